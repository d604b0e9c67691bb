//! Countdown latches: wait until N things happened, across processes.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::api::cancel::Cancel;
use crate::api::client::LockClient;
use crate::engine::contest::Wait;
use crate::engine::state::Engine;
use crate::error::Result;

/// The largest count a [`Latch`] accepts: the largest integer Redis's Lua numbers hold
/// exactly (2^53 − 1). A larger count, or zero, is
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument).
///
/// # Examples
///
/// ```
/// # fn main() -> Result<(), redbaton::Error> {
/// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
/// let too_big = client.latch("jobs-done", redbaton::MAX_LATCH_COUNT + 1);
/// assert!(too_big.count().unwrap_err().is_invalid_input());
/// # Ok(()) }
/// ```
pub const MAX_LATCH_COUNT: u64 = crate::proto::latch_scripts::MAX_COUNT;

impl LockClient {
    /// A countdown latch named `name` that opens once counted down `count` times, by any
    /// threads of any processes. Nothing is sent to Redis until it is used.
    ///
    /// The latch is made in Redis by whichever call touches it first
    /// ([`count_down`](Latch::count_down), [`count`](Latch::count) or a wait), with
    /// `count`; while it lives, a call with another count fails with
    /// [`Error::CountMismatch`](crate::Error::CountMismatch) and changes nothing. Once
    /// open it stays open (count 0, so that waiters that come late return at once) until
    /// it expires: its key lives [`latch_ttl`](crate::Builder::latch_ttl) (1 hour by
    /// default) after its creation or its last count down. After that the name is free:
    /// the next call makes a new latch, with its own count.
    ///
    /// The latch's key (`{prefix}{name}:latch`) is not the lock's: a name can be a lock
    /// and a latch at once. Not available on a Redlock client (independent masters
    /// cannot share one count): its calls fail with
    /// [`Error::Unsupported`](crate::Error::Unsupported).
    ///
    /// # Examples
    ///
    /// ```
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// let ready = client.latch("shards-loaded", 3);
    /// std::thread::scope(|s| {
    ///     for _ in 0..3 {
    ///         s.spawn(|| ready.count_down()); // e.g. one per shard, in other processes
    ///     }
    ///     ready.wait()
    /// })?;
    /// assert_eq!(ready.count()?, 0);
    /// # Ok(()) }
    /// ```
    pub fn latch(&self, name: impl AsRef<[u8]>, count: u64) -> Latch {
        Latch {
            engine: self.engine().clone(),
            name: name.as_ref().to_vec(),
            count,
        }
    }
}

/// A distributed countdown latch (see [`LockClient::latch`]), like Java's
/// `CountDownLatch` or Redisson's `RCountDownLatch`.
///
/// Waiters sleep until the count down that reaches zero publishes on the name's channel
/// (no polling): each waiter subscribes before it reads the count, and reads again on
/// each wake-up, at the client's [`recheck_interval`](crate::Builder::recheck_interval)
/// (a lost message costs a re-check, never a hang) and when the latch would expire (a
/// client that polls instead reads at each polling interval). The
/// handle is cheap to clone, `Send` and `Sync`: share it, or make one per thread.
///
/// A latch that expires before its count reached zero (nobody counted it down for a
/// [`latch_ttl`](crate::Builder::latch_ttl)) ends its waiters' waits with
/// [`Error::LatchExpired`](crate::Error::LatchExpired), also when another call has made
/// a new latch of the name since: a waiter never waits on a latch other than the one it
/// found.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// # fn main() -> Result<(), redbaton::Error> {
/// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
/// let done = client.latch("batch-7", 2);
/// assert_eq!(done.count_down()?, 1);
/// assert!(done.wait_for(Duration::from_millis(10)).unwrap_err().is_timeout());
/// assert_eq!(done.count_down()?, 0);
/// done.wait()?; // open: returns at once
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Latch {
    engine: Arc<Engine>,
    name: Vec<u8>,
    count: u64,
}

impl std::fmt::Debug for Latch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Latch")
            .field("name", &String::from_utf8_lossy(&self.name))
            .field("count", &self.count)
            .finish_non_exhaustive()
    }
}

impl Latch {
    /// Counts the latch down by one and returns the count left; the count down that
    /// reaches 0 wakes every waiter. At 0 it stays 0 and changes nothing. Each count down
    /// that lowers the count keeps the latch for another
    /// [`latch_ttl`](crate::Builder::latch_ttl).
    ///
    /// A count down is sent once: when its reply is lost (a network error, a timeout),
    /// the error is returned and it may or may not have counted. It is not sent again,
    /// since a second one would count twice. Such an error is a connection error
    /// ([`Error::is_connection`](crate::Error::is_connection)) whose
    /// [`redis_error`](crate::Error::redis_error) is not a refused connection; a refused
    /// connection or [`Error::PoolExhausted`](crate::Error::PoolExhausted) did not count.
    /// A count down that surely did not count (refused, or refused by a master demoted
    /// meanwhile) is sent again where the master is now, on Redis Cluster and Sentinel.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for a count of 0 or above
    /// [`MAX_LATCH_COUNT`]; [`Error::InvalidName`](crate::Error::InvalidName);
    /// [`Error::CountMismatch`](crate::Error::CountMismatch);
    /// [`Error::WrongKind`](crate::Error::WrongKind) when the name's key holds something
    /// else (left as it is);
    /// [`Error::Unsupported`](crate::Error::Unsupported) on a Redlock client; Redis errors.
    ///
    /// # Examples
    ///
    /// ```
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// let latch = client.latch("replicas-synced", 2);
    /// assert_eq!(latch.count_down()?, 1);
    /// assert_eq!(latch.count_down()?, 0);
    /// assert_eq!(latch.count_down()?, 0); // stays open
    /// # Ok(()) }
    /// ```
    pub fn count_down(&self) -> Result<u64> {
        self.engine.latch_count_down(&self.name, self.count)
    }

