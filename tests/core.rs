//! The core lock on one Redis node, against a real `redis-server`: mutual exclusion
//! (threads and processes), fencing tokens, release on panic, `try_lock*`, the idempotent
//! acquire after a lost reply, unlock outcomes, bad input, and the connection bound.

use std::collections::HashSet;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use redbaton::{Error, LockClient, Unlocked};
use redbaton_testkit::child;
use redbaton_testkit::child_only;
use redbaton_testkit::keys::{Counter, FENCE_STEP, FenceCount, Keys, fence_of};
use redbaton_testkit::proxy::Proxy;
use redbaton_testkit::server::RedisServer;
use redbaton_testkit::wait::{join_within, wait_until};
use redbaton_testkit::{dead_url, test_server, test_server_and};
use redbaton_testkit::{init_log, ms};
use redbaton_testkit::{lock_builder, lock_client};
use redbaton_testkit::{pttl, raw_conn};
use redis::Connection;

/// The keys of a client with the default prefix.
const KEYS: Keys = Keys::DEFAULT;

// --- helpers ---------------------------------------------------------------

/// A client on `url` with the defaults.
fn client(url: &str) -> LockClient {
    lock_client!(node(url))
}

/// Every key on the server that is not a fencing counter.
fn lock_keys(srv: &RedisServer) -> Vec<Vec<u8>> {
    srv.keys("*")
        .into_iter()
        .filter(|k| !k.ends_with(b":fence"))
        .collect()
}

fn get(conn: &mut Connection, key: &[u8]) -> Option<Vec<u8>> {
    redis::cmd("GET").arg(key).query(conn).expect("GET")
}

fn get_u64(conn: &mut Connection, key: &[u8]) -> Option<u64> {
    redis::cmd("GET").arg(key).query(conn).expect("GET")
}

fn set_u64(conn: &mut Connection, key: &[u8], v: u64) {
    let () = redis::cmd("SET").arg(key).arg(v).query(conn).expect("SET");
}

fn assert_strictly_increasing(tokens: &[u64], what: &str) {
    for (i, w) in tokens.windows(2).enumerate() {
        assert!(
            w[0] < w[1],
            "{what}: fencing token #{} = {:#x} is not above #{i} = {:#x}",
            i + 1,
            w[1],
            w[0]
        );
    }
}

// --- smoke -------------------------------------------------------------------

#[test]
fn smoke() {
    let (srv, client) = test_server_and(client);
    let guard = client.lock("smoke").expect("lock");
    assert_eq!(guard.name(), b"smoke");
    assert!(guard.fencing_token() > 0);
    assert!(!guard.is_lost());
    assert_eq!(lock_keys(&srv), vec![KEYS.lock_bytes(b"smoke")]);
    assert_eq!(guard.unlock().expect("unlock"), Unlocked::Released);
    assert!(lock_keys(&srv).is_empty(), "lock key left after unlock");
}

// --- 1. mutual exclusion, one process ----------------------------------------

const THREADS: usize = 16;
const SECTIONS: usize = 200;

/// 16 threads x 200 sections on one key, each a non-atomic GET + SET of a counter on its
/// own raw connection: the counter ends exact, and the fencing tokens seen inside the
/// sections, in the order the sections ran, strictly increase.
fn mutual_exclusion(local_handoff: bool) {
    let srv = test_server();
    let fences = FenceCount::start(&srv);
    let url = srv.url();
    let client = lock_client!(node(&url), local_handoff(local_handoff));
    let name = b"counter-lock";
    let counter = b"counter".to_vec();
    let tokens = Arc::new(Mutex::new(Vec::with_capacity(THREADS * SECTIONS)));
    let inside = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let handles: Vec<_> = (0..THREADS)
        .map(|_| {
            let (client, url, counter) = (client.clone(), url.clone(), counter.clone());
            let (tokens, inside) = (tokens.clone(), inside.clone());
            thread::spawn(move || {
                let mut conn = raw_conn(&url);
                for _ in 0..SECTIONS {
                    let guard = client.lock(name).expect("lock");
                    assert!(
                        !inside.swap(true, Ordering::SeqCst),
                        "two holders inside the critical section at once"
                    );
                    let v = get_u64(&mut conn, &counter).unwrap_or(0);
                    thread::yield_now(); // widen the race a lost lock would open
                    set_u64(&mut conn, &counter, v + 1);
                    tokens.lock().unwrap().push(guard.fencing_token());
                    inside.store(false, Ordering::SeqCst);
                    let outcome = guard.unlock().expect("unlock");
                    assert!(outcome.was_held(), "unlock said {outcome}");
                }
            })
        })
        .collect();
    join_within(handles, Duration::from_secs(120), "workers");
    let elapsed = started.elapsed();
    let stats = client.stats();
    eprintln!(
        "mutual exclusion (local_handoff={local_handoff}): {} sections in {elapsed:?}; {stats:?}",
        THREADS * SECTIONS
    );

    let mut conn = srv.conn();
    assert_eq!(
        get_u64(&mut conn, &counter),
        Some((THREADS * SECTIONS) as u64),
        "lost updates: the lock let two sections overlap"
    );
    let tokens = tokens.lock().unwrap();
    assert_eq!(tokens.len(), THREADS * SECTIONS);
    assert_strictly_increasing(&tokens, "one process");
    // Every remote acquisition issued exactly one fence, and the counter holds the last.
    assert_eq!(fences.issued(), stats.remote_acquisitions);
    assert_eq!(
        get_u64(&mut conn, &KEYS.fence_bytes(name)),
        Some(fence_of(*tokens.last().unwrap()))
    );
    assert_eq!(
        stats.remote_acquisitions + stats.local_handoffs,
        (THREADS * SECTIONS) as u64
    );
    if local_handoff {
        assert!(
            stats.local_handoffs > 0,
            "16 threads on one key never queued?"
        );
    } else {
        assert_eq!(stats.local_handoffs, 0, "handoff is off");
        assert_eq!(stats.remote_acquisitions, (THREADS * SECTIONS) as u64);
    }
    assert!(
        lock_keys(&srv).iter().all(|k| k == &counter),
        "lock key left"
    );
}

