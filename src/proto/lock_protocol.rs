//! The exclusive lock's protocol: which scripts take, give back and leave a lock, how
//! their calls are built and their replies read, and the answers the contend loop and the
//! release path need from it. Chosen once per route, when the topology builds the route.
//!
//! Two protocols: [`LockProtocol::Plain`] (`ACQUIRE`, `RELEASE`, `UNMARK`: a failed
//! attempt leaves a contention mark, a release deletes the key) and
//! [`LockProtocol::Fair`] (`FAIR_ACQUIRE`, `FAIR_RELEASE`, `FAIR_LEAVE`: a failed
//! attempt queues, a release grants the lock to the head of the queue). Redlock routes
//! always get `Plain`: independent masters cannot agree on one queue.
//!
//! An enum rather than a trait object: the set is closed and small, the value is `Copy`
//! (a route carries it at no cost, a fan-out closure captures it without an `Arc`), and
//! every answer is one `match` in which the compiler checks that each protocol gives one.
//! The shared locks and the semaphore have calls of other shapes (members, counts): when
//! they become protocols, a trait over what the contest loop asks may suit better.

use std::time::{Duration, Instant};

use redis::{Cmd, RedisResult, Value};

use crate::config::Config;
use crate::error::{Error, Result};
use crate::proto::fair_scripts::{FAIR_ACQUIRE, FAIR_LEAVE, FAIR_RELEASE};
use crate::proto::keys::Keys;
use crate::proto::node::{Attempt, Marks, Node, ReleaseReply, Retry, lease_key, millis};
use crate::proto::scripts::{ACQUIRE, Lua, RELEASE, UNMARK};
use crate::stats::Counters;

/// How a route's exclusive lock is contended for and given back.
#[derive(Debug, Clone, Copy)]
pub(crate) enum LockProtocol {
    /// First come, first served: a failed attempt of a waiter leaves a contention mark
    /// that lives `mark_ttl` (a waiter re-marks at least this often).
    Plain { mark_ttl: Duration },
    /// Processes take turns in arrival order (see `fair_scripts`).
    Fair(Fair),
}

/// The fair queue's timings (see `fair_scripts`): how long a waiter's entry lives unless
/// its next attempt refreshes it, and the lease a grant gives until the grantee renews.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Fair {
    pub entry_ttl: Duration,
    pub grant_lease: Duration,
}

/// How a waiter that gives up without the lock takes its trace with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Exit {
    /// Deletes its contention mark on every node ([`LockProtocol::unmark`]).
    Unmark,
    /// Leaves the queue with its token, passing on a grant that raced it
    /// ([`LockProtocol::leave`]).
    Leave,
}

impl LockProtocol {
    /// The protocol `cfg` asks for on a route whose one node decides alone.
    pub fn of(cfg: &Config) -> Self {
        if cfg.fair {
            LockProtocol::Fair(Fair {
                entry_ttl: cfg.entry_ttl(),
                grant_lease: cfg.grant_lease(),
            })
        } else {
            Self::plain(cfg)
        }
    }

    /// The plain protocol, whatever `cfg` asks (Redlock: no queue).
    pub fn plain(cfg: &Config) -> Self {
        LockProtocol::Plain {
            mark_ttl: cfg.mark_ttl(),
        }
    }

    /// Whether one wait uses one token for all its attempts (fair queue: the token is the
    /// waiter's place in the queue, and a grant is made to it). Otherwise each attempt
    /// has a fresh one.
    pub fn keeps_token_across_attempts(self) -> bool {
        matches!(self, LockProtocol::Fair(_))
    }

    /// Whether a release may hand the lock straight to a waiting process (fair queue): the
    /// releaser then has nobody to yield to, and its next contender queues at once.
    pub fn release_may_grant(self) -> bool {
        matches!(self, LockProtocol::Fair(_))
    }

    /// How a waiter that gives up leaves.
    pub fn exit(self) -> Exit {
        match self {
            LockProtocol::Plain { .. } => Exit::Unmark,
            LockProtocol::Fair(_) => Exit::Leave,
        }
    }

    /// Whether an attempt whose outcome is unknown may be left for the same wait's next
    /// call (its next attempt finds the token in the key if the lock is ours, and its
    /// leave passes such a lock on), rather than released in the background now.
    pub fn next_call_settles_unknown(self) -> bool {
        matches!(self, LockProtocol::Fair(_))
    }

