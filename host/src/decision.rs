//! Decision points: the traits a policy implements, and the decision values it returns.
//!
//! The engine asks; the policy advises; the engine checks and decides. Every
//! decision is a plain value. The allocator validates it against its own state
//! ([`PlacementDecision::validate`], [`validate_victims`], …) and, when a decision is
//! invalid or the policy failed ([`PolicyError`]), counts a fallback and takes the
//! built-in default's decision for that one call. A policy therefore can never
//! lose or corrupt a tensor.
//!
//! Native Rust policies (in [`crate::builtin`]) and WebAssembly policies (the
//! policy runtime) implement the same traits, so they are interchangeable.

use std::fmt;
use std::sync::Arc;

use crate::types::{Phase, StreamId, TensorId, TensorKind, Tier, GIB};

/// A pool a placement policy wants the allocator to keep.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolSpec {
    /// Name; pools are matched by name across policy swaps.
    pub name: String,
    /// Release a segment to the device as soon as all of its blocks are free
    /// (no caching). Used by the `naive` baseline.
    pub release_when_empty: bool,
}

impl PoolSpec {
    /// A caching pool named `name`.
    pub fn caching(name: &str) -> Self {
        PoolSpec { name: name.to_string(), release_when_empty: false }
    }
}

/// A snapshot of the allocator's state that policies may read.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PolicyContext {
    /// Logical clock: number of allocator operations so far (never the wall clock).
    pub clock: u64,
    /// Current training phase (forward until the first marker).
    pub phase: Option<Phase>,
    /// Current training step.
    pub step: u64,
    /// Requested bytes of live tensors.
    pub live_bytes: u64,
    /// Bytes in blocks handed out.
    pub allocated_bytes: u64,
    /// Bytes obtained from the device.
    pub reserved_bytes: u64,
    /// Peak of `reserved_bytes` so far (the high-water mark).
    pub peak_reserved_bytes: u64,
    /// Device capacity in bytes.
    pub capacity_bytes: u64,
}

/// One allocation request, as a placement policy sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AllocRequest {
    /// Requested size in bytes (> 0).
    pub bytes: u64,
    /// What the tensor holds.
    pub kind: TensorKind,
    /// Stream the tensor is allocated on.
    pub stream: StreamId,
}

/// Where and how to place one allocation.
///
/// The allocator rounds the request to `round_to`, looks for the best-fitting
/// free block of the chosen pool on the request's stream, and if there is none
/// obtains a new segment of `max(segment_min, round_up(rounded, segment_round))`
/// bytes. A block is split when at least `split_min_remainder` bytes would remain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlacementDecision {
    /// Index into the policy's own [`PlacementPolicy::pools`] list.
    pub pool: u32,
    /// Block granularity: a power of two between 1 and 1 GiB.
    pub round_to: u64,
    /// Smallest new segment, in bytes (0: just the rounded request).
    pub segment_min: u64,
    /// New segments are a multiple of this: a power of two between 1 and 1 GiB.
    pub segment_round: u64,
    /// Split a larger free block when the remainder is at least this many bytes
    /// (≥ 1; `u64::MAX` never splits).
    pub split_min_remainder: u64,
    /// Do not serve the request from a cached block larger than
    /// `rounded + max_waste` bytes (`u64::MAX`: any block fits).
    pub max_waste: u64,
    /// The same decision holds for every request with the same
    /// (kind, size class, stream, phase), so the engine may memoize it.
    pub cacheable: bool,
}

/// Why a decision was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidDecision(pub String);

impl fmt::Display for InvalidDecision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Largest `round_to` / `segment_round` a decision may ask for.
pub const MAX_GRANULARITY: u64 = GIB;

impl PlacementDecision {
    /// Checks the decision for a request against a policy with `pool_count`
    /// pools and returns `(rounded block bytes, new segment bytes)`.
    #[inline]
    pub fn validate(&self, req: &AllocRequest, pool_count: usize) -> Result<(u64, u64), InvalidDecision> {
        let granular = |v: u64| v.is_power_of_two() && v <= MAX_GRANULARITY;
        if (self.pool as usize) >= pool_count
            || !granular(self.round_to)
            || !granular(self.segment_round)
            || self.split_min_remainder == 0
        {
            return Err(self.diagnose(pool_count));
        }
        let rounded = crate::types::round_up(req.bytes, self.round_to)
            .ok_or_else(|| InvalidDecision(format!("rounding {} bytes overflows", req.bytes)))?;
        let segment = crate::types::round_up(rounded, self.segment_round)
            .ok_or_else(|| InvalidDecision(format!("segment for {rounded} bytes overflows")))?
            .max(self.segment_min);
        Ok((rounded, segment))
    }

