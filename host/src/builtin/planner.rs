//! The built-in planner: the cheapest of a time-order best-fit plan and
//! greedy-by-size plans with best fit over lifetime intervals (Pisarchyk &
//! Lee 2020, "Efficient memory management for deep neural net inference",
//! the "greedy by size" offset calculation).
//!
//! Requests are placed in decreasing size (longer lifetimes first among
//! equals). Each goes into the smallest gap, between the blocks already
//! placed whose lifetimes overlap its own, that holds it (the lowest such gap
//! on a tie); when no gap holds it, just above the highest of them. The arena
//! is the highest end. Requests whose end of life in the step's cycle is not
//! known are left to the dynamic path.
//!
//! When some requests stay to the end of the profile (parameters allocated
//! once, in a whole-trace offline plan), a second order is tried as well:
//! those first, stacked in allocation order as a floor, then the rest by
//! size; the smaller arena wins (greedy by size alone can leave holes under
//! tensors that never leave: 0.6 % on one real snapshot, against 0.05 %).
//!
//! Greedy by size looks at every placed block whose lifetime overlaps the
//! one it places: its cost grows with the number of tensors live at once
//! (a step of 50,000 requests with thousands of activations live together
//! takes seconds). So a third plan is always made, in O(n log n): the step
//! replayed in time order through a best-fit allocator that knows each
//! lifetime. Greedy by size runs only while its work — the sum of the
//! planned lifetimes, in requests — stays within [`GREEDY_WORK`]; the
//! smallest arena of the plans made wins. In steps of at most 2,048
//! requests, within a budget of block visits linear in the requests, the
//! greedy orders are also tried with equal sizes in time order, and the
//! time-order plan's layout as an order, then searched (nearby requests
//! swapped) while the plan is above the live bound (`wasmem_plan_core`'s
//! documentation).
//!
//! The algorithm itself is `wasmem_plan_core::plan` (a crate of its own,
//! `no_std` and without dependencies, in `policies/sdk/plan-core`), which
//! the policy SDK's default planner calls too: the shipped `greedy-planner`
//! component plans exactly as this one, plan for plan.

use crate::decision::{AliasedPlan, Plan, PlannerPolicy, PolicyContext, PolicyError, Refined, StepProfile};

pub use wasmem_plan_core::GREEDY_WORK;

/// The built-in planner (see the module documentation).
///
/// Its search budget is `effort` times the online one
/// ([`wasmem_plan_core::Effort::times`]): 1 by default, sized to the
/// engine's planning deadline; more where planning is offline or a longer
/// pause at the steps that plan is welcome (`planned?effort=K`, e.g.
/// `wasmem plan` and planning ahead from a recording).
///
/// It keeps the search of its last `MAX_SEARCHES` plans
/// ([`wasmem_plan_core::Refiner`]), which [`PlannerPolicy::refine`] goes on
/// with, one budget a call (unless `planned?refine=off`: no search at
/// step ends).
///
/// Its plans are deterministic: a profile it planned lately (the last
/// [`MAX_MADE`] plain and aliased ones) gets the plan it got then, without
/// a search — the engine plans a step again after a few misses, often one
/// of the very profile its plan came from (the misses were the install's).
#[derive(Debug)]
pub struct GreedyPlanner {
    effort: u64,
    /// Whether [`PlannerPolicy::refine`] searches.
    refine: bool,
    /// Whether unmarked steps are found by their period
    /// ([`PlannerPolicy::steps_by_period`]).
    by_period: bool,
    /// The searches of the latest plans, the newest last.
    searches: Vec<Refiner>,
    /// The latest plans made, by profile, the newest last.
    made: Vec<(Vec<wasmem_plan_core::Request>, Plan)>,
    /// The latest aliased plans made (or none), by profile, the newest last.
    made_aliased: Vec<(Vec<wasmem_plan_core::Request>, Option<AliasedPlan>)>,
}

/// Most plans (and as many aliased ones) a [`GreedyPlanner`] remembers.
pub const MAX_MADE: usize = 2;

