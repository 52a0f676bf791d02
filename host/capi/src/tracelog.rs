//! An allocation trace kept in memory while a process runs, with
//! re-tagging: a tensor's kind, learnt after its allocation (PyTorch: a
//! gradient, an activation saved for backward, an optimizer state), is
//! written into its `alloc` event, so the trace tells each tensor's real
//! kind from its allocation on. Written as trace v1 by the engine's writer.
//!
//! Invariants: the events are a valid trace v1 (ids unique, frees and
//! re-tags of live ids only); `live` maps each live id to the index of its
//! `alloc` event.

use std::path::Path;

use rustc_hash::FxHashMap;
use wasmem::trace::{Event, TraceError, TraceHeader};
use wasmem::types::{Phase, TensorKind};

/// Why an event was refused (nothing was recorded).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LogError {
    /// An `alloc` of an id that is live or was used before.
    #[error("trace id {0} is already used")]
    Reused(u64),
    /// A `free` or re-tag of an id that is not live.
    #[error("trace id {0} is not live")]
    NotLive(u64),
}

/// An in-memory trace (see the module documentation).
#[derive(Debug, Default, Clone)]
pub struct TraceLog {
    events: Vec<Event>,
    live: FxHashMap<u64, usize>,
    /// Largest id allocated so far (ids must grow: never reused).
    last_id: Option<u64>,
    live_bytes: u64,
    peak_live_bytes: u64,
}

impl TraceLog {
    /// An empty trace.
    pub fn new() -> Self {
        TraceLog::default()
    }

    /// Records an allocation of `bytes` (requested) with id `id`, which must
    /// be larger than every id before.
    pub fn alloc(&mut self, id: u64, bytes: u64, kind: TensorKind, stream: u32) -> Result<(), LogError> {
        if self.last_id.is_some_and(|l| id <= l) {
            return Err(LogError::Reused(id));
        }
        self.last_id = Some(id);
        self.live.insert(id, self.events.len());
        self.events.push(Event::Alloc { id, bytes, kind, stream, t_us: None });
        self.live_bytes += bytes;
        self.peak_live_bytes = self.peak_live_bytes.max(self.live_bytes);
        Ok(())
    }

    /// Records the free of live id `id`.
    pub fn free(&mut self, id: u64) -> Result<(), LogError> {
        let at = self.live.remove(&id).ok_or(LogError::NotLive(id))?;
        if let Event::Alloc { bytes, .. } = self.events[at] {
            self.live_bytes -= bytes;
        }
        self.events.push(Event::Free { id, t_us: None });
        Ok(())
    }

    /// Gives live id `id` the kind `kind` from its allocation on.
    pub fn retag(&mut self, id: u64, kind: TensorKind) -> Result<(), LogError> {
        let at = *self.live.get(&id).ok_or(LogError::NotLive(id))?;
        if let Event::Alloc { kind: k, .. } = &mut self.events[at] {
            *k = kind;
        }
        Ok(())
    }

    /// Records a phase mark.
    pub fn phase(&mut self, phase: Phase, step: u64) {
        self.events.push(Event::Phase { phase, step });
    }

    /// The events so far.
    pub fn events(&self) -> &[Event] {
        &self.events
    }

    /// Whether `id` is live.
    pub fn is_live(&self, id: u64) -> bool {
        self.live.contains_key(&id)
    }

    /// Live ids.
    pub fn live_ids(&self) -> usize {
        self.live.len()
    }

    /// Requested bytes of the live ids.
    pub fn live_bytes(&self) -> u64 {
        self.live_bytes
    }

    /// Peak of [`Self::live_bytes`].
    pub fn peak_live_bytes(&self) -> u64 {
        self.peak_live_bytes
    }

    /// Writes the trace (`.gz`: compressed) with the engine's trace writer.
    pub fn write(&self, path: &Path, header: &TraceHeader) -> Result<(), TraceError> {
        wasmem::trace::write_file(path, header, &self.events)
    }

    /// Checks the module invariants by a recount.
    pub fn check(&self) -> Result<(), String> {
        let mut open: FxHashMap<u64, usize> = FxHashMap::default();
        let mut live = 0u64;
        for (i, ev) in self.events.iter().enumerate() {
            match *ev {
                Event::Alloc { id, bytes, .. } => {
                    if open.insert(id, i).is_some() {
                        return Err(format!("id {id} reused"));
                    }
                    live += bytes;
                }
                Event::Free { id, .. } => {
                    let at = open.remove(&id).ok_or(format!("free of dead id {id}"))?;
                    if let Event::Alloc { bytes, .. } = self.events[at] {
                        live -= bytes;
                    }
                }
                Event::Use { .. } => return Err("unexpected use event".into()),
                Event::Phase { .. } => {}
            }
        }
        if open != self.live {
            return Err(format!("{} live ids recounted, {} recorded", open.len(), self.live.len()));
        }
        if live != self.live_bytes {
            return Err(format!("live bytes recounted {live}, recorded {}", self.live_bytes));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retags_rewrite_the_alloc_and_bad_ids_are_refused() {
        let mut t = TraceLog::new();
        t.alloc(1, 100, TensorKind::Temp, 0).unwrap();
        t.alloc(2, 50, TensorKind::Temp, 0).unwrap();
        t.phase(Phase::Backward, 0);
        t.retag(1, TensorKind::Grad).unwrap();
        t.free(2).unwrap();
        assert_eq!(t.free(2), Err(LogError::NotLive(2)));
        assert_eq!(t.retag(2, TensorKind::Param), Err(LogError::NotLive(2)));
        assert_eq!(t.alloc(2, 1, TensorKind::Temp, 0), Err(LogError::Reused(2)));
        assert!(matches!(t.events()[0], Event::Alloc { id: 1, kind: TensorKind::Grad, .. }));
        assert_eq!((t.live_bytes(), t.peak_live_bytes(), t.live_ids()), (100, 150, 1));
        t.check().unwrap();
        let dir = std::env::temp_dir().join(format!("wasmem-tracelog-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("t.jsonl.gz");
        t.write(&p, &TraceHeader::default()).unwrap();
        assert_eq!(wasmem::trace::read_file(&p).unwrap().1, t.events());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
