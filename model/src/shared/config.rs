//! The bounds of a shared-hold check, and the variant checked.
//!
//! Durations are whole ticks, as in the lock model (`crate::config`): only their order
//! matters (timeout < lease, grant lease ≤ lease, re-check < a mark's TTL).

use crate::config::Grants;

/// What each process waits for: one read-write lock's read or write hold, or one permit
/// of a semaphore. A check mixes reads and writes, or uses permits alone (one name has
/// one kind at a time).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Want {
    Read,
    Write,
    Permit,
    /// The upgradable read (`u…`): a read that excludes writers and other upgradable
    /// reads, which its holder may upgrade (`try_upgrade`) to the write hold.
    Upgradable,
}

/// What to check.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct SharedConfig {
    /// One process per entry, each taking one hold of that kind once.
    pub wants: Vec<Want>,
    /// Further threads of each reading or writing process that take turns on its hold
    /// (`local::shares`): when the thread holding lets go, the next one takes the hold
    /// over with no request, unless it is known lost or its validity ran out; then it
    /// would ask Redis with a token of its own, as another process does (left out).
    /// Upgradable reads and permits are a thread's own, never shared. `RW_KEEP` (does
    /// another process wait?) is left out, on the side of more behaviour: a turn never
    /// ends for a waiter elsewhere. Its passing over of permit-seekers' marks concerns
    /// no check: a name has one kind, so no read-write check has such a mark.
    pub turns: u8,
    /// A semaphore's permits (with `Want::Permit`).
    pub permits: u8,
    /// The lease of a hold won by an attempt, and of every renewal.
    pub lease: u8,
    /// The lease of a grant, until the grantee's first renewal or confirming attempt.
    pub grant_lease: u8,
    /// The clock-drift margin taken off every validity (0 is enough: clocks are exact).
    pub drift: u8,
    /// A request unanswered this long is given up (the read timeout).
    pub timeout: u8,
    /// The longest a request or a message to a running process stays in flight.
    pub max_delay: u8,
    /// A waiter's longest sleep between attempts; its waiting mark lives twice that.
    pub recheck: u8,
    /// The watchdog retries a renewal whose outcome is unknown this much later.
    pub renew_retry: u8,
    /// How many times an attempt whose reply did not come by the read timeout is sent
    /// again, with the same member and nonce, before the wait fails (the node's
    /// `Retry::LOST_REPLY`). A hold it wins counts from its first send; a win whose reply
    /// comes after that lease ran out (`Vote::Late`) is given back (`SHARED_RELEASE` of
    /// the member, awaited, which may itself run late), and the wait goes on. 0 (a lost
    /// reply fails the wait) in every configuration but `resends()`, to keep their state
    /// counts; the library's node sends twice more.
    pub acquire_retries: u8,
    /// Broken: after a late win was given back, the wait's next attempts use the same
    /// member (the library before `Contest::retire_token`); a give-back that runs late
    /// then deletes the hold such an attempt won, under its holder. The library's rule:
    /// a new member, as a new waiter's (a new mark, at the back).
    pub reuse_given_back_member: bool,
    /// The last tick.
    pub horizon: u8,
    /// Pauses the adversary may begin.
    pub pauses: u8,
    /// Faults the adversary may cause: a request, reply or message lost or duplicated,
    /// a request run after its sender gave up.
    pub faults: u8,
    /// Liveness of a semaphore: the most ticks in a row a permit may be left free while
    /// a permit-seeker waits and nobody is paused, counted from the last fault.
    pub starve_bound: u8,
    /// What a waiter makes of a grant message to its member.
    pub grants: Grants,
    /// Broken: `SHARED_EXTEND` renews a hold that has expired but is still in the set
    /// (the script refuses it: an expired hold is never revived).
    pub renewal_revives: bool,
    /// Broken: an upgrade that goes unanswered leaves the upgradable read's guard as it
    /// was, while the write hold the upgrade may have made is given back (the library
    /// before the guard was marked lost, `LostReason::Converted`).
    pub upgrade_keeps_guard: bool,
    /// Upgrades wait (`upgrade`: marked as a waiting writer, woken by the release of the
    /// last other hold) rather than try once (`try_upgrade`).
    pub upgrade_waits: bool,
    /// Writers may downgrade their write hold to a read hold.
    pub downgrades: bool,
    /// Broken: a downgrade that goes unanswered gives its write hold to the next local
    /// turn as it was, while the read hold the downgrade may have made is given back (the
    /// library before the write hold was marked lost, `LostReason::Converted`).
    pub downgrade_keeps_turns: bool,
}

impl SharedConfig {
    /// The read-write configuration `cargo test` checks: a reader, a writer and a second
    /// reader, so that a write grant follows read holds and read grants follow a write
    /// hold, with every kind of fault (about 1.9 million states).
    pub fn rw() -> SharedConfig {
        SharedConfig {
            wants: vec![Want::Read, Want::Write, Want::Read],
            turns: 0,
            permits: 0,
            lease: 3,
            grant_lease: 2,
            drift: 0,
            timeout: 1,
            max_delay: 1,
            recheck: 2,
            renew_retry: 1,
            acquire_retries: 0,
            reuse_given_back_member: false,
            horizon: 6,
            pauses: 1,
            faults: 2,
            starve_bound: 2,
            grants: Grants::Trusted,
            renewal_revives: false,
            upgrade_keeps_guard: false,
            upgrade_waits: false,
            downgrades: false,
            downgrade_keeps_turns: false,
        }
    }

