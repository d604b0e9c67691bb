//! The Lua scripts of the protocol. Each is hashed once (`redis::Script`) and run with
//! EVALSHA; it is loaded, and the call sent again, when the server answers NOSCRIPT (after
//! a restart or `SCRIPT FLUSH`).

use std::sync::LazyLock;
use std::time::Duration;

use redis::{Cmd, Connection, FromRedisValue, RedisError, RedisResult, Script};

use crate::error::{Error, Result};
use crate::proto::attempt::Attempt;
use crate::proto::keys::Keys;
use crate::proto::pool::next_read;
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
            Err(e) if is_noscript(&e) => reloaded(&[self], conn, before, |c| call.query(c)),
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
        Err(e) if is_noscript(&e) => reloaded(scripts, conn, before, |c| pipe.query(c)),
        other => other,
    }
}

/// After a `NOSCRIPT`: loads `scripts`, sends `before` again (see [`Lua::run`]), then the
/// call (`again`). More replies in a row than the one the call expected: each waits only
/// for what remains of the call's deadline, if it has one (see `pool::next_read`).
fn reloaded<T>(
    scripts: &[&Lua],
    conn: &mut Connection,
    before: Option<&Cmd>,
    again: impl FnOnce(&mut Connection) -> RedisResult<T>,
) -> RedisResult<T> {
    for script in scripts {
        next_read(conn)?;
        script.0.load(conn)?;
    }
    again_before(before, conn)?;
    next_read(conn)?;
    again(conn)
}

/// Sends `before` again, when there is one: a reloaded script's call follows it anew.
fn again_before(before: Option<&Cmd>, conn: &mut Connection) -> RedisResult<()> {
    match before {
        Some(cmd) => {
            next_read(conn)?;
            cmd.query(conn)
        }
        None => Ok(()),
    }
}

/// The server does not have the script (restarted, or `SCRIPT FLUSH`).
pub(crate) fn is_noscript(e: &RedisError) -> bool {
    e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript)
}

/// The server's clock, `clock_us()`: microseconds since the epoch, by `TIME`, read once per
/// script run (the first call reads it, the later ones give the same value): a script that
/// dates holds in milliseconds and issues a fence reads the clock once, and every step of
/// it sees the same now. Every script that issues or reads a fencing counter starts with
/// it, before [`FENCE_FN`] and [`HOLD_FENCE_FN`]; so do the scripts of shared holds.
///
/// One reading serves: a fence is `max(last + 1, now)` whatever `now` was read within the
/// script (see [`FENCE_FN`]); it is still not ahead of the clock, and the next script on the
/// same key reads the clock after this one ended.
pub(crate) const CLOCK_FN: &str = r"
local clock
local function clock_us()
  if not clock then
    local t = redis.call('TIME')
    clock = tonumber(t[1]) * 1000000 + tonumber(t[2])
  end
  return clock
end
";

