//! The importer's memory budget: every growing structure of the pickle
//! reader, and the records the walk builds from it, is charged here before
//! it grows, so an import holds at most `limit` accounted bytes whatever the
//! input.
//!
//! Accounted bytes are the capacities of the reader's vectors and tables
//! (element size × capacity) plus owned strings and object boxes; the
//! allocator's own overhead per allocation is not included, and a vector
//! that grows briefly holds its old buffer too. Growth doubles (amortized
//! O(1)), so a structure holds at most twice what it uses.

/// The budget has no room for a growth.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Exceeded;

/// Accounted bytes in use, their peak, and the limit.
#[derive(Debug, Clone)]
pub(crate) struct Budget {
    limit: u64,
    used: u64,
    peak: u64,
}

impl Budget {
    /// A budget of `limit` bytes.
    pub(crate) fn new(limit: u64) -> Self {
        Budget { limit, used: 0, peak: 0 }
    }

    /// The limit.
    pub(crate) fn limit(&self) -> u64 {
        self.limit
    }

    /// The most bytes held at once so far.
    pub(crate) fn peak(&self) -> u64 {
        self.peak
    }

    /// Takes `bytes` more, or fails (taking nothing) past the limit.
    pub(crate) fn charge(&mut self, bytes: u64) -> Result<(), Exceeded> {
        let used = self.used.saturating_add(bytes);
        if used > self.limit {
            return Err(Exceeded);
        }
        self.used = used;
        self.peak = self.peak.max(used);
        Ok(())
    }

    /// Makes room in `v` for `extra` more elements: the capacity at least
    /// doubles when it must grow, and the added bytes are charged first.
    pub(crate) fn room<T>(&mut self, v: &mut Vec<T>, extra: usize) -> Result<(), Exceeded> {
        let need = v.len().checked_add(extra).ok_or(Exceeded)?;
        if need <= v.capacity() {
            return Ok(());
        }
        let cap = need.max(v.capacity().saturating_mul(2)).max(16);
        let bytes = ((cap - v.capacity()) as u64).saturating_mul(std::mem::size_of::<T>() as u64);
        self.charge(bytes)?;
        v.try_reserve_exact(cap - v.len()).map_err(|_| Exceeded)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charges_before_growing_and_doubles() {
        let mut b = Budget::new(1000);
        let mut v: Vec<u64> = Vec::new();
        b.room(&mut v, 1).unwrap();
        assert_eq!((v.capacity(), b.peak()), (16, 128));
        v.extend([0; 16]);
        b.room(&mut v, 1).unwrap();
        assert_eq!(v.capacity(), 32);
        assert_eq!(b.peak(), 256);
        v.extend([0; 16]);
        // 64 elements would take 512 more bytes: still within 1000.
        b.room(&mut v, 1).unwrap();
        v.extend([0; 32]);
        assert_eq!(b.room(&mut v, 1), Err(Exceeded));
        assert_eq!(v.capacity(), 64, "nothing grew past the limit");
        assert!(b.charge(1000 - 512).is_ok());
        assert_eq!(b.charge(1), Err(Exceeded));
        assert_eq!(b.limit(), 1000);
    }
}
