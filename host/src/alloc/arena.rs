//! The arena: segments obtained from the device, the blocks that tile them,
//! and the pools whose free indices serve requests.
//!
//! Invariants (checked by [`Arena::check`]):
//! - the blocks of a segment tile it without gaps or overlap, in address
//!   order, with mutual `prev`/`next` links; every block is in exactly one
//!   segment's list and every segment has at least one block;
//! - no two neighbouring blocks are both free;
//! - a block is free ⇔ it is in its pool's free index under its current key
//!   `(stream, size, address, block)`; a pending block (see `deferred`) is
//!   in no index;
//! - per pool, `reserved = Σ segment sizes` and `segments = |segments|`.

use super::deferred::PENDING;
use super::pool::Pool;
use super::slab::{Block, Segment, Slab, NIL};
use super::stats::Gauges;
use super::InvariantError;

/// Segments, blocks and pools.
#[derive(Debug, Default)]
pub(crate) struct Arena {
    /// Blocks, by index.
    pub blocks: Slab<Block>,
    /// Segments, by index.
    pub segments: Slab<Segment>,
    /// Pools, by engine pool index (append-only; matched by name).
    pub pools: Vec<Pool>,
}

impl Arena {
    /// Checks the arena's invariants. `holder(block, tensor slot)` checks an
    /// allocated block against the handle table and returns the requested
    /// bytes it holds. Returns the recounted gauges per pool.
    pub fn check(
        &self,
        mut holder: impl FnMut(u32, &Block) -> Result<u64, InvariantError>,
    ) -> Result<Vec<Gauges>, InvariantError> {
        let bad = |m: String| Err(InvariantError(m));
        let mut per_pool = vec![Gauges::default(); self.pools.len()];
        let mut linked = 0usize;
        let mut seen = vec![false; self.blocks.capacity()];
        let mut free_count = vec![0usize; self.pools.len()];
        for (si, s) in self.segments.iter() {
            let pool = s.pool as usize;
            if pool >= self.pools.len() {
                return bad(format!("segment {si} names pool {pool} that does not exist"));
            }
            per_pool[pool].reserved_bytes += s.size;
            per_pool[pool].segments += 1;
            let (mut offset, mut prev, mut prev_free, mut b) = (0u64, NIL, false, s.first);
            if b == NIL {
                return bad(format!("segment {si} has no blocks"));
            }
            while b != NIL {
                let Some(blk) = self.blocks.try_get(b) else {
                    return bad(format!("segment {si} links to dead block {b}"));
                };
                if std::mem::replace(&mut seen[b as usize], true) {
                    return bad(format!("block {b} is linked twice"));
                }
                linked += 1;
                if blk.segment != si {
                    return bad(format!("block {b} says segment {} but is in segment {si}", blk.segment));
                }
                if blk.prev != prev {
                    return bad(format!("block {b}: prev link {} should be {prev}", blk.prev));
                }
                if blk.offset != offset {
                    return bad(format!("block {b}: offset {} leaves a gap or overlap at {offset}", blk.offset));
                }
                if blk.size == 0 {
                    return bad(format!("block {b} is empty"));
                }
                let key = (s.stream, blk.size, s.base + blk.offset, b);
                let p = &self.pools[pool];
                if blk.is_free() {
                    if prev_free {
                        return bad(format!("blocks {prev} and {b} are neighbours and both free"));
                    }
                    if p.planned {
                        // Arena blocks are in their arena's free map (checked by
                        // `check_planning`), never in a free index.
                        if p.free.contains(&key) {
                            return bad(format!("arena block {b} is in a free index"));
                        }
                    } else if !p.free.contains(&key) {
                        return bad(format!("free block {b} is missing from pool {}'s index", p.name));
                    }
                    if !p.planned {
                        free_count[pool] += 1;
                    }
                } else if blk.tensor == PENDING {
                    if p.free.contains(&key) {
                        return bad(format!("pending block {b} is in pool {}'s free index", p.name));
                    }
                } else {
                    per_pool[pool].live_bytes += holder(b, blk)?;
                    per_pool[pool].allocated_bytes += blk.size;
                }
                prev_free = blk.is_free();
                offset += blk.size;
                prev = b;
                b = blk.next;
            }
            if offset != s.size {
                return bad(format!("blocks of segment {si} cover {offset} of {} bytes", s.size));
            }
        }
        if linked != self.blocks.len() {
            return bad(format!("{} blocks exist but {linked} are linked", self.blocks.len()));
        }
        for (i, p) in self.pools.iter().enumerate() {
            p.free.check().map_err(|e| InvariantError(format!("pool {}: {e}", p.name)))?;
            if p.free.len() != free_count[i] {
                return bad(format!(
                    "pool {} indexes {} free blocks but {} exist",
                    p.name,
                    p.free.len(),
                    free_count[i]
                ));
            }
        }
        Ok(per_pool)
    }
}
