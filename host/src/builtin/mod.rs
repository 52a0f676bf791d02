//! Built-in native policies, selectable by name.
//!
//! | name | placement | reclamation | eviction |
//! |---|---|---|---|
//! | `naive` | one device allocation per tensor, released at free | none | LRU |
//! | `pytorch` | PyTorch's CUDACachingAllocator defaults | release all cached on a failed device allocation | LRU |
//! | `lifecycle` | pools per lifetime class, tight segments | before a pool grows, release free segments cached by others; all on a failed device allocation | LRU |
//! | `defrag` | `lifecycle`'s | paged segments; growth stitched from free pages of every pool; cache above 50 % of reserved trimmed at step ends (≤ 16 MiB each); all on a failed device allocation | LRU |
//! | `planned` | a planned arena for the requests of repeating steps ([`GreedyPlanner`]), `defrag` for the rest | `defrag`'s | LRU |
//!
//! Eviction-only built-ins (`lru`, `dtr`, `belady`): the `pytorch`
//! placement and reclamation with that eviction policy. In a `+` spec they
//! provide only the eviction role, and the part with the fewest roles wins
//! a role, so `lifecycle+dtr` and `dtr+lifecycle` both evict with `dtr` and
//! do the rest as `lifecycle`. `belady` reads
//! the workload's future: an offline bound for comparisons. The shipped
//! WebAssembly versions of `lru` and `dtr` are `lru-evict` and `dtr-evict`.
//!
//! The `pytorch` policy is also the built-in *default*: the engine falls back
//! to its decisions whenever another policy fails or answers invalidly.

mod belady;
mod defrag;
mod dtr;
mod lifecycle;
mod lru;
mod naive;
mod planner;
mod pytorch;

pub use belady::BeladyEviction;
pub use defrag::DefragReclamation;
pub use dtr::DtrEviction;
pub use lifecycle::{LifecycleClass, LifecyclePlacement, LifecycleReclamation};
pub use lru::LruEviction;
pub use naive::NaivePlacement;
pub use planner::{GreedyPlanner, GREEDY_WORK, MAX_EFFORT};
pub use pytorch::{PytorchPlacement, PytorchReclamation};

use crate::decision::{EvictionPolicy, PlacementPolicy, PlannerPolicy, Policies, ReclamationPolicy};

/// Names of the built-in policy sets.
pub const BUILTIN_NAMES: [&str; 5] = ["naive", "pytorch", "lifecycle", "defrag", "planned"];

/// Names of the built-in eviction policies (`lru` is also every set's default).
pub const EVICTION_NAMES: [&str; 3] = ["lru", "dtr", "belady"];

/// The built-in eviction policy called `name`.
pub fn eviction_by_name(name: &str) -> Option<Box<dyn EvictionPolicy>> {
    Some(match name {
        "lru" => Box::new(LruEviction),
        "dtr" => Box::new(DtrEviction),
        "belady" => Box::new(BeladyEviction),
        _ => return None,
    })
}

/// The built-in policy set called `name` (an eviction-only name gives the
/// `pytorch` set with that eviction policy).
pub fn by_name(name: &str) -> Option<Policies> {
    if let Some(eviction) = eviction_by_name(name) {
        return Some(Policies {
            placement: Box::new(PytorchPlacement),
            reclamation: Box::new(PytorchReclamation),
            eviction,
        });
    }
    let (placement, reclamation): (Box<dyn PlacementPolicy>, Box<dyn ReclamationPolicy>) = match name {
        "naive" => (Box::new(NaivePlacement), Box::new(PytorchReclamation)),
        "pytorch" => (Box::new(PytorchPlacement), Box::new(PytorchReclamation)),
        "lifecycle" => (Box::new(LifecyclePlacement::default()), Box::new(LifecycleReclamation)),
        "defrag" | "planned" => (Box::new(LifecyclePlacement::scaled()), Box::new(DefragReclamation::default())),
        _ => return None,
    };
    Some(Policies { placement, reclamation, eviction: Box::new(LruEviction) })
}

/// The planner of the built-in set `name`, if it has one (`planned`).
pub fn planner_by_name(name: &str) -> Option<Box<dyn PlannerPolicy>> {
    (name == "planned").then(|| Box::new(GreedyPlanner::default()) as Box<dyn PlannerPolicy>)
}

/// The default policy set (`pytorch`), used as the fallback.
pub fn default_policies() -> Policies {
    by_name("pytorch").expect("the default policy set exists")
}
