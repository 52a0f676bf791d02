//! The command line's arguments (clap) and their conversion into the
//! library's options.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};

use wasmem::model::{ModelError, ModelOverrides, ModelSpec};
use wasmem::shard::{PlanError, ZeroConfig};
use wasmem::tier::TierConfig;
use wasmem::types::parse_size;

/// wasmem: a GPU memory engine whose decisions are made by WebAssembly policies.
#[derive(Parser)]
#[command(name = "wasmem", version, about)]
pub struct Cli {
    #[command(subcommand)]
    pub cmd: Command,
}

#[derive(Subcommand)]
pub enum Command {
    /// Replay traces under one policy and print its metrics.
    Replay {
        #[command(flatten)]
        common: Common,
        /// Policy: a built-in name (naive, pytorch, lifecycle, defrag; eviction only:
        /// lru, dtr, belady), a shipped policy name (pytorch-like, lru-evict, …), a
        /// `.wasm` path, or `a+b`: each role from the part that provides the fewest
        /// roles, the earlier on a tie (`pytorch-like+defrag-reclaim` reclaims with
        /// defrag-reclaim); `part?key=value,…` configures a part.
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
        /// Keep the run's plans in FILE and start from the plans there: the
        /// next run of the same training is planned from its first request
        /// (a planner is needed, e.g. `--policy planned`; one input only).
        #[arg(long, value_name = "FILE")]
        plan_cache: Option<PathBuf>,
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
        /// The policy with a planner (at most one) starts from the plans in FILE
        /// and keeps its plans there, the others run as they are: a warm planned
        /// run beside them (one input only).
        #[arg(long, value_name = "FILE")]
        plan_cache: Option<PathBuf>,
    },
    /// Plan each workload as a whole, knowing every lifetime in advance (the
    /// offline bound of planned placement, like `belady` for eviction): the
    /// smallest arena the planner finds, against the peak of live bytes —
    /// its plan of the whole trace, of what lies above the tensors that never
    /// leave, of each step (`step_end` markers) composed, of a repeating
    /// window of steps as a cycle, or of each step placed on its own in
    /// alternate aliased windows (steps that keep their output into the
    /// next), whichever is smallest (`composition` in the report).
    Plan {
        /// Trace files (trace v1 `.jsonl` or `.jsonl.gz`) or PyTorch memory
        /// snapshots (`.pickle`); `-` reads standard input.
        traces: Vec<PathBuf>,
        /// Also plan a synthesized workload of this preset (repeat; see `wasmem synth`).
        #[arg(long = "synth")]
        synth: Vec<String>,
        /// The policy whose planner plans (a built-in with a planner, `planned`,
        /// or a part that exports the `planner` interface). The default searches
        /// 100 times as long as online planning does (offline, no deadline);
        /// `planned` alone plans as a run's steps are planned.
        #[arg(long, default_value = "planned?effort=100")]
        policy: String,
        /// Print one JSON object per workload instead of text.
        #[arg(long)]
        json: bool,
        /// Per-call deadline of a WebAssembly planner, in milliseconds.
        #[arg(long, default_value_t = 60_000.0)]
        deadline_ms: f64,
    },
    /// Work with WebAssembly policy components.
    Policy {
        #[command(subcommand)]
        cmd: PolicyCommand,
    },
    /// Talk to running wasmem processes over their control sockets: a
    /// `wasmem train --ctl` run, or every rank of a PyTorch job that called
    /// `wasmem.torch.enable(ctl=True)`.
    Ctl {
        /// The control socket (default: every live socket in $XDG_RUNTIME_DIR/wasmem,
        /// or in <tmp>/wasmem-<uid> without XDG_RUNTIME_DIR: one per process of this node).
        #[arg(long, global = true)]
        socket: Option<PathBuf>,
        /// Only the process of this rank (`RANK` of a PyTorch job).
        #[arg(long, global = true)]
        rank: Option<u32>,
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
        /// Sequence lengths of successive steps, cycled (`512,384,448`):
        /// batches of varying length, each at most `--seq`.
        #[arg(long, value_delimiter = ',', value_name = "LEN,…")]
        seq_cycle: Vec<u64>,
    },
    /// Train a small GPT with ZeRO sharding on local ranks (one thread each),
    /// every tensor in the engine's allocator; prints loss and memory per step.
    Train(TrainArgs),
}

