//! One device of the library: its engine, the pointers it handed out, its
//! streams, its trace, its shadow and its memory history.
//!
//! Invariants (checked by [`DeviceState::check`]):
//! - `live` holds exactly the pointers handed out and not yet freed, each
//!   with the trace id the engine's driver maps to the allocator handle
//!   whose address it is: `|live| = stats.allocs − stats.frees`;
//! - `requested = Σ live requested bytes`, `peak_requested ≥ requested`;
//!   `allocated_total − freed_total = Σ live rounded bytes`;
//! - `streams` maps each `cudaStream_t` seen to a distinct [`StreamId`]
//!   `1..=n`; the null (default) stream is stream 0;
//! - when tracing is on, the trace is valid and its live ids are exactly the
//!   `trace_id`s in `live`;
//! - the memory history holds at most `history_max` entries.

use std::collections::VecDeque;

use rustc_hash::FxHashMap;
use serde_json::{json, Value};
use wasmem::alloc::AllocError;
use wasmem::driver::DriveError;
use wasmem::shadow::ShadowHandle;
use wasmem::trace::snapshot::export::{export_bytes, ExportInput, ExportTraceEntry};
use wasmem::trace::Event;
use wasmem::types::{Phase, StreamId, TensorKind};

use crate::engine::Engine;
use crate::log::Cause;
use crate::state::Failure;
use crate::tracelog::TraceLog;

/// Every request is rounded up to this many bytes, so that every block is
/// this well aligned whatever rounding the placement policy chooses (it is
/// also PyTorch's own smallest block).
pub const ALIGN: u64 = 512;

/// One pointer handed out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Live {
    trace_id: u64,
    bytes: u64,
}

/// A device served by the library (see the module documentation).
pub struct DeviceState {
    index: i32,
    engine: Box<dyn Engine>,
    shadow: Option<ShadowHandle>,
    live: FxHashMap<u64, Live>,
    streams: FxHashMap<usize, StreamId>,
    trace: Option<TraceLog>,
    next_trace_id: u64,
    requested: u64,
    peak_requested: u64,
    /// Rounded bytes of every allocation and of every free so far.
    allocated_total: u64,
    freed_total: u64,
    history: VecDeque<ExportTraceEntry>,
    history_max: usize,
}

impl std::fmt::Debug for DeviceState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceState")
            .field("index", &self.index)
            .field("live", &self.live.len())
            .finish_non_exhaustive()
    }
}

impl DeviceState {
    /// Device `index` served by `engine`, with a shadow fed its events and a
    /// trace when asked.
    pub fn new(index: i32, engine: Box<dyn Engine>, shadow: Option<ShadowHandle>, trace: bool) -> Self {
        DeviceState {
            index,
            engine,
            shadow,
            live: FxHashMap::default(),
            streams: FxHashMap::default(),
            trace: trace.then(TraceLog::new),
            next_trace_id: 1,
            requested: 0,
            peak_requested: 0,
            allocated_total: 0,
            freed_total: 0,
            history: VecDeque::new(),
            history_max: 0,
        }
    }

    /// The device index.
    pub fn index(&self) -> i32 {
        self.index
    }

    /// The engine.
    pub fn engine(&self) -> &dyn Engine {
        &*self.engine
    }

    /// The engine, mutably.
    pub fn engine_mut(&mut self) -> &mut dyn Engine {
        &mut *self.engine
    }

    /// The shadow, if any.
    pub fn shadow(&self) -> Option<&ShadowHandle> {
        self.shadow.as_ref()
    }

    /// The trace, when tracing is on.
    pub fn trace(&self) -> Option<&TraceLog> {
        self.trace.as_ref()
    }

    /// The [`StreamId`] of a `cudaStream_t` value (the null stream is 0).
    fn stream_id(&mut self, stream: usize) -> StreamId {
        if stream == 0 {
            return StreamId(0);
        }
        let next = StreamId(self.streams.len() as u32 + 1);
        *self.streams.entry(stream).or_insert(next)
    }

    /// Feeds the shadow (which never fails the primary).
    fn observe(&self, ev: &Event) {
        if let Some(s) = &self.shadow {
            s.with(|s| s.observe(ev));
        }
    }

