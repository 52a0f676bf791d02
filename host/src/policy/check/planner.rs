//! The planner suite of `wasmem policy check` (WIT 0.3.0 on): plans for
//! fuzzed step profiles (or, with `--trace`, the profiles a replay of the
//! trace hands its planner), each on two instances.
//!
//! - valid plans: every plan passes the engine's own [`validate_plan`]
//!   against the context's capacity, and no call fails (a refusal, a trap
//!   or a limit is a failure);
//! - determinism: the two instances plan every profile alike;
//! - state: the state saved halfway loads into a fresh instance, which then
//!   plans the rest as the original;
//! - cost: the calls and their p50/p99 (the lower of the two measurements)
//!   against the engine's planning deadline
//!   ([`Runtime::planning_deadline`]: the decision deadline plus an
//!   allowance per request); the check fails when more than
//!   [`MAX_OVER_DEADLINE`](super::MAX_OVER_DEADLINE) of them would run past it.
//!
//! - aliased plans (WIT 0.4.0): on profiles of two like steps whose
//!   outputs outlive their next instance, every `plan-aliased` answer
//!   passes the engine's [`validate_aliased`] (in physical memory, pages of
//!   2 MiB), no call fails, and the two instances answer alike.
//!
//! The calls run under the suite's relaxed deadline scaled like the
//! engine's (see the parent module), so they are measured, not interrupted.

use std::time::{Duration, Instant};

use super::{human_ns, relaxed_deadline, Outcome, Verdict, A, B, MAX_OVER_DEADLINE};
use crate::alloc::LatencyHistogram;
use crate::decision::{
    cycle_live, validate_aliased, validate_plan, Plan, PlanRequest, PlannerPolicy, PolicyContext, PolicyError,
    StepProfile,
};
use crate::policy::{Loaded, Runtime, WasmPlanner, WasmPolicy};
use crate::types::{StreamId, TensorKind, GIB, MIB};

/// The fuzzed contexts' device capacity: 1 TiB.
const TIB: u64 = 1 << 40;

/// Calls and cost of the planner.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannerCost {
    /// Planning calls made.
    pub calls: u64,
    /// Median duration, nanoseconds (within 12.5 %).
    pub p50_ns: u64,
    /// 99th-percentile duration, nanoseconds.
    pub p99_ns: u64,
    /// Calls that took longer than the engine's planning deadline for them.
    pub over_deadline: u64,
    /// Requests of the largest profile planned.
    pub largest: usize,
}

/// One planning call: the profile, the context, the answer and its duration.
#[derive(Debug, Clone)]
pub(crate) struct PlanCall {
    pub profile: StepProfile,
    pub ctx: PolicyContext,
    pub answer: Result<Plan, PolicyError>,
    pub took: Duration,
}

/// SplitMix64 (the same generator as the other roles' fuzzed inputs).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next() % n
        }
    }
}

/// Sizes of the fuzzed profiles, cycled: edge cases and a few large steps.
const PROFILE_SIZES: [u32; 10] = [1, 2, 7, 40, 200, 600, 1500, 64, 3000, 350];

/// The context of a fuzzed planning call: a 1 TiB device (the fuzzed
/// profiles' lower bounds stay far below it, so an arena above it is the
/// planner's fault).
fn fuzz_context(step: u64) -> PolicyContext {
    PolicyContext { clock: step * 10_000, step, capacity_bytes: TIB, ..PolicyContext::default() }
}

/// `count` fuzzed step profiles from `seed`: random sizes (mostly up to
/// 64 MiB, a few edge sizes), kinds and streams; 80 % freed within the step
/// after a random life, the others live at its end, half of them with a
/// known wrap (anywhere in the step, so some are too late to plan); every
/// fourth profile is shaped like training (activations freed in reverse,
/// temporaries, gradients that wrap into the next step).
pub(crate) fn fuzzed_profiles(count: usize, seed: u64) -> Vec<(StepProfile, PolicyContext)> {
    let mut rng = Rng(seed ^ 0x9_1a22e5);
    (0..count)
        .map(|i| {
            let n = PROFILE_SIZES[i % PROFILE_SIZES.len()];
            let requests = if i % 4 == 3 { training_like(&mut rng, n) } else { random_profile(&mut rng, n) };
            (StepProfile { step: i as u64, requests }, fuzz_context(i as u64))
        })
        .collect()
}

