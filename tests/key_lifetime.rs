//! How long every key the library writes lives, key by key, against a real redis-server:
//! each primitive (plain and fair lock, read-write lock with upgrades and downgrades,
//! semaphore, latch, multi-lock, inspect) through normal use and through faults (holders
//! and waiters killed, replies lost, timeouts, cancels, a server restart). While they run
//! and after, every key under the prefix carries a TTL within its documented bound; once
//! the leases have ended, only the fence counters (`fence_ttl`) and latches (`latch_ttl`)
//! are left.
//!
//! Run it alone with `cargo test --test key_lifetime`.

use std::sync::Arc;
use std::thread;
use std::time::Duration;

use redbaton::{Cancel, LockClient};
use redbaton_testkit::child;
use redbaton_testkit::keys::Keys;
use redbaton_testkit::leftover::{self, Allowed, KeyPolicy};
use redbaton_testkit::proxy::Proxy;
use redbaton_testkit::server::RedisServer;
use redbaton_testkit::wait::{join_within, wait_for};
use redbaton_testkit::{lock_client, ms, secs, test_server};

const PREFIX: &str = "life:";
const KEYS: Keys = Keys::new(PREFIX);
const LEASE: Duration = Duration::from_secs(1);
const RECHECK: Duration = Duration::from_millis(100);
const FENCE_TTL: Duration = Duration::from_secs(3);
const LATCH_TTL: Duration = Duration::from_secs(2);

/// A client of `url` with the bounds of [`policy`].
fn client(url: &str) -> LockClient {
    client_with(url, LEASE, false)
}

/// A client of `url` with the bounds of [`policy`] but for its `lease` (and a fence TTL of
/// at least twice it), fair or not.
fn client_with(url: &str, lease: Duration, fair: bool) -> LockClient {
    lock_client!(
        node(url),
        key_prefix(PREFIX),
        lease(lease),
        read_timeout(ms(500)),
        recheck_interval(RECHECK),
        fence_ttl(FENCE_TTL.max(lease * 2)),
        latch_ttl(LATCH_TTL),
        fair(fair)
    )
}

/// The documented bounds of [`client`]'s keys: a lock key (a plain lock's, or the holds
/// of a shared one) its lease, a mark twice the re-check interval, a waiting set twice a
/// mark, a fair queue an entry plus 1 s, the fence counter `fence_ttl`.
fn policy() -> KeyPolicy {
    let mut p = KeyPolicy::new(LEASE, RECHECK);
    p.fence = Allowed::Within(FENCE_TTL);
    p.queue = Allowed::Within(RECHECK * 2 + secs(1));
    p
}

/// Every key under the prefix that breaks its bound: no TTL, a TTL longer than
/// documented, or a key of no known kind. A shared lock key lives no longer than its
/// longest hold, a lease (the policy's default allows two).
fn misplaced(srv: &RedisServer, names: &[&str]) -> Vec<String> {
    let mut conn = srv.conn();
    let mut bad = Vec::new();
    for m in leftover::misplaced(&mut conn, KEYS, names, &policy()) {
        let latch = names
            .iter()
            .any(|n| m.key == format!("{}:latch", KEYS.lock(n)));
        if latch {
            if m.pttl <= 0 || m.pttl as u128 > LATCH_TTL.as_millis() {
                bad.push(format!("{}: latch with PTTL {}", m.key, m.pttl));
            }
        } else {
            bad.push(m.to_string());
        }
    }
    for n in names {
        let lock = KEYS.lock(n);
        let pttl = redbaton_testkit::pttl(&mut conn, &lock);
        if pttl > LEASE.as_millis() as i64 {
            bad.push(format!("{lock}: PTTL {pttl} beyond the lease"));
        }
    }
    bad
}

/// Asserts that every key under the prefix is within its bound.
fn assert_bounded(srv: &RedisServer, names: &[&str], when: &str) {
    let bad = misplaced(srv, names);
    assert!(bad.is_empty(), "{when}: {bad:#?}");
}

