//! Everything the command line prints: replay summaries, comparison tables
//! (metrics as rows, policies as columns, ratios to the first), the JSON
//! lines of `--json`, PyTorch's own figures beside a snapshot's replay, and
//! the training report ([`train`](mod@train)). The library's sessions return
//! values; this module turns them into text.

use std::fmt::Write;

use serde_json::Value;

use crate::metrics::Metrics;
use crate::plan::OfflinePlan;
use crate::session::ReplayOutcome;
use crate::trace::snapshot::SnapshotInfo;
use crate::types::human_bytes;

pub mod train;

/// PyTorch's own figures for a snapshot, shown beside each replay of it.
pub fn pytorch_line(info: &SnapshotInfo) -> String {
    format!(
        "recorded by PyTorch itself: reserved {} at the end of the snapshot, peak over the window {} ({} segments)",
        human_bytes(info.pytorch_reserved_bytes_end),
        human_bytes(info.pytorch_peak_reserved_bytes),
        info.segments
    )
}

/// The `--json` object of one replay: the metric keys, `trace`, `policy`,
/// PyTorch's figures for a snapshot, `halves` of a hot swap and `shadow`.
pub fn replay_json(o: &ReplayOutcome) -> Value {
    let mut v = serde_json::to_value(&o.metrics).unwrap_or_else(|_| Value::Object(Default::default()));
    v["trace"] = o.workload.as_str().into();
    if let Some(info) = &o.pytorch {
        v["pytorch_reserved_bytes_end"] = info.pytorch_reserved_bytes_end.into();
        v["pytorch_peak_reserved_bytes"] = info.pytorch_peak_reserved_bytes.into();
    }
    v["policy"] = o.policy.as_str().into();
    if let Some(h) = &o.halves {
        v["halves"] = serde_json::to_value(h).unwrap_or_default();
    }
    if let Some(s) = &o.shadow {
        let mut sv = serde_json::to_value(&s.metrics).unwrap_or_default();
        sv["policy"] = s.spec.as_str().into();
        sv["errors"] = s.errors.into();
        v["shadow"] = sv;
    }
    v
}

/// The `--json` object of an offline plan (`wasmem plan --json`).
pub fn plan_json(p: &OfflinePlan) -> Value {
    serde_json::to_value(p).unwrap_or_default()
}

/// The text report of an offline plan (`wasmem plan`).
pub fn plan_text(p: &OfflinePlan) -> String {
    let ratio = |b: u64| if p.peak_live_bytes == 0 { 1.0 } else { b as f64 / p.peak_live_bytes as f64 };
    format!(
        "== {} · planner {} · offline bound ==\n\
         requests          {}\n\
         peak live         {}\n\
         lower bound       {} ({:.4} × peak live: every block rounded to {} B)\n\
         planned arena     {} ({:.4} × peak live)\n\
         composition       {} ({} steps)\n\
         planning time     {:.1} ms\n",
        p.trace,
        p.planner,
        p.requests,
        human_bytes(p.peak_live_bytes),
        human_bytes(p.lower_bound_bytes),
        ratio(p.lower_bound_bytes),
        crate::decision::PLAN_ALIGN,
        human_bytes(p.arena_bytes),
        p.overhead_ratio,
        p.composition.name(),
        p.steps,
        p.plan_seconds * 1e3,
    )
}

/// The text report of one replay (`wasmem replay`): the summary, the shadow
/// beside the primary, PyTorch's figures.
pub fn replay_text(o: &ReplayOutcome) -> String {
    let mut out = summary(&o.workload, &o.policy, &o.metrics);
    out.push('\n');
    if let Some(s) = &o.shadow {
        let title = format!("== {} · shadow A/B ({} shadow errors) ==", o.workload, s.errors);
        out.push_str(&crate::shadow::side_by_side(&title, (&o.policy, &o.metrics), (&s.spec, &s.metrics)));
        out.push('\n');
    }
    if let Some(info) = &o.pytorch {
        out.push_str(&pytorch_line(info));
        out.push('\n');
    }
    out
}

