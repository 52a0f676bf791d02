//! Replay speed of a synthesized workload, for profiling:
//! `cargo run --release --example replay_speed -- POLICY ROUNDS STEPS [warm]`
//! (default `pytorch 20 4`): the events are in memory, so this is the
//! allocator's and the driver's speed, without reading a trace. `warm`
//! (a policy with a planner): a first, unmeasured run fills a plan cache,
//! and every measured run starts from it (reading it included). STEPS may
//! instead name a trace file (our format, or a PyTorch snapshot `.pickle`),
//! read once before the rounds.
use wasmem::alloc::Allocator;
use wasmem::device::sim::SimDevice;
use wasmem::model::ModelSpec;
use wasmem::replay::{replay_with, ReplayConfig};
use wasmem::synth::synth;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let policy = args.get(1).map_or("pytorch", |s| s.as_str());
    let rounds: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(20);
    let what = args.get(3).map_or("4", |s| s.as_str());
    let warm = args.get(4).is_some_and(|s| s == "warm");
    let ev = match what.parse::<u64>() {
        Ok(steps) => synth(&ModelSpec { steps, ..ModelSpec::preset("gpt2-124m").expect("preset") }).expect("valid"),
        Err(_) if what.ends_with(".pickle") => {
            let opts = wasmem::trace::snapshot::ImportOptions::default();
            wasmem::trace::snapshot::import_file(what, &opts).unwrap_or_else(|e| panic!("{e}")).events
        }
        Err(_) => wasmem::trace::read_file(what).unwrap_or_else(|e| panic!("{what}: {e}")).1,
    };
    let dir = tempfile::tempdir().expect("a temporary directory");
    let cache = dir.path().join("plans.json");
    let run = |measured: bool| {
        let cfg = ReplayConfig::default();
        let mut alloc = Allocator::with_builtin(SimDevice::new(cfg.device), policy).expect("a built-in policy");
        if warm {
            let n = alloc.use_plan_cache(&cache).expect("a planner and a plan cache");
            assert!(!measured || n > 0, "the cache was not filled");
        }
        let r = replay_with(ev.iter().cloned().map(Ok::<_, String>), alloc, &cfg, |_| {}).expect("replay");
        std::hint::black_box(r.metrics.peak_reserved_bytes);
    };
    if warm {
        run(false);
    }
    let t = std::time::Instant::now();
    for _ in 0..rounds {
        run(true);
    }
    let n = (ev.len() * rounds) as f64;
    let how = if warm { " (warm plan cache)" } else { "" };
    println!("{policy}{how}: {:.2} M events/s", n / t.elapsed().as_secs_f64() / 1e6);
}
