//! Loading a policy component: read, compile or fetch from the artifact
//! cache, inspect its exports (which roles, which WIT version), link its
//! imports once into an `InstancePre`.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use wasmtime::component::{Component, InstancePre};

use super::bindings::{WitVersion, WIT_PACKAGE};
use super::cache::LoadSource;
use super::error::LoadError;
use super::guests::Indices;
use super::host::HostState;
use super::Runtime;
use crate::decision::Role;

pub(crate) struct LoadedInner {
    pub runtime: Runtime,
    pub label: String,
    pub path: Option<PathBuf>,
    pub pre: InstancePre<HostState>,
    pub indices: Indices,
    pub version: WitVersion,
    pub roles: Vec<Role>,
    /// Whether it exports `planner` (0.3.0 on).
    pub planner: bool,
    pub imports_wasi: bool,
    pub source: LoadSource,
    pub load_time: Duration,
}

/// A compiled and linked policy component, ready to instantiate. Cheap to
/// clone; instantiate it as often as needed (each instance has its own
/// store and state).
#[derive(Clone)]
pub struct Loaded {
    pub(crate) inner: Arc<LoadedInner>,
}

impl std::fmt::Debug for Loaded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Loaded")
            .field("label", &self.inner.label)
            .field("roles", &self.inner.roles)
            .field("source", &self.inner.source)
            .finish_non_exhaustive()
    }
}

impl Loaded {
    /// The label (file stem) used in messages until `lifecycle.name` is known.
    pub fn label(&self) -> &str {
        &self.inner.label
    }

    /// The file it was loaded from, if any.
    pub fn path(&self) -> Option<&Path> {
        self.inner.path.as_deref()
    }

    /// The decision roles the component exports.
    pub fn roles(&self) -> &[Role] {
        &self.inner.roles
    }

    /// Whether it exports `role`.
    pub fn exports(&self, role: Role) -> bool {
        self.inner.roles.contains(&role)
    }

    /// Whether it exports the planner (`wasmem:policy/planner`, 0.3.0 on).
    pub fn exports_planner(&self) -> bool {
        self.inner.planner
    }

    /// The version of the `wasmem:policy` WIT package it was built against.
    pub fn wit_version(&self) -> WitVersion {
        self.inner.version
    }

    /// Whether it imports WASI interfaces (served by a deny-all context).
    pub fn imports_wasi(&self) -> bool {
        self.inner.imports_wasi
    }

    /// Whether the component came from the artifact cache or was compiled.
    pub fn source(&self) -> LoadSource {
        self.inner.source
    }

    /// Time the load took (read + compile or deserialize + link).
    pub fn load_time(&self) -> Duration {
        self.inner.load_time
    }
}

fn label_of(path: &Path) -> String {
    path.file_stem().map_or_else(|| path.display().to_string(), |s| s.to_string_lossy().into_owned())
}

impl Runtime {
    /// Loads the component at `path`.
    pub fn load(&self, path: impl AsRef<Path>) -> Result<Loaded, LoadError> {
        let start = Instant::now();
        let path = path.as_ref();
        let label = label_of(path);
        let bytes = std::fs::read(path).map_err(|e| LoadError::Io {
            policy: label.clone(),
            path: path.to_path_buf(),
            cause: e.to_string(),
        })?;
        self.load_inner(label, Some(path.to_path_buf()), &bytes, start)
    }

    /// Loads a component from `bytes` (a binary component) named `label`.
    pub fn load_bytes(&self, label: &str, bytes: &[u8]) -> Result<Loaded, LoadError> {
        self.load_inner(label.to_string(), None, bytes, Instant::now())
    }