    /// Words the first failed field check of [`PlacementDecision::validate`]
    /// (kept off the hot path).
    #[cold]
    #[inline(never)]
    fn diagnose(&self, pool_count: usize) -> InvalidDecision {
        if self.pool as usize >= pool_count {
            return InvalidDecision(format!("pool {} does not exist (the policy declares {pool_count})", self.pool));
        }
        for (field, v) in [("round_to", self.round_to), ("segment_round", self.segment_round)] {
            if !v.is_power_of_two() || v > MAX_GRANULARITY {
                return InvalidDecision(format!("{field} = {v} is not a power of two between 1 and {MAX_GRANULARITY}"));
            }
        }
        InvalidDecision("split_min_remainder must be at least 1".into())
    }
}

/// The placement decision point: pools, rounding, segment growth, splitting.
pub trait PlacementPolicy: Send {
    /// Name for logs and reports.
    fn name(&self) -> &str;
    /// The pools this policy places into; decisions index this list.
    fn pools(&self) -> Vec<PoolSpec>;
    /// Decides where and how to place `req`.
    fn place(&mut self, req: &AllocRequest, ctx: &PolicyContext) -> Result<PlacementDecision, PolicyError>;
    /// Whether the engine should memoize decisions marked `cacheable` (worth
    /// it when a call is expensive, e.g. into WebAssembly).
    fn memoizable(&self) -> bool {
        false
    }
    /// Whether a call costs enough (a WebAssembly call: hundreds of
    /// nanoseconds or more) that the engine times every one for the
    /// `policy_call_p50_ns`/`p99_ns` metrics. `false` (the default, for
    /// native policies): the engine times one call in 64 and counts it for
    /// the 64, so timing stays off the hot path.
    fn time_every_call(&self) -> bool {
        false
    }
    /// The learned state behind this role, if the policy can hand it to a
    /// successor at a hot swap (see [`PolicyState`]).
    fn state(&self) -> Option<StateHandle> {
        None
    }
}

/// What made the engine consult the reclamation policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReclaimTrigger {
    /// The device could not provide a new segment of `segment_bytes` for `request`.
    AllocFailed {
        /// The request being served.
        request: AllocRequest,
        /// Size of the segment the device refused.
        segment_bytes: u64,
    },
    /// The pool chosen for `request` has no fitting free block: the engine is
    /// about to obtain a new segment of `segment_bytes`. Cached memory released
    /// now keeps the reserved total from growing.
    Grow {
        /// The request being served.
        request: AllocRequest,
        /// Size of the segment about to be obtained.
        segment_bytes: u64,
    },
    /// A phase marker was reached.
    Phase {
        /// The new phase.
        phase: Phase,
        /// The step it belongs to.
        step: u64,
    },
}

/// How much cached memory to give back to the device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReclaimDecision {
    /// Release fully free cached segments, largest first, until at least this
    /// many bytes are released (0: none; `u64::MAX`: all).
    pub release_bytes: u64,
    /// Only from these pools (indices into the placement policy's pools are
    /// not known here: engine-wide pool names); `None` = every pool.
    pub pools: Option<Vec<String>>,
    /// Also compact this pool, copying at most this many bytes (see
    /// `Allocator::compact`). Valid when the pool exists and the budget is at
    /// most the pool's allocated bytes; otherwise the whole decision is refused.
    pub compact: Option<(String, u64)>,
    /// On a `Grow` or `AllocFailed` trigger: build the new segment by stitching
    /// free physical pages of the pool's paged segments into one new virtual
    /// range (fresh pages only for what is missing) instead of obtaining a
    /// whole new segment. Ignored on `Phase` triggers and when the pool has no
    /// paged segments (see [`ReclamationPolicy::paged_segments`]).
    pub stitch: bool,
    /// Let `release_bytes` also come from free whole pages inside paged
    /// segments that still hold tensors (they are unmapped and released, the
    /// segment is cut around them), not only from entirely free segments.
    /// Such releases never synchronize the device.
    pub trim: bool,
}

impl ReclaimDecision {
    /// Release nothing.
    pub fn none() -> Self {
        ReclaimDecision { release_bytes: 0, pools: None, compact: None, stitch: false, trim: false }
    }
    /// Release every fully free cached segment.
    pub fn all() -> Self {
        ReclaimDecision { release_bytes: u64::MAX, pools: None, compact: None, stitch: false, trim: false }
    }
}

