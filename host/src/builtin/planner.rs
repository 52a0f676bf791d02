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
//! When some requests stay to the end of the profile (parameters allocated
//! once, in a whole-trace offline plan), a second order is tried as well:
//! those first, stacked in allocation order as a floor, then the rest by
//! size; the smaller arena wins (greedy by size alone can leave holes under
//! tensors that never leave: 0.6 % on one real snapshot, against 0.05 %).
//!
//! Greedy by size looks at every placed block whose lifetime overlaps the
//! one it places: its cost grows with the number of tensors live at once
//! (a step of 50,000 requests with thousands of activations live together
//! takes seconds). So a third plan is always made, in O(n log n): the step
//! replayed in time order through a best-fit allocator that knows each
//! lifetime (a free gap map by size and by offset, the arena growing at the
//! top when no gap holds a request). Requests that wrap into the next step
//! keep their block only when it is free during the next step's start too;
//! the others are left to the dynamic path. Greedy by size runs only while
//! its work — the sum of the planned lifetimes, in requests — stays within
//! [`GREEDY_WORK`]; the smallest arena of the plans made wins.
//!
//! Finding the placed blocks that overlap a lifetime `[a, e)`: those that
//! cover time `a` (a segment tree over time whose nodes hold the blocks that
//! cover them: the blocks on the root-to-leaf path of `a`) and those that
//! start in `(a, e)` (a list of placed blocks by start time). The cost is
//! O(log n) per placement plus the overlapping blocks it looks at.

use std::collections::{BTreeMap, BTreeSet};

use crate::decision::{Plan, PlanRequest, PlannerPolicy, PolicyContext, PolicyError, StepProfile};

/// Most work (the sum of the planned requests' lifetimes, in requests) for
/// which greedy by size is tried (its cost grows with it; the time-order
/// plan is made whatever the work).
pub const GREEDY_WORK: u64 = 4_000_000;

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
        let life = |k: u32| -> u64 {
            let (iv, m) = reqs[k as usize].intervals(k, n);
            iv[..m].iter().map(|&(a, b)| u64::from(b.saturating_sub(a))).sum()
        };
        let by_size = |order: &mut Vec<u32>| {
            order.sort_unstable_by_key(|&k| {
                (std::cmp::Reverse(reqs[k as usize].planned_bytes()), std::cmp::Reverse(life(k)), k)
            })
        };
        let plannable = (0..n).filter(|&k| reqs[k as usize].plannable(k));
        let sim = in_time_order(reqs);
        let work: u64 = plannable.clone().map(life).sum();
        if work > GREEDY_WORK {
            return sim;
        }
        // A plan's cost: its arena, plus the bytes it leaves to the dynamic
        // path (they need memory too); the first plan wins a tie.
        let cost = |p: &Plan| -> u64 {
            let left = (0..n).filter(|&k| reqs[k as usize].plannable(k) && p.offsets[k as usize].is_none());
            p.arena_bytes + left.map(|k| reqs[k as usize].planned_bytes()).sum::<u64>()
        };
        let mut best = sim;
        let keep = |plan: Plan, best: &mut Plan| {
            if cost(&plan) < cost(best) {
                *best = plan;
            }
        };
        let mut order: Vec<u32> = plannable.clone().collect();
        by_size(&mut order);
        keep(place(reqs, &order), &mut best);
        // The floor: requests that stay to the end of the profile, stacked in
        // allocation order below the rest (they never leave, so every gap
        // between them is lost for good).
        let (floor, mut rest): (Vec<u32>, Vec<u32>) = plannable.partition(|&k| reqs[k as usize].freed_at == Some(n));
        if !floor.is_empty() && !rest.is_empty() {
            by_size(&mut rest);
            let mut floored = floor;
            floored.extend(rest);
            keep(place(reqs, &floored), &mut best);
        }
        best
    }
}

/// Free gaps of an arena, by offset and by (size, offset).
#[derive(Default)]
struct Gaps {
    by_offset: BTreeMap<u64, u64>,
    by_size: BTreeSet<(u64, u64)>,
    top: u64,
}

impl Gaps {
    fn insert(&mut self, off: u64, size: u64) {
        self.by_offset.insert(off, size);
        self.by_size.insert((size, off));
    }

    fn remove(&mut self, off: u64, size: u64) {
        self.by_offset.remove(&off);
        self.by_size.remove(&(size, off));
    }

    /// The lowest offset of the smallest gap that holds `size`; else the
    /// top gap grown, or the top.
    fn take(&mut self, size: u64) -> u64 {
        if let Some(&(g, off)) = self.by_size.range((size, 0)..).next() {
            self.remove(off, g);
            if g > size {
                self.insert(off + size, g - size);
            }
            return off;
        }
        let off = match self.by_offset.iter().next_back().map(|(&o, &g)| (o, g)) {
            Some((o, g)) if o + g == self.top => {
                self.remove(o, g);
                o
            }
            _ => self.top,
        };
        self.top = off + size;
        off
    }

    /// Gives `[off, off + size)` back, merged with free neighbours.
    fn give(&mut self, mut off: u64, mut size: u64) {
        if let Some((&o, &g)) = self.by_offset.range(..off).next_back() {
            if o + g == off {
                self.remove(o, g);
                off = o;
                size += g;
            }
        }
        if let Some(&g) = self.by_offset.get(&(off + size)) {
            self.remove(off + size, g);
            size += g;
        }
        self.insert(off, size);
    }
}

