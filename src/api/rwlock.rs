//! Read-write locks: many readers across processes, or one writer; and the upgradable
//! read, which turns into the write hold without letting another writer in first.

use std::marker::PhantomData;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::Receiver;

use crate::api::cancel::Cancel;
use crate::api::client::LockClient;
use crate::api::detached::{Detached, DetachedWriteGuard, release_on_drop};
use crate::engine::contest::Wait;
use crate::engine::shared_hold::Hold;
use crate::engine::state::Engine;
use crate::error::{Error, LostReason, Result, Unlocked};
use crate::local::shares::Mode;
use crate::stats::HoldKind;

impl LockClient {
    /// A read-write lock named `name`: many readers (across threads and processes) or one
    /// writer. Nothing is sent to Redis until a guard is asked for.
    ///
    /// The name shares its key with a plain lock and a semaphore of the same name: while
    /// it is held as one kind, asking for it as another fails with [`Error::WrongKind`].
    /// Not available on a Redlock client ([`Error::Unsupported`]).
    ///
    /// # Examples
    ///
    /// ```
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// let catalog = client.rwlock("catalog");
    /// let r1 = catalog.read()?;
    /// let r2 = catalog.read()?; // readers share
    /// std::thread::scope(|s| {
    ///     // Another thread may not write while they read.
    ///     let busy = s.spawn(|| catalog.try_write().unwrap_err().is_would_block());
    ///     assert!(busy.join().unwrap());
    /// });
    /// drop((r1, r2));
    /// let w = catalog.write()?;
    /// # Ok(()) }
    /// ```
    pub fn rwlock(&self, name: impl AsRef<[u8]>) -> RwLock {
        RwLock {
            engine: self.engine().clone(),
            name: name.as_ref().to_vec(),
        }
    }
}

/// A distributed read-write lock (see [`LockClient::rwlock`]).
///
/// * **Many readers or one writer**, across all processes. Each remote hold has its own
///   lease, renewed by the client's watchdog: a crashed reader's hold ends by itself.
/// * **Writer-preferring.** A writer that fails to get the lock and waits leaves a mark
///   that stops *new* read holds in Redis until it has written (the mark lives twice the
///   [re-check interval](crate::Builder::recheck_interval) and is renewed at each of the
///   writer's attempts, so a crashed waiting writer holds readers back at most that long).
///   Readers that already hold keep reading; the writer gets the lock when they are done.
///   The release of the last hold wakes only the writer waiting longest; the other
///   writers and the readers sleep on.
/// * **Local turns.** One process holds at most one remote hold of a name and lets its
///   threads take turns on it with no Redis command: local readers share a remote read
///   hold; under the remote write hold, local writers write one after another (like the
///   plain lock's baton) and local readers may read between them, unless another process
///   waited when the write hold was granted: then it serves the local writers only and
///   goes back when none waits, so that the local readers read in the next read phase,
///   side by side with the other processes' readers. Local writers are preferred too:
///   while one waits, a read hold admits at most
///   [`max_handoffs`](crate::Builder::max_handoffs) more local readers, then none, and is
///   given back as soon as its readers are done so the writer can ask for the write hold.
///   A remote hold serves local turns for at most
///   [`handoff_slice`](crate::Builder::handoff_slice) and
///   [`max_handoffs`](crate::Builder::max_handoffs) local writes (reads run side by side
///   and are bounded by the slice alone); then the process asks
///   Redis (one cheap script) whether another process waits (a writer, for a read hold;
///   anyone, for the write hold). If one does, nobody new is admitted and the hold is given
///   back when the turns already running end. So a waiting writer of another process
///   waits at most that slice plus the sections already running, then the readers' release.
/// * Waiters sleep until a release event (no polling), as for the plain lock.
/// * **Upgradable reads.** [`upgradable_read`](RwLock::upgradable_read) reads beside the
///   other readers while excluding writers and the other upgradable reads (one at a time
///   across all processes); [`upgrade`](UpgradableReadGuard::upgrade) then waits for the
///   other readers to be done (holding new ones back, as a waiting writer does) and turns
///   the hold into the write hold in one step, with no writer in between.
///   [`downgrade`](WriteGuard::downgrade) turns the write hold back into a read hold in
///   one step. An upgradable read is a remote hold of its thread's own, never shared with
///   the process's local turns.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// # fn main() -> Result<(), redbaton::Error> {
/// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
/// let rw = client.rwlock("catalog");
/// {
///     let r = rw.read()?;
///     let _token = r.fencing_token();
/// }
/// let w = rw.try_write_for(Duration::from_secs(1))?;
/// w.unlock()?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct RwLock {
    engine: Arc<Engine>,
    name: Vec<u8>,
}

impl std::fmt::Debug for RwLock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RwLock")
            .field("name", &String::from_utf8_lossy(&self.name))
            .finish_non_exhaustive()
    }
}

impl RwLock {
    /// Waits until a read hold is ours. A thread that reads already joins its own read
    /// hold at once.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidName`]; [`Error::WouldDeadlock`] if this thread holds the write
    /// lock or the upgradable read; [`Error::Lost`] if this thread reads already and that
    /// read hold is known lost; [`Error::WrongKind`] if the name is held as a plain lock
    /// or a semaphore; [`Error::Unsupported`] on a Redlock client; Redis errors.
    ///
    /// # Examples
    ///
    /// ```
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// let r = client.rwlock("catalog").read()?;
    /// # Ok(()) }
    /// ```
    pub fn read(&self) -> Result<ReadGuard> {
        self.read_with(Wait::Until(None, None))
    }

