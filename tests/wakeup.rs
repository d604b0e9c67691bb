//! Waking waiters by Redis keyspace notifications (DESIGN.md, "Waiting without polling"),
//! against a real `redis-server`.
//!
//! Holders and waiters live in different processes wherever the claim is about other
//! processes (child processes re-run this binary, see `redbaton_testkit::child`). Time bounds are
//! generous liveness bounds, never speed claims; measured figures are printed with
//! `eprintln!` (run with `--nocapture` to see them).
//!
//! Tests that load both cores for seconds (`churn_*`, `many_waiters_*`) take [`HEAVY`] for
//! writing; the tests whose bounds are about latency take it for reading, so they never
//! run while a heavy test saturates the machine (they still run in parallel with each
//! other).
//!
//! Three tests are regressions of fixed library bugs (server restart, and the two Redis 7
//! ACL cases).

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, Once};
use std::thread;
use std::time::{Duration, Instant};

use crossbeam_channel::Receiver;
use parking_lot::RwLock;
use redbaton::{Cancel, LockClient, LockGuard, Stats, Unlocked, Wakeup};
use redbaton_testkit::child;
use redbaton_testkit::child::{field, result_with};
use redbaton_testkit::child_only;
use redbaton_testkit::clock::wall_us;
use redbaton_testkit::keys::Keys;
use redbaton_testkit::lock_builder;
use redbaton_testkit::ms;
use redbaton_testkit::server::RedisServer;
use redbaton_testkit::wait::wait_for;
use redbaton_testkit::{raw_conn, secs};

/// Held for writing by CPU-heavy tests, for reading by latency-bounded ones.
static HEAVY: RwLock<()> = RwLock::new(());

const SUB_NAME: &str = "redbaton:sub";

fn client(url: &str) -> redbaton::Builder {
    lock_builder!(node(url))
}

/// When a waiter got its lock.
#[derive(Debug, Clone, Copy)]
struct Acquired {
    at: Instant,
    at_us: i64,
}

/// Starts a thread that waits in `lock(name)`, notes when it got the lock, keeps it for
/// `hold`, unlocks it and reports. Errors and panics are reported as `Err`.
fn spawn_waiter(
    client: &LockClient,
    name: &str,
    hold: Duration,
) -> Receiver<Result<Acquired, String>> {
    let (tx, rx) = crossbeam_channel::bounded(1);
    let client = client.clone();
    let name = name.to_owned();
    thread::spawn(move || {
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let guard = client.lock(&name).map_err(|e| format!("lock: {e}"))?;
            let got = Acquired {
                at: Instant::now(),
                at_us: wall_us() as i64,
            };
            thread::sleep(hold);
            match guard.unlock() {
                Ok(u) if u.was_held() => Ok(got),
                Ok(u) => Err(format!("unlock: not held ({u})")),
                Err(e) => Err(format!("unlock: {e}")),
            }
        }))
        .unwrap_or_else(|_| Err("waiter thread panicked".to_owned()));
        let _ = tx.send(result);
    });
    rx
}

/// Waits for every waiter's report, all within one overall `timeout`.
fn collect(
    waiters: &[Receiver<Result<Acquired, String>>],
    timeout: Duration,
    what: &str,
) -> Vec<Acquired> {
    let deadline = Instant::now() + timeout;
    waiters
        .iter()
        .enumerate()
        .map(|(i, rx)| match rx.recv_deadline(deadline) {
            Ok(Ok(a)) => a,
            Ok(Err(e)) => panic!("{what}: waiter {i} failed: {e}"),
            Err(_) => panic!("{what}: waiter {i} did not get the lock within {timeout:?} (hung?)"),
        })
        .collect()
}

/// The subscriptions a subscriber connection should have for `keys` waited-for keys, as
/// `(classic, shard)` channel counts: a keyspace channel per key, and the library's channel
/// per key, a shard channel where the server has sharded pub/sub (Redis 7) and a classic
/// one before (the documented fallback). Says which path it checks.
fn expected_channels(keys: usize) -> (usize, usize) {
    let version = redbaton_testkit::binaries::server_version().expect("server version");
    if version.at_least(7, 0) {
        eprintln!("{version}: library channels are shard channels (SSUBSCRIBE)");
        (keys, keys)
    } else {
        eprintln!("{version}: no sharded pub/sub, library channels are classic (fallback)");
        (2 * keys, 0)
    }
}

/// A subscriber connection's `(classic, shard)` channel counts (`ssub` is absent before
/// Redis 7).
fn channels(conn: &HashMap<String, String>) -> (usize, usize) {
    let count = |field: &str| conn.get(field).and_then(|v| v.parse().ok()).unwrap_or(0);
    (count("sub"), count("ssub"))
}

fn sub_connections(srv: &RedisServer) -> Vec<HashMap<String, String>> {
    srv.client_list()
        .into_iter()
        .filter(|c| c.get("name").map(String::as_str) == Some(SUB_NAME))
        .collect()
}

// --- smoke ---------------------------------------------------------------------------

#[test]
fn smoke() {
    let srv = RedisServer::start();
    let c = client(&srv.url()).build().expect("build");
    let flags = srv.config_get("notify-keyspace-events");
    for class in ['K', 'g', '$', 'x', 'e'] {
        assert!(
            flags.contains(class) || (class != 'K' && flags.contains('A')),
            "build() did not turn on class {class}: {flags:?}"
        );
    }
    let guard = c.lock("smoke").expect("lock");
    assert!(c.try_lock("smoke").is_err());
    assert_eq!(guard.unlock().unwrap(), Unlocked::Released);
    assert_eq!(c.with_lock("smoke", || 7).unwrap(), 7);
}

// --- 1. a waiter wakes on the holder's release ---------------------------------------

