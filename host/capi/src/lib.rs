//! # wasmem-capi
//!
//! The C ABI of the wasmem engine, built as `libwasmem_capi.so`: a PyTorch
//! [`CUDAPluggableAllocator`] whose placement, reclamation and eviction
//! decisions are made by wasmem policies (built-in or WebAssembly).
//!
//! ```python
//! import torch
//! alloc = torch.cuda.memory.CUDAPluggableAllocator(
//!     "target/release/libwasmem_capi.so", "wasmem_malloc", "wasmem_free")
//! torch.cuda.memory.change_current_allocator(alloc)   # before any CUDA allocation
//! ```
//!
//! ## Exported symbols (exactly these)
//!
//! | C signature | what it does |
//! |---|---|
//! | `void* wasmem_malloc(ssize_t size, int device, cudaStream_t stream)` | allocates `size` bytes on `device` for `stream`; null for a zero size (no error) and on failure (negative size, out of memory, another device, no CUDA: logged) |
//! | `void wasmem_free(void* ptr, ssize_t size, int device, cudaStream_t stream)` | frees `ptr`; null is a no-op; a pointer not handed out here or already freed is logged and ignored |
//! | `int wasmem_stats_json(char* buf, size_t len)` | the statistics as one JSON object; returns its length in bytes (without the NUL), and wrote it with a NUL iff that length is `< len`, else wrote an empty string (when `len > 0`); `-1` on failure. `buf` may be null to ask for the length |
//! | `int wasmem_dump_trace(const char* path)` | writes the allocations and frees seen so far as a trace v1 (`.gz`: compressed) to `path` (null: to `WASMEM_TRACE_OUT`); `0`, or `-1` (tracing off, I/O error: logged) |
//! | `int wasmem_swap_policy(const char* spec)` | resolves a policy spec (as `WASMEM_POLICY`) and swaps in the roles it provides between two decisions (the engine's one swap: state carried between instances of the same policy); `0`, or `-1` with the old policies kept (logged) |
//!
//! The signatures of `wasmem_malloc` and `wasmem_free` are those
//! `CUDAPluggableAllocator` calls (it passes `size_t`; a value above
//! `SSIZE_MAX` arrives negative and is refused).
//!
//! ## Configuration (environment, read at the first call)
//!
//! | variable | meaning | default |
//! |---|---|---|
//! | `WASMEM_POLICY` | policy spec: built-in (`naive`, `pytorch`, `lifecycle`), shipped name, `.wasm` path, `a+b` | `lifecycle` |
//! | `WASMEM_DEVICE` | `cuda`, or `sim` (simulated device: addresses are not memory; for tests) | `cuda` |
//! | `WASMEM_SIM_CAPACITY` | capacity of `sim`, e.g. `8GiB` | `80GiB` |
//! | `WASMEM_TRACE_OUT` | tracing on; the trace is written there at process exit | off |
//! | `WASMEM_LOG` | log filter (`tracing` syntax), to stderr | `warn` |
//!
//! ## Behaviour
//!
//! - The device is opened at the first allocation, on the device it names;
//!   the library serves that one device and refuses requests for others.
//! - Requests are rounded up to 512 bytes ([`state::ALIGN`]), so every pointer
//!   is 512-byte aligned whatever the policy's rounding; the statistics count
//!   rounded bytes, the trace records the requested bytes with kind `other`.
//! - Each distinct `cudaStream_t` becomes a wasmem stream (the null stream is
//!   stream 0); freed blocks are reused on their own stream only, as in
//!   PyTorch's caching allocator. Pointers never move (no defragmentation or
//!   eviction is run behind PyTorch's back).
//! - Errors never unwind across the C boundary: every export runs inside
//!   `catch_unwind`; a failure returns null / `-1` and is logged (repeating
//!   causes once at `error` level, then at `debug`), and counted under
//!   `errors` in the stats JSON.
//! - When tracing is on, events are kept in memory for the life of the
//!   process (about 40 bytes per allocation and free).
//!
//! [`CUDAPluggableAllocator`]: https://pytorch.org/docs/stable/notes/cuda.html#using-custom-memory-allocators-for-cuda

#![warn(missing_docs)]

pub mod config;
pub mod engine;
pub mod log;
pub mod state;

use std::ffi::{c_char, c_int, c_void, CStr};
use std::os::unix::ffi::OsStrExt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard, OnceLock, PoisonError};

use config::Config;
use log::Cause;
use state::{Failure, State};

