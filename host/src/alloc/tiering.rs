//! Moving tensors between the device and the host and disk tiers: eviction
//! under pressure, bring-back on use, prefetch at phase boundaries.
//!
//! ```text
//!  request ─► cached block? ─► new segment? ─OOM─► reclamation (in grow)
//!     ─► defragmentation (compaction, once) ─► eviction policy: victims for the
//!     missing bytes (validated, completed by LRU) ─► move them off ─► release
//!     free segments ─► retry … until served, or nothing is left to evict (OOM)
//! ```
//!
//! Invariants (checked by [`Allocator::check_invariants`]):
//! - a tensor is on exactly one tier: `tier == Device` ⇔ it holds a block;
//!   otherwise its block is `NIL` and the tier store has one entry for its
//!   slot, on the host or on disk as its `tier` says, with its bytes;
//! - every tier-store entry belongs to a live off-device tensor;
//! - `host_bytes = Σ host entries ≤ host capacity`, `disk_bytes = Σ disk
//!   entries = bytes the disk tier holds ≤ quota`;
//! - a pinned tensor is on the device (pinning brings it back; eviction
//!   skips it);
//! - a failed move changes nothing: the tensor stays where it was, with its
//!   contents.
//!
//! The device gauges (`live`, `allocated`) count device tensors only.

use std::sync::Arc;

use super::slab::NIL;
use super::{ActionKind, AllocError, Allocator};
use crate::decision::{validate_victims, AllocRequest, EvictionCandidate};
use crate::device::{Device, HostBuf};
use crate::tier::{Offloaded, Stored, TierConfig, TierError, TierState, TierStats};
use crate::types::{TensorId, Tier};

impl<D: Device> Allocator<D> {
    /// Enables the host and disk tiers: from now on a request the device
    /// cannot serve evicts tensors instead of failing, and a use of an
    /// off-device tensor brings it back.
    pub fn enable_tiers(&mut self, cfg: TierConfig) {
        match self.tiers.as_mut() {
            Some(t) => t.cfg = TierConfig { spill_dir: t.cfg.spill_dir.clone(), ..cfg },
            None => self.tiers = Some(Box::new(TierState::new(cfg))),
        }
    }

    /// The tiers, when enabled.
    pub fn tier_state(&self) -> Option<&TierState> {
        self.tiers.as_deref()
    }

    /// Tier counters and gauges (zero when the tiers are not enabled).
    pub fn tier_stats(&self) -> TierStats {
        self.tiers.as_ref().map(|t| t.stats).unwrap_or_default()
    }

    /// Where a live tensor's bytes are.
    pub fn tier(&self, id: TensorId) -> Result<Tier, AllocError> {
        self.tensors.get(id).map(|t| t.tier).ok_or(AllocError::UnknownTensor(id))
    }

    /// Records the position of a tensor's next use (look-ahead of a replay,
    /// for offline eviction policies); unknown handles are ignored.
    pub fn set_next_use(&mut self, id: TensorId, next: Option<u64>) {
        if let Some(t) = self.tensors.get_mut(id) {
            t.next_use = next;
        }
    }

    /// Whether the eviction policy reads the future (an offline bound).
    pub fn eviction_needs_future(&self) -> bool {
        self.policies.eviction_needs_future()
    }

    /// Brings a tensor back to the device if it is not there (a stall).
    pub fn ensure_resident(&mut self, id: TensorId) -> Result<(), AllocError> {
        match self.tier(id)? {
            Tier::Device => Ok(()),
            _ => self.bring_back(id, false),
        }
    }

    /// A `use` with tiers enabled: bring back, wait for a prefetch in
    /// flight, advance the workload clock.
    pub(super) fn use_tiered(&mut self, id: TensorId) -> Result<(), AllocError> {
        let t = self.tensors.get(id).ok_or(AllocError::UnknownTensor(id))?;
        let (tier, bytes) = (t.tier, t.bytes);
        if tier != Tier::Device {
            self.bring_back(id, false)?;
        }
        if let Some(ts) = self.tiers.as_mut() {
            ts.on_use(id.slot, bytes);
        }
        Ok(())
    }

