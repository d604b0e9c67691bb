//! The scripts of the fair queue: a FIFO of waiting processes beside each lock, in the
//! lock's hash slot, and a release that grants the lock to the head of it.
//!
//! Keys of a lock `L` (all share its hash tag): `L` itself, its fence counter, its mark,
//! `L:q` — a sorted set of the waiting contenders' tokens scored by arrival (server time,
//! µs, or just after the last entry's when the clock reads earlier: a clock stepped back
//! never lets a later waiter ahead) — `L:qx`, the same tokens scored by when their entry
//! expires unless the waiter's next attempt refreshes it (server time, ms), and `L:qn`,
//! the same tokens scored by the nonce of the latest attempt that queued or refreshed them
//! (a sorted set, so that the queue needs no command beyond the sorted-set ones). A
//! waiter's entry is its contender token, the same for every attempt of one wait; each
//! attempt has a new nonce.
//!
//! A grant is `SET L <head> PX <grant lease>`, a fence (the counter written held: see
//! `FENCE_FN`) and a publish of `g<head>:<nonce>:<fence>:<grant ms>` on the lock's channel
//! (sharded where the node has it, see `sharded`), `nonce` being the head's entry's. The
//! grant ran after the attempt that stored that nonce, so after the waiter sent it: the
//! grant's lease ends no earlier than that send plus the grant lease. A grantee that knows
//! when it sent the attempt of that nonce (its latest) holds the lock until then, less its
//! drift margin, with no round trip; its watchdog's first renewal, sent a quarter of the
//! way to that bound, gives it the full lease. A grant of an older nonce, or read after that bound (a slow network, a
//! stopped process), is only a wake-up: the next attempt confirms it (it finds its own
//! token in the key, sets the full lease and reads the fence as it is then). A grant that
//! follows a hold which ended without a release carries nonce 0, so that its grantee
//! confirms it and the confirming attempt's reply tells it of the loss
//! (`previous_lost`). The counter is held from the grant on: a grantee may hold the lock
//! without another call, so a grant that expires unconfirmed tells the next holder of a
//! loss (erring on the side of caution). The short grant lease bounds what a dead grantee
//! costs the others; a lost message is recovered by the grantee's next attempt.
//!
//! Bounds, so that no queue can stop the scripts: each call drops at most `PRUNE_CHUNK`
//! expired entries (a mass crash leaves thousands; they drain over the calls that follow,
//! and while some are left the lock goes to whoever comes, as without the queue), and
//! every enqueue keeps `L:q` and `L:qx` alive for at least its entry's TTL plus
//! `QUEUE_MARGIN_MS`: the queue's keys outlive every live entry, and a queue whose waiters
//! are all gone expires by itself.
//!
//! Keys of another type (another program's key of the same name, an operator's edit): an
//! attempt reads the queue and its expiries before it writes (`ZCARD`, then the prune),
//! and fails with the server's `WRONGTYPE` having written nothing. After its first write
//! a script reads and cleans the queue's keys through `SETS_FN`, for which such a key
//! holds nobody: a release or a leave passes the lock on to nobody then (it frees it and
//! says `r`), a grant whose nonce cannot be read is a wake-up, and a waiter is queued
//! without a nonce when the nonces are such a key.

use std::sync::LazyLock;

use redis::Cmd;

use super::keys::Keys;
use super::scripts::{
    CLOCK_FN, END_FENCE_FN, FENCE_FN, FENCE_FORM_FN, GONE_AGAIN_FN, HOLD_FENCE_FN, Lua, OWNER_FN,
    SETS_FN, Site, fence_arg,
};
use super::sharded::PUBLISH_FN;

