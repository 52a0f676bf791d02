//! Same seed, same data: every ZeRO stage, offload, and 1 vs 4 ranks give the
//! same loss at every step; model-state bytes follow the ZeRO formulas.

use wasmem::alloc::Allocator;
use wasmem::alloc::SharedAllocator;
use wasmem::device::sim::{SimConfig, SimDevice};
use wasmem::model::ModelSpec;
use wasmem::shard::ZeroConfig;
use wasmem::train::{TrainConfig, TrainResult, Trainer};

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

fn allocators(n: usize, policy: &str) -> Vec<SharedAllocator<SimDevice>> {
    (0..n)
        .map(|_| {
            let dev = SimDevice::new(SimConfig { host_backed: true, ..SimConfig::default() });
            SharedAllocator::new(Allocator::with_builtin(dev, policy).unwrap())
        })
        .collect()
}

fn train(stage: u8, ranks: usize, offload: bool, steps: u64) -> TrainResult {
    train_spec(small(), stage, ranks, offload, steps)
}

fn train_spec(spec: ModelSpec, stage: u8, ranks: usize, offload: bool, steps: u64) -> TrainResult {
    let zero = ZeroConfig { stage, ranks, offload, micro_batches: 4 };
    let cfg = TrainConfig::new(spec, zero, steps);
    Trainer::new(cfg, allocators(ranks, "pytorch")).unwrap().run().unwrap()
}

fn losses(r: &TrainResult) -> Vec<f64> {
    r.steps.iter().map(|s| s.loss).collect()
}

fn assert_close(a: &[f64], b: &[f64], what: &str) {
    assert_eq!(a.len(), b.len());
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!((x - y).abs() <= 1e-5 * x.abs(), "{what}: step {i}: {x} vs {y}");
    }
}

#[test]
fn stages_offload_and_rank_counts_give_the_same_losses() {
    let steps = 6;
    let base = train(0, 4, false, steps);
    let l0 = losses(&base);
    assert!(l0.iter().all(|l| l.is_finite()));
    assert!(l0[steps as usize - 1] < l0[0], "the loss falls: {l0:?}");
    for stage in 1..=3 {
        assert_close(&l0, &losses(&train(stage, 4, false, steps)), &format!("stage {stage}"));
    }
    assert_close(&l0, &losses(&train(2, 4, true, steps)), "stage 2 + offload");
    assert_close(&l0, &losses(&train(3, 4, true, steps)), "stage 3 + offload");
    for stage in [0, 3] {
        assert_close(&l0, &losses(&train(stage, 1, false, steps)), &format!("1 rank, stage {stage}"));
    }
    assert_close(&l0, &losses(&train(1, 2, false, steps)), "2 ranks, stage 1");
}

#[test]
fn an_untied_head_trains_the_same_under_every_stage() {
    let spec = ModelSpec { tied: false, layers: 1, ..small() };
    let l0 = losses(&train_spec(spec.clone(), 0, 4, false, 4));
    assert!(l0[3] < l0[0], "{l0:?}");
    for (stage, ranks, offload) in [(1, 4, false), (2, 2, true), (3, 4, false), (3, 1, false)] {
        let l = losses(&train_spec(spec.clone(), stage, ranks, offload, 4));
        assert_close(&l0, &l, &format!("untied, stage {stage}, {ranks} ranks, offload {offload}"));
    }
}
