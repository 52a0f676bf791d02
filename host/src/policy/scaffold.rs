//! `wasmem policy new`: a new policy project, anywhere, that builds with one
//! command and passes `wasmem policy check` unchanged.
//!
//! Everything a project needs travels inside this binary (embedded at build
//! time, so the project never points into the wasmem repository):
//!
//! | language | files | build (one command) | output |
//! |---|---|---|---|
//! | Rust | `Cargo.toml`, `Cargo.lock`, `src/lib.rs`, `sdk/` (the Rust SDK with its copy of the WIT package) | `cargo build --release --target wasm32-wasip2` | `target/wasm32-wasip2/release/NAME.wasm` (`-` → `_`) |
//! | Python | `MODULE.py`, `wit/`, `build.sh` | `sh build.sh` (componentize-py 0.25.1) | `NAME.wasm` |
//! | JavaScript | `NAME.js`, `wit/`, `build.mjs`, `package.json` | `npm install && npm run build` (componentize-js 0.23.0) | `NAME.wasm` |
//!
//! Each project implements one role with the PyTorch defaults (placement,
//! reclamation), least-recently-used eviction, or, for a planner, the
//! engine's greedy-by-size plan (Rust, through the SDK) or a first-fit
//! plan (Python, JavaScript), as a starting point. The WIT text is
//! `wasmem:policy@0.4.0` from the repository's `wit/` (the single source of
//! truth; the SDK's copy is checked identical by a test).

use std::fmt;
use std::path::{Path, PathBuf};

use crate::decision::Role;
use crate::policy::WIT_VERSION;

/// What a new project implements: a decision role, or the planner (WIT 0.3.0 on).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProjectRole {
    /// The placement role.
    Placement,
    /// The reclamation role.
    Reclamation,
    /// The eviction role.
    Eviction,
    /// The planner (`wasmem:policy/planner`).
    Planner,
}

impl ProjectRole {
    /// Parses `placement`, `reclamation`, `eviction` or `planner`.
    pub fn parse(s: &str) -> Option<ProjectRole> {
        match s {
            "placement" => Some(ProjectRole::Placement),
            "reclamation" => Some(ProjectRole::Reclamation),
            "eviction" => Some(ProjectRole::Eviction),
            "planner" => Some(ProjectRole::Planner),
            _ => None,
        }
    }
}

impl From<Role> for ProjectRole {
    fn from(r: Role) -> Self {
        match r {
            Role::Placement => ProjectRole::Placement,
            Role::Reclamation => ProjectRole::Reclamation,
            Role::Eviction => ProjectRole::Eviction,
        }
    }
}

impl fmt::Display for ProjectRole {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ProjectRole::Placement => "placement",
            ProjectRole::Reclamation => "reclamation",
            ProjectRole::Eviction => "eviction",
            ProjectRole::Planner => "planner",
        })
    }
}

/// A policy's language.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lang {
    /// Rust with the wasmem policy SDK (wit-bindgen).
    Rust,
    /// Python with componentize-py.
    Python,
    /// JavaScript with componentize-js.
    Js,
}

impl Lang {
    /// Parses `rust`, `python` or `js` (also `py`, `javascript`).
    pub fn parse(s: &str) -> Option<Lang> {
        match s {
            "rust" | "rs" => Some(Lang::Rust),
            "python" | "py" => Some(Lang::Python),
            "js" | "javascript" => Some(Lang::Js),
            _ => None,
        }
    }
}

impl fmt::Display for Lang {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Lang::Rust => "rust",
            Lang::Python => "python",
            Lang::Js => "js",
        })
    }
}

/// Why a project could not be created.
#[derive(Debug, thiserror::Error)]
pub enum ScaffoldError {
    /// The name is not a valid policy name.
    #[error(
        "invalid policy name `{0}`: use 1–64 characters of lowercase letters, digits and `-`, \
         starting with a letter (e.g. `my-placement`)"
    )]
    Name(String),
    /// The project directory exists and is not empty.
    #[error("{} already exists and is not empty: choose another NAME or --dir", .0.display())]
    Exists(PathBuf),
    /// Writing a file failed.
    #[error("cannot write {}: {cause}", path.display())]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The OS error.
        cause: std::io::Error,
    },
}

/// A created project: where it is, and how to build and check it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Project {
    /// The project directory.
    pub dir: PathBuf,
    /// The files written, relative to `dir`.
    pub files: Vec<PathBuf>,
    /// The build command (run in `dir`).
    pub build: String,
    /// The component the build writes, relative to `dir`.
    pub output: PathBuf,
}