/// Shared Lua: the server clock, pruning of expired entries, and a grant to the head.
/// KEYS[1] lock, KEYS[2] fence; `q`, `qx`, `qn` and the channel are passed in; the publish
/// mode is the last argument (`PUBLISH_FN`, which comes first). After `SETS_FN`: the
/// queue's keys are read and cleaned with its helpers, so that a key of another type
/// there never fails a script after it wrote (a grant whose nonce cannot be read is only a
/// wake-up; a queue that cannot be read has no head, and a release frees the lock).
const COMMON: &str = r"
local PRUNE_CHUNK = 256
local QUEUE_MARGIN_MS = 1000
-- Drops expired entries, at most PRUNE_CHUNK of them: a script does bounded work (and
-- Lua unpacks at most a few thousand values) however many waiters crashed; the queue
-- drains over the calls that follow. True when no expired entry is left, so that the
-- head is a live waiter; false when some may be (the caller then grants to nobody).
-- `strict`: an attempt's first read of the queue, before it writes, which a key of another
-- type fails (see `SETS_FN`).
local function prune(q, qx, qn, now_ms, strict)
  local dead
  if strict then
    dead = redis.call('ZRANGEBYSCORE', qx, '-inf', now_ms, 'LIMIT', 0, PRUNE_CHUNK)
  else
    dead = tolerate({}, 'ZRANGEBYSCORE', qx, '-inf', now_ms, 'LIMIT', 0, PRUNE_CHUNK)
  end
  if #dead > 0 then
    tolerate(0, 'ZREM', q, unpack(dead))
    tolerate(0, 'ZREM', qx, unpack(dead))
    tolerate(0, 'ZREM', qn, unpack(dead))
  end
  return #dead < PRUNE_CHUNK
end
-- Takes `token` out of the queue.
local function dequeue(q, qx, qn, token)
  local was = tolerate(0, 'ZREM', q, token)
  tolerate(0, 'ZREM', qx, token)
  tolerate(0, 'ZREM', qn, token)
  return was == 1
end
-- The first entry by arrival that has an expiry, after `prune`. An entry without one (its
-- `qx` member evicted, or deleted) is refreshed by nobody and never pruned: it would be
-- granted the lock in its turn, a grant lease each, while it kept the queue alive. It is
-- dropped on the way, at most PRUNE_CHUNK of them. Nil when the queue is empty; false
-- when more such entries may be left (no head is known to be alive, as for `prune`).
local function live_head(q, qx, qn)
  for _ = 1, PRUNE_CHUNK do
    local head = tolerate({}, 'ZRANGE', q, 0, 0)[1]
    if not head or tolerate(false, 'ZSCORE', qx, head) then return head end
    dequeue(q, qx, qn, head)
  end
  return false
end
-- Keeps `key` for at least `ms`: a queue lives as long as its longest-lived entry, and an
-- abandoned one (its waiters all gone) disappears with it.
local function keep_for(key, ms)
  if redis.call('PTTL', key) < ms then
    redis.call('PEXPIRE', key, ms)
  end
