//! The caching allocator: segments from the device, blocks carved from them,
//! pools of free blocks, and the handle table.
//!
//! ```text
//!  alloc(bytes, kind, stream) ──► placement decision (pool, rounding, growth, split)
//!        │ best fit in pool.free[(stream, size, addr)] ──hit──► split? ──► handle
//!        └─miss──► device.alloc_segment ──OOM──► reclamation decision ──► retry once
//!                                      └─still OOM, tiers on──► compaction, eviction (tiering)
//!  free(id) ──► merge with free neighbours ──► pool.free (or release if uncached pool)
//! ```
//!
//! Invariants (every one checked by [`Allocator::check_invariants`], which
//! tests call after every operation):
//! - the blocks of a segment tile it without gaps or overlap;
//! - no two neighbouring blocks are both free;
//! - a block is free ⇔ it is in its pool's free index under its current key;
//! - every live tensor on the device maps to exactly one allocated block and
//!   back; a tensor on the host or disk tier holds no block (see
//!   [`tiering`](self), whose invariants `check_invariants` checks too);
//! - `reserved = Σ segment sizes`, `allocated = Σ allocated block sizes`,
//!   `live = Σ requested bytes of live tensors`, per pool and in total;
//! - `live ≤ allocated ≤ reserved ≤ device capacity`;
//! - a pending block (a freed block waiting on events of other streams, see
//!   [`deferred`](self)) is neither in a free index nor holds a tensor, is on
//!   the pending list exactly once, and `pending_bytes = Σ pending sizes`;
//!   `allocated + pending ≤ reserved`;
//! - a pinned tensor is live, and compaction never moves it.
//!
//! A failed request (error value, including out-of-memory) leaves every live
//! tensor, its block and address, and the live/allocated accounting unchanged;
//! the only state an out-of-memory path may change is cached memory released
//! by the reclamation remedy, and it is not even tried when the device reports
//! that releasing everything cached could not make room. With the tiers
//! enabled, tensors moved off the device (and blocks moved by compaction)
//! while trying to serve a request stay moved, with their contents, when the
//! request still fails.

mod arena;
mod check;
mod compact;
mod deferred;
mod free_index;
mod grow;
mod handles;
mod latency;
mod paged;
mod period;
mod plan_cache;
mod planned;
mod policies;
mod pool;
pub mod shared;
mod slab;
mod stats;
pub mod swap;
mod tiering;

pub use deferred::PendingView;
pub use handles::Tensor;
pub use latency::LatencyHistogram;
pub use plan_cache::{check_plan_cache, CacheError as PlanCacheError, CacheSummary as PlanCacheSummary};
pub use policies::{NoDecision, PolicySet, RoleHealth, SAMPLE_EVERY};
pub use pool::Pool;
pub use shared::SharedAllocator;
pub use slab::{Block, Segment, NIL};
pub use stats::{Gauges, PauseHistogram, Stats};

use crate::decision::Policies;
use crate::decision::{
    AllocRequest, EvictionCandidate, EvictionPolicy, PlacementPolicy, PolicyContext, ReclaimDecision, ReclaimTrigger,
    ReclamationPolicy,
};
use crate::device::{Device, DeviceError, DevicePtr};
use crate::tier::{TierError, TierState};
use crate::types::{Phase, StreamId, TensorId, TensorKind, Tier};

use arena::Arena;
use deferred::Deferred;
use handles::HandleTable;
use paged::Paging;
use pool::FreeKey;

/// Largest single request accepted (1 PiB): larger sizes are certainly bogus.
pub const MAX_ALLOC: u64 = 1 << 50;

/// Why an allocator operation failed. The state is unchanged unless noted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AllocError {
    /// A request for zero bytes.
    #[error("zero-byte allocation requested ({kind} on {stream})")]
    ZeroSize {
        /// Kind of the request.
        kind: TensorKind,
        /// Stream of the request.
        stream: StreamId,
    },
    /// A request larger than [`MAX_ALLOC`].
    #[error("request of {bytes} bytes exceeds the largest supported allocation ({MAX_ALLOC} bytes)")]
    TooLarge {
        /// Requested bytes.
        bytes: u64,
    },
    /// The device could not provide the memory, even after reclamation.
    #[error(
        "out of memory: {kind} request of {bytes} bytes on {stream} needs a new segment of {segment_bytes} bytes; \
         device capacity {capacity}, reserved {reserved}, live {live}"
    )]
    OutOfMemory {
        /// Requested bytes.
        bytes: u64,
        /// Kind of the request.
        kind: TensorKind,
        /// Stream of the request.
        stream: StreamId,
        /// Segment size that could not be obtained.
        segment_bytes: u64,
        /// Bytes reserved when it failed.
        reserved: u64,
        /// Live bytes when it failed.
        live: u64,
        /// Device capacity.
        capacity: u64,
    },
    /// The handle is not a live tensor (never issued, or already freed).
    #[error("{0} is not a live tensor (never allocated, or already freed)")]
    UnknownTensor(TensorId),
    /// An access outside the tensor's bytes.
    #[error("access of {len} bytes at offset {offset} is outside {id} ({bytes} bytes)")]
    OutOfBounds {
        /// The tensor.
        id: TensorId,
        /// Offset of the access.
        offset: u64,
        /// Length of the access.
        len: u64,
        /// Size of the tensor.
        bytes: u64,
    },
    /// No pool has this name.
    #[error("no pool is named `{0}`")]
    UnknownPool(String),
    /// The device failed in an unexpected way.
    #[error("device error: {0}")]
    Device(DeviceError),
    /// Neither the policy nor the fallback gave a valid decision.
    #[error("{0}")]
    NoDecision(Box<NoDecision>),
    /// A move between tiers failed; the tensor stayed on its previous tier.
    #[error(transparent)]
    Tier(#[from] TierError),
    /// The tensor is not on the device (an address was asked for).
    #[error("{id} is on the {tier:?} tier, not on the device")]
    NotResident {
        /// The tensor.
        id: TensorId,
        /// Where it is.
        tier: Tier,
    },
}