/// Checks a policy name: `[a-z][a-z0-9-]{0,63}`, no `--`, not ending in `-`.
pub fn valid_name(name: &str) -> bool {
    let b = name.as_bytes();
    !b.is_empty()
        && b.len() <= 64
        && b[0].is_ascii_lowercase()
        && b.iter().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        && !name.contains("--")
        && !name.ends_with('-')
}

/// The repository's `wit/` package (0.4.0), embedded.
pub const WIT_FILES: [(&str, &str); 8] = [
    ("eviction.wit", include_str!("../../../wit/eviction.wit")),
    ("host.wit", include_str!("../../../wit/host.wit")),
    ("lifecycle.wit", include_str!("../../../wit/lifecycle.wit")),
    ("placement.wit", include_str!("../../../wit/placement.wit")),
    ("planner.wit", include_str!("../../../wit/planner.wit")),
    ("reclamation.wit", include_str!("../../../wit/reclamation.wit")),
    ("types.wit", include_str!("../../../wit/types.wit")),
    ("worlds.wit", include_str!("../../../wit/worlds.wit")),
];

/// The Rust SDK (`policies/sdk`), embedded, with its copy of the WIT package.
pub const SDK_FILES: [(&str, &str); 17] = [
    ("Cargo.toml", include_str!("../../../policies/sdk/Cargo.toml")),
    ("src/lib.rs", include_str!("../../../policies/sdk/src/lib.rs")),
    ("src/bindings.rs", include_str!("../../../policies/sdk/src/bindings.rs")),
    ("src/config.rs", include_str!("../../../policies/sdk/src/config.rs")),
    ("src/defaults.rs", include_str!("../../../policies/sdk/src/defaults.rs")),
    ("src/runtime.rs", include_str!("../../../policies/sdk/src/runtime.rs")),
    ("plan-core/Cargo.toml", include_str!("../../../policies/sdk/plan-core/Cargo.toml")),
    ("plan-core/src/lib.rs", include_str!("../../../policies/sdk/plan-core/src/lib.rs")),
    ("plan-core/src/aliased.rs", include_str!("../../../policies/sdk/plan-core/src/aliased.rs")),
    ("wit/eviction.wit", include_str!("../../../policies/sdk/wit/eviction.wit")),
    ("wit/host.wit", include_str!("../../../policies/sdk/wit/host.wit")),
    ("wit/lifecycle.wit", include_str!("../../../policies/sdk/wit/lifecycle.wit")),
    ("wit/placement.wit", include_str!("../../../policies/sdk/wit/placement.wit")),
    ("wit/planner.wit", include_str!("../../../policies/sdk/wit/planner.wit")),
    ("wit/reclamation.wit", include_str!("../../../policies/sdk/wit/reclamation.wit")),
    ("wit/types.wit", include_str!("../../../policies/sdk/wit/types.wit")),
    ("wit/worlds.wit", include_str!("../../../policies/sdk/wit/worlds.wit")),
];

/// The lock file of the policies' workspace: the versions the shipped
/// Rust policies are built and tested with (cargo prunes what the new
/// project does not use).
const POLICIES_LOCK: &str = include_str!("../../../policies/Cargo.lock");

/// `my-policy` → `MyPolicy`.
fn camel(name: &str) -> String {
    name.split('-')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let mut c = p.chars();
            c.next().map_or_else(String::new, |f| f.to_ascii_uppercase().to_string() + c.as_str())
        })
        .collect()
}

fn fill(template: &str, name: &str, role: ProjectRole) -> String {
    template
        .replace("{{WIT}}", WIT_VERSION)
        .replace("{{NAME}}", name)
        .replace("{{STRUCT}}", &camel(name))
        .replace("{{MODULE}}", &name.replace('-', "_"))
        .replace("{{ROLE}}", &role.to_string())
        .replace("{{WORLD}}", &format!("{role}-policy"))
}

