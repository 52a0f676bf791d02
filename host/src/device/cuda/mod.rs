//! The CUDA backend: a [`Device`] on a real GPU through `cudarc`'s driver API,
//! loaded at run time.
//!
//! | trait operation | driver calls |
//! |---|---|
//! | segments | `cuMemAlloc` / `cuMemFree` (a free counts as a device synchronization, as `cudaFree` synchronizes) |
//! | virtual memory | `cuMemGetAllocationGranularity`, `cuMemAddressReserve` / `cuMemAddressFree`, `cuMemCreate` / `cuMemRelease`, `cuMemMap` + `cuMemSetAccess` / `cuMemUnmap` |
//! | streams | `cuStreamCreate`, one per [`StreamId`], created on first use |
//! | events | `cuEventCreate` + `cuEventRecord`, `cuEventQuery`, `cuEventDestroy` |
//! | copies | `cuMemcpyDtoDAsync` on the stream (overlapping ranges are split so they behave like `memmove`) |
//! | write / read | `cuMemcpyHtoD` / `cuMemcpyDtoH` (synchronous) |
//! | available | `cuMemGetInfo` |
//!
//! Layers, as in cudarc: `driver` is the thin `result` layer (each raw call
//! returns a `Result` and documents its `# Safety`), `book` refuses every
//! bad argument before the driver sees it, and [`CudaDevice`] owns what it
//! obtained; its `Drop` releases all of it and never panics (errors are logged
//! through `tracing`; [`CudaDevice::close`] returns them instead).
//!
//! A machine without the CUDA driver gets [`DeviceError::Unavailable`] from
//! [`CudaDevice::new`], never a panic: the library and every symbol this
//! backend calls are checked before the first cudarc call.
//!
//! Streams are created with the default (blocking) flag, so the synchronous
//! `write`/`read` copies, which run on the legacy default stream, are ordered
//! after the work already queued on every stream.
//!
//! `time_us` in [`DeviceCounters`] is measured wall time spent inside driver
//! calls that allocate, free, map, synchronize or copy.

mod book;
mod driver;
mod pinned;

use std::ffi::c_int;
use std::time::Instant;

use cudarc::driver::result::{self as cu, DriverError};
use cudarc::driver::sys;
use rustc_hash::FxHashMap;

use super::{Device, DeviceCounters, DeviceError, DevicePtr, EventId, HostBuf, PhysHandle};
use crate::types::StreamId;
use book::Book;

/// Whether the CUDA driver library can be loaded on this machine (no other
/// driver call is made).
pub fn driver_present() -> bool {
    driver::library_present()
}

/// The message of the error [`CudaDevice::new`] returns when there is no driver.
pub const NO_DRIVER: &str = "no CUDA driver found (libcuda could not be loaded); use --device sim";

/// A GPU driven through the CUDA driver API.
///
/// Owns a retained primary context of its device, the streams, events,
/// segments, reservations, physical allocations and mappings it created.
#[derive(Debug)]
pub struct CudaDevice {
    ordinal: c_int,
    ctx: sys::CUcontext,
    cu_device: sys::CUdevice,
    name: String,
    driver_version: c_int,
    total: u64,
    /// `None` when the device does not support the virtual-memory API.
    granularity: Option<u64>,
    prop: sys::CUmemAllocationProp,
    book: Book,
    streams: FxHashMap<StreamId, sys::CUstream>,
    events: FxHashMap<u64, sys::CUevent>,
    next_event: u64,
    counters: DeviceCounters,
    /// Errors met while cleaning up (rollbacks, Drop); see [`CudaDevice::errors`].
    errors: Vec<String>,
    /// The driver refused pinned host memory once (warned).
    pinned_refused: bool,
    released: bool,
}

// SAFETY: the driver handles (context, streams, events) may be used from any
// thread once the context is current on it, and every method that calls the
// driver first makes the context current (`bind`). The device is not `Sync`,
// so no two threads use it at once.
unsafe impl Send for CudaDevice {}

fn unavailable(what: &str, e: DriverError) -> DeviceError {
    DeviceError::Unavailable(format!("{what}: {}; use --device sim", driver::describe(e)))
}

