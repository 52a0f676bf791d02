//! The precompiled-artifact cache: `Engine::precompile_component` output
//! stored under `<dir>/<key>.cwasm`, where
//! `key = sha256(component bytes ‖ engine compatibility hash ‖ wasmtime version)`.
//! A later load of the same bytes by a compatible engine deserializes the
//! artifact (milliseconds) instead of compiling (tens of milliseconds for a
//! Rust policy, ~20 s for a Python one).
//!
//! Cache failures never fail a load: they are logged and the component is
//! compiled in memory. Artifacts are written to a temporary file and renamed
//! into place, so concurrent loaders (threads or processes) never see a
//! partial file; do not edit artifact files in place while a process uses
//! them (they are memory-mapped).

use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use sha2::{Digest, Sha256};
use wasmtime::component::Component;
use wasmtime::Engine;

use super::artifact;

/// Feeds `Hash` output into SHA-256 (stable across processes, unlike
/// `DefaultHasher`'s `finish`).
struct ShaHasher(Sha256);

impl Hasher for ShaHasher {
    fn finish(&self) -> u64 {
        0
    }
    fn write(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }
}

/// How a component was obtained.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoadSource {
    /// Deserialized from the artifact cache.
    Cached,
    /// Compiled now (and stored in the cache if there is one).
    Compiled,
}

/// A directory of precompiled artifacts for one engine configuration.
pub(crate) struct ArtifactCache {
    dir: PathBuf,
    /// Digest of the engine's compatibility hash and wasmtime's version.
    engine_key: [u8; 32],
}

impl ArtifactCache {
    pub(crate) fn new(dir: PathBuf, engine: &Engine) -> Self {
        let mut h = ShaHasher(Sha256::new());
        engine.precompile_compatibility_hash().hash(&mut h);
        "wasmtime-48.0.8".hash(&mut h);
        ArtifactCache { dir, engine_key: h.0.finalize().into() }
    }

    pub(crate) fn dir(&self) -> &Path {
        &self.dir
    }

    /// The artifact path for `bytes`.
    pub(crate) fn path_for(&self, bytes: &[u8]) -> PathBuf {
        let mut h = Sha256::new();
        h.update(bytes);
        h.update(self.engine_key);
        let hex: String = h.finalize().iter().map(|b| format!("{b:02x}")).collect();
        self.dir.join(format!("{hex}.cwasm"))
    }

    /// Loads the component for `bytes`: from the cache when present and
    /// valid, else compiled and stored.
    pub(crate) fn load(&self, engine: &Engine, bytes: &[u8]) -> wasmtime::Result<(Component, LoadSource)> {
        let path = self.path_for(bytes);
        if path.is_file() {
            match artifact::deserialize_own_artifact(engine, &path) {
                Ok(c) => return Ok((c, LoadSource::Cached)),
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, "discarding unusable cached policy artifact")
                }
            }
        }
        let serialized = engine.precompile_component(bytes)?;
        if let Err(e) = self.store(&path, &serialized) {
            tracing::warn!(dir = %self.dir.display(), error = %e, "cannot write the policy artifact cache");
        }
        // Deserializing our own fresh output is as fast as keeping the
        // compiled form and avoids compiling twice.
        let c = artifact::deserialize_fresh(engine, &serialized)?;
        Ok((c, LoadSource::Compiled))
    }

    /// Writes atomically: a uniquely named temporary file renamed into
    /// place. An artifact file is never modified in place — components
    /// deserialized from it map it into memory, and truncating a mapped file
    /// would crash their process (SIGBUS).
    fn store(&self, path: &Path, data: &[u8]) -> std::io::Result<()> {
        static SEQ: AtomicU64 = AtomicU64::new(0);
        std::fs::create_dir_all(&self.dir)?;
        let seq = SEQ.fetch_add(1, Ordering::Relaxed);
        let tmp = path.with_extension(format!("tmp.{}.{seq}", std::process::id()));
        let result = std::fs::write(&tmp, data).and_then(|()| std::fs::rename(&tmp, path));
        if result.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        result
    }
}
