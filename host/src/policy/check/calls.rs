//! The calls of a conformance check: their inputs (fuzzed, or recorded from
//! a replay), running them on an instance with their durations, describing
//! inputs and answers in words, and comparing two runs call by call.

use std::time::{Duration, Instant};

use super::super::{WasmEviction, WasmPlacement, WasmPolicy, WasmReclamation};
use crate::decision::{
    AllocRequest, EvictionCandidate, EvictionPolicy, PlacementDecision, PlacementPolicy, PolicyContext, PolicyError,
    ReclaimDecision, ReclaimTrigger, ReclamationPolicy, Role,
};
use crate::types::{Phase, StreamId, TensorId, TensorKind, Tier, GIB, MIB};

/// The inputs of one decision call.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Input {
    /// `placement.place`.
    Place(AllocRequest, PolicyContext),
    /// `reclamation.plan` (or `reclaim`).
    Reclaim(ReclaimTrigger, PolicyContext),
    /// `eviction.choose-victims`.
    Evict(u64, Vec<EvictionCandidate>, PolicyContext),
}

impl Input {
    /// The role called.
    pub(crate) fn role(&self) -> Role {
        match self {
            Input::Place(..) => Role::Placement,
            Input::Reclaim(..) => Role::Reclamation,
            Input::Evict(..) => Role::Eviction,
        }
    }

    /// Candidates offered (0 for other roles).
    pub(crate) fn candidates(&self) -> usize {
        match self {
            Input::Evict(_, c, _) => c.len(),
            _ => 0,
        }
    }

    /// The inputs in words (an eviction call names its first candidates only).
    pub(crate) fn describe(&self) -> String {
        let ctx = |c: &PolicyContext| {
            format!(
                "clock {}, phase {}, reserved {} of {} bytes",
                c.clock,
                c.phase.map_or("none".to_string(), |p| format!("{p:?}").to_lowercase()),
                c.reserved_bytes,
                c.capacity_bytes
            )
        };
        match self {
            Input::Place(r, c) => format!("{} bytes, {:?}, stream {}; {}", r.bytes, r.kind, r.stream.0, ctx(c)),
            Input::Reclaim(t, c) => format!("{t:?}; {}", ctx(c)),
            Input::Evict(need, cands, c) => {
                let first: Vec<String> =
                    cands.iter().take(3).map(|x| format!("{} ({} bytes)", x.id, x.bytes)).collect();
                let more = if cands.len() > 3 { ", …" } else { "" };
                format!("need {need} bytes of {} candidates [{}{more}]; {}", cands.len(), first.join(", "), ctx(c))
            }
        }
    }
}

/// One call: its index among the calls of its role, and its inputs.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Call {
    /// Index among the calls of the same role (what reports name).
    pub index: usize,
    /// The inputs.
    pub input: Input,
}

impl Call {
    /// "placement call 17 (…inputs…)".
    pub(crate) fn name(&self) -> String {
        format!("{} call {} ({})", self.input.role(), self.index, self.input.describe())
    }
}

/// The answer to one call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Answer {
    /// A placement.
    Place(Result<PlacementDecision, PolicyError>),
    /// A reclamation.
    Reclaim(Result<ReclaimDecision, PolicyError>),
    /// Victims.
    Evict(Result<Vec<TensorId>, PolicyError>),
    /// Not asked: the role had failed too often already.
    Skipped,
}

impl Answer {
    /// The failure, if the call failed.
    pub(crate) fn error(&self) -> Option<&PolicyError> {
        match self {
            Answer::Place(Err(e)) | Answer::Reclaim(Err(e)) | Answer::Evict(Err(e)) => Some(e),
            _ => None,
        }
    }

    /// The answer in words.
    pub(crate) fn describe(&self) -> String {
        match self {
            Answer::Place(Ok(d)) => format!("{d:?}"),
            Answer::Reclaim(Ok(d)) => format!("{d:?}"),
            Answer::Evict(Ok(v)) => {
                let ids: Vec<String> = v.iter().take(8).map(|id| id.to_string()).collect();
                format!("{} victims [{}{}]", v.len(), ids.join(", "), if v.len() > 8 { ", …" } else { "" })
            }
            Answer::Place(Err(e)) | Answer::Reclaim(Err(e)) | Answer::Evict(Err(e)) => format!("an error ({e})"),
            Answer::Skipped => "nothing (not asked: the role had failed too often)".into(),
        }
    }
}

/// An answer and how long it took.
#[derive(Debug, Clone)]
pub(crate) struct Outcome {
    /// The answer.
    pub answer: Answer,
    /// Wall-clock duration of the call.
    pub took: Duration,
}

/// A role's run stops after this many failed calls (trap or limit): the
/// engine would have disabled the policy long before.
const MAX_FAILED_CALLS: usize = 16;
/// … or after this many calls past the check's own (relaxed) deadline.
const MAX_RUNAWAY_CALLS: usize = 3;

