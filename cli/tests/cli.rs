//! The `redbaton` binary, run as a subprocess against a real `redis-server`: its tables,
//! its JSON, the fence-checked release, and its exit codes.

mod support;

use redbaton_testkit::server::RedisServer;
use redbaton_testkit::wait::wait_for;
use redbaton_testkit::{dead_url, secs, test_server};
use serde_json::Value;

use support::{client, code, command, json, redbaton, run, stderr, stdout};

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
/// sequence) is shown escaped, in the tables and in the JSON, in the form that NAME
/// arguments take back.
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
    let shown = json(&o)["name"].as_str().expect("a name").to_owned();
    assert_eq!(
        shown,
        r"job\nadmin  lock  1700000000000000  29.9s  1  0\x1b[2J"
    );
    let o = redbaton(&srv.url(), &["status", &shown, "--json"]);
    assert_eq!(json(&o)["kind"], "lock", "{shown} addresses the name");
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
fn usage_errors_exit_2() {
    let srv = test_server();
    let o = redbaton(&srv.url(), &["release", "x"]);
    assert_eq!(code(&o), 2, "--fence is required");
    let o = redbaton(&srv.url(), &["frobnicate"]);
    assert_eq!(code(&o), 2);
    let o = run(&["--help"]);
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
    let o = command(&["status", "x", "--json"])
        .env("REDIS_URL", srv.url_with_auth())
        .output()
        .unwrap();
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(!stdout(&o).contains("right-pass"));
    let o = command(&["--help"])
        .env("REDIS_URL", srv.url_with_auth())
        .output()
        .unwrap();
    assert!(!stdout(&o).contains("right-pass"), "{}", stdout(&o));
}

