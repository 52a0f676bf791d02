//! The metrics of a run (DESIGN.md's contract: `wasmem replay --json`
//! prints these keys), and the one place that derives them.
//!
//! A [`Metrics`] value is filled in three parts: the event counts by whoever
//! drives the allocator ([`crate::driver::Driver`]), the allocator-derived
//! keys by [`fill`], and the timing keys by [`Metrics::set_timing`] (wall
//! time) and [`Metrics::set_policy_latency`] (policy call durations).
//! [`Metrics::clear_timing`] zeroes every wall-clock-dependent key, for
//! comparisons.

use serde::Serialize;

use crate::alloc::{Allocator, LatencyHistogram, PauseHistogram, Stats};
use crate::device::Device;
use crate::tier::TierStats;

/// The metrics of one replay. Field names are the contract keys.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Metrics {
    /// Events replayed.
    pub events: u64,
    /// `alloc` events.
    pub allocs: u64,
    /// `free` events.
    pub frees: u64,
    /// Max over time of the requested bytes of live tensors (policy-independent).
    pub peak_live_bytes: u64,
    /// Max over time of bytes in blocks handed out.
    pub peak_allocated_bytes: u64,
    /// Max over time of bytes obtained from the device.
    pub peak_reserved_bytes: u64,
    /// `peak_reserved_bytes / peak_live_bytes`.
    pub overhead_ratio: f64,
    /// Segment allocations.
    pub device_alloc_calls: u64,
    /// Segment releases.
    pub device_free_calls: u64,
    /// Operations that would synchronize the device.
    pub device_syncs: u64,
    /// Requests that failed after every remedy.
    pub ooms: u64,
    /// Bytes moved off the device.
    pub evicted_bytes: u64,
    /// Bytes brought back ahead of use.
    pub prefetched_bytes: u64,
    /// Bytes copied by defragmentation.
    pub moved_bytes: u64,
    /// Calls into the active policy of each role: the one the spec names, or
    /// the built-in default of a role the spec does not provide. Memoized
    /// placements and calls the fallback decided (a disabled role) are not
    /// counted; per-role counts are in [`crate::alloc::PolicySet::health`].
    pub policy_calls: u64,
    /// Policy calls that trapped or hit a limit.
    pub policy_traps: u64,
    /// Calls decided by the built-in default.
    pub policy_fallbacks: u64,
    /// Replay time on this machine.
    pub wall_seconds: f64,
    /// Replay speed on this machine.
    pub events_per_second: f64,
    /// Median duration of a call into the active policies, nanoseconds
    /// (wall-clock, within 12.5 %; 0 without calls). WebAssembly calls are
    /// all timed, native ones one in 64.
    pub policy_call_p50_ns: u64,
    /// 99th-percentile duration of a call into the active policies, nanoseconds.
    pub policy_call_p99_ns: u64,
    /// `use` events.
    pub uses: u64,
    /// Allocations served from cached blocks.
    pub cache_hits: u64,
    /// Placement decisions served from the memo.
    pub policy_memo_hits: u64,
    /// Bytes released by reclamation decisions.
    pub reclaimed_bytes: u64,
    /// Zero-byte allocations (tracked, no storage).
    pub zero_byte_allocs: u64,
    /// Simulated time spent in device calls, microseconds.
    pub device_time_us: f64,
    /// Device capacity used for the replay.
    pub device_capacity_bytes: u64,
    /// Frees deferred on events of other streams.
    pub deferred_frees: u64,
    /// Releases of cached memory ("GC pauses").
    pub gc_pauses: u64,
    /// Median GC pause in simulated microseconds (0 when none).
    pub gc_pause_us_p50: f64,
    /// 99th-percentile GC pause in simulated microseconds.
    pub gc_pause_us_p99: f64,
    /// Longest GC pause in simulated microseconds.
    pub gc_pause_us_max: f64,
    /// Training steps in the trace (`phase step_end` markers).
    pub steps: u64,
    /// Sum of the requested bytes of every allocation.
    pub bytes_allocated: u64,
    /// `moved_bytes / steps` (all moved bytes when the trace has no step marker).
    pub moved_bytes_per_step: f64,
    /// `moved_bytes / bytes_allocated`: defragmentation traffic against the
    /// workload's own allocation volume.
    pub moved_fraction: f64,
    /// Bytes of free pages stitched into new segments instead of new device memory.
    pub stitched_bytes: u64,
    /// Bytes of free pages released from inside partly used paged segments.
    pub trimmed_bytes: u64,
    /// Simulated time the workload waited for copies between tiers, microseconds.
    pub stall_us: f64,
    /// Bytes brought back on demand (a use of an off-device tensor).
    pub fetched_bytes: u64,
    /// Bytes moved from the host tier to spill files.
    pub spilled_bytes: u64,
    /// Tensors moved off the device.
    pub evictions: u64,
    /// Peak bytes on the host tier.
    pub peak_host_bytes: u64,
    /// Peak bytes on the disk tier.
    pub peak_disk_bytes: u64,
    /// Traffic between tiers: `evicted + prefetched + fetched` bytes.
    pub tier_traffic_bytes: u64,
    /// The eviction policy read the workload's future (Belady): an offline
    /// bound for comparisons, not an achievable result.
    pub offline_bound: bool,
    /// Plans accepted from the planner (planned placement).
    pub plans: u64,
    /// Requests served at their planned offset.
    pub plan_hits: u64,
    /// Requests of planned steps served by the dynamic path instead (not
    /// counting those a plan leaves to the room the dynamic path keeps).
    pub plan_misses: u64,
    /// Plans refused (invalid, the planner failed, or no arena: the device
    /// refused it, or it would have raised the peak reserved memory).
    pub plan_refused: u64,
    /// Bytes of the planned arena at the end (the peak is in `peak_reserved_bytes`).
    pub plan_arena_bytes: u64,
    /// Plans read from a plan cache at the start (`--plan-cache`).
    pub plans_loaded: u64,
    /// Cheaper plans the planner found for the plan cache at step ends
    /// (the next run starts from them; this one serves the plans it has).
    pub plans_refined: u64,
    /// Step ends found by the repeating period of the requests, in a run
    /// without step markers (planned placement plans those steps).
    pub plan_detected_steps: u64,
    /// The first request that failed after every remedy (event and reason).
    pub first_oom: Option<String>,
}

