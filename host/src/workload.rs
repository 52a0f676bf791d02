//! Workloads: what a replay or a comparison runs on — a trace v1 file, a
//! PyTorch memory snapshot, or a synthesized preset — opened once.
//!
//! [`Workload::open`] decides the kind (a `.pickle`/`.pkl` file is a
//! snapshot, any other file a trace v1, `synth:` sources are presets),
//! parses a snapshot or synthesizes a preset once (the events are then
//! shared by every run), and checks that a trace file opens. A trace file is
//! streamed anew by each run ([`Workload::events`]), so a large trace is never
//! held in memory; with a [`TraceCache`] (the default for files of at least
//! [`TraceCache::min_file_bytes`]) the first run writes its binary entry and
//! later runs read that instead of parsing. The file's content key is
//! computed once at open, and again only when the file's size or
//! modification time changed since.

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use flate2::bufread::MultiGzDecoder;

use crate::model::{ModelError, ModelOverrides};
use crate::synth::synth;
use crate::trace::cache::{CachedTrace, ContentKey, Origin, TraceCache};
use crate::trace::snapshot::{self, SnapshotError, SnapshotInfo};
use crate::trace::{Event, ReadAhead, ReadOptions, TraceError, TraceErrorKind, TraceReader};

/// Where a workload comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// A trace v1 file (`.jsonl`, `.jsonl.gz`) or a PyTorch snapshot (`.pickle`, `.pkl`).
    File(PathBuf),
    /// A synthesized training workload of this preset (see [`crate::model::ModelSpec::PRESETS`]).
    Synth(String),
}

/// Why a workload cannot be opened or read.
#[derive(Debug, thiserror::Error)]
pub enum WorkloadError {
    /// The trace file cannot be read.
    #[error("cannot read {}: {cause}", path.display())]
    Trace {
        /// The file.
        path: PathBuf,
        /// Why.
        cause: TraceError,
    },
    /// The snapshot cannot be imported.
    #[error(transparent)]
    Snapshot(#[from] SnapshotError),
    /// The preset is unknown or invalid.
    #[error(transparent)]
    Model(#[from] ModelError),
}

/// Whether `path` names a PyTorch snapshot (by its extension).
pub fn is_snapshot(path: &Path) -> bool {
    path.extension().is_some_and(|e| e == "pickle" || e == "pkl")
}

enum Kind {
    /// Streamed from the file by each run (through the cache when it applies).
    Trace(PathBuf, Option<Cached>),
    /// Parsed or synthesized once, shared by every run.
    Events(Arc<Vec<Event>>),
}

/// A trace file's cache and its content key as of its size and mtime.
struct Cached {
    cache: TraceCache,
    key: Mutex<(Stamp, ContentKey)>,
}

/// What tells that a file may have changed.
type Stamp = (u64, Option<SystemTime>);

fn stamp(path: &Path) -> std::io::Result<Stamp> {
    let m = std::fs::metadata(path)?;
    Ok((m.len(), m.modified().ok()))
}

/// How a [`Workload`] reads trace files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceOptions {
    /// The cache of parsed traces (`None`: parse every time). Default:
    /// [`TraceCache::from_env`].
    pub cache: Option<TraceCache>,
    /// Read (parse, or decode the cache entry) on a second thread, ahead of
    /// the replay ([`ReadAhead`]). Default: on.
    pub read_ahead: bool,
}

impl Default for TraceOptions {
    fn default() -> Self {
        TraceOptions { cache: TraceCache::from_env(), read_ahead: true }
    }
}

/// An opened workload.
pub struct Workload {
    name: String,
    kind: Kind,
    pytorch: Option<SnapshotInfo>,
    read_ahead: bool,
}

/// The events of one run of a workload.
pub type EventStream = Box<dyn Iterator<Item = Result<Event, TraceError>> + Send>;

impl Workload {
    /// Opens `source` (see the module documentation) with the default
    /// [`TraceOptions`].
    pub fn open(source: &Source) -> Result<Workload, WorkloadError> {
        Self::open_with(source, &TraceOptions::default())
    }

    /// Opens `source`, reading trace files as `opts` says.
    pub fn open_with(source: &Source, opts: &TraceOptions) -> Result<Workload, WorkloadError> {
        let cache = opts.cache.clone();
        let read_ahead = opts.read_ahead;
        match source {
            Source::File(p) if p.as_os_str() == "-" => Self::from_stdin(),
            Source::File(p) if is_snapshot(p) => {
                let snap = snapshot::import_file(p, &snapshot::ImportOptions::default())?;
                Ok(Workload {
                    name: p.display().to_string(),
                    kind: Kind::Events(Arc::new(snap.events)),
                    pytorch: Some(snap.info),
                    read_ahead,
                })
            }
            Source::File(p) => {
                let trace_err = |cause| WorkloadError::Trace { path: p.clone(), cause };
                TraceReader::open(p).map_err(trace_err)?;
                let read_err =
                    |e| trace_err(TraceError { file: p.display().to_string(), line: 0, kind: TraceErrorKind::Read(e) });
                let cached = match cache {
                    Some(cache) => {
                        let st = stamp(p).map_err(read_err)?;
                        if cache.applies_to(st.0) {
                            let key = ContentKey::of_file(p).map_err(read_err)?;
                            Some(Cached { cache, key: Mutex::new((st, key)) })
                        } else {
                            None
                        }
                    }
                    None => None,
                };
                Ok(Workload {
                    name: p.display().to_string(),
                    kind: Kind::Trace(p.clone(), cached),
                    pytorch: None,
                    read_ahead,
                })
            }
            Source::Synth(preset) => {
                let spec = ModelOverrides::default().apply(preset)?;
                Ok(Workload {
                    name: format!("synth:{preset}"),
                    kind: Kind::Events(Arc::new(synth(&spec)?)),
                    pytorch: None,
                    read_ahead,
                })
            }
        }
    }

