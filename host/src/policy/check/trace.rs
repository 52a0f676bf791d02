//! `wasmem policy check FILE.wasm --trace TRACE`: the conformance checks on
//! the calls of a replay of a real trace (real candidate lists are hundreds
//! long, the fuzzer's at most 47).
//!
//! The trace is replayed twice, each time with a fresh instance of the
//! policy in the roles it exports (the built-in defaults in the others),
//! every call recorded with its inputs, answer and duration by a thin
//! wrapper around the role. The recorded calls of the first replay go
//! through the same validity checks as the fuzzed suite's; the two
//! replays' calls and metrics must agree (determinism); the cost check
//! judges the lower of each call's two durations against the engine's
//! deadline. The replays run with the relaxed deadline of the suite (see
//! the parent module): a call delayed by a busy machine would otherwise be
//! decided by the fallback and change every later input.
//!
//! A planner (WIT 0.3.0) is checked on the profiles of two more replays in
//! which it plans for the built-in `defrag` set (as in
//! `PLANNER+defrag`): the plans of the first go through the planner
//! suite's validity check, the two replays' plans must agree, and their
//! cost is judged against the planning deadline.
//!
//! The device is 80 GiB, or, for a policy that exports eviction, 60 % of
//! the trace's peak live bytes (so that eviction is exercised), unless
//! [`TraceOptions::device_mem`] says otherwise; the host and disk tiers are
//! on, as in `wasmem replay`.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::calls::{first_difference, Answer, Call, Input, Outcome as CallOutcome};
use super::planner::{self, PlanCall, RecordingPlanner};
use super::{cost, prepare, sandbox, validity, Outcome, Verdict, A, B};
use crate::alloc::Allocator;
use crate::decision::{
    AllocRequest, EvictionCandidate, EvictionPolicy, PlacementDecision, PlacementPolicy, Policies, PolicyContext,
    PolicyError, PoolSpec, ReclaimDecision, ReclaimTrigger, ReclamationPolicy, StateHandle,
};
use crate::device::sim::{SimConfig, SimDevice};
use crate::policy::{Runtime, WasmPolicy};
use crate::replay::{replay, replay_with, Metrics, ReplayConfig};
use crate::tier::TierConfig;
use crate::trace::Event;
use crate::types::{TensorId, GIB};
use crate::workload::{Source, Workload};

/// Options of [`check_trace`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceOptions {
    /// The trace (trace v1 or a PyTorch snapshot).
    pub trace: PathBuf,
    /// Simulated device memory (`None`: see the module documentation).
    pub device_mem: Option<u64>,
    /// Configuration passed to `init`.
    pub config: String,
}

/// Calls recorded by the wrappers of one replay, in call order.
type Log = Arc<Mutex<Vec<(Input, CallOutcome)>>>;

fn push(log: &Log, input: Input, answer: Answer, start: Instant) {
    let took = start.elapsed();
    log.lock().unwrap_or_else(|e| e.into_inner()).push((input, CallOutcome { answer, took }));
}

/// A role of the policy under test, recording every call.
struct Recorder<P> {
    inner: P,
    log: Log,
}

impl<P: PlacementPolicy> PlacementPolicy for Recorder<P> {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn pools(&self) -> Vec<PoolSpec> {
        self.inner.pools()
    }
    fn place(&mut self, req: &AllocRequest, ctx: &PolicyContext) -> Result<PlacementDecision, PolicyError> {
        let start = Instant::now();
        let r = self.inner.place(req, ctx);
        push(&self.log, Input::Place(*req, *ctx), Answer::Place(r.clone()), start);
        r
    }
    fn memoizable(&self) -> bool {
        self.inner.memoizable()
    }
    fn time_every_call(&self) -> bool {
        self.inner.time_every_call()
    }
    fn state(&self) -> Option<StateHandle> {
        self.inner.state()
    }
}

