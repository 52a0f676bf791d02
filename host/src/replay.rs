//! Replays an event stream through an allocator and reports the metrics of
//! DESIGN.md (a contract: `wasmem replay --json` prints these keys).
//!
//! The replay knows nothing of the CLI: it takes events and policies, and
//! returns a [`Metrics`] value.

use std::time::Instant;

use rustc_hash::FxHashMap;
use serde::Serialize;

use crate::alloc::swap::{swap, SwapError, SwapOptions};
use crate::alloc::{ActionKind, AllocError, Allocator, PauseHistogram, Stats};
use crate::decision::Policies;
use crate::device::sim::{SimConfig, SimDevice};
use crate::device::Device;
use crate::spec::Resolved;
use crate::tier::{TierConfig, TierStats};
use crate::trace::snapshot::export::{
    BlockState, ExportBlock, ExportInput, ExportSegment, ExportTraceEntry, TraceAction,
};
use crate::trace::Event;
use crate::types::{Phase, StreamId, TensorId, GIB};

/// Configuration of a replay.
#[derive(Debug, Clone)]
pub struct ReplayConfig {
    /// The simulated device.
    pub device: SimConfig,
    /// Record `(event index, allocated, reserved)` every this many events for plots (0: never).
    pub sample_every: u64,
    /// Record allocator actions (for snapshot export).
    pub record_actions: bool,
    /// Enable the host and disk tiers (eviction instead of OOM, prefetch).
    pub tiers: Option<TierConfig>,
}

impl Default for ReplayConfig {
    fn default() -> Self {
        ReplayConfig {
            device: SimConfig { capacity: 80 * GIB, ..SimConfig::default() },
            sample_every: 0,
            record_actions: false,
            tiers: None,
        }
    }
}

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
    /// Calls into policies.
    pub policy_calls: u64,
    /// Policy calls that trapped or hit a limit.
    pub policy_traps: u64,
    /// Calls decided by the built-in default.
    pub policy_fallbacks: u64,
    /// Replay time on this machine.
    pub wall_seconds: f64,
    /// Replay speed on this machine.
    pub events_per_second: f64,
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
    /// The first request that failed after every remedy (event and reason).
    pub first_oom: Option<String>,
}

/// A sample of the allocator's gauges over the trace.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Sample {
    /// Index of the event after which it was taken.
    pub event: u64,
    /// Allocated bytes.
    pub allocated: u64,
    /// Reserved bytes.
    pub reserved: u64,
}

/// The full result of a replay.
pub struct Replay<D: Device> {
    /// Metrics.
    pub metrics: Metrics,
    /// Gauge samples (when requested).
    pub samples: Vec<Sample>,
    /// The allocator at the end (its recorded actions, segments, stats).
    pub allocator: Allocator<D>,
}

/// Why a replay stopped.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    /// The event source failed (malformed trace…).
    #[error("{0}")]
    Source(String),
    /// An event refers to an id that is not live.
    #[error("event {event}: tensor id {id} is not live")]
    UnknownId {
        /// Event index (0-based, header excluded).
        event: u64,
        /// Trace id.
        id: u64,
    },
    /// The hot swap of a split replay was refused.
    #[error("event {event}: {source}")]
    Swap {
        /// Event index.
        event: u64,
        /// The error.
        source: SwapError,
    },
    /// The allocator failed in a way that is not an OOM.
    #[error("event {event}: {source}")]
    Alloc {
        /// Event index.
        event: u64,
        /// The error.
        source: AllocError,
    },
}

/// The events of a replay: read as they come, or buffered for a look-ahead.
enum Source<It> {
    Lazy(It),
    Buffered(std::vec::IntoIter<Event>),
}

impl<It, E> Iterator for Source<It>
where
    It: Iterator<Item = Result<Event, E>>,
    E: std::fmt::Display,
{
    type Item = Result<Event, String>;
    fn next(&mut self) -> Option<Self::Item> {
        match self {
            Source::Lazy(it) => it.next().map(|e| e.map_err(|e| e.to_string())),
            Source::Buffered(it) => it.next().map(Ok),
        }
    }
}

/// For every `alloc` and `use` event, the index of the next `use` of the same
/// tensor before it is freed (`u64::MAX`: none), by a backward scan.
pub fn next_uses(events: &[Event]) -> Vec<u64> {
    let mut next = vec![u64::MAX; events.len()];
    let mut upcoming: FxHashMap<u64, u64> = FxHashMap::default();
    for (i, ev) in events.iter().enumerate().rev() {
        match ev {
            Event::Free { id, .. } => {
                upcoming.insert(*id, u64::MAX);
            }
            Event::Use { id, .. } => {
                next[i] = upcoming.get(id).copied().unwrap_or(u64::MAX);
                upcoming.insert(*id, i as u64);
            }
            Event::Alloc { id, .. } => {
                next[i] = upcoming.remove(id).unwrap_or(u64::MAX);
            }
            Event::Phase { .. } => {}
        }
    }
    next
}

