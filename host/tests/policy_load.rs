//! Loading policy components: role detection, the artifact cache, version and
//! export errors, configuration errors, spec resolution.
#![cfg(feature = "wasm")]

mod common;

use wasmem::decision::Role;
use wasmem::policy::{resolve_with, CacheDir, Limits, LoadError, LoadSource, Runtime, RuntimeConfig, WitVersion};

#[test]
fn shipped_policies_export_their_roles() {
    let rt = common::relaxed_runtime();
    for (name, roles) in [
        ("pytorch-like", vec![Role::Placement, Role::Reclamation]),
        ("lru-evict", vec![Role::Eviction]),
        ("watermark-reclaim", vec![Role::Reclamation]),
        ("lifecycle", vec![Role::Placement, Role::Reclamation]),
        ("defrag-reclaim", vec![Role::Reclamation]),
    ] {
        let path = need!(common::rust_policy(name));
        let loaded = rt.load(&path).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(loaded.roles(), roles.as_slice(), "{name}");
        assert_eq!(loaded.wit_version(), WitVersion::V0_4, "{name} is built against wit/");
        assert!(!loaded.imports_wasi(), "{name} should import no WASI");
        let p = loaded.instantiate("").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(p.name(), name);
        assert_eq!(p.placement().is_some(), roles.contains(&Role::Placement));
        assert_eq!(p.eviction().is_some(), roles.contains(&Role::Eviction));
    }
}

#[test]
fn second_load_comes_from_the_artifact_cache() {
    let path = need!(common::rust_policy("pytorch-like"));
    let dir = common::cache_dir("second-load");
    let _ = std::fs::remove_dir_all(&dir);
    let rt = Runtime::new(RuntimeConfig { cache: CacheDir::At(dir.clone()), ..Default::default() }).unwrap();
    let first = rt.load(&path).unwrap();
    assert_eq!(first.source(), LoadSource::Compiled);
    let second = rt.load(&path).unwrap();
    assert_eq!(second.source(), LoadSource::Cached);
    // A fresh runtime with the same configuration shares the artifacts.
    let rt2 = Runtime::new(RuntimeConfig { cache: CacheDir::At(dir.clone()), ..Default::default() }).unwrap();
    assert_eq!(rt2.load(&path).unwrap().source(), LoadSource::Cached);
    // Another engine configuration (fuel on) does not.
    let rt3 = Runtime::new(RuntimeConfig {
        limits: Limits { fuel: Some(1_000_000), ..Limits::default() },
        cache: CacheDir::At(dir.clone()),
        ..Default::default()
    })
    .unwrap();
    assert_eq!(rt3.load(&path).unwrap().source(), LoadSource::Compiled);
    // A corrupt artifact is discarded and recompiled. (Replaced by a
    // rename: the old file is still mapped by the components above.)
    for e in std::fs::read_dir(&dir).unwrap() {
        let path = e.unwrap().path();
        let tmp = path.with_extension("corrupt");
        std::fs::write(&tmp, b"garbage").unwrap();
        std::fs::rename(&tmp, &path).unwrap();
    }
    let again = rt.load(&path).unwrap();
    assert_eq!(again.source(), LoadSource::Compiled);
    assert!(again.instantiate("").is_ok());
    println!("load: compiled {:?}, cached {:?}", first.load_time(), second.load_time());
}

