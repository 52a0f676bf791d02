//! Property tests of deferred frees and compaction on a host-backed simulated
//! device: random workloads with cross-stream uses, stream work (copies that
//! push stream clocks), host time, pins and forced compactions. After every
//! step: invariants hold, no tensor is lost, every live tensor's contents are
//! intact (so a move never corrupts one), a pending block keeps its contents
//! and is never handed out before its events complete, and a pinned tensor
//! never moves. The same workloads run again over paged segments with
//! stitching and trimming forced at every opportunity.

use proptest::prelude::*;
use wasmem::alloc::{AllocError, Allocator};
use wasmem::builtin::{self, LruEviction, PytorchPlacement, PytorchReclamation};
use wasmem::decision::Policies;
use wasmem::decision::{PolicyContext, PolicyError, ReclaimDecision, ReclaimTrigger, ReclamationPolicy};
use wasmem::device::sim::{SimConfig, SimCost, SimDevice};
use wasmem::device::Device;
use wasmem::types::{Phase, StreamId, TensorId, TensorKind, MIB};

mod common;

use common::model::{action, check_all, pattern, Action, Coverage, Live, Mix};

fn mix() -> Mix {
    Mix {
        sizes: [1..2048, 2048..2 * MIB, 2 * MIB..12 * MIB],
        kinds: 1,
        streams: 2,
        uses: 3,
        work: 2,
        advance: 1,
        compact: 2,
        pin: 1,
        unpin: 1,
        ..Mix::default()
    }
}

/// Asks for a compaction of the large pool, with a budget of all its bytes, on every phase.
struct CompactOnPhase;

impl ReclamationPolicy for CompactOnPhase {
    fn name(&self) -> &str {
        "compact-on-phase"
    }
    fn reclaim(&mut self, t: &ReclaimTrigger, ctx: &PolicyContext) -> Result<ReclaimDecision, PolicyError> {
        let mut d = PytorchReclamation.reclaim(t, ctx)?;
        if matches!(t, ReclaimTrigger::Phase { .. }) {
            // Budget = all allocated bytes: valid only while the large pool holds them all.
            d.compact = Some(("large".into(), ctx.allocated_bytes));
        }
        Ok(d)
    }
}

fn device() -> SimDevice {
    device_with(false)
}

/// The test device; with `maps_parts` false, a page per physical
/// allocation (a device that maps whole allocations only), so that a
/// trimmed page goes back to the device at once; with it true, a growth's
/// pages are one allocation (as on CUDA) and trimmed pages of an allocation
/// in use wait as spares.
fn device_with(maps_parts: bool) -> SimDevice {
    // Slow copies (1 MB/s) so that stream work keeps events pending for a while.
    let cost = SimCost { copy_gbps: 0.001, ..SimCost::default() };
    SimDevice::new(SimConfig { capacity: 96 * MIB, host_backed: true, cost, maps_parts, ..SimConfig::default() })
}

/// Paged segments: stitches every growth, trims half of the cache (page by
/// page) and compacts on every phase, releases everything on a failed device
/// allocation.
struct StitchTrimCompact;

impl ReclamationPolicy for StitchTrimCompact {
    fn name(&self) -> &str {
        "stitch-trim-compact"
    }
    fn paged_segments(&self) -> bool {
        true
    }
    fn reclaim(&mut self, t: &ReclaimTrigger, ctx: &PolicyContext) -> Result<ReclaimDecision, PolicyError> {
        Ok(match t {
            ReclaimTrigger::Grow { .. } => ReclaimDecision { stitch: true, ..ReclaimDecision::none() },
            ReclaimTrigger::AllocFailed { .. } => {
                ReclaimDecision { stitch: true, trim: true, ..ReclaimDecision::all() }
            }
            ReclaimTrigger::Phase { .. } => ReclaimDecision {
                release_bytes: (ctx.reserved_bytes - ctx.allocated_bytes) / 2,
                trim: true,
                compact: Some(("large".into(), ctx.allocated_bytes)),
                ..ReclaimDecision::none()
            },
        })
    }
}

fn allocator() -> Allocator<SimDevice> {
    allocator_with(false)
}

fn allocator_with(paged: bool) -> Allocator<SimDevice> {
    let reclamation: Box<dyn ReclamationPolicy> =
        if paged { Box::new(StitchTrimCompact) } else { Box::new(CompactOnPhase) };
    let p = Policies { placement: Box::new(PytorchPlacement), reclamation, eviction: Box::new(LruEviction) };
    Allocator::new(device(), p)
}

/// (address, expected head bytes) of freed tensors whose block is pending.
type Watched = Vec<(u64, Vec<u8>)>;

fn run(actions: Vec<Action>, paged: bool) {
    run_on(actions, paged, false, false)
}

