//! Allocator statistics.
//!
//! Invariants (checked by `Allocator::check_invariants` against a recount):
//! - `reserved_bytes = Σ segment sizes`, per pool and in total;
//! - `allocated_bytes = Σ sizes of blocks holding a tensor`;
//! - `live_bytes = Σ requested bytes of live tensors`;
//! - `live ≤ allocated ≤ reserved`, and every `peak_*` ≥ its current value;
//! - `pending_bytes = Σ sizes of blocks waiting on stream events` and
//!   `allocated + pending ≤ reserved`.

use serde::Serialize;

/// Byte gauges with their peaks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Gauges {
    /// Requested bytes of live tensors.
    pub live_bytes: u64,
    /// Peak of `live_bytes`.
    pub peak_live_bytes: u64,
    /// Bytes of blocks holding tensors (after rounding).
    pub allocated_bytes: u64,
    /// Peak of `allocated_bytes`.
    pub peak_allocated_bytes: u64,
    /// Bytes of segments obtained from the device.
    pub reserved_bytes: u64,
    /// Peak of `reserved_bytes`.
    pub peak_reserved_bytes: u64,
    /// Number of segments held.
    pub segments: u64,
}

impl Gauges {
    #[inline]
    pub(crate) fn add_live(&mut self, live: u64, allocated: u64) {
        self.live_bytes += live;
        self.allocated_bytes += allocated;
        self.peak_live_bytes = self.peak_live_bytes.max(self.live_bytes);
        self.peak_allocated_bytes = self.peak_allocated_bytes.max(self.allocated_bytes);
    }

    #[inline]
    pub(crate) fn sub_live(&mut self, live: u64, allocated: u64) {
        self.live_bytes -= live;
        self.allocated_bytes -= allocated;
    }

    /// `bytes` of pages left one segment, which became `pieces` segments.
    pub(crate) fn cut(&mut self, bytes: u64, pieces: u64) {
        self.reserved_bytes -= bytes;
        self.segments = self.segments + pieces - 1;
    }

    #[inline]
    pub(crate) fn add_reserved(&mut self, bytes: u64) {
        self.reserved_bytes += bytes;
        self.segments += 1;
        self.peak_reserved_bytes = self.peak_reserved_bytes.max(self.reserved_bytes);
    }

    /// `bytes` of memory added to a segment it already counts (the zone of
    /// an aliased planned arena made after the arena).
    pub(crate) fn grow(&mut self, bytes: u64) {
        self.reserved_bytes += bytes;
        self.peak_reserved_bytes = self.peak_reserved_bytes.max(self.reserved_bytes);
    }

    /// `bytes` of memory that no segment counts given back (spare pages).
    pub(crate) fn shrink(&mut self, bytes: u64) {
        self.reserved_bytes -= bytes;
    }

    #[inline]
    pub(crate) fn sub_reserved(&mut self, bytes: u64) {
        self.reserved_bytes -= bytes;
        self.segments -= 1;
    }
}

impl Stats {
    /// Counters accumulated since `earlier` (gauges and peaks are kept as they are now).
    pub fn minus(&self, earlier: &Stats) -> Stats {
        Stats {
            bytes: self.bytes,
            allocs: self.allocs - earlier.allocs,
            frees: self.frees - earlier.frees,
            uses: self.uses - earlier.uses,
            cache_hits: self.cache_hits - earlier.cache_hits,
            ooms: self.ooms - earlier.ooms,
            alloc_retries: self.alloc_retries - earlier.alloc_retries,
            device_alloc_calls: self.device_alloc_calls - earlier.device_alloc_calls,
            device_free_calls: self.device_free_calls - earlier.device_free_calls,
            device_syncs: self.device_syncs - earlier.device_syncs,
            reclaimed_bytes: self.reclaimed_bytes - earlier.reclaimed_bytes,
            evicted_bytes: self.evicted_bytes - earlier.evicted_bytes,
            prefetched_bytes: self.prefetched_bytes - earlier.prefetched_bytes,
            moved_bytes: self.moved_bytes - earlier.moved_bytes,
            policy_calls: self.policy_calls - earlier.policy_calls,
            policy_traps: self.policy_traps - earlier.policy_traps,
            policy_fallbacks: self.policy_fallbacks - earlier.policy_fallbacks,
            policy_memo_hits: self.policy_memo_hits - earlier.policy_memo_hits,
            deferred_frees: self.deferred_frees - earlier.deferred_frees,
            pending_bytes: self.pending_bytes,
            gc_pauses: self.gc_pauses - earlier.gc_pauses,
            compactions: self.compactions - earlier.compactions,
            stream_syncs: self.stream_syncs - earlier.stream_syncs,
            paged_segments: self.paged_segments - earlier.paged_segments,
            stitches: self.stitches - earlier.stitches,
            stitched_bytes: self.stitched_bytes - earlier.stitched_bytes,
            trimmed_bytes: self.trimmed_bytes - earlier.trimmed_bytes,
            plans: self.plans - earlier.plans,
            plan_hits: self.plan_hits - earlier.plan_hits,
            plan_misses: self.plan_misses - earlier.plan_misses,
            plan_refused: self.plan_refused - earlier.plan_refused,
            plan_arena_bytes: self.plan_arena_bytes,
            plans_loaded: self.plans_loaded - earlier.plans_loaded,
            plans_refined: self.plans_refined - earlier.plans_refined,
            plan_detected_steps: self.plan_detected_steps - earlier.plan_detected_steps,
        }
    }
}

