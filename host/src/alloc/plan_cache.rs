//! The plan cache: the plans of a run, kept in a file for the next run of
//! the same training, so that it is planned from its first request.
//!
//! ```text
//!  run 1: step 0 profiled ─► planner ─► first plan (+ which end-live requests are never freed)
//!         steady steps planned as usual ───────────────► plans
//!         at a step end where either changed ──────────► FILE (written whole, then renamed)
//!  run 2: FILE ─► every plan validated again ─► one arena for every plan (the largest), and a
//!         kept arena for the persistent requests ─► step 0 served from its first request
//! ```
//!
//! A run's first step cannot be learned online: it happens once. The cache
//! gives it a plan — its temporaries as the planner placed them, and its
//! requests that stayed live for the whole run (parameters, gradients,
//! optimizer states: freed after the last step end, or never) packed in an
//! arena of their own, kept while they live (a run that turns out to be
//! another training then holds no more than what its own persistent
//! requests take). The next run serves every step from these two arenas:
//! its device calls are theirs and its misses', not those of learning on
//! the dynamic path.
//!
//! Plans of two steps in an aliased arena (kept-output loops: one physical
//! arena mapped at two windows, see [`super::planned`]) are cached with
//! their zone bytes; the first-step plan then lies in the second window of
//! the arena of one of them, as the step before a pair would, so that the
//! next run serves its first pair in the arena its first step used.
//!
//! The file is JSON with one request per line (`[bytes, kind, stream,
//! freed_at, wraps_to, offset]`), so that an error names a line. A file that
//! does not parse, is of another format or version, or holds a plan that
//! fails [`validate_plan`] is refused whole, with its path and what is wrong
//! (line and column, or the plan and request): the run then learns as if
//! there were none, and overwrites it.

use std::io::Write as _;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::decision::{validate_aliased, validate_plan, AliasedPlan, Plan, PlanRequest, StepProfile, PLAN_ALIGN};
use crate::types::{StreamId, TensorKind};

/// The `format` field of a cache file.
pub const FORMAT: &str = "wasmem-plan-cache";

/// The version of the cache format this build reads and writes.
pub const VERSION: u32 = 1;

/// One request of a cached plan: `[bytes, kind, stream, freed_at, wraps_to, offset]`.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
struct Row(u64, TensorKind, u32, Option<u32>, Option<u32>, Option<u64>);

/// The header of a cache file.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Header {
    format: String,
    version: u32,
    align: u64,
    high_water: u64,
    /// Training steps per planned step after the first (1 or 2).
    #[serde(default = "one")]
    period: u32,
    /// An earlier run found the training's steps unsteady (a step that left
    /// its plan raised the peak): the next run does not plan.
    #[serde(default)]
    unsteady: bool,
    /// No plan served the run that wrote it: its high-water mark is its
    /// dynamic path's (absent: false).
    #[serde(default)]
    dynamic: bool,
    /// Plans in the file: the first-step plan (when there is one) then the others.
    plans: Vec<PlanFile>,
}

fn one() -> u32 {
    1
}

/// One plan of a cache file.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct PlanFile {
    /// Whether this is the plan of a run's first step.
    first: bool,
    arena_bytes: u64,
    /// First-step plan: the requests live for the whole run, packed at the
    /// start of the arena in this order.
    #[serde(default)]
    persistent: Vec<u32>,
    /// An aliased plan: the bytes of each end zone (0 or absent: a plain
    /// plan). `arena_bytes` is then its physical memory, and a steady
    /// plan's offsets are of each step's own window (see
    /// [`crate::decision::AliasedPlan`]); a first-step plan's are of the
    /// second window.
    #[serde(default)]
    zone: u64,
    /// Searches for a cheaper plan spent on it so far (0 or absent: none).
    #[serde(default)]
    searched: u64,
    requests: Vec<Row>,
}

