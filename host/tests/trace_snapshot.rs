//! PyTorch snapshot import and export: the shared samples (skipped with a
//! message when `../../shared/traces` is absent), round trips, and errors.

use std::path::PathBuf;

use rustc_hash::FxHashMap;
use serde_json::json;
use wasmem::trace::snapshot::export::{self, ExportInput};
use wasmem::trace::snapshot::{self, ImportOptions, Snapshot};
use wasmem::trace::{self, Event, TraceWriter};
use wasmem::types::{TensorKind, GIB};

fn traces_dir() -> Option<PathBuf> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/traces");
    if dir.is_dir() {
        Some(dir)
    } else {
        eprintln!("skipping: {} does not exist", dir.display());
        None
    }
}

/// Checks that the events are a valid v1 stream (the writer validates) and
/// returns (allocs, frees, live tensors at the end, live bytes at the end).
fn check_valid(events: &[Event]) -> (usize, usize, usize, u64) {
    let mut w = TraceWriter::new(std::io::sink(), "check", &Default::default()).unwrap();
    let mut live = FxHashMap::default();
    let (mut allocs, mut frees) = (0, 0);
    for e in events {
        w.write(e).unwrap();
        match *e {
            Event::Alloc { id, bytes, .. } => {
                allocs += 1;
                assert!(live.insert(id, bytes).is_none());
            }
            Event::Free { id, .. } => {
                frees += 1;
                live.remove(&id).expect("every free matches a live id");
            }
            _ => {}
        }
    }
    (allocs, frees, live.len(), live.values().sum())
}

/// The event stream with ids renumbered by first appearance, so that two
/// imports of the same allocations compare equal.
fn normalized(events: &[Event]) -> Vec<Event> {
    let mut ids = FxHashMap::default();
    let mut id_of = |id: u64| {
        let n = ids.len() as u64;
        *ids.entry(id).or_insert(n)
    };
    events
        .iter()
        .filter_map(|e| match *e {
            Event::Alloc { id, bytes, kind, stream, t_us } => {
                Some(Event::Alloc { id: id_of(id), bytes, kind, stream, t_us })
            }
            Event::Free { id, t_us } => Some(Event::Free { id: id_of(id), t_us }),
            _ => None,
        })
        .collect()
}

fn import(bytes: &[u8]) -> Snapshot {
    snapshot::import_bytes(bytes, "mem.pickle", &ImportOptions::default()).unwrap()
}

fn export_import(events: &[Event]) -> Snapshot {
    let input = ExportInput::one_segment_per_tensor(events, 0);
    import(&export::export_bytes(&input).unwrap())
}

#[test]
fn sample_a_imports() {
    let Some(dir) = traces_dir() else { return };
    let s = snapshot::import_file(dir.join("pytorch-snapshot-a.pickle"), &Default::default()).unwrap();
    let i = &s.info;
    assert_eq!((i.device, i.segments, i.entries), (0, 216, 5163));
    assert_eq!(i.pytorch_reserved_bytes_end, 14_180_941_824);
    assert_eq!((i.pytorch_reserved_bytes_end as f64 / GIB as f64 * 10.0).round() / 10.0, 13.2);
    // No segment_* entries in this sample: the peak is the end value.
    assert_eq!(i.pytorch_peak_reserved_bytes, i.pytorch_reserved_bytes_end);
    // 2 blocks freed in the window without an alloc, 227 active at the end
    // without one.
    assert_eq!(i.synthesized_allocs, 2 + 227);
    assert_eq!((i.skipped_entries, i.anomalies), (1721, 0));
    assert_eq!(i.streams, vec![(0, 0)]);
    let (allocs, frees, live, _) = check_valid(&s.events);
    assert_eq!((allocs, frees, live), (1721 + 229, 1721, 229));
    assert!(s.header.source.contains("pytorch-snapshot-a.pickle"));
    assert!(s.events.iter().all(|e| !matches!(e, Event::Alloc { kind, .. } if *kind != TensorKind::Other)));
}

