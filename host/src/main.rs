//! The `wasmem` command line: a thin layer over the library.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use rayon::prelude::*;

use std::time::Duration;

use wasmem::alloc::Allocator;
use wasmem::decision::Policies;
use wasmem::device::cuda::CudaDevice;
use wasmem::device::sim::SimConfig;
use wasmem::device::sim::SimDevice;
use wasmem::device::Device;
use wasmem::policy::{resolve_with, Limits, Runtime, RuntimeConfig};
use wasmem::replay::{replay_split, Metrics, ReplayConfig, Split};
use wasmem::report;
use wasmem::shadow::{Shadow, ShadowHandle};
use wasmem::synth::{synth, ModelSpec, Optimizer};
use wasmem::tier::TierConfig;
use wasmem::trace::Event;
use wasmem::trace::{snapshot, FileTraceWriter, TraceHeader, TraceReader};
use wasmem::types::parse_size;

/// wasmem: a GPU memory engine whose decisions are made by WebAssembly policies.
#[derive(Parser)]
#[command(name = "wasmem", version, about)]
struct Cli {
    #[command(subcommand)]
    cmd: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Replay traces under one policy and print its metrics.
    Replay {
        #[command(flatten)]
        common: Common,
        /// Policy: a built-in name (naive, pytorch, lifecycle; eviction only: lru,
        /// dtr, belady), a shipped policy name (pytorch-like, lru-evict, …), a
        /// `.wasm` path, or `a+b` to take each role from the first part that provides it.
        #[arg(long, default_value = "lifecycle")]
        policy: String,
        /// Write the replay's final state and actions as a PyTorch memory
        /// snapshot (for `torch.cuda._memory_viz`); one input only.
        #[arg(long)]
        export_snapshot: Option<PathBuf>,
        /// Shadow A/B: also feed every event to this policy on a bookkeeping-only
        /// copy of the allocator, and print its metrics beside the primary's
        /// (the primary run is unchanged).
        #[arg(long, value_name = "POLICY")]
        shadow: Option<String>,
    },
    /// Replay traces under several policies side by side.
    Compare {
        #[command(flatten)]
        common: Common,
        /// Policies to compare (repeat); ratios are against the first.
        #[arg(long = "policy", default_values_t = ["pytorch".to_string(), "lifecycle".to_string(), "naive".to_string()])]
        policies: Vec<String>,
        /// Draw reserved and allocated bytes over each workload into this SVG file.
        #[arg(long)]
        plot: Option<PathBuf>,
        /// Hot-swap every policy to POLICY before event EVENT (0-based) and report both halves.
        #[arg(long, value_name = "EVENT:POLICY", value_parser = parse_swap)]
        swap_at: Option<(u64, String)>,
    },
    /// Work with WebAssembly policy components.
    Policy {
        #[command(subcommand)]
        cmd: PolicyCommand,
    },
    /// Talk to a running `wasmem train` over its control socket.
    Ctl {
        /// The control socket (default: the only socket in $XDG_RUNTIME_DIR/wasmem,
        /// or in <tmp>/wasmem-<uid> without XDG_RUNTIME_DIR).
        #[arg(long, global = true)]
        socket: Option<PathBuf>,
        #[command(subcommand)]
        cmd: CtlCommand,
    },
    /// Synthesize a transformer-training trace (trace v1) from a model description.
    Synth {
        #[command(flatten)]
        model: ModelArgs,
        /// Output file (`.jsonl` or `.jsonl.gz`); with `--ranks N` one file per
        /// rank (`NAME.rankR.jsonl`) unless `--rank` picks one.
        #[arg(short, long)]
        output: PathBuf,
        /// Synthesize the ZeRO training plan of this stage (0–3) instead of the
        /// eager-PyTorch model: the per-rank trace `wasmem train` records.
        #[arg(long, value_parser = clap::value_parser!(u8).range(0..=3))]
        zero: Option<u8>,
        #[command(flatten)]
        ranks: ZeroArgs,
        /// With `--zero`: write only this rank's trace (to `--output` itself).
        #[arg(long)]
        rank: Option<usize>,
    },
    /// Train a small GPT with ZeRO sharding on local ranks (one thread each),
    /// every tensor in the engine's allocator; prints loss and memory per step.
    Train(TrainArgs),
}

