//! Loading policy components: role detection, the artifact cache, version and
//! export errors, configuration errors, spec resolution.

mod common;

use wasmem::decision::Role;
use wasmem::policy::{resolve_with, LoadError, LoadSource, Runtime};

#[test]
fn shipped_policies_export_their_roles() {
    let rt = common::relaxed_runtime();
    for (name, roles) in [
        ("pytorch-like", vec![Role::Placement, Role::Reclamation]),
        ("lru-evict", vec![Role::Eviction]),
        ("watermark-reclaim", vec![Role::Reclamation]),
        ("lifecycle", vec![Role::Placement, Role::Reclamation]),
    ] {
        let path = need!(common::rust_policy(name));
        let loaded = rt.load(&path).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(loaded.roles(), roles.as_slice(), "{name}");
        assert!(!loaded.imports_wasi(), "{name} should import no WASI");
        let p = loaded.instantiate("").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(p.name(), name);
        assert_eq!(p.placement().is_some(), roles.contains(&Role::Placement));
        assert_eq!(p.eviction().is_some(), roles.contains(&Role::Eviction));
    }
}