/// Child: takes `NAME` with a 30 s lease, says so, holds it at least 500 ms and until the
/// parent sets `GO` (its waiter is then surely blocked), releases, and reports when.
#[test]
fn child_hold_until_go() {
    child_only!();
    let url = child::env("URL");
    let c = client(&url).lease(secs(30)).build().expect("build");
    let guard = c.lock(child::env("NAME")).expect("lock");
    child::print_result(&[("acquired", "1".into())]);
    let held = Instant::now();
    let mut conn = raw_conn(&url);
    let go = child::env("GO");
    loop {
        let set: bool = redis::cmd("EXISTS").arg(&go).query(&mut conn).unwrap();
        if set && held.elapsed() >= ms(500) {
            break;
        }
        assert!(held.elapsed() < secs(30), "parent never said go");
        thread::sleep(ms(5));
    }
    let released_us = wall_us() as i64;
    assert_eq!(guard.unlock().expect("unlock"), Unlocked::Released);
    child::print_result(&[("released_us", released_us.to_string())]);
}

#[test]
fn waiter_wakes_on_release_by_another_process() {
    let _light = HEAVY.read();
    let srv = RedisServer::start();
    let name = "wake-on-release";
    let mut holder = child::spawn_self(
        "child_hold_until_go",
        &[
            ("URL", srv.url()),
            ("NAME", name.into()),
            ("GO", "go".into()),
        ],
    );
    child::wait_for_line(&mut holder, "acquired=1", secs(30));

    let c = client(&srv.url()).build().expect("build");
    let waiter = spawn_waiter(&c, name, Duration::ZERO);
    // Two failed attempts: the one before subscribing, and the one after the
    // subscription was confirmed; the waiter is then asleep.
    wait_for(secs(10), "the waiter to block", || {
        c.stats().failed_attempts >= 2
    });
    let () = redis::cmd("SET")
        .arg("go")
        .arg(1)
        .query(&mut srv.conn())
        .unwrap();

    let got = collect(&[waiter], secs(20), "waiter")[0];
    let out = child::wait_ok(holder, secs(30));
    let released_us = field::<i64>(&result_with(&out, "released_us"), "released_us");
    let latency = got.at_us - released_us;
    let s = c.stats();
    eprintln!("wake on release: acquired {latency} us after the other process released; {s:?}");
    assert!(
        latency < 1_000_000,
        "acquired {latency} us after the release (bound 1 s); {s:?}"
    );
    assert!(s.wakeups_event >= 1, "not woken by an event: {s:?}");
    assert_eq!(s.wakeups_lease, 0, "{s:?}");
    assert_eq!(s.wakeups_poll, 0, "{s:?}");
    assert_eq!(s.wakeups_recheck, 0, "{s:?}");
}

// --- 2. a holder killed with SIGKILL ---------------------------------------------------

/// Child: takes `NAME` with a `LEASE_MS` lease (renewed by its watchdog), or with
/// `auto_renew(false)` when `NO_RENEW` is set, says so, and sleeps until killed. With
/// `FORGET` the guard is leaked, so nothing ever releases the key.
#[test]
fn child_hold_forever() {
    child_only!();
    let lease = ms(child::env("LEASE_MS").parse().unwrap());
    let mut b = client(&child::env("URL")).lease(lease);
    if std::env::var("NO_RENEW").is_ok() {
        b = b.auto_renew(false);
    }
    let c = b.build().expect("build");
    let guard = c.lock(child::env("NAME")).expect("lock");
    if std::env::var("FORGET").is_ok() {
        std::mem::forget(guard);
        child::print_result(&[("acquired", "1".into())]);
        thread::sleep(secs(60));
    } else {
        child::print_result(&[("acquired", "1".into())]);
        thread::sleep(secs(60));
        drop(guard);
    }
}

/// Starts [`child_hold_forever`] on `srv` taking `name` with `lease` (and `flags`, e.g.
/// `NO_RENEW`), and waits until it holds.
fn spawn_holder(
    srv: &RedisServer,
    name: &str,
    lease: Duration,
    flags: &[(&str, String)],
) -> std::process::Child {
    let mut envs = vec![
        ("URL", srv.url()),
        ("NAME", name.to_owned()),
        ("LEASE_MS", lease.as_millis().to_string()),
    ];
    envs.extend(flags.iter().cloned());
    let mut holder = child::spawn_self("child_hold_forever", &envs);
    child::wait_for_line(&mut holder, "acquired=1", secs(30));
    holder
}

#[test]
fn waiter_takes_over_from_killed_holder_within_lease() {
    let _light = HEAVY.read();
    let srv = RedisServer::start();
    let name = "killed-holder";
    let lease = secs(2);
    let mut holder = spawn_holder(&srv, name, lease, &[]);
    let c = client(&srv.url()).build().expect("build");
    let waiter = spawn_waiter(&c, name, Duration::ZERO);
    wait_for(secs(10), "the waiter to block", || {
        c.stats().failed_attempts >= 2
    });
    // Let the holder's watchdog renew at least once while the waiter sleeps.
    thread::sleep(ms(800));
    let pttl: i64 = redis::cmd("PTTL")
        .arg(Keys::DEFAULT.lock(name))
        .query(&mut srv.conn())
        .unwrap();
    child::kill_child(&mut holder, libc::SIGKILL);
    let killed = Instant::now();
    let out = child::wait_output(holder, secs(10));
    assert!(!out.status.success());

    let got = collect(&[waiter], lease + secs(10), "waiter")[0];
    let after = got.at.duration_since(killed);
    let s = c.stats();
    eprintln!(
        "killed holder: acquired {after:?} after SIGKILL (lease {lease:?}, PTTL at the kill {pttl} ms, {} evalsha); {s:?}",
        srv.command_count("evalsha")
    );
    assert!(
        after < lease + secs(1),
        "acquired {after:?} after the kill; bound lease + 1 s; {s:?}"
    );
    assert_eq!(s.wakeups_poll, 0, "{s:?}");
}

