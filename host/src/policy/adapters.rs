//! The decision traits implemented over a policy instance: [`WasmPlacement`],
//! [`WasmReclamation`], [`WasmEviction`].
//!
//! Each converts the engine's values to their WIT mirrors, calls the export
//! under the sandbox limits, and converts the answer back. Nothing is
//! validated here: the engine validates every decision and falls back to its
//! default on an invalid one or on an error. Eviction candidates cross the
//! boundary with ids `slot << 32 | generation`; whatever ids come back are
//! mapped to handles and checked by the engine against the offered list.

use super::bindings::{
    candidate_to_wit, context_to_wit, decision_from_wit, reclaim_from_wit, request_to_wit, tensor_from_wit,
    trigger_to_wit,
};
use super::instance::{CallKind, WasmPolicy};
use crate::decision::{
    AllocRequest, EvictionCandidate, EvictionPolicy, PlacementDecision, PlacementPolicy, PolicyContext, PolicyError,
    PoolSpec, ReclaimDecision, ReclaimTrigger, ReclamationPolicy, Role,
};
use crate::types::TensorId;

fn missing(policy: &WasmPolicy, role: Role) -> PolicyError {
    PolicyError::Trap(format!("policy `{}` does not export the {role} role", policy.name()))
}

/// The placement role of a WebAssembly policy.
///
/// [`PlacementPolicy::memoizable`] is true: the engine memoizes decisions
/// marked `cacheable`, and a memo hit never enters WebAssembly.
#[derive(Debug, Clone)]
pub struct WasmPlacement {
    policy: WasmPolicy,
    pools: Vec<PoolSpec>,
}

impl WasmPlacement {
    pub(crate) fn new(policy: WasmPolicy) -> Self {
        let pools = policy.pools().to_vec();
        WasmPlacement { policy, pools }
    }

    /// The instance behind this role.
    pub fn policy(&self) -> &WasmPolicy {
        &self.policy
    }
}

impl PlacementPolicy for WasmPlacement {
    fn name(&self) -> &str {
        self.policy.name()
    }

    /// The pools the policy returned once after `init` (a re-instantiated
    /// instance keeps them: the engine's pool map does not change under it).
    fn pools(&self) -> Vec<PoolSpec> {
        self.pools.clone()
    }

    fn place(&mut self, req: &AllocRequest, ctx: &PolicyContext) -> Result<PlacementDecision, PolicyError> {
        let (r, c) = (request_to_wit(req), context_to_wit(ctx));
        let d = self.policy.lock().call(CallKind::Decision, ctx, |g, s| match &g.placement {
            Some(p) => p.call_place(s, r, c).map(Some),
            None => Ok(None),
        })?;
        d.map(|d| decision_from_wit(&d)).ok_or_else(|| missing(&self.policy, Role::Placement))
    }

    fn memoizable(&self) -> bool {
        true
    }
}

/// The reclamation role of a WebAssembly policy.
#[derive(Debug, Clone)]
pub struct WasmReclamation {
    policy: WasmPolicy,
}

impl WasmReclamation {
    pub(crate) fn new(policy: WasmPolicy) -> Self {
        WasmReclamation { policy }
    }

    /// The instance behind this role.
    pub fn policy(&self) -> &WasmPolicy {
        &self.policy
    }
}

impl ReclamationPolicy for WasmReclamation {
    fn name(&self) -> &str {
        self.policy.name()
    }

    fn reclaim(&mut self, trigger: &ReclaimTrigger, ctx: &PolicyContext) -> Result<ReclaimDecision, PolicyError> {
        let (t, c) = (trigger_to_wit(trigger), context_to_wit(ctx));
        let d = self.policy.lock().call(CallKind::Decision, ctx, |g, s| match &g.reclamation {
            Some(p) => p.call_reclaim(s, t, c).map(Some),
            None => Ok(None),
        })?;
        d.map(reclaim_from_wit).ok_or_else(|| missing(&self.policy, Role::Reclamation))
    }
}

/// The eviction role of a WebAssembly policy.
#[derive(Debug, Clone)]
pub struct WasmEviction {
    policy: WasmPolicy,
}

impl WasmEviction {
    pub(crate) fn new(policy: WasmPolicy) -> Self {
        WasmEviction { policy }
    }

    /// The instance behind this role.
    pub fn policy(&self) -> &WasmPolicy {
        &self.policy
    }
}

impl EvictionPolicy for WasmEviction {
    fn name(&self) -> &str {
        self.policy.name()
    }

    fn choose_victims(
        &mut self,
        need_bytes: u64,
        candidates: &[EvictionCandidate],
        ctx: &PolicyContext,
    ) -> Result<Vec<TensorId>, PolicyError> {
        let cands: Vec<_> = candidates.iter().map(candidate_to_wit).collect();
        let c = context_to_wit(ctx);
        let ids = self.policy.lock().call(CallKind::Decision, ctx, |g, s| match &g.eviction {
            Some(p) => p.call_choose_victims(s, need_bytes, &cands, c).map(Some),
            None => Ok(None),
        })?;
        ids.map(|ids| ids.into_iter().map(tensor_from_wit).collect())
            .ok_or_else(|| missing(&self.policy, Role::Eviction))
    }
}
