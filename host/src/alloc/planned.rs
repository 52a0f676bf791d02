//! Planned placement: learn a training step, plan its memory ahead of time,
//! serve it at planned offsets in one arena.
//!
//! ```text
//!  step s:   every request recorded (bytes, kind, stream, when freed) ─► profile
//!  step end: planner(profile) ─► plan ─► validate_plan ─► stored (≤ 8, keyed by the first request)
//!  step s+1: at the plan's install point, a larger arena (one segment of the `planned` pool)
//!  step s+1: request ──match the plan's next entries──► its offset free? ─► served there (a hit)
//!                          │ no entry matches, or the range is occupied (a deviation)
//!                          └──────────────────────────────────────────────► the dynamic path
//! ```
//!
//! A step is profiled completely when every request's lifetime is known
//! within it, or once it repeated the previous step's sequence (then the
//! ends of its end-live requests were seen in the next step: `wraps_to`).
//! The arena is not allocated when the plan is made but when a step that
//! matches it reaches its *install point* ([`install_point`]: the time with
//! the fewest planned bytes live): the old arena is freed if empty, the
//! arena refused if it and what stays dynamic would reserve more than the
//! run's high-water mark (a plan never raises the peak), the dynamic cache
//! released, the arena allocated — a plain one of 2 GiB or more (or of
//! nearly whole pages) mapped from the whole pages the dynamic path has
//! free ([`Allocator::stitched_arena`]:
//! no device call gives them back, one allocation makes the rest; given
//! back, its pages stay mapped as a free paged segment of the dynamic
//! path, which the next arena takes in turn; an aliased arena's parts
//! likewise, [`Allocator::paged_aliased_arena`]) —, and the plan's tensors live
//! then moved to their planned offsets (a device copy each) — unless the
//! allocator must keep addresses stable (the C ABI: PyTorch holds the
//! pointers), where they stay and their ranges are misses this step. When
//! the dynamic path runs out of memory, any free range of an arena that
//! holds the request serves it ([`Allocator::arena_fallback`]); under
//! pressure, idle arenas are the sixth rung of the reclamation ladder. A
//! request that missed its plan, where growing would raise the peak,
//! borrows the arena's free space first ([`Allocator::lend_idle_arena`]):
//! where the plan allocates least while its tensor is expected to live (as
//! planned, for a request the plan has), never a planned request larger
//! than the growth it saves (for a request the plan leaves dynamic, which
//! comes every step: than half of it) ([`Allocator::displaced`]), at a free
//! block's start or end.
//! The dynamic path keeps some room whatever is given back: the free bytes
//! of segments held by tensors that outlive the step (a loss kept for
//! logging holds a segment of small tensors). A step's requests that it
//! would place there are left out of the plan while the bytes they keep
//! live at once fit in [`ROOM_SHARE`] of that room
//! ([`Allocator::room_left`]); they are served there as planned (no
//! misses), and the arena need not hold them too. A plan cache keeps a plan
//! of every request (the next run has no such room).
//! Traces without step markers (most PyTorch snapshots) stay on the dynamic
//! path, with `defrag`'s results — unless the planner asks for steps found
//! by the period of the requests ([`PlannerPolicy::steps_by_period`],
//! `planned?steps=period`: see [`super::period`]), which then end steps
//! until the run marks one. A profile longer than [`MAX_PROFILE`] requests
//! is dropped (that step is not planned).
//!
//! Matching tolerates deviations: a request is compared with the next
//! [`LOOKAHEAD`] entries of the plan; a match there skips the entries before
//! it (missing requests, or ones that come later: a request takes an entry
//! skipped before one ahead, so that reordered requests keep their own);
//! else a request of the entry at the cursor's kind,
//! stream and planned size (its bytes rounded to [`PLAN_ALIGN`]) is that
//! one, a few bytes off; no match leaves the cursor (an extra request). At
//! a step's first request the most recently used plan whose first entry
//! matches is chosen. A step is planned again when it missed more than 1 %
//! of its requests, or when its profile knows more lifetimes than the plan's.
//!
//! Invariants (checked by [`Allocator::check_invariants`]):
//! - every arena is a whole segment of the `planned` pool, not a paged
//!   segment of the dynamic path (one mapped from pages holds its pages,
//!   then its rest, itself, in order from its base — an aliased one per
//!   part, in both windows); its
//!   free blocks are in no free index; its finger (the block touched last)
//!   is one of its blocks. A planned range is found without an index to
//!   maintain: it almost always starts a free block, which a direct-mapped
//!   cache of free block starts (overwritten, never cleaned, validated on
//!   use) gives in O(1); else the finger or a block hint of the same 2 MiB
//!   and the block links lead to it;
//! - a tensor is served from the arena only into a range that was entirely
//!   free: no tensor is ever placed over a live one, whatever the plan;
//! - `plan_arena_bytes = Σ arena sizes`.

use std::path::{Path, PathBuf};

use rustc_hash::FxHashMap;

use super::paged::Page;
use super::period::PeriodDetector;
use super::plan_cache::{CacheContent, CacheError, CachedPlan};
use super::policies::RoleHealth;
use super::slab::{Block, Segment, NIL};
use super::{ActionKind, AllocError, Allocator, InvariantError, Pool, Tier};
use crate::decision::{
    cycle_live, validate_aliased, validate_plan, AliasedPlan, AllocRequest, Plan, PlanRequest, PlannerPolicy,
    ReclaimDecision, Refined, StepProfile, PLAN_ALIGN,
};
use crate::device::{Device, DeviceError, DevicePtr, PhysHandle};
use crate::types::{StreamId, TensorId, TensorKind};

/// Plans kept at once (different kinds of steps).
pub const MAX_PLANS: usize = 8;

/// Entries of the plan a request is compared with.
pub const LOOKAHEAD: usize = 8;

/// Free blocks of an arena tried, best fit first, when the dynamic path
/// borrows its memory (in an aliased arena a block whose alias in the
/// other window is taken cannot serve).
const ALIAS_TRIES: usize = 64;

/// Planned ranges of the next entries offered as places when a request
/// that missed its plan borrows an arena's free space (see
/// [`Allocator::slot_fits`]).
const SLOT_TRIES: usize = 64;

/// What identifies a miss that borrowed the arena ([`Planning::lent`]).
type LentKey = (u32, u32, (u32, u32), u64, Key);

/// Plan entries a miss the plan has no entry for (another step's request:
/// an evaluation pass inside a planned step) is expected to live when it
/// borrows an arena's free space — a few layers of a forward pass; most
/// such requests are an evaluation's temporaries. One that lives longer
/// only lies in a range that was free: a planned request that then finds
/// its range taken misses, as any deviation. Expected to live a whole
/// cycle, no range was free that long: a kept-output loop evaluating in
/// the second step of its planned pairs (lske4, warm) grew the dynamic
/// path beside the arena at every evaluation (1.0113 against `defrag`'s
/// 1.0003; now 1.0004).
const UNKNOWN_LIFETIME: u32 = 64;

/// Most borrowed offsets remembered ([`Planning::lent`]).
const LENT_MEMO: usize = 1 << 14;

/// Plan entries looked ahead when a request that missed its plan borrows
/// an arena's free space (see [`Allocator::displaced`]).
const LEND_HORIZON: u32 = 4096;

/// Steps within which a second step that leaves its plan turns planned
/// placement off (see [`Allocator::suspend_if_unsteady`]).
const LEFT_AGAIN: u64 = 8;

/// Name of the pool of planned arenas.
pub const PLANNED_POOL: &str = "planned";

/// What identifies a request in a plan.
type Key = (u64, TensorKind, StreamId);

fn key(r: &PlanRequest) -> Key {
    (r.bytes, r.kind, r.stream)
}

/// A validated plan and the requests it was made for.
#[derive(Debug)]
struct StoredPlan {
    keys: Vec<Key>,
    offsets: Vec<Option<u64>>,
    /// When each request was freed, in the plan's time (past its length:
    /// in the next cycle; twice its length: never seen freed).
    frees: Vec<u32>,
    arena_bytes: u64,
    /// Requests of the profile whose lifetime was known (for replanning).
    known: usize,
    /// The request before which the arena is installed (see [`install_point`]).
    install_at: usize,
    last_used: u64,
    /// Only for a run's first step (a plan from the cache).
    first_only: bool,
    /// Bytes of its persistent requests (in the kept arena).
    kept_bytes: u64,
    /// Chosen for a step in this run (a cached plan that never is is not
    /// written back).
    used: bool,
    /// Read from the plan cache: its arena is held to the high-water mark
    /// of the run that made it.
    from_cache: bool,
    /// The profile and the planner's own plan, when a plan cache keeps them.
    cached: Option<Box<CachedPlan>>,
    /// Planned again from a step it served, it came out the same: its
    /// misses are the steps around it (another kind of step leaving its
    /// tensors where this plan expects its own), not for a new plan.
    settled: bool,
    /// An aliased plan (two steps in two windows over one arena): the
    /// bytes of each end zone; 0: a plain plan. Its offsets are then
    /// virtual, the second half's in window 1 (`+ arena_bytes / 2`).
    zone: u64,
    /// Its planner may still find a cheaper plan for the cache
    /// ([`PlannerPolicy::refine`]; off once it says the search is over, or
    /// fails).
    refinable: bool,
    /// Calls to [`PlannerPolicy::refine`] for it in this run (at most [`MAX_REFINES`]).
    refines: u32,
    /// Made from a run's first step, whose end-live requests' lifetimes
    /// were guessed ([`guessed_first`]): the peak live bytes of its planned
    /// requests (the least any placement of them needs); 0: not such a plan.
    guessed_need: u64,
    /// Requests left out of the plan for the free room of the dynamic
    /// path's held segments ([`Allocator::room_left`]; empty: none): served
    /// there, they are no misses.
    roomed: Vec<bool>,
    /// The entries at which each forward pass of its steps began (a plan
    /// of two steps: per step; empty: not known yet — a cached plan learns
    /// them from a step of its very requests). A planned step of two
    /// comes back to them at its forward passes ([`Planning::resync`]).
    forward_at: [Vec<u32>; 2],
    /// Its entries' physical pieces by bucket of arena memory, for
    /// [`Allocator::displaced`] (built on first use for the arena's size
    /// and zone).
    space: Option<SpaceIndex>,
}

/// The physical pieces of a plan's entries (those in its arena), each in
/// every bucket of `1 << shift` bytes it meets: what a range of the arena
/// holds over the plan's time is found from the few buckets it meets,
/// without a scan of every entry.
#[derive(Debug)]
struct SpaceIndex {
    /// The arena's (size, zone) it was built for.
    key: (u64, u64),
    shift: u32,
    /// Per bucket: (piece start, piece end, entry, its planned bytes).
    buckets: Vec<Vec<(u64, u64, u32, u64)>>,
}

impl SpaceIndex {
    fn build(plan: &StoredPlan, size: u64, zone: u64) -> Self {
        let phys = if zone == 0 { size } else { size / 2 };
        let shift = (phys / 256).max(1).next_power_of_two().trailing_zeros().max(21);
        let mut buckets = vec![Vec::new(); (phys >> shift) as usize + 1];
        for (e, (o, k)) in plan.offsets.iter().zip(&plan.keys).enumerate() {
            let Some(o) = o.filter(|o| o & KEPT == 0) else { continue };
            let bytes = k.0.div_ceil(PLAN_ALIGN) * PLAN_ALIGN;
            for (lo, hi) in physical(o, o + bytes, size, zone).into_iter().filter(|&(lo, hi)| lo < hi) {
                // (Past the arena — a plan that needs a larger one —
                // in the last bucket: no candidate lies there.)
                let last = buckets.len() - 1;
                let (b0, b1) = (((lo >> shift) as usize).min(last), (((hi - 1) >> shift) as usize).min(last));
                for b in &mut buckets[b0..=b1] {
                    b.push((lo, hi, e as u32, bytes));
                }
            }
        }
        SpaceIndex { key: (size, zone), shift, buckets }
    }
}

impl StoredPlan {
    /// A stored plan of `c` in an arena of at least `arena` bytes (an
    /// aliased plan: its own); the persistent requests of a first-step plan
    /// are packed, in their order, in the kept arena (their offsets marked
    /// [`KEPT`]).
    fn of(c: &CachedPlan, arena: u64, first_only: bool, now: u64) -> Self {
        if c.zone == 0 {
            return Self::build(&c.profile.requests, &c.plan, &c.persistent, arena, first_only, now);
        }
        let flat = windows(&c.plan.offsets, c.plan.arena_bytes, first_only);
        StoredPlan { zone: c.zone, ..Self::build(&c.profile.requests, &flat, &c.persistent, 0, first_only, now) }
    }

    /// A stored plan of `plan` for `profile`, not kept for a plan cache.
    fn of_profile(profile: &StepProfile, plan: &Plan, arena: u64, now: u64) -> Self {
        Self::build(&profile.requests, plan, &[], arena, false, now)
    }

    fn build(reqs: &[PlanRequest], plan: &Plan, persistent: &[u32], arena: u64, first_only: bool, now: u64) -> Self {
        let mut offsets = plan.offsets.clone();
        let mut at = 0;
        for &k in persistent {
            offsets[k as usize] = Some(at | KEPT);
            at += reqs[k as usize].planned_bytes();
        }
        let n = reqs.len() as u32;
        StoredPlan {
            keys: reqs.iter().map(key).collect(),
            offsets,
            frees: reqs
                .iter()
                .map(|r| r.freed_at.unwrap_or_else(|| n.saturating_add(r.wraps_to.unwrap_or(n))))
                .collect(),
            kept_bytes: at,
            used: false,
            arena_bytes: arena.max(plan.arena_bytes).div_ceil(PLAN_ALIGN) * PLAN_ALIGN,
            known: reqs.iter().enumerate().filter(|(k, r)| r.plannable(*k as u32)).count(),
            install_at: install_point(reqs, &plan.offsets).0,
            last_used: now,
            first_only,
            from_cache: false,
            cached: None,
            settled: false,
            zone: 0,
            refinable: true,
            refines: 0,
            guessed_need: 0,
            roomed: Vec::new(),
            forward_at: Default::default(),
            space: None,
        }
    }

    /// A stored aliased plan of `plan` for `profile` (two like steps): the
    /// arena is its two windows (`2 ×` the physical bytes), the second
    /// half's offsets in window 1 ([`windows`]).
    fn of_aliased(profile: &StepProfile, plan: &AliasedPlan, now: u64) -> Self {
        let flat = windows(&plan.offsets, plan.arena_bytes, false);
        StoredPlan { zone: plan.zone_bytes, ..Self::build(&profile.requests, &flat, &[], 0, false, now) }
    }

    /// Physical bytes of its arena (an aliased plan's two windows share them).
    fn physical(&self) -> u64 {
        if self.zone > 0 {
            self.arena_bytes / 2
        } else {
            self.arena_bytes
        }
    }

    /// The same, keeping `c` for the plan cache.
    fn keeping(self, c: CachedPlan) -> Self {
        StoredPlan { cached: Some(Box::new(c)), ..self }
    }
}

/// A run's plan cache (see [`super::plan_cache`]).
#[derive(Debug)]
struct CacheState {
    path: PathBuf,
    /// The first-step plan: loaded, or made from `first_profile`.
    first: Option<CachedPlan>,
    /// This run's first step, when its plan is learned in this run.
    first_profile: Option<StepProfile>,
    /// The first step's end-live requests not freed yet: handle → index.
    first_live: BySlot,
    /// `first` is to be planned again from `first_profile` (an end-live
    /// request of the first step was freed: it is not persistent).
    first_stale: bool,
    /// The planner may still find a cheaper `first` ([`PlannerPolicy::refine`]).
    first_refinable: bool,
    /// Calls to [`PlannerPolicy::refine`] for `first` in this run.
    first_refines: u32,
    /// Something to write at the next step end.
    dirty: bool,
    /// A write failed (warned once).
    write_failed: bool,
    /// The file was written in this run.
    written: bool,
    /// The last write said no plan served this run
    /// ([`CacheContent::dynamic`]).
    written_dynamic: bool,
}

/// Most calls to [`PlannerPolicy::refine`] for one plan in a run: a
/// hundred searches as long as its planning's (the built-in planner at
/// `effort=100`, over a run's steps).
const MAX_REFINES: u32 = 100;

/// Marks a planned offset in the kept arena: the one of the persistent
/// requests of a cached first-step plan (parameters, optimizer states),
/// apart from the arena of the step's other requests so that it is
/// released with them, not with the step.
const KEPT: u64 = 1 << 63;

/// Entries of an arena's cache of free block starts (two in unit tests:
/// its misses, and so the other ways to the block, are then the rule).
#[cfg(not(test))]
const START_SLOTS: usize = 4096;
#[cfg(test)]
const START_SLOTS: usize = 2;

/// The entry of offset `off` in an arena's cache of free block starts.
#[inline]
fn start_slot(off: u64) -> usize {
    ((off / PLAN_ALIGN).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 52) as usize & (START_SLOTS - 1)
}

/// Bytes of an arena covered by one entry of its block hints.
const HINT_SPAN_LOG2: u32 = 21;

/// One arena: a segment of the `planned` pool, its free blocks by start
/// offset, and where to start looking for the block holding an offset that
/// starts none.
#[derive(Debug)]
struct Arena {
    seg: u32,
    base: DevicePtr,
    size: u64,
    /// Free blocks by start offset, direct-mapped ([`start_slot`]): a hint,
    /// validated on use.
    starts: Vec<u32>,
    /// A block of the arena, always: the one touched last.
    finger: u32,
    /// Per 2 MiB of the arena, a block that was there when last touched
    /// (validated on use).
    near: Vec<u32>,
    /// An aliased arena: the bytes of each end zone (0: a plain one, one
    /// device allocation). Its segment is two windows of `size / 2` over
    /// the same physical memory, the second with its end zones swapped.
    zone: u64,
    /// An aliased arena's physical allocations: low zone, middle, high
    /// zone (`None`: none, or not made yet).
    phys: [Option<PhysHandle>; 3],
    /// An aliased arena's zone not made yet (0: low, 2: high): where the
    /// tensors of the step before its install lay in the plan, still live
    /// on the dynamic path then; made once a request needs it.
    pending: Option<usize>,
    /// A plain arena mapped from pages ([`Allocator::stitched_arena`]):
    /// what is mapped from its base on.
    pages: Option<Box<ArenaPages>>,
    /// An aliased arena mapped from pages
    /// ([`Allocator::paged_aliased_arena`]): per part, the pages mapped from
    /// its start (in both windows), before its allocation in `phys` (then
    /// the rest of the part, if any).
    zone_pages: Option<Box<[Vec<Page>; 3]>>,
}

/// Physical memory mapped into an aliased arena: a page of the dynamic
/// path's, or an allocation of its own (mapped whole).
#[derive(Debug, Clone, Copy)]
enum Piece {
    /// A page (of a chunk the paging part keeps).
    Page(Page),
    /// An allocation of the arena's own.
    Whole(PhysHandle),
}

/// The physical memory of a plain arena mapped from pages, in order from
/// its base: whole pages the dynamic path had free, then one allocation for
/// the rest (if any).
#[derive(Debug)]
struct ArenaPages {
    /// Page `i` is mapped at `base + i × page`.
    pages: Vec<Page>,
    /// Mapped right after the pages.
    rest: Option<PhysHandle>,
}

impl Arena {
    fn new(seg: u32, base: DevicePtr, size: u64, block: u32) -> Self {
        let spans = size.div_ceil(1 << HINT_SPAN_LOG2) as usize;
        let near = vec![block; spans];
        let (zone, phys, pending, pages, zone_pages) = (0, [None; 3], None, None, None);
        let starts = vec![NIL; START_SLOTS];
        let mut a = Arena { seg, base, size, starts, finger: block, near, zone, phys, pending, pages, zone_pages };
        a.started(0, block);
        a
    }

    /// Physical bytes it holds (an aliased arena's windows share them).
    fn physical(&self) -> u64 {
        if self.zone > 0 {
            self.size / 2 - if self.pending.is_some() { self.zone } else { 0 }
        } else {
            self.size
        }
    }

    /// An aliased arena's parts (low zone, middle, high zone): bytes, and
    /// offsets in window 0 and window 1.
    fn parts(&self) -> [(u64, u64, u64); 3] {
        let (half, zone) = (self.size / 2, self.zone);
        [(zone, 0, 2 * half - zone), (half - 2 * zone, zone, half + zone), (zone, half - zone, half)]
    }

    /// An aliased arena's physical allocations of part `i`, in order from
    /// the part's start, each with its offset in the part: its pages of
    /// `page` bytes, then its allocation in `phys`.
    fn part_handles(&self, i: usize, page: u64) -> Vec<(Piece, u64)> {
        let pages = self.zone_pages.as_ref().map_or(&[][..], |z| &z[i][..]);
        let mut out: Vec<(Piece, u64)> =
            pages.iter().enumerate().map(|(j, &h)| (Piece::Page(h), j as u64 * page)).collect();
        out.extend(self.phys[i].map(|h| (Piece::Whole(h), pages.len() as u64 * page)));
        out
    }

    /// Whether `[off, off + size)` (of one window) uses the physical memory
    /// of the zone not made yet.
    #[inline]
    fn touches_pending(&self, off: u64, size: u64) -> bool {
        let Some(p) = self.pending else { return false };
        let (bytes, w0, w1) = self.parts()[p];
        let meets = |at: u64| off < at + bytes && at < off + size;
        meets(w0) || meets(w1)
    }

    /// Notes that free block `blk` starts at `offset`.
    #[inline]
    fn started(&mut self, offset: u64, blk: u32) {
        self.starts[start_slot(offset)] = blk;
    }

    /// Notes that `blk` (of this arena) covers `offset`.
    #[inline]
    fn touch(&mut self, blk: u32, offset: u64) {
        self.finger = blk;
        if let Some(n) = self.near.get_mut((offset >> HINT_SPAN_LOG2) as usize) {
            *n = blk;
        }
    }
}

/// A `carried_freed` entry not freed yet.
const NOT_FREED: u32 = u32::MAX;

/// Tensor handles → request index, by handle slot (slots are small and
/// dense): no hashing on the hot path, and no allocation once warm.
#[derive(Debug, Default)]
struct BySlot {
    at: Vec<Option<(TensorId, u32)>>,
    /// Slots with an entry, each once (some may have been taken since).
    used: Vec<u32>,
    listed: Vec<bool>,
}

impl BySlot {
    fn insert(&mut self, id: TensorId, k: u32) {
        let s = id.slot as usize;
        if s >= self.at.len() {
            self.at.resize(s + 1, None);
            self.listed.resize(s + 1, false);
        }
        self.at[s] = Some((id, k));
        if !self.listed[s] {
            self.listed[s] = true;
            self.used.push(id.slot);
        }
    }

    /// The index of `id`, removed.
    fn take(&mut self, id: TensorId) -> Option<u32> {
        let e = self.at.get_mut(id.slot as usize)?;
        match *e {
            Some((h, k)) if h == id => {
                *e = None;
                Some(k)
            }
            _ => None,
        }
    }

    fn contains(&self, id: TensorId) -> bool {
        matches!(self.at.get(id.slot as usize), Some(Some((h, _))) if *h == id)
    }

    fn get(&self, id: TensorId) -> Option<u32> {
        match self.at.get(id.slot as usize) {
            Some(&Some((h, k))) if h == id => Some(k),
            _ => None,
        }
    }

    fn entries(&self) -> impl Iterator<Item = (TensorId, u32)> + '_ {
        self.used.iter().filter_map(|&s| self.at[s as usize])
    }

    fn clear(&mut self) {
        for s in self.used.drain(..) {
            self.at[s as usize] = None;
            self.listed[s as usize] = false;
        }
    }
}

