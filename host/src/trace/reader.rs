//! Streaming, validating reader of trace format v1.
//!
//! Memory: one line buffer (at most [`ReadOptions::max_line_len`] bytes) plus
//! the id validator (see the module docs of [`crate::trace`]). Speed: each line
//! is parsed by a hand-written serde visitor over borrowed strings, with no
//! allocation per line in the common case.

use std::borrow::Cow;
use std::cell::Cell;
use std::fmt;
use std::fs::File;
use std::io::{self, BufRead, BufReader};
use std::path::Path;

use flate2::bufread::MultiGzDecoder;
use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, Visitor};

use super::ids::IdTracker;
use super::{Event, TraceError, TraceErrorKind, TraceHeader, FORMAT_NAME, FORMAT_VERSION};
use crate::types::{Phase, TensorKind};

/// Default cap on the length of one line (1 MiB).
pub const DEFAULT_MAX_LINE_LEN: usize = 1 << 20;

/// Settings of a [`TraceReader`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadOptions {
    /// Longest accepted line in bytes (without the newline); a longer line is
    /// an error, so that a corrupt file cannot make the reader buffer without
    /// bound.
    pub max_line_len: usize,
}

impl Default for ReadOptions {
    fn default() -> Self {
        ReadOptions { max_line_len: DEFAULT_MAX_LINE_LEN }
    }
}

/// A [`TraceReader`] over a file opened by [`TraceReader::open`].
pub type FileTraceReader = TraceReader<Box<dyn BufRead + Send>>;

/// Reads and validates a v1 trace, one event at a time.
///
/// The header is read by the constructor. Iteration yields each event, or the
/// first error, after which the iterator is exhausted. Blank lines are
/// skipped; unknown fields are ignored.
///
/// ```no_run
/// use wasmem::trace::TraceReader;
/// let mut reader = TraceReader::open("gpt2_124m.jsonl.gz")?;
/// println!("{}", reader.header().source);
/// for event in &mut reader {
///     let event = event?;
///     // ...
/// }
/// # Ok::<(), wasmem::trace::TraceError>(())
/// ```
pub struct TraceReader<R> {
    inner: R,
    file: String,
    header: TraceHeader,
    line: u64,
    buf: Vec<u8>,
    opts: ReadOptions,
    ids: IdTracker,
    events: u64,
    done: bool,
}

impl<R> fmt::Debug for TraceReader<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TraceReader")
            .field("file", &self.file)
            .field("header", &self.header)
            .field("line", &self.line)
            .field("events", &self.events)
            .finish_non_exhaustive()
    }
}

impl FileTraceReader {
    /// Opens a trace file, gzip-compressed or not (detected by the gzip magic
    /// bytes, whatever the file name), and reads its header.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, TraceError> {
        Self::open_with(path, ReadOptions::default())
    }

    /// [`open`](Self::open) with explicit settings.
    pub fn open_with(path: impl AsRef<Path>, opts: ReadOptions) -> Result<Self, TraceError> {
        let path = path.as_ref();
        let name = path.display().to_string();
        let file = File::open(path).map_err(|e| TraceError::new(&name, 0, TraceErrorKind::Read(e)))?;
        let mut buffered = BufReader::with_capacity(1 << 16, file);
        let inner: Box<dyn BufRead + Send> =
            if is_gzip(&mut buffered).map_err(|e| TraceError::new(&name, 0, TraceErrorKind::Read(e)))? {
                Box::new(BufReader::with_capacity(1 << 16, MultiGzDecoder::new(buffered)))
            } else {
                Box::new(buffered)
            };
        TraceReader::with_options(inner, name, opts)
    }
}

