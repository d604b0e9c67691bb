//! Read-write locks and semaphores on the wire: holds that several owners share.
//!
//! The key of name `n` (the same `p{n}` as a plain lock, so that one name has one kind at
//! a time) is a sorted set:
//!
//! * one *kind member*, with a negative score: `#rw` (score −1) for a read-write lock,
//!   `#sem` (score −permits) for a semaphore, so the permit count travels with the holds;
//! * one member per hold, scored by the hold's expiry in server milliseconds (`TIME`):
//!   `r<token>` a read hold, `w<token>` the write hold, `p<token>` a permit.
//!
//! Every script drops the expired holds first (so a crashed holder's hold ends by itself),
//! deletes the key when only the kind member is left, and otherwise sets the key's expiry
//! to the latest hold's, so that the whole key goes when every holder has gone.
//!
//! `p{n}:ww` is a sorted set of the writers waiting for a read-write lock, scored by when
//! their mark expires (each failed write attempt that will wait renews its mark). While it
//! has a live member, no new read hold is granted: writers are preferred. The fence counter
//! `p{n}:fence` is the plain lock's: a write hold increments it.

use std::sync::LazyLock;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::proto::keys::Keys;
use crate::proto::node::{ExtendReply, Node, ReleaseReply, Retry};
use crate::proto::scripts::Lua;
use crate::proto::sharded::PUBLISH_FN;
use crate::stats::Counters;

/// What a shared-hold attempt asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Want {
    Read,
    Write,
    /// One permit of a semaphore of this many permits.
    Permit(u32),
}

impl Want {
    /// The first byte of a hold's member in the sorted set.
    pub fn tag(self) -> char {
        match self {
            Want::Read => 'r',
            Want::Write => 'w',
            Want::Permit(_) => 'p',
        }
    }
}

/// The reply to one shared-hold attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SharedAttempt {
    /// Held: the name's fence counter (incremented for a write hold; read as it is for a
    /// read hold; 0 for a permit).
    Acquired { fence: u64 },
    /// Not now: wake at the latest when this much time has passed (the earliest hold or
    /// writer's mark in the way ends then, if nobody renews it).
    Held { hint: Option<Duration> },
}

/// Functions every shared-hold script starts with.
const PRELUDE: &str = r"
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function kind(key)
  local t = redis.call('TYPE', key)['ok']
  if t == 'none' then return 'none', 0 end
  if t ~= 'zset' then return 'other', 0 end
  local meta = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
  if meta[1] == '#rw' then return 'rw', 0 end
  if meta[1] == '#sem' then return 'sem', -tonumber(meta[2]) end
  return 'other', 0
end
local function settle(key, now)
  redis.call('ZREMRANGEBYSCORE', key, 0, now)
  local n = redis.call('ZCARD', key) - 1
  if n <= 0 then
    redis.call('DEL', key)
    return 0
  end
  local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
  redis.call('PEXPIREAT', key, last[2])
  return n
end
";

fn lua(body: &str) -> Lua {
    Lua::new(&format!("{PUBLISH_FN}{PRELUDE}{body}"))
}