/// Waits until nothing but fence counters and latches is left under the prefix, every
/// key within its bound meanwhile.
fn assert_drains(srv: &RedisServer, names: &[&str]) {
    assert_bounded(srv, names, "once every user is gone");
    wait_for(secs(10), "only counters and latches left", || {
        srv.keys_but_fences(&format!("{PREFIX}*"))
            .iter()
            .all(|k| k.ends_with(":latch"))
    });
    assert_bounded(srv, names, "after the leases ended");
}

/// Asserts that the keys `name}suffix` (each given so) exist: the scenario wrote them.
fn assert_written(srv: &RedisServer, keys: &[&str]) {
    let mut conn = srv.conn();
    for key in keys {
        let key = format!("{PREFIX}{{{key}");
        assert!(redbaton_testkit::exists(&mut conn, &key), "{key} written");
    }
}

/// Runs `scenario` and asserts that it wrote the keys `name}suffix` (each given so), as
/// the server's keyspace events tell: by the time it returns, the cleanup thread may have
/// taken them out again (a departed waiter's mark, say), as it should.
fn assert_writes(srv: &RedisServer, keys: &[&str], scenario: impl FnOnce()) {
    let mut admin = srv.conn();
    let flags: Vec<String> = redis::cmd("CONFIG")
        .arg("GET")
        .arg("notify-keyspace-events")
        .query(&mut admin)
        .expect("CONFIG GET");
    let every = format!("{}KA", flags.get(1).map_or("", String::as_str));
    redis::cmd("CONFIG")
        .arg("SET")
        .arg("notify-keyspace-events")
        .arg(every)
        .query::<()>(&mut admin)
        .expect("CONFIG SET");
    let mut conn = srv.conn();
    let mut events = conn.as_pubsub();
    for key in keys {
        let channel = format!("__keyspace@*__:{PREFIX}{{{key}");
        events.psubscribe(channel).expect("PSUBSCRIBE");
    }
    events
        .set_read_timeout(Some(secs(5)))
        .expect("read timeout");
    scenario();
    let mut seen = std::collections::HashSet::new();
    while seen.len() < keys.len() {
        let event = events.get_message().expect("a keyspace event of each key");
        seen.insert(event.get_channel_name().to_owned());
    }
}

#[test]
fn smoke() {
    let srv = test_server();
    let c = client(&srv.url());
    c.try_lock("smoke").expect("free").unlock().expect("unlock");
    assert_drains(&srv, &["smoke"]);
    let ttl = redbaton_testkit::pttl(&mut srv.conn(), KEYS.fence("smoke"));
    assert!(ttl > 0 && ttl as u128 <= FENCE_TTL.as_millis(), "{ttl}");
}

/// Plain and fair locks: waiters that time out, one cancelled, one that gets the lock;
/// the marks and the queue keep TTLs within their bounds all along.
#[test]
fn lock_waiters_keep_bounded_keys() {
    let srv = test_server();
    let names = ["plain", "fair"];
    for fair in [false, true] {
        let name = if fair { "fair" } else { "plain" };
        let c = Arc::new(client_with(&srv.url(), LEASE, fair));
        let other = Arc::new(client(&srv.url()));
        let held = c.try_lock(name).expect("free");
        let e = other.try_lock_for(name, ms(300)).unwrap_err();
        assert!(e.is_timeout(), "{e:?}");
        assert_bounded(&srv, &names, "after a waiter timed out");
        let cancel = Cancel::new();
        let cancelled = {
            let (other, cancel) = (other.clone(), cancel.clone());
            thread::spawn(move || other.lock_cancellable(name, &cancel).map(drop))
        };
        let waiter = {
            let other = Arc::new(client(&srv.url()));
            thread::spawn(move || other.try_lock_for(name, secs(10)).map(|g| g.unlock()))
        };
        thread::sleep(ms(300));
        assert_bounded(&srv, &names, "while two wait");
        cancel.cancel();
        assert!(join_within(vec![cancelled], secs(10), "cancelled")[0].is_err());
        held.unlock().expect("unlock");
        join_within(vec![waiter], secs(10), "waiter")
            .remove(0)
            .expect("the waiter gets the lock")
            .expect("unlock");
        assert_drains(&srv, &names);
    }
}