/// Whether the stream starts with the gzip magic bytes `1f 8b` (not consumed).
fn is_gzip(r: &mut impl BufRead) -> io::Result<bool> {
    let buf = loop {
        match r.fill_buf() {
            Ok(b) => break b,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    };
    Ok(buf.starts_with(&[0x1f, 0x8b]))
}

impl<R: BufRead> TraceReader<R> {
    /// Reads the header from `inner`; `file` names the source in errors.
    pub fn new(inner: R, file: impl Into<String>) -> Result<Self, TraceError> {
        Self::with_options(inner, file, ReadOptions::default())
    }

    /// [`new`](Self::new) with explicit settings.
    pub fn with_options(inner: R, file: impl Into<String>, opts: ReadOptions) -> Result<Self, TraceError> {
        let mut reader = TraceReader {
            inner,
            file: file.into(),
            header: TraceHeader::default(),
            line: 0,
            buf: Vec::with_capacity(256),
            opts,
            ids: IdTracker::default(),
            events: 0,
            done: false,
        };
        reader.header = reader.read_header()?;
        Ok(reader)
    }

    /// The trace's header.
    pub fn header(&self) -> &TraceHeader {
        &self.header
    }

    /// The name used for the source in errors (the path for files).
    pub fn file(&self) -> &str {
        &self.file
    }

    /// Number of the last line read (1-based; the header is line 1).
    pub fn line(&self) -> u64 {
        self.line
    }

    /// Number of events returned so far.
    pub fn events_read(&self) -> u64 {
        self.events
    }

    /// Number of tensors allocated and not yet freed so far.
    pub fn live_tensors(&self) -> usize {
        self.ids.live()
    }

    fn err(&self, kind: TraceErrorKind) -> TraceError {
        TraceError::new(&self.file, self.line, kind)
    }

    /// Reads the next non-blank line into `self.buf` (without `\n` / `\r\n`).
    /// Returns `false` at the end of input.
    fn next_line(&mut self) -> Result<bool, TraceErrorKind> {
        loop {
            self.buf.clear();
            let mut any = false;
            loop {
                let avail = match self.inner.fill_buf() {
                    Ok(b) => b,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => {
                        if !any {
                            self.line += 1;
                        }
                        return Err(TraceErrorKind::Read(e));
                    }
                };
                if avail.is_empty() {
                    break;
                }
                if !any {
                    any = true;
                    self.line += 1;
                }
                let (take, newline) = match avail.iter().position(|&b| b == b'\n') {
                    Some(i) => (i, true),
                    None => (avail.len(), false),
                };
                if self.buf.len() + take > self.opts.max_line_len {
                    return Err(TraceErrorKind::LineTooLong(self.opts.max_line_len));
                }
                self.buf.extend_from_slice(&avail[..take]);
                self.inner.consume(take + usize::from(newline));
                if newline {
                    break;
                }
            }
            if !any {
                return Ok(false);
            }
            if self.buf.last() == Some(&b'\r') {
                self.buf.pop();
            }
            if !self.buf.iter().all(u8::is_ascii_whitespace) {
                return Ok(true);
            }
        }
    }

    fn read_header(&mut self) -> Result<TraceHeader, TraceError> {
        match self.next_line() {
            Ok(true) => {}
            Ok(false) => {
                self.line = self.line.max(1);
                return Err(self.err(TraceErrorKind::Empty));
            }
            Err(kind) => return Err(self.err(kind)),
        }
        let raw = parse_raw(&self.buf, Mode::Header).map_err(|k| self.err(k))?;
        let header = build_header(raw).map_err(|k| self.err(k))?;
        Ok(header)
    }

    fn read_event(&mut self) -> Result<Option<Event>, TraceErrorKind> {
        if !self.next_line()? {
            return Ok(None);
        }
        let raw = parse_raw(&self.buf, Mode::Event)?;
        let event = build_event(raw)?;
        self.ids.apply(&event)?;
        Ok(Some(event))
    }
}

impl<R: BufRead> Iterator for TraceReader<R> {
    type Item = Result<Event, TraceError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.done {
            return None;
        }
        match self.read_event() {
            Ok(Some(event)) => {
                self.events += 1;
                Some(Ok(event))
            }
            Ok(None) => {
                self.done = true;
                None
            }
            Err(kind) => {
                self.done = true;
                Some(Err(self.err(kind)))
            }
        }
    }
}

impl<R: BufRead> std::iter::FusedIterator for TraceReader<R> {}