/// The result remembered for `requests` in `made`, if any.
fn made_for<'a, T>(
    made: &'a [(Vec<wasmem_plan_core::Request>, T)],
    requests: &[wasmem_plan_core::Request],
) -> Option<&'a T> {
    made.iter().rev().find(|(r, _)| r.as_slice() == requests).map(|(_, t)| t)
}

/// Remembers `result` for `requests` in `made` (at most [`MAX_MADE`]).
fn remember<T>(
    made: &mut Vec<(Vec<wasmem_plan_core::Request>, T)>,
    requests: Vec<wasmem_plan_core::Request>,
    result: T,
) {
    if made.len() >= MAX_MADE {
        made.remove(0);
    }
    made.push((requests, result));
}

/// A planned profile and the search that goes on from its plan.
#[derive(Debug)]
struct Refiner {
    requests: Vec<wasmem_plan_core::Request>,
    search: wasmem_plan_core::Refiner,
}

/// Most searches a [`GreedyPlanner`] keeps (the engine keeps at most 8 plans).
pub const MAX_SEARCHES: usize = 8;

impl Default for GreedyPlanner {
    fn default() -> Self {
        GreedyPlanner {
            effort: 1,
            refine: true,
            by_period: false,
            searches: Vec::new(),
            made: Vec::new(),
            made_aliased: Vec::new(),
        }
    }
}

/// The most `effort` a [`GreedyPlanner`] takes (10,000 times the online
/// search: seconds for a step of a few hundred requests).
pub const MAX_EFFORT: u64 = 10_000;

impl GreedyPlanner {
    /// A planner that searches `effort` times as long as the online one
    /// (`1..=`[`MAX_EFFORT`]; clamped into that range).
    pub fn with_effort(effort: u64) -> Self {
        GreedyPlanner { effort: effort.clamp(1, MAX_EFFORT), ..Self::default() }
    }

    /// Its search budget, as a multiple of the online one.
    pub fn effort(&self) -> u64 {
        self.effort
    }

    /// The plan of `profile` with the online search budget (see the module
    /// documentation).
    pub fn plan_profile(profile: &StepProfile) -> Plan {
        Self::default().plan_of(profile)
    }

    /// The plan of `profile` with this planner's search budget.
    pub fn plan_of(&self, profile: &StepProfile) -> Plan {
        let requests: Vec<wasmem_plan_core::Request> = profile.requests.iter().map(|r| r.core()).collect();
        let p = wasmem_plan_core::plan_with(&requests, wasmem_plan_core::Effort::times(self.effort));
        Plan { arena_bytes: p.arena_bytes, offsets: p.offsets }
    }

    /// Whether it searches on at step ends ([`PlannerPolicy::refine`]).
    pub fn refines(&self) -> bool {
        self.refine
    }

    /// [`GreedyPlanner::plan_of`], keeping its search to go on with.
    fn plan_keeping(&mut self, profile: &StepProfile) -> Plan {
        if !self.refine {
            return self.plan_of(profile);
        }
        let requests: Vec<wasmem_plan_core::Request> = profile.requests.iter().map(|r| r.core()).collect();
        let search = wasmem_plan_core::Refiner::new(&requests, wasmem_plan_core::Effort::times(self.effort));
        let p = search.plan().clone();
        self.searches.retain(|s| s.requests != requests);
        if !search.done() {
            if self.searches.len() >= MAX_SEARCHES {
                self.searches.remove(0);
            }
            self.searches.push(Refiner { requests, search });
        }
        Plan { arena_bytes: p.arena_bytes, offsets: p.offsets }
    }

