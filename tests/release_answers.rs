//! What an unlock says when its release had to be sent again, against real redis-servers:
//! a multi-lock's release (one pipelined round trip for its names) after a try whose
//! reply was lost, and a lock's and a multi-lock's release sent again on the master that
//! replaced a dead one (Redis Cluster, Sentinel). Finding the key gone, a release sent again must
//! read the fence counter to tell our lost try's release (`Released`) from a hold that
//! ended without us (data lost in a restart or a failover: `Expired`). And the contention
//! mark a client's multi-locks share: one that stops waiting never removes the mark of
//! one that has just begun to wait.
//!
//! Times are liveness bounds, never speed claims.

use redbaton::{Builder, Cancel, LockClient, Unlocked, Wakeup};
use redbaton_testkit::cluster::Cluster;
use redbaton_testkit::keys::{Counter, Keys, fence_of};
use redbaton_testkit::proxy::Proxy;
use redbaton_testkit::sentinel::SentinelGroup;
use redbaton_testkit::server::RedisServer;
use redbaton_testkit::wait::wait_for;
use redbaton_testkit::{exists, lock_builder, lock_client, ms, secs, test_server};

const PREFIX: &str = "ra:";
const KEYS: Keys = Keys::new(PREFIX);

/// A builder for `url` with the fair lock (`fair`) or the plain one, and a lease long
/// enough that no renewal looks at a lock during a test.
fn builder(url: &str, fair: bool) -> Builder {
    lock_builder!(node(url), key_prefix(PREFIX), fair(fair), lease(secs(30)))
}

/// A server, a proxy in front of it, and a client through the proxy whose scripts are
/// loaded (a warm-up multi-lock taken and given back), so that a request a test loses is
/// the script run itself, not a `NOSCRIPT` round, which ran nothing.
fn behind_proxy(fair: bool) -> (RedisServer, Proxy, LockClient) {
    let srv = test_server();
    let proxy = Proxy::start(srv.addr());
    let c = builder(&proxy.url(), fair).read_timeout(ms(500));
    let c = c.build().expect("client");
    let warm = c.multi_lock(["warm-1", "warm-2"]).expect("warm-up");
    assert_eq!(warm.unlock().expect("warm-up unlock"), Unlocked::Released);
    (srv, proxy, c)
}

/// The contention mark key of `name`.
fn mark(name: &str) -> String {
    format!("{}:w", KEYS.lock(name))
}

/// A stranger's hold of `name` on `srv`: its key holding a foreign token for a minute.
fn stranger_holds(srv: &RedisServer, name: &str) {
    let set = redis::Commands::pset_ex(&mut srv.conn(), KEYS.lock(name), "stranger", 60_000);
    set.expect("a stranger's SET")
}

#[test]
fn smoke() {
    let (srv, _proxy, c) = behind_proxy(false);
    let g = c.multi_lock(["s1", "s2"]).expect("multi-lock");
    assert!(exists(&mut srv.conn(), KEYS.lock("s1")));
    assert_eq!(g.unlock().expect("unlock"), Unlocked::Released);
    for name in ["s1", "s2"] {
        let counter = Counter::read(&mut srv.conn(), KEYS.fence(name).as_bytes());
        assert!(counter.is_some_and(|c| !c.held), "{name}: {counter:?}");
    }
}

// --- a fair release sent again ----------------------------------------------------------------

/// A fair lock's release whose first try never reached Redis (its connection closed on
/// the way) is sent again in the form that reads the fence counter when it finds the key
/// gone, and, finding the lock still ours and a waiter queued, grants it to that waiter as
/// the first try would have: the fence counter keeps its TTL (it tells the next holder
/// whether the hold before ended without a release, and a retried release whether a try
/// of ours released it), and the grantee's fence is the counter's.
#[test]
fn a_fair_release_sent_again_that_grants_keeps_the_fence_counter() {
    let (srv, proxy, c) = behind_proxy(true);
    let other = builder(&srv.url(), true).build().expect("client");
    let name = "regrant";
    // The fair scripts loaded, so that the request lost is the release itself.
    c.lock(name)
        .expect("warm-up")
        .unlock()
        .expect("warm-up unlock");
    let held = c.lock(name).expect("lock");
    std::thread::scope(|s| {
        let waiter = s.spawn(|| {
            let g = other.try_lock_for(name, secs(20)).expect("granted");
            (g.fencing_token(), g.unlock().expect("unlock"))
        });
        let queue = format!("{}:q", KEYS.lock(name));
        wait_for(secs(20), "the waiter queues", || {
            redis::Commands::zcard::<_, u64>(&mut srv.conn(), &queue).unwrap_or(0) > 0
        });
        let lease = format!("{}:lease", KEYS.lock(name));
        proxy.refuse_next_request_matching(lease.as_bytes());
        assert_eq!(held.unlock().expect("unlock"), Unlocked::Released);
        assert_eq!(proxy.requests_refused(), 1, "the first try was not lost");
        let fence_ttl: i64 =
            redis::Commands::pttl(&mut srv.conn(), KEYS.fence(name)).expect("PTTL");
        assert!(
            fence_ttl > 60_000,
            "the fence counter's TTL after the grant: {fence_ttl} ms"
        );
        let (fence, released) = waiter.join().expect("waiter");
        assert_eq!(released, Unlocked::Released);
        let counter = Counter::read(&mut srv.conn(), KEYS.fence(name).as_bytes());
        assert!(
            counter.is_some_and(|c| !c.held && c.fence == fence_of(fence)),
            "the counter after the grantee's release: {counter:?}, its fence {fence}"
        );
    });
}