// --- expiry wakes the waiter ------------------------------------------------------------

#[test]
fn raw_expiring_key_wakes_waiter() {
    let _light = HEAVY.read();
    let srv = RedisServer::start();
    let name = "raw-expiry";
    let c = client(&srv.url()).build().expect("build");
    let () = redis::cmd("SET")
        .arg(Keys::DEFAULT.lock(name))
        .arg("someone-else")
        .arg("PX")
        .arg(1000)
        .query(&mut srv.conn())
        .unwrap();
    let set_at = Instant::now();
    let got = collect(
        &[spawn_waiter(&c, name, Duration::ZERO)],
        secs(10),
        "waiter",
    )[0];
    let after = got.at.duration_since(set_at);
    let s = c.stats();
    eprintln!(
        "raw key with PX 1000: acquired {after:?} after the SET (event {}, lease {}); {s:?}",
        s.wakeups_event, s.wakeups_lease
    );
    assert!(
        after >= ms(950),
        "acquired {after:?}: before the key expired"
    );
    assert!(
        after < secs(2),
        "acquired {after:?}; bound lease + 1 s; {s:?}"
    );
    assert!(
        s.wakeups_event + s.wakeups_lease >= 1,
        "woken neither by `expired` nor the lease timer: {s:?}"
    );
    assert_eq!(s.wakeups_recheck, 0, "{s:?}");
    assert_eq!(s.wakeups_poll, 0, "{s:?}");
}

/// The waiter's lease timer says 30 s, but the key's TTL is cut to 300 ms behind its back
/// (`PEXPIRE`, whose `expire` event waiters ignore): only the `expired` event can wake it
/// before the re-check ceiling.
#[test]
fn expired_event_wakes_waiter_before_its_lease_timer() {
    let _light = HEAVY.read();
    let srv = RedisServer::start();
    let name = "expired-event";
    let key = Keys::DEFAULT.lock(name);
    let c = client(&srv.url()).build().expect("build");
    let () = redis::cmd("SET")
        .arg(&key)
        .arg("someone-else")
        .arg("PX")
        .arg(30_000)
        .query(&mut srv.conn())
        .unwrap();
    let waiter = spawn_waiter(&c, name, Duration::ZERO);
    wait_for(secs(10), "the waiter to block", || {
        c.stats().failed_attempts >= 2
    });
    let () = redis::cmd("PEXPIRE")
        .arg(&key)
        .arg(300)
        .query(&mut srv.conn())
        .unwrap();
    let cut = Instant::now();
    let got = collect(&[waiter], secs(20), "waiter")[0];
    let after = got.at.duration_since(cut);
    let s = c.stats();
    eprintln!("TTL cut to 300 ms: acquired {after:?} after the cut; {s:?}");
    assert!(
        after >= ms(250),
        "acquired {after:?}: before the key expired"
    );
    assert!(
        after < ms(1300),
        "acquired {after:?}; bound TTL + 1 s; {s:?}"
    );
    assert!(s.wakeups_event >= 1, "not woken by `expired`: {s:?}");
    assert_eq!(s.wakeups_lease + s.wakeups_recheck, 0, "{s:?}");
}

#[test]
fn leaked_unrenewed_lock_expires_and_wakes_waiter() {
    let _light = HEAVY.read();
    let srv = RedisServer::start();
    let name = "leaked";
    let lease = secs(1);
    let flags = [("NO_RENEW", "1".into()), ("FORGET", "1".into())];
    let holder = spawn_holder(&srv, name, lease, &flags);
    // The child acquired before it printed: the lease ends within `lease` from here.
    let seen = Instant::now();
    let c = client(&srv.url()).build().expect("build");
    let got = collect(
        &[spawn_waiter(&c, name, Duration::ZERO)],
        secs(10),
        "waiter",
    )[0];
    let after = got.at.duration_since(seen);
    let s = c.stats();
    eprintln!(
        "leaked 1 s lock: acquired {after:?} after the holder said it had it (event {}, lease {}); {s:?}",
        s.wakeups_event, s.wakeups_lease
    );
    child::kill_and_reap(holder);
    assert!(
        after < lease + secs(1),
        "acquired {after:?}; bound lease + 1 s; {s:?}"
    );
    assert!(s.wakeups_event + s.wakeups_lease >= 1, "{s:?}");
    assert_eq!(s.wakeups_recheck, 0, "{s:?}");
}

// --- polling, for comparison --------------------------------------------------------------

/// A client that polls every `every`, and the guard of another client holding `name`.
fn poller_behind_a_holder(
    srv: &RedisServer,
    name: &str,
    every: Duration,
) -> (LockClient, LockGuard) {
    let holder = client(&srv.url()).build().expect("build");
    let guard = holder.lock(name).expect("lock");
    let poller = client(&srv.url())
        .wakeup(Wakeup::Polling(every))
        .build()
        .expect("build");
    (poller, guard)
}