#[test]
fn mutual_exclusion_threads_with_handoff() {
    mutual_exclusion(true);
}

#[test]
fn mutual_exclusion_threads_without_handoff() {
    mutual_exclusion(false);
}

// --- 2. mutual exclusion across processes --------------------------------------

const PROCS: usize = 4;
const PROC_THREADS: usize = 4;
const PROC_SECTIONS: usize = 150;

/// Child entry point: `CORE_THREADS` threads x `CORE_ITERS` sections on lock `xproc`, each
/// a GET + SET of `xcounter` and an RPUSH of its fencing token to `xtokens`.
#[test]
fn child_mutex_worker() {
    child_only!();
    let url = child::env("CORE_URL");
    let threads: usize = child::env("CORE_THREADS").parse().expect("CORE_THREADS");
    let iters: usize = child::env("CORE_ITERS").parse().expect("CORE_ITERS");
    let client = client(&url);
    // Start barrier: every process is built and connected before anyone locks.
    let mut conn = raw_conn(&url);
    let () = redis::cmd("INCR")
        .arg("xready")
        .query(&mut conn)
        .expect("INCR");
    assert!(
        wait_until(Duration::from_secs(30), || get(&mut conn, b"xgo").is_some()),
        "no go signal"
    );
    let handles: Vec<_> = (0..threads)
        .map(|_| {
            let (client, url) = (client.clone(), url.clone());
            thread::spawn(move || {
                let mut conn = raw_conn(&url);
                let mut seen = Vec::with_capacity(iters);
                for _ in 0..iters {
                    let guard = client.lock("xproc").expect("lock");
                    let token = guard.fencing_token();
                    let v = get_u64(&mut conn, b"xcounter").unwrap_or(0);
                    thread::yield_now();
                    set_u64(&mut conn, b"xcounter", v + 1);
                    let () = redis::cmd("RPUSH")
                        .arg("xtokens")
                        .arg(token)
                        .query(&mut conn)
                        .expect("RPUSH");
                    seen.push(token);
                    let outcome = guard.unlock().expect("unlock");
                    assert!(outcome.was_held(), "unlock said {outcome}");
                }
                seen
            })
        })
        .collect();
    let per_thread = join_within(handles, Duration::from_secs(120), "workers");
    for seen in &per_thread {
        assert_strictly_increasing(seen, "one thread");
    }
    let sections = per_thread.iter().map(Vec::len).sum::<usize>();
    child::print_counters(&client.stats(), &[("sections", sections.to_string())]);
}

