//! Multi-locks: several locks taken together, all or none, and held by one guard.
//!
//! A multi-lock holds each of its names as an exclusive lock, under a token of its own:
//! to every other contender (another process, another multi-lock, a thread of this
//! process calling [`lock`](LockClient::lock)) a name it holds is a held lock. Like a
//! [`DetachedGuard`](crate::DetachedGuard) it takes no part in the local handoff: the
//! guard may move between threads, and nothing is handed from it to a local waiter.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::Receiver;

use crate::api::cancel::Cancel;
use crate::api::client::LockClient;
use crate::api::detached::release_on_drop;
use crate::engine::contest::Wait;
use crate::engine::multi::{MAX_NAMES, MultiHeld};
use crate::engine::state::Engine;
use crate::error::{Error, LostReason, Result, Unlocked};
use crate::fencing;
use crate::stats::{HoldKind, Path};

/// The most names one multi-lock may have (64): a group of names is taken by one Redis
/// script, which blocks the server while it runs.
///
/// # Examples
///
/// ```
/// # fn main() -> Result<(), redbaton::Error> {
/// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
/// let names: Vec<String> = (0..=redbaton::MAX_MULTI_NAMES).map(|i| format!("n{i}")).collect();
/// assert!(client.multi_lock(&names).unwrap_err().is_invalid_input());
/// # Ok(()) }
/// ```
pub const MAX_MULTI_NAMES: usize = MAX_NAMES;

impl LockClient {
    /// Waits until every lock of `names` is taken, all at once, however long that takes.
    ///
    /// All or nothing: the names whose keys are on one node and in one hash slot (every
    /// name, outside Redis Cluster) are taken by one Redis script, which takes them all
    /// if all are free and none otherwise. On Redis Cluster the slots are taken one after
    /// the other, in slot order, so that two multi-locks never wait for each other, and
    /// whatever was taken is given back if the call fails. While it waits, the call
    /// sleeps until Redis says one of the names may be free (or a holder's lease ends),
    /// as [`lock`](Self::lock) does.
    ///
    /// A multi-lock does not join the fair queue of [`Builder::fair`](crate::Builder::fair):
    /// it takes a name whose key is free. A fair release grants its lock to the head of
    /// the name's queue, so a name that processes keep queuing for can keep a multi-lock
    /// waiting; its failed attempts do make the holders' processes keep to their fairness
    /// budget. Not available on a Redlock client (independent masters cannot take several
    /// keys atomically).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for no names, a name given twice or more than
    /// [`MAX_MULTI_NAMES`] names, [`Error::InvalidName`] for a bad name (nothing is sent
    /// then); [`Error::WouldDeadlock`] if this thread holds one of the names through a
    /// [`LockGuard`](crate::LockGuard); [`Error::WrongKind`] if a name is held as a
    /// read-write lock or a semaphore; [`Error::Unsupported`] on a Redlock client;
    /// [`Error::Lost`] on Redis Cluster when the names of one slot, taken first, were lost
    /// while those of a later slot were waited for, three times in a row (each time what
    /// was taken is given back and the names are taken again); Redis errors.
    ///
    /// # Examples
    ///
    /// ```
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// let guard = client.multi_lock(["account:7", "account:9"])?;
    /// // ... move money between the two accounts ...
    /// guard.unlock()?;
    /// # Ok(()) }
    /// ```
    pub fn multi_lock(
        &self,
        names: impl IntoIterator<Item = impl AsRef<[u8]>>,
    ) -> Result<MultiGuard> {
        self.multi(names, Wait::Until(None, None))
    }

    /// Takes every lock of `names` if all are free right now; [`Error::WouldBlock`]
    /// otherwise (and nothing is taken).
    ///
    /// # Errors
    ///
    /// [`Error::WouldBlock`] when a name is held; otherwise as
    /// [`multi_lock`](Self::multi_lock).
    ///
    /// # Examples
    ///
    /// ```
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// let held = client.lock("b")?.detach(); // as if another process held it
    /// assert!(client.try_multi_lock(["a", "b"]).unwrap_err().is_would_block());
    /// drop(held);
    /// let both = client.try_multi_lock(["a", "b"])?;
    /// # Ok(()) }
    /// ```
    pub fn try_multi_lock(
        &self,
        names: impl IntoIterator<Item = impl AsRef<[u8]>>,
    ) -> Result<MultiGuard> {
        self.multi(names, Wait::No)
    }

