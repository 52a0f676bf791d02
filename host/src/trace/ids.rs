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
///
/// The run that was inserted into or extended last is kept out of the map,
/// together with the start of the next run above it, so that extending it by
/// the next id (the common, counter-style case) touches no tree node.
#[derive(Debug, Default, Clone)]
pub(crate) struct RunSet {
    /// Every run but `last`.
    runs: BTreeMap<u64, u64>,
    /// The run most recently inserted into or extended (not in `runs`).
    last: Option<(u64, u64)>,
    /// Start of the first run of `runs` above `last` (`None`: there is none).
    next_start: Option<u64>,
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
        if let Some((s, e)) = self.last {
            if e.checked_add(1) == Some(x) {
                // `x` is free: runs neither overlap nor touch `last`.
                let end = match x.checked_add(1).filter(|&n| self.next_start == Some(n)) {
                    Some(n) => self.runs.remove(&n).unwrap_or(x),
                    None => x,
                };
                self.set_last(s, end, end != x);
                return true;
            }
        }
        if self.contains(x) {
            return false;
        }
        if let Some((s, e)) = self.last.take() {
            self.runs.insert(s, e);
        }
        let prev = self.runs.range(..=x).next_back().map(|(&s, &e)| (s, e));
        let start = match prev.filter(|&(_, e)| e.checked_add(1) == Some(x)) {
            Some((s, _)) => {
                self.runs.remove(&s);
                s
            }
            None => x,
        };
        let end = match x.checked_add(1).and_then(|n| self.runs.remove(&n)) {
            Some(e) => e,
            None => x,
        };
        self.set_last(start, end, true);
        true
    }

    /// Makes `start..=end` the last run; `moved`: its end changed in a way
    /// that may change the next run above it.
    fn set_last(&mut self, start: u64, end: u64, moved: bool) {
        self.last = Some((start, end));
        if moved {
            self.next_start = end.checked_add(1).and_then(|n| self.runs.range(n..).next().map(|(&k, _)| k));
        }
    }

    /// Number of runs stored.
    #[cfg(test)]
    pub(crate) fn runs(&self) -> usize {
        self.runs.len() + usize::from(self.last.is_some())
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
