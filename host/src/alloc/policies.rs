//! The engine side of the policy boundary: the active policies, the built-in
//! default behind them, decision validation, memoization and failure
//! accounting.
//!
//! Every call goes through here. A policy error or an invalid decision is
//! counted, logged once per policy and cause, and replaced by the default's
//! decision for that call. After `max_consecutive_failures` failures in a row
//! a role's policy is disabled and the default stays in charge.

use rustc_hash::FxHashMap;

use crate::builtin::{LruEviction, PytorchPlacement, PytorchReclamation};
use crate::decision::{
    validate_victims, AllocRequest, EvictionCandidate, EvictionPolicy, PlacementDecision, PlacementPolicy,
    PolicyContext, PolicyError, ReclaimDecision, ReclaimTrigger, ReclamationPolicy, Role,
};
use crate::types::{Phase, TensorId};

/// Failure accounting of one role.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RoleHealth {
    /// Calls into the policy.
    pub calls: u64,
    /// Calls that trapped or hit a limit.
    pub traps: u64,
    /// Calls decided by the default instead.
    pub fallbacks: u64,
    /// Failures in a row (reset by a good decision).
    pub consecutive_failures: u32,
    /// Disabled after too many consecutive failures.
    pub disabled: bool,
    /// The last failure, for reports.
    pub last_error: Option<String>,
    logged: Vec<std::mem::Discriminant<PolicyError>>,
}

impl RoleHealth {
    /// A new policy takes the role: its failure streak, disabling and log
    /// memory start over; the counters keep counting (they are the role's).
    fn fresh_policy(&mut self) {
        self.consecutive_failures = 0;
        self.disabled = false;
        self.last_error = None;
        self.logged.clear();
    }

    fn record(&mut self, role: Role, policy: &str, err: &PolicyError, max: u32) {
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
            tracing::warn!(%role, policy, error = %err, "policy failed; the built-in default decides this call");
        }
        if !self.disabled && max > 0 && self.consecutive_failures >= max {
            self.disabled = true;
            tracing::error!(
                %role,
                policy,
                failures = self.consecutive_failures,
                "policy disabled after consecutive failures; the built-in default stays in charge"
            );
        }
    }
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

/// The active policies of an allocator and their defaults.
pub struct PolicySet {
    pub(crate) placement: Box<dyn PlacementPolicy>,
    pub(crate) reclamation: Box<dyn ReclamationPolicy>,
    pub(crate) eviction: Box<dyn EvictionPolicy>,
    /// Placement-local pool index → engine pool index.
    pub(crate) pool_map: Vec<u32>,
    /// Engine pools of the default placement (`small`, `large`).
    pub(crate) default_pool_map: Vec<u32>,
    memoize: bool,
    memo: FxHashMap<u64, PlacementDecision>,
    /// Health per role: placement, reclamation, eviction.
    pub(crate) health: [RoleHealth; 3],
    /// Consecutive failures before a role's policy is disabled (0: never).
    pub max_consecutive_failures: u32,
}

impl PolicySet {
    /// Whether new large segments should be paged: the reclamation policy
    /// asks for it and is not disabled.
    pub(crate) fn reclamation_wants_pages(&self) -> bool {
        !self.health[1].disabled && self.reclamation.paged_segments()
    }
}

fn memo_key(req: &AllocRequest, phase: Option<Phase>) -> u64 {
    let class = 64 - req.bytes.leading_zeros() as u64; // log2 size class
    let phase = phase.map_or(0, |p| p as u64 + 1);
    (req.stream.0 as u64) << 32 | (req.kind.index() as u64) << 16 | class << 8 | phase
}

impl PolicySet {
    pub(crate) fn new(
        placement: Box<dyn PlacementPolicy>,
        reclamation: Box<dyn ReclamationPolicy>,
        eviction: Box<dyn EvictionPolicy>,
    ) -> Self {
        let memoize = placement.memoizable();
        PolicySet {
            placement,
            reclamation,
            eviction,
            pool_map: Vec::new(),
            default_pool_map: Vec::new(),
            memoize,
            memo: FxHashMap::default(),
            health: Default::default(),
            max_consecutive_failures: 8,
        }
    }

    pub(crate) fn set_placement(&mut self, p: Box<dyn PlacementPolicy>) {
        self.memoize = p.memoizable();
        self.memo.clear();
        self.placement = p;
        self.health[0].fresh_policy();
    }

    pub(crate) fn set_reclamation(&mut self, p: Box<dyn ReclamationPolicy>) {
        self.reclamation = p;
        self.health[1].fresh_policy();
    }

    pub(crate) fn set_eviction(&mut self, p: Box<dyn EvictionPolicy>) {
        self.eviction = p;
        self.health[2].fresh_policy();
    }

    /// Names of the active policies (placement, reclamation, eviction).
    pub fn names(&self) -> [String; 3] {
        [self.placement.name().to_string(), self.reclamation.name().to_string(), self.eviction.name().to_string()]
    }

    /// Health of a role.
    pub fn health(&self, role: Role) -> &RoleHealth {
        &self.health[role as usize]
    }

