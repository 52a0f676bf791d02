//! # wasmem-policy-sdk
//!
//! Write a wasmem allocation policy in Rust and build it into a WebAssembly
//! component with `cargo build --target wasm32-wasip2 --release`.
//!
//! A policy is a struct that implements [`Policy`] (name, configuration,
//! state) and one or more role traits: [`Placement`], [`Reclamation`],
//! [`Eviction`], [`Planner`] (WIT 0.3.0; aliased plans 0.4.0). Every role method has a default —
//! PyTorch's CUDACachingAllocator decisions for placement and reclamation,
//! LRU for eviction, the engine's greedy-by-size plan for the planner — so
//! a policy overrides only what it changes. [`export!`] exports
//! the struct as a component of the roles it names:
//!
//! ```
//! #![cfg_attr(all(target_arch = "wasm32", not(test)), no_std)]
//! use wasmem_policy_sdk::prelude::*;
//!
//! #[derive(Default)]
//! struct NoSplit;
//!
//! impl Policy for NoSplit {
//!     fn name(&self) -> &str {
//!         "no-split"
//!     }
//! }
//!
//! impl Placement for NoSplit {
//!     fn place(&mut self, req: &AllocRequest, _ctx: &PolicyContext) -> PlacementDecision {
//!         PlacementDecision {
//!             split_min_remainder: u64::MAX,
//!             ..defaults::pytorch_placement(req.bytes)
//!         }
//!     }
//! }
//!
//! export!(NoSplit: placement);
//! # fn main() {}
//! ```
//!
//! The crate must be a `cdylib`, and `no_std` on wasm32
//! (`#![cfg_attr(all(target_arch = "wasm32", not(test)), no_std)]`):
//! the SDK then supplies the panic handler and the allocator, and the
//! component imports nothing from WASI ([`prelude`] brings `Vec`, `String`,
//! `format!`…). To use `std` instead, turn off the SDK's default `runtime`
//! feature. One instance of the struct lives in the
//! component: it is created with [`Default`] and configured by
//! `lifecycle.init` (see [`Config`]) before the engine asks for decisions.
//!
//! The host's services (log, allocator statistics, logical clock) are in
//! [`host`]; they exist only inside a component, so native unit tests of a
//! policy must not call them.

#![no_std]
#![warn(missing_docs)]

extern crate alloc;
#[cfg(not(target_arch = "wasm32"))]
extern crate std;

pub mod bindings;
pub mod config;
pub mod defaults;

pub use config::Config;

#[cfg(all(target_arch = "wasm32", feature = "runtime", not(test)))]
mod runtime;

use alloc::string::String;
use alloc::vec::Vec;

/// What a policy crate needs in scope: the SDK's traits and macro, the WIT
/// types, the default decisions, and `alloc`'s `Vec`, `String`, `Box`,
/// `format!`, `vec!`.
pub mod prelude {
    pub use crate::types::*;
    pub use crate::{defaults, export, host, Config, Eviction, Placement, Planner, Policy, Reclamation};
    pub use alloc::borrow::ToOwned;
    pub use alloc::boxed::Box;
    pub use alloc::string::{String, ToString};
    pub use alloc::vec::Vec;
    pub use alloc::{format, vec};
}

/// The WIT types of `wasmem:policy/types` (requests, contexts, decisions…).
pub mod types {
    pub use crate::bindings::base::wasmem::policy::types::*;
}

/// The engine's services imported from `wasmem:policy/host`: `log`, `stats`
/// (a read-only [`PolicyContext`](types::PolicyContext)) and `clock` (the
/// logical clock, never the wall clock).
pub mod host {
    pub use crate::bindings::base::wasmem::policy::host::*;
}

use types::{
    AliasedPlan, AllocRequest, ArenaPlan, EvictionCandidate, PlacementDecision, PolicyContext, PoolSpec,
    ReclaimDecision, ReclaimPlan, ReclaimTrigger, StepProfile,
};

/// What every policy provides: its name, configuration and state transfer
/// (the `lifecycle` interface).
pub trait Policy: Default + 'static {
    /// Name for logs and reports.
    fn name(&self) -> &str;

    /// Applies the configuration given to `lifecycle.init` to a fresh
    /// (default) instance. Read the keys you support with [`Config::get_or`];
    /// keys left unread are refused as unknown. Default: no keys.
    fn configure(&mut self, config: &Config) -> Result<(), String> {
        let _ = config;
        Ok(())
    }

    /// Serializes learned state for a successor instance. Default: no state.
    fn save_state(&self) -> Vec<u8> {
        Vec::new()
    }

    /// Restores state produced by [`Policy::save_state`]. Default: accepts
    /// only the empty state.
    fn load_state(&mut self, state: &[u8]) -> Result<(), String> {
        if state.is_empty() {
            Ok(())
        } else {
            Err(alloc::format!("policy `{}` keeps no state", self.name()))
        }
    }
}

