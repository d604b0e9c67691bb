//! The bounds of a check and the protocol variant checked.
//!
//! Every duration is a whole number of ticks: a tick is the smallest time step the
//! adversary can take. The library's durations map to ticks only in their order
//! (timeout < lease, grant lease < lease, re-check < entry TTL): what the model proves
//! holds for any durations in that order, as far as the bounds reach.

/// Which scripts acquire and release.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mode {
    /// `proto::fair_scripts::{FAIR_ACQUIRE, FAIR_RELEASE, FAIR_LEAVE}`: the queue and the
    /// grant.
    Fair,
    /// `proto::scripts::{ACQUIRE, RELEASE}`: first come, first served.
    Plain,
}

/// The parts of the protocol that a variant may leave out, to show that the checker
/// finds what each one prevents.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Rules {
    /// A lease change (renewal or `extend`) whose reply is lost leaves the holder's
    /// validity at `min(old, sent_at + new lease − drift)`. Without it, the old validity
    /// stays (the library before the fix).
    pub min_on_unknown: bool,
    /// Redis applies a lease change only if its sequence number is not below the hold's
    /// last applied one (see `redis::Key::seq`). Without it every change that finds the
    /// token applies, in whatever order the changes arrive.
    pub ordered_changes: bool,
    /// An acquisition's refresh of its own token (a retry after a lost reply, a first
    /// send landing after its retry, the confirmation of a grant) only lengthens the
    /// lease (`PTTL < lease`). Without it the refresh sets the lease whatever it was,
    /// and may cut short a longer one an extend set.
    pub refresh_lengthens: bool,
    /// What a waiter makes of a grant message to its token.
    pub grants: Grants,
    /// A grant that follows a hold which ended without a release carries nonce 0, so
    /// that its grantee never trusts it: the attempt that confirms it reads the counter,
    /// and its reply tells of the loss. Without it the grant carries its entry's nonce,
    /// and a grantee that takes it as the lock is told nothing was lost.
    pub confirm_after_loss: bool,
    /// An attempt given back unused (the cleanup after a lost reply, a waiter leaving
    /// with a grant) leaves the counter saying what the hold before it said: a loss stays
    /// news for the next holder. Without it every give-back ends the hold as a release
    /// does, hiding a loss before it.
    pub transparent_give_back: bool,
    /// A won attempt with no validity left by its reply (`Round::Late`: a pause or
    /// resends outlasted the lease counted from the first send) is given back with its
    /// token (`Contest::undo`, a release with no fence, waited for), and the next attempt
    /// goes at once. Without it the late win is left for the next attempt, which finds
    /// its token and confirms the hold, as the queue's `next_call_settles_unknown` does
    /// for an unknown outcome (`Config::keeping_late_wins`: an alternative that holds
    /// too).
    pub late_give_back: bool,
    /// A token whose hold was given back is never used again by its wait
    /// (`Contest::retire_token`): the following attempts use a new one (fair queue: a
    /// new entry, at the back), and a grant to the old one is not the waiter's. Without
    /// it the fair queue's next attempt reuses the token given back (the library before
    /// the fix), and a give-back that runs late deletes or passes on the hold that attempt
    /// won, under its holder.
    pub retire_given_back_token: bool,
    /// A hold won by a retry after a lost reply (or, fair, won while an earlier attempt
    /// of its token is unsettled: a retry of it answered `held`) is looked at again once
    /// released, or given back as a late win: the cleanup gives its token back
    /// (`RemoteLock::resent`, a job). Without
    /// it the first send, stalled on its way, lands after the release and takes the free
    /// lock with a token nobody holds, for a whole lease.
    pub look_again_after_release: bool,
    /// Fair: that give-back, and its looks again, are a leave (`Cleanup::give_back_later`),
    /// which takes the token's queue entry out as well as a hold. Without it (a release,
    /// the library before), a first send that lands while the key is held queues the
    /// token, and a later release grants the lock to that entry, to nobody.
    pub look_again_leaves: bool,
}