    /// Parses a `planned?CONFIG` configuration: `effort=K` (`K` from 1 to
    /// [`MAX_EFFORT`]), `refine=on|off` and `steps=marked|period` (steps
    /// of a run without step markers found by the period of its requests),
    /// separated by `,` or `&`, or nothing. The error says what is wrong.
    pub fn from_config(config: &str) -> Result<Self, String> {
        let mut planner = Self::default();
        for item in config.split([',', '&']).map(str::trim).filter(|s| !s.is_empty()) {
            let Some((key, value)) = item.split_once('=') else {
                return Err(format!("`{item}` is not KEY=VALUE"));
            };
            match key.trim() {
                "effort" => {
                    let k: u64 =
                        value.trim().parse().map_err(|_| format!("effort `{}` is not a whole number", value.trim()))?;
                    if !(1..=MAX_EFFORT).contains(&k) {
                        return Err(format!("effort {k} is out of range (1 to {MAX_EFFORT})"));
                    }
                    planner.effort = k;
                }
                "refine" => {
                    planner.refine = match value.trim() {
                        "on" | "true" | "1" => true,
                        "off" | "false" | "0" => false,
                        v => return Err(format!("refine `{v}` is not on or off")),
                    }
                }
                "steps" => {
                    planner.by_period = match value.trim() {
                        "period" => true,
                        "marked" => false,
                        v => return Err(format!("steps `{v}` is not marked or period")),
                    }
                }
                other => return Err(format!("unknown key `{other}` (the keys are `effort`, `refine` and `steps`)")),
            }
        }
        Ok(planner)
    }
}

impl PlannerPolicy for GreedyPlanner {
    fn name(&self) -> &str {
        "greedy"
    }

    fn steps_by_period(&self) -> bool {
        self.by_period
    }

    fn plan(&mut self, profile: &StepProfile, _ctx: &PolicyContext) -> Result<Plan, PolicyError> {
        let requests: Vec<wasmem_plan_core::Request> = profile.requests.iter().map(|r| r.core()).collect();
        if let Some(plan) = made_for(&self.made, &requests) {
            return Ok(plan.clone());
        }
        let plan = self.plan_keeping(profile);
        remember(&mut self.made, requests, plan.clone());
        Ok(plan)
    }

    fn refine(
        &mut self,
        profile: &StepProfile,
        plan: &Plan,
        searched: u64,
        _ctx: &PolicyContext,
    ) -> Result<Refined, PolicyError> {
        if !self.refine {
            return Ok(Refined::Done);
        }
        let same = |s: &Refiner| {
            s.requests.len() == profile.requests.len()
                && s.requests.iter().zip(&profile.requests).all(|(a, b)| *a == b.core())
        };
        // A plan this planner did not make here (an earlier run's): a
        // search from it.
        let i = match self.searches.iter().position(same) {
            Some(i) => i,
            None => {
                let requests: Vec<wasmem_plan_core::Request> = profile.requests.iter().map(|r| r.core()).collect();
                let core = wasmem_plan_core::Plan { arena_bytes: plan.arena_bytes, offsets: plan.offsets.clone() };
                let effort = wasmem_plan_core::Effort::times(self.effort);
                let search = wasmem_plan_core::Refiner::resume(&requests, &core, effort, searched);
                if search.done() {
                    return Ok(Refined::Done);
                }
                if self.searches.len() >= MAX_SEARCHES {
                    self.searches.remove(0);
                }
                self.searches.push(Refiner { requests, search });
                self.searches.len() - 1
            }
        };
        let found = self.searches[i].search.refine();
        let done = self.searches[i].search.done();
        if done {
            self.searches.remove(i);
        }
        Ok(match found {
            Some(p) => Refined::Better(Plan { arena_bytes: p.arena_bytes, offsets: p.offsets }),
            None if done => Refined::Done,
            None => Refined::NotYet,
        })
    }

