//! Fenced writes: the protected resource refuses a stale holder's write.
//!
//! ```text
//! cargo run --example fenced_write
//! ```
//!
//! A lease can run out under a holder that is paused (a long GC, a stopped VM, a swap
//! storm): when it wakes, it still believes it holds the lock, and another holder may
//! already be writing. No lock can stop the paused one's write in flight; the resource
//! can, by remembering the highest fencing token it has seen and refusing lower ones.
//!
//! Here the resource is a hash in Redis, written by one script that compares tokens
//! (`FENCED_SET` below). For a SQL table the same check is one statement:
//!
//! ```sql
//! UPDATE accounts SET balance = $1, fence = $2 WHERE id = $3 AND fence < $2;
//! -- 0 rows updated: a newer holder has written since; give up, do not retry
//! ```
//!
//! Uses `REDIS_URL` when set; otherwise Redis on 127.0.0.1:6379 if one answers; otherwise it
//! starts a throwaway `redis-server` and stops it at the end.

use std::time::Duration;

use clap::Parser;
use redbaton::LockClient;

/// Fenced writes: a holder paused past its lease wakes and writes with its old fencing
/// token; the resource (a hash in Redis that keeps the highest token it saw) refuses it.
///
/// Redis: $REDIS_URL when set; else 127.0.0.1:6379 if one answers; else a throwaway
/// redis-server (temp dir, no persistence) started here and stopped at the end.
#[derive(Parser)]
struct Cli {}

/// Writes `value` to the hash `KEYS[1]` only if the fencing token `ARGV[1]` is higher than
/// the last one that wrote it; returns 1 when written, 0 when refused as stale. Tokens are
/// compared as numbers: a token is below 2^64 and Lua's numbers are doubles, so they are
/// compared as strings of equal length instead (zero-padded to 20 digits).
const FENCED_SET: &str = r"
local last = redis.call('HGET', KEYS[1], 'fence') or ''
if #last == #ARGV[1] and last >= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'value', ARGV[2], 'fence', ARGV[1])
return 1
";

/// The token as the script compares it: 20 digits, zero-padded.
fn padded(token: u64) -> String {
    format!("{token:020}")
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    Cli::parse();
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let (url, _server) = redbaton_testkit::example_redis(true);
    println!("using {url}");
    let script = redis::Script::new(FENCED_SET);
    let mut conn = redis::Client::open(url.as_str())?.get_connection()?;
    let resource = "fenced:account:42";
    redis::cmd("DEL").arg(resource).query::<()>(&mut conn)?;
    // The resource's one way in: whether the write under `token` was accepted.
    let mut write = |token: u64, value: &str| -> redis::RedisResult<bool> {
        let written: i64 = script
            .key(resource)
            .arg(padded(token))
            .arg(value)
            .invoke(&mut conn)?;
        Ok(written == 1)
    };

    // Two processes' clients; short leases and no watchdog, so that a pause outlives one.
    let client = || {
        LockClient::builder()
            .node(url.as_str())
            .key_prefix("fenced:")
            .lease(Duration::from_millis(300))
            .auto_renew(false)
            .build()
    };
    let (slow, fast) = (client()?, client()?);

    let first = slow.lock("account:42")?;
    let stale = first.fencing_token();
    println!("holder 1 took the lock, token {stale}, and pauses longer than its lease");
    std::thread::sleep(Duration::from_millis(600));

    let second = fast.lock("account:42")?;
    let fresh = second.fencing_token();
    let accepted = write(fresh, "balance 100")?;
    println!("holder 2 took the lock, token {fresh}: write accepted = {accepted}");

    // Holder 1 wakes: its guard can tell it the lease is over, but a write already on its
    // way cannot be called back. The resource refuses it.
    println!("holder 1 wakes: still valid = {}", first.check().is_ok());
    let refused = !write(stale, "balance 0")?;
    println!(
        "holder 1 writes anyway with token {stale}: write accepted = {}",
        !refused
    );
    let value: String = redis::cmd("HGET")
        .arg(resource)
        .arg("value")
        .query(&mut conn)?;
    println!("the account says {value:?}");
    assert!(fresh > stale && accepted && refused && value == "balance 100");
    println!("holder 1 unlocks: {:?}", first.unlock()?);
    println!("holder 2 unlocks: {:?}", second.unlock()?);
    redis::cmd("DEL").arg(resource).query::<()>(&mut conn)?;
    Ok(())
}
