//! Deferred frees: a freed block that other streams used waits on their
//! events before it returns to its pool.
//!
//! A tensor used on a stream other than its own (`use_tensor(id, Some(s))`)
//! remembers those streams. When it is freed, the engine records an event on
//! each of them; the block becomes *pending* (its `tensor` field is
//! [`PENDING`]) and goes on the pending list instead of the free index. The
//! list is polled, never blocking ([`Device::event_done`]), at the start of
//! `alloc` and `phase` when it is not empty; a block whose events are all done
//! returns to its pool, merged with its free neighbours. When the device is
//! out of memory, the engine synchronizes once and polls before giving up.
//!
//! Invariants (checked by `Allocator::check_invariants`):
//! - a pending block is neither in a free index nor holds a tensor; it is on
//!   the pending list exactly once, and the list names only pending blocks;
//! - `stats.pending_bytes = Σ sizes of pending blocks`;
//! - a pending block is never merged, split, handed out or released.

use super::slab::NIL;
use super::{AllocError, Allocator};
use crate::device::{Device, DevicePtr, EventId};
use crate::types::StreamId;

/// `Block::tensor` of a pending block (no handle slot ever reaches it).
pub const PENDING: u32 = NIL - 1;

/// One block waiting on stream events.
#[derive(Debug, Clone)]
pub(crate) struct PendingFree {
    /// The block (its `tensor` is [`PENDING`]).
    pub block: u32,
    /// Events recorded on the other streams at the free.
    pub events: Vec<EventId>,
}

/// The deferred-free part of the allocator.
#[derive(Debug, Default)]
pub(crate) struct Deferred {
    /// Other streams each cross-stream tensor was used on (by handle slot).
    pub cross_uses: rustc_hash::FxHashMap<u32, Vec<StreamId>>,
    /// Freed blocks waiting on stream events.
    pub pending: Vec<PendingFree>,
}

/// A read-only view of one pending block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingView {
    /// Device address of the block.
    pub addr: DevicePtr,
    /// Size of the block.
    pub size: u64,
    /// The events it waits on.
    pub events: Vec<EventId>,
}

impl<D: Device> Allocator<D> {
    /// Records an event on each of `streams` after `blk` was freed; when some
    /// event is not yet done, makes the block pending and returns `true`.
    /// Returns `false` when the block may return to its pool at once.
    pub(super) fn defer_free(&mut self, blk: u32, streams: &[StreamId]) -> Result<bool, AllocError> {
        let mut events = Vec::with_capacity(streams.len());
        for &s in streams {
            match self.device.record_event(s) {
                Ok(e) => events.push(e),
                Err(_) => {
                    // Without an event the only safe way is to wait.
                    self.destroy_events(&events)?;
                    self.device.synchronize()?;
                    self.stats.device_syncs += 1;
                    return Ok(false);
                }
            }
        }
        if self.events_done(&events)? {
            self.destroy_events(&events)?;
            return Ok(false);
        }
        let b = self.arena.blocks.get_mut(blk);
        b.tensor = PENDING;
        self.stats.pending_bytes += b.size;
        self.stats.deferred_frees += 1;
        self.deferred.pending.push(PendingFree { block: blk, events });
        Ok(true)
    }

    fn events_done(&mut self, events: &[EventId]) -> Result<bool, AllocError> {
        for &e in events {
            if !self.device.event_done(e)? {
                return Ok(false);
            }
        }
        Ok(true)
    }

    fn destroy_events(&mut self, events: &[EventId]) -> Result<(), AllocError> {
        for &e in events {
            self.device.destroy_event(e)?;
        }
        Ok(())
    }

    /// Returns every pending block whose events are all done to its pool
    /// (never blocks). Returns the number of blocks returned.
    pub fn poll_pending(&mut self) -> Result<usize, AllocError> {
        let mut i = 0;
        let mut returned = 0;
        while i < self.deferred.pending.len() {
            let events = std::mem::take(&mut self.deferred.pending[i].events);
            let done = self.events_done(&events);
            if !matches!(done, Ok(true)) {
                self.deferred.pending[i].events = events;
                done?;
                i += 1;
                continue;
            }
            let p = self.deferred.pending.swap_remove(i);
            self.destroy_events(&events)?;
            let b = self.arena.blocks.get_mut(p.block);
            b.tensor = NIL;
            self.stats.pending_bytes -= b.size;
            self.return_block(p.block)?;
            returned += 1;
        }
        Ok(returned)
    }

    /// The pending blocks (freed, waiting on events of other streams).
    pub fn pending_frees(&self) -> Vec<PendingView> {
        self.deferred
            .pending
            .iter()
            .map(|p| {
                let b = self.arena.blocks.get(p.block);
                PendingView {
                    addr: self.arena.segments.get(b.segment).base + b.offset,
                    size: b.size,
                    events: p.events.clone(),
                }
            })
            .collect()
    }

    /// Checks the pending list against the blocks (part of `check_invariants`).
    /// Checks the invariants of the module documentation.
    pub(super) fn check_pending(&self) -> Result<(), String> {
        if self.deferred.cross_uses.keys().any(|&slot| self.tensors.by_slot(slot).is_none()) {
            return Err("cross-stream uses recorded for a dead tensor".into());
        }
        let mut seen = rustc_hash::FxHashSet::default();
        let mut bytes = 0u64;
        for p in &self.deferred.pending {
            let b = self.arena.blocks.try_get(p.block).ok_or_else(|| format!("pending block {} is dead", p.block))?;
            if b.tensor != PENDING {
                return Err(format!("block {} is on the pending list but not pending", p.block));
            }
            if !seen.insert(p.block) {
                return Err(format!("block {} is on the pending list twice", p.block));
            }
            if p.events.is_empty() {
                return Err(format!("pending block {} waits on no event", p.block));
            }
            bytes += b.size;
        }
        let marked = self.arena.blocks.iter().filter(|(_, b)| b.tensor == PENDING).count();
        if marked != seen.len() {
            return Err(format!("{marked} blocks are pending but {} are on the list", seen.len()));
        }
        if bytes != self.stats.pending_bytes {
            return Err(format!("pending_bytes {} but pending blocks hold {bytes}", self.stats.pending_bytes));
        }
        let g = &self.stats.bytes;
        if g.allocated_bytes + bytes > g.reserved_bytes {
            return Err(format!(
                "allocated {} + pending {bytes} exceed reserved {}",
                g.allocated_bytes, g.reserved_bytes
            ));
        }
        Ok(())
    }
}
