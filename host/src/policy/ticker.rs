//! The epoch ticker: a thread that increments the engine's epoch every tick,
//! so that a policy call running past its deadline is interrupted
//! (`Trap::Interrupt`). One ticker per [`super::Runtime`]; it stops when the
//! runtime is dropped.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use wasmtime::Engine;

/// Handle to the ticker thread; dropping it stops the thread (within one tick).
pub(crate) struct Ticker {
    stop: Arc<AtomicBool>,
}

impl Ticker {
    /// Starts a thread that calls `engine.increment_epoch()` every `tick`.
    pub(crate) fn start(engine: Engine, tick: Duration) -> Ticker {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let spawned = std::thread::Builder::new().name("wasmem-epoch".into()).spawn(move || {
            while !flag.load(Ordering::Relaxed) {
                std::thread::sleep(tick);
                engine.increment_epoch();
            }
        });
        if let Err(e) = spawned {
            // Without the ticker no deadline fires; fuel (if set) still does.
            tracing::error!(error = %e, "cannot start the epoch ticker thread: policy deadlines are not enforced");
        }
        Ticker { stop }
    }
}

impl Drop for Ticker {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}
