//! The disk tier: spill files in a spill directory, written and read by a
//! small pool of I/O threads, each file with a CRC-32 of its contents.
//!
//! Invariants:
//! - every file this tier created and did not remove is in `files`, with the
//!   length and checksum of what was written; `used_bytes = Σ lengths`;
//! - `used_bytes ≤ quota` (a write that would pass the quota is refused
//!   before any byte is written);
//! - a failed write leaves no file behind; a failed read changes nothing;
//! - dropping the tier removes every file it created, and the directory when
//!   the tier created it (the default fresh temporary directory).

use std::fs;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use rustc_hash::FxHashMap;

use super::TierError;
use crate::device::HostBuf;

/// A spill file written by [`DiskTier`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpillFile {
    /// Where it is.
    pub path: PathBuf,
    /// Bytes written.
    pub len: u64,
    /// CRC-32 of the bytes written.
    pub crc: u32,
}

type Job = Box<dyn FnOnce() + Send>;

/// One I/O job answering a `T`.
type IoJob<T> = Box<dyn FnOnce() -> T + Send>;

/// A fixed pool of I/O threads fed by a channel.
struct IoPool {
    tx: Option<mpsc::Sender<Job>>,
    workers: Vec<JoinHandle<()>>,
}

impl IoPool {
    fn new(threads: usize) -> Self {
        let (tx, rx) = mpsc::channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        let workers = (0..threads.max(1))
            .map(|i| {
                let rx = Arc::clone(&rx);
                std::thread::Builder::new()
                    .name(format!("wasmem-spill-{i}"))
                    .spawn(move || loop {
                        let job = match rx.lock() {
                            Ok(r) => r.recv(),
                            Err(_) => return,
                        };
                        match job {
                            Ok(job) => job(),
                            Err(_) => return,
                        }
                    })
                    .expect("spawning an I/O thread")
            })
            .collect();
        IoPool { tx: Some(tx), workers }
    }

    /// Runs every job on the pool and returns their results in order.
    fn run<T: Send + 'static>(&self, jobs: Vec<IoJob<T>>) -> Vec<T> {
        let (rtx, rrx) = mpsc::channel::<(usize, T)>();
        let n = jobs.len();
        let tx = self.tx.as_ref().expect("the pool lives until drop");
        for (i, job) in jobs.into_iter().enumerate() {
            let rtx = rtx.clone();
            // A send fails only when every worker is gone, which ends the wait below.
            let _ = tx.send(Box::new(move || {
                let _ = rtx.send((i, job()));
            }));
        }
        drop(rtx);
        let mut out: Vec<Option<T>> = (0..n).map(|_| None).collect();
        for (i, v) in rrx.iter() {
            out[i] = Some(v);
        }
        out.into_iter().map(|v| v.expect("every I/O job answers")).collect()
    }
}

impl Drop for IoPool {
    fn drop(&mut self) {
        self.tx.take();
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

enum Dir {
    /// Not created yet (the default: a fresh temporary directory on first use).
    Lazy,
    /// A fresh temporary directory, removed with its contents on drop.
    Temp(tempfile::TempDir),
    /// A directory the user named; only our files are removed.
    User(PathBuf),
}

/// The disk tier.
pub struct DiskTier {
    dir: Dir,
    quota: u64,
    used: u64,
    next: u64,
    files: FxHashMap<PathBuf, u64>,
    pool: IoPool,
}

impl std::fmt::Debug for DiskTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DiskTier")
            .field("dir", &self.dir_path())
            .field("quota", &self.quota)
            .field("used", &self.used)
            .field("files", &self.files.len())
            .finish()
    }
}

impl DiskTier {
    /// A disk tier in `dir` (created if missing; `None`: a fresh temporary
    /// directory under the system's, created on first use), refusing writes
    /// past `quota` bytes, with `threads` I/O threads.
    pub fn new(dir: Option<PathBuf>, quota: u64, threads: usize) -> Self {
        DiskTier {
            dir: dir.map_or(Dir::Lazy, Dir::User),
            quota,
            used: 0,
            next: 0,
            files: FxHashMap::default(),
            pool: IoPool::new(threads),
        }
    }

