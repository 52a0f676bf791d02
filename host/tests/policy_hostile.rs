//! The hostile corpus against the engine: for each misbehaviour the engine
//! keeps serving, the counters say exactly what happened, the invariants
//! hold, no tensor is lost, and the error names the policy and the cause.
#![cfg(feature = "wasm")]

mod common;

use std::collections::HashSet;
use std::time::Duration;

use wasmem::alloc::Allocator;
use wasmem::builtin::{LruEviction, PytorchPlacement, PytorchReclamation};
use wasmem::decision::Policies;
use wasmem::decision::Role;
use wasmem::device::sim::SimDevice;
use wasmem::policy::{Limits, Runtime, WasmPolicy};
use wasmem::types::{Phase, StreamId, TensorId, TensorKind, GIB};

/// The hostile policy in `mode` serving `role`; the built-in defaults serve
/// the other roles.
fn hostile_as(rt: &Runtime, config: &str, role: Role) -> Option<(WasmPolicy, Allocator<SimDevice>)> {
    let path = common::hostile()?;
    let p = rt.load(&path).unwrap().instantiate(config).unwrap_or_else(|e| panic!("{e}"));
    let mut policies = Policies {
        placement: Box::new(PytorchPlacement),
        reclamation: Box::new(PytorchReclamation),
        eviction: Box::new(LruEviction),
    };
    match role {
        Role::Placement => policies.placement = Box::new(p.placement().unwrap()),
        Role::Reclamation => policies.reclamation = Box::new(p.reclamation().unwrap()),
        Role::Eviction => policies.eviction = Box::new(p.eviction().unwrap()),
    }
    Some((p, Allocator::new(SimDevice::with_capacity(64 * GIB), policies)))
}

/// The hostile policy in `mode` as the placement policy.
fn hostile(rt: &Runtime, config: &str) -> Option<(WasmPolicy, Allocator<SimDevice>)> {
    hostile_as(rt, config, Role::Placement)
}

/// `n` allocations of distinct memo keys (one log2 size class each), so that
/// every one consults the policy exactly once unless it is disabled.
fn alloc_distinct(a: &mut Allocator<SimDevice>, n: u32) -> Vec<TensorId> {
    (0..n)
        .map(|i| {
            let id = a.alloc((1u64 << (9 + i)) + 3, TensorKind::Temp, StreamId(0)).expect("the engine keeps serving");
            a.check_invariants().unwrap();
            id
        })
        .collect()
}

/// Every tensor is live at its own address.
fn none_lost(a: &Allocator<SimDevice>, ids: &[TensorId]) {
    a.check_invariants().unwrap();
    assert_eq!(a.live_tensors(), ids.len());
    let addrs: HashSet<_> = ids.iter().map(|id| a.address(*id).expect("tensor lost")).collect();
    assert_eq!(addrs.len(), ids.len(), "two tensors share an address");
}

#[test]
fn infinite_loop_hits_the_deadline() {
    // The default limits: 1 ms deadline by epoch interruption.
    let rt = common::runtime_with(Limits::default(), "default");
    let (p, mut a) = need!(hostile(&rt, "mode=loop"));
    let ids = alloc_distinct(&mut a, 12);
    none_lost(&a, &ids);
    let h = a.policies().health(Role::Placement).clone();
    assert_eq!((h.calls, h.traps, h.fallbacks), (8, 8, 12), "{h:?}");
    assert!(h.disabled, "disabled after 8 consecutive failures");
    assert_eq!(h.last_error.as_deref(), Some("deadline exceeded"));
    assert_eq!(a.policies().names()[0], "hostile");
    assert_eq!(p.failures(), 8);
    assert_eq!(p.reinstantiations(), 7, "re-instantiated before each call after a failure");
}

#[test]
fn fuel_exhaustion_is_classified() {
    let rt = common::runtime_with(Limits { deadline: None, fuel: Some(200_000), ..Limits::default() }, "fuel");
    let (_p, mut a) = need!(hostile(&rt, "mode=loop"));
    a.policies_mut().max_consecutive_failures = 0;
    let ids = alloc_distinct(&mut a, 3);
    none_lost(&a, &ids);
    let h = a.policies().health(Role::Placement);
    assert_eq!((h.calls, h.traps, h.fallbacks), (3, 3, 3), "{h:?}");
    assert_eq!(h.last_error.as_deref(), Some("out of fuel"));
}

#[test]
fn memory_growth_stops_at_the_cap() {
    let rt = common::runtime_with(
        Limits { deadline: Some(Duration::from_secs(5)), max_memory: 16 << 20, ..Limits::default() },
        "mem16",
    );
    let (p, mut a) = need!(hostile(&rt, "mode=grow"));
    a.policies_mut().max_consecutive_failures = 0;
    let ids = alloc_distinct(&mut a, 3);
    none_lost(&a, &ids);
    let h = a.policies().health(Role::Placement);
    assert_eq!((h.calls, h.traps, h.fallbacks), (3, 3, 3), "{h:?}");
    assert_eq!(h.last_error.as_deref(), Some("memory limit exceeded"));
    assert!(p.memory_bytes() <= 16 << 20);
}

