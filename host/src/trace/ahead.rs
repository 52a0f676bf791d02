//! Reading a trace on a second thread, ahead of its consumer.
//!
//! [`ReadAhead`] runs an event stream (a [`super::TraceReader`], a
//! [`super::cache::CachedTrace`]) on a thread of its own and hands its events
//! over in batches, so that parsing (or decoding) overlaps the replay that
//! consumes the events. The events and the error, if any, arrive exactly as
//! the stream yields them: after an error the stream ends.
//!
//! Bounds: at most [`DEPTH`] batches of [`BATCH`] events are in flight, and
//! their buffers are handed back and reused. Dropping the `ReadAhead` stops
//! the thread at its next batch (a cache entry it was writing is then
//! abandoned, as when any stream stops early). A panic of the reading thread
//! (a bug: the readers do not panic on any input) is resumed in the
//! consumer.

use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::thread::JoinHandle;

use super::{Event, TraceError};

/// Events per batch (80 KiB of events: below the usual threshold at which
/// `malloc` maps memory).
pub const BATCH: usize = 2048;
/// Batches in flight between the threads.
pub const DEPTH: usize = 4;

/// What the reading thread sends.
enum Msg {
    /// The next events (never empty).
    Events(Vec<Event>),
    /// The stream's error, after which it ends.
    Error(TraceError),
}

/// An event stream read on its own thread (see the module documentation).
pub struct ReadAhead {
    rx: Receiver<Msg>,
    /// Emptied buffers for the thread to reuse.
    spare: SyncSender<Vec<Event>>,
    batch: Vec<Event>,
    /// Events of `batch` delivered.
    pos: usize,
    error: Option<TraceError>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for ReadAhead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReadAhead").field("buffered", &(self.batch.len() - self.pos)).finish_non_exhaustive()
    }
}

impl ReadAhead {
    /// Starts reading `stream` on a new thread. Fails only when the thread
    /// cannot be created (the stream is then dropped).
    pub fn spawn<I>(stream: I) -> std::io::Result<ReadAhead>
    where
        I: Iterator<Item = Result<Event, TraceError>> + Send + 'static,
    {
        let (tx, rx) = sync_channel(DEPTH);
        let (spare, spares) = sync_channel::<Vec<Event>>(DEPTH + 1);
        let thread = std::thread::Builder::new()
            .name("wasmem-trace-read".into())
            .spawn(move || produce(stream, &tx, &spares))?;
        Ok(ReadAhead { rx, spare, batch: Vec::new(), pos: 0, error: None, thread: Some(thread) })
    }
}

/// The reading thread: batches of events, then the error if there is one.
fn produce<I>(mut stream: I, tx: &SyncSender<Msg>, spares: &Receiver<Vec<Event>>)
where
    I: Iterator<Item = Result<Event, TraceError>>,
{
    loop {
        let mut batch = spares.try_recv().unwrap_or_else(|_| Vec::with_capacity(BATCH));
        batch.clear();
        let mut error = None;
        while batch.len() < BATCH {
            match stream.next() {
                Some(Ok(e)) => batch.push(e),
                Some(Err(e)) => {
                    error = Some(e);
                    break;
                }
                None => break,
            }
        }
        let last = batch.len() < BATCH;
        if !batch.is_empty() && tx.send(Msg::Events(batch)).is_err() {
            return;
        }
        if let Some(e) = error {
            let _ = tx.send(Msg::Error(e));
            return;
        }
        if last {
            return;
        }
    }
}

impl Iterator for ReadAhead {
    type Item = Result<Event, TraceError>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            if let Some(&e) = self.batch.get(self.pos) {
                self.pos += 1;
                return Some(Ok(e));
            }
            if let Some(e) = self.error.take() {
                return Some(Err(e));
            }
            let msg = self.rx.recv();
            // Hand the emptied buffer back (dropped when the thread has enough).
            let mut used = std::mem::take(&mut self.batch);
            self.pos = 0;
            if used.capacity() >= BATCH {
                used.clear();
                let _ = self.spare.try_send(used);
            }
            match msg {
                Ok(Msg::Events(b)) => self.batch = b,
                Ok(Msg::Error(e)) => self.error = Some(e),
                Err(_) => {
                    // The thread is done; a panic there is resumed here.
                    if let Some(t) = self.thread.take() {
                        if let Err(panic) = t.join() {
                            std::panic::resume_unwind(panic);
                        }
                    }
                    return None;
                }
            }
        }
    }
}

impl std::iter::FusedIterator for ReadAhead {}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::TraceErrorKind;

    fn events(n: u64) -> Vec<Event> {
        (0..n).map(|id| Event::Free { id, t_us: Some(id) }).collect()
    }

    #[test]
    fn delivers_every_event_in_order() {
        for n in [0, 1, BATCH as u64 - 1, BATCH as u64, BATCH as u64 * 5 + 3] {
            let ev = events(n);
            let got: Vec<Event> =
                ReadAhead::spawn(ev.clone().into_iter().map(Ok)).unwrap().map(Result::unwrap).collect();
            assert_eq!(got, ev);
        }
    }

    #[test]
    fn the_error_comes_after_the_events_before_it() {
        let n = BATCH as u64 + 10;
        let stream = events(n).into_iter().map(Ok).chain(std::iter::once(Err(TraceError {
            file: "f".into(),
            line: 7,
            kind: TraceErrorKind::Empty,
        })));
        let mut r = ReadAhead::spawn(stream.chain(events(3).into_iter().map(Ok))).unwrap();
        for e in events(n) {
            assert_eq!(r.next().unwrap().unwrap(), e);
        }
        assert_eq!(r.next().unwrap().unwrap_err().to_string(), "f:7: empty trace: missing header line");
        assert!(r.next().is_none());
        assert!(r.next().is_none());
    }

    #[test]
    fn dropping_it_early_stops_the_thread() {
        let mut r = ReadAhead::spawn((0..).map(|id| Ok(Event::Free { id, t_us: None }))).unwrap();
        assert!(r.next().is_some());
        drop(r);
    }
}