// --- a multi-lock's release sent again ------------------------------------------------------

/// The server restarts without data while a multi-lock is held: the release's first try
/// fails on the dead pooled connection (its outcome unknown), and its retry finds every
/// key gone, with no fence counter either. Nothing of ours was released: `Expired`, plain
/// and fair.
#[test]
fn a_multi_unlock_after_a_restart_without_data_is_not_released() {
    for fair in [false, true] {
        let (srv, _proxy, c) = behind_proxy(fair);
        let g = c.multi_lock(["r1", "r2"]).expect("multi-lock");
        srv.restart();
        let outcome = g.unlock();
        assert_eq!(outcome.expect("unlock"), Unlocked::Expired, "fair: {fair}");
    }
}

/// The release's first try never reaches Redis (its connection dies) and meanwhile one
/// name's key was deleted by hand: the retry finds that key gone and its counter still
/// holding our fence, held. That name was not released by us: `Expired`; its counter
/// stays held, so that its next holder is told; the other name is released.
#[test]
fn a_multi_unlock_whose_key_was_deleted_before_its_retry_is_not_released() {
    for fair in [false, true] {
        let (srv, proxy, c) = behind_proxy(fair);
        let g = c.multi_lock(["d1", "d2"]).expect("multi-lock");
        let fence = g.fencing_token("d1").map(fence_of).expect("a fence");
        // Deleted by hand, as an operator or a lost write would; the counter stays.
        let deleted: i64 = redis::Commands::del(&mut srv.conn(), KEYS.lock("d1")).expect("DEL");
        assert_eq!(deleted, 1);
        proxy.kill_all();
        let outcome = g.unlock();
        assert_eq!(outcome.expect("unlock"), Unlocked::Expired, "fair: {fair}");
        let counter = Counter::read(&mut srv.conn(), KEYS.fence("d1").as_bytes())
            .expect("the counter is there");
        assert!(counter.held && counter.fence == fence, "{counter:?}");
        assert!(!exists(&mut srv.conn(), KEYS.lock("d2")), "d2 released");
        let next = c.lock("d1").expect("lock again");
        assert!(next.previous_lost(), "the next holder is told");
    }
}

/// The multi-lock's release runs but its reply is lost: the retry, reading the counters,
/// finds every key gone and its counter holding our fence released: `Released`.
#[test]
fn a_multi_unlock_whose_reply_was_lost_is_released() {
    for fair in [false, true] {
        let (srv, proxy, c) = behind_proxy(fair);
        let g = c.multi_lock(["l1", "l2"]).expect("multi-lock");
        proxy.drop_next_reply_matching(KEYS.lock("l1").as_bytes());
        let outcome = g.unlock();
        assert_eq!(proxy.replies_dropped(), 1, "the fault fired");
        assert_eq!(outcome.expect("unlock"), Unlocked::Released, "fair: {fair}");
        for name in ["l1", "l2"] {
            let counter = Counter::read(&mut srv.conn(), KEYS.fence(name).as_bytes());
            assert!(counter.is_some_and(|c| !c.held), "{name}: {counter:?}");
        }
    }
}

// --- a release ridden through a failover --------------------------------------------------

