//! The CUDA backend on a real GPU, and its clean failure without one.
//!
//! GPU tests run when `WASMEM_GPU_TESTS=1` (then a missing GPU is a failure)
//! or when a CUDA driver and device are detected; otherwise they print
//! "skipping: no CUDA driver" and pass.

use wasmem::alloc::Allocator;
use wasmem::decision::ReclaimDecision;
use wasmem::device::cuda::{self, CudaDevice};
use wasmem::device::{Device, DeviceError};
use wasmem::types::{StreamId, TensorId, TensorKind, KIB, MIB};

/// The GPU under test, or `None` (after saying so) when the tests should skip.
fn gpu(test: &str) -> Option<CudaDevice> {
    let required = std::env::var("WASMEM_GPU_TESTS").is_ok_and(|v| v == "1");
    if required {
        return Some(CudaDevice::new(0).unwrap_or_else(|e| panic!("WASMEM_GPU_TESTS=1 but no usable GPU: {e}")));
    }
    if !cuda::driver_present() {
        eprintln!("{test}: skipping: no CUDA driver");
        return None;
    }
    match CudaDevice::new(0) {
        Ok(d) => Some(d),
        Err(e) => {
            eprintln!("{test}: skipping: CUDA driver present but no usable device ({e})");
            None
        }
    }
}

#[test]
fn without_a_driver_new_is_a_clean_error() {
    // Must never panic, whatever the machine.
    let r = std::panic::catch_unwind(|| CudaDevice::new(0).map(|_| ()));
    let r = r.expect("CudaDevice::new must not panic");
    if !cuda::driver_present() {
        match r {
            Err(DeviceError::Unavailable(msg)) => {
                assert_eq!(msg, cuda::NO_DRIVER);
                assert!(msg.contains("no CUDA driver") && msg.contains("--device sim"), "{msg}");
            }
            other => panic!("expected Unavailable without a driver, got {other:?}"),
        }
    } else if let Err(e) = r {
        assert!(
            matches!(e, DeviceError::Unavailable(_)),
            "a driver is present: only Unavailable is acceptable, got {e:?}"
        );
    }
    // A device index that cannot exist is refused cleanly too.
    let far = CudaDevice::new(1 << 20);
    assert!(matches!(far, Err(DeviceError::Unavailable(_))), "{far:?}");
}

#[test]
fn segments_alloc_write_read_free() {
    let Some(mut d) = gpu("segments_alloc_write_read_free") else { return };
    assert_eq!(d.name(), "cuda");
    assert!(d.capacity() > 0);
    let before = d.available().expect("cuMemGetInfo");
    let a = d.alloc_segment(4 * KIB).unwrap();
    let b = d.alloc_segment(8 * MIB).unwrap();
    assert!(d.available().unwrap() < before + MIB, "available should not grow while holding 8 MiB");
    let data: Vec<u8> = (0..8 * MIB as usize).map(|i| (i * 7 % 253) as u8).collect();
    d.write(b, &data).unwrap();
    let mut back = vec![0u8; data.len()];
    d.read(b, &mut back).unwrap();
    assert_eq!(back, data);
    // Out of range and unknown pointers are refused before the driver sees them.
    assert!(matches!(d.write(a, &[0u8; 4097]), Err(DeviceError::Invalid(_))));
    assert!(matches!(d.read(b + 8 * MIB, &mut [0u8; 1]), Err(DeviceError::Invalid(_))));
    assert!(matches!(d.free_segment(a + 1), Err(DeviceError::Invalid(_))));
    assert!(matches!(d.alloc_segment(0), Err(DeviceError::Invalid(_))));
    d.check_invariants().unwrap();
    d.free_segment(a).unwrap();
    assert!(d.free_segment(a).is_err());
    d.free_segment(b).unwrap();
    let c = d.counters();
    assert_eq!((c.alloc_calls, c.free_calls, c.syncs, c.used_bytes), (2, 2, 2, 0));
    assert!(c.time_us > 0.0);
    // Far more than the device has: a typed out-of-memory error, not a panic.
    let huge = d.capacity() * 2;
    assert!(matches!(d.alloc_segment(huge), Err(DeviceError::OutOfMemory { .. })));
    d.check_invariants().unwrap();
    d.close().unwrap();
}

