//! The read-to-write upgrade of a read-write lock under faults, against a real
//! redis-server (through the fault-injecting proxy, and with child processes for a crashed
//! upgrader): the mark of an upgrader that crashed never keeps the lock from a waiting
//! writer, an upgrade whose reply comes after its lease ends as lost (never as a timeout
//! with the upgradable read gone), an upgrade that times out keeps its upgradable read and
//! wakes the readers it held back, an upgrade waiting for a reader of its own process is
//! woken when that reader leaves, and a detached write guard outlives its client.
//!
//! Times are liveness bounds, never speed claims.

use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use redbaton::{HoldKind, LockClient, ReadGuard, Unlocked, UpgradableReadGuard, Wakeup};
use redbaton_testkit::child;
use redbaton_testkit::child_only;
use redbaton_testkit::proxy::Proxy;
use redbaton_testkit::server::RedisServer;
use redbaton_testkit::wait::wait_for;
use redbaton_testkit::{lock_client, ms, secs, test_server};

const PREFIX: &str = "ru:";
/// Liveness bound of the waits of the test itself (never a speed claim).
const LIVENESS: Duration = Duration::from_secs(30);

fn lock_key(name: &str) -> String {
    format!("{PREFIX}{{{name}}}")
}

fn writer_marks(name: &str) -> String {
    format!("{}:ww", lock_key(name))
}

fn reader_marks(name: &str) -> String {
    format!("{}:wr", lock_key(name))
}

/// A client whose waits end only by a message (or their deadline): its re-checks and its
/// holders' lease hints come long after the test.
fn patient(url: &str) -> LockClient {
    lock_client!(node(url), key_prefix(PREFIX), patient())
}

fn client(url: &str) -> LockClient {
    lock_client!(node(url), key_prefix(PREFIX))
}

/// The members of the sorted set `key` of the Redis at `url`.
fn zcard(url: &str, key: &str) -> i64 {
    redis::cmd("ZCARD")
        .arg(key)
        .query(&mut redbaton_testkit::raw_conn(url))
        .unwrap()
}

/// Only fence counters are left under the prefix.
fn assert_only_fences(srv: &RedisServer) {
    let left = srv.keys_but_fences(&format!("{PREFIX}*"));
    assert!(left.is_empty(), "only fence counters left: {left:?}");
}

/// An upgrade refused while a reader holds, then granted, a downgrade and a write guard
/// unlocked from another thread work end to end and leave only fence counters behind.
#[test]
fn smoke() {
    let srv = test_server();
    let (a, b) = (client(&srv.url()), client(&srv.url()));
    let rw = a.rwlock("smoke");
    let u = rw.upgradable_read().expect("upgradable read");
    let read_token = u.fencing_token();
    let r = b.rwlock("smoke").read().expect("a reader beside it");
    let u = u.try_upgrade().expect_err("a reader holds").into_guard();
    u.check().expect("still the upgradable read");
    assert_eq!(u.fencing_token(), read_token);
    drop(r);
    let w = u.upgrade().expect("upgrade");
    assert!(w.fencing_token() > read_token);
    let r = w.downgrade().expect("downgrade");
    drop(r);
    let w = rw.write().expect("write");
    let token = w.fencing_token();
    let detached = w.detach();
    let outcome = thread::spawn(move || detached.unlock())
        .join()
        .unwrap()
        .expect("unlock elsewhere");
    assert_eq!(outcome, Unlocked::Released);
    let next = b.rwlock("smoke").try_write().expect("free");
    assert!(next.fencing_token() > token);
    drop(next);
    assert_only_fences(&srv);
}

/// Child: takes the upgradable read of `NAME` with a short lease and a long re-check (its
/// upgrade mark in `…:ww` lives 2 × 30 s), says so, then waits to upgrade until killed.
#[test]
fn child_upgrader_waits() {
    child_only!();
    let url = child::env("REDIS_URL");
    let c = lock_client!(
        node(url.as_str()),
        key_prefix(PREFIX),
        lease(ms(1000)),
        recheck_interval(secs(30))
    );
    let u = c
        .rwlock(child::env("NAME"))
        .upgradable_read()
        .expect("upgradable read");
    child::print_result(&[("held", "1".to_owned())]);
    // Waits (marked as a waiting writer) for the parent's reader, until killed.
    let _ = u.upgrade();
    thread::sleep(secs(120));
}

