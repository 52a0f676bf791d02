//! Replay throughput on in-memory events (no parsing), per policy, against
//! `naive` in the same process. Goal: ≥ 10 million events/s with `pytorch`.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use wasmem::builtin;
use wasmem::model::ModelSpec;
use wasmem::replay::{replay, ReplayConfig};
use wasmem::synth::synth;
use wasmem::trace::Event;

fn events() -> Vec<Event> {
    let spec = ModelSpec { steps: 2, ..ModelSpec::preset("gpt2-124m").expect("preset") };
    synth(&spec).expect("valid preset")
}

fn throughput(c: &mut Criterion) {
    let ev = events();
    let mut g = c.benchmark_group("replay");
    g.throughput(Throughput::Elements(ev.len() as u64));
    for policy in ["pytorch", "lifecycle", "naive"] {
        g.bench_function(policy, |b| {
            b.iter(|| {
                let r = replay(
                    ev.iter().cloned().map(Ok::<_, String>),
                    builtin::by_name(policy).expect("built-in"),
                    &ReplayConfig::default(),
                )
                .expect("replay");
                r.metrics.peak_reserved_bytes
            })
        });
    }
    g.finish();
}

criterion_group!(benches, throughput);
criterion_main!(benches);
