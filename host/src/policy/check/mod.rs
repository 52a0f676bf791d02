//! `wasmem policy check FILE.wasm`: is this component a well-behaved policy?
//!
//! [`check_with`] loads the component (exports, WIT version, imports),
//! instantiates it, and runs a conformance suite of fuzzed requests and
//! contexts from a fixed seed ([`check_trace`] runs the same checks on the
//! calls of a replay of a real trace instead):
//!
//! - every decision is valid by the engine's own rules
//!   ([`crate::decision::PlacementDecision::validate`], [`validate_victims`], pool names and
//!   budgets of reclamation decisions), and no call fails;
//! - decisions marked `cacheable` agree within their memo key;
//! - determinism: a second instance given the same calls gives the same
//!   answers;
//! - state: the state saved halfway loads into a fresh instance, which then
//!   answers the rest of the calls as the original does;
//! - cost: per role, the number of calls and their median and 99th-percentile
//!   duration, against the runtime's deadline;
//! - a planner (WIT 0.3.0) gets its own suite (`planner`):
//!   valid plans ([`crate::decision::validate_plan`]) for fuzzed step
//!   profiles, determinism, state, cost against the planning deadline.
//!
//! **Measure, then judge.** The suite's calls run with a relaxed deadline
//! ([`relaxed_deadline`]: 10× the runtime's, at least 100 ms), so that a
//! call delayed by a busy machine is neither interrupted nor re-instantiated
//! and the answers can be compared. Each call's cost is the lower of its two
//! measurements (the two instances); the cost check fails only when more
//! than [`MAX_OVER_DEADLINE`] of a role's calls would have run past the
//! engine's deadline — a policy the engine would routinely replace by its
//! fallback — and says how many did in any case. A call that loops still
//! fails: it hits the relaxed deadline.
//!
//! Every difference reported names the call (role, index among that role's
//! calls, inputs) and the instances. The [`Verdict`] prints as a report.

mod calls;
mod planner;
mod trace;

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

pub use planner::PlannerCost;
pub use trace::{check_trace, TraceOptions};

use self::calls::{first_difference, Answer, Call, Input, Outcome as CallOutcome, Runner};
use super::{Limits, Loaded, Runtime, RuntimeConfig, WasmPolicy, WitVersion};
use crate::alloc::LatencyHistogram;
use crate::decision::{validate_victims, Role};
use crate::types::{Phase, TensorKind};

/// Options of [`check_with`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckOptions {
    /// Calls per role (a quarter of it for eviction).
    pub cases: usize,
    /// Seed of the generated inputs.
    pub seed: u64,
    /// Configuration passed to `init`.
    pub config: String,
}

impl CheckOptions {
    /// Step profiles planned by a planner's suite: one per 50 cases, at least 10.
    pub fn profiles(&self) -> usize {
        (self.cases / 50).max(10)
    }
}

impl Default for CheckOptions {
    fn default() -> Self {
        CheckOptions { cases: 2000, seed: 0x00c0_ffee_5eed, config: String::new() }
    }
}

/// A role fails the cost check when more than this fraction of its calls
/// would have run past the engine's deadline.
pub const MAX_OVER_DEADLINE: f64 = 0.10;

/// Outcome of one check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Passed.
    Pass,
    /// Failed: the policy is not conformant.
    Fail,
    /// Not applicable (role not exported, or an earlier step failed).
    Skip,
}

/// One line of a verdict.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckItem {
    /// What was checked.
    pub name: String,
    /// The outcome.
    pub outcome: Outcome,
    /// Details (first counter-example on failure).
    pub detail: String,
}

/// Calls and their cost for one role.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoleCost {
    /// The role.
    pub role: Role,
    /// Calls made.
    pub calls: u64,
    /// Median duration, nanoseconds (within 12.5 %).
    pub p50_ns: u64,
    /// 99th-percentile duration, nanoseconds.
    pub p99_ns: u64,
    /// Calls that took longer than the engine's deadline for them.
    pub over_deadline: u64,
}

