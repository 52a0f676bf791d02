//! The simulated device: byte accounting, a cost model, optional host backing.
//!
//! Invariants (checked by [`SimDevice::check_invariants`]):
//! - `used = Σ segment sizes + Σ physical page sizes ≤ capacity`;
//! - segments, reservations and mappings never overlap (addresses come from a
//!   bump pointer and are never reused);
//! - every mapping lies inside one reservation and refers to one physical
//!   allocation (one allocation may be mapped at several addresses:
//!   aliases), whose count of mappings is exact;
//! - each reservation counts the mappings inside it (a release checks that
//!   count, not the reservation's granules);
//! - mappings are indexed by granule: each granule a mapping covers names
//!   that mapping, and no other granule does (map, unmap and lookups are a
//!   few hash operations, whatever the number of mappings).
//!
//! Time model: a host clock `now_us` advances with the cost of every device
//! call (and with [`SimDevice::advance`] for workload time); each stream has its
//! own clock that copies push forward; an event completes once the host clock
//! passes the stream time at which it was recorded; a synchronization moves the
//! host clock to the latest stream clock.

use std::collections::BTreeMap;

use rustc_hash::FxHashMap;

/// Maps keyed by counters that mostly come in order (physical handles,
/// granule indices): each run of 16 consecutive keys goes to 16
/// consecutive buckets, so the paged path's runs of pages stay in cache (a
/// hash that scatters every key made the table lookups half of a paged
/// replay's time); the runs themselves are scattered, so that keys of
/// distant ranges do not pile up in one stretch of the table.
type SeqMap<V> = std::collections::HashMap<u64, V, std::hash::BuildHasherDefault<SeqHasher>>;

/// The hasher of [`SeqMap`]: the key's run of 16 hashed (multiplicative,
/// which also fills the table's tag byte at the top), its place in the run
/// kept in the low bits.
#[derive(Default)]
struct SeqHasher(u64);

impl std::hash::Hasher for SeqHasher {
    fn finish(&self) -> u64 {
        ((self.0 >> 4).wrapping_mul(0x9E37_79B9_7F4A_7C15) << 4) ^ (self.0 & 15)
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

use super::{Device, DeviceCounters, DeviceError, DevicePtr, EventId, PhysHandle};
use crate::types::{round_up, StreamId, GIB, MIB};

/// Costs charged by the simulated device.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SimCost {
    /// Microseconds per segment allocation (cudaMalloc).
    pub alloc_us: f64,
    /// Microseconds per segment release (cudaFree), on top of the synchronization it implies.
    pub free_us: f64,
    /// Microseconds per device-wide synchronization.
    pub sync_us: f64,
    /// Microseconds per physical page creation, mapping or unmapping.
    pub map_us: f64,
    /// Device-to-device copy bandwidth in GB/s (10⁹ bytes per second).
    pub copy_gbps: f64,
}

impl Default for SimCost {
    /// Figures measured on an NVIDIA H200 (driver 13.0) by `scripts/gpu-check.sh`
    /// (docs/measurements/gpu-check-h200.json): cuMemAlloc 45 µs, cuMemFree
    /// 36 µs, about 17 µs per cuMemCreate / cuMemMap+SetAccess / cuMemUnmap /
    /// cuMemRelease, HBM copies around 1.5 TB/s.
    fn default() -> Self {
        SimCost { alloc_us: 45.0, free_us: 36.0, sync_us: 10.0, map_us: 17.0, copy_gbps: 1500.0 }
    }
}

/// Configuration of a [`SimDevice`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SimConfig {
    /// Capacity in bytes (default 80 GiB).
    pub capacity: u64,
    /// Cost model.
    pub cost: SimCost,
    /// Back every byte with host memory so contents can be written and read.
    pub host_backed: bool,
    /// Page granularity for the virtual-memory operations (default 2 MiB).
    pub granularity: u64,
    /// Maps a part of a physical allocation at an address (`cuMemMap` with
    /// an offset; default true). False models a driver that maps only
    /// whole allocations: the engine then makes a page at a time.
    pub maps_parts: bool,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            capacity: 80 * GIB,
            cost: SimCost::default(),
            host_backed: false,
            granularity: 2 * MIB,
            maps_parts: true,
        }
    }
}