#[test]
fn trap_on_the_nth_call_loses_state_and_recovers() {
    let rt = common::relaxed_runtime();
    let (p, mut a) = need!(hostile(&rt, "mode=trap-nth n=3"));
    let ids = alloc_distinct(&mut a, 10);
    none_lost(&a, &ids);
    let h = a.policies().health(Role::Placement).clone();
    // The counter restarts with every re-instantiation: calls 3, 6 and 9 trap.
    assert_eq!((h.calls, h.traps, h.fallbacks), (10, 3, 3), "{h:?}");
    assert!(!h.disabled);
    let err = h.last_error.unwrap();
    assert!(err.contains("policy `hostile`") && err.contains("traps on call 3"), "{err}");
    assert_eq!(p.reinstantiations(), 3);
    assert_eq!(a.stats().policy_traps, 3);
}

#[test]
fn out_of_range_pool_is_refused() {
    let rt = common::relaxed_runtime();
    let (p, mut a) = need!(hostile(&rt, "mode=bad-pool"));
    let ids = alloc_distinct(&mut a, 12);
    none_lost(&a, &ids);
    let h = a.policies().health(Role::Placement).clone();
    assert_eq!((h.calls, h.traps, h.fallbacks), (8, 0, 12), "{h:?}");
    assert!(h.disabled);
    assert!(h.last_error.unwrap().contains("pool 7 does not exist"));
    assert_eq!(p.reinstantiations(), 0, "an invalid answer is not a trap");
}

#[test]
fn invalid_rounding_is_refused() {
    let rt = common::relaxed_runtime();
    let (_p, mut a) = need!(hostile(&rt, "mode=bad-round"));
    a.policies_mut().max_consecutive_failures = 0;
    let ids = alloc_distinct(&mut a, 5);
    none_lost(&a, &ids);
    let h = a.policies().health(Role::Placement);
    assert_eq!((h.calls, h.traps, h.fallbacks), (5, 0, 5), "{h:?}");
    assert!(h.last_error.as_deref().unwrap().contains("round_to = 3"));
}

#[test]
fn inconsistent_victims_are_refused() {
    let rt = common::relaxed_runtime();
    let (_p, mut a) = need!(hostile_as(&rt, "mode=bad-victims", Role::Eviction));
    let ids = alloc_distinct(&mut a, 6);
    for (i, id) in ids.iter().enumerate() {
        for _ in 0..i {
            a.use_tensor(*id, None).unwrap();
        }
    }
    let victims = a.choose_victims(1);
    // The default (LRU) decided: the least recently used tensor.
    assert_eq!(victims, vec![ids[0]]);
    let h = a.policies().health(Role::Eviction);
    assert_eq!((h.calls, h.traps, h.fallbacks), (1, 0, 1), "{h:?}");
    assert!(h.last_error.as_deref().unwrap().contains("was not offered"), "{h:?}");
    none_lost(&a, &ids);
}

#[test]
fn unknown_reclaim_pool_is_refused() {
    let rt = common::relaxed_runtime();
    let (_p, mut a) = need!(hostile_as(&rt, "mode=bad-reclaim", Role::Reclamation));
    let ids = alloc_distinct(&mut a, 4);
    let before = a.policies().health(Role::Reclamation).clone();
    for (step, phase) in Phase::ALL.into_iter().enumerate() {
        a.phase(phase, step as u64).unwrap();
    }
    let h = a.policies().health(Role::Reclamation);
    // Consulted at each phase marker (and, before, when pools had to grow).
    assert_eq!((h.calls - before.calls, h.traps, h.fallbacks - before.fallbacks), (4, 0, 4), "{h:?}");
    assert_eq!(h.calls, h.fallbacks, "every answer was refused");
    assert!(h.last_error.as_deref().unwrap().contains("`no-such-pool` does not exist"));
    none_lost(&a, &ids);
}

#[test]
fn invalid_compactions_are_refused_and_nothing_moves() {
    let rt = common::relaxed_runtime();
    for (mode, reason) in [
        ("mode=bad-compact", "compaction of pool `no-such-pool`, which does not exist"),
        ("mode=huge-compact", "compaction budget 18446744073709551615 exceeds pool `large`'s"),
    ] {
        let (_p, mut a) = need!(hostile_as(&rt, mode, Role::Reclamation));
        let ids = alloc_distinct(&mut a, 4);
        let before = a.policies().health(Role::Reclamation).clone();
        for (step, phase) in Phase::ALL.into_iter().enumerate() {
            a.phase(phase, step as u64).unwrap();
        }
        let h = a.policies().health(Role::Reclamation);
        assert_eq!((h.calls - before.calls, h.traps, h.fallbacks - before.fallbacks), (4, 0, 4), "{mode}: {h:?}");
        assert!(h.last_error.as_deref().unwrap().contains(reason), "{mode}: {h:?}");
        assert_eq!(a.stats().moved_bytes, 0, "{mode}");
        none_lost(&a, &ids);
    }
}

#[test]
fn a_well_behaved_mode_counts_nothing() {
    let rt = common::relaxed_runtime();
    let (p, mut a) = need!(hostile(&rt, "mode=ok"));
    let ids = alloc_distinct(&mut a, 10);
    none_lost(&a, &ids);
    let s = a.stats();
    assert_eq!((s.policy_traps, s.policy_fallbacks), (0, 0));
    assert_eq!(p.save_state().unwrap(), 10u64.to_le_bytes().to_vec(), "state counts the decisions");
}
