//! Planner components (WIT 0.3.0 and 0.4.0) against the engine:
//!
//! - the shipped `greedy-planner` (Rust) plans exactly as the built-in
//!   greedy planner, plan for plan: on the step profiles the allocator
//!   builds from the shared traces (and their whole-trace offline profile,
//!   as `wasmem plan` builds it), and on random profiles (proptest); and
//!   its aliased plans (`plan-aliased`, 0.4.0) of a loop that keeps its
//!   output until the next forward are the built-in's;
//! - a replay with `greedy-planner+defrag` has the very metrics of one with
//!   the built-in `planned`, kept-output loops included, where the same
//!   planner built against 0.3.0 (`tests/data/wit-0.3.0`) plans plainly;
//! - the Python `first-fit-planner`'s plans pass the engine's validation,
//!   and it serves steps from its arena in a replay;
//! - a hostile planner is refused in every way it misbehaves, counted in
//!   `plan_refused` with the cause recorded, and the run continues with the
//!   peak of `defrag` alone (or, when only its aliased plans are bad, as a
//!   planner of plain plans).
#![cfg(feature = "wasm")]

mod common;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use proptest::prelude::*;
use proptest::strategy::ValueTree;
use wasmem::alloc::Allocator;
use wasmem::builtin::GreedyPlanner;
use wasmem::decision::{
    validate_plan, AliasedPlan, Plan, PlanRequest, PlannerPolicy, PolicyContext, PolicyError, StepProfile,
};
use wasmem::device::sim::{SimConfig, SimDevice};
use wasmem::model::ModelSpec;
use wasmem::policy::{resolve_with, Limits, Runtime, WasmPlanner, WitVersion};
use wasmem::replay::{replay_with, Metrics, Replay, ReplayConfig};
use wasmem::synth::synth;
use wasmem::trace::Event;
use wasmem::types::{Phase, StreamId, TensorKind, GIB, KIB, MIB};
use wasmem::workload::{Source, Workload};

/// The shared traces present on this machine.
fn traces() -> Vec<PathBuf> {
    let dir = common::repo().join("../shared/traces");
    let dir = if dir.is_dir() { dir } else { PathBuf::from("/work/shared/traces") };
    let found: Vec<PathBuf> =
        ["gpt2_124m.jsonl.gz", "bert_base.jsonl.gz"].iter().map(|f| dir.join(f)).filter(|p| p.is_file()).collect();
    if found.is_empty() {
        eprintln!("SKIP: no shared traces in {}", dir.display());
    }
    found
}

/// A planner that records the profiles it is given and plans with the built-in.
struct Recording(Arc<Mutex<Vec<StepProfile>>>);

impl Recording {
    /// Keeps `profile`, once when it is asked of twice in a row.
    fn record(&self, profile: &StepProfile) {
        let mut log = self.0.lock().unwrap();
        if log.last() != Some(profile) {
            log.push(profile.clone());
        }
    }
}

impl PlannerPolicy for Recording {
    fn name(&self) -> &str {
        "recording"
    }
    fn plan(&mut self, profile: &StepProfile, _ctx: &PolicyContext) -> Result<Plan, PolicyError> {
        self.record(profile);
        Ok(GreedyPlanner::plan_profile(profile))
    }
    fn plan_aliased(&mut self, profile: &StepProfile, ctx: &PolicyContext) -> Result<Option<AliasedPlan>, PolicyError> {
        // (A two-step profile is asked for an aliased plan first, and for a
        // plain one only when that plan does not reach the live bound.)
        self.record(profile);
        GreedyPlanner::default().plan_aliased(profile, ctx)
    }
}