/// The Lua helpers every script that issues or reads a fencing counter has, after
/// [`FENCE_FORM_FN`] and [`CLOCK_FN`].
///
/// # The counter's forms
///
/// The counter keeps the last fence issued and whether that hold was released, so that
/// the next holder learns whether the hold before it ended without a release (its lease
/// ran out, its key was deleted): `LockGuard::previous_lost`.
///
/// * `<f>`: released (or never held: the form an older version of the library wrote);
/// * `-<f>`: held (the holder's release writes `<f>` back, see [`END_FENCE_FN`]);
/// * `-0<f>`: held, by a hold that began after one that ended without a release (the
///   leading zero carries that news to a retry or a grantee that reads the counter later,
///   see `hold_fence`). `tonumber` reads both held forms as `-f`.
///
/// A counter found held when a hold begins means the hold before ended without a release.
/// A hold that nobody used is transparent: an attempt given back (the undo of a lost
/// round, a waiter leaving with a grant) leaves what the hold before it left (released
/// stays released, a loss stays news for the next holder). A grant is issued held, as any
/// hold: its grantee may hold the lock from the grant message alone (see `fair_scripts`),
/// so a grant that expires unconfirmed is news of a loss for the next holder, erring on
/// the side of caution. A counter that is gone
/// (expired after `fence_ttl` idle, evicted, deleted, lost in a restart) says nothing
/// either: the next holder is told nothing was lost.
///
/// `fence_form(fence, held, after_lost)` writes a form; `fence_read(value)` reads a `GET`'s
/// or `SET … GET`'s reply: the fence (0 when there is none: no key, a value of another
/// type, a string that is not a number), whether it is held, and whether after a loss.
///
/// # Issuing a fence
///
/// `next_fence(key, ttl, after_lost)` issues the next fence of the counter `key`:
/// one more than the last, and never below the server's clock in microseconds (`TIME`);
/// the counter is kept `ttl` ms more, so that the counter of a name nobody locks any more
/// expires. One `SET … PX … GET` writes the clock and reads the last value; a second `SET`
/// (keeping the TTL) only when the last value was not below the clock or the form guessed
/// was wrong. `after_lost`: what the new hold is told of the hold before it; `nil` to learn
/// it from the counter (held: that hold was never released), as an acquisition does.
/// The counter is written held. Returns the fence, `after_lost` and the counter's value
/// before (`false`: none), for a caller that must put it back (see `multi_scripts`); or
/// the error table of a failed `SET` (a key of another type, an ACL without `set`): the
/// caller undoes what it did first. A string that is not a number counts as no counter.
///
/// Why tokens then strictly increase, also when the counter expires, is evicted, deleted,
/// or lost in a restart or a failover to a replica that missed the last fences: every
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
/// for it (`fencing::MAX_FENCE`). The forms change nothing here: `last` is the value
/// without its sign, and a release writes back its hold's own fence, the last issued.
///
/// `take_fenced(lock, token, lease, key, ttl)` takes a free lock and issues its fence:
/// `SET lock token NX PX lease`, then `next_fence(key, ttl)`, so three commands when
/// it wins (`SET NX PX`, `TIME`, `SET … GET`) and one when the lock exists. Returns `false`
/// when the lock exists (nothing changed), else what `next_fence` returned. A script that
/// fails half-way is not rolled back, so when the counter's `SET` fails it deletes the
/// lock it just set before returning the error table: no lock without a fence is left.
///
/// # Reading it
///
/// `current_fence(key)` ([`HOLD_FENCE_FN`]) is the counter's fence as it is, for a holder
/// that does not issue one (a read hold); when the counter is gone, the server's clock,
/// which the next `next_fence` will reach or exceed. `hold_fence(key)` is the same, and
/// `after_lost`, for an exclusive holder that finds its own token in the key (a retry
/// after a lost reply, a grantee confirming its grant); it marks the counter held when it
/// is in the released form (a counter written by an earlier version of the library): from
/// then on the hold is one that can be lost.
/// `won(fence, after_lost)`: an acquire script's reply when the hold is ours, `{1, fence,
/// 0 or 1}`.
pub(crate) const FENCE_FN: &str = r"
local function next_fence(key, ttl, after_lost)
  local now = clock_us()
  local lost = after_lost == true
  local old = redis.pcall('SET', key, fence_form(now, true, lost), 'PX', ttl, 'GET')
  if type(old) == 'table' then return old end
  local last, was_held = fence_read(old)
  local fence = now
  if last >= now then fence = last + 1 end
  if after_lost == nil and was_held then
    lost = true
  elseif fence == now then
    return fence, lost, old
  end
  redis.call('SET', key, fence_form(fence, true, lost), 'KEEPTTL')
  return fence, lost, old
end
local function take_fenced(lock, token, lease, key, ttl)
  if not redis.call('SET', lock, token, 'NX', 'PX', lease) then return false end
  local fence, after_lost, old = next_fence(key, ttl)
  if type(fence) == 'table' then redis.call('DEL', lock) end
  return fence, after_lost, old
end
local function won(fence, after_lost)
  if after_lost then return {1, fence, 1} end
  return {1, fence, 0}
end
";