// ---------------------------------------------------------------------------
// Line parsing
// ---------------------------------------------------------------------------

/// Which keys a line is parsed for; the others are ignored.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    Header,
    Event,
}

/// The fields of one line, as found (before checking the op's requirements).
#[derive(Default)]
struct RawLine<'a> {
    op: Option<Cow<'a, str>>,
    id: Option<u64>,
    bytes: Option<u64>,
    kind: Option<Cow<'a, str>>,
    stream: Option<u32>,
    t_us: Option<u64>,
    name: Option<Cow<'a, str>>,
    step: Option<u64>,
    format: Option<Cow<'a, str>>,
    version: Option<u64>,
    source: Option<Cow<'a, str>>,
    ranks: Option<u32>,
}

/// A string that borrows from the line when it has no escapes.
struct CowStr<'a>(Cow<'a, str>);

impl<'de> de::Deserialize<'de> for CowStr<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = CowStr<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(CowStr(Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(CowStr(Cow::Owned(v.to_owned())))
            }
        }
        d.deserialize_str(V)
    }
}

/// Deserializes a [`RawLine`], remembering which field's value is being read
/// so that a type error can name it, and which field appeared twice.
struct LineSeed<'c> {
    mode: Mode,
    field: &'c Cell<Option<&'static str>>,
    duplicate: &'c Cell<Option<&'static str>>,
}

impl<'de> DeserializeSeed<'de> for LineSeed<'_> {
    type Value = RawLine<'de>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_map(self)
    }
}

/// Reads one optional field value into `slot`, tracking the field name.
fn read_field<'de, A, T>(
    map: &mut A,
    seed: &LineSeed<'_>,
    name: &'static str,
    slot: &mut Option<T>,
) -> Result<(), A::Error>
where
    A: MapAccess<'de>,
    T: de::Deserialize<'de>,
{
    if slot.is_some() {
        seed.duplicate.set(Some(name));
        return Err(de::Error::custom("duplicate field"));
    }
    seed.field.set(Some(name));
    *slot = map.next_value::<Option<T>>()?;
    seed.field.set(None);
    Ok(())
}

/// Like [`read_field`] for strings, which borrow from the line.
fn read_str_field<'de, A: MapAccess<'de>>(
    map: &mut A,
    seed: &LineSeed<'_>,
    name: &'static str,
    slot: &mut Option<Cow<'de, str>>,
) -> Result<(), A::Error> {
    let mut tmp: Option<CowStr<'de>> = None;
    if slot.is_some() {
        seed.duplicate.set(Some(name));
        return Err(de::Error::custom("duplicate field"));
    }
    read_field(map, seed, name, &mut tmp)?;
    *slot = tmp.map(|s| s.0);
    Ok(())
}

impl<'de> Visitor<'de> for LineSeed<'_> {
    type Value = RawLine<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut raw = RawLine::default();
        while let Some(key) = map.next_key::<CowStr<'de>>()? {
            match (self.mode, key.0.as_ref()) {
                (Mode::Event, "op") => read_str_field(&mut map, &self, "op", &mut raw.op)?,
                (Mode::Event, "id") => read_field(&mut map, &self, "id", &mut raw.id)?,
                (Mode::Event, "bytes") => read_field(&mut map, &self, "bytes", &mut raw.bytes)?,
                (Mode::Event, "kind") => read_str_field(&mut map, &self, "kind", &mut raw.kind)?,
                (Mode::Event, "stream") => read_field(&mut map, &self, "stream", &mut raw.stream)?,
                (Mode::Event, "t_us") => read_field(&mut map, &self, "t_us", &mut raw.t_us)?,
                (Mode::Event, "name") => read_str_field(&mut map, &self, "name", &mut raw.name)?,
                (Mode::Event, "step") => read_field(&mut map, &self, "step", &mut raw.step)?,
                (Mode::Header, "format") => read_str_field(&mut map, &self, "format", &mut raw.format)?,
                (Mode::Header, "version") => read_field(&mut map, &self, "version", &mut raw.version)?,
                (Mode::Header, "source") => read_str_field(&mut map, &self, "source", &mut raw.source)?,
                (Mode::Header, "ranks") => read_field(&mut map, &self, "ranks", &mut raw.ranks)?,
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(raw)
    }
}