/// [`run`] on a device whose growths are one allocation each (`chunks`),
/// and with `swap`, the reclamation swapped at every phase between the
/// paged one and one that does not page (spare pages then serve its
/// segments).
fn run_on(actions: Vec<Action>, paged: bool, chunks: bool, swap: bool) {
    let reclamation: Box<dyn ReclamationPolicy> =
        if paged { Box::new(StitchTrimCompact) } else { Box::new(CompactOnPhase) };
    let p = Policies { placement: Box::new(PytorchPlacement), reclamation, eviction: Box::new(LruEviction) };
    let mut a = Allocator::new(device_with(chunks), p);
    let mut paging = paged;
    let mut live: Vec<Live> = Vec::new();
    let mut watched: Watched = Vec::new();
    let mut seed = 0u64;
    for act in actions {
        match act {
            Action::Alloc { bytes, stream, .. } => {
                let before = a.pending_frees();
                match a.alloc(bytes, TensorKind::Activation, StreamId(stream)) {
                    Ok(id) => {
                        let t = a.tensor(id).unwrap();
                        for p in &before {
                            let done = p.events.iter().all(|&e| a.device_mut().event_done(e).unwrap_or(true));
                            let overlap = t.address < p.addr + p.size && p.addr < t.address + t.block_bytes;
                            assert!(done || !overlap, "a pending block was handed out before its events completed");
                        }
                        seed += 1;
                        let l = Live { id, bytes, seed };
                        l.fill(&mut a, Coverage::HeadAndTail);
                        live.push(l);
                    }
                    Err(AllocError::OutOfMemory { .. }) => {}
                    Err(e) => panic!("unexpected error {e}"),
                }
            }
            Action::Free(i) if !live.is_empty() => {
                let l = live.swap_remove(i % live.len());
                let addr = a.address(l.id).unwrap();
                let n = l.bytes.min(64) as usize;
                let head = pattern(l.seed, 0, n);
                a.free(l.id).unwrap();
                if a.pending_frees().iter().any(|p| p.addr == addr) {
                    watched.push((addr, head));
                }
            }
            Action::Use(i, s) if !live.is_empty() => {
                a.use_tensor(live[i % live.len()].id, Some(StreamId(s))).unwrap();
            }
            Action::Work(i, s) if !live.is_empty() => {
                let l = &live[i % live.len()];
                let addr = a.address(l.id).unwrap();
                a.device_mut().copy(addr, addr, l.bytes.min(4096), StreamId(s)).unwrap();
            }
            Action::Advance(us) => a.device_mut().advance(us as f64),
            Action::Phase(p) => {
                a.phase(Phase::ALL[p], 1).unwrap();
                if swap {
                    paging = !paging;
                    let next: Box<dyn ReclamationPolicy> =
                        if paging { Box::new(StitchTrimCompact) } else { Box::new(CompactOnPhase) };
                    a.set_reclamation(next);
                }
            }
            Action::Compact { large, budget_mib } => {
                let pinned: Vec<_> =
                    live.iter().filter(|l| a.is_pinned(l.id)).map(|l| (l.id, a.address(l.id).unwrap())).collect();
                let moved_before = a.stats().moved_bytes;
                let pool = if large { "large" } else { "small" };
                let moved = a.compact(pool, budget_mib * MIB).unwrap();
                assert!(moved <= budget_mib * MIB, "compaction exceeded its budget");
                assert_eq!(a.stats().moved_bytes, moved_before + moved);
                for (id, addr) in pinned {
                    assert_eq!(a.address(id).unwrap(), addr, "a pinned tensor moved");
                }
            }
            Action::Pin(i) if !live.is_empty() => a.pin(live[i % live.len()].id).unwrap(),
            Action::Unpin(i) if !live.is_empty() => a.unpin(live[i % live.len()].id).unwrap(),
            _ => {}
        }
        a.check_invariants().unwrap_or_else(|e| panic!("{e}"));
        a.device().check_invariants().unwrap();
        assert_eq!(a.live_tensors(), live.len(), "a tensor was lost");
        check_all(&mut a, &live, Coverage::HeadAndTail);
        // Pending blocks keep the bytes of the tensor freed into them.
        let pending = a.pending_frees();
        watched.retain(|(addr, _)| pending.iter().any(|p| p.addr == *addr));
        for (addr, head) in &watched {
            let mut got = vec![0u8; head.len()];
            a.device_mut().read(*addr, &mut got).unwrap();
            assert_eq!(&got, head, "a pending block at {addr:#x} was overwritten");
        }
    }
    for l in live.drain(..) {
        a.free(l.id).unwrap();
    }
    a.device_mut().synchronize().unwrap();
    a.poll_pending().unwrap();
    a.check_invariants().unwrap();
    assert_eq!(a.gauges().allocated_bytes, 0);
    assert_eq!(a.stats().pending_bytes, 0);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn deferred_frees_and_compaction(actions in prop::collection::vec(action(&mix()), 1..300)) { run(actions, false) }

    /// The same with paged segments, stitching on every growth and trimming
    /// on every phase: contents survive every cut and remap.
    #[test]
    fn stitching_and_trimming(actions in prop::collection::vec(action(&mix()), 1..300)) { run(actions, true) }

    /// The same where a growth's pages are one physical allocation (trimmed
    /// pages of one in use wait as spares), the reclamation swapped at every
    /// phase between paging and not: spare pages serve the segments of
    /// both, contents survive.
    #[test]
    fn chunks_spares_and_swaps(actions in prop::collection::vec(action(&mix()), 1..300)) {
        run_on(actions, true, true, true)
    }
}

