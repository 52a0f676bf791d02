//! Shadow A/B: a shadow fed a run's events reports exactly what a replay of
//! those events with the shadow policy reports, and never changes the
//! primary run (library and `wasmem replay --shadow`).

use std::path::PathBuf;
#[cfg(feature = "wasm")]
use std::process::Command;

use wasmem::builtin;
use wasmem::device::sim::SimConfig;
use wasmem::model::ModelSpec;
use wasmem::replay::{replay, Metrics, ReplayConfig};
use wasmem::shadow::{Shadow, ShadowHandle};
use wasmem::synth::synth;
use wasmem::tier::TierConfig;
use wasmem::trace::Event;
use wasmem::types::GIB;

fn untimed(mut m: Metrics) -> Metrics {
    m.clear_timing();
    m
}

fn synth_events(preset: &str) -> Vec<Event> {
    synth(&ModelSpec::preset(preset).unwrap()).unwrap()
}

/// Shared sample traces, when the folder exists (a message otherwise).
fn shared_traces() -> Vec<PathBuf> {
    let d = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/traces");
    let Ok(rd) = std::fs::read_dir(&d) else {
        eprintln!("skipping the shared traces: {} not found", d.display());
        return vec![];
    };
    let mut v: Vec<PathBuf> =
        rd.filter_map(|e| e.ok().map(|e| e.path())).filter(|p| p.to_string_lossy().ends_with(".jsonl.gz")).collect();
    v.sort();
    v
}

/// Replays `events` with `primary` while a shadow with `shadow` watches;
/// returns (primary metrics, shadow metrics, shadow errors).
fn with_shadow(events: &[Event], primary: &str, shadow: &str, cfg: &ReplayConfig) -> (Metrics, Metrics, u64) {
    let mut s = Shadow::new(shadow, builtin::by_name(shadow).unwrap(), cfg.device);
    if let Some(t) = &cfg.tiers {
        s = s.with_tiers(t.clone());
    }
    let h = ShadowHandle::new(s);
    let mut tap = h.tap();
    let fed = events.iter().map(|e| {
        tap(e);
        Ok::<_, String>(*e)
    });
    let p = replay(fed, builtin::by_name(primary).unwrap(), cfg).unwrap();
    h.with(|s| s.allocator().check_invariants()).unwrap();
    (p.metrics, h.metrics(), h.with(|s| s.errors()))
}

fn alone(events: &[Event], policy: &str, cfg: &ReplayConfig) -> Metrics {
    replay(events.iter().map(|e| Ok::<_, String>(*e)), builtin::by_name(policy).unwrap(), cfg).unwrap().metrics
}

fn config(capacity: u64, tiers: bool) -> ReplayConfig {
    ReplayConfig {
        device: SimConfig { capacity, ..SimConfig::default() },
        tiers: tiers.then(TierConfig::default),
        ..ReplayConfig::default()
    }
}

#[test]
fn shadow_equals_a_standalone_replay_and_leaves_the_primary_alone() {
    let mut workloads: Vec<(String, Vec<Event>)> =
        ["gpt2-124m", "bert-base"].iter().map(|p| (format!("synth:{p}"), synth_events(p))).collect();
    for t in shared_traces() {
        let (_, ev) = wasmem::trace::read_file(&t).unwrap();
        workloads.push((t.display().to_string(), ev));
    }
    let pairs = [("pytorch", "lifecycle"), ("lifecycle", "naive"), ("naive", "pytorch")];
    for (name, events) in &workloads {
        // 80 GiB: everything fits; 9 GiB: every policy runs out of memory,
        // or with tiers evicts to the host instead.
        for cfg in [config(80 * GIB, false), config(9 * GIB, false), config(9 * GIB, true)] {
            for (p, q) in pairs {
                let (pm, sm, errors) = with_shadow(events, p, q, &cfg);
                let what = format!("{name} at {} B, tiers {}", cfg.device.capacity, cfg.tiers.is_some());
                assert_eq!(errors, 0, "{what}");
                assert_eq!(untimed(sm.clone()), untimed(alone(events, q, &cfg)), "{what}: shadow {q} ≠ replay {q}");
                assert_eq!(untimed(pm), untimed(alone(events, p, &cfg)), "{what}: {p} changed by a shadow");
                if cfg.device.capacity < 10 * GIB {
                    assert!(if cfg.tiers.is_some() { sm.evicted_bytes > 0 } else { sm.ooms > 0 }, "{what}: {sm:?}");
                }
            }
        }
    }
}

