//! The engine side of the policy boundary: the active policies, the
//! fallback behind them, decision validation, memoization and failure
//! accounting.
//!
//! Every decision goes through one skeleton, [`consult`]: ask the active
//! policy of a role (unless that role is disabled), validate its answer, and
//! record the outcome in the role's [`RoleHealth`]. A policy error or an
//! invalid decision is counted, logged once per policy and cause, and the
//! *fallback* policy of the role decides that call instead. After
//! `max_consecutive_failures` failures in a row a role's policy is disabled
//! and the fallback stays in charge until a new policy takes the role.
//!
//! The fallback is injected ([`PolicySet::new`]); [`crate::alloc::Allocator::new`]
//! uses the built-in `pytorch` set. Its decisions are validated too: a
//! fallback that cannot place a request fails that request with
//! [`NoDecision`] instead of corrupting the allocator.

use std::time::Instant;

use rustc_hash::FxHashMap;

use super::latency::LatencyHistogram;

use crate::decision::{
    validate_victims, AllocRequest, EvictionCandidate, EvictionPolicy, PlacementDecision, PlacementPolicy, Policies,
    PolicyContext, PolicyError, ReclaimDecision, ReclaimTrigger, ReclamationPolicy, Role, StateHandle,
};
use crate::types::{Phase, TensorId};

/// Failure accounting and call cost of one role.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RoleHealth {
    /// Calls into the role's active policy (the one a spec named, or the
    /// built-in default filling a role the spec does not provide); memo hits
    /// and calls decided by the fallback are not calls.
    pub calls: u64,
    /// Calls that trapped or hit a limit.
    pub traps: u64,
    /// Calls decided by the fallback instead.
    pub fallbacks: u64,
    /// Failures in a row (reset by a good decision).
    pub consecutive_failures: u32,
    /// Disabled after too many consecutive failures.
    pub disabled: bool,
    /// The last failure, for reports.
    pub last_error: Option<String>,
    /// Durations of the calls (wall-clock; every call of a policy that
    /// [times every call](crate::decision::PlacementPolicy::time_every_call),
    /// else one in [`SAMPLE_EVERY`] counted for the others).
    pub latency: LatencyHistogram,
    logged: Vec<std::mem::Discriminant<PolicyError>>,
}

impl RoleHealth {
    /// A new policy takes the role: its failure streak, disabling and log
    /// memory start over; the counters keep counting (they are the role's).
    pub(crate) fn fresh_policy(&mut self) {
        self.consecutive_failures = 0;
        self.disabled = false;
        self.last_error = None;
        self.logged.clear();
    }

    pub(crate) fn record(&mut self, role: impl std::fmt::Display, policy: &str, err: &PolicyError, max: u32) {
        if matches!(
            err,
            PolicyError::Trap(_) | PolicyError::OutOfFuel | PolicyError::Deadline | PolicyError::MemoryLimit
        ) {
            self.traps += 1;
        }
        self.fallbacks += 1;
        self.consecutive_failures += 1;
        self.last_error = Some(err.to_string());
        let d = std::mem::discriminant(err);
        if !self.logged.contains(&d) {
            self.logged.push(d);
            tracing::warn!(%role, policy, error = %err, "policy failed; the fallback policy decides this call");
        }
        if !self.disabled && max > 0 && self.consecutive_failures >= max {
            self.disabled = true;
            tracing::error!(
                %role,
                policy,
                failures = self.consecutive_failures,
                "policy disabled after consecutive failures; the fallback policy stays in charge"
            );
        }
    }
}

/// A native policy's call is timed once in this many calls.
pub const SAMPLE_EVERY: u64 = 64;

/// The fallback policy of a role gave no valid decision either: the request
/// fails (nothing changed).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the fallback {role} policy `{policy}` gave no valid decision: {cause}")]
pub struct NoDecision {
    /// The role.
    pub role: Role,
    /// The fallback policy.
    pub policy: String,
    /// Its failure.
    pub cause: PolicyError,
}

/// A validated placement, in engine terms.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Placement {
    /// Engine pool index.
    pub pool: u32,
    /// Rounded block size.
    pub rounded: u64,
    /// Size of a new segment if one is needed.
    pub segment: u64,
    /// The decision (split rule, waste limit).
    pub decision: PlacementDecision,
    /// Served from the memo.
    pub memo_hit: bool,
}

