//! The built-in planner: greedy by size with best fit over lifetime
//! intervals (Pisarchyk & Lee 2020, "Efficient memory management for deep
//! neural net inference", the "greedy by size" offset calculation).
//!
//! Requests are placed in decreasing size (longer lifetimes first among
//! equals). Each goes into the smallest gap, between the blocks already
//! placed whose lifetimes overlap its own, that holds it (the lowest such gap
//! on a tie); when no gap holds it, just above the highest of them. The arena
//! is the highest end. Requests whose end of life in the step's cycle is not
//! known are left to the dynamic path.
//!
//! Finding the placed blocks that overlap a lifetime `[a, e)`: those that
//! cover time `a` (a segment tree over time whose nodes hold the blocks that
//! cover them: the blocks on the root-to-leaf path of `a`) and those that
//! start in `(a, e)` (a list of placed blocks by start time). The cost is
//! O(log n) per placement plus the overlapping blocks it looks at.

use crate::decision::{Plan, PlanRequest, PlannerPolicy, PolicyContext, PolicyError, StepProfile};

/// Greedy-by-size best-fit planner (see the module documentation).
#[derive(Debug, Clone, Copy, Default)]
pub struct GreedyPlanner;

/// A placed piece of a lifetime: its time interval and its block.
#[derive(Debug, Clone, Copy)]
struct Piece {
    item: u32,
    t0: u32,
    t1: u32,
}

/// Placed blocks, queryable by lifetime overlap.
struct Placed {
    /// Size of the time axis (a power of two ≥ the step's requests).
    width: u32,
    /// Segment tree over time: node → pieces that cover its whole range.
    nodes: Vec<Vec<u32>>,
    /// Pieces by start time.
    starts: Vec<Vec<u32>>,
    pieces: Vec<Piece>,
    /// Per item: (offset, end) once placed.
    blocks: Vec<(u64, u64)>,
    /// Per item: the query stamp that last saw it (deduplication).
    seen: Vec<u32>,
    stamp: u32,
}

impl Placed {
    fn new(n: u32, items: usize) -> Self {
        let width = n.max(1).next_power_of_two();
        Placed {
            width,
            nodes: vec![Vec::new(); 2 * width as usize],
            starts: vec![Vec::new(); width as usize + 1],
            pieces: Vec::new(),
            blocks: vec![(0, 0); items],
            seen: vec![0; items],
            stamp: 0,
        }
    }

    /// Registers `[t0, t1)` of `item` in the canonical nodes covering it.
    fn insert(&mut self, item: u32, t0: u32, t1: u32) {
        let id = self.pieces.len() as u32;
        self.pieces.push(Piece { item, t0, t1 });
        self.starts[t0 as usize].push(id);
        let (mut lo, mut hi) = (t0 + self.width, t1 + self.width);
        while lo < hi {
            if lo & 1 == 1 {
                self.nodes[lo as usize].push(id);
                lo += 1;
            }
            if hi & 1 == 1 {
                hi -= 1;
                self.nodes[hi as usize].push(id);
            }
            lo >>= 1;
            hi >>= 1;
        }
    }

    /// Calls `f` with the block of every placed item with a piece
    /// overlapping `[a, e)` (each item once per `begin_query`).
    fn overlapping(&mut self, a: u32, e: u32, out: &mut Vec<(u64, u64)>) {
        let mut visit = |placed: &mut Placed, id: u32| {
            let p = placed.pieces[id as usize];
            if p.t0 < e && a < p.t1 && placed.seen[p.item as usize] != placed.stamp {
                placed.seen[p.item as usize] = placed.stamp;
                out.push(placed.blocks[p.item as usize]);
            }
        };
        // Pieces covering time `a`.
        let mut node = (a + self.width) as usize;
        while node >= 1 {
            for i in 0..self.nodes[node].len() {
                let id = self.nodes[node][i];
                visit(self, id);
            }
            node >>= 1;
        }
        // Pieces starting in (a, e).
        for t in (a + 1)..e.min(self.width + 1) {
            for i in 0..self.starts[t as usize].len() {
                let id = self.starts[t as usize][i];
                visit(self, id);
            }
        }
    }

    fn begin_query(&mut self) {
        self.stamp = self.stamp.wrapping_add(1);
        if self.stamp == 0 {
            self.seen.iter_mut().for_each(|s| *s = 0);
            self.stamp = 1;
        }
    }
}

/// The lowest offset of the smallest gap of at least `size` bytes between
/// the (possibly overlapping) blocks `occupied`, or above them all.
fn best_fit(occupied: &mut [(u64, u64)], size: u64) -> u64 {
    occupied.sort_unstable();
    let mut best: Option<(u64, u64)> = None; // (gap, offset)
    let mut top = 0u64;
    for &(off, end) in occupied.iter() {
        if off > top {
            let gap = off - top;
            if gap >= size && best.is_none_or(|(g, _)| gap < g) {
                best = Some((gap, top));
            }
        }
        top = top.max(end);
    }
    best.map_or(top, |(_, off)| off)
}

