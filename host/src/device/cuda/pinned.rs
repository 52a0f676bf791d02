//! Pinned (page-locked) host memory for the host tier: `cuMemHostAlloc`,
//! freed with `cuMemFreeHost`.
//!
//! A buffer retains its device's primary context for as long as it lives, so
//! it stays valid after the [`super::CudaDevice`] that made it is dropped,
//! and it may be dropped on any thread (the disk tier's I/O threads hold
//! buffers too): the drop makes the context current on that thread first.

use std::ffi::c_void;

use cudarc::driver::result as cu;
use cudarc::driver::sys;

use crate::device::PinnedMemory;

/// `len` bytes of page-locked host memory.
#[derive(Debug)]
pub(super) struct PinnedBuf {
    ptr: *mut u8,
    len: usize,
    ctx: sys::CUcontext,
    dev: sys::CUdevice,
}

// SAFETY: the buffer is plain host memory owned by this value alone (no
// other pointer to it escapes except through `&self`/`&mut self` borrows),
// and the driver calls in `drop` first make the retained context current on
// the dropping thread, which the driver allows from any thread.
unsafe impl Send for PinnedBuf {}
// SAFETY: shared access only reads the bytes (`as_slice`); no interior mutability.
unsafe impl Sync for PinnedBuf {}

impl PinnedBuf {
    /// Allocates `len` zeroed bytes pinned for device `dev`. Returns `None`
    /// when the driver refuses (e.g. the page-locked limit is reached).
    pub(super) fn new(dev: sys::CUdevice, len: usize) -> Option<Self> {
        // SAFETY: `dev` is a valid device handle of an initialized driver (the
        // caller is a live `CudaDevice`); the retained primary context is
        // released in `drop` or below when the allocation fails.
        let ctx = unsafe { cu::primary_ctx::retain(dev) }.ok()?;
        // SAFETY: `ctx` was just retained, so it is a valid context.
        let bound = unsafe { cu::ctx::set_current(ctx) };
        // SAFETY: a context is current; `len.max(1)` bytes, default flags.
        let ptr = bound.and_then(|()| unsafe { cu::malloc_host(len.max(1), 0) });
        match ptr {
            Ok(p) => {
                // SAFETY: `p` points to `len.max(1)` writable bytes just allocated.
                unsafe { std::ptr::write_bytes(p as *mut u8, 0, len) };
                Some(PinnedBuf { ptr: p as *mut u8, len, ctx, dev })
            }
            Err(_) => {
                // SAFETY: releases the reference retained above.
                let _ = unsafe { cu::primary_ctx::release(dev) };
                None
            }
        }
    }
}

impl PinnedMemory for PinnedBuf {
    fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` points to `len` initialized bytes owned by `self`
        // (zeroed at allocation) for as long as `self` lives.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, and `&mut self` makes the borrow unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for PinnedBuf {
    fn drop(&mut self) {
        // SAFETY: `ctx` is still retained by this buffer, so it is valid to
        // make current; `ptr` came from `cuMemHostAlloc` in that context and
        // is freed once; the retained reference is released last. Errors
        // cannot be reported from a drop and leave at most a leak.
        unsafe {
            if cu::ctx::set_current(self.ctx).is_ok() {
                let _ = cu::free_host(self.ptr as *mut c_void);
            }
            let _ = cu::primary_ctx::release(self.dev);
        }
    }
}