/// The fence counter read by a holder that issues no fence (see [`FENCE_FN`], after
/// which it comes): `current_fence` and `hold_fence`. Apart, so that an acquisition that
/// takes a free lock defines neither: a script's Lua functions are created each time it
/// runs, as far as it runs.
pub(crate) const HOLD_FENCE_FN: &str = r"
local function current_fence(key)
  local fence = fence_read(redis.pcall('GET', key))
  if fence == 0 then return clock_us() end
  return fence
end
local function hold_fence(key)
  local fence, held, after_lost = fence_read(redis.pcall('GET', key))
  if fence == 0 then return clock_us(), false end
  if not held then redis.call('SET', key, fence_form(fence, true, false), 'KEEPTTL') end
  return fence, after_lost
end
";

/// The fence counter's forms (see [`FENCE_FN`]): `fence_form` and `fence_read`, which
/// every script that reads or writes the counter starts with. Apart from the rest, so
/// that a release defines no more Lua functions than it calls.
///
/// `fence_form` gives the two common forms as numbers, which `redis.call` writes out
/// whole (`%.17g` on Redis 6.2 and 7.0, the shortest exact form on later servers and
/// Valkey: the same digits for an integer below 2^53), sparing the `string.format` that
/// costs each acquisition more server time than the `TIME` it reads; only the rare
/// `-0<f>` form is a formatted string.
pub(crate) const FENCE_FORM_FN: &str = r"
local function fence_form(fence, held, after_lost)
  if not held then return fence end
  if after_lost then return string.format('-0%.0f', fence) end
  return -fence
end
local function fence_read(v)
  local n = tonumber(v)
  if not n or n ~= n or n >= 2 ^ 53 or n <= -2 ^ 53 then return 0, false, false end
  if n >= 0 then return n, false, false end
  return -n, true, string.byte(v, 2) == 48
end
";

/// How a hold's end marks the fence counter (see [`FENCE_FN`]), after [`FENCE_FORM_FN`].
///
/// `end_fence(key, fence)`, after a hold of `key`'s lock ended by the call (the caller
/// checked the token): `fence` is the holder's fence (a decimal string; Redlock: the
/// highest of the granting nodes'), written back released, keeping the TTL, in one
/// `SET … XX KEEPTTL`. It is the last fence the node issued: while a hold lives, only its
/// own scripts write the counter (a Redlock raise that comes late brings an earlier
/// holder's fence, below this one, which is the highest of a majority overlapping that
/// holder's). `0` gives back an attempt nobody used: one `GET`, and a held counter becomes
/// released only if that hold began after a clean release (`-<f>`), else (`-0<f>`) stays
/// as it is. A counter that is gone stays gone (no key without a TTL).
pub(crate) const END_FENCE_FN: &str = r"
local function end_fence(key, fence)
  if fence ~= '0' then
    redis.call('SET', key, fence, 'XX', 'KEEPTTL')
    return
  end
  local last, held, after_lost = fence_read(redis.pcall('GET', key))
  if held and not after_lost then
    redis.call('SET', key, fence_form(last, false), 'KEEPTTL')
  end
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
";

/// The Lua helper of the scripts that read and clean the waiters' keys, which hold sorted
/// sets: the fair queue (`:q`, `:qx`), the waiting marks of a read-write lock or a
/// semaphore (`:ww`, `:wr`) and the nonces (`:qn`).
///
/// A script is not undone when one of its commands fails, so none of these may fail once
/// the script has written. A key of another type (another program's key of the same name,
/// an operator's edit, a key left by an older layout) fails them with `WRONGTYPE`;
/// through `tolerate(empty, ...)`, which runs the command `...`, it gives `empty`
/// instead: a set with nobody in it (`{}` for a listing, `false` for a score, 0 for a
/// `ZREM`: none of ours was in it), and nothing is taken out of it. So a release, a leave
/// or a hold taken goes on as if nobody waited there, and wakes whoever waits (`r`): their
/// own attempts then meet the key. Any other error (an ACL that refuses the command) fails
/// the script as `redis.call` would: the command is sent again with it. One function
/// (each a script defines costs every run of it).
///
/// An attempt's read of such a key before its first write still uses `redis.call`, and
/// fails the attempt with the server's error, having written nothing. The nonces are
/// hints (a grant without one is only a wake-up, which its waiter's next attempt
/// confirms): a nonce set of another type is never written, and the waiters are queued or
/// marked without nonces. A waiter's own queue entry or mark is added with `redis.call`
/// to a key the attempt read first (the fair queue's, before it wrote anything), or as its
/// first write (a mark): a queue or a set of marks of another type fails it with
/// `WRONGTYPE`, having written nothing.
pub(crate) const SETS_FN: &str = r"
local function tolerate(empty, ...)
  local r = redis.pcall(...)
  if type(r) ~= 'table' or not r.err then return r end
  if string.find(r.err, 'WRONGTYPE', 1, true) then return empty end
  return redis.call(...)
