//! Measurement (ignored by default): overhead with compaction on the shared
//! traces. `cargo test --release --test defrag_measure -- --ignored --nocapture`.

use std::path::PathBuf;

use wasmem::builtin::{self, PytorchReclamation};
use wasmem::decision::{PolicyContext, PolicyError, ReclaimDecision, ReclaimTrigger, ReclamationPolicy};
use wasmem::replay::{replay, Metrics, ReplayConfig};
use wasmem::trace::snapshot::{import_file, ImportOptions};
use wasmem::trace::TraceReader;
use wasmem::types::MIB;

/// PyTorch's reclamation plus a compaction of the `large` pool (budget
/// `budget` bytes) before every growth.
struct CompactBeforeGrow(u64);

impl ReclamationPolicy for CompactBeforeGrow {
    fn name(&self) -> &str {
        "compact-before-grow"
    }
    fn reclaim(&mut self, t: &ReclaimTrigger, ctx: &PolicyContext) -> Result<ReclaimDecision, PolicyError> {
        let mut d = PytorchReclamation.reclaim(t, ctx)?;
        if let ReclaimTrigger::Grow { .. } = t {
            d.compact = Some(("large".into(), self.0.min(ctx.allocated_bytes / 2)));
            // Release what compaction empties, up to the segment about to be obtained.
            d.release_bytes = d.release_bytes.max(1);
        }
        Ok(d)
    }
}

fn run(name: &str, events: Vec<wasmem::trace::Event>, budget: Option<u64>) -> Metrics {
    let mut p = builtin::by_name("pytorch").unwrap();
    if let Some(b) = budget {
        p.reclamation = Box::new(CompactBeforeGrow(b));
    }
    let r = replay(events.into_iter().map(Ok::<_, String>), p, &ReplayConfig::default()).unwrap();
    r.allocator.check_invariants().unwrap_or_else(|e| panic!("{name}: {e}"));
    r.metrics
}

#[test]
#[ignore]
fn overhead_with_compaction() {
    let d = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/traces");
    let Ok(rd) = std::fs::read_dir(&d) else { return };
    let mut paths: Vec<_> = rd.map(|e| e.unwrap().path()).collect();
    paths.sort();
    for path in paths {
        let s = path.to_string_lossy().to_string();
        let events: Vec<_> = if s.ends_with(".jsonl.gz") {
            TraceReader::open(&path).unwrap().map(|e| e.unwrap()).collect()
        } else if s.ends_with(".pickle") {
            import_file(&path, &ImportOptions::default()).unwrap().events
        } else {
            continue;
        };
        for budget in [None, Some(64 * MIB), Some(1024 * MIB)] {
            let m = run(&s, events.clone(), budget);
            println!(
                "{:28} budget {:>10?} ratio {:.4} moved {} device frees {} syncs {} gc pauses {} p50 {:.0} p99 {:.0} max {:.0} us fallbacks {}",
                path.file_name().unwrap().to_string_lossy(),
                budget.map(|b| b / MIB),
                m.overhead_ratio,
                m.moved_bytes,
                m.device_free_calls,
                m.device_syncs,
                m.gc_pauses,
                m.gc_pause_us_p50,
                m.gc_pause_us_p99,
                m.gc_pause_us_max,
                m.policy_fallbacks
            );
        }
    }
}

/// Stitching and trimming (paged segments) against the segment-based
/// built-ins: `cargo test --release --test defrag_measure -- --ignored --nocapture stitching`.
#[test]
#[ignore]
fn overhead_with_stitching() {
    let d = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/traces");
    let Ok(rd) = std::fs::read_dir(&d) else { return };
    let mut paths: Vec<_> = rd.map(|e| e.unwrap().path()).collect();
    paths.sort();
    for path in paths {
        let s = path.to_string_lossy().to_string();
        let events: Vec<_> = if s.ends_with(".jsonl.gz") {
            TraceReader::open(&path).unwrap().map(|e| e.unwrap()).collect()
        } else if s.ends_with(".pickle") {
            import_file(&path, &ImportOptions::default()).unwrap().events
        } else {
            continue;
        };
        let with = |placement: &str, r: builtin::DefragReclamation| {
            let mut p = builtin::by_name(placement).unwrap();
            p.reclamation = Box::new(r);
            p
        };
        let d = builtin::DefragReclamation::default();
        let variants: Vec<(&str, wasmem::decision::Policies)> = vec![
            ("pytorch", builtin::by_name("pytorch").unwrap()),
            ("lifecycle", builtin::by_name("lifecycle").unwrap()),
            ("defrag", builtin::by_name("defrag").unwrap()),
            ("lc+d notrim", with("lifecycle", builtin::DefragReclamation { keep_fraction: 1.0, ..d })),
            (
                "lc+d notrim rel",
                with("lifecycle", builtin::DefragReclamation { keep_fraction: 1.0, release_others: true, ..d }),
            ),
            ("pt+d notrim", with("pytorch", builtin::DefragReclamation { keep_fraction: 1.0, ..d })),
            ("pt+d trim", with("pytorch", d)),
        ];
        for (name, p) in variants {
            let r = replay(events.clone().into_iter().map(Ok::<_, String>), p, &ReplayConfig::default()).unwrap();
            r.allocator.check_invariants().unwrap_or_else(|e| panic!("{s} {name}: {e}"));
            let st = r.allocator.stats();
            let m = r.metrics;
            println!(
                "{:28} {:22} ratio {:.4} dev allocs {} frees {} syncs {} stitches {} stitched {} MiB trimmed {} MiB p99 {:.0} us",
                path.file_name().unwrap().to_string_lossy(),
                name,
                m.overhead_ratio,
                m.device_alloc_calls,
                m.device_free_calls,
                m.device_syncs,
                st.stitches,
                st.stitched_bytes / MIB,
                st.trimmed_bytes / MIB,
                m.gc_pause_us_p99,
            );
        }
    }
}
