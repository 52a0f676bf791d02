//! The replay session: one workload under one policy spec, with what a user
//! asks around it — a device, the host and disk tiers, a shadow A/B, a hot
//! swap at an event, gauge samples for a plot, the final state for a
//! snapshot export — returned as values ([`ReplayOutcome`]) for the report
//! to print. `wasmem replay` and `wasmem compare` are loops over it.
//!
//! The session resolves specs with a [`PartLoader`] (the WebAssembly runtime
//! in the CLI), builds the allocator on the chosen device, feeds the shadow
//! from the same event stream (a tap in front of the replay, so the shadow
//! sees every event the primary sees, in order) and runs
//! [`crate::replay::replay_split`].

use crate::alloc::Allocator;
use crate::device::cuda::CudaDevice;
use crate::device::sim::{SimConfig, SimDevice};
use crate::device::{Device, DeviceError};
use crate::metrics::Metrics;
use crate::replay::{replay_split, snapshot_of, Halves, ReplayConfig, ReplayError, Sample, Split};
use crate::shadow::{Shadow, ShadowHandle};
use crate::spec::{resolve, PartLoader, SpecError};
use crate::tier::TierConfig;
use crate::trace::snapshot::export::ExportInput;
use crate::trace::snapshot::SnapshotInfo;
use crate::workload::{Workload, WorkloadError};

/// The device a session replays on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceChoice {
    /// The simulated device, with this capacity in bytes.
    Sim {
        /// Capacity in bytes.
        capacity: u64,
    },
    /// A CUDA GPU: segments come from the device itself.
    Cuda {
        /// Device ordinal.
        ordinal: usize,
    },
}

/// What to run around one replay.
#[derive(Debug, Clone)]
pub struct ReplayOptions {
    /// The device.
    pub device: DeviceChoice,
    /// Host and disk tiers (eviction instead of OOM); `None`: OOMs.
    pub tiers: Option<TierConfig>,
    /// Shadow A/B: this policy spec decides on a bookkeeping-only copy of
    /// the allocator fed the same events (the primary run is unchanged).
    pub shadow: Option<String>,
    /// Hot swap to this spec before this event (0-based); both halves are reported.
    pub swap: Option<(u64, String)>,
    /// Record `(event, allocated, reserved)` every this many events (0: never).
    pub sample_every: u64,
    /// Keep the final state and the allocator actions for a snapshot export.
    pub export: bool,
    /// Read plans from this plan cache and keep the run's plans there
    /// ([`Allocator::use_plan_cache`]; the policy needs a planner).
    pub plan_cache: Option<std::path::PathBuf>,
}

impl Default for ReplayOptions {
    fn default() -> Self {
        ReplayOptions {
            device: DeviceChoice::Sim { capacity: 80 * crate::types::GIB },
            tiers: None,
            shadow: None,
            swap: None,
            sample_every: 0,
            export: false,
            plan_cache: None,
        }
    }
}

/// A shadow's figures over a run.
#[derive(Debug, Clone, PartialEq)]
pub struct ShadowOutcome {
    /// The shadow's spec.
    pub spec: String,
    /// Its metrics (the keys of a replay's; timing: time spent inside the shadow).
    pub metrics: Metrics,
    /// Events it could not apply.
    pub errors: u64,
}

/// What one replay produced.
#[derive(Debug, Clone)]
pub struct ReplayOutcome {
    /// The workload's name.
    pub workload: String,
    /// The primary's policy spec.
    pub policy: String,
    /// Its metrics.
    pub metrics: Metrics,
    /// Gauge samples ([`ReplayOptions::sample_every`]).
    pub samples: Vec<Sample>,
    /// Both halves of a hot swap ([`ReplayOptions::swap`]).
    pub halves: Option<Halves>,
    /// The shadow's figures ([`ReplayOptions::shadow`]).
    pub shadow: Option<ShadowOutcome>,
    /// PyTorch's own figures, for a snapshot workload.
    pub pytorch: Option<SnapshotInfo>,
    /// The final state and actions in PyTorch's snapshot shape ([`ReplayOptions::export`]).
    pub snapshot: Option<ExportInput>,
}

/// Why a session could not run.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    /// A policy spec does not resolve.
    #[error("cannot load policy `{spec}`: {cause}")]
    Spec {
        /// The spec.
        spec: String,
        /// Why.
        cause: Box<SpecError>,
    },
    /// The shadow's eviction policy reads the workload's future, which a shadow never sees.
    #[error("--shadow {0}: its eviction reads the trace's future, which a shadow never sees")]
    ShadowNeedsFuture(String),
    /// The plan cache is not one, or the policy has no planner.
    #[error(transparent)]
    PlanCache(Box<crate::alloc::PlanCacheError>),
    /// The device cannot be opened.
    #[error("--device cuda: {0}")]
    Device(DeviceError),
    /// The workload cannot be read.
    #[error(transparent)]
    Workload(#[from] WorkloadError),
    /// The replay stopped.
    #[error("replay of {workload} with {policy} failed: {}{cause}", at.as_ref().map(|a| format!("{a}: ")).unwrap_or_default())]
    Replay {
        /// The workload.
        workload: String,
        /// The primary's spec.
        policy: String,
        /// `FILE:LINE` of the event that failed, for a trace file.
        at: Option<String>,
        /// Why.
        cause: Box<ReplayError>,
    },
    /// The swap event is past the end of the workload.
    #[error("--swap-at {at}: {workload} has only {events} events")]
    SwapPastEnd {
        /// The requested event.
        at: u64,
        /// The workload.
        workload: String,
        /// Its events.
        events: u64,
    },
}

