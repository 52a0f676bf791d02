//! Paged segments and the two mechanisms they allow: stitching and trimming.
//!
//! While the reclamation policy asks for it ([`ReclamationPolicy::paged_segments`]
//! — read at each growth) and the device has a virtual memory API
//! (granularity > 0), a segment of at least two pages is built from
//! individually mapped physical pages: one virtual reservation, one physical
//! allocation per page (`cuMemAddressReserve` + `cuMemCreate` + `cuMemMap` on
//! CUDA), instead of one `cudaMalloc`.
//!
//! - **Stitching** (GMLake): when a pool must grow and the reclamation
//!   decision says `stitch`, the whole pages inside its free blocks are
//!   unmapped and mapped again, in order, into a new reservation — fresh pages
//!   only for what is missing. A large request is thus served from free memory
//!   that is not contiguous, without copying a byte.
//! - **Trimming**: a release with `trim` also unmaps and releases the free
//!   whole pages inside segments that still hold tensors.
//! - **Extending** (PyTorch's expandable segments): a reservation is larger
//!   than the pages first mapped into it, and a segment whose last block is
//!   free grows in place — pages (free whole pages of other blocks, as a
//!   stitch takes them, then fresh ones) are mapped right after its end, so
//!   that the free bytes of its last, partly used page serve the request
//!   instead of being lost beside a new segment. A growth then maps only the
//!   request's pages, not the policy's whole segment: the rest of it (a
//!   growth chunk) is mapped as later requests extend the segment.
//!
//! Taking pages out of the middle of a segment *cuts* it: the part before the
//! pages and the part after them become two segments (same reservation, same
//! pool and stream), each still tiled by its blocks; the free block that held
//! the pages keeps its bytes outside them as free remnants. Addresses of live
//! tensors never change.
//!
//! Unmapping is not ordered on a stream: the last user of a free block may
//! still be running. Before pages are unmapped (stitch, trim, release) the
//! engine waits for the streams of their segments
//! ([`Device::synchronize_stream`]): the `sim` device waits for that stream
//! alone (counted in `stream_syncs`); the `cuda` backend, which does not
//! know the client's streams, synchronizes the device (counted in
//! `device_syncs`, as a `cudaFree` would be).
//!
//! [`Device::synchronize_stream`]: crate::device::Device::synchronize_stream
//!
//! Invariants (checked by `Allocator::check_invariants`):
//! - a paged segment's base is page-aligned, its size is `pages × page`, and
//!   page `i` is mapped at `base + i × page`;
//! - the `room` after a paged segment lies inside its reservation and holds
//!   no other segment's bytes (it may be less than the truth: the room a
//!   released neighbour leaves is not claimed);
//! - a reservation's reference count equals the number of segments inside it,
//!   and a reservation with no segment is released at once.
//!
//! [`ReclamationPolicy::paged_segments`]: crate::decision::ReclamationPolicy::paged_segments

use super::slab::{Block, Segment, NIL};
use super::{ActionKind, AllocError, Allocator};
use crate::device::{Device, DeviceError, DevicePtr, PhysHandle};
use crate::types::StreamId;

/// The pages of one paged segment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PagedSeg {
    /// Physical page `i` is mapped at `segment.base + i × page`.
    pub pages: Vec<PhysHandle>,
    /// The reservation the segment lies in (key of `Allocator::reservations`).
    pub resv: DevicePtr,
    /// Bytes of address space right after the segment's end, inside its
    /// reservation, that no segment uses: it may be extended by as much.
    pub room: u64,
}

/// The paging part of the allocator: the pages of paged segments and the
/// virtual reservations they lie in.
#[derive(Debug, Default)]
pub(crate) struct Paging {
    /// Pages of paged segments (by segment index).
    pub segs: rustc_hash::FxHashMap<u32, PagedSeg>,
    /// Virtual reservations of paged segments (by base address).
    pub reservations: rustc_hash::FxHashMap<DevicePtr, Reservation>,
}