/// Most (wrapping request, early block) pairs checked by [`in_time_order`];
/// past it, wrapping requests are left to the dynamic path.
const WRAP_CHECKS: u64 = 20_000_000;

/// The step replayed in time order through a best-fit allocator that knows
/// every lifetime (see the module documentation).
fn in_time_order(reqs: &[PlanRequest]) -> Plan {
    let n = reqs.len() as u32;
    let mut ends: Vec<Vec<u32>> = vec![Vec::new(); n as usize + 1];
    let mut gaps = Gaps::default();
    let mut offsets: Vec<Option<u64>> = vec![None; reqs.len()];
    for k in 0..n {
        for i in std::mem::take(&mut ends[k as usize]) {
            let off = offsets[i as usize].expect("placed");
            gaps.give(off, reqs[i as usize].planned_bytes());
        }
        let r = &reqs[k as usize];
        if !r.plannable(k) {
            continue;
        }
        offsets[k as usize] = Some(gaps.take(r.planned_bytes()));
        if let Some(f) = r.freed_at {
            ends[f.max(k + 1).min(n) as usize].push(k);
        }
    }
    // A wrapping request is also live in `[0, w)`: its block must not meet
    // the blocks of requests that were live then.
    let wraps: Vec<u32> =
        (0..n).filter(|&k| offsets[k as usize].is_some() && reqs[k as usize].freed_at.is_none()).collect();
    let horizon = wraps.iter().map(|&k| reqs[k as usize].wraps_to.unwrap_or(0)).max().unwrap_or(0);
    let early: Vec<u32> = (0..horizon.min(n)).filter(|&k| offsets[k as usize].is_some()).collect();
    let block = |k: u32, offsets: &[Option<u64>]| {
        let o = offsets[k as usize].unwrap_or(0);
        (o, o + reqs[k as usize].planned_bytes())
    };
    if wraps.len() as u64 * early.len() as u64 > WRAP_CHECKS {
        for &k in &wraps {
            offsets[k as usize] = None;
        }
    } else {
        for &k in &wraps {
            let w = reqs[k as usize].wraps_to.unwrap_or(0);
            let (o, e) = block(k, &offsets);
            let clash = early.iter().take_while(|&&j| j < w).any(|&j| {
                let (jo, je) = block(j, &offsets);
                j != k && offsets[j as usize].is_some() && jo < e && o < je
            });
            if clash {
                offsets[k as usize] = None;
            }
        }
    }
    let arena = (0..n).filter_map(|k| offsets[k as usize].map(|_| block(k, &offsets).1)).max().unwrap_or(0);
    Plan { arena_bytes: arena, offsets }
}

/// Places the requests of `order` one by one, each at the best-fitting gap
/// among the placed blocks whose lifetimes overlap its own.
fn place(reqs: &[PlanRequest], order: &[u32]) -> Plan {
    let n = reqs.len() as u32;
    let mut placed = Placed::new(n, reqs.len());
    let mut offsets = vec![None; reqs.len()];
    let mut arena = 0u64;
    let mut occupied = Vec::new();
    for &k in order {
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
                assert!(o.is_none() || r.plannable(k as u32), "round {round}, request {k}");
            }
            // The time-order plan alone is valid too (it is what large steps get).
            let sim = in_time_order(&p.requests);
            validate_plan(&p, &sim, u64::MAX).unwrap_or_else(|e| panic!("round {round}, in time order: {e}"));
            let left: u64 = (0..p.requests.len())
                .filter(|&k| plan.offsets[k].is_none() && p.requests[k].plannable(k as u32))
                .map(|k| p.requests[k].planned_bytes())
                .sum();
            assert!(plan.arena_bytes + left >= peak(&p), "round {round}");
        }
    }

    #[test]
    fn a_large_step_is_planned_in_time_order_and_stays_tight() {
        // 60,000 requests: nested activations (many live at once, beyond
        // greedy by size's work bound), temporaries, and a few wrapping.
        let n = 60_000u32;
        let mut rng = oorandom::Rand32::new(3);
        let mut rs = Vec::new();
        for k in 0..n {
            let bytes = 512 * u64::from(rng.rand_range(1..2048));
            let (freed_at, wraps_to) = if k < n / 2 && k % 3 == 0 {
                (Some(n - 1 - k), None)
            } else if k % 101 == 0 && k > n / 2 {
                (None, Some(4))
            } else {
                (Some((k + 1 + rng.rand_range(0..6)).min(n)), None)
            };
            rs.push(req(bytes, freed_at, wraps_to));
        }
        let p = StepProfile { step: 1, requests: rs };
        let work: u64 = (0..n)
            .map(|k| {
                let (iv, m) = p.requests[k as usize].intervals(k, n);
                iv[..m].iter().map(|&(a, b)| u64::from(b - a)).sum::<u64>()
            })
            .sum();
        assert!(work > GREEDY_WORK, "the test must exceed the greedy bound ({work})");
        let plan = GreedyPlanner::plan_profile(&p);
        validate_plan(&p, &plan, u64::MAX).unwrap();
        let lb = peak(&p);
        assert!(plan.planned() as f64 >= 0.99 * f64::from(n), "{} planned", plan.planned());
        assert!(plan.arena_bytes as f64 <= lb as f64 * 1.02, "arena {} for a peak of {lb}", plan.arena_bytes);
    }
}
