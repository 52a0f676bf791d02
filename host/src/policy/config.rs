//! The policy runtime: one wasmtime [`Engine`] with its configuration, the
//! [`Linker`] that provides the host imports, the epoch ticker and the
//! artifact cache. Cheap to clone (`Arc` inside); share one per process.

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use wasmtime::component::{HasSelf, Linker};
use wasmtime::{Config, Engine};

use super::bindings::{v0_1, v0_2, v0_3, v0_4};
use super::cache::ArtifactCache;
use super::error::LoadError;
use super::host::HostState;
use super::ticker::Ticker;

/// Default per-decision deadline.
pub const DEFAULT_DEADLINE: Duration = Duration::from_millis(1);
/// Default extra deadline of an eviction call per candidate offered: the
/// canonical ABI lifts every candidate record into the guest (about 7 µs
/// each into JavaScript, 0.05 µs into Rust), so a call over the 400+
/// candidates of a real trace gets 1 ms + 10 ms.
pub const DEFAULT_DEADLINE_PER_CANDIDATE: Duration = Duration::from_micros(25);
/// Default extra deadline of a planning call per request of the profile:
/// the canonical ABI lifts every request record into the guest (about 7 µs
/// each into JavaScript, a few µs into Python, 0.05 µs into Rust) and a
/// planner does O(log n) work or more per request: the same allowance as
/// per eviction candidate. A step of 50,000 requests gets 1 ms + 1.25 s; a
/// planning call happens at a step's end only when the step needs a new
/// plan, never on the allocation path.
pub const DEFAULT_DEADLINE_PER_PLAN_REQUEST: Duration = Duration::from_micros(25);
/// Default bound on what one instance may write to its standard output and
/// error (WASI) and keep: the tail of it is attached to a failed call's error.
pub const DEFAULT_MAX_GUEST_OUTPUT: usize = 4096;
/// Default deadline of lifecycle calls (`init`, `pools`, `save-state`, `load-state`, `name`).
pub const DEFAULT_LIFECYCLE_DEADLINE: Duration = Duration::from_secs(1);
/// Default of [`Limits::failure_grace`].
pub const DEFAULT_FAILURE_GRACE: Duration = Duration::from_millis(100);
/// Default cap on a policy's linear memory.
pub const DEFAULT_MAX_MEMORY: usize = 64 << 20;

/// Sandbox limits applied to every policy instance.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// Wall-clock budget of one decision call, enforced by epoch
    /// interruption (`None`: no deadline). The call is interrupted after at
    /// least `deadline - epoch_tick` and at most `deadline` (plus scheduling).
    pub deadline: Option<Duration>,
    /// Budget of one lifecycle call (only when `deadline` is set).
    pub lifecycle_deadline: Duration,
    /// Added to `deadline` per candidate of an eviction call (only when
    /// `deadline` is set).
    pub deadline_per_candidate: Duration,
    /// Added to `deadline` per request of a planning call's profile (only
    /// when `deadline` is set).
    pub deadline_per_plan_request: Duration,
    /// Fuel (≈ wasm instructions) of one decision call (`None`: unmetered).
    /// Lifecycle calls get 1000× this; a planning call gets this times the
    /// ratio of its deadline to the decision deadline (rounded up).
    pub fuel: Option<u64>,
    /// Largest linear memory (sum over the instance's memories), in bytes.
    pub max_memory: usize,
    /// Largest table size (elements) of one table.
    pub max_table_elements: usize,
    /// Log messages a policy may write per second before they are dropped.
    pub log_per_second: u32,
    /// How long past its deadline a decision call may run once its guest
    /// has started to report a failure (it logged at error level or wrote to
    /// stdout/stderr during the call), so that the error carries the guest's
    /// text: formatting a Python traceback takes 1–3 ms, more than the default
    /// deadline. Once per call; only when `deadline` is set.
    pub failure_grace: Duration,
    /// Bytes of an instance's standard output and error (WASI) kept in
    /// memory (the rest is discarded); their tail names the cause of a
    /// failed call (a Python traceback, for instance).
    pub max_guest_output: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            deadline: Some(DEFAULT_DEADLINE),
            lifecycle_deadline: DEFAULT_LIFECYCLE_DEADLINE,
            deadline_per_candidate: DEFAULT_DEADLINE_PER_CANDIDATE,
            deadline_per_plan_request: DEFAULT_DEADLINE_PER_PLAN_REQUEST,
            fuel: None,
            max_memory: DEFAULT_MAX_MEMORY,
            max_table_elements: 1 << 20,
            log_per_second: 20,
            failure_grace: DEFAULT_FAILURE_GRACE,
            max_guest_output: DEFAULT_MAX_GUEST_OUTPUT,
        }
    }
}

