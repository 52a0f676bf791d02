//! Property tests of the host and disk tiers: random workloads on a tiny
//! host-backed simulated device (42–56 MiB: room for one pinned 20 MiB
//! segment and one more) with a tiny host tier (so tensors go to host
//! memory and to spill files and come back), under every built-in eviction
//! policy, a hostile one and `defrag`'s paged segments, with pins. After every step the invariants hold; every tensor brought back
//! (by a use, a read or a prefetch) has exactly the bytes written into it;
//! no request fails (at most one tensor is pinned and every segment fits the
//! device); no spill file outlives the allocator.

use proptest::prelude::*;
use wasmem::alloc::Allocator;
use wasmem::builtin;
use wasmem::decision::Policies;
use wasmem::decision::{EvictionCandidate, EvictionPolicy, PolicyContext, PolicyError};
use wasmem::device::sim::{SimConfig, SimDevice};
use wasmem::tier::TierConfig;
use wasmem::types::{Phase, StreamId, TensorId, TensorKind, Tier, MIB};

mod common;

use common::model::{action, pattern, Action, Coverage, Live, Mix};

fn mix() -> Mix {
    Mix {
        sizes: [1..4096, 4096..MIB, MIB..6 * MIB],
        streams: 2,
        use_streams: 2,
        free: 3,
        uses: 5,
        evict: 2,
        pin: 1,
        ..Mix::default()
    }
}

/// An eviction policy that answers wrongly in every way it can: the engine
/// must refuse or complete each answer and still lose nothing.
struct Hostile(u64);

impl EvictionPolicy for Hostile {
    fn name(&self) -> &str {
        "hostile"
    }
    fn choose_victims(
        &mut self,
        _need: u64,
        c: &[EvictionCandidate],
        _ctx: &PolicyContext,
    ) -> Result<Vec<TensorId>, PolicyError> {
        self.0 += 1;
        let first = c.first().map(|c| c.id);
        Ok(match self.0 % 5 {
            0 => return Err(PolicyError::Trap("boom".into())),
            1 => Vec::new(),                                      // short: completed by LRU
            2 => vec![TensorId { slot: 999_999, generation: 7 }], // never offered
            3 => first.into_iter().chain(first).collect(),        // listed twice
            _ => c.iter().filter(|c| c.pinned).map(|c| c.id).chain(first).collect(), // pinned first
        })
    }
    fn prefetch_order(&mut self, offloaded: &[EvictionCandidate], _: &PolicyContext) -> Option<Vec<TensorId>> {
        // Unknown and repeated ids: refused, the engine's order is used.
        let mut v: Vec<TensorId> = offloaded.iter().map(|c| c.id).collect();
        v.extend(v.clone());
        v.push(TensorId { slot: 123_456, generation: 1 });
        Some(v)
    }
}

/// The built-in eviction policies, the hostile one, and `defrag` (paged
/// segments: pages of shared chunks, spare pages, stitching, trimming).
fn policies(i: usize) -> Policies {
    match builtin::EVICTION_NAMES.get(i) {
        Some(name) => builtin::by_name(name).unwrap(),
        None if i == builtin::EVICTION_NAMES.len() => {
            Policies { eviction: Box::new(Hostile(0)), ..builtin::by_name("pytorch").unwrap() }
        }
        None => builtin::by_name("defrag").unwrap(),
    }
}

fn check_contents(a: &mut Allocator<SimDevice>, l: &Live) -> Result<(), TestCaseError> {
    l.check(a, Coverage::Full).map_err(TestCaseError::fail)
}

proptest! {
    // 48 cases by default; PROPTEST_CASES asks for more.
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(48),
        ..ProptestConfig::default()
    })]

    #[test]
    fn contents_survive_every_move(
        actions in prop::collection::vec(action(&mix()), 1..70),
        capacity_mib in 42u64..56,
        host_kib in prop_oneof![Just(0u64), 1u64..4096, Just(1 << 20)],
        policy in 0usize..5,
        prefetch in any::<bool>(),
    ) {
        run_moves(&actions, capacity_mib * MIB, host_kib, policies(policy), prefetch, 0)?;
    }

    /// `defrag` beside a pinned 1.25 GiB parameter (never touched): growths
    /// are chunks of several pages (one per growth), so trimmed and freed pages wait as spare pages while
    /// their chunks' other pages hold tensors, under eviction.
    #[test]
    fn chunks_and_spare_pages_survive_every_move(
        actions in prop::collection::vec(action(&mix()), 1..70),
        capacity_mib in 42u64..56,
        host_kib in prop_oneof![Just(0u64), 1u64..4096, Just(1 << 20)],
        prefetch in any::<bool>(),
    ) {
        let base = 1280 * MIB;
        run_moves(&actions, base + capacity_mib * MIB, host_kib, builtin::by_name("defrag").unwrap(), prefetch, base)?;
    }

}

