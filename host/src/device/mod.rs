//! Device backends: where segments come from.
//!
//! A [`Device`] hands out *segments* (contiguous device ranges), models the
//! CUDA virtual-memory API (reserve a virtual range, create physical pages,
//! map and unmap them), streams with events, and copies. Backends know nothing
//! of the allocator above them.
//!
//! - [`sim::SimDevice`]: the embedded default. Accounts bytes against a
//!   configured capacity, charges a cost model so replays report simulated
//!   time, and can back memory with host bytes so contents can be checked.
//! - [`cuda::CudaDevice`]: the same operations on a real GPU through `cudarc`
//!   (driver loaded at run time; a clean error where there is none).

pub mod cuda;
pub mod sim;
mod zeroed;

use crate::types::StreamId;

/// A device (virtual) address. Never crosses the policy boundary.
pub type DevicePtr = u64;

/// A physical allocation created by [`Device::create_physical`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PhysHandle(pub u64);

/// An event recorded on a stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct EventId(pub u64);

/// Why a device operation failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeviceError {
    /// Not enough device memory for the request.
    #[error("device out of memory: requested {requested} bytes, {available} available of {capacity}")]
    OutOfMemory {
        /// Bytes requested.
        requested: u64,
        /// Bytes still available.
        available: u64,
        /// Total capacity.
        capacity: u64,
    },
    /// Host memory for the device's bookkeeping or contents could not be
    /// obtained (a host-backed simulated device).
    #[error("the host could not provide {bytes} bytes to back the device's memory")]
    HostMemory {
        /// Bytes asked of the host.
        bytes: u64,
    },
    /// An address, handle or range the device does not know.
    #[error("invalid argument: {0}")]
    Invalid(String),
    /// The backend does not implement this operation.
    #[error("{0} is not supported by the {1} device")]
    Unsupported(&'static str, &'static str),
    /// The backend is not available on this machine (e.g. no CUDA driver).
    #[error("{0}")]
    Unavailable(String),
    /// A driver call failed.
    #[error("driver error: {0}")]
    Driver(String),
}

/// Counters every backend keeps.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct DeviceCounters {
    /// Segment allocations (cudaMalloc equivalents), including physical page creations.
    pub alloc_calls: u64,
    /// Segment releases (cudaFree equivalents), including physical page releases.
    pub free_calls: u64,
    /// Operations that synchronized the whole device.
    pub syncs: u64,
    /// Bytes copied by [`Device::copy`].
    pub copied_bytes: u64,
    /// Bytes currently held from the device (segments plus physical pages).
    pub used_bytes: u64,
    /// Simulated (or measured) time spent in device calls, microseconds.
    pub time_us: f64,
}

/// A device backend.
///
/// All methods take `&mut self`: the allocator owns its device exclusively.
pub trait Device: Send {
    /// Backend name (`sim`, `cuda`).
    fn name(&self) -> &'static str;
    /// Total device memory in bytes.
    fn capacity(&self) -> u64;
    /// Bytes the device can still hand out, if the backend knows.
    fn available(&self) -> Option<u64>;
    /// Counters so far.
    fn counters(&self) -> DeviceCounters;

    /// Allocates a segment of `bytes` (cudaMalloc).
    fn alloc_segment(&mut self, bytes: u64) -> Result<DevicePtr, DeviceError>;
    /// Releases a segment obtained from [`Device::alloc_segment`] (cudaFree:
    /// synchronizes the device).
    fn free_segment(&mut self, ptr: DevicePtr) -> Result<(), DeviceError>;
    /// Waits for all streams (cudaDeviceSynchronize).
    fn synchronize(&mut self) -> Result<(), DeviceError>;
    /// Host memory for `bytes` bytes of tensor contents off the device: pinned
    /// (page-locked, for full-bandwidth copies) on backends that have it,
    /// ordinary heap memory otherwise (the default).
    fn alloc_host(&mut self, bytes: usize) -> Result<HostBuf, DeviceError> {
        Ok(HostBuf::heap(bytes))
    }
    /// Waits until the work queued on `stream` so far has completed (before
    /// memory that work may touch is unmapped). Returns `true` when the
    /// backend had to synchronize the whole device for it — the default, for
    /// backends that do not know the client's streams.
    fn synchronize_stream(&mut self, stream: StreamId) -> Result<bool, DeviceError> {
        let _ = stream;
        self.synchronize()?;
        Ok(true)
    }

