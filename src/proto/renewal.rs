//! Renewals: the lease-change scripts (`EXTEND`, and `EXTEND_UNORDERED` for a Cluster slot
//! half-way through a migration), their calls and replies, and running them on a node in
//! batches (one round trip for every due lock of a node, one `WAIT` when replicas must
//! acknowledge).

use std::sync::LazyLock;
use std::time::Duration;

use redis::Cmd;

use crate::error::{Error, Result};
use crate::proto::node::{Call, Node, Retry, millis};
use crate::proto::scripts::{self, EXTEND_OWNED_FN, Lua, OWNER_FN};

/// Compare-and-`PEXPIRE` for a batch of locks in one round trip (the watchdog renews every
/// due lock of a node with one call; an explicit extend is a batch of one), each lease
/// change ordered by its hold's change number.
///
/// KEYS: per lock, its key and its lease record (`<lock>:lease`, see `Keys::lease`),
/// in pairs. ARGV: lease in ms, then per lock its token and the change's number.
/// Returns one status per lock: 1 extended, 0 the key was gone, -1 another token (or
/// another kind of lock, whose key is not a string) holds it, 2 refused as stale (a newer
/// change of this hold was applied). One such lock does not fail the batch. A key that is
/// gone is never recreated: a renewal racing a release cannot revive a lock.
///
/// # The rule of lease changes
///
/// Every change of a hold's lease (a watchdog renewal or an explicit extend, across the
/// local handoffs of one remote token) carries a number from a per-hold counter that only
/// increases, and its sender notes when it sent it (`sent_at`):
///
/// * Redis applies a change only if no change of the same hold with a higher number was
///   applied before: the lease record keeps `<number>:<token>` of the last applied change,
///   with the lease it set (so it lives exactly as long as that lease, and never longer
///   than the lock it describes, unless the lock is released first: then it expires with
///   the lease it was given). A change with an equal number is applied again (a retry of
///   the same change). An older one is refused (status 2): a newer, maybe longer, lease
///   can never be cut short by a request that was delayed on the way, and the sender of
///   the refused change learns nothing about the lock from it (neither extended nor lost).
/// * The holder's validity after a change that was applied is `sent_at + lease - drift`
///   (the TTL was set no earlier than `sent_at`; nothing older can overwrite it).
/// * After a change whose outcome is unknown (no reply: a timeout, a dropped connection,
///   too few Redlock answers; or refused as stale), the change may have been applied, so
///   the validity becomes `min(old validity, sent_at + new lease - drift)`: a shorter
///   lease that did land is believed, a longer one that may not have is not.
///
/// A lock's first lease comes from the acquire (change number 0, no record); the first
/// change writes the record. The acquire and release scripts never read it.
///
/// Each lock is `extend_owned` with its record (see [`EXTEND_OWNED_FN`]).
pub(crate) static EXTEND: LazyLock<Lua> = LazyLock::new(|| {
    Lua::new(&format!(
        "{OWNER_FN}{EXTEND_OWNED_FN}{}",
        r"
local out = {}
for i = 1, #KEYS / 2 do
  out[i] = extend_owned(KEYS[2 * i - 1], ARGV[2 * i], ARGV[1], KEYS[2 * i], ARGV[2 * i + 1])
end
return out
"
    ))
});

/// Compare-and-`PEXPIRE` of locks named alone, without their lease records: how a lock is
/// renewed while its Redis Cluster slot migrates and the server refuses a lock and its
/// record on different sides (`TRYAGAIN`); one key per call is always served. Such a
/// renewal is not ordered with the hold's other lease changes (see [`EXTEND`]), so it only
/// lengthens the lease: a renewal delayed on the way that lands after a newer, longer
/// extend leaves that extend's lease, which its holder believes, as it was. An explicit
/// extend to a shorter lease does not shorten it while the slot migrates (its holder
/// believes the shorter one: it holds the lock for no longer than it thinks).
///
/// KEYS: lock keys. ARGV: lease in ms, then one token per key. Returns one status per key:
/// 1 extended, 0 gone, -1 another owner (each lock `extend_owned` without a record, see
/// [`EXTEND_OWNED_FN`]).
pub(crate) static EXTEND_UNORDERED: LazyLock<Lua> = LazyLock::new(|| {
    Lua::new(&format!(
        "{OWNER_FN}{EXTEND_OWNED_FN}{}",
        r"
local out = {}
for i = 1, #KEYS do
  out[i] = extend_owned(KEYS[i], ARGV[i + 1], ARGV[1])
end
return out
"
    ))
});

/// What a compare-and-extend found for one key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ExtendReply {
    Extended,
    Gone,
    Other,
    /// Ours, but a newer change of the lease was applied: this one was refused. Says
    /// nothing the holder can use (the newer change's own reply does): counted as no
    /// answer, never as a loss.
    Stale,
}

