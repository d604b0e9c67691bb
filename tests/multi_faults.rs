//! The multi-lock under faults whose outcome the library cannot know, against real
//! redis-servers (one node, Redis Cluster) and the fault-injecting proxy: a reply cut
//! short by the caller's deadline ends the call as a timeout and what the attempt took is
//! given back, a server that stalls past the lease never yields a guard born dead, bad
//! name lists are refused before anything is sent; on a Cluster, a call that times out
//! while a master it took names on is silent returns by its deadline, an attempt whose
//! replies were lost is given back even when the ride through the failure ends refused,
//! and a multi-lock is never returned with a lock already lost. The plain lock's wait is
//! the same contest: two of these cases are checked for it too. (A retry that wins after
//! a lost reply is in `lost_replies.rs`.)
//!
//! Times are liveness bounds, never speed claims.

use std::thread;
use std::time::{Duration, Instant};

use redbaton::{LockClient, Result, Unlocked};
use redbaton_testkit::cluster::{Cluster, announces_ports_at_runtime, slot_port};
use redbaton_testkit::keys::Keys;
use redbaton_testkit::proxy::Proxy;
use redbaton_testkit::server::RedisServer;
use redbaton_testkit::wait::wait_for;
use redbaton_testkit::{exists, init_log, lock_builder, lock_client, ms, secs, test_server};

const PREFIX: &str = "rm:";
const KEYS: Keys = Keys::new(PREFIX);
/// An odd lease, long enough that nothing the tests look for expires meanwhile.
const LEASE_MS: u64 = 17_777;

fn key(name: &str) -> String {
    KEYS.lock(name)
}

/// The contention mark key of `name` (`p{n}:w`, see the design's key table).
fn mark(name: &str) -> String {
    format!("{}:w", KEYS.lock(name))
}

fn client(url: &str, io: Duration) -> LockClient {
    lock_client!(
        node(url),
        key_prefix(PREFIX),
        lease(ms(LEASE_MS)),
        io_timeouts(io)
    )
}

/// A server, a proxy in front of it, and a client through the proxy whose scripts are
/// loaded (a warm-up multi-lock and lock taken and given back), so that the first
/// `EVALSHA` of a test is answered by the script, not by `NOSCRIPT`.
fn behind_proxy(io: Duration) -> (RedisServer, Proxy, LockClient) {
    let srv = test_server();
    let proxy = Proxy::start(srv.addr());
    let c = client(&proxy.url(), io);
    let warm = c.multi_lock(["warm-1", "warm-2"]).expect("warm-up");
    assert_eq!(warm.unlock().expect("unlock"), Unlocked::Released);
    drop(c.lock("warm-3").expect("warm-up"));
    (srv, proxy, c)
}

/// A stranger's hold of `name`: its key holding a foreign token for a minute.
fn stranger_holds(conn: &mut redis::Connection, name: &str) {
    redis::cmd("SET")
        .arg(key(name))
        .arg("stranger")
        .arg("PX")
        .arg(60_000)
        .query::<()>(conn)
        .expect("SET");
}

/// A multi-lock is taken and given back through the proxy; nothing is left behind.
#[test]
fn smoke() {
    let (srv, _proxy, c) = behind_proxy(secs(2));
    let g = c.multi_lock(["s1", "s2", "s3"]).expect("multi-lock");
    g.check().expect("held");
    assert!(!g.previous_lost());
    let tokens = g.fencing_tokens();
    assert_eq!(tokens.len(), 3);
    assert_eq!(g.unlock().expect("unlock"), Unlocked::Released);
    let mut conn = srv.conn();
    for n in ["s1", "s2", "s3"] {
        assert!(!exists(&mut conn, key(n)), "{n} released");
        assert!(!exists(&mut conn, mark(n)), "{n}: no mark");
    }
}

/// `take` asks for the free `names` within 200 ms over a link whose replies take 600 ms:
/// the attempt runs in Redis and takes the names, but its reply cannot come within the
/// caller's deadline. The call ends with `Error::Timeout`, as a wait that ran out does,
/// and what the unanswered attempt took is given back.
fn cut_short_by_the_deadline(names: &[&str], take: impl FnOnce(&LockClient) -> Result<()>) {
    let (srv, proxy, c) = behind_proxy(secs(2));
    proxy.set_delay(ms(600));
    let asked = Instant::now();
    let e = take(&c).expect_err("no reply within the deadline");
    let took = asked.elapsed();
    proxy.set_delay(Duration::ZERO);
    eprintln!("{names:?} within 200 ms over a 600 ms link: {e:?} after {took:?}");
    assert!(e.is_timeout(), "the deadline ends the call: {e:?}");
    // What the unanswered attempt took is given back by the cleanup job.
    let mut conn = srv.conn();
    let given_back = || names.iter().all(|n| !exists(&mut conn, key(n)));
    wait_for(secs(5), "every name given back", given_back);
}

