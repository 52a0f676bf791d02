//! One rank's memory: executes the plan's memory ops against its allocator,
//! keeps the buffer table, and feeds every allocation event to the rank's
//! event tap.
//!
//! Memory ops become trace events ([`EventNumbering`]) applied through the
//! one [`Driver`] (out of memory is an error here, not an outcome).
//!
//! Invariants: a [`Buf`] is live in the numbering ⇔ its trace id is live in
//! the driver ⇔ it is a live tensor of the allocator; `state_live = Σ bytes of live Param/Grad/Master/ExpAvg/ExpAvgSq
//! buffers`, `layer_live = Σ bytes of live Gathered/FullGrad buffers`; the
//! tap sees the events of [`super::plan::EventNumbering`] in plan order, so a
//! rank's recorded trace equals [`super::plan::Plan::events`].
//!
//! Buffer contents go through [`crate::alloc::Allocator::write`] and
//! [`crate::alloc::Allocator::read`], which both the host-backed simulated
//! device and the CUDA backend support.

use super::plan::{Buf, EventNumbering, Op};
use crate::alloc::{AllocError, SharedAllocator};
use crate::device::Device;
use crate::driver::{DriveError, Driver, OnOom};
use crate::trace::Event;
use crate::types::TensorId;

/// A consumer of one rank's allocation events (trace recorder, shadow A/B).
pub type EventTap = Box<dyn FnMut(&Event) + Send>;

/// A memory operation of a rank failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MemError {
    /// The allocator refused an operation on a buffer.
    #[error("rank {rank}: {what} of {buf:?} failed: {cause}")]
    Alloc {
        /// The rank.
        rank: usize,
        /// alloc, free, use, read, write, phase.
        what: &'static str,
        /// The buffer.
        buf: Buf,
        /// Why.
        cause: AllocError,
    },
    /// The plan refers to a buffer that is not live (a bug in the plan).
    #[error("rank {rank}: {buf:?} is not allocated")]
    NotLive {
        /// The rank.
        rank: usize,
        /// The buffer.
        buf: Buf,
    },
}

/// One rank's buffers over its allocator.
pub struct RankMemory<D: Device> {
    rank: usize,
    alloc: SharedAllocator<D>,
    /// Trace ids → handles (the one driver; out of memory is an error here).
    driver: Driver,
    numbering: EventNumbering,
    tap: Option<EventTap>,
    /// Device bytes of persistent model states now.
    pub state_live: u64,
    /// Most device bytes of persistent model states so far.
    pub state_peak: u64,
    /// Device bytes of layer buffers (gathered weights, full gradients) now.
    pub layer_live: u64,
    /// Most device bytes of layer buffers so far.
    pub layer_peak: u64,
}

fn is_state(b: Buf) -> bool {
    matches!(b, Buf::Param(_) | Buf::Grad(_) | Buf::Master(_) | Buf::ExpAvg(_) | Buf::ExpAvgSq(_))
}

fn is_layer(b: Buf) -> bool {
    matches!(b, Buf::Gathered(_) | Buf::FullGrad(_))
}

impl<D: Device> RankMemory<D> {
    /// The memory of `rank` over `alloc`, reporting to `tap`.
    pub fn new(rank: usize, alloc: SharedAllocator<D>, tap: Option<EventTap>) -> Self {
        RankMemory {
            rank,
            alloc,
            driver: Driver::new(OnOom::Error),
            numbering: EventNumbering::default(),
            tap,
            state_live: 0,
            state_peak: 0,
            layer_live: 0,
            layer_peak: 0,
        }
    }

    /// The allocator.
    pub fn allocator(&self) -> &SharedAllocator<D> {
        &self.alloc
    }

    fn err(&self, what: &'static str, buf: Buf, cause: AllocError) -> MemError {
        MemError::Alloc { rank: self.rank, what, buf, cause }
    }