#[test]
fn a_failing_shadow_never_reaches_the_primary() {
    let events = synth_events("gpt2-124m");
    // The shadow is fed the run's events plus garbage, on a device far too
    // small: it runs out of memory and counts errors; the primary does not notice.
    let cfg = ReplayConfig::default();
    let tiny = SimConfig { capacity: GIB, ..SimConfig::default() };
    let h = ShadowHandle::new(Shadow::new("pytorch", builtin::by_name("pytorch").unwrap(), tiny));
    let mut tap = h.tap();
    let fed = events.iter().map(|e| {
        tap(&Event::Free { id: u64::MAX, t_us: None });
        tap(e);
        Ok::<_, String>(*e)
    });
    let p = replay(fed, builtin::by_name("lifecycle").unwrap(), &cfg).unwrap();
    assert_eq!(untimed(p.metrics), untimed(alone(&events, "lifecycle", &cfg)));
    let (sm, errors) = (h.metrics(), h.with(|s| s.errors()));
    assert_eq!(errors, events.len() as u64);
    assert!(sm.ooms > 0, "{sm:?}");
    assert_eq!(sm.device_capacity_bytes, GIB);
}

#[cfg(feature = "wasm")]
fn wasmem(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_wasmem")).args(args).output().expect("run wasmem");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[cfg(feature = "wasm")]
fn json(stdout: &str) -> serde_json::Value {
    serde_json::from_str(stdout.trim()).expect("one JSON object")
}

#[cfg(feature = "wasm")]
/// A metrics object without timing and labels.
fn core(v: &serde_json::Value) -> serde_json::Value {
    let mut v = v.clone();
    let o = v.as_object_mut().unwrap();
    for k in [
        "wall_seconds",
        "events_per_second",
        "policy_call_p50_ns",
        "policy_call_p99_ns",
        "policy",
        "trace",
        "shadow",
        "errors",
    ] {
        o.remove(k);
    }
    v
}

#[cfg(feature = "wasm")]
fn shipped(name: &str) -> bool {
    let found = wasmem::policy::shipped_candidates(name).iter().any(|p| p.is_file());
    if !found {
        eprintln!("skipping {name}: not built (bash policies/build.sh)");
    }
    found
}

#[cfg(feature = "wasm")]
#[test]
fn cli_shadow_prints_what_a_replay_of_the_shadow_policy_prints() {
    let mut pairs = vec![("pytorch", "lifecycle"), ("lifecycle", "naive")];
    if shipped("pytorch-like") && shipped("lru-evict") {
        pairs.push(("pytorch", "pytorch-like+lru-evict"));
        pairs.push(("pytorch-like", "lifecycle"));
    }
    for (p, q) in pairs {
        for (mem, offload) in [("80GiB", "--prefetch"), ("9GiB", "--prefetch"), ("9GiB", "--no-offload")] {
            let base = ["replay", "--synth", "gpt2-124m", "--device-mem", mem, offload, "--json"];
            let (code, out, err) = wasmem(&[&base[..], &["--policy", p, "--shadow", q]].concat());
            assert_eq!(code, 0, "{err}");
            let both = json(&out);
            let shadow = &both["shadow"];
            assert_eq!(shadow["policy"], q);
            assert_eq!(shadow["errors"], 0);
            let (code, out_q, err) = wasmem(&[&base[..], &["--policy", q]].concat());
            assert_eq!(code, 0, "{err}");
            assert_eq!(core(shadow), core(&json(&out_q)), "--shadow {q} ≠ replay --policy {q} ({mem})");
            let (code, out_p, err) = wasmem(&[&base[..], &["--policy", p]].concat());
            assert_eq!(code, 0, "{err}");
            assert_eq!(core(&both), core(&json(&out_p)), "--shadow changed the primary {p} ({mem})");
        }
    }
    // Text: both columns side by side.
    let (code, out, err) = wasmem(&["replay", "--synth", "bert-base", "--policy", "pytorch", "--shadow", "naive"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("shadow A/B") && out.contains("shadow:naive") && out.contains("peak_reserved_bytes"), "{out}");
    // A shadow that does not load is an error before anything runs.
    let (code, _, err) = wasmem(&["replay", "--synth", "bert-base", "--shadow", "no-such-policy"]);
    assert_eq!(code, 1);
    assert!(err.contains("no-such-policy"), "{err}");
    // Nor can a shadow read the future.
    let (code, _, err) = wasmem(&["replay", "--synth", "bert-base", "--shadow", "belady"]);
    assert_eq!(code, 1);
    assert!(err.contains("--shadow belady") && err.contains("future"), "{err}");
}
