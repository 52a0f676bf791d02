//! Planning time of the built-in greedy planner (native) against the same
//! algorithm in the shipped `greedy-planner` component (WebAssembly), on
//! the same step profiles of 2,000, 5,000 and 50,000 requests (two shapes, see
//! `training` and `deep`), in the same run; the plans are checked identical.
//!
//! ```sh
//! bash policies/build.sh --rust
//! cargo run --release -p wasmem --example planner_speed [-- ROUNDS]
//! ```
//!
//! Prints, per profile, the median of ROUNDS (default 3) plans each:
//! native, WebAssembly (the call through the runtime: lowering the profile,
//! planning, lifting the plan), their ratio, and the engine's default
//! planning deadline for that profile (1 ms + 25 µs per request).

use std::time::{Duration, Instant};

use wasmem::builtin::GreedyPlanner;
use wasmem::decision::{PlanRequest, PlannerPolicy, PolicyContext, StepProfile};
use wasmem::policy::{CacheDir, Limits, Runtime, RuntimeConfig};
use wasmem::types::{StreamId, TensorKind, GIB};

/// xorshift64: deterministic sizes.
struct Sizes(u64);

impl Sizes {
    fn next(&mut self, lo: u64, hi: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        lo + self.0 % (hi - lo)
    }
}

fn req(bytes: u64, kind: TensorKind, freed_at: Option<u32>, wraps_to: Option<u32>) -> PlanRequest {
    PlanRequest { bytes, kind, stream: StreamId(0), freed_at, wraps_to }
}

/// A training-like step of `n` requests: a forward of `n / 2` requests in
/// which every tenth is an activation saved for the backward and the
/// others are temporaries freed within 1–8 requests; a backward of as many
/// that frees the activations in reverse, with temporaries alike and a
/// gradient per layer that wraps into the next step.
fn training(n: u32) -> StepProfile {
    let mut s = Sizes(0x2545_f491_4f6c_dd1d);
    let half = n / 2;
    let mut rs: Vec<PlanRequest> = Vec::new();
    let mut acts = Vec::new();
    for k in 0..half {
        if k.is_multiple_of(10) {
            acts.push(rs.len());
            rs.push(req(s.next(1 << 20, 64 << 20), TensorKind::Activation, None, None));
        } else {
            let life = s.next(1, 9) as u32;
            rs.push(req(s.next(1 << 12, 8 << 20), TensorKind::Temp, Some((k + life).min(n)), None));
        }
    }
    for k in half..n {
        if (k - half).is_multiple_of(10) {
            if let Some(a) = acts.pop() {
                rs[a].freed_at = Some(k + 1);
            }
            rs.push(req(s.next(1 << 18, 16 << 20), TensorKind::Grad, None, Some((k - half) / 10 % 64)));
        } else {
            let life = s.next(1, 9) as u32;
            rs.push(req(s.next(1 << 12, 8 << 20), TensorKind::Temp, Some((k + life).min(n)), None));
        }
    }
    StepProfile { step: 1, requests: rs }
}

/// A deep step of `n` requests: a forward in which every fourth request is
/// an activation live until the backward (a quarter of all requests live
/// at once at the turn), temporaries between, freed in reverse: the
/// greedy planner's costly case (each block overlaps thousands of others).
fn deep(n: u32) -> StepProfile {
    let mut s = Sizes(0x9e37_79b9_7f4a_7c15);
    let layers = n / 4;
    let mut rs: Vec<PlanRequest> = Vec::new();
    for _ in 0..layers {
        rs.push(req(s.next(1 << 20, 64 << 20), TensorKind::Activation, None, None));
        let k = rs.len() as u32;
        rs.push(req(s.next(1 << 16, 8 << 20), TensorKind::Temp, Some(k + 1), None));
    }
    for i in 0..layers {
        let k = rs.len() as u32;
        rs.push(req(s.next(1 << 16, 8 << 20), TensorKind::Temp, Some(k + 1), None));
        rs[(2 * (layers - 1 - i)) as usize].freed_at = Some(k + 1);
        rs.push(req(s.next(1 << 18, 16 << 20), TensorKind::Grad, None, Some(i % 64)));
    }
    StepProfile { step: 1, requests: rs }
}

/// A named profile generator.
type Shape = (&'static str, fn(u32) -> StepProfile);

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn main() -> anyhow::Result<()> {
    let rounds: usize = std::env::args().nth(1).map(|a| a.parse()).transpose()?.unwrap_or(3).max(1);
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
    println!(
        "{:>9} {:>9} {:>12} {:>12} {:>7} {:>12}  arena",
        "shape", "requests", "native", "wasm", "ratio", "deadline"
    );
    let shapes: [Shape; 2] = [("training", training), ("deep", deep)];
    for ((shape, make), n) in shapes.iter().flat_map(|s| [2_000u32, 5_000, 50_000].map(|n| (*s, n))) {
        let p = make(n);
        let native_plan = GreedyPlanner::plan_profile(&p);
        let wasm_plan = wasm.plan(&p, &ctx)?;
        anyhow::ensure!(native_plan == wasm_plan, "the plans of {n} requests differ");
        let (mut tn, mut tw) = (Vec::new(), Vec::new());
        for _ in 0..rounds {
            let t = Instant::now();
            std::hint::black_box(GreedyPlanner::default().plan(&p, &ctx)?);
            tn.push(t.elapsed());
            let t = Instant::now();
            std::hint::black_box(wasm.plan(&p, &ctx)?);
            tw.push(t.elapsed());
        }
        let (a, b) = (median(tn), median(tw));
        println!(
            "{shape:>9} {:>9} {:>9.2} ms {:>9.2} ms {:>6.2}× {:>9.2} ms  {:.2} GiB",
            p.requests.len(),
            a.as_secs_f64() * 1e3,
            b.as_secs_f64() * 1e3,
            b.as_secs_f64() / a.as_secs_f64(),
            // The engine's default planning deadline for a profile this long.
            1.0 + 0.025 * p.requests.len() as f64,
            native_plan.arena_bytes as f64 / GIB as f64
        );
    }
    Ok(())
}
