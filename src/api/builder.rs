//! The builder: documented defaults, validation in `build()`.

use std::time::Duration;

use crate::api::client::LockClient;
use crate::config::{Config, Wakeup};
use crate::error::{Error, Result};
use crate::fencing::MAX_LOCAL_SEQ;
use crate::proto::keys::MAX_PREFIX_LEN;

pub(crate) const MAX_LEASE: Duration = Duration::from_secs(24 * 3600);
pub(crate) const MIN_LEASE: Duration = Duration::from_millis(10);
/// The longest timeout or interval accepted: longer ones are taken for mistakes (a
/// `Duration::MAX` meant as "never") rather than silently capped.
const MAX_INTERVAL: Duration = Duration::from_secs(24 * 3600);

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
#[derive(Clone)]
#[must_use = "a builder does nothing until build() is called"]
pub struct Builder {
    nodes: Vec<String>,
    key_prefix: String,
    lease: Duration,
    connect_timeout: Duration,
    read_timeout: Duration,
    write_timeout: Duration,
    pool_size: usize,
    wakeup: Wakeup,
    configure_notifications: bool,
    recheck_interval: Duration,
    auto_renew: bool,
    renew_interval: Option<Duration>,
    max_hold: Option<Duration>,
    local_handoff: bool,
    max_handoffs: u32,
    handoff_slice: Duration,
}

/// Node URLs may carry a password: `Debug` shows them with it replaced by `***`.
impl std::fmt::Debug for Builder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Builder")
            .field(
                "nodes",
                &self.nodes.iter().map(|u| redact(u)).collect::<Vec<_>>(),
            )
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
            .finish()
    }
}

