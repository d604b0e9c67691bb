//! The Lua scripts of the protocol. Each is hashed once (`redis::Script`) and run with
//! EVALSHA; it is loaded, and the call sent again, when the server answers NOSCRIPT (after
//! a restart or `SCRIPT FLUSH`).

use std::sync::LazyLock;
use std::time::Duration;

use redis::{Cmd, Connection, FromRedisValue, RedisError, RedisResult, Script};

use crate::error::{Error, Result};
use crate::proto::attempt::Attempt;
use crate::proto::keys::Keys;
use crate::proto::sharded::PUBLISH_FN;

/// A script, called by hash.
///
/// The `EVALSHA` command is built directly, arguments written once into the command's
/// buffer, rather than through `ScriptInvocation`, which copies every key and argument into
/// a vector of its own first: the acquire and release are on every lock's path. A built
/// call can also be sent by another thread (see `early`).
pub(crate) struct Lua(Script);

impl Lua {
    pub(crate) fn new(code: &str) -> Self {
        Lua(Script::new(code))
    }

    /// An `EVALSHA` of this script with `keys` keys: append the keys, then the arguments.
    /// Its buffers are sized for the lock scripts' calls (up to 17 arguments with
    /// `FAIR_ACQUIRE`, keys of a few dozen bytes), so that building one does not grow them
    /// step by step.
    pub fn call(&self, keys: usize) -> Cmd {
        let mut cmd = Cmd::with_capacity(20, 512);
        cmd.arg("EVALSHA");
        cmd.arg(self.0.get_hash()).arg(keys);
        cmd
    }

    /// Runs `call` on `conn`, loading the script first if the server does not know it.
    /// `before`: the command sent ahead of `call` on `conn`, if any (see
    /// `node::Commands`), sent again ahead of the call after a reload: it covers the next
    /// command only (Redis Cluster's `ASKING`, without which the target of an `ASK` sends
    /// the call back to the source).
    pub fn run<T: FromRedisValue>(
        &self,
        call: &Cmd,
        conn: &mut Connection,
        before: Option<&Cmd>,
    ) -> RedisResult<T> {
        match call.query(conn) {
            Err(e) if is_noscript(&e) => {
                self.0.load(conn)?;
                again_before(before, conn)?;
                call.query(conn)
            }
            other => other,
        }
    }
}

/// Runs `calls` (`EVALSHA`s of `scripts`, in any mix) in one round trip, one reply each;
/// after a `NOSCRIPT` loads them all and sends them again (after `before`, as
/// [`Lua::run`] does), so `calls` must be safe to run twice (renewals are).
pub fn run_pipelined<T: FromRedisValue>(
    scripts: &[&Lua],
    calls: &[Cmd],
    conn: &mut Connection,
    before: Option<&Cmd>,
) -> RedisResult<Vec<T>> {
    let mut pipe = redis::pipe();
    for call in calls {
        pipe.add_command(call.clone());
    }
    match pipe.query(conn) {
        Err(e) if is_noscript(&e) => {
            for script in scripts {
                script.0.load(conn)?;
            }
            again_before(before, conn)?;
            pipe.query(conn)
        }
        other => other,
    }
}

/// Sends `before` again, when there is one: a reloaded script's call follows it anew.
fn again_before(before: Option<&Cmd>, conn: &mut Connection) -> RedisResult<()> {
    match before {
        Some(cmd) => cmd.query(conn),
        None => Ok(()),
    }
}

/// The server does not have the script (restarted, or `SCRIPT FLUSH`).
pub(crate) fn is_noscript(e: &RedisError) -> bool {
    e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript)
}