/// The placement role (`wasmem:policy/placement`).
pub trait Placement: Policy {
    /// The pools decisions index. Default: PyTorch's `[small, large]`.
    fn pools(&self) -> Vec<PoolSpec> {
        defaults::pytorch_pools()
    }

    /// Where and how to place `req`. Default: PyTorch's placement
    /// ([`defaults::pytorch_placement`]), which indexes [`defaults::pytorch_pools`].
    fn place(&mut self, req: &AllocRequest, ctx: &PolicyContext) -> PlacementDecision {
        let _ = ctx;
        defaults::pytorch_placement(req.bytes)
    }
}

/// The reclamation role (`wasmem:policy/reclamation`).
///
/// A policy that only releases cached memory overrides [`Reclamation::reclaim`].
/// One that also defragments (WIT 0.2.0) overrides [`Reclamation::plan`]
/// (compaction, stitching, trimming) and [`Reclamation::paged_segments`].
/// The engine calls `plan`; the component's `reclaim` export answers with
/// the release part of the plan, so the two never disagree.
pub trait Reclamation: Policy {
    /// What to release after `trigger`. Default: everything cached when the
    /// device refused a segment, nothing at phase markers.
    fn reclaim(&mut self, trigger: &ReclaimTrigger, ctx: &PolicyContext) -> ReclaimDecision {
        let _ = ctx;
        defaults::pytorch_reclaim(trigger)
    }

    /// What to release, compact, stitch or trim after `trigger`. Default:
    /// the release of [`Reclamation::reclaim`], nothing else
    /// ([`defaults::plan_of`]).
    fn plan(&mut self, trigger: &ReclaimTrigger, ctx: &PolicyContext) -> ReclaimPlan {
        defaults::plan_of(self.reclaim(trigger, ctx))
    }

    /// Whether the engine should build large segments from individually
    /// mapped pages while this policy is active (needed for `stitch` and
    /// `trim` to act). Asked once, after `lifecycle.init`. Default: no.
    fn paged_segments(&self) -> bool {
        false
    }
}

/// The eviction role (`wasmem:policy/eviction`).
pub trait Eviction: Policy {
    /// Victims (candidate ids) covering `need_bytes`. Default: least recently
    /// used first ([`defaults::lru_victims`]).
    fn choose_victims(&mut self, need_bytes: u64, candidates: &[EvictionCandidate], ctx: &PolicyContext) -> Vec<u64> {
        let _ = ctx;
        defaults::lru_victims(need_bytes, candidates)
    }
}

/// The planning role (`wasmem:policy/planner`, WIT 0.4.0): at a step's end,
/// the engine hands the step's profile (every request with its size, kind,
/// stream and lifetime) to the planner, validates the plan it returns (one
/// offset per request, aligned to [`defaults::PLAN_ALIGN`], inside the
/// arena, no two requests live at once sharing a byte) and serves the
/// steps that repeat the profile from one arena at the planned offsets.
pub trait Planner: Policy {
    /// The plan of `profile`; an error refuses it (the steps stay dynamic).
    /// Default: the engine's built-in greedy-by-size plan
    /// ([`defaults::greedy_plan`]).
    fn plan(&mut self, profile: &StepProfile) -> Result<ArenaPlan, String> {
        Ok(defaults::greedy_plan(profile))
    }

    /// For a profile of two like training steps (asked after [`Planner::plan`]
    /// when a step's output outlives its next instance): a plan in an
    /// aliased arena (see [`AliasedPlan`]), used when it holds less than
    /// the plain one; `None`: the plain plan serves; an error refuses it.
    /// Default: the engine's built-in aliased plan
    /// ([`defaults::aliased_plan`]).
    fn plan_aliased(&mut self, profile: &StepProfile) -> Result<Option<AliasedPlan>, String> {
        Ok(defaults::aliased_plan(profile))
    }
}

