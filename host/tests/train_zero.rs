//! The trainer against the ZeRO plan: model-state bytes vs the formulas,
//! recorded traces vs synthesized ones, hot swaps, and failing ranks.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use wasmem::alloc::Allocator;
use wasmem::alloc::SharedAllocator;
use wasmem::builtin;
use wasmem::device::sim::{SimConfig, SimDevice};
use wasmem::model::ModelSpec;
use wasmem::replay::{replay, ReplayConfig};
use wasmem::shard::{Plan, ZeroConfig};
use wasmem::trace::Event;
use wasmem::train::session::swap_policy;
use wasmem::train::{TrainConfig, TrainError, Trainer};

fn small() -> ModelSpec {
    ModelSpec {
        layers: 2,
        hidden: 32,
        heads: 2,
        kv_heads: 2,
        intermediate: 64,
        vocab: 64,
        seq: 16,
        batch: 2,
        ..ModelSpec::preset("tiny").unwrap()
    }
}

fn allocators(n: usize, capacity: impl Fn(usize) -> u64) -> Vec<SharedAllocator<SimDevice>> {
    (0..n)
        .map(|r| {
            let dev = SimDevice::new(SimConfig { host_backed: true, capacity: capacity(r), ..SimConfig::default() });
            SharedAllocator::new(Allocator::with_builtin(dev, "pytorch").unwrap())
        })
        .collect()
}

fn cfg(stage: u8, ranks: usize, offload: bool, steps: u64) -> TrainConfig {
    TrainConfig::new(small(), ZeroConfig { stage, ranks, offload, micro_batches: ranks }, steps)
}

#[test]
fn model_state_bytes_match_the_zero_formulas() {
    let ranks = 4;
    let mut per_stage = Vec::new();
    for (stage, offload) in [(0, false), (1, false), (2, false), (3, false), (2, true), (3, true)] {
        let c = cfg(stage, ranks, offload, 2);
        let plan = Plan::new(&c.spec, c.zero).unwrap();
        let psi = plan.parameters() as f64;
        let r = Trainer::new(c, allocators(ranks, |_| 8 << 30)).unwrap().run().unwrap();
        for rank in &r.steps.last().unwrap().ranks {
            let got = rank.model_state_bytes as f64;
            let n = ranks as f64;
            let want = match (stage, offload) {
                (0, _) => 16.0 * psi,
                (1, _) => 4.0 * psi + 12.0 * psi / n,
                (2, false) => 2.0 * psi + 14.0 * psi / n,
                (2, true) => 2.0 * psi + 2.0 * psi / n,
                (_, false) => 16.0 * psi / n,
                (_, true) => 4.0 * psi / n,
            };
            assert!((got - want).abs() / want < 0.01, "stage {stage} offload {offload}: {got} vs {want}");
            // The layer buffers stay within the documented slack.
            assert!(rank.layer_buffer_peak_bytes <= plan.slack_bytes(), "stage {stage}: {rank:?}");
            if stage >= 2 {
                assert!(rank.layer_buffer_peak_bytes > 0);
            }
            let host = if offload { 12.0 * psi / n } else { 0.0 };
            assert!((rank.host_state_bytes as f64 - host).abs() <= 0.01 * host + 1.0, "{rank:?}");
        }
        per_stage.push(r.steps.last().unwrap().ranks[0].model_state_bytes);
    }
    // Stage 3 saves 75 % of the model states of stage 0 on 4 ranks.
    assert!(per_stage[3] * 4 <= per_stage[0] + per_stage[0] / 100);
}

/// Collects each rank's tapped events.
fn record(t: &mut Trainer<SimDevice>, ranks: usize) -> Vec<Arc<Mutex<Vec<Event>>>> {
    (0..ranks)
        .map(|r| {
            let v = Arc::new(Mutex::new(Vec::new()));
            let sink = v.clone();
            t.set_tap(r, Box::new(move |e| sink.lock().unwrap().push(*e)));
            v
        })
        .collect()
}

#[test]
fn recorded_traces_equal_the_synthesized_plan_and_replay_to_the_same_peak() {
    for (stage, ranks, offload) in [(3, 8, false), (2, 4, true), (0, 2, false)] {
        let c = cfg(stage, ranks, offload, 2);
        let plan = Plan::new(&c.spec, c.zero).unwrap();
        let mut t = Trainer::new(c, allocators(ranks, |_| 8 << 30)).unwrap();
        let taps = record(&mut t, ranks);
        let run = t.run().unwrap();
        let synth = plan.events(2);
        for (r, tap) in taps.iter().enumerate() {
            let got = tap.lock().unwrap();
            assert_eq!(*got, synth, "stage {stage}: rank {r}'s trace differs from the plan");
        }
        // Replaying the synthesized trace reaches the trained run's peak (within 5 %).
        let m = replay(
            synth.iter().map(|e| Ok::<_, String>(*e)),
            builtin::by_name("pytorch").unwrap(),
            &ReplayConfig::default(),
        )
        .unwrap()
        .metrics;
        for rank in &run.steps.last().unwrap().ranks {
            let (a, b) = (m.peak_reserved_bytes as f64, rank.peak_reserved_bytes as f64);
            assert!((a - b).abs() <= 0.05 * b, "stage {stage}: synthesized peak {a} vs trained {b}");
        }
    }
}

