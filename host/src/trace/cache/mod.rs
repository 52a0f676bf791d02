//! A cache of parsed traces, keyed by content.
//!
//! Comparing policies on one big trace parses the same file again for every
//! run, and parsing (gzip, JSON, validation) costs more than replaying. The
//! cache keeps each trace's events in a compact checksummed binary form
//! (`codec`: about 4 bytes per event), so that every run after the first
//! reads that instead.
//!
//! - **Key**: the SHA-256 of the file's bytes ([`ContentKey`]) and the read
//!   options; an entry is `<dir>/<sha256>-v<codec version>-l<max line>.wtc`.
//!   A changed file has another key; nothing depends on names or times.
//! - **Location**: [`TraceCache::from_env`] — `traces/` under
//!   [`crate::dirs::cache_root`] (`$WASMEM_CACHE_DIR`, `$XDG_CACHE_HOME/wasmem`
//!   or `~/.cache/wasmem`).
//! - **Miss**: the trace is parsed as usual and each event is also encoded
//!   into a temporary file in the cache directory, renamed into place only
//!   after the last line was read and validated (atomic: readers never see a
//!   partial entry; an invalid trace, an early stop or a write error leaves
//!   nothing). So the first run costs a parse plus a few ns per event.
//! - **Hit**: the entry's header (magic, version, digest, options, checksum)
//!   is checked, then each chunk's checksum and structure before any of its
//!   events is used, and the events are checked against the id rules again
//!   (never trusted blindly). An entry that fails any check is ignored with a
//!   warning: the trace is parsed instead (and the entry rewritten); when
//!   that happens after some events were already delivered, the parser skips
//!   as many events and the stream continues where it was, unchanged.
//! - Cache failures never fail a read: they are logged (`tracing::warn!`).
//!
//! Files smaller than [`TraceCache::min_file_bytes`] (default 1 MiB) are
//! not cached: they parse in milliseconds.
//!
//! The stream assumes the trace file does not change while it is read (as
//! the plain reader does).

mod codec;

pub use codec::CacheError;

use std::fmt;
use std::fs::File;
use std::io::{self, BufReader, BufWriter, Read};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use self::codec::{EntryHeader, EntryReader, EntryWriter};
use super::ids::IdTracker;
use super::{Event, FileTraceReader, ReadOptions, TraceError, TraceHeader, TraceReader};

/// The SHA-256 digest of a file's bytes: what identifies a trace in the cache.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct ContentKey(pub [u8; 32]);

impl ContentKey {
    /// The digest of the file at `path` (read once, in 1 MiB pieces).
    pub fn of_file(path: impl AsRef<Path>) -> io::Result<ContentKey> {
        let mut file = File::open(path)?;
        let mut h = Sha256::new();
        let mut buf = vec![0u8; 1 << 20];
        loop {
            match file.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => h.update(&buf[..n]),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(ContentKey(h.finalize().into()))
    }

    /// The digest in lower-case hex.
    pub fn hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }
}

impl fmt::Debug for ContentKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ContentKey({})", self.hex())
    }
}

/// A directory of cache entries and the rule for which files use it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceCache {
    dir: PathBuf,
    min_file_bytes: u64,
}

/// Where the events of a [`CachedTrace`] come from.
#[derive(Debug)]
pub enum Origin {
    /// From a valid cache entry.
    Hit,
    /// Parsed; the entry is written as the events are read.
    Miss,
    /// Parsed, because the entry was unusable (it is rewritten).
    Rejected(CacheError),
}

impl TraceCache {
    /// Files below this size are not cached by default (1 MiB).
    pub const DEFAULT_MIN_FILE_BYTES: u64 = 1 << 20;

    /// The cache in `dir` (created when the first entry is written).
    pub fn at(dir: impl Into<PathBuf>) -> TraceCache {
        TraceCache { dir: dir.into(), min_file_bytes: Self::DEFAULT_MIN_FILE_BYTES }
    }