/// A plan as the cache holds it: its profile and the planner's plan (offsets
/// from 0, without the persistent prefix).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct CachedPlan {
    /// The profiled step's requests.
    pub profile: StepProfile,
    /// The planner's plan of them.
    pub plan: Plan,
    /// For the first-step plan: requests packed at `[0, P)`, in this order.
    pub persistent: Vec<u32>,
    /// An aliased plan (two steps, or a first step in the second window of
    /// such a plan's arena): the bytes of each end zone; `plan.arena_bytes`
    /// is then the physical memory. 0: a plain plan.
    pub zone: u64,
    /// Searches for a cheaper plan ([`crate::decision::PlannerPolicy::refine`])
    /// spent on it in the runs so far: the next one goes on from there.
    pub searched: u64,
}

impl CachedPlan {
    /// The aliased plan of a cached plan of two steps (`zone > 0`).
    pub fn aliased(&self) -> Option<AliasedPlan> {
        (self.zone > 0).then(|| AliasedPlan {
            arena_bytes: self.plan.arena_bytes,
            zone_bytes: self.zone,
            offsets: self.plan.offsets.clone(),
        })
    }

    /// Bytes the persistent requests take when packed.
    pub fn persistent_bytes(&self) -> u64 {
        self.persistent.iter().map(|&k| self.profile.requests[k as usize].planned_bytes()).sum()
    }

    /// Bytes a step of a plain steady plan keeps live at most on the
    /// dynamic path: its unplanned requests, twice each one that is live
    /// at the step's end past its next instance's allocation (or of
    /// unknown end) — an input held until the next batch replaces it.
    pub fn planless_bytes(&self) -> u64 {
        if self.zone > 0 || !self.persistent.is_empty() {
            return 0;
        }
        let reqs = self.profile.requests.iter().zip(&self.plan.offsets).enumerate();
        reqs.filter(|(_, (_, o))| o.is_none())
            .map(|(k, (r, _))| {
                let outlives = r.freed_at.is_none() && r.wraps_to.is_none_or(|w| w as usize > k);
                r.planned_bytes() * if outlives { 2 } else { 1 }
            })
            .sum()
    }
}

/// The content of a cache file.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct CacheContent {
    /// The most bytes the run that made it reserved (step ends): arenas of
    /// the next run are held to it.
    pub high_water: u64,
    /// Training steps per planned step after the first (1 or 2; 0 in a
    /// default value means 1).
    pub period: u32,
    /// The plan of a run's first step.
    pub first: Option<CachedPlan>,
    /// The other plans.
    pub plans: Vec<CachedPlan>,
    /// The run that wrote it found the training's steps unsteady (it then
    /// holds no plan): planned placement stays off in the next one.
    pub unsteady: bool,
    /// No plan served the run that wrote it (its `high_water` is what its
    /// dynamic path reserved): the next run's dynamic path may grow to it
    /// in large chunks until a plan serves.
    pub dynamic: bool,
}

/// What a valid plan cache holds ([`check_plan_cache`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheSummary {
    /// Whether it has a plan of a run's first step.
    pub first_step: bool,
    /// Plans of the steps after it.
    pub steady: usize,
    /// Training steps per planned step after the first (1 or 2).
    pub period: u32,
    /// A run of this training found its steps unsteady: the next run does
    /// not plan (the file holds no plan).
    pub unsteady: bool,
    /// Its high-water mark is what the dynamic path alone reserved
    /// ([`CacheContent::dynamic`]): the next run's dynamic path grows to it
    /// in few device calls until a plan serves.
    pub dynamic: bool,
}

/// Reads and validates the plan cache at `path` as a run on a device of
/// `capacity` bytes and pages of `granularity` bytes would: what it holds,
/// `Ok(None)` when there is no such file, or why it would be refused
/// ([`CacheError::foreign`]: not a plan cache at all, never overwritten).
pub fn check_plan_cache(path: &Path, capacity: u64, granularity: u64) -> Result<Option<CacheSummary>, CacheError> {
    Ok(CacheContent::read(path, capacity, granularity)?.map(|c| CacheSummary {
        first_step: c.first.is_some(),
        steady: c.plans.len(),
        period: c.period.max(1),
        unsteady: c.unsteady,
        dynamic: c.dynamic,
    }))
}

