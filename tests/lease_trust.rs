//! Lease changes whose outcome is unknown, and leases the timeouts can eat, against a real
//! redis-server behind the fault-injecting proxy.
//!
//! The property every test here checks is the lock's first promise: while another client
//! holds the lock, this holder's `check()` is not `Ok`. Timing bounds are generous (a
//! loaded 2-core box runs these in parallel): the proxy's delays are seconds where the
//! client's read timeout is a few hundred milliseconds.

use std::thread;
use std::time::{Duration, Instant};

use redbaton::LockClient;
use redbaton_testkit::keys::Keys;
use redbaton_testkit::lock_builder;
use redbaton_testkit::proxy::Proxy;
use redbaton_testkit::server::RedisServer;
use redbaton_testkit::test_server;
use redbaton_testkit::{init_log, ms, pttl, raw_conn, secs};

const PREFIX: &str = "lt:";
const KEYS: Keys = Keys::new(PREFIX);

/// A client's settings: `url`, `lease`, and a short read timeout, so that a delayed reply
/// is a lost one.
fn builder(url: &str, lease: Duration) -> redbaton::Builder {
    lock_builder!(
        node(url),
        key_prefix(PREFIX),
        lease(lease),
        read_timeout(ms(300))
    )
}

fn client(url: &str, lease: Duration) -> LockClient {
    builder(url, lease).build().expect("build client")
}

/// After a late request (`what`) landed: the holder of `guard` on `name`, extended to a
/// minute, must still hold the lock in Redis with most of that minute left, and `other`
/// must not get it while the holder's `check()` is `Ok`.
fn assert_longer_lease_kept(
    guard: &redbaton::LockGuard,
    other: &LockClient,
    srv: &RedisServer,
    name: &str,
    what: &str,
) {
    let left = pttl(&mut srv.conn(), KEYS.lock(name));
    let valid = guard
        .valid_until()
        .saturating_duration_since(Instant::now());
    let taken = take_within(other, name, secs(4));
    assert!(
        taken.is_none() || guard.check().is_err(),
        "another client took the lock while the holder's check() is Ok (validity {valid:?}, \
         PTTL after {what} {left} ms)"
    );
    assert!(
        left > 50_000,
        "{what} shortened the key to {left} ms under a validity of {valid:?}"
    );
    guard.check().expect("still held");
}

/// `c`'s lock of `name`, extended once to `lease`, which loads the extend script: a later
/// call whose `NOSCRIPT` reply were delayed too would leave it unrun.
fn locked_and_extended(c: &LockClient, name: &str, lease: Duration) -> redbaton::LockGuard {
    let guard = c.lock(name).expect("lock");
    guard.extend(lease).expect("extend");
    guard
}

/// Polls `other` for the lock until it gets it or `within` passes.
fn take_within(other: &LockClient, name: &str, within: Duration) -> Option<redbaton::LockGuard> {
    let until = Instant::now() + within;
    while Instant::now() < until {
        if let Ok(g) = other.try_lock(name) {
            return Some(g);
        }
        thread::sleep(ms(20));
    }
    None
}

/// A holder shortens its lease with `extend`; the script runs, but its reply comes after
/// the read timeout. The call fails, and the holder must not go on believing in the old
/// lease: when the short one ends in Redis and another client takes the lock, the first
/// holder's `check()` fails.
#[test]
fn extend_with_a_lost_reply_keeps_no_old_validity() {
    let srv = test_server();
    let proxy = Proxy::start(srv.addr());
    // Without renewals: the short lease is left to end (a renewal would keep it).
    let a = builder(&proxy.url(), secs(30))
        .auto_renew(false)
        .build()
        .expect("build client");
    let b = client(&srv.url(), secs(30));
    let guard = locked_and_extended(&a, "x", secs(30));

    proxy.set_delay(secs(1));
    let sent = Instant::now();
    let err = guard
        .extend(ms(500))
        .expect_err("the reply came after the read timeout");
    assert!(err.is_connection(), "{err:?}");
    // The extend may have run: the holder believes in its lease no longer than that.
    assert!(
        guard.valid_until() <= sent + ms(500),
        "{:?}",
        guard.valid_until() - sent
    );
    proxy.heal();
    let mut conn = srv.conn();
    let left = pttl(&mut conn, KEYS.lock("x"));
    assert!(left <= 500, "the extend ran in Redis: PTTL {left}");

    let other = take_within(&b, "x", secs(5)).expect("the short lease ended in Redis");
    let taken = sent.elapsed();
    assert!(
        guard.check().is_err(),
        "another client holds the lock ({taken:?} after the extend), yet the first holder's \
         check() is Ok with validity until {:?} from now",
        guard
            .valid_until()
            .saturating_duration_since(Instant::now())
    );
    assert!(guard.valid_until() <= Instant::now());
    drop(other);
}

/// A watchdog renewal whose request is delayed on the way (its reply times out) lands in
/// Redis after a newer, longer `extend`. It must not shorten the key's TTL below the
/// validity the extend gave the holder.
#[test]
fn a_late_renewal_cannot_undo_a_newer_extend() {
    let srv = test_server();
    let proxy = Proxy::start(srv.addr());
    let lease = secs(3);
    let a = builder(&proxy.url(), lease)
        .renew_interval(secs(1))
        .build()
        .expect("build client");
    let b = client(&srv.url(), secs(30));
    let guard = a.lock("y").expect("lock");
    let sent_before = a.stats().renewals_sent;

    // The first renewal's request takes 2 s to reach Redis: it times out at the client,
    // then runs anyway.
    proxy.set_delay_both(secs(2));
    let until = Instant::now() + secs(5);
    while a.stats().renewals_sent == sent_before {
        assert!(Instant::now() < until, "no renewal was sent");
        thread::sleep(ms(5));
    }
    // Let the proxy read (and stamp) the renewal before the delay goes.
    thread::sleep(ms(50));
    proxy.heal();
    // Waits for the renewal in flight to time out, then sets a long lease.
    guard.extend(secs(60)).expect("extend");
    let mut conn = srv.conn();
    assert!(pttl(&mut conn, KEYS.lock("y")) > 50_000);

    // The late renewal has landed by now.
    thread::sleep(secs(3));
    assert_longer_lease_kept(&guard, &b, &srv, "y", "the late renewal");
}