end
";

/// The lease change of the renewal scripts, after [`OWNER_FN`].
///
/// `extend_owned(lock, token, lease, record, change)`, compare-and-`PEXPIRE`: when `lock`
/// holds `token`, sets its TTL to `lease` ms. With a lease record and the change's number
/// (the string sent), the change is ordered by the rule of lease changes (see [`EXTEND`]):
/// refused (2, nothing changed) when the record holds a higher number of this token's;
/// else applied and the record set to `<change>:<token>` with the same lease. Without,
/// unordered (see [`EXTEND_UNORDERED`]): it only lengthens the lease, so that a change
/// landing after a longer one never cuts it short. Returns 1 extended (the lease lasts
/// `lease` ms at least), else `ownership` of `lock` (0 gone, -1 another owner) or 2. A
/// lock that is gone is never recreated.
pub(crate) const EXTEND_OWNED_FN: &str = r"
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
  if record then
    redis.call('PEXPIRE', lock, lease)
    redis.call('SET', record, change .. ':' .. token, 'PX', lease)
  elseif redis.call('PTTL', lock) < tonumber(lease) then
    redis.call('PEXPIRE', lock, lease)
  end
  return 1
end
";

/// Acquire in one round trip, idempotently.
///
/// KEYS: lock, fence, mark. ARGV: token, lease in ms, the library's channel, the client's
/// id, the mark's TTL in ms (0: the caller will not wait, so leave no mark), `1` if this
/// caller marked before (its mark is deleted when it wins), the fence counter's TTL in ms
/// (see [`FENCE_FN`]), the publish mode (see `sharded`).
/// Returns `{1, fence, after lost}` when the lock is ours (`after lost`: 1 when the hold
/// before ended without a release, see [`FENCE_FN`]), `{0, pttl, 0}` when someone else
/// holds it, `{2, 0, 0}` when the key is a read-write lock or a semaphore (checked on the
/// failure path only: `SET NX` fails on any existing key, so the success path stays as it
/// is).
///
/// The common case comes first and costs three calls: `take_fenced` (see [`FENCE_FN`]),
/// which also deletes the key it set when the fence's `SET` fails: no lock is left
/// behind. The winner's own mark, if it marked before, is compare-and-deleted (see
/// [`OWNER_FN`]).
///
/// When the key already holds *our* token (a retry after the reply to a first attempt was
/// lost), the lease is refreshed and the fence the first attempt created is returned (with
/// what it found, see `hold_fence`): one lock, one fence, no stray key. The refresh only
/// lengthens the lease: an attempt delayed on the way can land after a lease change of the
/// hold it started (see [`EXTEND`]), and must not cut short a longer lease that change set
/// (the holder's validity counts from before the first attempt, so any refresh covers
/// it). A failed attempt publishes `c<client id>` on the lock's
/// channel, and leaves its client id in the mark key, so that the holder's process knows
/// another process is waiting (the fairness budget only applies then): live when it is
/// subscribed, through the mark when it subscribed too late to hear. Marks are published
/// with `pcall`: an ACL user without channel permissions still locks.
pub(crate) static ACQUIRE: LazyLock<Lua> = LazyLock::new(|| {
    Lua::new(&format!(
        "{PUBLISH_FN}{FENCE_FORM_FN}{CLOCK_FN}{FENCE_FN}{OWNER_FN}{}{HOLD_FENCE_FN}{}",
        r"
local fence, after_lost = take_fenced(KEYS[1], ARGV[1], ARGV[2], KEYS[2], ARGV[7])
if type(fence) == 'table' then return fence end
if fence then
  if ARGV[6] == '1' then delete_owned({KEYS[3]}, ARGV[4]) end
  return won(fence, after_lost)
end
",
        r"
local cur = redis.pcall('GET', KEYS[1])
if type(cur) == 'table' then return {2, 0, 0} end
if cur == ARGV[1] then
  if redis.call('PTTL', KEYS[1]) < tonumber(ARGV[2]) then redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
  return won(hold_fence(KEYS[2]))
end
if ARGV[5] ~= '0' then
  redis.call('SET', KEYS[3], ARGV[4], 'PX', ARGV[5])
  publish(ARGV[3], 'c' .. ARGV[4])
end
return {0, redis.call('PTTL', KEYS[1]), 0}
"
    ))
});

