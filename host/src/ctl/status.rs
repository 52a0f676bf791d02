//! What `status` reports, and its text rendering.

use std::fmt::Write;

use serde::{Deserialize, Serialize};

use crate::alloc::Allocator;
use crate::decision::Role;
use crate::device::Device;
use crate::shadow::ShadowHandle;
use crate::types::human_bytes;

/// The state of a running process: every rank, every shadow.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Status {
    /// Process id of the server.
    pub pid: u32,
    /// The process's rank in its job (`RANK`), for a process that is one rank
    /// of a multi-process job (PyTorch under `torchrun`); `None` otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub process_rank: Option<u32>,
    /// Current training step, when the driver reports one.
    #[serde(default)]
    pub step: Option<u64>,
    /// One entry per rank.
    pub ranks: Vec<RankStatus>,
    /// One entry per shadow (`--shadow`).
    #[serde(default)]
    pub shadows: Vec<ShadowSummary>,
}

/// The state of one rank's allocator.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RankStatus {
    /// Rank.
    pub rank: usize,
    /// The device this allocator serves, when the process has one allocator
    /// per device (the C ABI); `None` for a rank of `wasmem train`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<u32>,
    /// Active policy per role.
    pub policies: RolePolicies,
    /// Failure accounting per role (placement, reclamation, eviction).
    pub health: Vec<RoleHealthView>,
    /// Byte gauges and their peaks.
    pub memory: MemoryView,
    /// Counters since the start.
    pub counters: Counters,
    /// The host and disk tiers, when enabled.
    #[serde(default)]
    pub tiers: Option<TierView>,
}

/// The off-device tiers of one allocator.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct TierView {
    /// Bytes on the host tier now.
    pub host_bytes: u64,
    /// Peak of `host_bytes`.
    pub peak_host_bytes: u64,
    /// Bytes on the disk tier now.
    pub disk_bytes: u64,
    /// Peak of `disk_bytes`.
    pub peak_disk_bytes: u64,
    /// Tensors moved off the device.
    pub evictions: u64,
    /// Bytes brought back on demand.
    pub fetched_bytes: u64,
    /// Bytes moved from host to disk.
    pub spilled_bytes: u64,
    /// Simulated time waited for copies, microseconds.
    pub stall_us: f64,
}

/// The active policy of each role.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RolePolicies {
    /// Placement.
    pub placement: String,
    /// Reclamation.
    pub reclamation: String,
    /// Eviction.
    pub eviction: String,
}

/// Failure accounting of one role.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RoleHealthView {
    /// The role.
    pub role: String,
    /// Calls into its policies.
    pub calls: u64,
    /// Calls that trapped or hit a limit.
    pub traps: u64,
    /// Calls decided by the built-in default.
    pub fallbacks: u64,
    /// Whether the policy was disabled after consecutive failures.
    pub disabled: bool,
    /// The last failure.
    #[serde(default)]
    pub last_error: Option<String>,
}

/// Byte gauges of one allocator.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryView {
    /// Requested bytes of live tensors.
    pub live_bytes: u64,
    /// Peak of `live_bytes`.
    pub peak_live_bytes: u64,
    /// Bytes of blocks holding tensors.
    pub allocated_bytes: u64,
    /// Peak of `allocated_bytes`.
    pub peak_allocated_bytes: u64,
    /// Bytes of segments held.
    pub reserved_bytes: u64,
    /// Peak of `reserved_bytes`.
    pub peak_reserved_bytes: u64,
    /// Segments held.
    pub segments: u64,
    /// Device capacity.
    pub capacity_bytes: u64,
}

/// Counters of one allocator.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counters {
    /// Successful allocations.
    pub allocs: u64,
    /// Frees.
    pub frees: u64,
    /// Allocations served from cache.
    pub cache_hits: u64,
    /// Requests that failed after every remedy.
    pub ooms: u64,
    /// Segment allocations.
    pub device_alloc_calls: u64,
    /// Segment releases.
    pub device_free_calls: u64,
    /// Device synchronizations.
    pub device_syncs: u64,
    /// Calls into policies.
    pub policy_calls: u64,
    /// Policy calls that trapped or hit a limit.
    pub policy_traps: u64,
    /// Calls decided by the default.
    pub policy_fallbacks: u64,
    /// Bytes evicted.
    pub evicted_bytes: u64,
    /// Bytes released by reclamation.
    pub reclaimed_bytes: u64,
}

