//! WIT 0.1.0 to 0.4.0 side by side: components built against 0.1.0, 0.2.0
//! and 0.3.0 (the prebuilt fixtures of `tests/data/wit-0.1.0`,
//! `tests/data/wit-0.2.0` and `tests/data/wit-0.3.0`) load and decide
//! exactly as the same policies rebuilt against the current package
//! (0.4.0), the 0.3.0 planner plan for plan; a plan's compaction,
//! stitching, trimming and paged-segments request reach the engine from
//! 0.2.0 and 0.3.0 components and from their 0.4.0 rebuild.
#![cfg(feature = "wasm")]

mod common;

use std::path::PathBuf;

use wasmem::decision::{
    AllocRequest, EvictionCandidate, EvictionPolicy, PlacementPolicy, PolicyContext, ReclaimDecision, ReclaimTrigger,
    ReclamationPolicy, Role,
};
use wasmem::model::ModelSpec;
use wasmem::policy::{resolve_with, LoadError, WasmPolicy, WitVersion};
use wasmem::replay::{replay, Metrics, ReplayConfig};
use wasmem::synth::synth;
use wasmem::types::{Phase, StreamId, TensorId, TensorKind, Tier, GIB, MIB};

/// The 0.1.0 fixture `name`.
fn old(name: &str) -> PathBuf {
    common::repo().join("tests/data/wit-0.1.0").join(format!("{name}.wasm"))
}

/// The 0.2.0 fixture `name`.
fn v2(name: &str) -> PathBuf {
    common::repo().join("tests/data/wit-0.2.0").join(format!("{name}.wasm"))
}

/// The 0.3.0 fixture `name`.
fn v3(name: &str) -> PathBuf {
    common::repo().join("tests/data/wit-0.3.0").join(format!("{name}.wasm"))
}

/// A small deterministic generator (SplitMix64).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

fn context(rng: &mut Rng, clock: u64) -> PolicyContext {
    let capacity = 80 * GIB;
    let reserved = rng.below(capacity);
    let allocated = rng.below(reserved + 1);
    PolicyContext {
        clock,
        phase: [None, Some(Phase::Forward), Some(Phase::Backward), Some(Phase::StepEnd)][rng.below(4) as usize],
        step: clock / 10,
        live_bytes: allocated,
        allocated_bytes: allocated,
        reserved_bytes: reserved,
        peak_reserved_bytes: reserved,
        capacity_bytes: capacity,
    }
}

fn request(rng: &mut Rng) -> AllocRequest {
    let bits = 1 + rng.below(34);
    let bytes = 1 + rng.below(1 << bits);
    AllocRequest { bytes, kind: TensorKind::ALL[rng.below(6) as usize], stream: StreamId(rng.below(2) as u32) }
}

fn trigger(rng: &mut Rng) -> ReclaimTrigger {
    let request = request(rng);
    let segment_bytes = request.bytes + rng.below(20 * MIB);
    match rng.below(3) {
        0 => ReclaimTrigger::AllocFailed { request, segment_bytes },
        1 => ReclaimTrigger::Grow { request, segment_bytes },
        _ => ReclaimTrigger::Phase { phase: Phase::ALL[rng.below(4) as usize], step: rng.below(100) },
    }
}

fn candidates(rng: &mut Rng) -> Vec<EvictionCandidate> {
    (0..rng.below(20) as u32)
        .map(|slot| EvictionCandidate {
            id: TensorId { slot, generation: 0 },
            bytes: 1 + rng.below(64 * MIB),
            kind: TensorKind::ALL[rng.below(6) as usize],
            tier: Tier::Device,
            last_use: rng.below(1000),
            use_count: rng.below(10),
            in_use: rng.below(5) == 0,
            pinned: false,
            phase: None,
            next_use: None,
        })
        .collect()
}

