//! Robustness of the two parsers: random and mutated input never panics,
//! and the memory either parser allocates stays within a bound set by its
//! limits and the input size (measured with a counting global allocator,
//! per thread). Seeded, so a run is reproducible.
//!
//! The cargo-fuzz targets in `host/fuzz/` drive the same entry points.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::io::Write;

use proptest::prelude::*;
use proptest::test_runner::RngSeed;
use wasmem::trace::snapshot::export::{self, ExportInput};
use wasmem::trace::snapshot::{self, ImportLimits, ImportOptions};
use wasmem::trace::{Event, ReadOptions, TraceReader, TraceWriter};
use wasmem::types::{Phase, TensorKind};

// ---------------------------------------------------------------------------
// Counting allocator: live bytes and peak per thread.
// ---------------------------------------------------------------------------

struct Counting;

thread_local! {
    static LIVE: Cell<isize> = const { Cell::new(0) };
    static PEAK: Cell<isize> = const { Cell::new(0) };
}

fn track(delta: isize) {
    let _ = LIVE.try_with(|live| {
        let now = live.get() + delta;
        live.set(now);
        let _ = PEAK.try_with(|peak| peak.set(peak.get().max(now)));
    });
}

// SAFETY: defers to `System`; the bookkeeping touches only const-initialized
// thread-locals without destructors, which never allocate.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            track(layout.size() as isize);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        track(-(layout.size() as isize));
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            track(layout.size() as isize);
        }
        p
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            track(new_size as isize - layout.size() as isize);
        }
        p
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Runs `f` and returns its result and the peak of bytes it had allocated
/// (on this thread) above what was live when it started.
fn peak_of<R>(f: impl FnOnce() -> R) -> (R, usize) {
    let base = LIVE.with(Cell::get);
    PEAK.with(|p| p.set(base));
    let r = f();
    let peak = PEAK.with(Cell::get);
    (r, (peak - base).max(0) as usize)
}

// ---------------------------------------------------------------------------
// The parsers under test, with small limits.
// ---------------------------------------------------------------------------

const MAX_LINE: usize = 4096;

/// Reads a trace to its end or first error; returns the events read.
fn read_trace(bytes: &[u8]) -> Result<Vec<Event>, String> {
    let reader = TraceReader::with_options(bytes, "fuzz.jsonl", ReadOptions { max_line_len: MAX_LINE })
        .map_err(|e| e.to_string())?;
    reader.collect::<Result<Vec<_>, _>>().map_err(|e| e.to_string())
}

/// Reads like [`read_trace`] with the reader's fast path on or off.
fn read_trace_with(bytes: &[u8], fast: bool) -> Result<Vec<Event>, String> {
    let mut reader = TraceReader::with_options(bytes, "fuzz.jsonl", ReadOptions { max_line_len: MAX_LINE })
        .map_err(|e| e.to_string())?;
    reader.set_fast_path(fast);
    reader.collect::<Result<Vec<_>, _>>().map_err(|e| e.to_string())
}

/// One line built from pieces that are valid, nearly valid or odd JSON.
fn near_valid_line() -> impl Strategy<Value = String> {
    let key = prop::sample::select(vec![
        "op", "id", "bytes", "kind", "stream", "t_us", "name", "step", "extra", "i\\u0064", "ID", "",
    ]);
    let value = prop::sample::select(vec![
        "0",
        "1",
        "7",
        "01",
        "-1",
        "1.5",
        "1e3",
        "4294967295",
        "4294967296",
        "18446744073709551615",
        "18446744073709551616",
        "\"alloc\"",
        "\"free\"",
        "\"use\"",
        "\"phase\"",
        "\"param\"",
        "\"temp\"",
        "\"forward\"",
        "\"step_end\"",
        "\"fr\\u0065e\"",
        "\"a b\"",
        "\"\"",
        "null",
        "true",
        "[1]",
        "{\"a\":1}",
        "\"\u{e9}\"",
    ]);
    let sep = prop::sample::select(vec!["", "", "", " ", "\t"]);
    let field = (key, sep.clone(), value, sep.clone()).prop_map(|(k, s1, v, s2)| format!("\"{k}\"{s1}:{s2}{v}"));
    let tail = prop::sample::select(vec!["", "", "", " ", ",", "}", "x"]);
    (proptest::collection::vec(field, 0..7), sep, tail)
        .prop_map(|(fields, s, t)| format!("{{{s}{}}}{t}", fields.join(",")))
}

