//! The store data of a policy instance and the host imports
//! (`wasmem:policy/host`, the same for every WIT version): `log` (to
//! `tracing`, rate limited), `stats` (the context of the current call) and
//! `clock` (its logical clock).

use std::time::Instant;

use wasmtime::component::ResourceTable;
use wasmtime_wasi::{WasiCtx, WasiCtxView, WasiView};

use super::bindings::{v0_1, v0_2, v0_3, v0_4, GuestLogLevel};
use super::output::GuestOutput;
use super::sandbox::{deny_all_wasi, MemoryCap};
use crate::decision::PolicyContext;
use crate::text::{tidy, MAX_MESSAGE_CHARS};

/// A one-second window of log messages.
#[derive(Debug)]
struct LogBudget {
    per_second: u32,
    window_start: Option<Instant>,
    in_window: u32,
    dropped: u64,
}

impl LogBudget {
    /// Whether one more message may be written now; reports drops when a
    /// new window opens.
    fn admit(&mut self, policy: &str) -> bool {
        let now = Instant::now();
        let fresh = self.window_start.is_none_or(|s| now.duration_since(s).as_secs() >= 1);
        if fresh {
            if self.dropped > 0 {
                tracing::warn!(policy, dropped = self.dropped, "policy log messages dropped by the rate limit");
                self.dropped = 0;
            }
            self.window_start = Some(now);
            self.in_window = 0;
        }
        if self.in_window < self.per_second {
            self.in_window += 1;
            true
        } else {
            self.dropped += 1;
            false
        }
    }
}

/// Everything a policy store holds besides the instance.
pub(crate) struct HostState {
    /// Name used in logs.
    pub policy: String,
    /// The context passed to the current call (default outside calls).
    pub ctx: PolicyContext,
    /// The last `error`-level message of the current call (a guest panic
    /// message, attached to a trap report).
    pub last_error: Option<String>,
    pub limiter: MemoryCap,
    /// What the guest writes to stdout and stderr (bounded).
    pub output: GuestOutput,
    /// [`GuestOutput::written`] when the current call started.
    pub output_mark: u64,
    /// Epoch ticks of the one extension a call may get past its deadline
    /// when the guest has started to report a failure (0: none left).
    pub grace_ticks: u64,
    log: LogBudget,
    wasi: WasiCtx,
    table: ResourceTable,
}

impl HostState {
    pub(crate) fn new(policy: String, limits: &super::Limits) -> Self {
        let output = GuestOutput::new(limits.max_guest_output);
        HostState {
            policy,
            ctx: PolicyContext::default(),
            last_error: None,
            limiter: MemoryCap::new(limits.max_memory, limits.max_table_elements),
            log: LogBudget { per_second: limits.log_per_second, window_start: None, in_window: 0, dropped: 0 },
            wasi: deny_all_wasi(&output),
            output,
            output_mark: 0,
            grace_ticks: 0,
            table: ResourceTable::new(),
        }
    }
}

impl HostState {
    /// The store's epoch deadline callback: at the deadline, a call whose
    /// guest has started to report a failure — it logged at error level or
    /// wrote to stdout/stderr during this call (a Python traceback is
    /// printed before the trap) — gets one extension of `grace_ticks`, so
    /// that the failure arrives with its text; any other call is interrupted.
    pub(crate) fn at_deadline(&mut self) -> wasmtime::UpdateDeadline {
        let reporting = self.last_error.is_some() || self.output.written() > self.output_mark;
        if reporting && self.grace_ticks > 0 {
            let t = std::mem::take(&mut self.grace_ticks);
            wasmtime::UpdateDeadline::Continue(t)
        } else {
            wasmtime::UpdateDeadline::Interrupt
        }
    }
}

impl WasiView for HostState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView { ctx: &mut self.wasi, table: &mut self.table }
    }
}

impl HostState {
    /// `host.log`: sanitized (no control characters or ANSI escapes),
    /// bounded to [`MAX_MESSAGE_CHARS`] characters, rate limited per instance.
    fn log_message(&mut self, level: GuestLogLevel, message: String) {
        let message = tidy(&message, MAX_MESSAGE_CHARS, false);
        if matches!(level, GuestLogLevel::Error) {
            self.last_error = Some(message.clone());
        }
        if !self.log.admit(&self.policy) {
            return;
        }
        let policy = self.policy.as_str();
        match level {
            GuestLogLevel::Trace => tracing::trace!(target: "wasmem::policy::guest", policy, "{message}"),
            GuestLogLevel::Debug => tracing::debug!(target: "wasmem::policy::guest", policy, "{message}"),
            GuestLogLevel::Info => tracing::info!(target: "wasmem::policy::guest", policy, "{message}"),
            GuestLogLevel::Warn => tracing::warn!(target: "wasmem::policy::guest", policy, "{message}"),
            GuestLogLevel::Error => tracing::error!(target: "wasmem::policy::guest", policy, "{message}"),
        }
    }
}

/// The host imports of one WIT version, served by [`HostState`].
macro_rules! host_imports {
    ($v:ident) => {
        impl $v::wasmem::policy::types::Host for HostState {}

        impl $v::wasmem::policy::host::Host for HostState {
            fn log(&mut self, level: $v::LogLevel, message: String) {
                self.log_message($v::level_from_wit(level), message)
            }

            fn stats(&mut self) -> $v::wit::PolicyContext {
                $v::context_to_wit(&self.ctx)
            }

            fn clock(&mut self) -> u64 {
                self.ctx.clock
            }
        }
    };
}

host_imports!(v0_1);
host_imports!(v0_2);
host_imports!(v0_3);
host_imports!(v0_4);