    /// A read hold if one can be had right now.
    ///
    /// # Errors
    ///
    /// [`Error::WouldBlock`] when a writer holds the lock or waits for it; otherwise as
    /// [`read`](Self::read).
    ///
    /// # Examples
    ///
    /// ```
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// let rw = client.rwlock("catalog");
    /// let w = rw.write()?;
    /// std::thread::scope(|s| {
    ///     let busy = s.spawn(|| rw.try_read().unwrap_err().is_would_block());
    ///     assert!(busy.join().unwrap());
    /// });
    /// # Ok(()) }
    /// ```
    pub fn try_read(&self) -> Result<ReadGuard> {
        self.read_with(Wait::No)
    }

    /// Waits at most `timeout` for a read hold.
    ///
    /// # Errors
    ///
    /// [`Error::Timeout`] when none could be had in time; otherwise as [`read`](Self::read).
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// let r = client.rwlock("catalog").try_read_for(Duration::from_secs(1))?;
    /// # Ok(()) }
    /// ```
    pub fn try_read_for(&self, timeout: Duration) -> Result<ReadGuard> {
        self.read_with(Wait::Until(Instant::now().checked_add(timeout), None))
    }

    /// Waits until `deadline` at most for a read hold.
    ///
    /// # Errors
    ///
    /// [`Error::Timeout`] when none could be had by `deadline`; otherwise as
    /// [`read`](Self::read).
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::{Duration, Instant};
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// let deadline = Instant::now() + Duration::from_secs(1);
    /// let r = client.rwlock("catalog").try_read_until(deadline)?;
    /// # Ok(()) }
    /// ```
    pub fn try_read_until(&self, deadline: Instant) -> Result<ReadGuard> {
        self.read_with(Wait::Until(Some(deadline), None))
    }

    /// Waits until a read hold is ours or `cancel` is cancelled (see [`Cancel`] and
    /// [`LockClient::lock_cancellable`]: a cancelled wait leaves nothing behind; a hold
    /// taken first is returned).
    ///
    /// # Errors
    ///
    /// [`Error::Cancelled`] when the wait was cancelled (at once, without contacting
    /// Redis, if it was before the call); otherwise as [`read`](Self::read).
    ///
    /// # Examples
    ///
    /// ```
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// let rw = client.rwlock("catalog");
    /// let cancel = redbaton::Cancel::new();
    /// let r = rw.read_cancellable(&cancel)?;
    /// # Ok(()) }
    /// ```
    pub fn read_cancellable(&self, cancel: &Cancel) -> Result<ReadGuard> {
        self.read_with(cancel.wait())
    }

    /// Waits until the write hold is ours.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidName`]; [`Error::WouldDeadlock`] if this thread holds the lock
    /// (for reading or writing, or the upgradable read); [`Error::WrongKind`] if the name is held as a plain lock
    /// or a semaphore; [`Error::Unsupported`] on a Redlock client; Redis errors.
    ///
    /// # Examples
    ///
    /// ```
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// let w = client.rwlock("catalog").write()?;
    /// # Ok(()) }
    /// ```
    pub fn write(&self) -> Result<WriteGuard> {
        self.write_with(Wait::Until(None, None))
    }

    /// The write hold if it can be had right now.
    ///
    /// # Errors
    ///
    /// [`Error::WouldBlock`] when anyone holds the lock; otherwise as
    /// [`write`](Self::write).
    ///
    /// # Examples
    ///
    /// ```
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// let rw = client.rwlock("catalog");
    /// let w = rw.try_write()?;
    /// # Ok(()) }
    /// ```
    pub fn try_write(&self) -> Result<WriteGuard> {
        self.write_with(Wait::No)
    }

    /// Waits at most `timeout` for the write hold.
    ///
    /// # Errors
    ///
    /// [`Error::Timeout`] when it could not be had in time; otherwise as
    /// [`write`](Self::write).
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// let w = client.rwlock("catalog").try_write_for(Duration::from_secs(1))?;
    /// # Ok(()) }
    /// ```
    pub fn try_write_for(&self, timeout: Duration) -> Result<WriteGuard> {
        self.write_with(Wait::Until(Instant::now().checked_add(timeout), None))
    }

    /// Waits until `deadline` at most for the write hold.
    ///
    /// # Errors
    ///
    /// [`Error::Timeout`] when it could not be had by `deadline`; otherwise as
    /// [`write`](Self::write).
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::{Duration, Instant};
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// let deadline = Instant::now() + Duration::from_secs(1);
    /// let w = client.rwlock("catalog").try_write_until(deadline)?;
    /// # Ok(()) }
    /// ```
    pub fn try_write_until(&self, deadline: Instant) -> Result<WriteGuard> {
        self.write_with(Wait::Until(Some(deadline), None))
    }

