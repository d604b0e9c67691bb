//! The contest: the one loop in which a process's contender takes a hold in Redis (the
//! exclusive lock, a read or write hold, a semaphore permit) on whatever topology, and
//! decides when it tries again. Everything that differs between holds is the route's
//! [`Protocol`]'s answer; everything that differs between layouts is the topology's.
//!
//! A contest may also turn a hold of ours into another ([`Start::Convert`]: an upgradable
//! read into the write hold): every attempt then uses that hold's member as its token, and
//! the hold's renewals wait while an attempt is in flight (see [`Paused`]).

use std::cell::{Cell, RefCell};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::clock::Stamp;
use crate::config::Config;
use crate::engine::cleanup::release_on;
use crate::engine::state::Engine;
use crate::engine::waiter::{Pending, Waiter};
use crate::engine::watchdog::{Expecting, Watchdog};
use crate::error::{Error, LostReason, Result};
use crate::fencing::MAX_FENCE;
use crate::local::held::{Acquisition, RemoteLock};
use crate::local::mailbox::Cancellation;
use crate::local::undo::OnUnwind;
use crate::proto::keys::Keys;
use crate::proto::node::{NodeId, may_have_run};
use crate::proto::protocol::{Attempt, Hears, Kind, Marks, Protocol, Request};
use crate::stats::Counters;
use crate::topology::Route;
use crate::topology::ride::Ride;
use crate::topology::verdict::{Undo, Vote, lease_left, vote};
use crate::wake::early::Shot;
use crate::wake::events::Grant;

/// The caller's wait policy: no wait, or a wait until the deadline (`None`: without one)
/// or until the caller cancels it, whichever comes first. A cancelled wait ends as one
/// whose deadline passed, with [`Error::Cancelled`] instead of [`Error::Timeout`].
#[derive(Clone, Copy)]
pub(crate) enum Wait<'a> {
    No,
    Until(Option<Instant>, Option<&'a Arc<Cancellation>>),
}

impl<'a> Wait<'a> {
    pub fn deadline(self) -> Option<Instant> {
        match self {
            Wait::No => None,
            Wait::Until(d, _) => d,
        }
    }

    /// The caller's cancellation, for a wait that has one.
    pub fn cancel(self) -> Option<&'a Arc<Cancellation>> {
        match self {
            Wait::No => None,
            Wait::Until(_, c) => c,
        }
    }

    /// Whether the wait must end by a deadline, or may not wait at all: then nothing on
    /// its way may wait for a server past it.
    pub fn bounded(self) -> bool {
        matches!(self, Wait::No | Wait::Until(Some(_), _))
    }

    /// Whether the caller cancelled the wait.
    pub fn cancelled(self) -> bool {
        self.cancel().is_some_and(|c| c.is_cancelled())
    }

    /// A waiter that hears what `hears` says, and whose sleeps end when the caller cancels
    /// this wait.
    pub fn waiter(self, hears: Hears) -> Waiter {
        let mut waiter = Waiter::hearing(hears);
        if let Some(cancel) = self.cancel() {
            waiter.cancel_with(cancel);
        }
        waiter
    }

    /// Whether the caller would wait now if the hold is taken.
    pub fn waits_now(self) -> bool {
        match self {
            Wait::No => false,
            Wait::Until(d, _) => !self.cancelled() && d.is_none_or(|d| Instant::now() < d),
        }
    }
}

/// What the attempts of a wait said that changes the error it ends with, whatever it
/// contends for (see [`next`](WaitEnd::next)).
pub(crate) struct WaitEnd {
    /// The last attempt's replica acknowledgements, when too few: the error to give if
    /// the caller's wait ends before one has enough.
    pub unacked: Option<usize>,
    /// The last attempt won a lease that had run out by the reply: `try_lock` then says
    /// the time ran out, not that someone else holds the hold.
    pub late: bool,
    /// The replica acknowledgements asked for.
    wanted: usize,
}

/// What a contender does after an attempt that did not get its hold.
pub(crate) enum Next {
    /// The caller does not wait: the call ends with this error (it left nothing to take
    /// with it).
    Stop(Error),
    /// The wait is over (its deadline passed, or it was cancelled): it leaves, and ends
    /// with this error.
    Over(Error),
    /// It sleeps, until this deadline at the latest.
    Sleep(Option<Instant>),
}

impl WaitEnd {
    pub fn new(cfg: &Config) -> Self {
        WaitEnd {
            unacked: None,
            late: false,
            wanted: cfg.replica_ack.map_or(0, |(n, _)| n),
        }
    }

    /// After an attempt that did not get the hold: what the wait policy says now.
    pub fn next(&self, wait: Wait<'_>) -> Next {
        let short = |otherwise: Error| match self.unacked {
            Some(acked) => Error::ReplicaAck {
                acked,
                wanted: self.wanted,
            },
            None => otherwise,
        };
        let deadline = match wait {
            Wait::No if self.late => return Next::Stop(Error::Timeout),
            Wait::No => return Next::Stop(short(Error::WouldBlock)),
            Wait::Until(d, _) => d,
        };
        if wait.cancelled() {
            return Next::Over(Error::Cancelled);
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Next::Over(short(Error::Timeout));
        }
        Next::Sleep(deadline)
    }