fn driver_err(call: &str, e: DriverError) -> DeviceError {
    DeviceError::Driver(format!("{call}: {}", driver::describe(e)))
}

fn to_usize(bytes: u64) -> Result<usize, DeviceError> {
    usize::try_from(bytes).map_err(|_| DeviceError::Invalid(format!("size {bytes} does not fit in usize")))
}

fn is_oom(e: &DriverError) -> bool {
    e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY
}

impl CudaDevice {
    /// Opens CUDA device `ordinal`: checks that the driver library loads and
    /// has every symbol this backend uses, initializes the driver, checks the
    /// device count, retains the device's primary context and queries its
    /// memory and virtual-memory granularity.
    ///
    /// Returns [`DeviceError::Unavailable`] (never panics) when there is no
    /// driver ([`NO_DRIVER`]), the driver is too old, or there is no such device.
    pub fn new(ordinal: usize) -> Result<Self, DeviceError> {
        if !driver::library_present() {
            return Err(DeviceError::Unavailable(NO_DRIVER.into()));
        }
        // SAFETY: the library loads (checked just above).
        let missing = unsafe { driver::missing_symbols() };
        if !missing.is_empty() {
            return Err(DeviceError::Unavailable(format!(
                "the CUDA driver is too old: it lacks {}; use --device sim",
                missing.join(", ")
            )));
        }
        cu::init().map_err(|e| unavailable("the CUDA driver failed to initialize", e))?;
        let count = cu::device::get_count().map_err(|e| unavailable("cannot count CUDA devices", e))?;
        let ordinal = c_int::try_from(ordinal).ok().filter(|&o| o < count).ok_or_else(|| {
            DeviceError::Unavailable(format!(
                "CUDA device {ordinal} requested but {count} device(s) present; use --device sim"
            ))
        })?;
        let cu_device = cu::device::get(ordinal).map_err(|e| unavailable("cuDeviceGet", e))?;
        // SAFETY: `cu_device` was returned by `device::get`.
        let ctx =
            unsafe { cu::primary_ctx::retain(cu_device) }.map_err(|e| unavailable("cuDevicePrimaryCtxRetain", e))?;
        let mut dev = CudaDevice {
            ordinal,
            ctx,
            cu_device,
            name: String::new(),
            driver_version: 0,
            total: 0,
            granularity: None,
            prop: driver::device_prop(ordinal),
            book: Book::default(),
            streams: FxHashMap::default(),
            events: FxHashMap::default(),
            next_event: 1,
            counters: DeviceCounters::default(),
            errors: Vec::new(),
            released: false,
            pinned_refused: false,
        };
        // From here on `dev` owns the context: an early return releases it in Drop.
        dev.bind()?;
        dev.name = cu::device::get_name(cu_device).unwrap_or_else(|_| format!("CUDA device {ordinal}"));
        // SAFETY: library and symbols checked above.
        dev.driver_version = unsafe { driver::driver_version() }.unwrap_or(0);
        // SAFETY: `cu_device` was returned by `device::get`.
        dev.total = unsafe { cu::device::total_mem(cu_device) }.map_err(|e| driver_err("cuDeviceTotalMem", e))? as u64;
        // SAFETY: initialized, context current, `prop` describes this device.
        dev.granularity = unsafe { driver::granularity(&dev.prop) }.ok().map(|g| g as u64).filter(|&g| g > 0);
        Ok(dev)
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal as usize
    }

    /// The device's name as the driver reports it (e.g. `NVIDIA H200`).
    pub fn device_name(&self) -> &str {
        &self.name
    }

    /// The driver's CUDA version, e.g. `13000` for 13.0 (0 if unknown).
    pub fn driver_version(&self) -> i32 {
        self.driver_version
    }

    /// Whether the device supports the virtual-memory API (reserve / create / map).
    pub fn supports_vmm(&self) -> bool {
        self.granularity.is_some()
    }

    /// Errors recorded while cleaning up (a failed rollback), oldest first.
    pub fn errors(&self) -> &[String] {
        &self.errors
    }

    /// Checks the backend's bookkeeping: `used = Σ segments + Σ physical`,
    /// mappings inside reservations, each counted by its physical allocation.
    pub fn check_invariants(&self) -> Result<(), crate::types::InvariantError> {
        self.book.check_invariants(self.counters.used_bytes).map_err(crate::types::InvariantError)
    }

