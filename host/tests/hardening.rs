//! The defects of issue 16, each with the test that shows it gone: output
//! errors, host memory, policy-supplied text, silent acceptance, messages,
//! standard input as a trace.
#![cfg(feature = "wasm")]

mod common;

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

fn bin() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_wasmem"));
    c.env_remove("WASMEM_LOG");
    c
}

fn run(args: &[&str]) -> Output {
    bin().args(args).output().expect("run wasmem")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn temp(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("wasmem-hardening-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn a_full_disk_is_a_clean_error() {
    let full = Path::new("/dev/full");
    if !full.exists() {
        eprintln!("SKIP: no /dev/full");
        return;
    }
    let mut cases: Vec<Vec<String>> = vec![
        vec!["replay".into(), "--synth".into(), "tiny".into(), "--policy".into(), "pytorch".into()],
        vec!["compare".into(), "--synth".into(), "tiny".into(), "--json".into()],
        vec!["train".into(), "--steps".into(), "2".into()],
    ];
    if let Some(h) = common::hostile() {
        cases.push(vec!["policy".into(), "check".into(), h.display().to_string(), "--config".into(), "mode=ok".into()]);
    }
    for args in cases {
        let out = bin().args(&args).stdout(std::fs::File::create(full).unwrap()).output().unwrap();
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.contains("cannot write to standard output") && err.contains("No space left"), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
}

/// Reads one line of `args`' output, closes the pipe, and waits.
fn first_line_then_close(args: &[&str]) -> (String, Output) {
    let mut child = bin().args(args).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    // The reader is dropped here: the pipe is closed.
    (line, child.wait_with_output().unwrap())
}

#[test]
fn a_closed_pipe_ends_quietly() {
    for args in [
        &["train", "--steps", "200"][..],
        // The second workload takes seconds: the pipe is closed before it prints.
        &["replay", "--synth", "tiny", "--synth", "llama-1b", "--policy", "pytorch"],
    ] {
        let (line, out) = first_line_then_close(args);
        assert!(!line.is_empty(), "{args:?}");
        let err = text(&out.stderr);
        assert!(out.status.success(), "{args:?}: {:?} {err}", out.status);
        assert!(err.trim().is_empty(), "{args:?}: a closed pipe is no error: {err}");
    }
}

#[test]
fn train_refuses_a_run_larger_than_the_host_before_starting() {
    let out = run(&["train", "--ranks", "100000", "--steps", "1"]);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("needs about") && err.contains("of host memory") && err.contains("100000 rank(s)"), "{err}");
    assert!(err.contains("is available"), "{err}");
}

/// No terminal control character reaches the output.
fn assert_printable(what: &str, s: &str) {
    let bad: Vec<char> = s.chars().filter(|c| c.is_control() && *c != '\n' && *c != '\t').collect();
    assert!(bad.is_empty(), "{what}: control characters {bad:?} in {s:?}");
    assert!(!s.contains('\u{202e}'), "{what}: a bidirectional override in {s:?}");
}

#[test]
fn policy_supplied_text_is_bounded_and_printable() {
    let Some(h) = common::hostile() else { return };
    let hp = h.display().to_string();
    let out = run(&["policy", "check", &hp, "--config", "mode=evil-name", "--deadline-ms", "2000"]);
    assert_printable("check output", &text(&out.stdout));
    assert_printable("check log", &text(&out.stderr));
    assert!(text(&out.stdout).contains("\\u{1b}[31mhostile"), "the name is shown escaped: {}", text(&out.stdout));

    let out = run(&["replay", "--synth", "tiny", "--policy", &format!("{}?mode=evil-init", h.display())]);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1));
    assert_printable("init refusal", &err);
    assert!(err.contains("refused the configuration") && err.contains("\\u{1b}"), "{err}");

    // A 16 MiB name is cut to a bounded one everywhere it goes.
    let rt = common::relaxed_runtime();
    let r = wasmem::policy::resolve_with(&rt, &format!("{}?mode=huge-name,n=16", h.display())).unwrap();
    let name = r.policies.placement.name();
    assert!(name.len() < 256 && name.contains("more bytes cut"), "{} bytes", name.len());
}

#[test]
fn a_swap_whose_reply_would_be_too_large_changes_nothing() {
    use wasmem::ctl::{Control, RankControl, RoleArg};
    let shared = wasmem::alloc::SharedAllocator::new(
        wasmem::alloc::Allocator::with_builtin(wasmem::device::sim::SimDevice::with_capacity(1 << 30), "pytorch")
            .unwrap(),
    );
    let ctl = RankControl::new(vec![shared.clone()], common::loader());
    // A spec of 2 MiB: its echo alone would not fit a reply.
    let spec = format!("lifecycle+{}", "lru+".repeat(400_000)).trim_end_matches('+').to_string();
    let e = ctl.swap(RoleArg::All, &spec).unwrap_err();
    assert!(e.contains("reply would take"), "{}", &e[..e.len().min(300)]);
    assert!(e.len() < 1024, "the refusal itself is bounded");
    assert_eq!(shared.with(|a| a.policies().names()[0].clone()), "pytorch", "nothing changed");
}