#[test]
fn sample_b_imports() {
    let Some(dir) = traces_dir() else { return };
    let s = snapshot::import_file(dir.join("pytorch-snapshot-b.pickle"), &Default::default()).unwrap();
    let i = &s.info;
    assert_eq!((i.segments, i.entries), (96, 6486));
    assert_eq!((i.pytorch_reserved_bytes_end as f64 / GIB as f64 * 100.0).round() / 100.0, 3.95);
    assert_eq!(i.synthesized_allocs, 222 + 225);
    let (allocs, frees, live, _) = check_valid(&s.events);
    assert_eq!((allocs, frees, live), (2162 + 447, 2162, 447));
    // Events from the window carry PyTorch's timestamps, synthesized ones none.
    assert!(matches!(s.events[0], Event::Alloc { t_us: None, .. }));
    assert!(matches!(s.events.last(), Some(Event::Free { t_us: Some(1_773_270_053_909_604), .. })));
}

#[test]
fn samples_survive_export_and_import() {
    let Some(dir) = traces_dir() else { return };
    for name in ["pytorch-snapshot-a.pickle", "pytorch-snapshot-b.pickle"] {
        let s = snapshot::import_file(dir.join(name), &Default::default()).unwrap();
        let again = export_import(&s.events);
        // Synthesized allocs (no t_us) come back as allocs in the window at
        // the same place; the exporter stamps them with their index.
        let strip = |ev: Vec<Event>| -> Vec<Event> {
            ev.into_iter()
                .map(|e| match e {
                    Event::Alloc { id, bytes, kind, stream, .. } => {
                        Event::Alloc { id, bytes, kind, stream, t_us: None }
                    }
                    e => e,
                })
                .collect()
        };
        assert_eq!(strip(normalized(&again.events)), strip(normalized(&s.events)), "{name}");
        assert_eq!(again.info.synthesized_allocs, 0);
    }
}

#[test]
fn shared_trace_round_trips_through_a_snapshot() {
    let Some(dir) = traces_dir() else { return };
    let (_, events) = trace::read_file(dir.join("gpt2_124m.jsonl.gz")).unwrap();
    let s = export_import(&events);
    // Kinds survive through the `wasmem kind=` frame; t_us is the event index.
    let with_index: Vec<Event> = events
        .iter()
        .enumerate()
        .map(|(i, e)| match *e {
            Event::Alloc { id, bytes, kind, stream, t_us } => {
                Event::Alloc { id, bytes, kind, stream, t_us: t_us.or(Some(i as u64)) }
            }
            Event::Free { id, t_us } => Event::Free { id, t_us: t_us.or(Some(i as u64)) },
            e => e,
        })
        .collect();
    assert_eq!(normalized(&s.events), normalized(&with_index));
    assert_eq!(s.info.synthesized_allocs, 0);
    check_valid(&s.events);

    // PyTorch's figures describe the exported layout (one segment per
    // tensor, rounded to 512 bytes): reserved at the peak and at the end.
    let mut live = FxHashMap::default();
    let (mut cur, mut peak) = (0u64, 0u64);
    for e in &events {
        match *e {
            Event::Alloc { id, bytes, .. } => {
                let r = bytes.max(1).div_ceil(512) * 512;
                live.insert(id, r);
                cur += r;
                peak = peak.max(cur);
            }
            Event::Free { id, .. } => cur -= live.remove(&id).unwrap(),
            _ => {}
        }
    }
    assert_eq!(s.info.pytorch_peak_reserved_bytes, peak);
    assert_eq!(s.info.pytorch_reserved_bytes_end, cur);
    assert_eq!(s.info.segments, live.len());
}

fn alloc(id: u64, bytes: u64, kind: TensorKind, stream: u32, t: u64) -> Event {
    Event::Alloc { id, bytes, kind, stream, t_us: Some(t) }
}