/// The reclamation decision point: when and how much cached memory to release.
pub trait ReclamationPolicy: Send {
    /// Name for logs and reports.
    fn name(&self) -> &str;
    /// Decides what to release after `trigger`.
    fn reclaim(&mut self, trigger: &ReclaimTrigger, ctx: &PolicyContext) -> Result<ReclaimDecision, PolicyError>;
    /// Whether large segments should be built from individually mapped
    /// physical pages (virtual memory API) while this policy is active, so
    /// that `stitch` and `trim` decisions can act on them. Read when the
    /// policy is installed; segments keep the form they were created with.
    fn paged_segments(&self) -> bool {
        false
    }
    /// Whether a call costs enough (a WebAssembly call: hundreds of
    /// nanoseconds or more) that the engine times every one for the
    /// `policy_call_p50_ns`/`p99_ns` metrics. `false` (the default, for
    /// native policies): the engine times one call in 64 and counts it for
    /// the 64, so timing stays off the hot path.
    fn time_every_call(&self) -> bool {
        false
    }
    /// The learned state behind this role (see [`PolicyState`]).
    fn state(&self) -> Option<StateHandle> {
        None
    }
}

/// A tensor the engine offers for eviction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EvictionCandidate {
    /// The tensor.
    pub id: TensorId,
    /// Its size in bytes.
    pub bytes: u64,
    /// What it holds.
    pub kind: TensorKind,
    /// Where it is now.
    pub tier: Tier,
    /// Logical clock of its last use (or allocation).
    pub last_use: u64,
    /// Number of uses so far.
    pub use_count: u64,
    /// Resolved by a client right now: must not move.
    pub in_use: bool,
    /// Pinned by the client: must not move.
    pub pinned: bool,
    /// Phase of its last use (engine-side only: not passed to WebAssembly policies).
    pub phase: Option<Phase>,
    /// Position of its next use in the workload (`Some(u64::MAX)`: never
    /// again), known only to a replay with look-ahead (see
    /// [`EvictionPolicy::needs_future`]); engine-side only.
    pub next_use: Option<u64>,
}

impl EvictionCandidate {
    /// Whether the engine may move this tensor.
    pub fn evictable(&self) -> bool {
        !self.in_use && !self.pinned
    }
}

/// The eviction decision point: which tensors to move off the device.
pub trait EvictionPolicy: Send {
    /// Name for logs and reports.
    fn name(&self) -> &str;
    /// Picks victims among `candidates` covering at least `need_bytes`.
    fn choose_victims(
        &mut self,
        need_bytes: u64,
        candidates: &[EvictionCandidate],
        ctx: &PolicyContext,
    ) -> Result<Vec<TensorId>, PolicyError>;

    /// Orders off-device tensors (`offloaded`, their `tier` not `Device`) for
    /// prefetch at a phase boundary, soonest needed first. `None` (the
    /// default): the engine's own order (most recently evicted first). The
    /// engine validates the answer like a victim list and ignores an invalid one.
    fn prefetch_order(&mut self, _offloaded: &[EvictionCandidate], _ctx: &PolicyContext) -> Option<Vec<TensorId>> {
        None
    }
    /// Whether a call costs enough (a WebAssembly call: hundreds of
    /// nanoseconds or more) that the engine times every one for the
    /// `policy_call_p50_ns`/`p99_ns` metrics. `false` (the default, for
    /// native policies): the engine times one call in 64 and counts it for
    /// the 64, so timing stays off the hot path.
    fn time_every_call(&self) -> bool {
        false
    }

    /// Whether the policy reads the workload's future (`next_use`): an
    /// offline policy, whose results are a bound for comparisons, not
    /// something a live engine can achieve. A replay then pre-scans the trace.
    fn needs_future(&self) -> bool {
        false
    }

    /// The learned state behind this role (see [`PolicyState`]).
    fn state(&self) -> Option<StateHandle> {
        None
    }
}

/// Checks a victim list: every victim offered, evictable, and listed once.
/// Returns the total bytes the victims free.
pub fn validate_victims(candidates: &[EvictionCandidate], victims: &[TensorId]) -> Result<u64, InvalidDecision> {
    let mut seen = rustc_hash::FxHashSet::default();
    let mut total = 0u64;
    for v in victims {
        let c = candidates
            .iter()
            .find(|c| c.id == *v)
            .ok_or_else(|| InvalidDecision(format!("victim {v} was not offered")))?;
        if !c.evictable() {
            return Err(InvalidDecision(format!("victim {v} is in use or pinned")));
        }
        if !seen.insert(*v) {
            return Err(InvalidDecision(format!("victim {v} is listed twice")));
        }
        total = total.saturating_add(c.bytes);
    }
    Ok(total)
}

/// Alignment of every planned offset (and the rounding of every planned request).
pub const PLAN_ALIGN: u64 = wasmem_plan_core::ALIGN;

