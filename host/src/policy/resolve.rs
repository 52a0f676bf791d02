//! The runtime's side of policy specs ([`crate::spec`]): the parts that are
//! not built-in names, loaded as components.
//!
//! ```text
//! shipped NAME, the first that exists:
//!   1. $WASMEM_POLICY_DIR/NAME.wasm
//!   2. <exe dir>/policies/NAME.wasm, <exe dir>/../share/wasmem/policies/NAME.wasm
//!   3. the build tree, only for a binary that runs from inside it (cargo run,
//!      tests): <repo>/policies/out/NAME.wasm,
//!      <repo>/policies/target/wasm32-wasip2/release/NAME.wasm (`-` → `_`)
//!   4. the copy embedded at build time (components ≤ 1 MiB: the Rust ones)
//! path: anything ending in `.wasm` or containing a path separator
//! ```
//!
//! An installed or copied binary therefore finds the Rust policies without
//! any file, and the Python and JavaScript ones (12–18 MB each, not
//! embedded) next to itself or through `$WASMEM_POLICY_DIR`.
//!
//! [`Runtime`] implements [`PartLoader`]: each part is loaded (from the
//! artifact cache when it was compiled before) and instantiated with its
//! configuration, so every resolution gets its own instances.

use std::path::{Path, PathBuf};

use super::Runtime;
use crate::spec::{self, Part, PartLoader, Resolved, SpecError};

mod embedded {
    include!(concat!(env!("OUT_DIR"), "/embedded_policies.rs"));
}

/// The repository's `policies/` directory, as known at compile time.
const REPO_POLICIES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../policies");

/// The policies shipped in `policies/` (built into `policies/out/NAME.wasm`
/// by `policies/build.sh`): what a spec may name besides the built-ins.
pub const SHIPPED_NAMES: [&str; 9] = [
    "pytorch-like",
    "lifecycle",
    "lru-evict",
    "watermark-reclaim",
    "defrag-reclaim",
    "greedy-planner",
    "size-class",
    "dtr-evict",
    "first-fit-planner",
];

/// Where a shipped policy was found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Shipped {
    /// A component file.
    File(PathBuf),
    /// The copy embedded in this binary at build time.
    Embedded(&'static [u8]),
}

impl std::fmt::Display for Shipped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Shipped::File(p) => write!(f, "{}", p.display()),
            Shipped::Embedded(b) => write!(f, "embedded in this binary ({} bytes)", b.len()),
        }
    }
}

/// The embedded copy of shipped policy `name`, if this binary has one.
pub fn embedded(name: &str) -> Option<&'static [u8]> {
    embedded::EMBEDDED.iter().find(|(n, _)| *n == name).map(|(_, b)| *b)
}

/// Whether `name` was built but left out of the binary for its size.
fn too_large_to_embed(name: &str) -> bool {
    embedded::NOT_EMBEDDED.contains(&name)
}

/// Directories next to the executable that hold shipped components:
/// `<exe dir>/policies` and `<exe dir>/../share/wasmem/policies`.
pub fn exe_policy_dirs() -> Vec<PathBuf> {
    let Some(dir) = std::env::current_exe().ok().and_then(|e| e.canonicalize().ok()?.parent().map(Path::to_path_buf))
    else {
        return Vec::new();
    };
    let mut v = vec![dir.join("policies")];
    if let Some(up) = dir.parent() {
        v.push(up.join("share/wasmem/policies"));
    }
    v
}

/// The repository's `policies/` directory when this process runs from
/// inside that repository (its executable lies under the repository root),
/// else `None`: an installed or copied binary never looks into the tree it
/// was built in.
fn build_tree() -> Option<PathBuf> {
    let repo = Path::new(REPO_POLICIES).parent()?.canonicalize().ok()?;
    let exe = std::env::current_exe().ok()?.canonicalize().ok()?;
    exe.starts_with(&repo).then(|| repo.join("policies"))
}

/// Candidate files for a shipped policy `name`, in the order they are
/// tried (the embedded copy, tried last, is not a file: see [`locate_shipped`]).
pub fn shipped_candidates(name: &str) -> Vec<PathBuf> {
    let file = format!("{name}.wasm");
    let mut v = Vec::new();
    if let Some(dir) = std::env::var_os("WASMEM_POLICY_DIR").filter(|d| !d.is_empty()) {
        v.push(PathBuf::from(dir).join(&file));
    }
    v.extend(exe_policy_dirs().into_iter().map(|d| d.join(&file)));
    if let Some(repo) = build_tree() {
        v.push(repo.join("out").join(&file));
        v.push(repo.join("target/wasm32-wasip2/release").join(format!("{}.wasm", name.replace('-', "_"))));
    }
    v
}

/// Finds shipped policy `name`: the first candidate file that exists, else
/// the embedded copy. `Err` holds the files tried.
pub fn locate_shipped(name: &str) -> Result<Shipped, Vec<PathBuf>> {
    let tried = shipped_candidates(name);
    if let Some(p) = tried.iter().find(|p| p.is_file()) {
        return Ok(Shipped::File(p.clone()));
    }
    embedded(name).map(Shipped::Embedded).ok_or(tried)
}

/// What a spec part names: a path as it is, a shipped name where it is found.
fn locate_part(what: &str) -> Result<Shipped, SpecError> {
    let looks_like_path = what.ends_with(".wasm") || what.contains(std::path::MAIN_SEPARATOR) || what.contains('/');
    if looks_like_path {
        return Ok(Shipped::File(PathBuf::from(what)));
    }
    locate_shipped(what).map_err(|tried| {
        let mut shipped = SHIPPED_NAMES.join(", ");
        if too_large_to_embed(what) {
            shipped.push_str(&format!(
                "; `{what}` is too large to be embedded in the binary: put {what}.wasm next to it \
                 (<exe dir>/policies/) or in $WASMEM_POLICY_DIR"
            ));
        }
        SpecError::Unknown { part: what.to_string(), builtins: spec::builtin_names(), shipped, tried }
    })
}

impl PartLoader for Runtime {
    fn load_part(&self, what: &str, config: &str) -> Result<Part, SpecError> {
        let found = locate_part(what)?;
        let load = |e: super::LoadError| SpecError::Load { part: what.to_string(), cause: Box::new(e) };
        let loaded = match &found {
            Shipped::File(path) => self.load(path),
            Shipped::Embedded(bytes) => self.load_bytes(what, bytes),
        }
        .map_err(load)?;
        let policy = loaded.instantiate(config).map_err(load)?;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_build_script_knows_the_shipped_names() {
        assert_eq!(embedded::BUILD_SHIPPED, &SHIPPED_NAMES[..]);
    }

    #[test]
    fn embedded_components_are_shipped_components() {
        for (name, bytes) in embedded::EMBEDDED {
            assert!(SHIPPED_NAMES.contains(name), "{name}");
            assert!(bytes.starts_with(b"\0asm"), "{name} is not a WebAssembly binary");
        }
    }
}
