//! Plans of two like steps in an *aliased* arena: two virtual windows over
//! one physical arena, the second with its two end zones swapped.
//!
//! A step whose output lives into the next step past the allocation of its
//! own next instance (`out = model(x)` kept until the next forward returns,
//! as many Hugging Face loops do) cannot be planned one step at a time, and
//! a plan of two steps as one profile stays 1–2 % above the live bound on
//! such loops: the two instances of the output interleave with the
//! temporaries of the other step's peak (see docs/measurements.md). With
//! virtual memory (one physical arena mapped at two virtual windows) the
//! two steps can share one plan of one step:
//!
//! ```text
//!  physical:         [ L | M | H ]           arena bytes S, zones L and H of w bytes
//!  window 0 (step 1): L M H   request k at window 0 + offset(k)
//!  window 1 (step 2): H M L   request k + n/2 at window 1 + offset(k)
//! ```
//!
//! A request at offset `o` occupies the physical range `o` during its own
//! step and, if it lives into the next step, the same range while the next
//! instance (at the same offset of the other window) lives elsewhere when
//! `o` is in a zone: what one step leaves live (its output, in the low
//! zone) lies in the other step's high zone, and what a step allocates once
//! the other step's output is gone can take that zone's memory, straddling
//! a zone's edge if it must. In one step's cycle of times `0 .. n/2`, a
//! request's *main* part (its own step) occupies `[o, o + size)` and its
//! *wrap* part (its previous instance, during the next step's start)
//! `σ([o, o + size))`, where `σ` swaps the zones ([`swap_zones`]).
//!
//! [`aliased`] places the requests greedily: those that live at once with
//! their own next instance (they must lie wholly in one zone) first, then
//! the others, each in decreasing size (longer lifetimes first among
//! equals, then by index), in the smallest gap — among the ranges its main
//! part and wrap part must avoid — that holds it. While that leaves a pair
//! out or needs more than the live bound, three more orders of the others
//! are tried (those live at the peak first; the longest-lived first; those
//! that live to the step's end first), then, while a pair is still left
//! out at the bound, the orders are placed again with the pairs they left
//! out placed first (the order that left least first; iterative repair,
//! until an order's repair leaves more than twice what the order left at
//! first: it diverges, and the next order's turn comes), all within
//! [`ALIASED_WORK`] (times the effort, [`aliased_with`]), and
//! the cheapest plan is kept (the first on a tie). Arenas and zones are
//! whole pages ([`PAGE`]: physical memory is mapped in whole allocations).

use alloc::vec;
use alloc::vec::Vec;

use crate::{live_bound, Effort, Request, GREEDY_WORK, MAX_REQUESTS, SEARCH_VISITS};

/// Granularity of an aliased arena and of its zones (2 MiB: the physical
/// allocations behind the windows are mapped whole).
pub const PAGE: u64 = 2 << 20;

/// An aliased plan of a profile of two like steps (see the module documentation).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AliasedPlan {
    /// Physical bytes of the arena (a multiple of [`PAGE`]).
    pub arena_bytes: u64,
    /// Bytes of each of its two end zones (a multiple of [`PAGE`], at most half the arena).
    pub zone_bytes: u64,
    /// For each request of the profile, in order, its offset in its
    /// *window*: the first half's in window 0, the second half's in window
    /// 1 (request `k + n/2` at the offset of request `k`); `None`: not
    /// planned.
    pub offsets: Vec<Option<u64>>,
}

impl AliasedPlan {
    /// The physical ranges (up to three) that `[off, off + size)` of the
    /// window of request `k` of a profile of `n` requests occupies.
    pub fn physical(&self, k: usize, n: usize, off: u64, size: u64, out: &mut Vec<(u64, u64)>) {
        if k < n / 2 {
            out.push((off, off.saturating_add(size)));
        } else {
            swap_zones(off, off.saturating_add(size), self.arena_bytes, self.zone_bytes, out);
        }
    }
}

