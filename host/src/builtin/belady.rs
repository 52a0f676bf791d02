//! Belady's eviction: evict the tensors whose next use is farthest in the
//! future (never used again first). It reads the workload's future
//! (`next_use`, filled by a replay's look-ahead), so it is an **offline
//! bound** for comparisons, not a policy a live engine can run.
//!
//! With tensors of different sizes, farthest-next-use is a heuristic for the
//! minimum traffic, not its proof; it is the usual reference. Candidates
//! whose future is unknown (no look-ahead) come after the known ones, least
//! recently used first. Prefetch: the off-device tensors that will be used
//! again, soonest first.

use crate::decision::{EvictionCandidate, EvictionPolicy, PolicyContext, PolicyError};
use crate::types::TensorId;

use super::dtr::cover;

/// Farthest next use first (an offline bound; see the module documentation).
#[derive(Debug, Clone, Copy, Default)]
pub struct BeladyEviction;

impl EvictionPolicy for BeladyEviction {
    fn name(&self) -> &str {
        "belady"
    }

    fn choose_victims(
        &mut self,
        need_bytes: u64,
        candidates: &[EvictionCandidate],
        _ctx: &PolicyContext,
    ) -> Result<Vec<TensorId>, PolicyError> {
        let mut order: Vec<&EvictionCandidate> = candidates.iter().filter(|c| c.evictable()).collect();
        order.sort_by(|a, b| {
            // Known futures first, farthest first; then unknown, least recently used first.
            let key = |c: &EvictionCandidate| (c.next_use.is_none(), std::cmp::Reverse(c.next_use.unwrap_or(0)));
            key(a).cmp(&key(b)).then(a.last_use.cmp(&b.last_use)).then(b.bytes.cmp(&a.bytes)).then(a.id.cmp(&b.id))
        });
        Ok(cover(need_bytes, order.into_iter()))
    }

    fn prefetch_order(&mut self, offloaded: &[EvictionCandidate], _ctx: &PolicyContext) -> Option<Vec<TensorId>> {
        let mut v: Vec<&EvictionCandidate> =
            offloaded.iter().filter(|c| c.next_use.is_some_and(|n| n != u64::MAX)).collect();
        v.sort_by_key(|c| (c.next_use, c.id));
        Some(v.into_iter().map(|c| c.id).collect())
    }

    fn needs_future(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::{TensorKind, Tier};

    fn c(slot: u32, next_use: Option<u64>) -> EvictionCandidate {
        EvictionCandidate {
            id: TensorId { slot, generation: 0 },
            bytes: 10,
            kind: TensorKind::Activation,
            tier: Tier::Device,
            last_use: slot as u64,
            use_count: 0,
            in_use: false,
            pinned: false,
            phase: None,
            next_use,
        }
    }

    #[test]
    fn farthest_future_first_then_unknown() {
        let cands = [c(1, Some(50)), c(2, Some(u64::MAX)), c(3, None), c(4, Some(20))];
        let ctx = PolicyContext::default();
        let v = BeladyEviction.choose_victims(35, &cands, &ctx).unwrap();
        assert_eq!(v, vec![cands[1].id, cands[0].id, cands[3].id, cands[2].id]);
        let p = BeladyEviction.prefetch_order(&cands, &ctx).unwrap();
        assert_eq!(p, vec![cands[3].id, cands[0].id]);
    }
}
