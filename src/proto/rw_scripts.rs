//! Read-write locks and semaphores on the wire: holds that several owners share.
//!
//! The key of name `n` (the same `p{n}` as a plain lock, so that one name has one kind at
//! a time) is a sorted set:
//!
//! * one *kind member*, with a negative score: `#rw` (score −1) for a read-write lock,
//!   `#sem` (score −permits) for a semaphore, so the permit count travels with the holds;
//! * one member per hold, scored by the hold's expiry in server milliseconds (`TIME`):
//!   `r<token>` a read hold, `w<token>` the write hold, `u<token>` the upgradable read
//!   hold (a read hold that excludes writers and other upgradable holds, at most one at a
//!   time), `p<token>` a permit.
//!
//! Every script that reads the holds drops the expired ones (so a crashed holder's hold
//! ends by itself) and deletes the key when only the kind member is left; a new or renewed
//! hold raises the key's expiry to its own when it is shorter, and a hold that ends while
//! others remain lowers it to the latest of theirs, so that the whole key goes with the
//! last hold to expire: a key left with expired holds alone would be taken for another
//! kind by a plain lock of the name, which reads no sorted set.
//!
//! `p{n}:ww` is a sorted set of the writers waiting for a read-write lock, scored by when
//! their mark expires (each failed write attempt that will wait renews its mark, and drops
//! the marks that expired: those of waiters that crashed or gave up without a word). While
//! it has a live member, no new read hold is granted: writers are preferred. `p{n}:wr` holds
//! the same marks for waiting readers: they hold nobody back, but tell a process that
//! keeps its hold for its own threads that another process waits. Both sets expire at the
//! latest twice a mark's TTL after the last mark. The fence counter `p{n}:fence` is the
//! plain lock's: a write hold issues the next fence and marks the counter held until its
//! release (and refreshes its TTL, see `FENCE_FN`), so that the next write hold learns
//! whether it was released or expired; read holds only read it.
//!
//! A semaphore's waiting permit-seekers are marked the same way, in the same `p{n}:ww`
//! (the lock key has one kind at a time; see `Keys::permit_waiters`): a failed attempt
//! that will wait marks its member, each attempt renews the mark, a permit won takes it
//! out.
//!
//! `p{n}:wa` orders the waiting writers and permit-seekers by arrival: a wait's first mark
//! adds its member, scored by the server's time, and its renewals keep that score
//! (`ZADD NX`), so a waiter that re-checks, however often, keeps its place, and a waiter
//! whose re-check interval (so its mark's TTL) is longer is not passed by the ones with a
//! shorter one, as it would be in the order of expiry. A release grants (or wakes) the
//! member with a live mark that came first; arrivals whose mark expired or went are
//! dropped on the way. A member leaves `…:wa` whenever its mark leaves `…:ww` for good
//! (a hold won or granted, a leave, an expired mark dropped); a wake-up that takes a
//! permit-seeker's mark keeps its arrival. Marks of an older version of the library,
//! which records no arrival, are granted in the order of expiry when no arrival has a live
//! mark. `…:wa` is kept as long as the marks, and tolerated as they are when it holds a
//! value of another type (the order of expiry then).
//!
//! On the library's channel a release says `r` (a waiter may get in), `g<member>:0`, a
//! wake-up for one waiter alone (nothing is reserved: its next attempt takes what is free
//! as any would, and marks itself again if it fails: a permit-seeker in the place its
//! mark had), or a grant,
//! `g<member>:<nonce>:<fence>:<grant ms>`, as the fair queue's (see `fair_scripts`).
//!
//! When the last hold of a read-write lock ends (a release, or a waiter leaving with a
//! grant it never used) and writers wait, the write hold is *granted* to the writer waiting
//! longest (the first to arrive), in the same script: its member is held for the grant lease, the counter issues
//! its fence, its mark goes, and the message carries the nonce of its latest attempt
//! (stored with its mark in `p{n}:qn`, the fair queue's set of nonces, which a name of this
//! kind has free). When no writer waits, every reader marked waiting is granted a read hold
//! the same way, each with its own message (an upgradable read, or a waiter with no mark,
//! is told `r`). A waiter takes a grant that carries its latest attempt's nonce as the hold
//! with no round trip, until that attempt's send plus the grant lease, as the fair queue's
//! waiter does (`Contest::trust`): Redis ran that attempt before the grant. Any other grant
//! is only a wake-up, whose next attempt finds its member held and keeps it. A grant after
//! a write hold that ended without a release carries nonce `0`, so that the grantee's
//! confirming attempt tells it of the loss.
//!
//! A failed write attempt that starts to wait also says `c<client id>`: the processes that
//! hold read holds for their own threads hear it (see `engine::turns`) and give their holds
//! back as soon as their readers are done, rather than at their next budget check.
//!
//! A freed permit is granted the same way to the permit-seeker waiting longest (its
//! member held for the grant lease, its mark and nonce taken out, `g<member>:<nonce>:
//! <permits>:<grant ms>`: permits have no fence, and the semaphore's count in its place
//! lets a waiter that asked for another count take it for a wake-up, whose attempt is told
//! of the mismatch), so that a second release in quick succession
//! grants to the next one, not the same one twice. With no live mark (waiters of an older
//! version, or none), or no permit free, or called without the waiting sets (the narrow
//! call of a Cluster migration), it wakes as before: `g<member>:0` to the one waiting
//! longest, taking its mark, or `r`. A permit-seeker that gives up passes on a permit
//! granted to it, or a wake-up whose mark a release took (`WAITER_LEAVE`), so none is lost
//! with it. Holds that expire inside the key wake nobody: the waiters' re-checks (the
//! earliest lease's end, which a failed attempt replies) cover them.
//!
//! An upgrade turns the upgradable hold `u<token>` into the write hold `w<token>` in one
//! script once it is the only hold left; until then each attempt marks it in `…:ww` as a
//! waiting writer does (so no new read hold is granted, and a process's read hold is given
//! back at its next budget check), and the release of the last other hold wakes it alone
//! (`g<u-member>:0`). No writer gets in between: the upgradable hold excludes writers
//! until it is the write hold. A downgrade turns the write hold `w<token>` into the read
//! hold `r<token>` in one script, and says `r` when readers wait and no writer does.
//!
//! A waiting set or the nonces holding a value of another type (another program's key of
//! the same name, an operator's edit) never fails a script after it wrote (see
//! `SETS_FN`): it holds nobody, so a release frees the hold and says `r`, a hold taken
//! is kept, and a conversion is done. An attempt fails with the server's `WRONGTYPE`
//! before it writes: a read attempt reads the waiting writers first, and a waiter's mark
//! is its first write.

use std::sync::LazyLock;
use std::time::{Duration, Instant};

use redis::Cmd;

use crate::error::{Error, LostReason, Result};
use crate::proto::attempt::Attempt;
use crate::proto::keys::Keys;
use crate::proto::node::{Node, ReleaseReply, Retry, millis};
use crate::proto::scripts::{
    CLOCK_FN, END_FENCE_FN, FENCE_FN, FENCE_FORM_FN, HOLD_FENCE_FN, Lua, SETS_FN, fence_arg,
};
use crate::proto::sharded::PUBLISH_FN;
use crate::stats::Counters;

/// What a shared-hold attempt asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Want {
    Read,
    Write,
    /// One permit of a semaphore of this many permits.
    Permit(u32),
    /// The upgradable read hold: a read that excludes writers and other upgradable reads.
    Upgradable,
}

impl Want {
    /// The first byte of a hold's member in the sorted set.
    pub fn tag(self) -> char {
        match self {
            Want::Read => 'r',
            Want::Write => 'w',
            Want::Permit(_) => 'p',
            Want::Upgradable => 'u',
        }
    }

    /// The member of this kind of hold with the token of `member` (another hold's): the
    /// member an upgrade or a downgrade turns `member` into.
    pub fn member_like(self, member: &str) -> String {
        let token = member.get(1..).unwrap_or_default();
        format!("{}{token}", self.tag())
    }
}

