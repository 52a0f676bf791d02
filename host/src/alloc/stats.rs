//! Allocator statistics.
//!
//! Invariants (checked by `Allocator::check_invariants` against a recount):
//! - `reserved_bytes = Σ segment sizes`, per pool and in total;
//! - `allocated_bytes = Σ sizes of blocks holding a tensor`;
//! - `live_bytes = Σ requested bytes of live tensors`;
//! - `live ≤ allocated ≤ reserved`, and every `peak_*` ≥ its current value.

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

    #[inline]
    pub(crate) fn add_reserved(&mut self, bytes: u64) {
        self.reserved_bytes += bytes;
        self.segments += 1;
        self.peak_reserved_bytes = self.peak_reserved_bytes.max(self.reserved_bytes);
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
}
