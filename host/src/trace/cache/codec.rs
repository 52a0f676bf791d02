//! The binary form of a parsed trace: what a cache entry holds.
//!
//! ```text
//! entry  := header chunk* end
//! header := "WMTRACE\0" · u32 version · [32] source digest · u64 max_line_len
//!           · u32 ranks · u32 source_len · source · u32 crc32(all of the above)
//! chunk  := u32 events (1 ..= CHUNK_EVENTS) · u32 len (≤ MAX_PAYLOAD)
//!           · u32 crc32(events · len · payload) · payload
//! end    := u32 0 · u32 8 · u32 crc32(0 · 8 · total) · u64 total events
//! ```
//!
//! All integers little-endian. A payload is the chunk's events, each a tag
//! byte then LEB128 varints: ids and times as zigzag deltas from the
//! previous id (time) in the chunk, so counter-style ids take one byte.
//!
//! | op | tag (bits) | then |
//! |---|---|---|
//! | alloc | `0` · kind (2–4) · has `t_us` (5) · stream ≠ 0 (6) | Δid, bytes, [stream], [Δt] |
//! | free | `1` · has `t_us` (5) | Δid, [Δt] |
//! | use | `2` · has stream (6) | Δid, [stream] |
//! | phase | `3` · phase (2–3) | step |
//!
//! Unused tag bits are zero. The reader checks everything: magic, version,
//! the header's fields and checksum, each chunk's checksum before any of its
//! events is used, lengths, tags, varints (no overlong or overflowing
//! encoding), that a payload holds exactly its events, the end record and
//! that nothing follows it. Chunks decode independently (the delta state
//! restarts at each).

use std::fmt;
use std::io::{self, Read, Write};

use crate::trace::{Event, TraceHeader};
use crate::types::{Phase, TensorKind};

/// First bytes of an entry.
const MAGIC: [u8; 8] = *b"WMTRACE\0";
/// Version of this encoding (part of the entry's name and checked on read).
pub(crate) const VERSION: u32 = 1;
/// Most events in one chunk.
pub(crate) const CHUNK_EVENTS: usize = 1 << 16;
/// Largest payload of one chunk (an event takes at most 36 bytes).
const MAX_PAYLOAD: usize = CHUNK_EVENTS * 36;
/// Longest `source` text accepted in a header.
const MAX_SOURCE: usize = 16 << 20;

const OP_ALLOC: u8 = 0;
const OP_FREE: u8 = 1;
const OP_USE: u8 = 2;
const OP_PHASE: u8 = 3;
const HAS_T: u8 = 1 << 5;
const HAS_STREAM: u8 = 1 << 6;

/// Why a cache entry cannot be used. The entry is then ignored (with a
/// warning) and the trace parsed instead.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CacheError {
    /// Reading or writing the entry failed.
    #[error("I/O error: {0}")]
    Io(#[from] io::Error),
    /// The file does not start like an entry.
    #[error("not a trace cache entry (bad magic bytes)")]
    BadMagic,
    /// The entry was written by another version of the encoding.
    #[error("entry version {found}, expected {VERSION}")]
    Version {
        /// The version in the entry.
        found: u32,
    },
    /// The entry was made from other content or with other read options.
    #[error("entry made for another source ({what} differs)")]
    Mismatch {
        /// `digest` or `max_line_len`.
        what: &'static str,
    },
    /// A checksum does not match: the entry is corrupt.
    #[error("checksum mismatch in {part} at byte {offset}")]
    Checksum {
        /// `header` or `chunk`.
        part: &'static str,
        /// Offset of that part in the entry.
        offset: u64,
    },
    /// The entry ends before its end record.
    #[error("truncated at byte {offset} (no end record)")]
    Truncated {
        /// Bytes read.
        offset: u64,
    },
    /// A field is out of range or an event does not decode.
    #[error("malformed {what} at byte {offset}")]
    Malformed {
        /// What is wrong.
        what: &'static str,
        /// Offset of the part (header field, chunk) that holds it.
        offset: u64,
    },
    /// The events break the trace rules (ids); the entry was not written by
    /// this reader.
    #[error("event {event} breaks the trace rules: {cause}")]
    Invalid {
        /// Index of the event in the trace.
        event: u64,
        /// Which rule.
        cause: crate::trace::TraceErrorKind,
    },
}