/// One request of a profiled step, as a planner sees it. Time is counted in
/// requests: request `k` is allocated at time `k`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PlanRequest {
    /// Requested bytes (the planned block is this, rounded up to [`PLAN_ALIGN`]).
    pub bytes: u64,
    /// What the tensor holds.
    pub kind: TensorKind,
    /// Its stream.
    pub stream: StreamId,
    /// The time it was freed: the index of the first request allocated
    /// after its free; `None`: still live at the end of the step.
    pub freed_at: Option<u32>,
    /// For a tensor live at the step's end: the time in the *next* step at
    /// which the same request of the previous step was freed (the step is a
    /// cycle: request `k` then occupies `[k, end) ∪ [0, wraps_to)`); `None`:
    /// not known (it was never freed, or there was no previous step).
    pub wraps_to: Option<u32>,
}

impl PlanRequest {
    /// The same request in the plain types of the planning algorithm
    /// (`wasmem-plan-core`, shared with the policy SDK).
    pub fn core(&self) -> wasmem_plan_core::Request {
        wasmem_plan_core::Request { bytes: self.bytes, freed_at: self.freed_at, wraps_to: self.wraps_to }
    }

    /// The bytes a planned block of this request takes.
    pub fn planned_bytes(&self) -> u64 {
        self.core().planned_bytes()
    }

    /// Whether request `k` (this one) has a known lifetime in the step's
    /// cycle: freed within the step, or live at the end and freed in the
    /// next step before that step's request `k` (otherwise two instances of
    /// it would be live at once). Only such requests can be planned.
    pub fn plannable(&self, k: u32) -> bool {
        self.core().plannable(k)
    }

    /// The time intervals it occupies in the cycle of a step of `n` requests
    /// (`k`: its index): one, or two when it wraps.
    pub fn intervals(&self, k: u32, n: u32) -> ([(u32, u32); 2], usize) {
        self.core().intervals(k, n)
    }
}

/// The profile of one step: its requests in order.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StepProfile {
    /// The step that was profiled.
    pub step: u64,
    /// Its requests, in allocation order.
    pub requests: Vec<PlanRequest>,
}

/// Where each request of a step goes in one arena.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Plan {
    /// Bytes of the arena.
    pub arena_bytes: u64,
    /// An offset in the arena for each request of the profile, in order;
    /// `None`: not planned (served by the dynamic path).
    pub offsets: Vec<Option<u64>>,
}

impl Plan {
    /// Number of planned requests.
    pub fn planned(&self) -> usize {
        self.offsets.iter().filter(|o| o.is_some()).count()
    }
}

/// A plan of two like steps in an aliased arena: one physical arena of
/// `arena_bytes` mapped at two virtual windows, the second with its end
/// zones of `zone_bytes` swapped; request `k` of the profile's first half at
/// `offsets[k]` of window 0, request `k + n/2` at `offsets[k + n/2]` of
/// window 1 (see `wasmem_plan_core::aliased`).
pub use wasmem_plan_core::AliasedPlan;

/// The planning decision point: at a step boundary, a plan for the steps
/// that repeat the profiled one.
pub trait PlannerPolicy: Send {
    /// Name for logs and reports.
    fn name(&self) -> &str;
    /// A plan for `profile` (one offset per request, or none).
    fn plan(&mut self, profile: &StepProfile, ctx: &PolicyContext) -> Result<Plan, PolicyError>;
    /// For a profile of two like training steps (the engine plans two at a
    /// time when a step's output outlives its next instance): a plan in an
    /// aliased arena ([`AliasedPlan`]), or `None` (the default: the plain
    /// plan of [`PlannerPolicy::plan`] serves). An error refuses it and
    /// counts as a failure of the planner. WIT `planner.plan-aliased`
    /// (0.4.0); a planner component of 0.3.0 makes none.
    fn plan_aliased(&mut self, profile: &StepProfile, ctx: &PolicyContext) -> Result<Option<AliasedPlan>, PolicyError> {
        let _ = (profile, ctx);
        Ok(None)
    }
    /// At a step end that `plan`, a plan of `profile`, served, while a
    /// plan cache keeps it: searches on for a cheaper plan of that profile,
    /// as long as planning it took at most (a step's spare time, spent on
    /// the plans the next run of the training starts from; `plan` may come
    /// from an earlier run's cache, and `searched` says how many such calls
    /// were spent on it before, in this run and earlier ones). The engine validates a
    /// [`Refined::Better`] plan like any other and keeps it for the cache
    /// only when it costs less (the run itself goes on with the plan it
    /// serves). The default: [`Refined::Done`] (no search to go on).
    fn refine(
        &mut self,
        profile: &StepProfile,
        plan: &Plan,
        searched: u64,
        ctx: &PolicyContext,
    ) -> Result<Refined, PolicyError> {
        let _ = (profile, plan, searched, ctx);
        Ok(Refined::Done)
    }
    /// The learned state behind this role (see [`PolicyState`]).
    fn state(&self) -> Option<StateHandle> {
        None
    }
    /// Whether the steps of a run that marks none are found by the
    /// repeating period of its requests and planned (`planned?steps=period`;
    /// see `alloc::period`). The default: no, such a run stays on the
    /// dynamic path until it marks a step end.
    fn steps_by_period(&self) -> bool {
        false
    }
}

