//! The `redbaton` binary, run as a subprocess against a real `redis-server`: its tables,
//! its JSON, the fence-checked release, and its exit codes.

use std::process::{Command, Output};

use redbaton::LockClient;
use redbaton_testkit::server::RedisServer;
use redbaton_testkit::wait::wait_for;
use redbaton_testkit::{dead_url, secs, test_server};
use serde_json::Value;

fn redbaton(url: &str, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_redbaton"))
        .arg("--url")
        .arg(url)
        .args(args)
        .env_remove("REDIS_URL")
        .env("RUST_BACKTRACE", "1")
        .output()
        .expect("run redbaton")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn code(o: &Output) -> i32 {
    o.status.code().expect("exited")
}

fn json(o: &Output) -> Value {
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {}", stdout(o)))
}

fn client(srv: &RedisServer) -> LockClient {
    LockClient::builder()
        .node(srv.url())
        .build()
        .expect("client")
}

#[test]
fn smoke() {
    let srv = test_server();
    let c = client(&srv);
    let guard = c.lock("job").expect("lock");
    let fence = guard.fencing_token() >> 12;
    let o = redbaton(&srv.url(), &["status", "job"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.contains("kind            lock"), "{out}");
    assert!(out.contains(&format!("fence           {fence}")), "{out}");
    assert!(out.contains("lease left"), "{out}");
}

/// The status table and JSON of a lock with a waiting process; printed for the README.
#[test]
fn status_shows_the_holder_and_the_queue() {
    let srv = test_server();
    let (holder, waiter) = (client(&srv), client(&srv));
    let guard = holder.lock("orders:42").expect("lock");
    let fence = guard.fencing_token() >> 12;
    std::thread::scope(|s| {
        let w = s.spawn(|| waiter.try_lock_for("orders:42", secs(30)).map(drop));
        wait_for(secs(20), "the waiter to queue", || {
            !holder.inspect("orders:42").unwrap().queue.is_empty()
        });
        let o = redbaton(&srv.url(), &["status", "orders:42"]);
        assert_eq!(code(&o), 0);
        let table = stdout(&o);
        println!("$ redbaton status orders:42\n{table}");
        assert!(table.contains("queue           1 waiting"), "{table}");
        assert!(table.contains("1. waiting"), "{table}");
        let o = redbaton(&srv.url(), &["status", "orders:42", "--json"]);
        assert_eq!(code(&o), 0);
        let j = json(&o);
        println!("$ redbaton status orders:42 --json\n{j}");
        assert_eq!(j["name"], "orders:42");
        assert_eq!(j["kind"], "lock");
        assert_eq!(j["fence"], fence);
        assert!(j["ttl_ms"].as_u64().unwrap() > 0);
        assert_eq!(j["holders"].as_array().unwrap().len(), 1);
        assert_eq!(j["holders"][0]["fence"], fence);
        assert_eq!(j["holders"][0]["mine"], false, "the command holds nothing");
        assert_eq!(j["queue"].as_array().unwrap().len(), 1);
        drop(guard);
        w.join().unwrap().expect("the waiter's turn");
    });
}

#[test]
fn an_unknown_name_is_free() {
    let srv = test_server();
    let o = redbaton(&srv.url(), &["status", "nobody", "--json"]);
    assert_eq!(code(&o), 0);
    let j = json(&o);
    assert_eq!(j["kind"], "free");
    assert_eq!(j["fence"], Value::Null);
    assert_eq!(j["ttl_ms"], Value::Null);
    assert_eq!(j["holders"], serde_json::json!([]));
    assert_eq!(j["queue"], serde_json::json!([]));
    let o = redbaton(&srv.url(), &["release", "nobody", "--fence", "1"]);
    assert_eq!(code(&o), 1, "nothing to release");
    assert!(stdout(&o).contains("not held"), "{}", stdout(&o));
}

#[test]
fn list_shows_held_names() {
    let srv = test_server();
    let c = client(&srv);
    let _a = c.lock("jobs:a").expect("lock");
    let _b = c.lock("jobs:b").expect("lock");
    let _p = c.semaphore("pool", 4).acquire().expect("permit");
    let o = redbaton(&srv.url(), &["list"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let out = stdout(&o);
    println!("$ redbaton list\n{out}");
    assert!(out.starts_with("NAME"), "{out}");
    for name in ["jobs:a", "jobs:b", "pool"] {
        assert!(out.contains(name), "{out}");
    }
    assert!(out.contains("semaphore/4"), "{out}");
    let o = redbaton(&srv.url(), &["list", "jobs:*", "--json"]);
    assert_eq!(code(&o), 0);
    let lines: Vec<Value> = stdout(&o)
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect();
    assert_eq!(lines.len(), 2);
    assert!(
        lines
            .iter()
            .all(|j| j["kind"] == "lock" && j["fence"].is_u64())
    );
    let o = redbaton(&srv.url(), &["list", "--prefix", "other:"]);
    assert_eq!(stdout(&o).lines().count(), 1, "only the header");
}

/// A name with control characters (a newline that would start a forged row, an escape
/// sequence) is shown escaped in the tables, and as it is in the JSON.
#[test]
fn a_name_cannot_forge_table_rows() {
    let srv = test_server();
    let name = "job\nadmin  lock  1700000000000000  29.9s  1  0\u{1b}[2J";
    let _guard = client(&srv).lock(name).expect("lock");
    let o = redbaton(&srv.url(), &["list"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let out = stdout(&o);
    assert_eq!(out.lines().count(), 2, "the header and one row:\n{out}");
    assert!(
        out.contains(r"job\nadmin") && !out.contains('\u{1b}'),
        "{out}"
    );
    let o = redbaton(&srv.url(), &["list", "--json"]);
    assert_eq!(json(&o)["name"], name);
}

#[test]
fn release_checks_the_fence() {
    let srv = test_server();
    let c = client(&srv);
    let guard = c.lock("stuck").expect("lock");
    let fence = guard.fencing_token() >> 12;
    let wrong = (fence - 1).to_string();
    let o = redbaton(&srv.url(), &["release", "stuck", "--fence", &wrong]);
    assert_eq!(code(&o), 1, "refused");
    assert!(stdout(&o).contains("refused"), "{}", stdout(&o));
    assert!(c.inspect("stuck").unwrap().is_held(), "nothing deleted");
    let right = fence.to_string();
    let o = redbaton(
        &srv.url(),
        &["release", "stuck", "--fence", &right, "--json"],
    );
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let j = json(&o);
    assert_eq!(j["released"], true);
    assert!(!c.inspect("stuck").unwrap().is_held());
    drop(guard);
    // A read-write lock is never force-released.
    let _r = c.rwlock("rw").read().expect("read");
    let o = redbaton(&srv.url(), &["release", "rw", "--fence", "1"]);
    assert_eq!(code(&o), 1);
    assert!(c.inspect("rw").unwrap().is_held());
}

#[test]
fn watch_refreshes() {
    let srv = test_server();
    let o = redbaton(
        &srv.url(),
        &["watch", "w", "--interval", "10", "--count", "3", "--json"],
    );
    assert_eq!(code(&o), 0);
    assert_eq!(stdout(&o).lines().count(), 3);
}

#[test]
fn usage_errors_exit_2() {
    let srv = test_server();
    let o = redbaton(&srv.url(), &["release", "x"]);
    assert_eq!(code(&o), 2, "--fence is required");
    let o = redbaton(&srv.url(), &["frobnicate"]);
    assert_eq!(code(&o), 2);
    let o = Command::new(env!("CARGO_BIN_EXE_redbaton"))
        .arg("--help")
        .output()
        .unwrap();
    assert!(stdout(&o).contains("Exit codes"), "{}", stdout(&o));
}

/// Nothing listens: one line on stderr, exit 3, no panic.
#[test]
fn an_unreachable_server_exits_3() {
    let o = redbaton(&dead_url(), &["status", "x"]);
    assert_eq!(code(&o), 3);
    let err = stderr(&o);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        !err.contains("panicked") && !err.contains("backtrace"),
        "{err}"
    );
    assert!(stdout(&o).is_empty());
}

/// Refused credentials are a connection failure, and the password is never printed.
#[test]
fn credentials_are_never_echoed() {
    let srv = RedisServer::builder().password("right-pass").start();
    let bad = format!("redis://:wrong-pass-123@127.0.0.1:{}/", srv.port());
    let o = redbaton(&bad, &["status", "x"]);
    assert_eq!(code(&o), 3);
    assert!(!stderr(&o).contains("wrong-pass-123"), "{}", stderr(&o));
    let o = Command::new(env!("CARGO_BIN_EXE_redbaton"))
        .args(["status", "x", "--json"])
        .env("REDIS_URL", srv.url_with_auth())
        .output()
        .unwrap();
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(!stdout(&o).contains("right-pass"));
    let o = Command::new(env!("CARGO_BIN_EXE_redbaton"))
        .arg("--help")
        .env("REDIS_URL", srv.url_with_auth())
        .output()
        .unwrap();
    assert!(!stdout(&o).contains("right-pass"), "{}", stdout(&o));
}