/// Kills `master` once `replica`, which is to take over, has lost its data: flushed by
/// hand (writes allowed for that; a cluster replica would redirect a `DEL` of one key)
/// after it had every write of `master`, so none comes back.
fn kill_after_its_replica_lost_the_data(master: &RedisServer, replica: &RedisServer) {
    let mut conn = master.conn();
    redis::cmd("SET")
        .arg("ra:sync")
        .arg(1)
        .exec(&mut conn)
        .expect("SET");
    let acked: i64 = redis::cmd("WAIT")
        .arg(1)
        .arg(10_000)
        .query(&mut conn)
        .expect("WAIT");
    assert_eq!(acked, 1, "the replica has the master's writes");
    replica.config_set("replica-read-only", "no");
    redis::cmd("FLUSHALL")
        .exec(&mut replica.conn())
        .expect("FLUSHALL on the replica");
    master.kill();
}

/// A Cluster master dies while a lock and a multi-lock of it are held, and its replica,
/// which takes over, has lost its data. Each release's first try dies with the master's
/// connection (its outcome unknown); the releases ride the failover and send themselves
/// again on the new master, which has neither the keys nor their fence counters: no try
/// of ours released them. `Expired`, not `Released`.
#[test]
fn unlocks_ridden_through_a_failover_that_lost_the_keys_are_not_released() {
    redbaton_testkit::init_log();
    let cluster = Cluster::start();
    let c = lock_client!(
        cluster(cluster.seed_urls()),
        key_prefix(PREFIX),
        lease(secs(20)),
        io_timeouts(secs(1))
    );
    // One slot, so one master: a lock, and a multi-lock of one group.
    let (_, names) = cluster.names_in_one_slot(&KEYS, "ridden", 3);
    let g = c.lock(&names[0]).expect("lock");
    let multi = c.multi_lock(&names[1..]).expect("multi-lock");
    let master = cluster.master_of(&KEYS.lock_bytes(names[0].as_bytes()));
    let replica = cluster.replica_of(master.port());
    kill_after_its_replica_lost_the_data(master, replica);
    let (single, multi) = std::thread::scope(|s| {
        let multi = s.spawn(|| multi.unlock());
        (g.unlock(), multi.join().expect("multi-lock unlock"))
    });
    assert!(
        replica.info("replication").contains("role:master"),
        "the replica took over"
    );
    assert_eq!(single.expect("unlock"), Unlocked::Expired, "the lock");
    assert_eq!(multi.expect("unlock"), Unlocked::Expired, "the multi-lock");
}

/// The same behind Sentinel: the master dies with a lock held, and the replica that the
/// sentinels promote has lost its data. The release rides the failover until the client
/// follows the new master, where its retry finds the key and its counter gone: `Expired`.
#[test]
fn an_unlock_ridden_through_a_sentinel_failover_that_lost_the_key_is_not_released() {
    redbaton_testkit::init_log();
    let group = SentinelGroup::start("ra-lost", 1, 3);
    let c = lock_client!(
        sentinel("ra-lost", group.sentinel_urls()),
        key_prefix(PREFIX),
        lease(secs(20)),
        io_timeouts(secs(1))
    );
    let g = c.lock("sentinel").expect("lock");
    let old = group.master_port();
    kill_after_its_replica_lost_the_data(group.server(old), &group.servers[1]);
    let outcome = g.unlock();
    assert_ne!(group.master_port(), old, "the replica took over");
    assert_eq!(outcome.expect("unlock"), Unlocked::Expired);
}

// --- the contention mark a client's multi-locks share ---------------------------------------

/// Two multi-locks of one client wait for a name a stranger holds, one after the other: the
/// first is cancelled, and its removal of the shared mark is slow on the wire (600 ms);
/// the second begins to wait meanwhile. The first was the last to wait with the mark when
/// it left, but the second's mark must not go with that removal: the mark is there while
/// the second waits (a holder's process that looks for marks then must find it). The
/// waits poll (once a minute): no subscription of the first delays the second's attempt.
#[test]
fn a_multi_lock_leaving_keeps_the_mark_of_one_that_began_to_wait() {
    let (srv, proxy, c) = waited_for_once("m");
    let mark = mark("m");
    let waits = |cancel: &Cancel| c.multi_lock_cancellable(["m"], cancel).map(drop);
    let (first, second) = (Cancel::new(), Cancel::new());
    let marked = || exists(&mut srv.conn(), &mark);
    std::thread::scope(|s| {
        let a = s.spawn(|| waits(&first));
        wait_for(secs(5), "the mark of the one waiting", marked);
        proxy.set_delay_both(ms(600));
        first.cancel();
        // The first one's removal is on its way (held back by the proxy); the second
        // one's attempt is not.
        std::thread::sleep(ms(150));
        proxy.set_delay_both(ms(0));
        let b = s.spawn(|| waits(&second));
        let left = a.join().expect("the first one");
        assert!(left.is_err_and(|e| e.is_cancelled()));
        std::thread::sleep(ms(200));
        let still = marked();
        second.cancel();
        let left = b.join().expect("the second one");
        assert!(left.is_err_and(|e| e.is_cancelled()));
        assert!(still, "the second one waits with its mark");
    });
}

