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
//!
//! With `--trace T…`: the profiles the engine itself asks its planner for
//! when it replays each trace under `planned` (the built-in planner,
//! recorded), each planned again ROUNDS times natively and by the
//! component: per trace, the profiles (plain and of two steps), the
//! largest, and the median and the most of their planning times.
//!
//! ```sh
//! cargo run --release -p wasmem --example planner_speed -- 3 --trace ../shared/traces/gpt2_124m.jsonl.gz
//! ```

use std::time::{Duration, Instant};

use std::sync::{Arc, Mutex};

use wasmem::alloc::Allocator;
use wasmem::builtin::GreedyPlanner;
use wasmem::decision::{AliasedPlan, Plan, PlanRequest, PlannerPolicy, PolicyContext, PolicyError, StepProfile};
use wasmem::device::sim::SimDevice;
use wasmem::policy::{CacheDir, Limits, Runtime, RuntimeConfig};
use wasmem::replay::{replay_with, ReplayConfig};
use wasmem::types::{StreamId, TensorKind, GIB};
use wasmem::workload::{Source, Workload};

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

/// A profile the engine asked for: plain, or of two steps (aliased).
type Asked = (StepProfile, bool);

/// The built-in planner, keeping every profile it is asked to plan.
struct Recorder {
    inner: GreedyPlanner,
    asked: Arc<Mutex<Vec<Asked>>>,
}

impl PlannerPolicy for Recorder {
    fn name(&self) -> &str {
        "recorder"
    }
    fn plan(&mut self, profile: &StepProfile, ctx: &PolicyContext) -> Result<Plan, PolicyError> {
        self.asked.lock().expect("not poisoned").push((profile.clone(), false));
        self.inner.plan(profile, ctx)
    }
    fn plan_aliased(&mut self, profile: &StepProfile, ctx: &PolicyContext) -> Result<Option<AliasedPlan>, PolicyError> {
        self.asked.lock().expect("not poisoned").push((profile.clone(), true));
        self.inner.plan_aliased(profile, ctx)
    }
}

/// The profiles `planned` asks its planner for when it replays `trace`.
fn profiles_of(trace: &str) -> anyhow::Result<Vec<Asked>> {
    let w = Workload::open(&Source::File(trace.into()))?;
    let cfg = ReplayConfig::default();
    let mut alloc = Allocator::with_builtin(SimDevice::new(cfg.device), "planned")
        .ok_or_else(|| anyhow::anyhow!("no built-in `planned`"))?;
    let asked = Arc::new(Mutex::new(Vec::new()));
    alloc.set_planner(Some(Box::new(Recorder { inner: GreedyPlanner::default(), asked: asked.clone() })));
    replay_with(w.events()?, alloc, &cfg, |_| {})?;
    let out = std::mem::take(&mut *asked.lock().expect("not poisoned"));
    Ok(out)
}

/// Plans the profiles each of `traces` asks for, `rounds` times each, natively
/// and by `wasm`, and prints a row per trace.
fn traces(traces: &[String], rounds: usize, wasm: &mut dyn PlannerPolicy, ctx: &PolicyContext) -> anyhow::Result<()> {
    println!(
        "{:>24} {:>8} {:>8} {:>21} {:>21}",
        "trace", "profiles", "largest", "native median / most", "wasm median / most"
    );
    for t in traces {
        let asked = profiles_of(t)?;
        let (mut tn, mut tw) = (Vec::new(), Vec::new());
        for (p, aliased) in &asked {
            // One plan of `p` by `planner`, timed.
            let time = |planner: &mut dyn PlannerPolicy| -> anyhow::Result<Duration> {
                let t0 = Instant::now();
                if *aliased {
                    std::hint::black_box(planner.plan_aliased(p, ctx)?);
                } else {
                    std::hint::black_box(planner.plan(p, ctx)?);
                }
                Ok(t0.elapsed())
            };
            let (mut n, mut w) = (Vec::new(), Vec::new());
            for _ in 0..rounds {
                n.push(time(&mut GreedyPlanner::default())?);
                w.push(time(&mut *wasm)?);
            }
            tn.push(median(n));
            tw.push(median(w));
        }
        let name = std::path::Path::new(t).file_name().map_or(t.clone(), |f| f.to_string_lossy().into_owned());
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let most = |v: &[Duration]| v.iter().max().copied().unwrap_or_default();
        let largest = asked.iter().map(|(p, _)| p.requests.len()).max().unwrap_or(0);
        let aliased = asked.iter().filter(|(_, a)| *a).count();
        println!(
            "{name:>24} {:>4} ({aliased}) {largest:>8} {:>9.2} / {:>6.2} ms {:>9.2} / {:>6.2} ms",
            asked.len(),
            if tn.is_empty() { 0.0 } else { ms(median(tn.clone())) },
            ms(most(&tn)),
            if tw.is_empty() { 0.0 } else { ms(median(tw.clone())) },
            ms(most(&tw)),
        );
    }
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (args, trace_args) = match args.iter().position(|a| a == "--trace") {
        Some(i) => (args[..i].to_vec(), args[i + 1..].to_vec()),
        None => (args, Vec::new()),
    };
    let rounds: usize = args.first().map(|a| a.parse()).transpose()?.unwrap_or(3).max(1);
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
    if !trace_args.is_empty() {
        return traces(&trace_args, rounds, &mut wasm, &ctx);
    }
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
