//! Countdown latches against real `redis-server`s: four child processes count a latch
//! down while eight waiters in two other child processes wait for it, none returning
//! before the last count down; bad input (a zero or too large count, another count, a
//! foreign key, Redlock) refused with typed errors and nothing written; expiry (a waiter
//! of an expired latch told so, an open latch staying open until its TTL, every count
//! down keeping it); a lost message caught by the re-check; timeouts (counted in
//! `Stats::timeouts`); cancelled waits (a latch a wait made stays); polling; names with
//! odd bytes and prefixes; far deadlines; the lock's minimal ACL; Sentinel and Cluster (a
//! waiter following a moved slot).
//! Latencies are printed, not asserted.

use std::collections::HashMap;
use std::thread;
use std::time::{Duration, Instant};

use redbaton::{Cancel, Error, Latch, LockClient, MAX_LATCH_COUNT, Wakeup};
use redbaton_testkit::clock::mono_ns;
use redbaton_testkit::cluster::Cluster;
use redbaton_testkit::sentinel::SentinelGroup;
use redbaton_testkit::server::RedisServer;
use redbaton_testkit::wait::{join_within, wait_for};
use redbaton_testkit::{child, child_only, init_log, lock_builder, lock_client, ms, secs};
use redbaton_testkit::{test_server, test_server_and, wait::wait_until};

/// Generous bound for a call that should return: liveness, not a latency assertion.
const LIVENESS: Duration = Duration::from_secs(30);

fn client(url: &str) -> LockClient {
    lock_client!(node(url))
}

/// The key of the latch `name` under the default prefix.
fn latch_key(name: &str) -> Vec<u8> {
    format!("redbaton:{{{name}}}:latch").into_bytes()
}

fn pttl(srv: &RedisServer, key: &[u8]) -> i64 {
    redis::cmd("PTTL")
        .arg(key)
        .query(&mut srv.conn())
        .expect("PTTL")
}

/// How many subscriber connections of `srv` listen on the latch `name`'s channel as a
/// `kind` channel (`SHARDNUMSUB` or `NUMSUB`).
fn subscribed(srv: &RedisServer, name: &str, kind: &str) -> u64 {
    redis::cmd("PUBSUB")
        .arg(kind)
        .arg(format!("redbaton:{{{name}}}:ev"))
        .query::<(String, u64)>(&mut srv.conn())
        .map_or(0, |(_, n)| n)
}

/// How many subscriber connections of `srv` listen on the latch `name`'s channel, sharded
/// or classic.
fn listeners(srv: &RedisServer, name: &str) -> u64 {
    subscribed(srv, name, "SHARDNUMSUB") + subscribed(srv, name, "NUMSUB")
}

#[test]
fn smoke() {
    let (srv, c) = test_server_and(client);
    let latch = c.latch("smoke", 2);
    assert_eq!(latch.count().expect("count"), 2);
    assert!(latch.wait_for(ms(10)).unwrap_err().is_timeout());
    assert_eq!(latch.count_down().expect("down"), 1);
    assert_eq!(latch.count_down().expect("down"), 0);
    assert_eq!(latch.count_down().expect("at zero"), 0, "stays 0");
    latch.wait().expect("open");
    // A late waiter, of another client, returns at once.
    client(&srv.url())
        .latch("smoke", 2)
        .wait_for(ms(0))
        .expect("open for a late waiter");
    assert!(format!("{latch:?}").contains("smoke"));
    fn shareable<T: Clone + Send + Sync + std::fmt::Debug>() {}
    shareable::<Latch>();
}

/// Child: `THREADS` threads wait for the latch `NAME` of `COUNT`; each says when it
/// returned and the count it read then. Then the client's counters.
#[test]
fn child_latch_waiter() {
    child_only!();
    let c = client(&child::env("REDIS_URL"));
    let (name, count) = (child::env("NAME"), child::env("COUNT").parse().unwrap());
    let threads: usize = child::env("THREADS").parse().unwrap();
    let handles: Vec<_> = (0..threads)
        .map(|_| {
            let latch = c.latch(&name, count);
            thread::spawn(move || {
                latch.wait().expect("wait");
                let returned_ns = mono_ns();
                (returned_ns, latch.count().expect("count"))
            })
        })
        .collect();
    for (returned_ns, left) in join_within(handles, LIVENESS * 2, "waiters") {
        child::print_result(&[
            ("returned_ns", returned_ns.to_string()),
            ("left", left.to_string()),
        ]);
    }
    child::print_counters(&c.stats(), &[("stats", "1".to_owned())]);
}