    /// Releases everything and returns the errors met on the way (also those
    /// recorded earlier), instead of logging them as `Drop` does.
    pub fn close(mut self) -> Result<(), DeviceError> {
        self.release_all();
        let errors = std::mem::take(&mut self.errors);
        if errors.is_empty() {
            Ok(())
        } else {
            Err(DeviceError::Driver(errors.join("; ")))
        }
    }

    /// Makes this device's context current on the calling thread.
    fn bind(&self) -> Result<(), DeviceError> {
        // SAFETY: `ctx` is the primary context retained in `new` and released
        // only in `release_all`, after which `released` is set and no method binds.
        unsafe { cu::ctx::set_current(self.ctx) }.map_err(|e| driver_err("cuCtxSetCurrent", e))
    }

    /// Adds the wall time since `t0` to the measured device time.
    fn charge(&mut self, t0: Instant) {
        self.counters.time_us += t0.elapsed().as_secs_f64() * 1e6;
    }

    fn vmm_granularity(&self) -> Result<u64, DeviceError> {
        self.granularity.ok_or(DeviceError::Unsupported("virtual memory management", "cuda (this GPU)"))
    }

    fn check_multiple(&self, what: &str, bytes: u64) -> Result<u64, DeviceError> {
        let g = self.vmm_granularity()?;
        if bytes == 0 || !bytes.is_multiple_of(g) {
            return Err(DeviceError::Invalid(format!("{what} of {bytes} bytes is not a positive multiple of {g}")));
        }
        Ok(g)
    }

    fn oom(&self, requested: u64) -> DeviceError {
        DeviceError::OutOfMemory { requested, available: self.available().unwrap_or(0), capacity: self.total }
    }

    /// The stream for `id`, created on first use.
    fn stream(&mut self, id: StreamId) -> Result<sys::CUstream, DeviceError> {
        if let Some(&s) = self.streams.get(&id) {
            return Ok(s);
        }
        let s = cu::stream::create(cu::stream::StreamKind::Default).map_err(|e| driver_err("cuStreamCreate", e))?;
        self.streams.insert(id, s);
        Ok(s)
    }

    fn record(&mut self, what: &str, r: Result<(), DriverError>) {
        if let Err(e) = r {
            self.errors.push(format!("{what}: {}", driver::describe(e)));
        }
    }

    /// Releases everything held, in dependency order, recording (never
    /// raising) errors. Idempotent.
    fn release_all(&mut self) {
        if self.released {
            return;
        }
        self.released = true;
        if let Err(e) = self.bind() {
            // Without a current context the frees below cannot work; keep the
            // record and still give the primary context back.
            self.errors.push(format!("release: {e}"));
        } else {
            self.release_resources();
        }
        // SAFETY: retained once in `new` for this device, released once here
        // (`released` guards against a second time).
        let r = unsafe { cu::primary_ctx::release(self.cu_device) };
        self.record("cuDevicePrimaryCtxRelease", r);
        self.counters.used_bytes = 0;
    }

    /// Frees events, mappings, physical memory, reservations, segments and
    /// streams; the context is current.
    fn release_resources(&mut self) {
        self.record("cuCtxSynchronize (release)", cu::ctx::synchronize());
        for (_, ev) in std::mem::take(&mut self.events) {
            // SAFETY: created by `event::create`, destroyed only here or in `destroy_event` (which removes it).
            let r = unsafe { cu::event::destroy(ev) };
            self.record("cuEventDestroy", r);
        }
        for (va, (_, size)) in std::mem::take(&mut self.book.mappings) {
            // SAFETY: an exact mapping made by `map_rw`; the context was synchronized above.
            let r = unsafe { driver::unmap(va, size as usize) };
            self.record("cuMemUnmap", r);
        }
        for (_, p) in std::mem::take(&mut self.book.physical) {
            // SAFETY: a live handle from `mem_create`; every mapping was removed above.
            let r = unsafe { driver::mem_release(p.handle) };
            self.record("cuMemRelease", r);
        }
        for (va, size) in std::mem::take(&mut self.book.reservations) {
            // SAFETY: an exact reservation from `address_reserve`, now without mappings.
            let r = unsafe { driver::address_free(va, size as usize) };
            self.record("cuMemAddressFree", r);
        }
        for (ptr, _) in std::mem::take(&mut self.book.segments) {
            // SAFETY: a live pointer from `malloc_sync`, freed only here or in `free_segment`.
            let r = unsafe { cu::free_sync(ptr) };
            self.record("cuMemFree", r);
        }
        for (_, s) in std::mem::take(&mut self.streams) {
            // SAFETY: created by `stream::create` and destroyed only here.
            let r = unsafe { cu::stream::destroy(s) };
            self.record("cuStreamDestroy", r);
        }
    }

