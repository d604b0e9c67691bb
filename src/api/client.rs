//! `LockClient`: the handle applications share, and the state behind it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::api::builder::Builder;
use crate::api::guard::LockGuard;
use crate::config::{Config, Wakeup};
use crate::engine::cleanup::Cleanup;
use crate::engine::contend::{Wait, YIELD};
use crate::engine::watchdog::Watchdog;
use crate::error::{Error, Result, Unlocked};
use crate::local::held::RemoteLock;
use crate::local::table::{Grant, Role, Step, Table};
use crate::local::undo::OnUnwind;
use crate::proto::keys::Keys;
use crate::proto::node::{ExtendReply, Node, ReleaseReply, Renewal, Retry};
use crate::stats::{Counters, Stats};
use crate::topology::fanout::Fanout;
use crate::wake::notify::{self, Mode};
use crate::wake::subscriber::{Connector, Setup, Subscriber};

/// A distributed lock client over one Redis node, or over several independent masters
/// (Redlock).
///
/// Cheap to clone (an `Arc`), `Send + Sync`: build one per process and share it. It owns
/// one subscriber thread per node (waking waiters), one watchdog thread (renewing leases),
/// for Redlock two threads per node beyond the first that talk to the nodes in parallel,
/// and, from the first acquire whose outcome was unknown, one cleanup thread (releasing
/// what such attempts may have left). A subscriber or watchdog thread that panics is
/// restarted (and logged at `error`). They stop, and are joined, when the last clone and
/// the last guard are dropped.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
///
/// # fn main() -> Result<(), redbaton::Error> {
/// let url = "redis://127.0.0.1:6379/";
/// # let url = redbaton_testkit::redis_url(); // the doc test's throwaway redis-server
/// let client = redbaton::LockClient::builder()
///     .node(url)
///     .build()?;
///
/// let guard = client.lock("orders:42")?;
/// println!("fencing token {}", guard.fencing_token());
/// drop(guard); // released (or handed to a waiting thread of this process)
///
/// let total = client.with_lock("orders:42", || 40 + 2)?;
/// assert_eq!(total, 42);
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct LockClient {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for LockClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LockClient")
            .field("nodes", &self.inner.nodes.len())
            .field("key_prefix", &self.inner.cfg.key_prefix)
            .field("lease", &self.inner.cfg.lease)
            .finish_non_exhaustive()
    }
}

/// The shared state. Guards hold it too, so that a guard can always release.
pub(crate) struct Inner {
    pub cfg: Config,
    pub nodes: Vec<Node>,
    /// One per node with `Wakeup::Notifications`; none when polling.
    pub subs: Vec<Subscriber>,
    pub table: Table,
    pub counters: Arc<Counters>,
    watchdog: Option<Watchdog>,
    fanout: Option<Fanout>,
    pub cleanup: Cleanup,
}

impl LockClient {
    /// A [`Builder`] with the documented defaults.
    ///
    /// # Examples
    ///
    /// ```
    /// # fn main() -> Result<(), redbaton::Error> {
    /// let client = redbaton::LockClient::builder()
    /// #   .node(redbaton_testkit::redis_url())
    ///     .key_prefix("lock:")
    ///     .build()?;
    /// # Ok(()) }
    /// ```
    pub fn builder() -> Builder {
        Builder::new()
    }

