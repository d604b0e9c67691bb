//! Support for redbaton's documentation examples, which run against a real `redis-server`
//! like every other test of the crate.
//!
//! [`redis_url`] starts a throwaway server (loopback, free port, temp dir, persistence
//! off) and returns its URL. Examples do not share servers, so two of them locking the
//! same name at once cannot disturb each other.
//!
//! A doctest's process exits without running destructors of statics, and may be killed,
//! so each server comes with a reaper: a `sh` child blocked reading a pipe from this
//! process. When this process is gone, however it went, the pipe closes and the reaper
//! kills the server by PID and removes its temp dir.

use std::process::{Child, ChildStdin, Command, Stdio};

use parking_lot::Mutex;

#[path = "../../tests/support/server.rs"]
#[allow(dead_code)]
mod server;

use server::RedisServer;

/// A server kept alive until this process ends, and its reaper's pipe.
struct Kept {
    _server: RedisServer,
    _reaper: Child,
    _pipe: ChildStdin,
}

/// Servers handed out; never dropped (the reapers stop them at exit).
static KEPT: Mutex<Vec<Kept>> = Mutex::new(Vec::new());

/// Starts a throwaway `redis-server` for one example and returns its URL
/// (`redis://127.0.0.1:PORT/`).
///
/// Panics with an install hint when `redis-server` is not on `PATH`: examples never skip.
pub fn redis_url() -> String {
    let server = RedisServer::start();
    let url = server.url();
    // `read` returns at end of file, that is when every write end of the pipe is closed:
    // this process exited. `$0` and `$1` are the PID and the directory.
    let mut reaper = Command::new("sh")
        .arg("-c")
        .arg(r#"read _; kill -9 "$0" 2>/dev/null; rm -rf "$1""#)
        .arg(server.pid().to_string())
        .arg(server.dir())
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn the reaper shell of a doc example's redis-server");
    let pipe = reaper.stdin.take().expect("reaper stdin is piped");
    KEPT.lock().push(Kept {
        _server: server,
        _reaper: reaper,
        _pipe: pipe,
    });
    url
}