/// A read-write lock through every path: read holds, a writer waiting and timing out, a
/// reader held back by a waiting writer, an upgradable read upgraded past a reader, a
/// downgrade with readers waiting, a grant of the write hold.
#[test]
fn rwlock_paths_keep_bounded_keys() {
    let srv = test_server();
    let names = ["rw"];
    let a = Arc::new(client(&srv.url()));
    let b = Arc::new(client(&srv.url()));
    let rw = a.rwlock("rw");
    let read = rw.try_read().expect("free");
    let e = b.rwlock("rw").try_write_for(ms(300)).unwrap_err();
    assert!(e.is_timeout(), "{e:?}");
    assert_bounded(&srv, &names, "after a writer gave up");
    let writer = {
        let b = b.clone();
        thread::spawn(move || {
            let w = b.rwlock("rw").try_write_for(secs(10)).expect("write");
            w.downgrade().expect("downgrade").unlock().expect("unlock");
        })
    };
    thread::sleep(ms(200));
    let third = client(&srv.url());
    let e = third.rwlock("rw").try_read_for(ms(300)).unwrap_err();
    assert!(e.is_timeout(), "a writer waits: {e:?}");
    assert_bounded(&srv, &names, "a writer and a reader waiting");
    read.unlock().expect("unlock");
    join_within(vec![writer], secs(10), "writer");
    let up = a.rwlock("rw").try_upgradable_read().expect("free");
    thread::scope(|s| {
        let (tx, rx) = std::sync::mpsc::channel();
        let srv = &srv;
        s.spawn(move || {
            let reader = b.rwlock("rw").try_read().expect("a read beside it");
            tx.send(()).expect("send");
            thread::sleep(ms(300));
            assert_bounded(srv, &names, "an upgrade waiting");
            reader.unlock().expect("unlock");
        });
        rx.recv().expect("the reader holds");
        up.try_upgrade_for(secs(10))
            .map_err(|e| e.into_parts().1)
            .expect("upgraded")
            .unlock()
            .expect("unlock");
    });
    assert_drains(&srv, &names);
}

/// A semaphore: permit-seekers that time out, wait and are granted.
#[test]
fn semaphore_waiters_keep_bounded_keys() {
    let srv = test_server();
    let a = client(&srv.url());
    let b = Arc::new(client(&srv.url()));
    let sem = a.semaphore("sem", 2);
    let (p1, p2) = (sem.try_acquire().expect("1"), sem.try_acquire().expect("2"));
    let e = b.semaphore("sem", 2).try_acquire_for(ms(300)).unwrap_err();
    assert!(e.is_timeout(), "{e:?}");
    let waiters: Vec<_> = (0..2)
        .map(|_| {
            let b = b.clone();
            thread::spawn(move || {
                b.semaphore("sem", 2)
                    .try_acquire_for(secs(10))
                    .map(|p| p.unlock())
            })
        })
        .collect();
    thread::sleep(ms(300));
    assert_bounded(&srv, &["sem"], "two permit-seekers waiting");
    p1.unlock().expect("unlock");
    p2.unlock().expect("unlock");
    for r in join_within(waiters, secs(10), "permit-seekers") {
        r.expect("a permit").expect("unlock");
    }
    assert_drains(&srv, &["sem"]);
}