/// Compare-and-delete (`delete_owned`, see [`OWNER_FN`]), and the fence counter marked
/// released (`end_fence`, see [`END_FENCE_FN`]).
///
/// KEYS: lock, its lease record (see [`EXTEND`]; deleted with the lock by the same
/// `DEL`: no key of the hold outlives its release, at no extra command) and its fence
/// counter, except where a Redis Cluster slot migration refuses them (the lock alone: the
/// record then ends with its TTL, and the counter stays held, so the next holder is told
/// the hold before it was lost). ARGV: token, the library's channel, the holder's fence
/// (`0`: an attempt nobody used is given back), the publish mode. `r` is published on
/// the channel after a release. Always, even when keyspace notifications are on: waiters
/// of another ACL user may not be allowed keyspace channels, and a server restart forgets
/// a `CONFIG SET`. The subscriber pairs each `r` with the `del` event before it, so nobody
/// wakes twice.
/// Returns 1 released, 0 the key was gone, -1 another token (or another kind of lock)
/// holds it.
///
/// # A retry
///
/// A release sent again after a try whose reply was lost (see [`release_cmd`])
/// carries one more argument before the publish mode, the fence counter's TTL in ms. When
/// it finds the key gone, the counter tells whether a try before ended the hold: a
/// release writes the hold's fence back released (see [`END_FENCE_FN`]), so the counter
/// holding our fence released says it did (0, gone: our first try released it). Our fence still held, a fence below
/// ours (data that came back older) or no counter at all (a restart without data, a
/// `FLUSHALL`) says the hold ended without it: 3, gone and not released by us. A counter
/// past our fence (the name was taken since) cannot tell: 0. Neither can a counter that
/// is gone when the hold is old enough for it to have expired under it (it is kept
/// `fence_ttl` from the acquisition, whose fence is at least the server's clock then in
/// µs): past half that TTL, 0. Only this branch reads the counter and the clock: the first
/// try's commands are those above.
pub(crate) static RELEASE: LazyLock<Lua> = LazyLock::new(|| {
    Lua::new(&format!(
        "{PUBLISH_FN}{FENCE_FORM_FN}{END_FENCE_FN}{OWNER_FN}{}{GONE_AGAIN_FN}{}",
        r"
local status = delete_owned({KEYS[1], KEYS[2]}, ARGV[1])
if status == 1 then
  if KEYS[3] then end_fence(KEYS[3], ARGV[3]) end
  publish(ARGV[2], 'r')
elseif status == 0 and #ARGV == 5 then
",
        r"
  return gone_again(KEYS[3], ARGV[3], ARGV[4])
end
return status
"
    ))
});

/// How a release sent again after a try whose reply was lost reads a key it finds gone
/// (see [`RELEASE`], "A retry"; the fair queue's release reads it the same way), after
/// [`FENCE_FORM_FN`]: `gone_again(counter, fence, ttl_ms)` is 3 when the fence counter
/// shows that no try of the holder of `fence` released the hold, else 0 (released by one,
/// or cannot tell). Written inside the branch that calls it: only a retry that finds the
/// key gone creates the function.
pub(crate) const GONE_AGAIN_FN: &str = r"
  local function gone_again(counter, fence, ttl_ms)
    local last, held = fence_read(redis.pcall('GET', counter))
    local ours = tonumber(fence)
    if last > ours or (last == ours and not held) then return 0 end
    if last == 0 then
      local t = redis.call('TIME')
      local age_us = tonumber(t[1]) * 1000000 + tonumber(t[2]) - ours
      if age_us >= tonumber(ttl_ms) * 500 then return 0 end
    end
    return 3
  end
