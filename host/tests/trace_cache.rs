//! The trace cache: a hit gives exactly the events of a parse; a corrupt,
//! truncated or foreign entry is detected and ignored (the trace is parsed,
//! the stream is unchanged, the entry rewritten); entries appear only
//! complete and only for valid traces; workloads use the cache and notice a
//! changed file.

use std::path::{Path, PathBuf};

use wasmem::trace::cache::{CacheError, ContentKey, Origin, TraceCache};
use wasmem::trace::{read_file, write_file, Event, ReadOptions, TraceHeader};
use wasmem::types::{Phase, TensorKind};
use wasmem::workload::{Source, TraceOptions, Workload};

/// A valid trace of about `n` events (several cache chunks when large).
fn events(n: u64) -> Vec<Event> {
    let mut ev = Vec::new();
    let kinds = TensorKind::ALL;
    let mut id = 0u64;
    while (ev.len() as u64) < n {
        id += 1;
        ev.push(Event::Alloc {
            id,
            bytes: 512 * (id % 97 + 1),
            kind: kinds[id as usize % kinds.len()],
            stream: (id % 3) as u32,
            t_us: Some(id * 10),
        });
        ev.push(Event::Use { id, stream: id.is_multiple_of(4).then_some(2) });
        if id > 8 {
            ev.push(Event::Free { id: id - 8, t_us: id.is_multiple_of(2).then_some(id * 10 + 3) });
        }
        if id.is_multiple_of(500) {
            ev.push(Event::Phase { phase: Phase::StepEnd, step: id / 500 });
        }
    }
    ev
}

struct Fixture {
    _dir: tempfile::TempDir,
    trace: PathBuf,
    cache: TraceCache,
    key: ContentKey,
    header: TraceHeader,
    events: Vec<Event>,
}

fn fixture(n: u64, name: &str) -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join(name);
    let header = TraceHeader { source: "cache test".into(), ranks: 2 };
    let events = events(n);
    write_file(&trace, &header, &events).unwrap();
    let cache = TraceCache::at(dir.path().join("cache")).with_min_file_bytes(0);
    let key = ContentKey::of_file(&trace).unwrap();
    Fixture { _dir: dir, trace, cache, key, header, events }
}

impl Fixture {
    fn entry(&self) -> PathBuf {
        self.cache.entry_path(&self.key, ReadOptions::default())
    }

    /// Reads through the cache: (origin, events, resumed_at).
    fn read(&self) -> (Origin, Vec<Event>, Option<u64>) {
        let mut t = self.cache.open(&self.trace, &self.key, ReadOptions::default()).unwrap();
        assert_eq!(t.header(), &self.header);
        let events: Vec<Event> = t.by_ref().map(|e| e.unwrap()).collect();
        let resumed = t.resumed_at();
        (t.into_origin(), events, resumed)
    }
}

fn files_in(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map(|d| d.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    v.sort();
    v
}

#[test]
fn a_hit_equals_a_parse() {
    for (n, name) in [(10, "small.jsonl"), (200_000, "big.jsonl.gz")] {
        let f = fixture(n, name);
        let (origin, first, _) = f.read();
        assert!(matches!(origin, Origin::Miss), "{origin:?}");
        assert_eq!(first, f.events);
        assert!(f.entry().is_file());
        assert_eq!(files_in(f.cache.dir()).len(), 1, "no temporary file is left");
        let (origin, second, resumed) = f.read();
        assert!(matches!(origin, Origin::Hit), "{origin:?}");
        assert_eq!(resumed, None);
        assert_eq!(second, f.events);
        assert_eq!(second, read_file(&f.trace).unwrap().1);
    }
}

#[test]
fn shared_traces_hit_equals_parse() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/traces");
    let Ok(entries) = std::fs::read_dir(&dir) else {
        eprintln!("SKIP: no shared traces in {}", dir.display());
        return;
    };
    let cache_dir = tempfile::tempdir().unwrap();
    let cache = TraceCache::at(cache_dir.path()).with_min_file_bytes(0);
    for e in entries.flatten() {
        let p = e.path();
        if !p.to_string_lossy().ends_with(".jsonl.gz") {
            continue;
        }
        let (header, parsed) = read_file(&p).unwrap();
        let key = ContentKey::of_file(&p).unwrap();
        for expect_hit in [false, true] {
            let t = cache.open(&p, &key, ReadOptions::default()).unwrap();
            assert_eq!(matches!(t.origin(), Origin::Hit), expect_hit, "{}", p.display());
            assert_eq!(t.header(), &header);
            assert_eq!(t.map(|e| e.unwrap()).collect::<Vec<_>>(), parsed, "{}", p.display());
        }
    }
}