impl From<DeviceError> for AllocError {
    fn from(e: DeviceError) -> Self {
        AllocError::Device(e)
    }
}

pub use crate::types::InvariantError;

/// A read-only view of one live tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TensorInfo {
    /// Requested bytes.
    pub bytes: u64,
    /// Kind.
    pub kind: TensorKind,
    /// Stream.
    pub stream: StreamId,
    /// Current device address (valid until the next allocator call).
    pub address: DevicePtr,
    /// Size of the block holding it.
    pub block_bytes: u64,
    /// Name of its pool.
    pub pool: u32,
}

/// What happened, for recorders (snapshot export, plots).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ActionKind {
    /// A block was handed to a tensor.
    Alloc,
    /// A tensor's block was returned to its pool.
    Free,
    /// A segment was obtained from the device.
    SegmentAlloc,
    /// A segment was released to the device.
    SegmentFree,
}

/// One recorded allocator action.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Action {
    /// What happened.
    pub kind: ActionKind,
    /// Address of the block or segment.
    pub addr: DevicePtr,
    /// Size of the block or segment (for `Alloc`/`Free`: the requested bytes).
    pub size: u64,
    /// Stream.
    pub stream: StreamId,
    /// Logical clock.
    pub clock: u64,
    /// Kind of the tensor (for `Alloc` and `Free`).
    pub tensor_kind: Option<TensorKind>,
}

/// One block of a [`SegmentView`]: `(offset, size, (requested bytes, kind) if allocated)`.
pub type BlockView = (u64, u64, Option<(u64, TensorKind)>);

/// A read-only view of one segment and its blocks, lowest address first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentView {
    /// Base address.
    pub base: DevicePtr,
    /// Size in bytes.
    pub size: u64,
    /// Pool name.
    pub pool: String,
    /// Stream.
    pub stream: StreamId,
    /// The blocks, lowest address first.
    pub blocks: Vec<BlockView>,
}

/// The caching allocator over a device `D`: owned parts, each with its
/// own invariants and check (see the module documentation).
pub struct Allocator<D: Device> {
    device: D,
    /// Segments, blocks and pools (`arena`).
    arena: Arena,
    /// Live tensors and pins (`handles`).
    tensors: HandleTable,
    /// Cross-stream uses and frees waiting on stream events (`deferred`).
    deferred: Deferred,
    /// Physical pages of paged segments and their reservations (`paged`).
    paging: Paging,
    /// Host and disk tiers, when enabled (`tiering`).
    tiers: Option<Box<TierState>>,
    /// Planned placement, when a planner is installed (`planned`).
    planning: Option<Box<planned::Planning>>,
    /// Tensors never move: their addresses are held outside the engine
    /// (the C ABI, PyTorch). Compaction and arena installs then copy nothing.
    stable_addresses: bool,
    /// The active policies, the fallback, memo and health (`policies`).
    policies: PolicySet,
    stats: Stats,
    gc_pauses: PauseHistogram,
    /// Logical clock: operations so far.
    clock: u64,
    phase: Option<Phase>,
    step: u64,
    recorder: Option<Vec<Action>>,
}

impl<D: Device> Allocator<D> {
    /// An allocator over `device` driven by `policies`, with the built-in
    /// default (`pytorch`) as the fallback of every role.
    pub fn new(device: D, policies: Policies) -> Self {
        Self::with_fallback(device, policies, crate::builtin::default_policies())
    }

