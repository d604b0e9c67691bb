//! Read-write locks and semaphores: taking a shared hold in Redis (the same wait as the
//! lock's: subscribe before the attempt that makes us wait, then sleep until an event, the
//! obstacle's lease, the re-check ceiling or the deadline), sharing one process's read
//! hold among its readers, and giving holds back.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use crate::engine::contend::Wait;
use crate::engine::state::Engine;
use crate::engine::waiter::Waiter;
use crate::error::{Error, Result, Unlocked};
use crate::fencing::MAX_FENCE;
use crate::local::held::{Acquisition, HoldKind, RemoteLock};
use crate::local::shares::{Current, Mine};
use crate::proto::keys::Keys;
use crate::proto::node::{Node, may_have_run, new_token};
use crate::proto::rw_scripts::{SharedAttempt, Want};
use crate::stats::Counters;
use crate::topology::Route;
use crate::topology::verdict::tally_release;

static NEXT_SHARER: AtomicU64 = AtomicU64::new(1);

/// A hold as a guard keeps it: the remote hold, and the guard's id among the readers who
/// share it (0 for a hold of its own).
pub(crate) struct Hold {
    pub remote: Arc<RemoteLock>,
    pub sharer: u64,
}

impl Engine {
    /// Takes a read hold of `name`: joins this process's current read hold when it is
    /// young enough (see [`joinable`]) or this thread already reads it, else takes one in
    /// Redis.
    pub(crate) fn read(self: &Arc<Self>, name: &[u8], wait: Wait) -> Result<Hold> {
        let keys = Keys::new(&self.cfg.key_prefix, name)?;
        let me = std::thread::current().id();
        let mut guard = self.shares.state.lock();
        loop {
            let st = &mut *guard;
            let joined = match st.threads.get_mut(&(keys.clone(), me)) {
                Some(Mine::Write) => return Err(Error::WouldDeadlock),
                // A thread that reads already joins its own hold: a new remote read could
                // queue behind a waiting writer, which waits for this thread's read.
                Some(Mine::Read(remote, n)) => {
                    *n += 1;
                    Some(remote.clone())
                }
                None => match st.current.get_mut(&keys) {
                    Some(cur) if self.joinable(cur) => {
                        cur.joins += 1;
                        st.threads
                            .insert((keys.clone(), me), Mine::Read(cur.remote.clone(), 1));
                        Some(cur.remote.clone())
                    }
                    _ => None,
                },
            };
            if let Some(remote) = joined {
                *st.readers.entry(remote.id).or_default() += 1;
                Counters::inc(&self.counters.local_handoffs);
                return Ok(self.sharer(remote));
            }
            // Another local reader is asking Redis: wait for its hold and join it.
            let deadline = match wait {
                Wait::Until(d) if self.cfg.local_handoff && st.acquiring.contains(&keys) => d,
                _ => break,
            };
            match deadline {
                Some(d) => {
                    if self.shares.attempted.wait_until(&mut guard, d).timed_out() {
                        Counters::inc(&self.counters.timeouts);
                        return Err(Error::Timeout);
                    }
                }
                None => self.shares.attempted.wait(&mut guard),
            }
        }
        // A `try_read` next to a local contender tries on its own, and leaves the flag to it.
        let flagged = guard.acquiring.insert(keys.clone());
        drop(guard);
        let acquired = self.acquire_shared(&keys, Want::Read, wait);
        let mut st = self.shares.state.lock();
        if flagged {
            st.acquiring.remove(&keys);
            self.shares.attempted.notify_all();
        }
        let remote = acquired?;
        st.readers.insert(remote.id, 1);
        if self.cfg.local_handoff {
            st.current.insert(
                keys.clone(),
                Current {
                    remote: remote.clone(),
                    since: Instant::now(),
                    joins: 0,
                },
            );
        }
        st.threads.insert((keys, me), Mine::Read(remote.clone(), 1));
        drop(st);
        Ok(self.sharer(remote))
    }

    /// Whether a new local reader may join `cur` without asking Redis: within the first
    /// `handoff_slice` and `max_handoffs` joins of the hold, while it is not lost. After
    /// that, a new reader asks Redis, where a waiting writer stops it: local sharing
    /// delays a waiting writer by at most that slice plus the readers' sections.
    fn joinable(&self, cur: &Current) -> bool {
        cur.since.elapsed() < self.cfg.handoff_slice
            && cur.joins < self.cfg.max_handoffs
            && cur.remote.lost(&self.counters).is_none()
    }

    fn sharer(&self, remote: Arc<RemoteLock>) -> Hold {
        Hold {
            remote,
            sharer: NEXT_SHARER.fetch_add(1, Ordering::Relaxed),
        }
    }

