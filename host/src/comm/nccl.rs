//! The NCCL communicator: one process per GPU, through `cudarc::nccl`.
//!
//! Launch with the usual environment — `RANK`, `WORLD_SIZE`, `LOCAL_RANK`
//! (the GPU ordinal; default `RANK`), `MASTER_ADDR` (default 127.0.0.1) and
//! `MASTER_PORT` (default 29500) — so the same binary runs on one node or
//! many. Rank 0 creates the NCCL unique id and hands it to the other ranks over
//! TCP ([`exchange_id`]); every rank then joins with `ncclCommInitRank`.
//!
//! Buffers of the [`Communicator`] trait are host slices: each collective
//! copies in to the device, runs on the communicator's stream and copies back.
//! The rendezvous is bounded by the timeout; a peer that dies *during* a NCCL
//! collective is detected by NCCL itself (set `NCCL_TIMEOUT` /
//! `TORCH_NCCL_BLOCKING_WAIT`-style watchdogs at the launcher), which this
//! backend does not yet abort on its own.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaStream};
use cudarc::nccl::{Comm, Id, ReduceOp};

use super::{CommError, Communicator};

/// Length of a NCCL unique id.
pub const ID_BYTES: usize = 128;

/// Why a NCCL rank could not join its group.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NcclError {
    /// A launch variable (`RANK`, `WORLD_SIZE`, …) is missing or invalid.
    #[error("{0}")]
    Launch(String),
    /// The exchange of rank 0's unique id over TCP failed.
    #[error("{0}")]
    Rendezvous(String),
    /// The NCCL or CUDA driver library is not installed.
    #[error("{NCCL_MISSING}")]
    Unavailable,
    /// A CUDA or NCCL call failed.
    #[error("{0}")]
    Driver(String),
}

/// Where this process sits in the job, from the launcher's environment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Launch {
    /// Global rank.
    pub rank: usize,
    /// Number of ranks.
    pub world_size: usize,
    /// GPU ordinal on this node.
    pub local_rank: usize,
    /// Host of rank 0's rendezvous socket.
    pub master_addr: String,
    /// Port of rank 0's rendezvous socket.
    pub master_port: u16,
}

impl Launch {
    /// Reads `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`
    /// through `get` (e.g. `|k| std::env::var(k).ok()`); names the bad variable.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Self, NcclError> {
        let num = |k: &str, default: Option<usize>| -> Result<usize, NcclError> {
            match get(k) {
                Some(v) => {
                    v.trim().parse().map_err(|_| NcclError::Launch(format!("{k}={v} is not a non-negative integer")))
                }
                None => default.ok_or_else(|| NcclError::Launch(format!("{k} is not set"))),
            }
        };
        let rank = num("RANK", None)?;
        let world_size = num("WORLD_SIZE", None)?;
        if world_size == 0 || rank >= world_size {
            return Err(NcclError::Launch(format!("RANK={rank} is not below WORLD_SIZE={world_size}")));
        }
        let local_rank = num("LOCAL_RANK", Some(rank))?;
        let master_port = num("MASTER_PORT", Some(29500))?;
        let master_port = u16::try_from(master_port)
            .map_err(|_| NcclError::Launch(format!("MASTER_PORT={master_port} is not a port")))?;
        let master_addr = get("MASTER_ADDR").unwrap_or_else(|| "127.0.0.1".to_string());
        Ok(Launch { rank, world_size, local_rank, master_addr, master_port })
    }

    /// [`Launch::from_vars`] over the process environment.
    pub fn from_env() -> Result<Self, NcclError> {
        Self::from_vars(|k| std::env::var(k).ok())
    }
}

/// Hands rank 0's `id` to every rank over TCP: rank 0 listens on
/// `MASTER_ADDR:MASTER_PORT` and sends the bytes to each of the other
/// `world_size − 1` ranks, which connect (retrying until `timeout`) and read
/// them. Returns the id every rank uses.
pub fn exchange_id(
    launch: &Launch,
    id: Option<[u8; ID_BYTES]>,
    timeout: Duration,
) -> Result<[u8; ID_BYTES], NcclError> {
    exchange(launch, id, timeout).map_err(NcclError::Rendezvous)
}

