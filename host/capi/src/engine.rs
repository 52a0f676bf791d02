//! The allocator behind the C ABI, whatever its device: [`Engine`] is the
//! small object-safe slice of [`Allocator`] the library needs.

use wasmem::alloc::swap::{swap, SwapError, SwapOptions, SwapReport};
use wasmem::alloc::{AllocError, Allocator, Stats};
use wasmem::decision::Policies;
use wasmem::device::cuda::CudaDevice;
use wasmem::device::sim::SimDevice;
use wasmem::device::{Device, DeviceError, DevicePtr};
use wasmem::spec::Resolved;
use wasmem::types::{StreamId, TensorId, TensorKind};

use crate::config::Backend;

/// An allocator over some device.
pub trait Engine: Send {
    /// Allocates `bytes` (a tensor of kind `other`) on `stream`; returns the
    /// handle and its device address.
    fn alloc(&mut self, bytes: u64, stream: StreamId) -> Result<(TensorId, DevicePtr), AllocError>;
    /// Frees a live tensor.
    fn free(&mut self, id: TensorId) -> Result<(), AllocError>;
    /// Statistics so far.
    fn stats(&self) -> Stats;
    /// The one hot swap ([`wasmem::alloc::swap::swap`]): the roles `new`
    /// provides, carrying state, between two decisions.
    fn swap(&mut self, new: Resolved) -> Result<SwapReport, SwapError>;
    /// The backend's name (`cuda`, `sim`).
    fn device_name(&self) -> &'static str;
    /// The device's capacity in bytes.
    fn capacity(&self) -> u64;
}

impl<D: Device> Engine for Allocator<D> {
    fn alloc(&mut self, bytes: u64, stream: StreamId) -> Result<(TensorId, DevicePtr), AllocError> {
        let id = Allocator::alloc(self, bytes, TensorKind::Other, stream)?;
        Ok((id, self.address(id)?))
    }

    fn free(&mut self, id: TensorId) -> Result<(), AllocError> {
        Allocator::free(self, id)
    }

    fn stats(&self) -> Stats {
        Allocator::stats(self)
    }

    fn swap(&mut self, new: Resolved) -> Result<SwapReport, SwapError> {
        swap(self, new, &SwapOptions::default()).map(|(report, _retired)| report)
    }

    fn device_name(&self) -> &'static str {
        self.device().name()
    }

    fn capacity(&self) -> u64 {
        self.device().capacity()
    }
}

/// Opens `backend` (device `ordinal` on CUDA; the ordinal is ignored by
/// `sim`) under `policies`.
pub fn open(backend: Backend, ordinal: usize, policies: Policies) -> Result<Box<dyn Engine>, DeviceError> {
    Ok(match backend {
        Backend::Cuda => Box::new(Allocator::new(CudaDevice::new(ordinal)?, policies)),
        Backend::Sim { capacity } => Box::new(Allocator::new(SimDevice::with_capacity(capacity), policies)),
    })
}
