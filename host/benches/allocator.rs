//! Hot path of the allocator: alloc + free of a cached size, per policy.
//!
//! `naive` (a device call per alloc and per free) is the baseline run in the
//! same process; the caching policies should be far below it. Goal: ≤ 100 ns
//! median per pair for the native `pytorch` policy.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion};
use wasmem::alloc::Allocator;
use wasmem::device::sim::SimDevice;
use wasmem::types::{StreamId, TensorKind, GIB, MIB};

fn pair(c: &mut Criterion) {
    let mut g = c.benchmark_group("alloc_free_pair");
    for policy in ["pytorch", "lifecycle", "naive"] {
        for (label, bytes) in [("4KiB", 4096u64), ("8MiB", 8 * MIB)] {
            let mut a = Allocator::with_builtin(SimDevice::with_capacity(80 * GIB), policy).unwrap();
            // Background population so the pools are not trivially empty.
            let keep: Vec<_> =
                (0..256u64).map(|i| a.alloc(512 + i * 4096, TensorKind::Activation, StreamId(0)).unwrap()).collect();
            let warm = a.alloc(bytes, TensorKind::Temp, StreamId(0)).unwrap();
            a.free(warm).unwrap();
            g.bench_function(format!("{policy}/{label}"), |b| {
                b.iter(|| {
                    let id = a.alloc(black_box(bytes), TensorKind::Temp, StreamId(0)).unwrap();
                    a.free(black_box(id)).unwrap();
                })
            });
            black_box(keep);
        }
    }
    g.finish();
}

criterion_group!(benches, pair);
criterion_main!(benches);