#[test]
fn wrong_wit_version_is_refused_with_policy_and_cause() {
    let rt = common::relaxed_runtime();
    let err = rt.load_bytes("future", &common::wat("wrong-version")).unwrap_err();
    assert!(matches!(err, LoadError::WrongVersion { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(
        msg.contains("`future`")
            && msg.contains("wasmem:policy/placement@9.0.0")
            && msg.contains("0.1.0, 0.2.0, 0.3.0 or 0.4.0"),
        "{msg}"
    );
}

#[test]
fn component_without_role_is_refused() {
    let rt = common::relaxed_runtime();
    let err = rt.load_bytes("nothing", &common::wat("no-role")).unwrap_err();
    assert!(matches!(err, LoadError::NoRole { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains("`nothing`") && msg.contains("answer"), "{msg}");
}

#[test]
fn garbage_and_missing_files_are_refused() {
    let rt = common::relaxed_runtime();
    let err = rt.load_bytes("junk", b"\0asm\x0d\0\x01\0garbage").unwrap_err();
    assert!(matches!(err, LoadError::Compile { .. }), "{err:?}");
    let err = rt.load_bytes("text", b"hello").unwrap_err();
    assert!(err.to_string().contains("`text`"), "{err}");
    let err = rt.load("/nonexistent/dir/p.wasm").unwrap_err();
    assert!(matches!(err, LoadError::Io { .. }) && err.to_string().contains("`p`"), "{err}");
}

#[test]
fn init_errors_name_the_policy() {
    let rt = common::relaxed_runtime();
    let path = need!(common::rust_policy("pytorch-like"));
    let err = rt.load(&path).unwrap().instantiate("no-such-key=1").unwrap_err();
    assert!(matches!(err, LoadError::Lifecycle { call: "init", .. }), "{err:?}");
    assert!(err.to_string().contains("pytorch_like") && err.to_string().contains("no-such-key"), "{err}");

    let hostile = need!(common::hostile());
    let loaded = rt.load(&hostile).unwrap();
    let err = loaded.instantiate("mode=trap-init").unwrap_err();
    assert!(err.to_string().contains("init") && err.to_string().contains("traps in init"), "{err}");
    let err = loaded.instantiate("mode=empty-pools").unwrap_err();
    assert!(matches!(err, LoadError::Lifecycle { call: "pools", .. }), "{err:?}");
    assert!(err.to_string().contains("hostile") && err.to_string().contains("empty"), "{err}");
}

#[test]
fn specs_resolve_builtins_shipped_names_paths_and_combinations() {
    let rt = common::relaxed_runtime();
    let r = resolve_with(&rt, "lifecycle").unwrap();
    assert_eq!(r.policies.placement.name(), "lifecycle");
    assert!(Role::ALL.iter().all(|&role| r.policies.state(role).is_none()));

    let pytorch = need!(common::rust_policy("pytorch-like"));
    let lru = need!(common::rust_policy("lru-evict"));
    let spec = format!("{}+{}", pytorch.display(), lru.display());
    let r = resolve_with(&rt, &spec).unwrap();
    assert_eq!(r.policies.placement.name(), "pytorch-like");
    assert_eq!(r.policies.reclamation.name(), "pytorch-like");
    assert_eq!(r.policies.eviction.name(), "lru-evict");
    assert!(r.policies.placement.memoizable());
    assert!(Role::ALL.iter().all(|&role| r.policies.state(role).is_some()));

    // A shipped name (found in policies/out or the policies' build folder);
    // roles it does not export come from the built-in defaults.
    let r = resolve_with(&rt, "lru-evict").unwrap();
    assert_eq!(r.policies.eviction.name(), "lru-evict");
    assert_eq!(r.policies.placement.name(), "pytorch");
    assert_eq!(r.sources[0], None);

    // The more specific part wins a role: `defrag-reclaim` exports only
    // reclamation, so it reclaims whichever side of `+` it is on.
    for spec in ["pytorch-like+defrag-reclaim", "defrag-reclaim+pytorch-like"] {
        let r = resolve_with(&rt, spec).unwrap();
        assert_eq!(r.policies.placement.name(), "pytorch-like", "{spec}");
        assert_eq!(r.policies.reclamation.name(), "defrag-reclaim", "{spec}");
        assert!(r.policies.reclamation.paged_segments(), "{spec}");
        assert_eq!(r.policies.eviction.name(), "lru", "{spec}");
        assert_eq!(r.sources, [Some("pytorch-like".into()), Some("defrag-reclaim".into()), None], "{spec}");
        let states = Role::ALL.map(|role| r.policies.state(role).is_some());
        assert_eq!(states, [true, true, false], "{spec}");
    }
    // A built-in provides all three roles: a WebAssembly part with fewer wins its roles.
    let r = resolve_with(&rt, "pytorch+watermark-reclaim").unwrap();
    assert_eq!((r.policies.placement.name(), r.policies.reclamation.name()), ("pytorch", "watermark-reclaim"));
    // Two parts with the same roles: the first.
    let r = resolve_with(&rt, &format!("pytorch-like+{}", need!(common::rust_policy("lifecycle")).display())).unwrap();
    assert_eq!(r.policies.reclamation.name(), "pytorch-like");

    // Configuration after `?`.
    let hostile = need!(common::hostile());
    let r = resolve_with(&rt, &format!("{}?mode=bad-pool", hostile.display())).unwrap();
    assert_eq!(r.policies.placement.name(), "hostile");

    let err = resolve_with(&rt, "no-such-policy").unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("no-such-policy")
            && msg.contains("pytorch")
            && msg.contains("out/no-such-policy.wasm")
            && msg.contains("defrag-reclaim"),
        "{msg}"
    );
}

#[test]
fn eviction_only_builtins_provide_only_their_role() {
    let rt = common::relaxed_runtime();
    let r = resolve_with(&rt, "dtr+lifecycle").unwrap();
    assert_eq!(r.policies.eviction.name(), "dtr");
    assert_eq!(r.policies.placement.name(), "lifecycle");
    assert_eq!(r.sources, [Some("lifecycle".into()), Some("lifecycle".into()), Some("dtr".into())]);
    // The most specific part wins a role, whatever the order.
    let r = resolve_with(&rt, "lifecycle+belady").unwrap();
    assert_eq!((r.policies.placement.name(), r.policies.eviction.name()), ("lifecycle", "belady"));
    // Alone: the default placement and reclamation.
    let r = resolve_with(&rt, "belady").unwrap();
    assert_eq!((r.policies.placement.name(), r.policies.eviction.name()), ("pytorch", "belady"));
    assert_eq!(r.sources[0], None);
    assert!(r.policies.eviction.needs_future());
    let msg = resolve_with(&rt, "no-such-policy").unwrap_err().to_string();
    assert!(msg.contains("lru, dtr, belady"), "{msg}");
}
