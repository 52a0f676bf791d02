//! Emulation of PyTorch's CUDACachingAllocator defaults.
//!
//! - sizes round up to 512 B;
//! - rounded sizes ≤ 1 MiB go to the `small` pool, grown in 2 MiB segments,
//!   and a small block is split when ≥ 512 B remain;
//! - larger sizes go to the `large` pool: below 10 MiB it grows 20 MiB
//!   segments, from 10 MiB on segments of the size rounded up to 2 MiB; a large
//!   block is split when more than 1 MiB remains;
//! - best fit ordered by (stream, size, address) — the pool index does that;
//! - on a failed device allocation, release every cached segment that is
//!   entirely free and retry once; nothing is released otherwise.

use crate::decision::{
    AllocRequest, PlacementDecision, PlacementPolicy, PolicyContext, PolicyError, PoolSpec, ReclaimDecision,
    ReclaimTrigger, ReclamationPolicy,
};
use crate::types::MIB;

/// PyTorch's minimum block size and rounding.
pub const MIN_BLOCK: u64 = 512;
/// Largest "small" request.
pub const SMALL_SIZE: u64 = MIB;
/// Segment size of the small pool.
pub const SMALL_BUFFER: u64 = 2 * MIB;
/// Segment size for 1–10 MiB requests.
pub const LARGE_BUFFER: u64 = 20 * MIB;
/// Requests from this size on get a segment of their own size (rounded to 2 MiB).
pub const MIN_LARGE_ALLOC: u64 = 10 * MIB;
/// Rounding of large segments.
pub const ROUND_LARGE: u64 = 2 * MIB;

/// PyTorch's placement rules.
#[derive(Debug, Clone, Copy, Default)]
pub struct PytorchPlacement;

impl PytorchPlacement {
    /// The decision for `bytes` (pure function of the size).
    #[inline]
    pub fn decide(bytes: u64) -> PlacementDecision {
        let rounded = crate::types::round_up(bytes, MIN_BLOCK).unwrap_or(u64::MAX);
        let (pool, segment_min, split) = if rounded <= SMALL_SIZE {
            (0, SMALL_BUFFER, MIN_BLOCK)
        } else if rounded < MIN_LARGE_ALLOC {
            (1, LARGE_BUFFER, SMALL_SIZE + 1)
        } else {
            (1, 0, SMALL_SIZE + 1)
        };
        // Cacheable per log2 size class unless the class straddles a boundary.
        let class_lo = if bytes == 0 { 0 } else { 1u64 << (63 - bytes.leading_zeros()) };
        let class_hi = class_lo.saturating_mul(2);
        let straddles = |b: u64| class_lo < b && b < class_hi;
        PlacementDecision {
            pool,
            round_to: MIN_BLOCK,
            segment_min,
            segment_round: ROUND_LARGE,
            split_min_remainder: split,
            max_waste: u64::MAX,
            cacheable: !straddles(SMALL_SIZE + 1) && !straddles(MIN_LARGE_ALLOC),
        }
    }
}

impl PlacementPolicy for PytorchPlacement {
    fn name(&self) -> &str {
        "pytorch"
    }

    fn pools(&self) -> Vec<PoolSpec> {
        vec![PoolSpec::caching("small"), PoolSpec::caching("large")]
    }

    #[inline]
    fn place(&mut self, req: &AllocRequest, _ctx: &PolicyContext) -> Result<PlacementDecision, PolicyError> {
        Ok(Self::decide(req.bytes))
    }
}

/// PyTorch's reclamation: free all cached segments on a failed device allocation.
#[derive(Debug, Clone, Copy, Default)]
pub struct PytorchReclamation;

impl ReclamationPolicy for PytorchReclamation {
    fn name(&self) -> &str {
        "pytorch"
    }

    fn reclaim(&mut self, trigger: &ReclaimTrigger, _ctx: &PolicyContext) -> Result<ReclaimDecision, PolicyError> {
        Ok(match trigger {
            ReclaimTrigger::AllocFailed { .. } => ReclaimDecision::all(),
            ReclaimTrigger::Grow { .. } | ReclaimTrigger::Phase { .. } => ReclaimDecision::none(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn size_classes() {
        let d = PytorchPlacement::decide(100);
        assert_eq!((d.pool, d.segment_min, d.split_min_remainder), (0, 2 * MIB, 512));
        let d = PytorchPlacement::decide(MIB);
        assert_eq!(d.pool, 0);
        let d = PytorchPlacement::decide(MIB + 1);
        assert_eq!((d.pool, d.segment_min), (1, 20 * MIB));
        let d = PytorchPlacement::decide(10 * MIB);
        assert_eq!((d.pool, d.segment_min), (1, 0));
        assert!(!PytorchPlacement::decide(9 * MIB).cacheable);
        assert!(!PytorchPlacement::decide(MIB + 100).cacheable);
        assert!(PytorchPlacement::decide(3 * MIB).cacheable);
        assert!(PytorchPlacement::decide(64).cacheable);
    }
}
