//! Text that comes from outside the engine — a policy's name, its log
//! lines and refusals, a trap's message — bounded in length and made safe to
//! print: it reaches terminals, logs and control-socket replies.
//!
//! [`sanitize`] keeps printable text as it is, writes control characters
//! (ESC, CR, NUL, DEL, C1 controls, bidirectional overrides…) as visible
//! escapes (`\u{1b}`), and cuts what is longer than the bound, saying how
//! much was cut. Whitespace runs of spaces and tabs are kept; newlines become
//! `\n` so that one message stays one line. [`tidy`] is for a guest's console
//! output (a traceback, coloured log lines): it drops escape sequences
//! instead of showing them, folds whitespace, and can keep the end.

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

/// A guest's console output or log line made safe to log and bounded, for
/// text whose escapes are decoration (colours, titles), not content: ANSI escape sequences (CSI `ESC [ …
/// final`, OSC `ESC ] … BEL|ESC \`, and two-byte `ESC x`) removed, other
/// control characters removed except newlines and tabs (which become
/// spaces), runs of blanks collapsed, trimmed, and cut to `max` characters
/// with `…` (keeping the *end* when `keep_end`: the last line of a
/// traceback names the exception).
pub fn tidy(text: &str, max: usize, keep_end: bool) -> String {
    let mut out = String::with_capacity(text.len().min(max * 4));
    let mut chars = text.chars().peekable();
    let mut blank = false;
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            match chars.next() {
                Some('[') => {
                    // CSI: parameters and intermediates up to a final byte @..~.
                    for d in chars.by_ref() {
                        if ('@'..='~').contains(&d) {
                            break;
                        }
                    }
                }
                Some(']') => {
                    // OSC: up to BEL or ESC \.
                    while let Some(d) = chars.next() {
                        if d == '\u{7}' {
                            break;
                        }
                        if d == '\u{1b}' {
                            chars.next_if_eq(&'\\');
                            break;
                        }
                    }
                }
                _ => {}
            }
            continue;
        }
        let c = if c == '\n' || c == '\t' || c == '\r' { ' ' } else { c };
        if c.is_control() || matches!(c, '\u{200b}'..='\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}') {
            continue;
        }
        if c == ' ' {
            if blank {
                continue;
            }
            blank = true;
        } else {
            blank = false;
        }
        out.push(c);
    }
    let out = out.trim();
    let n = out.chars().count();
    if n <= max {
        return out.to_string();
    }
    let keep = max.saturating_sub(1);
    if keep_end {
        let tail: String = out.chars().skip(n - keep).collect();
        format!("…{tail}")
    } else {
        let head: String = out.chars().take(keep).collect();
        format!("{head}…")
    }
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

    #[test]
    fn tidy_strips_escapes_and_bounds() {
        let s = "\u{1b}[31mValueError\u{1b}[0m: bad\n\tsize\u{7}\u{1b}]0;title\u{7} \u{202e}x\r\n";
        assert_eq!(tidy(s, 100, false), "ValueError: bad size x");
        assert_eq!(tidy("abcdefghij", 5, false), "abcd…");
        assert_eq!(tidy("abcdefghij", 5, true), "…ghij");
        assert_eq!(tidy("é\u{0}é", 10, false), "éé");
        assert_eq!(tidy("", 10, true), "");
    }
}
