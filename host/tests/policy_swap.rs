//! Hot swap under load: threads allocate and free while another thread swaps
//! policies; no allocation fails or is served twice. State transfer and an
//! aborted swap.
#![cfg(feature = "wasm")]

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use wasmem::alloc::swap::{CarryState, SwapError, SwapOptions};
use wasmem::alloc::Allocator;
use wasmem::alloc::SharedAllocator;
use wasmem::builtin;
use wasmem::decision::Role;
use wasmem::device::sim::SimDevice;
use wasmem::types::{StreamId, TensorId, TensorKind, GIB};

#[test]
fn swapping_under_concurrent_allocation_loses_nothing() {
    let rt = common::relaxed_runtime();
    let pytorch = rt.load(need!(common::rust_policy("pytorch-like"))).unwrap();
    let lifecycle = rt.load(need!(common::rust_policy("lifecycle"))).unwrap();
    let hostile = rt.load(need!(common::hostile())).unwrap();
    let shared = SharedAllocator::new(Allocator::new(SimDevice::with_capacity(512 * GIB), builtin::default_policies()));
    let stop = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = (0..3u64)
        .map(|t| {
            let (shared, stop) = (shared.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut rng = 0x9e37_79b9_7f4a_7c15u64 ^ (t + 1);
                let mut live: Vec<TensorId> = Vec::new();
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) || n < 2000 {
                    rng ^= rng << 13;
                    rng ^= rng >> 7;
                    rng ^= rng << 17;
                    if live.is_empty() || (live.len() < 48 && rng.is_multiple_of(2)) {
                        let bytes = 1 + rng % (1 << (8 + rng % 20));
                        let kind = TensorKind::ALL[(rng % 6) as usize];
                        let id = shared.alloc(bytes, kind, StreamId((t % 2) as u32)).expect("no allocation fails");
                        live.push(id);
                    } else {
                        let id = live.swap_remove((rng % live.len() as u64) as usize);
                        shared.free(id).expect("a live tensor frees");
                    }
                    n += 1;
                }
                (live, n)
            })
        })
        .collect();
    let mut latencies = Vec::new();
    let mut carried = 0;
    for i in 0..60 {
        // Instantiate outside the allocator lock, then swap.
        let t0 = Instant::now();
        let (new, opts) = match i % 3 {
            0 => (lifecycle.instantiate("").unwrap(), SwapOptions::default()),
            1 => (pytorch.instantiate("").unwrap(), SwapOptions::default()),
            _ => (
                hostile.instantiate("mode=ok").unwrap(),
                SwapOptions { carry: CarryState::Never, ..Default::default() },
            ),
        };
        let (report, _) = shared.swap(new.resolved(), &opts).unwrap();
        latencies.push(t0.elapsed());
        carried += report.state_bytes.is_some() as u32;
        shared.with(|a| a.check_invariants()).unwrap();
        std::thread::sleep(Duration::from_millis(2));
    }
    stop.store(true, Ordering::Relaxed);
    let mut all = Vec::new();
    let mut ops = 0;
    for w in workers {
        let (live, n) = w.join().expect("worker panicked");
        all.extend(live);
        ops += n;
    }
    shared.with(|a| {
        a.check_invariants().unwrap();
        assert_eq!(a.live_tensors(), all.len(), "tensors lost or leaked");
        let mut addrs = HashMap::new();
        for id in &all {
            let addr = a.address(*id).expect("every live tensor resolves");
            assert!(addrs.insert(addr, *id).is_none(), "address served twice");
        }
        let s = a.stats();
        assert_eq!(s.policy_traps, 0);
        assert_eq!(a.policies().names()[0], "hostile");
    });
    latencies.sort();
    println!(
        "{ops} operations during 60 swaps; swap (instantiate + swap) median {:?}, max {:?}; {carried} state transfers",
        latencies[latencies.len() / 2],
        latencies[latencies.len() - 1]
    );
}