/// A shadow's figures beside its rank's.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ShadowSummary {
    /// Rank whose events the shadow sees.
    pub rank: usize,
    /// Device whose events the shadow sees (the C ABI's allocators); `None`
    /// for a rank of `wasmem train`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<u32>,
    /// The shadow policy spec.
    pub label: String,
    /// Active policy per role in the shadow.
    pub policies: RolePolicies,
    /// Events seen.
    pub events: u64,
    /// Peak reserved bytes the shadow policy would have had.
    pub peak_reserved_bytes: u64,
    /// Peak allocated bytes.
    pub peak_allocated_bytes: u64,
    /// Segment allocations.
    pub device_alloc_calls: u64,
    /// Out-of-memory outcomes.
    pub ooms: u64,
    /// Calls decided by the default.
    pub policy_fallbacks: u64,
    /// Events the shadow could not apply.
    pub errors: u64,
    /// Disabled by an internal failure.
    pub disabled: bool,
}

fn role_policies(names: [String; 3]) -> RolePolicies {
    let [placement, reclamation, eviction] = names;
    RolePolicies { placement, reclamation, eviction }
}

/// The status of one allocator.
pub fn rank_status<D: Device>(rank: usize, a: &Allocator<D>) -> RankStatus {
    let s = a.stats();
    let g = s.bytes;
    let health = [Role::Placement, Role::Reclamation, Role::Eviction]
        .iter()
        .map(|&r| {
            let h = a.policies().health(r);
            RoleHealthView {
                role: r.to_string(),
                calls: h.calls,
                traps: h.traps,
                fallbacks: h.fallbacks,
                disabled: h.disabled,
                last_error: h.last_error.clone(),
            }
        })
        .collect();
    RankStatus {
        rank,
        device: None,
        policies: role_policies(a.policies().names()),
        health,
        memory: MemoryView {
            live_bytes: g.live_bytes,
            peak_live_bytes: g.peak_live_bytes,
            allocated_bytes: g.allocated_bytes,
            peak_allocated_bytes: g.peak_allocated_bytes,
            reserved_bytes: g.reserved_bytes,
            peak_reserved_bytes: g.peak_reserved_bytes,
            segments: g.segments,
            capacity_bytes: a.device().capacity(),
        },
        counters: Counters {
            allocs: s.allocs,
            frees: s.frees,
            cache_hits: s.cache_hits,
            ooms: s.ooms,
            device_alloc_calls: s.device_alloc_calls,
            device_free_calls: s.device_free_calls,
            device_syncs: s.device_syncs,
            policy_calls: s.policy_calls,
            policy_traps: s.policy_traps,
            policy_fallbacks: s.policy_fallbacks,
            evicted_bytes: s.evicted_bytes,
            reclaimed_bytes: s.reclaimed_bytes,
        },
        tiers: a.tier_state().map(|_| {
            let t = a.tier_stats();
            TierView {
                host_bytes: t.host_bytes,
                peak_host_bytes: t.peak_host_bytes,
                disk_bytes: t.disk_bytes,
                peak_disk_bytes: t.peak_disk_bytes,
                evictions: t.evictions,
                fetched_bytes: t.fetched_bytes,
                spilled_bytes: t.spilled_bytes,
                stall_us: t.stall_us,
            }
        }),
    }
}

/// The summary of a shadow fed by rank `rank`.
pub fn shadow_summary(rank: usize, h: &ShadowHandle) -> ShadowSummary {
    let st = h.status();
    ShadowSummary {
        rank,
        device: None,
        label: st.label,
        policies: role_policies(st.policies),
        events: st.metrics.events,
        peak_reserved_bytes: st.metrics.peak_reserved_bytes,
        peak_allocated_bytes: st.metrics.peak_allocated_bytes,
        device_alloc_calls: st.metrics.device_alloc_calls,
        ooms: st.metrics.ooms,
        policy_fallbacks: st.metrics.policy_fallbacks,
        errors: st.errors,
        disabled: st.disabled,
    }
}

