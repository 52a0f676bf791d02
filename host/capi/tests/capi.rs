//! The C ABI on the `sim` device, called as PyTorch would call it.
//!
//! The library keeps process-global state configured from the environment at
//! the first call, so everything runs in one `#[test]`, in order, after the
//! environment is set. Sim addresses are not host memory: pointers are
//! compared, never dereferenced.
//!
//! Every call that is wrong must be refused without a crash and logged; the
//! log of each refusal is counted under `errors` in the stats JSON, which is
//! what the checks below read.

use std::ffi::{c_void, CString};
use std::path::Path;

use serde_json::Value;
use wasmem::trace::{Event, TraceReader};
use wasmem::types::TensorKind;
use wasmem_capi::{check_state, wasmem_dump_trace, wasmem_free, wasmem_malloc, wasmem_stats_json, wasmem_swap_policy};

const MIB: isize = 1 << 20;

fn stats() -> Value {
    // SAFETY: null asks for the length only.
    let n = unsafe { wasmem_stats_json(std::ptr::null_mut(), 0) };
    assert!(n > 0, "stats length {n}");
    let mut buf = vec![0u8; n as usize + 1];
    // SAFETY: `buf` has `buf.len()` writable bytes.
    let m = unsafe { wasmem_stats_json(buf.as_mut_ptr().cast(), buf.len()) };
    assert!(m >= 0 && (m as usize) < buf.len(), "stats grew from {n} to {m}");
    assert_eq!(buf[m as usize], 0, "NUL-terminated");
    serde_json::from_slice(&buf[..m as usize]).expect("stats are JSON")
}

fn u(v: &Value, key: &str) -> u64 {
    v[key].as_u64().unwrap_or_else(|| panic!("`{key}` is not a number in {v}"))
}

fn errors(v: &Value, cause: &str) -> u64 {
    v["errors"][cause].as_u64().unwrap_or(0)
}

fn stream(s: usize) -> *mut c_void {
    s as *mut c_void
}

fn checked() {
    check_state().expect("state invariants");
}

fn dump(path: &Path) -> i32 {
    let c = CString::new(path.to_str().unwrap()).unwrap();
    // SAFETY: a valid C string.
    unsafe { wasmem_dump_trace(c.as_ptr()) }
}

fn swap(spec: &str) -> i32 {
    let c = CString::new(spec).unwrap();
    // SAFETY: a valid C string.
    unsafe { wasmem_swap_policy(c.as_ptr()) }
}

fn read_trace(path: &Path) -> (String, Vec<Event>) {
    let r = TraceReader::open(path).expect("the trace opens");
    let source = r.header().source.clone();
    (source, r.collect::<Result<Vec<_>, _>>().expect("the trace reads back"))
}