/// Replays `events` with `policies` on a fresh simulated device.
pub fn replay<E, I>(events: I, policies: Policies, cfg: &ReplayConfig) -> Result<Replay<SimDevice>, ReplayError>
where
    I: IntoIterator<Item = Result<Event, E>>,
    E: std::fmt::Display,
{
    let alloc = Allocator::new(SimDevice::new(cfg.device), policies);
    replay_with(events, alloc, cfg, |_| {})
}

/// Replays `events` through an existing allocator; `progress` is called with
/// the event count every 65,536 events.
pub fn replay_with<D, E, I>(
    events: I,
    alloc: Allocator<D>,
    cfg: &ReplayConfig,
    progress: impl FnMut(u64),
) -> Result<Replay<D>, ReplayError>
where
    D: Device,
    I: IntoIterator<Item = Result<Event, E>>,
    E: std::fmt::Display,
{
    replay_split(events, alloc, cfg, progress, None).map(|(r, _)| r)
}

/// A hot swap before the event of index `at` (0-based): the one swap of
/// [`crate::alloc::swap`], then the peaks restart so that each half reports
/// its own.
pub struct Split {
    /// Index of the first event of the second half.
    pub at: u64,
    /// The policies swapped in.
    pub to: Resolved,
    /// Which roles, and whether state is carried.
    pub opts: SwapOptions,
}

/// Metrics of the two halves of a split replay: counters are counted within
/// each half, peaks are the peaks within each half.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Halves {
    /// Index of the first event of the second half.
    pub split_at: u64,
    /// Events before the split.
    pub first: Metrics,
    /// Events from the split on.
    pub second: Metrics,
}

/// Replays like [`replay_with`], running `split.hook` before event `split.at`
/// and reporting both halves.
pub fn replay_split<D, E, I>(
    events: I,
    mut alloc: Allocator<D>,
    cfg: &ReplayConfig,
    mut progress: impl FnMut(u64),
    mut split: Option<Split>,
) -> Result<(Replay<D>, Option<Halves>), ReplayError>
where
    D: Device,
    I: IntoIterator<Item = Result<Event, E>>,
    E: std::fmt::Display,
{
    let mut first: Option<(Metrics, Stats, crate::device::DeviceCounters, usize, TierStats)> = None;
    if let Some(t) = &cfg.tiers {
        alloc.enable_tiers(t.clone());
    }
    let (events, future) = if alloc.eviction_needs_future() {
        let evs = events
            .into_iter()
            .enumerate()
            .map(|(n, e)| e.map_err(|e| ReplayError::Source(format!("event {n}: {e}"))))
            .collect::<Result<Vec<Event>, _>>()?;
        let next = next_uses(&evs);
        (Source::Buffered(evs.into_iter()), Some(next))
    } else {
        (Source::Lazy(events.into_iter()), None)
    };
    let mut half_peak_live = 0u64;
    alloc.record_actions(cfg.record_actions);
    let start = Instant::now();
    let mut ids: FxHashMap<u64, (Option<TensorId>, u64)> = FxHashMap::default();
    let mut m = Metrics::default();
    let mut live = 0u64;
    let mut samples = Vec::new();
    for (n, ev) in events.into_iter().enumerate() {
        let n = n as u64;
        let ev = ev.map_err(ReplayError::Source)?;
        let next_use = future.as_ref().map(|f| f[n as usize]);
        if split.as_ref().is_some_and(|s| s.at == n) {
            let s = split.take().expect("checked");
            let mut fm = m.clone();
            fill(&mut fm, &alloc.stats(), alloc.device(), alloc.gc_pauses(), &alloc.tier_stats());
            fm.wall_seconds = start.elapsed().as_secs_f64();
            first = Some((fm, alloc.stats(), alloc.device().counters(), alloc.gc_pauses().len(), alloc.tier_stats()));
            swap(&mut alloc, s.to, &s.opts).map_err(|e| ReplayError::Swap { event: n, source: e })?;
            alloc.reset_peaks();
            half_peak_live = live;
        }
        match ev {
            Event::Alloc { id, bytes, kind, stream, .. } => {
                m.allocs += 1;
                m.bytes_allocated += bytes;
                live += bytes;
                m.peak_live_bytes = m.peak_live_bytes.max(live);
                half_peak_live = half_peak_live.max(live);
                let handle = if bytes == 0 {
                    m.zero_byte_allocs += 1;
                    None
                } else {
                    match alloc.alloc(bytes, kind, StreamId(stream)) {
                        Ok(h) => {
                            if next_use.is_some() {
                                alloc.set_next_use(h, next_use);
                            }
                            Some(h)
                        }
                        Err(e @ AllocError::OutOfMemory { .. }) => {
                            m.first_oom.get_or_insert_with(|| format!("event {n}: {e}"));
                            None
                        }
                        Err(e) => return Err(ReplayError::Alloc { event: n, source: e }),
                    }
                };
                ids.insert(id, (handle, bytes));
            }
            Event::Free { id, .. } => {
                m.frees += 1;
                let (h, bytes) = ids.remove(&id).ok_or(ReplayError::UnknownId { event: n, id })?;
                live -= bytes;
                if let Some(h) = h {
                    alloc.free(h).map_err(|e| ReplayError::Alloc { event: n, source: e })?;
                }
            }
            Event::Use { id, stream } => {
                let &(h, _) = ids.get(&id).ok_or(ReplayError::UnknownId { event: n, id })?;
                if let Some(h) = h {
                    match alloc.use_tensor(h, stream.map(StreamId)) {
                        Ok(()) => {
                            if next_use.is_some() {
                                alloc.set_next_use(h, next_use);
                            }
                        }
                        // Bringing it back failed after every remedy: counted, left where it is.
                        Err(e @ AllocError::OutOfMemory { .. }) => {
                            m.first_oom.get_or_insert_with(|| format!("event {n} (use of trace id {id}): {e}"));
                        }
                        Err(e) => return Err(ReplayError::Alloc { event: n, source: e }),
                    }
                }
            }
            Event::Phase { phase, step } => {
                if phase == Phase::StepEnd {
                    m.steps += 1;
                }
                alloc.phase(phase, step).map_err(|e| ReplayError::Alloc { event: n, source: e })?;
            }
        }
        m.events += 1;
        if cfg.sample_every > 0 && n.is_multiple_of(cfg.sample_every) {
            let g = alloc.gauges();
            samples.push(Sample { event: n, allocated: g.allocated_bytes, reserved: g.reserved_bytes });
        }
        if n & 0xffff == 0xffff {
            progress(n + 1);
        }
    }
    let wall = start.elapsed().as_secs_f64();
    fill(&mut m, &alloc.stats(), alloc.device(), alloc.gc_pauses(), &alloc.tier_stats());
    m.offline_bound = alloc.eviction_needs_future();
    m.wall_seconds = wall;
    m.events_per_second = if wall > 0.0 { m.events as f64 / wall } else { 0.0 };
    let halves = first.map(|(f, stats0, dev0, pauses0, tiers0)| {
        let mut sm = Metrics {
            events: m.events - f.events,
            allocs: m.allocs - f.allocs,
            frees: m.frees - f.frees,
            peak_live_bytes: half_peak_live,
            zero_byte_allocs: m.zero_byte_allocs - f.zero_byte_allocs,
            steps: m.steps - f.steps,
            bytes_allocated: m.bytes_allocated - f.bytes_allocated,
            ..Metrics::default()
        };
        let s = alloc.stats();
        let ts = alloc.tier_stats().minus(&tiers0);
        fill(&mut sm, &s.minus(&stats0), alloc.device(), &alloc.gc_pauses().since(pauses0), &ts);
        sm.offline_bound = m.offline_bound;
        sm.device_time_us = alloc.device().counters().time_us - dev0.time_us;
        sm.wall_seconds = wall - f.wall_seconds;
        sm.events_per_second = if sm.wall_seconds > 0.0 { sm.events as f64 / sm.wall_seconds } else { 0.0 };
        let mut f = f;
        f.events_per_second = if f.wall_seconds > 0.0 { f.events as f64 / f.wall_seconds } else { 0.0 };
        Halves { split_at: f.events, first: f, second: sm }
    });
    Ok((Replay { metrics: m, samples, allocator: alloc }, halves))
}

