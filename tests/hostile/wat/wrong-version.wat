;; A component that exports the placement interface of a future version of
;; the WIT package (wasmem:policy@9.0.0): the engine must refuse it, naming
;; the interface and the version it speaks.
(component
  (core module $m
    (func (export "name") (result i32) i32.const 0))
  (core instance $i (instantiate $m))
  (func $place (result u32) (canon lift (core func $i "name")))
  (instance $placement (export "place" (func $place)))
  (export "wasmem:policy/placement@9.0.0" (instance $placement))
)
