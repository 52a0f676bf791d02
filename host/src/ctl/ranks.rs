//! [`RankControl`]: the [`Control`] of a run whose ranks each allocate
//! through a [`SharedAllocator`].
//!
//! A swap resolves the spec once per rank (each rank gets its own policy
//! instances: policies keep per-rank state) *before* touching any rank, so a
//! spec that does not load, or does not provide the role asked for, changes
//! nothing. Then each rank is swapped with [`SharedAllocator::swap`] (the one
//! swap of [`crate::alloc::swap`]), which replaces all its roles between two
//! of its decisions and carries state when the old policy is the same
//! policy. Departure: a swap is atomic per rank, not across ranks; a failing
//! state transfer on rank k leaves ranks < k swapped and is reported with the
//! rank.

use std::sync::Arc;

use super::protocol::{RoleArg, MAX_REPLY_BYTES};
use super::server::{Control, SwapOutcome};
use super::status::{rank_status, shadow_summary, Status};
use crate::alloc::swap::{target_roles, SwapOptions};
use crate::alloc::SharedAllocator;
use crate::device::Device;
use crate::shadow::ShadowHandle;
use crate::spec::{resolve, Loader};

/// A hook that adds what only the driver knows (the current step…) to a status.
pub type StatusHook = Box<dyn Fn(&mut Status) + Send + Sync>;

/// The ranks of a run, with what a swap needs to load policies.
pub struct RankControl<D: Device> {
    ranks: Vec<SharedAllocator<D>>,
    loader: Loader,
    shadows: Vec<(usize, ShadowHandle)>,
    hook: Option<StatusHook>,
}

impl<D: Device> RankControl<D> {
    /// Controls `ranks` (rank `i` is `ranks[i]`), resolving specs with `loader`.
    pub fn new(ranks: Vec<SharedAllocator<D>>, loader: Loader) -> Self {
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
    pub fn into_arc(self) -> Arc<dyn Control>
    where
        D: 'static,
    {
        Arc::new(self)
    }
}

impl<D: Device> Control for RankControl<D> {
    fn swap(&self, role: RoleArg, spec: &str) -> Result<SwapOutcome, String> {
        if self.ranks.is_empty() {
            return Err("no rank to swap".into());
        }
        let opts = SwapOptions { roles: (role != RoleArg::All).then(|| role.roles()), ..SwapOptions::default() };
        let mut resolved = Vec::with_capacity(self.ranks.len());
        for _ in &self.ranks {
            let r = resolve(spec, &*self.loader).map_err(|e| format!("cannot load policy `{spec}`: {e}"))?;
            target_roles(&r, &opts).map_err(|e| e.to_string())?;
            resolved.push(r);
        }
        // The reply must fit before anything changes: its size is that of
        // the outcome built from the names it will carry.
        let roles = target_roles(&resolved[0], &opts).map_err(|e| e.to_string())?;
        let old = self.ranks[0].with(|a| a.policies().names());
        let provisional = SwapOutcome {
            roles: roles.iter().map(ToString::to_string).collect(),
            policy: spec.to_string(),
            old: roles.iter().map(|r| old[r.index()].clone()).collect(),
            new: roles.iter().map(|r| resolved[0].policies.name(*r).to_string()).collect(),
            ranks: self.ranks.len(),
            state_bytes: Some(usize::MAX),
        };
        let size = serde_json::to_string(&provisional).map_or(usize::MAX, |s| s.len()) + 64;
        if size > MAX_REPLY_BYTES {
            return Err(format!(
                "swap to `{}` refused: its reply would take {size} bytes, more than {MAX_REPLY_BYTES}",
                crate::text::name(spec)
            ));
        }
        let mut out = SwapOutcome { policy: spec.to_string(), ranks: self.ranks.len(), ..SwapOutcome::default() };
        for (rank, (shared, res)) in self.ranks.iter().zip(resolved).enumerate() {
            let (rep, _) = shared.swap(res, &opts).map_err(|e| format!("rank {rank}: {e}"))?;
            if rank == 0 {
                out.roles = rep.roles.iter().map(ToString::to_string).collect();
                out.old = rep.old;
                out.new = rep.new;
                out.state_bytes = rep.state_bytes;
            }
        }
        tracing::info!(policy = spec, roles = ?out.roles, old = ?out.old, ranks = out.ranks, "policy swapped through the control socket");
        Ok(out)
    }

    fn status(&self) -> Status {
        let mut s = Status {
            pid: std::process::id(),
            step: None,
            ranks: self.ranks.iter().enumerate().map(|(i, r)| r.with(|a| rank_status(i, a))).collect(),
            shadows: self.shadows.iter().map(|(rank, h)| shadow_summary(*rank, h)).collect(),
        };
        if let Some(h) = &self.hook {
            h(&mut s);
        }
        s
    }
}