    /// The acquire script.
    pub fn acquire_script(self) -> &'static Lua {
        match self {
            LockProtocol::Plain { .. } => &ACQUIRE,
            LockProtocol::Fair(_) => &FAIR_ACQUIRE,
        }
    }

    /// One acquire attempt on `node` with `token`, retried with the same token after an
    /// ambiguous failure (the script recognises its own token and returns the first
    /// fence). When the outcome stays unknown, the caller must release with the token: the
    /// key may be ours. `marks`: whether a failure leaves a contention mark (or queues),
    /// and whether a success clears ours.
    #[allow(clippy::too_many_arguments)]
    pub fn acquire(
        self,
        node: &Node,
        keys: &Keys,
        token: &str,
        lease: Duration,
        retry: Retry,
        marks: Marks,
        deadline: Option<Instant>,
    ) -> Result<Attempt> {
        let call = self.acquire_call(node, keys, token, lease, marks);
        let (reply, unacked) = node.run_acquire(self.acquire_script(), &call, retry, deadline)?;
        match (attempt_of(node, reply)?, unacked) {
            (Attempt::Acquired { .. }, Some(acked)) => Ok(Attempt::Unacked { acked }),
            (attempt, _) => Ok(attempt),
        }
    }

    /// The `EVALSHA` of one acquire attempt on `node`.
    pub fn acquire_call(
        self,
        node: &Node,
        keys: &Keys,
        token: &str,
        lease: Duration,
        marks: Marks,
    ) -> Cmd {
        let lease_ms = millis(lease);
        match self {
            LockProtocol::Plain { mark_ttl } => {
                let mut call = ACQUIRE.call(3);
                call.arg(keys.lock())
                    .arg(keys.fence())
                    .arg(keys.mark())
                    .arg(token)
                    .arg(lease_ms)
                    .arg(keys.channel())
                    .arg(node.client_id())
                    .arg(if marks.leave { millis(mark_ttl) } else { 0 })
                    .arg(if marks.clear { "1" } else { "0" })
                    .arg(node.fence_ttl_ms())
                    .arg(node.publish_mode());
                call
            }
            LockProtocol::Fair(fair) => {
                let mut call = FAIR_ACQUIRE.call(4);
                call.arg(keys.lock())
                    .arg(keys.fence())
                    .arg(keys.queue())
                    .arg(keys.queue_expiry())
                    .arg(token)
                    .arg(lease_ms)
                    .arg(keys.channel())
                    .arg(node.client_id())
                    .arg(if marks.leave {
                        millis(fair.entry_ttl)
                    } else {
                        0
                    })
                    .arg(millis(fair.grant_lease))
                    .arg(node.fence_ttl_ms())
                    .arg(node.publish_mode());
                call
            }
        }
    }

    /// The outcome of an acquire the subscriber thread made early on `node` (see
    /// `early`), from its raw reply; made again the usual way with the same token when
    /// the reply was lost (see [`Node::finish_early`]).
    pub fn finish_acquire(
        self,
        node: &Node,
        reply: RedisResult<Value>,
        call: &Cmd,
        retry: Retry,
        deadline: Option<Instant>,
    ) -> Result<Attempt> {
        let reply = node.finish_early(reply, self.acquire_script(), call, retry, deadline)?;
        attempt_of(node, reply)
    }

    /// Gives back `token`'s lock on `node`: compare-and-delete, or (fair queue) a grant
    /// to the head of the queue. `retry` may be non-zero: a repeated release is harmless,
    /// and reports [`ReleaseReply::GoneAfterRetry`] for a key that the first attempt may
    /// have deleted ([`ReleaseReply::OtherAfterRetry`]: passed on, or deleted and taken
    /// since).
    pub fn release(
        self,
        node: &Node,
        keys: &Keys,
        token: &str,
        retry: Retry,
    ) -> Result<ReleaseReply> {
        // Redis Cluster, the lock's slot half-way through a migration: the server refuses
        // a script whose keys are not all on one side (`TRYAGAIN`). The narrow release names
        // the lock key alone, which the server always serves: on the source while the key
        // is there, else (`ASK`) on the target; its lease record, if any, is left to its
        // TTL (at most the lease).
        let narrow = || release_call(node, keys, token, false);
        match self {
            LockProtocol::Plain { .. } => {
                let call = release_call(node, keys, token, true);
                node.release_with(&RELEASE, &call, retry, Some((&RELEASE, &narrow)))
            }
            LockProtocol::Fair(fair) => {
                // The fair release names the lock, its counter and its queue, and an empty
                // queue has no key: during a migration the narrow release is the fair
                // release of a lock with no one queued; a queue that exists (moved ahead
                // of the lock) gets no grant, and its head takes the lock at its next
                // attempt once the slot has moved.
                let call = fair_call(&FAIR_RELEASE, node, keys, token, fair);
                node.release_with(&FAIR_RELEASE, &call, retry, Some((&RELEASE, &narrow)))
            }
        }
    }

    /// A waiter with `token` stops waiting on `node`: out of the queue, its mark removed,
    /// and a grant that raced its leaving passed on. Whether it passed one on. Plain: its
    /// mark removed.
    pub fn leave(self, node: &Node, keys: &Keys, token: &str) -> Result<bool> {
        let LockProtocol::Fair(fair) = self else {
            self.unmark(node, keys)?;
            return Ok(false);
        };
        let call = fair_call(&FAIR_LEAVE, node, keys, token, fair);
        // Redis Cluster, the slot half-way through a migration: refused like the fair
        // release (see `release`), leaving is the plain compare-and-delete of our token,
        // which gives back a grant that raced our leaving; our queue entry expires.
        let narrow = || release_call(node, keys, token, false);
        let reply = node.release_with(
            &FAIR_LEAVE,
            &call,
            Retry::ON_RESET,
            Some((&RELEASE, &narrow)),
        )?;
        Ok(reply == ReleaseReply::Passed)
    }

    /// Removes our own contention mark on `node` (a waiter gave up).
    pub fn unmark(self, node: &Node, keys: &Keys) -> Result<()> {
        let mut call = UNMARK.call(1);
        call.arg(keys.mark()).arg(node.client_id());
        node.run_script::<i64>(&UNMARK, &call, Retry::ON_RESET, None)?;
        Ok(())
    }

    /// Whether another client failed to get `keys` on `node` lately: its mark is alive,
    /// or (fair queue) someone is queued.
    pub fn foreign_mark(self, node: &Node, keys: &Keys) -> Result<bool> {
        if let LockProtocol::Fair(_) = self {
            // The queue is the mark: whoever is in it waits (this process's contender is
            // not, while it holds the lock).
            let queued: u64 = node.run(Retry::ON_RESET, |c| {
                redis::cmd("ZCARD").arg(keys.queue()).query(c)
            })?;
            return Ok(queued > 0);
        }
        let mark: Option<Vec<u8>> = node.run(Retry::ON_RESET, |c| {
            redis::cmd("GET").arg(keys.mark()).query(c)
        })?;
        Ok(mark.is_some_and(|m| m != node.client_id().as_bytes()))
    }
}

