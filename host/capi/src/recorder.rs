//! Recorders: traces written by a client that sees tensor storages itself
//! instead of allocating them here (`wasmem.torch.Recorder` on PyTorch's
//! meta device, where nothing is allocated at all). Each is a [`TraceLog`]
//! with its own ids, behind a handle; the trace is written with the
//! engine's writer, so it is the same trace v1 a live run records.
//!
//! Handles are numbers from 1 up, never reused: a stale or unknown handle is
//! an error, never memory of another recorder.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Mutex, PoisonError};

use serde_json::{json, Value};
use wasmem::trace::TraceHeader;
use wasmem::types::{Phase, TensorKind};

use crate::log::Cause;
use crate::state::Failure;
use crate::tracelog::TraceLog;

/// One recorder.
#[derive(Debug, Default)]
struct Recorder {
    source: String,
    log: TraceLog,
    next_id: u64,
    allocs: u64,
    frees: u64,
    retags: u64,
    phases: u64,
    /// The figures of the last [`plan`].
    planned: Option<Value>,
}

#[derive(Debug, Default)]
struct Registry {
    next: i64,
    open: BTreeMap<i64, Recorder>,
}

static RECORDERS: Mutex<Registry> = Mutex::new(Registry { next: 0, open: BTreeMap::new() });

fn with<R>(handle: i64, f: impl FnOnce(&mut Recorder) -> Result<R, Failure>) -> Result<R, Failure> {
    let mut g = RECORDERS.lock().unwrap_or_else(PoisonError::into_inner);
    let r = g
        .open
        .get_mut(&handle)
        .ok_or_else(|| Failure::new(Cause::BadArgument, format!("recorder handle {handle} is not open")))?;
    f(r)
}

fn log_err(handle: i64) -> impl Fn(crate::tracelog::LogError) -> Failure {
    move |e| Failure::new(Cause::BadArgument, format!("recorder {handle}: {e}"))
}

/// Opens a recorder whose trace header says `source`; returns its handle.
pub fn open(source: &str) -> i64 {
    let mut g = RECORDERS.lock().unwrap_or_else(PoisonError::into_inner);
    g.next += 1;
    let h = g.next;
    g.open.insert(h, Recorder { source: source.to_string(), next_id: 1, ..Recorder::default() });
    h
}

/// Records an allocation; returns its trace id.
pub fn alloc(handle: i64, bytes: u64, kind: TensorKind, stream: u32) -> Result<u64, Failure> {
    with(handle, |r| {
        let id = r.next_id;
        r.log.alloc(id, bytes, kind, stream).map_err(log_err(handle))?;
        r.next_id += 1;
        r.allocs += 1;
        Ok(id)
    })
}

/// Records the free of trace id `id`.
pub fn free(handle: i64, id: u64) -> Result<(), Failure> {
    with(handle, |r| {
        r.log.free(id).map_err(log_err(handle))?;
        r.frees += 1;
        Ok(())
    })
}

/// Gives live trace id `id` the kind `kind` from its allocation on.
pub fn retag(handle: i64, id: u64, kind: TensorKind) -> Result<(), Failure> {
    with(handle, |r| {
        r.log.retag(id, kind).map_err(log_err(handle))?;
        r.retags += 1;
        Ok(())
    })
}

/// Records a phase mark.
pub fn phase(handle: i64, phase: Phase, step: u64) -> Result<(), Failure> {
    with(handle, |r| {
        r.log.phase(phase, step);
        r.phases += 1;
        Ok(())
    })
}

/// Writes the trace so far to `path` (`.gz`: compressed). The events are
/// copied under the registry's lock and written outside it.
pub fn save(handle: i64, path: &Path) -> Result<(), Failure> {
    let (source, log) = with(handle, |r| Ok((r.source.clone(), r.log.clone())))?;
    log.write(path, &TraceHeader { source, ranks: 1 })
        .map_err(|e| Failure::new(Cause::Trace, format!("writing the trace to {}: {e}", path.display())))
}

/// The keys of [`plan`]'s options.
const PLAN_KEYS: [&str; 4] = ["plan_cache", "policy", "capacity", "device"];