/// Corrupts the entry with `edit`, then checks that reading detects it and
/// still gives the parsed events, and that the entry is good again after.
fn detected(f: &Fixture, edit: impl FnOnce(&mut Vec<u8>)) -> (Origin, Option<u64>) {
    let mut bytes = std::fs::read(f.entry()).unwrap();
    edit(&mut bytes);
    std::fs::write(f.entry(), &bytes).unwrap();
    let (origin, events, resumed) = f.read();
    assert_eq!(events, f.events, "the stream is unchanged");
    let (again, events, none) = f.read();
    assert!(matches!(again, Origin::Hit), "rewritten: {again:?}");
    assert_eq!((events, none), (f.events.clone(), None));
    (origin, resumed)
}

#[test]
fn a_corrupt_entry_is_detected_and_ignored() {
    let f = fixture(200_000, "t.jsonl.gz");
    f.read();
    let len = std::fs::metadata(f.entry()).unwrap().len() as usize;

    // Header: rejected before any event.
    let (o, r) = detected(&f, |b| b[20] ^= 0x40);
    assert!(matches!(o, Origin::Rejected(CacheError::Checksum { part: "header", .. })), "{o:?}");
    assert_eq!(r, None);
    let (o, _) = detected(&f, |b| b[0] = b'X');
    assert!(matches!(o, Origin::Rejected(CacheError::BadMagic)), "{o:?}");
    let (o, _) = detected(&f, |b| b.truncate(10));
    assert!(matches!(o, Origin::Rejected(CacheError::Truncated { .. })), "{o:?}");

    // A late chunk: the events before it come from the entry, the rest
    // from the parser, and nothing differs.
    let (o, r) = detected(&f, |b| b[len - 1000] ^= 1);
    assert!(matches!(o, Origin::Hit), "{o:?}");
    let r = r.expect("resumed");
    assert!(r > 0 && r < f.events.len() as u64 && r % (1 << 16) == 0, "resumed at {r}");
    // Truncated inside the events, and at the very end (no end record).
    let (_, r) = detected(&f, |b| b.truncate(len / 2));
    assert!(r.is_some());
    let (_, r) = detected(&f, |b| b.truncate(len - 3));
    assert!(r.is_some());
    // Trailing garbage.
    let (_, r) = detected(&f, |b| b.extend_from_slice(b"junk"));
    assert_eq!(r, Some(f.events.len() as u64));
    // Not an entry at all.
    let (o, _) = detected(&f, |b| *b = b"hello".to_vec());
    assert!(matches!(o, Origin::Rejected(_)), "{o:?}");
}