/// The result of [`check`]: printable with `{}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    /// The file checked.
    pub path: PathBuf,
    /// `lifecycle.name` (or the file stem if it did not load).
    pub policy: String,
    /// Roles exported.
    pub roles: Vec<Role>,
    /// Whether it exports the planner (WIT 0.3.0).
    pub planner: bool,
    /// The version of the WIT package the component was built against
    /// (`None` if it did not load).
    pub wit_version: Option<WitVersion>,
    /// The checks, in order.
    pub items: Vec<CheckItem>,
    /// Per exported role: calls and their cost (empty when no call ran).
    pub costs: Vec<RoleCost>,
    /// The planner's calls and their cost (`None`: no planner, or no call ran).
    pub planner_cost: Option<PlannerCost>,
}

impl Verdict {
    fn new(path: &Path) -> Verdict {
        let label = path.file_stem().map_or_else(|| path.display().to_string(), |s| s.to_string_lossy().into_owned());
        Verdict {
            path: path.to_path_buf(),
            policy: label,
            roles: vec![],
            planner: false,
            wit_version: None,
            items: vec![],
            costs: vec![],
            planner_cost: None,
        }
    }

    /// Whether every check passed (skips do not count against).
    pub fn passed(&self) -> bool {
        !self.items.is_empty() && self.items.iter().all(|i| i.outcome != Outcome::Fail)
    }

    /// The item named `name`, if the verdict has one.
    pub fn item(&self, name: &str) -> Option<&CheckItem> {
        self.items.iter().find(|i| i.name == name)
    }

    fn push(&mut self, name: &str, outcome: Outcome, detail: impl Into<String>) {
        self.items.push(CheckItem { name: name.to_string(), outcome, detail: detail.into() });
    }
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut roles: Vec<String> = self.roles.iter().map(|r| r.to_string()).collect();
        if self.planner {
            roles.push("planner".to_string());
        }
        writeln!(
            f,
            "policy `{}` ({}): {}",
            self.policy,
            self.path.display(),
            if self.passed() { "PASS" } else { "FAIL" }
        )?;
        if !roles.is_empty() {
            match self.wit_version {
                Some(v) => writeln!(f, "  roles: {} (wasmem:policy@{v})", roles.join(", "))?,
                None => writeln!(f, "  roles: {}", roles.join(", "))?,
            }
        }
        for i in &self.items {
            let tag = match i.outcome {
                Outcome::Pass => "pass",
                Outcome::Fail => "FAIL",
                Outcome::Skip => "skip",
            };
            writeln!(f, "  [{tag}] {}: {}", i.name, i.detail)?;
        }
        Ok(())
    }
}

/// `ns` nanoseconds in words (ns, µs or ms).
pub fn human_ns(ns: u64) -> String {
    match ns {
        0..=999 => format!("{ns} ns"),
        1_000..=999_999 => format!("{:.1} µs", ns as f64 / 1e3),
        _ => format!("{:.1} ms", ns as f64 / 1e6),
    }
}

/// Checks the component at `path` with the default limits and options.
pub fn check(path: impl AsRef<Path>) -> Verdict {
    match Runtime::global() {
        Ok(rt) => check_with(rt, path.as_ref(), &CheckOptions::default()),
        Err(e) => {
            let mut v = Verdict::new(path.as_ref());
            v.push("runtime", Outcome::Fail, e.to_string());
            v
        }
    }
}

/// A runtime for checks with a custom per-call deadline, otherwise the
/// defaults.
pub fn runtime_with_deadline(deadline: Duration) -> Result<Runtime, super::LoadError> {
    Runtime::new(RuntimeConfig {
        limits: Limits { deadline: Some(deadline), ..Limits::default() },
        ..Default::default()
    })
}

/// The deadline the check's own calls run under: 10× the runtime's decision
/// deadline, at least 100 ms, at most the lifecycle deadline (when larger).
pub fn relaxed_deadline(rt: &Runtime) -> Option<Duration> {
    let l = &rt.config().limits;
    l.deadline.map(|d| (d * 10).max(Duration::from_millis(100)).min(l.lifecycle_deadline.max(d)))
}

