//! The snapshot importer's memory cap on hostile pickles, checked by its own
//! accounting (`SnapshotInfo::accounted_peak_bytes`, the `MemoryLimit`
//! error) and that accounting against the heap: this test binary counts
//! every allocation (one test function, so nothing else allocates while an
//! import runs), and an import's heap peak must stay within what it
//! accounted for (plus a small slack for the few untracked allocations).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};

use wasmem::trace::snapshot::{self, ImportLimits, ImportOptions, Snapshot, SnapshotError, SnapshotErrorKind};
use wasmem::trace::Event;
use wasmem::types::TensorKind;

/// The system allocator, counting the bytes live and their peak.
struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);
static PEAK: AtomicIsize = AtomicIsize::new(0);

fn add(bytes: isize) {
    let now = LIVE.fetch_add(bytes, Ordering::Relaxed) + bytes;
    PEAK.fetch_max(now, Ordering::Relaxed);
}

// SAFETY: every call is forwarded to `System` with the same arguments.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        add(l.size() as isize);
        unsafe { System.alloc(l) }
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        add(l.size() as isize);
        unsafe { System.alloc_zeroed(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        unsafe { System.dealloc(p, l) };
        LIVE.fetch_sub(l.size() as isize, Ordering::Relaxed);
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        add(new as isize - l.size() as isize);
        unsafe { System.realloc(p, l, new) }
    }
}

#[global_allocator]
static COUNTING: Counting = Counting;

/// An import and the heap bytes it held at most above what was live before.
fn import(name: &str, bytes: &[u8], limits: ImportLimits) -> (Result<Snapshot, SnapshotError>, u64) {
    let base = LIVE.load(Ordering::Relaxed);
    PEAK.store(base, Ordering::Relaxed);
    let r = snapshot::import_bytes(bytes, name, &ImportOptions { limits, ..ImportOptions::default() });
    let heap = (PEAK.load(Ordering::Relaxed) - base).max(0) as u64;
    match &r {
        Ok(s) => eprintln!(
            "{name}: {} input bytes, accounted peak {} ({:.2} per input byte), heap peak {heap}, {} events",
            bytes.len(),
            s.info.accounted_peak_bytes,
            s.info.accounted_peak_bytes as f64 / bytes.len() as f64,
            s.events.len()
        ),
        Err(e) => eprintln!("{name}: {} input bytes, heap peak {heap}: {e}", bytes.len()),
    }
    (r, heap)
}

/// The heap peak is within the accounted peak, plus slack for what the
/// accounting leaves out (allocations of a few bytes, the result's header).
fn assert_accounted(name: &str, accounted: u64, heap: u64) {
    let slack = accounted / 8 + (1 << 20);
    assert!(heap <= accounted + slack, "{name}: heap peak {heap} > accounted {accounted} + {slack}");
}

// Pickle bytes, protocol 4.
const PROTO4: [u8; 2] = [0x80, 4];
const MARK: u8 = b'(';
const EMPTY_LIST: u8 = b']';
const EMPTY_DICT: u8 = b'}';
const APPEND: u8 = b'a';
const APPENDS: u8 = b'e';
const SETITEM: u8 = b's';
const SETITEMS: u8 = b'u';
const MEMOIZE: u8 = 0x94;
const STOP: u8 = b'.';

fn str_(b: &mut Vec<u8>, s: &str) {
    b.push(0x8c);
    b.push(s.len() as u8);
    b.extend_from_slice(s.as_bytes());
}

fn int(b: &mut Vec<u8>, i: u32) {
    b.push(b'J');
    b.extend_from_slice(&i.to_le_bytes());
}

/// `"segments": [{"address": 0, "total_size": 4096, "blocks": [{"size":
/// 4096, "state": "active_allocated"}]}]`, as a key and value of an open
/// `SETITEMS`.
fn one_segment(b: &mut Vec<u8>) {
    str_(b, "segments");
    b.extend_from_slice(&[EMPTY_LIST, EMPTY_DICT, MARK]);
    str_(b, "address");
    int(b, 0);
    str_(b, "total_size");
    int(b, 4096);
    str_(b, "blocks");
    b.extend_from_slice(&[EMPTY_LIST, EMPTY_DICT, MARK]);
    str_(b, "size");
    int(b, 4096);
    str_(b, "state");
    str_(b, "active_allocated");
    b.extend_from_slice(&[SETITEMS, APPEND, SETITEMS, APPEND]);
}

