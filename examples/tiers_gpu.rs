//! Tiers on a real GPU: tensors written on the device, evicted to host memory
//! and to spill files, brought back, and compared byte for byte.
//!
//! Run (a CUDA driver and GPU 0 needed; exits 3 without): `cargo run --release
//! --example tiers_gpu [COUNT] [MIB]` (default 24 tensors of 64 MiB; host tier
//! a quarter of them, the rest spill to disk). Prints one JSON line of results.

use std::time::Instant;

use wasmem::alloc::Allocator;
use wasmem::builtin;
use wasmem::device::cuda::CudaDevice;
use wasmem::tier::TierConfig;
use wasmem::types::{StreamId, TensorKind, Tier, MIB};

fn pattern(seed: u64, len: u64) -> Vec<u8> {
    (0..len).map(|i| (seed.wrapping_mul(0x9E37_79B9).wrapping_add(i.wrapping_mul(31)) >> 3) as u8).collect()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<u64> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let count = args.first().copied().unwrap_or(24);
    let bytes = args.get(1).copied().unwrap_or(64) * MIB;
    let dev = match CudaDevice::new(0) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("no GPU: {e}");
            std::process::exit(3);
        }
    };
    let mut a = Allocator::new(dev, builtin::by_name("lru").ok_or("lru")?);
    a.enable_tiers(TierConfig { host_capacity: count / 4 * bytes, copy_contents: true, ..TierConfig::default() });
    let mut ids = Vec::new();
    for k in 0..count {
        let id = a.alloc(bytes, TensorKind::Activation, StreamId(0))?;
        a.write(id, 0, &pattern(k, bytes))?;
        ids.push(id);
    }
    let t0 = Instant::now();
    a.evict(&ids)?;
    let evict_s = t0.elapsed().as_secs_f64();
    let on_disk = ids.iter().filter(|&&id| a.tier(id).ok() == Some(Tier::Disk)).count();
    let dir = a.tier_state().and_then(|t| t.disk.dir_path()).map(|p| p.to_path_buf());
    let files = dir.as_ref().map_or(0, |d| std::fs::read_dir(d).map_or(0, |r| r.count()));
    a.check_invariants()?;
    let t1 = Instant::now();
    let mut mismatches = 0;
    let mut out = vec![0u8; bytes as usize];
    for (k, &id) in ids.iter().enumerate() {
        a.read(id, 0, &mut out)?; // brings it back to the GPU first
        if out != pattern(k as u64, bytes) {
            mismatches += 1;
        }
    }
    let back_s = t1.elapsed().as_secs_f64();
    a.check_invariants()?;
    let ts = a.tier_stats();
    for id in ids {
        a.free(id)?;
    }
    drop(a);
    let dir_gone = dir.as_ref().is_none_or(|d| !d.exists());
    println!(
        "{{\"tensors\":{count},\"bytes_each\":{bytes},\"on_disk_after_evict\":{on_disk},\"spill_files\":{files},\
         \"mismatches\":{mismatches},\"evict_wall_s\":{evict_s:.3},\"bring_back_wall_s\":{back_s:.3},\
         \"evict_gbps\":{:.2},\"bring_back_gbps\":{:.2},\"peak_host_bytes\":{},\"peak_disk_bytes\":{},\
         \"spill_dir_removed\":{dir_gone}}}",
        (count * bytes) as f64 / evict_s / 1e9,
        (count * bytes) as f64 / back_s / 1e9,
        ts.peak_host_bytes,
        ts.peak_disk_bytes
    );
    if mismatches > 0 || !dir_gone {
        std::process::exit(1);
    }
    Ok(())
}