/// Functions every shared-hold script starts with, after `CLOCK_FN`. They keep the command
/// count low: each call below is one Redis command, and scripts run on the server's one
/// thread.
const PRELUDE: &str = r"
local MARK_CHUNK = 64
-- The server's clock in milliseconds: the holds' expiries are scored in it. The same
-- reading as a fence issued by the same script (see CLOCK_FN).
local function now_ms()
  return math.floor(clock_us() / 1000)
end
-- Drops the expired holds of `key` and reads what is left: its kind ('none', 'rw', 'sem'
-- or 'other'), the stored permit count, and the first live hold (member) and its expiry,
-- if any. A key with no live hold left is deleted. The holds are read in expiry order:
-- when the first has not expired, none has, and nothing is dropped (one command).
local function load(key, now)
  local head = redis.pcall('ZRANGE', key, 0, 1, 'WITHSCORES')
  if head.err then return 'other', 0, nil end
  if #head == 0 then return 'none', 0, nil end
  local k, stored = 'other', 0
  if head[1] == '#rw' then k = 'rw' elseif head[1] == '#sem' then
    k = 'sem'
    stored = -tonumber(head[2])
  else
    return 'other', 0, nil
  end
  if head[4] and tonumber(head[4]) <= now then
    redis.call('ZREMRANGEBYSCORE', key, 0, now)
    head = redis.call('ZRANGE', key, 0, 1, 'WITHSCORES')
  end
  if #head == 2 then
    redis.call('DEL', key)
    return 'none', 0, nil
  end
  return k, stored, head[3], tonumber(head[4])
end
-- Holds `member` until `now + lease`, and keeps the key that long, no longer than its
-- longest hold: a key that outlived its holds would stand in the way of a plain lock of
-- the name (which cannot read holds in a sorted set, and takes the key for another kind).
-- Its TTL is read after the write: a read refused (an ACL without PTTL) must not fail
-- the script there, leaving a key just made without a TTL, never to expire; the key then
-- lives as long as its latest hold.
local function hold(key, member, now, lease)
  redis.call('ZADD', key, now + lease, member)
  local ttl = redis.pcall('PTTL', key)
  if type(ttl) ~= 'number' then
    local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
    redis.call('PEXPIRE', key, tonumber(last[2]) - now)
  elseif ttl < lease then
    redis.call('PEXPIRE', key, lease)
  end
end
-- Lengthens the TTL of `set` (waiting marks or their nonces) to twice `ttl` when shorter;
-- read after the set's write: a read refused (an ACL without PTTL) sets it, rather than
-- leaving a set just made without a TTL.
local function keep_marks(set, ttl)
  local left = redis.pcall('PTTL', set)
  if type(left) ~= 'number' or left < ttl then redis.call('PEXPIRE', set, 2 * ttl) end
end
-- The live member of `set` (waiting marks scored by expiry) that expires first: the one
-- renewed least lately; nil if none. Whether anyone waits; the order of waiters marked
-- by an older version of the library, which records no arrival (see `first_arrived`).
local function first_waiting(set, now)
  return tolerate({}, 'ZRANGEBYSCORE', set, now + 1, '+inf', 'LIMIT', 0, 1)[1]
