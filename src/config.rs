//! The settings a client runs with: declared, defaulted and shown here once; checked by
//! the builder; and the timings derived from them, each named once.

use std::time::Duration;

/// The longest lease accepted (by the builder and by an explicit extend).
pub(crate) const MAX_LEASE: Duration = Duration::from_secs(24 * 3600);
/// The shortest lease accepted: shorter could not be renewed in time.
pub(crate) const MIN_LEASE: Duration = Duration::from_millis(10);

/// How waiters learn that a held lock may have become free.
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
    /// With the fair queue (the default) a polling waiter hears no grant: it takes a lock
    /// granted to it at its next poll, so an interval longer than the grant lease (one
    /// second, or the lease if shorter) loses it its turn (`build()` warns of one); poll
    /// faster, or turn the queue off ([`Builder::fair`](crate::Builder::fair)).
    Polling(Duration),
}

/// Every setting of a client. The builder holds one (its defaults are the documented
/// ones, see `Builder`), its methods set the fields, and `Builder::build` checks it and
/// hands it to the client.
#[derive(Clone)]
pub(crate) struct Config {
    /// The node URLs: one node, or an odd number (3 or more) for Redlock. Empty until
    /// the builder's check puts the local default there (unless Cluster or Sentinel).
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
    /// The renewal interval of the configured lease as set (`None`: a third of it); read
    /// it through [`Config::renew_every`].
    pub renew_interval: Option<Duration>,
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
    /// How long a countdown latch's key lives after its creation or its last count down.
    pub latch_ttl: Duration,
}

/// The documented defaults (the table on `Builder`).
impl Default for Config {
    fn default() -> Self {
        Config {
            nodes: Vec::new(),
            key_prefix: "redbaton:".to_owned(),
            lease: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(2),
            read_timeout: Duration::from_secs(2),
            write_timeout: Duration::from_secs(2),
            pool_size: 8,
            wakeup: Wakeup::Notifications,
            configure_notifications: true,
            recheck_interval: Duration::from_secs(5),
            auto_renew: true,
            renew_interval: None,
            max_hold: None,
            local_handoff: true,
            max_handoffs: 16,
            handoff_slice: Duration::from_millis(10),
            tls: Tls::default(),
            replica_ack: None,
            sentinel: None,
            fair: true,
            cluster: Vec::new(),
            fence_ttl: Duration::from_secs(7 * 24 * 3600),
            latch_ttl: Duration::from_secs(3600),
        }
    }
}

/// URLs may carry a password: shown with it replaced by `***`. Keys and the master's
/// credentials are never shown (see [`Tls`] and [`SentinelConfig`]).
impl std::fmt::Debug for Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Config")
            .field("nodes", &redact_all(&self.nodes))
            .field("key_prefix", &self.key_prefix)
            .field("lease", &self.lease)
            .field("connect_timeout", &self.connect_timeout)
            .field("read_timeout", &self.read_timeout)
            .field("write_timeout", &self.write_timeout)
            .field("pool_size", &self.pool_size)
            .field("wakeup", &self.wakeup)
            .field("configure_notifications", &self.configure_notifications)
            .field("recheck_interval", &self.recheck_interval)
            .field("auto_renew", &self.auto_renew)
            .field("renew_interval", &self.renew_interval)
            .field("max_hold", &self.max_hold)
            .field("local_handoff", &self.local_handoff)
            .field("max_handoffs", &self.max_handoffs)
            .field("handoff_slice", &self.handoff_slice)
            .field("tls", &self.tls)
            .field("replica_ack", &self.replica_ack)
            .field("sentinel", &self.sentinel)
            .field("fair", &self.fair)
            .field("cluster", &redact_all(&self.cluster))
            .field("fence_ttl", &self.fence_ttl)
            .field("latch_ttl", &self.latch_ttl)
            .finish()
    }
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

