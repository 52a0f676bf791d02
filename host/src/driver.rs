//! The one driver: applies trace events ([`Event`]) to an allocator, keeps
//! the map from the client's ids to the allocator's handles, the live bytes
//! and the event counts of the [`Metrics`].
//!
//! Every client that speaks in events uses it: the trace replay, the shadow
//! A/B, a ZeRO rank's memory (`shard::engine`) and the C ABI behind
//! PyTorch. So a reused live id, a free or use of an unknown id and an
//! allocator failure are the same typed [`DriveError`] everywhere, and
//! `peak_live_bytes` is counted the same way: from the events, independent of
//! the policy and of OOMs.
//!
//! Invariants: `live = Σ bytes of the ids in the map`; an id is in the map
//! from its successful `alloc` to its `free`; a mapped id holds a live
//! allocator handle, or none for a zero-byte request or (with
//! [`OnOom::Outcome`]) a request that failed for lack of memory.
//!
//! Out of memory is an *outcome* for a replay (counted by the allocator in
//! `ooms`, the first one named in `first_oom`; the tensor is tracked without
//! storage and its later events are no-ops) and an *error* for a live client
//! that must tell its caller ([`OnOom`]).

use std::collections::hash_map::Entry;

use rustc_hash::FxHashMap;

use crate::alloc::{AllocError, Allocator};
use crate::device::Device;
use crate::metrics::Metrics;
use crate::trace::Event;
use crate::types::{Phase, StreamId, TensorId};

/// What an out-of-memory failure of a request means.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnOom {
    /// An outcome to report: the tensor is tracked without storage (replays, shadows).
    #[default]
    Outcome,
    /// An error for the caller; the event is not applied (live clients).
    Error,
}

/// Why an event could not be applied. Nothing changed, except as noted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DriveError {
    /// An `alloc` of an id that is live.
    #[error("event {event}: trace id {id} is already live")]
    ReusedId {
        /// Index of the event (0-based).
        event: u64,
        /// The id.
        id: u64,
    },
    /// A `free` or `use` of an id that is not live.
    #[error("event {event}: tensor id {id} is not live")]
    UnknownId {
        /// Index of the event.
        event: u64,
        /// The id.
        id: u64,
    },
    /// The allocator refused the event (with [`OnOom::Error`], also out of memory).
    #[error("event {event}: {cause}")]
    Alloc {
        /// Index of the event.
        event: u64,
        /// The allocator's error.
        cause: AllocError,
    },
}

impl DriveError {
    /// Index of the event that failed.
    pub fn event(&self) -> u64 {
        match self {
            DriveError::ReusedId { event, .. }
            | DriveError::UnknownId { event, .. }
            | DriveError::Alloc { event, .. } => *event,
        }
    }
}

/// A mapped id: its handle (none for zero bytes or an OOM outcome) and bytes.
#[derive(Debug, Clone, Copy)]
struct Slot {
    handle: Option<TensorId>,
    bytes: u64,
}

/// Applies events to an allocator (see the module documentation).
#[derive(Debug, Default)]
pub struct Driver {
    ids: FxHashMap<u64, Slot>,
    live: u64,
    /// Peak of `live` since the last [`Driver::mark`].
    window_peak: u64,
    on_oom: OnOom,
    /// Event-derived keys: events, allocs, frees, peak live, zero-byte
    /// allocs, steps, bytes allocated, first OOM.
    m: Metrics,
}

impl Driver {
    /// A driver with no live id.
    pub fn new(on_oom: OnOom) -> Self {
        Driver { on_oom, ..Driver::default() }
    }

    /// Applies `ev` to `alloc`; returns the new handle of an `alloc` that got
    /// storage. `next_use` (a replay with look-ahead) is the position of the
    /// tensor's next use, passed to the allocator for offline eviction.
    #[inline]
    pub fn apply<D: Device>(
        &mut self,
        alloc: &mut Allocator<D>,
        ev: &Event,
        next_use: Option<u64>,
    ) -> Result<Option<TensorId>, DriveError> {
        let n = self.m.events;
        self.m.events += 1;
        let err = |cause| DriveError::Alloc { event: n, cause };
        match *ev {
            Event::Alloc { id, bytes, kind, stream, .. } => {
                self.m.allocs += 1;
                self.m.bytes_allocated += bytes;
                let vacant = match self.ids.entry(id) {
                    Entry::Occupied(_) => return Err(DriveError::ReusedId { event: n, id }),
                    Entry::Vacant(v) => v,
                };
                let handle = if bytes == 0 {
                    self.m.zero_byte_allocs += 1;
                    None
                } else {
                    match alloc.alloc(bytes, kind, StreamId(stream)) {
                        Ok(h) => {
                            if next_use.is_some() {
                                alloc.set_next_use(h, next_use);
                            }
                            Some(h)
                        }
                        Err(e @ AllocError::OutOfMemory { .. }) if self.on_oom == OnOom::Outcome => {
                            self.m.first_oom.get_or_insert_with(|| format!("event {n}: {e}"));
                            None
                        }
                        Err(e) => return Err(err(e)),
                    }
                };
                vacant.insert(Slot { handle, bytes });
                self.live += bytes;
                self.m.peak_live_bytes = self.m.peak_live_bytes.max(self.live);
                self.window_peak = self.window_peak.max(self.live);
                Ok(handle)
            }
            Event::Free { id, .. } => {
                self.m.frees += 1;
                let slot = self.ids.remove(&id).ok_or(DriveError::UnknownId { event: n, id })?;
                self.live -= slot.bytes;
                if let Some(h) = slot.handle {
                    alloc.free(h).map_err(err)?;
                }
                Ok(None)
            }
            Event::Use { id, stream } => {
                let slot = *self.ids.get(&id).ok_or(DriveError::UnknownId { event: n, id })?;
                if let Some(h) = slot.handle {
                    match alloc.use_tensor(h, stream.map(StreamId)) {
                        Ok(()) => {
                            if next_use.is_some() {
                                alloc.set_next_use(h, next_use);
                            }
                        }
                        // Bringing it back failed after every remedy: an
                        // outcome, the tensor stays where it is.
                        Err(e @ AllocError::OutOfMemory { .. }) if self.on_oom == OnOom::Outcome => {
                            self.m.first_oom.get_or_insert_with(|| format!("event {n} (use of trace id {id}): {e}"));
                        }
                        Err(e) => return Err(err(e)),
                    }
                }
                Ok(None)
            }
            Event::Phase { phase, step } => {
                if phase == Phase::StepEnd {
                    self.m.steps += 1;
                }
                alloc.phase(phase, step).map_err(err)?;
                Ok(None)
            }
        }
    }

