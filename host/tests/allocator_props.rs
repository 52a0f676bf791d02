//! Property tests: random alloc / free / use / phase sequences against every
//! built-in policy (and a faulty one) on a small host-backed simulated device.
//! After every step: invariants hold, no tensor is lost or corrupted, the
//! statistics agree with an independent recount, and a failed request leaves
//! every live tensor where it was.

use proptest::prelude::*;
use wasmem::alloc::{AllocError, Allocator};
use wasmem::builtin::{self, LruEviction, PytorchReclamation};
use wasmem::decision::Policies;
use wasmem::decision::{
    AllocRequest, PlacementDecision, PlacementPolicy, PolicyContext, PolicyError, PoolSpec, ReclaimDecision,
    ReclaimTrigger, ReclamationPolicy,
};
use wasmem::device::sim::{SimConfig, SimDevice};
use wasmem::types::{Phase, StreamId, TensorId, TensorKind, MIB};

mod common;

use common::model::{action, check_all, Action, Coverage, Live, Mix};

fn mix() -> Mix {
    Mix { bad: 1, ..Mix::default() }
}

/// A placement policy that answers wrongly in every way it can.
struct Chaos(u64);

impl PlacementPolicy for Chaos {
    fn name(&self) -> &str {
        "chaos"
    }
    fn pools(&self) -> Vec<PoolSpec> {
        vec![PoolSpec::caching("chaos")]
    }
    fn place(&mut self, req: &AllocRequest, _: &PolicyContext) -> Result<PlacementDecision, PolicyError> {
        self.0 += 1;
        let good = PlacementDecision {
            pool: 0,
            round_to: 512,
            segment_min: 2 * MIB,
            segment_round: 2 * MIB,
            split_min_remainder: 512,
            max_waste: u64::MAX,
            cacheable: false,
        };
        match (self.0 + req.bytes) % 6 {
            0 => Err(PolicyError::Trap("boom".into())),
            1 => Ok(PlacementDecision { pool: 7, ..good }),
            2 => Ok(PlacementDecision { round_to: 3, ..good }),
            3 => Ok(PlacementDecision { split_min_remainder: 0, ..good }),
            _ => Ok(good),
        }
    }
}

/// A reclamation policy that names pools that do not exist half the time.
struct BadReclaim(u64);

impl ReclamationPolicy for BadReclaim {
    fn name(&self) -> &str {
        "bad-reclaim"
    }
    fn reclaim(&mut self, _: &ReclaimTrigger, _: &PolicyContext) -> Result<ReclaimDecision, PolicyError> {
        self.0 += 1;
        if self.0.is_multiple_of(2) {
            Ok(ReclaimDecision {
                release_bytes: u64::MAX,
                pools: Some(vec!["nope".into()]),
                compact: None,
                stitch: false,
                trim: false,
            })
        } else {
            Ok(ReclaimDecision { release_bytes: 4 * MIB, pools: None, compact: None, stitch: false, trim: false })
        }
    }
}

fn policies(name: &str) -> Policies {
    match name {
        "chaos" => Policies {
            placement: Box::new(Chaos(0)),
            reclamation: Box::new(BadReclaim(0)),
            eviction: Box::new(LruEviction),
        },
        "chaos-default-reclaim" => Policies {
            placement: Box::new(Chaos(3)),
            reclamation: Box::new(PytorchReclamation),
            eviction: Box::new(LruEviction),
        },
        n => builtin::by_name(n).unwrap(),
    }
}

