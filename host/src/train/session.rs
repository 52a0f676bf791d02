//! The training session behind `wasmem train`: one allocator per rank from
//! a policy spec, the hot swap at a step (the one swap of
//! [`crate::alloc::swap`]), the trace recorder, the shadow A/B, the control
//! socket, and the stage-0 reference — returned as values
//! ([`TrainOutcome`]); [`crate::report::train`] prints them.
//!
//! [`TrainSession::prepare`] builds everything and starts the control
//! socket (so a caller can announce it), [`TrainSession::run`] trains and
//! calls back once per step with a [`StepView`].

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::{
    dry_run, EventTap, RankStep, ReportHook, StepHook, StepReport, TrainConfig, TrainError, TrainResult, Trainer,
};
use crate::alloc::swap::SwapOptions;
use crate::alloc::{Allocator, SharedAllocator};
use crate::ctl::{CtlServer, RankControl, ServerError, ServerOptions};
use crate::device::sim::{SimConfig, SimDevice};
use crate::device::{Device, DeviceError};
use crate::metrics::Metrics;
use crate::shadow::{allocator_metrics, Shadow, ShadowHandle};
use crate::shard::{rank_path, Plan, PlanError};
use crate::spec::{resolve, Loader, SpecError};
use crate::trace::{FileTraceWriter, TraceError, TraceHeader};
use crate::types::human_bytes;

/// What a training session was asked to do.
#[derive(Debug, Clone)]
pub struct TrainOptions {
    /// Model, ZeRO configuration, steps, seed.
    pub config: TrainConfig,
    /// Policy spec of every rank's allocator.
    pub policy: String,
    /// Hot-swap every rank to this policy at the start of this step.
    pub swap_at: Option<(u64, String)>,
    /// Write each rank's allocation trace here (rank suffix when several).
    pub record: Option<PathBuf>,
    /// Shadow A/B: feed every rank's events to this policy on a
    /// bookkeeping-only allocator and report its memory beside the primary's.
    pub shadow: Option<String>,
    /// Serve the live-control socket (`wasmem ctl`) here while training.
    pub ctl: Option<PathBuf>,
    /// Device capacity of each rank (the shadow's simulated capacity).
    pub device_capacity: u64,
}

/// Why a session could not run.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    /// A policy spec does not resolve (`what`: the option that named it).
    #[error("cannot load policy `{spec}`{what}: {cause}")]
    Spec {
        /// The spec.
        spec: String,
        /// ` (--swap-at)`, ` (--shadow)` or empty.
        what: &'static str,
        /// Why.
        cause: Box<SpecError>,
    },
    /// The swap step is not a step of the run.
    #[error("--swap-at {at}: the run has only {steps} steps (0 to {})", steps.saturating_sub(1))]
    SwapPastEnd {
        /// The step asked for.
        at: u64,
        /// The run's steps.
        steps: u64,
    },
    /// The swap to a spec was refused.
    #[error("swap to `{spec}`: {cause}")]
    Swap {
        /// The spec.
        spec: String,
        /// Why.
        cause: crate::alloc::swap::SwapError,
    },
    /// The run would take more host memory than there is.
    #[error(
        "this run needs about {} of host memory ({} rank(s) × ({} of device memory held in host memory + {} of \
         working buffers)), but {} is available: use fewer ranks, a smaller model or --device cuda",
        human_bytes(est.total), est.ranks, human_bytes(est.device_bytes), human_bytes(est.working_bytes),
        human_bytes(*available)
    )]
    HostMemory {
        /// The estimate.
        est: HostEstimate,
        /// Host memory available.
        available: u64,
    },
    /// A rank's device cannot be opened.
    #[error("rank {rank}: device: {cause}")]
    Device {
        /// The rank.
        rank: usize,
        /// Why.
        cause: DeviceError,
    },
    /// The model and configuration make no plan.
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// A trace file could not be written.
    #[error("recording {}: {cause}", path.display())]
    Record {
        /// The file.
        path: PathBuf,
        /// Why.
        cause: TraceError,
    },
    /// The control socket could not be served.
    #[error("cannot serve the control socket {}: {cause}", path.display())]
    Ctl {
        /// The socket.
        path: PathBuf,
        /// Why.
        cause: ServerError,
    },
    /// Training failed.
    #[error("training failed: {0}")]
    Train(TrainError),
    /// The per-step callback asked to stop.
    #[error("training stopped at step {0} by its report")]
    Stopped(u64),
}

