//! One Redis node: its connection pool and the protocol's three operations on it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use redis::{Cmd, Connection, RedisResult, Value};

use crate::config::Config;
use crate::error::{Error, Result, is_network_error};
use crate::proto::keys::Keys;
use crate::proto::pool::Pool;
use crate::proto::scripts::{self, ACQUIRE, EXTEND, RAISE_FENCE, RELEASE, UNMARK};
use crate::stats::Counters;

/// The reply to one acquire attempt on one node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Attempt {
    /// The lock is ours; `fence` is the node's fencing counter for this acquisition.
    Acquired { fence: u64 },
    /// Someone else holds it; `pttl` is what remains of their lease (`None`: no TTL).
    Held { pttl: Option<Duration> },
}

/// What a compare-and-delete found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ReleaseReply {
    Released,
    Gone,
    /// Gone, but only a retry saw it: the first attempt, whose reply was lost, may have
    /// been the one that deleted it.
    GoneAfterRetry,
    Other,
}

/// What a compare-and-extend found for one key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ExtendReply {
    Extended,
    Gone,
    Other,
}

/// When a command is sent again on a fresh connection after a network failure. Only
/// idempotent commands are retried.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Retry {
    pub times: u32,
    /// Also after a read timeout. Right when the reply may just be lost (one node); wrong
    /// when a node hangs and others can decide without it (Redlock, renewals).
    pub after_timeout: bool,
}

impl Retry {
    /// Start-up checks: fail fast.
    pub const NEVER: Retry = Retry {
        times: 0,
        after_timeout: false,
    };
    /// A dead pooled connection (server restarted) is worth one more try; a hung node is not.
    pub const ON_RESET: Retry = Retry {
        times: 1,
        after_timeout: false,
    };
    /// One node, idempotent command: a lost reply is retried with the same arguments.
    pub const LOST_REPLY: Retry = Retry {
        times: 2,
        after_timeout: true,
    };
}

/// What an acquire attempt does with contention marks.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Marks {
    /// The caller will wait if the lock is held: a failure marks contention.
    pub leave: bool,
    /// The caller marked before: a success deletes its mark.
    pub clear: bool,
}

/// The shortest read timeout an attempt gets, however close the caller's deadline.
const MIN_ATTEMPT: Duration = Duration::from_millis(50);

pub(crate) struct Node {
    pub idx: usize,
    pub pool: Arc<Pool>,
    /// The database of the URL: keyspace channels are per database.
    pub db: i64,
    counters: Arc<Counters>,
    /// Sent with failed attempts, so that our own subscriber ignores our own marks.
    client_id: Arc<str>,
    /// How long a failed attempt's mark lives: a waiter re-marks at least this often.
    mark_ttl: Duration,
}

impl Node {
    pub fn new(
        idx: usize,
        url: &str,
        cfg: &Config,
        counters: Arc<Counters>,
        client_id: Arc<str>,
    ) -> Result<Self> {
        let bad_url = || Error::InvalidConfig(format!("node {idx}: unparsable redis url"));
        let info = redis::IntoConnectionInfo::into_connection_info(url).map_err(|_| bad_url())?;
        // No `CLIENT SETINFO` pipeline at connect: against a hung server each of its
        // replies would wait a full timeout.
        let settings = info.redis_settings().clone().set_skip_set_lib_name();
        let client =
            redis::Client::open(info.set_redis_settings(settings)).map_err(|_| bad_url())?;
        let db = client.get_connection_info().redis_settings().db();
        Ok(Node {
            idx,
            pool: Arc::new(Pool::new(client, cfg)),
            db,
            counters,
            client_id,
            mark_ttl: cfg.recheck_interval.saturating_mul(2),
        })
    }

    /// Runs one command on a pooled connection. A network failure discards the connection
    /// (its reply may still arrive) and every idle one (a server restart kills them all),
    /// then retries on fresh connections as `retry` says: callers pass retries only for
    /// idempotent commands.
    pub fn run<T>(
        &self,
        retry: Retry,
        f: impl FnMut(&mut Connection) -> RedisResult<T>,
    ) -> Result<T> {
        self.run_until(retry, None, f)
    }