fn crc(parts: &[&[u8]]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    for p in parts {
        h.update(p);
    }
    h.finalize()
}

/// The fixed part of an entry's header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct EntryHeader {
    /// SHA-256 of the source file's bytes.
    pub(crate) digest: [u8; 32],
    /// The reader's line limit the events were validated with.
    pub(crate) max_line_len: u64,
    /// The trace's header.
    pub(crate) trace: TraceHeader,
}

// ---------------------------------------------------------------------------
// Writing
// ---------------------------------------------------------------------------

/// Encodes events into an entry, one chunk at a time.
pub(crate) struct EntryWriter<W: Write> {
    out: W,
    payload: Vec<u8>,
    in_chunk: usize,
    total: u64,
    prev_id: u64,
    prev_t: u64,
}

impl<W: Write> fmt::Debug for EntryWriter<W> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EntryWriter").field("total", &self.total).finish_non_exhaustive()
    }
}

impl<W: Write> EntryWriter<W> {
    /// Writes the header to `out`.
    pub(crate) fn new(mut out: W, header: &EntryHeader) -> io::Result<Self> {
        let source = header.trace.source.as_bytes();
        let mut h = Vec::with_capacity(64 + source.len());
        h.extend_from_slice(&MAGIC);
        h.extend_from_slice(&VERSION.to_le_bytes());
        h.extend_from_slice(&header.digest);
        h.extend_from_slice(&header.max_line_len.to_le_bytes());
        h.extend_from_slice(&header.trace.ranks.to_le_bytes());
        h.extend_from_slice(&(source.len() as u32).to_le_bytes());
        h.extend_from_slice(source);
        let c = crc(&[&h]);
        h.extend_from_slice(&c.to_le_bytes());
        out.write_all(&h)?;
        Ok(EntryWriter { out, payload: Vec::with_capacity(1 << 20), in_chunk: 0, total: 0, prev_id: 0, prev_t: 0 })
    }

    /// Appends one event.
    pub(crate) fn push(&mut self, event: &Event) -> io::Result<()> {
        let p = &mut self.payload;
        match *event {
            Event::Alloc { id, bytes, kind, stream, t_us } => {
                let k = TensorKind::ALL.iter().position(|&x| x == kind).unwrap_or(0) as u8;
                let tag = OP_ALLOC
                    | k << 2
                    | if t_us.is_some() { HAS_T } else { 0 }
                    | if stream != 0 { HAS_STREAM } else { 0 };
                p.push(tag);
                put_delta(p, &mut self.prev_id, id);
                put_varint(p, bytes);
                if stream != 0 {
                    put_varint(p, stream.into());
                }
                if let Some(t) = t_us {
                    put_delta(p, &mut self.prev_t, t);
                }
            }
            Event::Free { id, t_us } => {
                p.push(OP_FREE | if t_us.is_some() { HAS_T } else { 0 });
                put_delta(p, &mut self.prev_id, id);
                if let Some(t) = t_us {
                    put_delta(p, &mut self.prev_t, t);
                }
            }
            Event::Use { id, stream } => {
                p.push(OP_USE | if stream.is_some() { HAS_STREAM } else { 0 });
                put_delta(p, &mut self.prev_id, id);
                if let Some(s) = stream {
                    put_varint(p, s.into());
                }
            }
            Event::Phase { phase, step } => {
                let ph = Phase::ALL.iter().position(|&x| x == phase).unwrap_or(0) as u8;
                p.push(OP_PHASE | ph << 2);
                put_varint(p, step);
            }
        }
        self.in_chunk += 1;
        self.total += 1;
        if self.in_chunk == CHUNK_EVENTS {
            self.flush_chunk()?;
        }
        Ok(())
    }