impl From<TrainError> for SessionError {
    fn from(e: TrainError) -> Self {
        SessionError::Train(e)
    }
}

/// The host memory a training run takes, estimated before it starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostEstimate {
    /// Ranks of the run.
    pub ranks: usize,
    /// Device bytes a rank holds at its peak (in host memory on the
    /// host-backed simulated device; 0 on a real GPU).
    pub device_bytes: u64,
    /// A rank's working buffers: f32 copies of its largest layer group and
    /// of its activations, its thread, and its offloaded optimizer states.
    pub working_bytes: u64,
    /// All ranks together.
    pub total: u64,
}

/// Estimates what a run of `cfg` takes from the host (`host_backed`: the
/// device's bytes live in host memory), from the plan alone (a dry run on a
/// bookkeeping-only device; nothing is computed).
pub fn host_memory_estimate(cfg: &TrainConfig, host_backed: bool) -> Result<HostEstimate, SessionError> {
    let plan = Plan::new(&cfg.spec, cfg.zero)?;
    let dev = SimDevice::new(SimConfig { capacity: u64::MAX >> 2, host_backed: false, ..SimConfig::default() });
    // `naive` reserves exactly the live bytes: the rank's peak of device tensors.
    let alloc = SharedAllocator::new(Allocator::with_builtin(dev, "naive").expect("a built-in policy"));
    let peak = dry_run(&plan, cfg.steps.clamp(1, 2), alloc)?;
    let s = &cfg.spec;
    let largest_group = plan.groups.iter().map(|g| g.padded).max().unwrap_or(0);
    let tokens = s.batch * s.seq;
    let widest = (3 * s.hidden).max(s.intermediate).max(s.vocab);
    // Weights, their gradient and the accumulation read as f32, activations
    // and logits as f32 (and their gradients), a thread stack and slack.
    let working = 4 * 4 * largest_group + 4 * 4 * tokens * widest + 4 * (1 << 20) + plan.state_bytes().host;
    let device_bytes = if host_backed { peak.peak_reserved_bytes } else { 0 };
    let per_rank = device_bytes.saturating_add(working);
    // 10 % for what the model misses (allocator slack, thread bookkeeping)
    // and the process itself.
    let total = per_rank.saturating_mul(cfg.zero.ranks as u64);
    let total = total.saturating_add(total / 10).saturating_add(32 << 20);
    Ok(HostEstimate { ranks: cfg.zero.ranks, device_bytes, working_bytes: working, total })
}

/// Host memory available now (`MemAvailable` of `/proc/meminfo`), where the
/// system says.
pub fn available_host_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// What the per-step callback asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepFlow {
    /// Go on training.
    Continue,
    /// Stop at the next step boundary (e.g. the report's output was closed):
    /// the run ends with [`SessionError::Stopped`].
    Stop,
}

/// What the per-step callback sees.
#[derive(Debug, Clone)]
pub struct StepView<'a> {
    /// All ranks' figures after the step.
    pub report: &'a StepReport,
    /// Each shadow's peak reserved bytes so far (one per rank; empty without `--shadow`).
    pub shadow_peaks: Vec<u64>,
    /// The spec swapped in at the start of this step, if any.
    pub swapped_to: Option<&'a str>,
}

/// A stretch of steps under one policy, against stage 0 under the same policy.
#[derive(Debug, Clone, PartialEq)]
pub struct PhaseFigures {
    /// The policy spec.
    pub policy: String,
    /// First step.
    pub from: u64,
    /// Last step.
    pub to: u64,
    /// Peak reserved bytes of the most loaded rank over these steps.
    pub peak_reserved_bytes: u64,
    /// The same at ZeRO stage 0 (the plan's dry run, same model and ranks).
    pub stage0_peak_reserved_bytes: u64,
}