/// What [`PlannerPolicy::refine`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refined {
    /// A plan of the profile cheaper than the last one.
    Better(Plan),
    /// Nothing cheaper yet: the search goes on at the next call.
    NotYet,
    /// The search is over (the plan is at its live bound, or this planner
    /// does not search that profile): no need to call again.
    Done,
}

/// Checks a plan against its profile: one entry per request; every planned
/// request plannable ([`PlanRequest::plannable`]), its offset aligned to
/// [`PLAN_ALIGN`] and its block inside the arena; the arena at most
/// `max_arena` bytes; and no two planned requests whose lifetimes overlap
/// (in the step's cycle) sharing a byte — by a sweep over time with the
/// active blocks ordered by address, O(n log n).
pub fn validate_plan(profile: &StepProfile, plan: &Plan, max_arena: u64) -> Result<(), InvalidDecision> {
    let bad = |m: String| Err(InvalidDecision(m));
    let reqs = &profile.requests;
    if plan.offsets.len() != reqs.len() {
        return bad(format!("the plan has {} entries for {} requests", plan.offsets.len(), reqs.len()));
    }
    if plan.arena_bytes > max_arena {
        return bad(format!("an arena of {} bytes exceeds the {max_arena} bytes the device allows", plan.arena_bytes));
    }
    let n = u32::try_from(reqs.len()).map_err(|_| InvalidDecision("more than 2^32 requests".into()))?;
    // (time, is_start, offset, end offset, request)
    let mut events: Vec<(u32, bool, u64, u64, u32)> = Vec::with_capacity(2 * reqs.len());
    for (k, (r, off)) in reqs.iter().zip(&plan.offsets).enumerate() {
        let Some(off) = *off else { continue };
        if !r.plannable(k as u32) {
            return bad(format!("request {k} has no known end of life in the cycle and cannot be planned"));
        }
        if off % PLAN_ALIGN != 0 {
            return bad(format!("request {k}: offset {off} is not a multiple of {PLAN_ALIGN}"));
        }
        let end = off.checked_add(r.planned_bytes()).filter(|&e| e <= plan.arena_bytes);
        let Some(end) = end else {
            return bad(format!(
                "request {k}: [{off}, +{}) leaves the arena of {} bytes",
                r.planned_bytes(),
                plan.arena_bytes
            ));
        };
        let (iv, m) = r.intervals(k as u32, n);
        for &(t0, t1) in &iv[..m] {
            if t0 < t1 {
                events.push((t0, true, off, end, k as u32));
                events.push((t1, false, off, end, k as u32));
            }
        }
    }
    sweep(events, n)
}

/// Checks an aliased plan against its profile of two like steps: one entry
/// per request; the arena and its zones whole multiples of `granularity`,
/// the zones at most half of it, the arena at most `max_arena` bytes; every
/// planned request plannable, aligned to [`PLAN_ALIGN`] and inside its
/// window; and no two planned requests whose lifetimes overlap sharing a
/// byte of *physical* memory (window 1 seen through the zone swap).
pub fn validate_aliased(
    profile: &StepProfile,
    plan: &AliasedPlan,
    granularity: u64,
    max_arena: u64,
) -> Result<(), InvalidDecision> {
    let bad = |m: String| Err(InvalidDecision(m));
    let reqs = &profile.requests;
    if plan.offsets.len() != reqs.len() || !reqs.len().is_multiple_of(2) {
        return bad(format!("the aliased plan has {} entries for {} requests", plan.offsets.len(), reqs.len()));
    }
    let (arena, zone) = (plan.arena_bytes, plan.zone_bytes);
    let g = granularity.max(1);
    if arena == 0 || !arena.is_multiple_of(g) || !zone.is_multiple_of(g) || zone.saturating_mul(2) > arena {
        return bad(format!("an aliased arena of {arena} bytes with zones of {zone} is not whole pages of {g} with zones at most half of it"));
    }
    if arena > max_arena {
        return bad(format!("an arena of {arena} bytes exceeds the {max_arena} bytes the device allows"));
    }
    let n = u32::try_from(reqs.len()).map_err(|_| InvalidDecision("more than 2^32 requests".into()))?;
    let mut events = Vec::with_capacity(2 * reqs.len());
    let mut pieces = Vec::with_capacity(3);
    for (k, (r, off)) in reqs.iter().zip(&plan.offsets).enumerate() {
        let Some(off) = *off else { continue };
        if !r.plannable(k as u32) {
            return bad(format!("request {k} has no known end of life in the cycle and cannot be planned"));
        }
        if off % PLAN_ALIGN != 0 {
            return bad(format!("request {k}: offset {off} is not a multiple of {PLAN_ALIGN}"));
        }
        if off.checked_add(r.planned_bytes()).is_none_or(|e| e > arena) {
            return bad(format!("request {k}: [{off}, +{}) leaves its window of {arena} bytes", r.planned_bytes()));
        }
        pieces.clear();
        plan.physical(k, reqs.len(), off, r.planned_bytes(), &mut pieces);
        let (iv, m) = r.intervals(k as u32, n);
        for &(t0, t1) in iv[..m].iter().filter(|(t0, t1)| t0 < t1) {
            for &(o, e) in &pieces {
                events.push((t0, true, o, e, k as u32));
                events.push((t1, false, o, e, k as u32));
            }
        }
    }
    sweep(events, n)
}

