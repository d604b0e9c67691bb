//! Multi-locks: several exclusive locks held together, taken all or none.
//!
//! The names are split into groups: the names whose keys are on one node and in one hash
//! slot (on one node or behind Sentinel, all of them; on Redis Cluster, one group per
//! slot, since a script may name keys of one slot only). A group is taken by one script
//! call that takes every lock of it or none (`multi_scripts::MULTI_ACQUIRE`), and waits,
//! when it cannot, like a lock's contender: it watches every key of the group, confirmed,
//! before the attempt whose failure makes it wait (invariant 1), and sleeps until an event
//! of any of them, the time the whole group may be free (the latest end of the leases and
//! fair-queue entries in its way), the re-check, the deadline or a cancel. Groups are
//! taken one after the other; what was taken is given back when a later group cannot be
//! (a timeout, a cancel, an error, a panic).
//!
//! # Why groups are taken in slot order
//!
//! Two multi-locks must never wait for each other. Each holds some groups while it waits
//! for its next one, so groups are taken in one order that every process shares: by hash
//! slot (outside a cluster there is one group). If a multi-lock waits for a lock held by
//! another, that one holds a key of the slot waited for, and so waits (if at all) for a
//! later slot than that: along any chain of waiting multi-locks the slots only grow, and
//! the chain cannot close into a cycle. Ordering the groups by their smallest name would
//! not do: a group is only the names one call asked for, so `{a, z}` then `{m}` in one
//! call and `{m}` then `{z}` in another (`a`, `z` in one slot) deadlock.
//!
//! # Held like detached locks
//!
//! Each name is held as a lock of its own ([`RemoteLock`]) under its group's token, with
//! the route's lock protocol, watched and renewed by the watchdog (the names of one group
//! share node, slot and lease: one renewal call covers them), and a loss of any one is the
//! loss of the multi-lock. The local table never knows them: as with a detached guard,
//! nothing is handed to a local thread, and this process's threads wait for the names in
//! Redis like any other contender. A multi-lock does not queue in the fair queue, nor pass
//! it: it takes a name when its key is free and nobody alive is queued for it (a fair
//! release grants the key to the head of its queue), and its contention marks make the
//! holders' processes, this one included, keep to their fairness budget. Early attempts
//! are not used.
//!
//! # One mark for the client's multi-locks
//!
//! A name's mark key holds one id, and every multi-lock of a client marks with the same
//! one (see [`MARK_SUFFIX`]), so that whichever of them wins clears it. A multi-lock that
//! stops waiting therefore leaves the mark of a name another multi-lock of the client
//! still waits for (see `multi_marks`): removed, it would tell the holder's process that
//! nobody waits until that one's next attempt, as a process's one contender per name
//! (singleflight) never does to its local waiters. The last one's removal, on its way,
//! is waited for by one that begins to wait just then, before its first attempt: its
//! mark comes after the removal. (A removal whose reply is lost, after its wait's
//! deadline, may still land after that attempt: the mark is back at the next one.)

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::clock::Stamp;
use crate::config::Wakeup;
use crate::engine::contest::{Next, Wait, WaitEnd};
use crate::engine::multi_marks::Waiting;
use crate::engine::state::Engine;
use crate::engine::waiter::Waiter;
use crate::error::{Error, LostReason, Result, Unlocked};
use crate::fencing::MAX_FENCE;
use crate::local::held::{Acquisition, RemoteLock};
use crate::proto::keys::{Keys, keyslot};
use crate::proto::multi_scripts::Taken;
use crate::proto::node::{Node, may_have_run, new_token, past};
use crate::proto::protocol::{Group, Hears, Kind, Marks, Protocol};
use crate::stats::{Counters, HoldKind, Path};
use crate::topology::Route;
use crate::topology::ride::Ride;
use crate::topology::verdict::{lease_left, tally_release};