/// The shadow's figures over a training run.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainShadow {
    /// The shadow's spec.
    pub spec: String,
    /// Peak reserved bytes of each rank's shadow.
    pub peak_reserved_bytes: Vec<u64>,
    /// Events the shadows could not apply, over all ranks.
    pub errors: u64,
    /// Rank 0's shadow metrics.
    pub rank0: Metrics,
    /// Rank 0's primary, from its allocator's counters.
    pub primary_rank0: Metrics,
}

/// What a training run produced.
#[derive(Debug, Clone)]
pub struct TrainOutcome {
    /// The options it ran with.
    pub options: TrainOptions,
    /// Every step's figures and the parameter count.
    pub result: TrainResult,
    /// Model-state bytes per rank the ZeRO formulas give.
    pub formula_bytes: f64,
    /// The plan's bound on layer-buffer slack.
    pub slack_bytes: u64,
    /// Model-state bytes per rank at stage 0 (same model and ranks).
    pub stage0_model_state_bytes: u64,
    /// Peak reserved per policy phase (two with a swap after step 0).
    pub phases: Vec<PhaseFigures>,
    /// The trace files written (`--record`).
    pub recorded: Vec<PathBuf>,
    /// The shadow's figures (`--shadow`).
    pub shadow: Option<TrainShadow>,
}

impl TrainOutcome {
    /// The last step's figures.
    pub fn last(&self) -> &StepReport {
        self.result.steps.last().expect("a run has at least one step")
    }

    /// The largest value of `f` over the ranks of the last step.
    pub fn max_last(&self, f: fn(&RankStep) -> u64) -> u64 {
        self.last().ranks.iter().map(f).max().unwrap_or(0)
    }
}

/// A rank's trace writer and the first error it met (the writer is dropped then).
type WriterSlot = Arc<Mutex<(Option<FileTraceWriter>, Option<TraceError>)>>;

/// Writers of the ranks' recorded traces.
struct Recorder {
    paths: Vec<PathBuf>,
    writers: Vec<WriterSlot>,
}

impl Recorder {
    fn create(path: &Path, ranks: usize, source: &str) -> Result<Self, SessionError> {
        let header = TraceHeader { source: source.to_string(), ranks: ranks as u32 };
        let mut paths = Vec::new();
        let mut writers = Vec::new();
        for r in 0..ranks {
            let p = rank_path(path, r, ranks);
            let w = FileTraceWriter::create(&p, &header)
                .map_err(|cause| SessionError::Record { path: p.clone(), cause })?;
            paths.push(p);
            writers.push(Arc::new(Mutex::new((Some(w), None))));
        }
        Ok(Recorder { paths, writers })
    }

    fn tap(&self, rank: usize) -> EventTap {
        let slot = self.writers[rank].clone();
        Box::new(move |e| {
            let mut g = slot.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(w) = g.0.as_mut() {
                if let Err(err) = w.write(e) {
                    g.0 = None;
                    g.1 = Some(err);
                }
            }
        })
    }

    fn finish(self) -> Result<Vec<PathBuf>, SessionError> {
        for (w, p) in self.writers.iter().zip(&self.paths) {
            let (writer, err) = std::mem::take(&mut *w.lock().unwrap_or_else(|e| e.into_inner()));
            if let Some(cause) = err {
                return Err(SessionError::Record { path: p.clone(), cause });
            }
            if let Some(w) = writer {
                w.close().map_err(|cause| SessionError::Record { path: p.clone(), cause })?;
            }
        }
        Ok(self.paths)
    }
}