/// The physical pieces of `[o, e)` of an arena of `arena` bytes with its
/// zones of `zone` bytes swapped: `[0, zone)` ↔ `[arena - zone, arena)`,
/// the middle in place (the same pieces map back: the swap is its own inverse).
pub fn swap_zones(o: u64, e: u64, arena: u64, zone: u64, out: &mut Vec<(u64, u64)>) {
    let shift = arena.saturating_sub(zone);
    let (lo, le) = (o, e.min(zone));
    if lo < le {
        out.push((lo + shift, le + shift));
    }
    let (mo, me) = (o.max(zone), e.min(shift));
    if mo < me {
        out.push((mo, me));
    }
    let (ho, he) = (o.max(shift), e.min(arena));
    if ho < he {
        out.push((ho - shift, he - shift));
    }
}

/// One request pair of the two steps, seen in one step's cycle `0 .. h`.
struct Item {
    /// Index of the request in the first half.
    k: u32,
    size: u64,
    /// Its own step's part: `[k, end)`.
    end: u32,
    /// Its previous instance's part in the next step: `[0, wrap)` (0: none).
    wrap: u32,
}

impl Item {
    /// Whether it lives at once with its own next instance (then it must
    /// lie wholly in a zone).
    fn crossing(&self) -> bool {
        self.wrap > self.k
    }
}

/// The one-step items of a profile of two like halves: each pair's hull of
/// both instances' lifetimes (what either instance needs); `None` when the
/// halves are not alike ([`crate::halves_alike`]).
fn items(reqs: &[Request]) -> Option<Vec<Item>> {
    if !crate::halves_alike(reqs) {
        return None;
    }
    let n = reqs.len() as u32;
    let h = n / 2;
    let mut out = Vec::new();
    for k in 0..h {
        let (a, b) = (&reqs[k as usize], &reqs[(k + h) as usize]);
        if !a.plannable(k) || !b.plannable(k + h) {
            continue;
        }
        // First instance: freed within its step, or in the next one (a
        // wrap); one that outlives the next step too is not planned.
        let (end1, wrap1) = match a.freed_at {
            Some(f) if f <= h => (f.max(k + 1), 0),
            Some(f) => (h, f.min(n) - h),
            None => continue,
        };
        // Second instance: freed within its step, or in the next period's
        // first step (a wrap at most a step long).
        let (end2, wrap2) = match (b.freed_at, b.wraps_to) {
            (Some(f), _) => (f.max(k + h + 1).min(n) - h, 0),
            (None, Some(w)) if w <= h => (h, w),
            _ => continue,
        };
        out.push(Item { k, size: a.planned_bytes(), end: end1.max(end2), wrap: wrap1.max(wrap2) });
    }
    Some(out)
}

/// The aliased plan of a profile of two like steps ([`crate::halves_alike`]),
/// or `None` when its halves are not alike, its work (the sum of the
/// planned lifetimes, in requests) exceeds [`GREEDY_WORK`], or nothing
/// lives into the next step past its own next instance (a plain plan does
/// as well then). In each order (see the module documentation), the arena
/// is the live bound rounded up to [`PAGE`], or the first of two larger
/// ones (1/1024 and 1/256 more) with which no pair is left out; the plan
/// that costs least (its arena plus the bytes it leaves) wins. The zones
/// hold the requests that must lie in them, rounded up to [`PAGE`]. A pair
/// that fits nowhere is left to the dynamic path.
pub fn aliased(reqs: &[Request]) -> Option<AliasedPlan> {
    aliased_with(reqs, Effort::ONLINE)
}