#[test]
fn mutual_exclusion_across_processes() {
    let srv = test_server();
    let fences = FenceCount::start(&srv);
    let url = srv.url();
    let started = Instant::now();
    let children = child::spawn_many(
        PROCS,
        "child_mutex_worker",
        &[
            ("CORE_URL", url.clone()),
            ("CORE_THREADS", PROC_THREADS.to_string()),
            ("CORE_ITERS", PROC_SECTIONS.to_string()),
        ],
    );
    let mut conn = srv.conn();
    let ready = wait_until(Duration::from_secs(60), || {
        get_u64(&mut conn, b"xready") == Some(PROCS as u64)
    });
    if !ready {
        for c in children {
            let mut c = c;
            child::kill_child(&mut c, libc::SIGKILL);
            let out = child::wait_output(c, Duration::from_secs(10));
            eprintln!("child stderr:\n{}", out.stderr);
        }
        panic!("children did not all reach the start barrier");
    }
    set_u64(&mut conn, b"xgo", 1);
    let go = Instant::now();
    let outputs = child::wait_all_ok(children, Duration::from_secs(150));
    eprintln!(
        "across processes: {} sections in {:?} (after start barrier; {:?} total)",
        PROCS * PROC_THREADS * PROC_SECTIONS,
        go.elapsed(),
        started.elapsed()
    );

    let total = (PROCS * PROC_THREADS * PROC_SECTIONS) as u64;
    let mut remote_sum = 0;
    for out in &outputs {
        let results = child::parse_results(out);
        assert_eq!(results.len(), 1, "child stdout:\n{out}");
        let r = &results[0];
        eprintln!("  child: {r:?}");
        assert_eq!(
            r["sections"],
            (PROC_THREADS * PROC_SECTIONS).to_string(),
            "{r:?}"
        );
        remote_sum += r["remote_acquisitions"].parse::<u64>().expect("remote");
    }
    assert_eq!(
        get_u64(&mut conn, b"xcounter"),
        Some(total),
        "lost updates: two processes were inside the lock at once"
    );
    let tokens: Vec<u64> = redis::cmd("LRANGE")
        .arg("xtokens")
        .arg(0)
        .arg(-1)
        .query(&mut conn)
        .expect("LRANGE");
    assert_eq!(tokens.len() as u64, total);
    assert_strictly_increasing(&tokens, "all processes, in section order");
    assert_eq!(
        tokens.iter().collect::<HashSet<_>>().len() as u64,
        total,
        "fencing tokens repeat"
    );
    // Each remote acquisition of every process issued exactly one fence, and the counter
    // holds the last.
    assert_eq!(fences.issued(), remote_sum);
    assert_eq!(
        get_u64(&mut conn, &KEYS.fence_bytes(b"xproc")),
        Some(fence_of(*tokens.last().unwrap()))
    );
    assert!(
        get(&mut conn, &KEYS.lock_bytes(b"xproc")).is_none(),
        "lock key left"
    );
}

// --- 3. a panic inside with_lock releases the lock ----------------------------

