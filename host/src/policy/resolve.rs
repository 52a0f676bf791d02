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
//! Each role is taken from the most specific part that provides it: the one
//! that provides the fewest roles, the earlier one on a tie (a built-in
//! provides all three). So `pytorch-like+defrag-reclaim` takes reclamation
//! from `defrag-reclaim` (reclamation only) and placement from
//! `pytorch-like`, and `a+b` of two parts with the same roles takes every
//! role from `a`. Roles no part provides are filled by the built-in
//! `pytorch` defaults (PyTorch placement and reclamation, LRU eviction).

use std::path::{Path, PathBuf};

use super::error::LoadError;
use super::instance::WasmPolicy;
use super::Runtime;
use crate::builtin::{self, LruEviction, Policies, PytorchPlacement, PytorchReclamation};
use crate::decision::{EvictionPolicy, PlacementPolicy, ReclamationPolicy};

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

/// The policies shipped in `policies/` (built into `policies/out/NAME.wasm`
/// by `policies/build.sh`): what a spec may name besides the built-ins.
pub const SHIPPED_NAMES: [&str; 7] =
    ["pytorch-like", "lifecycle", "lru-evict", "watermark-reclaim", "defrag-reclaim", "size-class", "dtr-evict"];

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

/// The part chosen for one role so far: how many roles it provides, the
/// policy, its label and its WebAssembly instance.
struct Choice<P: ?Sized> {
    roles: usize,
    policy: Box<P>,
    label: String,
    wasm: Option<WasmPolicy>,
}

/// Takes `policy` for a role unless the current choice is at least as specific.
fn offer<P: ?Sized>(slot: &mut Option<Choice<P>>, roles: usize, make: impl FnOnce() -> Option<Choice<P>>) {
    if slot.as_ref().is_none_or(|c| roles < c.roles) {
        if let Some(c) = make() {
            *slot = Some(c);
        }
    }
}

/// The choice of a WebAssembly part that provides `roles` roles.
fn wasm_choice<P: ?Sized>(policy: Box<P>, roles: usize, wasm: &WasmPolicy) -> Choice<P> {
    Choice { roles, policy, label: wasm.name().to_string(), wasm: Some(wasm.clone()) }
}

/// Resolves `spec` with `runtime`, keeping the WebAssembly handles.
pub fn resolve_with(runtime: &Runtime, spec: &str) -> Result<Resolved, LoadError> {
    let mut placement: Option<Choice<dyn PlacementPolicy>> = None;
    let mut reclamation: Option<Choice<dyn ReclamationPolicy>> = None;
    let mut eviction: Option<Choice<dyn EvictionPolicy>> = None;
    for part in spec.split('+').map(str::trim).filter(|p| !p.is_empty()) {
        let (what, config) = part.split_once('?').unwrap_or((part, ""));
        if let Some(e) = builtin::eviction_by_name(what) {
            // An eviction-only built-in provides only its role.
            let label = what.to_string();
            offer(&mut eviction, 1, || Some(Choice { roles: 1, policy: e, label, wasm: None }));
            continue;
        }
        if let Some(p) = builtin::by_name(what) {
            let label = what.to_string();
            offer(&mut placement, 3, || {
                Some(Choice { roles: 3, policy: p.placement, label: label.clone(), wasm: None })
            });
            offer(&mut reclamation, 3, || {
                Some(Choice { roles: 3, policy: p.reclamation, label: label.clone(), wasm: None })
            });
            offer(&mut eviction, 3, || Some(Choice { roles: 3, policy: p.eviction, label, wasm: None }));
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
                        shipped: SHIPPED_NAMES.join(", "),
                        tried,
                    })
                }
            }
        };
        let policy = runtime.load(&path)?.instantiate(config)?;
        let n = policy.roles().len();
        offer(&mut placement, n, || policy.placement().map(|p| wasm_choice(Box::new(p) as Box<_>, n, &policy)));
        offer(&mut reclamation, n, || policy.reclamation().map(|p| wasm_choice(Box::new(p) as Box<_>, n, &policy)));
        offer(&mut eviction, n, || policy.eviction().map(|p| wasm_choice(Box::new(p) as Box<_>, n, &policy)));
    }
    let sources = [
        placement.as_ref().map(|c| c.label.clone()),
        reclamation.as_ref().map(|c| c.label.clone()),
        eviction.as_ref().map(|c| c.label.clone()),
    ];
    let wasm = [
        placement.as_ref().and_then(|c| c.wasm.clone()),
        reclamation.as_ref().and_then(|c| c.wasm.clone()),
        eviction.as_ref().and_then(|c| c.wasm.clone()),
    ];
    let policies = Policies {
        placement: placement.map_or_else(|| Box::new(PytorchPlacement) as Box<dyn PlacementPolicy>, |c| c.policy),
        reclamation: reclamation
            .map_or_else(|| Box::new(PytorchReclamation) as Box<dyn ReclamationPolicy>, |c| c.policy),
        eviction: eviction.map_or_else(|| Box::new(LruEviction) as Box<dyn EvictionPolicy>, |c| c.policy),
    };
    Ok(Resolved { policies, wasm, sources })
}
