//! The contender: the one thread of a process (per key) that talks to Redis to take a lock,
//! and the loop that decides when it tries again.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::clock::Stamp;
use crate::engine::ride::Ride;
use crate::engine::state::Engine;
use crate::engine::waiter::{Pending, Waiter};
use crate::error::{Error, Result};
use crate::fencing::MAX_FENCE;
use crate::local::held::{Acquisition, RemoteLock};
use crate::local::undo::OnUnwind;
use crate::proto::keys::Keys;
use crate::proto::lock_protocol::Exit;
use crate::proto::node::{Attempt, Marks, NodeId, may_have_run, new_token};
use crate::stats::Counters;
use crate::topology::Route;
use crate::topology::verdict::{Rules, Undo, Vote, lease_left, vote};
use crate::wake::early::Shot;

/// The outcome of one round of attempts.
enum Round {
    Acquired(Arc<RemoteLock>),
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

/// The caller's wait policy.
#[derive(Clone, Copy)]
pub(crate) enum Wait {
    No,
    Until(Option<Instant>),
}

impl Wait {
    pub fn deadline(self) -> Option<Instant> {
        match self {
            Wait::No => None,
            Wait::Until(d) => d,
        }
    }
}

impl Engine {
    /// Redis Cluster: the key's slot moved (a reshard, a failover) since the last attempt.
    /// Subscribes on its new master, confirmed, before the attempt, as after a reconnect:
    /// events there were not heard. The old master may have said so (it dropped the key's
    /// shard channel) before our slot map knows: has the map read again first.
    pub(crate) fn follow(
        self: &Arc<Self>,
        keys: &Keys,
        route: &mut Route,
        waiter: &mut Waiter,
        deadline: Option<Instant>,
    ) {
        let moved = waiter.moved();
        if moved {
            route.nodes().iter().for_each(|n| n.slot_moved());
        }
        let now = self.topology.route(keys);
        if moved && now.same_nodes(route) {
            // The map does not know the new master yet (it is read at most every 100 ms):
            // this attempt's redirect will tell it. Watch there after the attempt, before
            // sleeping.
            waiter.unwatch();
        } else if moved || !now.same_nodes(route) {
            *route = now;
            if waiter.watching() {
                waiter.watch(keys, self, route, deadline);
            }
        }
    }