#[test]
fn a_reply_cut_short_by_the_deadline_says_timeout() {
    let names = ["x", "y"];
    cut_short_by_the_deadline(&names, |c| c.try_multi_lock_for(names, ms(200)).map(drop));
}

/// The same for a plain lock (`try_lock_for`), whose wait is the same contest.
#[test]
fn a_lock_whose_reply_is_cut_short_by_the_deadline_says_timeout() {
    cut_short_by_the_deadline(&["l"], |c| c.try_lock_for("l", ms(200)).map(drop));
}

/// The server stalls longer than the lease while the attempt waits (its retry's reply
/// comes after the lease it granted ran out): the multi-lock gives that hold back, tries
/// again, and never returns a guard born dead.
#[test]
fn a_guard_is_never_born_dead() {
    let srv = test_server();
    let c = lock_builder!(node(srv.url()), key_prefix(PREFIX), lease(secs(1)))
        .read_timeout(ms(900))
        .build()
        .expect("build");
    drop(c.multi_lock(["warm-1", "warm-2"]).expect("warm-up"));
    let url = srv.url();
    let staller = thread::spawn(move || {
        let mut conn = redbaton_testkit::raw_conn(&url);
        redis::cmd("DEBUG")
            .arg("SLEEP")
            .arg("1.5")
            .query::<()>(&mut conn)
    });
    thread::sleep(ms(100));
    let got = c.try_multi_lock_for(["z1", "z2"], secs(10));
    staller.join().expect("staller").expect("DEBUG SLEEP");
    let g = got.expect("free: taken within the deadline");
    assert!(
        g.check().is_ok() && g.valid_until() > Instant::now(),
        "the guard is valid when returned: {:?}",
        g.check()
    );
    assert_eq!(g.unlock().expect("unlock"), Unlocked::Released);
}

/// A name given twice, no names, or too many are refused before anything is sent; two
/// names given in either order take the same keys.
#[test]
fn names_twice_empty_and_orders() {
    let srv = test_server();
    let c = client(&srv.url(), secs(2));
    let none: [&str; 0] = [];
    assert!(c.multi_lock(none).unwrap_err().is_invalid_input());
    assert!(
        c.multi_lock(["d", "e", "d"])
            .unwrap_err()
            .is_invalid_input()
    );
    let many: Vec<String> = (0..=redbaton::MAX_MULTI_NAMES)
        .map(|i| format!("m{i}"))
        .collect();
    assert!(c.multi_lock(&many).unwrap_err().is_invalid_input());
    assert!(srv.keys_but_fences(&format!("{PREFIX}*")).is_empty());
    let all = c
        .multi_lock(&many[..redbaton::MAX_MULTI_NAMES])
        .expect("64 names");
    assert_eq!(all.unlock().expect("unlock"), Unlocked::Released);
    let g = c.multi_lock(["e", "d"]).expect("e, d");
    assert!(c.try_multi_lock(["d", "e"]).unwrap_err().is_would_block());
    drop(g);
    assert!(srv.keys_but_fences(&format!("{PREFIX}*")).is_empty());
}

// --- Redis Cluster -------------------------------------------------------------------------

/// The port of a `redis://127.0.0.1:PORT/` URL.
fn port_of(url: &str) -> u16 {
    url.trim_start_matches("redis://127.0.0.1:")
        .trim_end_matches('/')
        .parse()
        .expect("a port")
}

/// A Redis Cluster whose master M1 (the one serving slot 0) is reached through a proxy:
/// M1 announces the proxy's port, so the slot map names the proxy. With a name `a` on M1
/// (in `slot_a`), and a client (without the fair queue) whose scripts are loaded. `None` (said for `test`) when the
/// server cannot announce a port at runtime.
struct ProxiedMaster {
    cluster: Cluster,
    m1: u16,
    proxy: Proxy,
    a: String,
    slot_a: u16,
    c: LockClient,
}

