//! Policy specs: what a user types to choose policies, resolved into one
//! policy per role.
//!
//! ```text
//! spec   := part ('+' part)*
//! part   := builtin | other                 (optionally `part?config`: the text after `?` goes to `init`)
//! builtin: a name of `builtin::BUILTIN_NAMES` (naive, pytorch, lifecycle, defrag: every role;
//!          planned: every role and a planner), or of `builtin::EVICTION_NAMES` (lru, dtr, belady:
//!          the eviction role only). Built-ins take no configuration, but `planned?effort=K`
//!          (its planner searches K times as long as online, 1 ≤ K ≤ 10,000) and
//!          `planned?refine=off` (no search at step ends for the plan cache) and
//!          `planned?steps=period` (a run without step markers: steps found by the
//!          period of its requests, see `alloc::period`)
//! other  : anything else, handed to a [`PartLoader`] (the WebAssembly runtime
//!          loads shipped policy names and `.wasm` paths)
//! ```
//!
//! Each role is taken from the most specific part that provides it: the one
//! that provides the fewest roles, the earlier one on a tie (a built-in set
//! provides all three). So `pytorch-like+defrag-reclaim` takes reclamation
//! from `defrag-reclaim` (reclamation only) and placement from
//! `pytorch-like`, and `a+b` of two parts with the same roles takes every
//! role from `a`. Roles no part provides are filled by the built-in `pytorch`
//! defaults and have no source ([`Resolved::sources`]).
//!
//! Parts that do not fit are warned about ([`resolve_with_warnings`]; [`resolve`]
//! logs them): a reclamation part that comes with a placement of its own,
//! whose pools the chosen placement does not have (its decisions would name
//! pools that do not exist, and be refused); a reclamation part that asks
//! for paged segments while every pool of the chosen placement releases its
//! segments when empty (no free page is ever cached to stitch or trim).
//!
//! This module knows nothing of WebAssembly: [`Builtins`] resolves built-in
//! names only; the policy runtime implements [`PartLoader`] for the rest.

use std::sync::Arc;

use crate::builtin::{self, LruEviction, PytorchPlacement, PytorchReclamation};
use crate::decision::{EvictionPolicy, PlacementPolicy, PlannerPolicy, Policies, PoolSpec, ReclamationPolicy, Role};

/// Why a spec does not resolve.
#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    /// The spec names no part at all (empty, or only `+`).
    #[error("empty policy spec `{0}`")]
    Empty(String),
    /// A built-in part was given a configuration (`pytorch?x=1`): built-ins
    /// take none, and it would be dropped silently.
    #[error("policy `{part}` is a built-in and takes no configuration (`?{config}` given)")]
    BuiltinConfig {
        /// The built-in name.
        part: String,
        /// The configuration given.
        config: String,
    },
    /// The configuration of the built-in `planned` is not `effort=K`.
    #[error("policy `planned?{config}`: {why} (`planned` takes `effort=K`, K from 1 to 10000, `refine=on|off` and `steps=marked|period`)")]
    PlannedConfig {
        /// The configuration given.
        config: String,
        /// What is wrong with it.
        why: String,
    },
    /// A part is not a built-in, and this loader loads nothing else.
    #[error(
        "unknown policy `{part}`: not a built-in ({builtins}), and this build of wasmem has no WebAssembly \
         policy runtime (the `wasm` feature)"
    )]
    NotBuiltin {
        /// The part.
        part: String,
        /// The built-in names.
        builtins: String,
    },
    /// A part names nothing that exists.
    #[error(
        "unknown policy `{part}`: not a built-in ({builtins}), and no file at {} \
         (the shipped policies are {shipped}; build them with policies/build.sh)",
        tried.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
    )]
    Unknown {
        /// The part.
        part: String,
        /// The built-in names.
        builtins: String,
        /// The shipped policy names.
        shipped: String,
        /// The paths looked at.
        tried: Vec<std::path::PathBuf>,
    },
    /// The loader found the part but could not load it.
    #[error("{cause}")]
    Load {
        /// The part.
        part: String,
        /// Why (the loader's own error, which names the policy).
        #[source]
        cause: Box<dyn std::error::Error + Send + Sync>,
    },
}

/// The built-in names, for messages.
pub fn builtin_names() -> String {
    builtin::BUILTIN_NAMES.iter().chain(&builtin::EVICTION_NAMES).copied().collect::<Vec<_>>().join(", ")
}

