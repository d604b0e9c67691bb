//! One Redis node: its connection pool and the protocol's three operations on it.

use std::sync::Arc;
use std::time::Duration;

use redis::{Connection, RedisResult};

use crate::builder::Config;
use crate::error::{Error, Result, is_network_error};
use crate::keys::Keys;
use crate::pool::Pool;
use crate::scripts::{ACQUIRE, EXTEND, RELEASE, UNMARK};
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

pub(crate) struct Node {
    pub idx: usize,
    pub pool: Pool,
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
        let client = redis::Client::open(url)
            .map_err(|_| Error::InvalidConfig(format!("node {idx}: unparsable redis url")))?;
        let db = client.get_connection_info().redis_settings().db();
        Ok(Node {
            idx,
            pool: Pool::new(client, cfg),
            db,
            counters,
            client_id,
            mark_ttl: cfg.recheck_interval * 2,
        })
    }

    /// Runs one command on a pooled connection. A network failure discards the connection
    /// (its reply may still arrive) and every idle one (a server restart kills them all),
    /// then retries up to `retries` times on fresh connections: callers pass retries only
    /// for idempotent commands.
    pub fn run<T>(
        &self,
        retries: u32,
        mut f: impl FnMut(&mut Connection) -> RedisResult<T>,
    ) -> Result<T> {
        let mut tries = 0;
        loop {
            let mut conn = self.pool.get()?;
            Counters::inc(&self.counters.commands);
            match f(&mut conn) {
                Ok(v) => return Ok(v),
                Err(e) if is_network_error(&e) => {
                    conn.discard();
                    drop(conn);
                    self.pool.clear_idle();
                    if tries >= retries {
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
    /// outcome stays unknown, a best-effort release removes whatever the attempts left.
    /// `waiting`: the caller will wait if the lock is held, so a failure marks contention.
    pub fn acquire(
        &self,
        keys: &Keys,
        token: &str,
        lease: Duration,
        retries: u32,
        waiting: bool,
    ) -> Result<Attempt> {
        let lease_ms = lease.as_millis().max(1) as u64;
        let mark_ms = if waiting {
            self.mark_ttl.as_millis().max(1) as u64
        } else {
            0
        };
        let reply = self.run(retries, |c| {
            ACQUIRE
                .key(keys.lock())
                .key(keys.fence())
                .key(keys.mark())
                .arg(token)
                .arg(lease_ms)
                .arg(keys.channel())
                .arg(&*self.client_id)
                .arg(mark_ms)
                .invoke::<(i64, i64)>(c)
        });
        match reply {
            Ok((1, fence)) => Ok(Attempt::Acquired {
                fence: u64::try_from(fence)
                    .map_err(|_| Error::Protocol(format!("negative fence {fence}")))?,
            }),
            Ok((0, pttl)) => {
                Counters::inc(&self.counters.failed_attempts);
                Ok(Attempt::Held {
                    pttl: u64::try_from(pttl).ok().map(Duration::from_millis),
                })
            }
            Ok(other) => Err(Error::Protocol(format!("acquire replied {other:?}"))),
            Err(e) => {
                if e.is_connection() {
                    // We may hold the key without knowing: leave nothing behind.
                    let _ = self.release(keys, token, 0);
                }
                Err(e)
            }
        }
    }

    /// Whether another client failed to get `keys` lately (its mark is alive).
    pub fn foreign_mark(&self, keys: &Keys) -> Result<bool> {
        let mark: Option<Vec<u8>> = self.run(1, |c| redis::cmd("GET").arg(keys.mark()).query(c))?;
        Ok(mark.is_some_and(|m| m != self.client_id.as_bytes()))
    }

    /// Removes our own contention mark (a waiter gave up).
    pub fn unmark(&self, keys: &Keys) -> Result<()> {
        self.run(1, |c| {
            UNMARK
                .key(keys.mark())
                .arg(&*self.client_id)
                .invoke::<i64>(c)
        })?;
        Ok(())
    }

    /// Compare-and-delete. `retries` may be non-zero: a repeated release is harmless, and
    /// reports [`ReleaseReply::GoneAfterRetry`] for a key that the first attempt may have
    /// deleted.
    pub fn release(&self, keys: &Keys, token: &str, retries: u32) -> Result<ReleaseReply> {
        let mut attempts = 0;
        let reply = self.run(retries, |c| {
            attempts += 1;
            RELEASE
                .key(keys.lock())
                .arg(token)
                .arg(keys.channel())
                .invoke::<i64>(c)
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
        let lease_ms = lease.as_millis().max(1) as u64;
        let replies = self.run(1, |c| {
            let mut inv = EXTEND.prepare_invoke();
            inv.arg(lease_ms);
            for (key, token) in locks {
                inv.key(*key).arg(*token);
            }
            inv.invoke::<Vec<i64>>(c)
        })?;
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