/// Every decision of `p` for a fixed series of inputs, as text;
/// `release_only`: check that no decision compacts, stitches or trims (0.1.0).
fn transcript(p: &WasmPolicy, release_only: bool) -> Vec<String> {
    let mut out = Vec::new();
    let mut rng = Rng(42);
    if let Some(mut pl) = p.placement() {
        out.push(format!("pools {:?}", pl.pools()));
        for i in 0..400 {
            let (req, ctx) = (request(&mut rng), context(&mut rng, i));
            out.push(format!("place {req:?} → {:?}", pl.place(&req, &ctx)));
        }
    }
    if let Some(mut r) = p.reclamation() {
        out.push(format!("paged {}", r.paged_segments()));
        for i in 0..400 {
            let (t, ctx) = (trigger(&mut rng), context(&mut rng, i));
            let d = r.reclaim(&t, &ctx);
            if let (Ok(d), true) = (&d, release_only) {
                assert_eq!((&d.compact, d.stitch, d.trim), (&None, false, false), "{}: {d:?}", p.name());
            }
            out.push(format!("reclaim {t:?} → {d:?}"));
        }
    }
    if let Some(mut e) = p.eviction() {
        for i in 0..100 {
            let ctx = context(&mut rng, 1000 + i);
            let cands = candidates(&mut rng);
            let need = rng.below(cands.iter().map(|c| c.bytes).sum::<u64>() + 1);
            out.push(format!("evict {need} → {:?}", e.choose_victims(need, &cands, &ctx)));
        }
    }
    out
}