/// The overlap check of [`validate_plan`] and [`validate_aliased`] over
/// `(time, is_start, offset, end offset, request)` events of a cycle of `n`.
fn sweep(events: Vec<(u32, bool, u64, u64, u32)>, n: u32) -> Result<(), InvalidDecision> {
    // In time order, ends before starts at the same time (a block freed
    // before request t is free for it): a counting sort by (time, start),
    // times being at most n. The order within one slot does not matter: a
    // block is checked against the active one nearest below its end, which
    // finds an overlap with any of them.
    let slot = |t: u32, start: bool| 2 * t as usize + usize::from(start);
    let mut at = vec![0u32; 2 * n as usize + 3];
    for &(t, start, ..) in &events {
        at[slot(t, start) + 1] += 1;
    }
    for i in 1..at.len() {
        at[i] += at[i - 1];
    }
    let mut sorted = vec![(0u32, false, 0u64, 0u64, 0u32); events.len()];
    for &e in &events {
        let i = &mut at[slot(e.0, e.1)];
        sorted[*i as usize] = e;
        *i += 1;
    }
    let mut active: std::collections::BTreeMap<u64, (u64, u32)> = std::collections::BTreeMap::new();
    for (_, start, off, end, k) in sorted {
        if !start {
            active.remove(&off);
            continue;
        }
        if let Some((&o, &(e, j))) = active.range(..end).next_back() {
            if e > off && o < end {
                return Err(InvalidDecision(format!(
                    "requests {j} and {k} are live at once and share bytes at offset {}",
                    off.max(o)
                )));
            }
        }
        active.insert(off, (end, k));
    }
    Ok(())
}

/// The planned bytes live at each time of a step's cycle: entry `t` is
/// what occupies the arena while request `t` is served (the intervals of
/// [`PlanRequest::intervals`]); its maximum is the smallest arena any plan
/// of these requests can have.
pub fn cycle_live(requests: &[PlanRequest], offsets: &[Option<u64>]) -> Vec<u64> {
    let n = requests.len();
    let mut delta = vec![0i128; n + 1];
    for (k, (r, off)) in requests.iter().zip(offsets).enumerate() {
        if off.is_none() {
            continue;
        }
        let b = i128::from(r.planned_bytes());
        let (iv, m) = r.intervals(k as u32, n as u32);
        for &(t0, t1) in &iv[..m] {
            let (t0, t1) = (t0 as usize, (t1 as usize).min(n));
            if t0 < t1 {
                delta[t0] += b;
                delta[t1] -= b;
            }
        }
    }
    let mut live = 0i128;
    delta[..n]
        .iter()
        .map(|d| {
            live += d;
            live.max(0) as u64
        })
        .collect()
}

/// Why a policy call produced no usable decision.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    /// The policy trapped (panic, unreachable, out-of-bounds access…).
    #[error("trap: {0}")]
    Trap(String),
    /// The policy ran out of fuel.
    #[error("out of fuel")]
    OutOfFuel,
    /// The policy ran past its per-call deadline.
    #[error("deadline exceeded")]
    Deadline,
    /// The policy hit its memory limit.
    #[error("memory limit exceeded")]
    MemoryLimit,
    /// The policy answered with a decision the engine refused.
    #[error("invalid decision: {0}")]
    InvalidDecision(String),
    /// The policy was disabled after repeated failures.
    #[error("policy disabled")]
    Disabled,
    /// The policy refused a request (a state it cannot load, a profile it
    /// does not plan), with its reason.
    #[error("refused: {0}")]
    Refused(String),
}

impl From<InvalidDecision> for PolicyError {
    fn from(e: InvalidDecision) -> Self {
        PolicyError::InvalidDecision(e.0)
    }
}

/// The three decision roles of a policy set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Role {
    /// [`PlacementPolicy`].
    Placement,
    /// [`ReclamationPolicy`].
    Reclamation,
    /// [`EvictionPolicy`].
    Eviction,
}

impl Role {
    /// Every role, in the order of [`Role::index`].
    pub const ALL: [Role; 3] = [Role::Placement, Role::Reclamation, Role::Eviction];