/// The engine's memo key of a placement decision (kind, log2 size class, stream, phase).
fn memo_key(bytes: u64, kind: TensorKind, stream: u32, phase: Option<Phase>) -> (TensorKind, u32, u32, Option<Phase>) {
    (kind, 64 - bytes.leading_zeros(), stream, phase)
}

/// Summarizes failures: how many and the first, named.
fn failures(all: Vec<(&Call, String)>) -> Option<String> {
    let (call, first) = all.first()?;
    Some(format!("{} of the calls failed; first: {}: {first}", all.len(), call.name()))
}

/// The instance's label in reports.
const A: &str = "A";
const B: &str = "B";

/// Loads and instantiates twice; pushes the load and instantiate items.
/// `None` when either failed (the verdict says why).
fn prepare(rt: &Runtime, path: &Path, config: &str, v: &mut Verdict) -> Option<(Loaded, WasmPolicy, WasmPolicy)> {
    let loaded: Loaded = match rt.load(path) {
        Ok(l) => l,
        Err(e) => {
            v.push("load (exports, WIT version, imports)", Outcome::Fail, e.to_string());
            return None;
        }
    };
    v.roles = loaded.roles().to_vec();
    v.planner = loaded.exports_planner();
    v.wit_version = Some(loaded.wit_version());
    v.push(
        "load (exports, WIT version, imports)",
        Outcome::Pass,
        format!(
            "wasmem:policy@{}; {} in {:.1} ms; imports WASI: {}",
            loaded.wit_version(),
            match loaded.source() {
                super::LoadSource::Cached => "deserialized from the artifact cache",
                super::LoadSource::Compiled => "compiled",
            },
            loaded.load_time().as_secs_f64() * 1e3,
            if loaded.imports_wasi() { "yes (served by a deny-all context)" } else { "no" }
        ),
    );
    let (a, b) = match (loaded.instantiate(config), loaded.instantiate(config)) {
        (Ok(a), Ok(b)) => (a, b),
        (Err(e), _) | (_, Err(e)) => {
            v.push("instantiate + init", Outcome::Fail, e.to_string());
            return None;
        }
    };
    let relaxed = relaxed_deadline(rt);
    a.set_relaxed_deadline(relaxed);
    b.set_relaxed_deadline(relaxed);
    v.policy = a.name().to_string();
    v.push("instantiate + init", Outcome::Pass, format!("config `{config}`"));
    Some((loaded, a, b))
}