/// The most names one multi-lock may have: a group's script reads every key of it, and a
/// script blocks the server while it runs.
pub(crate) const MAX_NAMES: usize = 64;

/// What a multi-lock's contention marks carry after the client's id: not the client's id
/// itself, so that this process's own holders of the names count it as a waiter.
const MARK_SUFFIX: &str = ":multi";
/// Rounds a multi-lock takes its groups in when one taken early is lost while a later one
/// is waited for: a name whose key keeps vanishing (an operator deleting it, a server
/// evicting) ends the call with [`Error::Lost`] rather than have it try forever.
const TAKE_ROUNDS: u32 = 3;

/// A multi-lock held.
pub(crate) struct MultiHeld {
    /// Its locks, group by group in the order they were taken.
    pub groups: Vec<Vec<Arc<RemoteLock>>>,
    /// The same locks, one per name in the caller's order.
    pub names: Vec<Arc<RemoteLock>>,
    /// When the call returned: the hold's start.
    pub since: Instant,
}

impl Engine {
    /// Takes the exclusive locks `names` together, as `wait` allows: all of them, or none
    /// (every group taken before is given back). The wait is recorded (see `stats`).
    pub(crate) fn multi_lock(
        self: &Arc<Self>,
        names: &[Vec<u8>],
        wait: Wait<'_>,
    ) -> Result<MultiHeld> {
        let take = || self.take_all(names, wait);
        let (took, since) = self.recorded(HoldKind::Lock, wait, take, |_| Path::Remote);
        let (groups, by_name) = took?;
        Ok(MultiHeld {
            groups,
            names: by_name,
            since,
        })
    }

    /// Gives back every lock of a multi-lock in Redis. No renewal is sent once this
    /// returns. The outcome: `Released` when every name was still ours, else the worst
    /// (`HeldByOther`, then `Expired`), or the first error of a group that could not tell
    /// (the other groups are released all the same).
    pub(crate) fn release_multi(
        self: &Arc<Self>,
        groups: &[Vec<Arc<RemoteLock>>],
    ) -> Result<Unlocked> {
        groups
            .iter()
            .map(|locks| self.release_group(locks))
            .fold(Ok(Unlocked::Released), worst)
    }

    /// Gives back one group that a multi-lock took and does not keep (see [`Partial`]):
    /// one release where the route says now, not ridden through a failover, which could
    /// keep the caller (whose deadline is near or past, or who got an error) up to a
    /// lease; what it could not confirm is left to the cleanup job.
    fn give_back_group(self: &Arc<Self>, locks: &[Arc<RemoteLock>]) {
        let Some(first) = locks.first() else {
            return;
        };
        let (_, keys, _) = self.end_group(locks);
        // Holds nobody used: released with fence 0, so that a counter that told of a lost
        // hold before them still tells the next holder (see `END_FENCE_FN`).
        let unused = vec![None; keys.len()];
        let route = self.topology.route(&first.keys);
        let released = on_sole(&route, |node| {
            let token = first.token.as_str();
            (first.protocol).release_all(node, &keys, token, &unused, route.retry(), false)
        });
        match released {
            // A group won by a retry: its first send may land after this.
            Ok(_) => locks
                .iter()
                .for_each(|lock| self.look_again_if_resent(lock, &route)),
            Err(e) => {
                log::debug!(
                    "giving back a multi-lock's names failed: {e}; left to the cleanup job"
                );
                let nodes: Vec<_> = route.node_ids();
                for lock in locks {
                    let token = lock.token.clone();
                    (self.cleanup).release_later(&lock.keys, lock.protocol, token, nodes.clone());
                }
            }
        }
    }