    fn flush_chunk(&mut self) -> io::Result<()> {
        if self.in_chunk == 0 {
            return Ok(());
        }
        let n = (self.in_chunk as u32).to_le_bytes();
        let len = (self.payload.len() as u32).to_le_bytes();
        let c = crc(&[&n, &len, &self.payload]).to_le_bytes();
        self.out.write_all(&n)?;
        self.out.write_all(&len)?;
        self.out.write_all(&c)?;
        self.out.write_all(&self.payload)?;
        self.payload.clear();
        self.in_chunk = 0;
        self.prev_id = 0;
        self.prev_t = 0;
        Ok(())
    }

    /// Writes the last chunk and the end record; returns the output.
    pub(crate) fn finish(mut self) -> io::Result<W> {
        self.flush_chunk()?;
        let zero = 0u32.to_le_bytes();
        let len = 8u32.to_le_bytes();
        let total = self.total.to_le_bytes();
        let c = crc(&[&zero, &len, &total]).to_le_bytes();
        for part in [&zero[..], &len, &c, &total] {
            self.out.write_all(part)?;
        }
        self.out.flush()?;
        Ok(self.out)
    }
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push(v as u8 | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// Writes `v − prev` as a zigzag varint and makes `v` the new `prev`.
fn put_delta(out: &mut Vec<u8>, prev: &mut u64, v: u64) {
    let d = v.wrapping_sub(*prev) as i64;
    put_varint(out, ((d << 1) ^ (d >> 63)) as u64);
    *prev = v;
}

// ---------------------------------------------------------------------------
// Reading
// ---------------------------------------------------------------------------

/// Decodes an entry chunk by chunk.
pub(crate) struct EntryReader<R: Read> {
    input: R,
    /// Bytes consumed so far.
    offset: u64,
    payload: Vec<u8>,
    /// Events decoded so far (all chunks).
    total: u64,
    done: bool,
}

impl<R: Read> fmt::Debug for EntryReader<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EntryReader").field("offset", &self.offset).field("total", &self.total).finish_non_exhaustive()
    }
}

impl<R: Read> EntryReader<R> {
    /// Reads and checks the header.
    pub(crate) fn new(mut input: R) -> Result<(Self, EntryHeader), CacheError> {
        let mut fixed = [0u8; 8 + 4 + 32 + 8 + 4 + 4];
        read_exact_or(&mut input, &mut fixed, 0)?;
        if fixed[..8] != MAGIC {
            return Err(CacheError::BadMagic);
        }
        let version = u32::from_le_bytes(fixed[8..12].try_into().expect("4 bytes"));
        if version != VERSION {
            return Err(CacheError::Version { found: version });
        }
        let mut digest = [0u8; 32];
        digest.copy_from_slice(&fixed[12..44]);
        let max_line_len = u64::from_le_bytes(fixed[44..52].try_into().expect("8 bytes"));
        let ranks = u32::from_le_bytes(fixed[52..56].try_into().expect("4 bytes"));
        let source_len = u32::from_le_bytes(fixed[56..60].try_into().expect("4 bytes")) as usize;
        if source_len > MAX_SOURCE {
            return Err(CacheError::Malformed { what: "source length", offset: 56 });
        }
        let mut rest = vec![0u8; source_len + 4];
        read_exact_or(&mut input, &mut rest, fixed.len() as u64)?;
        let (source, stored) = rest.split_at(source_len);
        if crc(&[&fixed, source]).to_le_bytes() != stored {
            return Err(CacheError::Checksum { part: "header", offset: 0 });
        }
        let source = String::from_utf8(source.to_vec())
            .map_err(|_| CacheError::Malformed { what: "source text", offset: fixed.len() as u64 })?;
        let offset = (fixed.len() + rest.len()) as u64;
        let header = EntryHeader { digest, max_line_len, trace: TraceHeader { source, ranks } };
        Ok((EntryReader { input, offset, payload: Vec::new(), total: 0, done: false }, header))
    }