    pub(crate) fn connect(cfg: Config) -> Result<Self> {
        let counters = Arc::new(Counters::default());
        let client_id: Arc<str> = uuid::Uuid::new_v4().simple().to_string().into();
        let nodes = cfg
            .nodes
            .iter()
            .enumerate()
            .map(|(i, url)| Node::new(i, url, &cfg, counters.clone(), client_id.clone()))
            .collect::<Result<Vec<_>>>()?;
        let notifications = cfg.wakeup == Wakeup::Notifications;
        let mut modes = Vec::with_capacity(nodes.len());
        let mut first_error = None;
        for node in &nodes {
            match check_node(node, notifications, cfg.configure_notifications) {
                Ok(mode) => modes.push(Some(mode)),
                Err(e) => {
                    log::warn!("node {}: unreachable at start: {e}", node.idx);
                    first_error.get_or_insert(e);
                    modes.push(None);
                }
            }
        }
        let reachable = modes.iter().filter(|m| m.is_some()).count();
        let quorum = nodes.len() / 2 + 1;
        if reachable < quorum {
            return Err(first_error.expect("an unreachable node left its error"));
        }
        let mut subs = Vec::new();
        for (node, mode) in nodes.iter().zip(&modes) {
            let keyspace = match mode {
                Some(Mode::Keyspace) => true,
                Some(Mode::Fallback(why)) => {
                    if notifications {
                        log::warn!(
                            "node {}: keyspace notifications unavailable: {why}; waiters are woken by the library's release channel instead",
                            node.idx
                        );
                    }
                    false
                }
                None => true,
            };
            if notifications {
                let (connect_timeout, read_timeout, write_timeout) = node.pool.timeouts();
                let connector = Connector {
                    client: node.pool.client().clone(),
                    connect_timeout,
                    read_timeout,
                    write_timeout,
                };
                let setup = Setup {
                    node: node.idx,
                    db: node.db,
                    keyspace,
                    configure: cfg.configure_notifications,
                    prefix: cfg.key_prefix.clone(),
                    client_id: client_id.to_string(),
                    connector,
                };
                subs.push(
                    Subscriber::start(setup, counters.clone())
                        .map_err(|e| thread_error("subscriber", e))?,
                );
            }
        }
        let fanout = if nodes.len() > 1 {
            Some(
                Fanout::start(nodes.len(), cfg.read_timeout)
                    .map_err(|e| thread_error("fanout", e))?,
            )
        } else {
            None
        };
        let mut spawn_error = None;
        let inner = Arc::new_cyclic(|weak| {
            // Also with renewals off: it tells holders when their lease runs out.
            let watchdog = Watchdog::start(weak.clone())
                .map_err(|e| spawn_error = Some(thread_error("watchdog", e)))
                .ok();
            Inner {
                cfg,
                nodes,
                subs,
                table: Table::default(),
                counters,
                watchdog,
                fanout,
                cleanup: Cleanup::new(weak.clone()),
            }
        });
        match spawn_error {
            Some(e) => Err(e),
            None => Ok(LockClient { inner }),
        }
    }

    /// Waits until the lock is acquired, however long that takes.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidName`], [`Error::WouldDeadlock`] if this thread already holds it,
    /// Redis errors, [`Error::NoQuorum`] for Redlock.
    ///
    /// # Examples
    ///
    /// ```
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// let guard = client.lock("orders:42")?;
    /// // ... critical section ...
    /// guard.unlock()?;
    /// # Ok(()) }
    /// ```
    pub fn lock(&self, name: impl AsRef<[u8]>) -> Result<LockGuard> {
        self.acquire(name.as_ref(), Wait::Until(None))
    }

    /// Takes the lock if it is free right now; [`Error::WouldBlock`] otherwise.
    ///
    /// # Examples
    ///
    /// ```
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// match client.try_lock("orders:42") {
    ///     Ok(guard) => drop(guard),
    ///     Err(e) if e.is_would_block() => println!("busy"),
    ///     Err(e) => return Err(e),
    /// }
    /// # Ok(()) }
    /// ```
    pub fn try_lock(&self, name: impl AsRef<[u8]>) -> Result<LockGuard> {
        self.acquire(name.as_ref(), Wait::No)
    }

    /// Waits at most `timeout`; [`Error::Timeout`] after. A zero timeout makes one attempt;
    /// a timeout too long to add to the current time (`Duration::MAX`) waits without a
    /// deadline, like [`lock`](LockClient::lock).
    ///
    /// # Errors
    ///
    /// [`Error::Timeout`], and the errors of [`lock`](LockClient::lock).
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// match client.try_lock_for("orders:42", Duration::from_secs(5)) {
    ///     Ok(guard) => drop(guard),
    ///     Err(e) if e.is_timeout() => println!("gave up"),
    ///     Err(e) => return Err(e),
    /// }
    /// # Ok(()) }
    /// ```
    pub fn try_lock_for(&self, name: impl AsRef<[u8]>, timeout: Duration) -> Result<LockGuard> {
        self.acquire(
            name.as_ref(),
            Wait::Until(Instant::now().checked_add(timeout)),
        )
    }

    /// Waits until `deadline` at most; [`Error::Timeout`] after. A deadline in the past
    /// makes one attempt; any deadline is accepted, however far in the future.
    ///
    /// # Errors
    ///
    /// [`Error::Timeout`], and the errors of [`lock`](LockClient::lock).
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::{Duration, Instant};
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// let deadline = Instant::now() + Duration::from_secs(2);
    /// let a = client.try_lock_until("a", deadline)?;
    /// let b = client.try_lock_until("b", deadline)?; // one deadline for both
    /// # Ok(()) }
    /// ```
    pub fn try_lock_until(&self, name: impl AsRef<[u8]>, deadline: Instant) -> Result<LockGuard> {
        self.acquire(name.as_ref(), Wait::Until(Some(deadline)))
    }

    /// Runs `f` while holding the lock, and releases it after, also when `f` panics.
    ///
    /// # Examples
    ///
    /// ```
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// let n = client.with_lock("counter", || 1 + 1)?;
    /// # Ok(()) }
    /// ```
    pub fn with_lock<T>(&self, name: impl AsRef<[u8]>, f: impl FnOnce() -> T) -> Result<T> {
        let guard = self.lock(name)?;
        let out = f();
        if let Err(e) = guard.unlock() {
            log::warn!("with_lock: release failed after the section ran: {e}");
        }
        Ok(out)
    }

