//! Guards that move: a lock or write hold taken out of the local handoff, so that another
//! thread may release it.
//!
//! A [`LockGuard`](crate::LockGuard) or [`WriteGuard`](crate::WriteGuard) belongs to the
//! thread that took it, because on release the lock may be handed to the next local thread
//! waiting for the same name without asking Redis. Detaching leaves that local handoff:
//! the thread's place in the local table (or the read-write turns) is given up, the local
//! waiters contend in Redis like any other process, and the hold itself (token, fence,
//! lease, watchdog renewals, lost signal) stays with the detached guard, which is released
//! in Redis only, from whichever thread has it.
//!
//! Two types rather than one: a detached lock can [`extend`](DetachedGuard::extend) its
//! lease like a [`LockGuard`](crate::LockGuard), while a write hold keeps its lease for
//! life (its renewals are not numbered in Redis, see `rw_scripts::SHARED_EXTEND`, so an
//! extend could be undone by a late renewal) and is released with the read-write protocol.
//! Both share one implementation.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::Receiver;

use crate::config::{MAX_LEASE, MIN_LEASE};
use crate::engine::shared_hold::Hold;
use crate::engine::state::Engine;
use crate::error::{Error, LostReason, Result, Unlocked};
use crate::local::held::RemoteLock;
use crate::stats::HoldKind;

/// The state behind a detached guard: the hold (its remote lock, token and when and how
/// it was got), its lost channel, and release on drop. Never in the local table.
pub(crate) struct Detached {
    engine: Arc<Engine>,
    hold: Hold,
    /// What is held ([`HoldKind::Lock`] or [`HoldKind::Write`]), which says how it is
    /// released.
    kind: HoldKind,
    lost_rx: Receiver<LostReason>,
    released: bool,
}

impl Detached {
    /// A detached `hold` (its hold time goes on). The caller has already taken it out of
    /// the local table or turns.
    pub(crate) fn new(
        engine: Arc<Engine>,
        hold: Hold,
        kind: HoldKind,
        lost_rx: Receiver<LostReason>,
    ) -> Self {
        Detached {
            engine,
            hold,
            kind,
            lost_rx,
            released: false,
        }
    }

    /// The guard named `ty`, for `Debug`: its name and fencing token.
    fn fmt_as(&self, ty: &str, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct(ty)
            .field("name", &self.hold.remote.keys.display())
            .field("fencing_token", &self.hold.token)
            .finish_non_exhaustive()
    }

    fn check(&self) -> Result<()> {
        match self.hold.remote.lost(&self.engine.counters) {
            Some(reason) => Err(Error::Lost(reason)),
            None => Ok(()),
        }
    }

    fn unlock(mut self) -> Result<Unlocked> {
        self.released = true;
        self.release()
    }

    /// Records the hold's time and releases it in Redis (never locally).
    fn release(&self) -> Result<Unlocked> {
        self.engine
            .counters
            .released(self.kind, self.hold.path, self.hold.since);
        match self.kind {
            HoldKind::Write => self.engine.release_shared(&self.hold.remote),
            _ => self.engine.release_detached(&self.hold.remote),
        }
    }
}

impl Drop for Detached {
    fn drop(&mut self) {
        if !self.released {
            release_on_drop(
                format_args!("{:?}", self.hold.remote.keys.display()),
                || self.release(),
            );
        }
    }
}

/// Runs a guard's release on drop and logs what it did, when it is worth a warning;
/// `what` names the guard's hold in the messages (a lock's name, a multi-lock's names).
/// It never panics: the guard may be dropped while its thread unwinds, where a second
/// panic aborts the process. A panic of the release itself (a bug) is caught and logged;
/// the hold is then given back in the background, or ends with its lease at the latest.
pub(crate) fn release_on_drop(
    what: impl std::fmt::Display,
    release: impl FnOnce() -> Result<Unlocked>,
) {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(release)) {
        Ok(Ok(outcome)) if outcome.was_held() => {}
        Ok(Ok(outcome)) => log::warn!("{what} dropped but it was not held: {outcome}"),
        Ok(Err(e)) => log::warn!("{what}: release on drop failed (it expires with its lease): {e}"),
        Err(_) => log::error!(
            "{what}: release on drop panicked (it expires with its lease at the latest)"
        ),
    }
}

