//! Collective communication between data-parallel ranks.
//!
//! A [`Communicator`] is one rank's handle on a group: all-reduce,
//! all-gather, reduce-scatter, broadcast and barrier, each with a timeout.
//! Every rank of a group must call the same collectives in the same order
//! with consistent sizes; a size mismatch, a rank that fails or leaves, or a
//! rank that stops answering makes *every* rank's call return an error — no
//! rank waits forever.
//!
//! Backends: [`local`] runs N ranks as threads of one process over shared
//! memory (the embedded default and the test backend). A NCCL backend
//! (through `cudarc::nccl`) implements the same trait on GPUs.

pub mod local;
pub mod nccl;

use std::time::Duration;

/// Why a collective failed. Once a group has failed, every later call on any
/// of its ranks fails too.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CommError {
    /// A rank did not arrive within the timeout.
    #[error("rank {rank}: {op} timed out after {timeout:?} waiting for ranks {missing:?}")]
    Timeout {
        /// The rank that gave up.
        rank: usize,
        /// The collective.
        op: &'static str,
        /// The timeout.
        timeout: Duration,
        /// Ranks that had not arrived.
        missing: Vec<usize>,
    },
    /// Another rank failed, left the group, or timed out first.
    #[error("rank {rank}: {op} aborted: {cause}")]
    GroupFailed {
        /// This rank.
        rank: usize,
        /// The collective.
        op: &'static str,
        /// What happened to the group.
        cause: String,
    },
    /// The ranks called different collectives or with inconsistent sizes.
    #[error("rank {rank}: {op}: {detail}")]
    Mismatch {
        /// This rank.
        rank: usize,
        /// The collective.
        op: &'static str,
        /// What differed.
        detail: String,
    },
    /// Bad arguments on this rank (buffer sizes, root out of range).
    #[error("rank {rank}: {op}: {detail}")]
    Invalid {
        /// This rank.
        rank: usize,
        /// The collective.
        op: &'static str,
        /// What is wrong.
        detail: String,
    },
}

/// One rank's handle on a communication group.
pub trait Communicator: Send {
    /// This rank (0-based).
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn world_size(&self) -> usize;
    /// Element-wise sum over all ranks, in place.
    fn all_reduce_sum(&mut self, buf: &mut [f32]) -> Result<(), CommError>;
    /// Concatenates every rank's `send` (rank order) into `recv`
    /// (`recv.len() = world_size × send.len()`).
    fn all_gather(&mut self, send: &[f32], recv: &mut [f32]) -> Result<(), CommError>;
    /// Sums `send` over all ranks and gives rank r the r-th chunk
    /// (`send.len() = world_size × recv.len()`).
    fn reduce_scatter_sum(&mut self, send: &[f32], recv: &mut [f32]) -> Result<(), CommError>;
    /// Copies `root`'s `buf` to every rank.
    fn broadcast(&mut self, buf: &mut [f32], root: usize) -> Result<(), CommError>;
    /// Waits until every rank arrives.
    fn barrier(&mut self) -> Result<(), CommError>;
    /// Bytes this rank sent so far, counted as a ring algorithm would
    /// (all-reduce 2(N−1)/N × size, all-gather and reduce-scatter (N−1)/N × total).
    fn bytes_sent(&self) -> u64;
}