/// Child: counts the latch `NAME` of `COUNT` down once, after a short random pause, and
/// says when the call began and ended and the count it left.
#[test]
fn child_latch_counter() {
    child_only!();
    let c = client(&child::env("REDIS_URL"));
    let latch = c.latch(child::env("NAME"), child::env("COUNT").parse().unwrap());
    thread::sleep(ms(rand::random_range(0..=50)));
    let before_ns = mono_ns();
    let left = latch.count_down().expect("count down");
    let after_ns = mono_ns();
    child::print_result(&[
        ("left", left.to_string()),
        ("before_ns", before_ns.to_string()),
        ("after_ns", after_ns.to_string()),
    ]);
}

fn field(r: &HashMap<String, String>, k: &str) -> u64 {
    r[k].parse().unwrap_or_else(|_| panic!("{k} in {r:?}"))
}

/// Four child processes count the latch down; eight waiters (four threads in each of two
/// other child processes) all return, none before the last count down began, and each
/// reads 0 after.
#[test]
fn four_processes_count_down_and_eight_waiters_wake() {
    let srv = test_server();
    let (name, count) = ("gate", 4u64);
    let envs = |threads: usize| {
        vec![
            ("REDIS_URL", srv.url()),
            ("NAME", name.to_owned()),
            ("COUNT", count.to_string()),
            ("THREADS", threads.to_string()),
        ]
    };
    let waiters = child::spawn_many(2, "child_latch_waiter", &envs(4));
    // Both waiting processes listen on the latch's channel before anyone counts down.
    wait_for(LIVENESS, "both waiting processes subscribed", || {
        listeners(&srv, name) >= 2
    });
    thread::sleep(ms(100)); // their threads' reads are under way (not needed for the checks)
    assert_eq!(client(&srv.url()).latch(name, count).count().unwrap(), 4);
    let counters = child::spawn_many(4, "child_latch_counter", &envs(1));
    let downs: Vec<_> = child::wait_all_ok(counters, LIVENESS)
        .iter()
        .flat_map(|out| child::parse_results(out))
        .collect();
    let mut lefts: Vec<u64> = downs.iter().map(|r| field(r, "left")).collect();
    lefts.sort_unstable();
    assert_eq!(lefts, [0, 1, 2, 3], "each count down counted once");
    let last = downs.iter().find(|r| field(r, "left") == 0).unwrap();
    let (last_before, last_after) = (field(last, "before_ns"), field(last, "after_ns"));

    let outs = child::wait_all_ok(waiters, LIVENESS * 3);
    let mut latencies = Vec::new();
    let mut event_wakeups = 0;
    for out in &outs {
        for r in child::parse_results(out) {
            if r.contains_key("stats") {
                event_wakeups += field(&r, "wakeups_event");
                continue;
            }
            let returned = field(&r, "returned_ns");
            assert!(
                returned >= last_before,
                "a waiter returned before the last count down began"
            );
            assert_eq!(field(&r, "left"), 0);
            latencies.push(returned as i64 - last_after as i64);
        }
    }
    assert_eq!(latencies.len(), 8, "eight waiters returned");
    assert!(
        event_wakeups >= 1,
        "no waiter was woken by the latch's message"
    );
    latencies.sort_unstable();
    eprintln!(
        "last count_down's return to the waiters' return: min {} us, median {} us, max {} us; {event_wakeups} event wake-ups",
        latencies[0] / 1000,
        latencies[4] / 1000,
        latencies[7] / 1000
    );
}

