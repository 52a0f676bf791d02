//! The default decisions, as plain functions so that a policy can build on
//! them. They are the same decisions as the engine's built-in defaults
//! (`host/src/builtin/{pytorch,lru,planner}.rs`), decision for decision
//! (the planner's algorithm is the very code the engine runs:
//! `wasmem-plan-core`).

use alloc::string::ToString;
use alloc::vec;
use alloc::vec::Vec;

use crate::types::{
    AliasedPlan, ArenaPlan, EvictionCandidate, PlacementDecision, PlanRequest, PoolSpec, ReclaimDecision, ReclaimPlan,
    ReclaimTrigger, StepProfile,
};

/// Alignment of every planned offset, and the rounding of every planned request.
pub const PLAN_ALIGN: u64 = wasmem_plan_core::ALIGN;

/// A profile's request in the planning algorithm's plain type.
pub fn plan_request_core(r: &PlanRequest) -> wasmem_plan_core::Request {
    wasmem_plan_core::Request { bytes: r.bytes, freed_at: r.freed_at, wraps_to: r.wraps_to }
}

/// The bytes a planned block of `r` takes (its bytes rounded up to [`PLAN_ALIGN`]).
pub fn planned_bytes(r: &PlanRequest) -> u64 {
    plan_request_core(r).planned_bytes()
}

/// Whether request `k` of a profile (`r`) has a known lifetime in the
/// step's cycle, so that it can be planned: freed within the step, or live
/// at its end with `wraps-to ≤ k`.
pub fn plannable(r: &PlanRequest, k: u32) -> bool {
    plan_request_core(r).plannable(k)
}

/// The time intervals request `k` (`r`) of a step of `n` requests occupies
/// in the step's cycle: one, or two when it wraps (`[k, n)` and `[0, wraps-to)`).
pub fn plan_intervals(r: &PlanRequest, k: u32, n: u32) -> ([(u32, u32); 2], usize) {
    plan_request_core(r).intervals(k, n)
}

/// The engine's built-in plan of `profile` (`planned`): the cheapest of a
/// time-order best-fit plan and greedy-by-size plans over lifetime
/// intervals (`wasmem_plan_core::plan`) — the same code the engine runs, so
/// the same plan, offset for offset.
pub fn greedy_plan(profile: &StepProfile) -> ArenaPlan {
    let requests: Vec<wasmem_plan_core::Request> = profile.requests.iter().map(plan_request_core).collect();
    let p = wasmem_plan_core::plan(&requests);
    ArenaPlan { arena_bytes: p.arena_bytes, offsets: p.offsets }
}

/// The engine's built-in aliased plan of a profile of two like steps
/// (`wasmem_plan_core::aliased`, the code the engine runs), or `None` when
/// the profile is not two like steps or no request can be planned.
pub fn aliased_plan(profile: &StepProfile) -> Option<AliasedPlan> {
    let requests: Vec<wasmem_plan_core::Request> = profile.requests.iter().map(plan_request_core).collect();
    let p = wasmem_plan_core::aliased(&requests)?;
    Some(AliasedPlan { arena_bytes: p.arena_bytes, zone_bytes: p.zone_bytes, offsets: p.offsets })
}

/// `1 MiB`.
pub const MIB: u64 = 1 << 20;
/// PyTorch's minimum block size and rounding.
pub const MIN_BLOCK: u64 = 512;
/// Largest "small" request (after rounding).
pub const SMALL_SIZE: u64 = MIB;
/// Segment size of the small pool.
pub const SMALL_BUFFER: u64 = 2 * MIB;
/// Segment size for requests between 1 and 10 MiB.
pub const LARGE_BUFFER: u64 = 20 * MIB;
/// Requests from this size on get a segment of their own size.
pub const MIN_LARGE_ALLOC: u64 = 10 * MIB;
/// Rounding of segments.
pub const ROUND_LARGE: u64 = 2 * MIB;

/// A caching pool named `name`.
pub fn caching_pool(name: &str) -> PoolSpec {
    PoolSpec { name: name.to_string(), release_when_empty: false }
}

