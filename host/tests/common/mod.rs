//! Helpers shared by the policy runtime's integration tests: building the
//! guest components once per test binary, runtimes with a private artifact
//! cache.
#![allow(dead_code)]

pub mod model;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
#[cfg(feature = "wasm")]
use std::time::Duration;

#[cfg(feature = "wasm")]
use wasmem::policy::{CacheDir, Limits, Runtime, RuntimeConfig};

/// The repository root.
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Whether the wasm32-wasip2 target is installed.
pub fn have_wasm_target() -> bool {
    Command::new("rustc")
        .args(["--print", "target-libdir", "--target", "wasm32-wasip2"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .is_some_and(|d| Path::new(d.trim()).is_dir())
}

fn cargo_build(manifest_dir: &Path) -> Result<(), String> {
    let out = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .current_dir(manifest_dir)
        .env("CARGO_TARGET_DIR", manifest_dir.join("target"))
        .args(["build", "--release", "--target", "wasm32-wasip2", "--quiet"])
        .output()
        .map_err(|e| format!("cannot run cargo: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("cargo build in {} failed:\n{}", manifest_dir.display(), String::from_utf8_lossy(&out.stderr)))
    }
}

/// Builds `dir` once per process; `None` (with a message) when the wasm32-wasip2
/// target is missing; panics when the build itself fails.
fn built(dir: &'static OnceLock<Option<PathBuf>>, manifest_dir: PathBuf) -> Option<PathBuf> {
    dir.get_or_init(|| {
        if !have_wasm_target() {
            eprintln!("SKIP: the wasm32-wasip2 target is not installed (rustup target add wasm32-wasip2)");
            return None;
        }
        if let Err(e) = cargo_build(&manifest_dir) {
            panic!("{e}");
        }
        Some(manifest_dir.join("target/wasm32-wasip2/release"))
    })
    .clone()
}

/// A shipped Rust policy (`pytorch-like`, `lru-evict`, `lifecycle`,
/// `watermark-reclaim`), built from `policies/` on first use.
pub fn rust_policy(name: &str) -> Option<PathBuf> {
    static DIR: OnceLock<Option<PathBuf>> = OnceLock::new();
    let dir = built(&DIR, repo().join("policies"))?;
    let p = dir.join(format!("{}.wasm", name.replace('-', "_")));
    assert!(p.is_file(), "{} was not built", p.display());
    Some(p)
}

/// The hostile policy of `tests/hostile`, built on first use.
pub fn hostile() -> Option<PathBuf> {
    static DIR: OnceLock<Option<PathBuf>> = OnceLock::new();
    let dir = built(&DIR, repo().join("tests/hostile"))?;
    Some(dir.join("hostile.wasm"))
}

/// The hostile planner of `tests/hostile` (WIT 0.4.0), built on first use.
pub fn hostile_planner() -> Option<PathBuf> {
    let dir = hostile()?;
    Some(dir.with_file_name("hostile_planner.wasm"))
}

/// A WAT component of `tests/hostile/wat`, compiled to a binary.
pub fn wat(name: &str) -> Vec<u8> {
    let path = repo().join("tests/hostile/wat").join(format!("{name}.wat"));
    wat::parse_file(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A private artifact cache directory for this test binary.
pub fn cache_dir(tag: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("wasmem-cache-{tag}"))
}

/// A runtime with `limits` and a private cache.
#[cfg(feature = "wasm")]
pub fn runtime_with(limits: Limits, tag: &str) -> Runtime {
    Runtime::new(RuntimeConfig { limits, epoch_tick: None, cache: CacheDir::At(cache_dir(tag)) }).expect("runtime")
}

/// A runtime whose deadline is generous enough that a loaded test machine
/// never trips it (tests that count fallbacks exactly use this one).
#[cfg(feature = "wasm")]
pub fn relaxed_runtime() -> Runtime {
    runtime_with(Limits { deadline: Some(Duration::from_secs(2)), ..Limits::default() }, "relaxed")
}

/// The spec loader of tests that swap policies: the relaxed runtime, or
/// the built-in policies only in a build without the `wasm` feature.
pub fn loader() -> wasmem::spec::Loader {
    #[cfg(feature = "wasm")]
    return std::sync::Arc::new(relaxed_runtime());
    #[cfg(not(feature = "wasm"))]
    return std::sync::Arc::new(wasmem::spec::Builtins);
}

/// Skips the calling test (returns) when `$e` is `None`.
#[macro_export]
macro_rules! need {
    ($e:expr) => {
        match $e {
            Some(v) => v,
            None => return,
        }
    };
}

/// componentize-py as `policies/build.sh` installs it, or `None` (with a
/// message) when it is absent.
pub fn componentize_py() -> Option<PathBuf> {
    let p = repo().join("policies/target/py-venv/bin/componentize-py");
    if p.is_file() {
        Some(p)
    } else {
        eprintln!("SKIP: {} not found (policies/build.sh installs it)", p.display());
        None
    }
}

/// The `node_modules` of `policies/js` with componentize-js, as
/// `policies/build.sh` installs it (and `node` on PATH), or `None` (with a
/// message) when either is absent.
pub fn componentize_js() -> Option<PathBuf> {
    let modules = repo().join("policies/js/node_modules");
    let node = Command::new("node").arg("--version").output().is_ok_and(|o| o.status.success());
    if node && modules.join("@bytecodealliance/componentize-js").is_dir() {
        Some(modules)
    } else {
        eprintln!(
            "SKIP: node or {}/@bytecodealliance/componentize-js not found (policies/build.sh installs it)",
            modules.display()
        );
        None
    }
}

/// Runs `cmd`, panicking with its output when it fails.
pub fn run_ok(cmd: &mut Command, what: &str) {
    let out = cmd.output().unwrap_or_else(|e| panic!("{what}: cannot run: {e}"));
    assert!(
        out.status.success(),
        "{what} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Every item of a verdict passes, except that the cost item — a wall-clock
/// judgement — is only checked for its per-role call counts (tests never
/// assert on wall-clock time; `docs/measurements.md` has its record under load).
#[cfg(feature = "wasm")]
pub fn assert_conformant(v: &wasmem::policy::check::Verdict) {
    use wasmem::policy::check::Outcome;
    for i in &v.items {
        if i.name.starts_with("cost:") {
            if i.outcome == Outcome::Fail {
                eprintln!("NOTE (wall-clock, not asserted): {}", i.detail);
            }
            continue;
        }
        assert_ne!(i.outcome, Outcome::Fail, "{}: {}\n{v}", i.name, i.detail);
    }
    for c in &v.costs {
        assert!(c.calls > 0 && c.over_deadline <= c.calls, "{c:?}");
    }
}
