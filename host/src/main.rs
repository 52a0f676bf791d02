//! The `wasmem` command line: a thin layer over the library.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use rayon::prelude::*;

use wasmem::builtin::{self, Policies};
use wasmem::device::sim::SimConfig;
use wasmem::replay::{replay_with, Metrics, ReplayConfig};
use wasmem::report;
use wasmem::trace::TraceReader;
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
    },
    /// Replay traces under several policies side by side.
    Compare {
        #[command(flatten)]
        common: Common,
        /// Policies to compare (repeat); ratios are against the first.
        #[arg(long = "policy", default_values_t = ["pytorch".to_string(), "lifecycle".to_string(), "naive".to_string()])]
        policies: Vec<String>,
    },
}

#[derive(Args)]
struct Common {
    /// Trace files (trace v1 `.jsonl` or `.jsonl.gz`).
    #[arg(required = true)]
    traces: Vec<PathBuf>,
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

fn trace_name(p: &Path) -> String {
    p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| p.display().to_string())
}

fn run_one(trace: &Path, policy: &str, common: &Common, progress: bool) -> Result<Metrics> {
    let reader = TraceReader::open(trace).with_context(|| format!("cannot read {}", trace.display()))?;
    let cfg = ReplayConfig {
        device: SimConfig { capacity: common.device_mem, ..SimConfig::default() },
        ..Default::default()
    };
    let alloc = wasmem::alloc::Allocator::new(wasmem::device::sim::SimDevice::new(cfg.device), policies_for(policy)?);
    let bar = progress.then(|| {
        let b = indicatif::ProgressBar::new_spinner();
        b.set_message(format!("{} · {policy}", trace_name(trace)));
        b
    });
    let r = replay_with(reader, alloc, &cfg, |n| {
        if let Some(b) = &bar {
            b.set_position(n);
        }
    })
    .with_context(|| format!("replay of {} with {policy} failed", trace.display()))?;
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    Ok(r.metrics)
}

fn json_line(trace: &Path, policy: &str, m: &Metrics) -> Result<String> {
    let mut v = serde_json::to_value(m)?;
    v["trace"] = trace.display().to_string().into();
    v["policy"] = policy.into();
    Ok(serde_json::to_string(&v)?)
}

fn run(cli: Cli) -> Result<()> {
    match cli.cmd {
        Command::Replay { common, policy } => {
            policies_for(&policy)?;
            let progress = !common.json && std::io::stderr().is_terminal();
            for t in &common.traces {
                let m = run_one(t, &policy, &common, progress)?;
                if common.json {
                    println!("{}", json_line(t, &policy, &m)?);
                } else {
                    println!("{}", report::summary(&trace_name(t), &policy, &m));
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
            let pairs: Vec<(usize, usize)> =
                (0..common.traces.len()).flat_map(|t| (0..policies.len()).map(move |p| (t, p))).collect();
            let results: Vec<Result<Metrics>> =
                pairs.par_iter().map(|&(t, p)| run_one(&common.traces[t], &policies[p], &common, false)).collect();
            let mut it = results.into_iter();
            for t in &common.traces {
                let mut cols = Vec::new();
                for p in &policies {
                    let m = it.next().expect("one result per pair")?;
                    if common.json {
                        println!("{}", json_line(t, p, &m)?);
                    }
                    cols.push((p.clone(), m));
                }
                if !common.json {
                    println!("{}", report::comparison_table(&format!("== {} ==", t.display()), &cols));
                }
            }
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
