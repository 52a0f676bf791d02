//! Growth: what the allocator does when no cached block of the chosen pool
//! fits a request. The remedies, in the order they are tried:
//!
//! ```text
//!  1. reclaim (Grow)        cached memory is waste when a pool must grow: the reclamation
//!                           policy releases cache, and may ask to …
//!  2. stitch                … build the new segment from free pages of paged segments (or
//!                           extend a segment whose last block is free with them)
//!  3. new segment           from the device (paged while the reclamation policy asks for pages:
//!                           the request's pages only; a paged segment whose last block is free
//!                           is extended instead)
//!  ── the device is full ──
//!  4. drain deferred frees  wait for the streams, so that every pending free completes
//!  5. reclaim (AllocFailed) unless releasing everything cached could not make room; may stitch
//!  6. new segment           again, idle planned arenas given back first, then (without tiers)
//!                           one of just the rounded request when the placement's is larger;
//!                           otherwise out of memory, unless the tiers are enabled:
//!  7. compact               once: move live blocks into denser segments; a cached block may fit
//!  8. evict                 the eviction policy's victims leave one at a time until a cached block
//!                           fits or the segment can be obtained; free pages are released; then 1.
//! ```
//!
//! Steps 1–6 are [`Allocator::grow`], the loop over 1–8 is
//! [`Allocator::grow_or_evict`]. A prefetch (which only uses free memory)
//! stops after 6. A request that fails leaves every live tensor where it was
//! (see the allocator's documentation for what a failed request may change).

use super::slab::{Block, Segment, NIL};
use super::{ActionKind, AllocError, Allocator};
use crate::decision::{AllocRequest, ReclaimDecision, ReclaimTrigger};
use crate::device::{Device, DeviceError};
use crate::types::round_up;

/// One request that needs memory: where it goes and how much.
#[derive(Debug, Clone, Copy)]
pub(super) struct Growth {
    /// Engine pool index.
    pub pool: u32,
    /// Size of a new segment (before page rounding).
    pub segment: u64,
    /// Rounded block size.
    pub rounded: u64,
    /// Largest waste a cached block may have.
    pub max_waste: u64,
    /// The request.
    pub req: AllocRequest,
}

impl<D: Device> Allocator<D> {
    /// Remedies 1–8 (see the module documentation), until the request is
    /// served or nothing is left to try. Counts an OOM when it finally fails.
    #[inline(never)]
    pub(super) fn grow_or_evict(&mut self, g: &Growth) -> Result<u32, AllocError> {
        let mut compacted = false;
        loop {
            let oom = match self.grow(g) {
                Err(e @ AllocError::OutOfMemory { .. }) => e,
                served => return served,
            };
            if self.tiers.as_ref().is_some_and(|t| t.prefetching) {
                // A prefetch only uses free memory: no eviction, not an OOM.
                return Err(oom);
            }
            if self.tiers.is_none() || g.segment > self.device.capacity() {
                self.stats.ooms += 1;
                return Err(oom);
            }
            if !compacted {
                compacted = true;
                if self.compact_all()? > 0 {
                    if let Some(b) = self.take_fit(g) {
                        return Ok(b);
                    }
                    continue;
                }
            }
            match self.evict_for(g)? {
                Evicted::Served(b) => return Ok(b),
                Evicted::Some => {}
                Evicted::Nothing => {
                    self.stats.ooms += 1;
                    return Err(oom);
                }
            }
        }
    }