    /// An upgradable reader that may upgrade (`try_upgrade`), a writer and a reader.
    pub fn upgrade() -> SharedConfig {
        SharedConfig {
            wants: vec![Want::Upgradable, Want::Write, Want::Read],
            horizon: 5,
            ..SharedConfig::rw()
        }
    }

    /// A writer that may downgrade, a reader and a second writer.
    pub fn downgrade() -> SharedConfig {
        SharedConfig {
            wants: vec![Want::Write, Want::Read, Want::Write],
            downgrades: true,
            horizon: 5,
            ..SharedConfig::rw()
        }
    }

    /// A writer that may downgrade, a reader and a second writer, each with a second
    /// thread that takes a turn on its process's hold.
    pub fn turns() -> SharedConfig {
        SharedConfig {
            turns: 1,
            ..SharedConfig::downgrade()
        }
    }

    /// The same with upgrades that wait (`upgrade`).
    pub fn upgrade_waiting() -> SharedConfig {
        SharedConfig {
            upgrade_waits: true,
            ..SharedConfig::upgrade()
        }
    }

    /// Replies as slow as two ticks (read timeout and longest delay), the lease a tick
    /// longer: a renewal can run after its hold expired and still be answered in time.
    pub fn slow_replies() -> SharedConfig {
        SharedConfig {
            lease: 4,
            timeout: 2,
            max_delay: 2,
            ..SharedConfig::rw()
        }
    }

    /// An attempt whose reply is lost is sent again once (`acquire_retries`): a reader
    /// and a writer, horizon 7 (about 150,000 states). A pause between an attempt and its
    /// resend makes a late win, given back while the wait goes on.
    pub fn resends() -> SharedConfig {
        SharedConfig {
            wants: vec![Want::Read, Want::Write],
            acquire_retries: 1,
            horizon: 7,
            ..SharedConfig::rw()
        }
    }

    /// The same for two permit-seekers and one permit.
    pub fn resends_of_permits() -> SharedConfig {
        SharedConfig {
            wants: vec![Want::Permit; 2],
            permits: 1,
            ..SharedConfig::resends()
        }
    }

    /// The semaphore configuration `cargo test` checks: three permit-seekers, two
    /// permits.
    pub fn semaphore() -> SharedConfig {
        SharedConfig {
            wants: vec![Want::Permit; 3],
            permits: 2,
            ..SharedConfig::rw()
        }
    }

    /// Three permit-seekers, one permit, a tick less: where a permit believed too long
    /// is an overlap (with two permits, the bounds reach no third holder).
    pub fn semaphore_of_one() -> SharedConfig {
        SharedConfig {
            permits: 1,
            horizon: 5,
            ..SharedConfig::semaphore()
        }
    }

    /// The longer checks: two readers and two writers, four permit-seekers for two
    /// permits (16 and 37 million states), and the upgrade, downgrade and local-turn
    /// configurations two ticks longer.
    pub fn deep() -> [SharedConfig; 6] {
        let rw = SharedConfig {
            wants: vec![Want::Read, Want::Write, Want::Read, Want::Write],
            horizon: 5,
            ..SharedConfig::rw()
        };
        let semaphore = SharedConfig {
            wants: vec![Want::Permit; 4],
            horizon: 5,
            ..SharedConfig::semaphore()
        };
        let longer = |cfg: SharedConfig| SharedConfig { horizon: 7, ..cfg };
        [
            rw,
            semaphore,
            longer(SharedConfig::upgrade()),
            longer(SharedConfig::upgrade_waiting()),
            longer(SharedConfig::downgrade()),
            longer(SharedConfig::turns()),
        ]
    }

    /// The same bounds, grant messages taken as `grants` says.
    pub fn with_grants(self, grants: Grants) -> SharedConfig {
        SharedConfig { grants, ..self }
    }

    /// Until when a hold of `lease` counted from `from` is surely held.
    pub fn valid_until(&self, from: u8, lease: u8) -> u8 {
        (from + lease).saturating_sub(self.drift)
    }

    /// A hold given the full lease by a request sent at `sent` (an attempt, a renewal, a
    /// conversion): until when it is surely held, and when it is renewed next.
    pub fn lease_from(&self, sent: u8) -> (u8, u8) {
        (
            self.valid_until(sent, self.lease),
            sent + self.renew_every(),
        )
    }

    /// When a waiter told `hint` ticks to the obstacle's end tries again: at once if a
    /// message came meanwhile (`heard`), else at that end or the re-check.
    pub fn wake(&self, now: u8, hint: u8, heard: bool) -> u8 {
        if heard {
            now
        } else {
            now + hint.min(self.recheck)
        }
    }

    /// How often the watchdog renews: a third of the lease, at least one tick.
    pub fn renew_every(&self) -> u8 {
        self.lease.div_ceil(3).max(1)
    }

    /// The first renewal of a hold taken from a grant, surely held `left` more ticks: a
    /// quarter of the way (the library's `Config::first_renewal`).
    pub fn first_renewal(&self, left: u8) -> u8 {
        left / 4
    }

    /// How long a waiting mark lives unrenewed.
    pub fn mark_ttl(&self) -> u8 {
        self.recheck * 2
    }

    /// Whether the durations are in the order the library's builder keeps them in.
    pub fn is_sound(&self) -> bool {
        !self.wants.is_empty()
            && self.lease > self.timeout + self.drift
            && (1..=self.lease).contains(&self.grant_lease)
            && self.timeout >= 1
            && self.max_delay >= 1
            && self.recheck >= 1
            && self.renew_retry >= 1
            && (self.permits >= 1) == self.wants.contains(&Want::Permit)
            && !(self.wants.contains(&Want::Permit)
                && self.wants.iter().any(|&w| w != Want::Permit))
    }
}