    /// Enqueues a device-to-device copy of `bytes` on `stream`, split into
    /// non-overlapping pieces when the ranges overlap (memmove semantics).
    fn copy_on(&mut self, dst: DevicePtr, src: DevicePtr, bytes: u64, s: sys::CUstream) -> Result<(), DeviceError> {
        let gap = dst.abs_diff(src);
        let piece = if gap >= bytes { bytes } else { gap };
        if piece == 0 {
            return Ok(()); // dst == src: nothing to move
        }
        let mut done = 0u64;
        while done < bytes {
            let n = piece.min(bytes - done);
            // Moving down: front to back; moving up: back to front.
            let off = if dst < src { done } else { bytes - done - n };
            // SAFETY: both ranges were checked to be device memory this backend
            // holds (`check_range`); the pieces do not overlap; stream order keeps
            // them sequential.
            unsafe { cu::memcpy_dtod_async(dst + off, src + off, n as usize, s) }
                .map_err(|e| driver_err("cuMemcpyDtoDAsync", e))?;
            done += n;
        }
        Ok(())
    }
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        self.release_all();
        for e in self.errors.drain(..) {
            tracing::warn!(device = self.ordinal, "CUDA backend cleanup: {e}");
        }
    }
}

impl Device for CudaDevice {
    fn name(&self) -> &'static str {
        "cuda"
    }

    /// Pinned host memory (`cuMemHostAlloc`); heap memory, with a warning
    /// once, when the driver refuses to pin more.
    fn alloc_host(&mut self, bytes: usize) -> Result<HostBuf, DeviceError> {
        match pinned::PinnedBuf::new(self.cu_device, bytes) {
            Some(p) => Ok(HostBuf::Pinned(Box::new(p))),
            None => {
                if !self.pinned_refused {
                    self.pinned_refused = true;
                    tracing::warn!(bytes, "cuMemHostAlloc refused: host tier buffers fall back to pageable memory");
                }
                Ok(HostBuf::heap(bytes))
            }
        }
    }

    fn capacity(&self) -> u64 {
        self.total
    }

    fn available(&self) -> Option<u64> {
        self.bind().ok()?;
        cu::mem_get_info().ok().map(|(free, _)| free as u64)
    }

    fn counters(&self) -> DeviceCounters {
        self.counters
    }

    fn alloc_segment(&mut self, bytes: u64) -> Result<DevicePtr, DeviceError> {
        if bytes == 0 {
            return Err(DeviceError::Invalid("zero-byte segment".into()));
        }
        let n = to_usize(bytes)?;
        self.bind()?;
        let t0 = Instant::now();
        // SAFETY: a context is current; the memory is handed out uninitialized,
        // which is what a segment is.
        let r = unsafe { cu::malloc_sync(n) };
        self.charge(t0);
        let ptr = r.map_err(|e| if is_oom(&e) { self.oom(bytes) } else { driver_err("cuMemAlloc", e) })?;
        self.book.segments.insert(ptr, bytes);
        self.counters.alloc_calls += 1;
        self.counters.used_bytes += bytes;
        Ok(ptr)
    }

    fn free_segment(&mut self, ptr: DevicePtr) -> Result<(), DeviceError> {
        let size = self.book.segment(ptr)?;
        self.bind()?;
        let t0 = Instant::now();
        // SAFETY: `ptr` is a live segment from `malloc_sync` (checked by the book).
        let r = unsafe { cu::free_sync(ptr) };
        self.charge(t0);
        r.map_err(|e| driver_err("cuMemFree", e))?;
        self.book.segments.remove(&ptr);
        self.counters.free_calls += 1;
        // cuMemFree synchronizes the device, as cudaFree does.
        self.counters.syncs += 1;
        self.counters.used_bytes -= size;
        Ok(())
    }

    fn synchronize(&mut self) -> Result<(), DeviceError> {
        self.bind()?;
        let t0 = Instant::now();
        let r = cu::ctx::synchronize();
        self.charge(t0);
        r.map_err(|e| driver_err("cuCtxSynchronize", e))?;
        self.counters.syncs += 1;
        Ok(())
    }

    fn granularity(&self) -> u64 {
        // The trait has no error here; 2 MiB is CUDA's granularity on every
        // current GPU, and the VMM calls refuse when VMM is unsupported.
        self.granularity.unwrap_or(2 << 20)
    }

    fn reserve_virtual(&mut self, bytes: u64) -> Result<DevicePtr, DeviceError> {
        self.check_multiple("reservation", bytes)?;
        let n = to_usize(bytes)?;
        self.bind()?;
        let t0 = Instant::now();
        // SAFETY: context current; `n` is a positive multiple of the granularity.
        let r = unsafe { driver::address_reserve(n) };
        self.charge(t0);
        let va = r.map_err(|e| driver_err("cuMemAddressReserve", e))?;
        self.book.reservations.insert(va, bytes);
        Ok(va)
    }

    fn release_virtual(&mut self, va: DevicePtr) -> Result<(), DeviceError> {
        let size = self.book.releasable_reservation(va)?;
        self.bind()?;
        let t0 = Instant::now();
        // SAFETY: an exact live reservation without mappings (checked by the book).
        let r = unsafe { driver::address_free(va, size as usize) };
        self.charge(t0);
        r.map_err(|e| driver_err("cuMemAddressFree", e))?;
        self.book.reservations.remove(&va);
        Ok(())
    }

    fn create_physical(&mut self, bytes: u64) -> Result<PhysHandle, DeviceError> {
        self.check_multiple("physical allocation", bytes)?;
        let n = to_usize(bytes)?;
        self.bind()?;
        let t0 = Instant::now();
        // SAFETY: context current; `n` is a positive multiple of the granularity of `prop`.
        let r = unsafe { driver::mem_create(n, &self.prop) };
        self.charge(t0);
        let handle = r.map_err(|e| if is_oom(&e) { self.oom(bytes) } else { driver_err("cuMemCreate", e) })?;
        self.counters.alloc_calls += 1;
        self.counters.used_bytes += bytes;
        Ok(self.book.add_physical(handle, bytes))
    }

    fn release_physical(&mut self, phys: PhysHandle) -> Result<(), DeviceError> {
        let p = self.book.releasable_physical(phys)?;
        self.bind()?;
        let t0 = Instant::now();
        // SAFETY: a live, unmapped handle from `mem_create` (checked by the book).
        let r = unsafe { driver::mem_release(p.handle) };
        self.charge(t0);
        r.map_err(|e| driver_err("cuMemRelease", e))?;
        self.book.physical.remove(&phys.0);
        self.counters.free_calls += 1;
        self.counters.used_bytes -= p.size;
        Ok(())
    }

    fn map(&mut self, va: DevicePtr, phys: PhysHandle) -> Result<(), DeviceError> {
        let size = self.book.physical.get(&phys.0).map_or(0, |p| p.size);
        self.map_part(va, phys, 0, size)
    }

    fn maps_parts(&self) -> bool {
        true
    }

    fn map_part(&mut self, va: DevicePtr, phys: PhysHandle, offset: u64, bytes: u64) -> Result<(), DeviceError> {
        let g = self.vmm_granularity()?;
        let p = self.book.mappable_part(va, phys, offset, bytes, g)?;
        let (size, off) = (to_usize(bytes)?, to_usize(offset)?);
        self.bind()?;
        let t0 = Instant::now();
        // SAFETY: the book checked that the range is aligned, inside a
        // reservation and unmapped, and that the handle is live and holds
        // `offset + bytes` (it may be mapped elsewhere too: an alias).
        let r = unsafe { driver::map_rw(va, size, p.handle, off, self.ordinal) };
        self.charge(t0);
        match r {
            Ok(()) => {
                self.book.add_mapping(va, phys, bytes);
                Ok(())
            }
            Err((e, undo)) => {
                if let Some(u) = undo {
                    // The range stays mapped in the driver: keep it in the book so
                    // that Drop unmaps it, and remember the failed rollback.
                    self.book.add_mapping(va, phys, bytes);
                    self.errors
                        .push(format!("cuMemUnmap (rollback of a failed cuMemSetAccess): {}", driver::describe(u)));
                }
                Err(driver_err("cuMemMap/cuMemSetAccess", e))
            }
        }
    }

    fn unmap(&mut self, va: DevicePtr) -> Result<(), DeviceError> {
        let (_, size) = self.book.mapping(va)?;
        self.bind()?;
        let t0 = Instant::now();
        // SAFETY: exactly one mapping made by `map_rw` (checked by the book).
        let r = unsafe { driver::unmap(va, size as usize) };
        self.charge(t0);
        r.map_err(|e| driver_err("cuMemUnmap", e))?;
        self.book.remove_mapping(va);
        Ok(())
    }

    fn record_event(&mut self, stream: StreamId) -> Result<EventId, DeviceError> {
        self.bind()?;
        let s = self.stream(stream)?;
        let ev = cu::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map_err(|e| driver_err("cuEventCreate", e))?;
        // SAFETY: `ev` was just created, `s` is a live stream of this context.
        if let Err(e) = unsafe { cu::event::record(ev, s) } {
            // SAFETY: `ev` was just created and is not stored anywhere.
            let r = unsafe { cu::event::destroy(ev) };
            self.record("cuEventDestroy (rollback)", r);
            return Err(driver_err("cuEventRecord", e));
        }
        let id = self.next_event;
        self.next_event += 1;
        self.events.insert(id, ev);
        Ok(EventId(id))
    }

    fn event_done(&mut self, event: EventId) -> Result<bool, DeviceError> {
        let ev =
            *self.events.get(&event.0).ok_or_else(|| DeviceError::Invalid(format!("unknown event {}", event.0)))?;
        self.bind()?;
        // SAFETY: a live event of this context.
        match unsafe { cu::event::query(ev) } {
            Ok(()) => Ok(true),
            Err(e) if e.0 == sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            Err(e) => Err(driver_err("cuEventQuery", e)),
        }
    }

    fn destroy_event(&mut self, event: EventId) -> Result<(), DeviceError> {
        let ev =
            self.events.remove(&event.0).ok_or_else(|| DeviceError::Invalid(format!("unknown event {}", event.0)))?;
        self.bind()?;
        // SAFETY: a live event, removed from the table so it is destroyed once.
        unsafe { cu::event::destroy(ev) }.map_err(|e| driver_err("cuEventDestroy", e))
    }

    fn copy(&mut self, dst: DevicePtr, src: DevicePtr, bytes: u64, stream: StreamId) -> Result<(), DeviceError> {
        if bytes == 0 {
            return Ok(());
        }
        self.book.check_range(src, bytes)?;
        self.book.check_range(dst, bytes)?;
        self.bind()?;
        let s = self.stream(stream)?;
        let t0 = Instant::now();
        let r = self.copy_on(dst, src, bytes, s);
        self.charge(t0);
        r?;
        self.counters.copied_bytes += bytes;
        Ok(())
    }

    fn write(&mut self, dst: DevicePtr, data: &[u8]) -> Result<(), DeviceError> {
        self.book.check_range(dst, data.len() as u64)?;
        if data.is_empty() {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: the destination range is device memory this backend holds
        // (checked by the book); `data` is a valid host slice.
        unsafe { cu::memcpy_htod_sync(dst, data) }.map_err(|e| driver_err("cuMemcpyHtoD", e))
    }

    fn read(&mut self, src: DevicePtr, out: &mut [u8]) -> Result<(), DeviceError> {
        self.book.check_range(src, out.len() as u64)?;
        if out.is_empty() {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: the source range is device memory this backend holds
        // (checked by the book); `out` is a valid, exclusive host slice.
        unsafe { cu::memcpy_dtoh_sync(out, src) }.map_err(|e| driver_err("cuMemcpyDtoH", e))
    }
}