/// [`aliased`] with `effort` times ([`Effort::times`]) the pair visits
/// ([`ALIASED_WORK`]) for the placements after the first order's: the same
/// plan where those were enough, else one closer to the bound (more
/// retries).
pub fn aliased_with(reqs: &[Request], effort: Effort) -> Option<AliasedPlan> {
    if reqs.len() > MAX_REQUESTS {
        return None;
    }
    let items = items(reqs)?;
    let work: u64 =
        items.iter().map(|i| u64::from(i.end - i.k) + u64::from(i.wrap)).fold(0, u64::saturating_add).saturating_mul(2);
    let crossing: u64 = items.iter().filter(|i| i.crossing()).map(|i| i.size).fold(0, u64::saturating_add);
    if work > GREEDY_WORK || crossing == 0 {
        return None;
    }
    let bound = live_bound(reqs);
    let zone = crossing.div_ceil(PAGE).saturating_mul(PAGE);
    let mut best: Option<(u64, AliasedPlan)> = None;
    // A placement visits every pair placed before each: the orders after
    // the first, and the retries, get as many placements as
    // [`ALIASED_WORK`] visits (times the effort) allow.
    let visits = (items.len() as u64).saturating_mul(items.len() as u64) / 2;
    let times = (effort.visits / SEARCH_VISITS).max(1);
    let mut more = ALIASED_WORK.saturating_mul(times) / visits.max(1);
    // Each order's placement at the least arena: what it left out, and
    // which pairs failed.
    let least = bound.div_ceil(PAGE).saturating_mul(PAGE).max(2 * zone);
    let mut failures: Vec<(u64, Vec<usize>, Vec<usize>)> = Vec::new();
    let h = (reqs.len() / 2) as u32;
    for (j, order) in ORDERS.into_iter().enumerate() {
        if j > 0 && more == 0 {
            break;
        }
        let order = sorted(&items, h, order);
        let mut tried = 0;
        for extra in [0, bound >> 10, bound >> 8] {
            let arena = bound.saturating_add(extra).div_ceil(PAGE).saturating_mul(PAGE).max(2 * zone);
            if arena == tried {
                // (The same whole pages: the same plan.)
                continue;
            }
            tried = arena;
            if best.as_ref().is_some_and(|(c, _)| arena >= *c) {
                // Nothing in this order, or in the larger arenas, can cost less.
                break;
            }
            if j > 0 {
                if more == 0 {
                    break;
                }
                more -= 1;
            }
            let mut failed = Vec::new();
            let (plan, left) = place(reqs.len(), &items, &order, arena, zone, &mut failed);
            let cost = arena.saturating_add(left);
            if best.as_ref().is_none_or(|(c, _)| cost < *c) {
                best = Some((cost, plan));
            }
            if arena == least && left > 0 {
                failures.push((left, order.clone(), failed));
            }
            if left == 0 {
                break;
            }
        }
    }
    // Retries at the least arena while the plan costs more: the order
    // that left least first, with the pairs that failed it placed first
    // (after those that must lie in a zone), all of them at once, then
    // also those that failed that, until a retry leaves more than twice
    // what the order left (on a recorded ViT loop, the repair of the order
    // that left least drifted to 100 times that, while another order's
    // reached the bound: docs/measurements.md).
    failures.sort_by_key(|f| f.0);
    for (start, order, failed) in failures {
        let mut first: Vec<usize> = Vec::new();
        let mut failed = failed;
        loop {
            if best.as_ref().is_some_and(|(c, _)| *c <= least) || more == 0 {
                return best.map(|(_, p)| p);
            }
            let before = first.len();
            for &i in &failed {
                if !items[i].crossing() && !first.contains(&i) {
                    first.push(i);
                }
            }
            if first.len() == before {
                break;
            }
            let mut retried: Vec<usize> = order.iter().copied().filter(|i| !first.contains(i)).collect();
            let lead = retried.iter().position(|&i| !items[i].crossing()).unwrap_or(retried.len());
            retried.splice(lead..lead, first.iter().copied());
            more -= 1;
            failed.clear();
            let (plan, left) = place(reqs.len(), &items, &retried, least, zone, &mut failed);
            let cost = least.saturating_add(left);
            if best.as_ref().is_none_or(|(c, _)| cost < *c) {
                best = Some((cost, plan));
            }
            if left > start.saturating_mul(2) {
                // The repair diverges: the next order's turn.
                break;
            }
        }
    }
    best.map(|(_, p)| p)
}

