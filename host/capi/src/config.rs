//! Configuration from environment variables, read once at first use.
//!
//! | variable | meaning | default |
//! |---|---|---|
//! | `WASMEM_POLICY` | policy spec (built-in name, shipped name, `.wasm` path, `a+b`) | `lifecycle` |
//! | `WASMEM_DEVICE` | `cuda` (the real GPU) or `sim` (simulated, for tests) | `cuda` |
//! | `WASMEM_SIM_CAPACITY` | capacity of the `sim` device, e.g. `8GiB` | `80GiB` |
//! | `WASMEM_TRACE_OUT` | record a trace v1 and write it to this path at exit | off |
//! | `WASMEM_LOG` | `tracing` filter for the library's log (stderr) | `warn` |

use std::path::PathBuf;

use wasmem::types::{parse_size, GIB};

/// The policy spec used when `WASMEM_POLICY` is unset or empty.
pub const DEFAULT_POLICY: &str = "lifecycle";

/// The capacity of the `sim` device when `WASMEM_SIM_CAPACITY` is unset.
pub const DEFAULT_SIM_CAPACITY: u64 = 80 * GIB;

/// Which device backend serves the requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// The real GPU through the CUDA driver.
    Cuda,
    /// The simulated device of this capacity (addresses are not memory).
    Sim {
        /// Capacity in bytes.
        capacity: u64,
    },
}

/// The library's configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// Policy spec for all three roles.
    pub policy: String,
    /// Device backend.
    pub backend: Backend,
    /// Where the trace goes at exit; tracing is on iff this is set.
    pub trace_out: Option<PathBuf>,
}

/// Why the configuration could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// `WASMEM_DEVICE` is neither `cuda` nor `sim`.
    #[error("WASMEM_DEVICE=`{0}` is not a device: expected `cuda` or `sim`")]
    Device(String),
    /// `WASMEM_SIM_CAPACITY` is not a size.
    #[error("WASMEM_SIM_CAPACITY: {0}")]
    Capacity(String),
}

impl Config {
    /// Reads the configuration from the process environment.
    pub fn from_env() -> Result<Config, ConfigError> {
        Config::from_lookup(|k| std::env::var(k).ok())
    }

    /// Reads the configuration through `get` (a variable's value, `None` when
    /// unset); empty values count as unset.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Config, ConfigError> {
        let get = |k: &str| get(k).map(|v| v.trim().to_string()).filter(|v| !v.is_empty());
        let policy = get("WASMEM_POLICY").unwrap_or_else(|| DEFAULT_POLICY.to_string());
        let backend = match get("WASMEM_DEVICE").as_deref().map(str::to_ascii_lowercase).as_deref() {
            None | Some("cuda") => Backend::Cuda,
            Some("sim") => {
                let capacity = match get("WASMEM_SIM_CAPACITY") {
                    Some(s) => parse_size(&s).map_err(|e| ConfigError::Capacity(e.to_string()))?,
                    None => DEFAULT_SIM_CAPACITY,
                };
                Backend::Sim { capacity }
            }
            Some(other) => return Err(ConfigError::Device(other.to_string())),
        };
        let trace_out = get("WASMEM_TRACE_OUT").map(PathBuf::from);
        Ok(Config { policy, backend, trace_out })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(vars: &[(&str, &str)]) -> Result<Config, ConfigError> {
        Config::from_lookup(|k| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string()))
    }

    #[test]
    fn defaults() {
        let c = cfg(&[]).unwrap();
        assert_eq!(c, Config { policy: "lifecycle".into(), backend: Backend::Cuda, trace_out: None });
    }

    #[test]
    fn sim_with_capacity_and_trace() {
        let c = cfg(&[
            ("WASMEM_DEVICE", "sim"),
            ("WASMEM_SIM_CAPACITY", "8GiB"),
            ("WASMEM_TRACE_OUT", "/tmp/t.jsonl"),
            ("WASMEM_POLICY", " pytorch "),
        ])
        .unwrap();
        assert_eq!(c.backend, Backend::Sim { capacity: 8 * GIB });
        assert_eq!(c.policy, "pytorch");
        assert_eq!(c.trace_out, Some(PathBuf::from("/tmp/t.jsonl")));
    }

    #[test]
    fn errors_name_the_variable() {
        assert!(cfg(&[("WASMEM_DEVICE", "tpu")]).unwrap_err().to_string().contains("WASMEM_DEVICE"));
        let e = cfg(&[("WASMEM_DEVICE", "sim"), ("WASMEM_SIM_CAPACITY", "lots")]).unwrap_err();
        assert!(e.to_string().contains("WASMEM_SIM_CAPACITY"), "{e}");
        assert_eq!(cfg(&[("WASMEM_POLICY", "")]).unwrap().policy, DEFAULT_POLICY);
    }
}