/// The Lua helpers every script that issues or reads a fencing counter starts with.
///
/// `next_fence(key, ttl)` issues the next fence of the counter `key`: one more than the
/// last, and never below the server's clock in microseconds (`TIME`); the counter is kept
/// `ttl` ms more, so that the counter of a name nobody locks any more expires.
///
/// Why tokens then strictly increase, also when the counter expires, is evicted, deleted,
/// or lost in a restart or a failover to a replica that missed the last increments: every
/// fence is `max(last + 1, now)`, so while the counter lives it increases; and a fence is
/// never ahead of the clock of the server that issued it (acquisitions of one name are
/// scripts on one key, run one at a time, each taking more than a microsecond: by
/// induction `c_i ≤ t_i`, since `c_{i+1} = max(c_i + 1, t_{i+1}) ≤ max(t_i + 1, t_{i+1}) =
/// t_{i+1}`). A counter that starts again, from nothing or from a stale value, starts at
/// the clock of now, above every fence issued before. This rests on the clock of the
/// server that issues a fence not being behind the clock that issued the previous one (no
/// step back across a restart; a promoted replica's clock in step with the old master's),
/// and on fewer than one fence per microsecond on one name, on average (a burst above
/// that puts the counter ahead of the clock by at most the burst's excess). The value is
/// written with `%.0f`: Lua numbers are doubles, exact to 2^53, and a token keeps 52 bits
/// for it (`fencing::MAX_FENCE`).
///
/// Returns the new value, or the error table of a failed `INCR` (a foreign value in the
/// key, an ACL without `incr`): the caller undoes what it did first.
///
/// `take_fenced(lock, token, lease, key, ttl)` takes a free lock and issues its fence:
/// `SET lock token NX PX lease`, then `next_fence(key, ttl)`, so four commands when it
/// wins (`SET NX PX`, `INCR`, `TIME`, `SET` or `PEXPIRE`) and one when the lock exists.
/// Returns `false` when the lock exists (nothing changed), else what `next_fence` returned.
/// A script that fails half-way is not rolled back, so when the `INCR` fails it deletes the
/// lock it just set before returning the error table: no lock without a fence is left.
///
/// `current_fence(key)` is the counter as it is, for a holder that does not increment it
/// (a read hold, a retry finding its own acquisition): when the counter is gone, the
/// server's clock, which the next `next_fence` will reach or exceed.
pub(crate) const FENCE_FN: &str = r"
local function clock_us()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end
local function next_fence(key, ttl)
  local fence = redis.pcall('INCR', key)
  if type(fence) == 'table' then return fence end
  local now = clock_us()
  if fence < now then
    fence = now
    redis.call('SET', key, string.format('%.0f', fence), 'PX', ttl)
  else
    redis.call('PEXPIRE', key, ttl)
  end
  return fence
end
local function take_fenced(lock, token, lease, key, ttl)
  if not redis.call('SET', lock, token, 'NX', 'PX', lease) then return false end
  local fence = next_fence(key, ttl)
  if type(fence) == 'table' then redis.call('DEL', lock) end
  return fence
end
local function current_fence(key)
  local fence = redis.call('GET', key)
  if fence then return tonumber(fence) end
  return clock_us()
end
";

/// The Lua helpers of the scripts that compare a lock's token before they change it.
///
/// `ownership(key, token)`: whose `key` is, in one `GET` (a `pcall`, so that a key of
/// another type is an answer, not an error): 1 it holds `token`, 0 it is gone, -1 it holds
/// another value or is not a string (another kind of lock).
///
/// `delete_owned(keys, token)`, compare-and-delete: when `keys[1]` holds `token`, deletes
/// all of `keys` with one `DEL` (a lock and the keys that end with it). Returns
/// `ownership` of `keys[1]`.
///
/// `extend_owned(lock, token, lease, record, change)`, compare-and-`PEXPIRE`: when `lock`
/// holds `token`, sets its TTL to `lease` ms. With a lease record and the change's number
/// (the string sent), the change is ordered by the rule of lease changes (see [`EXTEND`]):
/// refused (2, nothing changed) when the record holds a higher number of this token's;
/// else applied and the record set to `<change>:<token>` with the same lease. Without,
/// unordered (see [`EXTEND_UNORDERED`]). Returns 1 extended, else `ownership` of `lock`
/// (0 gone, -1 another owner) or 2. A lock that is gone is never recreated.
pub(crate) const OWNER_FN: &str = r"
local function ownership(key, token)
  local cur = redis.pcall('GET', key)
  if cur == token then return 1 end
  if cur then return -1 end
  return 0
end
local function delete_owned(keys, token)
  local status = ownership(keys[1], token)
  if status == 1 then redis.call('DEL', unpack(keys)) end
  return status
