//! `LockClient`: the handle applications share, and the state behind it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::api::cancel::Cancel;
use crate::api::guard::LockGuard;
use crate::config::Config;
use crate::engine::contest::Wait;
use crate::engine::state::Engine;
use crate::error::{Error, Result};
use crate::stats::{Stats, SubscriberStats};

/// A distributed lock client over one Redis node, or over several independent masters
/// (Redlock).
///
/// Cheap to clone (an `Arc`), `Send + Sync`: build one per process and share it. It owns
/// one subscriber thread per node (waking waiters), one watchdog thread (renewing leases)
/// and, for Redlock, a few threads that talk to the nodes in parallel. They stop, and are
/// joined, when the last clone, the last guard and the last handle made by it (an
/// [`RwLock`](crate::RwLock), a [`Semaphore`](crate::Semaphore), a
/// [`Latch`](crate::Latch)) are dropped.
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
    engine: Arc<Engine>,
}

impl std::fmt::Debug for LockClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LockClient")
            .field("nodes", &self.engine.topology.nodes().len())
            .field("key_prefix", &self.engine.cfg.key_prefix)
            .field("lease", &self.engine.cfg.lease)
            .finish_non_exhaustive()
    }
}

impl LockClient {
    pub(crate) fn connect(cfg: Config) -> Result<Self> {
        Ok(LockClient {
            engine: Arc::new(Engine::start(cfg)?),
        })
    }

