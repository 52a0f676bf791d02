//! The dependency rules of ARCHITECTURE.md, checked on the sources: the
//! engine never names the policy runtime or wasmtime; only the CUDA backend
//! and the NCCL communicator name cudarc; the library never prints.

use std::path::{Path, PathBuf};

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// Every `.rs` file under `dir` (or `dir` itself when it is a file).
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    if dir.is_file() {
        return vec![dir.to_path_buf()];
    }
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(rust_files(&p));
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
    out
}

/// Lines of code of `files` (comments and the `#[cfg(test)]` module at the
/// end of a file skipped) that contain any of `needles`.
fn offenders(files: &[PathBuf], needles: &[&str]) -> Vec<String> {
    let mut bad = Vec::new();
    for f in files {
        let text = std::fs::read_to_string(f).unwrap();
        for (i, line) in text.lines().enumerate() {
            let code = line.trim_start();
            if code == "#[cfg(test)]" {
                break;
            }
            if code.starts_with("//") {
                continue;
            }
            if needles.iter().any(|n| code.contains(n)) {
                bad.push(format!("{}:{}: {}", f.display(), i + 1, line.trim()));
            }
        }
    }
    bad
}

#[test]
fn the_engine_never_names_the_policy_runtime() {
    let engine = [
        "alloc",
        "tier",
        "shard",
        "builtin",
        "decision.rs",
        "replay.rs",
        "driver.rs",
        "metrics.rs",
        "spec.rs",
        "session.rs",
        "shadow.rs",
        "workload.rs",
        "train",
        "ctl",
        "device",
        "comm",
        "trace",
        "model.rs",
        "synth.rs",
    ];
    let files: Vec<PathBuf> = engine.iter().flat_map(|m| rust_files(&src().join(m))).collect();
    assert!(files.len() > 50, "found only {} files", files.len());
    let bad = offenders(&files, &["crate::policy", "wasmtime"]);
    assert!(bad.is_empty(), "the engine names the policy runtime:\n{}", bad.join("\n"));
}

#[test]
fn only_the_cuda_backend_and_nccl_name_cudarc() {
    let all = rust_files(&src());
    let others: Vec<PathBuf> =
        all.into_iter().filter(|p| !p.starts_with(src().join("device/cuda")) && !p.ends_with("comm/nccl.rs")).collect();
    let bad = offenders(&others, &["cudarc"]);
    assert!(bad.is_empty(), "cudarc outside its backends:\n{}", bad.join("\n"));
}

#[test]
fn the_library_never_prints() {
    let lib: Vec<PathBuf> = rust_files(&src()).into_iter().filter(|p| !p.starts_with(src().join("bin"))).collect();
    let bad = offenders(&lib, &["println!", "print!(", "eprintln!", "anyhow::"]);
    assert!(bad.is_empty(), "printing or anyhow in the library (it belongs in report or the CLI):\n{}", bad.join("\n"));
}
