//! The script of multi-locks: every lock of a group (a multi-lock's names whose keys are on
//! one node and in one hash slot) taken by one call, all or none.
//!
//! Each name of a multi-lock is held as a plain lock: its key holds the group's token with
//! the lease as TTL, and its fence counter is incremented as `ACQUIRE` does (see
//! `scripts::FENCE_FN`). So a name held by a multi-lock is renewed by `EXTEND`, released
//! by its protocol's release script (sent for the whole group in one pipelined round
//! trip, see `Node::release_all`), and looks to every other contender exactly like a
//! lock held by `lock()`.
//!
//! Contention marks are written with the multi-lock's own mark id (the client's id and a
//! suffix) rather than the client's id: a thread of this very process that holds one of the
//! names then hears a waiter it must make room for, as it would hear another process (its
//! subscriber ignores only marks of its own id).

use std::sync::LazyLock;
use std::time::Duration;

use redis::Cmd;

use crate::error::{Error, Result};
use crate::proto::keys::Keys;
use crate::proto::node::{Node, Retry};
use crate::proto::scripts::{
    CLOCK_FN, END_FENCE_FN, FENCE_FN, FENCE_FORM_FN, HOLD_FENCE_FN, Lua, OWNER_FN, Site,
};
use crate::proto::sharded::PUBLISH_FN;
use crate::stats::Counters;

/// Acquire every lock of a group, all or none, in one round trip; idempotent.
///
/// KEYS: per lock, its key, its fence counter, its contention mark and its fair queue's
/// expiries (`L:qx`, see `fair_scripts`): four each, in the group's order. ARGV: token,
/// lease in ms, the mark id, the mark's TTL in ms (0: the caller will not wait, so it
/// leaves no mark), `1` if the caller marked before (its marks are deleted when it wins),
/// the fence counter's TTL in ms, then one library channel per lock, then the publish mode
/// (see `sharded`).
///
/// Returns `{1, fence…}` (one fence per lock, in order; negative when the hold before
/// that lock's ended without a release, see `FENCE_FN`) when every lock is ours;
/// `{0, ms}` when at least one is in the way (held by another, or free with a live waiter
/// in its fair queue), with when the whole group may be free: the latest end among their
/// leases and queue entries (`-1`: one of them has no TTL); `{2, 0}` when a key is a
/// read-write lock or a semaphore.
///
/// * **All or none.** Each key is read first (`GET`, a `pcall`: another kind of lock is an
///   answer). Every key free or holding our token: each free one is taken with
///   `take_fenced`, each of ours keeps its fence and has its lease lengthened (a retry
///   after a lost reply: one lock, one fence). Otherwise nothing is taken, and a key
///   holding our token is deleted (a retry whose first try ran, then a lock of ours
///   expired and was taken by another: no lock is left held without the others). A fence
///   counter that cannot be written (a key of another type) deletes what the call took
///   before returning the error, and puts back the counters it raised as they were (a
///   script is not undone when it fails: the counters of locks nobody held stay as if
///   the call had not run); a lock of ours from before the call, given back here, marks
///   its counter as an attempt nobody used (see `END_FENCE_FN`).
/// * **The fair queue.** It is not joined, but it is not passed over either: a free key
///   whose queue has a live entry (its expiry ahead) is in the way, as a held one is. Its
///   waiter, woken by the same release, takes it (or a release grants it to the head),
///   and its release wakes the multi-lock; a lock that is free with nobody queued alive
///   is taken.
/// * **When to look again.** All or none: the group cannot be taken before every lease
///   and queue entry in the way has ended, or a release (which is heard) ends it sooner.
///   Waking at the soonest of them, a lease renewed meanwhile, only costs attempts.
/// * **Marks.** A failed attempt of a caller that will wait leaves its mark id on each
///   key in the way, and publishes `c<mark id>` on that lock's channel, as `ACQUIRE`
///   does: the holders' processes apply their fairness budget.
pub(crate) static MULTI_ACQUIRE: LazyLock<Lua> = LazyLock::new(|| {
    Lua::new(&format!(
        "{PUBLISH_FN}{FENCE_FORM_FN}{CLOCK_FN}{FENCE_FN}{HOLD_FENCE_FN}{END_FENCE_FN}{OWNER_FN}{}",
        r"
local n = #KEYS / 4
local token, lease = ARGV[1], ARGV[2]
local owners, blocked = {}, {}
-- When the whole group may be free: the latest end among the leases and queue entries
-- in the way (-1: one of them does not end by itself).
local held, latest, forever = false, -1, false
local now_ms
for i = 1, n do
  local cur = redis.pcall('GET', KEYS[4 * i - 3])
  if type(cur) == 'table' then return {2, 0} end
  owners[i] = cur
  local left
  if cur and cur ~= token then
    left = redis.call('PTTL', KEYS[4 * i - 3])
  elseif not cur then
    -- A free lock with a live fair-queue entry is that waiter's, whose attempt (woken by
    -- the same release) takes it: taken past it, the queue would be passed over.
    local last = redis.call('ZRANGE', KEYS[4 * i], -1, -1, 'WITHSCORES')[2]
    if last then
      now_ms = now_ms or math.floor(clock_us() / 1000)
      if tonumber(last) > now_ms then left = tonumber(last) - now_ms end
    end
  end
  if left then
    held, blocked[i] = true, true
    if left < 0 then forever = true elseif left > latest then latest = left end
  end
end
if held then
  for i = 1, n do
    if owners[i] == token then
      redis.call('DEL', KEYS[4 * i - 3])
      end_fence(KEYS[4 * i - 2], '0')
      publish(ARGV[6 + i], 'r')
    elseif blocked[i] and ARGV[4] ~= '0' then
      redis.call('SET', KEYS[4 * i - 1], ARGV[3], 'PX', ARGV[4])
      publish(ARGV[6 + i], 'c' .. ARGV[3])
    end
  end
  return {0, forever and -1 or latest}
end
local out = {1}
-- The counters this call raised, as they were before (false: there was none).
local before = {}
for i = 1, n do
  local lock, counter = KEYS[4 * i - 3], KEYS[4 * i - 2]
  local fence
  if owners[i] == token then
    if redis.call('PTTL', lock) < tonumber(lease) then redis.call('PEXPIRE', lock, lease) end
    local after_lost
    fence, after_lost = hold_fence(counter)
    if after_lost then fence = -fence end
  else
    local after_lost
    fence, after_lost, before[i] = take_fenced(lock, token, lease, counter, ARGV[6])
    if after_lost then fence = -fence end
    if type(fence) == 'table' then
      for j = 1, i - 1 do
        local counter_j = KEYS[4 * j - 2]
        redis.call('DEL', KEYS[4 * j - 3])
        if owners[j] == token then
          -- Ours before this call (a retry whose first try ran): given back as in `held`.
          end_fence(counter_j, '0')
        elseif before[j] then
          -- Taken by this call: its counter is put back as it was.
          redis.call('SET', counter_j, before[j], 'KEEPTTL')
        else
          redis.call('DEL', counter_j)
        end
        publish(ARGV[6 + j], 'r')
      end
      return fence
    end
  end
  out[i + 1] = fence
end
if ARGV[5] == '1' then
  for i = 1, n do delete_owned({KEYS[4 * i - 1]}, ARGV[3]) end
end
return out
"
    ))
});

