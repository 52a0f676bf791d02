//! The thin `result` layer: the driver calls that cudarc 0.19 exposes only as
//! raw `sys` functions (the virtual-memory API, the driver version), each
//! returning a `Result`, plus the load checks that must come before *any*
//! cudarc call.
//!
//! With cudarc's `dynamic-loading` feature every `sys` function loads its
//! symbol on first use and panics when the library or the symbol is missing.
//! [`library_present`] and [`missing_symbols`] are checked once, when a
//! [`super::CudaDevice`] is created; after that every call this backend makes
//! resolves.

use std::ffi::c_int;
use std::mem::MaybeUninit;

use cudarc::driver::result::DriverError;
use cudarc::driver::sys;

/// Every driver symbol the CUDA backend calls (as cudarc loads them).
pub(crate) const REQUIRED_SYMBOLS: &[&str] = &[
    "cuInit",
    "cuDriverGetVersion",
    "cuGetErrorName",
    "cuGetErrorString",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetName",
    "cuDeviceTotalMem_v2",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxSetCurrent",
    "cuCtxSynchronize",
    "cuMemGetInfo_v2",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemcpyHtoD_v2",
    "cuMemcpyDtoH_v2",
    "cuMemcpyDtoDAsync_v2",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuEventCreate",
    "cuEventRecord",
    "cuEventQuery",
    "cuEventDestroy_v2",
    "cuMemGetAllocationGranularity",
    "cuMemAddressReserve",
    "cuMemAddressFree",
    "cuMemCreate",
    "cuMemRelease",
    "cuMemMap",
    "cuMemUnmap",
    "cuMemSetAccess",
];

/// Whether the CUDA driver library (`libcuda.so`) can be loaded.
pub(crate) fn library_present() -> bool {
    // SAFETY: `is_culib_present` only tries `dlopen` on the driver's library
    // names and drops what it opened; loading the vendor's driver library runs
    // its initializers, which is what every CUDA program does.
    unsafe { sys::is_culib_present() }
}

/// The [`REQUIRED_SYMBOLS`] the loaded driver lacks (an old driver).
///
/// # Safety
///
/// [`library_present`] must have returned `true`: otherwise cudarc's
/// `culib()` panics.
pub(crate) unsafe fn missing_symbols() -> Vec<&'static str> {
    // SAFETY: the caller checked that the library loads; `get` only looks a
    // symbol up and the pointer type is never called through.
    let lib = unsafe { sys::culib() };
    REQUIRED_SYMBOLS.iter().copied().filter(|name| unsafe { lib.get::<*const ()>(name.as_bytes()) }.is_err()).collect()
}

/// A driver error as text: `NAME (description)` when the driver can name it.
pub(crate) fn describe(e: DriverError) -> String {
    let name = e.error_name().map(|s| s.to_string_lossy().into_owned());
    let text = e.error_string().map(|s| s.to_string_lossy().into_owned());
    match (name, text) {
        (Ok(n), Ok(t)) => format!("{n} ({t})"),
        (Ok(n), Err(_)) => n,
        _ => format!("{:?}", e.0),
    }
}

/// The driver's CUDA version (e.g. 12080 for 12.8).
///
/// # Safety
///
/// The library and symbols were checked ([`library_present`], [`missing_symbols`]).
pub(crate) unsafe fn driver_version() -> Result<c_int, DriverError> {
    let mut v = 0;
    // SAFETY: `v` is a valid out-pointer.
    unsafe { sys::cuDriverGetVersion(&mut v) }.result()?;
    Ok(v)
}

/// Allocation properties for pinned device memory on device `ordinal`.
pub(crate) fn device_prop(ordinal: c_int) -> sys::CUmemAllocationProp {
    sys::CUmemAllocationProp {
        type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE,
        location: sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: ordinal },
        win32HandleMetaData: std::ptr::null_mut(),
        allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
            compressionType: 0,
            gpuDirectRDMACapable: 0,
            usage: 0,
            reserved: [0; 4],
        },
    }
}