#[test]
fn export_import_round_trips_a_small_stream() {
    let events = vec![
        alloc(10, 1, TensorKind::Param, 0, 1),
        alloc(11, 3 << 20, TensorKind::Activation, 7, 2),
        Event::Use { id: 11, stream: Some(3) },
        Event::Free { id: 11, t_us: Some(3) },
        alloc(12, u64::MAX / 4, TensorKind::Optim, u32::MAX, 4),
        Event::Free { id: 10, t_us: Some(5) },
    ];
    let s = export_import(&events);
    let expect: Vec<Event> = events.iter().copied().filter(|e| !matches!(e, Event::Use { .. })).collect();
    assert_eq!(normalized(&s.events), normalized(&expect));
    let mut streams = s.info.streams.clone();
    streams.sort_unstable();
    assert_eq!(streams, vec![(0, 0), (7, 7), (u64::from(u32::MAX), u32::MAX)]);
    // The live tensor is the final state's only active block.
    assert_eq!(s.info.segments, 1);
    assert_eq!(s.info.pytorch_allocated_bytes_end, u64::MAX / 4 + 1);
}

#[test]
fn export_shape_and_devices() {
    let events = vec![alloc(1, 100, TensorKind::Grad, 0, 5)];
    let input = ExportInput::one_segment_per_tensor(&events, 2);
    let bytes = export::export_bytes(&input).unwrap();
    let v: serde_pickle::Value = serde_pickle::value_from_slice(&bytes, serde_pickle::DeOptions::new()).unwrap();
    let text = format!("{v:?}");
    for key in [
        "segments",
        "device_traces",
        "allocator_settings",
        "segment_pool_id",
        "active_allocated",
        "segment_alloc",
        "wasmem kind=grad",
        "is_expandable",
        "roundup_power2_divisions",
    ] {
        assert!(text.contains(key), "{key} missing from {text}");
    }
    let s = snapshot::import_bytes(&bytes, "dev.pickle", &ImportOptions { device: 2, ..Default::default() }).unwrap();
    assert_eq!(s.info.device, 2);
    assert_eq!(s.events.len(), 1);
    let e = snapshot::import_bytes(&bytes, "dev.pickle", &ImportOptions::default()).unwrap_err();
    assert_eq!(e.to_string(), "dev.pickle: device 0 is not in the snapshot (devices present: 2)");
}

/// Pickles a JSON value (dicts, lists, ints, strings) with serde_pickle.
fn pk(v: serde_json::Value) -> Vec<u8> {
    serde_pickle::to_vec(&v, serde_pickle::SerOptions::new()).unwrap()
}

fn import_err(v: serde_json::Value) -> String {
    snapshot::import_bytes(&pk(v), "x.pickle", &ImportOptions::default()).unwrap_err().to_string()
}

#[test]
fn import_errors() {
    assert_eq!(
        import_err(json!(5)),
        "x.pickle: not a PyTorch memory snapshot: the top level should be a dict, found int"
    );
    assert_eq!(
        import_err(json!({"a": 1})),
        "x.pickle: not a PyTorch memory snapshot: \
         the top-level dict has neither `segments` nor `device_traces`"
    );
    assert_eq!(import_err(json!({"segments": 3})), "x.pickle: `segments` should be a list, found int");
    assert_eq!(
        import_err(json!({"segments": [{"address": 0, "total_size": "big"}]})),
        "x.pickle: `segments[0].total_size` should be a non-negative integer below 2**63, found str"
    );
    assert_eq!(
        import_err(json!({"segments": [{"address": 0}]})),
        "x.pickle: `segments[0]` is missing key `total_size`"
    );
    assert_eq!(
        import_err(json!({"segments": [{"address": 0, "total_size": 512, "blocks": [{"state": "inactive"}]}]})),
        "x.pickle: `segments[0].blocks[0]` is missing key `size`"
    );
    assert_eq!(
        import_err(json!({"device_traces": [[{"action": "alloc", "addr": -1, "size": 1}]]})),
        "x.pickle: `device_traces[0][0].addr` should be a non-negative integer below 2**63, found int"
    );
    assert_eq!(
        import_err(json!({"device_traces": [[{"addr": 1}]]})),
        "x.pickle: `device_traces[0][0]` is missing key `action`"
    );
    assert_eq!(
        import_err(json!({"device_traces": [[7]]})),
        "x.pickle: `device_traces[0][0]` should be a dict, found int"
    );
    assert_eq!(
        snapshot::import_bytes(b"\x80\x04K", "x.pickle", &Default::default()).unwrap_err().to_string(),
        "x.pickle: malformed pickle at byte 2: truncated input"
    );
    let e = snapshot::import_file("/nonexistent.pickle", &Default::default()).unwrap_err();
    assert!(e.to_string().starts_with("/nonexistent.pickle: read error: "), "{e}");
}

