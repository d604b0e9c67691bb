//! Redlock rounds whose replies come late or never, and what the library then believes: a
//! round won in time whose fence raise is slow, a node that hangs under calls already
//! queued for it, a hung node beside a waiter, and what Redlock refuses.

use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use redbaton::{Error, LockClient};
use redbaton_testkit::keys::Keys;
use redbaton_testkit::proxy::Proxy;
use redbaton_testkit::server::{self, RedisServer};
use redbaton_testkit::{init_log, lock_client, ms, secs};

const PREFIX: &str = "rv:";
const KEYS: Keys = Keys::new(PREFIX);

fn set_stranger(srv: &RedisServer, name: &str, px: u64) {
    let _: () = redis::cmd("SET")
        .arg(KEYS.lock(name))
        .arg("stranger")
        .arg("PX")
        .arg(px)
        .query(&mut srv.conn())
        .expect("SET the stranger's key");
}

/// Three nodes: a lock taken on all, held, released.
#[test]
fn smoke() {
    let (_servers, urls) = three_nodes();
    let client = lock_client!(nodes(urls), key_prefix(PREFIX));
    let guard = client.lock("smoke").expect("a majority grants");
    guard.check().expect("held");
    guard.unlock().expect("released");
}

/// A round won in time, whose one granting node with a fence counter behind answers
/// slowly (2 s of a 3 s lease): raising its counter takes what the lease had left. No
/// guard is returned with its lease already over: the round counts as late, is given
/// back, and the call tries again until its deadline.
///
/// A grants, B holds a stranger's key (so A and C are the majority), A's requests are
/// delayed 30 ms so that C's fence (its clock, µs) is below A's: C is the one behind.
#[test]
fn a_slow_fence_raise_returns_no_guard_born_dead() {
    init_log();
    let servers = server::start_many(3);
    let pa = Proxy::start(servers[0].addr());
    let pc = Proxy::start(servers[2].addr());
    let nodes = vec![pa.url(), servers[1].url(), pc.url()];
    let client = lock_client!(
        nodes(nodes),
        key_prefix(PREFIX),
        lease(secs(3)),
        read_timeout(ms(2_500))
    );
    // Scripts loaded, connections pooled (the raise script too: lock a few times).
    warm_up(&client);
    set_stranger(&servers[1], "born", 600_000);
    pa.set_delay_both(ms(30));
    pc.set_delay(secs(2));
    let started = Instant::now();
    let guard = match client.try_lock_for("born", secs(8)) {
        Ok(guard) => guard,
        // Every round's raise took what the lease had left: no guard, rather than a dead one.
        Err(e) if e.is_timeout() || e.is_no_quorum() => return,
        Err(e) => panic!("{e:?}"),
    };
    let took = started.elapsed();
    let (a_fence, c_fence) = (fence_of(&servers[0], "born"), fence_of(&servers[2], "born"));
    let left = guard
        .valid_until()
        .saturating_duration_since(Instant::now());
    eprintln!(
        "lock took {took:?}; validity left {left:?}; check {:?}; fences A {a_fence} C {c_fence}",
        guard.check()
    );
    pa.heal();
    pc.heal();
    assert!(
        guard.check().is_ok() && guard.valid_until() > Instant::now(),
        "a guard born dead after {took:?}: check {:?}",
        guard.check()
    );
}

/// `try_lock_for(name, d)` of `client`, and how long it took (the guard, if any, dropped).
fn timed_try(client: &LockClient, name: &str, d: Duration) -> (redbaton::Result<()>, Duration) {
    let started = Instant::now();
    let got = client.try_lock_for(name, d).map(drop);
    let took = started.elapsed();
    eprintln!("try_lock_for({name}, {d:?}): {got:?} after {took:?}");
    (got, took)
}

/// Three servers, and their URLs.
fn three_nodes() -> (Vec<RedisServer>, Vec<String>) {
    init_log();
    let servers = server::start_many(3);
    let urls = servers.iter().map(RedisServer::url).collect();
    (servers, urls)
}

