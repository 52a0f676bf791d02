//! [`RankControl`]: the [`Control`] of a run whose ranks each allocate
//! through a [`SharedAllocator`].
//!
//! A swap resolves the spec once per rank (each rank gets its own
//! WebAssembly instances: policies keep per-rank state) *before* touching
//! any rank, so a spec that does not load changes nothing. Then, rank by
//! rank: built-in roles are set in one locked call
//! ([`crate::alloc::Allocator::set_placement`] …); WebAssembly roles go
//! through [`SharedAllocator::swap`], one call per instance, carrying state
//! when the old policy is the same WebAssembly policy. Each of those calls
//! takes the allocator lock once, so the swap takes effect at the next
//! decision of that rank. Departure: a swap is atomic per rank and per
//! instance, not across ranks or across the parts of a mixed spec (`a+b`
//! where one part is built-in); a failing state transfer on rank k leaves
//! ranks < k swapped and is reported with the rank.

use std::sync::Arc;

use super::protocol::RoleArg;
use super::server::{Control, SwapOutcome};
use super::status::{rank_status, shadow_summary, Status};
use crate::decision::{EvictionPolicy, PlacementPolicy, ReclamationPolicy, Role};
use crate::device::Device;
use crate::policy::{resolve_with, Runtime, SharedAllocator, SwapOptions, WasmPolicy};
use crate::shadow::ShadowHandle;

/// A hook that adds what only the driver knows (the current step…) to a status.
pub type StatusHook = Box<dyn Fn(&mut Status) + Send + Sync>;

/// The ranks of a run, with what a swap needs to load policies.
pub struct RankControl<D: Device> {
    ranks: Vec<SharedAllocator<D>>,
    runtime: Runtime,
    shadows: Vec<(usize, ShadowHandle)>,
    hook: Option<StatusHook>,
}

impl<D: Device> RankControl<D> {
    /// Controls `ranks` (rank `i` is `ranks[i]`), loading policies with `runtime`.
    pub fn new(ranks: Vec<SharedAllocator<D>>, runtime: Runtime) -> Self {
        RankControl { ranks, runtime, shadows: Vec::new(), hook: None }
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

/// The roles `spec` would replace under `role`, from its resolution's sources.
fn target_roles(role: RoleArg, spec: &str, sources: &[Option<String>; 3]) -> Result<Vec<Role>, String> {
    let provided: Vec<Role> = role.roles().into_iter().filter(|r| sources[*r as usize].is_some()).collect();
    match role {
        RoleArg::All if provided.is_empty() => Err(format!("policy `{spec}` provides no role")),
        RoleArg::All => Ok(provided),
        _ if provided.is_empty() => Err(format!("policy `{spec}` does not provide the {} role", role.roles()[0])),
        _ => Ok(provided),
    }
}

impl<D: Device> Control for RankControl<D> {
    fn swap(&self, role: RoleArg, spec: &str) -> Result<SwapOutcome, String> {
        if self.ranks.is_empty() {
            return Err("no rank to swap".into());
        }
        let mut resolved = Vec::with_capacity(self.ranks.len());
        for _ in &self.ranks {
            resolved.push(resolve_with(&self.runtime, spec).map_err(|e| format!("cannot load policy `{spec}`: {e}"))?);
        }
        let roles = target_roles(role, spec, &resolved[0].sources)?;
        let mut out = SwapOutcome {
            roles: roles.iter().map(Role::to_string).collect(),
            policy: spec.to_string(),
            ranks: self.ranks.len(),
            ..SwapOutcome::default()
        };
        for (rank, (shared, res)) in self.ranks.iter().zip(resolved).enumerate() {
            let old = shared.with(|a| a.policies().names());
            let crate::builtin::Policies { placement, reclamation, eviction } = res.policies;
            let mut placement: Option<Box<dyn PlacementPolicy>> = Some(placement);
            let mut reclamation: Option<Box<dyn ReclamationPolicy>> = Some(reclamation);
            let mut eviction: Option<Box<dyn EvictionPolicy>> = Some(eviction);
            // WebAssembly roles, grouped by instance; the rest are native.
            let mut groups: Vec<(WasmPolicy, Vec<Role>)> = Vec::new();
            let mut native: Vec<Role> = Vec::new();
            for &r in &roles {
                match &res.wasm[r as usize] {
                    Some(w) => match groups.iter_mut().find(|(g, _)| Arc::ptr_eq(&g.instance, &w.instance)) {
                        Some((_, rs)) => rs.push(r),
                        None => groups.push((w.clone(), vec![r])),
                    },
                    None => native.push(r),
                }
            }
            if !native.is_empty() {
                shared.with(|a| {
                    for r in &native {
                        match r {
                            Role::Placement => a.set_placement(placement.take().expect("taken once")),
                            Role::Reclamation => a.set_reclamation(reclamation.take().expect("taken once")),
                            Role::Eviction => a.set_eviction(eviction.take().expect("taken once")),
                        }
                    }
                });
            }
            for (w, rs) in groups {
                let opts = SwapOptions { roles: Some(rs), ..SwapOptions::default() };
                let rep = shared.swap(&w, &opts).map_err(|e| format!("rank {rank}: {e}"))?;
                if rank == 0 && rep.state_bytes.is_some() {
                    out.state_bytes = Some(out.state_bytes.unwrap_or(0) + rep.state_bytes.unwrap_or(0));
                }
            }
            if rank == 0 {
                let now = shared.with(|a| a.policies().names());
                out.old = roles.iter().map(|r| old[*r as usize].clone()).collect();
                out.new = roles.iter().map(|r| now[*r as usize].clone()).collect();
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