/// The error of importing raw pickle bytes.
fn raw_err(bytes: &[u8]) -> String {
    snapshot::import_bytes(bytes, "x.pickle", &ImportOptions::default()).unwrap_err().to_string()
}

#[test]
fn wrong_types_are_named_as_found() {
    // Every container where the other kind is expected, at each level.
    let cases = [
        (json!({"segments": [[1]]}), "`segments[0]` should be a dict, found list"),
        (
            json!({"segments": [{"address": 0, "total_size": 8, "blocks": {"a": 1}}]}),
            "`segments[0].blocks` should be a list, found dict",
        ),
        (
            json!({"segments": [{"address": 0, "total_size": 8, "blocks": [[]]}]}),
            "`segments[0].blocks[0]` should be a dict, found list",
        ),
        (json!({"device_traces": {"0": []}}), "`device_traces` should be a list, found dict"),
        (json!({"device_traces": [{"a": 1}]}), "`device_traces[0]` should be a list, found dict"),
        (json!({"device_traces": [[[]]]}), "`device_traces[0][0]` should be a dict, found list"),
        (json!({"device_traces": [[{"action": {}}]]}), "`device_traces[0][0].action` should be a str, found dict"),
        (
            json!({"device_traces": [[{"action": "alloc", "addr": [], "size": 1}]]}),
            "`device_traces[0][0].addr` should be a non-negative integer below 2**63, found list",
        ),
        // A list under a key that the parse does not keep elsewhere.
        (
            json!({"segments": [{"address": 0, "total_size": 8, "blocks": [{"size": 8, "state": []}]}]}),
            "`segments[0].blocks[0].state` should be a str, found list",
        ),
    ];
    for (v, want) in cases {
        assert_eq!(import_err(v), format!("x.pickle: {want}"));
    }

    // Objects (built by a class the reader never calls) are named by their
    // class, and read as a list or a dict only when they are one.
    // pickle.dumps({"segments": [collections.deque([1])]}, protocol=4)
    let deque = b"\x80\x04\x950\x00\x00\x00\x00\x00\x00\x00}\x94\x8c\x08segments\x94]\x94\x8c\x0bcollections\x94\x8c\x05deque\x94\x93\x94)R\x94K\x01aas.";
    assert_eq!(raw_err(deque), "x.pickle: `segments[0]` should be a dict, found collections.deque object");
    // {"segments": [mymod.Foo()]}: an empty object of another class is no
    // dict (it was once read as an empty one).
    let foo = b"\x80\x02}q\x00X\x08\x00\x00\x00segmentsq\x01]q\x02cmymod\nFoo\nq\x03)Rq\x04as.";
    assert_eq!(raw_err(foo), "x.pickle: `segments[0]` should be a dict, found mymod.Foo object");
    // pickle.dumps({1}, protocol=2) builds set([1]) by a call: read as the
    // set it is (a list of segments, in the oldest format), as protocol 4's
    // native set is, not as an empty dict.
    let set2 = b"\x80\x02c__builtin__\nset\nq\x00]q\x01K\x01a\x85q\x02Rq\x03.";
    let set4 = b"\x80\x04\x95\x07\x00\x00\x00\x00\x00\x00\x00\x8f\x94(K\x01\x90.";
    assert_eq!(raw_err(set2), "x.pickle: `segments[0]` should be a dict, found int");
    assert_eq!(raw_err(set4), raw_err(set2));
    // pickle.dumps(collections.OrderedDict(), protocol=2): an empty mapping.
    assert_eq!(
        raw_err(b"\x80\x02ccollections\nOrderedDict\nq\x00)Rq\x01."),
        "x.pickle: not a PyTorch memory snapshot: the top-level dict has neither `segments` nor `device_traces`"
    );
    // {"segments": [OrderedDict(address=0, total_size=8)]}, protocol 2: a dict.
    let od = b"\x80\x02}q\x00X\x08\x00\x00\x00segmentsq\x01]q\x02ccollections\nOrderedDict\nq\x03)Rq\x04(X\x07\x00\x00\x00addressq\x05K\x00X\n\x00\x00\x00total_sizeq\x06K\x08uas.";
    let s = snapshot::import_bytes(od, "x.pickle", &ImportOptions::default()).unwrap();
    assert_eq!((s.info.segments, s.info.pytorch_reserved_bytes_end), (1, 8));
}

