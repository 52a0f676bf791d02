//! PyTorch memory snapshots (`torch.cuda.memory._dump_snapshot` pickles).
//!
//! [`import_file`] / [`import_bytes`] turn a snapshot into the same
//! [`Event`] stream as a v1 trace, plus [`SnapshotInfo`]: PyTorch's own
//! figures (reserved bytes at the end and at the peak) to show beside a
//! replay. [`export`] writes a replay result back into the snapshot shape so
//! that PyTorch's memory visualizer can draw it.
//!
//! ## The snapshot shape (what is read)
//!
//! ```text
//! { "segments": [ { "device", "address", "total_size", "stream",
//!                   "blocks": [ { "address", "size", "requested_size", "state" } ] } ],
//!   "device_traces": [ [ { "action", "addr", "size", "stream", "time_us", "frames" } ] ],
//!   "allocator_settings": …, … }
//! ```
//!
//! Other keys are ignored. Older files are accepted too: a top-level list of
//! segments (no trace), blocks without `address` (placed one after the other
//! from the segment's address) or without `requested_size`.
//!
//! ## From trace entries to events
//!
//! - `alloc` → [`Event::Alloc`] of `size` bytes (PyTorch records the
//!   requested size) on the entry's stream; `free_completed` → [`Event::Free`].
//!   `free_requested` does not end a block's life (the memory is not reusable
//!   before `free_completed`); `segment_*` entries feed
//!   [`SnapshotInfo::pytorch_peak_reserved_bytes`]; other actions (`oom`,
//!   `snapshot`, …) are skipped and counted.
//! - Addresses are mapped to fresh ids (an address is reused after a free),
//!   numbered from 1 in order of appearance.
//! - The recorded window usually starts after the run began. A block freed in
//!   the window without an `alloc` in it, and a block active in the final
//!   `segments` without an `alloc` in the window, were live before the window:
//!   both become an `Alloc` at the start of the stream (first the former, in
//!   the order of their frees, then the latter, by address), without `t_us`.
//! - An `alloc` at an address that is still live (the trace lost the free)
//!   first frees the old id; [`SnapshotInfo::anomalies`] counts these.
//! - Kinds are [`TensorKind::Other`] unless the entry's (or block's) first
//!   stack frame is a `wasmem kind=<kind>` marker, which [`export`] writes.
//! - Streams: PyTorch records CUDA stream handles. When they all fit in `u32`
//!   they are kept; otherwise each distinct value is numbered (0 stays 0) in
//!   order of first appearance. [`SnapshotInfo::streams`] lists the mapping.
//!
//! ## Limits
//!
//! The pickle reader never executes code and never copies shared values;
//! memory and time are linear in the input, capped by [`ImportLimits`]:
//! everything the import holds (the reader's arena, stack and memo, the
//! records and events built from them) is charged to one budget of
//! `memory_per_input_byte × input bytes + memory_base_bytes` before it
//! grows, and reaching it is an error naming the limit and where
//! ([`SnapshotErrorKind::MemoryLimit`]); [`SnapshotInfo::accounted_peak_bytes`]
//! says what an import held. The reader keeps nothing of the parts of a
//! snapshot the import never reads (other keys at every level, frames after
//! the first); when its guess of those parts is wrong for an unusual file,
//! the import notices and parses again keeping everything, so the result
//! never depends on it.
//!
//! Measured (accounted peak per input byte, `tests/snapshot_memory.rs`):
//! the two shared real snapshots 5.4 and 2.6 (the heap held 3.7 and 1.7);
//! the hostile 20 MB inputs, 10 M empty lists and 10 M nested lists under an
//! unused key, 0.01 and 6.7 (see `docs/measurements.md`).

mod budget;
pub mod export;
mod pickle;

use std::fmt;
use std::fs::File;
use std::io::Read;
use std::path::Path;

use rustc_hash::{FxHashMap, FxHashSet};

use self::budget::{Budget, Exceeded};
use self::pickle::{Pickle, PickleError, Val};
use super::{Event, TraceHeader};
use crate::types::TensorKind;

/// Prefix of the stack-frame name that carries a tensor kind (see [`export`]).
pub const KIND_FRAME_PREFIX: &str = "wasmem kind=";

/// Resource caps of the importer: a hostile or corrupt file gets a clear
/// error instead of exhausting memory or time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImportLimits {
    /// Largest accepted pickle in bytes (default 1 GiB).
    pub max_input_bytes: u64,
    /// Most values (objects, stack slots, marks, memo entries) the pickle
    /// may create (default 128 Mi); a real snapshot creates about one value
    /// per 3 bytes of pickle.
    pub max_values: usize,
    /// Most dict items and list elements the walk over the snapshot may
    /// visit (default 1 Gi); shared values are counted once per visit.
    pub max_walk_steps: u64,
    /// Accounted bytes the import may hold per byte of input (default 8).
    pub memory_per_input_byte: u64,
    /// Accounted bytes the import may hold whatever the input size (default
    /// 64 MiB).
    pub memory_base_bytes: u64,
}