/// The text report of one workload under several policies (`wasmem
/// compare`): the comparison table, both halves of a hot swap to `swap_to`,
/// PyTorch's figures.
pub fn compare_text(outcomes: &[ReplayOutcome], swap_to: Option<&str>) -> String {
    let Some(first) = outcomes.first() else { return String::new() };
    let cols: Vec<(String, Metrics)> = outcomes.iter().map(|o| (o.policy.clone(), o.metrics.clone())).collect();
    let mut out = comparison_table(&format!("== {} ==", first.workload), &cols);
    out.push('\n');
    let mut halves = Vec::new();
    for o in outcomes {
        if let (Some(h), Some(to)) = (&o.halves, swap_to) {
            halves.push((format!("{} [0,{})", o.policy, h.split_at), h.first.clone()));
            halves.push((format!("→{to} [{},end)", h.split_at), h.second.clone()));
        }
    }
    if !halves.is_empty() {
        let title = format!("== {} · both halves of the hot swap ==", first.workload);
        out.push_str(&comparison_table(&title, &halves));
        out.push('\n');
    }
    if let Some(info) = &first.pytorch {
        out.push_str(&pytorch_line(info));
        out.push_str("\n\n");
    }
    out
}

/// How a metric is shown.
#[derive(Clone, Copy)]
enum Unit {
    Bytes,
    Count,
    Ratio,
    Seconds,
    Rate,
    Micros,
}

/// One row of a table: key, unit, getter.
type Row = (&'static str, Unit, fn(&Metrics) -> f64);

/// The rows of a table.
fn rows() -> Vec<Row> {
    vec![
        ("peak_reserved_bytes", Unit::Bytes, |m| m.peak_reserved_bytes as f64),
        ("peak_allocated_bytes", Unit::Bytes, |m| m.peak_allocated_bytes as f64),
        ("peak_live_bytes", Unit::Bytes, |m| m.peak_live_bytes as f64),
        ("overhead_ratio", Unit::Ratio, |m| m.overhead_ratio),
        ("device_alloc_calls", Unit::Count, |m| m.device_alloc_calls as f64),
        ("device_free_calls", Unit::Count, |m| m.device_free_calls as f64),
        ("device_syncs", Unit::Count, |m| m.device_syncs as f64),
        ("ooms", Unit::Count, |m| m.ooms as f64),
        ("evicted_bytes", Unit::Bytes, |m| m.evicted_bytes as f64),
        ("prefetched_bytes", Unit::Bytes, |m| m.prefetched_bytes as f64),
        ("fetched_bytes", Unit::Bytes, |m| m.fetched_bytes as f64),
        ("tier_traffic_bytes", Unit::Bytes, |m| m.tier_traffic_bytes as f64),
        ("stall_us", Unit::Micros, |m| m.stall_us),
        ("spilled_bytes", Unit::Bytes, |m| m.spilled_bytes as f64),
        ("peak_host_bytes", Unit::Bytes, |m| m.peak_host_bytes as f64),
        ("peak_disk_bytes", Unit::Bytes, |m| m.peak_disk_bytes as f64),
        ("moved_bytes", Unit::Bytes, |m| m.moved_bytes as f64),
        ("plans", Unit::Count, |m| m.plans as f64),
        ("plan_hits", Unit::Count, |m| m.plan_hits as f64),
        ("plan_misses", Unit::Count, |m| m.plan_misses as f64),
        ("plan_refused", Unit::Count, |m| m.plan_refused as f64),
        ("plan_arena_bytes", Unit::Bytes, |m| m.plan_arena_bytes as f64),
        ("plans_loaded", Unit::Count, |m| m.plans_loaded as f64),
        ("plans_refined", Unit::Count, |m| m.plans_refined as f64),
        ("plan_detected_steps", Unit::Count, |m| m.plan_detected_steps as f64),
        ("policy_calls", Unit::Count, |m| m.policy_calls as f64),
        ("policy_traps", Unit::Count, |m| m.policy_traps as f64),
        ("policy_fallbacks", Unit::Count, |m| m.policy_fallbacks as f64),
        ("policy_call_p50_ns", Unit::Count, |m| m.policy_call_p50_ns as f64),
        ("policy_call_p99_ns", Unit::Count, |m| m.policy_call_p99_ns as f64),
        ("events", Unit::Count, |m| m.events as f64),
        ("wall_seconds", Unit::Seconds, |m| m.wall_seconds),
        ("events_per_second", Unit::Rate, |m| m.events_per_second),
    ]
}

fn show(unit: Unit, v: f64) -> String {
    match unit {
        Unit::Bytes => human_bytes(v as u64),
        Unit::Count => format!("{}", v as u64),
        Unit::Ratio => format!("{v:.4}"),
        Unit::Seconds => format!("{v:.3} s"),
        Unit::Rate => format!("{:.2} M/s", v / 1e6),
        Unit::Micros => format!("{v:.1} µs"),
    }
}

/// A table comparing `columns` (policy name, metrics); ratios are against the first column.
pub fn comparison_table(title: &str, columns: &[(String, Metrics)]) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "{title}");
    let key_w = 22;
    let col_w = columns.iter().map(|(n, _)| n.len()).max().unwrap_or(0).max(22);
    let _ = write!(out, "{:<key_w$}", "metric");
    for (name, _) in columns {
        let _ = write!(out, " {name:>col_w$}");
    }
    out.push('\n');
    for (key, unit, get) in rows() {
        let _ = write!(out, "{key:<key_w$}");
        let base = columns.first().map(|(_, m)| get(m)).unwrap_or(0.0);
        for (i, (_, m)) in columns.iter().enumerate() {
            let v = get(m);
            let cell = if i == 0 || matches!(unit, Unit::Ratio) {
                show(unit, v)
            } else if base > 0.0 {
                format!("{} ({:.2}x)", show(unit, v), v / base)
            } else {
                show(unit, v)
            };
            let _ = write!(out, " {cell:>col_w$}");
        }
        out.push('\n');
    }
    for (name, m) in columns {
        if m.offline_bound {
            let _ = writeln!(
                out,
                "note: {name} reads the workload's future (Belady): an offline bound, not achievable live"
            );
        }
    }
    out
}

