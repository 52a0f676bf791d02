//! A policy that misbehaves in the way its configuration asks for
//! (`mode=NAME`, optional `n=N`); with `mode=ok` it is PyTorch's default.
//!
//! | mode | misbehaviour |
//! |---|---|
//! | `ok` | none (PyTorch placement and reclamation, LRU eviction) |
//! | `loop` | every decision loops forever (deadline) |
//! | `grow` | every decision allocates until the memory cap |
//! | `trap-nth` | the `n`-th call of each role panics (trap), the others are fine |
//! | `trap-init` | `init` traps |
//! | `bad-pool` | placement names pool 7 (out of range) |
//! | `bad-round` | placement rounds to 3 bytes (not a power of two) |
//! | `bad-victims` | eviction names an unknown id and one id twice |
//! | `bad-reclaim` | reclamation names a pool that does not exist |
//! | `bad-compact` | the reclamation plan (WIT 0.2.0) compacts a pool that does not exist |
//! | `huge-compact` | the reclamation plan compacts `large` with a budget of 2^64 − 1 bytes |
//! | `empty-pools` | `pools` returns an empty list |
//! | `bad-state` | `load-state` refuses any state |
//! | `fickle` | cacheable decisions that differ between calls of one size class |
//! | `evil-name` | `name` holds terminal escapes, a carriage return and a NUL |
//! | `huge-name` | `name` is `n` MiB long |
//! | `evil-init` | `init` refuses with a message full of terminal escapes |
//! | `diverge` | decisions depend on a count of calls that `save-state` leaves out, so an instance restored from the state answers differently |
//!
//! In every mode the policy counts its decisions; `save-state` returns the
//! count (8 bytes, little endian) and `load-state` restores it, so tests can
//! see whether state was carried over a swap.

#![cfg_attr(all(target_arch = "wasm32", not(test)), no_std)]

use wasmem_policy_sdk::prelude::*;

/// The policy.
#[derive(Debug, Default)]
pub struct Hostile {
    mode: String,
    /// What `name` returns.
    label: String,
    n: u64,
    calls: u64,
    /// Calls counted outside the saved state (`diverge`).
    hidden: u64,
    hoard: Vec<Vec<u8>>,
}

impl Hostile {
    /// Counts a decision and misbehaves as configured.
    fn act(&mut self) {
        self.calls += 1;
        self.hidden += 1;
        match self.mode.as_str() {
            "loop" => {
                let mut x = self.calls;
                loop {
                    x = core::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
                }
            }
            "grow" => loop {
                let mut v = Vec::with_capacity(1 << 20);
                v.resize(1 << 20, self.calls as u8);
                self.hoard.push(core::hint::black_box(v));
            },
            "trap-nth" if self.calls == self.n => panic!("hostile policy traps on call {}", self.n),
            _ => {}
        }
    }
}

impl Policy for Hostile {
    fn name(&self) -> &str {
        &self.label
    }

    fn configure(&mut self, config: &Config) -> Result<(), String> {
        self.mode = config.get_or("mode", String::from("ok"))?;
        self.n = config.get_or("n", 3u64)?;
        self.label = match self.mode.as_str() {
            "evil-name" => String::from("\u{1b}[2J\u{1b}[31mhostile\r\0\u{202e}name"),
            "huge-name" => "h".repeat((self.n as usize) << 20),
            _ => String::from("hostile"),
        };
        match self.mode.as_str() {
            "trap-init" => panic!("hostile policy traps in init"),
            "evil-init" => Err(String::from("\u{1b}]0;owned\u{7}\u{1b}[31mrefused\r\nfake line\0")),
            _ => Ok(()),
        }
    }

    fn save_state(&self) -> Vec<u8> {
        self.calls.to_le_bytes().to_vec()
    }

    fn load_state(&mut self, state: &[u8]) -> Result<(), String> {
        if self.mode == "bad-state" {
            return Err(format!("hostile policy refuses a state of {} bytes", state.len()));
        }
        let bytes: [u8; 8] = state.try_into().map_err(|_| format!("expected 8 bytes of state, got {}", state.len()))?;
        self.calls = u64::from_le_bytes(bytes);
        Ok(())
    }
}

impl Placement for Hostile {
    fn pools(&self) -> Vec<PoolSpec> {
        if self.mode == "empty-pools" {
            Vec::new()
        } else {
            defaults::pytorch_pools()
        }
    }

    fn place(&mut self, req: &AllocRequest, _ctx: &PolicyContext) -> PlacementDecision {
        self.act();
        let d = defaults::pytorch_placement(req.bytes);
        match self.mode.as_str() {
            "bad-pool" => PlacementDecision { pool: 7, ..d },
            "bad-round" => PlacementDecision { round_to: 3, ..d },
            "fickle" => PlacementDecision { cacheable: true, segment_min: (self.calls % 2) << 21, ..d },
            "diverge" => PlacementDecision { cacheable: false, split_min_remainder: 512 + (self.hidden % 2), ..d },
            _ => d,
        }
    }
}

impl Reclamation for Hostile {
    fn reclaim(&mut self, trigger: &ReclaimTrigger, _ctx: &PolicyContext) -> ReclaimDecision {
        self.act();
        let d = defaults::pytorch_reclaim(trigger);
        match self.mode.as_str() {
            "bad-reclaim" => ReclaimDecision { release_bytes: 1, pools: Some(vec!["no-such-pool".to_string()]) },
            "diverge" => ReclaimDecision { release_bytes: self.hidden, ..d },
            _ => d,
        }
    }

    fn plan(&mut self, trigger: &ReclaimTrigger, ctx: &PolicyContext) -> ReclaimPlan {
        let p = defaults::plan_of(self.reclaim(trigger, ctx));
        let compact = |pool: &str, max_bytes| Some(Compaction { pool: pool.to_string(), max_bytes });
        match self.mode.as_str() {
            "bad-compact" => ReclaimPlan { compact: compact("no-such-pool", 1), ..p },
            "huge-compact" => ReclaimPlan { compact: compact("large", u64::MAX), ..p },
            _ => p,
        }
    }
}

impl Eviction for Hostile {
    fn choose_victims(&mut self, need_bytes: u64, candidates: &[EvictionCandidate], _ctx: &PolicyContext) -> Vec<u64> {
        self.act();
        let mut v = defaults::lru_victims(need_bytes, candidates);
        if self.mode == "bad-victims" {
            v.push(u64::MAX);
            if let Some(&first) = v.first() {
                v.push(first);
            }
        }
        if self.mode == "diverge" && self.hidden % 2 == 1 {
            v.reverse();
        }
        v
    }
}

export!(Hostile: placement, reclamation, eviction);