/// `{key: [[], [], …] (n empty lists, each memoized as Python's pickler
/// does), "segments": [one segment]}`, about two bytes per list.
fn many_empty_lists(key: &str, n: usize) -> Vec<u8> {
    let mut b = PROTO4.to_vec();
    b.extend_from_slice(&[EMPTY_DICT, MEMOIZE, MARK]);
    str_(&mut b, key);
    b.push(EMPTY_LIST);
    for i in 0..n {
        if i % 1000 == 0 {
            b.push(MARK);
        }
        b.extend_from_slice(&[EMPTY_LIST, MEMOIZE]);
        if i % 1000 == 999 || i == n - 1 {
            b.push(APPENDS);
        }
    }
    if key != "segments" {
        one_segment(&mut b);
    }
    b.extend_from_slice(&[SETITEMS, STOP]);
    b
}

/// `{key: [[[…]]] (depth lists, each in the one before), "segments": […]}`,
/// two bytes per level.
fn nested_lists(key: &str, depth: usize) -> Vec<u8> {
    let mut b = PROTO4.to_vec();
    b.extend_from_slice(&[EMPTY_DICT, MEMOIZE]);
    str_(&mut b, key);
    b.extend(std::iter::repeat_n(EMPTY_LIST, depth));
    b.extend(std::iter::repeat_n(APPEND, depth - 1));
    b.push(SETITEM);
    if key != "segments" {
        b.push(MARK);
        one_segment(&mut b);
        b.push(SETITEMS);
    }
    b.push(STOP);
    b
}

fn the_segment_only() -> Vec<Event> {
    vec![Event::Alloc { id: 1, bytes: 4096, kind: TensorKind::Other, stream: 0, t_us: None }]
}

#[test]
fn hostile_pickles_stay_within_the_cap_and_the_accounting_holds() {
    let limits = ImportLimits::default();

    // The shared real snapshots (skipped when absent): well within the cap;
    // their results are checked by trace_snapshot.rs.
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/traces");
    for name in ["pytorch-snapshot-a.pickle", "pytorch-snapshot-b.pickle"] {
        let Ok(bytes) = std::fs::read(dir.join(name)) else {
            eprintln!("skipping {name}: {} is absent", dir.join(name).display());
            continue;
        };
        let (r, heap) = import(name, &bytes, limits);
        let s = r.unwrap();
        assert!(s.info.accounted_peak_bytes <= 8 * bytes.len() as u64, "{name}: {}", s.info.accounted_peak_bytes);
        assert_accounted(name, s.info.accounted_peak_bytes, heap);
    }

    // 10 M empty lists under an unused key (20 MB): nothing of them is
    // kept, the import holds less than 1 MB.
    let bytes = many_empty_lists("junk", 10_000_000);
    assert!(bytes.len() > 20_000_000);
    let (r, heap) = import("empty-lists", &bytes, limits);
    let s = r.unwrap();
    assert_eq!(s.events, the_segment_only());
    assert!(s.info.accounted_peak_bytes < 1 << 20, "{}", s.info.accounted_peak_bytes);
    assert_accounted("empty-lists", s.info.accounted_peak_bytes, heap);

    // 10 M nested lists under an unused key (20 MB): only the parser's
    // stack (8 bytes a level) is held.
    let bytes = nested_lists("junk", 10_000_000);
    let (r, heap) = import("nested-lists", &bytes, limits);
    let s = r.unwrap();
    assert_eq!(s.events, the_segment_only());
    let per_byte = s.info.accounted_peak_bytes as f64 / bytes.len() as f64;
    assert!(per_byte < 7.0, "{per_byte}");
    assert_accounted("nested-lists", s.info.accounted_peak_bytes, heap);

    // The same under `segments`, where the import must keep them: over the
    // cap (8 bytes per input byte + 64 MiB), a clear error naming it, and
    // the heap never held much more than the cap.
    for (name, bytes) in [
        ("segments-of-empty-lists", many_empty_lists("segments", 10_000_000)),
        ("segments-of-nested-lists", nested_lists("segments", 10_000_000)),
    ] {
        let cap = limits.memory_limit(bytes.len());
        let (r, heap) = import(name, &bytes, limits);
        let e = r.err().unwrap_or_else(|| panic!("{name}: imported"));
        assert!(
            matches!(e.kind, SnapshotErrorKind::MemoryLimit { limit, offset: Some(_), .. } if limit == cap),
            "{name}: {e}"
        );
        assert!(e.to_string().contains(&format!("needs more than {cap} bytes of memory")), "{e}");
        assert_accounted(name, cap, heap);
        // A larger cap admits the nested lists; it is all accounted.
        let roomy = ImportLimits { memory_per_input_byte: 64, ..limits };
        let (r, heap) = import(name, &bytes, roomy);
        match r {
            Ok(s) => assert_accounted(name, s.info.accounted_peak_bytes, heap),
            Err(e) => assert!(matches!(e.kind, SnapshotErrorKind::Shape { .. }), "{name}: {e}"),
        }
    }
}