#[test]
fn panic_in_with_lock_releases() {
    let (srv, a) = test_server_and(client);
    let b = client(&srv.url());
    let name = "panicky";

    // (a) A waiter of another client ("process"), blocked in lock(), gets it at once.
    let (tx, rx) = crossbeam_channel::bounded::<(Instant, u64)>(1);
    let b2 = b.clone();
    let mut waiter = None;
    let panicked_at = Mutex::new(None::<Instant>);
    let result = std::panic::catch_unwind(AssertUnwindSafe(|| {
        a.with_lock(name, || {
            waiter = Some(thread::spawn(move || {
                let g = b2.lock(name).expect("waiter lock");
                tx.send((Instant::now(), g.fencing_token())).unwrap();
                assert_eq!(g.unlock().unwrap(), Unlocked::Released);
            }));
            // The waiter has failed its attempt(s) and sleeps in lock().
            assert!(
                wait_until(Duration::from_secs(10), || b.stats().failed_attempts >= 2),
                "waiter never tried"
            );
            thread::sleep(ms(100));
            *panicked_at.lock().unwrap() = Some(Instant::now());
            panic!("boom (expected: testing release on panic)");
        })
    }));
    let returned_at = Instant::now();
    assert!(result.is_err(), "the closure's panic must propagate");
    let panicked_at = panicked_at.lock().unwrap().expect("closure ran");
    let (acquired_at, waiter_token) = rx
        .recv_timeout(Duration::from_secs(10))
        .expect("the remote waiter did not get the lock within 10 s (lease is 30 s)");
    let latency = acquired_at.saturating_duration_since(panicked_at);
    // The panic hook (printing a backtrace) runs before the unwinding releases the lock.
    eprintln!(
        "remote waiter acquired {latency:?} after panic!, {:?} after with_lock returned",
        acquired_at.saturating_duration_since(returned_at)
    );
    assert!(latency < Duration::from_secs(5), "{latency:?}");
    // The second acquisition, in Redis: the counter's latest value, no local handoff (read
    // in any of its forms: the waiter may still hold it).
    assert_eq!(
        Counter::read(&mut srv.conn(), &KEYS.fence(name).into_bytes()).map(|c| c.fence),
        Some(fence_of(waiter_token)),
        "second acquisition: {waiter_token:#x}"
    );
    assert_eq!(waiter_token % FENCE_STEP, 0, "{waiter_token:#x}");
    join_within(
        vec![waiter.expect("spawned")],
        Duration::from_secs(10),
        "the waiter",
    );

    // (b) A waiter of the same client (queued locally) gets the baton at once.
    let (tx, rx) = crossbeam_channel::bounded::<Instant>(1);
    let a2 = a.clone();
    let mut waiter = None;
    let panicked_at = Mutex::new(None::<Instant>);
    let result = std::panic::catch_unwind(AssertUnwindSafe(|| {
        a.with_lock(name, || {
            waiter = Some(thread::spawn(move || {
                let g = a2.lock(name).expect("local waiter lock");
                tx.send(Instant::now()).unwrap();
                assert!(g.unlock().unwrap().was_held());
            }));
            thread::sleep(ms(200)); // let it queue
            *panicked_at.lock().unwrap() = Some(Instant::now());
            panic!("boom (expected: testing release on panic)");
        })
    }));
    let returned_at = Instant::now();
    assert!(result.is_err());
    let panicked_at = panicked_at.lock().unwrap().expect("closure ran");
    let acquired_at = rx
        .recv_timeout(Duration::from_secs(10))
        .expect("the local waiter did not get the lock within 10 s");
    let latency = acquired_at.saturating_duration_since(panicked_at);
    eprintln!(
        "local waiter acquired {latency:?} after panic!, {:?} after with_lock returned",
        acquired_at.saturating_duration_since(returned_at)
    );
    assert!(latency < Duration::from_secs(5), "{latency:?}");
    join_within(
        vec![waiter.expect("spawned")],
        Duration::from_secs(10),
        "the waiter",
    );

    // (c) Nobody waits: the key is gone and try_lock succeeds right away, on both clients.
    let result = std::panic::catch_unwind(AssertUnwindSafe(|| {
        a.with_lock::<()>(name, || panic!("boom (expected: testing release on panic)"))
    }));
    assert!(result.is_err());
    assert!(lock_keys(&srv).is_empty(), "the panic left the lock key");
    let g = a
        .try_lock(name)
        .expect("try_lock on the same client after a panic");
    assert_eq!(g.unlock().unwrap(), Unlocked::Released);
    let result = std::panic::catch_unwind(AssertUnwindSafe(|| {
        a.with_lock::<()>(name, || panic!("boom (expected: testing release on panic)"))
    }));
    assert!(result.is_err());
    let g = b
        .try_lock(name)
        .expect("try_lock on another client after a panic");
    assert_eq!(g.unlock().unwrap(), Unlocked::Released);
}

// --- 4. try_lock / try_lock_for on a held key -----------------------------------

#[test]
fn try_lock_on_a_held_key() {
    let (srv, a) = test_server_and(client);
    let b = client(&srv.url());
    let name = b"busy";
    let mut conn = srv.conn();

    let held = b.lock(name).expect("other owner locks");
    let their_fence = held.fencing_token() / FENCE_STEP;
    let their_token = get(&mut conn, &KEYS.lock_bytes(name)).expect("their token");

    let t0 = Instant::now();
    let err = a.try_lock(name).expect_err("held elsewhere");
    let took = t0.elapsed();
    assert!(err.is_would_block(), "{err:?}");
    assert!(took < Duration::from_secs(10), "try_lock waited {took:?}");

    let t0 = Instant::now();
    let err = a.try_lock_for(name, ms(200)).expect_err("held elsewhere");
    let took = t0.elapsed();
    eprintln!("try_lock_for(200 ms) gave up after {took:?}");
    assert!(err.is_timeout(), "{err:?}");
    assert!(took >= ms(190), "gave up early: {took:?}");
    assert!(took < Duration::from_secs(10), "gave up late: {took:?}");
    assert_eq!(a.stats().timeouts, 1);
    assert_eq!(a.stats().remote_acquisitions, 0);

    // Nothing held, nothing left: the key still holds the other owner's token, and no
    // other key appeared.
    assert_eq!(get(&mut conn, &KEYS.lock_bytes(name)), Some(their_token));
    assert!(pttl(&mut conn, KEYS.lock_bytes(name)) > 0);
    let mut keys = srv.keys("*");
    keys.sort();
    assert_eq!(keys, vec![KEYS.lock_bytes(name), KEYS.fence_bytes(name)]);
    // ...and no subscription outlives the wait.
    let subscribed = || {
        srv.client_list()
            .iter()
            .filter(|c| c["name"] == "redbaton:sub")
            .map(|c| {
                ["sub", "psub", "ssub"]
                    .iter()
                    .map(|k| c.get(*k).and_then(|n| n.parse::<u64>().ok()).unwrap_or(0))
                    .sum::<u64>()
            })
            .sum::<u64>()
    };
    assert!(
        wait_until(Duration::from_secs(10), || subscribed() == 0),
        "{} channels still subscribed after the wait ended",
        subscribed()
    );

    // The same from another thread of the holder's own client: WouldBlock, no wait.
    let b2 = b.clone();
    let t = thread::spawn(move || {
        let t0 = Instant::now();
        let err = b2.try_lock(name).expect_err("held by a sibling thread");
        (err, t0.elapsed())
    });
    let (err, took) = join_within(vec![t], Duration::from_secs(10), "the waiter").remove(0);
    assert!(err.is_would_block(), "{err:?}");
    assert!(took < Duration::from_secs(10), "{took:?}");

    // Once the owner releases, the client that timed out takes it: no stale local state.
    assert_eq!(held.unlock().unwrap(), Unlocked::Released);
    let g = a.try_lock(name).expect("free now");
    assert!(fence_of(g.fencing_token()) > their_fence);
    assert_eq!(g.unlock().unwrap(), Unlocked::Released);
    assert!(lock_keys(&srv).is_empty());
}

