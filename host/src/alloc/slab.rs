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
#[derive(Debug, Clone)]
pub struct Slab<T> {
    items: Vec<Option<T>>,
    free: Vec<u32>,
    len: usize,
}

impl<T> Default for Slab<T> {
    fn default() -> Self {
        Slab { items: Vec::new(), free: Vec::new(), len: 0 }
    }
}

impl<T> Slab<T> {
    /// Stores `v` and returns its index.
    pub fn insert(&mut self, v: T) -> u32 {
        self.len += 1;
        if let Some(i) = self.free.pop() {
            self.items[i as usize] = Some(v);
            i
        } else {
            self.items.push(Some(v));
            (self.items.len() - 1) as u32
        }
    }

    /// Removes and returns the item at `i`.
    pub fn remove(&mut self, i: u32) -> T {
        let v = self.items[i as usize].take().expect("slab index is live");
        self.free.push(i);
        self.len -= 1;
        v
    }

    /// The item at `i` (which must be live).
    #[inline]
    pub fn get(&self, i: u32) -> &T {
        self.items[i as usize].as_ref().expect("slab index is live")
    }

    /// The item at `i` (which must be live), mutably.
    #[inline]
    pub fn get_mut(&mut self, i: u32) -> &mut T {
        self.items[i as usize].as_mut().expect("slab index is live")
    }

    /// The item at `i` if it is live.
    pub fn try_get(&self, i: u32) -> Option<&T> {
        self.items.get(i as usize).and_then(|v| v.as_ref())
    }

    /// Number of live items.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Live items with their indices.
    pub fn iter(&self) -> impl Iterator<Item = (u32, &T)> {
        self.items.iter().enumerate().filter_map(|(i, v)| v.as_ref().map(|v| (i as u32, v)))
    }
}