#[test]
fn cross_stream_free_waits_for_the_other_stream() {
    let mut a = allocator();
    let x = a.alloc(MIB, TensorKind::Activation, StreamId(0)).unwrap();
    let addr = a.address(x).unwrap();
    a.use_tensor(x, Some(StreamId(1))).unwrap();
    // 4 KiB at 1 MB/s: stream 1 is busy for about 4 ms.
    a.device_mut().copy(addr, addr, 4096, StreamId(1)).unwrap();
    a.free(x).unwrap();
    let s = a.stats();
    assert_eq!((s.deferred_frees, s.pending_bytes), (1, MIB));
    assert_eq!(a.pending_frees().len(), 1);
    a.check_invariants().unwrap();
    let y = a.alloc(MIB, TensorKind::Activation, StreamId(0)).unwrap();
    assert_ne!(a.address(y).unwrap(), addr, "the pending block was reused too early");
    a.device_mut().advance(10_000.0);
    a.free(y).unwrap();
    let z = a.alloc(MIB, TensorKind::Activation, StreamId(0)).unwrap();
    assert!(a.pending_frees().is_empty());
    assert_eq!(a.stats().pending_bytes, 0);
    assert_eq!(a.address(z).unwrap(), addr, "the block returned to its pool once the event completed");
    a.check_invariants().unwrap();
}

#[test]
fn same_stream_and_idle_streams_free_at_once() {
    let mut a = Allocator::with_builtin(device(), "pytorch").unwrap();
    let x = a.alloc(MIB, TensorKind::Activation, StreamId(0)).unwrap();
    a.use_tensor(x, Some(StreamId(0))).unwrap();
    a.use_tensor(x, Some(StreamId(2))).unwrap();
    a.free(x).unwrap();
    assert_eq!(a.stats().deferred_frees, 0);
    a.check_invariants().unwrap();
}

/// Two segments of the large pool, each half full: compaction empties one.
#[test]
fn compaction_releases_a_segment_and_keeps_contents() {
    let mut a = Allocator::with_builtin(device(), "pytorch").unwrap();
    // 20 MiB requests get their own 20 MiB segments; 8 MiB ones share 20 MiB segments.
    let ids: Vec<_> = (0..4).map(|_| a.alloc(8 * MIB, TensorKind::Activation, StreamId(0)).unwrap()).collect();
    for (i, &id) in ids.iter().enumerate() {
        a.write(id, 0, &pattern(i as u64, 0, 4096)).unwrap();
    }
    let reserved = a.gauges().reserved_bytes;
    a.free(ids[1]).unwrap();
    a.free(ids[2]).unwrap();
    let moved = a.compact("large", 64 * MIB).unwrap();
    assert_eq!(moved, 8 * MIB);
    assert_eq!(a.gauges().reserved_bytes, reserved - 20 * MIB);
    for i in [0usize, 3] {
        let mut got = vec![0u8; 4096];
        a.read(ids[i], 0, &mut got).unwrap();
        assert_eq!(got, pattern(i as u64, 0, 4096));
    }
    let s = a.stats();
    assert_eq!((s.moved_bytes, s.compactions, s.gc_pauses), (8 * MIB, 1, 1));
    assert!(a.gc_pauses().max() > 0.0);
    a.check_invariants().unwrap();
    assert!(matches!(a.compact("nope", 1), Err(AllocError::UnknownPool(_))));
}

/// Five live 4 MiB tensors in one paged 20 MiB segment (10 pages), at its
/// pages 0, 2, 4, 6 and 8: a 20 MiB tensor's block, freed, serves them (a
/// growth maps only the request's own pages, so five growths would make five
/// segments).
fn five_in_one_segment(a: &mut Allocator<SimDevice>) -> Vec<TensorId> {
    let whole = a.alloc(20 * MIB, TensorKind::Activation, StreamId(0)).unwrap();
    a.free(whole).unwrap();
    let ids: Vec<_> = (0..5).map(|_| a.alloc(4 * MIB, TensorKind::Activation, StreamId(0)).unwrap()).collect();
    assert_eq!((a.gauges().reserved_bytes, a.gauges().segments), (20 * MIB, 1));
    ids
}