    /// The default cache: `traces/` under [`crate::dirs::cache_root`];
    /// `None` when no cache root is known.
    pub fn from_env() -> Option<TraceCache> {
        crate::dirs::cache_root().map(|root| TraceCache::at(root.join("traces")))
    }

    /// The same cache, used for files of at least `bytes` bytes.
    pub fn with_min_file_bytes(self, bytes: u64) -> TraceCache {
        TraceCache { min_file_bytes: bytes, ..self }
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Smallest file the cache is used for.
    pub fn min_file_bytes(&self) -> u64 {
        self.min_file_bytes
    }

    /// Whether a file of `len` bytes is cached.
    pub fn applies_to(&self, len: u64) -> bool {
        len >= self.min_file_bytes
    }

    /// The entry for content `key` read with `opts`.
    pub fn entry_path(&self, key: &ContentKey, opts: ReadOptions) -> PathBuf {
        self.dir.join(format!("{}-v{}-l{}.wtc", key.hex(), codec::VERSION, opts.max_line_len))
    }

    /// The events of the trace file at `path`, whose content has `key`:
    /// from its entry when that is valid, else parsed (and the entry
    /// written). Errors are those of the trace (a trace that does not open
    /// or whose header is invalid); cache problems are only logged.
    pub fn open(&self, path: impl AsRef<Path>, key: &ContentKey, opts: ReadOptions) -> Result<CachedTrace, TraceError> {
        let path = path.as_ref();
        let entry = self.entry_path(key, opts);
        let rejected = match open_entry(&entry, key, opts) {
            Ok(Some((reader, header))) => {
                let state = State::Cached(Box::new(Cached {
                    entry: reader,
                    chunk: Vec::with_capacity(codec::CHUNK_EVENTS),
                    pos: 0,
                    ids: IdTracker::default(),
                    delivered: 0,
                    entry_path: entry,
                    cache: self.clone(),
                    key: *key,
                    path: path.to_path_buf(),
                    opts,
                }));
                return Ok(CachedTrace { header: header.trace, origin: Origin::Hit, state, resumed_at: None });
            }
            Ok(None) => None,
            Err(e) => {
                tracing::warn!(entry = %entry.display(), error = %e, "ignoring an unusable trace cache entry");
                Some(e)
            }
        };
        let reader = TraceReader::open_with(path, opts)?;
        let header = reader.header().clone();
        let writer = self.create_entry(key, opts, &header);
        let origin = match rejected {
            Some(e) => Origin::Rejected(e),
            None => Origin::Miss,
        };
        Ok(CachedTrace {
            header,
            origin,
            state: State::Parsing(Box::new(Parsing { reader, writer })),
            resumed_at: None,
        })
    }

    /// Starts writing the entry for `key` (logged and `None` on failure).
    fn create_entry(&self, key: &ContentKey, opts: ReadOptions, header: &TraceHeader) -> Option<PendingEntry> {
        let dest = self.entry_path(key, opts);
        let start = || -> io::Result<PendingEntry> {
            std::fs::create_dir_all(&self.dir)?;
            let tmp = tempfile::Builder::new().prefix(".tmp-").suffix(".wtc").tempfile_in(&self.dir)?;
            let eh = EntryHeader { digest: key.0, max_line_len: opts.max_line_len as u64, trace: header.clone() };
            let writer = EntryWriter::new(BufWriter::with_capacity(1 << 16, tmp), &eh)?;
            Ok(PendingEntry { writer, dest: dest.clone() })
        };
        match start() {
            Ok(p) => Some(p),
            Err(e) => {
                tracing::warn!(dir = %self.dir.display(), error = %e, "cannot write the trace cache");
                None
            }
        }
    }
}

/// An entry being read.
type EntryFile = EntryReader<BufReader<File>>;

/// Opens and checks an entry's header; `Ok(None)` when there is none.
fn open_entry(
    entry: &Path,
    key: &ContentKey,
    opts: ReadOptions,
) -> Result<Option<(EntryFile, EntryHeader)>, CacheError> {
    let file = match File::open(entry) {
        Ok(f) => f,
        Err(e) if matches!(e.kind(), io::ErrorKind::NotFound | io::ErrorKind::NotADirectory) => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    let (reader, header) = EntryReader::new(BufReader::with_capacity(1 << 16, file))?;
    if header.digest != key.0 {
        return Err(CacheError::Mismatch { what: "digest" });
    }
    if header.max_line_len != opts.max_line_len as u64 {
        return Err(CacheError::Mismatch { what: "max_line_len" });
    }
    Ok(Some((reader, header)))
}

/// An entry being written next to its final name.
struct PendingEntry {
    writer: EntryWriter<BufWriter<tempfile::NamedTempFile>>,
    dest: PathBuf,
}

impl PendingEntry {
    /// Completes the entry and renames it into place.
    fn commit(self) -> io::Result<()> {
        let file = self.writer.finish()?.into_inner().map_err(|e| e.into_error())?;
        file.persist(&self.dest).map_err(|e| e.error)?;
        Ok(())
    }
}

/// The events of one trace, from the cache or parsed (see the module
/// documentation). Iteration yields each event or the trace's first error,
/// then ends.
pub struct CachedTrace {
    header: TraceHeader,
    origin: Origin,
    state: State,
    /// Events delivered from the entry before it proved unusable.
    resumed_at: Option<u64>,
}

impl fmt::Debug for CachedTrace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CachedTrace")
            .field("header", &self.header)
            .field("origin", &self.origin)
            .finish_non_exhaustive()
    }
}

