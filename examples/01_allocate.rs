//! 01 · Allocate: drive the caching allocator by hand on the simulated device.
//!
//! Run: `cargo run --release --example 01_allocate`
//!
//! One toy training step (parameters, activations, gradients, temporaries)
//! under each built-in policy, with the allocator's statistics.

use wasmem::alloc::Allocator;
use wasmem::builtin::BUILTIN_NAMES;
use wasmem::device::sim::SimDevice;
use wasmem::types::{human_bytes, Phase, StreamId, TensorKind, GIB, MIB};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    for policy in BUILTIN_NAMES {
        let mut a = Allocator::with_builtin(SimDevice::with_capacity(16 * GIB), policy).ok_or("unknown policy")?;
        let s0 = StreamId(0);
        let params: Vec<_> =
            (0..24).map(|i| a.alloc((3 + i % 5) * MIB + 4096, TensorKind::Param, s0)).collect::<Result<_, _>>()?;
        for step in 0..3 {
            a.phase(Phase::Forward, step)?;
            let mut acts = Vec::new();
            for layer in 0..24u64 {
                let tmp = a.alloc(7 * MIB + layer * 1000, TensorKind::Temp, s0)?;
                acts.push(a.alloc(12 * MIB + layer * 512, TensorKind::Activation, s0)?);
                a.free(tmp)?;
            }
            a.phase(Phase::Backward, step)?;
            let mut grads = Vec::new();
            for (p, act) in params.iter().zip(acts.into_iter().rev()) {
                let tmp = a.alloc(9 * MIB, TensorKind::Temp, s0)?;
                grads.push(a.alloc(a.tensor(*p).map_or(MIB, |t| t.bytes), TensorKind::Grad, s0)?);
                a.free(tmp)?;
                a.free(act)?;
            }
            a.phase(Phase::Optimizer, step)?;
            for g in grads {
                a.free(g)?;
            }
            a.check_invariants()?;
        }
        let s = a.stats();
        println!(
            "{policy:>10}: peak live {:>10}  peak allocated {:>10}  peak reserved {:>10}  device allocs {:>5}  frees {:>5}  cache hits {}",
            human_bytes(s.bytes.peak_live_bytes),
            human_bytes(s.bytes.peak_allocated_bytes),
            human_bytes(s.bytes.peak_reserved_bytes),
            s.device_alloc_calls,
            s.device_free_calls,
            s.cache_hits
        );
    }
    Ok(())
}