    /// What a wait that ended with `error` says: a slot half-way through a migration is
    /// waited out until the caller's deadline (see `topology::call`), so a wait that a
    /// refusal ended at its deadline timed out, whichever step met the refusal last (an
    /// attempt, a grant's confirmation, a leave); `try_lock` and a wait without a deadline
    /// say `SlotMigrating`.
    pub fn at_deadline(wait: Wait<'_>, error: Error) -> Error {
        let past = wait.deadline().is_some_and(|d| Instant::now() >= d);
        match error {
            Error::SlotMigrating if past => Error::Timeout,
            error => error,
        }
    }

    /// The error a wait ends with after an attempt failed with `error` and was not tried
    /// again: when the caller's deadline passed (or it cancelled) while its master was
    /// being replaced, or while the attempt's reply was awaited, a timeout (or a cancel),
    /// as for a hold kept until then.
    pub fn failed(ride: &Ride<'_>, wait: Wait<'_>, error: Error) -> Error {
        // The attempt's read is cut to what the deadline leaves (see `proto::node`): a
        // reply that had not come by then ends the wait as the deadline does; so does a
        // Redlock round left short of a majority by such cut reads.
        let cut = match &error {
            Error::Redis(e) => e.is_timeout(),
            Error::NoQuorum { .. } => true,
            _ => false,
        };
        // A cancel cannot cut a read short: one that ends at its timeout after the caller
        // cancelled ends the wait as the cancel does.
        if (ride.retried() || cut) && wait.cancelled() {
            return Error::Cancelled;
        }
        let past = wait.deadline().is_some_and(|d| Instant::now() >= d);
        if ride.retried() && past {
            log::debug!("deadline passed during a failover: {error:?}");
            return Error::Timeout;
        }
        if past && cut {
            log::debug!("deadline passed waiting for replies: {error:?}");
            return Error::Timeout;
        }
        error
    }
}

/// A hold won in Redis.
pub(crate) struct Won {
    pub remote: Arc<RemoteLock>,
    /// A write hold: another process may wait for it (see `rw_scripts`).
    pub others_wait: bool,
}

/// The outcome of one round of attempts.
enum Round {
    Acquired(Won),
    /// Held elsewhere; wake by this time at the latest (the holder's remaining lease, or a
    /// jitter after a split Redlock vote).
    Held(Option<Duration>),
    /// Ours, but too few replicas acknowledged it (`replica_ack`): undone; retry.
    Unacked(usize),
    /// Ours, but with no validity left when the replies came: undone; retry at once.
    Late,
    /// The round failed with `error`; `undo` says where the attempt with `token` may have
    /// left it. The caller either retries with the same token (riding through a failover:
    /// the script recognises its own token) or undoes it and returns the error.
    Failed {
        error: Error,
        token: String,
        undo: Undo,
    },
}

/// What a contest starts from.
#[derive(Clone, Copy)]
pub(crate) enum Start<'a> {
    /// A new hold. `yield_first`: this process just released the lock others wait for
    /// (see `yield_to_others`).
    New { yield_first: bool },
    /// A hold of ours, which the hold won replaces (an upgrade): every attempt uses its
    /// member. Once the contest returns the hold, this one is out of the watchdog's hands:
    /// the caller retires it (see `RemoteLock::begin_release`), with no release.
    Convert(&'a RemoteLock),
}

impl Engine {
    /// Contends in Redis for a hold of `kind` on `route` (the route of `keys`, looked up
    /// once by the caller), from `start`, until it is ours, the wait policy says stop, or
    /// an error.
    pub(crate) fn contest(
        self: &Arc<Self>,
        keys: &Keys,
        route: Route,
        kind: Kind,
        wait: Wait<'_>,
        start: Start<'_>,
    ) -> Result<Won> {
        let (yield_first, from) = match start {
            Start::New { yield_first } => (yield_first, None),
            Start::Convert(from) => (false, Some(from)),
        };
        let protocol = route.protocol(kind)?;
        // Fair queue: one token for the whole wait, so that our place in the queue, and a
        // grant to it, survive from one attempt to the next. Shared holds: one member, so
        // that a retry after a lost reply, or after a wait, finds its own hold. A
        // conversion: the member of the hold it turns.
        // The wait may retire it for a new one (see `Contest::retire_token`).
        let token = RefCell::new(match from {
            Some(from) => Some(from.token.clone()),
            None => protocol
                .keeps_token_across_attempts()
                .then(|| protocol.new_token()),
        });
        // A panic in the loop must not leave our entry in the queue, nor a grant to it.
        // (Every normal way out leaves the queue itself, or holds the lock.)
        let _unwinding = OnUnwind::new(|| {
            if std::thread::panicking()
                && let Ok(token) = token.try_borrow()
            {
                leave_after_panic(self, keys, protocol, token.as_deref());
            }
        });
        let mut waiter = wait.waiter(protocol.hears());
        if let Some(t) = token
            .borrow()
            .as_deref()
            .filter(|_| protocol.awaits_grant())
        {
            waiter.await_grant(t);
        }
        Contest {
            engine: self,
            keys,
            route,
            protocol,
            wait,
            waiter,
            token: &token,
            spent: Cell::new(false),
            unsettled: RefCell::new(Vec::new()),
            from,
            marked: false,
            fresh: true,
            nonce: Cell::new(0),
            last: Cell::new(None),
            round_trip: Cell::new(Duration::ZERO),
            expecting: None,
        }
        .run(yield_first)
        .map_err(|e| WaitEnd::at_deadline(wait, e))
    }
}

