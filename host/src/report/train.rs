//! The training report: one line (or JSON object) per step as the run goes,
//! then the summary — memory saved against ZeRO stage 0, per policy phase,
//! and the shadow beside the primary.

use std::fmt::Write;

use serde_json::{json, Value};

use crate::train::session::{StepView, TrainOutcome};
use crate::train::RankStep;
use crate::types::human_bytes;

/// One line of per-rank figures: a single value when all ranks agree.
fn per_rank(v: &[u64]) -> String {
    if v.is_empty() {
        return String::new();
    }
    if v.windows(2).all(|w| w[0] == w[1]) {
        format!("{}{}", human_bytes(v[0]), if v.len() > 1 { format!(" ×{}", v.len()) } else { String::new() })
    } else {
        v.iter().map(|&b| human_bytes(b)).collect::<Vec<_>>().join(" / ")
    }
}

/// "−40.0 %, 4.00 MiB saved" or "+20.0 %, more".
fn change(from: u64, to: u64) -> String {
    let p = saved(from, to);
    if p >= 0.0 {
        format!("−{p:.1} %, {} saved", human_bytes(from - to))
    } else {
        format!("+{:.1} %, more", -p)
    }
}

/// Percent saved going from `from` to `to` bytes.
fn saved(from: u64, to: u64) -> f64 {
    if from == 0 {
        0.0
    } else {
        100.0 * (1.0 - to as f64 / from as f64)
    }
}

/// The text line of a step.
pub fn step_text(v: &StepView<'_>) -> String {
    let r = v.report;
    let col = |f: fn(&RankStep) -> u64| r.ranks.iter().map(f).collect::<Vec<_>>();
    let host = col(|x| x.host_state_bytes);
    let host = if host.iter().any(|&h| h > 0) { format!(" (+{} host)", per_rank(&host)) } else { String::new() };
    let mut l = format!(
        "step {:>4}  loss {:.4}  model states/rank {}{}  peak reserved/rank {}  comm/rank {}",
        r.step,
        r.loss,
        per_rank(&col(|x| x.model_state_bytes)),
        host,
        per_rank(&col(|x| x.peak_reserved_bytes)),
        per_rank(&col(|x| x.comm_bytes)),
    );
    if !v.shadow_peaks.is_empty() {
        let _ = write!(l, "  shadow peak/rank {}", per_rank(&v.shadow_peaks));
    }
    if let Some(to) = v.swapped_to {
        let _ = write!(l, "  ← policy swapped to {to}");
    }
    l
}

/// The JSON object of a step (`"event": "step"`).
pub fn step_json(v: &StepView<'_>) -> Value {
    let mut j = serde_json::to_value(v.report).unwrap_or_default();
    j["event"] = "step".into();
    if !v.shadow_peaks.is_empty() {
        j["shadow_peak_reserved_bytes"] = v.shadow_peaks.clone().into();
    }
    j
}

/// The summary object (`"event": "summary"`).
pub fn summary_json(o: &TrainOutcome) -> Value {
    let cfg = &o.options.config;
    let states = o.max_last(|r| r.model_state_bytes);
    let phases: Vec<Value> = o
        .phases
        .iter()
        .map(|p| {
            json!({
                "policy": p.policy, "steps": [p.from, p.to], "peak_reserved_bytes": p.peak_reserved_bytes,
                "stage0_peak_reserved_bytes": p.stage0_peak_reserved_bytes,
                "peak_reserved_saved_percent": saved(p.stage0_peak_reserved_bytes, p.peak_reserved_bytes),
            })
        })
        .collect();
    let mut summary = json!({
        "event": "summary",
        "parameters": o.result.parameters,
        "stage": cfg.zero.stage,
        "ranks": cfg.zero.ranks,
        "offload": cfg.zero.offload,
        "final_loss": o.last().loss,
        "model_state_bytes": states,
        "formula_bytes": o.formula_bytes,
        "slack_bytes": o.slack_bytes,
        "layer_buffer_peak_bytes": o.max_last(|r| r.layer_buffer_peak_bytes),
        "host_state_bytes": o.max_last(|r| r.host_state_bytes),
        "stage0_model_state_bytes": o.stage0_model_state_bytes,
        "model_state_saved_percent": saved(o.stage0_model_state_bytes, states),
        "phases": phases,
        "recorded": o.recorded.iter().map(|p| p.display().to_string()).collect::<Vec<_>>(),
    });
    if let Some(s) = &o.shadow {
        summary["shadow"] = json!({
            "policy": s.spec,
            "peak_reserved_bytes": s.peak_reserved_bytes,
            "errors": s.errors,
            "rank0": serde_json::to_value(&s.rank0).unwrap_or_default(),
        });
    }
    summary
}

/// The summary as text: the model states against the ZeRO formulas, memory
/// saved against stage 0 per policy phase, the shadow beside the primary,
/// the recorded files.
pub fn summary_text(o: &TrainOutcome) -> String {
    let cfg = &o.options.config;
    let states = o.max_last(|r| r.model_state_bytes);
    let mut out = String::new();
    let _ = writeln!(
        out,
        "\nΨ = {} parameters; ZeRO-{} on {} rank(s){}: model states/rank {} (formula {}), \
         layer buffers at most {} (slack bound {})",
        o.result.parameters,
        cfg.zero.stage,
        cfg.zero.ranks,
        if cfg.zero.offload { " + CPU offload" } else { "" },
        human_bytes(states),
        human_bytes(o.formula_bytes.round() as u64),
        human_bytes(o.max_last(|r| r.layer_buffer_peak_bytes)),
        human_bytes(o.slack_bytes),
    );
    let _ = writeln!(
        out,
        "memory saved against ZeRO-0 on the same model and ranks: model states/rank {} → {} ({})",
        human_bytes(o.stage0_model_state_bytes),
        human_bytes(states),
        change(o.stage0_model_state_bytes, states),
    );
    for p in &o.phases {
        let _ = writeln!(
            out,
            "  steps {}–{} under {}: peak reserved/rank {} against {} at stage 0 ({})",
            p.from,
            p.to,
            p.policy,
            human_bytes(p.peak_reserved_bytes),
            human_bytes(p.stage0_peak_reserved_bytes),
            change(p.stage0_peak_reserved_bytes, p.peak_reserved_bytes),
        );
    }
    if let Some(s) = &o.shadow {
        let primary = match &o.options.swap_at {
            Some((at, to)) => format!("{} →{to}@{at}", o.options.policy),
            None => o.options.policy.clone(),
        };
        let title = format!("== rank 0 · shadow A/B over the whole run ({} shadow errors) ==", s.errors);
        let _ = writeln!(
            out,
            "\n{}",
            crate::shadow::side_by_side(&title, (&primary, &s.primary_rank0), (&s.spec, &s.rank0))
        );
    }
    for p in &o.recorded {
        let _ = writeln!(out, "recorded {}", p.display());
    }
    out
}