/// The validity checks over one run: placement (valid, cacheable agree per
/// memo key), reclamation (pools known, budgets), eviction (victims).
/// `known_pool` says whether a reclamation decision may name a pool.
fn validity(
    v: &mut Verdict,
    p: &WasmPolicy,
    calls: &[Call],
    outs: &[CallOutcome],
    known_pool: &dyn Fn(&str) -> bool,
    suffix: &str,
) {
    let pools = p.pools();
    if p.exports(Role::Placement) {
        let mut names: Vec<&str> = pools.iter().map(|p| p.name.as_str()).collect();
        names.sort_unstable();
        names.dedup();
        let outcome = if names.len() == pools.len() { Outcome::Pass } else { Outcome::Fail };
        v.push("pools", outcome, format!("{:?}", pools.iter().map(|p| &p.name).collect::<Vec<_>>()));
        let mut memo = std::collections::HashMap::new();
        let (mut bad, mut inconsistent, mut n) = (Vec::new(), Vec::new(), 0);
        for (c, o) in calls.iter().zip(outs) {
            let (Input::Place(req, ctx), Answer::Place(r)) = (&c.input, &o.answer) else { continue };
            n += 1;
            match r {
                Err(e) => bad.push((c, e.to_string())),
                Ok(d) => match d.validate(req, pools.len()) {
                    Err(e) => bad.push((c, format!("answered {d:?}: {e}"))),
                    Ok(_) if d.cacheable => {
                        let key = memo_key(req.bytes, req.kind, req.stream.0, ctx.phase);
                        if let Some(prev) = memo.insert(key, (*d, c.index)) {
                            if prev.0 != *d {
                                inconsistent
                                    .push((c, format!("answered {d:?}, but earlier (call {}) {:?}", prev.1, prev.0)));
                            }
                        }
                    }
                    Ok(_) => {}
                },
            }
        }
        let name = format!("placement: valid decisions within limits{suffix}");
        match failures(bad) {
            None => v.push(&name, Outcome::Pass, format!("{n} calls")),
            Some(f) => v.push(&name, Outcome::Fail, f),
        }
        let name = format!("placement: cacheable decisions agree per memo key{suffix}");
        match failures(inconsistent) {
            None => v.push(&name, Outcome::Pass, "kind, size class, stream, phase"),
            Some(f) => v.push(&name, Outcome::Fail, f),
        }
    } else {
        v.push("placement", Outcome::Skip, "not exported");
    }
    if p.exports(Role::Reclamation) {
        let (mut bad, mut n) = (Vec::new(), 0);
        let (mut compactions, mut stitches, mut trims) = (0usize, 0usize, 0usize);
        for (c, o) in calls.iter().zip(outs) {
            let (Input::Reclaim(_, ctx), Answer::Reclaim(r)) = (&c.input, &o.answer) else { continue };
            n += 1;
            let d = match r {
                Err(e) => {
                    bad.push((c, e.to_string()));
                    continue;
                }
                Ok(d) => d,
            };
            compactions += d.compact.is_some() as usize;
            stitches += d.stitch as usize;
            trims += d.trim as usize;
            if let Some(pool) = d.pools.iter().flatten().find(|n| !known_pool(n)) {
                bad.push((c, format!("names unknown pool `{pool}`")));
            } else if let Some((pool, budget)) = &d.compact {
                if !known_pool(pool) {
                    bad.push((c, format!("compacts unknown pool `{pool}`")));
                } else if *budget > ctx.allocated_bytes {
                    bad.push((
                        c,
                        format!(
                            "compaction budget {budget} of pool `{pool}` exceeds the {} allocated bytes in all pools",
                            ctx.allocated_bytes
                        ),
                    ));
                }
            }
        }
        let name = format!("reclamation: valid decisions within limits{suffix}");
        match failures(bad) {
            None => v.push(
                &name,
                Outcome::Pass,
                format!(
                    "{n} calls ({compactions} compact, {stitches} stitch, {trims} trim); paged segments: {}",
                    if p.paged_segments() { "yes" } else { "no" }
                ),
            ),
            Some(f) => v.push(&name, Outcome::Fail, f),
        }
    } else {
        v.push("reclamation", Outcome::Skip, "not exported");
    }
    if p.exports(Role::Eviction) {
        let (mut bad, mut n, mut longest) = (Vec::new(), 0, 0);
        for (c, o) in calls.iter().zip(outs) {
            let (Input::Evict(_, cands, _), Answer::Evict(r)) = (&c.input, &o.answer) else { continue };
            n += 1;
            longest = longest.max(cands.len());
            match r {
                Err(e) => bad.push((c, e.to_string())),
                Ok(victims) => {
                    if let Err(e) = validate_victims(cands, victims) {
                        bad.push((c, e.to_string()));
                    }
                }
            }
        }
        let name = format!("eviction: valid victims within limits{suffix}");
        match failures(bad) {
            None => v.push(&name, Outcome::Pass, format!("{n} calls (up to {longest} candidates)")),
            Some(f) => v.push(&name, Outcome::Fail, f),
        }
    } else {
        v.push("eviction", Outcome::Skip, "not exported");
    }
}

