//! Hot swap: a thread-safe allocator handle whose policies can be replaced
//! between two decisions while other threads allocate.
//!
//! [`SharedAllocator`] is an `Arc<Mutex<Allocator>>` plus a registry of the
//! WebAssembly instance behind each role. [`SharedAllocator::swap`]:
//!
//! 1. the caller has instantiated (and `init`ed) the new policy *outside* the
//!    lock ([`super::Loaded::instantiate`]);
//! 2. under the allocator lock — decisions are paused — the old instance's
//!    `save-state` is loaded into the new one with `load-state` when the
//!    [`CarryState`] rule says so; a failing `load-state` aborts the swap
//!    with [`SwapError::LoadState`] and the old policy stays;
//! 3. the roles are replaced (`Allocator::set_placement` also clears the
//!    placement memo and re-maps pools by name), and the lock is released.
//!
//! The lock is held only for the state transfer (two lifecycle calls, bounded
//! by the lifecycle deadline) and the pointer swap.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::error::SwapError;
use super::instance::WasmPolicy;
use super::resolve::Resolved;
use crate::alloc::{AllocError, Allocator};
use crate::decision::{PolicyError, Role};
use crate::device::Device;
use crate::types::{Phase, StreamId, TensorId, TensorKind};

/// When to carry learned state from the old policy to the new one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CarryState {
    /// When the old role is a WebAssembly policy with the same
    /// `lifecycle.name` as the new one (state formats are per policy).
    #[default]
    SameName,
    /// Whenever the old role is a WebAssembly policy.
    Always,
    /// Never: the new policy starts from its `init` state.
    Never,
}

/// Options of [`SharedAllocator::swap`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SwapOptions {
    /// Roles to replace; `None`: every role the new policy exports.
    pub roles: Option<Vec<Role>>,
    /// State transfer rule.
    pub carry: CarryState,
}

/// What a swap did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SwapReport {
    /// Roles replaced.
    pub roles: Vec<Role>,
    /// Names of the policies replaced, per role in `roles`.
    pub old: Vec<String>,
    /// Name of the new policy.
    pub new: String,
    /// Bytes of state carried over (`None`: no transfer).
    pub state_bytes: Option<usize>,
    /// `save-state` of the old policy failed; the new one starts fresh.
    pub save_error: Option<PolicyError>,
    /// Time the allocator lock was held.
    pub lock_held: Duration,
}

struct Shared<D: Device> {
    alloc: Allocator<D>,
    /// The WebAssembly instance behind each role (placement, reclamation, eviction).
    wasm: [Option<WasmPolicy>; 3],
}

/// A thread-safe allocator handle with hot-swappable policies. Clones share
/// the allocator.
pub struct SharedAllocator<D: Device> {
    inner: Arc<Mutex<Shared<D>>>,
}

impl<D: Device> Clone for SharedAllocator<D> {
    fn clone(&self) -> Self {
        SharedAllocator { inner: self.inner.clone() }
    }
}

impl<D: Device> SharedAllocator<D> {
    /// Wraps `alloc` (its policies are treated as native: no state transfer
    /// from them).
    pub fn new(alloc: Allocator<D>) -> Self {
        SharedAllocator { inner: Arc::new(Mutex::new(Shared { alloc, wasm: Default::default() })) }
    }

    /// An allocator over `device` driven by the policies of a resolved spec.
    pub fn from_resolved(device: D, resolved: Resolved) -> Self {
        let Resolved { policies, wasm, .. } = resolved;
        let alloc = Allocator::new(device, policies);
        SharedAllocator { inner: Arc::new(Mutex::new(Shared { alloc, wasm })) }
    }

    fn lock(&self) -> MutexGuard<'_, Shared<D>> {
        // The allocator keeps its invariants across a panic in a caller's
        // closure only if that closure kept them; `with` documents this.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// [`Allocator::alloc`].
    pub fn alloc(&self, bytes: u64, kind: TensorKind, stream: StreamId) -> Result<TensorId, AllocError> {
        self.lock().alloc.alloc(bytes, kind, stream)
    }

    /// [`Allocator::free`].
    pub fn free(&self, id: TensorId) -> Result<(), AllocError> {
        self.lock().alloc.free(id)
    }