    /// A snapshot of the client's counters.
    ///
    /// # Examples
    ///
    /// ```
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// let before = client.stats();
    /// client.with_lock("k", || ())?;
    /// assert!(client.stats().commands > before.commands);
    /// # Ok(()) }
    /// ```
    pub fn stats(&self) -> Stats {
        self.inner.counters.snapshot()
    }

    fn acquire(&self, name: &[u8], wait: Wait) -> Result<LockGuard> {
        let inner = &self.inner;
        let keys = Keys::new(&inner.cfg.key_prefix, name)?;
        let waits = matches!(wait, Wait::Until(_));
        let role = inner
            .table
            .enter(&keys, waits, inner.cfg.local_handoff, &inner.subs)?;
        let (remote, seq) = match role {
            Role::Contend => (inner.contend_for_table(&keys, wait, false)?, 0),
            Role::Queued { slot, check_marks } => {
                let deadline = match wait {
                    Wait::Until(d) => d,
                    Wait::No => None,
                };
                let undo = OnUnwind::new(|| inner.abandon_queued(&keys, &slot));
                if check_marks {
                    inner.check_marks(&keys, deadline);
                }
                let granted = inner.table.wait_queued(&keys, &slot, deadline);
                undo.disarm();
                match granted {
                    Ok(Grant::Baton { remote, seq }) => {
                        Counters::inc(&inner.counters.local_handoffs);
                        (remote, seq)
                    }
                    Ok(Grant::Contend { yield_first }) => {
                        (inner.contend_for_table(&keys, wait, yield_first)?, 0)
                    }
                    Err(e) => {
                        if e.is_timeout() {
                            Counters::inc(&inner.counters.timeouts);
                        }
                        return Err(e);
                    }
                }
            }
        };
        Ok(LockGuard::new(inner.clone(), remote, seq))
    }
}