/// PyTorch's pools: `[small, large]`, both caching.
pub fn pytorch_pools() -> Vec<PoolSpec> {
    vec![caching_pool("small"), caching_pool("large")]
}

/// Rounds `x` up to a multiple of `to` (a power of two), or `None` on overflow.
pub fn round_up(x: u64, to: u64) -> Option<u64> {
    debug_assert!(to.is_power_of_two());
    x.checked_add(to - 1).map(|v| v & !(to - 1))
}

/// The log2 size class `[2^k, 2^(k+1))` of `bytes` as `(low, high)`; the
/// engine memoizes cacheable decisions per class (with kind, stream, phase).
pub fn size_class(bytes: u64) -> (u64, u64) {
    let low = if bytes == 0 { 0 } else { 1u64 << (63 - bytes.leading_zeros()) };
    (low, low.saturating_mul(2))
}

/// Whether the size class of `bytes` holds sizes on both sides of `boundary`
/// (sizes `< boundary` and sizes `≥ boundary`), so that one decision cannot
/// serve the whole class.
pub fn class_straddles(bytes: u64, boundary: u64) -> bool {
    let (low, high) = size_class(bytes);
    low < boundary && boundary < high
}

/// PyTorch CUDACachingAllocator's placement of a `bytes`-byte request into
/// [`pytorch_pools`]: round to 512 B; ≤ 1 MiB → `small`, 2 MiB segments,
/// split when ≥ 512 B remain; otherwise `large`, 20 MiB segments below 10 MiB
/// and segments of the request's own size (rounded to 2 MiB) from 10 MiB on,
/// split when more than 1 MiB remains. Not cacheable for the size classes
/// that straddle the 1 MiB or the 10 MiB boundary.
pub fn pytorch_placement(bytes: u64) -> PlacementDecision {
    let rounded = round_up(bytes, MIN_BLOCK).unwrap_or(u64::MAX);
    let (pool, segment_min, split_min_remainder) = if rounded <= SMALL_SIZE {
        (0, SMALL_BUFFER, MIN_BLOCK)
    } else if rounded < MIN_LARGE_ALLOC {
        (1, LARGE_BUFFER, SMALL_SIZE + 1)
    } else {
        (1, 0, SMALL_SIZE + 1)
    };
    PlacementDecision {
        pool,
        round_to: MIN_BLOCK,
        segment_min,
        segment_round: ROUND_LARGE,
        split_min_remainder,
        max_waste: u64::MAX,
        cacheable: !class_straddles(bytes, SMALL_SIZE + 1) && !class_straddles(bytes, MIN_LARGE_ALLOC),
    }
}

/// PyTorch's reclamation: release every cached segment when the device
/// refused a segment; release nothing before a pool grows or at phase markers.
pub fn pytorch_reclaim(trigger: &ReclaimTrigger) -> ReclaimDecision {
    ReclaimDecision {
        release_bytes: match trigger {
            ReclaimTrigger::AllocFailed(_) => u64::MAX,
            ReclaimTrigger::Grow(_) | ReclaimTrigger::Phase(_) => 0,
        },
        pools: None,
    }
}

/// A plan that releases what `d` releases and uses no other mechanism.
pub fn plan_of(d: ReclaimDecision) -> ReclaimPlan {
    ReclaimPlan { release_bytes: d.release_bytes, pools: d.pools, compact: None, stitch: false, trim: false }
}

/// The release part of a plan (what the 0.1.0 `reclaim` answer can carry).
pub fn release_of(p: ReclaimPlan) -> ReclaimDecision {
    ReclaimDecision { release_bytes: p.release_bytes, pools: p.pools }
}

/// Whether the engine may move `c` (neither in use nor pinned).
pub fn evictable(c: &EvictionCandidate) -> bool {
    !c.in_use && !c.pinned
}

