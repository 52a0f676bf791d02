//! The process-wide state behind the C ABI.
//!
//! Invariants (checked by [`State::check_invariants`] in the tests):
//! - `live` holds exactly the pointers handed out and not yet freed, each
//!   with the trace id the engine's driver maps to the allocator handle
//!   whose address it is:
//!   `|live| = stats.allocs − stats.frees` once the engine is open;
//! - `streams` maps each `cudaStream_t` seen to a distinct [`StreamId`]; the
//!   null (default) stream is stream 0;
//! - when tracing is on, the recorded events are a valid trace v1 whose live
//!   ids are exactly the `trace_id`s in `live`.
//!
//! The engine (allocator and device) is opened at the first allocation, on
//! the device that allocation names; the library serves that one device.

use std::path::Path;

use rustc_hash::FxHashMap;
use serde_json::{json, Value};
use wasmem::alloc::AllocError;
use wasmem::builtin;
use wasmem::decision::{PlannerPolicy, Policies, Role};
use wasmem::driver::DriveError;
use wasmem::spec::{Resolved, SpecError};
use wasmem::trace::{Event, TraceHeader};
use wasmem::types::InvariantError;
use wasmem::types::{StreamId, TensorKind};

use crate::config::{Backend, Config};
use crate::engine::{self, Engine};
use crate::log::{self, Cause};

/// Every request is rounded up to this many bytes, so that every block is
/// this well aligned whatever rounding the placement policy chooses (it is
/// also PyTorch's own smallest block).
pub const ALIGN: u64 = 512;

/// A refused or failed call: why, and the message to log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    /// The cause it is counted under.
    pub cause: Cause,
    /// What to log.
    pub msg: String,
}

impl Failure {
    /// A failure of `cause` with message `msg`.
    pub fn new(cause: Cause, msg: impl Into<String>) -> Self {
        Failure { cause, msg: msg.into() }
    }
}

/// One pointer handed out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Live {
    trace_id: u64,
    bytes: u64,
}

/// Resolves a policy spec: built-in names without starting the WebAssembly
/// runtime, components through the global one ([`wasmem::policy::resolve`]).
pub fn resolve_spec(spec: &str) -> Result<Resolved, SpecError> {
    wasmem::policy::resolve(spec)
}

/// The configured policy does not resolve.
#[derive(Debug, thiserror::Error)]
#[error("WASMEM_POLICY=`{spec}` does not resolve: {cause}")]
pub struct PolicyConfigError {
    /// The spec.
    pub spec: String,
    /// Why.
    pub cause: SpecError,
}

/// The library's state (see the module documentation).
pub struct State {
    config: Config,
    /// The spec of the policies in force.
    policy: String,
    engine: Option<Box<dyn Engine>>,
    /// The device ordinal the engine serves.
    ordinal: Option<i32>,
    /// Why the engine could not be opened (then every allocation is refused).
    open_error: Option<String>,
    /// Policies for the engine, until it opens.
    pending: Option<Policies>,
    /// The planner for the engine, until it opens.
    pending_planner: Option<Box<dyn PlannerPolicy>>,
    live: FxHashMap<u64, Live>,
    streams: FxHashMap<usize, StreamId>,
    trace: Option<Vec<Event>>,
    next_trace_id: u64,
}

impl std::fmt::Debug for State {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("State")
            .field("config", &self.config)
            .field("policy", &self.policy)
            .field("ordinal", &self.ordinal)
            .field("live", &self.live.len())
            .finish_non_exhaustive()
    }
}