#[test]
fn polling_waiter_acquires_by_polls_not_events() {
    let _light = HEAVY.read();
    let srv = RedisServer::start();
    let name = "polling";
    let (c, guard) = poller_behind_a_holder(&srv, name, ms(50));
    let waiter = spawn_waiter(&c, name, Duration::ZERO);
    wait_for(secs(10), "a few polls", || c.stats().failed_attempts >= 3);
    assert!(
        sub_connections(&srv).is_empty(),
        "a polling client opened a subscriber connection"
    );
    assert_eq!(guard.unlock().unwrap(), Unlocked::Released);
    let released = Instant::now();
    let got = collect(&[waiter], secs(10), "polling waiter")[0];
    let s = c.stats();
    eprintln!(
        "polling 50 ms: acquired {:?} after release; {s:?}",
        got.at.duration_since(released)
    );
    assert!(s.wakeups_poll > 0, "{s:?}");
    assert_eq!(s.wakeups_event, 0, "{s:?}");
    assert_eq!(s.wakeups_lease + s.wakeups_recheck, 0, "{s:?}");
}

/// `wakeups_poll` counts the polling intervals that ended a wait: a wait that its deadline
/// ended before the interval did is a timeout, not a poll wake-up.
#[test]
fn a_polling_wait_ended_by_its_deadline_is_not_a_poll_wakeup() {
    let srv = RedisServer::start();
    // Polling every 10 s: the deadline ends the wait, never an interval.
    let (waiter, _guard) = poller_behind_a_holder(&srv, "poll", secs(10));
    let err = waiter
        .try_lock_for("poll", ms(150))
        .expect_err("held by the other client");
    assert!(err.is_timeout(), "{err:?}");
    let s = waiter.stats();
    assert_eq!(s.timeouts, 1);
    assert_eq!(
        s.wakeups_poll, 0,
        "no 10 s polling interval ended within a 150 ms wait: {s:?}"
    );
}

/// Nor is a polling wait that a cancel ended.
#[test]
fn a_cancelled_polling_wait_is_not_a_poll_wakeup() {
    let srv = RedisServer::start();
    let (waiter, _guard) = poller_behind_a_holder(&srv, "poll-c", secs(10));
    let cancel = Cancel::new();
    let err = thread::scope(|s| {
        let w = s.spawn(|| waiter.lock_cancellable("poll-c", &cancel).map(drop));
        thread::sleep(ms(300));
        cancel.cancel();
        w.join().expect("waiter").expect_err("cancelled")
    });
    assert!(err.is_cancelled(), "{err:?}");
    let s = waiter.stats();
    assert_eq!(
        s.wakeups_poll, 0,
        "the cancel, not a 10 s polling interval, ended the wait: {s:?}"
    );
}

// --- 3. idle waiters cost nothing ------------------------------------------------------

/// Starts `n` waiter threads on `name` with `local_handoff(false)`, so each one waits in
/// Redis on its own.
fn idle_waiters(
    url: &str,
    name: &str,
    n: usize,
) -> (LockClient, Vec<Receiver<Result<Acquired, String>>>) {
    let c = client(url).local_handoff(false).build().expect("build");
    let waiters = (0..n)
        .map(|_| spawn_waiter(&c, name, Duration::ZERO))
        .collect();
    (c, waiters)
}

/// Child: `THREADS` waiters on `NAME`; says `blocked=1` once they all are, then waits for
/// them to get the lock in turn and reports its counters.
#[test]
fn child_idle_waiters() {
    child_only!();
    let n: usize = child::env("THREADS").parse().unwrap();
    let (c, waiters) = idle_waiters(&child::env("URL"), &child::env("NAME"), n);
    // Each waiter fails at least once: the first of a key subscribes and tries again, the
    // others may find the key's subscription confirmed and wait at once.
    wait_for(secs(20), "the child's waiters to block", || {
        c.stats().failed_attempts >= n as u64
    });
    thread::sleep(ms(200));
    child::print_result(&[("blocked", "1".into())]);
    collect(&waiters, secs(60), "child waiter");
    child::print_counters(&c.stats(), &[]);
}

#[test]
fn idle_waiters_send_no_commands() {
    let _light = HEAVY.read();
    let srv = RedisServer::start();
    let name = "idle";
    let holder = client(&srv.url()).lease(secs(30)).build().expect("build");
    let guard = holder.lock(name).expect("lock");

    let mut other = child::spawn_self(
        "child_idle_waiters",
        &[
            ("URL", srv.url()),
            ("NAME", name.into()),
            ("THREADS", "10".into()),
        ],
    );
    child::wait_for_line(&mut other, "blocked=1", secs(30));
    let (c, waiters) = idle_waiters(&srv.url(), name, 10);
    wait_for(secs(20), "the parent's waiters to block", || {
        c.stats().failed_attempts >= 10
    });
    // Settle, then watch for 2.5 s: the key is held for about 3 s of idle waiting, and the
    // window ends well before the re-check ceiling (5 s) of any waiter.
    thread::sleep(ms(500));
    let window = ms(2500);
    srv.reset_stats();
    let before = c.stats();
    thread::sleep(window);
    let stats = srv.commandstats();
    let after = c.stats();
    let ignored = [
        "subscribe",
        "unsubscribe",
        "psubscribe",
        "punsubscribe",
        "ping",
    ];
    let counted: u64 = stats
        .iter()
        .filter(|(k, _)| !ignored.contains(&k.as_str()))
        .map(|(_, v)| v)
        .sum();
    eprintln!(
        "20 idle waiters over {window:?}: server commandstats {stats:?}; counted (all but (un)subscribe/ping) = {counted}; parent client commands +{}",
        after.commands - before.commands
    );
    assert!(
        counted < 10,
        "20 idle waiters sent {counted} commands in {window:?}: {stats:?}"
    );

    assert_eq!(guard.unlock().unwrap(), Unlocked::Released);
    collect(&waiters, secs(30), "parent waiter");
    let out = child::wait_ok(other, secs(60));
    let cs = result_with(&out, "wakeups_event");
    let s = c.stats();
    eprintln!("idle waiters afterwards: parent {s:?}; child {cs:?}");
    assert_eq!(s.wakeups_recheck + s.wakeups_lease, 0, "{s:?}");
    assert_eq!(
        field::<i64>(&cs, "wakeups_recheck") + field::<i64>(&cs, "wakeups_lease"),
        0,
        "{cs:?}"
    );
}

