//! Human-readable reports of replay metrics: one summary, or a comparison
//! table with metrics as rows, policies as columns, and ratios to the first.

use std::fmt::Write;

use crate::replay::Metrics;
use crate::types::human_bytes;

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
        ("policy_calls", Unit::Count, |m| m.policy_calls as f64),
        ("policy_traps", Unit::Count, |m| m.policy_traps as f64),
        ("policy_fallbacks", Unit::Count, |m| m.policy_fallbacks as f64),
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
         {} device allocs / {} frees / {} syncs, {} OOMs, {} policy calls ({} traps, {} fallbacks), \
         {} events in {:.3} s ({:.2} M events/s)",
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