#[test]
fn vmm_stitched_pages_hold_contents() {
    let Some(mut d) = gpu("vmm_stitched_pages_hold_contents") else { return };
    assert!(d.supports_vmm(), "{} does not support the virtual-memory API", d.device_name());
    let g = d.granularity();
    assert!(g.is_power_of_two() && g >= 64 * KIB, "granularity {g}");
    let va = d.reserve_virtual(4 * g).unwrap();
    let p1 = d.create_physical(g).unwrap();
    let p2 = d.create_physical(g).unwrap();
    // Stitch two physical pages in reverse order into one virtual range.
    d.map(va + g, p1).unwrap();
    d.map(va, p2).unwrap();
    assert!(d.map(va, p1).is_err(), "p1 is already mapped");
    assert!(d.map(va + 2 * g + 1, p1).is_err(), "unaligned");
    assert!(d.reserve_virtual(g + 1).is_err());
    assert!(d.create_physical(g / 2).is_err());
    let data: Vec<u8> = (0..(g + g / 2) as usize).map(|i| (i % 251) as u8).collect();
    d.write(va + g / 4, &data).unwrap();
    let mut back = vec![0u8; data.len()];
    d.read(va + g / 4, &mut back).unwrap();
    assert_eq!(back, data);
    // A copy across the stitch point, then an overlapping one (memmove).
    let seg = d.alloc_segment(2 * g).unwrap();
    d.copy(seg, va + g / 4, g + g / 2, StreamId(3)).unwrap();
    d.copy(va + g / 2, va + g / 4, g, StreamId(3)).unwrap();
    d.synchronize().unwrap();
    let mut out = vec![0u8; (g + g / 2) as usize];
    d.read(seg, &mut out).unwrap();
    assert_eq!(out, data);
    let mut moved = vec![0u8; g as usize];
    d.read(va + g / 2, &mut moved).unwrap();
    assert_eq!(moved[..], data[..g as usize], "overlapping copy must behave like memmove");
    // Beyond the mapped pages is refused.
    assert!(d.read(va + 2 * g - 1, &mut [0u8; 2]).is_err());
    d.check_invariants().unwrap();
    assert!(d.release_virtual(va).is_err(), "still mapped");
    assert!(d.release_physical(p1).is_err(), "still mapped");
    d.unmap(va).unwrap();
    d.unmap(va + g).unwrap();
    assert!(d.unmap(va).is_err());
    d.release_physical(p1).unwrap();
    d.release_physical(p2).unwrap();
    d.release_virtual(va).unwrap();
    d.free_segment(seg).unwrap();
    assert_eq!(d.counters().used_bytes, 0);
    d.check_invariants().unwrap();
    d.close().unwrap();
}

/// Parts of one physical allocation (`cuMemMap` at an offset) back pages at
/// unrelated addresses, as the allocator's chunks do: contents written
/// through the parts read back through a whole mapping of the allocation.
#[test]
fn parts_of_one_physical_allocation_hold_contents() {
    let Some(mut d) = gpu("parts_of_one_physical_allocation_hold_contents") else { return };
    assert!(d.maps_parts());
    let g = d.granularity();
    let va = d.reserve_virtual(4 * g).unwrap();
    let p = d.create_physical(2 * g).unwrap();
    d.map_part(va, p, g, g).unwrap();
    d.map_part(va + 2 * g, p, 0, g).unwrap();
    assert!(d.map_part(va + g, p, g / 2, g).is_err(), "unaligned offset");
    assert!(d.map_part(va + g, p, g, 2 * g).is_err(), "past the allocation's end");
    let second: Vec<u8> = (0..g as usize).map(|i| (i % 241) as u8).collect();
    let first: Vec<u8> = (0..g as usize).map(|i| (i % 239) as u8).collect();
    d.write(va, &second).unwrap();
    d.write(va + 2 * g, &first).unwrap();
    let whole = d.reserve_virtual(2 * g).unwrap();
    d.map(whole, p).unwrap();
    let mut back = vec![0u8; g as usize];
    d.read(whole, &mut back).unwrap();
    assert_eq!(back, first);
    d.read(whole + g, &mut back).unwrap();
    assert_eq!(back, second);
    d.check_invariants().unwrap();
    for at in [va, va + 2 * g, whole] {
        d.unmap(at).unwrap();
    }
    d.release_physical(p).unwrap();
    d.release_virtual(va).unwrap();
    d.release_virtual(whole).unwrap();
    assert_eq!(d.counters().used_bytes, 0);
    d.check_invariants().unwrap();
    d.close().unwrap();
}

