//! Shadow A/B: a second policy fed the same allocation events as the
//! primary, deciding on a copy of the allocator's bookkeeping only.
//!
//! A [`Shadow`] owns its own [`Allocator`] over a [`SimDevice`] without host
//! backing (no device memory, no host copy of any byte) whose capacity is the
//! primary's. It consumes the primary's events ([`Event`]: alloc with a trace
//! id, free, use, phase) exactly as a replay does, maps trace ids to its own
//! [`TensorId`](crate::types::TensorId)s, and so reports the metrics the shadow policy *would* have
//! had on the same run.
//!
//! Invariants:
//! - the shadow never touches the primary: it sees events by value, holds no
//!   handle of the primary, and none of its failures is returned — an
//!   unknown id, an allocator error or even a panic inside the shadow is
//!   counted in [`Shadow::errors`] (a panic disables the shadow for the rest
//!   of the run; a panicking step-end callback is removed);
//! - fed a trace, the shadow's [`Shadow::metrics`] equal those of a replay
//!   ([`crate::replay::replay`]) of that trace with the shadow's policies,
//!   apart from the timing keys (`wall_seconds`: time spent inside the
//!   shadow, `events_per_second`) — tested in `tests/shadow.rs`;
//! - out-of-memory in the shadow is an outcome (counted in `ooms`, the first
//!   one named in `first_oom`), as in a replay: the tensor is tracked without
//!   storage and its later events are no-ops; with tiers
//!   ([`Shadow::with_tiers`], the primary's configuration) it evicts to its
//!   own bookkeeping of the host and disk tiers instead, moving no byte.
//!
//! A shadow sees events as they come: it has no future, so an eviction policy
//! that reads one (`belady`, [`crate::decision::EvictionPolicy::needs_future`])
//! decides without it there (`wasmem replay --shadow` refuses it).
//!
//! [`ShadowHandle`] shares a shadow between the thread that feeds it (through
//! [`ShadowHandle::tap`], a `Box<dyn FnMut(&Event) + Send>`) and readers of its
//! metrics; at each `phase step_end` the shadow records a [`StepReport`] and
//! calls the callback set with [`ShadowHandle::on_step_end`], where a trainer
//! prints both policies side by side ([`side_by_side`]).
//!
//! Departure: the shadow runs inline on the thread that delivers the event
//! (no queue, so its state is exact at every step end); its cost is that
//! thread's, and is reported as the shadow's `wall_seconds`.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::alloc::Allocator;
use crate::decision::Policies;
use crate::device::sim::{SimConfig, SimDevice};
use crate::device::Device;
use crate::driver::{Driver, OnOom};
use crate::metrics::Metrics;
use crate::tier::TierConfig;
use crate::trace::Event;
use crate::types::Phase;

/// Metrics of both policies at the end of one step.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StepReport {
    /// The step that ended.
    pub step: u64,
    /// The shadow's metrics so far ([`Shadow::metrics`]).
    pub shadow: Metrics,
    /// The same from the shadow allocator's own counters ([`allocator_metrics`]),
    /// to set beside a primary's.
    pub allocator: Metrics,
    /// Shadow errors so far.
    pub errors: u64,
}

/// Callback run at each `phase step_end` the shadow sees.
pub type StepCallback = Box<dyn FnMut(&StepReport) + Send>;

/// A shadow allocator (see the module documentation).
pub struct Shadow {
    label: String,
    alloc: Allocator<SimDevice>,
    /// Trace ids, live bytes and event counts (OOM is an outcome, as in a replay).
    driver: Driver,
    busy: Duration,
    errors: u64,
    last_error: Option<String>,
    disabled: bool,
    last_step: Option<StepReport>,
    on_step_end: Option<StepCallback>,
}

impl std::fmt::Debug for Shadow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shadow")
            .field("label", &self.label)
            .field("events", &self.driver.events())
            .field("errors", &self.errors)
            .field("disabled", &self.disabled)
            .finish_non_exhaustive()
    }
}