/// The planning state of an allocator (see the module documentation).
pub(crate) struct Planning {
    planner: Box<dyn PlannerPolicy>,
    /// Failure accounting of the planner.
    pub health: RoleHealth,
    /// This step's requests, in order.
    current: Vec<PlanRequest>,
    /// This step's requests still live: handle → index.
    live: BySlot,
    /// The previous step's requests live at its end: handle → index.
    carried: BySlot,
    /// When each of the previous step's end-live requests was freed in this
    /// step, by its index ([`NOT_FREED`]: not yet).
    carried_freed: Vec<u32>,
    /// The previous step's request keys (to match wraps by position).
    previous: Vec<Key>,
    plans: Vec<StoredPlan>,
    /// The plan serving this step, and the next entry to match.
    active: Option<usize>,
    cursor: usize,
    /// Entries the cursor skipped in this step (at most [`LOOKAHEAD`], the
    /// latest): a request that arrives after its place (two swapped) takes
    /// its own entry, not a later one of the same key.
    skipped: Vec<u32>,
    /// Entries before a forward pass of this step that a resynchronised
    /// plan of two steps jumped over ([`Planning::resync`]: at most
    /// [`LOOKAHEAD`]): the step's inputs, still to come when an evaluation
    /// forward pass came first. A request of their key takes one of them
    /// before any entry ahead of the cursor (which the evaluation brought
    /// into the forward pass: a range a large tensor of the step needs
    /// later, while the input lives on).
    early: Vec<u32>,
    /// No plan is chosen for this step yet, and one still may be: its
    /// first [`LOOKAHEAD`] requests may start a plan (what comes before
    /// is extra).
    choosing: bool,
    /// The step's requests before which a plan may still be chosen (its
    /// first [`LOOKAHEAD`]; at a later forward pass, that pass's first
    /// request alone).
    choose_until: usize,
    /// A later forward pass of the step began while no plan served it (an
    /// evaluation forward came before a training step's): a plan whose
    /// first [`LOOKAHEAD`] requests hold the pass's first request may
    /// start there.
    late_forward: bool,
    /// The active plan was chosen after requests of the step it lacks (an
    /// evaluation before the training step it plans): those were another
    /// step's, so the step is planned again at its end; leaving the plan,
    /// or having its arena refused (what came before may hold memory), is
    /// no sign of unsteady steps and sets no floor on arenas.
    chosen_late: bool,
    /// The step's request at which the active plan was chosen late (the
    /// next [`LOOKAHEAD`] must be its next entries, or the choice is undone).
    late_from: usize,
    /// The active plan needs a larger arena: it is matched, not served,
    /// until its install point.
    installing: bool,
    /// While installing: this step's requests and the plan entries they matched.
    matched: Vec<(TensorId, u32)>,
    /// The plan entry the request being served matched.
    last_match: Option<u32>,
    /// The request being served missed its plan: when it comes (this
    /// step's requests so far) and the plan's time in which its tensor is
    /// expected to live (see [`Allocator::displaced`]).
    borrow: Option<(u32, u32, u32)>,
    /// That request is one its plan leaves dynamic (a tensor that outlives
    /// its next instance, an input held until the next batch replaces it):
    /// it comes every step, so it displaces no planned request as large as
    /// the growth it saves (that one would grow as much, every step).
    borrow_planless: bool,
    /// Where a miss borrowed the arena ([`Allocator::lend_idle_arena`]),
    /// by (arena segment, active plan, (the request's index in the step,
    /// the plan time it borrows from), the most it may displace, its key):
    /// the same miss of the next such step (an evaluation's tensors, every
    /// evaluation) first tries that offset, which displaced no more then
    /// (the plan is the same; a range taken now is not served). At most
    /// [`LENT_MEMO`] entries (then cleared).
    lent: FxHashMap<LentKey, u64>,
    /// Dynamic cache to give back after the first step served by a new arena.
    trim_pending: bool,
    /// The smallest arena the device refused: larger plans are not installed.
    refused_arena: u64,
    step_hits: u64,
    step_misses: u64,
    /// Misses of this step where the plan had an offset or no entry (a
    /// request it planned dynamic is no deviation): what leaves a cached
    /// first-step plan.
    step_deviations: u64,
    /// Deviations since the step's last hit: what leaves any other plan.
    deviation_run: u64,
    arenas: Vec<Arena>,
    /// Step ends seen (a clock for choosing plans).
    steps: u64,
    /// The most bytes reserved at once so far, over peak resets (taken at
    /// step ends): an arena that would reserve more is not installed.
    high_water: u64,
    /// The plan cache, when the run keeps its plans in a file.
    cache: Option<Box<CacheState>>,
    /// The kept arena (always `arenas[0]` while it is held).
    kept_seg: Option<u32>,
    /// The arena every cached plan shares (0: none).
    common_arena: u64,
    /// The high-water mark of the run that made the cached plans.
    cached_high_water: u64,
    /// The cached first-step plan was left: release its arena once free.
    left_first: bool,
    /// Persistent requests of a left first-step plan not served yet: key →
    /// offsets in the kept arena (the last is the next).
    kept_left: std::collections::HashMap<Key, Vec<u64>>,
    /// Bytes of the arena of a cached first-step plan not allocated yet
    /// (see [`Allocator::open_deferred_arena`]).
    deferred_arena: u64,
    /// Training steps per planned step (1 or 2; the first step is always
    /// one): 2 once a step's tensors outlive the allocation of their next
    /// instance (see [`DOUBLE_SHARE`]).
    period: u32,
    /// In a planned step of two training steps: the first one ended.
    mid: bool,
    /// Requests of the first training step of the current planned step of
    /// two (counted at its end).
    pair_mid: u32,
    /// Planned steps of two seen: the first request's key, the requests of
    /// each training step and their forward passes (at most [`SHAPE_KINDS`]
    /// first keys kept).
    pairs: Vec<(Key, u32, u32, (usize, usize))>,
    /// Two planned steps of two that start alike differ in the requests of
    /// their training steps (an evaluation every third step, say): a plan
    /// chosen by its first request cannot tell them ([`Planning::note_pair`]).
    pairs_vary: bool,
    /// In a planned step of two: the plan it left (requests of another
    /// kind in a row, such as an evaluation forward pass between its two
    /// training steps) and the entry it expected next. At the next forward
    /// pass the plan resumes from there if that pass starts as expected
    /// (its tensors of the pair so far are where it placed them).
    resume: Option<(usize, usize)>,
    /// The requests (of `current`) at which the forward passes of this
    /// step began (a planned step of two: per training step).
    marks: [Vec<u32>; 2],
    /// The marks of the last closed profile, and its number of requests.
    last_marks: ([Vec<u32>; 2], usize),
    /// The plan of this planned step of two was left and resumed: the
    /// pair held requests of another kind, which are neither learned as a
    /// pair of its own nor compared with the pairs that start alike.
    resumed: bool,
    /// The plan a new plan of its first request replaced while it could
    /// serve the current arena as it is, where the new one needs another:
    /// it comes back if the new one's arena is refused (an arena holding
    /// tensors, as a kept-output loop's always does, leaves no room for
    /// another beside it), instead of the steps going dynamic for good.
    superseded: Option<StoredPlan>,
    /// A superseded plan came back in this step: it is not planned again
    /// at its end (the same plan would be refused again).
    restored: bool,
    /// This step left its plan (another step under the same first
    /// request): the peak reserved and peak live bytes at the first of the
    /// deviations in a row that made it leave.
    left_peaks: Option<(u64, u64)>,
    /// The peak reserved and peak live bytes at the first of the current
    /// deviations in a row (what a step that leaves its plan is held to).
    run_peaks: (u64, u64),
    /// The step count at the end of the last step that left its plan.
    last_left: Option<u64>,
    /// Planned placement is off for the rest of the run: a step that left
    /// its plan raised the peak reserved more than its live bytes, or the
    /// later forward passes of steps change shape (see
    /// [`Allocator::suspend_if_unsteady`]), or the plan cache says an
    /// earlier run of this training found so.
    suspended: bool,
    /// The plan cache said its high-water mark is the dynamic path's
    /// alone ([`CacheContent::dynamic`]).
    dynamic_cache: bool,
    /// An arena was made in this run.
    arena_mapped: bool,
    /// A plan read from the cache was chosen in this run (sticky: the plan
    /// may be gone since).
    cached_served: bool,
    /// This step's forward passes (phase marks), by the largest request
    /// each allocated: a step's shapes ([`Planning::note_shapes`]).
    forwards: Vec<u64>,
    /// A forward pass of this step is running (the last phase mark).
    in_forward: bool,
    /// The request of the run's first step before which its first forward
    /// pass began (what came before it sets the model up).
    first_forward: Option<u32>,
    /// The shapes of the forward passes of the first step seen with each
    /// number of them (two or more; at most [`SHAPE_KINDS`] numbers kept).
    shapes: Vec<Vec<u64>>,
    /// Distinct shapes of the steps of one forward pass (at most
    /// [`SHAPE_KINDS`] kept).
    single: Vec<u64>,
    /// The forward passes show that the first request of a step does not
    /// tell the rest of it ([`Planning::note_shapes`]).
    shapes_vary: bool,
    /// Step ends by the period of the requests, until the run marks one
    /// itself (see [`super::period`]).
    detector: Option<Box<PeriodDetector>>,
    /// A step end was marked: steps are never found by period again.
    marked: bool,
    /// This step's profile outgrew [`MAX_PROFILE`]: it was dropped, and
    /// the step is not planned.
    overflowed: bool,
    /// The dynamic pool each request key was last placed in (at most
    /// [`MAX_KEYS`] keys): where a request left out of a plan would go
    /// ([`Allocator::room_left`]).
    dynamic_pools: FxHashMap<Key, u32>,
}

/// Request keys whose dynamic pool is remembered at most (a run of
/// endlessly many shapes starts over).
const MAX_KEYS: usize = 1 << 16;

/// The share of the free room of the dynamic path's held segments that
/// requests left out of a plan may fill at once (the rest absorbs the
/// fragmentation of its best-fit placement and the step's own misses).
const ROOM_SHARE: (u64, u64) = (3, 4);

/// Requests of a step profiled at most: a longer step (a run whose step
/// ends are neither marked nor found) is not planned, and its profile is
/// not kept.
pub const MAX_PROFILE: usize = 1 << 20;

/// A step whose requests live into the next step past the allocation of
/// their own next instance (`out = model(x)` kept until the next forward
/// returns) cannot be planned one step at a time: both instances are live
/// at once. When such requests hold at least 1/`DOUBLE_SHARE` of the peak
/// live bytes, steps are planned two at a time (each instance then has its
/// own offset).
const DOUBLE_SHARE: u64 = 200;

/// Numbers of forward passes per step whose shapes are compared (see
/// [`Planning::note_shapes`]).
const SHAPE_KINDS: usize = 4;

impl std::fmt::Debug for Planning {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Planning")
            .field("planner", &self.planner.name())
            .field("plans", &self.plans.len())
            .field("arenas", &self.arenas.len())
            .finish_non_exhaustive()
    }
}

impl Planning {
    /// Whether a plan serves the run now. The dynamic path then grows by
    /// whole new segments, not by extending a paged one in place: its rules
    /// for borrowing the arena and for installing one weigh growths by
    /// segments (extending serves the learning steps, where a cold run's
    /// peak lies, and steps no plan serves while arenas are held: a run
    /// that left another training's cached plan reserved 30 % more with
    /// whole segments there).
    pub(super) fn plans_in_use(&self) -> bool {
        self.active.is_some()
    }

    /// Whether the dynamic path may grow to the plan cache's high-water
    /// mark ([`Planning::cached_mark`]) in large chunks: the cache said the
    /// mark is what the dynamic path alone reserved (no plan served the run
    /// that wrote it, and it made no arena), and in this run no plan has
    /// served (`hits`) nor holds an arena: the same dynamic path reaches
    /// the mark again.
    pub(super) fn grows_to_mark(&self, hits: u64) -> bool {
        self.dynamic_cache && hits == 0 && self.arenas.is_empty()
    }

    /// The high-water mark of reserved bytes the plan cache recorded.
    pub(super) fn cached_mark(&self) -> u64 {
        self.cached_high_water
    }

    pub(crate) fn new(planner: Box<dyn PlannerPolicy>) -> Self {
        let detector = planner.steps_by_period().then(Box::default);
        Planning {
            planner,
            health: RoleHealth::default(),
            current: Vec::new(),
            live: BySlot::default(),
            carried: BySlot::default(),
            carried_freed: Vec::new(),
            previous: Vec::new(),
            plans: Vec::new(),
            active: None,
            cursor: 0,
            skipped: Vec::new(),
            early: Vec::new(),
            choosing: false,
            choose_until: 0,
            late_forward: false,
            chosen_late: false,
            late_from: 0,
            installing: false,
            matched: Vec::new(),
            last_match: None,
            borrow: None,
            borrow_planless: false,
            lent: FxHashMap::default(),
            trim_pending: false,
            refused_arena: u64::MAX,
            step_hits: 0,
            step_misses: 0,
            step_deviations: 0,
            deviation_run: 0,
            arenas: Vec::new(),
            steps: 0,
            high_water: 0,
            cache: None,
            kept_seg: None,
            common_arena: 0,
            cached_high_water: 0,
            left_first: false,
            deferred_arena: 0,
            kept_left: std::collections::HashMap::new(),
            period: 1,
            mid: false,
            pair_mid: 0,
            pairs: Vec::new(),
            pairs_vary: false,
            resume: None,
            resumed: false,
            marks: Default::default(),
            last_marks: Default::default(),
            superseded: None,
            restored: false,
            left_peaks: None,
            run_peaks: (0, 0),
            last_left: None,
            suspended: false,
            dynamic_cache: false,
            arena_mapped: false,
            cached_served: false,
            forwards: Vec::new(),
            first_forward: None,
            in_forward: false,
            shapes: Vec::new(),
            single: Vec::new(),
            shapes_vary: false,
            detector,
            marked: false,
            overflowed: false,
            dynamic_pools: FxHashMap::default(),
        }
    }

    /// The planner's name.
    pub(crate) fn planner_name(&self) -> &str {
        self.planner.name()
    }

    /// Bytes and zone of the current arena ((0, 0): none).
    fn current_arena(&self) -> (u64, u64) {
        self.arenas.last().filter(|a| Some(a.seg) != self.kept_seg).map_or((0, 0), |a| (a.size, a.zone))
    }

    /// Whether plan `q` can serve from the current arena as it is (an
    /// aliased plan: of its size exactly).
    fn serves_current_arena(&self, q: &StoredPlan) -> bool {
        let (size, zone) = self.current_arena();
        size > 0 && zone == q.zone && if zone > 0 { q.arena_bytes == size } else { q.arena_bytes <= size }
    }

    /// The plan a borrowing tensor must make room for: the active one; at
    /// a step's start before any is chosen (an input before the forward
    /// pass: one of the step's first [`LOOKAHEAD`] requests, not at a later
    /// forward pass), the plan that served the arena last — the step will
    /// most likely choose it at its next requests, from its first entry
    /// (steps planned one at a time: a plan of two steps resumes at its
    /// forward passes).
    fn lend_plan(&self) -> Option<usize> {
        if self.active.is_some() {
            return self.active;
        }
        let start = self.choosing && !self.late_forward && self.current.len() < LOOKAHEAD;
        if !start || self.period != 1 || self.suspended {
            return None;
        }
        let used =
            self.plans.iter().enumerate().filter(|(_, q)| !q.first_only && q.used && self.serves_current_arena(q));
        used.max_by_key(|(_, q)| q.last_used).map(|(i, _)| i)
    }

    /// Drops every stored plan and the step's use of one.
    fn forget_plans(&mut self) {
        self.plans.clear();
        self.lent.clear();
        self.resume = None;
        self.superseded = None;
        self.active = None;
        self.installing = false;
        self.matched.clear();
    }

    /// The entry of the active plan `req` matches among the next
    /// [`LOOKAHEAD`] (advancing the cursor past it), and its offset.
    #[inline]
    fn next_offset(&mut self, req: &AllocRequest) -> Option<(usize, Option<u64>)> {
        if self.current.is_empty() && !self.overflowed {
            self.choosing = true;
            self.choose_until = LOOKAHEAD;
            self.late_forward = false;
            self.chosen_late = false;
        }
        if self.choosing {
            self.choosing = self.current.len() < self.choose_until;
            if self.resume.is_some() {
                self.resume_left(req);
            } else {
                self.choose(req);
            }
            if self.resumed && self.active.is_some() {
                self.choosing = false;
            } else if self.active.is_some() {
                self.choosing = false;
                self.chosen_late = !self.current.is_empty();
                self.late_from = self.current.len();
                // What came before it is extra: misses (for replanning).
                self.step_misses += self.current.len() as u64;
            }
        }
        let plan = &self.plans[self.active?];
        let k = (req.bytes, req.kind, req.stream);
        let end = (self.cursor + LOOKAHEAD).min(plan.keys.len());
        // The request itself, or one of the same planned size where it is
        // expected (the same tensor a few bytes off: its planned block).
        let resized = |&(b, kind, stream): &Key| {
            kind == req.kind && stream == req.stream && req.bytes.div_ceil(PLAN_ALIGN) == b.div_ceil(PLAN_ALIGN)
        };
        if let Some(s) = self.early.iter().position(|&s| plan.keys[s as usize] == k) {
            // An input after an evaluation's forward pass: its own entry.
            let j = self.early.swap_remove(s) as usize;
            return Some((j, plan.offsets[j]));
        }
        let j = if plan.keys.get(self.cursor) == Some(&k) {
            self.cursor
        } else if let Some(s) = self.skipped.iter().position(|&s| plan.keys[s as usize] == k) {
            // Late: its own entry, the cursor stays.
            let j = self.skipped.remove(s) as usize;
            return Some((j, plan.offsets[j]));
        } else if let Some(j) = (self.cursor + 1..end).find(|&j| plan.keys[j] == k) {
            if self.skipped.len() + (j - self.cursor) > LOOKAHEAD {
                let over = (self.skipped.len() + j - self.cursor).saturating_sub(LOOKAHEAD);
                self.skipped.drain(..over.min(self.skipped.len()));
            }
            let from = j.saturating_sub(LOOKAHEAD).max(self.cursor);
            self.skipped.extend((from..j).map(|s| s as u32));
            j
        } else {
            Some(self.cursor).filter(|&c| plan.keys.get(c).is_some_and(resized))?
        };
        self.cursor = j + 1;
        Some((j, plan.offsets[j]))
    }

    /// At a forward pass of a planned step of two whose plan it left
    /// ([`Planning::resume`]): the plan serves again when `req` is one of
    /// the [`LOOKAHEAD`] entries it expected next (the cursor moves there;
    /// what came between was another step's, served dynamically). The
    /// departure then sets no floor on later steps (`left_peaks`).
    fn resume_left(&mut self, req: &AllocRequest) {
        let Some((i, at)) = self.resume else { return };
        let k = (req.bytes, req.kind, req.stream);
        let Some(plan) = self.plans.get(i).filter(|_| !self.suspended) else {
            self.resume = None;
            return;
        };
        let end = (at + LOOKAHEAD).min(plan.keys.len());
        let Some(j) = (at..end).find(|&j| plan.keys[j] == k) else { return };
        tracing::debug!(entry = j, request = self.current.len(), "the left plan of two steps resumes");
        self.resume = None;
        self.resumed = true;
        self.active = Some(i);
        self.cursor = j;
        self.skipped.clear();
        self.deviation_run = 0;
        self.left_peaks = None;
        self.plans[i].last_used = self.steps;
    }

    /// At the start of the `f`-th forward pass of training step `s` of a
    /// planned step of two: the plan serving it (or the one it left, which
    /// serves again) goes on from the entry at which its own `f`-th forward
    /// pass of that step began — its last one when it has fewer. What came
    /// since the step's previous forward pass (an evaluation forward pass
    /// between training steps, served by entries of the plan's forward pass
    /// or dynamically) was another step's; its tensors, freed by now, left
    /// those ranges free, and a range still taken is a miss as always.
    /// Entries of the step before that forward pass that it jumps over
    /// (inputs still to come) are kept aside ([`Planning::early`]). A
    /// pair whose plan moves so by more than [`LOOKAHEAD`] entries, or
    /// comes back, held requests of another kind ([`Planning::resumed`]).
    fn resync(&mut self, s: usize, f: usize) {
        if self.suspended || self.installing || self.period < 2 {
            return;
        }
        let Some(i) = self.active.or(self.resume.map(|(i, _)| i)) else { return };
        let Some(plan) = self.plans.get(i) else { return };
        let Some(e) = plan.forward_at[s].get(f).or(plan.forward_at[s].last()).map(|&e| e as usize) else { return };
        if self.active.is_none() {
            tracing::debug!(entry = e, request = self.current.len(), "the left plan of two steps resumes");
            self.active = Some(i);
            self.resume = None;
            self.resumed = true;
            self.left_peaks = None;
            self.choosing = false;
            self.plans[i].last_used = self.steps;
        } else if e.abs_diff(self.cursor) > LOOKAHEAD {
            tracing::debug!(entry = e, cursor = self.cursor, "a plan of two steps goes on from its forward pass");
            self.resumed = true;
        }
        // (Jumped over: entries before the forward pass, still to come.)
        self.early.clear();
        if e > self.cursor && e - self.cursor <= LOOKAHEAD {
            self.early.extend((self.cursor..e).map(|j| j as u32));
        }
        self.cursor = e;
        self.skipped.clear();
        self.deviation_run = 0;
    }

    /// Chooses the plan for a step that starts with `first`: the most
    /// recently used one that starts with it and whose arena the device
    /// did not refuse.
    fn choose(&mut self, first: &AllocRequest) {
        if self.suspended {
            self.active = None;
            return;
        }
        let k = (first.bytes, first.kind, first.stream);
        let refused = self.refused_arena;
        let first_step = self.steps == 0;
        // (At a later forward pass: a plan whose step starts with a few
        // requests before its forward pass, an input, which came before the
        // mark; they are skipped.)
        let ahead = if self.late_forward { LOOKAHEAD } else { 1 };
        let at = |p: &StoredPlan| p.keys.iter().take(ahead).position(|q| *q == k);
        let chosen = self
            .plans
            .iter()
            .enumerate()
            .filter(|(_, p)| p.physical() < refused && (first_step || !p.first_only))
            .filter_map(|(i, p)| at(p).map(|j| (i, j, p)))
            .max_by_key(|&(_, j, p)| (p.first_only, std::cmp::Reverse(j), p.last_used));
        self.active = chosen.map(|(i, ..)| i);
        self.cursor = chosen.map_or(0, |(_, j, _)| j);
        self.skipped.clear();
        self.early.clear();
        self.matched.clear();
        if let Some(i) = self.active {
            self.plans[i].last_used = self.steps;
            if self.plans[i].from_cache && !self.left_first {
                self.cached_served = true;
            }
            if !std::mem::replace(&mut self.plans[i].used, true) && self.plans[i].from_cache {
                // A cached plan serves this run: if the file was rewritten
                // without it (it was not used yet), it goes back at this step's end.
                if let Some(c) = self.cache.as_mut().filter(|c| c.written) {
                    c.dirty = true;
                }
            }
            // A larger arena (an aliased plan: its own), or the kept arena
            // of a first-step plan.
            self.installing = self.needs_install(i);
        }
    }

    /// Whether plan `i` needs an arena installed to serve: a larger one
    /// than the current arena (an aliased plan: its own), or the kept arena
    /// of a first-step plan.
    fn needs_install(&self, i: usize) -> bool {
        let kept = self.plans[i].kept_bytes > 0 && self.kept_seg.is_none();
        let (size, zone) = self.current_arena();
        let (want, want_zone) = (self.plans[i].arena_bytes, self.plans[i].zone);
        let fits = zone == want_zone && if zone > 0 { want == size } else { want <= size };
        kept || !fits
    }

    /// Records an allocation of this step.
    fn record_alloc(&mut self, id: TensorId, bytes: u64, kind: TensorKind, stream: StreamId) {
        if self.in_forward {
            if let Some(m) = self.forwards.last_mut() {
                *m = (*m).max(bytes);
            }
        }
        if self.current.len() >= MAX_PROFILE {
            self.overflow();
        }
        let k = self.current.len() as u32;
        self.current.push(PlanRequest { bytes, kind, stream, freed_at: None, wraps_to: None });
        self.live.insert(id, k);
        if let Some(j) = self.last_match.take() {
            self.matched.push((id, j));
        }
    }

    /// Remembers the dynamic pool a request of `req`'s key was placed in.
    #[cold]
    fn note_dynamic_pool(&mut self, req: &AllocRequest, pool: u32) {
        if self.dynamic_pools.len() >= MAX_KEYS {
            self.dynamic_pools.clear();
        }
        self.dynamic_pools.insert((req.bytes, req.kind, req.stream), pool);
    }

    /// Drops this step's profile (too long to plan): what it recorded goes,
    /// no plan serves the rest of the step, and it is not planned.
    #[cold]
    fn overflow(&mut self) {
        tracing::debug!(requests = self.current.len(), "a step too long to plan: its profile is dropped");
        self.overflowed = true;
        self.current.clear();
        self.live.clear();
        self.carried.clear();
        self.previous.clear();
        self.active = None;
        self.installing = false;
        self.choosing = false;
        self.matched.clear();
        self.last_match = None;
        self.borrow = None;
    }

    /// Records a free: the end of a request of this step, or of one carried
    /// from the previous step.
    fn record_free(&mut self, id: TensorId) {
        let now = self.current.len() as u32;
        if let Some(k) = self.live.take(id) {
            self.current[k as usize].freed_at = Some(now);
        } else if let Some(k) = self.carried.take(id) {
            if let Some(f) = self.carried_freed.get_mut(k as usize) {
                *f = now;
            }
        }
        if let Some(c) = self.cache.as_mut() {
            if c.first_live.take(id).is_some() {
                c.dirty = true;
                c.first_stale = true;
            }
        }
    }

    /// The cache's content now: the first-step plan and the other plans,
    /// with their own offsets.
    /// `hits`: requests plans served in this run.
    fn cache_content(&self, hits: u64) -> Option<CacheContent> {
        let c = self.cache.as_ref()?;
        // The run's mark is its dynamic path's alone: no plan served, no
        // arena held memory.
        let dynamic = hits == 0 && !self.arena_mapped;
        if self.suspended {
            // No plan: the next run of this training stays dynamic too. A
            // run that was dynamic throughout tells its own mark (the one
            // it read may hold a raise that plans left earlier).
            let high_water = if dynamic { self.high_water } else { self.high_water.max(self.cached_high_water) };
            return Some(CacheContent {
                high_water,
                period: self.period,
                unsteady: true,
                dynamic,
                ..Default::default()
            });
        }
        // Cached plans no step of this run used are of another training.
        let kept = |p: &&StoredPlan| !p.first_only && (p.used || !p.from_cache);
        let plans: Vec<CachedPlan> =
            self.plans.iter().filter(kept).filter_map(|p| p.cached.as_deref().cloned()).collect();
        // The allowance of the run that made the cached plans stays while
        // they serve (a run served by them reserves less than it did).
        let served = (self.cached_served && !self.left_first) || self.plans.iter().any(|p| p.from_cache && p.used);
        let high_water = if served { self.high_water.max(self.cached_high_water) } else { self.high_water };
        let first = c.first.clone().map(|f| fitted_first(f, &plans));
        Some(CacheContent { high_water, period: self.period, first, plans, unsteady: false, dynamic })
    }

    /// At the end of the step after a run's first one, when the first
    /// step's plan is learned in this run: when that step freed each of the
    /// first step's end-live requests, in its own time (their `wraps_to`),
    /// so that the first-step plan can be fitted to the plan of the steps
    /// after it ([`aliased_first`]).
    fn note_first_wraps(&mut self) {
        let Some(c) = self.cache.as_mut() else { return };
        let Some(f) = c.first_profile.as_mut() else { return };
        for (k, r) in f.requests.iter_mut().enumerate() {
            if r.freed_at.is_none() {
                r.wraps_to = self.carried_freed.get(k).copied().filter(|&t| t != NOT_FREED);
            }
        }
        c.first_stale = true;
        c.dirty = true;
    }

    /// The first step's profile as its cached plan sees it, and its
    /// persistent requests: those live at its end and still live now stay
    /// unplanned (they go to the kept arena); those freed since, in a later
    /// step, are freed after its end (`freed_at` = its length + 1, planned
    /// as live until its end; `wraps_to`: when the next step freed them, if
    /// it did — see [`Planning::note_first_wraps`]).
    fn first_for_planning(&self) -> Option<(StepProfile, Vec<u32>)> {
        let c = self.cache.as_ref()?;
        let mut profile = c.first_profile.clone()?;
        let mut persistent: Vec<u32> = c.first_live.entries().map(|(_, k)| k).collect();
        persistent.sort_unstable();
        let n = profile.requests.len() as u32;
        let mut keep = persistent.iter().peekable();
        for (k, r) in profile.requests.iter_mut().enumerate() {
            if keep.peek() == Some(&&(k as u32)) {
                keep.next();
            } else if r.freed_at.is_none() {
                r.freed_at = Some(n + 1);
            }
        }
        Some((profile, persistent))
    }

    /// Closes the step's profile (lifetimes, wraps matched by position with
    /// the previous step) and starts the next one.
    fn close_step(&mut self, step: u64) -> (StepProfile, bool) {
        let mut requests = std::mem::take(&mut self.current);
        self.last_marks = (std::mem::take(&mut self.marks), requests.len());
        if std::mem::take(&mut self.overflowed) {
            // Only the tail of a step too long to plan: nothing to plan,
            // nothing to match the next step with.
            requests.clear();
            self.live.clear();
        }
        let repeated =
            requests.len() == self.previous.len() && requests.iter().map(key).eq(self.previous.iter().copied());
        let mut unmatched = false;
        for (k, r) in requests.iter_mut().enumerate() {
            if r.freed_at.is_none() {
                if self.previous.get(k) == Some(&key(r)) {
                    r.wraps_to = self.carried_freed.get(k).copied().filter(|&f| f != NOT_FREED);
                } else {
                    unmatched = true;
                }
            }
        }
        if unmatched {
            self.wraps_by_key(&mut requests);
        }
        self.previous.clear();
        self.previous.extend(requests.iter().map(key));
        std::mem::swap(&mut self.carried, &mut self.live);
        self.live.clear();
        self.carried_freed.clear();
        self.carried_freed.resize(requests.len(), NOT_FREED);
        self.active = None;
        self.installing = false;
        self.matched.clear();
        self.last_match = None;
        self.cursor = 0;
        self.skipped.clear();
        self.early.clear();
        self.steps += 1;
        (StepProfile { step, requests }, repeated)
    }

