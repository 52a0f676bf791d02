//! # wasmem-plan-core
//!
//! The planning algorithm of wasmem's planned placement, with its own plain
//! types: the engine's built-in planner and the SDK's default planner (and
//! so the shipped `greedy-planner` component) both call [`plan`], so they
//! plan alike, plan for plan.
//!
//! A step of `n` requests is a cycle of times `0 .. n`: request `k` is
//! allocated at time `k` and occupies its block until it is freed
//! ([`Request::freed_at`]), or, when it is live at the step's end, until
//! the end and again from the next step's start until [`Request::wraps_to`].
//!
//! **Greedy by size with best fit over lifetime intervals** (Pisarchyk &
//! Lee 2020, "Efficient memory management for deep neural net inference",
//! the "greedy by size" offset calculation). Requests are placed in
//! decreasing planned size (longer lifetimes first among equals, then by
//! index). Each goes into the smallest gap, between the blocks already
//! placed whose lifetimes overlap its own, that holds it (the lowest such
//! gap on a tie); when no gap holds it, just above the highest of them. The
//! arena is the highest end. Requests whose end of life in the cycle is not
//! known ([`Request::plannable`]) are left unplanned.
//!
//! [`plan`] makes several plans and keeps the cheapest (its arena plus
//! the bytes it leaves to the dynamic path; the first on a tie), stopping
//! as soon as one costs the [`live_bound`], which no plan can beat:
//!
//! 1. always, in O(n log n), [`in_time_order`]: the step replayed in time
//!    order through a best-fit allocator that knows each lifetime (a free
//!    gap map by size and by offset, the arena growing at the top when no
//!    gap holds a request). Requests that wrap into the next step keep
//!    their block only when it is free during the next step's start too;
//!    the others are left unplanned;
//! 2. greedy by size, while its work — the sum of the planned lifetimes,
//!    in requests — stays within [`GREEDY_WORK`] (its cost grows with the
//!    number of tensors live at once);
//! 3. when some requests stay to the end of the profile (parameters in a
//!    whole-trace offline plan): those first, stacked in allocation order
//!    as a floor, then the rest by size (greedy by size alone can leave
//!    holes under tensors that never leave);
//! 4. within [`SEARCH_VISITS`] block visits per request (a step of at most
//!    2,048 requests; a longer one gets the visits of at most 8,192, and
//!    its placements cost the visits its first one made): *peak first* —
//!    the requests live at the first time the live bound is reached (every
//!    plan that costs the bound packs them below it) placed first, in
//!    allocation order or the longer-lived first, then the others by size
//!    or by size times lifetime (greedy by size alone often leaves a gap
//!    under one of them that none of the others fits: an AdamW step 5 %
//!    above the bound, planned at it so);
//!    2 and 3 again with requests of equal size in
//!    time order instead of longer lifetimes first (either order can be a
//!    few per cent above the bound where the other meets it: a GPT-2 step
//!    of batch 2 × 256, 1.070 and 1.011), then a search from the best
//!    greedy order (pairs of nearby requests swapped, deterministic
//!    pseudo-random choices, at most [`SEARCH_ROUNDS`] rounds), keeping an
//!    order whose plan costs no more;
//! 5. within the same budget, the time-order plan's blocks from the bottom
//!    up as one more greedy order (it places close to that plan), and the
//!    search starts from the cheapest greedy order, even when the time-order
//!    plan costs less (the search may end below it). A search round keeps
//!    an order whose plan costs less, or as much with fewer bytes above the
//!    live bound. [`plan_with`] takes another budget ([`Effort`]): offline,
//!    a longer search reaches the bound more often.
//!
//! Finding the placed blocks that overlap a lifetime `[a, e)`: those that
//! cover time `a` (a segment tree over time whose nodes hold the pieces
//! that cover their whole range: the nodes on the root-to-leaf path of `a`)
//! and those that start in `(a, e)` (a list of placed pieces by start
//! time). The cost is O(log n) per placement plus the overlapping blocks it
//! looks at. Steps of at most 2,048 requests scan every placed block
//! instead (kept in offset order): quadratic, but faster at that size, and
//! the same blocks are found; the scan computes the best fit as it meets
//! them, in the order it would sort them in.

#![no_std]
#![warn(missing_docs)]

extern crate alloc;

mod aliased;
pub use aliased::{aliased, aliased_with, swap_zones, AliasedPlan, ALIASED_WORK, PAGE};

use alloc::collections::{BTreeMap, BTreeSet};
use alloc::vec;
use alloc::vec::Vec;

/// Most work (the sum of the planned requests' lifetimes, in requests) for
/// which greedy by size is tried by [`plan`] (its cost grows with it; the
/// time-order plan is made whatever the work).
pub const GREEDY_WORK: u64 = 4_000_000;

/// Most (wrapping request, early block) pairs checked by [`in_time_order`];
/// past it, wrapping requests are left unplanned.
pub const WRAP_CHECKS: u64 = 20_000_000;

/// Alignment of every planned offset, and the rounding of every planned request.
pub const ALIGN: u64 = 512;

/// Most requests [`greedy_by_size`] plans; a longer profile is left
/// entirely unplanned (time is indexed by `u32`, the segment tree by a
/// power of two above the count).
pub const MAX_REQUESTS: usize = 1 << 30;

/// One request of a step, as the planner sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    /// Requested bytes.
    pub bytes: u64,
    /// When it was freed: the index of the first request allocated after
    /// its free; `None`: still live at the end of the step.
    pub freed_at: Option<u32>,
    /// For a request live at the step's end: the time in the next step at
    /// which the same request of the previous step was freed; `None`: not known.
    pub wraps_to: Option<u32>,
}

impl Request {
    /// The bytes its planned block takes: [`Request::bytes`] rounded up to
    /// [`ALIGN`] (saturating at the largest multiple of [`ALIGN`]).
    pub fn planned_bytes(&self) -> u64 {
        self.bytes.div_ceil(ALIGN).checked_mul(ALIGN).unwrap_or(u64::MAX - (ALIGN - 1))
    }

    /// Whether request `k` (this one) has a known lifetime in the step's
    /// cycle: freed within the step, or live at the end and freed in the
    /// next step before that step's request `k` (otherwise two instances of
    /// it would be live at once). Only such requests can be planned.
    pub fn plannable(&self, k: u32) -> bool {
        self.freed_at.is_some() || self.wraps_to.is_some_and(|w| w <= k)
    }

    /// The time intervals it occupies in the cycle of a step of `n`
    /// requests (`k < n`: its index): one, or two when it wraps. A free
    /// after the step's end counts as the end (`n`).
    pub fn intervals(&self, k: u32, n: u32) -> ([(u32, u32); 2], usize) {
        match (self.freed_at, self.wraps_to) {
            (Some(f), _) => ([(k, f.max(k + 1).min(n.max(k + 1))), (0, 0)], 1),
            (None, Some(w)) if w > 0 => ([(k, n), (0, w.min(k))], if w.min(k) > 0 { 2 } else { 1 }),
            (None, _) => ([(k, n), (0, 0)], 1),
        }
    }

    /// Times of the cycle it occupies (the sum of its intervals' lengths).
    pub fn lifetime(&self, k: u32, n: u32) -> u64 {
        let (iv, m) = self.intervals(k, n);
        iv[..m].iter().map(|&(a, b)| u64::from(b.saturating_sub(a))).sum()
    }
}

/// Where each request of a step goes in one arena.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Plan {
    /// Bytes of the arena: the highest end of a planned block.
    pub arena_bytes: u64,
    /// The offset of each request, in order; `None`: not planned.
    pub offsets: Vec<Option<u64>>,
}

/// A placed piece of a lifetime: its item and time interval.
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
    /// What the queries so far cost: the pieces they visited and the
    /// start times they stepped through.
    visits: u64,
    /// Scratch: the blocks a query found, packed for sorting.
    keys: Vec<u64>,
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
            visits: 0,
            keys: Vec::new(),
        }
    }

    /// Registers `[t0, t1)` of `item` (`t0 < t1 ≤ width`) in the canonical
    /// nodes covering it.
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

    /// Adds to `out` the block of every placed item with a piece
    /// overlapping `[a, e)` (each item once per `begin_query`).
    fn overlapping_piece(&mut self, a: u32, e: u32, out: &mut Vec<(u64, u64)>) {
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
            self.visits += 1 + self.nodes[node].len() as u64;
            for i in 0..self.nodes[node].len() {
                let id = self.nodes[node][i];
                visit(self, id);
            }
            node >>= 1;
        }
        // Pieces starting in (a, e).
        for t in (a + 1)..e.min(self.width + 1) {
            self.visits += 1 + self.starts[t as usize].len() as u64;
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
    // By offset alone: blocks of one offset may meet in any order (the
    // running top is their highest end either way).
    occupied.sort_unstable_by_key(|b| b.0);
    let mut fit = Fit::default();
    for &(off, end) in occupied.iter() {
        fit.meet(off, end, size);
    }
    fit.offset()
}