/// The methods both detached guards have, documented with `$what` naming what the guard
/// holds and `$get` the example's way to get one.
macro_rules! detached_methods {
    ($what:literal, $get:literal) => {
        #[doc = concat!("The ", $what, "'s name, as given.")]
        ///
        /// # Examples
        ///
        /// ```
        /// # fn main() -> Result<(), redbaton::Error> {
        /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
        #[doc = concat!("let guard = ", $get, "?.detach();")]
        /// assert_eq!(guard.name(), b"report");
        /// # Ok(()) }
        /// ```
        pub fn name(&self) -> &[u8] {
            self.0.hold.remote.keys.name()
        }

        #[doc = concat!("The ", $what, "'s fencing token: the one it had before it was detached.")]
        ///
        /// # Examples
        ///
        /// ```
        /// # fn main() -> Result<(), redbaton::Error> {
        /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
        #[doc = concat!("let guard = ", $get, "?;")]
        /// let token = guard.fencing_token();
        /// assert_eq!(guard.detach().fencing_token(), token);
        /// # Ok(()) }
        /// ```
        pub fn fencing_token(&self) -> u64 {
            self.0.hold.token
        }

        #[doc = concat!("Whether the hold before this ", $what, " ended without a release (its lease ran out, or its key was deleted): what the guard said before it was detached (see [`LockGuard::previous_lost`](crate::LockGuard::previous_lost)).")]
        ///
        /// # Examples
        ///
        /// ```
        /// # fn main() -> Result<(), redbaton::Error> {
        /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
        #[doc = concat!("let guard = ", $get, "?;")]
        /// let lost = guard.previous_lost();
        /// assert_eq!(guard.detach().previous_lost(), lost);
        /// # Ok(()) }
        /// ```
        pub fn previous_lost(&self) -> bool {
            self.0.hold.previous_lost()
        }

        #[doc = concat!("Until when the ", $what, " is surely held: its acquisition or last lease change, plus the lease, minus a drift margin (lease × 1% + 2 ms), and no later than the hold's cap ([`max_hold`](crate::Builder::max_hold)); once it is known lost, no later than when that was found.")]
        ///
        /// # Examples
        ///
        /// ```
        /// # fn main() -> Result<(), redbaton::Error> {
        /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
        #[doc = concat!("let guard = ", $get, "?.detach();")]
        /// assert!(guard.valid_until() > std::time::Instant::now());
        /// # Ok(()) }
        /// ```
        pub fn valid_until(&self) -> Instant {
            self.0.hold.remote.valid_until()
        }

        #[doc = concat!("Whether the ", $what, " is known to be lost. Never asks Redis.")]
        ///
        /// # Examples
        ///
        /// ```
        /// # fn main() -> Result<(), redbaton::Error> {
        /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
        #[doc = concat!("let guard = ", $get, "?.detach();")]
        /// assert!(!guard.is_lost());
        /// # Ok(()) }
        /// ```
        pub fn is_lost(&self) -> bool {
            self.0.hold.remote.lost(&self.0.engine.counters).is_some()
        }

        #[doc = concat!("`Ok(())` while the ", $what, " is held, [`Error::Lost`](crate::Error::Lost) once it is known lost. Never asks Redis.")]
        ///
        /// # Errors
        ///
        #[doc = concat!("[`Error::Lost`](crate::Error::Lost) with the reason, once the ", $what, " is known lost.")]
        ///
        /// # Examples
        ///
        /// ```
        /// # fn main() -> Result<(), redbaton::Error> {
        /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
        #[doc = concat!("let guard = ", $get, "?.detach();")]
        /// std::thread::spawn(move || guard.check()).join().unwrap()?;
        /// # Ok(()) }
        /// ```
        pub fn check(&self) -> Result<()> {
            self.0.check()
        }

        #[doc = concat!("A channel that receives the [`LostReason`] once, when the ", $what, " is lost (the guard's channel from before it was detached: a reason sent then is still there).")]
        ///
        /// # Examples
        ///
        /// ```
        /// use std::time::Duration;
        /// # fn main() -> Result<(), redbaton::Error> {
        /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
        #[doc = concat!("let guard = ", $get, "?.detach();")]
        /// assert!(guard.lost().recv_timeout(Duration::from_millis(10)).is_err());
        /// # Ok(()) }
        /// ```
        pub fn lost(&self) -> &Receiver<LostReason> {
            &self.0.lost_rx
        }

        #[doc = concat!("Releases the ", $what, " in Redis (never to a local thread) and says what happened.")]
        ///
        /// # Errors
        ///
        /// Redis errors when too few nodes answered to tell whether it was released (it
        /// then expires with its lease). A hold that had expired or was taken by another
        /// owner is not an error: see [`Unlocked`].
        ///
        /// # Examples
        ///
        /// ```
        /// # fn main() -> Result<(), redbaton::Error> {
        /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
        #[doc = concat!("let guard = ", $get, "?.detach();")]
        /// let released = std::thread::spawn(move || guard.unlock()).join().unwrap()?;
        /// assert_eq!(released, redbaton::Unlocked::Released);
        /// # Ok(()) }
        /// ```
        pub fn unlock(self) -> Result<Unlocked> {
            self.0.unlock()
        }
    };
}

