//! `wasmem plan` (the offline bound) and planned placement on real
//! workloads: on the shared traces `planned` ≤ `defrag` ≤ `pytorch` in peak
//! reserved bytes, and the offline plan within 0.2 % of the peak of live
//! bytes. Without `../shared/traces` the shared-trace checks skip; the
//! synthesized workloads always run.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

fn wasmem() -> Command {
    Command::new(env!("CARGO_BIN_EXE_wasmem"))
}

fn shared(name: &str) -> Option<PathBuf> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/traces").join(name);
    if p.is_file() {
        Some(p)
    } else {
        eprintln!("SKIP: {} not found", p.display());
        None
    }
}

/// The JSON lines a successful command prints.
fn json_lines(cmd: &mut Command) -> Vec<Value> {
    let out = cmd.output().expect("wasmem runs");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

fn u(v: &Value, key: &str) -> u64 {
    v[key].as_u64().unwrap_or_else(|| panic!("no `{key}` in {v}"))
}

/// Checks an offline plan's figures and returns its overhead.
fn checked_plan(v: &Value) -> f64 {
    assert_eq!(v["offline_bound"], Value::Bool(true));
    assert!(u(v, "lower_bound_bytes") >= u(v, "peak_live_bytes"), "{v}");
    assert!(u(v, "arena_bytes") >= u(v, "lower_bound_bytes"), "{v}");
    assert!(u(v, "requests") > 0);
    v["overhead_ratio"].as_f64().unwrap()
}

#[test]
fn offline_plans_reach_the_bound() {
    let mut cmd = wasmem();
    cmd.args(["plan", "--json", "--synth", "gpt2-124m", "--synth", "bert-base"]);
    let traces: Vec<PathBuf> =
        ["gpt2_124m.jsonl.gz", "bert_base.jsonl.gz", "pytorch-snapshot-a.pickle", "pytorch-snapshot-b.pickle"]
            .iter()
            .filter_map(|t| shared(t))
            .collect();
    cmd.args(&traces);
    let plans = json_lines(&mut cmd);
    assert_eq!(plans.len(), 2 + traces.len());
    for p in &plans {
        let r = checked_plan(p);
        assert!(r <= 1.002, "offline overhead {r} above 1.002: {p}");
    }
}

/// A five-layer model trained with SGD in bf16 (a random synth
/// configuration): its step's online plan is 1.015× its live bound;
/// `planned?effort=100` plans it at 1.0004×.
const SGD_5_LAYERS: [&str; 26] = [
    "--preset",
    "tiny",
    "--hidden",
    "384",
    "--heads",
    "6",
    "--kv-heads",
    "6",
    "--intermediate",
    "1536",
    "--layers",
    "5",
    "--seq",
    "64",
    "--batch",
    "2",
    "--vocab",
    "10000",
    "--optimizer",
    "sgd",
    "--checkpointing",
    "false",
    "--dtype",
    "bf16",
    "--steps",
    "3",
];

#[test]
fn a_longer_search_plans_closer_to_the_bound_online_and_the_steps_compose_offline() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("sgd.jsonl.gz");
    let out = wasmem().arg("synth").args(SGD_5_LAYERS).arg("-o").arg(&trace).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // Offline, its steps' plans composed: at the bound with effort 100,
    // 1.015× it at online planning's effort.
    let offline = |policy: &[&str]| {
        let plans = json_lines(wasmem().args(["plan", "--json"]).args(policy).arg(&trace));
        assert_eq!((plans[0]["composition"].as_str(), u(&plans[0], "steps")), (Some("steps"), 3), "{}", plans[0]);
        checked_plan(&plans[0])
    };
    let (longer, online) = (offline(&[]), offline(&["--policy", "planned"]));
    assert!(
        longer <= 1.0005 && online > 1.005 && online <= 1.02,
        "offline: effort 100 {longer}, online effort {online}"
    );
    // Four runs with a plan cache: the first learns, the next three start
    // from the file. With effort 100 the first plans at the bound; with the
    // online effort its plan is 1.015× the bound, but every step it serves
    // searches on for the cache (`plans_refined`): without that
    // (`refine=off`) the next runs stay at 1.015.
    let runs = |policy: &str| -> Vec<Value> {
        let cache = dir.path().join(format!("{}.json", policy.replace(['?', '=', ','], "_")));
        let run = || {
            let mut cmd = wasmem();
            cmd.args(["replay", "--json", "--policy", policy, "--plan-cache"]).arg(&cache).arg(&trace);
            json_lines(&mut cmd).remove(0)
        };
        let runs = vec![run(), run(), run(), run()];
        for r in &runs {
            assert_eq!(u(r, "plan_refused"), 0, "{r}");
        }
        for r in &runs[1..] {
            assert_eq!(u(r, "plan_misses"), 0, "{r}");
            assert!(u(r, "device_alloc_calls") <= 2, "{r}");
        }
        runs
    };
    let overhead = |r: &Value| r["overhead_ratio"].as_f64().unwrap();
    let longer = runs("planned?effort=100");
    assert!(overhead(&longer[1]) <= 1.0005, "warm, effort 100: {}", longer[1]);
    let online = runs("planned");
    assert!(u(&online[1], "plans_refined") >= 1, "{}", online[1]);
    let (first, later) = (overhead(&online[1]), overhead(&online[3]));
    assert!(first <= 1.02 && later < first && later <= 1.005, "warm runs, online effort: {first}, then {later}");
    // Without the search at step ends, the cache keeps the first plan.
    let off = runs("planned?refine=off");
    assert!(off.iter().all(|r| u(r, "plans_refined") == 0), "{off:?}");
    assert!(overhead(&off[3]) > 1.01, "{}", off[3]);
}