/// A stranger's hold of `name` behind a proxy, and a client through the proxy whose waits
/// poll (once a minute: no subscription delays an attempt) and one of whose multi-locks
/// has waited for `name` and been cancelled: it marked the name and removed its mark, so
/// every script of a wait and of its leaving is loaded (a `NOSCRIPT` would add round trips
/// to a later removal).
fn waited_for_once(name: &str) -> (RedisServer, Proxy, LockClient) {
    let srv = test_server();
    let proxy = Proxy::start(srv.addr());
    let polling = lock_builder!(node(proxy.url()), key_prefix(PREFIX), patient());
    let polling = polling.wakeup(Wakeup::Polling(secs(60)));
    let c = polling.read_timeout(secs(10)).build().expect("client");
    stranger_holds(&srv, name);
    let cancel = Cancel::new();
    let marked = || exists(&mut srv.conn(), mark(name));
    std::thread::scope(|s| {
        let waiting = s.spawn(|| c.multi_lock_cancellable([name], &cancel).map(drop));
        wait_for(secs(5), "the mark of the one waiting", marked);
        cancel.cancel();
        let left = waiting.join().expect("the one waiting");
        assert!(left.is_err_and(|e| e.is_cancelled()));
        assert!(!marked(), "its mark went with it");
    });
    (srv, proxy, c)
}

/// The mark only tells holders that someone waits: a multi-lock whose mark was taken from
/// under it (as by a removal that landed late) is still woken by the release of the name it
/// waits for, long before its next look (a minute away).
#[test]
fn a_multi_lock_whose_mark_was_taken_still_wakes_on_the_release() {
    let srv = test_server();
    let c = lock_client!(node(srv.url()), key_prefix(PREFIX), patient());
    let (name, mark) = (KEYS.lock("w"), mark("w"));
    stranger_holds(&srv, "w");
    std::thread::scope(|s| {
        let waiter = s.spawn(|| c.try_multi_lock_for(["w"], secs(20)));
        wait_for(secs(5), "the waiter's mark", || {
            exists(&mut srv.conn(), &mark)
        });
        redis::cmd("DEL")
            .arg(&mark)
            .exec(&mut srv.conn())
            .expect("DEL the mark");
        redis::cmd("DEL")
            .arg(&name)
            .exec(&mut srv.conn())
            .expect("DEL the lock");
        let g = waiter
            .join()
            .expect("the waiter")
            .expect("woken, it takes w");
        assert_eq!(g.unlock().expect("unlock"), Unlocked::Released);
    });
}

/// A multi-lock that begins to wait while another of its client is removing their shared
/// mark waits for that removal before its first attempt; a cancel ends that wait at once.
/// The removal's reply is held back on the wire for seconds: the cancel must not wait for
/// it.
#[test]
fn a_cancel_ends_a_multi_lock_waiting_for_a_mark_removal() {
    let (srv, proxy, c) = waited_for_once("c");
    let mark = mark("c");
    let (first, second) = (Cancel::new(), Cancel::new());
    let waits = |cancel: &Cancel| c.multi_lock_cancellable(["c"], cancel).map(drop);
    let marked = || exists(&mut srv.conn(), &mark);
    std::thread::scope(|s| {
        let a = s.spawn(|| waits(&first));
        wait_for(secs(5), "the first one's mark", marked);
        // Its attempt's reply has come back: it sleeps until its next look.
        std::thread::sleep(ms(300));
        proxy.set_delay(secs(3));
        first.cancel();
        // The first one's removal ran; its reply is on its way.
        wait_for(secs(5), "the first one's removal", || !marked());
        let b = s.spawn(|| waits(&second));
        std::thread::sleep(ms(200));
        let asked = std::time::Instant::now();
        second.cancel();
        let left = b.join().expect("the second one");
        let took = asked.elapsed();
        proxy.set_delay(ms(0));
        assert!(left.is_err_and(|e| e.is_cancelled()));
        assert!(took < secs(2), "the cancel ended the wait after {took:?}");
        let left = a.join().expect("the first one");
        assert!(left.is_err_and(|e| e.is_cancelled()));
    });
}