fn exchange(launch: &Launch, id: Option<[u8; ID_BYTES]>, timeout: Duration) -> Result<[u8; ID_BYTES], String> {
    let deadline = Instant::now() + timeout;
    let addr = format!("{}:{}", launch.master_addr, launch.master_port);
    if launch.rank == 0 {
        let id = id.ok_or("rank 0 needs an id to hand out")?;
        let listener = TcpListener::bind(&addr).map_err(|e| format!("rank 0 cannot listen on {addr}: {e}"))?;
        listener.set_nonblocking(true).map_err(|e| e.to_string())?;
        let mut served = 0;
        while served + 1 < launch.world_size {
            match listener.accept() {
                Ok((mut s, _)) => {
                    s.set_nonblocking(false).map_err(|e| e.to_string())?;
                    s.set_write_timeout(Some(timeout)).map_err(|e| e.to_string())?;
                    s.write_all(&id).map_err(|e| format!("rank 0: sending the NCCL id failed: {e}"))?;
                    served += 1;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        return Err(format!(
                            "rank 0: only {served} of {} ranks connected to {addr} within {timeout:?}",
                            launch.world_size - 1
                        ));
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
                Err(e) => return Err(format!("rank 0: accepting on {addr} failed: {e}")),
            }
        }
        Ok(id)
    } else {
        loop {
            let target = addr.to_socket_addrs().map_err(|e| format!("cannot resolve {addr}: {e}"))?.next();
            let Some(target) = target else { return Err(format!("{addr} resolves to no address")) };
            match TcpStream::connect_timeout(&target, Duration::from_millis(500)) {
                Ok(mut s) => {
                    s.set_read_timeout(Some(
                        deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1)),
                    ))
                    .map_err(|e| e.to_string())?;
                    let mut buf = [0u8; ID_BYTES];
                    s.read_exact(&mut buf)
                        .map_err(|e| format!("rank {}: reading the NCCL id failed: {e}", launch.rank))?;
                    return Ok(buf);
                }
                Err(e) => {
                    if Instant::now() >= deadline {
                        return Err(format!(
                            "rank {}: cannot reach rank 0 at {addr} within {timeout:?}: {e}",
                            launch.rank
                        ));
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        }
    }
}

/// The error when [`nccl_present`] is false.
pub const NCCL_MISSING: &str = "no NCCL or CUDA driver library found (searched libcuda.so and libnccl.so on the \
     loader path; where only libnccl.so.2 is installed, link it: `ln -s /path/to/libnccl.so.2 DIR/libnccl.so` and \
     add DIR to LD_LIBRARY_PATH); use the local communicator";

/// Whether the NCCL and CUDA driver libraries can be loaded.
pub fn nccl_present() -> bool {
    // SAFETY: only tries to load the shared libraries; no other call is made.
    unsafe { cudarc::driver::sys::is_culib_present() && cudarc::nccl::sys::is_culib_present() }
}

/// One rank of a NCCL group.
pub struct NcclComm {
    comm: Comm,
    stream: Arc<CudaStream>,
    rank: usize,
    n: usize,
    sent: u64,
}

// SAFETY: a `NcclComm` is used by one thread at a time (every method takes
// `&mut self`); NCCL allows a communicator to move between threads when calls
// on it do not overlap, and each collective first binds the communicator's CUDA
// context to the calling thread (`on_device`).
unsafe impl Send for NcclComm {}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclComm").field("rank", &self.rank).field("world_size", &self.n).finish()
    }
}

impl NcclComm {
    /// Joins the group described by `launch` (rendezvous bounded by `timeout`).
    pub fn new(launch: &Launch, timeout: Duration) -> Result<Self, NcclError> {
        if !nccl_present() {
            return Err(NcclError::Unavailable);
        }
        let ctx = CudaContext::new(launch.local_rank).map_err(|e| {
            NcclError::Driver(format!("rank {}: cannot open GPU {}: {e:?}", launch.rank, launch.local_rank))
        })?;
        let stream = ctx.default_stream();
        let mine = if launch.rank == 0 {
            let id = Id::new().map_err(|e| NcclError::Driver(format!("rank 0: ncclGetUniqueId failed: {e:?}")))?;
            Some(id.internal().map(|c| c as u8))
        } else {
            None
        };
        let bytes = exchange_id(launch, mine, timeout)?;
        let id = Id::uninit(bytes.map(|b| b as ::core::ffi::c_char));
        let comm = Comm::from_rank(stream.clone(), launch.rank, launch.world_size, id)
            .map_err(|e| NcclError::Driver(format!("rank {}: ncclCommInitRank failed: {e:?}", launch.rank)))?;
        Ok(NcclComm { comm, stream, rank: launch.rank, n: launch.world_size, sent: 0 })
    }

    fn backend(&self, op: &'static str, e: impl std::fmt::Debug) -> CommError {
        CommError::GroupFailed { rank: self.rank, op, cause: format!("{e:?}") }
    }

    /// Copies `input` to the device, runs `f(send, recv)` and copies `recv` back into `out`.
    fn on_device(
        &mut self,
        op: &'static str,
        input: &[f32],
        out: &mut [f32],
        f: impl FnOnce(&Comm, &cudarc::driver::CudaSlice<f32>, &mut cudarc::driver::CudaSlice<f32>) -> Result<(), String>,
    ) -> Result<(), CommError> {
        self.stream.context().bind_to_thread().map_err(|e| self.backend(op, e))?;
        let send = self.stream.clone_htod(input).map_err(|e| self.backend(op, e))?;
        let mut recv = self.stream.alloc_zeros::<f32>(out.len().max(1)).map_err(|e| self.backend(op, e))?;
        f(&self.comm, &send, &mut recv).map_err(|e| self.backend(op, e))?;
        let back = self.stream.clone_dtoh(&recv).map_err(|e| self.backend(op, e))?;
        self.stream.synchronize().map_err(|e| self.backend(op, e))?;
        out.copy_from_slice(&back[..out.len()]);
        Ok(())
    }
}

