//! Semaphores: at most N holders across all processes.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::Receiver;

use crate::api::cancel::Cancel;
use crate::api::client::LockClient;
use crate::api::rwlock::{Kind, SharedGuard, shared_guard_methods};
use crate::engine::contest::Wait;
use crate::engine::state::Engine;
use crate::error::{LostReason, Result, Unlocked};

impl LockClient {
    /// A semaphore named `name` with `permits` permits: at most that many holders at once
    /// across all processes. Nothing is sent to Redis until a permit is asked for.
    ///
    /// The permit count is stored with the holds: while any permit is held, asking with
    /// another count fails with [`Error::PermitsMismatch`](crate::Error::PermitsMismatch)
    /// (when none is held, the next holder's count is the one). The name shares its key
    /// with a plain lock and a read-write lock of the same name: while it is held as one
    /// kind, asking for it as another fails with [`Error::WrongKind`](crate::Error::WrongKind).
    /// Not available on a Redlock client.
    ///
    /// # Examples
    ///
    /// ```
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// let quota = client.semaphore("api-quota", 2);
    /// let a = quota.acquire()?;
    /// let b = quota.acquire()?;
    /// assert!(quota.try_acquire().unwrap_err().is_would_block());
    /// # Ok(()) }
    /// ```
    pub fn semaphore(&self, name: impl AsRef<[u8]>, permits: u32) -> Semaphore {
        Semaphore {
            engine: self.engine().clone(),
            name: name.as_ref().to_vec(),
            permits,
        }
    }
}

/// A distributed counting semaphore (see [`LockClient::semaphore`]).
///
/// Each permit is a hold of its own in Redis with its own lease, renewed by the client's
/// watchdog: a crashed holder's permit returns when its lease ends. Waiters sleep until a
/// permit is released (no polling) or the earliest permit's lease runs out. A released
/// permit goes to one waiting process, the one waiting longest, not to all of them: the
/// release grants it to that process in Redis, where it is held for it for a short grant
/// lease (the releasing client's lease, at most one second) until it takes it, so that a
/// second release goes to the next one. Meanwhile nobody else gets that permit; a waiter
/// that gives up passes it on, and one that died holds it until the grant lease ends (the
/// others find it free at their next re-check). In a process, one thread at a time waits
/// for a permit in Redis (unless local handoff is off). Permits are not shared between
/// threads, and a thread asking for a second permit simply takes one more.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// # fn main() -> Result<(), redbaton::Error> {
/// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
/// let sem = client.semaphore("api-quota", 3);
/// let permit = sem.try_acquire_for(Duration::from_secs(1))?;
/// permit.check()?;
/// permit.unlock()?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Semaphore {
    engine: Arc<Engine>,
    name: Vec<u8>,
    permits: u32,
}

impl std::fmt::Debug for Semaphore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Semaphore")
            .field("name", &String::from_utf8_lossy(&self.name))
            .field("permits", &self.permits)
            .finish_non_exhaustive()
    }
}

impl Semaphore {
    /// Waits until a permit is ours.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidName`](crate::Error::InvalidName);
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for zero permits;
    /// [`Error::PermitsMismatch`](crate::Error::PermitsMismatch);
    /// [`Error::WrongKind`](crate::Error::WrongKind);
    /// [`Error::Unsupported`](crate::Error::Unsupported) on a Redlock client; Redis errors.
    ///
    /// # Examples
    ///
    /// ```
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// let permit = client.semaphore("api-quota", 3).acquire()?;
    /// # Ok(()) }
    /// ```
    pub fn acquire(&self) -> Result<Permit> {
        self.acquire_with(Wait::Until(None, None))
    }

    /// A permit if one is free right now.
    ///
    /// # Errors
    ///
    /// [`Error::WouldBlock`](crate::Error::WouldBlock) when every permit is held;
    /// otherwise as [`acquire`](Self::acquire).
    ///
    /// # Examples
    ///
    /// ```
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// let sem = client.semaphore("api-quota", 1);
    /// let p = sem.try_acquire()?;
    /// assert!(sem.try_acquire().unwrap_err().is_would_block());
    /// # Ok(()) }
    /// ```
    pub fn try_acquire(&self) -> Result<Permit> {
        self.acquire_with(Wait::No)
    }

