//! High-watermark reclamation as a wasmem policy.
//!
//! - When the device refuses a segment, release every cached segment (as
//!   PyTorch does); before a pool grows, release nothing.
//! - At a phase marker, when the bytes obtained from the device exceed
//!   `high × capacity`, release cached (reserved but unallocated) bytes down
//!   to the watermark: `min(reserved − high × capacity, reserved − allocated)`.
//!   This returns memory that a phase no longer needs (e.g. activations
//!   cached after backward) before the next phase asks for it, so that a
//!   failed allocation, which stalls, becomes rarer.
//!
//! Configuration (`lifecycle.init`), `key=value` pairs:
//!
//! | key | meaning | default |
//! |---|---|---|
//! | `high` | watermark as a fraction of capacity, in `[0, 1]` | `0.8` |
//! | `phase` | only react to this phase (`forward`, `backward`, `optimizer`, `step_end`), or `any` | `any` |
//!
//! No state.

#![cfg_attr(all(target_arch = "wasm32", not(test)), no_std)]

use wasmem_policy_sdk::prelude::*;

/// The policy.
#[derive(Debug)]
pub struct WatermarkReclaim {
    /// Watermark as a fraction of capacity.
    high: f64,
    /// The phase to react to (`None`: every phase).
    phase: Option<Phase>,
}

impl Default for WatermarkReclaim {
    fn default() -> Self {
        WatermarkReclaim { high: 0.8, phase: None }
    }
}

/// Parses a phase name as traces write it (`any` for every phase).
fn parse_phase(name: &str) -> Result<Option<Phase>, String> {
    Ok(Some(match name {
        "any" => return Ok(None),
        "forward" => Phase::Forward,
        "backward" => Phase::Backward,
        "optimizer" => Phase::Optimizer,
        "step_end" => Phase::StepEnd,
        other => {
            return Err(format!("unknown phase `{other}` (expected forward, backward, optimizer, step_end or any)"))
        }
    }))
}

impl WatermarkReclaim {
    /// The watermark in bytes for a device of `capacity` bytes.
    fn watermark(&self, capacity: u64) -> u64 {
        // Exact for capacities below 2^53 bytes; the cast saturates above.
        (capacity as f64 * self.high) as u64
    }
}

impl Policy for WatermarkReclaim {
    fn name(&self) -> &str {
        "watermark-reclaim"
    }

    fn configure(&mut self, config: &Config) -> Result<(), String> {
        let high: f64 = config.get_or("high", self.high)?;
        if !(0.0..=1.0).contains(&high) {
            return Err(format!("high = {high} is not a fraction between 0 and 1"));
        }
        self.high = high;
        if let Some(name) = config.raw("phase") {
            self.phase = parse_phase(name)?;
        }
        Ok(())
    }
}

impl Reclamation for WatermarkReclaim {
    fn reclaim(&mut self, trigger: &ReclaimTrigger, ctx: &PolicyContext) -> ReclaimDecision {
        let release_bytes = match trigger {
            ReclaimTrigger::AllocFailed(_) => u64::MAX,
            ReclaimTrigger::Grow(_) => 0,
            ReclaimTrigger::Phase(marker) => {
                if self.phase.is_some_and(|p| p != marker.phase) {
                    0
                } else {
                    let excess = ctx.reserved_bytes.saturating_sub(self.watermark(ctx.capacity_bytes));
                    let cached = ctx.reserved_bytes.saturating_sub(ctx.allocated_bytes);
                    excess.min(cached)
                }
            }
        };
        ReclaimDecision { release_bytes, pools: None }
    }
}

export!(WatermarkReclaim: reclamation);

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn ctx(reserved: u64, allocated: u64) -> PolicyContext {
        PolicyContext {
            clock: 0,
            phase: Some(Phase::Backward),
            step: 1,
            live_bytes: allocated,
            allocated_bytes: allocated,
            reserved_bytes: reserved,
            peak_reserved_bytes: reserved,
            capacity_bytes: 100 * MIB,
        }
    }

    fn at(phase: Phase) -> ReclaimTrigger {
        ReclaimTrigger::Phase(PhaseMarker { phase, step: 1 })
    }

    #[test]
    fn releases_down_to_the_watermark() {
        let mut p = WatermarkReclaim::default();
        // 90 MiB reserved, watermark 80 MiB, 30 MiB cached: release 10 MiB.
        let d = p.reclaim(&at(Phase::StepEnd), &ctx(90 * MIB, 60 * MIB));
        assert_eq!(d.release_bytes, 10 * MIB);
        // Only 5 MiB cached: release those.
        let d = p.reclaim(&at(Phase::StepEnd), &ctx(90 * MIB, 85 * MIB));
        assert_eq!(d.release_bytes, 5 * MIB);
        // Below the watermark: nothing.
        let d = p.reclaim(&at(Phase::StepEnd), &ctx(70 * MIB, 10 * MIB));
        assert_eq!(d.release_bytes, 0);
    }

    #[test]
    fn alloc_failure_releases_all() {
        let mut p = WatermarkReclaim::default();
        let t = ReclaimTrigger::AllocFailed(SegmentRequest {
            request: AllocRequest { bytes: MIB, kind: TensorKind::Activation, stream_id: 0 },
            segment_bytes: 2 * MIB,
        });
        assert_eq!(p.reclaim(&t, &ctx(0, 0)).release_bytes, u64::MAX);
        if let ReclaimTrigger::AllocFailed(r) = t {
            let grow = ReclaimTrigger::Grow(r);
            assert_eq!(p.reclaim(&grow, &ctx(90 * MIB, 0)).release_bytes, 0);
        }
    }

    #[test]
    fn configuration() {
        let mut p = WatermarkReclaim::default();
        let c = Config::parse("high=0.5, phase=step_end").unwrap();
        p.configure(&c).unwrap();
        c.check_all_used().unwrap();
        assert_eq!(p.watermark(100 * MIB), 50 * MIB);
        let d = p.reclaim(&at(Phase::Backward), &ctx(90 * MIB, 0));
        assert_eq!(d.release_bytes, 0);
        let d = p.reclaim(&at(Phase::StepEnd), &ctx(90 * MIB, 0));
        assert_eq!(d.release_bytes, 40 * MIB);
        for bad in ["high=1.5", "high=x", "phase=lunch"] {
            let c = Config::parse(bad).unwrap();
            assert!(WatermarkReclaim::default().configure(&c).is_err(), "{bad}");
        }
    }
}