/// The master's credentials are only said to be set; the sentinels' passwords are `***`.
impl std::fmt::Debug for SentinelConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SentinelConfig")
            .field("master", &self.master)
            .field("sentinels", &redact_all(&self.sentinels))
            .field("master_auth", &self.master_auth.is_some())
            .field("master_tls", &self.master_tls)
            .field("db", &self.db)
            .finish()
    }
}

/// TLS material for `rediss://` nodes (PEM).
#[derive(Clone, Default)]
pub(crate) struct Tls {
    /// The CA that signed the servers' certificates, instead of the system's trust store.
    pub ca: Option<Vec<u8>>,
    /// A client certificate chain and its private key, for servers that verify clients.
    pub identity: Option<(Vec<u8>, Vec<u8>)>,
}

/// Only whether each is set: the private key must never be printed.
impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tls")
            .field("ca_cert", &self.ca.is_some())
            .field("client_identity", &self.identity.is_some())
            .finish()
    }
}

/// `redis://user:secret@host/` → `redis://user:***@host/`.
pub(crate) fn redact(url: &str) -> String {
    let Some(scheme_end) = url.find("://").map(|i| i + 3) else {
        return url.to_owned();
    };
    let rest = &url[scheme_end..];
    let authority_end = rest.find('/').unwrap_or(rest.len());
    let Some(at) = rest[..authority_end].rfind('@') else {
        return url.to_owned();
    };
    let userinfo = &rest[..at];
    let user = userinfo.split(':').next().unwrap_or("");
    format!("{}{user}:***{}", &url[..scheme_end], &rest[at..])
}

fn redact_all(urls: &[String]) -> Vec<String> {
    urls.iter().map(|u| redact(u)).collect()
}

/// The timings derived from the settings: every place that needs one asks here.
impl Config {
    /// Safety margin for clock drift between this process and Redis: lease × 1% + 2 ms.
    pub fn drift(&self, lease: Duration) -> Duration {
        lease / 100 + Duration::from_millis(2)
    }

    /// When a holder whose key has `left` to live is surely gone: `left` plus its drift
    /// margin, since Redis may evict an expired key late (and so say `expired` late).
    pub fn past_expiry(&self, left: Duration) -> Duration {
        left.saturating_add(self.drift(left))
    }

    /// How often to renew a lock of this lease: the configured interval (a third of the
    /// lease unless set) for the configured lease, a third of any other (set by an
    /// explicit extend).
    pub fn renew_every(&self, lease: Duration) -> Duration {
        match self.renew_interval {
            Some(every) if lease == self.lease => every,
            _ => lease / 3,
        }
    }

    /// Renewals due within this of each other go in one round trip: a quarter of the
    /// renewal interval.
    pub fn renew_batch(&self) -> Duration {
        self.renew_every(self.lease) / 4
    }

    /// How soon a lease change whose outcome is unknown is tried again: a quarter of the
    /// renewal interval, at most 200 ms.
    pub fn renew_retry(&self) -> Duration {
        self.renew_batch().min(Duration::from_millis(200))
    }

    /// How long a waiting process's contention mark lives in Redis: a waiter attempts
    /// (and so marks the key again) at least every re-check interval, so two of them.
    pub fn mark_ttl(&self) -> Duration {
        self.recheck_interval.saturating_mul(2)
    }

    /// How long a process's fair-queue entry lives without an attempt: two re-check
    /// intervals, for the same reason as [`mark_ttl`](Self::mark_ttl). A dead waiter is
    /// dropped from the queue after it.
    pub fn entry_ttl(&self) -> Duration {
        self.recheck_interval.saturating_mul(2)
    }

    /// The lease of a fair-queue grant until its process takes the lock: short (one
    /// second, or the lease if shorter), since it is what a dead grantee costs.
    pub fn grant_lease(&self) -> Duration {
        self.lease.min(Duration::from_secs(1))
    }

    /// How often the watchdog looks at least while a waiter of this client may be granted
    /// a lock it takes from the grant message: an eighth of the grant lease (at least
    /// 1 ms). Such a lock's first renewal ([`first_renewal`](Config::first_renewal)) is
    /// then planned without waking the watchdog at the moment of the handoff, when the
    /// wake-up would compete for a core with the thread the grant is for.
    pub fn grant_tick(&self) -> Duration {
        (self.grant_lease() / 8).max(Duration::from_millis(1))
    }

