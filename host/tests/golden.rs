//! Golden tests on the shared sample traces (`../shared/traces`), skipped
//! with a message when the folder is absent.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;

use wasmem::builtin;
use wasmem::replay::{replay, Metrics, ReplayConfig};
use wasmem::trace::snapshot::{import_file, ImportOptions};
use wasmem::trace::{Event, TraceReader};

fn traces_dir() -> Option<PathBuf> {
    let d = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/traces");
    if d.is_dir() {
        Some(d)
    } else {
        eprintln!("skipping: {} not found", d.display());
        None
    }
}

fn traces() -> Vec<PathBuf> {
    let Some(d) = traces_dir() else { return vec![] };
    let mut v: Vec<PathBuf> = std::fs::read_dir(d)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().ends_with(".jsonl.gz"))
        .collect();
    v.sort();
    v
}

/// Independent recount straight from the JSON: (peak live bytes, peak of live
/// bytes rounded up to 512 per tensor).
fn recount(path: &PathBuf) -> (u64, u64) {
    let f = std::fs::File::open(path).unwrap();
    let r = BufReader::new(flate2::read::GzDecoder::new(f));
    let mut live = std::collections::HashMap::new();
    let (mut cur, mut cur_r, mut peak, mut peak_r) = (0u64, 0u64, 0u64, 0u64);
    for line in r.lines().skip(1) {
        let v: serde_json::Value = serde_json::from_str(&line.unwrap()).unwrap();
        match v["op"].as_str().unwrap() {
            "alloc" => {
                let b = v["bytes"].as_u64().unwrap();
                live.insert(v["id"].as_u64().unwrap(), b);
                cur += b;
                cur_r += b.div_ceil(512) * 512;
                peak = peak.max(cur);
                peak_r = peak_r.max(cur_r);
            }
            "free" => {
                let b = live.remove(&v["id"].as_u64().unwrap()).unwrap();
                cur -= b;
                cur_r -= b.div_ceil(512) * 512;
            }
            _ => {}
        }
    }
    (peak, peak_r)
}

fn run(path: &PathBuf, policy: &str) -> Metrics {
    let r = TraceReader::open(path).unwrap();
    let rep = replay(r, builtin::by_name(policy).unwrap(), &ReplayConfig::default()).unwrap();
    rep.allocator.check_invariants().unwrap();
    rep.metrics
}

/// A replay of events in memory under the built-in `policy`, invariants checked.
fn run_events(events: &[Event], policy: &str) -> Metrics {
    let ev = events.iter().map(|e| Ok::<_, String>(*e));
    let r = replay(ev, builtin::by_name(policy).unwrap(), &ReplayConfig::default()).unwrap();
    r.allocator.check_invariants().unwrap();
    r.metrics
}

#[test]
fn peaks_and_policy_ordering() {
    for t in traces() {
        let (peak, peak_rounded) = recount(&t);
        let naive = run(&t, "naive");
        let pytorch = run(&t, "pytorch");
        let lifecycle = run(&t, "lifecycle");
        let name = t.file_name().unwrap().to_string_lossy().to_string();
        for (p, m) in [("naive", &naive), ("pytorch", &pytorch), ("lifecycle", &lifecycle)] {
            eprintln!(
                "{name} {p:>10}: peak live {} reserved {} ratio {:.4} device allocs {} frees {}",
                m.peak_live_bytes, m.peak_reserved_bytes, m.overhead_ratio, m.device_alloc_calls, m.device_free_calls
            );
            assert_eq!(m.peak_live_bytes, peak, "{name}/{p}: peak live differs from the recount");
            assert_eq!(m.ooms, 0);
        }
        assert_eq!(naive.peak_reserved_bytes, peak_rounded, "{name}: naive reserves exactly the rounded live bytes");
        assert_eq!(naive.device_alloc_calls, naive.allocs);
        assert!(
            lifecycle.peak_reserved_bytes <= pytorch.peak_reserved_bytes,
            "{name}: lifecycle {} > pytorch {}",
            lifecycle.peak_reserved_bytes,
            pytorch.peak_reserved_bytes
        );
    }
}

#[test]
fn replays_are_deterministic() {
    for t in traces() {
        for p in builtin::BUILTIN_NAMES {
            let mut a = run(&t, p);
            let mut b = run(&t, p);
            for m in [&mut a, &mut b] {
                m.clear_timing();
            }
            assert_eq!(a, b, "{p} on {}", t.display());
        }
    }
}