    /// Waits at most `timeout` for every lock of `names`; [`Error::Timeout`] after, with
    /// nothing taken. A zero timeout makes one attempt; a timeout too long to add to the
    /// current time waits without a deadline.
    ///
    /// # Errors
    ///
    /// [`Error::Timeout`] when the names were not all free within `timeout`; otherwise as
    /// [`multi_lock`](Self::multi_lock).
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// match client.try_multi_lock_for(["a", "b", "c"], Duration::from_secs(5)) {
    ///     Ok(guard) => drop(guard),
    ///     Err(e) if e.is_timeout() => println!("gave up; nothing is held"),
    ///     Err(e) => return Err(e),
    /// }
    /// # Ok(()) }
    /// ```
    pub fn try_multi_lock_for(
        &self,
        names: impl IntoIterator<Item = impl AsRef<[u8]>>,
        timeout: Duration,
    ) -> Result<MultiGuard> {
        let deadline = Instant::now().checked_add(timeout);
        self.multi(names, Wait::Until(deadline, None))
    }

    /// Waits until `deadline` at most for every lock of `names`; [`Error::Timeout`]
    /// after, with nothing taken. A deadline in the past makes one attempt.
    ///
    /// # Errors
    ///
    /// [`Error::Timeout`] when the names were not all free by `deadline`; otherwise as
    /// [`multi_lock`](Self::multi_lock).
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::{Duration, Instant};
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// let deadline = Instant::now() + Duration::from_secs(2);
    /// let guard = client.try_multi_lock_until(["a", "b"], deadline)?;
    /// # Ok(()) }
    /// ```
    pub fn try_multi_lock_until(
        &self,
        names: impl IntoIterator<Item = impl AsRef<[u8]>>,
        deadline: Instant,
    ) -> Result<MultiGuard> {
        self.multi(names, Wait::Until(Some(deadline), None))
    }

    /// Waits until every lock of `names` is taken or `cancel` is cancelled, from another
    /// thread (see [`Cancel`]). A cancelled wait leaves nothing behind: what it took is
    /// given back, and its contention marks go. A token cancelled before the call makes it
    /// return [`Error::Cancelled`] without contacting Redis.
    ///
    /// # Errors
    ///
    /// [`Error::Cancelled`] when the wait was cancelled; otherwise as
    /// [`multi_lock`](Self::multi_lock).
    ///
    /// # Examples
    ///
    /// ```
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// let cancel = redbaton::Cancel::new();
    /// let guard = client.multi_lock_cancellable(["a", "b"], &cancel)?;
    /// drop(guard);
    /// cancel.cancel();
    /// assert!(client.multi_lock_cancellable(["a", "b"], &cancel).unwrap_err().is_cancelled());
    /// # Ok(()) }
    /// ```
    pub fn multi_lock_cancellable(
        &self,
        names: impl IntoIterator<Item = impl AsRef<[u8]>>,
        cancel: &Cancel,
    ) -> Result<MultiGuard> {
        self.multi(names, cancel.wait())
    }

    fn multi(
        &self,
        names: impl IntoIterator<Item = impl AsRef<[u8]>>,
        wait: Wait<'_>,
    ) -> Result<MultiGuard> {
        // One more than the most accepted is enough to refuse the call: an endless
        // iterator is not read to its end.
        let names: Vec<Vec<u8>> = names
            .into_iter()
            .take(MAX_NAMES + 1)
            .map(|n| n.as_ref().to_vec())
            .collect();
        let engine = self.engine();
        let held = engine.multi_lock(&names, wait)?;
        Ok(MultiGuard::new(engine.clone(), names, held))
    }
}

