//! Workloads: what a replay or a comparison runs on — a trace v1 file, a
//! PyTorch memory snapshot, or a synthesized preset — opened once.
//!
//! [`Workload::open`] decides the kind (a `.pickle`/`.pkl` file is a
//! snapshot, any other file a trace v1, `synth:` sources are presets),
//! parses a snapshot or synthesizes a preset once (the events are then
//! shared by every run), and checks that a trace file opens. A trace file is
//! streamed anew by each run ([`Workload::events`]), so a large trace is never
//! held in memory.

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use flate2::bufread::MultiGzDecoder;

use crate::model::{ModelError, ModelOverrides};
use crate::synth::synth;
use crate::trace::snapshot::{self, SnapshotError, SnapshotInfo};
use crate::trace::{Event, TraceError, TraceErrorKind, TraceReader};

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
    /// Streamed from the file by each run.
    Trace(PathBuf),
    /// Parsed or synthesized once, shared by every run.
    Events(Arc<Vec<Event>>),
}

/// An opened workload.
pub struct Workload {
    name: String,
    kind: Kind,
    pytorch: Option<SnapshotInfo>,
}

/// The events of one run of a workload.
pub type EventStream = Box<dyn Iterator<Item = Result<Event, TraceError>> + Send>;

impl Workload {
    /// Opens `source` (see the module documentation).
    pub fn open(source: &Source) -> Result<Workload, WorkloadError> {
        match source {
            Source::File(p) if p.as_os_str() == "-" => Self::from_stdin(),
            Source::File(p) if is_snapshot(p) => {
                let snap = snapshot::import_file(p, &snapshot::ImportOptions::default())?;
                Ok(Workload {
                    name: p.display().to_string(),
                    kind: Kind::Events(Arc::new(snap.events)),
                    pytorch: Some(snap.info),
                })
            }
            Source::File(p) => {
                TraceReader::open(p).map_err(|cause| WorkloadError::Trace { path: p.clone(), cause })?;
                Ok(Workload { name: p.display().to_string(), kind: Kind::Trace(p.clone()), pytorch: None })
            }
            Source::Synth(preset) => {
                let spec = ModelOverrides::default().apply(preset)?;
                Ok(Workload {
                    name: format!("synth:{preset}"),
                    kind: Kind::Events(Arc::new(synth(&spec)?)),
                    pytorch: None,
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
            });
        }
        let input: Box<dyn BufRead + Send> = if bytes.starts_with(&[0x1f, 0x8b]) {
            Box::new(BufReader::new(MultiGzDecoder::new(std::io::Cursor::new(bytes))))
        } else {
            Box::new(std::io::Cursor::new(bytes))
        };
        let trace = |cause| WorkloadError::Trace { path: PathBuf::from("-"), cause };
        let events = TraceReader::new(input, NAME).map_err(trace)?.collect::<Result<Vec<_>, _>>().map_err(trace)?;
        Ok(Workload { name: NAME.into(), kind: Kind::Events(Arc::new(events)), pytorch: None })
    }

    /// A workload of the events `events`, named `name`.
    pub fn from_events(name: &str, events: Vec<Event>) -> Workload {
        Workload { name: name.to_string(), kind: Kind::Events(Arc::new(events)), pytorch: None }
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
        let Kind::Trace(p) = &self.kind else { return None };
        let mut r = TraceReader::open(p).ok()?;
        for _ in 0..=index {
            r.next()?.ok()?;
        }
        Some(format!("{}:{}", p.display(), r.line()))
    }

    /// The events, from the start.
    pub fn events(&self) -> Result<EventStream, WorkloadError> {
        Ok(match &self.kind {
            Kind::Trace(p) => {
                Box::new(TraceReader::open(p).map_err(|cause| WorkloadError::Trace { path: p.clone(), cause })?)
            }
            Kind::Events(ev) => {
                let ev = ev.clone();
                Box::new((0..ev.len()).map(move |i| Ok(ev[i])))
            }
        })
    }
}

impl std::fmt::Debug for Workload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Workload").field("name", &self.name).field("snapshot", &self.pytorch.is_some()).finish()
    }
}