const MAX_VALUES: usize = 20_000;

fn small_limits() -> ImportOptions {
    ImportOptions {
        device: 0,
        limits: ImportLimits {
            max_input_bytes: 1 << 20,
            max_values: MAX_VALUES,
            max_walk_steps: 200_000,
            ..ImportLimits::default()
        },
    }
}

fn import(bytes: &[u8]) -> Result<snapshot::Snapshot, String> {
    snapshot::import_bytes(bytes, "fuzz.pickle", &small_limits()).map_err(|e| e.to_string())
}

/// Memory bound of the pickle importer with [`small_limits`]: the arena and
/// stack (≤ 64 bytes per value), the records built from it (≤ 160 bytes per
/// value), the events, and slack for vector doubling.
fn pickle_bound(input_len: usize) -> usize {
    4 * (MAX_VALUES * 224 + input_len * 8) + (1 << 20)
}

/// Memory bound of the trace reader: line buffer, id sets, the collected
/// events (≤ 40 bytes each, one per ≥ 10 input bytes), doubling slack.
fn trace_bound(input_len: usize) -> usize {
    4 * (MAX_LINE + input_len * 8) + (1 << 16)
}

// ---------------------------------------------------------------------------
// Seeds for mutation
// ---------------------------------------------------------------------------

fn sample_events() -> Vec<Event> {
    let kinds = TensorKind::ALL;
    let mut ev = vec![Event::Phase { phase: Phase::Forward, step: 0 }];
    for i in 0..12u64 {
        ev.push(Event::Alloc {
            id: i + 1,
            bytes: 100 * i + 1,
            kind: kinds[i as usize % kinds.len()],
            stream: (i % 3) as u32,
            t_us: (i % 2 == 0).then_some(i * 10),
        });
        ev.push(Event::Use { id: i + 1, stream: (i % 4 == 0).then_some(1) });
        if i >= 3 {
            ev.push(Event::Free { id: i - 2, t_us: Some(i * 10 + 5) });
        }
    }
    ev.push(Event::Phase { phase: Phase::StepEnd, step: 0 });
    ev
}

fn sample_trace() -> Vec<u8> {
    let mut w = TraceWriter::new(Vec::new(), "seed", &Default::default()).unwrap();
    for e in sample_events() {
        w.write(&e).unwrap();
    }
    w.finish().unwrap()
}

fn sample_pickle() -> Vec<u8> {
    export::export_bytes(&ExportInput::one_segment_per_tensor(&sample_events(), 0)).unwrap()
}

/// One edit to a byte string.
#[derive(Debug, Clone)]
enum Mutation {
    Flip(usize, u8),
    Set(usize, u8),
    Insert(usize, Vec<u8>),
    Delete(usize, usize),
    Duplicate(usize, usize, usize),
    Truncate(usize),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<usize>(), 1u8..=255).prop_map(|(i, b)| Mutation::Flip(i, b)),
        (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Mutation::Set(i, b)),
        (any::<usize>(), proptest::collection::vec(any::<u8>(), 1..8)).prop_map(|(i, b)| Mutation::Insert(i, b)),
        (any::<usize>(), 1usize..16).prop_map(|(i, n)| Mutation::Delete(i, n)),
        (any::<usize>(), 1usize..64, any::<usize>()).prop_map(|(i, n, j)| Mutation::Duplicate(i, n, j)),
        any::<usize>().prop_map(Mutation::Truncate),
    ]
}