/// Creates a project for a `lang` policy of `role` (a [`Role`] or
/// [`ProjectRole::Planner`]) named `name` in `dir` (default: `./NAME`).
/// `dir` may exist if it is empty.
pub fn new_project(
    lang: Lang,
    role: impl Into<ProjectRole>,
    name: &str,
    dir: Option<&Path>,
) -> Result<Project, ScaffoldError> {
    let role = role.into();
    if !valid_name(name) {
        return Err(ScaffoldError::Name(name.to_string()));
    }
    let dir = dir.map_or_else(|| PathBuf::from(name), Path::to_path_buf);
    if std::fs::read_dir(&dir).is_ok_and(|mut d| d.next().is_some()) {
        return Err(ScaffoldError::Exists(dir));
    }
    let module = name.replace('-', "_");
    let mut files: Vec<(String, String)> = Vec::new();
    let wit = |files: &mut Vec<(String, String)>, under: &str| {
        for (f, text) in WIT_FILES {
            files.push((format!("{under}{f}"), text.to_string()));
        }
    };
    let (build, output) = match lang {
        Lang::Rust => {
            files.push(("Cargo.toml".into(), fill(RUST_MANIFEST, name, role)));
            files.push(("Cargo.lock".into(), POLICIES_LOCK.to_string()));
            files.push(("src/lib.rs".into(), fill(&rust_source(role), name, role)));
            for (f, text) in SDK_FILES {
                files.push((format!("sdk/{f}"), text.to_string()));
            }
            files.push((".gitignore".into(), "/target\n".into()));
            (
                "cargo build --release --target wasm32-wasip2".to_string(),
                PathBuf::from(format!("target/wasm32-wasip2/release/{module}.wasm")),
            )
        }
        Lang::Python => {
            files.push((format!("{module}.py"), fill(&python_source(role), name, role)));
            files.push(("build.sh".into(), fill(PYTHON_BUILD, name, role)));
            wit(&mut files, "wit/");
            files.push((".gitignore".into(), "*.wasm\n__pycache__/\n".into()));
            ("sh build.sh".to_string(), PathBuf::from(format!("{name}.wasm")))
        }
        Lang::Js => {
            files.push((format!("{name}.js"), fill(&js_source(role), name, role)));
            files.push(("build.mjs".into(), fill(JS_BUILD, name, role)));
            files.push(("package.json".into(), fill(JS_PACKAGE, name, role)));
            wit(&mut files, "wit/");
            files.push((".gitignore".into(), "*.wasm\nnode_modules/\n".into()));
            ("npm install && npm run build".to_string(), PathBuf::from(format!("{name}.wasm")))
        }
    };
    files.push(("README.md".into(), readme(lang, role, name, &build, &output)));
    let io = |path: &Path, cause| ScaffoldError::Io { path: path.to_path_buf(), cause };
    let mut written = Vec::new();
    for (rel, text) in &files {
        let path = dir.join(rel);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(|e| io(parent, e))?;
        }
        std::fs::write(&path, text).map_err(|e| io(&path, e))?;
        written.push(PathBuf::from(rel));
    }
    #[cfg(unix)]
    if lang == Lang::Python {
        use std::os::unix::fs::PermissionsExt;
        let p = dir.join("build.sh");
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).map_err(|e| io(&p, e))?;
    }
    Ok(Project { dir, files: written, build, output })
}

fn readme(lang: Lang, role: ProjectRole, name: &str, build: &str, output: &Path) -> String {
    let (toolchain, test) = match lang {
        Lang::Rust => (
            "Rust with the `wasm32-wasip2` target (`rustup target add wasm32-wasip2`). The SDK is \
             vendored in `sdk/` (with its copy of the WIT package in `sdk/wit/`); the build needs the \
             crates `wit-bindgen` 0.63 and `dlmalloc` 0.2 (from the registry, or offline from cargo's \
             cache with `--offline`).",
            "cargo test    # the decision logic, natively",
        ),
        Lang::Python => (
            "componentize-py 0.25.1 (`pip install componentize-py==0.25.1`); `build.sh` runs \
             `componentize-py` from `PATH`, or `$COMPONENTIZE_PY`.",
            "python3 -c 'import ast,sys; ast.parse(open(sys.argv[1]).read())' MODULE.py",
        ),
        Lang::Js => (
            "Node.js 18+ and componentize-js 0.23.0 (`npm install` fetches it; an existing \
             `node_modules` with it works offline).",
            "node --check NAME.js",
        ),
    };
    let test = test.replace("MODULE", &name.replace('-', "_")).replace("NAME", name);
    let start = match (role, lang) {
        (ProjectRole::Planner, Lang::Rust) => "the engine's own planner (`defaults::greedy_plan`)",
        (ProjectRole::Planner, _) => "a first-fit planner (valid plans, simpler than the engine's)",
        _ => "the engine's default for its role",
    };
    let use_it = if role == ProjectRole::Planner {
        format!("{out}+defrag", out = output.display())
    } else {
        output.display().to_string()
    };
    format!(
        "# {name}\n\n\
         A wasmem {role} policy in {lang}, built against the WIT package `wasmem:policy@{WIT_VERSION}` \
         (world `{role}-policy`). It starts as {start}; change the \
         decision logic and keep the checks passing.\n\n\
         Build (one command, in this folder):\n\n```sh\n{build}\n```\n\n\
         It writes `{out}`. Check it and use it:\n\n```sh\n\
         wasmem policy check {out}\n\
         wasmem policy check {out} --trace TRACE.jsonl.gz     # on a real trace's calls\n\
         wasmem replay TRACE.jsonl.gz --policy {use_it}\n```\n\n\
         Toolchain: {toolchain}\n\n\
         Quick test: `{test}`\n\n\
         The value shapes of the WIT types in {lang} and the rules a decision must follow \
         are in the wasmem repository's `policies/README.md`.\n",
        out = output.display(),
    )
}

