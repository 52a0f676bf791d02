//! The decision traits implemented over a policy instance: [`WasmPlacement`],
//! [`WasmReclamation`], [`WasmEviction`], and [`WasmPlanner`] (WIT 0.3.0).
//!
//! Each calls the export under the sandbox limits through the instance's
//! version-independent `Guests` (`super::guests`, which convert the engine's
//! values to the WIT mirrors of the component's version and back). Nothing is
//! validated here: the engine validates every decision and falls back to its
//! default on an invalid one or on an error. Eviction candidates cross the
//! boundary with ids `slot << 32 | generation`; whatever ids come back are
//! mapped to handles and checked by the engine against the offered list.
//!
//! A planning call gets the decision deadline plus
//! [`Limits::deadline_per_plan_request`](super::Limits::deadline_per_plan_request)
//! per request of the profile (1 ms + 25 µs × n by default: 1.251 s for a
//! step of 50,000 requests), and fuel scaled alike; the memory cap is the
//! instance's. A trap, a limit, or the planner's own error (`Err(text)`,
//! [`PolicyError::Refused`]) is a [`PolicyError`]: the engine counts the
//! refusal (`plan_refused`) and the step stays on the dynamic path.

use std::sync::Arc;

use super::instance::{CallKind, WasmPolicy};
use crate::decision::{
    AliasedPlan, AllocRequest, EvictionCandidate, EvictionPolicy, PlacementDecision, PlacementPolicy, Plan,
    PlannerPolicy, Policies, PolicyContext, PolicyError, PoolSpec, ReclaimDecision, ReclaimTrigger, ReclamationPolicy,
    Role, StateHandle, StepProfile,
};
use crate::spec::{Part, Resolved};
use crate::types::TensorId;

impl WasmPolicy {
    /// The placement role, if exported.
    pub fn placement(&self) -> Option<WasmPlacement> {
        self.exports(Role::Placement).then(|| WasmPlacement::new(self.clone()))
    }

    /// The reclamation role, if exported.
    pub fn reclamation(&self) -> Option<WasmReclamation> {
        self.exports(Role::Reclamation).then(|| WasmReclamation::new(self.clone()))
    }

    /// The eviction role, if exported.
    pub fn eviction(&self) -> Option<WasmEviction> {
        self.exports(Role::Eviction).then(|| WasmEviction::new(self.clone()))
    }

    /// The planner, if exported (WIT 0.3.0).
    pub fn planner(&self) -> Option<WasmPlanner> {
        self.exports_planner().then(|| WasmPlanner::new(self.clone()))
    }

    /// The roles (and planner) this instance exports, as a part of a policy spec.
    pub fn part(&self) -> Part {
        Part {
            label: self.name().to_string(),
            placement: self.placement().map(|p| Box::new(p) as Box<dyn PlacementPolicy>),
            reclamation: self.reclamation().map(|p| Box::new(p) as Box<dyn ReclamationPolicy>),
            eviction: self.eviction().map(|p| Box::new(p) as Box<dyn EvictionPolicy>),
            planner: self.planner().map(|p| Box::new(p) as Box<dyn PlannerPolicy>),
        }
    }

    /// This instance alone as a resolved spec: the roles it exports, the
    /// built-in defaults for the others (e.g. to swap it in).
    pub fn resolved(&self) -> Resolved {
        let part = self.part();
        let source = |has: bool| has.then(|| part.label.clone());
        let sources =
            [source(part.placement.is_some()), source(part.reclamation.is_some()), source(part.eviction.is_some())];
        let defaults = crate::builtin::default_policies();
        let policies = Policies {
            placement: part.placement.unwrap_or(defaults.placement),
            reclamation: part.reclamation.unwrap_or(defaults.reclamation),
            eviction: part.eviction.unwrap_or(defaults.eviction),
        };
        let planner_source = part.planner.as_ref().map(|_| part.label.clone());
        Resolved { spec: part.label, policies, planner: part.planner, planner_source, sources }
    }