    /// Position of the role in per-role arrays (`[_; 3]`).
    #[inline]
    pub const fn index(self) -> usize {
        self as usize
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Role::Placement => "placement",
            Role::Reclamation => "reclamation",
            Role::Eviction => "eviction",
        })
    }
}

/// Learned state that a policy can hand to its successor at a hot swap
/// (`save-state` / `load-state` of a WebAssembly component).
///
/// The roles of one policy instance share its state: [`PolicyState::instance`]
/// identifies the instance, so a swap transfers each state once. States are
/// only meaningful between instances of the same policy:
/// [`PolicyState::state_name`] names the format.
pub trait PolicyState: Send + Sync {
    /// Name of the state's format (a component's `lifecycle.name`).
    fn state_name(&self) -> String;
    /// Identity of the instance holding the state (equal for the roles of one instance).
    fn instance(&self) -> usize;
    /// The state, serialized by the policy.
    fn save_state(&self) -> Result<Vec<u8>, PolicyError>;
    /// Replaces the state with `state` (from [`PolicyState::save_state`] of
    /// another instance); `Err` with the policy's refusal or the failure.
    fn load_state(&self, state: &[u8]) -> Result<(), PolicyError>;
}

/// A shared handle to a policy's state.
pub type StateHandle = Arc<dyn PolicyState>;

/// One policy per decision role: what an allocator is driven by.
pub struct Policies {
    /// Placement role.
    pub placement: Box<dyn PlacementPolicy>,
    /// Reclamation role.
    pub reclamation: Box<dyn ReclamationPolicy>,
    /// Eviction role.
    pub eviction: Box<dyn EvictionPolicy>,
}

impl Policies {
    /// Name of the policy serving `role`.
    pub fn name(&self, role: Role) -> &str {
        match role {
            Role::Placement => self.placement.name(),
            Role::Reclamation => self.reclamation.name(),
            Role::Eviction => self.eviction.name(),
        }
    }

    /// The state behind `role`, if its policy has one.
    pub fn state(&self, role: Role) -> Option<StateHandle> {
        match role {
            Role::Placement => self.placement.state(),
            Role::Reclamation => self.reclamation.state(),
            Role::Eviction => self.eviction.state(),
        }
    }
}

impl fmt::Debug for Policies {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Policies")
            .field("placement", &self.placement.name())
            .field("reclamation", &self.reclamation.name())
            .field("eviction", &self.eviction.name())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::MIB;

    fn req(bytes: u64) -> AllocRequest {
        AllocRequest { bytes, kind: TensorKind::Temp, stream: StreamId(0) }
    }

    fn d() -> PlacementDecision {
        PlacementDecision {
            pool: 0,
            round_to: 512,
            segment_min: 2 * MIB,
            segment_round: 2 * MIB,
            split_min_remainder: 512,
            max_waste: u64::MAX,
            cacheable: true,
        }
    }

    #[test]
    fn placement_validation() {
        assert_eq!(d().validate(&req(100), 1), Ok((512, 2 * MIB)));
        assert_eq!(d().validate(&req(3 * MIB), 1), Ok((3 * MIB, 4 * MIB)));
        assert!(d().validate(&req(100), 0).is_err());
        assert!(PlacementDecision { round_to: 3, ..d() }.validate(&req(1), 1).is_err());
        assert!(PlacementDecision { segment_round: 0, ..d() }.validate(&req(1), 1).is_err());
        assert!(PlacementDecision { split_min_remainder: 0, ..d() }.validate(&req(1), 1).is_err());
        assert!(d().validate(&req(u64::MAX - 10), 1).is_err());
    }

    fn preq(freed_at: Option<u32>, wraps_to: Option<u32>) -> PlanRequest {
        PlanRequest { bytes: 1000, kind: TensorKind::Activation, stream: StreamId(0), freed_at, wraps_to }
    }