    /// The groups of `names` in the order they are taken, each with its keys sorted and
    /// the place of each name in `names`; every check of the input is made here, before
    /// anything is sent.
    fn groups_of(&self, names: &[Vec<u8>]) -> Result<Vec<Vec<(usize, Keys)>>> {
        if names.is_empty() {
            return Err(Error::InvalidArgument("multi-lock of no names".to_owned()));
        }
        if names.len() > MAX_NAMES {
            return Err(Error::InvalidArgument(format!(
                "multi-lock of more than {MAX_NAMES} names"
            )));
        }
        let mut keys = names
            .iter()
            .enumerate()
            .map(|(i, name)| Ok((i, Keys::new(&self.cfg.key_prefix, name)?)))
            .collect::<Result<Vec<_>>>()?;
        keys.sort_by(|(_, a), (_, b)| a.lock().cmp(b.lock()));
        if let Some(pair) = keys.windows(2).find(|w| w[0].1 == w[1].1) {
            return Err(Error::InvalidArgument(format!(
                "multi-lock names {:?} twice",
                pair[0].1.display()
            )));
        }
        if keys.iter().any(|(_, k)| self.table.held_here(k)) {
            return Err(Error::WouldDeadlock);
        }
        // Redis Cluster: one group per slot, in slot order (see the module docs).
        let by_slot = self.topology.batches_by_slot();
        let mut groups: BTreeMap<u16, Vec<(usize, Keys)>> = BTreeMap::new();
        for (i, k) in keys {
            let slot = if by_slot { keyslot(k.lock()) } else { 0 };
            groups.entry(slot).or_default().push((i, k));
        }
        Ok(groups.into_values().collect())
    }

    /// Takes every group of `names` in order: the locks by group, and by name in the
    /// caller's order.
    #[allow(clippy::type_complexity)]
    fn take_all(
        self: &Arc<Self>,
        names: &[Vec<u8>],
        wait: Wait<'_>,
    ) -> Result<(Vec<Vec<Arc<RemoteLock>>>, Vec<Arc<RemoteLock>>)> {
        let groups = self.groups_of(names)?;
        let mut rounds = 1;
        let held = loop {
            match self.take_groups(&groups, wait)? {
                Ok(held) => break held,
                Err(reason) if rounds < TAKE_ROUNDS => {
                    rounds += 1;
                    log::info!(
                        "multi-lock: a name taken first was lost ({reason}) while later ones were waited for; taking them all again"
                    );
                }
                Err(reason) => return Err(Error::Lost(reason)),
            }
        };
        let mut by_name: Vec<Option<Arc<RemoteLock>>> = vec![None; names.len()];
        for (group, locks) in groups.iter().zip(&held) {
            for ((i, _), lock) in group.iter().zip(locks) {
                by_name[*i] = Some(lock.clone());
            }
        }
        Ok((held, by_name.into_iter().flatten().collect()))
    }

    /// One round of [`take_all`](Self::take_all): every group in order, or why one taken
    /// early was lost while a later one was waited for (its key deleted, its lease run out
    /// in a stall): the names were then never all held at once, and what was taken has
    /// been given back.
    #[allow(clippy::type_complexity)]
    fn take_groups(
        self: &Arc<Self>,
        groups: &[Vec<(usize, Keys)>],
        wait: Wait<'_>,
    ) -> Result<std::result::Result<Vec<Vec<Arc<RemoteLock>>>, LostReason>> {
        let mut taken = Partial {
            engine: self,
            groups: Vec::with_capacity(groups.len()),
        };
        for group in groups {
            let keys: Vec<Keys> = group.iter().map(|(_, k)| k.clone()).collect();
            let locks = self.take_group(&keys, wait).inspect_err(|e| {
                if e.is_timeout() {
                    Counters::inc(&self.counters.timeouts);
                }
            })?;
            if let Some(w) = &self.watchdog {
                for lock in &locks {
                    w.register(lock.clone(), lock.next_due());
                }
            }
            taken.groups.push(locks);
        }
        let mut taken_locks = taken.groups.iter().flatten();
        // Renewals that stopped (a shutdown, a failed watchdog) mark every hold lost at its
        // registration: taking the names again would not cure that, and the wait returns
        // the guard already told, as a lock's wait does.
        if let Some(reason) = taken_locks.find_map(|l| l.lost(&self.counters))
            && reason != LostReason::WatchdogFailed
        {
            return Ok(Err(reason));
        }
        Ok(Ok(std::mem::take(&mut taken.groups)))
    }