/// Fills the allocator-derived keys of `m` (everything but the event counts and timing).
pub(crate) fn fill<D: Device>(m: &mut Metrics, s: &Stats, dev: &D, pauses: &PauseHistogram, ts: &TierStats) {
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
}

/// The state and recorded actions of a replay in PyTorch's snapshot shape,
/// ready for [`crate::trace::snapshot::export::export_file`]. Needs
/// [`ReplayConfig::record_actions`] for the trace part.
pub fn snapshot_of<D: Device>(alloc: &mut Allocator<D>) -> ExportInput {
    let segments = alloc
        .segment_views()
        .into_iter()
        .map(|s| ExportSegment {
            address: s.base,
            total_size: s.size,
            stream: s.stream.0,
            blocks: s
                .blocks
                .iter()
                .map(|&(off, size, t)| ExportBlock {
                    address: s.base + off,
                    size,
                    requested_size: t.map_or(0, |t| t.0),
                    state: if t.is_some() { BlockState::ActiveAllocated } else { BlockState::Inactive },
                    kind: t.map(|t| t.1),
                })
                .collect(),
        })
        .collect();
    let mut trace = Vec::new();
    for a in alloc.take_actions() {
        let entry = |action| ExportTraceEntry {
            action,
            addr: a.addr,
            size: a.size,
            stream: a.stream.0,
            time_us: a.clock,
            kind: a.tensor_kind,
        };
        match a.kind {
            ActionKind::Alloc => trace.push(entry(TraceAction::Alloc)),
            ActionKind::Free => {
                // Frees complete at once (no cross-stream deferral yet).
                trace.push(entry(TraceAction::FreeRequested));
                trace.push(entry(TraceAction::FreeCompleted));
            }
            ActionKind::SegmentAlloc => trace.push(entry(TraceAction::SegmentAlloc)),
            ActionKind::SegmentFree => trace.push(entry(TraceAction::SegmentFree)),
        }
    }
    ExportInput { device: 0, segments, trace }
}
