//! The guard a holder keeps while in its critical section.

use std::marker::PhantomData;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::Receiver;

use crate::api::detached::{Detached, DetachedGuard, extend_checked, release_on_drop};
use crate::engine::acquire::path_of;
use crate::engine::shared_hold::Hold;
use crate::engine::state::Engine;
use crate::error::{Error, LostReason, Result, Unlocked};
use crate::fencing;
use crate::local::held::RemoteLock;
use crate::stats::HoldKind;

/// Proof that this thread holds a lock. Dropping it releases the lock (best effort, never
/// panicking, also while unwinding); [`unlock`](LockGuard::unlock) does the same and says
/// what happened.
///
/// A guard is not `Send`: the lock belongs to the thread that took it (that is how a thread
/// asking again for a lock it holds gets [`Error::WouldDeadlock`] instead of waiting for
/// itself, and how the baton knows whom it was passed to). To release it from another
/// thread, [`detach`](LockGuard::detach) it first.
///
/// # Losing the lock
///
/// A lease can run out under a holder: the process paused longer than the lease, Redis was
/// unreachable for the watchdog, the key was deleted by hand, the server restarted empty.
/// The holder learns it without asking Redis, through [`is_lost`](LockGuard::is_lost),
/// [`check`](LockGuard::check) and the channel [`lost`](LockGuard::lost). Two policies:
///
/// *Conservative*: check between steps and stop when the lock is gone.
///
/// ```
/// # fn main() -> Result<(), redbaton::Error> {
/// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
/// # let steps: Vec<fn()> = vec![];
/// let guard = client.lock("migration")?;
/// for step in steps {
///     guard.check()?; // Err(Error::Lost(_)) once the lock is gone: stop here
///     step();
/// }
/// # Ok(()) }
/// ```
///
/// *Aggressive*: carry on knowingly, and let the protected resource reject stale writers by
/// their [fencing token](LockGuard::fencing_token).
///
/// ```
/// use crossbeam_channel::select;
/// use std::time::Duration;
/// # fn main() -> Result<(), redbaton::Error> {
/// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
/// # let work = crossbeam_channel::after(Duration::from_millis(10));
/// let guard = client.lock("migration")?;
/// select! {
///     recv(guard.lost()) -> reason => eprintln!("lock lost ({reason:?}); finishing, fenced"),
///     recv(work) -> _ => {}
/// }
/// # Ok(()) }
/// ```
#[must_use = "the lock is released as soon as the guard is dropped"]
pub struct LockGuard {
    client: Arc<Engine>,
    remote: Arc<RemoteLock>,
    seq: u32,
    /// When this holder got the lock, for its hold time (see `stats`).
    since: Instant,
    lost_rx: Receiver<LostReason>,
    released: bool,
    /// Not `Send`, not `Sync`: see the type's docs.
    _not_send: PhantomData<*const ()>,
}

impl std::fmt::Debug for LockGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LockGuard")
            .field("name", &self.remote.keys.display())
            .field("fencing_token", &self.fencing_token())
            .finish_non_exhaustive()
    }
}

impl LockGuard {
    pub(crate) fn new(client: Arc<Engine>, remote: Arc<RemoteLock>, seq: u32) -> Self {
        let (tx, lost_rx) = crossbeam_channel::bounded(1);
        remote.set_listener(tx);
        LockGuard {
            client,
            remote,
            seq,
            since: Instant::now(),
            lost_rx,
            released: false,
            _not_send: PhantomData,
        }
    }

    /// The lock's name, as given (names are bytes; see [`MAX_NAME_LEN`](crate::MAX_NAME_LEN)).
    ///
    /// # Examples
    ///
    /// ```
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// let guard = client.lock("orders:42")?;
    /// assert_eq!(guard.name(), b"orders:42");
    /// # Ok(()) }
    /// ```
    pub fn name(&self) -> &[u8] {
        self.remote.keys.name()
    }

    /// A number that grows with every holder of this name, for the protected resource to
    /// refuse writes from an older holder (one whose lease ran out while it was paused).
    ///
    /// It is `(fence << 12) | handoff`, where `fence` comes from a Redis counter incremented
    /// by every acquisition in Redis, and `handoff` numbers the local handoffs of that
    /// acquisition (at most 2^12 - 1 of them before the lock goes back through Redis). On one
    /// node it strictly increases across all holders, local and remote, also when the
    /// counter expires or is evicted: a new counter starts at the server's clock in
    /// microseconds (see [`Builder::fence_ttl`](crate::Builder::fence_ttl) for what this
    /// rests on). For Redlock it is the highest counter of the granting
    /// nodes, written back to them; it keeps increasing unless a majority of nodes lose
    /// their data (see the crate docs).
    ///
    /// # Examples
    ///
    /// ```
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// let first = client.lock("k")?.fencing_token();
    /// let second = client.lock("k")?.fencing_token();
    /// assert!(second > first);
    /// # Ok(()) }
    /// ```
    pub fn fencing_token(&self) -> u64 {
        fencing::token(self.remote.fence, self.seq)
    }

