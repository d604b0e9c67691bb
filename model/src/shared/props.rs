//! The properties of the shared holds.
//!
//! - **exclusion**: while a process believes it holds the write hold (`now <
//!   valid_until`, a paused process's belief included), no other believes it holds
//!   anything; at most one believes it holds the upgradable read; at most `permits`
//!   believe they hold a permit;
//! - **fencing**: each write hold begins with a fence above every earlier write hold's;
//! - **no permit left unclaimed** (a bounded, safety-style liveness check, as the lock's
//!   starvation check): a semaphore's permit is not left free in Redis for more than
//!   `SharedConfig::starve_bound` ticks in a row while a permit-seeker waits and nobody
//!   is paused, counted from the last fault. A permit granted to a seeker that never
//!   takes it lapses with the key (its TTL fitted to the grant), and whoever waits next
//!   gets in by its re-check, or at once when the grantee leaves (`WAITER_LEAVE` wakes
//!   it).
//! - **no hold for nobody** (`ORPHAN`, with `SharedConfig::stalls`): what a stalled
//!   send that landed late left (an attempt's member, held; the mark it made among the
//!   waiting writers, a writer's or a permit-seeker's, while that mark lasts; the write
//!   hold an upgrade made of an upgradable read, or the waiting upgrade's mark it made)
//!   does not hold, is not granted, and does not mark a waiting writer, at the end of a
//!   tick, while no process uses that member (`Proc::uses`: waits with it, holds it, or
//!   will give it back with its hold) and no request on its way gives it back. The
//!   cleanup's looks again give it back within the tick it landed; a guard's release
//!   gives back the write hold a late upgrade made of its upgradable read, unless that
//!   release was dropped on its way (then the hold is left to its lease, as any hold
//!   whose release is lost). A reader's mark is not judged: it holds nobody back, and a
//!   read grant to it is a hold, which is.
//!
//! `sometimes` properties show the paths are taken: each kind of hold taken from a grant
//! with no confirming attempt, a hold won with a new member after a late win was given
//! back, holds shared (two readers, two permits, at once), and, with stalls, a late
//! landing that holds for nobody and is given back (and a late upgrade turning a guard's
//! upgradable read).

use stateright::Property;

use crate::config::Grants;
use crate::shared::config::{SharedConfig, Want};
use crate::shared::redis::{Entry, Member, Op};
use crate::shared::{SharedModel, State};

pub const EXCLUSION: &str = "shared exclusion";
pub const UNCLAIMED: &str = "no permit left free while a permit-seeker waits";
pub const ORPHAN: &str = "no late attempt holds a shared hold for nobody";

/// A property's condition.
type Condition = fn(&SharedModel, &State) -> bool;

/// The kinds of the holds believed now (an upgrade's write hold is a write hold, a
/// downgrade's read hold a read hold).
fn believed(s: &State) -> impl Iterator<Item = Want> + '_ {
    s.procs
        .iter()
        .filter(|p| p.believes(s.now))
        .filter_map(|p| p.hold().map(|h| h.kind))
}

fn excluded(cfg: &SharedConfig, s: &State) -> bool {
    let all = believed(s).count();
    let writers = believed(s).filter(|&w| w == Want::Write).count();
    let permits = believed(s).filter(|&w| w == Want::Permit).count();
    let upgradable = believed(s).filter(|&w| w == Want::Upgradable).count();
    (writers == 0 || all == 1) && permits <= usize::from(cfg.permits) && upgradable <= 1
}

/// Whether a semaphore has a permit free in Redis (fewer live holds than permits) while
/// a permit-seeker waits, and nobody is paused (a paused waiter's wait, or a paused
/// holder's renewals, are the adversary's).
pub fn unclaimed(cfg: &SharedConfig, s: &State) -> bool {
    let held = s.redis.holds.iter().filter(|e| e.exp > s.now).count();
    held < usize::from(cfg.permits)
        && s.procs.iter().all(|p| !p.pid.paused)
        && s.procs.iter().any(|p| p.want == Want::Permit && p.waits())
}

/// Whether what the stalled request that landed left holds, is granted or marks a
/// waiting writer (or permit-seeker) now, while no process uses that member and no
/// request on its way gives it back: an attempt's member, held, or its mark among the
/// writers (a writer's, a permit-seeker's) while that mark lasts; an upgrade's write
/// hold, or the waiting upgrade's mark it made. A release of what a late upgrade left
/// that was dropped excuses it (see the module docs).
pub fn orphaned(cfg: &SharedConfig, s: &State) -> bool {
    let Some(landed) = s.history.landed.filter(|_| !s.history.release_dropped) else {
        return false;
    };
    let m = landed.member;
    let held = if landed.upgrade {
        m.turned(Want::Write)
    } else {
        m
    };
    let live = |set: &[Entry], x: Member| set.iter().any(|e| e.member == x && e.exp > s.now);
    let unused = |x: Member| {
        s.procs.iter().all(|p| !p.uses(x))
            && !s.net.requests.iter().any(|r| gives_back(cfg, r.op, x))
    };
    let marked = landed.marked && live(&s.redis.writers, m);
    (live(&s.redis.holds, held) && unused(held)) || (marked && unused(m))
}