impl Default for ImportLimits {
    fn default() -> Self {
        ImportLimits {
            max_input_bytes: 1 << 30,
            max_values: 128 << 20,
            max_walk_steps: 1 << 30,
            memory_per_input_byte: 8,
            memory_base_bytes: 64 << 20,
        }
    }
}

impl ImportLimits {
    /// The memory budget of an import of `input_len` bytes:
    /// `memory_per_input_byte × input_len + memory_base_bytes`.
    pub fn memory_limit(&self, input_len: usize) -> u64 {
        self.memory_per_input_byte.saturating_mul(input_len as u64).saturating_add(self.memory_base_bytes)
    }
}

/// Settings of an import.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ImportOptions {
    /// The CUDA device whose segments and trace are imported (default 0).
    pub device: u32,
    /// Resource caps.
    pub limits: ImportLimits,
}

/// PyTorch's own figures and counts from a snapshot, to show beside a replay.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SnapshotInfo {
    /// The device imported.
    pub device: u32,
    /// Segments of the device in the final state.
    pub segments: usize,
    /// Trace entries of the device (all actions).
    pub entries: usize,
    /// Σ `total_size` of the device's final segments: what PyTorch's caching
    /// allocator had reserved when the snapshot was taken.
    pub pytorch_reserved_bytes_end: u64,
    /// Best-effort peak of reserved bytes over the recorded window: the
    /// `segment_alloc`/`segment_map` (+size) and `segment_free`/
    /// `segment_unmap` (−size) entries are replayed from a start value of
    /// `end − Σ changes` (clamped at 0 when a lost entry makes it negative).
    /// Without segment entries in the trace this equals the end value, a
    /// lower bound of the true peak.
    pub pytorch_peak_reserved_bytes: u64,
    /// Σ `size` of the blocks active in the final state.
    pub pytorch_allocated_bytes_end: u64,
    /// `Alloc` events made up at the start for blocks live before the window.
    pub synthesized_allocs: usize,
    /// Trace entries with actions that produce no event (`free_requested`,
    /// `segment_*`, `oom`, `snapshot`, unknown ones).
    pub skipped_entries: usize,
    /// `alloc`s at an address that was still live (lost `free_completed`):
    /// the earlier block is taken as freed there.
    pub anomalies: usize,
    /// Trace entries with an action this importer does not know, by action
    /// (they are ignored, with a warning).
    pub unknown_actions: std::collections::BTreeMap<String, usize>,
    /// Stream mapping: (PyTorch stream value, stream in the events).
    pub streams: Vec<(u64, u32)>,
    /// The most accounted bytes the import held at once (see
    /// [`ImportLimits::memory_limit`]).
    pub accounted_peak_bytes: u64,
}

/// An imported snapshot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    /// Header for writing the events as a v1 trace.
    pub header: TraceHeader,
    /// The event stream (valid: ids unique, frees of live ids).
    pub events: Vec<Event>,
    /// PyTorch's figures and import counts.
    pub info: SnapshotInfo,
}

/// A snapshot that cannot be imported, with the file it concerns.
#[derive(Debug, thiserror::Error)]
pub struct SnapshotError {
    /// The file (or the name given to [`import_bytes`]).
    pub file: String,
    /// What went wrong.
    pub kind: SnapshotErrorKind,
}

impl fmt::Display for SnapshotError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.file, self.kind)
    }
}