/// The active policies of an allocator and the fallback behind them.
pub struct PolicySet {
    active: Policies,
    fallback: Policies,
    /// Active placement's pool index → engine pool index.
    pub(crate) pool_map: Vec<u32>,
    /// Fallback placement's pool index → engine pool index.
    pub(crate) fallback_pool_map: Vec<u32>,
    memoize: bool,
    memo: FxHashMap<u64, PlacementDecision>,
    /// Health per role, indexed by [`Role::index`].
    health: [RoleHealth; 3],
    /// Per role: time every call (the active policy asks for it).
    time_all: [bool; 3],
    /// Consecutive failures before a role's policy is disabled (0: never).
    pub max_consecutive_failures: u32,
}

/// The decision skeleton shared by every role: ask `policy` through `call`
/// unless the role is disabled, and record the outcome in `health`. `None`:
/// the fallback decides (the failure is already counted). The call is
/// timed when `time_all`, else once in [`SAMPLE_EVERY`] calls (weighted),
/// out of line: the untimed path adds one counter test.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn consult<P: ?Sized, T>(
    policy: &mut P,
    name: impl FnOnce(&P) -> &str,
    health: &mut RoleHealth,
    role: Role,
    max: u32,
    time_all: bool,
    call: impl FnOnce(&mut P) -> Result<T, PolicyError>,
) -> Option<T> {
    if health.disabled {
        health.fallbacks += 1;
        return None;
    }
    health.calls += 1;
    if time_all || health.calls % SAMPLE_EVERY == 1 {
        return consult_timed(policy, name, health, role, max, time_all, call);
    }
    let r = call(policy);
    settle(policy, name, health, role, max, r)
}

/// [`consult`]'s timed call.
#[cold]
#[inline(never)]
#[allow(clippy::too_many_arguments)]
fn consult_timed<P: ?Sized, T>(
    policy: &mut P,
    name: impl FnOnce(&P) -> &str,
    health: &mut RoleHealth,
    role: Role,
    max: u32,
    time_all: bool,
    call: impl FnOnce(&mut P) -> Result<T, PolicyError>,
) -> Option<T> {
    let start = Instant::now();
    let r = call(policy);
    health.latency.record_duration(start.elapsed(), if time_all { 1 } else { SAMPLE_EVERY });
    settle(policy, name, health, role, max, r)
}

/// Records the outcome of a call in `health`.
#[inline(always)]
fn settle<P: ?Sized, T>(
    policy: &P,
    name: impl FnOnce(&P) -> &str,
    health: &mut RoleHealth,
    role: Role,
    max: u32,
    r: Result<T, PolicyError>,
) -> Option<T> {
    match r {
        Ok(v) => {
            health.consecutive_failures = 0;
            Some(v)
        }
        Err(e) => {
            health.record(role, name(policy), &e, max);
            None
        }
    }
}

fn memo_key(req: &AllocRequest, phase: Option<Phase>) -> u64 {
    let class = 64 - req.bytes.leading_zeros() as u64; // log2 size class
    let phase = phase.map_or(0, |p| p as u64 + 1);
    (req.stream.0 as u64) << 32 | (req.kind.index() as u64) << 16 | class << 8 | phase
}

/// Checks a reclamation decision against the pools (`pool_allocated` gives
/// a pool's allocated bytes by name, `None` when it does not exist).
fn validate_reclaim(d: &ReclaimDecision, pool_allocated: &impl Fn(&str) -> Option<u64>) -> Result<(), PolicyError> {
    if let Some(bad) = d.pools.iter().flatten().find(|p| pool_allocated(p).is_none()) {
        return Err(PolicyError::InvalidDecision(format!("pool `{bad}` does not exist")));
    }
    if let Some((pool, budget)) = &d.compact {
        match pool_allocated(pool) {
            None => {
                return Err(PolicyError::InvalidDecision(format!("compaction of pool `{pool}`, which does not exist")))
            }
            Some(a) if *budget > a => {
                return Err(PolicyError::InvalidDecision(format!(
                    "compaction budget {budget} exceeds pool `{pool}`'s {a} allocated bytes"
                )))
            }
            Some(_) => {}
        }
    }
    Ok(())
}

impl PolicySet {
    /// `active` policies with `fallback` behind them. The pool maps are
    /// filled by the allocator ([`crate::alloc::Allocator`] registers pools).
    pub(crate) fn new(active: Policies, fallback: Policies) -> Self {
        let memoize = active.placement.memoizable();
        let time_all = [
            active.placement.time_every_call(),
            active.reclamation.time_every_call(),
            active.eviction.time_every_call(),
        ];
        PolicySet {
            active,
            fallback,
            pool_map: Vec::new(),
            fallback_pool_map: Vec::new(),
            memoize,
            memo: FxHashMap::default(),
            health: Default::default(),
            time_all,
            max_consecutive_failures: 8,
        }
    }