    /// A local reader lets go: the last reader of a remote read hold releases it in Redis.
    pub(crate) fn release_read(self: &Arc<Self>, hold: &Hold) -> Result<Unlocked> {
        let remote = &hold.remote;
        remote.remove_sharer(hold.sharer);
        let me = std::thread::current().id();
        let last = {
            let mut st = self.shares.state.lock();
            let key = (remote.keys.clone(), me);
            if let Some(Mine::Read(_, n)) = st.threads.get_mut(&key) {
                *n -= 1;
                if *n == 0 {
                    st.threads.remove(&key);
                }
            }
            let left = st.readers.get_mut(&remote.id).map(|n| {
                *n -= 1;
                *n
            });
            if left.unwrap_or(0) == 0 {
                st.readers.remove(&remote.id);
                if st
                    .current
                    .get(&remote.keys)
                    .is_some_and(|c| c.remote.id == remote.id)
                {
                    st.current.remove(&remote.keys);
                }
                true
            } else {
                false
            }
        };
        if last {
            return self.release_shared(remote);
        }
        Ok(match remote.lost(&self.counters) {
            None => Unlocked::Released,
            Some(_) => Unlocked::Expired,
        })
    }

    /// Takes the write hold of `name`.
    pub(crate) fn write(self: &Arc<Self>, name: &[u8], wait: Wait) -> Result<Hold> {
        let keys = Keys::new(&self.cfg.key_prefix, name)?;
        let me = std::thread::current().id();
        if self
            .shares
            .state
            .lock()
            .threads
            .contains_key(&(keys.clone(), me))
        {
            return Err(Error::WouldDeadlock);
        }
        let remote = self.acquire_shared(&keys, Want::Write, wait)?;
        self.shares
            .state
            .lock()
            .threads
            .insert((keys, me), Mine::Write);
        Ok(Hold { remote, sharer: 0 })
    }

    /// The writer lets go.
    pub(crate) fn release_write(self: &Arc<Self>, hold: &Hold) -> Result<Unlocked> {
        let me = std::thread::current().id();
        self.shares
            .state
            .lock()
            .threads
            .remove(&(hold.remote.keys.clone(), me));
        self.release_shared(&hold.remote)
    }

    /// Takes one permit of the semaphore `name` of `permits` permits.
    pub(crate) fn permit(self: &Arc<Self>, name: &[u8], permits: u32, wait: Wait) -> Result<Hold> {
        let keys = Keys::new(&self.cfg.key_prefix, name)?;
        if permits == 0 {
            return Err(Error::InvalidConfig(
                "a semaphore needs at least one permit".to_owned(),
            ));
        }
        let remote = self.acquire_shared(&keys, Want::Permit(permits), wait)?;
        Ok(Hold { remote, sharer: 0 })
    }

    /// Ends a shared hold in Redis. No renewal is sent once this returns.
    pub(crate) fn release_shared(self: &Arc<Self>, remote: &Arc<RemoteLock>) -> Result<Unlocked> {
        let lost = remote.begin_release(&self.counters);
        if let Some(w) = &self.watchdog {
            w.unregister(remote);
        }
        let route = self.topology.route(&remote.keys);
        let node = sole(&route)?;
        let reply = node.release_shared(&remote.keys, &remote.token, route.retry());
        tally_release(vec![reply], lost.is_none(), route.quorum())
    }

    /// Contends for a shared hold until it is ours, the wait policy says stop, or an error.
    /// One member (tag and token) for the whole call: a retry after a lost reply, or after
    /// a wait, finds its own hold.
    fn acquire_shared(
        self: &Arc<Self>,
        keys: &Keys,
        want: Want,
        wait: Wait,
    ) -> Result<Arc<RemoteLock>> {
        let route = self.topology.route(keys);
        let node = sole(&route)?;
        let member = format!("{}{}", want.tag(), new_token());
        let lease = self.cfg.lease;
        let mut waiter = Waiter::new();
        let mut marked = false;
        loop {
            let before = waiter.snapshots();
            let deadline = wait.deadline();
            let waiting = matches!(wait, Wait::Until(d) if d.is_none_or(|d| Instant::now() < d));
            let mark_ttl = (waiting && want == Want::Write).then(|| self.cfg.recheck_interval * 2);
            let started = Instant::now();
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
                Ok(SharedAttempt::Acquired { fence }) => {
                    return self.held(keys, &route, member, fence, started);
                }
                Ok(SharedAttempt::Held { hint }) => {
                    marked |= mark_ttl.is_some();
                    hint
                }
                Err(e) => {
                    self.give_up(node, keys, &member, marked, may_have_run(&e));
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
            waiter.sleep(keys, self, &route, before, hint, deadline, |_| {});
        }
    }

    /// A contender leaves without the hold: its writer mark goes (waking the readers it
    /// held back), and a hold an ambiguous attempt may have taken is released.
    fn give_up(&self, node: &Node, keys: &Keys, member: &str, marked: bool, may_hold: bool) {
        if marked && let Err(e) = node.unmark_writer(keys, member) {
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
        started: Instant,
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
fn sole(route: &Route) -> Result<&Arc<Node>> {
    route.sole().ok_or(Error::Unsupported(
        "read-write locks and semaphores need a single node (not Redlock)",
    ))
}