/// A compaction request naming a missing pool or too large a budget is refused,
/// counted as a fallback, and moves nothing.
#[test]
fn invalid_compaction_requests_are_refused() {
    struct Bad(u64);
    impl ReclamationPolicy for Bad {
        fn name(&self) -> &str {
            "bad-compact"
        }
        fn reclaim(&mut self, _: &ReclaimTrigger, _: &PolicyContext) -> Result<ReclaimDecision, PolicyError> {
            self.0 += 1;
            let compact = if self.0.is_multiple_of(2) { ("nope".into(), 1) } else { ("large".into(), u64::MAX) };
            Ok(ReclaimDecision { compact: Some(compact), ..ReclaimDecision::none() })
        }
    }
    let p = Policies { reclamation: Box::new(Bad(0)), ..builtin::by_name("pytorch").unwrap() };
    let mut a = Allocator::new(device(), p);
    let ids: Vec<_> = (0..4).map(|_| a.alloc(8 * MIB, TensorKind::Activation, StreamId(0)).unwrap()).collect();
    a.free(ids[1]).unwrap();
    a.free(ids[2]).unwrap();
    let f0 = a.stats().policy_fallbacks;
    a.phase(Phase::Backward, 1).unwrap();
    a.phase(Phase::Optimizer, 1).unwrap();
    let s = a.stats();
    assert_eq!(s.policy_fallbacks, f0 + 2);
    assert_eq!(s.moved_bytes, 0);
    a.check_invariants().unwrap();
}

/// Holes between live tensors serve a larger request: their pages are
/// stitched into a new segment with fresh pages only for the rest, the
/// segment they came from is cut around them, and no live tensor moves or
/// changes.
#[test]
fn stitching_reuses_the_pages_of_holes() {
    let mut a = allocator_with(true);
    // Five 4 MiB tensors share one paged 20 MiB segment (10 pages): the
    // cached block of a 20 MiB tensor serves them (a growth maps only the
    // request's own pages).
    let ids = five_in_one_segment(&mut a);
    let addrs: Vec<_> = ids.iter().map(|&id| a.address(id).unwrap()).collect();
    for (i, &id) in ids.iter().enumerate() {
        a.write(id, 0, &pattern(i as u64, 0, 4096)).unwrap();
    }
    assert_eq!((a.gauges().reserved_bytes, a.gauges().segments), (20 * MIB, 1));
    a.free(ids[1]).unwrap();
    a.free(ids[3]).unwrap();
    // 8 MiB fits no 4 MiB hole: the growth (the policy's segment is 20 MiB;
    // its 4 pages are mapped now) takes the holes' four pages, no fresh one.
    let calls = a.stats().device_alloc_calls;
    let big = a.alloc(8 * MIB, TensorKind::Activation, StreamId(0)).unwrap();
    a.write(big, 8 * MIB - 4096, &pattern(99, 0, 4096)).unwrap();
    let s = a.stats();
    assert_eq!((s.stitches, s.stitched_bytes, s.device_alloc_calls), (1, 8 * MIB, calls));
    assert_eq!(a.gauges().reserved_bytes, 20 * MIB, "the holes' pages, not 8 MiB more");
    assert_eq!(a.gauges().segments, 4, "the first segment is cut in three around the holes");
    for i in [0usize, 2, 4] {
        assert_eq!(a.address(ids[i]).unwrap(), addrs[i], "a live tensor moved");
        let mut got = vec![0u8; 4096];
        a.read(ids[i], 0, &mut got).unwrap();
        assert_eq!(got, pattern(i as u64, 0, 4096));
    }
    let mut got = vec![0u8; 4096];
    a.read(big, 8 * MIB - 4096, &mut got).unwrap();
    assert_eq!(got, pattern(99, 0, 4096));
    a.check_invariants().unwrap();
    a.device().check_invariants().unwrap();
    // Trimming gives free pages back without a device synchronization.
    a.free(ids[2]).unwrap();
    let syncs = a.stats().device_syncs;
    let released =
        a.release_cached(&ReclaimDecision { release_bytes: u64::MAX, trim: true, ..ReclaimDecision::none() });
    assert!(released.unwrap() >= 4 * MIB);
    assert!(a.stats().trimmed_bytes >= 4 * MIB);
    assert_eq!(a.stats().device_syncs, syncs);
    a.check_invariants().unwrap();
    a.device().check_invariants().unwrap();
    for id in [ids[0], ids[4], big] {
        a.free(id).unwrap();
    }
    a.release_cached(&ReclaimDecision::all()).unwrap();
    assert_eq!((a.gauges().reserved_bytes, a.gauges().segments), (0, 0));
    assert_eq!(a.device().counters().used_bytes, 0, "every page and reservation went back");
    a.check_invariants().unwrap();
}

/// A host-backed sim of `capacity` bytes (a big tensor's host memory is
/// never touched) with PyTorch's placement, stitching, trimming and LRU.
fn stitching_allocator(capacity: u64) -> Allocator<SimDevice> {
    let dev = SimDevice::new(SimConfig { capacity, host_backed: true, ..SimConfig::default() });
    let p = Policies {
        placement: Box::new(PytorchPlacement),
        reclamation: Box::new(StitchTrimCompact),
        eviction: Box::new(LruEviction),
    };
    Allocator::new(dev, p)
}