    /// [`run`](Self::run), within the caller's `deadline`: each read waits at most until
    /// the deadline (but [`MIN_ATTEMPT`] at least, so an attempt has a chance), and
    /// nothing is retried once it has passed.
    pub fn run_until<T>(
        &self,
        retry: Retry,
        deadline: Option<Instant>,
        mut f: impl FnMut(&mut Connection) -> RedisResult<T>,
    ) -> Result<T> {
        if let Some(e) = crate::proto::skip::skipped() {
            return Err(Error::Redis(e));
        }
        let (_, read_timeout, _) = self.pool.timeouts();
        let mut tries = 0;
        loop {
            let mut conn = self.pool.get()?;
            Counters::inc(&self.counters.commands);
            match within_deadline(&mut conn, deadline, read_timeout, &mut f) {
                Ok(v) => return Ok(v),
                Err(e) if is_network_error(&e) => {
                    conn.discard();
                    drop(conn);
                    self.pool.clear_idle();
                    let late = deadline.is_some_and(|d| Instant::now() >= d);
                    if tries >= retry.times || (e.is_timeout() && !retry.after_timeout) || late {
                        return Err(Error::Redis(e));
                    }
                    tries += 1;
                    log::debug!("node {}: retrying after network error: {e}", self.idx);
                }
                Err(e) => return Err(Error::Redis(e)),
            }
        }
    }

    /// One acquire attempt with `token`, retried with the same token after an ambiguous
    /// failure (the script recognises its own token and returns the first fence). When the
    /// outcome stays unknown, the caller must release with the token: the key may be ours.
    /// `marks`: whether a failure leaves a contention mark, and whether a success clears ours.
    pub fn acquire(
        &self,
        keys: &Keys,
        token: &str,
        lease: Duration,
        retry: Retry,
        marks: Marks,
        deadline: Option<Instant>,
    ) -> Result<Attempt> {
        let call = self.acquire_call(keys, token, lease, marks);
        let reply = self.run_until(retry, deadline, |c| ACQUIRE.run(&call, c));
        self.attempt_of(reply?)
    }

    /// The `EVALSHA` of one acquire attempt.
    pub fn acquire_call(&self, keys: &Keys, token: &str, lease: Duration, marks: Marks) -> Cmd {
        let lease_ms = crate::clock::millis(lease).max(1);
        let mark_ms = if marks.leave {
            crate::clock::millis(self.mark_ttl).max(1)
        } else {
            0
        };
        let mut call = ACQUIRE.call(3);
        call.arg(keys.lock())
            .arg(keys.fence())
            .arg(keys.mark())
            .arg(token)
            .arg(lease_ms)
            .arg(keys.channel())
            .arg(&*self.client_id)
            .arg(mark_ms)
            .arg(if marks.clear { "1" } else { "0" });
        call
    }

    /// The outcome of an acquire the subscriber thread made early (see `early`), from its
    /// raw reply. When the reply was lost or the server lacked the script, the attempt is
    /// made again the usual way with the same token: the script recognises its own token.
    pub fn finish_acquire(
        &self,
        reply: RedisResult<Value>,
        call: &Cmd,
        retry: Retry,
        deadline: Option<Instant>,
    ) -> Result<Attempt> {
        Counters::inc(&self.counters.commands);
        Counters::inc(&self.counters.early_attempts);
        let parsed = reply
            .and_then(Value::extract_error)
            .and_then(|v| Ok(redis::from_redis_value::<(i64, i64)>(v)?));
        match parsed {
            Ok(v) => self.attempt_of(v),
            Err(e) if is_network_error(&e) || scripts::is_noscript(&e) => {
                if is_network_error(&e) {
                    self.pool.clear_idle();
                }
                log::debug!("node {}: early attempt failed: {e}; retrying", self.idx);
                self.attempt_of(self.run_until(retry, deadline, |c| ACQUIRE.run(call, c))?)
            }
            Err(e) => Err(Error::Redis(e)),
        }
    }

    fn attempt_of(&self, reply: (i64, i64)) -> Result<Attempt> {
        match reply {
            (1, fence) => Ok(Attempt::Acquired {
                fence: u64::try_from(fence)
                    .map_err(|_| Error::Protocol(format!("negative fence {fence}")))?,
            }),
            (0, pttl) => {
                Counters::inc(&self.counters.failed_attempts);
                Ok(Attempt::Held {
                    pttl: u64::try_from(pttl).ok().map(Duration::from_millis),
                })
            }
            other => Err(Error::Protocol(format!("acquire replied {other:?}"))),
        }
    }

    /// Whether another client failed to get `keys` lately (its mark is alive).
    pub fn foreign_mark(&self, keys: &Keys) -> Result<bool> {
        let mark: Option<Vec<u8>> = self.run(Retry::ON_RESET, |c| {
            redis::cmd("GET").arg(keys.mark()).query(c)
        })?;
        Ok(mark.is_some_and(|m| m != self.client_id.as_bytes()))
    }

    /// Raises the key's fencing counter to at least `fence`.
    pub fn raise_fence(&self, keys: &Keys, fence: u64) -> Result<()> {
        self.run(Retry::ON_RESET, |c| {
            let mut call = RAISE_FENCE.call(1);
            call.arg(keys.fence()).arg(fence);
            RAISE_FENCE.run::<i64>(&call, c)
        })?;
        Ok(())
    }