    /// Applies a memory op (`Exec` ops are ignored) through the driver, then
    /// hands its event to the tap.
    pub fn apply(&mut self, op: &Op) -> Result<(), MemError> {
        let (what, buf) = match *op {
            Op::Exec(_) => return Ok(()),
            Op::Phase(..) => ("phase", Buf::Tokens),
            Op::Alloc { buf, .. } => ("alloc", buf),
            Op::Free(buf) => ("free", buf),
            Op::Use(buf) => ("use", buf),
        };
        let rank = self.rank;
        let freed = if matches!(op, Op::Free(_)) { self.bytes(buf)? } else { 0 };
        let ev = self.numbering.event(op).ok_or(MemError::NotLive { rank, buf })?;
        let driver = &mut self.driver;
        self.alloc.with(|a| driver.apply(a, &ev, None)).map_err(|e| match e {
            DriveError::Alloc { cause, .. } => self.err(what, buf, cause),
            DriveError::UnknownId { .. } | DriveError::ReusedId { .. } => MemError::NotLive { rank, buf },
        })?;
        match *op {
            Op::Alloc { buf, bytes, .. } => {
                if is_state(buf) {
                    self.state_live += bytes;
                    self.state_peak = self.state_peak.max(self.state_live);
                }
                if is_layer(buf) {
                    self.layer_live += bytes;
                    self.layer_peak = self.layer_peak.max(self.layer_live);
                }
            }
            Op::Free(buf) => {
                if is_state(buf) {
                    self.state_live -= freed;
                }
                if is_layer(buf) {
                    self.layer_live -= freed;
                }
            }
            _ => {}
        }
        if let Some(tap) = self.tap.as_mut() {
            tap(&ev);
        }
        Ok(())
    }

    /// The trace id of a live buffer.
    fn trace_id(&self, buf: Buf) -> Result<u64, MemError> {
        self.numbering.id(buf).ok_or(MemError::NotLive { rank: self.rank, buf })
    }

    /// The tensor behind a live buffer.
    pub fn id(&self, buf: Buf) -> Result<TensorId, MemError> {
        self.driver.handle(self.trace_id(buf)?).ok_or(MemError::NotLive { rank: self.rank, buf })
    }

    /// Bytes of a live buffer.
    pub fn bytes(&self, buf: Buf) -> Result<u64, MemError> {
        self.driver.bytes(self.trace_id(buf)?).ok_or(MemError::NotLive { rank: self.rank, buf })
    }

    fn read_bytes(&self, buf: Buf, offset: u64, out: &mut [u8]) -> Result<(), MemError> {
        let id = self.id(buf)?;
        self.alloc.with(|a| a.read(id, offset, out)).map_err(|e| self.err("read", buf, e))
    }

    fn write_bytes(&self, buf: Buf, offset: u64, data: &[u8]) -> Result<(), MemError> {
        let id = self.id(buf)?;
        self.alloc.with(|a| a.write(id, offset, data)).map_err(|e| self.err("write", buf, e))
    }

    /// Reads `n` bf16 elements from element `at` as f32.
    pub fn read_bf16(&self, buf: Buf, at: u64, n: usize) -> Result<Vec<f32>, MemError> {
        let mut raw = vec![0u8; n * 2];
        self.read_bytes(buf, at * 2, &mut raw)?;
        Ok(raw.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect())
    }

    /// Writes `v` as bf16 (round to nearest even) at element `at`.
    pub fn write_bf16(&self, buf: Buf, at: u64, v: &[f32]) -> Result<(), MemError> {
        let raw: Vec<u8> = v.iter().flat_map(|&x| half::bf16::from_f32(x).to_le_bytes()).collect();
        self.write_bytes(buf, at * 2, &raw)
    }

    /// Reads `n` f32 elements from element `at`.
    pub fn read_f32(&self, buf: Buf, at: u64, n: usize) -> Result<Vec<f32>, MemError> {
        let mut raw = vec![0u8; n * 4];
        self.read_bytes(buf, at * 4, &mut raw)?;
        Ok(raw.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
    }

    /// Writes f32 elements at element `at`.
    pub fn write_f32(&self, buf: Buf, at: u64, v: &[f32]) -> Result<(), MemError> {
        let raw: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        self.write_bytes(buf, at * 4, &raw)
    }

    /// Reads `n` u32 elements from element `at`.
    pub fn read_u32(&self, buf: Buf, at: u64, n: usize) -> Result<Vec<u32>, MemError> {
        let mut raw = vec![0u8; n * 4];
        self.read_bytes(buf, at * 4, &mut raw)?;
        Ok(raw.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
    }

    /// Writes u32 elements at element `at`.
    pub fn write_u32(&self, buf: Buf, at: u64, v: &[u32]) -> Result<(), MemError> {
        let raw: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        self.write_bytes(buf, at * 4, &raw)
    }

    /// Fills a live buffer with zero bytes.
    pub fn zero(&self, buf: Buf) -> Result<(), MemError> {
        let n = self.bytes(buf)? as usize;
        self.write_bytes(buf, 0, &vec![0u8; n])
    }
}