#[derive(Args, Clone)]
pub struct ZeroArgs {
    /// Data-parallel ranks.
    #[arg(long, default_value_t = 1)]
    pub ranks: usize,
    /// ZeRO-Offload: fp32 master weights and Adam states in host memory, Adam on the CPU.
    #[arg(long, value_parser = ["cpu"])]
    pub offload: Option<String>,
    /// Micro-batches per step over all ranks, a multiple of `--ranks`
    /// (default: train 4 rounded up to a multiple of the ranks, synth one per rank).
    #[arg(long)]
    pub micro_batches: Option<usize>,
}

impl ZeroArgs {
    /// The ZeRO configuration of `stage`, validated.
    pub fn config(&self, stage: u8, default_micro: usize) -> Result<ZeroConfig, PlanError> {
        let z = ZeroConfig {
            stage,
            ranks: self.ranks,
            offload: self.offload.is_some(),
            micro_batches: self.micro_batches.unwrap_or(default_micro),
        };
        z.validate()?;
        Ok(z)
    }
}

#[derive(Args)]
pub struct TrainArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// ZeRO stage: 0 (data parallel), 1 (optimizer states sharded), 2 (+ gradients), 3 (+ parameters).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u8).range(0..=3))]
    pub zero: u8,
    #[command(flatten)]
    pub ranks: ZeroArgs,
    /// Policy of every rank's allocator (as for `replay`).
    #[arg(long, default_value = "lifecycle")]
    pub policy: String,
    /// Hot-swap every rank's policy to POLICY at the start of step STEP (0-based).
    #[arg(long, value_name = "STEP:POLICY", value_parser = parse_swap)]
    pub swap_at: Option<(u64, String)>,
    /// Record each rank's allocation trace (trace v1; `NAME.rankR.jsonl` per rank).
    #[arg(long)]
    pub record: Option<PathBuf>,
    /// Shadow A/B: feed every rank's allocation events to this policy on a
    /// bookkeeping-only allocator and print its memory beside the primary's.
    #[arg(long, value_name = "POLICY")]
    pub shadow: Option<String>,
    /// Serve the live-control socket for `wasmem ctl` while training (default
    /// path: $XDG_RUNTIME_DIR/wasmem/<pid>.sock).
    #[arg(long, value_name = "SOCKET", num_args = 0..=1)]
    pub ctl: Option<Option<PathBuf>>,
    /// One JSON object per step and a summary object.
    #[arg(long)]
    pub json: bool,
    /// Seed of the weights and the synthetic data.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Learning rate of AdamW.
    #[arg(long, default_value_t = 3e-3)]
    pub lr: f32,
    /// Device backend of every rank: `sim` (host-backed simulation) or `cuda` (GPU 0).
    #[arg(long, value_enum, default_value_t = DeviceKind::Sim)]
    pub device: DeviceKind,
    /// Simulated device memory per rank.
    #[arg(long, default_value = "80GiB", value_parser = parse_capacity)]
    pub device_mem: u64,
    /// Per-call deadline of WebAssembly policies, in milliseconds.
    #[arg(long, default_value_t = 1.0)]
    pub deadline_ms: f64,
}

#[derive(Subcommand)]
pub enum PolicyCommand {
    /// Validate a component's exports and WIT version and run the conformance
    /// suite (fuzzed calls, or the calls of a replay of `--trace`); prints per
    /// role the calls and their p50/p99 duration.
    Check {
        /// The component (`.wasm`), or a shipped policy name.
        file: PathBuf,
        /// The engine's per-decision deadline to judge the calls' cost against,
        /// in milliseconds (eviction calls get 25 µs more per candidate). The
        /// calls themselves run with 10× this (at least 100 ms): they are
        /// measured, not interrupted.
        #[arg(long, default_value_t = 1.0)]
        deadline_ms: f64,
        /// Text passed to the policy's `init`.
        #[arg(long, default_value = "")]
        config: String,
        /// Run the checks on the calls of a replay of this trace (trace v1 or a
        /// PyTorch snapshot) instead of fuzzed calls.
        #[arg(long, value_name = "TRACE")]
        trace: Option<PathBuf>,
        /// With --trace: simulated device memory (default 80GiB, or 60 % of the
        /// trace's peak live bytes for a policy that exports eviction).
        #[arg(long, value_parser = parse_size)]
        device_mem: Option<u64>,
    },
    /// Create a policy project in a new directory (WIT and, for Rust, the SDK
    /// copied in) that builds with one command and passes `policy check`.
    New {
        /// Language: rust, python or js.
        #[arg(long, value_parser = parse_lang)]
        lang: wasmem::policy::scaffold::Lang,
        /// Role: placement, reclamation, eviction or planner (WIT 0.4.0).
        #[arg(long, value_parser = parse_project_role)]
        role: wasmem::policy::scaffold::ProjectRole,
        /// The policy's name (lowercase letters, digits, `-`).
        name: String,
        /// The project directory (default: ./NAME); created, or empty.
        #[arg(long)]
        dir: Option<PathBuf>,
    },
    /// Show the shipped policies and where this binary finds each one.
    List,
    /// Show the artifact cache (precompiled components) and its size, or clean it.
    Cache {
        /// Remove every cached artifact (the next load of a component compiles it again).
        #[arg(long)]
        clean: bool,
    },
}

