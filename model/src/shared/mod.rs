//! A model of the holds several owners share: a read-write lock's read and write holds
//! and a semaphore's permits, with the grants their releases make (`proto::rw_scripts`),
//! checked as the lock is (`crate::system`) and by the same adversary's moves: requests
//! run in any order, late or never, replies and messages lost or duplicated, a process
//! paused, time advancing.
//!
//! | file | job |
//! |---|---|
//! | `config.rs` | bounds, durations, the grant variant |
//! | `redis.rs` | the sorted sets, marks, nonces, fence counter; the scripts |
//! | `client.rs` | a process: wait, grants, renewals, release |
//! | `adversary.rs` | the moves |
//! | `props.rs` | exclusion, fencing, and the paths taken |

pub mod adversary;
pub mod client;
pub mod config;
pub mod props;
pub mod redis;

use stateright::{Model, Property};

use crate::net::{Net, put};
use crate::shared::adversary::Move;
use crate::shared::client::{Effects, Proc};
use crate::shared::config::SharedConfig;
use crate::shared::redis::{Op, Publish, Redis};

/// The whole system.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct State {
    pub now: u8,
    pub redis: Redis,
    pub procs: Vec<Proc>,
    pub net: Net<Op, Publish>,
    /// The last write hold's fence, and whether a write hold began with a fence not
    /// above it.
    pub last_fence: u8,
    pub fence_regressed: bool,
    pub pauses_left: u8,
    pub faults_left: u8,
}

/// The model checked: a configuration.
#[derive(Clone, Debug)]
pub struct SharedModel {
    pub cfg: SharedConfig,
}

impl SharedModel {
    pub fn new(cfg: SharedConfig) -> SharedModel {
        assert!(cfg.is_sound(), "durations out of order: {cfg:?}");
        SharedModel { cfg }
    }
}

impl State {
    /// Records what a process's step did outside it.
    pub fn effects(&mut self, fx: Effects) {
        for r in fx.sent {
            put(&mut self.net.requests, r);
        }
        if let Some((crate::shared::config::Want::Write, fence)) = fx.began {
            if fence <= self.last_fence {
                self.fence_regressed = true;
            }
            self.last_fence = fence;
        }
    }

    /// Messages to processes that no longer listen change nothing.
    fn tidy(&mut self) {
        let procs = &self.procs;
        self.net
            .messages
            .retain(|m| procs[usize::from(m.to)].waits());
    }
}

impl Model for SharedModel {
    type State = State;
    type Action = Move;

    fn init_states(&self) -> Vec<State> {
        let cfg = &self.cfg;
        let mut s = State {
            now: 0,
            redis: Redis::default(),
            procs: Vec::new(),
            net: Net::default(),
            last_fence: 0,
            fence_regressed: false,
            pauses_left: cfg.pauses,
            faults_left: cfg.faults,
        };
        for (id, &want) in (0u8..).zip(&cfg.wants) {
            let mut fx = Effects::default();
            s.procs.push(Proc::new(cfg, id, want, &mut fx));
            s.effects(fx);
        }
        vec![s]
    }

    fn actions(&self, s: &State, actions: &mut Vec<Move>) {
        adversary::moves(&self.cfg, s, actions);
    }

    fn next_state(&self, last: &State, mv: Move) -> Option<State> {
        let mut s = last.clone();
        adversary::apply(&self.cfg, &mut s, mv);
        s.tidy();
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        props::properties(&self.cfg)
    }
}