/// Runs `actions` on a host-backed sim of `capacity` bytes with tiers (a
/// host tier of `host_kib` KiB, a spill directory), after allocating and
/// pinning a parameter of `base` bytes (none when 0; never written): after
/// every step the invariants hold and every tensor brought back has its
/// bytes; no request fails; no spill file outlives the allocator.
fn run_moves(
    actions: &[Action],
    capacity: u64,
    host_kib: u64,
    policies: Policies,
    prefetch: bool,
    base: u64,
) -> Result<(), TestCaseError> {
    let spill = tempfile::tempdir().unwrap();
    let dev = SimDevice::new(SimConfig { capacity, host_backed: true, ..SimConfig::default() });
    let mut a = Allocator::new(dev, policies);
    a.enable_tiers(TierConfig {
        host_capacity: host_kib * 1024,
        spill_dir: Some(spill.path().to_path_buf()),
        copy_contents: true,
        prefetch,
        prefetch_headroom: 0.0,
        ..TierConfig::default()
    });
    let mut live: Vec<Live> = Vec::new();
    let mut seed = 1u64;
    let mut moved_off = 0u64;
    if base > 0 {
        let id = a.alloc(base, TensorKind::Param, StreamId(0)).map_err(|e| TestCaseError::fail(e.to_string()))?;
        a.pin(id).unwrap();
    }
    for act in actions {
        match *act {
            Action::Alloc { bytes, kind, stream } => {
                let id = a
                    .alloc(bytes, TensorKind::ALL[kind], StreamId(stream))
                    .map_err(|e| TestCaseError::fail(format!("alloc of {bytes}: {e}")))?;
                seed += 1;
                let l = Live { id, bytes, seed };
                l.fill(&mut a, Coverage::Full);
                live.push(l);
            }
            Action::Free(i) if !live.is_empty() => {
                let l = live.swap_remove(i % live.len());
                a.free(l.id).unwrap();
            }
            Action::Use(i, s) if !live.is_empty() => {
                let l = live[i % live.len()];
                let id = l.id;
                let was = a.tier(id).unwrap();
                a.use_tensor(id, Some(StreamId(s))).map_err(|e| TestCaseError::fail(format!("use {id}: {e}")))?;
                prop_assert_eq!(a.tier(id).unwrap(), Tier::Device);
                if was != Tier::Device {
                    moved_off += 1;
                }
                check_contents(&mut a, &l)?;
            }
            Action::Evict(i) if !live.is_empty() => {
                let id = live[i % live.len()].id;
                a.evict(&[id]).unwrap();
                // A pinned tensor stays; anything else leaves the device.
                prop_assert_eq!(a.tier(id).unwrap() == Tier::Device, a.is_pinned(id));
            }
            Action::Pin(i) if !live.is_empty() => {
                // Pin one tensor (bringing it back) or unpin it; at most one pinned at a time
                // keeps every request servable.
                let l = live[i % live.len()];
                let id = l.id;
                if a.is_pinned(id) {
                    a.unpin(id).unwrap();
                } else if live.iter().all(|o| !a.is_pinned(o.id)) {
                    a.pin(id).map_err(|e| TestCaseError::fail(format!("pin {id}: {e}")))?;
                    prop_assert_eq!(a.tier(id).unwrap(), Tier::Device);
                    check_contents(&mut a, &l)?;
                }
            }
            Action::Phase(p) => a.phase(Phase::ALL[p], 0).unwrap(),
            _ => {}
        }
        a.check_invariants().map_err(|e| TestCaseError::fail(e.0))?;
    }
    prop_assert_eq!(a.stats().ooms, 0);
    // Every survivor, wherever it is, still has its bytes.
    for l in &live {
        check_contents(&mut a, l)?;
    }
    a.check_invariants().map_err(|e| TestCaseError::fail(e.0))?;
    let ts = a.tier_stats();
    prop_assert!(ts.peak_host_bytes <= host_kib * 1024);
    let _ = moved_off;
    drop(a);
    let left: Vec<_> = std::fs::read_dir(spill.path()).unwrap().collect();
    prop_assert!(left.is_empty(), "spill files left after shutdown: {left:?}");
    Ok(())
}