/// The roles a loaded part provides (at least one).
pub struct Part {
    /// Name for reports (a component's `lifecycle.name`).
    pub label: String,
    /// Its placement role, if it has one.
    pub placement: Option<Box<dyn PlacementPolicy>>,
    /// Its reclamation role, if it has one.
    pub reclamation: Option<Box<dyn ReclamationPolicy>>,
    /// Its eviction role, if it has one.
    pub eviction: Option<Box<dyn EvictionPolicy>>,
    /// Its planner, if it has one (`wasmem:policy@0.3.0` on).
    pub planner: Option<Box<dyn PlannerPolicy>>,
}

impl Part {
    fn roles(&self) -> usize {
        self.placement.is_some() as usize
            + self.reclamation.is_some() as usize
            + self.eviction.is_some() as usize
            + self.planner.is_some() as usize
    }
}

/// Loads the parts of a spec that are not built-in names.
pub trait PartLoader: Send + Sync {
    /// Loads `what` (a shipped policy name or a path) and configures it with
    /// `config` (the text after `?`, empty when none).
    fn load_part(&self, what: &str, config: &str) -> Result<Part, SpecError>;
}

/// A loader that knows only the built-in policies.
#[derive(Debug, Clone, Copy, Default)]
pub struct Builtins;

impl PartLoader for Builtins {
    fn load_part(&self, what: &str, _config: &str) -> Result<Part, SpecError> {
        Err(SpecError::NotBuiltin { part: what.to_string(), builtins: builtin_names() })
    }
}

/// A shared loader, for what resolves specs later (a swap, a control socket).
pub type Loader = Arc<dyn PartLoader>;

/// What a spec resolved to.
pub struct Resolved {
    /// The spec as given (trimmed).
    pub spec: String,
    /// One policy per role, ready for [`crate::alloc::Allocator::new`].
    pub policies: Policies,
    /// The planner, when a part provides one (planned placement; see
    /// `alloc::planned`); `None`: no planned placement.
    pub planner: Option<Box<dyn PlannerPolicy>>,
    /// The part that provided the planner.
    pub planner_source: Option<String>,
    /// Which part provided each role (indexed by [`Role::index`]; a
    /// built-in name or a component's name); `None`: the built-in default.
    pub sources: [Option<String>; 3],
}

impl Resolved {
    /// The roles some part of the spec provides.
    pub fn provided(&self) -> Vec<Role> {
        Role::ALL.into_iter().filter(|r| self.sources[r.index()].is_some()).collect()
    }
}

impl std::fmt::Debug for Resolved {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Resolved")
            .field("spec", &self.spec)
            .field("policies", &self.policies)
            .field("planner", &self.planner.as_ref().map(|p| p.name().to_string()))
            .field("sources", &self.sources)
            .finish()
    }
}

/// The part chosen for one role so far: how many roles it provides, the
/// policy and its label.
struct Choice<P: ?Sized> {
    roles: usize,
    policy: Box<P>,
    label: String,
}

/// Takes `policy` for a role unless the current choice is at least as specific.
fn offer<P: ?Sized>(slot: &mut Option<Choice<P>>, roles: usize, label: &str, policy: Option<Box<P>>) {
    if let Some(policy) = policy {
        if slot.as_ref().is_none_or(|c| roles < c.roles) {
            *slot = Some(Choice { roles, policy, label: label.to_string() });
        }
    }
}

/// Resolves `spec` (see the module documentation), loading parts that are
/// not built-in names with `loader`; the parts that do not fit are logged
/// as warnings.
pub fn resolve(spec: &str, loader: &dyn PartLoader) -> Result<Resolved, SpecError> {
    let (r, warnings) = resolve_with_warnings(spec, loader)?;
    for w in &warnings {
        tracing::warn!(spec = %r.spec, "{w}");
    }
    Ok(r)
}

/// The pools every engine has besides the active placement's: the fallback
/// (`pytorch`) placement's.
const FALLBACK_POOLS: [&str; 2] = ["small", "large"];

/// Why the parts chosen for placement and reclamation may not fit, from
/// their declared pools (see the module documentation). `part_pools` holds
/// the placement pools of every part that has a placement, by label.
fn fit_warnings(
    placement: (&str, &[PoolSpec]),
    reclamation: (&str, &dyn ReclamationPolicy),
    part_pools: &[(String, Vec<PoolSpec>)],
) -> Vec<String> {
    let (pl, pools) = placement;
    let (rl, rec) = reclamation;
    let mut w = Vec::new();
    if pl == rl {
        return w;
    }
    let have = |n: &str| FALLBACK_POOLS.contains(&n) || pools.iter().any(|p| p.name == n);
    if let Some((_, own)) = part_pools.iter().find(|(l, _)| l == rl) {
        let missing: Vec<&str> = own.iter().map(|p| p.name.as_str()).filter(|n| !have(n)).collect();
        if !missing.is_empty() {
            w.push(format!(
                "the reclamation part `{rl}` comes with a placement of its own whose pools [{}] the placement                  part `{pl}` does not have ([{}]): reclamation decisions that name them are refused and decided                  by the fallback",
                missing.join(", "),
                pools.iter().map(|p| p.name.as_str()).collect::<Vec<_>>().join(", ")
            ));
        }
    }
    if rec.paged_segments() && !pools.is_empty() && pools.iter().all(|p| p.release_when_empty) {
        w.push(format!(
            "the reclamation part `{rl}` asks for paged segments, but every pool of the placement part `{pl}`              releases its segments when they empty: no free page stays cached to stitch or trim"
        ));
    }
    w
}

