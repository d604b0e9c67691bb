//! A model of the holds several owners share: a read-write lock's read and write holds
//! and a semaphore's permits, with the grants their releases make (`proto::rw_scripts`),
//! checked as the lock is (`crate::system`) and moved by the same adversary
//! (`crate::adversary`): requests run in any order, late or never, one first send stalled
//! to land after its retry, the cleanup's jobs fired, replies and messages lost or
//! duplicated, a process paused, time advancing.
//!
//! | file | job |
//! |---|---|
//! | `config.rs` | bounds, durations, the variants |
//! | `redis.rs` | the sorted sets, marks, nonces, fence counter; the scripts |
//! | `client.rs` | a process: wait, grants, renewals, release, the cleanup's jobs |
//! | `props.rs` | exclusion, fencing, a permit left free, no hold for nobody, and the paths taken |

pub mod client;
pub mod config;
pub mod props;
pub mod redis;

use stateright::{Model, Property};

use crate::adversary::{self, Bounds};
use crate::net::{Net, Request, put};
use crate::shared::client::{Effects, Phase, Proc};
use crate::shared::config::{SharedConfig, Want};
use crate::shared::redis::{Answer, Member, Op, Publish, Redis};
use crate::world::{Budget, Ledger, Sim, Store};

/// The whole system.
pub type State = Sim<Redis, Proc, History>;

/// One move of the adversary on the shared holds.
pub type Move = adversary::Move<Proc>;

/// The write fences seen, how long a permit has been left free, and what a stalled send
/// that landed left.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct History {
    /// The last write hold's fence.
    pub last_fence: u8,
    /// A write hold began with a fence not above the one before.
    pub fence_regressed: bool,
    /// Ticks in a row, since the last fault, with a permit free while a permit-seeker
    /// waits (`props::unclaimed`).
    pub unclaimed: u8,
    /// The stalled request that landed, if one did.
    pub landed: Option<Landed>,
    /// The release that would give back what a late upgrade left was dropped on its way:
    /// that hold is left to its lease, as any hold whose release is lost
    /// (`props::orphaned`).
    pub release_dropped: bool,
    /// At the end of a tick, what the landed request left held (or marked) a member
    /// nobody used.
    pub orphaned: bool,
    /// What the landed request left for nobody was given back within its tick (for the
    /// vacuity check).
    pub given_back: bool,
}

/// A stalled request that landed: the member it carried, whether it was an upgrade
/// (which turns the upgradable read into the write hold of its token), and whether the
/// mark it left among the waiting writers (a writer's, a permit-seeker's, a waiting
/// upgrade's) is still there.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Landed {
    pub member: Member,
    pub upgrade: bool,
    pub marked: bool,
}

impl Landed {
    /// `op`, answered `answer` if it ran.
    fn of(op: Op, answer: Option<Answer>) -> Option<Landed> {
        let failed = matches!(answer, Some(Answer::Failed { .. }));
        match op {
            Op::Acquire { m, marks, .. } => Some(Landed {
                member: m,
                upgrade: false,
                marked: failed && marks && matches!(m.want, Want::Write | Want::Permit),
            }),
            Op::Upgrade { m, waits } => Some(Landed {
                member: m,
                upgrade: true,
                marked: failed && waits,
            }),
            _ => None,
        }
    }
}

impl Ledger<Redis, Proc> for History {
    fn fault(&mut self) {
        self.unclaimed = 0;
    }

    fn ticking(cfg: &SharedConfig, s: &mut State) {
        s.history.orphaned |= props::orphaned(cfg, s);
    }

    /// Every landing is judged: one that takes a hold, and one that marks its member
    /// waiting, which a release could grant the hold to later, to nobody.
    fn landed(s: &mut State, request: Request<Op>, answer: Answer) {
        s.history.landed = Landed::of(request.op, Some(answer));
    }

