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

/// One free block in a bin: `(size, address, block index)`.
type Entry = (u64, u64, u32);

/// The sort key of an entry: size, then address, as one integer (one
/// comparison instead of a branch per field; addresses are unique, so the
/// block index never decides).
#[inline(always)]
fn order(size: u64, addr: u64) -> u128 {
    (size as u128) << 64 | addr as u128
}

#[inline(always)]
fn entry_order(e: &Entry) -> u128 {
    order(e.0, e.1)
}

/// Position of the entry ordered as `(size, addr)` in a sorted bin.
#[inline]
fn search(bin: &[Entry], size: u64, addr: u64) -> Result<usize, usize> {
    let want = order(size, addr);
    bin.binary_search_by(|e| entry_order(e).cmp(&want))
}

/// Free blocks of one stream.
#[derive(Debug, Clone)]
struct Bins {
    bins: Vec<Vec<Entry>>,
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
    fn best_fit(&self, size: u64) -> Option<Entry> {
        let k = bin_of(size);
        let bin = &self.bins[k];
        // Every entry of the bin with at least `size` bytes is ordered after
        // (size, 0), so the first of them is the best fit.
        let i = bin.partition_point(|e| entry_order(e) < order(size, 0));
        if i < bin.len() {
            return Some(bin[i]);
        }
        let j = self.next_nonempty(k + 1)?;
        Some(self.bins[j][0])
    }
}

/// The free-block index of one pool.
///
/// The most recently indexed block waits in a one-entry `hot` slot before it
/// goes to the bins: a training loop frees a block and allocates the same
/// size again, which splits the same block and merges it back, and those
/// round trips then update the slot instead of a sorted bin (the set of
/// indexed blocks, and so every answer, is the same either way).
#[derive(Debug, Clone, Default)]
pub struct FreeIndex {
    streams: Vec<(StreamId, Bins)>,
    /// Blocks in the bins (the hot block not included).
    len: usize,
    /// The most recently indexed block, not in the bins.
    hot: Option<FreeKey>,
}

impl FreeIndex {
    #[inline]
    fn bins(&self, stream: StreamId) -> Option<&Bins> {
        self.streams.iter().find(|(s, _)| *s == stream).map(|(_, b)| b)
    }

    /// Adds a block to the bins; false if it was already there.
    fn bins_insert(&mut self, key: FreeKey) -> bool {
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
        match search(bin, size, addr) {
            Ok(_) => false,
            Err(i) => {
                bin.insert(i, (size, addr, block));
                bins.nonempty[k / 64] |= 1 << (k % 64);
                self.len += 1;
                true
            }
        }
    }

    /// Removes a block from the bins; false if it was not there.
    fn bins_remove(&mut self, key: &FreeKey) -> bool {
        let (stream, size, addr, block) = *key;
        let Some((_, bins)) = self.streams.iter_mut().find(|(s, _)| *s == stream) else { return false };
        let k = bin_of(size);
        let bin = &mut bins.bins[k];
        match search(bin, size, addr) {
            Ok(i) if bin[i].2 == block => {
                bin.remove(i);
                if bin.is_empty() {
                    bins.nonempty[k / 64] &= !(1 << (k % 64));
                }
                self.len -= 1;
                true
            }
            _ => false,
        }
    }

    /// Adds a free block, which must not be indexed already (the allocator
    /// indexes a block at most once; [`FreeIndex::check`] reports a
    /// duplicate). The block takes the hot slot; the block it displaces goes
    /// to the bins.
    #[inline]
    pub fn insert(&mut self, key: FreeKey) {
        if let Some(h) = self.hot.replace(key) {
            self.bins_insert(h);
        }
    }

    /// Removes a free block; false if it was not there.
    #[inline]
    pub fn remove(&mut self, key: &FreeKey) -> bool {
        if self.hot.as_ref() == Some(key) {
            self.hot = None;
            return true;
        }
        self.bins_remove(key)
    }

    /// Replaces the free block `old` by `new` (the block after a split or a
    /// merge), which must not be indexed already. False, with nothing
    /// changed, if `old` was not there.
    #[inline]
    pub fn replace(&mut self, old: &FreeKey, new: FreeKey) -> bool {
        if self.hot.as_ref() == Some(old) {
            self.hot = Some(new);
            return true;
        }
        if !self.bins_remove(old) {
            return false;
        }
        self.insert(new);
        true
    }

    /// Whether the block is indexed under exactly this key.
    pub fn contains(&self, key: &FreeKey) -> bool {
        if self.hot.as_ref() == Some(key) {
            return true;
        }
        let (stream, size, addr, block) = *key;
        self.bins(stream).is_some_and(|b| {
            let bin = &b.bins[bin_of(size)];
            matches!(search(bin, size, addr), Ok(i) if bin[i].2 == block)
        })
    }

    /// The smallest free block on `stream` of at least `size` bytes (lowest
    /// address among equals), if it is at most `size + max_waste` bytes.
    #[inline]
    pub fn best_fit(&self, stream: StreamId, size: u64, max_waste: u64) -> Option<FreeKey> {
        let binned = self.bins(stream).and_then(|b| b.best_fit(size)).map(|(s, a, b)| (stream, s, a, b));
        let best = match self.hot {
            Some(h) if h.0 == stream && h.1 >= size => match binned {
                Some(b) if order(b.1, b.2) < order(h.1, h.2) => Some(b),
                _ => Some(h),
            },
            _ => binned,
        };
        best.filter(|k| k.1 <= size.saturating_add(max_waste))
    }

