//! `wasmem policy check FILE.wasm`: is this component a well-behaved policy?
//!
//! [`check`] loads the component (exports, WIT version, imports), instantiates
//! it, and runs a conformance suite of fuzzed requests and contexts from a
//! fixed seed: every call answers within the sandbox limits, every decision
//! is valid by the engine's own rules ([`PlacementDecision::validate`],
//! [`validate_victims`], pool names of reclamation decisions), decisions
//! marked `cacheable` agree within their memo key, a second instance given
//! the same inputs gives the same outputs, and saved state loads into a fresh
//! instance. The [`Verdict`] prints as a report.

use std::fmt;
use std::path::{Path, PathBuf};

use super::{Limits, Loaded, Runtime, RuntimeConfig, WasmPolicy, WitVersion};
use crate::decision::{
    validate_victims, AllocRequest, EvictionCandidate, EvictionPolicy, PlacementDecision, PlacementPolicy,
    PolicyContext, PolicyError, ReclaimDecision, ReclaimTrigger, ReclamationPolicy, Role,
};
use crate::types::{Phase, StreamId, TensorId, TensorKind, Tier, GIB, MIB};

/// Options of [`check_with`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckOptions {
    /// Calls per role.
    pub cases: usize,
    /// Seed of the generated inputs.
    pub seed: u64,
    /// Configuration passed to `init`.
    pub config: String,
}

impl Default for CheckOptions {
    fn default() -> Self {
        CheckOptions { cases: 2000, seed: 0x00c0_ffee_5eed, config: String::new() }
    }
}

/// Outcome of one check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Passed.
    Pass,
    /// Failed: the policy is not conformant.
    Fail,
    /// Not applicable (role not exported, or an earlier step failed).
    Skip,
}

/// One line of a verdict.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckItem {
    /// What was checked.
    pub name: String,
    /// The outcome.
    pub outcome: Outcome,
    /// Details (first counter-example on failure).
    pub detail: String,
}

/// The result of [`check`]: printable with `{}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    /// The file checked.
    pub path: PathBuf,
    /// `lifecycle.name` (or the file stem if it did not load).
    pub policy: String,
    /// Roles exported.
    pub roles: Vec<Role>,
    /// The version of the WIT package the component was built against
    /// (`None` if it did not load).
    pub wit_version: Option<WitVersion>,
    /// The checks, in order.
    pub items: Vec<CheckItem>,
}

impl Verdict {
    /// Whether every check passed (skips do not count against).
    pub fn passed(&self) -> bool {
        !self.items.is_empty() && self.items.iter().all(|i| i.outcome != Outcome::Fail)
    }

    fn push(&mut self, name: &str, outcome: Outcome, detail: impl Into<String>) {
        self.items.push(CheckItem { name: name.to_string(), outcome, detail: detail.into() });
    }
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let roles: Vec<String> = self.roles.iter().map(|r| r.to_string()).collect();
        writeln!(
            f,
            "policy `{}` ({}): {}",
            self.policy,
            self.path.display(),
            if self.passed() { "PASS" } else { "FAIL" }
        )?;
        if !roles.is_empty() {
            match self.wit_version {
                Some(v) => writeln!(f, "  roles: {} (wasmem:policy@{v})", roles.join(", "))?,
                None => writeln!(f, "  roles: {}", roles.join(", "))?,
            }
        }
        for i in &self.items {
            let tag = match i.outcome {
                Outcome::Pass => "pass",
                Outcome::Fail => "FAIL",
                Outcome::Skip => "skip",
            };
            writeln!(f, "  [{tag}] {}: {}", i.name, i.detail)?;
        }
        Ok(())
    }
}

/// Checks the component at `path` with the default limits and options.
pub fn check(path: impl AsRef<Path>) -> Verdict {
    match Runtime::global() {
        Ok(rt) => check_with(rt, path.as_ref(), &CheckOptions::default()),
        Err(e) => {
            let mut v = Verdict {
                path: path.as_ref().to_path_buf(),
                policy: String::new(),
                roles: vec![],
                wit_version: None,
                items: vec![],
            };
            v.push("runtime", Outcome::Fail, e.to_string());
            v
        }
    }
}

/// A runtime for checks with a custom per-call deadline (e.g. for slow
/// interpreted policies), otherwise the defaults.
pub fn runtime_with_deadline(deadline: std::time::Duration) -> Result<Runtime, super::LoadError> {
    Runtime::new(RuntimeConfig {
        limits: Limits { deadline: Some(deadline), ..Limits::default() },
        ..Default::default()
    })
}