#[test]
fn planned_is_never_above_defrag_nor_defrag_above_pytorch() {
    for t in ["gpt2_124m.jsonl.gz", "bert_base.jsonl.gz", "pytorch-snapshot-a.pickle", "pytorch-snapshot-b.pickle"] {
        let Some(path) = shared(t) else { continue };
        let mut cmd = wasmem();
        cmd.args(["compare", "--json", "--policy", "planned", "--policy", "defrag", "--policy", "pytorch"]).arg(&path);
        let runs = json_lines(&mut cmd);
        let peak = |policy: &str| {
            let r = runs.iter().find(|r| r["policy"] == policy).unwrap_or_else(|| panic!("no {policy} run"));
            u(r, "peak_reserved_bytes")
        };
        let (p, d, y) = (peak("planned"), peak("defrag"), peak("pytorch"));
        assert!(p <= d && d <= y, "{t}: planned {p}, defrag {d}, pytorch {y}");
        for key in ["plans", "plan_hits", "plan_misses", "plan_refused", "plan_arena_bytes"] {
            assert!(runs[0].get(key).is_some(), "no `{key}` in the planned run");
        }
    }
}

#[test]
fn a_multi_step_synthesized_run_is_served_from_the_plan() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("tiny6.jsonl.gz");
    let out = wasmem().args(["synth", "--preset", "tiny", "--steps", "6", "-o"]).arg(&trace).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let runs =
        json_lines(wasmem().args(["compare", "--json", "--policy", "planned", "--policy", "defrag"]).arg(&trace));
    let (p, d) = (&runs[0], &runs[1]);
    assert!(u(p, "plans") >= 1 && u(p, "plan_hits") > 0, "{p}");
    assert_eq!(u(p, "plan_refused"), 0);
    assert!(u(p, "peak_reserved_bytes") <= u(d, "peak_reserved_bytes"), "planned {p}\ndefrag {d}");
}