/// The plan of a step's `requests`: the cheapest of the plans described in
/// the crate documentation. Deterministic; every planned request is
/// [`Request::plannable`]. A profile of more than [`MAX_REQUESTS`] requests
/// gets an empty plan (nothing planned).
pub fn plan(requests: &[Request]) -> Plan {
    plan_with(requests, Effort::ONLINE)
}

/// How much [`plan_with`] may search beyond the plans it always makes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Effort {
    /// Block visits per planned request for the extra greedy orders and
    /// the search (a greedy plan of `m` planned requests costs about
    /// `m² / 2` visits).
    pub visits: u64,
    /// Most rounds of the search.
    pub rounds: u64,
    /// Most requests of a step that gets the extra orders and the search.
    pub requests: usize,
}

impl Effort {
    /// What [`plan`] spends, within the engine's planning deadline:
    /// [`SEARCH_VISITS`], [`SEARCH_ROUNDS`], steps of at most 2,048 requests
    /// (a longer step: the visits of 8,192 requests at most).
    pub const ONLINE: Effort = Effort { visits: SEARCH_VISITS, rounds: SEARCH_ROUNDS, requests: SCAN_REQUESTS };

    /// [`Effort::ONLINE`] with `k` times its visits and rounds, for
    /// steps of up to `k` times its requests (saturating; `k = 1` is
    /// [`Effort::ONLINE`]): what an offline plan, with no deadline, may spend.
    pub const fn times(k: u64) -> Effort {
        let k = if k == 0 { 1 } else { k };
        Effort {
            visits: SEARCH_VISITS.saturating_mul(k),
            rounds: SEARCH_ROUNDS.saturating_mul(k),
            requests: SCAN_REQUESTS.saturating_mul(if k > usize::MAX as u64 { usize::MAX } else { k as usize }),
        }
    }
}

/// [`plan`] with the search budget `effort` instead of [`Effort::ONLINE`]:
/// the same plans in the same order, and a longer search. Deterministic.
pub fn plan_with(requests: &[Request], effort: Effort) -> Plan {
    match begin(requests, effort) {
        Begun::Planned(plan) => plan,
        Begun::Searching { sim, mut search, rounds } => {
            search.run(requests, rounds);
            search.or(requests, sim)
        }
    }
}

/// Where [`begin`] leaves a plan: made, or a search to run.
enum Begun {
    /// No search: the plan.
    Planned(Plan),
    /// The time-order plan, and a search from the cheapest greedy order
    /// with the rounds the budget leaves it.
    Searching { sim: Plan, search: Search, rounds: u64 },
}

/// A plan's cost: its arena, plus the bytes it leaves to the dynamic path
/// (they need memory too; a request without an offset entry is left).
fn cost(reqs: &[Request], p: &Plan) -> u64 {
    let n = reqs.len() as u32;
    let left =
        (0..n).filter(|&k| reqs[k as usize].plannable(k) && p.offsets.get(k as usize).is_none_or(Option::is_none));
    left.map(|k| reqs[k as usize].planned_bytes()).fold(p.arena_bytes, u64::saturating_add)
}

/// [`plan_with`] up to its search.
fn begin(requests: &[Request], effort: Effort) -> Begun {
    if requests.len() > MAX_REQUESTS {
        return Begun::Planned(Plan { arena_bytes: 0, offsets: vec![None; requests.len()] });
    }
    let reqs = requests;
    let n = reqs.len() as u32;
    let life = |k: u32| reqs[k as usize].lifetime(k, n);
    // By size; among equals longer lifetimes first, or in time order.
    let by_size = |order: &mut Vec<u32>, by_life: bool| {
        order.sort_unstable_by_key(|&k| {
            let l = if by_life { life(k) } else { 0 };
            (core::cmp::Reverse(reqs[k as usize].planned_bytes()), core::cmp::Reverse(l), k)
        })
    };
    let plannable = (0..n).filter(|&k| reqs[k as usize].plannable(k));
    let sim = in_time_order(reqs);
    let work: u64 = plannable.clone().map(life).fold(0, u64::saturating_add);
    if work > GREEDY_WORK {
        return Begun::Planned(sim);
    }
    // The first plan wins a tie.
    let cost = |p: &Plan| cost(reqs, p);
    // No plan costs less than the most planned bytes live at once: once a
    // plan costs that, the later ones cannot win (the first wins a tie).
    let bound = live_bound(reqs);
    if cost(&sim) <= bound {
        return Begun::Planned(sim);
    }
    // The best greedy plan so far and its order: the search starts from
    // it, even when the time-order plan costs less (it may end below).
    let mut greedy: Option<(Plan, Vec<u32>)> = None;
    // The floor: requests that stay to the end of the profile, stacked in
    // allocation order below the rest (they never leave, so every gap
    // between them is lost for good).
    let (floor_reqs, rest): (Vec<u32>, Vec<u32>) =
        plannable.clone().partition(|&k| reqs[k as usize].freed_at == Some(n));
    let floored = !floor_reqs.is_empty() && !rest.is_empty();
    // Greedy by size; then, in a short step (scanned, a greedy plan costs
    // about m²/2 block visits for m planned requests), the peak-first
    // orders, greedy by size with the other order among requests of a size
    // (which of them goes lower decides what fits beside them later: either
    // can be a few per cent off the bound) and with the floor, then a
    // search, all within the effort's visits per request.
    //
    // Peak first: the requests live at the first time the live bound is
    // reached lie below the bound in every plan that costs it, so they go
    // first — in allocation order (a staircase: the earlier, the lower), or
    // the longer-lived lower — then the others by size, or by size times
    // lifetime (those that block time longest lower). Greedy by size often
    // leaves a gap under a peak tensor that none of the others fits.
    let m = plannable.clone().count() as u64;
    // (A step longer than the effort's: what its first order cost,
    // measured; a shorter one keeps a scan's cost, whichever placed it.)
    let long = reqs.len() > effort.requests;
    let mut round = (m * m / 2).max(1);
    let whole = budget(reqs.len(), m, effort);
    let mut budget = whole;
    let peak = live_peak(reqs).1;
    // Whether the placements after the first scan every placed block (see
    // [`scans`]): the same plans, sooner.
    let mut scan = false;
    let (at_peak, off_peak): (Vec<u32>, Vec<u32>) = plannable.clone().partition(|&k| {
        let (iv, m) = reqs[k as usize].intervals(k, n);
        iv[..m].iter().any(|&(a, e)| a <= peak && peak < e)
    });
    for order_by in ORDERS {
        let order = match order_by {
            Order::Size { floor: true, .. } if !floored => continue,
            Order::Peak { .. } if at_peak.is_empty() || off_peak.is_empty() => continue,
            // (By size with longer lifetimes first, with or without the
            // floor: always.)
            Order::Size { by_life: false, .. } | Order::Peak { .. } if budget < round => continue,
            Order::Size { floor, by_life } => {
                if !by_life {
                    budget -= round;
                }
                let mut order: Vec<u32> = if floor { rest.clone() } else { plannable.clone().collect() };
                by_size(&mut order, by_life);
                if floor {
                    order.splice(0..0, floor_reqs.iter().copied());
                }
                order
            }
            Order::Peak { by_alloc, by_area } => {
                budget -= round;
                let mut order = at_peak.clone();
                if !by_alloc {
                    order.sort_by_key(|&k| core::cmp::Reverse(life(k)));
                }
                let mut rest = off_peak.clone();
                if by_area {
                    let area = |k: u32| u128::from(reqs[k as usize].planned_bytes()) * u128::from(life(k));
                    rest.sort_unstable_by_key(|&k| (core::cmp::Reverse(area(k)), k));
                } else {
                    by_size(&mut rest, true);
                }
                order.extend(rest);
                order
            }
        };
        let (plan, visits) =
            if greedy.is_none() { place_costed(reqs, &order) } else { (place(reqs, &order, scan), None) };
        if greedy.is_none() {
            scan = scans(visits, m);
        }
        if let Some(v) = visits.filter(|_| long && greedy.is_none()) {
            round = v.max(1);
        }
        if cost(&plan) <= bound {
            return Begun::Planned(plan);
        }
        if greedy.as_ref().is_none_or(|(g, _)| cost(&plan) < cost(g)) {
            greedy = Some((plan, order));
        }
    }
    // The time-order plan's layout as an order: its blocks from the bottom
    // up, placed greedily (a plan close to it, which the search can then
    // improve where the time order itself cannot be searched). Kept over
    // the greedy orders on a tie.
    if budget >= round {
        budget -= round;
        let mut order: Vec<u32> = plannable.clone().filter(|&k| sim.offsets[k as usize].is_some()).collect();
        order.sort_unstable_by_key(|&k| (sim.offsets[k as usize], k));
        let plan = place(reqs, &order, scan);
        if cost(&plan) <= bound {
            return Begun::Planned(plan);
        }
        if greedy.as_ref().is_none_or(|(g, _)| cost(&plan) <= cost(g)) {
            greedy = Some((plan, order));
        }
    }
    let Some((g, order)) = greedy else { return Begun::Planned(sim) };
    // Later budgets (a [`Refiner`]'s): the whole budget in rounds.
    let per_budget = effort.rounds.min(whole / round);
    let search = Search::new(reqs, order, g, bound, per_budget, scan);
    Begun::Searching { sim, search, rounds: effort.rounds.min(budget / round) }
}