/// What went wrong in a [`SnapshotError`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SnapshotErrorKind {
    /// The file cannot be read.
    #[error("read error: {0}")]
    Read(#[source] std::io::Error),
    /// The file is larger than [`ImportLimits::max_input_bytes`].
    #[error("the file is larger than {limit} bytes (raise ImportLimits::max_input_bytes)")]
    TooLarge {
        /// The limit.
        limit: u64,
    },
    /// The bytes are not a valid pickle.
    #[error("malformed pickle at byte {offset}: {message}")]
    Pickle {
        /// Offset of the offending opcode.
        offset: usize,
        /// What is wrong.
        message: String,
    },
    /// The pickle creates more values than [`ImportLimits::max_values`].
    #[error("the pickle holds more than {limit} values (raise ImportLimits::max_values)")]
    TooManyValues {
        /// The limit.
        limit: usize,
    },
    /// The import would hold more accounted bytes than
    /// [`ImportLimits::memory_limit`] allows.
    #[error(
        "the import needs more than {limit} bytes of memory ({}; the limit is {per_byte} bytes per input byte \
         + {base} bytes: raise ImportLimits::memory_per_input_byte or ImportLimits::memory_base_bytes)",
        offset.map_or_else(|| "building the records and events".to_owned(), |o| format!("at byte {o} of the pickle"))
    )]
    MemoryLimit {
        /// The limit in bytes.
        limit: u64,
        /// Offset of the opcode being read when it was reached (`None`:
        /// while building the records and events).
        offset: Option<usize>,
        /// [`ImportLimits::memory_per_input_byte`].
        per_byte: u64,
        /// [`ImportLimits::memory_base_bytes`].
        base: u64,
    },
    /// The walk visited more than [`ImportLimits::max_walk_steps`] items.
    #[error("the snapshot has more than {limit} items to visit (raise ImportLimits::max_walk_steps)")]
    TooManySteps {
        /// The limit.
        limit: u64,
    },
    /// The pickle is not shaped like a snapshot.
    #[error("not a PyTorch memory snapshot: {0}")]
    NotASnapshot(String),
    /// A value has the wrong type.
    #[error("`{path}` should be {expected}, found {found}")]
    Shape {
        /// Where, e.g. `segments[3].blocks[0].size`.
        path: String,
        /// What was expected.
        expected: &'static str,
        /// What was found: its Python type (an object's class when the
        /// pickle names it).
        found: String,
    },
    /// A required key is absent.
    #[error("`{path}` is missing key `{key}`")]
    MissingKey {
        /// The dict, e.g. `device_traces[0][17]`.
        path: String,
        /// The key.
        key: &'static str,
    },
    /// The requested device has no segments and no trace.
    #[error("device {device} is not in the snapshot (devices present: {present})")]
    NoSuchDevice {
        /// The device asked for.
        device: u32,
        /// The devices found, comma-separated (or `none`).
        present: String,
    },
}

/// Imports a snapshot file.
pub fn import_file(path: impl AsRef<Path>, opts: &ImportOptions) -> Result<Snapshot, SnapshotError> {
    let path = path.as_ref();
    let name = path.display().to_string();
    let err = |kind| SnapshotError { file: name.clone(), kind };
    let file = File::open(path).map_err(|e| err(SnapshotErrorKind::Read(e)))?;
    let limit = opts.limits.max_input_bytes;
    let len = file.metadata().map(|m| m.len()).unwrap_or(0);
    if len > limit {
        return Err(err(SnapshotErrorKind::TooLarge { limit }));
    }
    let mut bytes = Vec::with_capacity(len as usize);
    file.take(limit.saturating_add(1)).read_to_end(&mut bytes).map_err(|e| err(SnapshotErrorKind::Read(e)))?;
    let file_name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| name.clone());
    import_named(&bytes, &name, &file_name, opts)
}

/// Imports a snapshot from memory; `name` labels it in errors and in the
/// header's `source`.
pub fn import_bytes(bytes: &[u8], name: &str, opts: &ImportOptions) -> Result<Snapshot, SnapshotError> {
    import_named(bytes, name, name, opts)
}

fn import_named(bytes: &[u8], name: &str, short_name: &str, opts: &ImportOptions) -> Result<Snapshot, SnapshotError> {
    let err = |kind| SnapshotError { file: name.to_owned(), kind };
    if bytes.len() as u64 > opts.limits.max_input_bytes {
        return Err(err(SnapshotErrorKind::TooLarge { limit: opts.limits.max_input_bytes }));
    }
    // First keeping only what the walk reads; again keeping everything if
    // the walk met something the first parse did not keep (whether it then
    // succeeded or failed: a failure may come from what was not kept).
    let lean = pass(bytes, &opts.limits, opts.device, false);
    let mut peak = lean.peak;
    let done = if lean.touched_skipped {
        let full = pass(bytes, &opts.limits, opts.device, true);
        peak = peak.max(full.peak);
        full
    } else {
        lean
    };
    let raw = done.raw.map_err(err)?;
    let (events, mut info) = build_events(&raw);
    info.accounted_peak_bytes = peak;
    info.unknown_actions = raw.unknown.clone();
    if !info.unknown_actions.is_empty() {
        let list: Vec<String> = info.unknown_actions.iter().map(|(a, n)| format!("`{a}` ×{n}")).collect();
        tracing::warn!(file = %name, "snapshot entries with unknown actions ignored: {}", list.join(", "));
    }
    if info.anomalies > 0 {
        tracing::warn!(
            file = %name,
            count = info.anomalies,
            "snapshot `alloc` entries at an address still live (a lost `free_completed`): the earlier block is taken as freed there"
        );
    }
    info.device = opts.device;
    Ok(Snapshot {
        header: TraceHeader {
            source: format!(
                "PyTorch memory snapshot {short_name}, device {}: {} segments, {} trace entries",
                opts.device, info.segments, info.entries
            ),
            ranks: 1,
        },
        events,
        info,
    })
}