    /// An allocator over `device` driven by `policies`, where `fallback`
    /// decides every call that a policy fails or answers invalidly.
    pub fn with_fallback(device: D, policies: Policies, fallback: Policies) -> Self {
        let mut a = Allocator {
            device,
            arena: Arena::default(),
            tensors: HandleTable::default(),
            deferred: Deferred::default(),
            paging: Paging::default(),
            tiers: None,
            planning: None,
            stable_addresses: false,
            policies: PolicySet::new(policies, fallback),
            stats: Stats::default(),
            gc_pauses: PauseHistogram::default(),
            clock: 0,
            phase: None,
            step: 0,
            recorder: None,
        };
        let fallback_pools = a.policies.fallback().placement.pools();
        a.policies.fallback_pool_map = a.register_pools(&fallback_pools);
        let pools = a.policies.active().placement.pools();
        a.policies.pool_map = a.register_pools(&pools);
        a
    }

    /// An allocator over `device` with the built-in policy set `name` (and
    /// its planner, for `planned`).
    pub fn with_builtin(device: D, name: &str) -> Option<Self> {
        let mut a = crate::builtin::by_name(name).map(|p| Self::new(device, p))?;
        a.set_planner(crate::builtin::planner_by_name(name));
        Some(a)
    }

    /// An allocator over `device` driven by a resolved spec: its policies,
    /// and its planner when it has one.
    pub fn from_resolved(device: D, r: crate::spec::Resolved) -> Self {
        let mut a = Self::new(device, r.policies);
        a.set_planner(r.planner);
        a
    }

    fn register_pools(&mut self, specs: &[crate::decision::PoolSpec]) -> Vec<u32> {
        specs
            .iter()
            .map(|s| match self.arena.pools.iter().position(|p| p.name == s.name) {
                Some(i) => {
                    self.arena.pools[i].release_when_empty = s.release_when_empty;
                    i as u32
                }
                None => {
                    self.arena.pools.push(Pool::new(&s.name, s.release_when_empty));
                    (self.arena.pools.len() - 1) as u32
                }
            })
            .collect()
    }

    /// Replaces the placement policy (between two decisions) and returns
    /// the old one. Its pools are matched to existing pools by name; new
    /// names become new pools. Hot swaps go through [`swap::swap`], which
    /// also carries learned state.
    pub fn set_placement(&mut self, p: Box<dyn PlacementPolicy>) -> Box<dyn PlacementPolicy> {
        let pools = p.pools();
        let old = self.policies.set_placement(p);
        self.policies.pool_map = self.register_pools(&pools);
        old
    }

    /// Replaces the reclamation policy and returns the old one.
    pub fn set_reclamation(&mut self, p: Box<dyn ReclamationPolicy>) -> Box<dyn ReclamationPolicy> {
        self.policies.set_reclamation(p)
    }

    /// Replaces the eviction policy and returns the old one.
    pub fn set_eviction(&mut self, p: Box<dyn EvictionPolicy>) -> Box<dyn EvictionPolicy> {
        self.policies.set_eviction(p)
    }

    /// The policies and their health.
    pub fn policies(&self) -> &PolicySet {
        &self.policies
    }

    /// The policies, mutably (e.g. to set the failure threshold).
    pub fn policies_mut(&mut self) -> &mut PolicySet {
        &mut self.policies
    }

    /// The device.
    pub fn device(&self) -> &D {
        &self.device
    }

    /// The device, mutably (for backend-specific controls such as sim time).
    pub fn device_mut(&mut self) -> &mut D {
        &mut self.device
    }

    /// Declares that tensors must never move (their addresses are held
    /// outside the engine, as through the C ABI): compaction moves nothing
    /// and a planned arena is installed without moving live tensors into it.
    pub fn set_stable_addresses(&mut self, on: bool) {
        self.stable_addresses = on;
    }

    /// Starts or stops recording [`Action`]s.
    pub fn record_actions(&mut self, on: bool) {
        self.recorder = if on { Some(self.recorder.take().unwrap_or_default()) } else { None };
    }

    /// Takes the recorded actions.
    pub fn take_actions(&mut self) -> Vec<Action> {
        self.recorder.as_mut().map(std::mem::take).unwrap_or_default()
    }

    #[inline]
    fn record(&mut self, kind: ActionKind, addr: DevicePtr, size: u64, stream: StreamId, t: Option<TensorKind>) {
        if let Some(r) = self.recorder.as_mut() {
            r.push(Action { kind, addr, size, stream, clock: self.clock, tensor_kind: t });
        }
    }

    /// Statistics so far.
    pub fn stats(&self) -> Stats {
        let mut s = self.stats.clone();
        let (calls, traps, fallbacks) = self.policies.totals();
        s.policy_calls = calls;
        s.policy_traps = traps;
        s.policy_fallbacks = fallbacks;
        s
    }

    /// Starts new peaks from the current gauges (whole allocator and pools),
    /// e.g. to measure the second half of a replay after a policy swap.
    pub fn reset_peaks(&mut self) {
        for g in std::iter::once(&mut self.stats.bytes).chain(self.arena.pools.iter_mut().map(|p| &mut p.gauges)) {
            g.peak_live_bytes = g.live_bytes;
            g.peak_allocated_bytes = g.allocated_bytes;
            g.peak_reserved_bytes = g.reserved_bytes;
        }
    }