/// The step profiles the allocator hands its planner on a replay of `trace`
/// with `planned`, and the whole trace as one profile (`wasmem plan`).
fn trace_profiles(trace: &Path) -> Vec<StepProfile> {
    let w = Workload::open(&Source::File(trace.to_path_buf())).unwrap();
    let log = Arc::new(Mutex::new(Vec::new()));
    let mut a =
        Allocator::with_builtin(SimDevice::new(SimConfig { capacity: 80 * GIB, ..SimConfig::default() }), "planned")
            .unwrap();
    a.set_planner(Some(Box::new(Recording(Arc::clone(&log)))));
    replay_with(w.events().unwrap(), a, &ReplayConfig::default(), |_| {}).unwrap();
    wasmem::plan::plan_offline(&w, &mut Recording(Arc::clone(&log))).unwrap();
    let v = std::mem::take(&mut *log.lock().unwrap());
    assert!(v.len() >= 2, "{}: {} profiles", trace.display(), v.len());
    v
}

fn greedy(rt: &Runtime) -> Option<WasmPlanner> {
    let path = common::rust_policy("greedy-planner")?;
    let loaded = rt.load(&path).unwrap();
    assert_eq!(loaded.wit_version(), WitVersion::V0_4);
    assert!(loaded.exports_planner() && loaded.roles().is_empty(), "{loaded:?}");
    Some(loaded.instantiate("").unwrap().planner().expect("a planner"))
}

fn ctx() -> PolicyContext {
    PolicyContext { capacity_bytes: 80 * GIB, ..PolicyContext::default() }
}

#[test]
fn greedy_planner_plans_as_the_built_in_on_trace_profiles() {
    let rt = common::relaxed_runtime();
    let mut wasm = need!(greedy(&rt));
    // Its 0.3.0 build too: it loads and plans with the algorithm of its
    // day (greedy by size with longer lifetimes first among equal sizes,
    // the floor, time order: no equal sizes in time order, no search), so
    // its plans are valid and no smaller than the built-in's.
    let old = greedy_0_3_0().expect("tests/data/wit-0.3.0/greedy-planner.wasm is committed");
    let mut old = rt.load(&old).unwrap().instantiate("").unwrap().planner().expect("a planner");
    for trace in traces() {
        let profiles = trace_profiles(&trace);
        let mut requests = 0;
        for (i, p) in profiles.iter().enumerate() {
            let native = GreedyPlanner::plan_profile(p);
            let theirs = wasm.plan(p, &ctx()).unwrap_or_else(|e| panic!("{}: profile {i}: {e}", trace.display()));
            assert_eq!(theirs, native, "{}: profile {i} ({} requests)", trace.display(), p.requests.len());
            let plain = old.plan(p, &ctx()).unwrap();
            validate_plan(p, &plain, u64::MAX)
                .unwrap_or_else(|e| panic!("0.3.0: {}: profile {i}: {e}", trace.display()));
            assert!(plain.arena_bytes >= native.arena_bytes, "0.3.0: {}: profile {i}", trace.display());
            assert_eq!(old.plan_aliased(p, &ctx()).unwrap(), None, "a 0.3.0 planner makes no aliased plan");
            assert!(native.planned() > 0);
            validate_plan(p, &theirs, u64::MAX).unwrap();
            requests += p.requests.len();
        }
        eprintln!("{}: {} profiles, {requests} requests, identical plans", trace.display(), profiles.len());
    }
}