#[derive(Args, Clone)]
struct ZeroArgs {
    /// Data-parallel ranks.
    #[arg(long, default_value_t = 1)]
    ranks: usize,
    /// ZeRO-Offload: fp32 master weights and Adam states in host memory, Adam on the CPU.
    #[arg(long, value_parser = ["cpu"])]
    offload: Option<String>,
    /// Micro-batches per step over all ranks, a multiple of `--ranks`
    /// (default: train 4 rounded up to a multiple of the ranks, synth one per rank).
    #[arg(long)]
    micro_batches: Option<usize>,
}

impl ZeroArgs {
    fn config(&self, stage: u8, default_micro: usize) -> Result<wasmem::shard::ZeroConfig> {
        let z = wasmem::shard::ZeroConfig {
            stage,
            ranks: self.ranks,
            offload: self.offload.is_some(),
            micro_batches: self.micro_batches.unwrap_or(default_micro),
        };
        z.validate().map_err(|e| anyhow::anyhow!(e))?;
        Ok(z)
    }
}

#[derive(Args)]
struct TrainArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// ZeRO stage: 0 (data parallel), 1 (optimizer states sharded), 2 (+ gradients), 3 (+ parameters).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u8).range(0..=3))]
    zero: u8,
    #[command(flatten)]
    ranks: ZeroArgs,
    /// Policy of every rank's allocator (as for `replay`).
    #[arg(long, default_value = "lifecycle")]
    policy: String,
    /// Hot-swap every rank's policy to POLICY at the start of step STEP (0-based).
    #[arg(long, value_name = "STEP:POLICY", value_parser = parse_swap)]
    swap_at: Option<(u64, String)>,
    /// Record each rank's allocation trace (trace v1; `NAME.rankR.jsonl` per rank).
    #[arg(long)]
    record: Option<PathBuf>,
    /// Shadow A/B: feed every rank's allocation events to this policy on a
    /// bookkeeping-only allocator and print its memory beside the primary's.
    #[arg(long, value_name = "POLICY")]
    shadow: Option<String>,
    /// Serve the live-control socket for `wasmem ctl` while training (default
    /// path: $XDG_RUNTIME_DIR/wasmem/<pid>.sock).
    #[arg(long, value_name = "SOCKET", num_args = 0..=1)]
    ctl: Option<Option<PathBuf>>,
    /// One JSON object per step and a summary object.
    #[arg(long)]
    json: bool,
    /// Seed of the weights and the synthetic data.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Learning rate of AdamW.
    #[arg(long, default_value_t = 3e-3)]
    lr: f32,
    /// Device backend of every rank: `sim` (host-backed simulation) or `cuda` (GPU 0).
    #[arg(long, value_enum, default_value_t = DeviceKind::Sim)]
    device: DeviceKind,
    /// Simulated device memory per rank.
    #[arg(long, default_value = "80GiB", value_parser = parse_size)]
    device_mem: u64,
    /// Per-call deadline of WebAssembly policies, in milliseconds.
    #[arg(long, default_value_t = 1.0)]
    deadline_ms: f64,
}

#[derive(Subcommand)]
enum PolicyCommand {
    /// Validate a component's exports and WIT version and run the conformance suite.
    Check {
        /// The component (`.wasm`).
        file: PathBuf,
        /// Per-call deadline in milliseconds (interpreted Python and JavaScript
        /// policies need more than the default).
        #[arg(long, default_value_t = 1.0)]
        deadline_ms: f64,
        /// Text passed to the policy's `init`.
        #[arg(long, default_value = "")]
        config: String,
    },
}

