//! Countdown latches on the wire.
//!
//! The latch of name `n` is the string key `p{n}:latch` (beside the lock's keys, in their
//! hash slot): `<left>:<count>:<id>`, the count still to go, the count it was created
//! with, and a random id of this incarnation, with the latch TTL. One script,
//! [`LATCH`], reads it, creates it when it is missing, and counts it down: whoever touches
//! a latch first creates it, with the count it was asked with.
//!
//! * A count down lowers `left` (never below 0), sets the TTL again, and when `left`
//!   reaches 0 publishes `z` on the name's library channel (`p{n}:ev`, classic or
//!   sharded like the lock's, see `sharded`), after its write (a count down the server
//!   refuses opens nothing and wakes nobody): the latch's waiters wake and read it. At 0 it
//!   changes nothing (not even the TTL): an open latch lives one TTL after the count down
//!   that opened it, and waiters that come meanwhile return at once.
//! * A waiter's first read may create the latch and learns its id; its later reads send
//!   that id and never create: a latch that is gone, or is another incarnation (it
//!   expired and someone touched the name again), is reported as expired, so the waiter
//!   does not wait for a latch nobody counts down. Each read returns the key's TTL, so a
//!   waiter wakes when it would expire.
//! * A live latch created with another count is refused (its stored count is returned):
//!   nothing changes.

use std::sync::LazyLock;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::proto::keys::Keys;
use crate::proto::node::{Node, Retry, millis, new_token};
use crate::proto::scripts::Lua;
use crate::proto::sharded::PUBLISH_FN;

/// The largest count a latch accepts: the largest integer Lua's numbers (doubles) hold
/// exactly, which the script counts with.
pub(crate) const MAX_COUNT: u64 = (1 << 53) - 1;

/// Reads, creates or counts down a latch.
///
/// KEYS: latch. ARGV: count, TTL ms, the library's channel, `d` to count down or `r` to
/// read, the id of the incarnation the caller waits on (empty: none yet, the latch may be
/// created), the id of a new incarnation, the publish mode (see `sharded`).
/// Returns `{1, left, id, pttl}`, `{2, 0, '', 0}` when the key holds something else,
/// `{3, stored count, '', 0}` for a live latch of another count, or `{4, 0, '', 0}` when
/// the incarnation waited on is gone.
pub(crate) static LATCH: LazyLock<Lua> = LazyLock::new(|| {
    Lua::new(&format!(
        "{PUBLISH_FN}{}",
        r"
local cur = redis.pcall('GET', KEYS[1])
if type(cur) == 'table' then return {2, 0, '', 0} end
local left, count, id
local changed = false
if cur then
  left, count, id = string.match(cur, '^(%d+):(%d+):(.+)$')
  if not left then return {2, 0, '', 0} end
  if ARGV[5] ~= '' and id ~= ARGV[5] then return {4, 0, '', 0} end
  if count ~= ARGV[1] then return {3, tonumber(count), '', 0} end
  left = tonumber(left)
elseif ARGV[5] ~= '' then
  return {4, 0, '', 0}
else
  left, id, changed = tonumber(ARGV[1]), ARGV[6], true
end
if ARGV[4] == 'd' and left > 0 then
  left = left - 1
  changed = true
end
if changed then
  local value = string.format('%.0f', left) .. ':' .. ARGV[1] .. ':' .. id
  redis.call('SET', KEYS[1], value, 'PX', ARGV[2])
  -- After the write: a count down the server refuses (OOM, an ACL) opens nothing, so it
  -- must wake nobody.
  if ARGV[4] == 'd' and left == 0 then publish(ARGV[3], 'z') end
end
return {1, left, id, redis.call('PTTL', KEYS[1])}
"
    ))
});

/// What a call does to a latch.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Op<'a> {
    /// Count it down by one (creating it first if it is missing).
    CountDown,
    /// Read it; `seen`: the id of the incarnation the caller waits on (never created
    /// again), or `None` (created if missing).
    Read { seen: Option<&'a str> },
}

/// A latch as a call found (or left) it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct State {
    /// The count still to go: 0 when the latch is open.
    pub left: u64,
    /// The incarnation's id, for a waiter's later reads.
    pub id: String,
    /// What remains of the key's TTL.
    pub ttl: Option<Duration>,
}

impl Node {
    /// Runs `op` on the latch `keys` of `count`, whose key lives `ttl` after it is created
    /// or counted down. A read is retried as `retry` says (it is idempotent); a count
    /// down is never retried after the command may have run (a second one would count
    /// twice).
    pub fn latch(
        &self,
        keys: &Keys,
        count: u64,
        ttl: Duration,
        op: Op<'_>,
        retry: Retry,
        deadline: Option<Instant>,
    ) -> Result<State> {
        let (code, seen, retry) = match op {
            Op::CountDown => ("d", "", Retry::NEVER),
            Op::Read { seen } => ("r", seen.unwrap_or(""), retry),
        };
        let mut call = LATCH.call(1);
        call.arg(keys.latch())
            .arg(count)
            .arg(millis(ttl))
            .arg(keys.channel())
            .arg(code)
            .arg(seen)
            .arg(new_token())
            .arg(self.publish_mode(deadline)?);
        let reply: (i64, i64, String, i64) = self.run_script(&LATCH, &call, retry, deadline)?;
        state_of(reply, count)
    }
}

/// Reads [`LATCH`]'s reply to a call for a latch of `count`.
fn state_of(reply: (i64, i64, String, i64), count: u64) -> Result<State> {
    match reply {
        (1, left, id, pttl) => Ok(State {
            left: u64::try_from(left)
                .map_err(|_| Error::Protocol(format!("latch count {left}")))?,
            id,
            ttl: u64::try_from(pttl).ok().map(Duration::from_millis),
        }),
        (2, ..) => Err(Error::WrongKind),
        (3, stored, ..) => Err(Error::CountMismatch {
            stored: u64::try_from(stored).unwrap_or(0),
            asked: count,
        }),
        (4, ..) => Err(Error::LatchExpired),
        other => Err(Error::Protocol(format!("latch replied {other:?}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_are_read() {
        let open = state_of((1, 0, "id".to_owned(), 1500), 3).expect("open");
        assert_eq!(open.left, 0);
        assert_eq!(open.ttl, Some(Duration::from_millis(1500)));
        assert!(matches!(
            state_of((3, 4, String::new(), 0), 3),
            Err(Error::CountMismatch {
                stored: 4,
                asked: 3
            })
        ));
        assert!(
            state_of((4, 0, String::new(), 0), 3)
                .unwrap_err()
                .is_latch_expired()
        );
        assert!(
            state_of((2, 0, String::new(), 0), 3)
                .unwrap_err()
                .is_wrong_kind()
        );
        assert!(matches!(
            state_of((1, -1, String::new(), 0), 3),
            Err(Error::Protocol(_))
        ));
    }
}
