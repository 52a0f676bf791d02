//! The reader's two paths agree: the byte-level fast path and the general
//! serde parser give the same header, the same events and the same errors
//! (FILE:LINE and message) on the shared traces, on every trace-like fixture
//! under `tests/data/`, and on traces made of unusual but valid or nearly
//! valid lines. (Random and mutated input: `trace_fuzz.rs`.)

use std::path::{Path, PathBuf};

use wasmem::trace::{Event, TraceHeader, TraceReader, TraceWriter};
use wasmem::types::{Phase, TensorKind};

type Outcome = Result<(TraceHeader, Vec<Event>), String>;

fn read_file(path: &Path, fast: bool) -> Outcome {
    let mut r = TraceReader::open(path).map_err(|e| e.to_string())?;
    r.set_fast_path(fast);
    let header = r.header().clone();
    let events = r.collect::<Result<Vec<_>, _>>().map_err(|e| e.to_string())?;
    Ok((header, events))
}

fn read_bytes(bytes: &[u8], fast: bool) -> Outcome {
    let mut r = TraceReader::new(bytes, "t.jsonl").map_err(|e| e.to_string())?;
    r.set_fast_path(fast);
    let header = r.header().clone();
    let events = r.collect::<Result<Vec<_>, _>>().map_err(|e| e.to_string())?;
    Ok((header, events))
}

fn same_both_ways(path: &Path) -> Outcome {
    let general = read_file(path, false);
    let fast = read_file(path, true);
    assert_eq!(fast, general, "{}", path.display());
    fast
}

fn files_under(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            files_under(&p, out);
        } else if p.to_string_lossy().ends_with(".jsonl") || p.to_string_lossy().ends_with(".jsonl.gz") {
            out.push(p);
        }
    }
}

#[test]
fn shared_traces_read_the_same_both_ways() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/traces");
    let mut files = Vec::new();
    files_under(&dir, &mut files);
    if files.is_empty() {
        eprintln!("SKIP: no shared traces in {}", dir.display());
        return;
    }
    for f in files {
        let (_, events) = same_both_ways(&f).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
        assert!(events.len() > 10_000, "{}", f.display());
    }
}

#[test]
fn fixtures_read_the_same_both_ways() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/data");
    let mut files = Vec::new();
    files_under(&dir, &mut files);
    assert!(files.iter().any(|f| f.ends_with("tiny.jsonl")), "fixtures found: {files:?}");
    let mut ok = 0;
    for f in &files {
        // Golden outputs are JSON Lines too, not traces: both paths must
        // refuse them with the same error.
        if same_both_ways(f).is_ok() {
            ok += 1;
        }
    }
    assert!(ok >= 1);
}

const HEADER: &str = r#"{"format":"wasmem-trace","version":1,"source":"paths","ranks":1}"#;

fn check(body: &[&str]) -> Outcome {
    let text = format!("{HEADER}\n{}\n", body.join("\n"));
    let general = read_bytes(text.as_bytes(), false);
    let fast = read_bytes(text.as_bytes(), true);
    assert_eq!(fast, general, "{text}");
    fast
}