fn apply(mut b: Vec<u8>, muts: &[Mutation]) -> Vec<u8> {
    for m in muts {
        if b.is_empty() {
            b.push(b'{');
        }
        let n = b.len();
        match m {
            Mutation::Flip(i, x) => b[i % n] ^= x,
            Mutation::Set(i, x) => b[i % n] = *x,
            Mutation::Insert(i, s) => {
                let at = i % (n + 1);
                b.splice(at..at, s.iter().copied());
            }
            Mutation::Delete(i, k) => {
                let at = i % n;
                b.drain(at..(at + k).min(n));
            }
            Mutation::Duplicate(i, k, j) => {
                let at = i % n;
                let piece: Vec<u8> = b[at..(at + k).min(n)].to_vec();
                let to = j % (n + 1);
                b.splice(to..to, piece);
            }
            Mutation::Truncate(i) => b.truncate(i % n),
        }
    }
    b
}

fn config(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        rng_seed: RngSeed::Fixed(0x7ace_5eed),
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

proptest! {
    #![proptest_config(config(512))]

    #[test]
    fn trace_reader_survives_random_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..2048)) {
        let (_, peak) = peak_of(|| read_trace(&bytes));
        prop_assert!(peak <= trace_bound(bytes.len()), "peak {peak} for {} bytes", bytes.len());
    }

    #[test]
    fn trace_reader_survives_mutations(muts in proptest::collection::vec(mutation(), 1..4)) {
        let bytes = apply(sample_trace(), &muts);
        let (result, peak) = peak_of(|| read_trace(&bytes));
        prop_assert!(peak <= trace_bound(bytes.len()), "peak {peak} for {} bytes", bytes.len());
        if std::env::var_os("WASMEM_PRINT_PEAKS").is_some() {
            eprintln!("mutated trace: {} bytes, ok={}, peak {peak}", bytes.len(), result.is_ok());
        }
        if let Ok(events) = result {
            // Whatever the reader accepts, the writer accepts and reproduces.
            let mut w = TraceWriter::new(Vec::new(), "rt", &Default::default()).unwrap();
            for e in &events {
                w.write(e).unwrap();
            }
            let again = read_trace(&w.finish().unwrap()).unwrap();
            prop_assert_eq!(again, events);
        }
    }

    #[test]
    fn fast_and_general_paths_agree_on_random_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..2048)) {
        prop_assert_eq!(read_trace_with(&bytes, true), read_trace_with(&bytes, false));
    }

    #[test]
    fn fast_and_general_paths_agree_on_mutations(muts in proptest::collection::vec(mutation(), 1..4)) {
        let bytes = apply(sample_trace(), &muts);
        prop_assert_eq!(read_trace_with(&bytes, true), read_trace_with(&bytes, false));
    }

    #[test]
    fn fast_and_general_paths_agree_on_near_valid_lines(lines in proptest::collection::vec(near_valid_line(), 1..6)) {
        // Each line alone after a valid prefix, so that a line's own result
        // is compared, not only the first error.
        let mut prefix = sample_trace();
        for line in &lines {
            let mut b = prefix.clone();
            b.extend_from_slice(line.as_bytes());
            b.push(b'\n');
            let fast = read_trace_with(&b, true);
            prop_assert_eq!(&fast, &read_trace_with(&b, false), "{}", line);
            if fast.is_ok() {
                prefix = b;
            }
        }
    }

    #[test]
    fn pickle_importer_survives_random_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..2048)) {
        let (_, peak) = peak_of(|| import(&bytes));
        prop_assert!(peak <= pickle_bound(bytes.len()), "peak {peak} for {} bytes", bytes.len());
    }

    #[test]
    fn pickle_importer_survives_mutations(muts in proptest::collection::vec(mutation(), 1..4)) {
        let bytes = apply(sample_pickle(), &muts);
        let (result, peak) = peak_of(|| import(&bytes));
        prop_assert!(peak <= pickle_bound(bytes.len()), "peak {peak} for {} bytes", bytes.len());
        if std::env::var_os("WASMEM_PRINT_PEAKS").is_some() {
            eprintln!("mutated pickle: {} bytes, ok={}, peak {peak}", bytes.len(), result.is_ok());
        }
        if let Ok(s) = result {
            // Whatever the importer produces is a valid event stream.
            let mut w = TraceWriter::new(std::io::sink(), "rt", &s.header).unwrap();
            for e in &s.events {
                w.write(e).unwrap();
            }
        }
    }
}