/// A short summary of one replay.
pub fn summary(trace: &str, policy: &str, m: &Metrics) -> String {
    let mut s = summary_line(trace, policy, m);
    if m.evictions > 0 || m.tier_traffic_bytes > 0 {
        let _ = write!(
            s,
            "\n  tiers: evicted {} ({} tensors), prefetched {}, fetched on use {}, spilled to disk {}, \
             stall {:.1} µs, peak host {}, peak disk {}",
            human_bytes(m.evicted_bytes),
            m.evictions,
            human_bytes(m.prefetched_bytes),
            human_bytes(m.fetched_bytes),
            human_bytes(m.spilled_bytes),
            m.stall_us,
            human_bytes(m.peak_host_bytes),
            human_bytes(m.peak_disk_bytes),
        );
    }
    if m.offline_bound {
        s.push_str("\n  note: the eviction policy reads the workload's future (Belady): an offline bound");
    }
    if let Some(e) = &m.first_oom {
        let _ = write!(s, "\n  first OOM: {e}");
    }
    s
}

fn summary_line(trace: &str, policy: &str, m: &Metrics) -> String {
    format!(
        "{trace} · {policy}: peak reserved {} for peak live {} (overhead {:.4}), peak allocated {}, \
         {} device allocs / {} frees / {} syncs, {} OOMs, {} policy calls ({} traps, {} fallbacks; \
         p50 {} ns, p99 {} ns), {} events in {:.3} s ({:.2} M events/s)",
        human_bytes(m.peak_reserved_bytes),
        human_bytes(m.peak_live_bytes),
        m.overhead_ratio,
        human_bytes(m.peak_allocated_bytes),
        m.device_alloc_calls,
        m.device_free_calls,
        m.device_syncs,
        m.ooms,
        m.policy_calls,
        m.policy_traps,
        m.policy_fallbacks,
        m.policy_call_p50_ns,
        m.policy_call_p99_ns,
        m.events,
        m.wall_seconds,
        m.events_per_second / 1e6,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_has_ratios() {
        let a = Metrics { peak_reserved_bytes: 100, ..Metrics::default() };
        let b = Metrics { peak_reserved_bytes: 50, ..Metrics::default() };
        let t = comparison_table("t", &[("a".into(), a), ("b".into(), b)]);
        assert!(t.contains("(0.50x)"), "{t}");
        assert!(t.lines().count() > 10);
    }
}
