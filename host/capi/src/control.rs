//! The library's live control: the engine's control server
//! ([`wasmem::ctl::CtlServer`], the protocol of `wasmem train --ctl`) over
//! the devices of this process, so that `wasmem ctl status` lists them and
//! `wasmem ctl swap` swaps them with the one swap, like the ranks of a
//! `wasmem train` run. `wasmem_swap_policy` is the same swap.

use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};

use wasmem::ctl::status::shadow_summary;
use wasmem::ctl::{prepare_swap, Control, CtlServer, RoleArg, ServerError, ServerOptions, Status, SwapOutcome};
use wasmem::policy::GlobalRuntime;

use crate::log::Cause;
use crate::state::Failure;
use crate::{lock, state};

/// The control of this process's devices.
#[derive(Debug, Clone, Copy, Default)]
pub struct LibraryControl;

/// Swaps `role` to `spec` on every open device, and on those that open later.
/// The spec is resolved once per device outside the library's lock; if a
/// device opens meanwhile, it is prepared again.
pub fn swap_all(role: RoleArg, spec: &str) -> Result<SwapOutcome, Failure> {
    let m = state()?;
    for _ in 0..4 {
        let (first, devices) = lock(m).swap_inputs();
        let prepared = prepare_swap(first, devices.len(), role, spec, &GlobalRuntime)
            .map_err(|e| Failure::new(Cause::Policy, format!("policy `{spec}`: {e}")))?;
        let mut s = lock(m);
        if s.open_devices() == devices {
            return s.apply_swap(prepared, &devices, role, spec);
        }
    }
    Err(Failure::new(Cause::Policy, format!("swap to `{spec}`: devices kept opening while it was prepared")))
}

impl Control for LibraryControl {
    fn swap(&self, role: RoleArg, policy: &str) -> Result<SwapOutcome, String> {
        let r = swap_all(role, policy);
        match &r {
            Ok(_) => tracing::info!("wasmem: swapped to policy `{}` through the control socket", policy.trim()),
            Err(f) => crate::log::report(f.cause, format!("ctl swap: {}", f.msg)),
        }
        r.map_err(|f| f.msg)
    }

    fn status(&self) -> Status {
        let Ok(m) = state() else {
            return Status { pid: std::process::id(), ..Status::default() };
        };
        let (rank, (devices, step)) = {
            let s = lock(m);
            (s.config().rank, s.status_inputs())
        };
        let as_rank = rank.unwrap_or(0) as usize;
        let mut out = Status { pid: std::process::id(), process_rank: rank, step, ..Status::default() };
        for (index, alloc, shadow) in devices {
            let device = u32::try_from(index).ok();
            let mut r = alloc.status(as_rank);
            r.device = device;
            out.ranks.push(r);
            if let Some(h) = shadow {
                let mut sh = shadow_summary(as_rank, &h);
                sh.device = device;
                out.shadows.push(sh);
            }
        }
        out
    }
}

static SERVER: Mutex<Option<CtlServer>> = Mutex::new(None);

/// Serves the control socket at `path` (once per process).
pub fn start(path: &Path) -> Result<(), ServerError> {
    let mut g = SERVER.lock().unwrap_or_else(PoisonError::into_inner);
    if g.is_some() {
        return Ok(());
    }
    *g = Some(CtlServer::start(path, Arc::new(LibraryControl), ServerOptions::default())?);
    Ok(())
}

/// The socket served, if any.
pub fn socket() -> Option<String> {
    SERVER.lock().unwrap_or_else(PoisonError::into_inner).as_ref().map(|s| s.path().display().to_string())
}

/// Stops the server and removes its socket (at exit).
pub fn stop() {
    let server = SERVER.lock().unwrap_or_else(PoisonError::into_inner).take();
    drop(server);
}
