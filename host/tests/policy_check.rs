//! `policy::check`: shipped policies pass; hostile ones fail with the reason.
#![cfg(feature = "wasm")]

mod common;

use std::time::Duration;

use wasmem::policy::check::{check_trace, check_with, runtime_with_deadline, CheckOptions, Outcome, TraceOptions};
use wasmem::policy::{Runtime, WitVersion, SHIPPED_NAMES};

fn opts(config: &str) -> CheckOptions {
    CheckOptions { cases: 500, config: config.to_string(), ..CheckOptions::default() }
}

#[test]
fn shipped_rust_policies_pass() {
    let rt = common::relaxed_runtime();
    for name in ["pytorch-like", "lru-evict", "watermark-reclaim", "lifecycle", "defrag-reclaim", "greedy-planner"] {
        let path = need!(common::rust_policy(name));
        let v = check_with(&rt, &path, &opts(""));
        println!("{v}");
        assert!(v.passed(), "{v}");
        assert_eq!(v.policy, name);
        assert_eq!(v.wit_version, Some(WitVersion::V0_4), "{v}");
        assert!(v.to_string().contains("(wasmem:policy@0.4.0)"), "{v}");
        assert_eq!(v.planner, name == "greedy-planner", "{v}");
    }
}

#[test]
fn components_of_wit_0_1_0_pass_and_report_their_version() {
    let rt = common::relaxed_runtime();
    for name in ["pytorch-like", "lru-evict", "watermark-reclaim", "lifecycle"] {
        let path = common::repo().join("tests/data/wit-0.1.0").join(format!("{name}.wasm"));
        let v = check_with(&rt, &path, &opts(""));
        assert!(v.passed(), "{v}");
        assert_eq!(v.wit_version, Some(WitVersion::V0_1), "{v}");
        let text = v.to_string();
        assert!(
            text.contains("(wasmem:policy@0.1.0)") && text.contains("load (exports, WIT version, imports)"),
            "{text}"
        );
    }
}

#[test]
fn defrag_reclaim_check_counts_the_mechanisms() {
    let rt = common::relaxed_runtime();
    let path = need!(common::rust_policy("defrag-reclaim"));
    let v = check_with(&rt, &path, &opts("frag=0.1 compact_fraction=0.05"));
    assert!(v.passed(), "{v}");
    let item = v.items.iter().find(|i| i.name == "reclamation: valid decisions within limits").unwrap();
    // The fuzzed triggers are a third each grow, alloc-failed and phase
    // markers: stitching on the first two, compaction at some markers.
    assert!(item.detail.contains("paged segments: yes"), "{v}");
    assert!(!item.detail.contains("(0 compact") && !item.detail.contains(", 0 stitch"), "{v}");
    let v = check_with(&rt, &path, &opts("paged=false"));
    assert!(v.passed() && v.to_string().contains("paged segments: no"), "{v}");
}

#[test]
fn default_check_passes_pytorch_like() {
    let path = need!(common::rust_policy("pytorch-like"));
    let v = wasmem::policy::check(&path);
    common::assert_conformant(&v);
    assert!(v.to_string().contains("pytorch-like"));
}

/// Every shipped component in `policies/out` (skipped when not built) passes
/// the check at the default limits, and the report gives per-role calls and
/// their p50/p99.
#[test]
fn every_shipped_component_passes_at_the_defaults() {
    let rt = Runtime::global().unwrap();
    let mut checked = 0;
    for name in SHIPPED_NAMES {
        let path = common::repo().join("policies/out").join(format!("{name}.wasm"));
        if !path.is_file() {
            eprintln!("SKIP {name}: {} not built (policies/build.sh)", path.display());
            continue;
        }
        let v = check_with(rt, &path, &CheckOptions::default());
        println!("{v}");
        common::assert_conformant(&v);
        assert_eq!(v.policy, name);
        let cost = v.items.iter().find(|i| i.name.starts_with("cost:")).unwrap_or_else(|| panic!("{v}"));
        for role in &v.roles {
            let c = v.costs.iter().find(|c| c.role == *role).unwrap_or_else(|| panic!("no cost for {role}: {v}"));
            assert_eq!(c.calls, if *role == wasmem::decision::Role::Eviction { 500 } else { 2000 }, "{v}");
            assert!(cost.detail.contains(&format!("{role} {} calls p50 ", c.calls)), "{v}");
        }
        checked += 1;
    }
    eprintln!("{checked} shipped components checked");
}