    /// Every free block of at least `size` bytes, of any stream, in no
    /// particular order (only the bins that can hold such sizes are read).
    pub fn at_least(&self, size: u64) -> impl Iterator<Item = FreeKey> + '_ {
        let hot = self.hot.filter(|h| h.1 >= size);
        let binned = self.streams.iter().flat_map(move |(stream, bins)| {
            let mut k = Some(bin_of(size));
            std::iter::from_fn(move || {
                let found = bins.next_nonempty(k?);
                k = found.map(|b| b + 1).filter(|&b| b < BINS);
                found
            })
            .flat_map(move |b| {
                bins.bins[b].iter().filter(move |e| e.0 >= size).map(move |&(s, a, i)| (*stream, s, a, i))
            })
        });
        hot.into_iter().chain(binned)
    }

    /// Number of free blocks.
    pub fn len(&self) -> usize {
        self.len + self.hot.is_some() as usize
    }

    /// Whether there is no free block.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Checks the index's own invariants.
    pub fn check(&self) -> Result<(), String> {
        let mut n = 0;
        for (stream, bins) in &self.streams {
            for (k, bin) in bins.bins.iter().enumerate() {
                if bin.windows(2).any(|w| entry_order(&w[0]) >= entry_order(&w[1])) {
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
        if let Some(h) = self.hot {
            let binned = self.bins(h.0).is_some_and(|b| search(&b.bins[bin_of(h.1)], h.1, h.2).is_ok());
            if binned {
                return Err(format!("the hot block {h:?} is also in the bins"));
            }
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
        /// Same answers as a `BTreeSet` ordered by (stream, size, address);
        /// addresses are unique among free blocks, as in the allocator.
        #[test]
        fn matches_btreeset(ops in prop::collection::vec((0u8..4, 0u32..2, 1u64..(1 << 26), 0u64..64), 1..400)) {
            let mut idx = FreeIndex::default();
            let mut set: BTreeSet<FreeKey> = BTreeSet::new();
            for (i, (op, stream, size, addr)) in ops.into_iter().enumerate() {
                let key = (StreamId(stream), size, addr * 4096, i as u32);
                let addr_taken = |set: &BTreeSet<FreeKey>, a: u64| set.iter().any(|k| k.2 == a);
                match op {
                    0 => {
                        if !addr_taken(&set, key.2) {
                            idx.insert(key);
                            set.insert(key);
                        }
                    }
                    1 => {
                        if let Some(&k) = set.iter().nth(i % set.len().max(1)) {
                            prop_assert_eq!(idx.remove(&k), set.remove(&k));
                        }
                    }
                    2 => {
                        // Replace an indexed block by a split or merged
                        // version of it: often the same bin and stream.
                        if let Some(&old) = set.iter().nth(i % set.len().max(1)) {
                            let new = if size % 3 == 0 {
                                key
                            } else {
                                (old.0, (old.1 + size % 8192).saturating_sub(4096).max(1), old.2 + 512 * (size % 4), key.3)
                            };
                            if !set.iter().any(|k| k.2 == new.2 && *k != old) {
                                set.remove(&old);
                                prop_assert!(idx.replace(&old, new));
                                set.insert(new);
                            }
                        }
                    }
                    _ => {
                        let s = StreamId(stream);
                        let want = set.range((s, size, 0, 0)..).next().copied().filter(|k| k.0 == s);
                        prop_assert_eq!(idx.best_fit(s, size, u64::MAX), want);
                        let mut big: Vec<FreeKey> = idx.at_least(size).collect();
                        big.sort_unstable();
                        let want: Vec<FreeKey> = set.iter().copied().filter(|k| k.1 >= size).collect();
                        prop_assert_eq!(big, want);
                    }
                }
                prop_assert_eq!(idx.len(), set.len());
                for k in &set {
                    prop_assert!(idx.contains(k), "{:?} missing", k);
                }
                idx.check().map_err(TestCaseError::fail)?;
            }
        }
    }

    #[test]
    fn replace_of_a_missing_block_changes_nothing() {
        let mut idx = FreeIndex::default();
        let s = StreamId(0);
        idx.insert((s, 4096, 0, 1));
        idx.insert((s, 8192, 4096, 3));
        assert!(!idx.replace(&(s, 4096, 8192, 2), (s, 4000, 8192, 2)));
        assert!(!idx.replace(&(s, 4096, 0, 9), (s, 4000, 0, 9)));
        assert_eq!(idx.len(), 2);
        assert!(idx.contains(&(s, 4096, 0, 1)));
        assert!(idx.remove(&(s, 8192, 4096, 3)));
        assert!(idx.replace(&(s, 4096, 0, 1), (StreamId(1), 4096, 0, 1)));
        assert_eq!(idx.best_fit(StreamId(1), 1, u64::MAX), Some((StreamId(1), 4096, 0, 1)));
        assert_eq!(idx.best_fit(s, 1, u64::MAX), None);
        idx.check().unwrap();
    }
}
