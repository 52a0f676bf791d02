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
//! them (they are memory-mapped). Removing one is safe: a process that maps
//! it keeps its pages until it unmaps them.
//!
//! Size: a Rust policy's artifact is ~0.1–0.5 MB, a Python or JavaScript
//! one ~35 MB (the interpreter, compiled). The cache is bounded: after each
//! store, the least recently written artifacts are removed until the
//! directory holds at most `$WASMEM_CACHE_MAX_BYTES` (default
//! [`DEFAULT_CACHE_MAX_BYTES`], 1 GiB). [`usage`] and [`clean`] back
//! `wasmem policy cache [--clean]`.

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

/// Default bound on the artifact cache's size, in bytes (1 GiB).
pub const DEFAULT_CACHE_MAX_BYTES: u64 = 1 << 30;

/// What an artifact cache directory holds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheUsage {
    /// Artifact files (`*.cwasm`), and leftovers of interrupted writes.
    pub files: u64,
    /// Their total size in bytes.
    pub bytes: u64,
}

/// Whether `name` is a file this cache writes: `<hex>.cwasm` or a
/// temporary `<hex>.tmp.<pid>.<seq>` of an interrupted write.
fn is_cache_file(name: &str) -> bool {
    name.ends_with(".cwasm") || name.contains(".tmp.")
}

/// The cache files of `dir` with their size and modification time
/// (nothing when `dir` does not exist).
fn entries(dir: &Path) -> std::io::Result<Vec<(PathBuf, u64, std::time::SystemTime)>> {
    let rd = match std::fs::read_dir(dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let mut v = Vec::new();
    for e in rd {
        let e = e?;
        let name = e.file_name();
        let Some(name) = name.to_str() else { continue };
        let Ok(m) = e.metadata() else { continue };
        if m.is_file() && is_cache_file(name) {
            v.push((e.path(), m.len(), m.modified().unwrap_or(std::time::UNIX_EPOCH)));
        }
    }
    Ok(v)
}

/// What the artifact cache at `dir` holds (empty when it does not exist).
pub fn usage(dir: &Path) -> std::io::Result<CacheUsage> {
    let e = entries(dir)?;
    Ok(CacheUsage { files: e.len() as u64, bytes: e.iter().map(|x| x.1).sum() })
}

/// Removes every artifact of the cache at `dir` (only the files the cache
/// writes; the directory and anything else in it stay). Returns what was
/// removed. Running processes keep the artifacts they mapped; the next load
/// of a component compiles it again.
pub fn clean(dir: &Path) -> std::io::Result<CacheUsage> {
    let mut removed = CacheUsage::default();
    for (path, len, _) in entries(dir)? {
        match std::fs::remove_file(&path) {
            Ok(()) => {
                removed.files += 1;
                removed.bytes += len;
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(std::io::Error::new(e.kind(), format!("cannot remove {}: {e}", path.display()))),
        }
    }
    Ok(removed)
}

/// The cache bound: `$WASMEM_CACHE_MAX_BYTES` or the default.
fn max_bytes() -> u64 {
    match std::env::var("WASMEM_CACHE_MAX_BYTES") {
        Ok(v) => v.trim().parse().unwrap_or_else(|_| {
            tracing::warn!(value = %v, "WASMEM_CACHE_MAX_BYTES is not a number of bytes; using the default");
            DEFAULT_CACHE_MAX_BYTES
        }),
        Err(_) => DEFAULT_CACHE_MAX_BYTES,
    }
}

/// Removes the oldest artifacts of `dir` (by modification time), never
/// `keep`, until the total is at most `max` bytes. Returns what was removed.
fn evict(dir: &Path, max: u64, keep: &Path) -> std::io::Result<CacheUsage> {
    let mut e = entries(dir)?;
    let mut total: u64 = e.iter().map(|x| x.1).sum();
    let mut removed = CacheUsage::default();
    if total <= max {
        return Ok(removed);
    }
    e.sort_by_key(|x| x.2);
    for (path, len, _) in e {
        if total <= max {
            break;
        }
        if path == keep {
            continue;
        }
        if std::fs::remove_file(&path).is_ok() {
            total -= len;
            removed.files += 1;
            removed.bytes += len;
        }
    }
    Ok(removed)
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
        match self.store(&path, &serialized) {
            Err(e) => tracing::warn!(dir = %self.dir.display(), error = %e, "cannot write the policy artifact cache"),
            Ok(()) => match evict(&self.dir, max_bytes(), &path) {
                Ok(r) if r.files > 0 => tracing::info!(
                    dir = %self.dir.display(),
                    files = r.files,
                    bytes = r.bytes,
                    "removed the oldest policy artifacts to keep the cache under WASMEM_CACHE_MAX_BYTES"
                ),
                Ok(_) => {}
                Err(e) => {
                    tracing::warn!(dir = %self.dir.display(), error = %e, "cannot bound the policy artifact cache")
                }
            },
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

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, name: &str, len: usize) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, vec![0u8; len]).unwrap();
        p
    }

    #[test]
    fn usage_clean_and_eviction_touch_only_cache_files() {
        let d = tempfile::tempdir().unwrap();
        let old = write(d.path(), "aa.cwasm", 100);
        std::thread::sleep(std::time::Duration::from_millis(20));
        let new = write(d.path(), "bb.cwasm", 100);
        write(d.path(), "cc.tmp.1.0", 10);
        let other = write(d.path(), "notes.txt", 5);
        assert_eq!(usage(d.path()).unwrap(), CacheUsage { files: 3, bytes: 210 });
        // Over 150 bytes: the oldest goes first, the one just written stays.
        let r = evict(d.path(), 150, &new).unwrap();
        assert!(!old.exists() && new.exists(), "{r:?}");
        assert_eq!(usage(d.path()).unwrap().bytes, 110);
        let r = clean(d.path()).unwrap();
        assert_eq!(r, CacheUsage { files: 2, bytes: 110 });
        assert!(other.exists(), "clean removes only the cache's own files");
        assert_eq!(usage(&d.path().join("absent")).unwrap(), CacheUsage::default());
    }
}