/// serde_json's message without its ` at line L column C` suffix (the line
/// number in it would be 1, which is misleading inside a file).
fn json_message(e: &serde_json::Error) -> String {
    let full = e.to_string();
    let suffix = format!(" at line {} column {}", e.line(), e.column());
    match full.strip_suffix(&suffix) {
        Some(m) => m.to_owned(),
        None => full,
    }
}

fn parse_raw(line: &[u8], mode: Mode) -> Result<RawLine<'_>, TraceErrorKind> {
    let field = Cell::new(None);
    let duplicate = Cell::new(None);
    let mut de = serde_json::Deserializer::from_slice(line);
    let result = LineSeed { mode, field: &field, duplicate: &duplicate }
        .deserialize(&mut de)
        .and_then(|raw| de.end().map(|()| raw));
    result.map_err(|e| {
        if let Some(name) = duplicate.get() {
            return TraceErrorKind::DuplicateField(name);
        }
        match (field.get(), e.classify()) {
            (Some(name), serde_json::error::Category::Data) => {
                TraceErrorKind::InvalidField { field: name, message: json_message(&e) }
            }
            _ => TraceErrorKind::Json { column: (e.column() > 0).then_some(e.column()), message: json_message(&e) },
        }
    })
}

fn build_header(raw: RawLine<'_>) -> Result<TraceHeader, TraceErrorKind> {
    let format = raw.format.ok_or(TraceErrorKind::MissingHeader)?;
    if format != FORMAT_NAME {
        return Err(TraceErrorKind::WrongFormat(format.into_owned()));
    }
    let version = raw.version.ok_or(TraceErrorKind::MissingField { context: "header", field: "version" })?;
    if version != FORMAT_VERSION {
        return Err(TraceErrorKind::UnsupportedVersion(version));
    }
    Ok(TraceHeader { source: raw.source.map(Cow::into_owned).unwrap_or_default(), ranks: raw.ranks.unwrap_or(1) })
}

fn build_event(raw: RawLine<'_>) -> Result<Event, TraceErrorKind> {
    let op = raw.op.ok_or(TraceErrorKind::MissingField { context: "event", field: "op" })?;
    let missing = |context: &'static str, field: &'static str| TraceErrorKind::MissingField { context, field };
    Ok(match op.as_ref() {
        "alloc" => {
            const C: &str = "`alloc` event";
            let id = raw.id.ok_or_else(|| missing(C, "id"))?;
            let bytes = raw.bytes.ok_or_else(|| missing(C, "bytes"))?;
            let kind = raw.kind.ok_or_else(|| missing(C, "kind"))?;
            let kind = parse_kind(&kind).ok_or_else(|| TraceErrorKind::UnknownKind(kind.into()))?;
            Event::Alloc { id, bytes, kind, stream: raw.stream.unwrap_or(0), t_us: raw.t_us }
        }
        "free" => Event::Free { id: raw.id.ok_or_else(|| missing("`free` event", "id"))?, t_us: raw.t_us },
        "use" => Event::Use { id: raw.id.ok_or_else(|| missing("`use` event", "id"))?, stream: raw.stream },
        "phase" => {
            const C: &str = "`phase` event";
            let name = raw.name.ok_or_else(|| missing(C, "name"))?;
            let phase = parse_phase(&name).ok_or_else(|| TraceErrorKind::UnknownPhase(name.into()))?;
            let step = raw.step.ok_or_else(|| missing(C, "step"))?;
            Event::Phase { phase, step }
        }
        other => return Err(TraceErrorKind::UnknownOp(other.to_owned())),
    })
}

fn parse_kind(s: &str) -> Option<TensorKind> {
    TensorKind::ALL.into_iter().find(|k| k.as_str() == s)
}

fn parse_phase(s: &str) -> Option<Phase> {
    Phase::ALL.into_iter().find(|p| p.as_str() == s)
}
