//! The control server: a Unix socket in an owner-only directory, served by
//! its own thread.
//!
//! Invariants:
//! - the socket's directory is a real directory (not a symlink) owned by
//!   this user with no group or other permission bits (0700); the server
//!   creates it that way when it is missing and refuses to start otherwise;
//! - the socket file is 0600 and is removed when the server stops (drop),
//!   with the directory when the server created it and it is empty;
//! - every connection's peer credentials (`SO_PEERCRED`) are checked before
//!   anything is read: a peer whose uid is not [`ServerOptions::allowed_uid`]
//!   (default: ours) gets an error reply and is closed;
//! - each request line must arrive whole within
//!   [`ServerOptions::request_timeout`] and fit in
//!   [`ServerOptions::max_request_bytes`]; connections are served one at a
//!   time, so a silent client delays others by at most that timeout;
//! - nothing a client sends can panic or stop the server thread.

use std::io::{BufReader, Read, Write};
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::protocol::{
    parse_request, read_line, ProtocolError, Reply, Request, RoleArg, MAX_REPLY_BYTES, MAX_REQUEST_BYTES,
};
use super::status::Status;

/// What a control server acts on: the ranks of a run.
pub trait Control: Send + Sync {
    /// Replaces the policy of `role` on every rank by `policy` (a spec), from
    /// the next decision on.
    fn swap(&self, role: RoleArg, policy: &str) -> Result<SwapOutcome, String>;
    /// The current state.
    fn status(&self) -> Status;
}

/// The result of a `swap`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SwapOutcome {
    /// Roles replaced.
    pub roles: Vec<String>,
    /// The new policy spec.
    pub policy: String,
    /// Policies replaced (rank 0), per role in `roles`.
    pub old: Vec<String>,
    /// Policies now active (rank 0), per role in `roles`.
    pub new: Vec<String>,
    /// Ranks swapped.
    pub ranks: usize,
    /// Bytes of policy state carried over on rank 0 (WebAssembly to the same policy).
    #[serde(default)]
    pub state_bytes: Option<usize>,
}

/// Why the server could not start.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// The socket directory is unsafe or cannot be made.
    #[error("control socket directory {}: {cause}", dir.display())]
    Directory {
        /// The directory.
        dir: PathBuf,
        /// What is wrong.
        cause: String,
    },
    /// The socket cannot be created.
    #[error("control socket {}: {cause}", path.display())]
    Socket {
        /// The socket path.
        path: PathBuf,
        /// What is wrong.
        cause: String,
    },
}

/// Options of a [`CtlServer`].
#[derive(Debug, Clone)]
pub struct ServerOptions {
    /// Largest request line, newline included.
    pub max_request_bytes: usize,
    /// Time a request line may take to arrive.
    pub request_timeout: Duration,
    /// The only peer uid served (default: this process's uid). Tests set
    /// another to exercise the refusal without a second user.
    pub allowed_uid: u32,
}

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions {
            max_request_bytes: MAX_REQUEST_BYTES,
            request_timeout: Duration::from_secs(5),
            allowed_uid: current_uid(),
        }
    }
}

/// This process's real uid.
pub fn current_uid() -> u32 {
    rustix::process::getuid().as_raw()
}

/// The default socket directory: `$XDG_RUNTIME_DIR/wasmem` when set (an
/// absolute path), else `<temp dir>/wasmem-<uid>`.
pub fn default_socket_dir() -> PathBuf {
    match std::env::var_os("XDG_RUNTIME_DIR").map(PathBuf::from).filter(|p| p.is_absolute()) {
        Some(d) => d.join("wasmem"),
        None => std::env::temp_dir().join(format!("wasmem-{}", current_uid())),
    }
}

/// The default socket of this process: `<default dir>/<pid>.sock`.
pub fn default_socket_path() -> PathBuf {
    default_socket_dir().join(format!("{}.sock", std::process::id()))
}

/// A running control server; dropping it stops the thread and removes the socket.
pub struct CtlServer {
    path: PathBuf,
    created_dir: Option<PathBuf>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for CtlServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CtlServer").field("path", &self.path).finish_non_exhaustive()
    }
}

/// Makes sure `dir` is an owner-only directory of ours; returns whether it was created.
fn prepare_dir(dir: &Path) -> Result<bool, ServerError> {
    let fail = |cause: String| ServerError::Directory { dir: dir.to_path_buf(), cause };
    let created = match std::fs::symlink_metadata(dir) {
        Ok(_) => false,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .map_err(|e| fail(format!("cannot create: {e}")))?;
            true
        }
        Err(e) => return Err(fail(e.to_string())),
    };
    let md = std::fs::symlink_metadata(dir).map_err(|e| fail(e.to_string()))?;
    if !md.file_type().is_dir() {
        return Err(fail("not a directory (symlinks are refused)".into()));
    }
    let uid = current_uid();
    if md.uid() != uid {
        return Err(fail(format!("owned by uid {}, not by this user (uid {uid})", md.uid())));
    }
    let mode = md.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(fail(format!("mode {mode:04o} lets other users in; it must be owner-only (0700)")));
    }
    Ok(created)
}