/// SplitMix64: a small, seedable generator for the fuzzed inputs.
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
        if n == 0 {
            0
        } else {
            self.next() % n
        }
    }
    fn pick<T: Copy>(&mut self, xs: &[T]) -> T {
        xs[self.below(xs.len() as u64) as usize]
    }
}

const EDGE_SIZES: [u64; 12] =
    [1, 511, 512, 513, MIB - 1, MIB, MIB + 1, 10 * MIB - 1, 10 * MIB, 10 * MIB + 1, GIB, 1 << 40];

fn gen_request(rng: &mut Rng) -> AllocRequest {
    let bytes = if rng.below(8) == 0 {
        rng.pick(&EDGE_SIZES)
    } else {
        let bits = 1 + rng.below(36);
        1 + rng.below(1 << bits)
    };
    AllocRequest { bytes, kind: rng.pick(&TensorKind::ALL), stream: StreamId(rng.below(4) as u32) }
}

fn gen_context(rng: &mut Rng, clock: u64) -> PolicyContext {
    let capacity = rng.pick(&[16 * GIB, 40 * GIB, 80 * GIB]);
    let reserved = rng.below(capacity + 1);
    let allocated = rng.below(reserved + 1);
    let live = rng.below(allocated + 1);
    let phase = if rng.below(5) == 0 { None } else { Some(rng.pick(&Phase::ALL)) };
    PolicyContext {
        clock,
        phase,
        step: clock / 1000,
        live_bytes: live,
        allocated_bytes: allocated,
        reserved_bytes: reserved,
        peak_reserved_bytes: reserved.saturating_add(rng.below(capacity - reserved + 1)),
        capacity_bytes: capacity,
    }
}

fn gen_trigger(rng: &mut Rng) -> ReclaimTrigger {
    let request = gen_request(rng);
    let segment_bytes = request.bytes.saturating_add(rng.below(20 * MIB));
    match rng.below(3) {
        0 => ReclaimTrigger::AllocFailed { request, segment_bytes },
        1 => ReclaimTrigger::Grow { request, segment_bytes },
        _ => ReclaimTrigger::Phase { phase: rng.pick(&Phase::ALL), step: rng.below(10_000) },
    }
}

fn gen_candidates(rng: &mut Rng, clock: u64) -> (u64, Vec<EvictionCandidate>) {
    let n = rng.below(48) as u32;
    let cands: Vec<EvictionCandidate> = (0..n)
        .map(|i| EvictionCandidate {
            id: TensorId { slot: i * 3 + rng.below(3) as u32, generation: rng.below(4) as u32 },
            bytes: 1 + rng.below(64 * MIB),
            kind: rng.pick(&TensorKind::ALL),
            tier: Tier::Device,
            last_use: rng.below(clock + 1),
            use_count: rng.below(100),
            in_use: rng.below(6) == 0,
            pinned: rng.below(10) == 0,
            phase: None,
            next_use: None,
        })
        .collect();
    let total: u64 = cands.iter().map(|c| c.bytes).sum();
    (rng.below(total.saturating_add(2)), cands)
}

/// The engine's memo key of a placement decision (kind, log2 size class, stream, phase).
fn memo_key(req: &AllocRequest, phase: Option<Phase>) -> (TensorKind, u32, u32, Option<Phase>) {
    (req.kind, 64 - req.bytes.leading_zeros(), req.stream.0, phase)
}

/// Answers of one run, compared between two instances.
#[derive(Debug, Default, PartialEq, Eq)]
struct Transcript {
    place: Vec<Result<PlacementDecision, PolicyError>>,
    reclaim: Vec<Result<ReclaimDecision, PolicyError>>,
    evict: Vec<Result<Vec<TensorId>, PolicyError>>,
}

/// A role's run stops after this many failed calls (trap or limit): the
/// engine would have disabled the policy long before.
const MAX_FAILED_CALLS: usize = 16;

fn failed<T>(xs: &[Result<T, PolicyError>]) -> bool {
    xs.iter().filter(|r| matches!(r, Err(e) if !matches!(e, PolicyError::InvalidDecision(_)))).count()
        >= MAX_FAILED_CALLS
}

/// Runs the fuzzed inputs of `opts` against `p`.
fn run(p: &WasmPolicy, opts: &CheckOptions) -> Transcript {
    let mut t = Transcript::default();
    let mut rng = Rng(opts.seed);
    if let Some(mut pl) = p.placement() {
        for i in 0..opts.cases {
            let (req, ctx) = (gen_request(&mut rng), gen_context(&mut rng, i as u64));
            t.place.push(pl.place(&req, &ctx));
            if failed(&t.place) {
                break;
            }
        }
    }
    let mut rng = Rng(opts.seed ^ 1);
    if let Some(mut r) = p.reclamation() {
        for i in 0..opts.cases {
            let (trig, ctx) = (gen_trigger(&mut rng), gen_context(&mut rng, i as u64));
            t.reclaim.push(r.reclaim(&trig, &ctx));
            if failed(&t.reclaim) {
                break;
            }
        }
    }
    let mut rng = Rng(opts.seed ^ 2);
    if let Some(mut e) = p.eviction() {
        for i in 0..opts.cases.div_ceil(4) {
            let ctx = gen_context(&mut rng, 1000 + i as u64);
            let (need, cands) = gen_candidates(&mut rng, ctx.clock);
            t.evict.push(e.choose_victims(need, &cands, &ctx));
            if failed(&t.evict) {
                break;
            }
        }
    }
    t
}