/// The error of a spec that does not resolve.
fn spec_err(spec: &str) -> impl FnOnce(SpecError) -> SessionError + '_ {
    move |cause| SessionError::Spec { spec: spec.to_string(), cause: Box::new(cause) }
}

/// Checks that `spec` resolves (without running anything).
pub fn check_spec(spec: &str, loader: &dyn PartLoader) -> Result<(), SessionError> {
    resolve(spec, loader).map(|_| ()).map_err(spec_err(spec))
}

/// Whether `spec` resolves to policies with a planner (planned placement).
pub fn has_planner(spec: &str, loader: &dyn PartLoader) -> Result<bool, SessionError> {
    resolve(spec, loader).map(|r| r.planner.is_some()).map_err(spec_err(spec))
}

/// Replays `workload` under `policy` with `opts`; `progress` is called with
/// the event count every 65,536 events.
pub fn run(
    workload: &Workload,
    policy: &str,
    opts: &ReplayOptions,
    loader: &dyn PartLoader,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<ReplayOutcome, SessionError> {
    let resolved = resolve(policy, loader).map_err(spec_err(policy))?;
    match opts.device {
        DeviceChoice::Sim { capacity } => {
            let dev = SimDevice::new(SimConfig { capacity, ..SimConfig::default() });
            run_on(Allocator::from_resolved(dev, resolved), workload, policy, opts, loader, progress)
        }
        DeviceChoice::Cuda { ordinal } => {
            let dev = CudaDevice::new(ordinal).map_err(SessionError::Device)?;
            run_on(Allocator::from_resolved(dev, resolved), workload, policy, opts, loader, progress)
        }
    }
}

fn run_on<D: Device>(
    mut alloc: Allocator<D>,
    workload: &Workload,
    policy: &str,
    opts: &ReplayOptions,
    loader: &dyn PartLoader,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<ReplayOutcome, SessionError> {
    if let Some(path) = &opts.plan_cache {
        alloc.use_plan_cache(path).map_err(|e| SessionError::PlanCache(Box::new(e)))?;
    }
    let shadow = match &opts.shadow {
        Some(q) => {
            let r = resolve(q, loader).map_err(spec_err(q))?;
            if r.policies.eviction.needs_future() {
                return Err(SessionError::ShadowNeedsFuture(q.clone()));
            }
            let dev = SimConfig { capacity: alloc.device().capacity(), ..SimConfig::default() };
            let mut s = Shadow::from_resolved(q, r, dev);
            if let Some(t) = &opts.tiers {
                s = s.with_tiers(t.clone());
            }
            Some(ShadowHandle::new(s))
        }
        None => None,
    };
    let split = match &opts.swap {
        Some((at, to)) => {
            Some(Split { at: *at, to: resolve(to, loader).map_err(spec_err(to))?, opts: Default::default() })
        }
        None => None,
    };
    let events = workload.events()?;
    let events: crate::workload::EventStream = match &shadow {
        Some(h) => {
            let mut tap = h.tap();
            Box::new(events.inspect(move |e| {
                if let Ok(e) = e {
                    tap(e)
                }
            }))
        }
        None => events,
    };
    // The allocator is built: the config's device is not used.
    let cfg = ReplayConfig {
        record_actions: opts.export,
        sample_every: opts.sample_every,
        tiers: opts.tiers.clone(),
        ..ReplayConfig::default()
    };
    let (mut r, halves) = replay_split(events, alloc, &cfg, progress, split).map_err(|cause| {
        // Errors found after parsing name the event: say where it is in the file.
        let at = match &cause {
            ReplayError::Drive(e) => workload.locate(e.event()),
            ReplayError::Swap { event, .. } => workload.locate(*event),
            ReplayError::Source(_) => None,
        };
        SessionError::Replay {
            workload: workload.name().to_string(),
            policy: policy.to_string(),
            at,
            cause: Box::new(cause),
        }
    })?;
    if let (Some((at, _)), None) = (&opts.swap, &halves) {
        return Err(SessionError::SwapPastEnd {
            at: *at,
            workload: workload.name().to_string(),
            events: r.metrics.events,
        });
    }
    let snapshot = opts.export.then(|| snapshot_of(&mut r.allocator));
    let shadow = match (&opts.shadow, shadow) {
        (Some(spec), Some(h)) => {
            Some(ShadowOutcome { spec: spec.clone(), metrics: h.metrics(), errors: h.with(|s| s.errors()) })
        }
        _ => None,
    };
    Ok(ReplayOutcome {
        workload: workload.name().to_string(),
        policy: policy.to_string(),
        metrics: r.metrics,
        samples: r.samples,
        halves,
        shadow,
        pytorch: workload.pytorch().cloned(),
        snapshot,
    })
}