    /// Bytes in spill files.
    pub fn used_bytes(&self) -> u64 {
        self.used
    }

    /// The quota in bytes.
    pub fn quota(&self) -> u64 {
        self.quota
    }

    /// Number of spill files.
    pub fn file_count(&self) -> usize {
        self.files.len()
    }

    /// The spill directory, once known.
    pub fn dir_path(&self) -> Option<&Path> {
        match &self.dir {
            Dir::Lazy => None,
            Dir::Temp(t) => Some(t.path()),
            Dir::User(p) => Some(p),
        }
    }

    fn ensure_dir(&mut self) -> Result<PathBuf, TierError> {
        match &self.dir {
            Dir::Lazy => {
                let t = tempfile::Builder::new().prefix("wasmem-spill-").tempdir().map_err(|e| {
                    TierError::SpillDir { dir: std::env::temp_dir().display().to_string(), message: e.to_string() }
                })?;
                let p = t.path().to_path_buf();
                self.dir = Dir::Temp(t);
                Ok(p)
            }
            Dir::Temp(t) => Ok(t.path().to_path_buf()),
            Dir::User(p) => {
                fs::create_dir_all(p)
                    .map_err(|e| TierError::SpillDir { dir: p.display().to_string(), message: e.to_string() })?;
                Ok(p.clone())
            }
        }
    }

    /// Writes each buffer to a new spill file (in parallel on the I/O
    /// threads). A write that fails, or that would pass the quota, leaves no
    /// file; the others are kept.
    pub fn write_batch(&mut self, bufs: Vec<Arc<HostBuf>>) -> Vec<Result<SpillFile, TierError>> {
        let dir = match self.ensure_dir() {
            Ok(d) => d,
            Err(e) => return bufs.iter().map(|_| Err(e.clone())).collect(),
        };
        let mut jobs: Vec<IoJob<Result<SpillFile, TierError>>> = Vec::new();
        let mut planned = self.used;
        for buf in bufs {
            self.next += 1;
            let path = dir.join(format!("tensor-{}-{:06}.spill", std::process::id(), self.next));
            let len = buf.len() as u64;
            if planned.saturating_add(len) > self.quota {
                let (used, quota) = (planned, self.quota);
                jobs.push(Box::new(move || {
                    Err(TierError::QuotaExceeded { file: path.display().to_string(), bytes: len, used, quota })
                }));
                continue;
            }
            planned += len;
            jobs.push(Box::new(move || write_file(&path, &buf)));
        }
        let results = self.pool.run(jobs);
        for f in results.iter().flatten() {
            self.used += f.len;
            self.files.insert(f.path.clone(), f.len);
        }
        results
    }

    /// Reads spill files back (in parallel), checking length and checksum.
    pub fn read_batch(&self, files: &[SpillFile]) -> Vec<Result<Vec<u8>, TierError>> {
        let jobs: Vec<IoJob<Result<Vec<u8>, TierError>>> = files
            .iter()
            .map(|f| {
                let f = f.clone();
                Box::new(move || read_file(&f)) as IoJob<Result<Vec<u8>, TierError>>
            })
            .collect();
        self.pool.run(jobs)
    }

    /// Removes a spill file (a file already gone is not an error: it was ours).
    pub fn remove(&mut self, f: &SpillFile) -> Result<(), TierError> {
        if let Some(len) = self.files.remove(&f.path) {
            self.used -= len;
        }
        match fs::remove_file(&f.path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(TierError::SpillRemove { file: f.path.display().to_string(), message: e.to_string() }),
        }
    }

