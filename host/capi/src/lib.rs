//! # wasmem-capi
//!
//! The C ABI of the wasmem engine, built as `libwasmem_capi.so`: a PyTorch
//! [`CUDAPluggableAllocator`] whose placement, reclamation and eviction
//! decisions are made by wasmem policies (built-in or WebAssembly), with what
//! the Python package `wasmem` (`python/`) builds on: settings at start-up,
//! the kind of the next allocations, re-tagging, phase marks, PyTorch's
//! memory statistics and snapshots, live control, a shadow policy, and
//! recorders for runs without a GPU.
//!
//! ```python
//! import wasmem.torch
//! wasmem.torch.enable(policy="defrag")   # before any CUDA work
//! ```
//!
//! ## Exported symbols (exactly these)
//!
//! Kinds are codes: 0 `param`, 1 `grad`, 2 `optim`, 3 `activation`, 4 `temp`,
//! 5 `other`; -1 means "none". Functions that return `int` return `-1` on
//! failure; [`wasmem_last_error`] then gives the message (also logged).
//!
//! | C signature | what it does |
//! |---|---|
//! | `void* wasmem_malloc(ssize_t size, int device, cudaStream_t stream)` | allocates `size` bytes on `device` for `stream`, of the calling thread's current kind (else the default kind); null for a zero size (no error) and on failure (negative size, out of memory, no such device, no CUDA: logged) |
//! | `void wasmem_free(void* ptr, ssize_t size, int device, cudaStream_t stream)` | frees `ptr`; null is a no-op; a pointer not handed out here or already freed is logged and ignored |
//! | `int wasmem_init(const char* json)` | configures the library before its first use: a JSON object of settings (`policy`, `shadow`, `device`, `sim_capacity`, `sim_devices`, `trace`, `trace_out`, `ctl`, `rank`) over the environment's; `-1` when it was already configured (an earlier `wasmem_init` or any other call) or a setting is bad |
//! | `int wasmem_last_error(char* buf, size_t len)` | the message of this thread's last failure, written as [`wasmem_stats_json`] writes |
//! | `int wasmem_stats_json(char* buf, size_t len)` | the statistics as one JSON object (per device under `devices`, sums at the top); returns its length in bytes (without the NUL), and wrote it with a NUL iff that length is `< len`, else wrote an empty string (when `len > 0`); `-1` on failure. `buf` may be null to ask for the length |
//! | `int wasmem_set_kind(int kind)` | sets the calling thread's current kind (-1: none); returns the previous code |
//! | `int wasmem_set_default_kind(int kind)` | sets the kind of allocations made without a current kind; returns the previous code |
//! | `int wasmem_retag(void* ptr, int device, int kind)` | gives the live storage at `ptr` the kind `kind` (allocator and trace); `1`, or `0` when `ptr` is not a live pointer of this library |
//! | `int wasmem_phase(const char* name, uint64_t step)` | marks a phase (`forward`, `backward`, `optimizer`, `step_end`) of `step` on every device, its shadow and its trace |
//! | `int64_t wasmem_empty_cache(int device)` | releases the cached memory of `device` (-1: every device) through the reclamation path; returns the bytes released |
//! | `int wasmem_reset_peaks(int device)` | peaks back to the current values (-1: every device) |
//! | `int wasmem_record_history(size_t max)` | keeps the last `max` allocator actions per device for snapshots (0: off) |
//! | `int64_t wasmem_snapshot(int device, char* buf, size_t len)` | the memory snapshot of `device` as a pickle of `torch.cuda.memory._snapshot()`'s shape; returns its length, and wrote it iff that length is `<= len` |
//! | `int wasmem_dump_trace(const char* path)` | writes the trace v1 recorded so far (`.gz`: compressed) to `path` (null: to the configured `trace_out`); a second device's trace goes beside it (`<stem>.dev<N>.jsonl`) |
//! | `int wasmem_swap_policy(const char* spec)` | resolves a policy spec and swaps every device to the roles it provides (the engine's one swap, as `wasmem ctl swap`); later devices open with it too |
//! | `int64_t wasmem_recorder_open(const char* source)` | opens a recorder (a trace written by a client that sees storages itself: PyTorch's meta device); returns its handle |
//! | `int64_t wasmem_recorder_alloc(int64_t h, uint64_t bytes, int kind, uint32_t stream)` | records an allocation; returns its id |
//! | `int wasmem_recorder_free(int64_t h, uint64_t id)` | records a free |
//! | `int wasmem_recorder_retag(int64_t h, uint64_t id, int kind)` | gives a live id its kind from its allocation on |
//! | `int wasmem_recorder_phase(int64_t h, const char* name, uint64_t step)` | records a phase mark |
//! | `int wasmem_recorder_save(int64_t h, const char* path)` | writes the trace v1 so far |
//! | `int wasmem_recorder_stats(int64_t h, char* buf, size_t len)` | the recorder's counts as JSON (as [`wasmem_stats_json`] writes), and `plan`: the last plan ahead's figures |
//! | `int wasmem_recorder_plan(int64_t h, const char* options_json)` | plans ahead: replays the recording under a planner on the `sim` device into a plan cache (`plan_cache`, `policy`, `capacity`, `device`) that a live run reads |
//! | `int wasmem_recorder_close(int64_t h)` | closes a recorder |
//!
//! The signatures of `wasmem_malloc` and `wasmem_free` are those
//! `CUDAPluggableAllocator` calls (it passes `size_t`; a value above
//! `SSIZE_MAX` arrives negative and is refused).
//!
//! ## Configuration
//!
//! The environment ([`config`]), read at the first call, under the settings
//! of `wasmem_init` when that is the first call.
//!
//! ## Behaviour
//!
//! - Each device is opened at its first allocation; every device of the
//!   process gets its own allocator (and shadow, and trace), under the same
//!   policies: swaps made before a device opens are replayed on it.
//! - Requests are rounded up to 512 bytes ([`state::ALIGN`]), so every pointer
//!   is 512-byte aligned whatever the policy's rounding; the statistics count
//!   rounded bytes, the trace records the requested bytes with their kind.
//! - Each distinct `cudaStream_t` becomes a wasmem stream (the null stream is
//!   stream 0); freed blocks are reused on their own stream only, as in
//!   PyTorch's caching allocator. Pointers never move (no defragmentation or
//!   eviction is run behind PyTorch's back; planned arenas are installed
//!   without moving live tensors).
//! - With `ctl`, the process serves the control protocol of `wasmem train
//!   --ctl` on its own socket (named by `RANK`/`LOCAL_RANK`), so `wasmem ctl
//!   status` lists every rank of a node and `wasmem ctl swap` swaps them.
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
pub mod control;
pub mod device;
pub mod engine;
pub mod kind;
pub mod log;
pub mod recorder;
pub mod state;
pub mod tracelog;

