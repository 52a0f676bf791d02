//! The built-in planner: greedy by size with best fit over lifetime
//! intervals (Pisarchyk & Lee 2020, "Efficient memory management for deep
//! neural net inference", the "greedy by size" offset calculation).
//!
//! Requests are placed in decreasing size (longer lifetimes first among
//! equals). Each goes into the smallest gap, between the blocks already
//! placed whose lifetimes overlap its own, that holds it (the lowest such gap
//! on a tie); when no gap holds it, just above the highest of them. The arena
//! is the highest end. Requests whose end of life in the step's cycle is not
//! known are left to the dynamic path.
//!
//! The algorithm itself is `wasmem_plan_core::greedy_by_size` (a crate of
//! its own, without dependencies), which the policy SDK's default planner
//! calls too: the shipped `greedy-planner` component plans exactly as this
//! one, plan for plan.

use crate::decision::{Plan, PlannerPolicy, PolicyContext, PolicyError, StepProfile};

/// Greedy-by-size best-fit planner (see the module documentation).
#[derive(Debug, Clone, Copy, Default)]
pub struct GreedyPlanner;

impl GreedyPlanner {
    /// The plan of `profile` (see the module documentation).
    pub fn plan_profile(profile: &StepProfile) -> Plan {
        let requests: Vec<wasmem_plan_core::Request> = profile.requests.iter().map(|r| r.core()).collect();
        let p = wasmem_plan_core::greedy_by_size(&requests);
        Plan { arena_bytes: p.arena_bytes, offsets: p.offsets }
    }
}

impl PlannerPolicy for GreedyPlanner {
    fn name(&self) -> &str {
        "greedy"
    }

    fn plan(&mut self, profile: &StepProfile, _ctx: &PolicyContext) -> Result<Plan, PolicyError> {
        Ok(Self::plan_profile(profile))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decision::{validate_plan, PlanRequest};
    use crate::types::{StreamId, TensorKind};

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
                assert_eq!(o.is_some(), r.plannable(k as u32), "round {round}, request {k}");
            }
            assert!(plan.arena_bytes >= peak(&p));
        }
    }
}