#[test]
fn components_of_0_1_0_load_and_decide_as_their_rebuilds() {
    let rt = common::relaxed_runtime();
    for (name, roles) in [
        ("pytorch-like", vec![Role::Placement, Role::Reclamation]),
        ("watermark-reclaim", vec![Role::Reclamation]),
        ("lru-evict", vec![Role::Eviction]),
        ("lifecycle", vec![Role::Placement, Role::Reclamation]),
    ] {
        let loaded = rt.load(old(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(loaded.wit_version(), WitVersion::V0_1, "{name}");
        assert_eq!(loaded.roles(), roles.as_slice(), "{name}");
        let a = loaded.instantiate("").unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!((a.name(), a.wit_version(), a.paged_segments()), (name, WitVersion::V0_1, false));

        let new = need!(common::rust_policy(name));
        let loaded = rt.load(&new).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(loaded.wit_version(), WitVersion::V0_4, "{name}");
        assert_eq!(loaded.roles(), roles.as_slice(), "{name}");
        let b = loaded.instantiate("").unwrap();
        let (ta, tb) = (transcript(&a, true), transcript(&b, true));
        assert!(ta.len() >= 100, "{name}: {} decisions", ta.len());
        if let Some(i) = ta.iter().zip(&tb).position(|(x, y)| x != y) {
            panic!("{name}: decision {i} differs: 0.1.0 `{}`, 0.4.0 `{}`", ta[i], tb[i]);
        }
        assert_eq!(ta.len(), tb.len(), "{name}");
        // State transfer works across versions (a hot swap from an old build to a new one).
        b.load_state(&a.save_state().unwrap()).unwrap_or_else(|e| panic!("{name}: {e}"));
    }
}

/// Components of an earlier version (`fixture`, of `version`) decide as
/// their rebuilds against the current package, and hand their state over.
fn decide_as_their_rebuilds(version: WitVersion, fixture: fn(&str) -> PathBuf, policies: &[(&str, Vec<Role>, &str)]) {
    let rt = common::relaxed_runtime();
    for (name, roles, config) in policies {
        let loaded = rt.load(fixture(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(loaded.wit_version(), version, "{name}");
        assert_eq!(loaded.roles(), roles.as_slice(), "{name}");
        assert!(!loaded.exports_planner(), "{name}");
        let a = loaded.instantiate(config).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!((a.name(), a.wit_version()), (*name, version));

        let new = need!(common::rust_policy(name));
        let loaded = rt.load(&new).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(loaded.wit_version(), WitVersion::V0_4, "{name}");
        assert_eq!(loaded.roles(), roles.as_slice(), "{name}");
        let b = loaded.instantiate(config).unwrap();
        assert_eq!(a.paged_segments(), b.paged_segments(), "{name}");
        let (ta, tb) = (transcript(&a, false), transcript(&b, false));
        assert!(ta.len() >= 100, "{name}: {} decisions", ta.len());
        if let Some(i) = ta.iter().zip(&tb).position(|(x, y)| x != y) {
            panic!("{name}: decision {i} differs: {version} `{}`, 0.4.0 `{}`", ta[i], tb[i]);
        }
        assert_eq!(ta.len(), tb.len(), "{name}");
        b.load_state(&a.save_state().unwrap()).unwrap_or_else(|e| panic!("{name}: {e}"));
    }
}

const DEFRAG_CONFIG: &str = "cached_high=100MiB compact_fraction=0.05 frag=0.05";

#[test]
fn components_of_0_2_0_load_and_decide_as_their_0_4_0_rebuilds() {
    decide_as_their_rebuilds(
        WitVersion::V0_2,
        v2,
        &[
            ("pytorch-like", vec![Role::Placement, Role::Reclamation], ""),
            ("watermark-reclaim", vec![Role::Reclamation], ""),
            ("lru-evict", vec![Role::Eviction], ""),
            ("lifecycle", vec![Role::Placement, Role::Reclamation], ""),
            ("defrag-reclaim", vec![Role::Reclamation], DEFRAG_CONFIG),
        ],
    );
}

#[test]
fn components_of_0_3_0_load_and_decide_as_their_0_4_0_rebuilds() {
    decide_as_their_rebuilds(
        WitVersion::V0_3,
        v3,
        &[
            ("lifecycle", vec![Role::Placement, Role::Reclamation], ""),
            ("defrag-reclaim", vec![Role::Reclamation], DEFRAG_CONFIG),
        ],
    );
}

fn replay_metrics(spec: &str) -> (Metrics, u64) {
    let rt = common::relaxed_runtime();
    let events = synth(&ModelSpec { steps: 2, ..ModelSpec::preset("gpt2-124m").expect("preset") }).expect("valid");
    let p = resolve_with(&rt, spec).unwrap_or_else(|e| panic!("{spec}: {e}")).policies;
    let r = replay(events.into_iter().map(Ok::<_, String>), p, &ReplayConfig::default()).expect("replay");
    r.allocator.check_invariants().unwrap_or_else(|e| panic!("{spec}: {e}"));
    let moved = r.allocator.stats().moved_bytes;
    let mut m = r.metrics;
    m.clear_timing();
    (m, moved)
}

#[test]
fn components_of_0_1_0_replay_exactly_as_before() {
    need!(common::rust_policy("pytorch-like"));
    // `lifecycle` alone names the built-in: the WebAssembly one by path.
    let lifecycle = need!(common::rust_policy("lifecycle"));
    for (old_spec, new_spec) in [
        (format!("{}", old("pytorch-like").display()), "pytorch-like".to_string()),
        (
            format!("{}+{}", old("watermark-reclaim").display(), old("lifecycle").display()),
            format!("watermark-reclaim+{}", lifecycle.display()),
        ),
        (format!("{}+pytorch", old("lru-evict").display()), "lru-evict+pytorch".to_string()),
        (format!("{}", v2("pytorch-like").display()), "pytorch-like".to_string()),
        (
            format!("{}+{}", v2("pytorch-like").display(), v2("defrag-reclaim").display()),
            "pytorch-like+defrag-reclaim".to_string(),
        ),
        (format!("{}+pytorch", v2("lru-evict").display()), "lru-evict+pytorch".to_string()),
    ] {
        let (a, _) = replay_metrics(&old_spec);
        let (b, _) = replay_metrics(&new_spec);
        assert_eq!(a, b, "{old_spec} vs {new_spec}");
        assert_eq!((a.policy_traps, a.policy_fallbacks), (0, 0), "{old_spec}");
    }
}

#[test]
fn a_reclamation_plan_reaches_the_engine_from_0_2_0_0_3_0_and_0_4_0() {
    let rebuilt = need!(common::rust_policy("defrag-reclaim"));
    for (path, version) in [
        (v2("defrag-reclaim"), WitVersion::V0_2),
        (v3("defrag-reclaim"), WitVersion::V0_3),
        (rebuilt, WitVersion::V0_4),
    ] {
        a_plan_reaches_the_engine(&path, version);
    }
}

fn a_plan_reaches_the_engine(path: &std::path::Path, version: WitVersion) {
    let rt = common::relaxed_runtime();
    let loaded = rt.load(path).unwrap();
    assert_eq!((loaded.wit_version(), loaded.roles()), (version, &[Role::Reclamation][..]));
    let p = loaded.instantiate("cached_high=100MiB trim_max=1GiB compact_fraction=0.05").unwrap();
    assert!(p.paged_segments());
    let mut r = p.reclamation().unwrap();
    assert!(r.paged_segments(), "the engine reads paged segments through the trait");

    let request = AllocRequest { bytes: 3 * MIB, kind: TensorKind::Activation, stream: StreamId(0) };
    let ctx = PolicyContext {
        clock: 7,
        phase: Some(Phase::Forward),
        step: 3,
        live_bytes: 600 * MIB,
        allocated_bytes: 600 * MIB,
        reserved_bytes: GIB,
        peak_reserved_bytes: GIB,
        capacity_bytes: 80 * GIB,
    };
    let grow = r.reclaim(&ReclaimTrigger::Grow { request, segment_bytes: 20 * MIB }, &ctx).unwrap();
    assert_eq!(grow, ReclaimDecision { stitch: true, ..ReclaimDecision::none() });
    let failed = r.reclaim(&ReclaimTrigger::AllocFailed { request, segment_bytes: 20 * MIB }, &ctx).unwrap();
    assert_eq!(failed, ReclaimDecision { stitch: true, trim: true, ..ReclaimDecision::all() });
    // 424 MiB cached of 1 GiB (41 % ≥ 25 %): compact `large` by 5 % of the
    // allocated bytes, and trim the cache down to 100 MiB.
    let phase = r.reclaim(&ReclaimTrigger::Phase { phase: Phase::Backward, step: 3 }, &ctx).unwrap();
    assert_eq!(
        phase,
        ReclaimDecision {
            release_bytes: 324 * MIB,
            pools: None,
            compact: Some(("large".to_string(), 30 * MIB)),
            stitch: false,
            trim: true,
        }
    );
    // Configuration reaches it too.
    let p = loaded.instantiate("paged=false stitch=false").unwrap();
    assert!(!p.paged_segments() && !p.reclamation().unwrap().paged_segments());
    let grow = p.reclamation().unwrap().reclaim(&ReclaimTrigger::Grow { request, segment_bytes: 20 * MIB }, &ctx);
    assert_eq!(grow, Ok(ReclaimDecision::none()));
}

#[test]
fn defrag_reclaim_compacts_in_a_replay_without_fallbacks() {
    need!(common::rust_policy("defrag-reclaim"));
    let (plain, moved_plain) = replay_metrics("pytorch-like");
    // Reclamation from `defrag-reclaim` (the more specific part), placement from `pytorch-like`.
    let (defrag, moved) =
        replay_metrics("pytorch-like+defrag-reclaim?frag=0.05,cached_high=0,compact_min=0,compact_fraction=0.05");
    eprintln!(
        "gpt2-124m synth, 2 steps: pytorch-like peak reserved {} MiB, overhead {:.4}; \
         +defrag-reclaim peak reserved {} MiB, overhead {:.4}, moved {} MiB, {} GC pauses",
        plain.peak_reserved_bytes / MIB,
        plain.overhead_ratio,
        defrag.peak_reserved_bytes / MIB,
        defrag.overhead_ratio,
        moved / MIB,
        defrag.gc_pauses,
    );
    assert_eq!(moved_plain, 0);
    assert_eq!((defrag.policy_traps, defrag.policy_fallbacks, defrag.ooms), (0, 0, 0));
    assert!(defrag.reclaimed_bytes > plain.reclaimed_bytes, "trimming at phase markers releases the cache");
    assert!(moved > 0, "the compaction the plans ask for moves blocks");
}

#[test]
fn mixed_versions_are_refused_naming_both_interfaces() {
    let rt = common::relaxed_runtime();
    let err = rt.load_bytes("mixed", &common::wat("mixed-versions")).unwrap_err();
    assert!(matches!(err, LoadError::MixedVersions { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(
        msg.contains("`mixed`")
            && msg.contains("wasmem:policy/lifecycle@0.1.0")
            && msg.contains("wasmem:policy/placement@0.2.0"),
        "{msg}"
    );
}