// --- 5. a lost reply to the acquire ----------------------------------------------

#[test]
fn lost_acquire_reply_is_retried_idempotently() {
    let srv = test_server();
    let proxy = Proxy::start(srv.addr());
    let client = lock_client!(node(proxy.url()), read_timeout(Duration::from_secs(5)));
    // Warm up: scripts loaded, pool connected, on another name.
    let g = client.lock("warm-up").expect("warm-up lock");
    assert_eq!(g.unlock().unwrap(), Unlocked::Released);
    let before = client.stats();
    srv.reset_stats();

    proxy.drop_next_reply_matching(b"EVALSHA");
    let name = b"fragile";
    let t0 = Instant::now();
    let guard = client
        .lock(name)
        .expect("acquire must survive a lost reply");
    eprintln!("acquired after a lost reply in {:?}", t0.elapsed());
    assert_eq!(proxy.replies_dropped(), 1, "the fault never fired");
    assert!(!proxy.drop_armed());
    // Both attempts ran in Redis: the first (reply lost) and the retry.
    assert_eq!(srv.command_count("evalsha"), 2, "{:?}", srv.commandstats());

    let mut conn = srv.conn();
    // One acquisition, one fence: the retry recognised its own token, and read back the
    // counter the first attempt created.
    let fence = fence_of(guard.fencing_token());
    assert_eq!(guard.fencing_token(), fence * FENCE_STEP, "{fence:#x}");
    let guard_token = guard.fencing_token();
    let counter = Counter::read(&mut conn, &KEYS.fence_bytes(name)).expect("counter");
    assert_eq!((counter.fence, counter.held), (fence, true));
    assert_eq!(
        client.stats().remote_acquisitions,
        before.remote_acquisitions + 1
    );
    // Exactly one lock key, with a live lease.
    assert_eq!(lock_keys(&srv), vec![KEYS.lock_bytes(name)]);
    assert!(pttl(&mut conn, KEYS.lock_bytes(name)) > 0);
    assert!(!guard.is_lost());

    assert_eq!(guard.unlock().unwrap(), Unlocked::Released);
    assert!(lock_keys(&srv).is_empty(), "lock key left after unlock");
    // And the next acquisition gets the next fence.
    let g = client.lock(name).expect("relock");
    assert!(g.fencing_token() > guard_token, "{:#x}", g.fencing_token());
    assert_eq!(g.fencing_token() % FENCE_STEP, 0);
    drop(g);
    assert!(lock_keys(&srv).is_empty());
}

// --- 6. unlock outcomes ------------------------------------------------------------

#[test]
fn unlock_after_the_lease_expired() {
    let srv = test_server();
    let lease = ms(150);
    let a = lock_client!(node(srv.url()), lease(lease), auto_renew(false));
    let g = a.lock("brief").expect("lock");
    assert!(g.valid_until() <= Instant::now() + lease);
    thread::sleep(lease * 2 + ms(50));
    assert!(g.is_lost());
    assert!(g.check().unwrap_err().is_lost());
    assert!(
        lock_keys(&srv).is_empty(),
        "Redis should have expired the key"
    );
    assert_eq!(g.unlock().expect("unlock"), Unlocked::Expired);
    assert!(lock_keys(&srv).is_empty());
}