/// Minimum granularity of physical allocations and mappings for `prop`.
///
/// # Safety
///
/// The driver is initialized and a context is current.
pub(crate) unsafe fn granularity(prop: &sys::CUmemAllocationProp) -> Result<usize, DriverError> {
    let mut g = MaybeUninit::uninit();
    // SAFETY: `g` is a valid out-pointer, `prop` a valid property struct.
    unsafe {
        sys::cuMemGetAllocationGranularity(
            g.as_mut_ptr(),
            prop,
            sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
        )
        .result()?;
        Ok(g.assume_init())
    }
}

/// Reserves `size` bytes of virtual address space (`cuMemAddressReserve`).
///
/// # Safety
///
/// A context is current; `size` is a multiple of the granularity.
pub(crate) unsafe fn address_reserve(size: usize) -> Result<sys::CUdeviceptr, DriverError> {
    let mut va = MaybeUninit::uninit();
    // SAFETY: `va` is a valid out-pointer; alignment 0 means the granularity,
    // address 0 lets the driver choose, flags must be 0.
    unsafe {
        sys::cuMemAddressReserve(va.as_mut_ptr(), size, 0, 0, 0).result()?;
        Ok(va.assume_init())
    }
}

/// Frees a virtual reservation (`cuMemAddressFree`).
///
/// # Safety
///
/// `(va, size)` is exactly a reservation from [`address_reserve`] that was not
/// freed, and nothing is mapped in it.
pub(crate) unsafe fn address_free(va: sys::CUdeviceptr, size: usize) -> Result<(), DriverError> {
    // SAFETY: guaranteed by the caller.
    unsafe { sys::cuMemAddressFree(va, size) }.result()
}

/// Creates `size` bytes of physical memory (`cuMemCreate`).
///
/// # Safety
///
/// A context is current; `size` is a multiple of the granularity of `prop`.
pub(crate) unsafe fn mem_create(size: usize, prop: &sys::CUmemAllocationProp) -> Result<u64, DriverError> {
    let mut h = MaybeUninit::uninit();
    // SAFETY: `h` is a valid out-pointer, `prop` a valid property struct, flags must be 0.
    unsafe {
        sys::cuMemCreate(h.as_mut_ptr(), size, prop, 0).result()?;
        Ok(h.assume_init())
    }
}

/// Releases physical memory (`cuMemRelease`).
///
/// # Safety
///
/// `handle` came from [`mem_create`], was not released, and is not mapped.
pub(crate) unsafe fn mem_release(handle: u64) -> Result<(), DriverError> {
    // SAFETY: guaranteed by the caller.
    unsafe { sys::cuMemRelease(handle) }.result()
}

/// Maps all `size` bytes of `handle` at `va` and makes them readable and
/// writable from device `ordinal` (`cuMemMap` + `cuMemSetAccess`). When
/// setting the access fails the mapping is undone; the second error (if the
/// undo fails too) is returned alongside.
///
/// # Safety
///
/// `[va, va + size)` lies inside a reservation, is granularity-aligned and has
/// nothing mapped; `handle` is a live physical allocation of at least
/// `offset + size` bytes, `offset` granularity-aligned (it may be mapped at
/// other addresses too: the driver allows aliases).
pub(crate) unsafe fn map_rw(
    va: sys::CUdeviceptr,
    size: usize,
    handle: u64,
    offset: usize,
    ordinal: c_int,
) -> Result<(), (DriverError, Option<DriverError>)> {
    // SAFETY: guaranteed by the caller; flags must be 0.
    unsafe { sys::cuMemMap(va, size, offset, handle, 0) }.result().map_err(|e| (e, None))?;
    let desc = sys::CUmemAccessDesc {
        location: sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: ordinal },
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    };
    // SAFETY: `[va, va + size)` was just mapped; `desc` points to one descriptor.
    if let Err(e) = unsafe { sys::cuMemSetAccess(va, size, &desc, 1) }.result() {
        // SAFETY: the range was mapped above and nothing else refers to it yet.
        let undo = unsafe { sys::cuMemUnmap(va, size) }.result().err();
        return Err((e, undo));
    }
    Ok(())
}

/// Unmaps `[va, va + size)` (`cuMemUnmap`).
///
/// # Safety
///
/// The range is exactly one mapping made by [`map_rw`]; no queued work still
/// uses it.
pub(crate) unsafe fn unmap(va: sys::CUdeviceptr, size: usize) -> Result<(), DriverError> {
    // SAFETY: guaranteed by the caller.
    unsafe { sys::cuMemUnmap(va, size) }.result()
}
