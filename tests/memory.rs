//! Redis memory per name, against a real redis-server: what a name leaves behind once
//! nobody locks it (its fencing counter expires after `fence_ttl`, a crashed waiter's mark
//! is dropped), tokens that still increase across a counter's expiry or eviction, and the
//! warning `build()` gives for an eviction policy that can remove lock keys.
//!
//! Run it alone with `cargo test --test memory`.

use std::sync::Arc;
use std::thread;
use std::time::Duration;

use redbaton::{Builder, Error, LockClient};
use redbaton_testkit::child;
use redbaton_testkit::child_only;
use redbaton_testkit::keys::{FENCE_STEP, FenceCount, Keys};
use redbaton_testkit::logs;
use redbaton_testkit::server::RedisServer;
use redbaton_testkit::test_server;
use redbaton_testkit::wait::{join_within, wait_for};
use redbaton_testkit::{init_log, ms, secs};
use redbaton_testkit::{lock_builder, lock_client};

const PREFIX: &str = "mem:";
const KEYS: Keys = Keys::new(PREFIX);
/// Short, so that the tests can wait it out; the lease and read timeout are short enough
/// for the builder to accept it.
const FENCE_TTL: Duration = Duration::from_millis(1500);

/// A client of `url` whose idle counters expire after [`FENCE_TTL`].
fn short_fence(url: &str) -> Builder {
    with_short_fence(lock_builder!(node(url)))
}

/// `b`, with idle counters expiring after [`FENCE_TTL`].
/// For the fair queue's script and the plain one: whether it is the fair one, a client
/// with short-lived counters that uses it, and a name of its own made from `prefix`.
fn both_scripts(srv: &RedisServer, prefix: &str) -> [(bool, LockClient, String); 2] {
    [true, false].map(|fair| {
        let c = short_fence(&srv.url()).fair(fair).build().expect("client");
        (fair, c, format!("{prefix}-{fair}"))
    })
}

fn with_short_fence(b: Builder) -> Builder {
    b.key_prefix(PREFIX)
        .lease(ms(600))
        .read_timeout(ms(375))
        .fence_ttl(FENCE_TTL)
}

fn dbsize(conn: &mut redis::Connection) -> u64 {
    redis::cmd("DBSIZE").query(conn).expect("DBSIZE")
}

fn exists(conn: &mut redis::Connection, key: &str) -> bool {
    redis::cmd("EXISTS")
        .arg(key)
        .query::<i64>(conn)
        .expect("EXISTS")
        == 1
}

fn pttl(conn: &mut redis::Connection, key: &str) -> i64 {
    redis::cmd("PTTL").arg(key).query(conn).expect("PTTL")
}

/// 10,000 names locked once and released: once `fence_ttl` has passed, Redis holds O(1)
/// keys, not one counter per name ever locked.
#[test]
fn ten_thousand_names_leave_o1_keys() {
    init_log();
    const NAMES: usize = 10_000;
    const THREADS: usize = 8;
    let srv = RedisServer::start();
    let c = Arc::new(short_fence(&srv.url()).build().expect("client"));
    let workers = (0..THREADS)
        .map(|t| {
            let c = c.clone();
            thread::spawn(move || {
                for i in (t..NAMES).step_by(THREADS) {
                    let g = c.try_lock(format!("n{i}")).expect("a free name");
                    g.unlock().expect("unlock");
                }
            })
        })
        .collect();
    join_within(workers, secs(120), "locking 10,000 names");
    let mut conn = srv.conn();
    // Each counter was refreshed by its acquisition and expires on its own.
    let ttl = pttl(&mut conn, &KEYS.fence(&format!("n{}", NAMES - 1)));
    assert!(
        ttl > 0 && ttl <= FENCE_TTL.as_millis() as i64,
        "the last name's counter has PTTL {ttl}"
    );
    // Expired keys go with the server's active expiry cycle: a generous bound.
    wait_for(secs(30), "at most 100 keys left", || {
        dbsize(&mut conn) <= 100
    });
    eprintln!("keys left: {}", dbsize(&mut conn));
}

