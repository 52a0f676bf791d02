//! The general parser of one trace line: serde_json with a hand-written
//! visitor over borrowed strings (no allocation per line in the common case).
//!
//! It accepts every JSON object the format allows (any key order, escapes,
//! whitespace, unknown fields of any type, `null` for absent optional
//! fields) and words every error: the reader's fast path
//! ([`super::fast`]) hands it each line it does not recognize, so that both
//! paths give the same events and the same messages.

use std::borrow::Cow;
use std::cell::Cell;
use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, Visitor};

use super::{Event, TraceErrorKind, TraceHeader, FORMAT_NAME, FORMAT_VERSION};
use crate::types::{Phase, TensorKind};

/// Which keys a line is parsed for; the others are ignored.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Mode {
    Header,
    Event,
}

/// The event fields of one line, as found (before checking the op's
/// requirements). `S` is the text of a string field: borrowed or unescaped
/// text for the general parser, the bytes inside the quotes for the fast path.
pub(super) struct EventFields<S> {
    pub(super) op: Option<S>,
    pub(super) id: Option<u64>,
    pub(super) bytes: Option<u64>,
    pub(super) kind: Option<S>,
    pub(super) stream: Option<u32>,
    pub(super) t_us: Option<u64>,
    pub(super) name: Option<S>,
    pub(super) step: Option<u64>,
}

impl<S> Default for EventFields<S> {
    fn default() -> Self {
        EventFields { op: None, id: None, bytes: None, kind: None, stream: None, t_us: None, name: None, step: None }
    }
}

/// The text of a string field, as [`build_event`] reads it.
pub(super) trait FieldText {
    /// The UTF-8 bytes.
    fn bytes(&self) -> &[u8];
    /// The text, owned (for an error message).
    fn owned(&self) -> String;
}

impl FieldText for Cow<'_, str> {
    fn bytes(&self) -> &[u8] {
        self.as_bytes()
    }
    fn owned(&self) -> String {
        self.to_string()
    }
}

impl FieldText for &[u8] {
    fn bytes(&self) -> &[u8] {
        self
    }
    fn owned(&self) -> String {
        String::from_utf8_lossy(self).into_owned()
    }
}

/// The fields of one line the general parser found.
#[derive(Default)]
pub(super) struct RawLine<'a> {
    pub(super) event: EventFields<Cow<'a, str>>,
    pub(super) format: Option<Cow<'a, str>>,
    pub(super) version: Option<u64>,
    pub(super) source: Option<Cow<'a, str>>,
    pub(super) ranks: Option<u32>,
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
                (Mode::Event, "op") => read_str_field(&mut map, &self, "op", &mut raw.event.op)?,
                (Mode::Event, "id") => read_field(&mut map, &self, "id", &mut raw.event.id)?,
                (Mode::Event, "bytes") => read_field(&mut map, &self, "bytes", &mut raw.event.bytes)?,
                (Mode::Event, "kind") => read_str_field(&mut map, &self, "kind", &mut raw.event.kind)?,
                (Mode::Event, "stream") => read_field(&mut map, &self, "stream", &mut raw.event.stream)?,
                (Mode::Event, "t_us") => read_field(&mut map, &self, "t_us", &mut raw.event.t_us)?,
                (Mode::Event, "name") => read_str_field(&mut map, &self, "name", &mut raw.event.name)?,
                (Mode::Event, "step") => read_field(&mut map, &self, "step", &mut raw.event.step)?,
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

/// Parses one line for the keys of `mode`; errors name the field they concern.
pub(super) fn parse_raw(line: &[u8], mode: Mode) -> Result<RawLine<'_>, TraceErrorKind> {
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

/// The header a parsed first line describes.
pub(super) fn build_header(raw: RawLine<'_>) -> Result<TraceHeader, TraceErrorKind> {
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

/// The event a line's fields describe (the op's required fields, known
/// kinds and phases): the one validation both parsers share.
#[inline]
pub(super) fn build_event<S: FieldText>(raw: EventFields<S>) -> Result<Event, TraceErrorKind> {
    let op = raw.op.ok_or(TraceErrorKind::MissingField { context: "event", field: "op" })?;
    let missing = |context: &'static str, field: &'static str| TraceErrorKind::MissingField { context, field };
    Ok(match op.bytes() {
        b"alloc" => {
            const C: &str = "`alloc` event";
            let id = raw.id.ok_or_else(|| missing(C, "id"))?;
            let bytes = raw.bytes.ok_or_else(|| missing(C, "bytes"))?;
            let kind = raw.kind.ok_or_else(|| missing(C, "kind"))?;
            let kind = parse_kind(kind.bytes()).ok_or_else(|| TraceErrorKind::UnknownKind(kind.owned()))?;
            Event::Alloc { id, bytes, kind, stream: raw.stream.unwrap_or(0), t_us: raw.t_us }
        }
        b"free" => Event::Free { id: raw.id.ok_or_else(|| missing("`free` event", "id"))?, t_us: raw.t_us },
        b"use" => Event::Use { id: raw.id.ok_or_else(|| missing("`use` event", "id"))?, stream: raw.stream },
        b"phase" => {
            const C: &str = "`phase` event";
            let name = raw.name.ok_or_else(|| missing(C, "name"))?;
            let phase = parse_phase(name.bytes()).ok_or_else(|| TraceErrorKind::UnknownPhase(name.owned()))?;
            let step = raw.step.ok_or_else(|| missing(C, "step"))?;
            Event::Phase { phase, step }
        }
        _ => return Err(TraceErrorKind::UnknownOp(op.owned())),
    })
}

fn parse_kind(s: &[u8]) -> Option<TensorKind> {
    TensorKind::ALL.into_iter().find(|k| k.as_str().as_bytes() == s)
}

fn parse_phase(s: &[u8]) -> Option<Phase> {
    Phase::ALL.into_iter().find(|p| p.as_str().as_bytes() == s)
}