    /// Contends for the locks `keys` (one group) until all are ours, the wait policy says
    /// stop, or an error.
    fn take_group(self: &Arc<Self>, keys: &[Keys], wait: Wait<'_>) -> Result<Vec<Arc<RemoteLock>>> {
        let Some(first) = keys.first() else {
            return Ok(Vec::new());
        };
        let route = self.topology.route(first);
        let protocol = route.protocol(Kind::Multi)?;
        let Some(node) = route.sole() else {
            return Err(Error::Protocol(
                "a multi-lock's group without a sole node".to_owned(),
            ));
        };
        GroupContest {
            engine: self,
            keys,
            mark_id: format!("{}{MARK_SUFFIX}", node.client_id()),
            route,
            protocol,
            wait,
            waiter: wait.waiter(Hears::Key),
            waiting: Waiting::new(&self.multi_marks),
        }
        .run()
    }

    /// Ends the holds of a group before its release or give-back: no renewal may be sent
    /// once this returns. Says, per lock, whether it was already lost, and gives the keys
    /// and fences the release scripts take.
    fn end_group(&self, locks: &[Arc<RemoteLock>]) -> (Vec<bool>, Vec<Keys>, Vec<Option<u64>>) {
        let lost = locks
            .iter()
            .map(|l| l.begin_release(&self.counters).is_some())
            .collect();
        if let Some(w) = &self.watchdog {
            locks.iter().for_each(|l| w.unregister(l));
        }
        let keys = locks.iter().map(|l| l.keys.clone()).collect();
        let fences = locks.iter().map(|l| Some(l.fence)).collect();
        (lost, keys, fences)
    }

    /// Gives back one group's locks (see [`release_multi`](Self::release_multi)).
    fn release_group(self: &Arc<Self>, locks: &[Arc<RemoteLock>]) -> Result<Unlocked> {
        let Some(first) = locks.first() else {
            return Ok(Unlocked::Released);
        };
        let (lost, keys, fences) = self.end_group(locks);
        let (protocol, token) = (first.protocol, first.token.as_str());
        let route = self.topology.route(&first.keys);
        // One reply per lock; one error for the group, which a failover rides through.
        let (route, replies) = self.release_riding(first, route, |route, resent| {
            match on_sole(route, |node| {
                protocol.release_all(node, &keys, token, &fences, route.retry(), resent)
            }) {
                Ok(replies) => replies.into_iter().map(Ok).collect(),
                Err(e) => vec![Err(e)],
            }
        });
        locks
            .iter()
            .for_each(|lock| self.look_again_if_resent(lock, &route));
        if replies.len() != locks.len() {
            return match replies.into_iter().find_map(|r| r.err()) {
                Some(e) => Err(e),
                None => Err(Error::Protocol(
                    "multi-lock release: replies missing".to_owned(),
                )),
            };
        }
        let outcomes = replies
            .into_iter()
            .zip(lost)
            .zip(locks)
            .map(|((reply, lost), lock)| {
                let outcome = tally_release(vec![reply], !lost, 1);
                self.found_lost(lock, lost, false, &outcome);
                outcome
            });
        outcomes.fold(Ok(Unlocked::Released), worst)
    }
}

/// `f` on the node that decides alone on `route` (a multi-lock's routes have one).
fn on_sole<T>(route: &Route, f: impl FnOnce(&Node) -> Result<T>) -> Result<T> {
    match route.sole() {
        Some(node) => f(node),
        None => Err(Error::Protocol(
            "a multi-lock's route without a sole node".to_owned(),
        )),
    }
}