/// The greedy orders [`plan_with`] tries, in this order: by size with the
/// longer-lived first (with and without the floor) always, the others
/// within its budget.
#[derive(Clone, Copy)]
enum Order {
    /// By decreasing size; among equals the longer-lived first (`by_life`),
    /// or in time order; with `floor`, the requests that stay to the
    /// profile's end first, in allocation order.
    Size { floor: bool, by_life: bool },
    /// The requests live at the live peak first, in allocation order
    /// (`by_alloc`) or the longer-lived first; then the others by size
    /// ([`Order::Size`]) or by size times lifetime (`by_area`).
    Peak { by_alloc: bool, by_area: bool },
}

const ORDERS: [Order; 8] = [
    Order::Size { floor: false, by_life: true },
    Order::Peak { by_alloc: true, by_area: false },
    Order::Peak { by_alloc: false, by_area: false },
    Order::Peak { by_alloc: true, by_area: true },
    Order::Peak { by_alloc: false, by_area: true },
    Order::Size { floor: false, by_life: false },
    Order::Size { floor: true, by_life: true },
    Order::Size { floor: true, by_life: false },
];

/// Block visits per planned request that [`plan`] may spend, in a step of
/// at most 2,048 requests (a longer one: those of 8,192 at most, each
/// placement costed by what its first one visited), on greedy plans beyond
/// the two it always makes and on the search after them (a linear budget, like the engine's
/// planning deadline: about 5 µs per request natively).
pub const SEARCH_VISITS: u64 = 1_000;

/// Most rounds of that search.
pub const SEARCH_ROUNDS: u64 = 256;

/// A search from a greedy order that improves its plan while it costs
/// more than the live `bound`: each round swaps one to three requests of
/// the order with one up to 16 places later (deterministic pseudo-random
/// choices) and places it again, keeping the new order when its plan costs
/// less, or as much with no more bytes above the bound (the sum, over the
/// planned blocks, of what lies above it: on a plateau of equal cost the
/// search moves towards plans whose top blocks shrink, where a lower arena
/// lies). It can go on later where it stopped ([`Refiner`]).
#[derive(Debug, Clone)]
struct Search {
    order: Vec<u32>,
    trial: Vec<u32>,
    best: Plan,
    /// The best plan's cost and bytes above the bound.
    best_cost: (u64, u64),
    bound: u64,
    /// The xorshift64 state: the same choices on every machine, in every
    /// language's build of this crate.
    x: u64,
    /// Rounds in one whole budget (a later call's).
    per_budget: u64,
    /// Whether its placements scan every placed block ([`scans`]).
    scan: bool,
}

impl Search {
    fn new(reqs: &[Request], order: Vec<u32>, best: Plan, bound: u64, per_budget: u64, scan: bool) -> Self {
        let best_cost = (cost(reqs, &best), Self::excess(reqs, &best, bound));
        let trial = order.clone();
        Search { order, trial, best, best_cost, bound, x: 0x9E37_79B9_7F4A_7C15, per_budget, scan }
    }

    /// Bytes of `p`'s blocks above `bound`.
    fn excess(reqs: &[Request], p: &Plan, bound: u64) -> u64 {
        p.offsets
            .iter()
            .zip(reqs)
            .filter_map(|(o, r)| o.map(|o| o.saturating_add(r.planned_bytes()).saturating_sub(bound)))
            .sum()
    }

    fn next(&mut self, m: usize) -> usize {
        self.x ^= self.x << 13;
        self.x ^= self.x >> 7;
        self.x ^= self.x << 17;
        (self.x % m as u64) as usize
    }

    /// Whether the search is over: its plan costs the bound, or it has
    /// nothing to swap.
    fn over(&self) -> bool {
        self.best_cost.0 <= self.bound || self.order.len() < 2
    }

    /// At most `rounds` more rounds.
    fn run(&mut self, reqs: &[Request], rounds: u64) {
        let len = self.order.len();
        for _ in 0..rounds {
            if self.over() {
                break;
            }
            self.trial.copy_from_slice(&self.order);
            for _ in 0..1 + self.next(3) {
                let i = self.next(len);
                let j = (i + 1 + self.next(16)).min(len - 1);
                self.trial.swap(i, j);
            }
            let plan = place(reqs, &self.trial, self.scan);
            let c = (cost(reqs, &plan), Self::excess(reqs, &plan, self.bound));
            if c <= self.best_cost {
                self.best_cost = c;
                self.best = plan;
                core::mem::swap(&mut self.order, &mut self.trial);
            }
        }
    }

    /// Its plan when it costs less than `sim`, else `sim` (the time-order
    /// plan wins a tie: it was made first).
    fn or(self, reqs: &[Request], sim: Plan) -> Plan {
        if self.best_cost.0 < cost(reqs, &sim) {
            self.best
        } else {
            sim
        }
    }
}

/// A plan's search that goes on, one budget at a time, where [`plan_with`]
/// stopped: what a planner can do at the step ends of a run after it
/// planned a step (each call as long as that planning's search), to find a
/// cheaper plan for the next run (a plan cache). Deterministic: after `t`
/// calls, the same plan on every machine.
#[derive(Debug, Clone)]
pub struct Refiner {
    reqs: Vec<Request>,
    search: Option<Search>,
    /// The cheapest plan so far (what [`plan_with`] returned, at first).
    best: Plan,
    best_cost: u64,
}

impl Refiner {
    /// The search of `plan_with(requests, effort)`, at the point where it
    /// returned ([`Refiner::plan`] is its plan).
    pub fn new(requests: &[Request], effort: Effort) -> Self {
        let (best, search) = match begin(requests, effort) {
            Begun::Planned(plan) => (plan, None),
            Begun::Searching { sim, mut search, rounds } => {
                search.run(requests, rounds);
                let best = if search.best_cost.0 < cost(requests, &sim) { search.best.clone() } else { sim };
                (best, Some(search))
            }
        };
        let best_cost = cost(requests, &best);
        Refiner { reqs: requests.to_vec(), search: search.filter(|s| !s.over() && s.per_budget > 0), best, best_cost }
    }

    /// A search from `plan`, a plan of `requests` made before (by an
    /// earlier run, say): its blocks from the bottom up as the order to
    /// search from; [`Refiner::refine`] finds plans cheaper than `plan`
    /// (nothing, when it does not have one offset per request). `searched`:
    /// the calls spent searching from it before (earlier runs): the search
    /// takes other choices than theirs.
    pub fn resume(requests: &[Request], plan: &Plan, effort: Effort, searched: u64) -> Self {
        let best_cost = cost(requests, plan);
        let done = Refiner { reqs: Vec::new(), search: None, best: plan.clone(), best_cost };
        if plan.offsets.len() != requests.len() || requests.len() > MAX_REQUESTS {
            return done;
        }
        let n = requests.len() as u32;
        let plannable = (0..n).filter(|&k| requests[k as usize].plannable(k));
        let m = plannable.clone().count() as u64;
        let whole = budget(requests.len(), m, effort);
        let bound = live_bound(requests);
        if whole == 0 || best_cost <= bound {
            return done;
        }
        let mut order: Vec<u32> = plannable.filter(|&k| plan.offsets[k as usize].is_some()).collect();
        order.sort_unstable_by_key(|&k| (plan.offsets[k as usize], k));
        let (start, visits) = place_costed(requests, &order);
        let long = requests.len() > effort.requests;
        let per_budget = whole / visits.filter(|_| long).unwrap_or(m * m / 2).max(1);
        if per_budget == 0 {
            return done;
        }
        let mut search = Search::new(requests, order, start, bound, effort.rounds.min(per_budget), scans(visits, m));
        // (splitmix64 of the calls: a nonzero xorshift state of its own.)
        let mut z = searched.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        search.x = (z ^ (z >> 31)).max(1);
        Refiner { reqs: requests.to_vec(), search: Some(search).filter(|s| !s.over()), ..done }
    }

