//! Golden command-line outputs: `compare --json` over every shared trace ×
//! every built-in and shipped policy (on the 80 GiB device and at 60 % of each
//! trace's peak live bytes, with a hot swap), `replay --json --shadow`, and
//! `train --json` for ZeRO stages 0–3. The files under `tests/data/golden/`
//! were written by the engine *before* the redesign of the upper floors
//! (issue 13); the same commands must give the same output, timing keys
//! aside, for as long as no change of behaviour is intended.
//!
//! Cases on the shared traces (`../shared/traces`) are skipped with a message
//! when that folder is absent; the synthesized and training cases always run.
//! Shipped policies come from `policies/out` (`policies/build.sh`): cases that
//! name one are skipped with a message when it is not built.
//!
//! Keys added to the outputs after the files were written are ignored (no
//! existing key may change). `WASMEM_BLESS=1 cargo test --release --test
//! golden_cli` rewrites the files.
#![cfg(feature = "wasm")]

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").canonicalize().expect("repository root")
}

fn golden_dir() -> PathBuf {
    repo().join("tests/data/golden")
}

/// The shared sample traces, sorted, or `None` (with a message) when absent.
fn shared_traces() -> Option<Vec<String>> {
    let d = repo().join("../shared/traces");
    if !d.is_dir() {
        eprintln!("SKIP: {} not found: the shared-trace cases do not run", d.display());
        return None;
    }
    let mut v: Vec<String> = std::fs::read_dir(&d)
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            let s = p.to_string_lossy();
            s.ends_with(".jsonl.gz") || s.ends_with(".pickle")
        })
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    v.sort();
    Some(v)
}

/// Every built-in policy and every shipped one, plus two combinations.
const POLICIES: [&str; 16] = [
    "naive",
    "pytorch",
    "lifecycle",
    "defrag",
    "lru",
    "dtr",
    "belady",
    "pytorch-like",
    "policies/out/lifecycle.wasm",
    "lru-evict",
    "watermark-reclaim",
    "defrag-reclaim",
    "size-class",
    "dtr-evict",
    "pytorch-like+defrag-reclaim",
    "dtr+lifecycle",
];

/// Shipped components a spec names (built by `policies/build.sh`).
fn components(spec: &str) -> Vec<PathBuf> {
    let builtin = ["naive", "pytorch", "lifecycle", "defrag", "lru", "dtr", "belady"];
    spec.split('+')
        .map(|p| p.split('?').next().unwrap_or(p))
        .filter(|p| !builtin.contains(p))
        .map(|p| if p.ends_with(".wasm") { repo().join(p) } else { repo().join(format!("policies/out/{p}.wasm")) })
        .collect()
}

/// 60 % of each shared trace's peak live bytes (from the 80 GiB run), by file name.
const SIXTY_PERCENT: [(&str, u64); 4] = [
    ("bert_base.jsonl.gz", 11_100_993_254),
    ("gpt2_124m.jsonl.gz", 9_707_607_979),
    ("pytorch-snapshot-a.pickle", 8_354_398_620),
    ("pytorch-snapshot-b.pickle", 2_309_539_584),
];

struct Case {
    /// Golden file name (without `.jsonl`).
    name: String,
    args: Vec<String>,
}

fn case(name: impl Into<String>, args: &[&str]) -> Case {
    Case { name: name.into(), args: args.iter().map(|s| s.to_string()).collect() }
}

fn with_policies(mut c: Case, policies: &[&str]) -> Case {
    for p in policies {
        c.args.extend(["--policy".to_string(), p.to_string()]);
    }
    c
}

fn base_name(path: &str) -> &str {
    path.rsplit('/').next().unwrap_or(path)
}

/// Every case; those on shared traces only when the folder is present.
fn cases() -> Vec<Case> {
    // A slow shared machine must not turn a deadline into a fallback.
    let dl = ["--deadline-ms", "2000"];
    let mut v = Vec::new();
    let synth = ["compare", "--synth", "gpt2-124m", "--synth", "llama-1b", "--json"];
    v.push(with_policies(
        case("compare-synth", &[&synth[..], &dl].concat()),
        &["pytorch", "lifecycle", "pytorch-like", "naive"],
    ));
    for stage in 0..=3 {
        let s = stage.to_string();
        v.push(case(
            format!("train-zero{stage}"),
            &["train", "--json", "--zero", &s, "--ranks", "2", "--steps", "3", "--policy", "lifecycle"],
        ));
    }
    v.push(case(
        "train-offload",
        &["train", "--json", "--zero", "2", "--offload", "cpu", "--ranks", "2", "--steps", "2", "--policy", "pytorch"],
    ));
    v.push(case(
        "train-swap-shadow",
        &[
            "train",
            "--json",
            "--zero",
            "3",
            "--ranks",
            "4",
            "--steps",
            "4",
            "--policy",
            "pytorch-like",
            "--swap-at",
            "2:pytorch-like+watermark-reclaim",
            "--shadow",
            "lifecycle",
        ],
    ));
    v.push(case(
        "train-swap-builtin",
        &[
            "train",
            "--json",
            "--zero",
            "1",
            "--ranks",
            "2",
            "--steps",
            "3",
            "--policy",
            "pytorch",
            "--swap-at",
            "1:defrag",
        ],
    ));
    let Some(traces) = shared_traces() else { return v };
    let t: Vec<&str> = traces.iter().map(String::as_str).collect();
    let mut all = vec!["compare"];
    all.extend(&t);
    all.extend(["--json"]);
    all.extend(dl);
    v.push(with_policies(case("compare-80gib", &all), &POLICIES));
    for trace in &t {
        let name = base_name(trace);
        let Some(&(_, mem)) = SIXTY_PERCENT.iter().find(|(n, _)| *n == name) else {
            eprintln!("SKIP: no 60 % figure for {name}");
            continue;
        };
        let mem = mem.to_string();
        let c = case(
            format!("compare-60pct-{name}"),
            &[&["compare", trace, "--json", "--device-mem", &mem][..], &dl].concat(),
        );
        v.push(with_policies(c, &POLICIES));
        for (primary, shadow) in [("pytorch", "lifecycle"), ("pytorch-like", "defrag")] {
            v.push(case(
                format!("replay-shadow-{primary}-{shadow}-{name}"),
                &[&["replay", trace, "--json", "--policy", primary, "--shadow", shadow][..], &dl].concat(),
            ));
        }
        v.push(
            case(
                format!("replay-shadow-tiers-{name}"),
                &[
                    &[
                        "replay",
                        trace,
                        "--json",
                        "--policy",
                        "lifecycle",
                        "--shadow",
                        "lru-evict",
                        "--device-mem",
                        &mem,
                    ][..],
                    &dl,
                ]
                .concat(),
            ),
        );
    }
    let mut swap = all.clone();
    swap.extend(["--swap-at", "2000:lifecycle"]);
    v.push(with_policies(
        case("compare-swap-builtin", &swap),
        &["pytorch", "naive", "pytorch-like", "defrag", "watermark-reclaim"],
    ));
    let mut swap = all.clone();
    swap.extend(["--swap-at", "2000:pytorch-like+defrag-reclaim"]);
    v.push(with_policies(case("compare-swap-wasm", &swap), &["pytorch", "lifecycle", "defrag-reclaim"]));
    v
}