    /// Waits at most `timeout` for a permit.
    ///
    /// # Errors
    ///
    /// [`Error::Timeout`](crate::Error::Timeout) when none was free in time; otherwise as
    /// [`acquire`](Self::acquire).
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// let p = client.semaphore("api-quota", 3).try_acquire_for(Duration::from_secs(1))?;
    /// # Ok(()) }
    /// ```
    pub fn try_acquire_for(&self, timeout: Duration) -> Result<Permit> {
        self.acquire_with(Wait::Until(Instant::now().checked_add(timeout), None))
    }

    /// Waits until `deadline` at most for a permit.
    ///
    /// # Errors
    ///
    /// [`Error::Timeout`](crate::Error::Timeout) when none was free by `deadline`;
    /// otherwise as [`acquire`](Self::acquire).
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::{Duration, Instant};
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// let deadline = Instant::now() + Duration::from_secs(1);
    /// let p = client.semaphore("api-quota", 3).try_acquire_until(deadline)?;
    /// # Ok(()) }
    /// ```
    pub fn try_acquire_until(&self, deadline: Instant) -> Result<Permit> {
        self.acquire_with(Wait::Until(Some(deadline), None))
    }

    /// Waits until a permit is ours or `cancel` is cancelled (see [`Cancel`] and
    /// [`LockClient::lock_cancellable`]: a cancelled wait leaves nothing behind; a permit
    /// taken first is returned).
    ///
    /// # Errors
    ///
    /// [`Error::Cancelled`](crate::Error::Cancelled) when the wait was cancelled (at once,
    /// without contacting Redis, if it was before the call); otherwise as
    /// [`acquire`](Self::acquire).
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// let sem = client.semaphore("api-quota", 1);
    /// let only = sem.acquire()?;
    /// let cancel = redbaton::Cancel::new();
    /// std::thread::scope(|s| {
    ///     let waiter = s.spawn(|| sem.acquire_cancellable(&cancel).map(drop));
    ///     std::thread::sleep(Duration::from_millis(50));
    ///     cancel.cancel();
    ///     assert!(waiter.join().unwrap().unwrap_err().is_cancelled());
    /// });
    /// # Ok(()) }
    /// ```
    pub fn acquire_cancellable(&self, cancel: &Cancel) -> Result<Permit> {
        self.acquire_with(cancel.wait())
    }

    fn acquire_with(&self, wait: Wait<'_>) -> Result<Permit> {
        let hold = self.engine.permit(&self.name, self.permits, wait)?;
        Ok(Permit(SharedGuard::new(
            self.engine.clone(),
            hold,
            Kind::Permit,
        )))
    }
}

/// One permit of a [`Semaphore`], leased and renewed like a lock. Dropping it gives it
/// back (best effort, never panicking); [`unlock`](Permit::unlock) does the same and says
/// what happened. Not `Send`.
///
/// # Examples
///
/// ```
/// # fn main() -> Result<(), redbaton::Error> {
/// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
/// let permit = client.semaphore("api-quota", 3).acquire()?;
/// permit.check()?;
/// drop(permit); // given back
/// # Ok(()) }
/// ```
#[must_use = "the permit is given back as soon as it is dropped"]
pub struct Permit(SharedGuard);

impl std::fmt::Debug for Permit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Permit")
            .field("name", &String::from_utf8_lossy(self.0.name()))
            .finish_non_exhaustive()
    }
}

impl Permit {
    shared_guard_methods!("permit", "client.semaphore(\"api-quota\", 3).acquire()");

    /// Gives the permit back and says what happened.
    ///
    /// # Errors
    ///
    /// Redis errors when the release could not be confirmed (the permit then returns when
    /// its lease ends).
    ///
    /// # Examples
    ///
    /// ```
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// let permit = client.semaphore("api-quota", 3).acquire()?;
    /// assert!(permit.unlock()?.was_held());
    /// # Ok(()) }
    /// ```
    pub fn unlock(self) -> Result<Unlocked> {
        self.0.unlock()
    }
}
