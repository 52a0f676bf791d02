//! Streaming, validating reader of trace format v1.
//!
//! Memory: one line buffer (at most [`ReadOptions::max_line_len`] bytes) plus
//! the id validator (see the module docs of [`crate::trace`]).
//!
//! Speed: a line that lies whole in the input buffer is parsed where it is,
//! without a copy; the byte-level fast path ([`super::fast`]) reads the common
//! line shapes, and every other line goes to the general serde parser
//! ([`super::line`]), which also words every error. Both fill the same raw
//! fields, validated by the same code, so the two paths cannot disagree.

use std::fmt;
use std::fs::File;
use std::io::{self, BufRead, BufReader};
use std::path::Path;

use flate2::bufread::MultiGzDecoder;

use super::fast;
use super::ids::IdTracker;
use super::line::{build_event, build_header, parse_raw, Mode};
use super::{Event, TraceError, TraceErrorKind, TraceHeader};

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
    /// Whether the fast path is tried first (see [`TraceReader::set_fast_path`]).
    fast: bool,
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
            fast: true,
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

    /// Turns the byte-level fast path on (the default) or off. Off, every
    /// line goes through the general parser: the events and errors are the
    /// same either way (tests and measurements compare the two).
    pub fn set_fast_path(&mut self, on: bool) {
        self.fast = on;
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
        // Lines that lie whole in the input buffer are parsed in place.
        loop {
            let avail = match self.inner.fill_buf() {
                Ok(b) => b,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    self.line += 1;
                    return Err(TraceErrorKind::Read(e));
                }
            };
            let Some(newline) = memchr::memchr(b'\n', avail) else { break };
            self.line += 1;
            if newline > self.opts.max_line_len {
                return Err(TraceErrorKind::LineTooLong(self.opts.max_line_len));
            }
            let line = avail[..newline].strip_suffix(b"\r").unwrap_or(&avail[..newline]);
            if line.first() != Some(&b'{') && line.iter().all(u8::is_ascii_whitespace) {
                self.inner.consume(newline + 1);
                continue;
            }
            let event = parse_event(line, self.fast)?;
            self.inner.consume(newline + 1);
            self.ids.apply(&event)?;
            return Ok(Some(event));
        }
        // A line across the end of the buffer, or the last line.
        if !self.next_line()? {
            return Ok(None);
        }
        let event = parse_event(&self.buf, self.fast)?;
        self.ids.apply(&event)?;
        Ok(Some(event))
    }
}

/// The event of one non-blank line: the fast path when `fast` and the line
/// has a simple shape, else the general parser.
#[inline]
fn parse_event(line: &[u8], fast: bool) -> Result<Event, TraceErrorKind> {
    if fast {
        if let Some(fields) = fast::parse_event(line) {
            return build_event(fields);
        }
    }
    build_event(parse_raw(line, Mode::Event)?.event)
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
