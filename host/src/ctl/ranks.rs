//! [`RankControl`]: the [`Control`] of a run whose ranks each allocate
//! through a [`SharedAllocator`], and the swap over ranks it performs
//! ([`prepare_swap`], [`PreparedSwap::apply`]), which other controls (the C
//! ABI's, over the devices of a process) reuse.
//!
//! A swap resolves the spec once per rank (each rank gets its own policy
//! instances: policies keep per-rank state) *before* touching any rank, so a
//! spec that does not load, or does not provide the role asked for, changes
//! nothing. Then each rank is swapped with [`ControlledRank::swap`] (the one
//! swap of [`crate::alloc::swap`]), which replaces all its roles between two
//! of its decisions and carries state when the old policy is the same
//! policy. Departure: a swap is atomic per rank, not across ranks; a failing
//! state transfer on rank k leaves ranks < k swapped and is reported with the
//! rank.

use std::sync::Arc;

use super::protocol::{RoleArg, MAX_REPLY_BYTES};
use super::server::{Control, SwapOutcome};
use super::status::{rank_status, shadow_summary, RankStatus, Status};
use crate::alloc::swap::{target_roles, SwapError, SwapOptions, SwapReport};
use crate::alloc::SharedAllocator;
use crate::device::Device;
use crate::shadow::ShadowHandle;
use crate::spec::{resolve, Loader, PartLoader, Resolved};

/// A hook that adds what only the driver knows (the current step…) to a status.
pub type StatusHook = Box<dyn Fn(&mut Status) + Send + Sync>;

/// One allocator a control server acts on: a rank of a run, or a device of
/// a process (the C ABI). Implemented by every [`SharedAllocator`].
pub trait ControlledRank: Send + Sync {
    /// The active policy of each role (placement, reclamation, eviction).
    fn policy_names(&self) -> [String; 3];
    /// The one swap ([`crate::alloc::swap::swap`]) between two decisions.
    fn swap(&self, new: Resolved, opts: &SwapOptions) -> Result<SwapReport, SwapError>;
    /// Its status, reported as rank `rank`.
    fn status(&self, rank: usize) -> RankStatus;
}

impl<D: Device + 'static> ControlledRank for SharedAllocator<D> {
    fn policy_names(&self) -> [String; 3] {
        self.with(|a| a.policies().names())
    }

    fn swap(&self, new: Resolved, opts: &SwapOptions) -> Result<SwapReport, SwapError> {
        SharedAllocator::swap(self, new, opts).map(|(report, _)| report)
    }

    fn status(&self, rank: usize) -> RankStatus {
        self.with(|a| rank_status(rank, a))
    }
}

/// A swap whose spec resolved for every rank and provides the roles asked
/// for; nothing has changed yet.
pub struct PreparedSwap {
    spec: String,
    opts: SwapOptions,
    resolved: Vec<Resolved>,
    /// The outcome as rank 0 will report it (names of the roles swapped,
    /// old and new policies), used when there is no rank.
    provisional: SwapOutcome,
}

impl std::fmt::Debug for PreparedSwap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PreparedSwap").field("spec", &self.spec).field("ranks", &self.resolved.len()).finish()
    }
}

/// Prepares swapping `role` to `spec` on `ranks` ranks whose first rank's
/// policies are `first` (the policies the swap replaces, for the reply):
/// resolves the spec once per rank (at least once, so that a swap with no
/// rank still checks the spec), checks the roles and that the reply fits.
pub fn prepare_swap(
    first: [String; 3],
    ranks: usize,
    role: RoleArg,
    spec: &str,
    loader: &dyn PartLoader,
) -> Result<PreparedSwap, String> {
    let opts = SwapOptions { roles: (role != RoleArg::All).then(|| role.roles()), ..SwapOptions::default() };
    let mut resolved = Vec::with_capacity(ranks.max(1));
    for _ in 0..ranks.max(1) {
        let r = resolve(spec, loader).map_err(|e| format!("cannot load policy `{spec}`: {e}"))?;
        target_roles(&r, &opts).map_err(|e| e.to_string())?;
        resolved.push(r);
    }
    // The reply must fit before anything changes: its size is that of the
    // outcome built from the names it will carry.
    let roles = target_roles(&resolved[0], &opts).map_err(|e| e.to_string())?;
    let provisional = SwapOutcome {
        roles: roles.iter().map(ToString::to_string).collect(),
        policy: spec.to_string(),
        old: roles.iter().map(|r| first[r.index()].clone()).collect(),
        new: roles.iter().map(|r| resolved[0].policies.name(*r).to_string()).collect(),
        ranks,
        state_bytes: None,
    };
    let mut sized = provisional.clone();
    sized.state_bytes = Some(usize::MAX);
    let size = serde_json::to_string(&sized).map_or(usize::MAX, |s| s.len()) + 64;
    if size > MAX_REPLY_BYTES {
        return Err(format!(
            "swap to `{}` refused: its reply would take {size} bytes, more than {MAX_REPLY_BYTES}",
            crate::text::name(spec)
        ));
    }
    resolved.truncate(ranks);
    Ok(PreparedSwap { spec: spec.to_string(), opts, resolved, provisional })
}

