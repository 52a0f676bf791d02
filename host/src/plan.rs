//! The offline planning bound (`wasmem plan`): a whole workload planned as
//! one step, knowing every lifetime in advance.
//!
//! Every request of the workload becomes one [`PlanRequest`] whose lifetime
//! is exactly the time between its allocation and its free (a tensor never
//! freed lives to the end); the planner places them all in one arena, and
//! the plan is validated like any online plan. The arena is a lower bound
//! of what any allocator that knew the future could reserve with this
//! planner (it is `offline_bound`, like `belady`): online planning learns
//! the same lifetimes one step later, per step. The exact lower bound of
//! every planner, the peak of live bytes rounded to [`PLAN_ALIGN`], is
//! reported beside it.
//!
//! A whole trace is one long profile, where a planner's search has little
//! room; its structure helps. Besides the planner's plan of the whole
//! ([`Composition::Whole`]), two compositions of the planner's plans of
//! parts are tried, and the cheapest valid plan wins (the whole on a tie):
//!
//! - [`Composition::Floor`]: the tensors that never leave (parameters,
//!   optimizer states) stacked in allocation order at the bottom, the
//!   planner's plan of the rest above them;
//! - [`Composition::Steps`] (traces with `step_end` markers): each step
//!   becomes a profile of its own — the tensors live when it begins, as if
//!   allocated first, then its own requests, those that outlive it live to
//!   its end — planned like the whole (the cheaper of its plan and its
//!   floor composition; alike steps are planned once). The steps are then
//!   placed from the one with the largest plan down, each request at its
//!   offset in its step's plan when that place is free
//!   ([`wasmem_plan_core::place_hinted`]), else at the best-fitting gap: the
//!   largest step keeps its layout, the others fit around what crosses into
//!   them;
//! - [`Composition::Cycle`] (traces whose steps repeat, one at a time or in
//!   windows of up to [`MAX_CYCLE_STEPS`]): where every window after the
//!   first repeats the second — the same requests, each freed at the same
//!   time in its window or in the next one (an output kept until the next
//!   step replaces it) — the second window is planned as a cycle (a
//!   request freed in the next window wraps to its start, as online plans
//!   are), every later window placed at the same offsets, above the
//!   tensors the first window leaves for good; the first window and a last,
//!   partial one fit around them. Steps that keep a tensor into the next
//!   one cannot be composed step by step without moving it;
//! - [`Composition::AliasedSteps`] (such steps, repeating or not: an
//!   evaluation every few steps, varying lengths): every step placed on its
//!   own in one of two virtual windows over one physical arena (the second
//!   with its end zones swapped, as online plans of two like steps are), by
//!   [`aliased_steps`]: what a step keeps into the next lies in its low
//!   zone, which the next step's window sees as its high zone, so each step
//!   fits around the previous one's output wherever that step put it.

use std::hash::{Hash, Hasher};
use std::time::Instant;

use rustc_hash::FxHashMap;

use crate::decision::{
    validate_aliased, validate_plan, Plan, PlanRequest, PlannerPolicy, PolicyContext, PolicyError, StepProfile,
    PLAN_ALIGN,
};
use crate::trace::Event;
use crate::types::Phase;
use crate::types::StreamId;
use crate::workload::{Workload, WorkloadError};
use wasmem_plan_core::PAGE as ALIASED_PAGE;

/// The offline plan of a workload and what it reaches.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct OfflinePlan {
    /// The workload's name.
    pub trace: String,
    /// The planner's name.
    pub planner: String,
    /// Allocation requests planned.
    pub requests: u64,
    /// Peak of live (requested) bytes.
    pub peak_live_bytes: u64,
    /// Peak of live bytes with each request rounded to [`PLAN_ALIGN`]: no
    /// plan's arena can be smaller.
    pub lower_bound_bytes: u64,
    /// The planned arena.
    pub arena_bytes: u64,
    /// `arena_bytes / peak_live_bytes` (1 for an empty workload).
    pub overhead_ratio: f64,
    /// Seconds the planner took (every plan of the whole and of its parts,
    /// and their composition).
    pub plan_seconds: f64,
    /// Which plan was kept.
    pub composition: Composition,
    /// Steps of the workload (`step_end` markers).
    pub steps: u64,
    /// Always true: the plan knew every lifetime in advance.
    pub offline_bound: bool,
}

/// How an offline plan was made (see the module documentation).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Composition {
    /// The planner's plan of the whole workload.
    Whole,
    /// The tensors that never leave at the bottom, the plan of the rest above.
    Floor,
    /// The plans of the steps, composed.
    Steps,
    /// One plan of a repeating window of steps, as a cycle, for every window.
    Cycle,
    /// [`Composition::Cycle`] with a window of two like steps planned in an
    /// aliased arena (one memory at two virtual windows, as online plans of
    /// a loop that keeps its output are): the physical memory it needs.
    AliasedCycle,
    /// Each step (or each forward pass, in a workload whose steps
    /// accumulate gradients over several) placed on its own in one of two
    /// aliased windows, in turn (see [`aliased_steps`]): the physical
    /// memory it needs.
    AliasedSteps,
}

impl Composition {
    /// Its name in reports.
    pub fn name(self) -> &'static str {
        match self {
            Composition::Whole => "whole",
            Composition::Floor => "floor",
            Composition::Steps => "steps",
            Composition::Cycle => "cycle",
            Composition::AliasedCycle => "aliased cycle",
            Composition::AliasedSteps => "aliased steps",
        }
    }
}

/// Most distinct step profiles [`Composition::Steps`] plans (the largest
/// by live bytes); the other steps are placed after them without hints.
pub const MAX_STEP_PLANS: usize = 64;

/// Most steps a window of [`Composition::Cycle`] holds.
pub const MAX_CYCLE_STEPS: usize = 4;

/// Most entries the step profiles of [`Composition::Steps`] hold in all
/// (a request counts once in each step it is live in: parameters in every
/// step); a workload whose steps hold more is not composed by steps.
pub const MAX_STEP_ENTRIES: usize = 1 << 24;

/// Why a workload cannot be planned.
#[derive(Debug, thiserror::Error)]
pub enum OfflinePlanError {
    /// The workload cannot be read.
    #[error(transparent)]
    Workload(#[from] WorkloadError),
    /// An event refers to a tensor that is not live.
    #[error("{at}: {what}")]
    Event {
        /// Where (`FILE:LINE`, or the event's index).
        at: String,
        /// What is wrong.
        what: String,
    },
    /// The planner failed or its plan was invalid.
    #[error("the planner {planner} failed: {cause}")]
    Planner {
        /// The planner.
        planner: String,
        /// Why.
        cause: PolicyError,
    },
    /// More requests than a plan can index.
    #[error("{0} requests: a plan indexes at most 2^32")]
    TooLarge(u64),
}

/// Plans the whole of `w` with `planner` (see the module documentation).
pub fn plan_offline(w: &Workload, planner: &mut dyn PlannerPolicy) -> Result<OfflinePlan, OfflinePlanError> {
    let mut requests: Vec<PlanRequest> = Vec::new();
    let mut live: FxHashMap<u64, u32> = FxHashMap::default();
    let (mut live_bytes, mut peak_live) = (0u64, 0u64);
    // The requests made before each `step_end`, and before each forward
    // pass (the micro-batches of a step that accumulates gradients).
    let (mut cuts, mut passes): (Vec<u32>, Vec<u32>) = (Vec::new(), Vec::new());
    let at = |i: u64| w.locate(i).unwrap_or_else(|| format!("{} event {}", w.name(), i + 1));
    for (i, ev) in w.events()?.enumerate() {
        let i = i as u64;
        let ev = ev.map_err(|e| OfflinePlanError::Event { at: at(i), what: e.to_string() })?;
        match ev {
            Event::Alloc { id, bytes, kind, stream, .. } => {
                let k = u32::try_from(requests.len()).map_err(|_| OfflinePlanError::TooLarge(requests.len() as u64))?;
                if live.insert(id, k).is_some() {
                    return Err(OfflinePlanError::Event { at: at(i), what: format!("tensor {id} is allocated twice") });
                }
                requests.push(PlanRequest { bytes, kind, stream: StreamId(stream), freed_at: None, wraps_to: None });
                live_bytes += bytes;
                peak_live = peak_live.max(live_bytes);
            }
            Event::Free { id, .. } => {
                let k = live.remove(&id).ok_or_else(|| OfflinePlanError::Event {
                    at: at(i),
                    what: format!("free of tensor {id}, which is not live"),
                })?;
                let now = requests.len() as u32;
                let r = &mut requests[k as usize];
                r.freed_at = Some(now);
                live_bytes -= r.bytes;
            }
            Event::Phase { phase: Phase::StepEnd, .. } => cuts.push(requests.len() as u32),
            Event::Phase { phase: Phase::Forward, .. } => passes.push(requests.len() as u32),
            _ => {}
        }
    }
    let n = requests.len() as u32;
    for r in requests.iter_mut().filter(|r| r.freed_at.is_none()) {
        r.freed_at = Some(n); // lives to the end
    }
    let profile = StepProfile { step: 0, requests };
    let all: Vec<Option<u64>> = vec![Some(0); profile.requests.len()];
    let lower_bound = crate::decision::cycle_live(&profile.requests, &all).into_iter().max().unwrap_or(0);
    let ctx = PolicyContext { capacity_bytes: u64::MAX, ..PolicyContext::default() };
    let name = planner.name().to_string();
    let t0 = Instant::now();
    let mut parts = Parts { planner, ctx };
    let failed = |cause| OfflinePlanError::Planner { planner: name.clone(), cause };
    let mut plan = parts.ask(&profile.requests).map_err(failed)?;
    let mut composition = Composition::Whole;
    let windows = steps(n, &cuts);
    if plan.arena_bytes > lower_bound {
        if let Some(p) = parts.floored(&profile.requests, Above::Plan).filter(|p| p.arena_bytes < plan.arena_bytes) {
            (plan, composition) = (p, Composition::Floor);
        }
    }
    if plan.arena_bytes > lower_bound && windows.len() > 1 {
        // The steps above the floor, then (unless those reach the bound)
        // the steps whole.
        if let Some(p) =
            parts.floored(&profile.requests, Above::Steps(&cuts)).filter(|p| p.arena_bytes < plan.arena_bytes)
        {
            (plan, composition) = (p, Composition::Steps);
        }
        if plan.arena_bytes > lower_bound {
            if let Some(p) = parts.by_steps(&profile.requests, &windows).filter(|p| p.arena_bytes < plan.arena_bytes) {
                (plan, composition) = (p, Composition::Steps);
            }
        }
    }
    let mut arena = plan.arena_bytes;
    if arena > lower_bound && windows.len() > 2 {
        if let Some((a, how)) = parts.by_cycle(&profile.requests, &windows).filter(|&(a, _)| a < arena) {
            (arena, composition) = (a, how);
        }
    }
    for cut in aliased_cuts(n, &cuts, &passes) {
        if arena > lower_bound {
            if let Some(a) = aliased_steps(&profile.requests, &cut, lower_bound).filter(|&a| a < arena) {
                (arena, composition) = (a, Composition::AliasedSteps);
            }
        }
    }
    let plan_seconds = t0.elapsed().as_secs_f64();
    let arena = arena.div_ceil(PLAN_ALIGN) * PLAN_ALIGN;
    Ok(OfflinePlan {
        trace: w.name().to_string(),
        planner: name,
        requests: u64::from(n),
        peak_live_bytes: peak_live,
        lower_bound_bytes: lower_bound,
        arena_bytes: arena,
        overhead_ratio: if peak_live == 0 { 1.0 } else { arena as f64 / peak_live as f64 },
        plan_seconds,
        composition,
        steps: cuts.len() as u64,
        offline_bound: true,
    })
}

/// The windows [`aliased_steps`] places a workload of `n` requests in: its
/// steps (cut after the request counts `cuts`), then, when they cut it
/// otherwise, its forward passes (cut before the counts `passes`: a step of
/// several micro-batches keeps each one's output into the next); only cuts
/// into two windows or more.
fn aliased_cuts(n: u32, cuts: &[u32], passes: &[u32]) -> Vec<Vec<(u32, u32)>> {
    let (by_step, by_pass) = (steps(n, cuts), steps(n, passes));
    let mut out = vec![by_step];
    if by_pass != out[0] {
        out.push(by_pass);
    }
    out.retain(|w| w.len() > 1);
    out
}

/// Whether request `k` of a whole workload's `requests` belongs to its
/// floor: it stays to the end and is allocated by the time of the live peak
/// (there, it is live anyway; one allocated later would raise the peak by
/// its bytes).
fn in_floor(requests: &[PlanRequest]) -> impl Fn(&u32) -> bool + '_ {
    let n = requests.len() as u32;
    let mut delta = vec![0i128; requests.len() + 1];
    for (k, r) in requests.iter().enumerate() {
        let f = r.freed_at.unwrap_or(n).clamp(k as u32 + 1, n);
        delta[k] += i128::from(r.planned_bytes());
        delta[f as usize] -= i128::from(r.planned_bytes());
    }
    let (mut live, mut peak, mut peak_at) = (0i128, -1i128, 0u32);
    for (t, d) in delta.iter().enumerate().take(requests.len()) {
        live += d;
        if live > peak {
            (peak, peak_at) = (live, t as u32);
        }
    }
    move |&k| k <= peak_at && requests[k as usize].freed_at == Some(n)
}

