//! The policy runtime: WebAssembly component policies behind the decision
//! traits of [`crate::decision`].
//!
//! ```text
//!  Runtime (engine, linker, epoch ticker, artifact cache)
//!     │ load(path) ── sha256 ──► cache hit: deserialize │ miss: compile, store
//!     ▼
//!  Loaded (Component + InstancePre + WIT version + roles) ── instantiate(config) ──►
//!  WasmPolicy (one Store: limits, deny-all WASI, host imports; Arc<Mutex<_>>)
//!     ├─ WasmPlacement   : PlacementPolicy   (memoizable)
//!     ├─ WasmReclamation : ReclamationPolicy
//!     ├─ WasmEviction    : EvictionPolicy
//!     └─ WasmPlanner     : PlannerPolicy      (WIT 0.3.0; aliased plans 0.4.0)
//!  WasmPolicy : PolicyState (save-state / load-state, carried by alloc::swap)
//!  check(path) → Verdict: exports, version, fuzzed conformance suite
//!  Runtime : spec::PartLoader — resolve("pytorch-like+lru-evict") → Resolved
//! ```
//!
//! One file per job: [`config`] (runtime, limits), `ticker` (epoch thread),
//! `cache` + `artifact` (precompiled artifacts; the only `unsafe`),
//! `bindings` (one module per WIT version: 0.1.0, 0.2.0 and 0.3.0 from their frozen
//! copies in `wit/compat/`, 0.4.0 from `wit/`), `guests` (the exports of any version behind one
//! set of native calls), `loader` (exports, version, `InstancePre`), `instance` (store, calls,
//! re-instantiation), `sandbox` (memory cap, WASI, failure classification),
//! `host` (imports), [`adapters`] (the traits), [`check`](mod@check),
//! [`resolve`](mod@resolve). Module order (no cycle): `adapters` → `instance`
//! → `loader` → `config`.
//!
//! Failures are classified by type into [`PolicyError`](crate::decision::PolicyError):
//! `Trap::Interrupt` → `Deadline`, `Trap::OutOfFuel` → `OutOfFuel`, the
//! memory cap's [`MemoryLimitExceeded`] → `MemoryLimit`, any other trap →
//! `Trap`. The engine counts them and falls back to its default decision;
//! the failed instance is re-instantiated before its next call.

pub mod adapters;
mod artifact;
mod bindings;
mod cache;
pub mod check;
pub mod config;
mod error;
mod guests;
mod host;
mod instance;
mod loader;
mod output;
pub mod resolve;
mod sandbox;
pub mod scaffold;
mod ticker;

pub use adapters::{WasmEviction, WasmPlacement, WasmPlanner, WasmReclamation};
pub use bindings::{tensor_from_wit, tensor_to_wit, WitVersion, WIT_VERSION};
pub use cache::{clean as clean_cache, usage as cache_usage, CacheUsage, LoadSource, DEFAULT_CACHE_MAX_BYTES};
pub use check::{check, Verdict};
pub use config::{CacheDir, Limits, Runtime, RuntimeConfig};
pub use error::LoadError;
pub use instance::WasmPolicy;
pub use loader::Loaded;
pub use resolve::{
    exe_policy_dirs, locate_shipped, resolve, resolve_with, shipped_candidates, GlobalRuntime, Shipped, SHIPPED_NAMES,
};
pub use sandbox::MemoryLimitExceeded;
