//! Live control of a running `wasmem train --ctl` (default socket path)
//! from `wasmem ctl` without `--socket`: a swap mid-run shows in `status`,
//! changes no loss, and a `--shadow` is reported by `status`.
#![cfg(feature = "wasm")]

use std::io::{BufRead, BufReader};
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};

const SMALL: [&str; 14] = [
    "--layers",
    "2",
    "--hidden",
    "32",
    "--heads",
    "2",
    "--intermediate",
    "64",
    "--vocab",
    "64",
    "--seq",
    "16",
    "--batch",
    "2",
];

/// A training run that would go on for hours; the test reads what it needs and kills it.
struct Run {
    child: Child,
    lines: std::io::Lines<BufReader<ChildStdout>>,
    stderr: PathBuf,
}

impl Run {
    fn start(xdg: &Path, extra: &[&str]) -> Run {
        let mut args =
            vec!["train", "--ranks", "2", "--zero", "3", "--steps", "1000000", "--policy", "pytorch", "--json"];
        args.extend(SMALL);
        args.extend(extra);
        let mut child = Command::new(env!("CARGO_BIN_EXE_wasmem"))
            .args(&args)
            .env("XDG_RUNTIME_DIR", xdg)
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(xdg.join("stderr")).unwrap())
            .spawn()
            .expect("run wasmem train");
        let lines = BufReader::new(child.stdout.take().unwrap()).lines();
        Run { child, lines, stderr: xdg.join("stderr") }
    }

    /// The loss of the next step line.
    fn next_loss(&mut self) -> f64 {
        loop {
            let Some(line) = self.lines.next() else {
                panic!("the run ended early: {}", std::fs::read_to_string(&self.stderr).unwrap_or_default());
            };
            let line = line.unwrap();
            let v: serde_json::Value = serde_json::from_str(&line).unwrap();
            if v["event"] == "step" {
                return v["loss"].as_f64().unwrap();
            }
        }
    }
}

impl Drop for Run {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn ctl(xdg: &Path, args: &[&str]) -> (i32, String, String) {
    let out =
        Command::new(env!("CARGO_BIN_EXE_wasmem")).arg("ctl").args(args).env("XDG_RUNTIME_DIR", xdg).output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn xdg(tag: &str) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("train-ctl-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(&d).unwrap();
    d
}

#[test]
fn a_swap_through_ctl_mid_run_shows_in_status_and_changes_no_loss() {
    let dir = xdg("swap");
    let mut run = Run::start(&dir, &["--ctl", "--shadow", "naive"]);
    let mut losses = vec![run.next_loss()];
    // Step 0 is done, so the socket is up (it is served before the first step).
    let (code, out, err) = ctl(&dir, &["status", "--json"]);
    assert_eq!(code, 0, "{err}");
    let st: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(st["pid"], run.child.id());
    assert_eq!(st["ranks"].as_array().unwrap().len(), 2);
    assert_eq!(st["ranks"][0]["policies"]["placement"], "pytorch");
    assert_eq!(st["shadows"].as_array().unwrap().len(), 2, "{st}");
    assert_eq!(st["shadows"][1]["label"], "naive");
    let sock = dir.join("wasmem").join(format!("{}.sock", run.child.id()));
    assert!(sock.exists(), "{} missing", sock.display());
    let (code, out, err) = ctl(&dir, &["swap", "all", "lifecycle"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("placement: pytorch → lifecycle on 2 rank(s)"), "{out}");
    let (code, out, err) = ctl(&dir, &["status", "--json"]);
    assert_eq!(code, 0, "{err}");
    let st: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(st["ranks"][1]["policies"]["reclamation"], "lifecycle", "{st}");
    // The run went on while the swap was made: it is at step `now` or
    // later. Read past it, then compare every loss with an untouched run.
    let now = st["step"].as_u64().unwrap() as usize;
    while losses.len() < now + 4 {
        losses.push(run.next_loss());
    }
    let (code, out, err) = ctl(&dir, &["status"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("rank 1: placement=lifecycle reclamation=lifecycle eviction=lru"), "{out}");
    eprintln!("swapped during step {now} or later; comparing {} losses", losses.len());
    drop(run);
    let plain = xdg("plain");
    let mut reference = Run::start(&plain, &[]);
    let expected: Vec<f64> = (0..losses.len()).map(|_| reference.next_loss()).collect();
    // Policies decide where bytes live, never what they hold.
    assert_eq!(losses, expected, "a live swap changed a loss (swapped during step {now} or later)");
}
