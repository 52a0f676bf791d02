//! Errors of the trace reader and writer.

use std::fmt;
use std::io;

/// A trace that cannot be read or written, with the file and line it concerns.
///
/// Displays as `FILE:LINE: message`, e.g.
/// `run.jsonl:17: double free of id 5`.
#[derive(Debug, thiserror::Error)]
pub struct TraceError {
    /// The file (or the name given to an in-memory reader).
    pub file: String,
    /// 1-based line number the error concerns (the header is line 1); 0 when
    /// the file could not be opened or created.
    pub line: u64,
    /// What went wrong.
    pub kind: TraceErrorKind,
}

impl fmt::Display for TraceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}: {}", self.file, self.line, self.kind)
    }
}

/// What went wrong in a [`TraceError`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TraceErrorKind {
    /// Reading failed (including a corrupt gzip stream).
    #[error("read error: {0}")]
    Read(#[source] io::Error),
    /// Writing failed.
    #[error("write error: {0}")]
    Write(#[source] io::Error),
    /// The file has no lines at all.
    #[error("empty trace: missing header line")]
    Empty,
    /// The first line is not a header (it has no `format` field).
    #[error(
        "missing header: the first line must be \
         {{\"format\":\"wasmem-trace\",\"version\":1,\"source\":\"...\",\"ranks\":1}}"
    )]
    MissingHeader,
    /// The header's `format` is not `wasmem-trace`.
    #[error("header field `format` is `{0}`, expected `wasmem-trace`")]
    WrongFormat(String),
    /// The header's `version` is not one this reader understands.
    #[error("unsupported trace version {0} (this reader supports version 1)")]
    UnsupportedVersion(u64),
    /// The line is not valid JSON (or not a JSON object).
    #[error("malformed JSON{}: {message}", column.map(|c| format!(" at column {c}")).unwrap_or_default())]
    Json {
        /// 1-based column (byte offset) within the line, when known.
        column: Option<usize>,
        /// serde_json's description.
        message: String,
    },
    /// The line is longer than the configured maximum.
    #[error("line is longer than {0} bytes")]
    LineTooLong(usize),
    /// The `op` is not one of `alloc`, `free`, `use`, `phase`.
    #[error("unknown op `{0}` (expected alloc, free, use or phase)")]
    UnknownOp(String),
    /// A required field is absent (or `null`).
    #[error("{context} is missing field `{field}`")]
    MissingField {
        /// `header`, `event` (no `op`), or e.g. `` `alloc` event ``.
        context: &'static str,
        /// The field.
        field: &'static str,
    },
    /// A field has the wrong JSON type or is out of range.
    #[error("field `{field}`: {message}")]
    InvalidField {
        /// The field.
        field: &'static str,
        /// What is wrong with it (serde_json's description).
        message: String,
    },
    /// A field appears twice in one line.
    #[error("duplicate field `{0}`")]
    DuplicateField(&'static str),
    /// The `kind` of an `alloc` is not a known tensor kind.
    #[error(
        "field `kind`: unknown tensor kind `{0}` \
         (expected param, grad, optim, activation, temp or other)"
    )]
    UnknownKind(String),
    /// The `name` of a `phase` is not a known phase.
    #[error("field `name`: unknown phase `{0}` (expected forward, backward, optimizer or step_end)")]
    UnknownPhase(String),
    /// An `alloc` names an id that was allocated before.
    #[error("alloc of id {0}, which was already used (ids are never reused)")]
    IdReused(u64),
    /// A `free` names an id that was never allocated.
    #[error("free of unknown id {0}")]
    FreeOfUnknownId(u64),
    /// A `free` names an id that was already freed.
    #[error("double free of id {0}")]
    DoubleFree(u64),
    /// A `use` names an id that was never allocated.
    #[error("use of unknown id {0}")]
    UseOfUnknownId(u64),
    /// A `use` names an id that was already freed.
    #[error("use of id {0} after its free")]
    UseAfterFree(u64),
}

impl TraceError {
    pub(crate) fn new(file: &str, line: u64, kind: TraceErrorKind) -> Self {
        TraceError { file: file.to_owned(), line, kind }
    }
}