    fn state_handle(&self) -> StateHandle {
        Arc::new(self.clone())
    }
}

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

    fn state(&self) -> Option<StateHandle> {
        Some(self.policy.state_handle())
    }

    fn place(&mut self, req: &AllocRequest, ctx: &PolicyContext) -> Result<PlacementDecision, PolicyError> {
        let d = self.policy.lock().call(CallKind::Decision, ctx, |g, s| g.place(s, req, ctx))?;
        d.ok_or_else(|| missing(&self.policy, Role::Placement))
    }

    fn memoizable(&self) -> bool {
        true
    }

    fn time_every_call(&self) -> bool {
        true
    }
}

/// The reclamation role of a WebAssembly policy.
///
/// A component of 0.2.0 or later is asked `plan`, whose compaction, stitching and
/// trimming reach the engine, and `paged-segments` (once, after `init`); a
/// 0.1.0 component is asked `reclaim`, and its decisions never use those
/// mechanisms.
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
        let d = self.policy.lock().call(CallKind::Decision, ctx, |g, s| g.reclaim(s, trigger, ctx))?;
        d.ok_or_else(|| missing(&self.policy, Role::Reclamation))
    }

    fn paged_segments(&self) -> bool {
        self.policy.paged_segments()
    }

    fn time_every_call(&self) -> bool {
        true
    }

    fn state(&self) -> Option<StateHandle> {
        Some(self.policy.state_handle())
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
        let ids = self
            .policy
            .lock()
            .call(CallKind::Eviction(candidates.len()), ctx, |g, s| g.choose_victims(s, need_bytes, candidates, ctx))?;
        ids.ok_or_else(|| missing(&self.policy, Role::Eviction))
    }

    fn time_every_call(&self) -> bool {
        true
    }

    fn state(&self) -> Option<StateHandle> {
        Some(self.policy.state_handle())
    }
}

/// The planner of a WebAssembly policy (`wasmem:policy/planner`, WIT 0.3.0).
///
/// See the module documentation for its limits. Nothing is validated here:
/// the engine validates every plan ([`crate::decision::validate_plan`]).
#[derive(Debug, Clone)]
pub struct WasmPlanner {
    policy: WasmPolicy,
}

impl WasmPlanner {
    pub(crate) fn new(policy: WasmPolicy) -> Self {
        WasmPlanner { policy }
    }

    /// The instance behind the planner.
    pub fn policy(&self) -> &WasmPolicy {
        &self.policy
    }
}

impl PlannerPolicy for WasmPlanner {
    fn name(&self) -> &str {
        self.policy.name()
    }

    fn plan(&mut self, profile: &StepProfile, ctx: &PolicyContext) -> Result<Plan, PolicyError> {
        let n = profile.requests.len();
        let answer = self.policy.lock().call(CallKind::Planning(n), ctx, |g, s| g.plan(s, profile))?;
        match answer {
            Some(Ok(plan)) => Ok(plan),
            Some(Err(msg)) => Err(PolicyError::Refused(crate::text::message(&msg))),
            None => Err(PolicyError::Trap(format!("policy `{}` does not export the planner", self.policy.name()))),
        }
    }

    fn plan_aliased(&mut self, profile: &StepProfile, ctx: &PolicyContext) -> Result<Option<AliasedPlan>, PolicyError> {
        if !self.policy.wit_version().has_aliased_plans() {
            return Ok(None);
        }
        let n = profile.requests.len();
        match self.policy.lock().call(CallKind::Planning(n), ctx, |g, s| g.plan_aliased(s, profile))? {
            Some(Ok(plan)) => Ok(plan),
            Some(Err(msg)) => Err(PolicyError::Refused(crate::text::message(&msg))),
            None => Ok(None),
        }
    }

    fn state(&self) -> Option<StateHandle> {
        Some(self.policy.state_handle())
    }
}
