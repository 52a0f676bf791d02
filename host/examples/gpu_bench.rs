//! GPU check benchmark (run by `scripts/gpu-check.sh` on a machine with a GPU).
//!
//! Measures on the real device, median over many samples:
//! - (a) a raw `cuMemAlloc` + `cuMemFree` pair through [`CudaDevice`];
//! - (b) an alloc + free pair through a warmed `Allocator<CudaDevice>` with
//!   the built-in `pytorch` policy (served from cache: no driver call);
//! - the ratio b/a (goal: the cache at least 10× faster);
//! - (c) per physical page: `cuMemCreate` + `cuMemMap` + `cuMemSetAccess`,
//!   and `cuMemUnmap` + `cuMemRelease`.
//!
//! Prints one table; writes it as JSON to `$OUT/gpu-check.json` when `OUT` is
//! set (or to the path after `--json`).
//!
//! ```text
//! gpu_bench            # full run (a few seconds)
//! gpu_bench --quick    # fewer samples
//! gpu_bench --probe    # only open the device and describe it (exit 3 if none)
//! ```

use std::hint::black_box;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use serde_json::json;
use wasmem::alloc::Allocator;
use wasmem::device::cuda::CudaDevice;
use wasmem::device::Device;
use wasmem::types::{StreamId, TensorKind, GIB, KIB, MIB};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        f64::NAN
    } else if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn us(t0: Instant) -> f64 {
    t0.elapsed().as_secs_f64() * 1e6
}

fn label(bytes: u64) -> String {
    if bytes >= MIB {
        format!("{} MiB", bytes / MIB)
    } else {
        format!("{} KiB", bytes / KIB)
    }
}

/// (a): median µs of alloc+free pairs straight from the driver, and of each half.
fn raw_pair(d: &mut CudaDevice, bytes: u64, samples: usize) -> Result<(f64, f64, f64), String> {
    let err = |e| format!("raw {bytes}: {e}");
    for _ in 0..5 {
        let p = d.alloc_segment(bytes).map_err(err)?;
        d.free_segment(p).map_err(err)?;
    }
    let (mut pair, mut alloc, mut free) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..samples {
        let t0 = Instant::now();
        let p = d.alloc_segment(black_box(bytes)).map_err(err)?;
        let t1 = us(t0);
        let t2 = Instant::now();
        d.free_segment(black_box(p)).map_err(err)?;
        let t3 = us(t2);
        pair.push(us(t0));
        alloc.push(t1);
        free.push(t3);
    }
    Ok((median(pair), median(alloc), median(free)))
}

/// (b): median µs per cached alloc+free pair (batches of `batch` pairs), and
/// the number of driver allocations made while measuring (should be 0).
fn cached_pair(a: &mut Allocator<CudaDevice>, bytes: u64, batches: usize, batch: usize) -> Result<(f64, u64), String> {
    let err = |e| format!("cached {bytes}: {e}");
    // Warm: the first request grows a segment, the rest hit the cache.
    for _ in 0..3 {
        let id = a.alloc(bytes, TensorKind::Temp, StreamId(0)).map_err(err)?;
        a.free(id).map_err(err)?;
    }
    let calls_before = a.device().counters().alloc_calls;
    let mut per_pair = Vec::with_capacity(batches);
    for _ in 0..batches {
        let t0 = Instant::now();
        for _ in 0..batch {
            let id = a.alloc(black_box(bytes), TensorKind::Temp, StreamId(0)).map_err(err)?;
            a.free(black_box(id)).map_err(err)?;
        }
        per_pair.push(us(t0) / batch as f64);
    }
    Ok((median(per_pair), a.device().counters().alloc_calls - calls_before))
}

/// (c): median µs of create+map+access and of unmap+release for one page of `g` bytes.
fn vmm_page(d: &mut CudaDevice, samples: usize) -> Result<(f64, f64), String> {
    let g = d.granularity();
    let err = |e| format!("vmm: {e}");
    let va = d.reserve_virtual(g).map_err(err)?;
    let (mut map_in, mut map_out) = (Vec::new(), Vec::new());
    for i in 0..samples + 5 {
        let t0 = Instant::now();
        let p = d.create_physical(g).map_err(err)?;
        d.map(va, p).map_err(err)?;
        let t1 = us(t0);
        let t2 = Instant::now();
        d.unmap(va).map_err(err)?;
        d.release_physical(p).map_err(err)?;
        let t3 = us(t2);
        if i >= 5 {
            map_in.push(t1);
            map_out.push(t3);
        }
    }
    d.release_virtual(va).map_err(err)?;
    Ok((median(map_in), median(map_out)))
}