/// Summarizes failures: counts per kind and the first example.
fn failures<'a>(errs: impl Iterator<Item = (usize, String)> + 'a) -> Option<String> {
    let all: Vec<(usize, String)> = errs.collect();
    let (i, first) = all.first()?;
    Some(format!("{} of the calls failed; first at call {i}: {first}", all.len()))
}

/// Checks the component at `path` with `rt` and `opts`.
pub fn check_with(rt: &Runtime, path: &Path, opts: &CheckOptions) -> Verdict {
    let label = path.file_stem().map_or_else(|| path.display().to_string(), |s| s.to_string_lossy().into_owned());
    let mut v = Verdict { path: path.to_path_buf(), policy: label, roles: vec![], wit_version: None, items: vec![] };
    let loaded: Loaded = match rt.load(path) {
        Ok(l) => l,
        Err(e) => {
            v.push("load (exports, WIT version, imports)", Outcome::Fail, e.to_string());
            return v;
        }
    };
    v.roles = loaded.roles().to_vec();
    v.wit_version = Some(loaded.wit_version());
    v.push(
        "load (exports, WIT version, imports)",
        Outcome::Pass,
        format!(
            "wasmem:policy@{}; {} in {:.1} ms; imports WASI: {}",
            loaded.wit_version(),
            match loaded.source() {
                super::LoadSource::Cached => "deserialized from the artifact cache",
                super::LoadSource::Compiled => "compiled",
            },
            loaded.load_time().as_secs_f64() * 1e3,
            if loaded.imports_wasi() { "yes (served by a deny-all context)" } else { "no" }
        ),
    );
    let (a, b) = match (loaded.instantiate(&opts.config), loaded.instantiate(&opts.config)) {
        (Ok(a), Ok(b)) => (a, b),
        (Err(e), _) | (_, Err(e)) => {
            v.push("instantiate + init", Outcome::Fail, e.to_string());
            return v;
        }
    };
    v.policy = a.name().to_string();
    v.push("instantiate + init", Outcome::Pass, format!("config `{}`", opts.config));

    let ta = run(&a, opts);
    // Placement.
    let pools = a.pools().to_vec();
    if a.exports(Role::Placement) {
        let mut names: Vec<&str> = pools.iter().map(|p| p.name.as_str()).collect();
        names.sort_unstable();
        names.dedup();
        let outcome = if names.len() == pools.len() { Outcome::Pass } else { Outcome::Fail };
        v.push("pools", outcome, format!("{:?}", pools.iter().map(|p| &p.name).collect::<Vec<_>>()));
        let mut rng = Rng(opts.seed);
        let mut memo = std::collections::HashMap::new();
        let mut bad = Vec::new();
        let mut inconsistent = Vec::new();
        for (i, r) in ta.place.iter().enumerate() {
            let (req, ctx) = (gen_request(&mut rng), gen_context(&mut rng, i as u64));
            match r {
                Err(e) => bad.push((i, format!("{req:?}: {e}"))),
                Ok(d) => match d.validate(&req, pools.len()) {
                    Err(e) => bad.push((i, format!("{req:?} → {d:?}: {e}"))),
                    Ok(_) if d.cacheable => {
                        if let Some(prev) = memo.insert(memo_key(&req, ctx.phase), *d) {
                            if prev != *d {
                                inconsistent.push((i, format!("{req:?} → {d:?}, earlier {prev:?}")));
                            }
                        }
                    }
                    Ok(_) => {}
                },
            }
        }
        match failures(bad.into_iter()) {
            None => {
                v.push("placement: valid decisions within limits", Outcome::Pass, format!("{} calls", ta.place.len()))
            }
            Some(f) => v.push("placement: valid decisions within limits", Outcome::Fail, f),
        }
        match failures(inconsistent.into_iter()) {
            None => v.push(
                "placement: cacheable decisions agree per memo key",
                Outcome::Pass,
                "kind, size class, stream, phase",
            ),
            Some(f) => v.push("placement: cacheable decisions agree per memo key", Outcome::Fail, f),
        }
    } else {
        v.push("placement", Outcome::Skip, "not exported");
    }
    // Reclamation: pool names must exist; the engine's pools are the
    // policy's own plus the default's `small` and `large`. A compaction
    // budget above the context's allocated bytes exceeds every pool's.
    if a.exports(Role::Reclamation) {
        let known = |n: &str| n == "small" || n == "large" || pools.iter().any(|p| p.name == n);
        let mut rng = Rng(opts.seed ^ 1);
        let mut bad = Vec::new();
        let (mut compactions, mut stitches, mut trims) = (0usize, 0usize, 0usize);
        for (i, r) in ta.reclaim.iter().enumerate() {
            let (_, ctx) = (gen_trigger(&mut rng), gen_context(&mut rng, i as u64));
            let d = match r {
                Err(e) => {
                    bad.push((i, e.to_string()));
                    continue;
                }
                Ok(d) => d,
            };
            compactions += d.compact.is_some() as usize;
            stitches += d.stitch as usize;
            trims += d.trim as usize;
            if let Some(n) = d.pools.iter().flatten().find(|n| !known(n)) {
                bad.push((i, format!("names unknown pool `{n}`")));
            } else if let Some((pool, budget)) = &d.compact {
                if !known(pool) {
                    bad.push((i, format!("compacts unknown pool `{pool}`")));
                } else if *budget > ctx.allocated_bytes {
                    bad.push((
                        i,
                        format!(
                            "compaction budget {budget} of pool `{pool}` exceeds the {} allocated bytes in all pools",
                            ctx.allocated_bytes
                        ),
                    ));
                }
            }
        }
        match failures(bad.into_iter()) {
            None => v.push(
                "reclamation: valid decisions within limits",
                Outcome::Pass,
                format!(
                    "{} calls ({compactions} compact, {stitches} stitch, {trims} trim); paged segments: {}",
                    ta.reclaim.len(),
                    if a.paged_segments() { "yes" } else { "no" }
                ),
            ),
            Some(f) => v.push("reclamation: valid decisions within limits", Outcome::Fail, f),
        }
    } else {
        v.push("reclamation", Outcome::Skip, "not exported");
    }
    if a.exports(Role::Eviction) {
        let mut rng = Rng(opts.seed ^ 2);
        let mut bad = Vec::new();
        for (i, r) in ta.evict.iter().enumerate() {
            let ctx = gen_context(&mut rng, 1000 + i as u64);
            let (_, cands) = gen_candidates(&mut rng, ctx.clock);
            match r {
                Err(e) => bad.push((i, e.to_string())),
                Ok(victims) => {
                    if let Err(e) = validate_victims(&cands, victims) {
                        bad.push((i, e.to_string()));
                    }
                }
            }
        }
        match failures(bad.into_iter()) {
            None => v.push("eviction: valid victims within limits", Outcome::Pass, format!("{} calls", ta.evict.len())),
            Some(f) => v.push("eviction: valid victims within limits", Outcome::Fail, f),
        }
    } else {
        v.push("eviction", Outcome::Skip, "not exported");
    }
    // Determinism: a second instance, the same inputs.
    let tb = run(&b, opts);
    if ta == tb {
        v.push("determinism: same inputs, same outputs", Outcome::Pass, "two instances agree on every call");
    } else {
        let first = ta
            .place
            .iter()
            .zip(&tb.place)
            .position(|(x, y)| x != y)
            .map(|i| format!("placement call {i}: {:?} vs {:?}", ta.place[i], tb.place[i]))
            .or_else(|| {
                ta.reclaim.iter().zip(&tb.reclaim).position(|(x, y)| x != y).map(|i| format!("reclamation call {i}"))
            })
            .unwrap_or_else(|| "eviction calls differ".to_string());
        v.push("determinism: same inputs, same outputs", Outcome::Fail, first);
    }
    // State transfer into a fresh instance.
    match a.save_state() {
        Err(e) => v.push("state: save-state → load-state", Outcome::Fail, format!("save-state failed: {e}")),
        Ok(state) => {
            match loaded
                .instantiate(&opts.config)
                .map_err(|e| e.to_string())
                .and_then(|c| c.load_state(&state).map_err(|e| e.to_string()))
            {
                Ok(()) => v.push("state: save-state → load-state", Outcome::Pass, format!("{} bytes", state.len())),
                Err(e) => v.push("state: save-state → load-state", Outcome::Fail, format!("load-state failed: {e}")),
            }
        }
    }
    let traps = a.failures();
    v.push(
        "sandbox",
        if traps == 0 { Outcome::Pass } else { Outcome::Fail },
        format!("{traps} failed calls, {} KiB of linear memory", a.memory_bytes() / 1024),
    );
    v
}