impl Paging {
    /// Checks the invariants of the module documentation against the
    /// arena's segments (`page`: the device's granularity).
    pub fn check(&self, segments: &super::slab::Slab<Segment>, page: u64) -> Result<(), String> {
        let mut refs: rustc_hash::FxHashMap<DevicePtr, u32> = Default::default();
        // (base, end including room) of the segments of each reservation.
        let mut spans: rustc_hash::FxHashMap<DevicePtr, Vec<(DevicePtr, DevicePtr)>> = Default::default();
        for (&si, p) in &self.segs {
            let s =
                segments.try_get(si).ok_or_else(|| format!("paged entry for segment {si}, which does not exist"))?;
            if page == 0 || !s.base.is_multiple_of(page) || s.size != p.pages.len() as u64 * page {
                return Err(format!("paged segment {si} at {:#x}: {} bytes, {} pages", s.base, s.size, p.pages.len()));
            }
            if !self.reservations.contains_key(&p.resv) || s.base < p.resv {
                return Err(format!("paged segment {si} is not inside a known reservation"));
            }
            *refs.entry(p.resv).or_default() += 1;
            spans.entry(p.resv).or_default().push((s.base, s.base + s.size + p.room));
        }
        for (resv, mut v) in spans {
            v.sort_unstable();
            let end = resv + self.reservations.get(&resv).map_or(0, |r| r.size);
            for (i, &(b, e)) in v.iter().enumerate() {
                let next = v.get(i + 1).map_or(end, |n| n.0);
                if e > next {
                    return Err(format!("paged segment at {b:#x}: its room reaches {e:#x}, past {next:#x}"));
                }
            }
        }
        for (va, r) in &self.reservations {
            if refs.get(va).copied().unwrap_or(0) != r.refs {
                return Err(format!("reservation {va:#x} counts {} segments, holds {:?}", r.refs, refs.get(va)));
            }
        }
        Ok(())
    }
}

/// A virtual reservation and the number of segments inside it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Reservation {
    /// Segments that lie in it.
    pub refs: u32,
    /// Its bytes of address space.
    pub size: u64,
}

/// A run of whole free pages inside one free block.
#[derive(Debug, Clone, Copy)]
pub(super) struct PageRun {
    /// The free block holding the pages.
    block: u32,
    /// Address of the first page (absolute: carving renumbers offsets).
    va: DevicePtr,
    /// Number of pages.
    count: u64,
}

impl PageRun {
    /// The order runs are taken in, greatest first: more pages, then the
    /// lower address (unique: runs do not overlap).
    fn rank(&self) -> (u64, std::cmp::Reverse<DevicePtr>) {
        (self.count, std::cmp::Reverse(self.va))
    }
}

/// A run of pages by segment-relative index (inside `carve`).
#[derive(Debug, Clone, Copy)]
struct PageRunIdx {
    first: u64,
    count: u64,
}

impl<D: Device> Allocator<D> {
    /// The page size for paged segments, or 0 when they cannot be used now.
    pub(super) fn paged_page(&self, segment_bytes: u64) -> u64 {
        let page = self.device.granularity();
        if page == 0 || segment_bytes < page || !self.policies.reclamation_wants_pages() {
            return 0;
        }
        page
    }

    /// Waits for the work queued on `streams` before their pages are
    /// unmapped (a free block's last user may still be running: unmapping
    /// is not ordered on the stream). A backend that synchronizes the whole
    /// device for it does so once.
    pub(super) fn quiesce(&mut self, streams: &[StreamId]) -> Result<(), AllocError> {
        let mut done: Vec<StreamId> = Vec::new();
        for &s in streams {
            if done.contains(&s) {
                continue;
            }
            if self.device.synchronize_stream(s)? {
                self.stats.device_syncs += 1;
                return Ok(());
            }
            self.stats.stream_syncs += 1;
            done.push(s);
        }
        Ok(())
    }

