//! The builder: documented defaults, validation in `build()`.

use std::time::Duration;

use crate::api::client::LockClient;
use crate::config::{Config, MAX_LEASE, MIN_LEASE, SentinelConfig, Wakeup};
use crate::error::{Error, Result};
use crate::fencing::MAX_LOCAL_SEQ;
use crate::proto::connect::{access, open_client};
use crate::proto::keys::MAX_PREFIX_LEN;

/// The longest timeout or interval accepted: longer ones are taken for mistakes (a
/// `Duration::MAX` meant as "never") rather than silently capped.
const MAX_INTERVAL: Duration = Duration::from_secs(24 * 3600);

/// The shortest `fence_ttl` accepted, whatever the lease and timeouts.
const MIN_FENCE_TTL: Duration = Duration::from_secs(1);
/// The longest `fence_ttl` accepted: longer is taken for a mistake.
const MAX_FENCE_TTL: Duration = Duration::from_secs(10 * 365 * 24 * 3600);

/// The shortest `latch_ttl` accepted: a latch must outlive the round trips of its users.
const MIN_LATCH_TTL: Duration = Duration::from_secs(1);
/// The longest `latch_ttl` accepted: longer is taken for a mistake.
const MAX_LATCH_TTL: Duration = Duration::from_secs(365 * 24 * 3600);

/// Builds a [`LockClient`]. Every setting has a default; [`build`](Builder::build) checks
/// them all and connects.
///
/// | setting | default |
/// |---|---|
/// | [`node`](Builder::node) / [`nodes`](Builder::nodes) | `redis://127.0.0.1:6379/` |
/// | [`key_prefix`](Builder::key_prefix) | `"redbaton:"` |
/// | [`lease`](Builder::lease) | 30 s |
/// | [`connect_timeout`](Builder::connect_timeout) | 2 s |
/// | [`read_timeout`](Builder::read_timeout), [`write_timeout`](Builder::write_timeout) | 2 s |
/// | [`pool_size`](Builder::pool_size) | 8 command connections per node |
/// | [`wakeup`](Builder::wakeup) | [`Wakeup::Notifications`] |
/// | [`configure_notifications`](Builder::configure_notifications) | `true` |
/// | [`recheck_interval`](Builder::recheck_interval) | 5 s |
/// | [`auto_renew`](Builder::auto_renew) | `true`, every [`renew_interval`](Builder::renew_interval) = lease / 3 |
/// | [`max_hold`](Builder::max_hold) | none |
/// | [`local_handoff`](Builder::local_handoff) | `true` |
/// | [`max_handoffs`](Builder::max_handoffs) | 16 consecutive handoffs while another process waits |
/// | [`handoff_slice`](Builder::handoff_slice) | 10 ms while another process waits |
/// | [`sentinel`](Builder::sentinel) | none: the node(s) given |
/// | [`fair`](Builder::fair) | `true`: processes take turns in arrival order (not for Redlock) |
/// | [`cluster`](Builder::cluster) | none: the node(s) given |
/// | [`replica_ack`](Builder::replica_ack) | none: an acquisition does not wait for replicas |
/// | [`fence_ttl`](Builder::fence_ttl) | 7 days: a name's fencing counter outlives its last acquisition by a week |
/// | [`latch_ttl`](Builder::latch_ttl) | 1 hour: a countdown latch outlives its creation or last count down by an hour |
/// | [`tls_ca_cert`](Builder::tls_ca_cert), [`tls_client_identity`](Builder::tls_client_identity) | the system's trust store, no client certificate |
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
///     .key_prefix("lock:")
///     .lease(Duration::from_secs(30))
///     .build()?;
/// # Ok(()) }
/// ```
///
/// Bad settings are an error, never a panic:
///
/// ```
/// use std::time::Duration;
///
/// let err = redbaton::LockClient::builder().lease(Duration::ZERO).build().unwrap_err();
/// assert!(err.is_invalid_input());
/// ```
#[derive(Clone, Debug, Default)]
#[must_use = "a builder does nothing until build() is called"]
pub struct Builder {
    /// Every setting, with its default (its `Debug` hides passwords and keys).
    settings: Config,
    /// Whether the caller chose the read timeout (see [`Builder::read_timeout`]).
    read_timeout_set: bool,
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
}

impl Builder {
    /// A builder with the defaults in the table above.
    ///
    /// # Examples
    ///
    /// ```
    /// let b = redbaton::Builder::new(); // same as LockClient::builder()
    /// # let _ = b;
    /// ```
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds one Redis node by URL (`redis://[user:password@]host:port/db`). One node is a
    /// plain lock; three or more (an odd number) make a Redlock.
    ///
    /// # Examples
    ///
    /// ```
    /// let b = redbaton::LockClient::builder().node("redis://:secret@127.0.0.1:6379/0");
    /// # let _ = b;
    /// ```
    pub fn node(mut self, url: impl Into<String>) -> Self {
        self.settings.nodes.push(url.into());
        self
    }

