//! Lifecycle-aware placement as a wasmem policy: tensors of different
//! expected lifetimes never share a segment.
//!
//! A port of the engine's native `lifecycle` policy set
//! (`host/src/builtin/lifecycle.rs` for placement, PyTorch's reclamation),
//! decision for decision.
//!
//! Classes: *persistent* (parameters, optimizer states: allocated once, live
//! for the run), *per-step* (gradients: born in backward, dead after the
//! optimizer step), *transient* (activations, temporaries, everything else).
//! Each class has a pool for small requests (≤ 1 MiB, 2 MiB segments) and
//! one for larger ones:
//! - persistent and per-step blocks are not freed out of order within a
//!   step, so they are packed tightly: every block splits (≥ 512 B remain)
//!   and segments grow by at least `packed_chunk` bytes;
//! - transient blocks churn, so segments are sized to the request (rounded to
//!   2 MiB) and a block is split only when more than 1 MiB would remain.
//!
//! Configuration (`lifecycle.init`): `packed_chunk=SIZE` (bytes, or with a
//! KiB/MiB/GiB suffix; default `20MiB`). Reclamation: PyTorch's (release all
//! cached segments when the device refuses one). No state.

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

/// Pool names, indexed by `2 × class + (large ? 1 : 0)`.
const POOLS: [&str; 6] = ["persistent.small", "persistent", "step.small", "step", "transient.small", "transient"];

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
        let base = match class {
            LifecycleClass::Persistent => 0,
            LifecycleClass::PerStep => 2,
            LifecycleClass::Transient => 4,
        };
        let pool = base + u32::from(!small);
        let (segment_min, split_min_remainder) = if small {
            (2 * MIB, 512)
        } else if class == LifecycleClass::Transient {
            (0, MIB + 1)
        } else {
            (self.packed_chunk, 512)
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
            cacheable: !(MIB..2 * MIB).contains(&req.bytes),
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

impl Reclamation for Lifecycle {}

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
        assert_eq!((d.pool, d.segment_min, d.split_min_remainder), (0, 2 * MIB, 512));
        let d = p.decide(&req(4 * MIB, TensorKind::Optim));
        assert_eq!((d.pool, d.segment_min, d.split_min_remainder), (1, 20 * MIB, 512));
        let d = p.decide(&req(MIB, TensorKind::Grad));
        assert_eq!(d.pool, 2);
        let d = p.decide(&req(MIB + 1, TensorKind::Grad));
        assert_eq!((d.pool, d.segment_min), (3, 20 * MIB));
        let d = p.decide(&req(64 * MIB, TensorKind::Activation));
        assert_eq!((d.pool, d.segment_min, d.split_min_remainder), (5, 0, MIB + 1));
        assert_eq!(p.decide(&req(1, TensorKind::Other)).pool, 4);
        assert_eq!(p.pools().len(), 6);
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
