//! Blocks and segments, stored in index-addressed slabs.
//!
//! Invariants (checked by `Allocator::check_invariants`):
//! - the blocks of a segment tile it without gaps or overlap: walking `next`
//!   from `segment.first`, `block.offset = Σ sizes of the blocks before it`
//!   and `Σ block sizes = segment.size`;
//! - `prev`/`next` links are mutual, and every block's `segment` is the
//!   segment whose chain holds it;
//! - no two neighbouring blocks are both free (frees merge eagerly);
//! - a block is free ⇔ `tensor == NIL` ⇔ it is in its pool's free index.

use crate::device::DevicePtr;
use crate::types::StreamId;

/// "No index" in a link or slot field.
pub const NIL: u32 = u32::MAX;

/// A range of a segment: free (cached) or holding one tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Block {
    /// Index of the owning segment.
    pub segment: u32,
    /// Offset from the segment base.
    pub offset: u64,
    /// Size in bytes.
    pub size: u64,
    /// Previous block of the segment (lower address), or [`NIL`].
    pub prev: u32,
    /// Next block of the segment (higher address), or [`NIL`].
    pub next: u32,
    /// Handle-table slot of the tensor in this block, or [`NIL`] when free.
    pub tensor: u32,
}

impl Block {
    /// Whether the block is free.
    pub fn is_free(&self) -> bool {
        self.tensor == NIL
    }
}

/// A contiguous range obtained from the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    /// Device address of the first byte.
    pub base: DevicePtr,
    /// Size in bytes.
    pub size: u64,
    /// Engine pool the segment belongs to.
    pub pool: u32,
    /// Stream whose requests the segment serves.
    pub stream: StreamId,
    /// First (lowest-address) block.
    pub first: u32,
    /// Logical clock when the segment was obtained.
    pub born: u64,
}

/// A vector of `T` addressed by `u32` index, reusing freed slots.
///
/// A dead slot keeps its stale value (the hot path indexes without checking
/// liveness; debug builds assert it); `live` tells live from dead for scans.
#[derive(Debug, Clone)]
pub struct Slab<T: Copy> {
    items: Vec<T>,
    live: Vec<bool>,
    free: Vec<u32>,
    len: usize,
}

impl<T: Copy> Default for Slab<T> {
    fn default() -> Self {
        Slab { items: Vec::new(), live: Vec::new(), free: Vec::new(), len: 0 }
    }
}

impl<T: Copy> Slab<T> {
    /// Stores `v` and returns its index.
    #[inline]
    pub fn insert(&mut self, v: T) -> u32 {
        self.len += 1;
        if let Some(i) = self.free.pop() {
            self.items[i as usize] = v;
            self.live[i as usize] = true;
            i
        } else {
            self.items.push(v);
            self.live.push(true);
            (self.items.len() - 1) as u32
        }
    }

    /// Removes and returns the item at `i` (which must be live).
    #[inline]
    pub fn remove(&mut self, i: u32) -> T {
        debug_assert!(self.live[i as usize], "slab index {i} is dead");
        self.live[i as usize] = false;
        self.free.push(i);
        self.len -= 1;
        self.items[i as usize]
    }

    /// The item at `i` (which must be live).
    #[inline]
    pub fn get(&self, i: u32) -> &T {
        debug_assert!(self.live[i as usize], "slab index {i} is dead");
        &self.items[i as usize]
    }

    /// The item at `i` (which must be live), mutably.
    #[inline]
    pub fn get_mut(&mut self, i: u32) -> &mut T {
        debug_assert!(self.live[i as usize], "slab index {i} is dead");
        &mut self.items[i as usize]
    }

    /// The item at `i` if it is live.
    pub fn try_get(&self, i: u32) -> Option<&T> {
        self.live.get(i as usize).copied().unwrap_or(false).then(|| &self.items[i as usize])
    }

    /// Number of live items.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Number of indices ever issued (live or free): every index is below it.
    pub fn capacity(&self) -> usize {
        self.items.len()
    }

    /// Live items with their indices.
    pub fn iter(&self) -> impl Iterator<Item = (u32, &T)> {
        self.items.iter().zip(&self.live).enumerate().filter(|(_, (_, l))| **l).map(|(i, (v, _))| (i as u32, v))
    }
}
