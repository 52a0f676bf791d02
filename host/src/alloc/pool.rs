//! Pools: free blocks indexed for best-fit lookup.
//!
//! Invariants:
//! - `free` holds exactly the free blocks of the pool's segments, each under
//!   the key `(stream, size, address, block)` of its current state;
//! - the pool's gauges count only its own segments and blocks.

use std::collections::BTreeSet;

use super::stats::Gauges;
use crate::types::StreamId;

/// Key of a free block: ordered by stream, then size, then address (best fit,
/// lowest address first among equals), as in PyTorch's allocator.
pub type FreeKey = (StreamId, u64, u64, u32);

/// One pool of the allocator.
#[derive(Debug, Clone)]
pub struct Pool {
    /// Name (pools are matched by name across policy swaps).
    pub name: String,
    /// Release a segment as soon as it is entirely free.
    pub release_when_empty: bool,
    /// Free blocks.
    pub free: BTreeSet<FreeKey>,
    /// Byte gauges of this pool.
    pub gauges: Gauges,
}

impl Pool {
    /// An empty pool.
    pub fn new(name: &str, release_when_empty: bool) -> Self {
        Pool { name: name.to_string(), release_when_empty, free: BTreeSet::new(), gauges: Gauges::default() }
    }

    /// The smallest free block on `stream` of at least `size` bytes and at
    /// most `size + max_waste` bytes.
    #[inline]
    pub fn best_fit(&self, stream: StreamId, size: u64, max_waste: u64) -> Option<FreeKey> {
        let k = self.free.range((stream, size, 0, 0)..).next().copied()?;
        (k.0 == stream && k.1 <= size.saturating_add(max_waste)).then_some(k)
    }

    /// Free bytes cached in this pool.
    pub fn cached_bytes(&self) -> u64 {
        self.gauges.reserved_bytes - self.gauges.allocated_bytes
    }
}
