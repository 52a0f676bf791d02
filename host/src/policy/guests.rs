//! The typed exports of a component, whatever its WIT version, behind one
//! set of calls in native types.
//!
//! [`Indices`] are found once per loaded component (from its `InstancePre`),
//! [`Guests`] once per instance. Both are enums over the versions of
//! [`bindings`](super::bindings); every call converts the native arguments
//! to that version's WIT types and the answer back, so the rest of the
//! runtime never sees a version. A call answers `None` when the component
//! does not export the role it needs.
//!
//! The differences between versions: reclamation — a 0.1.0 component is
//! asked `reclaim` (its decision never compacts, stitches or trims, and it
//! never asks for paged segments), a component of 0.2.0 or later `plan` and
//! `paged-segments`; and the planner, which a component of 0.3.0 or later
//! can export, with `plan-aliased` from 0.4.0 on.

use wasmtime::component::{Instance, InstancePre};
use wasmtime::Store;

use super::bindings::{v0_1 as b0_1, v0_2 as b0_2, v0_3 as b0_3, v0_4 as b0_4, WitVersion};
use super::host::HostState;
use crate::decision::{
    AliasedPlan, AllocRequest, EvictionCandidate, PlacementDecision, Plan, PolicyContext, PoolSpec, ReclaimDecision,
    ReclaimTrigger, Role, StepProfile,
};
use crate::types::TensorId;

/// The indices and instance exports of one version, with the calls every
/// version answers alike.
macro_rules! version_guests {
    ($v:ident) => {
        pub(crate) mod $v {
            use super::*;
            use crate::policy::bindings::$v as b;

            /// Export indices of the interfaces a component provides.
            #[derive(Clone)]
            pub(crate) struct Indices {
                lifecycle: b::lifecycle::GuestIndices,
                placement: Option<b::placement::GuestIndices>,
                reclamation: Option<b::reclamation::GuestIndices>,
                eviction: Option<b::eviction::GuestIndices>,
            }

            impl Indices {
                /// Looks up the exports of `roles` (and `lifecycle`).
                pub(crate) fn new(pre: &InstancePre<HostState>, roles: &[Role]) -> wasmtime::Result<Self> {
                    let has = |r| roles.contains(&r);
                    Ok(Indices {
                        lifecycle: b::lifecycle::GuestIndices::new(pre)?,
                        placement: has(Role::Placement).then(|| b::placement::GuestIndices::new(pre)).transpose()?,
                        reclamation: has(Role::Reclamation)
                            .then(|| b::reclamation::GuestIndices::new(pre))
                            .transpose()?,
                        eviction: has(Role::Eviction).then(|| b::eviction::GuestIndices::new(pre)).transpose()?,
                    })
                }

                /// The typed exports of `instance`.
                pub(crate) fn load(
                    &self,
                    store: &mut Store<HostState>,
                    instance: &Instance,
                ) -> wasmtime::Result<Guests> {
                    Ok(Guests {
                        lifecycle: self.lifecycle.load(&mut *store, instance)?,
                        placement: self.placement.as_ref().map(|i| i.load(&mut *store, instance)).transpose()?,
                        reclamation: self.reclamation.as_ref().map(|i| i.load(&mut *store, instance)).transpose()?,
                        eviction: self.eviction.as_ref().map(|i| i.load(&mut *store, instance)).transpose()?,
                    })
                }
            }

            /// The typed exports of one instance.
            pub(crate) struct Guests {
                pub(super) lifecycle: b::lifecycle::Guest,
                pub(super) placement: Option<b::placement::Guest>,
                pub(super) reclamation: Option<b::reclamation::Guest>,
                pub(super) eviction: Option<b::eviction::Guest>,
            }

            impl Guests {
                pub(crate) fn name(&self, s: &mut Store<HostState>) -> wasmtime::Result<String> {
                    self.lifecycle.call_name(s)
                }

                pub(crate) fn init(
                    &self,
                    s: &mut Store<HostState>,
                    config: &str,
                ) -> wasmtime::Result<Result<(), String>> {
                    self.lifecycle.call_init(s, config)
                }

                pub(crate) fn save_state(&self, s: &mut Store<HostState>) -> wasmtime::Result<Vec<u8>> {
                    self.lifecycle.call_save_state(s)
                }

                pub(crate) fn load_state(
                    &self,
                    s: &mut Store<HostState>,
                    state: &[u8],
                ) -> wasmtime::Result<Result<(), String>> {
                    self.lifecycle.call_load_state(s, state)
                }

                pub(crate) fn pools(&self, s: &mut Store<HostState>) -> wasmtime::Result<Option<Vec<PoolSpec>>> {
                    match &self.placement {
                        Some(p) => Ok(Some(p.call_pools(s)?.into_iter().map(b::pool_from_wit).collect())),
                        None => Ok(None),
                    }
                }

                pub(crate) fn place(
                    &self,
                    s: &mut Store<HostState>,
                    req: &AllocRequest,
                    ctx: &PolicyContext,
                ) -> wasmtime::Result<Option<PlacementDecision>> {
                    match &self.placement {
                        Some(p) => {
                            let d = p.call_place(s, b::request_to_wit(req), b::context_to_wit(ctx))?;
                            Ok(Some(b::decision_from_wit(&d)))
                        }
                        None => Ok(None),
                    }
                }

                pub(crate) fn choose_victims(
                    &self,
                    s: &mut Store<HostState>,
                    need_bytes: u64,
                    candidates: &[EvictionCandidate],
                    ctx: &PolicyContext,
                ) -> wasmtime::Result<Option<Vec<TensorId>>> {
                    match &self.eviction {
                        Some(p) => {
                            let cands: Vec<_> = candidates.iter().map(b::candidate_to_wit).collect();
                            let ids = p.call_choose_victims(s, need_bytes, &cands, b::context_to_wit(ctx))?;
                            Ok(Some(ids.into_iter().map(crate::policy::bindings::tensor_from_wit).collect()))
                        }
                        None => Ok(None),
                    }
                }
            }
        }
    };
}