    /// Allocates `size > 0` requested bytes of `kind` for `stream`.
    pub fn malloc(&mut self, size: u64, kind: TensorKind, stream: usize) -> Result<u64, Failure> {
        let rounded = wasmem::types::round_up(size, ALIGN)
            .ok_or_else(|| Failure::new(Cause::AllocFailed, format!("size {size} overflows when rounded")))?;
        let sid = self.stream_id(stream);
        let trace_id = self.next_trace_id;
        let ev = Event::Alloc { id: trace_id, bytes: rounded, kind, stream: sid.0, t_us: None };
        let got = self.engine.apply(&ev).map_err(|e| match e {
            DriveError::Alloc { cause: e @ AllocError::OutOfMemory { .. }, .. } => {
                Failure::new(Cause::OutOfMemory, format!("device {}: {e}", self.index))
            }
            DriveError::Alloc { cause, .. } => Failure::new(
                Cause::AllocFailed,
                format!("device {}: allocation of {size} bytes failed: {cause}", self.index),
            ),
            e => Failure::new(
                Cause::AllocFailed,
                format!("device {}: allocation of {size} bytes failed: {e}", self.index),
            ),
        })?;
        let Some((_, addr)) = got else {
            return Err(Failure::new(Cause::AllocFailed, format!("allocation of {size} bytes got no storage")));
        };
        if addr == 0 || addr % ALIGN != 0 || self.live.contains_key(&addr) {
            // Cannot happen with a sound device; refuse rather than hand out a bad pointer.
            let _ = self.engine.apply(&Event::Free { id: trace_id, t_us: None });
            return Err(Failure::new(Cause::AllocFailed, format!("the device returned an unusable address {addr:#x}")));
        }
        self.next_trace_id += 1;
        self.observe(&ev);
        if let Some(t) = self.trace.as_mut() {
            // Ids grow, so the log cannot refuse one.
            let _ = t.alloc(trace_id, size, kind, sid.0);
        }
        self.live.insert(addr, Live { trace_id, bytes: size });
        self.requested += size;
        self.peak_requested = self.peak_requested.max(self.requested);
        self.allocated_total += rounded;
        self.collect_history();
        Ok(addr)
    }

    /// Frees `ptr` (a pointer of this device). `size` is checked against the
    /// request when given (non-zero).
    pub fn free(&mut self, ptr: u64, size: isize) -> Result<(), Failure> {
        let Some(live) = self.live.get(&ptr).copied() else {
            return Err(Failure::new(
                Cause::UnknownPointer,
                format!("free of {ptr:#x} ({size} bytes, device {}): not allocated here, or already freed", self.index),
            ));
        };
        if size > 0 && size as u64 != live.bytes {
            tracing::warn!("wasmem: free of {ptr:#x} says {size} bytes, it was allocated with {}", live.bytes);
        }
        // The allocator drops the handle before any device call that can fail
        // (releasing an emptied segment), so the pointer is gone either way.
        self.live.remove(&ptr);
        self.requested -= live.bytes;
        self.freed_total += wasmem::types::round_up(live.bytes, ALIGN).unwrap_or(live.bytes);
        let ev = Event::Free { id: live.trace_id, t_us: None };
        if let Some(t) = self.trace.as_mut() {
            let _ = t.free(live.trace_id);
        }
        self.observe(&ev);
        let r = self
            .engine
            .apply(&ev)
            .map(|_| ())
            .map_err(|e| Failure::new(Cause::FreeFailed, format!("free of {ptr:#x} failed: {e}")));
        self.collect_history();
        r
    }

    /// Gives the storage at `ptr` the kind `kind`; `Ok(false)` when `ptr` is
    /// not a live pointer of this device (a tensor of another allocator).
    pub fn retag(&mut self, ptr: u64, kind: TensorKind) -> Result<bool, Failure> {
        let Some(live) = self.live.get(&ptr).copied() else {
            return Ok(false);
        };
        self.engine
            .retag(live.trace_id, kind)
            .map_err(|e| Failure::new(Cause::AllocFailed, format!("re-tagging {ptr:#x}: {e}")))?;
        if let Some(t) = self.trace.as_mut() {
            let _ = t.retag(live.trace_id, kind);
        }
        Ok(true)
    }

    /// Marks a phase: the engine (its reclamation policy sees it), the shadow
    /// and the trace.
    pub fn phase(&mut self, phase: Phase, step: u64) -> Result<(), Failure> {
        let ev = Event::Phase { phase, step };
        self.observe(&ev);
        if let Some(t) = self.trace.as_mut() {
            t.phase(phase, step);
        }
        let r = self
            .engine
            .apply(&ev)
            .map(|_| ())
            .map_err(|e| Failure::new(Cause::AllocFailed, format!("device {}: phase {phase}: {e}", self.index)));
        self.collect_history();
        r
    }

