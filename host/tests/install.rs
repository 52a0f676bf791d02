//! An installed or copied `wasmem` finds its shipped policies without the
//! repository: the Rust ones are embedded, the others are looked up next
//! to the executable. Also `policy cache` (size and `--clean`) on a private
//! cache directory.
#![cfg(feature = "wasm")]

mod common;

use std::path::Path;
use std::process::{Command, Output};

fn wasmem(exe: &Path, dir: &Path, args: &[&str], cache: &Path) -> Output {
    // A copy just written can be "busy" for a moment: another test's child
    // process, forked while the copy was open for writing, holds it until
    // it execs (ETXTBSY). Retried, not a failure.
    for _ in 0..100 {
        match Command::new(exe)
            .current_dir(dir)
            .env_remove("WASMEM_POLICY_DIR")
            .env("WASMEM_CACHE_DIR", cache)
            .args(args)
            .output()
        {
            Err(e) if e.kind() == std::io::ErrorKind::ExecutableFileBusy => {
                std::thread::sleep(std::time::Duration::from_millis(20))
            }
            r => return r.expect("run wasmem"),
        }
    }
    panic!("{} stayed busy (ETXTBSY) for 2 s", exe.display())
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

#[test]
fn a_copied_binary_resolves_the_shipped_policies() {
    let tmp = tempfile::Builder::new().prefix("wasmem-install-").tempdir_in(std::env::temp_dir()).unwrap();
    let exe = tmp.path().join("bin/wasmem");
    std::fs::create_dir_all(exe.parent().unwrap()).unwrap();
    std::fs::copy(env!("CARGO_BIN_EXE_wasmem"), &exe).unwrap();
    let cache = tmp.path().join("cache");
    let list = wasmem(&exe, tmp.path(), &["policy", "list"], &cache);
    assert!(list.status.success(), "{}", text(&list));
    let listing = text(&list);
    if !listing.lines().any(|l| l.starts_with("pytorch-like") && l.contains("embedded")) {
        eprintln!("SKIP: this binary embeds no pytorch-like (policies/out was not built before it):\n{listing}");
        return;
    }
    assert!(!listing.contains(env!("CARGO_MANIFEST_DIR")), "no build-tree path for a copied binary:\n{listing}");
    let out = wasmem(&exe, tmp.path(), &["replay", "--synth", "tiny", "--policy", "pytorch-like", "--json"], &cache);
    assert!(out.status.success(), "{}", text(&out));
    let m: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(m["policy"], "pytorch-like");
    assert!(m["policy_calls"].as_u64().unwrap() > 0, "{m}");
    // A component next to the executable wins over the embedded copy.
    let beside = tmp.path().join("bin/policies");
    std::fs::create_dir_all(&beside).unwrap();
    std::fs::copy(common::repo().join("policies/out/lru-evict.wasm"), beside.join("lru-evict.wasm")).unwrap();
    let listing = text(&wasmem(&exe, tmp.path(), &["policy", "list"], &cache));
    let line = listing.lines().find(|l| l.starts_with("lru-evict")).unwrap();
    assert!(line.contains("bin/policies/lru-evict.wasm"), "{listing}");
    // A large component that is not embedded says where to put it.
    let out = wasmem(&exe, tmp.path(), &["replay", "--synth", "tiny", "--policy", "size-class"], &cache);
    if !out.status.success() {
        assert!(text(&out).contains("too large to be embedded"), "{}", text(&out));
    }
}

#[test]
fn policy_cache_reports_and_cleans_a_private_cache() {
    let path = need!(common::rust_policy("pytorch-like"));
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("cache");
    let exe = Path::new(env!("CARGO_BIN_EXE_wasmem"));
    let out = wasmem(exe, tmp.path(), &["policy", "check", path.to_str().unwrap()], &cache);
    assert!(out.status.success(), "{}", text(&out));
    let out = wasmem(exe, tmp.path(), &["policy", "cache"], &cache);
    assert!(out.status.success() && text(&out).contains(": 1 artifacts"), "{}", text(&out));
    let out = wasmem(exe, tmp.path(), &["policy", "cache", "--clean"], &cache);
    assert!(out.status.success() && text(&out).contains("removed 1 artifacts"), "{}", text(&out));
    let out = wasmem(exe, tmp.path(), &["policy", "cache"], &cache);
    assert!(text(&out).contains(": 0 artifacts"), "{}", text(&out));
}
