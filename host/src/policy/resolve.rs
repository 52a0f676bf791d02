//! The runtime's side of policy specs ([`crate::spec`]): the parts that are
//! not built-in names, loaded as components.
//!
//! ```text
//! shipped: NAME → $WASMEM_POLICY_DIR/NAME.wasm, <repo>/policies/out/NAME.wasm,
//!          <repo>/policies/target/wasm32-wasip2/release/NAME.wasm (`-` → `_`)
//! path   : anything ending in `.wasm` or containing a path separator
//! ```
//!
//! [`Runtime`] implements [`PartLoader`]: each part is loaded (from the
//! artifact cache when it was compiled before) and instantiated with its
//! configuration, so every resolution gets its own instances.

use std::path::{Path, PathBuf};

use super::Runtime;
use crate::spec::{self, Part, PartLoader, Resolved, SpecError};

/// The repository's `policies/` directory, as known at compile time.
const REPO_POLICIES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../policies");

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

/// The file a spec part names: a path as it is, a shipped name where it is found.
fn part_path(what: &str) -> Result<PathBuf, SpecError> {
    let looks_like_path = what.ends_with(".wasm") || what.contains(std::path::MAIN_SEPARATOR) || what.contains('/');
    if looks_like_path {
        return Ok(PathBuf::from(what));
    }
    let tried = shipped_candidates(what);
    match tried.iter().find(|p| p.is_file()) {
        Some(p) => Ok(p.clone()),
        None => Err(SpecError::Unknown {
            part: what.to_string(),
            builtins: spec::builtin_names(),
            shipped: SHIPPED_NAMES.join(", "),
            tried,
        }),
    }
}

impl PartLoader for Runtime {
    fn load_part(&self, what: &str, config: &str) -> Result<Part, SpecError> {
        let path = part_path(what)?;
        let load = |e: super::LoadError| SpecError::Load { part: what.to_string(), cause: Box::new(e) };
        let policy = self.load(&path).map_err(load)?.instantiate(config).map_err(load)?;
        Ok(policy.part())
    }
}

/// Resolves `spec` with `runtime` (see [`crate::spec`]).
pub fn resolve_with(runtime: &Runtime, spec: &str) -> Result<Resolved, SpecError> {
    spec::resolve(spec, runtime)
}

/// The process's global runtime ([`Runtime::global`]) as a loader, started
/// only when a spec names a part that is not built in.
#[derive(Debug, Clone, Copy, Default)]
pub struct GlobalRuntime;

impl PartLoader for GlobalRuntime {
    fn load_part(&self, what: &str, config: &str) -> Result<Part, SpecError> {
        let rt = Runtime::global().map_err(|e| SpecError::Load { part: what.to_string(), cause: Box::new(e) })?;
        rt.load_part(what, config)
    }
}

/// Resolves `spec` with the process's global runtime, which starts only
/// when the spec names a component.
pub fn resolve(spec: &str) -> Result<Resolved, SpecError> {
    spec::resolve(spec, &GlobalRuntime)
}
