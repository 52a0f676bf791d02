//! Throughput of the replay pipeline on a big synthesized trace, every figure
//! from the same run (so they can be compared as ratios):
//!
//! ```text
//! cargo run --release -p wasmem --example trace_pipeline -- [--events N] [--dir DIR] [--only PART]...
//! ```
//!
//! It synthesizes `llama-1b` training steps until the trace has N events
//! (default 10,000,000), writes them gzip-compressed to DIR (default: a
//! temporary directory), and prints one JSON object per figure:
//!
//! - `gunzip`: decompression alone (bytes/s of output);
//! - `parse`: the reader alone (events/s), general parser only and with the
//!   fast path;
//! - `allocator`: a replay of the events already in memory, per policy;
//! - `end_to_end`: a replay of the file through `Workload` and the session
//!   (what `wasmem replay` runs), per policy: without the trace cache, then
//!   with an empty cache (`cold`: parses and writes the entry), then again
//!   (`warm`: reads the entry). Its `ratio` is events/s over the same
//!   policy's `allocator` figure.
//!
//! `--only` restricts the run to `gunzip`, `parse`, `allocator` or
//! `end_to_end` (repeatable); `--policy` replaces the policies (default
//! `pytorch` and `defrag`).
use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::Instant;

use wasmem::builtin;
use wasmem::model::ModelSpec;
use wasmem::replay::{replay, ReplayConfig};
use wasmem::session::{self, ReplayOptions};
use wasmem::spec::Builtins;
use wasmem::synth::synth;
use wasmem::trace::cache::TraceCache;
use wasmem::trace::{write_file, Event, TraceHeader, TraceReader};
use wasmem::workload::{Source, TraceOptions, Workload};

/// Events one `llama-1b` training step adds.
const EVENTS_PER_STEP: u64 = 2740;

struct Args {
    events: u64,
    dir: Option<PathBuf>,
    only: Vec<String>,
    policies: Vec<String>,
}

fn args() -> Args {
    let mut a = Args { events: 10_000_000, dir: None, only: Vec::new(), policies: Vec::new() };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().unwrap_or_else(|| panic!("{flag} needs a value"));
        match flag.as_str() {
            "--events" => a.events = value().parse().expect("--events N"),
            "--dir" => a.dir = Some(PathBuf::from(value())),
            "--only" => a.only.push(value()),
            "--policy" => a.policies.push(value()),
            other => panic!("unknown argument {other}"),
        }
    }
    if a.policies.is_empty() {
        a.policies = vec!["pytorch".into(), "defrag".into()];
    }
    a
}

fn figure(what: &str, variant: &str, policy: &str, events: u64, seconds: f64, ratio: Option<f64>) {
    let mut o = serde_json::json!({
        "what": what,
        "variant": variant,
        "policy": policy,
        "events": events,
        "seconds": seconds,
        "events_per_second": events as f64 / seconds,
    });
    if let Some(r) = ratio {
        o["ratio_to_allocator"] = r.into();
    }
    println!("{o}");
}

/// Seconds of one end-to-end replay of `path` with `policy`.
fn end_to_end(path: &Path, policy: &str, cache: Option<TraceCache>, read_ahead: bool) -> (u64, f64) {
    let t = Instant::now();
    let opts = TraceOptions { cache, read_ahead };
    let w = Workload::open_with(&Source::File(path.to_path_buf()), &opts).expect("opens");
    let out = session::run(&w, policy, &ReplayOptions::default(), &Builtins, &|_| {}).expect("replays");
    (out.metrics.events, t.elapsed().as_secs_f64())
}

fn main() {
    let a = args();
    let wants = |part: &str| a.only.is_empty() || a.only.iter().any(|o| o == part);
    let steps = a.events.saturating_sub(3908).div_ceil(EVENTS_PER_STEP) + 1;
    let spec = ModelSpec { steps, ..ModelSpec::preset("llama-1b").expect("preset") };
    let events: Vec<Event> = synth(&spec).expect("valid preset");
    let n = events.len() as u64;
    let tmp = tempfile::tempdir().expect("temporary directory");
    let dir = a.dir.clone().unwrap_or_else(|| tmp.path().to_path_buf());
    let path = dir.join(format!("llama-1b-{n}.jsonl.gz"));
    let header = TraceHeader { source: format!("llama-1b, {steps} steps (trace_pipeline)"), ranks: 1 };
    if ["gunzip", "parse", "end_to_end"].iter().any(|p| wants(p)) {
        let t = Instant::now();
        write_file(&path, &header, &events).expect("writes the trace");
        let bytes = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
        let s = t.elapsed().as_secs_f64();
        eprintln!("{n} events, {bytes} bytes gzip-compressed at {} in {s:.2} s", path.display());
    }

    if wants("gunzip") {
        let t = Instant::now();
        let file = std::fs::File::open(&path).expect("opens");
        let mut d = flate2::read::MultiGzDecoder::new(std::io::BufReader::with_capacity(1 << 16, file));
        let mut buf = vec![0u8; 1 << 16];
        let mut out = 0u64;
        loop {
            match d.read(&mut buf).expect("decompresses") {
                0 => break,
                k => out += k as u64,
            }
        }
        let s = t.elapsed().as_secs_f64();
        println!(
            "{}",
            serde_json::json!({"what": "gunzip", "bytes_out": out, "seconds": s, "bytes_per_second": out as f64 / s, "events_per_second": n as f64 / s})
        );
    }
    if wants("parse") {
        for (variant, fast) in [("general", false), ("fast", true)] {
            let t = Instant::now();
            let mut r = TraceReader::open(&path).expect("opens");
            r.set_fast_path(fast);
            let mut count = 0u64;
            for e in r {
                e.expect("valid");
                count += 1;
            }
            figure("parse", variant, "-", count, t.elapsed().as_secs_f64(), None);
        }
    }
    let mut alloc_eps = std::collections::HashMap::new();
    if wants("allocator") || wants("end_to_end") {
        for policy in &a.policies {
            let t = Instant::now();
            let p = builtin::by_name(policy).expect("a built-in policy");
            let r = replay(events.iter().copied().map(Ok::<_, String>), p, &ReplayConfig::default()).expect("replays");
            let s = t.elapsed().as_secs_f64();
            alloc_eps.insert(policy.clone(), r.metrics.events as f64 / s);
            figure("allocator", "in_memory", policy, r.metrics.events, s, Some(1.0));
        }
    }
    drop(events);
    if wants("end_to_end") {
        for policy in &a.policies {
            for (threads, read_ahead) in [("one_thread", false), ("read_ahead", true)] {
                let ratio = |k: u64, s: f64| Some(k as f64 / s / alloc_eps[policy]);
                let (k, s) = end_to_end(&path, policy, None, read_ahead);
                figure("end_to_end", &format!("no_cache/{threads}"), policy, k, s, ratio(k, s));
                let cache_dir = tempfile::tempdir().expect("temporary directory");
                let cache = TraceCache::at(cache_dir.path());
                let (k, s) = end_to_end(&path, policy, Some(cache.clone()), read_ahead);
                figure("end_to_end", &format!("cold/{threads}"), policy, k, s, ratio(k, s));
                let (k, s) = end_to_end(&path, policy, Some(cache), read_ahead);
                figure("end_to_end", &format!("warm/{threads}"), policy, k, s, ratio(k, s));
            }
        }
    }
}
