//! PyTorch memory snapshots.
pub mod export;
