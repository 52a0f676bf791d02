//! A policy instance: one `Store` (its own memory, limits and host state)
//! created from the component's `InstancePre`, and the calls into it.
//!
//! Every call is armed with the sandbox limits (epoch deadline, fuel) and
//! carries the [`PolicyContext`] the host imports report. A call that fails
//! (trap, deadline, fuel, memory cap) leaves the instance unusable, so it is
//! marked *poisoned* and re-instantiated from the `InstancePre` before the
//! next call — its learned state is lost (logged).
//!
//! [`WasmPolicy`] is a shared handle (`Arc<Mutex<_>>`) to one instance: the
//! role adapters of a component that exports several roles share it, so a
//! policy sees all of its own decisions.

use std::sync::{Arc, Mutex, MutexGuard};

use wasmtime::Store;

use super::bindings::WitVersion;
use super::error::LoadError;
use super::guests::Guests;
use super::host::HostState;
use super::loader::Loaded;
use super::sandbox::{classify, describe, guest_said};
use crate::decision::{PolicyContext, PolicyError, PolicyState, PoolSpec, Role};

/// Which limits to arm a call with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CallKind {
    /// A decision: the per-call deadline and fuel.
    Decision,
    /// An eviction decision over this many candidates: the per-call
    /// deadline plus the allowance per candidate, and the fuel.
    Eviction(usize),
    /// A planning call over a profile of this many requests: the per-call
    /// deadline plus the allowance per request, and the fuel scaled alike.
    Planning(usize),
    /// A lifecycle call: the lifecycle deadline, 1000× fuel.
    Lifecycle,
}

pub(crate) struct Instance {
    loaded: Loaded,
    config: String,
    /// `lifecycle.name`, or the label before it is known.
    pub name: String,
    store: Store<HostState>,
    guests: Guests,
    poisoned: bool,
    /// Re-instantiations after failures.
    pub reinstantiations: u64,
    /// Failed calls (any cause).
    pub failures: u64,
    /// Decision calls get this many epoch ticks instead of their deadline
    /// (the conformance check's runs, which measure rather than interrupt).
    pub relaxed_ticks: Option<u64>,
    /// Limit failures whose guest text was logged (the first few only).
    said_logged: u32,
}

impl Instance {
    /// Instantiates `loaded` and runs `init(config)`.
    fn create(loaded: &Loaded, config: &str, name: &str) -> Result<(Store<HostState>, Guests), LoadError> {
        let inner = &loaded.inner;
        let rt = &inner.runtime.inner;
        let limits = &rt.config.limits;
        let mut store = Store::new(&rt.engine, HostState::new(name.to_string(), limits));
        store.limiter(|s| &mut s.limiter);
        if rt.deadline_ticks.is_some() {
            store.epoch_deadline_callback(|mut s| Ok(s.data_mut().at_deadline()));
        }
        arm(&mut store, &loaded.inner.runtime, CallKind::Lifecycle);
        let err = |e: &wasmtime::Error, s: &Store<HostState>| {
            let d = s.data();
            describe(e, guest_said(d.last_error.as_deref(), &d.output.take()).as_deref())
        };
        let instance = inner
            .pre
            .instantiate(&mut store)
            .map_err(|e| LoadError::Instantiate { policy: name.to_string(), cause: err(&e, &store) })?;
        let link = |e: wasmtime::Error| LoadError::Link { policy: name.to_string(), cause: format!("{e:#}") };
        let guests = inner.indices.load(&mut store, &instance).map_err(link)?;
        match guests.init(&mut store, config) {
            Ok(Ok(())) => {}
            Ok(Err(msg)) => {
                let msg = crate::text::message(&msg);
                return Err(LoadError::lifecycle(name, "init", format!("refused the configuration: {msg}")));
            }
            Err(e) => return Err(LoadError::lifecycle(name, "init", err(&e, &store))),
        }
        Ok((store, guests))
    }