    #[test]
    fn plan_validation() {
        // 0 lives [0,2), 1 lives [1,3), 2 lives [2,3), 3 is live at the end and wraps to 1.
        let p = StepProfile {
            step: 1,
            requests: vec![preq(Some(2), None), preq(Some(3), None), preq(Some(3), None), preq(None, Some(1))],
        };
        let ok = Plan { arena_bytes: 2048, offsets: vec![Some(0), Some(1024), Some(0), Some(0)] };
        // 3 takes offset 0 from time 3 on, and at the next step's time 0 (before 0 is allocated again)… 0 starts at 0 while 3 still lives: overlap.
        assert!(validate_plan(&p, &ok, 1 << 20).unwrap_err().0.contains("share bytes"));
        let ok = Plan { arena_bytes: 3072, offsets: vec![Some(0), Some(1024), Some(0), Some(2048)] };
        assert_eq!(validate_plan(&p, &ok, 1 << 20), Ok(()));
        let short = Plan { arena_bytes: 3072, offsets: vec![Some(0)] };
        assert!(validate_plan(&p, &short, 1 << 20).is_err());
        let overlap = Plan { arena_bytes: 3072, offsets: vec![Some(0), Some(512), None, None] };
        assert!(validate_plan(&p, &overlap, 1 << 20).unwrap_err().0.contains("share bytes"));
        let outside = Plan { arena_bytes: 1024, offsets: vec![Some(512), None, None, None] };
        assert!(validate_plan(&p, &outside, 1 << 20).unwrap_err().0.contains("leaves the arena"));
        let unaligned = Plan { arena_bytes: 4096, offsets: vec![Some(100), None, None, None] };
        assert!(validate_plan(&p, &unaligned, 1 << 20).unwrap_err().0.contains("multiple"));
        let big = Plan { arena_bytes: 1 << 30, offsets: vec![None; 4] };
        assert!(validate_plan(&p, &big, 1 << 20).unwrap_err().0.contains("exceeds"));
        let unknown = StepProfile { step: 1, requests: vec![preq(None, None)] };
        assert!(validate_plan(&unknown, &Plan { arena_bytes: 1024, offsets: vec![Some(0)] }, 1 << 20).is_err());
    }

    #[test]
    fn victim_validation() {
        let c = |slot, in_use| EvictionCandidate {
            id: TensorId { slot, generation: 0 },
            bytes: 10,
            kind: TensorKind::Activation,
            tier: Tier::Device,
            last_use: 0,
            use_count: 0,
            in_use,
            pinned: false,
            phase: None,
            next_use: None,
        };
        let cands = [c(1, false), c(2, true)];
        assert_eq!(validate_victims(&cands, &[cands[0].id]), Ok(10));
        assert!(validate_victims(&cands, &[cands[1].id]).is_err());
        assert!(validate_victims(&cands, &[cands[0].id, cands[0].id]).is_err());
        assert!(validate_victims(&cands, &[TensorId { slot: 9, generation: 0 }]).is_err());
    }

    #[test]
    fn aliased_plans_are_checked_in_physical_memory() {
        const P: u64 = 2 << 20;
        let r = |bytes, freed_at, wraps_to| PlanRequest {
            bytes,
            kind: TensorKind::Activation,
            stream: StreamId(0),
            freed_at,
            wraps_to,
        };
        // Two steps of two requests: an output (0, 2) live into the next
        // step past its next instance, and a temporary (1, 3).
        let profile = StepProfile {
            step: 1,
            requests: vec![r(P, Some(3), None), r(P, Some(2), None), r(P, None, Some(1)), r(P, Some(4), None)],
        };
        let plan = |offsets: Vec<Option<u64>>| AliasedPlan { arena_bytes: 3 * P, zone_bytes: P, offsets };
        // The outputs in the low zone of each window: physically the low zone, then the high one.
        let ok = plan(vec![Some(0), Some(P), Some(0), Some(P)]);
        validate_aliased(&profile, &ok, P, 1 << 40).unwrap();
        // Output 2 in the high zone of window 1: physically the low zone, where output 0 still lives.
        let clash = plan(vec![Some(0), Some(P), Some(2 * P), Some(P)]);
        assert!(validate_aliased(&profile, &clash, P, 1 << 40).is_err());
        // Output 0 in the middle, output 2 (window 1) in the middle too: the same physical bytes at once.
        let same = plan(vec![Some(P), Some(0), Some(P), Some(2 * P)]);
        assert!(validate_aliased(&profile, &same, P, 1 << 40).is_err());
        // Out of the window, unaligned, a zone over half, not whole pages, too large, the wrong length.
        assert!(validate_aliased(&profile, &plan(vec![Some(3 * P), None, None, None]), P, 1 << 40).is_err());
        assert!(validate_aliased(&profile, &plan(vec![Some(100), None, None, None]), P, 1 << 40).is_err());
        let zones = AliasedPlan { zone_bytes: 2 * P, ..ok.clone() };
        assert!(validate_aliased(&profile, &zones, P, 1 << 40).is_err());
        let pages = AliasedPlan { arena_bytes: 3 * P + 512, ..ok.clone() };
        assert!(validate_aliased(&profile, &pages, P, 1 << 40).is_err());
        assert!(validate_aliased(&profile, &ok, P, 2 * P).is_err());
        assert!(validate_aliased(&profile, &plan(vec![Some(0)]), P, 1 << 40).is_err());
        // What the built-in planner makes for it is valid.
        let core: Vec<_> = profile.requests.iter().map(|q| q.core()).collect();
        let made = wasmem_plan_core::aliased(&core).expect("two like steps");
        validate_aliased(&profile, &made, P, 1 << 40).unwrap();
    }
}
