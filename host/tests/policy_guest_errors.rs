//! A guest's own words reach the engine's error: a Rust panic (the SDK logs
//! it), a Python `raise` (componentize-py prints the traceback to stderr,
//! which the engine captures) and a JavaScript `throw` (printed to stderr
//! with its stack) arrive as `PolicyError::Trap` with the exception's text,
//! bounded and stripped of control characters and escape sequences, at the
//! default limits. The Python and JavaScript guests are built here from
//! `tests/guests/` with the toolchains `policies/build.sh` installs; a
//! language whose toolchain is absent is skipped with a message.
#![cfg(feature = "wasm")]

mod common;

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use wasmem::alloc::Allocator;
use wasmem::builtin::{LruEviction, PytorchReclamation};
use wasmem::decision::{
    AllocRequest, EvictionCandidate, EvictionPolicy, PlacementPolicy, Policies, PolicyContext, PolicyError, Role,
};
use wasmem::device::sim::SimDevice;
use wasmem::policy::Limits;
use wasmem::types::{StreamId, TensorId, TensorKind, Tier, GIB};

fn out_dir() -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("guest-errors");
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn python_raiser() -> Option<PathBuf> {
    let cpy = common::componentize_py()?;
    let out = out_dir().join("raiser.py.wasm");
    let src = common::repo().join("tests/guests");
    common::run_ok(
        Command::new(cpy)
            .current_dir(&src)
            .args(["-d", "../../wit", "-w", "placement-policy", "componentize", "-p", ".", "raiser", "-o"])
            .arg(&out),
        "componentize-py raiser",
    );
    Some(out)
}

fn js_raiser() -> Option<PathBuf> {
    common::componentize_js()?;
    let out = out_dir().join("raiser.js.wasm");
    let js = common::repo().join("policies/js");
    common::run_ok(
        Command::new("node")
            .current_dir(&js)
            .arg("build.mjs")
            .arg(common::repo().join("tests/guests/raiser.js"))
            .arg("eviction-policy")
            .arg(&out)
            .arg(common::repo().join("wit")),
        "componentize-js raiser",
    );
    Some(out)
}

/// The text is one clean line: no escape or other control character.
fn clean(msg: &str) {
    assert!(!msg.chars().any(|c| c.is_control()), "control characters in {msg:?}");
    assert!(msg.chars().count() < 3000, "unbounded: {} characters", msg.chars().count());
}

fn big(bytes: u64) -> AllocRequest {
    AllocRequest { bytes, kind: TensorKind::Activation, stream: StreamId(0) }
}

#[test]
fn python_exceptions_arrive_with_their_text() {
    let path = need!(python_raiser());
    // A deadline and a failure grace long enough for a loaded machine to
    // run the call and print the traceback (what is tested is the text).
    let limits = Limits {
        deadline: Some(Duration::from_millis(500)),
        failure_grace: Duration::from_secs(5),
        ..Limits::default()
    };
    let rt = common::runtime_with(limits.clone(), "guest-errors");
    let loaded = rt.load(&path).unwrap_or_else(|e| panic!("{e}"));
    // Guarded (the generated template's decorator): the exception is logged
    // first, the call gets its grace, and the traceback follows.
    let p = loaded.instantiate("mode=guarded").unwrap_or_else(|e| panic!("{e}"));
    let mut pl = p.placement().unwrap();
    assert!(pl.place(&big(100), &PolicyContext::default()).is_ok());
    match pl.place(&big(4096), &PolicyContext::default()) {
        Err(PolicyError::Trap(msg)) => {
            clean(&msg);
            assert!(msg.contains("ValueError: raiser refuses 4096 bytes red second line"), "{msg}");
            assert!(msg.contains("Traceback"), "{msg}");
        }
        other => panic!("expected a trap with the exception's text, got {other:?}"),
    }
    // Unguarded: the traceback alone, given time to print it.
    let rt = common::runtime_with(
        Limits { deadline: Some(Duration::from_millis(200)), ..Limits::default() },
        "guest-errors",
    );
    let p = rt.load(&path).unwrap().instantiate("").unwrap();
    match p.placement().unwrap().place(&big(4096), &PolicyContext::default()) {
        Err(PolicyError::Trap(msg)) => {
            clean(&msg);
            assert!(msg.contains("it wrote:") && msg.contains("ValueError: raiser refuses 4096 bytes"), "{msg}");
        }
        other => panic!("expected a trap with the traceback, got {other:?}"),
    }
    // The engine records the text as the role's last error.
    let rt = common::runtime_with(limits, "guest-errors");
    let p = rt.load(&path).unwrap().instantiate("mode=guarded").unwrap();
    let policies = Policies {
        placement: Box::new(p.placement().unwrap()),
        reclamation: Box::new(PytorchReclamation),
        eviction: Box::new(LruEviction),
    };
    let mut a = Allocator::new(SimDevice::with_capacity(GIB), policies);
    a.alloc(1 << 20, TensorKind::Activation, StreamId(0)).expect("the fallback serves it");
    let h = a.policies().health(Role::Placement);
    assert_eq!((h.calls, h.traps, h.fallbacks), (1, 1, 1), "{h:?}");
    assert!(h.last_error.as_deref().is_some_and(|e| e.contains("ValueError: raiser refuses")), "{h:?}");
}

#[test]
fn javascript_exceptions_arrive_with_their_text() {
    let path = need!(js_raiser());
    // A deadline a loaded machine meets (what is tested is the text).
    let rt = common::runtime_with(
        Limits { deadline: Some(Duration::from_millis(500)), ..Limits::default() },
        "guest-errors",
    );
    let p = rt.load(&path).unwrap_or_else(|e| panic!("{e}")).instantiate("").unwrap_or_else(|e| panic!("{e}"));
    let cand = |i: u32| EvictionCandidate {
        id: TensorId { slot: i, generation: 0 },
        bytes: 4096,
        kind: TensorKind::Activation,
        tier: Tier::Device,
        last_use: i as u64,
        use_count: 1,
        in_use: false,
        pinned: false,
        phase: None,
        next_use: None,
    };
    let cands: Vec<EvictionCandidate> = (0..5).map(cand).collect();
    let mut e = p.eviction().unwrap();
    assert!(e.choose_victims(1, &cands[..2], &PolicyContext::default()).is_ok());
    match e.choose_victims(1, &cands, &PolicyContext::default()) {
        Err(PolicyError::Trap(msg)) => {
            clean(&msg);
            assert!(msg.contains("jsraiser refuses 5 candidates bold"), "{msg}");
            assert!(msg.contains("chooseVictims"), "the stack names the function: {msg}");
        }
        other => panic!("expected a trap with the exception's text, got {other:?}"),
    }
}

#[test]
fn rust_panics_arrive_with_their_message() {
    let path = need!(common::hostile());
    let rt = common::runtime_with(Limits::default(), "guest-errors");
    let p = rt.load(&path).unwrap().instantiate("mode=trap-nth n=2").unwrap();
    let mut pl = p.placement().unwrap();
    assert!(pl.place(&big(100), &PolicyContext::default()).is_ok());
    match pl.place(&big(100), &PolicyContext::default()) {
        Err(PolicyError::Trap(msg)) => {
            clean(&msg);
            assert!(
                msg.contains("it logged: policy panicked") && msg.contains("hostile policy traps on call 2"),
                "{msg}"
            );
        }
        other => panic!("expected a trap with the panic message, got {other:?}"),
    }
}
