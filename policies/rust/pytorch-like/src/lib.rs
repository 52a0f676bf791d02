//! PyTorch's CUDACachingAllocator defaults as a wasmem policy (placement and
//! reclamation).
//!
//! Decision for decision the same as the engine's native `pytorch` policy
//! (`host/src/builtin/pytorch.rs`): pools `[small, large]`; sizes round up to
//! 512 B; rounded sizes ≤ 1 MiB go to `small` (2 MiB segments, split when
//! ≥ 512 B remain); larger ones to `large` (20 MiB segments below 10 MiB,
//! segments of their own size rounded to 2 MiB from 10 MiB on, split when more
//! than 1 MiB remains). On a failed device allocation every cached segment is
//! released; nothing is released at phase markers. No configuration, no state.

#![cfg_attr(all(target_arch = "wasm32", not(test)), no_std)]

use wasmem_policy_sdk::{export, Placement, Policy, Reclamation};

/// The policy; all decisions are the SDK's defaults.
#[derive(Debug, Default)]
pub struct PytorchLike;

impl Policy for PytorchLike {
    fn name(&self) -> &str {
        "pytorch-like"
    }
}

impl Placement for PytorchLike {}

impl Reclamation for PytorchLike {}

export!(PytorchLike: placement, reclamation);