/// Swaps the roles `spec` provides into `alloc` (the one swap of
/// [`crate::alloc::swap`]: between two decisions, carrying the state of a
/// policy of the same name).
pub fn swap_policy<D: Device>(alloc: &SharedAllocator<D>, loader: &Loader, spec: &str) -> Result<(), SessionError> {
    let resolved = resolve(spec, &**loader).map_err(spec_err(spec, " (--swap-at)"))?;
    alloc.swap(resolved, &SwapOptions::default()).map_err(|cause| SessionError::Swap { spec: spec.into(), cause })?;
    Ok(())
}

/// The error of a spec (named by option `what`) that does not resolve.
fn spec_err<'a>(spec: &'a str, what: &'static str) -> impl FnOnce(SpecError) -> SessionError + 'a {
    move |cause| SessionError::Spec { spec: spec.to_string(), what, cause: Box::new(cause) }
}

/// A prepared training run (see the module documentation).
pub struct TrainSession<D: Device> {
    opts: TrainOptions,
    loader: Loader,
    trainer: Trainer<D>,
    shadows: Vec<ShadowHandle>,
    recorder: Option<Recorder>,
    server: Option<CtlServer>,
    current_step: Arc<AtomicU64>,
}

impl<D: Device + 'static> TrainSession<D> {
    /// Builds the ranks' allocators on devices made by `device` (one per
    /// rank), the recorder, the shadows and the control socket. A run that
    /// would take more host memory than is available is refused first
    /// ([`host_memory_estimate`]; `host_backed`: the devices keep their bytes
    /// in host memory).
    pub fn prepare(
        opts: TrainOptions,
        loader: Loader,
        host_backed: bool,
        device: impl Fn(usize) -> Result<D, DeviceError>,
    ) -> Result<Self, SessionError> {
        let cfg = &opts.config;
        let ranks = cfg.zero.ranks;
        cfg.plan()?;
        let est = host_memory_estimate(cfg, host_backed)?;
        if let Some(available) = available_host_memory().filter(|&a| est.total > a) {
            return Err(SessionError::HostMemory { est, available });
        }
        if let Some((at, _)) = &opts.swap_at {
            if *at >= cfg.steps {
                return Err(SessionError::SwapPastEnd { at: *at, steps: cfg.steps });
            }
        }
        let mut allocators = Vec::with_capacity(ranks);
        for rank in 0..ranks {
            let dev = device(rank).map_err(|cause| SessionError::Device { rank, cause })?;
            let resolved = resolve(&opts.policy, &*loader).map_err(spec_err(&opts.policy, ""))?;
            allocators.push(SharedAllocator::new(Allocator::from_resolved(dev, resolved)));
        }
        if let Some((_, to)) = &opts.swap_at {
            resolve(to, &*loader).map_err(spec_err(to, " (--swap-at)"))?;
        }
        let mut trainer = Trainer::new(cfg.clone(), allocators)?;
        let source = format!(
            "wasmem train: zero {} ranks {} offload {} micro-batches {} policy {} spec {}",
            cfg.zero.stage,
            ranks,
            cfg.zero.offload,
            cfg.zero.micro_batches,
            opts.policy,
            serde_json::to_string(&cfg.spec).unwrap_or_default()
        );
        let recorder = match &opts.record {
            Some(p) => Some(Recorder::create(p, ranks, &source)?),
            None => None,
        };
        let shadows: Vec<ShadowHandle> = match &opts.shadow {
            Some(q) => (0..ranks)
                .map(|_| {
                    let p = resolve(q, &*loader).map_err(spec_err(q, " (--shadow)"))?;
                    let dev = SimConfig { capacity: opts.device_capacity, ..SimConfig::default() };
                    Ok(ShadowHandle::new(Shadow::from_resolved(q, p, dev)))
                })
                .collect::<Result<_, SessionError>>()?,
            None => Vec::new(),
        };
        for r in 0..ranks {
            let mut taps: Vec<EventTap> = Vec::new();
            if let Some(rec) = &recorder {
                taps.push(rec.tap(r));
            }
            if let Some(h) = shadows.get(r) {
                taps.push(h.tap());
            }
            match taps.len() {
                0 => {}
                1 => trainer.set_tap(r, taps.remove(0)),
                _ => trainer.set_tap(r, Box::new(move |e| taps.iter_mut().for_each(|t| t(e)))),
            }
        }
        let current_step = Arc::new(AtomicU64::new(0));
        let server = match &opts.ctl {
            Some(path) => {
                let mut control = RankControl::new(trainer.allocators(), loader.clone());
                for (r, h) in shadows.iter().enumerate() {
                    control = control.with_shadow(r, h.clone());
                }
                let step = current_step.clone();
                let control = control.with_status_hook(Box::new(move |s| {
                    s.step = Some(step.load(Ordering::Relaxed));
                }));
                let server = CtlServer::start(path, control.into_arc(), ServerOptions::default())
                    .map_err(|cause| SessionError::Ctl { path: path.clone(), cause })?;
                Some(server)
            }
            None => None,
        };
        Ok(TrainSession { opts, loader, trainer, shadows, recorder, server, current_step })
    }

    /// The control socket, when one is served.
    pub fn ctl_path(&self) -> Option<&Path> {
        self.server.as_ref().map(|s| s.path())
    }

    /// The ranks' allocators (clones share them).
    pub fn allocators(&self) -> Vec<SharedAllocator<D>> {
        self.trainer.allocators()
    }

    /// Trains, calling `on_step` once per step (from the rank that completes
    /// it), and returns the figures.
    pub fn run(
        self,
        on_step: impl Fn(&StepView<'_>) -> StepFlow + Send + Sync + 'static,
    ) -> Result<TrainOutcome, SessionError> {
        let TrainSession { opts, loader, mut trainer, shadows, recorder, server, current_step } = self;
        let cfg = opts.config.clone();
        // Set by the report callback; every rank stops at its next step start.
        let stop: Arc<std::sync::atomic::AtomicBool> = Arc::default();
        {
            let (swap, loader, stop) = (opts.swap_at.clone(), loader.clone(), stop.clone());
            let hook: StepHook<D> = Arc::new(move |_rank, step, alloc| {
                if stop.load(Ordering::Relaxed) {
                    return Err(format!("stopped before step {step}"));
                }
                if let Some((at, to)) = &swap {
                    if step == *at {
                        swap_policy(alloc, &loader, to).map_err(|e| e.to_string())?;
                        // Peaks from here on belong to the new policy.
                        alloc.with(|a| a.reset_peaks());
                    }
                }
                Ok(())
            });
            trainer.on_step(hook);
        }
        {
            let (swap, shadows, step_now, stop) =
                (opts.swap_at.clone(), shadows.clone(), current_step.clone(), stop.clone());
            let hook: ReportHook = Arc::new(move |r| {
                step_now.store(r.step + 1, Ordering::Relaxed);
                if stop.load(Ordering::Relaxed) {
                    return;
                }
                let shadow_peaks = shadows.iter().map(|h| h.metrics().peak_reserved_bytes).collect();
                let swapped_to = swap.as_ref().filter(|(at, _)| *at == r.step).map(|(_, to)| to.as_str());
                if on_step(&StepView { report: r, shadow_peaks, swapped_to }) == StepFlow::Stop {
                    stop.store(true, Ordering::Relaxed);
                }
            });
            trainer.on_report(hook);
        }
        let allocs = trainer.allocators();
        let plan = trainer.plan().clone();
        let result = match trainer.run() {
            Ok(r) => r,
            Err(_) if stop.load(Ordering::Relaxed) => {
                return Err(SessionError::Stopped(current_step.load(Ordering::Relaxed)))
            }
            Err(e) => return Err(e.into()),
        };
        drop(server);
        let recorded = match recorder {
            Some(r) => r.finish()?,
            None => Vec::new(),
        };
        // Stage-0 reference: the same model and ranks, from the plan, under
        // each policy the run used (peaks restart at a swap).
        let mut zero0 = cfg.zero;
        zero0.stage = 0;
        zero0.offload = false;
        let plan0 = Plan::new(&cfg.spec, zero0)?;
        let reference = |policy: &str| -> Result<RankStep, SessionError> {
            let resolved = resolve(policy, &*loader).map_err(spec_err(policy, ""))?;
            let alloc = SharedAllocator::new(Allocator::from_resolved(SimDevice::new(SimConfig::default()), resolved));
            Ok(dry_run(&plan0, cfg.steps.min(2), alloc)?)
        };
        let peak_at = |s: usize| result.steps[s].ranks.iter().map(|r| r.peak_reserved_bytes).max().unwrap_or(0);
        let end = cfg.steps - 1;
        let mut spans = Vec::new();
        match &opts.swap_at {
            Some((at, to)) if *at > 0 => {
                spans.push((opts.policy.clone(), 0, at - 1, peak_at(*at as usize - 1)));
                spans.push((to.clone(), *at, end, peak_at(end as usize)));
            }
            Some((_, to)) => spans.push((to.clone(), 0, end, peak_at(end as usize))),
            None => spans.push((opts.policy.clone(), 0, end, peak_at(end as usize))),
        }
        let mut phases = Vec::new();
        let mut stage0_model_state_bytes = 0;
        for (policy, from, to, peak) in spans {
            let r0 = reference(&policy)?;
            stage0_model_state_bytes = r0.model_state_bytes;
            phases.push(PhaseFigures {
                policy,
                from,
                to,
                peak_reserved_bytes: peak,
                stage0_peak_reserved_bytes: r0.peak_reserved_bytes,
            });
        }
        let shadow = match (&opts.shadow, shadows.first()) {
            (Some(q), Some(h)) => Some(TrainShadow {
                spec: q.clone(),
                peak_reserved_bytes: shadows.iter().map(|h| h.metrics().peak_reserved_bytes).collect(),
                errors: shadows.iter().map(|h| h.with(|s| s.errors())).sum(),
                rank0: h.metrics(),
                primary_rank0: allocs[0].with(|a| allocator_metrics(a)),
            }),
            _ => None,
        };
        Ok(TrainOutcome {
            formula_bytes: plan.formula_bytes(),
            slack_bytes: plan.slack_bytes(),
            options: opts,
            result,
            stage0_model_state_bytes,
            phases,
            recorded,
            shadow,
        })
    }
}