    /// Obtains `pages` fresh physical pages; on failure releases those
    /// already created and returns the device's error.
    fn create_pages(&mut self, pages: u64, page: u64) -> Result<Vec<PhysHandle>, DeviceError> {
        let mut out = Vec::with_capacity(pages as usize);
        for _ in 0..pages {
            match self.device.create_physical(page) {
                Ok(h) => out.push(h),
                Err(e) => {
                    for h in out {
                        self.device.release_physical(h)?;
                    }
                    return Err(e);
                }
            }
        }
        Ok(out)
    }

    /// Address space reserved after a new paged segment's pages, so that it
    /// can be extended in place: 1/8 of the device (at most 64 GiB, at
    /// least a page). Address space costs no memory (PyTorch's expandable
    /// segments reserve the whole device), but a run may hold hundreds of
    /// reservations at once.
    fn room_for_extension(&self, page: u64) -> u64 {
        let want = (self.device.capacity() / 8).min(64 << 30);
        crate::types::round_up(want, page).unwrap_or(page).max(page)
    }

    /// Maps `pages` in order into a new reservation of their bytes and
    /// `room` more; returns its base and records the reservation.
    /// On failure everything is unmapped again; the pages stay unmapped and
    /// owned by the caller.
    fn map_pages(&mut self, pages: &[PhysHandle], page: u64, room: u64) -> Result<DevicePtr, DeviceError> {
        let size = pages.len() as u64 * page + room;
        let va = self.device.reserve_virtual(size)?;
        if let Err(e) = self.map_at(va, pages, page) {
            self.device.release_virtual(va)?;
            return Err(e);
        }
        self.paging.reservations.insert(va, Reservation { refs: 1, size });
        Ok(va)
    }

    /// Maps `pages` in order from `va`; on failure unmaps them again.
    fn map_at(&mut self, va: DevicePtr, pages: &[PhysHandle], page: u64) -> Result<(), DeviceError> {
        for (i, &h) in pages.iter().enumerate() {
            if let Err(e) = self.device.map(va + i as u64 * page, h) {
                for j in 0..i {
                    self.device.unmap(va + j as u64 * page)?;
                }
                return Err(e);
            }
        }
        Ok(())
    }

    /// Allocates a paged segment of `bytes` (a multiple of `page`): returns
    /// its base. The device's error (e.g. out of memory) leaves nothing behind.
    pub(super) fn alloc_paged_segment(&mut self, bytes: u64, page: u64) -> Result<(DevicePtr, PagedSeg), DeviceError> {
        let pages = self.create_pages(bytes / page, page)?;
        let room = self.room_for_extension(page);
        match self.map_pages(&pages, page, room) {
            Ok(va) => {
                self.stats.paged_segments += 1;
                Ok((va, PagedSeg { pages, resv: va, room }))
            }
            Err(e) => {
                for h in pages {
                    self.device.release_physical(h)?;
                }
                Err(e)
            }
        }
    }

    /// Unmaps and releases a paged segment's pages (the segment itself is
    /// removed by the caller); releases the reservation when it was the last
    /// segment in it. Returns the number of pages released.
    pub(super) fn release_paged(&mut self, seg: &Segment, ps: PagedSeg) -> Result<u64, AllocError> {
        let page = self.device.granularity();
        for (i, &h) in ps.pages.iter().enumerate() {
            self.device.unmap(seg.base + i as u64 * page)?;
            self.device.release_physical(h)?;
        }
        self.drop_resv_ref(ps.resv)?;
        Ok(ps.pages.len() as u64)
    }

    fn drop_resv_ref(&mut self, resv: DevicePtr) -> Result<(), AllocError> {
        let r = self.paging.reservations.get_mut(&resv).expect("a paged segment's reservation is known");
        r.refs -= 1;
        if r.refs == 0 {
            self.paging.reservations.remove(&resv);
            self.device.release_virtual(resv)?;
        }
        Ok(())
    }