impl PreparedSwap {
    /// The ranks it was prepared for.
    pub fn ranks(&self) -> usize {
        self.resolved.len()
    }

    /// The swap options (which roles).
    pub fn options(&self) -> &SwapOptions {
        &self.opts
    }

    /// Swaps each of `ranks` (as many as prepared for) in order; the outcome
    /// names rank 0's policies. With no rank, the outcome is the provisional
    /// one (nothing to swap).
    pub fn apply(self, ranks: &[&dyn ControlledRank]) -> Result<SwapOutcome, String> {
        if ranks.len() != self.resolved.len() {
            return Err(format!("the swap was prepared for {} rank(s), not {}", self.resolved.len(), ranks.len()));
        }
        let mut out = SwapOutcome { policy: self.spec.clone(), ranks: ranks.len(), ..self.provisional };
        for (rank, (shared, res)) in ranks.iter().zip(self.resolved).enumerate() {
            let rep = shared.swap(res, &self.opts).map_err(|e| format!("rank {rank}: {e}"))?;
            if rank == 0 {
                out.roles = rep.roles.iter().map(ToString::to_string).collect();
                out.old = rep.old;
                out.new = rep.new;
                out.state_bytes = rep.state_bytes;
            }
        }
        tracing::info!(policy = %self.spec, roles = ?out.roles, old = ?out.old, ranks = out.ranks, "policy swapped through the control socket");
        Ok(out)
    }
}

/// The ranks of a run, with what a swap needs to load policies.
pub struct RankControl {
    ranks: Vec<Arc<dyn ControlledRank>>,
    loader: Loader,
    shadows: Vec<(usize, ShadowHandle)>,
    hook: Option<StatusHook>,
}

impl RankControl {
    /// Controls `ranks` (rank `i` is `ranks[i]`), resolving specs with `loader`.
    pub fn new<D: Device + 'static>(ranks: Vec<SharedAllocator<D>>, loader: Loader) -> Self {
        let ranks = ranks.into_iter().map(|r| Arc::new(r) as Arc<dyn ControlledRank>).collect();
        RankControl { ranks, loader, shadows: Vec::new(), hook: None }
    }

    /// Reports `shadow`, fed by rank `rank`, in the status.
    pub fn with_shadow(mut self, rank: usize, shadow: ShadowHandle) -> Self {
        self.shadows.push((rank, shadow));
        self
    }

    /// Lets the driver complete each status (current step…).
    pub fn with_status_hook(mut self, hook: StatusHook) -> Self {
        self.hook = Some(hook);
        self
    }

    /// Shares this control for a [`super::CtlServer`].
    pub fn into_arc(self) -> Arc<dyn Control> {
        Arc::new(self)
    }
}

impl Control for RankControl {
    fn swap(&self, role: RoleArg, spec: &str) -> Result<SwapOutcome, String> {
        let Some(first) = self.ranks.first() else {
            return Err("no rank to swap".into());
        };
        let prepared = prepare_swap(first.policy_names(), self.ranks.len(), role, spec, &*self.loader)?;
        let ranks: Vec<&dyn ControlledRank> = self.ranks.iter().map(|r| &**r).collect();
        prepared.apply(&ranks)
    }

    fn status(&self) -> Status {
        let mut s = Status {
            pid: std::process::id(),
            process_rank: None,
            step: None,
            ranks: self.ranks.iter().enumerate().map(|(i, r)| r.status(i)).collect(),
            shadows: self.shadows.iter().map(|(rank, h)| shadow_summary(*rank, h)).collect(),
        };
        if let Some(h) = &self.hook {
            h(&mut s);
        }
        s
    }
}
