//! N ranks as threads of one process over shared memory.
//!
//! Every collective is a *round*: ranks deposit their input (collecting
//! phase); the last to arrive computes the result (the group switches to
//! distributing); each rank copies out its part and the last to do so opens
//! the next round. Invariants (under the mutex): `arrived = #(inputs that are
//! Some)`; in the distributing phase `arrived = n` and `taken ≤ n`; a failed
//! group stays failed. Waits are bounded by the group timeout; a rank whose
//! handle is dropped (normally or while unwinding from a panic) marks itself
//! as left, so ranks waiting for its input fail at once instead of at the
//! timeout.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::{CommError, Communicator};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    AllReduce,
    AllGather,
    ReduceScatter,
    Broadcast(usize),
    Barrier,
}

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::AllReduce => "all_reduce",
            Op::AllGather => "all_gather",
            Op::ReduceScatter => "reduce_scatter",
            Op::Broadcast(_) => "broadcast",
            Op::Barrier => "barrier",
        }
    }
}

#[derive(Debug)]
struct State {
    collecting: bool,
    op: Option<(Op, usize)>,
    inputs: Vec<Option<Vec<f32>>>,
    arrived: usize,
    output: Vec<f32>,
    taken: usize,
    failed: Option<String>,
    left: Vec<bool>,
}

#[derive(Debug)]
struct Shared {
    n: usize,
    timeout: Duration,
    state: Mutex<State>,
    cv: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // No code panics while holding the lock; recover the state if it ever did.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// One rank of a [`local_group`].
#[derive(Debug)]
pub struct LocalComm {
    rank: usize,
    shared: Arc<Shared>,
    sent: u64,
}

/// Creates a group of `n` ranks whose collectives give up after `timeout`.
/// Hand each [`LocalComm`] to its own thread.
pub fn local_group(n: usize, timeout: Duration) -> Vec<LocalComm> {
    let n = n.max(1);
    let shared = Arc::new(Shared {
        n,
        timeout,
        state: Mutex::new(State {
            collecting: true,
            op: None,
            inputs: vec![None; n],
            arrived: 0,
            output: Vec::new(),
            taken: 0,
            failed: None,
            left: vec![false; n],
        }),
        cv: Condvar::new(),
    });
    (0..n).map(|rank| LocalComm { rank, shared: shared.clone(), sent: 0 }).collect()
}

fn fail(st: &mut State, cv: &Condvar, cause: String) {
    if st.failed.is_none() {
        st.failed = Some(cause);
    }
    cv.notify_all();
}

impl LocalComm {
    /// Runs one collective: deposits `input`, waits for the round, then lets
    /// `take` copy this rank's part out of the full result.
    fn run(&mut self, op: Op, input: &[f32], take: impl FnOnce(&[f32])) -> Result<(), CommError> {
        let sh = self.shared.clone();
        let (rank, n, name) = (self.rank, sh.n, op.name());
        let deadline = Instant::now() + sh.timeout;
        let group_failed = |cause: &str| CommError::GroupFailed { rank, op: name, cause: cause.to_string() };
        let mut st = sh.lock();
        // Wait for the previous round to be fully distributed.
        while !st.collecting {
            if let Some(c) = &st.failed {
                return Err(group_failed(c));
            }
            let now = Instant::now();
            if now >= deadline {
                let cause = format!("rank {rank} timed out in {name} waiting for the previous collective to finish");
                fail(&mut st, &sh.cv, cause);
                return Err(CommError::Timeout { rank, op: name, timeout: sh.timeout, missing: vec![] });
            }
            st = sh.cv.wait_timeout(st, deadline - now).unwrap_or_else(|e| e.into_inner()).0;
        }
        if let Some(c) = &st.failed {
            return Err(group_failed(c));
        }
        match st.op {
            None => st.op = Some((op, input.len())),
            Some(o) if o != (op, input.len()) => {
                let detail = format!(
                    "called {name} with {} elements while another rank called {} with {}",
                    input.len(),
                    o.0.name(),
                    o.1
                );
                fail(&mut st, &sh.cv, format!("rank {rank}: {detail}"));
                return Err(CommError::Mismatch { rank, op: name, detail });
            }
            Some(_) => {}
        }
        st.inputs[rank] = Some(input.to_vec());
        st.arrived += 1;
        if st.arrived == n {
            st.output = combine(op, &st.inputs);
            st.collecting = false;
            sh.cv.notify_all();
        } else {
            loop {
                if let Some(c) = &st.failed {
                    return Err(group_failed(c));
                }
                if !st.collecting {
                    break;
                }
                if let Some(gone) = (0..n).find(|&r| st.left[r] && st.inputs[r].is_none()) {
                    let cause = format!("rank {gone} left the group before {name}");
                    fail(&mut st, &sh.cv, cause.clone());
                    return Err(group_failed(&cause));
                }
                let now = Instant::now();
                if now >= deadline {
                    let missing: Vec<usize> = (0..n).filter(|&r| st.inputs[r].is_none()).collect();
                    let cause = format!("rank {rank} timed out in {name} waiting for ranks {missing:?}");
                    fail(&mut st, &sh.cv, cause);
                    return Err(CommError::Timeout { rank, op: name, timeout: sh.timeout, missing });
                }
                st = sh.cv.wait_timeout(st, deadline - now).unwrap_or_else(|e| e.into_inner()).0;
            }
        }
        take(&st.output);
        st.taken += 1;
        if st.taken == n {
            st.collecting = true;
            st.op = None;
            st.inputs.iter_mut().for_each(|i| *i = None);
            st.arrived = 0;
            st.taken = 0;
            st.output.clear();
            sh.cv.notify_all();
        }
        Ok(())
    }

