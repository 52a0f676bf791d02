//! Live control of a running process over a local Unix socket.
//!
//! ```text
//!  wasmem ctl swap placement lru-evict ──► client ── {"cmd":"swap",…}\n ──► socket (0600, dir 0700)
//!                                                                            │ SO_PEERCRED: same uid only
//!                                                  ◄── {"ok":true,…}\n ──   server thread ── Control
//!                                                                            └─ RankControl: SharedAllocator per rank
//! ```
//!
//! One file per job: [`protocol`] (the line-delimited JSON messages and
//! their limits), [`server`] (the socket, its permissions, peer check,
//! timeouts and the serving thread), [`status`] (what `status` reports and
//! its text form), [`client`], and `ranks` ([`RankControl`]: the ranks'
//! allocators and the spec loader a swap resolves policies with).

pub mod client;
pub mod protocol;
mod ranks;
pub mod server;
pub mod status;

pub use client::{choose_socket, choose_sockets, request, request_raw, ClientError};
pub use protocol::{ProtocolError, Reply, Request, RoleArg, UnknownRole, MAX_REQUEST_BYTES};
pub use ranks::{prepare_swap, ControlledRank, PreparedSwap, RankControl, StatusHook};
pub use server::{
    current_uid, default_socket_dir, default_socket_path, Control, CtlServer, ServerError, ServerOptions, SwapOutcome,
};
pub use status::{render as render_status, RankStatus, Status, TierView};
