//! Pools: free blocks indexed for best-fit lookup.
//!
//! Invariants:
//! - `free` holds exactly the free blocks of the pool's segments, each under
//!   the key `(stream, size, address, block)` of its current state;
//! - the pool's gauges count only its own segments and blocks.

pub use super::free_index::{FreeIndex, FreeKey};
use super::stats::Gauges;
use crate::types::StreamId;

/// One pool of the allocator.
#[derive(Debug, Clone)]
pub struct Pool {
    /// Name (pools are matched by name across policy swaps).
    pub name: String,
    /// Release a segment as soon as it is entirely free.
    pub release_when_empty: bool,
    /// Free blocks, ordered by stream, then size, then address (best fit,
    /// lowest address first among equals), as in PyTorch's allocator.
    pub free: FreeIndex,
    /// Byte gauges of this pool.
    pub gauges: Gauges,
    /// The pool of planned arenas: its free blocks are not in `free` (only
    /// planned requests, at their offsets, take them), and reclamation,
    /// stitching and compaction leave it alone.
    pub planned: bool,
}

impl Pool {
    /// An empty pool.
    pub fn new(name: &str, release_when_empty: bool) -> Self {
        Pool {
            name: name.to_string(),
            release_when_empty,
            free: FreeIndex::default(),
            gauges: Gauges::default(),
            planned: false,
        }
    }

    /// The smallest free block on `stream` of at least `size` bytes and at
    /// most `size + max_waste` bytes.
    #[inline]
    pub fn best_fit(&self, stream: StreamId, size: u64, max_waste: u64) -> Option<FreeKey> {
        self.free.best_fit(stream, size, max_waste)
    }

    /// Free bytes cached in this pool.
    pub fn cached_bytes(&self) -> u64 {
        self.gauges.reserved_bytes - self.gauges.allocated_bytes
    }
}
