//! Support for redbaton's documentation examples, which run against a real `redis-server`
//! like every other test of the crate.
//!
//! [`redis_url`] starts a throwaway server (loopback, free port, temp dir, persistence
//! off) and returns its URL. Examples do not share servers, so two of them locking the
//! same name at once cannot disturb each other.
//!
//! A doctest's process exits without dropping statics, so the servers are never stopped
//! from here: the harness gives each one a reaper that kills it by PID, and removes its
//! temp dir, once this process is gone (see `tests/support/server.rs`).

use parking_lot::Mutex;

#[path = "../../tests/support/server.rs"]
#[allow(dead_code)]
mod server;

use server::RedisServer;

/// Servers handed out, kept running until this process ends.
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