end
-- The member of `set` with a live mark that came first by `arrivals` (each waiter's first
-- mark of its wait, by server time, kept by its re-marks), and its mark's expiry: the one
-- waiting longest, whatever its re-check interval; nil when no arrival has a live mark
-- (none waits, or only waiters of an older version, marked in `set` alone: the caller
-- falls back to `first_waiting`'s order). Arrivals whose mark expired or went (a crashed
-- waiter's, or one granted by an older version) are dropped on the way, at most
-- MARK_CHUNK a call; one whose mark a wake-up took keeps its place while the mark it had
-- would have lived (its nonce, negated, see `wake_first`): its next attempt marks it again.
local function first_arrived(set, arrivals, nonces, now)
  local at = 0
  for _ = 1, MARK_CHUNK do
    local a = tolerate({}, 'ZRANGE', arrivals, at, at)[1]
    if not a then return nil end
    local s = tolerate(false, 'ZSCORE', set, a)
    if s and tonumber(s) > now then return a, tonumber(s) end
    local woken = not s and nonces and tonumber(tolerate(false, 'ZSCORE', nonces, a) or 0)
    if woken and -woken > now then
      at = at + 1
    else
      redis.call('ZREM', arrivals, a)
    end
  end
  return nil
end
-- The live member of `set` waiting longest: by `arrivals` when given and live, else the
-- one whose mark expires first.
local function longest_waiting(set, now, arrivals, nonces)
  return arrivals and first_arrived(set, arrivals, nonces, now) or first_waiting(set, now)
end
-- Wakes the member of `set` waiting longest alone (`g<member>:0`) and, when `take`, takes
-- its mark out, so that the next wake-up goes to the next one; `r` (whoever waits) when
-- no mark is live, or there is no `set`. With `nonces`, a mark taken leaves its expiry
-- in place of its nonce (negated: nonces are positive), unused until its next attempt,
-- and its arrival stays: the waiter keeps its place (see `first_arrived`), and a leave
-- learns it was woken (see `WAITER_LEAVE`); should its next attempt fail, it is marked
-- again (waiters of an older version: with the expiry it had, see `SEM_ACQUIRE`).
local function wake_first(set, channel, now, take, nonces, arrivals)
  local w = set and longest_waiting(set, now, arrivals, nonces)
  if not w then
    publish(channel, 'r')
    return
  end
  if take then
    if nonces and tolerate(false, 'ZSCORE', nonces, w) then
      redis.call('ZADD', nonces, -tonumber(redis.call('ZSCORE', set, w)), w)
    end
    redis.call('ZREM', set, w)
  end
  publish(channel, 'g' .. w .. ':0')
end
-- The first live mark of `set` whose kind (its first letter) `grantable` accepts, and
-- when it expires; the marks before it (at most MARK_CHUNK: past them, the first one
-- left) are woken on `channel` with a grant of nonce 0, whose attempt finds what is
-- wrong, and taken out with their nonces, so that the waiters behind them are not left
-- for their re-checks. `strict`: an attempt's read before it writes, which a set of
-- another type fails (see `SETS_FN`). With `arrivals`, by arrival (see `first_arrived`),
-- and the marks passed over leave it too.
local function first_grantable(set, nonces, now, channel, grantable, strict, arrivals)
  local function first()
    local a, until_ = nil, nil
    if arrivals then a, until_ = first_arrived(set, arrivals, nonces, now) end
    if a then return {a, until_} end
    if strict then
      return redis.call('ZRANGEBYSCORE', set, now + 1, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
    end
    return tolerate({}, 'ZRANGEBYSCORE', set, now + 1, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
  end
  local w = first()
  local skipped = 0
  while w[1] and not grantable(string.sub(w[1], 1, 1)) and skipped < MARK_CHUNK do
    redis.call('ZREM', set, w[1])
    tolerate(0, 'ZREM', nonces, w[1])
    if arrivals then tolerate(0, 'ZREM', arrivals, w[1]) end
    publish(channel, 'g' .. w[1] .. ':0')
    skipped = skipped + 1
    w = first()
  end
  return w[1], w[2] and tonumber(w[2])
end
-- Marks `member` waiting in `set` until `now + ttl` (or until `place`, a live mark's
-- expiry it had, see `wake_first`), and drops the marks that expired
-- (their waiters crashed or gave up unheard): as many as were added, so one call each,
-- amortized. With `nonces` (the waiting writers' and readers' nonces), the expired marks'
-- nonces go too, at most MARK_CHUNK a call (a call adds one), and `nonce`, when given, is
-- stored as `member`'s latest attempt's: the one a grant tells it. The nonces live at
-- least as long as this mark: their key's TTL, like the set's, is only ever lengthened
-- (marks of another set, or of another TTL, share it; a key re-made by ZADD has none).
-- With `arrivals` (waiting writers and permit-seekers), `member`'s arrival is recorded
-- there at its wait's first mark, and kept by the marks after it (`NX`): the order a
-- release grants in (see `first_arrived`); the expired marks leave it too, and it lives as
-- long as the marks.
-- Returns whether `member` was not marked before. `set` is read (or cleaned) first with
-- `redis.call`: a set of another type fails the attempt before `mark` writes; `nonces`
-- and `arrivals` are hints (see `SETS_FN`).
local function mark(set, member, now, ttl, nonces, nonce, place, arrivals)
  if nonces then
    local dead = redis.call('ZRANGEBYSCORE', set, '-inf', now, 'LIMIT', 0, MARK_CHUNK)
    if #dead > 0 then
      redis.call('ZREM', set, unpack(dead))
      tolerate(0, 'ZREM', nonces, unpack(dead))
      if arrivals then tolerate(0, 'ZREM', arrivals, unpack(dead)) end
    end
  else
    redis.call('ZREMRANGEBYSCORE', set, '-inf', now)
  end
  local new = redis.call('ZADD', set, place or now + ttl, member) == 1
  keep_marks(set, ttl)
  if arrivals and tolerate(false, 'ZADD', arrivals, 'NX', now, member) then
    keep_marks(arrivals, ttl)
  end
  if nonce and tolerate(false, 'ZADD', nonces, nonce, member) then keep_marks(nonces, ttl) end
  return new
end
";

/// What the scripts that end a hold of a read-write lock or a semaphore do next, after
/// the fence helpers and [`PRELUDE`]: who is told, and (the write hold) who is given it.
///
/// KEYS: lock, waiting writers, waiting readers, fence counter, nonces; for a semaphore:
/// lock, waiting permit-seekers, nonces (or the lock alone, the narrow call). ARGV: member, channel,
/// fence, grant lease ms, fence counter TTL ms, publish mode.
///
/// `pass_on(ended, now, released)`, after the hold `ended` was taken out of the key: a
/// permit is granted to the permit-seeker waiting longest (`grant_permit`, or woken when it
/// cannot be); the last hold of a read-write lock grants the write hold to the writer
/// waiting longest (`grant_first`), or says `r`; of a read-write lock whose holds remain,
/// an upgradable hold left alone and waiting to upgrade is woken, and the end of an
/// upgradable hold says `r` to the readers it held back. `released`: the fence of a write
/// hold that ended by its release, whose counter is not marked released yet: when the write
/// hold is granted on, issuing the grant's fence marks the counter in the same `SET`
/// (`next_fence`, told that nothing was lost), else `end_fence` marks it released. `0`:
/// an attempt nobody used, given back: a writer granted is told what that attempt was.
///
/// `grant_first(now, released)`: the write hold of a read-write lock that has no live hold
/// goes to the writer waiting longest, as the fair queue's grant does (see
/// `fair_scripts`): its member is held for the grant lease, the counter issues its fence,
/// its mark and nonce go, and `g<member>:<nonce>:<fence>:<grant ms>` tells it, with the
/// nonce of its latest attempt (`0` when it has none, or when the write hold before ended
/// without a release: only a wake-up, whose confirming attempt tells of the loss). An
/// upgrade waiting (an upgradable member marked as a writer, whose hold is gone: no hold
/// is live) is woken and its mark taken out, and the grant goes to the next waiting.
/// Returns whether it wrote holds into the key (the key, left with no live hold,
/// is deleted only when it did not: a grant would write it again at once), and whether it
/// issued a write grant's fence (which marked `released`'s counter).
const PASS_ON: &str = r"
-- The key of a read-write lock with no live hold (or none at all) made to hold `members`
-- for `ms`.
local function grant_holds(members, now, ms)
  local args = {}
  for i, m in ipairs(members) do
    args[2 * i - 1] = now + ms
    args[2 * i] = m
  end
  redis.call('ZADD', KEYS[1], -1, '#rw', unpack(args))
  redis.call('PEXPIRE', KEYS[1], ms)
end
-- The nonces of `members`' latest attempts (nil when lost or unknown), taken out of
-- `nonces` with their marks of `set` (and their arrivals, when `arrivals`). Read after the
-- grant's holds were written: a read refused (an ACL without ZMSCORE) leaves them
-- unknown: the grants go out as wake-ups, whose attempts find the holds theirs, rather
-- than the release failing half-way.
local function take_nonces(set, nonces, members, lost, arrivals)
  redis.call('ZREM', set, unpack(members))
  if arrivals then tolerate(0, 'ZREM', arrivals, unpack(members)) end
  local found = redis.pcall('ZMSCORE', nonces, unpack(members))
  tolerate(0, 'ZREM', nonces, unpack(members))
  if lost or found.err then return {} end
  return found
end
-- One grant message: `nonce` '0' (none) makes it a wake-up whose attempt confirms it.
-- Written out whole: Lua's own number-to-string keeps 14 digits, a fence has 16.
local function tell_grant(member, nonce, fence, ms)
  nonce = nonce and string.format('%.0f', tonumber(nonce)) or '0'
  publish(ARGV[2], 'g' .. member .. ':' .. nonce .. ':' .. string.format('%.0f', fence) .. ':' .. ms)
end
local function grant_first(now, released)
  local grant_ms = tonumber(ARGV[4])
  -- An upgrade's mark, with no hold left here to upgrade (its upgrader crashed, or gave
  -- up unheard): its upgrader, if alive, is told (its next attempt finds its hold gone),
  -- and the grant goes on to the next waiting. So does a permit-seeker's mark left from
  -- when the name was a semaphore (its attempt finds the other kind).
  local w = first_grantable(KEYS[2], KEYS[5], now, ARGV[2], function(kind)
    return kind ~= 'u' and kind ~= 'p'
  end, false, KEYS[6])
  if not w then
    -- No writer waits: the readers that marked themselves waiting get read holds, in
    -- one call each for all of them (an upgradable read, or a waiter with no mark, is
    -- told `r`).
    local marked = tolerate({}, 'ZRANGEBYSCORE', KEYS[3], now + 1, '+inf', 'LIMIT', 0, MARK_CHUNK)
    local readers, others = {}, #marked == 0
    for _, r in ipairs(marked) do
      if string.sub(r, 1, 1) == 'r' then readers[#readers + 1] = r else others = true end
    end
    if #readers > 0 then
      grant_holds(readers, now, grant_ms)
      local nonces = take_nonces(KEYS[3], KEYS[5], readers, false)
      local fence = current_fence(KEYS[4])
      for i, r in ipairs(readers) do tell_grant(r, nonces[i], fence, grant_ms) end
    end
    -- A full chunk may leave readers marked beyond it: `r` sends them to try, as they
    -- would get in beside the readers granted (no writer waits).
    if others or #marked == MARK_CHUNK then publish(ARGV[2], 'r') end
    return #readers > 0, false
  end
  if string.sub(w, 1, 1) ~= 'w' then
    -- A member of no kind a script writes (an operator's edit): woken, as it came first.
    publish(ARGV[2], 'g' .. w .. ':0')
    return false, false
  end
  -- After a write hold released, the writer granted is told nothing was lost (the counter
  -- still says held: the release left its mark to this `next_fence`). After an attempt
  -- nobody used given back ('0'), what that attempt was told, as the fair queue's grant
  -- does (`grant_lost`): the hold given back changed nothing.
  local after_lost = nil
  if released == '0' then
    local _, held, was_lost = fence_read(redis.pcall('GET', KEYS[4]))
    after_lost = held and was_lost
  elseif released then
    after_lost = false
  end
  local fence, lost = next_fence(KEYS[4], ARGV[5], after_lost)
  if type(fence) == 'table' then
    -- The counter cannot be written (a key of another type): a wake-up, whose attempt
    -- reports the error.
    publish(ARGV[2], 'g' .. w .. ':0')
    return false, false
  end
  grant_holds({w}, now, grant_ms)
  tell_grant(w, take_nonces(KEYS[2], KEYS[5], {w}, lost, KEYS[6])[1], fence, grant_ms)
  return true, true
end
-- Keeps the key, whose holds `left` are live, as long as its longest live hold, no longer
-- (see `hold`, which only lengthens it): the hold that ended may be the one that set its
-- TTL, and a key left with expired holds alone stands in the way of a plain lock.
local function fit(left, now)
  if not left[1] then return end
  local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
  redis.call('PEXPIRE', KEYS[1], tonumber(last[2]) - now)
end
-- A permit freed: granted to the permit-seeker waiting longest (KEYS[2] its mark, KEYS[3]
-- the nonces, KEYS[4] the arrivals), held for the grant lease, when the semaphore has a
-- permit free (its count is the kind member's); else, or without the sets (the narrow
-- call), the wake-up of old.
local function grant_permit(now)
  -- A mark of another kind's waiter (a writer left waiting when the name became a
  -- semaphore) is never granted a permit: it would take the permit for its own hold, with
  -- the count for a fence. It is woken and passed over.
  local w = KEYS[3] and first_grantable(KEYS[2], KEYS[3], now, ARGV[2], function(kind)
    return kind == 'p'
  end, false, KEYS[4])
  local sem = w and string.sub(w, 1, 1) == 'p' and redis.call('ZSCORE', KEYS[1], '#sem')
  -- Counted after the ended hold was taken out: a count refused (an ACL without ZCOUNT)
  -- wakes the waiter, whose attempt takes the free permit, rather than failing half-way.
  local live = sem and redis.pcall('ZCOUNT', KEYS[1], now + 1, '+inf')
  if not sem or type(live) ~= 'number' or live >= -tonumber(sem) then
    wake_first(KEYS[2], ARGV[2], now, true, KEYS[3], KEYS[4])
    return false
  end
  local grant_ms = tonumber(ARGV[4])
  hold(KEYS[1], w, now, grant_ms)
  -- The key may still have the TTL of the permit that ended (a lease): it goes with the
  -- grant, should its grantee never take it, unless other holds live longer.
  fit({w}, now)
  -- The count where a write grant's fence would be: a waiter that asked for another
  -- count takes the grant for a wake-up, and its attempt is told of the mismatch.
  tell_grant(w, take_nonces(KEYS[2], KEYS[3], {w}, false, KEYS[4])[1], -tonumber(sem), grant_ms)
  return true
end
local function pass_on(ended, now, released)
  local permit = string.sub(ended, 1, 1) == 'p'
  -- The kind member's score is negative: a live hold is scored after now.
  local left = redis.call('ZRANGEBYSCORE', KEYS[1], now + 1, '+inf', 'LIMIT', 0, 2)
  fit(left, now)
  if permit then
    -- The waiter waiting longest: the first to arrive, whose mark goes (the next
    -- release grants to, or wakes, the next one).
    if not grant_permit(now) and not left[1] then redis.call('DEL', KEYS[1]) end
    return
  end
  if not KEYS[2] then
    -- The narrower call (a Redis Cluster slot half-way through a migration serves the
    -- lock key alone): no mark is read, whoever waits tries; a write hold's counter stays
    -- held (the next writer is told of a loss, erring on the side of caution).
    if not left[1] then redis.call('DEL', KEYS[1]) end
    publish(ARGV[2], 'r')
    return
  end
  -- Whether a write grant's fence marked the released write hold's counter.
  local marked = false
  if not left[1] then
    local wrote
    wrote, marked = grant_first(now, released)
    if not wrote then redis.call('DEL', KEYS[1]) end
  elseif not left[2] and string.sub(left[1], 1, 1) == 'u'
      and tonumber(tolerate(false, 'ZSCORE', KEYS[2], left[1]) or 0) > now then
    publish(ARGV[2], 'g' .. left[1] .. ':0')
  elseif string.sub(ended, 1, 1) == 'u' and first_waiting(KEYS[3], now) then
    publish(ARGV[2], 'r')
  end
  if released and not marked then end_fence(KEYS[4], released) end
end
";

fn lua(body: &str) -> Lua {
    Lua::new(&format!("{PUBLISH_FN}{CLOCK_FN}{SETS_FN}{PRELUDE}{body}"))
}

/// [`lua`], for a script that also issues, reads or releases the fence counter.
fn fenced(body: &str) -> Lua {
    Lua::new(&format!(
        "{PUBLISH_FN}{FENCE_FORM_FN}{CLOCK_FN}{FENCE_FN}{HOLD_FENCE_FN}{END_FENCE_FN}{SETS_FN}{PRELUDE}{body}"
    ))
}

/// [`fenced`], for a script that ends a hold (see [`PASS_ON`]).
fn ending(body: &str) -> Lua {
    fenced(&format!("{PASS_ON}{body}"))
}

/// Read, write or upgradable read hold, idempotently (a retry with the same member
/// refreshes its lease).
///
/// KEYS: lock, fence, waiting writers, waiting readers, writer nonces, waiting writers'
/// arrivals. ARGV: `r`, `w` or
/// `u`, member, lease ms, waiting mark TTL ms (0: the caller will not wait), the fence
/// counter's TTL ms, the attempt's nonce (a waiting writer's is stored with its mark, and
/// told by a grant, see [`PASS_ON`]), `1` if an earlier attempt of the same wait may have
/// marked it (a hold won then takes its mark and nonce out), the library's channel, the client's
/// id (a failed write attempt that will wait says `c<client id>` on the channel, so that
/// the processes holding read holds give them back), the publish mode. Returns `{1, fence, others, after lost}` (`others`: for a write hold, 1 when a mark
/// of another waiting writer or reader is left, maybe an expired one; `after lost`: for a
/// write hold, 1 when the write hold before ended without a release, see `FENCE_FN`; both
/// always 0 for a read or upgradable hold), `{0, ms until the earliest obstacle ends}`
/// (−1: unknown), or `{2, 0}` when the key is another kind of lock.
///
/// A read is granted when no write hold exists and no writer waits; an upgradable read
/// when, besides, no other upgradable hold exists (found by reading the live holds: only
/// its attempts pay for that); a write when no hold exists (waiting writers race among
/// themselves, or the release of the last hold grants it to the one waiting longest). A
/// write attempt that fails and will wait marks the writer as waiting until the mark's
/// TTL, which it renews at each attempt, with its nonce; a read or upgradable attempt that
/// fails and will wait marks a waiting reader the same way. A write attempt that finds its
/// own member held (granted to it, or taken by an earlier attempt whose reply was lost)
/// holds it, with the fence the counter has.
static RW_ACQUIRE: LazyLock<Lua> = LazyLock::new(|| {
    fenced(
        r"
local now = now_ms()
local k, _, first, until_ = load(KEYS[1], now)
if k ~= 'none' and k ~= 'rw' then return {2, 0} end
local lease = tonumber(ARGV[3])
local waits = ARGV[4] ~= '0'
local function take()
  if k == 'none' then
    redis.call('ZADD', KEYS[1], -1, '#rw', now + lease, ARGV[2])
    redis.call('PEXPIRE', KEYS[1], lease)
  else
    hold(KEYS[1], ARGV[2], now, lease)
  end
end
-- Whether somebody else may wait, asked for a write hold only (one command: a mark left
-- by a waiter that has gone only costs its process a shorter turn). Asked after the hold
-- was taken: refused (an ACL without EXISTS), somebody may wait, and the hold stands.
local function others()
  if ARGV[1] == 'r' or redis.pcall('EXISTS', KEYS[3], KEYS[4]) == 0 then return 0 end
  return 1
end
-- A retry whose earlier attempt took the hold (its reply was lost) finds it: the write
-- hold is then the only hold; a read hold is looked for only when it could not be taken.
if first == ARGV[2] and ARGV[1] == 'w' then
  take()
  local fence, after_lost = hold_fence(KEYS[2])
  return {1, fence, others(), after_lost and 1 or 0}
end
if ARGV[1] ~= 'w' then
  -- A permit-seeker's mark left from when the name was a semaphore holds no reader back,
  -- as a writer's would: it is woken (its attempt finds the other kind) and goes.
  local w, w_until = first_grantable(KEYS[3], KEYS[5], now, ARGV[8], function(kind)
    return kind ~= 'p'
  end, true)
  -- A write hold is the only hold: when it exists, it is the first.
  local free = (not first or string.sub(first, 1, 1) ~= 'w') and not w
  if free and ARGV[1] == 'u' then
    -- One upgradable hold at a time: when another one's ends, if there is one.
    local holds = redis.call('ZRANGEBYSCORE', KEYS[1], now + 1, '+inf', 'WITHSCORES')
    for i = 1, #holds, 2 do
      if string.sub(holds[i], 1, 1) == 'u' and holds[i] ~= ARGV[2] then
        free = false
        until_ = tonumber(holds[i + 1])
        break
      end
    end
  end
  if free or (first and redis.call('ZSCORE', KEYS[1], ARGV[2])) then
    take()
    if ARGV[7] == '1' and tolerate(0, 'ZREM', KEYS[4], ARGV[2]) == 1 then
      tolerate(0, 'ZREM', KEYS[5], ARGV[2])
    end
    return {1, current_fence(KEYS[2]), 0, 0}
  end
  if waits then
    -- A reader's nonce, for a grant of a read hold; an upgradable read gets none.
    local nonce = ARGV[1] == 'r' and ARGV[6] or nil
    mark(KEYS[4], ARGV[2], now, tonumber(ARGV[4]), KEYS[5], nonce)
  end
  if w_until and (not until_ or w_until < until_) then until_ = w_until end
elseif not first then
  -- The fence before the hold: a failed SET leaves nothing to undo (unlike the plain
  -- lock's `take_fenced`, whose SET NX is its test of a free lock).
  local fence, after_lost = next_fence(KEYS[2], ARGV[5])
  if type(fence) == 'table' then return fence end
  take()
  if ARGV[7] == '1' and tolerate(0, 'ZREM', KEYS[3], ARGV[2]) == 1 then
    tolerate(0, 'ZREM', KEYS[5], ARGV[2])
    tolerate(0, 'ZREM', KEYS[6], ARGV[2])
  end
  return {1, fence, others(), after_lost and 1 or 0}
elseif waits then
  -- A writer that begins to wait is heard by the processes that hold read holds: they
  -- give them back at once (a process that missed it learns at its next budget check).
  if mark(KEYS[3], ARGV[2], now, tonumber(ARGV[4]), KEYS[5], ARGV[6], nil, KEYS[6]) then
    publish(ARGV[8], 'c' .. ARGV[9])
  end
end
if not until_ then return {0, -1} end
return {0, until_ - now}
",
    )
});

/// Turns the upgradable hold into the write hold once it is the only hold, idempotently
/// (a retry whose earlier attempt upgraded finds the write hold and refreshes its lease).
///
/// KEYS: lock, fence, waiting writers, writer nonces (the marks that expired drop theirs),
/// waiting writers' arrivals.
/// ARGV: the upgradable member, the write member (the same token), lease ms, waiting mark TTL ms (0: the caller will not wait), the fence
/// counter's TTL ms. Returns `{1, fence, 0, after lost}` (the write hold is ours, with a
/// fence of its own, as any write hold's, and whether the write hold before it ended
/// without a release, see `FENCE_FN`), `{0, ms until the first other hold's lease ends}`, `{2, 0}` when
/// the key is another kind of lock, or `{4, 0}` when the upgradable hold is gone (expired
/// or deleted: there is nothing to upgrade).
///
/// While other holds remain, an attempt that will wait marks the upgradable member as a
/// waiting writer: no new read hold is granted meanwhile, and the release of the last other
/// hold wakes it (see `SHARED_RELEASE`).
static RW_UPGRADE: LazyLock<Lua> = LazyLock::new(|| {
    fenced(
        r"
local now = now_ms()
local k, _, first = load(KEYS[1], now)
if k ~= 'none' and k ~= 'rw' then return {2, 0} end
local lease = tonumber(ARGV[3])
-- The write hold is the only hold: when it is ours, it is the first.
if first == ARGV[2] then
  hold(KEYS[1], ARGV[2], now, lease)
  local fence, after_lost = hold_fence(KEYS[2])
  return {1, fence, 0, after_lost and 1 or 0}
end
if not (first and redis.call('ZSCORE', KEYS[1], ARGV[1])) then return {4, 0} end
-- The first two live holds: ours alone, or the first other one and when it ends.
local two = redis.call('ZRANGEBYSCORE', KEYS[1], now + 1, '+inf', 'WITHSCORES', 'LIMIT', 0, 2)
if #two == 2 then
  local fence, after_lost = next_fence(KEYS[2], ARGV[5])
  if type(fence) == 'table' then return fence end
  redis.call('ZREM', KEYS[1], ARGV[1])
  hold(KEYS[1], ARGV[2], now, lease)
  tolerate(0, 'ZREM', KEYS[3], ARGV[1])
  tolerate(0, 'ZREM', KEYS[5], ARGV[1])
  return {1, fence, 0, after_lost and 1 or 0}
end
if ARGV[4] ~= '0' then mark(KEYS[3], ARGV[1], now, tonumber(ARGV[4]), KEYS[4], nil, nil, KEYS[5]) end
local other = two[2]
if two[1] == ARGV[1] then other = two[4] end
return {0, tonumber(other) - now}
",
    )
});

/// Turns the write hold into a read hold with the same token, in one step: no writer gets
/// in between. Idempotent: a retry whose earlier attempt downgraded finds the read hold.
///
/// KEYS: lock, waiting writers, waiting readers, fence counter. ARGV: the write member,
/// the read member, lease ms, the library's channel, the write hold's fence, the publish
/// mode. Returns 1 downgraded, 0 the write hold had expired or was gone, −1 the key is
/// another kind of lock. The write hold ends cleanly, so the counter is marked released
/// (see `END_FENCE_FN`): the next writer is not told of a loss. Publishes `r` when readers
/// wait and no writer does: they may join now.
static RW_DOWNGRADE: LazyLock<Lua> = LazyLock::new(|| {
    fenced(
        r"
local s = redis.pcall('ZSCORE', KEYS[1], ARGV[1])
if type(s) == 'table' and s.err then return -1 end
local now = now_ms()
if not s or tonumber(s) <= now then
  local r = redis.call('ZSCORE', KEYS[1], ARGV[2])
  if r and tonumber(r) > now then return 1 end
  return 0
end
redis.call('ZREM', KEYS[1], ARGV[1])
hold(KEYS[1], ARGV[2], now, tonumber(ARGV[3]))
end_fence(KEYS[4], ARGV[5])
if first_waiting(KEYS[3], now) and not first_waiting(KEYS[2], now) then
  publish(ARGV[4], 'r')
end
return 1
",
    )
});

/// One permit, idempotently.
///
/// KEYS: lock, and the waiting permit-seekers, their nonces and their arrivals when the
/// caller waits or waited (see `Keys::permit_waiters`; a call without them names one key, which a Redis
/// Cluster slot half-way through a migration still serves). ARGV: member, lease ms,
/// permits, waiting mark TTL ms (0: the caller will not wait), the attempt's nonce (stored
/// with its mark, and told by a grant of a permit, see [`PASS_ON`]). Returns `{1, 0}`, `{0, ms until the earliest
/// permit's lease ends}`, `{2, 0}` for another kind of lock, or `{3, stored}` when the
/// current holders use another permit count.
///
/// An attempt that fails and will wait marks the member waiting until the mark's TTL, as a
/// waiting writer does (each attempt renews it), so that a release grants it a permit
/// alone when its turn comes (an attempt woken by a release that had no permit to grant,
/// which took its mark, marks it again in the place it had, see `wake_first`); one that succeeds takes its mark (and its nonce) out, so
/// that no release grants to a holder.
static SEM_ACQUIRE: LazyLock<Lua> = LazyLock::new(|| {
    lua(r"
local now = now_ms()
local k, stored, first = load(KEYS[1], now)
if k ~= 'none' and k ~= 'sem' then return {2, 0} end
local permits = tonumber(ARGV[3])
if first and stored ~= permits then return {3, stored} end
local n = 0
if first then n = redis.call('ZCARD', KEYS[1]) - 1 end
if n < permits or (first and redis.call('ZSCORE', KEYS[1], ARGV[1])) then
  if not first then redis.call('ZADD', KEYS[1], -permits, '#sem') end
  hold(KEYS[1], ARGV[1], now, tonumber(ARGV[2]))
  -- Its mark, and its nonce and arrival, which outlive the mark a wake-up took.
  if KEYS[2] then
    tolerate(0, 'ZREM', KEYS[2], ARGV[1])
    tolerate(0, 'ZREM', KEYS[3], ARGV[1])
    tolerate(0, 'ZREM', KEYS[4], ARGV[1])
  end
  return {1, 0}
end
if KEYS[2] and ARGV[4] ~= '0' then
  -- Woken with no permit to take, its mark taken and its expiry left with its nonce (see
  -- `wake_first`): it is marked again with the expiry it had, while that mark would live
  -- past its next attempt (due within half a mark's TTL, its re-check interval), so that
  -- a release of an older version of the library, which orders marks by expiry, finds it
  -- in its place; its arrival, which orders them here, was kept.
  local kept = -tonumber(tolerate(false, 'ZSCORE', KEYS[3], ARGV[1]) or 0)
  local place = nil
  if kept > now + tonumber(ARGV[4]) / 2 then place = kept end
  mark(KEYS[2], ARGV[1], now, tonumber(ARGV[4]), KEYS[3], ARGV[5], place, KEYS[4])
end
return {0, tonumber(redis.call('ZSCORE', KEYS[1], first)) - now}
")
});

/// Ends a hold.
///
/// KEYS: lock; for a permit, the waiting permit-seekers, their nonces and their arrivals
/// (left out by the narrower form of the call, see `Node::release_shared`); for a
/// read-write lock its waiting writers and readers, its fence counter, its writer nonces
/// and the writers' arrivals. ARGV: member, the library's channel,
/// the holder's fence (a write hold's, see `end_fence` of `END_FENCE_FN`; `0` for other
/// holds, or a write attempt nobody used), the grant lease ms, the fence counter's TTL
/// ms, the publish mode. Returns 1 released, 0 the hold had expired or was gone, −1 the
/// key is another kind of lock. An upgradable hold that is gone because a late upgrade of
/// it turned it into the write hold of its token gives that write hold back instead. A write hold released before it expired marks the counter
/// released, or, when the write hold is granted on, the grant's fence is issued as after a
/// release (one `SET` of the counter, see [`PASS_ON`]).
///
/// Then [`PASS_ON`]: a permit freed is granted to the permit-seeker waiting longest, whose
/// mark goes with it (a second release grants to the next one, not the same one twice), or
/// woken as before when it cannot be (see `grant_permit`). The last hold of a read-write
/// lock ended: the write hold is granted to the writer waiting longest, or read holds to
/// the readers waiting when no writer does, or `r` when none waits. Of a read-write lock
/// whose holds remain: when the one left is an upgradable hold waiting to upgrade,
/// `g<member>:0` for it alone; when the hold that ended was the upgradable one and readers
/// wait (a waiting upgradable read marks itself so), `r`.
static SHARED_RELEASE: LazyLock<Lua> = LazyLock::new(|| {
    ending(
        r"
local s = redis.pcall('ZSCORE', KEYS[1], ARGV[1])
if type(s) == 'table' and s.err then return -1 end
local now = now_ms()
local unmarked = false
if string.sub(ARGV[1], 1, 1) == 'u' and KEYS[2] then
  -- An upgrade of this hold whose first send landed after its wait ended (its mark taken
  -- out) may have marked it waiting again: the mark goes with the hold, or it would hold
  -- new readers back for nobody. The readers it held back hear of it (`pass_on`, or here
  -- when there is no hold to end).
  unmarked = tolerate(0, 'ZREM', KEYS[2], ARGV[1]) == 1
  if KEYS[5] then tolerate(0, 'ZREM', KEYS[5], ARGV[1]) end
  if KEYS[6] then tolerate(0, 'ZREM', KEYS[6], ARGV[1]) end
end
if not s and string.sub(ARGV[1], 1, 1) == 'u' then
  -- An upgrade of this hold whose first send landed after its wait ended turned it into
  -- the write hold of the same token, which nobody uses: it goes with the upgradable
  -- hold, as a write attempt nobody used.
  local turned = 'w' .. string.sub(ARGV[1], 2)
  if redis.call('ZSCORE', KEYS[1], turned) then
    redis.call('ZREM', KEYS[1], turned)
    if KEYS[4] then end_fence(KEYS[4], '0') end
    pass_on(turned, now, nil)
    unmarked = false
  end
end
if not s then
  if unmarked then publish(ARGV[2], 'r') end
  return 0
end
redis.call('ZREM', KEYS[1], ARGV[1])
local live = tonumber(s) > now
-- A write hold released in time: its counter is marked released by what comes next.
local released = nil
if live and KEYS[4] and string.sub(ARGV[1], 1, 1) == 'w' then released = ARGV[3] end
pass_on(ARGV[1], now, released)
if live then return 1 end
return 0
",
    )
});

/// A waiting writer, reader or permit-seeker gives up: its mark and nonce go, and a grant
/// that raced its leaving is passed on (the write hold as an attempt nobody used: the
/// counter keeps what the hold before it left, see `end_fence` of `END_FENCE_FN`); else a
/// writer's leaving tells the readers it held back (`r`), and a permit-seeker whose mark a
/// release took to wake it passes the wake-up on. A permit granted to it that lapsed
/// before it was taken is passed on too: nobody else was told it is free.
///
/// KEYS and ARGV: those of [`SHARED_RELEASE`] (the fence is unused): for a read-write lock
/// lock, writers, readers, fence counter, nonces, arrivals; for a semaphore lock,
/// permit-seekers, nonces, arrivals.
/// Returns 2 a grant to it was passed on, 0 otherwise, −1 the key is another kind of lock.
static WAITER_LEAVE: LazyLock<Lua> = LazyLock::new(|| {
    ending(
        r"
-- Whether the semaphore has a permit free: no key (every permit), or fewer live holds than
-- its stored count (the expired ones dropped first).
local function permit_free(now)
  local k, stored = load(KEYS[1], now)
  return k == 'none' or (k == 'sem' and redis.call('ZCARD', KEYS[1]) - 1 < stored)
end
local tag = string.sub(ARGV[1], 1, 1)
local permit = tag == 'p'
local nonces, arrivals = KEYS[5], KEYS[6]
if permit then nonces, arrivals = KEYS[3], KEYS[4] end
local s = redis.pcall('ZSCORE', KEYS[1], ARGV[1])
if type(s) == 'table' and s.err then return -1 end
-- The narrower call names the lock key alone (see `pass_on`): the mark, nonce and arrival
-- expire.
local noted = nonces and tolerate(0, 'ZREM', nonces, ARGV[1]) == 1
if arrivals then tolerate(0, 'ZREM', arrivals, ARGV[1]) end
local now = now_ms()
if s and tonumber(s) > now then
  redis.call('ZREM', KEYS[1], ARGV[1])
  if tag == 'w' and KEYS[4] then end_fence(KEYS[4], '0') end
  pass_on(ARGV[1], now, nil)
  return 2
end
if permit and s then
  -- A permit granted to it (or taken by an attempt whose reply was lost) that lapsed
  -- unused: nobody was told it is free, and the others sleep until their re-checks. It
  -- goes on now, as a release's would.
  redis.call('ZREM', KEYS[1], ARGV[1])
  pass_on(ARGV[1], now, nil)
  return 2
end
if not KEYS[2] then return 0 end
if permit then
  -- A mark gone while its nonce is still here was taken by a release that woke this
  -- waiter (with no permit to grant: a wake-up takes the mark, not the nonce): the
  -- wake-up goes on to the next one, so that a freed permit is never left for the
  -- re-checks. No nonce: this waiter never marked, or this is the leave sent again after
  -- its first run (whose reply was lost) took both, or a release granted it a permit
  -- (taking both) that lapsed unused, dropped since by another script, or gone with the
  -- key (which goes with its last hold), which another holder may have made again. When
  -- a permit is free, nobody was told of it: the next waiter is woken, as it would be
  -- for the lapsed grant; else nothing is owed, and the next waiter keeps its place.
  if tolerate(0, 'ZREM', KEYS[2], ARGV[1]) == 0 then
    if noted or (permit_free(now) and first_waiting(KEYS[2], now)) then
      wake_first(KEYS[2], ARGV[2], now, true, nonces, arrivals)
    end
  end
  return 0
end
local set = KEYS[3]
if tag == 'w' then set = KEYS[2] end
if tolerate(0, 'ZREM', set, ARGV[1]) == 1 then publish(ARGV[2], 'r') end
return 0
",
    )
});

/// Renews many holds of one node in one round trip.
///
/// KEYS: lock keys. ARGV: lease ms, then one member per key. Returns one status per key:
/// 1 extended, 0 the hold had expired or was gone (never revived), −1 another kind of lock.
///
/// Unlike the lock's `EXTEND`, renewals are not numbered: a shared hold keeps the client's
/// lease for life (nothing extends it to another), so a renewal delayed on the way sets a
/// later expiry than any sent before it, never an earlier one.
pub(crate) static SHARED_EXTEND: LazyLock<Lua> = LazyLock::new(|| {
    lua(r"
local now = now_ms()
local lease = tonumber(ARGV[1])
local out = {}
for i = 1, #KEYS do
  local s = redis.pcall('ZSCORE', KEYS[i], ARGV[i + 1])
  if type(s) == 'table' and s.err then
    out[i] = -1
  elseif s and tonumber(s) > now then
    -- The key's TTL (only ever lengthened) before the hold's expiry: a server out of
    -- memory refuses a script's first write that may take memory (`ZADD`), never a
    -- `PEXPIRE`, nor any write after one, so holds are renewed while it is full, as
    -- locks are.
    redis.call('PEXPIRE', KEYS[i], math.max(redis.call('PTTL', KEYS[i]), lease))
    redis.call('ZADD', KEYS[i], now + lease, ARGV[i + 1])
    out[i] = 1
  else
    out[i] = 0
  end
end
return out
")
});

/// May a process go on letting its own threads take turns on its hold? Yes (1) while the
/// hold is live and nobody else waits: no writer for a read hold, no writer or reader for
/// the write hold (a permit-seeker's mark left from when the name was a semaphore is no
/// writer); no (0) otherwise. Cheap on purpose: a process asks once per budget of
/// local turns.
///
/// KEYS: lock, waiting writers, waiting readers. ARGV: member, `r` or `w`.
static RW_KEEP: LazyLock<Lua> = LazyLock::new(|| {
    lua(r"
local now = now_ms()
local s = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not s or tonumber(s) <= now then return 0 end
if ARGV[2] == 'w' and first_waiting(KEYS[3], now) then return 0 end
-- A permit-seeker's mark left from when the name was a semaphore waits for no hold of
-- this kind (its attempt finds the other kind): only the other marks count. Past a chunk
-- of such marks, somebody may wait.
local marks = tolerate({}, 'ZRANGEBYSCORE', KEYS[2], now + 1, '+inf', 'LIMIT', 0, MARK_CHUNK)
for _, m in ipairs(marks) do
  if string.sub(m, 1, 1) ~= 'p' then return 0 end
end
if #marks == MARK_CHUNK then return 0 end
return 1
")
});

/// A waiter gives up: removes its mark (and a writer's arrival), and (a writer's) wakes
/// the readers it held back.
///
/// KEYS: waiting writers and their arrivals, or waiting readers. ARGV: member, the
/// library's channel, the publish mode.
static WAITER_UNMARK: LazyLock<Lua> = LazyLock::new(|| {
    lua(r"
if KEYS[2] then tolerate(0, 'ZREM', KEYS[2], ARGV[1]) end
if tolerate(0, 'ZREM', KEYS[1], ARGV[1]) == 1 then publish(ARGV[2], 'r') end
return 0
")
});

/// One attempt at a shared hold, or at an upgrade, as the contest makes it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SharedAttempt<'a> {
    pub keys: &'a Keys,
    /// The hold's member (its tag and token); an upgrade's: the upgradable hold's.
    pub member: &'a str,
    pub lease: Duration,
    /// The caller will wait: a failed attempt marks it waiting for this long.
    pub mark_ttl: Option<Duration>,
    /// An earlier attempt of the same wait may have marked it: a hold won takes the mark
    /// (and a reader's or writer's nonce) out; an attempt that never marked pays nothing
    /// for it.
    pub clear: bool,
    /// Sent again with the same member after an ambiguous failure, as this says.
    pub retry: Retry,
    /// The attempt's nonce (see `RW_ACQUIRE`).
    pub nonce: u64,
    pub deadline: Option<Instant>,
}

impl Node {
    /// One attempt at a shared hold of `want` (see [`SharedAttempt`]).
    pub fn acquire_shared(&self, want: Want, at: SharedAttempt<'_>) -> Result<Attempt> {
        let (keys, member) = (at.keys, at.member);
        let lease_ms = millis(at.lease);
        let mark_ms = at.mark_ttl.map_or(0, millis);
        match want {
            Want::Read | Want::Write | Want::Upgradable => {
                let publish = self.publish_mode(at.deadline)?;
                // Tags are ASCII: one byte each.
                let tag = [want.tag() as u8];
                let call = |clear: bool| {
                    let mut call = RW_ACQUIRE.call(6);
                    call.arg(keys.lock())
                        .arg(keys.fence())
                        .arg(keys.writers())
                        .arg(keys.readers())
                        .arg(keys.writer_nonces())
                        .arg(keys.arrivals())
                        .arg(&tag[..])
                        .arg(member)
                        .arg(lease_ms)
                        .arg(mark_ms)
                        .arg(self.fence_ttl_ms())
                        .arg(at.nonce)
                        .arg(if clear { "1" } else { "0" })
                        .arg(keys.channel())
                        .arg(self.client_id())
                        .arg(publish);
                    call
                };
                // A first send that may have run, failed and marked us waiting: a retry
                // that wins takes the mark out, or the release of our hold would grant
                // it to us again (the mark the oldest), to nobody.
                let again = || call(true);
                let again: Option<&dyn Fn() -> Cmd> =
                    (!at.clear && at.mark_ttl.is_some()).then_some(&again);
                self.shared_attempt(&RW_ACQUIRE, (&call(at.clear), again), want, at)
            }
            Want::Permit(permits) => {
                // The waiting set only when the attempt may mark or unmark: a `try_acquire`
                // names one key. A permit won always takes its own mark out.
                let marks = at.mark_ttl.is_some() || at.clear;
                let mut call = SEM_ACQUIRE.call(if marks { 4 } else { 1 });
                call.arg(keys.lock());
                if marks {
                    call.arg(keys.permit_waiters())
                        .arg(keys.writer_nonces())
                        .arg(keys.arrivals());
                }
                call.arg(member)
                    .arg(lease_ms)
                    .arg(permits)
                    .arg(mark_ms)
                    .arg(at.nonce);
                self.shared_attempt(&SEM_ACQUIRE, (&call, None), want, at)
            }
        }
    }

    /// One attempt at turning the upgradable hold `at.member` into the write hold of the
    /// same token; a failed attempt that will wait marks it waiting, as a writer.
    /// [`Error::Lost`] when the upgradable hold is gone.
    pub fn upgrade_shared(&self, at: SharedAttempt<'_>) -> Result<Attempt> {
        let (keys, member) = (at.keys, at.member);
        let mut call = RW_UPGRADE.call(5);
        call.arg(keys.lock())
            .arg(keys.fence())
            .arg(keys.writers())
            .arg(keys.writer_nonces())
            .arg(keys.arrivals())
            .arg(member)
            .arg(Want::Write.member_like(member))
            .arg(millis(at.lease))
            .arg(at.mark_ttl.map_or(0, millis))
            .arg(self.fence_ttl_ms());
        self.shared_attempt(&RW_UPGRADE, (&call, None), Want::Write, at)
    }

    /// Runs one shared-hold attempt (`call` of `script`, asking for `want`) and reads its
    /// reply.
    fn shared_attempt(
        &self,
        script: &Lua,
        call: (&Cmd, Option<&dyn Fn() -> Cmd>),
        want: Want,
        at: SharedAttempt<'_>,
    ) -> Result<Attempt> {
        // Two numbers, and a third (`others`) when a read-write hold is granted. A hold
        // taken waits for the replicas `replica_ack` asks for, as a lock does.
        let took = |reply: &Vec<i64>| reply.first() == Some(&1);
        let (reply, unacked, resent) =
            self.run_acquire(script, call, at.retry, at.deadline, took)?;
        if let Some(acked) = unacked {
            return Ok(Attempt::Unacked { acked, resent });
        }
        match *reply.as_slice() {
            [1, fence, ..] => Ok(Attempt::Acquired {
                fence: u64::try_from(fence)
                    .map_err(|_| Error::Protocol(format!("negative fence {fence}")))?,
                others_wait: reply.get(2) == Some(&1),
                previous_lost: reply.get(3) == Some(&1),
                resent,
            }),
            [0, ms] => {
                Counters::inc(&self.counters().failed_attempts);
                Ok(Attempt::Held {
                    pttl: u64::try_from(ms).ok().map(Duration::from_millis),
                    resent,
                })
            }
            [2, _] => Err(Error::WrongKind),
            [3, stored] => Err(Error::PermitsMismatch {
                stored: u32::try_from(stored).unwrap_or(u32::MAX),
                asked: match want {
                    Want::Permit(n) => n,
                    _ => 0,
                },
            }),
            [4, _] => Err(Error::Lost(LostReason::Deleted)),
            _ => Err(Error::Protocol(format!("shared acquire replied {reply:?}"))),
        }
    }

    /// Ends the hold `member` of `keys`; `fence`: a write holder's (see
    /// `scripts::fence_arg`).
    pub fn release_shared(
        &self,
        keys: &Keys,
        member: &str,
        fence: Option<u64>,
        retry: Retry,
        deadline: Option<Instant>,
    ) -> Result<ReleaseReply> {
        let publish = self.publish_mode(None)?;
        let call = |waiters: bool| {
            self.ending_call(&SHARED_RELEASE, keys, member, fence, waiters, publish)
        };
        // Redis Cluster, the slot half-way through a migration: the server refuses a script
        // whose keys are not all on one side (`TRYAGAIN`), and always serves the lock key
        // alone, whose release then says `r` (every waiter tries) as with no mark.
        let narrow = || call(false);
        let narrow: (&Lua, &dyn Fn() -> Cmd) = (&SHARED_RELEASE, &narrow);
        self.release_with(&SHARED_RELEASE, &call(true), retry, Some(narrow), deadline)
    }

    /// A call of `script`, one that ends a hold or a wait (see `SHARED_RELEASE`), of
    /// `member` of `keys`; `waiters`: it names the waiting sets and their nonces (the
    /// narrower form, the lock key alone, does not); `publish`: the node's publish mode.
    fn ending_call(
        &self,
        script: &Lua,
        keys: &Keys,
        member: &str,
        fence: Option<u64>,
        waiters: bool,
        publish: &str,
    ) -> Cmd {
        let permit = member.starts_with(Want::Permit(0).tag());
        let mut call = script.call(match (permit, waiters) {
            (_, false) => 1,
            (true, true) => 4,
            (false, true) => 6,
        });
        call.arg(keys.lock());
        if waiters {
            self.waiter_keys(&mut call, keys, permit);
        }
        self.ending_args(&mut call, keys, member, fence, publish);
        call
    }

    /// A waiting writer, reader or permit-seeker `member` of `keys` gives up (see
    /// `WAITER_LEAVE`): whether a grant to it was passed on. Within the wait's
    /// `deadline`, if any.
    pub fn leave_waiter(
        &self,
        keys: &Keys,
        member: &str,
        deadline: Option<Instant>,
    ) -> Result<bool> {
        let publish = self.publish_mode(deadline)?;
        let call =
            |waiters: bool| self.ending_call(&WAITER_LEAVE, keys, member, None, waiters, publish);
        // Redis Cluster, the slot half-way through a migration: the lock key alone, as a
        // release does (a grant that raced the leaving is passed on; the mark expires).
        let narrow = || call(false);
        let narrow: (&Lua, &dyn Fn() -> Cmd) = (&WAITER_LEAVE, &narrow);
        let left = self.release_with(
            &WAITER_LEAVE,
            &call(true),
            Retry::ON_RESET,
            Some(narrow),
            deadline,
        )?;
        match left {
            ReleaseReply::Passed => Ok(true),
            ReleaseReply::Other | ReleaseReply::OtherAfterRetry => Err(Error::WrongKind),
            _ => Ok(false),
        }
    }

    /// The keys after the lock key of the scripts that end a hold (see `SHARED_RELEASE`):
    /// a semaphore's waiting permit-seekers, their nonces and arrivals; a read-write lock's
    /// writers, readers, fence counter, nonces and writers' arrivals.
    fn waiter_keys(&self, call: &mut Cmd, keys: &Keys, permit: bool) {
        if permit {
            call.arg(keys.permit_waiters())
                .arg(keys.writer_nonces())
                .arg(keys.arrivals());
        } else {
            call.arg(keys.writers())
                .arg(keys.readers())
                .arg(keys.fence())
                .arg(keys.writer_nonces())
                .arg(keys.arrivals());
        }
    }

    /// The arguments of the scripts that end a hold (see `SHARED_RELEASE`).
    fn ending_args(
        &self,
        call: &mut Cmd,
        keys: &Keys,
        member: &str,
        fence: Option<u64>,
        publish: &str,
    ) {
        call.arg(member)
            .arg(keys.channel())
            .arg(fence_arg(fence))
            .arg(self.grant_ms())
            .arg(self.fence_ttl_ms())
            .arg(publish);
    }

    /// Turns the write hold `member` of `keys` into the read hold of the same token (see
    /// `RW_DOWNGRADE`), retried after an ambiguous failure as `retry` says. Whether it was
    /// done: `false` when the write hold had expired or was gone; and, when it was done
    /// and `replica_ack` asks, how many replicas acknowledged it if fewer than asked.
    pub fn downgrade_shared(
        &self,
        keys: &Keys,
        member: &str,
        fence: u64,
        lease: Duration,
        retry: Retry,
    ) -> Result<(bool, Option<usize>)> {
        let mut call = RW_DOWNGRADE.call(4);
        call.arg(keys.lock())
            .arg(keys.writers())
            .arg(keys.readers())
            .arg(keys.fence())
            .arg(member)
            .arg(Want::Read.member_like(member))
            .arg(millis(lease))
            .arg(keys.channel())
            .arg(fence_arg(Some(fence)))
            .arg(self.publish_mode(None)?);
        // Acknowledged as an acquisition is (see `run_acquire`): the read hold replaces
        // the write hold, and a failover must not bring the write hold back.
        let (replied, unacked, _) =
            self.run_acquire::<i64>(&RW_DOWNGRADE, (&call, None), retry, None, |r| *r == 1)?;
        match replied {
            1 => Ok((true, unacked)),
            0 => Ok((false, None)),
            -1 => Err(Error::WrongKind),
            other => Err(Error::Protocol(format!("downgrade replied {other}"))),
        }
    }

    /// Whether the hold `member` (the write hold if `write`) is live and nobody else
    /// waits for it (see `RW_KEEP`).
    pub fn keep_turns(
        &self,
        keys: &Keys,
        member: &str,
        write: bool,
        deadline: Option<Instant>,
    ) -> Result<bool> {
        let mut call = RW_KEEP.call(3);
        call.arg(keys.lock())
            .arg(keys.writers())
            .arg(keys.readers())
            .arg(member)
            .arg(if write { "w" } else { "r" });
        let keep: i64 = self.run_script(&RW_KEEP, &call, Retry::ON_RESET, deadline)?;
        Ok(keep == 1)
    }

    /// Removes the mark of a waiter that is never granted (an upgradable read, or an
    /// upgrade, as a writer when `write`; see `WAITER_UNMARK`): it stops waiting without
    /// the hold.
    pub fn unmark_waiter(
        &self,
        keys: &Keys,
        member: &str,
        write: bool,
        deadline: Option<Instant>,
    ) -> Result<()> {
        let script = &*WAITER_UNMARK;
        let mut call = script.call(if write { 2 } else { 1 });
        if write {
            call.arg(keys.writers()).arg(keys.arrivals());
        } else {
            call.arg(keys.readers());
        }
        call.arg(member)
            .arg(keys.channel())
            .arg(self.publish_mode(deadline)?);
        self.run_script::<i64>(script, &call, Retry::ON_RESET, deadline)?;
        Ok(())
    }
}
