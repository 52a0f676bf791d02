//! The allocator behind the C ABI, whatever its device: [`Engine`] is the
//! small object-safe slice of [`Allocator`] one device of the library needs,
//! driven by events through the engine's one [`Driver`] (out of memory is an
//! error the caller sees). The allocator is a [`SharedAllocator`], so that
//! the control socket's thread can swap and report it between two calls.

use std::sync::Arc;

use wasmem::alloc::swap::{SwapError, SwapOptions, SwapReport};
use wasmem::alloc::{AllocError, Allocator, SharedAllocator, Stats};
use wasmem::ctl::ControlledRank;
use wasmem::decision::ReclaimDecision;
use wasmem::device::cuda::CudaDevice;
use wasmem::device::sim::SimDevice;
use wasmem::device::{Device, DeviceError, DevicePtr};
use wasmem::driver::{DriveError, Driver, OnOom};
use wasmem::spec::Resolved;
use wasmem::trace::snapshot::export::{ExportSegment, ExportTraceEntry};
use wasmem::trace::Event;
use wasmem::types::{InvariantError, TensorId, TensorKind};

use crate::config::Backend;

/// An allocator over some device, driven by events.
pub trait Engine: Send {
    /// Applies `ev`; an `alloc` that got storage returns its handle and
    /// device address.
    fn apply(&mut self, ev: &Event) -> Result<Option<(TensorId, DevicePtr)>, DriveError>;
    /// Changes the kind of the live tensor of trace id `id`
    /// ([`Allocator::retag`]).
    fn retag(&mut self, id: u64, kind: TensorKind) -> Result<(), AllocError>;
    /// Statistics so far.
    fn stats(&self) -> Stats;
    /// Peaks back to the current values ([`Allocator::reset_peaks`]).
    fn reset_peaks(&mut self);
    /// Releases every entirely free cached segment and free page (the
    /// reclamation path, [`Allocator::release_cached`]); returns the bytes.
    fn release_cached(&mut self) -> Result<u64, AllocError>;
    /// Records allocator actions from now on (`on`), or stops.
    fn record_actions(&mut self, on: bool);
    /// The segments now, in PyTorch's snapshot shape.
    fn segments(&self) -> Vec<ExportSegment>;
    /// The actions recorded since the last call, in PyTorch's snapshot shape.
    fn take_actions(&mut self) -> Vec<ExportTraceEntry>;
    /// The allocator as the control socket sees it.
    fn controlled(&self) -> Arc<dyn ControlledRank>;
    /// The one hot swap ([`wasmem::alloc::swap::swap`]).
    fn swap(&mut self, new: Resolved, opts: &SwapOptions) -> Result<SwapReport, SwapError>;
    /// The backend's name (`cuda`, `sim`).
    fn device_name(&self) -> &'static str;
    /// The device's capacity in bytes.
    fn capacity(&self) -> u64;
    /// The allocator's invariants ([`Allocator::check_invariants`]).
    fn check(&self) -> Result<(), InvariantError>;
    /// Reads plans from the plan cache at `path` and keeps the run's plans
    /// there ([`Allocator::use_plan_cache`]); returns the plans read.
    fn use_plan_cache(&mut self, path: &std::path::Path) -> Result<usize, wasmem::alloc::PlanCacheError>;
}

/// An allocator and its driver.
struct Driven<D: Device> {
    alloc: SharedAllocator<D>,
    driver: Driver,
}

impl<D: Device + 'static> Engine for Driven<D> {
    fn apply(&mut self, ev: &Event) -> Result<Option<(TensorId, DevicePtr)>, DriveError> {
        let n = self.driver.events();
        let driver = &mut self.driver;
        self.alloc.with(|a| match driver.apply(a, ev, None)? {
            Some(id) => {
                let addr = a.address(id).map_err(|cause| DriveError::Alloc { event: n, cause })?;
                Ok(Some((id, addr)))
            }
            None => Ok(None),
        })
    }

    fn retag(&mut self, id: u64, kind: TensorKind) -> Result<(), AllocError> {
        match self.driver.handle(id) {
            Some(h) => self.alloc.with(|a| a.retag(h, kind)),
            // A zero-byte tensor has no storage to retag.
            None => Ok(()),
        }
    }

    fn stats(&self) -> Stats {
        self.alloc.with(|a| a.stats())
    }

    fn reset_peaks(&mut self) {
        self.alloc.with(Allocator::reset_peaks);
    }

    fn release_cached(&mut self) -> Result<u64, AllocError> {
        let all = ReclaimDecision { release_bytes: u64::MAX, pools: None, compact: None, stitch: false, trim: true };
        self.alloc.with(|a| a.release_cached(&all))
    }

    fn record_actions(&mut self, on: bool) {
        self.alloc.with(|a| a.record_actions(on));
    }

    fn segments(&self) -> Vec<ExportSegment> {
        self.alloc.with(|a| wasmem::replay::export_segments(a))
    }

    fn take_actions(&mut self) -> Vec<ExportTraceEntry> {
        wasmem::replay::export_actions(self.alloc.with(|a| a.take_actions()))
    }

    fn controlled(&self) -> Arc<dyn ControlledRank> {
        Arc::new(self.alloc.clone())
    }

    fn swap(&mut self, new: Resolved, opts: &SwapOptions) -> Result<SwapReport, SwapError> {
        self.alloc.swap(new, opts).map(|(report, _held)| report)
    }

    fn device_name(&self) -> &'static str {
        self.alloc.with(|a| a.device().name())
    }

    fn capacity(&self) -> u64 {
        self.alloc.with(|a| a.device().capacity())
    }

    fn check(&self) -> Result<(), InvariantError> {
        self.alloc.with(|a| a.check_invariants())
    }

    fn use_plan_cache(&mut self, path: &std::path::Path) -> Result<usize, wasmem::alloc::PlanCacheError> {
        self.alloc.with(|a| a.use_plan_cache(path))
    }
}

fn driven<D: Device + 'static>(device: D, resolved: Resolved) -> Box<dyn Engine> {
    let mut alloc = Allocator::new(device, resolved.policies);
    alloc.set_planner(resolved.planner);
    // PyTorch holds the addresses: tensors never move (planned arenas are
    // installed without moving live tensors into them).
    alloc.set_stable_addresses(true);
    let alloc = SharedAllocator::new(alloc);
    Box::new(Driven { alloc, driver: Driver::new(OnOom::Error) })
}

/// Opens `backend` (device `ordinal` on CUDA; each `sim` device is a
/// separate simulated device of the configured capacity) under the policies
/// (and planner) of `policies`.
pub fn open(backend: Backend, ordinal: usize, policies: Resolved) -> Result<Box<dyn Engine>, DeviceError> {
    Ok(match backend {
        Backend::Cuda => driven(CudaDevice::new(ordinal)?, policies),
        Backend::Sim { capacity } => driven(SimDevice::with_capacity(capacity), policies),
    })
}