    /// Waits until the write hold is ours or `cancel` is cancelled (see [`Cancel`] and
    /// [`LockClient::lock_cancellable`]: a cancelled wait leaves nothing behind, its
    /// waiting-writer mark included; a hold taken first is returned).
    ///
    /// # Errors
    ///
    /// [`Error::Cancelled`] when the wait was cancelled (at once, without contacting
    /// Redis, if it was before the call); otherwise as [`write`](Self::write).
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// let rw = client.rwlock("catalog");
    /// let reading = rw.read()?;
    /// let cancel = redbaton::Cancel::new();
    /// std::thread::scope(|s| {
    ///     let writer = s.spawn(|| rw.write_cancellable(&cancel).map(drop));
    ///     std::thread::sleep(Duration::from_millis(50));
    ///     cancel.cancel();
    ///     assert!(writer.join().unwrap().unwrap_err().is_cancelled());
    /// });
    /// # Ok(()) }
    /// ```
    pub fn write_cancellable(&self, cancel: &Cancel) -> Result<WriteGuard> {
        self.write_with(cancel.wait())
    }

    /// Waits until the upgradable read hold is ours: a read beside the other readers that
    /// excludes writers and the other upgradable reads (at most one at a time, across all
    /// processes), and that may later [`upgrade`](UpgradableReadGuard::upgrade) to the
    /// write hold with no writer in between. Like a read, it is not granted while a writer
    /// waits.
    ///
    /// It is a remote hold of this thread's own: the process's local readers do not share
    /// it, and it does not share theirs (see [`RwLock`]).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidName`]; [`Error::WouldDeadlock`] if this thread holds the lock in
    /// any way (reading, writing, or an upgradable read); [`Error::WrongKind`] if the name
    /// is held as a plain lock or a semaphore; [`Error::Unsupported`] on a Redlock client;
    /// Redis errors.
    ///
    /// # Examples
    ///
    /// ```
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// let catalog = client.rwlock("catalog");
    /// let entry = catalog.upgradable_read()?;
    /// std::thread::scope(|s| {
    ///     // Others read beside it, but neither write nor take another upgradable read.
    ///     s.spawn(|| drop(catalog.try_read().unwrap()));
    ///     let busy = s.spawn(|| catalog.try_upgradable_read().unwrap_err().is_would_block());
    ///     assert!(busy.join().unwrap());
    /// });
    /// let w = entry.upgrade()?; // now the writer
    /// # Ok(()) }
    /// ```
    pub fn upgradable_read(&self) -> Result<UpgradableReadGuard> {
        self.upgradable_with(Wait::Until(None, None))
    }

    /// The upgradable read hold if it can be had right now.
    ///
    /// # Errors
    ///
    /// [`Error::WouldBlock`] when a writer or another upgradable reader holds the lock, or
    /// a writer waits for it; otherwise as [`upgradable_read`](Self::upgradable_read).
    ///
    /// # Examples
    ///
    /// ```
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// let rw = client.rwlock("catalog");
    /// let u = rw.try_upgradable_read()?;
    /// # Ok(()) }
    /// ```
    pub fn try_upgradable_read(&self) -> Result<UpgradableReadGuard> {
        self.upgradable_with(Wait::No)
    }

    /// Waits at most `timeout` for the upgradable read hold.
    ///
    /// # Errors
    ///
    /// [`Error::Timeout`] when it could not be had in time; otherwise as
    /// [`upgradable_read`](Self::upgradable_read).
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// let u = client.rwlock("catalog").try_upgradable_read_for(Duration::from_secs(1))?;
    /// # Ok(()) }
    /// ```
    pub fn try_upgradable_read_for(&self, timeout: Duration) -> Result<UpgradableReadGuard> {
        self.upgradable_with(Wait::Until(Instant::now().checked_add(timeout), None))
    }

    /// Waits until `deadline` at most for the upgradable read hold.
    ///
    /// # Errors
    ///
    /// [`Error::Timeout`] when it could not be had by `deadline`; otherwise as
    /// [`upgradable_read`](Self::upgradable_read).
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::{Duration, Instant};
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// let deadline = Instant::now() + Duration::from_secs(1);
    /// let u = client.rwlock("catalog").try_upgradable_read_until(deadline)?;
    /// # Ok(()) }
    /// ```
    pub fn try_upgradable_read_until(&self, deadline: Instant) -> Result<UpgradableReadGuard> {
        self.upgradable_with(Wait::Until(Some(deadline), None))
    }

    /// Waits until the upgradable read hold is ours or `cancel` is cancelled (see
    /// [`Cancel`]: a cancelled wait leaves nothing behind; a hold taken first is
    /// returned).
    ///
    /// # Errors
    ///
    /// [`Error::Cancelled`] when the wait was cancelled; otherwise as
    /// [`upgradable_read`](Self::upgradable_read).
    ///
    /// # Examples
    ///
    /// ```
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// let cancel = redbaton::Cancel::new();
    /// let u = client.rwlock("catalog").upgradable_read_cancellable(&cancel)?;
    /// # Ok(()) }
    /// ```
    pub fn upgradable_read_cancellable(&self, cancel: &Cancel) -> Result<UpgradableReadGuard> {
        self.upgradable_with(cancel.wait())
    }

    fn upgradable_with(&self, wait: Wait<'_>) -> Result<UpgradableReadGuard> {
        let hold = self.engine.upgradable(&self.name, wait)?;
        Ok(UpgradableReadGuard(SharedGuard::new(
            self.engine.clone(),
            hold,
            Kind::Upgradable,
        )))
    }

    fn read_with(&self, wait: Wait<'_>) -> Result<ReadGuard> {
        let hold = self.engine.read(&self.name, wait)?;
        Ok(ReadGuard(SharedGuard::new(
            self.engine.clone(),
            hold,
            Kind::Read,
        )))
    }