#[cfg(test)]
mod estimate_tests {
    use super::*;
    use crate::model::ModelOverrides;
    use crate::shard::ZeroConfig;

    fn cfg(o: ModelOverrides, ranks: usize) -> TrainConfig {
        let spec = o.apply("tiny").unwrap();
        let zero = ZeroConfig { stage: 3, ranks, offload: false, micro_batches: ranks * 4usize.div_ceil(ranks) };
        TrainConfig::new(spec.clone(), zero, 2)
    }

    /// Measured peak resident memory of `wasmem train … --steps 2` on the
    /// development machine (2026-12-01): 1000 ranks of `tiny` 7.9 GiB, 64
    /// ranks 571 MiB, one rank of `tiny` widened to hidden 8192 with 2 layers
    /// 17.2 GiB. The estimate must not be below them by more than a little,
    /// nor far above.
    #[test]
    fn estimates_bracket_measured_runs() {
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        let e = host_memory_estimate(&cfg(ModelOverrides::default(), 1000), true).unwrap();
        assert!((7.9..16.0).contains(&gib(e.total)), "{e:?}");
        let e = host_memory_estimate(&cfg(ModelOverrides::default(), 64), true).unwrap();
        assert!((0.55..1.2).contains(&gib(e.total)), "{e:?}");
        let wide = ModelOverrides { hidden: Some(8192), heads: Some(8), layers: Some(2), ..Default::default() };
        let e = host_memory_estimate(&cfg(wide, 1), true).unwrap();
        assert!((17.2..26.0).contains(&gib(e.total)), "{e:?}");
        // On a real GPU the device bytes are not the host's.
        let g = host_memory_estimate(&cfg(ModelOverrides::default(), 64), false).unwrap();
        assert_eq!(g.device_bytes, 0);
    }
}