/// Bad counts and names are refused before anything is sent; another count, a foreign
/// key and a Redlock client are typed errors that change nothing.
#[test]
fn bad_input_is_refused_and_writes_nothing() {
    let (srv, c) = test_server_and(client);
    let cancel = Cancel::new();
    for count in [0, MAX_LATCH_COUNT + 1, u64::MAX] {
        let latch = c.latch("bad", count);
        let errors = [
            latch.count_down().map(drop),
            latch.count().map(drop),
            latch.wait(),
            latch.wait_for(ms(10)),
            latch.wait_until(Instant::now()),
            latch.wait_cancellable(&cancel),
        ];
        for e in errors {
            let e = e.unwrap_err();
            assert!(matches!(e, Error::InvalidArgument(_)), "{count}: {e:?}");
            assert!(e.is_invalid_input());
        }
    }
    assert!(matches!(
        c.latch("", 1).count_down(),
        Err(Error::InvalidName(_))
    ));
    assert!(srv.keys("*").is_empty(), "{:?}", srv.keys("*"));
    // The largest count is accepted.
    assert_eq!(
        c.latch("big", MAX_LATCH_COUNT).count_down().unwrap(),
        MAX_LATCH_COUNT - 1
    );

    // Another count: refused, and the latch is left as it was.
    assert_eq!(c.latch("m", 3).count_down().unwrap(), 2);
    let other = client(&srv.url()).latch("m", 4);
    for e in [
        other.count_down().map(drop),
        other.count().map(drop),
        other.wait(),
        other.wait_for(ms(10)),
    ] {
        match e.unwrap_err() {
            Error::CountMismatch { stored, asked } => assert_eq!((stored, asked), (3, 4)),
            e => panic!("expected CountMismatch, got {e:?}"),
        }
    }
    assert!(other.count().unwrap_err().is_count_mismatch());
    assert_eq!(c.latch("m", 3).count().unwrap(), 2);

    // A key of the latch's name that this library did not write.
    let mut admin = srv.conn();
    redis::cmd("SET")
        .arg(latch_key("junk"))
        .arg("not a latch")
        .query::<()>(&mut admin)
        .unwrap();
    redis::cmd("HSET")
        .arg(latch_key("hash"))
        .arg("a")
        .arg("b")
        .query::<()>(&mut admin)
        .unwrap();
    for name in ["junk", "hash"] {
        let e = c.latch(name, 1).count_down().unwrap_err();
        assert!(e.is_wrong_kind(), "{name}: {e:?}");
    }

    // Redlock: no single node decides.
    let nodes = [test_server(), test_server(), test_server()];
    let redlock = lock_client!(nodes(nodes.iter().map(RedisServer::url)));
    let latch = redlock.latch("r", 1);
    for e in [
        latch.count_down().map(drop),
        latch.count().map(drop),
        latch.wait(),
    ] {
        assert!(e.unwrap_err().is_unsupported());
    }
    for n in &nodes {
        assert!(n.keys("*").is_empty(), "{:?}", n.keys("*"));
    }

    // The TTL setting is checked when the client is built.
    for ttl in [Duration::ZERO, ms(999), secs(366 * 24 * 3600)] {
        let e = lock_builder!(node(srv.url()), latch_ttl(ttl))
            .build()
            .unwrap_err();
        assert!(e.is_invalid_input(), "{ttl:?}: {e}");
    }
}