    fn write_with(&self, wait: Wait<'_>) -> Result<WriteGuard> {
        let hold = self.engine.write(&self.name, wait)?;
        Ok(WriteGuard(SharedGuard::new(
            self.engine.clone(),
            hold,
            Kind::Write,
        )))
    }
}

/// The methods every shared-hold guard has (`check`, `lost`, `valid_until`), documented
/// with `$what` naming what the guard holds and `$get` the example's way to get one.
macro_rules! shared_guard_methods {
    ($what:literal, $get:literal) => {
        #[doc = concat!("`Ok(())` while the ", $what, " is ours, [`Error::Lost`](crate::Error::Lost) once it is known lost.")]
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
        #[doc = concat!("let guard = ", $get, "?;")]
        /// guard.check()?;
        /// # Ok(()) }
        /// ```
        pub fn check(&self) -> Result<()> {
            self.0.check()
        }

        #[doc = concat!("A channel that receives the [`LostReason`] once, if the ", $what, " is lost.")]
        ///
        /// # Examples
        ///
        /// ```
        /// use std::time::Duration;
        /// # fn main() -> Result<(), redbaton::Error> {
        /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
        #[doc = concat!("let guard = ", $get, "?;")]
        /// assert!(guard.lost().recv_timeout(Duration::from_millis(10)).is_err());
        /// # Ok(()) }
        /// ```
        pub fn lost(&self) -> &Receiver<LostReason> {
            self.0.lost()
        }

        #[doc = concat!("Until when the ", $what, " is surely ours: its acquisition or last renewal, plus the lease, minus a drift margin (lease × 1% + 2 ms); once it is known lost, no later than when that was found.")]
        ///
        /// # Examples
        ///
        /// ```
        /// # fn main() -> Result<(), redbaton::Error> {
        /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
        #[doc = concat!("let guard = ", $get, "?;")]
        /// assert!(guard.valid_until() > std::time::Instant::now());
        /// # Ok(()) }
        /// ```
        pub fn valid_until(&self) -> Instant {
            self.0.valid_until()
        }
    };
}
pub(crate) use shared_guard_methods;

/// What a [`SharedGuard`] holds, which says how it is released.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Read,
    Write,
    Permit,
    Upgradable,
}

/// The state behind every shared-hold guard (read, write, permit): the hold, its lost
/// channel, release on drop.
pub(crate) struct SharedGuard {
    engine: Arc<Engine>,
    hold: Hold,
    kind: Kind,
    lost_rx: Receiver<LostReason>,
    released: bool,
    /// Not `Send`: a hold belongs to the thread that took it (see `LockGuard`).
    _not_send: PhantomData<*const ()>,
}

impl SharedGuard {
    pub(crate) fn new(engine: Arc<Engine>, hold: Hold, kind: Kind) -> Self {
        let (tx, lost_rx) = crossbeam_channel::bounded(1);
        // Local readers and writers may take turns on one remote hold: each is told
        // when it is lost.
        if kind == Kind::Permit {
            hold.remote.set_listener(tx);
        } else {
            hold.remote.add_sharer(hold.sharer, tx);
        }
        SharedGuard {
            engine,
            hold,
            kind,
            lost_rx,
            released: false,
            _not_send: PhantomData,
        }
    }

    pub(crate) fn check(&self) -> Result<()> {
        match self.hold.remote.lost(&self.engine.counters) {
            Some(reason) => Err(Error::Lost(reason)),
            None => Ok(()),
        }
    }

    pub(crate) fn lost(&self) -> &Receiver<LostReason> {
        &self.lost_rx
    }

    pub(crate) fn valid_until(&self) -> Instant {
        self.hold.remote.valid_until()
    }

    pub(crate) fn token(&self) -> u64 {
        self.hold.token
    }

    pub(crate) fn previous_lost(&self) -> bool {
        self.hold.previous_lost()
    }

    pub(crate) fn name(&self) -> &[u8] {
        self.hold.remote.keys.name()
    }

    pub(crate) fn unlock(mut self) -> Result<Unlocked> {
        self.released = true;
        self.release()
    }

    /// Takes a write hold out of the local turns into a detached guard's hands (see
    /// [`WriteGuard::detach`]): this guard no longer lets go of it.
    fn detach_write(mut self) -> Detached {
        debug_assert!(self.kind == Kind::Write, "only a write hold detaches");
        self.released = true;
        self.engine.detach_write(&self.hold.remote);
        let hold = Hold {
            remote: self.hold.remote.clone(),
            ..self.hold
        };
        Detached::new(
            self.engine.clone(),
            hold,
            HoldKind::Write,
            self.lost_rx.clone(),
        )
    }

    /// Turns the upgradable read hold into the write hold (see
    /// [`UpgradableReadGuard::upgrade`]); on an error, this guard back, still holding
    /// whatever it held unless it is lost (its upgradable read then given back).
    fn upgrade(self, wait: Wait<'_>) -> std::result::Result<SharedGuard, (Self, Error)> {
        debug_assert!(
            self.kind == Kind::Upgradable,
            "only an upgradable read upgrades"
        );
        let failed = match self.engine.upgrade(&self.hold, wait) {
            Ok(hold) => return Ok(self.replaced_by(hold, Kind::Write)),
            // An attempt left unanswered at the deadline may have run, and the upgradable
            // hold with it (see `UpgradeError`): a timeout would say the read goes on.
            Err(e @ (Error::Timeout | Error::Cancelled)) => match self.check() {
                Err(lost) => lost,
                Ok(()) => e,
            },
            Err(e) => e,
        };
        if self.check().is_err() {
            // Lost, the upgrade having maybe run: should it not have, the upgradable read
            // is still held in Redis and keeps writers out, while the guard, which says it
            // is lost, may be kept for long. It goes back now, renewed no more. Whatever
            // the upgrade did is safe: a late one finds no upgradable read to turn, and a
            // write hold it made is given back by the upgrade.
            self.engine.release_in_background(&self.hold.remote);
        }
        Err((self, failed))
    }

