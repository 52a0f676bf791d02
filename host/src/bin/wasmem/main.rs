//! The `wasmem` command line: clap arguments → library options → a session
//! of the library → the report (`wasmem::report`). No engine logic lives here.

mod args;
mod policy;

use std::io::{IsTerminal, Write};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Parser;
use rayon::prelude::*;

use args::{Cli, Command, Common, CtlCommand, DeviceKind, TrainArgs};
use wasmem::device::cuda::CudaDevice;
use wasmem::device::sim::{SimConfig, SimDevice};
use wasmem::policy::{Limits, Runtime, RuntimeConfig};
use wasmem::report;
use wasmem::session::{self, DeviceChoice, ReplayOptions, ReplayOutcome};
use wasmem::spec::Loader;
use wasmem::trace::TraceHeader;
use wasmem::train::session::{StepFlow, TrainOptions, TrainSession};
use wasmem::workload::{Source, TraceOptions, Workload};

/// Standard output was closed by its reader (`wasmem … | head`): the
/// program ends quietly.
#[derive(Debug, thiserror::Error)]
#[error("standard output was closed")]
struct OutputClosed;

/// Writes `text` to standard output: a closed pipe is [`OutputClosed`], any
/// other failure (a full disk…) an error that says so.
fn emit(text: &str) -> Result<()> {
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes()).and_then(|()| out.flush()).map_err(|e| match e.kind() {
        std::io::ErrorKind::BrokenPipe => anyhow::Error::new(OutputClosed),
        _ => anyhow::Error::new(e).context("cannot write to standard output"),
    })
}

/// Prints to standard output through [`emit`], returning its failure with `?`.
macro_rules! out {
    ($($t:tt)*) => { emit(&format!($($t)*))? };
}

/// [`out!`] with a newline.
macro_rules! outln {
    ($($t:tt)*) => { emit(&format!("{}\n", format_args!($($t)*)))? };
}

/// Prints a note to standard error; a failure to do so is ignored (the note
/// is not the output).
macro_rules! note {
    ($($t:tt)*) => {{
        let _ = writeln!(std::io::stderr(), $($t)*);
    }};
}

/// The policy runtime of this process (one engine, one artifact cache).
fn runtime(deadline_ms: f64) -> Result<&'static Runtime> {
    static RT: std::sync::OnceLock<Runtime> = std::sync::OnceLock::new();
    if let Some(rt) = RT.get() {
        return Ok(rt);
    }
    if !(deadline_ms.is_finite() && deadline_ms > 0.0) {
        bail!("--deadline-ms must be a positive number of milliseconds, not {deadline_ms}");
    }
    let rt = Runtime::new(RuntimeConfig {
        limits: Limits { deadline: Some(Duration::from_secs_f64(deadline_ms / 1e3)), ..Limits::default() },
        ..RuntimeConfig::default()
    })?;
    Ok(RT.get_or_init(|| rt))
}

/// The workloads named on the command line, each opened once.
fn workloads(common: &Common) -> Result<Vec<Workload>> {
    let sources: Vec<Source> = common
        .traces
        .iter()
        .cloned()
        .map(Source::File)
        .chain(common.synth.iter().cloned().map(Source::Synth))
        .collect();
    if sources.is_empty() {
        bail!("give at least one trace file or --synth PRESET");
    }
    let mut opts = TraceOptions::default();
    if common.no_trace_cache {
        opts.cache = None;
    }
    sources.iter().map(|s| Ok(Workload::open_with(s, &opts)?)).collect()
}

/// `wasmem plan`: the offline planning bound of each workload.
fn plan(traces: Vec<std::path::PathBuf>, synth: Vec<String>, policy: &str, json: bool, deadline_ms: f64) -> Result<()> {
    let rt = runtime(deadline_ms)?;
    let resolved = wasmem::spec::resolve(policy, rt).with_context(|| format!("--policy {policy}"))?;
    let Some(mut planner) = resolved.planner else {
        bail!("--policy {policy} has no planner: give `planned` or a part that exports the `planner` interface");
    };
    let sources: Vec<Source> =
        traces.into_iter().map(Source::File).chain(synth.into_iter().map(Source::Synth)).collect();
    if sources.is_empty() {
        bail!("give at least one trace file or --synth PRESET");
    }
    for s in &sources {
        let w = Workload::open(s)?;
        let p = wasmem::plan::plan_offline(&w, planner.as_mut())?;
        if json {
            outln!("{}", report::plan_json(&p));
        } else {
            out!("{}", report::plan_text(&p));
        }
    }
    Ok(())
}

/// The replay options every run of a command shares.
fn replay_options(common: &Common) -> Result<ReplayOptions> {
    let device = match common.device {
        DeviceKind::Sim => DeviceChoice::Sim { capacity: common.device_mem },
        DeviceKind::Cuda => DeviceChoice::Cuda { ordinal: 0 },
    };
    Ok(ReplayOptions { device, tiers: common.tiers.config()?, ..ReplayOptions::default() })
}