version_guests!(v0_1);
version_guests!(v0_2);
version_guests!(v0_3);
version_guests!(v0_4);

impl v0_1::Guests {
    /// `reclaim`: release only.
    fn reclaim(
        &self,
        s: &mut Store<HostState>,
        trigger: &ReclaimTrigger,
        ctx: &PolicyContext,
    ) -> wasmtime::Result<Option<ReclaimDecision>> {
        match &self.reclamation {
            Some(p) => {
                let d = p.call_reclaim(s, b0_1::trigger_to_wit(trigger), b0_1::context_to_wit(ctx))?;
                Ok(Some(b0_1::reclaim_from_wit(d)))
            }
            None => Ok(None),
        }
    }
}

/// Reclamation of the versions that have `plan` (0.2.0 on).
macro_rules! planned_reclamation {
    ($v:ident, $b:ident) => {
        impl $v::Guests {
            /// `plan`: release, compaction, stitching, trimming.
            fn reclaim(
                &self,
                s: &mut Store<HostState>,
                trigger: &ReclaimTrigger,
                ctx: &PolicyContext,
            ) -> wasmtime::Result<Option<ReclaimDecision>> {
                match &self.reclamation {
                    Some(p) => {
                        let d = p.call_plan(s, $b::trigger_to_wit(trigger), $b::context_to_wit(ctx))?;
                        Ok(Some($b::plan_from_wit(d)))
                    }
                    None => Ok(None),
                }
            }

            /// `paged-segments` (false without a reclamation role).
            fn paged_segments(&self, s: &mut Store<HostState>) -> wasmtime::Result<bool> {
                match &self.reclamation {
                    Some(p) => p.call_paged_segments(s),
                    None => Ok(false),
                }
            }
        }
    };
}

planned_reclamation!(v0_2, b0_2);
planned_reclamation!(v0_3, b0_3);
planned_reclamation!(v0_4, b0_4);

/// Export indices of a component, by WIT version.
#[derive(Clone)]
pub(crate) enum Indices {
    V0_1(v0_1::Indices),
    V0_2(v0_2::Indices),
    /// With the planner's indices when the component exports it.
    V0_3(v0_3::Indices, Option<b0_3::planner::GuestIndices>),
    /// With the planner's indices when the component exports it.
    V0_4(v0_4::Indices, Option<b0_4::planner::GuestIndices>),
}

/// The typed exports of one instance, by WIT version.
pub(crate) enum Guests {
    V0_1(v0_1::Guests),
    V0_2(v0_2::Guests),
    /// With the planner when the component exports it.
    V0_3(v0_3::Guests, Option<b0_3::planner::Guest>),
    /// With the planner when the component exports it.
    V0_4(v0_4::Guests, Option<b0_4::planner::Guest>),
}

/// Runs the same expression on whichever version `$e` holds.
macro_rules! each {
    ($e:expr, $g:ident => $body:expr) => {
        match $e {
            Guests::V0_1($g) => $body,
            Guests::V0_2($g) => $body,
            Guests::V0_3($g, _) => $body,
            Guests::V0_4($g, _) => $body,
        }
    };
}

impl Indices {
    /// The indices of the exports of `roles` (and of the planner, when
    /// `planner`) of a component of `version`.
    pub(crate) fn new(
        version: WitVersion,
        pre: &InstancePre<HostState>,
        roles: &[Role],
        planner: bool,
    ) -> wasmtime::Result<Indices> {
        if planner && !version.has_planner() {
            wasmtime::bail!("a component of wasmem:policy@{version} cannot export the planner");
        }
        Ok(match version {
            WitVersion::V0_1 => Indices::V0_1(v0_1::Indices::new(pre, roles)?),
            WitVersion::V0_2 => Indices::V0_2(v0_2::Indices::new(pre, roles)?),
            WitVersion::V0_3 => Indices::V0_3(
                v0_3::Indices::new(pre, roles)?,
                planner.then(|| b0_3::planner::GuestIndices::new(pre)).transpose()?,
            ),
            WitVersion::V0_4 => Indices::V0_4(
                v0_4::Indices::new(pre, roles)?,
                planner.then(|| b0_4::planner::GuestIndices::new(pre)).transpose()?,
            ),
        })
    }