/// Plans ahead: replays the trace recorded so far on a simulated device
/// under a policy with a planner, so that its plans land in a plan cache —
/// the file a live run reads (`wasmem_init`'s `plan_cache`) to be planned
/// from its first request, its first step included.
///
/// `options` (a JSON object): `plan_cache` (required; `{rank}` and
/// `{device}` replaced as for a live run), `policy` (default `planned`),
/// `capacity` (the device's bytes, a number or a size such as `"80GiB"`;
/// default 80 GiB) and `device` (the ordinal for `{device}`, default 0).
/// The cache is made afresh, in a temporary file renamed over the old one,
/// unless the old one is not a plan cache (then it is left as it is). The
/// figures of the run are returned and kept for [`stats`] (`plan`): with
/// `plans`, `steady_plans` (plans of the steps after the first: none means
/// those steps learn on the device) and `period`, the planning run's
/// metrics (it learns on the device, as a run without a cache would), and
/// `first_run`: the figures of the recording replayed again from the cache
/// written, as the first live run starts (`plans_loaded`, `plan_hits`,
/// `plan_misses`, `plan_refused`, `plan_arena_bytes`, `peak_reserved_bytes`,
/// `overhead_ratio`, `device_alloc_calls`).
pub fn plan(handle: i64, options: &str) -> Result<Value, Failure> {
    let bad = |m: String| Failure::new(Cause::BadArgument, format!("recorder {handle}: planning ahead: {m}"));
    let o: Value = serde_json::from_str(options).map_err(|e| bad(format!("options are not JSON: {e}")))?;
    let o = o.as_object().ok_or_else(|| bad("options are not a JSON object".into()))?;
    if let Some(k) = o.keys().find(|k| !PLAN_KEYS.contains(&k.as_str())) {
        return Err(bad(format!("unknown option `{k}` (known: {})", PLAN_KEYS.join(", "))));
    }
    let template = o
        .get("plan_cache")
        .and_then(Value::as_str)
        .ok_or_else(|| bad("option `plan_cache` (a path) is required".into()))?;
    let policy = match o.get("policy") {
        None | Some(Value::Null) => "planned",
        Some(v) => v.as_str().ok_or_else(|| bad("option `policy` is not a string".into()))?,
    };
    let capacity = match o.get("capacity") {
        None | Some(Value::Null) => crate::config::DEFAULT_SIM_CAPACITY,
        Some(Value::String(t)) => wasmem::types::parse_size(t)
            .ok()
            .filter(|&c| c > 0)
            .ok_or_else(|| bad(format!("option `capacity` is {t:?}, not a size such as \"80GiB\"")))?,
        Some(v) => v.as_u64().filter(|&c| c > 0).ok_or_else(|| bad(format!("option `capacity` is {v}")))?,
    };
    let ordinal = match o.get("device") {
        None | Some(Value::Null) => 0,
        Some(v) => v.as_u64().ok_or_else(|| bad(format!("option `device` is {v}")))? as usize,
    };
    let config = crate::config::Config {
        plan_cache: Some(template.to_string()),
        ..crate::config::Config::from_env().map_err(|e| bad(e.to_string()))?
    };
    let path = config.plan_cache_path(ordinal).expect("a template is set");
    // Pages of the simulated device that plans ahead (CUDA's too).
    let granularity = wasmem::device::sim::SimConfig::default().granularity;
    let planner = wasmem::session::has_planner(policy, &wasmem::policy::GlobalRuntime)
        .map_err(|e| Failure::new(Cause::Policy, e.to_string()))?;
    if !planner {
        return Err(bad(format!("policy `{policy}` has no planner (e.g. `planned`)")));
    }
    // A stale or invalid cache is replaced; a file that is no plan cache is not.
    if let Err(e) = wasmem::alloc::check_plan_cache(&path, capacity, granularity) {
        if e.foreign {
            return Err(bad(format!("{e}; it is not overwritten")));
        }
    }
    // The live library rounds requests up (`state::ALIGN`) before its
    // allocator sees them: plans are keyed by the rounded sizes.
    let mut events = with(handle, |r| Ok(r.log.events().to_vec()))?;
    let steps =
        events.iter().filter(|e| matches!(e, wasmem::trace::Event::Phase { phase: Phase::StepEnd, .. })).count();
    if steps < 3 {
        return Err(bad(format!(
            "the trace has {steps} step ends; record three steps or more (the first, and two that repeat: a steady \
             step is planned once it repeated), tracked with `track(model, optimizer)`"
        )));
    }
    for e in &mut events {
        if let wasmem::trace::Event::Alloc { bytes, .. } = e {
            *bytes = bytes.div_ceil(crate::state::ALIGN) * crate::state::ALIGN;
        }
    }
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(format!(".ahead{}", std::process::id()));
    let tmp = std::path::PathBuf::from(tmp);
    let _ = std::fs::remove_file(&tmp);
    let opts = wasmem::session::ReplayOptions {
        device: wasmem::session::DeviceChoice::Sim { capacity },
        plan_cache: Some(tmp.clone()),
        ..Default::default()
    };
    let workload = wasmem::workload::Workload::from_events(&format!("recorder {handle}"), events);
    let run = wasmem::session::run(&workload, policy, &opts, &wasmem::policy::GlobalRuntime, &|_| {});
    let outcome = run.map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        bad(e.to_string())
    })?;
    let m = &outcome.metrics;
    if !tmp.is_file() {
        return Err(bad(format!("the {} recorded steps gave no plan (no step repeated the one before)", m.steps)));
    }
    std::fs::rename(&tmp, &path).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        bad(format!("{}: {e}", path.display()))
    })?;
    let cached = wasmem::alloc::check_plan_cache(&path, capacity, granularity)
        .map_err(|e| bad(e.to_string()))?
        .ok_or_else(|| bad(format!("{} vanished", path.display())))?;
    // What the first live run gets: the recording replayed again, started
    // from a copy of the cache just written (the planning run learned on
    // the device: its own figures count the steps before a plan, and an
    // arena it refused because its learning steps left memory reserved).
    std::fs::copy(&path, &tmp).map_err(|e| bad(format!("{}: {e}", tmp.display())))?;
    let warm = wasmem::session::run(&workload, policy, &opts, &wasmem::policy::GlobalRuntime, &|_| {});
    let _ = std::fs::remove_file(&tmp);
    let w = warm.map_err(|e| bad(format!("replaying from the plan cache: {e}")))?.metrics;
    let figures = json!({
        "plan_cache": path.to_string_lossy(),
        "policy": policy,
        "capacity_bytes": capacity,
        "plans": usize::from(cached.first_step) + cached.steady,
        "steady_plans": cached.steady,
        "period": cached.period,
        "unsteady": cached.unsteady,
        "dynamic": cached.dynamic,
        "steps": m.steps,
        "plan_arena_bytes": m.plan_arena_bytes,
        "plan_refused": m.plan_refused,
        "peak_live_bytes": m.peak_live_bytes,
        "peak_reserved_bytes": m.peak_reserved_bytes,
        "overhead_ratio": m.overhead_ratio,
        "device_alloc_calls": m.device_alloc_calls,
        "first_run": {
            "plans_loaded": w.plans_loaded,
            "plan_hits": w.plan_hits,
            "plan_misses": w.plan_misses,
            "plan_refused": w.plan_refused,
            "plan_arena_bytes": w.plan_arena_bytes,
            "peak_reserved_bytes": w.peak_reserved_bytes,
            "overhead_ratio": w.overhead_ratio,
            "device_alloc_calls": w.device_alloc_calls,
        },
    });
    with(handle, |r| {
        r.planned = Some(figures.clone());
        Ok(())
    })?;
    Ok(figures)
}