#[derive(Debug)]
struct Range {
    size: u64,
    backing: Option<Vec<u8>>,
}

#[derive(Debug)]
struct Phys {
    size: u64,
    backing: Option<Vec<u8>>,
    /// Mappings that refer to it (one allocation may be mapped at several
    /// addresses: aliases).
    maps: u32,
}

/// The simulated device.
#[derive(Debug)]
pub struct SimDevice {
    cfg: SimConfig,
    next_va: DevicePtr,
    segments: BTreeMap<DevicePtr, Range>,
    /// Reservations by base: size.
    reservations: BTreeMap<DevicePtr, u64>,
    /// Mappings inside each reservation (by base), so that a release checks
    /// for them in O(1) instead of walking every granule of a reservation (a
    /// paged segment reserves 1/8 of the device).
    resv_maps: FxHashMap<DevicePtr, u64>,
    /// The reservation `map` found last: (base, size).
    last_reservation: Option<(DevicePtr, u64)>,
    physical: SeqMap<Phys>,
    next_phys: u64,
    mappings: Mappings,
    stream_clock_us: FxHashMap<StreamId, f64>,
    events: FxHashMap<u64, f64>,
    next_event: u64,
    now_us: f64,
    counters: DeviceCounters,
}

/// The mappings of virtual ranges to physical allocations, by granule.
#[derive(Debug)]
struct Mappings {
    granularity: u64,
    /// Granule index (`address / granularity`) → the mapping that covers it.
    granules: SeqMap<Mapping>,
}

/// One mapping: `size` bytes of a physical allocation from `off` on, at `va`.
#[derive(Debug, Clone, Copy)]
struct Mapping {
    va: DevicePtr,
    phys: PhysHandle,
    off: u64,
    size: u64,
    /// Base of the reservation it lies in.
    resv: DevicePtr,
}

impl Mappings {
    /// The granule indices of `[va, va + size)`.
    fn span(&self, va: DevicePtr, size: u64) -> std::ops::Range<u64> {
        va / self.granularity..(va + size).div_ceil(self.granularity)
    }

    /// The mapping that covers `addr`.
    fn covering(&self, addr: DevicePtr) -> Option<Mapping> {
        self.granules.get(&(addr / self.granularity)).copied()
    }

    /// Whether a mapping covers part of `[va, va + size)`.
    fn any_in(&self, va: DevicePtr, size: u64) -> bool {
        self.span(va, size).any(|g| self.granules.contains_key(&g))
    }

    /// Adds a mapping of granule-aligned `va` inside the reservation at
    /// `resv` unless part of its range is mapped already (then `false`,
    /// nothing changed).
    fn insert(&mut self, m: Mapping) -> bool {
        let span = self.span(m.va, m.size);
        if span.end - span.start == 1 {
            return match self.granules.entry(span.start) {
                std::collections::hash_map::Entry::Occupied(_) => false,
                std::collections::hash_map::Entry::Vacant(v) => {
                    v.insert(m);
                    true
                }
            };
        }
        if self.any_in(m.va, m.size) {
            return false;
        }
        for g in span {
            self.granules.insert(g, m);
        }
        true
    }

    /// Removes the mapping that starts at `va`.
    fn remove(&mut self, va: DevicePtr) -> Option<Mapping> {
        let first = va / self.granularity;
        let m = self.granules.remove(&first)?;
        if m.va != va {
            self.granules.insert(first, m);
            return None;
        }
        for g in self.span(m.va, m.size).skip(1) {
            self.granules.remove(&g);
        }
        Some(m)
    }

    /// Every mapping once.
    fn iter(&self) -> impl Iterator<Item = Mapping> + '_ {
        let g = self.granularity;
        self.granules.iter().filter(move |(&k, m)| k == m.va / g).map(|(_, &m)| m)
    }
}

/// Base of the simulated address space (keeps 0 and small values invalid).
const VA_BASE: DevicePtr = 0x7f00_0000_0000;

