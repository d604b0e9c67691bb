//! A model of the holds several owners share: a read-write lock's read and write holds
//! and a semaphore's permits, with the grants their releases make (`proto::rw_scripts`),
//! checked as the lock is (`crate::system`) and moved by the same adversary
//! (`crate::adversary`): requests run in any order, late or never, replies and messages
//! lost or duplicated, a process paused, time advancing.
//!
//! | file | job |
//! |---|---|
//! | `config.rs` | bounds, durations, the variants |
//! | `redis.rs` | the sorted sets, marks, nonces, fence counter; the scripts |
//! | `client.rs` | a process: wait, grants, renewals, release |
//! | `props.rs` | exclusion, fencing, a permit left free, and the paths taken |

pub mod client;
pub mod config;
pub mod props;
pub mod redis;

use stateright::{Model, Property};

use crate::adversary::{self, Bounds};
use crate::net::{Net, put};
use crate::shared::client::{Effects, Proc};
use crate::shared::config::{SharedConfig, Want};
use crate::shared::redis::{Answer, Op, Publish, Redis};
use crate::world::{Budget, Ledger, Sim, Store};

/// The whole system.
pub type State = Sim<Redis, Proc, History>;

/// One move of the adversary on the shared holds.
pub type Move = adversary::Move<Proc>;

/// The write fences seen, and how long a permit has been left free.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct History {
    /// The last write hold's fence.
    pub last_fence: u8,
    /// A write hold began with a fence not above the one before.
    pub fence_regressed: bool,
    /// Ticks in a row, since the last fault, with a permit free while a permit-seeker
    /// waits (`props::unclaimed`).
    pub unclaimed: u8,
}

impl Ledger<Redis, Proc> for History {
    fn fault(&mut self) {
        self.unclaimed = 0;
    }

    fn ticked(cfg: &SharedConfig, s: &mut State) {
        s.history.unclaimed = if props::unclaimed(cfg, s) {
            s.history.unclaimed.saturating_add(1)
        } else {
            0
        };
    }

    fn effects(s: &mut State, fx: Effects) {
        for r in fx.sent {
            put(&mut s.net.requests, r);
        }
        if let Some((Want::Write, fence)) = fx.began {
            let h = &mut s.history;
            h.fence_regressed |= fence <= h.last_fence;
            h.last_fence = fence;
        }
    }
}

impl Store<Proc> for Redis {
    fn run(&mut self, cfg: &SharedConfig, now: u8, op: Op) -> (Answer, Vec<Publish>) {
        Redis::run(self, cfg, now, op)
    }

    fn expire(&mut self, now: u8) {
        Redis::expire(self, now);
    }
}

impl Bounds for SharedConfig {
    fn max_delay(&self) -> u8 {
        self.max_delay
    }
    fn horizon(&self) -> u8 {
        self.horizon
    }
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

impl Model for SharedModel {
    type State = State;
    type Action = Move;

    fn init_states(&self) -> Vec<State> {
        let cfg = &self.cfg;
        let mut s = Sim {
            now: 0,
            redis: Redis::default(),
            procs: Vec::new(),
            net: Net::default(),
            budget: Budget {
                pauses_left: cfg.pauses,
                faults_left: cfg.faults,
                stalls_left: 0,
            },
            history: History::default(),
        };
        for (id, &want) in (0u8..).zip(&cfg.wants) {
            let mut fx = Effects::default();
            s.procs.push(Proc::new(cfg, id, want, &mut fx));
            History::effects(&mut s, fx);
        }
        vec![s]
    }

    fn actions(&self, s: &State, actions: &mut Vec<Move>) {
        adversary::moves(&self.cfg, s, actions);
    }

    fn next_state(&self, last: &State, mv: Move) -> Option<State> {
        let mut s = last.clone();
        adversary::apply(&self.cfg, &mut s, mv);
        s.forget_unheard();
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        props::properties(&self.cfg)
    }
}
