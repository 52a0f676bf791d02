//! Memory tiers below the device: host memory and spill files on disk, and
//! the time model of the copies between tiers.
//!
//! ```text
//!  device ──evict (D2H copy)──► host ──spill when host is full──► disk
//!     ▲                           │                                │
//!     └──── use / prefetch (H2D copy; disk read + H2D) ◄───────────┘
//! ```
//!
//! This module holds what is *not* on the device: [`TierState`] keeps one
//! [`Offloaded`] entry per tensor that lives on the host or on disk (by
//! handle slot), the host-tier byte count against its capacity, the
//! [`DiskTier`] and the counters. The allocator
//! (`alloc::tiering`) decides when to move what and keeps the handle table's
//! `tier` field in step with these entries.
//!
//! Contents: when the device has contents (a host-backed `sim` device, a real
//! GPU with `copy_contents`), an evicted tensor's bytes are copied to a host
//! buffer or a spill file with a CRC-32 and written back on return. Without
//! contents (replays of traces), the tiers hold accounting only: the same
//! capacities, quotas and copy times, no bytes.
//!
//! Time model (simulated microseconds, never the wall clock): a *workload
//! clock* advances by `bytes / workload_gbps` at every use of a tensor; two
//! copy engines (device-to-host for evictions and spills, host-to-device
//! for bring-backs and prefetches, as on a GPU with bidirectional PCIe)
//! each serialize their copies at `host_gbps` (plus `disk_gbps` for spill
//! files). A copy the workload needs now (an eviction
//! making room, a bring-back on use) stalls the workload until it ends; a
//! prefetch is queued on the copy stream and stalls only the use that comes
//! before the copy ends. `stall_us` sums the waits.

pub mod disk;

use std::path::PathBuf;
use std::sync::Arc;

use rustc_hash::FxHashMap;
use serde::Serialize;

use crate::device::HostBuf;
use crate::types::{Phase, GIB};
use disk::{DiskTier, SpillFile};

/// Configuration of the host and disk tiers.
#[derive(Debug, Clone, PartialEq)]
pub struct TierConfig {
    /// Host-tier capacity in bytes.
    pub host_capacity: u64,
    /// Device↔host copy bandwidth, GB/s (10⁹ bytes per second).
    pub host_gbps: f64,
    /// Host↔disk bandwidth of spill files, GB/s.
    pub disk_gbps: f64,
    /// Spill directory (`None`: a fresh temporary directory, removed at shutdown).
    pub spill_dir: Option<PathBuf>,
    /// Largest number of bytes the disk tier may hold (a full disk).
    pub disk_quota: u64,
    /// I/O threads of the disk tier.
    pub io_threads: usize,
    /// Workload model: a use of a tensor of `b` bytes takes `b / workload_gbps`.
    pub workload_gbps: f64,
    /// Bring tensors back ahead of use at phase boundaries.
    pub prefetch: bool,
    /// At most this fraction of the device capacity is prefetched per phase boundary.
    pub prefetch_fraction: f64,
    /// Prefetch only while this fraction of the device capacity stays free,
    /// on top of the growth of live bytes the coming phase had last time.
    pub prefetch_headroom: f64,
    /// Copy tensor contents between tiers (host-backed or real devices).
    pub copy_contents: bool,
}

impl Default for TierConfig {
    /// 1 TiB of host memory at 25 GB/s (PCIe 5 pinned copies), spill files at
    /// 3 GB/s (an NVMe drive) in a fresh temporary directory without quota,
    /// two I/O threads, a workload of 200 GB/s per used byte, prefetch off
    /// (when on: a quarter of the device per boundary at most, keeping free
    /// what the coming phase grew by last time plus 5 % of the device), no
    /// contents.
    fn default() -> Self {
        TierConfig {
            host_capacity: 1024 * GIB,
            host_gbps: 25.0,
            disk_gbps: 3.0,
            spill_dir: None,
            disk_quota: u64::MAX,
            io_threads: 2,
            workload_gbps: 200.0,
            prefetch: false,
            prefetch_fraction: 0.25,
            prefetch_headroom: 0.05,
            copy_contents: false,
        }
    }
}

