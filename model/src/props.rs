//! The properties checked, and the history they need.
//!
//! - **mutual exclusion**: at most one thread believes it holds the lock with validity
//!   covering now (`now < valid_until`), a paused process's belief included;
//! - **fencing**: each thread that begins to hold (a remote acquisition or a local
//!   handoff) has a fencing token (`fence << k | handoffs`) above every earlier holder's;
//! - **no starvation** (a bounded, safety-style liveness check): a thread is not left in
//!   `lock()` for more than `Config::starve_bound` ticks in a row while the key is free,
//!   no other token is queued, no process is paused and no thread of its own process
//!   holds the guard, counted from the last fault (a loss, a late run, a pause or
//!   resume, a client's timeout). Faults can delay anyone as long as
//!   they go on; the bound says that once they stop, the protocol itself never leaves a
//!   waiter behind a free lock.
//!
//! - **no hold for nobody** (`ORPHAN`): an acquisition that landed late (stalled on its
//!   way, see `adversary`) does not hold the key, at a tick's end, with a token that no
//!   process holds or waits with, whether it took the key as it landed or queued its
//!   token then (the key held) and was granted the lock later: the cleanup's look again
//!   gives the key back, or takes the entry out, within the tick it landed. Left there,
//!   it would keep the name nobody's for a lease (or a grant lease), every waiter behind
//!   it.
//!
//! - **the news of a lost hold**: every `previous_lost` answer (an acquisition's, from
//!   the fence counter's forms, or a trusted grant's: nothing was lost) is the ghost
//!   truth `redis::Truth` kept from the events themselves: true exactly when the last
//!   hold ended without a release (its key expired, a grant that ran out unconfirmed
//!   included), where a holder's release clears it, an attempt given back unused leaves
//!   it, and a local handoff passes the hold on as no news (`Hold::previous_lost` is the
//!   remote acquisition's).
//!
//! `sometimes` properties show that the paths are taken at all: a lock held, a grant
//! confirmed (fair), a grant taken without a confirming attempt (fair), a local handoff,
//! an `extend` applied, a lost hold reported.

use stateright::Property;

use crate::redis::Token;
use crate::system::{LockModel, State};

/// The names of the `always` properties that the broken variants' checks look for.
pub const EXCLUSION: &str = "mutual exclusion";
pub const LOST_NEWS: &str = "previous_lost tells a lost hold, and only one";
pub const STARVATION: &str = "no waiter starves behind a free lock";
pub const ORPHAN: &str = "no late acquisition holds the lock for nobody";

/// What the properties remember of the past.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct History {
    /// The last fencing token a holder began with.
    pub last_token: Option<(u8, u8)>,
    /// A holder began with a token not above the one before.
    pub token_regressed: bool,
    /// Ticks in a row with a starving waiter, since the last fault.
    pub starving: u8,
    /// The token of the stalled request that landed, if one did.
    pub landed: Option<Token>,
    /// At the end of a tick, the key was held by that token, and nobody used it.
    pub orphaned: bool,
}

impl History {
    /// A thread began to hold with `token`.
    pub fn began(&mut self, token: (u8, u8)) {
        if self.last_token.is_some_and(|last| token <= last) {
            self.token_regressed = true;
        }
        self.last_token = Some(token);
    }

    pub fn fault(&mut self) {
        self.starving = 0;
    }

    /// Time advanced; `starving` says whether a waiter starves at the new tick.
    pub fn tick(&mut self, starving: bool) {
        self.starving = if starving {
            self.starving.saturating_add(1)
        } else {
            0
        };
    }
}

/// The threads that believe they hold the lock now.
pub fn believers(s: &State) -> usize {
    s.procs.iter().filter(|p| p.believes(s.now)).count()
}

/// Whether some thread waits in `lock()` while the key is free, no token but its own is
/// queued, and nobody is paused. A thread waiting behind a holder of its own process
/// waits for that thread's unlock, which is the application's business (also when the
/// holder's lease ran out): it does not count.
pub fn starving(s: &State) -> bool {
    s.redis.lock.is_none()
        && s.procs.iter().all(|p| !p.pid.paused)
        && s.procs.iter().any(|p| {
            p.has_waiter() && p.hold().is_none() && {
                let own = p.contending();
                s.redis.queue.iter().all(|e| Some(e.token) == own)
            }
        })
}

/// Whether the key is held by the token of the request that landed late, and no process
/// holds it, waits with it or is releasing it: nobody will release it or confirm it.
pub fn orphaned(s: &State) -> bool {
    s.redis.lock.is_some_and(|key| {
        s.history.landed == Some(key.token) && s.procs.iter().all(|p| !p.uses(key.token))
    })
}

pub fn properties(model: &LockModel) -> Vec<Property<LockModel>> {
    let mut props = vec![
        Property::always(EXCLUSION, |_, s: &State| believers(s) <= 1),
        Property::always("fencing tokens increase", |_, s: &State| {
            !s.history.token_regressed
        }),
        Property::always(LOST_NEWS, |_, s: &State| !s.redis.truth.wrong),
        Property::always(STARVATION, |m: &LockModel, s: &State| {
            s.history.starving <= m.cfg.starve_bound
        }),
        Property::always(ORPHAN, |_, s: &State| !s.history.orphaned),
        Property::sometimes(
            "a late acquisition takes the lock for nobody",
            |_, s: &State| orphaned(s),
        ),
        Property::sometimes("a lock is held", |_, s: &State| believers(s) == 1),
        Property::sometimes("a local handoff", |_, s: &State| {
            s.procs
                .iter()
                .filter_map(|p| p.hold())
                .any(|h| h.handoffs > 0)
        }),
        Property::sometimes("a lost hold reported", |_, s: &State| {
            s.procs
                .iter()
                .filter_map(|p| p.hold())
                .any(|h| h.previous_lost && s.now < h.valid_until)
        }),
        Property::sometimes("an extend applied", |m: &LockModel, s: &State| {
            s.procs
                .iter()
                .filter_map(|p| p.hold())
                .any(|h| h.lease != m.cfg.lease && s.now < h.valid_until)
        }),
    ];
    if model.cfg.mode == crate::config::Mode::Fair {
        props.push(Property::sometimes("a grant confirmed", |_, s: &State| {
            s.procs
                .iter()
                .filter_map(|p| p.hold())
                .any(|h| h.granted && s.now < h.valid_until)
        }));
    }
    if model.cfg.mode == crate::config::Mode::Fair
        && model.cfg.rules.grants == crate::config::Grants::Trusted
    {
        props.push(Property::sometimes(
            "a grant taken without a confirming attempt",
            |_, s: &State| {
                s.procs
                    .iter()
                    .filter_map(|p| p.hold())
                    .any(|h| h.trusted && s.now < h.valid_until)
            },
        ));
    }
    props
}