impl CtlServer {
    /// Binds `path` (see the module invariants) and serves `target` on a new thread.
    pub fn start(path: &Path, target: Arc<dyn Control>, opts: ServerOptions) -> Result<CtlServer, ServerError> {
        let sock_err = |cause: String| ServerError::Socket { path: path.to_path_buf(), cause };
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let created = prepare_dir(&dir)?;
        if let Ok(md) = std::fs::symlink_metadata(path) {
            if !md.file_type().is_socket() {
                return Err(sock_err("exists and is not a socket".into()));
            }
            if UnixStream::connect(path).is_ok() {
                return Err(sock_err("in use by another running process".into()));
            }
            // A socket nobody listens on: left by a process that died.
            std::fs::remove_file(path).map_err(|e| sock_err(format!("cannot remove the stale socket: {e}")))?;
        }
        let listener = UnixListener::bind(path).map_err(|e| sock_err(format!("cannot bind: {e}")))?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
            .map_err(|e| sock_err(format!("cannot set mode 0600: {e}")))?;
        listener.set_nonblocking(true).map_err(|e| sock_err(e.to_string()))?;
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = stop.clone();
        let thread = std::thread::Builder::new()
            .name("wasmem-ctl".into())
            .spawn(move || serve(listener, target.as_ref(), &opts, &stop2))
            .map_err(|e| sock_err(format!("cannot start the server thread: {e}")))?;
        tracing::info!(socket = %path.display(), "control socket listening");
        Ok(CtlServer { path: path.to_path_buf(), created_dir: created.then_some(dir), stop, thread: Some(thread) })
    }

    /// The socket path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for CtlServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.path);
        if let Some(d) = &self.created_dir {
            let _ = std::fs::remove_dir(d);
        }
    }
}

/// How often the accept loop checks for a stop.
const POLL: Duration = Duration::from_millis(100);

fn serve(listener: UnixListener, target: &dyn Control, opts: &ServerOptions, stop: &AtomicBool) {
    let ts = rustix::event::Timespec { tv_sec: 0, tv_nsec: POLL.as_nanos() as _ };
    while !stop.load(Ordering::SeqCst) {
        let mut fds = [rustix::event::PollFd::new(&listener, rustix::event::PollFlags::IN)];
        match rustix::event::poll(&mut fds, Some(&ts)) {
            Ok(0) => continue,
            Ok(_) => {}
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => {
                tracing::error!(error = %e, "control socket poll failed; the server stops");
                return;
            }
        }
        match listener.accept() {
            Ok((stream, _)) => {
                if let Err(e) = connection(stream, target, opts) {
                    tracing::debug!(error = %e, "control connection ended with an error");
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => tracing::warn!(error = %e, "control socket accept failed"),
        }
    }
}

/// A reader that fails with `TimedOut` once `deadline` has passed, however
/// slowly the bytes trickle in.
struct DeadlineReader<'a> {
    stream: &'a UnixStream,
    deadline: Instant,
}

impl Read for DeadlineReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::ErrorKind::TimedOut.into());
        }
        self.stream.set_read_timeout(Some(left))?;
        (&*self.stream).read(buf)
    }
}

fn send(stream: &UnixStream, reply: &Reply) -> std::io::Result<()> {
    let line = reply.to_line();
    let line = if line.len() > MAX_REPLY_BYTES {
        Reply::err(format!("the reply would be {} bytes, more than the limit of {MAX_REPLY_BYTES}", line.len()))
            .to_line()
    } else {
        line
    };
    (&*stream).write_all(line.as_bytes())
}

/// Serves one connection until it closes or a protocol error.
fn connection(stream: UnixStream, target: &dyn Control, opts: &ServerOptions) -> std::io::Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_write_timeout(Some(opts.request_timeout))?;
    let peer = rustix::net::sockopt::socket_peercred(&stream).map_err(std::io::Error::from)?;
    let uid = peer.uid.as_raw();
    if uid != opts.allowed_uid {
        tracing::warn!(peer_uid = uid, peer_pid = peer.pid.as_raw_nonzero().get(), "control connection refused");
        return send(
            &stream,
            &Reply::err(format!("refused: peer uid {uid} is not the owner of this process (uid {})", opts.allowed_uid)),
        );
    }
    let mut r = BufReader::new(DeadlineReader { stream: &stream, deadline: Instant::now() });
    loop {
        r.get_mut().deadline = Instant::now() + opts.request_timeout;
        let line = match read_line(&mut r, opts.max_request_bytes) {
            Ok(None) => return Ok(()),
            Ok(Some(l)) => l,
            Err(e) => {
                let pe = match e.kind() {
                    std::io::ErrorKind::InvalidData => ProtocolError::TooLarge { limit: opts.max_request_bytes },
                    std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock => {
                        ProtocolError::Timeout(opts.request_timeout.as_millis())
                    }
                    _ => ProtocolError::Io(e.to_string()),
                };
                return send(&stream, &Reply::err(pe.to_string()));
            }
        };
        let req = match parse_request(&line) {
            Ok(req) => req,
            Err(e) => return send(&stream, &Reply::err(e.to_string())),
        };
        let reply = handle(target, req);
        send(&stream, &reply)?;
    }
}

fn handle(target: &dyn Control, req: Request) -> Reply {
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match req {
        Request::Status => serde_json::to_value(target.status()).map_err(|e| e.to_string()),
        Request::Swap { role, policy } => {
            target.swap(role, &policy).and_then(|o| serde_json::to_value(o).map_err(|e| e.to_string()))
        }
    }));
    match r {
        Ok(Ok(v)) => Reply::ok(v),
        Ok(Err(e)) => Reply::err(e),
        Err(_) => Reply::err("internal error: the command panicked (the run goes on)"),
    }
}