    /// Moves tensors off the device (to the host, or to disk when the host
    /// is full); tensors already off the device or pinned are skipped.
    /// Returns the bytes moved. On an error the tensors moved so far stay
    /// moved and the failing one stays where it was.
    pub fn evict(&mut self, ids: &[TensorId]) -> Result<u64, AllocError> {
        if self.tiers.is_none() {
            return Err(TierError::Disabled.into());
        }
        let mut moved = 0;
        for &id in ids {
            moved += self.evict_one(id)?;
        }
        Ok(moved)
    }

    pub(super) fn evict_one(&mut self, id: TensorId) -> Result<u64, AllocError> {
        let t = *self.tensors.get(id).ok_or(AllocError::UnknownTensor(id))?;
        if t.tier != Tier::Device || self.tensors.pins.contains_key(&id.slot) {
            return Ok(0);
        }
        let addr = self.address(id)?;
        let bytes = t.bytes;
        let contents = self.tiers.as_ref().is_some_and(|ts| ts.cfg.copy_contents);
        let data = if contents {
            let len = usize::try_from(bytes).map_err(|_| TierError::TooLargeForHost { what: id.to_string(), bytes })?;
            let mut buf = self.device.alloc_host(len)?;
            self.device.read(addr, &mut buf)?;
            Some(Arc::new(buf))
        } else {
            None
        };
        let to_disk = self.make_host_room(bytes)?;
        let stored = if to_disk { Stored::Disk(self.write_spill(id, bytes, data)?) } else { Stored::Host(data) };
        // Committed: the block leaves the tensor.
        let blk = t.block;
        let b = *self.arena.blocks.get(blk);
        let seg = *self.arena.segments.get(b.segment);
        self.arena.blocks.get_mut(blk).tensor = NIL;
        self.stats.bytes.sub_live(bytes, b.size);
        self.arena.pools[seg.pool as usize].gauges.sub_live(bytes, b.size);
        self.record(ActionKind::Free, seg.base + b.offset, bytes, seg.stream, Some(t.kind));
        {
            let tm = self.tensors.get_mut(id).expect("checked above");
            tm.block = NIL;
            tm.tier = if to_disk { Tier::Disk } else { Tier::Host };
            tm.cross_stream = false;
        }
        let clock = self.clock;
        let ts = self.tiers.as_mut().expect("checked by evict");
        ts.entries.insert(id.slot, Offloaded { bytes, stored, evicted_at: clock });
        ts.ready_at.remove(&id.slot);
        ts.add(to_disk, bytes);
        ts.stats.evictions += 1;
        let us = ts.host_us(bytes) + if to_disk { ts.disk_us(bytes) } else { 0.0 };
        ts.copy_sync(us, false);
        self.stats.evicted_bytes += bytes;
        let streams = if t.cross_stream { self.deferred.cross_uses.remove(&id.slot) } else { None };
        if let Some(streams) = streams {
            if self.defer_free(blk, &streams)? {
                return Ok(bytes);
            }
        }
        self.return_block(blk)?;
        Ok(bytes)
    }

    /// Makes room for `bytes` on the host tier by spilling its least
    /// recently used tensors (never the one being brought back) to disk.
    /// Returns `true` when the tensor must go to disk itself (larger than the
    /// host tier, or the host cannot make room).
    fn make_host_room(&mut self, bytes: u64) -> Result<bool, AllocError> {
        let ts = self.tiers.as_ref().ok_or(TierError::Disabled)?;
        let keep = ts.bringing;
        if bytes > ts.cfg.host_capacity {
            return Ok(true);
        }
        let mut free = ts.host_free();
        if free >= bytes {
            return Ok(false);
        }
        let mut host: Vec<(u64, u32, u64)> = ts
            .entries
            .iter()
            .filter(|(&slot, e)| matches!(e.stored, Stored::Host(_)) && Some(slot) != keep)
            .map(|(&slot, e)| (self.tensors.by_slot(slot).map_or(0, |(_, t)| t.last_use), slot, e.bytes))
            .collect();
        host.sort_unstable();
        let mut pick = Vec::new();
        for (_, slot, b) in host {
            if free >= bytes {
                break;
            }
            free += b;
            pick.push(slot);
        }
        self.spill_to_disk(&pick)?;
        // Still short (the tensor being brought back holds the rest): this one goes to disk.
        Ok(self.tiers.as_ref().is_some_and(|ts| ts.host_free() < bytes))
    }