    /// [`Allocator::use_tensor`].
    pub fn use_tensor(&self, id: TensorId, stream: Option<StreamId>) -> Result<(), AllocError> {
        self.lock().alloc.use_tensor(id, stream)
    }

    /// [`Allocator::phase`].
    pub fn phase(&self, phase: Phase, step: u64) -> Result<(), AllocError> {
        self.lock().alloc.phase(phase, step)
    }

    /// Runs `f` with the allocator locked (statistics, invariants, direct
    /// calls). Replacing policies through `f` is allowed; state transfer then
    /// only happens from WebAssembly policies swapped in by [`Self::swap`].
    pub fn with<R>(&self, f: impl FnOnce(&mut Allocator<D>) -> R) -> R {
        f(&mut self.lock().alloc)
    }

    /// The WebAssembly instance serving `role` now, if any.
    pub fn wasm_policy(&self, role: Role) -> Option<WasmPolicy> {
        let g = self.lock();
        current_wasm(&g, role)
    }

    /// Replaces the roles of `opts.roles` (default: all the new policy
    /// exports) by `new`, atomically between two decisions; see the module
    /// documentation. On error nothing changed.
    pub fn swap(&self, new: &WasmPolicy, opts: &SwapOptions) -> Result<SwapReport, SwapError> {
        let roles = opts.roles.clone().unwrap_or_else(|| new.roles().to_vec());
        if let Some(&role) = roles.iter().find(|r| !new.exports(**r)) {
            return Err(SwapError::MissingRole { policy: new.name().to_string(), role });
        }
        // Adapters are built before taking the lock.
        let placement = roles.contains(&Role::Placement).then(|| new.placement()).flatten();
        let reclamation = roles.contains(&Role::Reclamation).then(|| new.reclamation()).flatten();
        let eviction = roles.contains(&Role::Eviction).then(|| new.eviction()).flatten();

        let mut g = self.lock();
        let t0 = Instant::now();
        let names = g.alloc.policies().names();
        let old: Vec<String> = roles.iter().map(|r| names[*r as usize].clone()).collect();
        let mut state_bytes = None;
        let mut save_error = None;
        let from = roles.iter().find_map(|r| current_wasm(&g, *r));
        if let Some(from) = from.filter(|f| !Arc::ptr_eq(&f.instance, &new.instance)) {
            let carry = match opts.carry {
                CarryState::SameName => from.name() == new.name(),
                CarryState::Always => true,
                CarryState::Never => false,
            };
            if carry {
                match from.save_state() {
                    Ok(state) => {
                        new.load_state(&state).map_err(|cause| SwapError::LoadState {
                            old: from.name().to_string(),
                            new: new.name().to_string(),
                            cause,
                        })?;
                        state_bytes = Some(state.len());
                    }
                    Err(e) => {
                        tracing::warn!(old = from.name(), new = new.name(), error = %e,
                            "save-state failed during a swap; the new policy starts without state");
                        save_error = Some(e);
                    }
                }
            }
        }
        // The old instances are dropped after the lock is released (a store
        // takes tens of microseconds to tear down): `retired` keeps a
        // reference until then.
        let mut retired = Vec::new();
        if let Some(p) = placement {
            g.alloc.set_placement(Box::new(p));
            retired.push(g.wasm[Role::Placement as usize].replace(new.clone()));
        }
        if let Some(p) = reclamation {
            g.alloc.set_reclamation(Box::new(p));
            retired.push(g.wasm[Role::Reclamation as usize].replace(new.clone()));
        }
        if let Some(p) = eviction {
            g.alloc.set_eviction(Box::new(p));
            retired.push(g.wasm[Role::Eviction as usize].replace(new.clone()));
        }
        let lock_held = t0.elapsed();
        drop(g);
        drop(retired);
        tracing::info!(new = new.name(), ?roles, ?old, ?state_bytes, ?lock_held, "policy swapped");
        Ok(SwapReport { roles, old, new: new.name().to_string(), state_bytes, save_error, lock_held })
    }
}

/// The registered instance of `role`, if it still serves it (a policy set
/// through [`SharedAllocator::with`] replaces it under a different name).
fn current_wasm<D: Device>(g: &Shared<D>, role: Role) -> Option<WasmPolicy> {
    let w = g.wasm[role as usize].as_ref()?;
    (g.alloc.policies().names()[role as usize] == w.name()).then(|| w.clone())
}
