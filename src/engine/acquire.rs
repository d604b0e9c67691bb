//! The acquire path: the local table decides whether this thread contends in Redis or
//! queues behind a local holder, and the outcome is recorded there.

use std::sync::Arc;
use std::time::Instant;

use crate::engine::contest::{Start, Wait};
use crate::engine::state::Engine;
use crate::error::{Error, Result};
use crate::local::held::RemoteLock;
use crate::local::mailbox::Grant;
use crate::local::table::Role;
use crate::local::undo::OnUnwind;
use crate::proto::keys::Keys;
use crate::proto::protocol::Kind;
use crate::stats::{Counters, HoldKind, Path};
use crate::topology::Route;
use crate::wake::events::Hears;

/// How the holder with handoff number `seq` got the lock: the first holder of a remote
/// acquisition took it in Redis, the others from the local holder before them.
pub(crate) fn path_of(seq: u32) -> Path {
    if seq == 0 {
        Path::Remote
    } else {
        Path::Handoff
    }
}

impl Engine {
    /// Runs `take`, a call for a hold of `kind` made now as `wait` allows, and records its
    /// wait (see `stats`), with the path `path` says a hold it got came by. A wait
    /// cancelled before the call ends it with [`Error::Cancelled`] before `take` sends
    /// anything, and is recorded as any other call that failed. Returns what the call
    /// returns and when it returned: the start of the hold it got.
    pub(crate) fn recorded<T>(
        &self,
        kind: HoldKind,
        wait: Wait<'_>,
        take: impl FnOnce() -> Result<T>,
        path: impl FnOnce(&T) -> Path,
    ) -> (Result<T>, Instant) {
        let asked = Instant::now();
        let took = if self.shut_down.load(std::sync::atomic::Ordering::Relaxed) {
            Err(Error::ShutDown)
        } else if wait.cancelled() {
            Err(Error::Cancelled)
        } else {
            // A slot map read on the way ends by the caller's deadline (Redis Cluster).
            crate::topology::with_caller_deadline(wait.deadline(), take)
        };
        let since = self.counters.settled(kind, asked, took.as_ref().map(path));
        (took, since)
    }

    /// Takes the lock `name` for the calling thread as `wait` allows: the remote lock and
    /// the handoff number of this holder (0: taken in Redis, see [`path_of`]). The wait is
    /// recorded (see [`recorded`](Self::recorded)).
    pub fn acquire(
        self: &Arc<Self>,
        name: &[u8],
        wait: Wait<'_>,
    ) -> Result<(Arc<RemoteLock>, u32)> {
        let take = || self.take(name, wait);
        let (took, _) = self.recorded(HoldKind::Lock, wait, take, |(_, seq)| path_of(*seq));
        took
    }

    fn take(self: &Arc<Self>, name: &[u8], wait: Wait<'_>) -> Result<(Arc<RemoteLock>, u32)> {
        let keys = Keys::new(&self.cfg.key_prefix, name)?;
        let waits = matches!(wait, Wait::Until(..));
        loop {
            // The route is read once here and given to the contest (a queued thread reads
            // it again when its turn comes: the layout may have changed meanwhile).
            let route = self.topology.route(&keys);
            let subs = self.subs_for(&route);
            let role = self
                .table
                .enter(&keys, waits, self.cfg.local_handoff, &subs)?;
            drop(subs);
            let (slot, check_marks) = match role {
                Role::Contend => {
                    return Ok((self.contend_for_table(&keys, route, wait, false)?, 0));
                }
                Role::Queued { slot, check_marks } => (slot, check_marks),
            };
            // A panic while queued must not strand the key (see `cleanup`).
            let undo = OnUnwind::new(|| self.abandon_queued(&keys, &slot));
            if check_marks {
                self.check_marks(&keys, wait);
            }
            let granted = self
                .table
                .wait_queued(&keys, &slot, wait.deadline(), wait.cancel());
            undo.disarm();
            match granted {
                Ok(Grant::Baton { remote, seq }) => {
                    // This thread holds it now: a panic before it is returned (the user's
                    // logger, as a loss is told) must let it go, or nobody would.
                    let undo = OnUnwind::new(|| self.abandon_baton(&keys, &remote));
                    crate::fault::hit(&self.cfg.key_prefix, crate::fault::Point::Handoff);
                    let lost = remote.lost(&self.counters).is_some();
                    undo.disarm();
                    if !lost {
                        Counters::inc(&self.counters.local_handoffs);
                        return Ok((remote, seq));
                    }
                    // Handed a lock whose lease ran out on its way (a giver slowed down
                    // after it looked, this thread woken late): no lock to return, as an
                    // attempt in Redis whose reply came too late is not. It goes back as
                    // a lost one (released in Redis, where it may still be ours; never
                    // handed on), and this thread queues or contends again.
                    self.give_back_lost(&remote, wait);
                }
                Ok(Grant::Contend { yield_first }) => {
                    let route = self.topology.route(&keys);
                    return Ok((self.contend_for_table(&keys, route, wait, yield_first)?, 0));
                }
                Err(e) => {
                    if e.is_timeout() {
                        Counters::inc(&self.counters.timeouts);
                    }
                    return Err(e);
                }
            }
        }
    }

