//! Running the `redbaton` binary as a subprocess, and reading what it did.

// Each test file uses its own part of these.
#![allow(dead_code)]

use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};

use redbaton::LockClient;
use redbaton_testkit::server::RedisServer;
use serde_json::Value;

pub const BIN: &str = env!("CARGO_BIN_EXE_redbaton");

/// The command with `args`, `$REDIS_URL` and `$REDBATON_MASTER_PASSWORD` unset.
pub fn command(args: &[&str]) -> Command {
    let mut c = Command::new(BIN);
    c.args(args)
        .env_remove("REDIS_URL")
        .env_remove("REDBATON_MASTER_PASSWORD")
        .env("RUST_BACKTRACE", "1");
    c
}

/// Runs `redbaton args...`.
pub fn run(args: &[&str]) -> Output {
    command(args).output().expect("run redbaton")
}

/// Runs `redbaton --url URL args...`.
pub fn redbaton(url: &str, args: &[&str]) -> Output {
    run(&[&["--url", url], args].concat())
}

/// Spawns `redbaton --url URL args...` with stdout and stderr piped.
pub fn spawn(url: &str, args: &[&str]) -> Child {
    command(&[&["--url", url], args].concat())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn redbaton")
}

/// Waits up to `limit` for `child` to exit; kills it (it is ours) and returns `None` when
/// it is still running then.
pub fn exit_within(child: &mut Child, limit: Duration) -> Option<ExitStatus> {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            return Some(status);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

pub fn code(o: &Output) -> i32 {
    o.status.code().expect("exited")
}

pub fn json(o: &Output) -> Value {
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {}", stdout(o)))
}

/// No panic, no backtrace on stderr.
pub fn no_panic(o: &Output) {
    let err = stderr(o);
    assert!(
        !err.contains("panicked") && !err.contains("backtrace"),
        "{err}"
    );
}

pub fn client(srv: &RedisServer) -> LockClient {
    LockClient::builder()
        .node(srv.url())
        .build()
        .expect("client")
}