/// The orders [`aliased`] places the pairs in, each with the pairs that
/// must lie in a zone first; the next is tried only while the plans so far
/// leave a pair out or need more than the bound: by decreasing size (the
/// longer-lived first among equals); those live at the cycle's peak first,
/// in allocation order, then by size; the longest-lived first (tensors kept
/// from the forward for the backward, nested: a checkpointed model's
/// inputs, which by size come after larger short-lived ones and then find
/// no gap over their whole lifetimes); those that live to the step's end
/// first, in allocation order (gradients), then by size.
#[derive(Clone, Copy)]
enum Order {
    Size,
    PeakFirst,
    Longest,
    ToTheEnd,
}

const ORDERS: [Order; 4] = [Order::Size, Order::PeakFirst, Order::Longest, Order::ToTheEnd];

/// Pair visits [`aliased`] may spend on the placements of its orders after
/// the first and on its retries (about 30 ms natively: 1.8 ns a visit,
/// measured on a recorded profile of 1,058 pairs): a profile of a few
/// hundred pairs gets all of them, one of 2,500 four.
pub const ALIASED_WORK: u64 = 16_000_000;

/// The indices of `items` (of a cycle of `h` times) in `order`.
fn sorted(items: &[Item], h: u32, order: Order) -> Vec<usize> {
    use core::cmp::Reverse;
    let life = |i: &Item| u64::from(i.end - i.k) + u64::from(i.wrap);
    // The first time of the cycle with the most bytes live.
    let mut delta = vec![0i128; h as usize + 1];
    for it in items {
        delta[it.k as usize] += i128::from(it.size);
        delta[it.end.min(h) as usize] -= i128::from(it.size);
        if it.wrap > 0 {
            delta[0] += i128::from(it.size);
            delta[it.wrap.min(h) as usize] -= i128::from(it.size);
        }
    }
    let (mut live, mut most, mut peak) = (0i128, -1i128, 0u32);
    for (t, d) in delta.iter().enumerate() {
        live += d;
        if live > most {
            (most, peak) = (live, t as u32);
        }
    }
    let at_peak = |i: &Item| (i.k <= peak && peak < i.end) || peak < i.wrap;
    let mut out: Vec<usize> = (0..items.len()).collect();
    match order {
        Order::Size => out.sort_unstable_by_key(|&x| {
            let i = &items[x];
            (!i.crossing(), Reverse(i.size), Reverse(life(i)), i.k)
        }),
        Order::PeakFirst => out.sort_unstable_by_key(|&x| {
            let i = &items[x];
            (!i.crossing(), !at_peak(i), if at_peak(i) { i.k } else { 0 }, Reverse(i.size), Reverse(life(i)), i.k)
        }),
        Order::Longest => out.sort_unstable_by_key(|&x| {
            let i = &items[x];
            (!i.crossing(), Reverse(life(i)), Reverse(i.size), i.k)
        }),
        Order::ToTheEnd => out.sort_unstable_by_key(|&x| {
            let i = &items[x];
            let to_end = i.end >= h;
            (!i.crossing(), !to_end, if to_end { i.k } else { 0 }, Reverse(i.size), Reverse(life(i)), i.k)
        }),
    }
    out
}