    fn invalid(&self, op: &'static str, detail: String) -> CommError {
        CommError::Invalid { rank: self.rank, op, detail }
    }
}

/// The full result of a round from every rank's input.
fn combine(op: Op, inputs: &[Option<Vec<f32>>]) -> Vec<f32> {
    let all = inputs.iter().map(|i| i.as_deref().unwrap_or(&[]));
    match op {
        Op::AllReduce | Op::ReduceScatter => {
            let mut sum = inputs[0].clone().unwrap_or_default();
            for other in all.skip(1) {
                sum.iter_mut().zip(other).for_each(|(a, b)| *a += b);
            }
            sum
        }
        Op::AllGather => all.flat_map(|v| v.iter().copied()).collect(),
        Op::Broadcast(root) => inputs[root].clone().unwrap_or_default(),
        Op::Barrier => Vec::new(),
    }
}

impl Communicator for LocalComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.shared.n
    }

    fn all_reduce_sum(&mut self, buf: &mut [f32]) -> Result<(), CommError> {
        let input = buf.to_vec();
        self.run(Op::AllReduce, &input, |out| buf.copy_from_slice(out))?;
        let n = self.shared.n as u64;
        self.sent += 2 * (n - 1) * (buf.len() as u64 * 4) / n;
        Ok(())
    }

    fn all_gather(&mut self, send: &[f32], recv: &mut [f32]) -> Result<(), CommError> {
        let n = self.shared.n;
        if recv.len() != send.len() * n {
            return Err(
                self.invalid("all_gather", format!("recv has {} elements, expected {}", recv.len(), send.len() * n))
            );
        }
        self.run(Op::AllGather, send, |out| recv.copy_from_slice(out))?;
        self.sent += (n as u64 - 1) * send.len() as u64 * 4;
        Ok(())
    }

    fn reduce_scatter_sum(&mut self, send: &[f32], recv: &mut [f32]) -> Result<(), CommError> {
        let (n, rank) = (self.shared.n, self.rank);
        if send.len() != recv.len() * n {
            return Err(self
                .invalid("reduce_scatter", format!("send has {} elements, expected {}", send.len(), recv.len() * n)));
        }
        let chunk = recv.len();
        self.run(Op::ReduceScatter, send, |out| recv.copy_from_slice(&out[rank * chunk..(rank + 1) * chunk]))?;
        self.sent += (n as u64 - 1) * chunk as u64 * 4;
        Ok(())
    }

    fn broadcast(&mut self, buf: &mut [f32], root: usize) -> Result<(), CommError> {
        let n = self.shared.n;
        if root >= n {
            return Err(self.invalid("broadcast", format!("root {root} is not a rank of a group of {n}")));
        }
        let input = buf.to_vec();
        self.run(Op::Broadcast(root), &input, |out| buf.copy_from_slice(out))?;
        if self.rank != (root + n - 1) % n {
            self.sent += buf.len() as u64 * 4;
        }
        Ok(())
    }

    fn barrier(&mut self) -> Result<(), CommError> {
        self.run(Op::Barrier, &[], |_| {})
    }

    fn bytes_sent(&self) -> u64 {
        self.sent
    }
}