impl State {
    /// A state for `config`: resolves its policy spec now (the device is
    /// opened at the first allocation).
    pub fn new(config: Config) -> Result<State, PolicyConfigError> {
        let resolved =
            resolve_spec(&config.policy).map_err(|cause| PolicyConfigError { spec: config.policy.clone(), cause })?;
        let (policies, planner) = (resolved.policies, resolved.planner);
        Ok(State {
            policy: config.policy.clone(),
            trace: config.trace_out.as_ref().map(|_| Vec::new()),
            config,
            engine: None,
            ordinal: None,
            open_error: None,
            pending: Some(policies),
            pending_planner: planner,
            live: FxHashMap::default(),
            streams: FxHashMap::default(),
            next_trace_id: 1,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The engine for `device`, opened on first use.
    fn engine_for(&mut self, device: i32) -> Result<&mut dyn Engine, Failure> {
        if let Some(e) = &self.open_error {
            return Err(Failure::new(Cause::Init, e.clone()));
        }
        match self.ordinal {
            Some(d) if d != device => {
                return Err(Failure::new(
                    Cause::WrongDevice,
                    format!("this library serves device {d} only; a request for device {device} was refused"),
                ))
            }
            Some(_) => {}
            None => {
                let ordinal = usize::try_from(device)
                    .map_err(|_| Failure::new(Cause::WrongDevice, format!("invalid device index {device}")))?;
                let policies = self.pending.take().unwrap_or_else(builtin::default_policies);
                let planner = self.pending_planner.take();
                match engine::open(self.config.backend, ordinal, policies, planner) {
                    Ok(e) => {
                        tracing::info!(
                            "wasmem: serving {} device {device} ({} bytes) with policy `{}`",
                            e.device_name(),
                            e.capacity(),
                            self.policy
                        );
                        self.engine = Some(e);
                        self.ordinal = Some(device);
                    }
                    Err(e) => {
                        let msg = format!("cannot open the {} device {device}: {e}", self.backend_name());
                        self.open_error = Some(msg.clone());
                        return Err(Failure::new(Cause::Init, msg));
                    }
                }
            }
        }
        Ok(self.engine.as_deref_mut().expect("the engine is open"))
    }

    fn backend_name(&self) -> &'static str {
        match self.config.backend {
            Backend::Cuda => "cuda",
            Backend::Sim { .. } => "sim",
        }
    }

    /// The [`StreamId`] of a `cudaStream_t` value (the null stream is 0).
    fn stream_id(&mut self, stream: usize) -> StreamId {
        if stream == 0 {
            return StreamId(0);
        }
        let next = StreamId(self.streams.len() as u32 + 1);
        *self.streams.entry(stream).or_insert(next)
    }

    /// Allocates `size` bytes on `device` for `stream`. `Ok(0)` (null) for a
    /// zero size, as PyTorch's own allocator answers.
    pub fn malloc(&mut self, size: isize, device: i32, stream: usize) -> Result<u64, Failure> {
        let size = match u64::try_from(size) {
            Ok(0) => return Ok(0),
            Ok(s) => s,
            Err(_) => return Err(Failure::new(Cause::NegativeSize, format!("negative size {size} requested"))),
        };
        let rounded = wasmem::types::round_up(size, ALIGN)
            .ok_or_else(|| Failure::new(Cause::AllocFailed, format!("size {size} overflows when rounded")))?;
        let sid = self.stream_id(stream);
        let trace_id = self.next_trace_id;
        let ev = Event::Alloc { id: trace_id, bytes: rounded, kind: TensorKind::Other, stream: sid.0, t_us: None };
        let got = self.engine_for(device)?.apply(&ev).map_err(|e| match e {
            DriveError::Alloc { cause: e @ AllocError::OutOfMemory { .. }, .. } => {
                Failure::new(Cause::OutOfMemory, e.to_string())
            }
            DriveError::Alloc { cause, .. } => {
                Failure::new(Cause::AllocFailed, format!("allocation of {size} bytes failed: {cause}"))
            }
            e => Failure::new(Cause::AllocFailed, format!("allocation of {size} bytes failed: {e}")),
        })?;
        let engine = self.engine.as_deref_mut().expect("opened above");
        let Some((_, addr)) = got else {
            return Err(Failure::new(Cause::AllocFailed, format!("allocation of {size} bytes got no storage")));
        };
        if addr == 0 || addr % ALIGN != 0 || self.live.contains_key(&addr) {
            // Cannot happen with a sound device; refuse rather than hand out a bad pointer.
            let _ = engine.apply(&Event::Free { id: trace_id, t_us: None });
            return Err(Failure::new(Cause::AllocFailed, format!("the device returned an unusable address {addr:#x}")));
        }
        self.next_trace_id += 1;
        if let Some(t) = self.trace.as_mut() {
            t.push(Event::Alloc { id: trace_id, bytes: size, kind: TensorKind::Other, stream: sid.0, t_us: None });
        }
        self.live.insert(addr, Live { trace_id, bytes: size });
        Ok(addr)
    }

    /// Frees `ptr` (null: nothing to do). `size` is checked against the
    /// request when given (non-zero); `device` and `stream` are those of the
    /// allocation and not otherwise needed.
    pub fn free(&mut self, ptr: u64, size: isize, device: i32) -> Result<(), Failure> {
        if ptr == 0 {
            return Ok(());
        }
        let Some(live) = self.live.get(&ptr).copied() else {
            return Err(Failure::new(
                Cause::UnknownPointer,
                format!("free of {ptr:#x} ({size} bytes, device {device}): not allocated here, or already freed"),
            ));
        };
        if size > 0 && size as u64 != live.bytes {
            tracing::warn!("wasmem: free of {ptr:#x} says {size} bytes, it was allocated with {}", live.bytes);
        }
        // The allocator drops the handle before any device call that can fail
        // (releasing an emptied segment), so the pointer is gone either way.
        self.live.remove(&ptr);
        if let Some(t) = self.trace.as_mut() {
            t.push(Event::Free { id: live.trace_id, t_us: None });
        }
        let engine = self.engine.as_deref_mut().expect("a live pointer implies an open engine");
        engine
            .apply(&Event::Free { id: live.trace_id, t_us: None })
            .map(|_| ())
            .map_err(|e| Failure::new(Cause::FreeFailed, format!("free of {ptr:#x} failed: {e}")))
    }

    /// Swaps in the roles `new` provides (the one swap: state carried
    /// between instances of the same policy); before the engine opens, they
    /// replace those roles of the policies it will open with.
    pub fn swap(&mut self, new: Resolved) -> Result<(), Failure> {
        let spec = new.spec.clone();
        match self.engine.as_deref_mut() {
            Some(e) => {
                e.swap(new).map_err(|e| Failure::new(Cause::Policy, format!("swap to `{spec}` refused: {e}")))?;
            }
            None => {
                let provided = new.provided();
                if new.planner.is_some() {
                    self.pending_planner = new.planner;
                }
                let p = self.pending.get_or_insert_with(builtin::default_policies);
                let Policies { placement, reclamation, eviction } = new.policies;
                if provided.contains(&Role::Placement) {
                    p.placement = placement;
                }
                if provided.contains(&Role::Reclamation) {
                    p.reclamation = reclamation;
                }
                if provided.contains(&Role::Eviction) {
                    p.eviction = eviction;
                }
            }
        }
        self.policy = spec;
        Ok(())
    }

    /// The statistics as a JSON object: the allocator's [`Stats`] fields
    /// (`live_bytes`, `peak_reserved_bytes`, `allocs`, …) plus `device`,
    /// `device_index`, `capacity_bytes`, `policy`, `live_pointers`,
    /// `streams`, `trace_events` (null when tracing is off) and `errors`
    /// (counts by cause).
    ///
    /// [`Stats`]: wasmem::alloc::Stats
    pub fn stats_json(&self) -> Value {
        let stats = self.engine.as_ref().map(|e| e.stats()).unwrap_or_default();
        let mut v = serde_json::to_value(&stats).unwrap_or_else(|_| json!({}));
        if let Some(m) = v.as_object_mut() {
            m.insert("device".into(), json!(self.backend_name()));
            m.insert("device_index".into(), json!(self.ordinal));
            m.insert("capacity_bytes".into(), json!(self.engine.as_ref().map(|e| e.capacity())));
            m.insert("policy".into(), json!(self.policy));
            m.insert("live_pointers".into(), json!(self.live.len()));
            m.insert("streams".into(), json!(self.streams.len() + 1));
            m.insert("trace_events".into(), json!(self.trace.as_ref().map(Vec::len)));
            m.insert("errors".into(), json!(log::counts()));
        }
        v
    }

    /// The header and a copy of the events recorded so far, to be written
    /// outside the lock.
    pub fn trace_snapshot(&self) -> Result<(TraceHeader, Vec<Event>), Failure> {
        let events = self.trace.as_ref().ok_or_else(|| {
            Failure::new(Cause::Trace, "tracing is off: set WASMEM_TRACE_OUT before the first allocation")
        })?;
        let device = match self.ordinal {
            Some(d) => format!("{}:{d}", self.backend_name()),
            None => self.backend_name().to_string(),
        };
        let source = format!("wasmem-capi (PyTorch pluggable allocator), device {device}, policy {}", self.policy);
        Ok((TraceHeader { source, ranks: 1 }, events.clone()))
    }

    /// Checks the invariants of the module documentation.
    pub fn check_invariants(&self) -> Result<(), InvariantError> {
        self.check_all().map_err(InvariantError)
    }

    fn check_all(&self) -> Result<(), String> {
        if let Some(e) = &self.engine {
            let s = e.stats();
            if s.allocs - s.frees != self.live.len() as u64 {
                return Err(format!("{} live pointers but {} allocs − {} frees", self.live.len(), s.allocs, s.frees));
            }
        } else if !self.live.is_empty() {
            return Err("live pointers without an engine".into());
        }
        let mut ids: Vec<u32> = self.streams.values().map(|s| s.0).collect();
        ids.sort_unstable();
        if ids.iter().enumerate().any(|(i, &s)| s != i as u32 + 1) {
            return Err(format!("stream ids are not 1..={}: {ids:?}", ids.len()));
        }
        if let Some(t) = &self.trace {
            let mut open: FxHashMap<u64, ()> = FxHashMap::default();
            for ev in t {
                match *ev {
                    Event::Alloc { id, .. } => open.insert(id, ()).map_or(Ok(()), |_| Err(format!("id {id} reused"))),
                    Event::Free { id, .. } => open.remove(&id).ok_or(format!("free of dead id {id}")),
                    _ => Err("unexpected event".to_string()),
                }?;
            }
            if open.len() != self.live.len() || self.live.values().any(|l| !open.contains_key(&l.trace_id)) {
                return Err("trace live ids differ from live pointers".into());
            }
        }
        Ok(())
    }
}

/// Writes a trace file (outside the lock).
pub fn write_trace(path: &Path, header: &TraceHeader, events: &[Event]) -> Result<(), Failure> {
    wasmem::trace::write_file(path, header, events)
        .map_err(|e| Failure::new(Cause::Trace, format!("writing the trace to {}: {e}", path.display())))
}