    /// Wraps of the end-live requests that no request of the previous step
    /// matches by position (a step of another kind came between, e.g. an
    /// evaluation forward before the training one): the `i`-th such
    /// request of a key takes the end of the `i`-th end-live request of
    /// that key in the previous step that no position matched (both in
    /// order), freed during this step.
    #[cold]
    fn wraps_by_key(&self, requests: &mut [PlanRequest]) {
        let by_position = |k: usize, r: &PlanRequest| r.freed_at.is_none() && self.previous.get(k) == Some(&key(r));
        let mut taken = vec![false; self.previous.len()];
        for (k, r) in requests.iter().enumerate() {
            if by_position(k, r) {
                taken[k] = true;
            }
        }
        let mut ends: std::collections::HashMap<Key, std::collections::VecDeque<u32>> =
            std::collections::HashMap::new();
        for (j, (&k, &f)) in self.previous.iter().zip(&self.carried_freed).enumerate() {
            if f != NOT_FREED && !taken[j] {
                ends.entry(k).or_default().push_back(f);
            }
        }
        for (k, r) in requests.iter_mut().enumerate() {
            if r.freed_at.is_none() && !by_position(k, r) {
                r.wraps_to = ends.get_mut(&key(r)).and_then(|q| q.pop_front());
            }
        }
    }

    /// At a training step's end: its forward passes' shapes (the largest
    /// request of each). A step of several forward passes of different
    /// shapes (micro-batches of drawn sequence lengths accumulated into one
    /// optimizer step, an evaluation forward before the training one) is
    /// *mixed*; when two steps of as many forward passes, one of them
    /// mixed, differ in the shape of a later one (not an evaluation forward
    /// of another batch size before each training one: that repeats), or a
    /// later forward pass of a mixed step has one of the shapes that steps
    /// of one forward pass took, and they took several (a training forward
    /// of drawn length after evaluation ones), the
    /// first request of a step (what chooses its plan) does not tell the
    /// rest of it: a step would follow its plan through
    /// its first forward pass and leave it in the middle, with the arena
    /// holding tensors (the gradients) where the rest of the step cannot
    /// use its free space. Found so from phase marks alone, before any
    /// plan serves such a step (see [`Allocator::suspend_if_unsteady`]).
    fn note_shapes(&mut self) {
        self.in_forward = false;
        let f = &self.forwards;
        let mixed = |s: &[u64]| s.iter().any(|&m| m != s[0]);
        if let [one] = f[..] {
            if self.single.len() < SHAPE_KINDS && !self.single.contains(&one) {
                self.single.push(one);
            }
        } else if f.len() >= 2 {
            match self.shapes.iter().find(|s| s.len() == f.len()) {
                Some(s) => self.shapes_vary |= s[1..] != f[1..] && (mixed(s) || mixed(f)),
                None if self.shapes.len() < SHAPE_KINDS => self.shapes.push(f.clone()),
                None => {}
            }
        }
        // (Against every mixed step seen: the shapes of steps of one
        // forward pass may vary only after it.)
        let drawn = |s: &Vec<u64>| mixed(s) && s[1..].iter().any(|m| self.single.contains(m));
        if self.single.len() >= 2 && (drawn(f) || self.shapes.iter().any(drawn)) {
            self.shapes_vary = true;
        }
        self.forwards.clear();
    }

    /// The profile of a planned step of two with each training step's
    /// inputs — its requests before its first forward pass, still live
    /// there (a batch) — planned as live for the whole cycle (`None`: no
    /// such request, or no marks). Their lifetime is the loop's, not the
    /// model's: an evaluation between training steps may hold the last
    /// batch until the next one, and a range the plan gave, through the
    /// other window, to a large tensor later in the cycle would then miss
    /// in every pair and have the dynamic path grow by it. Whole-cycle,
    /// such an input only ever holds its own range (its next instance
    /// then misses, and is small). At most 1/256 of `peak_live` bytes
    /// change so; past that the profile is kept as it is.
    fn inputs_held(&self, profile: &StepProfile, peak_live: u64) -> Option<StepProfile> {
        let n = profile.requests.len();
        let (marks, len) = &self.last_marks;
        if self.period != 2 || *len != n || marks.iter().any(Vec::is_empty) {
            return None;
        }
        let mid = (self.pair_mid as usize).min(n);
        let spans = [(0, marks[0][0] as usize), (mid, marks[1][0] as usize)];
        let mut held = Vec::new();
        for (from, mark) in spans {
            for k in from..mark.min(n) {
                let r = &profile.requests[k];
                if r.freed_at.is_none_or(|f| f as usize > mark) {
                    held.push(k);
                }
            }
        }
        let bytes: u64 = held.iter().map(|&k| profile.requests[k].planned_bytes()).sum();
        if held.is_empty() || bytes > peak_live / 256 {
            return None;
        }
        let mut requests = profile.requests.clone();
        for k in held {
            requests[k].freed_at = None;
            requests[k].wraps_to = Some(k as u32);
        }
        Some(StepProfile { step: profile.step, requests })
    }

    /// At the end of a planned step of two training steps: compares it with
    /// the one seen first with the same first request. Steps planned two at
    /// a time must repeat as pairs; where the training steps of two pairs
    /// that start alike and make as many forward passes hold different
    /// numbers of requests (more than 1 % and 2 apart: another kind of
    /// step, not a deviation), a plan chosen by the first request would
    /// serve one pair with the other's plan, and leave it in the middle
    /// with the arena holding the first step's tensors: `pairs_vary`
    /// (planned placement then goes off, [`Allocator::suspend_if_unsteady`]).
    /// A pair whose steps make different numbers of forward passes holds an
    /// extra one (an evaluation between training steps, in a loop that
    /// keeps its outputs and evaluates every few steps): it is not learned
    /// (a plan of two training steps serves it, coming back to its own
    /// forward passes, [`Planning::resync`]), and where one that starts
    /// alike makes fewer, that one is the kind learned. Nor is a pair whose
    /// plan had to come back so.
    /// Returns whether a pair like it was seen before (a pair is planned
    /// only once its kind recurs: a pair seen once may be one of two kinds
    /// that start alike, the other not seen yet).
    fn note_pair(&mut self) -> bool {
        self.resume = None;
        if std::mem::take(&mut self.resumed) {
            return false;
        }
        let Some(first) = self.current.first().map(key) else { return false };
        let n = self.current.len() as u32;
        let (a, b) = (self.pair_mid.min(n), n - self.pair_mid.min(n));
        let fw = (self.marks[0].len(), self.marks[1].len());
        // (Deviations leave a step at 8 in a row and 1 %: not a count apart.)
        let apart = |x: u32, y: u32| x.abs_diff(y) > 8 + x.max(y) / 100;
        let uneven = fw.0 != fw.1;
        let kinds = self.pairs.len();
        match self.pairs.iter_mut().find(|q| q.0 == first) {
            Some(q) if q.3 == fw => {
                self.pairs_vary |= apart(a, q.1) || apart(b, q.2);
                !uneven
            }
            Some(q) => {
                if fw.0 <= q.3 .0 && fw.1 <= q.3 .1 {
                    *q = (first, a, b, fw);
                }
                false
            }
            None if kinds < SHAPE_KINDS => {
                self.pairs.push((first, a, b, fw));
                false
            }
            None => false,
        }
    }

    /// Drops the plans and turns planned placement off for the rest of
    /// the run (the plan cache is written so).
    fn suspend(&mut self) {
        self.suspended = true;
        self.forget_plans();
        if let Some(c) = self.cache.as_mut() {
            c.dirty = true;
        }
    }

    /// Leaves the active (cached first-step) plan for the rest of the
    /// step; its persistent requests not served yet can still be, by key.
    fn leave_first(&mut self) {
        tracing::info!(misses = self.step_deviations, "the cached first-step plan does not fit this run; left");
        if let Some(plan) = self.active.take().map(|i| &self.plans[i]) {
            for j in self.cursor..plan.keys.len() {
                if let Some(off) = plan.offsets[j].filter(|o| o & KEPT != 0) {
                    self.kept_left.entry(plan.keys[j]).or_default().push(off);
                }
            }
            for offs in self.kept_left.values_mut() {
                offs.reverse();
            }
        }
        self.matched.clear();
    }

    /// Stores a plan: one per first request (a first-step plan aside), the
    /// least recently used going first when [`MAX_PLANS`] are kept.
    fn store(&mut self, mut stored: StoredPlan) {
        self.lent.clear();
        if stored.forward_at.iter().all(Vec::is_empty) && self.last_marks.1 == stored.keys.len() {
            stored.forward_at = self.last_marks.0.clone();
        }
        if let Some(i) = self.plans.iter().position(|q| !q.first_only && q.keys.first() == stored.keys.first()) {
            let old = self.plans.remove(i);
            self.superseded = (self.serves_current_arena(&old) && !self.serves_current_arena(&stored)).then_some(old);
        } else if self.plans.len() >= MAX_PLANS {
            let lru = self.plans.iter().enumerate().min_by_key(|(_, q)| q.last_used).map(|(i, _)| i).expect("full");
            self.plans.remove(lru);
        }
        self.plans.push(stored);
    }

    /// The arena holding segment `seg`, if it is one.
    fn arena_mut(&mut self, seg: u32) -> Option<&mut Arena> {
        self.arenas.iter_mut().find(|a| a.seg == seg)
    }

    /// The live tensors of the active plan, with their planned offsets:
    /// this step's matched requests and, when the previous step was the
    /// plan's sequence, its end-live requests (matched by position). One
    /// still live later than planned is included too: moving it only
    /// succeeds into a free range, so a later request it blocks is a miss.
    fn plan_live(&self) -> Vec<(TensorId, u64)> {
        let Some(plan) = self.active.map(|i| &self.plans[i]) else { return Vec::new() };
        let mut out: Vec<(TensorId, u64)> = self
            .matched
            .iter()
            .filter(|(id, _)| self.live.contains(*id))
            .filter_map(|&(id, j)| Some((id, plan.offsets[j as usize]?)))
            .collect();
        if self.previous == plan.keys {
            out.extend(self.carried.entries().filter_map(|(id, k)| Some((id, plan.offsets[k as usize]?))));
        }
        out
    }
}

impl<D: Device> Allocator<D> {
    /// Installs a planner (`None`: no planned placement); returns the old one.
    /// Stored plans are dropped; arenas stay until they are free.
    pub fn set_planner(&mut self, planner: Option<Box<dyn PlannerPolicy>>) -> Option<Box<dyn PlannerPolicy>> {
        match (self.planning.as_mut(), planner) {
            (Some(p), Some(new)) => {
                p.forget_plans();
                if !new.steps_by_period() {
                    p.detector = None;
                } else if p.detector.is_none() && !p.marked {
                    p.detector = Some(Box::default());
                }
                p.refused_arena = u64::MAX;
                p.suspended = false;
                p.health.fresh_policy();
                Some(std::mem::replace(&mut p.planner, new))
            }
            (None, Some(new)) => {
                self.planning = Some(Box::new(Planning::new(new)));
                None
            }
            (Some(p), None) => {
                // Arenas must stay consistent with their segments: keep the
                // state, with no plan to serve, until nothing is left in them.
                p.forget_plans();
                None
            }
            (None, None) => None,
        }
    }

    /// The planner's name, when planned placement is on.
    pub fn planner_name(&self) -> Option<&str> {
        self.planning.as_ref().map(|p| p.planner_name())
    }

    /// The planner's failure accounting, when planned placement is on.
    pub fn planner_health(&self) -> Option<&RoleHealth> {
        self.planning.as_ref().map(|p| &p.health)
    }

    /// A block at the planned offset of `req` when the plan has one and its
    /// range is free (a hit); `None` otherwise (the dynamic path serves it).
    /// At the install point of a plan that needs a larger arena, the arena
    /// is installed first.
    #[inline]
    pub(super) fn planned_block(&mut self, req: &AllocRequest) -> Result<Option<(u32, u32)>, AllocError> {
        let Some(p) = self.planning.as_mut() else { return Ok(None) };
        let expected = p.cursor;
        let planned = p.next_offset(req);
        // A plan chosen at a later forward pass serves on only if the
        // pass's next LOOKAHEAD requests are its next entries, in order:
        // an evaluation's forward pass may start with a request of the
        // training forward's (its embedding), then differ (gradients off).
        // Undone, the pass goes on as one no plan serves; a later forward
        // pass may choose again.
        if p.chosen_late
            && p.late_forward
            && p.active.is_some()
            && p.current.len() > p.late_from
            && p.current.len() <= p.late_from + LOOKAHEAD
            && planned.map(|(j, _)| j) != Some(expected)
        {
            tracing::debug!(
                request = p.current.len(),
                "a plan chosen at a later forward pass is not that pass's; undone"
            );
            p.active = None;
            p.chosen_late = false;
            p.matched.clear();
        }
        let Some(i) = p.active else {
            // A request before the step chose its plan (an input): if it
            // borrows the arena, it must leave what the plan it will most
            // likely choose places first, for as long as a request the
            // plan has no entry for is expected to live.
            if let Some(j) = p.lend_plan() {
                let n = p.plans[j].keys.len() as u32;
                p.borrow = Some((p.current.len() as u32, 0, UNKNOWN_LIFETIME.min(n)));
                p.borrow_planless = false;
            }
            return Ok(if p.kept_left.is_empty() { None } else { self.serve_kept_left(req) });
        };
        if p.installing {
            match planned {
                Some((j, ..)) if j >= p.plans[i].install_at => {
                    if !self.install_arena()? {
                        // Refused at the step's first request, bringing back
                        // the plan it replaced, which the arena there is
                        // serves: that plan serves the step from here (else
                        // the step would be dynamic beside an idle arena).
                        let p = self.planning.as_ref().expect("planning is on");
                        if p.restored && p.current.is_empty() && !p.needs_install(i) {
                            tracing::debug!("the plan it replaced serves this step");
                            return self.planned_block(req);
                        }
                        return Ok(None);
                    }
                }
                Some((j, ..)) => {
                    p.last_match = Some(j as u32);
                    return Ok(None);
                }
                None => {
                    // A deviation before the arena exists: this step stays dynamic.
                    p.active = None;
                    p.installing = false;
                    p.matched.clear();
                    p.step_misses += 1;
                    p.step_deviations += 1;
                    self.stats.plan_misses += 1;
                    return Ok(None);
                }
            }
        }
        let deferred = self.planning.as_ref().is_some_and(|p| p.deferred_arena > 0);
        let size = req.bytes.div_ceil(PLAN_ALIGN) * PLAN_ALIGN;
        let pending = |p: &Planning, off: u64| {
            off & KEPT == 0 && p.arenas.last().is_some_and(|a| a.pending.is_some() && a.touches_pending(off, size))
        };
        let served = match planned {
            Some((_, Some(off))) if deferred && off & KEPT == 0 && !self.open_deferred_arena()? => None,
            Some((_, Some(off)))
                if self.planning.as_ref().is_some_and(|p| pending(p, off)) && !self.complete_aliased_arena()? =>
            {
                None
            }
            Some((_, Some(off))) => self.take_arena_range(off, size, req.stream),
            _ => None,
        };
        let p = self.planning.as_mut().expect("checked");
        let roomed = match planned {
            Some((j, None)) if p.plans[i].roomed.get(j) == Some(&true) => Some(j),
            _ => None,
        };
        if served.is_some() {
            p.step_hits += 1;
            p.deviation_run = 0;
            self.stats.plan_hits += 1;
        } else if let Some(j) = roomed {
            // Left to the dynamic path's room as planned: no miss (if it
            // must grow, the arena's free space is borrowed first, as for
            // a planned request whose range is taken).
            let n = p.plans[i].keys.len() as u32;
            let from = j as u32 + 1;
            p.borrow = Some((p.current.len() as u32, from, p.plans[i].frees[j].min(from.saturating_add(n))));
            p.borrow_planless = false;
        } else {
            tracing::trace!(request = p.current.len(), planned = ?planned, bytes = req.bytes, "plan miss");
            p.step_misses += 1;
            self.stats.plan_misses += 1;
            // A deviation: a request the plan does not have where it is
            // (one it has, whose range is taken — by a tensor freed later
            // than planned, or placed by the plan before — is no sign of
            // another step: the plan serves on).
            if planned.is_none() {
                if p.deviation_run == 0 {
                    p.run_peaks = (self.stats.bytes.peak_reserved_bytes, self.stats.bytes.peak_live_bytes);
                }
                p.step_deviations += 1;
                p.deviation_run += 1;
            }
            // If it borrows the arena's free space: the plan's time in which
            // it is expected to live (a request the plan has: as planned;
            // another: the next UNKNOWN_LIFETIME entries).
            let n = p.plans[i].keys.len() as u32;
            let (from, until) = match planned {
                Some((j, _)) => (j as u32 + 1, p.plans[i].frees[j]),
                None => (p.cursor as u32, (p.cursor as u32).saturating_add(UNKNOWN_LIFETIME.min(n))),
            };
            p.borrow = Some((p.current.len() as u32, from, until.min(from.saturating_add(n))));
            p.borrow_planless = matches!(planned, Some((_, None)));
            // A cached first-step plan is chosen on the first request alone
            // and installed at once: a run that turns out to be another
            // training leaves it, and its arena, as soon as that is plain.
            // Any other plan is left for the rest of the step once the step
            // is plainly another — as many deviations in a row (a sequence
            // length that changed within a plan of two steps; scattered
            // ones are deviations of the same step): what the arena does
            // not hold then goes to its free space before the dynamic path
            // grows (`lend_idle_arena`), not beside it.
            let plan = &p.plans[i];
            // (A plan of guessed lifetimes: at the first deviation in a
            // row of two, the guess was wrong.)
            let most = if plan.guessed_need > 0 { 1 } else { 8 + plan.keys.len() as u64 / 100 };
            if plan.first_only && p.step_deviations > most {
                p.leave_first();
                p.left_first = true;
                self.release_left_arena()?;
            } else if !plan.first_only && p.deviation_run > most {
                tracing::debug!(misses = p.step_deviations, "the step is not its plan's; left for the rest of it");
                p.active = None;
                p.matched.clear();
                if p.period > 1 {
                    p.resume = Some((i, p.cursor));
                }
                if !p.chosen_late {
                    p.left_peaks.get_or_insert(p.run_peaks);
                }
            }
        }
        Ok(served)
    }

    /// After a cached first-step plan was left: a request of the same key
    /// as one of its persistent requests not served yet takes that one's
    /// range of the kept arena (parameters and optimizer states of a run of
    /// the same model with other shapes still fill it).
    #[cold]
    fn serve_kept_left(&mut self, req: &AllocRequest) -> Option<(u32, u32)> {
        let p = self.planning.as_mut()?;
        let offs = p.kept_left.get_mut(&(req.bytes, req.kind, req.stream))?;
        let off = offs.pop()?;
        let served = self.take_arena_range(off, req.bytes.div_ceil(PLAN_ALIGN) * PLAN_ALIGN, req.stream);
        if served.is_some() {
            self.stats.plan_hits += 1;
        }
        served
    }

    /// The arena of a cached first-step plan, at its first request that is
    /// not persistent: allocated when the step so far matched it (at most
    /// two misses, and four hits for each); otherwise the plan is left
    /// (the run is another training) and no arena was spent on it. Returns
    /// whether the arena is there.
    #[cold]
    fn open_deferred_arena(&mut self) -> Result<bool, AllocError> {
        let p = self.planning.as_mut().expect("planning is on");
        let want = std::mem::take(&mut p.deferred_arena);
        // A request or two the plan lacks (a workspace the recorded run did
        // not have) among many matched ones is the same training.
        let (hits, misses) = (p.step_hits, p.step_deviations);
        if misses > 2 || hits < 4 * misses {
            p.leave_first();
            return Ok(false);
        }
        // (A first-step plan in the second window of an aliased arena.)
        let zone = p.active.map_or(0, |i| p.plans[i].zone);
        let made = match zone {
            0 => match self.stitched_arena(want)? {
                Some(a) => Some(a),
                None => self.new_arena(want)?,
            },
            _ => match self.paged_aliased_arena(want / 2, zone, None)? {
                Some(a) => Some(a),
                None => self.new_aliased_arena(want / 2, zone, None)?,
            },
        };
        let Some(arena) = made else { return Ok(false) };
        let p = self.planning.as_mut().expect("planning is on");
        p.arenas.push(arena);
        p.arena_mapped = true;
        Ok(true)
    }

    /// After a cached first-step plan was left: its arena (the current
    /// one, not the kept one) is released once it holds nothing.
    fn release_left_arena(&mut self) -> Result<(), AllocError> {
        let Some(p) = self.planning.as_ref() else { return Ok(()) };
        let Some(a) = p.arenas.last().filter(|a| Some(a.seg) != p.kept_seg) else { return Ok(()) };
        if !self.arena_is_free(a.seg) {
            return Ok(());
        }
        let p = self.planning.as_mut().expect("checked");
        let a = p.arenas.pop().expect("checked");
        p.left_first = false;
        self.release_arena(a)
    }

    /// When the dynamic path is out of memory: the smallest free range of
    /// any arena that holds `req` (the request is then not an OOM).
    #[cold]
    pub(super) fn arena_fallback(&mut self, req: &AllocRequest) -> Option<(u32, u32)> {
        let size = req.bytes.div_ceil(PLAN_ALIGN) * PLAN_ALIGN;
        let arenas = self.planning.as_ref()?.arenas.len();
        // Best fit among the ranges that displace least (as when lending).
        let mut fits: Vec<(u64, u64, usize, u64)> = Vec::new();
        for a in 0..arenas {
            let free = self.free_fits(a, size, u64::MAX);
            self.index_space(a);
            let displaced = self.displaced(a, size, &free).unwrap_or_else(|| vec![0; free.len()]);
            fits.extend(displaced.into_iter().zip(free).map(|(d, (b, off))| (d, b, a, off)));
        }
        fits.sort_unstable();
        fits.dedup();
        let served =
            fits.into_iter().take(ALIAS_TRIES).find_map(|(_, _, a, off)| self.take_range(a, off, size, req.stream))?;
        // The dynamic path counted an OOM when it gave up: this is none.
        self.stats.ooms = self.stats.ooms.saturating_sub(1);
        Some(served)
    }

    /// Carves `[off, off + size)` of the current arena into a block if that
    /// range is entirely free; returns (block, pool).
    /// An offset marked [`KEPT`] is in the kept arena.
    #[inline]
    fn take_arena_range(&mut self, off: u64, size: u64, stream: StreamId) -> Option<(u32, u32)> {
        let p = self.planning.as_ref()?;
        let kept = p.kept_seg.is_some() && p.arenas.first().map(|a| a.seg) == p.kept_seg;
        if off & KEPT != 0 {
            return if kept { self.take_range(0, off & !KEPT, size, stream) } else { None };
        }
        let last = p.arenas.len().checked_sub(1).filter(|&l| !(kept && l == 0))?;
        self.take_range(last, off, size, stream)
    }

    /// [`Allocator::take_arena_range`] in arena `a`.
    #[inline]
    fn take_range(&mut self, a: usize, off: u64, size: u64, stream: StreamId) -> Option<(u32, u32)> {
        let p = self.planning.as_mut()?;
        let arena = p.arenas.get_mut(a)?;
        if off.checked_add(size)? > arena.size {
            return None;
        }
        let blocks = &mut self.arena.blocks;
        // The block holding `off`: the free block starting there (the common
        // case), else a walk along the links from the finger or from the
        // block hinted for the nearest 2 MiB at or below.
        let c = off >> HINT_SPAN_LOG2;
        let within = |b: u32, lo: u64, hi: u64| {
            b != NIL
                && blocks.try_get(b).is_some_and(|x| x.segment == arena.seg && x.offset < hi && x.offset + x.size > lo)
        };
        let start = arena.starts[start_slot(off)];
        let blk = if start != NIL
            && blocks.try_get(start).is_some_and(|x| x.segment == arena.seg && x.offset == off && x.is_free())
        {
            start
        } else if within(arena.finger, off, off + 1) {
            arena.finger
        } else {
            // The nearest 2 MiB at or below whose hint is still a block of
            // the arena (one that covered it once: a part of it, split
            // since, lies next to it along the links).
            let mut d = c;
            loop {
                let near = arena.near[d as usize];
                if near != NIL && blocks.try_get(near).is_some_and(|x| x.segment == arena.seg) {
                    break near;
                }
                if d == 0 {
                    break self.arena.segments.get(arena.seg).first;
                }
                d -= 1;
            }
        };
        let (blk, b) = walk_to(blocks, blk, off);
        arena.near[c as usize] = blk;
        if !b.is_free() || b.offset + b.size < off + size {
            return None;
        }
        let seg = *self.arena.segments.get(b.segment);
        if seg.stream != stream {
            // Blocks stay on the stream of their segment; the arena is on stream 0.
            return None;
        }
        if arena.zone > 0 && (arena.touches_pending(off, size) || !alias_free(blocks, arena, off, size)) {
            // Its physical memory is taken through the other window.
            return None;
        }
        // Before the range: a free remainder (keeps `blk`).
        let mut cur = blk;
        if off > b.offset {
            cur = split(blocks, blk, off - b.offset);
        }
        // After the range: a free remainder (the finger: the next request is
        // often placed right after this one).
        arena.touch(cur, off);
        if blocks.get(cur).size > size {
            let tail = split(blocks, cur, size);
            arena.started(off + size, tail);
            arena.touch(tail, off + size);
        }
        Some((cur, seg.pool))
    }

    /// Records an allocation of this step in the profile (after it succeeded).
    #[inline]
    pub(super) fn plan_record_alloc(&mut self, id: TensorId, req: &AllocRequest, pool: usize) {
        if let Some(p) = self.planning.as_mut() {
            if !self.arena.pools[pool].planned {
                p.note_dynamic_pool(req, pool as u32);
            }
            p.record_alloc(id, req.bytes, req.kind, req.stream);
        }
    }

    /// Before serving `req`, in a run that marked no step end yet: a step
    /// ends here when the period of the requests says so (see
    /// [`super::period`]).
    #[inline]
    pub(super) fn plan_detect(&mut self, req: &AllocRequest) -> Result<(), AllocError> {
        let live = self.stats.bytes.live_bytes;
        let Some(d) = self.planning.as_mut().and_then(|p| p.detector.as_deref_mut()) else { return Ok(()) };
        if !d.observe(super::period::token(req.bytes, req.kind, req.stream), live) {
            return Ok(());
        }
        let step = d.cuts();
        self.stats.plan_detected_steps += 1;
        self.plan_step_end(step)
    }