use std::cell::RefCell;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::os::unix::ffi::OsStrExt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard, OnceLock, PoisonError};

use config::Config;
use log::Cause;
use state::{Failure, State};
use wasmem::types::{Phase, TensorKind};

static STATE: OnceLock<Result<Mutex<State>, String>> = OnceLock::new();

thread_local! {
    /// The message of this thread's last failure.
    static LAST_ERROR: RefCell<String> = const { RefCell::new(String::new()) };
}

/// A state for `config`, with its control socket served and its exit hook
/// registered.
fn start(config: Config) -> Result<Mutex<State>, String> {
    let ctl = config.ctl.clone();
    let s = State::new(config).map_err(|e| e.to_string())?;
    if let Some(path) = &ctl {
        control::start(path).map_err(|e| format!("control socket {}: {e}", path.display()))?;
        tracing::info!("wasmem: control socket {}", path.display());
    }
    register_exit_hook();
    Ok(Mutex::new(s))
}

/// The process-wide state, created (configuration read, policy resolved,
/// control socket served, exit hook registered) on first use.
fn state() -> Result<&'static Mutex<State>, Failure> {
    STATE
        .get_or_init(|| {
            log::init();
            start(Config::from_env().map_err(|e| e.to_string())?)
        })
        .as_ref()
        .map_err(|e| Failure::new(Cause::Init, e.clone()))
}