    /// Whether the hold before this one ended without a release: its holder's lease ran
    /// out (it crashed, stalled past its lease, or lost Redis for longer) or its key was
    /// deleted ([`force_release`](crate::LockClient::force_release), by hand). Like a
    /// poisoned [`std::sync::Mutex`]: what that holder was changing may be half-changed,
    /// so check or repair it before relying on it. False after a release, and for a lock
    /// handed to this thread by another thread of this process (the baton: a clean
    /// release).
    ///
    /// The acquisition reads it from the name's fence counter, which says whether its last
    /// hold was released: no extra round trip or command. It errs on the side of caution,
    /// and can say true when no thread of any process used the hold that expired (an
    /// attempt whose reply was lost and that could not be given back; a release sent while
    /// a Redis Cluster slot migrates). It says false when the counter is gone (the first
    /// acquisition of a name, or after [`fence_ttl`](crate::Builder::fence_ttl) idle, an
    /// eviction, a restart without data): there is nothing left to tell. With Redlock it
    /// is true when any node that granted the lock saw a hold end without a release.
    ///
    /// # Examples
    ///
    /// ```
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// client.lock("previous-lost-doc")?.unlock()?;
    /// let guard = client.lock("previous-lost-doc")?;
    /// assert!(!guard.previous_lost(), "the last holder released it");
    /// if guard.previous_lost() {
    ///     // The last holder died inside: check what it was changing first.
    /// }
    /// # Ok(()) }
    /// ```
    pub fn previous_lost(&self) -> bool {
        self.remote.previous_lost_for(path_of(self.seq))
    }

    /// Until when the lock is surely held: when the last successful acquisition or lease
    /// change was sent, plus its lease, minus a clock-drift margin (lease × 1% + 2 ms). A
    /// change whose outcome is unknown (an [`extend`](LockGuard::extend) that failed on a
    /// lost reply) may have been applied: it can bring this forward, never push it back.
    /// Once the lock is known lost ([`check`](LockGuard::check) says why), this is no later
    /// than when that was found: another holder may be in. With a cap on the hold
    /// ([`max_hold`](crate::Builder::max_hold)), it is no later than the cap either: from
    /// then on `check` fails.
    ///
    /// The lock's validity is kept on a clock that counts while the machine is suspended
    /// (`CLOCK_BOOTTIME` on Linux and Android, `CLOCK_MONOTONIC` on Apple platforms; on
    /// Windows `Instant` counts through sleep already; elsewhere it is `Instant`, which may
    /// not): a holder resumed after its lease ran out finds the lock lost. The `Instant`
    /// returned is as far from `Instant::now()` as the validity is from now on that clock.
    ///
    /// # Examples
    ///
    /// ```
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// let guard = client.lock("k")?;
    /// assert!(guard.valid_until() > std::time::Instant::now());
    /// # Ok(()) }
    /// ```
    pub fn valid_until(&self) -> Instant {
        self.remote.valid_until()
    }

    /// Whether the lock is known to be lost. Never asks Redis.
    ///
    /// # Examples
    ///
    /// ```
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// let guard = client.lock("k")?;
    /// if guard.is_lost() {
    ///     return Ok(()); // stop: someone else may hold it
    /// }
    /// # Ok(()) }
    /// ```
    pub fn is_lost(&self) -> bool {
        self.remote.lost(&self.client.counters).is_some()
    }

    /// A channel that receives the [`LostReason`] once, when the lock is lost (and is never
    /// sent anything otherwise): `select!` on it next to your work.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// let guard = client.lock("k")?;
    /// if let Ok(reason) = guard.lost().recv_timeout(Duration::from_millis(10)) {
    ///     eprintln!("lost: {reason}");
    /// }
    /// # Ok(()) }
    /// ```
    pub fn lost(&self) -> &Receiver<LostReason> {
        &self.lost_rx
    }