    fn load_inner(
        &self,
        label: String,
        path: Option<PathBuf>,
        bytes: &[u8],
        start: Instant,
    ) -> Result<Loaded, LoadError> {
        let engine = &self.inner.engine;
        let compile_err = |e: wasmtime::Error| LoadError::Compile { policy: label.clone(), cause: format!("{e:#}") };
        if !bytes.starts_with(b"\0asm") {
            return Err(LoadError::Compile {
                policy: label,
                cause: "not a WebAssembly binary (no `\\0asm` header)".into(),
            });
        }
        let (component, source) = match &self.inner.cache {
            Some(cache) => cache.load(engine, bytes).map_err(compile_err)?,
            None => (Component::new(engine, bytes).map_err(compile_err)?, LoadSource::Compiled),
        };
        let Inspected { version, roles, planner, imports_wasi } = inspect(&label, &component, engine)?;
        let pre = self
            .inner
            .linker
            .instantiate_pre(&component)
            .map_err(|e| LoadError::Link { policy: label.clone(), cause: format!("{e:#}") })?;
        let indices = Indices::new(version, &pre, &roles, planner)
            .map_err(|e| LoadError::Link { policy: label.clone(), cause: format!("{e:#}") })?;
        let load_time = start.elapsed();
        tracing::debug!(policy = %label, %version, ?roles, planner, ?source, ?load_time, "policy component loaded");
        Ok(Loaded {
            inner: Arc::new(LoadedInner {
                runtime: self.clone(),
                label,
                path,
                pre,
                indices,
                version,
                roles,
                planner,
                imports_wasi,
                source,
                load_time,
            }),
        })
    }
}

/// What [`inspect`] finds in a component.
struct Inspected {
    version: WitVersion,
    roles: Vec<Role>,
    planner: bool,
    imports_wasi: bool,
}

/// The WIT version, roles and planner a component exports, and whether it
/// imports WASI. Refuses versions the engine does not speak, a component
/// whose `wasmem:policy` interfaces are of two versions, and components
/// without a role (or planner) or lifecycle.
fn inspect(label: &str, component: &Component, engine: &wasmtime::Engine) -> Result<Inspected, LoadError> {
    let ty = component.component_type();
    let mut roles = Vec::new();
    let mut planner = false;
    let mut lifecycle = false;
    let mut names = Vec::new();
    let prefix = format!("{WIT_PACKAGE}/");
    // The version of the first `wasmem:policy` interface seen, and its name.
    let mut found: Option<(WitVersion, String)> = None;
    let mut version_of = |name: &str| -> Result<Option<String>, LoadError> {
        let Some(rest) = name.strip_prefix(&prefix) else { return Ok(None) };
        let (iface, text) = rest.split_once('@').unwrap_or((rest, ""));
        let version = WitVersion::parse(text).ok_or_else(|| LoadError::WrongVersion {
            policy: label.to_string(),
            interface: name.to_string(),
            expected: WitVersion::supported(),
        })?;
        match &found {
            None => found = Some((version, name.to_string())),
            Some((first, first_name)) if *first != version => {
                return Err(LoadError::MixedVersions {
                    policy: label.to_string(),
                    first: first_name.clone(),
                    second: name.to_string(),
                })
            }
            Some(_) => {}
        }
        Ok(Some(iface.to_string()))
    };
    for (name, _) in ty.exports(engine) {
        names.push(name.to_string());
        match version_of(name)?.as_deref() {
            Some("lifecycle") => lifecycle = true,
            Some("placement") => roles.push(Role::Placement),
            Some("reclamation") => roles.push(Role::Reclamation),
            Some("eviction") => roles.push(Role::Eviction),
            Some("planner") => planner = true,
            _ => {}
        }
    }
    let mut imports_wasi = false;
    for (name, _) in ty.imports(engine) {
        imports_wasi |= name.starts_with("wasi:");
        version_of(name)?;
    }
    let version = found.map(|(v, _)| v);
    let expected = version.map_or_else(WitVersion::supported, |v| v.to_string());
    if roles.is_empty() && !planner {
        return Err(LoadError::NoRole {
            policy: label.to_string(),
            exports: if names.is_empty() { "nothing".into() } else { names.join(", ") },
            expected,
        });
    }
    let Some(version) = version.filter(|_| lifecycle) else {
        return Err(LoadError::NoLifecycle { policy: label.to_string(), expected });
    };
    roles.sort_by_key(|r| *r as u8);
    Ok(Inspected { version, roles, planner, imports_wasi })
}
