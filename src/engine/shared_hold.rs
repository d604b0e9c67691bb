//! Read-write locks and semaphores in Redis: taking a shared hold (the same wait as the
//! lock's: subscribe before the attempt that makes us wait, then sleep until an event, the
//! obstacle's lease, the re-check ceiling or the deadline), semaphore permits, and giving
//! holds back. How a process's threads share its read-write holds is in `turns`.

use std::sync::Arc;
use std::time::Instant;

use crate::clock::Stamp;
use crate::engine::contend::Wait;
use crate::engine::ride::Ride;
use crate::engine::state::Engine;
use crate::engine::waiter::Waiter;
use crate::error::{Error, Result, Unlocked};
use crate::fencing::MAX_FENCE;
use crate::local::held::{Acquisition, HoldKind, RemoteLock};
use crate::local::undo::OnUnwind;
use crate::proto::keys::Keys;
use crate::proto::node::{Node, may_have_run, new_token};
use crate::proto::rw_scripts::{SharedAttempt, Want};
use crate::stats::Counters;
use crate::topology::Route;
use crate::topology::verdict::{lease_left, tally_release};
use crate::wake::events::Hears;

/// A hold as a guard keeps it: the remote hold (maybe shared with other local threads),
/// the guard's id among its users, and the guard's fencing token.
pub(crate) struct Hold {
    pub remote: Arc<RemoteLock>,
    pub sharer: u64,
    pub token: u64,
}

impl Engine {
    /// Takes one permit of the semaphore `name` of `permits` permits.
    pub(crate) fn permit(self: &Arc<Self>, name: &[u8], permits: u32, wait: Wait) -> Result<Hold> {
        let keys = Keys::new(&self.cfg.key_prefix, name)?;
        if permits == 0 {
            return Err(Error::InvalidConfig(
                "a semaphore needs at least one permit".to_owned(),
            ));
        }
        // One local thread at a time waits for a permit in Redis (the others wait for it to
        // get one): a freed permit wakes one attempt per process, not one per thread. While
        // it waits, no permit is free, so the others lose nothing by waiting here.
        let queued = self.cfg.local_handoff && matches!(wait, Wait::Until(_));
        if queued {
            let mut st = self.shares.state.lock();
            while st.permit_contenders.contains(&keys) {
                self.await_change(&mut st, wait.deadline())?;
            }
            st.permit_contenders.insert(keys.clone());
        }
        // The next local waiter's turn, however this attempt ends (a panic included).
        let _next = queued.then(|| {
            OnUnwind::new(|| {
                self.shares.state.lock().permit_contenders.remove(&keys);
                self.shares.changed.notify_all();
            })
        });
        Ok(Hold {
            remote: self.acquire_shared(&keys, Want::Permit(permits), wait)?.0,
            sharer: 0,
            token: 0,
        })
    }

    /// Ends a shared hold in Redis. No renewal is sent once this returns.
    pub(crate) fn release_shared(self: &Arc<Self>, remote: &Arc<RemoteLock>) -> Result<Unlocked> {
        let lost = remote.begin_release(&self.counters);
        if let Some(w) = &self.watchdog {
            w.unregister(remote);
        }
        let (route, replies) =
            self.release_riding(remote, |route| {
                vec![sole(route).and_then(|node| {
                    node.release_shared(&remote.keys, &remote.token, route.retry())
                })]
            });
        tally_release(replies, lost.is_none(), route.quorum())
    }