    /// Releases the cached memory (`empty_cache`); returns the bytes.
    pub fn release_cached(&mut self) -> Result<u64, Failure> {
        let r = self
            .engine
            .release_cached()
            .map_err(|e| Failure::new(Cause::AllocFailed, format!("device {}: releasing the cache: {e}", self.index)));
        self.collect_history();
        r
    }

    /// Peaks back to the current values.
    pub fn reset_peaks(&mut self) {
        self.engine.reset_peaks();
        self.peak_requested = self.requested;
    }

    /// Keeps the last `max` allocator actions for snapshots (0: none).
    pub fn record_history(&mut self, max: usize) {
        self.collect_history();
        self.history_max = max;
        self.engine.record_actions(max > 0);
        while self.history.len() > max {
            self.history.pop_front();
        }
    }

    /// Moves recorded actions into the bounded history (every 1024
    /// allocations, and for every snapshot).
    fn collect_history(&mut self) {
        if self.history_max > 0 && self.next_trace_id.is_multiple_of(1024) {
            self.drain_history();
        }
    }

    fn drain_history(&mut self) {
        let actions = self.engine.take_actions();
        if self.history_max > 0 {
            self.history.extend(actions);
            while self.history.len() > self.history_max {
                self.history.pop_front();
            }
        }
    }

    /// This device's state and memory history in PyTorch's snapshot shape
    /// (`torch.cuda.memory._snapshot()`), as pickle bytes.
    pub fn snapshot(&mut self) -> Result<Vec<u8>, Failure> {
        self.drain_history();
        let segments = self.engine.segments();
        let device = u32::try_from(self.index).unwrap_or(0);
        let input = ExportInput { device, segments, trace: self.history.iter().cloned().collect() };
        export_bytes(&input).map_err(|e| Failure::new(Cause::Trace, format!("device {}: snapshot: {e}", self.index)))
    }

    /// This device's statistics: the allocator's `Stats` fields plus
    /// `device_index`, `policies` (placement, reclamation, eviction),
    /// `capacity_bytes`, `requested_bytes`,
    /// `peak_requested_bytes`, `allocated_bytes_total`, `freed_bytes_total`
    /// (rounded bytes of every allocation, of every free), `live_pointers`, `streams`, `trace_events`,
    /// `history_entries` and `shadow` (its status, or null).
    pub fn stats_json(&self) -> Value {
        let mut v = serde_json::to_value(self.engine.stats()).unwrap_or_else(|_| json!({}));
        if let Some(m) = v.as_object_mut() {
            m.insert("device_index".into(), json!(self.index));
            m.insert("policies".into(), json!(self.engine.controlled().policy_names()));
            m.insert("capacity_bytes".into(), json!(self.engine.capacity()));
            m.insert("requested_bytes".into(), json!(self.requested));
            m.insert("peak_requested_bytes".into(), json!(self.peak_requested));
            m.insert("allocated_bytes_total".into(), json!(self.allocated_total));
            m.insert("freed_bytes_total".into(), json!(self.freed_total));
            m.insert("live_pointers".into(), json!(self.live.len()));
            m.insert("streams".into(), json!(self.streams.len() + 1));
            m.insert("trace_events".into(), json!(self.trace.as_ref().map(|t| t.events().len())));
            m.insert("history_entries".into(), json!(self.history.len()));
            m.insert("shadow".into(), self.shadow.as_ref().map_or(Value::Null, |h| json!(h.status())));
        }
        v
    }

