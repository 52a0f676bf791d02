//! `wasmem replay/compare --device-mem` with the tiers: the shared traces at
//! 60 % of their peak live bytes complete without an OOM under every shipped
//! eviction policy (built-in and WebAssembly), and Belady, the offline bound,
//! moves no more bytes between tiers than any other. Skipped cleanly without
//! `../shared/traces`.
#![cfg(feature = "wasm")]

use std::path::{Path, PathBuf};
use std::process::Command;

fn wasmem(args: &[&str]) -> (i32, String, String) {
    // WASMEM_BIN: a private copy of the binary, for machines where several
    // checkouts share one target directory (and overwrite each other's binary).
    let bin = std::env::var("WASMEM_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_wasmem").to_string());
    let out = Command::new(bin).args(args).output().expect("run wasmem");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn traces() -> Vec<PathBuf> {
    let d = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/traces");
    let Ok(rd) = std::fs::read_dir(&d) else {
        eprintln!("SKIP: {} not found", d.display());
        return Vec::new();
    };
    let mut v: Vec<PathBuf> =
        rd.filter_map(|e| e.ok().map(|e| e.path())).filter(|p| p.to_string_lossy().ends_with(".jsonl.gz")).collect();
    v.sort();
    v
}

fn json_lines(out: &str) -> Vec<serde_json::Value> {
    out.lines().map(|l| serde_json::from_str(l).expect("one JSON object per line")).collect()
}

/// The eviction policies to compare: the built-ins, and the shipped
/// WebAssembly versions when `policies/out` is built.
fn policies() -> Vec<&'static str> {
    let mut v = vec!["lru", "dtr", "belady"];
    let out = Path::new(env!("CARGO_MANIFEST_DIR")).join("../policies/out");
    for p in ["lru-evict", "dtr-evict"] {
        if out.join(format!("{p}.wasm")).is_file() {
            v.push(p);
        } else {
            eprintln!("SKIP {p}: policies/out/{p}.wasm is not built");
        }
    }
    v
}

#[test]
fn shared_traces_at_60_percent_complete_with_every_eviction_policy() {
    for t in traces() {
        let path = t.to_str().unwrap();
        let (code, out, err) = wasmem(&["replay", path, "--policy", "pytorch", "--no-offload", "--json"]);
        assert_eq!(code, 0, "{err}");
        let peak = json_lines(&out)[0]["peak_live_bytes"].as_u64().unwrap();
        let mem = (peak * 6 / 10).to_string();
        let pols = policies();
        for prefetch in [false, true] {
            check_compare(path, &mem, peak, &pols, prefetch);
        }
    }
}

fn check_compare(path: &str, mem: &str, peak: u64, pols: &[&str], prefetch: bool) {
    let mut args = vec!["compare", path, "--device-mem", mem, "--json", "--deadline-ms", "2000"];
    if prefetch {
        args.push("--prefetch");
    }
    for p in pols {
        args.extend(["--policy", p]);
    }
    let (code, out, err) = wasmem(&args);
    assert_eq!(code, 0, "{err}");
    let rows = json_lines(&out);
    assert_eq!(rows.len(), pols.len());
    let traffic = |m: &serde_json::Value| m["tier_traffic_bytes"].as_u64().unwrap();
    let belady = rows.iter().find(|m| m["policy"] == "belady").unwrap();
    for m in &rows {
        let p = m["policy"].as_str().unwrap();
        eprintln!(
            "{path} prefetch {prefetch} {p:>10}: evicted {} prefetched {} fetched {} traffic {} stall_us {:.0} peak host {} disk {}",
            m["evicted_bytes"],
            m["prefetched_bytes"],
            m["fetched_bytes"],
            traffic(m),
            m["stall_us"].as_f64().unwrap(),
            m["peak_host_bytes"],
            m["peak_disk_bytes"]
        );
        assert_eq!(m["ooms"], 0, "{p} on {path}: {}", m["first_oom"]);
        assert!(m["peak_reserved_bytes"].as_u64().unwrap() <= peak * 6 / 10, "{p} exceeded the device");
        assert!(m["evicted_bytes"].as_u64().unwrap() > 0, "{p}: a trace over the device must evict");
        assert!(m["peak_host_bytes"].as_u64().unwrap() > 0);
        assert_eq!(m["offline_bound"], p == "belady", "{p}: only Belady is an offline bound");
        assert_eq!(m["policy_fallbacks"], 0, "{p}: the policy itself decided every call");
        assert!(traffic(belady) <= traffic(m), "Belady moved more than {p} on {path}");
        assert_eq!(m["prefetched_bytes"].as_u64().unwrap() > 0, prefetch, "{p}: prefetch {prefetch}");
    }
    // The text table shows them side by side and marks the bound.
    let text_args: Vec<&str> = args.iter().copied().filter(|a| *a != "--json").collect();
    let (code, out, err) = wasmem(&text_args);
    assert_eq!(code, 0, "{err}");
    for key in ["evicted_bytes", "prefetched_bytes", "stall_us", "tier_traffic_bytes", "peak_host_bytes"] {
        assert!(out.contains(key), "{key} missing from\n{out}");
    }
    assert!(out.contains("note: belady reads the workload's future"), "{out}");
}

/// A trace file with one tensor larger than the device.
fn tiny_trace(dir: &Path) -> PathBuf {
    let p = dir.join("big.jsonl");
    let lines = [
        r#"{"format": "wasmem-trace", "version": 1, "source": "test", "ranks": 1}"#,
        r#"{"op":"alloc","id":1,"bytes":4194304,"kind":"param","stream":0}"#,
        r#"{"op":"alloc","id":2,"bytes":1073741824,"kind":"activation","stream":0}"#,
        r#"{"op":"use","id":1}"#,
        r#"{"op":"free","id":1}"#,
    ];
    std::fs::write(&p, lines.join("\n") + "\n").unwrap();
    p
}

#[test]
fn a_tensor_larger_than_the_device_is_a_named_oom_not_a_loop() {
    let dir = tempfile::tempdir().unwrap();
    let t = tiny_trace(dir.path());
    let path = t.to_str().unwrap();
    let (code, out, err) = wasmem(&["replay", path, "--device-mem", "64MiB", "--policy", "lru", "--json"]);
    assert_eq!(code, 0, "{err}");
    let m = &json_lines(&out)[0];
    assert_eq!(m["ooms"], 1);
    let first = m["first_oom"].as_str().unwrap();
    assert!(first.starts_with("event 1:") && first.contains("activation request of 1073741824 bytes"), "{first}");
    let (code, out, err) = wasmem(&["replay", path, "--device-mem", "64MiB", "--policy", "lru"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("first OOM: event 1:"), "{out}");
}

#[test]
fn bad_tier_flags_are_refused_clearly() {
    let (code, _, err) = wasmem(&["replay", "--synth", "gpt2-124m", "--prefetch-fraction", "1.5"]);
    assert_ne!(code, 0);
    assert!(err.contains("--prefetch-fraction must be between 0 and 1"), "{err}");
    let (code, _, err) = wasmem(&["replay", "--synth", "gpt2-124m", "--host-gbps", "0"]);
    assert_ne!(code, 0);
    assert!(err.contains("--host-gbps"), "{err}");
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("file");
    std::fs::write(&file, b"x").unwrap();
    let bad = file.join("spill");
    let (code, _, err) = wasmem(&["replay", "--synth", "gpt2-124m", "--spill-dir", bad.to_str().unwrap()]);
    assert_ne!(code, 0);
    assert!(err.contains(&format!("cannot create spill directory {}", bad.display())), "{err}");
}
