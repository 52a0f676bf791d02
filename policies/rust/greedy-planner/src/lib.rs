//! The engine's built-in planner (`planned`, `host/src/builtin/planner.rs`)
//! as a planner component (WIT `wasmem:policy@0.4.0`, world `planner-policy`).
//!
//! Plan for plan the same as the built-in: both run `wasmem_plan_core::plan`
//! (the cheapest of a time-order best-fit plan and greedy-by-size plans
//! over lifetime intervals) and, for two steps whose output outlives its
//! next instance, `wasmem_plan_core::aliased`, here through the SDK's
//! default planner ([`defaults::greedy_plan`], [`defaults::aliased_plan`]).
//! No configuration, no state. Combine it with
//! a dynamic path for what the plan does not cover:
//! `greedy-planner+defrag` decides as the built-in `planned`.

#![cfg_attr(all(target_arch = "wasm32", not(test)), no_std)]

use wasmem_policy_sdk::prelude::*;

/// The planner; its plan is the SDK's default.
#[derive(Debug, Default)]
pub struct GreedyPlanner;

impl Policy for GreedyPlanner {
    fn name(&self) -> &str {
        "greedy-planner"
    }
}

impl Planner for GreedyPlanner {}

export!(GreedyPlanner: planner);

#[cfg(test)]
mod tests {
    use super::*;

    fn req(bytes: u64, freed_at: Option<u32>, wraps_to: Option<u32>) -> PlanRequest {
        PlanRequest { bytes, kind: TensorKind::Activation, stream_id: 0, freed_at, wraps_to }
    }

    #[test]
    fn plans_reuse_the_bytes_of_freed_requests() {
        // 0 and 1 overlap; 2 comes after 0's free and takes its place; 3 has no known end.
        let profile = StepProfile {
            step: 1,
            requests: vec![
                req(1000, Some(2), None),
                req(2048, Some(3), None),
                req(1024, Some(4), None),
                req(512, None, None),
            ],
        };
        let plan = GreedyPlanner.plan(&profile).unwrap();
        assert_eq!(plan.offsets, vec![Some(0), Some(1024), Some(0), None]);
        assert_eq!(plan.arena_bytes, 3072);
        for (k, (r, o)) in profile.requests.iter().zip(&plan.offsets).enumerate() {
            assert_eq!(o.is_some(), defaults::plannable(r, k as u32), "request {k}");
            if let Some(o) = o {
                assert_eq!(o % defaults::PLAN_ALIGN, 0);
                assert!(o + defaults::planned_bytes(r) <= plan.arena_bytes);
            }
        }
    }
}