    /// Contends in Redis until the lock is ours, the wait policy says stop, or an error.
    pub(crate) fn contend(
        self: &Arc<Self>,
        keys: &Keys,
        wait: Wait,
        yield_first: bool,
    ) -> Result<Arc<RemoteLock>> {
        let mut route = self.topology.route(keys);
        let mut waiter = Waiter::new();
        // Fair queue: one token for the whole wait, so that our place in the queue, and a
        // grant to it, survive from one attempt to the next.
        let token = route
            .protocol()
            .keeps_token_across_attempts()
            .then(new_token);
        if let Some(t) = &token {
            waiter.await_grant(t);
        }
        // A panic in this loop must not leave our entry in the queue, nor a grant to it.
        // (Every normal way out leaves the queue itself, or holds the lock.)
        let _unwinding = OnUnwind::new(|| {
            if !std::thread::panicking() {
                return;
            }
            let Some(t) = &token else { return };
            let route = self.topology.route(keys);
            for node in route.nodes() {
                if let Err(e) = route.protocol().leave(node, keys, t) {
                    log::debug!("leaving the queue after a panic failed (the entry expires): {e}");
                }
            }
        });
        if !self.subs.is_empty() {
            let asked: Vec<Option<(Instant, u64)>> = self
                .subs_for(&route)
                .iter()
                .map(|s| s.should_yield(keys))
                .collect();
            if yield_first || asked.iter().any(Option::is_some) {
                waiter.yield_to_others(keys, wait.deadline(), self, &route, &asked);
            }
        }
        let mut marked = false;
        // Redis Cluster: retries through a failover, and the token of a failed attempt
        // that may have run, for the retry (one token, one lock: invariant 3).
        let mut ride = Ride::new(&self.topology, &self.counters);
        let mut carried: Option<String> = None;
        // The last attempt's replica acknowledgements, when too few: the error to give if
        // the caller's wait ends before one has enough.
        let mut unacked: Option<usize> = None;
        // The last attempt won a lease that had run out by the reply: `try_lock` then
        // says the time ran out, not that someone else holds the lock.
        let mut late = false;
        let wanted = self.cfg.replica_ack.map_or(0, |(n, _)| n);
        let short = |acked: Option<usize>, otherwise: Error| match acked {
            Some(acked) => Error::ReplicaAck { acked, wanted },
            None => otherwise,
        };
        loop {
            // Fair queue: a release granted us the lock. The attempt below confirms it: it
            // finds our token in the key and returns the fence counter as it is now, its
            // lease counted from this round trip. The message alone proves neither: it may
            // have come after the grant's short lease ran out (a slow network, a stopped
            // process), or be an older grant than the one the key holds now.
            if waiter.take_grant() {
                Counters::inc(&self.counters.grants_received);
            }
            // An attempt that will wait if it fails marks contention for the holder. The
            // script deletes our mark when we win; when we leave without the lock, we take
            // it with us, so that no holder keeps yielding to nobody.
            let (before, marks, outcome) = match waiter.take_early() {
                // The subscriber sent our attempt when the key was freed.
                Some((shot, pending)) => (
                    Some(vec![shot.at]),
                    pending.marks,
                    self.finish_early(keys, &route, shot, pending, wait.deadline()),
                ),
                None => {
                    self.follow(keys, &mut route, &mut waiter, wait.deadline());
                    let before = waiter.snapshots();
                    let waiting = match wait {
                        Wait::No => false,
                        Wait::Until(d) => d.is_none_or(|d| Instant::now() < d),
                    };
                    let marks = Marks {
                        leave: waiting,
                        clear: marked,
                    };
                    let token = token.as_deref().or(carried.as_deref());
                    (
                        before,
                        marks,
                        self.round(keys, &route, marks, wait.deadline(), token),
                    )
                }
            };
            if !matches!(outcome, Ok(Round::Failed { .. })) {
                ride.settled();
                carried = None;
            }
            let hint = match outcome {
                Ok(Round::Acquired(lock)) => return Ok(lock),
                Ok(Round::Held(hint)) => {
                    marked |= marks.leave;
                    hint
                }
                Ok(Round::Unacked(acked)) => {
                    unacked = Some(acked);
                    // Our own release of it wakes us: try again at once.
                    Some(Duration::ZERO)
                }
                Ok(Round::Late) => {
                    late = true;
                    Some(Duration::ZERO)
                }
                Ok(Round::Failed {
                    error,
                    token: tried,
                    undo,
                }) => {
                    // An attempt whose reply was lost may have left our mark (or queue
                    // entry): take it with us if we leave.
                    marked |= marks.leave && may_have_run(&error);
                    // A wait rides through a failover (`try_lock` does not wait); the next
                    // attempt reads the route again, and watches there if it moved.
                    if matches!(wait, Wait::Until(_)) && ride.again(&error, wait.deadline()) {
                        carried = Some(tried);
                        continue;
                    }
                    // Fair queue: the leave below frees a lock that the lost attempt may
                    // have taken with our token; without one (the caller did not wait, so
                    // it is not queued) the undo releases it.
                    self.undo(keys, &route, tried, undo, wait.deadline(), marked);
                    self.leave_queue(keys, &route, token.as_deref(), marked);
                    // The caller's deadline passed while its master was being replaced:
                    // that is a timeout, like a lock held until then.
                    if ride.retried() && wait.deadline().is_some_and(|d| Instant::now() >= d) {
                        log::debug!("deadline passed during a failover: {error:?}");
                        return Err(Error::Timeout);
                    }
                    return Err(error);
                }
                Err(e) => {
                    self.leave_queue(keys, &route, token.as_deref(), marked);
                    return Err(e);
                }
            };
            let deadline = match wait {
                Wait::No if late => return Err(Error::Timeout),
                Wait::No => return Err(short(unacked, Error::WouldBlock)),
                Wait::Until(d) => d,
            };
            if deadline.is_some_and(|d| Instant::now() >= d) {
                // A grant heard at the deadline: one more attempt confirms (and takes) it.
                if waiter.take_grant() {
                    Counters::inc(&self.counters.grants_received);
                    continue;
                }
                self.leave_queue(keys, &route, token.as_deref(), marked);
                return Err(short(unacked, Error::Timeout));
            }
            crate::fault::hit(&self.cfg.key_prefix, crate::fault::Point::Contend);
            if !waiter.watching() {
                // The sleep only subscribes (and the next attempt follows): where the key
                // is now, which the attempt's redirects may have just told.
                route = self.topology.route(keys);
            }
            waiter.sleep(keys, self, &route, before, hint, deadline, |w| {
                w.arm(keys, self, &route, marked, deadline);
            });
        }
    }