/// The smallest gap of at least `size` bytes in `[lo, hi)` between the
/// blocks of `a` and `b` (each sorted by offset), and the offset at its low
/// end, or with `high` at its high end; the lowest on a tie.
fn smallest_gap(a: &[(u64, u64)], b: &[(u64, u64)], lo: u64, hi: u64, size: u64, high: bool) -> Option<(u64, u64)> {
    let mut best: Option<(u64, u64)> = None;
    let mut top = lo;
    let (mut i, mut j) = (0, 0);
    // The blocks of both in offset order (blocks of one offset may meet in
    // any order: the running top is their highest end either way), then
    // the region's end.
    loop {
        let next = match (a.get(i), b.get(j)) {
            (Some(x), Some(y)) if x.0 <= y.0 => {
                i += 1;
                *x
            }
            (_, Some(y)) => {
                j += 1;
                *y
            }
            (Some(x), None) => {
                i += 1;
                *x
            }
            (None, None) => (hi, u64::MAX),
        };
        let (off, end) = if next.0 >= hi { (hi, u64::MAX) } else { next };
        if off > top && off - top >= size && best.is_none_or(|(g, _)| off - top < g) {
            best = Some((off - top, if high { off - size } else { top }));
            if off - top == size {
                // No later gap is smaller (the first of the smallest wins).
                return best;
            }
        }
        top = top.max(end);
        if off >= hi {
            return best;
        }
    }
}

