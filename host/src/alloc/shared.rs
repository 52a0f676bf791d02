//! [`SharedAllocator`]: the engine's thread-safe handle, an
//! `Arc<Mutex<Allocator>>` whose policies can be hot-swapped between two
//! decisions while other threads allocate.
//!
//! Locking rule: every allocator call takes the lock once and holds it for
//! that call only; policy calls happen under it (a decision needs the
//! allocator's state, and the policy sees a consistent one). A swap takes it
//! once for the state transfer and the replacement ([`super::swap`]), and
//! drops the retired policies after releasing it. No device call or policy
//! call is made while holding another lock. The lock is not re-entrant:
//! closures passed to [`SharedAllocator::with`] must not call back into the
//! same handle.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::swap::{swap, SwapError, SwapOptions, SwapReport};
use super::{AllocError, Allocator};
use crate::decision::{Role, StateHandle};
use crate::device::Device;
use crate::spec::Resolved;
use crate::types::{Phase, StreamId, TensorId, TensorKind};

/// A thread-safe allocator handle with hot-swappable policies. Clones share
/// the allocator.
pub struct SharedAllocator<D: Device> {
    inner: Arc<Mutex<Allocator<D>>>,
}

impl<D: Device> Clone for SharedAllocator<D> {
    fn clone(&self) -> Self {
        SharedAllocator { inner: self.inner.clone() }
    }
}

impl<D: Device> SharedAllocator<D> {
    /// Shares `alloc`.
    pub fn new(alloc: Allocator<D>) -> Self {
        SharedAllocator { inner: Arc::new(Mutex::new(alloc)) }
    }

    fn lock(&self) -> MutexGuard<'_, Allocator<D>> {
        // The allocator keeps its invariants across a panic in a caller's
        // closure only if that closure kept them; `with` documents this.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// [`Allocator::alloc`].
    pub fn alloc(&self, bytes: u64, kind: TensorKind, stream: StreamId) -> Result<TensorId, AllocError> {
        self.lock().alloc(bytes, kind, stream)
    }

    /// [`Allocator::free`].
    pub fn free(&self, id: TensorId) -> Result<(), AllocError> {
        self.lock().free(id)
    }

    /// [`Allocator::use_tensor`].
    pub fn use_tensor(&self, id: TensorId, stream: Option<StreamId>) -> Result<(), AllocError> {
        self.lock().use_tensor(id, stream)
    }

    /// [`Allocator::phase`].
    pub fn phase(&self, phase: Phase, step: u64) -> Result<(), AllocError> {
        self.lock().phase(phase, step)
    }

    /// Runs `f` with the allocator locked (statistics, invariants, direct
    /// calls). A panic in `f` leaves the allocator as `f` left it.
    pub fn with<R>(&self, f: impl FnOnce(&mut Allocator<D>) -> R) -> R {
        f(&mut self.lock())
    }

    /// The state behind the policy serving `role` now, if it has one.
    pub fn state(&self, role: Role) -> Option<StateHandle> {
        self.lock().policies().state(role)
    }

    /// [`super::swap::swap`] between two decisions of the threads sharing the
    /// allocator; the policies it replaces are dropped after the lock is
    /// released. Returns the report and how long the lock was held.
    pub fn swap(&self, new: Resolved, opts: &SwapOptions) -> Result<(SwapReport, Duration), SwapError> {
        let mut g = self.lock();
        let t0 = Instant::now();
        let (report, retired) = swap(&mut g, new, opts)?;
        let held = t0.elapsed();
        drop(g);
        drop(retired);
        Ok((report, held))
    }
}
