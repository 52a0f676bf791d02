//! The handle table: `TensorId → (block, request)`.
//!
//! Invariants:
//! - every live tensor maps to exactly one allocated block, and that block's
//!   `tensor` field names the tensor's slot (a bijection between live tensors
//!   and allocated blocks);
//! - a slot's generation grows by one each time the slot is freed, so a stale
//!   [`TensorId`] never resolves to a newer tensor.

use crate::types::{Phase, StreamId, TensorId, TensorKind, Tier};

/// What the engine knows of one live tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tensor {
    /// Block holding the tensor's bytes.
    pub block: u32,
    /// Requested size in bytes.
    pub bytes: u64,
    /// What the tensor holds.
    pub kind: TensorKind,
    /// Stream it was allocated on.
    pub stream: StreamId,
    /// Logical clock of the last use (allocation counts as a use).
    pub last_use: u64,
    /// Number of `use` calls.
    pub use_count: u64,
    /// Used on a stream other than its own since allocation.
    pub cross_stream: bool,
    /// Where its bytes are; off the device, `block` is `NIL` and the tier
    /// store holds the bytes (see `alloc::tiering`).
    pub tier: Tier,
    /// Phase of the last use (or allocation).
    pub phase: Option<Phase>,
    /// Position of the next use in the workload, when a look-ahead knows it
    /// (`Some(u64::MAX)`: never used again); for offline policies (Belady).
    pub next_use: Option<u64>,
}

#[derive(Debug, Clone)]
struct Slot {
    generation: u32,
    tensor: Option<Tensor>,
}

/// Slab of tensor entries addressed by [`TensorId`], and the pin counts.
#[derive(Debug, Clone, Default)]
pub struct HandleTable {
    slots: Vec<Slot>,
    free: Vec<u32>,
    live: usize,
    /// Pin counts of pinned tensors (by handle slot): each names a live
    /// tensor and is at least 1.
    pub(crate) pins: rustc_hash::FxHashMap<u32, u32>,
}

impl HandleTable {
    /// Stores a tensor and issues its handle.
    #[inline]
    pub fn insert(&mut self, t: Tensor) -> TensorId {
        self.live += 1;
        if let Some(slot) = self.free.pop() {
            let s = &mut self.slots[slot as usize];
            s.tensor = Some(t);
            TensorId { slot, generation: s.generation }
        } else {
            self.slots.push(Slot { generation: 0, tensor: Some(t) });
            TensorId { slot: (self.slots.len() - 1) as u32, generation: 0 }
        }
    }

    /// The live tensor behind `id`, if any.
    #[inline]
    pub fn get(&self, id: TensorId) -> Option<&Tensor> {
        match self.slots.get(id.slot as usize) {
            Some(s) if s.generation == id.generation => s.tensor.as_ref(),
            _ => None,
        }
    }

    /// The live tensor behind `id`, mutably.
    #[inline]
    pub fn get_mut(&mut self, id: TensorId) -> Option<&mut Tensor> {
        match self.slots.get_mut(id.slot as usize) {
            Some(s) if s.generation == id.generation => s.tensor.as_mut(),
            _ => None,
        }
    }

    /// The live tensor in `slot` (used when walking blocks).
    pub fn by_slot(&self, slot: u32) -> Option<(TensorId, &Tensor)> {
        let s = self.slots.get(slot as usize)?;
        s.tensor.as_ref().map(|t| (TensorId { slot, generation: s.generation }, t))
    }

    /// Removes the tensor behind `id`; its handle becomes stale.
    #[inline]
    pub fn remove(&mut self, id: TensorId) -> Option<Tensor> {
        let s = self.slots.get_mut(id.slot as usize)?;
        if s.generation != id.generation {
            return None;
        }
        let t = s.tensor.take()?;
        s.generation = s.generation.wrapping_add(1);
        self.free.push(id.slot);
        self.live -= 1;
        Some(t)
    }

    /// Number of live tensors.
    pub fn len(&self) -> usize {
        self.live
    }

    /// Live tensors with their handles.
    pub fn iter(&self) -> impl Iterator<Item = (TensorId, &Tensor)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| s.tensor.as_ref().map(|t| (TensorId { slot: i as u32, generation: s.generation }, t)))
    }
}