    /// Turns the write hold into a read hold (see [`WriteGuard::downgrade`]); on an error
    /// this guard lets go of the write hold.
    fn downgrade(self) -> Result<SharedGuard> {
        debug_assert!(self.kind == Kind::Write, "only a write hold downgrades");
        let hold = self.engine.downgrade(&self.hold)?;
        Ok(self.replaced_by(hold, Kind::Read))
    }

    /// The guard of `hold`, of `kind`, which replaced this guard's hold in Redis: this one
    /// is done holding (its time is recorded) and lets go of nothing.
    fn replaced_by(mut self, hold: Hold, kind: Kind) -> SharedGuard {
        self.released = true;
        self.hold.remote.remove_sharer(self.hold.sharer);
        self.record();
        SharedGuard::new(self.engine.clone(), hold, kind)
    }

    /// Records the hold's time.
    fn record(&self) {
        let kind = match self.kind {
            // An upgradable read is a read, for the times and the metrics' labels.
            Kind::Read | Kind::Upgradable => HoldKind::Read,
            Kind::Write => HoldKind::Write,
            Kind::Permit => HoldKind::Permit,
        };
        let hold = &self.hold;
        self.engine.counters.released(kind, hold.path, hold.since);
    }

    /// Records the hold's time and gives the hold back (or leaves the turn).
    fn release(&self) -> Result<Unlocked> {
        self.record();
        match self.kind {
            Kind::Read | Kind::Upgradable => self.engine.leave_turn(&self.hold, Mode::Read),
            Kind::Write => self.engine.leave_turn(&self.hold, Mode::Write),
            Kind::Permit => self.engine.release_shared(&self.hold.remote),
        }
    }
}

impl Drop for SharedGuard {
    fn drop(&mut self) {
        if !self.released {
            release_on_drop(
                format_args!("{:?}", self.hold.remote.keys.display()),
                || self.release(),
            );
        }
    }
}

/// Proof that this thread reads a [`RwLock`]. Dropping it lets go (best effort, never
/// panicking); [`unlock`](ReadGuard::unlock) does the same and says what happened. Not
/// `Send`, like [`LockGuard`](crate::LockGuard).
///
/// # Examples
///
/// ```
/// # fn main() -> Result<(), redbaton::Error> {
/// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
/// let r = client.rwlock("catalog").read()?;
/// r.check()?;
/// r.unlock()?;
/// # Ok(()) }
/// ```
#[must_use = "the read hold is released as soon as the guard is dropped"]
pub struct ReadGuard(SharedGuard);

/// Proof that this thread writes a [`RwLock`]: nobody else reads or writes it. Dropping it
/// lets go (best effort, never panicking); [`unlock`](WriteGuard::unlock) does the same
/// and says what happened. Not `Send`, like [`LockGuard`](crate::LockGuard); to release
/// it from another thread, [`detach`](WriteGuard::detach) it first.
///
/// # Examples
///
/// ```
/// # fn main() -> Result<(), redbaton::Error> {
/// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
/// let w = client.rwlock("catalog").write()?;
/// w.check()?;
/// w.unlock()?;
/// # Ok(()) }
/// ```
#[must_use = "the write hold is released as soon as the guard is dropped"]
pub struct WriteGuard(SharedGuard);

impl std::fmt::Debug for ReadGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReadGuard")
            .field("name", &String::from_utf8_lossy(self.0.name()))
            .field("fencing_token", &self.fencing_token())
            .finish_non_exhaustive()
    }
}

impl std::fmt::Debug for WriteGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WriteGuard")
            .field("name", &String::from_utf8_lossy(self.0.name()))
            .field("fencing_token", &self.fencing_token())
            .finish_non_exhaustive()
    }
}

impl ReadGuard {
    shared_guard_methods!("read hold", "client.rwlock(\"catalog\").read()");

    /// Lets go of the read hold (the process's last reader releases it in Redis) and says
    /// what happened.
    ///
    /// # Errors
    ///
    /// Redis errors when the release could not be confirmed (the hold then expires with
    /// its lease).
    ///
    /// # Examples
    ///
    /// ```
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// let r = client.rwlock("catalog").read()?;
    /// assert!(r.unlock()?.was_held());
    /// # Ok(()) }
    /// ```
    pub fn unlock(self) -> Result<Unlocked> {
        self.0.unlock()
    }

    /// The read's fencing token. Under a remote read hold it is `(f << 12) | (2^12 − 1)`,
    /// where `f` is the name's fence counter when the hold began; under this process's
    /// write hold, the token of the last local write before the read. Either way it is at
    /// least the token of every write that ended before the read began, and below the
    /// token of every write that begins after it. Readers that share a hold may share a
    /// token.
    ///
    /// # Examples
    ///
    /// ```
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// let rw = client.rwlock("catalog");
    /// let w = rw.write()?.fencing_token();
    /// let r = rw.read()?.fencing_token();
    /// assert!(r > w);
    /// assert!(rw.write()?.fencing_token() > r);
    /// # Ok(()) }
    /// ```
    pub fn fencing_token(&self) -> u64 {
        self.0.token()
    }
}