#[derive(Subcommand)]
enum CtlCommand {
    /// Replace a role's policy on every rank, from the next decision on.
    Swap {
        /// placement, reclamation, eviction, or all (every role POLICY provides).
        #[arg(value_parser = wasmem::ctl::RoleArg::parse)]
        role: wasmem::ctl::RoleArg,
        /// A policy spec, as `--policy` takes it.
        policy: String,
    },
    /// Show the active policies, counters and memory of every rank.
    Status {
        /// Print the status as JSON.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Args, Clone, Default)]
struct ModelArgs {
    /// Preset: gpt2-124m, bert-base, llama-1b, llama-7b, llama-70b, tiny
    /// (default: gpt2-124m; `train`: tiny).
    #[arg(long)]
    preset: Option<String>,
    /// Override: transformer layers.
    #[arg(long)]
    layers: Option<u64>,
    /// Override: hidden size.
    #[arg(long)]
    hidden: Option<u64>,
    /// Override: attention heads.
    #[arg(long)]
    heads: Option<u64>,
    /// Override: key/value heads.
    #[arg(long)]
    kv_heads: Option<u64>,
    /// Override: MLP intermediate size.
    #[arg(long)]
    intermediate: Option<u64>,
    /// Override: vocabulary size.
    #[arg(long)]
    vocab: Option<u64>,
    /// Override: sequence length.
    #[arg(long)]
    seq: Option<u64>,
    /// Override: micro-batch size.
    #[arg(long)]
    batch: Option<u64>,
    /// Override: element type (fp32, bf16).
    #[arg(long)]
    dtype: Option<String>,
    /// Override: optimizer (adamw, sgd).
    #[arg(long)]
    optimizer: Option<String>,
    /// Override: activation checkpointing (true/false).
    #[arg(long)]
    checkpointing: Option<bool>,
    /// Override: training steps.
    #[arg(long)]
    steps: Option<u64>,
}

impl ModelArgs {
    fn spec(&self, default: &str) -> Result<ModelSpec> {
        let preset = self.preset.as_deref().unwrap_or(default);
        let mut s = ModelSpec::preset(preset)
            .with_context(|| format!("unknown preset `{preset}`: presets are {}", ModelSpec::PRESETS.join(", ")))?;
        let set = |dst: &mut u64, v: Option<u64>| {
            if let Some(v) = v {
                *dst = v;
            }
        };
        set(&mut s.layers, self.layers);
        set(&mut s.hidden, self.hidden);
        // Multi-head presets stay multi-head when only `heads` changes.
        let mha = s.kv_heads == s.heads;
        set(&mut s.heads, self.heads);
        set(&mut s.kv_heads, self.kv_heads.or(self.heads.filter(|_| mha)));
        set(&mut s.intermediate, self.intermediate);
        set(&mut s.vocab, self.vocab);
        set(&mut s.seq, self.seq);
        set(&mut s.batch, self.batch);
        set(&mut s.steps, self.steps);
        if let Some(d) = &self.dtype {
            (s.dtype_bytes, s.master_weights) = match d.as_str() {
                "fp32" => (4, false),
                "bf16" | "fp16" => (2, true),
                other => bail!("unknown dtype `{other}` (expected fp32, bf16 or fp16)"),
            };
        }
        if let Some(o) = &self.optimizer {
            s.optimizer = match o.as_str() {
                "adamw" | "adam" => Optimizer::Adamw,
                "sgd" => Optimizer::Sgd,
                other => bail!("unknown optimizer `{other}` (expected adamw or sgd)"),
            };
        }
        if let Some(c) = self.checkpointing {
            s.checkpointing = c;
        }
        s.validate().map_err(|e| anyhow::anyhow!("invalid model description: {e}"))?;
        Ok(s)
    }
}

/// Device backends selectable on the command line.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum DeviceKind {
    /// The simulated device.
    Sim,
    /// A CUDA GPU through the driver API.
    Cuda,
}

#[derive(Args)]
struct Common {
    /// Trace files (trace v1 `.jsonl` or `.jsonl.gz`) or PyTorch memory
    /// snapshots (`.pickle` from `torch.cuda.memory._dump_snapshot`).
    traces: Vec<PathBuf>,
    /// Also replay a synthesized workload of this preset (repeat; see `wasmem synth`).
    #[arg(long = "synth")]
    synth: Vec<String>,
    /// Simulated device memory (e.g. 80GiB, 16GB).
    #[arg(long, default_value = "80GiB", value_parser = parse_size)]
    device_mem: u64,
    /// Device backend: `sim` (simulated, the default) or `cuda` (GPU 0).
    #[arg(long, value_enum, default_value_t = DeviceKind::Sim)]
    device: DeviceKind,
    /// Print one JSON object per (trace, policy) instead of text.
    #[arg(long)]
    json: bool,
    /// Per-call deadline of WebAssembly policies, in milliseconds (the rank
    /// threads share the cores, so a policy call can wait behind another
    /// rank's computation: the default is longer than replay's).
    #[arg(long, default_value_t = 50.0)]
    deadline_ms: f64,
    #[command(flatten)]
    tiers: TierArgs,
}

/// Host and disk tiers of a replay (eviction instead of OOM, prefetch).
#[derive(Args, Clone)]
struct TierArgs {
    /// Do not evict to host or disk: a request the device cannot serve is an OOM.
    #[arg(long)]
    no_offload: bool,
    /// Host-tier capacity (host memory for evicted tensors).
    #[arg(long, default_value = "1TiB", value_parser = parse_size)]
    host_mem: u64,
    /// Device-host copy bandwidth in GB/s.
    #[arg(long, default_value_t = 25.0)]
    host_gbps: f64,
    /// Spill directory for the disk tier (default: a fresh temporary directory, removed at exit).
    #[arg(long)]
    spill_dir: Option<PathBuf>,
    /// Largest size of the disk tier (a full disk past it).
    #[arg(long, value_parser = parse_size)]
    disk_quota: Option<u64>,
    /// Prefetch off-device tensors at phase boundaries (off by default: on
    /// the sample traces it adds traffic; see ARCHITECTURE.md, Tiers).
    #[arg(long)]
    prefetch: bool,
    /// Largest fraction of the device prefetched at one phase boundary.
    #[arg(long, default_value_t = 0.25)]
    prefetch_fraction: f64,
    /// Prefetch only while this fraction of the device stays free, on top of
    /// what the coming phase grew by the last time it ran.
    #[arg(long, default_value_t = 0.05)]
    prefetch_headroom: f64,
}

impl TierArgs {
    fn config(&self) -> Result<Option<TierConfig>> {
        if self.no_offload {
            return Ok(None);
        }
        if !(self.host_gbps.is_finite() && self.host_gbps > 0.0) {
            bail!("--host-gbps must be a positive number of GB/s, not {}", self.host_gbps);
        }
        if let Some(dir) = &self.spill_dir {
            // Replays carry no contents and write no spill file: check the directory now.
            std::fs::create_dir_all(dir)
                .with_context(|| format!("--spill-dir: cannot create spill directory {}", dir.display()))?;
        }
        for (flag, v) in
            [("--prefetch-fraction", self.prefetch_fraction), ("--prefetch-headroom", self.prefetch_headroom)]
        {
            if !(0.0..=1.0).contains(&v) {
                bail!("{flag} must be between 0 and 1, not {v}");
            }
        }
        Ok(Some(TierConfig {
            host_capacity: self.host_mem,
            host_gbps: self.host_gbps,
            spill_dir: self.spill_dir.clone(),
            disk_quota: self.disk_quota.unwrap_or(u64::MAX),
            prefetch: self.prefetch,
            prefetch_fraction: self.prefetch_fraction,
            prefetch_headroom: self.prefetch_headroom,
            ..TierConfig::default()
        }))
    }
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

/// Resolves a policy spec: a built-in name, a shipped policy name, a `.wasm`
/// path, or several joined by `+` (see `wasmem::policy::resolve`).
fn policies_for(spec: &str, deadline_ms: f64) -> Result<Policies> {
    Ok(resolve_with(runtime(deadline_ms)?, spec).with_context(|| format!("cannot load policy `{spec}`"))?.policies)
}

/// A workload: a trace file or a synthesized preset.
#[derive(Clone)]
enum Input {
    File(PathBuf),
    Synth(String),
}

impl Input {
    fn name(&self) -> String {
        match self {
            Input::File(p) => p.display().to_string(),
            Input::Synth(p) => format!("synth:{p}"),
        }
    }

