//! Paged segments and the two mechanisms they allow: stitching and trimming.
//!
//! While the reclamation policy asks for it ([`ReclamationPolicy::paged_segments`]
//! — read at each growth) and the device has a virtual memory API
//! (granularity > 0), a segment of at least two pages is built from
//! individually mapped physical pages: one virtual reservation, each page
//! mapped on its own (`cuMemAddressReserve` + `cuMemMap` on CUDA), instead
//! of one `cudaMalloc`. A page is a part of a physical allocation, a
//! *chunk*: the fresh pages of one growth are one chunk (`cuMemCreate` once,
//! each page mapped at its offset: [`Device::map_part`]; a page at a time
//! where the device cannot map parts), as a growth of PyTorch's caching
//! allocator is one `cudaMalloc`. A page given back (trim, release) while
//! other pages of its chunk are in use stays *spare*: reserved, in no pool;
//! the next growth, stitch or arena takes spare pages before it makes a
//! chunk, and a chunk goes back to the device once all its pages are spare.
//! What a chunk keeps from the device is thus used again by the run itself
//! (measured: no overhead of a recorded or shared trace changed against
//! chunks of at most 1/64 of the reserved bytes; a planned arena made from
//! spare pages is whole pages, within one page of an exact-size one).
//!
//! [`Device::map_part`]: crate::device::Device::map_part
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
//!   and a reservation with no segment is released at once;
//! - a chunk has fewer spare pages than pages (one all spare is released),
//!   and the reserved gauge counts the spare pages
//!   (`Paging::spare_counted`, settled by `Allocator::settle_spare` after the
//!   pools' gauges drop, so that no peak counts a page twice).
//!
//! [`ReclamationPolicy::paged_segments`]: crate::decision::ReclamationPolicy::paged_segments

use super::grow::Growth;
use super::slab::{Block, Segment, NIL};
use super::{ActionKind, AllocError, Allocator};
use crate::decision::AllocRequest;
use crate::device::{Device, DeviceError, DevicePtr, PhysHandle};
use crate::types::{StreamId, TensorKind};
use std::collections::VecDeque;

/// One page of paged memory: a granule of a physical allocation (a
/// *chunk*, made for one growth: one device call for all its pages) from
/// `off` on. A chunk goes back to the device once none of its pages is in
/// use; until then a page given back is *spare* (still reserved), and the
/// next growth takes spare pages before it makes a chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Page {
    /// The physical allocation.
    pub chunk: PhysHandle,
    /// Offset of the page in it.
    pub off: u64,
}

/// A physical allocation pages are cut from.
#[derive(Debug, Clone, Default)]
pub(crate) struct Chunk {
    /// Its pages.
    pages: u64,
    /// Offsets of its spare pages (given back, not mapped).
    spare: Vec<u64>,
}

/// The pages of one paged segment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PagedSeg {
    /// Page `i` is mapped at `segment.base + i × page` (a deque: a carve
    /// keeps the larger side of the run in place and copies the smaller).
    pub pages: VecDeque<Page>,
    /// The reservation the segment lies in (key of `Allocator::reservations`).
    pub resv: DevicePtr,
    /// Bytes of address space right after the segment's end, inside its
    /// reservation, that no segment uses: it may be extended by as much.
    pub room: u64,
}

/// The paging part of the allocator: the pages of paged segments and the
/// A loading growth of fewer pages than this gets a chunk of up to this
/// many ([`Allocator::create_growth_pages`]): 20 MiB of 2 MiB pages,
/// PyTorch's segment for requests of 1–10 MiB.
pub(crate) const GROWTH_PAGES: u64 = 10;

/// A parameter's growth takes at most the bytes reserved over this in
/// extra pages ([`Allocator::create_growth_pages`]).
pub(crate) const PARAM_SLACK: u64 = 2;

/// A growth of no known kind ([`TensorKind::Other`]) before the run's first
/// free takes at most the bytes reserved over this in extra pages
/// ([`Allocator::create_growth_pages`]).
pub(crate) const LOADING_SLACK: u64 = 8;

