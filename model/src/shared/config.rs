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

/// The cleanup's rules for a member whose first send may land after its retry (see
/// `SharedConfig::stalls`), each of which a variant may leave out to show that the
/// checker finds what it prevents.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SharedRules {
    /// The release of a hold won by a retry after a lost reply, or won while a retry of its
    /// member was answered `held` (`RemoteLock::resent`, `Contest::settled_by`), is
    /// followed by the cleanup's give-back of its member, looked at again while it lives
    /// (`Engine::look_again_if_resent`); so is the give-back of a late win won so.
    /// Without it the first send, landing after the release, takes the hold (or marks
    /// its member waiting, and is granted later) for nobody.
    pub look_again_after_release: bool,
    /// `SHARED_RELEASE` of an upgradable read `u<tok>` that is gone gives back the write
    /// hold `w<tok>` a late upgrade of it made. Without it an upgrade whose first send
    /// landed after the upgrade gave up (the guard keeping its upgradable read) leaves a
    /// write hold nobody uses once the guard lets go.
    pub release_gives_back_turned: bool,
    /// The release of a hold turned from one won by a retry (an upgradable read upgraded,
    /// a write hold downgraded) is followed by the cleanup's give-back of the member the
    /// turn retired (`RemoteLock::turned_from`, `Engine::look_again_at_turned`). Without
    /// it the first send of the original attempt, landing after that release, takes the
    /// retired member's hold for nobody.
    pub look_again_at_turned: bool,
    /// A member left unsettled (a retry of it answered `held`) whose next call will not
    /// come is handed to the cleanup, which gives it back and looks again: the wait ends
    /// (its leave is made, `Contest::leave`), the call does not wait and left nothing
    /// (`give_back_unsettled`), or a late win retires the member (`settle_token`).
    /// Without it the first send, landing after the wait ended, holds (or marks its
    /// member waiting) for nobody.
    pub unsettled_handed_on: bool,
    /// `SHARED_RELEASE` of an upgradable read also takes out the waiting-writer mark of
    /// its member (and the readers it held back hear of it). Without it (the library
    /// before, which this model found), an upgrade's first send that lands after the
    /// upgrade's wait ended (its mark taken out) while another hold remains marks the
    /// upgradable read waiting again, and the guard's release leaves that mark, holding
    /// new readers back for nobody until it expires or the last other hold ends.
    pub release_takes_upgrade_mark: bool,
}

impl SharedRules {
    /// The rules as the library implements them.
    pub const FIXED: SharedRules = SharedRules {
        look_again_after_release: true,
        release_gives_back_turned: true,
        look_again_at_turned: true,
        unsettled_handed_on: true,
        release_takes_upgrade_mark: true,
    };
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
    /// The deadline of every wait, a tick (`try_read_for` and the like; all waits begin at
    /// 0): an attempt sent before it marks its member waiting when it fails, one sent
    /// from then on does not, and once an attempt fails at or after it (or a late win
    /// is given back), the wait ends (`Next::Over`; at 0, a call that does not wait,
    /// `Next::Stop`). `None`: a wait ends only with the hold, or when an attempt's
    /// resends go unanswered.
    pub deadline: Option<u8>,
    /// The last tick.
    pub horizon: u8,
    /// Pauses the adversary may begin.
    pub pauses: u8,
    /// Faults the adversary may cause: a request, reply or message lost or duplicated,
    /// a request run after its sender gave up, a request stalled.
    pub faults: u8,
    /// How many first sends of an acquisition attempt the adversary may stall (each a
    /// fault): held back on the way, one lands at any tick past `max_delay`, up to `stall`
    /// ticks after it was sent, after its retry on a fresh connection overtook it (it
    /// needs `acquire_retries`). 0 but in the `stalls…` configurations.
    pub stalls: u8,
    /// The latest a stalled request lands, in ticks after it was sent.
    pub stall: u8,
    /// The first send of an upgrade attempt (`RW_UPGRADE`) may be stalled too.
    pub stall_upgrades: bool,
    /// The cleanup's rules for what a stalled send may leave.
    pub rules: SharedRules,
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
    /// hold, with every kind of fault (about 1.4 million states).
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
            deadline: None,
            horizon: 6,
            pauses: 1,
            faults: 2,
            stalls: 0,
            stall: 2,
            stall_upgrades: false,
            rules: SharedRules::FIXED,
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

    /// `resends()` with the first send of an attempt stalled (one in all, a fault): it
    /// lands up to two ticks after it was sent, after its retry won and the hold was
    /// released, or after the retry was answered `held`.
    pub fn stalls() -> SharedConfig {
        SharedConfig {
            stalls: 1,
            ..SharedConfig::resends()
        }
    }

    /// The same for two permit-seekers and one permit.
    pub fn stalls_of_permits() -> SharedConfig {
        SharedConfig {
            stalls: 1,
            ..SharedConfig::resends_of_permits()
        }
    }

    /// `rw()` (a reader, a writer and a second reader) with one resend of an unanswered
    /// attempt and a stalled first send, a tick less (about 3.8 million states): a late
    /// send marks a writer waiting, is granted a hold, or takes one, beside other holds.
    pub fn stalled_rw() -> SharedConfig {
        SharedConfig {
            acquire_retries: 1,
            stalls: 1,
            horizon: 5,
            ..SharedConfig::rw()
        }
    }