static STATE: OnceLock<Result<Mutex<State>, String>> = OnceLock::new();

/// The process-wide state, created (configuration read, policy resolved,
/// exit hook registered) on first use.
fn state() -> Result<&'static Mutex<State>, Failure> {
    STATE
        .get_or_init(|| {
            log::init();
            let config = Config::from_env().map_err(|e| e.to_string())?;
            let tracing_on = config.trace_out.is_some();
            let s = State::new(config).map_err(|e| e.to_string())?;
            if tracing_on {
                register_exit_hook();
            }
            Ok(Mutex::new(s))
        })
        .as_ref()
        .map_err(|e| Failure::new(Cause::Init, e.clone()))
}

/// Locks the state. A panic caught earlier may have poisoned the lock; the
/// state is still used (each operation leaves it consistent before it can panic).
fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Runs `f` and turns a failure or a panic into `fail`, logged under `what`.
fn guard<R>(what: &str, fail: R, f: impl FnOnce() -> Result<R, Failure>) -> R {
    let (cause, msg) = match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(r)) => return r,
        Ok(Err(e)) => (e.cause, e.msg),
        Err(p) => {
            let m = p.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| p.downcast_ref::<String>().cloned());
            (Cause::Panic, format!("panic: {}", m.unwrap_or_else(|| "(no message)".into())))
        }
    };
    let _ = catch_unwind(AssertUnwindSafe(|| log::report(cause, format!("{what}: {msg}"))));
    fail
}

/// Copies `bytes` and a NUL into `buf` if they fit in `len` bytes, else
/// writes an empty string there (when `len > 0`).
///
/// # Safety
/// `buf` is null, or valid for writes of `len` bytes.
unsafe fn copy_out(buf: *mut c_char, len: usize, bytes: &[u8]) {
    if buf.is_null() || len == 0 {
        return;
    }
    if bytes.len() < len {
        // SAFETY: `bytes.len() + 1 <= len` bytes of `buf` are writable (caller);
        // a Rust slice never overlaps the caller's buffer.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), buf.cast::<u8>(), bytes.len());
            *buf.add(bytes.len()) = 0;
        }
    } else {
        // SAFETY: `len >= 1` bytes of `buf` are writable (caller).
        unsafe { *buf = 0 };
    }
}

/// Reads a C string argument.
///
/// # Safety
/// `p` is null or points to a NUL-terminated string valid for the call.
unsafe fn c_str<'a>(p: *const c_char, what: &str) -> Result<&'a CStr, Failure> {
    if p.is_null() {
        return Err(Failure::new(Cause::BadArgument, format!("{what} is null")));
    }
    // SAFETY: non-null and NUL-terminated (caller).
    Ok(unsafe { CStr::from_ptr(p) })
}

/// Allocates `size` bytes on CUDA device `device` for work on `stream`
/// (PyTorch's `CUDAPluggableAllocator` allocation function).
///
/// Returns null for `size == 0` (no error, as PyTorch's own allocator), and
/// on failure: a negative size, out of memory after every remedy, a request
/// for another device than the first one used, no usable CUDA device, or a
/// configuration error. Failures are logged and counted.
#[no_mangle]
pub extern "C" fn wasmem_malloc(size: isize, device: i32, stream: *mut c_void) -> *mut c_void {
    if size == 0 {
        return std::ptr::null_mut();
    }
    guard("wasmem_malloc", std::ptr::null_mut(), || {
        let addr = lock(state()?).malloc(size, device, stream as usize)?;
        Ok(addr as usize as *mut c_void)
    })
}

/// Frees `ptr`, which [`wasmem_malloc`] returned with this `size`, `device`
/// and `stream` (PyTorch's `CUDAPluggableAllocator` free function).
///
/// A null `ptr` is a no-op. A pointer not allocated here, or already freed,
/// changes nothing and is logged. The block is reused by later requests on
/// the same stream only (stream order makes that safe without a sync).
#[no_mangle]
pub extern "C" fn wasmem_free(ptr: *mut c_void, size: isize, device: i32, stream: *mut c_void) {
    if ptr.is_null() {
        return;
    }
    let _ = stream; // the allocation's own stream is known from `ptr`
    guard("wasmem_free", (), || lock(state()?).free(ptr as usize as u64, size, device));
}