/// One contender's contest for one hold.
struct Contest<'a> {
    engine: &'a Arc<Engine>,
    keys: &'a Keys,
    route: Route,
    protocol: Protocol,
    wait: Wait<'a>,
    waiter: Waiter,
    /// The token of every attempt, when the protocol keeps one for the whole wait (until
    /// it is retired, see [`Contest::retire_token`]).
    token: &'a RefCell<Option<String>>,
    /// A hold the kept token may have taken is being given back: the token must not be
    /// used again.
    spent: Cell<bool>,
    /// The nodes where an attempt with the kept token went unanswered, left to the next
    /// call with it (fair queue: the next attempt, or the leave). It may still land after
    /// the leave: the cleanup job looks again there (see `cleanup`).
    unsettled: RefCell<Vec<NodeId>>,
    /// The hold of ours the attempts turn into another (see [`Start::Convert`]).
    from: Option<&'a RemoteLock>,
    /// An attempt of ours may have left a contention mark or a queue entry: taken with
    /// us when we leave without the hold.
    marked: bool,
    /// The route was read by the caller for the first attempt: one lookup per
    /// uncontended acquisition.
    fresh: bool,
    /// The last nonce given to an attempt (fair queue: see `fair_scripts`).
    nonce: Cell<u64>,
    /// The nonce of the latest attempt sent, and when it was sent first: a grant that
    /// carries it ran after then (see [`Contest::trust`]).
    last: Cell<Option<(u64, Stamp)>>,
    /// How long the latest attempt took from its send to its reply: the first renewal of a
    /// hold taken from a grant needs about as long to be answered (see [`Contest::trust`]).
    round_trip: Cell<Duration>,
    /// Held from the first sleep of a wait that may take a grant as the lock: the
    /// watchdog looks often enough meanwhile that the lock's first renewal needs no
    /// wake-up of it at the handoff (see `Watchdog::expect_grant`).
    expecting: Option<Expecting<'a>>,
}