    /// A writer that may downgrade and a reader, with resends and a stalled first send:
    /// the first send of the write attempt lands after the hold its retry won was turned
    /// into a read hold.
    pub fn stalled_downgrades() -> SharedConfig {
        SharedConfig {
            wants: vec![Want::Write, Want::Read],
            downgrades: true,
            horizon: 6,
            ..SharedConfig::stalls()
        }
    }

    /// An upgradable reader that may upgrade (`try_upgrade`) and a reader, with resends;
    /// the first send of an attempt or of an upgrade stalled, up to three ticks: an
    /// upgradable read's first send lands after the write hold its retry's hold was
    /// upgraded to was released (a tick after the upgrade, itself a tick after the win),
    /// and an upgrade's first send after its retry, refused, ended the upgrade.
    pub fn stalled_upgrades() -> SharedConfig {
        SharedConfig {
            wants: vec![Want::Upgradable, Want::Read],
            stall: 3,
            stall_upgrades: true,
            horizon: 6,
            ..SharedConfig::stalls()
        }
    }

    /// `stalls()` with waits that end at tick 2: the retry of a stalled first send,
    /// answered `held`, leaves its member unsettled when the wait ends, and the first
    /// send lands after the leave.
    pub fn stalled_deadlines() -> SharedConfig {
        SharedConfig {
            deadline: Some(2),
            ..SharedConfig::stalls()
        }
    }

    /// `stalls_of_permits()` with calls that do not wait (`try_acquire`): a retry answered
    /// `held` ends the call, which left no mark, and hands its member to the cleanup.
    pub fn stalled_tries_of_permits() -> SharedConfig {
        SharedConfig {
            deadline: Some(0),
            ..SharedConfig::stalls_of_permits()
        }
    }

    /// `stalled_upgrades()` with upgrades that wait, until tick 3 (`try_upgrade_for`): an
    /// upgrade's first send may land after its wait ended (its mark taken out) while
    /// another reader holds, and mark the upgradable read waiting again.
    pub fn stalled_waiting_upgrades() -> SharedConfig {
        SharedConfig {
            upgrade_waits: true,
            deadline: Some(3),
            horizon: 5,
            ..SharedConfig::stalled_upgrades()
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

    /// `semaphore()` (three permit-seekers, two permits) with one resend of an
    /// unanswered attempt and a stalled first send, a tick less: a late send takes the
    /// second permit, or marks a seeker waiting, while both permits are free or one is
    /// held.
    pub fn stalled_semaphore() -> SharedConfig {
        SharedConfig {
            acquire_retries: 1,
            stalls: 1,
            horizon: 5,
            ..SharedConfig::semaphore()
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
    /// permits (7 and 17 million states), and the upgrade, downgrade and local-turn
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

    /// No look again after the release of a hold won by a retry (nor after the give-back
    /// of a late win won so): a late first send holds for nobody.
    pub fn without_look_again(self) -> SharedConfig {
        self.with_rules(SharedRules {
            look_again_after_release: false,
            ..SharedRules::FIXED
        })
    }

    /// `SHARED_RELEASE` of an upgradable read leaves the write hold a late upgrade turned
    /// it into.
    pub fn without_turned_give_back(self) -> SharedConfig {
        self.with_rules(SharedRules {
            release_gives_back_turned: false,
            ..SharedRules::FIXED
        })
    }

    /// No look again at the member a turn retired, after the release of the turned hold.
    pub fn without_look_again_at_turned(self) -> SharedConfig {
        self.with_rules(SharedRules {
            look_again_at_turned: false,
            ..SharedRules::FIXED
        })
    }

    /// No give-back of a member left unsettled when its next call will not come.
    pub fn without_unsettled_handed_on(self) -> SharedConfig {
        self.with_rules(SharedRules {
            unsettled_handed_on: false,
            ..SharedRules::FIXED
        })
    }

    /// Without `SharedRules::release_takes_upgrade_mark` (the library before).
    pub fn without_upgrade_mark_released(self) -> SharedConfig {
        self.with_rules(SharedRules {
            release_takes_upgrade_mark: false,
            ..SharedRules::FIXED
        })
    }

    /// The same bounds with other rules.
    pub fn with_rules(self, rules: SharedRules) -> SharedConfig {
        SharedConfig { rules, ..self }
    }

    /// The longer checks of stalled first sends (2 to 6 million states each): `stalled_rw()`
    /// a tick longer; three permit-seekers for one permit; the downgrade and local-turn
    /// configurations (`downgrade()`, `turns()`), and an upgradable reader beside a writer
    /// and a reader (`upgrade()`, attempts and upgrades stalled up to three ticks), at
    /// horizon 5; and `stalled_semaphore()` (three permit-seekers, two permits) a tick
    /// longer.
    pub fn deep_stalls() -> [SharedConfig; 6] {
        let stalled = |cfg: SharedConfig| SharedConfig {
            acquire_retries: 1,
            stalls: 1,
            horizon: 5,
            ..cfg
        };
        [
            SharedConfig {
                horizon: 6,
                ..SharedConfig::stalled_rw()
            },
            stalled(SharedConfig::semaphore_of_one()),
            stalled(SharedConfig::downgrade()),
            stalled(SharedConfig::turns()),
            SharedConfig {
                stall: 3,
                stall_upgrades: true,
                ..stalled(SharedConfig::upgrade())
            },
            SharedConfig {
                horizon: 6,
                ..SharedConfig::stalled_semaphore()
            },
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

    /// Whether a wait goes on at `now` (its deadline has not come): an attempt sent then
    /// marks its member waiting if it fails (`Wait::waits_now`).
    pub fn waits_at(&self, now: u8) -> bool {
        self.deadline.is_none_or(|d| now < d)
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