/// What one all-or-nothing attempt at a group found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Taken {
    /// Every lock of the group is ours: their fences, in the group's order, each with
    /// whether the hold before it ended without a release (see `FENCE_FN`). `resent`: as
    /// `Attempt::Acquired`'s, the first send may take them all again after their release.
    All {
        fences: Vec<(u64, bool)>,
        resent: bool,
    },
    /// At least one of them is held by another or is a queued waiter's (nothing was
    /// taken); `pttl`: when they may all be free, the latest end of the leases and queue
    /// entries in the way (`None`: one of them has no TTL). `resent`: as
    /// `Attempt::Held`'s, the token may still take them all.
    Held {
        pttl: Option<Duration>,
        resent: bool,
    },
    /// The script took them all, but fewer replicas than asked acknowledged it in time
    /// (`replica_ack`): the caller must give them back. `resent`: as `All`'s.
    Unacked { acked: usize, resent: bool },
}

impl Taken {
    /// This answer, to an attempt that followed another with the same token that may have
    /// run (`earlier`): that one may still land after it, as a first send after its retry.
    pub(crate) fn sent_again_if(mut self, earlier: bool) -> Self {
        let (Taken::All { resent, .. }
        | Taken::Held { resent, .. }
        | Taken::Unacked { resent, .. }) = &mut self;
        *resent |= earlier;
        self
    }
}