// --- 4. the subscriber connection is killed --------------------------------------------

/// 8 waiter threads (`local_handoff(false)`: each waits in Redis); the subscriber
/// connection is killed while they wait; the holder releases once the subscriber has
/// re-subscribed and every waiter retried (`wait_for_resubscribe`), or right after the
/// kill, racing the reconnect.
fn pubsub_kill(name: &str, wait_for_resubscribe: bool) {
    let _light = HEAVY.read();
    let srv = RedisServer::start();
    let holder = client(&srv.url()).lease(secs(30)).build().expect("build");
    let guard = holder.lock(name).expect("lock");
    let (c, waiters) = {
        let c = client(&srv.url())
            .local_handoff(false)
            .build()
            .expect("build");
        let w: Vec<_> = (0..8).map(|_| spawn_waiter(&c, name, ms(5))).collect();
        (c, w)
    };
    // Each waiter fails at least once: the first of a key subscribes and tries again, the
    // others may find the key's subscription confirmed and wait at once.
    wait_for(secs(20), "8 waiters to block", || {
        c.stats().failed_attempts >= 8
    });
    thread::sleep(ms(200));
    let killed = srv.kill_pubsub();
    assert!(killed >= 1, "no pubsub client to kill");
    if wait_for_resubscribe {
        wait_for(secs(10), "the subscriber to reconnect", || {
            c.stats().reconnects >= 1
        });
        // The keyspace channel (classic) and the library's (sharded on Redis 7).
        let expected = expected_channels(1);
        wait_for(secs(10), "the subscriber to re-subscribe", || {
            sub_connections(&srv)
                .iter()
                .any(|s| channels(s) == expected)
        });
        // Every waiter retries once after the reconnect, then sleeps again.
        wait_for(secs(10), "8 waiters to retry after the reconnect", || {
            c.stats().wakeups_reconnect >= 8
        });
    }
    let before = c.stats();
    assert_eq!(guard.unlock().unwrap(), Unlocked::Released);
    let released = Instant::now();
    let got = collect(&waiters, secs(20), "waiter after pubsub kill");
    let last = got.iter().map(|a| a.at).max().unwrap();
    let first = got.iter().map(|a| a.at).min().unwrap();
    wait_for(secs(10), "the reconnect to be counted", || {
        c.stats().reconnects >= 1
    });
    let s = c.stats();
    eprintln!(
        "pubsub killed ({killed} client(s)), resubscribed first: {wait_for_resubscribe}; first waiter {:?}, last {:?} after release; before release {before:?}; after {s:?}",
        first.duration_since(released),
        last.duration_since(released)
    );
    assert!(s.reconnects >= 1, "{s:?}");
    let subs = c.subscribers();
    assert_eq!(subs.len(), 1);
    assert_eq!(subs[0].reconnects, s.reconnects, "per node, the same count");
    assert_eq!(
        s.wakeups_recheck, 0,
        "a waiter needed the safety net: {s:?}"
    );
    assert_eq!(s.wakeups_lease, 0, "{s:?}");
}

#[test]
fn pubsub_kill_then_release_wakes_every_waiter() {
    pubsub_kill("pubsub-kill", true);
}

#[test]
fn pubsub_kill_racing_release_wakes_every_waiter() {
    pubsub_kill("pubsub-kill-race", false);
}

// --- 5. keyspace notifications off and CONFIG renamed away ------------------------------

static WARNINGS: AtomicUsize = AtomicUsize::new(0);
static WARNING_TEXT: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// Counts the library's `warn!` records. Installed only in the child that needs it, so
/// the count is that process's alone.
struct WarnCounter;

impl log::Log for WarnCounter {
    fn enabled(&self, metadata: &log::Metadata<'_>) -> bool {
        metadata.level() <= log::Level::Warn
    }

    fn log(&self, record: &log::Record<'_>) {
        if record.level() == log::Level::Warn && record.target().starts_with("redbaton") {
            WARNINGS.fetch_add(1, Ordering::SeqCst);
            let text = format!("{}: {}", record.target(), record.args());
            eprintln!("captured warning: {text}");
            WARNING_TEXT
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(text);
        }
    }

    fn flush(&self) {}
}

fn install_warn_counter() {
    static INSTALL: Once = Once::new();
    INSTALL.call_once(|| {
        log::set_logger(&WarnCounter).expect("no other logger in this process");
        log::set_max_level(log::LevelFilter::Warn);
    });
}

/// Child: one client against a server without keyspace notifications; checks the lock
/// works, then waits on `NAME` (held by the parent) and reports when it got it, its
/// counters, and how many warnings the library logged.
#[test]
fn child_fallback_waiter() {
    child_only!();
    install_warn_counter();
    let c = client(&child::env("URL")).build().expect("build");
    let at_build = WARNINGS.load(Ordering::SeqCst);
    // The lock works.
    let g = c.try_lock("fallback-other").expect("try_lock");
    assert!(c.try_lock_for("fallback-other", ms(50)).is_err()); // this thread holds it
    assert_eq!(g.unlock().unwrap(), Unlocked::Released);
    assert_eq!(c.with_lock("fallback-other", || 1).unwrap(), 1);

    let waiter = spawn_waiter(&c, &child::env("NAME"), Duration::ZERO);
    wait_for(secs(20), "the waiter to block", || {
        c.stats().failed_attempts >= 2
    });
    child::print_result(&[("blocked", "1".into())]);
    let got = collect(&[waiter], secs(60), "fallback waiter")[0];
    let s = c.stats();
    drop(c);
    let warnings = WARNINGS.load(Ordering::SeqCst);
    child::print_counters(
        &s,
        &[
            ("acquired_us", got.at_us.to_string()),
            ("warnings_at_build", at_build.to_string()),
            ("warnings", warnings.to_string()),
        ],
    );
}

