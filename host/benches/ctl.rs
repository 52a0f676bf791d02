//! Live control and shadow A/B costs, in one process:
//!
//! - `status`: a client connects, asks `status` of 4 ranks and reads the reply;
//! - `swap_builtin`: a placement swap between two built-in policies on 4 ranks
//!   (resolution, one lock per rank, the reply);
//! - `swap_wasm`: an eviction swap to the shipped `lru-evict` component on 4
//!   ranks (4 instantiations from the artifact cache), when it is built;
//! - `replay` vs `replay_with_shadow`: a synthesized GPT-2 workload replayed
//!   under `pytorch` alone and with a `lifecycle` shadow watching, beside
//!   `replay_of_the_shadow_policy` (`lifecycle` alone): the shadow's cost on
//!   the driving thread against that of a replay of its policy.

use std::hint::black_box;
use std::os::unix::fs::DirBuilderExt;
use std::path::PathBuf;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion};
use wasmem::alloc::Allocator;
use wasmem::alloc::SharedAllocator;
use wasmem::builtin;
use wasmem::ctl::{request, CtlServer, RankControl, Request, RoleArg, ServerOptions};
use wasmem::device::sim::{SimConfig, SimDevice};
use wasmem::model::ModelSpec;
use wasmem::policy::Runtime;
use wasmem::replay::{replay, ReplayConfig};
use wasmem::shadow::{Shadow, ShadowHandle};
use wasmem::synth::synth;
use wasmem::types::GIB;

fn control(c: &mut Criterion) {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("ctl-bench-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(&dir).expect("bench directory");
    let path = dir.join("b.sock");
    let ranks: Vec<_> = (0..4)
        .map(|_| {
            SharedAllocator::new(Allocator::new(
                SimDevice::with_capacity(80 * GIB),
                builtin::by_name("pytorch").unwrap(),
            ))
        })
        .collect();
    let rt = Runtime::global().expect("runtime").clone();
    let server =
        CtlServer::start(&path, RankControl::new(ranks, std::sync::Arc::new(rt)).into_arc(), ServerOptions::default())
            .unwrap();
    let t = Duration::from_secs(60);
    c.bench_function("ctl/status", |b| b.iter(|| black_box(request(&path, &Request::Status, t).unwrap())));
    let mut flip = false;
    c.bench_function("ctl/swap_builtin", |b| {
        b.iter(|| {
            flip = !flip;
            let policy = if flip { "naive" } else { "pytorch" }.to_string();
            black_box(request(&path, &Request::Swap { role: RoleArg::Placement, policy }, t).unwrap())
        })
    });
    if wasmem::policy::shipped_candidates("lru-evict").iter().any(|p| p.is_file()) {
        c.bench_function("ctl/swap_wasm", |b| {
            b.iter(|| {
                let req = Request::Swap { role: RoleArg::Eviction, policy: "lru-evict".into() };
                black_box(request(&path, &req, t).unwrap())
            })
        });
    } else {
        eprintln!("SKIP ctl/swap_wasm: lru-evict is not built (bash policies/build.sh)");
    }
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
}

fn shadow(c: &mut Criterion) {
    let events = synth(&ModelSpec::preset("gpt2-124m").unwrap()).unwrap();
    let cfg = ReplayConfig::default();
    let run = |with_shadow: bool| {
        let h = with_shadow.then(|| {
            ShadowHandle::new(Shadow::new("lifecycle", builtin::by_name("lifecycle").unwrap(), SimConfig::default()))
        });
        let mut tap = h.as_ref().map(ShadowHandle::tap);
        let fed = events.iter().map(|e| {
            if let Some(t) = tap.as_mut() {
                t(e);
            }
            Ok::<_, String>(*e)
        });
        black_box(replay(fed, builtin::by_name("pytorch").unwrap(), &cfg).unwrap().metrics.peak_reserved_bytes)
    };
    c.bench_function("shadow/replay", |b| b.iter(|| run(false)));
    c.bench_function("shadow/replay_of_the_shadow_policy", |b| {
        b.iter(|| {
            let fed = events.iter().map(|e| Ok::<_, String>(*e));
            black_box(replay(fed, builtin::by_name("lifecycle").unwrap(), &cfg).unwrap().metrics.peak_reserved_bytes)
        })
    });
    c.bench_function("shadow/replay_with_shadow", |b| b.iter(|| run(true)));
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20).measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    targets = control, shadow
}
criterion_main!(benches);
