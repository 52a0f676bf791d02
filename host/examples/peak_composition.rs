//! Where the reserved bytes lie at a replay's peak, for finding what keeps a
//! policy's overhead above 1: replays a trace once to find the first event
//! at which the reserved bytes reach their peak, then again up to that
//! event, and prints, per pool, its segments, their bytes, the bytes of the
//! live tensors in them, what rounding adds to those tensors, the free
//! bytes, and how many of those free bytes are whole pages (which stitching
//! and trimming can use; the rest are slivers of partly used pages).
//!
//! ```sh
//! cargo run --release -p wasmem --example peak_composition -- TRACE [POLICY] [POOL]
//! ```
//!
//! POLICY is a built-in policy (default `planned`). With POOL, each segment
//! of that pool is listed too, with its free blocks (`#index/blocks@offset:size`,
//! MiB). A planned arena is one segment of the `planned` pool: its free
//! bytes are the plan's, not waste.

use std::collections::BTreeMap;
use std::process::ExitCode;

use wasmem::alloc::Allocator;
use wasmem::device::sim::SimDevice;
use wasmem::replay::{replay_with, Replay, ReplayConfig};
use wasmem::workload::{Source, Workload};

/// The 2 MiB page of the simulated device.
const PAGE: u64 = 2 << 20;

/// Replays the first `take` events of `path` (all: `None`) under `policy`,
/// sampling the gauges after every event when `sample`.
fn run(path: &str, policy: &str, take: Option<usize>, sample: bool) -> Result<Replay<SimDevice>, String> {
    let w = Workload::open(&Source::File(path.into())).map_err(|e| format!("{path}: {e}"))?;
    let cfg = ReplayConfig { sample_every: u64::from(sample), ..ReplayConfig::default() };
    let alloc = Allocator::with_builtin(SimDevice::new(cfg.device), policy)
        .ok_or_else(|| format!("{policy}: not a built-in policy"))?;
    let events = w.events().map_err(|e| format!("{path}: {e}"))?;
    let n = take.unwrap_or(usize::MAX);
    replay_with(events.take(n), alloc, &cfg, |_| {}).map_err(|e| format!("{path}: {e}"))
}

fn mib(x: u64) -> f64 {
    x as f64 / (1 << 20) as f64
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let Some(path) = args.get(1) else {
        eprintln!("usage: peak_composition TRACE [POLICY] [POOL]");
        return ExitCode::from(2);
    };
    let policy = args.get(2).map_or("planned", String::as_str);
    let detail = args.get(3);
    match report(path, policy, detail) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("peak_composition: {e}");
            ExitCode::FAILURE
        }
    }
}

fn report(path: &str, policy: &str, detail: Option<&String>) -> Result<(), String> {
    let whole = run(path, policy, None, true)?;
    let peak = whole.metrics.peak_reserved_bytes;
    let at = whole.samples.iter().find(|s| s.reserved >= peak).map(|s| s.event).ok_or("the trace reserves nothing")?;
    println!(
        "{path} under {policy}: peak reserved {peak} B, peak live {} B (overhead {:.5}), first reached after event {at}",
        whole.metrics.peak_live_bytes,
        peak as f64 / whole.metrics.peak_live_bytes.max(1) as f64
    );
    let upto = run(path, policy, Some(at as usize + 1), false)?;
    let a = &upto.allocator;
    let g = a.gauges();
    println!(
        "then: reserved {:.1} MiB, allocated {:.1} MiB, live {:.1} MiB",
        mib(g.reserved_bytes),
        mib(g.allocated_bytes),
        mib(g.live_bytes)
    );
    // pool -> (segments, bytes, live, rounding, free, whole free pages)
    let mut pools: BTreeMap<String, (usize, u64, u64, u64, u64, u64)> = BTreeMap::new();
    let views = a.segment_views();
    for s in &views {
        let e = pools.entry(s.pool.clone()).or_default();
        e.0 += 1;
        e.1 += s.size;
        for &(off, size, tensor) in &s.blocks {
            match tensor {
                Some((bytes, _)) => {
                    e.2 += bytes;
                    e.3 += size - bytes;
                }
                None => {
                    e.4 += size;
                    let (lo, hi) = (off.div_ceil(PAGE) * PAGE, (off + size) / PAGE * PAGE);
                    e.5 += hi.saturating_sub(lo);
                }
            }
        }
    }
    let mut in_segments = 0;
    for (pool, (n, size, live, rounding, free, pages)) in &pools {
        in_segments += size;
        println!(
            "{pool:>20}: {n:4} segments {:10.1} MiB, live {:10.1}, rounding {:6.2}, free {:9.2} (whole pages {:9.2}) MiB",
            mib(*size),
            mib(*live),
            mib(*rounding),
            mib(*free),
            mib(*pages)
        );
    }
    println!(
        "segments {:.1} MiB (address space: an aliased arena counts both windows); reserved outside segments (spare pages) {:.2} MiB",
        mib(in_segments),
        mib(g.reserved_bytes.saturating_sub(in_segments))
    );
    if let Some(pool) = detail {
        for s in views.iter().filter(|s| &s.pool == pool) {
            let free: Vec<String> = s
                .blocks
                .iter()
                .enumerate()
                .filter(|(_, b)| b.2.is_none())
                .map(|(i, b)| format!("#{i}/{}@{:.2}:{:.3}", s.blocks.len(), mib(b.0), mib(b.1)))
                .collect();
            println!("  segment {:.1} MiB, {} blocks, free: {}", mib(s.size), s.blocks.len(), free.join(" "));
        }
    }
    Ok(())
}
