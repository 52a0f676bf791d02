//! Faults of the disk tier and impossible requests: each gives a clear error
//! naming the file (or the request), the tensor stays on its previous tier
//! with its contents, and nothing is left behind.

use std::path::{Path, PathBuf};

use wasmem::alloc::{AllocError, Allocator};
use wasmem::builtin;
use wasmem::device::sim::{SimConfig, SimDevice};
use wasmem::tier::{TierConfig, TierError};
use wasmem::types::{StreamId, TensorId, TensorKind, Tier, MIB};

fn pattern(seed: u8, len: u64) -> Vec<u8> {
    (0..len).map(|i| seed.wrapping_add((i % 251) as u8)).collect()
}

/// A device of 20 MiB: one 20 MiB segment of the large pool, room for two
/// 8 MiB tensors;
/// every eviction going straight to disk.
fn allocator(spill_dir: Option<PathBuf>, quota: u64) -> Allocator<SimDevice> {
    let dev = SimDevice::new(SimConfig { capacity: 20 * MIB, host_backed: true, ..SimConfig::default() });
    let mut a = Allocator::new(dev, builtin::by_name("lru").unwrap());
    a.enable_tiers(TierConfig {
        host_capacity: 0,
        spill_dir,
        disk_quota: quota,
        copy_contents: true,
        prefetch: false,
        ..TierConfig::default()
    });
    a
}

fn filled(a: &mut Allocator<SimDevice>, seed: u8) -> TensorId {
    let id = a.alloc(8 * MIB, TensorKind::Activation, StreamId(0)).unwrap();
    a.write(id, 0, &pattern(seed, 8 * MIB)).unwrap();
    id
}

fn assert_contents(a: &mut Allocator<SimDevice>, id: TensorId, seed: u8) {
    let mut out = vec![0u8; (8 * MIB) as usize];
    a.read(id, 0, &mut out).unwrap();
    assert!(out == pattern(seed, 8 * MIB), "{id} lost its contents");
}

fn files_in(dir: &Path) -> usize {
    std::fs::read_dir(dir).map(|d| d.count()).unwrap_or(0)
}

#[test]
fn unwritable_spill_dir_names_it_and_keeps_the_tensor() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("not-a-dir");
    std::fs::write(&file, b"x").unwrap();
    // A directory under a regular file cannot exist, even for root.
    let bad = file.join("spill");
    let mut a = allocator(Some(bad.clone()), u64::MAX);
    let x = filled(&mut a, 1);
    let y = filled(&mut a, 2);
    let err = a.alloc(8 * MIB, TensorKind::Activation, StreamId(0)).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, AllocError::Tier(TierError::SpillDir { .. })), "{err:?}");
    assert!(msg.contains(&bad.display().to_string()), "the error names the directory: {msg}");
    for (id, seed) in [(x, 1), (y, 2)] {
        assert_eq!(a.tier(id).unwrap(), Tier::Device);
        assert_contents(&mut a, id, seed);
    }
    a.check_invariants().unwrap();
    assert_eq!(a.live_tensors(), 2);
}

#[test]
fn full_disk_quota_names_the_file_and_keeps_the_tensor() {
    let spill = tempfile::tempdir().unwrap();
    let mut a = allocator(Some(spill.path().to_path_buf()), 12 * MIB);
    let x = filled(&mut a, 1);
    let y = filled(&mut a, 2);
    // The first eviction fits the quota, the second does not.
    let z = a.alloc(8 * MIB, TensorKind::Activation, StreamId(0)).unwrap();
    a.write(z, 0, &pattern(3, 8 * MIB)).unwrap();
    assert_eq!(a.tier(x).unwrap(), Tier::Disk);
    let err = a.evict(&[y]).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, AllocError::Tier(TierError::QuotaExceeded { .. })), "{err:?}");
    assert!(msg.contains(&spill.path().display().to_string()) && msg.contains(".spill"), "names the file: {msg}");
    assert_eq!(a.tier(y).unwrap(), Tier::Device, "the tensor stays where it was");
    assert_eq!(files_in(spill.path()), 1, "a refused write leaves no file");
    a.check_invariants().unwrap();
    for (id, seed) in [(y, 2), (z, 3)] {
        assert_contents(&mut a, id, seed);
    }
    // x comes back from disk (evicting another tensor, which fits the quota once x's file is gone).
    a.free(z).unwrap();
    assert_contents(&mut a, x, 1);
    a.check_invariants().unwrap();
}