#[test]
fn silent_acceptance_is_refused() {
    for (args, want) in [
        (&["replay", "--synth", "tiny", "--policy", ""][..], "empty policy spec"),
        (&["replay", "--synth", "tiny", "--policy", "+"], "empty policy spec"),
        (&["replay", "--synth", "tiny", "--policy", "pytorch?x=1"], "takes no configuration"),
        (&["compare", "--synth", "tiny", "--policy", "lifecycle", "--policy", "dtr?k=2"], "takes no configuration"),
        (&["replay", "--synth", "tiny", "--device-mem", "0"], "more than 0 bytes"),
        (&["train", "--steps", "1", "--device-mem", "0"], "more than 0 bytes"),
    ] {
        let out = run(args);
        let err = text(&out.stderr);
        assert_ne!(out.status.code(), Some(0), "{args:?} was accepted");
        assert!(err.contains(want), "{args:?}: {err}");
    }
}

#[test]
fn snapshot_anomalies_and_unknown_actions_are_named() {
    if Command::new("python3").arg("--version").output().is_err() {
        eprintln!("SKIP: no python3");
        return;
    }
    let d = temp("snap");
    let p = d.join("odd.pickle");
    let script = format!(
        "import pickle\ne=[{{'action':'alloc','addr':4096,'size':512,'stream':0}},\
         {{'action':'alloc','addr':4096,'size':512,'stream':0}},\
         {{'action':'teleport','addr':1,'size':1}},{{'action':'teleport','addr':1,'size':1}},\
         {{'action':'free_requested','addr':4096,'size':512}}]\n\
         pickle.dump({{'segments':[],'device_traces':[e]}}, open({:?},'wb'))\n",
        p.display().to_string()
    );
    assert!(Command::new("python3").args(["-c", &script]).status().unwrap().success());
    let out = run(&["replay", p.to_str().unwrap(), "--policy", "pytorch"]);
    let err = text(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("unknown actions ignored: `teleport` ×2"), "{err}");
    assert!(err.contains("still live") && err.contains("count=1"), "{err}");
    assert!(!err.contains("free_requested"), "a known action is not unknown: {err}");
}

#[test]
fn errors_say_where_and_each_cause_once() {
    let d = temp("msg");
    let t = d.join("big.jsonl");
    std::fs::write(
        &t,
        "{\"format\":\"wasmem-trace\",\"version\":1,\"source\":\"t\",\"ranks\":1}\n\
         {\"op\":\"alloc\",\"id\":1,\"bytes\":18446744073709551615,\"kind\":\"temp\"}\n",
    )
    .unwrap();
    let out = run(&["replay", t.to_str().unwrap(), "--policy", "pytorch"]);
    let err = text(&out.stderr);
    assert!(err.contains(&format!("{}:2:", t.display())), "file:line: {err}");
    assert_eq!(err.matches("exceeds the largest supported allocation").count(), 1, "{err}");

    let out = run(&["replay", "--synth", "tiny", "--export-snapshot", "/nonexistent/dir/x.pickle"]);
    let err = text(&out.stderr);
    assert_eq!(err.matches("/nonexistent/dir/x.pickle").count(), 1, "{err}");
    assert_eq!(err.matches("No such file").count(), 1, "{err}");

    let out = run(&["replay", "/nonexistent/trace.jsonl"]);
    let err = text(&out.stderr);
    assert_eq!(err.matches("No such file or directory").count(), 1, "{err}");
}

#[test]
fn standard_input_is_a_trace() {
    let d = temp("stdin");
    let t = d.join("t.jsonl.gz");
    assert!(run(&["synth", "--preset", "tiny", "-o", t.to_str().unwrap()]).status.success());
    let from_file = run(&["replay", t.to_str().unwrap(), "--policy", "pytorch", "--json"]);
    let mut child = bin()
        .args(["replay", "-", "--policy", "pytorch", "--json"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(&std::fs::read(&t).unwrap()).unwrap();
    let from_stdin = child.wait_with_output().unwrap();
    assert!(from_stdin.status.success());
    let key = |o: &Output| {
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        (v["events"].clone(), v["peak_reserved_bytes"].clone(), v["trace"].clone())
    };
    let (a, b) = (key(&from_file), key(&from_stdin));
    assert_eq!((&a.0, &a.1), (&b.0, &b.1));
    assert_eq!(b.2, "<stdin>");
}

#[test]
fn logs_carry_no_colours_when_stderr_is_not_a_terminal() {
    let Some(h) = common::hostile() else { return };
    // A policy that answers badly is logged (a warning) on every run.
    let spec = format!("{}?mode=bad-pool", h.display());
    let out = bin().args(["replay", "--synth", "tiny", "--policy", &spec]).output().unwrap();
    let err = text(&out.stderr);
    assert!(err.contains("WARN"), "a warning expected: {err}");
    assert!(!err.contains('\u{1b}'), "ANSI escapes in a piped log: {err:?}");
}

#[test]
fn a_silent_control_socket_is_a_clear_timeout() {
    let d = temp("ctl");
    let path = d.join("silent.sock");
    let _ = std::fs::remove_file(&path);
    let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
    let keep = std::thread::spawn(move || {
        let (s, _) = listener.accept().unwrap();
        std::thread::sleep(Duration::from_millis(800));
        drop(s);
    });
    let e = wasmem::ctl::request(&path, &wasmem::ctl::Request::Status, Duration::from_millis(200)).unwrap_err();
    let msg = e.to_string();
    assert!(msg.contains("no reply within 0.2 s") && !msg.contains("os error"), "{msg}");
    keep.join().unwrap();
}