#[test]
fn without_keyspace_events_release_still_wakes_waiters() {
    let _light = HEAVY.read();
    let srv = RedisServer::without_notifications();
    let name = "fallback";
    // The holder runs here (its warning goes nowhere: no logger in this process).
    let holder = client(&srv.url()).lease(secs(30)).build().expect("build");
    let guard = holder.lock(name).expect("lock");
    let mut waiter = child::spawn_self(
        "child_fallback_waiter",
        &[("URL", srv.url()), ("NAME", name.into())],
    );
    child::wait_for_line(&mut waiter, "blocked=1", secs(30));
    thread::sleep(ms(300));
    let released_us = wall_us() as i64;
    assert_eq!(guard.unlock().unwrap(), Unlocked::Released);
    let out = child::wait_ok(waiter, secs(60));
    let r = result_with(&out, "warnings");
    let latency = field::<i64>(&r, "acquired_us") - released_us;
    eprintln!("no keyspace events: waiter acquired {latency} us after release; child {r:?}");
    assert_eq!(field::<i64>(&r, "warnings_at_build"), 1, "{r:?}");
    assert_eq!(
        field::<i64>(&r, "warnings"),
        1,
        "exactly one warning in all: {r:?}"
    );
    assert!(
        latency < 1_000_000,
        "acquired {latency} us after release (bound 1 s); {r:?}"
    );
    assert!(field::<i64>(&r, "wakeups_event") >= 1, "{r:?}");
    assert_eq!(field::<i64>(&r, "wakeups_recheck"), 0, "{r:?}");
    assert_eq!(field::<i64>(&r, "wakeups_lease"), 0, "{r:?}");
    assert_eq!(field::<i64>(&r, "wakeups_poll"), 0, "{r:?}");
    let subs = sub_connections(&srv);
    assert!(subs.is_empty(), "the child is gone: {subs:?}");
}

// --- 6. churn: no lost wakeups -------------------------------------------------------------

const CHURN_PROCESSES: usize = 4;
const CHURN_THREADS: usize = 4;
const CHURN_SECTIONS: usize = 300;

/// Child: `THREADS` threads × `SECTIONS` critical sections on `NAME` (each a GET + SET of
/// `COUNTER`), with `local_handoff(false)` and 10 s leases; starts when `GO` exists;
/// reports its longest single wait.
#[test]
fn child_churn() {
    child_only!();
    let url = child::env("URL");
    let name = child::env("NAME");
    let counter = child::env("COUNTER");
    let threads: usize = child::env("THREADS").parse().unwrap();
    let sections: usize = child::env("SECTIONS").parse().unwrap();
    let c = client(&url)
        .lease(secs(10))
        .local_handoff(false)
        .build()
        .expect("build");
    let mut conn = raw_conn(&url);
    child::print_result(&[("ready", "1".into())]);
    let go = child::env("GO");
    let started = Instant::now();
    while !redis::cmd("EXISTS")
        .arg(&go)
        .query::<bool>(&mut conn)
        .unwrap()
    {
        assert!(started.elapsed() < secs(60), "parent never said go");
        thread::sleep(ms(2));
    }
    let handles: Vec<_> = (0..threads)
        .map(|_| {
            let (c, name, counter, url) = (c.clone(), name.clone(), counter.clone(), url.clone());
            thread::spawn(move || {
                let mut conn = raw_conn(&url);
                let mut max_wait = Duration::ZERO;
                for _ in 0..sections {
                    let t = Instant::now();
                    let guard = c.lock(&name).expect("lock");
                    max_wait = max_wait.max(t.elapsed());
                    let v: Option<u64> = redis::cmd("GET").arg(&counter).query(&mut conn).unwrap();
                    let () = redis::cmd("SET")
                        .arg(&counter)
                        .arg(v.unwrap_or(0) + 1)
                        .query(&mut conn)
                        .unwrap();
                    assert_eq!(guard.unlock().expect("unlock"), Unlocked::Released);
                }
                max_wait
            })
        })
        .collect();
    let max_wait = handles
        .into_iter()
        .map(|h| h.join().expect("churn thread"))
        .max()
        .unwrap();
    let run_ms = started.elapsed().as_millis();
    child::print_counters(
        &c.stats(),
        &[
            ("max_wait_us", max_wait.as_micros().to_string()),
            ("run_ms", run_ms.to_string()),
        ],
    );
}