    /// The allocator handle of a live id (`None` for an unknown id, a
    /// zero-byte tensor or an OOM outcome).
    pub fn handle(&self, id: u64) -> Option<TensorId> {
        self.ids.get(&id).and_then(|s| s.handle)
    }

    /// Requested bytes of a live id.
    pub fn bytes(&self, id: u64) -> Option<u64> {
        self.ids.get(&id).map(|s| s.bytes)
    }

    /// Whether `id` is live.
    pub fn is_live(&self, id: u64) -> bool {
        self.ids.contains_key(&id)
    }

    /// Number of live ids.
    pub fn live_ids(&self) -> usize {
        self.ids.len()
    }

    /// Requested bytes of the live ids.
    pub fn live_bytes(&self) -> u64 {
        self.live
    }

    /// Events applied (or attempted) so far.
    pub fn events(&self) -> u64 {
        self.m.events
    }

    /// Steps seen (`phase step_end` markers).
    pub fn steps(&self) -> u64 {
        self.m.steps
    }

    /// The event-derived keys only (events, allocs, frees, peak live,
    /// zero-byte allocs, steps, bytes allocated, first OOM).
    pub fn counts(&self) -> &Metrics {
        &self.m
    }

    /// Every key but the timing ones: the event counts and what `alloc`
    /// (the allocator this driver drives) reports.
    pub fn metrics<D: Device>(&self, alloc: &Allocator<D>) -> Metrics {
        let mut m = self.m.clone();
        m.fill_from(alloc);
        m
    }

    /// Starts a window (e.g. the second half of a split replay): its peak
    /// of live bytes starts from the current live bytes.
    pub fn mark(&mut self) {
        self.window_peak = self.live;
    }

    /// Peak of the live bytes since the last [`Driver::mark`] (since the start without one).
    pub fn window_peak(&self) -> u64 {
        self.window_peak
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::sim::SimDevice;
    use crate::types::{TensorKind, GIB, MIB};

    fn alloc(id: u64, bytes: u64) -> Event {
        Event::Alloc { id, bytes, kind: TensorKind::Activation, stream: 0, t_us: None }
    }

    #[test]
    fn errors_are_typed_and_change_nothing() {
        let mut a = Allocator::with_builtin(SimDevice::with_capacity(GIB), "pytorch").unwrap();
        let mut d = Driver::new(OnOom::Outcome);
        assert!(d.apply(&mut a, &alloc(1, MIB), None).unwrap().is_some());
        assert_eq!(d.apply(&mut a, &alloc(1, MIB), None), Err(DriveError::ReusedId { event: 1, id: 1 }));
        assert_eq!(
            d.apply(&mut a, &Event::Free { id: 9, t_us: None }, None),
            Err(DriveError::UnknownId { event: 2, id: 9 })
        );
        assert_eq!(
            d.apply(&mut a, &Event::Use { id: 9, stream: None }, None),
            Err(DriveError::UnknownId { event: 3, id: 9 })
        );
        assert_eq!((d.live_bytes(), d.live_ids(), a.live_tensors()), (MIB, 1, 1));
        d.apply(&mut a, &Event::Free { id: 1, t_us: None }, None).unwrap();
        assert_eq!((d.live_bytes(), a.live_tensors()), (0, 0));
        a.check_invariants().unwrap();
    }

    #[test]
    fn oom_is_an_outcome_or_an_error() {
        for (mode, fails) in [(OnOom::Outcome, false), (OnOom::Error, true)] {
            let mut a = Allocator::with_builtin(SimDevice::with_capacity(4 * MIB), "naive").unwrap();
            let mut d = Driver::new(mode);
            d.apply(&mut a, &alloc(1, 3 * MIB), None).unwrap();
            let r = d.apply(&mut a, &alloc(2, 3 * MIB), None);
            assert_eq!(r.is_err(), fails, "{mode:?}: {r:?}");
            assert_eq!(d.is_live(2), !fails);
            let m = d.metrics(&a);
            assert_eq!(m.ooms, 1);
            assert_eq!(m.first_oom.is_some(), !fails);
            assert_eq!(d.live_bytes(), if fails { 3 * MIB } else { 6 * MIB });
        }
    }
}