    /// One attempt on every node of the route, judged by the topology.
    fn round(
        self: &Arc<Self>,
        keys: &Keys,
        route: &Route,
        marks: Marks,
        deadline: Option<Instant>,
        token: Option<&str>,
    ) -> Result<Round> {
        let token = token.map_or_else(new_token, str::to_owned);
        let lease = self.cfg.lease;
        // On the lease clock: the validity counts from here.
        let started = Stamp::now();
        let retry = route.retry();
        let protocol = route.protocol();
        let replies = match route.sole() {
            // One node: no closure to share with other threads, nothing to clone.
            Some(node) => vec![(
                node.id.clone(),
                protocol.acquire(node, keys, &token, lease, retry, marks, deadline),
            )],
            None => {
                let (k, t) = (keys.clone(), token.clone());
                self.topology.fan_out(route.nodes(), move |node| {
                    let reply = protocol.acquire(node, &k, &t, lease, retry, marks, deadline);
                    (node.id.clone(), reply)
                })
            }
        };
        self.judge(keys, route, token, started, replies, deadline)
    }

    /// Reads the reply to the attempt the subscriber sent for us (the route's sole node).
    fn finish_early(
        self: &Arc<Self>,
        keys: &Keys,
        route: &Route,
        shot: Shot,
        pending: Pending,
        deadline: Option<Instant>,
    ) -> Result<Round> {
        let Some(node) = route.sole() else {
            return Err(Error::Protocol(
                "early attempt without a sole node".to_owned(),
            ));
        };
        let reply = route.protocol().finish_acquire(
            node,
            shot.reply,
            &pending.call,
            route.retry(),
            deadline,
        );
        let replies = vec![(node.id.clone(), reply)];
        let sent = Stamp::from_instant(shot.sent);
        self.judge(keys, route, pending.token, sent, replies, deadline)
    }

    /// Acts on the topology's verdict on a round's replies.
    fn judge(
        self: &Arc<Self>,
        keys: &Keys,
        route: &Route,
        token: String,
        started: Stamp,
        replies: Vec<(NodeId, Result<Attempt>)>,
        deadline: Option<Instant>,
    ) -> Result<Round> {
        let lease = self.cfg.lease;
        let rules = Rules {
            quorum: route.quorum(),
            sole: route.sole().is_some(),
            valid: lease_left(lease, started, self.cfg.drift(lease)),
            jitter: Duration::from_millis(rand::random_range(2..=25)),
        };
        let unacked = replies
            .iter()
            .filter_map(|(_, r)| match r {
                Ok(Attempt::Unacked { acked }) => Some(*acked),
                _ => None,
            })
            .min();
        let verdict = vote(replies, rules);
        match verdict {
            Vote::Won {
                fence,
                granted,
                behind,
            } => {
                // Redlock: only nodes behind need it; with counters in step there is no
                // extra round trip.
                if !behind.is_empty() {
                    self.raise_fences(keys, route, fence, &behind);
                }
                self.acquired(keys, route, token, fence, granted, started)
            }
            Vote::Held { hint, undo } => {
                // Fair queue: the next attempt, or the leave, uses the same token.
                self.undo(keys, route, token, undo, deadline, true);
                Ok(match unacked {
                    Some(acked) => Round::Unacked(acked),
                    None => Round::Held(hint),
                })
            }
            Vote::Failed { error, undo } => Ok(Round::Failed { error, token, undo }),
            Vote::Late { undo } => {
                Counters::inc(&self.counters.failed_attempts);
                // Given back whatever comes next: a lock without time left is nobody's.
                self.undo(keys, route, token, undo, deadline, false);
                Ok(Round::Late)
            }
        }
    }

