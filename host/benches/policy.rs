//! Per-decision cost at the policy boundary, run in one process:
//!
//! - `native`: the built-in `PytorchPlacement` through the trait (baseline);
//! - `wasm`: the `pytorch-like` Rust component through `WasmPlacement`
//!   (deadline armed, context for the host imports, lift/lower);
//! - `memo_hit`: an allocator alloc+free whose placement is a memoized WASM
//!   decision, against the same pair with the native policy.
//!
//! Also times loading (compile vs artifact cache), instantiation, and a hot
//! swap with a precompiled artifact. Goals: ≤ 1 µs median per WASM decision,
//! ≤ 5 ms per swap. The guest is built from `policies/` if needed.

use std::hint::black_box;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion};
use wasmem::alloc::swap::SwapOptions;
use wasmem::alloc::Allocator;
use wasmem::alloc::SharedAllocator;
use wasmem::builtin::{self, LruEviction, PytorchPlacement};
use wasmem::decision::Policies;
use wasmem::decision::{AllocRequest, PlacementPolicy, PolicyContext, Role};
use wasmem::device::sim::SimDevice;
use wasmem::policy::{CacheDir, Limits, Runtime, RuntimeConfig};
use wasmem::types::{StreamId, TensorKind, GIB};

fn guest() -> Option<PathBuf> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../policies");
    let wasm = dir.join("target/wasm32-wasip2/release/pytorch_like.wasm");
    if !wasm.is_file() {
        let ok = Command::new("cargo")
            .current_dir(&dir)
            .env("CARGO_TARGET_DIR", dir.join("target"))
            .args(["build", "--release", "--target", "wasm32-wasip2", "-p", "pytorch-like", "--quiet"])
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            eprintln!("SKIP: cannot build policies/rust/pytorch-like for wasm32-wasip2");
            return None;
        }
    }
    Some(wasm)
}

/// A runtime whose deadline (1 s) a preempted call on a loaded machine
/// cannot miss; arming it costs the same as arming the default 1 ms.
fn runtime(cache: CacheDir) -> Runtime {
    let limits = Limits { deadline: Some(Duration::from_secs(1)), ..Limits::default() };
    Runtime::new(RuntimeConfig { cache, limits, ..Default::default() }).expect("runtime")
}

fn decisions(c: &mut Criterion) {
    let Some(path) = guest() else { return };
    let rt = runtime(CacheDir::Off);
    let p = rt.load(&path).unwrap().instantiate("").unwrap();
    let mut wasm = p.placement().unwrap();
    let mut native = PytorchPlacement;
    let req = AllocRequest { bytes: 3 << 20, kind: TensorKind::Activation, stream: StreamId(0) };
    let ctx = PolicyContext { clock: 7, capacity_bytes: 80 * GIB, ..Default::default() };
    let mut g = c.benchmark_group("placement_decision");
    g.bench_function("native", |b| b.iter(|| native.place(black_box(&req), black_box(&ctx)).unwrap()));
    g.bench_function("wasm", |b| b.iter(|| wasm.place(black_box(&req), black_box(&ctx)).unwrap()));
    g.finish();

    // Memo hits: a cached-size alloc+free pair, native vs WASM placement.
    let mut g = c.benchmark_group("alloc_free_pair_4KiB");
    let policies = Policies {
        placement: Box::new(p.placement().unwrap()),
        reclamation: Box::new(p.reclamation().unwrap()),
        eviction: Box::new(LruEviction),
    };
    for (label, policies) in [("native", builtin::default_policies()), ("wasm_memo_hit", policies)] {
        let mut a = Allocator::new(SimDevice::with_capacity(80 * GIB), policies);
        let warm = a.alloc(4096, TensorKind::Temp, StreamId(0)).unwrap();
        a.free(warm).unwrap();
        let calls = a.policies().health(Role::Placement).calls;
        g.bench_function(label, |b| {
            b.iter(|| {
                let id = a.alloc(black_box(4096), TensorKind::Temp, StreamId(0)).unwrap();
                a.free(black_box(id)).unwrap();
            })
        });
        if label == "wasm_memo_hit" {
            assert_eq!(a.policies().health(Role::Placement).calls, calls, "memo hits must not call the policy");
        }
    }
    g.finish();
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// Load, instantiate and swap times (printed; criterion is not needed for
/// millisecond-scale one-shot costs).
fn lifecycle(_c: &mut Criterion) {
    let Some(path) = guest() else { return };
    let dir = std::env::temp_dir().join(format!("wasmem-bench-cache-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let uncached = runtime(CacheDir::Off);
    let compile = median((0..5).map(|_| uncached.load(&path).unwrap().load_time()).collect());
    let rt = runtime(CacheDir::At(dir.clone()));
    rt.load(&path).unwrap();
    let cached = median((0..20).map(|_| rt.load(&path).unwrap().load_time()).collect());
    let loaded = rt.load(&path).unwrap();
    let inst = median(
        (0..50)
            .map(|_| {
                let t = Instant::now();
                black_box(loaded.instantiate("").unwrap());
                t.elapsed()
            })
            .collect(),
    );
    let shared = SharedAllocator::new(Allocator::new(SimDevice::with_capacity(80 * GIB), builtin::default_policies()));
    let mut swap_total = Vec::new();
    let mut swap_locked = Vec::new();
    for _ in 0..50 {
        let t = Instant::now();
        let p = rt.load(&path).unwrap().instantiate("").unwrap();
        let (_, held) = shared.swap(p.resolved(), &SwapOptions::default()).unwrap();
        swap_total.push(t.elapsed());
        swap_locked.push(held);
        shared.alloc(4096, TensorKind::Temp, StreamId(0)).unwrap();
    }
    println!("policy/load_compile          median {:?}", compile);
    println!("policy/load_cached           median {:?}", cached);
    println!("policy/instantiate+init      median {:?}", inst);
    println!("policy/swap (load cached + instantiate + swap) median {:?}", median(swap_total));
    println!("policy/swap lock held        median {:?}", median(swap_locked));
    let _ = std::fs::remove_dir_all(&dir);
}

criterion_group!(benches, decisions, lifecycle);
criterion_main!(benches);