    fn plan_aliased(
        &mut self,
        profile: &StepProfile,
        _ctx: &PolicyContext,
    ) -> Result<Option<AliasedPlan>, PolicyError> {
        let requests: Vec<wasmem_plan_core::Request> = profile.requests.iter().map(|r| r.core()).collect();
        if let Some(plan) = made_for(&self.made_aliased, &requests) {
            return Ok(plan.clone());
        }
        let plan = wasmem_plan_core::aliased_with(&requests, wasmem_plan_core::Effort::times(self.effort));
        remember(&mut self.made_aliased, requests, plan.clone());
        Ok(plan)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decision::{validate_plan, PlanRequest};
    use crate::types::{StreamId, TensorKind};

    /// The time-order plan alone (what large steps get).
    fn in_time_order(reqs: &[PlanRequest]) -> Plan {
        let core: Vec<wasmem_plan_core::Request> = reqs.iter().map(|r| r.core()).collect();
        let p = wasmem_plan_core::in_time_order(&core);
        Plan { arena_bytes: p.arena_bytes, offsets: p.offsets }
    }

    fn req(bytes: u64, freed_at: Option<u32>, wraps_to: Option<u32>) -> PlanRequest {
        PlanRequest { bytes, kind: TensorKind::Activation, stream: StreamId(0), freed_at, wraps_to }
    }

    /// Peak of the live planned bytes over the cycle: the lower bound of any arena.
    fn peak(p: &StepProfile) -> u64 {
        let n = p.requests.len() as u32;
        (0..n)
            .map(|t| {
                p.requests
                    .iter()
                    .enumerate()
                    .filter(|(k, r)| r.plannable(*k as u32))
                    .filter(|(k, r)| {
                        let (iv, m) = r.intervals(*k as u32, n);
                        iv[..m].iter().any(|&(a, b)| a <= t && t < b)
                    })
                    .map(|(_, r)| r.planned_bytes())
                    .sum::<u64>()
            })
            .max()
            .unwrap_or(0)
    }

    #[test]
    fn plans_are_valid_and_tight_on_a_forward_backward_step() {
        // A forward that saves L activations, a backward that frees them in
        // reverse with a temporary each, and a gradient live across steps.
        let l = 40u32;
        let mut rs = Vec::new();
        for i in 0..l {
            rs.push(req(1 << 20 | (i as u64 * 4096), None, None)); // activation i, freed in backward
        }
        for i in 0..l {
            let k = rs.len() as u32;
            rs.push(req(256 << 10, Some(k + 1), None)); // a temporary
            let act = (l - 1 - i) as usize;
            rs[act].freed_at = Some(k + 1);
        }
        rs.push(req(3 << 20, None, Some(l))); // a gradient freed in the next step's forward
        let p = StepProfile { step: 1, requests: rs };
        let plan = GreedyPlanner::plan_profile(&p);
        validate_plan(&p, &plan, u64::MAX).unwrap();
        assert_eq!(plan.planned(), p.requests.len());
        let lb = peak(&p);
        assert!(plan.arena_bytes as f64 <= lb as f64 * 1.05, "arena {} for a peak of {lb}", plan.arena_bytes);
    }

    #[test]
    fn unknown_lifetimes_stay_dynamic_and_random_profiles_validate() {
        let mut rng = oorandom::Rand32::new(7);
        for round in 0..50 {
            let n = 1 + rng.rand_range(1..400);
            let mut rs = Vec::new();
            for k in 0..n {
                let bytes = 1 + u64::from(rng.rand_range(1..(1 << 20)));
                let freed_at = (rng.rand_range(0..10) > 1).then(|| (k + 1 + rng.rand_range(0..40)).min(n));
                let wraps_to = (freed_at.is_none() && rng.rand_range(0..2) == 0).then(|| rng.rand_range(0..n));
                rs.push(req(bytes, freed_at, wraps_to));
            }
            let p = StepProfile { step: round, requests: rs };
            let plan = GreedyPlanner::plan_profile(&p);
            validate_plan(&p, &plan, u64::MAX).unwrap_or_else(|e| panic!("round {round}: {e}"));
            for (k, (r, o)) in p.requests.iter().zip(&plan.offsets).enumerate() {
                assert!(o.is_none() || r.plannable(k as u32), "round {round}, request {k}");
            }
            // The time-order plan alone is valid too (it is what large steps get).
            let sim = in_time_order(&p.requests);
            validate_plan(&p, &sim, u64::MAX).unwrap_or_else(|e| panic!("round {round}, in time order: {e}"));
            let left: u64 = (0..p.requests.len())
                .filter(|&k| plan.offsets[k].is_none() && p.requests[k].plannable(k as u32))
                .map(|k| p.requests[k].planned_bytes())
                .sum();
            assert!(plan.arena_bytes + left >= peak(&p), "round {round}");
        }
    }

    #[test]
    fn a_large_step_is_planned_in_time_order_and_stays_tight() {
        // 60,000 requests: nested activations (many live at once, beyond
        // greedy by size's work bound), temporaries, and a few wrapping.
        let n = 60_000u32;
        let mut rng = oorandom::Rand32::new(3);
        let mut rs = Vec::new();
        for k in 0..n {
            let bytes = 512 * u64::from(rng.rand_range(1..2048));
            let (freed_at, wraps_to) = if k < n / 2 && k % 3 == 0 {
                (Some(n - 1 - k), None)
            } else if k % 101 == 0 && k > n / 2 {
                (None, Some(4))
            } else {
                (Some((k + 1 + rng.rand_range(0..6)).min(n)), None)
            };
            rs.push(req(bytes, freed_at, wraps_to));
        }
        let p = StepProfile { step: 1, requests: rs };
        let work: u64 = (0..n)
            .map(|k| {
                let (iv, m) = p.requests[k as usize].intervals(k, n);
                iv[..m].iter().map(|&(a, b)| u64::from(b - a)).sum::<u64>()
            })
            .sum();
        assert!(work > GREEDY_WORK, "the test must exceed the greedy bound ({work})");
        let plan = GreedyPlanner::plan_profile(&p);
        validate_plan(&p, &plan, u64::MAX).unwrap();
        let lb = peak(&p);
        assert!(plan.planned() as f64 >= 0.99 * f64::from(n), "{} planned", plan.planned());
        assert!(plan.arena_bytes as f64 <= lb as f64 * 1.02, "arena {} for a peak of {lb}", plan.arena_bytes);
    }

    /// A profile planned lately gets the plan it got then, from memory (no
    /// search: nothing is remembered anew), plain and aliased alike; a
    /// profile that differs in a lifetime is planned; the oldest is
    /// forgotten past `MAX_MADE`.
    #[test]
    fn a_profile_planned_lately_gets_the_same_plan_from_memory() {
        let ctx = PolicyContext::default();
        let mut g = GreedyPlanner::default();
        let profile = |last: u32| StepProfile {
            step: 1,
            requests: vec![
                req(4096, Some(2), None),
                req(8192, Some(3), None),
                req(4096, Some(last), None),
                req(2048, None, Some(1)),
            ],
        };
        let first = g.plan(&profile(4), &ctx).unwrap();
        validate_plan(&profile(4), &first, u64::MAX).unwrap();
        assert_eq!(g.made.len(), 1);
        assert_eq!(g.plan(&profile(4), &ctx).unwrap(), first);
        assert_eq!(g.made.len(), 1, "served from memory");
        let aliased = g.plan_aliased(&profile(4), &ctx).unwrap();
        assert_eq!(g.plan_aliased(&profile(4), &ctx).unwrap(), aliased);
        assert_eq!(g.made_aliased.len(), 1);
        // Another lifetime: planned, and remembered beside.
        let other = g.plan(&profile(3), &ctx).unwrap();
        validate_plan(&profile(3), &other, u64::MAX).unwrap();
        assert_eq!(g.made.len(), 2);
        // A third profile: the oldest is forgotten.
        g.plan(&StepProfile { step: 1, requests: vec![req(512, Some(1), None)] }, &ctx).unwrap();
        assert_eq!(g.made.len(), MAX_MADE);
        assert!(made_for(&g.made, &profile(4).requests.iter().map(|r| r.core()).collect::<Vec<_>>()).is_none());
        assert_eq!(g.plan(&profile(4), &ctx).unwrap(), first, "planned again: the same plan");
    }
}