    /// Standard input (`-`): a trace v1 (plain or gzip-compressed) or a
    /// PyTorch snapshot pickle, told apart by their first bytes; read once
    /// and kept in memory, since every run replays it.
    fn from_stdin() -> Result<Workload, WorkloadError> {
        const NAME: &str = "<stdin>";
        let mut bytes = Vec::new();
        std::io::stdin().lock().read_to_end(&mut bytes).map_err(|e| WorkloadError::Trace {
            path: PathBuf::from("-"),
            cause: TraceError::new(NAME, 0, TraceErrorKind::Read(e)),
        })?;
        // Pickles of protocol 2 and later start with PROTO (0x80).
        if bytes.first() == Some(&0x80) {
            let snap = snapshot::import_bytes(&bytes, NAME, &snapshot::ImportOptions::default())?;
            return Ok(Workload {
                name: NAME.into(),
                kind: Kind::Events(Arc::new(snap.events)),
                pytorch: Some(snap.info),
                read_ahead: false,
            });
        }
        let input: Box<dyn BufRead + Send> = if bytes.starts_with(&[0x1f, 0x8b]) {
            Box::new(BufReader::new(MultiGzDecoder::new(std::io::Cursor::new(bytes))))
        } else {
            Box::new(std::io::Cursor::new(bytes))
        };
        let trace = |cause| WorkloadError::Trace { path: PathBuf::from("-"), cause };
        let events = TraceReader::new(input, NAME).map_err(trace)?.collect::<Result<Vec<_>, _>>().map_err(trace)?;
        Ok(Workload { name: NAME.into(), kind: Kind::Events(Arc::new(events)), pytorch: None, read_ahead: false })
    }

    /// A workload of the events `events`, named `name`.
    pub fn from_events(name: &str, events: Vec<Event>) -> Workload {
        Workload { name: name.to_string(), kind: Kind::Events(Arc::new(events)), pytorch: None, read_ahead: false }
    }

    /// The name reports use (the path, or `synth:PRESET`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// PyTorch's own figures, for a snapshot.
    pub fn pytorch(&self) -> Option<&SnapshotInfo> {
        self.pytorch.as_ref()
    }

    /// Where event `index` (0-based) comes from, as `FILE:LINE`, for a trace
    /// file (it is read again up to that event; `None` for other workloads
    /// or when the file changed).
    pub fn locate(&self, index: u64) -> Option<String> {
        let Kind::Trace(p, _) = &self.kind else { return None };
        let mut r = TraceReader::open(p).ok()?;
        for _ in 0..=index {
            r.next()?.ok()?;
        }
        Some(format!("{}:{}", p.display(), r.line()))
    }

    /// The events, from the start. Trace files are read on a second thread
    /// ([`TraceOptions::read_ahead`]) unless that thread cannot start.
    pub fn events(&self) -> Result<EventStream, WorkloadError> {
        let stream = self.open_stream()?;
        if !self.read_ahead || matches!(self.kind, Kind::Events(_)) {
            return Ok(stream);
        }
        match ReadAhead::spawn(stream) {
            Ok(r) => Ok(Box::new(r)),
            Err(e) => {
                tracing::warn!(error = %e, "cannot start a thread to read the trace ahead; reading it inline");
                self.open_stream()
            }
        }
    }

    /// The events on the calling thread.
    fn open_stream(&self) -> Result<EventStream, WorkloadError> {
        Ok(match &self.kind {
            Kind::Trace(p, None) => {
                Box::new(TraceReader::open(p).map_err(|cause| WorkloadError::Trace { path: p.clone(), cause })?)
            }
            Kind::Trace(p, Some(c)) => Box::new(self.cached_events(p, c)?),
            Kind::Events(ev) => {
                let ev = ev.clone();
                Box::new((0..ev.len()).map(move |i| Ok(ev[i])))
            }
        })
    }

    /// For a cached trace file: writes its cache entry now unless a valid
    /// one exists (reading the whole trace once), so that runs started
    /// together afterwards all read the entry. Returns where the events came
    /// from, `None` for workloads the cache does not apply to.
    pub fn fill_cache(&self) -> Result<Option<Origin>, WorkloadError> {
        let Kind::Trace(p, Some(c)) = &self.kind else { return Ok(None) };
        let mut events = self.cached_events(p, c)?;
        if !matches!(events.origin(), Origin::Hit) {
            for e in &mut events {
                e.map_err(|cause| WorkloadError::Trace { path: p.clone(), cause })?;
            }
        }
        Ok(Some(events.into_origin()))
    }

    fn cached_events(&self, p: &Path, c: &Cached) -> Result<CachedTrace, WorkloadError> {
        let trace_err = |cause| WorkloadError::Trace { path: p.to_path_buf(), cause };
        let read_err =
            |e| trace_err(TraceError { file: p.display().to_string(), line: 0, kind: TraceErrorKind::Read(e) });
        let key = {
            let mut k = c.key.lock().unwrap_or_else(|e| e.into_inner());
            let now = stamp(p).map_err(read_err)?;
            if now != k.0 {
                *k = (now, ContentKey::of_file(p).map_err(read_err)?);
            }
            k.1
        };
        c.cache.open(p, &key, ReadOptions::default()).map_err(trace_err)
    }
}

impl std::fmt::Debug for Workload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Workload").field("name", &self.name).field("snapshot", &self.pytorch.is_some()).finish()
    }
}