/// A process waiting to upgrade crashes: its upgradable hold ends with its lease (1 s),
/// but its mark as a waiting writer (TTL twice its re-check interval) lives on. A writer
/// of another process then waits, marked, behind the last reader. When that reader
/// releases, the upgrade mark whose upgradable hold is gone is passed over and the
/// waiting writer gets the write hold within a few seconds, long before its 10 s
/// deadline or its re-check.
#[test]
fn a_crashed_upgraders_mark_does_not_keep_the_grant_from_a_writer() {
    let name = "crashed-upgrader";
    let srv = test_server();
    let (r_client, w_client) = (patient(&srv.url()), patient(&srv.url()));
    let reader = r_client.rwlock(name).read().expect("R reads");
    let envs = [("REDIS_URL", srv.url()), ("NAME", name.to_owned())];
    let mut upgrader = child::spawn_self("child_upgrader_waits", &envs);
    child::wait_for_line(&mut upgrader, "held=1", LIVENESS);
    wait_for(LIVENESS, "the upgrade marked itself waiting", || {
        srv.zcard(&writer_marks(name)) == 1
    });
    child::kill_and_reap(upgrader);
    // Its upgradable hold (lease 1 s, no longer renewed) ends in Redis.
    thread::sleep(ms(1500));
    let (tx, rx) = mpsc::channel();
    let writer = thread::spawn(move || {
        let got = w_client
            .rwlock(name)
            .try_write_for(secs(10))
            .map(|w| w.fencing_token());
        tx.send((got, Instant::now())).unwrap();
    });
    wait_for(LIVENESS, "W marked itself waiting", || {
        srv.zcard(&writer_marks(name)) == 2
    });
    // W subscribes after its first failure and tries once more before it sleeps: let it
    // be asleep (else its second attempt could find the name free by chance).
    thread::sleep(ms(500));
    let released = Instant::now();
    assert_eq!(reader.unlock().expect("R lets go"), Unlocked::Released);
    let (got, at) = rx.recv_timeout(LIVENESS).expect("W returned");
    writer.join().unwrap();
    let waited = at.saturating_duration_since(released);
    eprintln!("W got {got:?} {waited:?} after the name was free");
    assert!(
        got.is_ok() && waited < secs(3),
        "the waiting writer gets the free name within 3 s; it got {got:?} {waited:?} after \
         the release"
    );
}

/// A `try_upgrade` whose reply comes after the lease (a slow link): the upgrade ran in
/// Redis, and the library gives the late write hold back, so the upgradable read is gone
/// too. The call ends the upgrade as lost: it never says `Error::Timeout` (which promises
/// that the guard still holds the upgradable read) unless Redis does hold it.
#[test]
fn a_late_upgrade_reply_ends_the_upgrade_as_lost() {
    let srv = test_server();
    let proxy = Proxy::start(srv.addr());
    // Lease 1 s, the default read timeout (2 s): a reply 1.3 s late is still read.
    let a = lock_client!(node(proxy.url()), key_prefix(PREFIX), lease(ms(1000)));
    // The scripts are known to the server (an unknown one costs a second late round trip).
    drop(
        a.rwlock("warm")
            .upgradable_read()
            .and_then(|u| u.upgrade())
            .expect("warm up"),
    );
    let u = a.rwlock("late").upgradable_read().expect("upgradable read");
    proxy.set_delay(ms(1300));
    let refused = u.try_upgrade();
    proxy.heal();
    let e = match refused {
        Ok(w) => {
            eprintln!("the reply came within the lease after all, the upgrade won: {w:?}");
            return;
        }
        Err(e) => e,
    };
    let observer = patient(&srv.url());
    let info = observer.inspect("late").expect("inspect");
    let upgradable_in_redis = info.holds.iter().any(|h| h.kind == HoldKind::Upgradable);
    let (guard, error) = e.into_parts();
    eprintln!(
        "try_upgrade: {error:?}; guard check: {:?}; holds in Redis: {info:?}",
        guard.check()
    );
    if error.is_timeout() {
        assert!(
            upgradable_in_redis,
            "a Timeout from try_upgrade means the upgradable read is still held in Redis; \
             the guard says {:?}",
            guard.check()
        );
    }
}