#[test]
fn copies_and_events() {
    let Some(mut d) = gpu("copies_and_events") else { return };
    let a = d.alloc_segment(64 * MIB).unwrap();
    let b = d.alloc_segment(64 * MIB).unwrap();
    let data: Vec<u8> = (0..64 * MIB as usize).map(|i| (i % 241) as u8).collect();
    d.write(a, &data).unwrap();
    let before = d.record_event(StreamId(1)).unwrap();
    d.copy(b, a, 64 * MIB, StreamId(1)).unwrap();
    let after = d.record_event(StreamId(1)).unwrap();
    let other = d.record_event(StreamId(2)).unwrap();
    // An event completes eventually without any synchronization.
    let t0 = std::time::Instant::now();
    while !d.event_done(after).unwrap() {
        assert!(t0.elapsed().as_secs() < 30, "event never completed");
        std::hint::spin_loop();
    }
    assert!(d.event_done(before).unwrap());
    d.synchronize().unwrap();
    assert!(d.event_done(other).unwrap());
    let mut out = vec![0u8; data.len()];
    d.read(b, &mut out).unwrap();
    assert_eq!(out, data);
    // Read after an async copy without a synchronization: ordered by the blocking streams.
    d.copy(a + 1, b, 16, StreamId(4)).unwrap();
    let mut few = [0u8; 16];
    d.read(a + 1, &mut few).unwrap();
    assert_eq!(few[..], data[..16]);
    for ev in [before, after, other] {
        d.destroy_event(ev).unwrap();
    }
    assert!(d.event_done(before).is_err());
    assert!(d.copy(b, a, 64 * MIB + 1, StreamId(1)).is_err());
    assert_eq!(d.counters().copied_bytes, 64 * MIB + 16);
    d.free_segment(a).unwrap();
    d.free_segment(b).unwrap();
    d.close().unwrap();
}

/// splitmix64: a seeded generator, so a failure can be replayed.
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
        self.next() % n
    }
}

fn tag(id: TensorId) -> [u8; 8] {
    format!("{id:?}")
        .bytes()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3))
        .to_le_bytes()
}

#[test]
fn pytorch_allocator_over_cuda_random_ops() {
    let Some(d) = gpu("pytorch_allocator_over_cuda_random_ops") else { return };
    let s = random_ops(d, "pytorch", 4000, CudaDevice::check_invariants);
    assert!(s.cache_hits > 0, "the pytorch policy should serve some requests from cache");
}

/// The `defrag` set on the GPU: paged segments through the CUDA virtual
/// memory API, stitched and trimmed, with every tensor's tags checked.
#[test]
fn defrag_allocator_over_cuda_random_ops() {
    let Some(d) = gpu("defrag_allocator_over_cuda_random_ops") else { return };
    let s = random_ops(d, "defrag", 4000, CudaDevice::check_invariants);
    // The CUDA backend does not know the client's streams: pages are
    // unmapped after a device synchronization (counted), never before.
    assert!(s.stitches > 0 && s.paged_segments > 0 && s.stream_syncs == 0, "{s:?}");
}

/// The same random workload on the simulated device (no GPU needed): it
/// stitches, so the GPU run above exercises stitching too. Each growth is
/// one physical allocation there, as on CUDA; on a device that maps whole
/// allocations only (a page each), trims also give pages back.
#[test]
fn defrag_random_ops_stitch_on_sim() {
    use wasmem::device::sim::{SimConfig, SimDevice};
    for maps_parts in [true, false] {
        let d = SimDevice::new(SimConfig { host_backed: true, capacity: 4 << 30, maps_parts, ..SimConfig::default() });
        let s = random_ops(d, "defrag", 1200, SimDevice::check_invariants);
        assert!(s.stitches > 0 && s.paged_segments > 0, "{s:?}");
        assert!(maps_parts || s.trimmed_bytes > 0, "{s:?}");
        assert_eq!(s.device_syncs, 0);
    }
}

