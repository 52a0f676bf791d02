//! What a `no_std` policy needs on wasm32: a panic handler and an allocator.

use core::sync::atomic::{AtomicBool, Ordering};

use crate::host::{log, LogLevel};

#[global_allocator]
static ALLOCATOR: dlmalloc::GlobalDlmalloc = dlmalloc::GlobalDlmalloc;

/// Set while a panic is being reported, so that a panic inside the report
/// traps at once instead of recursing.
static PANICKING: AtomicBool = AtomicBool::new(false);

/// Logs the panic through the host at `error` level, then traps; the engine
/// counts the trap and falls back to its default decision.
#[panic_handler]
fn panic(info: &core::panic::PanicInfo<'_>) -> ! {
    if !PANICKING.swap(true, Ordering::Relaxed) {
        log(LogLevel::Error, &alloc::format!("policy panicked: {info}"));
    }
    core::arch::wasm32::unreachable()
}

// `compiler_builtins` leaves `memcpy`, `memmove`, `memset` and `memcmp` to the
// C library on this target; link wasi-libc (shipped with the target) for
// them. Only those leaf functions are pulled in: no WASI import.
#[link(name = "c")]
extern "C" {}

/// The canonical ABI's allocation function, through the global allocator
/// above: the engine allocates the lists and strings it passes in with it,
/// and the policy frees them as Rust values, so both must use one allocator.
/// (With `std`, wasi-libc defines it over `malloc`, which `std` also uses.)
///
/// # Safety
///
/// Called by the engine per the component model's canonical ABI: `old_ptr`
/// and `old_len` describe a live allocation of alignment `align` (or are
/// `0`), and `align` is a power of two.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cabi_realloc(old_ptr: *mut u8, old_len: usize, align: usize, new_len: usize) -> *mut u8 {
    use alloc::alloc::{alloc, realloc, Layout};

    if old_len == 0 && new_len == 0 {
        // A zero-sized allocation: any non-null, aligned pointer.
        return align as *mut u8;
    }
    // SAFETY: `align` is a power of two and the sizes come from the engine's
    // lowering of a value that fits in this memory (canonical ABI); `old_ptr`
    // was returned by this function with `old_len` and `align`.
    let ptr = unsafe {
        if old_len == 0 {
            alloc(Layout::from_size_align_unchecked(new_len, align))
        } else {
            realloc(old_ptr, Layout::from_size_align_unchecked(old_len, align), new_len)
        }
    };
    if ptr.is_null() {
        // Out of memory: trap; the engine counts it and falls back.
        core::arch::wasm32::unreachable()
    }
    ptr
}