    /// Runs `f` on the instance with the limits of `kind` and `ctx` as the
    /// context of the host imports. Re-instantiates a poisoned instance first.
    pub(crate) fn call<R>(
        &mut self,
        kind: CallKind,
        ctx: &PolicyContext,
        f: impl FnOnce(&Guests, &mut Store<HostState>) -> wasmtime::Result<R>,
    ) -> Result<R, PolicyError> {
        if self.poisoned {
            self.reinstantiate()?;
        }
        let grace = self.loaded.inner.runtime.inner.grace_ticks;
        let data = self.store.data_mut();
        data.ctx = *ctx;
        data.last_error = None;
        data.output_mark = data.output.written();
        data.grace_ticks = grace;
        match (self.relaxed_ticks, kind) {
            (Some(ticks), CallKind::Decision | CallKind::Eviction(_)) => self.store.set_epoch_deadline(ticks),
            (Some(ticks), CallKind::Planning(n)) => {
                let scale = planning_scale(&self.loaded.inner.runtime.inner.config.limits, n);
                self.store.set_epoch_deadline(ticks.saturating_mul(scale))
            }
            _ => arm(&mut self.store, &self.loaded.inner.runtime, kind),
        }
        match f(&self.guests, &mut self.store) {
            Ok(r) => Ok(r),
            Err(e) => {
                let data = self.store.data();
                let said = guest_said(data.last_error.as_deref(), &data.output.take());
                let err = classify(&self.name, &e, said.as_deref());
                if let (Some(said), false) = (&said, matches!(err, PolicyError::Trap(_))) {
                    // A limit's error carries no text: say what the guest said once in a while.
                    if self.said_logged < 3 {
                        self.said_logged += 1;
                        tracing::warn!(policy = %self.name, error = %err, said = %said, "policy call failed");
                    }
                }
                self.failures += 1;
                self.poisoned = true;
                tracing::debug!(policy = %self.name, error = %err, "policy call failed; the instance will be re-instantiated");
                Err(err)
            }
        }
    }

    fn reinstantiate(&mut self) -> Result<(), PolicyError> {
        match Instance::create(&self.loaded, &self.config, &self.name) {
            Ok((store, guests)) => {
                self.store = store;
                self.guests = guests;
                self.poisoned = false;
                self.reinstantiations += 1;
                tracing::warn!(
                    policy = %self.name,
                    count = self.reinstantiations,
                    "policy re-instantiated after a failed call; its learned state is lost"
                );
                Ok(())
            }
            Err(e) => Err(PolicyError::Trap(format!("re-instantiation after a failure failed: {e}"))),
        }
    }

    /// Bytes of linear memory in use.
    fn memory_bytes(&self) -> usize {
        self.store.data().limiter.used
    }
}

/// Arms the store's deadline and fuel for one call.
fn arm(store: &mut Store<HostState>, runtime: &super::Runtime, kind: CallKind) {
    let rt = &runtime.inner;
    let limits = &rt.config.limits;
    let ticks_of = |extra: u128| u64::try_from(extra.div_ceil(rt.tick.as_nanos().max(1))).unwrap_or(u64::MAX);
    if let Some((decision, lifecycle)) = rt.deadline_ticks {
        let ticks =
            match kind {
                CallKind::Decision => decision,
                CallKind::Eviction(n) => decision
                    .saturating_add(ticks_of(limits.deadline_per_candidate.as_nanos().saturating_mul(n as u128))),
                CallKind::Planning(n) => decision
                    .saturating_add(ticks_of(limits.deadline_per_plan_request.as_nanos().saturating_mul(n as u128))),
                CallKind::Lifecycle => lifecycle,
            };
        store.set_epoch_deadline(ticks);
    }
    if let Some(fuel) = limits.fuel {
        let fuel = match kind {
            CallKind::Lifecycle => fuel.saturating_mul(1000),
            CallKind::Planning(n) => fuel.saturating_mul(planning_scale(limits, n)),
            _ => fuel,
        };
        // Fails only when fuel is not enabled, which `Runtime::new` did.
        let _ = store.set_fuel(fuel);
    }
}