    /// `Ok(())` while the lock is held, [`Error::Lost`] once it is known lost.
    ///
    /// # Errors
    ///
    /// [`Error::Lost`] with the reason, once the lock is known lost.
    ///
    /// # Examples
    ///
    /// ```
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// let guard = client.lock("k")?;
    /// guard.check()?;
    /// # Ok(()) }
    /// ```
    pub fn check(&self) -> Result<()> {
        match self.remote.lost(&self.client.counters) {
            Some(reason) => Err(Error::Lost(reason)),
            None => Ok(()),
        }
    }

    /// Sets the lock's remaining lease to `lease` now (the watchdog then keeps renewing at a
    /// third of it).
    ///
    /// Lease changes of one lock are ordered in Redis: a renewal delayed on the way cannot
    /// land after this one and cut it short. When the outcome is unknown (an error after
    /// the request may have reached Redis), the new lease may be in force: the validity
    /// becomes the earlier of the old one and what this lease would give (see
    /// [`valid_until`](LockGuard::valid_until)), and the watchdog renews with the new lease
    /// soon after.
    ///
    /// `lease` must be within the range the builder's [`lease`](crate::Builder::lease)
    /// accepts, 10 ms to 24 h: shorter could not be renewed in time, longer is taken for a
    /// mistake (`Duration::MAX` meant as "forever").
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a lease outside 10 ms ..= 24 h (nothing is sent),
    /// [`Error::Lost`] if the lock is no longer ours, [`Error::Redis`] (or
    /// [`Error::PoolExhausted`]) when too few nodes answered to tell (Redis Cluster: after
    /// retrying through a failover while the lease lasted).
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// let guard = client.lock("k")?;
    /// guard.extend(Duration::from_secs(120))?;
    /// # Ok(()) }
    /// ```
    pub fn extend(&self, lease: Duration) -> Result<()> {
        extend_checked(&self.client, &self.remote, lease)
    }

    /// Takes the lock out of this thread's hands: the [`DetachedGuard`] returned keeps it
    /// in Redis (same token, fence, lease, watchdog renewals and lost signal) and may be
    /// sent to another thread, which can check, extend and release it.
    ///
    /// The lock leaves the local handoff for good: it is never handed to another thread of
    /// this process, and the threads of this process waiting for the name stop waiting
    /// behind it locally: they contend in Redis like any other process, and get the lock
    /// (with a higher fencing token) once the detached guard has released it there. This
    /// thread no longer holds the lock either: asking for it again waits for the detached
    /// guard like everyone else (a thread that waits for a detached guard it must release
    /// itself waits until its own deadline: the watchdog keeps renewing the detached lease).
    ///
    /// # Examples
    ///
    /// ```
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// let guard = client.lock("report")?;
    /// let token = guard.fencing_token();
    /// let detached = guard.detach();
    /// assert_eq!(detached.fencing_token(), token);
    /// let outcome = std::thread::spawn(move || detached.unlock()).join().unwrap()?;
    /// assert_eq!(outcome, redbaton::Unlocked::Released);
    /// # Ok(()) }
    /// ```
    pub fn detach(mut self) -> DetachedGuard {
        self.released = true;
        self.client.table.detach(&self.remote);
        let hold = Hold {
            remote: self.remote.clone(),
            sharer: 0,
            token: self.fencing_token(),
            path: path_of(self.seq),
            since: self.since,
        };
        let (engine, lost_rx) = (self.client.clone(), self.lost_rx.clone());
        DetachedGuard::new(Detached::new(engine, hold, HoldKind::Lock, lost_rx))
    }

    /// Releases the lock — to the next waiting thread of this process when the baton
    /// allows, else in Redis — and says what happened.
    ///
    /// # Errors
    ///
    /// Redis errors when too few nodes answered to tell whether the lock was released (it
    /// then expires with its lease; Redis Cluster: after retrying through a failover while
    /// the lease lasted). A lock that had expired or was taken by another owner is not an
    /// error: see [`Unlocked`].
    ///
    /// # Examples
    ///
    /// ```
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// let guard = client.lock("k")?;
    /// let outcome = guard.unlock()?;
    /// assert!(outcome.was_held());
    /// # Ok(()) }
    /// ```
    pub fn unlock(mut self) -> Result<Unlocked> {
        self.released = true;
        self.let_go()
    }

    /// Records the hold's time and gives the lock on.
    fn let_go(&self) -> Result<Unlocked> {
        let path = path_of(self.seq);
        self.client
            .counters
            .released(HoldKind::Lock, path, self.since);
        self.client.release(&self.remote)
    }
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        if !self.released {
            release_on_drop(format_args!("{:?}", self.remote.keys.display()), || {
                self.let_go()
            });
        }
    }
}
