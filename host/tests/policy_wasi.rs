//! A guest that imports WASI (componentize-py output imports 24 WASI 0.2
//! interfaces) runs under the deny-all context and decides validly.
//! Skipped unless `size-class.wasm` was built (`policies/build.sh`, or
//! `$WASMEM_POLICY_DIR`): building it needs componentize-py.
#![cfg(feature = "wasm")]

mod common;

use std::time::Duration;

use wasmem::decision::{AllocRequest, PlacementPolicy, PolicyContext, Role};
use wasmem::policy::resolve::shipped_candidates;
use wasmem::policy::Limits;
use wasmem::types::{StreamId, TensorKind, MIB};

#[test]
fn python_policy_runs_with_a_deny_all_wasi_context() {
    let Some(path) = shipped_candidates("size-class").into_iter().find(|p| p.is_file()) else {
        eprintln!("SKIP: size-class.wasm not built (run policies/build.sh or set WASMEM_POLICY_DIR)");
        return;
    };
    // Python decisions take microseconds; a loaded machine gets slack.
    let rt = common::runtime_with(Limits { deadline: Some(Duration::from_millis(200)), ..Limits::default() }, "wasi");
    let loaded = rt.load(&path).unwrap_or_else(|e| panic!("{e}"));
    assert!(loaded.imports_wasi());
    assert!(loaded.exports(Role::Placement));
    let p = loaded.instantiate("").unwrap_or_else(|e| panic!("{e}"));
    let mut pl = p.placement().unwrap();
    let pools = pl.pools();
    for (i, bytes) in [1u64, 4096, MIB, 3 * MIB, 64 * MIB].into_iter().enumerate() {
        let req = AllocRequest { bytes, kind: TensorKind::Activation, stream: StreamId(0) };
        let d = pl.place(&req, &PolicyContext { clock: i as u64, ..Default::default() }).unwrap();
        d.validate(&req, pools.len()).unwrap();
    }
    assert_eq!(p.failures(), 0);
    println!("{} loaded ({:?}) in {:?}", p.name(), loaded.source(), loaded.load_time());
}