fn gen_bytes(rng: &mut Rng) -> u64 {
    match rng.below(16) {
        0 => [1, 511, 512, 513, MIB - 1, MIB, MIB + 1, GIB][rng.below(8) as usize],
        _ => {
            let bits = 1 + rng.below(26);
            1 + rng.below(1 << bits)
        }
    }
}

fn random_profile(rng: &mut Rng, n: u32) -> Vec<PlanRequest> {
    (0..n)
        .map(|k| {
            let freed = rng.below(10) < 8;
            let life = rng.below(1 + u64::from(n) / 4) as u32;
            let freed_at = freed.then_some((k + 1 + life).min(n));
            let wraps_to = (!freed && rng.below(2) == 0).then(|| rng.below(u64::from(n)) as u32);
            PlanRequest {
                bytes: gen_bytes(rng),
                kind: TensorKind::ALL[rng.below(6) as usize],
                stream: StreamId(rng.below(3) as u32),
                freed_at,
                wraps_to,
            }
        })
        .collect()
}

fn training_like(rng: &mut Rng, n: u32) -> Vec<PlanRequest> {
    let layers = (n / 3).max(1);
    let act = |rng: &mut Rng| 1 + rng.below(8 * MIB);
    let mut rs = Vec::new();
    for _ in 0..layers {
        rs.push(PlanRequest {
            bytes: act(rng),
            kind: TensorKind::Activation,
            stream: StreamId(0),
            freed_at: None,
            wraps_to: None,
        });
    }
    for i in 0..layers {
        let k = rs.len() as u32;
        rs.push(PlanRequest {
            bytes: act(rng) / 4 + 1,
            kind: TensorKind::Temp,
            stream: StreamId(0),
            freed_at: Some(k + 1),
            wraps_to: None,
        });
        rs[(layers - 1 - i) as usize].freed_at = Some(k + 1);
    }
    for _ in 0..(n - 2 * layers).min(layers) {
        rs.push(PlanRequest {
            bytes: act(rng),
            kind: TensorKind::Grad,
            stream: StreamId(0),
            freed_at: None,
            wraps_to: Some(rng.below(u64::from(layers)) as u32),
        });
    }
    let len = rs.len() as u32;
    for r in rs.iter_mut() {
        if let Some(f) = r.freed_at.as_mut() {
            *f = (*f).min(len);
        }
    }
    rs
}

/// `count` profiles of two like training steps (from [`training_like`]
/// steps) in which some activations outlive their next instance (freed in
/// the next step after it is allocated, as the outputs of a loop that keeps
/// `out = model(x)` until the next forward): the profiles the engine hands
/// `plan-aliased`.
pub(crate) fn two_step_profiles(count: usize, seed: u64) -> Vec<(StepProfile, PolicyContext)> {
    let mut rng = Rng(seed ^ 0x0a11_a5ed);
    (0..count)
        .map(|i| {
            let one = training_like(&mut rng, 6 + 3 * (i as u32 % 40));
            let n = one.len() as u32;
            let mut first = one.clone();
            let mut second = one;
            for (k, (a, b)) in first.iter_mut().zip(second.iter_mut()).enumerate() {
                let k = k as u32;
                match (a.freed_at, a.wraps_to) {
                    (Some(f), _) if a.kind == TensorKind::Activation && rng.below(3) == 0 => {
                        // Kept: freed in the next step after its own next instance.
                        let j = (k + 1 + rng.below(u64::from(n - k)) as u32).min(n).max(f.min(n));
                        (a.freed_at, b.freed_at, b.wraps_to) = (Some(n + j), None, Some(j));
                    }
                    (Some(f), _) => b.freed_at = Some(n + f),
                    (None, Some(w)) => (a.freed_at, a.wraps_to) = (Some(n + w), None),
                    (None, None) => {}
                }
            }
            first.extend(second);
            (StepProfile { step: i as u64, requests: first }, fuzz_context(i as u64))
        })
        .collect()
}

/// One `plan-aliased` answer (`Ok(None)`: no aliased plan).
type AliasedAnswer = Result<Option<crate::decision::AliasedPlan>, PolicyError>;