    fn events(&self) -> Result<Box<dyn Iterator<Item = Result<Event, String>> + Send>> {
        Ok(match self {
            Input::File(p) if is_snapshot(p) => {
                let snap = snapshot::import_file(p, &snapshot::ImportOptions::default())?;
                Box::new(snap.events.into_iter().map(Ok))
            }
            Input::File(p) => {
                let r = TraceReader::open(p).with_context(|| format!("cannot read {}", p.display()))?;
                Box::new(r.map(|e| e.map_err(|e| e.to_string())))
            }
            Input::Synth(preset) => {
                let spec = ModelArgs { preset: Some(preset.clone()), ..ModelArgs::default() }.spec("gpt2-124m")?;
                let ev = synth(&spec).map_err(|e| anyhow::anyhow!(e))?;
                Box::new(ev.into_iter().map(Ok))
            }
        })
    }
}

fn is_snapshot(p: &std::path::Path) -> bool {
    p.extension().is_some_and(|e| e == "pickle" || e == "pkl")
}

/// PyTorch's own figures for a snapshot input, shown beside each replay.
fn pytorch_figures(input: &Input) -> Result<Option<snapshot::SnapshotInfo>> {
    match input {
        Input::File(p) if is_snapshot(p) => {
            Ok(Some(snapshot::import_file(p, &snapshot::ImportOptions::default())?.info))
        }
        _ => Ok(None),
    }
}

fn pytorch_line(info: &snapshot::SnapshotInfo) -> String {
    format!(
        "recorded by PyTorch itself: reserved {} at the end of the snapshot, peak over the window {} ({} segments)",
        wasmem::types::human_bytes(info.pytorch_reserved_bytes_end),
        wasmem::types::human_bytes(info.pytorch_peak_reserved_bytes),
        info.segments
    )
}

fn inputs(common: &Common) -> Result<Vec<Input>> {
    let v: Vec<Input> =
        common.traces.iter().cloned().map(Input::File).chain(common.synth.iter().cloned().map(Input::Synth)).collect();
    if v.is_empty() {
        bail!("give at least one trace file or --synth PRESET");
    }
    for i in &v {
        if let Input::Synth(p) = i {
            ModelSpec::preset(p)
                .with_context(|| format!("unknown preset `{p}`: presets are {}", ModelSpec::PRESETS.join(", ")))?;
        }
    }
    Ok(v)
}

fn parse_swap(s: &str) -> Result<(u64, String), String> {
    let (e, p) = s.split_once(':').ok_or_else(|| format!("`{s}`: expected EVENT:POLICY, e.g. 5000:lifecycle"))?;
    let e = e.trim().parse().map_err(|_| format!("`{e}` is not an event index"))?;
    if p.trim().is_empty() {
        return Err(format!("`{s}`: the policy after `:` is missing"));
    }
    Ok((e, p.trim().to_string()))
}

/// What one replay produced for the report.
struct RunOut {
    metrics: Metrics,
    samples: Vec<wasmem::replay::Sample>,
    halves: Option<wasmem::replay::Halves>,
    /// The shadow's metrics and error count (`--shadow`).
    shadow: Option<(Metrics, u64)>,
}

/// Options of one replay beyond the common ones.
#[derive(Default)]
struct RunOpts<'a> {
    progress: bool,
    export: Option<&'a std::path::Path>,
    sample_every: u64,
    swap: Option<&'a (u64, String)>,
    shadow: Option<&'a str>,
}

fn run_full(input: &Input, policy: &str, common: &Common, opts: &RunOpts<'_>) -> Result<RunOut> {
    let policies = policies_for(policy, common.deadline_ms)?;
    match common.device {
        DeviceKind::Sim => {
            let dev = SimDevice::new(SimConfig { capacity: common.device_mem, ..SimConfig::default() });
            run_on(Allocator::new(dev, policies), input, policy, common, opts)
        }
        DeviceKind::Cuda => {
            // A replay on a real GPU: segments come from the device itself.
            let dev = CudaDevice::new(0).map_err(|e| anyhow::anyhow!("--device cuda: {e}"))?;
            run_on(Allocator::new(dev, policies), input, policy, common, opts)
        }
    }
}

fn run_on<D: Device + 'static>(
    alloc: Allocator<D>,
    input: &Input,
    policy: &str,
    common: &Common,
    opts: &RunOpts<'_>,
) -> Result<RunOut> {
    let (progress, export) = (opts.progress, opts.export);
    let reader = input.events()?;
    let tiers = common.tiers.config()?;
    let shadow = match opts.shadow {
        Some(q) => {
            let dev = SimConfig { capacity: alloc.device().capacity(), ..SimConfig::default() };
            let policies = policies_for(q, common.deadline_ms)?;
            if policies.eviction.needs_future() {
                bail!("--shadow {q}: its eviction reads the trace's future, which a shadow never sees");
            }
            let mut s = Shadow::new(q, policies, dev);
            if let Some(t) = &tiers {
                s = s.with_tiers(t.clone());
            }
            Some(ShadowHandle::new(s))
        }
        None => None,
    };
    let reader: Box<dyn Iterator<Item = Result<Event, String>> + Send> = match &shadow {
        Some(h) => {
            let mut tap = h.tap();
            Box::new(reader.inspect(move |e| {
                if let Ok(e) = e {
                    tap(e)
                }
            }))
        }
        None => reader,
    };
    let cfg = ReplayConfig {
        device: SimConfig { capacity: common.device_mem, ..SimConfig::default() },
        record_actions: export.is_some(),
        sample_every: opts.sample_every,
        tiers,
    };
    let bar = progress.then(|| {
        let b = indicatif::ProgressBar::new_spinner();
        b.set_message(format!("{} · {policy}", input.name()));
        b
    });
    let split = match opts.swap {
        Some((at, to)) => {
            let to =
                resolve_with(runtime(common.deadline_ms)?, to).with_context(|| format!("cannot load policy `{to}`"))?;
            Some(Split { at: *at, to, opts: Default::default() })
        }
        None => None,
    };
    let (r, halves) = replay_split(
        reader,
        alloc,
        &cfg,
        |n| {
            if let Some(b) = &bar {
                b.set_position(n);
            }
        },
        split,
    )
    .with_context(|| format!("replay of {} with {policy} failed", input.name()))?;
    if let (Some((at, _)), None) = (opts.swap, &halves) {
        bail!("--swap-at {at}: {} has only {} events", input.name(), r.metrics.events);
    }
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    let mut r = r;
    if let Some(path) = export {
        let snap = wasmem::replay::snapshot_of(&mut r.allocator);
        snapshot::export::export_file(path, &snap).with_context(|| format!("cannot write {}", path.display()))?;
        eprintln!(
            "wrote snapshot {} ({} segments, {} trace entries)",
            path.display(),
            snap.segments.len(),
            snap.trace.len()
        );
    }
    let shadow = shadow.map(|h| (h.metrics(), h.with(|s| s.errors())));
    Ok(RunOut { metrics: r.metrics, samples: r.samples, halves, shadow })
}