/// The first shipped component a case's policy specs name that is not built.
fn missing_component(c: &Case) -> Option<PathBuf> {
    c.args
        .windows(2)
        .filter(|w| ["--policy", "--shadow", "--swap-at"].contains(&w[0].as_str()))
        .map(|w| w[1].split_once(':').map_or(w[1].as_str(), |(_, p)| p))
        .flat_map(components)
        .find(|p| !p.is_file())
}

/// Whether `got` has every key of `want` with the same value (recursively;
/// arrays element by element); keys only `got` has are new and ignored.
fn covers(got: &Value, want: &Value) -> bool {
    match (got, want) {
        (Value::Object(g), Value::Object(w)) => w.iter().all(|(k, wv)| g.get(k).is_some_and(|gv| covers(gv, wv))),
        (Value::Array(g), Value::Array(w)) => g.len() == w.len() && g.iter().zip(w).all(|(a, b)| covers(a, b)),
        (g, w) => g == w,
    }
}

/// Removes the timing keys everywhere and shortens trace paths to file names.
fn normalize(v: &mut Value) {
    match v {
        Value::Object(o) => {
            // Wall-clock-dependent keys: replay speed and policy call latency.
            for k in ["wall_seconds", "events_per_second", "policy_call_p50_ns", "policy_call_p99_ns"] {
                o.remove(k);
            }
            if let Some(Value::String(t)) = o.get_mut("trace") {
                *t = base_name(t).to_string();
            }
            o.values_mut().for_each(normalize);
        }
        Value::Array(a) => a.iter_mut().for_each(normalize),
        _ => {}
    }
}

fn run(c: &Case) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_wasmem"))
        .current_dir(repo())
        .env_remove("WASMEM_POLICY_DIR")
        .args(&c.args)
        .output()
        .expect("run wasmem");
    assert!(out.status.success(), "{}: wasmem {:?} failed:\n{}", c.name, c.args, String::from_utf8_lossy(&out.stderr));
    let mut text = String::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let mut v: Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("{}: not JSON ({e}): {line}", c.name));
        normalize(&mut v);
        text.push_str(&v.to_string());
        text.push('\n');
    }
    text
}

#[test]
fn outputs_equal_the_golden_files() {
    let bless = std::env::var_os("WASMEM_BLESS").is_some();
    let dir = golden_dir();
    let mut checked = 0;
    let mut failures = Vec::new();
    for c in cases() {
        if let Some(missing) = missing_component(&c) {
            eprintln!("SKIP {}: {} is not built (policies/build.sh)", c.name, missing.display());
            continue;
        }
        let got = run(&c);
        let path = dir.join(format!("{}.jsonl", c.name));
        if bless {
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(&path, &got).unwrap();
            checked += 1;
            continue;
        }
        let want = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("{}: {e} (WASMEM_BLESS=1 writes the golden files)", path.display()));
        // Keys added after a golden file was written are not compared (the
        // contract is that no existing key changes); every golden key is.
        let (g, w): (Vec<&str>, Vec<&str>) = (got.lines().collect(), want.lines().collect());
        let same = g.len() == w.len()
            && g.iter().zip(&w).all(|(a, b)| {
                let (a, b): (Value, Value) = (serde_json::from_str(a).unwrap(), serde_json::from_str(b).unwrap());
                covers(&a, &b)
            });
        if !same {
            let first = g
                .iter()
                .zip(&w)
                .position(|(a, b)| !covers(&serde_json::from_str(a).unwrap(), &serde_json::from_str(b).unwrap()))
                .unwrap_or(g.len().min(w.len()));
            failures.push(format!(
                "{}: line {} differs ({} lines against {} golden)\n  got:  {}\n  want: {}",
                c.name,
                first + 1,
                g.len(),
                w.len(),
                g.get(first).unwrap_or(&"<none>"),
                w.get(first).unwrap_or(&"<none>")
            ));
        }
        checked += 1;
    }
    assert!(failures.is_empty(), "{} of {checked} cases differ:\n{}", failures.len(), failures.join("\n"));
    eprintln!("{checked} golden cases {}", if bless { "written" } else { "equal" });
}