    /// The typed exports of `instance`.
    pub(crate) fn load(&self, store: &mut Store<HostState>, instance: &Instance) -> wasmtime::Result<Guests> {
        Ok(match self {
            Indices::V0_1(i) => Guests::V0_1(i.load(store, instance)?),
            Indices::V0_2(i) => Guests::V0_2(i.load(store, instance)?),
            Indices::V0_3(i, p) => Guests::V0_3(
                i.load(&mut *store, instance)?,
                p.as_ref().map(|p| p.load(&mut *store, instance)).transpose()?,
            ),
            Indices::V0_4(i, p) => Guests::V0_4(
                i.load(&mut *store, instance)?,
                p.as_ref().map(|p| p.load(&mut *store, instance)).transpose()?,
            ),
        })
    }
}

impl Guests {
    /// `lifecycle.name`.
    pub(crate) fn name(&self, s: &mut Store<HostState>) -> wasmtime::Result<String> {
        each!(self, g => g.name(s))
    }

    /// `lifecycle.init`.
    pub(crate) fn init(&self, s: &mut Store<HostState>, config: &str) -> wasmtime::Result<Result<(), String>> {
        each!(self, g => g.init(s, config))
    }

    /// `lifecycle.save-state`.
    pub(crate) fn save_state(&self, s: &mut Store<HostState>) -> wasmtime::Result<Vec<u8>> {
        each!(self, g => g.save_state(s))
    }

    /// `lifecycle.load-state`.
    pub(crate) fn load_state(&self, s: &mut Store<HostState>, state: &[u8]) -> wasmtime::Result<Result<(), String>> {
        each!(self, g => g.load_state(s, state))
    }

    /// `placement.pools`.
    pub(crate) fn pools(&self, s: &mut Store<HostState>) -> wasmtime::Result<Option<Vec<PoolSpec>>> {
        each!(self, g => g.pools(s))
    }

    /// `placement.place`.
    pub(crate) fn place(
        &self,
        s: &mut Store<HostState>,
        req: &AllocRequest,
        ctx: &PolicyContext,
    ) -> wasmtime::Result<Option<PlacementDecision>> {
        each!(self, g => g.place(s, req, ctx))
    }

    /// `reclamation.reclaim` (0.1.0) or `reclamation.plan` (0.2.0 on).
    pub(crate) fn reclaim(
        &self,
        s: &mut Store<HostState>,
        trigger: &ReclaimTrigger,
        ctx: &PolicyContext,
    ) -> wasmtime::Result<Option<ReclaimDecision>> {
        each!(self, g => g.reclaim(s, trigger, ctx))
    }

    /// `reclamation.paged-segments` (0.2.0 on); always false for 0.1.0.
    pub(crate) fn paged_segments(&self, s: &mut Store<HostState>) -> wasmtime::Result<bool> {
        match self {
            Guests::V0_1(_) => Ok(false),
            Guests::V0_2(g) => g.paged_segments(s),
            Guests::V0_3(g, _) => g.paged_segments(s),
            Guests::V0_4(g, _) => g.paged_segments(s),
        }
    }

    /// `planner.plan` (0.3.0 on): the plan, or the planner's refusal (its
    /// text); `None` when the component exports no planner.
    pub(crate) fn plan(
        &self,
        s: &mut Store<HostState>,
        profile: &StepProfile,
    ) -> wasmtime::Result<Option<Result<Plan, String>>> {
        match self {
            Guests::V0_3(_, Some(p)) => {
                let answer = p.call_plan(s, &b0_3::profile_to_wit(profile))?;
                Ok(Some(answer.map(b0_3::arena_plan_from_wit)))
            }
            Guests::V0_4(_, Some(p)) => {
                let answer = p.call_plan(s, &b0_4::profile_to_wit(profile))?;
                Ok(Some(answer.map(b0_4::arena_plan_from_wit)))
            }
            _ => Ok(None),
        }
    }

    /// `planner.plan-aliased` (0.4.0 on): the aliased plan or none, or the
    /// planner's refusal (its text); `None` when the component exports no
    /// planner or one of an earlier version.
    pub(crate) fn plan_aliased(
        &self,
        s: &mut Store<HostState>,
        profile: &StepProfile,
    ) -> wasmtime::Result<Option<Result<Option<AliasedPlan>, String>>> {
        match self {
            Guests::V0_4(_, Some(p)) => {
                let answer = p.call_plan_aliased(s, &b0_4::profile_to_wit(profile))?;
                Ok(Some(answer.map(|a| a.map(b0_4::aliased_plan_from_wit))))
            }
            _ => Ok(None),
        }
    }

    /// `eviction.choose-victims`.
    pub(crate) fn choose_victims(
        &self,
        s: &mut Store<HostState>,
        need_bytes: u64,
        candidates: &[EvictionCandidate],
        ctx: &PolicyContext,
    ) -> wasmtime::Result<Option<Vec<TensorId>>> {
        each!(self, g => g.choose_victims(s, need_bytes, candidates, ctx))
    }
}