fn proxied_master(test: &str) -> Option<ProxiedMaster> {
    if !announces_ports_at_runtime(test) {
        return None;
    }
    init_log();
    let cluster = Cluster::start();
    let slot_of = |n: &str| cluster.keyslot(key(n).as_bytes());
    let m1 = cluster.owner(0);
    let a = (0..)
        .map(|i| format!("q{i}"))
        .find(|n| cluster.owner(slot_of(n)) == m1)
        .expect("a name on M1");
    let slot_a = slot_of(&a);
    let server = cluster.server(m1);
    let proxy = Proxy::start(server.addr());
    server.config_set("cluster-announce-port", &proxy.port().to_string());
    wait_for(secs(30), "every node names the proxy", || {
        names_port(&cluster, slot_a, proxy.port())
    });
    // Without the fair queue, for the plain lock's tests (a multi-lock has none).
    let b = lock_builder!(
        cluster(cluster.seed_urls()),
        io_timeouts(ms(300)),
        fair(false)
    );
    let c = b
        .key_prefix(PREFIX)
        .lease(ms(LEASE_MS))
        .build()
        .expect("build");
    drop(c.multi_lock([a.as_str()]).expect("warm-up"));
    drop(c.lock(&a).expect("warm-up"));
    Some(ProxiedMaster {
        cluster,
        m1,
        proxy,
        a,
        slot_a,
        c,
    })
}

/// Whether every node of `cluster` says `slot` is served at `port`.
fn names_port(cluster: &Cluster, slot: u16, port: u16) -> bool {
    (cluster.servers.iter()).all(|s| slot_port(s, slot) == Some(port))
}

/// Redis Cluster: `try_multi_lock_for([a, b], 2 s)`, `a` on M1 (behind a proxy) in a
/// slot before `b`'s, `b` held by a stranger on another master. The call takes `a`, waits
/// for `b`, and M1 goes silent meanwhile (no failover). At the deadline the call ends
/// with `Timeout` within a few I/O timeouts, not a lease later: giving `a` back is one
/// attempt, and the cleanup job's once M1 answers again.
#[test]
fn cluster_a_multi_lock_that_times_out_returns_by_its_deadline() {
    let test = "cluster_a_multi_lock_that_times_out_returns_by_its_deadline";
    let Some(ProxiedMaster {
        cluster,
        m1,
        proxy,
        a,
        slot_a,
        c,
    }) = proxied_master(test)
    else {
        return;
    };
    let b = (0..)
        .map(|i| format!("lb{i}"))
        .find(|n| {
            let slot = cluster.keyslot(key(n).as_bytes());
            slot > slot_a && cluster.owner(slot) != m1
        })
        .expect("a name of a later slot on another master");
    stranger_holds(&mut cluster.master_of(key(&b).as_bytes()).conn(), &b);
    let mut conn = cluster.server(m1).conn();
    let (outcome, took) = thread::scope(|s| {
        let waiter = s.spawn(|| {
            let asked = Instant::now();
            let r = c.try_multi_lock_for([a.as_str(), b.as_str()], secs(2));
            (r.map(drop), asked.elapsed())
        });
        wait_for(secs(5), "a taken", || exists(&mut conn, key(&a)));
        proxy.blackhole(true);
        waiter.join().expect("waiter")
    });
    eprintln!("try_multi_lock_for(2 s) with M1 silent: {outcome:?} after {took:?}");
    assert!(outcome.expect_err("b is held").is_timeout());
    assert!(
        took < secs(6),
        "returned {took:?} after the call, a 2 s wait"
    );
    proxy.heal();
    wait_for(secs(10), "a given back once M1 answers", || {
        !exists(&mut conn, key(&a))
    });
}

/// Redis Cluster: `take` waits 6 s for `a`, on a master (M1) reached through a proxy
/// that loses every reply matching `needle` (its acquire's: the script runs and takes
/// `a`), so the wait rides through the failure with the attempt's token. Then M1
/// announces a port nobody listens on (as when a master is killed and the map still names
/// it): every later attempt is refused before it runs, and the call ends with `Timeout`.
/// The hold the unanswered attempts made is given back once M1 is reachable again, not
/// left until its lease ends.
fn lost_attempts_then_refused(
    test: &str,
    needle: &[u8],
    take: impl Fn(&LockClient, &str) -> Result<()> + Sync,
) {
    let Some(m) = proxied_master(test) else {
        return;
    };
    let ProxiedMaster {
        cluster,
        m1,
        proxy,
        a,
        slot_a,
        c,
    } = m;
    let server = cluster.server(m1);
    let dead = port_of(&redbaton_testkit::dead_url());
    let (outcome, took) = proxy.losing_replies_matching(needle, || {
        thread::scope(|s| {
            let waiter = s.spawn(|| {
                let asked = Instant::now();
                (take(&c, &a), asked.elapsed())
            });
            let mut conn = server.conn();
            wait_for(secs(5), "an unanswered attempt took a", || {
                exists(&mut conn, key(&a))
            });
            thread::sleep(ms(300));
            // M1 as if killed: its announced port refuses connections.
            server.config_set("cluster-announce-port", &dead.to_string());
            waiter.join().expect("waiter")
        })
    });
    eprintln!("{test}: replies lost then refused: {outcome:?} after {took:?}");
    let e = outcome.expect_err("never answered");
    assert!(e.is_timeout(), "{e:?}");
    let mut conn = server.conn();
    let held_for = redbaton_testkit::pttl(&mut conn, key(&a));
    eprintln!("a after the call: PTTL {held_for} ms");
    // M1 back at its own port: a give-back queued for the cleanup job reaches it now.
    server.config_set("cluster-announce-port", "0");
    wait_for(secs(30), "every node names M1 again", || {
        names_port(&cluster, slot_a, m1)
    });
    let start = Instant::now();
    while exists(&mut conn, key(&a)) && start.elapsed() < secs(6) {
        thread::sleep(ms(50));
    }
    let left = redbaton_testkit::pttl(&mut conn, key(&a));
    assert!(
        !exists(&mut conn, key(&a)),
        "a, taken by the wait's unanswered attempts, is given back within 6 s of M1's \
         return; still held (PTTL {left} ms) after {:?}",
        start.elapsed()
    );
}