/// The steps of a profile of `n` requests cut after the request counts
/// `cuts`: `[start, end)` in requests, none empty (requests after the last
/// cut are one more step).
fn steps(n: u32, cuts: &[u32]) -> Vec<(u32, u32)> {
    let mut out = Vec::new();
    let mut start = 0;
    for &c in cuts.iter().chain([&n]) {
        if c > start && c <= n {
            out.push((start, c));
            start = c;
        }
    }
    out
}

/// How [`Parts::floored`] plans what lies above the floor.
#[derive(Clone, Copy)]
enum Above<'a> {
    /// The planner's plan.
    Plan,
    /// [`Parts::by_steps`] with the steps cut after these request counts
    /// (of the whole).
    Steps(&'a [u32]),
}

/// The requests of each step of `windows` (consecutive, as [`steps`] cuts
/// them), in order: those live at its start (allocated before it, freed
/// after its first request), then its own; `None` when they would hold more
/// than `max` entries in all. Swept once: each step's live set from the
/// step before's.
fn step_requests(reqs: &[PlanRequest], windows: &[(u32, u32)], max: usize) -> Option<Vec<Vec<u32>>> {
    let mut idxs: Vec<Vec<u32>> = Vec::with_capacity(windows.len());
    let (mut live, mut entries): (Vec<u32>, usize) = (Vec::new(), 0);
    let mut before = 0..0;
    for &(c0, c1) in windows {
        let alive = |k: &u32| reqs[*k as usize].freed_at.is_none_or(|f| f > c0);
        live = live.iter().copied().chain(before).filter(alive).collect();
        entries += live.len() + (c1 - c0) as usize;
        if entries > max {
            return None;
        }
        idxs.push(live.iter().copied().chain(c0..c1).collect());
        before = c0..c1;
    }
    Some(idxs)
}

/// Where a request of a window of [`Composition::Cycle`] ends, relative to
/// its window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum WindowEnd {
    /// Freed within it: the index of the window's first request allocated
    /// after the free (its length: at its end).
    In(u32),
    /// Freed in the next window: the index there, as `wraps_to`.
    Wrap(u32),
    /// Never freed, in one of the workload's last two windows (it lives to
    /// the end: the last window's, or the last window holds no instance of
    /// it to replace it).
    Never,
}

impl WindowEnd {
    /// The time it ends, counted from its window's start (`m`: the
    /// window's length).
    fn at(self, m: u32) -> u64 {
        match self {
            WindowEnd::In(e) => u64::from(e),
            WindowEnd::Wrap(w) => u64::from(m) + u64::from(w),
            WindowEnd::Never => u64::from(m),
        }
    }
}

/// The end of request `k` of the window `[c0, c1)` whose next window ends
/// at `next_end` (`None`: the last window) in a workload of `n` requests;
/// `None` when it outlives the next window.
fn window_end(r: &PlanRequest, k: u32, (c0, c1): (u32, u32), next_end: Option<u32>, n: u32) -> Option<WindowEnd> {
    let f = r.freed_at.unwrap_or(n);
    match next_end {
        _ if f >= n && next_end.is_none_or(|e| e >= n) => Some(WindowEnd::Never),
        _ if f <= c1 => Some(WindowEnd::In(f.clamp(k + 1, c1) - c0)),
        Some(e) if f <= e => Some(WindowEnd::Wrap(f - c1)),
        _ => None,
    }
}

/// The planner, asked for plans of parts of a workload.
struct Parts<'a> {
    planner: &'a mut dyn PlannerPolicy,
    ctx: PolicyContext,
}