#[test]
fn unmutated_seeds_parse() {
    assert_eq!(read_trace(&sample_trace()).unwrap(), sample_events());
    let bytes = sample_pickle();
    let (s, peak) = peak_of(|| import(&bytes));
    let s = s.unwrap();
    // The counting allocator sees the importer's arena.
    assert!(peak > bytes.len(), "peak {peak}");
    if std::env::var_os("WASMEM_PRINT_PEAKS").is_some() {
        eprintln!("seed pickle: {} bytes, import peak {peak} bytes", bytes.len());
    }
    assert_eq!(s.info.synthesized_allocs, 0);
    assert_eq!(s.events.iter().filter(|e| matches!(e, Event::Alloc { .. })).count(), 12);
}

// ---------------------------------------------------------------------------
// Hostile inputs built on purpose
// ---------------------------------------------------------------------------

/// Protocol-4 opcodes used below.
const PROTO4: [u8; 2] = [0x80, 4];

fn short_str(b: &mut Vec<u8>, s: &str) {
    b.push(0x8c);
    b.push(s.len() as u8);
    b.extend_from_slice(s.as_bytes());
}

#[test]
fn billion_laughs_stays_small() {
    // l0 = [0]; l(k+1) = [l(k), l(k)]; {"segments": l60}. A copying reader
    // would build 2**60 lists; this one keeps 61.
    let mut b = PROTO4.to_vec();
    b.push(b'}');
    short_str(&mut b, "device_traces");
    // l0, memoized as 0, then popped: only the memo holds it.
    b.extend_from_slice(&[b']', 0x94, b'K', 0, b'a', b'0']);
    for k in 0..60u32 {
        b.extend_from_slice(&[b']', 0x94, b'(', b'j']);
        b.extend_from_slice(&k.to_le_bytes());
        b.push(b'j');
        b.extend_from_slice(&k.to_le_bytes());
        b.push(b'e');
        if k < 59 {
            b.push(b'0');
        }
    }
    b.extend_from_slice(b"s.");
    let (r, peak) =
        peak_of(|| snapshot::import_bytes(&b, "laughs.pickle", &ImportOptions::default()).map_err(|e| e.to_string()));
    assert_eq!(r.unwrap_err(), "laughs.pickle: `device_traces[0][0]` should be a dict, found list");
    assert!(peak < 1 << 20, "peak {peak}");
}

#[test]
fn shared_dict_with_many_keys_hits_the_walk_limit() {
    // One entry dict with 2,003 keys, referenced 2,000 times: 24 M key
    // comparisons from 18 kB of input. The walk limit stops it.
    let mut b = PROTO4.to_vec();
    b.push(b'}');
    short_str(&mut b, "device_traces");
    b.extend_from_slice(&[b']', b']', b'}', 0x94, b'(']);
    for i in 0..2000u32 {
        b.push(b'J');
        b.extend_from_slice(&i.to_le_bytes());
        b.extend_from_slice(&[b'K', 0]);
    }
    short_str(&mut b, "action");
    short_str(&mut b, "alloc");
    short_str(&mut b, "addr");
    b.extend_from_slice(&[b'K', 0]);
    short_str(&mut b, "size");
    b.extend_from_slice(&[b'K', 1]);
    b.push(b'u'); // SETITEMS into the dict (memo 0)
    b.push(b'0'); // POP the dict; the inner list is on top
    b.push(b'('); // MARK for APPENDS of references
    for _ in 0..2000 {
        b.extend_from_slice(&[b'h', 0]);
    }
    b.push(b'e'); // inner list gets 2000 references
    b.push(b'a'); // outer list gets the inner list
    b.extend_from_slice(b"s.");
    let opts = ImportOptions {
        limits: ImportLimits { max_walk_steps: 1_000_000, ..ImportLimits::default() },
        ..ImportOptions::default()
    };
    let e = snapshot::import_bytes(&b, "keys.pickle", &opts).unwrap_err();
    assert_eq!(
        e.to_string(),
        "keys.pickle: the snapshot has more than 1000000 items to visit \
         (raise ImportLimits::max_walk_steps)"
    );
}