/// A waiter whose latch expires before it opens is told so; an open latch stays open
/// until its TTL, and the name then makes a new latch; every count down keeps the latch.
#[test]
fn expiry() {
    let srv = test_server();
    let c = lock_client!(node(srv.url()), latch_ttl(secs(1)));

    // Nobody counts it down: the waiter wakes when the key would expire.
    let latch = c.latch("abandoned", 2);
    assert_eq!(latch.count_down().unwrap(), 1);
    let started = Instant::now();
    let e = latch.wait().unwrap_err();
    assert!(e.is_latch_expired(), "{e:?}");
    eprintln!(
        "waiter of an abandoned latch (TTL 1 s) told after {:?}",
        started.elapsed()
    );
    assert!(srv.keys("*latch").is_empty());

    // Open: stays open (count 0) until its TTL, then the name is a new latch.
    let three = lock_client!(node(srv.url()), latch_ttl(secs(3)));
    let open = three.latch("open", 1);
    assert_eq!(open.count_down().unwrap(), 0);
    open.wait_for(ms(0)).expect("open");
    let ttl = pttl(&srv, &latch_key("open"));
    assert!(ttl != -1 && ttl <= 3000, "{ttl}");
    wait_for(LIVENESS, "the open latch expires", || {
        srv.keys("*open*").is_empty()
    });
    assert_eq!(open.count().unwrap(), 1, "a new latch of the name");

    // Every count down that lowers the count keeps the latch another TTL; reads do not.
    let long = lock_client!(node(srv.url()), latch_ttl(secs(600)));
    let kept = long.latch("kept", 3);
    kept.count().unwrap();
    let key = latch_key("kept");
    let shorten = || {
        redis::cmd("PEXPIRE")
            .arg(&key)
            .arg(300_000)
            .query::<()>(&mut srv.conn())
            .unwrap()
    };
    shorten();
    kept.count().unwrap();
    assert!(pttl(&srv, &key) <= 300_000, "a read keeps the TTL");
    kept.count_down().unwrap();
    assert!(pttl(&srv, &key) > 300_000, "a count down sets it again");
    shorten();
    assert_eq!(kept.count_down().unwrap(), 1);
    assert!(pttl(&srv, &key) > 300_000);

    // Deleted (or expired) and made again by someone else under a waiter: the waiter does
    // not wait on the new latch.
    let quick = lock_client!(node(srv.url()), recheck_interval(ms(200)));
    let waited = quick.latch("again", 2);
    waited.count().unwrap();
    thread::scope(|s| {
        let w = s.spawn(|| waited.wait());
        wait_for(LIVENESS, "the waiter listens", || {
            listeners(&srv, "again") >= 1
        });
        redis::cmd("DEL")
            .arg(latch_key("again"))
            .query::<()>(&mut srv.conn())
            .unwrap();
        assert_eq!(
            client(&srv.url()).latch("again", 2).count_down().unwrap(),
            1
        );
        wait_for(LIVENESS, "the waiter returns", || w.is_finished());
        let e = w.join().unwrap().unwrap_err();
        assert!(e.is_latch_expired(), "{e:?}");
    });
}

/// The message that the latch opened is lost (the count is set to 0 behind the library's
/// back): the waiter reads it at its next re-check.
#[test]
fn a_lost_message_costs_a_recheck() {
    let srv = test_server();
    let c = lock_client!(node(srv.url()), recheck_interval(ms(200)));
    let latch = c.latch("lost", 2);
    latch.count().unwrap();
    thread::scope(|s| {
        let w = s.spawn(|| latch.wait());
        // Each read of the latch runs one `PTTL`: ours, the waiter's first, and its read
        // once subscribed, which found the latch closed. It sleeps now.
        wait_for(LIVENESS, "the waiter read twice", || {
            srv.command_count("pttl") >= 3
        });
        let key = latch_key("lost");
        let mut admin = srv.conn();
        let value: String = redis::cmd("GET").arg(&key).query(&mut admin).unwrap();
        let (left, rest) = value.split_once(':').unwrap();
        assert_eq!(left, "2");
        redis::cmd("SET")
            .arg(&key)
            .arg(format!("0:{rest}"))
            .arg("KEEPTTL")
            .query::<()>(&mut admin)
            .unwrap();
        wait_for(LIVENESS, "the waiter returns", || w.is_finished());
        w.join().unwrap().expect("open");
    });
    assert!(c.stats().wakeups_recheck >= 1);
}

/// Deadlines: a closed latch is a timeout, at once for a zero timeout or a past deadline.
#[test]
fn timeouts() {
    let (_srv, c) = test_server_and(client);
    let latch = c.latch("t", 1);
    assert!(latch.wait_for(Duration::ZERO).unwrap_err().is_timeout());
    assert!(
        latch
            .wait_until(Instant::now() - ms(1))
            .unwrap_err()
            .is_timeout()
    );
    let started = Instant::now();
    assert!(latch.wait_for(ms(200)).unwrap_err().is_timeout());
    assert!(started.elapsed() >= ms(200));
    latch.count_down().unwrap();
    latch.wait_for(Duration::ZERO).expect("open");
    latch
        .wait_for(Duration::MAX)
        .expect("no deadline: open anyway");
}