#[test]
fn unusual_lines_read_the_same_both_ways() {
    let alloc = r#"{"op":"alloc","id":1,"bytes":16,"kind":"param"}"#;
    // Valid in JSON and in the format, but not of the fast path's shapes.
    let valid: &[&[&str]] = &[
        &[r#"{ "op" : "alloc" , "id" : 1 , "bytes" : 16 , "kind" : "param" }"#],
        &[r#"{"op":"alloc","id":1,"bytes":16,"kind":"param","stream":null,"t_us":null}"#],
        &[r#"{"op":"alloc","id":1,"bytes":16,"kind":"p\u0061ram"}"#],
        &[r#"{"op":"alloc","id":1,"bytes":16,"kind":"param","extra":{"a":[1,2,{"b":null}]},"x":"\""}"#],
        &[r#"{"bytes":16,"kind":"param","id":1,"op":"alloc","stream":4294967295}"#],
        &[alloc, r#"{"op":"use","id":1,"stream":0}"#, r#"{"op":"free","id":1,"t_us":18446744073709551615}"#],
        &[alloc, "  ", "\t", r#"{"op":"free","id":1}   "#],
        &[r#"{"op":"phase","name":"forward","step":0,"id":99}"#],
    ];
    for body in valid {
        assert!(check(body).is_ok(), "{body:?}");
    }
    // Invalid: each error the same both ways (and the fast path never
    // accepts what the general path refuses).
    let invalid: &[&[&str]] = &[
        &[r#"{"op":"alloc","id":01,"bytes":16,"kind":"param"}"#],
        &[r#"{"op":"alloc","id":1,"bytes":-16,"kind":"param"}"#],
        &[r#"{"op":"alloc","id":1,"bytes":1.0,"kind":"param"}"#],
        &[r#"{"op":"alloc","id":1,"bytes":1e3,"kind":"param"}"#],
        &[r#"{"op":"alloc","id":1,"bytes":18446744073709551616,"kind":"param"}"#],
        &[r#"{"op":"alloc","id":1,"bytes":16,"kind":"param","stream":4294967296}"#],
        &[r#"{"op":"alloc","id":1,"bytes":16,"kind":"param","id":2}"#],
        &[r#"{"op":"alloc","id":1,"bytes":16,"kind":"weights"}"#],
        &[r#"{"op":"alloc","id":1,"bytes":16}"#],
        &[r#"{"op":"alloc","id":1,"bytes":16,"kind":"param"},"#],
        &[r#"{"op":"alloc","id":1,"bytes":16,"kind":"param"}}"#],
        &[r#"{"op":"alloc","id":1,"bytes":16,"kind":"param""#],
        &[r#"{"op":"alloc","id":1,"bytes":16,"kind":"par\am"}"#],
        &["{\"op\":\"alloc\",\"id\":1,\"bytes\":16,\"kind\":\"par\tam\"}"],
        &[r#"{"op":"allocate","id":1}"#],
        &[r#"{"op":"phase","name":"warmup","step":0}"#],
        &[r#"{"id":1}"#],
        &["{}"],
        &["[]"],
        &[alloc, alloc],
        &[alloc, r#"{"op":"free","id":2}"#],
        &[alloc, r#"{"op":"free","id":1}"#, r#"{"op":"free","id":1}"#],
        &[alloc, r#"{"op":"free","id":1}"#, r#"{"op":"use","id":1}"#],
        &[r#"{"op":"use","id":7}"#],
    ];
    for body in invalid {
        let e = check(body).unwrap_err();
        assert!(e.starts_with("t.jsonl:"), "{e}");
    }
}

#[test]
fn long_traces_cross_buffer_boundaries_the_same_way() {
    // Lines of many lengths, so that some straddle every read buffer edge.
    let mut w = TraceWriter::new(Vec::new(), "w", &TraceHeader::default()).unwrap();
    let kinds = TensorKind::ALL;
    for id in 1..40_000u64 {
        w.write(&Event::Alloc {
            id,
            bytes: id * 7919,
            kind: kinds[id as usize % kinds.len()],
            stream: (id % 5) as u32,
            t_us: id.is_multiple_of(3).then_some(id * id),
        })
        .unwrap();
        w.write(&Event::Use { id, stream: id.is_multiple_of(2).then_some(1) }).unwrap();
        if id.is_multiple_of(1000) {
            w.write(&Event::Phase { phase: Phase::StepEnd, step: id }).unwrap();
        }
        w.write(&Event::Free { id, t_us: None }).unwrap();
    }
    let bytes = w.finish().unwrap();
    let fast = read_bytes(&bytes, true).unwrap();
    assert_eq!(fast, read_bytes(&bytes, false).unwrap());
    assert_eq!(fast.1.len(), 39_999 * 3 + 39);
}
