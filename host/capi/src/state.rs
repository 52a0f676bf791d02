//! The process-wide state behind the C ABI: the configuration, one
//! [`DeviceState`] per device used, and the policy history.
//!
//! Each device's engine (allocator and device) is opened at the first
//! allocation on that device, under the configured policy with every swap
//! made since replayed on it through the one swap, so that every device of
//! the process runs the same policies whenever it opened. Its shadow (when
//! configured) is opened with it.
//!
//! Invariants (checked by [`State::check_invariants`] in the tests): each
//! device's ([`DeviceState::check`]); a device is open or failed to open,
//! never both.

use std::collections::BTreeMap;

use serde_json::{json, Map, Value};
use wasmem::alloc::swap::SwapOptions;
use wasmem::ctl::{ControlledRank, PreparedSwap, RoleArg, SwapOutcome};
use wasmem::decision::Role;
use wasmem::device::sim::SimConfig;
use wasmem::shadow::{Shadow, ShadowHandle};
use wasmem::spec::{Resolved, SpecError};
use wasmem::trace::{Event, TraceHeader};
use wasmem::types::{InvariantError, Phase, TensorKind};

use crate::config::{Backend, Config};
use crate::device::DeviceState;
pub use crate::device::ALIGN;
use crate::engine;
use crate::log::{self, Cause};

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

/// Resolves a policy spec: built-in names without starting the WebAssembly
/// runtime, components through the global one ([`wasmem::policy::resolve`]).
pub fn resolve_spec(spec: &str) -> Result<Resolved, SpecError> {
    wasmem::policy::resolve(spec)
}

/// A configured policy spec does not resolve.
#[derive(Debug, thiserror::Error)]
#[error("{setting}=`{spec}` does not resolve: {cause}")]
pub struct PolicyConfigError {
    /// The setting (`WASMEM_POLICY`, `WASMEM_SHADOW`).
    pub setting: &'static str,
    /// The spec.
    pub spec: String,
    /// Why.
    pub cause: Box<SpecError>,
}

/// What a control status needs of one open device: its index, its
/// allocator and its shadow.
pub type DeviceStatusInput = (i32, std::sync::Arc<dyn ControlledRank>, Option<ShadowHandle>);

/// The library's state (see the module documentation).
pub struct State {
    config: Config,
    /// What the policies in force are, in words (the spec, then the swaps).
    policy: String,
    /// The configured spec resolved once, for the first device to open.
    pending: Option<Resolved>,
    /// Swaps since the start, replayed on devices that open later.
    swaps: Vec<(SwapOptions, String)>,
    devices: BTreeMap<i32, DeviceState>,
    /// Why a device could not be opened (then its allocations are refused).
    open_errors: BTreeMap<i32, String>,
    /// The last phase mark and its step.
    phase: Option<(Phase, u64)>,
    /// Memory history entries kept per device (0: off).
    history_max: usize,
}