/// One parse and walk of a snapshot.
struct Pass {
    raw: Result<RawSnapshot, SnapshotErrorKind>,
    /// Whether the walk met a container the parse did not keep.
    touched_skipped: bool,
    /// The most accounted bytes held at once.
    peak: u64,
}

/// Parses `bytes` (keeping everything, or only what the walk reads) and walks
/// the snapshot of `device`, under one budget of
/// [`ImportLimits::memory_limit`].
fn pass(bytes: &[u8], limits: &ImportLimits, device: u32, keep_all: bool) -> Pass {
    let mut budget = Budget::new(limits.memory_limit(bytes.len()));
    let parsed = pickle::parse(bytes, limits.max_values, &mut budget, keep_all).map_err(|e| match e {
        PickleError::At { offset, message } => SnapshotErrorKind::Pickle { offset, message },
        PickleError::TooManyValues(limit) => SnapshotErrorKind::TooManyValues { limit },
        PickleError::MemoryLimit { limit, offset } => SnapshotErrorKind::MemoryLimit {
            limit,
            offset: Some(offset),
            per_byte: limits.memory_per_input_byte,
            base: limits.memory_base_bytes,
        },
    });
    let (raw, touched_skipped) = match parsed {
        Err(e) => (Err(e), false),
        Ok(pk) => {
            let mut walk = Walk {
                p: &pk,
                steps: 0,
                max_steps: limits.max_walk_steps,
                budget: &mut budget,
                limits: *limits,
                unknown: Default::default(),
            };
            let raw = walk.snapshot(device).and_then(|raw| {
                // The events and the maps that build them, at most.
                let n = raw.entries.len() + raw.segments.iter().map(|s| s.blocks.len()).sum::<usize>();
                walk.charge(n.saturating_mul(EVENT_BUILD_BYTES))?;
                Ok(raw)
            });
            (raw, pk.touched_skipped())
        }
    };
    Pass { raw, touched_skipped, peak: budget.peak() }
}

// ---------------------------------------------------------------------------
// Walking the pickle into plain records
// ---------------------------------------------------------------------------

/// A block of the final state.
#[derive(Debug, Clone)]
struct RawBlock {
    address: u64,
    size: u64,
    requested: u64,
    active: bool,
    kind: Option<TensorKind>,
}

/// A segment of the final state.
#[derive(Debug, Clone)]
struct RawSegment {
    total_size: u64,
    stream: u64,
    blocks: Vec<RawBlock>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Action {
    Alloc,
    FreeCompleted,
    SegmentGrow,
    SegmentShrink,
    /// An action PyTorch records that produces no event.
    Other,
    /// An action this importer does not know (counted by name, ignored).
    Unknown,
}

/// Actions PyTorch records that the importer reads but turns into no event.
const SKIPPED_ACTIONS: [&str; 3] = ["free_requested", "oom", "snapshot"];

/// One trace entry.
#[derive(Debug, Clone)]
struct RawEntry {
    action: Action,
    addr: u64,
    size: u64,
    stream: u64,
    time_us: Option<u64>,
    kind: Option<TensorKind>,
}

struct RawSnapshot {
    segments: Vec<RawSegment>,
    entries: Vec<RawEntry>,
    /// Unknown actions by name (sanitized), with their counts.
    unknown: std::collections::BTreeMap<String, usize>,
}

type WalkResult<T> = Result<T, SnapshotErrorKind>;

struct Walk<'p, 'a, 'b> {
    p: &'p Pickle<'a>,
    steps: u64,
    max_steps: u64,
    /// Charged for the records the walk builds.
    budget: &'b mut Budget,
    limits: ImportLimits,
    /// Unknown actions by name (sanitized), with their counts.
    unknown: std::collections::BTreeMap<String, usize>,
}

/// Bytes charged per trace entry or block for building the events: the
/// events (at most two per record), the id and liveness maps.
const EVENT_BUILD_BYTES: usize = 2 * std::mem::size_of::<Event>() + 48;