/// Read or write hold, idempotently (a retry with the same member refreshes its lease).
///
/// KEYS: lock, fence, waiting writers. ARGV: `r` or `w`, member, lease ms, writer mark TTL
/// ms (0: the caller will not wait). Returns `{1, fence}`, `{0, ms until the earliest
/// obstacle ends}` (−1: unknown), or `{2, 0}` when the key is another kind of lock.
///
/// A read is granted when no write hold exists and no writer waits; a write when no hold
/// exists (waiting writers race among themselves). A write attempt that fails and will wait
/// marks the writer as waiting until the mark's TTL, which it renews at each attempt.
static RW_ACQUIRE: LazyLock<Lua> = LazyLock::new(|| {
    lua(r"
local now = now_ms()
local k = kind(KEYS[1])
if k ~= 'none' and k ~= 'rw' then return {2, 0} end
local n = settle(KEYS[1], now)
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
local function hold()
  if n == 0 then redis.call('ZADD', KEYS[1], -1, '#rw') end
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[2])
  settle(KEYS[1], now)
end
if n > 0 and redis.call('ZSCORE', KEYS[1], ARGV[2]) then
  hold()
  return {1, tonumber(redis.call('GET', KEYS[2]) or '0')}
end
local first = nil
if n > 0 then first = redis.call('ZRANGE', KEYS[1], 1, 1, 'WITHSCORES') end
if ARGV[1] == 'r' then
  if (n == 0 or string.sub(first[1], 1, 1) == 'r') and redis.call('EXISTS', KEYS[3]) == 0 then
    hold()
    return {1, tonumber(redis.call('GET', KEYS[2]) or '0')}
  end
elseif n == 0 then
  local fence = redis.pcall('INCR', KEYS[2])
  if type(fence) == 'table' then return fence end
  hold()
  redis.call('ZREM', KEYS[3], ARGV[2])
  return {1, fence}
elseif ARGV[4] ~= '0' then
  redis.call('ZADD', KEYS[3], now + tonumber(ARGV[4]), ARGV[2])
  local last = redis.call('ZRANGE', KEYS[3], -1, -1, 'WITHSCORES')
  redis.call('PEXPIREAT', KEYS[3], last[2])
end
local until_ = nil
if first then until_ = tonumber(first[2]) end
if ARGV[1] == 'r' then
  local mark = redis.call('ZRANGE', KEYS[3], 0, 0, 'WITHSCORES')
  if mark[2] and (not until_ or tonumber(mark[2]) < until_) then until_ = tonumber(mark[2]) end
end
if not until_ then return {0, -1} end
return {0, until_ - now}
")
});