#[test]
fn an_entry_of_other_content_is_not_used() {
    let a = fixture(1_000, "a.jsonl");
    let b = fixture(1_000, "b.jsonl");
    let mut b_header = b.header.clone();
    b_header.source = "other".into();
    write_file(&b.trace, &b_header, &b.events[..500]).unwrap();
    let b_key = ContentKey::of_file(&b.trace).unwrap();
    assert_ne!(a.key, b_key);
    a.read();
    // b's entry slot holds a's entry.
    std::fs::create_dir_all(b.cache.dir()).unwrap();
    std::fs::copy(a.entry(), b.cache.entry_path(&b_key, ReadOptions::default())).unwrap();
    let t = b.cache.open(&b.trace, &b_key, ReadOptions::default()).unwrap();
    assert!(matches!(t.origin(), Origin::Rejected(CacheError::Mismatch { what: "digest" })), "{:?}", t.origin());
    assert_eq!(t.header(), &b_header);
    assert_eq!(t.map(|e| e.unwrap()).collect::<Vec<_>>(), b.events[..500].to_vec());
    // Other read options are another entry.
    let small = ReadOptions { max_line_len: 4096 };
    assert_ne!(a.cache.entry_path(&a.key, small), a.entry());
}

#[test]
fn only_complete_valid_traces_leave_an_entry() {
    // An invalid trace: the error as the parser reports it, no entry.
    let f = fixture(100, "bad.jsonl");
    let mut text = std::fs::read_to_string(&f.trace).unwrap();
    text.push_str("{\"op\":\"free\",\"id\":99999}\n");
    std::fs::write(&f.trace, text).unwrap();
    let key = ContentKey::of_file(&f.trace).unwrap();
    let t = f.cache.open(&f.trace, &key, ReadOptions::default()).unwrap();
    let last = t.last().unwrap();
    assert!(last.unwrap_err().to_string().ends_with(": free of unknown id 99999"));
    assert_eq!(files_in(f.cache.dir()), Vec::<String>::new());

    // A read stopped early: no entry either.
    let g = fixture(200_000, "stop.jsonl.gz");
    let t = g.cache.open(&g.trace, &g.key, ReadOptions::default()).unwrap();
    assert_eq!(t.take(100_000).count(), 100_000);
    assert_eq!(files_in(g.cache.dir()), Vec::<String>::new());
}

#[test]
fn an_unwritable_cache_only_costs_the_parse() {
    let f = fixture(1_000, "t.jsonl");
    // The cache directory is a file: nothing can be created in it.
    std::fs::write(f.cache.dir(), b"not a directory").unwrap();
    for _ in 0..2 {
        let (origin, events, _) = f.read();
        assert!(matches!(origin, Origin::Miss));
        assert_eq!(events, f.events);
    }
}

#[test]
fn workloads_use_the_cache_and_notice_a_changed_file() {
    let f = fixture(50_000, "w.jsonl.gz");
    let opts = TraceOptions { cache: Some(f.cache.clone()), read_ahead: true };
    let w = Workload::open_with(&Source::File(f.trace.clone()), &opts).unwrap();
    assert!(matches!(w.fill_cache().unwrap(), Some(Origin::Miss)));
    assert!(matches!(w.fill_cache().unwrap(), Some(Origin::Hit)));
    let run = |w: &Workload| w.events().unwrap().map(|e| e.unwrap()).collect::<Vec<_>>();
    assert_eq!(run(&w), f.events);

    // The file changes under the open workload: another key, another entry.
    write_file(&f.trace, &f.header, &f.events[..1000]).unwrap();
    assert_eq!(run(&w), f.events[..1000].to_vec());
    assert!(matches!(w.fill_cache().unwrap(), Some(Origin::Hit)));
    assert_eq!(files_in(f.cache.dir()).len(), 2);

    // Without a cache, or below its size threshold: no entry, same events.
    for opts in [
        TraceOptions { cache: None, read_ahead: false },
        TraceOptions { cache: Some(f.cache.clone().with_min_file_bytes(u64::MAX)), read_ahead: true },
    ] {
        let w = Workload::open_with(&Source::File(f.trace.clone()), &opts).unwrap();
        assert!(w.fill_cache().unwrap().is_none());
        assert_eq!(run(&w), f.events[..1000].to_vec());
    }
    assert_eq!(files_in(f.cache.dir()).len(), 2);
}