    /// Adds several independent Redis masters for Redlock (an odd number, at least 3, each
    /// a server of its own: `build()` refuses one named twice, also under two databases,
    /// or under two addresses when both answer at build time with one server's run id).
    ///
    /// # Examples
    ///
    /// ```
    /// let b = redbaton::LockClient::builder().nodes([
    ///     "redis://10.0.0.1:6379/",
    ///     "redis://10.0.0.2:6379/",
    ///     "redis://10.0.0.3:6379/",
    /// ]);
    /// # let _ = b;
    /// ```
    pub fn nodes<I, S>(mut self, urls: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.settings.nodes.extend(urls.into_iter().map(Into::into));
        self
    }

    /// Locks live on the master that the sentinels at `sentinel_urls` name
    /// `master_name`, and follow it when the sentinels promote a replica (instead of
    /// [`node`](Self::node)). The sentinels' own credentials and TLS come from their URLs
    /// (`redis://user:password@host:26379/`, `rediss://…`); the master's from
    /// [`sentinel_master_auth`](Self::sentinel_master_auth) and
    /// [`sentinel_master_tls`](Self::sentinel_master_tls).
    ///
    /// On a failover the client moves its connections, its subscriptions (waiters retry
    /// once) and its renewals to the new master. Meanwhile calls ride through it as in a
    /// [`cluster`](Self::cluster): a wait retries until its deadline, a
    /// [`lock`](crate::LockClient::lock) without one for one [`lease`](Self::lease),
    /// [`unlock`](crate::LockGuard::unlock) and [`extend`](crate::LockGuard::extend) while
    /// the lock's lease lasts; [`try_lock`](crate::LockClient::try_lock) does not wait.
    /// A lock survives it when the promoted replica had it —
    /// [`replica_ack`](Self::replica_ack) makes that the rule rather than luck; otherwise
    /// its holder's lost signal fires at the next renewal. Fencing counters are as fresh
    /// as the promoted replica was.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// use std::time::Duration;
    /// # fn main() -> Result<(), redbaton::Error> {
    /// let client = redbaton::LockClient::builder()
    ///     .sentinel("mymaster", ["redis://s1:26379/", "redis://s2:26379/", "redis://s3:26379/"])
    ///     .replica_ack(1, Duration::from_millis(100))
    ///     .build()?;
    /// # Ok(()) }
    /// ```
    pub fn sentinel<I, S>(mut self, master_name: impl Into<String>, sentinel_urls: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let sc = self
            .settings
            .sentinel
            .get_or_insert_with(SentinelConfig::default);
        sc.master = master_name.into();
        sc.sentinels = sentinel_urls.into_iter().map(Into::into).collect();
        self
    }

    /// Locks live in the Redis Cluster that `seed_urls` belong to (instead of
    /// [`node`](Self::node)): each on the master serving its key's hash slot. One seed that
    /// answers is enough; the client reads the slot map from it and talks to every master.
    /// The seeds' credentials and TLS (`rediss://`, with [`tls_ca_cert`](Self::tls_ca_cert)
    /// and [`tls_client_identity`](Self::tls_client_identity)), and the timeouts, apply to
    /// every master found in the map, so every seed must give the same TLS and
    /// credentials; cluster nodes only have database 0. Over TLS the masters' TLS ports
    /// are used (`tls-cluster yes` makes the cluster name them).
    ///
    /// `MOVED`, `ASK`, `TRYAGAIN` and `CLUSTERDOWN` replies are followed or waited out,
    /// never returned, except a slot migration that outlasts the call: a free lock whose
    /// slot is half-way between two masters cannot be taken until it has moved, and after
    /// the bounds of a failover (below) the call returns [`Error::Timeout`] or
    /// [`Error::SlotMigrating`]. Waiters are woken by the master that serves their key
    /// (keyspace notifications are per node): the client keeps one subscriber connection
    /// per master it waits on, and a waiter whose key moved (a reshard, a failover)
    /// subscribes on the new master and tries again.
    ///
    /// **Failover.** While a master is down and not yet replaced (the cluster promotes its
    /// replica after `cluster-node-timeout`), calls for its slots ride through: the slot
    /// map is read again and the call retried after a short pause, until the call's
    /// deadline ([`try_lock_for`](crate::LockClient::try_lock_for) then returns
    /// [`Error::Timeout`](crate::Error::Timeout)); a [`lock`](crate::LockClient::lock)
    /// without a deadline retries for one [`lease`](Self::lease) from the first failure,
    /// then returns the error: a failover slower than a lease loses every lock of that
    /// master anyway. [`unlock`](crate::LockGuard::unlock) and
    /// [`extend`](crate::LockGuard::extend) retry while the lock's lease lasts, and the
    /// watchdog keeps renewing until it runs out. [`try_lock`](crate::LockClient::try_lock)
    /// does not wait. A lock survives a failover only if the promoted replica had it
    /// ([`replica_ack`](Self::replica_ack) narrows the window) and the failover took less
    /// than its lease; otherwise its holder's lost signal fires.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # fn main() -> Result<(), redbaton::Error> {
    /// let client = redbaton::LockClient::builder()
    ///     .cluster(["redis://10.0.0.1:7000/", "redis://10.0.0.2:7000/"])
    ///     .build()?;
    /// let guard = client.lock("orders:42")?;
    /// # drop(guard);
    /// # Ok(()) }
    /// ```
    pub fn cluster<I, S>(mut self, seed_urls: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.settings.cluster = seed_urls.into_iter().map(Into::into).collect();
        self
    }