impl Shadow {
    /// A shadow deciding with `policies` on a bookkeeping-only simulated
    /// device configured like `device` (its `host_backed` is forced off).
    /// `label` names the shadow in reports (usually the policy spec).
    pub fn new(label: &str, policies: Policies, device: SimConfig) -> Self {
        let dev = SimDevice::new(SimConfig { host_backed: false, ..device });
        Shadow {
            label: label.to_string(),
            alloc: Allocator::new(dev, policies),
            driver: Driver::new(OnOom::Outcome),
            busy: Duration::ZERO,
            errors: 0,
            last_error: None,
            disabled: false,
            last_step: None,
            on_step_end: None,
        }
    }

    /// A shadow deciding with the policies (and planner) of a resolved spec
    /// (see [`Shadow::new`]).
    pub fn from_resolved(label: &str, r: crate::spec::Resolved, device: SimConfig) -> Self {
        let planner = r.planner;
        let mut s = Shadow::new(label, r.policies, device);
        s.alloc.set_planner(planner);
        s
    }

    /// Enables the host and disk tiers with the primary's configuration
    /// (bookkeeping only: the shadow's device holds no contents, so no byte
    /// is copied and no spill file written).
    pub fn with_tiers(mut self, cfg: TierConfig) -> Self {
        self.alloc.enable_tiers(cfg);
        self
    }

    /// The shadow's label.
    pub fn label(&self) -> &str {
        &self.label
    }

    /// Feeds one event. Never fails: problems are counted (see [`Self::errors`]).
    pub fn observe(&mut self, ev: &Event) {
        if self.disabled {
            return;
        }
        let t0 = Instant::now();
        let r = catch_unwind(AssertUnwindSafe(|| self.apply(ev)));
        self.busy += t0.elapsed();
        match r {
            Ok(Ok(())) => {}
            Ok(Err(e)) => self.record_error(e),
            Err(_) => {
                self.disabled = true;
                self.record_error(format!("event {}: the shadow panicked and is disabled", self.driver.events()));
            }
        }
        if let Event::Phase { phase: Phase::StepEnd, step } = *ev {
            let report = StepReport {
                step,
                shadow: self.metrics(),
                allocator: allocator_metrics(&self.alloc),
                errors: self.errors,
            };
            if let Some(mut cb) = self.on_step_end.take() {
                // A panicking report callback is dropped, not propagated
                // into the thread that drives the primary.
                match catch_unwind(AssertUnwindSafe(|| cb(&report))) {
                    Ok(()) => self.on_step_end = Some(cb),
                    Err(_) => self.record_error(format!("step {step}: the step-end callback panicked and is removed")),
                }
            }
            self.last_step = Some(report);
        }
    }

    fn record_error(&mut self, e: String) {
        if self.errors == 0 {
            tracing::warn!(shadow = %self.label, error = %e, "shadow error (counted; the primary run is unaffected)");
        }
        self.errors += 1;
        self.last_error = Some(e);
    }

    /// Applies one event through the driver (the replay's own logic).
    fn apply(&mut self, ev: &Event) -> Result<(), String> {
        self.driver.apply(&mut self.alloc, ev, None).map(|_| ()).map_err(|e| e.to_string())
    }

    /// Metrics so far, with the keys and meaning of a replay's; the timing
    /// keys are the time spent inside the shadow.
    pub fn metrics(&self) -> Metrics {
        let mut m = self.driver.metrics(&self.alloc);
        m.set_timing(self.busy.as_secs_f64());
        m
    }

    /// Problems in the shadow (events it could not apply); the primary never sees them.
    pub fn errors(&self) -> u64 {
        self.errors
    }

    /// The last such problem.
    pub fn last_error(&self) -> Option<&str> {
        self.last_error.as_deref()
    }

    /// Whether a panic disabled the shadow.
    pub fn disabled(&self) -> bool {
        self.disabled
    }

    /// The report of the last `phase step_end` seen.
    pub fn last_step(&self) -> Option<&StepReport> {
        self.last_step.as_ref()
    }