/// What a waiter makes of a grant message to its token (`g<token>:<nonce>:<fence>:<ms>`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Grants {
    /// The library: a grant carrying the nonce of the waiter's latest attempt is the
    /// lock, valid until that attempt's `sent + grant lease − drift` (the grant ran after
    /// the attempt, so after it was sent), with the first renewal sent at once; any other
    /// grant, or one whose bound has passed, only wakes the waiter, whose next attempt
    /// confirms.
    Trusted,
    /// Every grant only wakes its waiter, whose next attempt confirms the lock.
    Confirmed,
    /// Broken: the waiter owns the lock on reading the message, valid for the grant lease
    /// from then (the library before grants were confirmed).
    FromHearing,
    /// Broken: a grant carrying any nonce of the token is taken, bounded by the latest
    /// attempt's send.
    AnyNonce,
}

impl Rules {
    /// The protocol as the library implements it.
    pub const FIXED: Rules = Rules {
        min_on_unknown: true,
        ordered_changes: true,
        refresh_lengthens: true,
        grants: Grants::Trusted,
        confirm_after_loss: true,
        transparent_give_back: true,
        late_give_back: true,
        retire_given_back_token: true,
        look_again_after_release: true,
        look_again_leaves: true,
    };
}

/// What to check: the system's size, its durations, the adversary's budget and the
/// protocol variant.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Config {
    pub mode: Mode,
    /// Client processes; each has one remote token at a time, shared by its threads.
    pub procs: u8,
    /// Threads per process.
    pub threads: u8,
    /// How many times each thread takes the lock.
    pub locks_per_thread: u8,
    /// Whether threads call `lock()` at any time. Without, every thread calls it at the
    /// start and again as soon as it unlocks or its `lock()` fails, while it has locks
    /// left: the contention is the same, with far fewer interleavings.
    pub free_arrivals: bool,
    /// The lease of an acquisition (`Builder::lease`).
    pub lease: u8,
    /// The lease of a grant, until the grantee's first renewal (or confirmation) sets
    /// the full lease.
    pub grant_lease: u8,
    /// The leases a holder may pass to `extend` (at most once per hold).
    pub extends: Vec<u8>,
    /// The clock-drift margin taken off every validity. Clocks are exact in the model,
    /// so 0 is enough for safety; a larger margin only shortens validity.
    pub drift: u8,
    /// A client gives a request up this long after sending it (the read timeout).
    pub timeout: u8,
    /// How many times an acquisition attempt whose reply did not come by the timeout is
    /// sent again, with the same token and nonce, before `lock()` fails
    /// (`Retry::LOST_REPLY` of one node: 2). Its validity, and the bound of a grant that
    /// follows it, still count from its first send. The CI bounds send once more: with
    /// two faults, a `lock()` that fails (and leaves the queue) is then still reachable.
    pub acquire_retries: u8,
    /// The longest the adversary keeps a request in flight before it must run or drop
    /// it, and a message to a running process before it must deliver or drop it. From
    /// `timeout` on, a request can run after its sender gave up.
    pub max_delay: u8,
    /// A waiter's longest sleep between attempts (`Builder::recheck_interval`); its
    /// queue entry lives twice that.
    pub recheck: u8,
    /// The watchdog tries a renewal again this long after one whose outcome is unknown.
    pub renew_retry: u8,
    /// The last tick: time advances no further.
    pub horizon: u8,
    /// How many times the adversary may pause a process.
    pub pauses: u8,
    /// How many faults the adversary may cause in all: a request, reply or message
    /// lost, a request run after its sender gave up, a request stalled.
    pub faults: u8,
    /// How many acquisition attempts the adversary may stall (each a fault): held back
    /// on the way, one lands at any tick past `max_delay`, up to `stall` ticks after it
    /// was sent, after its retry on a fresh connection overtook it.
    pub stalls: u8,
    /// The latest a stalled request lands, in ticks after it was sent. The cleanup looks
    /// again at a give-back for a lease after it was queued: an attempt later than that
    /// is beyond the library's reach, and the model's. The CI bounds land it up to two
    /// ticks after its send, a tick later than any other request can run: after its retry
    /// won (a tick after the send) and the hold was released (the tick after), or after
    /// the wait gave up. Three ticks hold too, with a fifth more states.
    pub stall: u8,
    /// Liveness: the longest a thread may wait while the lock is free, nobody else is
    /// queued and nobody is paused, counted from the last fault.
    pub starve_bound: u8,
    pub rules: Rules,
}