    /// The ACL user (`None`: the default user) and password of the Sentinel-managed
    /// master and its replicas. Never printed, not even by `Debug`.
    ///
    /// # Examples
    ///
    /// ```
    /// let b = redbaton::LockClient::builder()
    ///     .sentinel("mymaster", ["redis://127.0.0.1:26379/"])
    ///     .sentinel_master_auth(Some("locker"), "s3cret");
    /// assert!(!format!("{b:?}").contains("s3cret"));
    /// ```
    pub fn sentinel_master_auth(mut self, user: Option<&str>, password: &str) -> Self {
        let sc = self
            .settings
            .sentinel
            .get_or_insert_with(SentinelConfig::default);
        sc.master_auth = Some((user.map(str::to_owned), password.to_owned()));
        self
    }

    /// Whether the Sentinel-managed master speaks TLS (with
    /// [`tls_ca_cert`](Self::tls_ca_cert) and
    /// [`tls_client_identity`](Self::tls_client_identity) when set). Default: `false`.
    ///
    /// # Examples
    ///
    /// ```
    /// let b = redbaton::LockClient::builder()
    ///     .sentinel("mymaster", ["rediss://127.0.0.1:26379/"])
    ///     .sentinel_master_tls(true);
    /// # let _ = b;
    /// ```
    pub fn sentinel_master_tls(mut self, on: bool) -> Self {
        self.settings
            .sentinel
            .get_or_insert_with(SentinelConfig::default)
            .master_tls = on;
        self
    }

