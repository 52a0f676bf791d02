//! Bookkeeping of what the CUDA backend holds from the driver: segments,
//! virtual reservations, physical allocations and mappings.
//!
//! Pure Rust, no driver calls: every misuse (an unknown pointer, an overlapping
//! mapping, a range that is not backed) is refused here with
//! [`DeviceError::Invalid`] *before* the driver sees it, so that a bad argument
//! can never turn into a sticky CUDA error that poisons the context.
//!
//! Invariants (checked by [`Book::check_invariants`]):
//! - `used = Σ segment sizes + Σ physical sizes`;
//! - every mapping lies inside one reservation and refers to one physical
//!   allocation of its size, whose `maps` counts the mappings that refer
//!   to it (one allocation may be mapped at several addresses: aliases);
//! - mappings never overlap.

use std::collections::BTreeMap;

use rustc_hash::FxHashMap;

use super::super::{DeviceError, DevicePtr, PhysHandle};

/// One physical allocation (`cuMemCreate`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Phys {
    /// The driver's generic allocation handle.
    pub(crate) handle: u64,
    /// Size in bytes.
    pub(crate) size: u64,
    /// How many mappings refer to it (aliases of one allocation).
    pub(crate) maps: u32,
}

/// What the backend holds from the driver.
#[derive(Debug, Default)]
pub(crate) struct Book {
    /// Segment start → size (`cuMemAlloc`).
    pub(crate) segments: BTreeMap<DevicePtr, u64>,
    /// Reservation start → size (`cuMemAddressReserve`).
    pub(crate) reservations: BTreeMap<DevicePtr, u64>,
    /// Our physical id → allocation (`cuMemCreate`).
    pub(crate) physical: FxHashMap<u64, Phys>,
    /// Mapping start → (physical id, size) (`cuMemMap`).
    pub(crate) mappings: BTreeMap<DevicePtr, (PhysHandle, u64)>,
    next_phys: u64,
}

fn invalid(msg: String) -> DeviceError {
    DeviceError::Invalid(msg)
}

impl Book {
    /// Bytes held: segments plus physical allocations.
    pub(crate) fn used(&self) -> u64 {
        self.segments.values().sum::<u64>() + self.physical.values().map(|p| p.size).sum::<u64>()
    }

    /// Records a new physical allocation and returns its id (ids are never reused).
    pub(crate) fn add_physical(&mut self, handle: u64, size: u64) -> PhysHandle {
        self.next_phys += 1;
        let id = self.next_phys;
        self.physical.insert(id, Phys { handle, size, maps: 0 });
        PhysHandle(id)
    }

    /// The size of segment `ptr`.
    pub(crate) fn segment(&self, ptr: DevicePtr) -> Result<u64, DeviceError> {
        self.segments.get(&ptr).copied().ok_or_else(|| invalid(format!("{ptr:#x} is not a segment")))
    }

    /// The size of reservation `va`, which must have no mappings left.
    pub(crate) fn releasable_reservation(&self, va: DevicePtr) -> Result<u64, DeviceError> {
        let size = *self.reservations.get(&va).ok_or_else(|| invalid(format!("{va:#x} is not a reservation")))?;
        if self.mappings.range(va..va + size).next().is_some() {
            return Err(invalid(format!("reservation {va:#x} still has mappings")));
        }
        Ok(size)
    }

    /// The physical allocation `phys`, which must not be mapped.
    pub(crate) fn releasable_physical(&self, phys: PhysHandle) -> Result<Phys, DeviceError> {
        match self.physical.get(&phys.0) {
            None => Err(invalid(format!("unknown physical handle {}", phys.0))),
            Some(p) if p.maps > 0 => Err(invalid(format!("physical handle {} is still mapped", phys.0))),
            Some(p) => Ok(*p),
        }
    }