#[test]
fn churn_loses_no_wakeups() {
    let _heavy = HEAVY.write();
    let srv = RedisServer::start();
    let envs = [
        ("URL", srv.url()),
        ("NAME", "churn".to_string()),
        ("COUNTER", "churn:counter".to_string()),
        ("GO", "churn:go".to_string()),
        ("THREADS", CHURN_THREADS.to_string()),
        ("SECTIONS", CHURN_SECTIONS.to_string()),
    ];
    let mut children = child::spawn_many(CHURN_PROCESSES, "child_churn", &envs);
    for ch in &mut children {
        child::wait_for_line(ch, "ready=1", secs(30));
    }
    let started = Instant::now();
    let () = redis::cmd("SET")
        .arg("churn:go")
        .arg(1)
        .query(&mut srv.conn())
        .unwrap();
    let outs: Vec<_> = children
        .into_iter()
        .map(|ch| child::wait_ok(ch, secs(240)))
        .collect();
    let elapsed = started.elapsed();
    let results: Vec<_> = outs.iter().map(|o| result_with(o, "max_wait_us")).collect();
    let total: u64 = redis::cmd("GET")
        .arg("churn:counter")
        .query(&mut srv.conn())
        .unwrap();
    let expected = (CHURN_PROCESSES * CHURN_THREADS * CHURN_SECTIONS) as u64;
    let max_wait = results
        .iter()
        .map(|r| field::<i64>(r, "max_wait_us"))
        .max()
        .unwrap();
    let sum = |k: &str| results.iter().map(|r| field::<i64>(r, k)).sum::<i64>();
    eprintln!(
        "churn {CHURN_PROCESSES}x{CHURN_THREADS}x{CHURN_SECTIONS}: {elapsed:?}, counter {total}, longest wait {max_wait} us; wakeups event {} lease {} recheck {} reconnect {}; failed attempts {}; evalsha {}",
        sum("wakeups_event"),
        sum("wakeups_lease"),
        sum("wakeups_recheck"),
        sum("wakeups_reconnect"),
        sum("failed_attempts"),
        srv.command_count("evalsha"),
    );
    for r in &results {
        eprintln!("  child: {r:?}");
    }
    assert_eq!(
        total, expected,
        "the counter lost updates: mutual exclusion broken"
    );
    assert_eq!(sum("wakeups_recheck"), 0, "a waiter needed the safety net");
    assert_eq!(sum("wakeups_lease"), 0, "a waiter slept until the lease");
    assert!(
        max_wait < 2_000_000,
        "a single wait took {max_wait} us (bound 2 s)"
    );
}

// --- 8. one subscriber connection for many waiters and keys ------------------------------

#[test]
fn many_waiters_on_many_keys_share_one_subscriber_connection() {
    let _heavy = HEAVY.write();
    let srv = RedisServer::start();
    let keys: Vec<String> = (0..50).map(|i| format!("many-{i}")).collect();
    let holder = client(&srv.url()).lease(secs(30)).build().expect("build");
    let guards: Vec<_> = keys.iter().map(|k| holder.lock(k).expect("lock")).collect();
    let c = client(&srv.url())
        .local_handoff(false)
        .build()
        .expect("build");
    let waiters: Vec<_> = (0..200)
        .map(|i| spawn_waiter(&c, &keys[i % keys.len()], Duration::ZERO))
        .collect();
    // Each waiter fails once (the first of a key subscribes, then tries again; the others
    // may find the key's subscription confirmed already and wait at once).
    let expected = expected_channels(50);
    wait_for(secs(60), "200 waiters to block", || {
        c.stats().failed_attempts >= 200
            && sub_connections(&srv)
                .first()
                .is_some_and(|s| channels(s) == expected)
    });
    let subs = sub_connections(&srv);
    let all = srv.client_list();
    eprintln!(
        "200 waiters on 50 keys: {} subscriber connection(s) {subs:?}; {} connections in all",
        subs.len(),
        all.len()
    );
    assert_eq!(
        subs.len(),
        1,
        "one subscriber connection per client: {subs:?}"
    );
    // 2 channels per key: its keyspace channel, and the library's (a shard channel on
    // Redis 7, a classic one before).
    assert_eq!(
        channels(&subs[0]),
        expected,
        "one keyspace channel and one library channel per key"
    );
    assert_eq!(subs[0].get("psub").map(String::as_str), Some("0"));
    let released = Instant::now();
    for g in guards {
        assert_eq!(g.unlock().unwrap(), Unlocked::Released);
    }
    let got = collect(&waiters, secs(60), "one of 200 waiters");
    let last = got.iter().map(|a| a.at).max().unwrap();
    let s = c.stats();
    eprintln!(
        "200 waiters: all acquired within {:?} of the first release; {s:?}",
        last.duration_since(released)
    );
    assert_eq!(s.wakeups_recheck + s.wakeups_lease, 0, "{s:?}");
}

// --- a server restart forgets `notify-keyspace-events` --------------------------------

/// Holder takes `name`, a waiter of `c` blocks, the holder releases after 300 ms: how long
/// after the release the waiter got the lock, and `c`'s counters before the wait.
fn release_latency(holder: &LockClient, c: &LockClient, name: &str) -> (Duration, Stats) {
    let guard = holder.lock(name).expect("lock");
    let before = c.stats();
    let waiter = spawn_waiter(c, name, Duration::ZERO);
    wait_for(secs(20), "the waiter to block", || {
        c.stats().failed_attempts >= before.failed_attempts + 2
    });
    thread::sleep(ms(300));
    assert_eq!(guard.unlock().unwrap(), Unlocked::Released);
    let released = Instant::now();
    let got = collect(&[waiter], secs(20), "waiter")[0];
    (got.at.saturating_duration_since(released), before)
}

/// `CONFIG SET notify-keyspace-events` done by `build()` lives only in the server's memory:
/// a restart (or a failover to a replica configured without it, or an operator's
/// `CONFIG SET`) loses it. Clients built before must still wake their waiters on release,
/// not by the re-check ceiling.
///
/// Regression: the flags were checked only in `build()`; the subscriber now re-checks them
/// at every (re)connect, and releases always publish on the library's channel.
#[test]
fn waiters_still_wake_on_release_after_server_restart() {
    let _light = HEAVY.read();
    let srv = RedisServer::start();
    let name = "restart";
    let holder = client(&srv.url()).lease(secs(30)).build().expect("build");
    let c = client(&srv.url()).build().expect("build");
    let (first, _) = release_latency(&holder, &c, name);
    eprintln!("before the restart: acquired {first:?} after release");
    assert!(first < secs(1), "{first:?}");

    srv.restart();
    let flags = srv.config_get("notify-keyspace-events");
    eprintln!("after the restart notify-keyspace-events = {:?}", flags);
    // The pools find their connections dead: the first command after a restart may fail.
    wait_for(secs(10), "the holder to reach the restarted server", || {
        holder.try_lock("probe").is_ok()
    });
    let (after, before) = release_latency(&holder, &c, name);
    let s = c.stats();
    eprintln!("after a server restart: acquired {after:?} after release; {s:?}");
    assert!(
        after < secs(1),
        "acquired {after:?} after the release (bound 1 s): not woken by the release; {s:?}"
    );
    assert_eq!(s.wakeups_recheck, before.wakeups_recheck, "{s:?}");
}