impl WriteGuard {
    shared_guard_methods!("write hold", "client.rwlock(\"catalog\").write()");

    /// Releases the write hold in Redis and says what happened.
    ///
    /// # Errors
    ///
    /// Redis errors when the release could not be confirmed (the hold then expires with
    /// its lease).
    ///
    /// # Examples
    ///
    /// ```
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// let w = client.rwlock("catalog").write()?;
    /// assert!(w.unlock()?.was_held());
    /// # Ok(()) }
    /// ```
    pub fn unlock(self) -> Result<Unlocked> {
        self.0.unlock()
    }

    /// The write's fencing token: `(f << 12) | k`, where `f` is the name's fence counter,
    /// which the remote write hold incremented, and `k` = 1, 2, … numbers the local writes
    /// that took turns on that hold (a hold serves fewer than 2^12 − 1 of them). Strictly
    /// increasing across writers, and laid out like a plain lock's token of the same name,
    /// so both compare.
    ///
    /// # Examples
    ///
    /// ```
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// let rw = client.rwlock("catalog");
    /// let first = rw.write()?.fencing_token();
    /// assert!(rw.write()?.fencing_token() > first);
    /// # Ok(()) }
    /// ```
    pub fn fencing_token(&self) -> u64 {
        self.0.token()
    }

    /// Whether the write hold before this one ended without a release (its lease ran out:
    /// its writer crashed or stalled): what it was changing may be half-changed (see
    /// [`LockGuard::previous_lost`](crate::LockGuard::previous_lost)). False after a
    /// release, and for a write that took a turn on this process's write hold. Read holds
    /// leave the counter as it is: a read guard has no such answer.
    ///
    /// # Examples
    ///
    /// ```
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// let rw = client.rwlock("previous-lost-rw-doc");
    /// rw.write()?.unlock()?;
    /// assert!(!rw.write()?.previous_lost(), "the last writer released it");
    /// # Ok(()) }
    /// ```
    pub fn previous_lost(&self) -> bool {
        self.0.previous_lost()
    }

    /// Takes the write hold out of this thread's hands: the [`DetachedWriteGuard`]
    /// returned keeps it in Redis (same token, lease, watchdog renewals and lost signal)
    /// and may be sent to another thread, which can check and release it.
    ///
    /// The hold leaves this process's local turns for good: no local reader or writer
    /// takes a turn on it, and the threads of this process waiting for the name ask Redis
    /// like any other process, where they wait until the detached guard has released it.
    /// This thread no longer holds the name either: asking for it again waits for the
    /// detached guard like everyone else.
    ///
    /// # Examples
    ///
    /// ```
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// let w = client.rwlock("catalog").write()?;
    /// let token = w.fencing_token();
    /// let detached = w.detach();
    /// assert_eq!(detached.fencing_token(), token);
    /// let outcome = std::thread::spawn(move || detached.unlock()).join().unwrap()?;
    /// assert_eq!(outcome, redbaton::Unlocked::Released);
    /// # Ok(()) }
    /// ```
    pub fn detach(self) -> DetachedWriteGuard {
        DetachedWriteGuard::new(self.0.detach_write())
    }

    /// Turns the write hold into a read hold, in one step in Redis: no writer gets in
    /// between, the readers waiting (of this process and, when no writer waits, of the
    /// others) may join at once, and a writer waiting goes on waiting for the readers. The
    /// read's fencing token is that of a read hold begun with this write's fence (above
    /// this write's token, below the next writer's).
    ///
    /// A write hold this process's threads take turns on stays theirs, as a read hold the
    /// local readers join; one of this thread's own (an upgraded read, or every hold with
    /// [`local_handoff(false)`](crate::Builder::local_handoff)) stays its own.
    ///
    /// # Errors
    ///
    /// [`Error::Lost`] when the write hold is known lost or Redis found it gone; Redis
    /// errors when the step could not be confirmed. Either way the write hold is given
    /// back, as by a drop (and a read hold the step may have made is released in the
    /// background). A step that may have run unconfirmed may have taken the write hold
    /// with it: the hold is then lost ([`LostReason::Converted`](crate::LostReason::Converted)), and
    /// the other threads of this process waiting for it ask Redis rather than take a turn
    /// on it.
    ///
    /// # Examples
    ///
    /// ```
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// let rw = client.rwlock("catalog");
    /// let w = rw.write()?;
    /// let written = w.fencing_token();
    /// // ... write ...
    /// let r = w.downgrade()?;
    /// assert!(r.fencing_token() > written);
    /// std::thread::scope(|s| {
    ///     // Readers join; writers still wait.
    ///     s.spawn(|| drop(rw.try_read().unwrap()));
    ///     assert!(s.spawn(|| rw.try_write().is_err()).join().unwrap());
    /// });
    /// # Ok(()) }
    /// ```
    pub fn downgrade(self) -> Result<ReadGuard> {
        self.0.downgrade().map(ReadGuard)
    }
}

