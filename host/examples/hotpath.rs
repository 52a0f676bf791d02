//! Runs N alloc+free pairs of a cached size (for instruction-count profiling:
//! `valgrind --tool=callgrind target/release/examples/hotpath pytorch 4096 1000000`).
use std::hint::black_box;

use wasmem::alloc::Allocator;
use wasmem::device::sim::SimDevice;
use wasmem::types::{StreamId, TensorKind, GIB};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let policy = args.get(1).map_or("pytorch", |s| s.as_str());
    let bytes: u64 = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(4096);
    let n: u64 = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(1_000_000);
    let mut a = Allocator::with_builtin(SimDevice::with_capacity(80 * GIB), policy).expect("known policy");
    let keep: Vec<_> =
        (0..256u64).map(|i| a.alloc(512 + i * 4096, TensorKind::Activation, StreamId(0)).expect("fits")).collect();
    let t = std::time::Instant::now();
    for _ in 0..n {
        let id = a.alloc(black_box(bytes), TensorKind::Temp, StreamId(0)).expect("fits");
        a.free(black_box(id)).expect("live");
    }
    let el = t.elapsed();
    println!("{policy} {bytes} B: {:.1} ns per pair ({} live kept)", el.as_nanos() as f64 / n as f64, keep.len());
}