// --- Redis 7 ACL users without channel permissions --------------------------------------

/// A server with the ACL user `alice` (password `pw`) defined by `rule`; the URL logs in
/// as alice.
fn acl_server(rule: &str) -> (RedisServer, String) {
    let srv = RedisServer::builder().acl_user("alice", "pw", rule).start();
    let url = srv.url_as("alice", "pw");
    (srv, url)
}

/// Redis 7 creates ACL users with `resetchannels` (`acl-pubsub-default`): such a user may
/// run every command on every key but may not publish or subscribe. The lock must still
/// work, and waiters must still get it after a release (without events they can only
/// retry with the degraded backoff, capped at 1 s).
///
/// Regression: the scripts `PUBLISH`ed with `redis.call`, so every attempt on a held lock
/// failed with "can't publish to the channel"; they use `pcall` now.
#[test]
fn acl_user_without_channel_permissions_can_still_wait() {
    let _light = HEAVY.read();
    let (_srv, url) = acl_server("~* +@all");
    let holder = client(&url).lease(secs(30)).build().expect("build");
    let c = client(&url).build().expect("build");
    let guard = holder.lock("acl").expect("lock");
    match c.try_lock("acl") {
        Err(e) if e.is_would_block() => {}
        other => panic!("try_lock on a held lock: expected WouldBlock, got {other:?}"),
    }
    let waiter = spawn_waiter(&c, "acl", Duration::ZERO);
    thread::sleep(ms(500));
    assert_eq!(guard.unlock().unwrap(), Unlocked::Released);
    let released = Instant::now();
    let got = collect(&[waiter], secs(20), "ACL waiter")[0];
    let after = got.at.saturating_duration_since(released);
    eprintln!(
        "ACL user without channels: acquired {after:?} after release; {:?}",
        c.stats()
    );
    assert!(
        after < secs(3),
        "acquired {after:?} after release (bound 3 s)"
    );
}

/// An ACL user allowed the library's channels (`&redbaton:*`) but not the keyspace ones
/// (`&__keyspace@*`, which the design notes Redis 7 ACLs need): `SUBSCRIBE` to the
/// keyspace channel is refused with NOPERM. Waiters must still wake on release (the
/// library's own channel can carry it), not by the 5 s re-check.
///
/// Regression: a refused `SUBSCRIBE` was taken for a confirmation (redis-rs
/// `PubSub::subscribe` returns `Ok` on an error reply); the subscriber now probes channel
/// permissions on a plain connection, and releases always publish on the library channel.
#[test]
fn acl_user_without_keyspace_channels_still_wakes_on_release() {
    let _light = HEAVY.read();
    let (_srv, url) = acl_server("~* resetchannels &redbaton:* +@all");
    let holder = client(&url).lease(secs(30)).build().expect("build");
    let c = client(&url).build().expect("build");
    let (after, before) = release_latency(&holder, &c, "acl-keyspace");
    let s = c.stats();
    eprintln!("ACL user without keyspace channels: acquired {after:?} after release; {s:?}");
    assert!(
        after < secs(1),
        "acquired {after:?} after release (bound 1 s); {s:?}"
    );
    assert_eq!(s.wakeups_recheck, before.wakeups_recheck, "{s:?}");
}

// --- names and databases -----------------------------------------------------------------

/// Keyspace channels are per database and carry the key verbatim: a waiter in database 3
/// on a binary name full of glob characters is still woken by the release event.
#[test]
fn waiters_wake_in_another_database_on_binary_names() {
    let _light = HEAVY.read();
    let srv = RedisServer::start();
    let url = format!("redis://127.0.0.1:{}/3", srv.port());
    let name: &[u8] = b"odd*[?]\\ name \xff\x00}{:ev";
    let holder = client(&url).lease(secs(30)).build().expect("build");
    let c = client(&url).build().expect("build");
    let guard = holder.lock(name).expect("lock");
    let before = c.stats();
    let (tx, rx) = crossbeam_channel::bounded(1);
    let c2 = c.clone();
    thread::spawn(move || {
        let r = c2.lock(name).map(|g| {
            let at = Instant::now();
            drop(g);
            at
        });
        let _ = tx.send(r.map_err(|e| e.to_string()));
    });
    wait_for(secs(10), "the waiter to block", || {
        c.stats().failed_attempts >= before.failed_attempts + 2
    });
    assert_eq!(guard.unlock().unwrap(), Unlocked::Released);
    let released = Instant::now();
    let at = rx
        .recv_timeout(secs(20))
        .expect("waiter hung")
        .expect("waiter failed");
    let after = at.saturating_duration_since(released);
    let s = c.stats();
    eprintln!("db 3, binary name: acquired {after:?} after release; {s:?}");
    assert!(
        after < secs(1),
        "acquired {after:?} after release (bound 1 s); {s:?}"
    );
    assert!(s.wakeups_event >= 1, "{s:?}");
    assert_eq!(s.wakeups_recheck + s.wakeups_lease, 0, "{s:?}");
    assert!(srv.keys("*").is_empty(), "keys went to database 0");
}