    /// When a lock taken from a grant message, surely held for `left` more, is renewed
    /// first: after a quarter of it, which leaves three quarters for the renewal and its
    /// retries, and which is at least a [`grant_tick`](Config::grant_tick) away unless the
    /// message came late (the watchdog is then woken at once).
    pub fn first_renewal(&self, left: Duration) -> Duration {
        left / 4
    }

    /// How long a Redlock node's call (or probe) may take before the node counts as
    /// stalled and is skipped until it answers quickly again: half the read timeout, well
    /// before its calls would time out (see `topology::fanout`).
    pub fn stall(&self) -> Duration {
        self.read_timeout / 2
    }

    /// How long after a remote process's failed attempt it still counts as waiting: it
    /// retries (and so marks the key again) at least every re-check interval; half of
    /// one more is the slack.
    pub fn contention_window(&self) -> Duration {
        self.recheck_interval + self.recheck_interval / 2
    }
}

#[cfg(test)]
mod tests {
    use super::{Config, redact};
    use std::time::Duration;

    #[test]
    fn passwords_are_redacted() {
        assert_eq!(redact("redis://u:pw@h:1/0"), "redis://u:***@h:1/0");
        assert_eq!(redact("redis://:pw@h/"), "redis://:***@h/");
        assert_eq!(redact("redis://h:6379/"), "redis://h:6379/");
        assert_eq!(redact("not a url"), "not a url");
        let b = crate::LockClient::builder().node("redis://a:s3cret@h/");
        assert!(!format!("{b:?}").contains("s3cret"));
    }

    /// No secret of any setting reaches `Debug`: URL passwords, the TLS private key, the
    /// Sentinel master's credentials.
    #[test]
    fn debug_shows_no_secret() {
        let b = crate::LockClient::builder()
            .nodes(["redis://a:s3cret-node@h/"])
            .cluster(["rediss://u:s3cret-seed@c:1/"])
            .sentinel("m", ["redis://:s3cret-sentinel@s:26379/"])
            .sentinel_master_auth(Some("locker"), "s3cret-master")
            .tls_client_identity("CERT", "s3cret-key");
        let shown = format!("{b:?}");
        assert!(
            !shown.contains("s3cret") && !shown.contains("locker"),
            "{shown}"
        );
        assert!(shown.contains("client_identity: true"), "{shown}");
    }

    /// The derived timings of the defaults, as documented on the builder.
    #[test]
    fn derived_timings_of_the_defaults() {
        let cfg = Config::default();
        let s = Duration::from_secs;
        let ms = Duration::from_millis;
        assert_eq!(cfg.drift(s(30)), ms(302));
        assert_eq!(cfg.renew_every(s(30)), s(10));
        assert_eq!(cfg.renew_every(s(9)), s(3));
        assert_eq!(cfg.renew_batch(), ms(2500));
        assert_eq!(cfg.renew_retry(), ms(200));
        assert_eq!(cfg.mark_ttl(), s(10));
        assert_eq!(cfg.entry_ttl(), s(10));
        assert_eq!(cfg.grant_lease(), s(1));
        assert_eq!(cfg.grant_tick(), ms(125));
        // A grant heard at once: its first renewal is further than the watchdog's look.
        assert!(cfg.first_renewal(cfg.grant_lease() - cfg.drift(s(1))) > cfg.grant_tick());
        assert_eq!(cfg.contention_window(), ms(7500));
        assert_eq!(cfg.stall(), s(1));
        let short = Config {
            lease: ms(300),
            renew_interval: Some(ms(40)),
            ..Config::default()
        };
        assert_eq!(short.grant_lease(), ms(300));
        assert_eq!(short.grant_tick(), Duration::from_micros(37_500));
        assert_eq!(short.renew_every(ms(300)), ms(40));
        assert_eq!(short.renew_retry(), ms(10));
    }
}