impl Parts<'_> {
    /// The planner's plan of `requests` (all of them lifetimes within the
    /// profile), validated, with every request planned.
    fn ask(&mut self, requests: &[PlanRequest]) -> Result<Plan, PolicyError> {
        let profile = StepProfile { step: 0, requests: requests.to_vec() };
        let plan = self.planner.plan(&profile, &self.ctx)?;
        validate_plan(&profile, &plan, u64::MAX)?;
        let unplanned = plan.offsets.iter().filter(|o| o.is_none()).count();
        if unplanned > 0 {
            return Err(PolicyError::InvalidDecision(format!("{unplanned} requests left unplanned")));
        }
        Ok(plan)
    }

    /// The cheaper of [`Parts::ask`] and [`Parts::floored`]; `None` when
    /// the planner fails.
    fn best(&mut self, requests: &[PlanRequest]) -> Option<Plan> {
        let p = self.ask(requests).ok()?;
        match self.floored(requests, Above::Plan) {
            Some(q) if q.arena_bytes < p.arena_bytes => Some(q),
            _ => Some(p),
        }
    }

    /// [`Composition::Floor`] of `requests`, the rest planned as `above`
    /// says: `None` when nothing stays to the end, or only that, or the
    /// rest has no plan.
    fn floored(&mut self, requests: &[PlanRequest], above: Above) -> Option<Plan> {
        let n = requests.len() as u32;
        let (floor, rest): (Vec<u32>, Vec<u32>) = (0..n).partition(in_floor(requests));
        if floor.is_empty() || rest.is_empty() {
            return None;
        }
        // The rest alone: time counts its own requests.
        let m = rest.len() as u32;
        let sub: Vec<PlanRequest> = rest
            .iter()
            .enumerate()
            .map(|(i, &k)| {
                let r = requests[k as usize];
                let f = r.freed_at.map_or(m, |f| rest.partition_point(|&j| j < f) as u32);
                PlanRequest { freed_at: Some(f.clamp(i as u32 + 1, m)), wraps_to: None, ..r }
            })
            .collect();
        let above = match above {
            Above::Plan => self.ask(&sub).ok()?,
            Above::Steps(cuts) => {
                let cuts: Vec<u32> = cuts.iter().map(|&c| rest.partition_point(|&j| j < c) as u32).collect();
                self.by_steps(&sub, &steps(m, &cuts))?
            }
        };
        let mut offsets = vec![None; requests.len()];
        let mut top = 0u64;
        for &k in &floor {
            offsets[k as usize] = Some(top);
            top = top.checked_add(requests[k as usize].planned_bytes())?;
        }
        for (&k, off) in rest.iter().zip(&above.offsets) {
            offsets[k as usize] = Some(top.checked_add((*off)?)?);
        }
        Some(Plan { arena_bytes: top.checked_add(above.arena_bytes)?, offsets })
    }

    /// [`Composition::Cycle`] (or [`Composition::AliasedCycle`]) of `reqs`
    /// cut into `steps`: the least memory over windows of 1 to
    /// [`MAX_CYCLE_STEPS`] steps, and how; `None` when no window repeats
    /// (or the planner plans none).
    fn by_cycle(&mut self, reqs: &[PlanRequest], steps: &[(u32, u32)]) -> Option<(u64, Composition)> {
        let mut best: Option<(u64, Composition)> = None;
        for p in 1..=MAX_CYCLE_STEPS {
            for found in self.cycle_of(reqs, steps, p).into_iter().flatten().flatten() {
                if best.is_none_or(|(b, _)| found.0 < b) {
                    best = Some(found);
                }
            }
        }
        best
    }

    /// [`Composition::Cycle`] with windows of `p` steps: `None` when fewer
    /// than two windows follow the first, when they do not all repeat the
    /// second (the last may end every request it holds: the workload ends),
    /// when a request of one of them outlives the next window or two
    /// instances of one are live at once, or when the composed plan is not
    /// valid. With the window's plain plan, its aliased plan when the
    /// planner makes one (a window of two like steps): the physical memory
    /// each composition needs.
    fn cycle_of(
        &mut self,
        reqs: &[PlanRequest],
        steps: &[(u32, u32)],
        p: usize,
    ) -> Option<[Option<(u64, Composition)>; 2]> {
        let n = reqs.len() as u32;
        let windows: Vec<(u32, u32)> = steps.chunks(p).map(|c| (c[0].0, c[c.len() - 1].1)).collect();
        // A last window of fewer steps is a tail, placed like the first.
        let full = if steps.len().is_multiple_of(p) { windows.len() } else { windows.len() - 1 };
        if full < 3 {
            return None;
        }
        let (s0, s1) = windows[1];
        let m = s1 - s0;
        let ends = |w: usize| -> Option<Vec<WindowEnd>> {
            let (c0, c1) = windows[w];
            let next = windows.get(w + 1).map(|x| x.1);
            (c0..c1).map(|k| window_end(&reqs[k as usize], k, (c0, c1), next, n)).collect()
        };
        let shape = |k: u32| {
            let r = &reqs[k as usize];
            (r.bytes, r.kind, r.stream)
        };
        let cycle = ends(1)?;
        for (w, &(c0, c1)) in windows.iter().enumerate().take(full).skip(2) {
            if c1 - c0 != m || (0..m).any(|i| shape(c0 + i) != shape(s0 + i)) {
                return None;
            }
            // (A request may end sooner than in the second window: it
            // still fits its place; the last window ends every request.)
            let e = ends(w)?;
            if !e.iter().zip(&cycle).all(|(a, b)| a.at(m) <= b.at(m)) {
                return None;
            }
        }
        // The second window as a cycle (a request freed in the next window
        // wraps to its start: its next instance takes its place after it).
        let mut profile = Vec::with_capacity(m as usize);
        for (i, end) in cycle.iter().enumerate() {
            let r = reqs[s0 as usize + i];
            let (freed_at, wraps_to) = match *end {
                WindowEnd::In(e) => (Some(e.clamp(i as u32 + 1, m)), None),
                WindowEnd::Wrap(w) if w <= i as u32 => (None, Some(w)),
                _ => return None,
            };
            profile.push(PlanRequest { freed_at, wraps_to, ..r });
        }
        let cyc = self.ask(&profile).ok()?;
        let window = StepProfile { step: 0, requests: profile };
        let aliased = match self.planner.plan_aliased(&window, &self.ctx) {
            Ok(Some(a)) if validate_aliased(&window, &a, ALIASED_PAGE, u64::MAX).is_ok() => Some(a),
            _ => None,
        };
        // The first window's tensors that never leave at the bottom, in
        // allocation order; the windows that repeat at their cycle's
        // offsets above them; then the first window's other requests and a
        // tail, hinted at the offsets of the requests of the second window
        // they line up with (the first from its end: it begins with the
        // model's setup; a tail from its start), where those are free.
        let (f0, f1) = windows[0];
        let mut order: Vec<(u32, Option<u64>)> = Vec::with_capacity(reqs.len());
        let mut top = 0u64;
        for k in (f0..f1).filter(|&k| reqs[k as usize].freed_at.is_none_or(|f| f >= n)) {
            order.push((k, Some(top)));
            top = top.checked_add(reqs[k as usize].planned_bytes())?;
        }
        let floor = order.len();
        let repeating: Vec<(u32, u32)> =
            windows[1..full].iter().flat_map(|&(c0, c1)| (c0..c1).map(move |k| (k, k - c0))).collect();
        // The first window's other requests and a tail, each with the
        // request of the second window it lines up with.
        let first: Vec<u32> = (f0..f1).filter(|&k| reqs[k as usize].freed_at.is_some_and(|f| f < n)).collect();
        let len = first.len() as u32;
        let mut around: Vec<(u32, Option<u32>)> = first
            .iter()
            .enumerate()
            .map(|(j, &k)| (k, (m + j as u32).checked_sub(len).filter(|&i| shape(s0 + i) == shape(k))))
            .collect();
        if let Some(&(c0, c1)) = windows.get(full) {
            around.extend((c0..c1).map(|k| (k, Some(k - c0).filter(|&i| i < m && shape(s0 + i) == shape(k)))));
        }
        let at = |i: u32| cyc.offsets[i as usize].and_then(|o| o.checked_add(top));
        order.extend(repeating.iter().map(|&(k, i)| (k, at(i))));
        order.extend(around.iter().map(|&(k, i)| (k, i.and_then(at))));
        let plain = placed(reqs, &order).map(|p| (p.arena_bytes, Composition::Cycle));
        // Aliased: the repeating windows' requests lie in the physical
        // pieces of their window (the second step's through the zone
        // swap); the first window and a tail in the pieces of the requests
        // they line up with where all of those are free (they then run in
        // the windows as the others do: the first window's output kept
        // into the second lies where the second expects its previous
        // instance), else whole where they fit, in physical memory.
        let aliased = aliased.and_then(|a| {
            let mut pieces = Vec::with_capacity(3);
            let mut phys = |i: u32| -> Vec<(u64, u64)> {
                pieces.clear();
                if let Some(off) = a.offsets[i as usize] {
                    a.physical(i as usize, m as usize, off, reqs[(s0 + i) as usize].planned_bytes(), &mut pieces);
                }
                pieces.iter().map(|&(o, e)| (o + top, e + top)).collect()
            };
            let mut fixed: Vec<Vec<(u64, u64)>> = vec![Vec::new(); reqs.len()];
            let mut pinned = vec![false; reqs.len()];
            for &(k, i) in &repeating {
                fixed[k as usize] = phys(i);
                pinned[k as usize] = true;
            }
            for &(k, i) in &around {
                fixed[k as usize] = i.map(&mut phys).unwrap_or_default();
            }
            // The pieces first; a request the aliased plan leaves goes where
            // it fits.
            let mut order: Vec<(u32, Option<u64>)> = order[..floor].to_vec();
            let (held, left): (Vec<u32>, Vec<u32>) =
                repeating.iter().map(|&(k, _)| k).partition(|&k| !fixed[k as usize].is_empty());
            order.extend(held.into_iter().chain(left).chain(around.iter().map(|&(k, _)| k)).map(|k| (k, None)));
            placed_in_pieces(reqs, &fixed, &pinned, &order).map(|arena| (arena, Composition::AliasedCycle))
        });
        Some([plain, aliased])
    }

    /// [`Composition::Steps`] of `reqs` cut into `windows`: `None` when
    /// the planner planned no step, or the composed plan is not valid.
    fn by_steps(&mut self, reqs: &[PlanRequest], windows: &[(u32, u32)]) -> Option<Plan> {
        let idxs = step_requests(reqs, windows, MAX_STEP_ENTRIES)?;
        // Step `i` as a profile of its own (made when needed: they can be
        // many).
        let sub_of = |i: usize| -> Vec<PlanRequest> {
            let (idx, (c0, c1)) = (&idxs[i], windows[i]);
            let (m, before) = (idx.len() as u32, idx.len() as u32 - (c1 - c0));
            let time = |f: u32| if f >= c1 { m } else { before + f.saturating_sub(c0) };
            idx.iter()
                .enumerate()
                .map(|(j, &k)| {
                    let r = reqs[k as usize];
                    PlanRequest {
                        freed_at: Some(r.freed_at.map_or(m, time).clamp(j as u32 + 1, m)),
                        wraps_to: None,
                        ..r
                    }
                })
                .collect()
        };
        let mut keys: Vec<(u64, u64)> = Vec::with_capacity(windows.len());
        for i in 0..windows.len() {
            let sub = sub_of(i);
            let mut h = rustc_hash::FxHasher::default();
            sub.hash(&mut h);
            let all: Vec<Option<u64>> = vec![Some(0); sub.len()];
            keys.push((h.finish(), crate::decision::cycle_live(&sub, &all).into_iter().max().unwrap_or(0)));
        }
        // Alike steps planned once (the first of them stands for the
        // others), the largest first, at most MAX_STEP_PLANS.
        let mut by_live: Vec<usize> = (0..windows.len()).collect();
        by_live.sort_by_key(|&i| (std::cmp::Reverse(keys[i].1), i));
        let mut alike: FxHashMap<u64, Vec<usize>> = FxHashMap::default();
        let mut plans: FxHashMap<usize, Option<Plan>> = FxHashMap::default();
        let mut stands: Vec<Option<usize>> = vec![None; windows.len()];
        for &i in &by_live {
            let sub = sub_of(i);
            let same = alike.get(&keys[i].0).and_then(|v| v.iter().copied().find(|&r| sub_of(r) == sub));
            stands[i] = match same {
                Some(r) => Some(r),
                None if plans.len() < MAX_STEP_PLANS => {
                    plans.insert(i, self.best(&sub));
                    alike.entry(keys[i].0).or_default().push(i);
                    Some(i)
                }
                None => None,
            };
        }
        let plan_of = |i: usize| stands[i].and_then(|r| plans.get(&r)).and_then(Option::as_ref);
        let mut planned: Vec<(u64, usize)> = Vec::new();
        let mut unplanned: Vec<usize> = Vec::new();
        for i in by_live {
            match plan_of(i) {
                Some(p) => planned.push((p.arena_bytes, i)),
                None => unplanned.push(i),
            }
        }
        if planned.is_empty() {
            return None;
        }
        planned.sort_by_key(|&(arena, i)| (std::cmp::Reverse(arena), i));
        unplanned.sort_unstable();
        // The order to place in: each step's blocks from the bottom up with
        // their offsets as hints, then the steps without a plan in time
        // order; each request where it first comes.
        let mut seen = vec![false; reqs.len()];
        let mut order: Vec<(u32, Option<u64>)> = Vec::with_capacity(reqs.len());
        for &(_, i) in &planned {
            let Some(p) = plan_of(i) else { continue };
            let mut blocks: Vec<(u64, u32)> =
                idxs[i].iter().zip(&p.offsets).filter_map(|(&k, o)| o.map(|o| (o, k))).collect();
            blocks.sort_unstable();
            for (o, k) in blocks {
                if !std::mem::replace(&mut seen[k as usize], true) {
                    order.push((k, Some(o)));
                }
            }
        }
        for i in unplanned {
            for &k in &idxs[i] {
                if !std::mem::replace(&mut seen[k as usize], true) {
                    order.push((k, None));
                }
            }
        }
        placed(reqs, &order)
    }
}