    /// Releases our token where a lost round left it: on the nodes that granted while the
    /// deadline allows, and without waiting where the outcome is unknown, so that no stray
    /// key outlives the call by long and the caller's deadline is kept. `reused`: a later
    /// call of this wait uses the token again (fair queue: the next attempt, or the leave),
    /// which settles an unknown outcome when the protocol says so.
    fn undo(
        self: &Arc<Self>,
        keys: &Keys,
        route: &Route,
        token: String,
        mut undo: Undo,
        deadline: Option<Instant>,
        reused: bool,
    ) {
        if undo.is_empty() {
            return;
        }
        if reused && route.protocol().next_call_settles_unknown() {
            // Fair queue: the next attempt finds the token in the key if it is ours, and
            // the leave passes such a lock on: only a lock taken without enough replicas
            // is given back now. A caller that neither attempts again nor leaves (a
            // `try_lock`) releases it like any other.
            undo.unknown.clear();
        }
        if !undo.granted.is_empty() && deadline.is_none_or(|d| Instant::now() < d) {
            self.release_on(keys, route, &token, &undo.granted);
            undo.granted.clear();
        }
        undo.unknown.append(&mut undo.granted);
        if !undo.unknown.is_empty() {
            // Not waited for: one bounded worker per client (see `cleanup`).
            self.cleanup.release_later(keys, token, undo.unknown);
        }
    }

    /// The wait ends without the lock: leave the fair queue (passing on a grant that
    /// raced us), or take our contention mark with us.
    fn leave_queue(
        self: &Arc<Self>,
        keys: &Keys,
        route: &Route,
        token: Option<&str>,
        marked: bool,
    ) {
        if !marked {
            return;
        }
        let protocol = route.protocol();
        match (protocol.exit(), token) {
            (Exit::Leave, Some(token)) => {
                Counters::inc(&self.counters.queue_departures);
                // One node: a queue lives where one node decides alone.
                for node in route.nodes() {
                    match protocol.leave(node, keys, token) {
                        Ok(true) => Counters::inc(&self.counters.grants_passed),
                        Ok(false) => {}
                        Err(e) => {
                            // A grant to us (or a lock a lost attempt took) may be left: the
                            // cleanup job releases it; the entry expires.
                            log::debug!(
                                "leaving the queue failed: {e}; released in the background"
                            );
                            self.cleanup.release_later(
                                keys,
                                token.to_owned(),
                                vec![node.id.clone()],
                            );
                        }
                    }
                }
            }
            _ => self.unmark(keys, route),
        }
    }

    fn acquired(
        self: &Arc<Self>,
        keys: &Keys,
        route: &Route,
        token: String,
        fence: u64,
        nodes: Vec<NodeId>,
        started: Stamp,
    ) -> Result<Round> {
        if fence > MAX_FENCE {
            self.release_on(keys, route, &token, &nodes);
            return Err(Error::Protocol(format!(
                "fence counter {fence} exceeds {MAX_FENCE}"
            )));
        }
        let lease = self.cfg.lease;
        let lock = Arc::new(RemoteLock::new(
            Acquisition {
                keys: keys.clone(),
                token,
                fence,
                nodes,
                started,
            },
            lease,
            self.cfg.drift(lease),
            self.cfg.auto_renew.then(|| self.cfg.renew_every(lease)),
        ));
        Counters::inc(&self.counters.remote_acquisitions);
        Ok(Round::Acquired(lock))
    }
}
