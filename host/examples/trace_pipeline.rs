//! Throughput of the replay pipeline on a large synthesized trace.
use std::io::Read;
use std::time::Instant;

use wasmem::trace::TraceReader;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let path = &args[1];
    let t = Instant::now();
    let f = std::fs::File::open(path).unwrap();
    let mut d = flate2::read::MultiGzDecoder::new(std::io::BufReader::with_capacity(1 << 16, f));
    let mut buf = vec![0u8; 1 << 16];
    let mut n = 0usize;
    loop {
        let k = d.read(&mut buf).unwrap();
        if k == 0 {
            break;
        }
        n += k;
    }
    let s = t.elapsed().as_secs_f64();
    println!("gunzip: {n} bytes {s:.3} s {:.0} MB/s", n as f64 / s / 1e6);
    let modes: Vec<bool> = if args.len() > 2 { vec![true] } else { vec![false, true] };
    for fast in modes {
        let t = Instant::now();
        let mut r = TraceReader::open(path).unwrap();
        r.set_fast_path(fast);
        let mut c = 0u64;
        for e in r {
            e.unwrap();
            c += 1;
        }
        let s = t.elapsed().as_secs_f64();
        println!("parse fast={fast}: {c} events {s:.3} s {:.2} M/s", c as f64 / s / 1e6);
    }
}
