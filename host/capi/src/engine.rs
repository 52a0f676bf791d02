//! The allocator behind the C ABI, whatever its device: [`Engine`] is the
//! small object-safe slice of [`Allocator`] the library needs, driven by
//! events through the engine's one [`Driver`] (out of memory is an error the
//! caller sees).

use wasmem::alloc::swap::{swap, SwapError, SwapOptions, SwapReport};
use wasmem::alloc::{Allocator, Stats};
use wasmem::decision::{PlannerPolicy, Policies};
use wasmem::device::cuda::CudaDevice;
use wasmem::device::sim::SimDevice;
use wasmem::device::{Device, DeviceError, DevicePtr};
use wasmem::driver::{DriveError, Driver, OnOom};
use wasmem::spec::Resolved;
use wasmem::trace::Event;
use wasmem::types::TensorId;

use crate::config::Backend;

/// An allocator over some device, driven by events.
pub trait Engine: Send {
    /// Applies `ev`; an `alloc` that got storage returns its handle and
    /// device address.
    fn apply(&mut self, ev: &Event) -> Result<Option<(TensorId, DevicePtr)>, DriveError>;
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

/// An allocator and its driver.
struct Driven<D: Device> {
    alloc: Allocator<D>,
    driver: Driver,
}

impl<D: Device> Engine for Driven<D> {
    fn apply(&mut self, ev: &Event) -> Result<Option<(TensorId, DevicePtr)>, DriveError> {
        let n = self.driver.events();
        match self.driver.apply(&mut self.alloc, ev, None)? {
            Some(id) => {
                let addr = self.alloc.address(id).map_err(|cause| DriveError::Alloc { event: n, cause })?;
                Ok(Some((id, addr)))
            }
            None => Ok(None),
        }
    }

    fn stats(&self) -> Stats {
        self.alloc.stats()
    }

    fn swap(&mut self, new: Resolved) -> Result<SwapReport, SwapError> {
        swap(&mut self.alloc, new, &SwapOptions::default()).map(|(report, _retired)| report)
    }

    fn device_name(&self) -> &'static str {
        self.alloc.device().name()
    }

    fn capacity(&self) -> u64 {
        self.alloc.device().capacity()
    }
}

fn driven<D: Device + 'static>(
    device: D,
    policies: Policies,
    planner: Option<Box<dyn PlannerPolicy>>,
) -> Box<dyn Engine> {
    let mut alloc = Allocator::new(device, policies);
    // PyTorch holds the pointers: no tensor may ever move (no compaction,
    // a planned arena installed without moving live tensors into it).
    alloc.set_stable_addresses(true);
    alloc.set_planner(planner);
    Box::new(Driven { alloc, driver: Driver::new(OnOom::Error) })
}

/// Opens `backend` (device `ordinal` on CUDA; the ordinal is ignored by
/// `sim`) under `policies` and `planner`.
pub fn open(
    backend: Backend,
    ordinal: usize,
    policies: Policies,
    planner: Option<Box<dyn PlannerPolicy>>,
) -> Result<Box<dyn Engine>, DeviceError> {
    Ok(match backend {
        Backend::Cuda => driven(CudaDevice::new(ordinal)?, policies, planner),
        Backend::Sim { capacity } => driven(SimDevice::with_capacity(capacity), policies, planner),
    })
}