const RUST_MANIFEST: &str = r#"[package]
name = "{{NAME}}"
description = "A wasmem {{ROLE}} policy"
version = "0.1.0"
edition = "2021"
publish = false

[lib]
crate-type = ["cdylib", "rlib"]

[dependencies]
wasmem-policy-sdk = { path = "sdk" }

# A workspace of its own (also when created inside another cargo workspace).
[workspace]

[profile.release]
opt-level = "s"
lto = true
codegen-units = 1
strip = true
"#;

fn rust_source(role: ProjectRole) -> String {
    let body = match role {
        ProjectRole::Placement => RUST_PLACEMENT,
        ProjectRole::Reclamation => RUST_RECLAMATION,
        ProjectRole::Eviction => RUST_EVICTION,
        ProjectRole::Planner => RUST_PLANNER,
    };
    format!("{RUST_HEAD}{body}")
}

const RUST_HEAD: &str = r#"//! `{{NAME}}`: a wasmem {{ROLE}} policy (WIT `wasmem:policy@{{WIT}}`).
//!
//! Build: `cargo build --release --target wasm32-wasip2`, then
//! `wasmem policy check target/wasm32-wasip2/release/{{MODULE}}.wasm`.

#![cfg_attr(all(target_arch = "wasm32", not(test)), no_std)]

use wasmem_policy_sdk::prelude::*;

/// The policy's state: one instance lives in the component.
#[derive(Default)]
pub struct {{STRUCT}};

impl Policy for {{STRUCT}} {
    fn name(&self) -> &str {
        "{{NAME}}"
    }

    // Read `init` configuration keys here (`config.get_or("key", default)?`);
    // keys left unread are refused as unknown.
    fn configure(&mut self, _config: &Config) -> Result<(), String> {
        Ok(())
    }
}

"#;

const RUST_PLACEMENT: &str = r#"impl Placement for {{STRUCT}} {
    /// The pools decisions index: PyTorch's `small` and `large`.
    fn pools(&self) -> Vec<PoolSpec> {
        defaults::pytorch_pools()
    }

    /// PyTorch's placement; change it here. Mark a decision `cacheable`
    /// only if it holds for every size of its log2 size class.
    fn place(&mut self, req: &AllocRequest, _ctx: &PolicyContext) -> PlacementDecision {
        defaults::pytorch_placement(req.bytes)
    }
}

export!({{STRUCT}}: placement);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_requests_go_to_the_small_pool() {
        let req = AllocRequest { bytes: 4096, kind: TensorKind::Activation, stream_id: 0 };
        let d = {{STRUCT}}.place(&req, &PolicyContext::default());
        assert_eq!(d.pool, 0);
        assert!(d.round_to.is_power_of_two());
    }
}
"#;

const RUST_RECLAMATION: &str = r#"impl Reclamation for {{STRUCT}} {
    /// PyTorch's reclamation: release every cached segment when the device
    /// refused one, nothing otherwise. Override `plan` and `paged_segments`
    /// to compact, stitch or trim (WIT 0.2.0).
    fn reclaim(&mut self, trigger: &ReclaimTrigger, _ctx: &PolicyContext) -> ReclaimDecision {
        defaults::pytorch_reclaim(trigger)
    }
}