/// A policy whose decisions depend on something its saved state leaves out
/// is caught by the state continuation check, which names the call, its
/// inputs and both instances.
#[test]
fn a_divergent_policy_is_reported_with_the_call_named() {
    let rt = common::relaxed_runtime();
    let path = need!(common::hostile());
    let v = check_with(&rt, &path, &opts("mode=diverge"));
    assert!(!v.passed(), "{v}");
    let item = v.item("state: a restored instance continues like the original").unwrap_or_else(|| panic!("{v}"));
    assert_eq!(item.outcome, Outcome::Fail, "{v}");
    // Halfway through 500 placements + 500 reclamations + 125 evictions: reclamation call 62.
    assert!(item.detail.starts_with("reclamation call 62 ("), "{v}");
    assert!(item.detail.contains("clock ") && item.detail.contains("reserved "), "inputs named: {v}");
    assert!(item.detail.contains("instance A answered ReclaimDecision"), "{v}");
    assert!(item.detail.contains("instance C (fresh, loaded with A's 8-byte state after"), "{v}");
    // Two fresh instances still agree with each other.
    assert_eq!(v.item("determinism: same inputs, same outputs").unwrap().outcome, Outcome::Pass, "{v}");
}

/// `--trace`: the checks on the calls of a replay of a trace under memory
/// pressure (a synthesized one, written to a file), eviction candidates
/// included.
#[test]
fn trace_check_runs_the_suite_on_a_replay() {
    let path = need!(common::rust_policy("lru-evict"));
    let events = wasmem::synth::synth(&wasmem::model::ModelSpec::preset("gpt2-124m").unwrap()).unwrap();
    let dir = common::cache_dir("check-trace");
    std::fs::create_dir_all(&dir).unwrap();
    let trace = dir.join("gpt2.jsonl");
    let header = wasmem::trace::TraceHeader { source: "policy_check test".into(), ranks: 1 };
    wasmem::trace::write_file(&trace, &header, &events).unwrap();
    let rt = common::relaxed_runtime();
    let v = check_trace(&rt, &path, &TraceOptions { trace: trace.clone(), device_mem: None, config: String::new() });
    println!("{v}");
    common::assert_conformant(&v);
    let replay = v.item("trace: replay").unwrap();
    assert!(!replay.detail.contains(" 0 evictions"), "the default device (60 % of peak live) evicts: {v}");
    assert!(v.item("eviction: valid victims within limits (trace)").is_some(), "{v}");
    assert!(v.item("determinism: same inputs, same outputs").unwrap().detail.contains("two replays"), "{v}");
    // A missing trace is a failed item naming the file, not a panic.
    let v = check_trace(
        &rt,
        &path,
        &TraceOptions { trace: dir.join("absent.jsonl"), device_mem: None, config: String::new() },
    );
    assert!(!v.passed() && v.to_string().contains("absent.jsonl"), "{v}");
}

#[test]
fn hostile_modes_fail_with_reasons() {
    let rt = runtime_with_deadline(Duration::from_millis(20)).unwrap();
    let path = need!(common::hostile());
    assert!(check_with(&rt, &path, &opts("mode=ok")).passed());
    for (mode, check, reason) in [
        ("mode=loop", "placement: valid decisions within limits", "deadline exceeded"),
        ("mode=bad-pool", "placement: valid decisions within limits", "pool 7 does not exist"),
        ("mode=bad-victims", "eviction: valid victims within limits", "not offered"),
        ("mode=bad-reclaim", "reclamation: valid decisions within limits", "no-such-pool"),
        ("mode=bad-compact", "reclamation: valid decisions within limits", "compacts unknown pool `no-such-pool`"),
        ("mode=huge-compact", "reclamation: valid decisions within limits", "exceeds the"),
        ("mode=fickle", "placement: cacheable decisions agree per memo key", "earlier"),
        ("mode=bad-state", "state: save-state → load-state", "refuses a state"),
        ("mode=trap-nth n=100", "placement: valid decisions within limits", "traps on call 100"),
        ("mode=empty-pools", "instantiate + init", "empty"),
    ] {
        let v = check_with(&rt, &path, &CheckOptions { cases: 200, ..opts(mode) });
        assert!(!v.passed(), "{mode}: {v}");
        let item = v.items.iter().find(|i| i.name == check).unwrap_or_else(|| panic!("{mode}: no `{check}` in\n{v}"));
        assert_eq!(item.outcome, Outcome::Fail, "{mode}: {v}");
        assert!(item.detail.contains(reason), "{mode}: {v}");
    }
}