fn replay(
    common: Common,
    policy: String,
    export: Option<std::path::PathBuf>,
    shadow: Option<String>,
    plan_cache: Option<std::path::PathBuf>,
) -> Result<()> {
    let rt = runtime(common.deadline_ms)?;
    for spec in std::iter::once(&policy).chain(&shadow) {
        session::check_spec(spec, rt)?;
    }
    let ins = workloads(&common)?;
    if export.is_some() && ins.len() != 1 {
        bail!("--export-snapshot takes exactly one input ({} given)", ins.len());
    }
    if plan_cache.is_some() && ins.len() != 1 {
        bail!("--plan-cache takes exactly one input ({} given)", ins.len());
    }
    let opts = ReplayOptions { shadow, export: export.is_some(), plan_cache, ..replay_options(&common)? };
    let progress = !common.json && std::io::stderr().is_terminal();
    for w in &ins {
        let bar = progress.then(|| {
            let b = indicatif::ProgressBar::new_spinner();
            b.set_message(format!("{} · {policy}", w.name()));
            b
        });
        let tick = |n: u64| {
            if let Some(b) = &bar {
                b.set_position(n);
            }
        };
        let out = session::run(w, &policy, &opts, rt, &tick)?;
        if let Some(b) = bar {
            b.finish_and_clear();
        }
        if let (Some(path), Some(snap)) = (&export, &out.snapshot) {
            // The export error names the file.
            wasmem::trace::snapshot::export::export_file(path, snap)?;
            note!(
                "wrote snapshot {} ({} segments, {} trace entries)",
                path.display(),
                snap.segments.len(),
                snap.trace.len()
            );
        }
        if common.json {
            outln!("{}", report::replay_json(&out));
        } else {
            out!("{}", report::replay_text(&out));
        }
    }
    Ok(())
}

