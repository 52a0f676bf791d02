//! Defragmenting reclamation as a wasmem policy (WIT 0.2.0).
//!
//! Uses every mechanism of the 0.2.0 `reclamation` interface:
//!
//! - **paged segments**: asks the engine to build large segments from
//!   individually mapped pages, so that the two next mechanisms can act;
//! - **stitch** on `grow` and `alloc-failed`: the new segment is built from
//!   free pages of the pool's paged segments (fresh pages only for what is
//!   missing), so free space scattered over segments is reused instead of
//!   reserving more;
//! - **trim** at phase markers: when the cached bytes (reserved − allocated)
//!   exceed `cached_high`, release the excess, also from free whole pages
//!   inside segments that still hold tensors (no device synchronization);
//!   when the device refuses a segment, release everything cached, trimming;
//! - **compaction** (off by default: `compact_fraction=0`) at phase markers: when the fragmentation
//!   `cached / reserved` is at least `frag` (and at least `compact_min` bytes
//!   are reserved), compact pool `compact_pool` moving at most
//!   `compact_fraction × allocated` bytes, once per training step; and, when
//!   `grow_compact_every` is set, on `grow` under the same conditions at most
//!   once per that many allocator operations (for workloads without phase
//!   markers, such as PyTorch snapshots). The engine releases the segments a
//!   compaction empties.
//!
//! The context gives totals, not per-pool figures, so the compaction budget
//! is a fraction of all allocated bytes. The engine refuses a budget above
//! the pool's own allocated bytes (and the whole plan with it): keep
//! `compact_fraction` small (5 % is a good start) and name the pool that holds most
//! bytes (`large` under PyTorch-style placement, which the engine always
//! keeps).
//!
//! Configuration (`lifecycle.init`), `key=value` pairs:
//!
//! | key | meaning | default |
//! |---|---|---|
//! | `paged` | ask for paged segments (`true`/`false`) | `true` |
//! | `stitch` | stitch on `grow` and `alloc-failed` | `true` |
//! | `cached_high` | trim at phase markers down to this many cached bytes (`512MiB`…) | `256MiB` |
//! | `trim_max` | trim at most this many bytes per phase marker, so that no pause is long | `16MiB` |
//! | `phase` | act only at this phase (`forward`, `backward`, `optimizer`, `step_end`) or `any` | `any` |
//! | `frag` | compact when `cached / reserved` is at least this fraction | `0.25` |
//! | `compact_pool` | the pool to compact | `large` |
//! | `compact_fraction` | budget per step, fraction of allocated bytes in `[0, 1]` (0: never compact) | `0` (stitching made it unnecessary on the measured workloads; `0.05` is a good start) |
//! | `compact_min` | do not compact below this many reserved bytes | `64MiB` |
//! | `grow_compact_every` | also compact on `grow`, at most once per this many allocator operations (0: never) | `0` |
//!
//! State: the step of the last compaction at a phase marker and the clock of
//! the last one on growth (16 bytes), carried across swaps so that a
//! successor does not compact again too soon.

#![cfg_attr(all(target_arch = "wasm32", not(test)), no_std)]

use wasmem_policy_sdk::prelude::*;

const MIB: u64 = 1 << 20;

/// The policy.
#[derive(Debug, Clone, PartialEq)]
pub struct DefragReclaim {
    paged: bool,
    stitch: bool,
    cached_high: u64,
    trim_max: u64,
    phase: Option<Phase>,
    frag: f64,
    compact_pool: String,
    compact_fraction: f64,
    compact_min: u64,
    grow_compact_every: u64,
    /// The step of the last compaction at a phase marker.
    last_compaction: Option<u64>,
    /// The clock of the last compaction on growth.
    last_grow_compaction: Option<u64>,
}