/// The cost item: per role, calls, p50/p99 of the lower of the two
/// measurements of each call, and calls over the engine's deadline.
fn cost(v: &mut Verdict, rt: &Runtime, calls: &[Call], a: &[CallOutcome], b: &[CallOutcome]) {
    let mut hist: [LatencyHistogram; 3] = Default::default();
    let mut over = [0u64; 3];
    for (i, c) in calls.iter().enumerate() {
        let (Some(x), Some(y)) = (a.get(i), b.get(i)) else { break };
        if matches!(x.answer, Answer::Skipped) {
            continue;
        }
        let took = x.took.min(y.took);
        let r = c.input.role().index();
        hist[r].record_duration(took, 1);
        if rt.decision_deadline(c.input.candidates()).is_some_and(|d| took > d) {
            over[r] += 1;
        }
    }
    v.costs = Role::ALL
        .iter()
        .filter(|r| hist[r.index()].count() > 0)
        .map(|&role| {
            let h = &hist[role.index()];
            RoleCost {
                role,
                calls: h.count(),
                p50_ns: h.quantile(0.5),
                p99_ns: h.quantile(0.99),
                over_deadline: over[role.index()],
            }
        })
        .collect();
    if v.costs.is_empty() {
        v.push("cost: calls within the engine's deadline", Outcome::Skip, "no call ran");
        return;
    }
    let l = &rt.config().limits;
    let deadline = match l.deadline {
        Some(d) => format!(
            "deadline {} (+{} per eviction candidate)",
            human_ns(d.as_nanos() as u64),
            human_ns(l.deadline_per_candidate.as_nanos() as u64)
        ),
        None => "no deadline".to_string(),
    };
    let parts: Vec<String> = v
        .costs
        .iter()
        .map(|c| {
            format!(
                "{} {} calls p50 {} p99 {}, {} over the deadline",
                c.role,
                c.calls,
                human_ns(c.p50_ns),
                human_ns(c.p99_ns),
                c.over_deadline
            )
        })
        .collect();
    let too_slow: Vec<String> = v
        .costs
        .iter()
        .filter(|c| c.over_deadline as f64 > MAX_OVER_DEADLINE * c.calls as f64)
        .map(|c| format!("{}: {} of {} calls", c.role, c.over_deadline, c.calls))
        .collect();
    let detail = format!("{}; {deadline}", parts.join("; "));
    if too_slow.is_empty() {
        v.push("cost: calls within the engine's deadline", Outcome::Pass, detail);
    } else {
        v.push(
            "cost: calls within the engine's deadline",
            Outcome::Fail,
            format!(
                "more than {:.0} % of the calls would run past the engine's deadline and be decided by its \
                 fallback ({}); {detail}",
                MAX_OVER_DEADLINE * 100.0,
                too_slow.join(", ")
            ),
        );
    }
}

/// The sandbox item: failed calls and memory of the instances.
fn sandbox(v: &mut Verdict, instances: &[&WasmPolicy]) {
    let traps: u64 = instances.iter().map(|p| p.failures()).sum();
    let mem = instances.iter().map(|p| p.memory_bytes()).max().unwrap_or(0);
    v.push(
        "sandbox",
        if traps == 0 { Outcome::Pass } else { Outcome::Fail },
        format!("{traps} failed calls, {} KiB of linear memory", mem / 1024),
    );
}

/// Checks the component at `path` with `rt` and `opts` (see the module
/// documentation).
pub fn check_with(rt: &Runtime, path: &Path, opts: &CheckOptions) -> Verdict {
    let mut v = Verdict::new(path);
    let Some((loaded, a, b)) = prepare(rt, path, &opts.config, &mut v) else { return v };
    let calls = calls::fuzzed(opts.cases, opts.seed, a.roles());
    let half = calls.len() / 2;
    let (mut ra, mut rb) = (Runner::new(&a), Runner::new(&b));
    let mut oa: Vec<CallOutcome> = calls[..half].iter().map(|c| ra.run(&c.input)).collect();
    let mut ob: Vec<CallOutcome> = calls[..half].iter().map(|c| rb.run(&c.input)).collect();
    // Halfway: both save their state (the same call on both, so that
    // saving cannot make them differ), and a fresh instance loads A's.
    let (sa, sb) = (a.save_state(), b.save_state());
    oa.extend(calls[half..].iter().map(|c| ra.run(&c.input)));
    ob.extend(calls[half..].iter().map(|c| rb.run(&c.input)));

    // The engine's pools are the policy's own plus the default's `small` and `large`.
    let pools = a.pools().to_vec();
    let known = |n: &str| n == "small" || n == "large" || pools.iter().any(|p| p.name == n);
    validity(&mut v, &a, &calls, &oa, &known, "");
    if calls.is_empty() {
        // A planner alone: its own suite below checks determinism and state.
        v.push("determinism: same inputs, same outputs", Outcome::Skip, "no decision role");
    } else {
        decision_determinism_and_state(&mut v, rt, &loaded, opts, &calls, (&oa, &ob), (sa, sb), half);
    }
    cost(&mut v, rt, &calls, &oa, &ob);
    if a.exports_planner() {
        let profiles = planner::fuzzed_profiles(opts.profiles(), opts.seed);
        let half = profiles.len() / 2;
        let mut pa = planner::run(&a, &profiles[..half]);
        let state = a.save_state();
        pa.extend(planner::run(&a, &profiles[half..]));
        let pb = planner::run(&b, &profiles);
        let halfway = planner::Halfway { loaded: &loaded, config: &opts.config, state };
        planner::judge(&mut v, rt, Some(halfway), &pa, &pb, "");
        planner::judge_aliased(&mut v, &a, &b, &planner::two_step_profiles(opts.profiles(), opts.seed));
    }
    sandbox(&mut v, &[&a, &b]);
    v
}