/// Locks the state. A panic caught earlier may have poisoned the lock; the
/// state is still used (each operation leaves it consistent before it can panic).
fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Runs `f` and turns a failure or a panic into `fail`, logged under `what`
/// and kept as this thread's last error.
fn guard<R>(what: &str, fail: R, f: impl FnOnce() -> Result<R, Failure>) -> R {
    let (cause, msg) = match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(r)) => return r,
        Ok(Err(e)) => (e.cause, e.msg),
        Err(p) => {
            let m = p.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| p.downcast_ref::<String>().cloned());
            (Cause::Panic, format!("panic: {}", m.unwrap_or_else(|| "(no message)".into())))
        }
    };
    let _ = catch_unwind(AssertUnwindSafe(|| {
        let text = format!("{what}: {msg}");
        LAST_ERROR.with(|l| l.borrow_mut().clone_from(&text));
        log::report(cause, text);
    }));
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

/// Writes `text` as [`copy_out`] does and returns its length as an `int`.
///
/// # Safety
/// As [`copy_out`].
unsafe fn text_out(buf: *mut c_char, len: usize, text: &str) -> Result<c_int, Failure> {
    let n =
        c_int::try_from(text.len()).map_err(|_| Failure::new(Cause::BadArgument, "the text does not fit in an int"))?;
    // SAFETY: forwarded from the caller.
    unsafe { copy_out(buf, len, text.as_bytes()) };
    Ok(n)
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

/// Reads a UTF-8 C string argument.
///
/// # Safety
/// As [`c_str`].
unsafe fn c_text<'a>(p: *const c_char, what: &str) -> Result<&'a str, Failure> {
    // SAFETY: forwarded from the caller.
    let s = unsafe { c_str(p, what) }?;
    s.to_str().map_err(|_| Failure::new(Cause::BadArgument, format!("{what} is not UTF-8")))
}

/// Reads a path argument.
///
/// # Safety
/// As [`c_str`].
unsafe fn c_path(p: *const c_char) -> Result<PathBuf, Failure> {
    // SAFETY: forwarded from the caller.
    let s = unsafe { c_str(p, "path") }?;
    Ok(PathBuf::from(std::ffi::OsStr::from_bytes(s.to_bytes())))
}

fn kind_arg(code: c_int) -> Result<Option<TensorKind>, Failure> {
    kind::from_code(code).map_err(|m| Failure::new(Cause::BadArgument, m))
}

fn phase_arg(name: &str) -> Result<Phase, Failure> {
    name.trim().parse::<Phase>().map_err(|m| Failure::new(Cause::BadArgument, m))
}

/// Allocates `size` bytes on CUDA device `device` for work on `stream`
/// (PyTorch's `CUDAPluggableAllocator` allocation function), of the calling
/// thread's current kind ([`wasmem_set_kind`]) or else the default kind.
///
/// Returns null for `size == 0` (no error, as PyTorch's own allocator), and
/// on failure: a negative size, out of memory after every remedy, a device
/// that cannot be opened, or a configuration error. Failures are logged and
/// counted.
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

/// Configures the library before its first use with a JSON object of
/// settings over the environment's ([`Config::apply_json`]). Returns 0, or
/// -1 when the library was already configured (by an earlier call of this or
/// any other function), or a setting is bad or its policy does not resolve;
/// then nothing is configured and a corrected call may follow.
///
/// # Safety
/// `json` is null or a NUL-terminated string valid for the call.
#[no_mangle]
pub unsafe extern "C" fn wasmem_init(json: *const c_char) -> c_int {
    guard("wasmem_init", -1, || {
        // SAFETY: this function's contract.
        let json = unsafe { c_text(json, "settings") }?;
        log::init();
        if STATE.get().is_some() {
            return Err(Failure::new(
                Cause::Init,
                "wasmem is already configured in this process (wasmem_init was called, or the library was used \
                 with its environment settings); it can be configured once per process",
            ));
        }
        let mut config = Config::from_env().map_err(|e| Failure::new(Cause::Init, e.to_string()))?;
        config.apply_json(json).map_err(|e| Failure::new(Cause::Init, e.to_string()))?;
        let s = start(config).map_err(|e| Failure::new(Cause::Init, e))?;
        STATE.set(Ok(s)).map_err(|_| Failure::new(Cause::Init, "wasmem was configured by another thread meanwhile"))?;
        Ok(0)
    })
}

/// Writes the message of the calling thread's last failure into `buf` (as
/// [`wasmem_stats_json`] writes); an empty string when there was none.
///
/// # Safety
/// `buf` is null or valid for writes of `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn wasmem_last_error(buf: *mut c_char, len: usize) -> c_int {
    let text = LAST_ERROR.with(|l| l.borrow().clone());
    // SAFETY: this function's contract.
    unsafe { text_out(buf, len, &text) }.unwrap_or(-1)
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
        let json = lock(state()?).stats_json(control::socket()).to_string();
        // SAFETY: forwarded from this function's contract.
        unsafe { text_out(buf, len, &json) }
    })
}

