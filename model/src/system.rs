//! The whole system as a `stateright::Model`: Redis, the clients, what is in flight, the
//! clock and the history the properties read. Every action is the adversary's (see
//! `adversary`); the clients react within it.

use stateright::{Model, Property};

use crate::adversary::{self, Move};
use crate::client::{Effects, Proc};
use crate::config::Config;
use crate::net::{Net, put};
use crate::props::{self, History};
use crate::redis::Redis;

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct State {
    /// The current tick (every clock reads it: clocks are exact).
    pub now: u8,
    pub redis: Redis,
    pub procs: Vec<Proc>,
    pub net: Net,
    pub history: History,
}

/// The model checked: a configuration.
#[derive(Clone, Debug)]
pub struct LockModel {
    pub cfg: Config,
}

impl LockModel {
    pub fn new(cfg: Config) -> LockModel {
        assert!(cfg.is_sound(), "durations out of order: {cfg:?}");
        LockModel { cfg }
    }
}

impl State {
    /// Records what a client step did outside its process.
    pub fn effects(&mut self, fx: Effects) {
        for r in fx.sent {
            put(&mut self.net.requests, r);
        }
        if let Some(token) = fx.began {
            self.history.began(token);
        }
        if let Some(token) = fx.trusted {
            self.redis.trusted(token);
        }
        if fx.timed_out {
            self.history.fault();
        }
    }

    /// Forgets what can no longer change anything, so that equal situations are equal
    /// states: the order of a process's threads (they are interchangeable) and messages
    /// to processes that no longer listen.
    fn tidy(&mut self) {
        self.procs.iter_mut().for_each(Proc::sort_threads);
        let procs = &self.procs;
        self.net
            .messages
            .retain(|m| procs[usize::from(m.to)].contending().is_some());
    }
}

impl Model for LockModel {
    type State = State;
    type Action = Move;

    fn init_states(&self) -> Vec<State> {
        let cfg = &self.cfg;
        let mut s = State {
            now: 0,
            redis: Redis::default(),
            procs: (0..cfg.procs).map(|id| Proc::new(id, cfg)).collect(),
            net: Net::default(),
            history: History {
                pauses_left: cfg.pauses,
                faults_left: cfg.faults,
                ..History::default()
            },
        };
        if !cfg.free_arrivals {
            // Every thread calls `lock()` at the start.
            for p in 0..s.procs.len() {
                for t in 0..s.procs[p].threads.len() {
                    let mut fx = Effects::default();
                    s.procs[p].lock(0, t, &mut fx);
                    s.effects(fx);
                }
            }
        }
        s.tidy();
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
        props::properties(self)
    }
}