#[test]
fn pytorch_snapshots_lifecycle_not_worse() {
    let Some(d) = traces_dir() else { return };
    for name in ["pytorch-snapshot-a.pickle", "pytorch-snapshot-b.pickle"] {
        let p = d.join(name);
        if !p.exists() {
            eprintln!("skipping: {} not found", p.display());
            continue;
        }
        let snap = import_file(&p, &ImportOptions::default()).unwrap();
        let run = |policy: &str| run_events(&snap.events, policy);
        let (naive, pytorch, lifecycle) = (run("naive"), run("pytorch"), run("lifecycle"));
        eprintln!(
            "{name}: live {} naive {} pytorch {} lifecycle {} (PyTorch recorded {})",
            naive.peak_live_bytes,
            naive.peak_reserved_bytes,
            pytorch.peak_reserved_bytes,
            lifecycle.peak_reserved_bytes,
            snap.info.pytorch_reserved_bytes_end
        );
        assert!(naive.peak_reserved_bytes >= naive.peak_live_bytes);
        assert!(lifecycle.peak_reserved_bytes <= pytorch.peak_reserved_bytes, "{name}");
    }
}

/// Issue 5's goals for the built-in `defrag` set on every shared workload
/// (traces and PyTorch snapshots): overhead ≤ 1.02, no device-wide
/// synchronization, reclamation pauses p99 ≤ 1 ms, defragmentation traffic
/// ≤ 5 % of the bytes allocated; and never worse than `pytorch`.
#[test]
fn defrag_meets_the_fragmentation_goals() {
    let Some(d) = traces_dir() else { return };
    let mut paths: Vec<PathBuf> = std::fs::read_dir(d).unwrap().map(|e| e.unwrap().path()).collect();
    paths.sort();
    for p in paths {
        let s = p.to_string_lossy().to_string();
        let events: Vec<_> = if s.ends_with(".jsonl.gz") {
            TraceReader::open(&p).unwrap().map(|e| e.unwrap()).collect()
        } else if s.ends_with(".pickle") {
            import_file(&p, &ImportOptions::default()).unwrap().events
        } else {
            continue;
        };
        let run = |policy: &str| run_events(&events, policy);
        let (pt, m) = (run("pytorch"), run("defrag"));
        eprintln!(
            "{s}: defrag ratio {:.4} (pytorch {:.4}) syncs {} p99 {:.0} us moved {:.4} stitched {}",
            m.overhead_ratio, pt.overhead_ratio, m.device_syncs, m.gc_pause_us_p99, m.moved_fraction, m.stitched_bytes
        );
        assert!(m.overhead_ratio <= 1.02, "{s}: overhead {}", m.overhead_ratio);
        assert!(m.peak_reserved_bytes <= pt.peak_reserved_bytes, "{s}: worse than pytorch");
        assert_eq!((m.device_syncs, m.ooms), (0, 0), "{s}");
        assert!(m.gc_pause_us_p99 <= 1000.0, "{s}: p99 pause {} us", m.gc_pause_us_p99);
        assert!(m.moved_fraction <= 0.05, "{s}: moved {}", m.moved_fraction);
    }
}

/// Models of a few MiB: `defrag` and `planned` scale their growth chunks to
/// the footprint, so each lifecycle pool does not start with a 20 MiB chunk
/// (a tiny model with SGD reserved 24 MiB for 5.2 MB live, 4.8× where
/// `pytorch` needs 1.2×). The planned cold run is never worse than `defrag`.
/// What remains above `pytorch` on some of them is a page or two per
/// lifecycle pool.
#[test]
fn small_models_reserve_near_their_footprint() {
    use wasmem::model::{ModelSpec, Optimizer};
    use wasmem::synth::synth;
    let tiny = ModelSpec::preset("tiny").unwrap();
    let specs = [
        ModelSpec { steps: 5, ..tiny.clone() },
        ModelSpec { layers: 5, optimizer: Optimizer::Sgd, checkpointing: true, steps: 9, ..tiny.clone() },
        ModelSpec { layers: 2, checkpointing: true, steps: 3, ..tiny.clone() },
        ModelSpec { layers: 1, dtype_bytes: 2, steps: 5, ..tiny },
    ];
    for (i, spec) in specs.iter().enumerate() {
        let events = synth(spec).unwrap();
        let run = |policy: &str| run_events(&events, policy);
        let (pt, d, p) = (run("pytorch"), run("defrag"), run("planned"));
        eprintln!(
            "tiny #{i}: live {} pytorch {:.4} defrag {:.4} planned {:.4}",
            d.peak_live_bytes, pt.overhead_ratio, d.overhead_ratio, p.overhead_ratio
        );
        // Before the scaled chunks: 4.82×, 2.90×, 5.16× (1.20×, 1.21×, 1.29× for pytorch).
        assert!(d.overhead_ratio <= 1.8, "tiny #{i}: defrag {:.4}", d.overhead_ratio);
        assert!(p.peak_reserved_bytes <= d.peak_reserved_bytes, "tiny #{i}: planned above defrag");
        if i == 1 || i == 2 {
            assert!(d.peak_reserved_bytes <= pt.peak_reserved_bytes, "tiny #{i}: defrag above pytorch");
        }
    }
}