/// A latch lives `latch_ttl` from its creation or last count down, never longer, and a
/// waiter's reads do not lengthen it; a multi-lock's contention marks, inspect and a
/// forced release leave nothing unbounded either.
#[test]
fn latch_multi_and_inspect_keep_bounded_keys() {
    let srv = test_server();
    let c = client(&srv.url());
    let other = client(&srv.url());
    let latch = c.latch("l", 2);
    assert_eq!(latch.count_down().expect("count down"), 1);
    let e = other.latch("l", 2).wait_for(ms(200)).unwrap_err();
    assert!(e.is_timeout(), "{e:?}");
    assert_eq!(latch.count_down().expect("count down"), 0);
    let latch_key = format!("{}:latch", KEYS.lock("l"));
    let opened = redbaton_testkit::pttl(&mut srv.conn(), &latch_key);
    thread::sleep(ms(50));
    other.latch("l", 2).wait().expect("open");
    assert_eq!(latch.count_down().expect("count down"), 0);
    let later = redbaton_testkit::pttl(&mut srv.conn(), &latch_key);
    assert!(
        0 < later && later < opened,
        "reads and count downs of an open latch keep its TTL: {later} ms after {opened} ms"
    );
    let held = c.try_lock("m2").expect("free");
    let e = other.try_multi_lock_for(["m1", "m2"], ms(300)).unwrap_err();
    assert!(e.is_timeout(), "{e:?}");
    let info = other.inspect("m2").expect("inspect");
    let fence = info.holder.and_then(|h| h.fence).expect("a fence");
    let names = ["l", "m1", "m2"];
    assert_bounded(&srv, &names, "a multi-lock gave up");
    // Forced out: its lock and lease record go, its counter stays held, as bounded.
    other.force_release("m2", fence).expect("force release");
    assert_bounded(&srv, &names, "a lock forced out");
    drop(held);
    other
        .try_multi_lock(["m1", "m2"])
        .expect("free")
        .unlock()
        .expect("unlock");
    assert_drains(&srv, &names);
    wait_for(secs(10), "the open latch expired", || {
        !redbaton_testkit::exists(&mut srv.conn(), &latch_key)
    });
}

/// Child of the tests of killed holders: takes `WHAT` of the name `NAME` with the lease
/// `LEASE_MS` and keeps it until killed.
#[test]
fn child_holder() {
    child::hold_until_killed(|url| {
        let lease = ms(child::env("LEASE_MS").parse().expect("LEASE_MS"));
        let c = client_with(url, lease, false);
        let name = child::env("NAME");
        let held: Box<dyn std::any::Any> = match child::env("WHAT").as_str() {
            "lock" => Box::new(c.lock(&name).expect("lock")),
            "read" => Box::new(c.rwlock(&name).read().expect("read")),
            "write" => Box::new(c.rwlock(&name).write().expect("write")),
            "permit" => Box::new(c.semaphore(&name, 2).acquire().expect("permit")),
            other => panic!("{other}"),
        };
        (c, held)
    });
}

/// A child process holding `what` of `name` with `lease`.
fn holder(srv: &RedisServer, what: &str, name: &str, lease: Duration) -> std::process::Child {
    start_child(srv, ("child_holder", "held=1"), what, name, lease)
}

/// The child entry point `entry.0` given `what`, `name` and `lease`, once it said `entry.1`.
fn start_child(
    srv: &RedisServer,
    (entry, line): (&str, &str),
    what: &str,
    name: &str,
    lease: Duration,
) -> std::process::Child {
    let env = [
        ("REDIS_URL", srv.url()),
        ("WHAT", what.to_owned()),
        ("NAME", name.to_owned()),
        ("LEASE_MS", lease.as_millis().to_string()),
    ];
    let mut child = child::spawn_self(entry, &env);
    child::wait_for_line(&mut child, line, secs(30));
    child
}