enum State {
    Cached(Box<Cached>),
    Parsing(Box<Parsing>),
    Done,
}

struct Cached {
    entry: EntryFile,
    /// The decoded, validated chunk being delivered.
    chunk: Vec<Event>,
    pos: usize,
    ids: IdTracker,
    /// Events delivered so far.
    delivered: u64,
    entry_path: PathBuf,
    cache: TraceCache,
    key: ContentKey,
    path: PathBuf,
    opts: ReadOptions,
}

struct Parsing {
    reader: FileTraceReader,
    /// The entry being written (`None`: not writing).
    writer: Option<PendingEntry>,
}

impl CachedTrace {
    /// The trace's header.
    pub fn header(&self) -> &TraceHeader {
        &self.header
    }

    /// Where the events come from (as decided when opened).
    pub fn origin(&self) -> &Origin {
        &self.origin
    }

    /// For a hit whose entry proved unusable after it was opened (a bad
    /// chunk): how many events came from the entry before the parser took
    /// over.
    pub fn resumed_at(&self) -> Option<u64> {
        self.resumed_at
    }

    /// [`origin`](Self::origin), by value.
    pub fn into_origin(self) -> Origin {
        self.origin
    }
}

impl Cached {
    /// The next chunk, decoded and checked against the id rules.
    fn refill(&mut self) -> Result<bool, CacheError> {
        self.pos = 0;
        if !self.entry.next_chunk(&mut self.chunk)? {
            return Ok(false);
        }
        for (k, e) in self.chunk.iter().enumerate() {
            self.ids.apply(e).map_err(|cause| CacheError::Invalid { event: self.delivered + k as u64, cause })?;
        }
        Ok(true)
    }

    /// After a bad chunk: parses the trace, skipping (and re-encoding) the
    /// events already delivered, and continues from there.
    fn resume(&self) -> Result<Parsing, TraceError> {
        let mut reader = TraceReader::open_with(&self.path, self.opts)?;
        let mut writer = self.cache.create_entry(&self.key, self.opts, reader.header());
        for _ in 0..self.delivered {
            match reader.next() {
                Some(Ok(e)) => push(&mut writer, &e),
                Some(Err(e)) => return Err(e),
                None => break,
            }
        }
        Ok(Parsing { reader, writer })
    }
}