    /// Bytes of whole free pages inside free blocks of paged segments.
    pub(super) fn free_page_bytes(&self) -> u64 {
        self.free_page_runs(None).iter().map(|r| r.count).sum::<u64>() * self.device.granularity()
    }

    /// Runs of whole free pages in free blocks of paged segments of the
    /// selected pools, in no order (they are used largest first, ties lower
    /// address first: [`PageRun::rank`]).
    fn free_page_runs(&self, names: Option<&[String]>) -> Vec<PageRun> {
        let page = self.device.granularity();
        let mut runs = Vec::new();
        if page == 0 {
            return runs;
        }
        if self.paging.segs.is_empty() {
            return runs;
        }
        // Free blocks are exactly the indexed ones; only those of a page or
        // more can hold a whole page.
        for (p, pool) in self.arena.pools.iter().enumerate() {
            if !self.pool_selected(p as u32, names) {
                continue;
            }
            for (_, size, addr, blk) in pool.free.at_least(page) {
                let b = self.arena.blocks.get(blk);
                if !self.paging.segs.contains_key(&b.segment) {
                    continue;
                }
                let base = addr - b.offset;
                let first = b.offset.div_ceil(page);
                let end = (b.offset + size) / page;
                if end > first {
                    runs.push(PageRun { block: blk, va: base + first * page, count: end - first });
                }
            }
        }
        runs
    }

    /// Takes the `run.count` pages at `run.va` out of the free block
    /// `run.block` of a paged segment: unmaps them and cuts the segment around
    /// them. Returns the (unmapped) physical pages; the reserved gauges drop
    /// by their bytes.
    fn carve(&mut self, run: PageRun) -> Result<Vec<PhysHandle>, AllocError> {
        let page = self.device.granularity();
        let blk = run.block;
        let b0 = *self.arena.blocks.get(blk);
        let s = b0.segment;
        let seg = *self.arena.segments.get(s);
        let first_page = (run.va - seg.base) / page;
        let run = PageRunIdx { first: first_page, count: run.count };
        let pool = seg.pool as usize;
        let ps = self.paging.segs.remove(&s).expect("carve is called on paged segments");
        // The pages before the run, the run, the pages after it.
        let mut before = ps.pages;
        let after = before.split_off((run.first + run.count) as usize);
        let taken = before.split_off(run.first as usize);
        let (lo, hi) = (run.first * page, (run.first + run.count) * page);
        debug_assert!(b0.is_free() && b0.offset <= lo && hi <= b0.offset + b0.size);
        self.arena.pools[pool].free.remove(&(seg.stream, b0.size, seg.base + b0.offset, blk));
        for i in run.first..run.first + run.count {
            self.device.unmap(seg.base + i * page)?;
        }
        self.arena.segments.remove(s);
        let mut segments_now = 0u32;
        // The part before the pages: the blocks up to `blk`, and `blk` itself
        // cut down to its bytes before `lo`.
        let left_remnant = lo > b0.offset;
        if lo > 0 {
            let first = if b0.offset == 0 { blk } else { seg.first };
            let last = if left_remnant { blk } else { b0.prev };
            let ls = self.arena.segments.insert(Segment { base: seg.base, size: lo, first, ..seg });
            let mut cur = first;
            loop {
                self.arena.blocks.get_mut(cur).segment = ls;
                if cur == last {
                    break;
                }
                cur = self.arena.blocks.get(cur).next;
            }
            if left_remnant {
                let bm = self.arena.blocks.get_mut(blk);
                bm.size = lo - b0.offset;
                bm.next = NIL;
                self.arena.pools[pool].free.insert((seg.stream, lo - b0.offset, seg.base + b0.offset, blk));
            } else {
                self.arena.blocks.get_mut(b0.prev).next = NIL;
            }
            // Its room: the pages taken (and the old room when nothing follows).
            let room = if hi < seg.size { hi - lo } else { hi - lo + ps.room };
            self.paging.segs.insert(ls, PagedSeg { pages: before, resv: ps.resv, room });
            segments_now += 1;
        }
        // The part after the pages: a remnant of `blk` after `hi`, then the
        // blocks after `blk`, with offsets now relative to `hi`.
        let end = b0.offset + b0.size;
        if hi < seg.size {
            let base = seg.base + hi;
            let first = if end > hi {
                let r = self.arena.blocks.insert(Block {
                    segment: NIL,
                    offset: 0,
                    size: end - hi,
                    prev: NIL,
                    next: b0.next,
                    tensor: NIL,
                });
                if b0.next != NIL {
                    self.arena.blocks.get_mut(b0.next).prev = r;
                }
                self.arena.pools[pool].free.insert((seg.stream, end - hi, base, r));
                r
            } else {
                self.arena.blocks.get_mut(b0.next).prev = NIL;
                b0.next
            };
            let rs = self.arena.segments.insert(Segment { base, size: seg.size - hi, first, ..seg });
            let mut cur = first;
            while cur != NIL {
                let bm = self.arena.blocks.get_mut(cur);
                bm.segment = rs;
                if cur != first || end <= hi {
                    bm.offset -= hi;
                }
                cur = bm.next;
            }
            self.paging.segs.insert(rs, PagedSeg { pages: after, resv: ps.resv, room: ps.room });
            segments_now += 1;
        }
        if !left_remnant {
            self.arena.blocks.remove(blk);
        }
        // One segment became `segments_now`.
        let r = self.paging.reservations.get_mut(&ps.resv).expect("a paged segment's reservation is known");
        r.refs = r.refs - 1 + segments_now;
        if r.refs == 0 {
            self.paging.reservations.remove(&ps.resv);
            self.device.release_virtual(ps.resv)?;
        }
        let bytes = run.count * page;
        self.stats.bytes.cut(bytes, segments_now as u64);
        self.arena.pools[pool].gauges.cut(bytes, segments_now as u64);
        // The pages leave the segment (a stitch records their new segment).
        self.record(ActionKind::SegmentFree, seg.base + lo, bytes, seg.stream, None);
        Ok(taken)
    }