export!({{STRUCT}}: reclamation);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_phase_marker_releases_nothing() {
        let t = ReclaimTrigger::Phase(PhaseMarker { phase: Phase::Forward, step: 1 });
        assert_eq!({{STRUCT}}.reclaim(&t, &PolicyContext::default()).release_bytes, 0);
    }
}
"#;

const RUST_EVICTION: &str = r#"impl Eviction for {{STRUCT}} {
    /// Least recently used first, until the need is covered; never a
    /// candidate that is in use or pinned.
    fn choose_victims(&mut self, need_bytes: u64, candidates: &[EvictionCandidate], _ctx: &PolicyContext) -> Vec<u64> {
        defaults::lru_victims(need_bytes, candidates)
    }
}

export!({{STRUCT}}: eviction);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nothing_needed_nothing_chosen() {
        assert!({{STRUCT}}.choose_victims(0, &[], &PolicyContext::default()).is_empty());
    }
}
"#;

const RUST_PLANNER: &str = r#"impl Planner for {{STRUCT}} {
    /// The engine's own plan (`defaults::greedy_plan`: the cheapest of a
    /// time-order best-fit plan and greedy-by-size plans); change it here. The engine refuses a plan whose offsets
    /// are not multiples of 512, leave the arena, or overlap for requests
    /// live at the same time (see `defaults::plan_intervals`).
    fn plan(&mut self, profile: &StepProfile) -> Result<ArenaPlan, String> {
        Ok(defaults::greedy_plan(profile))
    }
}

export!({{STRUCT}}: planner);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_freed_block_is_reused() {
        let req = |bytes, freed_at| PlanRequest { bytes, kind: TensorKind::Temp, stream_id: 0, freed_at, wraps_to: None };
        let profile = StepProfile { step: 1, requests: vec![req(4096, Some(1)), req(4096, Some(2))] };
        let plan = {{STRUCT}}.plan(&profile).unwrap();
        assert_eq!(plan.offsets, vec![Some(0), Some(0)]);
        assert_eq!(plan.arena_bytes, 4096);
    }
}
"#;

const PYTHON_BUILD: &str = r#"#!/bin/sh
# Builds {{NAME}}.wasm from {{MODULE}}.py (componentize-py 0.25.1).
set -eu
cd "$(dirname "$0")"
"${COMPONENTIZE_PY:-componentize-py}" -d wit -w {{WORLD}} componentize -p . {{MODULE}} -o {{NAME}}.wasm
echo "wrote {{NAME}}.wasm"
"#;

