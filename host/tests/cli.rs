//! The command line as users run it: exit codes, messages, and deterministic
//! metrics across `replay`, `compare` (parallel) and repeated runs.
#![cfg(feature = "wasm")]

use std::process::Command;

fn wasmem(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_wasmem")).args(args).output().expect("run wasmem");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// JSON lines without the timing keys.
fn metrics(stdout: &str) -> Vec<serde_json::Value> {
    stdout
        .lines()
        .map(|l| {
            let mut v: serde_json::Value = serde_json::from_str(l).expect("one JSON object per line");
            let o = v.as_object_mut().expect("object");
            for k in ["wall_seconds", "events_per_second", "policy_call_p50_ns", "policy_call_p99_ns"] {
                o.remove(k);
            }
            v
        })
        .collect()
}

#[test]
fn compare_in_parallel_equals_replays_in_sequence() {
    let policies = ["pytorch", "lifecycle", "naive"];
    let mut args = vec!["compare", "--synth", "gpt2-124m", "--synth", "bert-base", "--json"];
    for p in &policies {
        args.extend(["--policy", p]);
    }
    let (code, out, err) = wasmem(&args);
    assert_eq!(code, 0, "{err}");
    let parallel = metrics(&out);
    assert_eq!(parallel.len(), 6);
    let mut sequential = Vec::new();
    for preset in ["gpt2-124m", "bert-base"] {
        for p in &policies {
            let (code, out, err) = wasmem(&["replay", "--synth", preset, "--policy", p, "--json"]);
            assert_eq!(code, 0, "{err}");
            sequential.extend(metrics(&out));
        }
    }
    assert_eq!(parallel, sequential);
    let (_, again, _) = wasmem(&args);
    assert_eq!(metrics(&again), parallel, "a second run differs");
    for key in [
        "events",
        "allocs",
        "frees",
        "peak_live_bytes",
        "peak_allocated_bytes",
        "peak_reserved_bytes",
        "overhead_ratio",
        "device_alloc_calls",
        "device_free_calls",
        "device_syncs",
        "ooms",
        "evicted_bytes",
        "prefetched_bytes",
        "moved_bytes",
        "policy_calls",
        "policy_traps",
        "policy_fallbacks",
    ] {
        assert!(parallel[0].get(key).is_some(), "metric key `{key}` missing");
    }
}

#[test]
fn errors_are_clean() {
    let (code, _, err) = wasmem(&["replay", "/nonexistent/trace.jsonl", "--policy", "pytorch"]);
    assert_eq!(code, 1);
    assert!(err.starts_with("error: cannot read /nonexistent/trace.jsonl"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    let (code, _, err) = wasmem(&["replay", "--synth", "gpt2-124m", "--policy", "no-such-policy"]);
    assert_eq!(code, 1);
    assert!(err.contains("no-such-policy"), "{err}");
    let (code, _, err) = wasmem(&["compare", "--synth", "gpt9"]);
    assert_eq!(code, 1);
    assert!(err.contains("unknown preset `gpt9`"), "{err}");
    let (code, _, err) = wasmem(&["synth", "--preset", "gpt2-124m", "--heads", "7", "-o", "/tmp/x.jsonl"]);
    assert_eq!(code, 1);
    assert!(err.contains("hidden (768) must be a multiple of heads (7)"), "{err}");
    let (code, _, err) = wasmem(&["compare", "--synth", "gpt2-124m", "--swap-at", "99999999:lifecycle"]);
    assert_eq!(code, 1);
    assert!(err.contains("has only"), "{err}");
}

#[test]
fn synth_writes_a_trace_that_replays() {
    let dir = std::env::temp_dir().join(format!("wasmem-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let file = dir.join("t.jsonl.gz");
    let f = file.to_str().expect("utf-8 path");
    let (code, _, err) = wasmem(&["synth", "--preset", "gpt2-124m", "--layers", "2", "--steps", "2", "-o", f]);
    assert_eq!(code, 0, "{err}");
    let (code, out, err) = wasmem(&["replay", f, "--policy", "pytorch", "--json"]);
    assert_eq!(code, 0, "{err}");
    let (_, synth_out, _) = wasmem(&["replay", "--synth", "gpt2-124m", "--policy", "pytorch", "--json"]);
    let from_file = &metrics(&out)[0];
    assert!(from_file["events"].as_u64().unwrap() > 1000);
    assert_ne!(from_file["peak_live_bytes"], metrics(&synth_out)[0]["peak_live_bytes"], "--layers 2 applied");
    let snap = dir.join("s.pickle");
    let (code, _, err) =
        wasmem(&["replay", f, "--policy", "lifecycle", "--export-snapshot", snap.to_str().expect("utf-8")]);
    assert_eq!(code, 0, "{err}");
    let (code, out, err) = wasmem(&["replay", snap.to_str().expect("utf-8"), "--policy", "naive", "--json"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(metrics(&out)[0]["allocs"], from_file["allocs"]);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn cuda_device_without_a_driver_is_a_clean_error() {
    if wasmem::device::cuda::driver_present() {
        eprintln!("skipping: a CUDA driver is present");
        return;
    }
    for cmd in ["replay", "compare"] {
        let (code, out, err) = wasmem(&[cmd, "--synth", "gpt2-124m", "--device", "cuda"]);
        assert_eq!(code, 1, "{cmd}: {out}{err}");
        assert_eq!(
            err.trim(),
            "error: --device cuda: no CUDA driver found (libcuda could not be loaded); use --device sim"
        );
    }
}

#[test]
fn compare_plots_and_swaps() {
    let dir = std::env::temp_dir().join(format!("wasmem-plot-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let svg = dir.join("mem.svg");
    let (code, out, err) = wasmem(&[
        "compare",
        "--synth",
        "gpt2-124m",
        "--policy",
        "pytorch",
        "--policy",
        "lifecycle",
        "--swap-at",
        "4000:naive",
        "--plot",
        svg.to_str().expect("utf-8"),
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("both halves of the hot swap"), "{out}");
    assert!(out.contains("pytorch [0,4000)") && out.contains("→naive [4000,end)"), "{out}");
    let text = std::fs::read_to_string(&svg).expect("the plot was written");
    assert!(text.starts_with("<svg") && text.contains("lifecycle reserved"), "not the expected SVG");
    let (code, out, err) = wasmem(&["compare", "--synth", "gpt2-124m", "--swap-at", "4000:lifecycle", "--json"]);
    assert_eq!(code, 0, "{err}");
    let first: serde_json::Value = serde_json::from_str(out.lines().next().expect("a line")).expect("JSON");
    assert_eq!(first["halves"]["split_at"], 4000);
    assert_eq!(
        first["halves"]["first"]["events"].as_u64().unwrap() + first["halves"]["second"]["events"].as_u64().unwrap(),
        first["events"].as_u64().unwrap()
    );
    let _ = std::fs::remove_dir_all(&dir);
}