    /// Contends for a shared hold until it is ours, the wait policy says stop, or an error.
    /// One member (tag and token) for the whole call: a retry after a lost reply, or after
    /// a wait, finds its own hold. With the hold: whether another process may wait, for a
    /// write hold.
    pub(crate) fn acquire_shared(
        self: &Arc<Self>,
        keys: &Keys,
        want: Want,
        wait: Wait,
    ) -> Result<(Arc<RemoteLock>, bool)> {
        let mut route = self.topology.route(keys);
        sole(&route)?;
        let member = format!("{}{}", want.tag(), new_token());
        let lease = self.cfg.lease;
        let mut waiter = Waiter::hearing(Hears::Releases);
        if want == Want::Write {
            // The last hold's release wakes the writer waiting longest by its member.
            waiter.await_grant(&member);
        }
        let mut marked = false;
        let mut ride = Ride::new(&self.topology, &self.counters);
        loop {
            self.follow(keys, &mut route, &mut waiter, wait.deadline());
            if matches!(wait, Wait::Until(_)) {
                waiter.watch_if_subscribed(keys, self, &route, wait.deadline());
            }
            let node = sole(&route)?;
            // A writer's wake-up is only that: this attempt takes the lock if it is free.
            waiter.take_grant();
            let before = waiter.snapshots();
            let deadline = wait.deadline();
            let waiting = matches!(wait, Wait::Until(d) if d.is_none_or(|d| Instant::now() < d));
            let marks = matches!(want, Want::Read | Want::Write);
            let mark_ttl = (waiting && marks).then(|| self.cfg.mark_ttl());
            // On the lease clock: the validity counts from here.
            let started = Stamp::now();
            let reply = node.acquire_shared(
                keys,
                want,
                &member,
                lease,
                mark_ttl,
                route.retry(),
                deadline,
            );
            let hint = match reply {
                // Taken, but with no validity left by the reply (a stall longer than the
                // lease): no guard is born dead. Given back; tried again at once.
                Ok(SharedAttempt::Acquired { .. })
                    if !lease_left(lease, started, self.cfg.drift(lease)) =>
                {
                    ride.settled();
                    self.give_up(node, keys, &member, false, true);
                    if matches!(wait, Wait::No) || deadline.is_some_and(|d| Instant::now() >= d) {
                        return Err(Error::Timeout);
                    }
                    continue;
                }
                Ok(SharedAttempt::Acquired { fence, others_wait }) => {
                    // A redirect may have told the map where the key is now.
                    let route = self.topology.route(keys);
                    let remote = self.held(keys, &route, member, fence, started)?;
                    return Ok((remote, others_wait));
                }
                Ok(SharedAttempt::Held { hint }) => {
                    ride.settled();
                    marked |= mark_ttl.is_some();
                    hint
                }
                // A wait rides through a failover with the same member: a retry after a
                // lost reply finds its own hold.
                Err(e) if matches!(wait, Wait::Until(_)) && ride.again(&e, deadline) => {
                    marked |= mark_ttl.is_some() && may_have_run(&e);
                    continue;
                }
                Err(e) => {
                    let node = sole(&self.topology.route(keys))?.clone();
                    self.give_up(&node, keys, &member, marked, may_have_run(&e));
                    if ride.retried() && deadline.is_some_and(|d| Instant::now() >= d) {
                        log::debug!("deadline passed during a failover: {e:?}");
                        return Err(Error::Timeout);
                    }
                    return Err(e);
                }
            };
            let deadline = match wait {
                Wait::No => return Err(Error::WouldBlock),
                Wait::Until(d) => d,
            };
            if deadline.is_some_and(|d| Instant::now() >= d) {
                self.give_up(node, keys, &member, marked, false);
                Counters::inc(&self.counters.timeouts);
                return Err(Error::Timeout);
            }
            if !waiter.watching() {
                // The sleep only subscribes (and the next attempt follows): where the key
                // is now, which the attempt's redirects may have just told.
                route = self.topology.route(keys);
            }
            waiter.sleep(keys, self, &route, before, hint, deadline, |_| {});
        }
    }

    /// A contender leaves without the hold: its waiting mark goes (a writer's wakes the
    /// readers it held back), and a hold an ambiguous attempt may have taken is released.
    fn give_up(&self, node: &Node, keys: &Keys, member: &str, marked: bool, may_hold: bool) {
        let write = member.starts_with(Want::Write.tag());
        if marked && let Err(e) = node.unmark_waiter(keys, member, write) {
            log::debug!("removing a writer mark failed (it expires by itself): {e}");
        }
        if may_hold
            && let Err(e) = node.release_shared(keys, member, crate::proto::node::Retry::ON_RESET)
        {
            log::debug!("cleanup release failed (the hold expires with its lease): {e}");
        }
    }

    /// The hold is ours: its state, watched (and renewed) by the watchdog.
    fn held(
        self: &Arc<Self>,
        keys: &Keys,
        route: &Route,
        member: String,
        fence: u64,
        started: Stamp,
    ) -> Result<Arc<RemoteLock>> {
        let node = sole(route)?;
        if fence > MAX_FENCE {
            let _ = node.release_shared(keys, &member, route.retry());
            return Err(Error::Protocol(format!(
                "fence counter {fence} exceeds {MAX_FENCE}"
            )));
        }
        let lease = self.cfg.lease;
        let remote = Arc::new(
            RemoteLock::new(
                Acquisition {
                    keys: keys.clone(),
                    token: member,
                    fence,
                    nodes: vec![node.id.clone()],
                    started,
                },
                lease,
                self.cfg.drift(lease),
                self.cfg.auto_renew.then(|| self.cfg.renew_every(lease)),
            )
            .with_kind(HoldKind::Shared),
        );
        Counters::inc(&self.counters.remote_acquisitions);
        if let Some(w) = &self.watchdog {
            w.register(remote.clone(), remote.next_due());
        }
        Ok(remote)
    }
}

/// The one node that serves a shared hold: read-write locks and semaphores are not
/// offered over Redlock.
pub(crate) fn sole(route: &Route) -> Result<&Arc<Node>> {
    route.sole().ok_or(Error::Unsupported(
        "read-write locks and semaphores need a single node (not Redlock)",
    ))
}
