//! Least-recently-used eviction as a wasmem policy.
//!
//! Decision for decision the same as the engine's native `lru` eviction
//! (`host/src/builtin/lru.rs`): the evictable candidates (neither in use nor
//! pinned) in order of `(last-use, id)`, until their bytes cover the need.
//! The engine's ids must order like its native handles for ties to break the
//! same way. No configuration, no state.

#![cfg_attr(all(target_arch = "wasm32", not(test)), no_std)]

use wasmem_policy_sdk::{export, Eviction, Policy};

/// The policy; the decision is the SDK's default.
#[derive(Debug, Default)]
pub struct LruEvict;

impl Policy for LruEvict {
    fn name(&self) -> &str {
        "lru-evict"
    }
}

impl Eviction for LruEvict {}

export!(LruEvict: eviction);