/// Both invariants hold, and the even-numbered tensors of `ids` still begin
/// with their pattern (the odd ones were freed).
/// Spare pages left by a policy that pages serve the segments of one that
/// does not (as after a hot swap) before the device is asked: a transient's
/// growth is one allocation from the first byte, its trimmed holes wait as
/// spares, and the next policy's growth maps them instead of allocating.
#[test]
fn spare_pages_serve_a_policy_that_does_not_page() {
    let mut a = stitching_allocator(256 * MIB);
    let ids = five_in_one_segment(&mut a);
    assert_eq!(a.stats().device_alloc_calls, 1, "ten pages of a transient, one device call");
    tag_and_trim_holes(&mut a, &ids);
    assert_eq!(a.device().counters().used_bytes, 20 * MIB);
    // The `pytorch` reclamation asks for no paged segment.
    a.set_reclamation(Box::new(PytorchReclamation));
    let big = a.alloc(8 * MIB, TensorKind::Activation, StreamId(0)).unwrap();
    a.write(big, 0, &pattern(9, 0, 8 * MIB as usize)).unwrap();
    assert_eq!(a.stats().device_alloc_calls, 1, "the four spare pages, no device call");
    assert_eq!(a.device().counters().used_bytes, 20 * MIB);
    free_all_checked(&mut a, &ids, big, 9);
    assert_eq!((a.gauges().reserved_bytes, a.device().counters().used_bytes), (0, 0));
    assert_eq!(a.stats().device_free_calls, 1, "the allocation goes back whole");
}

/// Tags the five tensors of one allocation, frees the second and fourth and
/// trims their pages: the allocation still holds three tensors, so the
/// device gets nothing back and the pages stay reserved (spare).
fn tag_and_trim_holes(a: &mut Allocator<SimDevice>, ids: &[TensorId]) {
    for (i, &id) in ids.iter().enumerate() {
        a.write(id, 0, &pattern(i as u64, 0, 4096)).unwrap();
    }
    a.free(ids[1]).unwrap();
    a.free(ids[3]).unwrap();
    let released =
        a.release_cached(&ReclaimDecision { release_bytes: u64::MAX, trim: true, ..ReclaimDecision::none() }).unwrap();
    assert_eq!(released, 0, "nothing went back to the device");
}

/// Checks the even tensors of `ids` and `big` (tagged with `pattern(seed)`),
/// frees them and gives every cached byte back.
fn free_all_checked(a: &mut Allocator<SimDevice>, ids: &[TensorId], big: TensorId, seed: u64) {
    check_even_tensors(a, ids);
    let len = a.tensor(big).unwrap().bytes as usize;
    let mut got = vec![0u8; len];
    a.read(big, 0, &mut got).unwrap();
    assert_eq!(got, pattern(seed, 0, len));
    for id in [ids[0], ids[2], ids[4], big] {
        a.free(id).unwrap();
    }
    a.release_cached(&ReclaimDecision::all()).unwrap();
    a.check_invariants().unwrap();
    a.device().check_invariants().unwrap();
}

fn check_even_tensors(a: &mut Allocator<SimDevice>, ids: &[TensorId]) {
    a.check_invariants().unwrap();
    a.device().check_invariants().unwrap();
    for (i, &id) in ids.iter().enumerate().filter(|&(i, _)| i % 2 == 0) {
        let mut got = vec![0u8; 4096];
        a.read(id, 0, &mut got).unwrap();
        assert_eq!(got, pattern(i as u64, 0, 4096), "tensor {i}");
    }
}

/// A growth's pages are one physical allocation (one device call, as a
/// `cudaMalloc` would be), however large; a trimmed page of an allocation
/// whose other pages hold tensors stays reserved as a spare page, the next
/// growth takes it without a device call, and the allocation goes back to
/// the device once none of its pages is in use. Contents survive every step.
/// (The other tests here use a device that maps whole allocations only: a
/// page at a time.)
#[test]
fn a_growth_is_one_device_allocation_and_its_trimmed_pages_wait_as_spares() {
    let mut a = stitching_allocator(2048 * MIB);
    let base = a.alloc(1280 * MIB, TensorKind::Param, StreamId(0)).unwrap();
    assert_eq!(a.stats().device_alloc_calls, 1, "640 pages, one device call");
    let whole = a.alloc(20 * MIB, TensorKind::Activation, StreamId(0)).unwrap();
    a.free(whole).unwrap();
    let ids: Vec<_> = (0..5).map(|_| a.alloc(4 * MIB, TensorKind::Activation, StreamId(0)).unwrap()).collect();
    assert_eq!(a.stats().device_alloc_calls, 2, "ten pages, one device call");
    assert_eq!(a.device().counters().alloc_calls, 2);
    tag_and_trim_holes(&mut a, &ids);
    assert_eq!(a.gauges().reserved_bytes, 1300 * MIB, "16 MiB in segments and 4 spare pages");
    assert_eq!(a.device().counters().used_bytes, 1300 * MIB);
    assert_eq!(a.stats().device_free_calls, 0);
    a.check_invariants().unwrap();
    a.device().check_invariants().unwrap();
    // A 6 MiB growth takes the four spare pages (no device call) into a new
    // segment: the memory reserved does not grow.
    let big = a.alloc(6 * MIB, TensorKind::Activation, StreamId(0)).unwrap();
    a.write(big, 0, &pattern(7, 0, 6 * MIB as usize)).unwrap();
    assert_eq!(a.stats().device_alloc_calls, 2, "spare pages, no device call");
    assert_eq!(a.device().counters().used_bytes, 1300 * MIB);
    // Everything freed and given back: the allocation goes, in one call.
    free_all_checked(&mut a, &ids, big, 7);
    assert_eq!(a.gauges().reserved_bytes, 1280 * MIB);
    assert_eq!(a.device().counters().used_bytes, 1280 * MIB);
    assert_eq!(a.stats().device_free_calls, 1);
    a.free(base).unwrap();
    a.release_cached(&ReclaimDecision::all()).unwrap();
    assert_eq!((a.gauges().reserved_bytes, a.gauges().segments), (0, 0));
    assert_eq!(a.device().counters().used_bytes, 0, "every page and reservation went back");
}