/// Frees remove spill files at once, not only at shutdown.
#[test]
fn free_removes_spill_files() {
    let spill = tempfile::tempdir().unwrap();
    let dev = SimDevice::new(SimConfig { capacity: 64 * MIB, host_backed: true, ..SimConfig::default() });
    let mut a = Allocator::new(dev, builtin::by_name("lru").unwrap());
    a.enable_tiers(TierConfig {
        host_capacity: 0,
        spill_dir: Some(spill.path().to_path_buf()),
        copy_contents: true,
        ..TierConfig::default()
    });
    let ids: Vec<TensorId> = (0..4).map(|_| a.alloc(3 * MIB, TensorKind::Activation, StreamId(0)).unwrap()).collect();
    for (k, &id) in ids.iter().enumerate() {
        a.write(id, 0, &pattern(k as u64, 0, (3 * MIB) as usize)).unwrap();
    }
    a.evict(&ids).unwrap();
    assert_eq!(std::fs::read_dir(spill.path()).unwrap().count(), 4);
    assert_eq!(a.tier_stats().disk_bytes, 12 * MIB);
    a.free(ids[0]).unwrap();
    a.free(ids[1]).unwrap();
    assert_eq!(std::fs::read_dir(spill.path()).unwrap().count(), 2);
    let mut out = vec![0u8; (3 * MIB) as usize];
    a.read(ids[2], 0, &mut out).unwrap();
    assert!(out == pattern(2, 0, (3 * MIB) as usize));
    assert_eq!(std::fs::read_dir(spill.path()).unwrap().count(), 1, "a tensor brought back leaves no file");
    a.check_invariants().unwrap();
    let ts = a.tier_stats();
    assert_eq!((ts.evictions, ts.disk_bytes, ts.fetched_bytes), (4, 3 * MIB, 3 * MIB));
    assert!(ts.stall_us > 0.0, "a bring-back from disk stalls the workload");
}

/// A prefetch at a phase boundary overlaps the copy with the workload: the
/// use that follows waits less than a bring-back on demand would.
#[test]
fn prefetch_overlaps_the_copy_with_the_workload() {
    let run = |prefetch: bool| {
        let dev = SimDevice::new(SimConfig { capacity: 128 * MIB, host_backed: true, ..SimConfig::default() });
        let mut a = Allocator::new(dev, builtin::by_name("lru").unwrap());
        a.enable_tiers(TierConfig { copy_contents: true, prefetch, prefetch_headroom: 0.0, ..TierConfig::default() });
        let x = a.alloc(8 * MIB, TensorKind::Activation, StreamId(0)).unwrap();
        a.write(x, 0, &pattern(9, 0, (8 * MIB) as usize)).unwrap();
        let big = a.alloc(32 * MIB, TensorKind::Activation, StreamId(0)).unwrap();
        a.evict(&[x]).unwrap();
        // The second forward is the first boundary whose phase ran before.
        for p in [Phase::Forward, Phase::Backward, Phase::Forward] {
            a.phase(p, 0).unwrap();
        }
        let before = a.tier_stats().stall_us;
        a.use_tensor(big, None).unwrap();
        a.use_tensor(x, None).unwrap();
        let mut out = vec![0u8; (8 * MIB) as usize];
        a.read(x, 0, &mut out).unwrap();
        assert!(out == pattern(9, 0, (8 * MIB) as usize));
        a.check_invariants().unwrap();
        (a.tier_stats().stall_us - before, a.stats().prefetched_bytes, a.tier_stats().fetched_bytes)
    };
    let (stall_on, prefetched, fetched_on) = run(true);
    let (stall_off, none, fetched_off) = run(false);
    assert_eq!((prefetched, fetched_on), (8 * MIB, 0));
    assert_eq!((none, fetched_off), (0, 8 * MIB));
    // 8 MiB at 25 GB/s is 335 µs; the 32 MiB use before it covers 168 µs of it.
    assert!(stall_off > 330.0 && stall_on < stall_off - 150.0, "stall with prefetch {stall_on}, without {stall_off}");
}
