//! The reader's fast path: a byte-level parser of the line shapes that
//! traces are made of, e.g.
//!
//! ```text
//! {"op":"alloc","id":7,"bytes":4096,"kind":"param","stream":0,"t_us":12}
//! {"op":"free","id":7}
//! ```
//!
//! It accepts a line only when the line is a flat JSON object with no
//! whitespace, whose keys are event fields of the format (`op`, `id`,
//! `bytes`, `kind`, `stream`, `t_us`, `name`, `step`, each at most once, in
//! any order) and whose values are plain strings (printable ASCII without
//! escapes) or unsigned integers in JSON syntax that fit their field. That is
//! every line our writer produces and every line of the converted PyTorch
//! traces. For such a line it fills the same [`EventFields`] the general
//! parser ([`super::line`]) would, so the events are identical by
//! construction; any other line — valid or not — is left to the general
//! parser, which words every error. Validation after the fields (required
//! fields, kinds, phases, ids) is shared.

use super::line::EventFields;

/// The fields of `line` if it has one of the simple shapes, else `None`.
#[inline]
pub(super) fn parse_event(line: &[u8]) -> Option<EventFields<&[u8]>> {
    let mut raw = EventFields::default();
    let mut p = Cursor { b: line, i: 0 };
    p.expect(b'{')?;
    loop {
        p.expect(b'"')?;
        let key = p.plain_str()?;
        p.expect(b':')?;
        match key {
            b"op" => set(&mut raw.op, p.str_value()?)?,
            b"id" => set(&mut raw.id, p.u64_value()?)?,
            b"bytes" => set(&mut raw.bytes, p.u64_value()?)?,
            b"kind" => set(&mut raw.kind, p.str_value()?)?,
            b"stream" => set(&mut raw.stream, u32::try_from(p.u64_value()?).ok()?)?,
            b"t_us" => set(&mut raw.t_us, p.u64_value()?)?,
            b"name" => set(&mut raw.name, p.str_value()?)?,
            b"step" => set(&mut raw.step, p.u64_value()?)?,
            _ => return None,
        }
        match p.next()? {
            b',' => continue,
            b'}' if p.i == line.len() => return Some(raw),
            _ => return None,
        }
    }
}

/// Stores a field's value; `None` for a duplicate (the general parser
/// reports it).
fn set<T>(slot: &mut Option<T>, v: T) -> Option<()> {
    if slot.is_some() {
        return None;
    }
    *slot = Some(v);
    Some(())
}

struct Cursor<'a> {
    b: &'a [u8],
    i: usize,
}

impl<'a> Cursor<'a> {
    fn next(&mut self) -> Option<u8> {
        let c = *self.b.get(self.i)?;
        self.i += 1;
        Some(c)
    }

    fn expect(&mut self, c: u8) -> Option<()> {
        (self.next()? == c).then_some(())
    }

    /// The rest of a string whose opening quote was read: printable ASCII
    /// other than `"` and `\`, up to the closing quote (consumed).
    fn plain_str(&mut self) -> Option<&'a [u8]> {
        let start = self.i;
        loop {
            match *self.b.get(self.i)? {
                b'"' => break,
                b'\\' => return None,
                c if (0x20..0x7f).contains(&c) => self.i += 1,
                _ => return None,
            }
        }
        self.i += 1;
        Some(&self.b[start..self.i - 1])
    }

    /// A string value (printable ASCII, hence UTF-8).
    fn str_value(&mut self) -> Option<&'a [u8]> {
        self.expect(b'"')?;
        self.plain_str()
    }

    /// An unsigned integer in JSON syntax (no leading zero, no fraction or
    /// exponent), which must fit `u64`.
    fn u64_value(&mut self) -> Option<u64> {
        let start = self.i;
        let mut v: u64 = 0;
        while let Some(&c) = self.b.get(self.i) {
            if !c.is_ascii_digit() {
                break;
            }
            v = v.checked_mul(10)?.checked_add(u64::from(c - b'0'))?;
            self.i += 1;
        }
        let digits = self.i - start;
        if digits == 0 || (digits > 1 && self.b[start] == b'0') {
            return None;
        }
        Some(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(line: &str) -> Option<String> {
        parse_event(line.as_bytes()).map(|r| {
            format!(
                "{:?} {:?} {:?} {:?} {:?} {:?} {:?} {:?}",
                r.op.map(String::from_utf8_lossy),
                r.id,
                r.bytes,
                r.kind.map(String::from_utf8_lossy),
                r.stream,
                r.t_us,
                r.name.map(String::from_utf8_lossy),
                r.step
            )
        })
    }

    #[test]
    fn accepts_the_simple_shapes() {
        assert_eq!(
            fields(r#"{"op":"alloc","id":7,"bytes":4096,"kind":"param","stream":0,"t_us":12}"#).unwrap(),
            r#"Some("alloc") Some(7) Some(4096) Some("param") Some(0) Some(12) None None"#
        );
        assert_eq!(
            fields(r#"{"kind":"x","op":"free","id":18446744073709551615}"#).unwrap(),
            r#"Some("free") Some(18446744073709551615) None Some("x") None None None None"#
        );
        assert_eq!(
            fields(r#"{"op":"phase","name":"step_end","step":0}"#).unwrap(),
            r#"Some("phase") None None None None None Some("step_end") Some(0)"#
        );
        // Any field set, even one the op does not need: validation is shared.
        assert!(fields(r#"{"id":1}"#).is_some());
    }

    #[test]
    fn leaves_everything_else_to_the_general_parser() {
        for line in [
            "",
            "{}",
            "{ \"op\":\"free\",\"id\":1}",
            r#"{"op":"free","id":1} "#,
            r#"{"op":"free","id":1}x"#,
            r#"{"op":"free","id":1,}"#,
            r#"{"op":"free","id":01}"#,
            r#"{"op":"free","id":-1}"#,
            r#"{"op":"free","id":1.0}"#,
            r#"{"op":"free","id":1e3}"#,
            r#"{"op":"free","id":18446744073709551616}"#,
            r#"{"op":"free","id":null}"#,
            r#"{"op":"free","id":"1"}"#,
            r#"{"op":"free","id":1,"id":2}"#,
            r#"{"op":"fr\u0065e","id":1}"#,
            "{\"op\":\"fr\u{e9}e\",\"id\":1}",
            r#"{"op":"free","id":1,"extra":0}"#,
            r#"{"op":"alloc","id":1,"bytes":1,"kind":"param","stream":4294967296}"#,
            r#"{"op":"free","id":1"#,
            r#"{"op":"free","id":"#,
            r#"{"op":"free"#,
        ] {
            assert_eq!(fields(line), None, "{line}");
        }
    }
}
