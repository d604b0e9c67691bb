//! The operators' view on the wire: one read-only script that reads every key of a name
//! (`INSPECT`), the fence-checked delete of a stuck lock (`FORCE_RELEASE`), and the `SCAN`
//! pages that find the names under a prefix.
//!
//! `INSPECT` writes nothing and changes no expiry: it does not drop expired holds or queue
//! entries as the lock scripts do, it reports them as expired. Times are the server's
//! (`TIME`), so ages and leases left do not depend on this machine's clock.

use std::sync::LazyLock;

use redis::Value;

use crate::error::{Error, Result};
use crate::proto::keys::{Keys, name_of_key};
use crate::proto::node::{Call, Node, Retry};
use crate::proto::scripts::Lua;
use crate::proto::sharded::PUBLISH_FN;

/// Most holds, queue entries and waiting marks one `INSPECT` lists per key: a reply stays
/// small however many crashed waiters a key has kept.
pub(crate) const MAX_LISTED: usize = 1000;

/// Reads every key of one name in one round trip, writing nothing.
///
/// KEYS: lock, fence, lease record, contention mark, queue, queue expiries, waiting
/// writers, waiting readers. ARGV: the last index of the ranges read (`MAX_LISTED` − 1).
/// Returns `{seconds, microseconds, type, value, pttl, fence, mark, mark pttl, holds,
/// queue, queue expiries, writers, readers}`: `TIME`; the lock key's type, its value when
/// a string (else nil) and `PTTL`; the fence counter (nil when gone or not a string); the
/// mark's value and `PTTL`; then `member, score` lists of the lock key (a sorted set's
/// holds, kind member first; past the limit, its live holds after the first expired ones:
/// see `holds_of`), the queue by arrival (past the limit, its live entries and
/// then the first dead ones: see `queue_of`), the expiries of the entries listed,
/// and the live waiting writers' and readers' marks. A key of an unexpected type reads as
/// empty (`pcall`).
static INSPECT: LazyLock<Lua> = LazyLock::new(|| {
    Lua::new(
        r"
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function get(key)
  local v = redis.pcall('GET', key)
  if type(v) == 'string' then return v end
  return false
end
local function range(key)
  local v = redis.pcall('ZRANGE', key, 0, ARGV[1], 'WITHSCORES')
  if v.err then return {} end
  return v
end
-- The live marks of `key` (scored by expiry, in ms): dead ones, first by score, would
-- fill the list and hide the live.
local function live(key)
  local v = redis.pcall('ZRANGEBYSCORE', key, '(' .. now_ms, '+inf', 'WITHSCORES', 'LIMIT', 0,
    ARGV[1] + 1)
  if v.err then return {} end
  return v
end
-- `member, score` of each member of `listed` (a `member, score` list) in `key`: the
-- expiries of the queue entries listed, however many others expire first.
local function scores_of(key, listed)
  local members = {}
  for i = 1, #listed, 2 do members[#members + 1] = listed[i] end
  if #members == 0 then return {} end
  local v = redis.pcall('ZMSCORE', key, unpack(members))
  if v.err then return {} end
  local out = {}
  for i = 1, #members do
    if v[i] then
      out[#out + 1] = members[i]
      out[#out + 1] = v[i]
    end
  end
  return out
end
-- The queue by arrival, at most ARGV[1] + 1 entries. A longer queue: its live entries (their
-- expiry in `qx` ahead) and then dead ones, first by arrival: dead entries queued first
-- (crashed waiters not yet pruned) would fill the list and hide the live waiters after them.
local function queue_of(q, qx)
  local first = range(q)
  local limit = tonumber(ARGV[1]) + 1
  if #first < 2 * limit then return first end
  local live = redis.pcall('ZRANGEBYSCORE', qx, '(' .. now_ms, '+inf', 'LIMIT', 0, limit)
  if live.err or #live == 0 then return first end
  local arrivals = redis.pcall('ZMSCORE', q, unpack(live))
  if arrivals.err then return first end
  local entries, is_live = {}, {}
  for i = 1, #live do
    if arrivals[i] then
      is_live[live[i]] = true
      entries[#entries + 1] = {live[i], arrivals[i]}
    end
  end
  for i = 1, #first, 2 do
    if #entries >= limit then break end
    if not is_live[first[i]] then entries[#entries + 1] = {first[i], first[i + 1]} end
  end
  table.sort(entries, function(a, b) return tonumber(a[2]) < tonumber(b[2]) end)
  local out = {}
  for _, e in ipairs(entries) do
    out[#out + 1] = e[1]
    out[#out + 1] = e[2]
  end
  return out
end
-- The lock key's members by score (its kind member first), at most ARGV[1] + 1. More: the
-- kind member, expired holds first by expiry as room is left, then the live holds. Holds
-- are dropped when a script acquires or releases, never by a renewal: the holds of crashed
-- holders expire first and would fill the list and hide the live ones after them.
local function holds_of(key)
  local first = range(key)
  local limit = tonumber(ARGV[1]) + 1
  if #first < 2 * limit then return first end
  local live = redis.pcall('ZRANGEBYSCORE', key, '(' .. now_ms, '+inf', 'WITHSCORES', 'LIMIT',
    0, limit - 1)
  if live.err or #live == 0 then return first end
  local out = {first[1], first[2]}
  local room = limit - 1 - #live / 2
  for i = 3, #first, 2 do
    if room <= 0 or tonumber(first[i + 1]) > now_ms then break end
    out[#out + 1] = first[i]
    out[#out + 1] = first[i + 1]
    room = room - 1
  end
  for i = 1, #live do out[#out + 1] = live[i] end
  return out
end
local ty = redis.call('TYPE', KEYS[1]).ok
local holds = {}
if ty == 'zset' then holds = holds_of(KEYS[1]) end
local queue = queue_of(KEYS[5], KEYS[6])
return {t[1], t[2], ty, get(KEYS[1]), redis.call('PTTL', KEYS[1]), get(KEYS[2]),
  get(KEYS[4]), redis.call('PTTL', KEYS[4]), holds, queue, scores_of(KEYS[6], queue),
  live(KEYS[7]), live(KEYS[8])}
",
    )
});

/// Deletes a plain lock only while its fence counter is the given fence (0: while there
/// is no counter, as under a hold kept longer than the counter's TTL).
///
/// KEYS: lock, fence, lease record. ARGV: the fence (decimal), the library's channel, the
/// publish mode. Returns `{status, counter}`: 1 deleted (the lock and its lease record,
/// and `r` published so that waiters wake, as `RELEASE` does), 0 no lock, −1 the counter
/// is another fence (nothing deleted), 2 the key is not a plain lock (a read-write lock, a
/// semaphore, a value of another type, or a string with no expiry, which no lock of this
/// library is: nothing deleted). `counter` is the fence
/// counter as read (nil when gone; in any of its forms, see `scripts::FENCE_FN`). The
/// counter is left as it is: held, so that the next holder is told that the hold before
/// it ended without a release.
static FORCE_RELEASE: LazyLock<Lua> = LazyLock::new(|| {
    Lua::new(&format!(
        "{PUBLISH_FN}{}",
        r"
local cur = redis.pcall('GET', KEYS[2])
if type(cur) ~= 'string' then cur = false end
local ty = redis.call('TYPE', KEYS[1]).ok
if ty == 'none' then return {0, cur} end
-- Every lock this library takes has a lease: a string with no expiry is another program's.
if ty ~= 'string' or redis.call('PTTL', KEYS[1]) == -1 then return {2, cur} end
-- No counter (a hold kept longer than its TTL, or a value that is no number) reads as
-- fence 0, as `fence_read` has it: fence 0 frees such a hold, and no other.
local n = cur and tonumber(cur)
if not n or n ~= n then n = 0 end
if math.abs(n) ~= tonumber(ARGV[1]) then return {-1, cur} end
redis.call('DEL', KEYS[1], KEYS[3])
publish(ARGV[2], 'r')
return {1, cur}
"
    ))
});

/// What `INSPECT` read on one node. Times in server milliseconds (queue arrivals in µs).
#[derive(Debug, Default)]
pub(crate) struct Snapshot {
    pub now_ms: i64,
    pub now_us: i64,
    /// The lock key's Redis type (`none`, `string`, `zset`, ...).
    pub key_type: String,
    /// The lock key's value when it is a string (a plain lock's owner token).
    pub value: Option<String>,
    /// The lock key's `PTTL` (−1 no TTL, −2 no key).
    pub pttl: i64,
    /// The fence counter, when it holds a number.
    pub fence: Option<u64>,
    /// The contention mark's client id and `PTTL`.
    pub mark: Option<(String, i64)>,
    /// The lock key's members and scores (a sorted set's kind member and holds).
    pub holds: Vec<(String, f64)>,
    /// The queue by arrival (µs), and each entry's expiry (ms).
    pub queue: Vec<(String, f64)>,
    pub queue_expiry: Vec<(String, f64)>,
    /// Waiting writers' and readers' marks, by expiry (ms).
    pub writers: Vec<(String, f64)>,
    pub readers: Vec<(String, f64)>,
}

/// Reads every key of `keys` on `node` in one round trip (see [`INSPECT`]).
///
/// In a Redis Cluster slot half-way through a migration, whose masters refuse a command
/// naming keys that only some of them hold (`topology::call`), it reads the keys one at a
/// time instead, each where it is ([`inspect_by_key`]).
pub(crate) fn inspect(node: &Node, keys: &Keys) -> Result<Snapshot> {
    let call = inspect_call([
        keys.lock(),
        keys.fence(),
        keys.lease(),
        keys.mark(),
        keys.queue(),
        keys.queue_expiry(),
        keys.writers(),
        keys.readers(),
    ]);
    let whole = Call {
        retry: Retry::LOST_REPLY,
        deadline: None,
        narrower: true,
    };
    match node.call(whole, |c, before| INSPECT.run::<Value>(&call, c, before))? {
        Some(reply) => parse(reply),
        None => inspect_by_key(node, keys),
    }
}

/// A call of [`INSPECT`] on `keys`, in its order.
fn inspect_call(keys: [&[u8]; 8]) -> redis::Cmd {
    let mut call = INSPECT.call(keys.len());
    for key in keys {
        call.arg(key);
    }
    call.arg(MAX_LISTED - 1);
    call
}

fn parse(reply: Value) -> Result<Snapshot> {
    parse_snapshot(reply).map_err(|what| Error::Protocol(format!("inspect replied {what}")))
}

/// [`inspect`] one key at a time: [`INSPECT`] with one key in every place, which Redis
/// serves like any command naming one key (where the key is, or on the slot's target
/// after `ASK`), and of whose reply only that key's fields are kept. The keys are read
/// moments apart, not at one instant as the one script reads them; a queue longer than
/// [`MAX_LISTED`] is listed from its first entries by arrival, live or not.
fn inspect_by_key(node: &Node, keys: &Keys) -> Result<Snapshot> {
    let read = |key: &[u8]| -> Result<Snapshot> {
        let call = inspect_call([key; 8]);
        parse(node.run_script(&INSPECT, &call, Retry::LOST_REPLY, None)?)
    };
    let lock = read(keys.lock())?;
    let queue = read(keys.queue())?.queue;
    // The expiries of the entries listed: `qx` read as a queue lists its members with
    // their scores, the expiries.
    let queue_expiry = read(keys.queue_expiry())?
        .queue_expiry
        .into_iter()
        .filter(|(member, _)| queue.iter().any(|(m, _)| m == member))
        .collect();
    Ok(Snapshot {
        fence: read(keys.fence())?.fence,
        mark: read(keys.mark())?.mark,
        queue,
        queue_expiry,
        writers: read(keys.writers())?.writers,
        readers: read(keys.readers())?.readers,
        ..lock
    })
}

fn parse_snapshot(reply: Value) -> std::result::Result<Snapshot, String> {
    let Value::Array(items) = reply else {
        return Err(format!("{reply:?}"));
    };
    let [
        secs,
        micros,
        ty,
        value,
        pttl,
        fence,
        mark,
        mark_pttl,
        holds,
        q,
        qx,
        ww,
        wr,
    ] = <[Value; 13]>::try_from(items).map_err(|v| format!("{} items", v.len()))?;
    let secs = int(&secs)?;
    let micros = int(&micros)?;
    Ok(Snapshot {
        now_ms: secs * 1000 + micros / 1000,
        now_us: secs * 1_000_000 + micros,
        key_type: text(&ty).unwrap_or_default(),
        value: text(&value),
        pttl: int(&pttl)?,
        fence: text(&fence).as_deref().and_then(counter_fence),
        mark: text(&mark).map(|m| (m, int(&mark_pttl).unwrap_or(-2))),
        holds: scored(&holds)?,
        queue: scored(&q)?,
        queue_expiry: scored(&qx)?,
        writers: scored(&ww)?,
        readers: scored(&wr)?,
    })
}

/// The fence a counter's value says, in any of its forms (`<f>`, `-<f>`, `-0<f>`: see
/// `scripts::FENCE_FN`); `None` for a value that is not one.
pub(crate) fn counter_fence(value: &str) -> Option<u64> {
    value
        .parse::<i64>()
        .ok()
        .map(i64::unsigned_abs)
        .filter(|&f| f > 0)
}

fn text(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
        Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    }
}

fn int(v: &Value) -> std::result::Result<i64, String> {
    match v {
        Value::Int(n) => Ok(*n),
        other => text(other)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| format!("{other:?} for a number")),
    }
}

/// A `member, score, member, score, ...` list.
fn scored(v: &Value) -> std::result::Result<Vec<(String, f64)>, String> {
    let Value::Array(items) = v else {
        return Err(format!("{v:?} for a list"));
    };
    items
        .chunks(2)
        .map(|pair| match pair {
            [m, s] => {
                let member = text(m).ok_or_else(|| format!("{m:?} for a member"))?;
                let score = text(s)
                    .and_then(|s| s.parse().ok())
                    .ok_or_else(|| format!("{s:?} for a score"))?;
                Ok((member, score))
            }
            _ => Err("an odd list".to_owned()),
        })
        .collect()
}

/// What a fence-checked release did on one node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Forced {
    Released,
    NotHeld,
    /// The fence counter is another value (`None`: gone or not a number).
    OtherFence(Option<u64>),
    /// The key is a read-write lock, a semaphore, another type's value or a string with no
    /// expiry.
    NotALock,
}

/// Deletes the lock of `keys` on `node` only while its fence counter is `fence` (see
/// [`FORCE_RELEASE`]). Sent once, also when the connection drops (its outcome is then
/// unknown, and the error says so): a retry after a lost reply would find the key gone
/// and say "not held" of a lock it deleted.
pub(crate) fn force_release(node: &Node, keys: &Keys, fence: u64) -> Result<Forced> {
    let mut call = FORCE_RELEASE.call(3);
    call.arg(keys.lock())
        .arg(keys.fence())
        .arg(keys.lease())
        .arg(fence)
        .arg(keys.channel())
        .arg(node.publish_mode(None)?);
    let (status, counter): (i64, Option<String>) =
        node.run_script(&FORCE_RELEASE, &call, Retry::NEVER, None)?;
    Ok(match status {
        1 => Forced::Released,
        0 => Forced::NotHeld,
        -1 => Forced::OtherFence(counter.as_deref().and_then(counter_fence)),
        2 => Forced::NotALock,
        n => return Err(Error::Protocol(format!("force release replied {n}"))),
    })
}

/// Keys of a name that say it is held or waited for: the lock key, the fair queue, the
/// waiting writers' and readers' marks and the contention mark. Its fence counter and
/// lease record outlive both and are skipped.
const ACTIVE_SUFFIXES: [&[u8]; 5] = [b"", b":q", b":ww", b":wr", b":w"];

/// `SCAN` pages over one node's names under `prefix` matching `pattern` (a Redis glob over
/// names): one `MATCH` per key form of [`Keys`], plain then escaped, `COUNT` bounded.
pub(crate) struct Scan {
    prefix: String,
    pattern: Vec<u8>,
    /// The `MATCH` patterns still to scan, the current one first.
    matches: Vec<Vec<u8>>,
    cursor: u64,
}

/// Keys asked for per `SCAN` page (a hint to the server, which may return more or fewer).
const PAGE: usize = 200;

impl Scan {
    pub fn new(prefix: &str, pattern: &[u8]) -> Self {
        let pattern = if pattern.is_empty() { b"*" } else { pattern };
        let escaped_prefix = glob_escape(prefix.as_bytes());
        let matching = match_pattern(pattern);
        let mut matches = Vec::with_capacity(2);
        // Escaped form: `{16 hex digits}prefix name`, then any suffix.
        let mut escaped = b"{".to_vec();
        escaped.extend_from_slice(&[b'?'; 16]);
        escaped.push(b'}');
        escaped.extend_from_slice(&escaped_prefix);
        escaped.extend_from_slice(&matching);
        escaped.push(b'*');
        matches.push(escaped);
        if !prefix.contains('{') {
            // Plain form: `prefix{name}`, then any suffix.
            let mut plain = escaped_prefix;
            plain.push(b'{');
            plain.extend_from_slice(&matching);
            plain.extend_from_slice(b"}*");
            matches.push(plain);
        }
        Scan {
            prefix: prefix.to_owned(),
            pattern: pattern.to_vec(),
            matches,
            cursor: 0,
        }
    }

    /// Whether every page was read.
    pub fn done(&self) -> bool {
        self.matches.is_empty()
    }

    /// The next page's names (those of active keys, matching the pattern; a name may
    /// repeat, as `SCAN` may return a key twice). A page that fails leaves the cursor
    /// where it was, so that the next call asks the same page again.
    pub fn page(&mut self, node: &Node) -> Result<Vec<Vec<u8>>> {
        let Some(matching) = self.matches.last() else {
            return Ok(Vec::new());
        };
        let (next, keys): (u64, Vec<Vec<u8>>) = node.run(Retry::LOST_REPLY, |c| {
            redis::cmd("SCAN")
                .arg(self.cursor)
                .arg("MATCH")
                .arg(matching)
                .arg("COUNT")
                .arg(PAGE)
                .query(c)
        })?;
        self.cursor = next;
        if next == 0 {
            self.matches.pop();
        }
        Ok(keys
            .iter()
            .filter_map(|k| name_of_key(self.prefix.as_bytes(), k))
            .filter(|(name, suffix)| {
                ACTIVE_SUFFIXES.contains(suffix) && glob_match(&self.pattern, name)
            })
            .map(|(name, _)| name.to_vec())
            .collect())
    }
}

/// `bytes` with Redis glob's special characters escaped, so that they match themselves.
fn glob_escape(bytes: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(bytes.len());
    for &b in bytes {
        if matches!(b, b'*' | b'?' | b'[' | b']' | b'\\') {
            out.push(b'\\');
        }
        out.push(b);
    }
    out
}

/// Whether `text` matches the Redis glob `pattern` (`*`, `?`, `[abc]`, `[^a-z]`, `\x`), as
/// `SCAN MATCH` does: the escaped key form's `MATCH` can also match a suffixed key whose
/// name does not, so names are checked again once decoded.
pub(crate) fn glob_match(pattern: &[u8], text: &[u8]) -> bool {
    let (mut p, mut t) = (0, 0);
    // Where the last `*` was, and the text position it was tried at.
    let mut star: Option<(usize, usize)> = None;
    while t < text.len() {
        let step = match pattern.get(p) {
            Some(b'*') => {
                star = Some((p, t));
                p += 1;
                continue;
            }
            Some(b'?') => Some(p + 1),
            Some(b'[') => class(pattern, p, text[t]),
            Some(b'\\') if p + 1 < pattern.len() => (pattern[p + 1] == text[t]).then_some(p + 2),
            Some(&c) => (c == text[t]).then_some(p + 1),
            None => None,
        };
        match (step, star) {
            (Some(next), _) => {
                p = next;
                t += 1;
            }
            (None, Some((sp, st))) => {
                star = Some((sp, st + 1));
                p = sp + 1;
                t = st + 1;
            }
            (None, None) => return false,
        }
    }
    pattern[p.min(pattern.len())..].iter().all(|&c| c == b'*')
}

/// Matches `c` against the class starting at `pattern[open]` (`[`); the index after the
/// class when it matches. An unclosed class runs to the end of the pattern, as in Redis.
fn class(pattern: &[u8], open: usize, c: u8) -> Option<usize> {
    let mut hit = false;
    let (negate, end) = class_members(pattern, open, |member| {
        hit |= match member {
            Member::Byte(b) => b == c,
            Member::Range(a, b) => (a.min(b)..=a.max(b)).contains(&c),
        }
    });
    (hit != negate).then_some(end)
}

/// One member of a glob class.
#[derive(Clone, Copy)]
enum Member {
    /// A byte, given as itself or escaped (`\]`).
    Byte(u8),
    /// `a-b`, the ends as written (either may be the lower).
    Range(u8, u8),
}

/// Reads the class starting at `pattern[open]` (`[`) and gives each of its members to
/// `member`; returns whether it is negated (`[^`) and the index after it. An unclosed
/// class runs to the end of the pattern; a `-` before the closing `]` is a byte, not a
/// range. One reading, shared by [`glob_match`] and [`match_pattern`], so the two agree.
fn class_members(pattern: &[u8], open: usize, mut member: impl FnMut(Member)) -> (bool, usize) {
    let mut i = open + 1;
    let negate = pattern.get(i) == Some(&b'^');
    if negate {
        i += 1;
    }
    while i < pattern.len() && pattern[i] != b']' {
        if pattern[i] == b'\\' && i + 1 < pattern.len() {
            member(Member::Byte(pattern[i + 1]));
            i += 2;
        } else if i + 2 < pattern.len() && pattern[i + 1] == b'-' && pattern[i + 2] != b']' {
            member(Member::Range(pattern[i], pattern[i + 2]));
            i += 3;
        } else {
            member(Member::Byte(pattern[i]));
            i += 1;
        }
    }
    (negate, (i + 1).min(pattern.len()))
}

/// `pattern` written for a `SCAN MATCH` that goes on after it (`}*` or `*`), so that
/// Redis reads it as [`glob_match`] does. Alone the two agree on its end, but pasted
/// before more pattern a final unpaired `\` (a backslash, to both) would escape what
/// follows, and an unclosed class would run on over it. So a final `\` is doubled and
/// each class is written closed, its single bytes escaped: Redis also reads `[a-]` as a
/// range up to `]`, where `glob_match` reads the bytes `a` and `-`. A range's ends are
/// written as given: the first is never `\` or `]`, nor `^` right after `[`, and Redis
/// orders the ends as `glob_match` does.
fn match_pattern(pattern: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(pattern.len() + 4);
    let mut p = 0;
    while p < pattern.len() {
        match pattern[p] {
            b'\\' => {
                out.push(b'\\');
                out.push(pattern.get(p + 1).copied().unwrap_or(b'\\'));
                p += 2;
            }
            b'[' => {
                let mut members = Vec::new();
                let (negate, end) = class_members(pattern, p, |member| match member {
                    Member::Byte(b) => members.extend_from_slice(&[b'\\', b]),
                    Member::Range(a, b) => members.extend_from_slice(&[a, b'-', b]),
                });
                out.push(b'[');
                if negate {
                    out.push(b'^');
                }
                out.extend_from_slice(&members);
                out.push(b']');
                p = end;
            }
            c => {
                out.push(c);
                p += 1;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs_match_as_redis_does() {
        let cases: [(&str, &str, bool); 18] = [
            ("*", "anything", true),
            ("*", "", true),
            ("a*", "abc", true),
            ("a*", "ba", false),
            ("*c", "abc", true),
            ("a?c", "abc", true),
            ("a?c", "ac", false),
            ("[ab]x", "bx", true),
            ("[^ab]x", "bx", false),
            ("[a-c]", "b", true),
            ("\\*", "*", true),
            ("\\*", "a", false),
            ("a*b*c", "aXbYbZc", true),
            ("orders:*", "orders:42", true),
            ("end\\", "end\\", true),
            ("[ab", "b", true),
            ("[a-]", "-", true),
            ("[a-]", "b", false),
        ];
        for (p, t, want) in cases {
            assert_eq!(glob_match(p.as_bytes(), t.as_bytes()), want, "{p} ~ {t}");
        }
    }

    #[test]
    fn a_counter_reads_as_its_fence_in_every_form() {
        for (value, fence) in [
            ("1712345678901234", Some(1_712_345_678_901_234)),
            ("-1712345678901234", Some(1_712_345_678_901_234)),
            ("-01712345678901234", Some(1_712_345_678_901_234)),
            ("0", None),
            ("x", None),
            ("", None),
        ] {
            assert_eq!(counter_fence(value), fence, "{value:?}");
        }
    }

    #[test]
    fn scan_patterns_cover_both_key_forms() {
        let s = Scan::new("p:", b"a*");
        assert_eq!(s.matches[1], b"p:{a*}*");
        assert_eq!(s.matches[0], b"{????????????????}p:a**");
        let s = Scan::new("p:", b"\xff*");
        assert_eq!(s.matches[1], b"p:{\xff*}*");
        let s = Scan::new("{x}*", b"");
        assert_eq!(s.matches, vec![b"{????????????????}{x}\\***".to_vec()]);
    }

    /// What follows the user's glob in a `MATCH` pattern is read as the glob's own end
    /// would be: a final `\\` doubled, classes closed, their single bytes escaped.
    #[test]
    fn scan_patterns_end_where_the_glob_ends() {
        for (glob, plain) in [
            (&b"end\\"[..], &b"p:{end\\\\}*"[..]),
            (b"a\\*\\\\", b"p:{a\\*\\\\}*"),
            (b"[ab", b"p:{[\\a\\b]}*"),
            (b"[^a-]x[z-a\\", b"p:{[^\\a\\-]x[z-a\\\\]}*"),
            (b"[\\]]", b"p:{[\\]]}*"),
        ] {
            let s = Scan::new("p:", glob);
            assert_eq!(
                s.matches[1].escape_ascii().to_string(),
                plain.escape_ascii().to_string()
            );
        }
    }
}