impl Inner {
    /// Contends as the table's contender for `keys` and records the outcome there.
    fn contend_for_table(
        self: &Arc<Self>,
        keys: &Keys,
        wait: Wait,
        yield_first: bool,
    ) -> Result<Arc<RemoteLock>> {
        let undo = OnUnwind::new(|| self.table.contend_failed(keys));
        let contended = self.contend(keys, wait, yield_first);
        undo.disarm();
        match contended {
            Ok(lock) => {
                self.table.acquired(keys);
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
    fn check_marks(self: &Arc<Self>, keys: &Keys, deadline: Option<Instant>) {
        let until = deadline.map_or(Instant::now() + self.cfg.read_timeout, |d| {
            d.min(Instant::now() + self.cfg.read_timeout)
        });
        let (poke_tx, poke) = crossbeam_channel::bounded(1);
        for (i, sub) in self.subs.iter().enumerate() {
            let watch = sub.watch(keys, poke_tx.clone());
            let confirmed_at = loop {
                if let Some(at) = sub.confirmed_at(keys) {
                    break Some(at);
                }
                if poke.recv_deadline(until).is_err() {
                    break sub.confirmed_at(keys);
                }
            };
            drop(watch);
            let Some(at) = confirmed_at else { continue };
            match self.nodes[i].foreign_mark(keys) {
                Ok(foreign) => self.table.marks_checked(keys, i, at, foreign),
                Err(e) => log::debug!("node {i}: mark check failed: {e}"),
            }
        }
    }

    pub fn quorum(&self) -> usize {
        self.nodes.len() / 2 + 1
    }

    /// How often to renew a lock of this lease.
    pub fn renew_every(&self, lease: Duration) -> Duration {
        if lease == self.cfg.lease {
            self.cfg.renew_interval
        } else {
            lease / 3
        }
    }

    /// `f(node index)` for every node, in parallel when there are several.
    pub fn map_nodes<T, F>(&self, f: F) -> Vec<T>
    where
        T: Send + 'static,
        F: Fn(usize) -> T + Send + Sync + 'static,
    {
        match &self.fanout {
            Some(fanout) => fanout.map(self.nodes.len(), Arc::new(f)),
            None => (0..self.nodes.len()).map(f).collect(),
        }
    }

    /// A holder is done: hand the lock on locally, or release it in Redis.
    pub fn release(self: &Arc<Self>, lock: &Arc<RemoteLock>) -> Result<Unlocked> {
        let lost = lock.lost(&self.counters).is_some();
        match self.table.release(lock, lost, &self.cfg, &self.subs) {
            Step::HandedOff => Ok(Unlocked::HandedOff),
            Step::Remote { forced, contended } => {
                let undo = OnUnwind::new(|| self.abandon_release(lock));
                if forced {
                    Counters::inc(&self.counters.budget_releases);
                }
                // No renewal may be sent once this returns (a renewal racing the release
                // must not outlive it).
                let lost = lock.begin_release(&self.counters);
                if let Some(w) = &self.watchdog {
                    w.unregister(lock);
                }
                crate::fault::hit(&self.cfg.key_prefix, crate::fault::Point::Release);
                // Redlock: on every node, not only those that granted: a node whose grant
                // came too late to count may hold our token too.
                let every: Vec<usize> = (0..self.nodes.len()).collect();
                let replies = self.release_on(&lock.keys, &lock.token, every);
                if contended {
                    // A thread that releases and locks again would otherwise win every time:
                    // its attempt reaches Redis before the waiters have heard of the release.
                    let until = Instant::now() + YIELD;
                    for s in &self.subs {
                        s.ask_to_yield(&lock.keys, until);
                    }
                }
                undo.disarm();
                self.table.released(&lock.keys, forced && contended);
                self.tally_release(replies, lost.is_none())
            }
        }
    }

    /// One outcome from the nodes' replies. `was_valid`: the lease had not run out when the
    /// release began, so a key that only a retry found gone was deleted by our first attempt.
    fn tally_release(
        &self,
        replies: Vec<Result<ReleaseReply>>,
        was_valid: bool,
    ) -> Result<Unlocked> {
        let count = |want: &[ReleaseReply]| {
            replies
                .iter()
                .filter(|r| matches!(r, Ok(x) if want.contains(x)))
                .count()
        };
        let released = if was_valid {
            count(&[ReleaseReply::Released, ReleaseReply::GoneAfterRetry])
        } else {
            count(&[ReleaseReply::Released])
        };
        let other = count(&[ReleaseReply::Other]);
        let needed = self.quorum().min(replies.len());
        if released >= needed {
            return Ok(Unlocked::Released);
        }
        let answered = replies.iter().filter(|r| r.is_ok()).count();
        if answered < needed {
            // Too few answers to say anything: report the first error.
            if let Some(Err(e)) = replies.into_iter().find(|r| r.is_err()) {
                return Err(e);
            }
        }
        Ok(if other > 0 {
            Unlocked::HeldByOther
        } else {
            Unlocked::Expired
        })
    }

    /// Sets the lock's lease to `lease` on its nodes now.
    pub fn extend(self: &Arc<Self>, lock: &Arc<RemoteLock>, lease: Duration) -> Result<()> {
        if let Some(reason) = lock.lost(&self.counters) {
            return Err(Error::Lost(reason));
        }
        lock.begin_extend();
        let undo = OnUnwind::new(|| lock.end_extend(None));
        let started = Instant::now();
        let (client, l) = (self.clone(), lock.clone());
        let replies = self.map_nodes(move |n| {
            if l.nodes.contains(&n) {
                Some(client.nodes[n].extend(&[(l.keys.lock(), l.token.as_str())], lease))
            } else {
                None
            }
        });
        let replies: Vec<_> = replies.into_iter().flatten().collect();
        let count = |want: ExtendReply| {
            replies
                .iter()
                .filter(|r| matches!(r, Ok(v) if v.first() == Some(&want)))
                .count()
        };
        let tally = (
            count(ExtendReply::Extended),
            count(ExtendReply::Gone),
            count(ExtendReply::Other),
        );
        let verdict = Renewal::judge(tally, replies.len(), self.quorum(), self.nodes.len() > 1);
        undo.disarm();
        lock.end_extend((verdict == Renewal::Renewed).then(|| {
            (
                lease,
                started + lease - self.cfg.drift(lease),
                started + self.renew_every(lease),
            )
        }));
        match verdict {
            Renewal::Renewed => {
                if let Some(w) = &self.watchdog {
                    w.reschedule(lock.next_due());
                }
                return Ok(());
            }
            Renewal::Lost(reason) => {
                lock.mark_lost(reason, &self.counters);
                return Err(Error::Lost(reason));
            }
            Renewal::Unknown => {}
        }
        match replies.into_iter().find_map(|r| r.err()) {
            Some(e) => Err(e),
            None => Err(Error::Protocol("extend: no answer".to_owned())),
        }
    }
}

/// Connects to a node once at start: proves it reachable and, when waiters are to be woken
/// by notifications, checks (and maybe turns on) the node's keyspace notifications.
fn check_node(node: &Node, notifications: bool, configure: bool) -> Result<Mode> {
    if notifications {
        node.run(Retry::NEVER, |conn| notify::ensure(conn, configure))
    } else {
        node.run(Retry::NEVER, |conn| redis::cmd("PING").query::<()>(conn))?;
        Ok(Mode::Keyspace)
    }
}

fn thread_error(what: &'static str, source: std::io::Error) -> Error {
    Error::Thread { what, source }
}
