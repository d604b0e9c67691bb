//! A lock in the style of python-redis-lock, the queue-based peer the tool compares with:
//! `SET NX PX` to take it; a waiter that fails blocks in `BLPOP` on the lock's signal
//! list; the release deletes the lock and pushes one element on the signal list (one
//! script), which wakes exactly one waiter, which then retries. No fencing counter.

use std::sync::LazyLock;
use std::sync::atomic::{AtomicU64, Ordering};

use redbaton_testkit::keys::HANDOFF_BITS;
use redis::{Connection, RedisResult, Script};

/// python-redis-lock's unlock script: compare, then signal one waiter and delete.
static UNLOCK: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r#"
if redis.call("get", KEYS[1]) ~= ARGV[1] then
  return 1
else
  redis.call("del", KEYS[2])
  redis.call("lpush", KEYS[2], 1)
  redis.call("pexpire", KEYS[2], ARGV[2])
  redis.call("del", KEYS[1])
  return 0
end
"#,
    )
});

/// How long a release's signal lives (python-redis-lock's `signal_expire`, ms).
const SIGNAL_EXPIRE_MS: u64 = 1000;

static NEXT: AtomicU64 = AtomicU64::new(1);

/// Takes `lock` with a fresh token (blocking); returns the token and a number unique to
/// this acquisition (in the place of a fence, for the tool's tenure counts).
pub fn lock(
    conn: &mut Connection,
    lock: &str,
    lease_ms: u64,
    worker: usize,
) -> RedisResult<(String, u64)> {
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let token = format!("{worker}-{n}");
    let signal = format!("{lock}:signal");
    loop {
        let got: Option<String> = redis::cmd("SET")
            .arg(lock)
            .arg(&token)
            .arg("NX")
            .arg("PX")
            .arg(lease_ms)
            .query(conn)?;
        if got.is_some() {
            return Ok((token, ((worker as u64) << 40 | n) << HANDOFF_BITS));
        }
        // python-redis-lock blocks for the lock's expiry at most, then retries.
        let _: Option<(String, String)> = redis::cmd("BLPOP")
            .arg(&signal)
            .arg((lease_ms / 1000).max(1))
            .query(conn)?;
    }
}

/// Releases `lock` if `token` still holds it, waking one waiter.
pub fn unlock(conn: &mut Connection, lock: &str, token: &str) -> RedisResult<bool> {
    let signal = format!("{lock}:signal");
    let r: i64 = UNLOCK
        .key(lock)
        .key(&signal)
        .arg(token)
        .arg(SIGNAL_EXPIRE_MS)
        .invoke(conn)?;
    Ok(r == 0)
}