/// Random allocations and frees of three size classes on two streams under
/// the built-in policy set `policy`, with eight step ends;
/// both ends of every tensor are tagged and checked at its free, invariants
/// after every operation, and everything is given back at the end.
fn random_ops<D: Device>(
    d: D,
    policy: &str,
    steps: u64,
    check: fn(&D) -> Result<(), wasmem::types::InvariantError>,
) -> wasmem::alloc::Stats {
    let mut a = Allocator::with_builtin(d, policy).expect("builtin policy");
    let mut rng = Rng(0x5eed_cafe);
    let mut live: Vec<TensorId> = Vec::new();
    let kinds = TensorKind::ALL;
    for step in 0..steps {
        if step % (steps / 8) == steps / 8 - 1 {
            a.phase(wasmem::types::Phase::StepEnd, step / (steps / 8)).unwrap();
        }
        if live.is_empty() || rng.below(10) < 6 {
            let bytes = match rng.below(3) {
                0 => 1 + rng.below(2048),
                1 => 2048 + rng.below(2 * MIB),
                _ => 2 * MIB + rng.below(24 * MIB),
            };
            let kind = kinds[rng.below(kinds.len() as u64) as usize];
            let id = a.alloc(bytes, kind, StreamId(rng.below(2) as u32)).unwrap_or_else(|e| panic!("step {step}: {e}"));
            // Tag both ends: overlapping blocks or a wrong address would clobber a tag.
            let t = tag(id);
            a.write(id, 0, &t[..bytes.min(8) as usize]).unwrap();
            if bytes >= 16 {
                a.write(id, bytes - 8, &t).unwrap();
            }
            live.push(id);
        } else {
            let id = live.swap_remove(rng.below(live.len() as u64) as usize);
            let bytes = a.tensor(id).unwrap().bytes;
            let t = tag(id);
            let mut head = [0u8; 8];
            let n = bytes.min(8) as usize;
            a.read(id, 0, &mut head[..n]).unwrap();
            assert_eq!(head[..n], t[..n], "step {step}: head tag of {id:?} was overwritten");
            if bytes >= 16 {
                let mut tail = [0u8; 8];
                a.read(id, bytes - 8, &mut tail).unwrap();
                assert_eq!(tail, t, "step {step}: tail tag of {id:?} was overwritten");
            }
            a.free(id).unwrap();
        }
        a.check_invariants().unwrap_or_else(|e| panic!("step {step}: {e}"));
        check(a.device()).unwrap_or_else(|e| panic!("step {step}: device: {e}"));
    }
    let s = a.stats();
    assert_eq!(a.gauges().reserved_bytes, a.device().counters().used_bytes);
    for id in live.drain(..) {
        a.free(id).unwrap();
    }
    a.release_cached(&ReclaimDecision::all()).unwrap();
    a.check_invariants().unwrap();
    assert_eq!(a.gauges().reserved_bytes, 0);
    assert_eq!(a.device().counters().used_bytes, 0);
    let c = a.device().counters();
    assert_eq!(c.alloc_calls, c.free_calls);
    eprintln!(
        "{policy} allocator over {}: {} allocs, {} cache hits, {} device allocs, {} stitches, {:.1} ms in device calls",
        a.device().name(),
        s.allocs,
        s.cache_hits,
        c.alloc_calls,
        s.stitches,
        c.time_us / 1e3
    );
    s
}

/// Host-tier buffers are pinned on CUDA, hold what the device copies into
/// them, and stay valid (and are freed cleanly) after the device is gone and
/// on another thread, as the disk tier's I/O threads drop them.
#[test]
fn pinned_host_buffers_for_the_host_tier() {
    let Some(mut d) = gpu("pinned_host_buffers_for_the_host_tier") else { return };
    let len = MIB as usize;
    let ptr = d.alloc_segment(MIB).unwrap();
    let data: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
    d.write(ptr, &data).unwrap();
    let mut h = d.alloc_host(len).unwrap();
    assert!(h.is_pinned(), "cuMemHostAlloc should succeed for 1 MiB");
    d.read(ptr, &mut h).unwrap();
    assert_eq!(&h[..], &data[..]);
    d.free_segment(ptr).unwrap();
    drop(d);
    std::thread::spawn(move || {
        assert_eq!(h[250], 250);
        drop(h);
    })
    .join()
    .unwrap();
}