    /// Checks that all of `phys` may be mapped at `va` (also when it is
    /// mapped elsewhere already: an alias); returns the allocation.
    #[cfg(test)]
    pub(crate) fn mappable(&self, va: DevicePtr, phys: PhysHandle, granularity: u64) -> Result<Phys, DeviceError> {
        let size = self.physical.get(&phys.0).map_or(0, |p| p.size);
        self.mappable_part(va, phys, 0, size, granularity)
    }

    /// Checks that `size` bytes of `phys` from `offset` on may be mapped at
    /// `va` (aliases allowed); returns the allocation.
    pub(crate) fn mappable_part(
        &self,
        va: DevicePtr,
        phys: PhysHandle,
        offset: u64,
        size: u64,
        granularity: u64,
    ) -> Result<Phys, DeviceError> {
        let p = match self.physical.get(&phys.0) {
            None => return Err(invalid(format!("unknown physical handle {}", phys.0))),
            Some(p) => *p,
        };
        if granularity == 0
            || !va.is_multiple_of(granularity)
            || !offset.is_multiple_of(granularity)
            || size == 0
            || !size.is_multiple_of(granularity)
        {
            return Err(invalid(format!(
                "{va:#x}: offset {offset} and size {size} are not positive multiples of the granularity {granularity}"
            )));
        }
        if offset.checked_add(size).is_none_or(|e| e > p.size) {
            return Err(invalid(format!(
                "{size} bytes from offset {offset} overrun a physical allocation of {}",
                p.size
            )));
        }
        let end = va.checked_add(size).ok_or_else(|| invalid(format!("{va:#x}+{size} overflows")))?;
        let inside = self.reservations.range(..=va).next_back().is_some_and(|(&b, &s)| end <= b + s);
        if !inside {
            return Err(invalid(format!("{va:#x}+{size} is not inside a reservation")));
        }
        let overlaps_before = self.mappings.range(..va).next_back().is_some_and(|(&b, &(_, s))| b + s > va);
        let overlaps_after = self.mappings.range(va..end).next().is_some();
        if overlaps_before || overlaps_after {
            return Err(invalid(format!("{va:#x}+{size} overlaps an existing mapping")));
        }
        Ok(p)
    }

    /// Records a mapping checked by [`Book::mappable`].
    pub(crate) fn add_mapping(&mut self, va: DevicePtr, phys: PhysHandle, size: u64) {
        self.mappings.insert(va, (phys, size));
        if let Some(p) = self.physical.get_mut(&phys.0) {
            p.maps += 1;
        }
    }

    /// The mapping that starts at `va`: (physical id, size).
    pub(crate) fn mapping(&self, va: DevicePtr) -> Result<(PhysHandle, u64), DeviceError> {
        self.mappings.get(&va).copied().ok_or_else(|| invalid(format!("nothing is mapped at {va:#x}")))
    }

    /// Forgets the mapping at `va`.
    pub(crate) fn remove_mapping(&mut self, va: DevicePtr) {
        if let Some((phys, _)) = self.mappings.remove(&va) {
            if let Some(p) = self.physical.get_mut(&phys.0) {
                p.maps -= 1;
            }
        }
    }

    /// Checks that `[addr, addr + len)` is device memory the backend holds:
    /// inside one segment, or covered by mappings that follow each other
    /// without gaps (a stitched range).
    pub(crate) fn check_range(&self, addr: DevicePtr, len: u64) -> Result<(), DeviceError> {
        if len == 0 {
            return Ok(());
        }
        let end = addr.checked_add(len).ok_or_else(|| invalid(format!("{addr:#x}+{len} overflows")))?;
        if self.segments.range(..=addr).next_back().is_some_and(|(&b, &s)| end <= b + s) {
            return Ok(());
        }
        let mut at = addr;
        while at < end {
            match self.mappings.range(..=at).next_back() {
                Some((&b, &(_, s))) if at < b + s => at = b + s,
                _ => return Err(invalid(format!("{addr:#x}+{len}: {at:#x} is not in a segment or a mapping"))),
            }
        }
        Ok(())
    }

