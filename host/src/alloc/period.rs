//! Step ends of runs without step markers: the repeating period of the
//! request sequence.
//!
//! Many runs never say where a training step ends (a PyTorch memory
//! snapshot, a process that enabled the allocator without marking steps),
//! yet their requests repeat step after step. Planned placement needs step
//! ends; this detector finds them:
//!
//! ```text
//!  request ─► token (bytes, kind, stream) ─► window hash of the last W tokens
//!  seeking: (window, live bytes before it) seen P requests ago ─► candidate P
//!           the next P tokens equal those P before them, one by one ─► locked on P
//!  locked:  cut = the point of the last period with the fewest live bytes
//!           whose preceding window occurs once in it; each time the last W
//!           tokens are that window, a step ends before the next request
//!           no cut within 2P + W requests ─► seeking again
//! ```
//!
//! A candidate is keyed by the live bytes as well as the window: repeating
//! layers of one step (a forward pass accumulating activations) see the
//! same window with more bytes live, and are no period; the same point of
//! the next step sees them equal. Periods are at least [`MIN_PERIOD`] and
//! at most [`MAX_PERIOD`] requests; the history is a ring of
//! [`RING`] requests and a direct-mapped table of windows (a collision
//! only loses a candidate), so memory and work per request are bounded
//! whatever the run. The first step marker of a run turns detection off
//! for good (the allocator drops the detector): marks are the truth.

use std::hash::{Hash, Hasher};

use crate::types::{StreamId, TensorKind};

/// Tokens in the window that identifies a point of the sequence.
pub const WINDOW: usize = 16;

/// The shortest period taken for a step (shorter loops gain nothing from a
/// plan the dynamic path's cache does not already give).
pub const MIN_PERIOD: u64 = 32;

/// The longest period looked for, in requests.
pub const MAX_PERIOD: u64 = 1 << 16;

/// Requests remembered (a power of two above `MAX_PERIOD + WINDOW`).
const RING: usize = 1 << 17;

/// Slots of the table of windows (a power of two).
const TABLE: usize = 1 << 17;

/// Slots of the table at first.
const MIN_TABLE: usize = 1 << 10;

/// Candidate periods verified at once.
const CANDIDATES: usize = 4;

/// The base of the rolling window hash (odd).
const BASE: u64 = 0x0000_0100_0000_01b3;

/// One request seen.
#[derive(Debug, Clone, Copy, Default)]
struct Seen {
    token: u64,
    /// The hash of the window ending with this request.
    window: u64,
    /// Live bytes before it was served.
    live: u64,
}

/// The period the detector cuts steps by.
#[derive(Debug, Clone, Copy)]
struct Lock {
    period: u64,
    /// The window after which a step ends.
    cut: u64,
    /// The live bytes there too, when the window alone occurs more than
    /// once in a period.
    cut_live: Option<u64>,
    /// Requests seen at the last cut (or at the lock).
    last: u64,
}

/// Finds step ends in a request sequence by its period (see the module
/// documentation).
#[derive(Debug)]
pub struct PeriodDetector {
    ring: Vec<Seen>,
    table: Vec<(u64, u64)>,
    /// Requests seen.
    seen: u64,
    /// Rolling hash of the last [`WINDOW`] tokens.
    window: u64,
    /// `BASE^WINDOW`.
    outgoing: u64,
    /// Candidate periods and how many requests in a row agreed with them.
    candidates: Vec<(u64, u64)>,
    /// A period no cut could be found in (not tried again while seeking).
    uncuttable: u64,
    locked: Option<Lock>,
    cuts: u64,
    locks: u64,
}

impl Default for PeriodDetector {
    fn default() -> Self {
        Self::new()
    }
}

/// The token of a request.
#[inline]
pub fn token(bytes: u64, kind: TensorKind, stream: StreamId) -> u64 {
    let mut h = rustc_hash::FxHasher::default();
    (bytes, kind, stream).hash(&mut h);
    mix(h.finish())
}