impl<P: ReclamationPolicy> ReclamationPolicy for Recorder<P> {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn reclaim(&mut self, trigger: &ReclaimTrigger, ctx: &PolicyContext) -> Result<ReclaimDecision, PolicyError> {
        let start = Instant::now();
        let r = self.inner.reclaim(trigger, ctx);
        push(&self.log, Input::Reclaim(*trigger, *ctx), Answer::Reclaim(r.clone()), start);
        r
    }
    fn paged_segments(&self) -> bool {
        self.inner.paged_segments()
    }
    fn time_every_call(&self) -> bool {
        self.inner.time_every_call()
    }
    fn state(&self) -> Option<StateHandle> {
        self.inner.state()
    }
}

impl<P: EvictionPolicy> EvictionPolicy for Recorder<P> {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn choose_victims(
        &mut self,
        need_bytes: u64,
        candidates: &[EvictionCandidate],
        ctx: &PolicyContext,
    ) -> Result<Vec<TensorId>, PolicyError> {
        let start = Instant::now();
        let r = self.inner.choose_victims(need_bytes, candidates, ctx);
        push(&self.log, Input::Evict(need_bytes, candidates.to_vec(), *ctx), Answer::Evict(r.clone()), start);
        r
    }
    fn time_every_call(&self) -> bool {
        self.inner.time_every_call()
    }
    fn state(&self) -> Option<StateHandle> {
        self.inner.state()
    }
}

/// The policy under test in the roles it exports, recording into `log`;
/// the built-in defaults in the others.
fn recorded(p: &WasmPolicy, log: &Log) -> Policies {
    let d = crate::builtin::default_policies();
    let rec = |log: &Log| log.clone();
    Policies {
        placement: match p.placement() {
            Some(x) => Box::new(Recorder { inner: x, log: rec(log) }),
            None => d.placement,
        },
        reclamation: match p.reclamation() {
            Some(x) => Box::new(Recorder { inner: x, log: rec(log) }),
            None => d.reclamation,
        },
        eviction: match p.eviction() {
            Some(x) => Box::new(Recorder { inner: x, log: rec(log) }),
            None => d.eviction,
        },
    }
}

/// Peak of the requested bytes of live tensors over `events`.
fn peak_live(events: impl Iterator<Item = Event>) -> u64 {
    let mut live = rustc_hash::FxHashMap::default();
    let (mut now, mut peak) = (0u64, 0u64);
    for ev in events {
        match ev {
            Event::Alloc { id, bytes, .. } => {
                live.insert(id, bytes);
                now += bytes;
                peak = peak.max(now);
            }
            Event::Free { id, .. } => now -= live.remove(&id).unwrap_or(0),
            Event::Use { .. } | Event::Phase { .. } => {}
        }
    }
    peak
}

/// What one recorded replay gives: its calls, their outcomes, its metrics
/// and the engine's pool names.
type Recorded = (Vec<Call>, Vec<CallOutcome>, Metrics, Vec<String>);

/// One replay of `w` with `p` recording, or why not.
fn run(w: &Workload, p: &WasmPolicy, cfg: &ReplayConfig) -> Result<Recorded, String> {
    let log: Log = Arc::default();
    let events = w.events().map_err(|e| e.to_string())?;
    let r = replay(events, recorded(p, &log), cfg).map_err(|e| e.to_string())?;
    let pools = r.allocator.pools().iter().map(|p| p.name.clone()).collect();
    drop(r.allocator);
    let recorded = std::mem::take(&mut *log.lock().unwrap_or_else(|e| e.into_inner()));
    let mut per_role = [0usize; 3];
    let (mut calls, mut outs) = (Vec::new(), Vec::new());
    for (input, out) in recorded {
        let r = input.role().index();
        calls.push(Call { index: per_role[r], input });
        per_role[r] += 1;
        outs.push(out);
    }
    let mut m = r.metrics;
    m.clear_timing();
    Ok((calls, outs, m, pools))
}