#[test]
fn unlock_after_another_client_took_the_key() {
    let srv = test_server();
    let lease = ms(150);
    let a = lock_client!(node(srv.url()), lease(lease), auto_renew(false));
    let b = client(&srv.url());
    let name = b"contested";
    let mut conn = srv.conn();

    let mine = a.lock(name).expect("lock");
    let my_token = get(&mut conn, &KEYS.lock_bytes(name)).expect("my token");
    thread::sleep(lease * 2 + ms(50));
    let theirs = b
        .try_lock_for(name, Duration::from_secs(5))
        .expect("the other client takes the expired lock");
    let their_token = get(&mut conn, &KEYS.lock_bytes(name)).expect("their token");
    assert_ne!(my_token, their_token);
    assert!(theirs.fencing_token() > mine.fencing_token());

    assert_eq!(mine.unlock().expect("unlock"), Unlocked::HeldByOther);
    // Their lock is untouched.
    assert_eq!(get(&mut conn, &KEYS.lock_bytes(name)), Some(their_token));
    assert!(pttl(&mut conn, KEYS.lock_bytes(name)) > 1000);
    assert!(!theirs.is_lost());
    assert_eq!(theirs.unlock().expect("their unlock"), Unlocked::Released);
    assert!(lock_keys(&srv).is_empty());
}

// --- 7. bad input --------------------------------------------------------------------

#[test]
fn zero_lease_is_invalid_and_touches_nothing() {
    let srv = test_server();
    let err = lock_builder!(node(srv.url()), lease(Duration::ZERO))
        .build()
        .expect_err("zero lease");
    assert!(err.is_invalid_input(), "{err:?}");
    assert!(matches!(err, Error::InvalidConfig(_)), "{err:?}");
    assert!(srv.keys("*").is_empty());
    assert_eq!(
        srv.total_commands(),
        0,
        "validation must come before connecting"
    );
    assert!(srv.client_list().is_empty());
}

#[test]
fn unparsable_url_is_invalid() {
    init_log();
    for url in ["definitely not a url", "http://127.0.0.1:6379/", ""] {
        let err = lock_builder!(node(url))
            .build()
            .expect_err("bad url must not build");
        assert!(err.is_invalid_input(), "{url:?}: {err:?}");
        assert!(!err.is_connection(), "{url:?}: {err:?}");
    }
}

#[test]
fn unreachable_server_is_a_connection_error() {
    init_log();
    let connect_timeout = ms(500);
    let t0 = Instant::now();
    let err = LockClient::builder()
        .node(dead_url())
        .connect_timeout(connect_timeout)
        .build()
        .expect_err("nothing listens there");
    let took = t0.elapsed();
    eprintln!("refused connection reported in {took:?}: {err}");
    assert!(err.is_connection(), "{err:?}");
    assert!(!err.is_invalid_input());
    assert!(
        err.redis_error().is_some(),
        "the redis error is kept: {err:?}"
    );
    assert!(
        std::error::Error::source(&err).is_some(),
        "the redis error is the source"
    );
    assert!(took < connect_timeout + Duration::from_secs(2), "{took:?}");
}

#[test]
fn blackholed_server_is_a_connection_error() {
    let srv = test_server();
    let proxy = Proxy::start(srv.addr());
    proxy.blackhole(true);
    let (connect, read) = (ms(300), ms(300));
    let t0 = Instant::now();
    let err = lock_builder!(
        node(proxy.url()),
        connect_timeout(connect),
        read_timeout(read),
        write_timeout(read)
    )
    .build()
    .expect_err("nothing answers");
    let took = t0.elapsed();
    eprintln!("blackholed server reported in {took:?}: {err}");
    assert!(err.is_connection(), "{err:?}");
    assert!(
        took < connect + read + Duration::from_secs(2),
        "build took {took:?}"
    );
    assert!(srv.keys("*").is_empty());
    assert_eq!(srv.command_count("evalsha"), 0);
}