    /// Notes a phase mark (forward passes tell a step's shapes; a marked
    /// step end ends the detection of steps by the period of the requests).
    #[inline]
    pub(super) fn plan_phase(&mut self, phase: crate::types::Phase) {
        if let Some(p) = self.planning.as_mut() {
            if phase == crate::types::Phase::StepEnd {
                p.marked = true;
                if p.detector.take().is_some() {
                    tracing::debug!("steps are marked: no detection by period");
                }
            }
            p.in_forward = phase == crate::types::Phase::Forward;
            if p.in_forward {
                // A later forward pass of a step no plan serves (none was
                // chosen at its start, none left; not its first forward
                // pass, which a step of a new shape starts with): a plan
                // may start here.
                let late = p.steps > 0 && !p.mid && !p.forwards.is_empty() && !p.overflowed;
                // Only its first request may start a plan (at one of the
                // plan's first entries: an input before the mark is
                // skipped): a later one matched there would be a request of
                // an evaluation's forward pass that happens to have a key of
                // the training forward pass (sizes alike, gradients off),
                // the plan chosen in the middle of the evaluation, misses
                // cascading until it is left.
                if late && p.active.is_none() && !p.suspended && p.left_peaks.is_none() {
                    p.choosing = true;
                    p.choose_until = p.current.len();
                    p.late_forward = true;
                } else if p.resume.is_some() && p.active.is_none() && !p.suspended {
                    p.choosing = true;
                    p.choose_until = p.current.len() + LOOKAHEAD;
                }
                let s = usize::from(p.period > 1 && p.mid);
                let f = p.marks[s].len();
                p.marks[s].push(p.current.len() as u32);
                p.resync(s, f);
                p.forwards.push(0);
                if p.steps == 0 && p.first_forward.is_none() {
                    p.first_forward = Some(p.current.len() as u32);
                }
            }
        }
    }

    /// Records a free in the profile.
    #[inline]
    pub(super) fn plan_record_free(&mut self, id: TensorId) {
        if let Some(p) = self.planning.as_mut() {
            p.record_free(id);
        }
    }

    /// A freed arena block (merged with its free neighbours by the caller,
    /// which may have removed the finger and hints) becomes the arena's
    /// finger, the cached free block at its start, and the hint of its
    /// 2 MiB and of `was` (the freed tensor's offset).
    #[inline]
    pub(super) fn arena_block_freed(&mut self, seg: u32, blk: u32, was: u64) {
        let offset = self.arena.blocks.get(blk).offset;
        let Some(arena) = self.planning.as_mut().and_then(|p| p.arena_mut(seg)) else { return };
        arena.started(offset, blk);
        arena.touch(blk, offset);
        if let Some(n) = arena.near.get_mut((was >> HINT_SPAN_LOG2) as usize) {
            *n = blk;
        }
    }

    /// With planning off ([`Allocator::suspend_if_unsteady`]): the arena of
    /// segment `seg`, now entirely free, is released at once (the dynamic
    /// path stitches cached pages before it grows, and would not release it).
    #[cold]
    pub(super) fn release_suspended_arena(&mut self, seg: u32) -> Result<(), AllocError> {
        let Some(p) = self.planning.as_mut().filter(|p| p.suspended) else { return Ok(()) };
        let Some(i) = p.arenas.iter().position(|a| a.seg == seg) else { return Ok(()) };
        let a = p.arenas.remove(i);
        self.release_arena(a)
    }

    /// At a step end: closes the profile and plans it when needed; after the
    /// first step a new arena served, gives the dynamic cache back once.
    pub(super) fn plan_step_end(&mut self, step: u64) -> Result<(), AllocError> {
        let Some(p) = self.planning.as_mut() else { return Ok(()) };
        if self.stats.bytes.peak_reserved_bytes > p.high_water {
            p.high_water = self.stats.bytes.peak_reserved_bytes;
            // The file holds the run's high-water mark (what the next
            // run's arenas are held to), not the one at its last write.
            if let Some(c) = p.cache.as_mut().filter(|c| c.written) {
                c.dirty = true;
            }
        }
        if self.stats.plan_hits > 0 || p.arena_mapped {
            // A plan served, or an arena holds memory: the file no longer
            // says the mark is the dynamic path's alone.
            if let Some(c) = p.cache.as_mut().filter(|c| c.written_dynamic) {
                c.dirty = true;
            }
        }
        p.note_shapes();
        let mut pair_seen = false;
        if p.period > 1 && p.steps > 0 {
            // The first training step of a planned step of two ends.
            p.mid = !p.mid;
            if p.mid {
                p.pair_mid = p.current.len() as u32;
                return Ok(());
            }
            pair_seen = p.note_pair();
        }
        let (hits, misses) = (std::mem::take(&mut p.step_hits), std::mem::take(&mut p.step_misses));
        let restored = std::mem::take(&mut p.restored);
        p.step_deviations = 0;
        p.deviation_run = 0;
        let served_plan = p.active.filter(|_| !p.installing);
        let first_step = p.steps == 0;
        p.deferred_arena = 0;
        p.kept_left.clear();
        if p.steps == 1 {
            p.note_first_wraps();
        }
        let (profile, repeated) = p.close_step(step);
        // (A plan from the cache learns where its forward passes begin from
        // a step of its very requests.)
        if let Some(q) = served_plan.map(|i| &mut p.plans[i]) {
            if q.forward_at.iter().all(Vec::is_empty) && profile.requests.iter().map(key).eq(q.keys.iter().copied()) {
                q.forward_at = p.last_marks.0.clone();
            }
        }
        let n = profile.requests.len();
        let known = profile.requests.iter().enumerate().filter(|(k, r)| r.plannable(*k as u32)).count();
        // A step with unknown lifetimes is planned only once it repeated the
        // previous step: before, the ends of its end-live requests could not
        // be learned (they are freed in the next step) — unless they are at
        // most 1 in 100 (a step of a new shape after one of another: its
        // gradients wrap as the other's did, a loss does not); they stay
        // dynamic. Not in plans of two steps: keyed by their first request,
        // the second step's shape would not be known when chosen; nor is a
        // pair planned before a pair like it recurs ([`Planning::note_pair`]).
        let few_unknown = p.period == 1 && (n - known) * 100 <= n;
        let worth = n > 0 && known > 0 && (known == n || repeated || few_unknown) && (p.period == 1 || pair_seen);
        // (A settled plan misses up to 1 in 10 before it is planned again;
        // any plan but a cached first-step one, two requests: an extra
        // tensor or two is no new step. A profile knows more when fewer of
        // its lifetimes are unknown.)
        let most = |i: usize| if p.plans[i].settled { 10 } else { 100 };
        let unknown = |i: usize| p.plans[i].keys.len() - p.plans[i].known;
        let few = |i: usize| misses <= 2 && !p.plans[i].first_only;
        // (A plan of guessed lifetimes is planned again once they are known.)
        let guessed = served_plan.is_some_and(|i| p.plans[i].guessed_need > 0);
        let good = !guessed
            && served_plan.is_some_and(|i| unknown(i) <= n - known && (few(i) || misses * most(i) <= (hits + misses)));
        // The first step of a run that marks its steps, its end-live requests'
        // lifetimes not known: planned at once, with them guessed
        // ([`guessed_first`]), so that the second step is served too (its
        // dynamic peak would be the run's: the first step holds no optimizer
        // states yet).
        let guess = first_step
            && served_plan.is_none()
            && p.marked
            && p.period == 1
            && !p.suspended
            && known > 0
            && !(known == n || repeated || few_unknown);
        // (Not when no plan serves the steps to come: they need that cache.)
        let trim = std::mem::take(&mut p.trim_pending)
            && served_plan.is_some()
            && p.plans.iter().any(|q| !q.first_only && q.arena_bytes > 0);
        tracing::debug!(
            step,
            requests = n,
            known,
            hits,
            misses,
            replan = worth && !good,
            arena = self.stats.plan_arena_bytes,
            reserved = self.stats.bytes.reserved_bytes,
            device_allocs = self.stats.device_alloc_calls,
            "planned step end"
        );
        // A plan like one whose arena was refused would be refused too.
        let first = profile.requests.first().map(key);
        let futile = p
            .plans
            .iter()
            .any(|q| q.keys.first() == first.as_ref() && q.known >= known && q.physical() >= p.refused_arena);
        if let Some(i) = served_plan.filter(|_| guessed && p.left_peaks.is_some()) {
            // The step left a plan of guessed lifetimes: the guess was wrong,
            // not the steps unsteady. The plan goes (its arena once free).
            tracing::debug!(step, "the step left its plan of the first step's guessed lifetimes; it goes");
            p.left_peaks = None;
            p.plans.remove(i);
            p.active = None;
            p.superseded = None;
        } else if !first_step && !guessed && p.plans.iter().any(|q| q.guessed_need > 0) {
            // The second step was not the first one's: that plan goes.
            p.plans.retain(|q| q.guessed_need == 0);
            p.active = None;
        }
        self.suspend_if_unsteady();
        if first_step {
            self.end_first_step(&profile, served_plan.filter(|_| good))?;
        }
        if self.planning.as_ref().is_some_and(|p| p.left_first) {
            self.release_left_arena()?;
        }
        self.release_planless_arena()?;
        let guessed_profile = guess.then(|| self.guessed_first(&profile));
        let peak_live = self.stats.bytes.peak_live_bytes;
        let p = self.planning.as_mut().expect("planning is on");
        if p.suspended {
            // Nothing to plan.
        } else if p.period == 1 && !first_step && double_bytes(&profile) * DOUBLE_SHARE >= peak_live.max(1) {
            // Plans of one step would leave these requests dynamic: plan two
            // steps at a time from the next one (the one-step plans go).
            tracing::info!(
                step,
                bytes = double_bytes(&profile),
                "tensors outlive their next instance: planning two steps at a time"
            );
            p.period = 2;
            p.mid = false;
            p.plans.retain(|q| q.first_only);
            p.active = None;
            p.previous.clear();
            if let Some(c) = p.cache.as_mut() {
                c.dirty = true;
            }
        } else if let Some(guessed) = guessed_profile.filter(|g| !g.requests.is_empty()) {
            let made = self.stats.plans;
            self.make_plan(&guessed)?;
            if self.stats.plans > made {
                let p = self.planning.as_mut().expect("planning is on");
                let q = p.plans.last_mut().expect("just stored");
                let need = cycle_live(&guessed.requests, &q.offsets).into_iter().max().unwrap_or(0);
                q.guessed_need = need.max(1);
            }
        } else if worth && !good && !futile && !restored {
            let made = self.stats.plans;
            let held = p.inputs_held(&profile, peak_live);
            self.make_plan(held.as_ref().unwrap_or(&profile))?;
            let new_plan = self.stats.plans > made;
            // A plan of guessed lifetimes goes once one of known lifetimes
            // is made (it would be chosen by its own first request, which
            // may start other steps) — kept aside, as a plan its first
            // request replaced is, when it serves the arena there is and
            // the new plan needs another: it serves on if that one's arena
            // is refused (see [`Allocator::refuse_arena`]).
            let p = self.planning.as_mut().expect("planning is on");
            if let Some(g) = p.plans.iter().position(|q| q.guessed_need > 0).filter(|_| guessed) {
                let old = p.plans.remove(g);
                let needs_another = new_plan && p.plans.last().is_some_and(|q| !p.serves_current_arena(q));
                if needs_another && p.superseded.is_none() && p.serves_current_arena(&old) {
                    p.superseded = Some(old);
                }
                p.plans.retain(|q| q.guessed_need == 0);
                p.active = None;
            }
        } else if let Some(i) = served_plan.filter(|_| good && misses == 0 && !first_step) {
            self.refine_cached_plan(i);
        }
        self.write_plan_cache()?;
        // The profile's buffer serves the next step.
        if let Some(p) = self.planning.as_mut() {
            let mut buf = profile.requests;
            buf.clear();
            p.current = buf;
        }
        if trim {
            self.release_cached(&ReclaimDecision { trim: true, ..ReclaimDecision::all() })?;
        }
        self.release_free_retired()
    }

    /// The first step's profile with the lifetimes of its end-live
    /// requests guessed from what their tensors hold now: parameters and
    /// optimizer states (tagged so) stay live for the run and leave the
    /// profile (they stay on the dynamic path, where they lie), as do the
    /// requests before its first forward pass (phase marks: the model's
    /// setup, the first batch; the next step's first request of its plan
    /// is then found among its first few); any other
    /// (gradients, a loss, outputs kept for logging: freed in the next
    /// step, most often at its start) is planned as live until the step's
    /// end. The second step, which the first most often repeats without
    /// the states the optimizer made, is then served by a plan too; its
    /// end-known lifetimes are planned again at its end.
    fn guessed_first(&self, profile: &StepProfile) -> StepProfile {
        let n = profile.requests.len();
        let mut keep = vec![true; n];
        if let Some(p) = self.planning.as_ref() {
            let setup = p.first_forward.map_or(0, |f| (f as usize).min(n));
            keep[..setup].fill(false);
            for (id, k) in p.carried.entries() {
                let stays =
                    self.tensors.get(id).is_none_or(|t| matches!(t.kind, TensorKind::Param | TensorKind::Optim));
                if let Some(slot) = keep.get_mut(k as usize).filter(|_| stays) {
                    *slot = false;
                }
            }
        }
        // Each time of the profile, in the guessed profile's time.
        let mut at = Vec::with_capacity(n + 1);
        let mut kept = 0u32;
        for &k in &keep {
            at.push(kept);
            kept += u32::from(k);
        }
        at.push(kept);
        let requests = profile
            .requests
            .iter()
            .zip(&keep)
            .filter(|(_, &k)| k)
            .map(|(r, _)| PlanRequest {
                freed_at: Some(r.freed_at.map_or(kept, |f| at[(f as usize).min(n)])),
                wraps_to: None,
                ..*r
            })
            .collect();
        StepProfile { step: profile.step, requests }
    }

    /// At a step end: when the step left its plan (steps that start alike
    /// differ later, e.g. micro-batches of drawn sequence lengths
    /// accumulated into one optimizer step) and either the peak reserved
    /// memory then rose by more than a page beyond the run's overhead at
    /// that point applied to the peak live bytes (the arena held tensors
    /// where the rest of the step could not use its free space), or a step
    /// at most [`LEFT_AGAIN`] steps before left its plan too (the next one
    /// may raise it: a step that leaves its plan late needs the arena and
    /// the dynamic path beside it), a plan keyed by a step's first request
    /// cannot serve such a training. So too, before any such step, when the
    /// phase marks show it ([`Planning::note_shapes`]). Planned placement
    /// is then off for the rest of the run (the plans go; the arena lends
    /// its free space only where the dynamic path would raise the peak, and
    /// is released once free: the run goes on as its dynamic path alone
    /// would), and the plan cache says so, so that the next run does not
    /// plan either.
    fn suspend_if_unsteady(&mut self) {
        let g = self.device.granularity();
        let (res, live) = (self.stats.bytes.peak_reserved_bytes, self.stats.bytes.peak_live_bytes);
        let Some(p) = self.planning.as_mut().filter(|p| !p.suspended) else { return };
        if p.shapes_vary {
            tracing::warn!(
                "steps that start alike differ later (the later forward passes of a step change shape from step to \
                 step): planned placement is off for the rest of the run"
            );
            p.suspend();
            return;
        }
        if p.pairs_vary {
            tracing::warn!(
                "steps planned two at a time differ from pair to pair (two pairs that start alike hold other steps, \
                 e.g. an evaluation every third step): planned placement is off for the rest of the run"
            );
            p.suspend();
            return;
        }
        let Some((res0, live0)) = p.left_peaks.take() else { return };
        // Reserved beyond the overhead the run had when the step began to
        // deviate,
        // applied to the peak live bytes now (more than a page).
        let expected = u128::from(res0) * u128::from(live) / u128::from(live0.max(1));
        let raised = u128::from(res) > expected + u128::from(g);
        let again = p.last_left.replace(p.steps).filter(|&s| p.steps - s <= LEFT_AGAIN);
        if !raised && again.is_none() {
            return;
        }
        tracing::warn!(
            reserved = res,
            expected = expected as u64,
            steps_since_last_left = again.map(|s| p.steps - s),
            "steps that start alike differ later (a step left its plan and raised the peak reserved memory, or left \
             it again): planned placement is off for the rest of the run"
        );
        p.suspend();
    }

    /// At the end of a run's first step, with a plan cache: its plan was
    /// served from the cache (`served`), or it is learned now for the next
    /// run, with its end-live requests followed to tell which stay live for
    /// the whole run. The cached first-step plan is then of no more use in
    /// this run.
    fn end_first_step(&mut self, profile: &StepProfile, served: Option<usize>) -> Result<(), AllocError> {
        let Some(p) = self.planning.as_mut() else { return Ok(()) };
        let Some(cache) = p.cache.as_mut() else { return Ok(()) };
        let from_cache = served.is_some_and(|i| p.plans[i].first_only);
        if !from_cache {
            // The end-live requests of this step (carried into the next one).
            cache.first_live.clear();
            for (id, k) in p.carried.entries() {
                cache.first_live.insert(id, k);
            }
            cache.first_profile = Some(profile.clone());
            cache.first_stale = true;
            cache.dirty = true;
            // No persistent request is in the arena: the cached plans keep
            // their own offsets and arenas, as if made in this run.
            if p.common_arena > 0 {
                p.common_arena = 0;
                for q in p.plans.iter_mut().filter(|q| !q.first_only) {
                    if let Some(c) = q.cached.take() {
                        let again = StoredPlan::of(&c, 0, false, q.last_used).keeping(*c);
                        *q = StoredPlan { from_cache: q.from_cache, ..again };
                    }
                }
            }
        }
        p.plans.retain(|q| !q.first_only);
        Ok(())
    }

    /// Writes the plan cache when something changed since the last write
    /// (planning the first step again first when its persistent requests
    /// changed); a failure to write is warned about once (the run goes on).
    fn write_plan_cache(&mut self) -> Result<(), AllocError> {
        let Some(p) = self.planning.as_mut() else { return Ok(()) };
        if !p.cache.as_ref().is_some_and(|c| c.dirty) {
            return Ok(());
        }
        if let Some((profile, persistent)) =
            p.first_for_planning().filter(|_| !p.suspended && p.cache.as_ref().is_some_and(|c| c.first_stale))
        {
            let plan = self.ask_planner(&first_asked(&profile))?;
            let p = self.planning.as_mut().expect("planning is on");
            let c = p.cache.as_mut().expect("checked");
            c.first_stale = false;
            c.first_refinable = plan.is_some();
            c.first = plan.map(|plan| CachedPlan { profile, plan, persistent, zone: 0, searched: 0 });
        }
        let p = self.planning.as_mut().expect("planning is on");
        let content = p.cache_content(self.stats.plan_hits).expect("a cache");
        let c = p.cache.as_mut().expect("checked");
        c.dirty = false;
        c.written = true;
        c.written_dynamic = content.dynamic;
        match content.write(&c.path) {
            Ok(()) => tracing::debug!(path = %c.path.display(), plans = content.plans.len(), "plan cache written"),
            Err(e) if !c.write_failed => {
                c.write_failed = true;
                tracing::warn!(path = %c.path.display(), error = %e, "cannot write the plan cache; the run goes on");
            }
            Err(_) => {}
        }
        Ok(())
    }

    /// At the end of a step its plan (`plans[i]`) served without a miss,
    /// while a plan cache keeps the plans: the planner searches on for a
    /// cheaper plan ([`PlannerPolicy::refine`], one search budget) of that
    /// plan's profile or of the first step's, whichever has the larger
    /// arena (a run from the cache holds the largest of its plans' arenas).
    /// A valid plan that costs less (its arena, plus what it leaves
    /// dynamic) replaces the cached one, which the next run starts from
    /// (this run serves the plans it has: its tensors lie at their
    /// offsets). An invalid plan or a failure is refused and counted like
    /// a plan's, and that plan is not refined again; nor is one after
    /// [`MAX_REFINES`] calls in a run (a search that cannot reach its
    /// bound costs no step past them; the next run goes on from the cache).
    fn refine_cached_plan(&mut self, i: usize) {
        let ctx = self.context();
        let max_arena = self.device.capacity();
        let max = self.policies.max_consecutive_failures;
        let Some(p) = self.planning.as_mut() else { return };
        let Some(cache) = p.cache.as_ref().filter(|_| !p.health.disabled && !p.suspended) else { return };
        let steady = p
            .plans
            .get(i)
            .filter(|q| !q.first_only && q.zone == 0 && q.refinable && q.refines < MAX_REFINES)
            .and_then(|q| q.cached.as_deref());
        let first =
            cache.first.as_ref().filter(|f| cache.first_refinable && cache.first_refines < MAX_REFINES && f.zone == 0);
        let of_first = match (steady, first) {
            (_, None) => false,
            (None, Some(_)) => true,
            (Some(s), Some(f)) => f.plan.arena_bytes > s.plan.arena_bytes,
        };
        let (profile, plan, searched) = match (of_first, steady, first) {
            (true, _, Some(f)) => (first_asked(&f.profile), f.plan.clone(), f.searched),
            (false, Some(s), _) => (s.profile.clone(), s.plan.clone(), s.searched),
            _ => return,
        };
        // The calls spent on it, kept in the cache (written every tenth).
        let cache = p.cache.as_mut().expect("checked");
        let kept = if of_first {
            cache.first_refines += 1;
            cache.first.as_mut()
        } else {
            p.plans[i].refines += 1;
            p.plans[i].cached.as_deref_mut()
        };
        if let Some(c) = kept {
            c.searched = searched + 1;
        }
        cache.dirty |= (searched + 1).is_multiple_of(10);
        let result = p.planner.refine(&profile, &plan, searched, &ctx).and_then(|r| match r {
            Refined::Better(better) => {
                validate_plan(&profile, &better, max_arena).map(|()| Refined::Better(better)).map_err(Into::into)
            }
            other => Ok(other),
        });
        let mut stop = || {
            let cache = p.cache.as_mut().expect("checked");
            cache.dirty = true;
            if of_first {
                cache.first_refinable = false;
            } else {
                p.plans[i].refinable = false;
            }
        };
        match result {
            Ok(Refined::Better(better)) if plan_cost(&profile, &better) < plan_cost(&profile, &plan) => {
                tracing::debug!(
                    first = of_first,
                    arena = better.arena_bytes,
                    before = plan.arena_bytes,
                    "a cheaper plan for the plan cache"
                );
                let cache = p.cache.as_mut().expect("checked");
                let kept = if of_first { cache.first.as_mut() } else { p.plans[i].cached.as_deref_mut() };
                if let Some(c) = kept {
                    c.plan = better;
                }
                cache.dirty = true;
                self.stats.plans_refined += 1;
            }
            Ok(Refined::Better(_) | Refined::NotYet) => {}
            Ok(Refined::Done) => stop(),
            Err(e) => {
                stop();
                let p = self.planning.as_mut().expect("planning is on");
                let name = p.planner.name().to_string();
                p.health.record("planner", &name, &e, max);
                self.stats.plan_refused += 1;
                tracing::warn!(planner = %name, error = %e, "refined plan refused; the cached plan stays");
            }
        }
    }

    /// Asks the planner for a plan of `profile` and validates it; a refused
    /// plan is counted and logged (`None`).
    fn ask_planner(&mut self, profile: &StepProfile) -> Result<Option<Plan>, AllocError> {
        let ctx = self.context();
        let max_arena = self.device.capacity();
        let p = self.planning.as_mut().expect("planning is on");
        let max = self.policies.max_consecutive_failures;
        if p.health.disabled {
            return Ok(None);
        }
        p.health.calls += 1;
        let result = p.planner.plan(profile, &ctx).and_then(|plan| {
            validate_plan(profile, &plan, max_arena)?;
            Ok(plan)
        });
        let plan: Plan = match result {
            Ok(plan) => {
                p.health.consecutive_failures = 0;
                plan
            }
            Err(e) => {
                let name = p.planner.name().to_string();
                p.health.record("planner", &name, &e, max);
                self.stats.plan_refused += 1;
                tracing::warn!(planner = %name, step = profile.step, error = %e, "plan refused; the step stays dynamic");
                return Ok(None);
            }
        };
        if plan.planned() == 0 {
            return Ok(None);
        }
        tracing::debug!(
            step = profile.step,
            install_at = install_point(&profile.requests, &plan.offsets).0,
            arena = plan.arena_bytes,
            bound = cycle_live(&profile.requests, &plan.offsets).into_iter().max().unwrap_or(0),
            "plan made"
        );
        Ok(Some(plan))
    }

    /// The free room of the dynamic path that stays reserved whatever is
    /// given back, by pool: the free bytes of its segments that hold a
    /// tensor that outlives the next step, less their whole free pages
    /// (those are released when an arena is installed). At a step's end
    /// (`profile`: its own, not a guessed one), a tensor lives on unless
    /// it is one of the step's end-live requests that the next step frees
    /// (as the step before freed its instance: `wraps_to`); at the run's
    /// first step, nothing is known of that: unless it is a gradient
    /// (zeroed by the next step; a loss or an output kept for logging is
    /// smaller than a segment).
    fn held_room(&self, profile: &StepProfile) -> FxHashMap<u32, u64> {
        let Some(p) = self.planning.as_ref() else { return FxHashMap::default() };
        let first = p.steps <= 1;
        let durable = |id: TensorId, t: &super::Tensor| match p.carried.get(id) {
            None => true,
            Some(_) if first => t.kind != TensorKind::Grad,
            Some(k) => profile.requests.get(k as usize).is_some_and(|r| !r.plannable(k)),
        };
        let page = self.device.granularity();
        let mut room: FxHashMap<u32, u64> = FxHashMap::default();
        for (seg, s) in self.arena.segments.iter() {
            if self.arena.pools[s.pool as usize].planned {
                continue;
            }
            let paged = page > 0 && self.paging.segs.contains_key(&seg);
            let (mut free, mut held, mut b) = (0, false, s.first);
            while b != NIL {
                let blk = self.arena.blocks.get(b);
                if blk.is_free() {
                    let whole = if paged {
                        (blk.offset + blk.size) / page - (blk.offset.div_ceil(page)).min((blk.offset + blk.size) / page)
                    } else {
                        0
                    };
                    free += blk.size - whole * page;
                } else {
                    held |= self.tensors.by_slot(blk.tensor).is_some_and(|(id, t)| durable(id, t));
                }
                b = blk.next;
            }
            if held && free > 0 {
                *room.entry(s.pool).or_default() += free;
            }
        }
        room
    }

