//! A model of redbaton's one-node lock protocol, and of its read-write locks and
//! semaphores ([`shared`]), checked exhaustively with [stateright](https://docs.rs/stateright).
//!
//! The Lua scripts are atomic steps on a Redis state with TTLs ([`redis`]); client
//! processes of several threads are state machines that contend, queue, hear grants and
//! confirm them, renew, extend, hand the lock on locally and release ([`client`]); an
//! adversary runs requests in any order, late or not at all, holds one back to land
//! ticks later, fires the cleanup's jobs, loses replies and messages, pauses processes
//! and advances time ([`adversary`]). Breadth-first search
//! visits every state within the bounds of a [`Config`] and checks the properties of
//! [`props`] in each.
//!
//! | file | job |
//! |---|---|
//! | `config.rs` | bounds, durations (ticks), protocol variants |
//! | `redis.rs` | Redis state; the scripts (`proto::scripts`, `proto::fair_scripts`) |
//! | `world.rs` | what every model is made of, and the traits the adversary drives |
//! | `net.rs` | requests, replies, messages in flight |
//! | `client.rs` | a process: threads, local handoff, contender, watchdog, extend, release |
//! | `adversary.rs` | network, pauses, time (for every model) |
//! | `props.rs` | the properties and the history they read |
//! | `system.rs` | the `stateright::Model` tying them together |
//! | `shared/` | the same for read-write locks and semaphores: their scripts and grants |
//! | `redlock.rs` | Redlock's fencing tokens across nodes whose counters and clocks drift |
//!
//! `cargo test -p redbaton-model` checks [`Config::ci`] and the broken variants; the
//! longer check is `cargo run --release -p redbaton-model --example deep` (see the crate
//! README).

pub mod adversary;
pub mod client;
pub mod config;
pub mod net;
pub mod props;
pub mod redis;
pub mod redlock;
pub mod shared;
pub mod system;
pub mod world;

use std::fmt::Debug;
use std::hash::Hash;
use std::time::{Duration, Instant};

use stateright::{Checker, HasDiscoveries, Model};

pub use config::{Config, Grants, Mode, Rules};
pub use shared::SharedModel;
pub use shared::config::{SharedConfig, SharedRules, Want};
pub use system::{LockModel, Move, State};

/// The outcome of a check.
#[derive(Debug)]
pub struct Report {
    /// Distinct states visited.
    pub states: usize,
    /// The longest path explored, in steps.
    pub depth: usize,
    pub elapsed: Duration,
    /// Violated `always` properties, each with the length (steps) of the shortest path
    /// found to a violation, and that path.
    pub violations: Vec<(&'static str, usize, String)>,
    /// `sometimes` properties never met.
    pub never: Vec<&'static str>,
    /// Whether every state within the bounds was visited.
    pub complete: bool,
}

impl Report {
    /// Prints the figures and the path to each violation; panics unless the check
    /// finished with none.
    pub fn assert_holds(&self) {
        println!(
            "{} states, depth {}, {:.1?}",
            self.states, self.depth, self.elapsed
        );
        for (name, steps, path) in &self.violations {
            println!("VIOLATED {name} after {steps} steps:\n{path}");
        }
        assert!(self.complete, "the check did not finish");
        assert!(self.violations.is_empty(), "violations: see above");
    }

    /// [`assert_holds`](Self::assert_holds), and every `sometimes` property met: the check
    /// took every path its configuration names.
    pub fn assert_holds_on_every_path(&self) {
        self.assert_holds();
        assert!(self.never.is_empty(), "paths never taken: {:?}", self.never);
    }

    /// Prints the path to each violation; the length of the shortest path found to a
    /// violation of `property`, and a panic if there is none.
    pub fn assert_broken(&self, property: &str) -> usize {
        for (name, steps, path) in &self.violations {
            println!(
                "{name}: a path of {steps} steps ({} states, {:.1?}):\n{path}",
                self.states, self.elapsed
            );
        }
        let found = self.violations.iter().find(|v| v.0 == property);
        found.expect("the checker finds the violation").1
    }
}

/// Checks `cfg` breadth-first on `threads` threads. With `until`, stops once that
/// property is violated (its path is then a shortest one; violations of others found
/// on the way are reported too).
pub fn check(cfg: Config, threads: usize, until: Option<&'static str>) -> Report {
    check_model(LockModel::new(cfg), threads, until)
}

/// [`check`] for Redlock's fencing tokens across nodes (see [`redlock`]).
pub fn check_redlock(
    cfg: redlock::RedlockConfig,
    threads: usize,
    until: Option<&'static str>,
) -> Report {
    check_model(redlock::RedlockModel::new(cfg), threads, until)
}

/// [`check`] for the shared holds: a read-write lock or a semaphore (see [`shared`]).
pub fn check_shared(cfg: SharedConfig, threads: usize, until: Option<&'static str>) -> Report {
    check_model(SharedModel::new(cfg), threads, until)
}

fn check_model<M>(model: M, threads: usize, until: Option<&'static str>) -> Report
where
    M: Model + Send + Sync + 'static,
    M::State: Clone + Debug + Hash + PartialEq + Send + Sync + 'static,
    M::Action: Clone + Debug + PartialEq + Send + Sync + 'static,
{
    let props = model.properties();
    let started = Instant::now();
    let mut builder = model.checker().threads(threads);
    if let Some(name) = until {
        builder = builder.finish_when(HasDiscoveries::AnyOf([name].into()));
    }
    let checker = builder.spawn_bfs().join();
    let elapsed = started.elapsed();
    let mut violations = Vec::new();
    let mut never = Vec::new();
    for p in &props {
        let found = checker.discovery(p.name);
        match (p.expectation.discovery_is_failure(), found) {
            (true, Some(path)) => {
                let steps = path.clone().into_actions().len();
                violations.push((p.name, steps, format!("{path}")));
            }
            (false, None) => never.push(p.name),
            _ => {}
        }
    }
    Report {
        states: checker.unique_state_count(),
        depth: checker.max_depth(),
        elapsed,
        complete: checker.is_done(),
        violations,
        never,
    }
}