/// Lock, release, and lock again after the name's counter is gone: by expiry (idle for
/// `fence_ttl`) or by eviction (deleted while the server ran). The new token is higher,
/// for the fair queue's script and the plain one.
#[test]
fn tokens_increase_across_counter_expiry_and_eviction() {
    let srv = test_server();
    let mut conn = srv.conn();
    for (fair, c, name) in both_scripts(&srv, "t") {
        let fence = KEYS.fence(&name);
        let first = c.try_lock(&name).expect("free").fencing_token();
        wait_for(secs(30), "the idle counter expired", || {
            !exists(&mut conn, &fence)
        });
        let second = c.try_lock(&name).expect("free").fencing_token();
        assert!(second > first, "fair {fair}: {second} after {first}");
        let () = redis::cmd("DEL").arg(&fence).query(&mut conn).unwrap();
        let third = c.try_lock(&name).expect("free").fencing_token();
        assert!(
            third > second,
            "fair {fair}: {third} after eviction, {second} before"
        );
    }
}

/// A counter that comes back stale (a failover to a replica that missed the last
/// increments, a restart from an old snapshot): the next fence is still above every earlier
/// one, since a fence is never below the server's clock.
#[test]
fn tokens_increase_when_the_counter_comes_back_stale() {
    let srv = test_server();
    let mut conn = srv.conn();
    for (fair, c, name) in both_scripts(&srv, "stale") {
        let first = c.try_lock(&name).expect("free").fencing_token();
        let () = redis::cmd("SET")
            .arg(KEYS.fence(&name))
            .arg(5)
            .query(&mut conn)
            .unwrap();
        let second = c.try_lock(&name).expect("free").fencing_token();
        assert!(second > first, "fair {fair}: {second:#x} after {first:#x}");
    }
}

/// The read-write lock: a read hold's token (the counter as it is) stays above the last
/// write's when the counter is gone, and the next write's is above it.
#[test]
fn rwlock_tokens_increase_across_counter_eviction() {
    let srv = test_server();
    let mut conn = srv.conn();
    let c = short_fence(&srv.url()).build().expect("client");
    let rw = c.rwlock("rw");
    let w1 = rw.try_write().expect("free").fencing_token();
    let () = redis::cmd("DEL")
        .arg(KEYS.fence("rw"))
        .query(&mut conn)
        .unwrap();
    let r = rw.try_read().expect("free").fencing_token();
    assert!(r > w1, "read {r} after write {w1}");
    let w2 = rw.try_write().expect("free").fencing_token();
    assert!(w2 > r, "write {w2} after read {r}");
}

/// A settings check: `fence_ttl` must outlive a retry that reads the counter back.
#[test]
fn fence_ttl_too_short_is_invalid() {
    init_log();
    for (what, b) in [
        (
            "under 1 s",
            lock_builder!(lease(ms(100)), fence_ttl(ms(999))),
        ),
        ("under twice the lease", lock_builder!(fence_ttl(secs(59)))),
        (
            "under four read timeouts",
            lock_builder!(lease(ms(100)), fence_ttl(secs(7))),
        ),
        ("zero", lock_builder!(fence_ttl(Duration::ZERO))),
    ] {
        let e = b.build().expect_err(what);
        assert!(matches!(e, Error::InvalidConfig(_)), "{what}: {e:?}");
        assert!(e.to_string().contains("fence ttl"), "{what}: {e}");
    }
}

/// Child of the tests of crashed writers: waits to write `NAME` until killed, re-marking
/// every `RECHECK_MS`.
#[test]
fn child_waiting_writer() {
    child_only!();
    let recheck = ms(child::env("RECHECK_MS").parse().expect("RECHECK_MS"));
    let c = lock_client!(
        node(child::env("REDIS_URL")),
        key_prefix(PREFIX),
        recheck_interval(recheck)
    );
    child::print_result(&[("waiting", "1".to_owned())]);
    let _ = c.rwlock(child::env("NAME")).try_write_for(secs(60));
}

/// A writer of another process waiting for `name`, re-marking every `recheck_ms`.
fn crashing_writer(srv: &RedisServer, name: &str, recheck_ms: u64) -> std::process::Child {
    let env = [
        ("REDIS_URL", srv.url()),
        ("NAME", name.to_owned()),
        ("RECHECK_MS", recheck_ms.to_string()),
    ];
    let mut child = child::spawn_self("child_waiting_writer", &env);
    child::wait_for_line(&mut child, "waiting=1", secs(30));
    child
}

