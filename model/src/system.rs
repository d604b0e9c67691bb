//! The whole system as a `stateright::Model`: Redis, the clients, what is in flight, the
//! clock and the history the properties read. Every action is the adversary's (see
//! `adversary`); the clients react within it.

use stateright::{Model, Property};

use crate::adversary::{self, Bounds};
use crate::client::{Effects, Proc};
use crate::config::Config;
use crate::net::{Net, Request, put};
use crate::props::{self, History};
use crate::redis::{Answer, Op, Publish, Redis, Token};
use crate::world::{Budget, Ledger, Sim, Store};

/// The whole system: the current tick, Redis, the clients, what is in flight, and the
/// history the properties read.
pub type State = Sim<Redis, Proc, History>;

/// One move of the adversary on the lock.
pub type Move = adversary::Move<Proc>;

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

impl Bounds for Config {
    fn max_delay(&self) -> u8 {
        self.max_delay
    }
    fn horizon(&self) -> u8 {
        self.horizon
    }
    fn stall(&self) -> u8 {
        self.stall
    }
}

impl Store<Proc> for Redis {
    fn run(&mut self, cfg: &Config, now: u8, op: Op) -> (Answer, Vec<Publish>) {
        let (answer, published) = Redis::run(self, cfg, now, op);
        (answer, published.into_iter().collect())
    }

    fn expire(&mut self, now: u8) {
        Redis::expire(self, now);
    }
}

impl Ledger<Redis, Proc> for History {
    fn fault(&mut self) {
        History::fault(self);
    }

    fn effects(s: &mut State, fx: Effects) {
        for r in fx.sent {
            put(&mut s.net.requests, r);
        }
        for job in fx.jobs {
            if !s.net.jobs.contains(&job) {
                put(&mut s.net.jobs, job);
            }
        }
        if let Some(token) = fx.began {
            s.history.began(token);
        }
        if let Some(token) = fx.trusted {
            s.redis.trusted(token);
        }
        if fx.timed_out {
            s.history.fault();
        }
    }

    fn ticked(_cfg: &Config, s: &mut State) {
        let starving = props::starving(s);
        s.history.tick(starving);
    }

    fn ticking(_cfg: &Config, s: &mut State) {
        s.history.orphaned |= props::orphaned(s);
    }

    /// Every landing is judged: one that takes the key, and one that queues its token
    /// (the key held), which a release could grant the lock to later, to nobody.
    fn landed(s: &mut State, request: Request, _answer: Answer) {
        s.history.landed = Some(request.op.token());
    }
}

/// Forgets what can no longer change anything, so that equal situations are equal
/// states: the order of a process's threads (they are interchangeable), messages to
/// processes that no longer listen, and cleanup jobs with nothing left to give back.
fn tidy(s: &mut State) {
    s.procs.iter_mut().for_each(Proc::sort_threads);
    s.forget_unheard();
    forget_idle_jobs(s);
}

/// A job's token is one nobody uses any more: it is in Redis again only if a call with it
/// still on its way lands. A job whose token is neither in Redis (the key, a queue
/// entry) nor in a call on its way never finds anything again: forgotten.
fn forget_idle_jobs(s: &mut State) {
    let (redis, net) = (&s.redis, &s.net);
    let live = |token: Token| {
        redis.lock.is_some_and(|k| k.token == token)
            || redis.queue.iter().any(|e| e.token == token)
            || net.requests.iter().any(|r| r.op.token() == token)
            || net.stalled.is_some_and(|r| r.op.token() == token)
    };
    let keep: Vec<bool> = net.jobs.iter().map(|j| live(j.op.token())).collect();
    let mut keep = keep.into_iter();
    s.net.jobs.retain(|_| keep.next().unwrap_or(true));
}

impl Model for LockModel {
    type State = State;
    type Action = Move;

    fn init_states(&self) -> Vec<State> {
        let cfg = &self.cfg;
        let mut s = Sim {
            now: 0,
            redis: Redis::default(),
            procs: (0..cfg.procs).map(|id| Proc::new(id, cfg)).collect(),
            net: Net::default(),
            budget: Budget {
                pauses_left: cfg.pauses,
                faults_left: cfg.faults,
                stalls_left: cfg.stalls,
            },
            history: History::default(),
        };
        if !cfg.free_arrivals {
            // Every thread calls `lock()` at the start.
            for p in 0..s.procs.len() {
                for t in 0..s.procs[p].threads.len() {
                    let mut fx = Effects::default();
                    s.procs[p].lock(0, t, &mut fx);
                    History::effects(&mut s, fx);
                }
            }
        }
        tidy(&mut s);
        vec![s]
    }

    fn actions(&self, s: &State, actions: &mut Vec<Move>) {
        adversary::moves(&self.cfg, s, actions);
    }

    fn next_state(&self, last: &State, mv: Move) -> Option<State> {
        let mut s = last.clone();
        adversary::apply(&self.cfg, &mut s, mv);
        tidy(&mut s);
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        props::properties(self)
    }
}
