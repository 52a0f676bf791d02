//! Replay speed of a synthesized workload, for profiling:
//! `cargo run --release --example replay_speed -- pytorch 20`.
use wasmem::builtin;
use wasmem::model::ModelSpec;
use wasmem::replay::{replay, ReplayConfig};
use wasmem::synth::synth;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let policy = args.get(1).map_or("pytorch", |s| s.as_str());
    let rounds: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(20);
    let spec = ModelSpec { steps: 4, ..ModelSpec::preset("gpt2-124m").expect("preset") };
    let ev = synth(&spec).expect("valid");
    let t = std::time::Instant::now();
    for _ in 0..rounds {
        let r = replay(
            ev.iter().cloned().map(Ok::<_, String>),
            builtin::by_name(policy).expect("policy"),
            &ReplayConfig::default(),
        )
        .expect("replay");
        std::hint::black_box(r.metrics.peak_reserved_bytes);
    }
    let n = (ev.len() * rounds) as f64;
    println!("{policy}: {:.2} M events/s", n / t.elapsed().as_secs_f64() / 1e6);
}