/// A parameter's small growth is one device allocation of up to 20 MiB (at
/// most half the bytes reserved, PyTorch's segment for requests of 1–10
/// MiB): the next parameters take its spare pages without a device call,
/// and the activations after them take what is left before the device is
/// asked, so the peak holds no spare page. Activations alone grow by their
/// own pages, a call each. Contents survive every step.
#[test]
fn parameters_grow_in_shared_allocations_whose_spare_pages_the_next_growths_take() {
    // A tensor freed first: the run is past loading, only parameters get slack.
    let run = |kind: TensorKind| {
        let mut a = stitching_allocator(512 * MIB);
        let t = a.alloc(512, TensorKind::Temp, StreamId(0)).unwrap();
        a.free(t).unwrap();
        a.release_cached(&ReclaimDecision::all()).unwrap();
        assert_eq!((a.stats().device_alloc_calls, a.gauges().reserved_bytes), (1, 0));
        let mut ids = vec![a.alloc(16 * MIB, kind, StreamId(0)).unwrap()];
        ids.extend((0..8).map(|_| a.alloc(4 * MIB, kind, StreamId(0)).unwrap()));
        (a, ids)
    };
    let (control, _) = run(TensorKind::Activation);
    assert_eq!(control.stats().device_alloc_calls, 1 + 9, "a call per growth");
    assert_eq!(control.gauges().reserved_bytes, 48 * MIB);
    let (mut a, mut ids) = run(TensorKind::Param);
    // 16 MiB: nothing reserved before, no slack. The first 4 MiB: two
    // pages and 4 spare (half of 16 MiB), taken by the next two; the
    // fourth: two and 7 spare (half of 28 MiB), taken by the next three
    // and half of the eighth, whose other page comes with 9 spare (ten
    // pages in all).
    assert_eq!(a.stats().device_alloc_calls, 1 + 4);
    assert_eq!(a.gauges().reserved_bytes, (48 + 18) * MIB, "the live bytes and 9 spare pages");
    let calls = a.stats().device_alloc_calls;
    // Activations take the spare pages first (four of 4 MiB), then grow:
    // the fifth takes the last spare page and one from the device.
    for i in 0..4 {
        ids.push(a.alloc(4 * MIB, TensorKind::Activation, StreamId(0)).unwrap());
        assert_eq!(a.stats().device_alloc_calls, calls, "activation {i}: spare pages, no device call");
        assert_eq!(a.gauges().reserved_bytes, 66 * MIB);
    }
    ids.push(a.alloc(4 * MIB, TensorKind::Activation, StreamId(0)).unwrap());
    assert_eq!(a.stats().device_alloc_calls, calls + 1);
    assert_eq!(a.gauges().reserved_bytes, 68 * MIB, "no spare page left at the peak");
    assert_eq!(a.gauges().peak_reserved_bytes, 68 * MIB);
    tag_and_check(&mut a, &ids);
    for &id in &ids {
        a.free(id).unwrap();
    }
    a.release_cached(&ReclaimDecision::all()).unwrap();
    assert_eq!((a.gauges().reserved_bytes, a.device().counters().used_bytes), (0, 0));
    assert_eq!(a.stats().device_free_calls, a.stats().device_alloc_calls, "every allocation went back whole");
}

/// Tags each tensor of `ids` with its pattern, checks both invariants,
/// then reads every pattern back.
fn tag_and_check(a: &mut Allocator<SimDevice>, ids: &[TensorId]) {
    for (i, &id) in ids.iter().enumerate() {
        a.write(id, 0, &pattern(i as u64, 0, 4096)).unwrap();
    }
    a.check_invariants().unwrap();
    a.device().check_invariants().unwrap();
    for (i, &id) in ids.iter().enumerate() {
        let mut got = vec![0u8; 4096];
        a.read(id, 0, &mut got).unwrap();
        assert_eq!(got, pattern(i as u64, 0, 4096), "tensor {i}");
    }
}