/// An upgrade that times out while a reader holds keeps its upgradable read (the same
/// fencing token) and takes its mark out, and a reader it held back is woken by that at
/// once, not at its re-check.
#[test]
fn a_timed_out_upgrade_keeps_its_read_and_wakes_the_readers_it_held_back() {
    let name = "timeout";
    let srv = test_server();
    let (a, b, c) = (
        patient(&srv.url()),
        patient(&srv.url()),
        patient(&srv.url()),
    );
    let u = a.rwlock(name).upgradable_read().expect("upgradable read");
    let token = u.fencing_token();
    let r = b.rwlock(name).read().expect("a reader");
    let url = srv.url();
    let late = thread::spawn(move || {
        wait_for(LIVENESS, "the upgrade marked", || {
            zcard(&url, &writer_marks(name)) == 1
        });
        let got = c.rwlock(name).try_read_for(secs(20)).map(drop);
        (got, Instant::now())
    });
    // The late reader marks itself waiting behind the upgrade's mark.
    let (e, timed_out) = {
        let e = u.try_upgrade_for(secs(2)).expect_err("a reader holds");
        (e, Instant::now())
    };
    assert!(e.error().is_timeout(), "{e:?}");
    let u = e.into_guard();
    u.check().expect("still the upgradable read");
    assert_eq!(u.fencing_token(), token);
    assert_eq!(
        srv.zcard(&writer_marks(name)),
        0,
        "the upgrade's mark is gone"
    );
    let (got, at) = late.join().unwrap();
    got.expect("the late reader reads");
    let waited = at.saturating_duration_since(timed_out);
    eprintln!("the late reader read {waited:?} after the upgrade gave up");
    assert!(waited < secs(3), "woken within 3 s, not {waited:?}");
    drop((u, r));
    assert_eq!(srv.zcard(&reader_marks(name)), 0, "no reader mark left");
    assert_only_fences(&srv);
}

/// An upgrade waiting for a read hold of its own process (another thread's) is woken at
/// once when that hold goes back, not at a re-check.
#[test]
fn an_upgrade_waiting_for_its_own_processes_reader_is_woken_when_it_leaves() {
    let name = "own-reader";
    let srv = test_server();
    let a = patient(&srv.url());
    let u = a.rwlock(name).upgradable_read().expect("upgradable read");
    let (release_tx, release_rx) = mpsc::channel::<()>();
    let (reading_tx, reading_rx) = mpsc::channel::<()>();
    let (released_tx, released_rx) = mpsc::channel::<Instant>();
    let (a_ref, url) = (&a, srv.url());
    thread::scope(|s| {
        s.spawn(move || {
            let r = a_ref.rwlock(name).read().expect("a local reader");
            reading_tx.send(()).unwrap();
            release_rx.recv().unwrap();
            let at = Instant::now();
            drop(r);
            released_tx.send(at).unwrap();
        });
        reading_rx.recv().unwrap();
        s.spawn(move || {
            wait_for(LIVENESS, "the upgrade marked", || {
                zcard(&url, &writer_marks(name)) == 1
            });
            release_tx.send(()).unwrap();
        });
        let w = u.try_upgrade_for(secs(20)).expect("upgrade");
        let upgraded = Instant::now();
        let released = released_rx.recv().unwrap();
        let waited = upgraded.saturating_duration_since(released);
        eprintln!("upgraded {waited:?} after the local reader left");
        assert!(waited < secs(3), "woken within 3 s, not {waited:?}");
        drop(w);
    });
    assert_only_fences(&srv);
}