end
local function extend_owned(lock, token, lease, record, change)
  local status = ownership(lock, token)
  if status ~= 1 then return status end
  if record then
    local last = redis.pcall('GET', record)
    local applied = 0
    if type(last) == 'string' then
      local m, t = string.match(last, '^(%d+):(.*)$')
      if t == token then applied = tonumber(m) end
    end
    if tonumber(change) < applied then return 2 end
  end
  redis.call('PEXPIRE', lock, lease)
  if record then redis.call('SET', record, change .. ':' .. token, 'PX', lease) end
  return 1
end
";

/// Acquire in one round trip, idempotently.
///
/// KEYS: lock, fence, mark. ARGV: token, lease in ms, the library's channel, the client's
/// id, the mark's TTL in ms (0: the caller will not wait, so leave no mark), `1` if this
/// caller marked before (its mark is deleted when it wins), the fence counter's TTL in ms
/// (see [`FENCE_FN`]), the publish mode (see `sharded`).
/// Returns `{1, fence}` when the lock is ours, `{0, pttl}` when someone else holds it,
/// `{2, 0}` when the key is a read-write lock or a semaphore (checked on the failure path
/// only: `SET NX` fails on any existing key, so the success path stays as it is).
///
/// The common case comes first and costs four calls: `take_fenced` (see [`FENCE_FN`]),
/// which also deletes the key it set when the fence's `INCR` fails: no lock is left
/// behind. The winner's own mark, if it marked before, is compare-and-deleted (see
/// [`OWNER_FN`]).
///
/// When the key already holds *our* token (a retry after the reply to a first attempt was
/// lost), the lease is refreshed and the fence the first attempt created is returned: one
/// lock, one fence, no stray key. The refresh only lengthens the lease: an attempt delayed
/// on the way can land after a lease change of the hold it started (see [`EXTEND`]), and
/// must not cut short a longer lease that change set (the holder's validity counts from
/// before the first attempt, so any refresh covers it). A failed attempt publishes `c<client id>` on the lock's
/// channel, and leaves its client id in the mark key, so that the holder's process knows
/// another process is waiting (the fairness budget only applies then): live when it is
/// subscribed, through the mark when it subscribed too late to hear. Marks are published
/// with `pcall`: an ACL user without channel permissions still locks.
pub(crate) static ACQUIRE: LazyLock<Lua> = LazyLock::new(|| {
    Lua::new(&format!(
        "{PUBLISH_FN}{FENCE_FN}{OWNER_FN}{}",
        r"
local fence = take_fenced(KEYS[1], ARGV[1], ARGV[2], KEYS[2], ARGV[7])
if type(fence) == 'table' then return fence end
if fence then
  if ARGV[6] == '1' then delete_owned({KEYS[3]}, ARGV[4]) end
  return {1, fence}
end
local cur = redis.pcall('GET', KEYS[1])
if type(cur) == 'table' then return {2, 0} end
if cur == ARGV[1] then
  if redis.call('PTTL', KEYS[1]) < tonumber(ARGV[2]) then redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
  return {1, current_fence(KEYS[2])}
end
if ARGV[5] ~= '0' then
  redis.call('SET', KEYS[3], ARGV[4], 'PX', ARGV[5])
  publish(ARGV[3], 'c' .. ARGV[4])
end
return {0, redis.call('PTTL', KEYS[1])}
"
    ))
});

/// Compare-and-delete (`delete_owned`, see [`OWNER_FN`]).
///
/// KEYS: lock, and its lease record (see [`EXTEND`]; deleted with the lock by the same
/// `DEL`: no key of the hold outlives its release, at no extra command) except where a
/// Redis Cluster slot migration refuses the pair (the record then ends with its TTL). ARGV: token, the
/// library's channel, the publish mode. `r` is published on
/// the channel after a release. Always, even when keyspace notifications are on: waiters
/// of another ACL user may not be allowed keyspace channels, and a server restart forgets
/// a `CONFIG SET`. The subscriber pairs each `r` with the `del` event before it, so nobody
/// wakes twice.
/// Returns 1 released, 0 the key was gone, -1 another token (or another kind of lock)
/// holds it.
pub(crate) static RELEASE: LazyLock<Lua> = LazyLock::new(|| {
    Lua::new(&format!(
        "{PUBLISH_FN}{OWNER_FN}{}",
        r"
local status = delete_owned(KEYS, ARGV[1])
if status == 1 then publish(ARGV[2], 'r') end
return status
"
    ))
});