#[test]
fn a_planner_is_checked_on_fuzzed_profiles_and_hostile_plans_fail() {
    let rt = runtime_with_deadline(Duration::from_millis(20)).unwrap();
    let path = need!(common::hostile_planner());
    let v = check_with(&rt, &path, &opts("mode=ok"));
    println!("{v}");
    common::assert_conformant(&v);
    assert!(v.planner && v.roles.is_empty() && v.to_string().contains("roles: planner (wasmem:policy@0.4.0)"), "{v}");
    for item in [
        "planner: valid plans",
        "planner: determinism",
        "planner: a restored instance continues like the original",
        "planner: valid aliased plans",
        "planner: aliased determinism",
    ] {
        assert_eq!(v.item(item).map(|i| i.outcome), Some(Outcome::Pass), "{item}: {v}");
    }
    let c = v.planner_cost.as_ref().unwrap();
    assert_eq!(c.calls, opts("").profiles() as u64);
    assert!(c.largest >= 3000, "{c:?}");
    for (mode, reason) in [
        ("overlap", "share bytes"),
        ("outside", "leaves the arena"),
        ("unaligned", "not a multiple of 512"),
        ("wrong-length", "entries for"),
        ("too-large", "exceeds"),
        ("unknown-life", "no known end of life"),
        ("refuse", "hostile planner refuses a profile"),
        ("trap", "hostile planner traps"),
        ("deadline", "deadline exceeded"),
    ] {
        let v = check_with(&rt, &path, &opts(&format!("mode={mode}")));
        assert!(!v.passed(), "{mode}: {v}");
        let item = v.item("planner: valid plans").unwrap_or_else(|| panic!("{mode}: {v}"));
        assert_eq!(item.outcome, Outcome::Fail, "{mode}: {v}");
        assert!(item.detail.contains(reason) && item.detail.contains("planning call "), "{mode}: {v}");
    }
    // Aliased plans (WIT 0.4.0): the plain plans pass, the aliased ones fail.
    for (mode, reason) in [
        ("alias-overlap", "share bytes"),
        ("alias-zone", "zones at most half"),
        ("alias-outside", "leaves its window"),
        ("alias-refuse", "hostile planner refuses an aliased plan"),
        ("alias-trap", "hostile planner traps on an aliased plan"),
    ] {
        let v = check_with(&rt, &path, &opts(&format!("mode={mode}")));
        assert!(!v.passed(), "{mode}: {v}");
        assert_eq!(v.item("planner: valid plans").map(|i| i.outcome), Some(Outcome::Pass), "{mode}: {v}");
        let item = v.item("planner: valid aliased plans").unwrap_or_else(|| panic!("{mode}: {v}"));
        assert_eq!(item.outcome, Outcome::Fail, "{mode}: {v}");
        assert!(item.detail.contains(reason) && item.detail.contains("aliased call "), "{mode}: {v}");
    }
}

#[test]
fn a_planner_is_checked_on_the_profiles_of_a_trace() {
    let path = need!(common::rust_policy("greedy-planner"));
    let spec = wasmem::model::ModelSpec { steps: 3, ..wasmem::model::ModelSpec::preset("gpt2-124m").unwrap() };
    let events = wasmem::synth::synth(&spec).unwrap();
    let dir = common::cache_dir("check-trace-planner");
    std::fs::create_dir_all(&dir).unwrap();
    let trace = dir.join("gpt2.jsonl");
    let header = wasmem::trace::TraceHeader { source: "policy_check test".into(), ranks: 1 };
    wasmem::trace::write_file(&trace, &header, &events).unwrap();
    let rt = common::relaxed_runtime();
    let v = check_trace(&rt, &path, &TraceOptions { trace, device_mem: None, config: String::new() });
    println!("{v}");
    common::assert_conformant(&v);
    let item = v.item("planner: valid plans (trace)").unwrap_or_else(|| panic!("{v}"));
    assert_eq!(item.outcome, Outcome::Pass, "{v}");
    assert_eq!(v.item("planner: determinism (trace)").map(|i| i.outcome), Some(Outcome::Pass), "{v}");
    assert!(v.planner_cost.as_ref().is_some_and(|c| c.calls >= 1), "{v}");
}

#[test]
fn wrong_version_fails_at_load() {
    let dir = common::cache_dir("check-wat");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("future.wasm");
    std::fs::write(&path, common::wat("wrong-version")).unwrap();
    let v = wasmem::policy::check(&path);
    assert!(!v.passed());
    let text = v.to_string();
    assert!(text.contains("FAIL") && text.contains("wasmem:policy/placement@9.0.0"), "{text}");
}
