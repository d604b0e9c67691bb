//! `Cancel`: a token with which another thread ends a wait for a lock, a read or write
//! hold, a permit, or a latch to open.
//!
//! The token is a flag and the wakers of the waits sleeping on it (`local::mailbox`'s
//! `Cancellation`). Every wait checks the flag where it checks its deadline and ends as a
//! wait whose deadline passed: out of the local queue, out of the fair queue, its contention
//! mark taken with it, with [`Error::Cancelled`](crate::Error::Cancelled) instead of
//! [`Error::Timeout`](crate::Error::Timeout). A hold won before the wait saw the flag is
//! kept and returned: cancelling never takes a hold away.

use std::sync::Arc;

use crate::engine::contest::Wait;
use crate::local::mailbox::Cancellation;

/// A cancellation token for the `*_cancellable` waits
/// ([`LockClient::lock_cancellable`](crate::LockClient::lock_cancellable),
/// [`LockClient::multi_lock_cancellable`](crate::LockClient::multi_lock_cancellable),
/// [`RwLock::read_cancellable`](crate::RwLock::read_cancellable),
/// [`RwLock::upgradable_read_cancellable`](crate::RwLock::upgradable_read_cancellable),
/// [`RwLock::write_cancellable`](crate::RwLock::write_cancellable),
/// [`Semaphore::acquire_cancellable`](crate::Semaphore::acquire_cancellable),
/// [`Latch::wait_cancellable`](crate::Latch::wait_cancellable)).
///
/// Clones share one flag: cancel any clone, and every wait given any of them ends with
/// [`Error::Cancelled`](crate::Error::Cancelled) at its next wake-up, which
/// [`cancel`](Cancel::cancel) causes at once (a wait is not polling the flag). The flag
/// stays set: a call given a cancelled token returns
/// [`Error::Cancelled`](crate::Error::Cancelled) at once, without contacting Redis. Use a
/// new token for each operation you may want to cancel.
///
/// A wait that got its hold before it saw the flag returns the guard: the acquisition
/// wins, and cancelling never ends a hold already taken. A cancelled wait leaves nothing
/// behind (no local queue entry, no fair-queue entry, no contention mark), as a timed-out
/// wait does; a latch a wait made stays until its TTL ends (see
/// [`Latch::wait_cancellable`](crate::Latch::wait_cancellable)).
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// # fn main() -> Result<(), redbaton::Error> {
/// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
/// let held = client.lock("jobs")?;
/// let cancel = redbaton::Cancel::new();
/// std::thread::scope(|s| {
///     let waiter = s.spawn(|| client.lock_cancellable("jobs", &cancel).map(drop));
///     std::thread::sleep(Duration::from_millis(50));
///     cancel.cancel(); // e.g. the user pressed Ctrl-C
///     assert!(waiter.join().unwrap().unwrap_err().is_cancelled());
/// });
/// # drop(held);
/// # Ok(()) }
/// ```
#[derive(Clone, Default)]
pub struct Cancel(Arc<Cancellation>);

impl Cancel {
    /// A token not cancelled yet.
    ///
    /// # Examples
    ///
    /// ```
    /// let cancel = redbaton::Cancel::new();
    /// assert!(!cancel.is_cancelled());
    /// assert_eq!(format!("{cancel:?}"), "Cancel { cancelled: false, waiting: 0 }");
    /// ```
    pub fn new() -> Self {
        Cancel::default()
    }

    /// Cancels every wait given this token (or a clone of it), now and later. Calling it
    /// again does nothing.
    ///
    /// # Examples
    ///
    /// ```
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// let cancel = redbaton::Cancel::new();
    /// cancel.cancel();
    /// cancel.cancel(); // harmless
    /// let e = client.lock_cancellable("jobs", &cancel).unwrap_err();
    /// assert!(e.is_cancelled());
    /// # Ok(()) }
    /// ```
    pub fn cancel(&self) {
        self.0.cancel();
    }

    /// Whether [`cancel`](Self::cancel) was called on this token or a clone of it.
    ///
    /// # Examples
    ///
    /// ```
    /// let cancel = redbaton::Cancel::new();
    /// let clone = cancel.clone();
    /// clone.cancel();
    /// assert!(cancel.is_cancelled());
    /// ```
    pub fn is_cancelled(&self) -> bool {
        self.0.is_cancelled()
    }

    /// The wait policy of a cancellable call without a deadline. A call given a token
    /// cancelled already returns [`Error::Cancelled`](crate::Error::Cancelled) without
    /// sending anything: the engine checks, so that a call for a hold records its wait as
    /// any other.
    pub(crate) fn wait(&self) -> Wait<'_> {
        Wait::Until(None, Some(&self.0))
    }
}

impl std::fmt::Debug for Cancel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cancel")
            .field("cancelled", &self.is_cancelled())
            .field("waiting", &self.0.waiting())
            .finish()
    }
}