/// Waiting writers re-mark at least every 200 ms; a mark lives 400 ms.
fn marking_client(url: &str) -> LockClient {
    lock_client!(node(url), key_prefix(PREFIX), recheck_interval(ms(200)))
}

fn writers(conn: &mut redis::Connection) -> Vec<String> {
    redis::cmd("ZRANGE")
        .arg(format!("{}:ww", KEYS.lock("crash")))
        .arg(0)
        .arg(-1)
        .query(conn)
        .expect("ZRANGE")
}

/// A writer's process is killed while it waits: its mark in `:ww` is dropped although the
/// set lives on, refreshed by another writer that keeps waiting.
#[test]
fn crashed_waiting_writer_mark_is_dropped() {
    let srv = test_server();
    let mut conn = srv.conn();
    let holder = marking_client(&srv.url());
    let held = holder.rwlock("crash").try_write().expect("free");
    let mut crashed = crashing_writer(&srv, "crash", 200);
    wait_for(secs(30), "the child's mark", || {
        writers(&mut conn).len() == 1
    });
    let dead = writers(&mut conn).remove(0);
    child::kill_child(&mut crashed, libc::SIGKILL);
    child::wait_output(crashed, secs(30));

    let waiter = Arc::new(marking_client(&srv.url()));
    let live = {
        let waiter = waiter.clone();
        thread::spawn(move || waiter.rwlock("crash").try_write_for(secs(60)).map(drop))
    };
    wait_for(secs(30), "the live writer's mark", || {
        writers(&mut conn).len() == 2
    });
    wait_for(secs(30), "the dead writer's mark dropped", || {
        let left = writers(&mut conn);
        !left.contains(&dead) && !left.is_empty()
    });
    let set = format!("{}:ww", KEYS.lock("crash"));
    assert!(pttl(&mut conn, &set) > 0, "the marks expire with their set");
    held.unlock().expect("unlock");
    join_within(vec![live], secs(30), "the live writer")
        .remove(0)
        .expect("the live writer gets the lock");
}

/// The waiting writers' and readers' nonces (`:qn`) live as long as their marks, and never
/// without a TTL: a writer that re-marks every 2 s (its nonce kept 8 s) waits; a reader
/// that re-marks every 100 ms marks and gives up (a mark of a shorter TTL must not cut the
/// key's), the key outlives it while the writer waits, and once the writer's process is
/// killed everything of the name but its counter expires.
#[test]
fn the_waiters_nonces_expire_with_their_marks() {
    let srv = test_server();
    let mut conn = srv.conn();
    let nonces = format!("{}:qn", KEYS.lock("nonce"));
    let holder = lock_client!(node(srv.url()), key_prefix(PREFIX));
    let read = holder.rwlock("nonce").read().expect("read hold");
    let mut writer = crashing_writer(&srv, "nonce", 2000);
    wait_for(secs(30), "the writer's nonce", || {
        exists(&mut conn, &nonces)
    });
    let reader = lock_client!(
        node(srv.url()),
        key_prefix(PREFIX),
        recheck_interval(ms(100))
    );
    let e = reader.rwlock("nonce").try_read_for(ms(50)).unwrap_err();
    assert!(
        e.is_timeout(),
        "the writer's mark holds the reader back: {e:?}"
    );
    // Past the reader's mark and a re-mark of the writer's.
    for _ in 0..40 {
        let ttl = pttl(&mut conn, &nonces);
        assert!(
            ttl > 0,
            "the nonces gone or without a TTL ({ttl}) while the writer waits"
        );
        thread::sleep(ms(100));
    }
    child::kill_child(&mut writer, libc::SIGKILL);
    child::wait_output(writer, secs(30));
    read.unlock().expect("unlock");
    wait_for(
        secs(30),
        "every key of the name but its counter gone",
        || srv.keys_but_fences(&format!("{PREFIX}*")).is_empty(),
    );
}