/// A cancel ends a wait at once and leaves the latch as it was; a token cancelled before
/// the call sends nothing.
#[test]
fn cancel() {
    let (srv, c) = test_server_and(client);
    let latch = c.latch("c", 1);
    let cancel = Cancel::new();
    thread::scope(|s| {
        let w = s.spawn(|| {
            let r = latch.wait_cancellable(&cancel);
            (r, Instant::now())
        });
        wait_for(LIVENESS, "the waiter listens", || listeners(&srv, "c") >= 1);
        thread::sleep(ms(50));
        assert!(!w.is_finished(), "the waiter waits");
        let at = Instant::now();
        cancel.cancel();
        wait_for(LIVENESS, "the cancelled waiter returns", || w.is_finished());
        let (r, returned) = w.join().unwrap();
        assert!(r.unwrap_err().is_cancelled());
        eprintln!(
            "latch wait: cancel to return {:?}",
            returned.saturating_duration_since(at)
        );
    });
    assert_eq!(latch.count().unwrap(), 1, "the latch is as it was");

    let fresh = c.latch("never-touched", 1);
    assert!(fresh.wait_cancellable(&cancel).unwrap_err().is_cancelled());
    assert!(srv.keys("*never-touched*").is_empty(), "nothing sent");

    // Open before the cancel: the wait returns Ok.
    latch.count_down().unwrap();
    let late = Cancel::new();
    latch.wait_cancellable(&late).expect("open");
}

/// A wait on a name nobody touched made the latch with its first read; cancelled, it
/// leaves that latch as it is, for its TTL: its count stands, and a call with another
/// count is refused.
#[test]
fn a_cancelled_wait_leaves_the_latch_it_made() {
    let (srv, c) = test_server_and(client);
    let name = "cancelled-wait";
    let cancel = Cancel::new();
    let latch = c.latch(name, 3);
    thread::scope(|s| {
        let w = s.spawn(|| latch.wait_cancellable(&cancel));
        wait_for(LIVENESS, "the waiter listens", || {
            listeners(&srv, name) >= 1
        });
        thread::sleep(ms(100));
        cancel.cancel();
        wait_for(LIVENESS, "the cancelled waiter returns", || w.is_finished());
        assert!(w.join().unwrap().unwrap_err().is_cancelled());
    });
    let ttl = pttl(&srv, &latch_key(name));
    assert!(
        ttl > 0 && ttl <= 3_600_000,
        "kept for its TTL (1 hour): {ttl}"
    );
    assert_eq!(latch.count().unwrap(), 3, "as the wait made it");
    let other = c.latch(name, 5).count().unwrap_err();
    assert!(other.is_count_mismatch(), "{other:?}");
}

/// A wait that times out counts in `Stats::timeouts`, as a hold's does.
#[test]
fn a_latch_wait_that_times_out_is_counted_in_timeouts() {
    let (_srv, c) = test_server_and(client);
    let err = c
        .latch("gate", 1)
        .wait_for(ms(100))
        .expect_err("nobody counts it down");
    assert!(err.is_timeout(), "{err:?}");
    assert_eq!(c.stats().timeouts, 1, "{:?}", c.stats());
}

/// With polling instead of notifications, a waiter still sees the latch open.
#[test]
fn polling_waiters_see_it_open() {
    let srv = test_server();
    let c = lock_client!(node(srv.url()), wakeup(Wakeup::Polling(ms(20))));
    let latch = c.latch("p", 2);
    latch.count().unwrap();
    thread::scope(|s| {
        let w = s.spawn(|| latch.wait());
        latch.count_down().unwrap();
        client(&srv.url()).latch("p", 2).count_down().unwrap();
        wait_for(LIVENESS, "the polling waiter returns", || w.is_finished());
        w.join().unwrap().expect("open");
    });
    assert!(c.subscribers().is_empty());
}

