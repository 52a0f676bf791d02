//! What a guest writes to its standard output and error (WASI), kept in a
//! bounded in-memory buffer per instance, and the sanitizing of any text a
//! guest hands the host (log lines, output, panic messages).
//!
//! [`GuestOutput`] never refuses a write: it keeps the last `cap` bytes and
//! drops older ones, so a chatty policy behaves as it did with its output
//! discarded. When a call fails, the instance takes the tail
//! ([`GuestOutput::take`]) and attaches it to the error, so a Python
//! `raise` (componentize-py prints the traceback to stderr before it traps)
//! is reported with its text rather than as a bare trap.
//!
//! [`sanitize`] bounds a guest's text and removes what could corrupt a log or
//! a terminal: ANSI escape sequences and other control characters (newlines
//! and tabs become spaces).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use wasmtime_wasi::cli::{IsTerminal, StdoutStream};
use wasmtime_wasi::p2::{OutputStream, Pollable, StreamResult};

/// A bounded buffer shared by an instance's stdout and stderr.
#[derive(Debug, Clone)]
pub(crate) struct GuestOutput {
    inner: Arc<Mutex<VecDeque<u8>>>,
    /// Bytes ever written (kept or not), read without the lock.
    written: Arc<AtomicU64>,
    cap: usize,
}

impl GuestOutput {
    /// An empty buffer keeping at most `cap` bytes.
    pub(crate) fn new(cap: usize) -> Self {
        GuestOutput { inner: Arc::new(Mutex::new(VecDeque::new())), written: Arc::new(AtomicU64::new(0)), cap }
    }

    /// Bytes written so far (including those no longer kept).
    pub(crate) fn written(&self) -> u64 {
        self.written.load(Ordering::Relaxed)
    }

    fn push(&self, bytes: &[u8]) {
        self.written.fetch_add(bytes.len() as u64, Ordering::Relaxed);
        if self.cap == 0 || bytes.is_empty() {
            return;
        }
        let mut b = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let bytes = &bytes[bytes.len().saturating_sub(self.cap)..];
        let len = b.len();
        let overflow = (len + bytes.len()).saturating_sub(self.cap);
        b.drain(..overflow.min(len));
        b.extend(bytes);
    }

    /// Takes what was written since the last `take` (its last `cap` bytes),
    /// as text (invalid UTF-8 replaced), leaving the buffer empty.
    pub(crate) fn take(&self) -> String {
        let mut b = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let bytes: Vec<u8> = b.drain(..).collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

impl IsTerminal for GuestOutput {
    fn is_terminal(&self) -> bool {
        false
    }
}

impl StdoutStream for GuestOutput {
    fn p2_stream(&self) -> Box<dyn OutputStream> {
        Box::new(self.clone())
    }

    fn async_stream(&self) -> Box<dyn tokio::io::AsyncWrite + Send + Sync> {
        Box::new(self.clone())
    }
}

#[wasmtime_wasi::async_trait]
impl Pollable for GuestOutput {
    async fn ready(&mut self) {}
}

impl OutputStream for GuestOutput {
    fn write(&mut self, bytes: bytes::Bytes) -> StreamResult<()> {
        self.push(&bytes);
        Ok(())
    }

    fn flush(&mut self) -> StreamResult<()> {
        Ok(())
    }

    fn check_write(&mut self) -> StreamResult<usize> {
        // Always writable; one write at most 64 KiB (the WASI custom).
        Ok(64 << 10)
    }
}

impl tokio::io::AsyncWrite for GuestOutput {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        self.push(buf);
        std::task::Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Ready(Ok(()))
    }
}

/// Longest guest text kept in an error or a log line, in characters.
pub(crate) const MAX_GUEST_TEXT: usize = 1024;

/// `text` made safe to log and bounded: ANSI escape sequences (CSI `ESC [ …
/// final`, OSC `ESC ] … BEL|ESC \`, and two-byte `ESC x`) removed, other
/// control characters removed except newlines and tabs (which become
/// spaces), runs of blanks collapsed, trimmed, and cut to `max` characters
/// with `…` (keeping the *end* when `keep_end`: the last line of a
/// traceback names the exception).
pub(crate) fn sanitize(text: &str, max: usize, keep_end: bool) -> String {
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
    fn output_keeps_the_tail_and_never_refuses() {
        let mut o = GuestOutput::new(8);
        for _ in 0..100 {
            assert!(OutputStream::write(&mut o, bytes::Bytes::from_static(b"abc")).is_ok());
        }
        o.push(b"0123456789");
        assert_eq!(o.take(), "23456789");
        assert_eq!(o.take(), "");
        let mut none = GuestOutput::new(0);
        assert!(OutputStream::write(&mut none, bytes::Bytes::from_static(b"x")).is_ok());
        assert_eq!(none.take(), "");
    }

    #[test]
    fn sanitize_strips_escapes_and_bounds() {
        let s = "\u{1b}[31mValueError\u{1b}[0m: bad\n\tsize\u{7}\u{1b}]0;title\u{7} \u{202e}x\r\n";
        assert_eq!(sanitize(s, 100, false), "ValueError: bad size x");
        assert_eq!(sanitize("abcdefghij", 5, false), "abcd…");
        assert_eq!(sanitize("abcdefghij", 5, true), "…ghij");
        assert_eq!(sanitize("é\u{0}é", 10, false), "éé");
        assert_eq!(sanitize("", 10, true), "");
    }
}
