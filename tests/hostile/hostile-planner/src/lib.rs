//! A planner (WIT 0.4.0, world `planner-policy`) that misbehaves in the way
//! its configuration asks for (`mode=NAME`); with `mode=ok` it is the
//! engine's greedy planner. A crate of its own (not a mode of `hostile`):
//! a component that also exported the planner would turn planned placement
//! on in every test that loads `hostile`.
//!
//! | mode | plan |
//! |---|---|
//! | `ok` | the engine's greedy plan |
//! | `overlap` | every request at offset 0 (lifetimes overlap) |
//! | `outside` | offsets past the end of a 512-byte arena |
//! | `unaligned` | offsets of 7 bytes (not a multiple of 512) |
//! | `wrong-length` | one offset, whatever the number of requests |
//! | `too-large` | an arena of 2^64 − 512 bytes (more than any device) |
//! | `unknown-life` | also plans the requests whose end of life is unknown |
//! | `refuse` | `Err` with a message |
//! | `trap` | panics (a trap, its message logged) |
//! | `deadline` | loops forever |
//! | `grow` | allocates until the memory cap |
//!
//! The `alias-*` modes plan plainly as the engine does and misbehave in
//! `plan-aliased` alone (for profiles of two steps whose output outlives its
//! next instance; any other mode answers it as the engine):
//!
//! | mode | aliased plan |
//! |---|---|
//! | `alias-overlap` | every request at offset 0 of its window |
//! | `alias-zone` | end zones larger than half the arena |
//! | `alias-pages` | an arena that is not whole 2 MiB pages |
//! | `alias-outside` | offsets past the end of the window |
//! | `alias-refuse` | `Err` with a message |
//! | `alias-trap` | panics (a trap, its message logged) |

#![cfg_attr(all(target_arch = "wasm32", not(test)), no_std)]

use wasmem_policy_sdk::prelude::*;

/// The planner.
#[derive(Debug, Default)]
pub struct HostilePlanner {
    mode: String,
    hoard: Vec<Vec<u8>>,
}

impl Policy for HostilePlanner {
    fn name(&self) -> &str {
        "hostile-planner"
    }

    fn configure(&mut self, config: &Config) -> Result<(), String> {
        self.mode = config.get_or("mode", String::from("ok"))?;
        const MODES: [&str; 17] = [
            "ok",
            "overlap",
            "outside",
            "unaligned",
            "wrong-length",
            "too-large",
            "unknown-life",
            "refuse",
            "trap",
            "deadline",
            "grow",
            "alias-overlap",
            "alias-zone",
            "alias-pages",
            "alias-outside",
            "alias-refuse",
            "alias-trap",
        ];
        if MODES.contains(&self.mode.as_str()) {
            Ok(())
        } else {
            Err(format!("unknown mode `{}` (expected one of {})", self.mode, MODES.join(", ")))
        }
    }
}

impl Planner for HostilePlanner {
    fn plan(&mut self, profile: &StepProfile) -> Result<ArenaPlan, String> {
        let n = profile.requests.len();
        let total: u64 = profile.requests.iter().map(defaults::planned_bytes).sum();
        // Only the requests the engine lets a plan cover, so that the one
        // fault of each mode is what the engine finds.
        let all = |off: u64| -> Vec<Option<u64>> {
            let known = |(k, r)| defaults::plannable(r, k as u32).then_some(off);
            profile.requests.iter().enumerate().map(known).collect()
        };
        let good = defaults::greedy_plan(profile);
        Ok(match self.mode.as_str() {
            "overlap" => ArenaPlan { arena_bytes: total, offsets: all(0) },
            "outside" => ArenaPlan { arena_bytes: defaults::PLAN_ALIGN, offsets: all(1 << 20) },
            "unaligned" => ArenaPlan { arena_bytes: total + 4096, offsets: all(7) },
            "wrong-length" => ArenaPlan { arena_bytes: total, offsets: vec![Some(0)] },
            "too-large" => ArenaPlan { arena_bytes: u64::MAX - 511, offsets: vec![None; n] },
            "unknown-life" => {
                // Every request in a place of its own: valid but for the lifetimes.
                let mut off = 0;
                let offsets = profile
                    .requests
                    .iter()
                    .map(|r| {
                        let o = off;
                        off += defaults::planned_bytes(r);
                        Some(o)
                    })
                    .collect();
                ArenaPlan { arena_bytes: off, offsets }
            }
            "refuse" => return Err(format!("hostile planner refuses a profile of {n} requests")),
            "trap" => panic!("hostile planner traps on a profile of {n} requests"),
            "deadline" => {
                let mut x = n as u64;
                loop {
                    x = core::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
                }
            }
            "grow" => loop {
                let mut v = Vec::with_capacity(1 << 20);
                v.resize(1 << 20, n as u8);
                self.hoard.push(core::hint::black_box(v));
            },
            _ => good,
        })
    }

    fn plan_aliased(&mut self, profile: &StepProfile) -> Result<Option<AliasedPlan>, String> {
        let n = profile.requests.len();
        let Some(good) = defaults::aliased_plan(profile) else { return Ok(None) };
        let page = 2 << 20;
        let all = |off: u64| -> Vec<Option<u64>> {
            let known = |(k, r)| defaults::plannable(r, k as u32).then_some(off);
            profile.requests.iter().enumerate().map(known).collect()
        };
        Ok(Some(match self.mode.as_str() {
            "alias-overlap" => AliasedPlan { offsets: all(0), ..good },
            "alias-zone" => AliasedPlan { zone_bytes: good.arena_bytes / page * page + page, ..good },
            "alias-pages" => AliasedPlan { arena_bytes: good.arena_bytes + 512, ..good },
            "alias-outside" => AliasedPlan { offsets: all(good.arena_bytes), ..good },
            "alias-refuse" => return Err(format!("hostile planner refuses an aliased plan of {n} requests")),
            "alias-trap" => panic!("hostile planner traps on an aliased plan of {n} requests"),
            _ => good,
        }))
    }
}

export!(HostilePlanner: planner);
