//! Giving a lock back — to the next local waiter, or in Redis — and changing its lease.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::clock::{Stamp, from_now};
use crate::engine::cleanup::release_at;
use crate::engine::clock::YIELD;
use crate::engine::contest::Wait;
use crate::engine::state::Engine;
use crate::error::{Error, LostReason, Result, Unlocked};
use crate::local::held::{Changed, RemoteLock};
use crate::local::table::{Forced, Step};
use crate::local::undo::OnUnwind;
use crate::proto::keys::Keys;
use crate::proto::node::{NodeId, ReleaseReply, may_have_run};
use crate::proto::protocol::Protocol;
use crate::proto::renewal::{Change, ExtendReply};
use crate::stats::Counters;
use crate::topology::Route;
use crate::topology::ride::Ride;
use crate::topology::verdict::{Renewal, tally_release};

/// Who gives a lock back in Redis: a holder the local table knows (`forced`: why, when
/// local waiters remain), which then lets the next local waiter contend, or a detached
/// guard, which the table no longer knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Giver {
    Table { forced: Option<Forced> },
    Detached,
}

impl Engine {
    /// A holder is done: hand the lock on locally, or release it in Redis.
    pub fn release(self: &Arc<Self>, lock: &Arc<RemoteLock>) -> Result<Unlocked> {
        let route = self.topology.route(&lock.keys);
        let subs = self.subs_for(&route);
        // Looked at last, just before the table hands the lock on: a route may read the
        // slot map first (Redis Cluster), which can take a read timeout, and a lease that
        // ran out meanwhile must not be handed on as live.
        let lost = lock.lost(&self.counters).is_some();
        match self.table.release(lock, lost, &self.cfg, &subs) {
            Step::HandedOff => Ok(Unlocked::HandedOff),
            Step::Remote { forced, contended } => {
                self.release_in_redis(lock, route, Giver::Table { forced }, contended)
            }
        }
    }

    /// A lock handed to a thread queued for it whose lease ran out on its way: released
    /// in Redis, where it may still be ours, never handed on. Within a bounded `wait` the
    /// compare-and-delete is left to the cleanup thread: the thread then contends again,
    /// and a stalled server must not keep it past its deadline.
    pub(crate) fn give_back_lost(self: &Arc<Self>, lock: &Arc<RemoteLock>, wait: Wait<'_>) {
        if !wait.bounded() {
            let gave_back = self.release(lock);
            log::debug!("a lock handed on expired on its way, given back: {gave_back:?}");
            return;
        }
        let subs = self.subs_for(&self.topology.route(&lock.keys));
        if let Step::Remote { .. } = self.table.release(lock, true, &self.cfg, &subs) {
            self.abandon_release(lock, false);
            if let Some(w) = &self.watchdog {
                w.unregister(lock);
            }
        }
        log::debug!("a lock handed on expired on its way, left to the cleanup thread");
    }

    /// A detached guard is done: release its lock in Redis. The local table no longer
    /// knows it (see `Table::detach`); the process's waiters, if any, wait in Redis.
    pub(crate) fn release_detached(self: &Arc<Self>, lock: &Arc<RemoteLock>) -> Result<Unlocked> {
        let route = self.topology.route(&lock.keys);
        self.release_in_redis(lock, route, Giver::Detached, false)
    }

