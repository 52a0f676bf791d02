//! Built-in native policies, selectable by name.
//!
//! | name | placement | reclamation | eviction |
//! |---|---|---|---|
//! | `naive` | one device allocation per tensor, released at free | none | LRU |
//! | `pytorch` | PyTorch's CUDACachingAllocator defaults | release all cached on a failed device allocation | LRU |
//! | `lifecycle` | pools per lifetime class, tight segments | before a pool grows, release free segments cached by others; all on a failed device allocation | LRU |
//! | `defrag` | `lifecycle`'s | paged segments; growth stitched from free pages of every pool; cache above 50 % of reserved trimmed at step ends (≤ 16 MiB each); all on a failed device allocation | LRU |
//!
//! The `pytorch` policy is also the built-in *default*: the engine falls back
//! to its decisions whenever another policy fails or answers invalidly.

mod defrag;
mod lifecycle;
mod lru;
mod naive;
mod pytorch;

pub use defrag::DefragReclamation;
pub use lifecycle::{LifecycleClass, LifecyclePlacement, LifecycleReclamation};
pub use lru::LruEviction;
pub use naive::NaivePlacement;
pub use pytorch::{PytorchPlacement, PytorchReclamation};

use crate::decision::{EvictionPolicy, PlacementPolicy, ReclamationPolicy};

/// One policy per decision role.
pub struct Policies {
    /// Placement role.
    pub placement: Box<dyn PlacementPolicy>,
    /// Reclamation role.
    pub reclamation: Box<dyn ReclamationPolicy>,
    /// Eviction role.
    pub eviction: Box<dyn EvictionPolicy>,
}

/// Names of the built-in policy sets.
pub const BUILTIN_NAMES: [&str; 4] = ["naive", "pytorch", "lifecycle", "defrag"];

/// The built-in policy set called `name`.
pub fn by_name(name: &str) -> Option<Policies> {
    let (placement, reclamation): (Box<dyn PlacementPolicy>, Box<dyn ReclamationPolicy>) = match name {
        "naive" => (Box::new(NaivePlacement), Box::new(PytorchReclamation)),
        "pytorch" => (Box::new(PytorchPlacement), Box::new(PytorchReclamation)),
        "lifecycle" => (Box::new(LifecyclePlacement::default()), Box::new(LifecycleReclamation)),
        "defrag" => (Box::new(LifecyclePlacement::default()), Box::new(DefragReclamation::default())),
        _ => return None,
    };
    Some(Policies { placement, reclamation, eviction: Box::new(LruEviction) })
}

/// The default policy set (`pytorch`), used as the fallback.
pub fn default_policies() -> Policies {
    by_name("pytorch").expect("the default policy set exists")
}
