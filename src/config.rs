//! The settings a client runs with, as checked by the builder.

use std::time::Duration;

/// The longest lease accepted (by the builder and by an explicit extend).
pub(crate) const MAX_LEASE: Duration = Duration::from_secs(24 * 3600);
/// The shortest lease accepted: shorter could not be renewed in time.
pub(crate) const MIN_LEASE: Duration = Duration::from_millis(10);

/// How a waiter learns that a held lock may have become free.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use redbaton::Wakeup;
///
/// let _default = Wakeup::Notifications;
/// let _for_comparison = Wakeup::Polling(Duration::from_millis(100));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Wakeup {
    /// Sleep until Redis says the key changed (keyspace notifications, or the library's
    /// own release channel when the server's notifications cannot be turned on), the
    /// holder's lease runs out, or the re-check ceiling passes. The default.
    Notifications,
    /// Retry at a fixed interval, like most Redis locks do. Useful to measure the difference.
    Polling(Duration),
}

/// Settings checked by [`Builder::build`]; kept by the client.
#[derive(Clone)]
pub(crate) struct Config {
    pub nodes: Vec<String>,
    pub key_prefix: String,
    pub lease: Duration,
    pub connect_timeout: Duration,
    pub read_timeout: Duration,
    pub write_timeout: Duration,
    pub pool_size: usize,
    pub wakeup: Wakeup,
    pub configure_notifications: bool,
    pub recheck_interval: Duration,
    pub auto_renew: bool,
    pub renew_interval: Duration,
    pub max_hold: Option<Duration>,
    pub local_handoff: bool,
    pub max_handoffs: u32,
    pub handoff_slice: Duration,
    pub tls: Tls,
    /// Replicas that must acknowledge each acquisition and renewal, and the wait for them.
    pub replica_ack: Option<(usize, Duration)>,
    /// A Sentinel-managed master instead of `nodes`.
    pub sentinel: Option<SentinelConfig>,
    /// Waiting processes queue in Redis, and a release grants the lock to the first.
    pub fair: bool,
    /// Redis Cluster seed URLs instead of `nodes` (empty: not a cluster).
    pub cluster: Vec<String>,
    /// How long an idle fencing counter lives (every increment refreshes it).
    pub fence_ttl: Duration,
}

/// Where the sentinels are and how to reach the master they name.
#[derive(Clone, Default)]
pub(crate) struct SentinelConfig {
    /// The master's name in the sentinels' configuration.
    pub master: String,
    /// The sentinels' URLs (with their own credentials and scheme).
    pub sentinels: Vec<String>,
    /// The master's (and replicas') ACL user and password.
    pub master_auth: Option<(Option<String>, String)>,
    /// Whether the master speaks TLS.
    pub master_tls: bool,
    /// The database on the master.
    pub db: i64,
}

/// TLS material for `rediss://` nodes (PEM).
#[derive(Clone, Default)]
pub(crate) struct Tls {
    /// The CA that signed the servers' certificates, instead of the system's trust store.
    pub ca: Option<Vec<u8>>,
    /// A client certificate chain and its private key, for servers that verify clients.
    pub identity: Option<(Vec<u8>, Vec<u8>)>,
}

impl Config {
    /// Safety margin for clock drift between this process and Redis: lease × 1% + 2 ms.
    pub fn drift(&self, lease: Duration) -> Duration {
        lease / 100 + Duration::from_millis(2)
    }

    /// How often to renew a lock of this lease: the configured interval for the
    /// configured lease, a third of any other (set by an explicit extend).
    pub fn renew_every(&self, lease: Duration) -> Duration {
        if lease == self.lease {
            self.renew_interval
        } else {
            lease / 3
        }
    }
}