fn run(quick: bool, json_path: Option<PathBuf>) -> Result<(), String> {
    let mut raw_dev = CudaDevice::new(0).map_err(|e| e.to_string())?;
    let name = raw_dev.device_name().to_string();
    let driver = raw_dev.driver_version();
    let total = raw_dev.capacity();
    let g = raw_dev.granularity();
    println!(
        "wasmem gpu-check: {name}, CUDA driver {}.{}, {:.1} GiB, VMM granularity {} KiB",
        driver / 1000,
        (driver % 1000) / 10,
        total as f64 / GIB as f64,
        g / KIB
    );

    let mut alloc = Allocator::with_builtin(CudaDevice::new(0).map_err(|e| e.to_string())?, "pytorch")
        .ok_or("no builtin pytorch policy")?;
    // Background population so the pools are not trivially empty.
    let keep: Vec<_> = (0..64u64)
        .map(|i| alloc.alloc(512 + i * 4096, TensorKind::Activation, StreamId(0)))
        .collect::<Result<_, _>>()
        .map_err(|e| e.to_string())?;

    let sizes = [4 * KIB, 8 * MIB, 256 * MIB];
    let (batches, batch) = if quick { (11, 200) } else { (31, 1000) };
    let mut rows = Vec::new();
    println!();
    println!(
        "{:>8} | {:>16} {:>10} {:>10} | {:>14} | {:>9} {:>8} | goal >= 10x",
        "size", "a: raw pair us", "alloc us", "free us", "b: cached us", "b/a", "a/b"
    );
    println!("{}", "-".repeat(102));
    for &bytes in &sizes {
        let samples = match (quick, bytes >= 64 * MIB) {
            (true, _) => 30,
            (false, true) => 100,
            (false, false) => 300,
        };
        let (a_pair, a_alloc, a_free) = raw_pair(&mut raw_dev, bytes, samples)?;
        let (b_pair, driver_calls) = cached_pair(&mut alloc, bytes, batches, batch)?;
        let speedup = a_pair / b_pair;
        let met = speedup >= 10.0 && driver_calls == 0;
        println!(
            "{:>8} | {:>16.2} {:>10.2} {:>10.2} | {:>14.4} | {:>9.2e} {:>8.0} | {}",
            label(bytes),
            a_pair,
            a_alloc,
            a_free,
            b_pair,
            b_pair / a_pair,
            speedup,
            if met { "yes" } else { "NO" }
        );
        rows.push(json!({
            "bytes": bytes,
            "label": label(bytes),
            "raw_pair_median_us": a_pair,
            "raw_alloc_median_us": a_alloc,
            "raw_free_median_us": a_free,
            "raw_samples": samples,
            "cached_pair_median_us": b_pair,
            "cached_batches": batches,
            "cached_batch_pairs": batch,
            "cached_driver_allocs_while_measuring": driver_calls,
            "cached_over_raw": b_pair / a_pair,
            "speedup": speedup,
            "goal_10x_met": met,
        }));
    }

    let vmm = if raw_dev.supports_vmm() {
        let samples = if quick { 30 } else { 200 };
        println!();
        // A VMM failure (e.g. a sandbox without the VMM ioctls) is reported, not fatal.
        match vmm_page(&mut raw_dev, samples) {
            Ok((map_in, map_out)) => {
                println!(
                    "VMM per {} KiB page: create+map+setAccess {map_in:.2} us, unmap+release {map_out:.2} us, \
                     total {:.2} us (median of {samples})",
                    g / KIB,
                    map_in + map_out
                );
                json!({
                    "page_bytes": g,
                    "create_map_access_median_us": map_in,
                    "unmap_release_median_us": map_out,
                    "total_median_us": map_in + map_out,
                    "samples": samples,
                })
            }
            Err(e) => {
                println!("VMM per page: FAILED: {e}");
                json!({ "page_bytes": g, "error": e })
            }
        }
    } else {
        println!("\nVMM: not supported by this device");
        serde_json::Value::Null
    };

    for id in keep {
        alloc.free(id).map_err(|e| e.to_string())?;
    }
    let counters = alloc.device().counters();
    let all_met = rows.iter().all(|r| r["goal_10x_met"] == json!(true));
    println!();
    println!("goal (cached >= 10x faster than raw, at every size): {}", if all_met { "met" } else { "NOT met" });
    let report = json!({
        "device": name,
        "driver_version": driver,
        "total_bytes": total,
        "granularity_bytes": g,
        "quick": quick,
        "pairs": rows,
        "vmm_page": vmm,
        "goal_10x_met": all_met,
        "allocator_device_counters": {
            "alloc_calls": counters.alloc_calls,
            "free_calls": counters.free_calls,
            "syncs": counters.syncs,
            "time_us": counters.time_us,
        },
    });
    if let Some(path) = json_path {
        let text = serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?;
        std::fs::write(&path, text + "\n").map_err(|e| format!("writing {}: {e}", path.display()))?;
        println!("wrote {}", path.display());
    }
    raw_dev.close().map_err(|e| e.to_string())?;
    Ok(())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let quick = args.iter().any(|a| a == "--quick");
    let probe = args.iter().any(|a| a == "--probe");
    let json_path =
        args.iter().position(|a| a == "--json").and_then(|i| args.get(i + 1)).map(PathBuf::from).or_else(|| {
            std::env::var_os("OUT").filter(|o| !o.is_empty()).map(|o| PathBuf::from(o).join("gpu-check.json"))
        });
    if probe {
        return match CudaDevice::new(0) {
            Ok(d) => {
                println!(
                    "CUDA device 0: {}, driver {}, {} bytes, VMM {}",
                    d.device_name(),
                    d.driver_version(),
                    d.capacity(),
                    if d.supports_vmm() { "supported" } else { "unsupported" }
                );
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("gpu_bench: {e}");
                ExitCode::from(3)
            }
        };
    }
    match run(quick, json_path) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gpu_bench: {e}");
            ExitCode::from(1)
        }
    }
}
