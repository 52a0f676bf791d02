//! `defrag`: lifecycle pools whose large segments are paged, so that free
//! memory is traded by pages instead of by whole segments.
//!
//! - Before a pool grows, its new segment is stitched from the whole free
//!   pages of every pool (GMLake): memory that lies free in holes between
//!   live tensors serves the request without a copy and without new device
//!   memory. Pools that are not paged (the 2 MiB segments of small tensors)
//!   still give their entirely free segments back first, as in `lifecycle`.
//! - At the end of a step, cached memory above half of the reserved bytes is
//!   trimmed (free pages unmapped, at most 16 MiB per step so that no pause
//!   is long), never synchronizing the device.
//! - On a failed device allocation everything cached goes, pages included,
//!   and the request is stitched.

use super::lifecycle::LifecycleReclamation;
use crate::decision::{PolicyContext, PolicyError, ReclaimDecision, ReclaimTrigger, ReclamationPolicy};
use crate::types::{Phase, MIB};

/// The reclamation half of `defrag` (placement is `lifecycle`'s, with its
/// growth chunks scaled to the footprint: [`super::LifecyclePlacement::scaled`]).
#[derive(Debug, Clone, Copy)]
pub struct DefragReclamation {
    /// Cached bytes kept at a step end, as a fraction of reserved bytes
    /// (above it the excess is trimmed, at most `max_trim_bytes` per step so
    /// that no pause is long); `1.0` never trims.
    pub keep_fraction: f64,
    /// Most bytes trimmed at one step end.
    pub max_trim_bytes: u64,
    /// Before a growth, also give back the entirely free segments of the
    /// other pools (as `lifecycle` does; costs device frees, which
    /// synchronize for unpaged segments).
    pub release_others: bool,
}

impl Default for DefragReclamation {
    fn default() -> Self {
        DefragReclamation { keep_fraction: 0.5, max_trim_bytes: 16 * MIB, release_others: false }
    }
}

/// The lifecycle pools whose segments are paged (at least two pages).
const PAGED_POOLS: [&str; 3] = ["persistent", "step", "transient"];

impl ReclamationPolicy for DefragReclamation {
    fn name(&self) -> &str {
        "defrag"
    }

    fn paged_segments(&self) -> bool {
        true
    }

    fn reclaim(&mut self, trigger: &ReclaimTrigger, ctx: &PolicyContext) -> Result<ReclaimDecision, PolicyError> {
        Ok(match trigger {
            ReclaimTrigger::Grow { .. } if self.release_others => {
                let mut d = LifecycleReclamation.reclaim(trigger, ctx)?;
                d.stitch = true;
                d
            }
            // Free pages of every pool serve the growth.
            ReclaimTrigger::Grow { .. } => ReclaimDecision { stitch: true, ..ReclaimDecision::none() },
            ReclaimTrigger::AllocFailed { .. } => {
                ReclaimDecision { stitch: true, trim: true, ..ReclaimDecision::all() }
            }
            ReclaimTrigger::Phase { phase: Phase::StepEnd, .. } => {
                let cached = ctx.reserved_bytes.saturating_sub(ctx.allocated_bytes);
                let keep = (ctx.reserved_bytes as f64 * self.keep_fraction.clamp(0.0, 1.0)) as u64;
                if cached > keep {
                    ReclaimDecision {
                        release_bytes: (cached - keep).min(self.max_trim_bytes),
                        pools: Some(PAGED_POOLS.iter().map(|p| p.to_string()).collect()),
                        trim: true,
                        ..ReclaimDecision::none()
                    }
                } else {
                    ReclaimDecision::none()
                }
            }
            ReclaimTrigger::Phase { .. } => ReclaimDecision::none(),
        })
    }
}