    /// Whether `b` is the last block of a paged segment that can be
    /// extended: a remainder split off its end is not lost (the policy's
    /// smallest remainder keeps unusable slivers out of the free lists; this
    /// one serves the next extension).
    #[inline]
    pub(super) fn extensible_end(&self, b: &Block) -> bool {
        b.next == NIL
            && !self.paging.segs.is_empty()
            && self.paging.segs.get(&b.segment).is_some_and(|ps| ps.room > 0)
            && !self.planning.as_ref().is_some_and(|p| p.plans_in_use())
    }

    /// The free page runs that give `need` pages, greatest first, leaving
    /// out the block `except`; returns them and the pages they hold.
    pub(super) fn plan_runs(&self, need: u64, except: u32) -> (Vec<PageRun>, u64) {
        let mut plan = Vec::new();
        let mut have = 0u64;
        // The greatest runs first, as many as needed: a heap, not a full sort.
        let mut runs: std::collections::BinaryHeap<_> =
            self.free_page_runs(None).into_iter().filter(|r| r.block != except).map(|r| (r.rank(), r.block)).collect();
        while have < need {
            let Some(((count, std::cmp::Reverse(va)), block)) = runs.pop() else { break };
            let run = PageRun { block, va, count: count.min(need - have) };
            have += run.count;
            plan.push(run);
        }
        (plan, have)
    }