    /// Byte gauges of the whole allocator (cheap).
    pub fn gauges(&self) -> &Gauges {
        &self.stats.bytes
    }

    /// The pools (names, gauges, free indices).
    pub fn pools(&self) -> &[Pool] {
        &self.arena.pools
    }

    /// Logical clock: number of operations so far.
    pub fn clock(&self) -> u64 {
        self.clock
    }

    /// Number of live tensors.
    pub fn live_tensors(&self) -> usize {
        self.tensors.len()
    }

    /// Handles of all live tensors.
    pub fn tensor_ids(&self) -> Vec<TensorId> {
        self.tensors.iter().map(|(id, _)| id).collect()
    }

    /// The state policies may read.
    #[inline]
    pub fn context(&self) -> PolicyContext {
        let g = &self.stats.bytes;
        PolicyContext {
            clock: self.clock,
            phase: self.phase,
            step: self.step,
            live_bytes: g.live_bytes,
            allocated_bytes: g.allocated_bytes,
            reserved_bytes: g.reserved_bytes,
            peak_reserved_bytes: g.peak_reserved_bytes,
            capacity_bytes: self.device.capacity(),
        }
    }

    /// Allocates `bytes` for a tensor of `kind` on `stream`.
    pub fn alloc(&mut self, bytes: u64, kind: TensorKind, stream: StreamId) -> Result<TensorId, AllocError> {
        if bytes == 0 {
            return Err(AllocError::ZeroSize { kind, stream });
        }
        if bytes > MAX_ALLOC {
            return Err(AllocError::TooLarge { bytes });
        }
        if !self.deferred.pending.is_empty() {
            self.poll_pending()?;
        }
        let req = AllocRequest { bytes, kind, stream };
        self.plan_detect(&req)?;
        let (block, pool) = match self.planned_block(&req)? {
            Some(b) => b,
            None => match self.place_block(&req) {
                // Free space in a planned arena is the last resort.
                Err(e @ AllocError::OutOfMemory { .. }) => self.arena_fallback(&req).ok_or(e)?,
                placed => placed?,
            },
        };
        self.clock += 1;
        let pool = pool as usize;
        let b = *self.arena.blocks.get(block);
        debug_assert_eq!(self.arena.segments.get(b.segment).pool as usize, pool);
        let size = b.size;
        let id = self.tensors.insert(Tensor {
            block,
            bytes,
            kind,
            stream,
            last_use: self.clock,
            use_count: 0,
            cross_stream: false,
            tier: Tier::Device,
            phase: self.phase,
            next_use: None,
        });
        self.arena.blocks.get_mut(block).tensor = id.slot;
        self.stats.allocs += 1;
        self.stats.bytes.add_live(bytes, size);
        self.arena.pools[pool].gauges.add_live(bytes, size);
        if let Some(ts) = self.tiers.as_deref_mut() {
            ts.note_live(self.stats.bytes.live_bytes);
        }
        if self.recorder.is_some() {
            let addr = self.arena.segments.get(b.segment).base + b.offset;
            self.record(ActionKind::Alloc, addr, bytes, stream, Some(kind));
        }
        self.plan_record_alloc(id, &req, pool);
        Ok(id)
    }

    /// Finds a block for `req` (placement decision, cached block or a new
    /// segment, eviction when tiers are enabled), split to size. The block
    /// holds no tensor yet and is not in the free index. Returns the block
    /// and its pool.
    #[inline(always)]
    fn place_block(&mut self, req: &AllocRequest) -> Result<(u32, u32), AllocError> {
        let (stream, ctx) = (req.stream, self.context());
        let p = self.policies.place(req, &ctx).map_err(AllocError::NoDecision)?;
        if p.memo_hit {
            self.stats.policy_memo_hits += 1;
        }
        let pool = p.pool as usize;
        let (block, indexed) = match self.arena.pools[pool].best_fit(stream, p.rounded, p.decision.max_waste) {
            Some(key) => {
                self.stats.cache_hits += 1;
                (key.3, Some(key))
            }
            None => {
                let segment = self.miss_segment(p.segment, p.rounded);
                if let Some(served) = self.lend_idle_arena(req, segment) {
                    return Ok(served);
                }
                let g = grow::Growth {
                    pool: p.pool,
                    segment,
                    rounded: p.rounded,
                    max_waste: p.decision.max_waste,
                    req: *req,
                };
                let blk = self.grow_or_evict(&g)?;
                tracing::trace!(
                    bytes = req.bytes,
                    reserved = self.stats.bytes.reserved_bytes,
                    peak = self.stats.bytes.peak_reserved_bytes,
                    live = self.stats.bytes.live_bytes,
                    "the dynamic path grows"
                );
                (blk, None)
            }
        };
        // Split off the remainder when the decision says so; a cached block's
        // index entry becomes the remainder's in place.
        let b = *self.arena.blocks.get(block);
        let remainder = b.size - p.rounded;
        if remainder > 0 && (remainder >= p.decision.split_min_remainder || self.extensible_end(&b)) {
            let rest = self.arena.blocks.insert(Block {
                segment: b.segment,
                offset: b.offset + p.rounded,
                size: remainder,
                prev: block,
                next: b.next,
                tensor: NIL,
            });
            if b.next != NIL {
                self.arena.blocks.get_mut(b.next).prev = rest;
            }
            let blk = self.arena.blocks.get_mut(block);
            blk.next = rest;
            blk.size = p.rounded;
            let seg = self.arena.segments.get(b.segment);
            let key = (seg.stream, remainder, seg.base + b.offset + p.rounded, rest);
            match indexed {
                Some(old) => {
                    self.arena.pools[pool].free.replace(&old, key);
                }
                None => self.arena.pools[pool].free.insert(key),
            }
        } else if let Some(old) = indexed {
            self.arena.pools[pool].free.remove(&old);
        }
        Ok((block, p.pool))
    }