/// Exports a policy struct as a component.
///
/// `export!(MyPolicy: placement, reclamation);` exports `lifecycle` and the
/// named roles (any of `placement`, `reclamation`, `eviction`, `planner`,
/// each at most once); `MyPolicy` must implement [`Policy`] and the named
/// role traits.
/// Use it once, at the root of a `cdylib` crate.
#[macro_export]
macro_rules! export {
    ($ty:ty : $($role:ident),+ $(,)?) => {
        const _: () = {
            #[doc(hidden)]
            struct __WasmemPolicyExport;

            static __WASMEM_POLICY: $crate::__private::Slot<$ty> = $crate::__private::Slot::new();

            impl $crate::__private::Exporter for __WasmemPolicyExport {
                type Policy = $ty;

                fn slot() -> &'static $crate::__private::Slot<$ty> {
                    &__WASMEM_POLICY
                }
            }

            // The component's exports exist on wasm32 only: their names
            // (`wasmem:policy/placement@0.2.0#place`…) are no native symbols.
            #[cfg(target_arch = "wasm32")]
            $crate::__export_base_impl!(__WasmemPolicyExport with_types_in $crate::bindings::base);
            $($crate::__export_role!($role $ty, __WasmemPolicyExport);)+
        };
    };
}

/// Invokes the export macro of one role; used by [`export!`].
#[doc(hidden)]
#[macro_export]
macro_rules! __export_role {
    (placement $ty:ty, $e:ident) => {
        $crate::__export_role!(@check $ty, $crate::Placement);
        #[cfg(target_arch = "wasm32")]
        $crate::__export_placement_only_impl!($e with_types_in $crate::bindings::placement);
    };
    (reclamation $ty:ty, $e:ident) => {
        $crate::__export_role!(@check $ty, $crate::Reclamation);
        #[cfg(target_arch = "wasm32")]
        $crate::__export_reclamation_only_impl!($e with_types_in $crate::bindings::reclamation);
    };
    (eviction $ty:ty, $e:ident) => {
        $crate::__export_role!(@check $ty, $crate::Eviction);
        #[cfg(target_arch = "wasm32")]
        $crate::__export_eviction_only_impl!($e with_types_in $crate::bindings::eviction);
    };
    (planner $ty:ty, $e:ident) => {
        $crate::__export_role!(@check $ty, $crate::Planner);
        #[cfg(target_arch = "wasm32")]
        $crate::__export_planner_only_impl!($e with_types_in $crate::bindings::planner);
    };
    (@check $ty:ty, $role:path) => {
        // Also on native targets, where the exports are left out: the
        // policy implements the role it exports.
        const _: () = {
            fn implements<T: $role>() {}
            let _ = implements::<$ty>;
        };
    };
    ($other:ident $ty:ty, $e:ident) => {
        ::core::compile_error!(::core::concat!(
            "unknown role `",
            ::core::stringify!($other),
            "` (expected placement, reclamation, eviction or planner)"
        ));
    };
}

/// Glue between the generated `Guest` traits and the SDK's traits; used by
/// [`export!`], not part of the API.
#[doc(hidden)]
pub mod __private {
    use crate::bindings::base::exports::wasmem::policy::lifecycle;
    use crate::bindings::eviction::exports::wasmem::policy::eviction;
    use crate::bindings::placement::exports::wasmem::policy::placement;
    use crate::bindings::planner::exports::wasmem::policy::planner;
    use crate::bindings::reclamation::exports::wasmem::policy::reclamation;
    use crate::types::{
        AliasedPlan, AllocRequest, ArenaPlan, EvictionCandidate, PlacementDecision, PolicyContext, PoolSpec,
        ReclaimDecision, ReclaimPlan, ReclaimTrigger, StepProfile,
    };
    use crate::{defaults, Config, Eviction, Placement, Planner, Policy, Reclamation};
    use alloc::string::{String, ToString};
    use alloc::vec::Vec;

    /// Holds the one policy instance of a component (`None` until first use).
    #[cfg(all(target_arch = "wasm32", not(target_feature = "atomics")))]
    pub struct Slot<T>(core::cell::RefCell<Option<T>>);

    // SAFETY: wasm32 without the `atomics` target feature has no threads, so
    // the slot is never accessed from two threads; the component model does
    // not re-enter an instance, so the `RefCell` is never borrowed twice.
    #[cfg(all(target_arch = "wasm32", not(target_feature = "atomics")))]
    unsafe impl<T> Sync for Slot<T> {}

    #[cfg(all(target_arch = "wasm32", not(target_feature = "atomics")))]
    impl<T: Default> Slot<T> {
        /// An empty slot.
        pub const fn new() -> Self {
            Slot(core::cell::RefCell::new(None))
        }