/// Most requests a step of [`Composition::AliasedSteps`] may make (each
/// placement scans the step's blocks: quadratic in it).
pub const MAX_ALIASED_STEP: u32 = 1 << 14;

/// Most block visits (a placement visits every block its step holds so
/// far) that [`aliased_steps`] spends over all the arenas it tries: a
/// second or two; a workload of more, or longer, steps is not composed so.
pub const MAX_ALIASED_WORK: u64 = 1 << 31;

/// How long a request of a step of [`Composition::AliasedSteps`] lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reach {
    /// Freed within its step.
    Step,
    /// Freed in the next step: it lies in its window's low zone.
    Next,
    /// Freed after the next step (or never, not in the floor): it lies in
    /// the middle, where both windows see the same memory.
    Later,
}

/// A request of a step, as [`aliased_steps`] places it: its lifetime in the
/// step's own times (`[t0, t1)`, `t1` the step's length when it outlives it).
#[derive(Debug, Clone, Copy)]
struct StepItem {
    k: u32,
    size: u64,
    t0: u32,
    t1: u32,
    reach: Reach,
}

/// A block placed in a step's window: `[off, end)` over times `[t0, t1)`.
#[derive(Debug, Clone, Copy)]
struct WindowBlock {
    off: u64,
    end: u64,
    t0: u32,
    t1: u32,
}

/// The orders in which [`aliased_steps`] tries to place a step's requests
/// (those kept past the step always first): by decreasing size, the
/// longer-lived first among equals; those live at the step's peak first, in
/// allocation order or the longer-lived first, then by size; by size times
/// lifetime; by size, the earlier first among equals; by lifetime.
const STEP_ORDERS: usize = 6;

/// The physical memory of [`Composition::AliasedSteps`] for `reqs` (a whole
/// workload, `freed_at` set for every request) cut into `windows`, or `None`
/// when no step keeps a tensor into the next one, a step is longer than
/// [`MAX_ALIASED_STEP`], or no arena up to 1/128 above the live
/// `lower_bound` (or above the most bytes live over the floor at once)
/// holds every step.
///
/// The floor ([`in_floor`]) lies at the bottom, in allocation order; or,
/// when that stack passes the bound (the first step's peak came before
/// tensors that then stay to the end, such as lazily made optimizer
/// states), only what the floor holds that is allocated by the first
/// window's live peak, the rest placed in the middle. Above
/// it, an arena of `A` bytes with two end zones of `Z` (the most bytes a
/// step keeps into the next, in whole pages) is seen through two windows:
/// step `s` runs in window `s mod 2`, the second with its zones swapped
/// ([`wasmem_plan_core::swap_zones`]). Each step is placed on its own, in
/// its window: what it keeps into the next step in its low zone, what
/// outlives the next step in the middle (the same memory in both windows),
/// the rest anywhere, each in the smallest gap that holds it among the
/// blocks live with it — the previous step's kept tensors (in this window's
/// high zone, until freed), what earlier steps left in the middle, and this
/// step's requests placed so far. A request allocated once the previous
/// step's tensors are all freed takes the high end of its gap (towards the
/// zone they left). The first of [`STEP_ORDERS`] that places every request
/// of the step wins; when none does, each is retried with the requests
/// that failed it placed first, one more per retry (up to
/// [`STEP_PROMOTIONS`]). The arena is the smallest (from the bound up, in
/// whole pages) whose steps all place: the least tried first, then the
/// largest, then halving between them. The layout is then checked request
/// by request in physical memory ([`placed_in_pieces`]).
fn aliased_steps(reqs: &[PlanRequest], windows: &[(u32, u32)], lower_bound: u64) -> Option<u64> {
    if windows.len() < 2 || windows.iter().any(|&(c0, c1)| c1 - c0 > MAX_ALIASED_STEP) {
        return None;
    }
    let floor = floor_marks(reqs);
    // What stays to the end but comes after the first window's live peak
    // may go in the middle instead. Each floor bounds the arena below by
    // itself plus the most bytes live above it at once: the lower first,
    // the other only when it bounds lower still than what the first made.
    let until = window_peak(reqs, windows[0]) as usize;
    let mut floors = vec![floor];
    if floors[0].iter().skip(until + 1).any(|&f| f) {
        floors.push(floors[0].iter().enumerate().map(|(k, &f)| f && k <= until).collect());
    }
    let least =
        |floor: &[bool]| lower_bound.max(floor_bytes(reqs, floor).saturating_add(above_floor_peak(reqs, floor)));
    let mut floors: Vec<(u64, Vec<bool>)> = floors.into_iter().map(|f| (least(&f), f)).collect();
    floors.sort_by_key(|(least, _)| *least);
    let mut best: Option<u64> = None;
    for (i, (least, floor)) in floors.iter().enumerate() {
        if i > 0 && best.is_some_and(|b| b <= *least || floors[0].0 == *least) {
            break;
        }
        if let Some((a, _)) = aliased_steps_layout(reqs, windows, lower_bound, floor) {
            best = Some(best.map_or(a, |b| b.min(a)));
        }
    }
    best
}

/// Which requests of `reqs` (a whole workload) [`in_floor`] holds.
fn floor_marks(reqs: &[PlanRequest]) -> Vec<bool> {
    let f = in_floor(reqs);
    (0..reqs.len() as u32).map(|k| f(&k)).collect()
}

/// The bytes of the requests of `reqs` that `floor` marks.
fn floor_bytes(reqs: &[PlanRequest], floor: &[bool]) -> u64 {
    reqs.iter().zip(floor).filter(|(_, &f)| f).map(|(r, _)| r.planned_bytes()).sum()
}

/// The most bytes live at once among the requests of `reqs` (a whole
/// workload) that `floor` does not mark.
fn above_floor_peak(reqs: &[PlanRequest], floor: &[bool]) -> u64 {
    let n = reqs.len() as u32;
    let mut delta = vec![0i128; reqs.len() + 1];
    for (k, r) in reqs.iter().enumerate().filter(|&(k, _)| !floor[k]) {
        let f = r.freed_at.unwrap_or(n).clamp(k as u32 + 1, n);
        delta[k] += i128::from(r.planned_bytes());
        delta[f as usize] -= i128::from(r.planned_bytes());
    }
    let mut live = 0i128;
    delta
        .iter()
        .map(|d| {
            live += d;
            live
        })
        .max()
        .map_or(0, |m| u64::try_from(m).unwrap_or(0))
}

/// The time of the most bytes live (all of `requests`, the first on a tie)
/// within the window `[c0, c1)`.
fn window_peak(requests: &[PlanRequest], (c0, c1): (u32, u32)) -> u32 {
    let n = requests.len() as u32;
    let mut delta = vec![0i128; c1 as usize + 1];
    for (k, r) in requests.iter().enumerate().take(c1 as usize) {
        let f = r.freed_at.unwrap_or(n).clamp(k as u32 + 1, n).min(c1);
        delta[k] += i128::from(r.planned_bytes());
        delta[f as usize] -= i128::from(r.planned_bytes());
    }
    let (mut live, mut peak, mut peak_at) = (0i128, -1i128, c0);
    for (t, d) in delta.iter().enumerate().take(c1 as usize) {
        live += d;
        if t as u32 >= c0 && live > peak {
            (peak, peak_at) = (live, t as u32);
        }
    }
    peak_at
}

/// [`aliased_steps`] with the requests `floor` marks (they stay to the
/// end) stacked below the windows, and the physical pieces of every
/// request. The arenas tried start at the most bytes live above the floor
/// at once, when that passes the bound less the floor.
#[allow(clippy::type_complexity)]
fn aliased_steps_layout(
    reqs: &[PlanRequest],
    windows: &[(u32, u32)],
    lower_bound: u64,
    floor: &[bool],
) -> Option<(u64, Vec<Vec<(u64, u64)>>)> {
    let n = reqs.len() as u32;
    let floor_bytes = floor_bytes(reqs, floor);
    let mut items: Vec<Vec<StepItem>> = Vec::with_capacity(windows.len());
    let mut zone = 0u64;
    for (s, &(c0, c1)) in windows.iter().enumerate() {
        let next_end = windows.get(s + 1).map_or(n, |w| w.1);
        let mut step = Vec::with_capacity((c1 - c0) as usize);
        for k in (c0..c1).filter(|&k| !floor[k as usize]) {
            let f = reqs[k as usize].freed_at.unwrap_or(n).max(k + 1);
            let reach = match f {
                _ if f <= c1 => Reach::Step,
                _ if f <= next_end => Reach::Next,
                _ => Reach::Later,
            };
            let t1 = if reach == Reach::Step { f - c0 } else { c1 - c0 };
            step.push(StepItem { k, size: reqs[k as usize].planned_bytes(), t0: k - c0, t1, reach });
        }
        let kept: u64 = step.iter().filter(|i| i.reach == Reach::Next).map(|i| i.size).sum();
        zone = zone.max(kept);
        items.push(step);
    }
    if zone == 0 {
        return None;
    }
    let zone = zone.div_ceil(ALIASED_PAGE).checked_mul(ALIASED_PAGE)?;
    let base = lower_bound.saturating_sub(floor_bytes).max(above_floor_peak(reqs, floor)).max(2 * zone);
    // `base` plus sixteenths of 1/256 of it, in whole pages.
    let mut arenas: Vec<u64> = Vec::new();
    for sixteenths in [0u64, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32] {
        let extra = u64::try_from(u128::from(base) * u128::from(sixteenths) / 4096).ok()?;
        let arena = base.checked_add(extra)?.div_ceil(ALIASED_PAGE).checked_mul(ALIASED_PAGE)?;
        if arenas.last().is_none_or(|&a| a < arena) {
            arenas.push(arena);
        }
    }
    let mut work = 0u64;
    let mut layout = |arena: u64| -> Option<(u64, Vec<Vec<(u64, u64)>>)> {
        let offsets = chain_steps(&items, windows, reqs, arena, zone, &mut work)?;
        // Each request's physical pieces: the floor stacked at the bottom,
        // the steps' windows above it.
        let mut pieces: Vec<Vec<(u64, u64)>> = vec![Vec::new(); reqs.len()];
        let mut top = 0u64;
        for k in (0..n).filter(|&k| floor[k as usize]) {
            let end = top.checked_add(reqs[k as usize].planned_bytes())?;
            pieces[k as usize].push((top, end));
            top = end;
        }
        for (s, step) in items.iter().enumerate() {
            for it in step {
                let off = offsets[it.k as usize]?;
                let (o, e) = (off, off.checked_add(it.size)?);
                let at = &mut pieces[it.k as usize];
                if s % 2 == 0 {
                    at.push((o, e));
                } else {
                    wasmem_plan_core::swap_zones(o, e, arena, zone, at);
                }
                at.iter_mut().for_each(|p| *p = (p.0 + top, p.1 + top));
            }
        }
        let order: Vec<(u32, Option<u64>)> = (0..n).map(|k| (k, None)).collect();
        placed_in_pieces(reqs, &pieces, &vec![true; reqs.len()], &order).map(|a| (a, pieces))
    };
    // The smallest arena first, then the largest: when both hold, the
    // smallest between them that holds (halving; a larger arena holds
    // what a smaller one does, but for the greedy orders' whims).
    if let Some(made) = layout(arenas[0]) {
        return Some(made);
    }
    let (mut lo, mut hi) = (0usize, arenas.len() - 1);
    if hi == 0 {
        return None;
    }
    let mut best = layout(arenas[hi])?;
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        match layout(arenas[mid]) {
            Some(made) => (best, hi) = (made, mid),
            None => lo = mid,
        }
    }
    Some(best)
}