fn compare(
    common: Common,
    policies: Vec<String>,
    plot: Option<std::path::PathBuf>,
    swap_at: Option<(u64, String)>,
    plan_cache: Option<std::path::PathBuf>,
) -> Result<()> {
    if policies.is_empty() {
        bail!("give at least one --policy");
    }
    let rt = runtime(common.deadline_ms)?;
    for spec in policies.iter().chain(swap_at.as_ref().map(|(_, p)| p)) {
        session::check_spec(spec, rt)?;
    }
    let ins = workloads(&common)?;
    let opts = ReplayOptions {
        sample_every: if plot.is_some() { 8 } else { 0 },
        swap: swap_at.clone(),
        ..replay_options(&common)?
    };
    // The plan cache goes to the one policy with a planner.
    let mut planned = Vec::new();
    if plan_cache.is_some() {
        if ins.len() != 1 {
            bail!("--plan-cache takes exactly one input ({} given)", ins.len());
        }
        for (i, spec) in policies.iter().enumerate() {
            if session::has_planner(spec, rt)? {
                planned.push(i);
            }
        }
        match planned.len() {
            0 => bail!("--plan-cache: no --policy has a planner (e.g. `planned`)"),
            1 => {}
            _ => bail!("--plan-cache: {} policies have a planner; one may use the cache", planned.len()),
        }
    }
    let cached = ReplayOptions { plan_cache: plan_cache.clone(), ..opts.clone() };
    let opts_of = |p: usize| if planned.contains(&p) { &cached } else { &opts };
    if policies.len() > 1 {
        // One parse per trace file, then every run reads the cache entry.
        ins.par_iter().try_for_each(|w| w.fill_cache().map(|_| ()))?;
    }
    let pairs: Vec<(usize, usize)> = (0..ins.len()).flat_map(|t| (0..policies.len()).map(move |p| (t, p))).collect();
    let results: Vec<Result<ReplayOutcome, session::SessionError>> =
        pairs.par_iter().map(|&(t, p)| session::run(&ins[t], &policies[p], opts_of(p), rt, &|_| {})).collect();
    let mut it = results.into_iter();
    let mut charts: Vec<Vec<ReplayOutcome>> = Vec::new();
    for _ in &ins {
        let outs =
            (0..policies.len()).map(|_| it.next().expect("one result per pair")).collect::<Result<Vec<_>, _>>()?;
        if common.json {
            for o in &outs {
                outln!("{}", report::replay_json(o));
            }
        } else {
            out!("{}", report::compare_text(&outs, swap_at.as_ref().map(|(_, to)| to.as_str())));
        }
        charts.push(outs);
    }
    if let Some(path) = &plot {
        let series: Vec<(String, Vec<wasmem::plot::Series<'_>>)> = charts
            .iter()
            .map(|outs| {
                let s = outs.iter().map(|o| wasmem::plot::Series { label: &o.policy, samples: &o.samples }).collect();
                (outs[0].workload.clone(), s)
            })
            .collect();
        wasmem::plot::draw(path, &series)?;
        note!("wrote {}", path.display());
    }
    Ok(())
}

fn synth(cmd: Command) -> Result<()> {
    let Command::Synth { model, output, zero, ranks, rank, seq_cycle } = cmd else {
        unreachable!("synth commands only")
    };
    let spec = model.spec("gpt2-124m")?;
    let Some(stage) = zero else {
        if ranks.ranks != 1 || ranks.offload.is_some() || ranks.micro_batches.is_some() || rank.is_some() {
            bail!("--ranks, --rank, --offload and --micro-batches describe a ZeRO plan: add --zero STAGE");
        }
        let events = wasmem::synth::synth_with_seqs(&spec, &seq_cycle)?;
        let cycle = if seq_cycle.is_empty() { String::new() } else { format!(" seq cycle {seq_cycle:?}") };
        let header =
            TraceHeader { source: format!("wasmem synth: {}{cycle}", serde_json::to_string(&spec)?), ranks: 1 };
        wasmem::trace::write_file(&output, &header, &events)
            .with_context(|| format!("cannot write {}", output.display()))?;
        note!("wrote {} events ({} parameters) to {}", events.len(), spec.parameter_count(), output.display());
        return Ok(());
    };
    if !seq_cycle.is_empty() {
        bail!("--seq-cycle varies the eager model's steps; a ZeRO plan (--zero) has one length");
    }
    let cfg = ranks.config(stage, ranks.ranks)?;
    if let Some(r) = rank.filter(|&r| r >= cfg.ranks) {
        bail!("--rank {r} is not a rank of {} ranks", cfg.ranks);
    }
    let plan = wasmem::shard::Plan::new(&spec, cfg)?;
    let source = format!("wasmem synth --zero {stage}: {cfg:?} {}", serde_json::to_string(&spec)?);
    let files = wasmem::shard::write_traces(&plan, spec.steps, &output, rank, &source)
        .with_context(|| format!("cannot write {}", output.display()))?;
    let s = plan.state_bytes();
    note!(
        "wrote {} trace(s) of {} events ({} parameters; model states/rank {} device + {} host) to {}",
        files.len(),
        files.first().map_or(0, |f| f.1),
        plan.parameters(),
        wasmem::types::human_bytes(s.device()),
        wasmem::types::human_bytes(s.host),
        files.first().map_or(output.display().to_string(), |f| f.0.display().to_string()),
    );
    Ok(())
}

fn train(t: TrainArgs) -> Result<()> {
    let spec = t.model.spec("tiny")?;
    let zero = t.ranks.config(t.zero, t.ranks.ranks * 4usize.div_ceil(t.ranks.ranks.max(1)))?;
    let mut config = wasmem::train::TrainConfig::new(spec.clone(), zero, spec.steps);
    config.seed = t.seed;
    config.adam.lr = t.lr;
    let opts = TrainOptions {
        config,
        policy: t.policy,
        swap_at: t.swap_at,
        record: t.record,
        shadow: t.shadow,
        ctl: t.ctl.map(|p| p.unwrap_or_else(wasmem::ctl::default_socket_path)),
        device_capacity: t.device_mem,
    };
    let loader: Loader = Arc::new(runtime(t.deadline_ms)?.clone());
    let json = t.json;
    // Printed as the run goes, from the rank that completes the step; a
    // failure to print stops the run (and is reported after it).
    let failed: Arc<std::sync::Mutex<Option<anyhow::Error>>> = Arc::default();
    let seen = failed.clone();
    let on_step = move |v: &wasmem::train::session::StepView<'_>| {
        let line = if json { report::train::step_json(v).to_string() } else { report::train::step_text(v) };
        match emit(&format!("{line}\n")) {
            Ok(()) => StepFlow::Continue,
            Err(e) => {
                seen.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert(e);
                StepFlow::Stop
            }
        }
    };
    let outcome = match t.device {
        DeviceKind::Sim => {
            let sim = SimConfig { capacity: t.device_mem, host_backed: true, ..SimConfig::default() };
            let s = TrainSession::prepare(opts, loader, true, |_| Ok(SimDevice::new(sim)))?;
            announce(s.ctl_path());
            s.run(on_step).map_err(anyhow::Error::new)
        }
        DeviceKind::Cuda => {
            let s = TrainSession::prepare(opts, loader, false, |_| CudaDevice::new(0)).context("--device cuda")?;
            announce(s.ctl_path());
            s.run(on_step).map_err(|e| anyhow::Error::new(e).context("--device cuda"))
        }
    };
    if let Some(e) = failed.lock().unwrap_or_else(|p| p.into_inner()).take() {
        return Err(e);
    }
    let outcome = outcome?;
    if json {
        outln!("{}", report::train::summary_json(&outcome));
    } else {
        out!("{}", report::train::summary_text(&outcome));
    }
    Ok(())
}