/// Writes the allocator statistics as a JSON object into `buf` (see the
/// crate documentation for the keys). Returns the JSON's length in bytes
/// without the terminating NUL; the JSON and a NUL were written iff that
/// length is less than `len` (else, when `len > 0`, an empty string was).
/// Returns -1 on failure.
///
/// # Safety
/// `buf` is null or valid for writes of `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn wasmem_stats_json(buf: *mut c_char, len: usize) -> c_int {
    guard("wasmem_stats_json", -1, || {
        let json = lock(state()?).stats_json().to_string();
        let n = c_int::try_from(json.len())
            .map_err(|_| Failure::new(Cause::BadArgument, "the statistics do not fit in an int"))?;
        // SAFETY: forwarded from this function's contract.
        unsafe { copy_out(buf, len, json.as_bytes()) };
        Ok(n)
    })
}

/// Writes a trace v1 file: from the first allocation on, every allocation
/// (kind `other`, its stream) and free. `path` null: the `WASMEM_TRACE_OUT`
/// path. Tracing is on iff `WASMEM_TRACE_OUT` was set at the first call.
/// Returns 0, or -1 on failure (logged).
///
/// # Safety
/// `path` is null or a NUL-terminated string valid for the call.
#[no_mangle]
pub unsafe extern "C" fn wasmem_dump_trace(path: *const c_char) -> c_int {
    guard("wasmem_dump_trace", -1, || {
        let path = if path.is_null() {
            None
        } else {
            // SAFETY: non-null and NUL-terminated (this function's contract).
            let p = unsafe { c_str(path, "path") }?;
            Some(PathBuf::from(std::ffi::OsStr::from_bytes(p.to_bytes())))
        };
        dump(path.as_deref()).map(|()| 0)
    })
}

/// Resolves the policy `spec` (a built-in name, a shipped policy name, a
/// `.wasm` path, or parts joined by `+`, as `WASMEM_POLICY`) and swaps in
/// the roles it provides between two decisions (see `wasmem::alloc::swap`).
/// Returns 0, or -1 when the spec does not resolve (logged; the old policies stay).
///
/// # Safety
/// `spec` is null or a NUL-terminated string valid for the call.
#[no_mangle]
pub unsafe extern "C" fn wasmem_swap_policy(spec: *const c_char) -> c_int {
    guard("wasmem_swap_policy", -1, || {
        // SAFETY: this function's contract.
        let spec = unsafe { c_str(spec, "spec") }?;
        let spec = spec.to_str().map_err(|_| Failure::new(Cause::BadArgument, "spec is not UTF-8"))?;
        let m = state()?;
        // Loading a WebAssembly policy takes milliseconds: not under the lock.
        let resolved = state::resolve_spec(spec)
            .map_err(|e| Failure::new(Cause::Policy, format!("policy `{spec}` does not resolve: {e}")))?;
        lock(m).swap(resolved)?;
        tracing::info!("wasmem: swapped to policy `{}`", spec.trim());
        Ok(0)
    })
}

/// Writes the trace to `path`, or to the configured `WASMEM_TRACE_OUT`.
fn dump(path: Option<&Path>) -> Result<(), Failure> {
    let (header, events, configured) = {
        let s = lock(state()?);
        let (h, e) = s.trace_snapshot()?;
        (h, e, s.config().trace_out.clone())
    };
    let path = path.or(configured.as_deref()).ok_or_else(|| Failure::new(Cause::Trace, "no path given"))?;
    state::write_trace(path, &header, &events)?;
    tracing::info!("wasmem: wrote {} trace events to {}", events.len(), path.display());
    Ok(())
}

extern "C" {
    /// The C library's `atexit`.
    fn atexit(f: extern "C" fn()) -> c_int;
}

/// At process exit: writes the trace to `WASMEM_TRACE_OUT`.
extern "C" fn write_trace_at_exit() {
    guard("writing the trace at exit", (), || dump(None));
}

fn register_exit_hook() {
    // SAFETY: `write_trace_at_exit` is an `extern "C" fn()` that never
    // unwinds (it runs inside `guard`) and stays loaded: PyTorch never
    // unloads an allocator library.
    if unsafe { atexit(write_trace_at_exit) } != 0 {
        log::report(Cause::Trace, "atexit failed: the trace will be written only by wasmem_dump_trace");
    }
}

/// Checks the state's invariants (see [`state`]); `Ok` before the first
/// call. For tests: a Rust function, not exported from the C library.
pub fn check_state() -> Result<(), wasmem::types::InvariantError> {
    match STATE.get() {
        Some(Ok(m)) => lock(m).check_invariants(),
        Some(Err(e)) => Err(wasmem::types::InvariantError(format!("not initialized: {e}"))),
        None => Ok(()),
    }
}