impl Contest<'_> {
    fn run(&mut self, yield_first: bool) -> Result<Won> {
        let engine = self.engine;
        let (keys, wait) = (self.keys, self.wait);
        if !engine.subs.is_empty() {
            let asked: Vec<Option<(Instant, u64)>> = engine
                .subs_for(&self.route)
                .iter()
                .map(|s| s.should_yield(keys))
                .collect();
            if yield_first || asked.iter().any(Option::is_some) {
                self.waiter
                    .yield_to_others(keys, wait.deadline(), engine, &self.route, &asked);
            }
        }
        // Redis Cluster: retries through a failover, and the token of a failed attempt
        // that may have run, for the retry (one token, one lock: invariant 3), with what
        // it may have left to give back if the wait ends before the retry.
        let mut ride = Ride::new(&engine.topology, &engine.counters);
        let mut carried: Option<(String, Undo)> = None;
        // What the attempts before a retry with their token may have left: the retry's own
        // failure (a refused connection, say) says nothing of them, and nor does its win or
        // its finding the lock held (they may land after it). With that token.
        let mut earlier = Undo::default();
        let mut ridden: Option<String> = None;
        let mut end = WaitEnd::new(&engine.cfg);
        // Grants heard and not yet judged: at the deadline, or while the subscriber's
        // early attempt was in flight.
        let mut heard = Vec::new();
        loop {
            // After the early attempt's round (see below).
            self.settle_token(&mut heard);
            // A release granted us the lock (fair queue), or woke us as the writer
            // waiting longest. A fair grant that carries our latest attempt's nonce is
            // the lock (see `trust`); any other is confirmed by the attempt below: it
            // finds our token in the key and returns the fence counter as it is now, its
            // lease counted from this round trip.
            let mut grants = std::mem::take(&mut heard);
            let judged_again = grants.len();
            self.waiter.take_grants(&mut grants);
            let granted = !grants.is_empty();
            // Counted when heard, not again when a grant kept from the last pass is judged.
            if grants.len() > judged_again {
                Counters::inc(&engine.counters.grants_received);
            }
            // An attempt that will wait if it fails marks contention for the holder. The
            // script deletes our mark when we win; when we leave without the hold, we
            // take it with us, so that no holder keeps yielding to nobody.
            let (before, marks, outcome) = match self.waiter.take_early() {
                // The subscriber sent our attempt when the key was freed.
                Some((shot, pending)) => {
                    let (marks, at) = (pending.marks, shot.at);
                    let outcome = self.finish_early(shot, pending);
                    // A grant heard while it was in flight may carry its nonce: judged
                    // next, with no sleep.
                    if granted && matches!(outcome, Ok(Round::Held(_))) {
                        self.marked |= marks.leave;
                        heard = grants;
                        continue;
                    }
                    (Some(vec![at]), marks, outcome)
                }
                None => {
                    // Cancelled while asleep: no new attempt (one the subscriber sent for
                    // us is read above, and a grant heard is taken or confirmed: the hold
                    // wins).
                    if wait.cancelled() && !granted {
                        // A failed attempt carried into the ride may have taken the lock.
                        if let Some((tried, undo)) = carried.take() {
                            self.undo(tried, undo, self.marked);
                        }
                        self.leave();
                        return Err(Error::Cancelled);
                    }
                    if let Some(won) = self.trust(&grants)? {
                        return Ok(self.settled_by(won));
                    }
                    // The first attempt goes where the caller's route, read just now, says.
                    if !std::mem::take(&mut self.fresh) {
                        self.follow();
                    }
                    if matches!(wait, Wait::Until(..)) {
                        let keys = std::slice::from_ref(keys);
                        self.waiter
                            .watch_if_subscribed(keys, engine, &self.route, wait.deadline());
                    }
                    let before = self.waiter.snapshots();
                    let marks = Marks {
                        leave: wait.waits_now(),
                        clear: self.marked,
                    };
                    let retried = carried.take().map(|(tried, undo)| {
                        earlier = undo;
                        ridden = Some(tried.clone());
                        tried
                    });
                    let token = self.token.borrow().clone().or(retried);
                    (before, marks, self.round(marks, token))
                }
            };
            if !matches!(outcome, Ok(Round::Failed { .. })) {
                ride.settled();
                // A round ridden through that did not fail: what the failed rounds before it
                // may have left is settled as this round's own would be. A win with their
                // token counts as a retry's (its release is looked at again); otherwise it
                // is given back. (Not an upgrade's: see `Protocol::token_outlives_wait`.)
                let left = (carried.take())
                    .or_else(|| ridden.take().map(|t| (t, std::mem::take(&mut earlier))))
                    .filter(|(_, left)| !left.is_empty());
                if let Some((tried, left)) = left.filter(|_| !self.protocol.token_outlives_wait()) {
                    match &outcome {
                        Ok(Round::Acquired(won)) if won.remote.token == tried => {
                            won.remote.set_resent(true)
                        }
                        Ok(Round::Acquired(_) | Round::Late) => self.undo(tried, left, false),
                        _ => self.undo(tried, left, true),
                    }
                }
                earlier = Undo::default();
                ridden = None;
            }
            // Before anything else is sent for us: the early attempt armed before the sleep
            // below carries the token too.
            self.settle_token(&mut heard);
            let hint = match outcome {
                Ok(Round::Acquired(won)) => return Ok(self.settled_by(won)),
                Ok(Round::Held(hint)) => {
                    self.marked |= marks.leave;
                    hint
                }
                Ok(Round::Unacked(acked)) if self.from.is_some() => {
                    // A conversion given back (see `undo`): no hold left to convert again.
                    self.leave();
                    return Err(Error::ReplicaAck {
                        acked,
                        wanted: end.wanted,
                    });
                }
                Ok(Round::Unacked(acked)) => {
                    end.unacked = Some(acked);
                    // Our own release of it wakes us: try again at once.
                    Some(Duration::ZERO)
                }
                Ok(Round::Late) if self.from.is_some() => {
                    // A conversion that ran too late was given back (see `undo`): the
                    // hold it converted is gone, which a timeout would deny.
                    self.leave();
                    return Err(Error::Lost(LostReason::Converted));
                }
                Ok(Round::Late) => {
                    end.late = true;
                    Some(Duration::ZERO)
                }
                Ok(Round::Failed {
                    error,
                    token: tried,
                    mut undo,
                }) => {
                    undo.absorb(std::mem::take(&mut earlier));
                    // An attempt whose reply was lost may have left our mark (or queue
                    // entry): take it with us if we leave.
                    self.marked |= marks.leave && may_have_run(&error);
                    // A wait rides through a failover (`try_lock` does not wait); the next
                    // attempt reads the route again, and watches there if it moved.
                    if matches!(wait, Wait::Until(..))
                        && !wait.cancelled()
                        && ride.again(&error, wait.deadline())
                    {
                        carried = Some((tried, undo));
                        continue;
                    }
                    // Fair queue: the leave below frees a lock that the lost attempt may
                    // have taken with our token; without one (the caller did not wait, so
                    // it is not queued) the undo releases it.
                    // A node that did not answer the attempt (or could not be reached)
                    // is not asked again on the caller's time: the leave is left to the
                    // cleanup thread, as is the give-back of what the attempt may have
                    // taken there. A node that answered with an error (a key of another
                    // type, say) is left at once, as before.
                    let unanswered = error.is_connection()
                        || (self.route.nodes().iter())
                            .any(|n| undo.unknown.contains(&n.id) && !n.answering());
                    let reused = self.marked;
                    self.undo(tried, undo, reused);
                    if unanswered {
                        self.leave_later();
                    } else {
                        self.leave();
                    }
                    return Err(WaitEnd::failed(&ride, wait, error));
                }
                Err(e) => {
                    self.leave();
                    return Err(e);
                }
            };
            let deadline = match end.next(wait) {
                Next::Stop(e) => {
                    self.leave();
                    return Err(e);
                }
                Next::Over(e) => {
                    // A grant heard at the deadline: taken, or one more attempt confirms (and
                    // takes) it.
                    self.waiter.take_grants(&mut heard);
                    if !heard.is_empty() {
                        continue;
                    }
                    self.leave();
                    return Err(e);
                }
                Next::Sleep(deadline) => deadline,
            };
            crate::fault::hit(&engine.cfg.key_prefix, crate::fault::Point::Contend);
            if !self.waiter.watching() {
                // The sleep only subscribes (and the next attempt follows): where the key
                // is now, which the attempt's redirects may have just told.
                self.route = engine.topology.route(keys);
            }
            if self.expecting.is_none() && self.may_trust() {
                self.expecting = engine.watchdog.as_ref().map(Watchdog::expect_grant);
            }
            let (route, protocol, marked) = (&self.route, self.protocol, self.marked);
            let nonce = self.next_nonce();
            self.waiter
                .sleep(keys, engine, route, before, hint, deadline, |w| {
                    w.arm(keys, engine, route, protocol, marked, nonce, deadline);
                });
        }
    }

    /// Redis Cluster: the key's slot may have moved (a reshard, a failover) since the last
    /// attempt: the waiter follows it (see [`Waiter::follow`]).
    fn follow(&mut self) {
        let keys = std::slice::from_ref(self.keys);
        let deadline = self.wait.deadline();
        self.waiter
            .follow(keys, self.engine, &mut self.route, deadline);
    }

    /// One attempt on every node of the route, judged by the topology.
    fn round(&self, marks: Marks, token: Option<String>) -> Result<Round> {
        let engine = self.engine;
        let token = token.unwrap_or_else(|| self.protocol.new_token());
        let nonce = self.next_nonce();
        // On the lease clock: the validity counts from here.
        let started = Stamp::now();
        self.last.set(Some((nonce, started)));
        let req = Request {
            keys: self.keys,
            token: &token,
            lease: engine.cfg.lease,
            marks,
            nonce,
        };
        // A conversion of a hold lost meanwhile (its lease ran out, its hold limit came)
        // would make a fresh hold out of a dead one.
        if let Some(reason) = self.from.and_then(|from| from.lost(&engine.counters)) {
            return Err(Error::Lost(reason));
        }
        let paused = self.from.map(|from| Paused::new(engine, from));
        let replies =
            (engine.topology).attempt(&self.route, self.protocol, req, self.wait.deadline());
        self.round_trip.set(started.elapsed());
        let round = self.judge(token, started, replies);
        if let (Some(paused), Ok(Round::Acquired(_))) = (paused, &round) {
            paused.replaced();
        }
        round
    }

    /// Reads the reply to the attempt the subscriber sent for us.
    fn finish_early(&self, shot: Shot, pending: Pending) -> Result<Round> {
        let replies = self.engine.topology.finish_early(
            &self.route,
            self.protocol,
            shot.reply,
            &pending.call,
            self.wait.deadline(),
        );
        if replies.is_empty() {
            return Err(Error::Protocol(
                "early attempt without a sole node".to_owned(),
            ));
        }
        let sent = shot.sent;
        self.last.set(Some((pending.nonce, sent)));
        // Up to now, not to the reply: longer, which only makes a grant less often taken.
        self.round_trip.set(sent.elapsed());
        self.judge(pending.token, sent, replies)
    }

    /// The hold won, which was to settle the unknown outcome of earlier attempts with its
    /// token (see `unsettled`): one of them, still on its way, may land after the hold's
    /// release and take the lock again, so the release is looked at again.
    fn settled_by(&self, won: Won) -> Won {
        if !self.unsettled.borrow().is_empty() {
            won.remote.set_resent(true);
        }
        won
    }

    /// The next attempt's nonce.
    fn next_nonce(&self) -> u64 {
        let nonce = self.nonce.get() + 1;
        self.nonce.set(nonce);
        nonce
    }

    /// Takes a grant heard as the hold (the fair queue's lock, a read-write lock's write
    /// hold), with no round trip, when it carries
    /// the nonce of our latest attempt. Redis ran that attempt before the grant, so after
    /// we sent it: the grant's lease ends no earlier than `sent + grant lease`, and the
    /// hold is ours until then, less the drift margin. The watchdog's first renewal, a
    /// quarter of that validity later (`Config::first_renewal`), gives it the full lease.
    /// A grant of an older attempt (it may be of an earlier entry, whose lease ran out and
    /// whose fence another holder followed), or one heard after that bound (a slow
    /// network, a stopped process), or with less than two of our round trips left before
    /// it (the first renewal would not be answered in time), is only a wake-up:
    /// `None`, and the next attempt confirms it. So is any grant where the next attempt
    /// must decide: without renewals (the bound would be the whole hold), with replica
    /// acknowledgements (a grant is not known to be replicated), on more than one node.
    fn trust(&self, grants: &[Grant]) -> Result<Option<Won>> {
        let cfg = &self.engine.cfg;
        let (Some((nonce, sent)), Some(node)) = (self.last.get(), self.route.sole()) else {
            return Ok(None);
        };
        let trusted = self.may_trust();
        let Some(grant) = grants.iter().rev().find(|g| trusted && g.nonce == nonce) else {
            return Ok(None);
        };
        // A permit's grant carries the semaphore's count where a fence would be: one of
        // another count (the name was made again meanwhile, by a process that asked for
        // another) is only a wake-up, whose attempt reports the mismatch.
        let fence = match self.protocol {
            Protocol::Permit { permits, .. } if grant.fence != u64::from(permits) => {
                return Ok(None);
            }
            Protocol::Permit { .. } => 0,
            _ => grant.fence,
        };
        let until = sent + grant.lease.saturating_sub(cfg.drift(grant.lease));
        // The first renewal, a quarter of the time left from now, must be answered before
        // the bound: with less than two round trips left (a slow link, a grant read late),
        // the hold would be lost the moment it is taken, although Redis keeps it renewed.
        // The confirming attempt takes it with the full lease instead.
        let now = Stamp::now();
        if now >= until || until.since(now) < self.round_trip.get().saturating_mul(2) {
            return Ok(None);
        }
        let token = self.token.borrow().clone().unwrap_or_default();
        let nodes = vec![node.id.clone()];
        // A grant with a nonce follows a release (after a loss it carries none, so that
        // the confirming attempt tells of it): nothing was lost before it.
        let remote = self.acquired(token, (fence, false), nodes, sent, Some(until))?;
        Counters::inc(&self.engine.counters.grants_trusted);
        // A write hold granted by the release of a read-write lock's last hold: other
        // processes' readers, held back while we waited, may wait still, so the process
        // serves its own writers and gives the hold back (see `local::shares`).
        Ok(Some(Won {
            remote,
            others_wait: self.protocol.shared(),
        }))
    }

    /// Whether a grant heard may be taken as the hold (see [`Contest::trust`]): one of a
    /// protocol whose release grants (the fair queue, read-write locks, semaphores), for a
    /// new hold, with renewals on and no replica acknowledgement asked, on one node.
    fn may_trust(&self) -> bool {
        let cfg = &self.engine.cfg;
        self.protocol.release_may_grant()
            && self.from.is_none()
            && cfg.auto_renew
            && cfg.replica_ack.is_none()
            && self.route.sole().is_some()
    }

    /// Acts on the topology's verdict on a round's replies.
    fn judge(
        &self,
        token: String,
        started: Stamp,
        replies: Vec<(NodeId, Result<Attempt>)>,
    ) -> Result<Round> {
        let engine = self.engine;
        let lease = engine.cfg.lease;
        let rules = self
            .route
            .rules(lease_left(lease, started, engine.cfg.drift(lease)));
        let unacked = replies
            .iter()
            .filter_map(|(_, r)| match r {
                Ok(Attempt::Unacked { acked, .. }) => Some(*acked),
                _ => None,
            })
            .min();
        let mut vote = vote(replies, rules);
        // Redlock: only nodes behind need it; with counters in step there is no extra
        // round trip. A hold whose fence fewer than a majority carry after the raises is
        // nobody's: a later majority could miss them all and issue a lower token. It fails
        // as a round without enough grants does. A slow node's raise may take what the
        // lease had left: then the hold is nobody's, as a round that took too long.
        if let Vote::Won {
            fence,
            granted,
            behind,
            ..
        } = &vote
            && !behind.is_empty()
        {
            let deadline = self.wait.deadline();
            let raised = engine.raise_fences(self.keys, &self.route, *fence, behind, deadline);
            let carried = granted.len() - behind.len() + raised;
            let short = carried < rules.quorum;
            if short || !lease_left(lease, started, engine.cfg.drift(lease)) {
                let Vote::Won { granted, stray, .. } = vote else {
                    unreachable!("matched above")
                };
                // Every node that may hold our token: the granting ones, and those whose
                // reply was lost or that granted without enough replicas.
                let mut undo = Undo {
                    granted,
                    unknown: Vec::new(),
                };
                undo.absorb(stray);
                vote = match short {
                    true => Vote::Failed {
                        error: Error::NoQuorum {
                            granted: carried,
                            needed: rules.quorum,
                            nodes: self.route.nodes().len(),
                        },
                        undo,
                    },
                    false => Vote::Late { undo },
                };
            }
        }
        match vote {
            Vote::Won {
                fence,
                granted,
                others_wait,
                previous_lost,
                resent,
                ..
            } => {
                let remote =
                    self.acquired(token, (fence, previous_lost), granted, started, None)?;
                remote.set_resent(resent);
                Ok(Round::Acquired(Won {
                    remote,
                    others_wait,
                }))
            }
            Vote::Held { hint, undo } => {
                // Fair queue: the next attempt, or the leave, uses the same token.
                self.undo(token, undo, true);
                Ok(match unacked {
                    Some(acked) => Round::Unacked(acked),
                    None => Round::Held(hint),
                })
            }
            Vote::Failed { error, undo } => Ok(Round::Failed { error, token, undo }),
            Vote::Late { undo } => {
                Counters::inc(&engine.counters.failed_attempts);
                // Given back whatever comes next: a hold without time left is nobody's.
                self.undo(token, undo, false);
                Ok(Round::Late)
            }
        }
    }

    /// Releases our token where a lost round left it: on the nodes that granted while the
    /// deadline allows, and without waiting where the outcome is unknown, so that no stray
    /// key outlives the call by long and the caller's deadline is kept. `reused`: a later
    /// call of this wait uses the token again (fair queue: the next attempt, or the leave),
    /// which settles an unknown outcome when the protocol says so.
    fn undo(&self, token: String, mut undo: Undo, reused: bool) {
        if undo.is_empty() {
            return;
        }
        let engine = self.engine;
        // A conversion (an upgrade) that may have run turned the hold it converts into
        // the one given back below: the hold converted may be gone, and a writer may get
        // in as soon as that is released. Its guard must not go on claiming it.
        if let Some(from) = self.from {
            from.mark_lost(LostReason::Converted, &engine.counters);
        }
        if reused && self.protocol.next_call_settles_unknown() {
            // Fair queue: the next attempt finds the token in the key if it is ours, and
            // the leave passes such a lock on: only a lock taken without enough replicas
            // is given back now. A caller that neither attempts again nor leaves (a
            // `try_lock` refused) has it given back by the cleanup thread as it ends (see
            // `give_back_unsettled`).
            let mut unsettled = self.unsettled.borrow_mut();
            for node in undo.unknown.drain(..) {
                if !unsettled.contains(&node) {
                    unsettled.push(node);
                }
            }
        }
        // A give-back can run late (its reply lost, its bytes delayed): were the kept
        // token used again, a late one could delete, or pass on, the hold a later attempt
        // with it wins, under its holder. The token is retired instead.
        if !undo.is_empty() && self.token.borrow().is_some() {
            self.spent.set(true);
        }
        let deadline = self.wait.deadline();
        if !undo.granted.is_empty() && deadline.is_none_or(|d| Instant::now() < d) {
            let (route, protocol) = (&self.route, self.protocol);
            let replies = release_on(
                &engine.topology,
                self.keys,
                route,
                protocol,
                &token,
                (None, deadline),
                &undo.granted,
            );
            // A give-back that failed anywhere (its request or its reply lost) goes to the
            // cleanup thread with the others, or the hold would stay for its whole lease
            // (a second one finds the token gone).
            if replies.iter().all(Result::is_ok) {
                undo.granted.clear();
            }
        }
        undo.unknown.append(&mut undo.granted);
        undo.unknown.sort();
        undo.unknown.dedup();
        if !undo.unknown.is_empty() {
            // Not waited for: one bounded worker per client (see `cleanup`). The token is
            // not used again: settled by the next call above, or retired.
            (engine.cleanup).give_back_later(self.keys, self.protocol, token, undo.unknown);
        }
    }

    /// When the round just judged gave back a hold our kept token took: the attempts from
    /// now on use a new token, and the grants heard for the old one are nobody's.
    fn settle_token(&mut self, heard: &mut Vec<Grant>) {
        if self.spent.take() {
            heard.clear();
            // What the next call with the old token was to settle is left to the cleanup
            // job: the next call uses a new one.
            let unsettled = self.unsettled.take();
            let old = self.token.borrow().clone();
            if let Some(old) = old.filter(|_| !unsettled.is_empty() && self.from.is_none()) {
                (self.engine.cleanup).leave_later(self.keys, self.protocol, old, unsettled);
            }
            self.retire_token();
        }
    }

    /// The attempts from now on use a new token, as a new contender's (fair queue: a new
    /// entry, at the back: the hold given back was our turn). A conversion's token is the
    /// hold it converts, and a conversion whose attempt is given back ends its wait.
    fn retire_token(&mut self) {
        if self.from.is_some() {
            return;
        }
        let fresh = self.protocol.new_token();
        if self.protocol.awaits_grant() {
            self.waiter.await_grant(&fresh);
        }
        *self.token.borrow_mut() = Some(fresh);
    }

    /// The wait ends without the hold: leave the fair queue (passing on a grant that
    /// raced us), or take our contention mark with us. A wait that left nothing (a
    /// `try_lock` refused, say) may still have an attempt unsettled: its first send may
    /// land yet, and is given back by the cleanup thread.
    fn leave(&self) {
        if !self.departs() {
            return self.give_back_unsettled();
        }
        let (engine, keys, protocol) = (self.engine, self.keys, self.protocol);
        let token = self.token.borrow();
        let Some(token) = token.as_deref() else {
            engine.unmark(keys, &self.route, protocol, self.wait.deadline());
            return;
        };
        let mut unsettled = self.unsettled.take();
        for node in self.route.nodes() {
            match protocol.leave(node, keys, token, true, self.wait.deadline()) {
                Ok(true) => Counters::inc(&engine.counters.grants_passed),
                Ok(false) => {}
                Err(e) if protocol.token_outlives_wait() => {
                    log::debug!("leaving failed: {e}; the mark is left to its TTL");
                }
                Err(e) => {
                    // Our mark or entry, and a grant to us (or a hold a lost attempt
                    // took), may be left: the cleanup job leaves again.
                    log::debug!("leaving failed: {e}; left in the background");
                    unsettled.retain(|id| *id != node.id);
                    engine.cleanup.leave_later(
                        keys,
                        protocol,
                        token.to_owned(),
                        vec![node.id.clone()],
                    );
                }
            }
        }
        if !unsettled.is_empty() {
            (engine.cleanup).look_again(keys, protocol, token.to_owned(), unsettled);
        }
    }

    /// The wait ends having left nothing to give back, but an attempt of its kept token
    /// may still land where it went unsettled: the cleanup thread gives back what it
    /// takes, and looks again. (An upgrade's never are: see `Protocol::token_outlives_wait`.)
    fn give_back_unsettled(&self) {
        let unsettled = self.unsettled.take();
        let token = self.token.borrow().clone();
        if let Some(token) = token.filter(|_| !unsettled.is_empty()) {
            (self.engine.cleanup).give_back_later(self.keys, self.protocol, token, unsettled);
        }
    }

    /// Whether the wait left something to give back (a mark or a queue entry); a departure
    /// from the fair queue is counted.
    fn departs(&self) -> bool {
        if self.marked && self.protocol.queues_waiters() {
            Counters::inc(&self.engine.counters.queue_departures);
        }
        self.marked
    }

    /// The wait ends on a server that did not answer (or could not be reached): what
    /// [`leave`](Self::leave) gives back is left to the cleanup thread, which tries again
    /// until it is moot, rather than sent by the caller to the same server, which would
    /// hold the caller up once more for the least a call is given, past its deadline.
    fn leave_later(&self) {
        if !self.departs() {
            return self.give_back_unsettled();
        }
        if self.protocol.token_outlives_wait() {
            return;
        }
        let (engine, keys, protocol) = (self.engine, self.keys, self.protocol);
        // The job leaves on every node, the unsettled ones too, and looks again after.
        self.unsettled.take();
        let nodes = self.route.node_ids();
        match self.token.borrow().as_deref() {
            Some(token) => engine
                .cleanup
                .leave_later(keys, protocol, token.to_owned(), nodes),
            None => engine.cleanup.unmark_later(keys, protocol, nodes),
        }
    }

    /// The hold is ours: its state, for the guard(s) and the watchdog. `previous_lost`:
    /// the hold before it ended without a release (see `Attempt::Acquired`). `granted`:
    /// taken from a grant message, held until then unless the first renewal (due a quarter
    /// of the way there) lengthens it.
    fn acquired(
        &self,
        token: String,
        (fence, previous_lost): (u64, bool),
        nodes: Vec<NodeId>,
        started: Stamp,
        granted: Option<Stamp>,
    ) -> Result<Arc<RemoteLock>> {
        let engine = self.engine;
        if fence > MAX_FENCE {
            // A conversion ran: the hold it turned is gone with the one given back here.
            if let Some(from) = self.from {
                from.mark_lost(LostReason::Converted, &engine.counters);
            }
            release_on(
                &engine.topology,
                self.keys,
                &self.route,
                self.protocol,
                &token,
                (None, None),
                &nodes,
            );
            return Err(Error::Protocol(format!(
                "fence counter {fence} exceeds {MAX_FENCE}"
            )));
        }
        // An upgrade wins the write hold.
        let (protocol, token) = self.protocol.won(token);
        let acquisition = Acquisition {
            keys: self.keys.clone(),
            protocol,
            token,
            fence,
            previous_lost,
            nodes,
            started,
        };
        let lock = match granted {
            Some(until) => {
                let now = Stamp::now();
                let renew_at = now + engine.cfg.first_renewal(until.since(now));
                Arc::new(
                    engine
                        .remote_lock(acquisition)
                        .granted_until(until, renew_at),
                )
            }
            None => engine.new_hold(acquisition),
        };
        if let Some(from) = self.from {
            lock.set_turned_from(from);
        }
        Counters::inc(&engine.counters.remote_acquisitions);
        Ok(lock)
    }
}

