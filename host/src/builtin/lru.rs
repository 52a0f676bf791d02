//! Least-recently-used eviction: the default eviction policy.

use crate::decision::{EvictionCandidate, EvictionPolicy, PolicyContext, PolicyError};
use crate::types::TensorId;

/// Evicts the evictable candidates used longest ago until enough bytes are covered.
#[derive(Debug, Clone, Copy, Default)]
pub struct LruEviction;

impl LruEviction {
    /// The LRU choice (also used to complete a short answer of another policy):
    /// victims in order of last use, skipping `already`, until `need_bytes` are covered.
    pub fn pick(need_bytes: u64, candidates: &[EvictionCandidate], already: &[TensorId]) -> Vec<TensorId> {
        let mut order: Vec<&EvictionCandidate> =
            candidates.iter().filter(|c| c.evictable() && !already.contains(&c.id)).collect();
        order.sort_by_key(|c| (c.last_use, c.id));
        let mut got = 0u64;
        let mut out = Vec::new();
        for c in order {
            if got >= need_bytes {
                break;
            }
            got = got.saturating_add(c.bytes);
            out.push(c.id);
        }
        out
    }
}

impl EvictionPolicy for LruEviction {
    fn name(&self) -> &str {
        "lru"
    }

    fn choose_victims(
        &mut self,
        need_bytes: u64,
        candidates: &[EvictionCandidate],
        _ctx: &PolicyContext,
    ) -> Result<Vec<TensorId>, PolicyError> {
        Ok(Self::pick(need_bytes, candidates, &[]))
    }
}