/// Where compiled artifacts are cached.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum CacheDir {
    /// `$WASMEM_CACHE_DIR`, else `$XDG_CACHE_HOME/wasmem`, else `~/.cache/wasmem`.
    #[default]
    Default,
    /// This directory.
    At(PathBuf),
    /// No cache: compile every load.
    Off,
}

impl CacheDir {
    /// The directory this setting names, if any.
    pub fn resolve(&self) -> Option<PathBuf> {
        match self {
            CacheDir::Off => None,
            CacheDir::At(p) => Some(p.clone()),
            CacheDir::Default => crate::dirs::cache_root(),
        }
    }
}

/// Configuration of a [`Runtime`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuntimeConfig {
    /// Sandbox limits.
    pub limits: Limits,
    /// Period of the epoch ticker (default: a quarter of the deadline, at
    /// least 50 µs).
    pub epoch_tick: Option<Duration>,
    /// Artifact cache location.
    pub cache: CacheDir,
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        RuntimeConfig { limits: Limits::default(), epoch_tick: None, cache: CacheDir::Default }
    }
}

impl RuntimeConfig {
    /// The epoch tick this configuration uses.
    pub fn tick(&self) -> Duration {
        self.epoch_tick
            .unwrap_or_else(|| self.limits.deadline.map_or(Duration::from_millis(1), |d| d / 4))
            .max(Duration::from_micros(50))
    }
}

pub(crate) struct RuntimeInner {
    pub engine: Engine,
    pub linker: Linker<HostState>,
    pub config: RuntimeConfig,
    pub cache: Option<ArtifactCache>,
    /// Epoch ticks of one decision / one lifecycle call.
    pub deadline_ticks: Option<(u64, u64)>,
    /// The epoch tick.
    pub tick: Duration,
    /// Epoch ticks of [`Limits::failure_grace`].
    pub grace_ticks: u64,
    _ticker: Option<Ticker>,
}

/// The policy runtime: engine, linker, limits, ticker and artifact cache.
///
/// Load policies with [`Runtime::load`]; instantiate them with
/// [`super::Loaded::instantiate`].
#[derive(Clone)]
pub struct Runtime {
    pub(crate) inner: Arc<RuntimeInner>,
}

impl std::fmt::Debug for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runtime").field("config", &self.inner.config).finish_non_exhaustive()
    }
}