    /// The count left (making the latch if it does not exist yet).
    ///
    /// # Errors
    ///
    /// As [`count_down`](Self::count_down).
    ///
    /// # Examples
    ///
    /// ```
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// let latch = client.latch("replicas-synced", 2);
    /// assert_eq!(latch.count()?, 2);
    /// latch.count_down()?;
    /// assert_eq!(latch.count()?, 1);
    /// # Ok(()) }
    /// ```
    pub fn count(&self) -> Result<u64> {
        self.engine.latch_count(&self.name, self.count)
    }

    /// Waits until the count is 0, however long that takes (making the latch if it does
    /// not exist yet).
    ///
    /// # Errors
    ///
    /// [`Error::LatchExpired`](crate::Error::LatchExpired) when the latch expired before
    /// its count reached zero; otherwise as [`count_down`](Self::count_down). Redis
    /// Cluster: a master being replaced is waited for up to one lease.
    ///
    /// # Examples
    ///
    /// ```
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// let latch = client.latch("warmed-up", 1);
    /// std::thread::scope(|s| {
    ///     s.spawn(|| latch.count_down());
    ///     latch.wait()
    /// })?;
    /// # Ok(()) }
    /// ```
    pub fn wait(&self) -> Result<()> {
        self.wait_with(Wait::Until(None, None))
    }

    /// Waits at most `timeout` for the count to reach 0. A zero timeout reads the count
    /// once; a timeout too long to add to the current time waits without a deadline.
    ///
    /// # Errors
    ///
    /// [`Error::Timeout`](crate::Error::Timeout) when the count was not 0 in time;
    /// otherwise as [`wait`](Self::wait).
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// let latch = client.latch("warmed-up", 1);
    /// match latch.wait_for(Duration::from_millis(100)) {
    ///     Ok(()) => println!("open"),
    ///     Err(e) if e.is_timeout() => println!("not yet"),
    ///     Err(e) => return Err(e),
    /// }
    /// # Ok(()) }
    /// ```
    pub fn wait_for(&self, timeout: Duration) -> Result<()> {
        self.wait_with(Wait::Until(Instant::now().checked_add(timeout), None))
    }

    /// Waits until `deadline` at most for the count to reach 0. A deadline in the past
    /// reads the count once.
    ///
    /// # Errors
    ///
    /// [`Error::Timeout`](crate::Error::Timeout) when the count was not 0 by `deadline`;
    /// otherwise as [`wait`](Self::wait).
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::{Duration, Instant};
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// let deadline = Instant::now() + Duration::from_millis(100);
    /// let e = client.latch("warmed-up", 1).wait_until(deadline).unwrap_err();
    /// assert!(e.is_timeout());
    /// # Ok(()) }
    /// ```
    pub fn wait_until(&self, deadline: Instant) -> Result<()> {
        self.wait_with(Wait::Until(Some(deadline), None))
    }

    /// Waits until the count is 0 or `cancel` is cancelled (see [`Cancel`]): a cancel
    /// ends the wait at its next wake-up, which the cancel causes at once. A token
    /// cancelled before the call makes it return at once, without contacting Redis. A
    /// wait that reached Redis made the latch if it did not exist yet, as any call does
    /// (see [`LockClient::latch`]); cancelled or not, the wait leaves that latch as it is,
    /// until its [`latch_ttl`](crate::Builder::latch_ttl) ends: meanwhile a call with
    /// another count fails with [`Error::CountMismatch`](crate::Error::CountMismatch).
    ///
    /// # Errors
    ///
    /// [`Error::Cancelled`](crate::Error::Cancelled) when the wait was cancelled;
    /// otherwise as [`wait`](Self::wait).
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// let latch = client.latch("warmed-up", 1);
    /// let cancel = redbaton::Cancel::new();
    /// std::thread::scope(|s| {
    ///     let waiter = s.spawn(|| latch.wait_cancellable(&cancel));
    ///     std::thread::sleep(Duration::from_millis(50));
    ///     cancel.cancel();
    ///     assert!(waiter.join().unwrap().unwrap_err().is_cancelled());
    /// });
    /// # Ok(()) }
    /// ```
    pub fn wait_cancellable(&self, cancel: &Cancel) -> Result<()> {
        self.wait_with(cancel.wait())
    }

    fn wait_with(&self, wait: Wait<'_>) -> Result<()> {
        self.engine.latch_wait(&self.name, self.count, wait)
    }
}