impl<'p, 'a> Walk<'p, 'a, '_> {
    /// Charges `bytes` more.
    fn charge(&mut self, bytes: usize) -> WalkResult<()> {
        self.budget.charge(bytes as u64).map_err(|Exceeded| SnapshotErrorKind::MemoryLimit {
            limit: self.budget.limit(),
            offset: None,
            per_byte: self.limits.memory_per_input_byte,
            base: self.limits.memory_base_bytes,
        })
    }

    /// Pushes onto a vector of records, charging the element and the
    /// vector's doubling slack.
    fn keep<T>(&mut self, v: &mut Vec<T>, x: T) -> WalkResult<()> {
        self.charge(2 * std::mem::size_of::<T>())?;
        v.push(x);
        Ok(())
    }

    fn step(&mut self, n: usize) -> WalkResult<()> {
        self.steps = self.steps.saturating_add(n as u64);
        if self.steps > self.max_steps {
            return Err(SnapshotErrorKind::TooManySteps { limit: self.max_steps });
        }
        Ok(())
    }

    fn shape<T>(&self, path: impl Fn() -> String, expected: &'static str, v: Val) -> WalkResult<T> {
        Err(SnapshotErrorKind::Shape { path: path(), expected, found: self.p.type_name(v).into_owned() })
    }

    fn dict(&mut self, v: Val, path: impl Fn() -> String) -> WalkResult<&'p [(Val, Val)]> {
        match self.p.as_dict(v) {
            Some(d) => Ok(d),
            None => self.shape(path, "a dict", v),
        }
    }

    fn list(&mut self, v: Val, path: impl Fn() -> String) -> WalkResult<&'p [Val]> {
        match self.p.as_list(v) {
            Some(l) => {
                self.step(l.len())?;
                Ok(l)
            }
            None => self.shape(path, "a list", v),
        }
    }

    /// The value under a string key (the last one wins, as in Python).
    fn get(&mut self, d: &'p [(Val, Val)], key: &str) -> WalkResult<Option<Val>> {
        self.step(d.len())?;
        Ok(d.iter().rev().find(|(k, _)| self.p.as_str(*k) == Some(key)).map(|&(_, v)| v))
    }

    /// An optional non-negative integer (`None` also for Python's `None`).
    fn opt_u64(
        &mut self,
        d: &'p [(Val, Val)],
        key: &'static str,
        path: impl Fn() -> String,
    ) -> WalkResult<Option<u64>> {
        match self.get(d, key)? {
            None | Some(Val::NONE) => Ok(None),
            Some(v) => match self.p.as_int(v).and_then(|i| u64::try_from(i).ok()) {
                Some(u) => Ok(Some(u)),
                None => self.shape(|| format!("{}.{key}", path()), "a non-negative integer below 2**63", v),
            },
        }
    }

    fn req_u64(&mut self, d: &'p [(Val, Val)], key: &'static str, path: impl Fn() -> String) -> WalkResult<u64> {
        match self.opt_u64(d, key, &path)? {
            Some(u) => Ok(u),
            None => Err(SnapshotErrorKind::MissingKey { path: path(), key }),
        }
    }

    fn opt_str(
        &mut self,
        d: &'p [(Val, Val)],
        key: &'static str,
        path: impl Fn() -> String,
    ) -> WalkResult<Option<&'p str>> {
        match self.get(d, key)? {
            None | Some(Val::NONE) => Ok(None),
            Some(v) => match self.p.as_str(v) {
                Some(s) => Ok(Some(s)),
                None => self.shape(|| format!("{}.{key}", path()), "a str", v),
            },
        }
    }

    /// The kind marker in the first frame of `frames`, if any (tolerant:
    /// anything unexpected just means "no marker").
    fn kind_marker(&mut self, d: &'p [(Val, Val)]) -> WalkResult<Option<TensorKind>> {
        let Some(frames) = self.get(d, "frames")? else {
            return Ok(None);
        };
        let Some(first) = self.p.first_item(frames) else {
            return Ok(None);
        };
        let Some(frame) = self.p.as_dict(first) else {
            return Ok(None);
        };
        let name = self.get(frame, "name")?.and_then(|v| self.p.as_str(v));
        Ok(name.and_then(|n| n.strip_prefix(KIND_FRAME_PREFIX)).and_then(|k| k.parse().ok()))
    }

    fn snapshot(&mut self, device: u32) -> WalkResult<RawSnapshot> {
        let root = self.p.root;
        let (segments_val, traces_val) = if let Some(top) = self.p.as_dict(root) {
            let segments = self.get(top, "segments")?;
            let traces = self.get(top, "device_traces")?;
            if segments.is_none() && traces.is_none() {
                return Err(SnapshotErrorKind::NotASnapshot(
                    "the top-level dict has neither `segments` nor `device_traces`".into(),
                ));
            }
            (segments, traces)
        } else if self.p.as_list(root).is_some() {
            // Very old format: the list of segments alone.
            (Some(root), None)
        } else {
            return Err(SnapshotErrorKind::NotASnapshot(format!(
                "the top level should be a dict, found {}",
                self.p.type_name(root)
            )));
        };

        let mut present = std::collections::BTreeSet::new();
        let mut segments = Vec::new();
        if let Some(sv) = segments_val {
            for (i, &s) in self.list(sv, || "segments".into())?.iter().enumerate() {
                let path = || format!("segments[{i}]");
                let sd = self.dict(s, path)?;
                let dev = self.opt_u64(sd, "device", path)?.unwrap_or(0);
                present.insert(dev);
                if dev != u64::from(device) {
                    continue;
                }
                let seg = self.segment(sd, i)?;
                self.keep(&mut segments, seg)?;
            }
        }

        let mut entries = Vec::new();
        if let Some(tv) = traces_val {
            let traces = self.list(tv, || "device_traces".into())?;
            for (d, &t) in traces.iter().enumerate() {
                if self.p.as_list(t).is_some_and(|l| !l.is_empty()) {
                    present.insert(d as u64);
                }
            }
            if let Some(&t) = traces.get(device as usize) {
                let list = self.list(t, || format!("device_traces[{device}]"))?;
                self.charge(list.len() * std::mem::size_of::<RawEntry>())?;
                entries.reserve_exact(list.len());
                for (j, &e) in list.iter().enumerate() {
                    entries.push(self.entry(e, device, j)?);
                }
            }
        }

        if segments.is_empty() && entries.is_empty() && !present.is_empty() && !present.contains(&u64::from(device)) {
            let list: Vec<String> = present.iter().map(u64::to_string).collect();
            return Err(SnapshotErrorKind::NoSuchDevice { device, present: list.join(", ") });
        }
        Ok(RawSnapshot { segments, entries, unknown: std::mem::take(&mut self.unknown) })
    }

    fn segment(&mut self, sd: &'p [(Val, Val)], i: usize) -> WalkResult<RawSegment> {
        let path = || format!("segments[{i}]");
        let address = self.req_u64(sd, "address", path)?;
        let total_size = self.req_u64(sd, "total_size", path)?;
        let stream = self.opt_u64(sd, "stream", path)?.unwrap_or(0);
        let mut blocks = Vec::new();
        if let Some(bv) = self.get(sd, "blocks")? {
            let list = self.list(bv, || format!("segments[{i}].blocks"))?;
            let mut offset = address;
            for (k, &b) in list.iter().enumerate() {
                let path = || format!("segments[{i}].blocks[{k}]");
                let bd = self.dict(b, path)?;
                let size = self.req_u64(bd, "size", path)?;
                let baddr = self.opt_u64(bd, "address", path)?.unwrap_or(offset);
                offset = baddr.saturating_add(size);
                let requested = self.opt_u64(bd, "requested_size", path)?.filter(|&r| r > 0).unwrap_or(size);
                let state = self.opt_str(bd, "state", path)?.unwrap_or("inactive");
                let active = state.starts_with("active");
                let kind = if active { self.kind_marker(bd)? } else { None };
                self.keep(&mut blocks, RawBlock { address: baddr, size, requested, active, kind })?;
            }
        }
        Ok(RawSegment { total_size, stream, blocks })
    }

    fn entry(&mut self, e: Val, device: u32, j: usize) -> WalkResult<RawEntry> {
        let path = || format!("device_traces[{device}][{j}]");
        let ed = self.dict(e, path)?;
        let action_name = match self.opt_str(ed, "action", path)? {
            Some(a) => a,
            None => return Err(SnapshotErrorKind::MissingKey { path: path(), key: "action" }),
        };
        let action = match action_name {
            "alloc" => Action::Alloc,
            "free_completed" => Action::FreeCompleted,
            "segment_alloc" | "segment_map" => Action::SegmentGrow,
            "segment_free" | "segment_unmap" => Action::SegmentShrink,
            a if SKIPPED_ACTIONS.contains(&a) => Action::Other,
            a => {
                let name = crate::text::name(a);
                if !self.unknown.contains_key(&name) {
                    // The name and a map node.
                    self.charge(name.len() + 64)?;
                }
                *self.unknown.entry(name).or_default() += 1;
                Action::Unknown
            }
        };
        if matches!(action, Action::Other | Action::Unknown) {
            return Ok(RawEntry { action, addr: 0, size: 0, stream: 0, time_us: None, kind: None });
        }
        let addr = self.req_u64(ed, "addr", path)?;
        let size = self.req_u64(ed, "size", path)?;
        let stream = self.opt_u64(ed, "stream", path)?.unwrap_or(0);
        let time_us = self.opt_u64(ed, "time_us", path)?;
        let kind = if action == Action::Alloc { self.kind_marker(ed)? } else { None };
        Ok(RawEntry { action, addr, size, stream, time_us, kind })
    }
}