fn run(name: &str, actions: Vec<Action>) {
    let dev = SimDevice::new(SimConfig { capacity: 96 * MIB, host_backed: true, ..SimConfig::default() });
    let mut a = Allocator::new(dev, policies(name));
    a.set_planner(builtin::planner_by_name(name));
    let mut live: Vec<Live> = Vec::new();
    let mut freed: Vec<TensorId> = Vec::new();
    let mut seed = 0u64;
    for act in actions {
        match act {
            Action::Alloc { bytes, kind, stream } => {
                let before: Vec<_> = live.iter().map(|l| a.tensor(l.id).unwrap()).collect();
                let g = *a.gauges();
                match a.alloc(bytes, TensorKind::ALL[kind], StreamId(stream)) {
                    Ok(id) => {
                        seed += 1;
                        let l = Live { id, bytes, seed };
                        l.fill(&mut a, Coverage::HeadAndTail);
                        live.push(l);
                    }
                    Err(AllocError::OutOfMemory { .. }) => {
                        let after: Vec<_> = live.iter().map(|l| a.tensor(l.id).unwrap()).collect();
                        assert_eq!(before, after, "an OOM moved a live tensor");
                        assert_eq!(g.live_bytes, a.gauges().live_bytes);
                        assert_eq!(g.allocated_bytes, a.gauges().allocated_bytes);
                        check_all(&mut a, &live, Coverage::HeadAndTail);
                    }
                    Err(e) => panic!("unexpected error {e}"),
                }
            }
            Action::Free(i) if !live.is_empty() => {
                let l = live.swap_remove(i % live.len());
                a.free(l.id).unwrap();
                freed.push(l.id);
            }
            Action::Use(i, s) if !live.is_empty() => {
                a.use_tensor(live[i % live.len()].id, Some(StreamId(s))).unwrap();
            }
            Action::Phase(p) => a.phase(Phase::ALL[p], 1).unwrap(),
            Action::Bad(k) => {
                let g = *a.gauges();
                let stale = freed.last().copied().unwrap_or(TensorId { slot: 999_999, generation: 0 });
                let r = match k {
                    0 => a.alloc(0, TensorKind::Temp, StreamId(0)).map(|_| ()),
                    1 => a.alloc(u64::MAX - 5, TensorKind::Temp, StreamId(0)).map(|_| ()),
                    2 => a.free(stale),
                    _ => a.use_tensor(stale, None),
                };
                assert!(r.is_err(), "bad call {k} succeeded");
                assert_eq!(g, *a.gauges(), "bad call {k} changed the state");
            }
            _ => {}
        }
        a.check_invariants().unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(a.live_tensors(), live.len(), "a tensor was lost");
        let recount: u64 = live.iter().map(|l| l.bytes).sum();
        assert_eq!(a.gauges().live_bytes, recount);
        let s = a.stats();
        assert_eq!(s.allocs - s.frees, live.len() as u64);
    }
    check_all(&mut a, &live, Coverage::HeadAndTail);
    for l in live.drain(..) {
        a.free(l.id).unwrap();
    }
    a.check_invariants().unwrap();
    assert_eq!(a.gauges().allocated_bytes, 0);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn naive(actions in prop::collection::vec(action(&mix()), 1..300)) { run("naive", actions) }

    #[test]
    fn pytorch(actions in prop::collection::vec(action(&mix()), 1..300)) { run("pytorch", actions) }

    #[test]
    fn lifecycle(actions in prop::collection::vec(action(&mix()), 1..300)) { run("lifecycle", actions) }

    #[test]
    fn planned(actions in prop::collection::vec(action(&mix()), 1..300)) { run("planned", actions) }

    #[test]
    fn faulty_policies(actions in prop::collection::vec(action(&mix()), 1..300)) { run("chaos", actions) }

    #[test]
    fn faulty_placement(actions in prop::collection::vec(action(&mix()), 1..300)) { run("chaos-default-reclaim", actions) }
}

#[test]
fn faulty_policy_is_counted() {
    let mut a = Allocator::new(SimDevice::with_capacity(1 << 30), policies("chaos"));
    let mut ids = Vec::new();
    for i in 0..200u64 {
        ids.push(a.alloc(1000 + i * 512, TensorKind::Temp, StreamId(0)).unwrap());
        a.check_invariants().unwrap();
    }
    let s = a.stats();
    assert!(s.policy_fallbacks >= 3);
    let h = a.policies().health(wasmem::decision::Role::Placement);
    // Good answers in between reset the count of consecutive failures.
    assert!(!h.disabled);
    assert!(h.last_error.as_deref().is_some_and(|e| e.contains("invalid decision")), "{:?}", h.last_error);
    for id in ids {
        a.free(id).unwrap();
    }
    a.check_invariants().unwrap();
}