/// One permit, idempotently.
///
/// KEYS: lock. ARGV: member, lease ms, permits. Returns `{1, 0}`, `{0, ms until the
/// earliest permit's lease ends}`, `{2, 0}` for another kind of lock, or `{3, stored}` when
/// the current holders use another permit count.
static SEM_ACQUIRE: LazyLock<Lua> = LazyLock::new(|| {
    lua(r"
local now = now_ms()
local k, stored = kind(KEYS[1])
if k ~= 'none' and k ~= 'sem' then return {2, 0} end
local permits = tonumber(ARGV[3])
local n = settle(KEYS[1], now)
if n > 0 and stored ~= permits then return {3, stored} end
if n < permits or (n > 0 and redis.call('ZSCORE', KEYS[1], ARGV[1])) then
  if n == 0 then redis.call('ZADD', KEYS[1], -permits, '#sem') end
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
  settle(KEYS[1], now)
  return {1, 0}
end
local first = redis.call('ZRANGE', KEYS[1], 1, 1, 'WITHSCORES')
return {0, tonumber(first[2]) - now}
")
});

/// Ends a hold.
///
/// KEYS: lock. ARGV: member, the library's channel, the publish mode. Returns 1 released,
/// 0 the hold had expired or was gone, −1 the key is another kind of lock. Publishes `r`
/// when a waiter may now get in: a permit was freed, or the last hold of a read-write
/// lock ended.
static SHARED_RELEASE: LazyLock<Lua> = LazyLock::new(|| {
    lua(r"
local k = kind(KEYS[1])
if k == 'none' then return 0 end
if k == 'other' then return -1 end
local now = now_ms()
local s = redis.call('ZSCORE', KEYS[1], ARGV[1])
if s then redis.call('ZREM', KEYS[1], ARGV[1]) end
local n = settle(KEYS[1], now)
if s and (n == 0 or k == 'sem') then publish(ARGV[2], 'r') end
if s and tonumber(s) > now then return 1 end
return 0
")
});

/// Renews many holds of one node in one round trip.
///
/// KEYS: lock keys. ARGV: lease ms, then one member per key. Returns one status per key:
/// 1 extended, 0 the hold had expired or was gone (never revived), −1 another kind of lock.
static SHARED_EXTEND: LazyLock<Lua> = LazyLock::new(|| {
    lua(r"
local now = now_ms()
local out = {}
for i = 1, #KEYS do
  local k = kind(KEYS[i])
  if k == 'none' then
    out[i] = 0
  elseif k == 'other' then
    out[i] = -1
  else
    local s = redis.call('ZSCORE', KEYS[i], ARGV[i + 1])
    if s and tonumber(s) > now then
      redis.call('ZADD', KEYS[i], 'XX', now + tonumber(ARGV[1]), ARGV[i + 1])
      out[i] = 1
    else
      out[i] = 0
    end
    settle(KEYS[i], now)
  end
end
return out
")
});

/// A waiting writer gives up: removes its mark, and wakes the readers it held back.
///
/// KEYS: waiting writers. ARGV: member, the library's channel, the publish mode.
static WRITER_UNMARK: LazyLock<Lua> = LazyLock::new(|| {
    lua(r"
if redis.call('ZREM', KEYS[1], ARGV[1]) == 1 then publish(ARGV[2], 'r') end
return 0
")
});

/// The key of the writers waiting for the read-write lock `keys`.
fn writers_key(keys: &Keys) -> Vec<u8> {
    let mut k = keys.lock().to_vec();
    k.extend_from_slice(b":ww");
    k
}

impl Node {
    /// One attempt at a shared hold with `member` (the hold's tag and token), retried with
    /// the same member after an ambiguous failure. `mark_ttl`: the caller will wait, so a
    /// failed write attempt marks a waiting writer for that long.
    #[allow(clippy::too_many_arguments)]
    pub fn acquire_shared(
        &self,
        keys: &Keys,
        want: Want,
        member: &str,
        lease: Duration,
        mark_ttl: Option<Duration>,
        retry: Retry,
        deadline: Option<Instant>,
    ) -> Result<SharedAttempt> {
        let lease_ms = lease.as_millis().max(1) as u64;
        let (script, call) = match want {
            Want::Read | Want::Write => {
                let mark_ms = mark_ttl.map_or(0, |t| t.as_millis().max(1) as u64);
                let mut call = RW_ACQUIRE.call(3);
                call.arg(keys.lock())
                    .arg(keys.fence())
                    .arg(writers_key(keys))
                    .arg(if want == Want::Read { "r" } else { "w" })
                    .arg(member)
                    .arg(lease_ms)
                    .arg(mark_ms);
                (&*RW_ACQUIRE, call)
            }
            Want::Permit(permits) => {
                let mut call = SEM_ACQUIRE.call(1);
                call.arg(keys.lock()).arg(member).arg(lease_ms).arg(permits);
                (&*SEM_ACQUIRE, call)
            }
        };
        let reply: (i64, i64) = self.run_until(retry, deadline, |c| script.run(&call, c))?;
        match reply {
            (1, fence) => Ok(SharedAttempt::Acquired {
                fence: u64::try_from(fence)
                    .map_err(|_| Error::Protocol(format!("negative fence {fence}")))?,
            }),
            (0, ms) => {
                Counters::inc(&self.counters().failed_attempts);
                Ok(SharedAttempt::Held {
                    hint: u64::try_from(ms).ok().map(Duration::from_millis),
                })
            }
            (2, _) => Err(Error::WrongKind),
            (3, stored) => Err(Error::PermitsMismatch {
                stored: u32::try_from(stored).unwrap_or(u32::MAX),
                asked: match want {
                    Want::Permit(n) => n,
                    _ => 0,
                },
            }),
            other => Err(Error::Protocol(format!("shared acquire replied {other:?}"))),
        }
    }

    /// Ends the hold `member` of `keys`.
    pub fn release_shared(&self, keys: &Keys, member: &str, retry: Retry) -> Result<ReleaseReply> {
        let mut call = SHARED_RELEASE.call(1);
        call.arg(keys.lock())
            .arg(member)
            .arg(keys.channel())
            .arg(self.publish_mode());
        self.release_by(&SHARED_RELEASE, &call, retry)
    }

    /// Renews many shared holds of this node in one round trip: `(key, member)` pairs.
    pub fn extend_shared(
        &self,
        holds: &[(&[u8], &str)],
        lease: Duration,
    ) -> Result<Vec<ExtendReply>> {
        self.extend_by(&SHARED_EXTEND, holds, lease)
    }

    /// Removes a waiting writer's mark (it stops waiting without the lock).
    pub fn unmark_writer(&self, keys: &Keys, member: &str) -> Result<()> {
        let mut call = WRITER_UNMARK.call(1);
        call.arg(writers_key(keys))
            .arg(member)
            .arg(keys.channel())
            .arg(self.publish_mode());
        self.run(Retry::ON_RESET, |c| WRITER_UNMARK.run::<i64>(&call, c))?;
        Ok(())
    }
}