/// Why a move between tiers failed. The tensor stays on its previous tier.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TierError {
    /// The spill directory cannot be created.
    #[error("cannot create spill directory {dir}: {message}")]
    SpillDir {
        /// The directory.
        dir: String,
        /// The system's reason.
        message: String,
    },
    /// A spill file cannot be written (unwritable directory, disk full…).
    #[error("cannot write spill file {file}: {message}")]
    SpillWrite {
        /// The file.
        file: String,
        /// The system's reason.
        message: String,
    },
    /// A spill file cannot be read.
    #[error("cannot read spill file {file}: {message}")]
    SpillRead {
        /// The file.
        file: String,
        /// The system's reason.
        message: String,
    },
    /// A spill file no longer holds what was written.
    #[error("spill file {file} is corrupted: {reason}")]
    Corrupt {
        /// The file.
        file: String,
        /// What differs.
        reason: String,
    },
    /// A spill file cannot be removed.
    #[error("cannot remove spill file {file}: {message}")]
    SpillRemove {
        /// The file.
        file: String,
        /// The system's reason.
        message: String,
    },
    /// The disk tier's quota would be exceeded (a full disk).
    #[error(
        "disk tier full: spill file {file} of {bytes} bytes would exceed the quota ({used} of {quota} bytes used)"
    )]
    QuotaExceeded {
        /// The file that would have been written.
        file: String,
        /// Its size.
        bytes: u64,
        /// Bytes already in spill files.
        used: u64,
        /// The quota.
        quota: u64,
    },
    /// The host and disk tiers are not enabled on this allocator.
    #[error("the host and disk tiers are not enabled (Allocator::enable_tiers)")]
    Disabled,
    /// A tensor is larger than host memory can hold on this machine.
    #[error("{what}: {bytes} bytes do not fit in host memory")]
    TooLargeForHost {
        /// The tensor.
        what: String,
        /// Its size.
        bytes: u64,
    },
}

/// Where an off-device tensor's bytes are.
#[derive(Debug, Clone)]
pub enum Stored {
    /// In host memory (`None`: accounting only).
    Host(Option<Arc<HostBuf>>),
    /// In a spill file (`None`: accounting only).
    Disk(Option<SpillFile>),
}

/// One tensor that is not on the device.
#[derive(Debug, Clone)]
pub struct Offloaded {
    /// Requested bytes of the tensor.
    pub bytes: u64,
    /// Where it is.
    pub stored: Stored,
    /// Allocator clock when it left the device (prefetch order without hints).
    pub evicted_at: u64,
}

/// Counters and gauges of the tiers (the `--json` keys of the same names).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct TierStats {
    /// Tensors moved off the device.
    pub evictions: u64,
    /// Bytes brought back on demand (a use of an off-device tensor).
    pub fetched_bytes: u64,
    /// Bytes moved from host to disk.
    pub spilled_bytes: u64,
    /// Simulated time the workload waited for copies, microseconds.
    pub stall_us: f64,
    /// Bytes on the host tier now.
    pub host_bytes: u64,
    /// Peak of `host_bytes`.
    pub peak_host_bytes: u64,
    /// Bytes on the disk tier now.
    pub disk_bytes: u64,
    /// Peak of `disk_bytes`.
    pub peak_disk_bytes: u64,
}

impl TierStats {
    /// Counters accumulated since `earlier` (gauges and peaks as they are now).
    pub fn minus(&self, earlier: &TierStats) -> TierStats {
        TierStats {
            evictions: self.evictions - earlier.evictions,
            fetched_bytes: self.fetched_bytes - earlier.fetched_bytes,
            spilled_bytes: self.spilled_bytes - earlier.spilled_bytes,
            stall_us: self.stall_us - earlier.stall_us,
            ..*self
        }
    }
}

/// The off-device tiers of one allocator.
#[derive(Debug)]
pub struct TierState {
    /// Configuration.
    pub cfg: TierConfig,
    /// Off-device tensors by handle slot.
    pub entries: FxHashMap<u32, Offloaded>,
    /// The disk tier.
    pub disk: DiskTier,
    /// Counters and gauges.
    pub stats: TierStats,
    /// Prefetched tensors whose copy ends at this workload time.
    pub ready_at: FxHashMap<u32, f64>,
    /// A prefetch is placing a block: no eviction, no OOM counted.
    pub prefetching: bool,
    /// The slot being brought back (never spilled to make room for itself).
    pub bringing: Option<u32>,
    /// Live bytes on every tier when the current phase began, and the most since.
    phase_live: (u64, u64),
    /// Growth of live bytes over each phase, as last seen (the prefetch
    /// headroom of the next time that phase comes).
    growth: FxHashMap<Option<Phase>, u64>,
    now_us: f64,
    /// When the device-to-host copy engine is free (evictions, spills).
    d2h_free_us: f64,
    /// When the host-to-device copy engine is free (bring-backs, prefetches).
    h2d_free_us: f64,
}

