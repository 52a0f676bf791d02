//! Policy specs: what a user types to choose policies.
//!
//! ```text
//! spec   := part ('+' part)*
//! part   := builtin | shipped | path          (optionally `part?config` — the text after `?` goes to `init`)
//! builtin: a name of `wasmem::builtin::BUILTIN_NAMES` (naive, pytorch, lifecycle),
//!          or of `EVICTION_NAMES` (lru, dtr, belady: the eviction role only)
//! shipped: NAME → $WASMEM_POLICY_DIR/NAME.wasm, <repo>/policies/out/NAME.wasm,
//!          <repo>/policies/target/wasm32-wasip2/release/NAME.wasm (`-` → `_`)
//! path   : anything ending in `.wasm` or containing a path separator
//! ```
//!
//! Each role is taken from the first part that provides it (a built-in
//! provides all three); roles no part provides are filled by the built-in
//! `pytorch` defaults (PyTorch placement and reclamation, LRU eviction).

use std::path::{Path, PathBuf};

use super::error::LoadError;
use super::instance::WasmPolicy;
use super::Runtime;
use crate::builtin::{self, LruEviction, Policies, PytorchPlacement, PytorchReclamation};
use crate::decision::{EvictionPolicy, PlacementPolicy, ReclamationPolicy, Role};

/// The repository's `policies/` directory, as known at compile time.
const REPO_POLICIES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../policies");

/// What a spec resolved to.
pub struct Resolved {
    /// One policy per role, ready for [`crate::alloc::Allocator::new`].
    pub policies: Policies,
    /// The WebAssembly instance behind each role (placement, reclamation,
    /// eviction), if that role is a WebAssembly policy.
    pub wasm: [Option<WasmPolicy>; 3],
    /// Which part provided each role (a built-in name or `lifecycle.name`);
    /// `None`: the built-in default.
    pub sources: [Option<String>; 3],
}

impl std::fmt::Debug for Resolved {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Resolved").field("wasm", &self.wasm).field("sources", &self.sources).finish_non_exhaustive()
    }
}

/// Candidate files for a shipped policy `name`.
pub fn shipped_candidates(name: &str) -> Vec<PathBuf> {
    let file = format!("{name}.wasm");
    let mut v = Vec::new();
    if let Some(dir) = std::env::var_os("WASMEM_POLICY_DIR").filter(|d| !d.is_empty()) {
        v.push(PathBuf::from(dir).join(&file));
    }
    let repo = Path::new(REPO_POLICIES);
    v.push(repo.join("out").join(&file));
    v.push(repo.join("target/wasm32-wasip2/release").join(format!("{}.wasm", name.replace('-', "_"))));
    v
}

/// Resolves `spec` with the global runtime (see the module documentation).
pub fn resolve(spec: &str) -> Result<Policies, LoadError> {
    resolve_with(Runtime::global()?, spec).map(|r| r.policies)
}

/// Resolves `spec` with `runtime`, keeping the WebAssembly handles.
pub fn resolve_with(runtime: &Runtime, spec: &str) -> Result<Resolved, LoadError> {
    let mut placement: Option<(Box<dyn PlacementPolicy>, String)> = None;
    let mut reclamation: Option<(Box<dyn ReclamationPolicy>, String)> = None;
    let mut eviction: Option<(Box<dyn EvictionPolicy>, String)> = None;
    let mut wasm: [Option<WasmPolicy>; 3] = Default::default();
    for part in spec.split('+').map(str::trim).filter(|p| !p.is_empty()) {
        let (what, config) = part.split_once('?').unwrap_or((part, ""));
        if let Some(e) = builtin::eviction_by_name(what) {
            // An eviction-only built-in provides only its role.
            eviction.get_or_insert((e, what.to_string()));
            continue;
        }
        if let Some(p) = builtin::by_name(what) {
            placement.get_or_insert((p.placement, what.to_string()));
            reclamation.get_or_insert((p.reclamation, what.to_string()));
            eviction.get_or_insert((p.eviction, what.to_string()));
            continue;
        }
        let looks_like_path = what.ends_with(".wasm") || what.contains(std::path::MAIN_SEPARATOR) || what.contains('/');
        let path = if looks_like_path {
            PathBuf::from(what)
        } else {
            let tried = shipped_candidates(what);
            match tried.iter().find(|p| p.is_file()) {
                Some(p) => p.clone(),
                None => {
                    return Err(LoadError::UnknownSpec {
                        spec: what.to_string(),
                        builtins: builtin::BUILTIN_NAMES
                            .iter()
                            .chain(&builtin::EVICTION_NAMES)
                            .copied()
                            .collect::<Vec<_>>()
                            .join(", "),
                        tried,
                    })
                }
            }
        };
        let policy = runtime.load(&path)?.instantiate(config)?;
        let label = policy.name().to_string();
        if placement.is_none() && policy.exports(Role::Placement) {
            placement = policy.placement().map(|p| (Box::new(p) as Box<dyn PlacementPolicy>, label.clone()));
            wasm[0] = Some(policy.clone());
        }
        if reclamation.is_none() && policy.exports(Role::Reclamation) {
            reclamation = policy.reclamation().map(|p| (Box::new(p) as Box<dyn ReclamationPolicy>, label.clone()));
            wasm[1] = Some(policy.clone());
        }
        if eviction.is_none() && policy.exports(Role::Eviction) {
            eviction = policy.eviction().map(|p| (Box::new(p) as Box<dyn EvictionPolicy>, label.clone()));
            wasm[2] = Some(policy.clone());
        }
    }
    let sources = [
        placement.as_ref().map(|p| p.1.clone()),
        reclamation.as_ref().map(|p| p.1.clone()),
        eviction.as_ref().map(|p| p.1.clone()),
    ];
    let policies = Policies {
        placement: placement.map_or_else(|| Box::new(PytorchPlacement) as Box<dyn PlacementPolicy>, |p| p.0),
        reclamation: reclamation.map_or_else(|| Box::new(PytorchReclamation) as Box<dyn ReclamationPolicy>, |p| p.0),
        eviction: eviction.map_or_else(|| Box::new(LruEviction) as Box<dyn EvictionPolicy>, |p| p.0),
    };
    Ok(Resolved { policies, wasm, sources })
}
