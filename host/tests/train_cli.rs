//! `wasmem train` and `wasmem synth --zero` as users run them.
#![cfg(feature = "wasm")]

use std::process::Command;

/// The binary under test (`WASMEM_BIN` overrides cargo's, e.g. a private
/// copy when several checkouts share one target directory).
fn bin() -> String {
    std::env::var("WASMEM_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_wasmem").to_string())
}

fn wasmem(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(bin()).args(args).output().expect("run wasmem");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

const SMALL: [&str; 14] = [
    "--layers",
    "2",
    "--hidden",
    "32",
    "--heads",
    "2",
    "--intermediate",
    "64",
    "--vocab",
    "64",
    "--seq",
    "16",
    "--batch",
    "2",
];

fn peak_of_replay(path: &std::path::Path) -> u64 {
    let (code, out, err) = wasmem(&["replay", path.to_str().unwrap(), "--policy", "pytorch", "--json"]);
    assert_eq!(code, 0, "replay of {}: {err}", path.display());
    let v: serde_json::Value = serde_json::from_str(out.lines().next().unwrap()).unwrap();
    v["peak_reserved_bytes"].as_u64().unwrap()
}

#[test]
fn train_prints_steps_and_the_saving_and_its_record_replays_like_synth() {
    let dir = std::env::temp_dir().join(format!("wasmem-train-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let rec = dir.join("run.jsonl");
    let mut args = vec!["train", "--ranks", "8", "--zero", "3", "--policy", "pytorch", "--steps", "2", "--json"];
    args.extend(SMALL);
    args.extend(["--record", rec.to_str().unwrap()]);
    let (code, out, err) = wasmem(&args);
    assert_eq!(code, 0, "{err}");
    let lines: Vec<serde_json::Value> = out.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 3, "two steps and a summary: {out}");
    assert_eq!(lines[0]["ranks"].as_array().unwrap().len(), 8);
    assert!(lines[0]["loss"].as_f64().unwrap() > 0.0);
    let summary = &lines[2];
    assert_eq!(summary["event"], "summary");
    assert!(summary["model_state_saved_percent"].as_f64().unwrap() > 80.0, "{summary}");
    let trained = lines[1]["ranks"][0]["peak_reserved_bytes"].as_u64().unwrap();
    // Rank 0's recording replays; its peak agrees with the synthesized trace's.
    let rank0 = dir.join("run.rank0.jsonl");
    let recorded = peak_of_replay(&rank0);
    let synth = dir.join("synth.jsonl");
    let mut args = vec!["synth", "--zero", "3", "--ranks", "8", "--rank", "0", "--steps", "2", "--preset", "tiny"];
    args.extend(SMALL);
    args.extend(["-o", synth.to_str().unwrap()]);
    let (code, _, err) = wasmem(&args);
    assert_eq!(code, 0, "{err}");
    let synthesized = peak_of_replay(&synth);
    for (what, v) in [("recorded", recorded), ("synthesized", synthesized)] {
        let rel = (v as f64 - trained as f64).abs() / trained as f64;
        assert!(rel <= 0.05, "{what} peak {v} vs trained {trained}");
    }
    assert_eq!(
        std::fs::read_to_string(&synth).unwrap().lines().count(),
        std::fs::read_to_string(&rank0).unwrap().lines().count()
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn synth_writes_one_trace_per_rank_at_scale() {
    let dir = std::env::temp_dir().join(format!("wasmem-synth-zero-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join("l70.jsonl.gz");
    let (code, _, err) = wasmem(&[
        "synth",
        "--preset",
        "llama-70b",
        "--zero",
        "3",
        "--ranks",
        "1024",
        "--rank",
        "5",
        "--steps",
        "1",
        "-o",
        out.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("70") && out.is_file(), "{err}");
    let small = dir.join("t.jsonl");
    let (code, _, err) = wasmem(&[
        "synth",
        "--preset",
        "tiny",
        "--zero",
        "2",
        "--ranks",
        "2",
        "--steps",
        "1",
        "-o",
        small.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(dir.join("t.rank0.jsonl").is_file() && dir.join("t.rank1.jsonl").is_file());
    let (code, _, err) = wasmem(&[
        "synth",
        "--preset",
        "tiny",
        "--zero",
        "2",
        "--ranks",
        "3",
        "--micro-batches",
        "4",
        "-o",
        small.to_str().unwrap(),
    ]);
    assert_ne!(code, 0);
    assert!(err.contains("micro-batches"), "{err}");
    let (code, _, err) = wasmem(&["synth", "--preset", "tiny", "--ranks", "2", "-o", small.to_str().unwrap()]);
    assert_ne!(code, 0);
    assert!(err.contains("add --zero"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn train_on_cuda_without_a_gpu_is_a_clean_error() {
    if std::path::Path::new("/dev/nvidia0").exists() {
        eprintln!("skipped: this machine has a GPU");
        return;
    }
    let mut args = vec!["train", "--device", "cuda", "--steps", "1"];
    args.extend(SMALL);
    let (code, out, err) = wasmem(&args);
    assert_eq!(code, 1, "{out}{err}");
    assert!(err.starts_with("error: --device cuda:"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn bad_train_arguments_are_named() {
    let (code, _, err) = wasmem(&["train", "--ranks", "3", "--micro-batches", "4", "--steps", "1"]);
    assert_eq!(code, 1);
    assert!(err.contains("micro-batches (4) must be a positive multiple of the ranks (3)"), "{err}");
    let (code, _, err) = wasmem(&["train", "--steps", "2", "--swap-at", "5:lifecycle"]);
    assert_eq!(code, 1);
    assert!(err.contains("--swap-at 5"), "{err}");
    let (code, _, err) = wasmem(&["train", "--preset", "llama-1b", "--steps", "1"]);
    assert_eq!(code, 1);
    assert!(err.contains("GPT"), "{err}");
    let (code, _, err) = wasmem(&["train", "--zero", "4"]);
    assert_ne!(code, 0);
    assert!(err.contains("--zero"), "{err}");
}

#[test]
fn the_shadow_of_a_training_run_equals_a_replay_of_its_recording() {
    let dir = std::env::temp_dir().join(format!("wasmem-train-shadow-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let rec = dir.join("rec.jsonl");
    let mut args = vec!["train", "--ranks", "2", "--zero", "2", "--steps", "3", "--policy", "pytorch", "--json"];
    args.extend(SMALL);
    args.extend(["--shadow", "lifecycle", "--record", rec.to_str().unwrap()]);
    let (code, out, err) = wasmem(&args);
    assert_eq!(code, 0, "{err}");
    let summary: serde_json::Value = serde_json::from_str(out.lines().last().unwrap()).unwrap();
    let shadow = &summary["shadow"];
    assert_eq!(shadow["errors"], 0, "{summary}");
    let peaks = shadow["peak_reserved_bytes"].as_array().unwrap();
    assert_eq!(peaks.len(), 2);
    let step: serde_json::Value = serde_json::from_str(out.lines().next().unwrap()).unwrap();
    assert_eq!(step["shadow_peak_reserved_bytes"].as_array().unwrap().len(), 2);
    // The shadow decided on exactly the events a replay of the recording sees.
    let (code, out, err) =
        wasmem(&["replay", dir.join("rec.rank0.jsonl").to_str().unwrap(), "--policy", "lifecycle", "--json"]);
    assert_eq!(code, 0, "{err}");
    let replayed: serde_json::Value = serde_json::from_str(out.lines().next().unwrap()).unwrap();
    assert_eq!(replayed["peak_reserved_bytes"], peaks[0]);
    assert_eq!(replayed["events"], shadow["rank0"]["events"]);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn ctl_swaps_and_reads_a_running_training() {
    let dir = std::env::temp_dir().join(format!("wasmem-train-ctl-{}", std::process::id()));
    let sock = dir.join("t.sock");
    let mut args = vec!["train", "--ranks", "2", "--zero", "3", "--steps", "1000000", "--policy", "pytorch"];
    args.extend(SMALL);
    args.extend(["--ctl", sock.to_str().unwrap()]);
    let mut child = Command::new(bin())
        .args(&args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Wait for the socket (bounded by attempts, not by a clock assertion).
    let mut ready = false;
    for _ in 0..600 {
        if sock.exists() {
            ready = true;
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let s = sock.to_str().unwrap();
    let result = std::panic::catch_unwind(|| {
        assert!(ready, "the control socket did not appear");
        let (code, out, err) = wasmem(&["ctl", "--socket", s, "status", "--json"]);
        assert_eq!(code, 0, "{err}");
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["ranks"].as_array().unwrap().len(), 2, "{v}");
        assert!(v["step"].is_u64(), "{v}");
        let (code, out, err) = wasmem(&["ctl", "--socket", s, "swap", "placement", "lifecycle"]);
        assert_eq!(code, 0, "{err}");
        assert!(out.contains("placement: pytorch → lifecycle on 2 rank(s)"), "{out}");
        let (_, out, _) = wasmem(&["ctl", "--socket", s, "status", "--json"]);
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["ranks"][1]["policies"]["placement"], "lifecycle", "{v}");
    });
    child.kill().ok();
    child.wait().ok();
    std::fs::remove_dir_all(&dir).ok();
    if let Err(p) = result {
        std::panic::resume_unwind(p);
    }
}
