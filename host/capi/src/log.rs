//! The library's log and its error counters.
//!
//! Every refused or failed call is counted under a [`Cause`]. Causes that can
//! repeat on every allocation (out of memory, a free of an unknown pointer…)
//! are logged at `error` level the first time and at `debug` level after
//! that, so that a training loop does not flood stderr; the counts appear in
//! the stats JSON under `errors`. Explicit requests (a policy swap, a trace
//! dump) are logged every time.

use std::collections::BTreeMap;
use std::sync::{Mutex, Once, PoisonError};

/// Why a call was refused or failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Cause {
    /// The configuration or the device could not be set up.
    Init,
    /// A negative size was requested.
    NegativeSize,
    /// A request for another device than the one the library serves.
    WrongDevice,
    /// The allocator could not find the memory.
    OutOfMemory,
    /// The allocator refused the request for another reason.
    AllocFailed,
    /// A free of a pointer this library did not hand out (or already freed).
    UnknownPointer,
    /// The allocator failed to free a known pointer.
    FreeFailed,
    /// A null or non-UTF-8 argument where a string was expected.
    BadArgument,
    /// A policy spec that does not resolve.
    Policy,
    /// A trace could not be written (or tracing is off).
    Trace,
    /// A panic inside the library, caught at the C boundary.
    Panic,
}

impl Cause {
    /// The key of this cause in the stats JSON.
    pub fn key(self) -> &'static str {
        match self {
            Cause::Init => "init",
            Cause::NegativeSize => "negative_size",
            Cause::WrongDevice => "wrong_device",
            Cause::OutOfMemory => "out_of_memory",
            Cause::AllocFailed => "alloc_failed",
            Cause::UnknownPointer => "unknown_pointer",
            Cause::FreeFailed => "free_failed",
            Cause::BadArgument => "bad_argument",
            Cause::Policy => "policy",
            Cause::Trace => "trace",
            Cause::Panic => "panic",
        }
    }

    /// Whether every occurrence is logged at `error` level (not only the first).
    fn always_logged(self) -> bool {
        matches!(self, Cause::Policy | Cause::Trace | Cause::Panic | Cause::BadArgument)
    }
}

static COUNTS: Mutex<BTreeMap<Cause, u64>> = Mutex::new(BTreeMap::new());

/// Installs the log subscriber (stderr, filter from `WASMEM_LOG`, default
/// `warn`) once per process. Does nothing if the process already has one.
pub fn init() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let filter = tracing_subscriber::EnvFilter::try_from_env("WASMEM_LOG")
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
        let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
        let _ =
            tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(ansi).try_init();
    });
}

/// Counts an error of `cause` and logs `msg` (see the module documentation
/// for when it is logged at `error` level).
pub fn report(cause: Cause, msg: impl std::fmt::Display) {
    init();
    let n = {
        let mut counts = COUNTS.lock().unwrap_or_else(PoisonError::into_inner);
        let n = counts.entry(cause).or_insert(0);
        *n += 1;
        *n
    };
    if n == 1 && !cause.always_logged() {
        tracing::error!("wasmem: {msg} (further `{}` errors are logged at debug level)", cause.key());
    } else if cause.always_logged() {
        tracing::error!("wasmem: {msg}");
    } else {
        tracing::debug!("wasmem: {msg}");
    }
}

/// The error counts so far, by cause key.
pub fn counts() -> BTreeMap<&'static str, u64> {
    COUNTS.lock().unwrap_or_else(PoisonError::into_inner).iter().map(|(c, n)| (c.key(), *n)).collect()
}