    /// Prefix of every key the client writes (may be empty). The lock key of name `n` is
    /// `{prefix}{n}` with `n` between braces (a Redis Cluster hash tag), and its fencing
    /// counter is the same key with `:fence` appended.
    ///
    /// # Examples
    ///
    /// ```
    /// let b = redbaton::LockClient::builder().key_prefix("billing:lock:");
    /// # let _ = b;
    /// ```
    pub fn key_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.settings.key_prefix = prefix.into();
        self
    }

    /// How long a lock lives in Redis without renewal (10 ms to 24 h; outside that range
    /// [`build`](Builder::build) fails with [`Error::InvalidConfig`]).
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// let b = redbaton::LockClient::builder().lease(Duration::from_secs(10));
    /// # let _ = b;
    /// ```
    pub fn lease(mut self, lease: Duration) -> Self {
        self.settings.lease = lease;
        self
    }

    /// Timeout for opening a connection; also bounds how long a caller waits for a free
    /// pooled connection. Accepted range: above zero, at most 24 h (a client always has a
    /// timeout: an unbounded one would hang on an unresponsive node); outside it
    /// [`build`](Builder::build) fails with [`Error::InvalidConfig`].
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// let b = redbaton::LockClient::builder().connect_timeout(Duration::from_millis(500));
    /// # let _ = b;
    /// ```
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.settings.connect_timeout = timeout;
        self
    }

    /// Timeout for reading each reply. A connection whose read timed out is discarded.
    /// Accepted range: above zero, at most 24 h; outside it [`build`](Builder::build) fails
    /// with [`Error::InvalidConfig`]. A read timeout set here must also be shorter than the
    /// [`lease`](Builder::lease) less its drift margin (lease × 1% + 2 ms): otherwise a
    /// reply the client still accepts could grant a lease that had already ended, and
    /// `build` fails naming both settings. (With the default read timeout, a lease shorter
    /// than it is accepted: an acquisition whose reply comes after the lease ended is
    /// given back and tried again, never returned as a guard.)
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// let b = redbaton::LockClient::builder().read_timeout(Duration::from_millis(500));
    /// # let _ = b;
    /// ```
    pub fn read_timeout(mut self, timeout: Duration) -> Self {
        self.settings.read_timeout = timeout;
        self.read_timeout_set = true;
        self
    }

    /// Timeout for writing each command. Accepted range: above zero, at most 24 h; outside
    /// it [`build`](Builder::build) fails with [`Error::InvalidConfig`].
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// let b = redbaton::LockClient::builder().write_timeout(Duration::from_millis(500));
    /// # let _ = b;
    /// ```
    pub fn write_timeout(mut self, timeout: Duration) -> Self {
        self.settings.write_timeout = timeout;
        self
    }

    /// The most command connections the client opens to each node (1 to 1024). The
    /// subscriber thread's connection comes on top: one per node.
    ///
    /// Connections are opened as calls need them, on the calling thread, and kept open
    /// while idle; one that failed at the network level is closed, with the idle ones
    /// beside it, and never lent again (a late reply may still be on its way). A call that
    /// finds every connection busy waits for one for up to the
    /// [`connect_timeout`](Builder::connect_timeout), or what remains of its deadline when
    /// that is shorter, then fails with [`Error::PoolExhausted`]: an application with more
    /// threads than connections should size the pool for the calls it makes at once.
    ///
    /// # Examples
    ///
    /// ```
    /// let b = redbaton::LockClient::builder().pool_size(32);
    /// # let _ = b;
    /// ```
    pub fn pool_size(mut self, size: usize) -> Self {
        self.settings.pool_size = size;
        self
    }

    /// How waiters learn that a lock may be free; see [`Wakeup`]. A polling interval must
    /// be above zero and at most 24 h, else [`build`](Builder::build) fails with
    /// [`Error::InvalidConfig`].
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use redbaton::Wakeup;
    /// let b = redbaton::LockClient::builder().wakeup(Wakeup::Polling(Duration::from_millis(100)));
    /// # let _ = b;
    /// ```
    pub fn wakeup(mut self, wakeup: Wakeup) -> Self {
        self.settings.wakeup = wakeup;
        self
    }

    /// Whether `build()` may add the keyspace-notification classes it needs to the server's
    /// `notify-keyspace-events` (merging with, never replacing, what is set). When this is
    /// off or the server refuses `CONFIG`, waiters are woken through the library's own
    /// release channel instead (one `warn!` says so).
    ///
    /// # Examples
    ///
    /// ```
    /// // A managed Redis that forbids CONFIG: do not even try.
    /// let b = redbaton::LockClient::builder().configure_notifications(false);
    /// # let _ = b;
    /// ```
    pub fn configure_notifications(mut self, allowed: bool) -> Self {
        self.settings.configure_notifications = allowed;
        self
    }

    /// Safety net: a waiter re-tries at least this often even if no event arrives.
    /// Accepted range: above zero, at most 24 h; outside it [`build`](Builder::build) fails
    /// with [`Error::InvalidConfig`]. (It also sets how long a waiter's contention mark
    /// lives in Redis: twice this.)
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// let b = redbaton::LockClient::builder().recheck_interval(Duration::from_secs(2));
    /// # let _ = b;
    /// ```
    pub fn recheck_interval(mut self, interval: Duration) -> Self {
        self.settings.recheck_interval = interval;
        self
    }

    /// Whether the watchdog renews held locks. With `false` a lock lives for one lease.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// // A fixed 5 s lease, never renewed.
    /// let b = redbaton::LockClient::builder().lease(Duration::from_secs(5)).auto_renew(false);
    /// # let _ = b;
    /// ```
    pub fn auto_renew(mut self, renew: bool) -> Self {
        self.settings.auto_renew = renew;
        self
    }

    /// How often the watchdog renews a held lock; must be above zero and shorter than the
    /// lease less its drift margin (lease × 1% + 2 ms: until then a hold is surely
    /// valid), else [`build`](Builder::build) fails with [`Error::InvalidConfig`]. Leave
    /// room for a round trip and a retry: a renewal whose reply comes after the validity
    /// ended finds the hold already counted lost. Defaults to a third of the lease.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// let b = redbaton::LockClient::builder()
    ///     .lease(Duration::from_secs(30))
    ///     .renew_interval(Duration::from_secs(5));
    /// # let _ = b;
    /// ```
    pub fn renew_interval(mut self, interval: Duration) -> Self {
        self.settings.renew_interval = Some(interval);
        self
    }

    /// A cap on how long one lock may be held: after it, renewals stop and the holder is
    /// told the lock is lost ([`LostReason::HoldLimit`](crate::LostReason::HoldLimit)):
    /// `check()` fails from the cap on, and a hold past it is not handed to a waiting local
    /// thread but released in Redis. The cap counts from the acquisition in Redis: the
    /// local threads a hold is handed to (see [`local_handoff`](Self::local_handoff))
    /// share it, and the rest of its cap, as does the read hold a write hold is downgraded
    /// to (an upgrade issues a new fence, and its write hold a cap of its own). Must be
    /// above zero ([`Error::InvalidConfig`] otherwise); `Duration::MAX` means no cap, the
    /// default.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// let b = redbaton::LockClient::builder().max_hold(Duration::from_secs(600));
    /// # let _ = b;
    /// ```
    pub fn max_hold(mut self, cap: Duration) -> Self {
        self.settings.max_hold = Some(cap);
        self
    }

    /// Whether a released lock goes straight to a waiting thread of this process (the
    /// baton). With `false` every thread contends in Redis on its own.
    ///
    /// # Examples
    ///
    /// ```
    /// // Every thread contends in Redis (to measure what the baton saves).
    /// let b = redbaton::LockClient::builder().local_handoff(false);
    /// # let _ = b;
    /// ```
    pub fn local_handoff(mut self, on: bool) -> Self {
        self.settings.local_handoff = on;
        self
    }

    /// Fairness budget: consecutive local handoffs allowed while another process waits
    /// (1 to 4,095: a token's low 12 bits number them). A process alone on a key is not
    /// limited by the setting, but after 4,095 handoffs in a row the lock goes back through
    /// Redis all the same (the token has no more numbers).
    ///
    /// # Examples
    ///
    /// ```
    /// // More throughput, longer waits for other processes.
    /// let b = redbaton::LockClient::builder().max_handoffs(64);
    /// # let _ = b;
    /// ```
    pub fn max_handoffs(mut self, n: u32) -> Self {
        self.settings.max_handoffs = n;
        self
    }

    /// Fairness budget: how long one process may keep handing a lock around locally while
    /// another process waits. Must be above zero ([`Error::InvalidConfig`] otherwise);
    /// `Duration::MAX` means no time slice: only [`max_handoffs`](Builder::max_handoffs)
    /// then bounds the run.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// let b = redbaton::LockClient::builder().handoff_slice(Duration::from_millis(20));
    /// # let _ = b;
    /// ```
    pub fn handoff_slice(mut self, slice: Duration) -> Self {
        self.settings.handoff_slice = slice;
        self
    }

    /// Trusts this CA (PEM) for `rediss://` nodes instead of the system's trust store:
    /// for servers with certificates from a private CA. Needs the `tls` feature (on by
    /// default). The subscriber connections use it too.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let client = redbaton::LockClient::builder()
    ///     .node("rediss://redis.internal:6380/")
    ///     .tls_ca_cert(std::fs::read("ca.pem")?)
    ///     .build()?;
    /// # Ok(()) }
    /// ```
    pub fn tls_ca_cert(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.settings.tls.ca = Some(pem.into());
        self
    }

    /// Presents this client certificate chain and private key (PEM) to `rediss://` nodes
    /// that verify clients (mutual TLS, `tls-auth-clients yes`). Needs the `tls` feature.
    /// The key is never printed, not even by `Debug`.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let client = redbaton::LockClient::builder()
    ///     .node("rediss://redis.internal:6380/")
    ///     .tls_ca_cert(std::fs::read("ca.pem")?)
    ///     .tls_client_identity(std::fs::read("client.pem")?, std::fs::read("client.key")?)
    ///     .build()?;
    /// # Ok(()) }
    /// ```
    pub fn tls_client_identity(
        mut self,
        cert_pem: impl Into<Vec<u8>>,
        key_pem: impl Into<Vec<u8>>,
    ) -> Self {
        self.settings.tls.identity = Some((cert_pem.into(), key_pem.into()));
        self
    }

    /// Whether waiting processes take turns in the order they came (default `true`).
    ///
    /// On: a process that fails to get the lock and waits is queued in Redis beside the
    /// lock (one entry per process and name: its other threads queue locally behind it),
    /// and a release grants the lock to the first process in the queue, in the same
    /// script call, telling it on the lock's channel. The message names the waiter's latest
    /// attempt, and the grant ran after Redis ran that attempt: the waiter takes the lock
    /// from the message alone, valid until that attempt's send plus the grant lease (less
    /// the drift margin), and its first renewal goes out a quarter of the way there. A message that came too
    /// late for that, or names an older attempt, only wakes it: its next attempt finds its
    /// token in the key and takes the lock with the current fence. A turn passes between
    /// processes with one message and no stampede of waiters. A free lock goes
    /// only to the head of the queue. The local fairness budget
    /// ([`max_handoffs`](Self::max_handoffs), [`handoff_slice`](Self::handoff_slice)) then
    /// hands the lock to the next process, and this one queues again at the tail.
    ///
    /// Bounds: a queued process that dies is dropped when its entry expires (two
    /// [`recheck_interval`](Self::recheck_interval)s, 10 s by default, without an attempt);
    /// one granted the lock while dead or stopped holds it for the grant lease (1 s, or the
    /// lease if shorter) before the next process gets it. A waiting process costs one
    /// attempt per re-check interval (12 commands a minute by default) while it waits.
    ///
    /// Off: the behaviour of most Redis locks, for comparison: whoever reaches Redis first
    /// after a release wins. Redlock never queues: independent masters cannot agree on one
    /// queue without a consensus protocol.
    ///
    /// # Examples
    ///
    /// ```
    /// let b = redbaton::LockClient::builder().fair(false);
    /// # let _ = b;
    /// ```
    pub fn fair(mut self, on: bool) -> Self {
        self.settings.fair = on;
        self
    }

    /// After each acquisition and each renewal, waits (Redis `WAIT`) up to `timeout` for
    /// `replicas` replicas of the master to acknowledge it. An acquisition that fewer
    /// replicas acknowledged is undone and retried until the caller's deadline, which then
    /// ends with [`Error::ReplicaAck`](crate::Error::ReplicaAck) saying how many did; a
    /// renewal that fewer acknowledged counts as failed (retried while the lease lasts).
    /// The `WAIT` lasts no longer than what remains of a call's deadline; a call without
    /// one (`try_lock`, which does not wait for the lock but does for its replicas, or
    /// `lock`) waits up to `timeout`. Every kind of hold is an acquisition: a lock, a
    /// read, a write, an upgradable read, a permit, a multi-lock, and an upgrade, whose
    /// conversion cannot be undone: an upgrade fewer replicas acknowledged gives the hold
    /// back, and the guard its error hands back is lost.
    ///
    /// What it buys: a lock acquired with acknowledgement survives a failover to a replica
    /// that acknowledged it (Sentinel or Cluster promote the most up-to-date replica). What
    /// it does not: replication stays asynchronous, so a failover to a replica that had not
    /// acknowledged, or a crash of the master together with the acknowledging replicas,
    /// still loses the lock; the holder is then told through its lost signal at the next
    /// renewal. `timeout` must be shorter than the read timeout. It costs one `WAIT` round
    /// trip (about the replication delay) per acquisition and renewal, and turns off the
    /// subscriber's early attempts.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// use std::time::Duration;
    /// # fn main() -> Result<(), redbaton::Error> {
    /// let client = redbaton::LockClient::builder()
    ///     .node("redis://127.0.0.1:6379/")
    ///     .replica_ack(1, Duration::from_millis(100))
    ///     .build()?;
    /// # Ok(()) }
    /// ```
    pub fn replica_ack(mut self, replicas: usize, timeout: Duration) -> Self {
        self.settings.replica_ack = Some((replicas, timeout));
        self
    }

    /// How long a name's fencing counter (`{prefix}{name}:fence`) outlives the last
    /// acquisition that used it (default 7 days). Every acquisition refreshes it; a counter
    /// idle this long expires, so Redis keeps no key for a name nobody locked lately.
    ///
    /// Tokens still strictly increase across an expiry: every fence is `max(last + 1, the
    /// server's clock in microseconds)` (`TIME`), so a counter that does not exist, or
    /// comes back stale (a failover to a replica that missed the last increments), starts
    /// at the clock. A fence never runs ahead of the clock that issued it (acquisitions on
    /// one name are serialized and each takes more than a microsecond of server time), so
    /// one issued later is above every earlier token. What this rests on:
    ///
    /// * the clock of the server that issues a fence is not behind the clock that issued
    ///   the previous one (no step back across a restart; a promoted replica's clock in
    ///   step with the old master's);
    /// * fewer than one acquisition per microsecond on one name, on average;
    /// * with Redlock, the nodes' clocks agree to within the time between acquisitions (a
    ///   counter is raised to the majority's highest value, from another node's clock);
    /// * every client of the prefix issues fences this way (a client of an older version
    ///   counts on from the value it finds).
    ///
    /// A retry after a lost reply reads the counter back, so it must outlive the retries:
    /// `fence_ttl` must be at least 1 s, twice the lease and four read timeouts, and at
    /// most 10 years.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    ///
    /// // Names come and go (one per job): forget a counter a day after its last use.
    /// let b = redbaton::LockClient::builder().fence_ttl(Duration::from_secs(24 * 3600));
    /// # let _ = b;
    /// ```
    pub fn fence_ttl(mut self, ttl: Duration) -> Self {
        self.settings.fence_ttl = ttl;
        self
    }

    /// How long a countdown latch's key (`{prefix}{name}:latch`, see
    /// [`LockClient::latch`]) lives after it was created or last counted down (default
    /// 1 hour), so that a latch nobody finishes does not stay in Redis for ever. Every
    /// count down that lowers the count sets it again; reading the count or waiting does
    /// not. A latch that reached zero stays open (waiters that come late return at once)
    /// until this much time after the count down that opened it.
    ///
    /// A waiter whose latch expires before its count reached zero gets
    /// [`Error::LatchExpired`], and so does one that reads the open latch only after it
    /// expired. Choose a TTL longer than the longest gap between two count downs, and than
    /// a waiter may go without reading (its re-check and polling intervals, a process
    /// stopped for a while). It must be at least 1 s and at most 365 days.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    ///
    /// // Workers report within minutes: forget an abandoned latch after ten.
    /// let b = redbaton::LockClient::builder().latch_ttl(Duration::from_secs(600));
    /// # let _ = b;
    /// ```
    pub fn latch_ttl(mut self, ttl: Duration) -> Self {
        self.settings.latch_ttl = ttl;
        self
    }

    /// Checks every setting, connects to the node(s), checks keyspace notifications and
    /// starts the client's threads.
    ///
    /// It also reads each node's `maxmemory` and `maxmemory-policy` (in the same
    /// `CONFIG GET` as the notification flags, where `CONFIG GET` is allowed) and logs one
    /// warning per node when Redis may evict lock keys: with `maxmemory` set, a
    /// `volatile-*` policy can evict a held lock's key (it has a TTL), so another client
    /// takes the lock while its holder still believes in it, and an `allkeys-*` policy
    /// can evict fence counters too. Only `noeviction` keeps them.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] for a bad setting (the message names it and its accepted
    /// range), [`Error::Redis`] when a node cannot be reached within the connect timeout
    /// (for Redlock: when fewer than a majority can), [`Error::Thread`] when the operating
    /// system refuses to start one of the client's threads.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// # fn main() -> Result<(), redbaton::Error> {
    /// let url = "redis://127.0.0.1:6379/";
    /// # let url = redbaton_testkit::redis_url(); // the doc test's throwaway redis-server
    /// let client = redbaton::LockClient::builder()
    ///     .node(url)
    ///     .lease(Duration::from_secs(15))
    ///     .build()?;
    /// # Ok(()) }
    /// ```
    pub fn build(self) -> Result<LockClient> {
        let config = self.validate()?;
        LockClient::connect(config)
    }

    /// Checks every setting (the one place they are checked) and fills in the default
    /// node; the settings the client runs with.
    pub(crate) fn validate(self) -> Result<Config> {
        let bad = |msg: String| Err(Error::InvalidConfig(msg));
        let Builder {
            settings: mut cfg,
            read_timeout_set,
        } = self;
        if !cfg.cluster.is_empty() {
            if !cfg.nodes.is_empty() || cfg.sentinel.is_some() {
                return bad("cluster, sentinel and node(s) are exclusive: choose one".to_owned());
            }
            // The masters found in the slot map are reached as seed 0 says (TLS,
            // credentials): every seed must say the same.
            let first = access("cluster seed 0", &cfg.cluster[0])?;
            for (i, url) in cfg.cluster.iter().enumerate() {
                let label = format!("cluster seed {i}");
                open_client(&label, url, &cfg.tls)?;
                let seed = access(&label, url)?;
                if seed.db != 0 {
                    return bad(format!("{label}: cluster nodes only have database 0"));
                }
                if seed != first {
                    return bad(format!(
                        "{label}: TLS and credentials differ from seed 0's; every seed must reach the cluster the same way"
                    ));
                }
            }
        } else if let Some(sc) = &cfg.sentinel {
            if !cfg.nodes.is_empty() {
                return bad("sentinel and node(s) are exclusive: choose one".to_owned());
            }
            if sc.master.is_empty() || sc.sentinels.is_empty() {
                return bad("sentinel: a master name and at least one sentinel".to_owned());
            }
            for (i, url) in sc.sentinels.iter().enumerate() {
                open_client(&format!("sentinel {i}"), url, &cfg.tls)?;
            }
        } else if cfg.nodes.is_empty() {
            cfg.nodes.push("redis://127.0.0.1:6379/".to_owned());
        }
        let n = cfg.nodes.len();
        if n > 1 && (n < 3 || n.is_multiple_of(2)) {
            return bad(format!(
                "{n} nodes: Redlock needs an odd number of nodes, at least 3"
            ));
        }
        let mut servers: Vec<String> = Vec::with_capacity(n);
        for (i, url) in cfg.nodes.iter().enumerate() {
            // The URL may hold a password: errors name the node, not the URL.
            let client = open_client(&format!("node {i}"), url, &cfg.tls)?;
            // Redlock's nodes are distinct servers: one named twice (under two databases,
            // say) would grant a majority alone, and its restart without data would let a
            // second holder in.
            let server = client.get_connection_info().addr().to_string();
            if let Some(j) = servers.iter().position(|s| *s == server) {
                return bad(format!(
                    "nodes {j} and {i} name one server twice: Redlock needs distinct servers"
                ));
            }
            servers.push(server);
        }
        if cfg.key_prefix.len() > MAX_PREFIX_LEN {
            return bad(format!("key prefix longer than {MAX_PREFIX_LEN} bytes"));
        }
        if cfg.lease < MIN_LEASE || cfg.lease > MAX_LEASE {
            return bad(format!(
                "lease {:?} outside {MIN_LEASE:?}..={MAX_LEASE:?}",
                cfg.lease
            ));
        }
        let mut bounded = vec![
            ("connect timeout", cfg.connect_timeout),
            ("read timeout", cfg.read_timeout),
            ("write timeout", cfg.write_timeout),
            ("recheck interval", cfg.recheck_interval),
        ];
        if let Wakeup::Polling(d) = cfg.wakeup {
            bounded.push(("polling interval", d));
        }
        for (what, d) in bounded {
            if d.is_zero() || d > MAX_INTERVAL {
                return bad(format!(
                    "{what} {d:?} must be positive and at most {MAX_INTERVAL:?}"
                ));
            }
        }
        if cfg.handoff_slice.is_zero() {
            return bad("handoff slice must be positive".to_owned());
        }
        if !(1..=1024).contains(&cfg.pool_size) {
            return bad(format!("pool size {} outside 1..=1024", cfg.pool_size));
        }
        // A renewal due once the lease less its drift margin has run out comes after the
        // hold's validity ended: every hold would be lost after one lease.
        let renew_interval = cfg.renew_every(cfg.lease);
        let valid_for = cfg.lease.saturating_sub(cfg.drift(cfg.lease));
        if renew_interval.is_zero() || renew_interval >= valid_for {
            return bad(format!(
                "renew interval {renew_interval:?} must be positive and shorter than the lease {:?} less its drift margin ({valid_for:?})",
                cfg.lease
            ));
        }
        if let Some(cap) = cfg.max_hold
            && cap.is_zero()
        {
            return bad("max hold must be positive".to_owned());
        }
        if let Some((replicas, timeout)) = cfg.replica_ack
            && (replicas == 0 || timeout.is_zero() || timeout >= cfg.read_timeout)
        {
            return bad(format!(
                "replica ack: at least 1 replica, and a timeout shorter than the read timeout {:?}",
                cfg.read_timeout
            ));
        }
        if !(1..=MAX_LOCAL_SEQ).contains(&cfg.max_handoffs) {
            return bad(format!("max handoffs outside 1..={MAX_LOCAL_SEQ}"));
        }
        let min_fence_ttl = MIN_FENCE_TTL
            .max(cfg.lease.saturating_mul(2))
            .max(cfg.read_timeout.saturating_mul(4));
        if cfg.fence_ttl < min_fence_ttl || cfg.fence_ttl > MAX_FENCE_TTL {
            return bad(format!(
                "fence ttl {:?} outside {min_fence_ttl:?}..={MAX_FENCE_TTL:?} (at least 1 s, twice the lease and four read timeouts: a retry reads the counter back)",
                cfg.fence_ttl
            ));
        }
        if cfg.latch_ttl < MIN_LATCH_TTL || cfg.latch_ttl > MAX_LATCH_TTL {
            return bad(format!(
                "latch ttl {:?} outside {MIN_LATCH_TTL:?}..={MAX_LATCH_TTL:?}",
                cfg.latch_ttl
            ));
        }
        let left = cfg.lease.saturating_sub(cfg.drift(cfg.lease));
        if read_timeout_set && cfg.read_timeout >= left {
            return bad(format!(
                "read timeout {:?} must be shorter than the lease {:?} less its drift margin \
                 ({left:?}): a reply could come after the lease it grants ended",
                cfg.read_timeout, cfg.lease
            ));
        }
        if let Wakeup::Polling(every) = cfg.wakeup
            && cfg.fair
            && every >= cfg.grant_lease()
        {
            // Not refused: a waiter that polls slowly is how one that hears nothing is
            // shown. A polling waiter hears no grant, and takes one at its next poll.
            log::warn!(
                "waiters poll every {every:?} with the fair queue: a lock granted to one \
                 lapses after {:?}, before its next poll, and it loses its turn; poll \
                 faster or turn the queue off",
                cfg.grant_lease()
            );
        }
        Ok(cfg)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn cluster_seeds_must_agree_on_tls_and_credentials() {
        let check = |seeds: &[&str]| {
            crate::LockClient::builder()
                .cluster(seeds.iter().copied())
                .validate()
                .map(|_| ())
        };
        assert!(check(&["rediss://u:s3cret@a:1/", "rediss://u:s3cret@b:2/"]).is_ok());
        for seeds in [
            ["redis://a:1/", "rediss://b:2/"],
            ["rediss://u:s3cret@a:1/", "rediss://u:other@b:2/"],
            ["rediss://u:s3cret@a:1/", "rediss://v:s3cret@b:2/"],
            ["rediss://u:s3cret@a:1/", "rediss://b:2/"],
            ["redis://a:1/", "redis://b:2/3"],
        ] {
            let e = check(&seeds).unwrap_err();
            let msg = format!("{e} {e:?}");
            assert!(
                e.is_invalid_input() && msg.contains("cluster seed 1"),
                "{msg}"
            );
            assert!(!msg.contains("s3cret") && !msg.contains("other"), "{msg}");
        }
    }
}