/// `status` as text for `wasmem ctl status`.
pub fn render(s: &Status) -> String {
    let mut o = String::new();
    let step = s.step.map_or_else(|| "step unknown".to_string(), |n| format!("step {n}"));
    let of = s.process_rank.map_or_else(String::new, |r| format!(" · process rank {r}"));
    let _ = writeln!(o, "wasmem pid {}{of} · {step} · {} rank(s)", s.pid, s.ranks.len());
    for r in &s.ranks {
        let p = &r.policies;
        let (m, c) = (&r.memory, &r.counters);
        let dev = r.device.map_or_else(String::new, |d| format!(" (device {d})"));
        let _ = writeln!(
            o,
            "rank {}{dev}: placement={} reclamation={} eviction={}",
            r.rank, p.placement, p.reclamation, p.eviction
        );
        let _ = writeln!(
            o,
            "  memory: live {} (peak {}), allocated {} (peak {}), reserved {} (peak {}) in {} segments of {}",
            human_bytes(m.live_bytes),
            human_bytes(m.peak_live_bytes),
            human_bytes(m.allocated_bytes),
            human_bytes(m.peak_allocated_bytes),
            human_bytes(m.reserved_bytes),
            human_bytes(m.peak_reserved_bytes),
            m.segments,
            human_bytes(m.capacity_bytes)
        );
        let _ = writeln!(
            o,
            "  counters: {} allocs ({} cache hits), {} frees, {} OOMs, {} device allocs / {} frees / {} syncs, \
             {} policy calls ({} traps, {} fallbacks), evicted {}, reclaimed {}",
            c.allocs,
            c.cache_hits,
            c.frees,
            c.ooms,
            c.device_alloc_calls,
            c.device_free_calls,
            c.device_syncs,
            c.policy_calls,
            c.policy_traps,
            c.policy_fallbacks,
            human_bytes(c.evicted_bytes),
            human_bytes(c.reclaimed_bytes)
        );
        if let Some(t) = &r.tiers {
            let _ = writeln!(
                o,
                "  tiers: host {} (peak {}), disk {} (peak {}), {} evictions, fetched {}, spilled {}, stalled {:.3} ms",
                human_bytes(t.host_bytes),
                human_bytes(t.peak_host_bytes),
                human_bytes(t.disk_bytes),
                human_bytes(t.peak_disk_bytes),
                t.evictions,
                human_bytes(t.fetched_bytes),
                human_bytes(t.spilled_bytes),
                t.stall_us / 1e3
            );
        }
        for h in &r.health {
            let _ = write!(o, "  {}: {} calls, {} traps, {} fallbacks", h.role, h.calls, h.traps, h.fallbacks);
            if h.disabled {
                o.push_str(", DISABLED");
            }
            if let Some(e) = &h.last_error {
                let _ = write!(o, ", last error: {e}");
            }
            o.push('\n');
        }
    }
    for sh in &s.shadows {
        let dev = sh.device.map_or_else(String::new, |d| format!(" device {d}"));
        let _ = writeln!(
            o,
            "shadow of rank {}{dev} ({}: placement={} reclamation={} eviction={}): {} events, peak reserved {}, \
             peak allocated {}, {} device allocs, {} OOMs, {} fallbacks, {} errors{}",
            sh.rank,
            sh.label,
            sh.policies.placement,
            sh.policies.reclamation,
            sh.policies.eviction,
            sh.events,
            human_bytes(sh.peak_reserved_bytes),
            human_bytes(sh.peak_allocated_bytes),
            sh.device_alloc_calls,
            sh.ooms,
            sh.policy_fallbacks,
            sh.errors,
            if sh.disabled { ", DISABLED" } else { "" }
        );
    }
    o
}