#[test]
fn oom_is_an_error_value() {
    let mut a = Allocator::with_builtin(SimDevice::with_capacity(64 * MIB), "pytorch").unwrap();
    let x = a.alloc(40 * MIB, TensorKind::Activation, StreamId(0)).unwrap();
    let before = a.tensor(x).unwrap();
    let e = a.alloc(30 * MIB, TensorKind::Activation, StreamId(0)).unwrap_err();
    assert!(matches!(e, AllocError::OutOfMemory { .. }));
    assert!(e.to_string().contains("out of memory: activation request of 31457280 bytes"), "{e}");
    assert_eq!(a.tensor(x).unwrap(), before);
    assert_eq!(a.stats().ooms, 1);
    // Cached memory is released to satisfy a request that fits after reclaim.
    a.free(x).unwrap();
    let y = a.alloc(50 * MIB, TensorKind::Activation, StreamId(0)).unwrap();
    assert_eq!(a.stats().device_free_calls, 1);
    a.free(y).unwrap();
    a.check_invariants().unwrap();
}

#[test]
fn bad_input_is_refused_without_change() {
    let mut a = Allocator::with_builtin(SimDevice::with_capacity(64 * MIB), "lifecycle").unwrap();
    let g = a.stats();
    assert!(matches!(a.alloc(0, TensorKind::Param, StreamId(0)), Err(AllocError::ZeroSize { .. })));
    assert!(matches!(a.alloc(u64::MAX, TensorKind::Param, StreamId(0)), Err(AllocError::TooLarge { .. })));
    assert!(matches!(a.alloc(u64::MAX / 2, TensorKind::Param, StreamId(0)), Err(AllocError::TooLarge { .. })));
    let x = a.alloc(100, TensorKind::Param, StreamId(0)).unwrap();
    a.free(x).unwrap();
    let after_free = a.stats();
    assert_eq!(a.free(x), Err(AllocError::UnknownTensor(x)));
    assert_eq!(a.use_tensor(x, None), Err(AllocError::UnknownTensor(x)));
    let never = TensorId { slot: 12345, generation: 7 };
    assert_eq!(a.free(never), Err(AllocError::UnknownTensor(never)));
    assert_eq!(a.stats(), after_free);
    assert_eq!(g.allocs + 1, after_free.allocs);
    // A stale handle never resolves to the tensor that reuses its slot.
    let y = a.alloc(100, TensorKind::Param, StreamId(0)).unwrap();
    assert_eq!(y.slot, x.slot);
    assert!(a.tensor(x).is_none());
    assert!(a.tensor(y).is_some());
    // Out-of-bounds accesses are refused.
    let mut buf = [0u8; 8];
    assert!(matches!(a.read(y, 96, &mut buf), Err(AllocError::OutOfBounds { .. })));
    assert!(matches!(a.read(y, u64::MAX, &mut buf), Err(AllocError::OutOfBounds { .. })));
}

/// A placement policy that always traps.
struct AlwaysTrap;

impl PlacementPolicy for AlwaysTrap {
    fn name(&self) -> &str {
        "always-trap"
    }
    fn pools(&self) -> Vec<PoolSpec> {
        vec![]
    }
    fn place(&mut self, _: &AllocRequest, _: &PolicyContext) -> Result<PlacementDecision, PolicyError> {
        Err(PolicyError::Trap("unreachable executed".into()))
    }
}

#[test]
fn traps_are_counted_until_disabled() {
    let p = Policies {
        placement: Box::new(AlwaysTrap),
        reclamation: Box::new(PytorchReclamation),
        eviction: Box::new(LruEviction),
    };
    let mut a = Allocator::new(SimDevice::with_capacity(1 << 30), p);
    a.policies_mut().max_consecutive_failures = 5;
    let ids: Vec<_> = (0..20).map(|_| a.alloc(4096, TensorKind::Grad, StreamId(0)).unwrap()).collect();
    let s = a.stats();
    assert_eq!((s.policy_calls, s.policy_traps, s.policy_fallbacks), (5, 5, 20));
    assert_eq!(ids.len(), a.live_tensors());
    a.check_invariants().unwrap();
}
