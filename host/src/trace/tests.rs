//! Unit tests of the reader and writer: every error message, exactly as users
//! see it, and round trips.

use super::*;
use crate::types::{Phase, TensorKind};

const HEADER: &str = r#"{"format":"wasmem-trace","version":1,"source":"unit","ranks":2}"#;

fn read_str(text: &str) -> Result<(TraceHeader, Vec<Event>), TraceError> {
    let reader = TraceReader::new(text.as_bytes(), "t.jsonl")?;
    let header = reader.header().clone();
    let events = reader.collect::<Result<Vec<_>, _>>()?;
    Ok((header, events))
}

/// The error text for a trace made of the header and `body`.
fn err_of(body: &str) -> String {
    let text = format!("{HEADER}\n{body}");
    read_str(&text).expect_err("trace should be rejected").to_string()
}

#[test]
fn reads_a_small_trace() {
    let text = format!(
        "{HEADER}\n\
         {{\"op\":\"alloc\",\"id\":1,\"bytes\":100,\"kind\":\"param\"}}\n\
         \n\
         {{\"op\":\"alloc\",\"id\":2,\"bytes\":8,\"kind\":\"temp\",\"stream\":3,\"t_us\":7,\"extra\":[1,{{\"x\":null}}]}}\r\n\
         {{\"op\":\"use\",\"id\":2}}\n\
         {{\"op\":\"use\",\"id\":1,\"stream\":3}}\n\
         {{\"op\":\"phase\",\"name\":\"step_end\",\"step\":4}}\n\
         {{\"op\":\"free\",\"id\":2,\"t_us\":9}}\n\
         {{\"op\":\"free\",\"id\":1,\"t_us\":null}}"
    );
    let (header, events) = read_str(&text).unwrap();
    assert_eq!(header, TraceHeader { source: "unit".into(), ranks: 2 });
    assert_eq!(
        events,
        vec![
            Event::Alloc { id: 1, bytes: 100, kind: TensorKind::Param, stream: 0, t_us: None },
            Event::Alloc { id: 2, bytes: 8, kind: TensorKind::Temp, stream: 3, t_us: Some(7) },
            Event::Use { id: 2, stream: None },
            Event::Use { id: 1, stream: Some(3) },
            Event::Phase { phase: Phase::StepEnd, step: 4 },
            Event::Free { id: 2, t_us: Some(9) },
            Event::Free { id: 1, t_us: None },
        ]
    );
}