        fn with<R>(&self, f: impl FnOnce(&mut T) -> R) -> R {
            f(self.0.borrow_mut().get_or_insert_with(T::default))
        }

        fn replace(&self, value: T) {
            *self.0.borrow_mut() = Some(value);
        }
    }

    #[cfg(all(target_arch = "wasm32", not(target_feature = "atomics")))]
    impl<T: Default> Default for Slot<T> {
        fn default() -> Self {
            Self::new()
        }
    }

    /// Holds the one policy instance (native builds, where the exports exist
    /// but are not called by an engine: a mutex keeps them sound).
    #[cfg(not(all(target_arch = "wasm32", not(target_feature = "atomics"))))]
    pub struct Slot<T>(std::sync::Mutex<Option<T>>);

    #[cfg(not(all(target_arch = "wasm32", not(target_feature = "atomics"))))]
    impl<T: Default> Slot<T> {
        /// An empty slot.
        pub const fn new() -> Self {
            Slot(std::sync::Mutex::new(None))
        }

        fn with<R>(&self, f: impl FnOnce(&mut T) -> R) -> R {
            let mut guard = self.0.lock().unwrap_or_else(|e| e.into_inner());
            f(guard.get_or_insert_with(T::default))
        }

        fn replace(&self, value: T) {
            *self.0.lock().unwrap_or_else(|e| e.into_inner()) = Some(value);
        }
    }

    #[cfg(not(all(target_arch = "wasm32", not(target_feature = "atomics"))))]
    impl<T: Default> Default for Slot<T> {
        fn default() -> Self {
            Self::new()
        }
    }

    /// The type [`crate::export!`] declares to implement the generated
    /// `Guest` traits for its policy.
    pub trait Exporter: 'static {
        /// The exported policy.
        type Policy: Policy;

        /// The instance's slot.
        fn slot() -> &'static Slot<Self::Policy>;

        /// Runs `f` on the instance (a default one before `init`).
        fn with<R>(f: impl FnOnce(&mut Self::Policy) -> R) -> R {
            Self::slot().with(f)
        }

        /// Replaces the instance.
        fn replace(policy: Self::Policy) {
            Self::slot().replace(policy)
        }
    }

    impl<E: Exporter> lifecycle::Guest for E {
        fn name() -> String {
            E::with(|p| p.name().to_string())
        }

        fn init(config: String) -> Result<(), String> {
            let config = Config::parse(&config)?;
            let mut policy = E::Policy::default();
            policy.configure(&config)?;
            config.check_all_used()?;
            E::replace(policy);
            Ok(())
        }

        fn save_state() -> Vec<u8> {
            E::with(|p| p.save_state())
        }

        fn load_state(state: Vec<u8>) -> Result<(), String> {
            E::with(|p| p.load_state(&state))
        }
    }

    impl<E: Exporter> placement::Guest for E
    where
        E::Policy: Placement,
    {
        fn pools() -> Vec<PoolSpec> {
            E::with(|p| p.pools())
        }

        fn place(req: AllocRequest, ctx: PolicyContext) -> PlacementDecision {
            E::with(|p| p.place(&req, &ctx))
        }
    }

    impl<E: Exporter> reclamation::Guest for E
    where
        E::Policy: Reclamation,
    {
        fn reclaim(trigger: ReclaimTrigger, ctx: PolicyContext) -> ReclaimDecision {
            E::with(|p| defaults::release_of(p.plan(&trigger, &ctx)))
        }

        fn paged_segments() -> bool {
            E::with(|p| p.paged_segments())
        }

        fn plan(trigger: ReclaimTrigger, ctx: PolicyContext) -> ReclaimPlan {
            E::with(|p| p.plan(&trigger, &ctx))
        }
    }

    impl<E: Exporter> eviction::Guest for E
    where
        E::Policy: Eviction,
    {
        fn choose_victims(need_bytes: u64, candidates: Vec<EvictionCandidate>, ctx: PolicyContext) -> Vec<u64> {
            E::with(|p| p.choose_victims(need_bytes, &candidates, &ctx))
        }
    }

    impl<E: Exporter> planner::Guest for E
    where
        E::Policy: Planner,
    {
        fn plan(profile: StepProfile) -> Result<ArenaPlan, String> {
            E::with(|p| p.plan(&profile))
        }

        fn plan_aliased(profile: StepProfile) -> Result<Option<AliasedPlan>, String> {
            E::with(|p| p.plan_aliased(&profile))
        }
    }
}
