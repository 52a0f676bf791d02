//! Compaction: moving live blocks out of sparse segments so that the emptied
//! segments can be released.
//!
//! [`Allocator::compact`] takes the segments of one pool and one stream,
//! sparsest first, and moves each live, unpinned block of a source segment
//! into the best-fitting free block of a denser segment of the same pool and
//! stream (a device-to-device copy on the tensor's stream). The tensor keeps
//! its [`TensorId`](crate::types::TensorId); only its address changes. A source
//! segment left entirely free is released. A byte budget bounds the copies.
//!
//! Pinned tensors (see [`Allocator::pin`]) and pending blocks never move, so a
//! segment holding one is never emptied. Everything else keeps the module
//! invariants of the allocator: moving a block is an allocation in the target
//! and a free in the source of the same block size, so the gauges do not change.

use super::slab::{Block, NIL};
use super::{AllocError, Allocator};
use crate::device::Device;
use crate::types::{StreamId, TensorId};

impl<D: Device> Allocator<D> {
    /// Pins a live tensor: compaction (and eviction) will not move it until
    /// the matching [`Allocator::unpin`]. Pins nest.
    /// A tensor off the device is brought back first.
    pub fn pin(&mut self, id: TensorId) -> Result<(), AllocError> {
        self.ensure_resident(id)?;
        *self.tensors.pins.entry(id.slot).or_insert(0) += 1;
        Ok(())
    }

    /// Undoes one [`Allocator::pin`]; unpinning a tensor that is not pinned
    /// does nothing.
    pub fn unpin(&mut self, id: TensorId) -> Result<(), AllocError> {
        self.tensors.get(id).ok_or(AllocError::UnknownTensor(id))?;
        if let Some(n) = self.tensors.pins.get_mut(&id.slot) {
            *n -= 1;
            if *n == 0 {
                self.tensors.pins.remove(&id.slot);
            }
        }
        Ok(())
    }

    /// Whether a live tensor is pinned.
    pub fn is_pinned(&self, id: TensorId) -> bool {
        self.tensors.get(id).is_some() && self.tensors.pins.contains_key(&id.slot)
    }

    /// Moves live blocks of pool `pool` out of its sparsest segments into free
    /// blocks of its other segments on the same stream, copying at most
    /// `byte_budget` bytes, then releases the segments left empty. Returns
    /// the bytes moved. An unknown pool is an error and changes nothing.
    pub fn compact(&mut self, pool: &str, byte_budget: u64) -> Result<u64, AllocError> {
        let p =
            self.arena.pools.iter().position(|x| x.name == pool).ok_or_else(|| AllocError::UnknownPool(pool.into()))?;
        if self.arena.pools[p].planned || self.stable_addresses {
            // Planned arenas keep their blocks where the plan put them;
            // stable addresses never move.
            return Ok(0);
        }
        let p = p as u32;
        let mut streams: Vec<StreamId> =
            self.arena.segments.iter().filter(|(_, s)| s.pool == p).map(|(_, s)| s.stream).collect();
        streams.sort();
        streams.dedup();
        let t0 = self.device.counters().time_us;
        let mut moved = 0u64;
        let mut released = 0u64;
        for stream in streams {
            let (m, r) = self.compact_stream(p, stream, byte_budget - moved)?;
            moved += m;
            released += r;
            if moved >= byte_budget {
                break;
            }
        }
        self.stats.moved_bytes += moved;
        if moved > 0 {
            self.stats.compactions += 1;
        }
        if released > 0 {
            self.stats.reclaimed_bytes += released;
            self.record_pause(t0);
        }
        Ok(moved)
    }

    /// Bytes of blocks holding tensors in a segment.
    fn segment_used(&self, seg: u32) -> u64 {
        let mut used = 0;
        let mut b = self.arena.segments.get(seg).first;
        while b != NIL {
            let blk = self.arena.blocks.get(b);
            if !blk.is_free() {
                used += blk.size;
            }
            b = blk.next;
        }
        used
    }