impl Engine {
    /// The state of a hold just taken (or made by turning another), with the client's
    /// lease and renewals.
    pub(crate) fn new_hold(&self, acquisition: Acquisition) -> Arc<RemoteLock> {
        Arc::new(self.remote_lock(acquisition))
    }

    pub(crate) fn remote_lock(&self, acquisition: Acquisition) -> RemoteLock {
        let cfg = &self.cfg;
        let lease = cfg.lease;
        RemoteLock::new(
            acquisition,
            lease,
            cfg.drift(lease),
            cfg.auto_renew.then(|| cfg.renew_every(lease)),
            cfg.max_hold,
        )
    }
}

/// The renewals of a hold of ours wait while a script that replaces its member (an
/// upgrade, a downgrade) is in flight: a renewal crossing it would find the member gone
/// and report the hold lost. Taken like an explicit extend (`RemoteLock::begin_extend`),
/// and given back when dropped, with the hold's lease unchanged.
pub(crate) struct Paused<'a> {
    engine: &'a Engine,
    hold: &'a RemoteLock,
}

impl<'a> Paused<'a> {
    pub fn new(engine: &'a Engine, hold: &'a RemoteLock) -> Self {
        hold.begin_extend();
        Paused { engine, hold }
    }

    /// The script replaced the hold's member: the watchdog forgets the hold before its
    /// renewals could resume, so that none is sent for a member that is no more.
    pub fn replaced(self) {
        if let Some(w) = &self.engine.watchdog {
            w.unregister(self.hold);
        }
    }
}

impl Drop for Paused<'_> {
    fn drop(&mut self) {
        // Nothing changed the lease: the validity and the next renewal stay as they were.
        self.hold.cancel_extend();
    }
}

/// A panic unwinds through the contest: out of the queue, the mark removed (the route
/// read again: the panic may have come from anywhere). Without a token (a plain lock),
/// the mark's removal is left to the cleanup thread.
fn leave_after_panic(engine: &Engine, keys: &Keys, protocol: Protocol, token: Option<&str>) {
    let route = engine.topology.route(keys);
    let Some(token) = token else {
        let nodes = route.node_ids();
        engine.cleanup.unmark_later(keys, protocol, nodes);
        return;
    };
    for node in route.nodes() {
        if let Err(e) = protocol.leave(node, keys, token, true, None) {
            log::debug!("leaving after a panic failed (the entry expires): {e}");
        }
    }
}