/// Off CUDA, host buffers are ordinary heap memory.
#[test]
fn sim_host_buffers_are_heap_memory() {
    use wasmem::device::sim::{SimConfig, SimDevice};
    let mut d = SimDevice::new(SimConfig::default());
    let mut h = d.alloc_host(4096).unwrap();
    assert!(!h.is_pinned());
    h[7] = 7;
    assert_eq!((h.len(), h[7]), (4096, 7));
}

/// Planned placement on the GPU: repeated training-like steps learn a plan,
/// install the arena (one device allocation) with live tensors moved into it
/// (device copies), and are served from it; every tensor's tags are checked
/// at its free and the steady state makes no device call.
#[test]
fn planned_arena_over_cuda_keeps_tagged_contents() {
    let Some(d) = gpu("planned_arena_over_cuda_keeps_tagged_contents") else { return };
    planned_steps(d, CudaDevice::check_invariants);
}

/// The same steps on the host-backed simulated device (no GPU needed).
#[test]
fn planned_arena_on_sim_keeps_tagged_contents() {
    use wasmem::device::sim::{SimConfig, SimDevice};
    let d = SimDevice::new(SimConfig { host_backed: true, capacity: 4 << 30, ..SimConfig::default() });
    planned_steps(d, SimDevice::check_invariants);
}

/// Eight steps of a forward (activations and temporaries) and a backward
/// (activations freed in reverse, a gradient each, freed in the next step).
fn planned_steps<D: Device>(d: D, check: fn(&D) -> Result<(), wasmem::types::InvariantError>) {
    let mut a = Allocator::with_builtin(d, "planned").expect("builtin policy");
    let layers = 12u64;
    let mut grads: Vec<TensorId> = Vec::new();
    let mut calls_at = Vec::new();
    let tagged = |a: &mut Allocator<D>, bytes: u64, kind: TensorKind| {
        let id = a.alloc(bytes, kind, StreamId(0)).unwrap();
        let t = tag(id);
        a.write(id, 0, &t).unwrap();
        a.write(id, bytes - 8, &t).unwrap();
        id
    };
    let checked_free = |a: &mut Allocator<D>, id: TensorId| {
        let bytes = a.tensor(id).unwrap().bytes;
        let (mut head, mut tail) = ([0u8; 8], [0u8; 8]);
        a.read(id, 0, &mut head).unwrap();
        a.read(id, bytes - 8, &mut tail).unwrap();
        assert_eq!((head, tail), (tag(id), tag(id)), "the tags of {id:?} were overwritten");
        a.free(id).unwrap();
    };
    for step in 0..8u64 {
        let mut acts = Vec::new();
        for l in 0..layers {
            if l == 1 {
                for g in grads.drain(..) {
                    checked_free(&mut a, g);
                }
            }
            acts.push(tagged(&mut a, 2 * MIB + l * 64 * KIB, TensorKind::Activation));
            let t = tagged(&mut a, 700 * KIB, TensorKind::Temp);
            checked_free(&mut a, t);
        }
        for act in acts.into_iter().rev() {
            grads.push(tagged(&mut a, MIB + 4096, TensorKind::Grad));
            checked_free(&mut a, act);
        }
        a.phase(wasmem::types::Phase::StepEnd, step).unwrap();
        a.check_invariants().unwrap_or_else(|e| panic!("step {step}: {e}"));
        check(a.device()).unwrap_or_else(|e| panic!("step {step}: device: {e}"));
        calls_at.push(a.device().counters().alloc_calls + a.device().counters().free_calls);
    }
    let s = a.stats();
    assert!(s.plans >= 1 && s.plan_hits > 0 && s.plan_refused == 0, "{s:?}");
    let steady = &calls_at[calls_at.len() - 3..];
    assert!(steady.windows(2).all(|w| w[0] == w[1]), "device calls in the steady state: {calls_at:?}");
    for g in grads.drain(..) {
        checked_free(&mut a, g);
    }
    a.release_cached(&ReclaimDecision::all()).unwrap();
    a.check_invariants().unwrap();
    eprintln!(
        "planned over {}: {} plans, {} hits, {} misses, arena {} B, device calls per step {calls_at:?}",
        a.device().name(),
        s.plans,
        s.plan_hits,
        s.plan_misses,
        s.plan_arena_bytes
    );
}
