//! Error types and the small outcome enums of the public API.

use std::fmt;

/// Everything that can go wrong when taking, holding or releasing a lock.
///
/// Messages are short and lowercase and never repeat their cause: the underlying `redis`
/// or I/O error, when there is one, is the [`source`](std::error::Error::source), so that
/// printing the chain (`anyhow`'s `{:#}`, say) shows each cause once. Use the `is_*`
/// predicates rather than matching when you only need to classify.
///
/// # Examples
///
/// ```
/// use redbaton::Error;
///
/// let err = Error::Timeout;
/// assert!(err.is_timeout());
/// assert_eq!(err.to_string(), "wait timed out");
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// `try_lock`: the lock is held by someone else right now.
    #[error("lock is held elsewhere")]
    WouldBlock,
    /// The wait deadline passed before the lock (a hold, a permit, or a latch's opening)
    /// came.
    #[error("wait timed out")]
    Timeout,
    /// The caller cancelled the wait with a [`Cancel`](crate::Cancel) before the lock
    /// could be taken. Nothing of the wait is left behind (no queue entry, no mark).
    #[error("wait cancelled")]
    Cancelled,
    /// The lock was lost while held (see [`LostReason`]).
    #[error("lock lost: {0}")]
    Lost(LostReason),
    /// Redlock: too few nodes granted the lock (or answered at all) for a majority. A
    /// timed wait whose deadline passed before a majority could answer ends with
    /// [`Error::Timeout`] instead.
    #[error("no quorum: {granted} of {nodes} nodes granted the lock, {needed} needed")]
    NoQuorum {
        /// Nodes that granted the lock in the last round with its fencing token: a node
        /// that granted it but could not raise its fence counter to the token (the
        /// highest the granting nodes gave) does not count, since a later majority must
        /// meet a node that carries the token.
        granted: usize,
        /// Nodes needed for a majority.
        needed: usize,
        /// Nodes configured.
        nodes: usize,
    },
    /// `replica_ack`: fewer replicas than asked acknowledged the lock's acquisition (or
    /// renewal) in time, until the caller's deadline. The acquisition was undone.
    #[error("{acked} of {wanted} replicas acknowledged the lock in time")]
    ReplicaAck {
        /// Replicas that acknowledged the last attempt. When the caller's deadline cut
        /// that attempt's `WAIT` short, its answer is unknown: then as many as
        /// acknowledged the node's last answered `WAIT` (fewer than `wanted`).
        acked: usize,
        /// Replicas asked for.
        wanted: usize,
    },
    /// The calling thread already holds this lock through this client: waiting would wait
    /// for itself.
    #[error("this thread already holds the lock")]
    WouldDeadlock,
    /// The lock name is not acceptable (empty or too long).
    #[error("invalid lock name: {0}")]
    InvalidName(&'static str),
    /// A builder setting is invalid; the message says which, and its accepted range.
    #[error("invalid configuration: {0}")]
    InvalidConfig(String),
    /// An argument of a call is out of range (a zero lease given to
    /// [`LockGuard::extend`](crate::LockGuard::extend), say); the message says which.
    ///
    /// ```
    /// use std::time::Duration;
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// let guard = client.lock("k")?;
    /// let e = guard.extend(Duration::ZERO).unwrap_err();
    /// assert!(matches!(e, redbaton::Error::InvalidArgument(_)));
    /// assert!(e.is_invalid_input());
    /// # Ok(()) }
    /// ```
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// Every pooled connection stayed busy for longer than the connect timeout (or than
    /// what remained of the call's deadline).
    #[error("connection pool exhausted")]
    PoolExhausted,
    /// Redis answered something this library does not expect (a bug or a foreign value).
    #[error("unexpected reply from redis: {0}")]
    Protocol(String),
    /// A Redis or I/O error; the `redis` error is the source (see
    /// [`redis_error`](Error::redis_error)).
    #[error("redis request failed")]
    Redis(#[source] redis::RedisError),
    /// The name is held in Redis as another kind of lock (a plain lock, a read-write lock
    /// or a semaphore) than the one asked for, or its key holds a value of a type this
    /// library does not write: one name, one kind at a time.
    #[error("the name is held as another kind of lock")]
    WrongKind,
    /// A semaphore was opened with another permit count than the one its current holders
    /// use.
    #[error("semaphore has {stored} permits in redis, {asked} asked")]
    PermitsMismatch {
        /// The permit count of the semaphore's current holders.
        stored: u32,
        /// The permit count this call asked for.
        asked: u32,
    },
    /// A countdown latch was opened with another count than the one it was created with
    /// (see [`LockClient::latch`](crate::LockClient::latch)).
    #[error("latch has count {stored} in redis, {asked} asked")]
    CountMismatch {
        /// The count the live latch was created with.
        stored: u64,
        /// The count this call asked for.
        asked: u64,
    },
    /// The countdown latch waited on expired (its TTL,
    /// [`Builder::latch_ttl`](crate::Builder::latch_ttl), ran out without a count down, or
    /// it was deleted) before its count reached zero. The waiter returns rather than wait
    /// for a latch nobody counts down any more.
    ///
    /// A waiter that reads its latch only after the open latch itself expired (it stayed
    /// open one `latch_ttl`, and the waiter was stopped longer than that, or slept past
    /// it) cannot tell it from one that expired unopened, and gets this too.
    #[error("latch expired before its count reached zero")]
    LatchExpired,
    /// The operation is not available on this client's topology: read-write locks,
    /// semaphores, multi-locks and countdown latches need one node to decide (one node,
    /// Sentinel, or a Cluster slot's master), so Redlock does not take them.
    #[error("not supported: {0}")]
    Unsupported(&'static str),
    /// The client was [shut down](crate::LockClient::shutdown): no clone of it takes a
    /// new hold (nothing would renew it). Build a new client.
    #[error("the client was shut down")]
    ShutDown,
    /// Redis Cluster: the lock's hash slot is half-way through a migration between two
    /// masters, and the servers refused the lock's scripts (`TRYAGAIN`) for longer than
    /// the call could wait, or redirected them back and forth between the two masters
    /// (the source still `MIGRATING` while the target no longer imports the slot, after
    /// a failover of its own). While a slot migrates, Redis runs a command naming several
    /// keys of it only where all of them exist, and a free lock has no key: it cannot be
    /// taken until the migration ends. [`try_lock`](crate::LockClient::try_lock) gives
    /// this after about 2 s, [`lock`](crate::LockClient::lock) after one
    /// [`lease`](crate::Builder::lease) of retrying; a call with a deadline gets
    /// [`Timeout`](Error::Timeout) instead. Retrying later helps.
    #[error("the lock's hash slot is migrating between cluster masters")]
    SlotMigrating,
    /// The operating system refused to start one of the client's threads; the I/O error is
    /// the source. Not a connection error: retrying soon rarely helps.
    ///
    /// ```
    /// let e = redbaton::Error::Thread {
    ///     what: "watchdog",
    ///     source: std::io::Error::other("resource temporarily unavailable"),
    /// };
    /// assert_eq!(e.to_string(), "cannot start the watchdog thread");
    /// assert!(!e.is_connection());
    /// assert!(std::error::Error::source(&e).is_some());
    /// ```
    #[error("cannot start the {what} thread")]
    Thread {
        /// Which thread: `subscriber`, `watchdog`, `fanout` or `sentinel`.
        what: &'static str,
        /// Why it could not start.
        #[source]
        source: std::io::Error,
    },
}

impl Error {
    /// `try_lock` found the lock held.
    ///
    /// # Examples
    ///
    /// ```
    /// assert!(redbaton::Error::WouldBlock.is_would_block());
    /// ```
    pub fn is_would_block(&self) -> bool {
        matches!(self, Error::WouldBlock)
    }

    /// The wait deadline passed.
    ///
    /// # Examples
    ///
    /// ```
    /// assert!(redbaton::Error::Timeout.is_timeout());
    /// ```
    pub fn is_timeout(&self) -> bool {
        matches!(self, Error::Timeout)
    }

    /// The wait was cancelled ([`Error::Cancelled`]).
    ///
    /// # Examples
    ///
    /// ```
    /// let e = redbaton::Error::Cancelled;
    /// assert!(e.is_cancelled());
    /// assert_eq!(e.to_string(), "wait cancelled");
    /// ```
    pub fn is_cancelled(&self) -> bool {
        matches!(self, Error::Cancelled)
    }

    /// The lock was lost while held.
    ///
    /// # Examples
    ///
    /// ```
    /// use redbaton::{Error, LostReason};
    /// assert!(Error::Lost(LostReason::Stolen).is_lost());
    /// ```
    pub fn is_lost(&self) -> bool {
        matches!(self, Error::Lost(_))
    }

    /// Redlock could not reach a majority.
    ///
    /// # Examples
    ///
    /// ```
    /// let e = redbaton::Error::NoQuorum { granted: 2, needed: 3, nodes: 5 };
    /// assert!(e.is_no_quorum());
    /// assert_eq!(e.to_string(), "no quorum: 2 of 5 nodes granted the lock, 3 needed");
    /// ```
    pub fn is_no_quorum(&self) -> bool {
        matches!(self, Error::NoQuorum { .. })
    }

    /// Bad configuration, a bad argument or a bad lock name: retrying will not help.
    ///
    /// # Examples
    ///
    /// ```
    /// let e = redbaton::LockClient::builder().pool_size(0).build().unwrap_err();
    /// assert!(e.is_invalid_input());
    /// ```
    pub fn is_invalid_input(&self) -> bool {
        matches!(
            self,
            Error::InvalidConfig(_) | Error::InvalidName(_) | Error::InvalidArgument(_)
        )
    }

    /// The name is held as another kind of lock than the one asked for.
    ///
    /// # Examples
    ///
    /// ```
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// let guard = client.lock("report")?;
    /// let err = client.rwlock("report").try_read().unwrap_err();
    /// assert!(err.is_wrong_kind());
    /// # Ok(()) }
    /// ```
    pub fn is_wrong_kind(&self) -> bool {
        matches!(self, Error::WrongKind)
    }

    /// A semaphore was opened with another permit count than the stored one.
    ///
    /// # Examples
    ///
    /// ```
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// let permit = client.semaphore("quota", 3).acquire()?;
    /// let err = client.semaphore("quota", 5).try_acquire().unwrap_err();
    /// assert!(err.is_permits_mismatch());
    /// # Ok(()) }
    /// ```
    pub fn is_permits_mismatch(&self) -> bool {
        matches!(self, Error::PermitsMismatch { .. })
    }

    /// A countdown latch was opened with another count than its stored one
    /// ([`Error::CountMismatch`]).
    ///
    /// # Examples
    ///
    /// ```
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// client.latch("workers-ready", 3).count()?;
    /// let err = client.latch("workers-ready", 5).count_down().unwrap_err();
    /// assert!(err.is_count_mismatch());
    /// assert_eq!(err.to_string(), "latch has count 3 in redis, 5 asked");
    /// # Ok(()) }
    /// ```
    pub fn is_count_mismatch(&self) -> bool {
        matches!(self, Error::CountMismatch { .. })
    }

    /// The client was shut down before the call ([`Error::ShutDown`]).
    ///
    /// # Examples
    ///
    /// ```
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let url = redbaton_testkit::redis_url();
    /// let client = redbaton::LockClient::builder().node(url).build()?;
    /// let clone = client.clone();
    /// client.shutdown(std::time::Duration::from_secs(5))?;
    /// assert!(clone.lock("after").unwrap_err().is_shut_down());
    /// # Ok(()) }
    /// ```
    pub fn is_shut_down(&self) -> bool {
        matches!(self, Error::ShutDown)
    }

    /// The countdown latch waited on expired before its count reached zero
    /// ([`Error::LatchExpired`]).
    ///
    /// # Examples
    ///
    /// ```
    /// let e = redbaton::Error::LatchExpired;
    /// assert!(e.is_latch_expired());
    /// assert_eq!(e.to_string(), "latch expired before its count reached zero");
    /// ```
    pub fn is_latch_expired(&self) -> bool {
        matches!(self, Error::LatchExpired)
    }

    /// Redis Cluster: the lock's slot was migrating for longer than the call could wait
    /// ([`Error::SlotMigrating`]).
    ///
    /// # Examples
    ///
    /// ```
    /// assert!(redbaton::Error::SlotMigrating.is_slot_migrating());
    /// ```
    pub fn is_slot_migrating(&self) -> bool {
        matches!(self, Error::SlotMigrating)
    }

    /// The operation is not available on this client's topology.
    ///
    /// # Examples
    ///
    /// ```
    /// assert!(redbaton::Error::Unsupported("redlock").is_unsupported());
    /// ```
    pub fn is_unsupported(&self) -> bool {
        matches!(self, Error::Unsupported(_))
    }

    /// A network-level failure talking to Redis: refused, reset, timed out, or the pool
    /// had no connection to give. Retrying later may help.
    ///
    /// # Examples
    ///
    /// ```
    /// // Nothing listens on port 1.
    /// let e = redbaton::LockClient::builder().node("redis://127.0.0.1:1/").build().unwrap_err();
    /// assert!(e.is_connection());
    /// assert!(e.redis_error().is_some());
    /// ```
    pub fn is_connection(&self) -> bool {
        match self {
            Error::PoolExhausted => true,
            Error::Redis(e) => is_network_error(e),
            _ => false,
        }
    }

    /// Too few replicas acknowledged the lock in time ([`Error::ReplicaAck`]).
    ///
    /// # Examples
    ///
    /// ```
    /// let e = redbaton::Error::ReplicaAck { acked: 0, wanted: 1 };
    /// assert!(e.is_replica_ack());
    /// assert_eq!(e.to_string(), "0 of 1 replicas acknowledged the lock in time");
    /// ```
    pub fn is_replica_ack(&self) -> bool {
        matches!(self, Error::ReplicaAck { .. })
    }

    /// Redis refused the credentials: a wrong password, an unknown or disabled ACL user,
    /// or a server that wants a password and got none. Retrying will not help; unlike
    /// [`is_connection`](Self::is_connection), the server was reached.
    ///
    /// # Examples
    ///
    /// ```
    /// # fn main() {
    /// # let url = redbaton_testkit::redis_url();
    /// // The server has no user "nobody".
    /// let url = url.replace("redis://", "redis://nobody:wrong@");
    /// let e = redbaton::LockClient::builder().node(url).build().unwrap_err();
    /// assert!(e.is_auth());
    /// assert!(!e.is_connection());
    /// assert!(!format!("{e} {e:?}").contains("wrong"));
    /// # }
    /// ```
    pub fn is_auth(&self) -> bool {
        match self {
            Error::Redis(e) => is_auth_error(e),
            _ => false,
        }
    }

    /// The server was reached and refused the command for a reason of its own, which the
    /// lock's state has nothing to do with: an ACL without a command the lock needs
    /// (`NOPERM`), memory full under `maxmemory` with `noeviction` (`OOM`), a replica
    /// (`READONLY`), failed snapshots that stop writes (`MISCONF`), too few replicas for
    /// `min-replicas-to-write` (`NOREPLICAS`), a replica cut off from its master
    /// (`MASTERDOWN`), a long script or function running (`BUSY`), or data loading at
    /// start-up (`LOADING`). [`refusal_code`](Self::refusal_code) says which.
    ///
    /// The refused command did not run, and what the call was to do is not done (a lock
    /// not taken, a release not made: the lease ends the hold). `BUSY` and `LOADING` pass
    /// by themselves, usually within seconds; the others last until the server's settings
    /// or its role change. Not a connection error
    /// ([`is_connection`](Self::is_connection) is false): the server answered. Credentials
    /// refused are [`is_auth`](Self::is_auth), not this.
    ///
    /// Behind Sentinel or in Redis Cluster a `READONLY` is a master demoted by a failover:
    /// a call that may wait follows the new master instead, and ends with
    /// [`Error::Timeout`] if the failover outlasts its deadline.
    ///
    /// # Examples
    ///
    /// ```
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let url = redbaton_testkit::redis_url();
    /// # let admin = redis::Client::open(url.as_str())?;
    /// # let _: () = redis::cmd("ACL")
    /// #     .arg(&["SETUSER", "reporter", "on", ">pw", "~*", "&*", "+@all", "-evalsha"])
    /// #     .query(&mut admin.get_connection()?)?;
    /// // The ACL user "reporter" may not run scripts (`-evalsha`).
    /// let url = url.replace("redis://", "redis://reporter:pw@");
    /// let client = redbaton::LockClient::builder().node(url).build()?;
    /// let e = client.try_lock("report").unwrap_err();
    /// assert!(e.is_refused());
    /// assert_eq!(e.refusal_code(), Some("NOPERM"));
    /// assert!(!e.is_connection() && !e.is_auth());
    /// # Ok(()) }
    /// ```
    pub fn is_refused(&self) -> bool {
        self.refusal_code().is_some()
    }

    /// Which refusal of [`is_refused`](Self::is_refused) it was: the server's error code,
    /// `"NOPERM"`, `"OOM"`, `"READONLY"`, `"MISCONF"`, `"NOREPLICAS"`, `"MASTERDOWN"`,
    /// `"BUSY"` or `"LOADING"`; `None` for every other error. The code is the same on every
    /// server, as Redis 7 names it, also where the server words a refusal met inside a
    /// script otherwise (Redis 6.2 passes it on under `ERR`, and Redis 7 and Valkey say an
    /// ACL's refusal there under `ERR`); the server's own message is in
    /// [`redis_error`](Self::redis_error).
    ///
    /// # Examples
    ///
    /// ```
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let url = redbaton_testkit::redis_url();
    /// let client = redbaton::LockClient::builder().node(url.as_str()).build()?;
    /// // Memory full, and nothing may be evicted to make room.
    /// let mut admin = redis::Client::open(url.as_str())?.get_connection()?;
    /// for (name, value) in [("maxmemory-policy", "noeviction"), ("maxmemory", "1")] {
    ///     let _: () = redis::cmd("CONFIG").arg("SET").arg(name).arg(value).query(&mut admin)?;
    /// }
    /// let e = client.try_lock("report").unwrap_err();
    /// match e.refusal_code() {
    ///     Some("OOM") => eprintln!("redis is out of memory: {e}"),
    ///     Some(code) => eprintln!("redis refused ({code}): {e}"),
    ///     None => eprintln!("{e}"),
    /// }
    /// assert_eq!(e.refusal_code(), Some("OOM"));
    /// assert_eq!(redbaton::Error::Timeout.refusal_code(), None);
    /// # Ok(()) }
    /// ```
    pub fn refusal_code(&self) -> Option<&str> {
        match self {
            Error::Redis(e) => refusal_code(e),
            _ => None,
        }
    }

    /// The TLS handshake failed: the server's certificate is not trusted (wrong CA,
    /// wrong host name, expired), or the server wants a client certificate
    /// ([`Builder::tls_client_identity`](crate::Builder::tls_client_identity)) and got none
    /// or one it does not trust.
    ///
    /// # Examples
    ///
    /// ```
    /// let e = redbaton::Error::Timeout;
    /// assert!(!e.is_tls());
    /// ```
    pub fn is_tls(&self) -> bool {
        let Error::Redis(e) = self else {
            return false;
        };
        let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
        while let Some(s) = source {
            #[cfg(feature = "tls")]
            if s.downcast_ref::<rustls::Error>().is_some() {
                return true;
            }
            if let Some(io) = s.downcast_ref::<std::io::Error>() {
                #[cfg(feature = "tls")]
                if io
                    .get_ref()
                    .is_some_and(|inner| inner.downcast_ref::<rustls::Error>().is_some())
                {
                    return true;
                }
                let _ = io;
            }
            source = s.source();
        }
        // The `redis` crate passes rustls' handshake errors on as text.
        let text = e.to_string().to_ascii_lowercase();
        [
            "handshake",
            "peer certificate",
            "certificate",
            "fatal alert",
        ]
        .iter()
        .any(|m| text.contains(m))
    }

    /// The underlying `redis` error, if any.
    ///
    /// # Examples
    ///
    /// ```
    /// let e = redbaton::LockClient::builder().node("redis://127.0.0.1:1/").build().unwrap_err();
    /// if let Some(r) = e.redis_error() {
    ///     eprintln!("redis said: {r}");
    /// }
    /// ```
    pub fn redis_error(&self) -> Option<&redis::RedisError> {
        match self {
            Error::Redis(e) => Some(e),
            _ => None,
        }
    }
}

impl From<redis::RedisError> for Error {
    fn from(e: redis::RedisError) -> Self {
        Error::Redis(e)
    }
}

/// A failure where the connection itself is suspect: the request may or may not have reached
/// Redis, and the connection must not be used again.
pub(crate) fn is_network_error(e: &redis::RedisError) -> bool {
    e.is_timeout() || e.is_connection_dropped() || e.is_io_error() || e.is_connection_refusal()
}

/// Redis refused the credentials, or wants some and got none (see [`Error::is_auth`]).
pub(crate) fn is_auth_error(e: &redis::RedisError) -> bool {
    e.kind() == redis::ErrorKind::AuthenticationFailed
        || matches!(e.code(), Some("WRONGPASS" | "NOAUTH"))
}

/// The codes of [`Error::is_refused`].
const REFUSALS: [&str; 8] = [
    "NOPERM",
    "OOM",
    "READONLY",
    "MISCONF",
    "NOREPLICAS",
    "MASTERDOWN",
    "BUSY",
    "LOADING",
];

/// Which refusal `e` is (see [`Error::refusal_code`]). A refusal met inside a script comes
/// in three wordings besides its own code: an ACL's, under `ERR` on Redis 7 (`The user
/// executing the script can't run this command …`) and Valkey (`ACL failure in script:
/// …`); Redis 6.2's, where the refused command's reply is text after the script's line
/// (`ERR Error running script … @user_script: 12: -OOM command not allowed …`); and that
/// text as a script passes on an error it caught (`pcall`), its line first and read as
/// the code (`@user_script: 12: -OOM …`). A pipeline's error (a multi-lock's release)
/// keeps each failure's code and words apart, and gives the error itself a code only
/// when redis-rs knows it, and no words: its first failure is read instead.
pub(crate) fn refusal_code(e: &redis::RedisError) -> Option<&'static str> {
    match e.clone().into_server_errors() {
        Some(failures) => {
            let (_, first) = failures.first()?;
            refusal_in(first.code(), first.details())
        }
        None => refusal_in(e.code()?, e.detail()),
    }
}

/// Which refusal a server error of `code` and words `detail` is (see [`refusal_code`]).
fn refusal_in(code: &str, detail: Option<&str>) -> Option<&'static str> {
    if let Some(known) = REFUSALS.iter().find(|r| **r == code) {
        return Some(known);
    }
    let in_script = code == "ERR" || code.starts_with("@user_script");
    let detail = detail.filter(|_| in_script)?;
    if detail.contains("can't run this command or subcommand")
        || detail.starts_with("ACL failure in script")
    {
        return Some("NOPERM");
    }
    if !detail.contains("@user_script") && code == "ERR" {
        return None;
    }
    REFUSALS.iter().copied().find(|r| {
        detail
            .match_indices(r)
            .any(|(at, _)| detail[..at].ends_with('-') && detail[at + r.len()..].starts_with(' '))
    })
}

