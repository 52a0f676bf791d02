//! Recorders: traces written by a client that sees tensor storages itself
//! instead of allocating them here (`wasmem.torch.Recorder` on PyTorch's
//! meta device, where nothing is allocated at all). Each is a [`TraceLog`]
//! with its own ids, behind a handle; the trace is written with the
//! engine's writer, so it is the same trace v1 a live run records.
//!
//! Handles are numbers from 1 up, never reused: a stale or unknown handle is
//! an error, never memory of another recorder.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Mutex, PoisonError};

use serde_json::{json, Value};
use wasmem::trace::TraceHeader;
use wasmem::types::{Phase, TensorKind};

use crate::log::Cause;
use crate::state::Failure;
use crate::tracelog::TraceLog;

/// One recorder.
#[derive(Debug, Default)]
struct Recorder {
    source: String,
    log: TraceLog,
    next_id: u64,
    allocs: u64,
    frees: u64,
    retags: u64,
    phases: u64,
}

#[derive(Debug, Default)]
struct Registry {
    next: i64,
    open: BTreeMap<i64, Recorder>,
}

static RECORDERS: Mutex<Registry> = Mutex::new(Registry { next: 0, open: BTreeMap::new() });

fn with<R>(handle: i64, f: impl FnOnce(&mut Recorder) -> Result<R, Failure>) -> Result<R, Failure> {
    let mut g = RECORDERS.lock().unwrap_or_else(PoisonError::into_inner);
    let r = g
        .open
        .get_mut(&handle)
        .ok_or_else(|| Failure::new(Cause::BadArgument, format!("recorder handle {handle} is not open")))?;
    f(r)
}

fn log_err(handle: i64) -> impl Fn(crate::tracelog::LogError) -> Failure {
    move |e| Failure::new(Cause::BadArgument, format!("recorder {handle}: {e}"))
}

/// Opens a recorder whose trace header says `source`; returns its handle.
pub fn open(source: &str) -> i64 {
    let mut g = RECORDERS.lock().unwrap_or_else(PoisonError::into_inner);
    g.next += 1;
    let h = g.next;
    g.open.insert(h, Recorder { source: source.to_string(), next_id: 1, ..Recorder::default() });
    h
}

/// Records an allocation; returns its trace id.
pub fn alloc(handle: i64, bytes: u64, kind: TensorKind, stream: u32) -> Result<u64, Failure> {
    with(handle, |r| {
        let id = r.next_id;
        r.log.alloc(id, bytes, kind, stream).map_err(log_err(handle))?;
        r.next_id += 1;
        r.allocs += 1;
        Ok(id)
    })
}

/// Records the free of trace id `id`.
pub fn free(handle: i64, id: u64) -> Result<(), Failure> {
    with(handle, |r| {
        r.log.free(id).map_err(log_err(handle))?;
        r.frees += 1;
        Ok(())
    })
}

/// Gives live trace id `id` the kind `kind` from its allocation on.
pub fn retag(handle: i64, id: u64, kind: TensorKind) -> Result<(), Failure> {
    with(handle, |r| {
        r.log.retag(id, kind).map_err(log_err(handle))?;
        r.retags += 1;
        Ok(())
    })
}

/// Records a phase mark.
pub fn phase(handle: i64, phase: Phase, step: u64) -> Result<(), Failure> {
    with(handle, |r| {
        r.log.phase(phase, step);
        r.phases += 1;
        Ok(())
    })
}

/// Writes the trace so far to `path` (`.gz`: compressed). The events are
/// copied under the registry's lock and written outside it.
pub fn save(handle: i64, path: &Path) -> Result<(), Failure> {
    let (source, log) = with(handle, |r| Ok((r.source.clone(), r.log.clone())))?;
    log.write(path, &TraceHeader { source, ranks: 1 })
        .map_err(|e| Failure::new(Cause::Trace, format!("writing the trace to {}: {e}", path.display())))
}

/// The recorder's counts: `events`, `allocs`, `frees`, `retags`, `phases`,
/// `live_tensors`, `live_bytes`, `peak_live_bytes`.
pub fn stats(handle: i64) -> Result<Value, Failure> {
    with(handle, |r| {
        Ok(json!({
            "events": r.log.events().len(),
            "allocs": r.allocs,
            "frees": r.frees,
            "retags": r.retags,
            "phases": r.phases,
            "live_tensors": r.log.live_ids(),
            "live_bytes": r.log.live_bytes(),
            "peak_live_bytes": r.log.peak_live_bytes(),
        }))
    })
}

/// Closes a recorder (its trace is dropped).
pub fn close(handle: i64) -> Result<(), Failure> {
    let mut g = RECORDERS.lock().unwrap_or_else(PoisonError::into_inner);
    g.open
        .remove(&handle)
        .map(|_| ())
        .ok_or_else(|| Failure::new(Cause::BadArgument, format!("recorder handle {handle} is not open")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_are_checked_and_ids_are_recorded() {
        let h = open("test");
        let a = alloc(h, 100, TensorKind::Temp, 0).unwrap();
        let b = alloc(h, 300, TensorKind::Param, 0).unwrap();
        phase(h, Phase::Forward, 0).unwrap();
        retag(h, a, TensorKind::Activation).unwrap();
        free(h, a).unwrap();
        assert!(free(h, a).unwrap_err().msg.contains("not live"));
        let s = stats(h).unwrap();
        assert_eq!((s["live_bytes"].as_u64(), s["peak_live_bytes"].as_u64()), (Some(300), Some(400)));
        assert_eq!(b, 2);
        close(h).unwrap();
        assert!(close(h).unwrap_err().msg.contains("not open"));
        assert!(alloc(h, 1, TensorKind::Temp, 0).is_err());
    }
}
