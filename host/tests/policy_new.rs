//! `wasmem policy new`: a project for each language and role (the planner
//! of WIT 0.4.0 included) is created
//! outside the repository, builds offline with the toolchains
//! `policies/build.sh` installs, and passes `policy check` unchanged. A
//! language whose toolchain is absent is skipped with a message. Also: the
//! Rust SDK's copy of the WIT package is identical to `wit/`.
#![cfg(feature = "wasm")]

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use wasmem::policy::check::{check_with, CheckOptions};
use wasmem::policy::scaffold::{new_project, Lang, ProjectRole as Role};
use wasmem::policy::Runtime;

/// A fresh directory outside the repository.
fn outside(tag: &str) -> tempfile::TempDir {
    tempfile::Builder::new().prefix(&format!("wasmem-policy-new-{tag}-")).tempdir_in(std::env::temp_dir()).unwrap()
}

fn check(path: &Path) {
    assert!(path.is_file(), "the build wrote no {}", path.display());
    let v = check_with(Runtime::global().unwrap(), path, &CheckOptions::default());
    println!("{v}");
    common::assert_conformant(&v);
    if v.planner {
        let c = v.planner_cost.as_ref().unwrap_or_else(|| panic!("a planner without planning calls: {v}"));
        assert_eq!(c.calls, CheckOptions::default().profiles() as u64, "{v}");
        assert!(v.item("planner: valid plans").is_some(), "{v}");
    }
}

#[test]
fn the_sdk_carries_an_identical_copy_of_wit() {
    let wit = common::repo().join("wit");
    let copy = common::repo().join("policies/sdk/wit");
    let names = |d: &Path| -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(d)
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| e.path().extension().is_some_and(|x| x == "wit"))
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    };
    assert_eq!(names(&wit), names(&copy), "policies/sdk/wit must hold the same files as wit/");
    for f in names(&wit) {
        let (a, b) = (std::fs::read(wit.join(&f)).unwrap(), std::fs::read(copy.join(&f)).unwrap());
        assert!(a == b, "policies/sdk/wit/{f} differs from wit/{f}: copy wit/*.wit into policies/sdk/wit/");
    }
    // And the binary embeds exactly wit/.
    for (f, text) in wasmem::policy::scaffold::WIT_FILES {
        assert_eq!(std::fs::read_to_string(wit.join(f)).unwrap(), text, "{f}");
    }
}

#[test]
fn rust_projects_build_offline_and_pass() {
    if !common::have_wasm_target() {
        eprintln!("SKIP: the wasm32-wasip2 target is not installed");
        return;
    }
    // One target directory for the three projects (the SDK's dependencies compile once).
    let target = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("policy-new-rust");
    for (role, name) in [
        (Role::Placement, "my-place"),
        (Role::Reclamation, "my-reclaim"),
        (Role::Eviction, "my-evict"),
        (Role::Planner, "my-plan"),
    ] {
        let d = outside("rust");
        let p = new_project(Lang::Rust, role, name, Some(&d.path().join(name))).unwrap();
        assert!(p.files.iter().any(|f| f.starts_with("sdk/wit")), "{p:?}");
        let manifest = std::fs::read_to_string(p.dir.join("Cargo.toml")).unwrap();
        assert!(!manifest.contains("wasmem/") && !manifest.contains(".workspace"), "no path into the repository");
        common::run_ok(
            Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
                .current_dir(&p.dir)
                .env("CARGO_TARGET_DIR", &target)
                .args(["build", "--release", "--target", "wasm32-wasip2", "--offline", "--quiet"]),
            &format!("cargo build of the new {role} project"),
        );
        let built = target.join("wasm32-wasip2/release").join(p.output.file_name().unwrap());
        check(&built);
    }
}

#[test]
fn python_projects_build_and_pass() {
    let cpy = need!(common::componentize_py());
    for (role, name) in [
        (Role::Placement, "py-place"),
        (Role::Reclamation, "py-reclaim"),
        (Role::Eviction, "py-evict"),
        (Role::Planner, "py-plan"),
    ] {
        let d = outside("python");
        let p = new_project(Lang::Python, role, name, Some(&d.path().join(name))).unwrap();
        common::run_ok(
            Command::new("sh").arg("build.sh").current_dir(&p.dir).env("COMPONENTIZE_PY", &cpy),
            &format!("sh build.sh of the new {role} project"),
        );
        check(&p.dir.join(&p.output));
    }
}

#[test]
fn javascript_projects_build_and_pass() {
    let modules = need!(common::componentize_js());
    for (role, name) in [
        (Role::Placement, "js-place"),
        (Role::Reclamation, "js-reclaim"),
        (Role::Eviction, "js-evict"),
        (Role::Planner, "js-plan"),
    ] {
        let d = outside("js");
        let p = new_project(Lang::Js, role, name, Some(&d.path().join(name))).unwrap();
        // Offline: the componentize-js that policies/build.sh installed stands
        // in for `npm install`.
        std::os::unix::fs::symlink(&modules, p.dir.join("node_modules")).unwrap();
        common::run_ok(
            Command::new("npm").args(["run", "build", "--silent"]).current_dir(&p.dir),
            &format!("npm run build of the new {role} project"),
        );
        check(&p.dir.join(&p.output));
    }
}

#[test]
fn the_cli_creates_a_project_and_says_how_to_build_it() {
    let d = outside("cli");
    let dir = d.path().join("x");
    let out = Command::new(env!("CARGO_BIN_EXE_wasmem"))
        .args(["policy", "new", "--lang", "python", "--role", "eviction", "my-evict", "--dir"])
        .arg(&dir)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("sh build.sh") && text.contains("my-evict.wasm"), "{text}");
    assert!(dir.join("my_evict.py").is_file() && dir.join("wit/worlds.wit").is_file());
    // Again: the directory is no longer empty.
    let out = Command::new(env!("CARGO_BIN_EXE_wasmem"))
        .args(["policy", "new", "--lang", "python", "--role", "eviction", "my-evict", "--dir"])
        .arg(&dir)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("already exists and is not empty"));
    let out = Command::new(env!("CARGO_BIN_EXE_wasmem"))
        .args(["policy", "new", "--lang", "cobol", "--role", "eviction", "x"])
        .output()
        .unwrap();
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("expected rust, python or js"));
    let out = Command::new(env!("CARGO_BIN_EXE_wasmem"))
        .args(["policy", "new", "--lang", "rust", "--role", "planer", "x"])
        .output()
        .unwrap();
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("eviction or planner"));
    let dir = d.path().join("p");
    let out = Command::new(env!("CARGO_BIN_EXE_wasmem"))
        .args(["policy", "new", "--lang", "js", "--role", "planner", "my-plan", "--dir"])
        .arg(&dir)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("js planner policy `my-plan`"));
    let js = std::fs::read_to_string(dir.join("my-plan.js")).unwrap();
    assert!(js.contains("export const planner") && js.contains("wasmem:policy@0.4.0, world planner-policy"), "{js}");
}
