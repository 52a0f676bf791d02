//! The free-block index of a pool: exact best fit by (stream, size, address)
//! in a few dozen instructions.
//!
//! Free blocks are kept per stream in segregated size bins: bin `k` holds the
//! sizes of one range (eight sub-ranges per power of two, as in TLSF), bins
//! cover the sizes in increasing order, and each bin is a vector sorted by
//! `(size, address)`. A bitmap of non-empty bins finds the next bin holding
//! larger blocks in one word scan. The smallest block of at least `size`
//! bytes (lowest address among equals) is therefore either in `size`'s own bin
//! (found by binary search) or the first entry of the next non-empty bin —
//! exactly the order of PyTorch's `std::set` keyed by (stream, size, address).
//!
//! Invariants: every bin is sorted by `(size, address)` and holds only sizes
//! of its range; bit `k` of the bitmap is set ⇔ bin `k` is non-empty;
//! `len = Σ bin lengths`.

use crate::types::StreamId;

/// Key of a free block: (stream, size, address, block index).
pub type FreeKey = (StreamId, u64, u64, u32);

const SUB_BITS: u32 = 3;
const BINS: usize = 512;

/// Bin of a size: sizes below 8 have a bin each; above, eight bins per power of two.
#[inline]
fn bin_of(size: u64) -> usize {
    if size < (1 << SUB_BITS) {
        return size as usize;
    }
    let fl = 63 - size.leading_zeros();
    let sl = (size >> (fl - SUB_BITS)) & ((1 << SUB_BITS) - 1);
    (((fl - SUB_BITS + 1) << SUB_BITS) as u64 + sl) as usize
}

/// Free blocks of one stream.
#[derive(Debug, Clone)]
struct Bins {
    bins: Vec<Vec<(u64, u64, u32)>>,
    nonempty: [u64; BINS / 64],
}

impl Bins {
    fn new() -> Self {
        Bins { bins: vec![Vec::new(); BINS], nonempty: [0; BINS / 64] }
    }

    /// First non-empty bin at or after `k`.
    #[inline]
    fn next_nonempty(&self, k: usize) -> Option<usize> {
        let mut w = k / 64;
        let mut bits = self.nonempty[w] & (!0u64 << (k % 64));
        loop {
            if bits != 0 {
                return Some(w * 64 + bits.trailing_zeros() as usize);
            }
            w += 1;
            if w == self.nonempty.len() {
                return None;
            }
            bits = self.nonempty[w];
        }
    }

    #[inline]
    fn best_fit(&self, size: u64) -> Option<(u64, u64, u32)> {
        let k = bin_of(size);
        let bin = &self.bins[k];
        let i = bin.partition_point(|&(s, _, _)| s < size);
        if i < bin.len() {
            return Some(bin[i]);
        }
        let j = self.next_nonempty(k + 1)?;
        Some(self.bins[j][0])
    }
}

/// The free-block index of one pool.
#[derive(Debug, Clone, Default)]
pub struct FreeIndex {
    streams: Vec<(StreamId, Bins)>,
    len: usize,
}

impl FreeIndex {
    #[inline]
    fn bins(&self, stream: StreamId) -> Option<&Bins> {
        self.streams.iter().find(|(s, _)| *s == stream).map(|(_, b)| b)
    }

    /// Adds a free block; false if it was already there.
    pub fn insert(&mut self, key: FreeKey) -> bool {
        let (stream, size, addr, block) = key;
        let pos = match self.streams.iter().position(|(s, _)| *s == stream) {
            Some(p) => p,
            None => {
                self.streams.push((stream, Bins::new()));
                self.streams.len() - 1
            }
        };
        let bins = &mut self.streams[pos].1;
        let k = bin_of(size);
        let bin = &mut bins.bins[k];
        match bin.binary_search(&(size, addr, block)) {
            Ok(_) => false,
            Err(i) => {
                bin.insert(i, (size, addr, block));
                bins.nonempty[k / 64] |= 1 << (k % 64);
                self.len += 1;
                true
            }
        }
    }

