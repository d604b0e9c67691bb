//! The `redbaton` binary under faults, run as a subprocess against a real `redis-server`:
//! a stalled server, a release whose reply is lost, a fair queue of waiters that died, a
//! semaphore's waiters.

mod support;

use std::time::Duration;

use redbaton_testkit::keys::Keys;
use redbaton_testkit::proxy::Proxy;
use redbaton_testkit::{exists, test_server};

use support::{client, code, exit_within, no_panic, redbaton, spawn, stderr, stdout};

const KEYS: Keys = Keys::DEFAULT;

#[test]
fn smoke() {
    let srv = test_server();
    let o = redbaton(&srv.url(), &["status", "smoke"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(stdout(&o).contains("free"), "{}", stdout(&o));
}

/// A server that accepts connections and answers nothing (stopped): each command gives up
/// after `--timeout` with exit 3 and one line on stderr, no panic, no hang.
#[test]
fn a_stalled_server_exits_3() {
    let srv = test_server();
    srv.pause();
    for args in [
        &["status", "x"][..],
        &["list"],
        &["watch", "x", "--count", "2"],
        &["release", "x", "--fence", "7"],
    ] {
        let mut child = spawn(&srv.url(), &[&["--timeout", "1"], args].concat());
        let status = exit_within(&mut child, Duration::from_secs(20));
        let o = child.wait_with_output().expect("output");
        assert_eq!(
            status.and_then(|s| s.code()),
            Some(3),
            "{args:?}: {}",
            stderr(&o)
        );
        no_panic(&o);
        assert_eq!(stderr(&o).lines().count(), 1, "{args:?}: {}", stderr(&o));
        assert!(stdout(&o).is_empty(), "{args:?}: {}", stdout(&o));
    }
    srv.resume();
}

/// `release` deletes the lock but its reply is lost (the connection drops). Nothing says
/// whether the script ran, so the command fails (exit 3) without claiming that nothing was
/// done: it tells the operator that the release may have happened and how to look.
#[test]
fn a_release_whose_reply_is_lost_says_its_outcome_is_unknown() {
    let srv = test_server();
    let proxy = Proxy::start(srv.addr());
    let holder = client(&srv);
    let guard = holder.lock("lost-reply").expect("lock");
    let fence = (guard.fencing_token() >> 12).to_string();
    // Loads the release script on the server, so that the armed request is the script
    // itself (not a NOSCRIPT round).
    let o = redbaton(&proxy.url(), &["release", "warm-up", "--fence", "1"]);
    assert_eq!(code(&o), 1, "{}", stderr(&o));
    proxy.drop_next_reply_matching(fence.as_bytes());
    let o = redbaton(&proxy.url(), &["release", "lost-reply", "--fence", &fence]);
    assert_eq!(proxy.replies_dropped(), 1, "the fault fired");
    assert!(
        !exists(&mut srv.conn(), KEYS.lock_bytes(b"lost-reply")),
        "the lock was deleted"
    );
    assert_eq!(code(&o), 3, "{}", stderr(&o));
    no_panic(&o);
    let err = stderr(&o);
    assert!(
        err.contains("unknown") && err.contains("redbaton status lost-reply"),
        "{err}"
    );
    drop(guard);
}

/// A fair lock held, and its queue left with three entries whose waiters died (expired,
/// not yet dropped: they will never be granted). `status` and `list` count the processes
/// waiting, none here, and `status` tells the expired entries apart.
#[test]
fn expired_queue_entries_are_not_counted_as_waiting() {
    let srv = test_server();
    let _guard = client(&srv).lock("fifo").expect("lock");
    let lock = KEYS.lock("fifo");
    let mut conn = srv.conn();
    for (suffix, score) in [(":q", 1_000_000), (":qx", 1)] {
        let mut entries = redis::cmd("ZADD");
        entries.arg(format!("{lock}{suffix}"));
        for waiter in ["dead-1", "dead-2", "dead-3"] {
            entries.arg(score).arg(waiter);
        }
        entries.exec(&mut conn).expect("zadd");
    }
    let o = redbaton(&srv.url(), &["status", "fifo"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let table = stdout(&o);
    assert!(
        table.contains("queue           0 waiting, 3 expired"),
        "{table}"
    );
    let o = redbaton(&srv.url(), &["list"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let listed = stdout(&o);
    let line = listed
        .lines()
        .find(|l| l.starts_with("fifo "))
        .unwrap_or_else(|| panic!("{listed}"));
    assert_eq!(line.split_whitespace().last(), Some("0"), "{listed}");
}

/// A semaphore's waiting processes are marked in the set a read-write lock's waiting
/// writers use; `status` calls them what they are, waiters for a permit, not writers.
#[test]
fn a_semaphores_waiters_are_not_called_writers() {
    let srv = test_server();
    let _permit = client(&srv).semaphore("pool", 1).acquire().expect("permit");
    redis::cmd("ZADD")
        .arg(format!("{}:ww", KEYS.lock("pool")))
        .arg(9e15)
        .arg("a waiting process")
        .exec(&mut srv.conn())
        .expect("zadd");
    let o = redbaton(&srv.url(), &["status", "pool"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let table = stdout(&o);
    assert!(table.contains("kind            semaphore/1"), "{table}");
    assert!(table.contains("permit waiters  1"), "{table}");
    assert!(!table.contains("writers"), "{table}");
}