#[test]
fn corrupted_spill_file_is_detected_and_named() {
    let spill = tempfile::tempdir().unwrap();
    let mut a = allocator(Some(spill.path().to_path_buf()), u64::MAX);
    let x = filled(&mut a, 7);
    a.evict(&[x]).unwrap();
    assert_eq!(a.tier(x).unwrap(), Tier::Disk);
    let file = std::fs::read_dir(spill.path()).unwrap().next().unwrap().unwrap().path();
    let mut bytes = std::fs::read(&file).unwrap();
    bytes[12345] ^= 0xff;
    std::fs::write(&file, &bytes).unwrap();
    let err = a.use_tensor(x, None).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, AllocError::Tier(TierError::Corrupt { .. })), "{err:?}");
    assert!(msg.contains(&file.display().to_string()), "names the file: {msg}");
    assert_eq!(a.tier(x).unwrap(), Tier::Disk, "the tensor stays on disk");
    a.check_invariants().unwrap();
    // A truncated file is caught too.
    std::fs::write(&file, &bytes[..100]).unwrap();
    let err = a.use_tensor(x, None).unwrap_err();
    assert!(err.to_string().contains("100 bytes instead of"), "{err}");
    a.free(x).unwrap();
    assert_eq!(files_in(spill.path()), 0, "freeing removes the spill file");
    a.check_invariants().unwrap();
}

#[test]
fn spill_files_and_default_dir_are_removed_at_shutdown() {
    // A user directory: our files go, the directory stays.
    let spill = tempfile::tempdir().unwrap();
    let mut a = allocator(Some(spill.path().to_path_buf()), u64::MAX);
    let ids: Vec<TensorId> = (0..2).map(|k| filled(&mut a, k)).collect();
    a.evict(&ids).unwrap();
    assert_eq!(files_in(spill.path()), 2);
    drop(a);
    assert!(spill.path().is_dir());
    assert_eq!(files_in(spill.path()), 0);
    // The default: a fresh temporary directory, removed entirely.
    let mut a = allocator(None, u64::MAX);
    let ids: Vec<TensorId> = (0..2).map(|k| filled(&mut a, k)).collect();
    a.evict(&ids).unwrap();
    let dir = a.tier_state().unwrap().disk.dir_path().unwrap().to_path_buf();
    assert_eq!(files_in(&dir), 2);
    drop(a);
    assert!(!dir.exists(), "{} outlived the allocator", dir.display());
}

#[test]
fn request_larger_than_the_device_is_an_oom_naming_it() {
    let mut a = allocator(None, u64::MAX);
    let x = filled(&mut a, 1);
    let err = a.alloc(64 * MIB, TensorKind::Param, StreamId(3)).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, AllocError::OutOfMemory { .. }), "{err:?}");
    assert!(msg.contains(&(64 * MIB).to_string()) && msg.contains("param") && msg.contains("stream 3"), "{msg}");
    assert_eq!(a.stats().ooms, 1);
    assert_eq!(a.tier(x).unwrap(), Tier::Device, "nothing was evicted for a hopeless request");
    assert_eq!(a.tier_stats().evictions, 0);
    a.check_invariants().unwrap();
}

#[test]
fn pinned_tensors_are_never_evicted_and_pinning_brings_back() {
    let mut a = allocator(None, u64::MAX);
    let x = filled(&mut a, 1);
    let y = filled(&mut a, 2);
    a.pin(x).unwrap();
    a.pin(y).unwrap();
    // Both pinned: nothing can make room.
    let err = a.alloc(8 * MIB, TensorKind::Temp, StreamId(0)).unwrap_err();
    assert!(matches!(err, AllocError::OutOfMemory { .. }), "{err:?}");
    assert_eq!((a.tier(x).unwrap(), a.tier(y).unwrap()), (Tier::Device, Tier::Device));
    a.unpin(y).unwrap();
    let z = a.alloc(8 * MIB, TensorKind::Temp, StreamId(0)).unwrap();
    assert_eq!(a.tier(y).unwrap(), Tier::Disk);
    a.free(z).unwrap();
    a.pin(y).unwrap();
    assert_eq!(a.tier(y).unwrap(), Tier::Device);
    assert_contents(&mut a, y, 2);
    a.check_invariants().unwrap();
}

#[test]
fn eviction_without_tiers_is_refused() {
    let dev = SimDevice::new(SimConfig { capacity: 20 * MIB, ..SimConfig::default() });
    let mut a = Allocator::new(dev, builtin::by_name("lru").unwrap());
    let x = a.alloc(MIB, TensorKind::Temp, StreamId(0)).unwrap();
    let err = a.evict(&[x]).unwrap_err();
    assert!(err.to_string().contains("not enabled"), "{err}");
    assert_eq!(a.tier(x).unwrap(), Tier::Device);
}
