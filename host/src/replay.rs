//! Replays an event stream through an allocator and reports the metrics of
//! DESIGN.md (a contract: `wasmem replay --json` prints these keys).
//!
//! The replay knows nothing of the CLI: it takes events and policies, and
//! returns a [`Metrics`] value.

use std::time::Instant;

use rustc_hash::FxHashMap;
use serde::Serialize;

use crate::alloc::swap::{swap, SwapError, SwapOptions};
use crate::alloc::{ActionKind, Allocator, Stats};
use crate::decision::Policies;
use crate::device::sim::{SimConfig, SimDevice};
use crate::device::Device;
use crate::driver::{DriveError, Driver, OnOom};
use crate::metrics::fill;
pub use crate::metrics::Metrics;
use crate::spec::Resolved;
use crate::tier::{TierConfig, TierStats};
use crate::trace::snapshot::export::{
    BlockState, ExportBlock, ExportInput, ExportSegment, ExportTraceEntry, TraceAction,
};
use crate::trace::Event;
use crate::types::GIB;

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
    /// An event could not be applied (an unknown or reused id, an
    /// allocator failure that is not an OOM).
    #[error(transparent)]
    Drive(#[from] DriveError),
    /// The hot swap of a split replay was refused.
    #[error("event {event}: {cause}")]
    Swap {
        /// Event index.
        event: u64,
        /// The error.
        cause: SwapError,
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
    type AtSplit = (Metrics, Stats, crate::device::DeviceCounters, usize, TierStats, crate::alloc::LatencyHistogram);
    let mut first: Option<AtSplit> = None;
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
    alloc.record_actions(cfg.record_actions);
    let start = Instant::now();
    let mut driver = Driver::new(OnOom::Outcome);
    let mut samples = Vec::new();
    for (n, ev) in events.into_iter().enumerate() {
        let n = n as u64;
        let ev = ev.map_err(ReplayError::Source)?;
        let next_use = future.as_ref().map(|f| f[n as usize]);
        if split.as_ref().is_some_and(|s| s.at == n) {
            let s = split.take().expect("checked");
            let mut fm = driver.metrics(&alloc);
            fm.set_timing(start.elapsed().as_secs_f64());
            first = Some((
                fm,
                alloc.stats(),
                alloc.device().counters(),
                alloc.gc_pauses().len(),
                alloc.tier_stats(),
                alloc.policies().latency(),
            ));
            swap(&mut alloc, s.to, &s.opts).map_err(|e| ReplayError::Swap { event: n, cause: e })?;
            alloc.reset_peaks();
            driver.mark();
        }
        driver.apply(&mut alloc, &ev, next_use)?;
        if cfg.sample_every > 0 && n.is_multiple_of(cfg.sample_every) {
            let g = alloc.gauges();
            samples.push(Sample { event: n, allocated: g.allocated_bytes, reserved: g.reserved_bytes });
        }
        if n & 0xffff == 0xffff {
            progress(n + 1);
        }
    }
    let wall = start.elapsed().as_secs_f64();
    let mut m = driver.metrics(&alloc);
    m.set_timing(wall);
    let halves = first.map(|(f, stats0, dev0, pauses0, tiers0, latency0)| {
        let mut sm = Metrics {
            events: m.events - f.events,
            allocs: m.allocs - f.allocs,
            frees: m.frees - f.frees,
            peak_live_bytes: driver.window_peak(),
            zero_byte_allocs: m.zero_byte_allocs - f.zero_byte_allocs,
            steps: m.steps - f.steps,
            bytes_allocated: m.bytes_allocated - f.bytes_allocated,
            ..Metrics::default()
        };
        let s = alloc.stats();
        let ts = alloc.tier_stats().minus(&tiers0);
        fill(&mut sm, &s.minus(&stats0), alloc.device(), &alloc.gc_pauses().since(pauses0), &ts);
        sm.set_policy_latency(&alloc.policies().latency().since(&latency0));
        sm.offline_bound = m.offline_bound;
        sm.device_time_us = alloc.device().counters().time_us - dev0.time_us;
        sm.set_timing(wall - f.wall_seconds);
        Halves { split_at: f.events, first: f, second: sm }
    });
    Ok((Replay { metrics: m, samples, allocator: alloc }, halves))
}

/// The state and recorded actions of a replay in PyTorch's snapshot shape,
/// ready for [`crate::trace::snapshot::export::export_file`]. Needs
/// [`ReplayConfig::record_actions`] for the trace part.
pub fn snapshot_of<D: Device>(alloc: &mut Allocator<D>) -> ExportInput {
    let segments = export_segments(alloc);
    let trace = export_actions(alloc.take_actions());
    ExportInput { device: 0, segments, trace }
}

/// The allocator's segments and their blocks now, in the snapshot shape.
pub fn export_segments<D: Device>(alloc: &Allocator<D>) -> Vec<ExportSegment> {
    alloc
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
        .collect()
}

/// Recorded allocator actions ([`Allocator::take_actions`]) as snapshot
/// trace entries.
pub fn export_actions(actions: Vec<crate::alloc::Action>) -> Vec<ExportTraceEntry> {
    let mut trace = Vec::with_capacity(actions.len());
    for a in actions {
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
    trace
}