impl Runtime {
    /// A runtime with `config`.
    pub fn new(config: RuntimeConfig) -> Result<Runtime, LoadError> {
        let mut c = Config::new();
        c.wasm_component_model(true);
        c.epoch_interruption(config.limits.deadline.is_some());
        c.consume_fuel(config.limits.fuel.is_some());
        let engine = Engine::new(&c).map_err(|e| LoadError::Engine(format!("{e:#}")))?;
        let mut linker = Linker::<HostState>::new(&engine);
        // WASI 0.2 guests (componentize-py) import minor versions newer or
        // older than the host's; semver-compatible matching links them.
        // The host imports of every WIT version this engine speaks: 0.x
        // minors are not semver-compatible, so each links only its own.
        v0_1::FullPolicy::add_to_linker::<HostState, HasSelf<HostState>>(&mut linker, |s| s)
            .map_err(|e| LoadError::Engine(format!("host imports of wasmem:policy@0.1.0: {e:#}")))?;
        v0_2::FullPolicy::add_to_linker::<HostState, HasSelf<HostState>>(&mut linker, |s| s)
            .map_err(|e| LoadError::Engine(format!("host imports of wasmem:policy@0.2.0: {e:#}")))?;
        v0_3::FullPlannedPolicy::add_to_linker::<HostState, HasSelf<HostState>>(&mut linker, |s| s)
            .map_err(|e| LoadError::Engine(format!("host imports of wasmem:policy@0.3.0: {e:#}")))?;
        v0_4::FullPlannedPolicy::add_to_linker::<HostState, HasSelf<HostState>>(&mut linker, |s| s)
            .map_err(|e| LoadError::Engine(format!("host imports of wasmem:policy@0.4.0: {e:#}")))?;
        wasmtime_wasi::p2::add_to_linker_sync(&mut linker)
            .map_err(|e| LoadError::Engine(format!("WASI imports: {e:#}")))?;
        let tick = config.tick();
        let deadline_ticks = config.limits.deadline.map(|d| {
            let ticks = |d: Duration| d.as_nanos().div_ceil(tick.as_nanos()).max(1) as u64;
            (ticks(d), ticks(config.limits.lifecycle_deadline.max(d)))
        });
        let ticker = config.limits.deadline.map(|_| Ticker::start(engine.clone(), tick));
        let grace_ticks = config.limits.failure_grace.as_nanos().div_ceil(tick.as_nanos().max(1)) as u64;
        let cache = config.cache.resolve().map(|dir| ArtifactCache::new(dir, &engine));
        Ok(Runtime {
            inner: Arc::new(RuntimeInner {
                engine,
                linker,
                config,
                cache,
                deadline_ticks,
                tick,
                grace_ticks,
                _ticker: ticker,
            }),
        })
    }

    /// The process-wide runtime with the default configuration, created on
    /// first use.
    pub fn global() -> Result<&'static Runtime, LoadError> {
        static GLOBAL: OnceLock<Result<Runtime, LoadError>> = OnceLock::new();
        GLOBAL.get_or_init(|| Runtime::new(RuntimeConfig::default())).as_ref().map_err(Clone::clone)
    }

    /// The configuration.
    pub fn config(&self) -> &RuntimeConfig {
        &self.inner.config
    }

    /// The wasmtime engine.
    pub fn engine(&self) -> &Engine {
        &self.inner.engine
    }

    /// The deadline of a decision call over `candidates` eviction candidates (0 for other roles) under this runtime's
    /// limits (`None`: no deadline): the deadline, plus
    /// `deadline_per_candidate` per candidate of an eviction call.
    pub fn decision_deadline(&self, candidates: usize) -> Option<Duration> {
        let l = &self.inner.config.limits;
        l.deadline.map(|d| {
            d.saturating_add(l.deadline_per_candidate.saturating_mul(candidates.min(u32::MAX as usize) as u32))
        })
    }

    /// The deadline of a planning call over a profile of `requests` requests
    /// under this runtime's limits (`None`: no deadline): the deadline plus
    /// `deadline_per_plan_request` per request.
    pub fn planning_deadline(&self, requests: usize) -> Option<Duration> {
        let l = &self.inner.config.limits;
        l.deadline.map(|d| {
            d.saturating_add(l.deadline_per_plan_request.saturating_mul(requests.min(u32::MAX as usize) as u32))
        })
    }

    /// The artifact cache directory, if caching is on.
    pub fn cache_dir(&self) -> Option<&std::path::Path> {
        self.inner.cache.as_ref().map(|c| c.dir())
    }
}