#[test]
fn import_tolerates_old_and_odd_shapes() {
    // A bare list of segments (very old format), blocks without addresses.
    let s = import(&pk(json!([
        {"address": 4096, "total_size": 2048, "blocks": [
            {"size": 1024, "state": "active_allocated"},
            {"size": 512, "state": "inactive"},
            {"size": 512, "state": "active_pending_free", "requested_size": 100}
        ]}
    ])));
    assert_eq!(s.info.synthesized_allocs, 2);
    assert_eq!(
        s.events,
        vec![
            Event::Alloc { id: 1, bytes: 1024, kind: TensorKind::Other, stream: 0, t_us: None },
            Event::Alloc { id: 2, bytes: 100, kind: TensorKind::Other, stream: 0, t_us: None },
        ]
    );

    // Unknown actions are skipped; an alloc at a live address frees the old
    // id first; free_requested does not end a life; huge stream handles are
    // renumbered; segment entries drive the peak.
    let s = import(&pk(json!({
        "segments": [{"address": 0, "total_size": 4096, "stream": 140000000000001u64,
                      "blocks": [{"address": 0, "size": 4096, "state": "active_allocated"}]}],
        "device_traces": [[
            {"action": "segment_alloc", "addr": 8192, "size": 1048576, "stream": 0},
            {"action": "oom", "addr": 0, "size": 0},
            {"action": "alloc", "addr": 8192, "size": 10, "stream": 140000000000002u64, "time_us": 1},
            {"action": "free_requested", "addr": 8192, "size": 10, "stream": 0, "time_us": 2},
            {"action": "alloc", "addr": 8192, "size": 20, "stream": 0, "time_us": 3},
            {"action": "free_completed", "addr": 8192, "size": 20, "stream": 0, "time_us": 4},
            {"action": "segment_free", "addr": 8192, "size": 1048576, "stream": 0},
            {"action": "something_new", "addr": 8192}
        ]],
        "allocator_settings": {"whatever": [1, 2]},
        "external_annotations": []
    })));
    assert_eq!(s.info.anomalies, 1);
    assert_eq!(s.info.skipped_entries, 5);
    assert_eq!(s.info.pytorch_reserved_bytes_end, 4096);
    assert_eq!(s.info.pytorch_peak_reserved_bytes, 4096 + 1048576);
    assert_eq!(s.info.streams, vec![(0, 0), (140000000000001, 2), (140000000000002, 1)]);
    let (allocs, frees, live, live_bytes) = check_valid(&s.events);
    assert_eq!((allocs, frees, live, live_bytes), (3, 2, 1, 4096));
}

