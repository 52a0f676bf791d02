//! Writes a replay result as a PyTorch memory snapshot pickle, so that
//! PyTorch's visualizer (`python -m torch.cuda._memory_viz trace_plot FILE
//! -o out.html`, or <https://pytorch.org/memory_viz>) can draw it.
//!
//! The pickle is a dict of the shape `torch.cuda.memory._snapshot()` returns:
//!
//! ```text
//! { "segments": [ { "device", "address", "total_size", "allocated_size", "active_size",
//!                   "requested_size", "stream", "segment_type": "large"|"small",
//!                   "segment_pool_id": (0, 0), "is_expandable": False, "frames": [],
//!                   "blocks": [ { "address", "size", "requested_size", "state", "frames" } ] } ],
//!   "device_traces": [ [], …, [ { "action", "addr", "size", "stream", "time_us", "frames" } ] ],
//!   "allocator_settings": { … PyTorch's defaults … } }
//! ```
//!
//! `device_traces` has one list per device up to [`ExportInput::device`].
//! A block or trace entry with a [`TensorKind`] gets one stack frame named
//! `wasmem kind=<kind>` (file `wasmem`), which the visualizer shows as the
//! allocation's stack and [`super::import_bytes`] reads back.
//!
//! `segment_type` is `small` for segments of at most 2 MiB (PyTorch's small
//! pool allocates 2 MiB segments; its large pool's are at least 10 MiB… or
//! 20 MiB for requests between 1 and 10 MiB).

use std::collections::BTreeMap;
use std::path::Path;

use serde::Serialize;

use super::KIND_FRAME_PREFIX;
use crate::trace::Event;
use crate::types::{TensorKind, MIB};

/// Devices an export can name: `device_traces` holds one list per device
/// up to the exported one.
pub const MAX_EXPORT_DEVICE: u32 = 1024;

/// A replay result to export.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExportInput {
    /// The device the segments belong to (default 0).
    pub device: u32,
    /// The segments at the end of the replay.
    pub segments: Vec<ExportSegment>,
    /// The allocator's actions during the replay, in order.
    pub trace: Vec<ExportTraceEntry>,
}

/// A segment (one device allocation) at the end of the replay.
///
/// Its blocks must tile it in address order (first block at `address`, each
/// next one where the previous ends, sizes summing to `total_size`):
/// PyTorch's visualizer places blocks by adding up their sizes from the
/// segment's address. [`export_bytes`] checks this.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExportSegment {
    /// Start address.
    pub address: u64,
    /// Size in bytes.
    pub total_size: u64,
    /// Stream whose pool owns the segment.
    pub stream: u32,
    /// The blocks that tile the segment, by address.
    pub blocks: Vec<ExportBlock>,
}

/// Whether a block holds a tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BlockState {
    /// Holds a live tensor (`"active_allocated"`).
    ActiveAllocated,
    /// Free, cached by the allocator (`"inactive"`).
    #[default]
    Inactive,
}

impl BlockState {
    /// PyTorch's name for the state.
    pub fn as_str(self) -> &'static str {
        match self {
            BlockState::ActiveAllocated => "active_allocated",
            BlockState::Inactive => "inactive",
        }
    }
}

/// A block of a segment.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExportBlock {
    /// Start address.
    pub address: u64,
    /// Size in bytes (after rounding).
    pub size: u64,
    /// Bytes the client asked for (0 for an inactive block).
    pub requested_size: u64,
    /// Active or cached.
    pub state: BlockState,
    /// Kind of the tensor it holds, written as a stack frame.
    pub kind: Option<TensorKind>,
}

/// An action of the allocator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TraceAction {
    /// A block is handed to a tensor (`"alloc"`).
    Alloc,
    /// The client freed the tensor; the block may still wait for streams
    /// (`"free_requested"`).
    FreeRequested,
    /// The block is reusable (`"free_completed"`).
    FreeCompleted,
    /// A segment was obtained from the device (`"segment_alloc"`).
    SegmentAlloc,
    /// A segment was returned to the device (`"segment_free"`).
    SegmentFree,
}

impl TraceAction {
    /// PyTorch's name for the action.
    pub fn as_str(self) -> &'static str {
        match self {
            TraceAction::Alloc => "alloc",
            TraceAction::FreeRequested => "free_requested",
            TraceAction::FreeCompleted => "free_completed",
            TraceAction::SegmentAlloc => "segment_alloc",
            TraceAction::SegmentFree => "segment_free",
        }
    }
}