end
-- `after_lost`: what the grantee is told of the hold before (nil: the counter says).
-- The fence first: a counter that cannot issue one (a key of another type) leaves
-- everything as it was, and its error is returned (a script is not undone when it
-- fails half-way, so it must not fail after a write).
local function grant(head, q, qx, qn, channel, grant_ms, after_lost)
  -- The fence counter's TTL is the argument before the publish mode, in every script.
  -- Written held: the grantee may hold the lock from the message alone.
  local fence, lost = next_fence(KEYS[2], ARGV[#ARGV - 1], after_lost)
  if type(fence) == 'table' then return fence end
  redis.call('SET', KEYS[1], head, 'PX', grant_ms)
  -- Written out whole: Lua's own number-to-string keeps 14 digits, a fence has 16.
  fence = string.format('%.0f', fence)
  -- 0 (no attempt's nonce) is only a wake-up: an entry queued before nonces were kept,
  -- or a grant after a hold that ended without a release, whose grantee must confirm it
  -- to be told of the loss.
  local nonce = not lost and tolerate(false, 'ZSCORE', qn, head)
  nonce = nonce and string.format('%.0f', tonumber(nonce)) or '0'
  dequeue(q, qx, qn, head)
  publish(channel, 'g' .. head .. ':' .. nonce .. ':' .. fence .. ':' .. grant_ms)
  return fence
end
";

/// Shared Lua of the scripts that end a hold (release, leave), after `COMMON` and
/// `END_FENCE_FN`: passing the lock on.
const PASS_ON: &str = r"
-- What a grant made as a hold ends tells its grantee: nothing after a holder's release
-- (`fence`, its fence), else (`fence` '0': an attempt nobody used) what the hold given
-- back had been told.
local function grant_lost(fence)
  if fence ~= '0' then return false end
  local _, held, after_lost = fence_read(redis.pcall('GET', KEYS[2]))
  return held and after_lost
end
-- Gives a lock that `token` holds to the head of the queue, or deletes it with its lease
-- record (KEYS[5]: no key of the hold outlives it); `fence`: the
-- holder's fence, or '0' for an attempt nobody used (see `end_fence` of `END_FENCE_FN`).
-- 2: granted to the head; 1: released.
-- A queue with expired entries left after the prune has no head anybody knows is alive:
-- the lock is freed for whoever comes next; so is one whose grant cannot issue a fence
-- (its head's next attempt meets the counter's error).
local function pass_on(q, qx, qn, channel, grant_ms, now_ms, fence)
  local head = prune(q, qx, qn, now_ms) and live_head(q, qx, qn)
  if head and type(grant(head, q, qx, qn, channel, grant_ms, grant_lost(fence))) ~= 'table' then
    return 2
  end
  redis.call('DEL', KEYS[1], KEYS[5])
  end_fence(KEYS[2], fence)
  publish(channel, 'r')
  return 1
end
";

/// Acquire, fairly and idempotently.
///
/// KEYS: lock, fence, queue, queue expiries, queue nonces. ARGV: token, lease ms,
/// channel, client id, entry TTL ms (0: the caller will not wait, so it is not queued;
/// otherwise also the least TTL, plus a margin, that the queue's keys get), grant lease
/// ms, the attempt's nonce (stored with its entry), fence counter TTL ms (see
/// `FENCE_FN`), publish mode.
/// Returns `{1, fence, after lost}` when the lock is ours (`after lost`: 1 when the hold
/// before ended without a release, see `FENCE_FN`), `{0, pttl, 0}` when it is not (and
/// the caller, if it waits, is queued), `{2, 0, 0}` when the name holds another kind of
/// lock.
///
/// The lock is taken with `take_fenced` (see `FENCE_FN`), which deletes it again when the
/// fence's `SET` fails.
///
/// A free lock goes to the caller only when the queue is empty or the caller is its head;
/// a free lock with another head is granted to that head on the spot (its grant was lost,
/// or it queued while the lock was being released). The queue is also the contention
/// mark: a holder's process learns that another waits from `c<client id>` on the channel,
/// or from a non-empty queue.
pub(crate) static FAIR_ACQUIRE: LazyLock<Lua> = LazyLock::new(|| {
    Lua::new(&format!(
        "{PUBLISH_FN}{FENCE_FORM_FN}{CLOCK_FN}{FENCE_FN}{}{HOLD_FENCE_FN}{SETS_FN}{COMMON}{}",
        r"
-- The common case first: nobody queued and the lock free (three calls, as without the
-- queue but for the ZCARD), before the functions of the other cases are defined. The
-- queue and its expiries are read before anything is written (the queue here, its
-- expiries by the prune below): a key of another type there fails the attempt at once,
-- having written nothing (see `SETS_FN`).
if redis.call('ZCARD', KEYS[3]) == 0 then
  local fence, after_lost = take_fenced(KEYS[1], ARGV[1], ARGV[2], KEYS[2], ARGV[#ARGV - 1])
  if type(fence) == 'table' then return fence end
  if fence then return won(fence, after_lost) end
end
",
        r"
local now = clock_us()
local now_ms = math.floor(now / 1000)
local clean = prune(KEYS[3], KEYS[4], KEYS[5], now_ms, true)
local cur = redis.pcall('GET', KEYS[1])
if type(cur) == 'table' then return {2, 0, 0} end
if cur == ARGV[1] then
  -- Ours: granted to us, or a retry after a lost reply. Only lengthened: an attempt that
  -- was delayed on the way must not cut short a longer lease an extend set since.
  if redis.call('PTTL', KEYS[1]) < tonumber(ARGV[2]) then redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
  dequeue(KEYS[3], KEYS[4], KEYS[5], ARGV[1])
  return won(hold_fence(KEYS[2]))
end
if not cur then
  -- Expired entries left over (see prune): no known live head, the lock goes to us.
  local head = clean and live_head(KEYS[3], KEYS[4], KEYS[5])
  if not head or head == ARGV[1] then
    -- Free (read above, in this script), so the SET NX takes it.
    local fence, after_lost = take_fenced(KEYS[1], ARGV[1], ARGV[2], KEYS[2], ARGV[#ARGV - 1])
    if type(fence) == 'table' then return fence end
    dequeue(KEYS[3], KEYS[4], KEYS[5], ARGV[1])
    return won(fence, after_lost)
  end
  -- Free with a live head: the hold before ended, released or not, as the counter says.
  local granted = grant(head, KEYS[3], KEYS[4], KEYS[5], ARGV[3], ARGV[6])
  if type(granted) == 'table' then return granted end
end
if ARGV[5] ~= '0' then
  local entry_ms = tonumber(ARGV[5])
  if not redis.call('ZSCORE', KEYS[3], ARGV[1]) then
    -- Behind the last entry, whatever the clock says: a clock stepped back since an
    -- earlier waiter queued must not put a later one ahead of it.
    local last = tonumber(redis.call('ZRANGE', KEYS[3], -1, -1, 'WITHSCORES')[2])
    local arrival = now
    if last and last >= now then arrival = last + 1 end
    redis.call('ZADD', KEYS[3], arrival, ARGV[1])
  end
  redis.call('ZADD', KEYS[4], now_ms + entry_ms, ARGV[1])
  keep_for(KEYS[3], entry_ms + QUEUE_MARGIN_MS)
  keep_for(KEYS[4], entry_ms + QUEUE_MARGIN_MS)
  -- A hint (see `SETS_FN`): never written, nor kept, when it is a key of another type.
  if tolerate(false, 'ZADD', KEYS[5], ARGV[7], ARGV[1]) then
    keep_for(KEYS[5], entry_ms + QUEUE_MARGIN_MS)
  end
  publish(ARGV[3], 'c' .. ARGV[4])
end
return {0, redis.call('PTTL', KEYS[1]), 0}
"
    ))
});

/// Release: grant to the head of the queue, or delete (the token compared with `ownership`,
/// see `OWNER_FN`).
///
/// KEYS: lock, fence, queue, queue expiries, lease record (deleted with the lock; a grant
/// leaves it to the next holder's first lease change, or its TTL), queue nonces. ARGV:
/// token, channel, grant lease ms, the holder's fence (`0`: an attempt nobody used is
/// given back, see `end_fence` of `END_FENCE_FN`), then `1` when the release is sent again
/// after a try whose reply was lost (see `fair_call`), then the fence counter TTL ms and
/// the publish mode (the TTL comes just before the publish mode in both forms: a grant
/// reads it there, see `COMMON`).
/// Returns 2 granted to the next waiter, 1 released, 0 the key was gone, -1 another token
/// (or another kind) holds it; a release sent again that finds the key gone reads the
/// fence counter as the plain release does (see `scripts::RELEASE`, "A retry"): 3, gone
/// and not released by a try of ours.
pub(crate) static FAIR_RELEASE: LazyLock<Lua> = LazyLock::new(|| {
    Lua::new(&format!(
        "{PUBLISH_FN}{FENCE_FORM_FN}{END_FENCE_FN}{OWNER_FN}{}{GONE_AGAIN_FN}{}{CLOCK_FN}{FENCE_FN}{SETS_FN}{COMMON}{PASS_ON}{}",
        r"
local status = ownership(KEYS[1], ARGV[1])
if status == 0 and #ARGV == 7 then
",
        r"
  return gone_again(KEYS[2], ARGV[4], ARGV[6])
end
if status ~= 1 then return status end
-- Nobody queued: released, before the functions of a grant are defined.
if redis.call('EXISTS', KEYS[3]) == 0 then
  redis.call('DEL', KEYS[1], KEYS[5])
  end_fence(KEYS[2], ARGV[4])
  publish(ARGV[2], 'r')
  return 1
end
",
        r"
-- A token that gives the lock back waits no more (a cleanup of a waiter that could not
-- leave): never granted to itself.
dequeue(KEYS[3], KEYS[4], KEYS[6], ARGV[1])
return pass_on(KEYS[3], KEYS[4], KEYS[6], ARGV[2], ARGV[3], math.floor(clock_us() / 1000), ARGV[4])
"
    ))
});

/// A waiter leaves: out of the queue, and a grant that raced its leaving passed on.
///
/// KEYS: lock, fence, queue, queue expiries, lease record (deleted with a lock passed
/// on to nobody, as by a release), queue nonces. ARGV: token, channel, grant lease ms, a fence (unused: a lock a
/// waiter leaves with is one nobody used, given back as such), fence counter TTL ms,
/// publish mode.
/// Returns 2 a grant to us was passed to the next waiter, 1 it was released, 0 nothing was
/// ours. A waiter that leaves the queue of a free lock publishes `r`, as a release does:
/// a multi-lock that a live entry kept from the free name (see `multi_scripts`) tries
/// again.
pub(crate) static FAIR_LEAVE: LazyLock<Lua> = LazyLock::new(|| {
    Lua::new(&format!(
        "{PUBLISH_FN}{FENCE_FORM_FN}{CLOCK_FN}{FENCE_FN}{END_FENCE_FN}{OWNER_FN}{SETS_FN}{COMMON}{PASS_ON}{}",
        r"
local queued = dequeue(KEYS[3], KEYS[4], KEYS[6], ARGV[1])
local status = ownership(KEYS[1], ARGV[1])
if status == 1 then
  return pass_on(KEYS[3], KEYS[4], KEYS[6], ARGV[2], ARGV[3], math.floor(clock_us() / 1000), '0')
end
-- A free lock that a waiter was queued for: whoever an attempt refused because it was
-- queued first (a multi-lock, which grants nothing) hears of no release; wake them.
if queued and status == 0 then publish(ARGV[2], 'r') end
return 0
"
    ))
});

/// The call of [`FAIR_ACQUIRE`] (see it for the arguments): a waiter's failed attempt
/// queues with an entry that lives `entry_ms` (0: it will not wait) and holds `nonce`; a
/// grant it makes to a live head of the queue (see `pass_on`) lasts `grant_ms`.
pub(crate) fn fair_acquire_call(
    site: Site<'_>,
    keys: &Keys,
    token: &str,
    lease_ms: u64,
    (entry_ms, grant_ms): (u64, u64),
    nonce: u64,
) -> Cmd {
    let mut call = FAIR_ACQUIRE.call(5);
    call.arg(keys.lock())
        .arg(keys.fence())
        .arg(keys.queue())
        .arg(keys.queue_expiry())
        .arg(keys.queue_nonce())
        .arg(token)
        .arg(lease_ms)
        .arg(keys.channel())
        .arg(site.client_id)
        .arg(entry_ms)
        .arg(grant_ms)
        .arg(nonce)
        .arg(site.fence_ttl_ms)
        .arg(site.publish);
    call
}

/// A call of [`FAIR_RELEASE`] or [`FAIR_LEAVE`]: the same keys and arguments; a grant
/// lasts `grant_ms`; `fence`: the holder's (see `scripts::fence_arg`); `again`: a release
/// sent again after a try whose reply was lost (see [`FAIR_RELEASE`]).
pub(crate) fn fair_call(
    script: &Lua,
    site: Site<'_>,
    keys: &Keys,
    token: &str,
    (grant_ms, fence): (u64, Option<u64>),
    again: bool,
) -> Cmd {
    let mut call = script.call(6);
    call.arg(keys.lock())
        .arg(keys.fence())
        .arg(keys.queue())
        .arg(keys.queue_expiry())
        .arg(keys.lease())
        .arg(keys.queue_nonce())
        .arg(token)
        .arg(keys.channel())
        .arg(grant_ms)
        .arg(fence_arg(fence));
    if again {
        call.arg(1);
    }
    call.arg(site.fence_ttl_ms).arg(site.publish);
    call
}
