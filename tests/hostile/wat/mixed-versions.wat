;; A component that exports `lifecycle` of WIT 0.1.0 and `placement` of
;; 0.2.0: the engine must refuse it, naming both interfaces.
(component
  (core module $m
    (func (export "name") (result i32) i32.const 0))
  (core instance $i (instantiate $m))
  (func $name (result u32) (canon lift (core func $i "name")))
  (instance $lifecycle (export "name" (func $name)))
  (instance $placement (export "place" (func $name)))
  (export "wasmem:policy/lifecycle@0.1.0" (instance $lifecycle))
  (export "wasmem:policy/placement@0.2.0" (instance $placement))
)