/// Sets the calling thread's current kind (-1: none, the default kind
/// applies); returns the previous code, or -2 for a code that is no kind.
#[no_mangle]
pub extern "C" fn wasmem_set_kind(kind: c_int) -> c_int {
    guard("wasmem_set_kind", -2, || Ok(kind::code(kind::set_current(kind_arg(kind)?))))
}

/// Sets the kind of allocations made without a current kind (not -1);
/// returns the previous code, or -2 for a code that is no kind.
#[no_mangle]
pub extern "C" fn wasmem_set_default_kind(kind: c_int) -> c_int {
    guard("wasmem_set_default_kind", -2, || {
        let k = kind_arg(kind)?.ok_or_else(|| Failure::new(Cause::BadArgument, "the default kind cannot be none"))?;
        Ok(kind::code(Some(kind::set_default(k))))
    })
}

/// Gives the live storage at `ptr` on `device` the kind `kind` (the
/// allocator's tensor and the trace's `alloc` event). Returns 1, 0 when
/// `ptr` is not a live pointer of this library (a tensor of another
/// allocator: nothing to do), -1 on failure.
#[no_mangle]
pub extern "C" fn wasmem_retag(ptr: *mut c_void, device: c_int, kind: c_int) -> c_int {
    guard("wasmem_retag", -1, || {
        let k = kind_arg(kind)?.ok_or_else(|| Failure::new(Cause::BadArgument, "cannot re-tag to no kind"))?;
        Ok(c_int::from(lock(state()?).retag(ptr as usize as u64, device, k)?))
    })
}

/// Marks phase `name` (`forward`, `backward`, `optimizer`, `step_end`) of
/// training step `step` on every open device: its reclamation policy, its
/// shadow and its trace see it. Returns 0, or -1.
///
/// # Safety
/// `name` is null or a NUL-terminated string valid for the call.
#[no_mangle]
pub unsafe extern "C" fn wasmem_phase(name: *const c_char, step: u64) -> c_int {
    guard("wasmem_phase", -1, || {
        // SAFETY: this function's contract.
        let phase = phase_arg(unsafe { c_text(name, "phase") }?)?;
        lock(state()?).phase(phase, step).map(|()| 0)
    })
}

/// Releases the cached memory of `device` (-1: every open device) through
/// the reclamation path (whole free segments and free pages; no other
/// device synchronization); returns the bytes released, or -1.
#[no_mangle]
pub extern "C" fn wasmem_empty_cache(device: c_int) -> i64 {
    guard("wasmem_empty_cache", -1, || {
        let n = lock(state()?).release_cached(device)?;
        Ok(i64::try_from(n).unwrap_or(i64::MAX))
    })
}

/// Resets the peaks of `device` (-1: every open device) to the current
/// values. Returns 0, or -1.
#[no_mangle]
pub extern "C" fn wasmem_reset_peaks(device: c_int) -> c_int {
    guard("wasmem_reset_peaks", -1, || lock(state()?).reset_peaks(device).map(|()| 0))
}

/// Keeps the last `max` allocator actions of each device for snapshots
/// (`torch.cuda.memory._record_memory_history`); 0 stops. Returns 0, or -1.
#[no_mangle]
pub extern "C" fn wasmem_record_history(max: usize) -> c_int {
    guard("wasmem_record_history", -1, || {
        lock(state()?).record_history(max);
        Ok(0)
    })
}