    /// The cheapest plan so far.
    pub fn plan(&self) -> &Plan {
        &self.best
    }

    /// Whether searching more cannot find a cheaper plan (the plan costs
    /// the live bound, or there is no search: a step too large for it, or
    /// planned without one).
    pub fn done(&self) -> bool {
        self.search.is_none()
    }

    /// Searches one more budget; the new plan when it is cheaper than the
    /// one before (it plans the same requests, every planned one
    /// [`Request::plannable`]).
    pub fn refine(&mut self) -> Option<Plan> {
        let search = self.search.as_mut()?;
        search.run(&self.reqs, search.per_budget);
        let found = (search.best_cost.0 < self.best_cost).then(|| search.best.clone());
        if search.over() {
            self.search = None;
        }
        let plan = found?;
        self.best_cost = cost(&self.reqs, &plan);
        self.best = plan.clone();
        Some(plan)
    }
}

/// The most planned bytes of the plannable requests live at one time of
/// the cycle: a lower bound of every plan's cost. O(n).
pub fn live_bound(requests: &[Request]) -> u64 {
    live_peak(requests).0
}

/// [`live_bound`], and the first time of the cycle at which it is live.
fn live_peak(requests: &[Request]) -> (u64, u32) {
    let n = requests.len() as u32;
    // Signed changes of the live bytes at each time (wrapping adds).
    let mut delta = vec![0i128; requests.len() + 1];
    for (k, r) in requests.iter().enumerate() {
        let k = k as u32;
        if !r.plannable(k) {
            continue;
        }
        let (iv, m) = r.intervals(k, n);
        for &(a, e) in &iv[..m] {
            if a < e {
                delta[a as usize] += i128::from(r.planned_bytes());
                delta[e as usize] -= i128::from(r.planned_bytes());
            }
        }
    }
    let (mut live, mut most, mut at) = (0i128, 0i128, 0u32);
    for (t, d) in delta.into_iter().enumerate() {
        live += d;
        if live > most {
            (most, at) = (live, t as u32);
        }
    }
    (u64::try_from(most).unwrap_or(u64::MAX), at)
}

/// Whether a profile is two like steps: an even number of requests whose
/// second half asks, position by position, the planned bytes of the first
/// (what the engine profiles when it plans two training steps at a time).
pub fn halves_alike(reqs: &[Request]) -> bool {
    let h = reqs.len() / 2;
    h > 0 && reqs.len().is_multiple_of(2) && (0..h).all(|k| reqs[k].planned_bytes() == reqs[k + h].planned_bytes())
}

/// Greedy by size alone (the second plan of [`plan`], whatever its work):
/// the plannable requests in decreasing planned size (longer lifetimes
/// first among equals, then by index), each at the best-fitting gap.
pub fn greedy_by_size(requests: &[Request]) -> Plan {
    if requests.len() > MAX_REQUESTS {
        return Plan { arena_bytes: 0, offsets: vec![None; requests.len()] };
    }
    let n = requests.len() as u32;
    let mut order: Vec<u32> = (0..n).filter(|&k| requests[k as usize].plannable(k)).collect();
    order.sort_unstable_by_key(|&k| {
        let r = &requests[k as usize];
        (core::cmp::Reverse(r.planned_bytes()), core::cmp::Reverse(r.lifetime(k, n)), k)
    });
    place(requests, &order, false)
}

/// Places the requests of `order` one by one, each at the best-fitting gap
/// among the placed blocks whose lifetimes overlap its own; with `scan`
/// (or in a step of at most [`SCAN_REQUESTS`]) by scanning every placed
/// block ([`Scan`]), else with the segment tree ([`Placed`]): the same plan.
fn place(reqs: &[Request], order: &[u32], scan: bool) -> Plan {
    if scan {
        place_with(reqs, order, &mut Scan::default())
    } else {
        place_costed(reqs, order).0
    }
}

/// Whether the placements of a step whose placement of `m` planned
/// requests cost `visits` ([`place_costed`]) are sooner done by scanning
/// every placed block: when the segment tree's visits (in scan visits)
/// were more than a scan's m²/2. Where most blocks live at once (a step
/// of two like halves, each with activations live over most of it), the
/// tree finds nearly every placed block in each query and then sorts them.
fn scans(visits: Option<u64>, m: u64) -> bool {
    visits.is_some_and(|v| v > m.saturating_mul(m) / 2)
}

/// [`place`], and for a step longer than [`SCAN_REQUESTS`] what it cost in
/// scan visits (the round of a step longer than its effort's, see
/// [`budget`]): the segment tree's visits times [`TREE_VISIT`] (`None`: a
/// scanned step, whose placement costs about m²/2 visits for m requests).
fn place_costed(reqs: &[Request], order: &[u32]) -> (Plan, Option<u64>) {
    let n = reqs.len() as u32;
    if reqs.len() <= SCAN_REQUESTS {
        (place_with(reqs, order, &mut Scan::default()), None)
    } else {
        let mut placed = Placed::new(n, reqs.len());
        let plan = place_with(reqs, order, &mut placed);
        (plan, Some(placed.visits.saturating_mul(TREE_VISIT)))
    }
}

/// What one visit of the segment tree costs in visits of a scan (a piece
/// met or a start time stepped through, against a placed block compared:
/// 7–10 ns against 1.1–1.5 ns natively on recorded steps of 982–3,374
/// requests, 11–14 ns against 1.7–2 ns on synthetic ones of 1,500–50,000).
const TREE_VISIT: u64 = 6;

/// The visits [`plan_with`] may spend on a step of `len` requests, `m` of
/// them plannable, beyond the plans it always makes: [`Effort::visits`]
/// per planned request, in a step of at most [`Effort::requests`]; a
/// longer one (placed with the segment tree, whose placements cost what
/// the requests' lifetimes overlap, not a scan's m²/2) gets the visits of
/// [`LONG_STEP`] times [`Effort::requests`] requests, whatever its length,
/// each placement costed by what its first one visited (within the
/// effort's requests, a placement costs m²/2 as before: offline, the
/// profiles of whole traces would search for longer and plan no better):
/// a recorded ViT step of 3,374 requests costs 7.6 M a placement, so it
/// gets one greedy order more (it plans at its bound then, 2.7 % below
/// the plans it always makes).
fn budget(len: usize, m: u64, effort: Effort) -> u64 {
    if len <= effort.requests {
        effort.visits.saturating_mul(m)
    } else if len <= SCAN_REQUESTS {
        0
    } else {
        effort.visits.saturating_mul((effort.requests as u64).saturating_mul(LONG_STEP))
    }
}

/// See [`budget`]: 8.2 M visits at [`Effort::ONLINE`] (about 10 ms natively).
const LONG_STEP: u64 = 4;

/// Most requests [`place`] handles by scanning every placed block (kept in
/// offset order, [`Scan`]) instead of querying the segment tree
/// ([`Placed`]): faster for short steps, quadratic in the requests. Both
/// find the same blocks.
const SCAN_REQUESTS: usize = 2048;

/// Where the placed blocks are kept, to find those whose lifetimes overlap.
trait Blocks {
    /// Adds to `out` every placed block overlapping the intervals `iv`, each once.
    fn overlapping(&mut self, iv: &[(u32, u32)], out: &mut Vec<(u64, u64)>);
    /// Keeps request `k`'s block `[off, end)` over its intervals `iv`.
    fn keep(&mut self, k: u32, iv: &[(u32, u32)], off: u64, end: u64);
    /// [`best_fit`] of `size` bytes among the placed blocks overlapping
    /// the intervals `iv` (`scratch`: a buffer to collect them in).
    fn fit(&mut self, iv: &[(u32, u32)], size: u64, scratch: &mut Vec<(u64, u64)>) -> u64 {
        scratch.clear();
        self.overlapping(iv, scratch);
        best_fit(scratch, size)
    }
}

/// The running state of [`best_fit`] over blocks met in (offset, end) order.
#[derive(Default)]
struct Fit {
    /// The smallest gap that holds the request so far: (gap, offset).
    best: Option<(u64, u64)>,
    /// The highest end met so far.
    top: u64,
}