/// Scripts loaded and connections pooled on every node (the fence raise's script too: a
/// few locks, whose fences differ between nodes).
fn warm_up(client: &LockClient) {
    for i in 0..3 {
        let guard = client.lock(format!("warm{i}")).expect("warm-up lock");
        guard.unlock().expect("warm-up unlock");
    }
}

/// The fence counter of `name` on `srv`, as a number (held forms are negative).
fn fence_of(srv: &RedisServer, name: &str) -> i64 {
    let v: Option<String> = redis::cmd("GET")
        .arg(format!("{}:fence", KEYS.lock(name)))
        .query(&mut srv.conn())
        .expect("GET fence");
    v.and_then(|s| s.parse().ok()).unwrap_or(0)
}

/// One node hangs (SIGSTOP) right after it answered quickly, before the fan-out can see
/// it stalled, while several threads' rounds queue calls on its lane (each waits out a
/// read timeout). A `try_lock_for` whose call is queued behind them returns by its
/// deadline plus one read timeout: a call that waited in the queue for the stall bound is
/// skipped, and the two healthy nodes decide.
#[test]
fn a_node_hung_under_queued_calls_keeps_the_deadline() {
    let (servers, urls) = three_nodes();
    let read = secs(1);
    let client = Arc::new(lock_client!(
        nodes(urls),
        key_prefix(PREFIX),
        lease(secs(30)),
        read_timeout(read)
    ));
    warm_up(&client);
    // C just answered quickly: its lane is not stalled.
    servers[2].pause();
    let workers: Vec<_> = (0..8)
        .map(|i| {
            let c = client.clone();
            thread::spawn(move || {
                let g = c.lock(format!("q{i}"));
                drop(g);
            })
        })
        .collect();
    thread::sleep(ms(100));
    let deadline = ms(300);
    let (_, took) = timed_try(&client, "probe", deadline);
    servers[2].resume();
    for w in workers {
        w.join().expect("worker");
    }
    // Generous: the deadline, one read timeout, and a second of slack for a loaded box.
    let bound = deadline + read + secs(1);
    assert!(
        took <= bound,
        "try_lock_for({deadline:?}) took {took:?} with one node of three hung (bound {bound:?})"
    );
}

/// On a Redlock client every primitive that needs one deciding node is refused with a
/// typed `Error::Unsupported` (read-write locks, upgradable reads, semaphores, multi-locks,
/// latches), before anything is written to any node.
#[test]
fn redlock_refuses_what_needs_one_node_and_writes_nothing() {
    let servers = server::start_many(3);
    let urls: Vec<String> = servers.iter().map(RedisServer::url).collect();
    let client: LockClient = lock_client!(nodes(urls), key_prefix(PREFIX));
    let unsupported = |what: &str, e: Error| {
        assert!(matches!(e, Error::Unsupported(_)), "{what}: {e:?}");
    };
    let rw = client.rwlock("rw");
    unsupported("try_read", rw.try_read().map(|_| ()).unwrap_err());
    unsupported("try_write", rw.try_write().map(|_| ()).unwrap_err());
    unsupported(
        "try_upgradable_read",
        rw.try_upgradable_read().map(|_| ()).unwrap_err(),
    );
    unsupported(
        "write with a deadline",
        rw.try_write_for(ms(200)).map(|_| ()).unwrap_err(),
    );
    let sem = client.semaphore("sem", 2);
    unsupported("try_acquire", sem.try_acquire().map(|_| ()).unwrap_err());
    unsupported(
        "try_acquire_for",
        sem.try_acquire_for(ms(200)).map(|_| ()).unwrap_err(),
    );
    unsupported(
        "try_multi_lock",
        client.try_multi_lock(["m1", "m2"]).map(|_| ()).unwrap_err(),
    );
    unsupported(
        "multi_lock of one name",
        client.try_multi_lock(["m1"]).map(|_| ()).unwrap_err(),
    );
    let latch = client.latch("l", 2);
    unsupported("count_down", latch.count_down().map(|_| ()).unwrap_err());
    unsupported("count", latch.count().map(|_| ()).unwrap_err());
    unsupported("wait_for", latch.wait_for(ms(200)).unwrap_err());
    for (i, srv) in servers.iter().enumerate() {
        let keys = srv.keys(&format!("{PREFIX}*"));
        assert!(keys.is_empty(), "node {i} has keys {keys:?}");
    }
}

