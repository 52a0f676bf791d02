//! Golden checks on the shared sample traces (`../../shared/traces` from
//! `host/`), skipped with a message when that folder is absent.

use std::path::PathBuf;
use std::time::Instant;

use wasmem::trace::{self, Event, TraceReader, TraceWriter};
use wasmem::types::TensorKind;

fn traces_dir() -> Option<PathBuf> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/traces");
    if dir.is_dir() {
        Some(dir)
    } else {
        eprintln!("skipping: {} does not exist", dir.display());
        None
    }
}

struct Counts {
    lines: u64,
    events: u64,
    allocs: u64,
    frees: u64,
    uses: u64,
    phases: u64,
    peak_live: u64,
    total_alloc: u64,
}

fn count(path: &std::path::Path) -> Counts {
    let reader = TraceReader::open(path).unwrap();
    let mut c = Counts { lines: 0, events: 0, allocs: 0, frees: 0, uses: 0, phases: 0, peak_live: 0, total_alloc: 0 };
    let mut live = rustc_hash::FxHashMap::default();
    let mut live_bytes = 0u64;
    let mut reader = reader;
    for event in &mut reader {
        let event = event.unwrap();
        c.events += 1;
        match event {
            Event::Alloc { id, bytes, .. } => {
                c.allocs += 1;
                c.total_alloc += bytes;
                live.insert(id, bytes);
                live_bytes += bytes;
                c.peak_live = c.peak_live.max(live_bytes);
            }
            Event::Free { id, .. } => {
                c.frees += 1;
                live_bytes -= live.remove(&id).expect("free of a live id");
            }
            Event::Use { id, .. } => {
                c.uses += 1;
                assert!(live.contains_key(&id));
            }
            Event::Phase { .. } => c.phases += 1,
        }
    }
    c.lines = reader.line();
    c
}

#[test]
fn gpt2_matches_readme() {
    let Some(dir) = traces_dir() else { return };
    let c = count(&dir.join("gpt2_124m.jsonl.gz"));
    // README: "16,363 events" counts every line, the header included.
    assert_eq!(c.lines, 16_363);
    assert_eq!(c.events, 16_362);
    assert_eq!(c.allocs, 3_391);
    assert_eq!((c.frees, c.uses, c.phases), (2_947, 10_012, 12));
    assert_eq!((c.peak_live as f64 / 1e9 * 100.0).round() / 100.0, 16.18);
    assert_eq!((c.total_alloc as f64 / 1e9 * 10.0).round() / 10.0, 130.2);
}

#[test]
fn bert_matches_readme() {
    let Some(dir) = traces_dir() else { return };
    let c = count(&dir.join("bert_base.jsonl.gz"));
    assert_eq!(c.lines, 18_348);
    assert_eq!(c.events, 18_347);
    assert_eq!(c.allocs, 3_399);
    assert_eq!((c.peak_live as f64 / 1e9 * 100.0).round() / 100.0, 18.50);
    assert_eq!((c.total_alloc as f64 / 1e9 * 10.0).round() / 10.0, 114.4);
}

#[test]
fn shared_traces_round_trip() {
    let Some(dir) = traces_dir() else { return };
    let tmp = std::env::temp_dir().join(format!("wasmem-golden-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    for name in ["gpt2_124m.jsonl.gz", "bert_base.jsonl.gz"] {
        let (header, events) = trace::read_file(dir.join(name)).unwrap();
        assert!(header.source.len() > 20);
        assert_eq!(header.ranks, 1);
        for out in ["rt.jsonl", "rt.jsonl.gz"] {
            let path = tmp.join(out);
            trace::write_file(&path, &header, &events).unwrap();
            let (h2, e2) = trace::read_file(&path).unwrap();
            assert_eq!(h2, header);
            assert_eq!(e2, events);
        }
    }
    std::fs::remove_dir_all(&tmp).unwrap();
}

/// Parse speed: `cargo test --release -p wasmem --test trace_golden -- --ignored --nocapture`.
#[test]
#[ignore = "measurement, prints events/s"]
fn parse_speed() {
    let Some(dir) = traces_dir() else { return };
    let path = dir.join("gpt2_124m.jsonl.gz");
    let (header, events) = trace::read_file(&path).unwrap();

    // 1. The shared file itself (gzip), read repeatedly.
    let rounds = 100;
    let start = Instant::now();
    let mut n = 0u64;
    for _ in 0..rounds {
        for e in TraceReader::open(&path).unwrap() {
            e.unwrap();
            n += 1;
        }
    }
    let s = start.elapsed().as_secs_f64();
    println!("gpt2_124m.jsonl.gz x{rounds}: {n} events in {s:.3} s = {:.2} M events/s (gzip)", n as f64 / s / 1e6);

    // 2. The same events from memory without gzip.
    let mut w = TraceWriter::new(Vec::new(), "mem", &header).unwrap();
    for e in &events {
        w.write(e).unwrap();
    }
    let plain = w.finish().unwrap();
    let start = Instant::now();
    let mut n = 0u64;
    for _ in 0..rounds {
        for e in TraceReader::new(&plain[..], "mem").unwrap() {
            e.unwrap();
            n += 1;
        }
    }
    let s = start.elapsed().as_secs_f64();
    println!("gpt2_124m plain, in memory x{rounds}: {n} events in {s:.3} s = {:.2} M events/s", n as f64 / s / 1e6);

    // 3. One long trace: the gpt2 events repeated 200 times with fresh ids
    //    (3.3 M events), written to a .jsonl.gz file and read back once.
    let tmp = std::env::temp_dir().join(format!("wasmem-speed-{}.jsonl.gz", std::process::id()));
    let mut w = TraceWriter::create(&tmp, &header).unwrap();
    let mut total = 0u64;
    let wstart = Instant::now();
    for r in 0..200u64 {
        let off = r * 10_000;
        for e in &events {
            let e = match *e {
                Event::Alloc { id, bytes, kind, stream, t_us } => {
                    Event::Alloc { id: id + off, bytes, kind, stream, t_us }
                }
                Event::Free { id, t_us } => Event::Free { id: id + off, t_us },
                Event::Use { id, stream } => Event::Use { id: id + off, stream },
                p => p,
            };
            w.write(&e).unwrap();
            total += 1;
        }
    }
    w.close().unwrap();
    let ws = wstart.elapsed().as_secs_f64();
    let start = Instant::now();
    let mut reader = TraceReader::open(&tmp).unwrap();
    let mut n = 0u64;
    let mut kinds = [0u64; 6];
    for e in &mut reader {
        if let Event::Alloc { kind, .. } = e.unwrap() {
            kinds[kind.index()] += 1;
        }
        n += 1;
    }
    let s = start.elapsed().as_secs_f64();
    assert_eq!(n, total);
    assert!(kinds[TensorKind::Param.index()] > 0);
    println!(
        "long trace ({n} events, {:.1} MB gz): write {:.2} M events/s, read {:.2} M events/s",
        std::fs::metadata(&tmp).unwrap().len() as f64 / 1e6,
        n as f64 / ws / 1e6,
        n as f64 / s / 1e6
    );
    std::fs::remove_file(&tmp).unwrap();
}
