//! Configuration from environment variables, read once at first use.
//!
//! | variable | meaning | default |
//! |---|---|---|
//! | `WASMEM_POLICY` | policy spec (built-in name, shipped name, `.wasm` path, `a+b`) | `lifecycle` |
//! | `WASMEM_DEVICE` | `cuda` (the real GPU) or `sim` (simulated, for tests) | `cuda` |
//! | `WASMEM_SIM_CAPACITY` | capacity of the `sim` device, e.g. `8GiB` | `80GiB` |
//! | `WASMEM_SIM_DEVICES` | how many `sim` devices there are (devices `0..n`) | `8` |
//! | `WASMEM_TRACE_OUT` | record a trace v1 and write it to this path at exit | off |
//! | `WASMEM_PLAN_CACHE` | plan cache file of planned placement (`{rank}` and `{device}` in it are replaced): read at device open, the run's plans kept there | off |
//! | `WASMEM_SHADOW` | policy spec of a bookkeeping-only shadow fed the same events (per device) | off |
//! | `WASMEM_CTL` | serve the control socket: `1` (the default path, named by `RANK`/`LOCAL_RANK`) or a socket path | off |
//! | `RANK`, `LOCAL_RANK` | the process's rank in its job (torchrun sets them): socket name, `ctl status` | — |
//! | `WASMEM_LOG` | `tracing` filter for the library's log (stderr) | `warn` |
//!
//! `wasmem_init` (what `wasmem.torch.enable` calls) takes the same settings
//! as a JSON object, over the environment ([`Config::apply_json`]).

use std::path::PathBuf;

use serde_json::Value;
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
    /// Where the trace goes at exit.
    pub trace_out: Option<PathBuf>,
    /// Record a trace (kept in memory, written by `wasmem_dump_trace`); on
    /// whenever `trace_out` is set.
    pub trace: bool,
    /// Policy spec of a shadow per device.
    pub shadow: Option<String>,
    /// The control socket to serve.
    pub ctl: Option<PathBuf>,
    /// The plan cache, as given (`{rank}` and `{device}` not yet replaced:
    /// [`Config::plan_cache_path`]).
    pub plan_cache: Option<String>,
    /// `RANK`, when set.
    pub rank: Option<u32>,
    /// `LOCAL_RANK`, when set.
    pub local_rank: Option<u32>,
    /// How many `sim` devices there are.
    pub sim_devices: u32,
}

/// How many `sim` devices there are when `WASMEM_SIM_DEVICES` is unset.
pub const DEFAULT_SIM_DEVICES: u32 = 8;

/// Why the configuration could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// `WASMEM_DEVICE` is neither `cuda` nor `sim`.
    #[error("WASMEM_DEVICE=`{0}` is not a device: expected `cuda` or `sim`")]
    Device(String),
    /// `WASMEM_SIM_CAPACITY` is not a size.
    #[error("WASMEM_SIM_CAPACITY: {0}")]
    Capacity(String),
    /// `RANK` or `LOCAL_RANK` is not a number.
    #[error("{var}=`{value}` is not a rank (a non-negative integer)")]
    Rank {
        /// The variable.
        var: &'static str,
        /// Its value.
        value: String,
    },
    /// `WASMEM_SIM_DEVICES` is not a positive number.
    #[error("WASMEM_SIM_DEVICES=`{0}` is not a positive number of devices")]
    SimDevices(String),
    /// The JSON given to `wasmem_init` is not an object of known settings.
    #[error("wasmem_init: {0}")]
    Json(String),
}

/// The keys `wasmem_init` takes, each as its environment variable means it.
pub const JSON_KEYS: [&str; 10] =
    ["policy", "device", "sim_capacity", "sim_devices", "trace_out", "trace", "shadow", "ctl", "rank", "plan_cache"];

/// The control socket of this process by default: in the default socket
/// directory, named by the rank (`rank<RANK>-<pid>.sock`, else
/// `local<LOCAL_RANK>-<pid>.sock`, else `<pid>.sock`), so that each process
/// of a job has its own and `wasmem ctl` can tell them apart.
pub fn default_ctl_path(rank: Option<u32>, local_rank: Option<u32>) -> PathBuf {
    let pid = std::process::id();
    let name = match (rank, local_rank) {
        (Some(r), _) => format!("rank{r}-{pid}.sock"),
        (None, Some(l)) => format!("local{l}-{pid}.sock"),
        (None, None) => format!("{pid}.sock"),
    };
    wasmem::ctl::default_socket_dir().join(name)
}

/// `WASMEM_CTL`'s meaning: off, the default path, or a path.
fn ctl_setting(v: &str, rank: Option<u32>, local_rank: Option<u32>) -> Option<PathBuf> {
    match v.to_ascii_lowercase().as_str() {
        "" | "0" | "false" | "off" | "no" => None,
        "1" | "true" | "on" | "yes" => Some(default_ctl_path(rank, local_rank)),
        _ => Some(PathBuf::from(v)),
    }
}