    /// Releases `lock` in Redis for `giver`. `contended`: another thread or process is
    /// known to want the lock, so this process's next attempt lets it go first.
    fn release_in_redis(
        self: &Arc<Self>,
        lock: &Arc<RemoteLock>,
        route: Route,
        giver: Giver,
        contended: bool,
    ) -> Result<Unlocked> {
        // A panic from here on must not leave the key marked as releasing.
        let undo = OnUnwind::new(|| self.abandon_release(lock, giver == Giver::Detached));
        if giver
            == (Giver::Table {
                forced: Some(Forced::Budget),
            })
        {
            Counters::inc(&self.counters.budget_releases);
        }
        // No renewal may be sent once this returns (a renewal racing the release
        // must not outlive it).
        let lost = lock.begin_release(&self.counters);
        if let Some(w) = &self.watchdog {
            w.unregister(lock);
        }
        crate::fault::hit(&self.cfg.key_prefix, crate::fault::Point::Release);
        let (route, replies) = self.release_everywhere(lock, route);
        let passed = replies
            .iter()
            .any(|r| matches!(r, Ok(ReleaseReply::Passed)));
        if passed {
            Counters::inc(&self.counters.grants_passed);
        }
        // With the fair queue the next process already has it: nobody to yield to.
        let grants = lock.protocol.release_may_grant();
        if contended && !grants {
            // A thread that releases and locks again would otherwise win every time:
            // its attempt reaches Redis before the waiters have heard of the release.
            let until = from_now(YIELD);
            for s in self.subs_for(&route).iter() {
                s.ask_to_yield(&lock.keys, until);
            }
        }
        undo.disarm();
        if let Giver::Table { forced } = giver {
            // With the fair queue the next process already has the lock (or will get it
            // at its next attempt): our next contender queues at once, without a pause.
            self.table
                .released(&lock.keys, forced.is_some() && contended && !grants);
        }
        let outcome = tally_release(replies, lost.is_none(), route.quorum());
        self.found_lost(lock, lost.is_some(), route.sole().is_none(), &outcome);
        self.look_again_if_resent(lock, &route);
        outcome
    }

    /// After the release of `lock`, won by a retry after a lost reply (see
    /// `RemoteLock::resent`): the first send of that attempt may still land, and take the
    /// hold again with its token, which nobody uses any more. The cleanup thread gives it
    /// back and looks again, or takes the token out of the queue (or the waiting mark) where
    /// it landed while another held the name: the next release would grant the lock to
    /// that entry, to nobody, and a writer's mark would hold new readers back for its TTL.
    /// A hold made by turning one won so does not carry the flag (the member it was won
    /// with is not the one released): its release looks again at that member (see
    /// [`Self::look_again_at_turned`]).
    pub(crate) fn look_again_if_resent(&self, lock: &RemoteLock, route: &Route) {
        if lock.resent() {
            let token = lock.token.clone();
            (self.cleanup).give_back_later(&lock.keys, lock.protocol, token, route.node_ids());
        }
        self.look_again_at_turned(lock, route);
    }

    /// After the release of `lock`: the holds it was turned from that an attempt may still
    /// take (see `RemoteLock::turned_from`) are given back by the cleanup thread, which
    /// looks again. Their members were retired by the turn, and nothing uses them now.
    pub(crate) fn look_again_at_turned(&self, lock: &RemoteLock, route: &Route) {
        for (protocol, token) in lock.turned_from() {
            (self.cleanup).give_back_later(&lock.keys, protocol, token, route.node_ids());
        }
    }

    /// Counts a hold that its release found gone or another's (`outcome`) when it was not
    /// known lost as the release began (`was_lost`): it was lost while held, unnoticed
    /// until then (its key deleted or lost in a restart between two renewals, or taken),
    /// and counts once, with the reason a renewal would have given (`redlock`: a majority
    /// lost), or `Expired` when its lease ran out while the release was under way.
    pub(crate) fn found_lost(
        &self,
        lock: &RemoteLock,
        was_lost: bool,
        redlock: bool,
        outcome: &Result<Unlocked>,
    ) {
        let other = match outcome {
            _ if was_lost => return,
            Ok(Unlocked::Expired) => false,
            Ok(Unlocked::HeldByOther) => true,
            _ => return,
        };
        let reason = if Stamp::now() >= lock.validity() {
            LostReason::Expired
        } else if redlock {
            LostReason::NoQuorum
        } else if other {
            LostReason::Stolen
        } else {
            LostReason::Deleted
        };
        self.counters.lost(reason);
    }

    /// Compare-and-delete of `lock` on every node of its route (Redlock: not only those
    /// that granted: a node whose grant came too late to count may hold our token too).
    pub(crate) fn release_everywhere(
        self: &Arc<Self>,
        lock: &RemoteLock,
        route: Route,
    ) -> (Route, Vec<Result<ReleaseReply>>) {
        self.release_riding(lock, route, |route, resent| {
            let (keys, token, retry) = (&lock.keys, lock.token.as_str(), route.retry());
            release_at(
                &self.topology,
                keys,
                route.nodes(),
                retry,
                lock.protocol,
                token,
                Some(lock.fence),
                (resent, None),
            )
        })
    }