impl SimDevice {
    /// A device with the given configuration.
    pub fn new(cfg: SimConfig) -> Self {
        let granularity = if cfg.granularity.is_power_of_two() { cfg.granularity } else { 2 * MIB };
        SimDevice {
            cfg: SimConfig { granularity, ..cfg },
            next_va: VA_BASE,
            segments: BTreeMap::new(),
            reservations: BTreeMap::new(),
            resv_maps: FxHashMap::default(),
            last_reservation: None,
            physical: SeqMap::default(),
            next_phys: 1,
            mappings: Mappings { granularity, granules: SeqMap::default() },
            stream_clock_us: FxHashMap::default(),
            events: FxHashMap::default(),
            next_event: 1,
            now_us: 0.0,
            counters: DeviceCounters::default(),
        }
    }

    /// A device of `capacity` bytes with default costs.
    pub fn with_capacity(capacity: u64) -> Self {
        Self::new(SimConfig { capacity, ..SimConfig::default() })
    }

    /// The configuration.
    pub fn config(&self) -> &SimConfig {
        &self.cfg
    }

    /// Simulated host time so far, microseconds.
    pub fn now_us(&self) -> f64 {
        self.now_us
    }

    /// Advances the host clock by `us` (workload time between device calls).
    pub fn advance(&mut self, us: f64) {
        if us.is_finite() && us > 0.0 {
            self.now_us += us;
        }
    }

    fn charge(&mut self, us: f64) {
        self.now_us += us;
        self.counters.time_us += us;
    }

    fn take_va(&mut self, bytes: u64) -> Result<DevicePtr, DeviceError> {
        let g = self.cfg.granularity;
        let span = round_up(bytes, g).ok_or_else(|| DeviceError::Invalid(format!("size {bytes} overflows")))?;
        let va = self.next_va;
        // One granule of guard space between ranges.
        self.next_va = va
            .checked_add(span)
            .and_then(|v| v.checked_add(g))
            .ok_or_else(|| DeviceError::Invalid("simulated address space exhausted".into()))?;
        Ok(va)
    }

    fn reserve_bytes(&mut self, bytes: u64) -> Result<(), DeviceError> {
        let used = self.counters.used_bytes;
        if bytes > self.cfg.capacity.saturating_sub(used) {
            return Err(DeviceError::OutOfMemory {
                requested: bytes,
                available: self.cfg.capacity.saturating_sub(used),
                capacity: self.cfg.capacity,
            });
        }
        self.counters.used_bytes += bytes;
        Ok(())
    }

    fn backing(&self, size: u64) -> Result<Option<Vec<u8>>, DeviceError> {
        if !self.cfg.host_backed {
            return Ok(None);
        }
        let len = usize::try_from(size).map_err(|_| DeviceError::Invalid(format!("size {size} too large to back")))?;
        super::zeroed::zeroed_bytes(len).map(Some).ok_or(DeviceError::HostMemory { bytes: size })
    }

    fn sync_all(&mut self) {
        let latest = self.stream_clock_us.values().copied().fold(self.now_us, f64::max);
        self.now_us = latest;
        self.counters.syncs += 1;
        let c = self.cfg.cost.sync_us;
        self.charge(c);
    }

    /// Finds the backing bytes that hold `addr` and how many bytes follow
    /// contiguously in that backing.
    fn locate(&mut self, addr: DevicePtr) -> Result<(&mut Vec<u8>, usize, usize), DeviceError> {
        if !self.cfg.host_backed {
            return Err(DeviceError::Unsupported("reading and writing contents", "sim (without host backing)"));
        }
        let in_segment = self
            .segments
            .range(..=addr)
            .next_back()
            .filter(|(&base, r)| addr < base + r.size)
            .map(|(&base, r)| (base, r.size));
        if let Some((base, size)) = in_segment {
            let b = self.segments.get_mut(&base).and_then(|r| r.backing.as_mut()).expect("host-backed segment");
            return Ok((b, (addr - base) as usize, (size - (addr - base)) as usize));
        }
        if let Some(m) = self.mappings.covering(addr) {
            let b = self
                .physical
                .get_mut(&m.phys.0)
                .and_then(|p| p.backing.as_mut())
                .expect("host-backed physical allocation");
            return Ok((b, (m.off + addr - m.va) as usize, (m.size - (addr - m.va)) as usize));
        }
        Err(DeviceError::Invalid(format!("address {addr:#x} is not in a segment or a mapping")))
    }