impl Fit {
    /// Meets the next block `[off, end)` (in (offset, end) order).
    #[inline(always)]
    fn meet(&mut self, off: u64, end: u64, size: u64) {
        if off > self.top {
            let gap = off - self.top;
            if gap >= size && self.best.is_none_or(|(g, _)| gap < g) {
                self.best = Some((gap, self.top));
            }
        }
        self.top = self.top.max(end);
    }

    /// Whether the best gap so far holds exactly `size` (none can beat it).
    #[inline(always)]
    fn exact(&self, size: u64) -> bool {
        self.best.is_some_and(|(g, _)| g == size)
    }

    /// The offset found: the best gap's, or above every block met.
    fn offset(&self) -> u64 {
        self.best.map_or(self.top, |(_, off)| off)
    }
}

impl Blocks for Placed {
    fn overlapping(&mut self, iv: &[(u32, u32)], out: &mut Vec<(u64, u64)>) {
        self.begin_query();
        for &(a, e) in iv.iter().filter(|(a, e)| a < e) {
            self.overlapping_piece(a, e, out);
        }
    }

    /// [`best_fit`], with the blocks sorted as one `u64` each where their
    /// offsets and ends are whole [`ALIGN`]s below 2^32 of them (the
    /// tree's blocks always are, but for arenas of 2 TiB and more): half
    /// the bytes to move, one comparison each.
    fn fit(&mut self, iv: &[(u32, u32)], size: u64, scratch: &mut Vec<(u64, u64)>) -> u64 {
        scratch.clear();
        self.overlapping(iv, scratch);
        let fits = |&(o, e): &(u64, u64)| o % ALIGN == 0 && e % ALIGN == 0 && e / ALIGN <= u64::from(u32::MAX);
        if !scratch.iter().all(fits) {
            return best_fit(scratch, size);
        }
        self.keys.clear();
        self.keys.extend(scratch.iter().map(|&(o, e)| ((o / ALIGN) << 32) | (e / ALIGN)));
        self.keys.sort_unstable();
        let mut fit = Fit::default();
        for &k in &self.keys {
            fit.meet((k >> 32) * ALIGN, (k & u64::from(u32::MAX)) * ALIGN, size);
        }
        fit.offset()
    }

    fn keep(&mut self, k: u32, iv: &[(u32, u32)], off: u64, end: u64) {
        self.blocks[k as usize] = (off, end);
        for &(a, e) in iv.iter().filter(|(a, e)| a < e) {
            self.insert(k, a, e);
        }
    }
}

/// The placed blocks in (offset, end) order, each with its intervals: what
/// they overlap is found by a scan, in the order [`best_fit`] sorts them
/// in. Kept in runs of fewer than [`RUN_CAP`] blocks: keeping a block
/// moves the blocks of one run, not of all.
#[derive(Default)]
struct Scan(Vec<Vec<ScanBlock>>);

/// Blocks of a [`Scan`] run after it splits (a full run splits in two).
const SCAN_RUN: usize = 64;

/// A [`Scan`] run that reaches this many blocks splits.
const RUN_CAP: usize = 2 * SCAN_RUN;

/// A block of [`Scan`]: offset, end, intervals, how many of them are used.
type ScanBlock = (u64, u64, [(u32, u32); 2], usize);

impl Scan {
    /// The blocks, in (offset, end) order.
    fn blocks(&self) -> impl Iterator<Item = &ScanBlock> {
        self.0.iter().flatten()
    }
}

impl Blocks for Scan {
    fn overlapping(&mut self, iv: &[(u32, u32)], out: &mut Vec<(u64, u64)>) {
        // Intervals are never empty (`Request::intervals`).
        let meets = |&(a, e): &(u32, u32)| iv.iter().any(|&(b, f)| a < f && b < e);
        if let [(b, f)] = *iv {
            // One interval (most requests): a tight loop.
            for p in self.blocks() {
                let (a, e) = p.2[0];
                if (a < f && b < e) || (p.3 == 2 && meets(&p.2[1])) {
                    out.push((p.0, p.1));
                }
            }
        } else {
            out.extend(self.blocks().filter(|p| p.2[..p.3].iter().any(meets)).map(|p| (p.0, p.1)));
        }
    }

    /// The scan and [`best_fit`] in one pass: the blocks are kept in the
    /// order it sorts them in. A gap of exactly `size` ends the scan: no
    /// later gap is smaller, and the lowest gap wins a tie.
    fn fit(&mut self, iv: &[(u32, u32)], size: u64, _scratch: &mut Vec<(u64, u64)>) -> u64 {
        let meets = |&(a, e): &(u32, u32)| iv.iter().any(|&(b, f)| a < f && b < e);
        let mut fit = Fit::default();
        if let [(b, f)] = *iv {
            'scan: for run in &self.0 {
                for p in run {
                    let (a, e) = p.2[0];
                    if (a < f && b < e) || (p.3 == 2 && meets(&p.2[1])) {
                        fit.meet(p.0, p.1, size);
                        if fit.exact(size) {
                            break 'scan;
                        }
                    }
                }
            }
        } else {
            for p in self.blocks().filter(|p| p.2[..p.3].iter().any(meets)) {
                fit.meet(p.0, p.1, size);
                if fit.exact(size) {
                    break;
                }
            }
        }
        fit.offset()
    }

    fn keep(&mut self, _k: u32, iv: &[(u32, u32)], off: u64, end: u64) {
        let mut ivs = [(0, 0); 2];
        ivs[..iv.len()].copy_from_slice(iv);
        let key = (off, end);
        if self.0.is_empty() {
            self.0.push(Vec::with_capacity(RUN_CAP));
        }
        // After every block of its key: the first run that ends above the
        // key (the runs before hold only lower or equal keys, those after
        // only higher), else the last.
        let r = self.0.partition_point(|run| run.last().is_some_and(|p| (p.0, p.1) <= key));
        let r = r.min(self.0.len() - 1);
        let run = &mut self.0[r];
        let at = run.partition_point(|p| (p.0, p.1) <= key);
        run.insert(at, (off, end, ivs, iv.len()));
        if run.len() == RUN_CAP {
            let mut tail = Vec::with_capacity(RUN_CAP);
            tail.extend(run.drain(SCAN_RUN..));
            self.0.insert(r + 1, tail);
        }
    }
}

/// [`place`] with the placed blocks kept in `blocks`.
fn place_with(reqs: &[Request], order: &[u32], blocks: &mut impl Blocks) -> Plan {
    let n = reqs.len() as u32;
    let mut offsets = vec![None; reqs.len()];
    let mut arena = 0u64;
    let mut occupied = Vec::new();
    for &k in order {
        let r = &reqs[k as usize];
        let size = r.planned_bytes();
        let (iv, m) = r.intervals(k, n);
        let off = blocks.fit(&iv[..m], size, &mut occupied);
        let end = off.saturating_add(size);
        blocks.keep(k, &iv[..m], off, end);
        offsets[k as usize] = Some(off);
        arena = arena.max(end);
    }
    Plan { arena_bytes: arena, offsets }
}

/// Places the requests of `order` one by one, each at its hint (an offset
/// in the arena) when the block there meets no placed block whose lifetime
/// overlaps its own, else at the best-fitting gap (as [`greedy_by_size`]
/// places; a `None` hint too). Requests not in `order` are left unplanned.
/// A plan made from plans of parts (an offline plan that composes the plans
/// of a workload's steps: the hints are each step's plan, the first steps
/// placed keep their layout exactly, the later ones bend around them).
/// Requests are expected once each and [`Request::plannable`]; a later
/// repeat replaces the earlier placement of a request in the plan but not
/// in what the later requests avoid, so a caller that repeats one gets an
/// invalid plan.
pub fn place_hinted(reqs: &[Request], order: &[(u32, Option<u64>)]) -> Plan {
    let n = reqs.len() as u32;
    if reqs.len() <= SCAN_REQUESTS {
        place_hinted_with(reqs, order, &mut Scan::default())
    } else {
        place_hinted_with(reqs, order, &mut Placed::new(n, reqs.len()))
    }
}

