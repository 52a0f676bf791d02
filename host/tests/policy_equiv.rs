//! The WebAssembly `pytorch-like` policy decides exactly like the native
//! `pytorch` policy: call by call over random requests, and over whole
//! allocator runs (same addresses, same statistics).
#![cfg(feature = "wasm")]

mod common;

use wasmem::alloc::Allocator;
use wasmem::builtin::{self, LruEviction, PytorchPlacement, PytorchReclamation};
use wasmem::decision::Policies;
use wasmem::decision::{AllocRequest, PlacementPolicy, PolicyContext, ReclaimTrigger, ReclamationPolicy, Role};
use wasmem::device::sim::SimDevice;
use wasmem::types::{Phase, StreamId, TensorId, TensorKind, GIB, MIB};

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

fn request(rng: &mut Rng) -> AllocRequest {
    let bits = 1 + rng.next() % 36;
    let bytes = 1 + rng.next() % (1u64 << bits);
    let kind = TensorKind::ALL[(rng.next() % 6) as usize];
    AllocRequest { bytes, kind, stream: StreamId((rng.next() % 3) as u32) }
}

#[test]
fn wasm_pytorch_like_equals_native_decision_for_decision() {
    let rt = common::relaxed_runtime();
    let path = need!(common::rust_policy("pytorch-like"));
    let p = rt.load(&path).unwrap().instantiate("").unwrap();
    let mut wasm = p.placement().unwrap();
    let mut wasm_reclaim = p.reclamation().unwrap();
    assert_eq!(wasm.pools(), PytorchPlacement.pools());
    let mut rng = Rng(0x1234_5678_9abc_def1);
    let edges = [1, 511, 512, 513, MIB - 1, MIB, MIB + 1, 10 * MIB - 1, 10 * MIB, 10 * MIB + 1, 1 << 50];
    let mut n = 0;
    for i in 0..200_000u64 {
        let mut req = request(&mut rng);
        if i < edges.len() as u64 {
            req.bytes = edges[i as usize];
        }
        let ctx = PolicyContext { clock: i, ..Default::default() };
        let native = PytorchPlacement.place(&req, &ctx).unwrap();
        let got = wasm.place(&req, &ctx).unwrap();
        assert_eq!(got, native, "request {req:?}");
        n += 1;
    }
    for (i, t) in [
        ReclaimTrigger::Phase { phase: Phase::Backward, step: 3 },
        ReclaimTrigger::AllocFailed { request: request(&mut rng), segment_bytes: 20 * MIB },
        ReclaimTrigger::Grow { request: request(&mut rng), segment_bytes: 2 * MIB },
    ]
    .iter()
    .enumerate()
    {
        let ctx = PolicyContext { clock: i as u64, ..Default::default() };
        assert_eq!(wasm_reclaim.reclaim(t, &ctx).unwrap(), PytorchReclamation.reclaim(t, &ctx).unwrap());
    }
    assert_eq!(p.failures(), 0);
    println!("{n} placement decisions identical");
}

/// Drives two allocators with the same random workload; returns nothing but
/// asserts that every step agrees.
fn lockstep(a: &mut Allocator<SimDevice>, b: &mut Allocator<SimDevice>, steps: usize, seed: u64) {
    let mut rng = Rng(seed);
    let mut live: Vec<(TensorId, TensorId)> = Vec::new();
    for step in 0..steps {
        match rng.next() % 10 {
            0..=4 => {
                let req = request(&mut rng);
                let bytes = req.bytes % (256 * MIB) + 1;
                let (x, y) = (a.alloc(bytes, req.kind, req.stream), b.alloc(bytes, req.kind, req.stream));
                assert_eq!(x.is_ok(), y.is_ok(), "step {step}");
                if let (Ok(x), Ok(y)) = (x, y) {
                    assert_eq!(a.address(x).unwrap(), b.address(y).unwrap(), "step {step}");
                    live.push((x, y));
                }
            }
            5..=8 if !live.is_empty() => {
                let (x, y) = live.swap_remove((rng.next() % live.len() as u64) as usize);
                a.free(x).unwrap();
                b.free(y).unwrap();
            }
            _ => {
                let phase = Phase::ALL[(rng.next() % 4) as usize];
                a.phase(phase, step as u64).unwrap();
                b.phase(phase, step as u64).unwrap();
            }
        }
    }
    a.check_invariants().unwrap();
    b.check_invariants().unwrap();
}

#[test]
fn wasm_pytorch_like_drives_the_allocator_like_native() {
    let rt = common::relaxed_runtime();
    let path = need!(common::rust_policy("pytorch-like"));
    let p = rt.load(&path).unwrap().instantiate("").unwrap();
    let wasm = Policies {
        placement: Box::new(p.placement().unwrap()),
        reclamation: Box::new(p.reclamation().unwrap()),
        eviction: Box::new(LruEviction),
    };
    // Small capacity so that reclamation after failed device allocations happens.
    let mut a = Allocator::new(SimDevice::with_capacity(2 * GIB), wasm);
    let mut b = Allocator::new(SimDevice::with_capacity(2 * GIB), builtin::default_policies());
    lockstep(&mut a, &mut b, 50_000, 42);
    let (sa, sb) = (a.stats(), b.stats());
    assert_eq!(sa.allocs, sb.allocs);
    assert_eq!(sa.ooms, sb.ooms);
    assert_eq!(sa.device_alloc_calls, sb.device_alloc_calls);
    assert_eq!(sa.device_free_calls, sb.device_free_calls);
    assert_eq!(a.gauges(), b.gauges());
    assert_eq!(sa.policy_fallbacks, 0);
    assert_eq!(sa.policy_traps, 0);
    assert!(sa.policy_memo_hits > 0, "cacheable decisions are memoized");
    let placement_calls = a.policies().health(Role::Placement).calls;
    assert!(placement_calls < sa.allocs / 2, "memo hits never enter WebAssembly: {placement_calls} placement calls");
    println!(
        "allocs {} ooms {} policy calls {} memo hits {}",
        sa.allocs, sa.ooms, sa.policy_calls, sa.policy_memo_hits
    );
}