/// A read-write lock's upgradable read hold is named `upgradable`, in the JSON and in the
/// table.
#[test]
fn an_upgradable_read_is_named() {
    let srv = test_server();
    let c = client(&srv);
    let _u = c.rwlock("up").upgradable_read().expect("upgradable read");
    let o = redbaton(&srv.url(), &["status", "up", "--json"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let j = json(&o);
    assert_eq!(j["holders"][0]["kind"], "upgradable", "{j}");
    let o = redbaton(&srv.url(), &["status", "up"]);
    assert!(stdout(&o).contains("1. upgradable"), "{}", stdout(&o));
}

/// A name that is not UTF-8 is listed in an escaped form that differs from any UTF-8
/// name's, and that form, given back as NAME, addresses it: `status` shows the lock and
/// `release` deletes it.
#[test]
fn a_listed_non_utf8_name_can_be_addressed() {
    let srv = test_server();
    let c = client(&srv);
    let guard = c.lock([0xff, b'j', b'o', b'b']).expect("lock");
    let _ascii = c.lock(r"\xffjob").expect("lock");
    let o = redbaton(&srv.url(), &["list", "--json"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let mut shown: Vec<String> = stdout(&o)
        .lines()
        .map(|l| {
            serde_json::from_str::<Value>(l).expect("a JSON line")["name"]
                .as_str()
                .expect("a name")
                .to_owned()
        })
        .collect();
    shown.sort();
    assert_eq!(shown, [r"\\xffjob", r"\xffjob"], "two names, two forms");
    let o = redbaton(&srv.url(), &["status", r"\xffjob", "--json"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let j = json(&o);
    assert_eq!(j["kind"], "lock", "{j}");
    assert_eq!(j["fence"], guard.fencing_token() >> 12, "{j}");
    let fence = (guard.fencing_token() >> 12).to_string();
    let o = redbaton(&srv.url(), &["release", r"\xffjob", "--fence", &fence]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(!c.inspect([0xff, b'j', b'o', b'b']).unwrap().is_held());
    assert!(
        c.inspect(r"\xffjob").unwrap().is_held(),
        "the other name stays"
    );
}

/// A NAME argument with a backslash that starts no escape is a usage error that says how
/// to write a backslash.
#[test]
fn a_bad_escape_in_a_name_is_a_usage_error() {
    let srv = test_server();
    let o = redbaton(&srv.url(), &["status", r"a\b"]);
    support::no_panic(&o);
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(stderr(&o).contains(r"`\\`"), "{}", stderr(&o));
}

/// A NAME argument that is not UTF-8 is refused by the argument parser: exit 2, a clear
/// message, no panic.
#[test]
fn a_non_utf8_name_argument_is_a_usage_error() {
    use std::os::unix::ffi::OsStrExt;
    let srv = test_server();
    let o = command(&["--url", &srv.url(), "status"])
        .arg(std::ffi::OsStr::from_bytes(b"\xffjob"))
        .output()
        .unwrap();
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    support::no_panic(&o);
    assert!(
        stderr(&o).to_lowercase().contains("utf-8"),
        "{}",
        stderr(&o)
    );
}

/// A key under the prefix whose name no lock may have (over 4,096 bytes), beside a real
/// lock: `list` is not a usage error, and lists the real lock (the key is skipped, or
/// reported on stderr with exit 3).
#[test]
fn list_survives_a_foreign_key_with_a_long_name() {
    let srv = test_server();
    let c = client(&srv);
    let _g = c.lock("real").expect("lock");
    let mut key = b"redbaton:{".to_vec();
    key.extend(std::iter::repeat_n(b'x', 5000));
    key.push(b'}');
    let () = redis::cmd("SET")
        .arg(&key)
        .arg("v")
        .query(&mut srv.conn())
        .unwrap();
    let o = redbaton(&srv.url(), &["list"]);
    support::no_panic(&o);
    assert!([0, 3].contains(&code(&o)), "stderr: {}", stderr(&o));
    assert_eq!(code(&o) == 3, !stderr(&o).is_empty(), "{}", stderr(&o));
    assert!(stdout(&o).contains("real"), "{}", stdout(&o));
}

/// A name that `list` cannot inspect (here the user may not read its keys) is reported
/// on stderr, the others are still listed, and the command ends with exit 3 (runtime), not
/// 2 (usage).
#[test]
fn list_reports_a_name_it_cannot_read_and_goes_on() {
    let srv = RedisServer::builder()
        .acl_user("ops", "ops-pass", "~redbaton:{ok}* &* +@all")
        .start();
    let c = client(&srv);
    let _ok = c.lock("ok").expect("lock");
    let _hidden = c.lock("hidden").expect("lock");
    let o = redbaton(&srv.url_as("ops", "ops-pass"), &["list"]);
    support::no_panic(&o);
    assert_eq!(code(&o), 3, "{}", stderr(&o));
    assert!(stdout(&o).contains("ok"), "{}", stdout(&o));
    assert!(!stdout(&o).contains("hidden"), "{}", stdout(&o));
    let err = stderr(&o);
    assert_eq!(
        err.lines().count(),
        2,
        "the name's error, then a summary: {err}"
    );
    assert!(err.contains("may miss names"), "{err}");
}

/// Connection options parse before the subcommand as after it, and reach the connection
/// (exit 3 for a dead address, not 2): `--cluster SEED[,SEED]` (or repeated) and
/// `--sentinel MASTER URL[,URL]`.
#[test]
fn connection_options_before_or_after_the_subcommand() {
    let dead = dead_url();
    let both = format!("{dead},{dead}");
    for args in [
        &["--cluster", &dead, "status", "x"][..],
        &["--cluster", &both, "status", "x"],
        &["--cluster", &dead, "--cluster", &dead, "status", "x"],
        &["status", "x", "--cluster", &dead],
        &["--sentinel", "mymaster", &dead, "status", "x"],
        &["--sentinel", "mymaster", &both, "status", "x"],
        &["status", "x", "--sentinel", "mymaster", &dead],
    ] {
        let o = run(args);
        support::no_panic(&o);
        assert_eq!(code(&o), 3, "{args:?}: {}", stderr(&o));
    }
}

/// A long `--timeout` (a slow link) is accepted: the command takes no lock, so no lease
/// bounds it.
#[test]
fn a_long_timeout_is_accepted() {
    let srv = test_server();
    for timeout in ["30", "60", "3600"] {
        let o = redbaton(&srv.url(), &["--timeout", timeout, "status", "x"]);
        support::no_panic(&o);
        assert_eq!(code(&o), 0, "--timeout {timeout}: {}", stderr(&o));
    }
}

/// Bad input (huge numbers, unknown flags, an empty name, a timeout out of range) is a
/// clear error with exit 2 and no panic; a huge interval with `--count 1` ends at once.
#[test]
fn bad_input_is_a_usage_error() {
    let srv = test_server();
    let url = srv.url();
    for args in [
        &["release", "x", "--fence", "99999999999999999999"][..],
        &["release", "x", "--fence", "-1"],
        &["--timeout", "18446744073709551615", "status", "x"],
        &["--timeout", "99999999999999999999", "status", "x"],
        &["--timeout", "0", "status", "x"],
        &["--timeout", "3601", "status", "x"],
        &["status", "x", "--frobnicate"],
        &["status", ""],
        &["release", "", "--fence", "1"],
        &["watch", "x", "--interval", "-5"],
    ] {
        let o = redbaton(&url, args);
        support::no_panic(&o);
        assert_eq!(code(&o), 2, "{args:?}: {}", stderr(&o));
        assert!(!stderr(&o).trim().is_empty(), "{args:?}: a message");
    }
    let t = std::time::Instant::now();
    let o = redbaton(
        &url,
        &[
            "watch",
            "x",
            "--interval",
            "18446744073709551615",
            "--count",
            "1",
        ],
    );
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(t.elapsed() < secs(20));
    // The largest fence: refused as not held, exit 1.
    let o = redbaton(&url, &["release", "x", "--fence", "18446744073709551615"]);
    support::no_panic(&o);
    assert_eq!(code(&o), 1, "{}", stderr(&o));
}

/// Exit codes of `release`: 0 released, 1 wrong fence, 1 not held, 1 another kind; 3 when
/// the server is gone.
#[test]
fn release_exit_codes() {
    let srv = test_server();
    let c = client(&srv);
    let g = c.lock("rel").expect("lock");
    let fence = (g.fencing_token() >> 12).to_string();
    let wrong = (g.fencing_token() >> 12).saturating_add(1).to_string();
    let release = |url: &str, name: &str, fence: &str| {
        code(&redbaton(url, &["release", name, "--fence", fence]))
    };
    assert_eq!(release(&srv.url(), "rel", &wrong), 1);
    assert_eq!(release(&srv.url(), "rel", &fence), 0);
    assert_eq!(release(&srv.url(), "rel", &fence), 1);
    let _p = c.semaphore("sem", 2).acquire().expect("permit");
    assert_eq!(release(&srv.url(), "sem", "1"), 1);
    drop(g);
    let o = redbaton(&dead_url(), &["release", "rel", "--fence", &fence]);
    support::no_panic(&o);
    assert_eq!(code(&o), 3, "{}", stderr(&o));
}
