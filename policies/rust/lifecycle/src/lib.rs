//! Lifecycle-aware placement as a wasmem policy: tensors of different
//! expected lifetimes never share a segment.
//!
//! A port of the engine's native `lifecycle` policy set
//! (`host/src/builtin/lifecycle.rs`: `LifecyclePlacement` and
//! `LifecycleReclamation`), decision for decision.
//!
//! Classes: *persistent* (parameters, optimizer states: allocated once, live
//! for the run), *per-step* (gradients: born in backward, dead after the
//! optimizer step), *transient* (activations, temporaries, everything else).
//! Pools: `persistent`, `step`, `transient.small` (≤ 1 MiB, 2 MiB segments)
//! and `transient`.
//! - persistent and per-step blocks are not freed out of order within their
//!   lifetime, so they are packed tightly, small ones with large ones: every
//!   block splits (≥ 512 B remain) and segments grow by at least
//!   `packed_chunk` bytes;
//! - transient blocks churn, so large ones get segments sized to the request
//!   (rounded to 2 MiB) and split only when more than 1 MiB would remain.
//!
//! Separate pools cannot lend each other cached blocks, so before a pool
//! grows by a segment the policy releases as many bytes of entirely free
//! cached segments (of any pool); when the device refuses a segment it
//! releases everything cached; at phase markers nothing.
//!
//! Configuration (`lifecycle.init`): `packed_chunk=SIZE` (bytes, or with a
//! KiB/MiB/GiB suffix; default `20MiB`). No state.

#![cfg_attr(all(target_arch = "wasm32", not(test)), no_std)]

use wasmem_policy_sdk::defaults::{caching_pool, MIB};
use wasmem_policy_sdk::prelude::*;

/// Lifetime class of a tensor kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LifecycleClass {
    /// Parameters and optimizer states.
    Persistent,
    /// Gradients.
    PerStep,
    /// Activations, temporaries, everything else.
    Transient,
}

impl LifecycleClass {
    /// The class of `kind`.
    pub fn of(kind: TensorKind) -> Self {
        match kind {
            TensorKind::Param | TensorKind::Optim => LifecycleClass::Persistent,
            TensorKind::Grad => LifecycleClass::PerStep,
            TensorKind::Activation | TensorKind::Temp | TensorKind::Other => LifecycleClass::Transient,
        }
    }
}

/// Pool names; decisions index this list.
const POOLS: [&str; 4] = ["persistent", "step", "transient.small", "transient"];

/// Index in `POOLS` of the pool serving `req`.
fn pool_of(req: &AllocRequest) -> usize {
    match LifecycleClass::of(req.kind) {
        LifecycleClass::Persistent => 0,
        LifecycleClass::PerStep => 1,
        LifecycleClass::Transient if req.bytes <= MIB => 2,
        LifecycleClass::Transient => 3,
    }
}

/// The policy.
#[derive(Debug, Clone, Copy)]
pub struct Lifecycle {
    /// Smallest new segment of the persistent and per-step pools.
    packed_chunk: u64,
}

impl Default for Lifecycle {
    fn default() -> Self {
        Lifecycle { packed_chunk: 20 * MIB }
    }
}

impl Lifecycle {
    /// The decision for `req` (a pure function of its kind and size).
    pub fn decide(&self, req: &AllocRequest) -> PlacementDecision {
        let class = LifecycleClass::of(req.kind);
        let small = req.bytes <= MIB;
        let pool = pool_of(req) as u32;
        let (segment_min, split_min_remainder) = match class {
            LifecycleClass::Transient if small => (2 * MIB, 512),
            LifecycleClass::Transient if req.bytes < 10 * MIB => (20 * MIB, MIB + 1),
            LifecycleClass::Transient => (0, MIB + 1),
            LifecycleClass::Persistent | LifecycleClass::PerStep => (self.packed_chunk, 512),
        };
        PlacementDecision {
            pool,
            round_to: 512,
            segment_min,
            segment_round: 2 * MIB,
            split_min_remainder,
            max_waste: u64::MAX,
            // The engine memoizes per log2 size class: [1 MiB, 2 MiB) holds
            // sizes on both sides of the small/large boundary.
            // Memoized per log2 size class: [1, 2) MiB and [8, 16) MiB straddle boundaries.
            cacheable: !(MIB..2 * MIB).contains(&req.bytes) && !(8 * MIB..16 * MIB).contains(&req.bytes),
        }
    }
}

impl Policy for Lifecycle {
    fn name(&self) -> &str {
        "lifecycle"
    }

    fn configure(&mut self, config: &Config) -> Result<(), String> {
        self.packed_chunk = config.bytes_or("packed_chunk", self.packed_chunk)?;
        Ok(())
    }
}