/// How many decision calls' worth of time (and fuel) a planning call over
/// `n` requests gets: `(deadline + n × per-request allowance) / deadline`,
/// rounded up (1 + n / 40 without a deadline: 25 µs per request of 1 ms).
fn planning_scale(limits: &super::Limits, n: usize) -> u64 {
    let per = limits.deadline_per_plan_request.as_nanos().saturating_mul(n as u128);
    let scale = match limits.deadline {
        Some(d) if d.as_nanos() > 0 => (d.as_nanos().saturating_add(per)).div_ceil(d.as_nanos()),
        _ => 1 + n as u128 / 40,
    };
    u64::try_from(scale).unwrap_or(u64::MAX)
}

struct Meta {
    name: String,
    version: WitVersion,
    roles: Vec<Role>,
    planner: bool,
    pools: Vec<PoolSpec>,
    paged_segments: bool,
}

/// A shared handle to one instance of a policy component.
///
/// Cloning shares the instance. The role adapters ([`WasmPolicy::placement`]
/// …) share it too, so a component that exports several roles keeps one
/// state across them.
#[derive(Clone)]
pub struct WasmPolicy {
    pub(crate) instance: Arc<Mutex<Instance>>,
    meta: Arc<Meta>,
}

impl std::fmt::Debug for WasmPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WasmPolicy")
            .field("name", &self.meta.name)
            .field("roles", &self.meta.roles)
            .field("planner", &self.meta.planner)
            .finish()
    }
}

impl Loaded {
    /// A new instance configured with `config` (`lifecycle.init`).
    pub fn instantiate(&self, config: &str) -> Result<WasmPolicy, LoadError> {
        WasmPolicy::new(self.clone(), config)
    }
}

