//! Checks the NCCL communicator on real GPUs: run one process per GPU with the
//! usual launcher environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
//! MASTER_PORT), e.g. `RANK=0 WORLD_SIZE=1 cargo run --release --example nccl_check`.
//! Exits 0 when every collective gives the expected values, 1 when one fails or
//! gives a wrong value, 2 on a bad launcher environment, 3 without NCCL.

use std::time::{Duration, Instant};

use wasmem::comm::nccl::{nccl_present, Launch, NcclComm, NCCL_MISSING};
use wasmem::comm::{CommError, Communicator};

fn main() {
    let launch = match Launch::from_env() {
        Ok(l) => l,
        Err(e) => {
            eprintln!("nccl_check: {e}");
            std::process::exit(2);
        }
    };
    if !nccl_present() {
        eprintln!("nccl_check: {NCCL_MISSING}");
        std::process::exit(3);
    }
    let mut c = match NcclComm::new(&launch, Duration::from_secs(60)) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("nccl_check: {e}");
            std::process::exit(1);
        }
    };
    match check(&mut c) {
        Ok(true) => std::process::exit(0),
        Ok(false) => std::process::exit(1),
        Err(e) => {
            eprintln!("nccl_check: rank {}: {e}", c.rank());
            std::process::exit(1);
        }
    }
}

/// Runs every collective once with known values (and one large all-reduce
/// for a timing); `Ok(false)` when a value is wrong.
fn check(c: &mut NcclComm) -> Result<bool, CommError> {
    let (r, n) = (c.rank() as f32, c.world_size());
    let total: f32 = (0..n).map(|i| i as f32).sum();
    let mut ok = true;
    let mut report = |what: &str, good: bool| {
        println!("rank {r}: {what}: {}", if good { "ok" } else { "WRONG" });
        ok &= good;
    };
    let mut buf = vec![r; 1 << 20];
    c.all_reduce_sum(&mut buf)?;
    report("all_reduce_sum", buf.iter().all(|&x| x == total));
    let mut gathered = vec![0.0; 4 * n];
    c.all_gather(&[r; 4], &mut gathered)?;
    report("all_gather", (0..n).all(|i| gathered[4 * i..4 * i + 4].iter().all(|&x| x == i as f32)));
    let mut part = vec![0.0; 8];
    c.reduce_scatter_sum(&vec![1.0; 8 * n], &mut part)?;
    report("reduce_scatter_sum", part.iter().all(|&x| x == n as f32));
    let mut b = vec![r + 10.0; 16];
    c.broadcast(&mut b, 0)?;
    report("broadcast", b.iter().all(|&x| x == 10.0));
    c.barrier()?;
    let t = Instant::now();
    let mut big = vec![1.0f32; 64 << 20];
    c.all_reduce_sum(&mut big)?;
    report("all_reduce_sum 256 MiB", big.iter().all(|&x| x == n as f32));
    println!(
        "rank {r}: all_reduce of 256 MiB (host buffers, copies included): {:.1} ms",
        t.elapsed().as_secs_f64() * 1e3
    );
    println!("rank {r}: bytes sent (ring model): {}", c.bytes_sent());
    Ok(ok)
}