    /// The requests of `profile` to leave out of its plan: those freed in
    /// the step that the dynamic path places in a pool with free room it
    /// keeps anyway (the segments of tensors that outlive the step: a loss
    /// kept for logging, a step counter, the first step's leftovers), taken
    /// in their order while the bytes live at once in each pool stay within
    /// [`ROOM_SHARE`] of its room. The arena then need not hold them: the
    /// dynamic path's peak carries that room whether it is used or not
    /// (a plan that holds them is a little worse than `defrag` there,
    /// whose step fills it). `None`: none (no such room, or steps planned
    /// two at a time). Returns the profile the planner is asked to plan
    /// (those requests' lifetimes unknown) and which requests are left.
    fn room_left(&self, profile: &StepProfile) -> Option<(StepProfile, Vec<bool>)> {
        let p = self.planning.as_ref().filter(|p| p.period == 1 && !p.dynamic_pools.is_empty())?;
        let room = self.held_room(profile);
        if room.is_empty() {
            return None;
        }
        let budget = |pool: u32| room.get(&pool).map_or(0, |r| r / ROOM_SHARE.1 * ROOM_SHARE.0);
        let mut load: FxHashMap<u32, u64> = FxHashMap::default();
        let mut ends = std::collections::BinaryHeap::new();
        let mut left = vec![false; profile.requests.len()];
        let mut any = false;
        for (k, r) in profile.requests.iter().enumerate() {
            while let Some(&std::cmp::Reverse((end, pool, bytes))) = ends.peek() {
                if end > k as u32 {
                    break;
                }
                ends.pop();
                *load.entry(pool).or_default() -= bytes;
            }
            let Some(end) = r.freed_at.filter(|_| r.plannable(k as u32)) else { continue };
            let Some(&pool) = p.dynamic_pools.get(&key(r)) else { continue };
            let bytes = r.planned_bytes();
            let used = load.entry(pool).or_default();
            if *used + bytes > budget(pool) {
                continue;
            }
            *used += bytes;
            ends.push(std::cmp::Reverse((end, pool, bytes)));
            left[k] = true;
            any = true;
        }
        if !any {
            return None;
        }
        let mut asked = StepProfile { step: profile.step, requests: profile.requests.clone() };
        for (r, _) in asked.requests.iter_mut().zip(&left).filter(|(_, &l)| l) {
            r.freed_at = None;
            r.wraps_to = None;
        }
        Some((asked, left))
    }

    /// When steps are planned two at a time: the planner's aliased plan of
    /// `profile` ([`PlannerPolicy::plan_aliased`]), validated against the
    /// physical memory it maps (an invalid one is refused and counted).
    fn ask_aliased(&mut self, profile: &StepProfile) -> Option<AliasedPlan> {
        let ctx = self.context();
        let (granularity, capacity) = (self.device.granularity(), self.device.capacity());
        let max = self.policies.max_consecutive_failures;
        let p = self.planning.as_mut().filter(|p| p.period == 2 && !p.health.disabled)?;
        let result = p.planner.plan_aliased(profile, &ctx).and_then(|plan| match plan {
            Some(plan) => {
                validate_aliased(profile, &plan, granularity, capacity).map(|()| Some(plan)).map_err(Into::into)
            }
            None => Ok(None),
        });
        match result {
            Ok(plan) => plan.filter(|plan| plan.offsets.iter().any(Option::is_some)),
            Err(e) => {
                let name = p.planner.name().to_string();
                p.health.record("planner", &name, &e, max);
                self.stats.plan_refused += 1;
                tracing::warn!(planner = %name, step = profile.step, error = %e, "aliased plan refused");
                None
            }
        }
    }

    /// Asks the planner for a plan of `profile`, validates it and stores it
    /// (in an arena at least as large as the cached plans').
    fn make_plan(&mut self, profile: &StepProfile) -> Result<(), AllocError> {
        let room_left = self.room_left(profile);
        let asked = room_left.as_ref().map_or(profile, |(asked, _)| asked);
        let page = self.device.granularity().max(1);
        // What a plan leaves to the dynamic path.
        let left = |offsets: &[Option<u64>]| -> u64 {
            let reqs = &profile.requests;
            (0..reqs.len())
                .filter(|&k| offsets.get(k).is_none_or(Option::is_none) && reqs[k].plannable(k as u32))
                .map(|k| reqs[k].planned_bytes())
                .sum()
        };
        let aliased = self.ask_aliased(profile);
        // An aliased plan that holds (with what it leaves) no more than the
        // step's live bound in whole pages is preferred to every plain plan
        // (none holds less than that bound, see `prefer_aliased`): the
        // planner is not asked for one. (Steps planned two at a time are
        // asked as they are: `room_left` and `guessed_holds` are for single
        // steps.)
        let at_bound = aliased.as_ref().is_some_and(|a| {
            let core: Vec<wasmem_plan_core::Request> = profile.requests.iter().map(PlanRequest::core).collect();
            let bound = wasmem_plan_core::live_bound(&core).div_ceil(page).saturating_mul(page);
            let cost = a.arena_bytes.saturating_add(left(&a.offsets));
            tracing::debug!(step = profile.step, cost, bound, "aliased plan against the live bound in pages");
            cost <= bound
        });
        let plain = match self.guessed_holds(asked) {
            _ if at_bound => None,
            Some(plan) => Some(plan),
            None => self.ask_planner(asked)?,
        };
        // Two steps at a time: an aliased plan, when the planner makes one
        // that holds no more than the plain plan (with what each leaves
        // dynamic) in whole pages of the device (the aliased arena is
        // mapped in whole pages; a device allocation is rounded to them
        // too), or when the plain plan could not be installed under the
        // peak so far (within a page, as [`Allocator::install_arena`]
        // checks): its arena beside the tensors it expects live at its
        // install point, which still lie on the dynamic path then (an
        // aliased arena's zone where those lie is made only once they are
        // gone). A plain plan of two steps that a kept output crosses often
        // reaches its bound, but its arena rarely fits beside them.
        let high_water = self.planning.as_ref().map_or(0, |p| p.high_water);
        let high_water = high_water.max(self.stats.bytes.peak_reserved_bytes).saturating_add(page);
        let prefer_aliased = |aliased: u64, p: &Plan, left: u64| {
            let plain = p.arena_bytes + left;
            let at_install = install_point(&profile.requests, &p.offsets).1;
            aliased <= plain.div_ceil(page).saturating_mul(page) || plain.saturating_add(at_install) > high_water
        };
        if let Some(aliased) = aliased {
            let cost = aliased.arena_bytes + left(&aliased.offsets);
            if plain.as_ref().is_none_or(|p| prefer_aliased(cost, p, left(&p.offsets))) {
                let p = self.planning.as_mut().expect("planning is on");
                let stored = StoredPlan::of_aliased(profile, &aliased, p.steps);
                if let Some(q) = p.plans.iter_mut().find(|q| {
                    !q.first_only && q.zone == stored.zone && q.offsets == stored.offsets && q.keys == stored.keys
                }) {
                    q.settled = true;
                    return Ok(());
                }
                // The profile is copied only for a plan cache.
                let stored = match p.cache.as_mut() {
                    Some(cache) => {
                        cache.dirty = true;
                        stored.keeping(CachedPlan {
                            profile: StepProfile { step: profile.step, requests: profile.requests.clone() },
                            plan: Plan { arena_bytes: aliased.arena_bytes, offsets: aliased.offsets },
                            persistent: Vec::new(),
                            zone: aliased.zone_bytes,
                            searched: 0,
                        })
                    }
                    None => stored,
                };
                p.store(stored);
                self.stats.plans += 1;
                return Ok(());
            }
        }
        let Some(plan) = plain else { return Ok(()) };
        // A step that deviated from an aliased plan (its two halves no longer
        // alike) keeps that plan when a plain one would hold more (it would
        // need an arena of its own beside the one that serves), or when the
        // plain one could not be installed under the peak so far beside the
        // tensors live at its install point (as `prefer_aliased` judges) —
        // which lie in the arena there is, held whole while they live: its
        // steps would be dynamic until an install that is then refused.
        let at_install = install_point(&profile.requests, &plan.offsets).1;
        let beside = if at_install > 0 { at_install.max(self.stats.plan_arena_bytes) } else { 0 };
        let fits_at_install = plan.arena_bytes.saturating_add(beside) <= high_water;
        let p = self.planning.as_mut().expect("planning is on");
        let first = profile.requests.first().map(key);
        if p.plans.iter().any(|q| {
            !q.first_only
                && q.zone > 0
                && q.keys.first() == first.as_ref()
                && (q.physical() <= plan.arena_bytes || !fits_at_install)
        }) {
            return Ok(());
        }
        let same = |q: &StoredPlan| {
            !q.first_only
                && q.zone == 0
                && q.offsets == plan.offsets
                && q.keys.len() == profile.requests.len()
                && q.keys.iter().copied().eq(profile.requests.iter().map(key))
        };
        if let Some(q) = p.plans.iter_mut().find(|q| same(q)) {
            // (A plan of guessed lifetimes that the step confirmed: what it
            // leaves to the room is now judged by known lifetimes.)
            q.settled = true;
            q.guessed_need = 0;
            q.roomed = room_left.map(|(_, left)| left).unwrap_or_default();
            return Ok(());
        }
        let cached = p.cache.is_some();
        let (roomed, full) = match room_left {
            // The next run starts without this run's room (its first step
            // is planned too): the plan cache keeps a plan of every request.
            Some((_, left)) if cached => (left, self.ask_planner(profile)?),
            Some((_, left)) => (left, None),
            None => (Vec::new(), None),
        };
        let p = self.planning.as_mut().expect("planning is on");
        // The profile is copied only for a plan cache (its buffer serves the next step).
        let c = CachedPlan { profile: StepProfile::default(), plan, persistent: Vec::new(), zone: 0, searched: 0 };
        let stored = if cached {
            let c = CachedPlan { profile: StepProfile { step: profile.step, requests: profile.requests.clone() }, ..c };
            let stored = StoredPlan::of(&c, p.common_arena, false, p.steps);
            match full {
                Some(plan) => stored.keeping(CachedPlan { plan, ..c }),
                None => stored.keeping(c),
            }
        } else {
            StoredPlan::of_profile(profile, &c.plan, p.common_arena, p.steps)
        };
        p.store(StoredPlan { roomed, ..stored });
        if let Some(cache) = p.cache.as_mut() {
            cache.dirty = true;
        }
        self.stats.plans += 1;
        Ok(())
    }

    /// The plan of guessed lifetimes made at the first step, as a plan of
    /// `profile` (the next step's, as the planner would be asked it), when
    /// it holds: the profile is the plan's very requests after at most
    /// [`LOOKAHEAD`] others before them (an input before the first forward
    /// pass, which the guess left out), and the plan — judged by the known
    /// lifetimes — is valid, plans every request that can be planned and
    /// holds no more than the most of them live at once. No plan holds
    /// less, so the planner is not asked. `None` otherwise, and with steps
    /// planned two at a time.
    fn guessed_holds(&self, profile: &StepProfile) -> Option<Plan> {
        let p = self.planning.as_ref().filter(|p| p.period == 1)?;
        let reqs = &profile.requests;
        let q = p.plans.iter().find(|q| q.guessed_need > 0 && !q.first_only && q.zone == 0)?;
        let skip = reqs.len().checked_sub(q.keys.len()).filter(|&s| s <= LOOKAHEAD)?;
        if !reqs[skip..].iter().map(key).eq(q.keys.iter().copied()) {
            return None;
        }
        let offsets: Vec<Option<u64>> = std::iter::repeat_n(None, skip).chain(q.offsets.iter().copied()).collect();
        if reqs.iter().zip(&offsets).enumerate().any(|(k, (r, o))| o.is_some() != r.plannable(k as u32)) {
            return None;
        }
        let bound = cycle_live(reqs, &offsets).into_iter().max().unwrap_or(0);
        let arena = offsets.iter().zip(reqs).filter_map(|(o, r)| o.map(|o| o.saturating_add(r.planned_bytes()))).max();
        let plan = Plan { arena_bytes: arena.unwrap_or(0), offsets };
        if plan.arena_bytes > bound || validate_plan(profile, &plan, self.device.capacity()).is_err() {
            return None;
        }
        tracing::debug!(step = profile.step, arena = plan.arena_bytes, skip, "the plan of guessed lifetimes holds");
        Some(plan)
    }

    /// Reads the plan cache at `path` (the plans of an earlier run of the
    /// same training) and keeps the run's plans there from now on: written
    /// at step ends when they change. Needs a planner. Returns the plans
    /// read (0: no file yet).
    ///
    /// The plans are validated again and share one arena (the largest);
    /// the persistent requests of the first-step plan go to an arena of
    /// their own, kept while they live. Arenas of cached plans are held to
    /// the high-water mark of the run that made them.
    /// A file that is not a plan cache is an error, and nothing is changed
    /// (it is not overwritten); a cache whose plans are refused (another
    /// version, an invalid plan, too large for this device) is warned
    /// about, counted in `plan_refused`, and overwritten by this run's plans.
    pub fn use_plan_cache(&mut self, path: &Path) -> Result<usize, CacheError> {
        let (capacity, granularity) = (self.device.capacity(), self.device.granularity());
        let Some(p) = self.planning.as_mut() else {
            return Err(CacheError {
                path: path.to_path_buf(),
                what: "needs planned placement (a spec with a planner, e.g. `planned`)".into(),
                foreign: false,
            });
        };
        let content = match CacheContent::read(path, capacity, granularity) {
            Ok(c) => c,
            Err(e) if e.foreign => return Err(e),
            Err(e) => {
                tracing::warn!(error = %e, "plan cache refused; this run learns its plans again");
                self.stats.plan_refused += 1;
                None
            }
        };
        p.cache = Some(Box::new(CacheState {
            path: path.to_path_buf(),
            first: None,
            first_profile: None,
            first_live: BySlot::default(),
            first_stale: false,
            first_refinable: false,
            first_refines: 0,
            dirty: false,
            write_failed: false,
            written: false,
            written_dynamic: false,
        }));
        let Some(mut content) = content else { return Ok(0) };
        if content.unsteady {
            tracing::warn!(
                path = %path.display(),
                "plan cache: an earlier run of this training found its steps unsteady (a step that left its plan \
                 raised the peak reserved memory); planned placement stays off (delete the file to learn again)"
            );
            p.forget_plans();
            p.suspended = true;
            p.cached_high_water = content.high_water;
            p.dynamic_cache = content.dynamic;
            // This run is the dynamic path's alone: the file is to say so,
            // with its own mark (the one read may hold a raise that plans
            // left in an earlier run).
            if let Some(c) = p.cache.as_mut().filter(|_| !content.dynamic) {
                c.dirty = true;
            }
            return Ok(0);
        }
        let aliased = content.plans.iter().any(|c| c.zone > 0);
        if content.plans.is_empty() || (aliased && content.first.as_ref().is_some_and(|f| f.zone == 0)) {
            // No plan for the steps after the first: a step arena would be
            // held by what the first step leaves live while those steps
            // allocate elsewhere. Only the persistent requests are planned.
            // Likewise for a plain first plan (not fitted into the aliased
            // plan's windows) before an aliased plan, which is mapped from
            // the free pages the first step leaves: the first step's arena
            // would hold them with its tensors that stay, the aliased arena
            // be refused, and the steps grow beside the first one (a warm
            // run 29 % above its learning run).
            if let Some(f) = content.first.as_mut() {
                f.plan.offsets.iter_mut().for_each(|o| *o = None);
                f.plan.arena_bytes = 0;
                f.zone = 0;
            }
        }
        p.forget_plans();
        p.cached_high_water = content.high_water;
        p.dynamic_cache = content.dynamic;
        p.period = content.period.max(1);
        p.mid = false;
        // Room at the end of the arena for what the steady plans leave
        // dynamic (an input held until the next batch replaces it: the
        // arena's free space serves both instances without displacing a
        // planned request), when it fits under the step-end peak of the
        // run that made the plans (room for one instance only would
        // leave the other growing pages every other step all the same).
        let kept = content.first.as_ref().map_or(0, CachedPlan::persistent_bytes);
        let steady = content.plans.iter().filter(|c| c.zone == 0);
        let widest = steady.clone().map(|c| c.plan.arena_bytes).max().unwrap_or(0);
        let planless = steady.map(CachedPlan::planless_bytes).max().unwrap_or(0);
        let room = (widest + planless).div_ceil(PLAN_ALIGN) * PLAN_ALIGN;
        p.common_arena = content.arena_bytes();
        if room.saturating_add(kept) <= content.high_water {
            p.common_arena = p.common_arena.max(room);
        }
        let now = p.steps;
        let mut n = 0;
        if let Some(f) = content.first.as_ref().filter(|_| p.steps == 0) {
            p.plans.push(StoredPlan { from_cache: true, ..StoredPlan::of(f, p.common_arena, true, now) });
            n += 1;
        }
        for c in content.plans {
            let stored = StoredPlan::of(&c, p.common_arena, false, now).keeping(c);
            p.store(StoredPlan { from_cache: true, ..stored });
            n += 1;
        }
        let c = p.cache.as_mut().expect("set");
        c.first_refinable = content.first.is_some();
        c.first = content.first;
        self.stats.plans_loaded += n as u64;
        tracing::info!(path = %path.display(), plans = n, arena = p.common_arena, "plan cache read");
        Ok(n)
    }

    /// The peak an arena of plan `i` is held to (`high_water`: the run's so
    /// far). A plan of the first step's guessed lifetimes is installed in
    /// the second step, whose dynamic peak is not known yet and most often
    /// above the first's (the optimizer's states were made at the first
    /// step's end): the dynamic path would need at least the bytes live
    /// now that stay (those carried from the first step as freed in this
    /// one, and this step's own so far, are not counted) plus the plan's
    /// own peak live bytes, at the overhead it had so far — so much the
    /// arena and what stays dynamic may reserve. Any other plan:
    /// `high_water`.
    fn guessed_high_water(&self, i: usize, high_water: u64) -> u64 {
        let Some(p) = self.planning.as_ref() else { return high_water };
        let need = p.plans[i].guessed_need;
        let b = &self.stats.bytes;
        if need == 0 || b.peak_live_bytes == 0 {
            return high_water;
        }
        let leaving: u64 = p
            .carried
            .entries()
            .filter_map(|(id, _)| self.tensors.get(id))
            .filter(|t| !matches!(t.kind, TensorKind::Param | TensorKind::Optim))
            .map(|t| t.bytes)
            .sum();
        // (This step's tensors so far are the plan's requests, counted in
        // its need, or another step's before a plan chosen later in it.)
        let this_step: u64 = p.live.entries().filter_map(|(id, _)| self.tensors.get(id)).map(|t| t.bytes).sum();
        let least = b.live_bytes.saturating_sub(leaving).saturating_sub(this_step).saturating_add(need);
        let expected = u128::from(least) * u128::from(high_water) / u128::from(b.peak_live_bytes);
        tracing::debug!(least, expected = expected as u64, high_water, "a plan of guessed lifetimes is held to");
        high_water.max(u64::try_from(expected).unwrap_or(u64::MAX))
    }

    /// What giving back the dynamic path's cache would release: its
    /// entirely free segments and its whole free pages (free bytes within
    /// pages or segments that hold tensors stay reserved).
    fn dynamic_releasable(&self) -> u64 {
        let unpaged_free: u64 = self
            .free_segments(None)
            .into_iter()
            .filter(|s| !self.paging.segs.contains_key(s))
            .map(|s| self.arena.segments.get(s).size)
            .sum();
        unpaged_free + self.free_page_bytes()
    }

    /// Installs an arena for the active plan (at its install point): the old
    /// arena goes when it is free, the dynamic cache is given back, the new
    /// arena is allocated, and the live tensors the plan expects are moved
    /// to their planned offsets (unless addresses must stay stable); the
    /// others stay where they are. Returns whether the arena is installed
    /// (the device may refuse it: the step then stays dynamic).
    fn install_arena(&mut self) -> Result<bool, AllocError> {
        let p = self.planning.as_mut().expect("planning is on");
        let i = p.active.expect("a plan is active");
        let (want, zone) = (p.plans[i].arena_bytes, p.plans[i].zone);
        // An aliased arena's zone where the step before lay (its tensors
        // are on the dynamic path) is made once a request needs it (none
        // lay before a run's first step).
        let pending = (zone > 0 && !p.plans[i].first_only).then(|| {
            if p.plans[i].install_at < p.plans[i].keys.len() / 2 {
                2
            } else {
                0
            }
        });
        // What it holds: an aliased arena's two windows share their memory.
        let holds = p.plans[i].physical() - if pending.is_some() { zone } else { 0 };
        let kept = if p.kept_seg.is_none() { p.plans[i].kept_bytes } else { 0 };
        p.installing = false;
        if let Some(seg) = p.arenas.last().map(|a| a.seg) {
            if self.arena_is_free(seg) {
                let a = self.planning.as_mut().expect("planning is on").arenas.pop().expect("checked");
                self.release_arena(a)?;
            }
        }
        // Never above the dynamic path's own peak: the arena and what stays
        // dynamic must fit in the most reserved so far — estimated before
        // the cache is given back (whole free segments and free pages), then
        // checked after. A paged dynamic path reserves whole pages, so its
        // peak is known to within one: a plan within a page of it is no
        // worse (the step's small tensors that share the pages of persistent
        // ones leave the dynamic peak a little under the plan's bound plus
        // those pages; 0.8 MB of 9 GB on a recorded Llama step).
        let high_water = self.planning.as_ref().map_or(0, |p| {
            let cached = if p.plans[i].from_cache { p.cached_high_water } else { 0 };
            p.high_water.max(cached)
        });
        let high_water = high_water.max(self.stats.bytes.peak_reserved_bytes);
        // Spare pages (of chunks that persistent tensors still use) are
        // reserved either way: an arena mapped from pages takes them.
        let g = self.device.granularity();
        let paged =
            g > 0 && self.paged_page(want) > 0 && (zone == 0 || (want / 2).is_multiple_of(g) && zone.is_multiple_of(g));
        let spare_bytes = |a: &Self| if paged { a.spare_bytes() } else { 0 };
        let estimate = self
            .stats
            .bytes
            .reserved_bytes
            .saturating_sub(self.dynamic_releasable() + spare_bytes(self).min(holds))
            .saturating_add(holds + kept);
        let page = if self.policies.reclamation_wants_pages() { self.device.granularity() } else { 0 };
        let high_water = self.guessed_high_water(i, high_water).saturating_add(page);
        if estimate > high_water {
            return Ok(self.refuse_arena(holds + kept, estimate, high_water));
        }
        let first_only = self.planning.as_ref().is_some_and(|p| p.plans[i].first_only);
        // A plain arena is mapped from the whole free pages of the dynamic
        // path where that takes fewer device calls than giving them back
        // and allocating it whole.
        let stitched = match zone {
            _ if first_only => None,
            0 => self.stitched_arena(want)?,
            _ => self.paged_aliased_arena(want / 2, zone, pending)?,
        };
        let in_place = if stitched.is_some() { 0 } else { holds };
        self.release_cached(&ReclaimDecision { trim: true, ..ReclaimDecision::all() })?;
        let spare = if stitched.is_none() { spare_bytes(self).min(in_place) } else { 0 };
        let after = self.stats.bytes.reserved_bytes.saturating_add(in_place + kept) - spare;
        if after > high_water {
            if let Some(a) = stitched {
                self.release_arena(a)?;
            }
            return Ok(self.refuse_arena(holds + kept, after, high_water));
        }
        // A cached first-step plan's arena comes with its first request
        // that is not persistent, once the step so far matched it.
        if first_only {
            self.planning.as_mut().expect("planning is on").deferred_arena = want;
        } else {
            // (The spare pages the cache left: taken, as by a deferred arena.)
            let made = match stitched {
                Some(a) => Some(a),
                None if spare > 0 && zone > 0 => match self.paged_aliased_arena(want / 2, zone, pending)? {
                    Some(a) => Some(a),
                    None => self.new_aliased_arena(want / 2, zone, pending)?,
                },
                None if spare > 0 => match self.stitched_arena(want)? {
                    Some(a) => Some(a),
                    None => self.new_arena(want)?,
                },
                None if zone > 0 => self.new_aliased_arena(want / 2, zone, pending)?,
                None => self.new_arena(want)?,
            };
            let Some(arena) = made else { return Ok(false) };
            let p = self.planning.as_mut().expect("planning is on");
            p.arenas.push(arena);
            p.arena_mapped = true;
        }
        let p = self.planning.as_mut().expect("planning is on");
        p.trim_pending = true;
        p.superseded = None;
        if kept > 0 {
            // Without it the persistent requests are misses (the dynamic path).
            if let Some(k) = self.new_arena(kept)? {
                let p = self.planning.as_mut().expect("planning is on");
                p.kept_seg = Some(k.seg);
                p.arenas.insert(0, k);
            }
        }
        let p = self.planning.as_mut().expect("planning is on");
        let moving = if self.stable_addresses { Vec::new() } else { p.plan_live() };
        p.matched.clear();
        let mut moved = 0;
        for (id, off) in moving {
            moved += self.move_into_arena(id, off)?;
        }
        if moved > 0 {
            self.stats.moved_bytes += moved;
            self.release_cached(&ReclaimDecision { trim: true, ..ReclaimDecision::all() })?;
        }
        self.release_free_retired()?;
        Ok(true)
    }

    /// A new plain arena of at least `size` bytes (whole pages) mapped from
    /// the whole free pages of the dynamic path's paged segments, then one
    /// allocation for the rest: one reservation mapped once, at most one
    /// device call (giving those pages back and allocating the arena whole
    /// takes one per page and one more). Only where whole pages hold at
    /// most 1/1000 more than `size`; `None` otherwise (or no page is free),
    /// or when the device refuses the rest (nothing changed then).
    fn stitched_arena(&mut self, size: u64) -> Result<Option<Arena>, AllocError> {
        let page = self.paged_page(size);
        if page == 0 {
            return Ok(None);
        }
        let need = size.div_ceil(page);
        // Whole pages: where rounding up to them would hold more than
        // 1/1000 more than the plan's arena (arenas under 2 GiB, unless
        // nearly whole pages), the arena is allocated at its own size —
        // unless spare pages are at hand (reserved whatever is done).
        if (need * page - size).saturating_mul(1000) > size && self.paging.spare_pages == 0 {
            return Ok(None);
        }
        let (plan, have) = self.plan_runs(need, NIL);
        let spare = self.paging.spare_pages.min(need - have);
        if have + spare == 0 {
            return Ok(None);
        }
        let rest = match need - have - spare {
            0 => None,
            n => match self.device.create_physical(n * page) {
                Ok(h) => Some(h),
                Err(DeviceError::OutOfMemory { .. }) => return Ok(None),
                Err(e) => return Err(e.into()),
            },
        };
        let bytes = need * page;
        // Unmapping and mapping the pages blocks like giving them back does.
        let t0 = self.device.counters().time_us;
        let mut pages = self.take_runs(plan)?;
        // Spare pages (fewer than asked for: no device call).
        pages.extend(self.create_pages(spare, page)?);
        let held = ArenaPages { pages, rest };
        let base = match self.map_arena_pages(&held, bytes, page) {
            Ok(va) => va,
            Err(e) => {
                // The pages left the dynamic path: they go back to the device.
                self.release_pages(&held.pages)?;
                self.settle_spare();
                if let Some(h) = held.rest {
                    self.device.release_physical(h)?;
                    self.stats.device_free_calls += 1;
                }
                return Err(e.into());
            }
        };
        self.stats.device_alloc_calls += u64::from(rest.is_some());
        self.stats.stitches += 1;
        self.stats.stitched_bytes += (have + spare) * page;
        let pool = self.planned_pool();
        let seg = self.arena.segments.insert(Segment {
            base,
            size: bytes,
            pool,
            stream: StreamId(0),
            first: NIL,
            born: self.clock,
        });
        let block =
            self.arena.blocks.insert(Block { segment: seg, offset: 0, size: bytes, prev: NIL, next: NIL, tensor: NIL });
        self.arena.segments.get_mut(seg).first = block;
        self.stats.bytes.add_reserved(bytes);
        self.arena.pools[pool as usize].gauges.add_reserved(bytes);
        self.stats.plan_arena_bytes += bytes;
        self.record(ActionKind::SegmentAlloc, base, bytes, StreamId(0), None);
        self.record_pause(t0);
        tracing::debug!(bytes, from_free_pages = have * page, "arena mapped from the dynamic path's free pages");
        Ok(Some(Arena { pages: Some(Box::new(held)), ..Arena::new(seg, base, bytes, block) }))
    }