impl GreedyPlanner {
    /// The plan of `profile` (see the module documentation).
    pub fn plan_profile(profile: &StepProfile) -> Plan {
        let reqs: &[PlanRequest] = &profile.requests;
        let n = reqs.len() as u32;
        let mut order: Vec<u32> = (0..n).filter(|&k| reqs[k as usize].plannable(k)).collect();
        let life = |k: u32| -> u64 {
            let (iv, m) = reqs[k as usize].intervals(k, n);
            iv[..m].iter().map(|&(a, b)| u64::from(b.saturating_sub(a))).sum()
        };
        order.sort_unstable_by_key(|&k| {
            (std::cmp::Reverse(reqs[k as usize].planned_bytes()), std::cmp::Reverse(life(k)), k)
        });
        let mut placed = Placed::new(n, reqs.len());
        let mut offsets = vec![None; reqs.len()];
        let mut arena = 0u64;
        let mut occupied = Vec::new();
        for k in order {
            let r = &reqs[k as usize];
            let size = r.planned_bytes();
            let (iv, m) = r.intervals(k, n);
            placed.begin_query();
            occupied.clear();
            for &(a, e) in &iv[..m] {
                if a < e {
                    placed.overlapping(a, e, &mut occupied);
                }
            }
            let off = best_fit(&mut occupied, size);
            placed.blocks[k as usize] = (off, off + size);
            for &(a, e) in &iv[..m] {
                if a < e {
                    placed.insert(k, a, e);
                }
            }
            offsets[k as usize] = Some(off);
            arena = arena.max(off + size);
        }
        Plan { arena_bytes: arena, offsets }
    }
}

impl PlannerPolicy for GreedyPlanner {
    fn name(&self) -> &str {
        "greedy"
    }

    fn plan(&mut self, profile: &StepProfile, _ctx: &PolicyContext) -> Result<Plan, PolicyError> {
        Ok(Self::plan_profile(profile))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decision::validate_plan;
    use crate::types::{StreamId, TensorKind};

    fn req(bytes: u64, freed_at: Option<u32>, wraps_to: Option<u32>) -> PlanRequest {
        PlanRequest { bytes, kind: TensorKind::Activation, stream: StreamId(0), freed_at, wraps_to }
    }

    /// Peak of the live planned bytes over the cycle: the lower bound of any arena.
    fn peak(p: &StepProfile) -> u64 {
        let n = p.requests.len() as u32;
        (0..n)
            .map(|t| {
                p.requests
                    .iter()
                    .enumerate()
                    .filter(|(k, r)| r.plannable(*k as u32))
                    .filter(|(k, r)| {
                        let (iv, m) = r.intervals(*k as u32, n);
                        iv[..m].iter().any(|&(a, b)| a <= t && t < b)
                    })
                    .map(|(_, r)| r.planned_bytes())
                    .sum::<u64>()
            })
            .max()
            .unwrap_or(0)
    }

    #[test]
    fn plans_are_valid_and_tight_on_a_forward_backward_step() {
        // A forward that saves L activations, a backward that frees them in
        // reverse with a temporary each, and a gradient live across steps.
        let l = 40u32;
        let mut rs = Vec::new();
        for i in 0..l {
            rs.push(req(1 << 20 | (i as u64 * 4096), None, None)); // activation i, freed in backward
        }
        for i in 0..l {
            let k = rs.len() as u32;
            rs.push(req(256 << 10, Some(k + 1), None)); // a temporary
            let act = (l - 1 - i) as usize;
            rs[act].freed_at = Some(k + 1);
        }
        rs.push(req(3 << 20, None, Some(l))); // a gradient freed in the next step's forward
        let p = StepProfile { step: 1, requests: rs };
        let plan = GreedyPlanner::plan_profile(&p);
        validate_plan(&p, &plan, u64::MAX).unwrap();
        assert_eq!(plan.planned(), p.requests.len());
        let lb = peak(&p);
        assert!(plan.arena_bytes as f64 <= lb as f64 * 1.05, "arena {} for a peak of {lb}", plan.arena_bytes);
    }

    #[test]
    fn unknown_lifetimes_stay_dynamic_and_random_profiles_validate() {
        let mut rng = oorandom::Rand32::new(7);
        for round in 0..50 {
            let n = 1 + rng.rand_range(1..400);
            let mut rs = Vec::new();
            for k in 0..n {
                let bytes = 1 + u64::from(rng.rand_range(1..(1 << 20)));
                let freed_at = (rng.rand_range(0..10) > 1).then(|| (k + 1 + rng.rand_range(0..40)).min(n));
                let wraps_to = (freed_at.is_none() && rng.rand_range(0..2) == 0).then(|| rng.rand_range(0..n));
                rs.push(req(bytes, freed_at, wraps_to));
            }
            let p = StepProfile { step: round, requests: rs };
            let plan = GreedyPlanner::plan_profile(&p);
            validate_plan(&p, &plan, u64::MAX).unwrap_or_else(|e| panic!("round {round}: {e}"));
            for (k, (r, o)) in p.requests.iter().zip(&plan.offsets).enumerate() {
                assert_eq!(o.is_some(), r.plannable(k as u32), "round {round}, request {k}");
            }
            assert!(plan.arena_bytes >= peak(&p));
        }
    }
}
