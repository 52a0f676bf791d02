//! Allocation traces: the v1 JSON Lines format, and PyTorch memory snapshots.
//!
//! A trace is the workload a replay feeds to the engine: one [`TraceHeader`]
//! and a stream of [`Event`]s (tensor allocations, frees, uses, phase marks).
//!
//! - [`TraceReader`] streams a `.jsonl` or `.jsonl.gz` file and validates it
//!   (the format contract is in `DESIGN.md`, "Trace format v1").
//! - [`TraceWriter`] writes exactly that format.
//! - [`cache`] keeps parsed traces in a checksummed binary form, keyed by
//!   content, so that repeated runs over a big trace skip the parse.
//! - [`snapshot`] imports `torch.cuda.memory._dump_snapshot` pickles into the
//!   same event stream, and exports a replay result back into that shape.
//!
//! ## Invariants of a valid event stream (checked by reader and writer)
//!
//! - `alloc` ids are unique over the whole trace: an id is never reused, even
//!   after its `free`.
//! - a `free` names a live id (allocated, not yet freed).
//! - a `use` names a live id.
//!
//! The validator keeps the set of live ids plus the set of ids ever used,
//! stored as maximal runs of consecutive ids: for the usual counter-style ids
//! its size is that of the live set, so reading is constant-memory in the
//! length of the trace apart from the live ids.

mod ahead;
pub mod cache;
mod error;
mod fast;
mod ids;
mod line;
mod reader;
pub mod snapshot;
mod writer;

pub use ahead::ReadAhead;
pub use error::{TraceError, TraceErrorKind};
pub use reader::{FileTraceReader, ReadOptions, TraceReader, DEFAULT_MAX_LINE_LEN};
pub use writer::{FileSink, FileTraceWriter, TraceWriter};

use std::path::Path;

use crate::types::{Phase, TensorKind};

/// The `format` value of a v1 header line.
pub const FORMAT_NAME: &str = "wasmem-trace";
/// The trace format version this module reads and writes.
pub const FORMAT_VERSION: u64 = 1;

/// The first line of a trace: `{"format":"wasmem-trace","version":1,"source":…,"ranks":…}`.
///
/// `format` and `version` are checked on read and written on write; they are
/// not stored here.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceHeader {
    /// Free text: where the trace comes from (model, framework, settings).
    /// An absent `source` reads as the empty string.
    pub source: String,
    /// Number of ranks (processes) the trace describes. An absent `ranks`
    /// reads as 1.
    pub ranks: u32,
}

impl Default for TraceHeader {
    fn default() -> Self {
        TraceHeader { source: String::new(), ranks: 1 }
    }
}

/// One event of a trace (one line after the header).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// A tensor storage of `bytes` bytes is requested (`op: "alloc"`).
    Alloc {
        /// Tensor id, unique over the whole trace.
        id: u64,
        /// Requested size in bytes.
        bytes: u64,
        /// What the tensor holds.
        kind: TensorKind,
        /// Stream the tensor is allocated on (default 0).
        stream: u32,
        /// Optional timestamp in microseconds.
        t_us: Option<u64>,
    },
    /// The client releases the storage of a live tensor (`op: "free"`).
    Free {
        /// Id of a live tensor.
        id: u64,
        /// Optional timestamp in microseconds.
        t_us: Option<u64>,
    },
    /// An operator read or wrote a live tensor (`op: "use"`).
    Use {
        /// Id of a live tensor.
        id: u64,
        /// Stream of the use; `None` means the tensor's own stream.
        stream: Option<u32>,
    },
    /// A training phase begins (`op: "phase"`).
    Phase {
        /// The phase.
        phase: Phase,
        /// Training step number.
        step: u64,
    },
}

impl Event {
    /// The `op` string of this event in the trace format.
    pub fn op(&self) -> &'static str {
        match self {
            Event::Alloc { .. } => "alloc",
            Event::Free { .. } => "free",
            Event::Use { .. } => "use",
            Event::Phase { .. } => "phase",
        }
    }
}

/// Reads a whole trace file (`.jsonl` or `.jsonl.gz`) into memory.
///
/// Prefer iterating a [`TraceReader`] for large traces; this is for tests and
/// small tools.
pub fn read_file(path: impl AsRef<Path>) -> Result<(TraceHeader, Vec<Event>), TraceError> {
    let reader = TraceReader::open(path)?;
    let header = reader.header().clone();
    let events = reader.collect::<Result<Vec<_>, _>>()?;
    Ok((header, events))
}

/// Writes a whole trace file; gzip-compressed when the path ends in `.gz`.
///
/// The events are validated like the reader validates them, so a file this
/// function writes always reads back.
pub fn write_file<'a>(
    path: impl AsRef<Path>,
    header: &TraceHeader,
    events: impl IntoIterator<Item = &'a Event>,
) -> Result<(), TraceError> {
    let mut writer = TraceWriter::create(path, header)?;
    for event in events {
        writer.write(event)?;
    }
    writer.close()
}

#[cfg(test)]
mod tests;