#[test]
fn a_hot_swap_in_the_middle_changes_no_loss() {
    let plain = Trainer::new(cfg(3, 4, false, 6), allocators(4, |_| 8 << 30)).unwrap().run().unwrap();
    #[cfg(feature = "wasm")]
    let rt: wasmem::spec::Loader = Arc::new(wasmem::policy::Runtime::global().unwrap().clone());
    #[cfg(not(feature = "wasm"))]
    let rt: wasmem::spec::Loader = Arc::new(wasmem::spec::Builtins);
    let wasm = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../policies/out/pytorch-like.wasm");
    let mut targets = vec!["lifecycle".to_string()];
    if wasm.is_file() && cfg!(feature = "wasm") {
        targets.push(wasm.display().to_string());
    }
    for to in targets {
        let mut t = Trainer::new(cfg(3, 4, false, 6), allocators(4, |_| 8 << 30)).unwrap();
        let swaps = Arc::new(Mutex::new(0));
        let (count, target, rt) = (swaps.clone(), to.clone(), rt.clone());
        t.on_step(Arc::new(move |_, step, alloc| {
            if step == 3 {
                swap_policy(alloc, &rt, &target).map_err(|e| e.to_string())?;
                *count.lock().unwrap() += 1;
            }
            Ok(())
        }));
        let allocs = t.allocators();
        let swapped = t.run().unwrap();
        assert_eq!(*swaps.lock().unwrap(), 4, "every rank swapped");
        let losses = |r: &wasmem::train::TrainResult| r.steps.iter().map(|s| s.loss).collect::<Vec<_>>();
        assert_eq!(losses(&plain), losses(&swapped), "swap to {to}");
        let expect = if to == "lifecycle" { "lifecycle" } else { "pytorch-like" };
        for a in allocs {
            assert!(a.with(|a| a.policies().names()[0].contains(expect)), "{:?}", a.with(|a| a.policies().names()));
        }
    }
}

#[test]
fn a_panicking_rank_fails_every_rank_quickly() {
    let mut c = cfg(3, 4, false, 4);
    c.panic_at = Some((2, 1));
    c.comm_timeout = Duration::from_secs(120);
    let t0 = std::time::Instant::now();
    let e = Trainer::new(c, allocators(4, |_| 8 << 30)).unwrap().run().unwrap_err();
    match &e {
        TrainError::Panicked { rank, message } => {
            assert_eq!(*rank, 2);
            assert!(message.contains("injected fault"), "{message}");
        }
        other => panic!("expected the panic as the cause, got {other}"),
    }
    // The others noticed the departure, not the 120 s timeout (a generous bound, not a timing assertion).
    assert!(t0.elapsed() < Duration::from_secs(100));
}

#[test]
fn a_rank_out_of_memory_fails_every_rank_with_its_error() {
    // Rank 1's device cannot hold its model states.
    let e = Trainer::new(cfg(1, 4, false, 3), allocators(4, |r| if r == 1 { 64 << 10 } else { 8 << 30 }))
        .unwrap()
        .run()
        .unwrap_err();
    let msg = e.to_string();
    assert!(msg.contains("rank 1") && msg.contains("out of memory"), "{msg}");
}

#[test]
fn configurations_the_trainer_cannot_run_are_refused() {
    let llama = TrainConfig::new(
        ModelSpec::preset("llama-1b").unwrap(),
        ZeroConfig { stage: 0, ranks: 1, offload: false, micro_batches: 1 },
        1,
    );
    assert!(matches!(Trainer::new(llama, allocators(1, |_| 1 << 30)), Err(TrainError::Config(_))));
    let c = cfg(1, 4, false, 1);
    assert!(matches!(Trainer::new(c, allocators(3, |_| 1 << 30)), Err(TrainError::Config(_))));
}

#[test]
fn a_silent_rank_times_every_rank_out() {
    let mut c = cfg(2, 3, false, 3);
    c.comm_timeout = Duration::from_millis(500);
    let mut t = Trainer::new(c, allocators(3, |_| 8 << 30)).unwrap();
    // Rank 1 stops answering (alive, holding its communicator) at step 1.
    t.on_step(Arc::new(|rank, step, _| {
        if rank == 1 && step == 1 {
            std::thread::sleep(Duration::from_secs(3));
        }
        Ok(())
    }));
    let e = t.run().unwrap_err();
    match &e {
        TrainError::Comm(wasmem::comm::CommError::Timeout { missing, .. }) => assert_eq!(missing, &vec![1], "{e}"),
        other => panic!("expected a timeout naming rank 1, got {other}"),
    }
}
