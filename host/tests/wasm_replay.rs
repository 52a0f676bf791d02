//! Replays workloads with every shipped WebAssembly policy (Rust, Python,
//! JavaScript): invariants hold, two runs give identical metrics, and the WASM
//! `pytorch-like` gives exactly the native `pytorch` metrics. Shipped policies
//! are built by `policies/build.sh` (the test command runs it first); a
//! missing one is reported and skipped.
#![cfg(feature = "wasm")]

use std::path::PathBuf;
use std::time::Duration;

use wasmem::builtin;
use wasmem::model::ModelSpec;
use wasmem::policy::{resolve_with, shipped_candidates, Limits, Runtime, RuntimeConfig};
use wasmem::replay::{replay, Metrics, ReplayConfig};
use wasmem::synth::synth;
use wasmem::trace::{Event, TraceReader};

/// Shipped policies and a spec that uses them (eviction-only and
/// reclamation-only ones are combined with built-in placement).
const SHIPPED: [(&str, &str); 7] = [
    ("pytorch-like", "pytorch-like"),
    ("lifecycle", "policies/out/lifecycle.wasm"),
    ("watermark-reclaim", "watermark-reclaim+lifecycle"),
    ("defrag-reclaim", "pytorch-like+defrag-reclaim"),
    ("lru-evict", "lru-evict+pytorch"),
    ("size-class", "size-class"),
    ("dtr-evict", "dtr-evict+lifecycle"),
];

fn runtime() -> Runtime {
    // A generous deadline: this test asserts determinism, which a deadline
    // tripped by a loaded machine would break.
    Runtime::new(RuntimeConfig {
        limits: Limits { deadline: Some(Duration::from_secs(2)), ..Limits::default() },
        ..RuntimeConfig::default()
    })
    .expect("runtime")
}

fn workloads() -> Vec<(String, Vec<Event>)> {
    let spec = ModelSpec { steps: 2, ..ModelSpec::preset("gpt2-124m").expect("preset") };
    let mut v = vec![("synth:gpt2-124m".to_string(), synth(&spec).expect("valid"))];
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/traces");
    for name in ["gpt2_124m.jsonl.gz", "bert_base.jsonl.gz"] {
        let p = dir.join(name);
        if p.exists() {
            let ev = TraceReader::open(&p).expect("trace").collect::<Result<Vec<_>, _>>().expect("valid trace");
            v.push((name.to_string(), ev));
        } else {
            eprintln!("skipping {}: not found", p.display());
        }
    }
    v
}

fn run(rt: &Runtime, spec: &str, events: &[Event]) -> Metrics {
    let spec = spec.replace("policies/out/", &format!("{}/../policies/out/", env!("CARGO_MANIFEST_DIR")));
    let p = resolve_with(rt, &spec).unwrap_or_else(|e| panic!("{spec}: {e}")).policies;
    let r = replay(events.iter().cloned().map(Ok::<_, String>), p, &ReplayConfig::default()).expect("replay");
    r.allocator.check_invariants().unwrap_or_else(|e| panic!("{spec}: {e}"));
    let mut m = r.metrics;
    m.clear_timing();
    m
}

fn built(name: &str) -> bool {
    let ok = shipped_candidates(name).iter().any(|p| p.is_file());
    if !ok {
        eprintln!("SKIP {name}: not built (run policies/build.sh)");
    }
    ok
}

#[test]
fn shipped_policies_replay_deterministically() {
    let rt = runtime();
    for (name, events) in workloads() {
        for (policy, spec) in SHIPPED {
            if !built(policy) {
                continue;
            }
            let a = run(&rt, spec, &events);
            let b = run(&rt, spec, &events);
            assert_eq!(a, b, "{policy} on {name}: two runs differ");
            assert_eq!(a.ooms, 0, "{policy} on {name}");
            assert_eq!((a.policy_traps, a.policy_fallbacks), (0, 0), "{policy} on {name}");
            eprintln!(
                "{name} {policy:>18}: overhead {:.4}, {} policy calls, {} memo hits",
                a.overhead_ratio, a.policy_calls, a.policy_memo_hits
            );
        }
    }
}

#[test]
fn wasm_pytorch_like_equals_native_pytorch() {
    if !built("pytorch-like") {
        return;
    }
    let rt = runtime();
    for (name, events) in workloads() {
        let wasm = run(&rt, "pytorch-like", &events);
        let p = builtin::by_name("pytorch").expect("built-in");
        let mut native =
            replay(events.iter().cloned().map(Ok::<_, String>), p, &ReplayConfig::default()).expect("replay").metrics;
        native.clear_timing();
        // Only the policy-boundary counters differ: the WASM policy is memoized.
        let mut w = wasm.clone();
        w.policy_calls = native.policy_calls;
        w.policy_memo_hits = native.policy_memo_hits;
        assert_eq!(w, native, "{name}: WASM pytorch-like and native pytorch differ");
        assert!(wasm.policy_memo_hits > 0);
    }
}

#[test]
fn lifecycle_wasm_equals_native_lifecycle() {
    if !built("lifecycle") {
        return;
    }
    let rt = runtime();
    for (name, events) in workloads() {
        let wasm = run(&rt, "policies/out/lifecycle.wasm", &events);
        let native = run(&rt, "lifecycle", &events);
        assert_eq!(
            (wasm.peak_reserved_bytes, wasm.peak_allocated_bytes, wasm.device_alloc_calls, wasm.device_free_calls),
            (
                native.peak_reserved_bytes,
                native.peak_allocated_bytes,
                native.device_alloc_calls,
                native.device_free_calls
            ),
            "{name}"
        );
    }
}