impl WasmPolicy {
    pub(crate) fn new(loaded: Loaded, config: &str) -> Result<WasmPolicy, LoadError> {
        let label = loaded.label().to_string();
        let (store, guests) = Instance::create(&loaded, config, &label)?;
        let mut inst = Instance {
            loaded: loaded.clone(),
            config: config.to_string(),
            name: label.clone(),
            store,
            guests,
            poisoned: false,
            reinstantiations: 0,
            failures: 0,
            relaxed_ticks: None,
            said_logged: 0,
        };
        let ctx = PolicyContext::default();
        let name = inst
            .call(CallKind::Lifecycle, &ctx, |g, s| g.name(s))
            .map_err(|e| LoadError::lifecycle(&label, "name", e))?;
        // Policy text is bounded and made printable before it goes anywhere.
        let name = if name.trim().is_empty() { label.clone() } else { crate::text::name(&name) };
        inst.name = name.clone();
        inst.store.data_mut().policy = name.clone();
        let pools = if loaded.exports(Role::Placement) {
            let pools = inst
                .call(CallKind::Lifecycle, &ctx, |g, s| g.pools(s))
                .map_err(|e| LoadError::lifecycle(&name, "pools", e))?
                .unwrap_or_default();
            if pools.is_empty() {
                return Err(LoadError::lifecycle(
                    &name,
                    "pools",
                    "returned an empty list (at least one pool is needed)",
                ));
            }
            pools.into_iter().map(|p| PoolSpec { name: crate::text::name(&p.name), ..p }).collect()
        } else {
            Vec::new()
        };
        // Asked once: the answer holds for the instance's life.
        let paged_segments = if loaded.exports(Role::Reclamation) {
            inst.call(CallKind::Lifecycle, &ctx, |g, s| g.paged_segments(s))
                .map_err(|e| LoadError::lifecycle(&name, "paged-segments", e))?
        } else {
            false
        };
        let roles = loaded.roles().to_vec();
        let planner = loaded.exports_planner();
        let meta = Meta { name, version: loaded.wit_version(), roles, planner, pools, paged_segments };
        Ok(WasmPolicy { instance: Arc::new(Mutex::new(inst)), meta: Arc::new(meta) })
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, Instance> {
        // A panic while holding the lock cannot leave the instance
        // inconsistent in a way calls rely on (a failed call poisons it).
        self.instance.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `lifecycle.name`.
    pub fn name(&self) -> &str {
        &self.meta.name
    }

    /// The version of the `wasmem:policy` WIT package the component was built against.
    pub fn wit_version(&self) -> WitVersion {
        self.meta.version
    }

    /// The answer of `reclamation.paged-segments` after `init` (false for a
    /// 0.1.0 component or one without a reclamation role).
    pub fn paged_segments(&self) -> bool {
        self.meta.paged_segments
    }

    /// The roles the component exports.
    pub fn roles(&self) -> &[Role] {
        &self.meta.roles
    }

    /// Whether the component exports `role`.
    pub fn exports(&self, role: Role) -> bool {
        self.meta.roles.contains(&role)
    }

    /// Whether the component exports the planner (`wasmem:policy/planner`, 0.3.0 on).
    pub fn exports_planner(&self) -> bool {
        self.meta.planner
    }

    /// The pools of the placement role (empty without one), as returned by
    /// `placement.pools` after `init`.
    pub fn pools(&self) -> &[PoolSpec] {
        &self.meta.pools
    }

    /// `lifecycle.save-state`.
    pub fn save_state(&self) -> Result<Vec<u8>, PolicyError> {
        self.lock().call(CallKind::Lifecycle, &PolicyContext::default(), |g, s| g.save_state(s))
    }

    /// `lifecycle.load-state`: [`PolicyError::Refused`] with the policy's
    /// message, or the failure.
    pub fn load_state(&self, state: &[u8]) -> Result<(), PolicyError> {
        match self.lock().call(CallKind::Lifecycle, &PolicyContext::default(), |g, s| g.load_state(s, state)) {
            Ok(Ok(())) => Ok(()),
            Ok(Err(msg)) => Err(PolicyError::Refused(crate::text::message(&msg))),
            Err(e) => Err(e),
        }
    }

    /// Times the instance was re-instantiated after a failed call.
    pub fn reinstantiations(&self) -> u64 {
        self.lock().reinstantiations
    }

    /// Calls that failed (trap, deadline, fuel, memory cap).
    pub fn failures(&self) -> u64 {
        self.lock().failures
    }

    /// Bytes of linear memory the instance uses now.
    pub fn memory_bytes(&self) -> usize {
        self.lock().memory_bytes()
    }

    /// Gives every decision call of this instance `deadline` instead of
    /// the runtime's (`None`: the runtime's again). Used by the
    /// conformance check, which measures calls rather than interrupting
    /// them at the engine's deadline. Needs a runtime with a deadline.
    pub(crate) fn set_relaxed_deadline(&self, deadline: Option<std::time::Duration>) {
        let rt = self.lock().loaded.inner.runtime.clone();
        let tick = rt.inner.tick.as_nanos().max(1);
        let ticks = deadline.map(|d| u64::try_from(d.as_nanos().div_ceil(tick)).unwrap_or(u64::MAX).max(1));
        self.lock().relaxed_ticks = ticks.filter(|_| rt.inner.deadline_ticks.is_some());
    }
}

/// The learned state of a component (`lifecycle.save-state`/`load-state`),
/// shared by the roles of the instance.
impl PolicyState for WasmPolicy {
    fn state_name(&self) -> String {
        self.name().to_string()
    }

    fn instance(&self) -> usize {
        Arc::as_ptr(&self.instance) as *const () as usize
    }

    fn save_state(&self) -> Result<Vec<u8>, PolicyError> {
        WasmPolicy::save_state(self)
    }

    fn load_state(&self, state: &[u8]) -> Result<(), PolicyError> {
        WasmPolicy::load_state(self, state)
    }
}