    /// The guard's last release (of its upgradable read, or of the write hold it upgraded
    /// it to), dropped while a late upgrade of it is stalled or landed: the write hold the
    /// upgrade made (or refreshed) is left to its lease, as the guard's hold would be (a
    /// release is not left to the cleanup thread).
    fn dropped(s: &mut State, request: Request<Op>) {
        let Op::Release { m } = request.op else {
            return;
        };
        let late = s.net.stalled.and_then(|r| Landed::of(r.op, None));
        let Some(l) = late.or(s.history.landed).filter(|l| l.upgrade) else {
            return;
        };
        let last = s.procs[usize::from(request.from)].phase == Phase::Done;
        if last && (m == l.member || m == l.member.turned(Want::Write)) {
            s.history.release_dropped = true;
        }
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
        for job in fx.jobs {
            if !s.net.jobs.contains(&job) {
                put(&mut s.net.jobs, job);
            }
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
    fn stall(&self) -> u8 {
        self.stall
    }
}

/// Forgets what can no longer change anything, so that equal situations are equal
/// states: messages to processes that no longer listen, and cleanup jobs with nothing left
/// to give back.
fn tidy(s: &mut State) {
    s.forget_unheard();
    forget_idle_jobs(s);
    // The mark a landing left went (taken out, or granted): a mark of the member made
    // later is another call's.
    if let Some(l) = &mut s.history.landed
        && l.marked
        && !s.redis.writers.iter().any(|e| e.member == l.member)
    {
        l.marked = false;
    }
}

/// A job's member is one nobody uses any more: it is in Redis again only if a call that
/// leaves it (an attempt, an upgrade) is still on its way. A job whose member (with, for
/// an upgradable read's, the write hold of its token) is neither in Redis (a hold, a mark,
/// a nonce, an arrival) nor left by a call on its way never finds anything of its own
/// again: forgotten. (A permit-seeker's leave that finds nothing of its own still wakes
/// the next seeker when a permit is free, as any look of the library's would: forgotten
/// with the rest, it wakes nobody, on the side of fewer wake-ups.)
fn forget_idle_jobs(s: &mut State) {
    let (redis, net) = (&s.redis, &s.net);
    let live = |m: Member| {
        let ours = |x: Member| x == m || (m.want == Want::Upgradable && x == m.turned(Want::Write));
        let entries = [&redis.holds, &redis.writers, &redis.readers];
        entries.iter().any(|set| set.iter().any(|e| ours(e.member)))
            || redis.nonces.iter().any(|&(x, _)| ours(x))
            || redis.arrivals.iter().any(|&x| ours(x))
            || net
                .requests
                .iter()
                .chain(&net.stalled)
                .any(|r| r.op.leaves().into_iter().flatten().any(ours))
    };
    let keep: Vec<bool> = net.jobs.iter().map(|j| live(j.op.member())).collect();
    let mut keep = keep.into_iter();
    s.net.jobs.retain(|_| keep.next().unwrap_or(true));
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
                stalls_left: cfg.stalls,
            },
            history: History::default(),
        };
        for (id, &want) in (0u8..).zip(&cfg.wants) {
            let mut fx = Effects::default();
            s.procs.push(Proc::new(cfg, id, want, &mut fx));
            History::effects(&mut s, fx);
        }
        tidy(&mut s);
        vec![s]
    }

    fn actions(&self, s: &State, actions: &mut Vec<Move>) {
        adversary::moves(&self.cfg, s, actions);
    }

    fn next_state(&self, last: &State, mv: Move) -> Option<State> {
        let mut s = last.clone();
        let tick = matches!(mv, Move::Tick { .. });
        adversary::apply(&self.cfg, &mut s, mv);
        tidy(&mut s);
        let cfg = &self.cfg;
        if !tick && props::orphaned(cfg, last) && !props::orphaned(cfg, &s) {
            s.history.given_back = true;
        }
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        props::properties(&self.cfg)
    }
}