/// Holders killed while others wait (a plain lock, a write hold, a permit): the keys they
/// leave keep their bounds and go.
#[test]
fn killed_holders_leave_bounded_keys() {
    let srv = test_server();
    let names = ["k-lock", "k-rw", "k-sem"];
    let held = [
        holder(&srv, "lock", "k-lock", LEASE),
        holder(&srv, "write", "k-rw", LEASE),
        holder(&srv, "permit", "k-sem", LEASE),
    ];
    let c = Arc::new(client(&srv.url()));
    let waiters: Vec<_> = names
        .iter()
        .map(|&n| {
            let c = c.clone();
            thread::spawn(move || match n {
                "k-lock" => c.try_lock_for(n, secs(10)).map(drop),
                "k-rw" => c.rwlock(n).try_write_for(secs(10)).map(drop),
                _ => c.semaphore(n, 1).try_acquire_for(ms(300)).map(drop),
            })
        })
        .collect();
    thread::sleep(ms(200));
    for child in held {
        child::kill_and_reap(child);
    }
    assert_bounded(&srv, &names, "holders killed");
    let results = join_within(waiters, secs(20), "waiters");
    assert!(results[0].is_ok() && results[1].is_ok(), "{results:?}");
    assert_drains(&srv, &names);
}

/// Acquisitions and releases whose replies are lost (each ran in Redis): the retries and
/// clean-ups leave every key within its bound.
#[test]
fn lost_replies_leave_bounded_keys() {
    let srv = test_server();
    let proxy = Proxy::start(srv.addr());
    let c = client(&proxy.url());
    let names = ["lost", "lost-rw", "lost-sem", "lost-fair"];
    proxy.drop_next_reply_matching(b"EVALSHA");
    let _ = c.try_lock("lost").map(|g| g.unlock());
    proxy.drop_next_reply_matching(b"EVALSHA");
    let _ = c.rwlock("lost-rw").try_write().map(|g| g.unlock());
    proxy.drop_next_reply_matching(b"EVALSHA");
    let _ = c.semaphore("lost-sem", 1).try_acquire().map(|g| g.unlock());
    // Waiters whose attempts' replies are lost while another holds: their marks, queue
    // entries and waiting sets are written, and they give up with the connection error.
    let holder = client_with(&srv.url(), LEASE, true);
    let fair = client_with(&proxy.url(), LEASE, true);
    let held = (
        holder.try_lock("lost-fair").expect("free"),
        holder.rwlock("lost-rw").try_write().expect("free"),
        holder.semaphore("lost-sem", 1).try_acquire().expect("free"),
    );
    // Each wait ends at its first lost reply; its deadline leaves room for the
    // subscription that comes before its first waiting attempt (which writes the mark)
    // on a loaded machine.
    assert_writes(
        &srv,
        &["lost-fair}:q", "lost-rw}:wr", "lost-sem}:ww"],
        || {
            proxy.losing_replies_matching(b"EVALSHA", || {
                let _ = fair.try_lock_for("lost-fair", secs(3));
                let _ = c.rwlock("lost-rw").try_read_for(secs(3));
                let _ = c.semaphore("lost-sem", 1).try_acquire_for(secs(3));
            });
        },
    );
    assert_bounded(&srv, &names, "after lost replies");
    drop(held);
    assert_drains(&srv, &names);
}

/// The server restarts (its data gone) under a holder and a fair waiter: what they write
/// once it is back keeps its bounds.
#[test]
fn server_restart_leaves_bounded_keys() {
    let srv = test_server();
    let c = client_with(&srv.url(), LEASE, true);
    let other = Arc::new(client(&srv.url()));
    let held = c.try_lock("restart").expect("free");
    let waiter = {
        let other = other.clone();
        thread::spawn(move || other.try_lock_for("restart", secs(10)).map(drop))
    };
    thread::sleep(ms(200));
    srv.restart();
    thread::sleep(ms(300));
    assert_bounded(&srv, &["restart"], "after a restart");
    drop(held);
    let _ = join_within(vec![waiter], secs(20), "waiter");
    assert_drains(&srv, &["restart"]);
}

