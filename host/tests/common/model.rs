//! The one action model of the allocator's property tests
//! (`allocator_props`, `defrag_props`, `tiers_props`): the actions a random
//! workload is made of, a weighted strategy over them, and the record of live
//! tensors with the contents written into them.
#![allow(dead_code)]

use proptest::prelude::*;
use proptest::strategy::Union;
use wasmem::alloc::Allocator;
use wasmem::device::Device;
use wasmem::types::{TensorId, MIB};

/// One step of a random workload. Indices pick a live tensor modulo their count.
#[derive(Debug, Clone)]
pub enum Action {
    /// Allocate `bytes` of kind `TensorKind::ALL[kind]` on `stream`.
    Alloc {
        /// Requested bytes.
        bytes: u64,
        /// Index into `TensorKind::ALL`.
        kind: usize,
        /// Stream.
        stream: u32,
    },
    /// Free a live tensor.
    Free(usize),
    /// Use a live tensor on a stream.
    Use(usize, u32),
    /// Mark `Phase::ALL[i]`.
    Phase(usize),
    /// A call that must be refused without a change (zero bytes, too large, stale handle…).
    Bad(usize),
    /// Stream work on a tensor (a copy onto itself) pushes that stream's clock.
    Work(usize, u32),
    /// Advance the simulated host time by this many microseconds.
    Advance(u32),
    /// Compact the `large` (or `small`) pool with this budget in MiB.
    Compact {
        /// Which pool.
        large: bool,
        /// Budget in MiB.
        budget_mib: u64,
    },
    /// Pin a live tensor.
    Pin(usize),
    /// Unpin a live tensor.
    Unpin(usize),
    /// Move a live tensor off the device.
    Evict(usize),
}

/// The weights of each action in a workload (0: never) and the request sizes.
#[derive(Debug, Clone)]
pub struct Mix {
    /// Weight of `Alloc`.
    pub alloc: u32,
    /// Request sizes: three ranges, drawn evenly.
    pub sizes: [std::ops::Range<u64>; 3],
    /// Tensor kinds drawn from `TensorKind::ALL[..kinds]` (1: activations only).
    pub kinds: usize,
    /// Streams `0..streams` for allocations.
    pub streams: u32,
    /// Streams `0..use_streams` for uses and stream work.
    pub use_streams: u32,
    /// Weight of `Free`.
    pub free: u32,
    /// Weight of `Use`.
    pub uses: u32,
    /// Weight of `Phase`.
    pub phase: u32,
    /// Weight of `Bad`.
    pub bad: u32,
    /// Weight of `Work`.
    pub work: u32,
    /// Weight of `Advance`.
    pub advance: u32,
    /// Weight of `Compact`.
    pub compact: u32,
    /// Weight of `Pin`.
    pub pin: u32,
    /// Weight of `Unpin`.
    pub unpin: u32,
    /// Weight of `Evict`.
    pub evict: u32,
}

impl Default for Mix {
    /// Allocations, frees, uses and phases.
    fn default() -> Self {
        Mix {
            alloc: 6,
            sizes: [1..2048, 2048..2 * MIB, 2 * MIB..24 * MIB],
            kinds: 6,
            streams: 3,
            use_streams: 3,
            free: 4,
            uses: 2,
            phase: 1,
            bad: 0,
            work: 0,
            advance: 0,
            compact: 0,
            pin: 0,
            unpin: 0,
            evict: 0,
        }
    }
}

/// A strategy drawing actions with the weights of `mix`.
pub fn action(mix: &Mix) -> impl Strategy<Value = Action> {
    let m = mix.clone();
    let [s0, s1, s2] = m.sizes.clone();
    let (kinds, streams, use_streams) = (m.kinds.max(1), m.streams.max(1), m.use_streams.max(1));
    let mut arms: Vec<(u32, BoxedStrategy<Action>)> = vec![
        (
            m.alloc,
            (prop_oneof![s0, s1, s2], 0..kinds, 0..streams)
                .prop_map(|(bytes, kind, stream)| Action::Alloc { bytes, kind, stream })
                .boxed(),
        ),
        (m.free, any::<usize>().prop_map(Action::Free).boxed()),
        (m.uses, (any::<usize>(), 0..use_streams).prop_map(|(i, s)| Action::Use(i, s)).boxed()),
        (m.phase, (0usize..4).prop_map(Action::Phase).boxed()),
        (m.bad, (0usize..4).prop_map(Action::Bad).boxed()),
        (m.work, (any::<usize>(), 0..use_streams).prop_map(|(i, s)| Action::Work(i, s)).boxed()),
        (m.advance, (0u32..5000).prop_map(Action::Advance).boxed()),
        (
            m.compact,
            (any::<bool>(), 0u64..64).prop_map(|(large, budget_mib)| Action::Compact { large, budget_mib }).boxed(),
        ),
        (m.pin, any::<usize>().prop_map(Action::Pin).boxed()),
        (m.unpin, any::<usize>().prop_map(Action::Unpin).boxed()),
        (m.evict, any::<usize>().prop_map(Action::Evict).boxed()),
    ];
    arms.retain(|(w, _)| *w > 0);
    Union::new_weighted(arms)
}

/// The bytes written into the tensor with this seed, from `offset` on.
pub fn pattern(seed: u64, offset: u64, len: usize) -> Vec<u8> {
    (0..len as u64)
        .map(|i| (seed.wrapping_mul(0x9E37_79B9).wrapping_add((offset + i).wrapping_mul(31)) >> 3) as u8)
        .collect()
}

/// A live tensor of the workload and the seed of its contents.
#[derive(Debug, Clone, Copy)]
pub struct Live {
    /// Its handle.
    pub id: TensorId,
    /// Requested bytes.
    pub bytes: u64,
    /// Seed of its contents.
    pub seed: u64,
}

/// How much of each tensor is written and checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Coverage {
    /// All of a small tensor, the head and tail of a large one (fast).
    HeadAndTail,
    /// Every byte.
    Full,
}

impl Live {
    fn regions(&self, c: Coverage) -> Vec<(u64, usize)> {
        match c {
            Coverage::Full => vec![(0, self.bytes as usize)],
            Coverage::HeadAndTail if self.bytes <= 128 => vec![(0, self.bytes as usize)],
            Coverage::HeadAndTail => vec![(0, 64), (self.bytes - 64, 64)],
        }
    }

    /// Writes the tensor's contents.
    pub fn fill<D: Device>(&self, a: &mut Allocator<D>, c: Coverage) {
        for (off, n) in self.regions(c) {
            a.write(self.id, off, &pattern(self.seed, off, n)).unwrap();
        }
    }

    /// Checks the tensor's contents (bringing it back when it is off the device).
    pub fn check<D: Device>(&self, a: &mut Allocator<D>, c: Coverage) -> Result<(), String> {
        for (off, n) in self.regions(c) {
            let mut got = vec![0u8; n];
            a.read(self.id, off, &mut got).map_err(|e| format!("read {}: {e}", self.id))?;
            if got != pattern(self.seed, off, n) {
                return Err(format!("contents of {} ({} bytes) at {off} corrupted", self.id, self.bytes));
            }
        }
        Ok(())
    }
}

/// Checks every live tensor's contents; panics on the first corruption.
pub fn check_all<D: Device>(a: &mut Allocator<D>, live: &[Live], c: Coverage) {
    for l in live {
        l.check(a, c).unwrap_or_else(|e| panic!("{e}"));
    }
}
