//! ZeRO sharding: the memory plan of stages 0–3 (with offload), shared by the
//! trainer and the trace synthesizer, and the per-rank executor of that plan.
//!
//! - [`plan`]: which buffers exist per layer group, their kinds and sizes per
//!   stage, rank count and offload, and when each is allocated, used and
//!   freed; the formulas of the ZeRO paper and the layer-buffer slack.
//! - [`engine`]: a rank's buffers over its
//!   [`SharedAllocator`](crate::alloc::SharedAllocator), the event tap, and
//!   typed reads and writes of buffer contents.
//! - [`offload`]: host-resident optimizer states (ZeRO-Offload).

pub mod engine;
pub mod offload;
pub mod plan;

pub use plan::{Buf, Exec, Op, Plan, PlanError, StateBytes, ZeroConfig};

use std::path::{Path, PathBuf};

use crate::trace::{FileTraceWriter, TraceError, TraceHeader};

/// The trace file of `rank` for an output path: the path itself for one
/// rank, else `NAME.rankR.jsonl[.gz]` (the rank inserted before the trace
/// extension).
pub fn rank_path(path: &Path, rank: usize, ranks: usize) -> PathBuf {
    if ranks <= 1 {
        return path.to_path_buf();
    }
    let s = path.to_string_lossy();
    for ext in [".jsonl.gz", ".jsonl", ".json.gz", ".json"] {
        if let Some(stem) = s.strip_suffix(ext) {
            return PathBuf::from(format!("{stem}.rank{rank}{ext}"));
        }
    }
    PathBuf::from(format!("{s}.rank{rank}"))
}

/// Writes the synthesized per-rank traces of `plan` over `steps` steps: one
/// file per rank, or only `only` when given. Returns (path, events) per file.
pub fn write_traces(
    plan: &Plan,
    steps: u64,
    output: &Path,
    only: Option<usize>,
    source: &str,
) -> Result<Vec<(PathBuf, usize)>, TraceError> {
    let ranks = plan.cfg.ranks;
    // Every rank has the same plan (shards are padded to equal sizes).
    let events = plan.events(steps);
    let header = TraceHeader { source: source.to_string(), ranks: ranks as u32 };
    let chosen: Vec<usize> = match only {
        Some(r) => vec![r],
        None => (0..ranks).collect(),
    };
    let mut out = Vec::new();
    for r in chosen {
        let p = if only.is_some() { output.to_path_buf() } else { rank_path(output, r, ranks) };
        let mut w = FileTraceWriter::create(&p, &header)?;
        for e in &events {
            w.write(e)?;
        }
        w.close()?;
        out.push((p, events.len()));
    }
    Ok(out)
}