/// Compare-and-delete of a waiter's own mark, when it stops waiting without the lock
/// (`delete_owned`, see [`OWNER_FN`]).
///
/// KEYS: mark. ARGV: the client's id. Returns 0.
pub(crate) static UNMARK: LazyLock<Lua> = LazyLock::new(|| {
    Lua::new(&format!(
        "{OWNER_FN}{}",
        r"
delete_owned(KEYS, ARGV[1])
return 0
"
    ))
});

/// Raises a fencing counter to at least a value (Redlock: the highest counter of the
/// granting majority), and keeps it for the counter's TTL, as an increment would.
///
/// KEYS: fence. ARGV: the value, the counter's TTL in ms.
pub(crate) static RAISE_FENCE: LazyLock<Lua> = LazyLock::new(|| {
    Lua::new(
        r"
if (tonumber(redis.call('GET', KEYS[1]) or '0')) < tonumber(ARGV[1]) then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
else
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
",
    )
});

/// What a call needs from the node it is sent to: this client's id (sent with failed
/// attempts, so that our own subscriber ignores our own marks), how long an idle fencing
/// counter lives, and the publish mode of the node's library channel (see `sharded`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Site<'a> {
    pub client_id: &'a str,
    pub fence_ttl_ms: u64,
    pub publish: &'static str,
}

/// The call of [`ACQUIRE`] (see it for the arguments): a waiter's failed attempt marks
/// contention for `mark_ms` (0: it will not wait); `clear`: it marked before, and deletes
/// its mark if it wins.
pub(crate) fn acquire_call(
    site: Site<'_>,
    keys: &Keys,
    token: &str,
    lease_ms: u64,
    mark_ms: u64,
    clear: bool,
) -> Cmd {
    let mut call = ACQUIRE.call(3);
    call.arg(keys.lock())
        .arg(keys.fence())
        .arg(keys.mark())
        .arg(token)
        .arg(lease_ms)
        .arg(keys.channel())
        .arg(site.client_id)
        .arg(mark_ms)
        .arg(if clear { "1" } else { "0" })
        .arg(site.fence_ttl_ms)
        .arg(site.publish);
    call
}

/// Reads an acquire script's reply ([`ACQUIRE`]'s and the fair queue's alike): 1 and the
/// fence, 0 and the holder's PTTL, 2 for a key of another kind.
pub(crate) fn acquire_reply(reply: (i64, i64)) -> Result<Attempt> {
    match reply {
        (1, fence) => Ok(Attempt::Acquired {
            fence: u64::try_from(fence)
                .map_err(|_| Error::Protocol(format!("negative fence {fence}")))?,
            others_wait: false,
        }),
        (0, pttl) => Ok(Attempt::Held {
            pttl: u64::try_from(pttl).ok().map(Duration::from_millis),
        }),
        (2, _) => Err(Error::WrongKind),
        other => Err(Error::Protocol(format!("acquire replied {other:?}"))),
    }
}

/// The plain compare-and-delete of `token`'s lock ([`RELEASE`]): its key and, with
/// `record`, its lease record (deleted with it); without, its key alone (a Redis Cluster
/// slot migration refuses the pair: see `Protocol::release`).
pub(crate) fn release_call(site: Site<'_>, keys: &Keys, token: &str, record: bool) -> Cmd {
    let mut call = RELEASE.call(if record { 2 } else { 1 });
    call.arg(keys.lock());
    if record {
        call.arg(keys.lease());
    }
    call.arg(token).arg(keys.channel()).arg(site.publish);
    call
}

/// The call of [`UNMARK`]: our own contention mark goes.
pub(crate) fn unmark_call(site: Site<'_>, keys: &Keys) -> Cmd {
    let mut call = UNMARK.call(1);
    call.arg(keys.mark()).arg(site.client_id);
    call
}
