//! Planned placement: the hot path of a planned step, and planning time.
//!
//! - `planned_step`: one training-like step of 64 requests (allocations
//!   with their frees), repeated; after the warm-up the plan is installed
//!   and every request is served at its planned offset. The same step under
//!   `naive` (a device call per alloc and per free) and `pytorch` runs in
//!   the same process as the baselines. Divide by 64 for the time of one
//!   alloc+free pair. Goal: `planned` ≤ 60 ns per pair.
//! - `plan_50k`: the built-in planner on a step of 50,000 requests
//!   (forward/backward shaped, with temporaries and tensors that wrap into
//!   the next step). Goal: ≤ 50 ms.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion};
use wasmem::alloc::Allocator;
use wasmem::builtin::GreedyPlanner;
use wasmem::decision::{validate_plan, PlanRequest, StepProfile};
use wasmem::device::sim::SimDevice;
use wasmem::types::{Phase, StreamId, TensorId, TensorKind, GIB, KIB, MIB};

/// A step: `(bytes, kind, free after request k)` for each request.
fn step_template(layers: usize) -> Vec<(u64, TensorKind, usize)> {
    let mut reqs = Vec::new();
    for l in 0..layers {
        reqs.push((MIB + l as u64 * 4 * KIB, TensorKind::Activation, 0));
        reqs.push((300 * KIB, TensorKind::Temp, 0));
    }
    let fwd = reqs.len();
    for _ in 0..layers {
        reqs.push((600 * KIB, TensorKind::Temp, 0));
        reqs.push((200 * KIB, TensorKind::Temp, 0));
    }
    let n = reqs.len();
    for (k, r) in reqs.iter_mut().enumerate() {
        r.2 = match r.1 {
            TensorKind::Activation => fwd + 2 * (layers - 1 - k / 2) + 1,
            _ => (k + 1).min(n - 1),
        };
    }
    reqs
}

/// The frees of a step: for each request, the earlier requests freed just
/// before it (precomputed, so that the loop measures the allocator).
fn free_schedule(t: &[(u64, TensorKind, usize)]) -> Vec<Vec<usize>> {
    let mut before = vec![Vec::new(); t.len()];
    for (k, &(_, _, free_at)) in t.iter().enumerate() {
        if free_at > k && free_at < t.len() {
            before[free_at].push(k);
        }
    }
    before
}

/// Runs one step of `t` on `a`; `ids` holds the step's handles, `ended`
/// whether each was freed during the step.
fn run_step(
    a: &mut Allocator<SimDevice>,
    t: &[(u64, TensorKind, usize)],
    before: &[Vec<usize>],
    step: u64,
    ids: &mut [Option<TensorId>],
) {
    for (k, &(bytes, kind, _)) in t.iter().enumerate() {
        for &j in &before[k] {
            a.free(ids[j].take().expect("allocated earlier")).unwrap();
        }
        ids[k] = Some(a.alloc(black_box(bytes), kind, StreamId(0)).unwrap());
    }
    for id in ids.iter_mut().filter_map(Option::take) {
        a.free(id).unwrap();
    }
    a.phase(Phase::StepEnd, step).unwrap();
}

fn planned_step(c: &mut Criterion) {
    let t = step_template(16);
    assert_eq!(t.len(), 64);
    let mut g = c.benchmark_group("planned_step_64_requests");
    for policy in ["planned", "pytorch", "naive"] {
        let mut a = Allocator::with_builtin(SimDevice::with_capacity(80 * GIB), policy).unwrap();
        let before = free_schedule(&t);
        let mut ids = vec![None; t.len()];
        let mut step = 0;
        for _ in 0..6 {
            run_step(&mut a, &t, &before, step, &mut ids);
            step += 1;
        }
        if policy == "planned" {
            assert!(a.stats().plan_hits > 0, "the plan is not in use: {:?}", a.stats());
        }
        g.bench_function(policy, |b| {
            b.iter(|| {
                run_step(&mut a, &t, &before, step, &mut ids);
                step += 1;
            })
        });
    }
    g.finish();
}

/// A profile of `n` requests shaped like a long training step.
fn profile(n: u32) -> StepProfile {
    let mut rng = oorandom::Rand32::new(11);
    let mut requests = Vec::with_capacity(n as usize);
    let half = n / 2;
    for k in 0..n {
        let bytes = 512 * u64::from(1 + rng.rand_range(1..4096));
        let (kind, freed_at, wraps_to) = if k < half && k % 3 == 0 {
            // an activation, freed in the mirror position of the backward
            (TensorKind::Activation, Some((n - 1 - k).max(k + 1)), None)
        } else if k % 97 == 0 {
            // a gradient, live across the step end, freed early in the next
            (TensorKind::Grad, None, Some(k.min(8)))
        } else {
            (TensorKind::Temp, Some((k + 1 + rng.rand_range(0..8)).min(n)), None)
        };
        requests.push(PlanRequest { bytes, kind, stream: StreamId(0), freed_at, wraps_to });
    }
    StepProfile { step: 1, requests }
}

fn plan_50k(c: &mut Criterion) {
    let mut g = c.benchmark_group("plan");
    // A step short enough for the scan of placed blocks and the extra orders.
    let short = profile(2_000);
    g.bench_function("greedy_2k_requests", |b| b.iter(|| black_box(GreedyPlanner::plan_profile(black_box(&short)))));
    let p = profile(50_000);
    g.sample_size(10);
    g.bench_function("greedy_50k_requests", |b| b.iter(|| black_box(GreedyPlanner::plan_profile(black_box(&p)))));
    // Checking a plan: what every plan made or read from a plan cache costs.
    let plan = GreedyPlanner::plan_profile(&p);
    g.bench_function("validate_50k_requests", |b| {
        b.iter(|| validate_plan(black_box(&p), black_box(&plan), u64::MAX).expect("valid"))
    });
    g.finish();
}

criterion_group!(benches, planned_step, plan_50k);
criterion_main!(benches);