#[test]
fn plan_errors_are_clear() {
    let out = wasmem().args(["plan", "--synth", "tiny", "--policy", "pytorch"]).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("has no planner"), "{err}");
    let out = wasmem().args(["plan"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("at least one trace"));
    let out = wasmem().args(["plan", "/nonexistent/t.jsonl"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/t.jsonl"));
}

#[test]
fn replay_with_a_plan_cache_plans_the_next_run_from_its_start() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("tiny.jsonl");
    let out = wasmem().args(["synth", "--preset", "tiny", "--steps", "4", "-o"]).arg(&trace).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let cache = dir.path().join("plans.json");
    let run = |policy: &str| {
        let mut cmd = wasmem();
        cmd.args(["replay", "--json", "--policy", policy, "--plan-cache"]).arg(&cache).arg(&trace);
        json_lines(&mut cmd).remove(0)
    };
    let cold = run("planned");
    assert_eq!(u(&cold, "plans_loaded"), 0);
    assert!(cache.is_file());
    let warm = run("planned");
    assert!(u(&warm, "plans_loaded") >= 2, "{warm}");
    assert_eq!(u(&warm, "plan_misses"), 0, "{warm}");
    assert!(u(&warm, "device_alloc_calls") <= 2, "{warm}");
    assert!(u(&warm, "peak_reserved_bytes") <= u(&cold, "peak_reserved_bytes"), "{warm}\n{cold}");
    let mut cmd = wasmem();
    cmd.args(["replay", "--json", "--policy", "pytorch"]).arg(&trace);
    let pytorch = json_lines(&mut cmd).remove(0);
    assert!(u(&warm, "device_alloc_calls") <= u(&pytorch, "device_alloc_calls"), "{warm}\n{pytorch}");
    // `compare`: the policy with a planner runs warm beside the others.
    let mut cmd = wasmem();
    cmd.args(["compare", "--json", "--policy", "planned", "--policy", "pytorch", "--plan-cache"])
        .arg(&cache)
        .arg(&trace);
    let runs = json_lines(&mut cmd);
    assert!(u(&runs[0], "plans_loaded") >= 2 && u(&runs[0], "plan_misses") == 0, "{}", runs[0]);
    assert_eq!(u(&runs[1], "plans_loaded"), 0);
    assert!(u(&runs[0], "device_alloc_calls") <= u(&runs[1], "device_alloc_calls"));
    // One input only, a planner needed, and a file that is not a cache is refused and kept.
    let fail = |args: &[&str], want: &str| {
        let out = wasmem().args(args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(want), "{err}");
    };
    let (t, c) = (trace.to_str().unwrap(), cache.to_str().unwrap());
    fail(&["replay", "--policy", "planned", "--plan-cache", c, t, t], "--plan-cache takes exactly one input");
    fail(&["replay", "--policy", "defrag", "--plan-cache", c, t], "needs planned placement");
    fail(
        &["compare", "--policy", "planned", "--policy", "greedy-planner+defrag", "--plan-cache", c, t],
        "one may use the cache",
    );
    fail(&["compare", "--policy", "pytorch", "--plan-cache", c, t], "no --policy has a planner");
    fail(&["compare", "--policy", "planned", "--plan-cache", c, t, t], "--plan-cache takes exactly one input");
    let before = std::fs::read(&trace).unwrap();
    fail(&["replay", "--policy", "planned", "--plan-cache", t, t], "not a plan cache");
    assert_eq!(std::fs::read(&trace).unwrap(), before, "a file that is not a plan cache was overwritten");
}

/// A recorded loop that keeps its outputs and evaluates (three batches)
/// before every fourth training step (`tests/data/llama-small-eval-pairs.jsonl.gz`:
/// `scripts/record-meta.py llama-small 8 OUT --keep-outputs --eval-every 4
/// --eval-batches 3`, on the meta device). Its steps are planned two at a
/// time; in the warm run (plans from the cache) the evaluation falls in
/// the second step of a pair, whose plan has no entry for its requests:
/// each borrows arena memory expected to stay free for the next 64 plan
/// entries. Expected to live a whole cycle, they found none and grew the
/// dynamic path beside the arena (warm 1.01125 against `defrag`'s 1.0003).
/// Cold and warm, `planned` reserves no more than `defrag` (within 0.01 %).
#[test]
fn an_evaluation_inside_planned_pairs_stays_within_defrag() {
    let trace = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/data/llama-small-eval-pairs.jsonl.gz");
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("plans.json");
    let run = |policy: &str, cached: bool| {
        let mut cmd = wasmem();
        cmd.args(["replay", "--json", "--policy", policy]).arg(&trace);
        if cached {
            cmd.arg("--plan-cache").arg(&cache);
        }
        json_lines(&mut cmd).remove(0)
    };
    let defrag = u(&run("defrag", false), "peak_reserved_bytes");
    let cold = run("planned", true);
    let warm = run("planned", true);
    assert!(u(&warm, "plans_loaded") >= 2, "{warm}");
    for (which, r) in [("cold", &cold), ("warm", &warm)] {
        let peak = u(r, "peak_reserved_bytes");
        assert!(peak * 10_000 <= defrag * 10_001, "{which}: planned {peak} above defrag {defrag}: {r}");
    }
}

/// The same recorded loop planned offline (`wasmem plan`): its outputs,
/// kept into the next step, and its evaluations (no window of steps
/// repeats) left every plan of the whole, of its floor and of its steps
/// composed 0.5–0.8 % above the live peak (1.00788 before aliased steps).
/// Each step placed on its own in alternate aliased windows, around what
/// the previous one keeps: within the goal of 0.2 %.
#[test]
fn an_evaluating_loop_that_keeps_its_outputs_is_planned_offline_in_aliased_steps() {
    let trace = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/data/llama-small-eval-pairs.jsonl.gz");
    let p = json_lines(wasmem().args(["plan", "--json"]).arg(&trace)).remove(0);
    assert_eq!(p["composition"], "aliased_steps", "{p}");
    let ratio = p["overhead_ratio"].as_f64().unwrap();
    assert!(ratio <= 1.002, "offline plan {ratio} of the live peak: {p}");
    assert!(u(&p, "arena_bytes") >= u(&p, "lower_bound_bytes"), "{p}");
}

/// A checkpointed T5 loop that keeps its outputs and evaluates after the
/// fifth step (`tests/data/t5-small-ckpt-kept-eval5.jsonl.gz`:
/// `scripts/record-meta.py t5-small 6 OUT --checkpointing --keep-outputs
/// --foreach --eval-every 5 --seed 3`), planned offline. Its aliased steps
/// failed twice over: the first step's peak comes before its optimizer
/// states, which stay to the end, so stacking them under every step with
/// the parameters passed the bound by 19 %; and at the bound, each of the
/// six greedy orders left a request of a step without a gap. With those
/// states above the floor and each order retried with the requests it
/// failed placed first: 1.03639 (steps composed) → within 0.2 %.
#[test]
fn a_checkpointed_loop_whose_states_come_after_its_first_peak_is_planned_offline_in_aliased_steps() {
    let trace = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/data/t5-small-ckpt-kept-eval5.jsonl.gz");
    let p = json_lines(wasmem().args(["plan", "--json"]).arg(&trace)).remove(0);
    assert_eq!(p["composition"], "aliased_steps", "{p}");
    let ratio = checked_plan(&p);
    assert!(ratio <= 1.002, "offline plan {ratio} of the live peak: {p}");
}

/// Peak reserved bytes of `planned` cold (learning; a fresh plan cache),
/// `planned` warm (from that cache) and `defrag` on the recorded `trace`
/// (under `tests/data`), and the warm run's metrics.
fn cold_warm_defrag(trace: &str) -> (u64, u64, u64, Value) {
    let trace = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/data").join(trace);
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("plans.json");
    let run = |policy: &str| {
        let mut cmd = wasmem();
        cmd.args(["replay", "--json", "--policy", policy]).arg(&trace);
        if policy == "planned" {
            cmd.arg("--plan-cache").arg(&cache);
        }
        json_lines(&mut cmd).remove(0)
    };
    let defrag = u(&run("defrag"), "peak_reserved_bytes");
    let cold = u(&run("planned"), "peak_reserved_bytes");
    let warm = run("planned");
    (cold, u(&warm, "peak_reserved_bytes"), defrag, warm)
}

/// A checkpointed loop that keeps its outputs (`tests/data/llama-small-ckpt-kept.jsonl.gz`:
/// `scripts/record-meta.py llama-small 6 OUT --bf16 --foreach --checkpointing
/// --keep-outputs --seed 13`). Its steps are planned two at a time in an
/// aliased arena. Placed by decreasing size only, the layers' checkpointed
/// inputs (8 MiB, kept from the forward for the backward, nested) came after
/// larger temporaries and found no gap over their lifetimes: 218 MB of each
/// pair was left to the dynamic path beside the arena, and the warm run
/// reserved 3.9 % more than `defrag`. The aliased planner now tries more
/// orders (the longest-lived first places them): cold and warm within a
/// page (2 MiB) of `defrag`, every request of a warm pair but a few
/// planned.
#[test]
fn a_checkpointed_loop_that_keeps_its_outputs_is_planned_within_a_page_of_defrag() {
    let (cold, warm, defrag, w) = cold_warm_defrag("llama-small-ckpt-kept.jsonl.gz");
    for (which, peak) in [("cold", cold), ("warm", warm)] {
        assert!(peak <= defrag + (2 << 20), "{which}: planned {peak} against defrag {defrag}");
    }
    assert!(u(&w, "plan_misses") * 100 < u(&w, "plan_hits"), "{w}");
}

/// A checkpointed T5 loop that clips its gradients
/// (`tests/data/t5-small-ckpt-clip.jsonl.gz`: `scripts/record-meta.py
/// t5-small 4 OUT --checkpointing --clip --seed 105`). Its steps have
/// 2,845–3,243 requests: more than the planner scans, so its search budget
/// was spent before the orders beyond greedy by size (costed as a scan's
/// m²/2 for m requests), whose plans were 0.5 % above the live bound: cold
/// 0.13 % above `defrag`, warm 1.00269. Costed by what the segment tree
/// visits, the peak-first orders place them at their bound.
#[test]
fn a_step_too_long_to_scan_gets_the_peak_first_orders() {
    let (cold, warm, defrag, w) = cold_warm_defrag("t5-small-ckpt-clip.jsonl.gz");
    assert!(cold <= defrag, "cold: planned {cold} against defrag {defrag}");
    assert!(warm <= defrag, "warm: planned {warm} against defrag {defrag}");
    let live = u(&w, "peak_live_bytes");
    assert!(warm * 1000 <= live * 1001, "warm: {warm} for {live} live: {w}");
    assert_eq!(u(&w, "plan_refused"), 0, "{w}");
}

/// A checkpointed ViT loop with plain SGD (`tests/data/vit-ckpt-sgd.jsonl.gz`:
/// `scripts/record-meta.py vit 8 OUT --checkpointing --optim sgd --seed
/// 205`). Its steps are planned two at a time in an aliased arena, but
/// every order left a few pairs out at the bound, and the repair of the
/// order that left least (14 MB) drifted, retry after retry, to 1.5 GB
/// left while it spent the retries: the pair was planned plain, 1.7 %
/// above its bound, and the warm run was at 1.00936. A repair that
/// diverges now gives the next order its turn, whose repair places every
/// pair at the bound.
#[test]
fn a_diverging_repair_of_an_aliased_plan_gives_the_next_order_its_turn() {
    let (cold, warm, defrag, w) = cold_warm_defrag("vit-ckpt-sgd.jsonl.gz");
    assert!(cold <= defrag, "cold: planned {cold} against defrag {defrag}");
    let live = u(&w, "peak_live_bytes");
    assert!(warm * 1000 <= live * 1002, "warm: {warm} for {live} live: {w}");
    assert_eq!(u(&w, "plan_misses"), 0, "{w}");
}

/// A Qwen2 loop of varying sequence lengths that keeps its outputs and
/// accumulates three micro-batches (`tests/data/qwen2-small-varseq-kept-accum3.jsonl.gz`:
/// `scripts/record-meta.py qwen2-small 3 OUT --keep-outputs --varseq --foreach
/// --grads-kept --accum 3 --seed 207`). The first step's plan, installed at
/// the second step, is left a few requests into it (another length). The
/// rest of the step borrowed the arena's free ranges until its 2.5 GB
/// logits found none large enough, and grew twice beside the 7.7 GB arena:
/// 1.7 % above `defrag`. The arena, which still holds the step's first
/// tensors, now joins the dynamic path, whose stitching takes its free
/// pages: within `defrag`.
#[test]
fn a_step_that_leaves_its_plan_stitches_its_large_tensors_from_the_arena_s_free_pages() {
    let trace = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/data/qwen2-small-varseq-kept-accum3.jsonl.gz");
    let run = |policy: &str| json_lines(wasmem().args(["replay", "--json", "--policy", policy]).arg(&trace)).remove(0);
    let (planned, defrag) = (run("planned"), run("defrag"));
    let (p, d) = (u(&planned, "peak_reserved_bytes"), u(&defrag, "peak_reserved_bytes"));
    assert!(p <= d, "planned {p} above defrag {d}: {planned}");
    assert!(u(&planned, "plan_hits") > 0, "{planned}");
    assert_eq!(u(&planned, "ooms"), 0, "{planned}");
}

/// The same loop's next runs: the plan cache says the steps are unsteady,
/// so planning stays off and each run is `defrag`'s. The second run's mark
/// is the dynamic path's alone (the learning run's held what its plans
/// did) and the cache says so: the third run grows to it in chunks that
/// double, and later growths take their spare pages: `defrag`'s peak in
/// 6–7 device calls (the learning run and `defrag` 101, PyTorch 100).
#[test]
fn a_warm_run_of_unsteady_steps_makes_fewer_device_calls_than_pytorch() {
    let trace = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/data/qwen2-small-varseq-kept-accum3.jsonl.gz");
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("plans.json");
    let run = |policy: &str, cache: Option<&Path>| {
        let mut cmd = wasmem();
        cmd.args(["replay", "--json", "--policy", policy]).arg(&trace);
        if let Some(c) = cache {
            cmd.arg("--plan-cache").arg(c);
        }
        json_lines(&mut cmd).remove(0)
    };
    let (defrag, pytorch) = (run("defrag", None), run("pytorch", None));
    let cold = run("planned", Some(&cache));
    assert!(std::fs::read_to_string(&cache).unwrap().contains("\"unsteady\":true"));
    let second = run("planned", Some(&cache));
    assert_eq!(u(&second, "device_alloc_calls"), u(&defrag, "device_alloc_calls"), "{second}");
    assert!(std::fs::read_to_string(&cache).unwrap().contains("\"dynamic\":true"));
    let warm = run("planned", Some(&cache));
    assert_eq!(u(&warm, "plan_hits"), 0, "{warm}");
    assert_eq!(u(&warm, "peak_reserved_bytes"), u(&defrag, "peak_reserved_bytes"), "{warm}");
    let calls = u(&warm, "device_alloc_calls");
    assert!(calls < u(&pytorch, "device_alloc_calls") && calls * 4 <= u(&cold, "device_alloc_calls"), "{warm}");
}

/// A checkpointed T5 loop that keeps its outputs and evaluates every fifth
/// step (`tests/data/t5-small-ckpt-kept-eval5.jsonl.gz`), run three times
/// with one plan cache. The second run learned a first-step plan but ran its
/// own first step on the dynamic path, and wrote its own (lower) mark as the
/// allowance, since the cached plan it chose was gone from its plans by
/// then: the third run refused the arena that plan needs (two pages over)
/// and stayed dynamic, at the learning run's peak (1.00878). A run that
/// chose a cached plan keeps the allowance of the run before.
#[test]
fn a_third_run_keeps_the_allowance_of_the_runs_before() {
    let trace = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/data/t5-small-ckpt-kept-eval5.jsonl.gz");
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("plans.json");
    let run = || {
        let mut cmd = wasmem();
        cmd.args(["replay", "--json", "--policy", "planned", "--plan-cache"]).arg(&cache).arg(&trace);
        json_lines(&mut cmd).remove(0)
    };
    let runs: Vec<Value> = (0..3).map(|_| run()).collect();
    let peak = |r: &Value| u(r, "peak_reserved_bytes");
    assert!(peak(&runs[2]) < peak(&runs[0]), "{} against {}", runs[2], runs[0]);
    assert_eq!(u(&runs[2], "plan_refused"), 0, "{}", runs[2]);
    assert!(u(&runs[2], "plan_hits") > 0, "{}", runs[2]);
}

/// A loop that keeps its outputs and evaluates two batches every fifth step
/// (`tests/data/qwen2-small-kept-eval5.jsonl.gz`: `scripts/record-meta.py
/// qwen2-small 12 OUT --keep-outputs --eval-every 5 --eval-batches 2
/// --grads-kept --optim sgd --seed 17`). Its cache holds a plan of the
/// first step that could not be fitted into the aliased plan of its pairs.
/// The warm run served the first step in an arena of its own, which holds
/// the parameters for good. The pairs' aliased arena, mapped from the free
/// pages the first step leaves, was refused, and the steps grew beside the
/// first arena: 29 % above `defrag`. Now that first step runs dynamic, as
/// in the learning run: within a page of `defrag`.
#[test]
fn a_first_step_plan_that_would_hold_the_pages_of_an_aliased_arena_is_not_installed() {
    let (cold, warm, defrag, w) = cold_warm_defrag("qwen2-small-kept-eval5.jsonl.gz");
    for (which, peak) in [("cold", cold), ("warm", warm)] {
        assert!(peak <= defrag + (2 << 20), "{which}: planned {peak} against defrag {defrag}");
    }
    assert_eq!(u(&w, "plan_refused"), 0, "{w}");
}