/// One replay of `w` with the planner of `p` for the built-in `defrag`
/// set, recording the planning calls.
fn plan_run(w: &Workload, p: &WasmPolicy, cfg: &ReplayConfig) -> Result<Vec<PlanCall>, String> {
    let inner = p.planner().ok_or("no planner")?;
    let log = Arc::default();
    let defrag = crate::builtin::by_name("defrag").ok_or("no built-in `defrag`")?;
    let mut alloc = Allocator::new(SimDevice::new(cfg.device), defrag);
    alloc.set_planner(Some(Box::new(RecordingPlanner { inner, log: Arc::clone(&log) })));
    let events = w.events().map_err(|e| e.to_string())?;
    let r = replay_with(events, alloc, cfg, |_| {}).map_err(|e| e.to_string())?;
    drop(r);
    let calls = std::mem::take(&mut *log.lock().unwrap_or_else(|e| e.into_inner()));
    Ok(calls)
}

/// Checks the component at `path` on the calls of a replay of
/// `opts.trace` (see the module documentation).
pub fn check_trace(rt: &Runtime, path: &Path, opts: &TraceOptions) -> Verdict {
    let mut v = Verdict::new(path);
    let Some((_, a, b)) = prepare(rt, path, &opts.config, &mut v) else { return v };
    let w = match Workload::open(&Source::File(opts.trace.clone())) {
        Ok(w) => w,
        Err(e) => {
            v.push("trace", Outcome::Fail, e.to_string());
            return v;
        }
    };
    let capacity = match opts.device_mem {
        Some(m) => m,
        None if a.eviction().is_some() => match w.events() {
            Ok(evs) => {
                let peak = peak_live(evs.map_while(Result::ok));
                (peak / 10 * 6).max(GIB)
            }
            Err(e) => {
                v.push("trace", Outcome::Fail, e.to_string());
                return v;
            }
        },
        None => 80 * GIB,
    };
    let cfg = ReplayConfig {
        device: SimConfig { capacity, ..SimConfig::default() },
        tiers: Some(TierConfig::default()),
        ..ReplayConfig::default()
    };
    let (ca, oa, ma, pools) = match run(&w, &a, &cfg) {
        Ok(x) => x,
        Err(e) => {
            v.push("trace: replay", Outcome::Fail, format!("{}: {e}", opts.trace.display()));
            return v;
        }
    };
    let longest = ca.iter().map(|c| c.input.candidates()).max().unwrap_or(0);
    v.push(
        "trace: replay",
        Outcome::Pass,
        format!(
            "{}: {} events on a {} device: {} calls into the policy ({} placement memo hits), peak reserved {} \
             bytes, {} evictions (up to {longest} candidates), {} OOMs, {} fallbacks",
            opts.trace.display(),
            ma.events,
            crate::types::human_bytes(capacity),
            ca.len(),
            ma.policy_memo_hits,
            ma.peak_reserved_bytes,
            ma.evictions,
            ma.ooms,
            ma.policy_fallbacks
        ),
    );
    let known = |n: &str| pools.iter().any(|p| p == n);
    validity(&mut v, &a, &ca, &oa, &known, " (trace)");
    match run(&w, &b, &cfg) {
        Err(e) => v.push("determinism: same inputs, same outputs", Outcome::Fail, format!("second replay: {e}")),
        Ok((cb, ob, mb, _)) => {
            let diff = first_difference(&ca, (A, &oa), (B, &ob), 0)
                .or_else(|| {
                    (ca != cb).then(|| format!("the two replays made different calls ({} and {})", ca.len(), cb.len()))
                })
                .or_else(|| (ma != mb).then(|| "the two replays' metrics differ".to_string()));
            match diff {
                None => v.push(
                    "determinism: same inputs, same outputs",
                    Outcome::Pass,
                    format!("two replays with instances {A} and {B}: the same {} calls, answers and metrics", ca.len()),
                ),
                Some(d) => v.push("determinism: same inputs, same outputs", Outcome::Fail, d),
            }
            cost(&mut v, rt, &ca, &oa, &ob);
        }
    }
    if a.exports_planner() {
        match (plan_run(&w, &a, &cfg), plan_run(&w, &b, &cfg)) {
            (Ok(pa), Ok(pb)) => planner::judge(&mut v, rt, None, &pa, &pb, " (trace)"),
            (Err(e), _) | (_, Err(e)) => {
                v.push("planner: valid plans (trace)", Outcome::Fail, format!("replay with the planner: {e}"))
            }
        }
    }
    sandbox(&mut v, &[&a, &b]);
    v
}