// ---------------------------------------------------------------------------
// From records to events
// ---------------------------------------------------------------------------

/// Maps PyTorch stream values to `u32` stream numbers.
fn stream_map(raw: &RawSnapshot) -> FxHashMap<u64, u32> {
    let seen = raw
        .entries
        .iter()
        .filter(|e| e.action != Action::Other)
        .map(|e| e.stream)
        .chain(raw.segments.iter().map(|s| s.stream));
    let mut map = FxHashMap::default();
    let all_fit = seen.clone().all(|s| s <= u64::from(u32::MAX));
    let mut next = 1u32;
    for s in seen {
        map.entry(s).or_insert_with(|| {
            if all_fit {
                s as u32
            } else if s == 0 {
                0
            } else {
                let n = next;
                next = next.saturating_add(1);
                n
            }
        });
    }
    map
}

fn build_events(raw: &RawSnapshot) -> (Vec<Event>, SnapshotInfo) {
    let streams = stream_map(raw);
    let stream_of = |s: u64| streams.get(&s).copied().unwrap_or(0);
    let mut info = SnapshotInfo { segments: raw.segments.len(), entries: raw.entries.len(), ..SnapshotInfo::default() };

    // PyTorch's reserved bytes: final value, and the peak replayed backwards.
    let end: u128 = raw.segments.iter().map(|s| u128::from(s.total_size)).sum();
    let mut delta: i128 = 0;
    for e in &raw.entries {
        match e.action {
            Action::SegmentGrow => delta += i128::from(e.size),
            Action::SegmentShrink => delta -= i128::from(e.size),
            _ => {}
        }
    }
    let mut reserved = (end as i128 - delta).max(0);
    let mut peak = reserved.max(end as i128);
    for e in &raw.entries {
        match e.action {
            Action::SegmentGrow => reserved += i128::from(e.size),
            Action::SegmentShrink => reserved -= i128::from(e.size),
            _ => {}
        }
        peak = peak.max(reserved);
    }
    info.pytorch_reserved_bytes_end = u64::try_from(end).unwrap_or(u64::MAX);
    info.pytorch_peak_reserved_bytes = u64::try_from(peak).unwrap_or(u64::MAX);
    info.pytorch_allocated_bytes_end = raw
        .segments
        .iter()
        .flat_map(|s| &s.blocks)
        .filter(|b| b.active)
        .fold(0u64, |acc, b| acc.saturating_add(b.size));

    // Pass 1: which frees have no alloc in the window, what is live at the end.
    let mut live: FxHashSet<u64> = FxHashSet::default();
    let mut pre_frees: Vec<usize> = Vec::new();
    for (i, e) in raw.entries.iter().enumerate() {
        match e.action {
            Action::Alloc => {
                live.insert(e.addr);
            }
            Action::FreeCompleted if !live.remove(&e.addr) => pre_frees.push(i),
            _ => {}
        }
    }
    let mut end_only: Vec<(&RawBlock, u64)> = raw
        .segments
        .iter()
        .flat_map(|s| s.blocks.iter().map(move |b| (b, s.stream)))
        .filter(|(b, _)| b.active && !live.contains(&b.address))
        .collect();
    end_only.sort_by_key(|(b, _)| b.address);

    // Pass 2: emit.
    let mut events = Vec::with_capacity(raw.entries.len() / 2 + pre_frees.len() + end_only.len());
    let mut next_id = 1u64;
    let mut fresh = || {
        let id = next_id;
        next_id += 1;
        id
    };
    let mut pre_ids = Vec::with_capacity(pre_frees.len());
    for &i in &pre_frees {
        let e = &raw.entries[i];
        let id = fresh();
        pre_ids.push(id);
        events.push(Event::Alloc {
            id,
            bytes: e.size,
            kind: e.kind.unwrap_or(TensorKind::Other),
            stream: stream_of(e.stream),
            t_us: None,
        });
    }
    for (b, stream) in &end_only {
        events.push(Event::Alloc {
            id: fresh(),
            bytes: b.requested,
            kind: b.kind.unwrap_or(TensorKind::Other),
            stream: stream_of(*stream),
            t_us: None,
        });
    }
    info.synthesized_allocs = pre_frees.len() + end_only.len();

    let mut ids: FxHashMap<u64, u64> = FxHashMap::default();
    let mut pre = pre_ids.into_iter();
    for e in &raw.entries {
        match e.action {
            Action::Alloc => {
                let id = fresh();
                if let Some(old) = ids.insert(e.addr, id) {
                    info.anomalies += 1;
                    events.push(Event::Free { id: old, t_us: e.time_us });
                }
                events.push(Event::Alloc {
                    id,
                    bytes: e.size,
                    kind: e.kind.unwrap_or(TensorKind::Other),
                    stream: stream_of(e.stream),
                    t_us: e.time_us,
                });
            }
            Action::FreeCompleted => {
                // Pass 1 made the same decision: a free of an address not
                // live is the next pre-window block.
                let id = ids.remove(&e.addr).or_else(|| pre.next());
                if let Some(id) = id {
                    events.push(Event::Free { id, t_us: e.time_us });
                }
            }
            _ => info.skipped_entries += 1,
        }
    }

    let mut map: Vec<(u64, u32)> = streams.into_iter().collect();
    map.sort_unstable();
    info.streams = map;
    (events, info)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Events and figures of one pass (`keep_all` or not), and whether it
    /// met something it did not keep.
    fn events_of(bytes: &[u8], keep_all: bool) -> (Result<(Vec<Event>, SnapshotInfo), String>, bool) {
        let p = pass(bytes, &ImportLimits::default(), 0, keep_all);
        (p.raw.map(|raw| build_events(&raw)).map_err(|e| e.to_string()), p.touched_skipped)
    }

    #[test]
    fn keeping_less_gives_the_same_import_of_the_shared_snapshots() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/traces");
        for name in ["pytorch-snapshot-a.pickle", "pytorch-snapshot-b.pickle"] {
            let Ok(bytes) = std::fs::read(dir.join(name)) else {
                eprintln!("skipping: {} is absent", dir.join(name).display());
                continue;
            };
            let (lean, touched) = events_of(&bytes, false);
            let (full, _) = events_of(&bytes, true);
            assert!(!touched, "{name}: the lean pass needs nothing it skipped");
            let (lean, full) = (lean.unwrap(), full.unwrap());
            assert!(!lean.0.is_empty(), "{name}");
            assert_eq!(lean, full, "{name}");
            // And it holds less.
            let limits = ImportLimits::default();
            let (l, f) = (pass(&bytes, &limits, 0, false).peak, pass(&bytes, &limits, 0, true).peak);
            assert!(l < f, "{name}: lean {l} vs full {f}");
        }
    }

    /// `pickle.dumps({"junk": [seg], "segments": [seg]}, protocol=4)`: the
    /// segment is built under an unused key and shared with `segments`.
    const SHARED_WITH_AN_UNUSED_KEY: &[u8] = b"\x80\x04\x95x\x00\x00\x00\x00\x00\x00\x00}\x94(\x8c\x04junk\x94]\x94}\x94(\x8c\x07address\x94K\x00\x8c\ntotal_size\x94M\x00\x10\x8c\x06blocks\x94]\x94}\x94(h\x04K\x00\x8c\x04size\x94M\x00\x10\x8c\x05state\x94\x8c\x10active_allocated\x94uaua\x8c\x08segments\x94]\x94h\x03au.";

    #[test]
    fn a_value_shared_with_an_unused_key_is_read_from_a_second_pass() {
        let (lean, touched) = events_of(SHARED_WITH_AN_UNUSED_KEY, false);
        assert!(touched, "the lean pass did not keep the shared segment");
        // What the lean pass says is not trusted: here it fails.
        assert_eq!(lean.unwrap_err(), "`segments[0]` should be a dict, found dict");
        let (full, touched) = events_of(SHARED_WITH_AN_UNUSED_KEY, true);
        assert!(!touched);
        let s = import_bytes(SHARED_WITH_AN_UNUSED_KEY, "shared.pickle", &ImportOptions::default()).unwrap();
        assert_eq!((s.events.clone(), s.info.segments), (full.unwrap().0, 1));
        assert_eq!(s.events, vec![Event::Alloc { id: 1, bytes: 4096, kind: TensorKind::Other, stream: 0, t_us: None }]);
        // Both passes are accounted.
        assert!(s.info.accounted_peak_bytes > 0);
    }

    #[test]
    fn the_memory_limit_is_an_error_naming_it() {
        let limits = ImportLimits { memory_per_input_byte: 1, memory_base_bytes: 100, ..ImportLimits::default() };
        let limit = limits.memory_limit(SHARED_WITH_AN_UNUSED_KEY.len());
        assert_eq!(limit, SHARED_WITH_AN_UNUSED_KEY.len() as u64 + 100);
        let opts = ImportOptions { limits, ..ImportOptions::default() };
        let e = import_bytes(SHARED_WITH_AN_UNUSED_KEY, "x.pickle", &opts).unwrap_err();
        assert!(
            matches!(e.kind, SnapshotErrorKind::MemoryLimit { limit: l, offset: Some(_), per_byte: 1, base: 100 } if l == limit),
            "{e:?}"
        );
        let text = e.to_string();
        assert!(
            text.starts_with(&format!("x.pickle: the import needs more than {limit} bytes of memory (at byte ")),
            "{text}"
        );
        assert!(
            text.ends_with(
                " of the pickle; the limit is 1 bytes per input byte + 100 bytes: \
                 raise ImportLimits::memory_per_input_byte or ImportLimits::memory_base_bytes)"
            ),
            "{text}"
        );
    }
}