    /// Maps `bytes` (`None`: the rest) of `phys` from `offset` on at `va`.
    fn map_range(
        &mut self,
        va: DevicePtr,
        phys: PhysHandle,
        offset: u64,
        bytes: Option<u64>,
    ) -> Result<(), DeviceError> {
        // (One allocation may be mapped at several addresses: aliases.)
        let total = match self.physical.get(&phys.0) {
            None => return Err(DeviceError::Invalid(format!("unknown physical handle {}", phys.0))),
            Some(p) => p.size,
        };
        let g = self.cfg.granularity;
        let size = bytes.unwrap_or(total.saturating_sub(offset));
        if !va.is_multiple_of(g) || !offset.is_multiple_of(g) || size == 0 || !size.is_multiple_of(g) {
            return Err(DeviceError::Invalid(format!(
                "{va:#x}: offset {offset} and size {size} are not positive multiples of the granularity"
            )));
        }
        if offset.checked_add(size).is_none_or(|e| e > total) {
            return Err(DeviceError::Invalid(format!(
                "{size} bytes from offset {offset} overrun physical handle {} of {total} bytes",
                phys.0
            )));
        }
        // Consecutive maps go to the same reservation: check the last one first.
        let inside = |(b, s): (DevicePtr, u64)| b <= va && va + size <= b + s;
        if !self.last_reservation.is_some_and(inside) {
            let found = self.reservations.range(..=va).next_back().map(|(&b, &s)| (b, s)).filter(|&r| inside(r));
            match found {
                Some(r) => self.last_reservation = Some(r),
                None => return Err(DeviceError::Invalid(format!("{va:#x}+{size} is not inside a reservation"))),
            }
        }
        let base = self.last_reservation.expect("found above").0;
        if !self.mappings.insert(Mapping { va, phys, off: offset, size, resv: base }) {
            return Err(DeviceError::Invalid(format!("{va:#x}+{size} overlaps an existing mapping")));
        }
        self.physical.get_mut(&phys.0).expect("checked above").maps += 1;
        *self.resv_maps.entry(base).or_default() += 1;
        let c = self.cfg.cost.map_us;
        self.charge(c);
        Ok(())
    }

    /// Checks the module's invariants; returns a description of the first violation.
    pub fn check_invariants(&self) -> Result<(), crate::types::InvariantError> {
        self.check_all().map_err(crate::types::InvariantError)
    }

    fn check_all(&self) -> Result<(), String> {
        let seg: u64 = self.segments.values().map(|r| r.size).sum();
        let phys: u64 = self.physical.values().map(|p| p.size).sum();
        if seg + phys != self.counters.used_bytes {
            return Err(format!("used {} != segments {seg} + physical {phys}", self.counters.used_bytes));
        }
        if self.counters.used_bytes > self.cfg.capacity {
            return Err("used exceeds capacity".into());
        }
        let mut maps: FxHashMap<u64, u32> = FxHashMap::default();
        let mut in_resv: FxHashMap<DevicePtr, u64> = FxHashMap::default();
        for Mapping { va, phys: ph, off, size, .. } in self.mappings.iter() {
            let (&rbase, &rsize) = self
                .reservations
                .range(..=va)
                .next_back()
                .ok_or_else(|| format!("mapping {va:#x} outside any reservation"))?;
            *in_resv.entry(rbase).or_default() += 1;
            if va + size > rbase + rsize {
                return Err(format!("mapping {va:#x} overruns its reservation"));
            }
            match self.physical.get(&ph.0) {
                Some(p) if off.checked_add(size).is_some_and(|e| e <= p.size) => *maps.entry(ph.0).or_default() += 1,
                _ => return Err(format!("mapping {va:#x} refers to a bad physical allocation")),
            }
        }
        for base in self.reservations.keys() {
            let mapped = self.resv_maps.get(base).copied().unwrap_or(0);
            let n = in_resv.get(base).copied().unwrap_or(0);
            if mapped != n {
                return Err(format!("reservation {base:#x} counts {mapped} mappings, holds {n}"));
            }
        }
        for (id, p) in &self.physical {
            let n = maps.get(id).copied().unwrap_or(0);
            if p.maps != n {
                return Err(format!("physical {id} counts {} mappings, {n} refer to it", p.maps));
            }
        }
        Ok(())
    }
}