/// A shared lock key lives as long as its longest live hold, no longer: a read hold or a
/// permit of a long lease released while another of a short lease is left (its holder
/// killed), the key expires with the short one, and a plain lock of the name is not
/// refused after it.
#[test]
fn a_shared_key_ends_with_its_last_live_hold() {
    let srv = test_server();
    let long = client_with(&srv.url(), secs(10), false);
    for what in ["read", "permit"] {
        let name = format!("shared-{what}");
        let held: Box<dyn std::any::Any> = match what {
            "read" => Box::new(long.rwlock(&name).try_read().expect("free")),
            _ => Box::new(long.semaphore(&name, 2).try_acquire().expect("free")),
        };
        child::kill_and_reap(holder(&srv, what, &name, LEASE));
        drop(held);
        let ttl = redbaton_testkit::pttl(&mut srv.conn(), KEYS.lock(&name));
        assert!(
            ttl as u128 <= LEASE.as_millis(),
            "{what}: the key outlives its last live hold: PTTL {ttl}"
        );
        wait_for(secs(5), "the last hold's end", || {
            !redbaton_testkit::exists(&mut srv.conn(), KEYS.lock(&name))
        });
        long.try_lock(&name)
            .expect("a plain lock of the name")
            .unlock()
            .expect("unlock");
    }
}

/// Child of the tests of killed waiters: says `waiting=1`, then waits for `WHAT` of the
/// name `NAME` until killed.
#[test]
fn child_waiter() {
    redbaton_testkit::child_only!();
    let url = child::env("REDIS_URL");
    let c = client_with(&url, LEASE, true);
    let name = child::env("NAME");
    child::print_result(&[("waiting", "1".to_owned())]);
    let t = secs(60);
    let _ = match child::env("WHAT").as_str() {
        "fair" => c.try_lock_for(&name, t).map(drop),
        "read" => c.rwlock(&name).try_read_for(t).map(drop),
        "write" => c.rwlock(&name).try_write_for(t).map(drop),
        "permit" => c.semaphore(&name, 1).try_acquire_for(t).map(drop),
        _ => c
            .try_multi_lock_for([name.as_str(), "kw-multi"], t)
            .map(drop),
    };
}

/// Waiters killed while they wait (a fair queue entry, a waiting writer and reader, a
/// permit-seeker, a multi-lock's marks): what they leave keeps its bounds and goes.
#[test]
fn killed_waiters_leave_bounded_keys() {
    let srv = test_server();
    let names = ["kw-fair", "kw-rw", "kw-sem", "kw-multi"];
    let c = client_with(&srv.url(), LEASE, true);
    let fair = c.try_lock("kw-fair").expect("free");
    let write = c.rwlock("kw-rw").try_write().expect("free");
    let permit = c.semaphore("kw-sem", 1).try_acquire().expect("free");
    let multi = c.try_lock("kw-multi").expect("free");
    let waiters: Vec<_> = [
        ("fair", "kw-fair"),
        ("read", "kw-rw"),
        ("write", "kw-rw"),
        ("permit", "kw-sem"),
        ("multi", "kw-fair"),
    ]
    .into_iter()
    .map(|(what, name)| start_child(&srv, ("child_waiter", "waiting=1"), what, name, LEASE))
    .collect();
    thread::sleep(ms(400));
    assert_written(
        &srv,
        &[
            "kw-fair}:q",
            "kw-rw}:ww",
            "kw-rw}:wr",
            "kw-sem}:ww",
            "kw-multi}:w",
        ],
    );
    assert_bounded(&srv, &names, "waiters waiting");
    for child in waiters {
        child::kill_and_reap(child);
    }
    assert_bounded(&srv, &names, "waiters killed");
    fair.unlock().expect("unlock");
    write.unlock().expect("unlock");
    permit.unlock().expect("unlock");
    multi.unlock().expect("unlock");
    assert_drains(&srv, &names);
}