/// Whether `op`, a request on its way, gives back `m`'s hold or mark: a release of it (or
/// of the upgradable read a late upgrade turned into it, `SHARED_RELEASE`), a leave, an
/// upgrade's unmark.
fn gives_back(cfg: &SharedConfig, op: Op, m: Member) -> bool {
    match op {
        Op::Release { m: x } => {
            x == m
                || (cfg.rules.release_gives_back_turned
                    && x.want == Want::Upgradable
                    && m == x.turned(Want::Write))
        }
        Op::Leave { m: x } | Op::Unmark { m: x } => x == m,
        _ => false,
    }
}

/// Whether a guard holds its upgradable read while a late upgrade of it turned it into
/// the write hold of its token.
fn turned_late(s: &State) -> bool {
    let Some(l) = s.history.landed.filter(|l| l.upgrade) else {
        return false;
    };
    let w = l.member.turned(Want::Write);
    s.redis.holds.iter().any(|e| e.member == w)
        && s.procs
            .iter()
            .any(|p| p.uses(l.member) && p.hold().is_some_and(|h| h.kind == Want::Upgradable))
}

/// Whether a process of kind `want` believes a hold taken from a grant message alone.
fn trusted(s: &State, want: Want) -> bool {
    s.procs
        .iter()
        .any(|p| p.want == want && p.believes(s.now) && p.hold().is_some_and(|h| h.trusted))
}

pub fn properties(cfg: &SharedConfig) -> Vec<Property<SharedModel>> {
    let mut props = vec![
        Property::always(EXCLUSION, |m: &SharedModel, s: &State| excluded(&m.cfg, s)),
        Property::always("write fences increase", |_, s: &State| {
            !s.history.fence_regressed
        }),
    ];
    if cfg.stalls > 0 {
        props.push(Property::always(ORPHAN, |_, s: &State| !s.history.orphaned));
    }
    if cfg.wants.contains(&Want::Permit) {
        props.push(Property::always(UNCLAIMED, |m: &SharedModel, s: &State| {
            s.history.unclaimed <= m.cfg.starve_bound
        }));
    }
    if cfg.grants != Grants::Trusted {
        return props;
    }
    // Conditions are plain functions (no captures): one per kind.
    let kinds: [(Want, &'static str, Condition); 3] = [
        (Want::Read, "a read hold taken from its grant", |_, s| {
            trusted(s, Want::Read)
        }),
        (Want::Write, "a write hold taken from its grant", |_, s| {
            trusted(s, Want::Write)
        }),
        (Want::Permit, "a permit taken from its grant", |_, s| {
            trusted(s, Want::Permit)
        }),
    ];
    for (want, name, condition) in kinds {
        if cfg.wants.contains(&want) {
            props.push(Property::sometimes(name, condition));
        }
    }
    if cfg.wants.contains(&Want::Upgradable) {
        props.push(Property::sometimes("an upgrade made", |_, s: &State| {
            s.procs.iter().any(|p| {
                p.want == Want::Upgradable
                    && p.believes(s.now)
                    && p.hold().is_some_and(|h| h.kind == Want::Write)
            })
        }));
    }
    if cfg.downgrades {
        props.push(Property::sometimes("a downgrade made", |_, s: &State| {
            s.procs.iter().any(|p| {
                p.want == Want::Write
                    && p.believes(s.now)
                    && p.hold().is_some_and(|h| h.kind == Want::Read)
            })
        }));
    }
    if cfg.acquire_retries > 0 && !cfg.reuse_given_back_member {
        props.push(Property::sometimes(
            "a hold won after a late win was given back",
            |_, s: &State| s.procs.iter().any(|p| p.believes(s.now) && p.token > 0),
        ));
    }
    if cfg.turns > 0 {
        props.push(Property::sometimes("a local turn taken", |_, s: &State| {
            s.procs
                .iter()
                .any(|p| p.believes(s.now) && p.hold().is_some_and(|h| h.turned))
        }));
    }
    props.push(Property::sometimes("holds shared", |_, s: &State| {
        believed(s).count() >= 2
    }));
    if cfg.stalls > 0 {
        props.push(Property::sometimes(
            "a late attempt holds for nobody",
            |m: &SharedModel, s: &State| orphaned(&m.cfg, s),
        ));
        props.push(Property::sometimes(
            "a late attempt's hold for nobody given back",
            |_, s: &State| s.history.given_back,
        ));
    }
    if cfg.stalls > 0 && cfg.stall_upgrades {
        props.push(Property::sometimes(
            "a late upgrade turns a guard's upgradable read",
            |_, s: &State| turned_late(s),
        ));
    }
    props
}