/// Proof that a multi-lock holds every one of its names (see
/// [`LockClient::multi_lock`]). Dropping it releases them all in Redis (best effort,
/// logging, never panicking); [`unlock`](MultiGuard::unlock) does the same and says what
/// happened.
///
/// The watchdog renews every name's lease. Losing any one name loses the multi-lock:
/// [`is_lost`](MultiGuard::is_lost) is true, [`check`](MultiGuard::check) errs and
/// [`lost`](MultiGuard::lost) receives the reason; the names still held stay held until
/// the guard is released. The guard is `Send` and `Sync`: it may be released from any
/// thread. A thread that asks for one of its names again (through another multi-lock or
/// [`lock`](LockClient::lock)) waits for it like any other contender.
///
/// # Examples
///
/// ```
/// # fn main() -> Result<(), redbaton::Error> {
/// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
/// let guard = client.multi_lock(["from:7", "to:9"])?;
/// for (name, token) in guard.fencing_tokens() {
///     // ... write to the resource `name` protects, with `token` ...
///     # let _ = (name, token);
/// }
/// guard.check()?; // still ours, every one of them?
/// assert!(guard.unlock()?.was_held());
/// # Ok(()) }
/// ```
#[must_use = "the locks are released as soon as the guard is dropped"]
pub struct MultiGuard {
    engine: Arc<Engine>,
    /// The names as given, in the caller's order.
    names: Vec<Vec<u8>>,
    held: MultiHeld,
    lost_rx: Receiver<LostReason>,
    released: bool,
}

impl MultiGuard {
    fn new(engine: Arc<Engine>, names: Vec<Vec<u8>>, held: MultiHeld) -> Self {
        let (tx, lost_rx) = crossbeam_channel::bounded(1);
        for lock in &held.names {
            lock.set_listener(tx.clone());
        }
        MultiGuard {
            engine,
            names,
            held,
            lost_rx,
            released: false,
        }
    }

    /// Each name, as given and in the order given, with its fencing token: as a
    /// [`LockGuard`](crate::LockGuard)'s, `(fence << 12)` from the name's Redis counter, so
    /// that it compares with the tokens of every other holder of the name.
    ///
    /// # Examples
    ///
    /// ```
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// let before = client.lock("b")?.fencing_token();
    /// let guard = client.multi_lock(["b", "a"])?;
    /// let tokens = guard.fencing_tokens();
    /// assert_eq!(tokens[0].0, b"b");
    /// assert!(tokens[0].1 > before);
    /// # Ok(()) }
    /// ```
    pub fn fencing_tokens(&self) -> Vec<(&[u8], u64)> {
        self.names
            .iter()
            .zip(&self.held.names)
            .map(|(name, lock)| (name.as_slice(), fencing::token(lock.fence, 0)))
            .collect()
    }

    /// Whether the hold before this one ended without a release on any of the names (its
    /// holder died or stalled past its lease, or its key was deleted), as
    /// [`LockGuard::previous_lost`](crate::LockGuard::previous_lost) says for one name:
    /// check what the last holders were changing before relying on it.
    ///
    /// # Examples
    ///
    /// ```
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// let guard = client.multi_lock(["ledger:1", "ledger:2"])?;
    /// if guard.previous_lost() {
    ///     // a holder died holding one of them: repair before writing
    /// }
    /// # Ok(()) }
    /// ```
    pub fn previous_lost(&self) -> bool {
        self.held.names.iter().any(|lock| lock.previous_lost)
    }

    /// The fencing token of `name` (see [`fencing_tokens`](Self::fencing_tokens));
    /// `None` when the multi-lock does not hold that name.
    ///
    /// # Examples
    ///
    /// ```
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// let guard = client.multi_lock(["a", "b"])?;
    /// assert!(guard.fencing_token("a").is_some());
    /// assert_eq!(guard.fencing_token("c"), None);
    /// # Ok(()) }
    /// ```
    pub fn fencing_token(&self, name: impl AsRef<[u8]>) -> Option<u64> {
        let name = name.as_ref();
        self.fencing_tokens()
            .into_iter()
            .find_map(|(n, token)| (n == name).then_some(token))
    }