impl Default for DefragReclaim {
    fn default() -> Self {
        DefragReclaim {
            paged: true,
            stitch: true,
            cached_high: 256 * MIB,
            trim_max: 16 * MIB,
            phase: None,
            frag: 0.25,
            compact_pool: "large".to_string(),
            compact_fraction: 0.0,
            compact_min: 64 * MIB,
            grow_compact_every: 0,
            last_compaction: None,
            last_grow_compaction: None,
        }
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

fn fraction(config: &Config, key: &str, default: f64) -> Result<f64, String> {
    let v: f64 = config.get_or(key, default)?;
    if (0.0..=1.0).contains(&v) {
        Ok(v)
    } else {
        Err(format!("{key} = {v} is not a fraction between 0 and 1"))
    }
}

impl DefragReclaim {
    /// Nothing to do.
    fn nothing() -> ReclaimPlan {
        ReclaimPlan { release_bytes: 0, pools: None, compact: None, stitch: false, trim: false }
    }

    /// The compaction `ctx` calls for (fragmented enough, enough reserved,
    /// a budget above zero), ignoring how recently the last one ran.
    fn wanted_compaction(&self, ctx: &PolicyContext) -> Option<Compaction> {
        if self.compact_fraction == 0.0 || ctx.reserved_bytes < self.compact_min || ctx.reserved_bytes == 0 {
            return None;
        }
        let cached = ctx.reserved_bytes.saturating_sub(ctx.allocated_bytes);
        if (cached as f64) < self.frag * ctx.reserved_bytes as f64 {
            return None;
        }
        // Never above the allocated bytes (fraction ≤ 1; the cast saturates).
        let budget = ((ctx.allocated_bytes as f64 * self.compact_fraction) as u64).min(ctx.allocated_bytes);
        (budget > 0).then(|| Compaction { pool: self.compact_pool.clone(), max_bytes: budget })
    }

    /// The compaction for a phase marker of `step`: none if one ran in this step.
    fn compaction(&mut self, ctx: &PolicyContext, step: u64) -> Option<Compaction> {
        if self.last_compaction == Some(step) {
            return None;
        }
        let c = self.wanted_compaction(ctx)?;
        self.last_compaction = Some(step);
        Some(c)
    }

    /// The compaction before a segment is obtained: none if switched off or
    /// if one ran fewer than `grow_compact_every` operations ago.
    fn grow_compaction(&mut self, ctx: &PolicyContext) -> Option<Compaction> {
        if self.grow_compact_every == 0 {
            return None;
        }
        if self.last_grow_compaction.is_some_and(|t| ctx.clock.saturating_sub(t) < self.grow_compact_every) {
            return None;
        }
        let c = self.wanted_compaction(ctx)?;
        self.last_grow_compaction = Some(ctx.clock);
        Some(c)
    }
}

impl Policy for DefragReclaim {
    fn name(&self) -> &str {
        "defrag-reclaim"
    }

    fn configure(&mut self, config: &Config) -> Result<(), String> {
        self.paged = config.get_or("paged", self.paged)?;
        self.stitch = config.get_or("stitch", self.stitch)?;
        self.cached_high = config.bytes_or("cached_high", self.cached_high)?;
        self.trim_max = config.bytes_or("trim_max", self.trim_max)?;
        if let Some(name) = config.raw("phase") {
            self.phase = parse_phase(name)?;
        }
        self.frag = fraction(config, "frag", self.frag)?;
        if let Some(pool) = config.raw("compact_pool") {
            if pool.is_empty() {
                return Err("compact_pool is empty".to_string());
            }
            self.compact_pool = pool.to_string();
        }
        self.compact_fraction = fraction(config, "compact_fraction", self.compact_fraction)?;
        self.compact_min = config.bytes_or("compact_min", self.compact_min)?;
        self.grow_compact_every = config.get_or("grow_compact_every", self.grow_compact_every)?;
        Ok(())
    }

    fn save_state(&self) -> Vec<u8> {
        let mut state = self.last_compaction.unwrap_or(u64::MAX).to_le_bytes().to_vec();
        state.extend_from_slice(&self.last_grow_compaction.unwrap_or(u64::MAX).to_le_bytes());
        state
    }

    fn load_state(&mut self, state: &[u8]) -> Result<(), String> {
        if state.is_empty() {
            return Ok(());
        }
        if state.len() != 16 {
            return Err(format!(
                "defrag-reclaim state is 16 bytes (the step and the clock of the last compactions), got {}",
                state.len()
            ));
        }
        let word = |i: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&state[i * 8..i * 8 + 8]);
            let v = u64::from_le_bytes(b);
            (v != u64::MAX).then_some(v)
        };
        self.last_compaction = word(0);
        self.last_grow_compaction = word(1);
        Ok(())
    }
}

impl Reclamation for DefragReclaim {
    fn plan(&mut self, trigger: &ReclaimTrigger, ctx: &PolicyContext) -> ReclaimPlan {
        match trigger {
            ReclaimTrigger::AllocFailed(_) => {
                ReclaimPlan { release_bytes: u64::MAX, pools: None, compact: None, stitch: self.stitch, trim: true }
            }
            ReclaimTrigger::Grow(_) => {
                ReclaimPlan { stitch: self.stitch, compact: self.grow_compaction(ctx), ..Self::nothing() }
            }
            ReclaimTrigger::Phase(marker) => {
                if self.phase.is_some_and(|p| p != marker.phase) {
                    return Self::nothing();
                }
                let cached = ctx.reserved_bytes.saturating_sub(ctx.allocated_bytes);
                let release_bytes = cached.saturating_sub(self.cached_high).min(self.trim_max);
                let compact = self.compaction(ctx, marker.step);
                ReclaimPlan { release_bytes, pools: None, compact, stitch: false, trim: release_bytes > 0 }
            }
        }
    }

