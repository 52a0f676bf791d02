//! A replay exported as a PyTorch snapshot imports back to the same
//! allocation stream (sizes, kinds, order, which allocation each free ends).

use std::collections::HashMap;

use wasmem::builtin;
use wasmem::model::ModelSpec;
use wasmem::replay::{replay, snapshot_of, ReplayConfig};
use wasmem::synth::synth;
use wasmem::trace::snapshot::{export::export_bytes, import_bytes, ImportOptions};
use wasmem::trace::Event;

/// Alloc/free events with ids replaced by the index of their alloc.
fn normalize(events: &[Event]) -> Vec<(char, u64, String)> {
    let mut order = HashMap::new();
    let mut out = Vec::new();
    for e in events {
        match e {
            Event::Alloc { id, bytes, kind, .. } => {
                let n = order.len() as u64;
                order.insert(*id, n);
                out.push(('a', *bytes, format!("{n}:{kind}")));
            }
            Event::Free { id, .. } => out.push(('f', 0, order[id].to_string())),
            _ => {}
        }
    }
    out
}

#[test]
fn export_then_import_round_trips() {
    let spec = ModelSpec { layers: 2, steps: 2, seq: 128, batch: 2, ..ModelSpec::preset("gpt2-124m").unwrap() };
    let events = synth(&spec).unwrap();
    for policy in builtin::BUILTIN_NAMES {
        let cfg = ReplayConfig { record_actions: true, ..ReplayConfig::default() };
        let mut r =
            replay(events.iter().cloned().map(Ok::<_, String>), builtin::by_name(policy).unwrap(), &cfg).unwrap();
        let snap = snapshot_of(&mut r.allocator);
        assert!(!snap.segments.is_empty());
        let bytes = export_bytes(&snap).unwrap();
        let back = import_bytes(&bytes, "export", &ImportOptions::default()).unwrap();
        assert_eq!(back.info.synthesized_allocs, 0, "{policy}");
        assert_eq!(normalize(&back.events), normalize(&events), "{policy}: the event stream changed");
        assert_eq!(back.info.pytorch_reserved_bytes_end, r.allocator.gauges().reserved_bytes, "{policy}");
        assert_eq!(back.info.pytorch_peak_reserved_bytes, r.metrics.peak_reserved_bytes, "{policy}");
    }
}