impl Metrics {
    /// Sets the timing keys: `wall_seconds` and `events_per_second`
    /// (`events / wall_seconds`, 0 when no time passed). The only place
    /// they are computed.
    pub fn set_timing(&mut self, wall_seconds: f64) {
        self.wall_seconds = wall_seconds;
        self.events_per_second = if wall_seconds > 0.0 { self.events as f64 / wall_seconds } else { 0.0 };
    }

    /// Sets the policy call latency keys from the durations `h`.
    pub fn set_policy_latency(&mut self, h: &LatencyHistogram) {
        self.policy_call_p50_ns = h.quantile(0.5);
        self.policy_call_p99_ns = h.quantile(0.99);
    }

    /// Zeroes every key that depends on the wall clock (`wall_seconds`,
    /// `events_per_second`, `policy_call_p50_ns`, `policy_call_p99_ns`), so
    /// that two runs compare equal when their behaviour is.
    pub fn clear_timing(&mut self) {
        self.wall_seconds = 0.0;
        self.events_per_second = 0.0;
        self.policy_call_p50_ns = 0;
        self.policy_call_p99_ns = 0;
    }

    /// Fills the allocator-derived keys from `alloc` (see [`fill`]) and the
    /// policy call latencies.
    pub fn fill_from<D: Device>(&mut self, alloc: &Allocator<D>) {
        fill(self, &alloc.stats(), alloc.device(), alloc.gc_pauses(), &alloc.tier_stats());
        self.set_policy_latency(&alloc.policies().latency());
        self.offline_bound = alloc.eviction_needs_future();
    }
}

/// Fills the allocator-derived keys of `m` (everything but the event counts and timing).
pub fn fill<D: Device>(m: &mut Metrics, s: &Stats, dev: &D, pauses: &PauseHistogram, ts: &TierStats) {
    m.stall_us = ts.stall_us;
    m.fetched_bytes = ts.fetched_bytes;
    m.spilled_bytes = ts.spilled_bytes;
    m.evictions = ts.evictions;
    m.peak_host_bytes = ts.peak_host_bytes;
    m.peak_disk_bytes = ts.peak_disk_bytes;
    m.tier_traffic_bytes = s.evicted_bytes + s.prefetched_bytes + ts.fetched_bytes;
    m.deferred_frees = s.deferred_frees;
    m.gc_pauses = s.gc_pauses;
    m.gc_pause_us_p50 = pauses.quantile(0.5);
    m.gc_pause_us_p99 = pauses.quantile(0.99);
    m.gc_pause_us_max = pauses.max();
    m.peak_allocated_bytes = s.bytes.peak_allocated_bytes;
    m.peak_reserved_bytes = s.bytes.peak_reserved_bytes;
    m.overhead_ratio =
        if m.peak_live_bytes > 0 { s.bytes.peak_reserved_bytes as f64 / m.peak_live_bytes as f64 } else { 0.0 };
    m.device_alloc_calls = s.device_alloc_calls;
    m.device_free_calls = s.device_free_calls;
    m.device_syncs = s.device_syncs;
    m.ooms = s.ooms;
    m.evicted_bytes = s.evicted_bytes;
    m.prefetched_bytes = s.prefetched_bytes;
    m.moved_bytes = s.moved_bytes;
    m.policy_calls = s.policy_calls;
    m.policy_traps = s.policy_traps;
    m.policy_fallbacks = s.policy_fallbacks;
    m.uses = s.uses;
    m.cache_hits = s.cache_hits;
    m.policy_memo_hits = s.policy_memo_hits;
    m.reclaimed_bytes = s.reclaimed_bytes;
    m.device_time_us = dev.counters().time_us;
    m.device_capacity_bytes = dev.capacity();
    m.stitched_bytes = s.stitched_bytes;
    m.trimmed_bytes = s.trimmed_bytes;
    m.moved_bytes_per_step = s.moved_bytes as f64 / m.steps.max(1) as f64;
    m.moved_fraction = if m.bytes_allocated > 0 { s.moved_bytes as f64 / m.bytes_allocated as f64 } else { 0.0 };
    m.plans = s.plans;
    m.plan_hits = s.plan_hits;
    m.plan_misses = s.plan_misses;
    m.plan_refused = s.plan_refused;
    m.plan_arena_bytes = s.plan_arena_bytes;
    m.plans_loaded = s.plans_loaded;
    m.plans_refined = s.plans_refined;
    m.plan_detected_steps = s.plan_detected_steps;
}
