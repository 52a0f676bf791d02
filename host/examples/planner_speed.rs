//! Planning time of the built-in greedy planner (native) against the same
//! algorithm in the shipped `greedy-planner` component (WebAssembly), on
//! the same training-like step profiles of 5,000 to 50,000 requests, in the
//! same run; the plans are checked identical.
//!
//! ```sh
//! bash policies/build.sh --rust
//! cargo run --release -p wasmem --example planner_speed [-- ROUNDS]
//! ```
//!
//! Prints, per profile size, the median of ROUNDS (default 7) plans each:
//! native, WebAssembly (the call through the runtime: lowering the profile,
//! planning, lifting the plan), and their ratio.

use std::time::{Duration, Instant};

use wasmem::builtin::GreedyPlanner;
use wasmem::decision::{PlanRequest, PlannerPolicy, PolicyContext, StepProfile};
use wasmem::policy::{CacheDir, Limits, Runtime, RuntimeConfig};
use wasmem::types::{StreamId, TensorKind, GIB};

/// A training-like step of about `n` requests: activations freed in
/// reverse by the backward, a temporary per layer in each pass, gradients
/// that wrap into the next step, deterministic sizes.
fn profile(n: u32) -> StepProfile {
    let layers = n / 4;
    let mut rs: Vec<PlanRequest> = Vec::new();
    let mut x: u64 = 0x2545_f491_4f6c_dd1d;
    let mut size = |lo: u64, hi: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        lo + x % (hi - lo)
    };
    let req = |bytes, kind, freed_at, wraps_to| PlanRequest { bytes, kind, stream: StreamId(0), freed_at, wraps_to };
    for _ in 0..layers {
        rs.push(req(size(1 << 20, 64 << 20), TensorKind::Activation, None, None));
        let k = rs.len() as u32;
        rs.push(req(size(1 << 16, 8 << 20), TensorKind::Temp, Some(k + 1), None));
    }
    for i in 0..layers {
        let k = rs.len() as u32;
        rs.push(req(size(1 << 16, 8 << 20), TensorKind::Temp, Some(k + 1), None));
        rs[(2 * (layers - 1 - i)) as usize].freed_at = Some(k + 1);
        rs.push(req(size(1 << 18, 16 << 20), TensorKind::Grad, None, Some(i % 64)));
    }
    StepProfile { step: 1, requests: rs }
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn main() -> anyhow::Result<()> {
    let rounds: usize = std::env::args().nth(1).map(|a| a.parse()).transpose()?.unwrap_or(7).max(1);
    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let path = repo.join("policies/out/greedy-planner.wasm");
    anyhow::ensure!(path.is_file(), "{} is missing: run `bash policies/build.sh --rust`", path.display());
    // No deadline: this measures the call, it does not judge it.
    let rt = Runtime::new(RuntimeConfig {
        limits: Limits { deadline: None, max_memory: 512 << 20, ..Limits::default() },
        epoch_tick: None,
        cache: CacheDir::Off,
    })?;
    let mut wasm = rt.load(&path)?.instantiate("")?.planner().ok_or_else(|| anyhow::anyhow!("no planner"))?;
    let ctx = PolicyContext { capacity_bytes: 1 << 50, ..PolicyContext::default() };
    println!("{:>9} {:>12} {:>12} {:>7}  arena", "requests", "native", "wasm", "ratio");
    for n in [5_000u32, 20_000, 50_000] {
        let p = profile(n);
        let native_plan = GreedyPlanner::plan_profile(&p);
        let wasm_plan = wasm.plan(&p, &ctx)?;
        anyhow::ensure!(native_plan == wasm_plan, "the plans of {n} requests differ");
        let (mut tn, mut tw) = (Vec::new(), Vec::new());
        for _ in 0..rounds {
            let t = Instant::now();
            std::hint::black_box(GreedyPlanner.plan(&p, &ctx)?);
            tn.push(t.elapsed());
            let t = Instant::now();
            std::hint::black_box(wasm.plan(&p, &ctx)?);
            tw.push(t.elapsed());
        }
        let (a, b) = (median(tn), median(tw));
        println!(
            "{:>9} {:>9.2} ms {:>9.2} ms {:>6.2}×  {:.2} GiB",
            p.requests.len(),
            a.as_secs_f64() * 1e3,
            b.as_secs_f64() * 1e3,
            b.as_secs_f64() / a.as_secs_f64(),
            native_plan.arena_bytes as f64 / GIB as f64
        );
    }
    Ok(())
}
