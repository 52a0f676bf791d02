//! `wasmem synth` against the recorded traces: for the configuration each
//! trace was recorded with, the synthesized `peak_live_bytes` is within 10 %.

use std::path::PathBuf;

use wasmem::builtin;
use wasmem::model::ModelSpec;
use wasmem::replay::{replay, ReplayConfig};
use wasmem::synth::synth;
use wasmem::trace::TraceReader;

fn peak_live(events: impl IntoIterator<Item = Result<wasmem::trace::Event, String>>) -> u64 {
    replay(events, builtin::by_name("naive").expect("built-in"), &ReplayConfig::default())
        .expect("replay")
        .metrics
        .peak_live_bytes
}

#[test]
fn presets_match_recorded_traces() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/traces");
    // (trace, preset): the presets describe the recorded runs (see the traces' headers).
    for (file, preset) in [("gpt2_124m.jsonl.gz", "gpt2-124m"), ("bert_base.jsonl.gz", "bert-base")] {
        let p = dir.join(file);
        if !p.exists() {
            eprintln!("skipping {}: not found", p.display());
            continue;
        }
        let recorded = peak_live(TraceReader::open(&p).expect("trace").map(|e| e.map_err(|e| e.to_string())));
        let spec = ModelSpec::preset(preset).expect("preset");
        let synthesized = peak_live(synth(&spec).expect("valid").into_iter().map(Ok));
        let rel = (synthesized as f64 - recorded as f64) / recorded as f64;
        eprintln!("{preset}: synthesized peak live {synthesized}, recorded {recorded} ({:+.1} %)", rel * 100.0);
        assert!(rel.abs() <= 0.10, "{preset}: {:+.1} % off the recorded trace", rel * 100.0);
    }
}

#[test]
fn checkpointing_and_mixed_precision_shrink_the_peak() {
    let base = ModelSpec { steps: 2, ..ModelSpec::preset("llama-1b").expect("preset") };
    let live = |s: &ModelSpec| peak_live(synth(s).expect("valid").into_iter().map(Ok));
    let plain = live(&base);
    let ckpt = live(&ModelSpec { checkpointing: true, ..base.clone() });
    // Model states (≈ 16 bytes per parameter) and the logits stay; the layers' activations go.
    assert!((ckpt as f64) < plain as f64 * 0.8, "checkpointing: {ckpt} vs {plain}");
    let sgd = live(&ModelSpec { optimizer: wasmem::model::Optimizer::Sgd, ..base.clone() });
    assert!(sgd < plain, "no optimizer state: {sgd} vs {plain}");
}
