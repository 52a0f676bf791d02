//! The `wasmem` command line: a thin layer over the library.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use rayon::prelude::*;

use wasmem::builtin::{self, Policies};
use wasmem::device::sim::SimConfig;
use wasmem::replay::{replay_with, Metrics, ReplayConfig};
use wasmem::report;
use wasmem::synth::{synth, ModelSpec, Optimizer};
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
        /// Policy: a built-in name (naive, pytorch, lifecycle).
        #[arg(long, default_value = "lifecycle")]
        policy: String,
        /// Write the replay's final state and actions as a PyTorch memory
        /// snapshot (for `torch.cuda._memory_viz`); one input only.
        #[arg(long)]
        export_snapshot: Option<PathBuf>,
    },
    /// Replay traces under several policies side by side.
    Compare {
        #[command(flatten)]
        common: Common,
        /// Policies to compare (repeat); ratios are against the first.
        #[arg(long = "policy", default_values_t = ["pytorch".to_string(), "lifecycle".to_string(), "naive".to_string()])]
        policies: Vec<String>,
    },
    /// Synthesize a transformer-training trace (trace v1) from a model description.
    Synth {
        #[command(flatten)]
        model: ModelArgs,
        /// Output file (`.jsonl` or `.jsonl.gz`).
        #[arg(short, long)]
        output: PathBuf,
    },
}

#[derive(Args, Clone, Default)]
struct ModelArgs {
    /// Preset: gpt2-124m, bert-base, llama-1b, llama-7b.
    #[arg(long, default_value = "gpt2-124m")]
    preset: String,
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
    fn spec(&self) -> Result<ModelSpec> {
        let mut s = ModelSpec::preset(&self.preset).with_context(|| {
            format!("unknown preset `{}`: presets are {}", self.preset, ModelSpec::PRESETS.join(", "))
        })?;
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
    /// Print one JSON object per (trace, policy) instead of text.
    #[arg(long)]
    json: bool,
}

fn policies_for(spec: &str) -> Result<Policies> {
    builtin::by_name(spec).with_context(|| {
        format!("unknown policy `{spec}`: built-in policies are {}", builtin::BUILTIN_NAMES.join(", "))
    })
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
                let spec = ModelArgs { preset: preset.clone(), ..ModelArgs::default() }.spec()?;
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

fn run_one(input: &Input, policy: &str, common: &Common, progress: bool) -> Result<Metrics> {
    run_full(input, policy, common, progress, None)
}

fn run_full(
    input: &Input,
    policy: &str,
    common: &Common,
    progress: bool,
    export: Option<&std::path::Path>,
) -> Result<Metrics> {
    let reader = input.events()?;
    let cfg = ReplayConfig {
        device: SimConfig { capacity: common.device_mem, ..SimConfig::default() },
        record_actions: export.is_some(),
        ..Default::default()
    };
    let alloc = wasmem::alloc::Allocator::new(wasmem::device::sim::SimDevice::new(cfg.device), policies_for(policy)?);
    let bar = progress.then(|| {
        let b = indicatif::ProgressBar::new_spinner();
        b.set_message(format!("{} · {policy}", input.name()));
        b
    });
    let r = replay_with(reader, alloc, &cfg, |n| {
        if let Some(b) = &bar {
            b.set_position(n);
        }
    })
    .with_context(|| format!("replay of {} with {policy} failed", input.name()))?;
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
    Ok(r.metrics)
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
        Command::Replay { common, policy, export_snapshot } => {
            policies_for(&policy)?;
            let progress = !common.json && std::io::stderr().is_terminal();
            let ins = inputs(&common)?;
            if export_snapshot.is_some() && ins.len() != 1 {
                bail!("--export-snapshot takes exactly one input ({} given)", ins.len());
            }
            for t in &ins {
                let m = run_full(t, &policy, &common, progress, export_snapshot.as_deref())?;
                if common.json {
                    println!("{}", json_line(t, &policy, &m)?);
                } else {
                    println!("{}", report::summary(&t.name(), &policy, &m));
                    if let Some(info) = pytorch_figures(t)? {
                        println!("{}", pytorch_line(&info));
                    }
                }
            }
        }
        Command::Compare { common, policies } => {
            if policies.is_empty() {
                bail!("give at least one --policy");
            }
            for p in &policies {
                policies_for(p)?;
            }
            let ins = inputs(&common)?;
            let pairs: Vec<(usize, usize)> =
                (0..ins.len()).flat_map(|t| (0..policies.len()).map(move |p| (t, p))).collect();
            let results: Vec<Result<Metrics>> =
                pairs.par_iter().map(|&(t, p)| run_one(&ins[t], &policies[p], &common, false)).collect();
            let mut it = results.into_iter();
            for t in &ins {
                let mut cols = Vec::new();
                for p in &policies {
                    let m = it.next().expect("one result per pair")?;
                    if common.json {
                        println!("{}", json_line(t, p, &m)?);
                    }
                    cols.push((p.clone(), m));
                }
                if !common.json {
                    println!("{}", report::comparison_table(&format!("== {} ==", t.name()), &cols));
                    if let Some(info) = pytorch_figures(t)? {
                        println!("{}\n", pytorch_line(&info));
                    }
                }
            }
        }
        Command::Synth { model, output } => {
            let spec = model.spec()?;
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