#[test]
fn deep_nesting_does_not_overflow_the_stack() {
    // 1,000,000 nested lists: [[[[…]]]].
    let n = 1_000_000;
    let mut b = PROTO4.to_vec();
    b.extend(std::iter::repeat_n(b']', n));
    b.extend(std::iter::repeat_n(b'a', n - 1));
    b.push(b'.');
    // A bare list reads as the old format's list of segments.
    let e = snapshot::import_bytes(&b, "deep.pickle", &ImportOptions::default()).unwrap_err();
    assert_eq!(e.to_string(), "deep.pickle: `segments[0]` should be a dict, found list");
}

#[test]
fn value_limit_caps_memory() {
    // 500,000 `None`s on the stack: rejected at the value limit.
    let mut b = PROTO4.to_vec();
    b.extend(std::iter::repeat_n(b'N', 500_000));
    b.push(b'.');
    let (r, peak) = peak_of(|| import(&b).map(|_| ()));
    assert_eq!(
        r.unwrap_err(),
        format!(
            "fuzz.pickle: the pickle holds more than {MAX_VALUES} values \
             (raise ImportLimits::max_values)"
        )
    );
    assert!(peak < 4 << 20, "peak {peak}");
    // And the input-size limit comes first for bigger files.
    let big = vec![b'N'; (1 << 20) + 1];
    assert_eq!(
        import(&big).unwrap_err(),
        "fuzz.pickle: the file is larger than 1048576 bytes (raise ImportLimits::max_input_bytes)"
    );
}

#[test]
fn endless_line_and_gzip_bomb_stay_bounded() {
    // 8 MiB without a newline.
    let mut text = b"{\"format\":\"wasmem-trace\",\"version\":1}\n".to_vec();
    text.extend(std::iter::repeat_n(b'x', 8 << 20));
    let (r, peak) = peak_of(|| read_trace(&text));
    assert_eq!(r.unwrap_err(), format!("fuzz.jsonl:2: line is longer than {MAX_LINE} bytes"));
    assert!(peak < 64 << 10, "peak {peak}");

    // 64 MiB of spaces, gzip-compressed to ~64 kB: read in constant memory.
    let dir = std::env::temp_dir().join(format!("wasmem-bomb-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("bomb.jsonl.gz");
    let mut gz = flate2::write::GzEncoder::new(std::fs::File::create(&path).unwrap(), flate2::Compression::best());
    gz.write_all(b"{\"format\":\"wasmem-trace\",\"version\":1}\n").unwrap();
    let chunk = vec![b' '; 1 << 20];
    for _ in 0..64 {
        gz.write_all(&chunk).unwrap();
    }
    gz.finish().unwrap();
    let (r, peak) = peak_of(|| {
        let reader = TraceReader::open_with(&path, ReadOptions { max_line_len: 1 << 16 }).unwrap();
        reader.collect::<Result<Vec<_>, _>>().map_err(|e| e.to_string())
    });
    assert!(r.unwrap_err().ends_with(":2: line is longer than 65536 bytes"));
    assert!(peak < 1 << 20, "peak {peak}");
    std::fs::remove_dir_all(&dir).unwrap();
}