/// The window offset of every request of `items` (the steps of `windows`)
/// placed as [`aliased_steps`] says in an arena of `arena` bytes with zones
/// of `zone` (indexed by request; the floor's `None`); `None` when a step
/// cannot be placed, or `work` (block visits, added to) passes
/// [`MAX_ALIASED_WORK`].
fn chain_steps(
    items: &[Vec<StepItem>],
    windows: &[(u32, u32)],
    reqs: &[PlanRequest],
    arena: u64,
    zone: u64,
    work: &mut u64,
) -> Option<Vec<Option<u64>>> {
    let mut offsets: Vec<Option<u64>> = vec![None; reqs.len()];
    // The previous step's kept tensors (offset in its window) and what
    // outlives the next step (offset in the middle).
    let (mut kept, mut later): (Vec<u32>, Vec<u32>) = (Vec::new(), Vec::new());
    let mut order: Vec<usize> = Vec::new();
    let (mut blocks, mut occupied): (Vec<WindowBlock>, Vec<(u64, u64)>) = (Vec::new(), Vec::new());
    for (step, &(c0, c1)) in items.iter().zip(windows) {
        let m = c1 - c0;
        let freed = |k: u32| reqs[k as usize].freed_at.unwrap_or(u32::MAX);
        later.retain(|&k| freed(k) > c0);
        let mut fixed: Vec<WindowBlock> = Vec::with_capacity(kept.len() + later.len());
        for (&k, high) in kept.iter().map(|k| (k, true)).chain(later.iter().map(|k| (k, false))) {
            let off = offsets[k as usize]? + if high { arena - zone } else { 0 };
            let t1 = freed(k).min(c1) - c0;
            fixed.push(WindowBlock { off, end: off + reqs[k as usize].planned_bytes(), t0: 0, t1 });
        }
        // From then on nothing of the previous step is left.
        let late = kept.iter().map(|&k| freed(k).min(c1) - c0).max().unwrap_or(0);
        // The step's peak (with what it holds from before).
        let mut delta = vec![0i128; m as usize + 1];
        for (t0, t1, size) in
            fixed.iter().map(|b| (b.t0, b.t1, b.end - b.off)).chain(step.iter().map(|i| (i.t0, i.t1, i.size)))
        {
            delta[t0 as usize] += i128::from(size);
            delta[t1 as usize] -= i128::from(size);
        }
        let (mut live, mut most, mut peak) = (0i128, -1i128, 0u32);
        for (t, d) in delta.iter().enumerate() {
            live += d;
            if live > most {
                (most, peak) = (live, t as u32);
            }
        }
        // Each order as it is, then (when none places the step) each again
        // with the requests that failed it placed first.
        let mut placed_all = false;
        'orders: for (how, promote) in (0..STEP_ORDERS).map(|h| (h, false)).chain((0..STEP_ORDERS).map(|h| (h, true))) {
            let mut first: Vec<usize> = Vec::new();
            loop {
                order.clear();
                order.extend(0..step.len());
                sort_step(&mut order, step, how, peak);
                promoted(&mut order, &first, step);
                blocks.clear();
                blocks.extend_from_slice(&fixed);
                let place = Window { arena, zone, late };
                match place_step(step, &order, &place, &mut blocks, &mut occupied, &mut offsets, work) {
                    Placed::All => {
                        placed_all = true;
                        break 'orders;
                    }
                    Placed::OutOfWork => return None,
                    Placed::Failed(i) => {
                        if !promote || step[i].reach != Reach::Step || first.len() >= STEP_PROMOTIONS {
                            break;
                        }
                        first.push(i);
                    }
                }
            }
        }
        if !placed_all {
            return None;
        }
        kept = step.iter().filter(|i| i.reach == Reach::Next).map(|i| i.k).collect();
        later.extend(step.iter().filter(|i| i.reach == Reach::Later).map(|i| i.k));
    }
    Some(offsets)
}

/// How many requests of a step [`chain_steps`] moves to the front of an
/// order that fails to place it, one per retry (iterative repair: a request
/// left without a gap is placed before those that took its room).
const STEP_PROMOTIONS: usize = 32;

/// The window a step of [`chain_steps`] is placed in: its arena, its end
/// zones, and the step's time from which the previous step's tensors are
/// all freed.
struct Window {
    arena: u64,
    zone: u64,
    late: u32,
}

/// What [`place_step`] did.
enum Placed {
    /// Every request of the step is placed.
    All,
    /// The request at this index of the step found no gap.
    Failed(usize),
    /// The work bound ([`MAX_ALIASED_WORK`]) was passed.
    OutOfWork,
}

/// Places the requests of `step` in `order`, each in the smallest gap of
/// its range of `w` among `blocks` (the fixed blocks, then those placed
/// so far) that live with it, and records its window offset in `offsets`.
fn place_step(
    step: &[StepItem],
    order: &[usize],
    w: &Window,
    blocks: &mut Vec<WindowBlock>,
    occupied: &mut Vec<(u64, u64)>,
    offsets: &mut [Option<u64>],
    work: &mut u64,
) -> Placed {
    for &i in order {
        let it = step[i];
        *work += blocks.len() as u64;
        if *work > MAX_ALIASED_WORK {
            return Placed::OutOfWork;
        }
        occupied.clear();
        occupied.extend(blocks.iter().filter(|b| b.t0 < it.t1 && it.t0 < b.t1).map(|b| (b.off, b.end)));
        let (lo, hi) = match it.reach {
            Reach::Step => (0, w.arena),
            Reach::Next => (0, w.zone),
            Reach::Later => (w.zone, w.arena - w.zone),
        };
        let Some(off) = smallest_gap_in(occupied, it.size, lo, hi, it.t0 >= w.late) else {
            return Placed::Failed(i);
        };
        blocks.push(WindowBlock { off, end: off + it.size, t0: it.t0, t1: it.t1 });
        offsets[it.k as usize] = Some(off);
    }
    Placed::All
}

/// Moves the indices `first` (in that order) of `order` to just before its
/// first request freed within the step (those kept past it stay first).
fn promoted(order: &mut Vec<usize>, first: &[usize], step: &[StepItem]) {
    if first.is_empty() {
        return;
    }
    order.retain(|i| !first.contains(i));
    let lead = order.iter().position(|&i| step[i].reach == Reach::Step).unwrap_or(order.len());
    order.splice(lead..lead, first.iter().copied());
}

/// Sorts `order` (indices of `step`) in the order `how` of [`STEP_ORDERS`];
/// `peak`: the step's time with the most bytes live.
fn sort_step(order: &mut [usize], step: &[StepItem], how: usize, peak: u32) {
    use std::cmp::Reverse;
    let life = |i: &StepItem| u64::from(i.t1 - i.t0);
    let at_peak = |i: &StepItem| i.t0 <= peak && peak < i.t1;
    // Those kept past the step first, whatever the order.
    let kept = |i: &StepItem| i.reach == Reach::Step;
    match how {
        0 => order.sort_by_key(|&x| {
            let i = &step[x];
            (kept(i), Reverse(i.size), Reverse(life(i)), i.k)
        }),
        1 => order.sort_by_key(|&x| {
            let i = &step[x];
            (kept(i), !at_peak(i), if at_peak(i) { i.t0 } else { 0 }, Reverse(i.size), Reverse(life(i)), i.k)
        }),
        2 => order.sort_by_key(|&x| {
            let i = &step[x];
            (
                kept(i),
                !at_peak(i),
                Reverse(if at_peak(i) { life(i) } else { 0 }),
                Reverse(i.size),
                Reverse(life(i)),
                i.k,
            )
        }),
        3 => order.sort_by_key(|&x| {
            let i = &step[x];
            (kept(i), Reverse(u128::from(i.size) * u128::from(life(i))), i.k)
        }),
        4 => order.sort_by_key(|&x| {
            let i = &step[x];
            (kept(i), Reverse(i.size), i.t0, i.k)
        }),
        _ => order.sort_by_key(|&x| {
            let i = &step[x];
            (kept(i), Reverse(life(i)), Reverse(i.size), i.k)
        }),
    }
}