    /// The shadow's allocator (bookkeeping only).
    pub fn allocator(&self) -> &Allocator<SimDevice> {
        &self.alloc
    }

    /// Sets the callback run at each `phase step_end`.
    pub fn set_on_step_end(&mut self, cb: StepCallback) {
        self.on_step_end = Some(cb);
    }
}

/// A shadow shared between the thread feeding it and its readers.
#[derive(Clone, Debug)]
pub struct ShadowHandle {
    inner: Arc<Mutex<Shadow>>,
}

impl ShadowHandle {
    /// Shares `shadow`.
    pub fn new(shadow: Shadow) -> Self {
        ShadowHandle { inner: Arc::new(Mutex::new(shadow)) }
    }

    fn lock(&self) -> MutexGuard<'_, Shadow> {
        // `observe` catches panics, so a poisoned lock still holds a
        // consistent (possibly disabled) shadow.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A per-rank event tap feeding this shadow.
    pub fn tap(&self) -> Box<dyn FnMut(&Event) + Send> {
        let h = self.clone();
        Box::new(move |ev: &Event| h.lock().observe(ev))
    }

    /// Runs `f` on the shadow.
    pub fn with<R>(&self, f: impl FnOnce(&mut Shadow) -> R) -> R {
        f(&mut self.lock())
    }

    /// [`Shadow::metrics`].
    pub fn metrics(&self) -> Metrics {
        self.lock().metrics()
    }

    /// [`Shadow::set_on_step_end`].
    pub fn on_step_end(&self, cb: StepCallback) {
        self.lock().set_on_step_end(cb);
    }

    /// The shadow's state for a status report.
    pub fn status(&self) -> ShadowStatus {
        let s = self.lock();
        ShadowStatus {
            label: s.label.clone(),
            metrics: s.metrics(),
            errors: s.errors,
            last_error: s.last_error.clone(),
            disabled: s.disabled,
            policies: s.alloc.policies().names(),
        }
    }
}

/// A shadow's state as reported by `wasmem ctl status`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ShadowStatus {
    /// The shadow's label (policy spec).
    pub label: String,
    /// Its metrics so far.
    pub metrics: Metrics,
    /// Events it could not apply.
    pub errors: u64,
    /// The last such problem.
    pub last_error: Option<String>,
    /// Disabled by a panic.
    pub disabled: bool,
    /// Active policy per role (placement, reclamation, eviction).
    pub policies: [String; 3],
}

/// Metrics of any allocator from its own counters, for a side-by-side view
/// of a primary (whose events are counted by its driver, not here): `events`
/// is 0, `allocs`/`frees`/`uses` are the allocator's successful calls and
/// `peak_live_bytes` is its gauge.
pub fn allocator_metrics<D: Device>(alloc: &Allocator<D>) -> Metrics {
    let s = alloc.stats();
    let mut m =
        Metrics { allocs: s.allocs, frees: s.frees, peak_live_bytes: s.bytes.peak_live_bytes, ..Metrics::default() };
    crate::metrics::fill(&mut m, &s, alloc.device(), alloc.gc_pauses(), &alloc.tier_stats());
    m.set_policy_latency(&alloc.policies().latency());
    m.uses = s.uses;
    m
}