/// Before the run's first free a growth of no known kind loads (a
/// snapshot's tensors older than its window): a small one takes a chunk of
/// up to 20 MiB, by at most an eighth of the bytes reserved; after it, only
/// parameters do (activations never, before it either:
/// `defrag_keeps_activations_that_are_not_whole_pages_in_growing_segments`).
#[test]
fn growths_before_the_first_free_share_allocations_too() {
    let mut a = stitching_allocator(512 * MIB);
    let mut ids = vec![a.alloc(64 * MIB, TensorKind::Other, StreamId(0)).unwrap()];
    assert_eq!((a.stats().device_alloc_calls, a.gauges().reserved_bytes), (1, 64 * MIB), "32 pages: no slack");
    // Two pages and 4 spare (an eighth of 64 MiB), taken by the next two.
    for i in 0..3 {
        ids.push(a.alloc(4 * MIB, TensorKind::Other, StreamId(0)).unwrap());
        assert_eq!((a.stats().device_alloc_calls, a.gauges().reserved_bytes), (2, 76 * MIB), "tensor {i}");
    }
    a.free(ids.pop().unwrap()).unwrap();
    ids.push(a.alloc(4 * MIB, TensorKind::Other, StreamId(0)).unwrap());
    assert_eq!(a.stats().device_alloc_calls, 2, "the freed block again");
    ids.push(a.alloc(4 * MIB, TensorKind::Other, StreamId(0)).unwrap());
    assert_eq!((a.stats().device_alloc_calls, a.gauges().reserved_bytes), (3, 80 * MIB), "past loading: its own pages");
    tag_and_check(&mut a, &ids);
}

/// A parameter's larger growth that the device cannot hold is made at its
/// own size (no OOM), and a device that maps whole allocations only gets
/// no slack (a page at a time, as before).
#[test]
fn a_parameter_growth_too_large_for_the_device_is_made_exact() {
    let mut a = stitching_allocator(24 * MIB);
    a.alloc(16 * MIB, TensorKind::Param, StreamId(0)).unwrap();
    // Two pages and four spare would take 28 MiB of 24.
    let p = a.alloc(4 * MIB, TensorKind::Param, StreamId(0)).unwrap();
    a.write(p, 0, &pattern(3, 0, 4096)).unwrap();
    assert_eq!((a.stats().ooms, a.gauges().reserved_bytes), (0, 20 * MIB));
    assert_eq!(a.stats().device_alloc_calls, 2);
    a.check_invariants().unwrap();
    a.device().check_invariants().unwrap();
    let p = Policies {
        placement: Box::new(PytorchPlacement),
        reclamation: Box::new(StitchTrimCompact),
        eviction: Box::new(LruEviction),
    };
    let dev =
        SimDevice::new(SimConfig { capacity: 96 * MIB, host_backed: true, maps_parts: false, ..SimConfig::default() });
    let mut a = Allocator::new(dev, p);
    a.alloc(16 * MIB, TensorKind::Param, StreamId(0)).unwrap();
    a.alloc(4 * MIB, TensorKind::Param, StreamId(0)).unwrap();
    assert_eq!(a.gauges().reserved_bytes, 20 * MIB, "no spare page");
    assert_eq!(a.stats().device_alloc_calls, 10, "a page at a time");
}

/// The built-in `defrag` set stitches and never synchronizes the device.
#[test]
fn builtin_defrag_stitches_without_syncs() {
    let mut a = Allocator::with_builtin(device(), "defrag").unwrap();
    let ids: Vec<_> = (0..5).map(|_| a.alloc(4 * MIB, TensorKind::Activation, StreamId(0)).unwrap()).collect();
    a.free(ids[1]).unwrap();
    a.free(ids[3]).unwrap();
    a.alloc(8 * MIB, TensorKind::Activation, StreamId(0)).unwrap();
    a.phase(Phase::StepEnd, 1).unwrap();
    let s = a.stats();
    assert!(s.stitches >= 1 && s.paged_segments >= 1, "{s:?}");
    assert_eq!(s.device_syncs, 0);
    a.check_invariants().unwrap();
}

/// A growth whose pool has a paged segment ending in a free block maps the
/// new pages right after that segment — whole free pages of holes first (a
/// stitch's pages), then fresh ones — so the request starts in the free end
/// of the last, partly used page instead of leaving it beside a new segment.
#[test]
fn a_segment_ending_in_a_free_block_grows_in_place_with_the_pages_of_holes() {
    let mut a = allocator_with(true);
    // Five 4 MiB tensors share one paged 20 MiB segment.
    let ids = five_in_one_segment(&mut a);
    a.free(ids[1]).unwrap();
    // 11 MiB takes the hole's two pages and four fresh ones (a 12 MiB
    // segment); the 1 MiB left at its end is split off (PyTorch's placement
    // keeps remainders of 1 MiB inside the block).
    let first = a.alloc(11 * MIB, TensorKind::Activation, StreamId(0)).unwrap();
    assert_eq!((a.stats().stitches, a.gauges().reserved_bytes), (1, 28 * MIB));
    a.free(ids[3]).unwrap();
    // 13 MiB: a new segment would be 7 pages (two of them the new hole's);
    // the 1 MiB free end plus 6 pages (the hole's two, four fresh) hold it.
    let calls = a.stats().device_alloc_calls;
    let second = a.alloc(13 * MIB, TensorKind::Activation, StreamId(0)).unwrap();
    assert_eq!(a.address(second).unwrap(), a.address(first).unwrap() + 11 * MIB, "not in place");
    assert_eq!((a.stats().stitches, a.stats().stitched_bytes), (2, 8 * MIB));
    assert_eq!(a.stats().device_alloc_calls, calls + 4);
    assert_eq!(a.gauges().reserved_bytes, 36 * MIB, "28 - 4 carved + 12, not + 14");
    for (i, &id) in [ids[0], ids[2], ids[4], first, second].iter().enumerate() {
        let len = a.tensor(id).unwrap().bytes as usize;
        a.write(id, 0, &pattern(i as u64, 0, len)).unwrap();
    }
    for (i, &id) in [ids[0], ids[2], ids[4], first, second].iter().enumerate() {
        let len = a.tensor(id).unwrap().bytes as usize;
        let mut got = vec![0u8; len];
        a.read(id, 0, &mut got).unwrap();
        assert_eq!(got, pattern(i as u64, 0, len), "tensor {i}");
    }
    a.check_invariants().unwrap();
    a.device().check_invariants().unwrap();
    for id in [ids[0], ids[2], ids[4], first, second] {
        a.free(id).unwrap();
    }
    a.release_cached(&ReclaimDecision::all()).unwrap();
    assert_eq!((a.gauges().reserved_bytes, a.gauges().segments), (0, 0));
    assert_eq!(a.device().counters().used_bytes, 0, "every page and reservation went back");
    a.check_invariants().unwrap();
}