    fn paged_segments(&self) -> bool {
        self.paged
    }
}

export!(DefragReclaim: reclamation);

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx(reserved: u64, allocated: u64) -> PolicyContext {
        PolicyContext {
            clock: 0,
            phase: Some(Phase::Backward),
            step: 1,
            live_bytes: allocated,
            allocated_bytes: allocated,
            reserved_bytes: reserved,
            peak_reserved_bytes: reserved,
            capacity_bytes: 80 << 30,
        }
    }

    fn at(phase: Phase, step: u64) -> ReclaimTrigger {
        ReclaimTrigger::Phase(PhaseMarker { phase, step })
    }

    fn segment() -> SegmentRequest {
        SegmentRequest {
            request: AllocRequest { bytes: 3 * MIB, kind: TensorKind::Activation, stream_id: 0 },
            segment_bytes: 20 * MIB,
        }
    }

    fn configured(text: &str) -> DefragReclaim {
        let mut p = DefragReclaim::default();
        let c = Config::parse(text).unwrap();
        p.configure(&c).unwrap();
        c.check_all_used().unwrap();
        p
    }

    #[test]
    fn stitches_on_growth_and_failure() {
        let mut p = DefragReclaim::default();
        assert!(p.paged_segments());
        let d = p.plan(&ReclaimTrigger::Grow(segment()), &ctx(GIB, GIB / 2));
        assert_eq!(d, ReclaimPlan { stitch: true, ..DefragReclaim::nothing() });
        let d = p.plan(&ReclaimTrigger::AllocFailed(segment()), &ctx(GIB, GIB / 2));
        assert_eq!((d.release_bytes, d.stitch, d.trim, d.compact), (u64::MAX, true, true, None));
        let mut p = configured("stitch=false paged=false");
        assert!(!p.paged_segments());
        assert!(!p.plan(&ReclaimTrigger::Grow(segment()), &ctx(GIB, 0)).stitch);
    }

    const GIB: u64 = 1 << 30;

    #[test]
    fn trims_the_cache_above_the_watermark() {
        let mut p = configured("compact_fraction=0 trim_max=1GiB");
        // 1 GiB reserved, 600 MiB allocated: 424 MiB cached, 168 MiB above 256 MiB.
        let d = p.plan(&at(Phase::StepEnd, 1), &ctx(GIB, 600 * MIB));
        assert_eq!((d.release_bytes, d.trim, d.stitch), (168 * MIB, true, false));
        // By default at most 16 MiB per marker.
        let d = configured("compact_fraction=0").plan(&at(Phase::StepEnd, 1), &ctx(GIB, 600 * MIB));
        assert_eq!(d.release_bytes, 16 * MIB);
        // Below the watermark: nothing, and no trimming.
        let d = p.plan(&at(Phase::StepEnd, 1), &ctx(GIB, 900 * MIB));
        assert_eq!(d, DefragReclaim::nothing());
        let mut p = configured("cached_high=0 trim_max=1GiB compact_fraction=0 phase=optimizer");
        assert_eq!(p.plan(&at(Phase::Backward, 1), &ctx(GIB, 0)), DefragReclaim::nothing());
        assert_eq!(p.plan(&at(Phase::Optimizer, 1), &ctx(GIB, 0)).release_bytes, GIB);
    }

    #[test]
    fn compacts_a_fragmented_pool_once_per_step_within_budget() {
        let mut p = configured("cached_high=4GiB compact_fraction=0.05");
        // 40 % cached: fragmented. Budget 5 % of 600 MiB = 30 MiB.
        let d = p.plan(&at(Phase::Forward, 3), &ctx(GIB, 600 * MIB));
        let c = d.compact.expect("a compaction");
        assert_eq!(c.pool, "large");
        assert_eq!(c.max_bytes, 30 * MIB);
        assert!(c.max_bytes * 20 <= 600 * MIB);
        assert_eq!(d.release_bytes, 0);
        // Not twice in the same step, again in the next.
        assert!(p.plan(&at(Phase::Backward, 3), &ctx(GIB, 600 * MIB)).compact.is_none());
        assert!(p.plan(&at(Phase::Forward, 4), &ctx(GIB, 600 * MIB)).compact.is_some());
        // Not fragmented (10 % cached), too small, or switched off.
        assert!(p.plan(&at(Phase::Forward, 5), &ctx(GIB, 920 * MIB)).compact.is_none());
        assert!(p.plan(&at(Phase::Forward, 6), &ctx(32 * MIB, 8 * MIB)).compact.is_none());
        assert!(p.plan(&at(Phase::Forward, 7), &ctx(GIB, 0)).compact.is_none(), "nothing allocated, nothing to move");
        let mut off = configured("compact_fraction=0 cached_high=4GiB");
        assert!(off.plan(&at(Phase::Forward, 1), &ctx(GIB, 600 * MIB)).compact.is_none());
        let mut other = configured("compact_pool=act frag=0.5 compact_fraction=0.01");
        assert!(other.plan(&at(Phase::Forward, 1), &ctx(GIB, 600 * MIB)).compact.is_none(), "40 % < 50 %");
        let c = other.plan(&at(Phase::Forward, 1), &ctx(GIB, 400 * MIB)).compact.unwrap();
        assert_eq!((c.pool.as_str(), c.max_bytes), ("act", 4 * MIB));
    }

    #[test]
    fn the_budget_never_exceeds_the_allocated_bytes() {
        let mut p = configured("compact_fraction=1 frag=0 compact_min=0");
        for (reserved, allocated) in [(1, 1), (GIB, GIB), (u64::MAX, u64::MAX - 1), (3 * MIB, 1)] {
            let d = p.plan(&at(Phase::Forward, reserved ^ allocated), &ctx(reserved, allocated));
            assert!(d.compact.is_none_or(|c| c.max_bytes <= allocated), "{reserved} {allocated}");
        }
    }

    #[test]
    fn state_carries_the_last_compaction() {
        let mut p = configured("cached_high=4GiB compact_fraction=0.05");
        assert!(p.plan(&at(Phase::Forward, 9), &ctx(GIB, 600 * MIB)).compact.is_some());
        let state = p.save_state();
        let mut q = DefragReclaim::default();
        q.load_state(&state).unwrap();
        assert_eq!(q.last_compaction, Some(9));
        assert!(q.plan(&at(Phase::Backward, 9), &ctx(GIB, 600 * MIB)).compact.is_none());
        let mut fresh = DefragReclaim::default();
        fresh.load_state(&DefragReclaim::default().save_state()).unwrap();
        assert_eq!(fresh.last_compaction, None);
        assert!(fresh.load_state(&[]).is_ok());
        assert!(fresh.load_state(&[1, 2, 3]).unwrap_err().contains("16 bytes"));
    }

    #[test]
    fn compacts_on_growth_when_asked_at_most_once_per_interval() {
        let grow = ReclaimTrigger::Grow(segment());
        let at_clock = |clock, allocated| PolicyContext { clock, ..ctx(GIB, allocated) };
        let mut p = DefragReclaim::default();
        assert!(p.plan(&grow, &at_clock(0, 600 * MIB)).compact.is_none(), "off by default");
        let mut p = configured("grow_compact_every=100 compact_fraction=0.05");
        let d = p.plan(&grow, &at_clock(1000, 600 * MIB));
        assert_eq!(d.compact, Some(Compaction { pool: "large".to_string(), max_bytes: 30 * MIB }));
        assert!(d.stitch && d.release_bytes == 0);
        assert!(p.plan(&grow, &at_clock(1099, 600 * MIB)).compact.is_none(), "too soon");
        assert!(p.plan(&grow, &at_clock(1100, 920 * MIB)).compact.is_none(), "not fragmented");
        assert!(p.plan(&grow, &at_clock(1100, 600 * MIB)).compact.is_some());
        // Phase compactions are counted apart.
        assert!(p.plan(&at(Phase::Forward, 1), &at_clock(1101, 600 * MIB)).compact.is_some());
        let mut q = DefragReclaim::default();
        q.load_state(&p.save_state()).unwrap();
        assert_eq!((q.last_compaction, q.last_grow_compaction), (Some(1), Some(1100)));
    }

    #[test]
    fn configuration_errors() {
        for bad in [
            "frag=1.5",
            "frag=x",
            "phase=lunch",
            "cached_high=1.5GiB",
            "compact_fraction=-0.1",
            "compact_pool=",
            "paged=yes",
        ] {
            let c = Config::parse(bad).unwrap();
            assert!(DefragReclaim::default().configure(&c).is_err(), "{bad}");
        }
    }
}