/// Writes exported snapshots for a check with PyTorch's own tools:
/// `cargo test --release -p wasmem --test trace_snapshot -- --ignored`, then
/// `python -m torch.cuda._memory_viz trace_plot $TMP/wasmem-export/gpt2.pickle -o gpt2.html`.
#[test]
#[ignore = "writes files for a manual check with torch.cuda._memory_viz"]
fn write_exports_for_pytorch() {
    let Some(dir) = traces_dir() else { return };
    let out = std::env::temp_dir().join("wasmem-export");
    std::fs::create_dir_all(&out).unwrap();
    let (_, events) = trace::read_file(dir.join("gpt2_124m.jsonl.gz")).unwrap();
    let input = ExportInput::one_segment_per_tensor(&events, 0);
    export::export_file(out.join("gpt2.pickle"), &input).unwrap();
    let s = snapshot::import_file(dir.join("pytorch-snapshot-b.pickle"), &Default::default()).unwrap();
    let input = ExportInput::one_segment_per_tensor(&s.events, 0);
    export::export_file(out.join("snapshot-b-reexported.pickle"), &input).unwrap();
    println!("wrote {}", out.display());
}

fn data_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/data")
}

/// A 60-entry cut of a real snapshot (frames replaced), committed in
/// `tests/data`, so this runs without the shared folder.
#[test]
fn tiny_snapshot_imports() {
    let s = snapshot::import_file(data_dir().join("tiny-snapshot.pickle"), &Default::default()).unwrap();
    let i = &s.info;
    assert_eq!((i.segments, i.entries), (7, 60));
    assert_eq!(i.pytorch_reserved_bytes_end, 320_864_256);
    assert_eq!(i.pytorch_allocated_bytes_end, 155_512_832);
    // The cut's final segments hold 100 active blocks with no alloc among
    // the 60 entries kept.
    assert_eq!(i.synthesized_allocs, 100);
    assert_eq!((i.skipped_entries, i.anomalies), (6, 0));
    let (allocs, frees, live, _) = check_valid(&s.events);
    assert_eq!((allocs, frees, live), (148, 6, 142));
}

#[test]
fn tiny_trace_reads() {
    let (h, events) = trace::read_file(data_dir().join("tiny.jsonl")).unwrap();
    assert_eq!(h.source, "tiny hand-written trace");
    assert_eq!(events.len(), 15);
    let (allocs, frees, live, bytes) = check_valid(&events);
    assert_eq!((allocs, frees, live, bytes), (6, 3, 3, 4096 + 8192 + 1));
}

#[test]
fn export_checks_block_tiling() {
    use export::{BlockState, ExportBlock, ExportSegment};
    let seg = |blocks: Vec<ExportBlock>| ExportInput {
        device: 0,
        segments: vec![ExportSegment { address: 1 << 20, total_size: 4096, stream: 0, blocks }],
        trace: Vec::new(),
    };
    let block = |address: u64, size: u64| ExportBlock {
        address,
        size,
        requested_size: size,
        state: BlockState::ActiveAllocated,
        kind: None,
    };
    assert!(export::export_bytes(&seg(vec![block(1 << 20, 1024), block((1 << 20) + 1024, 3072)])).is_ok());
    assert_eq!(
        export::export_bytes(&seg(vec![block(1 << 20, 1024), block((1 << 20) + 2048, 2048)])).unwrap_err().to_string(),
        "invalid export input: segments[0].blocks[1] starts at 0x100800, expected 0x100400 \
         (blocks must tile their segment in address order)"
    );
    assert_eq!(
        export::export_bytes(&seg(vec![block(1 << 20, 1024)])).unwrap_err().to_string(),
        "invalid export input: the blocks of segments[0] end at 0x100400, the segment at 0x101000"
    );
    let mut far = seg(Vec::new());
    far.device = u32::MAX;
    assert_eq!(
        export::export_bytes(&far).unwrap_err().to_string(),
        "invalid export input: device 4294967295 is not below 1024"
    );
}