    /// Frees a tensor: its block returns to its pool, merged with free neighbours.
    pub fn free(&mut self, id: TensorId) -> Result<(), AllocError> {
        let t = self.tensors.remove(id).ok_or(AllocError::UnknownTensor(id))?;
        self.clock += 1;
        self.plan_record_free(id);
        if t.tier != Tier::Device {
            self.free_offloaded(id);
            return Ok(());
        }
        if let Some(ts) = self.tiers.as_mut() {
            ts.ready_at.remove(&id.slot);
        }
        let blk = t.block;
        let b = self.arena.blocks.get_mut(blk);
        b.tensor = NIL;
        let seg_idx = b.segment;
        let size = b.size;
        let seg = *self.arena.segments.get(seg_idx);
        let pool = seg.pool as usize;
        self.stats.frees += 1;
        self.stats.bytes.sub_live(t.bytes, size);
        self.arena.pools[pool].gauges.sub_live(t.bytes, size);
        if self.recorder.is_some() {
            let addr = seg.base + self.arena.blocks.get(blk).offset;
            self.record(ActionKind::Free, addr, t.bytes, seg.stream, Some(t.kind));
        }
        // Both maps are empty or miss for most tensors: skip the hashing then.
        if !self.tensors.pins.is_empty() {
            self.tensors.pins.remove(&id.slot);
        }
        if t.cross_stream {
            if let Some(streams) = self.deferred.cross_uses.remove(&id.slot) {
                if self.defer_free(blk, &streams)? {
                    return Ok(());
                }
            }
        }
        self.return_block(blk)
    }

    /// Returns a block that holds no tensor to its pool: merges it with free
    /// neighbours, then indexes it, or releases its segment when the pool
    /// does not cache and the segment is entirely free.
    fn return_block(&mut self, mut blk: u32) -> Result<(), AllocError> {
        let (seg_idx, was) = {
            let b = self.arena.blocks.get(blk);
            (b.segment, b.offset)
        };
        let seg = *self.arena.segments.get(seg_idx);
        let pool = seg.pool as usize;
        // Index keys of the free neighbours merged into the block: the merged
        // block takes over one of their entries.
        let mut stale: [Option<FreeKey>; 2] = [None, None];
        // Merge with the previous block.
        let prev = self.arena.blocks.get(blk).prev;
        if prev != NIL && self.arena.blocks.get(prev).is_free() {
            let p = *self.arena.blocks.get(prev);
            stale[0] = Some((seg.stream, p.size, seg.base + p.offset, prev));
            let cur = self.arena.blocks.remove(blk);
            let pm = self.arena.blocks.get_mut(prev);
            pm.size += cur.size;
            pm.next = cur.next;
            if cur.next != NIL {
                self.arena.blocks.get_mut(cur.next).prev = prev;
            }
            blk = prev;
        }
        // Merge with the next block.
        let next = self.arena.blocks.get(blk).next;
        if next != NIL && self.arena.blocks.get(next).is_free() {
            let n = self.arena.blocks.remove(next);
            stale[1] = Some((seg.stream, n.size, seg.base + n.offset, next));
            let cm = self.arena.blocks.get_mut(blk);
            cm.size += n.size;
            cm.next = n.next;
            if n.next != NIL {
                self.arena.blocks.get_mut(n.next).prev = blk;
            }
        }
        let b = *self.arena.blocks.get(blk);
        if self.arena.pools[pool].planned {
            // An arena block: never in a free index.
            self.arena_block_freed(seg_idx, blk, was);
            if b.size == seg.size {
                self.release_suspended_arena(seg_idx)?;
            }
            return Ok(());
        }
        let release = self.arena.pools[pool].release_when_empty && b.size == seg.size;
        let free = &mut self.arena.pools[pool].free;
        if release {
            for k in stale.iter().flatten() {
                free.remove(k);
            }
            self.release_segment(seg_idx)?;
        } else {
            let key = (seg.stream, b.size, seg.base + b.offset, blk);
            match stale {
                [None, None] => free.insert(key),
                [Some(k), None] | [None, Some(k)] => {
                    free.replace(&k, key);
                }
                [Some(p), Some(n)] => {
                    free.remove(&n);
                    free.replace(&p, key);
                }
            }
        }
        Ok(())
    }

