//! # wasmem
//!
//! A GPU memory-and-sharding engine whose decisions are made by sandboxed
//! WebAssembly policies.
//!
//! ## Glossary
//!
//! - **segment**: one contiguous range of device memory obtained from the device
//!   backend (a `cudaMalloc` equivalent). `reserved bytes = Σ segment sizes`.
//! - **block**: a sub-range of a segment. The blocks of a segment tile it without
//!   gaps or overlap; a block is either free (cached) or holds one tensor.
//! - **pool**: a set of segments whose free blocks serve requests of one class
//!   (e.g. small tensors, or one lifetime class), indexed by (stream, size, address).
//! - **handle**: a [`TensorId`](types::TensorId); clients hold handles, never
//!   addresses, so the engine can move blocks.
//! - **tier**: where a tensor's bytes are (device, host, disk).
//! - **policy**: code that makes decisions (placement, reclamation, eviction);
//!   built-in native Rust or a WebAssembly component.
//! - **shard**: one rank's part of a flat layer-group buffer (ZeRO); see [`shard`].
//! - **decision**: a plain value a policy returns; the engine validates it and
//!   falls back to the built-in default when it is invalid.
//!
//! ## Layers
//!
//! [`alloc`] (the caching allocator) asks the decision traits of [`decision`];
//! [`builtin`] holds the native policies; [`device`] holds the backends;
//! [`tier`] holds what is not on the device (host memory, spill files) for the
//! allocator's eviction, bring-back and prefetch.

#![warn(missing_docs)]

pub mod alloc;
pub mod builtin;
pub mod comm;
pub mod ctl;
pub mod decision;
pub mod device;
pub mod dirs;
pub mod driver;
pub mod metrics;
pub mod model;
pub mod plan;
pub mod plot;
#[cfg(feature = "wasm")]
pub mod policy;
pub mod replay;
pub mod report;
pub mod session;
pub mod shadow;
pub mod shard;
pub mod spec;
pub mod synth;
pub mod text;
pub mod tier;
pub mod trace;
pub mod train;
pub mod types;
pub mod workload;