/// Writes the memory snapshot of `device` (its segments, blocks and recorded
/// actions) as a pickle of the shape of `torch.cuda.memory._snapshot()`
/// into `buf`. Returns the pickle's length; it was written iff that length
/// is at most `len`. Returns -1 on failure.
///
/// # Safety
/// `buf` is null or valid for writes of `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn wasmem_snapshot(device: c_int, buf: *mut c_char, len: usize) -> i64 {
    guard("wasmem_snapshot", -1, || {
        let bytes = lock(state()?).snapshot(device)?;
        if !buf.is_null() && bytes.len() <= len {
            // SAFETY: `bytes.len() <= len` bytes of `buf` are writable (this
            // function's contract); a Rust vector never overlaps it.
            unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), buf.cast::<u8>(), bytes.len()) };
        }
        i64::try_from(bytes.len()).map_err(|_| Failure::new(Cause::Trace, "the snapshot is too large"))
    })
}

/// Writes a trace v1 file: from the first allocation on, every allocation
/// (its kind, its stream), free and phase mark of each device. `path` null:
/// the configured `trace_out` path. A second device's trace goes beside it
/// ([`state::trace_path`]). Returns 0, or -1 on failure (tracing off, I/O
/// error: logged).
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
            Some(unsafe { c_path(path) }?)
        };
        dump(path.as_deref()).map(|()| 0)
    })
}

/// Resolves the policy `spec` (a built-in name, a shipped policy name, a
/// `.wasm` path, or parts joined by `+`) and swaps every open device to the
/// roles it provides between two decisions (the one swap, as `wasmem ctl
/// swap`); devices opened later open with it. Returns 0, or -1 when the spec
/// does not resolve (logged; the old policies stay).
///
/// # Safety
/// `spec` is null or a NUL-terminated string valid for the call.
#[no_mangle]
pub unsafe extern "C" fn wasmem_swap_policy(spec: *const c_char) -> c_int {
    guard("wasmem_swap_policy", -1, || {
        // SAFETY: this function's contract.
        let spec = unsafe { c_text(spec, "spec") }?;
        if spec.trim().is_empty() {
            return Err(Failure::new(Cause::Policy, "the policy spec is empty"));
        }
        control::swap_all(wasmem::ctl::RoleArg::All, spec)?;
        tracing::info!("wasmem: swapped to policy `{}`", spec.trim());
        Ok(0)
    })
}

/// Opens a recorder whose trace header says `source` (null: a default);
/// returns its handle (> 0), or -1.
///
/// # Safety
/// `source` is null or a NUL-terminated string valid for the call.
#[no_mangle]
pub unsafe extern "C" fn wasmem_recorder_open(source: *const c_char) -> i64 {
    guard("wasmem_recorder_open", -1, || {
        let source = if source.is_null() {
            "wasmem recorder".to_string()
        } else {
            // SAFETY: this function's contract.
            unsafe { c_text(source, "source") }?.to_string()
        };
        Ok(recorder::open(&source))
    })
}

/// Records an allocation of `bytes` of kind `kind` on `stream` in recorder
/// `h`; returns its id (> 0), or -1.
#[no_mangle]
pub extern "C" fn wasmem_recorder_alloc(h: i64, bytes: u64, kind: c_int, stream: u32) -> i64 {
    guard("wasmem_recorder_alloc", -1, || {
        let k = kind_arg(kind)?.unwrap_or_else(kind::for_next_allocation);
        let id = recorder::alloc(h, bytes, k, stream)?;
        i64::try_from(id).map_err(|_| Failure::new(Cause::BadArgument, "recorder ids ran out"))
    })
}

/// Records the free of id `id` in recorder `h`. Returns 0, or -1.
#[no_mangle]
pub extern "C" fn wasmem_recorder_free(h: i64, id: u64) -> c_int {
    guard("wasmem_recorder_free", -1, || recorder::free(h, id).map(|()| 0))
}

/// Gives the live id `id` of recorder `h` the kind `kind` from its
/// allocation on. Returns 0, or -1.
#[no_mangle]
pub extern "C" fn wasmem_recorder_retag(h: i64, id: u64, kind: c_int) -> c_int {
    guard("wasmem_recorder_retag", -1, || {
        let k = kind_arg(kind)?.ok_or_else(|| Failure::new(Cause::BadArgument, "cannot re-tag to no kind"))?;
        recorder::retag(h, id, k).map(|()| 0)
    })
}