    /// Decodes the next chunk into `out` (cleared first); `Ok(false)` after
    /// the end record (then the input is checked to end there).
    pub(crate) fn next_chunk(&mut self, out: &mut Vec<Event>) -> Result<bool, CacheError> {
        out.clear();
        if self.done {
            return Ok(false);
        }
        let at = self.offset;
        let mut head = [0u8; 12];
        read_exact_or(&mut self.input, &mut head, at)?;
        let n = u32::from_le_bytes(head[0..4].try_into().expect("4 bytes")) as usize;
        let len = u32::from_le_bytes(head[4..8].try_into().expect("4 bytes")) as usize;
        let stored = u32::from_le_bytes(head[8..12].try_into().expect("4 bytes"));
        if n > CHUNK_EVENTS || len > MAX_PAYLOAD || (n == 0 && len != 8) || (n > 0 && len < n) {
            return Err(CacheError::Malformed { what: "chunk header", offset: at });
        }
        self.payload.resize(len, 0);
        read_exact_or(&mut self.input, &mut self.payload, at + 12)?;
        self.offset = at + 12 + len as u64;
        if crc(&[&head[..8], &self.payload]) != stored {
            return Err(CacheError::Checksum { part: "chunk", offset: at });
        }
        if n == 0 {
            let total = u64::from_le_bytes(self.payload[..8].try_into().expect("8 bytes"));
            if total != self.total {
                return Err(CacheError::Malformed { what: "event count in the end record", offset: at });
            }
            let mut extra = [0u8; 1];
            if read_some(&mut self.input, &mut extra)? != 0 {
                return Err(CacheError::Malformed { what: "data after the end record", offset: self.offset });
            }
            self.done = true;
            return Ok(false);
        }
        decode_chunk(&self.payload, n, out).map_err(|what| CacheError::Malformed { what, offset: at })?;
        self.total += n as u64;
        Ok(true)
    }
}

/// Fills `buf`, or says the entry is truncated at `offset + bytes read`.
fn read_exact_or(input: &mut impl Read, buf: &mut [u8], offset: u64) -> Result<(), CacheError> {
    let mut got = 0;
    while got < buf.len() {
        match read_some(input, &mut buf[got..])? {
            0 => return Err(CacheError::Truncated { offset: offset + got as u64 }),
            k => got += k,
        }
    }
    Ok(())
}

fn read_some(input: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    loop {
        match input.read(buf) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            r => return r,
        }
    }
}

/// Decodes exactly `n` events filling exactly `payload`.
fn decode_chunk(payload: &[u8], n: usize, out: &mut Vec<Event>) -> Result<(), &'static str> {
    out.reserve(n);
    let mut d = Decoder { b: payload, i: 0, prev_id: 0, prev_t: 0 };
    for _ in 0..n {
        out.push(d.event()?);
    }
    if d.i != payload.len() {
        return Err("chunk payload (bytes after its events)");
    }
    Ok(())
}

struct Decoder<'a> {
    b: &'a [u8],
    i: usize,
    prev_id: u64,
    prev_t: u64,
}