/// The determinism and state items of the decision roles' calls.
#[allow(clippy::too_many_arguments)]
fn decision_determinism_and_state(
    v: &mut Verdict,
    rt: &Runtime,
    loaded: &Loaded,
    opts: &CheckOptions,
    calls: &[Call],
    (oa, ob): (&[CallOutcome], &[CallOutcome]),
    (sa, sb): (Result<Vec<u8>, crate::decision::PolicyError>, Result<Vec<u8>, crate::decision::PolicyError>),
    half: usize,
) {
    // Determinism: the second instance, the same calls.
    match first_difference(calls, (A, oa), (B, ob), 0) {
        None => v.push(
            "determinism: same inputs, same outputs",
            Outcome::Pass,
            format!("instances {A} and {B} agree on all {} calls", calls.len()),
        ),
        Some(d) => v.push("determinism: same inputs, same outputs", Outcome::Fail, d),
    }

    // State: saved halfway, loaded into a fresh instance, which continues.
    let mut restored = None;
    match (&sa, &sb) {
        (Err(e), _) | (_, Err(e)) => {
            v.push("state: save-state → load-state", Outcome::Fail, format!("save-state failed: {e}"))
        }
        (Ok(x), Ok(y)) if x != y => v.push(
            "state: save-state → load-state",
            Outcome::Fail,
            format!(
                "instances {A} and {B} saved different states after the same {half} calls ({} and {} bytes)",
                x.len(),
                y.len()
            ),
        ),
        (Ok(state), Ok(_)) => {
            match loaded.instantiate(&opts.config).map_err(|e| e.to_string()).and_then(|c| {
                c.load_state(state).map_err(|e| e.to_string())?;
                Ok(c)
            }) {
                Ok(c) => {
                    v.push(
                        "state: save-state → load-state",
                        Outcome::Pass,
                        format!("{} bytes after {half} calls", state.len()),
                    );
                    restored = Some((c, state.len()));
                }
                Err(e) => v.push("state: save-state → load-state", Outcome::Fail, format!("load-state failed: {e}")),
            }
        }
    }
    let continuation = "state: a restored instance continues like the original";
    match restored {
        None => v.push(continuation, Outcome::Skip, "no state was carried"),
        Some((c, bytes)) => {
            c.set_relaxed_deadline(relaxed_deadline(rt));
            let mut rc = Runner::new(&c);
            let mut oc: Vec<CallOutcome> = vec![CallOutcome { answer: Answer::Skipped, took: Duration::ZERO }; half];
            oc.extend(calls[half..].iter().map(|x| rc.run(&x.input)));
            let c_name = format!("C (fresh, loaded with A's {bytes}-byte state after {half} calls)");
            match first_difference(calls, (A, oa), (&c_name, &oc), half) {
                None => v.push(
                    continuation,
                    Outcome::Pass,
                    format!("instance C answers the last {} calls as {A} does", calls.len() - half),
                ),
                Some(d) => v.push(
                    continuation,
                    Outcome::Fail,
                    format!(
                        "{d} (save-state must capture whatever later decisions depend on, or a hot swap to \
                         another instance of the policy changes its behaviour)"
                    ),
                ),
            }
        }
    }
}
