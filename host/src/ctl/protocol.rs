//! The control protocol: one JSON object per line each way.
//!
//! ```text
//! → {"cmd":"swap","role":"placement","policy":"lru-evict"}     role: placement|reclamation|eviction|all (default all)
//! ← {"ok":true,"result":{"roles":["placement"],"policy":"lru-evict","ranks":2,"old":["pytorch"]}}
//! → {"cmd":"status"}
//! ← {"ok":true,"result":{"pid":…,"step":…,"ranks":[…],"shadows":[…]}}
//! ← {"ok":false,"error":"unknown command `reboot` (commands: swap, status)"}
//! ```
//!
//! A request line is at most [`MAX_REQUEST_BYTES`] bytes (newline
//! included) and must arrive within the server's request timeout. A line
//! that is too large, not JSON, not an object, without a `cmd`, with an
//! unknown command or with bad arguments gets an error reply naming the
//! problem, and the server closes the connection. A command that is valid
//! but fails (an unknown policy, say) gets an error reply and the
//! connection stays open.

use std::io::{BufRead, Read};

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::decision::Role;

/// Largest request line accepted, newline included.
pub const MAX_REQUEST_BYTES: usize = 64 * 1024;

/// Largest reply line the server sends (and the client reads): a reply that
/// would be larger is an error reply instead, and a swap whose reply would be
/// larger is refused before anything changes.
pub const MAX_REPLY_BYTES: usize = 1 << 20;

/// The commands, as named on the wire.
pub const COMMANDS: [&str; 2] = ["swap", "status"];

/// Which roles a swap replaces.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RoleArg {
    /// Placement only.
    Placement,
    /// Reclamation only.
    Reclamation,
    /// Eviction only.
    Eviction,
    /// Every role the new policy provides.
    #[default]
    All,
}

impl RoleArg {
    /// The roles this argument names.
    pub fn roles(self) -> Vec<Role> {
        match self {
            RoleArg::Placement => vec![Role::Placement],
            RoleArg::Reclamation => vec![Role::Reclamation],
            RoleArg::Eviction => vec![Role::Eviction],
            RoleArg::All => vec![Role::Placement, Role::Reclamation, Role::Eviction],
        }
    }

    /// Parses `placement`, `reclamation`, `eviction` or `all`.
    pub fn parse(s: &str) -> Result<RoleArg, UnknownRole> {
        match s {
            "placement" => Ok(RoleArg::Placement),
            "reclamation" => Ok(RoleArg::Reclamation),
            "eviction" => Ok(RoleArg::Eviction),
            "all" => Ok(RoleArg::All),
            other => Err(UnknownRole(other.to_string())),
        }
    }
}

/// A role name that is not one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown role `{0}` (expected placement, reclamation, eviction or all)")]
pub struct UnknownRole(pub String);

/// A request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "cmd", rename_all = "snake_case", deny_unknown_fields)]
pub enum Request {
    /// Replace the policy of `role` (default: every role `policy` provides)
    /// on every rank, from the next decision on.
    Swap {
        /// Roles to replace.
        #[serde(default)]
        role: RoleArg,
        /// A policy spec as `--policy` takes it (built-in, shipped name, `.wasm` path, `a+b`).
        policy: String,
    },
    /// Active policies, counters and memory of every rank.
    Status,
}

/// A reply.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Reply {
    /// Whether the command succeeded.
    pub ok: bool,
    /// The command's result when `ok`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<Value>,
    /// What went wrong when not `ok`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl Reply {
    /// A success carrying `result`.
    pub fn ok(result: Value) -> Reply {
        Reply { ok: true, result: Some(result), error: None }
    }

    /// A failure.
    pub fn err(error: impl Into<String>) -> Reply {
        Reply { ok: false, result: None, error: Some(error.into()) }
    }

    /// The reply as one line (newline included).
    pub fn to_line(&self) -> String {
        let mut s = serde_json::to_string(self).unwrap_or_else(|e| {
            format!("{{\"ok\":false,\"error\":{}}}", Value::String(format!("cannot encode the reply: {e}")))
        });
        s.push('\n');
        s
    }
}

/// Why a request line was refused (the connection is then closed).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtocolError {
    /// The line is longer than the limit.
    #[error("request too large: more than {limit} bytes without a newline")]
    TooLarge {
        /// The limit in bytes.
        limit: usize,
    },
    /// Not JSON.
    #[error("malformed request: not JSON ({0})")]
    Malformed(String),
    /// JSON, but not an object.
    #[error("malformed request: expected a JSON object, got {0}")]
    NotObject(&'static str),
    /// No `cmd` string.
    #[error("malformed request: missing string field `cmd` (commands: {})", COMMANDS.join(", "))]
    MissingCmd,
    /// A `cmd` that is not a command.
    #[error("unknown command `{0}` (commands: {cmds})", cmds = COMMANDS.join(", "))]
    UnknownCommand(String),
    /// A known command with bad arguments.
    #[error("bad `{cmd}` request: {cause}")]
    BadArguments {
        /// The command.
        cmd: String,
        /// What is wrong.
        cause: String,
    },
    /// Nothing complete arrived in time.
    #[error("request timed out: no complete line within {0} ms")]
    Timeout(u128),
    /// The connection failed.
    #[error("connection error: {0}")]
    Io(String),
}