/// virtual reservations they lie in.
#[derive(Debug, Default)]
pub(crate) struct Paging {
    /// Pages of paged segments (by segment index).
    pub segs: rustc_hash::FxHashMap<u32, PagedSeg>,
    /// Virtual reservations of paged segments (by base address).
    pub reservations: rustc_hash::FxHashMap<DevicePtr, Reservation>,
    /// The physical allocations pages are cut from (by handle), in the
    /// order they were made.
    pub chunks: std::collections::BTreeMap<u64, Chunk>,
    /// Spare pages in all chunks.
    pub spare_pages: u64,
    /// Bytes of spare pages counted in the reserved gauge
    /// ([`Allocator::settle_spare`]).
    pub spare_counted: u64,
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
        let mut spare = 0u64;
        for (h, c) in &self.chunks {
            let n = c.spare.len() as u64;
            if c.pages == 0 || n >= c.pages || c.spare.iter().any(|&o| o % page.max(1) != 0 || o >= c.pages * page) {
                return Err(format!("chunk {h} of {} pages holds {n} spare pages (or a bad offset)", c.pages));
            }
            spare += n;
        }
        if spare != self.spare_pages || self.spare_counted != spare * page {
            return Err(format!(
                "{spare} spare pages in chunks, {} counted, {} bytes in the gauge",
                self.spare_pages, self.spare_counted
            ));
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

    /// The page size where spare pages can make (part of) a segment of
    /// `segment_bytes` that the policy did not ask to be paged: whole
    /// pages, at least one, and a spare page at hand; 0 otherwise.
    pub(super) fn spare_page_for(&self, segment_bytes: u64) -> u64 {
        let page = self.device.granularity();
        let whole = page > 0 && segment_bytes >= page && segment_bytes.is_multiple_of(page);
        if whole && self.paging.spare_pages > 0 && self.device.maps_parts() {
            page
        } else {
            0
        }
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

    /// Obtains `pages` pages not in use: spare ones first, then one chunk
    /// for the rest (one device call; one per page where the device cannot
    /// map part of an allocation), counted in `device_alloc_calls`. The
    /// reserved gauge drops by the spare pages taken (the caller counts
    /// the pages where it puts them). On failure nothing changes and the
    /// device's error is returned.
    pub(super) fn create_pages(&mut self, pages: u64, page: u64) -> Result<Vec<Page>, DeviceError> {
        self.create_pages_with(pages, 0, page)
    }

    /// [`Allocator::create_pages`] for a growth of the dynamic path for a
    /// tensor of `kind`. While no plan is in use, the fresh chunk of such a
    /// growth of fewer than [`GROWTH_PAGES`] pages is made larger, up to
    /// that many, when the growth loads rather than works: a parameter's
    /// (by at most half the bytes reserved), or one of no known kind before
    /// the run's first free (by at most an eighth: a snapshot's tensors
    /// older than its window). Its pages beyond `pages` wait spare for
    /// the next growths, as a PyTorch segment of 20 MiB serves several
    /// requests of 1–10 MiB with one `cudaMalloc`. Loading comes before a
    /// training step reaches its peak: the growths after it (gradients,
    /// activations) take those pages first, so the peak holds none of them
    /// (slack for every growth left the peaks of small trainings holding
    /// it: see docs/measurements.md). When the larger chunk does not fit,
    /// the exact one is made.
    pub(super) fn create_growth_pages(
        &mut self,
        pages: u64,
        page: u64,
        kind: TensorKind,
    ) -> Result<Vec<Page>, DeviceError> {
        let fresh = pages.saturating_sub(self.paging.spare_pages);
        let planned = self.planning.as_ref().is_some_and(|p| p.plans_in_use());
        let share = match kind {
            _ if fresh == 0 || planned || !self.device.maps_parts() => None,
            TensorKind::Param => Some(PARAM_SLACK),
            TensorKind::Other if self.stats.frees == 0 => Some(LOADING_SLACK),
            _ => None,
        };
        let mut slack = share.map_or(0, |d| {
            let room = self.stats.bytes.reserved_bytes / d / page.max(1);
            GROWTH_PAGES.saturating_sub(fresh).min(room)
        });
        if fresh > 0 && !planned && self.device.maps_parts() {
            slack = slack.max(self.warm_slack(fresh, page));
        }
        if slack > 0 {
            match self.create_pages_with(pages, slack, page) {
                Err(DeviceError::OutOfMemory { .. }) => {}
                made => return made,
            }
        }
        self.create_pages_with(pages, 0, page)
    }

    /// Extra pages for a fresh chunk of `fresh` pages in a run whose plan
    /// cache says its dynamic path reserved the cache's high-water mark
    /// (`Planning::grows_to_mark`: steps unsteady, or no plan served): this
    /// run's same dynamic path reaches it too, so growing up to it raises
    /// no peak, and the run's later growths are served by spare pages
    /// without device calls. At most the bytes reserved so far (the chunks
    /// double: a cache of a larger training costs this one at most what it
    /// holds), to the mark, not beyond.
    fn warm_slack(&self, fresh: u64, page: u64) -> u64 {
        let hits = self.stats.plan_hits;
        let Some(mark) = self.planning.as_ref().filter(|p| p.grows_to_mark(hits)).map(|p| p.cached_mark()) else {
            return 0;
        };
        let reserved = self.stats.bytes.reserved_bytes;
        let room = mark.saturating_sub(reserved.saturating_add(fresh.saturating_mul(page))) / page.max(1);
        room.min((reserved / page.max(1)).max(GROWTH_PAGES))
    }

    /// [`Allocator::create_pages`] with `extra` more pages in the fresh
    /// chunk (when one chunk is made), left spare: counted reserved.
    fn create_pages_with(&mut self, pages: u64, extra: u64, page: u64) -> Result<Vec<Page>, DeviceError> {
        let mut out = Vec::with_capacity(pages as usize);
        if self.paging.spare_pages > 0 {
            for (&h, c) in self.paging.chunks.iter_mut() {
                while (out.len() as u64) < pages {
                    let Some(off) = c.spare.pop() else { break };
                    out.push(Page { chunk: PhysHandle(h), off });
                }
                if out.len() as u64 == pages {
                    break;
                }
            }
            self.paging.spare_pages -= out.len() as u64;
            self.settle_spare();
        }
        let rest = pages - out.len() as u64;
        // One chunk for the rest (its free pages wait, spare, while any of
        // its pages is in use), or a page at a time.
        let cap = if self.device.maps_parts() { rest.max(1) } else { 1 };
        let chunks: Vec<u64> = (0..rest.div_ceil(cap)).map(|k| cap.min(rest - k * cap)).collect();
        let extra = if chunks.len() == 1 { extra } else { 0 };
        let taken = out.len();
        for n in chunks {
            match self.device.create_physical((n + extra) * page) {
                Ok(h) => {
                    self.stats.device_alloc_calls += 1;
                    // The extra pages are spare at once (the lowest taken first).
                    let spare: Vec<u64> = (n..n + extra).rev().map(|i| i * page).collect();
                    self.paging.chunks.insert(h.0, Chunk { pages: n + extra, spare });
                    self.paging.spare_pages += extra;
                    out.extend((0..n).map(|i| Page { chunk: h, off: i * page }));
                }
                Err(e) => {
                    // What was made goes back; the spare pages taken stay spare.
                    let made: Vec<Page> = out.drain(taken..).collect();
                    self.release_pages(&out)?;
                    self.release_pages(&made)?;
                    self.settle_spare();
                    return Err(e);
                }
            }
        }
        if extra > 0 && rest > 0 {
            self.settle_spare();
        }
        Ok(out)
    }

    /// Gives back pages no longer mapped: each becomes spare, and a chunk
    /// all of whose pages are spare goes back to the device (counted in
    /// `device_free_calls`). The reserved gauge follows at the caller's
    /// next [`Allocator::settle_spare`], once it has taken the pages' bytes
    /// out of its own gauges.
    pub(super) fn release_pages(&mut self, pages: &[Page]) -> Result<(), DeviceError> {
        for p in pages {
            let c = self.paging.chunks.get_mut(&p.chunk.0).expect("a page's chunk is known");
            if c.spare.len() as u64 + 1 < c.pages {
                c.spare.push(p.off);
                self.paging.spare_pages += 1;
                continue;
            }
            let spare = c.spare.len() as u64;
            self.device.release_physical(p.chunk)?;
            self.paging.chunks.remove(&p.chunk.0);
            self.paging.spare_pages -= spare;
            self.stats.device_free_calls += 1;
        }
        Ok(())
    }

    /// Brings the reserved gauge in line with the spare pages (which are
    /// reserved memory outside any pool). Called after the gauges of the
    /// pools have dropped by the pages given back, so that the peak never
    /// counts a page twice.
    pub(super) fn settle_spare(&mut self) {
        let want = self.paging.spare_pages * self.device.granularity();
        let had = self.paging.spare_counted;
        if want > had {
            self.stats.bytes.grow(want - had);
        } else {
            self.stats.bytes.shrink(had - want);
        }
        self.paging.spare_counted = want;
    }

    /// Maps page `p` at `va`.
    pub(super) fn map_page(&mut self, va: DevicePtr, p: Page, page: u64) -> Result<(), DeviceError> {
        if p.off == 0 && self.paging.chunks.get(&p.chunk.0).is_some_and(|c| c.pages == 1) {
            self.device.map(va, p.chunk)
        } else {
            self.device.map_part(va, p.chunk, p.off, page)
        }
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
    fn map_pages(&mut self, pages: &[Page], page: u64, room: u64) -> Result<DevicePtr, DeviceError> {
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
    fn map_at(&mut self, va: DevicePtr, pages: &[Page], page: u64) -> Result<(), DeviceError> {
        for (i, &h) in pages.iter().enumerate() {
            if let Err(e) = self.map_page(va + i as u64 * page, h, page) {
                for j in 0..i {
                    self.device.unmap(va + j as u64 * page)?;
                }
                return Err(e);
            }
        }
        Ok(())
    }

    /// Allocates a paged segment of `bytes` (a multiple of `page`) for a
    /// tensor of `kind`: returns its base. The device's error (e.g. out of
    /// memory) leaves nothing behind.
    pub(super) fn alloc_paged_segment(
        &mut self,
        bytes: u64,
        page: u64,
        kind: TensorKind,
    ) -> Result<(DevicePtr, PagedSeg), DeviceError> {
        let pages = self.create_growth_pages(bytes / page, page, kind)?;
        let room = self.room_for_extension(page);
        match self.map_pages(&pages, page, room) {
            Ok(va) => {
                self.stats.paged_segments += 1;
                Ok((va, PagedSeg { pages: pages.into(), resv: va, room }))
            }
            Err(e) => {
                self.release_pages(&pages)?;
                self.settle_spare();
                Err(e)
            }
        }
    }

    /// Unmaps and gives back a paged segment's pages (the segment itself is
    /// removed by the caller, which settles the spare pages after its
    /// gauges); releases the reservation when it was the last segment in it.
    pub(super) fn release_paged(&mut self, seg: &Segment, mut ps: PagedSeg) -> Result<(), AllocError> {
        let page = self.device.granularity();
        for i in 0..ps.pages.len() {
            self.device.unmap(seg.base + i as u64 * page)?;
        }
        self.release_pages(ps.pages.make_contiguous())?;
        self.drop_resv_ref(ps.resv)?;
        Ok(())
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

    /// Bytes of spare pages: reserved, in no segment, taken by the next
    /// growth before the device is asked.
    pub(super) fn spare_bytes(&self) -> u64 {
        self.paging.spare_pages * self.device.granularity()
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
    fn carve(&mut self, run: PageRun) -> Result<Vec<Page>, AllocError> {
        let page = self.device.granularity();
        let blk = run.block;
        let b0 = *self.arena.blocks.get(blk);
        let s = b0.segment;
        let seg = *self.arena.segments.get(s);
        let first_page = (run.va - seg.base) / page;
        let run = PageRunIdx { first: first_page, count: run.count };
        let pool = seg.pool as usize;
        let ps = self.paging.segs.remove(&s).expect("carve is called on paged segments");
        // The pages before the run, the run, the pages after it: the larger
        // of the two sides stays where it is, the other and the run are
        // moved out (a segment of thousands of pages is carved page by
        // page).
        let mut pages = ps.pages;
        let (first, end) = (run.first as usize, (run.first + run.count) as usize);
        let (before, taken, after) = if first >= pages.len() - end {
            let after = pages.split_off(end);
            let taken: Vec<Page> = pages.drain(first..).collect();
            (pages, taken, after)
        } else {
            let before: VecDeque<Page> = pages.drain(..first).collect();
            let taken: Vec<Page> = pages.drain(..end - first).collect();
            (before, taken, pages)
        };
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
    pub(super) fn take_runs(&mut self, plan: Vec<PageRun>) -> Result<Vec<Page>, AllocError> {
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
        req: &AllocRequest,
        segment_bytes: u64,
    ) -> Result<Option<(u32, u64)>, AllocError> {
        let stream = req.stream;
        let page = self.device.granularity();
        if page == 0 || self.paging.segs.is_empty() {
            return Ok(None);
        }
        let need = segment_bytes.div_ceil(page);
        let (plan, have) = self.plan_runs(need, NIL);
        if have == 0 {
            return Ok(None);
        }
        let fresh = match self.create_growth_pages(need - have, page, req.kind) {
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
        self.paging.segs.insert(seg, PagedSeg { pages: pages.into(), resv: va, room });
        self.stats.bytes.add_reserved(size);
        self.arena.pools[pool as usize].gauges.add_reserved(size);
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
        g: &Growth,
        extra: u64,
        whole: u64,
        stitch: bool,
    ) -> Result<Option<u32>, AllocError> {
        let (pool, stream, rounded) = (g.pool, g.req.stream, g.rounded);
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
        let fresh = match self.create_growth_pages(need - have, page, g.req.kind) {
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
            let pages = self.carve(run)?;
            self.release_pages(&pages)?;
            released += run.count * page;
        }
        // Pages of chunks still in use stay reserved (spare): what the
        // device got back is what left the gauge.
        let before = self.stats.bytes.reserved_bytes + released;
        self.settle_spare();
        let released = before - self.stats.bytes.reserved_bytes;
        self.stats.trimmed_bytes += released;
        Ok(released)
    }
}