";

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
/// granting majority), and keeps it for the counter's TTL, as issuing a fence would. The
/// counter keeps its form (see [`FENCE_FN`]): held stays held, with what it says of the
/// hold before.
///
/// KEYS: fence. ARGV: the value, the counter's TTL in ms.
pub(crate) static RAISE_FENCE: LazyLock<Lua> = LazyLock::new(|| {
    Lua::new(&format!(
        "{FENCE_FORM_FN}{}",
        r"
local last, held, after_lost = fence_read(redis.pcall('GET', KEYS[1]))
local raised = tonumber(ARGV[1])
if last < raised then
  redis.call('SET', KEYS[1], fence_form(raised, held, after_lost), 'PX', ARGV[2])
else
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"
    ))
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

/// Reads an acquire script's reply ([`ACQUIRE`]'s and the fair queue's alike): 1, the
/// fence and whether the hold before ended without a release; 0 and the holder's PTTL; 2
/// for a key of another kind.
pub(crate) fn acquire_reply(reply: (i64, i64, i64)) -> Result<Attempt> {
    match reply {
        (1, fence, after_lost) => Ok(Attempt::Acquired {
            fence: u64::try_from(fence)
                .map_err(|_| Error::Protocol(format!("negative fence {fence}")))?,
            others_wait: false,
            previous_lost: after_lost == 1,
            resent: false,
        }),
        (0, pttl, _) => Ok(Attempt::Held {
            pttl: u64::try_from(pttl).ok().map(Duration::from_millis),
            resent: false,
        }),
        (2, ..) => Err(Error::WrongKind),
        other => Err(Error::Protocol(format!("acquire replied {other:?}"))),
    }
}

/// The plain compare-and-delete of `token`'s lock ([`RELEASE`]): its key and, with
/// `whole`, its lease record (deleted with it) and its fence counter (marked released, see
/// [`fence_arg`]); without, its key alone (a Redis Cluster slot migration refuses the
/// others: see `Protocol::release`).
pub(crate) fn release_call(
    site: Site<'_>,
    keys: &Keys,
    token: &str,
    fence: Option<u64>,
    whole: bool,
) -> Cmd {
    release_cmd(site, keys, token, fence, whole, false)
}

/// [`release_call`]; `again`: the whole release sent again after a try whose reply was
/// lost, which carries the fence counter's TTL in ms before the publish mode (a script
/// reads the mode as its last argument), so that finding the key gone it reads the counter
/// to tell whether a try before released it (see [`RELEASE`]).
pub(crate) fn release_cmd(
    site: Site<'_>,
    keys: &Keys,
    token: &str,
    fence: Option<u64>,
    whole: bool,
    again: bool,
) -> Cmd {
    let mut call = RELEASE.call(if whole { 3 } else { 1 });
    call.arg(keys.lock());
    if whole {
        call.arg(keys.lease()).arg(keys.fence());
    }
    call.arg(token).arg(keys.channel()).arg(fence_arg(fence));
    if again {
        call.arg(site.fence_ttl_ms);
    }
    call.arg(site.publish);
    call
}

/// The fence a release script is given (see `end_fence` in [`END_FENCE_FN`]): the holder's,
/// or 0 when the hold given back is an attempt nobody used (an undone round, a cleanup
/// after a lost reply), which leaves the counter saying what the hold before it said.
pub(crate) fn fence_arg(fence: Option<u64>) -> u64 {
    fence.unwrap_or(0)
}

/// The call of [`UNMARK`]: our own contention mark goes.
pub(crate) fn unmark_call(site: Site<'_>, keys: &Keys) -> Cmd {
    let mut call = UNMARK.call(1);
    call.arg(keys.mark()).arg(site.client_id);
    call
}