fn profile_strategy() -> impl Strategy<Value = StepProfile> {
    prop::collection::vec((1u64..(1 << 26), 0u8..10, 1u32..64, any::<u32>()), 0..400).prop_map(|v| {
        let n = v.len() as u32;
        let requests = v
            .into_iter()
            .enumerate()
            .map(|(k, (bytes, shape, life, w))| {
                let k = k as u32;
                let (freed_at, wraps_to) = match shape {
                    0..=6 => (Some((k + life).min(n)), None),
                    7 | 8 => (None, Some(w % n.max(1))),
                    _ => (None, None),
                };
                PlanRequest {
                    bytes,
                    kind: TensorKind::ALL[(w % 6) as usize],
                    stream: StreamId(w % 3),
                    freed_at,
                    wraps_to,
                }
            })
            .collect();
        StepProfile { step: 1, requests }
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn greedy_planner_plans_as_the_built_in_on_random_profiles(p in profile_strategy()) {
        let rt = common::relaxed_runtime();
        let Some(mut wasm) = greedy(&rt) else { return Ok(()) };
        let native = GreedyPlanner::plan_profile(&p);
        prop_assert_eq!(wasm.plan(&p, &ctx()).unwrap(), native.clone());
        prop_assert!(validate_plan(&p, &native, u64::MAX).is_ok());
    }
}

/// A replay of `events` with `spec` (its planner included).
fn replay_spec(rt: &Runtime, spec: &str, events: &[Event], capacity: u64) -> Replay<SimDevice> {
    let r = resolve_with(rt, spec).unwrap_or_else(|e| panic!("{spec}: {e}"));
    let a = Allocator::from_resolved(SimDevice::new(SimConfig { capacity, ..SimConfig::default() }), r);
    let cfg = ReplayConfig { device: SimConfig { capacity, ..SimConfig::default() }, ..ReplayConfig::default() };
    let r = replay_with(events.iter().cloned().map(Ok::<_, String>), a, &cfg, |_| {}).unwrap();
    r.allocator.check_invariants().unwrap_or_else(|e| panic!("{spec}: {e}"));
    r
}

fn metrics(r: &Replay<SimDevice>) -> Metrics {
    let mut m = r.metrics.clone();
    m.clear_timing();
    m
}

/// The workloads of the replay tests: a synthesized GPT-2 run, and the shared traces.
fn workloads() -> Vec<(String, Vec<Event>)> {
    let spec = ModelSpec { steps: 4, ..ModelSpec::preset("gpt2-124m").expect("preset") };
    let mut v = vec![("synth gpt2-124m, 4 steps".to_string(), synth(&spec).expect("valid"))];
    for t in traces() {
        let w = Workload::open(&Source::File(t.clone())).unwrap();
        v.push((t.display().to_string(), w.events().unwrap().map(|e| e.unwrap()).collect()));
    }
    v
}

#[test]
fn greedy_planner_with_defrag_replays_exactly_as_planned() {
    let rt = common::relaxed_runtime();
    need!(common::rust_policy("greedy-planner"));
    let path = common::rust_policy("greedy-planner").unwrap();
    for (name, events) in workloads() {
        let builtin = replay_spec(&rt, "planned", &events, 80 * GIB);
        let wasm = replay_spec(&rt, &format!("{}+defrag", path.display()), &events, 80 * GIB);
        assert_eq!(wasm.allocator.planner_name(), Some("greedy-planner"));
        let (a, b) = (metrics(&builtin), metrics(&wasm));
        assert!(a.plans >= 1 && a.plan_hits > 0, "{name}: the built-in planned nothing: {a:?}");
        assert_eq!(a.plan_refused, 0, "{name}");
        assert_eq!(a, b, "{name}: planned vs greedy-planner+defrag");
        eprintln!(
            "{name}: {} plans, {} hits, peak reserved {} B, identical",
            a.plans, a.plan_hits, a.peak_reserved_bytes
        );
    }
}

fn first_fit(rt: &Runtime) -> Option<WasmPlanner> {
    let path = common::repo().join("policies/out/first-fit-planner.wasm");
    if !path.is_file() {
        eprintln!("SKIP: {} not built (policies/build.sh)", path.display());
        return None;
    }
    let loaded = rt.load(&path).unwrap();
    assert_eq!((loaded.wit_version(), loaded.exports_planner()), (WitVersion::V0_3, true));
    Some(loaded.instantiate("").unwrap().planner().expect("a planner"))
}

#[test]
fn the_python_planner_makes_valid_plans() {
    let rt = common::relaxed_runtime();
    let mut py = need!(first_fit(&rt));
    let mut profiles: Vec<StepProfile> = traces().iter().flat_map(|t| trace_profiles(t)).collect();
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    for _ in 0..24 {
        profiles.push(profile_strategy().new_tree(&mut runner).unwrap().current());
    }
    for (i, p) in profiles.iter().enumerate() {
        let plan = py.plan(p, &ctx()).unwrap_or_else(|e| panic!("profile {i}: {e}"));
        validate_plan(p, &plan, u64::MAX)
            .unwrap_or_else(|e| panic!("profile {i} ({} requests): {e}", p.requests.len()));
        for (k, (r, o)) in p.requests.iter().zip(&plan.offsets).enumerate() {
            assert_eq!(o.is_some(), r.plannable(k as u32), "profile {i}, request {k}");
        }
        let native = GreedyPlanner::plan_profile(p);
        if !p.requests.is_empty() {
            eprintln!(
                "profile {i}: {} requests, first-fit arena {} B, greedy {} B",
                p.requests.len(),
                plan.arena_bytes,
                native.arena_bytes
            );
        }
    }
    // And in a replay: its plans are accepted and serve requests (on a
    // small model, where its arena does not exceed what the dynamic path
    // reserved; on GPT-2 it would, and is refused: see `planned.rs`).
    let path = common::repo().join("policies/out/first-fit-planner.wasm");
    let spec = ModelSpec { steps: 4, ..ModelSpec::preset("tiny").expect("preset") };
    let events = synth(&spec).expect("valid");
    let r = replay_spec(&rt, &format!("{}+defrag", path.display()), &events, 80 * GIB);
    let m = r.metrics;
    assert!(m.plans >= 1 && m.plan_hits > 0 && m.plan_refused == 0, "{m:?}");
}

#[test]
fn hostile_planners_are_refused_and_counted() {
    let path = need!(common::hostile_planner());
    let relaxed = common::relaxed_runtime();
    // The deadline mode under a short deadline, the memory mode under a small cap.
    let tight = common::runtime_with(
        Limits { deadline: Some(Duration::from_millis(20)), ..Limits::default() },
        "planner-tight",
    );
    let small = common::runtime_with(
        Limits { deadline: Some(Duration::from_secs(5)), max_memory: 16 << 20, ..Limits::default() },
        "planner-mem16",
    );
    let (_, events) = workloads().swap_remove(0);
    let reference = metrics(&replay_spec(&relaxed, "defrag", &events, 80 * GIB));
    for (mode, rt, cause) in [
        ("overlap", &relaxed, "share bytes"),
        ("outside", &relaxed, "leaves the arena"),
        ("unaligned", &relaxed, "is not a multiple of 512"),
        ("wrong-length", &relaxed, "entries for"),
        ("too-large", &relaxed, "exceeds"),
        ("refuse", &relaxed, "hostile planner refuses a profile"),
        ("trap", &relaxed, "hostile planner traps on a profile"),
        ("deadline", &tight, "deadline exceeded"),
        ("grow", &small, "memory limit exceeded"),
    ] {
        let r = replay_spec(rt, &format!("{}?mode={mode}+defrag", path.display()), &events, 80 * GIB);
        let h = r.allocator.planner_health().expect("planning is on").clone();
        let m = metrics(&r);
        assert!(h.calls >= 1, "{mode}: the planner was never asked");
        assert_eq!(m.plan_refused, h.calls, "{mode}: every plan refused and counted: {m:?}");
        assert_eq!((m.plans, m.plan_hits, m.plan_arena_bytes), (0, 0, 0), "{mode}: {m:?}");
        let err = h.last_error.clone().unwrap_or_default();
        assert!(err.contains(cause), "{mode}: last error `{err}`");
        // The run went on as the dynamic path alone.
        assert_eq!(m.peak_reserved_bytes, reference.peak_reserved_bytes, "{mode}");
        assert_eq!(m.ooms, 0, "{mode}");
    }
    // And `ok` is the greedy planner.
    let ok = metrics(&replay_spec(&relaxed, &format!("{}?mode=ok+defrag", path.display()), &events, 80 * GIB));
    assert!(ok.plans >= 1 && ok.plan_refused == 0, "{ok:?}");
    let e = resolve_with(&relaxed, &format!("{}?mode=nonsense", path.display())).unwrap_err().to_string();
    assert!(e.contains("unknown mode `nonsense`"), "{e}");
    // A plan for a request whose end of life is unknown is refused.
    let mut p = relaxed.load(&path).unwrap().instantiate("mode=unknown-life").unwrap().planner().unwrap();
    let req =
        |freed_at| PlanRequest { bytes: 4096, kind: TensorKind::Temp, stream: StreamId(0), freed_at, wraps_to: None };
    let profile = StepProfile { step: 1, requests: vec![req(Some(1)), req(None)] };
    let plan = p.plan(&profile, &ctx()).unwrap();
    let e = validate_plan(&profile, &plan, u64::MAX).unwrap_err().0;
    assert!(e.contains("request 1 has no known end of life"), "{e}");
}

#[test]
fn a_planning_call_gets_a_deadline_scaled_by_its_requests() {
    let rt = common::runtime_with(Limits::default(), "planner-deadline");
    let l = Limits::default();
    assert_eq!(rt.planning_deadline(0), l.deadline);
    assert_eq!(rt.planning_deadline(50_000), Some(Duration::from_millis(1) + Duration::from_micros(25) * 50_000));
    assert_eq!(rt.decision_deadline(0), l.deadline);
}

/// A training loop that keeps its output until the next forward (`out =
/// model(x)` in the usual Hugging Face loop): each step's layer outputs and
/// logits are freed in the next step, once its own logits are allocated.
/// The engine profiles such steps two at a time.
fn kept_output_events(layers: u64, steps: u64) -> Vec<Event> {
    let (act, logits) = (3 * MIB, 24 * MIB);
    let mut ev = Vec::new();
    let mut next = 0u64;
    let mut alloc = |ev: &mut Vec<Event>, bytes: u64, kind: TensorKind| {
        next += 1;
        ev.push(Event::Alloc { id: next, bytes, kind, stream: 0, t_us: None });
        next
    };
    let free = |ev: &mut Vec<Event>, id: u64| ev.push(Event::Free { id, t_us: None });
    let mut kept: Vec<u64> = Vec::new();
    for step in 0..steps {
        ev.push(Event::Phase { phase: Phase::Forward, step });
        let mut acts = Vec::new();
        let mut outs = Vec::new();
        for l in 0..layers {
            acts.push(alloc(&mut ev, act + (l % 3) * 64 * KIB, TensorKind::Activation));
            outs.push(alloc(&mut ev, act / 2, TensorKind::Activation));
            let t = alloc(&mut ev, act / 4, TensorKind::Temp);
            free(&mut ev, t);
        }
        outs.push(alloc(&mut ev, logits, TensorKind::Activation));
        for id in kept.drain(..) {
            free(&mut ev, id);
        }
        ev.push(Event::Phase { phase: Phase::Backward, step });
        let (t1, t2) = (alloc(&mut ev, logits, TensorKind::Temp), alloc(&mut ev, logits, TensorKind::Temp));
        free(&mut ev, t1);
        free(&mut ev, t2);
        for &a in acts.iter().rev() {
            let t = alloc(&mut ev, act / 3, TensorKind::Temp);
            free(&mut ev, t);
            free(&mut ev, a);
        }
        kept = outs;
        ev.push(Event::Phase { phase: Phase::StepEnd, step });
    }
    ev
}

/// The shipped planner built against WIT 0.3.0 (plain plans only).
fn greedy_0_3_0() -> Option<PathBuf> {
    let path = common::repo().join("tests/data/wit-0.3.0/greedy-planner.wasm");
    path.is_file().then_some(path)
}

#[test]
fn greedy_planner_makes_the_built_in_s_aliased_plans() {
    let rt = common::relaxed_runtime();
    let path = need!(common::rust_policy("greedy-planner"));
    let old = greedy_0_3_0().expect("tests/data/wit-0.3.0/greedy-planner.wasm is committed");
    let loaded = rt.load(&old).unwrap();
    assert_eq!((loaded.wit_version(), loaded.exports_planner()), (WitVersion::V0_3, true));
    let events = kept_output_events(4, 10);
    let builtin = metrics(&replay_spec(&rt, "planned", &events, 80 * GIB));
    let wasm = metrics(&replay_spec(&rt, &format!("{}+defrag", path.display()), &events, 80 * GIB));
    assert_eq!(builtin, wasm, "planned vs greedy-planner+defrag on a kept-output loop");
    // The 0.3.0 build loads and plans, plainly: its plan of two steps in one
    // arena is refused by the peak guard or serves fewer requests.
    let plain = metrics(&replay_spec(&rt, &format!("{}+defrag", old.display()), &events, 80 * GIB));
    assert!(plain.plans >= 1, "{plain:?}");
    assert!(builtin.plan_hits > plain.plan_hits, "aliased {builtin:?}\nplain {plain:?}");
    assert!(builtin.peak_reserved_bytes <= plain.peak_reserved_bytes, "aliased {builtin:?}\nplain {plain:?}");
    // Plan for plan, on the two-step profiles the engine builds.
    let log = Arc::new(Mutex::new(Vec::new()));
    let mut a =
        Allocator::with_builtin(SimDevice::new(SimConfig { capacity: 80 * GIB, ..SimConfig::default() }), "planned")
            .unwrap();
    a.set_planner(Some(Box::new(Recording(Arc::clone(&log)))));
    replay_with(events.iter().cloned().map(Ok::<_, String>), a, &ReplayConfig::default(), |_| {}).unwrap();
    let profiles = std::mem::take(&mut *log.lock().unwrap());
    let mut wasm = greedy(&rt).unwrap();
    let mut aliased = 0;
    for (i, p) in profiles.iter().enumerate() {
        let want = GreedyPlanner::default().plan_aliased(p, &ctx()).unwrap();
        assert_eq!(wasm.plan_aliased(p, &ctx()).unwrap(), want, "profile {i}");
        aliased += usize::from(want.is_some());
    }
    assert!(aliased >= 1, "no two-step profile among {}", profiles.len());
}

#[test]
fn hostile_aliased_plans_are_refused_and_the_plain_plan_serves() {
    let path = need!(common::hostile_planner());
    let rt = common::relaxed_runtime();
    let events = kept_output_events(4, 10);
    let old = greedy_0_3_0().expect("tests/data/wit-0.3.0/greedy-planner.wasm is committed");
    let plain = metrics(&replay_spec(&rt, &format!("{}+defrag", old.display()), &events, 80 * GIB));
    for (mode, cause) in [
        ("alias-overlap", "share bytes"),
        ("alias-zone", "zones at most half"),
        ("alias-pages", "is not whole pages"),
        ("alias-outside", "leaves its window"),
        ("alias-refuse", "hostile planner refuses an aliased plan"),
        ("alias-trap", "hostile planner traps on an aliased plan"),
    ] {
        let r = replay_spec(&rt, &format!("{}?mode={mode}+defrag", path.display()), &events, 80 * GIB);
        let h = r.allocator.planner_health().expect("planning is on").clone();
        let m = metrics(&r);
        assert!(m.plan_refused >= 1, "{mode}: {m:?}");
        let err = h.last_error.clone().unwrap_or_default();
        assert!(err.contains(cause), "{mode}: last error `{err}`");
        // Nothing of the refused plans was used: the run is that of a
        // planner of plain plans.
        let same =
            |m: &Metrics| (m.plans, m.plan_hits, m.plan_misses, m.plan_arena_bytes, m.peak_reserved_bytes, m.ooms);
        assert_eq!(same(&m), same(&plain), "{mode}");
    }
}