impl Node {
    /// Compare-and-extend many locks of this node in one round trip, each change ordered
    /// by its number (see [`EXTEND`]).
    pub fn extend(&self, locks: &[Change<'_>], lease: Duration) -> Result<Vec<ExtendReply>> {
        let mut replies = self.extend_batches(&[Batch {
            script: &EXTEND,
            locks: locks.to_vec(),
            lease,
            ordered: true,
        }])?;
        Ok(replies.pop().unwrap_or_default())
    }

    /// Runs several renewal batches (each one script call; Redis Cluster: one slot each)
    /// in one round trip, pipelined, with one `WAIT` for all of them when replicas must
    /// acknowledge. One status list per batch.
    pub(crate) fn extend_batches(&self, batches: &[Batch<'_>]) -> Result<Vec<Vec<ExtendReply>>> {
        match self.extend_once(batches)? {
            Some(replies) => Ok(replies),
            None => self.extend_apart(batches),
        }
    }

    /// [`extend_batches`](Self::extend_batches) in one round trip; `None` when the call
    /// path says to send them one lock per call ([`extend_apart`](Self::extend_apart)).
    fn extend_once(&self, batches: &[Batch<'_>]) -> Result<Option<Vec<Vec<ExtendReply>>>> {
        let calls: Vec<redis::Cmd> = batches.iter().map(Batch::call).collect();
        // Each script once, for reloading after a NOSCRIPT.
        let mut scripts: Vec<&Lua> = Vec::new();
        for b in batches {
            if !scripts.iter().any(|s| std::ptr::eq(*s, b.script)) {
                scripts.push(b.script);
            }
        }
        // Narrower: one lock per call, and an ordered lock alone without its lease record.
        let locks: usize = batches.iter().map(|b| b.locks.len()).sum();
        let how = Call {
            retry: Retry::ON_RESET,
            deadline: None,
            narrower: locks > 1 || batches.iter().any(|b| b.ordered),
        };
        let outcome = self.call(how, |c, before| {
            let replies: Vec<Vec<i64>> = match calls.as_slice() {
                [one] => scripts[0].run(one, c, before).map(|r| vec![r]),
                _ => scripts::run_pipelined(&scripts, &calls, c, before),
            }?;
            let acked = match self.ack {
                Some(_) if replies.iter().flatten().any(|&r| r == 1) => {
                    Some(self.wait_replicas(c)?)
                }
                _ => None,
            };
            Ok((replies, acked))
        })?;
        let Some((replies, acked)) = outcome else {
            return Ok(None);
        };
        if let (Some(acked), Some((wanted, _))) = (acked, self.ack)
            && acked < wanted
        {
            // Not renewed as far as a failover is concerned: retried until the lease ends.
            return Err(Error::ReplicaAck { acked, wanted });
        }
        if replies.len() != batches.len() {
            return Err(Error::Protocol(format!(
                "extend replied {} lists for {} batches",
                replies.len(),
                batches.len()
            )));
        }
        replies
            .into_iter()
            .zip(batches)
            .map(|(r, b)| extend_replies(r, b.locks.len()))
            .collect::<Result<_>>()
            .map(Some)
    }
}

impl Node {
    /// [`extend_batches`](Self::extend_batches), one lock per call, each following its
    /// own redirects: the narrower form of a renewal, sent when the call path says so
    /// (Redis Cluster: a slot of this node migrates; see `topology::call`). Costs a round
    /// trip per lock.
    fn extend_apart(&self, batches: &[Batch<'_>]) -> Result<Vec<Vec<ExtendReply>>> {
        batches
            .iter()
            .map(|b| {
                b.locks
                    .iter()
                    .map(|&lock| {
                        let one = Batch {
                            script: b.script,
                            locks: vec![lock],
                            lease: b.lease,
                            ordered: b.ordered,
                        };
                        let replies = match self.extend_once(&[one])? {
                            Some(replies) => replies,
                            // The lock and its record refused together: the lock alone,
                            // unordered (see `EXTEND_UNORDERED`).
                            None => {
                                let alone = Batch {
                                    script: &EXTEND_UNORDERED,
                                    locks: vec![lock],
                                    lease: b.lease,
                                    ordered: false,
                                };
                                self.extend_once(&[alone])?.ok_or(Error::SlotMigrating)?
                            }
                        };
                        let mut replies = replies;
                        replies
                            .pop()
                            .and_then(|mut list| list.pop())
                            .ok_or_else(|| Error::Protocol("extend replied nothing".to_owned()))
                    })
                    .collect()
            })
            .collect()
    }
}

/// One lease change of one hold: its key, its token (a shared hold's member) and the
/// change's number in the hold's sequence (see [`EXTEND`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Change<'a> {
    pub key: &'a [u8],
    /// The lock's lease record (see `Keys::lease`).
    pub record: &'a [u8],
    pub token: &'a str,
    pub seq: u64,
}

/// One renewal script call: which script, the changes, the new lease, and whether the
/// script orders changes by their numbers (`EXTEND`: keys and lease records in pairs,
/// then a token and a number per lock) or not (`SHARED_EXTEND`: keys, then a member per
/// hold; its holds keep one lease for life, so a late renewal can only lengthen one).
pub(crate) struct Batch<'a> {
    pub script: &'a Lua,
    pub locks: Vec<Change<'a>>,
    pub lease: Duration,
    pub ordered: bool,
}

impl Batch<'_> {
    /// The `EVALSHA` of this batch.
    fn call(&self) -> Cmd {
        let keys = if self.ordered { 2 } else { 1 } * self.locks.len();
        let mut call = self.script.call(keys);
        for c in &self.locks {
            call.arg(c.key);
            if self.ordered {
                call.arg(c.record);
            }
        }
        call.arg(millis(self.lease));
        for c in &self.locks {
            call.arg(c.token);
            if self.ordered {
                call.arg(c.seq);
            }
        }
        call
    }
}

/// One batch's statuses, one per lock: 1 extended, 0 gone, −1 another owner, 2 refused as
/// stale.
fn extend_replies(replies: Vec<i64>, locks: usize) -> Result<Vec<ExtendReply>> {
    if replies.len() != locks {
        return Err(Error::Protocol(format!(
            "extend replied {} statuses for {locks} keys",
            replies.len(),
        )));
    }
    replies
        .into_iter()
        .map(|r| match r {
            1 => Ok(ExtendReply::Extended),
            0 => Ok(ExtendReply::Gone),
            -1 => Ok(ExtendReply::Other),
            2 => Ok(ExtendReply::Stale),
            n => Err(Error::Protocol(format!("extend replied {n}"))),
        })
        .collect()
}