    /// Maps an arena's pages (then the rest) in order into a new
    /// reservation of `bytes`; on failure unmaps what was mapped and
    /// releases the reservation (the physical memory stays the caller's).
    fn map_arena_pages(&mut self, held: &ArenaPages, bytes: u64, page: u64) -> Result<DevicePtr, DeviceError> {
        let va = self.device.reserve_virtual(bytes)?;
        let n = held.pages.len();
        for i in 0..n + usize::from(held.rest.is_some()) {
            let at = va + i as u64 * page;
            let r = match held.pages.get(i) {
                Some(&p) => self.map_page(at, p, page),
                None => self.device.map(at, held.rest.expect("one past the pages: the rest")),
            };
            if let Err(e) = r {
                for j in 0..i as u64 {
                    self.device.unmap(va + j * page)?;
                }
                self.device.release_virtual(va)?;
                return Err(e);
            }
        }
        Ok(va)
    }

    /// A new arena of `size` bytes from the device; `None` when the device
    /// refuses it (counted and logged, and plans needing that much are not
    /// installed again).
    fn new_arena(&mut self, size: u64) -> Result<Option<Arena>, AllocError> {
        let pool = self.planned_pool();
        let base = match self.device.alloc_segment(size) {
            Ok(b) => b,
            Err(e) => {
                self.stats.plan_refused += 1;
                tracing::warn!(bytes = size, error = %e, "no arena for the plan; its steps stay dynamic");
                let p = self.planning.as_mut().expect("planning is on");
                p.refused_arena = p.refused_arena.min(size);
                p.active = None;
                p.matched.clear();
                return Ok(None);
            }
        };
        self.stats.device_alloc_calls += 1;
        let seg =
            self.arena.segments.insert(Segment { base, size, pool, stream: StreamId(0), first: NIL, born: self.clock });
        let block =
            self.arena.blocks.insert(Block { segment: seg, offset: 0, size, prev: NIL, next: NIL, tensor: NIL });
        self.arena.segments.get_mut(seg).first = block;
        self.stats.bytes.add_reserved(size);
        self.arena.pools[pool as usize].gauges.add_reserved(size);
        self.stats.plan_arena_bytes += size;
        self.record(ActionKind::SegmentAlloc, base, size, StreamId(0), None);
        Ok(Some(Arena::new(seg, base, size, block)))
    }

    /// A new aliased arena as [`Allocator::new_aliased_arena`] makes it,
    /// its parts mapped from the whole pages the dynamic path has free (in
    /// turn: low zone, middle, high zone), each part's rest one allocation:
    /// no device call gives those pages back. `None` when no page is free,
    /// the arena's zones are not whole pages, or the device refuses a rest
    /// (nothing changed then).
    fn paged_aliased_arena(
        &mut self,
        half: u64,
        zone: u64,
        pending: Option<usize>,
    ) -> Result<Option<Arena>, AllocError> {
        let page = self.paged_page(half);
        if page == 0 || !half.is_multiple_of(page) || !zone.is_multiple_of(page) {
            return Ok(None);
        }
        let size = 2 * half;
        let parts = Arena { zone, pending, ..Arena::new(0, 0, size, NIL) }.parts();
        let made: Vec<usize> = (0..3).filter(|&i| parts[i].0 > 0 && pending != Some(i)).collect();
        let need: u64 = made.iter().map(|&i| parts[i].0 / page).sum();
        let (plan, runs) = self.plan_runs(need, NIL);
        let spare = self.paging.spare_pages.min(need - runs);
        let have = runs + spare;
        if have == 0 {
            return Ok(None);
        }
        // Each part takes the pages in turn, then one allocation for what
        // it still lacks.
        let (mut left, mut counts, mut phys) = (have, [0u64; 3], [None; 3]);
        for &i in &made {
            counts[i] = (parts[i].0 / page).min(left);
            left -= counts[i];
            let rest = parts[i].0 - counts[i] * page;
            if rest == 0 {
                continue;
            }
            match self.device.create_physical(rest) {
                Ok(h) => phys[i] = Some(h),
                Err(e) => {
                    for h in phys.into_iter().flatten() {
                        self.device.release_physical(h)?;
                        self.stats.device_free_calls += 1;
                    }
                    return match e {
                        DeviceError::OutOfMemory { .. } => Ok(None),
                        e => Err(e.into()),
                    };
                }
            }
        }
        // Unmapping and mapping the pages blocks like giving them back does.
        let t0 = self.device.counters().time_us;
        let mut taken = self.take_runs(plan)?;
        taken.extend(self.create_pages(spare, page)?);
        let mut taken = taken.into_iter();
        let mut zone_pages: [Vec<Page>; 3] = Default::default();
        for &i in &made {
            zone_pages[i] = taken.by_ref().take(counts[i] as usize).collect();
        }
        let shape =
            Arena { zone, pending, phys, zone_pages: Some(Box::new(zone_pages)), ..Arena::new(0, 0, size, NIL) };
        let base = match self.map_aliased(&shape, page) {
            Ok(va) => va,
            Err(e) => {
                // The pages left the dynamic path: they go back to the device.
                for i in 0..3 {
                    for (h, _) in shape.part_handles(i, page) {
                        self.release_piece(h)?;
                    }
                }
                self.settle_spare();
                return Err(e.into());
            }
        };
        self.stats.device_alloc_calls += phys.iter().flatten().count() as u64;
        self.stats.stitches += 1;
        self.stats.stitched_bytes += have * page;
        let pool = self.planned_pool();
        let seg =
            self.arena.segments.insert(Segment { base, size, pool, stream: StreamId(0), first: NIL, born: self.clock });
        let block =
            self.arena.blocks.insert(Block { segment: seg, offset: 0, size, prev: NIL, next: NIL, tensor: NIL });
        self.arena.segments.get_mut(seg).first = block;
        let Arena { zone_pages, .. } = shape;
        let arena = Arena { zone, pending, phys, zone_pages, ..Arena::new(seg, base, size, block) };
        let holds = arena.physical();
        self.stats.bytes.add_reserved(holds);
        self.arena.pools[pool as usize].gauges.add_reserved(holds);
        self.stats.plan_arena_bytes += holds;
        self.record(ActionKind::SegmentAlloc, base, size, StreamId(0), None);
        self.record_pause(t0);
        tracing::debug!(bytes = half, zone, ?pending, from_free_pages = have * page, "aliased arena mapped from pages");
        Ok(Some(arena))
    }

    /// Maps `piece` (a page, or an allocation whole) at `va`.
    fn map_piece(&mut self, va: DevicePtr, piece: Piece, page: u64) -> Result<(), DeviceError> {
        match piece {
            Piece::Page(p) => self.map_page(va, p, page),
            Piece::Whole(h) => self.device.map(va, h),
        }
    }

    /// Gives back `piece`, no longer mapped: a page becomes spare (its
    /// chunk goes once all its pages are: the caller settles), an
    /// allocation goes to the device.
    fn release_piece(&mut self, piece: Piece) -> Result<(), DeviceError> {
        match piece {
            Piece::Page(p) => self.release_pages(&[p]),
            Piece::Whole(h) => {
                self.device.release_physical(h)?;
                self.stats.device_free_calls += 1;
                Ok(())
            }
        }
    }

    /// Maps the parts of the aliased arena `a` (its base not set yet) at
    /// both windows of a new reservation; on failure unmaps what was mapped
    /// and releases the reservation (the physical memory stays the
    /// caller's).
    fn map_aliased(&mut self, a: &Arena, page: u64) -> Result<DevicePtr, DeviceError> {
        let va = self.device.reserve_virtual(a.size)?;
        let mut mapped: Vec<DevicePtr> = Vec::new();
        for (i, (_, w0, w1)) in a.parts().into_iter().enumerate() {
            for (h, off) in a.part_handles(i, page) {
                for at in [va + w0 + off, va + w1 + off] {
                    if let Err(e) = self.map_piece(at, h, page) {
                        for m in mapped {
                            self.device.unmap(m)?;
                        }
                        self.device.release_virtual(va)?;
                        return Err(e);
                    }
                    mapped.push(at);
                }
            }
        }
        Ok(va)
    }

    /// A new aliased arena: `half` bytes of physical memory (three
    /// allocations: the end zones of `zone` bytes and the middle) mapped at
    /// two windows of one reservation, the second `[high | middle | low]`:
    /// one segment of `2 × half` bytes. The zone `pending` (0: low, 2:
    /// high) is made later ([`Allocator::complete_aliased_arena`]). `None`
    /// when the device refuses it (as [`Allocator::new_arena`]); what was
    /// made is given back.
    fn new_aliased_arena(&mut self, half: u64, zone: u64, pending: Option<usize>) -> Result<Option<Arena>, AllocError> {
        let pool = self.planned_pool();
        let size = 2 * half;
        let shape = Arena { zone, pending, ..Arena::new(0, 0, size, NIL) };
        let mut phys = [None; 3];
        let mut reserved = None;
        let made = (|| {
            let va = self.device.reserve_virtual(size)?;
            reserved = Some(va);
            for (i, (bytes, w0, w1)) in shape.parts().into_iter().enumerate() {
                if bytes == 0 || pending == Some(i) {
                    continue;
                }
                let h = self.device.create_physical(bytes)?;
                phys[i] = Some(h);
                self.device.map(va + w0, h)?;
                self.device.map(va + w1, h)?;
            }
            Ok::<DevicePtr, crate::device::DeviceError>(va)
        })();
        let base = match made {
            Ok(va) => va,
            Err(e) => {
                if let Some(va) = reserved {
                    let shape = Arena { base: va, phys, ..shape };
                    self.unmap_aliased(&shape);
                }
                self.stats.plan_refused += 1;
                tracing::warn!(bytes = half, error = %e, "no aliased arena for the plan; its steps stay dynamic");
                let p = self.planning.as_mut().expect("planning is on");
                p.refused_arena = p.refused_arena.min(half);
                p.active = None;
                p.matched.clear();
                return Ok(None);
            }
        };
        let made = phys.iter().flatten().count() as u64;
        self.stats.device_alloc_calls += made;
        let seg =
            self.arena.segments.insert(Segment { base, size, pool, stream: StreamId(0), first: NIL, born: self.clock });
        let block =
            self.arena.blocks.insert(Block { segment: seg, offset: 0, size, prev: NIL, next: NIL, tensor: NIL });
        self.arena.segments.get_mut(seg).first = block;
        let arena = Arena { zone, phys, pending, ..Arena::new(seg, base, size, block) };
        let holds = arena.physical();
        self.stats.bytes.add_reserved(holds);
        self.arena.pools[pool as usize].gauges.add_reserved(holds);
        self.stats.plan_arena_bytes += holds;
        self.record(ActionKind::SegmentAlloc, base, size, StreamId(0), None);
        tracing::debug!(bytes = half, zone, ?pending, "aliased arena installed");
        Ok(Some(arena))
    }

    /// Unmaps and releases what an aliased arena holds from the device, and
    /// its reservation (errors are logged: used on failure paths).
    fn unmap_aliased(&mut self, a: &Arena) {
        let page = self.device.granularity();
        for (i, (_, w0, w1)) in a.parts().into_iter().enumerate() {
            for (h, off) in a.part_handles(i, page) {
                for at in [w0, w1] {
                    // Unmapping what was not mapped fails, and is harmless.
                    let _ = self.device.unmap(a.base + at + off);
                }
                if let Err(e) = self.release_piece(h) {
                    tracing::warn!(error = %e, "releasing a part of a failed aliased arena");
                }
            }
        }
        self.settle_spare();
        if let Err(e) = self.device.release_virtual(a.base) {
            tracing::warn!(error = %e, "releasing the reservation of a failed aliased arena");
        }
    }

    /// Makes the zone of the current aliased arena not made yet, when a
    /// planned request needs it: once what the dynamic path caches is given
    /// back, and only if the memory reserved then stays within the run's
    /// high-water mark (as at install). Returns whether it is there.
    #[cold]
    fn complete_aliased_arena(&mut self) -> Result<bool, AllocError> {
        let Some(p) = self.planning.as_ref() else { return Ok(false) };
        let Some(last) = p.arenas.len().checked_sub(1) else { return Ok(false) };
        let Some(part) = p.arenas[last].pending else { return Ok(true) };
        let (bytes, w0, w1) = p.arenas[last].parts()[part];
        let high_water = p.high_water.max(self.stats.bytes.peak_reserved_bytes);
        let page = if self.policies.reclamation_wants_pages() { self.device.granularity() } else { 0 };
        self.release_cached(&ReclaimDecision { trim: true, ..ReclaimDecision::all() })?;
        // Spare pages (of chunks the dynamic path still uses) first.
        let g = self.device.granularity();
        let spare = if g > 0 && bytes.is_multiple_of(g) { self.paging.spare_pages.min(bytes / g) } else { 0 };
        let new = bytes - spare * g;
        if self.stats.bytes.reserved_bytes.saturating_add(new) > high_water.saturating_add(page) {
            return Ok(false);
        }
        let base = self.planning.as_ref().expect("checked").arenas[last].base;
        let h = match new {
            0 => None,
            n => match self.device.create_physical(n) {
                Ok(h) => Some(h),
                Err(e) => {
                    tracing::debug!(error = %e, "the pending zone of the aliased arena: not now");
                    return Ok(false);
                }
            },
        };
        let pages = self.create_pages(spare, g)?;
        let pieces: Vec<Piece> = pages.iter().map(|&p| Piece::Page(p)).chain(h.map(Piece::Whole)).collect();
        let mut mapped: Vec<DevicePtr> = Vec::new();
        for (j, &piece) in pieces.iter().enumerate() {
            for at in [base + w0 + j as u64 * g, base + w1 + j as u64 * g] {
                if let Err(e) = self.map_piece(at, piece, g) {
                    for m in mapped {
                        self.device.unmap(m)?;
                    }
                    for piece in pieces {
                        self.release_piece(piece)?;
                    }
                    self.settle_spare();
                    tracing::warn!(error = %e, "the pending zone of the aliased arena could not be mapped");
                    return Ok(false);
                }
                mapped.push(at);
            }
        }
        self.stats.device_alloc_calls += u64::from(h.is_some());
        let p = self.planning.as_mut().expect("checked");
        let a = &mut p.arenas[last];
        a.phys[part] = h;
        if !pages.is_empty() {
            a.zone_pages.get_or_insert_with(Default::default)[part] = pages;
        }
        a.pending = None;
        let pool = self.arena.segments.get(a.seg).pool;
        self.stats.bytes.grow(bytes);
        self.arena.pools[pool as usize].gauges.grow(bytes);
        self.stats.plan_arena_bytes += bytes;
        Ok(true)
    }

    /// Refuses to install an arena of `want` bytes that would make `reserved`
    /// bytes, above the `peak` so far: counted, logged, and plans needing
    /// that much are not installed again. Returns `false` (not installed).
    /// A plan of guessed lifetimes is dropped instead, not counted: its
    /// step learns as it would have.
    fn refuse_arena(&mut self, want: u64, reserved: u64, peak: u64) -> bool {
        let p = self.planning.as_mut().expect("planning is on");
        let i = p.active.take().expect("a plan is being installed");
        p.matched.clear();
        if p.chosen_late {
            // (What the step's start left live may not fit beside it; the
            // steps it starts install it.)
            tracing::debug!(bytes = want, reserved, peak, "a plan chosen later in the step: its arena waits");
            return false;
        }
        if p.plans[i].guessed_need > 0 {
            tracing::debug!(bytes = want, reserved, peak, "a plan of guessed lifetimes would raise the peak; dropped");
            p.plans.remove(i);
            return false;
        }
        self.stats.plan_refused += 1;
        tracing::warn!(
            bytes = want,
            reserved,
            peak,
            "the arena would raise the peak reserved memory; its steps stay dynamic"
        );
        let p = self.planning.as_mut().expect("planning is on");
        p.matched.clear();
        // (A plan of the first step's guessed lifetimes lacks what came
        // before that step's first forward pass: its first request is
        // among the refused plan's first few.)
        let first = p.plans[i].keys.first();
        let ahead = &p.plans[i].keys[..p.plans[i].keys.len().min(LOOKAHEAD)];
        let replaced = |old: &StoredPlan| {
            old.keys.first() == first || (old.guessed_need > 0 && old.keys.first().is_some_and(|k| ahead.contains(k)))
        };
        match p.superseded.take().filter(replaced) {
            Some(old) if old.guessed_need > 0 => {
                // The first step's plan serves on, its lifetimes now taken
                // as they are (what it misses stays dynamic); plans as large
                // as the refused one are not installed (the steps it serves
                // would plan that one again).
                tracing::debug!(bytes = old.arena_bytes, "the plan of the first step's guessed lifetimes serves on");
                p.plans[i] = StoredPlan { guessed_need: 0, settled: true, ..old };
                p.restored = true;
                p.refused_arena = p.refused_arena.min(want);
            }
            Some(old) => {
                // The plan it replaced serves the arena there is: back, from
                // the next step on (the arena was not refused for its size).
                tracing::debug!(bytes = old.arena_bytes, "the plan it replaced serves on");
                p.plans[i] = old;
                p.restored = true;
            }
            None => p.refused_arena = p.refused_arena.min(want),
        }
        false
    }

    /// Moves live tensor `id` to offset `off` of the current arena when it
    /// can move (on the device, on the arena's stream, not pinned, used on
    /// no other stream) and the range is free; returns the bytes copied.
    fn move_into_arena(&mut self, id: TensorId, off: u64) -> Result<u64, AllocError> {
        let Some(t) = self.tensors.get(id).copied() else { return Ok(0) };
        if t.tier != Tier::Device || t.cross_stream || self.tensors.pins.contains_key(&id.slot) {
            return Ok(0);
        }
        let Some((dst, dpool)) = self.take_arena_range(off, t.bytes.div_ceil(PLAN_ALIGN) * PLAN_ALIGN, t.stream) else {
            return Ok(0);
        };
        let src = t.block;
        let s = *self.arena.blocks.get(src);
        let sseg = *self.arena.segments.get(s.segment);
        let d = *self.arena.blocks.get(dst);
        let dbase = self.arena.segments.get(d.segment).base;
        self.device.copy(dbase + d.offset, sseg.base + s.offset, t.bytes, t.stream)?;
        self.stats.bytes.sub_live(t.bytes, s.size);
        self.arena.pools[sseg.pool as usize].gauges.sub_live(t.bytes, s.size);
        self.stats.bytes.add_live(t.bytes, d.size);
        self.arena.pools[dpool as usize].gauges.add_live(t.bytes, d.size);
        self.arena.blocks.get_mut(dst).tensor = id.slot;
        self.tensors.get_mut(id).expect("live").block = dst;
        self.arena.blocks.get_mut(src).tensor = NIL;
        self.return_block(src)?;
        Ok(t.bytes)
    }

    /// With no plan stored (a warm run whose cache held only its first
    /// step's, or after the plans were dropped): the current arena serves
    /// nothing more, and goes once it is entirely free (the kept arena
    /// stays while it holds persistent tensors).
    fn release_planless_arena(&mut self) -> Result<(), AllocError> {
        let Some(p) = self.planning.as_ref().filter(|p| p.plans.is_empty() && p.active.is_none()) else {
            return Ok(());
        };
        let Some(seg) = p.arenas.last().map(|a| a.seg).filter(|&s| Some(s) != p.kept_seg) else { return Ok(()) };
        if !self.arena_is_free(seg) {
            return Ok(());
        }
        let a = self.planning.as_mut().expect("checked").arenas.pop().expect("checked");
        self.release_arena(a)
    }

    /// Releases arenas other than the current one once they are entirely free.
    /// The kept arena goes too once free, but not during the first step
    /// (its persistent requests are still to come).
    fn release_free_retired(&mut self) -> Result<(), AllocError> {
        loop {
            let Some(p) = self.planning.as_ref() else { return Ok(()) };
            let n = p.arenas.len();
            let waiting = |seg: u32| p.steps == 0 && p.kept_seg == Some(seg);
            let Some(i) =
                (0..n.saturating_sub(1)).find(|&i| !waiting(p.arenas[i].seg) && self.arena_is_free(p.arenas[i].seg))
            else {
                return Ok(());
            };
            let a = self.planning.as_mut().expect("planning is on").arenas.remove(i);
            self.release_arena(a)?;
        }
    }

    /// The segment the dynamic path grows by for a request of `rounded`
    /// bytes the placement gave a segment of `segment` bytes: in a step a
    /// plan serves, when the segment is paged, only the request's own pages.
    /// The plan places nearly every request of the step: a whole segment
    /// for a miss (a 20 MiB one for a 1 MiB tensor) would raise the peak by
    /// memory no later request of the step uses, and would make borrowing
    /// the arena's free space look cheaper than it is (a miss would displace
    /// a planned request up to the segment's size, at the step's peak).
    #[inline]
    pub(super) fn miss_segment(&self, segment: u64, rounded: u64) -> u64 {
        if !self.planning.as_ref().is_some_and(|p| p.active.is_some() && !p.installing) {
            return segment;
        }
        match self.paged_page(segment) {
            0 => segment,
            page => crate::types::round_up(rounded, page).filter(|&least| least < segment).unwrap_or(segment),
        }
    }

    /// When the dynamic path would grow by `grow` bytes (after the first
    /// step): a block for `req` in the free space of the current arena (best
    /// fit, at a free block's start or end):
    /// - in a step no plan serves, always, an arena that holds nothing too
    ///   (the memory is reserved already; a step of another length, or an
    ///   evaluation before a training step whose plan is chosen at its
    ///   training forward pass, runs in it without device calls); only a
    ///   request it cannot hold has it go, once it holds nothing
    ///   ([`Allocator::release_arena_for_dynamic_step`]);
    /// - in a step a plan serves (a deviation, or a planned range still
    ///   taken), when growing would raise the peak even after the dynamic
    ///   path's free memory is released: memory already reserved is used
    ///   before more is (a step that deviates from its plan must not hold
    ///   the arena and a dynamic copy of the step beside it);
    /// - with planning off ([`Allocator::suspend_if_unsteady`]), likewise:
    ///   the arena drains, to be released once free, but not at the cost
    ///   of a peak (a small tensor long live in it, such as the inputs of
    ///   an evaluation kept until the next, would otherwise have the
    ///   dynamic path grow a copy of the step beside it).
    ///
    /// Planned ranges are taken only when free, so a later request of the
    /// plan finds a tensor served here as a deviation, never under its own.
    pub(super) fn lend_idle_arena(&mut self, req: &AllocRequest, grow: u64) -> Option<(u32, u32)> {
        let p = self.planning.as_ref().filter(|p| p.steps > 0)?;
        let last = p.arenas.len().checked_sub(1)?;
        let arena = &p.arenas[last];
        if Some(arena.seg) == p.kept_seg {
            return None;
        }
        // (Planning off: the arena should empty, to be released, not fill;
        // but not at the cost of a peak.)
        if p.active.is_some() || p.suspended {
            let b = &self.stats.bytes;
            if b.reserved_bytes.saturating_sub(self.dynamic_releasable()) + grow <= b.peak_reserved_bytes {
                return None;
            }
        }
        let size = req.bytes.div_ceil(PLAN_ALIGN) * PLAN_ALIGN;
        // Best fit among the ranges that displace least, and never a
        // planned request larger than the growth: growing costs less (for a
        // request the plan leaves dynamic, which comes every step: none
        // larger than half of it, which then needs little of its own).
        let planless = p.borrow_planless && p.borrow.is_some_and(|(at, ..)| at == p.current.len() as u32);
        let most = if planless { grow / 2 } else { grow.max(size) };
        let window = p.borrow.filter(|&(at, ..)| at == p.current.len() as u32).map_or((0, 0), |(_, f, u)| (f, u));
        let at = (p.current.len() as u32, window.0);
        let memo = (arena.seg, p.active.map_or(u32::MAX, |i| i as u32), at, most, (req.bytes, req.kind, req.stream));
        if let Some(&off) = p.lent.get(&memo) {
            if let Some(t) = self.take_range(last, off, size, req.stream) {
                return Some(t);
            }
        }
        let fits = self.free_fits(last, size, most);
        self.index_space(last);
        let displaced = self.displaced(last, size, &fits).unwrap_or_else(|| vec![0; fits.len()]);
        let mut ranked: Vec<_> = displaced.into_iter().zip(fits).filter(|&(d, _)| d <= most).collect();
        if planless {
            // (Its instances alternate: each at the high end of its block,
            // the next one finds the low end whole once what lay below is
            // gone — the room above the steady plan holds both.)
            ranked.sort_unstable_by_key(|&(d, (size, off))| (d, size, std::cmp::Reverse(off)));
        } else {
            ranked.sort_unstable();
        }
        ranked.dedup();
        let taken = ranked
            .into_iter()
            .take(ALIAS_TRIES)
            .find_map(|(d, (_, off))| self.take_range(last, off, size, req.stream).map(|t| (t, d, off)));
        if let Some((_, displaced, offset)) = taken {
            tracing::trace!(bytes = req.bytes, grow, offset, displaced, "a miss borrows the arena");
            let p = self.planning.as_mut().expect("planning is on");
            if p.lent.len() >= LENT_MEMO {
                p.lent.clear();
            }
            p.lent.insert(memo, offset);
        }
        taken.map(|(t, ..)| t)
    }

    /// Builds the active plan's [`SpaceIndex`] for arena `a` (the current
    /// one) when it has none for that arena's size and zone.
    #[cold]
    fn index_space(&mut self, a: usize) {
        let Some(p) = self.planning.as_mut() else { return };
        let (Some(i), Some(arena)) = (p.lend_plan(), p.arenas.get(a)) else { return };
        let key = (arena.size, arena.zone);
        let plan = &mut p.plans[i];
        if plan.first_only || plan.space.as_ref().is_some_and(|ix| ix.key == key) {
            return;
        }
        plan.space = Some(SpaceIndex::build(plan, key.0, key.1));
    }