/// `rust`, `python` or `js`.
fn parse_lang(s: &str) -> Result<wasmem::policy::scaffold::Lang, String> {
    wasmem::policy::scaffold::Lang::parse(s).ok_or_else(|| format!("`{s}`: expected rust, python or js"))
}

/// `placement`, `reclamation`, `eviction` or `planner`.
fn parse_project_role(s: &str) -> Result<wasmem::policy::scaffold::ProjectRole, String> {
    wasmem::policy::scaffold::ProjectRole::parse(s)
        .ok_or_else(|| format!("`{s}`: expected placement, reclamation, eviction or planner"))
}

#[derive(Subcommand)]
pub enum CtlCommand {
    /// Replace a role's policy on every rank of every process, from the next decision on.
    Swap {
        /// placement, reclamation, eviction, or all (every role POLICY provides).
        #[arg(value_parser = wasmem::ctl::RoleArg::parse)]
        role: wasmem::ctl::RoleArg,
        /// A policy spec, as `--policy` takes it.
        policy: String,
    },
    /// Show the active policies, counters and memory of every rank of every process.
    Status {
        /// Print the status as JSON.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Args, Clone, Default)]
pub struct ModelArgs {
    /// Preset: gpt2-124m, bert-base, llama-1b, llama-7b, llama-70b, tiny
    /// (default: gpt2-124m; `train`: tiny).
    #[arg(long)]
    pub preset: Option<String>,
    /// Override: transformer layers.
    #[arg(long)]
    pub layers: Option<u64>,
    /// Override: hidden size.
    #[arg(long)]
    pub hidden: Option<u64>,
    /// Override: attention heads.
    #[arg(long)]
    pub heads: Option<u64>,
    /// Override: key/value heads.
    #[arg(long)]
    pub kv_heads: Option<u64>,
    /// Override: MLP intermediate size.
    #[arg(long)]
    pub intermediate: Option<u64>,
    /// Override: vocabulary size.
    #[arg(long)]
    pub vocab: Option<u64>,
    /// Override: sequence length.
    #[arg(long)]
    pub seq: Option<u64>,
    /// Override: micro-batch size.
    #[arg(long)]
    pub batch: Option<u64>,
    /// Override: element type (fp32, bf16).
    #[arg(long)]
    pub dtype: Option<String>,
    /// Override: optimizer (adamw, sgd).
    #[arg(long)]
    pub optimizer: Option<String>,
    /// Override: activation checkpointing (true/false).
    #[arg(long)]
    pub checkpointing: Option<bool>,
    /// Override: training steps.
    #[arg(long)]
    pub steps: Option<u64>,
}

impl ModelArgs {
    /// The preset (or `default`) with the overrides applied.
    pub fn spec(&self, default: &str) -> Result<ModelSpec, ModelError> {
        let o = ModelOverrides {
            layers: self.layers,
            hidden: self.hidden,
            heads: self.heads,
            kv_heads: self.kv_heads,
            intermediate: self.intermediate,
            vocab: self.vocab,
            seq: self.seq,
            batch: self.batch,
            dtype: self.dtype.clone(),
            optimizer: self.optimizer.clone(),
            checkpointing: self.checkpointing,
            steps: self.steps,
        };
        o.apply(self.preset.as_deref().unwrap_or(default))
    }
}

/// Device backends selectable on the command line.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DeviceKind {
    /// The simulated device.
    Sim,
    /// A CUDA GPU through the driver API.
    Cuda,
}

#[derive(Args)]
pub struct Common {
    /// Trace files (trace v1 `.jsonl` or `.jsonl.gz`) or PyTorch memory
    /// snapshots (`.pickle` from `torch.cuda.memory._dump_snapshot`).
    pub traces: Vec<PathBuf>,
    /// Also replay a synthesized workload of this preset (repeat; see `wasmem synth`).
    #[arg(long = "synth")]
    pub synth: Vec<String>,
    /// Simulated device memory (e.g. 80GiB, 16GB).
    #[arg(long, default_value = "80GiB", value_parser = parse_capacity)]
    pub device_mem: u64,
    /// Device backend: `sim` (simulated, the default) or `cuda` (GPU 0).
    #[arg(long, value_enum, default_value_t = DeviceKind::Sim)]
    pub device: DeviceKind,
    /// Print one JSON object per (trace, policy) instead of text.
    #[arg(long)]
    pub json: bool,
    /// Per-decision deadline of WebAssembly policies, in milliseconds (eviction
    /// calls get 25 µs more per candidate); a call past it is decided by the
    /// built-in fallback. Generous by default: the replays of `compare` run in
    /// parallel and share the cores.
    #[arg(long, default_value_t = 50.0)]
    pub deadline_ms: f64,
    /// Parse trace files every time instead of using the trace cache
    /// (binary copies of parsed traces of 1 MiB and more, under
    /// $WASMEM_CACHE_DIR/traces, else $XDG_CACHE_HOME/wasmem/traces, else
    /// ~/.cache/wasmem/traces).
    #[arg(long)]
    pub no_trace_cache: bool,
    #[command(flatten)]
    pub tiers: TierArgs,
}

/// Host and disk tiers of a replay (eviction instead of OOM, prefetch).
#[derive(Args, Clone)]
pub struct TierArgs {
    /// Do not evict to host or disk: a request the device cannot serve is an OOM.
    #[arg(long)]
    pub no_offload: bool,
    /// Host-tier capacity (host memory for evicted tensors).
    #[arg(long, default_value = "1TiB", value_parser = parse_size)]
    pub host_mem: u64,
    /// Device-host copy bandwidth in GB/s.
    #[arg(long, default_value_t = 25.0)]
    pub host_gbps: f64,
    /// Spill directory for the disk tier (default: a fresh temporary directory, removed at exit).
    #[arg(long)]
    pub spill_dir: Option<PathBuf>,
    /// Largest size of the disk tier (a full disk past it).
    #[arg(long, value_parser = parse_size)]
    pub disk_quota: Option<u64>,
    /// Prefetch off-device tensors at phase boundaries (off by default: on
    /// the sample traces it adds traffic; see ARCHITECTURE.md, Tiers).
    #[arg(long)]
    pub prefetch: bool,
    /// Largest fraction of the device prefetched at one phase boundary.
    #[arg(long, default_value_t = 0.25)]
    pub prefetch_fraction: f64,
    /// Prefetch only while this fraction of the device stays free, on top of
    /// what the coming phase grew by the last time it ran.
    #[arg(long, default_value_t = 0.05)]
    pub prefetch_headroom: f64,
}

impl TierArgs {
    /// The tiers of a replay (`None` with `--no-offload`).
    pub fn config(&self) -> Result<Option<TierConfig>> {
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

/// `EVENT:POLICY` (or `STEP:POLICY`).
pub fn parse_swap(s: &str) -> Result<(u64, String), String> {
    let (e, p) = s.split_once(':').ok_or_else(|| format!("`{s}`: expected EVENT:POLICY, e.g. 5000:lifecycle"))?;
    let e = e.trim().parse().map_err(|_| format!("`{e}` is not an event index"))?;
    if p.trim().is_empty() {
        return Err(format!("`{s}`: the policy after `:` is missing"));
    }
    Ok((e, p.trim().to_string()))
}

/// A device capacity: a size of at least one byte.
pub fn parse_capacity(s: &str) -> Result<u64, String> {
    match parse_size(s) {
        Ok(0) => Err(format!("`{s}`: a device needs more than 0 bytes")),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}
