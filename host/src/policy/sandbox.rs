//! Sandbox limits of one policy instance and the classification of failed
//! calls.
//!
//! - Memory: [`MemoryCap`] is the store's `ResourceLimiter` (the same limits
//!   as wasmtime's `StoreLimits`, but a growth past the cap raises a typed
//!   [`MemoryLimitExceeded`] error, so it is classified as
//!   [`PolicyError::MemoryLimit`] rather than as an allocation failure inside
//!   the guest).
//! - Time: epoch deadline ([`wasmtime::Trap::Interrupt`]) and fuel
//!   ([`wasmtime::Trap::OutOfFuel`]), configured per call by the instance.
//! - Capabilities: [`deny_all_wasi`] — no files, no environment, no
//!   arguments, no network, no stdin, clocks frozen at 0, randomness a fixed
//!   sequence (so a guest importing WASI is deterministic); stdout and
//!   stderr go to a bounded in-memory buffer ([`GuestOutput`]) whose tail is
//!   attached to the error of a failed call.
//!
//! [`classify`] maps an error of a call to a [`PolicyError`] by type, never by
//! message text.

use wasmtime::Trap;
use wasmtime_wasi::{Deterministic, HostMonotonicClock, HostWallClock, WasiCtx, WasiCtxBuilder};

use super::output::GuestOutput;
use crate::decision::PolicyError;
use crate::text::{tidy, MAX_MESSAGE_CHARS};

/// A policy tried to grow its memory past the cap.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("linear memory would grow to {desired} bytes, over the cap of {cap} bytes")]
pub struct MemoryLimitExceeded {
    /// Size asked for.
    pub desired: usize,
    /// The cap.
    pub cap: usize,
}

/// The resource limiter of a policy store.
#[derive(Debug, Clone)]
pub(crate) struct MemoryCap {
    pub max_memory: usize,
    pub max_table_elements: usize,
    /// Bytes of linear memory in use (all memories of the instance).
    pub used: usize,
    /// Set when a growth was refused (kept for reports).
    pub hit: bool,
}

impl MemoryCap {
    pub(crate) fn new(max_memory: usize, max_table_elements: usize) -> Self {
        MemoryCap { max_memory, max_table_elements, used: 0, hit: false }
    }
}

impl wasmtime::ResourceLimiter for MemoryCap {
    fn memory_growing(&mut self, current: usize, desired: usize, _maximum: Option<usize>) -> wasmtime::Result<bool> {
        let total = self.used.saturating_sub(current).saturating_add(desired);
        if total > self.max_memory {
            self.hit = true;
            return Err(wasmtime::Error::new(MemoryLimitExceeded { desired: total, cap: self.max_memory }));
        }
        self.used = total;
        Ok(true)
    }

    fn table_growing(&mut self, _current: usize, desired: usize, _maximum: Option<usize>) -> wasmtime::Result<bool> {
        Ok(desired <= self.max_table_elements)
    }

    fn instances(&self) -> usize {
        64
    }

    fn tables(&self) -> usize {
        64
    }

    fn memories(&self) -> usize {
        16
    }
}

/// Classifies the error of a policy call by its type.
pub(crate) fn classify(policy: &str, err: &wasmtime::Error, guest_said: Option<&str>) -> PolicyError {
    match err.downcast_ref::<Trap>() {
        Some(Trap::Interrupt) => PolicyError::Deadline,
        Some(Trap::OutOfFuel) => PolicyError::OutOfFuel,
        _ if err.downcast_ref::<MemoryLimitExceeded>().is_some() => PolicyError::MemoryLimit,
        _ => PolicyError::Trap(crate::text::message(&format!("policy `{policy}`: {}", describe(err, guest_said)))),
    }
}

/// What the guest said about a failed call: the last message it logged at
/// error level (an SDK panic message, a JavaScript exception reported by
/// its guard) and the tail of what it wrote to stdout/stderr during the
/// call (a Python traceback), sanitized and bounded; `None` when neither.
pub(crate) fn guest_said(logged: Option<&str>, output: &str) -> Option<String> {
    let output = tidy(output, MAX_MESSAGE_CHARS, true);
    let logged = logged.map(|l| tidy(l, MAX_MESSAGE_CHARS, false)).filter(|l| !l.is_empty());
    match (logged, output.is_empty()) {
        (None, true) => None,
        (Some(l), true) => Some(format!("it logged: {l}")),
        (None, false) => Some(format!("it wrote: {output}")),
        (Some(l), false) => Some(format!("it logged: {l}; it wrote: {output}")),
    }
}

/// The cause of a failed call in words: the trap (and what the guest said
/// just before, see [`guest_said`]), the limit, or wasmtime's message.
pub(crate) fn describe(err: &wasmtime::Error, guest_said: Option<&str>) -> String {
    let what = match err.downcast_ref::<Trap>() {
        Some(Trap::Interrupt) => PolicyError::Deadline.to_string(),
        Some(Trap::OutOfFuel) => PolicyError::OutOfFuel.to_string(),
        Some(trap) => trap.to_string(),
        None => match err.downcast_ref::<MemoryLimitExceeded>() {
            Some(m) => format!("{}: {m}", PolicyError::MemoryLimit),
            None => format!("{err:#}"),
        },
    };
    match guest_said {
        Some(said) => format!("{what} ({said})"),
        None => what,
    }
}

/// A clock that always reads 0: policies see the logical clock only.
struct FrozenClock;

impl HostWallClock for FrozenClock {
    fn resolution(&self) -> std::time::Duration {
        std::time::Duration::from_secs(1)
    }
    fn now(&self) -> std::time::Duration {
        std::time::Duration::ZERO
    }
}

impl HostMonotonicClock for FrozenClock {
    fn resolution(&self) -> u64 {
        1_000_000_000
    }
    fn now(&self) -> u64 {
        0
    }
}

/// A WASI context that grants nothing (see the module documentation);
/// stdout and stderr go to `output`.
pub(crate) fn deny_all_wasi(output: &GuestOutput) -> WasiCtx {
    let mut b = WasiCtxBuilder::new();
    b.stdout(output.clone()).stderr(output.clone());
    b.allow_tcp(false)
        .allow_udp(false)
        .allow_ip_name_lookup(false)
        .wall_clock(FrozenClock)
        .monotonic_clock(FrozenClock)
        .secure_random(Deterministic::new(vec![0x5a, 0x17, 0xc3, 0x88, 0x21, 0x9e, 0x4d, 0xf0]))
        .insecure_random(Deterministic::new(vec![0x3c, 0xa5, 0x12, 0x7e]))
        .insecure_random_seed(0x7761_736d_656d)
        .max_random_size(1 << 16);
    b.build()
}
