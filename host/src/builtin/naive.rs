//! The no-cache baseline: one device allocation per tensor, released at free.

use crate::decision::{AllocRequest, PlacementDecision, PlacementPolicy, PolicyContext, PolicyError, PoolSpec};

/// One segment per tensor (its size rounded to 512 B), never split, released
/// when the tensor is freed.
#[derive(Debug, Clone, Copy, Default)]
pub struct NaivePlacement;

impl PlacementPolicy for NaivePlacement {
    fn name(&self) -> &str {
        "naive"
    }

    fn pools(&self) -> Vec<PoolSpec> {
        vec![PoolSpec { name: "naive".into(), release_when_empty: true }]
    }

    fn place(&mut self, _req: &AllocRequest, _ctx: &PolicyContext) -> Result<PlacementDecision, PolicyError> {
        Ok(PlacementDecision {
            pool: 0,
            round_to: 512,
            segment_min: 0,
            segment_round: 512,
            split_min_remainder: u64::MAX,
            max_waste: 0,
            cacheable: true,
        })
    }
}