impl Device for SimDevice {
    fn name(&self) -> &'static str {
        "sim"
    }

    fn capacity(&self) -> u64 {
        self.cfg.capacity
    }

    fn available(&self) -> Option<u64> {
        Some(self.cfg.capacity.saturating_sub(self.counters.used_bytes))
    }

    fn counters(&self) -> DeviceCounters {
        self.counters
    }

    fn alloc_segment(&mut self, bytes: u64) -> Result<DevicePtr, DeviceError> {
        if bytes == 0 {
            return Err(DeviceError::Invalid("zero-byte segment".into()));
        }
        self.reserve_bytes(bytes)?;
        let backing = match self.backing(bytes) {
            Ok(b) => b,
            Err(e) => {
                self.counters.used_bytes -= bytes;
                return Err(e);
            }
        };
        let va = match self.take_va(bytes) {
            Ok(v) => v,
            Err(e) => {
                self.counters.used_bytes -= bytes;
                return Err(e);
            }
        };
        self.segments.insert(va, Range { size: bytes, backing });
        self.counters.alloc_calls += 1;
        let c = self.cfg.cost.alloc_us;
        self.charge(c);
        Ok(va)
    }

    fn free_segment(&mut self, ptr: DevicePtr) -> Result<(), DeviceError> {
        let r = self.segments.remove(&ptr).ok_or_else(|| DeviceError::Invalid(format!("{ptr:#x} is not a segment")))?;
        self.counters.used_bytes -= r.size;
        self.counters.free_calls += 1;
        // cudaFree synchronizes the device.
        self.sync_all();
        let c = self.cfg.cost.free_us;
        self.charge(c);
        Ok(())
    }

    fn synchronize(&mut self) -> Result<(), DeviceError> {
        self.sync_all();
        Ok(())
    }

    /// The simulated device knows every stream: waiting for one advances
    /// the host clock to that stream's clock, without a device-wide sync.
    fn synchronize_stream(&mut self, stream: StreamId) -> Result<bool, DeviceError> {
        let t = self.stream_clock_us.get(&stream).copied().unwrap_or(0.0);
        self.now_us = self.now_us.max(t);
        Ok(false)
    }

    fn granularity(&self) -> u64 {
        self.cfg.granularity
    }

    fn reserve_virtual(&mut self, bytes: u64) -> Result<DevicePtr, DeviceError> {
        if bytes == 0 || !bytes.is_multiple_of(self.cfg.granularity) {
            return Err(DeviceError::Invalid(format!(
                "reservation of {bytes} bytes is not a positive multiple of {}",
                self.cfg.granularity
            )));
        }
        let va = self.take_va(bytes)?;
        self.reservations.insert(va, bytes);
        self.resv_maps.insert(va, 0);
        Ok(va)
    }

    fn release_virtual(&mut self, va: DevicePtr) -> Result<(), DeviceError> {
        if !self.reservations.contains_key(&va) {
            return Err(DeviceError::Invalid(format!("{va:#x} is not a reservation")));
        }
        if self.resv_maps.get(&va).is_some_and(|&n| n > 0) {
            return Err(DeviceError::Invalid(format!("reservation {va:#x} still has mappings")));
        }
        self.reservations.remove(&va);
        self.resv_maps.remove(&va);
        if self.last_reservation.is_some_and(|(b, _)| b == va) {
            self.last_reservation = None;
        }
        Ok(())
    }

    fn create_physical(&mut self, bytes: u64) -> Result<PhysHandle, DeviceError> {
        if bytes == 0 || !bytes.is_multiple_of(self.cfg.granularity) {
            return Err(DeviceError::Invalid(format!(
                "physical allocation of {bytes} bytes is not a positive multiple of {}",
                self.cfg.granularity
            )));
        }
        self.reserve_bytes(bytes)?;
        if self.physical.capacity() == 0 {
            // Paging in use: room for a device's worth of pages at once
            // (growing the tables page by page dominated paged replays).
            let pages = (self.cfg.capacity / self.cfg.granularity).clamp(64, 1 << 12) as usize;
            self.physical.reserve(pages);
            self.mappings.granules.reserve(pages);
        }
        let backing = match self.backing(bytes) {
            Ok(b) => b,
            Err(e) => {
                self.counters.used_bytes -= bytes;
                return Err(e);
            }
        };
        let h = self.next_phys;
        self.next_phys += 1;
        self.physical.insert(h, Phys { size: bytes, backing, maps: 0 });
        self.counters.alloc_calls += 1;
        let c = self.cfg.cost.map_us;
        self.charge(c);
        Ok(PhysHandle(h))
    }

    fn release_physical(&mut self, phys: PhysHandle) -> Result<(), DeviceError> {
        match self.physical.get(&phys.0) {
            None => return Err(DeviceError::Invalid(format!("unknown physical handle {}", phys.0))),
            Some(p) if p.maps > 0 => {
                return Err(DeviceError::Invalid(format!("physical handle {} is still mapped", phys.0)))
            }
            Some(_) => {}
        }
        let p = self.physical.remove(&phys.0).expect("checked above");
        self.counters.used_bytes -= p.size;
        self.counters.free_calls += 1;
        let c = self.cfg.cost.map_us;
        self.charge(c);
        Ok(())
    }

    fn map(&mut self, va: DevicePtr, phys: PhysHandle) -> Result<(), DeviceError> {
        self.map_range(va, phys, 0, None)
    }

    fn map_part(&mut self, va: DevicePtr, phys: PhysHandle, offset: u64, bytes: u64) -> Result<(), DeviceError> {
        if !self.cfg.maps_parts {
            return Err(DeviceError::Invalid("this device maps whole physical allocations only".into()));
        }
        self.map_range(va, phys, offset, Some(bytes))
    }

    fn maps_parts(&self) -> bool {
        self.cfg.maps_parts
    }

    fn unmap(&mut self, va: DevicePtr) -> Result<(), DeviceError> {
        let m =
            self.mappings.remove(va).ok_or_else(|| DeviceError::Invalid(format!("nothing is mapped at {va:#x}")))?;
        self.physical.get_mut(&m.phys.0).expect("mapped physical exists").maps -= 1;
        if let Some(n) = self.resv_maps.get_mut(&m.resv) {
            *n -= 1;
        }
        let c = self.cfg.cost.map_us;
        self.charge(c);
        Ok(())
    }

    fn record_event(&mut self, stream: StreamId) -> Result<EventId, DeviceError> {
        let t = self.stream_clock_us.get(&stream).copied().unwrap_or(0.0).max(self.now_us);
        let id = self.next_event;
        self.next_event += 1;
        self.events.insert(id, t);
        Ok(EventId(id))
    }

    fn event_done(&mut self, event: EventId) -> Result<bool, DeviceError> {
        let t = self.events.get(&event.0).ok_or_else(|| DeviceError::Invalid(format!("unknown event {}", event.0)))?;
        Ok(self.now_us >= *t)
    }

    fn destroy_event(&mut self, event: EventId) -> Result<(), DeviceError> {
        self.events
            .remove(&event.0)
            .map(|_| ())
            .ok_or_else(|| DeviceError::Invalid(format!("unknown event {}", event.0)))
    }

    fn copy(&mut self, dst: DevicePtr, src: DevicePtr, bytes: u64, stream: StreamId) -> Result<(), DeviceError> {
        if self.cfg.host_backed && bytes > 0 {
            // Chunked through a bounce buffer so stitched (non-contiguous) ranges work.
            let mut buf = vec![0u8; bytes.min(16 * MIB) as usize];
            let mut done = 0u64;
            while done < bytes {
                let n = (bytes - done).min(buf.len() as u64) as usize;
                self.read(src + done, &mut buf[..n])?;
                self.write(dst + done, &buf[..n])?;
                done += n as u64;
            }
        }
        let secs = bytes as f64 / (self.cfg.cost.copy_gbps * 1e9);
        let clock = self.stream_clock_us.entry(stream).or_insert(0.0);
        *clock = clock.max(self.now_us) + secs * 1e6;
        self.counters.copied_bytes += bytes;
        Ok(())
    }

    fn write(&mut self, dst: DevicePtr, data: &[u8]) -> Result<(), DeviceError> {
        let mut done = 0usize;
        while done < data.len() {
            let (buf, off, avail) = self.locate(dst + done as u64)?;
            let n = avail.min(data.len() - done);
            buf[off..off + n].copy_from_slice(&data[done..done + n]);
            done += n;
        }
        Ok(())
    }

    fn read(&mut self, src: DevicePtr, out: &mut [u8]) -> Result<(), DeviceError> {
        let mut done = 0usize;
        while done < out.len() {
            let (buf, off, avail) = self.locate(src + done as u64)?;
            let n = avail.min(out.len() - done);
            out[done..done + n].copy_from_slice(&buf[off..off + n]);
            done += n;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small(host_backed: bool) -> SimDevice {
        SimDevice::new(SimConfig { capacity: 16 * MIB, host_backed, ..SimConfig::default() })
    }

    #[test]
    fn one_physical_allocation_mapped_at_two_addresses_is_one_memory() {
        let mut d = small(true);
        let g = d.granularity();
        let va = d.reserve_virtual(4 * g).unwrap();
        let p = d.create_physical(g).unwrap();
        d.map(va, p).unwrap();
        d.map(va + 3 * g, p).unwrap();
        d.check_invariants().unwrap();
        assert_eq!(d.counters().used_bytes, g, "an alias holds no more memory");
        d.write(va + 100, b"alias").unwrap();
        let mut out = [0u8; 5];
        d.read(va + 3 * g + 100, &mut out).unwrap();
        assert_eq!(&out, b"alias");
        assert!(d.map(va, p).is_err(), "the address is taken");
        d.unmap(va).unwrap();
        assert!(d.release_physical(p).is_err(), "still mapped at its alias");
        d.unmap(va + 3 * g).unwrap();
        d.release_physical(p).unwrap();
        d.release_virtual(va).unwrap();
        d.check_invariants().unwrap();
    }

    #[test]
    fn parts_of_one_physical_allocation_back_pages_at_unrelated_addresses() {
        let mut d = small(true);
        let g = d.granularity();
        let va = d.reserve_virtual(4 * g).unwrap();
        let p = d.create_physical(2 * g).unwrap();
        // Its second page first, then its first page two pages further on.
        d.map_part(va, p, g, g).unwrap();
        d.map_part(va + 2 * g, p, 0, g).unwrap();
        d.check_invariants().unwrap();
        assert_eq!((d.counters().used_bytes, d.counters().alloc_calls), (2 * g, 1));
        d.write(va + 7, b"second").unwrap();
        d.write(va + 2 * g + 7, b"first!").unwrap();
        // Seen through a whole mapping of the allocation: in its own order.
        d.map(va + g, p).unwrap_err(); // [va + g, va + 3g) overlaps the part at va + 2g
        let whole = d.reserve_virtual(2 * g).unwrap();
        d.map(whole, p).unwrap();
        let mut out = [0u8; 6];
        d.read(whole + 7, &mut out).unwrap();
        assert_eq!(&out, b"first!");
        d.read(whole + g + 7, &mut out).unwrap();
        assert_eq!(&out, b"second");
        // Misuse is refused: unaligned, past the end, empty.
        assert!(d.map_part(va + g, p, g / 2, g).is_err());
        assert!(d.map_part(va + g, p, g, 2 * g).is_err());
        assert!(d.map_part(va + g, p, 0, 0).is_err());
        d.check_invariants().unwrap();
        for at in [va, va + 2 * g, whole] {
            d.unmap(at).unwrap();
        }
        d.release_physical(p).unwrap();
        d.release_virtual(va).unwrap();
        d.release_virtual(whole).unwrap();
        d.check_invariants().unwrap();
        assert_eq!(d.counters().used_bytes, 0);
    }

    #[test]
    fn accounts_segments() {
        let mut d = small(false);
        let a = d.alloc_segment(4 * MIB).unwrap();
        let b = d.alloc_segment(12 * MIB).unwrap();
        assert!(matches!(d.alloc_segment(1), Err(DeviceError::OutOfMemory { .. })));
        assert_eq!(d.available(), Some(0));
        d.free_segment(a).unwrap();
        assert!(d.free_segment(a).is_err());
        d.free_segment(b).unwrap();
        let c = d.counters();
        assert_eq!((c.alloc_calls, c.free_calls, c.syncs, c.used_bytes), (2, 2, 2, 0));
        assert!(c.time_us > 0.0);
        d.check_invariants().unwrap();
    }

    #[test]
    fn stitched_pages_hold_contents() {
        let mut d = small(true);
        let va = d.reserve_virtual(4 * MIB).unwrap();
        let p1 = d.create_physical(2 * MIB).unwrap();
        let p2 = d.create_physical(2 * MIB).unwrap();
        d.map(va + 2 * MIB, p1).unwrap();
        d.map(va, p2).unwrap();
        assert!(d.map(va, p1).is_err());
        let data: Vec<u8> = (0..(3 * MIB as usize)).map(|i| (i % 251) as u8).collect();
        d.write(va + MIB, &data).unwrap();
        let mut back = vec![0u8; data.len()];
        d.read(va + MIB, &mut back).unwrap();
        assert_eq!(back, data);
        d.check_invariants().unwrap();
        assert!(d.release_virtual(va).is_err());
        assert!(d.release_physical(p1).is_err());
        d.unmap(va).unwrap();
        d.unmap(va + 2 * MIB).unwrap();
        d.release_physical(p1).unwrap();
        d.release_physical(p2).unwrap();
        d.release_virtual(va).unwrap();
        assert_eq!(d.counters().used_bytes, 0);
    }

    #[test]
    fn a_reservation_is_released_once_its_last_mapping_goes_whatever_its_neighbours_hold() {
        let mut d = small(false);
        let g = d.granularity();
        let a = d.reserve_virtual(8 * g).unwrap();
        let b = d.reserve_virtual(2 * g).unwrap();
        let (p, q, r) = (d.create_physical(g).unwrap(), d.create_physical(g).unwrap(), d.create_physical(g).unwrap());
        d.map(a, p).unwrap();
        d.map(a + 7 * g, q).unwrap();
        d.map(b, r).unwrap();
        assert!(d.map(a + 7 * g, r).is_err(), "taken: a refused map counts nothing");
        d.check_invariants().unwrap();
        d.unmap(b).unwrap();
        d.release_virtual(b).unwrap();
        d.unmap(a).unwrap();
        assert!(d.release_virtual(a).is_err(), "its last page is still mapped");
        d.unmap(a + 7 * g).unwrap();
        d.check_invariants().unwrap();
        d.release_virtual(a).unwrap();
        assert!(d.release_virtual(a).is_err(), "released already");
        for h in [p, q, r] {
            d.release_physical(h).unwrap();
        }
        d.check_invariants().unwrap();
    }

    #[test]
    fn copies_and_events() {
        let mut d = small(true);
        let a = d.alloc_segment(MIB).unwrap();
        let b = d.alloc_segment(MIB).unwrap();
        d.write(a, b"hello").unwrap();
        d.copy(b, a, 5, StreamId(1)).unwrap();
        let ev = d.record_event(StreamId(1)).unwrap();
        assert!(!d.event_done(ev).unwrap());
        d.synchronize().unwrap();
        assert!(d.event_done(ev).unwrap());
        let mut out = [0u8; 5];
        d.read(b, &mut out).unwrap();
        assert_eq!(&out, b"hello");
        assert!(d.read(a - 1, &mut out).is_err());
    }
}