/// `build()` warns once, naming the node, when the server may evict lock keys:
/// `maxmemory` set and a policy other than `noeviction`.
#[test]
fn eviction_policy_that_can_evict_lock_keys_warns_at_build() {
    init_log();
    logs::capture();
    for (policy, maxmemory, warns) in [
        ("volatile-lru", "100mb", true),
        ("allkeys-lfu", "100mb", true),
        ("noeviction", "100mb", false),
        ("volatile-lru", "0", false),
    ] {
        let srv = RedisServer::builder()
            .config("maxmemory", maxmemory)
            .config("maxmemory-policy", policy)
            .start();
        let c = lock_client!(node(srv.url()));
        let node = format!(":{}/", srv.port());
        let warned: Vec<String> = logs::lines(log::Level::Warn, &node)
            .into_iter()
            .filter(|l| l.contains("maxmemory-policy"))
            .collect();
        assert_eq!(
            warned.len(),
            usize::from(warns),
            "{policy}, maxmemory {maxmemory}: {warned:?}"
        );
        if warns {
            assert!(warned[0].contains(policy), "{warned:?}");
        }
        drop(c);
    }
}

/// The fair queue's grant message carries the whole fence (16 digits since counters start
/// at the server's clock in µs): the queued waiter of another client takes the lock from
/// the message, the fence right after the holder's, without waiting for a re-check.
#[test]
fn a_grant_carries_the_whole_fence() {
    let srv = test_server();
    let fences = FenceCount::start(&srv);
    let holder = short_fence(&srv.url()).build().expect("client");
    let waiter = Arc::new(
        short_fence(&srv.url())
            .recheck_interval(secs(30))
            .build()
            .expect("client"),
    );
    let held = holder.try_lock("grant").expect("free");
    let queued = {
        let waiter = waiter.clone();
        thread::spawn(move || {
            let g = waiter.try_lock_for("grant", secs(20)).expect("granted");
            (std::time::Instant::now(), g.fencing_token())
        })
    };
    let mut conn = srv.conn();
    let queue = format!("{}:q", KEYS.lock("grant"));
    wait_for(secs(30), "the waiter queued", || {
        redis::cmd("ZCARD")
            .arg(&queue)
            .query::<u64>(&mut conn)
            .unwrap()
            == 1
    });
    let held_token = held.fencing_token();
    let released = std::time::Instant::now();
    held.unlock().expect("unlock");
    let (got_at, token) = join_within(vec![queued], secs(30), "the waiter").remove(0);
    // The grant's fence, confirmed by the waiter's attempt: above the holder's, and the
    // last the counter issued (one fence each; the waiter took no second one after the
    // grant's lease ran out).
    assert!(token > held_token, "{token:#x} after {held_token:#x}");
    assert_eq!(token & (FENCE_STEP - 1), 0);
    assert_eq!(fences.issued(), 2, "the grant's fence");
    // Liveness, generous: a waiter that missed the message would wait for its re-check
    // (30 s) or the grant's lease.
    let waited = got_at.duration_since(released);
    assert!(waited < secs(10), "granted after {waited:?}");
}

/// Redlock: the counters a round raises to the majority's highest keep a TTL too, so a
/// name leaves nothing on any node once `fence_ttl` has passed.
#[test]
fn redlock_raised_counters_expire() {
    init_log();
    let servers = redbaton_testkit::server::start_many(3);
    let urls: Vec<String> = servers.iter().map(RedisServer::url).collect();
    let c = with_short_fence(lock_builder!(nodes(urls)))
        .build()
        .expect("redlock client");
    // The first round creates the nodes' counters at their clocks, some µs apart, and
    // raises the lagging ones to the highest (later rounds find them equal).
    c.try_lock("r").expect("free").unlock().expect("unlock");
    for s in &servers {
        let ttl = pttl(&mut s.conn(), &KEYS.fence("r"));
        assert!(
            ttl > 0 && ttl <= FENCE_TTL.as_millis() as i64,
            "node {}: counter PTTL {ttl}",
            s.port()
        );
    }
    for s in &servers {
        let mut conn = s.conn();
        wait_for(secs(30), "the node's keys expired", || {
            dbsize(&mut conn) == 0
        });
    }
}
