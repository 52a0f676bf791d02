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
//! [`crate::text::tidy`] bounds a guest's text and removes what could corrupt a log or
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
}