fn json_line(input: &Input, policy: &str, m: &Metrics) -> Result<String> {
    let mut v = serde_json::to_value(m)?;
    v["trace"] = input.name().into();
    if let Some(info) = pytorch_figures(input)? {
        v["pytorch_reserved_bytes_end"] = info.pytorch_reserved_bytes_end.into();
        v["pytorch_peak_reserved_bytes"] = info.pytorch_peak_reserved_bytes.into();
    }
    v["policy"] = policy.into();
    Ok(serde_json::to_string(&v)?)
}

fn run(cli: Cli) -> Result<()> {
    match cli.cmd {
        Command::Replay { common, policy, export_snapshot, shadow } => {
            policies_for(&policy, common.deadline_ms)?;
            if let Some(q) = &shadow {
                policies_for(q, common.deadline_ms)?;
            }
            let progress = !common.json && std::io::stderr().is_terminal();
            let ins = inputs(&common)?;
            if export_snapshot.is_some() && ins.len() != 1 {
                bail!("--export-snapshot takes exactly one input ({} given)", ins.len());
            }
            for t in &ins {
                let opts = RunOpts {
                    progress,
                    export: export_snapshot.as_deref(),
                    shadow: shadow.as_deref(),
                    ..RunOpts::default()
                };
                let out = run_full(t, &policy, &common, &opts)?;
                let m = out.metrics;
                if common.json {
                    let mut line: serde_json::Value = serde_json::from_str(&json_line(t, &policy, &m)?)?;
                    if let (Some((sm, errors)), Some(q)) = (&out.shadow, &shadow) {
                        let mut v = serde_json::to_value(sm)?;
                        v["policy"] = q.as_str().into();
                        v["errors"] = (*errors).into();
                        line["shadow"] = v;
                    }
                    println!("{line}");
                } else {
                    println!("{}", report::summary(&t.name(), &policy, &m));
                    if let (Some((sm, errors)), Some(q)) = (&out.shadow, &shadow) {
                        let title = format!("== {} · shadow A/B ({errors} shadow errors) ==", t.name());
                        println!("{}", wasmem::shadow::side_by_side(&title, (&policy, &m), (q, sm)));
                    }
                    if let Some(info) = pytorch_figures(t)? {
                        println!("{}", pytorch_line(&info));
                    }
                }
            }
        }
        Command::Compare { common, policies, plot, swap_at } => {
            if policies.is_empty() {
                bail!("give at least one --policy");
            }
            for p in &policies {
                policies_for(p, common.deadline_ms)?;
            }
            let ins = inputs(&common)?;
            let pairs: Vec<(usize, usize)> =
                (0..ins.len()).flat_map(|t| (0..policies.len()).map(move |p| (t, p))).collect();
            if let Some((_, to)) = &swap_at {
                policies_for(to, common.deadline_ms)?;
            }
            let opts = RunOpts {
                sample_every: if plot.is_some() { 8 } else { 0 },
                swap: swap_at.as_ref(),
                ..RunOpts::default()
            };
            let results: Vec<Result<RunOut>> =
                pairs.par_iter().map(|&(t, p)| run_full(&ins[t], &policies[p], &common, &opts)).collect();
            let mut it = results.into_iter();
            let mut charts = Vec::new();
            for t in &ins {
                let mut cols = Vec::new();
                let mut half_cols = Vec::new();
                let mut runs = Vec::new();
                for p in &policies {
                    let out = it.next().expect("one result per pair")?;
                    if common.json {
                        let mut line: serde_json::Value = serde_json::from_str(&json_line(t, p, &out.metrics)?)?;
                        if let Some(h) = &out.halves {
                            line["halves"] = serde_json::to_value(h)?;
                        }
                        println!("{line}");
                    }
                    if let (Some(h), Some((_, to))) = (&out.halves, &swap_at) {
                        half_cols.push((format!("{p} [0,{})", h.split_at), h.first.clone()));
                        half_cols.push((format!("→{to} [{},end)", h.split_at), h.second.clone()));
                    }
                    cols.push((p.clone(), out.metrics.clone()));
                    runs.push((p.clone(), out));
                }
                if plot.is_some() {
                    charts.push((t.name(), runs));
                }
                if !common.json {
                    println!("{}", report::comparison_table(&format!("== {} ==", t.name()), &cols));
                    if !half_cols.is_empty() {
                        let title = format!("== {} · both halves of the hot swap ==", t.name());
                        println!("{}", report::comparison_table(&title, &half_cols));
                    }
                    if let Some(info) = pytorch_figures(t)? {
                        println!("{}\n", pytorch_line(&info));
                    }
                }
            }
            if let Some(path) = &plot {
                let series: Vec<(String, Vec<wasmem::plot::Series<'_>>)> = charts
                    .iter()
                    .map(|(title, runs)| {
                        let s = runs
                            .iter()
                            .map(|(p, out)| wasmem::plot::Series { label: p, samples: &out.samples })
                            .collect();
                        (title.clone(), s)
                    })
                    .collect();
                wasmem::plot::draw(path, &series)?;
                eprintln!("wrote {}", path.display());
            }
        }
        Command::Policy { cmd: PolicyCommand::Check { file, deadline_ms, config } } => {
            let opts = wasmem::policy::check::CheckOptions { config, ..Default::default() };
            let verdict = wasmem::policy::check::check_with(runtime(deadline_ms)?, &file, &opts);
            print!("{verdict}");
            if !verdict.passed() {
                bail!("{} failed the conformance suite", file.display());
            }
        }
        Command::Synth { model, output, zero: Some(stage), ranks, rank } => {
            let spec = model.spec("gpt2-124m")?;
            let cfg = ranks.config(stage, ranks.ranks)?;
            if let Some(r) = rank.filter(|&r| r >= cfg.ranks) {
                bail!("--rank {r} is not a rank of {} ranks", cfg.ranks);
            }
            let plan = wasmem::shard::Plan::new(&spec, cfg).map_err(|e| anyhow::anyhow!("invalid ZeRO plan: {e}"))?;
            let source = format!("wasmem synth --zero {stage}: {cfg:?} {}", serde_json::to_string(&spec)?);
            let files = wasmem::shard::write_traces(&plan, spec.steps, &output, rank, &source)
                .with_context(|| format!("cannot write {}", output.display()))?;
            let s = plan.state_bytes();
            eprintln!(
                "wrote {} trace(s) of {} events ({} parameters; model states/rank {} device + {} host) to {}",
                files.len(),
                files.first().map_or(0, |f| f.1),
                plan.parameters(),
                wasmem::types::human_bytes(s.device()),
                wasmem::types::human_bytes(s.host),
                files.first().map_or(output.display().to_string(), |f| f.0.display().to_string()),
            );
        }
        Command::Train(t) => train(t)?,
        Command::Ctl { socket, cmd } => {
            let path = wasmem::ctl::choose_socket(socket.as_deref())?;
            // A swap may compile a policy before it answers.
            let timeout = Duration::from_secs(120);
            match cmd {
                CtlCommand::Swap { role, policy } => {
                    let req = wasmem::ctl::Request::Swap { role, policy };
                    let v = wasmem::ctl::request(&path, &req, timeout)?;
                    let o: wasmem::ctl::SwapOutcome = serde_json::from_value(v)?;
                    for ((r, old), new) in o.roles.iter().zip(&o.old).zip(&o.new) {
                        println!("{r}: {old} → {new} on {} rank(s), from the next decision", o.ranks);
                    }
                }
                CtlCommand::Status { json } => {
                    let v = wasmem::ctl::request(&path, &wasmem::ctl::Request::Status, timeout)?;
                    if json {
                        println!("{v}");
                    } else {
                        let s: wasmem::ctl::Status = serde_json::from_value(v)?;
                        print!("{}", wasmem::ctl::render_status(&s));
                    }
                }
            }
        }
        Command::Synth { model, output, zero: None, ranks, rank } => {
            if ranks.ranks != 1 || ranks.offload.is_some() || ranks.micro_batches.is_some() || rank.is_some() {
                bail!("--ranks, --rank, --offload and --micro-batches describe a ZeRO plan: add --zero STAGE");
            }
            let spec = model.spec("gpt2-124m")?;
            let events = synth(&spec).map_err(|e| anyhow::anyhow!(e))?;
            let header = TraceHeader { source: format!("wasmem synth: {}", serde_json::to_string(&spec)?), ranks: 1 };
            let mut w = FileTraceWriter::create(&output, &header)
                .with_context(|| format!("cannot write {}", output.display()))?;
            for e in &events {
                w.write(e)?;
            }
            w.close()?;
            eprintln!("wrote {} events ({} parameters) to {}", events.len(), spec.parameter_count(), output.display());
        }
    }
    Ok(())
}

fn train(t: TrainArgs) -> Result<()> {
    let spec = t.model.spec("tiny")?;
    let zero = t.ranks.config(t.zero, t.ranks.ranks * 4usize.div_ceil(t.ranks.ranks.max(1)))?;
    let mut config = wasmem::train::TrainConfig::new(spec.clone(), zero, spec.steps);
    config.seed = t.seed;
    config.adam.lr = t.lr;
    let ctl = t.ctl.map(|p| p.unwrap_or_else(wasmem::ctl::default_socket_path));
    let opts = wasmem::train::run::TrainOptions {
        config,
        policy: t.policy,
        swap_at: t.swap_at,
        record: t.record,
        json: t.json,
        shadow: t.shadow,
        ctl,
        device_capacity: t.device_mem,
    };
    let loader: wasmem::spec::Loader = std::sync::Arc::new(runtime(t.deadline_ms)?.clone());
    match t.device {
        DeviceKind::Sim => wasmem::train::run::train_command(&opts, loader, |_| {
            Ok(SimDevice::new(SimConfig { capacity: t.device_mem, host_backed: true, ..SimConfig::default() }))
        }),
        DeviceKind::Cuda => wasmem::train::run::train_command(&opts, loader, |_| CudaDevice::new(0))
            .map_err(|e| anyhow::anyhow!("--device cuda: {e:#}")),
    }
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_env("WASMEM_LOG").unwrap_or_else(|_| "warn".into()))
        .with_writer(std::io::stderr)
        .init();
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