impl Placement for Lifecycle {
    fn pools(&self) -> Vec<PoolSpec> {
        POOLS.iter().map(|name| caching_pool(name)).collect()
    }

    fn place(&mut self, req: &AllocRequest, _ctx: &PolicyContext) -> PlacementDecision {
        self.decide(req)
    }
}

impl Reclamation for Lifecycle {
    fn reclaim(&mut self, trigger: &ReclaimTrigger, _ctx: &PolicyContext) -> ReclaimDecision {
        match trigger {
            // Take back what the *other* pools cache in free segments.
            ReclaimTrigger::Grow(r) => {
                let own = pool_of(&r.request);
                let others = POOLS.iter().enumerate().filter(|&(i, _)| i != own).map(|(_, n)| String::from(*n));
                ReclaimDecision { release_bytes: r.segment_bytes, pools: Some(others.collect()) }
            }
            ReclaimTrigger::AllocFailed(_) => ReclaimDecision { release_bytes: u64::MAX, pools: None },
            ReclaimTrigger::Phase(_) => ReclaimDecision { release_bytes: 0, pools: None },
        }
    }
}

export!(Lifecycle: placement, reclamation);

#[cfg(test)]
mod tests {
    use super::*;

    fn req(bytes: u64, kind: TensorKind) -> AllocRequest {
        AllocRequest { bytes, kind, stream_id: 0 }
    }

    #[test]
    fn pools_by_class_and_size() {
        let p = Lifecycle::default();
        let d = p.decide(&req(100, TensorKind::Param));
        assert_eq!((d.pool, d.segment_min, d.split_min_remainder), (0, 20 * MIB, 512));
        let d = p.decide(&req(4 * MIB, TensorKind::Optim));
        assert_eq!((d.pool, d.segment_min, d.split_min_remainder), (0, 20 * MIB, 512));
        assert_eq!(p.decide(&req(MIB, TensorKind::Grad)).pool, 1);
        assert_eq!(p.decide(&req(MIB + 1, TensorKind::Grad)).pool, 1);
        let d = p.decide(&req(MIB, TensorKind::Temp));
        assert_eq!((d.pool, d.segment_min, d.split_min_remainder), (2, 2 * MIB, 512));
        let d = p.decide(&req(64 * MIB, TensorKind::Activation));
        assert_eq!((d.pool, d.segment_min, d.split_min_remainder), (3, 0, MIB + 1));
        let d = p.decide(&req(3 * MIB, TensorKind::Activation));
        assert_eq!((d.pool, d.segment_min, d.split_min_remainder), (3, 20 * MIB, MIB + 1));
        assert_eq!(p.decide(&req(1, TensorKind::Other)).pool, 2);
        assert_eq!(p.pools().len(), 4);
    }

    #[test]
    fn reclaims_before_growing() {
        let mut p = Lifecycle::default();
        let r = SegmentRequest { request: req(3 * MIB, TensorKind::Activation), segment_bytes: 4 * MIB };
        let ctx = PolicyContext {
            clock: 0,
            phase: None,
            step: 0,
            live_bytes: 0,
            allocated_bytes: 0,
            reserved_bytes: 0,
            peak_reserved_bytes: 0,
            capacity_bytes: 0,
        };
        let d = p.reclaim(&ReclaimTrigger::Grow(r), &ctx);
        assert_eq!(d.release_bytes, 4 * MIB);
        assert_eq!(d.pools.unwrap(), ["persistent", "step", "transient.small"]);
        assert_eq!(p.reclaim(&ReclaimTrigger::AllocFailed(r), &ctx).release_bytes, u64::MAX);
        let marker = ReclaimTrigger::Phase(PhaseMarker { phase: Phase::StepEnd, step: 1 });
        assert_eq!(p.reclaim(&marker, &ctx).release_bytes, 0);
    }

    #[test]
    fn cacheable_outside_the_straddling_class() {
        let p = Lifecycle::default();
        assert!(!p.decide(&req(MIB, TensorKind::Temp)).cacheable);
        assert!(!p.decide(&req(2 * MIB - 1, TensorKind::Temp)).cacheable);
        assert!(p.decide(&req(MIB - 1, TensorKind::Temp)).cacheable);
        assert!(p.decide(&req(2 * MIB, TensorKind::Temp)).cacheable);
    }

    #[test]
    fn configurable_chunk() {
        let mut p = Lifecycle::default();
        p.configure(&Config::parse("packed_chunk=64MiB").unwrap()).unwrap();
        assert_eq!(p.decide(&req(4 * MIB, TensorKind::Param)).segment_min, 64 * MIB);
        assert!(p.configure(&Config::parse("packed_chunk=lots").unwrap()).is_err());
    }
}