    /// What taking each of `fits` ((free block bytes, offset) in arena
    /// `a`) for `size` bytes would displace, for the request being served,
    /// which missed its plan: the largest request the active plan allocates
    /// over that range while the borrowed tensor is expected to live, and
    /// [`LOOKAHEAD`] entries more (in the next [`LEND_HORIZON`] entries; past
    /// a cached first-step plan's end, those of the steady plan of its
    /// arena; 0: none). That request would miss
    /// in turn and need as much beside the arena: a large tensor displaced
    /// so at the step's peak costs what the plan saved. `None` when no plan
    /// serves `a` or the request did not miss. Work: O(E log C + overlaps)
    /// for E entries scanned and C candidates; with the plan's
    /// [`SpaceIndex`] (a plan that is not a first step's), the pieces in
    /// the buckets each candidate meets.
    #[cold]
    fn displaced(&self, a: usize, size: u64, fits: &[(u64, u64)]) -> Option<Vec<u64>> {
        let p = self.planning.as_ref()?;
        let (_, from, until) = p.borrow.filter(|&(at, ..)| at == p.current.len() as u32)?;
        p.arenas.len().checked_sub(1).filter(|&l| l == a && Some(p.arenas[l].seg) != p.kept_seg)?;
        let (plan, arena) = (&p.plans[p.lend_plan()?], &p.arenas[a]);
        let (n, zone) = (plan.keys.len() as u32, arena.zone);
        if n == 0 || fits.is_empty() {
            return None;
        }
        // The physical pieces of every candidate, by start.
        let mut parts: Vec<(u64, u64, usize)> = fits
            .iter()
            .enumerate()
            .flat_map(|(c, &(_, off))| physical(off, off + size, arena.size, zone).map(|(lo, hi)| (lo, hi, c)))
            .filter(|&(lo, hi, _)| lo < hi)
            .collect();
        parts.sort_unstable();
        // After a cached first-step plan comes a steady plan of its arena.
        let next = if plan.first_only {
            p.plans.iter().find(|q| !q.first_only && q.zone == plan.zone && q.arena_bytes == plan.arena_bytes)
        } else {
            Some(plan)
        };
        let mut displaced = vec![0u64; fits.len()];
        // (A few entries past the expected end: a tensor freed a little
        // late must not have displaced what comes then.)
        let end = until.saturating_add(LOOKAHEAD as u32).min(from.saturating_add(LEND_HORIZON));
        if let Some(ix) = plan.space.as_ref().filter(|ix| !plan.first_only && ix.key == (arena.size, zone)) {
            // The entries of [from, end) are those of times `t mod n`.
            let span = end.saturating_sub(from);
            let within = |e: u32| span >= n || (e + n - from % n) % n < span;
            for (c, &(_, off)) in fits.iter().enumerate() {
                for (lo, hi) in physical(off, off + size, arena.size, zone).into_iter().filter(|&(lo, hi)| lo < hi) {
                    let last = ix.buckets.len() - 1;
                    let (b0, b1) = (((lo >> ix.shift) as usize).min(last), (((hi - 1) >> ix.shift) as usize).min(last));
                    for &(elo, ehi, e, bytes) in ix.buckets[b0..=b1].iter().flatten() {
                        if elo < hi && ehi > lo && bytes > displaced[c] && within(e) {
                            displaced[c] = bytes;
                        }
                    }
                }
            }
            return Some(displaced);
        }
        for t in from..end {
            let (q, e) = match next {
                _ if t < n => (plan, t as usize),
                Some(q) if !q.keys.is_empty() => (q, ((t - n) as usize) % q.keys.len()),
                _ => break,
            };
            let Some(o) = q.offsets[e].filter(|o| o & KEPT == 0) else { continue };
            let bytes = q.keys[e].0.div_ceil(PLAN_ALIGN) * PLAN_ALIGN;
            for (lo, hi) in physical(o, o + bytes, arena.size, zone).into_iter().filter(|&(lo, hi)| lo < hi) {
                // Pieces are at most `size` long: those meeting [lo, hi) start in (lo - size, hi).
                let mut k = parts.partition_point(|q| q.0 + size <= lo);
                while let Some(&(_, phi, c)) = parts.get(k).filter(|q| q.0 < hi) {
                    if phi > lo {
                        displaced[c] = displaced[c].max(bytes);
                    }
                    k += 1;
                }
            }
        }
        Some(displaced)
    }

    /// Where a block of `size` bytes (a multiple of [`PLAN_ALIGN`]) could go
    /// in the free space of arena `a`: per free block that large, its size
    /// and an offset: the block's start and its end; in an aliased arena,
    /// per window the block lies in, the first offset whose alias in the
    /// other window is free too ([`alias_fit`]), and the block's end; and
    /// the plan's own slots for a request that borrows displacing at most
    /// `most` bytes ([`Allocator::slot_fits`]); one per offset.
    #[cold]
    fn free_fits(&self, a: usize, size: u64, most: u64) -> Vec<(u64, u64)> {
        let Some(arena) = self.planning.as_ref().and_then(|p| p.arenas.get(a)) else { return Vec::new() };
        let blocks = &self.arena.blocks;
        let half = arena.size / 2;
        let mut fits = Vec::new();
        let mut b = self.arena.segments.get(arena.seg).first;
        while let Some(blk) = blocks.try_get(b) {
            b = blk.next;
            if !blk.is_free() || blk.size < size {
                continue;
            }
            let (lo, hi) = (blk.offset, blk.offset + blk.size);
            if arena.zone == 0 {
                fits.push((blk.size, lo));
                let end = (hi - size) / PLAN_ALIGN * PLAN_ALIGN;
                if end > lo {
                    fits.push((blk.size, end));
                }
                continue;
            }
            for (wlo, whi) in [(lo, hi.min(half)), (lo.max(half), hi)] {
                if let Some(off) = alias_fit(blocks, arena, wlo, whi, size) {
                    fits.push((blk.size, off));
                }
            }
            fits.push((blk.size, (hi - size) / PLAN_ALIGN * PLAN_ALIGN));
        }
        self.slot_fits(a, size, most, &mut fits);
        fits.sort_unstable_by_key(|&(b, off)| (off, b));
        fits.dedup_by_key(|f| f.1);
        fits
    }

    /// More candidates for [`Allocator::free_fits`] while a request that
    /// missed its plan borrows arena `a`: the planned ranges of the next
    /// entries of the active plan at least `size` and at most `most` bytes
    /// large (a slot of a larger one would displace it), where they lie in
    /// a free block of `a` (their start, and their end less `size`).
    /// A free block's ends alone would displace what the plan allocates
    /// there (in a nearly empty arena, an evaluation's tensors between two
    /// training forward passes would find only the ranges of the largest
    /// planned tensor); the plan's own slots for tensors of that size are
    /// where tensors alike are expected to come and go. At most
    /// [`SLOT_TRIES`] entries, nearest first. Work: O(F + S log F) for F
    /// free blocks and S slots.
    #[cold]
    fn slot_fits(&self, a: usize, size: u64, most: u64, fits: &mut Vec<(u64, u64)>) {
        let Some(p) = self.planning.as_ref() else { return };
        let Some((_, from, until)) = p.borrow.filter(|&(at, ..)| at == p.current.len() as u32) else { return };
        let (Some(i), Some(arena)) = (p.active, p.arenas.get(a)) else { return };
        if a + 1 != p.arenas.len() || Some(arena.seg) == p.kept_seg || fits.is_empty() {
            return;
        }
        let plan = &p.plans[i];
        let n = plan.keys.len() as u32;
        // The free blocks at least `size` large, by offset.
        let mut free: Vec<(u64, u64)> = Vec::new();
        let blocks = &self.arena.blocks;
        let mut b = self.arena.segments.get(arena.seg).first;
        while let Some(blk) = blocks.try_get(b) {
            b = blk.next;
            if blk.is_free() && blk.size >= size {
                free.push((blk.offset, blk.offset + blk.size));
            }
        }
        let end = until.saturating_add(LOOKAHEAD as u32).min(from.saturating_add(LEND_HORIZON)).min(n);
        let mut slots = 0;
        for t in from..end {
            let e = t as usize;
            let Some(o) = plan.offsets[e].filter(|o| o & KEPT == 0) else { continue };
            let bytes = plan.keys[e].0.div_ceil(PLAN_ALIGN) * PLAN_ALIGN;
            if bytes < size || bytes > most {
                continue;
            }
            let k = free.partition_point(|&(lo, _)| lo <= o);
            let Some(&(lo, hi)) = k.checked_sub(1).map(|k| &free[k]) else { continue };
            for off in [o, o + bytes - size] {
                if lo <= off && off + size <= hi {
                    fits.push((hi - lo, off));
                }
            }
            slots += 1;
            if slots == SLOT_TRIES {
                break;
            }
        }
    }

    /// Before the dynamic path grows during a step no plan serves (none
    /// matched it, or it left its plan before the arena was installed; the
    /// arena could not hold the request): the
    /// current arena goes once it holds nothing, so that the step's memory
    /// is not reserved twice (the arena and the dynamic pages beside it).
    /// Its plans are not refused: a step they serve installs it again,
    /// under the peak guard. The kept arena stays. Returns the bytes released.
    pub(super) fn release_arena_for_dynamic_step(&mut self) -> Result<u64, AllocError> {
        let Some(p) = self.planning.as_ref().filter(|p| p.active.is_none()) else { return Ok(0) };
        let Some(a) = p.arenas.last().filter(|a| Some(a.seg) != p.kept_seg) else { return Ok(0) };
        if !self.arena_is_free(a.seg) {
            return Ok(0);
        }
        let a = self.planning.as_mut().expect("checked").arenas.pop().expect("checked");
        tracing::debug!(bytes = a.physical(), "a step no plan serves grows: its idle arena goes first");
        let size = a.physical();
        self.release_arena(a)?;
        Ok(size)
    }

    /// Under memory pressure: releases every arena that is entirely free
    /// (the current one included: its plans are not installed again at
    /// that size). Returns the bytes released.
    pub(super) fn release_idle_arenas(&mut self) -> Result<u64, AllocError> {
        let mut released = 0;
        loop {
            let Some(p) = self.planning.as_ref() else { return Ok(released) };
            let Some(i) = (0..p.arenas.len()).find(|&i| self.arena_is_free(p.arenas[i].seg)) else {
                return Ok(released);
            };
            let p = self.planning.as_mut().expect("checked");
            let a = p.arenas.remove(i);
            if p.arenas.is_empty() {
                p.refused_arena = p.refused_arena.min(a.physical());
                p.active = None;
                p.installing = false;
            }
            released += a.physical();
            self.release_arena(a)?;
        }
    }

    /// Before the dynamic path grows during a step no plan serves, where
    /// the current arena still holds tensors (its plan was left mid-step:
    /// the step is another's, such as a batch of another length after the
    /// first step's plan was installed): the arena joins the dynamic path
    /// when it is plain and mapped from whole pages. It becomes a paged
    /// segment of the dynamic pool that reserves most, its tensors where
    /// they are and its free blocks cached, so that a request no free range
    /// of it holds is stitched from its free pages rather than from new
    /// memory beside it (a recorded Qwen2 loop of varying lengths grew its
    /// 2.5 GB logits twice beside a 7.7 GB arena: 1.7 % above `defrag`).
    /// Its plans are not refused: a step they serve installs an arena again,
    /// mapped from the free pages. Only when growing by `grow` bytes would
    /// raise the peak even after the dynamic path's free memory is given
    /// back (else the arena drains, to be released once free, as before).
    /// Returns whether it joined.
    pub(super) fn join_idle_arena(&mut self, grow: u64) -> bool {
        let Some(p) = self.planning.as_ref().filter(|p| p.active.is_none() && p.steps > 0) else { return false };
        let Some(a) = p.arenas.last().filter(|a| Some(a.seg) != p.kept_seg) else { return false };
        let whole = a.zone == 0 && a.pages.as_ref().is_some_and(|h| h.rest.is_none() && !h.pages.is_empty());
        if !whole || self.arena_is_free(a.seg) {
            return false;
        }
        let b = &self.stats.bytes;
        if b.reserved_bytes.saturating_sub(self.dynamic_releasable()) + grow <= b.peak_reserved_bytes {
            return false;
        }
        let Some(pool) = self.page_pool(a.physical()) else { return false };
        let p = self.planning.as_mut().expect("checked");
        let a = p.arenas.pop().expect("checked");
        p.lent.clear();
        let pages = a.pages.map(|h| h.pages).expect("checked");
        let seg = *self.arena.segments.get(a.seg);
        let from = seg.pool as usize;
        let (mut live, mut allocated) = (0, 0);
        let mut blk = seg.first;
        while blk != NIL {
            let b = *self.arena.blocks.get(blk);
            if b.is_free() {
                self.arena.pools[pool as usize].free.insert((seg.stream, b.size, seg.base + b.offset, blk));
            } else if let Some((_, t)) = self.tensors.by_slot(b.tensor) {
                live += t.bytes;
                allocated += b.size;
            }
            blk = b.next;
        }
        let size = seg.size;
        self.arena.pools[from].gauges.sub_live(live, allocated);
        self.arena.pools[from].gauges.sub_reserved(size);
        self.arena.pools[pool as usize].gauges.add_reserved(size);
        self.arena.pools[pool as usize].gauges.add_live(live, allocated);
        self.arena.segments.get_mut(a.seg).pool = pool;
        self.paging.reservations.insert(seg.base, super::paged::Reservation { refs: 1, size });
        self.paging.segs.insert(a.seg, super::paged::PagedSeg { pages: pages.into(), resv: seg.base, room: 0 });
        self.stats.plan_arena_bytes -= size;
        tracing::debug!(
            bytes = size,
            live,
            "a step no plan serves grows: its arena, which holds tensors, joins the dynamic path"
        );
        true
    }

    fn arena_is_free(&self, seg: u32) -> bool {
        let s = self.arena.segments.get(seg);
        let b = self.arena.blocks.get(s.first);
        b.is_free() && b.size == s.size
    }

    /// The pool that takes the pages of an arena given back: the dynamic
    /// pool that reserves the most, where the dynamic path is paged now and
    /// the pool keeps free segments (`None`: they go back to the device).
    fn page_pool(&self, bytes: u64) -> Option<u32> {
        self.arena
            .pools
            .iter()
            .enumerate()
            .filter(|(_, p)| !p.planned && !p.release_when_empty)
            .max_by_key(|&(i, p)| (p.gauges.reserved_bytes, std::cmp::Reverse(i)))
            .map(|(i, _)| i as u32)
            .filter(|_| bytes > 0 && self.paged_page(bytes) > 0)
    }

    /// Runs of pages of the reservation at `resv` (`resv_size` bytes), each
    /// mapped in order from its address, become free paged segments of
    /// `pool` on `stream` (the reservation is theirs).
    fn adopt_pages(
        &mut self,
        resv: DevicePtr,
        resv_size: u64,
        runs: Vec<(DevicePtr, Vec<Page>)>,
        pool: u32,
        stream: StreamId,
    ) {
        let page = self.device.granularity();
        self.paging.reservations.insert(resv, super::paged::Reservation { refs: runs.len() as u32, size: resv_size });
        for (base, pages) in runs {
            let size = pages.len() as u64 * page;
            let seg = self.arena.segments.insert(Segment { base, size, pool, stream, first: NIL, born: self.clock });
            let block =
                self.arena.blocks.insert(Block { segment: seg, offset: 0, size, prev: NIL, next: NIL, tensor: NIL });
            self.arena.segments.get_mut(seg).first = block;
            self.paging.segs.insert(seg, super::paged::PagedSeg { pages: pages.into(), resv, room: 0 });
            self.arena.pools[pool as usize].free.insert((stream, size, base, block));
            self.stats.bytes.add_reserved(size);
            self.arena.pools[pool as usize].gauges.add_reserved(size);
            self.record(ActionKind::SegmentAlloc, base, size, stream, None);
        }
    }

    /// Gives back an entirely free arena. The pages a plain arena was mapped
    /// from ([`Allocator::stitched_arena`]) stay mapped where they are and
    /// become a free paged segment of the dynamic path, which the dynamic
    /// path or the next arena takes without a device call and a trim gives
    /// back as any ([`Allocator::page_pool`]); the rest goes to the device
    /// (an aliased arena's pages too: it is given back far more rarely).
    fn release_arena(&mut self, a: Arena) -> Result<(), AllocError> {
        if let Some(p) = self.planning.as_mut().filter(|p| p.kept_seg == Some(a.seg)) {
            p.kept_seg = None;
        }
        let page = self.device.granularity();
        let mut adopt: Vec<(DevicePtr, Vec<Page>)> = Vec::new();
        let pool = if a.pages.is_some() { self.page_pool(a.physical()) } else { None };
        if a.zone > 0 {
            // Unmapped once the arena's stream is done with it (no device
            // synchronization), then its memory and reservation go.
            if self.device.synchronize_stream(StreamId(0))? {
                self.stats.device_syncs += 1;
            }
            for (i, (_, w0, w1)) in a.parts().into_iter().enumerate() {
                for (h, off) in a.part_handles(i, page) {
                    self.device.unmap(a.base + w0 + off)?;
                    self.device.unmap(a.base + w1 + off)?;
                    self.release_piece(h)?;
                }
            }
        } else if let Some(held) = a.pages.as_deref() {
            // Unmapping is not ordered on the stream.
            self.quiesce(&[StreamId(0)])?;
            let kept = if pool.is_some() { held.pages.len() } else { 0 };
            let mapped = held.pages.len() + usize::from(held.rest.is_some());
            for i in kept..mapped {
                self.device.unmap(a.base + i as u64 * page)?;
            }
            self.release_pages(&held.pages[kept..])?;
            if let Some(h) = held.rest {
                self.device.release_physical(h)?;
                self.stats.device_free_calls += 1;
            }
            if kept > 0 {
                adopt.push((a.base, held.pages.clone()));
            }
        } else {
            self.device.free_segment(a.base)?;
            self.stats.device_free_calls += 1;
            self.stats.device_syncs += 1;
        }
        if (a.zone > 0 || a.pages.is_some()) && adopt.is_empty() {
            self.device.release_virtual(a.base)?;
        }
        let seg = *self.arena.segments.get(a.seg);
        self.arena.blocks.remove(seg.first);
        self.arena.segments.remove(a.seg);
        self.stats.bytes.sub_reserved(a.physical());
        self.arena.pools[seg.pool as usize].gauges.sub_reserved(a.physical());
        self.stats.plan_arena_bytes -= a.physical();
        self.record(ActionKind::SegmentFree, seg.base, seg.size, seg.stream, None);
        if let Some(pool) = pool.filter(|_| !adopt.is_empty()) {
            self.adopt_pages(a.base, a.size, adopt, pool, seg.stream);
        }
        self.settle_spare();
        Ok(())
    }

    /// The engine pool of planned arenas, created on first use.
    fn planned_pool(&mut self) -> u32 {
        match self.arena.pools.iter().position(|p| p.planned) {
            Some(i) => i as u32,
            None => {
                let mut pool = Pool::new(PLANNED_POOL, false);
                pool.planned = true;
                self.arena.pools.push(pool);
                (self.arena.pools.len() - 1) as u32
            }
        }
    }

    /// Per aliased arena: its pool and the bytes of its second window (a
    /// segment's size counts them, the memory it holds does not).
    pub(super) fn aliased_windows(&self) -> Vec<(u32, u64)> {
        let Some(p) = self.planning.as_ref() else { return Vec::new() };
        p.arenas
            .iter()
            .filter(|a| a.zone > 0)
            .map(|a| (self.arena.segments.get(a.seg).pool, a.size - a.physical()))
            .collect()
    }

    /// The planning invariants of the module documentation.
    pub(super) fn check_planning(&self) -> Result<(), InvariantError> {
        let bad = |m: String| Err(InvariantError(m));
        let Some(p) = self.planning.as_ref() else {
            return match self.arena.pools.iter().find(|p| p.planned && p.gauges.segments > 0) {
                Some(_) => bad("planned arenas without planning".into()),
                None => Ok(()),
            };
        };
        let mut total = 0;
        for a in &p.arenas {
            let Some(s) = self.arena.segments.try_get(a.seg) else {
                return bad(format!("arena segment {} is gone", a.seg));
            };
            if !self.arena.pools[s.pool as usize].planned || s.size != a.size || s.base != a.base {
                return bad(format!("arena segment {} is not a planned segment of {} bytes", a.seg, a.size));
            }
            if self.paging.segs.contains_key(&a.seg) {
                return bad(format!("arena segment {} is paged", a.seg));
            }
            if let Some(z) = a.zone_pages.as_deref() {
                let page = self.device.granularity();
                let parts = a.parts();
                let bad_part = (0..3).find(|&i| {
                    let mapped = z[i].len() as u64 * page;
                    if a.pending == Some(i) {
                        !z[i].is_empty() || a.phys[i].is_some()
                    } else {
                        mapped > parts[i].0 || (mapped == parts[i].0) != a.phys[i].is_none()
                    }
                });
                if a.zone == 0 || bad_part.is_some() {
                    return bad(format!("aliased arena segment {}: part {bad_part:?} not its pages and rest", a.seg));
                }
            }
            if let Some(held) = a.pages.as_deref() {
                let mapped = held.pages.len() as u64 * self.device.granularity();
                if a.zone > 0 || mapped > a.size || (mapped == a.size) != held.rest.is_none() {
                    return bad(format!(
                        "arena segment {} of {} bytes: mapped from {} pages and {} rest (aliased: {})",
                        a.seg,
                        a.size,
                        held.pages.len(),
                        if held.rest.is_some() { "a" } else { "no" },
                        a.zone > 0
                    ));
                }
            }
            total += a.physical();
            if self.arena.blocks.try_get(a.finger).is_none_or(|b| b.segment != a.seg) {
                return bad(format!("arena segment {}: its finger {} is not one of its blocks", a.seg, a.finger));
            }
        }
        if self.arena.pools.iter().filter(|q| q.planned).any(|q| q.gauges.segments != p.arenas.len() as u64) {
            return bad("planned pool segments and arenas disagree".into());
        }
        if p.kept_seg.is_some() && p.arenas.first().map(|a| a.seg) != p.kept_seg {
            return bad(format!("the kept arena {:?} is not the first arena", p.kept_seg));
        }
        if total != self.stats.plan_arena_bytes {
            return bad(format!("plan_arena_bytes {} but arenas hold {total}", self.stats.plan_arena_bytes));
        }
        Ok(())
    }
}

/// Whether `[off, off + size)` of an aliased arena lies within one of its
/// windows and what the other window sees of that physical memory is free
/// (each piece within a free block).
#[inline]
fn alias_free(blocks: &super::slab::Slab<Block>, arena: &mut Arena, off: u64, size: u64) -> bool {
    let half = arena.size / 2;
    let end = off + size;
    let (o, e, other) = if end <= half {
        (off, end, half)
    } else if off >= half {
        (off - half, end - half, 0)
    } else {
        return false; // across the two windows
    };
    swapped(o, e, half, arena.zone)
        .into_iter()
        .filter(|&(a, b)| a < b)
        .all(|(a, b)| free_span(blocks, arena, a + other, b + other))
}

/// The first offset in `[lo, hi)` (free in an aliased arena, within one
/// window) where `size` bytes lie off the zone not made yet and what the
/// other window sees of them is free too. A try that fails on a taken byte
/// of the other window goes on past that byte as this window sees it:
/// every offset in between would hold it too (each byte of a window has
/// one alias).
fn alias_fit(blocks: &super::slab::Slab<Block>, arena: &Arena, lo: u64, hi: u64, size: u64) -> Option<u64> {
    let (half, zone) = (arena.size / 2, arena.zone);
    let (base, other) = if lo < half { (0, half) } else { (half, 0) };
    let after = |x: u64| x.div_ceil(PLAN_ALIGN) * PLAN_ALIGN;
    let mut p = after(lo);
    for _ in 0..ALIAS_TRIES {
        if p + size > hi {
            return None;
        }
        if let Some(z) = arena.pending {
            let (bytes, w0, w1) = arena.parts()[z];
            let at = if base == 0 { w0 } else { w1 };
            if p < at + bytes && at < p + size {
                p = after(at + bytes);
                continue;
            }
        }
        // The last taken byte of the first taken block the alias meets.
        let mut taken = None;
        for (a, b) in swapped(p - base, p + size - base, half, zone).into_iter().filter(|&(a, b)| a < b) {
            let (a, b) = (a + other, b + other);
            let (_, mut blk) = walk_to(blocks, arena.finger, a);
            loop {
                if !blk.is_free() {
                    taken = Some((blk.offset + blk.size).min(b) - 1);
                    break;
                }
                if blk.offset + blk.size >= b {
                    break;
                }
                blk = *blocks.get(blk.next);
            }
            if taken.is_some() {
                break;
            }
        }
        let Some(t) = taken else { return Some(p) };
        // That byte as this window sees it: a swap of the end zones is its own inverse.
        let x = t - other;
        let shift = half - zone;
        let back = if x < zone {
            x + shift
        } else if x < shift {
            x
        } else {
            x - shift
        };
        p = after(back + base + 1);
    }
    None
}

/// The physical memory of `[o, e)` of an arena segment of `size` bytes
/// (as its first window sees it): the range itself in a plain arena
/// (`zone` 0) or in the first window; in the second, its pieces with the
/// end zones swapped. Empty pieces are `(0, 0)`.
#[inline]
fn physical(o: u64, e: u64, size: u64, zone: u64) -> [(u64, u64); 3] {
    let half = size / 2;
    if zone == 0 || e <= half {
        [(o, e), (0, 0), (0, 0)]
    } else if o >= half {
        swapped(o - half, e - half, half, zone)
    } else {
        // Across the windows: never served, so it meets everything.
        [(0, half), (0, 0), (0, 0)]
    }
}

/// The pieces of `[o, e)` of an arena of `half` bytes with its end zones of
/// `zone` bytes swapped (`wasmem_plan_core::swap_zones`, without a
/// vector); empty pieces are `(0, 0)`.
#[inline]
fn swapped(o: u64, e: u64, half: u64, zone: u64) -> [(u64, u64); 3] {
    let shift = half - zone;
    let piece =
        |a: u64, b: u64, to: i128| if a < b { ((a as i128 + to) as u64, (b as i128 + to) as u64) } else { (0, 0) };
    [
        piece(o, e.min(zone), shift as i128),
        piece(o.max(zone), e.min(shift), 0),
        piece(o.max(shift), e.min(half), -(shift as i128)),
    ]
}

/// The block of `from`'s segment that holds offset `off`, found along the
/// links from `from` (the offset lies in the segment).
#[inline]
fn walk_to(blocks: &super::slab::Slab<Block>, from: u32, off: u64) -> (u32, Block) {
    let (mut blk, mut b) = (from, *blocks.get(from));
    while b.offset > off {
        blk = b.prev;
        b = *blocks.get(blk);
    }
    while b.offset + b.size <= off {
        blk = b.next;
        b = *blocks.get(blk);
    }
    (blk, b)
}