impl Drop for LocalComm {
    fn drop(&mut self) {
        let mut st = self.shared.lock();
        st.left[self.rank] = true;
        self.shared.cv.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use std::thread;

    use super::*;

    fn on_ranks<T: Send + 'static>(
        n: usize,
        timeout: Duration,
        f: impl Fn(&mut LocalComm) -> T + Send + Sync + Copy + 'static,
    ) -> Vec<thread::Result<T>> {
        let handles: Vec<_> =
            local_group(n, timeout).into_iter().map(|mut c| thread::spawn(move || f(&mut c))).collect();
        handles.into_iter().map(|h| h.join()).collect()
    }

    #[test]
    fn collectives_compute_the_right_values() {
        let results = on_ranks(4, Duration::from_secs(10), |c| {
            let r = c.rank() as f32;
            let mut buf = vec![r, 2.0 * r];
            c.all_reduce_sum(&mut buf).unwrap();
            let mut gathered = vec![0.0; 8];
            c.all_gather(&[r, r + 0.5], &mut gathered).unwrap();
            let send: Vec<f32> = (0..8).map(|i| i as f32 + r).collect();
            let mut part = vec![0.0; 2];
            c.reduce_scatter_sum(&send, &mut part).unwrap();
            let mut b = vec![r; 3];
            c.broadcast(&mut b, 2).unwrap();
            c.barrier().unwrap();
            // Many rounds in a row keep working.
            for _ in 0..200 {
                let mut x = [1.0f32];
                c.all_reduce_sum(&mut x).unwrap();
                assert_eq!(x, [4.0]);
            }
            (buf, gathered, part, b, c.bytes_sent())
        });
        for (rank, res) in results.into_iter().enumerate() {
            let (buf, gathered, part, b, sent) = res.unwrap();
            assert_eq!(buf, vec![6.0, 12.0]);
            assert_eq!(gathered, vec![0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5]);
            let k = rank as f32 * 2.0;
            assert_eq!(part, vec![4.0 * k + 6.0, 4.0 * (k + 1.0) + 6.0]);
            assert_eq!(b, vec![2.0; 3]);
            assert!(sent > 0);
        }
    }

    #[test]
    fn a_panicking_rank_fails_every_rank_quickly() {
        let start = Instant::now();
        let results = on_ranks(3, Duration::from_secs(30), |c| {
            if c.rank() == 1 {
                panic!("rank 1 crashes");
            }
            let mut x = [1.0f32];
            c.all_reduce_sum(&mut x)
        });
        assert!(results[1].is_err(), "rank 1 panicked");
        for r in [0, 2] {
            let e = results[r].as_ref().unwrap().as_ref().unwrap_err();
            assert!(e.to_string().contains("rank 1 left the group"), "{e}");
        }
        assert!(start.elapsed() < Duration::from_secs(10), "nobody waited for the timeout");
    }

    #[test]
    fn a_silent_rank_times_out_everyone() {
        let results = on_ranks(3, Duration::from_millis(200), |c| {
            if c.rank() == 2 {
                thread::sleep(Duration::from_millis(1500));
                let mut x = [1.0f32];
                return c.all_reduce_sum(&mut x);
            }
            let mut x = [1.0f32];
            c.all_reduce_sum(&mut x)
        });
        let errs: Vec<String> = results.into_iter().map(|r| r.unwrap().unwrap_err().to_string()).collect();
        assert!(errs.iter().any(|e| e.contains("timed out") && e.contains("[2]")), "{errs:?}");
        assert!(errs[2].contains("aborted"), "the late rank learns the group failed: {}", errs[2]);
    }

    #[test]
    fn mismatched_calls_are_refused() {
        let results = on_ranks(2, Duration::from_secs(5), |c| {
            let mut x = vec![1.0f32; 2 + c.rank()];
            c.all_reduce_sum(&mut x)
        });
        let errs: Vec<String> = results.into_iter().map(|r| r.unwrap().unwrap_err().to_string()).collect();
        assert!(errs.iter().any(|e| e.contains("elements while another rank called all_reduce")), "{errs:?}");
        let mut g = local_group(2, Duration::from_secs(1));
        let e = g[0].all_gather(&[1.0], &mut [0.0; 3]).unwrap_err();
        assert!(matches!(e, CommError::Invalid { .. }), "{e}");
        let e = g[0].broadcast(&mut [0.0], 5).unwrap_err();
        assert!(e.to_string().contains("root 5"), "{e}");
    }
}
