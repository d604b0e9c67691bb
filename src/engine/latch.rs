//! Countdown latches: counting down, reading the count, and waiting for it to reach zero.
//!
//! A latch is not a hold, so it does not go through the contest: there is nothing to take,
//! renew, give back or leave, no token, fence or lease, and a wait that ends has nothing
//! to hand a guard. What a latch waiter shares with a contender is the wait between two
//! reads, the [`Waiter`]: it watches the name before the read whose answer makes it wait
//! (the first invariant: subscribe before the attempt that makes you wait), hears the
//! latch's `z` message ([`Hears::Zero`]), and reads again on each wake-up, at its re-check
//! and when the latch's key would expire, so a lost message costs a re-check, never a
//! hang. Its reads carry the id of the latch they found first, so that a latch that expired
//! (and maybe was made again by someone else's call) ends the wait with
//! [`Error::LatchExpired`] instead of a wait for a count nobody lowers any more.

use crate::engine::contest::{Wait, WaitEnd};
use crate::engine::state::Engine;
use crate::engine::waiter::Waiter;
use crate::error::{Error, Result};
use crate::proto::keys::Keys;
use crate::proto::latch_scripts::{MAX_COUNT, Op, State};
use crate::proto::node::{Retry, may_have_run, past};
use crate::stats::Counters;
use crate::topology::Route;
use crate::topology::is_read_only;
use crate::topology::ride::Ride;
use crate::wake::events::Hears;

impl Engine {
    /// Counts the latch `name` of `count` down by one; the count left.
    pub(crate) fn latch_count_down(&self, name: &[u8], count: u64) -> Result<u64> {
        let keys = latch_keys(&self.cfg.key_prefix, name, count)?;
        let left = self.latch_call(&keys, count, Op::CountDown)?.left;
        if left == 0 {
            log::debug!("latch {} is open", keys.display());
            self.latch_republish_open(&keys);
        }
        Ok(left)
    }

    /// Redis Cluster with shard channels: says `z` again where the name's channel is
    /// served. A count down that followed an `ASK` (its slot half-way to another master,
    /// the latch's key moved already) ran, and published, on the target, while the
    /// source serves the slot's shard channels until the slot has moved: the waiters,
    /// subscribed there, would hear nothing until their re-check. A waiter that heard the
    /// first `z` loses a read to the second at most. Best effort: the count down is done.
    fn latch_republish_open(&self, keys: &Keys) {
        if self.cfg.cluster.is_empty() {
            return;
        }
        let route = self.topology.route(keys);
        let Some(node) = route.sole() else {
            return;
        };
        if !node.publish_mode(None).is_ok_and(|mode| mode == "s") {
            // Classic messages reach every node of the cluster (and a node that cannot
            // be asked would not take the message either).
            return;
        }
        let published = node.run(Retry::NEVER, |c| {
            redis::cmd("SPUBLISH")
                .arg(keys.channel())
                .arg("z")
                .query::<i64>(c)
        });
        if let Err(e) = published {
            log::debug!("latch {}: `z` not published again: {e}", keys.display());
        }
    }

    /// The count left of the latch `name` of `count`.
    pub(crate) fn latch_count(&self, name: &[u8], count: u64) -> Result<u64> {
        let keys = latch_keys(&self.cfg.key_prefix, name, count)?;
        Ok(self.latch_call(&keys, count, Op::Read { seen: None })?.left)
    }

    /// Waits until the latch `name` of `count` is open, as `wait` says. A wait cancelled
    /// before the call sends nothing; one that times out is counted in `timeouts`.
    pub(crate) fn latch_wait(&self, name: &[u8], count: u64, wait: Wait<'_>) -> Result<()> {
        if wait.cancelled() {
            return Err(Error::Cancelled);
        }
        // A slot map read on the way ends by the caller's deadline (Redis Cluster).
        let waited = crate::topology::with_caller_deadline(wait.deadline(), || {
            self.latch_wait_reading(name, count, wait)
        });
        if matches!(waited, Err(Error::Timeout)) {
            Counters::inc(&self.counters.timeouts);
        }
        waited
    }

