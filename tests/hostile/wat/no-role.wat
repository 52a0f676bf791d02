;; A component that exports something, but no decision role of the
;; wasmem:policy package: the engine must refuse to load it as a policy.
(component
  (core module $m
    (func (export "answer") (result i32) i32.const 42))
  (core instance $i (instantiate $m))
  (func $answer (result u32) (canon lift (core func $i "answer")))
  (export "answer" (func $answer))
)
