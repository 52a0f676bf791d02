//! ZeRO-Offload: fp32 master weights and Adam moments in host memory, updated
//! on the CPU.
//!
//! The states live in ordinary host vectors owned by the shard engine and are
//! counted as host-tier bytes in the per-rank report (`host_bytes`). They
//! will move to the allocator's host tier once the engine has one; the plan
//! already keeps them out of the device schedule. The Adam step itself
//! ([`crate::train::adam`]) runs on all cores through rayon.
//!
//! Invariant: `master[g].len() = m[g].len() = v[g].len() =` the rank's
//! optimizer elements of group `g` ([`super::plan::Plan::optim_elems`]).

/// Host-resident optimizer states of one rank.
#[derive(Debug, Clone, Default)]
pub struct HostStates {
    /// fp32 master weights per group.
    pub master: Vec<Vec<f32>>,
    /// Adam first moments per group.
    pub m: Vec<Vec<f32>>,
    /// Adam second moments per group.
    pub v: Vec<Vec<f32>>,
}

impl HostStates {
    /// Bytes held in host memory.
    pub fn bytes(&self) -> u64 {
        [&self.master, &self.m, &self.v].iter().flat_map(|s| s.iter()).map(|g| g.len() as u64 * 4).sum()
    }
}