/// Encodes `e` into the pending entry; a write error abandons the entry.
fn push(writer: &mut Option<PendingEntry>, e: &Event) {
    if let Some(p) = writer {
        if let Err(err) = p.writer.push(e) {
            tracing::warn!(entry = %p.dest.display(), error = %err, "cannot write the trace cache");
            *writer = None;
        }
    }
}

impl Iterator for CachedTrace {
    type Item = Result<Event, TraceError>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            match &mut self.state {
                State::Cached(c) => {
                    if let Some(&e) = c.chunk.get(c.pos) {
                        c.pos += 1;
                        c.delivered += 1;
                        return Some(Ok(e));
                    }
                    match c.refill() {
                        Ok(true) => continue,
                        Ok(false) => self.state = State::Done,
                        Err(e) => {
                            tracing::warn!(
                                entry = %c.entry_path.display(),
                                error = %e,
                                delivered = c.delivered,
                                "ignoring an unusable trace cache entry; parsing the trace from there"
                            );
                            self.resumed_at = Some(c.delivered);
                            match c.resume() {
                                Ok(p) => self.state = State::Parsing(Box::new(p)),
                                Err(e) => {
                                    self.state = State::Done;
                                    return Some(Err(e));
                                }
                            }
                        }
                    }
                }
                State::Parsing(p) => match p.reader.next() {
                    Some(Ok(e)) => {
                        push(&mut p.writer, &e);
                        return Some(Ok(e));
                    }
                    Some(Err(e)) => {
                        // The temporary file is removed with the writer.
                        self.state = State::Done;
                        return Some(Err(e));
                    }
                    None => {
                        if let Some(w) = p.writer.take() {
                            let dest = w.dest.clone();
                            if let Err(e) = w.commit() {
                                tracing::warn!(entry = %dest.display(), error = %e, "cannot write the trace cache");
                            }
                        }
                        self.state = State::Done;
                    }
                },
                State::Done => return None,
            }
        }
    }
}

impl std::iter::FusedIterator for CachedTrace {}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::write_file;
    use crate::types::TensorKind;

    fn alloc(id: u64) -> Event {
        Event::Alloc { id, bytes: 64, kind: TensorKind::Temp, stream: 0, t_us: None }
    }

    #[test]
    fn an_entry_that_breaks_the_id_rules_is_not_trusted() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.jsonl");
        let events = vec![alloc(1), Event::Free { id: 1, t_us: None }, alloc(2)];
        write_file(&path, &TraceHeader::default(), &events).unwrap();
        let key = ContentKey::of_file(&path).unwrap();
        let cache = TraceCache::at(dir.path().join("cache")).with_min_file_bytes(0);
        // A well-formed entry with valid checksums whose events reuse an id.
        let eh = EntryHeader {
            digest: key.0,
            max_line_len: ReadOptions::default().max_line_len as u64,
            trace: TraceHeader::default(),
        };
        std::fs::create_dir_all(cache.dir()).unwrap();
        let mut w = EntryWriter::new(Vec::new(), &eh).unwrap();
        for e in [alloc(1), alloc(1)] {
            w.push(&e).unwrap();
        }
        std::fs::write(cache.entry_path(&key, ReadOptions::default()), w.finish().unwrap()).unwrap();

        let mut t = cache.open(&path, &key, ReadOptions::default()).unwrap();
        assert!(matches!(t.origin(), Origin::Hit));
        let got: Vec<Event> = t.by_ref().map(Result::unwrap).collect();
        assert_eq!(got, events);
        assert_eq!(t.resumed_at(), Some(0), "no event of the bad chunk was delivered");
        // The parse rewrote the entry.
        let again = cache.open(&path, &key, ReadOptions::default()).unwrap();
        assert!(matches!(again.origin(), Origin::Hit));
        assert_eq!(again.map(Result::unwrap).collect::<Vec<_>>(), events);
    }
}