#[test]
fn c_abi_on_sim() {
    let dir = std::env::temp_dir().join(format!("wasmem-capi-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::env::set_var("WASMEM_DEVICE", "sim");
    std::env::set_var("WASMEM_SIM_CAPACITY", "1GiB");
    std::env::set_var("WASMEM_POLICY", "lifecycle");
    std::env::set_var("WASMEM_SIM_DEVICES", "1");
    // Written again at exit (checked in `exports.rs`); left in the temp dir.
    let at_exit = std::env::temp_dir().join(format!("wasmem-capi-test-{}.jsonl", std::process::id()));
    std::env::set_var("WASMEM_TRACE_OUT", &at_exit);

    // Before any allocation: valid stats, nothing open yet.
    let s = stats();
    assert_eq!(s["device"], "sim");
    assert_eq!(s["policy"], "lifecycle");
    assert_eq!(u(&s, "allocs"), 0);
    assert!(s["device_index"].is_null());
    checked();

    // A buffer too small gets an empty string and the needed length.
    let mut small = [b'x'; 8];
    // SAFETY: `small` has 8 writable bytes.
    let need = unsafe { wasmem_stats_json(small.as_mut_ptr().cast(), small.len()) };
    assert!(need as usize > small.len());
    assert_eq!(small[0], 0);
    assert_eq!(&small[1..], b"xxxxxxx", "nothing beyond the NUL is touched");

    // Allocations on two streams: distinct, aligned, non-null pointers.
    let sizes = [1isize, 512, 513, 4096, 3 * MIB, 40 * MIB];
    let mut ptrs = Vec::new();
    for (i, &size) in sizes.iter().enumerate() {
        let st = if i % 2 == 0 { 0 } else { 0x5000_1234 };
        let p = wasmem_malloc(size, 0, stream(st));
        assert!(!p.is_null(), "malloc({size}) failed");
        assert_eq!(p as usize % 512, 0, "512-byte aligned");
        ptrs.push((p, size, st));
        checked();
    }
    let mut addrs: Vec<usize> = ptrs.iter().map(|p| p.0 as usize).collect();
    addrs.sort_unstable();
    addrs.dedup();
    assert_eq!(addrs.len(), sizes.len(), "pointers are distinct");
    let s = stats();
    assert_eq!(u(&s, "allocs"), sizes.len() as u64);
    assert_eq!(u(&s, "live_pointers"), sizes.len() as u64);
    assert_eq!(u(&s, "streams"), 2);
    assert_eq!(s["device_index"], 0);
    let rounded: u64 = sizes.iter().map(|&b| (b as u64).div_ceil(512) * 512).sum();
    assert_eq!(u(&s, "live_bytes"), rounded, "live bytes count the 512-rounded requests");
    assert!(u(&s, "reserved_bytes") >= u(&s, "allocated_bytes"));

    // Free one, then free it again, then a foreign pointer: the last two are
    // refused and logged, nothing changes.
    let (p0, size0, st0) = ptrs.remove(0);
    wasmem_free(p0, size0, 0, stream(st0));
    checked();
    let after_free = stats();
    assert_eq!(u(&after_free, "frees"), 1);
    wasmem_free(p0, size0, 0, stream(st0));
    wasmem_free(0xdead_0000 as *mut c_void, 64, 0, stream(0));
    checked();
    let s = stats();
    assert_eq!(errors(&s, "unknown_pointer"), 2);
    for key in ["allocs", "frees", "live_bytes", "allocated_bytes", "reserved_bytes", "live_pointers"] {
        assert_eq!(u(&s, key), u(&after_free, key), "`{key}` changed by a refused free");
    }

    // Null free: a no-op, no error. Zero size: null, no error.
    wasmem_free(std::ptr::null_mut(), 0, 0, stream(0));
    assert!(wasmem_malloc(0, 0, stream(0)).is_null());
    let s = stats();
    assert_eq!(errors(&s, "unknown_pointer"), 2);
    assert_eq!(s["errors"].as_object().unwrap().values().map(|v| v.as_u64().unwrap()).sum::<u64>(), 2);
    assert_eq!(u(&s, "allocs"), u(&after_free, "allocs"));

    // Negative size, more than the device holds, another device: null, logged.
    assert!(wasmem_malloc(-1, 0, stream(0)).is_null());
    assert!(wasmem_malloc(isize::MIN, 0, stream(0)).is_null());
    assert!(wasmem_malloc(2048 * MIB, 0, stream(0)).is_null());
    assert!(wasmem_malloc(MIB, 1, stream(0)).is_null());
    assert!(wasmem_malloc(MIB, -1, stream(0)).is_null());
    checked();
    let s = stats();
    assert_eq!(errors(&s, "negative_size"), 2);
    assert_eq!(errors(&s, "out_of_memory"), 1);
    assert_eq!(u(&s, "ooms"), 1);
    assert_eq!(errors(&s, "wrong_device"), 2);
    assert_eq!(u(&s, "allocs"), u(&after_free, "allocs"), "refused requests allocate nothing");

    // Policy swap: a valid spec takes over, invalid ones leave it in place.
    assert_eq!(swap("pytorch"), 0);
    assert_eq!(stats()["policy"], "pytorch");
    let p = wasmem_malloc(5 * MIB, 0, stream(0));
    assert!(!p.is_null());
    ptrs.push((p, 5 * MIB, 0));
    assert_eq!(swap("no-such-policy"), -1);
    assert_eq!(swap("/nonexistent/policy.wasm"), -1);
    assert_eq!(swap(""), -1);
    // SAFETY: null is allowed and refused.
    assert_eq!(unsafe { wasmem_swap_policy(std::ptr::null()) }, -1);
    let s = stats();
    assert_eq!(s["policy"], "pytorch");
    assert_eq!(errors(&s, "policy"), 3);
    assert_eq!(errors(&s, "bad_argument"), 1);
    // A WebAssembly policy (built by policies/build.sh, as scripts/test.sh does).
    let wasm = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../policies/out/lifecycle.wasm");
    if wasm.is_file() {
        assert_eq!(swap(wasm.to_str().unwrap()), 0, "swap to {}", wasm.display());
        let before = u(&stats(), "policy_calls");
        let p = wasmem_malloc(7 * MIB, 0, stream(0));
        assert!(!p.is_null());
        wasmem_free(p, 7 * MIB, 0, stream(0));
        let s = stats();
        assert!(u(&s, "policy_calls") > before, "the WebAssembly policy was consulted: {s}");
        assert_eq!(u(&s, "policy_fallbacks"), 0);
    } else {
        eprintln!("skipped the WebAssembly swap: {} is not built (bash policies/build.sh)", wasm.display());
    }
    assert_eq!(swap(" lifecycle "), 0);
    assert_eq!(stats()["policy"], "lifecycle");
    checked();

    // Several threads at once, each on its own stream.
    std::thread::scope(|sc| {
        for t in 0..4usize {
            sc.spawn(move || {
                let mut mine = Vec::new();
                for i in 0..200isize {
                    let p = wasmem_malloc(1024 * (i % 17 + 1), 0, stream(0x7000 + t));
                    assert!(!p.is_null());
                    mine.push(p);
                    if i % 3 == 0 {
                        let q = mine.swap_remove(0);
                        wasmem_free(q, 0, 0, stream(0x7000 + t));
                    }
                }
                for q in mine {
                    wasmem_free(q, 0, 0, stream(0x7000 + t));
                }
            });
        }
    });
    checked();
    let s = stats();
    assert_eq!(u(&s, "streams"), 6);
    assert_eq!(u(&s, "live_pointers"), ptrs.len() as u64);
    assert_eq!(u(&s, "allocs") - u(&s, "frees"), ptrs.len() as u64);

    // The trace so far reads back: allocs and frees of the live pointers.
    let plain = dir.join("trace.jsonl");
    let gz = dir.join("trace.jsonl.gz");
    assert_eq!(dump(&plain), 0);
    assert_eq!(dump(&gz), 0);
    let (source, events) = read_trace(&plain);
    assert!(source.contains("wasmem-capi") && source.contains("sim:0"), "{source}");
    assert_eq!(read_trace(&gz).1, events);
    // SAFETY: null means the configured WASMEM_TRACE_OUT.
    assert_eq!(unsafe { wasmem_dump_trace(std::ptr::null()) }, 0);
    assert_eq!(read_trace(&at_exit).1, events);
    let allocs: Vec<_> = events.iter().filter(|e| matches!(e, Event::Alloc { .. })).collect();
    let frees = events.iter().filter(|e| matches!(e, Event::Free { .. })).count();
    assert_eq!(allocs.len() as u64, u(&s, "allocs"));
    assert_eq!(frees as u64, u(&s, "frees"));
    assert_eq!(u(&s, "trace_events"), events.len() as u64);
    match *allocs[0] {
        Event::Alloc { bytes, kind, stream, .. } => {
            assert_eq!((bytes, kind, stream), (1, TensorKind::Other, 0), "requested bytes, kind other")
        }
        _ => unreachable!(),
    }
    match *allocs[1] {
        Event::Alloc { bytes, stream, .. } => assert_eq!((bytes, stream), (512, 1)),
        _ => unreachable!(),
    }
    // A path that cannot be written: -1, logged.
    assert_eq!(dump(Path::new("/nonexistent-dir/trace.jsonl")), -1);
    assert_eq!(errors(&stats(), "trace"), 1);

    // Free everything: nothing live, the counts balance.
    for (p, size, st) in ptrs {
        wasmem_free(p, size, 0, stream(st));
    }
    checked();
    let s = stats();
    assert_eq!(u(&s, "live_pointers"), 0);
    assert_eq!(u(&s, "live_bytes"), 0);
    assert_eq!(u(&s, "allocs"), u(&s, "frees"));
    let _ = std::fs::remove_dir_all(&dir);
}