    /// Moves host-tier tensors to disk, writing their files in parallel.
    /// Those whose write fails stay on the host; the first error is returned.
    fn spill_to_disk(&mut self, slots: &[u32]) -> Result<(), AllocError> {
        let ts = self.tiers.as_mut().ok_or(TierError::Disabled)?;
        let mut first_err = None;
        let mut with_data = Vec::new();
        let mut bufs = Vec::new();
        for &slot in slots {
            match &ts.entries[&slot].stored {
                Stored::Host(Some(d)) => {
                    with_data.push(slot);
                    bufs.push(Arc::clone(d));
                }
                Stored::Host(None) => {
                    let bytes = ts.entries[&slot].bytes;
                    match ts.disk.reserve(bytes, &format!("tensor slot {slot}")) {
                        Ok(()) => {
                            ts.entries.get_mut(&slot).expect("listed").stored = Stored::Disk(None);
                            spilled(ts, bytes);
                        }
                        Err(e) => {
                            first_err.get_or_insert(e);
                        }
                    }
                }
                Stored::Disk(_) => {}
            }
        }
        let results = if bufs.is_empty() { Vec::new() } else { ts.disk.write_batch(bufs) };
        for (slot, r) in with_data.into_iter().zip(results) {
            match r {
                Ok(f) => {
                    let e = ts.entries.get_mut(&slot).expect("listed");
                    e.stored = Stored::Disk(Some(f));
                    let bytes = e.bytes;
                    spilled(ts, bytes);
                }
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        let moved: Vec<u32> = slots
            .iter()
            .copied()
            .filter(|s| ts.entries.get(s).is_some_and(|e| matches!(e.stored, Stored::Disk(_))))
            .collect();
        for slot in moved {
            if let Some((id, _)) = self.tensors.by_slot(slot) {
                self.tensors.get_mut(id).expect("live").tier = Tier::Disk;
            }
        }
        match first_err {
            Some(e) => Err(e.into()),
            None => Ok(()),
        }
    }

    /// Writes one evicted tensor straight to a spill file (or accounts it
    /// when there are no contents).
    fn write_spill(
        &mut self,
        id: TensorId,
        bytes: u64,
        data: Option<Arc<HostBuf>>,
    ) -> Result<Option<crate::tier::disk::SpillFile>, AllocError> {
        let ts = self.tiers.as_mut().ok_or(TierError::Disabled)?;
        match data {
            Some(d) => {
                let f = ts.disk.write_batch(vec![d]).pop().expect("one result per buffer")?;
                Ok(Some(f))
            }
            None => {
                ts.disk.reserve(bytes, &id.to_string())?;
                Ok(None)
            }
        }
    }

    /// Brings an off-device tensor back: reads its contents (checking a
    /// spill file's checksum), places a block (which may evict others),
    /// writes the contents. A prefetch queues the copy without a stall and
    /// never evicts. On an error the tensor stays where it was.
    pub(super) fn bring_back(&mut self, id: TensorId, prefetch: bool) -> Result<(), AllocError> {
        let t = *self.tensors.get(id).ok_or(AllocError::UnknownTensor(id))?;
        if t.tier == Tier::Device {
            return Ok(());
        }
        let ts = self.tiers.as_ref().ok_or(TierError::Disabled)?;
        let entry = ts.entries.get(&id.slot).cloned().ok_or(TierError::Disabled)?;
        let data: Option<Arc<HostBuf>> = match &entry.stored {
            Stored::Host(d) => d.clone(),
            Stored::Disk(Some(f)) => Some(Arc::new(HostBuf::from(
                ts.disk.read_batch(std::slice::from_ref(f)).pop().expect("one result per file")?,
            ))),
            Stored::Disk(None) => None,
        };
        let req = AllocRequest { bytes: t.bytes, kind: t.kind, stream: t.stream };
        let (was_prefetching, was_bringing) = {
            let ts = self.tiers.as_mut().expect("checked");
            let w = (ts.prefetching, ts.bringing);
            ts.prefetching = prefetch;
            ts.bringing = Some(id.slot);
            w
        };
        let placed = self.place_block(&req);
        {
            let ts = self.tiers.as_mut().expect("checked");
            ts.prefetching = was_prefetching;
            ts.bringing = was_bringing;
        }
        let (block, _) = placed?;
        let b = *self.arena.blocks.get(block);
        let seg = *self.arena.segments.get(b.segment);
        let addr = seg.base + b.offset;
        if let Some(d) = &data {
            if let Err(e) = self.device.write(addr, d) {
                self.return_block(block)?;
                return Err(e.into());
            }
        }
        self.arena.blocks.get_mut(block).tensor = id.slot;
        self.stats.bytes.add_live(t.bytes, b.size);
        self.arena.pools[seg.pool as usize].gauges.add_live(t.bytes, b.size);
        self.record(ActionKind::Alloc, addr, t.bytes, seg.stream, Some(t.kind));
        let clock = self.clock;
        {
            let tm = self.tensors.get_mut(id).expect("checked above");
            tm.block = block;
            tm.tier = Tier::Device;
            if prefetch {
                // Counts as recent, so that the next eviction does not undo it.
                tm.last_use = clock;
            }
        }
        let ts = self.tiers.as_mut().expect("checked");
        // The entry may have moved to disk while making room (never this
        // one: `bringing` protects it), so take it as it is now.
        let e = ts.entries.remove(&id.slot).expect("an off-device tensor has an entry");
        let on_disk = matches!(e.stored, Stored::Disk(_));
        ts.sub(on_disk, e.bytes);
        match &e.stored {
            Stored::Disk(Some(f)) => {
                if let Err(err) = ts.disk.remove(f) {
                    tracing::warn!(error = %err, "spill file left behind (removed at shutdown)");
                }
            }
            Stored::Disk(None) => ts.disk.unreserve(e.bytes),
            Stored::Host(_) => {}
        }
        let us = ts.host_us(e.bytes) + if on_disk { ts.disk_us(e.bytes) } else { 0.0 };
        if prefetch {
            let end = ts.copy_async(us);
            ts.ready_at.insert(id.slot, end);
            self.stats.prefetched_bytes += e.bytes;
        } else {
            ts.copy_sync(us, true);
            ts.stats.fetched_bytes += e.bytes;
        }
        Ok(())
    }

    /// Prefetch at a phase boundary: brings off-device tensors back into
    /// free device memory (never evicting), in the eviction policy's order
    /// when it gives a valid one, else most recently evicted first, up to
    /// `prefetch_fraction` of the capacity, and only while `growth` (how much
    /// live bytes grew the last time the coming phase ran) plus
    /// `prefetch_headroom` of the capacity stay free: prefetching into memory
    /// the phase will allocate only makes it evict.
    pub(super) fn prefetch(&mut self, growth: u64) -> Result<(), AllocError> {
        let Some(ts) = self.tiers.as_ref() else { return Ok(()) };
        if !ts.cfg.prefetch || ts.entries.is_empty() {
            return Ok(());
        }
        let capacity = self.device.capacity() as f64;
        let budget = (capacity * ts.cfg.prefetch_fraction) as u64;
        let headroom = ((capacity * ts.cfg.prefetch_headroom) as u64).saturating_add(growth);
        let mut cands: Vec<(u64, EvictionCandidate)> = ts
            .entries
            .iter()
            .filter_map(|(&slot, e)| {
                let (id, t) = self.tensors.by_slot(slot)?;
                let c = EvictionCandidate {
                    id,
                    bytes: t.bytes,
                    kind: t.kind,
                    tier: t.tier,
                    last_use: t.last_use,
                    use_count: t.use_count,
                    in_use: false,
                    pinned: false,
                    phase: t.phase,
                    next_use: t.next_use,
                };
                Some((e.evicted_at, c))
            })
            .collect();
        cands.sort_unstable_by_key(|(at, c)| (std::cmp::Reverse(*at), c.id));
        let cands: Vec<EvictionCandidate> = cands.into_iter().map(|(_, c)| c).collect();
        let ctx = self.context();
        let order = match self.policies.prefetch_order(&cands, &ctx) {
            Some(v) if validate_victims(&cands, &v).is_ok() => v,
            _ => cands.iter().map(|c| c.id).collect(),
        };
        let mut done = 0u64;
        for id in order {
            let Some(t) = self.tensors.get(id) else { continue };
            if done.saturating_add(t.bytes) > budget {
                break;
            }
            let bytes = t.bytes;
            let free = self.device.available().unwrap_or(0).saturating_add(self.cached_bytes());
            if free < bytes.saturating_add(headroom) {
                break;
            }
            match self.bring_back(id, true) {
                Ok(()) => done += bytes,
                Err(AllocError::OutOfMemory { .. }) => break,
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// A tensor freed while off the device: its entry and spill file go.
    pub(super) fn free_offloaded(&mut self, id: TensorId) {
        self.stats.frees += 1;
        let Some(ts) = self.tiers.as_mut() else { return };
        ts.ready_at.remove(&id.slot);
        if let Some(e) = ts.entries.remove(&id.slot) {
            let on_disk = matches!(e.stored, Stored::Disk(_));
            ts.sub(on_disk, e.bytes);
            match &e.stored {
                Stored::Disk(Some(f)) => {
                    if let Err(err) = ts.disk.remove(f) {
                        tracing::warn!(error = %err, "spill file left behind (removed at shutdown)");
                    }
                }
                Stored::Disk(None) => ts.disk.unreserve(e.bytes),
                Stored::Host(_) => {}
            }
        }
    }

    /// The tier invariants of the module documentation.
    pub(super) fn check_tiers(&self) -> Result<(), String> {
        let Some(ts) = self.tiers.as_ref() else {
            return match self.tensors.iter().find(|(_, t)| t.tier != Tier::Device) {
                Some((id, _)) => Err(format!("{id} is off the device but the tiers are not enabled")),
                None => Ok(()),
            };
        };
        let (mut host, mut disk) = (0u64, 0u64);
        for (id, t) in self.tensors.iter() {
            if t.tier == Tier::Device {
                continue;
            }
            if t.block != NIL {
                return Err(format!("{id} is on the {:?} tier but holds block {}", t.tier, t.block));
            }
            if self.tensors.pins.contains_key(&id.slot) {
                return Err(format!("{id} is pinned but off the device"));
            }
            let e = ts.entries.get(&id.slot).ok_or_else(|| format!("{id} is off the device without an entry"))?;
            if e.bytes != t.bytes {
                return Err(format!("{id}: entry of {} bytes for a tensor of {}", e.bytes, t.bytes));
            }
            match (&e.stored, t.tier) {
                (Stored::Host(d), Tier::Host) => {
                    if d.as_ref().is_some_and(|d| d.len() as u64 != t.bytes) {
                        return Err(format!("{id}: host copy of the wrong length"));
                    }
                    host += e.bytes;
                }
                (Stored::Disk(f), Tier::Disk) => {
                    if f.as_ref().is_some_and(|f| f.len != t.bytes) {
                        return Err(format!("{id}: spill file of the wrong length"));
                    }
                    disk += e.bytes;
                }
                (_, tier) => return Err(format!("{id} says {tier:?} but its entry disagrees")),
            }
        }
        if ts.entries.len() != self.tensors.iter().filter(|(_, t)| t.tier != Tier::Device).count() {
            return Err("a tier entry belongs to no off-device tensor".into());
        }
        if (host, disk) != (ts.stats.host_bytes, ts.stats.disk_bytes) {
            return Err(format!(
                "tier gauges host {} disk {} disagree with recount host {host} disk {disk}",
                ts.stats.host_bytes, ts.stats.disk_bytes
            ));
        }
        if host > ts.cfg.host_capacity {
            return Err(format!("host tier holds {host} bytes, more than its capacity"));
        }
        if ts.disk.used_bytes() != disk || disk > ts.disk.quota() {
            return Err(format!("disk tier holds {} bytes for {disk} of entries", ts.disk.used_bytes()));
        }
        Ok(())
    }
}

fn spilled(ts: &mut TierState, bytes: u64) {
    ts.sub(false, bytes);
    ts.add(true, bytes);
    ts.stats.spilled_bytes += bytes;
    let us = ts.disk_us(bytes);
    ts.copy_sync(us, false);
}