#[test]
fn cluster_a_lost_attempt_is_given_back_after_a_ride_that_ends_refused() {
    // The mark id (`<client id>:multi`) is an argument of the multi-lock's acquire alone.
    lost_attempts_then_refused(
        "cluster_a_lost_attempt_is_given_back_after_a_ride_that_ends_refused",
        b":multi",
        |c, a| c.try_multi_lock_for([a], secs(6)).map(drop),
    );
}

/// The same for a plain lock without the fair queue (whose leave would settle it
/// otherwise), whose wait is the same contest: the needle is its lease, which only its
/// acquire carries (nothing is held, so no renewal is sent).
#[test]
fn cluster_a_lock_lost_attempt_is_given_back_after_a_ride_that_ends_refused() {
    lost_attempts_then_refused(
        "cluster_a_lock_lost_attempt_is_given_back_after_a_ride_that_ends_refused",
        LEASE_MS.to_string().as_bytes(),
        |c, a| c.try_lock_for(a, secs(6)).map(drop),
    );
}

/// Redis Cluster: `multi_lock([a, b])`, `a` in a lower slot than `b`, `b` held by a
/// stranger. The call takes `a` first, then waits for `b`. Meanwhile `a`'s key is deleted
/// (an operator, a restart without data, an eviction) and the watchdog finds it lost;
/// then the stranger lets `b` go. The call never returns a guard whose `a` is lost: it
/// takes every name again and returns a guard that holds them all.
#[test]
fn cluster_a_multi_lock_is_never_returned_lost() {
    init_log();
    let cluster = Cluster::start();
    let slot_of = |n: &str| cluster.keyslot(key(n).as_bytes());
    let a = "la0".to_owned();
    let slot_a = slot_of(&a);
    let b = (0..)
        .map(|i| format!("lb{i}"))
        .find(|n| slot_of(n) > slot_a)
        .expect("a name of a later slot");
    let c = lock_client!(
        cluster(cluster.seed_urls()),
        key_prefix(PREFIX),
        lease(ms(900)),
        io_timeouts(ms(300))
    );
    drop(c.multi_lock([a.as_str(), b.as_str()]).expect("warm-up"));
    let mut conn_a = cluster.master_of(key(&a).as_bytes()).conn();
    let mut conn_b = cluster.master_of(key(&b).as_bytes()).conn();
    stranger_holds(&mut conn_b, &b);
    let g = thread::scope(|s| {
        let waiter = s.spawn(|| c.multi_lock([a.as_str(), b.as_str()]));
        wait_for(secs(10), "a taken", || exists(&mut conn_a, key(&a)));
        let _: i64 = redis::cmd("DEL")
            .arg(key(&a))
            .query(&mut conn_a)
            .expect("DEL");
        // The watchdog renews every 300 ms: by now it found `a` gone.
        wait_for(secs(5), "a's loss counted", || c.stats().locks_lost >= 1);
        let _: i64 = redis::cmd("DEL")
            .arg(key(&b))
            .query(&mut conn_b)
            .expect("DEL");
        waiter.join().expect("waiter")
    });
    let g = g.expect("multi-lock");
    eprintln!("multi_lock returned: lost {:?}", g.check());
    assert!(
        !g.is_lost(),
        "multi_lock returns a guard that holds every name: {:?}",
        g.check()
    );
}