fn announce(ctl: Option<&std::path::Path>) {
    if let Some(p) = ctl {
        note!("control socket: {} (wasmem ctl --socket {} status)", p.display(), p.display());
    }
}

/// The statuses of the sockets `ctl` talks to, with `--rank` applied: a
/// process whose status names another rank (or none, when one was asked) is
/// left out.
fn ctl_targets(
    socket: Option<&std::path::Path>,
    rank: Option<u32>,
    timeout: Duration,
) -> Result<Vec<(std::path::PathBuf, serde_json::Value)>> {
    let mut out = Vec::new();
    for path in wasmem::ctl::choose_sockets(socket)? {
        let v = wasmem::ctl::request(&path, &wasmem::ctl::Request::Status, timeout)
            .with_context(|| format!("control socket {}", path.display()))?;
        let theirs = v.get("process_rank").and_then(serde_json::Value::as_u64);
        if rank.is_none() || theirs == rank.map(u64::from) {
            out.push((path, v));
        }
    }
    if out.is_empty() {
        bail!("no running wasmem process has rank {}", rank.map_or_else(String::new, |r| r.to_string()));
    }
    Ok(out)
}

fn ctl(socket: Option<std::path::PathBuf>, rank: Option<u32>, cmd: CtlCommand) -> Result<()> {
    // A swap may compile a policy before it answers.
    let timeout = Duration::from_secs(120);
    let targets = ctl_targets(socket.as_deref(), rank, timeout)?;
    let many = targets.len() > 1;
    match cmd {
        CtlCommand::Swap { role, policy } => {
            let mut failed = Vec::new();
            for (path, _) in &targets {
                let req = wasmem::ctl::Request::Swap { role, policy: policy.clone() };
                match wasmem::ctl::request(path, &req, timeout) {
                    Ok(v) => {
                        let o: wasmem::ctl::SwapOutcome = serde_json::from_value(v)?;
                        let at = if many { format!(" ({})", path.display()) } else { String::new() };
                        for ((r, old), new) in o.roles.iter().zip(&o.old).zip(&o.new) {
                            outln!("{r}: {old} → {new} on {} rank(s), from the next decision{at}", o.ranks);
                        }
                    }
                    Err(e) if !many => return Err(e.into()),
                    Err(e) => {
                        note!("{}: {e}", path.display());
                        failed.push(path.display().to_string());
                    }
                }
            }
            if !failed.is_empty() {
                bail!("the swap failed on {} of {} process(es): {}", failed.len(), targets.len(), failed.join(", "));
            }
        }
        CtlCommand::Status { json } => {
            if json && !many {
                outln!("{}", targets[0].1);
            } else if json {
                let all: Vec<serde_json::Value> = targets
                    .iter()
                    .map(|(p, v)| serde_json::json!({"socket": p.display().to_string(), "status": v}))
                    .collect();
                outln!("{}", serde_json::Value::Array(all));
            } else {
                for (path, v) in targets {
                    let s: wasmem::ctl::Status = serde_json::from_value(v)?;
                    if many {
                        outln!("== {} ==", path.display());
                    }
                    out!("{}", wasmem::ctl::render_status(&s));
                }
            }
        }
    }
    Ok(())
}

fn run(cli: Cli) -> Result<()> {
    match cli.cmd {
        Command::Replay { common, policy, export_snapshot, shadow, plan_cache } => {
            replay(common, policy, export_snapshot, shadow, plan_cache)
        }
        Command::Compare { common, policies, plot, swap_at, plan_cache } => {
            compare(common, policies, plot, swap_at, plan_cache)
        }
        Command::Policy { cmd } => policy::run(cmd),
        cmd @ Command::Synth { .. } => synth(cmd),
        Command::Train(t) => train(t),
        Command::Plan { traces, synth, policy, json, deadline_ms } => plan(traces, synth, &policy, json, deadline_ms),
        Command::Ctl { socket, rank, cmd } => ctl(socket, rank, cmd),
    }
}

/// An error and its causes, each said once (a cause whose text the message
/// already contains is not repeated).
fn render(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let m = cause.to_string();
        if out.contains(&m) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&m);
    }
    out
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        // Default: warnings, and what policies log through `host.log` at info and
        // above (rate limited per instance); WASMEM_LOG overrides.
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("WASMEM_LOG")
                .unwrap_or_else(|_| "warn,wasmem::policy::guest=info".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.is::<OutputClosed>() => ExitCode::SUCCESS,
        Err(e) => {
            note!("error: {}", render(&e));
            ExitCode::FAILURE
        }
    }
}
