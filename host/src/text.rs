//! Text that comes from outside the engine — a policy's name, its log
//! lines and refusals, a trap's message — bounded in length and made safe to
//! print: it reaches terminals, logs and control-socket replies.
//!
//! [`sanitize`] keeps printable text as it is, writes control characters
//! (ESC, CR, NUL, DEL, C1 controls, bidirectional overrides…) as visible
//! escapes (`\u{1b}`), and cuts what is longer than the bound, saying how
//! much was cut. Whitespace runs of spaces and tabs are kept; newlines become
//! `\n` so that one message stays one line.

/// Longest policy name kept, in characters.
pub const MAX_NAME_CHARS: usize = 128;

/// Longest policy message (log line, refusal, error) kept, in characters.
pub const MAX_MESSAGE_CHARS: usize = 1024;

/// Whether `c` is shown as is (printable, or a space or tab).
fn printable(c: char) -> bool {
    if c == ' ' || c == '\t' {
        return true;
    }
    if c.is_control() {
        return false;
    }
    // Bidirectional overrides and isolates, zero-width joiners and marks
    // that can disguise what a terminal shows.
    !matches!(c, '\u{200b}'..='\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}' | '\u{feff}')
}

/// `s` cut to at most `max_chars` characters (with a note of what was cut)
/// and with every character that is not printable written as an escape.
pub fn sanitize(s: &str, max_chars: usize) -> String {
    let mut out = String::with_capacity(s.len().min(max_chars * 2));
    for (kept, (i, c)) in s.char_indices().enumerate() {
        if kept >= max_chars {
            out.push_str(&format!("… ({} more bytes cut)", s.len() - i));
            return out;
        }
        match c {
            c if printable(c) => out.push(c),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            c => out.push_str(&format!("\\u{{{:x}}}", c as u32)),
        }
    }
    out
}

/// [`sanitize`] bounded to [`MAX_NAME_CHARS`].
pub fn name(s: &str) -> String {
    sanitize(s, MAX_NAME_CHARS)
}

/// [`sanitize`] bounded to [`MAX_MESSAGE_CHARS`].
pub fn message(s: &str) -> String {
    sanitize(s, MAX_MESSAGE_CHARS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn controls_become_visible_and_length_is_bounded() {
        assert_eq!(sanitize("plain name-1", 64), "plain name-1");
        assert_eq!(sanitize("a\x1b[31mred\r\0b", 64), "a\\u{1b}[31mred\\r\\u{0}b");
        assert_eq!(sanitize("two\nlines", 64), "two\\nlines");
        assert_eq!(sanitize("evil\u{202e}txt", 64), "evil\\u{202e}txt");
        let long = "x".repeat(10_000);
        let s = sanitize(&long, 100);
        assert!(s.starts_with(&"x".repeat(100)) && s.ends_with("(9900 more bytes cut)"), "{s}");
        assert_eq!(sanitize("é€𝄞", 2), "é€… (4 more bytes cut)");
    }
}