    /// Contends as the table's contender for `keys` and records the outcome there.
    fn contend_for_table(
        self: &Arc<Self>,
        keys: &Keys,
        route: Route,
        wait: Wait<'_>,
        yield_first: bool,
    ) -> Result<Arc<RemoteLock>> {
        // A contender that panics gives up its turn, so that the next local waiter contends.
        let undo = OnUnwind::new(|| self.table.contend_failed(keys));
        let contended = self.contest(keys, route, Kind::Lock, wait, Start::New { yield_first });
        undo.disarm();
        match contended.map(|won| won.remote) {
            Ok(lock) => {
                self.table.acquired(keys, lock.id, lock.acquired_at);
                if let Some(w) = &self.watchdog {
                    w.register(lock.clone(), lock.next_due());
                }
                Ok(lock)
            }
            Err(e) => {
                self.table.contend_failed(keys);
                if e.is_timeout() {
                    Counters::inc(&self.counters.timeouts);
                }
                Err(e)
            }
        }
    }

    /// Run by the first local waiter queued behind a holder (it is idle anyway): once the
    /// key's subscription is confirmed, read the mark key, so that a remote waiter whose
    /// live mark came before the subscription is known too. One `GET` per node and episode.
    /// A cancelled wait stops waiting for the confirmation (and reads nothing). Nor is the
    /// mark key read when the subscription was confirmed before the round that won the
    /// hold began: every mark since was heard, and a read on a server that stopped
    /// answering would keep this waiter from a handoff it may be given meanwhile.
    fn check_marks(self: &Arc<Self>, keys: &Keys, wait: Wait<'_>) {
        let soon = crate::clock::from_now(self.cfg.read_timeout);
        let until = wait.deadline().map_or(soon, |d| d.min(soon));
        let route = self.topology.route(keys);
        let (poke_tx, poke) = crossbeam_channel::bounded(1);
        let _woken = wait.cancel().map(|c| c.on_cancel_poke(poke_tx.clone()));
        for node in route.nodes() {
            let Some(sub) = self.subs.find(&node.id) else {
                continue;
            };
            let watch = sub.watch(keys, Hears::Key, poke_tx.clone());
            let confirmed_at = loop {
                if let Some(at) = sub.confirmed_at(keys) {
                    break Some(at);
                }
                if wait.cancelled() {
                    return;
                }
                if poke.recv_deadline(until).is_err() {
                    break sub.confirmed_at(keys);
                }
            };
            drop(watch);
            let Some(at) = confirmed_at else { continue };
            // The read is bounded like the wait for the confirmation: a server that stops
            // answering must not keep this waiter past its own deadline (a handoff, which
            // sends nothing, may be waiting for it). Not read at all once that has passed:
            // unchecked, the holder applies the budget, which is safe.
            if wait.cancelled() || Instant::now() >= until {
                return;
            }
            if self.table.marks_heard_since(keys, at) {
                continue;
            }
            match route.lock_protocol().foreign_mark(node, keys, Some(until)) {
                Ok(foreign) => self.table.marks_checked(keys, &node.id, at, foreign),
                Err(e) => log::debug!("node {}: mark check failed: {e}", node.id),
            }
        }
    }
}