/// Counters and gauges of one allocator.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Stats {
    /// Whole-device byte gauges.
    #[serde(flatten)]
    pub bytes: Gauges,
    /// Successful allocations.
    pub allocs: u64,
    /// Frees.
    pub frees: u64,
    /// `use` calls.
    pub uses: u64,
    /// Allocations served from a cached free block.
    pub cache_hits: u64,
    /// Requests that failed after every remedy.
    pub ooms: u64,
    /// Requests the device refused a new segment for, retried after the
    /// remedies that free memory (PyTorch's `num_alloc_retries`).
    pub alloc_retries: u64,
    /// Segment allocations made on the device.
    pub device_alloc_calls: u64,
    /// Segment releases made on the device.
    pub device_free_calls: u64,
    /// Operations that synchronized the device.
    pub device_syncs: u64,
    /// Bytes released back to the device by reclamation decisions.
    pub reclaimed_bytes: u64,
    /// Bytes moved off the device by eviction.
    pub evicted_bytes: u64,
    /// Bytes brought back to the device ahead of use.
    pub prefetched_bytes: u64,
    /// Bytes copied by defragmentation.
    pub moved_bytes: u64,
    /// Calls into policies (memoized decisions excluded).
    pub policy_calls: u64,
    /// Policy calls that trapped, ran out of time, fuel or memory.
    pub policy_traps: u64,
    /// Calls decided by the built-in default instead of the policy.
    pub policy_fallbacks: u64,
    /// Placement decisions served from the memo.
    pub policy_memo_hits: u64,
    /// Frees whose block waited on events of other streams before returning
    /// to its pool.
    pub deferred_frees: u64,
    /// Gauge: bytes of blocks waiting on stream events (neither free nor live).
    pub pending_bytes: u64,
    /// Releases of cached memory (reclamation or compaction) that freed at
    /// least one segment; their durations are in [`PauseHistogram`].
    pub gc_pauses: u64,
    /// Compaction runs that moved at least one block.
    pub compactions: u64,
    /// Waits for one stream before its pages were unmapped (no device-wide
    /// synchronization; those count in `device_syncs`).
    pub stream_syncs: u64,
    /// Segments built from individually mapped pages (virtual memory API).
    pub paged_segments: u64,
    /// Segments built by stitching free pages of a pool.
    pub stitches: u64,
    /// Bytes of free pages that stitching reused instead of new device memory.
    pub stitched_bytes: u64,
    /// Bytes of free pages released from inside partly used paged segments.
    pub trimmed_bytes: u64,
    /// Plans accepted from the planner (see `alloc::planned`).
    pub plans: u64,
    /// Requests served at their planned offset.
    pub plan_hits: u64,
    /// Requests of a planned step that were not (no planned entry matched,
    /// or the planned range was occupied: a deviation; not those the plan
    /// leaves to the dynamic path's room, which are served as planned).
    pub plan_misses: u64,
    /// Plans refused (invalid, the planner failed, or no arena could be had).
    pub plan_refused: u64,
    /// Gauge: bytes of the planned arena(s) held.
    pub plan_arena_bytes: u64,
    /// Plans read from a plan cache (see `alloc::plan_cache`).
    pub plans_loaded: u64,
    /// Cheaper plans found for the plan cache by searching on at step ends
    /// (`PlannerPolicy::refine`).
    pub plans_refined: u64,
    /// Step ends found by the repeating period of a run without step
    /// markers (see `alloc::period`).
    pub plan_detected_steps: u64,
}

/// Durations of "GC pauses": releases of cached memory, each measured as the
/// device time (cost model: free + synchronization per segment) it took.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PauseHistogram {
    samples: Vec<f64>,
}

impl PauseHistogram {
    /// Records one pause of `us` microseconds.
    pub fn record(&mut self, us: f64) {
        self.samples.push(us);
    }

    /// Number of pauses recorded.
    pub fn len(&self) -> usize {
        self.samples.len()
    }

    /// Whether no pause was recorded.
    pub fn is_empty(&self) -> bool {
        self.samples.is_empty()
    }

    /// The pauses recorded from index `from` on (e.g. after a split point).
    pub fn since(&self, from: usize) -> PauseHistogram {
        PauseHistogram { samples: self.samples.get(from..).unwrap_or_default().to_vec() }
    }

    /// The `q`-quantile (0 ≤ q ≤ 1, nearest rank) in microseconds; 0 when empty.
    pub fn quantile(&self, q: f64) -> f64 {
        if self.samples.is_empty() {
            return 0.0;
        }
        let mut v = self.samples.clone();
        v.sort_by(f64::total_cmp);
        let rank = (q.clamp(0.0, 1.0) * v.len() as f64).ceil() as usize;
        v[rank.saturating_sub(1).min(v.len() - 1)]
    }

    /// The longest pause in microseconds; 0 when empty.
    pub fn max(&self) -> f64 {
        self.samples.iter().copied().fold(0.0, f64::max)
    }
}
