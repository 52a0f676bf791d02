//! `wasmem policy …`: check, new, list, cache.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

use crate::args::PolicyCommand;
use wasmem::policy::check::{check_trace, check_with, CheckOptions, TraceOptions};
use wasmem::policy::{locate_shipped, CacheDir, Shipped, SHIPPED_NAMES};

/// The component a `policy check` argument names: a file, or a shipped
/// policy (an embedded one is written to a temporary file, kept in `keep`).
fn component(arg: &Path, keep: &mut Option<tempfile::TempDir>) -> Result<PathBuf> {
    let name = arg.to_string_lossy();
    if arg.is_file() || name.contains('/') || name.ends_with(".wasm") {
        return Ok(arg.to_path_buf());
    }
    match locate_shipped(&name) {
        Ok(Shipped::File(p)) => Ok(p),
        Ok(Shipped::Embedded(bytes)) => {
            let dir = tempfile::tempdir().context("cannot create a temporary directory")?;
            let path = dir.path().join(format!("{name}.wasm"));
            std::fs::write(&path, bytes).with_context(|| format!("cannot write {}", path.display()))?;
            *keep = Some(dir);
            Ok(path)
        }
        Err(tried) => bail!(
            "{name}: no such file, and not a shipped policy found at {}",
            tried.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
        ),
    }
}

/// Writes `text` to standard output; a closed pipe (`| head`) ends the
/// output quietly instead of panicking like `print!`.
fn say(text: &str) -> Result<()> {
    match std::io::stdout().lock().write_all(text.as_bytes()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e).context("cannot write to standard output"),
        _ => Ok(()),
    }
}

/// Runs a `policy` subcommand.
pub fn run(cmd: PolicyCommand) -> Result<()> {
    match cmd {
        PolicyCommand::Check { file, deadline_ms, config, trace, device_mem } => {
            let rt = crate::runtime(deadline_ms)?;
            let mut keep = None;
            let path = component(&file, &mut keep)?;
            let verdict = match trace {
                Some(trace) => check_trace(rt, &path, &TraceOptions { trace, device_mem, config }),
                None => {
                    if device_mem.is_some() {
                        bail!("--device-mem goes with --trace");
                    }
                    check_with(rt, &path, &CheckOptions { config, ..Default::default() })
                }
            };
            say(&verdict.to_string())?;
            if !verdict.passed() {
                bail!("{} failed the conformance suite", file.display());
            }
            Ok(())
        }
        PolicyCommand::New { lang, role, name, dir } => {
            let p = wasmem::policy::scaffold::new_project(lang, role, &name, dir.as_deref())?;
            say(&format!(
                "created {} ({lang} {role} policy `{name}`, {} files)\nbuild:  cd {} && {}\ncheck:  wasmem policy check {}\n",
                p.dir.display(),
                p.files.len(),
                p.dir.display(),
                p.build,
                p.dir.join(&p.output).display()
            ))
        }
        PolicyCommand::List => {
            let mut text = String::new();
            for name in SHIPPED_NAMES {
                text.push_str(&match locate_shipped(name) {
                    Ok(found) => format!("{name:<18} {found}\n"),
                    Err(tried) => format!(
                        "{name:<18} not found (looked at {})\n",
                        tried.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
                    ),
                });
            }
            say(&text)
        }
        PolicyCommand::Cache { clean } => {
            let Some(dir) = CacheDir::Default.resolve() else {
                return say("no artifact cache: neither $WASMEM_CACHE_DIR, $XDG_CACHE_HOME nor $HOME is set\n");
            };
            let human = wasmem::types::human_bytes;
            if clean {
                let r = wasmem::policy::clean_cache(&dir).with_context(|| format!("cleaning {}", dir.display()))?;
                say(&format!("{}: removed {} artifacts ({})\n", dir.display(), r.files, human(r.bytes)))
            } else {
                let u = wasmem::policy::cache_usage(&dir).with_context(|| format!("reading {}", dir.display()))?;
                say(&format!(
                    "{}: {} artifacts, {} (bounded by $WASMEM_CACHE_MAX_BYTES, default {}; \
                     `wasmem policy cache --clean` removes them)\n",
                    dir.display(),
                    u.files,
                    human(u.bytes),
                    human(wasmem::policy::DEFAULT_CACHE_MAX_BYTES)
                ))
            }
        }
    }
}
