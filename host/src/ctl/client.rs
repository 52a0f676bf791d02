//! The client side: one request, one reply.

use std::io::{BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::Value;

use super::protocol::{read_line, Reply, Request};
use super::server::default_socket_dir;

/// Why a request failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// No socket could be chosen or reached.
    #[error("{0}")]
    Connect(String),
    /// The connection failed midway, or the reply is not a reply.
    #[error("control socket {}: {cause}", path.display())]
    Io {
        /// The socket.
        path: PathBuf,
        /// What happened.
        cause: String,
    },
    /// The server answered with an error.
    #[error("{0}")]
    Refused(String),
}

/// The socket to talk to: `given`, or the only live socket in the default
/// directory (sockets nobody listens on, left by a process that was killed,
/// are skipped).
pub fn choose_socket(given: Option<&Path>) -> Result<PathBuf, ClientError> {
    let mut live = choose_sockets(given)?;
    if live.len() == 1 {
        return Ok(live.remove(0));
    }
    let list = live.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ");
    Err(ClientError::Connect(format!(
        "several wasmem sockets in {}: {list}; choose one with --socket",
        default_socket_dir().display()
    )))
}

/// The sockets to talk to: `given`, or every live socket in the default
/// directory, sorted by name (one per process of the node: a `wasmem train`
/// run, or each rank of a PyTorch job with `wasmem.torch.enable(ctl=True)`).
/// Sockets nobody listens on, left by a process that was killed, are skipped;
/// none live is an error that names them.
pub fn choose_sockets(given: Option<&Path>) -> Result<Vec<PathBuf>, ClientError> {
    if let Some(p) = given {
        return Ok(vec![p.to_path_buf()]);
    }
    let dir = default_socket_dir();
    let mut socks: Vec<PathBuf> = std::fs::read_dir(&dir)
        .map_err(|e| {
            ClientError::Connect(format!("no running wasmem found: cannot list {} ({e}); give --socket", dir.display()))
        })?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "sock"))
        .collect();
    socks.sort();
    let (live, stale): (Vec<PathBuf>, Vec<PathBuf>) = socks.into_iter().partition(|p| UnixStream::connect(p).is_ok());
    let list = |v: &[PathBuf]| v.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ");
    match (live.is_empty(), stale.is_empty()) {
        (false, _) => Ok(live),
        (true, true) => {
            Err(ClientError::Connect(format!("no running wasmem found in {}; give --socket", dir.display())))
        }
        (true, false) => Err(ClientError::Connect(format!(
            "no running wasmem found in {} (nobody listens on {}); give --socket",
            dir.display(),
            list(&stale)
        ))),
    }
}

/// Sends `req` to the server at `path` and returns its result.
pub fn request(path: &Path, req: &Request, timeout: Duration) -> Result<Value, ClientError> {
    let line = serde_json::to_string(req).map_err(|e| ClientError::Connect(e.to_string()))?;
    let reply = request_raw(path, line.as_bytes(), timeout)?;
    if reply.ok {
        Ok(reply.result.unwrap_or(Value::Null))
    } else {
        Err(ClientError::Refused(reply.error.unwrap_or_else(|| "error without a message".into())))
    }
}

/// Sends `bytes` (a newline is appended) and reads one reply; for tests and tools.
pub fn request_raw(path: &Path, bytes: &[u8], timeout: Duration) -> Result<Reply, ClientError> {
    let io = |cause: String| ClientError::Io { path: path.to_path_buf(), cause };
    let mut s = UnixStream::connect(path)
        .map_err(|e| ClientError::Connect(format!("cannot connect to the control socket {}: {e}", path.display())))?;
    s.set_read_timeout(Some(timeout)).map_err(|e| io(e.to_string()))?;
    s.set_write_timeout(Some(timeout)).map_err(|e| io(e.to_string()))?;
    // A refused or oversized request may be answered and closed before it
    // is all written; the reply is still read.
    let wrote = s.write_all(bytes).and_then(|_| s.write_all(b"\n"));
    let mut r = BufReader::new(&s);
    let line = match read_line(&mut r, super::protocol::MAX_REPLY_BYTES + 1) {
        Ok(Some(l)) => l,
        Ok(None) => {
            return Err(io(match wrote {
                Err(e) => format!("cannot send the request: {e}"),
                Ok(()) => "the server closed the connection without a reply".into(),
            }))
        }
        Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
            return Err(io(format!("no reply within {} s (the run may be busy or stopped)", timeout.as_secs_f64())))
        }
        Err(e) => return Err(io(format!("no reply: {e}"))),
    };
    serde_json::from_slice(&line).map_err(|e| io(format!("the reply is not a reply: {e}")))
}