/// A detached write guard outlives its client (the watchdog keeps renewing it), is
/// released from another thread, and the next writer gets a higher token; after the
/// client's shutdown, a detached guard is still released.
#[test]
fn a_detached_write_guard_outlives_its_client() {
    let srv = test_server();
    let c = lock_client!(node(srv.url()), key_prefix(PREFIX), lease(ms(600)));
    let rw = c.rwlock("outlives");
    let detached = rw.write().expect("write").detach();
    let token = detached.fencing_token();
    drop((rw, c));
    let other = patient(&srv.url());
    let outcome = thread::spawn(move || {
        // Several leases: renewed with no client left.
        thread::sleep(ms(2000));
        detached.check().expect("still held");
        detached.unlock()
    })
    .join()
    .unwrap();
    assert_eq!(outcome.expect("unlock"), Unlocked::Released);
    let next = other.rwlock("outlives").try_write().expect("free");
    assert!(next.fencing_token() > token);
    drop(next);
    // After a shutdown.
    let c = client(&srv.url());
    let detached = c.rwlock("shut").write().expect("write").detach();
    c.shutdown(secs(5)).expect("shutdown");
    let outcome = thread::spawn(move || detached.unlock()).join().unwrap();
    assert_eq!(outcome.expect("unlock after shutdown"), Unlocked::Released);
    assert_only_fences(&srv);
}

/// An upgradable read of `name` by a client through a proxy (`a`, waking as `wakeup`
/// says) and a read by another (`b`), then an upgrade of `a`'s that times out while its
/// leave is lost on its way: the guard, kept, and the reader.
fn first_upgrade_leave_lost(
    srv: &RedisServer,
    proxy: &Proxy,
    wakeup: Wakeup,
    name: &str,
) -> (LockClient, LockClient, UpgradableReadGuard, ReadGuard) {
    let a = lock_client!(
        node(proxy.url()),
        key_prefix(PREFIX),
        patient(),
        wakeup(wakeup)
    );
    let b = patient(&srv.url());
    let u = a.rwlock(name).upgradable_read().expect("upgradable read");
    let r = b.rwlock(name).read().expect("a reader");
    // The upgrade's leave alone names the waiting writers' key first of two keys.
    let marks = writer_marks(name);
    let leave = format!("2\r\n${}\r\n{marks}", marks.len());
    let e = proxy.refusing_requests_matching(leave.as_bytes(), || {
        u.try_upgrade_for(secs(1)).expect_err("a reader holds")
    });
    assert!(e.error().is_timeout(), "{e:?}");
    (a, b, e.into_guard(), r)
}

/// The same guard's next upgrade, after one whose leave was lost, wins the write hold:
/// nothing the first left behind gives that write hold back under its holder (the write
/// member is the guard's, the same for both upgrades).
#[test]
fn a_second_upgrade_is_never_given_back_by_the_firsts_cleanup() {
    let (srv, name) = (test_server(), "up");
    let proxy = Proxy::start(srv.addr());
    let (_a, b, u, r) = first_upgrade_leave_lost(&srv, &proxy, Wakeup::Notifications, name);
    r.unlock().expect("the reader leaves");
    let w = u.try_upgrade_for(secs(5)).expect("the upgrade");
    // A cleanup thread's looks again would come at doubling pauses from 100 ms.
    thread::sleep(secs(3));
    w.check().expect("the write hold");
    let other = b.rwlock(name).try_read();
    assert!(other.is_err(), "a reader got in beside the write hold");
    w.unlock().expect("unlock");
}

/// The same guard's next upgrade, after one whose leave was lost, waits behind a reader:
/// nothing the first left behind takes its waiting mark out (the mark is the guard's
/// member, the same for both), so no new reader gets in while it waits. (The upgrader
/// polls, so that it does not mark itself again at each release it hears.)
#[test]
fn a_second_upgrade_keeps_its_mark_whatever_the_first_left() {
    let (srv, name) = (test_server(), "mark");
    let proxy = Proxy::start(srv.addr());
    let polling = Wakeup::Polling(secs(20));
    let (_a, b, u, _r) = first_upgrade_leave_lost(&srv, &proxy, polling, name);
    thread::scope(|s| {
        let late = s.spawn(|| {
            thread::sleep(secs(3));
            (
                b.rwlock(name).try_read().map(drop),
                srv.zcard(&writer_marks(name)),
            )
        });
        let e = u.try_upgrade_for(secs(5)).expect_err("the reader stays");
        assert!(e.error().is_timeout(), "{e:?}");
        let (read, marks) = late.join().expect("the late reader");
        assert!(
            read.is_err(),
            "a new reader got in while the upgrade waited ({marks} marks)"
        );
    });
}