    /// Until when every name is surely held: the earliest of their validities (each is
    /// its acquisition or last renewal, plus the lease, minus a drift margin; once the
    /// name is known lost, no later than when that was found).
    ///
    /// # Examples
    ///
    /// ```
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// let guard = client.multi_lock(["a", "b"])?;
    /// assert!(guard.valid_until() > std::time::Instant::now());
    /// # Ok(()) }
    /// ```
    pub fn valid_until(&self) -> Instant {
        let each = self.held.names.iter().map(|l| l.valid_until());
        each.min().unwrap_or_else(Instant::now)
    }

    /// Whether any name is known to be lost. Never asks Redis.
    ///
    /// # Examples
    ///
    /// ```
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// let guard = client.multi_lock(["a", "b"])?;
    /// assert!(!guard.is_lost());
    /// # Ok(()) }
    /// ```
    pub fn is_lost(&self) -> bool {
        self.lost_reason().is_some()
    }

    /// `Ok(())` while every name is held, [`Error::Lost`] (with the reason of the first
    /// name lost, in the order given) once one is known lost. Never asks Redis.
    ///
    /// # Errors
    ///
    /// [`Error::Lost`] once a name is known lost.
    ///
    /// # Examples
    ///
    /// ```
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// let guard = client.multi_lock(["a", "b"])?;
    /// std::thread::spawn(move || guard.check()).join().unwrap()?;
    /// # Ok(()) }
    /// ```
    pub fn check(&self) -> Result<()> {
        match self.lost_reason() {
            Some(reason) => Err(Error::Lost(reason)),
            None => Ok(()),
        }
    }

    /// A channel that receives a [`LostReason`] when a name is lost, to `select!` on (the
    /// first loss at once; a later one only if the channel was emptied meanwhile).
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// let guard = client.multi_lock(["a", "b"])?;
    /// assert!(guard.lost().recv_timeout(Duration::from_millis(10)).is_err());
    /// # Ok(()) }
    /// ```
    pub fn lost(&self) -> &Receiver<LostReason> {
        &self.lost_rx
    }

    /// Releases every name in Redis and says what happened: [`Unlocked::Released`] when
    /// each was still held, otherwise the worst of them ([`Unlocked::HeldByOther`], then
    /// [`Unlocked::Expired`]).
    ///
    /// # Errors
    ///
    /// The first Redis error of a group of names whose release could not be told (they
    /// expire with their lease); the other names are released all the same.
    ///
    /// # Examples
    ///
    /// ```
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// let guard = client.multi_lock(["a", "b"])?;
    /// let released = std::thread::spawn(move || guard.unlock()).join().unwrap()?;
    /// assert_eq!(released, redbaton::Unlocked::Released);
    /// # Ok(()) }
    /// ```
    pub fn unlock(mut self) -> Result<Unlocked> {
        self.released = true;
        self.release()
    }

    /// The first reason a name is lost for, in the order given.
    fn lost_reason(&self) -> Option<LostReason> {
        let counters = &self.engine.counters;
        self.held.names.iter().find_map(|l| l.lost(counters))
    }

    /// Records the hold's time and releases every name in Redis.
    fn release(&self) -> Result<Unlocked> {
        let counters = &self.engine.counters;
        counters.released(HoldKind::Lock, Path::Remote, self.held.since);
        self.engine.release_multi(&self.held.groups)
    }
}

impl Drop for MultiGuard {
    fn drop(&mut self) {
        if self.released {
            return;
        }
        release_on_drop(format_args!("multi-lock {:?}", self.display()), || {
            self.release()
        });
    }
}

impl MultiGuard {
    /// The names for log lines and `Debug`.
    fn display(&self) -> Vec<String> {
        let names = self.names.iter();
        names
            .map(|n| String::from_utf8_lossy(n).into_owned())
            .collect()
    }
}

impl std::fmt::Debug for MultiGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let tokens: Vec<u64> = self.fencing_tokens().iter().map(|(_, t)| *t).collect();
        f.debug_struct("MultiGuard")
            .field("names", &self.display())
            .field("fencing_tokens", &tokens)
            .finish_non_exhaustive()
    }
}

/// A multi-lock guard moves between threads and may be shared by reference: checked here
/// so that a change of its insides that breaks it fails to build.
const _: fn() = || {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<MultiGuard>();
};