/// Why a cache file was refused.
#[derive(Debug, thiserror::Error)]
#[error("plan cache {}: {what}", path.display())]
pub struct CacheError {
    /// The file.
    pub path: PathBuf,
    /// What is wrong, and where in it.
    pub what: String,
    /// The file is not a plan cache at all (it does not parse, or is of
    /// another format): it is never overwritten.
    pub foreign: bool,
}

impl CacheContent {
    /// Reads and validates `path` for a device of `capacity` bytes and
    /// pages of `granularity` bytes (aliased arenas are whole pages);
    /// `Ok(None)` when there is no such file.
    pub fn read(path: &Path, capacity: u64, granularity: u64) -> Result<Option<Self>, CacheError> {
        let err = |what: String| CacheError { path: path.to_path_buf(), what, foreign: false };
        let foreign = |what: String| CacheError { path: path.to_path_buf(), what, foreign: true };
        let bytes = match std::fs::read(path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(foreign(e.to_string())),
        };
        let h: Header = serde_json::from_slice(&bytes).map_err(|e| foreign(format!("not a plan cache: {e}")))?;
        if h.format != FORMAT {
            return Err(foreign(format!("field `format` is {:?}, not {FORMAT:?}", h.format)));
        }
        if h.version != VERSION {
            return Err(err(format!("field `version` is {}; this build reads version {VERSION}", h.version)));
        }
        if h.align != PLAN_ALIGN {
            return Err(err(format!("field `align` is {}; this build plans at {PLAN_ALIGN}", h.align)));
        }
        if !(1..=2).contains(&h.period) {
            return Err(err(format!("field `period` is {}; it is 1 or 2", h.period)));
        }
        let mut out = CacheContent {
            high_water: h.high_water,
            period: h.period,
            unsteady: h.unsteady,
            dynamic: h.dynamic,
            ..Default::default()
        };
        for (i, f) in h.plans.into_iter().enumerate() {
            let at = |m: String| err(format!("plans[{i}]: {m}"));
            let (requests, offsets) = f
                .requests
                .iter()
                .map(|r| {
                    (PlanRequest { bytes: r.0, kind: r.1, stream: StreamId(r.2), freed_at: r.3, wraps_to: r.4 }, r.5)
                })
                .unzip();
            let c = CachedPlan {
                profile: StepProfile { step: 0, requests },
                plan: Plan { arena_bytes: f.arena_bytes, offsets },
                persistent: f.persistent,
                zone: f.zone,
                searched: f.searched,
            };
            match c.aliased().filter(|_| !f.first) {
                Some(a) => validate_aliased(&c.profile, &a, granularity, capacity).map_err(|e| at(e.0))?,
                None => validate_plan(&c.profile, &c.plan, capacity).map_err(|e| at(e.0))?,
            }
            let g = granularity.max(1);
            if f.first
                && c.zone > 0
                && (!c.zone.is_multiple_of(g) || !f.arena_bytes.is_multiple_of(g) || c.zone * 2 > f.arena_bytes)
            {
                return Err(at(format!(
                    "an aliased arena of {} bytes with zones of {} is not whole pages of {g} with zones at most half \
                     of it",
                    f.arena_bytes, c.zone
                )));
            }
            if c.plan.planned() == 0 && c.persistent.is_empty() {
                return Err(at("plans nothing".into()));
            }
            let mut seen = vec![false; c.profile.requests.len()];
            for (j, &k) in c.persistent.iter().enumerate() {
                let ok = seen.get(k as usize).is_some_and(|s| !s)
                    && c.plan.offsets[k as usize].is_none()
                    && c.profile.requests[k as usize].freed_at.is_none();
                if !ok {
                    return Err(at(format!(
                        "persistent[{j}] = {k}: not a request live at the step's end, unplanned and listed once"
                    )));
                }
                seen[k as usize] = true;
            }
            if !f.first && !c.persistent.is_empty() {
                return Err(at("only the first-step plan has persistent requests".into()));
            }
            if f.first {
                if out.first.is_some() {
                    return Err(at("a second first-step plan".into()));
                }
                out.first = Some(c);
            } else {
                out.plans.push(c);
            }
        }
        let kept = out.first.as_ref().map_or(0, CachedPlan::persistent_bytes);
        let aliased = out.first.iter().chain(&out.plans).filter(|c| c.zone > 0).map(|c| c.plan.arena_bytes);
        let arena = out.arena_bytes().max(aliased.max().unwrap_or(0));
        if arena.saturating_add(kept) > capacity {
            return Err(err(format!("its arenas of {arena} + {kept} bytes exceed the device's {capacity}")));
        }
        Ok(Some(out))
    }