/// The offset of the smallest gap of at least `size` bytes inside
/// `[lo, hi)` between the blocks `occupied` (the lowest on a tie): its low
/// end, or with `high` its high end; `None` when none holds it.
fn smallest_gap_in(occupied: &mut Vec<(u64, u64)>, size: u64, lo: u64, hi: u64, high: bool) -> Option<u64> {
    occupied.push((0, lo));
    occupied.push((hi, u64::MAX));
    occupied.sort_unstable_by_key(|b| b.0);
    let (mut best, mut top): (Option<(u64, u64)>, u64) = (None, 0);
    for &(off, end) in occupied.iter() {
        if off > top && off - top >= size && best.is_none_or(|(g, _)| off - top < g) {
            best = Some((off - top, if high { off - size } else { top }));
        }
        top = top.max(end);
    }
    best.map(|(_, off)| off)
}

/// The physical memory `reqs` need with the requests `pieces` names (a
/// nonempty entry) lying in those pieces (each over its request's
/// lifetime), the others placed in `order` at their hints where free, else
/// where they fit (`order` lists each request once). A request with
/// `pinned` pieces must get them; one whose pieces are only wished for
/// gets them all, or else is placed whole where it fits (its pieces are of
/// one virtual range: a request cannot lie in some of them). `None` unless
/// every request is placed and no two that live at once share a byte.
/// Each piece is one request of an expanded profile (a request's pieces
/// one after the other, nothing between them).
fn placed_in_pieces(
    reqs: &[PlanRequest],
    pieces: &[Vec<(u64, u64)>],
    pinned: &[bool],
    order: &[(u32, Option<u64>)],
) -> Option<u64> {
    let n = reqs.len();
    let mut pieces = pieces.to_vec();
    // A few rounds: each drops the wished-for pieces that did not all fit.
    for _ in 0..4 {
        let mut idx = Vec::with_capacity(n + 1);
        let mut t = 0u32;
        for f in &pieces {
            idx.push(t);
            t = t.checked_add(f.len().max(1) as u32)?;
        }
        idx.push(t);
        let mut expanded = Vec::with_capacity(t as usize);
        for (k, (r, f)) in reqs.iter().zip(&pieces).enumerate() {
            let end = idx[r.freed_at.map_or(n, |f| (f as usize).min(n))];
            let sizes: Vec<u64> = if f.is_empty() { vec![r.bytes] } else { f.iter().map(|&(o, e)| e - o).collect() };
            for (j, bytes) in sizes.into_iter().enumerate() {
                let at = idx[k] + j as u32;
                expanded.push(PlanRequest { bytes, freed_at: Some(end.max(at + 1)), wraps_to: None, ..*r });
            }
        }
        let mut out: Vec<(u32, Option<u64>)> = Vec::with_capacity(t as usize);
        for &(k, hint) in order {
            let f = &pieces[k as usize];
            if f.is_empty() {
                out.push((idx[k as usize], hint));
            } else {
                out.extend(f.iter().enumerate().map(|(j, &(o, _))| (idx[k as usize] + j as u32, Some(o))));
            }
        }
        let plan = placed(&expanded, &out)?;
        let moved: Vec<usize> = (0..n)
            .filter(|&k| {
                pieces[k].iter().enumerate().any(|(j, &(o, _))| plan.offsets[(idx[k] + j as u32) as usize] != Some(o))
            })
            .collect();
        if moved.is_empty() {
            return Some(plan.arena_bytes);
        }
        if moved.iter().any(|&k| pinned[k]) {
            return None;
        }
        for k in moved {
            pieces[k].clear();
        }
    }
    None
}