    /// Checks the module invariants.
    pub fn check(&self) -> Result<(), String> {
        self.engine.check().map_err(|e| format!("device {}: {e}", self.index))?;
        let s = self.engine.stats();
        if s.allocs - s.frees != self.live.len() as u64 {
            return Err(format!("{} live pointers but {} allocs − {} frees", self.live.len(), s.allocs, s.frees));
        }
        let requested: u64 = self.live.values().map(|l| l.bytes).sum();
        if requested != self.requested || self.peak_requested < self.requested {
            return Err(format!("requested {} (peak {}), recount {requested}", self.requested, self.peak_requested));
        }
        let rounded: u64 = self.live.values().map(|l| wasmem::types::round_up(l.bytes, ALIGN).unwrap_or(l.bytes)).sum();
        if self.allocated_total - self.freed_total != rounded {
            return Err(format!(
                "{} bytes allocated − {} freed, but {rounded} rounded bytes live",
                self.allocated_total, self.freed_total
            ));
        }
        let mut ids: Vec<u32> = self.streams.values().map(|s| s.0).collect();
        ids.sort_unstable();
        if ids.iter().enumerate().any(|(i, &s)| s != i as u32 + 1) {
            return Err(format!("stream ids are not 1..={}: {ids:?}", ids.len()));
        }
        if let Some(t) = &self.trace {
            t.check()?;
            if t.live_ids() != self.live.len() || self.live.values().any(|l| !t.is_live(l.trace_id)) {
                return Err("trace live ids differ from live pointers".into());
            }
        }
        if self.history.len() > self.history_max {
            return Err(format!("{} history entries, at most {}", self.history.len(), self.history_max));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Backend;
    use wasmem::device::sim::SimConfig;
    use wasmem::shadow::Shadow;
    use wasmem::spec::{resolve, Builtins};

    const MIB: u64 = 1 << 20;

    fn device(policy: &str, shadow: Option<&str>) -> DeviceState {
        let engine =
            crate::engine::open(Backend::Sim { capacity: 256 * MIB }, 0, resolve(policy, &Builtins).unwrap()).unwrap();
        let shadow = shadow.map(|s| {
            let cfg = SimConfig { capacity: 256 * MIB, ..SimConfig::default() };
            ShadowHandle::new(Shadow::from_resolved(s, resolve(s, &Builtins).unwrap(), cfg))
        });
        DeviceState::new(0, engine, shadow, true)
    }

    fn kinds(d: &DeviceState) -> Vec<TensorKind> {
        d.trace()
            .unwrap()
            .events()
            .iter()
            .filter_map(|e| match *e {
                Event::Alloc { kind, .. } => Some(kind),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn kinds_retags_phases_and_the_shadow_are_consistent() {
        let mut d = device("lifecycle", Some("pytorch"));
        let a = d.malloc(1000, TensorKind::Param, 0).unwrap();
        let b = d.malloc(3 * MIB, TensorKind::Temp, 0x77).unwrap();
        d.check().unwrap();
        assert!(d.retag(b, TensorKind::Activation).unwrap());
        assert!(!d.retag(0x1000, TensorKind::Grad).unwrap(), "a foreign pointer changes nothing");
        d.phase(Phase::Forward, 3).unwrap();
        d.free(b, 0).unwrap();
        assert!(d.free(b, 0).is_err(), "a second free is refused");
        d.check().unwrap();
        assert_eq!(kinds(&d), [TensorKind::Param, TensorKind::Activation]);
        let s = d.stats_json();
        assert_eq!(s["requested_bytes"], 1000);
        assert_eq!(s["peak_requested_bytes"], 1000 + 3 * MIB);
        assert_eq!(s["allocated_bytes_total"].as_u64().unwrap() - s["freed_bytes_total"].as_u64().unwrap(), 1024);
        assert_eq!(s["streams"], 2);
        assert_eq!(s["shadow"]["label"], "pytorch");
        assert_eq!(s["shadow"]["metrics"]["allocs"], 2, "the shadow saw both allocations");
        assert_eq!(s["shadow"]["metrics"]["frees"], 1);
        let _ = a;
    }

    #[test]
    fn empty_cache_peaks_and_snapshot_history() {
        let mut d = device("lifecycle", None);
        d.record_history(4);
        let ptrs: Vec<u64> = (1..=6).map(|i| d.malloc(i * MIB, TensorKind::Temp, 0).unwrap()).collect();
        for (i, &p) in ptrs.iter().enumerate().skip(1) {
            d.free(p, ((i + 1) as u64 * MIB) as isize).unwrap();
        }
        let before = d.engine().stats();
        let released = d.release_cached().unwrap();
        let after = d.engine().stats();
        assert_eq!(released, before.bytes.reserved_bytes - after.bytes.reserved_bytes);
        assert!(released > 0 && after.bytes.reserved_bytes >= after.bytes.allocated_bytes);
        d.reset_peaks();
        let s = d.stats_json();
        assert_eq!(s["peak_reserved_bytes"], s["reserved_bytes"]);
        assert_eq!(s["peak_requested_bytes"], s["requested_bytes"]);
        let snap = d.snapshot().unwrap();
        assert!(!snap.is_empty());
        d.check().unwrap();
        assert!(d.stats_json()["history_entries"].as_u64().unwrap() <= 4, "the history is bounded");
    }
}