/// A lock and a latch of one name live side by side.
#[test]
fn a_name_can_be_a_lock_and_a_latch() {
    let (_srv, c) = test_server_and(client);
    let guard = c.lock("both").expect("lock");
    let latch = c.latch("both", 1);
    assert_eq!(latch.count_down().unwrap(), 0);
    latch.wait().expect("open");
    guard.check().expect("the lock is still held");
    guard.unlock().expect("unlock");
}

/// Waits and count downs on `a` and `b` (two clients of one deployment) for latches named
/// `names`: each waiter returns once the other client counted its latch down. `settle`:
/// how long the waiters have to listen (and read again) before the count downs.
fn wait_and_count_down<N: AsRef<[u8]> + Sync>(
    a: &LockClient,
    b: &LockClient,
    names: &[N],
    settle: Duration,
) {
    thread::scope(|s| {
        let waits: Vec<_> = names
            .iter()
            .map(|n| {
                let latch = a.latch(n, 2);
                latch.count().expect("count");
                s.spawn(move || latch.wait())
            })
            .collect();
        thread::sleep(settle);
        for n in names {
            let latch = b.latch(n, 2);
            assert_eq!(latch.count_down().expect("down"), 1);
            assert_eq!(latch.count_down().expect("down"), 0);
        }
        let deadline = Instant::now() + LIVENESS;
        for (w, n) in waits.into_iter().zip(names) {
            let n = n.as_ref();
            assert!(
                wait_until(deadline.saturating_duration_since(Instant::now()), || w
                    .is_finished()),
                "the waiter of {:?} did not return",
                String::from_utf8_lossy(&n[..n.len().min(16)])
            );
            w.join().unwrap().expect("open");
        }
    });
}

/// The least ACL a lock needs (see `tests/bad_input.rs`) is enough for a latch.
#[test]
fn the_locks_minimal_acl_is_enough() {
    init_log();
    let rules = "resetkeys ~redbaton:* resetchannels &redbaton:* &__keyspace@* \
         -@all +evalsha +script|load +get +set +del +pexpire +pttl +incr +publish \
         +exists +time +zadd +zrem +zrange +zrangebyscore +zcard +zscore +zremrangebyscore \
         +subscribe +unsubscribe +ping +client|setname";
    let srv = RedisServer::builder()
        .acl_user("locker", "lockerpw", rules)
        .start();
    let build = || client(&srv.url_as("locker", "lockerpw"));
    let (a, b) = (build(), build());
    wait_and_count_down(&a, &b, &["acl".to_owned()], Duration::ZERO);
}

/// Redis Cluster: each latch lives on its slot's master and wakes its waiters there.
#[test]
fn cluster_latches_on_every_master() {
    init_log();
    let cluster = Cluster::start();
    let build = || {
        lock_builder!(cluster(cluster.seed_urls()), io_timeouts(ms(1000)))
            .build()
            .expect("build")
    };
    let (a, b) = (build(), build());
    // Two names on each master.
    let mut per_master: HashMap<u16, usize> = HashMap::new();
    let names: Vec<String> = (0..)
        .map(|i| format!("cl-{i}"))
        .filter(|n| {
            let on = per_master
                .entry(cluster.master_of(&latch_key(n)).port())
                .or_default();
            *on += 1;
            *on <= 2
        })
        .take(6)
        .collect();
    wait_and_count_down(&a, &b, &names, Duration::ZERO);
    for n in &names {
        let key = latch_key(n);
        let on: bool = redis::cmd("EXISTS")
            .arg(&key)
            .query(&mut cluster.master_of(&key).conn())
            .expect("EXISTS");
        assert!(on, "{n}: on its slot's master");
    }

    // A waiter whose latch's slot moves to another master follows it, and is woken there
    // by the count down: not by its re-check (60 s) nor the latch's TTL (1 hour).
    let slow = lock_builder!(
        cluster(cluster.seed_urls()),
        io_timeouts(ms(1000)),
        recheck_interval(secs(60))
    )
    .build()
    .expect("build");
    let key = latch_key("moving");
    let slot = cluster.keyslot(&key);
    let from = cluster.owner(slot);
    let to = cluster.other_master(from);
    let latch = slow.latch("moving", 2);
    assert_eq!(b.latch("moving", 2).count_down().unwrap(), 1);
    thread::scope(|s| {
        let w = s.spawn(|| latch.wait());
        wait_for(LIVENESS, "the waiter listens", || {
            listeners(cluster.server(from), "moving") >= 1
        });
        let sharded = subscribed(cluster.server(from), "moving", "SHARDNUMSUB") >= 1;
        cluster.move_slot(slot, to);
        if sharded {
            wait_for(LIVENESS, "the waiter listens on the new master", || {
                listeners(cluster.server(to), "moving") >= 1
            });
        } else {
            // A classic message is broadcast to every node: the subscription on the old
            // master hears the count down on the new one.
            thread::sleep(ms(200));
        }
        assert_eq!(b.latch("moving", 2).count_down().unwrap(), 0);
        wait_for(LIVENESS, "the waiter returns", || w.is_finished());
        w.join().unwrap().expect("open");
    });
    let st = slow.stats();
    eprintln!(
        "moved-slot waiter: {} moved, {} event, {} re-check wake-ups",
        st.wakeups_moved, st.wakeups_event, st.wakeups_recheck
    );
}