/// The aliased plans of instances `a` and `b` for `profiles` (0.4.0
/// planners), judged: validity in physical memory and determinism.
pub(crate) fn judge_aliased(
    v: &mut Verdict,
    a: &WasmPolicy,
    b: &WasmPolicy,
    profiles: &[(StepProfile, PolicyContext)],
) {
    let item = "planner: valid aliased plans";
    if !a.wit_version().has_aliased_plans() {
        v.push(item, Outcome::Skip, format!("a planner of WIT {} makes none", a.wit_version()));
        return;
    }
    let answers = |p: &WasmPolicy| -> Vec<AliasedAnswer> {
        let Some(mut planner) = p.planner() else { return Vec::new() };
        profiles.iter().map(|(profile, ctx)| planner.plan_aliased(profile, ctx)).collect()
    };
    let (aa, ab) = (answers(a), answers(b));
    let mut bad = Vec::new();
    let mut planned = 0;
    for (i, ((profile, ctx), answer)) in profiles.iter().zip(&aa).enumerate() {
        let what = format!("aliased call {i} ({} requests)", profile.requests.len());
        match answer {
            Err(e) => bad.push(format!("{what}: {e}")),
            Ok(None) => {}
            Ok(Some(plan)) => match validate_aliased(profile, plan, 2 * MIB, ctx.capacity_bytes) {
                Err(e) => bad.push(format!("{what}: {e}")),
                Ok(()) => planned += 1,
            },
        }
    }
    match bad.first() {
        None => v.push(item, Outcome::Pass, format!("{planned} of {} two-step profiles planned aliased", aa.len())),
        Some(first) => {
            v.push(item, Outcome::Fail, format!("{} of {} calls failed; first: {first}", bad.len(), aa.len()))
        }
    }
    let item = "planner: aliased determinism";
    match aa.iter().zip(&ab).position(|(x, y)| x != y) {
        None => v.push(item, Outcome::Pass, format!("instances {A} and {B} answer all {} profiles alike", aa.len())),
        Some(i) => v.push(item, Outcome::Fail, format!("aliased call {i}: instances {A} and {B} answer differently")),
    }
}

/// Plans every profile on `p` (the planner of an instance), timing each.
pub(crate) fn run(p: &WasmPolicy, profiles: &[(StepProfile, PolicyContext)]) -> Vec<PlanCall> {
    let Some(mut planner) = p.planner() else { return Vec::new() };
    let mut failed = 0;
    profiles
        .iter()
        .map(|(profile, ctx)| {
            if failed >= 4 {
                // The engine would have disabled it long before.
                let answer = Err(PolicyError::Disabled);
                return PlanCall { profile: profile.clone(), ctx: *ctx, answer, took: Duration::ZERO };
            }
            let start = Instant::now();
            let answer = planner.plan(profile, ctx);
            let took = start.elapsed();
            failed += answer.is_err() as usize;
            PlanCall { profile: profile.clone(), ctx: *ctx, answer, took }
        })
        .collect()
}

/// A call named in reports: "planning call 3 (step 3, 7 requests)".
fn name(i: usize, c: &PlanCall) -> String {
    format!("planning call {i} (step {}, {} requests)", c.profile.step, c.profile.requests.len())
}

fn describe(r: &Result<Plan, PolicyError>) -> String {
    match r {
        Ok(p) => {
            let first: Vec<String> = p.offsets.iter().take(6).map(|o| format!("{o:?}")).collect();
            let more = if p.offsets.len() > 6 { ", …" } else { "" };
            format!("an arena of {} bytes, offsets [{}{more}]", p.arena_bytes, first.join(", "))
        }
        Err(e) => format!("an error ({e})"),
    }
}

/// The first call at or after `from` where two runs planned differently.
fn first_difference(a: (&str, &[PlanCall]), b: (&str, &[PlanCall]), from: usize) -> Option<String> {
    let n = a.1.len().min(b.1.len());
    (from..n).find(|&i| a.1[i].answer != b.1[i].answer).map(|i| {
        format!(
            "{}: instance {} planned {}, instance {} planned {}",
            name(i, &a.1[i]),
            a.0,
            describe(&a.1[i].answer),
            b.0,
            describe(&b.1[i].answer)
        )
    })
}