/// Why a held lock was lost.
///
/// # Examples
///
/// ```
/// use redbaton::LostReason;
/// assert_eq!(LostReason::Stolen.to_string(), "held by another owner");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum LostReason {
    /// The lease ran out before a renewal succeeded (Redis unreachable, process paused,
    /// or renewals turned off).
    Expired,
    /// A renewal found the key gone (deleted, evicted, or the server restarted empty).
    Deleted,
    /// A renewal found the key holding another owner's token.
    Stolen,
    /// The configured cap on total hold time was reached; renewals stopped.
    HoldLimit,
    /// Redlock: fewer than a majority of nodes still hold the lock.
    NoQuorum,
    /// The watchdog thread kept failing, or was stopped by
    /// [`LockClient::shutdown`](crate::LockClient::shutdown) while the lock was held (or
    /// before a wait under way won it), so renewals stopped; the lock lives until its
    /// lease runs out, and this holder is told at once rather than then.
    ///
    /// ```
    /// let r = redbaton::LostReason::WatchdogFailed;
    /// assert_eq!(r.to_string(), "renewals stopped: the watchdog thread failed");
    /// ```
    WatchdogFailed,
    /// An upgrade of this upgradable read, or a downgrade of this write hold, went
    /// unanswered: it may have turned the hold into another in Redis, which the library
    /// then gave back, so this hold may be gone.
    ///
    /// ```
    /// let r = redbaton::LostReason::Converted;
    /// assert_eq!(r.to_string(), "an unanswered upgrade or downgrade may have replaced it");
    /// ```
    Converted,
}