    /// Granularity of physical pages and virtual reservations (2 MiB on CUDA).
    fn granularity(&self) -> u64;
    /// Reserves `bytes` of virtual address space (no memory behind it).
    fn reserve_virtual(&mut self, bytes: u64) -> Result<DevicePtr, DeviceError>;
    /// Releases a virtual reservation; nothing may be mapped in it.
    fn release_virtual(&mut self, va: DevicePtr) -> Result<(), DeviceError>;
    /// Creates `bytes` (a multiple of the granularity) of physical memory.
    fn create_physical(&mut self, bytes: u64) -> Result<PhysHandle, DeviceError>;
    /// Releases physical memory; it must not be mapped.
    fn release_physical(&mut self, phys: PhysHandle) -> Result<(), DeviceError>;
    /// Maps all of `phys` at `va` (inside a reservation, granularity-aligned).
    fn map(&mut self, va: DevicePtr, phys: PhysHandle) -> Result<(), DeviceError>;
    /// Maps `bytes` of `phys` from `offset` on at `va` (all three
    /// granularity-aligned; `cuMemMap`'s offset): one physical allocation
    /// can then back pages at unrelated addresses. Backends without it
    /// return [`DeviceError::Unsupported`] (the default): the allocator then
    /// makes one physical allocation per page.
    fn map_part(&mut self, va: DevicePtr, phys: PhysHandle, offset: u64, bytes: u64) -> Result<(), DeviceError> {
        let _ = (va, phys, offset, bytes);
        Err(DeviceError::Unsupported("mapping part of a physical allocation", self.name()))
    }
    /// Whether [`Device::map_part`] works on this backend.
    fn maps_parts(&self) -> bool {
        false
    }
    /// Unmaps whatever is mapped at `va` (a mapping start).
    fn unmap(&mut self, va: DevicePtr) -> Result<(), DeviceError>;

    /// Records an event on `stream` after the work queued so far.
    fn record_event(&mut self, stream: StreamId) -> Result<EventId, DeviceError>;
    /// Whether all work before the event has completed (never blocks).
    fn event_done(&mut self, event: EventId) -> Result<bool, DeviceError>;
    /// Forgets an event.
    fn destroy_event(&mut self, event: EventId) -> Result<(), DeviceError>;

    /// Copies `bytes` from `src` to `dst` on `stream` (device to device).
    fn copy(&mut self, dst: DevicePtr, src: DevicePtr, bytes: u64, stream: StreamId) -> Result<(), DeviceError>;
    /// Writes host bytes at `dst` (only on backends with host backing or real memory).
    fn write(&mut self, dst: DevicePtr, data: &[u8]) -> Result<(), DeviceError>;
    /// Reads device bytes at `src` into `out`.
    fn read(&mut self, src: DevicePtr, out: &mut [u8]) -> Result<(), DeviceError>;
}

/// Memory a backend pins for host-side copies (see [`Device::alloc_host`]).
pub trait PinnedMemory: Send + Sync + std::fmt::Debug {
    /// The bytes.
    fn as_slice(&self) -> &[u8];
    /// The bytes, writable.
    fn as_mut_slice(&mut self) -> &mut [u8];
}

/// Host memory holding tensor contents off the device: heap or pinned.
#[derive(Debug)]
pub enum HostBuf {
    /// Ordinary (pageable) heap memory.
    Heap(Vec<u8>),
    /// Page-locked memory of a backend, freed by it on drop.
    Pinned(Box<dyn PinnedMemory>),
}

impl HostBuf {
    /// `bytes` zeroed bytes of heap memory.
    pub fn heap(bytes: usize) -> Self {
        HostBuf::Heap(vec![0; bytes])
    }

    /// Whether the memory is page-locked.
    pub fn is_pinned(&self) -> bool {
        matches!(self, HostBuf::Pinned(_))
    }
}

impl From<Vec<u8>> for HostBuf {
    fn from(v: Vec<u8>) -> Self {
        HostBuf::Heap(v)
    }
}

impl std::ops::Deref for HostBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            HostBuf::Heap(v) => v,
            HostBuf::Pinned(p) => p.as_slice(),
        }
    }
}

impl std::ops::DerefMut for HostBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        match self {
            HostBuf::Heap(v) => v,
            HostBuf::Pinned(p) => p.as_mut_slice(),
        }
    }
}