    /// Removes our own contention mark (a waiter gave up).
    pub fn unmark(&self, keys: &Keys) -> Result<()> {
        let mut call = UNMARK.call(1);
        call.arg(keys.mark()).arg(&*self.client_id);
        self.run(Retry::ON_RESET, |c| UNMARK.run::<i64>(&call, c))?;
        Ok(())
    }

    /// Compare-and-delete. `retries` may be non-zero: a repeated release is harmless, and
    /// reports [`ReleaseReply::GoneAfterRetry`] for a key that the first attempt may have
    /// deleted.
    pub fn release(&self, keys: &Keys, token: &str, retry: Retry) -> Result<ReleaseReply> {
        let mut call = RELEASE.call(1);
        call.arg(keys.lock()).arg(token).arg(keys.channel());
        let mut attempts = 0;
        let reply = self.run(retry, |c| {
            attempts += 1;
            RELEASE.run::<i64>(&call, c)
        })?;
        match reply {
            1 => Ok(ReleaseReply::Released),
            0 if attempts > 1 => Ok(ReleaseReply::GoneAfterRetry),
            0 => Ok(ReleaseReply::Gone),
            -1 => Ok(ReleaseReply::Other),
            n => Err(Error::Protocol(format!("release replied {n}"))),
        }
    }

    /// Compare-and-extend many locks of this node in one round trip.
    pub fn extend(&self, locks: &[(&[u8], &str)], lease: Duration) -> Result<Vec<ExtendReply>> {
        let lease_ms = crate::clock::millis(lease).max(1);
        let mut call = EXTEND.call(locks.len());
        for (key, _) in locks {
            call.arg(*key);
        }
        call.arg(lease_ms);
        for (_, token) in locks {
            call.arg(*token);
        }
        let replies = self.run(Retry::ON_RESET, |c| EXTEND.run::<Vec<i64>>(&call, c))?;
        if replies.len() != locks.len() {
            return Err(Error::Protocol(format!(
                "extend replied {} statuses for {} keys",
                replies.len(),
                locks.len()
            )));
        }
        replies
            .into_iter()
            .map(|r| match r {
                1 => Ok(ExtendReply::Extended),
                0 => Ok(ExtendReply::Gone),
                -1 => Ok(ExtendReply::Other),
                n => Err(Error::Protocol(format!("extend replied {n}"))),
            })
            .collect()
    }
}

/// What one round of extends, on the nodes that hold a lock, says about it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Renewal {
    /// A majority (one node: that node) extended it.
    Renewed,
    /// Enough nodes said "not yours" that no majority can hold it.
    Lost(crate::error::LostReason),
    /// Too few answers to tell (network errors): try again while the lease lasts.
    Unknown,
}

impl Renewal {
    /// The verdict from the replies of `holders` nodes: `ok` extended, `gone` had no key,
    /// `other` held another token; `quorum` of all nodes is needed; `redlock` says whether
    /// a loss is a lost majority rather than one node's answer.
    pub fn judge(
        (ok, gone, other): (usize, usize, usize),
        holders: usize,
        quorum: usize,
        redlock: bool,
    ) -> Renewal {
        use crate::error::LostReason;
        let needed = quorum.min(holders);
        if ok >= needed {
            Renewal::Renewed
        } else if gone + other > holders.saturating_sub(needed) {
            Renewal::Lost(if redlock {
                LostReason::NoQuorum
            } else if other > 0 {
                LostReason::Stolen
            } else {
                LostReason::Deleted
            })
        } else {
            Renewal::Unknown
        }
    }
}

/// Runs `f` on `conn` with its reads bounded by `deadline`: what remains of it, but
/// [`MIN_ATTEMPT`] at least, when that is shorter than `read_timeout`, the connection's
/// usual timeout, which is then put back (after a reply, error replies included). A
/// connection whose timeout cannot be put back fails the call (a network error: the
/// caller drops it).
pub(crate) fn within_deadline<T>(
    conn: &mut Connection,
    deadline: Option<Instant>,
    read_timeout: Duration,
    f: impl FnOnce(&mut Connection) -> RedisResult<T>,
) -> RedisResult<T> {
    let short = deadline
        .map(|d| d.saturating_duration_since(Instant::now()).max(MIN_ATTEMPT))
        .filter(|t| *t < read_timeout);
    let Some(t) = short else {
        return f(conn);
    };
    conn.set_read_timeout(Some(t))?;
    let result = f(conn);
    if result.as_ref().is_err_and(is_network_error) {
        return result; // the connection is dropped anyway
    }
    // Also after an error reply: the connection goes back to the pool.
    conn.set_read_timeout(Some(read_timeout))?;
    result
}

/// Whether a failed command may have reached Redis (and so may have taken effect).
pub(crate) fn may_have_run(e: &Error) -> bool {
    match e {
        Error::PoolExhausted => false,
        Error::Redis(e) => !e.is_connection_refusal(),
        _ => true,
    }
}
