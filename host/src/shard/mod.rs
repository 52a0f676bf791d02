//! ZeRO sharding: the memory plan of stages 0–3 (with offload), shared by the
//! trainer and the trace synthesizer, and the per-rank executor of that plan.
//!
//! - [`plan`]: which buffers exist per layer group, their kinds and sizes per
//!   stage, rank count and offload, and when each is allocated, used and
//!   freed; the formulas of the ZeRO paper and the layer-buffer slack.
//! - `engine` (with the `wasm` feature): a rank's buffers over its
//!   [`SharedAllocator`](crate::policy::SharedAllocator), the event tap, and
//!   typed reads and writes of buffer contents.
//! - [`offload`]: host-resident optimizer states (ZeRO-Offload).

#[cfg(feature = "wasm")]
pub mod engine;
pub mod offload;
pub mod plan;

pub use plan::{Buf, Exec, Op, Plan, StateBytes, ZeroConfig};