    /// Checks the invariants against the `used` counter; returns the first violation.
    pub(crate) fn check_invariants(&self, used: u64) -> Result<(), String> {
        if self.used() != used {
            return Err(format!("used counter {used} != held bytes {}", self.used()));
        }
        let mut prev_end = 0u64;
        let mut maps: FxHashMap<u64, u32> = FxHashMap::default();
        for (&va, &(ph, size)) in &self.mappings {
            if va < prev_end {
                return Err(format!("mapping {va:#x} overlaps the previous one"));
            }
            prev_end = va + size;
            let (&rb, &rs) = self
                .reservations
                .range(..=va)
                .next_back()
                .ok_or_else(|| format!("mapping {va:#x} outside any reservation"))?;
            if va + size > rb + rs {
                return Err(format!("mapping {va:#x} overruns its reservation"));
            }
            match self.physical.get(&ph.0) {
                Some(p) if size <= p.size => *maps.entry(ph.0).or_default() += 1,
                _ => return Err(format!("mapping {va:#x} refers to a bad physical allocation")),
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

#[cfg(test)]
mod tests {
    use super::*;

    const G: u64 = 2 << 20;

    #[test]
    fn refuses_misuse_before_the_driver_sees_it() {
        let mut b = Book::default();
        b.segments.insert(0x1000_0000, 4096);
        assert!(b.segment(0x1000_0001).is_err());
        assert!(b.check_range(0x1000_0000, 4096).is_ok());
        assert!(b.check_range(0x1000_0000, 4097).is_err());
        assert!(b.check_range(0x0fff_ffff, 2).is_err());
        assert!(b.check_range(u64::MAX, 2).is_err());

        let va = 0x7000_0000_0000;
        b.reservations.insert(va, 4 * G);
        let p1 = b.add_physical(11, G);
        let p2 = b.add_physical(12, G);
        let p3 = b.add_physical(13, 2 * G);
        assert!(b.mappable(va + 1, p1, G).is_err(), "unaligned");
        assert!(b.mappable(va + 4 * G, p1, G).is_err(), "outside");
        assert!(b.mappable(va, PhysHandle(99), G).is_err(), "unknown");
        assert_eq!(b.mappable(va + G, p1, G).unwrap().handle, 11);
        b.add_mapping(va + G, p1, G);
        assert!(b.mappable(va + G, p2, G).is_err(), "occupied");
        assert!(b.mappable(va, p3, G).is_err(), "overlaps the next mapping");
        // An alias: the same allocation at a second address.
        assert!(b.mappable(va + 3 * G, p1, G).is_ok(), "an alias");
        // Part of an allocation: aligned, inside it.
        assert!(b.mappable_part(va + 3 * G, p1, 0, G, G).is_ok());
        assert!(b.mappable_part(va + 3 * G, p1, G / 2, G, G).is_err(), "unaligned offset");
        assert!(b.mappable_part(va + 3 * G, p1, G, G, G).is_err(), "past the allocation's end");
        assert!(b.mappable_part(va + 3 * G, p1, 0, 0, G).is_err(), "empty");
        b.add_mapping(va + 3 * G, p1, G);
        b.check_invariants(b.used()).unwrap();
        b.remove_mapping(va + 3 * G);
        b.add_mapping(va, p2, G);
        assert!(b.releasable_physical(p1).is_err());
        assert!(b.releasable_reservation(va).is_err());
        // Stitched: two mappings in a row cover [va, va + 2G).
        assert!(b.check_range(va + G / 2, G).is_ok());
        assert!(b.check_range(va, 2 * G).is_ok());
        assert!(b.check_range(va, 2 * G + 1).is_err());
        b.check_invariants(b.used()).unwrap();
        assert!(b.check_invariants(0).is_err());

        b.remove_mapping(va);
        b.remove_mapping(va + G);
        assert!(b.mapping(va).is_err());
        assert!(b.releasable_physical(p1).is_ok());
        assert_eq!(b.releasable_reservation(va).unwrap(), 4 * G);
        b.check_invariants(4096 + 4 * G).unwrap();
    }
}