#[test]
fn state_is_carried_between_instances_of_the_same_policy() {
    let rt = common::relaxed_runtime();
    let hostile = rt.load(need!(common::hostile())).unwrap();
    let resolved =
        wasmem::policy::resolve_with(&rt, &format!("{}?mode=ok", hostile.path().unwrap().display())).unwrap();
    let shared = SharedAllocator::new(Allocator::new(SimDevice::with_capacity(64 * GIB), resolved.policies));
    for i in 0..5u32 {
        shared.alloc((1u64 << (10 + i)) + 1, TensorKind::Temp, StreamId(0)).unwrap();
    }
    let old = shared.state(Role::Placement).unwrap();
    assert_eq!(old.save_state().unwrap(), 5u64.to_le_bytes());
    let new = hostile.instantiate("mode=ok").unwrap();
    let (report, _) = shared.swap(new.resolved(), &SwapOptions::default()).unwrap();
    assert_eq!(report.state_bytes, Some(8));
    assert_eq!(report.roles, vec![Role::Placement, Role::Reclamation, Role::Eviction]);
    assert_eq!(new.save_state().unwrap(), 5u64.to_le_bytes(), "the count moved to the new instance");
    // `Never` starts fresh.
    let fresh = hostile.instantiate("mode=ok").unwrap();
    let (report, _) =
        shared.swap(fresh.resolved(), &SwapOptions { carry: CarryState::Never, ..Default::default() }).unwrap();
    assert_eq!(report.state_bytes, None);
    assert_eq!(fresh.save_state().unwrap(), 0u64.to_le_bytes());
    // Only one role.
    let one = hostile.instantiate("mode=ok").unwrap();
    let opts = SwapOptions { roles: Some(vec![Role::Eviction]), carry: CarryState::Always };
    let (report, _) = shared.swap(one.resolved(), &opts).unwrap();
    assert_eq!(report.roles, vec![Role::Eviction]);
    assert_eq!(shared.state(Role::Eviction).unwrap().save_state().unwrap(), 0u64.to_le_bytes());
}

#[test]
fn failing_load_state_aborts_the_swap_and_keeps_the_old_policy() {
    let rt = common::relaxed_runtime();
    let hostile = rt.load(need!(common::hostile())).unwrap();
    let pytorch = rt.load(need!(common::rust_policy("pytorch-like"))).unwrap();
    let shared = SharedAllocator::new(Allocator::new(SimDevice::with_capacity(64 * GIB), builtin::default_policies()));
    let first = hostile.instantiate("mode=ok").unwrap();
    shared.swap(first.resolved(), &SwapOptions::default()).unwrap();
    let ids: Vec<_> = (0..4u32).map(|i| shared.alloc(1 << (12 + i), TensorKind::Grad, StreamId(0)).unwrap()).collect();
    let bad = hostile.instantiate("mode=bad-state").unwrap();
    let err = shared.swap(bad.resolved(), &SwapOptions::default()).unwrap_err();
    assert!(matches!(err, SwapError::LoadState { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains("`hostile` stays") && msg.contains("refuses a state of 8 bytes"), "{msg}");
    // The old instance still serves every role, with its state.
    let still = shared.state(Role::Placement).unwrap();
    assert_eq!(still.save_state().unwrap(), 4u64.to_le_bytes());
    shared.alloc(12345, TensorKind::Temp, StreamId(0)).unwrap();
    assert_eq!(still.save_state().unwrap(), 5u64.to_le_bytes());
    // A role the new policy does not export is refused up front.
    let p = pytorch.instantiate("").unwrap();
    let err = shared
        .swap(p.resolved(), &SwapOptions { roles: Some(vec![Role::Eviction]), ..Default::default() })
        .unwrap_err();
    assert!(matches!(err, SwapError::MissingRole { role: Role::Eviction, .. }), "{err:?}");
    shared.with(|a| {
        a.check_invariants().unwrap();
        assert_eq!(a.live_tensors(), ids.len() + 1);
        assert_eq!(a.stats().policy_fallbacks, 0);
    });
}