/// Proof that this thread holds the upgradable read of a [`RwLock`] (see
/// [`RwLock::upgradable_read`]): it reads beside the other readers, and no writer nor other
/// upgradable reader holds the lock. [`upgrade`](Self::upgrade) turns it into the write
/// hold. Dropping it lets go (best effort, never panicking); [`unlock`](Self::unlock) does
/// the same and says what happened. Not `Send`, like [`LockGuard`](crate::LockGuard): an
/// upgrade happens on the thread that holds it.
///
/// # Examples
///
/// ```
/// # fn main() -> Result<(), redbaton::Error> {
/// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
/// let config = client.rwlock("config");
/// let entry = config.upgradable_read()?;
/// let stale = true; // ... decided by reading ...
/// if stale {
///     let w = entry.upgrade()?;
///     // ... write, with `w.fencing_token()` ...
/// }
/// # Ok(()) }
/// ```
#[must_use = "the upgradable read hold is released as soon as the guard is dropped"]
pub struct UpgradableReadGuard(SharedGuard);

impl std::fmt::Debug for UpgradableReadGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UpgradableReadGuard")
            .field("name", &String::from_utf8_lossy(self.0.name()))
            .field("fencing_token", &self.fencing_token())
            .finish_non_exhaustive()
    }
}

impl UpgradableReadGuard {
    shared_guard_methods!(
        "upgradable read hold",
        "client.rwlock(\"catalog\").upgradable_read()"
    );

    /// Lets go of the upgradable read hold in Redis and says what happened.
    ///
    /// # Errors
    ///
    /// Redis errors when the release could not be confirmed (the hold then expires with
    /// its lease).
    ///
    /// # Examples
    ///
    /// ```
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// let u = client.rwlock("catalog").upgradable_read()?;
    /// assert!(u.unlock()?.was_held());
    /// # Ok(()) }
    /// ```
    pub fn unlock(self) -> Result<Unlocked> {
        self.0.unlock()
    }

    /// The read's fencing token, as a read hold's (see [`ReadGuard::fencing_token`]).
    ///
    /// # Examples
    ///
    /// ```
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// let rw = client.rwlock("catalog");
    /// let u = rw.upgradable_read()?;
    /// let read = u.fencing_token();
    /// assert!(u.upgrade()?.fencing_token() > read);
    /// # Ok(()) }
    /// ```
    pub fn fencing_token(&self) -> u64 {
        self.0.token()
    }

    /// Turns the upgradable read into the write hold: waits until the other readers are
    /// done, then takes the write hold in one step in Redis, so that no writer gets in
    /// between (the upgradable hold keeps them out meanwhile). While it waits, no new read
    /// hold is granted (as for a waiting writer), and the process's local readers give
    /// their read hold back at its next budget check. The write's fencing token is a
    /// writer's: the name's fence counter was incremented.
    ///
    /// # Errors
    ///
    /// [`Error::Lost`] when the upgradable hold is known lost or Redis found it gone;
    /// Redis errors. The upgradable hold is given back then, as by a drop: use
    /// [`try_upgrade_for`](Self::try_upgrade_for) to keep it.
    ///
    /// # Examples
    ///
    /// ```
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// let w = client.rwlock("catalog").upgradable_read()?.upgrade()?;
    /// w.check()?;
    /// # Ok(()) }
    /// ```
    pub fn upgrade(self) -> Result<WriteGuard> {
        self.upgrade_with(Wait::Until(None, None))
            .map_err(UpgradeError::into_error)
    }

    /// The write hold if the upgrade can be made right now (no other reader holds).
    ///
    /// # Errors
    ///
    /// An [`UpgradeError`] with this guard back: [`Error::WouldBlock`] when other readers
    /// hold; otherwise as [`upgrade`](Self::upgrade).
    ///
    /// # Examples
    ///
    /// ```
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let url = redbaton_testkit::redis_url();
    /// # let client = redbaton::LockClient::builder().node(url.as_str()).build()?;
    /// # let other = redbaton::LockClient::builder().node(url.as_str()).build()?;
    /// let u = client.rwlock("catalog").upgradable_read()?;
    /// let reader = other.rwlock("catalog").read()?; // another process, say
    /// let u = u.try_upgrade().unwrap_err().into_guard(); // still the upgradable read
    /// drop(reader);
    /// let w = u.try_upgrade()?;
    /// # Ok(()) }
    /// ```
    pub fn try_upgrade(self) -> std::result::Result<WriteGuard, UpgradeError> {
        self.upgrade_with(Wait::No)
    }

    /// Waits at most `timeout` for the upgrade.
    ///
    /// # Errors
    ///
    /// An [`UpgradeError`] with this guard back, still holding the upgradable read:
    /// [`Error::Timeout`] when the other readers were not done in time (the upgrade's
    /// waiting mark is removed, so new readers may read again); otherwise as
    /// [`upgrade`](Self::upgrade) (after an upgrade that went unanswered, the guard is
    /// lost: see [`UpgradeError`]).
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let url = redbaton_testkit::redis_url();
    /// # let client = redbaton::LockClient::builder().node(url.as_str()).build()?;
    /// # let other = redbaton::LockClient::builder().node(url.as_str()).build()?;
    /// let u = client.rwlock("catalog").upgradable_read()?;
    /// let reader = other.rwlock("catalog").read()?; // another process, say
    /// let u = match u.try_upgrade_for(Duration::from_millis(50)) {
    ///     Ok(_w) => unreachable!("a reader holds"),
    ///     Err(e) => {
    ///         assert!(e.error().is_timeout());
    ///         e.into_guard() // still the upgradable read
    ///     }
    /// };
    /// u.check()?;
    /// # Ok(()) }
    /// ```
    pub fn try_upgrade_for(
        self,
        timeout: Duration,
    ) -> std::result::Result<WriteGuard, UpgradeError> {
        self.upgrade_with(Wait::Until(Instant::now().checked_add(timeout), None))
    }