/// Parses one request line (without or with its newline).
pub fn parse_request(line: &[u8]) -> Result<Request, ProtocolError> {
    let v: Value = serde_json::from_slice(line).map_err(|e| ProtocolError::Malformed(e.to_string()))?;
    let kind = match &v {
        Value::Object(_) => None,
        Value::Null => Some("null"),
        Value::Bool(_) => Some("a boolean"),
        Value::Number(_) => Some("a number"),
        Value::String(_) => Some("a string"),
        Value::Array(_) => Some("an array"),
    };
    if let Some(k) = kind {
        return Err(ProtocolError::NotObject(k));
    }
    let cmd = v.get("cmd").and_then(Value::as_str).ok_or(ProtocolError::MissingCmd)?.to_string();
    if !COMMANDS.contains(&cmd.as_str()) {
        return Err(ProtocolError::UnknownCommand(cmd));
    }
    let allowed: &[&str] = if cmd == "swap" { &["cmd", "role", "policy"] } else { &["cmd"] };
    if let Some(k) = v.as_object().into_iter().flat_map(|o| o.keys()).find(|k| !allowed.contains(&k.as_str())) {
        return Err(ProtocolError::BadArguments {
            cause: format!("unknown field `{k}` (fields: {})", allowed.join(", ")),
            cmd,
        });
    }
    serde_json::from_value(v).map_err(|e| ProtocolError::BadArguments { cmd, cause: e.to_string() })
}

/// Reads one line of at most `limit` bytes. `Ok(None)`: the peer closed
/// the connection before sending anything. A last line without a newline
/// is accepted.
pub fn read_line(r: &mut impl BufRead, limit: usize) -> Result<Option<Vec<u8>>, std::io::Error> {
    let mut buf = Vec::new();
    r.take(limit as u64 + 1).read_until(b'\n', &mut buf)?;
    if buf.is_empty() {
        return Ok(None);
    }
    if buf.len() > limit {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, "too large"));
    }
    Ok(Some(buf))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_commands() {
        assert_eq!(parse_request(br#"{"cmd":"status"}"#), Ok(Request::Status));
        assert_eq!(
            parse_request(b"{\"cmd\":\"swap\",\"role\":\"eviction\",\"policy\":\"lru-evict\"}\n"),
            Ok(Request::Swap { role: RoleArg::Eviction, policy: "lru-evict".into() })
        );
        assert_eq!(
            parse_request(br#"{"cmd":"swap","policy":"naive"}"#),
            Ok(Request::Swap { role: RoleArg::All, policy: "naive".into() })
        );
        let r = Request::Swap { role: RoleArg::Placement, policy: "a+b".into() };
        assert_eq!(parse_request(serde_json::to_string(&r).unwrap().as_bytes()), Ok(r));
    }

    #[test]
    fn refuses_bad_requests_by_name() {
        let cases: [(&[u8], &str); 10] = [
            (b"{\"cmd\":", "not JSON"),
            (b"\xff\xfe", "not JSON"),
            (b"", "not JSON"),
            (b"[1,2]", "got an array"),
            (b"\"status\"", "got a string"),
            (b"{\"command\":\"status\"}", "missing string field `cmd`"),
            (b"{\"cmd\":7}", "missing string field `cmd`"),
            (b"{\"cmd\":\"reboot\"}", "unknown command `reboot`"),
            (b"{\"cmd\":\"swap\"}", "bad `swap` request: missing field `policy`"),
            (b"{\"cmd\":\"swap\",\"policy\":\"x\",\"role\":\"everything\"}", "bad `swap` request: unknown variant"),
        ];
        for (line, want) in cases {
            let e = parse_request(line).unwrap_err().to_string();
            assert!(e.contains(want), "{:?}: {e} (wanted {want})", String::from_utf8_lossy(line));
        }
        let e = parse_request(br#"{"cmd":"status","now":true}"#).unwrap_err();
        assert!(matches!(e, ProtocolError::BadArguments { .. }), "{e}");
    }

    #[test]
    fn fuzzed_lines_never_panic() {
        // A deterministic byte soup around valid requests: every outcome is
        // a request or a named error.
        let seeds: [&[u8]; 3] = [br#"{"cmd":"status"}"#, br#"{"cmd":"swap","policy":"naive","role":"all"}"#, b"{}"];
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for i in 0..20_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let mut line = seeds[i % 3].to_vec();
            let n = (x % 4) as usize;
            for k in 0..n {
                let pos = ((x >> (8 * k)) as usize) % (line.len() + 1);
                let byte = (x >> (3 + k)) as u8;
                match (x >> (40 + k)) % 3 {
                    0 => line.insert(pos, byte),
                    1 if pos < line.len() => line[pos] = byte,
                    _ if pos < line.len() => {
                        line.remove(pos);
                    }
                    _ => {}
                }
            }
            match parse_request(&line) {
                Ok(_) => {}
                Err(e) => assert!(!e.to_string().is_empty()),
            }
        }
    }

    #[test]
    fn lines_are_bounded() {
        let mut ok = std::io::Cursor::new(b"{\"cmd\":\"status\"}\nrest".to_vec());
        assert_eq!(read_line(&mut ok, 64).unwrap().unwrap(), b"{\"cmd\":\"status\"}\n");
        assert_eq!(read_line(&mut ok, 64).unwrap().unwrap(), b"rest");
        assert_eq!(read_line(&mut ok, 64).unwrap(), None);
        let exact = [vec![b' '; 63], vec![b'\n']].concat();
        assert_eq!(read_line(&mut std::io::Cursor::new(exact.clone()), 64).unwrap().unwrap(), exact);
        let big = vec![b' '; 65];
        let e = read_line(&mut std::io::Cursor::new(big), 64).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidData);
        let big_nl = [vec![b' '; 64], vec![b'\n']].concat();
        assert!(read_line(&mut std::io::Cursor::new(big_nl), 64).is_err());
    }

    #[test]
    fn replies_are_one_line() {
        let l = Reply::err("a\nb").to_line();
        assert_eq!(l.matches('\n').count(), 1);
        let r: Reply = serde_json::from_str(&l).unwrap();
        assert_eq!(r.error.as_deref(), Some("a\nb"));
    }
}