    /// Records a use of a tensor on `stream` (default: its own stream).
    pub fn use_tensor(&mut self, id: TensorId, stream: Option<StreamId>) -> Result<(), AllocError> {
        if self.tiers.is_some() {
            self.use_tiered(id)?;
        }
        let clock = self.clock + 1;
        let phase = self.phase;
        let t = self.tensors.get_mut(id).ok_or(AllocError::UnknownTensor(id))?;
        t.last_use = clock;
        t.use_count += 1;
        t.phase = phase;
        if let Some(s) = stream.filter(|&s| s != t.stream) {
            t.cross_stream = true;
            let others = self.deferred.cross_uses.entry(id.slot).or_default();
            if !others.contains(&s) {
                others.push(s);
            }
        }
        self.clock = clock;
        self.stats.uses += 1;
        Ok(())
    }

    /// Marks a training phase; the reclamation policy is consulted.
    pub fn phase(&mut self, phase: Phase, step: u64) -> Result<(), AllocError> {
        if !self.deferred.pending.is_empty() {
            self.poll_pending()?;
        }
        let old = self.phase.replace(phase);
        self.step = step;
        self.plan_phase(phase);
        self.run_reclaim(&ReclaimTrigger::Phase { phase, step })?;
        if phase == Phase::StepEnd {
            self.plan_step_end(step)?;
        }
        let live = self.stats.bytes.live_bytes;
        if let Some(growth) = self.tiers.as_deref_mut().and_then(|t| t.phase_boundary(old, Some(phase), live)) {
            self.prefetch(growth)?;
        }
        Ok(())
    }

    /// Consults the reclamation policy and applies its decision; returns
    /// whether it asked to stitch (meaningful on growth triggers).
    fn run_reclaim(&mut self, trigger: &ReclaimTrigger) -> Result<bool, AllocError> {
        // Planned arenas are neither the dynamic path's cache nor its to
        // give back: reclamation sees them as wholly allocated (their free
        // space would read as cache to trim, and the dynamic pages went
        // every step), and as reserved (a cache kept as a share of the
        // reserved bytes is kept as a share of the device's footprint, not
        // of the few pages beside an arena: a miss's pages would go at each
        // step's end and come back at the next).
        let mut ctx = self.context();
        for p in self.arena.pools.iter().filter(|p| p.planned) {
            ctx.allocated_bytes += p.gauges.reserved_bytes.saturating_sub(p.gauges.allocated_bytes);
        }
        // Likewise the spare pages of a run growing to its plan cache's
        // mark (`Allocator::warm_slack`): the run will use them, and a
        // trim they made look due would only reorder its pages.
        if self.planning.as_ref().is_some_and(|p| p.grows_to_mark(self.stats.plan_hits)) {
            ctx.allocated_bytes = (ctx.allocated_bytes + self.spare_bytes()).min(ctx.reserved_bytes);
        }
        let pools = &self.arena.pools;
        let (mut d, _) = self
            .policies
            .reclaim(trigger, &ctx, |name| pools.iter().find(|p| p.name == name).map(|p| p.gauges.allocated_bytes));
        let stitch = d.stitch;
        if let Some((pool, budget)) = d.compact.take() {
            self.compact(&pool, budget)?;
        }
        if d.release_bytes > 0 {
            // Pools the current placement policy no longer places into (left
            // by a swapped-out policy) only strand memory: a release that names
            // pools includes them too.
            if let Some(names) = d.pools.as_mut() {
                for (i, p) in self.arena.pools.iter().enumerate() {
                    let served = self.policies.pool_map.contains(&(i as u32));
                    if !served && !names.contains(&p.name) {
                        names.push(p.name.clone());
                    }
                }
            }
            self.release_cached(&d)?;
        }
        if let ReclaimTrigger::Grow { segment_bytes, .. } = trigger {
            // Pools that neither the current placement policy nor the default
            // serves (left by a swapped-out policy) can never hand out their
            // cache again: the engine gives it back before growing, whatever
            // the policy said.
            let orphans: Vec<String> = (0..self.arena.pools.len() as u32)
                .filter(|i| !self.policies.pool_map.contains(i) && !self.policies.fallback_pool_map.contains(i))
                .filter(|&i| self.arena.pools[i as usize].cached_bytes() > 0)
                .map(|i| self.arena.pools[i as usize].name.clone())
                .collect();
            if !orphans.is_empty() {
                let d = ReclaimDecision {
                    release_bytes: *segment_bytes,
                    pools: Some(orphans),
                    compact: None,
                    stitch: false,
                    trim: false,
                };
                self.release_cached(&d)?;
            }
        }
        Ok(stitch)
    }