    /// Decides placement for `req`.
    #[inline]
    pub(crate) fn place(&mut self, req: &AllocRequest, ctx: &PolicyContext) -> Placement {
        let h = &mut self.health[0];
        let mut memo_hit = false;
        let mut called = false;
        let result = if h.disabled {
            Err(PolicyError::Disabled)
        } else if let Some(d) = self.memoize.then(|| self.memo.get(&memo_key(req, ctx.phase))).flatten() {
            memo_hit = true;
            Ok(*d)
        } else {
            h.calls += 1;
            called = true;
            self.placement.place(req, ctx)
        };
        let checked = result.and_then(|d| {
            let (rounded, seg) = d.validate(req, self.pool_map.len())?;
            Ok((d, rounded, seg))
        });
        match checked {
            Ok((d, rounded, seg)) => {
                if called {
                    h.consecutive_failures = 0;
                    if self.memoize && d.cacheable {
                        self.memo.insert(memo_key(req, ctx.phase), d);
                    }
                }
                Placement { pool: self.pool_map[d.pool as usize], rounded, segment: seg, decision: d, memo_hit }
            }
            Err(e) => {
                if !matches!(e, PolicyError::Disabled) {
                    h.record(Role::Placement, self.placement.name(), &e, self.max_consecutive_failures);
                } else {
                    h.fallbacks += 1;
                }
                let d = PytorchPlacement::decide(req.bytes);
                let (rounded, seg) = d.validate(req, 2).expect("the default placement is valid for accepted sizes");
                Placement {
                    pool: self.default_pool_map[d.pool as usize],
                    rounded,
                    segment: seg,
                    decision: d,
                    memo_hit: false,
                }
            }
        }
    }

    /// Decides reclamation; `pool_exists` checks pool names.
    pub(crate) fn reclaim(
        &mut self,
        trigger: &ReclaimTrigger,
        ctx: &PolicyContext,
        pool_allocated: impl Fn(&str) -> Option<u64>,
    ) -> (ReclaimDecision, bool) {
        let h = &mut self.health[1];
        let result = if h.disabled {
            Err(PolicyError::Disabled)
        } else {
            h.calls += 1;
            self.reclamation.reclaim(trigger, ctx)
        };
        let checked = result.and_then(|d| {
            if let Some(bad) = d.pools.iter().flatten().find(|p| pool_allocated(p).is_none()) {
                return Err(PolicyError::InvalidDecision(format!("pool `{bad}` does not exist")));
            }
            if let Some((pool, budget)) = &d.compact {
                match pool_allocated(pool) {
                    None => {
                        return Err(PolicyError::InvalidDecision(format!(
                            "compaction of pool `{pool}`, which does not exist"
                        )))
                    }
                    Some(a) if *budget > a => {
                        return Err(PolicyError::InvalidDecision(format!(
                            "compaction budget {budget} exceeds pool `{pool}`'s {a} allocated bytes"
                        )))
                    }
                    Some(_) => {}
                }
            }
            Ok(d)
        });
        match checked {
            Ok(d) => {
                h.consecutive_failures = 0;
                (d, true)
            }
            Err(e) => {
                if !matches!(e, PolicyError::Disabled) {
                    h.record(Role::Reclamation, self.reclamation.name(), &e, self.max_consecutive_failures);
                } else {
                    h.fallbacks += 1;
                }
                let d = PytorchReclamation.reclaim(trigger, ctx).expect("the default reclamation never fails");
                (d, false)
            }
        }
    }

    /// Picks eviction victims covering `need_bytes` among `candidates`: the
    /// policy's answer, validated, completed by LRU when short.
    pub fn choose_victims(
        &mut self,
        need_bytes: u64,
        candidates: &[EvictionCandidate],
        ctx: &PolicyContext,
    ) -> Vec<TensorId> {
        let h = &mut self.health[2];
        let result = if h.disabled {
            Err(PolicyError::Disabled)
        } else {
            h.calls += 1;
            self.eviction.choose_victims(need_bytes, candidates, ctx)
        };
        let checked = result.and_then(|v| {
            let got = validate_victims(candidates, &v)?;
            Ok((v, got))
        });
        match checked {
            Ok((mut v, got)) => {
                h.consecutive_failures = 0;
                if got < need_bytes {
                    let more = LruEviction::pick(need_bytes - got, candidates, &v);
                    v.extend(more);
                }
                v
            }
            Err(e) => {
                if !matches!(e, PolicyError::Disabled) {
                    h.record(Role::Eviction, self.eviction.name(), &e, self.max_consecutive_failures);
                } else {
                    h.fallbacks += 1;
                }
                LruEviction::pick(need_bytes, candidates, &[])
            }
        }
    }

    /// Totals over the roles: (calls, traps, fallbacks).
    pub fn totals(&self) -> (u64, u64, u64) {
        self.health.iter().fold((0, 0, 0), |(c, t, f), h| (c + h.calls, t + h.traps, f + h.fallbacks))
    }
}