impl Communicator for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.n
    }

    fn all_reduce_sum(&mut self, buf: &mut [f32]) -> Result<(), CommError> {
        let input = buf.to_vec();
        self.on_device("all_reduce", &input, buf, |c, s, r| {
            c.all_reduce(s, r, &ReduceOp::Sum).map(|_| ()).map_err(|e| format!("{e:?}"))
        })?;
        let n = self.n as u64;
        self.sent += 2 * (n - 1) * (buf.len() as u64 * 4) / n;
        Ok(())
    }

    fn all_gather(&mut self, send: &[f32], recv: &mut [f32]) -> Result<(), CommError> {
        if recv.len() != send.len() * self.n {
            let detail = format!("recv has {} elements, expected {}", recv.len(), send.len() * self.n);
            return Err(CommError::Invalid { rank: self.rank, op: "all_gather", detail });
        }
        self.on_device("all_gather", send, recv, |c, s, r| {
            c.all_gather(s, r).map(|_| ()).map_err(|e| format!("{e:?}"))
        })?;
        self.sent += (self.n as u64 - 1) * send.len() as u64 * 4;
        Ok(())
    }

    fn reduce_scatter_sum(&mut self, send: &[f32], recv: &mut [f32]) -> Result<(), CommError> {
        if send.len() != recv.len() * self.n {
            let detail = format!("send has {} elements, expected {}", send.len(), recv.len() * self.n);
            return Err(CommError::Invalid { rank: self.rank, op: "reduce_scatter", detail });
        }
        self.on_device("reduce_scatter", send, recv, |c, s, r| {
            c.reduce_scatter(s, r, &ReduceOp::Sum).map(|_| ()).map_err(|e| format!("{e:?}"))
        })?;
        self.sent += (self.n as u64 - 1) * recv.len() as u64 * 4;
        Ok(())
    }

    fn broadcast(&mut self, buf: &mut [f32], root: usize) -> Result<(), CommError> {
        if root >= self.n {
            let detail = format!("root {root} is not a rank of a group of {}", self.n);
            return Err(CommError::Invalid { rank: self.rank, op: "broadcast", detail });
        }
        let input = buf.to_vec();
        self.on_device("broadcast", &input, buf, |c, s, r| {
            c.broadcast(Some(s), r, root as i32).map(|_| ()).map_err(|e| format!("{e:?}"))
        })?;
        self.sent += buf.len() as u64 * 4;
        Ok(())
    }

    fn barrier(&mut self) -> Result<(), CommError> {
        let mut one = [0.0f32];
        self.all_reduce_sum(&mut one)
    }

    fn bytes_sent(&self) -> u64 {
        self.sent
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
    }

    #[test]
    fn launch_environment() {
        let l = Launch::from_vars(vars(&[("RANK", "1"), ("WORLD_SIZE", "2")])).unwrap();
        assert_eq!((l.rank, l.world_size, l.local_rank, l.master_port), (1, 2, 1, 29500));
        assert_eq!(Launch::from_vars(vars(&[("WORLD_SIZE", "2")])).unwrap_err().to_string(), "RANK is not set");
        let e = Launch::from_vars(vars(&[("RANK", "2"), ("WORLD_SIZE", "2")])).unwrap_err();
        assert!(e.to_string().contains("not below"), "{e}");
        let e = Launch::from_vars(vars(&[("RANK", "x"), ("WORLD_SIZE", "2")])).unwrap_err();
        assert!(e.to_string().contains("RANK=x"), "{e}");
        let e = Launch::from_vars(vars(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "70000")])).unwrap_err();
        assert!(e.to_string().contains("MASTER_PORT=70000"), "{e}");
    }

    #[test]
    fn the_id_reaches_every_rank_over_tcp() {
        let port = {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let id = [7u8; ID_BYTES];
        let handles: Vec<_> = (0..3)
            .map(|rank| {
                std::thread::spawn(move || {
                    let launch = Launch {
                        rank,
                        world_size: 3,
                        local_rank: rank,
                        master_addr: "127.0.0.1".into(),
                        master_port: port,
                    };
                    exchange_id(&launch, (rank == 0).then_some(id), Duration::from_secs(10))
                })
            })
            .collect();
        for h in handles {
            assert_eq!(h.join().unwrap().unwrap(), id);
        }
    }

    #[test]
    fn a_missing_rank_zero_times_out() {
        let port = {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let launch =
            Launch { rank: 1, world_size: 2, local_rank: 1, master_addr: "127.0.0.1".into(), master_port: port };
        let e = exchange_id(&launch, None, Duration::from_millis(300)).unwrap_err();
        assert!(e.to_string().contains("cannot reach rank 0"), "{e}");
    }

    #[test]
    fn without_nccl_the_error_is_clean() {
        if nccl_present() {
            eprintln!("skipping: NCCL is present");
            return;
        }
        let launch = Launch { rank: 0, world_size: 1, local_rank: 0, master_addr: "127.0.0.1".into(), master_port: 1 };
        let e = NcclComm::new(&launch, Duration::from_secs(1)).unwrap_err();
        assert!(e.to_string().contains("no NCCL or CUDA driver library found"), "{e}");
    }
}
