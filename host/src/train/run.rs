//! `wasmem train`: builds one allocator per rank from a policy spec, wires
//! the hot swap, the trace recorder and the report, runs, and prints the
//! memory saved against stage 0. The command line only parses arguments and
//! calls [`train_command`].

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use anyhow::{bail, Context, Result};

use super::{dry_run, ReportHook, StepHook, StepReport, TrainConfig, Trainer};
use crate::alloc::swap::SwapOptions;
use crate::alloc::{Allocator, SharedAllocator};
use crate::ctl::{CtlServer, RankControl, ServerOptions};
use crate::device::sim::{SimConfig, SimDevice};
use crate::device::{Device, DeviceError};
use crate::shadow::{allocator_metrics, side_by_side, Shadow, ShadowHandle};
use crate::shard::{rank_path, Plan};
use crate::spec::{resolve, Loader};
use crate::trace::{FileTraceWriter, TraceError, TraceHeader};
use crate::types::human_bytes;

/// What `wasmem train` was asked to do.
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
    /// One JSON object per step and one summary object instead of text.
    pub json: bool,
    /// Shadow A/B: feed every rank's events to this policy on a
    /// bookkeeping-only allocator and report its memory beside the primary's.
    pub shadow: Option<String>,
    /// Serve the live-control socket (`wasmem ctl`) here while training.
    pub ctl: Option<PathBuf>,
    /// Device capacity of each rank (the shadow's simulated capacity).
    pub device_capacity: u64,
}

/// Swaps the roles `spec` provides into `alloc` (the one swap of
/// [`crate::alloc::swap`]: between two decisions, carrying the state of a
/// policy of the same name).
pub fn swap_policy<D: Device>(alloc: &SharedAllocator<D>, loader: &Loader, spec: &str) -> Result<(), String> {
    let resolved = resolve(spec, &**loader).map_err(|e| format!("policy `{spec}`: {e}"))?;
    alloc.swap(resolved, &SwapOptions::default()).map_err(|e| format!("swap to `{spec}`: {e}"))?;
    Ok(())
}

/// A rank's trace writer and the first error it met (the writer is dropped then).
type WriterSlot = Arc<Mutex<(Option<FileTraceWriter>, Option<TraceError>)>>;

/// Writers of the ranks' recorded traces.
struct Recorder {
    paths: Vec<PathBuf>,
    writers: Vec<WriterSlot>,
}

impl Recorder {
    fn create(path: &Path, ranks: usize, source: &str) -> Result<Self> {
        let header = TraceHeader { source: source.to_string(), ranks: ranks as u32 };
        let mut paths = Vec::new();
        let mut writers = Vec::new();
        for r in 0..ranks {
            let p = rank_path(path, r, ranks);
            let w = FileTraceWriter::create(&p, &header).with_context(|| format!("cannot write {}", p.display()))?;
            paths.push(p);
            writers.push(Arc::new(Mutex::new((Some(w), None))));
        }
        Ok(Recorder { paths, writers })
    }