fn python_source(role: ProjectRole) -> String {
    let head = r#""""{{NAME}}: a wasmem {{ROLE}} policy (WIT wasmem:policy@{{WIT}}, world {{WORLD}}).

Build with `sh build.sh` (componentize-py 0.25.1), check with
`wasmem policy check {{NAME}}.wasm`.

Value shapes: u64 fields are ints, enums are Enum members (TensorKind.ACTIVATION),
variants are classes (ReclaimTrigger_AllocFailed with .value), option is None
or the value; raise componentize_py_types.Err(text) for a result error.
"""
from componentize_py_types import Err
from wit_world import exports
from wit_world.imports import host
from wit_world.imports.host import LogLevel
from wit_world.imports import types


def reported(method):
    """Logs an unexpected exception through the host (at error level) before it
    propagates: the engine then gives the call the time to print the traceback
    and reports both with the failed call, instead of a bare deadline."""

    def call(*args):
        try:
            return method(*args)
        except Err:
            raise
        except BaseException as e:
            host.log(LogLevel.ERROR, f"{type(e).__name__}: {e}")
            raise

    return call


class Lifecycle(exports.Lifecycle):
    def name(self) -> str:
        return "{{NAME}}"

    @reported
    def init(self, config: str) -> None:
        if config.strip():
            raise Err(f"{{NAME}} takes no configuration (got {config!r})")

    def save_state(self) -> bytes:
        return b""

    def load_state(self, state: bytes) -> None:
        if state:
            raise Err("{{NAME}} keeps no state")
"#;
    let body = match role {
        ProjectRole::Placement => {
            r#"

SMALL = 1 << 20  # a log2 size-class boundary: every decision below holds for its whole class


class Placement(exports.Placement):
    @reported
    def pools(self):
        return [types.PoolSpec(name="small", release_when_empty=False),
                types.PoolSpec(name="large", release_when_empty=False)]

    @reported
    def place(self, req, ctx):
        if req.bytes < SMALL:
            return types.PlacementDecision(pool=0, round_to=512, segment_min=2 << 20,
                                           segment_round=2 << 20, split_min_remainder=512,
                                           max_waste=(1 << 64) - 1, cacheable=True)
        return types.PlacementDecision(pool=1, round_to=512, segment_min=20 << 20,
                                       segment_round=2 << 20, split_min_remainder=SMALL + 1,
                                       max_waste=(1 << 64) - 1, cacheable=True)
"#
        }
        ProjectRole::Reclamation => {
            r#"

ALL = (1 << 64) - 1


class Reclamation(exports.Reclamation):
    @reported
    def reclaim(self, trigger, ctx):
        # Release every cached segment when the device refused one, nothing otherwise.
        release = ALL if isinstance(trigger, types.ReclaimTrigger_AllocFailed) else 0
        return types.ReclaimDecision(release_bytes=release, pools=None)

    def paged_segments(self) -> bool:
        return False

    @reported
    def plan(self, trigger, ctx):
        d = self.reclaim(trigger, ctx)
        return types.ReclaimPlan(release_bytes=d.release_bytes, pools=d.pools,
                                 compact=None, stitch=False, trim=False)
"#
        }
        ProjectRole::Eviction => {
            r#"


class Eviction(exports.Eviction):
    @reported
    def choose_victims(self, need_bytes, candidates, ctx):
        # Least recently used first; never a candidate in use or pinned.
        order = sorted((c for c in candidates if not c.in_use and not c.pinned),
                       key=lambda c: (c.last_use, c.id))
        victims, got = [], 0
        for c in order:
            if got >= need_bytes:
                break
            victims.append(c.id)
            got += c.bytes
        return victims
"#
        }
        ProjectRole::Planner => {
            r#"

ALIGN = 512


def planned_bytes(nbytes):
    return -(-nbytes // ALIGN) * ALIGN


class Planner(exports.Planner):
    @reported
    def plan(self, profile):
        # First fit in allocation order: requests that wrap into the next step
        # get the bottom of the arena; the others take the lowest free range
        # once the blocks of the requests that ended before them are free.
        reqs = profile.requests
        n = len(reqs)
        offsets = [None] * n
        base = 0
        for k, r in enumerate(reqs):
            if r.freed_at is None and r.wraps_to is not None and 0 < r.wraps_to <= k:
                offsets[k] = base
                base += planned_bytes(r.bytes)
        free = []  # [offset, size], sorted by offset
        top = arena = base
        ending = [[] for _ in range(n + 1)]
        for t, r in enumerate(reqs):
            for off, size in ending[t]:
                i = 0
                while i < len(free) and free[i][0] < off:
                    i += 1
                if i > 0 and free[i - 1][0] + free[i - 1][1] == off:
                    i -= 1
                    off, size = free[i][0], size + free[i][1]
                    del free[i]
                if i < len(free) and off + size == free[i][0]:
                    size += free[i][1]
                    del free[i]
                if off + size == top:
                    top = off
                else:
                    free.insert(i, [off, size])
            known = r.freed_at is not None or (r.wraps_to is not None and r.wraps_to <= t)
            if offsets[t] is not None or not known:
                continue
            size = planned_bytes(r.bytes)
            hole = next((i for i, (_, s) in enumerate(free) if s >= size), None)
            if hole is None:
                off, top = top, top + size
            else:
                off = free[hole][0]
                if free[hole][1] == size:
                    del free[hole]
                else:
                    free[hole] = [off + size, free[hole][1] - size]
            offsets[t] = off
            arena = max(arena, off + size)
            end = n if r.freed_at is None else min(max(r.freed_at, t + 1), n)
            if end < n:
                ending[end].append((off, size))
        return types.ArenaPlan(arena_bytes=arena, offsets=offsets)

    @reported
    def plan_aliased(self, profile):
        # Steps whose output outlives its next instance are profiled two at a
        # time; an aliased plan (types.AliasedPlan: two windows over one
        # physical arena, the second with its end zones swapped) would serve
        # them at their live bound. None: the plain plan above serves.
        return None
"#
        }
    };
    format!("{head}{body}")
}

const JS_BUILD: &str = r#"// Builds {{NAME}}.wasm from {{NAME}}.js with componentize-js (world {{WORLD}}).
// Every WASI feature but stdio is off: an uncaught exception's message and
// stack reach the engine's error through stderr.
import { writeFile } from 'node:fs/promises';
import { dirname, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';
import { componentize } from '@bytecodealliance/componentize-js';

const here = dirname(fileURLToPath(import.meta.url));
const { component } = await componentize({
  sourcePath: resolve(here, '{{NAME}}.js'),
  witPath: resolve(here, 'wit'),
  worldName: '{{WORLD}}',
  disableFeatures: ['random', 'clocks', 'http', 'fetch-event'],
});
await writeFile(resolve(here, '{{NAME}}.wasm'), component);
console.log(`{{NAME}}.wasm: ${component.length} bytes`);
"#;

const JS_PACKAGE: &str = r#"{
  "name": "{{NAME}}",
  "version": "0.1.0",
  "private": true,
  "description": "A wasmem {{ROLE}} policy",
  "type": "module",
  "scripts": {
    "build": "node build.mjs"
  },
  "devDependencies": {
    "@bytecodealliance/componentize-js": "0.23.0"
  }
}
"#;

fn js_source(role: ProjectRole) -> String {
    let head = r#"// {{NAME}}: a wasmem {{ROLE}} policy (WIT wasmem:policy@{{WIT}}, world {{WORLD}}).
// Build with `npm install && npm run build`, check with `wasmem policy check {{NAME}}.wasm`.
//
// Value shapes: u64 values are BigInt (compare with 0n, add with +); enum cases
// are strings ('activation'); a variant is { tag: 'alloc-failed', val: {...} };
// an option is undefined or the value; record fields are camelCase
// (lastUse, inUse). Throw { payload: 'text' } for a result error; any other
// exception traps and is reported with its message.

export const lifecycle = {
  name() {
    return '{{NAME}}';
  },
  init(config) {
    if (config.trim().length > 0) throw { payload: `{{NAME}} takes no configuration (got '${config}')` };
  },
  saveState() {
    return new Uint8Array(0);
  },
  loadState(state) {
    if (state.length > 0) throw { payload: '{{NAME}} keeps no state' };
  },
};
"#;
    let body = match role {
        ProjectRole::Placement => {
            r#"
// A log2 size-class boundary: every decision below holds for its whole class.
const SMALL = 1n << 20n;
const NO_LIMIT = (1n << 64n) - 1n;

export const placement = {
  pools() {
    return [
      { name: 'small', releaseWhenEmpty: false },
      { name: 'large', releaseWhenEmpty: false },
    ];
  },
  place(req, ctx) {
    if (req.bytes < SMALL) {
      return { pool: 0, roundTo: 512n, segmentMin: 2n << 20n, segmentRound: 2n << 20n,
               splitMinRemainder: 512n, maxWaste: NO_LIMIT, cacheable: true };
    }
    return { pool: 1, roundTo: 512n, segmentMin: 20n << 20n, segmentRound: 2n << 20n,
             splitMinRemainder: SMALL + 1n, maxWaste: NO_LIMIT, cacheable: true };
  },
};
"#
        }
        ProjectRole::Reclamation => {
            r#"
const ALL = (1n << 64n) - 1n;

// Release every cached segment when the device refused one, nothing otherwise.
function release(trigger, ctx) {
  return { releaseBytes: trigger.tag === 'alloc-failed' ? ALL : 0n, pools: undefined };
}

export const reclamation = {
  reclaim(trigger, ctx) {
    return release(trigger, ctx);
  },
  pagedSegments() {
    return false;
  },
  // WIT 0.2.0: the release, and no compaction, stitching or trimming.
  plan(trigger, ctx) {
    const d = release(trigger, ctx);
    return { releaseBytes: d.releaseBytes, pools: d.pools, compact: undefined, stitch: false, trim: false };
  },
};
"#
        }
        ProjectRole::Eviction => {
            r#"
export const eviction = {
  // Least recently used first; never a candidate in use or pinned.
  chooseVictims(needBytes, candidates, ctx) {
    const order = candidates
      .filter((c) => !c.inUse && !c.pinned)
      .sort((a, b) => (a.lastUse < b.lastUse ? -1 : a.lastUse > b.lastUse ? 1 : a.id < b.id ? -1 : a.id > b.id ? 1 : 0));
    const victims = [];
    let got = 0n;
    for (const c of order) {
      if (got >= needBytes) break;
      victims.push(c.id);
      got += c.bytes;
    }
    return victims;
  },
};
"#
        }
        ProjectRole::Planner => {
            r#"
const ALIGN = 512n;
const planned = (bytes) => ((bytes + ALIGN - 1n) / ALIGN) * ALIGN;

export const planner = {
  // First fit in allocation order: requests that wrap into the next step get
  // the bottom of the arena; the others take the lowest free range once the
  // blocks of the requests that ended before them are free. Sizes and
  // offsets are BigInt; freedAt and wrapsTo are Numbers (or undefined).
  plan(profile) {
    const reqs = profile.requests;
    const n = reqs.length;
    const offsets = new Array(n).fill(undefined);
    let base = 0n;
    reqs.forEach((r, k) => {
      if (r.freedAt === undefined && r.wrapsTo !== undefined && r.wrapsTo > 0 && r.wrapsTo <= k) {
        offsets[k] = base;
        base += planned(r.bytes);
      }
    });
    const free = []; // [offset, size], sorted by offset
    let top = base;
    let arena = base;
    const ending = Array.from({ length: n + 1 }, () => []);
    const give = (off, size) => {
      let i = 0;
      while (i < free.length && free[i][0] < off) i++;
      if (i > 0 && free[i - 1][0] + free[i - 1][1] === off) {
        i--;
        off = free[i][0];
        size += free[i][1];
        free.splice(i, 1);
      }
      if (i < free.length && off + size === free[i][0]) {
        size += free[i][1];
        free.splice(i, 1);
      }
      if (off + size === top) top = off;
      else free.splice(i, 0, [off, size]);
    };
    for (let t = 0; t < n; t++) {
      for (const [off, size] of ending[t]) give(off, size);
      const r = reqs[t];
      const known = r.freedAt !== undefined || (r.wrapsTo !== undefined && r.wrapsTo <= t);
      if (offsets[t] !== undefined || !known) continue;
      const size = planned(r.bytes);
      let off;
      const hole = free.findIndex(([, s]) => s >= size);
      if (hole < 0) {
        off = top;
        top += size;
      } else {
        off = free[hole][0];
        if (free[hole][1] === size) free.splice(hole, 1);
        else free[hole] = [off + size, free[hole][1] - size];
      }
      offsets[t] = off;
      if (off + size > arena) arena = off + size;
      const end = r.freedAt === undefined ? n : Math.min(Math.max(r.freedAt, t + 1), n);
      if (end < n) ending[end].push([off, size]);
    }
    return { arenaBytes: arena, offsets };
  },

  // Steps whose output outlives its next instance are profiled two at a time;
  // an aliased plan ({ arenaBytes, zoneBytes, offsets }: two windows over one
  // physical arena, the second with its end zones swapped) would serve them at
  // their live bound. undefined: the plain plan above serves.
  planAliased(profile) {
    return undefined;
  },
};
"#
        }
    };
    format!("{head}{body}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        for ok in ["a", "my-policy", "lru2", "x-1-y"] {
            assert!(valid_name(ok), "{ok}");
        }
        for bad in ["", "1x", "My", "a--b", "a-", "a_b", "a b", &"x".repeat(65)] {
            assert!(!valid_name(bad), "{bad}");
        }
        assert_eq!(camel("my-lru-policy"), "MyLruPolicy");
    }

    #[test]
    fn the_embedded_sdk_is_self_contained() {
        let manifest = SDK_FILES[0].1;
        assert!(!manifest.contains(".workspace = true"), "the SDK manifest must not inherit from a workspace");
        let bindings = SDK_FILES.iter().find(|(f, _)| *f == "src/bindings.rs").unwrap().1;
        assert!(bindings.contains(r#"path: "wit""#) && !bindings.contains("../"), "bindings must use sdk/wit");
    }

    #[test]
    fn a_project_refuses_a_bad_name_and_a_full_directory() {
        let d = tempfile::tempdir().unwrap();
        assert!(matches!(new_project(Lang::Js, Role::Eviction, "Bad", Some(d.path())), Err(ScaffoldError::Name(_))));
        std::fs::write(d.path().join("x"), "").unwrap();
        assert!(matches!(new_project(Lang::Js, Role::Eviction, "ok", Some(d.path())), Err(ScaffoldError::Exists(_))));
        let p = new_project(Lang::Python, Role::Reclamation, "my-reclaim", Some(&d.path().join("p"))).unwrap();
        assert!(p.files.contains(&PathBuf::from("my_reclaim.py")) && p.files.contains(&PathBuf::from("wit/types.wit")));
        let text = std::fs::read_to_string(p.dir.join("build.sh")).unwrap();
        assert!(text.contains("-w reclamation-policy") && text.contains("my_reclaim -o my-reclaim.wasm"), "{text}");
    }
}