/// Least recently used first: the evictable candidates in order of
/// `(last-use, id)`, until `need_bytes` are covered (all of them if they do
/// not cover it).
pub fn lru_victims(need_bytes: u64, candidates: &[EvictionCandidate]) -> Vec<u64> {
    let mut order: Vec<&EvictionCandidate> = candidates.iter().filter(|c| evictable(c)).collect();
    order.sort_by_key(|c| (c.last_use, c.id));
    take_until(need_bytes, order)
}

/// The ids of `ordered` candidates, in order, until their bytes cover
/// `need_bytes`.
pub fn take_until<'a>(need_bytes: u64, ordered: impl IntoIterator<Item = &'a EvictionCandidate>) -> Vec<u64> {
    let mut got = 0u64;
    let mut out = Vec::new();
    for c in ordered {
        if got >= need_bytes {
            break;
        }
        got = got.saturating_add(c.bytes);
        out.push(c.id);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::{AllocRequest, PhaseMarker, SegmentRequest, TensorKind, Tier};

    #[test]
    fn pytorch_size_classes() {
        let d = pytorch_placement(100);
        assert_eq!((d.pool, d.segment_min, d.split_min_remainder), (0, 2 * MIB, 512));
        assert_eq!(pytorch_placement(MIB).pool, 0);
        assert_eq!(pytorch_placement(MIB - 511).pool, 0);
        let d = pytorch_placement(MIB + 1);
        assert_eq!((d.pool, d.segment_min), (1, 20 * MIB));
        let d = pytorch_placement(10 * MIB);
        assert_eq!((d.pool, d.segment_min), (1, 0));
        assert_eq!(pytorch_placement(10 * MIB - 512).segment_min, 20 * MIB);
        assert_eq!(pytorch_placement(10 * MIB - 511).segment_min, 0);
        assert!(!pytorch_placement(9 * MIB).cacheable);
        assert!(!pytorch_placement(MIB + 100).cacheable);
        assert!(!pytorch_placement(MIB).cacheable);
        assert!(pytorch_placement(MIB - 1).cacheable);
        assert!(pytorch_placement(3 * MIB).cacheable);
        assert!(pytorch_placement(16 * MIB).cacheable);
        assert!(pytorch_placement(64).cacheable);
        assert_eq!(pytorch_placement(u64::MAX).pool, 1);
    }

    #[test]
    fn plans_and_releases_convert() {
        let d = ReclaimDecision { release_bytes: 5, pools: Some(vec!["large".to_string()]) };
        let p = plan_of(d.clone());
        assert_eq!((p.compact.is_none(), p.stitch, p.trim), (true, false, false));
        assert_eq!(release_of(p), d);
    }

    #[test]
    fn pytorch_reclamation() {
        let failed = ReclaimTrigger::AllocFailed(SegmentRequest {
            request: AllocRequest { bytes: 1, kind: TensorKind::Temp, stream_id: 0 },
            segment_bytes: 2 * MIB,
        });
        assert_eq!(pytorch_reclaim(&failed).release_bytes, u64::MAX);
        if let ReclaimTrigger::AllocFailed(r) = failed {
            assert_eq!(pytorch_reclaim(&ReclaimTrigger::Grow(r)).release_bytes, 0);
        }
        let phase = ReclaimTrigger::Phase(PhaseMarker { phase: crate::types::Phase::Backward, step: 3 });
        assert_eq!(pytorch_reclaim(&phase).release_bytes, 0);
    }

    fn cand(id: u64, bytes: u64, last_use: u64, in_use: bool) -> EvictionCandidate {
        EvictionCandidate {
            id,
            bytes,
            kind: TensorKind::Activation,
            tier: Tier::Device,
            last_use,
            use_count: 1,
            in_use,
            pinned: false,
        }
    }

    #[test]
    fn lru_order() {
        let c = [cand(1, 10, 5, false), cand(2, 10, 1, false), cand(3, 10, 0, true), cand(4, 10, 1, false)];
        assert_eq!(lru_victims(15, &c), vec![2, 4]);
        assert_eq!(lru_victims(100, &c), vec![2, 4, 1]);
        assert_eq!(lru_victims(0, &c), Vec::<u64>::new());
    }
}
