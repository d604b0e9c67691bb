//! Read-write locks and semaphores in Redis: taking a shared hold (the lock's contest,
//! with the hold's protocol), semaphore permits, and giving holds back. How a process's threads share its read-write holds is in `turns`.

use std::sync::Arc;
use std::time::Instant;

use crate::engine::contest::{Start, Wait, Won};
use crate::engine::state::Engine;
use crate::error::{Error, Result, Unlocked};
use crate::local::held::RemoteLock;
use crate::local::undo::OnUnwind;
use crate::proto::keys::Keys;
use crate::proto::protocol::Kind;
use crate::stats::{Counters, HoldKind, Path};
use crate::topology::verdict::tally_release;

/// A hold as a guard keeps it: the remote hold (maybe shared with other local threads),
/// the guard's id among its users, the guard's fencing token, and how and when the guard
/// got it (for its hold time).
pub(crate) struct Hold {
    pub remote: Arc<RemoteLock>,
    pub sharer: u64,
    pub token: u64,
    pub path: Path,
    pub since: Instant,
}

impl Hold {
    /// A hold got by `path`; its start is set when the call returns (see `Engine::timed`).
    pub fn new(remote: Arc<RemoteLock>, sharer: u64, token: u64, path: Path) -> Self {
        Hold {
            remote,
            sharer,
            token,
            path,
            since: Instant::now(),
        }
    }

    /// Whether the hold before this one ended without a release, as this holder is told
    /// (see `LockGuard::previous_lost`).
    pub fn previous_lost(&self) -> bool {
        self.remote.previous_lost_for(self.path)
    }
}

impl Engine {
    /// Runs `take`, a call for a hold of `kind` made now as `wait` allows, and records its
    /// wait (see [`recorded`](Self::recorded)); the hold starts when it returns.
    pub(crate) fn timed(
        &self,
        kind: HoldKind,
        wait: Wait<'_>,
        take: impl FnOnce() -> Result<Hold>,
    ) -> Result<Hold> {
        let (mut took, since) = self.recorded(kind, wait, take, |h| h.path);
        if let Ok(hold) = &mut took {
            hold.since = since;
        }
        took
    }

    /// Takes one permit of the semaphore `name` of `permits` permits.
    pub(crate) fn permit(
        self: &Arc<Self>,
        name: &[u8],
        permits: u32,
        wait: Wait<'_>,
    ) -> Result<Hold> {
        self.timed(HoldKind::Permit, wait, || {
            self.take_permit(name, permits, wait)
        })
    }

    fn take_permit(self: &Arc<Self>, name: &[u8], permits: u32, wait: Wait<'_>) -> Result<Hold> {
        let keys = Keys::new(&self.cfg.key_prefix, name)?;
        if permits == 0 {
            return Err(Error::InvalidArgument(
                "a semaphore needs at least one permit".to_owned(),
            ));
        }
        // One local thread at a time waits for a permit in Redis (the others wait for it to
        // get one): a freed permit wakes one attempt per process, not one per thread. While
        // it waits, no permit is free, so the others lose nothing by waiting here.
        let queued = self.cfg.local_handoff && matches!(wait, Wait::Until(..));
        if queued {
            let mut st = self.shares.state.lock();
            while st.permit_contenders.contains(&keys) {
                self.await_change(&mut st, wait)?;
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
        let remote = self.acquire_shared(&keys, Kind::Permit(permits), wait)?.0;
        Ok(Hold::new(remote, 0, 0, Path::Remote))
    }

    /// Ends a shared hold in Redis. No renewal is sent once this returns.
    pub(crate) fn release_shared(self: &Arc<Self>, remote: &Arc<RemoteLock>) -> Result<Unlocked> {
        let lost = remote.begin_release(&self.counters);
        if let Some(w) = &self.watchdog {
            w.unregister(remote);
        }
        let route = self.topology.route(&remote.keys);
        let (route, replies) = self.release_everywhere(remote, route);
        let outcome = tally_release(replies, lost.is_none(), route.quorum());
        self.found_lost(remote, lost.is_some(), route.sole().is_none(), &outcome);
        self.look_again_if_resent(remote, &route);
        outcome
    }

    /// Contends for a shared hold until it is ours, the wait policy says stop, or an error
    /// (see `contest`). With the hold: whether another process may wait, for a write
    /// hold. The hold is watched (and renewed) by the watchdog.
    pub(crate) fn acquire_shared(
        self: &Arc<Self>,
        keys: &Keys,
        kind: Kind,
        wait: Wait<'_>,
    ) -> Result<(Arc<RemoteLock>, bool)> {
        let route = self.topology.route(keys);
        self.watched(self.contest(keys, route, kind, wait, Start::New { yield_first: false }))
    }

    /// A contest's outcome, counted when it timed out; the hold won is watched (and
    /// renewed) by the watchdog. With the hold: whether another process may wait.
    pub(crate) fn watched(&self, won: Result<Won>) -> Result<(Arc<RemoteLock>, bool)> {
        let Won {
            remote,
            others_wait,
        } = won.inspect_err(|e| {
            if e.is_timeout() {
                Counters::inc(&self.counters.timeouts);
            }
        })?;
        if let Some(w) = &self.watchdog {
            w.register(remote.clone(), remote.next_due());
        }
        Ok((remote, others_wait))
    }
}