    /// Waits until the lock is acquired, however long that takes.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidName`], [`Error::WouldDeadlock`] if this thread already holds it
    /// through this client or a clone of it (a guard it forgot with `mem::forget` too: it
    /// keeps the lock); a lock this thread holds through another client is waited for like
    /// another process's. Redis errors, [`Error::NoQuorum`] for Redlock. Redis Cluster: a master being
    /// replaced is waited for up to one lease before its error is returned (see
    /// [`Builder::cluster`](crate::Builder::cluster)).
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
        self.acquire(name.as_ref(), Wait::Until(None, None))
    }

    /// Takes the lock if it is free right now; [`Error::WouldBlock`] otherwise. It never
    /// waits for a holder: only for its round trip, the replicas' acknowledgement when
    /// [`replica_ack`](crate::Builder::replica_ack) asks for one, and on Redis Cluster a
    /// slot migration for about 2 s.
    ///
    /// # Errors
    ///
    /// [`Error::WouldBlock`] when another holder (a thread of this process, or another
    /// process) has it; [`Error::ReplicaAck`] when too few replicas acknowledged it (it
    /// was given back); [`Error::Timeout`] when its reply came after the lease it would
    /// grant had ended (given back too); [`Error::SlotMigrating`] when its slot was still
    /// migrating; otherwise as [`lock`](Self::lock).
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
    /// [`Error::Timeout`] when the lock was not free within `timeout` (Redis Cluster: also
    /// when its master was still being replaced then); otherwise as [`lock`](Self::lock).
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
            Wait::Until(Instant::now().checked_add(timeout), None),
        )
    }

    /// Waits until `deadline` at most; [`Error::Timeout`] after. A deadline in the past
    /// makes one attempt; any deadline is accepted, however far in the future.
    ///
    /// # Errors
    ///
    /// [`Error::Timeout`] when the lock was not free by `deadline`; otherwise as
    /// [`lock`](Self::lock).
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
        self.acquire(name.as_ref(), Wait::Until(Some(deadline), None))
    }

    /// Waits until the lock is acquired or `cancel` is cancelled, from another thread
    /// (see [`Cancel`]).
    ///
    /// A cancel ends the wait at its next wake-up, which the cancel causes at once, and
    /// leaves nothing behind: no place in the local or the fair queue, no contention mark.
    /// When the lock was taken before the wait saw the cancel, the guard is returned. A
    /// token cancelled before the call makes it return [`Error::Cancelled`] without
    /// contacting Redis.
    ///
    /// # Errors
    ///
    /// [`Error::Cancelled`] when the wait was cancelled; otherwise as [`lock`](Self::lock).
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// let cancel = redbaton::Cancel::new();
    /// let stop = cancel.clone();
    /// std::thread::spawn(move || {
    ///     std::thread::sleep(Duration::from_secs(30));
    ///     stop.cancel(); // give up after 30 s, or when the user asks
    /// });
    /// match client.lock_cancellable("orders:42", &cancel) {
    ///     Ok(guard) => drop(guard),
    ///     Err(e) if e.is_cancelled() => println!("gave up"),
    ///     Err(e) => return Err(e),
    /// }
    /// # Ok(()) }
    /// ```
    pub fn lock_cancellable(&self, name: impl AsRef<[u8]>, cancel: &Cancel) -> Result<LockGuard> {
        self.acquire(name.as_ref(), cancel.wait())
    }

    /// Runs `f` while holding the lock, and releases it after, also when `f` panics.
    ///
    /// # Errors
    ///
    /// As [`lock`](Self::lock); `f` does not run then. A failed release after `f` ran is
    /// logged, not returned: the lock then expires with its lease.
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
        self.engine.counters.snapshot()
    }

    /// The client's subscriber connections, one per node its locks are routed to (per
    /// master in a Redis Cluster; none with [`Wakeup::Polling`](crate::Wakeup::Polling)):
    /// each node's address, reconnects and whether it is connected now. A Cluster master
    /// that serves nothing any more (removed, or demoted by a failover) loses its
    /// subscriber once nothing waits there, and is no longer listed; one that serves
    /// again gets a fresh one. [`Stats::reconnects`] is the sum of their reconnects and
    /// of those of the subscribers that ended so.
    ///
    /// # Examples
    ///
    /// ```
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// let subs = client.subscribers();
    /// assert_eq!(subs.len(), 1, "one node, one subscriber");
    /// assert_eq!(subs[0].reconnects, 0);
    /// # Ok(()) }
    /// ```
    pub fn subscribers(&self) -> Vec<SubscriberStats> {
        self.engine.subs.stats()
    }

    /// Stops the client's background threads (the subscribers that wake waiters, the
    /// watchdog that renews leases, and the cleanup thread that gives back holds whose
    /// reply was lost) and waits up to `timeout` for them to end. The cleanup thread makes
    /// the releases queued and gives up those it was trying again after a network error
    /// (their keys expire with their lease); a release that fails after the shutdown is
    /// left to the key's lease at once.
    ///
    /// Dropping the last clone of a client and its last guard stops them too; this is
    /// for a caller who wants to know they are gone, for example before a fork or at the
    /// end of a test. Locks held when it is called are no longer renewed, and their
    /// guards are told at once that they are lost
    /// ([`LostReason::WatchdogFailed`](crate::LostReason::WatchdogFailed)): release them
    /// first. Afterwards no clone of this client takes a new hold: calls for one return
    /// [`Error::ShutDown`], and a wait under way that wins the lock returns a guard already
    /// told it is lost ([`LostReason::WatchdogFailed`](crate::LostReason::WatchdogFailed)),
    /// its waiters woken meanwhile only by their lease timers and re-checks. Releases,
    /// latch counts and `inspect` still work.
    ///
    /// # Errors
    ///
    /// [`Error::Timeout`] if a thread was still running when `timeout` passed (it ends
    /// on its own once its current Redis call returns).
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// client.with_lock("report", || ())?;
    /// client.shutdown(Duration::from_secs(5))?;
    /// # Ok(()) }
    /// ```
    pub fn shutdown(self, timeout: Duration) -> Result<()> {
        let now = Instant::now();
        let deadline = now
            .checked_add(timeout)
            .unwrap_or(now + Duration::from_secs(3600));
        if self.engine.shutdown(deadline) {
            Ok(())
        } else {
            Err(Error::Timeout)
        }
    }

    /// The engine behind the client (for the other primitives' handles).
    pub(crate) fn engine(&self) -> &Arc<Engine> {
        &self.engine
    }

    fn acquire(&self, name: &[u8], wait: Wait<'_>) -> Result<LockGuard> {
        let (remote, seq) = self.engine.acquire(name, wait)?;
        Ok(LockGuard::new(self.engine.clone(), remote, seq))
    }
}
