//! Writer of trace format v1.

use std::fmt;
use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::path::Path;

use flate2::write::GzEncoder;
use flate2::Compression;

use super::ids::IdTracker;
use super::{Event, TraceError, TraceErrorKind, TraceHeader, FORMAT_NAME, FORMAT_VERSION};

/// Writes a v1 trace: the header line at construction, then one line per
/// event.
///
/// Events are validated with the reader's rules (unique ids, frees and uses
/// of live ids only), so whatever this writer accepts reads back unchanged.
/// Lines look like
/// `{"op":"alloc","id":1,"bytes":4096,"kind":"param","stream":0,"t_us":12}`;
/// optional fields that are `None` are omitted.
pub struct TraceWriter<W: Write> {
    out: W,
    file: String,
    line: u64,
    ids: IdTracker,
    buf: Vec<u8>,
}

impl<W: Write> fmt::Debug for TraceWriter<W> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TraceWriter").field("file", &self.file).field("line", &self.line).finish_non_exhaustive()
    }
}

/// The output of [`TraceWriter::create`]: a buffered file, gzip-compressed
/// when the path ends in `.gz`.
pub enum FileSink {
    /// Plain JSON Lines.
    Plain(BufWriter<File>),
    /// Gzip-compressed JSON Lines (boxed: the encoder's state is large).
    Gzip(Box<GzEncoder<BufWriter<File>>>),
}

impl fmt::Debug for FileSink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            FileSink::Plain(_) => "FileSink::Plain",
            FileSink::Gzip(_) => "FileSink::Gzip",
        })
    }
}

impl Write for FileSink {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            FileSink::Plain(w) => w.write(buf),
            FileSink::Gzip(w) => w.write(buf),
        }
    }
    fn write_all(&mut self, buf: &[u8]) -> io::Result<()> {
        match self {
            FileSink::Plain(w) => w.write_all(buf),
            FileSink::Gzip(w) => w.write_all(buf),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        match self {
            FileSink::Plain(w) => w.flush(),
            FileSink::Gzip(w) => w.flush(),
        }
    }
}

impl FileSink {
    /// Writes the gzip trailer (if any) and flushes everything to the file.
    pub fn finish(self) -> io::Result<()> {
        let mut file = match self {
            FileSink::Plain(w) => w,
            FileSink::Gzip(w) => w.finish()?,
        };
        file.flush()?;
        file.get_ref().sync_data().or(Ok(()))
    }
}

/// A [`TraceWriter`] writing to a file.
pub type FileTraceWriter = TraceWriter<FileSink>;

impl FileTraceWriter {
    /// Creates (truncates) `path` and writes the header; gzip when the path
    /// ends in `.gz`.
    pub fn create(path: impl AsRef<Path>, header: &TraceHeader) -> Result<Self, TraceError> {
        let path = path.as_ref();
        let name = path.display().to_string();
        let file = File::create(path).map_err(|e| TraceError::new(&name, 0, TraceErrorKind::Write(e)))?;
        let buffered = BufWriter::with_capacity(1 << 16, file);
        let sink = if path.extension().is_some_and(|e| e == "gz") {
            FileSink::Gzip(Box::new(GzEncoder::new(buffered, Compression::default())))
        } else {
            FileSink::Plain(buffered)
        };
        TraceWriter::new(sink, name, header)
    }

    /// Flushes and closes the file (writing the gzip trailer).
    pub fn close(self) -> Result<(), TraceError> {
        let (file, line) = (self.file.clone(), self.line);
        self.out.finish().map_err(|e| TraceError::new(&file, line, TraceErrorKind::Write(e)))
    }
}

impl<W: Write> TraceWriter<W> {
    /// Writes the header line to `out`; `file` names the output in errors.
    pub fn new(out: W, file: impl Into<String>, header: &TraceHeader) -> Result<Self, TraceError> {
        let mut w =
            TraceWriter { out, file: file.into(), line: 0, ids: IdTracker::default(), buf: Vec::with_capacity(256) };
        w.line = 1;
        w.buf.clear();
        w.buf.extend_from_slice(b"{\"format\":");
        push_json_str(&mut w.buf, FORMAT_NAME);
        // Writing to a Vec cannot fail.
        let _ = write!(w.buf, ",\"version\":{FORMAT_VERSION},\"source\":");
        push_json_str(&mut w.buf, &header.source);
        let _ = writeln!(w.buf, ",\"ranks\":{}}}", header.ranks);
        w.flush_line()?;
        Ok(w)
    }

    /// Validates and writes one event. An invalid event is not written and
    /// the error names the line it would have had.
    pub fn write(&mut self, event: &Event) -> Result<(), TraceError> {
        self.ids.apply(event).map_err(|k| TraceError::new(&self.file, self.line + 1, k))?;
        self.line += 1;
        self.buf.clear();
        let b = &mut self.buf;
        // Writing to a Vec cannot fail.
        let _ = match *event {
            Event::Alloc { id, bytes, kind, stream, t_us } => {
                let _ = write!(
                    b,
                    "{{\"op\":\"alloc\",\"id\":{id},\"bytes\":{bytes},\"kind\":\"{kind}\",\"stream\":{stream}"
                );
                match t_us {
                    Some(t) => writeln!(b, ",\"t_us\":{t}}}"),
                    None => writeln!(b, "}}"),
                }
            }
            Event::Free { id, t_us } => match t_us {
                Some(t) => writeln!(b, "{{\"op\":\"free\",\"id\":{id},\"t_us\":{t}}}"),
                None => writeln!(b, "{{\"op\":\"free\",\"id\":{id}}}"),
            },
            Event::Use { id, stream } => match stream {
                Some(s) => writeln!(b, "{{\"op\":\"use\",\"id\":{id},\"stream\":{s}}}"),
                None => writeln!(b, "{{\"op\":\"use\",\"id\":{id}}}"),
            },
            Event::Phase { phase, step } => {
                writeln!(b, "{{\"op\":\"phase\",\"name\":\"{phase}\",\"step\":{step}}}")
            }
        };
        self.flush_line()
    }

    /// Number of lines written so far (the header included).
    pub fn lines_written(&self) -> u64 {
        self.line
    }

    /// Flushes and returns the underlying writer. For a [`FileSink`] use
    /// [`TraceWriter::close`], which also writes the gzip trailer.
    pub fn finish(mut self) -> Result<W, TraceError> {
        self.out.flush().map_err(|e| TraceError::new(&self.file, self.line, TraceErrorKind::Write(e)))?;
        Ok(self.out)
    }

    fn flush_line(&mut self) -> Result<(), TraceError> {
        self.out.write_all(&self.buf).map_err(|e| TraceError::new(&self.file, self.line, TraceErrorKind::Write(e)))
    }
}

/// Appends `s` as a JSON string literal.
fn push_json_str(buf: &mut Vec<u8>, s: &str) {
    // serde_json escapes exactly as JSON requires; writing to a Vec cannot fail.
    let _ = serde_json::to_writer(&mut *buf, s);
}