impl TierState {
    /// Tiers configured by `cfg` (the disk directory is created on first spill).
    pub fn new(cfg: TierConfig) -> Self {
        let disk = DiskTier::new(cfg.spill_dir.clone(), cfg.disk_quota, cfg.io_threads);
        TierState {
            cfg,
            entries: FxHashMap::default(),
            disk,
            stats: TierStats::default(),
            ready_at: FxHashMap::default(),
            prefetching: false,
            bringing: None,
            phase_live: (0, 0),
            growth: FxHashMap::default(),
            now_us: 0.0,
            d2h_free_us: 0.0,
            h2d_free_us: 0.0,
        }
    }

    /// Free bytes on the host tier.
    pub fn host_free(&self) -> u64 {
        self.cfg.host_capacity.saturating_sub(self.stats.host_bytes)
    }

    /// Accounts `bytes` arriving on (`+`) or leaving (`-`) a tier.
    pub fn add(&mut self, disk: bool, bytes: u64) {
        let s = &mut self.stats;
        if disk {
            s.disk_bytes += bytes;
            s.peak_disk_bytes = s.peak_disk_bytes.max(s.disk_bytes);
        } else {
            s.host_bytes += bytes;
            s.peak_host_bytes = s.peak_host_bytes.max(s.host_bytes);
        }
    }

    /// See [`TierState::add`].
    pub fn sub(&mut self, disk: bool, bytes: u64) {
        if disk {
            self.stats.disk_bytes -= bytes;
        } else {
            self.stats.host_bytes -= bytes;
        }
    }

    /// Copy time of `bytes` between device and host, microseconds.
    pub fn host_us(&self, bytes: u64) -> f64 {
        bytes as f64 / (self.cfg.host_gbps * 1e3)
    }

    /// Transfer time of `bytes` to or from a spill file, microseconds.
    pub fn disk_us(&self, bytes: u64) -> f64 {
        bytes as f64 / (self.cfg.disk_gbps * 1e3)
    }

    /// A copy the workload waits for, on the device-to-host engine
    /// (`to_device == false`) or the host-to-device one: it starts when that
    /// engine is free and the workload stalls until it ends.
    pub fn copy_sync(&mut self, us: f64, to_device: bool) {
        let engine = if to_device { &mut self.h2d_free_us } else { &mut self.d2h_free_us };
        let end = self.now_us.max(*engine) + us;
        *engine = end;
        self.stats.stall_us += end - self.now_us;
        self.now_us = end;
    }

    /// A host-to-device copy queued on its engine without waiting; returns
    /// the workload time it ends.
    pub fn copy_async(&mut self, us: f64) -> f64 {
        let end = self.now_us.max(self.h2d_free_us) + us;
        self.h2d_free_us = end;
        end
    }

    /// A use of `bytes`: waits for a prefetch of `slot` still in flight,
    /// then advances the workload clock by the use's modelled time.
    pub fn on_use(&mut self, slot: u32, bytes: u64) {
        if !self.ready_at.is_empty() {
            if let Some(t) = self.ready_at.remove(&slot) {
                if t > self.now_us {
                    self.stats.stall_us += t - self.now_us;
                    self.now_us = t;
                }
            }
        }
        self.now_us += bytes as f64 / (self.cfg.workload_gbps * 1e3);
    }

    /// Notes the live bytes on the device after an allocation.
    #[inline]
    pub fn note_live(&mut self, device_live: u64) {
        let total = device_live + self.stats.host_bytes + self.stats.disk_bytes;
        self.phase_live.1 = self.phase_live.1.max(total);
    }

    /// A phase boundary from `old` to `new` with `device_live` bytes live on
    /// the device: records how much `old` grew, and returns how much `new`
    /// grew the last time (`None` the first time).
    pub fn phase_boundary(&mut self, old: Option<Phase>, new: Option<Phase>, device_live: u64) -> Option<u64> {
        let total = device_live + self.stats.host_bytes + self.stats.disk_bytes;
        let (start, peak) = self.phase_live;
        self.growth.insert(old, peak.saturating_sub(start));
        self.phase_live = (total, total);
        self.growth.get(&new).copied()
    }

    /// The workload clock, simulated microseconds.
    pub fn now_us(&self) -> f64 {
        self.now_us
    }
}