impl std::fmt::Debug for State {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("State")
            .field("config", &self.config)
            .field("policy", &self.policy)
            .field("devices", &self.devices.keys().collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

impl State {
    /// A state for `config`: resolves its policy and shadow specs now (the
    /// devices are opened at their first allocation).
    pub fn new(config: Config) -> Result<State, PolicyConfigError> {
        let pending = resolve_spec(&config.policy).map_err(|cause| PolicyConfigError {
            setting: "WASMEM_POLICY",
            spec: config.policy.clone(),
            cause: Box::new(cause),
        })?;
        if let Some(s) = &config.shadow {
            resolve_spec(s).map_err(|cause| PolicyConfigError {
                setting: "WASMEM_SHADOW",
                spec: s.clone(),
                cause: Box::new(cause),
            })?;
        }
        Ok(State {
            policy: config.policy.clone(),
            pending: Some(pending),
            config,
            swaps: Vec::new(),
            devices: BTreeMap::new(),
            open_errors: BTreeMap::new(),
            phase: None,
            history_max: 0,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.config
    }

    fn backend_name(&self) -> &'static str {
        match self.config.backend {
            Backend::Cuda => "cuda",
            Backend::Sim { .. } => "sim",
        }
    }

    /// The state of `device`, opened on first use.
    fn device(&mut self, device: i32) -> Result<&mut DeviceState, Failure> {
        if let Some(e) = self.open_errors.get(&device) {
            return Err(Failure::new(Cause::Init, e.clone()));
        }
        if !self.devices.contains_key(&device) {
            let d = self.open(device).inspect_err(|f| {
                if f.cause == Cause::Init {
                    self.open_errors.insert(device, f.msg.clone());
                }
            })?;
            self.devices.insert(device, d);
        }
        Ok(self.devices.get_mut(&device).expect("opened above"))
    }

    fn open(&mut self, device: i32) -> Result<DeviceState, Failure> {
        let ordinal = usize::try_from(device)
            .map_err(|_| Failure::new(Cause::WrongDevice, format!("invalid device index {device}")))?;
        if matches!(self.config.backend, Backend::Sim { .. }) && ordinal >= self.config.sim_devices as usize {
            return Err(Failure::new(
                Cause::WrongDevice,
                format!("no sim device {device}: there are {} (WASMEM_SIM_DEVICES)", self.config.sim_devices),
            ));
        }
        let resolved = match self.pending.take() {
            Some(r) => r,
            None => resolve_spec(&self.config.policy).map_err(|e| {
                Failure::new(Cause::Init, format!("device {device}: policy `{}`: {e}", self.config.policy))
            })?,
        };
        let mut engine = engine::open(self.config.backend, ordinal, resolved).map_err(|e| {
            Failure::new(Cause::Init, format!("cannot open the {} device {device}: {e}", self.backend_name()))
        })?;
        for (opts, spec) in &self.swaps {
            let applied = resolve_spec(spec)
                .map_err(|e| e.to_string())
                .and_then(|r| engine.swap(r, opts).map(|_| ()).map_err(|e| e.to_string()));
            if let Err(e) = applied {
                log::report(
                    Cause::Policy,
                    format!("device {device}: the swap to `{spec}` made before it opened failed: {e}"),
                );
            }
        }
        if let Some(path) = self.config.plan_cache_path(ordinal) {
            match engine.use_plan_cache(&path) {
                Ok(n) => tracing::info!("wasmem: device {device}: {n} plans read from {}", path.display()),
                Err(e) => log::report(Cause::Policy, format!("device {device}: {e}; running without a plan cache")),
            }
        }
        let shadow = match &self.config.shadow {
            None => None,
            Some(spec) => match resolve_spec(spec) {
                Ok(r) => {
                    let cfg = SimConfig { capacity: engine.capacity(), ..SimConfig::default() };
                    Some(ShadowHandle::new(Shadow::from_resolved(spec, r, cfg)))
                }
                Err(e) => {
                    log::report(Cause::Policy, format!("device {device}: shadow `{spec}` does not resolve: {e}"));
                    None
                }
            },
        };
        tracing::info!(
            "wasmem: serving {} device {device} ({} bytes) with policy `{}`{}",
            engine.device_name(),
            engine.capacity(),
            self.policy,
            self.config.shadow.as_ref().map_or_else(String::new, |s| format!(", shadow `{s}`"))
        );
        let mut d = DeviceState::new(device, engine, shadow, self.config.trace);
        if self.history_max > 0 {
            d.record_history(self.history_max);
        }
        Ok(d)
    }

    /// Allocates `size` bytes on `device` for `stream`, of the kind of this
    /// thread's next allocation. `Ok(0)` (null) for a zero size, as
    /// PyTorch's own allocator answers.
    pub fn malloc(&mut self, size: isize, device: i32, stream: usize) -> Result<u64, Failure> {
        let size = match u64::try_from(size) {
            Ok(0) => return Ok(0),
            Ok(s) => s,
            Err(_) => return Err(Failure::new(Cause::NegativeSize, format!("negative size {size} requested"))),
        };
        let kind = crate::kind::for_next_allocation();
        self.device(device)?.malloc(size, kind, stream)
    }

    /// Frees `ptr` (null: nothing to do) of `device`.
    pub fn free(&mut self, ptr: u64, size: isize, device: i32) -> Result<(), Failure> {
        if ptr == 0 {
            return Ok(());
        }
        match self.devices.get_mut(&device) {
            Some(d) => d.free(ptr, size),
            None => Err(Failure::new(
                Cause::UnknownPointer,
                format!("free of {ptr:#x} ({size} bytes, device {device}): not allocated here, or already freed"),
            )),
        }
    }

    /// Gives the storage at `ptr` on `device` the kind `kind`; `Ok(false)`
    /// when it is not a live pointer of this library.
    pub fn retag(&mut self, ptr: u64, device: i32, kind: TensorKind) -> Result<bool, Failure> {
        match self.devices.get_mut(&device) {
            Some(d) => d.retag(ptr, kind),
            None => Ok(false),
        }
    }

    /// Marks a phase on every open device.
    pub fn phase(&mut self, phase: Phase, step: u64) -> Result<(), Failure> {
        self.phase = Some((phase, step));
        let mut first = None;
        for d in self.devices.values_mut() {
            if let Err(e) = d.phase(phase, step) {
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// The devices `device` names: that one (when open), or every open one for -1.
    fn selected(&mut self, device: i32) -> Result<Vec<&mut DeviceState>, Failure> {
        if device == -1 {
            return Ok(self.devices.values_mut().collect());
        }
        if device < -1 {
            return Err(Failure::new(Cause::BadArgument, format!("invalid device index {device}")));
        }
        Ok(self.devices.get_mut(&device).into_iter().collect())
    }

    /// Releases the cached memory of `device` (-1: every device); returns the bytes.
    pub fn release_cached(&mut self, device: i32) -> Result<u64, Failure> {
        let mut total = 0;
        for d in self.selected(device)? {
            total += d.release_cached()?;
        }
        Ok(total)
    }

    /// Resets the peaks of `device` (-1: every device).
    pub fn reset_peaks(&mut self, device: i32) -> Result<(), Failure> {
        for d in self.selected(device)? {
            d.reset_peaks();
        }
        Ok(())
    }

    /// Keeps the last `max` allocator actions per device for snapshots (0: off).
    pub fn record_history(&mut self, max: usize) {
        self.history_max = max;
        for d in self.devices.values_mut() {
            d.record_history(max);
        }
    }

    /// The snapshot pickle of `device` (an empty snapshot of that device
    /// when it is not open).
    pub fn snapshot(&mut self, device: i32) -> Result<Vec<u8>, Failure> {
        match self.devices.get_mut(&device) {
            Some(d) => d.snapshot(),
            None => {
                let dev = u32::try_from(device)
                    .map_err(|_| Failure::new(Cause::BadArgument, format!("invalid device index {device}")))?;
                let input = wasmem::trace::snapshot::export::ExportInput { device: dev, ..Default::default() };
                wasmem::trace::snapshot::export::export_bytes(&input)
                    .map_err(|e| Failure::new(Cause::Trace, format!("snapshot: {e}")))
            }
        }
    }

    /// The policy names of the first open device, or of the policies the
    /// first device will open with.
    fn first_names(&self) -> [String; 3] {
        match self.devices.values().next() {
            Some(d) => d.engine().controlled().policy_names(),
            None => match &self.pending {
                Some(r) => Role::ALL.map(|role| r.policies.name(role).to_string()),
                None => Role::ALL.map(|_| self.policy.clone()),
            },
        }
    }

    /// The open devices, in order.
    pub fn open_devices(&self) -> Vec<i32> {
        self.devices.keys().copied().collect()
    }

    /// Prepares a swap of `role` to `spec` for the devices open now (see
    /// [`State::swap`]); the spec is resolved outside any lock by the caller.
    pub fn swap_inputs(&self) -> ([String; 3], Vec<i32>) {
        (self.first_names(), self.open_devices())
    }

    /// Applies a prepared swap to the open devices `devices` (those it was
    /// prepared for) and records it for devices that open later.
    pub fn apply_swap(
        &mut self,
        prepared: PreparedSwap,
        devices: &[i32],
        role: RoleArg,
        spec: &str,
    ) -> Result<SwapOutcome, Failure> {
        if self.open_devices() != devices {
            return Err(Failure::new(Cause::Policy, "a device opened while the swap was prepared"));
        }
        let opts = prepared.options().clone();
        let ranks: Vec<std::sync::Arc<dyn ControlledRank>> =
            self.devices.values().map(|d| d.engine().controlled()).collect();
        let refs: Vec<&dyn ControlledRank> = ranks.iter().map(|r| &**r).collect();
        let out =
            prepared.apply(&refs).map_err(|e| Failure::new(Cause::Policy, format!("swap to `{spec}` refused: {e}")))?;
        // A swap of every role a spec provides, all three, is all that
        // matters for later devices: older swaps are superseded.
        if opts.roles.is_none() && out.roles.len() == Role::ALL.len() {
            self.swaps.clear();
        }
        self.swaps.push((opts, spec.to_string()));
        self.policy = match role {
            RoleArg::All if out.roles.len() == Role::ALL.len() => spec.trim().to_string(),
            _ => format!("{} + {} from `{}`", self.policy, out.roles.join("/"), spec.trim()),
        };
        Ok(out)
    }

    /// The statistics as a JSON object: per device (`devices`, each with the
    /// allocator's `Stats` fields, see [`DeviceState::stats_json`]), their
    /// sums at the top level (peaks: the sum of the devices' peaks), and
    /// `device` (backend), `device_index` (the first open device), `policy`,
    /// `phase`, `step`, `ctl_socket`, `shadow_policy`, `errors` (counts by
    /// cause).
    pub fn stats_json(&self, ctl_socket: Option<String>) -> Value {
        let devices: Vec<Value> = self.devices.values().map(DeviceState::stats_json).collect();
        let mut top = Map::new();
        for d in &devices {
            for (k, v) in d.as_object().into_iter().flatten() {
                if let (Some(n), false) = (v.as_u64(), k == "device_index") {
                    let sum = top.get(k).and_then(Value::as_u64).unwrap_or(0) + n;
                    top.insert(k.clone(), json!(sum));
                }
            }
        }
        if devices.is_empty() {
            let zero = serde_json::to_value(wasmem::alloc::Stats::default()).unwrap_or_else(|_| json!({}));
            for (k, v) in zero.as_object().into_iter().flatten() {
                top.insert(k.clone(), v.clone());
            }
            for k in ["requested_bytes", "peak_requested_bytes", "live_pointers"] {
                top.insert(k.into(), json!(0));
            }
            top.insert("streams".into(), json!(1));
        }
        if !self.config.trace {
            top.insert("trace_events".into(), Value::Null);
        } else {
            top.entry("trace_events").or_insert(json!(0));
        }
        top.insert("device".into(), json!(self.backend_name()));
        top.insert("device_index".into(), json!(self.devices.keys().next()));
        let capacity = self.devices.values().next().map(|d| d.engine().capacity());
        top.insert("capacity_bytes".into(), json!(capacity));
        top.insert("policy".into(), json!(self.policy));
        top.insert("phase".into(), json!(self.phase.map(|p| p.0.as_str())));
        top.insert("step".into(), json!(self.phase.map(|p| p.1)));
        top.insert("ctl_socket".into(), json!(ctl_socket));
        top.insert("shadow_policy".into(), json!(self.config.shadow));
        top.insert("rank".into(), json!(self.config.rank));
        top.insert("errors".into(), json!(log::counts()));
        top.insert("devices".into(), Value::Array(devices));
        Value::Object(top)
    }

    /// Everything a control status needs, to be read outside the lock:
    /// per open device its index, allocator and shadow; the last step.
    pub fn status_inputs(&self) -> (Vec<DeviceStatusInput>, Option<u64>) {
        let devs = self.devices.values().map(|d| (d.index(), d.engine().controlled(), d.shadow().cloned())).collect();
        (devs, self.phase.map(|p| p.1))
    }

    /// The traces of the devices (a header and a copy of the events each),
    /// to be written outside the lock.
    pub fn trace_snapshot(&self) -> Result<Vec<(i32, TraceHeader, Vec<Event>)>, Failure> {
        if !self.config.trace {
            return Err(Failure::new(
                Cause::Trace,
                "tracing is off: set WASMEM_TRACE_OUT, or trace=True in wasmem_init, before the first allocation",
            ));
        }
        Ok(self
            .devices
            .values()
            .filter_map(|d| {
                let t = d.trace()?;
                let source = format!(
                    "wasmem-capi (PyTorch pluggable allocator), device {}:{}, policy {}",
                    self.backend_name(),
                    d.index(),
                    self.policy
                );
                Some((d.index(), TraceHeader { source, ranks: 1 }, t.events().to_vec()))
            })
            .collect())
    }

    /// Checks the invariants of the module documentation.
    pub fn check_invariants(&self) -> Result<(), InvariantError> {
        for (i, d) in &self.devices {
            if self.open_errors.contains_key(i) {
                return Err(InvariantError(format!("device {i} is open and failed to open")));
            }
            d.check().map_err(InvariantError)?;
        }
        Ok(())
    }
}

/// Where the trace of `device` goes when a process writes one trace per
/// device: `path` itself for the only (or first) device, else
/// `<stem>.dev<N>.jsonl[.gz]` beside it.
pub fn trace_path(path: &std::path::Path, device: i32, first: bool) -> std::path::PathBuf {
    if first {
        return path.to_path_buf();
    }
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let (stem, ext) = match name.find(".jsonl") {
        Some(i) => (&name[..i], &name[i..]),
        None => (name.as_str(), ""),
    };
    path.with_file_name(format!("{stem}.dev{device}{ext}"))
}

/// Writes a trace file (outside the lock).
pub fn write_trace(path: &std::path::Path, header: &TraceHeader, events: &[Event]) -> Result<(), Failure> {
    wasmem::trace::write_file(path, header, events)
        .map_err(|e| Failure::new(Cause::Trace, format!("writing the trace to {}: {e}", path.display())))
}
