//! Where wasmem keeps files between runs.

use std::path::PathBuf;

/// The root of wasmem's caches: `$WASMEM_CACHE_DIR`, else
/// `$XDG_CACHE_HOME/wasmem`, else `~/.cache/wasmem` (empty variables count
/// as unset); `None` when none of them is set. The policy runtime keeps its
/// precompiled artifacts here, the trace cache its entries under `traces/`.
pub fn cache_root() -> Option<PathBuf> {
    let env = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    env("WASMEM_CACHE_DIR")
        .or_else(|| env("XDG_CACHE_HOME").map(|p| p.join("wasmem")))
        .or_else(|| env("HOME").map(|p| p.join(".cache").join("wasmem")))
}