/// `reqs` placed in `order` at their hints where free
/// ([`wasmem_plan_core::place_hinted`]): `None` unless every request is
/// placed and the plan is valid.
fn placed(reqs: &[PlanRequest], order: &[(u32, Option<u64>)]) -> Option<Plan> {
    let core: Vec<wasmem_plan_core::Request> = reqs.iter().map(|r| r.core()).collect();
    let p = wasmem_plan_core::place_hinted(&core, order);
    let plan = Plan { arena_bytes: p.arena_bytes, offsets: p.offsets };
    let complete = plan.offsets.iter().all(Option::is_some);
    let profile = StepProfile { step: 0, requests: reqs.to_vec() };
    (complete && validate_plan(&profile, &plan, u64::MAX).is_ok()).then_some(plan)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::builtin::GreedyPlanner;
    use crate::types::TensorKind;

    fn alloc(id: u64, bytes: u64) -> Event {
        Event::Alloc { id, bytes, kind: TensorKind::Temp, stream: 0, t_us: None }
    }
    fn free(id: u64) -> Event {
        Event::Free { id, t_us: None }
    }

    #[test]
    fn plans_a_workload_to_its_bound() {
        // 1 and 2 overlap, 3 reuses 1's place; 4 is never freed.
        let ev = vec![alloc(1, 1000), alloc(2, 2048), free(1), alloc(3, 1024), free(2), alloc(4, 512), free(3)];
        let w = Workload::from_events("t", ev);
        let p = plan_offline(&w, &mut GreedyPlanner::default()).unwrap();
        assert_eq!(p.requests, 4);
        assert_eq!(p.peak_live_bytes, 3072);
        assert_eq!(p.lower_bound_bytes, 3072);
        assert_eq!(p.arena_bytes, 3072);
        assert!(p.offline_bound);
    }

    #[test]
    fn equal_sizes_in_time_order_and_the_floor_reach_near_the_bound() {
        // GPT-2 shaped, 4 layers, batch 2 × 256: greedy by size with longer
        // lifetimes first among equal sizes, with or without the floor, ends
        // 2.6 % above the live bound (the logits and the embedding's
        // optimizer temporaries); with equal sizes in time order and the
        // floor, 0.45 %.
        let spec = crate::model::ModelSpec {
            layers: 4,
            seq: 256,
            batch: 2,
            steps: 3,
            ..crate::model::ModelSpec::preset("gpt2-124m").unwrap()
        };
        let w = Workload::from_events("gpt2-4l", crate::synth::synth(&spec).unwrap());
        let p = plan_offline(&w, &mut GreedyPlanner::default()).unwrap();
        let ratio = p.arena_bytes as f64 / p.lower_bound_bytes as f64;
        assert!(ratio <= 1.005, "offline plan {ratio:.5} of its bound");
    }

    /// The whole of `w` as one profile, as [`plan_offline`] hands it.
    fn whole(w: &Workload) -> StepProfile {
        let mut out = Vec::new();
        plan_offline(w, &mut Recorder(&mut out)).unwrap();
        out.swap_remove(0)
    }

    /// A planner that plans greedily and keeps the profiles it is asked.
    struct Recorder<'a>(&'a mut Vec<StepProfile>);
    impl PlannerPolicy for Recorder<'_> {
        fn name(&self) -> &str {
            "recorder"
        }
        fn plan(&mut self, profile: &StepProfile, _ctx: &PolicyContext) -> Result<Plan, PolicyError> {
            self.0.push(profile.clone());
            Ok(GreedyPlanner::plan_profile(profile))
        }
    }

    #[test]
    fn the_plans_of_the_steps_composed_reach_the_bound_where_the_whole_does_not() {
        // A small GPT-2 (1 layer, hidden 384, AdamW, 7 steps): planned as one
        // profile the trace ends 0.8 % above its bound; each step (with what
        // crosses into it) is planned to its own bound, and with the
        // parameters and optimizer states as a floor the steps compose to
        // the bound exactly.
        let spec = crate::model::ModelSpec {
            layers: 1,
            hidden: 384,
            heads: 6,
            kv_heads: 6,
            intermediate: 1536,
            vocab: 8000,
            seq: 256,
            batch: 1,
            dtype_bytes: 4,
            optimizer: crate::model::Optimizer::Adamw,
            checkpointing: false,
            steps: 7,
            ..crate::model::ModelSpec::preset("tiny").unwrap()
        };
        let w = Workload::from_events("gpt2-small", crate::synth::synth(&spec).unwrap());
        let p = plan_offline(&w, &mut GreedyPlanner::default()).unwrap();
        assert_eq!((p.composition, p.steps), (Composition::Steps, 7));
        assert_eq!(p.arena_bytes, p.lower_bound_bytes);
        let profile = whole(&w);
        let alone = GreedyPlanner::plan_profile(&profile);
        let ratio = alone.arena_bytes as f64 / p.lower_bound_bytes as f64;
        assert!(ratio > 1.005, "the whole alone: {ratio:.5}");
        // The planner was asked for the whole, the floor's rest, and each
        // distinct step profile (alike steps once).
        let mut asked = Vec::new();
        plan_offline(&w, &mut Recorder(&mut asked)).unwrap();
        assert!(asked.len() > 3 && asked.len() < 2 + 2 * 2 * 7, "{} profiles", asked.len());
        assert_eq!(asked[0], profile);
        for a in &asked[1..] {
            assert!(a.requests.len() < profile.requests.len());
            assert!(a.requests.iter().enumerate().all(|(k, r)| r.freed_at.is_some_and(|f| f as usize > k)));
        }
    }

    /// A loop that keeps each step's output until the next step's output
    /// is made (`prev = model(x)`): `steps` steps after a first one that
    /// also makes the parameters. Returns the events.
    fn kept_output_loop(steps: u64) -> Vec<Event> {
        let step_end = |s: u64| Event::Phase { phase: Phase::StepEnd, step: s };
        let mut ev = vec![alloc(1, 4096)];
        let mut id = 2;
        let mut prev: Option<u64> = None;
        for s in 0..steps {
            let (a, b, out, g) = (id, id + 1, id + 2, id + 3);
            id += 4;
            ev.extend([alloc(a, 8192), alloc(b, 12288), alloc(out, 16384), free(a)]);
            ev.extend(prev.map(free));
            ev.extend([free(b), alloc(g, 20480), free(g), step_end(s)]);
            prev = Some(out);
        }
        ev
    }

    /// The whole of `w` (a first request, then steps of `per` requests):
    /// its profile, its steps and its live bound.
    fn stepped(w: &Workload, per: u32) -> (StepProfile, Vec<(u32, u32)>, u64) {
        let profile = whole(w);
        let n = profile.requests.len() as u32;
        let cuts: Vec<u32> = (1..).map(|s| 1 + per * s).take_while(|&c| c <= n).collect();
        let all: Vec<Option<u64>> = vec![Some(0); profile.requests.len()];
        let bound = crate::decision::cycle_live(&profile.requests, &all).into_iter().max().unwrap();
        let windows = steps(n, &cuts);
        (profile, windows, bound)
    }

    #[test]
    fn a_loop_that_keeps_its_output_into_the_next_step_is_planned_as_a_cycle() {
        // Each output lives into the next step past the allocation of its
        // next instance: composed step by step, each later step finds the
        // place its plan gives the output taken by the previous output.
        // Two steps as a cycle (one instance of the output wraps to the
        // next window's start) reach the live bound.
        let w = Workload::from_events("kept", kept_output_loop(9));
        let (profile, windows, bound) = stepped(&w, 4);
        assert_eq!(windows.len(), 9, "{windows:?}");
        let mut planner = GreedyPlanner::default();
        let mut parts = Parts { planner: &mut planner, ctx: PolicyContext::default() };
        let by_steps = parts.by_steps(&profile.requests, &windows).unwrap();
        assert!(by_steps.arena_bytes > bound, "steps {} bound {bound}", by_steps.arena_bytes);
        let (arena, how) = parts.by_cycle(&profile.requests, &windows).unwrap();
        assert_eq!((arena, how), (bound, Composition::Cycle));
        // Too few windows (the first and two that repeat): no cycle.
        assert!(parts.by_cycle(&profile.requests, &windows[..4]).is_none());
        let p = plan_offline(&w, &mut GreedyPlanner::default()).unwrap();
        assert_eq!(p.arena_bytes, p.lower_bound_bytes, "{p:?}");
        assert_eq!(Composition::Cycle.name(), "cycle");
    }

    /// A training loop (MiB-sized tensors) that keeps each step's output
    /// until after the next step's peak, `steps` steps.
    fn kept_past_the_peak(steps: u64) -> Vec<Event> {
        const M: u64 = 1 << 20;
        let step_end = |s: u64| Event::Phase { phase: Phase::StepEnd, step: s };
        let mut ev = vec![alloc(1, 8 * M)];
        let mut id = 2;
        let mut prev: Option<u64> = None;
        for s in 0..steps {
            let (x, h, out, t, g) = (id, id + 1, id + 2, id + 3, id + 4);
            id += 5;
            ev.extend([alloc(x, 4 * M), alloc(h, 20 * M), alloc(out, 16 * M), alloc(t, 24 * M), free(t)]);
            ev.extend([alloc(g, 20 * M), free(h), free(g)]);
            ev.extend(prev.map(free));
            ev.extend([free(x), step_end(s)]);
            prev = Some(out);
        }
        ev
    }

    #[test]
    fn a_window_of_two_like_steps_is_also_composed_in_an_aliased_arena() {
        // Each output lives past the next step's peak. The window of two
        // steps planned in an aliased arena (its second step's output in a
        // zone the next window's first step sees swapped), the first window
        // in the pieces of the requests it lines up with: the live bound,
        // in physical memory, as the plain cycle.
        let (profile, windows, bound) = stepped(&Workload::from_events("kept", kept_past_the_peak(9)), 5);
        let mut planner = GreedyPlanner::default();
        let mut parts = Parts { planner: &mut planner, ctx: PolicyContext::default() };
        let [plain, aliased] = parts.cycle_of(&profile.requests, &windows, 2).unwrap();
        assert_eq!(plain, Some((bound, Composition::Cycle)));
        assert_eq!(aliased, Some((bound, Composition::AliasedCycle)));
        // One step at a time, two instances of the output live at once: no cycle.
        assert!(parts.cycle_of(&profile.requests, &windows, 1).is_none());
        assert_eq!(Composition::AliasedCycle.name(), "aliased cycle");
    }

    /// A training loop of `layers` layers (an activation kept for the
    /// backward and a temporary each, MiB-sized) that keeps each step's
    /// output until the next step's backward ends, with an evaluation
    /// forward after every third step's training (a temporary of a size
    /// that grows from one to the next, and an output of another size kept
    /// in place of the training one): no window of steps repeats.
    fn kept_with_evaluations(steps: u64, layers: u64) -> Vec<Event> {
        const M: u64 = 1 << 20;
        let (mut ev, mut id, mut prev) = (vec![alloc(1, 8 * M)], 2u64, None::<u64>);
        for s in 0..steps {
            // Forward: an activation per layer, kept for the backward, and a temporary.
            let acts: Vec<u64> = (id..id + layers).collect();
            id += layers;
            for (l, &a) in acts.iter().enumerate() {
                ev.extend([alloc(a, (4 + (l as u64 * 7) % 5) * M), alloc(id, (3 + (l as u64 * 3) % 4) * M), free(id)]);
                id += 1;
            }
            let (out, t) = (id, id + 1);
            id += 2;
            ev.extend([alloc(out, 16 * M), alloc(t, 24 * M), free(t)]);
            // Backward: a gradient temporary per layer, the activations freed in reverse.
            for (l, &a) in acts.iter().enumerate().rev() {
                ev.extend([alloc(id, (2 + (l as u64 * 5) % 6) * M), free(a), free(id)]);
                id += 1;
            }
            ev.extend(prev.map(free));
            prev = Some(out);
            if s % 3 == 2 {
                let (e, kept) = (id, id + 1);
                id += 2;
                ev.extend([alloc(e, (26 + s) * M), alloc(kept, 12 * M), free(e)]);
                ev.extend(prev.map(free));
                prev = Some(kept);
            }
            ev.push(Event::Phase { phase: Phase::StepEnd, step: s });
        }
        ev
    }

    #[test]
    fn steps_that_keep_their_output_but_never_repeat_are_placed_one_by_one_in_aliased_windows() {
        // An evaluation every third step: no window repeats (no cycle), and
        // the plans of the steps composed stay above the bound (each output
        // must move where the next step's plan needs its place). Each step
        // on its own in alternate aliased windows: the live bound, in whole
        // pages.
        let w = Workload::from_events("evaluating", kept_with_evaluations(12, 24));
        let (profile, windows, bound) = stepped_by_markers(&w);
        assert_eq!(windows.len(), 12);
        let mut planner = GreedyPlanner::default();
        let mut parts = Parts { planner: &mut planner, ctx: PolicyContext::default() };
        assert!(parts.by_cycle(&profile.requests, &windows).is_none());
        let by_steps = parts.by_steps(&profile.requests, &windows).unwrap();
        assert!(by_steps.arena_bytes > bound, "steps {} bound {bound}", by_steps.arena_bytes);
        let (arena, pieces) =
            aliased_steps_layout(&profile.requests, &windows, bound, &floor_marks(&profile.requests)).unwrap();
        let floor = profile.requests[0].planned_bytes();
        assert_eq!(arena, floor + (bound - floor).div_ceil(ALIASED_PAGE) * ALIASED_PAGE);
        // Checked here on its own: every request in pieces of its bytes,
        // no two live at once sharing one.
        let reqs = &profile.requests;
        let n = reqs.len() as u32;
        let life = |k: usize| (k as u32, reqs[k].freed_at.unwrap_or(n).max(k as u32 + 1));
        for (k, p) in pieces.iter().enumerate() {
            assert_eq!(p.iter().map(|&(o, e)| e - o).sum::<u64>(), reqs[k].planned_bytes(), "request {k}");
            assert!(p.iter().all(|&(o, e)| o < e && e <= arena), "request {k}: {p:?}");
            for (j, q) in pieces.iter().enumerate().take(k) {
                let ((a0, a1), (b0, b1)) = (life(j), life(k));
                let share = p.iter().any(|&(o, e)| q.iter().any(|&(u, v)| o < v && u < e));
                assert!(!(a0 < b1 && b0 < a1 && share), "requests {j} and {k} share bytes while both live");
            }
        }
        // (Here the whole, searched, reaches the bound itself: recorded
        // loops, where it does not, are in tests/plan_cli.rs.)
        let p = plan_offline(&w, &mut GreedyPlanner::default()).unwrap();
        assert!(p.arena_bytes <= arena, "{p:?}");
        assert_eq!(Composition::AliasedSteps.name(), "aliased steps");
        // Nothing kept into the next step: not composed so.
        let plain = Workload::from_events("plain", kept_output_loop(1));
        let (profile, windows, bound) = stepped_by_markers(&plain);
        assert!(aliased_steps(&profile.requests, &windows, bound).is_none());
    }

    #[test]
    fn aliased_steps_are_cut_at_the_steps_then_at_the_forward_passes() {
        // Two steps of two micro-batches each (forward markers at 0, 5, 10,
        // 15), 20 requests.
        let cuts = [10, 20];
        let passes = [0, 5, 10, 15];
        assert_eq!(aliased_cuts(20, &cuts, &passes), vec![vec![(0, 10), (10, 20)], steps(20, &[5, 10, 15])]);
        // One pass a step: the steps only; no marker, or one window: none.
        assert_eq!(aliased_cuts(20, &cuts, &[0, 10]), vec![vec![(0, 10), (10, 20)]]);
        assert!(aliased_cuts(20, &[], &[]).is_empty());
        assert_eq!(aliased_cuts(20, &[], &passes), vec![steps(20, &[5, 10, 15])]);
    }

    #[test]
    fn a_request_that_no_order_places_is_placed_first_on_a_retry() {
        // One step of eight requests (units of 4 KiB, lifetimes in the
        // step's times) in an arena of exactly its live peak: each of the
        // orders leaves one without a gap; moving the ones that fail to
        // the front, one per retry, places them all.
        const U: u64 = 4096;
        let shape = [(3, 0, 1), (1, 1, 3), (3, 2, 6), (2, 3, 7), (4, 4, 8), (2, 5, 6), (4, 6, 7), (3, 7, 8)];
        let step: Vec<StepItem> = shape
            .iter()
            .enumerate()
            .map(|(k, &(size, t0, t1))| StepItem { k: k as u32, size: size * U, t0, t1, reach: Reach::Step })
            .collect();
        let reqs: Vec<PlanRequest> = step
            .iter()
            .map(|i| PlanRequest {
                bytes: i.size,
                kind: TensorKind::Activation,
                stream: StreamId(0),
                freed_at: Some(i.t1),
                wraps_to: None,
            })
            .collect();
        let live = |t: u32| step.iter().filter(|i| i.t0 <= t && t < i.t1).map(|i| i.size).sum::<u64>();
        let (peak_at, arena) = (0..8).map(|t| (t, live(t))).rev().max_by_key(|&(_, b)| b).unwrap();
        let w = Window { arena, zone: 0, late: 0 };
        let mut work = 0;
        for how in 0..STEP_ORDERS {
            let mut order: Vec<usize> = (0..step.len()).collect();
            sort_step(&mut order, &step, how, peak_at);
            let (mut blocks, mut occupied, mut offsets) = (Vec::new(), Vec::new(), vec![None; step.len()]);
            let placed = place_step(&step, &order, &w, &mut blocks, &mut occupied, &mut offsets, &mut work);
            assert!(matches!(placed, Placed::Failed(_)), "order {how} places the step");
        }
        let offsets =
            chain_steps(std::slice::from_ref(&step), &[(0, 8)], &reqs, arena, 0, &mut work).expect("placed on a retry");
        for (i, a) in step.iter().enumerate() {
            let o = offsets[i].unwrap();
            assert!(o + a.size <= arena, "request {i} at {o} out of {arena}");
            for (j, b) in step.iter().enumerate().take(i) {
                let p = offsets[j].unwrap();
                let (share, live) = (o < p + b.size && p < o + a.size, a.t0 < b.t1 && b.t0 < a.t1);
                assert!(!(share && live), "requests {j} and {i} share bytes while both live");
            }
        }
        let mut order = vec![3, 0, 5, 1];
        promoted(&mut order, &[5, 1], &step);
        assert_eq!(order, vec![5, 1, 3, 0]);
    }

    #[test]
    fn what_stays_to_the_end_but_comes_after_the_first_peak_lies_above_the_floor() {
        // The loop of evaluations above, whose first step holds 40 MiB
        // more (a workspace of its own), then makes states (an optimizer's,
        // made lazily) that stay to the end. Stacked under every step with
        // the parameters, they add to the first step's peak, which they
        // missed: the arena passes the bound by 24 MiB. Placed in the
        // middle of the windows instead, where the first step's tensors
        // were: the bound, in whole pages.
        const M: u64 = 1 << 20;
        let mut ev = kept_with_evaluations(6, 24);
        let end = ev.iter().position(|e| matches!(e, Event::Phase { phase: Phase::StepEnd, .. })).unwrap();
        ev.splice(end..end, std::iter::once(free(2_000_000)).chain((0..3).map(|j| alloc(1_000_000 + j, 16 * M))));
        ev.insert(1, alloc(2_000_000, 40 * M));
        let w = Workload::from_events("late states", ev);
        let (profile, windows, bound) = stepped_by_markers(&w);
        let reqs = &profile.requests;
        let floor = floor_marks(reqs);
        let stacked = floor_bytes(reqs, &floor) + above_floor_peak(reqs, &floor);
        assert_eq!(stacked, bound + 24 * M);
        let whole = aliased_steps_layout(reqs, &windows, bound, &floor).map(|(a, _)| a);
        assert!(whole.is_none_or(|a| a >= stacked), "{whole:?}");
        let arena = aliased_steps(reqs, &windows, bound).unwrap();
        let params = reqs[0].planned_bytes();
        assert_eq!(arena, params + (bound - params).div_ceil(ALIASED_PAGE) * ALIASED_PAGE);
        let p = plan_offline(&w, &mut GreedyPlanner::default()).unwrap();
        assert!(p.arena_bytes <= arena && p.overhead_ratio <= 1.002, "{p:?}");
    }

    /// The whole of `w`, its steps as its `step_end` markers cut them, and its live bound.
    fn stepped_by_markers(w: &Workload) -> (StepProfile, Vec<(u32, u32)>, u64) {
        let profile = whole(w);
        let n = profile.requests.len() as u32;
        let mut cuts = Vec::new();
        let mut k = 0u32;
        for ev in w.events().unwrap() {
            match ev.unwrap() {
                Event::Alloc { .. } => k += 1,
                Event::Phase { phase: Phase::StepEnd, .. } => cuts.push(k),
                _ => {}
            }
        }
        let all: Vec<Option<u64>> = vec![Some(0); profile.requests.len()];
        let bound = crate::decision::cycle_live(&profile.requests, &all).into_iter().max().unwrap();
        (profile, steps(n, &cuts), bound)
    }

    #[test]
    fn pinned_pieces_that_meet_refuse_the_composition_and_wished_ones_give_way() {
        let r = |bytes: u64, freed_at: u32| PlanRequest {
            bytes,
            kind: crate::types::TensorKind::Activation,
            stream: StreamId(0),
            freed_at: Some(freed_at),
            wraps_to: None,
        };
        // Two requests live at once.
        let reqs = [r(1024, 2), r(1024, 2)];
        let order = [(0, None), (1, None)];
        let apart = vec![vec![(0, 512), (2048, 2560)], vec![(512, 1536)]];
        assert_eq!(placed_in_pieces(&reqs, &apart, &[true, true], &order), Some(2560));
        let meet = vec![vec![(0, 512), (512, 1024)], vec![(512, 1536)]];
        assert_eq!(placed_in_pieces(&reqs, &meet, &[true, true], &order), None);
        // Wished for: the second is placed whole where it fits instead.
        assert_eq!(placed_in_pieces(&reqs, &meet, &[true, false], &order), Some(2048));
    }

    #[test]
    fn windows_that_do_not_repeat_are_not_planned_as_a_cycle() {
        // The kept-output loop with a larger temporary in its sixth step:
        // no window of 1 to 4 steps repeats from the second on (windows of
        // three: steps 3–5 hold it, 6–8 do not; of four: too few).
        let mut ev = kept_output_loop(9);
        let temps: Vec<usize> = ev
            .iter()
            .enumerate()
            .filter(|(_, e)| matches!(e, Event::Alloc { bytes: 20480, .. }))
            .map(|(i, _)| i)
            .collect();
        if let Event::Alloc { bytes, .. } = &mut ev[temps[5]] {
            *bytes = 40960;
        }
        let w = Workload::from_events("odd", ev);
        let (profile, windows, _) = stepped(&w, 4);
        let mut planner = GreedyPlanner::default();
        let mut parts = Parts { planner: &mut planner, ctx: PolicyContext::default() };
        assert!(parts.by_cycle(&profile.requests, &windows).is_none());
        // The same loop without the odd step is one.
        let even = whole(&Workload::from_events("even", kept_output_loop(9)));
        assert!(parts.by_cycle(&even.requests, &windows).is_some());
        let p = plan_offline(&w, &mut GreedyPlanner::default()).unwrap();
        assert_ne!(p.composition, Composition::Cycle, "{p:?}");
    }

    /// A planner that plans the first profile greedily and fails, or
    /// answers nonsense, on every other.
    struct FirstOnly(u32, bool);
    impl PlannerPolicy for FirstOnly {
        fn name(&self) -> &str {
            "first-only"
        }
        fn plan(&mut self, profile: &StepProfile, _ctx: &PolicyContext) -> Result<Plan, PolicyError> {
            self.0 += 1;
            match (self.0, self.1) {
                (1, _) => Ok(GreedyPlanner::plan_profile(profile)),
                (_, true) => Err(PolicyError::InvalidDecision("no".into())),
                _ => Ok(Plan { arena_bytes: 512, offsets: vec![Some(0); profile.requests.len()] }),
            }
        }
    }

    #[test]
    fn parts_a_planner_cannot_plan_leave_its_plan_of_the_whole() {
        let spec = crate::model::ModelSpec { steps: 4, ..crate::model::ModelSpec::preset("tiny").unwrap() };
        let w = Workload::from_events("tiny", crate::synth::synth(&spec).unwrap());
        let alone = GreedyPlanner::plan_profile(&whole(&w));
        for fails in [true, false] {
            let mut planner = FirstOnly(0, fails);
            let p = plan_offline(&w, &mut planner).unwrap();
            assert_eq!(
                (p.composition, p.arena_bytes),
                (Composition::Whole, alone.arena_bytes.div_ceil(PLAN_ALIGN) * PLAN_ALIGN)
            );
            assert!(planner.0 > 1, "parts were asked");
        }
    }

    #[test]
    fn each_step_holds_what_is_live_at_its_start_then_its_own() {
        let mut rng = oorandom::Rand32::new(5);
        for _ in 0..50 {
            let n = 1 + rng.rand_range(1..300);
            let reqs: Vec<PlanRequest> = (0..n)
                .map(|k| PlanRequest {
                    bytes: 512,
                    kind: TensorKind::Temp,
                    stream: StreamId(0),
                    freed_at: Some((k + 1 + rng.rand_range(0..60)).min(n)),
                    wraps_to: None,
                })
                .collect();
            let cuts: Vec<u32> = (0..rng.rand_range(0..8)).map(|_| rng.rand_range(0..n + 1)).collect::<Vec<_>>();
            let mut cuts = cuts;
            cuts.sort_unstable();
            let windows = steps(n, &cuts);
            let idxs = step_requests(&reqs, &windows, usize::MAX).unwrap();
            for (&(c0, c1), idx) in windows.iter().zip(&idxs) {
                let brute: Vec<u32> =
                    (0..c0).filter(|&k| reqs[k as usize].freed_at.is_some_and(|f| f > c0)).chain(c0..c1).collect();
                assert_eq!(idx, &brute, "step [{c0}, {c1})");
            }
            let total: usize = idxs.iter().map(Vec::len).sum();
            assert!(step_requests(&reqs, &windows, total).is_some());
            assert!(step_requests(&reqs, &windows, total - 1).is_none());
        }
    }

    #[test]
    fn steps_are_cut_after_each_step_end() {
        assert_eq!(steps(10, &[3, 3, 7]), vec![(0, 3), (3, 7), (7, 10)]);
        assert_eq!(steps(10, &[0, 10]), vec![(0, 10)]);
        assert_eq!(steps(0, &[]), Vec::<(u32, u32)>::new());
        assert_eq!(steps(5, &[2, 9]), vec![(0, 2), (2, 5)]);
    }

    #[test]
    fn a_bad_free_names_the_event() {
        let w = Workload::from_events("t", vec![alloc(1, 10), free(2)]);
        let e = plan_offline(&w, &mut GreedyPlanner::default()).unwrap_err().to_string();
        assert!(e.contains("event 2") && e.contains("tensor 2"), "{e}");
    }
}