/// Records phase `name` of step `step` in recorder `h`. Returns 0, or -1.
///
/// # Safety
/// `name` is null or a NUL-terminated string valid for the call.
#[no_mangle]
pub unsafe extern "C" fn wasmem_recorder_phase(h: i64, name: *const c_char, step: u64) -> c_int {
    guard("wasmem_recorder_phase", -1, || {
        // SAFETY: this function's contract.
        let phase = phase_arg(unsafe { c_text(name, "phase") }?)?;
        recorder::phase(h, phase, step).map(|()| 0)
    })
}

/// Writes the trace v1 of recorder `h` so far to `path` (`.gz`:
/// compressed). Returns 0, or -1.
///
/// # Safety
/// `path` is null or a NUL-terminated string valid for the call.
#[no_mangle]
pub unsafe extern "C" fn wasmem_recorder_save(h: i64, path: *const c_char) -> c_int {
    guard("wasmem_recorder_save", -1, || {
        // SAFETY: this function's contract.
        let path = unsafe { c_path(path) }?;
        recorder::save(h, &path).map(|()| 0)
    })
}

/// Writes the counts of recorder `h` as JSON (as [`wasmem_stats_json`]
/// writes). Returns the length, or -1.
///
/// # Safety
/// `buf` is null or valid for writes of `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn wasmem_recorder_stats(h: i64, buf: *mut c_char, len: usize) -> c_int {
    guard("wasmem_recorder_stats", -1, || {
        let json = recorder::stats(h)?.to_string();
        // SAFETY: this function's contract.
        unsafe { text_out(buf, len, &json) }
    })
}

/// Plans ahead from recorder `h`: replays its trace so far under a policy
/// with a planner on a simulated device, and writes the plans to a plan
/// cache that a live run reads to be planned from its first request.
/// `options` is a JSON object: `plan_cache` (required; `{rank}` and
/// `{device}` are replaced), `policy` (default `planned`), `capacity`
/// (bytes or a size string; default 80 GiB), `device` (ordinal for
/// `{device}`). The run's figures appear under `plan` in
/// [`wasmem_recorder_stats`]. Returns 0, or -1.
///
/// # Safety
/// `options` is null or a NUL-terminated string valid for the call.
#[no_mangle]
pub unsafe extern "C" fn wasmem_recorder_plan(h: i64, options: *const c_char) -> c_int {
    guard("wasmem_recorder_plan", -1, || {
        // SAFETY: this function's contract.
        let options = unsafe { c_text(options, "options") }?;
        recorder::plan(h, options).map(|_| 0)
    })
}

/// Closes recorder `h` (its trace is dropped). Returns 0, or -1.
#[no_mangle]
pub extern "C" fn wasmem_recorder_close(h: i64) -> c_int {
    guard("wasmem_recorder_close", -1, || recorder::close(h).map(|()| 0))
}

/// Writes the traces to `path`, or to the configured `trace_out`.
fn dump(path: Option<&Path>) -> Result<(), Failure> {
    let (traces, configured) = {
        let s = lock(state()?);
        (s.trace_snapshot()?, s.config().trace_out.clone())
    };
    let path = path.or(configured.as_deref()).ok_or_else(|| Failure::new(Cause::Trace, "no path given"))?;
    if traces.is_empty() {
        // No device opened yet: an empty trace, so that the file says so.
        let header = wasmem::trace::TraceHeader { source: "wasmem-capi (no allocation yet)".into(), ranks: 1 };
        return state::write_trace(path, &header, &[]);
    }
    for (i, (device, header, events)) in traces.iter().enumerate() {
        let p = state::trace_path(path, *device, i == 0);
        state::write_trace(&p, header, events)?;
        tracing::info!("wasmem: wrote {} trace events of device {device} to {}", events.len(), p.display());
    }
    Ok(())
}

extern "C" {
    /// The C library's `atexit`.
    fn atexit(f: extern "C" fn()) -> c_int;
}

/// At process exit: writes the trace to the configured `trace_out` and
/// removes the control socket.
extern "C" fn at_exit() {
    guard("at exit", (), || {
        control::stop();
        let configured = lock(state()?).config().trace_out.is_some();
        if configured {
            dump(None)?;
        }
        Ok(())
    });
}

fn register_exit_hook() {
    // SAFETY: `at_exit` is an `extern "C" fn()` that never unwinds (it runs
    // inside `guard`) and stays loaded: PyTorch never unloads an allocator
    // library.
    if unsafe { atexit(at_exit) } != 0 {
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