/// Of two outcomes of giving back parts of a multi-lock, the one to report: the first
/// error, else the worst (held by another, then expired, then released).
fn worst(a: Result<Unlocked>, b: Result<Unlocked>) -> Result<Unlocked> {
    let rank = |u: Unlocked| match u {
        Unlocked::HeldByOther => 2,
        Unlocked::Expired => 1,
        _ => 0,
    };
    match (a, b) {
        (Err(e), _) | (_, Err(e)) => Err(e),
        (Ok(a), Ok(b)) => Ok(if rank(b) > rank(a) { b } else { a }),
    }
}

/// The groups a multi-lock took so far: given back if it does not get the rest (an
/// error, a timeout, a cancel, a panic on the way).
struct Partial<'a> {
    engine: &'a Arc<Engine>,
    groups: Vec<Vec<Arc<RemoteLock>>>,
}

impl Drop for Partial<'_> {
    fn drop(&mut self) {
        for locks in std::mem::take(&mut self.groups) {
            self.engine.give_back_group(&locks);
        }
    }
}

/// One group's contest: the loop of `contest`, for a set of keys taken all or none.
struct GroupContest<'a> {
    engine: &'a Arc<Engine>,
    keys: &'a [Keys],
    /// What our contention marks carry: the group node's id of our client, and
    /// [`MARK_SUFFIX`].
    mark_id: String,
    route: Route,
    protocol: Protocol,
    wait: Wait<'a>,
    waiter: Waiter,
    /// Counted among the client's multi-locks that wait with marks (see [`Waiting`]).
    waiting: Waiting<'a>,
}

