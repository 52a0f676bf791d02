//! Embeds the shipped policy components found in `policies/out/` at build
//! time into the binary (`$OUT_DIR/embedded_policies.rs`, read by
//! `src/policy/embedded.rs`), so that an installed or copied `wasmem` finds
//! them without the repository.
//!
//! Only components of at most `WASMEM_EMBED_MAX_BYTES` bytes (default
//! 1 MiB: the Rust policies, 30–100 KB each) are embedded; the Python and
//! JavaScript components (12–18 MB, mostly their interpreters) would grow
//! the binary by 30 MB and are found on disk instead (next to the
//! executable or through `$WASMEM_POLICY_DIR`). `WASMEM_EMBED_MAX_BYTES=0`
//! embeds nothing. A shipped component missing from `policies/out/` is
//! reported with a `cargo:warning` (build them with `policies/build.sh`
//! before building the binary); the build itself never fails for it.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// The shipped policy names (the same list as `policy::resolve::SHIPPED_NAMES`;
/// a unit test of `policy::resolve` checks that they agree).
const SHIPPED: [&str; 9] = [
    "pytorch-like",
    "lifecycle",
    "lru-evict",
    "watermark-reclaim",
    "defrag-reclaim",
    "greedy-planner",
    "size-class",
    "dtr-evict",
    "first-fit-planner",
];

/// Default largest component embedded, in bytes.
const DEFAULT_MAX: u64 = 1 << 20;

fn main() {
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let out_dir = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let policies = manifest.join("../policies/out");
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=WASMEM_EMBED_MAX_BYTES");
    // A directory: cargo rescans it, so adding or rebuilding a component re-embeds.
    println!("cargo:rerun-if-changed={}", policies.display());
    let max = match std::env::var("WASMEM_EMBED_MAX_BYTES") {
        Ok(v) => v.trim().parse::<u64>().unwrap_or_else(|_| {
            println!("cargo:warning=WASMEM_EMBED_MAX_BYTES=`{v}` is not a number of bytes; using {DEFAULT_MAX}");
            DEFAULT_MAX
        }),
        Err(_) => DEFAULT_MAX,
    };
    let mut code = String::from(
        "/// Shipped components embedded at build time: (name, bytes).\n\
         pub(crate) static EMBEDDED: &[(&str, &[u8])] = &[\n",
    );
    let mut missing = Vec::new();
    let mut skipped = Vec::new();
    for name in SHIPPED {
        let path = policies.join(format!("{name}.wasm"));
        println!("cargo:rerun-if-changed={}", path.display());
        match std::fs::metadata(&path) {
            Ok(m) if m.is_file() && m.len() <= max => {
                let abs = canonical(&path);
                let _ = writeln!(code, "    ({name:?}, include_bytes!({:?})),", abs.display().to_string());
            }
            Ok(m) if m.is_file() => skipped.push(format!("{name} ({} bytes)", m.len())),
            _ => missing.push(name),
        }
    }
    code.push_str("];\n");
    if !missing.is_empty() {
        println!(
            "cargo:warning=shipped policies not embedded (not built in {}): {}; run `bash policies/build.sh` \
             (or `--rust`) and rebuild so that an installed wasmem finds them",
            policies.display(),
            missing.join(", ")
        );
    }
    let _ = writeln!(
        code,
        "/// Shipped components left out (over {max} bytes): found on disk only.\n\
         pub(crate) static NOT_EMBEDDED: &[&str] = &{:?};",
        skipped.iter().map(|s| s.split(' ').next().unwrap_or(s)).collect::<Vec<_>>()
    );
    let _ = writeln!(code, "/// The shipped names this build script knows.\n#[allow(dead_code)]\npub(crate) static BUILD_SHIPPED: &[&str] = &{SHIPPED:?};");
    let target = out_dir.join("embedded_policies.rs");
    if std::fs::read_to_string(&target).ok().as_deref() != Some(code.as_str()) {
        std::fs::write(&target, code).expect("write embedded_policies.rs into OUT_DIR");
    }
}

fn canonical(p: &Path) -> PathBuf {
    p.canonicalize().unwrap_or_else(|_| p.to_path_buf())
}