    /// Remedies 1–6: a block of a new segment for the request, from cache
    /// released by reclamation, stitched pages or the device.
    #[inline]
    fn grow(&mut self, g: &Growth) -> Result<u32, AllocError> {
        let req = g.req;
        // (An idle arena that holds tensors first joins the dynamic path:
        // its free pages are then cached, for reclamation and stitching.)
        self.join_idle_arena(g.segment);
        // 1–2. Reclamation before growth; stitching if it asks.
        if self.cached_bytes() > 0 {
            let trigger = ReclaimTrigger::Grow { request: req, segment_bytes: g.segment };
            if self.run_reclaim(&trigger)? {
                if let Some(block) = self.stitch_or_extend(g, g.segment)? {
                    return Ok(block);
                }
            }
        }
        // 3. A new segment (an idle planned arena goes first: see
        // `release_arena_for_dynamic_step`), or a paged one extended.
        self.release_arena_for_dynamic_step()?;
        let page = match self.paged_page(g.segment) {
            // Spare pages (of chunks still in use, e.g. left by a policy
            // that paged before a swap) serve a segment of whole pages
            // before the device is asked, whatever the policy.
            0 => self.spare_page_for(g.segment),
            p => p,
        };
        let segment = if page > 0 { round_up(g.segment, page).unwrap_or(g.segment) } else { g.segment };
        let mut mapped = segment;
        if page > 0 {
            let (extra, first) = self.mapped_now(g, segment, page);
            if let Some(block) = self.extend_tail(g, extra, segment / page, false)? {
                return Ok(block);
            }
            mapped = first;
        }
        match self.new_segment(g.pool, mapped, page, &req) {
            Err(AllocError::Device(DeviceError::OutOfMemory { .. })) => {}
            served => return served,
        }
        // 4. Pending frees complete once the streams are waited for.
        self.stats.alloc_retries += 1;
        self.drain_deferred()?;
        // 5. Reclamation after the failure, unless even releasing every cached
        // byte could not make room; stitching if it asks.
        let hopeless = self.device.available().is_some_and(|avail| {
            avail
                .saturating_add(self.releasable_bytes(None))
                .saturating_add(self.free_page_bytes())
                .saturating_add(self.spare_bytes())
                < segment
        });
        if !hopeless {
            let trigger = ReclaimTrigger::AllocFailed { request: req, segment_bytes: segment };
            if self.run_reclaim(&trigger)? {
                if let Some(block) = self.stitch_or_extend(g, segment)? {
                    return Ok(block);
                }
            }
        }
        // 6. A new segment again, after giving back idle planned arenas;
        // then, without tiers (which evict instead), the least segment the
        // request fits in (the placement's may be larger than what is
        // left, e.g. next to a planned arena).
        self.release_idle_arenas()?;
        let least = if page > 0 { round_up(g.rounded, page).unwrap_or(g.rounded) } else { g.rounded };
        let again = match self.new_segment(g.pool, segment, page, &req) {
            Err(AllocError::Device(DeviceError::OutOfMemory { .. })) if least < segment && self.tiers.is_none() => {
                self.new_segment(g.pool, least, page, &req)
            }
            other => other,
        };
        match again {
            Err(AllocError::Device(DeviceError::OutOfMemory { .. })) => Err(AllocError::OutOfMemory {
                bytes: req.bytes,
                kind: req.kind,
                stream: req.stream,
                segment_bytes: segment,
                reserved: self.stats.bytes.reserved_bytes,
                live: self.stats.bytes.live_bytes,
                capacity: self.device.capacity(),
            }),
            served => served,
        }
    }

    /// A stitch's pages for the growth: a paged segment whose last block is
    /// free extended with them, or a new segment of `segment` bytes stitched
    /// from them.
    fn stitch_or_extend(&mut self, g: &Growth, segment: u64) -> Result<Option<u32>, AllocError> {
        let page = self.paged_page(segment);
        let mut mapped = segment;
        if page > 0 {
            let (extra, first) = self.mapped_now(g, segment, page);
            if let Some(block) = self.extend_tail(g, extra, segment.div_ceil(page), true)? {
                return Ok(Some(block));
            }
            mapped = first;
        }
        Ok(self.stitch(g.pool, &g.req, mapped)?.map(|(block, _)| block))
    }

    /// How much of the policy's paged segment of `segment` bytes (a
    /// multiple of `page`) a growth for `g` maps now: the bytes an extension
    /// adds beyond the request's pages, and the size of a new segment. While
    /// paged segments can grow in place (no plan in use: see
    /// `Planning::plans_in_use`), only the request's own pages — the rest of
    /// the policy's segment (a growth chunk shared by later requests) comes
    /// page by page, as those requests extend the segment, and pages no
    /// request reaches are never mapped (PyTorch's expandable segments). A
    /// chunk mapped at once stayed partly unused at the peak of small
    /// trainings (a 20 MiB chunk for 13 MiB of gradients). Otherwise all of it.
    fn mapped_now(&self, g: &Growth, segment: u64, page: u64) -> (u64, u64) {
        if self.planning.as_ref().is_some_and(|p| p.plans_in_use()) {
            return (extra_of(g, page), segment);
        }
        (0, round_up(g.rounded, page).unwrap_or(segment).min(segment))
    }