    /// Runs `release` (one reply per node of the route it is given) on `route`, then on
    /// the route read afresh each time it is retried through a failover (Redis Cluster,
    /// Sentinel), until `lock`'s validity ends: its key is gone by then anyway. A retry
    /// that finds the key gone, or another token in it, after a try whose reply was lost
    /// says so (`GoneAfterRetry`, `OtherAfterRetry`): that try may have deleted it or
    /// passed it on. `release`'s second argument says that a try before may have run: the
    /// release is then sent in its retry form, which reads the fence counter when it finds
    /// the key gone and says `NotReleased` when no try of ours released it (see
    /// `scripts::RELEASE`, "A retry"), as a node's own retry after a lost reply does.
    pub(crate) fn release_riding(
        &self,
        lock: &RemoteLock,
        route: Route,
        mut release: impl FnMut(&Route, bool) -> Vec<Result<ReleaseReply>>,
    ) -> (Route, Vec<Result<ReleaseReply>>) {
        let mut ride = Ride::new(&self.topology, &self.counters);
        let mut ran = false;
        let mut route = Some(route);
        loop {
            // The first try where the caller's route says; a retry where the key is now.
            let route = route
                .take()
                .unwrap_or_else(|| self.topology.route(&lock.keys));
            let mut replies = release(&route, ran);
            if ran {
                for r in replies.iter_mut().flatten() {
                    *r = r.as_retried();
                }
            }
            match replies.as_slice() {
                [Err(e)] if ride.again(e, Some(lock.valid_until())) => ran |= may_have_run(e),
                _ => return (route, replies),
            }
        }
    }

    /// Sets the lock's lease to `lease` on its nodes now. Redis Cluster: retried through a
    /// failover until the lock's validity ends. The validity follows the rule of lease
    /// changes (see `renewal::EXTEND`): applied, `sent at + lease − drift`; unknown (an
    /// error is returned), at most that.
    pub fn extend(self: &Arc<Self>, lock: &Arc<RemoteLock>, lease: Duration) -> Result<()> {
        if let Some(reason) = lock.lost(&self.counters) {
            return Err(Error::Lost(reason));
        }
        let drift = self.cfg.drift(lease);
        // Sent times are on the lease clock: the validity counts from them.
        let began = Stamp::now();
        let seq = lock.begin_extend();
        // `begin_extend` may have waited for a renewal in flight: the hold may have been
        // lost, or reached its cap, meanwhile. A fresh lease for it would let its holder
        // go on past that; nothing is sent, and the lease is as the renewal left it.
        if let Some(reason) = lock.lost(&self.counters) {
            lock.cancel_extend();
            return Err(Error::Lost(reason));
        }
        let unknown = |sent: Stamp| Changed::Unknown {
            cap: sent + lease - drift,
            retry_at: Stamp::now() + self.cfg.renew_retry(),
        };
        // A panic after the change was sent: it may have been applied.
        let undo = OnUnwind::new(|| lock.end_extend(lease, unknown(began), &self.counters));
        let mut ride = Ride::new(&self.topology, &self.counters);
        let (started, replies, verdict) = loop {
            let started = Stamp::now();
            // The change may land as soon as it is sent: a shorter lease is believed from
            // then on, not only once its outcome is known (the validity is shared with the
            // watchdog while this call waits for the reply). A longer one changes nothing
            // until it is applied.
            lock.cap_validity(started + lease - drift);
            let route = self.topology.route(&lock.keys);
            let holders = route.holders(&lock.nodes);
            let l = lock.clone();
            // Every try is the same change (the same number): a retry of one that was
            // applied is applied again, never refused.
            // Redlock: decided as soon as a majority's replies decide it, as a renewal is;
            // a node that hangs is not waited for (its change, if it lands, is this one).
            let n = holders.len();
            let replies = self.topology.fan_out_until(
                &holders,
                move |node| {
                    let change = Change {
                        key: l.keys.lock(),
                        record: l.keys.lease(),
                        token: l.token.as_str(),
                        seq,
                    };
                    node.extend(&[change], lease)
                },
                |so_far| {
                    route.renewal(tally_extends(so_far.iter().flatten()), n) != Renewal::Unknown
                },
            );
            let replies: Vec<Result<Vec<ExtendReply>>> = replies
                .into_iter()
                .map(|r| {
                    r.unwrap_or_else(|| Err(Error::Protocol("extend: no reply yet".to_owned())))
                })
                .collect();
            let verdict = route.renewal(tally_extends(replies.iter()), replies.len());
            match (verdict, replies.as_slice()) {
                (Renewal::Unknown, [Err(e)]) if ride.again(e, Some(lock.valid_until())) => {}
                _ => break (started, replies, verdict),
            }
        };
        undo.disarm();
        let outcome = match verdict {
            Renewal::Renewed => Changed::Applied {
                valid_until: started + lease - drift,
                next_renew: started + self.cfg.renew_every(lease),
            },
            Renewal::Lost(reason) => Changed::Lost(reason),
            Renewal::Unknown => unknown(started),
        };
        lock.end_extend(lease, outcome, &self.counters);
        if let Some(w) = &self.watchdog {
            // Renewed: the new renew time; unknown: a renewal soon, or the lost signal when
            // the capped validity ends first.
            w.reschedule(lock.next_due());
        }
        match verdict {
            Renewal::Renewed => return Ok(()),
            Renewal::Lost(reason) => return Err(Error::Lost(reason)),
            Renewal::Unknown => {}
        }
        match replies.into_iter().find_map(|r| r.err()) {
            Some(e) => Err(e),
            None => Err(Error::Protocol(
                "extend: no answer (a newer change of the lease was applied)".to_owned(),
            )),
        }
    }