impl GroupContest<'_> {
    fn run(&mut self) -> Result<Vec<Arc<RemoteLock>>> {
        let (engine, wait) = (self.engine, self.wait);
        let (keys, deadline) = (self.keys, wait.deadline());
        let lease = engine.cfg.lease;
        // Redis Cluster: retries through a failover with the token of the attempt that
        // failed (the script recognises its own token: invariant 3).
        let mut ride = Ride::new(&engine.topology, &engine.counters);
        // The token of a failed attempt that may have run, for the retry, and whether an
        // attempt with it may have run (the retry's own failure says nothing of those).
        let mut carried: Option<(String, bool)> = None;
        let mut end = WaitEnd::new(&engine.cfg);
        let mut fresh = true;
        loop {
            if wait.cancelled() {
                // A failed attempt carried into the ride may have taken the names.
                if let Some((token, _)) = carried.take() {
                    self.release_later(token);
                }
                self.leave();
                return Err(Error::Cancelled);
            }
            // The first attempt goes where the caller's route, read just now, says.
            if !std::mem::take(&mut fresh) {
                self.waiter.follow(keys, engine, &mut self.route, deadline);
            }
            if matches!(wait, Wait::Until(..)) {
                self.waiter
                    .watch_if_subscribed(keys, engine, &self.route, deadline);
            }
            // Counters from before the attempt, only when every key's subscription is
            // confirmed: otherwise a release of one of them could go unheard.
            let before = (self.waiter.snapshots())
                .filter(|snaps| snaps.len() == keys.len() && snaps.iter().all(|s| s.confirmed));
            let leave = wait.waits_now();
            if leave {
                // Before the attempt that may mark: a multi-lock of the client leaving
                // meanwhile then leaves the mark to us.
                if !(self.waiting).join(&self.mark_id, keys, deadline, wait.cancel()) {
                    // Cancelled while a removal was on its way: the loop's check ends it.
                    continue;
                }
            }
            // Counted, the mark may be ours: left by an attempt of ours, or to us by another
            // multi-lock of the client that left.
            let marks = Marks {
                leave,
                clear: self.waiting.counted(),
            };
            let (token, ran_before) = carried.take().unwrap_or_else(|| (new_token(), false));
            // On the lease clock: the validity counts from here.
            let started = Stamp::now();
            let outcome = self.attempt(&token, marks);
            if outcome.is_ok() {
                ride.settled();
            }
            // An attempt with this token before, in a ride, may have run: it may land after
            // this one, as a first send after its retry.
            let outcome = outcome.map(|taken| taken.sent_again_if(ran_before));
            let hint = match outcome {
                Ok(Taken::All { fences, resent })
                    if lease_left(lease, started, engine.cfg.drift(lease)) =>
                {
                    return self.acquired(token, (fences, resent), started);
                }
                Ok(Taken::All { resent, .. }) => {
                    // No time left by the reply: a hold without time left is nobody's.
                    Counters::inc(&engine.counters.failed_attempts);
                    self.give_back(token, resent);
                    end.late = true;
                    Some(Duration::ZERO)
                }
                Ok(Taken::Unacked { acked, resent }) => {
                    self.give_back(token, resent);
                    end.unacked = Some(acked);
                    Some(Duration::ZERO)
                }
                Ok(Taken::Held { pttl, resent }) => {
                    if resent {
                        // The first send may still land and take them all with this
                        // token, which the next attempt does not use.
                        self.release_later(token);
                    }
                    pttl
                }
                Err(e) => {
                    let ran = ran_before || may_have_run(&e);
                    if matches!(wait, Wait::Until(..))
                        && !wait.cancelled()
                        && ride.again(&e, deadline)
                    {
                        carried = Some((token, ran));
                        continue;
                    }
                    if ran {
                        self.release_later(token);
                    }
                    if e.is_connection() {
                        self.abandon_marks();
                    } else {
                        self.leave();
                    }
                    return Err(WaitEnd::failed(&ride, wait, e));
                }
            };
            let deadline = match end.next(wait) {
                Next::Stop(e) => return Err(e),
                Next::Over(e) => {
                    self.leave();
                    return Err(e);
                }
                Next::Sleep(deadline) => deadline,
            };
            if !self.waiter.watching() {
                // Where the keys are now, which the attempt's redirects may have just told.
                self.route = engine.topology.route(&keys[0]);
                if engine.cfg.wakeup == Wakeup::Notifications {
                    // Subscribe, confirmed, then the attempt whose failure makes us wait.
                    self.waiter.watch_all(keys, engine, &self.route, deadline);
                    // No subscriber serves the route (the client shut down): the sleep
                    // below waits on timers, rather than the next attempt at once.
                    if self.waiter.watching() {
                        continue;
                    }
                }
            }
            let route = &self.route;
            self.waiter
                .sleep(&keys[0], engine, route, before, hint, deadline, |_| {});
        }
    }

    /// One all-or-nothing attempt with `token` on the group's node.
    fn attempt(&self, token: &str, marks: Marks) -> Result<Taken> {
        let engine = self.engine;
        let group = Group {
            keys: self.keys,
            token,
            lease: engine.cfg.lease,
            marks,
            mark_id: &self.mark_id,
            mark_ttl: engine.cfg.mark_ttl(),
        };
        let (route, deadline) = (&self.route, self.wait.deadline());
        on_sole(route, |node| {
            self.protocol
                .acquire_all(node, group, route.retry(), deadline)
        })
    }

    /// The group is ours: one lock per key, sharing `token`.
    fn acquired(
        &self,
        token: String,
        (fences, resent): (Vec<(u64, bool)>, bool),
        started: Stamp,
    ) -> Result<Vec<Arc<RemoteLock>>> {
        let engine = self.engine;
        if let Some((fence, _)) = fences.iter().find(|&&(f, _)| f > MAX_FENCE) {
            let e = Error::Protocol(format!("fence counter {fence} exceeds {MAX_FENCE}"));
            self.give_back(token, resent);
            return Err(e);
        }
        let nodes: Vec<_> = self.route.node_ids();
        let locks = self
            .keys
            .iter()
            .zip(fences)
            .map(|(keys, (fence, previous_lost))| {
                Counters::inc(&engine.counters.remote_acquisitions);
                let acquisition = Acquisition {
                    keys: keys.clone(),
                    protocol: self.protocol,
                    token: token.clone(),
                    fence,
                    previous_lost,
                    nodes: nodes.clone(),
                    started,
                };
                let lock = engine.new_hold(acquisition);
                lock.set_resent(resent);
                lock
            });
        Ok(locks.collect())
    }

    /// Gives back what an attempt with `token` took: now while the caller's deadline
    /// allows, else (or when that fails) in the background. `resent`: it was won by a
    /// retry, whose first send may land after this: the cleanup job looks again.
    fn give_back(&self, token: String, resent: bool) {
        if !past(self.wait.deadline()) {
            let route = &self.route;
            let released = on_sole(route, |node| {
                // Attempts nobody used: the counters say what they said before.
                let unused = vec![None; self.keys.len()];
                self.protocol
                    .release_all(node, self.keys, &token, &unused, route.retry(), false)
            });
            match released {
                Ok(_) if !resent => return,
                Ok(_) => {}
                Err(e) => log::debug!("giving back a multi-lock's group failed: {e}"),
            }
        }
        self.release_later(token);
    }

    /// Leaves the release of `token`'s locks, which an attempt whose outcome is unknown
    /// may have taken, to the cleanup job.
    fn release_later(&self, token: String) {
        let nodes: Vec<_> = self.route.node_ids();
        for keys in self.keys {
            (self.engine.cleanup).release_later(keys, self.protocol, token.clone(), nodes.clone());
        }
    }

    /// The wait ends without the locks: our contention marks go with us, but for those
    /// another multi-lock of the client still waits with. A multi-lock of the client that
    /// begins to wait on one of them meanwhile waits until they are gone.
    fn leave(&mut self) {
        let last = self.waiting.leave();
        self.remove_marks(last);
        self.waiting.removed();
    }

    /// The wait ends on a server that did not answer (or could not be reached): our
    /// contention marks are left to expire with their TTL rather than removed by one more
    /// call to the same server, which would hold the caller up past its deadline once
    /// more. Not in the background either: a removal landing late could take the marks of
    /// another multi-lock of the client that joined them meanwhile. A mark left behind
    /// only tells a holder that someone may wait.
    fn abandon_marks(&mut self) {
        self.waiting.leave();
        self.waiting.removed();
    }

    /// Removes our contention marks of the keys where `last` says we were the last of the
    /// client's multi-locks to wait with them (none if we never counted among them).
    fn remove_marks(&self, last: Vec<bool>) {
        let keys: Vec<Keys> = (self.keys.iter().zip(last))
            .filter(|&(_, last)| last)
            .map(|(k, _)| k.clone())
            .collect();
        if keys.is_empty() {
            return;
        }
        let left = on_sole(&self.route, |node| {
            (self.protocol).leave_all(node, &keys, &self.mark_id, self.wait.deadline())
        });
        if let Err(e) = left {
            log::debug!("removing a multi-lock's contention marks failed (they expire): {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A multi-lock's release reports the first error, else the worst outcome of its parts.
    #[test]
    fn the_worst_outcome_is_reported() {
        use Unlocked::*;
        let fold = |parts: Vec<Result<Unlocked>>| parts.into_iter().fold(Ok(Released), worst);
        assert_eq!(
            fold(vec![Ok(Released), Ok(Released)]).expect("ok"),
            Released
        );
        assert_eq!(fold(vec![Ok(Expired), Ok(Released)]).expect("ok"), Expired);
        assert_eq!(
            fold(vec![Ok(Expired), Ok(HeldByOther), Ok(Released)]).expect("ok"),
            HeldByOther
        );
        let e = fold(vec![
            Ok(HeldByOther),
            Err(Error::Timeout),
            Err(Error::WouldBlock),
        ]);
        assert!(matches!(e, Err(Error::Timeout)), "{e:?}");
    }
}