/// [`place_hinted`] with the placed blocks kept in `blocks`.
fn place_hinted_with(reqs: &[Request], order: &[(u32, Option<u64>)], blocks: &mut impl Blocks) -> Plan {
    let n = reqs.len() as u32;
    let mut offsets = vec![None; reqs.len()];
    let mut arena = 0u64;
    let mut occupied = Vec::new();
    for &(k, hint) in order.iter().filter(|(k, _)| (*k as usize) < reqs.len()) {
        let r = &reqs[k as usize];
        let size = r.planned_bytes();
        let (iv, m) = r.intervals(k, n);
        occupied.clear();
        blocks.overlapping(&iv[..m], &mut occupied);
        let free = |h: u64| {
            h.is_multiple_of(ALIGN)
                && h.checked_add(size).is_some_and(|e| occupied.iter().all(|&(o, oe)| oe <= h || e <= o))
        };
        let off = match hint {
            Some(h) if free(h) => h,
            _ => best_fit(&mut occupied, size),
        };
        let end = off.saturating_add(size);
        blocks.keep(k, &iv[..m], off, end);
        offsets[k as usize] = Some(off);
        arena = arena.max(end);
    }
    Plan { arena_bytes: arena, offsets }
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
            Some((o, g)) if o.saturating_add(g) == self.top => {
                self.remove(o, g);
                o
            }
            _ => self.top,
        };
        self.top = off.saturating_add(size);
        off
    }

    /// Gives `[off, off + size)` back, merged with free neighbours.
    fn give(&mut self, mut off: u64, mut size: u64) {
        if let Some((&o, &g)) = self.by_offset.range(..off).next_back() {
            if o.saturating_add(g) == off {
                self.remove(o, g);
                off = o;
                size = size.saturating_add(g);
            }
        }
        if let Some(&g) = self.by_offset.get(&off.saturating_add(size)) {
            self.remove(off.saturating_add(size), g);
            size = size.saturating_add(g);
        }
        self.insert(off, size);
    }
}