/// A waiter behind a holder while one node of three is SIGSTOPped (its subscription there
/// is never confirmed): each `try_lock_for` ends within its deadline plus one read
/// timeout, and a waiter is woken by the release heard from the live nodes, before the
/// holder's `unlock` has finished waiting for the hung one.
#[test]
fn a_waiter_keeps_its_deadline_and_is_woken_with_a_hung_node() {
    let (servers, urls) = three_nodes();
    let read = secs(1);
    let x = lock_client!(
        nodes(urls.clone()),
        key_prefix(PREFIX),
        lease(secs(30)),
        read_timeout(read)
    );
    let y = lock_client!(
        nodes(urls),
        key_prefix(PREFIX),
        lease(secs(30)),
        read_timeout(read)
    );
    for c in [&x, &y] {
        c.lock("warm").expect("warm").unlock().expect("warm unlock");
    }
    let held = x.lock("w").expect("x holds");
    servers[2].pause();
    let mut worst = Duration::ZERO;
    for d in [ms(300), ms(300), ms(1500)] {
        let (got, took) = timed_try(&y, "w", d);
        assert!(got.is_err());
        worst = worst.max(took.saturating_sub(d));
    }
    // A waiter woken by the release, with C still hung.
    let y = Arc::new(y);
    let y2 = y.clone();
    let waiter = thread::spawn(move || {
        let started = Instant::now();
        let g = y2.try_lock_for("w", secs(20));
        (g.map(|g| g.fencing_token()), started.elapsed())
    });
    thread::sleep(ms(500));
    let released_at = Instant::now();
    let out = held.unlock();
    eprintln!(
        "unlock with C hung: {out:?} after {:?}",
        released_at.elapsed()
    );
    let (got, took) = waiter.join().expect("waiter");
    eprintln!(
        "woken waiter: {got:?} after {took:?}; since release {:?}",
        released_at.elapsed()
    );
    servers[2].resume();
    assert!(
        worst <= read + secs(1),
        "a wait overran its deadline by {worst:?}"
    );
    assert!(got.is_ok());
}

/// A split round: one slow node (every reply 900 ms late) grants, the two others hold a
/// stranger's key. The give-back on the slow node is made within the caller's deadline
/// (what it cannot finish by then is left to the cleanup thread), so the call returns by
/// its deadline, not a slow reply later; and the slow node's key is given back soon.
#[test]
fn a_split_round_gives_back_within_the_deadline() {
    init_log();
    let servers = server::start_many(3);
    let slow = Proxy::start(servers[0].addr());
    let urls = vec![slow.url(), servers[1].url(), servers[2].url()];
    let client = lock_client!(nodes(urls), key_prefix(PREFIX), read_timeout(secs(5)));
    warm_up(&client);
    for srv in &servers[1..] {
        set_stranger(srv, "split", 30_000);
    }
    slow.set_delay(ms(900));
    let (got, took) = timed_try(&client, "split", secs(1));
    slow.heal();
    assert!(got.is_err_and(|e| e.is_timeout()));
    // The deadline, the least a call is given past it, and scheduling.
    assert!(took < ms(1_600), "a wait of 1 s took {took:?}");
    let mut conn = servers[0].conn();
    redbaton_testkit::wait::wait_for(secs(10), "the slow node's key given back", || {
        !redbaton_testkit::exists(&mut conn, KEYS.lock("split"))
    });
}