/// The state A saved halfway through its calls, for the state check.
pub(crate) struct Halfway<'a> {
    /// What instantiates the fresh instance.
    pub loaded: &'a Loaded,
    /// Its configuration.
    pub config: &'a str,
    /// A's state after the first half of the calls.
    pub state: Result<Vec<u8>, PolicyError>,
}

/// The planner's items of a verdict for the calls `ca` (instance A) and
/// `cb` (instance B) of the same profiles, `what` naming where the profiles
/// came from; `restore` is A's state halfway for the state check (`None`:
/// none, as in a trace check, whose profiles depend on the replay).
pub(crate) fn judge(
    v: &mut Verdict,
    rt: &Runtime,
    restore: Option<Halfway<'_>>,
    ca: &[PlanCall],
    cb: &[PlanCall],
    what: &str,
) {
    // Validity.
    let mut bad = Vec::new();
    let (mut requests, mut planned, mut arena, mut bound) = (0usize, 0usize, 0u128, 0u128);
    for (i, c) in ca.iter().enumerate() {
        match &c.answer {
            Err(e) => bad.push(format!("{}: {e}", name(i, c))),
            Ok(plan) => match validate_plan(&c.profile, plan, c.ctx.capacity_bytes) {
                Err(e) => bad.push(format!("{}: answered {}: {e}", name(i, c), describe(&c.answer))),
                Ok(()) => {
                    requests += c.profile.requests.len();
                    planned += plan.planned();
                    arena += u128::from(plan.arena_bytes);
                    bound += u128::from(cycle_live(&c.profile.requests, &plan.offsets).into_iter().max().unwrap_or(0));
                }
            },
        }
    }
    let item = format!("planner: valid plans{what}");
    match bad.first() {
        None if ca.is_empty() => v.push(&item, Outcome::Skip, "no planning call was made"),
        None => v.push(
            &item,
            Outcome::Pass,
            format!(
                "{} plans of {requests} requests, {planned} planned; arenas {:.3}× the live peak of what they plan",
                ca.len(),
                if bound == 0 { 1.0 } else { arena as f64 / bound as f64 }
            ),
        ),
        Some(first) => {
            v.push(&item, Outcome::Fail, format!("{} of {} calls failed; first: {first}", bad.len(), ca.len()))
        }
    }
    // Determinism.
    let item = format!("planner: determinism{what}");
    match first_difference((A, ca), (B, cb), 0) {
        None => v.push(&item, Outcome::Pass, format!("instances {A} and {B} plan all {} profiles alike", ca.len())),
        Some(d) => v.push(&item, Outcome::Fail, d),
    }
    // State.
    if let Some(h) = restore {
        let half = ca.len() / 2;
        let item = "planner: a restored instance continues like the original";
        match restored_run(h, rt, &ca[half..]) {
            Err(e) => v.push(item, Outcome::Fail, e),
            Ok(cc) => {
                let mut padded: Vec<PlanCall> = ca[..half].to_vec();
                padded.extend(cc);
                match first_difference((A, ca), ("C (fresh, loaded with A's state)", &padded), half) {
                    None => {
                        v.push(item, Outcome::Pass, format!("the last {} profiles planned as by {A}", ca.len() - half))
                    }
                    Some(d) => v.push(item, Outcome::Fail, d),
                }
            }
        }
    }
    cost(v, rt, ca, cb);
}

/// Plans `rest` on a fresh instance loaded with the state saved halfway.
fn restored_run(h: Halfway<'_>, rt: &Runtime, rest: &[PlanCall]) -> Result<Vec<PlanCall>, String> {
    let state = h.state.map_err(|e| format!("save-state failed: {e}"))?;
    let c = h.loaded.instantiate(h.config).map_err(|e| e.to_string())?;
    c.load_state(&state).map_err(|e| format!("load-state failed: {e}"))?;
    c.set_relaxed_deadline(relaxed_deadline(rt));
    let profiles: Vec<(StepProfile, PolicyContext)> = rest.iter().map(|c| (c.profile.clone(), c.ctx)).collect();
    Ok(run(&c, &profiles))
}

