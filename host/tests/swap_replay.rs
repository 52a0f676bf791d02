//! A policy swapped mid-replay: the second half runs under the new policy,
//! the halves are reported separately, and memory cached by the old policy's
//! pools is not stranded.

use wasmem::alloc::Allocator;
use wasmem::builtin;
use wasmem::device::sim::SimDevice;
use wasmem::model::ModelSpec;
use wasmem::replay::{replay_split, ReplayConfig, Split};
use wasmem::spec::{resolve, Builtins};
use wasmem::synth::synth;

#[test]
fn swapped_policies_do_not_strand_memory() {
    let spec = ModelSpec { steps: 3, ..ModelSpec::preset("gpt2-124m").expect("preset") };
    let events = synth(&spec).expect("valid");
    let at = events.len() as u64 / 2;
    for (from, to) in [("lifecycle", "pytorch"), ("pytorch", "lifecycle"), ("naive", "lifecycle")] {
        let cfg = ReplayConfig::default();
        let alloc = Allocator::new(SimDevice::new(cfg.device), builtin::by_name(from).expect("built-in"));
        let next = resolve(to, &Builtins).expect("built-in");
        let split = Split { at, to: next, opts: Default::default() };
        let (r, halves) = replay_split(events.iter().cloned().map(Ok::<_, String>), alloc, &cfg, |_| {}, Some(split))
            .expect("replay");
        r.allocator.check_invariants().expect("invariants");
        let h = halves.expect("split inside the trace");
        assert_eq!(h.first.events + h.second.events, r.metrics.events);
        assert_eq!(h.first.allocs + h.second.allocs, r.metrics.allocs);
        assert_eq!(r.allocator.policies().names()[0], to);
        let ratio = h.second.peak_reserved_bytes as f64 / h.second.peak_live_bytes as f64;
        eprintln!("{from} → {to}: first half {:.4}, second half {ratio:.4}", h.first.overhead_ratio);
        assert!(ratio < 1.10, "{from} → {to}: second half overhead {ratio:.4}: memory stranded in the old pools");
    }
}
