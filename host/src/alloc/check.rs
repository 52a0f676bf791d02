//! The full consistency scan of the allocator's invariants.

use rustc_hash::FxHashSet;

use super::deferred::PENDING;
use super::slab::NIL;
use super::stats::Gauges;
use super::Allocator;
use crate::device::Device;

impl<D: Device> Allocator<D> {
    /// Checks every invariant of the module documentation by a full recount;
    /// returns the first violation found. Cost: O(blocks + tensors).
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut per_pool = vec![Gauges::default(); self.pools.len()];
        let mut seen_blocks = FxHashSet::default();
        let mut free_count = vec![0usize; self.pools.len()];
        for (si, s) in self.segments.iter() {
            let pool = s.pool as usize;
            if pool >= self.pools.len() {
                return Err(format!("segment {si} names pool {pool} that does not exist"));
            }
            per_pool[pool].reserved_bytes += s.size;
            per_pool[pool].segments += 1;
            let mut offset = 0u64;
            let mut prev = NIL;
            let mut prev_free = false;
            let mut b = s.first;
            if b == NIL {
                return Err(format!("segment {si} has no blocks"));
            }
            while b != NIL {
                let blk = self.blocks.try_get(b).ok_or_else(|| format!("segment {si} links to dead block {b}"))?;
                if !seen_blocks.insert(b) {
                    return Err(format!("block {b} is linked twice"));
                }
                if blk.segment != si {
                    return Err(format!("block {b} says segment {} but is in segment {si}", blk.segment));
                }
                if blk.prev != prev {
                    return Err(format!("block {b}: prev link {} should be {prev}", blk.prev));
                }
                if blk.offset != offset {
                    return Err(format!("block {b}: offset {} leaves a gap or overlap at {offset}", blk.offset));
                }
                if blk.size == 0 {
                    return Err(format!("block {b} is empty"));
                }
                let key = (s.stream, blk.size, s.base + blk.offset, b);
                if blk.is_free() {
                    if prev_free {
                        return Err(format!("blocks {prev} and {b} are neighbours and both free"));
                    }
                    if !self.pools[pool].free.contains(&key) {
                        return Err(format!("free block {b} is missing from pool {}'s index", self.pools[pool].name));
                    }
                    free_count[pool] += 1;
                } else if blk.tensor == PENDING {
                    if self.pools[pool].free.contains(&key) {
                        return Err(format!("pending block {b} is in pool {}'s free index", self.pools[pool].name));
                    }
                } else {
                    let (id, t) = self
                        .tensors
                        .by_slot(blk.tensor)
                        .ok_or_else(|| format!("block {b} holds dead tensor slot {}", blk.tensor))?;
                    if t.block != b {
                        return Err(format!("{id} maps to block {} but block {b} holds it", t.block));
                    }
                    if t.bytes > blk.size {
                        return Err(format!("{id} of {} bytes is in a block of {}", t.bytes, blk.size));
                    }
                    per_pool[pool].live_bytes += t.bytes;
                    per_pool[pool].allocated_bytes += blk.size;
                }
                prev_free = blk.is_free();
                offset += blk.size;
                prev = b;
                b = blk.next;
            }
            if offset != s.size {
                return Err(format!("blocks of segment {si} cover {offset} of {} bytes", s.size));
            }
        }
        if seen_blocks.len() != self.blocks.len() {
            return Err(format!("{} blocks exist but {} are linked", self.blocks.len(), seen_blocks.len()));
        }
        for (id, t) in self.tensors.iter() {
            if t.tier != crate::types::Tier::Device {
                continue; // checked by check_tiers
            }
            match self.blocks.try_get(t.block) {
                Some(b) if b.tensor == id.slot => {}
                _ => return Err(format!("{id} does not map to a block that holds it")),
            }
        }
        let mut total = Gauges::default();
        for (i, p) in self.pools.iter().enumerate() {
            p.free.check().map_err(|e| format!("pool {}: {e}", p.name))?;
            if p.free.len() != free_count[i] {
                return Err(format!(
                    "pool {} indexes {} free blocks but {} exist",
                    p.name,
                    p.free.len(),
                    free_count[i]
                ));
            }
            let c = &per_pool[i];
            let g = &p.gauges;
            if (g.live_bytes, g.allocated_bytes, g.reserved_bytes, g.segments)
                != (c.live_bytes, c.allocated_bytes, c.reserved_bytes, c.segments)
            {
                return Err(format!("pool {} gauges {g:?} disagree with recount {c:?}", p.name));
            }
            check_peaks(g).map_err(|e| format!("pool {}: {e}", p.name))?;
            total.live_bytes += c.live_bytes;
            total.allocated_bytes += c.allocated_bytes;
            total.reserved_bytes += c.reserved_bytes;
            total.segments += c.segments;
        }
        let g = &self.stats.bytes;
        if (g.live_bytes, g.allocated_bytes, g.reserved_bytes, g.segments)
            != (total.live_bytes, total.allocated_bytes, total.reserved_bytes, total.segments)
        {
            return Err(format!("gauges {g:?} disagree with recount {total:?}"));
        }
        check_peaks(g)?;
        self.check_pending()?;
        self.check_tiers()?;
        for (&slot, &n) in &self.pins {
            if n == 0 || self.tensors.by_slot(slot).is_none() {
                return Err(format!("pin count {n} on slot {slot}, which holds no live tensor"));
            }
        }
        if self.cross_uses.keys().any(|&slot| self.tensors.by_slot(slot).is_none()) {
            return Err("cross-stream uses recorded for a dead tensor".into());
        }
        if g.reserved_bytes > self.device.capacity() {
            return Err("reserved exceeds the device capacity".into());
        }
        Ok(())
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
