//! DTR eviction: the heuristic of Dynamic Tensor Rematerialization
//! (Kirisame et al., 2021), `h(t) = c(t) / (m(t) · s(t))`, evicting the
//! tensors of least `h` first.
//!
//! Here a tensor is not recomputed but brought back, so its cost `c` is the
//! bytes to copy back, times how often it is expected to be needed again
//! (`1 + use_count`), divided by a per-kind weight favouring what is idle
//! between uses (activations and optimizer states 1, gradients and
//! temporaries 1/2, parameters 1/4). With `m = bytes` and staleness
//! `s = clock − last_use + 1`, `h = (1 + use_count) / (weight · s)`. Ties go
//! to the larger tensor (fewer moves), then the least recently used.

use crate::decision::{EvictionCandidate, EvictionPolicy, PolicyContext, PolicyError};
use crate::types::{TensorId, TensorKind};

/// The DTR heuristic with the cost approximated by bytes (see the module documentation).
#[derive(Debug, Clone, Copy, Default)]
pub struct DtrEviction;

/// The weight of a kind: larger is evicted sooner.
pub fn kind_weight(k: TensorKind) -> f64 {
    match k {
        TensorKind::Param => 0.25,
        TensorKind::Grad | TensorKind::Temp => 0.5,
        TensorKind::Optim | TensorKind::Activation | TensorKind::Other => 1.0,
    }
}

impl DtrEviction {
    /// `h` of a candidate at logical time `clock` (lower: evicted sooner).
    pub fn score(c: &EvictionCandidate, clock: u64) -> f64 {
        let staleness = clock.saturating_sub(c.last_use) as f64 + 1.0;
        (1.0 + c.use_count as f64) / (kind_weight(c.kind) * staleness)
    }
}

impl EvictionPolicy for DtrEviction {
    fn name(&self) -> &str {
        "dtr"
    }

    fn choose_victims(
        &mut self,
        need_bytes: u64,
        candidates: &[EvictionCandidate],
        ctx: &PolicyContext,
    ) -> Result<Vec<TensorId>, PolicyError> {
        let mut order: Vec<(f64, &EvictionCandidate)> =
            candidates.iter().filter(|c| c.evictable()).map(|c| (Self::score(c, ctx.clock), c)).collect();
        order.sort_by(|a, b| {
            a.0.total_cmp(&b.0)
                .then(b.1.bytes.cmp(&a.1.bytes))
                .then(a.1.last_use.cmp(&b.1.last_use))
                .then(a.1.id.cmp(&b.1.id))
        });
        Ok(cover(need_bytes, order.into_iter().map(|(_, c)| c)))
    }
}

/// Takes candidates in order until `need_bytes` are covered.
pub(crate) fn cover<'a>(need_bytes: u64, order: impl Iterator<Item = &'a EvictionCandidate>) -> Vec<TensorId> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::Tier;

    fn c(slot: u32, bytes: u64, kind: TensorKind, last_use: u64, use_count: u64) -> EvictionCandidate {
        EvictionCandidate {
            id: TensorId { slot, generation: 0 },
            bytes,
            kind,
            tier: Tier::Device,
            last_use,
            use_count,
            in_use: false,
            pinned: false,
            phase: None,
            next_use: None,
        }
    }

    #[test]
    fn prefers_stale_rarely_used_activations_over_parameters() {
        let ctx = PolicyContext { clock: 100, ..PolicyContext::default() };
        let cands = [
            c(1, 10, TensorKind::Param, 10, 0),      // h = 1 / (0.25 · 91)
            c(2, 10, TensorKind::Activation, 50, 0), // h = 1 / 51
            c(3, 10, TensorKind::Activation, 10, 9), // h = 10 / 91
        ];
        let v = DtrEviction.choose_victims(15, &cands, &ctx).unwrap();
        assert_eq!(v, vec![cands[1].id, cands[0].id]);
        let mut pinned = cands;
        pinned[1].pinned = true;
        let v = DtrEviction.choose_victims(5, &pinned, &ctx).unwrap();
        assert_eq!(v, vec![cands[0].id]);
    }
}