/// `defrag` keeps large activations that are not whole pages (ViT's
/// 197-token ones) one after another in growing segments: each extension
/// starts in the free end of the last one's last page, so the reserved
/// bytes stay within a page of the live ones (each in its own segment,
/// every one would waste its last page's free part: 30 × 1.5 MiB here).
#[test]
fn defrag_keeps_activations_that_are_not_whole_pages_in_growing_segments() {
    let dev = SimDevice::new(SimConfig { capacity: 4096 * MIB, ..SimConfig::default() });
    let mut a = Allocator::with_builtin(dev, "defrag").unwrap();
    let bytes = 12 * MIB + 512 * 1024;
    let ids: Vec<_> = (0..30).map(|_| a.alloc(bytes, TensorKind::Activation, StreamId(0)).unwrap()).collect();
    let g = a.gauges();
    assert_eq!(g.live_bytes, 30 * bytes);
    assert!(g.reserved_bytes < g.live_bytes + 2 * MIB, "reserved {} for live {}", g.reserved_bytes, g.live_bytes);
    // A segment grows while that saves a page: three extensions (free ends
    // of 1.5, 1 and 0.5 MiB), then a new one.
    assert!(g.segments <= 8, "{} segments", g.segments);
    let in_place = ids.windows(2).filter(|w| a.address(w[1]).unwrap() == a.address(w[0]).unwrap() + bytes).count();
    assert!(in_place >= 22, "{in_place} of 29 in place");
    a.check_invariants().unwrap();
}

/// Spare pages count as room when eviction decides how much to move off:
/// a growth that spare pages nearly cover evicts only what they lack (they
/// were once left out: under a memory cap `defrag` evicted up to 3.6 % more).
#[test]
fn eviction_counts_spare_pages_as_room() {
    let mut a = stitching_allocator(1300 * MIB);
    a.enable_tiers(wasmem::tier::TierConfig { copy_contents: true, prefetch: false, ..Default::default() });
    let base = a.alloc(1280 * MIB, TensorKind::Param, StreamId(0)).unwrap();
    // One 20 MiB segment of one chunk, then five tensors in it.
    let whole = a.alloc(20 * MIB, TensorKind::Activation, StreamId(0)).unwrap();
    a.free(whole).unwrap();
    let ids: Vec<_> = (0..5).map(|_| a.alloc(4 * MIB, TensorKind::Activation, StreamId(0)).unwrap()).collect();
    assert_eq!(a.device().counters().used_bytes, 1300 * MIB, "the device is full");
    for (i, &id) in ids.iter().enumerate() {
        a.write(id, 0, &pattern(i as u64, 0, 4096)).unwrap();
    }
    a.write(base, 0, &pattern(9, 0, 4096)).unwrap();
    for &id in &ids {
        a.use_tensor(id, None).unwrap();
    }
    a.use_tensor(base, None).unwrap();
    a.free(ids[1]).unwrap();
    a.free(ids[3]).unwrap();
    a.release_cached(&ReclaimDecision { release_bytes: u64::MAX, trim: true, ..ReclaimDecision::none() }).unwrap();
    // 8 MiB of spare pages, nothing free on the device: a 12 MiB growth
    // lacks 4 MiB, one tensor's worth.
    let big = a.alloc(12 * MIB, TensorKind::Activation, StreamId(0)).unwrap();
    a.write(big, 0, &pattern(7, 0, 12 * MIB as usize)).unwrap();
    assert_eq!(a.tier_stats().evictions, 1, "one 4 MiB tensor moved off, not two");
    check_even_tensors(&mut a, &ids);
    let mut got = vec![0u8; 4096];
    a.read(base, 0, &mut got).unwrap();
    assert_eq!(got, pattern(9, 0, 4096));
}