    /// Waits until `deadline` at most for the upgrade.
    ///
    /// # Errors
    ///
    /// As [`try_upgrade_for`](Self::try_upgrade_for).
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::{Duration, Instant};
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// let u = client.rwlock("catalog").upgradable_read()?;
    /// let w = u.try_upgrade_until(Instant::now() + Duration::from_secs(1))?;
    /// # Ok(()) }
    /// ```
    pub fn try_upgrade_until(
        self,
        deadline: Instant,
    ) -> std::result::Result<WriteGuard, UpgradeError> {
        self.upgrade_with(Wait::Until(Some(deadline), None))
    }

    fn upgrade_with(self, wait: Wait<'_>) -> std::result::Result<WriteGuard, UpgradeError> {
        self.0
            .upgrade(wait)
            .map(WriteGuard)
            .map_err(|(guard, error)| UpgradeError {
                guard: UpgradableReadGuard(guard),
                error,
            })
    }
}

/// An upgrade that was not made (see [`UpgradableReadGuard::try_upgrade_for`]): why, and
/// the upgradable read guard, given back. The guard still holds the upgradable read unless
/// the error says it is lost ([`Error::Lost`]: also when the upgrade ran but its reply came
/// after the hold's lease, too late to use, or when an attempt was still unanswered at
/// the deadline), or the upgrade went unanswered (a connection error,
/// [`Error::is_connection`]): it may have run, turning the upgradable
/// read into the write hold, which the library gives back, so the guard is then lost
/// ([`LostReason::Converted`](crate::LostReason::Converted)). A guard lost so has its
/// upgradable read given back at once, should it still be held in Redis: writers do not
/// wait for the guard's drop. Its
/// [`check`](UpgradableReadGuard::check) always says which. Converts into [`Error`] for `?`
/// (the guard is then dropped, which lets go of the hold). Not `Send`, as the guard it
/// carries.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// # fn main() -> Result<(), redbaton::Error> {
/// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
/// let u = client.rwlock("catalog").upgradable_read()?;
/// match u.try_upgrade_for(Duration::from_secs(1)) {
///     Ok(w) => drop(w),
///     Err(e) if e.error().is_timeout() => drop(e.into_guard()), // read on, or give up
///     Err(e) => return Err(e.into()),
/// }
/// # Ok(()) }
/// ```
pub struct UpgradeError {
    guard: UpgradableReadGuard,
    error: Error,
}

impl UpgradeError {
    /// Why the upgrade was not made.
    ///
    /// # Examples
    ///
    /// ```
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let url = redbaton_testkit::redis_url();
    /// # let client = redbaton::LockClient::builder().node(url.as_str()).build()?;
    /// # let other = redbaton::LockClient::builder().node(url.as_str()).build()?;
    /// let u = client.rwlock("catalog").upgradable_read()?;
    /// let reader = other.rwlock("catalog").read()?;
    /// let e = u.try_upgrade().unwrap_err();
    /// assert!(e.error().is_would_block());
    /// # Ok(()) }
    /// ```
    pub fn error(&self) -> &Error {
        &self.error
    }

    /// The upgradable read guard, given back.
    ///
    /// # Examples
    ///
    /// ```
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let url = redbaton_testkit::redis_url();
    /// # let client = redbaton::LockClient::builder().node(url.as_str()).build()?;
    /// # let other = redbaton::LockClient::builder().node(url.as_str()).build()?;
    /// let u = client.rwlock("catalog").upgradable_read()?;
    /// let reader = other.rwlock("catalog").read()?;
    /// if let Err(e) = u.try_upgrade() {
    ///     e.into_guard().check()?; // still reading
    /// }
    /// # Ok(()) }
    /// ```
    pub fn into_guard(self) -> UpgradableReadGuard {
        self.guard
    }

    /// The guard and the error.
    ///
    /// # Examples
    ///
    /// ```
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let url = redbaton_testkit::redis_url();
    /// # let client = redbaton::LockClient::builder().node(url.as_str()).build()?;
    /// # let other = redbaton::LockClient::builder().node(url.as_str()).build()?;
    /// let u = client.rwlock("catalog").upgradable_read()?;
    /// let reader = other.rwlock("catalog").read()?;
    /// if let Err(e) = u.try_upgrade() {
    ///     let (guard, why) = e.into_parts();
    ///     eprintln!("not upgraded ({why}); still reading: {}", guard.check().is_ok());
    /// }
    /// # Ok(()) }
    /// ```
    pub fn into_parts(self) -> (UpgradableReadGuard, Error) {
        (self.guard, self.error)
    }

    /// The error alone; the guard is dropped (letting go of the upgradable read).
    fn into_error(self) -> Error {
        self.error
    }
}

impl std::fmt::Debug for UpgradeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UpgradeError")
            .field("error", &self.error)
            .field("guard", &self.guard)
            .finish()
    }
}

impl std::fmt::Display for UpgradeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("upgrade not made")
    }
}

impl std::error::Error for UpgradeError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

impl From<UpgradeError> for Error {
    fn from(e: UpgradeError) -> Self {
        e.into_error()
    }
}