impl Config {
    /// The configuration that `cargo test` checks: 2 processes × 2 threads, each thread
    /// locking once, the fair queue, every fault.
    pub fn ci() -> Config {
        Config {
            mode: Mode::Fair,
            procs: 2,
            threads: 2,
            locks_per_thread: 1,
            free_arrivals: false,
            lease: 3,
            grant_lease: 2,
            extends: vec![1, 4],
            drift: 0,
            timeout: 1,
            acquire_retries: 1,
            max_delay: 1,
            recheck: 2,
            renew_retry: 1,
            horizon: 5,
            pauses: 1,
            faults: 2,
            stalls: 1,
            stall: 2,
            starve_bound: 2,
            rules: Rules::FIXED,
        }
    }

    /// The longer check: two more ticks (40 million states, about 210 s and 7.5 GB on two
    /// threads; each tick more than doubles the states).
    pub fn deep() -> Config {
        Config {
            horizon: 7,
            ..Config::ci()
        }
    }

    /// The same bounds with the plain scripts (no queue).
    pub fn plain(self) -> Config {
        Config {
            mode: Mode::Plain,
            ..self
        }
    }

    /// The library before the lease-change fix: a lost `extend` reply keeps the old
    /// validity, and lease changes are not ordered.
    pub fn without_extend_fix(self) -> Config {
        self.with_rules(Rules {
            min_on_unknown: false,
            ordered_changes: false,
            refresh_lengthens: false,
            ..Rules::FIXED
        })
    }

    /// A late win left for the next attempt to confirm (with the same token), instead of
    /// given back with its token retired: the alternative to the library's rule, which
    /// keeps the waiter's place in the queue.
    pub fn keeping_late_wins(self) -> Config {
        self.with_rules(Rules {
            late_give_back: false,
            ..Rules::FIXED
        })
    }

    /// No look again after the release of a hold won by a retry (the library before it
    /// was added): a late first send takes the lock for nobody.
    pub fn without_look_again(self) -> Config {
        self.with_rules(Rules {
            look_again_after_release: false,
            ..Rules::FIXED
        })
    }

    /// A look again that releases the hold of a token but leaves its queue entry (the
    /// library before the leave): a first send that lands queued is granted the lock later.
    pub fn looking_again_with_a_release(self) -> Config {
        self.with_rules(Rules {
            look_again_leaves: false,
            ..Rules::FIXED
        })
    }

    /// Grant messages taken as `grants` says.
    pub fn with_grants(self, grants: Grants) -> Config {
        self.with_rules(Rules {
            grants,
            ..Rules::FIXED
        })
    }

    /// The same bounds with other rules.
    pub fn with_rules(self, rules: Rules) -> Config {
        Config { rules, ..self }
    }

    /// How often the watchdog renews a lease: a third of it, at least one tick.
    pub fn renew_every(&self, lease: u8) -> u8 {
        lease.div_ceil(3).max(1)
    }

    /// When a lock taken from a grant message, surely held for `left` more ticks, is
    /// renewed first: after a quarter of it (the library's `Config::first_renewal`).
    pub fn first_renewal(&self, left: u8) -> u8 {
        left / 4
    }

    /// How long a queue entry lives without an attempt refreshing it.
    pub fn entry_ttl(&self) -> u8 {
        self.recheck * 2
    }

    /// Whether the durations are in the order the library's settings keep them in (the
    /// builder refuses the rest): an acquisition's reply, accepted before the timeout,
    /// always leaves validity.
    pub fn is_sound(&self) -> bool {
        self.procs >= 1
            && self.threads >= 1
            && self.lease > self.timeout + self.drift
            && self.grant_lease >= 1
            && self.grant_lease <= self.lease
            && self.timeout >= 1
            && self.max_delay >= 1
            && self.recheck >= 1
            && self.renew_retry >= 1
            && self.extends.iter().all(|&e| e >= 1)
    }
}