/// A lock out of the local handoff: it may move to, and be released from, any thread
/// (see [`LockGuard::detach`](crate::LockGuard::detach)). It keeps the lock in Redis with
/// the same token, fence, lease, watchdog renewals and lost signal; it is never handed to
/// a local thread. Dropping it releases the lock in Redis (best effort, logging, never
/// panicking); [`unlock`](DetachedGuard::unlock) does the same and says what happened.
///
/// # Examples
///
/// ```
/// # fn main() -> Result<(), redbaton::Error> {
/// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
/// let guard = client.lock("report")?.detach();
/// let token = guard.fencing_token();
/// let worker = std::thread::spawn(move || {
///     guard.check()?; // still ours?
///     // ... write, with `token`, to the storage the lock protects ...
///     guard.unlock()
/// });
/// assert!(worker.join().unwrap()?.was_held());
/// # let _ = token;
/// # Ok(()) }
/// ```
#[must_use = "the lock is released as soon as the guard is dropped"]
pub struct DetachedGuard(Detached);

/// A read-write lock's write hold out of the local turns: it may move to, and be released
/// from, any thread (see [`WriteGuard::detach`](crate::WriteGuard::detach)). It keeps the
/// write hold in Redis with the same token, lease, watchdog renewals and lost signal; no
/// local reader or writer takes a turn on it. Dropping it releases the write hold in Redis
/// (best effort, logging, never panicking); [`unlock`](DetachedWriteGuard::unlock) does the
/// same and says what happened.
///
/// # Examples
///
/// ```
/// # fn main() -> Result<(), redbaton::Error> {
/// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
/// let guard = client.rwlock("report").write()?.detach();
/// let worker = std::thread::spawn(move || guard.unlock());
/// assert!(worker.join().unwrap()?.was_held());
/// # Ok(()) }
/// ```
#[must_use = "the write hold is released as soon as the guard is dropped"]
pub struct DetachedWriteGuard(Detached);

impl DetachedGuard {
    pub(crate) fn new(inner: Detached) -> Self {
        DetachedGuard(inner)
    }

    detached_methods!("lock", "client.lock(\"report\")");

    /// Sets the lock's remaining lease to `lease` now, as
    /// [`LockGuard::extend`](crate::LockGuard::extend) does (the watchdog then keeps
    /// renewing at a third of it).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a lease outside 10 ms ..= 24 h (nothing is sent),
    /// [`Error::Lost`] if the lock is no longer ours, [`Error::Redis`] (or
    /// [`Error::PoolExhausted`]) when too few nodes answered to tell.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// let guard = client.lock("report")?.detach();
    /// std::thread::spawn(move || guard.extend(Duration::from_secs(120))).join().unwrap()?;
    /// # Ok(()) }
    /// ```
    pub fn extend(&self, lease: Duration) -> Result<()> {
        extend_checked(&self.0.engine, &self.0.hold.remote, lease)
    }
}

impl DetachedWriteGuard {
    pub(crate) fn new(inner: Detached) -> Self {
        DetachedWriteGuard(inner)
    }

    detached_methods!("write hold", "client.rwlock(\"report\").write()");
}

/// Sets `remote`'s lease to `lease` after checking it is within the builder's range (see
/// [`LockGuard::extend`](crate::LockGuard::extend)).
pub(crate) fn extend_checked(
    engine: &Arc<Engine>,
    remote: &Arc<RemoteLock>,
    lease: Duration,
) -> Result<()> {
    if !(MIN_LEASE..=MAX_LEASE).contains(&lease) {
        return Err(Error::InvalidArgument(format!(
            "extend: lease {lease:?} outside {MIN_LEASE:?}..={MAX_LEASE:?}"
        )));
    }
    engine.extend(remote, lease)
}

impl std::fmt::Debug for DetachedGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt_as("DetachedGuard", f)
    }
}

impl std::fmt::Debug for DetachedWriteGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt_as("DetachedWriteGuard", f)
    }
}

/// Detached guards move between threads and may be shared by reference: checked here so
/// that a change of their insides that breaks it fails to build.
const _: fn() = || {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<DetachedGuard>();
    send_sync::<DetachedWriteGuard>();
};
