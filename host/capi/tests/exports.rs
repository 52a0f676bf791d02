//! The built library itself: its exported symbols, and a process that loads
//! it with `dlopen` (Python's `ctypes`), allocates on the `sim` device and
//! exits, which must write the trace through the exit hook.

use std::path::PathBuf;
use std::process::Command;

/// The C ABI: exactly these symbols, nothing else.
const EXPORTS: [&str; 24] = [
    "wasmem_dump_trace",
    "wasmem_empty_cache",
    "wasmem_free",
    "wasmem_init",
    "wasmem_last_error",
    "wasmem_malloc",
    "wasmem_phase",
    "wasmem_record_history",
    "wasmem_recorder_alloc",
    "wasmem_recorder_close",
    "wasmem_recorder_free",
    "wasmem_recorder_open",
    "wasmem_recorder_phase",
    "wasmem_recorder_plan",
    "wasmem_recorder_retag",
    "wasmem_recorder_save",
    "wasmem_recorder_stats",
    "wasmem_reset_peaks",
    "wasmem_retag",
    "wasmem_set_default_kind",
    "wasmem_set_kind",
    "wasmem_snapshot",
    "wasmem_stats_json",
    "wasmem_swap_policy",
];

/// `libwasmem_capi.so`, built with this test (`target/<profile>/`).
fn library() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let profile_dir = exe.parent().and_then(|deps| deps.parent()).unwrap();
    let lib = profile_dir.join("libwasmem_capi.so");
    assert!(
        lib.is_file(),
        "{} was not built: `cargo test` builds the crate as an rlib only; build the workspace first with \
         `cargo build --release --workspace --all-targets` (scripts/test.sh does)",
        lib.display()
    );
    lib
}

fn have(tool: &str) -> bool {
    Command::new(tool).arg("--version").output().is_ok()
}

#[test]
fn exports_exactly_the_c_abi() {
    if !have("nm") {
        eprintln!("skipped: `nm` is not installed");
        return;
    }
    let out = Command::new("nm").args(["-D", "--defined-only"]).arg(library()).output().unwrap();
    assert!(out.status.success(), "nm failed: {}", String::from_utf8_lossy(&out.stderr));
    let mut names: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().last().map(str::to_string))
        .collect();
    names.sort();
    assert_eq!(names, EXPORTS, "exported symbols");
}

const SCRIPT: &str = r#"
import ctypes, json, sys
lib = ctypes.CDLL(sys.argv[1])
lib.wasmem_malloc.restype = ctypes.c_void_p
lib.wasmem_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
lib.wasmem_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
lib.wasmem_stats_json.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
ptrs = [lib.wasmem_malloc(n, 0, None) for n in (100, 1 << 20, 3 << 20)]
assert all(ptrs), ptrs
lib.wasmem_free(ptrs[0], 100, 0, None)
lib.wasmem_free(ptrs[0], 100, 0, None)  # double free: logged, no crash
buf = ctypes.create_string_buffer(4096)
n = lib.wasmem_stats_json(buf, 4096)
s = json.loads(buf.value.decode())
assert n == len(buf.value), (n, buf.value)
assert (s["allocs"], s["frees"], s["errors"]["unknown_pointer"]) == (3, 1, 1), s
print("ok")
"#;

#[test]
fn loads_with_dlopen_and_writes_the_trace_at_exit() {
    if !have("python3") {
        eprintln!("skipped: `python3` is not installed");
        return;
    }
    let trace = std::env::temp_dir().join(format!("wasmem-capi-exit-{}.jsonl", std::process::id()));
    let _ = std::fs::remove_file(&trace);
    let out = Command::new("python3")
        .arg("-c")
        .arg(SCRIPT)
        .arg(library())
        .env("WASMEM_DEVICE", "sim")
        .env("WASMEM_SIM_CAPACITY", "1GiB")
        .env("WASMEM_TRACE_OUT", &trace)
        .env_remove("WASMEM_POLICY")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "python failed:\n{stderr}");
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "ok");
    assert!(stderr.contains("not allocated here, or already freed"), "the double free is logged:\n{stderr}");
    let (header, events) = wasmem::trace::read_file(&trace).expect("the exit hook wrote a readable trace");
    assert!(header.source.contains("policy lifecycle"), "{}", header.source);
    assert_eq!(events.len(), 4, "3 allocs and 1 free: {events:?}");
    let _ = std::fs::remove_file(&trace);
}