    /// The bytes of the one arena that serves every plain plan: the
    /// largest (an aliased plan has an arena of its own).
    pub fn arena_bytes(&self) -> u64 {
        let plain = self.first.iter().chain(&self.plans).filter(|c| c.zone == 0);
        let top = plain.map(|c| c.plan.arena_bytes).max().unwrap_or(0);
        top.div_ceil(PLAN_ALIGN) * PLAN_ALIGN
    }

    /// Writes the cache to `path` (a sibling temporary file, then renamed,
    /// so that a reader never sees half a file).
    pub fn write(&self, path: &Path) -> std::io::Result<()> {
        let mut out = Vec::new();
        let mut header = serde_json::json!({
            "format": FORMAT, "version": VERSION, "align": PLAN_ALIGN, "high_water": self.high_water,
            "period": self.period.max(1),
        });
        if self.unsteady {
            header["unsteady"] = true.into();
        }
        if self.dynamic {
            header["dynamic"] = true.into();
        }
        let header = header.to_string();
        // `{...,"plans":[` with the header's fields first.
        write!(out, "{},\"plans\":[", &header[..header.len() - 1])?;
        let plans = self.first.iter().map(|c| (true, c)).chain(self.plans.iter().map(|c| (false, c)));
        for (i, (first, c)) in plans.enumerate() {
            if i > 0 {
                out.push(b',');
            }
            let persistent = serde_json::to_string(&c.persistent).map_err(std::io::Error::other)?;
            let zone = if c.zone > 0 { format!("\"zone\":{},", c.zone) } else { String::new() };
            let searched = if c.searched > 0 { format!("\"searched\":{},", c.searched) } else { String::new() };
            write!(
                out,
                "\n{{\"first\":{first},\"arena_bytes\":{},\"persistent\":{persistent},{zone}{searched}\"requests\":[",
                c.plan.arena_bytes
            )?;
            for (k, (r, off)) in c.profile.requests.iter().zip(&c.plan.offsets).enumerate() {
                let row = Row(r.bytes, r.kind, r.stream.0, r.freed_at, r.wraps_to, *off);
                let sep = if k > 0 { "," } else { "" };
                write!(out, "{sep}\n{}", serde_json::to_string(&row).map_err(std::io::Error::other)?)?;
            }
            out.extend_from_slice(b"]}");
        }
        out.extend_from_slice(b"]}\n");
        let mut tmp = path.as_os_str().to_owned();
        tmp.push(format!(".tmp{}", std::process::id()));
        let tmp = PathBuf::from(tmp);
        std::fs::write(&tmp, &out)?;
        std::fs::rename(&tmp, path).inspect_err(|_| {
            let _ = std::fs::remove_file(&tmp);
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(bytes: u64, freed_at: Option<u32>) -> PlanRequest {
        PlanRequest { bytes, kind: TensorKind::Temp, stream: StreamId(0), freed_at, wraps_to: None }
    }

    fn sample() -> CacheContent {
        let first = CachedPlan {
            profile: StepProfile { step: 0, requests: vec![req(1000, None), req(512, Some(2)), req(512, Some(3))] },
            plan: Plan { arena_bytes: 512, offsets: vec![None, Some(0), Some(0)] },
            persistent: vec![0],
            zone: 0,
            searched: 0,
        };
        let steady = CachedPlan {
            profile: StepProfile { step: 0, requests: vec![req(512, Some(1)), req(2048, Some(2))] },
            plan: Plan { arena_bytes: 2048, offsets: vec![Some(0), Some(0)] },
            persistent: vec![],
            zone: 0,
            searched: 0,
        };
        CacheContent {
            high_water: 1 << 30,
            period: 2,
            first: Some(first),
            plans: vec![steady],
            unsteady: false,
            dynamic: false,
        }
    }

    #[test]
    fn a_written_cache_reads_back_the_same() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("plans.json");
        assert!(CacheContent::read(&path, 1 << 40, 1 << 21).unwrap().is_none(), "no file is no cache");
        let c = sample();
        c.write(&path).unwrap();
        let back = CacheContent::read(&path, 1 << 40, 1 << 21).unwrap().unwrap();
        assert_eq!(back, c);
        // The largest plan (the persistent request has its own arena).
        assert_eq!(back.arena_bytes(), 2048);
        // One request per line.
        assert!(std::fs::read_to_string(&path).unwrap().lines().count() >= 6);
    }

    /// A loop's first step and an aliased plan of two steps (2 MiB zones of
    /// a 6 MiB arena): each step's temporary at 0 of its own window, the
    /// first one live until the second step's end.
    fn aliased_sample() -> CacheContent {
        let mib = 1 << 20;
        let first = CachedPlan {
            profile: StepProfile { step: 0, requests: vec![req(1000, None), req(mib, Some(2))] },
            plan: Plan { arena_bytes: 6 * mib, offsets: vec![None, Some(0)] },
            persistent: vec![0],
            zone: 2 * mib,
            searched: 0,
        };
        let pair = CachedPlan {
            profile: StepProfile { step: 0, requests: vec![req(2 * mib, Some(2)), req(2 * mib, Some(2))] },
            plan: Plan { arena_bytes: 6 * mib, offsets: vec![Some(0), Some(0)] },
            persistent: vec![],
            zone: 2 * mib,
            searched: 0,
        };
        CacheContent {
            high_water: 1 << 30,
            period: 2,
            first: Some(first),
            plans: vec![pair],
            unsteady: false,
            dynamic: false,
        }
    }

    #[test]
    fn aliased_plans_read_back_and_are_checked_as_such() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("plans.json");
        let c = aliased_sample();
        c.write(&path).unwrap();
        let good = std::fs::read_to_string(&path).unwrap();
        assert_eq!(good.matches("\"zone\":2097152").count(), 2, "{good}");
        assert_eq!(CacheContent::read(&path, 1 << 40, 1 << 21).unwrap().unwrap(), c);
        // Aliased arenas have an arena of their own: none is shared.
        assert_eq!(c.arena_bytes(), 0);
        let check = |text: &str, granularity: u64, want: &str| {
            std::fs::write(&path, text).unwrap();
            let e = CacheContent::read(&path, 1 << 40, granularity).unwrap_err().to_string();
            assert!(e.contains("plans.json") && e.contains(want), "{e}");
        };
        // Pages of another size: neither the pair nor the first step fits them.
        check(&good, 4 << 20, "plans[0]: an aliased arena");
        let pair_only = good.replacen("\"zone\":2097152", "\"zone\":0", 1);
        check(&pair_only, 4 << 20, "plans[1]: an aliased arena");
        // Zones larger than half the arena.
        check(&good.replace("\"zone\":2097152", "\"zone\":4194304"), 1 << 21, "plans[0]");
        // Read as a plain plan, the pair's two temporaries would share bytes;
        // as an aliased one they do not, but they do once both are in zone 0's window.
        let mut one_window = aliased_sample();
        one_window.plans[0].zone = 0;
        one_window.write(&path).unwrap();
        let e = CacheContent::read(&path, 1 << 40, 1 << 21).unwrap_err().to_string();
        assert!(e.contains("plans[1]") && e.contains("share bytes"), "{e}");
        // Larger than the device.
        c.write(&path).unwrap();
        let e = CacheContent::read(&path, 5 << 20, 1 << 21).unwrap_err().to_string();
        assert!(e.contains("exceed"), "{e}");
    }

    #[test]
    fn an_unsteady_mark_reads_back_without_plans() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("plans.json");
        let c = CacheContent { high_water: 1 << 30, period: 1, unsteady: true, ..Default::default() };
        c.write(&path).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.contains("\"unsteady\":true") && text.contains("\"plans\":[]"), "{text}");
        assert_eq!(CacheContent::read(&path, 1 << 40, 1 << 21).unwrap().unwrap(), c);
        let summary = check_plan_cache(&path, 1 << 40, 1 << 21).unwrap().unwrap();
        assert_eq!(summary, CacheSummary { first_step: false, steady: 0, period: 1, unsteady: true, dynamic: false });
        // A steady cache does not write the field.
        sample().write(&path).unwrap();
        assert!(!std::fs::read_to_string(&path).unwrap().contains("unsteady"));
    }

    #[test]
    fn a_dynamic_mark_reads_back_and_is_absent_otherwise() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("plans.json");
        let c = CacheContent { dynamic: true, ..sample() };
        c.write(&path).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.contains("\"dynamic\":true"), "{text}");
        assert_eq!(CacheContent::read(&path, 1 << 40, 1 << 21).unwrap().unwrap(), c);
        assert!(check_plan_cache(&path, 1 << 40, 1 << 21).unwrap().unwrap().dynamic);
        // Not written when false; a file without it (written before it
        // existed) reads as false.
        sample().write(&path).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(!text.contains("dynamic"), "{text}");
        assert!(!CacheContent::read(&path, 1 << 40, 1 << 21).unwrap().unwrap().dynamic);
    }

    #[test]
    fn a_bad_cache_is_refused_with_where() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("plans.json");
        let check = |text: &str, want: &str| {
            std::fs::write(&path, text).unwrap();
            let e = CacheContent::read(&path, 1 << 40, 1 << 21).unwrap_err().to_string();
            assert!(e.contains("plans.json") && e.contains(want), "{e}");
        };
        sample().write(&path).unwrap();
        let good = std::fs::read_to_string(&path).unwrap();
        check(&good[..good.len() / 2], "line");
        check(&good.replace("wasmem-plan-cache", "other"), "`format`");
        check(&good.replace("\"version\":1", "\"version\":9"), "`version`");
        check(&good.replace("\"period\":2", "\"period\":3"), "`period`");
        // A file without a period (written before there were periods) plans one step at a time.
        std::fs::write(&path, good.replace(",\"period\":2", "")).unwrap();
        assert_eq!(CacheContent::read(&path, 1 << 40, 1 << 21).unwrap().unwrap().period, 1);
        // Two live requests on the same bytes.
        check(&good.replace("[512,\"temp\",0,2,null,0]", "[512,\"temp\",0,3,null,0]"), "share bytes");
        // A persistent request that is freed in the step.
        check(&good.replace("\"persistent\":[0]", "\"persistent\":[1]"), "persistent[0]");
        check(&good.replace("\"persistent\":[]", "\"persistent\":[0]"), "plans[1]");
        // Larger than the device.
        sample().write(&path).unwrap();
        let e = CacheContent::read(&path, 3000, 1 << 21).unwrap_err().to_string();
        assert!(e.contains("exceed"), "{e}");
    }
}