    /// Redlock: raises the fencing counter of the granting nodes that are behind to
    /// `fence`, the highest among them, before the lock is used. Any later majority
    /// overlaps the nodes whose counter is now at least `fence` in at least one node, as
    /// long as they are a majority: the next holder's token is then higher, even though
    /// the nodes' counters drift apart. Returns how many of `behind` were raised (a raise
    /// whose reply was lost counts as not raised); the caller hands the hold out only when
    /// those and the granting nodes already at `fence` are a majority. A node that
    /// restarts empty later weakens that promise: see the crate docs. Within the caller's
    /// `deadline`, if any: a raise not done by then counts as not raised.
    pub(crate) fn raise_fences(
        self: &Arc<Self>,
        keys: &Keys,
        route: &Route,
        fence: u64,
        behind: &[NodeId],
        deadline: Option<Instant>,
    ) -> usize {
        let k = keys.clone();
        let replies = self.topology.fan_out(&route.among(behind), move |node| {
            node.raise_fence(&k, fence, deadline)
        });
        let mut raised = 0;
        for r in replies {
            match r {
                Ok(()) => raised += 1,
                Err(e) => log::debug!("raising a fence counter failed: {e}"),
            }
        }
        raised
    }

    /// Removes our contention mark on every node of the route (best effort).
    pub(crate) fn unmark(
        self: &Arc<Self>,
        keys: &Keys,
        route: &Route,
        protocol: Protocol,
        deadline: Option<Instant>,
    ) {
        let k = keys.clone();
        for r in self.topology.fan_out(route.nodes(), move |node| {
            protocol.unmark(node, &k, deadline)
        }) {
            if let Err(e) = r {
                log::debug!("removing a contention mark failed: {e}");
            }
        }
    }
}

/// (extended, gone, other owner) among the replies of an extend's nodes.
fn tally_extends<'a>(
    replies: impl Iterator<Item = &'a Result<Vec<ExtendReply>>> + Clone,
) -> (usize, usize, usize) {
    let count = |want: ExtendReply| {
        replies
            .clone()
            .filter(|r| matches!(r, Ok(v) if v.first() == Some(&want)))
            .count()
    };
    (
        count(ExtendReply::Extended),
        count(ExtendReply::Gone),
        count(ExtendReply::Other),
    )
}
