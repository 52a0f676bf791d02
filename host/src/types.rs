//! Plain value types shared by every layer: tensor kinds, training phases, ids.
//!
//! None of these types carries a device address: addresses stay inside the
//! allocator and the device backends, so that blocks can move (defragmentation,
//! eviction) without any client or policy noticing.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// What a tensor storage holds; the main signal for lifetime-aware placement.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TensorKind {
    /// Model parameters (weights): live for the whole run.
    Param,
    /// Gradients: produced in backward, consumed by the optimizer step.
    Grad,
    /// Optimizer states (master weights, Adam moments): live for the whole run.
    Optim,
    /// Forward activations saved for backward.
    Activation,
    /// Short-lived temporaries (workspaces, intermediate results).
    Temp,
    /// Anything else.
    Other,
}

impl TensorKind {
    /// Every kind, in declaration order.
    pub const ALL: [TensorKind; 6] = [
        TensorKind::Param,
        TensorKind::Grad,
        TensorKind::Optim,
        TensorKind::Activation,
        TensorKind::Temp,
        TensorKind::Other,
    ];

    /// The name used in traces and on the command line.
    pub fn as_str(self) -> &'static str {
        match self {
            TensorKind::Param => "param",
            TensorKind::Grad => "grad",
            TensorKind::Optim => "optim",
            TensorKind::Activation => "activation",
            TensorKind::Temp => "temp",
            TensorKind::Other => "other",
        }
    }

    /// Dense index (0..6) for tables indexed by kind.
    pub fn index(self) -> usize {
        self as usize
    }
}

impl fmt::Display for TensorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for TensorKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        TensorKind::ALL.into_iter().find(|k| k.as_str() == s).ok_or_else(|| {
            format!("unknown tensor kind `{s}` (expected param, grad, optim, activation, temp or other)")
        })
    }
}

/// A training phase, as marked by `phase` events.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Forward pass.
    Forward,
    /// Backward pass.
    Backward,
    /// Optimizer step.
    Optimizer,
    /// End of a training step.
    StepEnd,
}

impl Phase {
    /// Every phase, in declaration order.
    pub const ALL: [Phase; 4] = [Phase::Forward, Phase::Backward, Phase::Optimizer, Phase::StepEnd];

    /// The name used in traces.
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Forward => "forward",
            Phase::Backward => "backward",
            Phase::Optimizer => "optimizer",
            Phase::StepEnd => "step_end",
        }
    }
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Phase {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Phase::ALL
            .into_iter()
            .find(|p| p.as_str() == s)
            .ok_or_else(|| format!("unknown phase `{s}` (expected forward, backward, optimizer or step_end)"))
    }
}

/// A stream of work on the device (a CUDA stream; a modelled clock on `sim`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Serialize, Deserialize)]
pub struct StreamId(pub u32);

impl fmt::Display for StreamId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "stream {}", self.0)
    }
}

/// A handle to a tensor storage managed by the allocator.
///
/// It indexes the allocator's handle table: `slot` is the table entry and
/// `generation` tells a live handle from a stale one whose slot was reused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TensorId {
    /// Index of the handle-table slot.
    pub slot: u32,
    /// Generation of the slot when the handle was issued.
    pub generation: u32,
}

impl fmt::Display for TensorId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "tensor#{}.{}", self.slot, self.generation)
    }
}

/// A memory pool of the allocator (engine-wide index).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PoolId(pub u32);

/// Where a tensor's bytes currently are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Tier {
    /// Device memory.
    Device,
    /// (Pinned) host memory.
    Host,
    /// A spill file on disk.
    Disk,
}

/// Rounds `x` up to a multiple of `to` (a power of two), or `None` on overflow.
pub fn round_up(x: u64, to: u64) -> Option<u64> {
    debug_assert!(to.is_power_of_two());
    x.checked_add(to - 1).map(|v| v & !(to - 1))
}

/// `1 KiB`.
pub const KIB: u64 = 1 << 10;
/// `1 MiB`.
pub const MIB: u64 = 1 << 20;
/// `1 GiB`.
pub const GIB: u64 = 1 << 30;

/// An invariant of a structure does not hold (a bug): what and where.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct InvariantError(pub String);

impl From<String> for InvariantError {
    fn from(s: String) -> Self {
        InvariantError(s)
    }
}

/// A size that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid size `{input}`: {why}")]
pub struct SizeError {
    /// The text given.
    pub input: String,
    /// What is wrong with it.
    pub why: String,
}

/// Parses a size such as `80GiB`, `512MiB`, `16GB`, `4096` (bytes).
pub fn parse_size(s: &str) -> Result<u64, SizeError> {
    let err = |why: String| SizeError { input: s.to_string(), why };
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let value: f64 = num.parse().map_err(|_| err("expected a number followed by a unit such as GiB".into()))?;
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kib" => KIB as f64,
        "m" | "mib" => MIB as f64,
        "g" | "gib" => GIB as f64,
        "t" | "tib" => (1u64 << 40) as f64,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        other => return Err(err(format!("unknown unit `{other}`"))),
    };
    let bytes = value * mult;
    if !bytes.is_finite() || bytes < 0.0 || bytes >= u64::MAX as f64 {
        return Err(err("out of range".into()));
    }
    Ok(bytes.round() as u64)
}

/// Formats bytes for humans (`1.50 GiB`).
pub fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.2} {}", UNITS[u])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("80GiB").unwrap(), 80 * GIB);
        assert_eq!(parse_size("16GB").unwrap(), 16_000_000_000);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("1.5 MiB").unwrap(), 3 * MIB / 2);
        assert!(parse_size("12 parsecs").is_err());
        assert!(parse_size("").is_err());
    }

    #[test]
    fn kinds_round_trip() {
        for k in TensorKind::ALL {
            assert_eq!(k.as_str().parse::<TensorKind>().unwrap(), k);
        }
        for p in Phase::ALL {
            assert_eq!(p.as_str().parse::<Phase>().unwrap(), p);
        }
        assert!("weights".parse::<TensorKind>().is_err());
    }

    #[test]
    fn rounding() {
        assert_eq!(round_up(1, 512), Some(512));
        assert_eq!(round_up(512, 512), Some(512));
        assert_eq!(round_up(u64::MAX - 3, 512), None);
    }
}