    /// Bytes of free blocks cached in all pools.
    pub fn cached_bytes(&self) -> u64 {
        self.stats.bytes.reserved_bytes - self.stats.bytes.allocated_bytes
    }

    fn pool_selected(&self, pool: u32, names: Option<&[String]>) -> bool {
        names.is_none_or(|n| n.iter().any(|x| *x == self.arena.pools[pool as usize].name))
    }

    /// Segments that are entirely free, in the given pools (all when `None`).
    fn free_segments(&self, names: Option<&[String]>) -> Vec<u32> {
        self.arena
            .segments
            .iter()
            .filter(|(_, s)| {
                let b = self.arena.blocks.get(s.first);
                b.is_free()
                    && b.size == s.size
                    && !self.arena.pools[s.pool as usize].planned
                    && self.pool_selected(s.pool, names)
            })
            .map(|(i, _)| i)
            .collect()
    }

    fn releasable_bytes(&self, names: Option<&[String]>) -> u64 {
        self.free_segments(names).iter().map(|&s| self.arena.segments.get(s).size).sum()
    }

    /// Releases entirely free cached segments, largest first, until
    /// `decision.release_bytes` are released. Returns the bytes released.
    ///
    /// With `decision.trim`, paged memory is released page by page instead
    /// (exactly what is asked, rounded up to a page, from the largest runs of
    /// free pages, entirely free paged segments included) after the entirely
    /// free unpaged segments.
    pub fn release_cached(&mut self, decision: &ReclaimDecision) -> Result<u64, AllocError> {
        let mut segs = self.free_segments(decision.pools.as_deref());
        if decision.trim {
            segs.retain(|s| !self.paging.segs.contains_key(s));
        }
        segs.sort_by_key(|&s| (std::cmp::Reverse(self.arena.segments.get(s).size), self.arena.segments.get(s).base));
        let mut released = 0u64;
        let t0 = self.device.counters().time_us;
        for s in segs {
            if released >= decision.release_bytes {
                break;
            }
            let size = self.arena.segments.get(s).size;
            let seg = *self.arena.segments.get(s);
            let b = *self.arena.blocks.get(seg.first);
            self.arena.pools[seg.pool as usize].free.remove(&(seg.stream, b.size, seg.base, seg.first));
            self.release_segment(s)?;
            released += size;
        }
        if decision.trim && released < decision.release_bytes {
            released += self.trim_pages(decision.release_bytes - released, decision.pools.as_deref())?;
        }
        self.stats.reclaimed_bytes += released;
        if released > 0 {
            self.record_pause(t0);
        }
        Ok(released)
    }

    /// Releases a segment whose single free block is not in the free index.
    fn release_segment(&mut self, seg_idx: u32) -> Result<(), AllocError> {
        let seg = *self.arena.segments.get(seg_idx);
        // The gauges first: pages of chunks still in use stay reserved
        // (spare), counted again once they are settled.
        self.stats.bytes.sub_reserved(seg.size);
        self.arena.pools[seg.pool as usize].gauges.sub_reserved(seg.size);
        if let Some(p) = self.paging.segs.remove(&seg_idx) {
            // Unmapping is not ordered on the stream: wait for the segment's
            // stream first (not the whole device, where the backend can).
            self.quiesce(&[seg.stream])?;
            self.release_paged(&seg, p)?;
            self.settle_spare();
        } else {
            self.device.free_segment(seg.base)?;
            self.stats.device_free_calls += 1;
            // cudaFree synchronizes the device.
            self.stats.device_syncs += 1;
        }
        self.arena.blocks.remove(seg.first);
        self.arena.segments.remove(seg_idx);
        self.record(ActionKind::SegmentFree, seg.base, seg.size, seg.stream, None);
        Ok(())
    }

    /// Records a GC pause that started when the device time was `t0`.
    fn record_pause(&mut self, t0: f64) {
        self.stats.gc_pauses += 1;
        self.gc_pauses.record(self.device.counters().time_us - t0);
    }

    /// Durations of the releases of cached memory so far ("GC pauses").
    pub fn gc_pauses(&self) -> &PauseHistogram {
        &self.gc_pauses
    }