/// Runs calls on one instance's roles.
pub(crate) struct Runner {
    placement: Option<WasmPlacement>,
    reclamation: Option<WasmReclamation>,
    eviction: Option<WasmEviction>,
    failed: [usize; 3],
    runaway: [usize; 3],
}

impl Runner {
    /// A runner over the roles `p` exports.
    pub(crate) fn new(p: &WasmPolicy) -> Runner {
        Runner {
            placement: p.placement(),
            reclamation: p.reclamation(),
            eviction: p.eviction(),
            failed: [0; 3],
            runaway: [0; 3],
        }
    }

    /// Runs one call (or skips it when its role failed too often).
    pub(crate) fn run(&mut self, input: &Input) -> Outcome {
        let r = input.role().index();
        if self.failed[r] >= MAX_FAILED_CALLS || self.runaway[r] >= MAX_RUNAWAY_CALLS {
            return Outcome { answer: Answer::Skipped, took: Duration::ZERO };
        }
        let start = Instant::now();
        let answer = match input {
            Input::Place(req, ctx) => match &mut self.placement {
                Some(p) => Answer::Place(p.place(req, ctx)),
                None => Answer::Skipped,
            },
            Input::Reclaim(t, ctx) => match &mut self.reclamation {
                Some(p) => Answer::Reclaim(p.reclaim(t, ctx)),
                None => Answer::Skipped,
            },
            Input::Evict(need, cands, ctx) => match &mut self.eviction {
                Some(p) => Answer::Evict(p.choose_victims(*need, cands, ctx)),
                None => Answer::Skipped,
            },
        };
        let took = start.elapsed();
        match answer.error() {
            Some(PolicyError::Deadline) => {
                self.failed[r] += 1;
                self.runaway[r] += 1;
            }
            Some(PolicyError::InvalidDecision(_)) | None => {}
            Some(_) => self.failed[r] += 1,
        }
        Outcome { answer, took }
    }
}

/// The first call at or after `from` where two runs answered differently,
/// in words naming the call and both instances.
pub(crate) fn first_difference(
    calls: &[Call],
    a: (&str, &[Outcome]),
    b: (&str, &[Outcome]),
    from: usize,
) -> Option<String> {
    let n = calls.len().min(a.1.len()).min(b.1.len());
    (from..n).find(|&i| a.1[i].answer != b.1[i].answer).map(|i| {
        format!(
            "{}: instance {} answered {}, instance {} answered {}",
            calls[i].name(),
            a.0,
            a.1[i].answer.describe(),
            b.0,
            b.1[i].answer.describe()
        )
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

/// The fuzzed calls of a check: `cases` placements, `cases` reclamations and
/// `cases / 4` evictions (the roles in `roles` only), from `seed`, in that order.
pub(crate) fn fuzzed(cases: usize, seed: u64, roles: &[Role]) -> Vec<Call> {
    let mut v = Vec::new();
    if roles.contains(&Role::Placement) {
        let mut rng = Rng(seed);
        for i in 0..cases {
            let (req, ctx) = (gen_request(&mut rng), gen_context(&mut rng, i as u64));
            v.push(Call { index: i, input: Input::Place(req, ctx) });
        }
    }
    if roles.contains(&Role::Reclamation) {
        let mut rng = Rng(seed ^ 1);
        for i in 0..cases {
            let (trig, ctx) = (gen_trigger(&mut rng), gen_context(&mut rng, i as u64));
            v.push(Call { index: i, input: Input::Reclaim(trig, ctx) });
        }
    }
    if roles.contains(&Role::Eviction) {
        let mut rng = Rng(seed ^ 2);
        for i in 0..cases.div_ceil(4) {
            let ctx = gen_context(&mut rng, 1000 + i as u64);
            let (need, cands) = gen_candidates(&mut rng, ctx.clock);
            v.push(Call { index: i, input: Input::Evict(need, cands, ctx) });
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_difference_names_the_call_its_inputs_and_both_instances() {
        let calls = fuzzed(4, 7, &[Role::Eviction]);
        let ok = |v: Vec<TensorId>| Outcome { answer: Answer::Evict(Ok(v)), took: Duration::ZERO };
        let id = TensorId { slot: 3, generation: 1 };
        let a = vec![ok(vec![])];
        let b = vec![ok(vec![id])];
        let d = first_difference(&calls, ("A", &a), ("B", &b), 0).expect("they differ");
        assert!(d.starts_with("eviction call 0 (need "), "{d}");
        assert!(d.contains("candidates") && d.contains("clock 1000"), "{d}");
        assert!(d.contains("instance A answered 0 victims []") && d.contains("instance B answered 1 victims"), "{d}");
        assert_eq!(first_difference(&calls, ("A", &a), ("A", &a), 0), None);
    }

    #[test]
    fn fuzzed_inputs_are_reproducible_and_per_role() {
        let all = fuzzed(8, 1, &Role::ALL);
        assert_eq!(all, fuzzed(8, 1, &Role::ALL));
        assert_eq!(all.len(), 8 + 8 + 2);
        assert_eq!(fuzzed(8, 1, &[Role::Reclamation]), all[8..16].to_vec());
    }
}