/// The recorder's counts: `events`, `allocs`, `frees`, `retags`, `phases`,
/// `live_tensors`, `live_bytes`, `peak_live_bytes`, and `plan`: the
/// figures of the last [`plan`] (null before one).
pub fn stats(handle: i64) -> Result<Value, Failure> {
    with(handle, |r| {
        Ok(json!({
            "plan": r.planned,
            "events": r.log.events().len(),
            "allocs": r.allocs,
            "frees": r.frees,
            "retags": r.retags,
            "phases": r.phases,
            "live_tensors": r.log.live_ids(),
            "live_bytes": r.log.live_bytes(),
            "peak_live_bytes": r.log.peak_live_bytes(),
        }))
    })
}

/// Closes a recorder (its trace is dropped).
pub fn close(handle: i64) -> Result<(), Failure> {
    let mut g = RECORDERS.lock().unwrap_or_else(PoisonError::into_inner);
    g.open
        .remove(&handle)
        .map(|_| ())
        .ok_or_else(|| Failure::new(Cause::BadArgument, format!("recorder handle {handle} is not open")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_are_checked_and_ids_are_recorded() {
        let h = open("test");
        let a = alloc(h, 100, TensorKind::Temp, 0).unwrap();
        let b = alloc(h, 300, TensorKind::Param, 0).unwrap();
        phase(h, Phase::Forward, 0).unwrap();
        retag(h, a, TensorKind::Activation).unwrap();
        free(h, a).unwrap();
        assert!(free(h, a).unwrap_err().msg.contains("not live"));
        let s = stats(h).unwrap();
        assert_eq!((s["live_bytes"].as_u64(), s["peak_live_bytes"].as_u64()), (Some(300), Some(400)));
        assert_eq!(b, 2);
        close(h).unwrap();
        assert!(close(h).unwrap_err().msg.contains("not open"));
        assert!(alloc(h, 1, TensorKind::Temp, 0).is_err());
    }

    #[test]
    fn planning_ahead_checks_its_options_and_writes_a_cache() {
        let h = open("test");
        let err = |o: &str| plan(h, o).unwrap_err().msg;
        assert!(err("[]").contains("not a JSON object"));
        assert!(err(r#"{"cache": "x"}"#).contains("unknown option `cache`"));
        assert!(err("{}").contains("`plan_cache`"));
        assert!(err(r#"{"plan_cache": "p.json", "capacity": "lots"}"#).contains("capacity"));
        assert!(err(r#"{"plan_cache": "p.json"}"#).contains("0 step ends"));
        // Parameters, then four steps of activations freed within the step.
        for k in 0..3 {
            alloc(h, (k + 1) << 20, TensorKind::Param, 0).unwrap();
        }
        for step in 0..4 {
            let acts: Vec<u64> = (0..5).map(|k| alloc(h, (3 + k) << 20, TensorKind::Activation, 0).unwrap()).collect();
            for a in acts.into_iter().rev() {
                free(h, a).unwrap();
            }
            phase(h, Phase::StepEnd, step).unwrap();
        }
        let dir = std::env::temp_dir().join(format!("wasmem-plan-ahead-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("plans.dev{device}.json");
        let o = json!({ "plan_cache": path, "capacity": "1GiB", "device": 3 }).to_string();
        let f = plan(h, &o).unwrap();
        let written = dir.join("plans.dev3.json");
        assert_eq!(f["plan_cache"].as_str(), Some(written.to_str().unwrap()));
        assert!(f["plans"].as_u64() >= Some(2), "{f}");
        assert_eq!((f["steady_plans"].as_u64(), f["period"].as_u64()), (Some(1), Some(1)), "{f}");
        // The replay from the file: planned from the first step on, every
        // request a hit, one arena at most the planning run's peak, and the
        // temporary copy of the cache gone.
        let first = &f["first_run"];
        assert_eq!(first["plans_loaded"], f["plans"], "{f}");
        assert_eq!((first["plan_misses"].as_u64(), first["plan_refused"].as_u64()), (Some(0), Some(0)), "{f}");
        // The parameters (the first step's plan) and every activation.
        assert_eq!(first["plan_hits"].as_u64(), Some(3 + 4 * 5), "{f}");
        assert_eq!(first["overhead_ratio"].as_f64(), Some(1.0), "{f}");
        assert!(first["peak_reserved_bytes"].as_u64() <= f["peak_reserved_bytes"].as_u64(), "{f}");
        assert!(first["device_alloc_calls"].as_u64() < f["device_alloc_calls"].as_u64(), "{f}");
        let left: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(left, [std::ffi::OsString::from("plans.dev3.json")]);
        assert!(err(r#"{"plan_cache": "p.json", "capacity": "0B"}"#).contains("capacity"));
        assert_eq!(stats(h).unwrap()["plan"], f);
        let text = std::fs::read_to_string(&written).unwrap();
        assert!(text.contains("wasmem-plan-cache"));
        // A file that is no plan cache is never overwritten.
        std::fs::write(&written, "notes\n").unwrap();
        assert!(err(&o).contains("not overwritten"));
        assert_eq!(std::fs::read_to_string(&written).unwrap(), "notes\n");
        assert!(err(r#"{"plan_cache": "p.json", "policy": "pytorch"}"#).contains("no planner"));
        assert!(err(r#"{"plan_cache": "p.json", "policy": "planned?effort=0"}"#).contains("out of range"));
        // A longer search (offline, before training): the same plans here,
        // where the online one already meets the bound.
        std::fs::remove_file(&written).unwrap();
        let longer = json!({ "plan_cache": path, "capacity": "1GiB", "device": 3, "policy": "planned?effort=100" });
        let g = plan(h, &longer.to_string()).unwrap();
        assert_eq!((g["plans"].as_u64(), g["first_run"]["plan_hits"].as_u64()), (f["plans"].as_u64(), Some(23)), "{g}");
        std::fs::remove_dir_all(&dir).unwrap();
        close(h).unwrap();
    }
}
