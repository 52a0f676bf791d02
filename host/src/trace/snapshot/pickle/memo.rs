//! The pickle memo: id → value, as Python's pickle machine keeps it.
//!
//! Picklers number memo entries from 0 (`MEMOIZE` always takes the next
//! id), so ids up to a small gap past the last one go to a dense part, in
//! chunks of [`CHUNK`] ids; a chunk whose ids all hold the same value so far
//! (every container a skipped subtree memoizes is the same stand-in node)
//! stores it once. Other ids go to a map.
//!
//! Invariants: `len` = number of distinct ids present; an id below `dense`
//! is present iff it does not hold [`Val::HOLE`] there or it is in `sparse`.

use rustc_hash::FxHashMap;

use super::store::Val;
use crate::trace::snapshot::budget::{Budget, Exceeded};

/// Ids per dense chunk.
pub(crate) const CHUNK: usize = 1024;
/// How far past the end of the dense part an id still extends it.
const GAP: usize = 16;
/// Bytes charged per slot of the map (entry, control byte, slack).
const SPARSE_SLOT: u64 = 24;

enum Chunk {
    /// Every id of the chunk below `dense` holds this value.
    Same(Val),
    /// One value per id (`CHUNK` of them).
    Each(Box<[Val]>),
}

/// The memo (see the module documentation).
#[derive(Default)]
pub(crate) struct Memo {
    chunks: Vec<Chunk>,
    /// Ids below this are in the chunks.
    dense: usize,
    sparse: FxHashMap<u32, Val>,
    /// Distinct ids present.
    len: usize,
}

impl Memo {
    /// Number of distinct ids present (the next `MEMOIZE` id).
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    fn dense_get(&self, i: usize) -> Val {
        match &self.chunks[i / CHUNK] {
            Chunk::Same(v) => *v,
            Chunk::Each(vals) => vals[i % CHUNK],
        }
    }

    /// The value of `id`.
    pub(crate) fn get(&self, id: u32) -> Option<Val> {
        let i = id as usize;
        if i < self.dense {
            let v = self.dense_get(i);
            if v != Val::HOLE {
                return Some(v);
            }
        }
        self.sparse.get(&id).copied()
    }

    /// Sets id `i` (below `dense`, or `dense` itself, which extends it).
    fn dense_set(&mut self, i: usize, v: Val, budget: &mut Budget) -> Result<(), Exceeded> {
        let c = i / CHUNK;
        if c == self.chunks.len() {
            budget.room(&mut self.chunks, 1)?;
            self.chunks.push(Chunk::Same(v));
        }
        if i == self.dense {
            self.dense += 1;
        }
        let first_in_chunk = i.is_multiple_of(CHUNK) && i + 1 == self.dense;
        match &mut self.chunks[c] {
            Chunk::Same(u) if *u == v => {}
            Chunk::Same(u) if first_in_chunk => *u = v,
            Chunk::Same(u) => {
                budget.charge((CHUNK * std::mem::size_of::<Val>()) as u64)?;
                let mut vals = vec![*u; CHUNK].into_boxed_slice();
                vals[i % CHUNK] = v;
                self.chunks[c] = Chunk::Each(vals);
            }
            Chunk::Each(vals) => vals[i % CHUNK] = v,
        }
        Ok(())
    }

    /// Sets `id` to `v`; returns whether the id is new.
    pub(crate) fn put(&mut self, id: u32, v: Val, budget: &mut Budget) -> Result<bool, Exceeded> {
        let i = id as usize;
        if i < self.dense {
            let fresh = self.dense_get(i) == Val::HOLE && self.sparse.remove(&id).is_none();
            self.dense_set(i, v, budget)?;
            self.len += usize::from(fresh);
            return Ok(fresh);
        }
        if i <= self.dense + GAP {
            while self.dense < i {
                self.dense_set(self.dense, Val::HOLE, budget)?;
            }
            let fresh = self.sparse.remove(&id).is_none();
            self.dense_set(i, v, budget)?;
            self.len += usize::from(fresh);
            return Ok(fresh);
        }
        if self.sparse.len() == self.sparse.capacity() {
            let more = self.sparse.capacity().max(16);
            budget.charge(more as u64 * SPARSE_SLOT)?;
            self.sparse.reserve(more);
        }
        let fresh = self.sparse.insert(id, v).is_none();
        self.len += usize::from(fresh);
        Ok(fresh)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn behaves_like_a_map() {
        let mut budget = Budget::new(u64::MAX);
        let mut m = Memo::default();
        let mut reference = std::collections::HashMap::new();
        let mut x: u64 = 99;
        for step in 0..20_000u64 {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            // Mostly the next ids, some repeats, some far away; values
            // often equal (as the stand-ins of skipped containers are).
            let id = match x >> 60 {
                0 => (x >> 20) as u32,
                1..=3 => (m.len() as u32).saturating_sub((x >> 40) as u32 % 50),
                _ => m.len() as u32,
            };
            let v = Val::node(if x >> 59 & 1 == 0 { 1 } else { (step % 7) as u32 });
            assert_eq!(m.put(id, v, &mut budget).unwrap(), reference.insert(id, v).is_none());
            assert_eq!(m.len(), reference.len());
            let probe = (x >> 33) as u32 % (m.len() as u32 + 40);
            assert_eq!(m.get(probe), reference.get(&probe).copied());
        }
    }

    #[test]
    fn equal_values_cost_one_slot_per_chunk() {
        let mut budget = Budget::new(u64::MAX);
        let mut m = Memo::default();
        for id in 0..(100 * CHUNK) as u32 {
            m.put(id, Val::node(0), &mut budget).unwrap();
        }
        assert!(budget.peak() < 4096, "{}", budget.peak());
        m.put(5, Val::node(9), &mut budget).unwrap();
        assert_eq!(m.get(5), Some(Val::node(9)));
        assert_eq!(m.get(6), Some(Val::node(0)));
        assert!(budget.peak() >= (CHUNK * 8) as u64);
    }
}