    /// Compacts the segments of one pool and stream; returns (moved, released) bytes.
    fn compact_stream(&mut self, pool: u32, stream: StreamId, budget: u64) -> Result<(u64, u64), AllocError> {
        let mut order: Vec<(u64, u64, u32)> = self
            .arena
            .segments
            .iter()
            .filter(|(_, s)| s.pool == pool && s.stream == stream)
            .map(|(i, s)| (self.segment_used(i), s.base, i))
            .collect();
        // Sparsest first; targets are the segments after the source in this order.
        order.sort();
        let mut moved = 0u64;
        let mut released = 0u64;
        for (k, &(used, _, src)) in order.iter().enumerate() {
            if used == 0 {
                continue;
            }
            let targets: Vec<u32> = order[k + 1..].iter().map(|&(_, _, s)| s).collect();
            if targets.is_empty() {
                break;
            }
            // Move the first live block until none is left or one cannot move.
            // (A move may merge and remove blocks, so the walk restarts each time.)
            while let Some(seg) = self.arena.segments.try_get(src).copied() {
                let mut b = seg.first;
                while b != NIL && self.arena.blocks.get(b).is_free() {
                    b = self.arena.blocks.get(b).next;
                }
                if b == NIL {
                    let first = *self.arena.blocks.get(seg.first);
                    self.arena.pools[pool as usize].free.remove(&(seg.stream, first.size, seg.base, seg.first));
                    self.release_segment(src)?;
                    released += seg.size;
                    break;
                }
                let blk = *self.arena.blocks.get(b);
                let movable =
                    self.tensors.by_slot(blk.tensor).is_some() && !self.tensors.pins.contains_key(&blk.tensor);
                if !movable || moved + blk.size > budget {
                    break;
                }
                let Some(dst) = self.find_target(&targets, blk.size) else { break };
                self.move_block(b, dst, stream)?;
                moved += blk.size;
            }
            if moved >= budget {
                break;
            }
        }
        Ok((moved, released))
    }

    /// The smallest free block of at least `size` bytes in `targets` (lowest address among equals).
    fn find_target(&self, targets: &[u32], size: u64) -> Option<u32> {
        let mut best: Option<(u64, u64, u32)> = None;
        for &t in targets {
            let seg = self.arena.segments.get(t);
            let mut b = seg.first;
            while b != NIL {
                let blk = self.arena.blocks.get(b);
                if blk.is_free() && blk.size >= size {
                    let key = (blk.size, seg.base + blk.offset, b);
                    if best.is_none_or(|x| key < x) {
                        best = Some(key);
                    }
                }
                b = blk.next;
            }
        }
        best.map(|(_, _, b)| b)
    }

    /// Moves the tensor in block `src` into the free block `dst` (split to
    /// size), copying its bytes on `stream`; `src` returns to its pool.
    fn move_block(&mut self, src: u32, dst: u32, stream: StreamId) -> Result<(), AllocError> {
        let s = *self.arena.blocks.get(src);
        let d = *self.arena.blocks.get(dst);
        let dseg = *self.arena.segments.get(d.segment);
        let pool = dseg.pool as usize;
        let (_, t) = self.tensors.by_slot(s.tensor).expect("a movable block holds a live tensor");
        let copy_bytes = t.bytes;
        let src_addr = self.arena.segments.get(s.segment).base + s.offset;
        let dst_addr = dseg.base + d.offset;
        self.device.copy(dst_addr, src_addr, copy_bytes, stream)?;
        self.arena.pools[pool].free.remove(&(dseg.stream, d.size, dst_addr, dst));
        if d.size > s.size {
            let rest = self.arena.blocks.insert(Block {
                segment: d.segment,
                offset: d.offset + s.size,
                size: d.size - s.size,
                prev: dst,
                next: d.next,
                tensor: NIL,
            });
            if d.next != NIL {
                self.arena.blocks.get_mut(d.next).prev = rest;
            }
            let db = self.arena.blocks.get_mut(dst);
            db.next = rest;
            db.size = s.size;
            self.arena.pools[pool].free.insert((dseg.stream, d.size - s.size, dst_addr + s.size, rest));
        }
        self.arena.blocks.get_mut(dst).tensor = s.tensor;
        let (id, _) = self.tensors.by_slot(s.tensor).expect("checked");
        self.tensors.get_mut(id).expect("live").block = dst;
        self.arena.blocks.get_mut(src).tensor = NIL;
        self.return_block(src)
    }
}