impl fmt::Display for LostReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LostReason::Expired => "lease expired before renewal",
            LostReason::Deleted => "key deleted",
            LostReason::Stolen => "held by another owner",
            LostReason::HoldLimit => "hold-time limit reached",
            LostReason::NoQuorum => "held on fewer than a majority of nodes",
            LostReason::WatchdogFailed => "renewals stopped: the watchdog thread failed",
            LostReason::Converted => "an unanswered upgrade or downgrade may have replaced it",
        })
    }
}

/// What an explicit [`unlock`](crate::LockGuard::unlock) did.
///
/// # Examples
///
/// ```
/// # fn main() -> Result<(), redbaton::Error> {
/// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
/// let guard = client.lock("orders:42")?;
/// match guard.unlock()? {
///     redbaton::Unlocked::Released | redbaton::Unlocked::HandedOff => {}
///     other => eprintln!("the lock was not ours any more: {other}"),
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Unlocked {
    /// Given back in Redis — deleted, or with the fair queue granted to the next waiting
    /// process: it was still ours. Also, on one node (a Sentinel master, a Cluster
    /// slot's), when the reply was lost and a retry found the key gone or held by the
    /// next owner while our lease was still running: the first attempt did it. A lock's
    /// retry (plain or fair) that finds the key gone asks the fence counter first, and says
    /// [`Expired`](Unlocked::Expired) when it shows the hold ended without that attempt
    /// (the counter gone with the key in a restart without data, or still holding our
    /// hold as held). Redlock counts a retry's "gone" towards no majority (a node may have
    /// lost the key in a restart, the cause of the lost reply).
    Released,
    /// Passed to a waiting thread of this process without a Redis command.
    HandedOff,
    /// The key was already gone: the lease had expired, someone deleted it, or the server
    /// lost it (a restart without data).
    Expired,
    /// The key holds another owner's token; it was left alone.
    HeldByOther,
}

impl Unlocked {
    /// `Released` or `HandedOff`: the lock was still ours until this call.
    ///
    /// # Examples
    ///
    /// ```
    /// assert!(redbaton::Unlocked::HandedOff.was_held());
    /// assert!(!redbaton::Unlocked::Expired.was_held());
    /// ```
    pub fn was_held(self) -> bool {
        matches!(self, Unlocked::Released | Unlocked::HandedOff)
    }
}

impl fmt::Display for Unlocked {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Unlocked::Released => "released",
            Unlocked::HandedOff => "handed off to a local waiter",
            Unlocked::Expired => "already expired",
            Unlocked::HeldByOther => "held by another owner",
        })
    }
}

/// Shorthand for `Result<T, redbaton::Error>`.
///
/// # Examples
///
/// ```
/// fn transfer(client: &redbaton::LockClient) -> redbaton::Result<u64> {
///     let guard = client.lock("accounts:7")?;
///     Ok(guard.fencing_token())
/// }
/// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
/// # assert!(transfer(&client)? > 0);
/// # Ok::<(), redbaton::Error>(())
/// ```
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The error for a library thread that could not be started.
pub(crate) fn thread_error(what: &'static str, source: std::io::Error) -> Error {
    Error::Thread { what, source }
}