#[test]
fn bad_names_are_invalid_and_touch_nothing() {
    let (srv, client) = test_server_and(client);
    srv.reset_stats();
    let long = vec![b'n'; redbaton::MAX_NAME_LEN + 1];
    let checks: Vec<(&str, Result<(), Error>)> = vec![
        ("lock empty", client.lock("").map(drop)),
        ("try_lock empty", client.try_lock(b"").map(drop)),
        (
            "try_lock_for empty",
            client.try_lock_for(Vec::<u8>::new(), ms(100)).map(drop),
        ),
        (
            "try_lock_until empty",
            client
                .try_lock_until("", Instant::now() + ms(100))
                .map(drop),
        ),
        ("with_lock empty", client.with_lock("", || ())),
        ("lock too long", client.lock(&long).map(drop)),
    ];
    for (what, r) in checks {
        let err = r.expect_err(what);
        assert!(err.is_invalid_input(), "{what}: {err:?}");
        assert!(matches!(err, Error::InvalidName(_)), "{what}: {err:?}");
    }
    assert!(srv.keys("*").is_empty());
    assert_eq!(
        srv.command_count("evalsha"),
        0,
        "nothing sent for a bad name"
    );
    // The longest valid name works, and the client is still usable.
    let g = client
        .lock(&long[..redbaton::MAX_NAME_LEN])
        .expect("4096 bytes");
    assert_eq!(
        lock_keys(&srv),
        vec![KEYS.lock_bytes(&long[..redbaton::MAX_NAME_LEN])]
    );
    drop(g);
    assert!(lock_keys(&srv).is_empty());
}

// --- 9. the connection bound -------------------------------------------------------------

#[test]
fn connections_stay_within_the_pool_bound() {
    let srv = test_server();
    let pool = 4;
    let client = lock_builder!(node(srv.url()), pool_size(pool))
        // 64 threads share 4 connections on 2 busy cores: waiting for one is not a failure.
        .connect_timeout(Duration::from_secs(10))
        .build()
        .expect("build");
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let handles: Vec<_> = (0..64)
        .map(|i| {
            let (client, stop, done) = (client.clone(), stop.clone(), done.clone());
            thread::spawn(move || {
                let name = format!("own-{i}");
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) || n == 0 {
                    let g = client.lock(&name).expect("own key is never contended");
                    assert_eq!(g.unlock().expect("unlock"), Unlocked::Released);
                    n += 1;
                    done.fetch_add(1, Ordering::Relaxed);
                }
                n
            })
        })
        .collect();
    let (mut max_pool, mut max_sub) = (0, 0);
    for _ in 0..12 {
        thread::sleep(ms(80));
        let clients = srv.client_list();
        let named = |n: &str| clients.iter().filter(|c| c["name"] == n).count();
        let (p, s) = (named("redbaton"), named("redbaton:sub"));
        assert!(p <= pool, "{p} pool connections, bound {pool}");
        assert!(s <= 1, "{s} subscriber connections");
        max_pool = max_pool.max(p);
        max_sub = max_sub.max(s);
    }
    stop.store(true, Ordering::Relaxed);
    let per_thread = join_within(handles, Duration::from_secs(60), "workers");
    let clients = srv.client_list();
    let p = clients.iter().filter(|c| c["name"] == "redbaton").count();
    eprintln!(
        "64 threads, pool {pool}: {} sections; at most {max_pool} pool and {max_sub} subscriber connections seen; {p} after",
        done.load(Ordering::Relaxed)
    );
    assert!(p <= pool);
    assert!(max_pool >= 1, "no pool connection ever seen");
    assert!(per_thread.iter().all(|&n| n > 0));
    assert!(lock_keys(&srv).is_empty());
}

// --- more --------------------------------------------------------------------------

#[test]
fn same_thread_twice_would_deadlock() {
    let srv = test_server();
    for handoff in [true, false] {
        let client = lock_client!(node(srv.url()), local_handoff(handoff));
        let g = client.lock("mine").expect("lock");
        let t0 = Instant::now();
        let err = client
            .lock("mine")
            .expect_err("second lock by the same thread");
        assert!(matches!(err, Error::WouldDeadlock), "{err:?}");
        assert!(matches!(
            client.try_lock("mine").unwrap_err(),
            Error::WouldDeadlock
        ));
        assert!(matches!(
            client
                .try_lock_for("mine", Duration::from_secs(5))
                .unwrap_err(),
            Error::WouldDeadlock
        ));
        let took = t0.elapsed();
        assert!(
            took < Duration::from_secs(2),
            "handoff={handoff}: took {took:?}"
        );
        // The first guard is unaffected.
        assert!(!g.is_lost());
        assert_eq!(g.unlock().unwrap(), Unlocked::Released);
        // And the thread can take it again afterwards.
        drop(client.lock("mine").expect("relock"));
        assert!(lock_keys(&srv).is_empty());
    }
}

#[test]
fn with_lock_returns_the_closures_value() {
    let (srv, client) = test_server_and(client);
    let seen = client
        .with_lock("value", || {
            assert_eq!(lock_keys(&srv), vec![KEYS.lock_bytes(b"value")]);
            String::from("forty-two")
        })
        .expect("with_lock");
    assert_eq!(seen, "forty-two");
    assert_eq!(client.with_lock("value", || 40 + 2).unwrap(), 42);
    assert!(lock_keys(&srv).is_empty());
}