    /// The active policies.
    pub fn active(&self) -> &Policies {
        &self.active
    }

    /// The fallback policies.
    pub fn fallback(&self) -> &Policies {
        &self.fallback
    }

    /// Whether new large segments should be paged: the reclamation policy in
    /// charge (the active one, or the fallback once it is disabled) asks for it.
    pub(crate) fn reclamation_wants_pages(&self) -> bool {
        if self.health[Role::Reclamation.index()].disabled {
            self.fallback.reclamation.paged_segments()
        } else {
            self.active.reclamation.paged_segments()
        }
    }

    /// Installs a placement policy (pools are re-mapped by the caller);
    /// returns the one it replaces.
    pub(crate) fn set_placement(&mut self, p: Box<dyn PlacementPolicy>) -> Box<dyn PlacementPolicy> {
        self.memoize = p.memoizable();
        self.memo.clear();
        self.health[Role::Placement.index()].fresh_policy();
        self.time_all[Role::Placement.index()] = p.time_every_call();
        std::mem::replace(&mut self.active.placement, p)
    }

    /// Installs a reclamation policy; returns the one it replaces.
    pub(crate) fn set_reclamation(&mut self, p: Box<dyn ReclamationPolicy>) -> Box<dyn ReclamationPolicy> {
        self.health[Role::Reclamation.index()].fresh_policy();
        self.time_all[Role::Reclamation.index()] = p.time_every_call();
        std::mem::replace(&mut self.active.reclamation, p)
    }

    /// Installs an eviction policy; returns the one it replaces.
    pub(crate) fn set_eviction(&mut self, p: Box<dyn EvictionPolicy>) -> Box<dyn EvictionPolicy> {
        self.health[Role::Eviction.index()].fresh_policy();
        self.time_all[Role::Eviction.index()] = p.time_every_call();
        std::mem::replace(&mut self.active.eviction, p)
    }

    /// Names of the active policies (placement, reclamation, eviction).
    pub fn names(&self) -> [String; 3] {
        Role::ALL.map(|r| self.active.name(r).to_string())
    }

    /// The state behind the active policy of `role`, if it has one.
    pub fn state(&self, role: Role) -> Option<StateHandle> {
        self.active.state(role)
    }

    /// Health of a role.
    pub fn health(&self, role: Role) -> &RoleHealth {
        &self.health[role.index()]
    }

    /// Decides placement for `req`.
    #[inline]
    pub(crate) fn place(&mut self, req: &AllocRequest, ctx: &PolicyContext) -> Result<Placement, Box<NoDecision>> {
        let pools = self.pool_map.len();
        let h = &mut self.health[Role::Placement.index()];
        if self.memoize && !h.disabled {
            if let Some(d) = self.memo.get(&memo_key(req, ctx.phase)) {
                if let Ok((rounded, segment)) = d.validate(req, pools) {
                    let pool = self.pool_map[d.pool as usize];
                    return Ok(Placement { pool, rounded, segment, decision: *d, memo_hit: true });
                }
            }
        }
        let max = self.max_consecutive_failures;
        let got = consult(
            &mut *self.active.placement,
            |p| p.name(),
            h,
            Role::Placement,
            max,
            self.time_all[Role::Placement.index()],
            |p| {
                let d = p.place(req, ctx)?;
                let (rounded, segment) = d.validate(req, pools)?;
                Ok((d, rounded, segment))
            },
        );
        match got {
            Some((d, rounded, segment)) => {
                if self.memoize && d.cacheable {
                    self.memo.insert(memo_key(req, ctx.phase), d);
                }
                Ok(Placement { pool: self.pool_map[d.pool as usize], rounded, segment, decision: d, memo_hit: false })
            }
            None => self.fallback_place(req, ctx),
        }
    }

    #[cold]
    #[inline(never)]
    fn fallback_place(&mut self, req: &AllocRequest, ctx: &PolicyContext) -> Result<Placement, Box<NoDecision>> {
        let pools = self.fallback_pool_map.len();
        let fb = &mut self.fallback.placement;
        let decided = fb.place(req, ctx).and_then(|d| Ok((d, d.validate(req, pools)?)));
        match decided {
            Ok((d, (rounded, segment))) => Ok(Placement {
                pool: self.fallback_pool_map[d.pool as usize],
                rounded,
                segment,
                decision: d,
                memo_hit: false,
            }),
            Err(cause) => Err(Box::new(NoDecision { role: Role::Placement, policy: fb.name().to_string(), cause })),
        }
    }

