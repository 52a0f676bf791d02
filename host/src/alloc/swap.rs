//! The one hot swap: replace some roles' policies of an allocator by those of
//! a resolved spec, between two decisions, carrying learned state.
//!
//! [`swap`] is what `compare --swap-at`, `train --swap-at`, `ctl swap`
//! and the C ABI's `wasmem_swap_policy` all call, so a swap means the same
//! everywhere:
//!
//! - **roles**: the roles asked for ([`SwapOptions::roles`]), or by default
//!   every role the spec *provides* (a role no part of the spec names keeps
//!   its current policy). Asking for a role the spec does not provide is
//!   [`SwapError::MissingRole`];
//! - **state**: for each policy instance taking roles, the state of the
//!   first replaced role whose old policy has one ([`PolicyState`]) is saved
//!   and loaded into the new instance when [`CarryState`] says so (by
//!   default when both have the same state name, i.e. the same policy). A
//!   failing `load-state` aborts the whole swap with nothing changed; a
//!   failing `save-state` is reported and the new policy starts fresh;
//! - **pools** are matched by name (`Allocator::set_placement`); the
//!   placement memo is cleared and each swapped role's failure streak
//!   starts over; counters and peaks are not touched (a caller measuring
//!   both sides of a swap calls `Allocator::reset_peaks` itself);
//! - **planner**: a spec with a planner (`planned`) replaces the planner too
//!   when no roles are named; its stored plans start over;
//! - **atomicity**: every role is replaced in one call on `&mut Allocator`,
//!   so under [`super::SharedAllocator`] no decision sees half a swap.
//!
//! [`PolicyState`]: crate::decision::PolicyState

use crate::decision::{
    EvictionPolicy, PlacementPolicy, PlannerPolicy, PolicyError, ReclamationPolicy, Role, StateHandle,
};
use crate::device::Device;
use crate::spec::Resolved;

use super::Allocator;

/// When to carry learned state from the old policy to the new one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CarryState {
    /// When the old and new policies have the same state name (the same policy).
    #[default]
    SameName,
    /// Whenever the old policy has state.
    Always,
    /// Never: the new policy starts from its `init` state.
    Never,
}

/// Options of [`swap`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SwapOptions {
    /// Roles to replace; `None`: every role the spec provides.
    pub roles: Option<Vec<Role>>,
    /// State transfer rule.
    pub carry: CarryState,
}

/// What a swap did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SwapReport {
    /// The spec swapped in.
    pub spec: String,
    /// Roles replaced.
    pub roles: Vec<Role>,
    /// Names of the policies replaced, per role in `roles`.
    pub old: Vec<String>,
    /// Names of the policies now serving them, per role in `roles`.
    pub new: Vec<String>,
    /// Bytes of state carried over, summed over instances (`None`: no transfer).
    pub state_bytes: Option<usize>,
    /// `save-state` of an old policy failed; its successor started fresh.
    pub save_error: Option<PolicyError>,
}

/// Why a swap was refused; the old policies stay in charge.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SwapError {
    /// The spec does not provide a requested role.
    #[error("cannot swap in policy `{spec}`: it does not provide the {role} role")]
    MissingRole {
        /// The spec.
        spec: String,
        /// The role.
        role: Role,
    },
    /// The spec provides no role at all.
    #[error("cannot swap in policy `{spec}`: it provides no role")]
    NoRole {
        /// The spec.
        spec: String,
    },
    /// `load-state` of a new policy failed.
    #[error("swap aborted, `{old}` stays: load-state of `{new}` failed: {cause}")]
    LoadState {
        /// The old policy.
        old: String,
        /// The new policy.
        new: String,
        /// The cause (a trap, or the policy's refusal).
        cause: PolicyError,
    },
}

/// The policies a swap replaced, to be dropped where it is cheap (outside a
/// lock: tearing down a WebAssembly store takes tens of microseconds).
#[derive(Default)]
pub struct Retired {
    placement: Option<Box<dyn PlacementPolicy>>,
    reclamation: Option<Box<dyn ReclamationPolicy>>,
    eviction: Option<Box<dyn EvictionPolicy>>,
    planner: Option<Box<dyn PlannerPolicy>>,
}

impl std::fmt::Debug for Retired {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Retired")
            .field("placement", &self.placement.as_ref().map(|p| p.name().to_string()))
            .field("reclamation", &self.reclamation.as_ref().map(|p| p.name().to_string()))
            .field("eviction", &self.eviction.as_ref().map(|p| p.name().to_string()))
            .finish()
    }
}

/// The roles a swap of `new` under `opts` replaces (see the module documentation).
pub fn target_roles(new: &Resolved, opts: &SwapOptions) -> Result<Vec<Role>, SwapError> {
    let provided = new.provided();
    match &opts.roles {
        None if provided.is_empty() => Err(SwapError::NoRole { spec: new.spec.clone() }),
        None => Ok(provided),
        Some(asked) => {
            if let Some(&role) = asked.iter().find(|r| !provided.contains(r)) {
                return Err(SwapError::MissingRole { spec: new.spec.clone(), role });
            }
            let mut roles = asked.clone();
            roles.sort();
            roles.dedup();
            Ok(roles)
        }
    }
}