#[test]
fn header_defaults_and_escapes() {
    let (h, ev) = read_str("{\"version\":1,\"format\":\"wasmem-trace\"}\n").unwrap();
    assert_eq!(h, TraceHeader::default());
    assert!(ev.is_empty());
    let (h, _) = read_str(r#"{"format":"wasmem-trace","version":1,"source":"a \"q\" \u00e9\n"}"#).unwrap();
    assert_eq!(h.source, "a \"q\" é\n");
}

#[test]
fn header_errors() {
    let e = |t: &str| read_str(t).unwrap_err().to_string();
    assert_eq!(e(""), "t.jsonl:1: empty trace: missing header line");
    assert_eq!(e("\n  \n"), "t.jsonl:2: empty trace: missing header line");
    assert_eq!(
        e(r#"{"op":"alloc","id":1,"bytes":1,"kind":"param"}"#),
        "t.jsonl:1: missing header: the first line must be \
         {\"format\":\"wasmem-trace\",\"version\":1,\"source\":\"...\",\"ranks\":1}"
    );
    assert_eq!(
        e(r#"{"format":"other","version":1}"#),
        "t.jsonl:1: header field `format` is `other`, expected `wasmem-trace`"
    );
    assert_eq!(
        e(r#"{"format":"wasmem-trace","version":2}"#),
        "t.jsonl:1: unsupported trace version 2 (this reader supports version 1)"
    );
    assert_eq!(e(r#"{"format":"wasmem-trace"}"#), "t.jsonl:1: header is missing field `version`");
    assert_eq!(
        e(r#"{"format":"wasmem-trace","version":"1"}"#),
        "t.jsonl:1: field `version`: invalid type: string \"1\", expected u64"
    );
    assert_eq!(
        e(r#"{"format":"wasmem-trace","version":1,"ranks":-1}"#),
        "t.jsonl:1: field `ranks`: invalid value: integer `-1`, expected u32"
    );
    assert_eq!(
        e("{\"format\":\"wasmem-trace\",\"version\":1"),
        "t.jsonl:1: malformed JSON at column 36: EOF while parsing an object"
    );
    assert_eq!(e("[1,2]"), "t.jsonl:1: malformed JSON: invalid type: sequence, expected a JSON object");
}

#[test]
fn event_errors() {
    assert_eq!(
        err_of(r#"{"op":"alloc","id":1,"bytes":1,"kind":"param"} x"#),
        "t.jsonl:2: malformed JSON at column 48: trailing characters"
    );
    assert_eq!(
        err_of(r#"{"op":"alloc","id":1,"bytes":1,"kind":"param""#),
        "t.jsonl:2: malformed JSON at column 45: EOF while parsing an object"
    );
    assert_eq!(
        err_of("{\"op\":\"alloc\",\"id\":1,\"bytes\":1,\"kind\":\"param\"}\n{\"op\":\"frea\",\"id\":1}"),
        "t.jsonl:3: unknown op `frea` (expected alloc, free, use or phase)"
    );
    assert_eq!(err_of(r#"{"id":1}"#), "t.jsonl:2: event is missing field `op`");
    assert_eq!(err_of(r#"{"op":"alloc","id":1,"kind":"param"}"#), "t.jsonl:2: `alloc` event is missing field `bytes`");
    assert_eq!(err_of(r#"{"op":"alloc","bytes":1,"kind":"param"}"#), "t.jsonl:2: `alloc` event is missing field `id`");
    assert_eq!(err_of(r#"{"op":"alloc","id":1,"bytes":1}"#), "t.jsonl:2: `alloc` event is missing field `kind`");
    assert_eq!(err_of(r#"{"op":"free"}"#), "t.jsonl:2: `free` event is missing field `id`");
    assert_eq!(err_of(r#"{"op":"use","stream":1}"#), "t.jsonl:2: `use` event is missing field `id`");
    assert_eq!(err_of(r#"{"op":"phase","step":1}"#), "t.jsonl:2: `phase` event is missing field `name`");
    assert_eq!(err_of(r#"{"op":"phase","name":"forward"}"#), "t.jsonl:2: `phase` event is missing field `step`");
    assert_eq!(
        err_of(r#"{"op":"alloc","id":"1","bytes":1,"kind":"param"}"#),
        "t.jsonl:2: field `id`: invalid type: string \"1\", expected u64"
    );
    assert_eq!(
        err_of(r#"{"op":"alloc","id":1,"bytes":-5,"kind":"param"}"#),
        "t.jsonl:2: field `bytes`: invalid value: integer `-5`, expected u64"
    );
    assert_eq!(
        err_of(r#"{"op":"alloc","id":1,"bytes":1.5,"kind":"param"}"#),
        "t.jsonl:2: field `bytes`: invalid type: floating point `1.5`, expected u64"
    );
    assert_eq!(
        err_of(r#"{"op":"alloc","id":1,"bytes":1,"kind":"param","stream":4294967296}"#),
        "t.jsonl:2: field `stream`: invalid value: integer `4294967296`, expected u32"
    );
    assert_eq!(err_of(r#"{"op":7}"#), "t.jsonl:2: field `op`: invalid type: integer `7`, expected a string");
    assert_eq!(
        err_of(r#"{"op":"alloc","id":1,"bytes":1,"kind":["param"]}"#),
        "t.jsonl:2: field `kind`: invalid type: sequence, expected a string"
    );
    assert_eq!(
        err_of(r#"{"op":"free","id":1,"t_us":"now"}"#),
        "t.jsonl:2: field `t_us`: invalid type: string \"now\", expected u64"
    );
    assert_eq!(
        err_of(r#"{"op":"phase","name":"forward","step":true}"#),
        "t.jsonl:2: field `step`: invalid type: boolean `true`, expected u64"
    );
    assert_eq!(err_of(r#"{"op":"free","id":1,"id":2}"#), "t.jsonl:2: duplicate field `id`");
    assert_eq!(
        err_of(r#"{"op":"alloc","id":1,"bytes":1,"kind":"weights"}"#),
        "t.jsonl:2: field `kind`: unknown tensor kind `weights` \
         (expected param, grad, optim, activation, temp or other)"
    );
    assert_eq!(
        err_of(r#"{"op":"phase","name":"warmup","step":0}"#),
        "t.jsonl:2: field `name`: unknown phase `warmup` \
         (expected forward, backward, optimizer or step_end)"
    );
    assert_eq!(err_of("\u{1}"), "t.jsonl:2: malformed JSON at column 1: expected value");
}

#[test]
fn id_errors() {
    let alloc = |id: u64| format!(r#"{{"op":"alloc","id":{id},"bytes":16,"kind":"temp"}}"#);
    let free = |id: u64| format!(r#"{{"op":"free","id":{id}}}"#);
    let use_ = |id: u64| format!(r#"{{"op":"use","id":{id}}}"#);
    assert_eq!(
        err_of(&[alloc(1), alloc(1)].join("\n")),
        "t.jsonl:3: alloc of id 1, which was already used (ids are never reused)"
    );
    assert_eq!(
        err_of(&[alloc(1), free(1), alloc(1)].join("\n")),
        "t.jsonl:4: alloc of id 1, which was already used (ids are never reused)"
    );
    assert_eq!(err_of(&free(9)), "t.jsonl:2: free of unknown id 9");
    assert_eq!(err_of(&[alloc(1), free(1), free(1)].join("\n")), "t.jsonl:4: double free of id 1");
    assert_eq!(err_of(&use_(3)), "t.jsonl:2: use of unknown id 3");
    assert_eq!(err_of(&[alloc(3), free(3), use_(3)].join("\n")), "t.jsonl:4: use of id 3 after its free");
}

#[test]
fn long_lines_are_rejected() {
    let text = format!("{HEADER}\n{{\"op\":\"free\",\"id\":1,\"pad\":\"{}\"}}\n", "x".repeat(200));
    let reader = TraceReader::with_options(text.as_bytes(), "t.jsonl", ReadOptions { max_line_len: 100 }).unwrap();
    let errs: Vec<_> = reader.collect();
    assert_eq!(errs.len(), 1, "the iterator stops after an error");
    assert_eq!(errs[0].as_ref().unwrap_err().to_string(), "t.jsonl:2: line is longer than 100 bytes");
    // The header line is held to the same limit.
    let e = TraceReader::with_options(text.as_bytes(), "t", ReadOptions { max_line_len: 10 }).unwrap_err();
    assert_eq!(e.to_string(), "t:1: line is longer than 10 bytes");
}

#[test]
fn write_then_read_round_trips() {
    let header = TraceHeader { source: "round \"trip\"\n\u{1F600}".into(), ranks: 8 };
    let mut events = Vec::new();
    for (i, kind) in TensorKind::ALL.into_iter().enumerate() {
        let id = i as u64 * 3 + u64::from(i == 5) * (u64::MAX - 20);
        events.push(Event::Alloc {
            id,
            bytes: u64::MAX - i as u64,
            kind,
            stream: i as u32 * 1000,
            t_us: (i % 2 == 0).then_some(i as u64),
        });
        events.push(Event::Use { id, stream: (i % 3 == 0).then_some(u32::MAX) });
    }
    for (i, phase) in Phase::ALL.into_iter().enumerate() {
        events.push(Event::Phase { phase, step: u64::MAX - i as u64 });
    }
    events.push(Event::Free { id: 0, t_us: Some(u64::MAX) });
    events.push(Event::Free { id: 3, t_us: None });

    let mut w = TraceWriter::new(Vec::new(), "mem", &header).unwrap();
    for e in &events {
        w.write(e).unwrap();
    }
    assert_eq!(w.lines_written(), events.len() as u64 + 1);
    let bytes = w.finish().unwrap();
    let text = String::from_utf8(bytes).unwrap();
    assert!(text.starts_with(
        "{\"format\":\"wasmem-trace\",\"version\":1,\"source\":\"round \\\"trip\\\"\\n\u{1F600}\",\"ranks\":8}\n"
    ));
    assert!(text.contains(
        "\n{\"op\":\"alloc\",\"id\":0,\"bytes\":18446744073709551615,\"kind\":\"param\",\"stream\":0,\"t_us\":0}\n"
    ));
    assert!(text.contains("\n{\"op\":\"free\",\"id\":3}\n"));
    assert!(text.contains("\n{\"op\":\"phase\",\"name\":\"step_end\",\"step\":18446744073709551612}\n"));
    let (h2, e2) = read_str(&text).unwrap();
    assert_eq!(h2, header);
    assert_eq!(e2, events);

    // Files, plain and gzip.
    let dir = std::env::temp_dir().join(format!("wasmem-trace-unit-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for name in ["t.jsonl", "t.jsonl.gz"] {
        let path = dir.join(name);
        write_file(&path, &header, &events).unwrap();
        let raw = std::fs::read(&path).unwrap();
        assert_eq!(raw.starts_with(&[0x1f, 0x8b]), name.ends_with(".gz"));
        let (h3, e3) = read_file(&path).unwrap();
        assert_eq!((h3, e3), (header.clone(), events.clone()));
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn writer_rejects_invalid_events() {
    let mut w = TraceWriter::new(Vec::new(), "out.jsonl", &TraceHeader::default()).unwrap();
    let e = w.write(&Event::Free { id: 4, t_us: None }).unwrap_err();
    assert_eq!(e.to_string(), "out.jsonl:2: free of unknown id 4");
    w.write(&Event::Alloc { id: 4, bytes: 1, kind: TensorKind::Other, stream: 0, t_us: None }).unwrap();
    let e = w.write(&Event::Alloc { id: 4, bytes: 1, kind: TensorKind::Other, stream: 0, t_us: None }).unwrap_err();
    assert_eq!(e.to_string(), "out.jsonl:3: alloc of id 4, which was already used (ids are never reused)");
    let text = String::from_utf8(w.finish().unwrap()).unwrap();
    assert_eq!(text.lines().count(), 2, "rejected events are not written");
}

#[test]
fn open_errors_name_the_file() {
    let e = TraceReader::open("/nonexistent/x.jsonl").unwrap_err();
    assert!(e.to_string().starts_with("/nonexistent/x.jsonl:0: read error: "), "{e}");
    let dir = std::env::temp_dir().join(format!("wasmem-trace-gz-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("bad.jsonl.gz");
    std::fs::write(&path, [0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 3, 1, 2, 3]).unwrap();
    let e = TraceReader::open(&path).unwrap_err();
    assert!(e.to_string().contains(":1: read error: "), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}