    /// The reads and sleeps of [`latch_wait`](Self::latch_wait).
    fn latch_wait_reading(&self, name: &[u8], count: u64, wait: Wait<'_>) -> Result<()> {
        let keys = latch_keys(&self.cfg.key_prefix, name, count)?;
        let deadline = wait.deadline();
        let mut waiter = Waiter::hearing(Hears::Zero);
        if let Some(cancel) = wait.cancel() {
            waiter.cancel_with(cancel);
        }
        let mut ride = Ride::new(&self.topology, &self.counters);
        let mut route = self.topology.route(&keys);
        // The latch this wait found first: a later read never makes it again.
        let mut seen: Option<String> = None;
        loop {
            // Redis Cluster: the name's slot moved (its old master dropped the channel, or
            // the map says so). Watch where it is now, confirmed, before the next read
            // that makes us wait, as after a reconnect.
            if waiter.moved() {
                route.nodes().iter().for_each(|n| n.slot_moved());
                waiter.unwatch();
            }
            let now = self.topology.route(&keys);
            if !now.same_nodes(&route) {
                waiter.unwatch();
                route = now;
            }
            waiter.watch_if_subscribed(std::slice::from_ref(&keys), self, &route, deadline);
            let before = waiter.snapshots();
            let read = Op::Read {
                seen: seen.as_deref(),
            };
            let state = match self.latch_on(&route, &keys, count, read, deadline) {
                Ok(state) => {
                    ride.settled();
                    state
                }
                // Cancelled while the read was under way (a stalled server's read ends
                // only at its timeout): the cancel is the answer, not how the read ended.
                Err(_) if wait.cancelled() => return Err(Error::Cancelled),
                Err(e) if ride.again(&e, deadline) => continue,
                Err(e) => {
                    if e.is_latch_expired() {
                        log::debug!("latch {} expired while waited on", keys.display());
                    }
                    // A read cut by the deadline, or a failover that outlasted it, ends
                    // the wait as the deadline does.
                    return Err(WaitEnd::failed(&ride, wait, e));
                }
            };
            if state.left == 0 {
                return Ok(());
            }
            seen = Some(state.id);
            if wait.cancelled() {
                return Err(Error::Cancelled);
            }
            if past(deadline) {
                return Err(Error::Timeout);
            }
            if !waiter.watching() {
                // The sleep only subscribes, where the name is now, and the next read
                // follows.
                route = self.topology.route(&keys);
            }
            waiter.sleep(&keys, self, &route, before, state.ttl, deadline, |_| {});
            // Cancelled while asleep: no new read.
            if wait.cancelled() {
                return Err(Error::Cancelled);
            }
        }
    }

    /// `op` on the latch `keys`, riding through a failover (Redis Cluster, Sentinel) when
    /// the call is a read or surely did not count: a count down whose reply was lost is
    /// not sent again, since a second one would count twice, while one a demoted master
    /// refused (`READONLY`) wrote nothing there and is sent where the master is now.
    fn latch_call(&self, keys: &Keys, count: u64, op: Op<'_>) -> Result<State> {
        let mut ride = Ride::new(&self.topology, &self.counters);
        loop {
            let route = self.topology.route(keys);
            match self.latch_on(&route, keys, count, op, None) {
                Err(e)
                    if (matches!(op, Op::Read { .. }) || !may_have_run(&e) || is_read_only(&e))
                        && ride.again(&e, None) => {}
                other => return other,
            }
        }
    }

    /// `op` on the node of `route` that decides alone: Redlock has none, and independent
    /// masters cannot share one count.
    fn latch_on(
        &self,
        route: &Route,
        keys: &Keys,
        count: u64,
        op: Op<'_>,
        deadline: Option<std::time::Instant>,
    ) -> Result<State> {
        let Some(node) = route.sole() else {
            return Err(Error::Unsupported(
                "countdown latches need a single node (not Redlock)",
            ));
        };
        node.latch(keys, count, self.cfg.latch_ttl, op, route.retry(), deadline)
    }
}

/// The keys of the latch `name` of `count`, checked before anything is sent.
fn latch_keys(prefix: &str, name: &[u8], count: u64) -> Result<Keys> {
    if !(1..=MAX_COUNT).contains(&count) {
        return Err(Error::InvalidArgument(format!(
            "latch count {count} outside 1..={MAX_COUNT}"
        )));
    }
    Keys::new(prefix, name)
}
