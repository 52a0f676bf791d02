//! Id validation shared by the reader and the writer.
//!
//! Invariants: `live ⊆ used`; an id enters `used` at its `alloc` and never
//! leaves; it is in `live` from its `alloc` until its `free`.
//!
//! `used` is stored as maximal runs of consecutive ids (`start → end`,
//! inclusive, runs neither overlap nor touch), so counter-style ids cost one
//! entry per gap rather than one per id.

use std::collections::BTreeMap;

use rustc_hash::FxHashSet;

use super::{Event, TraceErrorKind};

/// A set of `u64` stored as disjoint, non-adjacent inclusive runs.
#[derive(Debug, Default, Clone)]
pub(crate) struct RunSet {
    runs: BTreeMap<u64, u64>,
    /// The run most recently extended: the fast path for ascending ids.
    last: Option<(u64, u64)>,
}

impl RunSet {
    /// Whether `x` is in the set.
    pub(crate) fn contains(&self, x: u64) -> bool {
        if let Some((s, e)) = self.last {
            if s <= x && x <= e {
                return true;
            }
        }
        self.runs.range(..=x).next_back().is_some_and(|(_, &e)| x <= e)
    }

    /// Inserts `x`; returns `false` when it was already present.
    pub(crate) fn insert(&mut self, x: u64) -> bool {
        // Fast path: `x` extends the last run and no run starts right after it.
        if let Some((s, e)) = self.last {
            if e.checked_add(1) == Some(x) {
                let next_starts = x.checked_add(1).is_some_and(|n| self.runs.contains_key(&n));
                if !next_starts {
                    self.runs.insert(s, x);
                    self.last = Some((s, x));
                    return true;
                }
            }
        }
        let prev = self.runs.range(..=x).next_back().map(|(&s, &e)| (s, e));
        if let Some((_, e)) = prev {
            if x <= e {
                return false;
            }
        }
        let joins_prev = prev.filter(|&(_, e)| e.checked_add(1) == Some(x));
        let next = x.checked_add(1).and_then(|n| self.runs.get(&n).map(|&e| (n, e)));
        let run = match (joins_prev, next) {
            (Some((s, _)), Some((n, e))) => {
                self.runs.remove(&n);
                (s, e)
            }
            (Some((s, _)), None) => (s, x),
            (None, Some((n, e))) => {
                self.runs.remove(&n);
                (x, e)
            }
            (None, None) => (x, x),
        };
        self.runs.insert(run.0, run.1);
        self.last = Some(run);
        true
    }

    /// Number of runs stored.
    #[cfg(test)]
    pub(crate) fn runs(&self) -> usize {
        self.runs.len()
    }
}

/// Checks events against the id rules of the format.
#[derive(Debug, Default, Clone)]
pub(crate) struct IdTracker {
    live: FxHashSet<u64>,
    used: RunSet,
}

impl IdTracker {
    /// Applies `event`, or says why it is invalid (leaving the state as is).
    pub(crate) fn apply(&mut self, event: &Event) -> Result<(), TraceErrorKind> {
        match *event {
            Event::Alloc { id, .. } => {
                if !self.used.insert(id) {
                    return Err(TraceErrorKind::IdReused(id));
                }
                self.live.insert(id);
            }
            Event::Free { id, .. } => {
                if !self.live.remove(&id) {
                    return Err(if self.used.contains(id) {
                        TraceErrorKind::DoubleFree(id)
                    } else {
                        TraceErrorKind::FreeOfUnknownId(id)
                    });
                }
            }
            Event::Use { id, .. } => {
                if !self.live.contains(&id) {
                    return Err(if self.used.contains(id) {
                        TraceErrorKind::UseAfterFree(id)
                    } else {
                        TraceErrorKind::UseOfUnknownId(id)
                    });
                }
            }
            Event::Phase { .. } => {}
        }
        Ok(())
    }

    /// Number of live ids.
    pub(crate) fn live(&self) -> usize {
        self.live.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_merge() {
        let mut s = RunSet::default();
        for x in [1, 2, 3, 7, 5, 6, 4] {
            assert!(s.insert(x));
        }
        assert_eq!(s.runs(), 1);
        assert!(!s.insert(4));
        assert!(s.contains(1) && s.contains(7) && !s.contains(0) && !s.contains(8));
        assert!(s.insert(u64::MAX) && s.insert(0) && s.insert(u64::MAX - 1));
        assert!(s.contains(u64::MAX) && !s.contains(u64::MAX - 2));
        assert_eq!(s.runs(), 2);
        for x in (100..200).step_by(2) {
            assert!(s.insert(x));
        }
        assert_eq!(s.runs(), 52);
        for x in (101..200).step_by(2) {
            assert!(s.insert(x));
        }
        assert_eq!(s.runs(), 3);
    }

    #[test]
    fn runs_match_a_hash_set() {
        // Deterministic pseudo-random ids in a small range.
        let mut reference = std::collections::HashSet::new();
        let mut s = RunSet::default();
        let mut x: u64 = 12345;
        for _ in 0..5000 {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let v = (x >> 33) % 700;
            assert_eq!(s.insert(v), reference.insert(v));
            let probe = (x >> 13) % 700;
            assert_eq!(s.contains(probe), reference.contains(&probe));
        }
    }
}