/// The call of [`MULTI_ACQUIRE`] (see it for the arguments) for the locks `keys`; `site`
/// carries the multi-lock's mark id in place of the client's id. A failed attempt marks
/// contention for `mark_ms` (0: the caller will not wait); `clear`: the caller marked
/// before, and deletes its marks if it wins.
pub(crate) fn acquire_call(
    site: Site<'_>,
    keys: &[Keys],
    token: &str,
    lease_ms: u64,
    mark_ms: u64,
    clear: bool,
) -> Cmd {
    let mut call = MULTI_ACQUIRE.call(4 * keys.len());
    for k in keys {
        call.arg(k.lock())
            .arg(k.fence())
            .arg(k.mark())
            .arg(k.queue_expiry());
    }
    call.arg(token)
        .arg(lease_ms)
        .arg(site.client_id)
        .arg(mark_ms)
        .arg(if clear { "1" } else { "0" })
        .arg(site.fence_ttl_ms);
    for k in keys {
        call.arg(k.channel());
    }
    call.arg(site.publish);
    call
}

/// Reads [`MULTI_ACQUIRE`]'s reply for a group of `locks` locks.
fn taken_of(reply: Vec<i64>, locks: usize) -> Result<Taken> {
    // A negative fence: the hold before that one ended without a release.
    let fence = |f: i64| {
        let lost = f < 0;
        match f.unsigned_abs() {
            0 => Err(Error::Protocol(format!("fence {f}"))),
            fence => Ok((fence, lost)),
        }
    };
    match reply.as_slice() {
        [1, fences @ ..] if fences.len() == locks => Ok(Taken::All {
            fences: fences.iter().map(|&f| fence(f)).collect::<Result<_>>()?,
            resent: false,
        }),
        [0, pttl] => Ok(Taken::Held {
            resent: false,
            pttl: u64::try_from(*pttl).ok().map(Duration::from_millis),
        }),
        [2, _] => Err(Error::WrongKind),
        _ => Err(Error::Protocol(format!(
            "multi-lock acquire replied {reply:?} for {locks} locks"
        ))),
    }
}

impl Node {
    /// One [`MULTI_ACQUIRE`] call for a group of `locks` locks on this node, retried with
    /// the same token after an ambiguous failure as `retry` says (the script recognises its
    /// own token; `calls`: the call, and the retry's when it differs, see
    /// `Node::run_acquire`), within `deadline`; with the replicas' `WAIT` when `replica_ack` asks.
    /// When the outcome stays unknown, the caller must release the token's locks.
    pub(crate) fn acquire_all(
        &self,
        calls: (&Cmd, Option<&dyn Fn() -> Cmd>),
        locks: usize,
        retry: Retry,
        deadline: Option<std::time::Instant>,
    ) -> Result<Taken> {
        let took = |reply: &Vec<i64>| reply.first() == Some(&1);
        let (reply, unacked, resent) =
            self.run_acquire(&MULTI_ACQUIRE, calls, retry, deadline, took)?;
        match (taken_of(reply, locks)?, unacked) {
            (Taken::All { .. }, Some(acked)) => Ok(Taken::Unacked { acked, resent }),
            (Taken::All { fences, .. }, None) => Ok(Taken::All { fences, resent }),
            (Taken::Held { pttl, .. }, _) => {
                Counters::inc(&self.counters().failed_attempts);
                Ok(Taken::Held { pttl, resent })
            }
            (taken, _) => Ok(taken),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The replies the script gives, read: fences in order, when the group may be free, another
    /// kind, and anything else refused.
    #[test]
    fn replies_are_read() {
        assert_eq!(
            taken_of(vec![1, 7, 9], 2).expect("all"),
            Taken::All {
                fences: vec![(7, false), (9, false)],
                resent: false
            }
        );
        assert_eq!(
            taken_of(vec![1, -7, 9], 2).expect("all"),
            Taken::All {
                fences: vec![(7, true), (9, false)],
                resent: false
            }
        );
        assert_eq!(
            taken_of(vec![0, 250], 2).expect("held"),
            Taken::Held {
                pttl: Some(Duration::from_millis(250)),
                resent: false,
            }
        );
        assert_eq!(
            taken_of(vec![0, -1], 3).expect("held"),
            Taken::Held {
                pttl: None,
                resent: false
            }
        );
        assert!(matches!(taken_of(vec![2, 0], 1), Err(Error::WrongKind)));
        for bad in [vec![1, 7], vec![1, 0, 4], vec![], vec![5, 5]] {
            assert!(
                matches!(taken_of(bad.clone(), 2), Err(Error::Protocol(_))),
                "{bad:?}"
            );
        }
    }
}