/// One entry of the exported trace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportTraceEntry {
    /// What happened.
    pub action: TraceAction,
    /// Block or segment address.
    pub addr: u64,
    /// Requested bytes for `alloc`/`free_*`, segment size for `segment_*`
    /// (what PyTorch records).
    pub size: u64,
    /// Stream.
    pub stream: u32,
    /// Timestamp in microseconds (a logical clock is fine).
    pub time_us: u64,
    /// Kind of the tensor, written as a stack frame (for `alloc`).
    pub kind: Option<TensorKind>,
}

/// An export that failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ExportError {
    /// The input breaks a rule of the snapshot shape.
    #[error("invalid export input: {0}")]
    Invalid(String),
    /// Serializing the pickle failed.
    #[error("cannot serialize the snapshot: {0}")]
    Pickle(#[from] serde_pickle::Error),
    /// Writing the file failed.
    #[error("cannot write {path}: {source}")]
    Write {
        /// The file.
        path: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

#[derive(Serialize)]
struct PyFrame {
    name: String,
    filename: &'static str,
    line: u32,
}

#[derive(Serialize)]
struct PyBlock {
    address: u64,
    size: u64,
    requested_size: u64,
    state: &'static str,
    frames: Vec<PyFrame>,
}

#[derive(Serialize)]
struct PySegment {
    device: u32,
    address: u64,
    total_size: u64,
    allocated_size: u64,
    active_size: u64,
    requested_size: u64,
    stream: u32,
    segment_type: &'static str,
    segment_pool_id: (u64, u64),
    is_expandable: bool,
    frames: Vec<PyFrame>,
    blocks: Vec<PyBlock>,
}

#[derive(Serialize)]
struct PyEntry {
    action: &'static str,
    addr: u64,
    size: u64,
    stream: u32,
    time_us: u64,
    frames: Vec<PyFrame>,
}

/// PyTorch 2.x's default `allocator_settings`.
#[derive(Serialize)]
#[allow(non_snake_case)]
struct PySettings {
    PYTORCH_CUDA_ALLOC_CONF: &'static str,
    max_split_size: i64,
    garbage_collection_threshold: f64,
    expandable_segments: bool,
    pinned_num_register_threads: u32,
    release_lock_on_cudamalloc: bool,
    pinned_use_cuda_host_register: bool,
    roundup_power2_divisions: BTreeMap<String, u32>,
}

#[derive(Serialize)]
struct PySnapshot {
    segments: Vec<PySegment>,
    device_traces: Vec<Vec<PyEntry>>,
    allocator_settings: PySettings,
}

fn frames(kind: Option<TensorKind>) -> Vec<PyFrame> {
    kind.map(|k| PyFrame { name: format!("{KIND_FRAME_PREFIX}{k}"), filename: "wasmem", line: 0 }).into_iter().collect()
}

/// Serializes `input` to snapshot pickle bytes.
pub fn export_bytes(input: &ExportInput) -> Result<Vec<u8>, ExportError> {
    input.check()?;
    let segments = input
        .segments
        .iter()
        .map(|s| {
            let active = s.blocks.iter().filter(|b| b.state == BlockState::ActiveAllocated);
            let allocated: u64 = active.clone().map(|b| b.size).sum();
            let requested: u64 = active.map(|b| b.requested_size).sum();
            PySegment {
                device: input.device,
                address: s.address,
                total_size: s.total_size,
                allocated_size: allocated,
                active_size: allocated,
                requested_size: requested,
                stream: s.stream,
                segment_type: if s.total_size <= 2 * MIB { "small" } else { "large" },
                segment_pool_id: (0, 0),
                is_expandable: false,
                frames: Vec::new(),
                blocks: s
                    .blocks
                    .iter()
                    .map(|b| PyBlock {
                        address: b.address,
                        size: b.size,
                        requested_size: b.requested_size,
                        state: b.state.as_str(),
                        frames: frames(b.kind),
                    })
                    .collect(),
            }
        })
        .collect();
    let entries = input
        .trace
        .iter()
        .map(|e| PyEntry {
            action: e.action.as_str(),
            addr: e.addr,
            size: e.size,
            stream: e.stream,
            time_us: e.time_us,
            frames: frames(e.kind),
        })
        .collect();
    let mut device_traces: Vec<Vec<PyEntry>> = (0..input.device).map(|_| Vec::new()).collect();
    device_traces.push(entries);
    let snapshot = PySnapshot {
        segments,
        device_traces,
        allocator_settings: PySettings {
            PYTORCH_CUDA_ALLOC_CONF: "",
            max_split_size: -1,
            garbage_collection_threshold: 0.0,
            expandable_segments: false,
            pinned_num_register_threads: 1,
            release_lock_on_cudamalloc: false,
            pinned_use_cuda_host_register: false,
            roundup_power2_divisions: (0..16).map(|i| ((1u32 << i).to_string(), 0)).collect(),
        },
    };
    Ok(serde_pickle::to_vec(&snapshot, serde_pickle::SerOptions::new())?)
}

/// Serializes `input` and writes it to `path`.
pub fn export_file(path: impl AsRef<Path>, input: &ExportInput) -> Result<(), ExportError> {
    let path = path.as_ref();
    let bytes = export_bytes(input)?;
    std::fs::write(path, bytes).map_err(|source| ExportError::Write { path: path.display().to_string(), source })
}

impl ExportInput {
    /// Checks that the blocks of every segment tile it in address order,
    /// and that `device` is below [`MAX_EXPORT_DEVICE`].
    pub fn check(&self) -> Result<(), ExportError> {
        if self.device >= MAX_EXPORT_DEVICE {
            return Err(ExportError::Invalid(format!("device {} is not below {MAX_EXPORT_DEVICE}", self.device)));
        }
        for (i, s) in self.segments.iter().enumerate() {
            let mut at = s.address;
            for (k, b) in s.blocks.iter().enumerate() {
                if b.address != at {
                    return Err(ExportError::Invalid(format!(
                        "segments[{i}].blocks[{k}] starts at {:#x}, expected {at:#x} \
                         (blocks must tile their segment in address order)",
                        b.address
                    )));
                }
                at = at.saturating_add(b.size);
            }
            let end = s.address.saturating_add(s.total_size);
            if !s.blocks.is_empty() && at != end {
                return Err(ExportError::Invalid(format!(
                    "the blocks of segments[{i}] end at {at:#x}, the segment at {end:#x}"
                )));
            }
        }
        Ok(())
    }

    /// Lays out a v1 event stream without any caching: every tensor gets its
    /// own segment (its size rounded up to 512 bytes), obtained at its
    /// `alloc` and returned at its `free`. This is what a replay without an
    /// allocator would look like, and a way to draw any trace with PyTorch's
    /// visualizer; the replay engine fills an [`ExportInput`] with its real
    /// segments instead.
    ///
    /// `use` and `phase` events have no counterpart and are dropped;
    /// `time_us` is the event's `t_us`, or its index in `events` when absent.
    pub fn one_segment_per_tensor(events: &[Event], device: u32) -> ExportInput {
        // Addresses: a bump pointer from 2**32, each segment 2 MiB aligned.
        let mut next_addr: u64 = 1 << 32;
        let mut live: rustc_hash::FxHashMap<u64, (u64, u64, u32, u64, TensorKind)> = rustc_hash::FxHashMap::default();
        let mut order: Vec<u64> = Vec::new();
        let mut trace = Vec::new();
        for (i, event) in events.iter().enumerate() {
            match *event {
                Event::Alloc { id, bytes, kind, stream, t_us } => {
                    let time_us = t_us.unwrap_or(i as u64);
                    let size = bytes.max(1).div_ceil(512).saturating_mul(512);
                    let addr = next_addr;
                    next_addr = next_addr.saturating_add(size.div_ceil(2 * MIB).saturating_mul(2 * MIB));
                    live.insert(id, (addr, bytes, stream, size, kind));
                    order.push(id);
                    trace.push(ExportTraceEntry {
                        action: TraceAction::SegmentAlloc,
                        addr,
                        size,
                        stream,
                        time_us,
                        kind: None,
                    });
                    trace.push(ExportTraceEntry {
                        action: TraceAction::Alloc,
                        addr,
                        size: bytes,
                        stream,
                        time_us,
                        kind: Some(kind),
                    });
                }
                Event::Free { id, t_us } => {
                    let Some((addr, bytes, stream, size, _)) = live.remove(&id) else {
                        continue;
                    };
                    let time_us = t_us.unwrap_or(i as u64);
                    for (action, size) in [
                        (TraceAction::FreeRequested, bytes),
                        (TraceAction::FreeCompleted, bytes),
                        (TraceAction::SegmentFree, size),
                    ] {
                        trace.push(ExportTraceEntry { action, addr, size, stream, time_us, kind: None });
                    }
                }
                Event::Use { .. } | Event::Phase { .. } => {}
            }
        }
        let segments = order
            .into_iter()
            .filter_map(|id| live.get(&id).copied())
            .map(|(addr, bytes, stream, size, kind)| ExportSegment {
                address: addr,
                total_size: size,
                stream,
                blocks: vec![ExportBlock {
                    address: addr,
                    size,
                    requested_size: bytes,
                    state: BlockState::ActiveAllocated,
                    kind: Some(kind),
                }],
            })
            .collect();
        ExportInput { device, segments, trace }
    }
}