#[test]
fn try_lock_until_a_past_deadline_makes_one_attempt() {
    let (srv, a) = test_server_and(client);
    let b = client(&srv.url());
    // Free: one attempt is enough.
    let past = Instant::now();
    thread::sleep(ms(5));
    let g = a.try_lock_until("deadline", past).expect("free key");
    assert_eq!(g.unlock().unwrap(), Unlocked::Released);

    // Held: exactly one attempt, then Timeout.
    let held = b.lock("deadline").expect("other owner");
    srv.reset_stats();
    let before = a.stats();
    let t0 = Instant::now();
    let err = a
        .try_lock_until("deadline", Instant::now() - ms(1))
        .expect_err("held elsewhere");
    let took = t0.elapsed();
    assert!(err.is_timeout(), "{err:?}");
    assert!(took < Duration::from_secs(10), "{took:?}");
    let after = a.stats();
    assert_eq!(after.failed_attempts, before.failed_attempts + 1);
    assert_eq!(srv.command_count("evalsha"), 1, "{:?}", srv.commandstats());
    assert_eq!(held.unlock().unwrap(), Unlocked::Released);
}

#[test]
fn stats_count_a_remote_acquisition() {
    let (_srv, client) = test_server_and(client);
    let before = client.stats();
    let g = client.lock("counted").expect("lock");
    let mid = client.stats();
    assert_eq!(mid.remote_acquisitions, before.remote_acquisitions + 1);
    assert!(mid.commands > before.commands);
    assert_eq!(mid.local_handoffs, before.local_handoffs);
    assert_eq!(mid.failed_attempts, before.failed_attempts);
    g.unlock().unwrap();
    let after = client.stats();
    assert!(after.commands > mid.commands, "release is a command");
    assert_eq!(after.remote_acquisitions, mid.remote_acquisitions);
}

#[test]
fn dropping_the_guard_releases() {
    let (srv, a) = test_server_and(client);
    let b = client(&srv.url());
    {
        let _g = a.lock("dropped").expect("lock");
        assert_eq!(lock_keys(&srv), vec![KEYS.lock_bytes(b"dropped")]);
        assert!(b.try_lock("dropped").unwrap_err().is_would_block());
    }
    assert!(lock_keys(&srv).is_empty(), "drop did not release");
    let g = b.try_lock("dropped").expect("free after drop");
    assert_eq!(g.unlock().unwrap(), Unlocked::Released);
}

#[test]
fn binary_names_map_to_exact_keys() {
    let (srv, client) = test_server_and(client);
    let mut conn = srv.conn();
    let names: [&[u8]; 4] = [
        &[0xff, 0x00, b'}', 0x80, b'{'],
        b"with space",
        "caf\u{e9} \u{1f512}".as_bytes(),
        b"*?[glob]",
    ];
    for name in names {
        let g = client.lock(name).expect("binary name");
        assert_eq!(g.name(), name);
        let key = KEYS.lock_bytes(name);
        assert_eq!(lock_keys(&srv), vec![key.clone()], "key for {name:?}");
        assert!(get(&mut conn, &key).is_some());
        let counter = Counter::read(&mut conn, &KEYS.fence_bytes(name)).expect("counter");
        assert_eq!(counter.fence, fence_of(g.fencing_token()), "{name:?}");
        // Another client sees the same key.
        let other = self::client(&srv.url());
        assert!(other.try_lock(name).unwrap_err().is_would_block());
        assert_eq!(g.unlock().unwrap(), Unlocked::Released);
        assert!(lock_keys(&srv).is_empty());
    }
}

/// A lost reply to the release: the retry finds the key gone (our first attempt deleted
/// it) while the lease was still valid, so the lock was ours until this call.
#[test]
fn lost_release_reply_still_reports_released() {
    let srv = test_server();
    let proxy = Proxy::start(srv.addr());
    let client = lock_client!(node(proxy.url()));
    let g = client.lock("warm-up").expect("warm-up lock");
    assert_eq!(g.unlock().unwrap(), Unlocked::Released);

    let g = client.lock("fragile-release").expect("lock");
    proxy.drop_next_reply_matching(b"EVALSHA");
    let outcome = g.unlock();
    assert_eq!(proxy.replies_dropped(), 1, "the fault never fired");
    assert!(lock_keys(&srv).is_empty(), "lock key left after unlock");
    assert_eq!(outcome.expect("unlock"), Unlocked::Released);
}