/// Replaces roles of `alloc` by those of `new` (see the module
/// documentation). On error nothing changed.
pub fn swap<D: Device>(
    alloc: &mut Allocator<D>,
    new: Resolved,
    opts: &SwapOptions,
) -> Result<(SwapReport, Retired), SwapError> {
    let roles = target_roles(&new, opts)?;
    let before = alloc.policies().names();
    let old: Vec<String> = roles.iter().map(|r| before[r.index()].clone()).collect();

    // State transfer, once per new instance, before anything is replaced.
    let mut state_bytes: Option<usize> = None;
    let mut save_error = None;
    let mut done: Vec<usize> = Vec::new();
    for &role in &roles {
        let Some(to) = new.policies.state(role) else { continue };
        if done.contains(&to.instance()) {
            continue;
        }
        done.push(to.instance());
        let from: Option<StateHandle> = roles
            .iter()
            .filter(|r| new.policies.state(**r).is_some_and(|s| s.instance() == to.instance()))
            .find_map(|r| alloc.policies().state(*r));
        let Some(from) = from.filter(|f| f.instance() != to.instance()) else { continue };
        let carry = match opts.carry {
            CarryState::SameName => from.state_name() == to.state_name(),
            CarryState::Always => true,
            CarryState::Never => false,
        };
        if !carry {
            continue;
        }
        match from.save_state() {
            Ok(state) => {
                to.load_state(&state).map_err(|cause| SwapError::LoadState {
                    old: from.state_name(),
                    new: to.state_name(),
                    cause,
                })?;
                state_bytes = Some(state_bytes.unwrap_or(0) + state.len());
            }
            Err(e) => {
                tracing::warn!(old = %from.state_name(), new = %to.state_name(), error = %e,
                    "save-state failed during a swap; the new policy starts without state");
                save_error = Some(e);
            }
        }
    }

    let mut retired = Retired::default();
    let planner = new.planner;
    let planner_swapped = planner.is_some() && opts.roles.is_none();
    if planner_swapped {
        retired.planner = alloc.set_planner(planner);
    }
    let crate::decision::Policies { placement, reclamation, eviction } = new.policies;
    if roles.contains(&Role::Placement) {
        retired.placement = Some(alloc.set_placement(placement));
    }
    if roles.contains(&Role::Reclamation) {
        retired.reclamation = Some(alloc.set_reclamation(reclamation));
    }
    if roles.contains(&Role::Eviction) {
        retired.eviction = Some(alloc.set_eviction(eviction));
    }
    let after = alloc.policies().names();
    let report = SwapReport {
        spec: new.spec,
        new: roles.iter().map(|r| after[r.index()].clone()).collect(),
        roles,
        old,
        state_bytes,
        save_error,
    };
    tracing::info!(spec = %report.spec, roles = ?report.roles, old = ?report.old, state_bytes = ?report.state_bytes, "policy swapped");
    Ok((report, retired))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::sim::SimDevice;
    use crate::spec::{resolve, Builtins};
    use crate::types::{StreamId, TensorKind, GIB};

    #[test]
    fn only_provided_roles_are_replaced() {
        let mut a = Allocator::with_builtin(SimDevice::with_capacity(GIB), "lifecycle").unwrap();
        let id = a.alloc(4096, TensorKind::Param, StreamId(0)).unwrap();
        let (r, _) = swap(&mut a, resolve("dtr", &Builtins).unwrap(), &SwapOptions::default()).unwrap();
        assert_eq!(
            (r.roles.clone(), r.old.clone(), r.new.clone()),
            (vec![Role::Eviction], vec!["lru".into()], vec!["dtr".into()])
        );
        assert_eq!(a.policies().names(), ["lifecycle".to_string(), "lifecycle".into(), "dtr".into()]);
        let (r, _) = swap(&mut a, resolve("naive", &Builtins).unwrap(), &SwapOptions::default()).unwrap();
        assert_eq!(r.roles, Role::ALL.to_vec());
        a.free(id).unwrap();
        a.check_invariants().unwrap();
    }

    #[test]
    fn a_role_the_spec_does_not_provide_is_refused() {
        let mut a = Allocator::with_builtin(SimDevice::with_capacity(GIB), "pytorch").unwrap();
        let opts = SwapOptions { roles: Some(vec![Role::Placement]), ..Default::default() };
        let e = swap(&mut a, resolve("belady", &Builtins).unwrap(), &opts).unwrap_err();
        assert!(matches!(e, SwapError::MissingRole { role: Role::Placement, .. }), "{e:?}");
        assert_eq!(a.policies().names()[2], "lru");
    }
}