/// A 64-bit finalizer (spreads every input bit over the output).
#[inline]
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl PeriodDetector {
    /// A detector that has seen nothing (its tables grow with the requests
    /// it sees).
    pub fn new() -> Self {
        PeriodDetector {
            ring: Vec::new(),
            table: Vec::new(),
            seen: 0,
            window: 0,
            outgoing: (0..WINDOW).fold(1u64, |p, _| p.wrapping_mul(BASE)),
            candidates: Vec::new(),
            uncuttable: 0,
            locked: None,
            cuts: 0,
            locks: 0,
        }
    }

    /// Step ends found so far.
    pub fn cuts(&self) -> u64 {
        self.cuts
    }

    /// Times a period was confirmed (again after it was lost).
    #[cfg(test)]
    pub fn locks(&self) -> u64 {
        self.locks
    }

    /// The period steps are cut by now, if any.
    #[cfg(test)]
    pub fn period(&self) -> Option<u64> {
        self.locked.map(|l| l.period)
    }

    /// Sees a request with token `token` (see [`token`]) arriving while
    /// `live` bytes are live; returns whether a step ends before it.
    #[inline]
    pub fn observe(&mut self, token: u64, live: u64) -> bool {
        let mut cut = false;
        if let Some(l) = self.locked.as_mut() {
            if self.seen >= WINDOW as u64 && self.window == l.cut && l.cut_live.is_none_or(|v| v == live) {
                l.last = self.seen;
                self.cuts += 1;
                cut = true;
            } else if self.seen - l.last > 2 * l.period + WINDOW as u64 {
                tracing::debug!(period = l.period, at = self.seen, "the period of the requests is lost");
                self.locked = None;
                self.candidates.clear();
            }
        }
        self.push(token, live);
        if self.locked.is_none() && self.seen >= WINDOW as u64 {
            self.seek();
        }
        cut
    }

    fn push(&mut self, token: u64, live: u64) {
        let old = if self.seen >= WINDOW as u64 { self.at(self.seen - WINDOW as u64).token } else { 0 };
        self.window = self.window.wrapping_mul(BASE).wrapping_add(token).wrapping_sub(old.wrapping_mul(self.outgoing));
        let s = Seen { token, window: self.window, live };
        // The ring and the table grow with the run (a short one pays for
        // what it uses), up to their sizes.
        if self.ring.len() < RING {
            self.ring.push(s);
        } else {
            self.ring[self.seen as usize & (RING - 1)] = s;
        }
        self.seen += 1;
        if self.table.len() < TABLE && self.seen as usize * 2 > self.table.len() {
            self.grow_table();
        }
    }

    /// Doubles the table (at least [`MIN_TABLE`] slots), entering the
    /// requests remembered again.
    #[cold]
    fn grow_table(&mut self) {
        let size = (self.table.len() * 2).clamp(MIN_TABLE, TABLE);
        self.table = vec![(0, 0); size];
        let from = self.seen.saturating_sub(RING as u64).max(WINDOW as u64 - 1);
        for i in from..self.seen {
            let s = self.at(i);
            let key = s.window ^ mix(s.live);
            self.table[key as usize & (size - 1)] = (key, i + 1);
        }
    }

    #[inline]
    fn at(&self, i: u64) -> Seen {
        self.ring[i as usize & (RING - 1)]
    }

    /// Verifies the candidates against the request just pushed, locks on a
    /// confirmed one, and takes a new one from the table.
    fn seek(&mut self) {
        let i = self.seen - 1;
        let cur = self.at(i);
        let ring = &self.ring;
        self.candidates.retain_mut(|(p, agreed)| {
            let same = ring[(i - *p) as usize & (RING - 1)].token == cur.token;
            *agreed += 1;
            same
        });
        let confirmed =
            self.candidates.iter().filter(|&&(p, agreed)| agreed >= p.max(2 * WINDOW as u64)).map(|&(p, _)| p).min();
        if let Some(p) = confirmed {
            self.lock(p);
            return;
        }
        let key = cur.window ^ mix(cur.live);
        let mask = self.table.len() - 1;
        let slot = &mut self.table[key as usize & mask];
        if slot.0 == key && slot.1 > 0 {
            let p = i + 1 - slot.1;
            let new = (MIN_PERIOD..=MAX_PERIOD).contains(&p) && p != self.uncuttable;
            if new && self.candidates.len() < CANDIDATES && self.candidates.iter().all(|c| c.0 != p) {
                self.candidates.push((p, 0));
            }
        }
        *slot = (key, i + 1);
    }

    /// Locks on period `p` (confirmed at the request just pushed): the cut
    /// is the point of the last period with the fewest live bytes whose
    /// preceding window occurs once in it (or, failing that, whose window
    /// and live bytes do).
    #[cold]
    fn lock(&mut self, p: u64) {
        self.candidates.clear();
        let end = self.seen;
        // Point j: before request j, after the window ending at j - 1.
        let points = || (end - p..end).map(|j| (self.at(j - 1).window, self.at(j).live));
        let mut once: rustc_hash::FxHashMap<u64, u32> = rustc_hash::FxHashMap::default();
        let mut once_live: rustc_hash::FxHashMap<(u64, u64), u32> = rustc_hash::FxHashMap::default();
        for (w, live) in points() {
            *once.entry(w).or_default() += 1;
            *once_live.entry((w, live)).or_default() += 1;
        }
        let best = points()
            .filter(|(w, _)| once[w] == 1)
            .min_by_key(|&(_, live)| live)
            .map(|(w, _)| (w, None))
            .or_else(|| {
                points().filter(|k| once_live[k] == 1).min_by_key(|&(_, live)| live).map(|(w, live)| (w, Some(live)))
            });
        match best {
            Some((cut, cut_live)) => {
                tracing::debug!(period = p, at = end, "steps found by the period of the requests");
                self.locks += 1;
                self.locked = Some(Lock { period: p, cut, cut_live, last: end });
            }
            None => self.uncuttable = p,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `seq` (bytes, live) and returns the positions of the cuts.
    fn cuts(d: &mut PeriodDetector, seq: &[(u64, u64)]) -> Vec<usize> {
        let mut out = Vec::new();
        for (k, &(bytes, live)) in seq.iter().enumerate() {
            if d.observe(token(bytes, TensorKind::Activation, StreamId(0)), live) {
                out.push(k);
            }
        }
        out
    }

    /// A step of `n` requests whose live bytes climb and fall back: the
    /// fewest live before its first one.
    fn step(n: u64, salt: u64) -> Vec<(u64, u64)> {
        (0..n).map(|k| (1000 + k * 7 + salt, k.min(n - k) * 10)).collect()
    }

    #[test]
    fn a_repeating_sequence_is_cut_at_its_fewest_live_bytes_once_per_period() {
        let mut d = PeriodDetector::new();
        let s = step(100, 0);
        let seq: Vec<_> = (0..10).flat_map(|_| s.iter().copied()).collect();
        let c = cuts(&mut d, &seq);
        assert_eq!(d.period(), Some(100));
        assert!(!c.is_empty() && c.len() >= 6, "{c:?}");
        for w in c.windows(2) {
            assert_eq!(w[1] - w[0], 100);
        }
        assert_eq!(c[0] % 100, 0, "cut before a step's first request (the fewest live): {c:?}");
    }

    #[test]
    fn layers_that_accumulate_live_bytes_are_no_period() {
        // One long step of identical layers whose live bytes grow: the
        // windows repeat, the live bytes never do.
        let mut d = PeriodDetector::new();
        let seq: Vec<_> = (0..5000u64).map(|k| (1000 + k % 40, k * 100)).collect();
        assert!(cuts(&mut d, &seq).is_empty());
        assert_eq!(d.period(), None);
    }

    #[test]
    fn a_sequence_without_repetition_has_no_cut() {
        let mut d = PeriodDetector::new();
        let seq: Vec<_> = (0..20_000u64).map(|k| (mix(k) % 100_000, mix(k + 7) % 1000)).collect();
        assert!(cuts(&mut d, &seq).is_empty());
        assert_eq!(d.locks(), 0);
    }

    #[test]
    fn a_prefix_and_a_change_of_period_are_followed() {
        let mut d = PeriodDetector::new();
        let mut seq: Vec<(u64, u64)> = (0..777u64).map(|k| (50_000 + k, 5)).collect();
        let a = step(120, 0);
        let b = step(90, 3);
        seq.extend((0..8).flat_map(|_| a.iter().copied()));
        let switch = seq.len();
        seq.extend((0..12).flat_map(|_| b.iter().copied()));
        let c = cuts(&mut d, &seq);
        assert!(c.iter().filter(|&&k| k < switch).count() >= 4, "{c:?}");
        assert!(c.iter().all(|&k| k >= 777));
        let after: Vec<_> = c.iter().copied().filter(|&k| k > switch + 300).collect();
        assert!(after.len() >= 4, "{c:?}");
        for w in after.windows(2) {
            assert_eq!(w[1] - w[0], 90);
        }
        assert_eq!(d.period(), Some(90));
        assert_eq!(d.locks(), 2);
    }

    #[test]
    fn a_short_loop_is_no_step() {
        let mut d = PeriodDetector::new();
        let seq: Vec<_> = (0..4000u64).map(|k| (100 + k % 5, (k % 5) * 3)).collect();
        assert!(cuts(&mut d, &seq).is_empty());
    }

    #[test]
    fn a_period_whose_windows_all_repeat_is_cut_by_live_bytes_too() {
        // Tokens repeat every 40 requests, live bytes every 80: the period
        // is 80 and no window alone occurs once in it.
        let mut d = PeriodDetector::new();
        let seq: Vec<_> = (0..2000u64).map(|k| (100 + k % 40, (k % 80) * (k % 80 + 3))).collect();
        let c = cuts(&mut d, &seq);
        assert_eq!(d.period(), Some(80));
        assert!(c.len() >= 15, "{c:?}");
        for w in c.windows(2) {
            assert_eq!(w[1] - w[0], 80);
        }
    }
}