    fn tap(&self, rank: usize) -> super::EventTap {
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

    fn finish(self) -> Result<Vec<PathBuf>> {
        for (w, p) in self.writers.iter().zip(&self.paths) {
            let (writer, err) = std::mem::take(&mut *w.lock().unwrap_or_else(|e| e.into_inner()));
            if let Some(e) = err {
                return Err(e).with_context(|| format!("recording {}", p.display()));
            }
            if let Some(w) = writer {
                w.close().with_context(|| format!("closing {}", p.display()))?;
            }
        }
        Ok(self.paths)
    }
}

/// One line of the per-rank figures: a single value when all ranks agree.
fn per_rank(v: &[u64]) -> String {
    if v.windows(2).all(|w| w[0] == w[1]) {
        format!("{}{}", human_bytes(v[0]), if v.len() > 1 { format!(" ×{}", v.len()) } else { String::new() })
    } else {
        v.iter().map(|&b| human_bytes(b)).collect::<Vec<_>>().join(" / ")
    }
}

fn step_line(r: &StepReport) -> String {
    let col = |f: fn(&super::RankStep) -> u64| r.ranks.iter().map(f).collect::<Vec<_>>();
    let host = col(|x| x.host_state_bytes);
    let host = if host.iter().any(|&h| h > 0) { format!(" (+{} host)", per_rank(&host)) } else { String::new() };
    format!(
        "step {:>4}  loss {:.4}  model states/rank {}{}  peak reserved/rank {}  comm/rank {}",
        r.step,
        r.loss,
        per_rank(&col(|x| x.model_state_bytes)),
        host,
        per_rank(&col(|x| x.peak_reserved_bytes)),
        per_rank(&col(|x| x.comm_bytes)),
    )
}

/// "−40.0 % (saved 4.00 MiB)" or "+20.0 % (more)".
fn change(from: u64, to: u64) -> String {
    let p = saved(from, to);
    if p >= 0.0 {
        format!("−{p:.1} %, {} saved", human_bytes(from - to))
    } else {
        format!("+{:.1} %, more", -p)
    }
}

fn saved(from: u64, to: u64) -> f64 {
    if from == 0 {
        0.0
    } else {
        100.0 * (1.0 - to as f64 / from as f64)
    }
}

/// Runs `wasmem train` on devices made by `device` (one per rank), printing
/// to standard output.
pub fn train_command<D: Device + 'static>(
    opts: &TrainOptions,
    loader: Loader,
    device: impl Fn(usize) -> Result<D, DeviceError>,
) -> Result<()> {
    let mut stdout = std::io::stdout();
    let out = &mut stdout;
    let cfg = &opts.config;
    let ranks = cfg.zero.ranks;
    if let Some((at, _)) = &opts.swap_at {
        if *at >= cfg.steps {
            bail!("--swap-at {at}: the run has only {} steps (0 to {})", cfg.steps, cfg.steps.saturating_sub(1));
        }
    }
    let mut allocators = Vec::with_capacity(ranks);
    for r in 0..ranks {
        let dev = device(r).map_err(|e| anyhow::anyhow!("rank {r}: device: {e}"))?;
        let resolved =
            resolve(&opts.policy, &*loader).with_context(|| format!("cannot load policy `{}`", opts.policy))?;
        allocators.push(SharedAllocator::new(Allocator::new(dev, resolved.policies)));
    }
    if let Some((_, to)) = &opts.swap_at {
        resolve(to, &*loader).with_context(|| format!("cannot load policy `{to}` (--swap-at)"))?;
    }
    let mut trainer = Trainer::new(cfg.clone(), allocators).map_err(|e| anyhow::anyhow!(e))?;
    let plan = trainer.plan().clone();
    let source = format!(
        "wasmem train: zero {} ranks {} offload {} micro-batches {} policy {} spec {}",
        cfg.zero.stage,
        ranks,
        cfg.zero.offload,
        cfg.zero.micro_batches,
        opts.policy,
        serde_json::to_string(&cfg.spec)?
    );
    let recorder = match &opts.record {
        Some(p) => Some(Recorder::create(p, ranks, &source)?),
        None => None,
    };
    let shadows: Vec<ShadowHandle> = match &opts.shadow {
        Some(q) => (0..ranks)
            .map(|_| {
                let p = resolve(q, &*loader).with_context(|| format!("cannot load policy `{q}` (--shadow)"))?;
                let dev = SimConfig { capacity: opts.device_capacity, ..SimConfig::default() };
                Ok(ShadowHandle::new(Shadow::new(q, p.policies, dev)))
            })
            .collect::<Result<_>>()?,
        None => Vec::new(),
    };
    for r in 0..ranks {
        let mut taps: Vec<super::EventTap> = Vec::new();
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
    let current_step = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let _server = match &opts.ctl {
        Some(path) => {
            let mut control = RankControl::new(trainer.allocators(), loader.clone());
            for (r, h) in shadows.iter().enumerate() {
                control = control.with_shadow(r, h.clone());
            }
            let step = current_step.clone();
            let control = control.with_status_hook(Box::new(move |s| {
                s.step = Some(step.load(std::sync::atomic::Ordering::Relaxed));
            }));
            let server = CtlServer::start(path, control.into_arc(), ServerOptions::default())
                .with_context(|| format!("cannot serve the control socket {}", path.display()))?;
            eprintln!("control socket: {} (wasmem ctl --socket {} status)", path.display(), path.display());
            Some(server)
        }
        None => None,
    };
    if let Some((at, to)) = opts.swap_at.clone() {
        let loader = loader.clone();
        let hook: StepHook<D> = Arc::new(move |_rank, step, alloc| {
            if step == at {
                swap_policy(alloc, &loader, &to)?;
                // Peaks from here on belong to the new policy.
                alloc.with(|a| a.reset_peaks());
            }
            Ok(())
        });
        trainer.on_step(hook);
    }
    {
        let (json, swap, shadows, step_now) = (opts.json, opts.swap_at.clone(), shadows.clone(), current_step.clone());
        let hook: ReportHook = Arc::new(move |r| {
            step_now.store(r.step + 1, std::sync::atomic::Ordering::Relaxed);
            let shadow_peaks: Vec<u64> = shadows.iter().map(|h| h.metrics().peak_reserved_bytes).collect();
            let line = if json {
                let mut v = serde_json::to_value(r).unwrap_or_default();
                v["event"] = "step".into();
                if !shadow_peaks.is_empty() {
                    v["shadow_peak_reserved_bytes"] = shadow_peaks.into();
                }
                v.to_string()
            } else {
                let mut l = step_line(r);
                if !shadow_peaks.is_empty() {
                    l.push_str(&format!("  shadow peak/rank {}", per_rank(&shadow_peaks)));
                }
                if let Some((at, to)) = &swap {
                    if r.step == *at {
                        l.push_str(&format!("  ← policy swapped to {to}"));
                    }
                }
                l
            };
            // Printed as the run goes, from the rank that completes the step.
            println!("{line}");
        });
        trainer.on_report(hook);
    }
    let trainer_allocs = trainer.allocators();
    let result = trainer.run().map_err(|e| anyhow::anyhow!("training failed: {e}"))?;
    let recorded = match recorder {
        Some(r) => r.finish()?,
        None => Vec::new(),
    };
    // Stage-0 reference: the same model and ranks, from the plan, under each
    // policy the run used (peaks restart at a swap).
    let mut zero0 = cfg.zero;
    zero0.stage = 0;
    zero0.offload = false;
    let plan0 = Plan::new(&cfg.spec, zero0).map_err(|e| anyhow::anyhow!(e))?;
    let reference = |policy: &str| -> Result<super::RankStep> {
        let resolved = resolve(policy, &*loader)?;
        let alloc = SharedAllocator::new(Allocator::new(SimDevice::new(SimConfig::default()), resolved.policies));
        dry_run(&plan0, cfg.steps.min(2), alloc).map_err(|e| anyhow::anyhow!(e))
    };
    let last = result.steps.last().context("no step ran")?;
    let max = |r: &StepReport, f: fn(&super::RankStep) -> u64| r.ranks.iter().map(f).max().unwrap_or(0);
    let states = max(last, |r| r.model_state_bytes);
    let mut phases = Vec::new();
    let end = cfg.steps - 1;
    match &opts.swap_at {
        Some((at, to)) if *at > 0 => {
            phases.push((
                opts.policy.clone(),
                0,
                at - 1,
                max(&result.steps[*at as usize - 1], |r| r.peak_reserved_bytes),
            ));
            phases.push((to.clone(), *at, end, max(last, |r| r.peak_reserved_bytes)));
        }
        Some((_, to)) => phases.push((to.clone(), 0, end, max(last, |r| r.peak_reserved_bytes))),
        None => phases.push((opts.policy.clone(), 0, end, max(last, |r| r.peak_reserved_bytes))),
    }
    let mut phase_json = Vec::new();
    let mut phase_text = Vec::new();
    let mut stage0_states = 0;
    for (policy, from, to, peak) in &phases {
        let r0 = reference(policy)?;
        stage0_states = r0.model_state_bytes;
        phase_json.push(serde_json::json!({
            "policy": policy, "steps": [from, to], "peak_reserved_bytes": peak,
            "stage0_peak_reserved_bytes": r0.peak_reserved_bytes,
            "peak_reserved_saved_percent": saved(r0.peak_reserved_bytes, *peak),
        }));
        phase_text.push(format!(
            "  steps {from}–{to} under {policy}: peak reserved/rank {} against {} at stage 0 ({})",
            human_bytes(*peak),
            human_bytes(r0.peak_reserved_bytes),
            change(r0.peak_reserved_bytes, *peak),
        ));
    }
    let formula = plan.formula_bytes();
    let summary = serde_json::json!({
        "event": "summary",
        "parameters": result.parameters,
        "stage": cfg.zero.stage,
        "ranks": ranks,
        "offload": cfg.zero.offload,
        "final_loss": last.loss,
        "model_state_bytes": states,
        "formula_bytes": formula,
        "slack_bytes": plan.slack_bytes(),
        "layer_buffer_peak_bytes": max(last, |r| r.layer_buffer_peak_bytes),
        "host_state_bytes": max(last, |r| r.host_state_bytes),
        "stage0_model_state_bytes": stage0_states,
        "model_state_saved_percent": saved(stage0_states, states),
        "phases": phase_json,
        "recorded": recorded.iter().map(|p| p.display().to_string()).collect::<Vec<_>>(),
    });
    let mut summary = summary;
    let shadow_text = match (&opts.shadow, shadows.first()) {
        (Some(q), Some(h)) => {
            let primary = trainer_allocs[0].with(|a| allocator_metrics(a));
            let sm = h.metrics();
            let errors: u64 = shadows.iter().map(|h| h.with(|s| s.errors())).sum();
            summary["shadow"] = serde_json::json!({
                "policy": q,
                "peak_reserved_bytes": shadows.iter().map(|h| h.metrics().peak_reserved_bytes).collect::<Vec<_>>(),
                "errors": errors,
                "rank0": serde_json::to_value(&sm)?,
            });
            let primary_label = match &opts.swap_at {
                Some((at, to)) => format!("{} →{to}@{at}", opts.policy),
                None => opts.policy.clone(),
            };
            Some(side_by_side(
                &format!("== rank 0 · shadow A/B over the whole run ({errors} shadow errors) =="),
                (&primary_label, &primary),
                (q, &sm),
            ))
        }
        _ => None,
    };
    if opts.json {
        writeln!(out, "{summary}")?;
    } else {
        let psi = result.parameters;
        writeln!(
            out,
            "\nΨ = {psi} parameters; ZeRO-{} on {ranks} rank(s){}: model states/rank {} (formula {}), \
             layer buffers at most {} (slack bound {})",
            cfg.zero.stage,
            if cfg.zero.offload { " + CPU offload" } else { "" },
            human_bytes(states),
            human_bytes(formula.round() as u64),
            human_bytes(max(last, |r| r.layer_buffer_peak_bytes)),
            human_bytes(plan.slack_bytes()),
        )?;
        writeln!(
            out,
            "memory saved against ZeRO-0 on the same model and ranks: model states/rank {} → {} ({})",
            human_bytes(stage0_states),
            human_bytes(states),
            change(stage0_states, states),
        )?;
        for l in &phase_text {
            writeln!(out, "{l}")?;
        }
        if let Some(t) = &shadow_text {
            writeln!(out, "\n{t}")?;
        }
        for p in &recorded {
            writeln!(out, "recorded {}", p.display())?;
        }
    }
    Ok(())
}