/// The table printed at the end of a step: the primary's metrics beside the
/// shadow's, ratios against the primary. Both columns should come from the
/// same function ([`allocator_metrics`], or a replay's and
/// [`Shadow::metrics`]) so that they mean the same.
pub fn side_by_side(title: &str, primary: (&str, &Metrics), shadow: (&str, &Metrics)) -> String {
    crate::report::comparison_table(
        title,
        &[(primary.0.to_string(), primary.1.clone()), (format!("shadow:{}", shadow.0), shadow.1.clone())],
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::builtin;
    use crate::types::{TensorKind, GIB, MIB};

    fn alloc(id: u64, bytes: u64) -> Event {
        Event::Alloc { id, bytes, kind: TensorKind::Activation, stream: 0, t_us: None }
    }

    fn free(id: u64) -> Event {
        Event::Free { id, t_us: None }
    }

    fn shadow(name: &str, cap: u64) -> Shadow {
        Shadow::new(name, builtin::by_name(name).unwrap(), SimConfig { capacity: cap, ..SimConfig::default() })
    }

    #[test]
    fn bad_events_are_counted_not_raised() {
        let mut s = shadow("pytorch", GIB);
        s.observe(&free(7));
        s.observe(&Event::Use { id: 9, stream: None });
        s.observe(&alloc(1, MIB));
        s.observe(&alloc(1, MIB));
        assert_eq!(s.errors(), 3);
        assert!(s.last_error().unwrap().contains("already live"), "{:?}", s.last_error());
        s.observe(&free(1));
        assert_eq!(s.errors(), 3);
        assert_eq!(s.allocator().live_tensors(), 0);
        s.allocator().check_invariants().unwrap();
    }

    #[test]
    fn oom_is_an_outcome() {
        let mut s = shadow("naive", 4 * MIB);
        s.observe(&alloc(1, 3 * MIB));
        s.observe(&alloc(2, 3 * MIB));
        s.observe(&Event::Use { id: 2, stream: None });
        s.observe(&free(2));
        s.observe(&free(1));
        let m = s.metrics();
        assert_eq!((m.ooms, s.errors()), (1, 0));
        assert_eq!(m.peak_live_bytes, 6 * MIB);
    }

    #[test]
    fn step_end_reports_through_the_callback() {
        let h = ShadowHandle::new(shadow("pytorch", GIB));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let s2 = seen.clone();
        h.on_step_end(Box::new(move |r: &StepReport| {
            assert_eq!(r.allocator.peak_reserved_bytes, r.shadow.peak_reserved_bytes);
            s2.lock().unwrap().push((r.step, r.shadow.allocs, r.allocator.frees))
        }));
        let mut tap = h.tap();
        tap(&alloc(1, MIB));
        tap(&Event::Phase { phase: Phase::StepEnd, step: 0 });
        tap(&alloc(2, MIB));
        tap(&free(1));
        tap(&Event::Phase { phase: Phase::StepEnd, step: 1 });
        assert_eq!(*seen.lock().unwrap(), vec![(0, 1, 0), (1, 2, 1)]);
        assert_eq!(h.with(|s| s.last_step().map(|r| r.step)), Some(1));
        let st = h.status();
        assert_eq!(st.label, "pytorch");
        assert_eq!(st.metrics.frees, 1);
    }

    #[test]
    fn a_panicking_callback_stays_in_the_shadow() {
        let h = ShadowHandle::new(shadow("pytorch", GIB));
        h.on_step_end(Box::new(|r: &StepReport| {
            if r.step == 1 {
                panic!("report sink broke");
            }
        }));
        let mut tap = h.tap();
        for step in 0..3 {
            tap(&alloc(step + 10, MIB));
            tap(&Event::Phase { phase: Phase::StepEnd, step });
        }
        assert_eq!(h.with(|s| s.errors()), 1);
        assert!(h.with(|s| s.last_error().unwrap().contains("callback panicked")));
        assert_eq!(h.metrics().allocs, 3);
        assert!(!h.with(|s| s.disabled()));
    }

    #[test]
    fn allocator_metrics_match_a_shadow_driven_allocator() {
        let mut s = shadow("lifecycle", GIB);
        for i in 0..50 {
            s.observe(&alloc(i, (i + 1) * 100_000));
        }
        for i in 0..25 {
            s.observe(&free(i * 2));
        }
        let a = allocator_metrics(s.allocator());
        let m = s.metrics();
        assert_eq!(a.peak_reserved_bytes, m.peak_reserved_bytes);
        assert_eq!(a.device_alloc_calls, m.device_alloc_calls);
        assert_eq!((a.allocs, a.frees), (50, 25));
        let t = side_by_side("step 0", ("lifecycle", &a), ("lifecycle", &m));
        assert!(t.contains("shadow:lifecycle"), "{t}");
    }
}