    /// Waits for every stream when frees are pending, and completes them.
    fn drain_deferred(&mut self) -> Result<(), AllocError> {
        if !self.deferred.pending.is_empty() {
            self.device.synchronize()?;
            self.stats.device_syncs += 1;
            self.poll_pending()?;
        }
        Ok(())
    }

    /// A new segment of `bytes` in `pool` from the device (paged when `page >
    /// 0`); returns its single block, which is not in the free index.
    #[inline]
    fn new_segment(&mut self, pool: u32, bytes: u64, page: u64, req: &AllocRequest) -> Result<u32, AllocError> {
        let (base, paged) = if page > 0 {
            let (va, p) = self.alloc_paged_segment(bytes, page, req.kind)?;
            (va, Some(p))
        } else {
            (self.device.alloc_segment(bytes)?, None)
        };
        // (A paged segment's chunk is counted where it is made.)
        self.stats.device_alloc_calls += u64::from(paged.is_none());
        let seg = self.arena.segments.insert(Segment {
            base,
            size: bytes,
            pool,
            stream: req.stream,
            first: NIL,
            born: self.clock,
        });
        if let Some(p) = paged {
            self.paging.segs.insert(seg, p);
        }
        let block =
            self.arena.blocks.insert(Block { segment: seg, offset: 0, size: bytes, prev: NIL, next: NIL, tensor: NIL });
        self.arena.segments.get_mut(seg).first = block;
        self.stats.bytes.add_reserved(bytes);
        self.arena.pools[pool as usize].gauges.add_reserved(bytes);
        self.record(ActionKind::SegmentAlloc, base, bytes, req.stream, None);
        Ok(block)
    }

    /// Remedy 7: compacts every pool that caches memory (device copies are
    /// far cheaper than copies to the host: no byte budget). Returns the
    /// bytes moved.
    fn compact_all(&mut self) -> Result<u64, AllocError> {
        let names: Vec<String> =
            self.arena.pools.iter().filter(|p| p.cached_bytes() > 0 && !p.planned).map(|p| p.name.clone()).collect();
        let mut moved = 0;
        for n in names {
            moved += self.compact(&n, u64::MAX)?;
        }
        Ok(moved)
    }

    /// Remedy 8: asks the eviction policy for victims covering what the
    /// device lacks and moves them off one at a time, in the policy's order,
    /// until a freed block serves the request or the segment can be
    /// obtained; then releases free segments and pages.
    fn evict_for(&mut self, g: &Growth) -> Result<Evicted, AllocError> {
        let avail = self
            .device
            .available()
            .unwrap_or(0)
            .saturating_add(self.releasable_bytes(None))
            .saturating_add(self.spare_bytes());
        let victims = self.choose_victims(g.segment.saturating_sub(avail).max(1));
        if victims.is_empty() {
            return Ok(Evicted::Nothing);
        }
        for v in victims {
            self.evict_one(v)?;
            if let Some(b) = self.take_fit(g) {
                return Ok(Evicted::Served(b));
            }
            let avail = self
                .device
                .available()
                .unwrap_or(0)
                .saturating_add(self.releasable_bytes(None))
                .saturating_add(self.free_page_bytes())
                .saturating_add(self.spare_bytes());
            if avail >= g.segment {
                break;
            }
        }
        // Free pages of paged segments count too (trimmed to the page).
        self.release_cached(&ReclaimDecision { release_bytes: g.segment, trim: true, ..ReclaimDecision::none() })?;
        Ok(Evicted::Some)
    }

    /// Takes the best-fitting cached block of the growth's pool, if any.
    fn take_fit(&mut self, g: &Growth) -> Option<u32> {
        let pool = &mut self.arena.pools[g.pool as usize];
        let key = pool.best_fit(g.req.stream, g.rounded, g.max_waste)?;
        pool.free.remove(&key);
        Some(key.3)
    }
}

/// What remedy 8 did.
enum Evicted {
    /// A freed block serves the request.
    Served(u32),
    /// Tensors left the device; growth is tried again.
    Some,
    /// No victim was offered.
    Nothing,
}

/// The bytes of the policy's segment for `g` beyond the request's whole
/// pages (a growth chunk larger than the request): an extension adds them
/// too.
fn extra_of(g: &Growth, page: u64) -> u64 {
    g.segment.saturating_sub(round_up(g.rounded, page).unwrap_or(g.rounded))
}