/// Whether `[lo, hi)` of `arena` lies within one free block (found from a
/// block hint of its 2 MiB, or the finger, along the links; the hint is
/// then that block).
fn free_span(blocks: &super::slab::Slab<Block>, arena: &mut Arena, lo: u64, hi: u64) -> bool {
    let mine = |b: u32| b != NIL && blocks.try_get(b).is_some_and(|x| x.segment == arena.seg);
    let near = arena.near.get((lo >> HINT_SPAN_LOG2) as usize).copied().unwrap_or(NIL);
    let (blk, b) = walk_to(blocks, if mine(near) { near } else { arena.finger }, lo);
    if let Some(n) = arena.near.get_mut((lo >> HINT_SPAN_LOG2) as usize) {
        *n = blk;
    }
    b.is_free() && b.offset + b.size >= hi
}

/// The offsets of an aliased plan of `phys` physical bytes as one plan
/// over its arena's two windows (`2 × phys` bytes): the second half's
/// requests (all of them for a first-step plan, which lies in the second
/// window) in window 1.
fn windows(offsets: &[Option<u64>], phys: u64, first_only: bool) -> Plan {
    let h = offsets.len() / 2;
    let shift = |k: usize| if first_only || k >= h { phys } else { 0 };
    Plan { arena_bytes: 2 * phys, offsets: offsets.iter().enumerate().map(|(k, o)| o.map(|o| o + shift(k))).collect() }
}

/// The first step's profile (as a plan cache keeps it) as its planner
/// sees it: what the step leaves live is live to its end, whenever a later
/// step freed it.
fn first_asked(profile: &StepProfile) -> StepProfile {
    let mut asked = StepProfile { step: profile.step, requests: profile.requests.clone() };
    let n = asked.requests.len() as u32;
    for r in asked.requests.iter_mut().filter(|r| r.freed_at.is_some()) {
        r.freed_at = r.freed_at.map(|f| f.min(n));
        r.wraps_to = None;
    }
    asked
}

/// What `plan` costs for `profile`: its arena, plus the planned bytes of
/// the requests it could place (known lifetimes) but leaves dynamic.
fn plan_cost(profile: &StepProfile, plan: &Plan) -> u64 {
    let reqs = &profile.requests;
    let left =
        (0..reqs.len()).filter(|&k| plan.offsets.get(k).is_none_or(Option::is_none) && reqs[k].plannable(k as u32));
    left.map(|k| reqs[k].planned_bytes()).fold(plan.arena_bytes, u64::saturating_add)
}

/// Bytes of the requests of `profile` live at its end past the allocation
/// of their own next instance (freed in the next step after its request of
/// the same index): no plan of one step can place them.
fn double_bytes(profile: &StepProfile) -> u64 {
    let reqs = &profile.requests;
    reqs.iter()
        .enumerate()
        .filter(|(k, r)| r.freed_at.is_none() && r.wraps_to.is_some_and(|w| w > *k as u32))
        .map(|(_, r)| r.planned_bytes())
        .sum()
}

/// The first-step plan `first` fitted to the steady plans `plans` (as the
/// cache file keeps it): in the second window of an aliased plan's arena
/// when one matches ([`aliased_first`]; the one most of whose second step
/// matches), else out of the way of a plain plan ([`aligned_first`]).
fn fitted_first(first: CachedPlan, plans: &[CachedPlan]) -> CachedPlan {
    let aliased = plans.iter().filter(|s| s.zone > 0).filter_map(|s| aliased_first(&first, s));
    if let Some((_, f)) = aliased.max_by_key(|(matched, _)| *matched) {
        return f;
    }
    // (One fitted to an aliased plan no longer cached is a plain plan of
    // its window's bytes.)
    aligned_first(CachedPlan { zone: 0, ..first }, plans)
}

/// The requests of `first` (its indices `rest`, in order) matched with
/// those of `steady` from the end, in order, skipping what only the first
/// step has (the first step of a training is a steady step plus the
/// parameters and optimizer states it creates, and what it does once):
/// pairs (request of `first`, request of `steady`), last first.
fn match_from_end(first: &[PlanRequest], rest: &[usize], steady: &[PlanRequest]) -> Vec<(usize, usize)> {
    let mut pairs = Vec::with_capacity(steady.len());
    let mut j = steady.len();
    for &k in rest.iter().rev() {
        if j == 0 {
            break;
        }
        if key(&first[k]) == key(&steady[j - 1]) {
            j -= 1;
            pairs.push((k, j));
        }
    }
    pairs
}

/// The requests of a first-step plan that are not persistent, in order.
fn not_persistent(first: &CachedPlan) -> Vec<usize> {
    let mut persistent = vec![false; first.profile.requests.len()];
    for &k in &first.persistent {
        persistent[k as usize] = true;
    }
    (0..persistent.len()).filter(|&k| !persistent[k]).collect()
}

/// Whether request `u` of `first` at `off` meets none of the matched
/// requests (at `offsets`) in both time and bytes.
fn apart_from_matched(
    first: &CachedPlan,
    u: usize,
    off: u64,
    pairs: &[(usize, usize)],
    offsets: &[Option<u64>],
) -> bool {
    let reqs = &first.profile.requests;
    let n = reqs.len() as u32;
    let live = |k: usize| {
        let (iv, m) = reqs[k].intervals(k as u32, n);
        iv.into_iter().take(m).filter(|(a, b)| a < b).collect::<Vec<_>>()
    };
    let lu = live(u);
    let (lo, hi) = (off, off + reqs[u].planned_bytes());
    !pairs.iter().any(|&(k, _)| {
        offsets[k].is_some_and(|o| {
            o < hi
                && lo < o + reqs[k].planned_bytes()
                && live(k).iter().any(|&(a, b)| lu.iter().any(|&(c, d)| a < d && c < b))
        })
    })
}

/// The lowest offset where request `u` of `profile` meets no placed
/// request (`offsets`) live with it.
fn lowest_gap(profile: &StepProfile, u: usize, offsets: &[Option<u64>]) -> u64 {
    let reqs = &profile.requests;
    let n = reqs.len() as u32;
    let live = |k: usize| {
        let (iv, m) = reqs[k].intervals(k as u32, n);
        iv.into_iter().take(m).filter(|(a, b)| a < b).collect::<Vec<_>>()
    };
    let lu = live(u);
    let mut taken: Vec<(u64, u64)> = (0..reqs.len())
        .filter(|&k| k != u)
        .filter_map(|k| offsets[k].map(|o| (k, o)))
        .filter(|&(k, _)| live(k).iter().any(|&(a, b)| lu.iter().any(|&(c, d)| a < d && c < b)))
        .map(|(k, o)| (o, o + reqs[k].planned_bytes()))
        .collect();
    taken.sort_unstable();
    let size = reqs[u].planned_bytes();
    let mut at = 0u64;
    for (o, e) in taken {
        if o >= at + size {
            break;
        }
        at = at.max(e);
    }
    at
}

/// The first-step plan `first` changed when the tensors it leaves live
/// into the next step (a loss, the last logits) would lie in the way of
/// that step's requests under a steady plan of `plans` whose requests its
/// own are: then its requests take that plan's offsets, so that what it
/// leaves lies where the steady plan expects it. The steady plan's
/// requests are matched from the end ([`match_from_end`]); those of
/// `first` no request matched keep their offsets where nothing matched
/// overlaps them, and are left to the dynamic path otherwise. `first`
/// unchanged when nothing is in the way, no plain plan matches at least
/// half of its requests, or the result fails [`validate_plan`].
fn aligned_first(first: CachedPlan, plans: &[CachedPlan]) -> CachedPlan {
    let reqs = &first.profile.requests;
    let rest = not_persistent(&first);
    let range = |off: u64, r: &PlanRequest| (off, off + r.planned_bytes());
    let apart = |(a0, a1): (u64, u64), (b0, b1): (u64, u64)| a1 <= b0 || b1 <= a0;
    for s in plans.iter().filter(|s| s.zone == 0) {
        let steady = &s.profile.requests;
        let pairs = match_from_end(reqs, &rest, steady);
        if pairs.len() * 2 < steady.len().max(1) {
            continue;
        }
        // In the way: a tensor left live (planned in `first`, wrapping in
        // `s`) overlaps a request `s` serves before that tensor is freed.
        let in_way = pairs.iter().any(|&(k, j)| {
            let (Some(off), Some(w)) = (first.plan.offsets[k], steady[j].wraps_to) else { return false };
            let left = range(off, &reqs[k]);
            (0..(w as usize).min(steady.len()))
                .any(|i| s.plan.offsets[i].is_some_and(|o| !apart(left, range(o, &steady[i]))))
        });
        if !in_way {
            return first;
        }
        let mut offsets = first.plan.offsets.clone();
        let mut matched = vec![false; reqs.len()];
        for &(k, j) in &pairs {
            offsets[k] = s.plan.offsets[j];
            matched[k] = true;
        }
        // What only the first step has keeps its offset unless it meets a
        // matched request in time and in bytes; then it goes to the lowest
        // gap that holds it among the requests live with it (above them
        // when none does: the arena grows, by less than the request, which
        // would be beside the arena in the first step).
        let mut arena = s.plan.arena_bytes.max(first.plan.arena_bytes);
        let unmatched: Vec<usize> = rest.iter().copied().filter(|&u| !matched[u]).collect();
        for &u in &unmatched {
            if offsets[u].is_some_and(|off| !apart_from_matched(&first, u, off, &pairs, &offsets)) {
                offsets[u] = None;
            }
        }
        for &u in &unmatched {
            if offsets[u].is_some() || first.plan.offsets[u].is_none() {
                continue;
            }
            let at = lowest_gap(&first.profile, u, &offsets);
            offsets[u] = Some(at);
            arena = arena.max(at + first.profile.requests[u].planned_bytes());
        }
        let plan = Plan { arena_bytes: arena, offsets };
        if validate_plan(&first.profile, &plan, u64::MAX).is_ok() {
            return CachedPlan { plan, ..first };
        }
    }
    first
}

/// The first-step plan `first` in the second window of the arena of `s`,
/// an aliased plan of two steps: where the step before a pair lies, so
/// that the arena the first step used serves the first pair as it is (its
/// first step in the first window, around what the first step left live).
/// The requests of `first` take the offsets of those of the pair's second
/// step they match ([`match_from_end`]); what only the first step has keeps
/// its own offset where it lies in the window and meets no matched request
/// in time and bytes. A tensor it leaves live (freed after its end, see
/// [`Planning::first_for_planning`]) keeps its offset only where its
/// physical memory is apart from every range of the pair allocated before
/// it is freed there. Offsets are of the second window (`[0, phys)`,
/// physical through its swapped zones); with the number of matched
/// requests, or `None` when fewer than half of the second step's match or
/// the result is no valid plan.
fn aliased_first(first: &CachedPlan, s: &CachedPlan) -> Option<(usize, CachedPlan)> {
    let (phys, zone) = (s.plan.arena_bytes, s.zone);
    let reqs = &first.profile.requests;
    let n = reqs.len() as u32;
    let (steady, h) = (&s.profile.requests, s.profile.requests.len() / 2);
    let rest = not_persistent(first);
    let pairs: Vec<(usize, usize)> =
        match_from_end(reqs, &rest, &steady[h..]).into_iter().map(|(k, j)| (k, j + h)).collect();
    if pairs.len() * 2 < (steady.len() - h).max(1) {
        return None;
    }
    let mut offsets = vec![None; reqs.len()];
    // When the pair's second step frees the matched request's own instance
    // in the next pair (it is left live there too).
    let mut steady_wrap = vec![None; reqs.len()];
    let mut matched = vec![false; reqs.len()];
    for &(k, j) in &pairs {
        offsets[k] = s.plan.offsets[j];
        steady_wrap[k] = steady[j].wraps_to.filter(|_| steady[j].freed_at.is_none());
        matched[k] = true;
    }
    for &u in rest.iter().filter(|&&u| !matched[u]) {
        if let Some(off) = first.plan.offsets[u].filter(|&o| o + reqs[u].planned_bytes() <= phys) {
            if apart_from_matched(first, u, off, &pairs, &offsets) {
                offsets[u] = Some(off);
            }
        }
    }
    // What it may leave live into the pair, until the pair's request the
    // next step freed it before (as that step did, else as the second
    // step's own instance is, else never): apart, physically, from every
    // range of the pair allocated before then (its first step's in window
    // 0, physical as is; its second's in window 1).
    let pair_range = |i: usize, o: u64| {
        let e = o + steady[i].planned_bytes();
        if i < h {
            [(o, e), (0, 0), (0, 0)]
        } else {
            swapped(o, e, phys, zone)
        }
    };
    for k in 0..reqs.len() {
        let Some(off) = offsets[k] else { continue };
        if reqs[k].freed_at.is_some_and(|f| f <= n) {
            continue;
        }
        let until = reqs[k].wraps_to.or(steady_wrap[k]).map_or(steady.len(), |w| (w as usize).min(steady.len()));
        let mine = swapped(off, off + reqs[k].planned_bytes(), phys, zone);
        let meets = (0..until).any(|i| {
            s.plan.offsets[i].is_some_and(|o| {
                pair_range(i, o)
                    .into_iter()
                    .any(|(a, b)| a < b && mine.iter().any(|&(lo, hi)| lo < hi && lo < b && a < hi))
            })
        });
        if meets {
            offsets[k] = None;
        }
    }
    let plan = Plan { arena_bytes: phys, offsets };
    if plan.planned() == 0 || validate_plan(&first.profile, &plan, u64::MAX).is_err() {
        return None;
    }
    Some((pairs.len(), CachedPlan { plan, zone, ..first.clone() }))
}

/// The time to install a plan: the request before which the fewest planned
/// bytes are live (the earliest of equals), and those bytes.
pub(crate) fn install_point(requests: &[PlanRequest], offsets: &[Option<u64>]) -> (usize, u64) {
    let during = cycle_live(requests, offsets);
    during
        .iter()
        .enumerate()
        .map(|(t, &l)| {
            // Before request t is served: without request t itself.
            let own = if offsets[t].is_some() { requests[t].planned_bytes() } else { 0 };
            (t, l - own)
        })
        .min_by_key(|&(t, l)| (l, t))
        .unwrap_or((0, 0))
}

/// Splits `blk` after its first `at` bytes; returns the new block (the rest),
/// which is free and linked after `blk`.
fn split(blocks: &mut super::slab::Slab<Block>, blk: u32, at: u64) -> u32 {
    let b = *blocks.get(blk);
    debug_assert!(at > 0 && at < b.size);
    let rest = blocks.insert(Block {
        segment: b.segment,
        offset: b.offset + at,
        size: b.size - at,
        prev: blk,
        next: b.next,
        tensor: NIL,
    });
    if b.next != NIL {
        blocks.get_mut(b.next).prev = rest;
    }
    let m = blocks.get_mut(blk);
    m.next = rest;
    m.size = at;
    rest
}

#[cfg(test)]
mod tests {
    use super::{aliased_first, aligned_first, CachedPlan};
    use crate::alloc::Allocator;
    use crate::decision::validate_aliased;
    use crate::decision::{validate_plan, Plan, PlanRequest, StepProfile};
    use crate::device::sim::{SimConfig, SimDevice};
    use crate::types::MIB;
    use crate::types::{Phase, StreamId, TensorId, TensorKind, GIB, KIB};

    fn req(bytes: u64, kind: TensorKind, freed_at: Option<u32>, wraps_to: Option<u32>) -> PlanRequest {
        PlanRequest { bytes, kind, stream: StreamId(0), freed_at, wraps_to }
    }

    /// A steady step `[temp, act]` whose activation lives into the next
    /// step until its request 1, and a first step `[param, extra, temp,
    /// act]` planned with its activation over where the steady plan puts
    /// the temporary the next step starts with.
    fn first_and_steady(act_at: u64, extra_at: u64) -> (CachedPlan, CachedPlan) {
        let (t, a) = (req(MIB, TensorKind::Temp, Some(1), None), req(2 * MIB, TensorKind::Activation, None, Some(1)));
        let steady = CachedPlan {
            profile: StepProfile { step: 1, requests: vec![t, a] },
            plan: Plan { arena_bytes: 3 * MIB, offsets: vec![Some(2 * MIB), Some(0)] },
            persistent: vec![],
            zone: 0,
            searched: 0,
        };
        let requests = vec![
            req(4 * MIB, TensorKind::Param, None, None),
            req(MIB, TensorKind::Other, Some(3), None),
            PlanRequest { freed_at: Some(3), ..t },
            PlanRequest { freed_at: Some(4), wraps_to: None, ..a },
        ];
        let first = CachedPlan {
            profile: StepProfile { step: 0, requests },
            plan: Plan { arena_bytes: 4 * MIB, offsets: vec![None, Some(extra_at), Some(0), Some(act_at)] },
            persistent: vec![0],
            zone: 0,
            searched: 0,
        };
        validate_plan(&first.profile, &first.plan, u64::MAX).unwrap();
        validate_plan(&steady.profile, &steady.plan, u64::MAX).unwrap();
        (first, steady)
    }

    #[test]
    fn what_the_first_step_leaves_live_is_moved_out_of_the_next_steps_way() {
        // In the way ([MIB, 3 MIB) holds the steady temporary's [2, 3) MIB):
        // the matched requests take the steady offsets; the extra request,
        // which meets none of them, keeps its own.
        let (first, steady) = first_and_steady(MIB, 3 * MIB);
        let a = aligned_first(first.clone(), std::slice::from_ref(&steady));
        assert_eq!(a.plan.offsets, vec![None, Some(3 * MIB), Some(2 * MIB), Some(0)]);
        validate_plan(&a.profile, &a.plan, u64::MAX).unwrap();
        // An extra request that would meet a moved one goes to the lowest
        // gap among the requests live with it (here under the last one,
        // which comes after it is freed).
        let (first, steady) = first_and_steady(MIB, 2 * MIB);
        let a = aligned_first(first, std::slice::from_ref(&steady));
        assert_eq!(a.plan.offsets, vec![None, Some(0), Some(2 * MIB), Some(0)]);
        validate_plan(&a.profile, &a.plan, u64::MAX).unwrap();
        // Out of the way already: unchanged.
        let (first, steady) = first_and_steady(0, 3 * MIB);
        assert_eq!(aligned_first(first.clone(), std::slice::from_ref(&steady)), first);
        // A steady plan of another step: unchanged.
        let other = CachedPlan {
            profile: StepProfile { step: 1, requests: vec![req(7 * MIB, TensorKind::Temp, Some(1), None)] },
            plan: Plan { arena_bytes: 7 * MIB, offsets: vec![Some(0)] },
            persistent: vec![],
            zone: 0,
            searched: 0,
        };
        let (first, _) = first_and_steady(MIB, 3 * MIB);
        assert_eq!(aligned_first(first.clone(), &[other]), first);
    }

    #[test]
    fn the_first_step_of_a_kept_output_loop_lies_in_the_second_window() {
        // A pair [t, out | t, out] (2 MiB zones of a 6 MiB arena): each
        // output at 0 of its window (physical low zone, then high), live
        // into the next step; the temporaries in the middle.
        let (t, out) = (TensorKind::Temp, TensorKind::Activation);
        let pair = CachedPlan {
            profile: StepProfile {
                step: 1,
                requests: vec![
                    req(MIB, t, Some(1), None),
                    req(2 * MIB, out, Some(4), None),
                    req(MIB, t, Some(3), None),
                    req(2 * MIB, out, None, Some(2)),
                ],
            },
            plan: Plan { arena_bytes: 6 * MIB, offsets: vec![Some(2 * MIB), Some(0), Some(2 * MIB), Some(0)] },
            persistent: vec![],
            zone: 2 * MIB,
            searched: 0,
        };
        let a = pair.aliased().unwrap();
        validate_aliased(&pair.profile, &a, 2 * MIB, u64::MAX).unwrap();
        // The first step: a parameter, the step's requests and an extra
        // buffer, both left live (freed after its end: at 5 of 4), planned
        // plainly; the next step frees the buffer before its request
        // `extra_until` when given.
        let first = |extra_at: u64, extra_until: Option<u32>| CachedPlan {
            profile: StepProfile {
                step: 0,
                requests: vec![
                    req(4 * MIB, TensorKind::Param, None, None),
                    req(MIB, t, Some(2), None),
                    req(2 * MIB, out, Some(5), None),
                    req(MIB, TensorKind::Other, Some(5), extra_until),
                ],
            },
            plan: Plan { arena_bytes: 5 * MIB, offsets: vec![None, Some(0), Some(MIB), Some(extra_at)] },
            persistent: vec![0],
            zone: 0,
            searched: 0,
        };
        // The output takes the pair's second output's offset (window 1:
        // physical high zone), the temporary its; the extra buffer, at 3 MiB
        // of window 1 (physical middle), meets nothing of the pair and
        // keeps its offset.
        let (matched, f) = aliased_first(&first(3 * MIB, None), &pair).unwrap();
        assert_eq!(matched, 2);
        assert_eq!((f.zone, f.plan.arena_bytes), (2 * MIB, 6 * MIB));
        assert_eq!(f.plan.offsets, vec![None, Some(2 * MIB), Some(0), Some(3 * MIB)]);
        validate_plan(&f.profile, &f.plan, u64::MAX).unwrap();
        // At 4 MiB of window 1 it lies in the physical low zone, where the
        // pair's first output goes while it is still live: dynamic ...
        let (_, f) = aliased_first(&first(4 * MIB, None), &pair).unwrap();
        assert_eq!(f.plan.offsets, vec![None, Some(2 * MIB), Some(0), None]);
        // ... unless the next step frees it before that output comes.
        let (_, g) = aliased_first(&first(4 * MIB, Some(1)), &pair).unwrap();
        assert_eq!(g.plan.offsets, vec![None, Some(2 * MIB), Some(0), Some(4 * MIB)]);
        // Freed at the step's end (4 of 4), it is no concern of the pair.
        let mut freed = first(4 * MIB, None);
        freed.profile.requests[3].freed_at = Some(4);
        assert_eq!(aliased_first(&freed, &pair).unwrap().1.plan.offsets[3], Some(4 * MIB));
        // Fitted again, the result is the same (the cache is rewritten each run).
        let (_, again) = aliased_first(&f, &pair).unwrap();
        assert_eq!(again, f);
        // A pair of other requests: no fit.
        let other = CachedPlan {
            profile: StepProfile {
                step: 1,
                requests: vec![req(3 * MIB, t, Some(1), None), req(3 * MIB, t, Some(2), None)],
            },
            ..pair.clone()
        };
        assert!(aliased_first(&first(3 * MIB, None), &other).is_none());
    }

    /// With a cache of two entries, most planned ranges are found by the
    /// finger, the block hints and the links: a training-like step with
    /// deviations (extra, missing, resized requests) still gets its hits,
    /// every tensor keeps its contents and the invariants hold throughout.
    #[test]
    fn planned_ranges_are_found_when_the_start_cache_misses() {
        let dev = SimDevice::new(SimConfig { capacity: GIB, host_backed: true, ..SimConfig::default() });
        let mut a = Allocator::with_builtin(dev, "planned").unwrap();
        let layers = 24u64;
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut rand = move |m: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % m
        };
        let mut seed = 0u8;
        let mut live: Vec<(TensorId, u64, u8)> = Vec::new();
        let check = |a: &mut Allocator<SimDevice>, live: &[(TensorId, u64, u8)]| {
            for &(id, bytes, s) in live {
                let mut got = vec![0u8; 16];
                a.read(id, bytes - 16, &mut got).unwrap();
                assert!(got.iter().all(|&b| b == s), "contents of {id} lost");
            }
            a.check_invariants().unwrap();
        };
        for step in 0..10u64 {
            let deviate = step >= 6;
            let before = a.stats();
            let mut acts = Vec::new();
            for l in 0..layers {
                if deviate && rand(5) == 0 {
                    continue; // a missing activation
                }
                let extra = if deviate && rand(4) == 0 { 4 * KIB } else { 0 }; // resized
                let bytes = 64 * KIB + l * 8 * KIB + extra;
                let id = a.alloc(bytes, TensorKind::Activation, StreamId(0)).unwrap();
                seed = seed.wrapping_add(1);
                a.write(id, bytes - 16, &[seed; 16]).unwrap();
                acts.push((id, bytes, seed));
                let wobble = if deviate { rand(3) * KIB } else { 0 };
                let t = a.alloc(32 * KIB + wobble, TensorKind::Temp, StreamId(0)).unwrap();
                if deviate && rand(3) == 0 {
                    // an extra request, freed at once
                    let e = a.alloc(20 * KIB, TensorKind::Temp, StreamId(0)).unwrap();
                    a.free(e).unwrap();
                }
                a.free(t).unwrap();
                live.clone_from(&acts);
                check(&mut a, &live);
            }
            while let Some((id, ..)) = acts.pop() {
                let t = a.alloc(48 * KIB, TensorKind::Temp, StreamId(0)).unwrap();
                a.free(id).unwrap();
                a.free(t).unwrap();
                live.clone_from(&acts);
                check(&mut a, &live);
            }
            a.phase(Phase::StepEnd, step).unwrap();
            a.check_invariants().unwrap();
            let d = a.stats().minus(&before);
            if (2..6).contains(&step) {
                // Served from the plan of the step before: every request a hit.
                assert_eq!((d.plan_hits, d.plan_misses), (3 * layers, 0), "step {step}");
            }
        }
        let s = a.stats();
        assert!(s.plans >= 1 && s.plan_hits > 16 * layers, "{s:?}");
        assert_eq!(s.ooms, 0);
    }

    #[test]
    fn a_step_too_long_to_profile_is_dropped_not_kept() {
        // No step end for more than `MAX_PROFILE` requests: the profile
        // stays bounded, that step is not planned, and the steps after it
        // are planned as usual.
        let dev = SimDevice::new(SimConfig { capacity: GIB, ..SimConfig::default() });
        let mut a = Allocator::with_builtin(dev, "planned").unwrap();
        let mut held = None;
        for k in 0..super::MAX_PROFILE + 1000 {
            let id = a.alloc(4 * KIB + (k as u64 % 7) * 512, TensorKind::Temp, StreamId(0)).unwrap();
            if let Some(old) = held.replace(id) {
                a.free(old).unwrap();
            }
            assert!(a.planning.as_ref().unwrap().current.len() <= super::MAX_PROFILE);
        }
        assert!(a.planning.as_ref().unwrap().overflowed);
        a.free(held.take().unwrap()).unwrap();
        a.phase(Phase::StepEnd, 0).unwrap();
        assert_eq!(a.stats().plans, 0);
        assert!(!a.planning.as_ref().unwrap().overflowed);
        for step in 1..6 {
            let ids: Vec<TensorId> =
                (0..8).map(|k| a.alloc(MIB + k * 4096, TensorKind::Activation, StreamId(0)).unwrap()).collect();
            for id in ids {
                a.free(id).unwrap();
            }
            a.phase(Phase::StepEnd, step).unwrap();
        }
        assert!(a.stats().plans >= 1 && a.stats().plan_hits > 0, "{:?}", a.stats());
        a.check_invariants().unwrap();
    }
}