/// Reads an acquire script's reply: 1 and the fence, 0 and the holder's PTTL, 2 for a key
/// of another kind.
fn attempt_of(node: &Node, reply: (i64, i64)) -> Result<Attempt> {
    match reply {
        (1, fence) => Ok(Attempt::Acquired {
            fence: u64::try_from(fence)
                .map_err(|_| Error::Protocol(format!("negative fence {fence}")))?,
        }),
        (0, pttl) => {
            Counters::inc(&node.counters().failed_attempts);
            Ok(Attempt::Held {
                pttl: u64::try_from(pttl).ok().map(Duration::from_millis),
            })
        }
        (2, _) => Err(Error::WrongKind),
        other => Err(Error::Protocol(format!("acquire replied {other:?}"))),
    }
}

/// The plain compare-and-delete of `token`'s lock ([`RELEASE`]): its key and, with
/// `record`, its lease record (deleted with it); without, its key alone (see
/// [`LockProtocol::release`]).
fn release_call(node: &Node, keys: &Keys, token: &str, record: bool) -> Cmd {
    let mut call = RELEASE.call(if record { 2 } else { 1 });
    call.arg(keys.lock());
    if record {
        call.arg(lease_key(keys.lock()));
    }
    call.arg(token).arg(keys.channel()).arg(node.publish_mode());
    call
}

/// A call of the fair queue's release or leave script: the same keys and arguments
/// (the fence counter's TTL and the publish mode are `node`'s).
fn fair_call(script: &Lua, node: &Node, keys: &Keys, token: &str, fair: Fair) -> Cmd {
    let mut call = script.call(5);
    call.arg(keys.lock())
        .arg(keys.fence())
        .arg(keys.queue())
        .arg(keys.queue_expiry())
        .arg(lease_key(keys.lock()))
        .arg(token)
        .arg(keys.channel())
        .arg(millis(fair.grant_lease))
        .arg(node.fence_ttl_ms())
        .arg(node.publish_mode());
    call
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The answers the engine acts on, for each protocol.
    #[test]
    fn each_protocol_answers_for_itself() {
        let fair = LockProtocol::of(&Config::default());
        assert!(matches!(fair, LockProtocol::Fair(_)), "fair by default");
        assert!(fair.keeps_token_across_attempts());
        assert!(fair.release_may_grant());
        assert!(fair.next_call_settles_unknown());
        assert_eq!(fair.exit(), Exit::Leave);
        assert!(std::ptr::eq(fair.acquire_script(), &*FAIR_ACQUIRE));

        let off = Config {
            fair: false,
            ..Config::default()
        };
        for plain in [
            LockProtocol::of(&off),
            LockProtocol::plain(&Config::default()),
        ] {
            assert!(matches!(plain, LockProtocol::Plain { .. }), "{plain:?}");
            assert!(!plain.keeps_token_across_attempts());
            assert!(!plain.release_may_grant());
            assert!(!plain.next_call_settles_unknown());
            assert_eq!(plain.exit(), Exit::Unmark);
            assert!(std::ptr::eq(plain.acquire_script(), &*ACQUIRE));
        }
    }
}