/// Places `items` in `order` in an arena of `arena` bytes with zones of
/// `zone`; returns the plan (for a profile of `n` requests) and the bytes
/// left out, and adds the items left out to `failed`, in order.
fn place(
    n: usize,
    items: &[Item],
    order: &[usize],
    arena: u64,
    zone: u64,
    failed: &mut Vec<usize>,
) -> (AliasedPlan, u64) {
    let h = n / 2;
    let mut offsets = vec![None; n];
    // The pairs placed so far, by offset: their ranges, and their items'
    // times (`k`, `end`, `wrap`).
    let mut placed: Vec<(u64, u64, u32, u32, u32)> = Vec::with_capacity(items.len());
    // Those of them that wrap (in the order placed).
    let mut wrapping: Vec<(u64, u64, u32, u32, u32)> = Vec::new();
    // The ranges an item must avoid: those of the placed pairs as they are
    // (in offset order, as `placed`) and as their zones swap (sorted).
    let (mut direct, mut swapped, mut left) = (Vec::new(), Vec::new(), 0u64);
    // From then on in a step, nothing of the previous step is left: what
    // is allocated then goes to the high end of its gap, towards the zone
    // the previous step's output left.
    let late = items.iter().map(|i| i.wrap).max().unwrap_or(0);
    for &i in order {
        let it = &items[i];
        let (k, end, w) = (it.k, it.end, it.wrap);
        direct.clear();
        swapped.clear();
        if w == 0 {
            // (Most pairs: against the others' main parts as they are, and
            // against the swapped ranges of those that wrap.)
            direct.extend(placed.iter().filter(|p| (k < p.3) & (p.2 < end)).map(|p| (p.0, p.1)));
            for &(o, e, _, _, jw) in &wrapping {
                if k < jw {
                    swap_zones(o, e, arena, zone, &mut swapped);
                }
            }
        } else {
            for &(o, e, jk, jend, jw) in &placed {
                // Main part against main part, and wrap against wrap (both
                // from the step's start): the same ranges.
                if (k < jend) & (jk < end) | (jw > 0) {
                    direct.push((o, e));
                }
                // Main against the other's wrap (and the reverse): the
                // range against the other's swapped one (the swap is its
                // own inverse).
                if (k < jw) | (jk < w) {
                    swap_zones(o, e, arena, zone, &mut swapped);
                }
            }
        }
        // By offset alone (see `smallest_gap`).
        swapped.sort_unstable_by_key(|b: &(u64, u64)| b.0);
        // A request live with its next instance lies wholly in one zone
        // (in the middle, the two would share bytes); the others anywhere.
        let regions: &[(u64, u64)] = if it.crossing() { &[(0, zone), (arena - zone, arena)] } else { &[(0, arena)] };
        let mut best: Option<(u64, u64)> = None; // (gap, offset)
        for &(lo, hi) in regions {
            if best.is_some_and(|(g, _)| g == it.size) {
                // An exact gap: no region has a smaller one.
                break;
            }
            if let Some((gap, off)) = smallest_gap(&direct, &swapped, lo, hi, it.size, it.k >= late) {
                if best.is_none_or(|(g, _)| gap < g) {
                    best = Some((gap, off));
                }
            }
        }
        match best {
            Some((_, off)) => {
                let at = placed.partition_point(|p| p.0 <= off);
                placed.insert(at, (off, off + it.size, it.k, it.end, it.wrap));
                if it.wrap > 0 {
                    wrapping.push((off, off + it.size, it.k, it.end, it.wrap));
                }
                offsets[it.k as usize] = Some(off);
                offsets[it.k as usize + h] = Some(off);
            }
            None => {
                left = left.saturating_add(it.size.saturating_mul(2));
                failed.push(i);
            }
        }
    }
    (AliasedPlan { arena_bytes: arena, zone_bytes: zone, offsets }, left)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MB: u64 = 1 << 20;

    fn req(bytes: u64, freed_at: Option<u32>, wraps_to: Option<u32>) -> Request {
        Request { bytes, freed_at, wraps_to }
    }

    /// Two steps of a loop that keeps its output (logits and per-layer
    /// key/value tensors) until the next forward returns; its loss
    /// temporaries at the peak are as large as the logits.
    fn kept_output_steps(layers: u32, sizes: &mut impl FnMut() -> u64) -> Vec<Request> {
        // (bytes, kind): 0 activation, 1 kept output, 2 temporary
        let mut step: Vec<(u64, u8)> = Vec::new();
        for _ in 0..layers {
            step.push((sizes(), 0));
            step.push((24 * MB, 1));
            step.push((6 * MB, 2));
        }
        step.push((1570 * MB, 1)); // logits
        let forward_end = step.len() as u32; // the previous output is freed here
        step.push((1570 * MB, 2)); // two loss temporaries at the peak
        step.push((1570 * MB, 2));
        for _ in 0..layers {
            step.push((12 * MB, 2));
        }
        let m = step.len() as u32;
        let acts: Vec<u32> = (0..m).filter(|&i| step[i as usize].1 == 0).collect();
        let mut reqs = Vec::new();
        for half in 0..2u32 {
            let base = half * m;
            for (i, &(bytes, kind)) in step.iter().enumerate() {
                let (i, k) = (i as u32, base + i as u32);
                reqs.push(match kind {
                    0 => {
                        let nth = acts.iter().position(|&a| a == i).expect("an activation") as u32;
                        req(bytes, Some(base + m - nth), None)
                    }
                    1 if half == 0 => req(bytes, Some(m + forward_end), None),
                    1 => req(bytes, None, Some(forward_end)),
                    _ if i == forward_end => req(bytes, Some(k + 2), None),
                    _ => req(bytes, Some(k + 1), None),
                });
            }
        }
        reqs
    }

    /// Every two planned requests whose lifetimes meet lie in disjoint
    /// physical ranges, inside the arena; returns the planned requests.
    fn check(reqs: &[Request], p: &AliasedPlan) -> usize {
        let n = reqs.len();
        assert_eq!(p.offsets.len(), n);
        assert!(
            p.arena_bytes.is_multiple_of(PAGE)
                && p.zone_bytes.is_multiple_of(PAGE)
                && 2 * p.zone_bytes <= p.arena_bytes
        );
        let mut ranges: Vec<(usize, Vec<(u64, u64)>)> = Vec::new();
        for (k, o) in p.offsets.iter().enumerate() {
            let Some(o) = *o else { continue };
            let mut v = Vec::new();
            p.physical(k, n, o, reqs[k].planned_bytes(), &mut v);
            assert!(v.iter().all(|&(a, e)| a < e && e <= p.arena_bytes), "request {k} leaves the arena");
            assert_eq!(v.iter().map(|&(a, e)| e - a).sum::<u64>(), reqs[k].planned_bytes());
            ranges.push((k, v));
        }
        for (x, (a, ra)) in ranges.iter().enumerate() {
            for (b, rb) in &ranges[x + 1..] {
                let (ia, ma) = reqs[*a].intervals(*a as u32, n as u32);
                let (ib, mb) = reqs[*b].intervals(*b as u32, n as u32);
                let meet = ia[..ma].iter().any(|&(s, e)| ib[..mb].iter().any(|&(u, v)| s < v && u < e));
                let share = ra.iter().any(|&(s, e)| rb.iter().any(|&(u, v)| s < v && u < e));
                assert!(!(meet && share), "requests {a} and {b} share bytes while both live");
            }
        }
        ranges.len()
    }

    #[test]
    fn the_zones_swap_and_the_middle_stays() {
        let mut v = Vec::new();
        // Arena 10 pages, zones of 2: [1, 9) covers the low zone's second page, the middle, the high zone's first.
        swap_zones(PAGE, 9 * PAGE, 10 * PAGE, 2 * PAGE, &mut v);
        assert_eq!(v, [(9 * PAGE, 10 * PAGE), (2 * PAGE, 8 * PAGE), (0, PAGE)]);
        let mut back = Vec::new();
        for &(o, e) in &v {
            swap_zones(o, e, 10 * PAGE, 2 * PAGE, &mut back);
        }
        back.sort_unstable();
        assert_eq!(back, [(PAGE, 2 * PAGE), (2 * PAGE, 8 * PAGE), (8 * PAGE, 9 * PAGE)]);
    }

    #[test]
    fn a_kept_output_loop_is_planned_at_its_live_bound() {
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut sizes = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (20 + x % 80) * MB + (x >> 40) % 4096 * 512
        };
        let reqs = kept_output_steps(24, &mut sizes);
        let p = aliased(&reqs).expect("two like steps whose output outlives its next instance");
        assert_eq!(check(&reqs, &p), reqs.len());
        let bound = live_bound(&reqs);
        assert_eq!(p.arena_bytes, bound.div_ceil(PAGE) * PAGE, "the arena is the live bound, to a page");
        // One plan of the two steps as one profile cannot reach it.
        let plain = crate::plan(&reqs);
        assert!(plain.arena_bytes > p.arena_bytes, "{} against {}", plain.arena_bytes, p.arena_bytes);
    }

    #[test]
    fn pairs_that_no_order_places_are_placed_by_retrying_with_them_first() {
        // Two like steps of nine requests (in pages; each freed at the
        // time given, the second step's nine later), the first kept into
        // the next step until its time 8 (found by a random search). At
        // the live bound, each order leaves a pair out; placed again with
        // the pairs that failed placed first, every pair fits.
        let step: [(u64, u32); 9] = [(1, 17), (2, 4), (2, 8), (3, 5), (1, 9), (3, 6), (3, 9), (1, 8), (4, 9)];
        let mut reqs: Vec<Request> = step.iter().map(|&(pages, f)| req(pages * PAGE, Some(f), None)).collect();
        reqs.push(req(PAGE, None, Some(8)));
        reqs.extend(step[1..].iter().map(|&(pages, f)| req(pages * PAGE, Some(f + 9), None)));
        let items = items(&reqs).unwrap();
        let least = live_bound(&reqs).div_ceil(PAGE) * PAGE;
        for order in ORDERS {
            let (_, left) = place(reqs.len(), &items, &sorted(&items, 9, order), least, PAGE, &mut Vec::new());
            assert!(left > 0, "an order places every pair");
        }
        let p = aliased(&reqs).unwrap();
        assert_eq!((p.arena_bytes, p.zone_bytes), (least, PAGE));
        assert_eq!(check(&reqs, &p), reqs.len());
        // With more effort: the same plan (the retries fit the work bound).
        assert_eq!(aliased_with(&reqs, Effort::times(100)), Some(p));
    }

    #[test]
    fn random_two_step_profiles_get_valid_aliased_plans() {
        let mut next = crate::tests::xorshift(0x9e37_79b9_7f4a_7c15);
        let mut planned = 0;
        for round in 0..150 {
            let h = 2 + next(60) as u32;
            let n = 2 * h;
            // One step's requests; some live into the next step (past
            // their next instance or not), some to the next period.
            let step: Vec<(u64, u32)> =
                (0..h).map(|k| (1 + next(8 * MB), k + 1 + next(u64::from(h) + 4) as u32)).collect();
            let mut reqs = Vec::new();
            for half in 0..2 {
                for &(bytes, end) in &step {
                    let end = end + half * h;
                    reqs.push(if end < n { req(bytes, Some(end), None) } else { req(bytes, None, Some(end - n)) });
                }
            }
            // Deviations of the second step: a later free, a resize.
            if next(3) == 0 {
                let k = (h + next(u64::from(h)) as u32) as usize;
                if let Some(f) = reqs[k].freed_at.filter(|&f| f + 1 < n) {
                    reqs[k].freed_at = Some(f + 1);
                }
            }
            match aliased(&reqs) {
                Some(p) => {
                    check(&reqs, &p);
                    planned += 1;
                }
                None => assert!(
                    !(0..h as usize).any(|k| reqs[k].freed_at.is_some_and(|f| f > h + k as u32)),
                    "round {round}: a profile with outputs that outlive their next instance gets no aliased plan"
                ),
            }
        }
        assert!(planned > 50, "only {planned} profiles planned");
    }

    #[test]
    fn the_smallest_gap_of_two_sorted_lists_is_that_of_their_union() {
        // The reference: the union sorted, with the region's outside as blocks.
        fn reference(blocks: &[(u64, u64)], lo: u64, hi: u64, size: u64, high: bool) -> Option<(u64, u64)> {
            let mut all = blocks.to_vec();
            all.push((0, lo));
            all.push((hi, u64::MAX));
            all.sort_unstable_by_key(|b| b.0);
            let (mut best, mut top): (Option<(u64, u64)>, u64) = (None, 0);
            for &(off, end) in &all {
                if off > top && off - top >= size && best.is_none_or(|(g, _)| off - top < g) {
                    best = Some((off - top, if high { off - size } else { top }));
                }
                top = top.max(end);
            }
            best
        }
        let mut next = crate::tests::xorshift(0x5851_f42d_4c95_7f2d);
        for _ in 0..2000 {
            let list = |next: &mut dyn FnMut(u64) -> u64, n: u64| {
                let mut v: Vec<(u64, u64)> = (0..n)
                    .map(|_| {
                        let o = next(200);
                        (o, o + 1 + next(30))
                    })
                    .collect();
                v.sort_unstable_by_key(|b| b.0);
                v
            };
            let (na, nb) = (next(12), next(4));
            let (a, b) = (list(&mut next, na), list(&mut next, nb));
            let lo = next(100);
            let hi = lo + 1 + next(200);
            let size = 1 + next(40);
            let high = next(2) == 0;
            let union: Vec<(u64, u64)> = a.iter().chain(&b).copied().collect();
            assert_eq!(
                smallest_gap(&a, &b, lo, hi, size, high),
                reference(&union, lo, hi, size, high),
                "{a:?} {b:?} in [{lo}, {hi}) for {size}"
            );
        }
    }

    #[test]
    fn profiles_that_are_not_two_like_steps_get_none() {
        let two = [req(512, Some(3), None), req(512, Some(2), None), req(512, Some(4), None), req(512, None, Some(1))];
        assert!(aliased(&two).is_some());
        let mut other = two;
        other[2].bytes = 2048;
        assert!(aliased(&other).is_none());
        assert!(aliased(&two[..3]).is_none());
        assert!(aliased(&[]).is_none());
        // Nothing outlives its next instance: a plain plan does as well.
        let plain =
            [req(512, Some(1), None), req(512, Some(2), None), req(512, Some(3), None), req(512, Some(4), None)];
        assert!(aliased(&plain).is_none());
    }
}