    /// Removes a free block; false if it was not there.
    pub fn remove(&mut self, key: &FreeKey) -> bool {
        let (stream, size, addr, block) = *key;
        let Some((_, bins)) = self.streams.iter_mut().find(|(s, _)| *s == stream) else { return false };
        let k = bin_of(size);
        let bin = &mut bins.bins[k];
        match bin.binary_search(&(size, addr, block)) {
            Ok(i) => {
                bin.remove(i);
                if bin.is_empty() {
                    bins.nonempty[k / 64] &= !(1 << (k % 64));
                }
                self.len -= 1;
                true
            }
            Err(_) => false,
        }
    }

    /// Whether the block is indexed under exactly this key.
    pub fn contains(&self, key: &FreeKey) -> bool {
        let (stream, size, addr, block) = *key;
        self.bins(stream).is_some_and(|b| b.bins[bin_of(size)].binary_search(&(size, addr, block)).is_ok())
    }

    /// The smallest free block on `stream` of at least `size` bytes (lowest
    /// address among equals), if it is at most `size + max_waste` bytes.
    #[inline]
    pub fn best_fit(&self, stream: StreamId, size: u64, max_waste: u64) -> Option<FreeKey> {
        let (s, a, b) = self.bins(stream)?.best_fit(size)?;
        (s <= size.saturating_add(max_waste)).then_some((stream, s, a, b))
    }

    /// Number of free blocks.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there is no free block.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Checks the index's own invariants.
    pub fn check(&self) -> Result<(), String> {
        let mut n = 0;
        for (stream, bins) in &self.streams {
            for (k, bin) in bins.bins.iter().enumerate() {
                if bin.windows(2).any(|w| w[0] >= w[1]) {
                    return Err(format!("{stream}: bin {k} is not sorted"));
                }
                if bin.iter().any(|&(s, _, _)| bin_of(s) != k) {
                    return Err(format!("{stream}: bin {k} holds a size of another bin"));
                }
                if (bins.nonempty[k / 64] >> (k % 64) & 1 == 1) == bin.is_empty() {
                    return Err(format!("{stream}: bitmap bit {k} disagrees with the bin"));
                }
                n += bin.len();
            }
        }
        if n != self.len {
            return Err(format!("free index counts {} blocks but holds {n}", self.len));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use proptest::prelude::*;

    use super::*;

    #[test]
    fn bins_are_monotonic() {
        let mut last = 0;
        for size in 1..100_000u64 {
            let k = bin_of(size);
            assert!(k >= last, "bin of {size} decreased");
            last = k;
        }
        for b in 0..64 {
            assert!(bin_of(1u64 << b) < BINS);
        }
        assert!(bin_of(u64::MAX) < BINS);
    }

    proptest! {
        /// Same answers as a `BTreeSet` ordered by (stream, size, address).
        #[test]
        fn matches_btreeset(ops in prop::collection::vec((0u8..3, 0u32..2, 1u64..(1 << 26), 0u64..64), 1..400)) {
            let mut idx = FreeIndex::default();
            let mut set: BTreeSet<FreeKey> = BTreeSet::new();
            for (i, (op, stream, size, addr)) in ops.into_iter().enumerate() {
                let key = (StreamId(stream), size, addr * 4096, i as u32);
                match op {
                    0 => prop_assert_eq!(idx.insert(key), set.insert(key)),
                    1 => {
                        if let Some(&k) = set.iter().nth(i % set.len().max(1)) {
                            prop_assert_eq!(idx.remove(&k), set.remove(&k));
                        }
                    }
                    _ => {
                        let s = StreamId(stream);
                        let want = set.range((s, size, 0, 0)..).next().copied().filter(|k| k.0 == s);
                        prop_assert_eq!(idx.best_fit(s, size, u64::MAX), want);
                    }
                }
                prop_assert_eq!(idx.len(), set.len());
            }
            idx.check().map_err(TestCaseError::fail)?;
        }
    }
}