    /// A view of a live tensor.
    /// `None` also for a tensor that is not on the device (see [`Allocator::tier`]).
    pub fn tensor(&self, id: TensorId) -> Option<TensorInfo> {
        let t = self.tensors.get(id).filter(|t| t.tier == Tier::Device)?;
        let b = self.arena.blocks.get(t.block);
        let s = self.arena.segments.get(b.segment);
        Some(TensorInfo {
            bytes: t.bytes,
            kind: t.kind,
            stream: t.stream,
            address: s.base + b.offset,
            block_bytes: b.size,
            pool: s.pool,
        })
    }

    /// The handle-table entry of a live tensor.
    pub fn tensor_entry(&self, id: TensorId) -> Option<&Tensor> {
        self.tensors.get(id)
    }

    /// Changes the kind of live tensor `id`: a client that learns what a
    /// storage holds only after allocating it (PyTorch: a gradient, an
    /// activation saved for backward) says so. The tensor stays in its block
    /// and pool (placement was decided at allocation); what reads the kind
    /// later (eviction candidates, segment views and snapshot exports) sees
    /// the new one.
    pub fn retag(&mut self, id: TensorId, kind: TensorKind) -> Result<(), AllocError> {
        self.tensors.get_mut(id).ok_or(AllocError::UnknownTensor(id))?.kind = kind;
        Ok(())
    }

    /// The current device address of a tensor (valid until the next allocator call).
    pub fn address(&self, id: TensorId) -> Result<DevicePtr, AllocError> {
        match self.tensors.get(id) {
            Some(t) if t.tier != Tier::Device => Err(AllocError::NotResident { id, tier: t.tier }),
            _ => self.tensor(id).map(|t| t.address).ok_or(AllocError::UnknownTensor(id)),
        }
    }

    fn bounds(&self, id: TensorId, offset: u64, len: usize) -> Result<DevicePtr, AllocError> {
        let t = self.tensor(id).ok_or(AllocError::UnknownTensor(id))?;
        let len = len as u64;
        if offset.checked_add(len).is_none_or(|end| end > t.bytes) {
            return Err(AllocError::OutOfBounds { id, offset, len, bytes: t.bytes });
        }
        Ok(t.address + offset)
    }

    /// Writes `data` into a tensor at `offset` (host-backed devices only); a
    /// tensor off the device is brought back first.
    pub fn write(&mut self, id: TensorId, offset: u64, data: &[u8]) -> Result<(), AllocError> {
        self.ensure_resident(id)?;
        let addr = self.bounds(id, offset, data.len())?;
        Ok(self.device.write(addr, data)?)
    }

    /// Reads a tensor's bytes at `offset` into `out` (host-backed devices
    /// only); a tensor off the device is brought back first.
    pub fn read(&mut self, id: TensorId, offset: u64, out: &mut [u8]) -> Result<(), AllocError> {
        self.ensure_resident(id)?;
        let addr = self.bounds(id, offset, out.len())?;
        Ok(self.device.read(addr, out)?)
    }

    /// Segments and their blocks, ordered by address.
    pub fn segment_views(&self) -> Vec<SegmentView> {
        let mut v: Vec<SegmentView> = self
            .arena
            .segments
            .iter()
            .map(|(_, s)| {
                let mut blocks = Vec::new();
                let mut b = s.first;
                while b != NIL {
                    let blk = self.arena.blocks.get(b);
                    let req = self.tensors.by_slot(blk.tensor).map(|(_, t)| (t.bytes, t.kind));
                    blocks.push((blk.offset, blk.size, if blk.is_free() { None } else { req }));
                    b = blk.next;
                }
                SegmentView {
                    base: s.base,
                    size: s.size,
                    pool: self.arena.pools[s.pool as usize].name.clone(),
                    stream: s.stream,
                    blocks,
                }
            })
            .collect();
        v.sort_by_key(|s| s.base);
        v
    }

    /// Live device tensors as eviction candidates.
    pub fn eviction_candidates(&self) -> Vec<EvictionCandidate> {
        self.tensors
            .iter()
            .filter(|(_, t)| t.tier == Tier::Device)
            .map(|(id, t)| EvictionCandidate {
                id,
                bytes: t.bytes,
                kind: t.kind,
                tier: Tier::Device,
                last_use: t.last_use,
                use_count: t.use_count,
                in_use: false,
                pinned: self.tensors.pins.contains_key(&id.slot),
                phase: t.phase,
                next_use: t.next_use,
            })
            .collect()
    }

    /// Asks the eviction policy for victims covering `need_bytes` (validated,
    /// completed by LRU when short).
    pub fn choose_victims(&mut self, need_bytes: u64) -> Vec<TensorId> {
        let c = self.eviction_candidates();
        let ctx = self.context();
        self.policies.choose_victims(need_bytes, &c, &ctx)
    }
}

#[cfg(test)]
mod size_tests {
    #[test]
    fn errors_stay_small() {
        // Results of the hot path carry this type: keep it a few words.
        assert!(std::mem::size_of::<super::AllocError>() <= 64, "{}", std::mem::size_of::<super::AllocError>());
    }
}