/// [`resolve`], returning the warnings about parts that do not fit instead
/// of logging them.
pub fn resolve_with_warnings(spec: &str, loader: &dyn PartLoader) -> Result<(Resolved, Vec<String>), SpecError> {
    let mut part_pools: Vec<(String, Vec<PoolSpec>)> = Vec::new();
    let mut placement: Option<Choice<dyn PlacementPolicy>> = None;
    let mut reclamation: Option<Choice<dyn ReclamationPolicy>> = None;
    let mut eviction: Option<Choice<dyn EvictionPolicy>> = None;
    let mut planner: Option<Choice<dyn PlannerPolicy>> = None;
    let mut parts = 0;
    for part in spec.split('+').map(str::trim).filter(|p| !p.is_empty()) {
        parts += 1;
        let (what, config) = part.split_once('?').unwrap_or((part, ""));
        let builtin = builtin::eviction_by_name(what).is_some() || builtin::BUILTIN_NAMES.contains(&what);
        if builtin && part.contains('?') && what != "planned" {
            return Err(SpecError::BuiltinConfig { part: what.to_string(), config: config.to_string() });
        }
        if let Some(e) = builtin::eviction_by_name(what) {
            // An eviction-only built-in provides only its role.
            offer(&mut eviction, 1, what, Some(e));
            continue;
        }
        if let Some(p) = builtin::by_name(what) {
            part_pools.push((what.to_string(), p.placement.pools()));
            let planned = match builtin::planner_by_name(what) {
                Some(_) if part.contains('?') => {
                    let planner = builtin::GreedyPlanner::from_config(config)
                        .map_err(|why| SpecError::PlannedConfig { config: config.to_string(), why })?;
                    Some(Box::new(planner) as Box<dyn PlannerPolicy>)
                }
                planner => planner,
            };
            let n = 3 + planned.is_some() as usize;
            offer(&mut placement, n, what, Some(p.placement));
            offer(&mut reclamation, n, what, Some(p.reclamation));
            offer(&mut eviction, n, what, Some(p.eviction));
            offer(&mut planner, n, what, planned);
            continue;
        }
        let loaded = loader.load_part(what, config)?;
        if let Some(p) = &loaded.placement {
            part_pools.push((loaded.label.clone(), p.pools()));
        }
        let n = loaded.roles();
        offer(&mut placement, n, &loaded.label, loaded.placement);
        offer(&mut reclamation, n, &loaded.label, loaded.reclamation);
        offer(&mut eviction, n, &loaded.label, loaded.eviction);
        offer(&mut planner, n, &loaded.label, loaded.planner);
    }
    if parts == 0 {
        return Err(SpecError::Empty(spec.to_string()));
    }
    let sources = [
        placement.as_ref().map(|c| c.label.clone()),
        reclamation.as_ref().map(|c| c.label.clone()),
        eviction.as_ref().map(|c| c.label.clone()),
    ];
    let policies = Policies {
        placement: placement.map_or_else(|| Box::new(PytorchPlacement) as Box<dyn PlacementPolicy>, |c| c.policy),
        reclamation: reclamation
            .map_or_else(|| Box::new(PytorchReclamation) as Box<dyn ReclamationPolicy>, |c| c.policy),
        eviction: eviction.map_or_else(|| Box::new(LruEviction) as Box<dyn EvictionPolicy>, |c| c.policy),
    };
    let label = |i: usize| sources[i].clone().unwrap_or_else(|| "pytorch".to_string());
    let warnings = fit_warnings(
        (&label(Role::Placement.index()), &policies.placement.pools()),
        (&label(Role::Reclamation.index()), &*policies.reclamation),
        &part_pools,
    );
    let planner_source = planner.as_ref().map(|c| c.label.clone());
    let resolved = Resolved {
        spec: spec.trim().to_string(),
        policies,
        planner: planner.map(|c| c.policy),
        planner_source,
        sources,
    };
    Ok((resolved, warnings))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtins_resolve_without_a_runtime() {
        let r = resolve("lifecycle", &Builtins).unwrap();
        assert_eq!(r.policies.placement.name(), "lifecycle");
        assert_eq!(r.provided(), Role::ALL.to_vec());
        let r = resolve("dtr + pytorch", &Builtins).unwrap();
        assert_eq!((r.policies.placement.name(), r.policies.eviction.name()), ("pytorch", "dtr"));
        assert_eq!(r.sources, [Some("pytorch".into()), Some("pytorch".into()), Some("dtr".into())]);
        let r = resolve("belady", &Builtins).unwrap();
        assert_eq!(r.provided(), vec![Role::Eviction]);
        assert_eq!(r.policies.placement.name(), "pytorch");
    }

    #[test]
    fn parts_that_do_not_fit_are_warned_about() {
        // `naive` provides placement+reclamation+eviction: `pytorch+lifecycle` takes every
        // role from `pytorch`; a reclamation part must provide fewer roles to be chosen.
        let (_, w) = resolve_with_warnings("lifecycle", &Builtins).unwrap();
        assert!(w.is_empty(), "{w:?}");
        let (_, w) = resolve_with_warnings("pytorch+defrag", &Builtins).unwrap();
        assert!(w.is_empty(), "one part provides every role: {w:?}");
        let lifecycle = builtin::by_name("lifecycle").unwrap();
        let naive = builtin::by_name("naive").unwrap();
        let defrag = builtin::by_name("defrag").unwrap();
        let own = vec![("lifecycle".to_string(), lifecycle.placement.pools())];
        let w = fit_warnings(("pytorch", &PytorchPlacement.pools()), ("lifecycle", &*lifecycle.reclamation), &own);
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(
            w[0].contains("`lifecycle`") && w[0].contains("persistent") && w[0].contains("[small, large]"),
            "{w:?}"
        );
        let w = fit_warnings(("naive", &naive.placement.pools()), ("defrag", &*defrag.reclamation), &[]);
        assert!(w.len() == 1 && w[0].contains("paged segments"), "{w:?}");
        let w = fit_warnings(("defrag", &defrag.placement.pools()), ("defrag", &*defrag.reclamation), &[]);
        assert!(w.is_empty(), "a part fits itself: {w:?}");
    }

    #[test]
    fn other_parts_need_a_loader() {
        let e = resolve("pytorch-like", &Builtins).unwrap_err();
        assert!(matches!(e, SpecError::NotBuiltin { .. }), "{e:?}");
        assert!(e.to_string().contains("pytorch-like") && e.to_string().contains("naive"), "{e}");
        assert!(matches!(resolve(" + ", &Builtins), Err(SpecError::Empty(_))));
        assert!(matches!(resolve("", &Builtins), Err(SpecError::Empty(_))));
        let e = resolve("pytorch?x=1", &Builtins).unwrap_err();
        assert!(matches!(e, SpecError::BuiltinConfig { .. }) && e.to_string().contains("?x=1"), "{e}");
        assert!(matches!(resolve("lru?", &Builtins), Err(SpecError::BuiltinConfig { .. })));
    }

    #[test]
    fn planned_takes_a_search_effort_and_nothing_else() {
        for spec in [
            "planned?effort=100",
            "planned?effort=1",
            "planned?",
            "planned?effort=10000",
            "planned?effort=5,refine=off",
            "planned?steps=period",
            "planned?steps=marked,effort=2",
        ] {
            let r = resolve(spec, &Builtins).unwrap_or_else(|e| panic!("{spec}: {e}"));
            assert_eq!(r.planner.as_ref().map(|p| p.name()), Some("greedy"), "{spec}");
            let by_period = r.planner.as_ref().is_some_and(|p| p.steps_by_period());
            assert_eq!(by_period, spec.contains("steps=period"), "{spec}");
        }
        for (spec, says) in [
            ("planned?effort=0", "out of range"),
            ("planned?effort=10001", "out of range"),
            ("planned?effort=lots", "not a whole number"),
            ("planned?depth=3", "unknown key `depth`"),
            ("planned?effort", "not KEY=VALUE"),
            ("planned?refine=maybe", "not on or off"),
            ("planned?steps=guess", "not marked or period"),
        ] {
            let e = resolve(spec, &Builtins).err().unwrap_or_else(|| panic!("{spec} resolved"));
            assert!(matches!(e, SpecError::PlannedConfig { .. }), "{spec}: {e:?}");
            assert!(e.to_string().contains(says) && e.to_string().contains("effort=K"), "{spec}: {e}");
        }
        let e = resolve("defrag?effort=3", &Builtins).unwrap_err();
        assert!(matches!(e, SpecError::BuiltinConfig { .. }), "{e:?}");
    }
}