    /// Carves the runs of `plan` (their streams waited for first) and
    /// returns their pages in order.
    pub(super) fn take_runs(&mut self, plan: Vec<PageRun>) -> Result<Vec<PhysHandle>, AllocError> {
        let streams: Vec<StreamId> =
            plan.iter().map(|r| self.arena.segments.get(self.arena.blocks.get(r.block).segment).stream).collect();
        self.quiesce(&streams)?;
        // Carving moves blocks between segments: plan runs by block, and a
        // later run never names a block an earlier carve removed (one run per
        // free block).
        let mut pages = Vec::new();
        for run in plan {
            pages.extend(self.carve(run)?);
        }
        Ok(pages)
    }

    /// Builds a segment of `segment_bytes` for `pool` on `stream` from free
    /// whole pages of the pool's paged segments plus fresh pages for the
    /// rest. Returns its single block (not in the free index), or `None` when
    /// the pool has no free whole page or stitching is not possible now. A
    /// device error creating the fresh pages (out of memory) changes nothing.
    pub(super) fn stitch(
        &mut self,
        pool: u32,
        stream: StreamId,
        segment_bytes: u64,
    ) -> Result<Option<(u32, u64)>, AllocError> {
        let page = self.device.granularity();
        if page == 0 || self.paging.segs.is_empty() {
            return Ok(None);
        }
        let need = segment_bytes.div_ceil(page);
        let (plan, have) = self.plan_runs(need, NIL);
        if have == 0 {
            return Ok(None);
        }
        let fresh = match self.create_pages(need - have, page) {
            Ok(f) => f,
            Err(DeviceError::OutOfMemory { .. }) => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        let mut pages = self.take_runs(plan)?;
        pages.extend(fresh);
        let room = self.room_for_extension(page);
        let va = self.map_pages(&pages, page, room)?;
        let size = need * page;
        let seg = self.arena.segments.insert(Segment { base: va, size, pool, stream, first: NIL, born: self.clock });
        let block =
            self.arena.blocks.insert(Block { segment: seg, offset: 0, size, prev: NIL, next: NIL, tensor: NIL });
        self.arena.segments.get_mut(seg).first = block;
        self.paging.segs.insert(seg, PagedSeg { pages, resv: va, room });
        self.stats.bytes.add_reserved(size);
        self.arena.pools[pool as usize].gauges.add_reserved(size);
        self.stats.device_alloc_calls += need - have;
        self.stats.stitches += 1;
        self.stats.stitched_bytes += have * page;
        self.stats.paged_segments += 1;
        self.record(ActionKind::SegmentAlloc, va, size, stream, None);
        Ok(Some((block, size)))
    }

    /// The free last block of a paged segment of `pool` on `stream` that can
    /// be extended to hold `rounded` bytes (and `extra`) with the fewest
    /// pages, fewer than the `whole` pages of a new segment (the least free
    /// one of those: larger ones stay for other requests); returns the block
    /// and the pages to add. (Extending also when it saves no page, to join
    /// the partly used pages of consecutive requests, was measured worse on
    /// small trainings: the free end it takes is gone for the next one.)
    fn extensible_tail(
        &self,
        pool: u32,
        stream: StreamId,
        rounded: u64,
        extra: u64,
        whole: u64,
        page: u64,
    ) -> Option<(u32, u64)> {
        // (pages to add, free bytes, address, block)
        let mut best: Option<(u64, u64, DevicePtr, u32)> = None;
        for (s, size, addr, blk) in self.arena.pools[pool as usize].free.at_least(1) {
            if s != stream || size >= rounded {
                continue;
            }
            let add = (rounded - size + extra).div_ceil(page);
            if add >= whole || best.is_some_and(|b| (add, size, addr) >= (b.0, b.1, b.2)) {
                continue;
            }
            let b = self.arena.blocks.get(blk);
            if b.next != NIL {
                continue;
            }
            if self.paging.segs.get(&b.segment).is_some_and(|ps| add * page <= ps.room) {
                best = Some((add, size, addr, blk));
            }
        }
        best.map(|(add, _, _, blk)| (blk, add))
    }

    /// Extends a paged segment of `pool` on `stream` whose last block is free
    /// by the pages that make that block hold `rounded` bytes (and `extra`
    /// more: the part of the policy's segment beyond the request), when that
    /// takes fewer pages than the `whole` of a new segment: free
    /// whole pages of other blocks first when `stitch` (a stitch's pages),
    /// then fresh ones. Returns the grown block (taken out of the free
    /// index), or `None` when no segment can grow so, while plans are in
    /// use (`Planning::plans_in_use`), or (with `stitch`)
    /// when no free page would be used. A device error creating the fresh
    /// pages (out of memory) changes nothing.
    pub(super) fn extend_tail(
        &mut self,
        pool: u32,
        stream: StreamId,
        rounded: u64,
        extra: u64,
        whole: u64,
        stitch: bool,
    ) -> Result<Option<u32>, AllocError> {
        let page = self.device.granularity();
        if page == 0 || self.paging.segs.is_empty() || self.planning.as_ref().is_some_and(|p| p.plans_in_use()) {
            return Ok(None);
        }
        let Some((blk, need)) = self.extensible_tail(pool, stream, rounded, extra, whole, page) else {
            return Ok(None);
        };
        let (plan, have) = if stitch { self.plan_runs(need, blk) } else { (Vec::new(), 0) };
        if stitch && have == 0 {
            return Ok(None);
        }
        let fresh = match self.create_pages(need - have, page) {
            Ok(f) => f,
            Err(DeviceError::OutOfMemory { .. }) => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        let mut pages = self.take_runs(plan)?;
        pages.extend(fresh);
        // Carving may have cut the segment: `blk` is still its last block.
        let si = self.arena.blocks.get(blk).segment;
        let seg = *self.arena.segments.get(si);
        let end = seg.base + seg.size;
        self.map_at(end, &pages, page)?;
        let added = need * page;
        let b = *self.arena.blocks.get(blk);
        self.arena.pools[pool as usize].free.remove(&(seg.stream, b.size, seg.base + b.offset, blk));
        self.arena.blocks.get_mut(blk).size += added;
        self.arena.segments.get_mut(si).size += added;
        let ps = self.paging.segs.get_mut(&si).expect("an extended segment is paged");
        debug_assert!(ps.room >= added);
        ps.room -= added;
        ps.pages.extend(pages);
        self.stats.bytes.grow(added);
        self.arena.pools[pool as usize].gauges.grow(added);
        self.stats.device_alloc_calls += need - have;
        if have > 0 {
            self.stats.stitches += 1;
            self.stats.stitched_bytes += have * page;
        }
        self.record(ActionKind::SegmentAlloc, end, added, stream, None);
        Ok(Some(blk))
    }

    /// Releases free whole pages inside paged segments of the selected pools
    /// (largest runs first) until `target` bytes are released. Returns the
    /// bytes released.
    pub(super) fn trim_pages(&mut self, target: u64, names: Option<&[String]>) -> Result<u64, AllocError> {
        let page = self.device.granularity();
        let mut released = 0u64;
        // Greatest first. Carving a run leaves no whole page in its block and
        // changes no other run's block (one run per free block, addresses
        // absolute): the runs are found once.
        let mut runs = self.free_page_runs(names);
        runs.sort_unstable_by_key(|r| std::cmp::Reverse(r.rank()));
        for mut run in runs {
            if released >= target {
                break;
            }
            run.count = run.count.min((target - released).div_ceil(page));
            let stream = self.arena.segments.get(self.arena.blocks.get(run.block).segment).stream;
            self.quiesce(&[stream])?;
            for h in self.carve(run)? {
                self.device.release_physical(h)?;
                self.stats.device_free_calls += 1;
            }
            released += run.count * page;
            self.stats.trimmed_bytes += run.count * page;
        }
        Ok(released)
    }
}