/// Sentinel: the latch lives on the master the sentinels name.
#[test]
fn sentinel_latches() {
    init_log();
    let group = SentinelGroup::start("latches", 1, 3);
    let build = || {
        lock_builder!(sentinel("latches", group.sentinel_urls()))
            .build()
            .expect("build")
    };
    let (a, b) = (build(), build());
    wait_and_count_down(&a, &b, &["s".to_owned()], Duration::ZERO);
    assert!(!group.master().keys("*latch").is_empty());
}

/// Names with odd bytes (a `}`, which switches to the escaped key form `{hash}prefix
/// name`, NUL, CR LF, invalid UTF-8, a name ending in `:ev`, the longest name) and a
/// prefix with a `{`: each waiter is woken by its latch's `z` (the channel maps back to
/// its key), not by its re-check (60 s).
#[test]
fn odd_names_and_prefixes_wake_their_waiters() {
    let srv = test_server();
    let long = vec![b'x'; 4096];
    let names: Vec<Vec<u8>> = vec![
        b"}".to_vec(),
        b"a}b{c".to_vec(),
        b"nul\0byte".to_vec(),
        b"cr\r\nlf".to_vec(),
        vec![0xff, 0xfe, b'}', 0x80],
        b"ends:ev".to_vec(),
        b"x}:ev".to_vec(),
        long,
    ];
    for prefix in ["redbaton:", "p{x}:"] {
        let a = lock_client!(
            node(srv.url()),
            key_prefix(prefix),
            recheck_interval(secs(60))
        );
        let b = lock_client!(node(srv.url()), key_prefix(prefix));
        // Every waiter listens (and has read again) before the count downs.
        wait_and_count_down(&a, &b, &names, ms(500));
        assert_eq!(a.stats().wakeups_recheck, 0, "prefix {prefix}");
    }
}

/// A deadline far away but representable (not `Duration::MAX`, which `wait_for` turns
/// into no deadline) neither panics nor returns early; the wait returns when the latch
/// opens.
#[test]
fn far_deadlines_do_not_panic() {
    let (_srv, c) = test_server_and(client);
    let latch = c.latch("far", 1);
    latch.count().unwrap();
    let far = Duration::from_secs(1 << 40);
    let deadline = Instant::now().checked_add(far).expect("representable");
    thread::scope(|s| {
        let w1 = s.spawn(|| latch.wait_until(deadline));
        let w2 = s.spawn(|| latch.wait_for(far));
        thread::sleep(ms(300));
        assert!(!w1.is_finished() && !w2.is_finished(), "returned early");
        latch.count_down().unwrap();
        wait_for(LIVENESS, "the waiters return", || {
            w1.is_finished() && w2.is_finished()
        });
        w1.join().unwrap().expect("open");
        w2.join().unwrap().expect("open");
    });
}
