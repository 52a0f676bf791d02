//! The policy runtime: one wasmtime [`Engine`] with its configuration, the
//! [`Linker`] that provides the host imports, the epoch ticker and the
//! artifact cache. Cheap to clone (`Arc` inside); share one per process.

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use wasmtime::component::{HasSelf, Linker};
use wasmtime::{Config, Engine};

use super::bindings::{v0_1, v0_2};
use super::cache::ArtifactCache;
use super::error::LoadError;
use super::host::HostState;
use super::ticker::Ticker;

/// Default per-decision deadline.
pub const DEFAULT_DEADLINE: Duration = Duration::from_millis(1);
/// Default deadline of lifecycle calls (`init`, `pools`, `save-state`, `load-state`, `name`).
pub const DEFAULT_LIFECYCLE_DEADLINE: Duration = Duration::from_secs(1);
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
    /// Fuel (≈ wasm instructions) of one decision call (`None`: unmetered).
    /// Lifecycle calls get 1000× this.
    pub fuel: Option<u64>,
    /// Largest linear memory (sum over the instance's memories), in bytes.
    pub max_memory: usize,
    /// Largest table size (elements) of one table.
    pub max_table_elements: usize,
    /// Log messages a policy may write per second before they are dropped.
    pub log_per_second: u32,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            deadline: Some(DEFAULT_DEADLINE),
            lifecycle_deadline: DEFAULT_LIFECYCLE_DEADLINE,
            fuel: None,
            max_memory: DEFAULT_MAX_MEMORY,
            max_table_elements: 1 << 20,
            log_per_second: 20,
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
        wasmtime_wasi::p2::add_to_linker_sync(&mut linker)
            .map_err(|e| LoadError::Engine(format!("WASI imports: {e:#}")))?;
        let tick = config.tick();
        let deadline_ticks = config.limits.deadline.map(|d| {
            let ticks = |d: Duration| d.as_nanos().div_ceil(tick.as_nanos()).max(1) as u64;
            (ticks(d), ticks(config.limits.lifecycle_deadline.max(d)))
        });
        let ticker = config.limits.deadline.map(|_| Ticker::start(engine.clone(), tick));
        let cache = config.cache.resolve().map(|dir| ArtifactCache::new(dir, &engine));
        Ok(Runtime { inner: Arc::new(RuntimeInner { engine, linker, config, cache, deadline_ticks, _ticker: ticker }) })
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

    /// The artifact cache directory, if caching is on.
    pub fn cache_dir(&self) -> Option<&std::path::Path> {
        self.inner.cache.as_ref().map(|c| c.dir())
    }
}