impl Decoder<'_> {
    fn byte(&mut self) -> Result<u8, &'static str> {
        let c = *self.b.get(self.i).ok_or("event (payload ends inside it)")?;
        self.i += 1;
        Ok(c)
    }

    fn varint(&mut self) -> Result<u64, &'static str> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let c = self.byte()?;
            if shift == 63 && c > 1 {
                return Err("varint (overflow)");
            }
            v |= u64::from(c & 0x7f) << shift;
            if c & 0x80 == 0 {
                if c == 0 && shift > 0 {
                    return Err("varint (overlong)");
                }
                return Ok(v);
            }
        }
        Err("varint (too long)")
    }

    fn delta(&mut self, prev_t: bool) -> Result<u64, &'static str> {
        let z = self.varint()?;
        let d = ((z >> 1) as i64) ^ -((z & 1) as i64);
        let prev = if prev_t { &mut self.prev_t } else { &mut self.prev_id };
        *prev = prev.wrapping_add(d as u64);
        Ok(*prev)
    }

    fn stream(&mut self) -> Result<u32, &'static str> {
        u32::try_from(self.varint()?).map_err(|_| "stream (out of range)")
    }

    fn event(&mut self) -> Result<Event, &'static str> {
        let tag = self.byte()?;
        let has_t = tag & HAS_T != 0;
        let has_stream = tag & HAS_STREAM != 0;
        Ok(match tag & 3 {
            OP_ALLOC => {
                let kind = *TensorKind::ALL.get(usize::from(tag >> 2 & 7)).ok_or("tag (kind)")?;
                if tag & 0x80 != 0 {
                    return Err("tag (unused bits)");
                }
                let id = self.delta(false)?;
                let bytes = self.varint()?;
                let stream = if has_stream { self.stream()? } else { 0 };
                if has_stream && stream == 0 {
                    return Err("stream (zero written out)");
                }
                let t_us = if has_t { Some(self.delta(true)?) } else { None };
                Event::Alloc { id, bytes, kind, stream, t_us }
            }
            OP_FREE => {
                if tag & !(3 | HAS_T) != 0 {
                    return Err("tag (unused bits)");
                }
                let id = self.delta(false)?;
                let t_us = if has_t { Some(self.delta(true)?) } else { None };
                Event::Free { id, t_us }
            }
            OP_USE => {
                if tag & !(3 | HAS_STREAM) != 0 {
                    return Err("tag (unused bits)");
                }
                let id = self.delta(false)?;
                let stream = if has_stream { Some(self.stream()?) } else { None };
                Event::Use { id, stream }
            }
            _ => {
                if tag & !(3 | 3 << 2) != 0 {
                    return Err("tag (unused bits)");
                }
                let phase = Phase::ALL[usize::from(tag >> 2 & 3)];
                Event::Phase { phase, step: self.varint()? }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Vec<Event> {
        let mut ev = Vec::new();
        for (i, kind) in TensorKind::ALL.into_iter().enumerate() {
            let id = i as u64 * 7 + u64::from(i == 3) * (u64::MAX - 100);
            ev.push(Event::Alloc {
                id,
                bytes: u64::MAX >> i,
                kind,
                stream: [0, 1, u32::MAX][i % 3],
                t_us: (i % 2 == 0).then_some(u64::MAX - i as u64),
            });
            ev.push(Event::Use { id, stream: [None, Some(0), Some(u32::MAX)][i % 3] });
            ev.push(Event::Free { id, t_us: (i % 2 == 1).then_some(i as u64) });
        }
        for (i, phase) in Phase::ALL.into_iter().enumerate() {
            ev.push(Event::Phase { phase, step: u64::MAX - i as u64 });
        }
        ev
    }

    fn header() -> EntryHeader {
        EntryHeader {
            digest: [7; 32],
            max_line_len: 1 << 20,
            trace: TraceHeader { source: "unit \u{e9}".into(), ranks: 3 },
        }
    }

    fn encode(events: &[Event]) -> Vec<u8> {
        let mut w = EntryWriter::new(Vec::new(), &header()).unwrap();
        for e in events {
            w.push(e).unwrap();
        }
        w.finish().unwrap()
    }

    fn decode(bytes: &[u8]) -> Result<(EntryHeader, Vec<Event>), CacheError> {
        let (mut r, h) = EntryReader::new(bytes)?;
        let (mut all, mut chunk) = (Vec::new(), Vec::new());
        while r.next_chunk(&mut chunk)? {
            all.extend_from_slice(&chunk);
        }
        Ok((h, all))
    }

    #[test]
    fn round_trips_every_field() {
        let ev = sample();
        let (h, back) = decode(&encode(&ev)).unwrap();
        assert_eq!(h, header());
        assert_eq!(back, ev);
        // Several chunks.
        let many: Vec<Event> =
            (0..(CHUNK_EVENTS as u64 * 2 + 5)).map(|id| Event::Free { id, t_us: Some(id * 3) }).collect();
        assert_eq!(decode(&encode(&many)).unwrap().1, many);
        assert_eq!(decode(&encode(&[])).unwrap().1, vec![]);
    }

    #[test]
    fn every_corruption_is_detected() {
        let bytes = encode(&sample());
        // Each byte flipped, and each truncation: never accepted as is.
        for i in 0..bytes.len() {
            let mut b = bytes.clone();
            b[i] ^= 0x10;
            assert!(decode(&b).is_err(), "flip at {i}");
        }
        for n in 0..bytes.len() {
            assert!(decode(&bytes[..n]).is_err(), "truncated to {n}");
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(matches!(decode(&longer), Err(CacheError::Malformed { what: "data after the end record", .. })));
        assert!(matches!(decode(&bytes[..bytes.len() - 20]), Err(CacheError::Truncated { .. })));
    }

    #[test]
    fn malformed_payloads_with_valid_checksums_are_refused() {
        let chunk = |n: u32, payload: &[u8]| {
            let mut w = EntryWriter::new(Vec::new(), &header()).unwrap();
            w.flush_chunk().unwrap();
            let mut b = std::mem::take(&mut w.out);
            let (nb, lb) = (n.to_le_bytes(), (payload.len() as u32).to_le_bytes());
            b.extend_from_slice(&nb);
            b.extend_from_slice(&lb);
            b.extend_from_slice(&crc(&[&nb, &lb, payload]).to_le_bytes());
            b.extend_from_slice(payload);
            decode(&b).unwrap_err().to_string()
        };
        assert!(chunk(1, &[OP_ALLOC | 7 << 2, 1, 1]).starts_with("malformed tag (kind)"));
        assert!(chunk(1, &[OP_FREE | 0x80, 1]).starts_with("malformed tag (unused bits)"));
        assert!(chunk(1, &[OP_FREE, 0x80, 0]).starts_with("malformed varint (overlong)"));
        assert!(chunk(1, &[OP_FREE, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 2])
            .starts_with("malformed varint (overflow)"));
        assert!(chunk(2, &[OP_FREE, 2]).starts_with("malformed event (payload ends inside it)"));
        assert!(chunk(1, &[OP_FREE, 2, 0]).starts_with("malformed chunk payload"));
        assert!(chunk(1, &[OP_USE | HAS_STREAM, 2, 0x80, 0x80, 0x80, 0x80, 0x10]).starts_with("malformed stream"));
        assert!(chunk(1, &[OP_ALLOC | HAS_STREAM, 2, 1, 0]).starts_with("malformed stream (zero"));
        assert!(chunk(0, &[0; 4]).starts_with("malformed chunk header"));
        assert!(chunk(0, &[1, 0, 0, 0, 0, 0, 0, 0]).starts_with("malformed event count"));
    }

    #[test]
    fn header_checks() {
        let bytes = encode(&[]);
        let mut b = bytes.clone();
        b[0] = b'X';
        assert!(matches!(decode(&b), Err(CacheError::BadMagic)));
        let mut b = bytes.clone();
        b[8] = 9;
        assert!(matches!(decode(&b), Err(CacheError::Version { found: 9 })));
        let mut b = bytes.clone();
        b[20] ^= 1;
        assert!(matches!(decode(&b), Err(CacheError::Checksum { part: "header", offset: 0 })));
    }
}
