//! Test support for redbaton: its integration tests, benches, examples, documentation
//! examples and the `redbaton-contend` tool all run against real `redis-server` processes
//! started from here.
//!
//! * [`server`]: a throwaway `redis-server` per test ([`server::RedisServer`]).
//! * [`proxy`]: a fault-injecting TCP proxy (delays, lost replies, partitions).
//! * [`child`]: real child processes contending for locks.
//! * [`cluster`]: a Redis Cluster of three masters and three replicas.
//! * [`clock`]: clocks whose readings can be compared between processes.
//! * [`keys`]: the Redis keys and fencing-token layout of the lock protocol, as the
//!   tests observe them from outside.
//! * [`leftover`]: every kind of key the library writes and how long each may stay.
//! * [`history`]: seeds, histories and violations of replayable randomized tests.
//! * [`stalls`]: when the test process itself did not run (a loaded machine), so that
//!   liveness checks do not blame the library for it.
//! * [`sections`]: checking critical sections for overlaps nobody was told of.
//! * [`wait`]: polling and joining with a deadline, so a broken test fails instead of
//!   hanging.
//!
//! [`redis_url`] starts a throwaway server (loopback, free port, temp dir, persistence
//! off) for one documentation example and returns its URL. Examples do not share servers,
//! so two of them locking the same name at once cannot disturb each other.
//!
//! A doctest's process exits without dropping statics, so those servers are never stopped
//! from here: the harness gives each one a reaper that kills it by PID, and removes its
//! temp dir, once this process is gone (see [`server`]).
//!
//! This crate does not depend on `redbaton`: what it knows of the lock's protocol is
//! written down in [`keys`] and checked by the integration tests.

use std::time::Duration;

use parking_lot::Mutex;

pub mod child;
pub mod clock;
pub mod cluster;
pub mod history;
pub mod keys;
pub mod leftover;
pub mod proxy;
pub mod sections;
pub mod sentinel;
pub mod server;
pub mod stalls;
pub mod tls;
pub mod wait;

use server::RedisServer;

/// Servers handed out by [`redis_url`], kept running until this process ends.
static KEPT: Mutex<Vec<RedisServer>> = Mutex::new(Vec::new());

/// Starts a throwaway `redis-server` for one example and returns its URL
/// (`redis://127.0.0.1:PORT/`).
///
/// Panics with an install hint when `redis-server` is not on `PATH`: examples never skip.
pub fn redis_url() -> String {
    let server = RedisServer::start();
    let url = server.url();
    KEPT.lock().push(server);
    url
}

/// Shorthand for `Duration::from_millis`, to keep timing-heavy tests legible.
pub fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// Shorthand for `Duration::from_secs`.
pub fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

/// Placeholder for logger setup (env_logger may be wired in later); tests
/// call it first so that change will not touch every test.
pub fn init_log() {}

/// A raw connection to `url` (5 s to connect, 10 s per read or write), so that a broken
/// test fails instead of hanging. Panics when it cannot connect.
pub fn raw_conn(url: &str) -> redis::Connection {
    let conn = redis::Client::open(url)
        .unwrap_or_else(|e| panic!("redis url {url}: {e}"))
        .get_connection_with_timeout(secs(5))
        .unwrap_or_else(|e| panic!("connect to {url}: {e}"));
    conn.set_read_timeout(Some(secs(10))).expect("read timeout");
    conn.set_write_timeout(Some(secs(10)))
        .expect("write timeout");
    conn
}

/// Whether `key` exists (`EXISTS`).
pub fn exists(conn: &mut redis::Connection, key: impl redis::ToRedisArgs) -> bool {
    redis::cmd("EXISTS")
        .arg(key)
        .query::<i64>(conn)
        .expect("EXISTS")
        == 1
}

/// `PTTL key`: milliseconds left, -1 without expiry, -2 when the key does not exist.
pub fn pttl(conn: &mut redis::Connection, key: impl redis::ToRedisArgs) -> i64 {
    redis::cmd("PTTL").arg(key).query(conn).expect("PTTL")
}
