//! The only `unsafe` of the policy runtime: deserializing precompiled
//! component artifacts, which contain native machine code.

use std::path::Path;

use wasmtime::component::Component;
use wasmtime::Engine;

/// Deserializes an artifact of the artifact cache.
///
/// # Safety (why this is sound)
///
/// `Component::deserialize_file` trusts the file to be the output of
/// `Engine::precompile_component`; a crafted file runs arbitrary native
/// code. Files reach here only from the cache directory of this user
/// (`$XDG_CACHE_HOME/wasmem` or an explicitly configured one), written by
/// [`super::cache::ArtifactCache`] with this engine's `precompile_component`,
/// and named by the SHA-256 of the component bytes and the engine's
/// compatibility hash. Anyone able to write there can already run code as
/// this user. wasmtime additionally checks the artifact's header (version,
/// target, engine settings) and refuses an incompatible one with an error.
pub(crate) fn deserialize_own_artifact(engine: &Engine, path: &Path) -> wasmtime::Result<Component> {
    // SAFETY: see the function's documentation: the file is our own
    // `precompile_component` output for this engine configuration.
    unsafe { Component::deserialize_file(engine, path) }
}

/// Deserializes bytes that `engine.precompile_component` has just returned.
pub(crate) fn deserialize_fresh(engine: &Engine, serialized: &[u8]) -> wasmtime::Result<Component> {
    // SAFETY: `serialized` is the unmodified output of
    // `engine.precompile_component` from this process.
    unsafe { Component::deserialize(engine, serialized) }
}