    /// Decides reclamation; `pool_allocated` gives a pool's allocated bytes
    /// by name (`None`: no such pool). Returns the decision and whether the
    /// active policy made it. A failing fallback releases nothing.
    pub(crate) fn reclaim(
        &mut self,
        trigger: &ReclaimTrigger,
        ctx: &PolicyContext,
        pool_allocated: impl Fn(&str) -> Option<u64>,
    ) -> (ReclaimDecision, bool) {
        let h = &mut self.health[Role::Reclamation.index()];
        let max = self.max_consecutive_failures;
        let got = consult(
            &mut *self.active.reclamation,
            |p| p.name(),
            h,
            Role::Reclamation,
            max,
            self.time_all[Role::Reclamation.index()],
            |p| {
                let d = p.reclaim(trigger, ctx)?;
                validate_reclaim(&d, &pool_allocated)?;
                Ok(d)
            },
        );
        if let Some(d) = got {
            return (d, true);
        }
        let fb = &mut self.fallback.reclamation;
        match fb.reclaim(trigger, ctx).and_then(|d| validate_reclaim(&d, &pool_allocated).map(|()| d)) {
            Ok(d) => (d, false),
            Err(e) => {
                tracing::error!(policy = fb.name(), error = %e, "the fallback reclamation policy failed; nothing is released");
                (ReclaimDecision::none(), false)
            }
        }
    }

    /// Picks eviction victims covering `need_bytes` among `candidates`: the
    /// active policy's answer, validated, completed by the fallback when
    /// short; the fallback's alone when the active policy fails.
    pub fn choose_victims(
        &mut self,
        need_bytes: u64,
        candidates: &[EvictionCandidate],
        ctx: &PolicyContext,
    ) -> Vec<TensorId> {
        let h = &mut self.health[Role::Eviction.index()];
        let max = self.max_consecutive_failures;
        let got = consult(
            &mut *self.active.eviction,
            |p| p.name(),
            h,
            Role::Eviction,
            max,
            self.time_all[Role::Eviction.index()],
            |p| {
                let v = p.choose_victims(need_bytes, candidates, ctx)?;
                let covered = validate_victims(candidates, &v)?;
                Ok((v, covered))
            },
        );
        let (mut victims, covered) = got.unwrap_or_default();
        if covered < need_bytes {
            let rest: Vec<EvictionCandidate>;
            let offered = if victims.is_empty() {
                candidates
            } else {
                rest = candidates.iter().filter(|c| !victims.contains(&c.id)).copied().collect();
                &rest
            };
            let fb = &mut self.fallback.eviction;
            match fb.choose_victims(need_bytes - covered, offered, ctx) {
                Ok(more) if validate_victims(offered, &more).is_ok() => victims.extend(more),
                Ok(_) => tracing::error!(policy = fb.name(), "the fallback eviction policy chose invalid victims"),
                Err(e) => tracing::error!(policy = fb.name(), error = %e, "the fallback eviction policy failed"),
            }
        }
        victims
    }

    /// Orders off-device tensors for prefetch (see
    /// [`EvictionPolicy::prefetch_order`]): the active policy's order, or
    /// `None` for the engine's own.
    pub(crate) fn prefetch_order(
        &mut self,
        offloaded: &[EvictionCandidate],
        ctx: &PolicyContext,
    ) -> Option<Vec<TensorId>> {
        if self.health[Role::Eviction.index()].disabled {
            return None;
        }
        self.active.eviction.prefetch_order(offloaded, ctx)
    }

    /// Whether the eviction policy in charge reads the workload's future.
    pub(crate) fn eviction_needs_future(&self) -> bool {
        self.active.eviction.needs_future()
    }

    /// Durations of the calls into the active policies of every role
    /// (see [`RoleHealth::latency`]).
    pub fn latency(&self) -> LatencyHistogram {
        let mut h = LatencyHistogram::default();
        for r in &self.health {
            h.add(&r.latency);
        }
        h
    }

    /// Totals over the roles: (calls, traps, fallbacks).
    pub fn totals(&self) -> (u64, u64, u64) {
        self.health.iter().fold((0, 0, 0), |(c, t, f), h| (c + h.calls, t + h.traps, f + h.fallbacks))
    }
}