/// `redis://user:secret@host/` → `redis://user:***@host/`.
fn redact(url: &str) -> String {
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

impl Default for Builder {
    fn default() -> Self {
        Builder {
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
        }
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
        self.nodes.push(url.into());
        self
    }

    /// Adds several independent Redis masters for Redlock (an odd number, at least 3).
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
        self.nodes.extend(urls.into_iter().map(Into::into));
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
        self.key_prefix = prefix.into();
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
        self.lease = lease;
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
        self.connect_timeout = timeout;
        self
    }

    /// Timeout for reading each reply. A connection whose read timed out is discarded.
    /// Accepted range: above zero, at most 24 h; outside it [`build`](Builder::build) fails
    /// with [`Error::InvalidConfig`].
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// let b = redbaton::LockClient::builder().read_timeout(Duration::from_millis(500));
    /// # let _ = b;
    /// ```
    pub fn read_timeout(mut self, timeout: Duration) -> Self {
        self.read_timeout = timeout;
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
        self.write_timeout = timeout;
        self
    }

    /// The most command connections the client opens to each node (1 to 1024). The
    /// subscriber thread's connection comes on top: one per node.
    ///
    /// # Examples
    ///
    /// ```
    /// let b = redbaton::LockClient::builder().pool_size(32);
    /// # let _ = b;
    /// ```
    pub fn pool_size(mut self, size: usize) -> Self {
        self.pool_size = size;
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
        self.wakeup = wakeup;
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
        self.configure_notifications = allowed;
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
        self.recheck_interval = interval;
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
        self.auto_renew = renew;
        self
    }

    /// How often the watchdog renews a held lock; must be above zero and shorter than the
    /// lease, else [`build`](Builder::build) fails with [`Error::InvalidConfig`].
    /// Defaults to a third of the lease.
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
        self.renew_interval = Some(interval);
        self
    }

    /// A cap on how long one lock may be held: after it, renewals stop and the holder is
    /// told the lock is lost ([`LostReason::HoldLimit`](crate::LostReason::HoldLimit)).
    /// Must be above zero ([`Error::InvalidConfig`] otherwise); `Duration::MAX` means no
    /// cap, the default.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// let b = redbaton::LockClient::builder().max_hold(Duration::from_secs(600));
    /// # let _ = b;
    /// ```
    pub fn max_hold(mut self, cap: Duration) -> Self {
        self.max_hold = Some(cap);
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
        self.local_handoff = on;
        self
    }

    /// Fairness budget: consecutive local handoffs allowed while another process waits
    /// (1 to 1,048,575). A process alone on a key is not limited.
    ///
    /// # Examples
    ///
    /// ```
    /// // More throughput, longer waits for other processes.
    /// let b = redbaton::LockClient::builder().max_handoffs(64);
    /// # let _ = b;
    /// ```
    pub fn max_handoffs(mut self, n: u32) -> Self {
        self.max_handoffs = n;
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
        self.handoff_slice = slice;
        self
    }

    /// Checks every setting, connects to the node(s), checks keyspace notifications and
    /// starts the client's threads.
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

    pub(crate) fn validate(self) -> Result<Config> {
        let bad = |msg: String| Err(Error::InvalidConfig(msg));
        let mut nodes = self.nodes;
        if nodes.is_empty() {
            nodes.push("redis://127.0.0.1:6379/".to_owned());
        }
        let n = nodes.len();
        if n > 1 && (n < 3 || n.is_multiple_of(2)) {
            return bad(format!(
                "{n} nodes: Redlock needs an odd number of nodes, at least 3"
            ));
        }
        for (i, url) in nodes.iter().enumerate() {
            if redis::Client::open(url.as_str()).is_err() {
                // The URL may hold a password: name the node, not the URL.
                return bad(format!("node {i}: unparsable redis url"));
            }
        }
        if self.key_prefix.len() > MAX_PREFIX_LEN {
            return bad(format!("key prefix longer than {MAX_PREFIX_LEN} bytes"));
        }
        if self.lease < MIN_LEASE || self.lease > MAX_LEASE {
            return bad(format!(
                "lease {:?} outside {MIN_LEASE:?}..={MAX_LEASE:?}",
                self.lease
            ));
        }
        let mut bounded = vec![
            ("connect timeout", self.connect_timeout),
            ("read timeout", self.read_timeout),
            ("write timeout", self.write_timeout),
            ("recheck interval", self.recheck_interval),
        ];
        if let Wakeup::Polling(d) = self.wakeup {
            bounded.push(("polling interval", d));
        }
        for (what, d) in bounded {
            if d.is_zero() || d > MAX_INTERVAL {
                return bad(format!(
                    "{what} {d:?} must be positive and at most {MAX_INTERVAL:?}"
                ));
            }
        }
        if self.handoff_slice.is_zero() {
            return bad("handoff slice must be positive".to_owned());
        }
        if !(1..=1024).contains(&self.pool_size) {
            return bad(format!("pool size {} outside 1..=1024", self.pool_size));
        }
        let renew_interval = self.renew_interval.unwrap_or(self.lease / 3);
        if renew_interval.is_zero() || renew_interval >= self.lease {
            return bad(format!(
                "renew interval {renew_interval:?} must be positive and shorter than the lease {:?}",
                self.lease
            ));
        }
        if let Some(cap) = self.max_hold
            && cap.is_zero()
        {
            return bad("max hold must be positive".to_owned());
        }
        if !(1..=MAX_LOCAL_SEQ).contains(&self.max_handoffs) {
            return bad(format!("max handoffs outside 1..={MAX_LOCAL_SEQ}"));
        }
        Ok(Config {
            nodes,
            key_prefix: self.key_prefix,
            lease: self.lease,
            connect_timeout: self.connect_timeout,
            read_timeout: self.read_timeout,
            write_timeout: self.write_timeout,
            pool_size: self.pool_size,
            wakeup: self.wakeup,
            configure_notifications: self.configure_notifications,
            recheck_interval: self.recheck_interval,
            auto_renew: self.auto_renew,
            renew_interval,
            max_hold: self.max_hold,
            local_handoff: self.local_handoff,
            max_handoffs: self.max_handoffs,
            handoff_slice: self.handoff_slice,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::redact;

    #[test]
    fn passwords_are_redacted() {
        assert_eq!(redact("redis://u:pw@h:1/0"), "redis://u:***@h:1/0");
        assert_eq!(redact("redis://:pw@h/"), "redis://:***@h/");
        assert_eq!(redact("redis://h:6379/"), "redis://h:6379/");
        assert_eq!(redact("not a url"), "not a url");
        let b = crate::LockClient::builder().node("redis://a:s3cret@h/");
        assert!(!format!("{b:?}").contains("s3cret"));
    }
}