/// The server stalls longer than the lease while an acquire attempt waits (the first
/// attempt times out; its retry's reply comes when the server wakes, after the lease has
/// run out). Acquisition must not return a guard with no validity left: it gives that one
/// back and tries again within the caller's deadline.
#[test]
fn a_guard_is_never_born_dead() {
    let srv = test_server();
    let a = builder(&srv.url(), secs(1))
        .read_timeout(ms(900))
        .build()
        .expect("build client");
    // Scripts loaded, a connection pooled.
    drop(a.lock("warm-up").expect("lock"));

    let url = srv.url();
    let staller = thread::spawn(move || {
        let mut conn = raw_conn(&url);
        redis::cmd("DEBUG")
            .arg("SLEEP")
            .arg("1.5")
            .query::<()>(&mut conn)
    });
    thread::sleep(ms(100));
    let started = Instant::now();
    let got = a.try_lock_for("z", secs(10));
    staller.join().expect("staller").expect("DEBUG SLEEP");
    let guard = got.expect("the lock is free: acquired within the deadline");
    assert!(
        guard.check().is_ok() && guard.valid_until() > Instant::now(),
        "a guard born dead after {:?}: check {:?}",
        started.elapsed(),
        guard.check()
    );
}

/// A read timeout the lease cannot outlast is refused at build: a reply the client still
/// waits for could come after the lease it grants ended. The error names both settings.
#[test]
fn build_refuses_a_lease_the_read_timeout_can_eat() {
    let srv = test_server();
    for (lease, read) in [(secs(1), secs(2)), (secs(1), secs(1)), (ms(600), ms(595))] {
        let err = builder(&srv.url(), lease)
            .read_timeout(read)
            .build()
            .expect_err("a read timeout as long as the lease");
        let text = err.to_string();
        assert!(err.is_invalid_input(), "{err:?}");
        assert!(
            text.contains("lease") && text.contains("read timeout"),
            "the error names both settings: {text}"
        );
    }
    // Shorter, with the drift margin to spare: fine.
    drop(
        builder(&srv.url(), secs(1))
            .read_timeout(ms(900))
            .build()
            .expect("build"),
    );
}

/// An acquire attempt delayed on the way (it timed out, and its retry took the lock)
/// lands after the holder extended to a longer lease. Finding its own token there, it
/// must not cut the longer lease short: with the fair queue (the default) and without.
#[test]
fn a_late_acquire_attempt_cannot_undo_a_newer_extend() {
    init_log();
    for fair in [true, false] {
        late_acquire_attempt(fair);
    }
}

fn late_acquire_attempt(fair: bool) {
    let srv = RedisServer::start();
    let proxy = std::sync::Arc::new(Proxy::start(srv.addr()));
    let a = builder(&proxy.url(), secs(3))
        .fair(fair)
        .build()
        .expect("build client");
    let b = client(&srv.url(), secs(30));
    // Scripts loaded, a connection pooled.
    drop(locked_and_extended(&a, "warm-up", secs(3)));

    // The first attempt takes 2 s to reach Redis; its retry, 300 ms later, does not.
    proxy.set_delay_both(secs(2));
    let healer = {
        let proxy = proxy.clone();
        thread::spawn(move || {
            thread::sleep(ms(100));
            proxy.heal();
        })
    };
    let guard = a.lock("w").expect("lock");
    healer.join().expect("healer");
    guard.extend(secs(60)).expect("extend");
    let mut conn = srv.conn();
    assert!(pttl(&mut conn, KEYS.lock("w")) > 50_000);

    // The first attempt has landed by now.
    thread::sleep(secs(3));
    let what = format!("the late attempt (fair {fair})");
    assert_longer_lease_kept(&guard, &b, &srv, "w", &what);
}

/// The lease record lives as long as the lease it describes, and goes with the lock's
/// release: nothing of a hold is left but the fence counter (with the fair queue and
/// without).
#[test]
fn the_lease_record_goes_with_the_lock() {
    let srv = test_server();
    let mut conn = srv.conn();
    for fair in [true, false] {
        let a = builder(&srv.url(), secs(30))
            .fair(fair)
            .build()
            .expect("build client");
        let guard = a.lock("rec").expect("lock");
        guard.extend(secs(20)).expect("extend");
        let record = format!("{}:lease", KEYS.lock("rec"));
        let left = pttl(&mut conn, &record);
        assert!(left > 15_000 && left <= 20_000, "fair {fair}: PTTL {left}");
        guard.unlock().expect("unlock");
        let keys = srv.keys(&format!("{PREFIX}*"));
        let names: Vec<String> = keys
            .iter()
            .map(|k| String::from_utf8_lossy(k).into_owned())
            .collect();
        assert_eq!(
            names,
            [format!("{}:fence", KEYS.lock("rec"))],
            "fair {fair}"
        );
    }
}
