//! The full consistency scan: each part's own check, then the invariants
//! that tie the parts together.

use super::stats::Gauges;
use super::{Allocator, InvariantError};
use crate::device::Device;
use crate::types::Tier;

impl<D: Device> Allocator<D> {
    /// Checks every invariant of the module documentation by a full recount;
    /// returns the first violation found. Cost: O(blocks + tensors).
    pub fn check_invariants(&self) -> Result<(), InvariantError> {
        let bad = |m: String| InvariantError(m);
        // The arena, with each allocated block checked against the handle table.
        let mut per_pool = self.arena.check(|b, blk| {
            let (id, t) = self
                .tensors
                .by_slot(blk.tensor)
                .ok_or_else(|| bad(format!("block {b} holds dead tensor slot {}", blk.tensor)))?;
            if t.block != b {
                return Err(bad(format!("{id} maps to block {} but block {b} holds it", t.block)));
            }
            if t.bytes > blk.size {
                return Err(bad(format!("{id} of {} bytes is in a block of {}", t.bytes, blk.size)));
            }
            Ok(t.bytes)
        })?;
        // Handles: every device tensor's block holds it; pins name live tensors.
        for (id, t) in self.tensors.iter() {
            if t.tier != Tier::Device {
                continue; // checked by check_tiers
            }
            match self.arena.blocks.try_get(t.block) {
                Some(b) if b.tensor == id.slot => {}
                _ => return Err(bad(format!("{id} does not map to a block that holds it"))),
            }
        }
        for (&slot, &n) in &self.tensors.pins {
            if n == 0 || self.tensors.by_slot(slot).is_none() {
                return Err(bad(format!("pin count {n} on slot {slot}, which holds no live tensor")));
            }
        }
        // An aliased planned arena's second window holds no memory of its own.
        for (pool, window) in self.aliased_windows() {
            per_pool[pool as usize].reserved_bytes -= window;
        }
        // Gauges: per pool and in total, against the recount.
        let mut total = Gauges::default();
        for (p, c) in self.arena.pools.iter().zip(&per_pool) {
            let g = &p.gauges;
            if (g.live_bytes, g.allocated_bytes, g.reserved_bytes, g.segments)
                != (c.live_bytes, c.allocated_bytes, c.reserved_bytes, c.segments)
            {
                return Err(bad(format!("pool {} gauges {g:?} disagree with recount {c:?}", p.name)));
            }
            check_peaks(g).map_err(|e| bad(format!("pool {}: {e}", p.name)))?;
            total.live_bytes += c.live_bytes;
            total.allocated_bytes += c.allocated_bytes;
            total.reserved_bytes += c.reserved_bytes;
            total.segments += c.segments;
        }
        // Spare pages are reserved outside any pool.
        total.reserved_bytes += self.paging.spare_counted;
        let g = &self.stats.bytes;
        if (g.live_bytes, g.allocated_bytes, g.reserved_bytes, g.segments)
            != (total.live_bytes, total.allocated_bytes, total.reserved_bytes, total.segments)
        {
            return Err(bad(format!("gauges {g:?} disagree with recount {total:?}")));
        }
        check_peaks(g).map_err(bad)?;
        if g.reserved_bytes > self.device.capacity() {
            return Err(bad("reserved exceeds the device capacity".into()));
        }
        // The other parts.
        self.check_pending().map_err(bad)?;
        self.check_tiers().map_err(bad)?;
        self.paging.check(&self.arena.segments, self.device.granularity()).map_err(bad)?;
        self.check_planning()
    }
}

fn check_peaks(g: &Gauges) -> Result<(), String> {
    if !(g.live_bytes <= g.allocated_bytes && g.allocated_bytes <= g.reserved_bytes) {
        return Err(format!("live ≤ allocated ≤ reserved does not hold: {g:?}"));
    }
    if g.peak_live_bytes < g.live_bytes
        || g.peak_allocated_bytes < g.allocated_bytes
        || g.peak_reserved_bytes < g.reserved_bytes
    {
        return Err(format!("a peak is below its gauge: {g:?}"));
    }
    Ok(())
}