    /// Accounts `bytes` of a spill without contents (a device without
    /// contents: no file is written, the quota still applies). `what` names
    /// the tensor in the error.
    pub fn reserve(&mut self, bytes: u64, what: &str) -> Result<(), TierError> {
        if self.used.saturating_add(bytes) > self.quota {
            return Err(TierError::QuotaExceeded {
                file: format!("{what} (no contents: nothing written)"),
                bytes,
                used: self.used,
                quota: self.quota,
            });
        }
        self.used += bytes;
        Ok(())
    }

    /// Undoes [`DiskTier::reserve`].
    pub fn unreserve(&mut self, bytes: u64) {
        self.used -= bytes;
    }
}

impl Drop for DiskTier {
    fn drop(&mut self) {
        for p in self.files.keys() {
            if let Err(e) = fs::remove_file(p) {
                if e.kind() != std::io::ErrorKind::NotFound {
                    tracing::warn!(file = %p.display(), error = %e, "cannot remove spill file at shutdown");
                }
            }
        }
        // A `Dir::Temp` removes itself (and anything left in it) when dropped.
    }
}

fn write_file(path: &Path, data: &[u8]) -> Result<SpillFile, TierError> {
    let fail = |e: std::io::Error| TierError::SpillWrite { file: path.display().to_string(), message: e.to_string() };
    let res = (|| {
        let mut f = fs::OpenOptions::new().write(true).create_new(true).open(path)?;
        f.write_all(data)?;
        f.flush()
    })();
    if let Err(e) = res {
        let _ = fs::remove_file(path);
        return Err(fail(e));
    }
    Ok(SpillFile { path: path.to_path_buf(), len: data.len() as u64, crc: crc32fast::hash(data) })
}

fn read_file(f: &SpillFile) -> Result<Vec<u8>, TierError> {
    let file = f.path.display().to_string();
    let mut data = Vec::with_capacity(f.len as usize);
    fs::File::open(&f.path)
        .and_then(|mut h| h.read_to_end(&mut data))
        .map_err(|e| TierError::SpillRead { file: file.clone(), message: e.to_string() })?;
    if data.len() as u64 != f.len {
        return Err(TierError::Corrupt {
            file,
            reason: format!("{} bytes instead of the {} written", data.len(), f.len),
        });
    }
    let crc = crc32fast::hash(&data);
    if crc != f.crc {
        return Err(TierError::Corrupt {
            file,
            reason: format!("checksum {crc:08x} instead of {:08x} written", f.crc),
        });
    }
    Ok(data)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_write_read_remove_and_quota() {
        let dir = tempfile::tempdir().unwrap();
        let mut d = DiskTier::new(Some(dir.path().to_path_buf()), 10_000, 3);
        let bufs: Vec<Arc<HostBuf>> = (0..6u8).map(|k| Arc::new(HostBuf::from(vec![k; 1000 + k as usize]))).collect();
        let files: Vec<SpillFile> = d.write_batch(bufs.clone()).into_iter().map(Result::unwrap).collect();
        assert_eq!(d.used_bytes(), bufs.iter().map(|b| b.len() as u64).sum::<u64>());
        assert_eq!(d.file_count(), 6);
        for (f, b) in d.read_batch(&files).into_iter().zip(&bufs) {
            assert_eq!(&f.unwrap()[..], &b[..]);
        }
        // Past the quota: refused before writing, the others of the batch kept.
        let r = d.write_batch(vec![Arc::new(HostBuf::from(vec![1; 100])), Arc::new(HostBuf::from(vec![2; 5000]))]);
        assert!(r[0].is_ok());
        assert!(matches!(&r[1], Err(TierError::QuotaExceeded { bytes: 5000, .. })), "{:?}", r[1]);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 7);
        d.remove(&files[0]).unwrap();
        d.remove(&files[0]).unwrap(); // already gone: not an error
        assert_eq!(d.file_count(), 6);
        assert!(!files[0].path.exists());
        drop(d);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "files removed at drop");
    }
}