/// The step replayed in time order through a best-fit allocator that knows
/// every lifetime (the first plan of [`plan`]; see the crate documentation).
pub fn in_time_order(reqs: &[Request]) -> Plan {
    if reqs.len() > MAX_REQUESTS {
        return Plan { arena_bytes: 0, offsets: vec![None; reqs.len()] };
    }
    let n = reqs.len() as u32;
    let mut ends: Vec<Vec<u32>> = vec![Vec::new(); n as usize + 1];
    let mut gaps = Gaps::default();
    let mut offsets: Vec<Option<u64>> = vec![None; reqs.len()];
    for k in 0..n {
        for i in core::mem::take(&mut ends[k as usize]) {
            if let Some(off) = offsets[i as usize] {
                gaps.give(off, reqs[i as usize].planned_bytes());
            }
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
        (o, o.saturating_add(reqs[k as usize].planned_bytes()))
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic pseudo-random numbers below `m` (xorshift64 from `x`).
    pub(crate) fn xorshift(mut x: u64) -> impl FnMut(u64) -> u64 {
        move |m| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % m
        }
    }

    fn req(bytes: u64, freed_at: Option<u32>, wraps_to: Option<u32>) -> Request {
        Request { bytes, freed_at, wraps_to }
    }

    #[test]
    fn the_tree_s_packed_fit_is_best_fit_of_what_overlaps() {
        let mut next = xorshift(0x2545_f491_4f6c_dd1d);
        for round in 0..200 {
            let n = 8 + next(120) as u32;
            let mut placed = Placed::new(n, n as usize);
            // Offsets in whole ALIGNs, or (every fourth round) not.
            let unit = if round % 4 == 3 { 1 } else { ALIGN };
            for k in 0..n {
                let t0 = next(u64::from(n)) as u32;
                let t1 = (t0 + 1 + next(20) as u32).min(n);
                let off = next(400) * unit;
                let end = off + (1 + next(40)) * unit;
                let mut scratch = Vec::new();
                let size = (1 + next(30)) * unit;
                let iv = [(t0, t1)];
                let got = placed.fit(&iv, size, &mut scratch);
                let mut found = Vec::new();
                placed.overlapping(&iv, &mut found);
                assert_eq!(got, best_fit(&mut found, size), "round {round}, request {k}");
                placed.keep(k, &iv, off, end);
            }
        }
    }

    #[test]
    fn disjoint_lifetimes_share_bytes_and_overlapping_ones_do_not() {
        // 0 and 1 overlap; 2 starts after 0 is freed and reuses its place.
        let p = greedy_by_size(&[req(1000, Some(2), None), req(2048, Some(3), None), req(1024, Some(3), None)]);
        assert_eq!(p.offsets, [Some(2048), Some(0), Some(2048)]);
        assert_eq!(p.arena_bytes, 3072);
    }

    #[test]
    fn unknown_lifetimes_are_left_unplanned() {
        // Live at the end with no known wrap, and a wrap later than its own start.
        let p = greedy_by_size(&[req(512, None, None), req(512, None, Some(5)), req(512, Some(3), None)]);
        assert_eq!(p.offsets, [None, None, Some(0)]);
        assert_eq!(p.arena_bytes, 512);
    }

    #[test]
    fn a_wrapping_request_occupies_the_start_of_the_cycle() {
        // Request 2 lives [2, 3) and wraps to [0, 1): request 0 ([0, 1)) cannot share with it.
        let p = greedy_by_size(&[req(512, Some(1), None), req(512, Some(2), None), req(1024, None, Some(1))]);
        assert_eq!(p.offsets, [Some(1024), Some(0), Some(0)]);
        let (iv, m) = p_intervals(&req(1024, None, Some(1)), 2, 3);
        assert_eq!(&iv[..m], &[(2, 3), (0, 1)]);
    }

    fn p_intervals(r: &Request, k: u32, n: u32) -> ([(u32, u32); 2], usize) {
        r.intervals(k, n)
    }

    #[test]
    fn absurd_inputs_do_not_panic() {
        // A free past the step's end counts as the end; sizes saturate.
        let absurd = [req(u64::MAX, Some(99), None), req(u64::MAX, Some(1), None), req(u64::MAX, None, Some(1))];
        assert_eq!(greedy_by_size(&absurd).offsets.len(), 3);
        assert_eq!(in_time_order(&absurd).offsets.len(), 3);
        assert_eq!(plan(&absurd).offsets.len(), 3);
        assert_eq!(req(1, Some(99), None).intervals(0, 2).0[0], (0, 2));
        assert_eq!(req(u64::MAX, None, None).planned_bytes() % ALIGN, 0);
        assert_eq!(greedy_by_size(&[]), Plan { arena_bytes: 0, offsets: Vec::new() });
        assert_eq!(plan(&[]), Plan { arena_bytes: 0, offsets: Vec::new() });
    }

    #[test]
    fn the_cheapest_plan_wins() {
        // In time order, 2 cannot reuse 0's place (it is larger): greedy by size stacks tighter.
        let reqs = [req(1024, Some(1), None), req(512, Some(3), None), req(2048, Some(3), None)];
        let (t, g, p) = (in_time_order(&reqs), greedy_by_size(&reqs), plan(&reqs));
        assert!(g.arena_bytes <= t.arena_bytes);
        assert_eq!(p.arena_bytes, g.arena_bytes.min(t.arena_bytes));
    }

    #[test]
    fn the_live_bound_holds_and_stops_the_search_only_when_met() {
        // Nested lifetimes the time order stacks perfectly: the bound is met.
        let nested = [req(4096, Some(3), None), req(2048, Some(2), None), req(1024, Some(3), None)];
        assert_eq!(live_bound(&nested), 4096 + 2048);
        assert_eq!(plan(&nested), in_time_order(&nested));
        // A wrap: live [2, 3) and [0, 1) alongside request 0.
        let wrap = [req(512, Some(1), None), req(512, Some(2), None), req(1024, None, Some(1))];
        assert_eq!(live_bound(&wrap), 1536);
        // Pseudo-random profiles: no plan costs less than the bound, and
        // `plan` is the cheapest of the three plans (the first on a tie).
        let mut next = xorshift(0x9e37_79b9_7f4a_7c15);
        for _ in 0..200 {
            let n = 1 + next(40) as u32;
            let reqs: Vec<Request> = (0..n)
                .map(|k| match next(5) {
                    0 => req(1 + next(1 << 20), None, Some(next(u64::from(k) + 1) as u32)),
                    1 => req(1 + next(1 << 20), None, None),
                    _ => req(1 + next(1 << 20), Some(k + 1 + next(8) as u32), None),
                })
                .collect();
            let cost = |p: &Plan| -> u64 {
                let left = (0..n).filter(|&k| reqs[k as usize].plannable(k) && p.offsets[k as usize].is_none());
                p.arena_bytes + left.map(|k| reqs[k as usize].planned_bytes()).sum::<u64>()
            };
            let bound = live_bound(&reqs);
            let (t, g, p) = (in_time_order(&reqs), greedy_by_size(&reqs), plan(&reqs));
            assert!(bound <= cost(&t) && bound <= cost(&g) && bound <= cost(&p));
            assert!(cost(&p) <= cost(&t).min(cost(&g)), "{reqs:?}");
            // A search that goes on starts from the same plan, and each
            // plan it finds is valid and cheaper than the one before.
            let mut refiner = Refiner::new(&reqs, Effort::ONLINE);
            assert_eq!(refiner.plan(), &p);
            let mut last = cost(&p);
            for _ in 0..5 {
                if let Some(q) = refiner.refine() {
                    assert!(valid(&reqs, &q) && cost(&q) < last && cost(&q) >= bound, "{reqs:?}");
                    last = cost(&q);
                }
            }
            let longer = plan_with(&reqs, Effort::times(20));
            assert!(valid(&reqs, &p) && valid(&reqs, &longer), "{reqs:?}");
            assert!(bound <= cost(&longer) && cost(&longer) <= cost(&t), "{reqs:?}");
            // Both ways of finding the overlapping blocks place alike.
            let order: Vec<u32> = (0..n).filter(|&k| reqs[k as usize].plannable(k)).rev().collect();
            let tree = place_with(&reqs, &order, &mut Placed::new(n, reqs.len()));
            assert_eq!(place_with(&reqs, &order, &mut Scan::default()), tree);
        }
    }

    #[test]
    fn the_scan_in_runs_places_as_the_segment_tree_in_long_steps() {
        // Steps of hundreds of requests (the scan's runs split many times),
        // with wraps and many blocks of one offset and end (short-lived
        // requests of a few sizes stack at the same places).
        let mut next = xorshift(0x0bad_5eed_1234_5678);
        for _ in 0..12 {
            let n = 200 + next(1200) as u32;
            let reqs: Vec<Request> = (0..n)
                .map(|k| match next(6) {
                    0 => req(1 + next(1 << 20), None, Some(next(u64::from(k) + 1) as u32)),
                    1 => req(512 << next(4), Some(k + 1 + next(3) as u32), None),
                    _ => req(1 + next(1 << 20), Some(k + 1 + next(64) as u32), None),
                })
                .collect();
            let mut order: Vec<u32> = (0..n).filter(|&k| reqs[k as usize].plannable(k)).collect();
            for round in 0..3 {
                match round {
                    0 => order.reverse(),
                    1 => order.sort_unstable_by_key(|&k| (core::cmp::Reverse(reqs[k as usize].planned_bytes()), k)),
                    _ => {
                        let keys: Vec<u64> = (0..n).map(|_| next(1 << 30)).collect();
                        order.sort_unstable_by_key(|&k| (keys[k as usize], k));
                    }
                }
                let tree = place_with(&reqs, &order, &mut Placed::new(n, reqs.len()));
                let mut scan = Scan::default();
                assert_eq!(place_with(&reqs, &order, &mut scan), tree);
                assert!(scan.0.len() > 2 && scan.0.iter().all(|run| !run.is_empty() && run.len() < RUN_CAP));
                let keys: Vec<(u64, u64)> = scan.blocks().map(|p| (p.0, p.1)).collect();
                assert!(keys.is_sorted());
                // Both find the same overlapping blocks.
                let mut placed = Placed::new(n, reqs.len());
                for &k in &order {
                    let (iv, m) = reqs[k as usize].intervals(k, n);
                    let off = tree.offsets[k as usize].unwrap();
                    placed.keep(k, &iv[..m], off, off + reqs[k as usize].planned_bytes());
                }
                for k in 0..n {
                    let (iv, m) = reqs[k as usize].intervals(k, n);
                    let (mut a, mut b) = (Vec::new(), Vec::new());
                    scan.overlapping(&iv[..m], &mut a);
                    placed.overlapping(&iv[..m], &mut b);
                    a.sort_unstable();
                    b.sort_unstable();
                    assert_eq!(a, b);
                }
            }
        }
    }

    /// The optimizer step of a one-layer model with AdamW (83 requests of a
    /// random synth configuration): the update's two 12.3 MB temporaries
    /// beside the embedding's gradient, after activations that overlap the
    /// gradients' start. `(bytes, freed_at)`; -1: live at the step's end,
    /// freed before the next step's first request (a gradient).
    const ADAMW_STEP: [(u64, i64); 83] = [
        (2048, 51),
        (393216, 48),
        (393216, 3),
        (393216, 48),
        (1024, 48),
        (1024, 48),
        (1179648, 48),
        (393216, 48),
        (6144, 48),
        (393216, 48),
        (393216, 48),
        (393216, 48),
        (393216, 48),
        (1024, 48),
        (1024, 48),
        (1572864, 48),
        (1572864, 48),
        (1572864, 48),
        (1572864, 48),
        (1572864, 48),
        (393216, 48),
        (393216, 48),
        (393216, 31),
        (393216, 31),
        (8192000, 26),
        (8192000, 29),
        (4, 29),
        (8192000, 29),
        (8192000, 31),
        (12288000, -1),
        (393216, 48),
        (1572864, 33),
        (1572864, 33),
        (393216, 34),
        (1179648, 35),
        (1536, -1),
        (1536, -1),
        (1769472, -1),
        (4608, -1),
        (589824, -1),
        (1536, -1),
        (1536, -1),
        (1536, -1),
        (2359296, -1),
        (6144, -1),
        (2359296, -1),
        (1536, -1),
        (393216, 51),
        (393216, -1),
        (1536, -1),
        (1536, -1),
        (12288000, 67),
        (393216, 67),
        (1536, 67),
        (1536, 67),
        (1769472, 67),
        (4608, 67),
        (589824, 67),
        (1536, 67),
        (1536, 67),
        (1536, 67),
        (2359296, 67),
        (6144, 67),
        (2359296, 67),
        (1536, 67),
        (1536, 67),
        (1536, 67),
        (12288000, 83),
        (393216, 83),
        (1536, 83),
        (1536, 83),
        (1769472, 83),
        (4608, 83),
        (589824, 83),
        (1536, 83),
        (1536, 83),
        (1536, 83),
        (2359296, 83),
        (6144, 83),
        (2359296, 83),
        (1536, 83),
        (1536, 83),
        (1536, 83),
    ];

    /// A whole step of a one-layer model trained with SGD (hidden 320,
    /// batch 3 × 64, fp32: 51 requests of a random synth configuration).
    const STEP_51: [(u64, i64); 51] = [
        (1536, 51),
        (245760, 48),
        (245760, 3),
        (245760, 48),
        (768, 48),
        (768, 48),
        (737280, 48),
        (245760, 48),
        (3840, 48),
        (245760, 48),
        (245760, 48),
        (245760, 48),
        (245760, 48),
        (768, 48),
        (768, 48),
        (983040, 48),
        (983040, 48),
        (983040, 48),
        (983040, 48),
        (983040, 48),
        (245760, 48),
        (245760, 48),
        (245760, 31),
        (245760, 31),
        (6144000, 26),
        (6144000, 29),
        (4, 29),
        (6144000, 29),
        (6144000, 31),
        (10240000, -1),
        (245760, 48),
        (983040, 33),
        (983040, 33),
        (245760, 34),
        (737280, 35),
        (1280, -1),
        (1280, -1),
        (1228800, -1),
        (3840, -1),
        (409600, -1),
        (1280, -1),
        (1280, -1),
        (1280, -1),
        (1638400, -1),
        (5120, -1),
        (1638400, -1),
        (1280, -1),
        (245760, 51),
        (81920, -1),
        (1280, -1),
        (1280, -1),
    ];

    fn step(rows: &[(u64, i64)]) -> Vec<Request> {
        rows.iter().map(|&(b, f)| if f < 0 { req(b, None, Some(0)) } else { req(b, Some(f as u32), None) }).collect()
    }

    fn adamw_step() -> Vec<Request> {
        step(&ADAMW_STEP)
    }

    /// Whether no two planned requests whose lifetimes overlap share a byte.
    fn valid(reqs: &[Request], p: &Plan) -> bool {
        let n = reqs.len() as u32;
        let block = |k: usize| p.offsets[k].map(|o| (o, o + reqs[k].planned_bytes()));
        (0..reqs.len()).all(|a| {
            (a + 1..reqs.len()).all(|b| {
                let (Some((oa, ea)), Some((ob, eb))) = (block(a), block(b)) else { return true };
                let (ia, ma) = reqs[a].intervals(a as u32, n);
                let (ib, mb) = reqs[b].intervals(b as u32, n);
                let meet = ia[..ma].iter().any(|&(s, e)| ib[..mb].iter().any(|&(t, f)| s < f && t < e));
                !meet || ea <= ob || eb <= oa
            })
        }) && (0..reqs.len()).all(|k| block(k).is_none_or(|(_, e)| e <= p.arena_bytes))
    }

    #[test]
    fn hints_that_are_free_are_kept_and_the_others_fit_around_them() {
        let mut next = xorshift(0x2545_f491_4f6c_dd1d);
        // Short profiles (scanned) and one past SCAN_REQUESTS (segment tree).
        let sizes: Vec<u32> = (0..60).map(|_| 2 + next(60) as u32).chain([SCAN_REQUESTS as u32 + 300]).collect();
        for n in sizes {
            let reqs: Vec<Request> =
                (0..n).map(|k| req(1 + next(1 << 16), Some((k + 1 + next(12) as u32).min(n)), None)).collect();
            // A valid plan as hints, in any order: placed exactly as hinted.
            let p = plan(&reqs);
            let mut order: Vec<(u32, Option<u64>)> = (0..n).map(|k| (k, p.offsets[k as usize])).collect();
            order.reverse();
            assert_eq!(place_hinted(&reqs, &order), p);
            // Hints that clash, are unaligned or missing: a valid plan anyway,
            // every request planned, each free hint kept.
            let order: Vec<(u32, Option<u64>)> = (0..n)
                .map(|k| (k, [None, Some(0), Some(next(1 << 18)), Some(ALIGN * next(64))][next(4) as usize]))
                .collect();
            let q = place_hinted(&reqs, &order);
            assert!(valid(&reqs, &q) && q.offsets.iter().all(Option::is_some));
            assert_eq!(q.offsets[order[0].0 as usize], Some(order[0].1.filter(|h| h % ALIGN == 0).unwrap_or(0)));
        }
        // Out-of-range indices are skipped; absent requests stay unplanned.
        let reqs = [req(512, Some(1), None), req(512, Some(2), None)];
        let q = place_hinted(&reqs, &[(7, Some(0)), (1, Some(u64::MAX - 10))]);
        assert_eq!(q, Plan { arena_bytes: 512, offsets: vec![None, Some(0)] });
    }

    #[test]
    fn the_requests_live_at_the_peak_placed_first_reach_the_bound_where_greedy_by_size_does_not() {
        // Greedy by size leaves a gap under one of the tensors live at the
        // peak (the update's temporaries beside the embedding's gradient);
        // placed first, in allocation order, they stack below the bound.
        let reqs = adamw_step();
        let bound = live_bound(&reqs);
        let by_size = greedy_by_size(&reqs);
        assert!(by_size.arena_bytes * 100 > bound * 105, "greedy by size {} for {bound}", by_size.arena_bytes);
        let online = plan(&reqs);
        assert!(valid(&reqs, &online) && online.offsets.iter().all(Option::is_some));
        assert_eq!(online.arena_bytes, bound);
        assert_eq!(live_peak(&reqs).0, bound);
    }

    #[test]
    fn a_long_steps_placements_cost_what_its_lifetimes_overlap() {
        // The AdamW step after 2,100 small requests that meet nothing: its
        // placements use the segment tree and cost what the lifetimes
        // overlap, far less than a scan's m²/2, so it gets the extra orders
        // within the budget of a long step (whatever its length) — and
        // plans as well as greedy by size at least.
        let pad = 2100u32;
        let mut reqs: Vec<Request> = (0..pad).map(|k| req(512, Some(k + 1), None)).collect();
        reqs.extend(adamw_step().into_iter().map(|r| Request { freed_at: r.freed_at.map(|f| f + pad), ..r }));
        assert!(reqs.len() > SCAN_REQUESTS);
        let n = reqs.len() as u32;
        let order: Vec<u32> = (0..n).collect();
        let m = reqs.len() as u64;
        let (by_time, visits) = place_costed(&reqs, &order);
        let visits = visits.expect("placed with the segment tree");
        assert!(visits * 10 < m * m / 2, "{visits} visits");
        assert!(visits < budget(reqs.len(), m, Effort::ONLINE) / 8, "{visits} visits");
        assert!(valid(&reqs, &by_time));
        let online = plan(&reqs);
        assert!(valid(&reqs, &online) && online.offsets.iter().all(Option::is_some));
        assert!(online.arena_bytes <= greedy_by_size(&reqs).arena_bytes);
        assert_eq!(live_bound(&reqs), live_bound(&adamw_step()));
        // A short step's budget is linear in its requests; a long one's is
        // flat; a larger effort scales both.
        assert_eq!(budget(reqs.len(), m, Effort::ONLINE), SEARCH_VISITS * 2048 * LONG_STEP);
        assert_eq!(budget(50_000, 50_000, Effort::ONLINE), SEARCH_VISITS * 2048 * LONG_STEP);
        assert_eq!(budget(2048, 2000, Effort::ONLINE), SEARCH_VISITS * 2000);
        assert_eq!(budget(3000, 3000, Effort::times(2)), SEARCH_VISITS * 2 * 3000);
        // A scanned step's placement is costed by the caller (m²/2).
        assert_eq!(place_costed(&adamw_step(), &(0..83).collect::<Vec<u32>>()).1, None);
    }

    #[test]
    fn a_long_step_whose_blocks_all_live_at_once_is_placed_by_scanning() {
        // Two like halves whose requests live over most of the step (a
        // paired profile of activations): each query of the segment tree
        // finds nearly every placed block, so the placements after the
        // first scan, and place as the tree does.
        let mut next = xorshift(0x1357_9bdf_2468_ace0);
        let h = 1100u32;
        let half: Vec<(u64, u32)> =
            (0..h).map(|k| (512 * (1 + next(4096)), h - k / 2 + next(u64::from(h / 4)) as u32)).collect();
        let reqs: Vec<Request> = (0..2 * h)
            .map(|k| {
                let (bytes, life) = half[(k % h) as usize];
                req(bytes, Some((k + life).min(2 * h)), None)
            })
            .collect();
        assert!(reqs.len() > SCAN_REQUESTS);
        let n = reqs.len() as u32;
        let order: Vec<u32> = (0..n).filter(|&k| reqs[k as usize].plannable(k)).collect();
        let m = order.len() as u64;
        let (tree, visits) = place_costed(&reqs, &order);
        assert!(scans(visits, m), "{visits:?} visits for {m} requests");
        assert_eq!(place(&reqs, &order, true), tree);
        assert!(valid(&reqs, &plan(&reqs)));
        // The short-lived step before keeps the tree (it costs far less).
        let pad = 2100u32;
        let short: Vec<Request> = (0..pad).map(|k| req(512, Some(k + 1), None)).collect();
        let order: Vec<u32> = (0..pad).collect();
        assert!(!scans(place_costed(&short, &order).1, u64::from(pad)));
        assert!(!scans(None, m));
    }

    #[test]
    fn a_longer_search_reaches_the_bound_where_the_online_one_stops_short() {
        let reqs = step(&STEP_51);
        let bound = live_bound(&reqs);
        let online = plan(&reqs);
        assert_eq!(plan_with(&reqs, Effort::times(1)), online);
        assert_eq!(Effort::times(1), Effort::ONLINE);
        assert!(valid(&reqs, &online));
        // Every request is planned: the cost is the arena.
        assert!(online.offsets.iter().all(Option::is_some));
        assert!(online.arena_bytes * 1000 > bound * 1005, "online {} for {bound}", online.arena_bytes);
        let longer = plan_with(&reqs, Effort::times(100));
        assert!(valid(&reqs, &longer));
        assert!(longer.offsets.iter().all(Option::is_some));
        assert!(longer.arena_bytes * 1000 <= bound * 1005, "effort 100: {} for {bound}", longer.arena_bytes);
        // The same search, one online budget at a time: 100 calls reach it
        // too, and a search from the online plan (made by an earlier run)
        // finds cheaper plans as well.
        for mut refiner in [Refiner::new(&reqs, Effort::ONLINE), Refiner::resume(&reqs, &online, Effort::ONLINE, 0)] {
            let mut calls = 0;
            while !refiner.done() && calls < 100 {
                if let Some(p) = refiner.refine() {
                    assert!(valid(&reqs, &p) && p.offsets.iter().all(Option::is_some));
                }
                calls += 1;
            }
            let found = refiner.plan().arena_bytes;
            assert!(found * 1000 <= bound * 1005, "after {calls} calls: {found} for {bound}");
        }
        // Nothing to search: a plan at the bound, a plan of another length.
        let at_bound = Refiner::resume(&reqs, &longer, Effort::ONLINE, 0);
        assert_eq!(at_bound.done(), longer.arena_bytes <= bound);
        assert!(Refiner::resume(&reqs, &Plan { arena_bytes: 0, offsets: vec![] }, Effort::ONLINE, 0).done());
    }
}