/// The planner's cost item.
fn cost(v: &mut Verdict, rt: &Runtime, ca: &[PlanCall], cb: &[PlanCall]) {
    let item = "cost: planning within the engine's deadline";
    let mut hist = LatencyHistogram::default();
    let (mut over, mut largest) = (0u64, 0usize);
    for (x, y) in ca.iter().zip(cb) {
        if matches!(x.answer, Err(PolicyError::Disabled)) {
            continue;
        }
        let took = x.took.min(y.took);
        let n = x.profile.requests.len();
        largest = largest.max(n);
        hist.record_duration(took, 1);
        if rt.planning_deadline(n).is_some_and(|d| took > d) {
            over += 1;
        }
    }
    if hist.count() == 0 {
        v.push(item, Outcome::Skip, "no planning call ran");
        return;
    }
    let c = PlannerCost {
        calls: hist.count(),
        p50_ns: hist.quantile(0.5),
        p99_ns: hist.quantile(0.99),
        over_deadline: over,
        largest,
    };
    let l = &rt.config().limits;
    let deadline = match l.deadline {
        Some(d) => format!(
            "deadline {} + {} per request",
            human_ns(d.as_nanos() as u64),
            human_ns(l.deadline_per_plan_request.as_nanos() as u64)
        ),
        None => "no deadline".to_string(),
    };
    let detail = format!(
        "planner {} calls (up to {} requests) p50 {} p99 {}, {} over the deadline; {deadline}",
        c.calls,
        c.largest,
        human_ns(c.p50_ns),
        human_ns(c.p99_ns),
        c.over_deadline
    );
    let outcome =
        if c.over_deadline as f64 > MAX_OVER_DEADLINE * c.calls as f64 { Outcome::Fail } else { Outcome::Pass };
    v.push(item, outcome, detail);
    v.planner_cost = Some(c);
}

/// A planner that records every call (for the trace check's replays).
pub(crate) struct RecordingPlanner {
    pub inner: WasmPlanner,
    pub log: std::sync::Arc<std::sync::Mutex<Vec<PlanCall>>>,
}

impl PlannerPolicy for RecordingPlanner {
    fn name(&self) -> &str {
        self.inner.name()
    }

    fn plan(&mut self, profile: &StepProfile, ctx: &PolicyContext) -> Result<Plan, PolicyError> {
        let start = Instant::now();
        let answer = self.inner.plan(profile, ctx);
        let took = start.elapsed();
        let call = PlanCall { profile: profile.clone(), ctx: *ctx, answer: answer.clone(), took };
        self.log.lock().unwrap_or_else(|e| e.into_inner()).push(call);
        answer
    }

    fn state(&self) -> Option<crate::decision::StateHandle> {
        self.inner.state()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::builtin::GreedyPlanner;

    #[test]
    fn fuzzed_profiles_are_reproducible_and_plannable() {
        let a = fuzzed_profiles(12, 5);
        let b = fuzzed_profiles(12, 5);
        assert_eq!(a.iter().map(|x| &x.0).collect::<Vec<_>>(), b.iter().map(|x| &x.0).collect::<Vec<_>>());
        let mut wraps = 0;
        for (p, ctx) in &a {
            let n = p.requests.len() as u32;
            for r in &p.requests {
                assert!(r.bytes >= 1 && r.freed_at.is_none_or(|f| f <= n), "{r:?}");
                wraps += r.wraps_to.is_some() as usize;
            }
            // The engine's own planner stays far below the context's capacity.
            let plan = GreedyPlanner::plan_profile(p);
            validate_plan(p, &plan, ctx.capacity_bytes).unwrap();
        }
        assert!(wraps > 0);
    }

    #[test]
    fn two_step_profiles_get_the_built_in_s_aliased_plans() {
        let mut aliased = 0;
        for (p, ctx) in two_step_profiles(30, 9) {
            let n = p.requests.len();
            for (k, r) in p.requests.iter().enumerate() {
                assert!(r.freed_at.is_none_or(|f| f as usize <= n), "request {k}: {r:?}");
            }
            validate_plan(&p, &GreedyPlanner::plan_profile(&p), ctx.capacity_bytes).unwrap();
            if let Some(plan) = GreedyPlanner::default().plan_aliased(&p, &ctx).unwrap() {
                validate_aliased(&p, &plan, 2 * MIB, ctx.capacity_bytes).unwrap();
                aliased += 1;
            }
        }
        assert!(aliased >= 20, "{aliased} of 30 profiles planned aliased");
    }
}