impl Config {
    /// The plan cache file of device `ordinal`: `{rank}` replaced by the
    /// rank (else the local rank, else 0) and `{device}` by the ordinal, so
    /// that the processes of a job can each keep their own.
    pub fn plan_cache_path(&self, ordinal: usize) -> Option<PathBuf> {
        let rank = self.rank.or(self.local_rank).unwrap_or(0);
        let t = self.plan_cache.as_ref()?;
        Some(PathBuf::from(t.replace("{rank}", &rank.to_string()).replace("{device}", &ordinal.to_string())))
    }

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
        let rank_of = |var: &'static str| -> Result<Option<u32>, ConfigError> {
            get(var).map(|v| v.parse::<u32>().map_err(|_| ConfigError::Rank { var, value: v })).transpose()
        };
        let (rank, local_rank) = (rank_of("RANK")?, rank_of("LOCAL_RANK")?);
        let sim_devices = match get("WASMEM_SIM_DEVICES") {
            None => DEFAULT_SIM_DEVICES,
            Some(v) => v.parse::<u32>().ok().filter(|&n| n > 0).ok_or(ConfigError::SimDevices(v))?,
        };
        Ok(Config {
            policy,
            backend,
            trace: trace_out.is_some(),
            trace_out,
            shadow: get("WASMEM_SHADOW"),
            plan_cache: get("WASMEM_PLAN_CACHE"),
            ctl: get("WASMEM_CTL").and_then(|v| ctl_setting(&v, rank, local_rank)),
            rank,
            local_rank,
            sim_devices,
        })
    }

    /// Applies the settings of a `wasmem_init` JSON object over this
    /// configuration: `policy`, `shadow` (string or null), `device` (`cuda`
    /// or `sim`), `sim_capacity` (a size string or bytes), `trace` (bool),
    /// `sim_devices` (a positive number), `trace_out` (path or null), `ctl` (true, false, null or a socket
    /// path), `rank` (number or null). Unknown keys are refused by name.
    pub fn apply_json(&mut self, json: &str) -> Result<(), ConfigError> {
        let bad = |m: String| ConfigError::Json(m);
        let v: Value = serde_json::from_str(json).map_err(|e| bad(format!("not JSON: {e}")))?;
        let obj = v.as_object().ok_or_else(|| bad("expected a JSON object".into()))?;
        if let Some(k) = obj.keys().find(|k| !JSON_KEYS.contains(&k.as_str())) {
            return Err(bad(format!("unknown setting `{k}` (settings: {})", JSON_KEYS.join(", "))));
        }
        let text = |k: &str| -> Result<Option<String>, ConfigError> {
            match obj.get(k) {
                None | Some(Value::Null) => Ok(None),
                Some(Value::String(s)) if !s.trim().is_empty() => Ok(Some(s.trim().to_string())),
                Some(other) => Err(bad(format!("`{k}` must be a non-empty string or null, not {other}"))),
            }
        };
        if let Some(p) = text("policy")? {
            self.policy = p;
        }
        if obj.contains_key("shadow") {
            self.shadow = text("shadow")?;
        }
        if obj.contains_key("rank") {
            self.rank = match obj.get("rank") {
                Some(Value::Null) => None,
                Some(r) => Some(
                    r.as_u64()
                        .and_then(|r| u32::try_from(r).ok())
                        .ok_or_else(|| bad(format!("`rank` must be a non-negative integer or null, not {r}")))?,
                ),
                None => None,
            };
        }
        let capacity = match obj.get("sim_capacity") {
            None | Some(Value::Null) => None,
            Some(Value::Number(n)) => {
                Some(n.as_u64().ok_or_else(|| bad(format!("`sim_capacity` must be a size, not {n}")))?)
            }
            Some(Value::String(s)) => Some(parse_size(s).map_err(|e| bad(format!("`sim_capacity`: {e}")))?),
            Some(other) => return Err(bad(format!("`sim_capacity` must be a size, not {other}"))),
        };
        match text("device")?.map(|d| d.to_ascii_lowercase()).as_deref() {
            None => {}
            Some("cuda") => self.backend = Backend::Cuda,
            Some("sim") => {
                let current = match self.backend {
                    Backend::Sim { capacity } => capacity,
                    Backend::Cuda => DEFAULT_SIM_CAPACITY,
                };
                self.backend = Backend::Sim { capacity: current };
            }
            Some(other) => return Err(ConfigError::Device(other.to_string())),
        }
        if let (Some(c), Backend::Sim { capacity }) = (capacity, &mut self.backend) {
            *capacity = c;
        }
        match obj.get("sim_devices") {
            None | Some(Value::Null) => {}
            Some(v) => {
                self.sim_devices = v
                    .as_u64()
                    .and_then(|n| u32::try_from(n).ok())
                    .filter(|&n| n > 0)
                    .ok_or_else(|| bad(format!("`sim_devices` must be a positive number of devices, not {v}")))?
            }
        }
        if obj.contains_key("plan_cache") {
            self.plan_cache = text("plan_cache")?;
        }
        if obj.contains_key("trace_out") {
            self.trace_out = text("trace_out")?.map(PathBuf::from);
        }
        match obj.get("trace") {
            None | Some(Value::Null) => {}
            Some(Value::Bool(b)) => self.trace = *b,
            Some(other) => return Err(bad(format!("`trace` must be true or false, not {other}"))),
        }
        self.trace |= self.trace_out.is_some();
        match obj.get("ctl") {
            None => {}
            Some(Value::Null) | Some(Value::Bool(false)) => self.ctl = None,
            Some(Value::Bool(true)) => self.ctl = Some(default_ctl_path(self.rank, self.local_rank)),
            Some(Value::String(s)) => self.ctl = ctl_setting(s.trim(), self.rank, self.local_rank),
            Some(other) => return Err(bad(format!("`ctl` must be true, false, null or a socket path, not {other}"))),
        }
        Ok(())
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
        assert_eq!(c.policy, "lifecycle");
        assert_eq!(c.backend, Backend::Cuda);
        assert_eq!((c.trace_out, c.trace, c.shadow, c.ctl, c.rank), (None, false, None, None, None));
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
        let e = cfg(&[("RANK", "one")]).unwrap_err().to_string();
        assert!(e.contains("RANK=`one`"), "{e}");
    }

    #[test]
    fn ctl_sockets_are_named_by_rank() {
        let c = cfg(&[("WASMEM_CTL", "1"), ("RANK", "3"), ("LOCAL_RANK", "1")]).unwrap();
        let name = c.ctl.unwrap().file_name().unwrap().to_string_lossy().into_owned();
        assert!(name.starts_with("rank3-") && name.ends_with(".sock"), "{name}");
        let c = cfg(&[("WASMEM_CTL", "on"), ("LOCAL_RANK", "2")]).unwrap();
        assert!(c.ctl.unwrap().to_string_lossy().contains("local2-"));
        assert_eq!(cfg(&[("WASMEM_CTL", "/tmp/x.sock")]).unwrap().ctl, Some(PathBuf::from("/tmp/x.sock")));
        assert_eq!(cfg(&[("WASMEM_CTL", "0")]).unwrap().ctl, None);
    }

    #[test]
    fn plan_cache_paths_are_per_rank_and_device() {
        let c = cfg(&[("WASMEM_PLAN_CACHE", "/tmp/plans.rank{rank}.dev{device}.json"), ("LOCAL_RANK", "2")]).unwrap();
        assert_eq!(c.plan_cache_path(5), Some(PathBuf::from("/tmp/plans.rank2.dev5.json")));
        let mut c = cfg(&[("RANK", "7")]).unwrap();
        assert_eq!(c.plan_cache_path(0), None);
        c.apply_json(r#"{"plan_cache":"p{rank}.json"}"#).unwrap();
        assert_eq!(c.plan_cache_path(0), Some(PathBuf::from("p7.json")));
        c.apply_json(r#"{"plan_cache":null}"#).unwrap();
        assert_eq!(c.plan_cache_path(0), None);
        assert!(c.apply_json(r#"{"plan_cache":3}"#).unwrap_err().to_string().contains("plan_cache"));
    }

    #[test]
    fn json_settings_apply_over_the_environment() {
        let mut c = cfg(&[("WASMEM_POLICY", "pytorch")]).unwrap();
        c.apply_json(r#"{"policy":"defrag","device":"sim","sim_capacity":"2GiB","shadow":"lifecycle","trace":true,"ctl":"/tmp/s.sock","rank":4}"#)
            .unwrap();
        assert_eq!(c.policy, "defrag");
        assert_eq!(c.backend, Backend::Sim { capacity: 2 * GIB });
        assert_eq!((c.shadow.as_deref(), c.trace, c.rank), (Some("lifecycle"), true, Some(4)));
        assert_eq!(c.ctl, Some(PathBuf::from("/tmp/s.sock")));
        c.apply_json(r#"{"ctl":true}"#).unwrap();
        assert!(c.ctl.as_ref().unwrap().to_string_lossy().contains("rank4-"));
        for (bad, want) in [
            ("[1]", "expected a JSON object"),
            ("{", "not JSON"),
            (r#"{"polcy":"x"}"#, "unknown setting `polcy`"),
            (r#"{"policy":7}"#, "`policy` must be"),
            (r#"{"device":"tpu"}"#, "WASMEM_DEVICE=`tpu`"),
            (r#"{"sim_capacity":"lots"}"#, "`sim_capacity`"),
            (r#"{"ctl":3}"#, "`ctl` must be"),
            (r#"{"rank":-1}"#, "`rank` must be"),
        ] {
            let e = c.clone().apply_json(bad).unwrap_err().to_string();
            assert!(e.contains(want), "{bad}: {e}");
        }
    }
}
