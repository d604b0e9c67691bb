//! Multi-locks at their edges: fencing tokens of a name keep growing across multi-locks
//! and plain locks (local handoffs, the fair queue and a server restart included); a name
//! of another kind found while waiting ends the wait with nothing taken and no mark left;
//! the process's own lock holders and a multi-lock exclude each other both ways; a name
//! taken over is reported by `unlock`; a restart, a killed holder and a shutdown during a
//! wait; on Redis Cluster, the slots taken before a failure are given back, their fence
//! counters as they were. Times are printed, never asserted.

use std::sync::mpsc;
use std::thread;
use std::time::Duration;

use redbaton::{Cancel, LockClient, LostReason, Unlocked};
use redbaton_testkit::cluster::Cluster;
use redbaton_testkit::keys::{FenceCount, Keys, fence_of};
use redbaton_testkit::server::RedisServer;
use redbaton_testkit::wait::wait_for;
use redbaton_testkit::{child, exists, lock_client, ms, secs, test_server, test_server_and};

const PREFIX: &str = "me:";
const KEYS: Keys = Keys::new(PREFIX);
/// Generous bounds: liveness, not speed.
const LIVENESS: Duration = Duration::from_secs(20);

fn client(url: &str) -> LockClient {
    lock_client!(node(url), key_prefix(PREFIX))
}

/// Every key of the prefix but the fence counters, sorted.
fn keys_left(srv: &RedisServer) -> Vec<String> {
    srv.keys_but_fences(&format!("{PREFIX}*"))
}

/// The contention mark key of `name` (`p{n}:w`, see the design's key table).
fn mark(name: &str) -> String {
    format!("{}:w", KEYS.lock(name))
}

/// A stranger's hold of `name`: its key holding a foreign token for a minute.
fn stranger_holds(srv: &RedisServer, name: &str) {
    let _: () = redis::cmd("SET")
        .arg(KEYS.lock(name))
        .arg("stranger")
        .arg("PX")
        .arg(60_000)
        .query(&mut srv.conn())
        .expect("SET");
}

/// A Redis Cluster, two clients of it, and six names of `stem` in slot order (the first
/// and the last in different slots).
fn cluster_by_slot(stem: &str) -> (Cluster, LockClient, LockClient, Vec<String>) {
    let cluster = Cluster::start();
    let c = lock_client!(cluster(cluster.seed_urls()), key_prefix(PREFIX));
    let other = lock_client!(cluster(cluster.seed_urls()), key_prefix(PREFIX));
    let slot = |n: &String| cluster.keyslot(KEYS.lock(n).as_bytes());
    let mut names: Vec<String> = (0..6).map(|i| format!("{stem}{i}")).collect();
    names.sort_by_key(slot);
    assert!(slot(&names[0]) < slot(&names[5]), "{names:?}");
    (cluster, c, other, names)
}

#[test]
fn smoke() {
    let (srv, c) = test_server_and(client);
    let guard = c.multi_lock(["x", "y"]).expect("multi-lock");
    assert_eq!(guard.unlock().expect("unlock"), Unlocked::Released);
    assert!(keys_left(&srv).is_empty(), "{:?}", keys_left(&srv));
}

/// The tokens of one name grow across every kind of hold of it: a plain lock handed
/// locally between threads, a multi-lock, a plain lock again, and (fences are made from
/// the server's clock) a multi-lock after a restart that lost every key.
fn tokens_grow(fair: bool) {
    let srv = test_server();
    let c = lock_client!(node(srv.url()), key_prefix(PREFIX), fair(fair));
    let mut last = 0;
    let mut grew = |what: &str, token: u64| {
        assert!(token > last, "{what}: {token} after {last}");
        last = token;
    };
    // A plain lock handed to a local waiter: a handoff token above the first.
    let first = c.lock("a").expect("a");
    grew("lock", first.fencing_token());
    let (tx, rx) = mpsc::channel();
    thread::scope(|s| {
        s.spawn(|| tx.send(c.lock("a").expect("handed").fencing_token()));
        thread::sleep(ms(100));
        drop(first);
        grew(
            "handoff",
            rx.recv_timeout(LIVENESS).expect("the handed token"),
        );
    });
    let multi = c.multi_lock(["b", "a"]).expect("multi");
    grew("multi", multi.fencing_token("a").expect("a"));
    drop(multi);
    grew("lock after multi", c.lock("a").expect("a").fencing_token());
    srv.restart();
    let multi = c.try_multi_lock_for(["a", "b"], LIVENESS).expect("multi");
    let token = multi.fencing_token("a").expect("a");
    grew("multi after restart", token);
    assert!(fence_of(token) > 0);
}

#[test]
fn tokens_of_a_name_grow_across_multi_and_single_holds() {
    tokens_grow(false);
}

#[test]
fn tokens_of_a_name_grow_across_multi_and_fair_holds() {
    tokens_grow(true);
}

/// A multi-lock waits for `a` (held elsewhere), leaving its contention mark there;
/// meanwhile `r` becomes a read-write lock. When `a` is free the wait ends with
/// `WrongKind`: nothing taken, and its mark gone with it.
#[test]
fn a_name_turned_another_kind_while_waiting_ends_the_wait_clean() {
    let srv = test_server();
    let other = client(&srv.url());
    let held = other.lock("a").expect("a");
    let names = ["z", "r", "a"];
    thread::scope(|s| {
        let c = client(&srv.url());
        let waiter = s.spawn(move || c.try_multi_lock_for(names, LIVENESS).map(drop));
        wait_for(LIVENESS, "the waiter's mark", || {
            exists(&mut srv.conn(), mark("a"))
        });
        let write = other.rwlock("r").write().expect("write");
        drop(held);
        let e = waiter.join().expect("waiter").unwrap_err();
        assert!(e.is_wrong_kind(), "{e:?}");
        for name in ["a", "z"] {
            assert!(!exists(&mut srv.conn(), KEYS.lock(name)), "{name} taken");
        }
        assert!(!exists(&mut srv.conn(), mark("a")), "mark left");
        drop(write);
    });
    assert!(keys_left(&srv).is_empty(), "{:?}", keys_left(&srv));
}

/// A plain lock held by one thread of the process keeps a multi-lock of another thread
/// of the same client out (it times out, taking nothing), and the reverse; each gets in
/// once the other lets go.
#[test]
fn the_processs_lock_holders_and_a_multi_lock_exclude_each_other() {
    let (srv, c) = test_server_and(client);
    thread::scope(|s| {
        let (held_tx, held_rx) = mpsc::channel();
        let (go_tx, go_rx) = mpsc::channel::<()>();
        let c = &c;
        let holder = s.spawn(move || {
            let guard = c.lock("b").expect("b");
            held_tx.send(()).expect("send");
            let _ = go_rx.recv();
            drop(guard);
        });
        held_rx.recv_timeout(LIVENESS).expect("b held");
        let e = c.try_multi_lock_for(["a", "b"], ms(300)).unwrap_err();
        assert!(e.is_timeout(), "{e:?}");
        assert!(!exists(&mut srv.conn(), KEYS.lock("a")), "a taken");
        go_tx.send(()).expect("go");
        holder.join().expect("holder");
    });
    let multi = c.try_multi_lock_for(["a", "b"], LIVENESS).expect("free");
    thread::scope(|s| {
        let e = s
            .spawn(|| c.try_lock_for("a", ms(300)).map(drop))
            .join()
            .expect("thread")
            .unwrap_err();
        assert!(e.is_timeout(), "{e:?}");
        let waiter = s.spawn(|| c.try_lock_for("b", LIVENESS).map(|g| g.fencing_token()));
        thread::sleep(ms(100));
        let in_multi = multi.fencing_token("b").expect("b");
        assert_eq!(multi.unlock().expect("unlock"), Unlocked::Released);
        let token = waiter
            .join()
            .expect("waiter")
            .expect("b after the multi-lock");
        assert!(token > in_multi, "{token} after {in_multi}");
    });
    assert!(keys_left(&srv).is_empty(), "{:?}", keys_left(&srv));
}

/// One name is taken over by another holder: the guard is lost, and its
/// `unlock` says `HeldByOther`, releasing the names still its own and leaving the other
/// holder's.
#[test]
fn unlock_says_held_by_other_for_a_name_taken_over() {
    let srv = test_server();
    let c = lock_client!(node(srv.url()), key_prefix(PREFIX), lease(ms(500)));
    let guard = c.multi_lock(["c", "b", "a"]).expect("multi-lock");
    stranger_holds(&srv, "b");
    let reason = guard.lost().recv_timeout(LIVENESS).expect("a lost signal");
    assert!(
        matches!(reason, LostReason::Deleted | LostReason::Stolen),
        "{reason:?}"
    );
    assert!(guard.check().is_err());
    assert_eq!(guard.unlock().expect("unlock"), Unlocked::HeldByOther);
    assert_eq!(keys_left(&srv), [KEYS.lock("b")]);
    let e = c.try_multi_lock_for(["c", "b"], ms(200)).unwrap_err();
    assert!(e.is_timeout(), "{e:?}");
    assert_eq!(keys_left(&srv), [KEYS.lock("b")], "nothing more taken");
}

/// Threads of a fair client keep handing a name to each other; a multi-lock of another
/// client (another process, as Redis sees it) still gets it: its contention marks make the
/// holders give the name back in Redis within their fairness budget, and their own
/// waiters let it go first.
#[test]
fn steady_fair_contention_does_not_starve_a_multi_lock() {
    let srv = test_server();
    let busy = lock_client!(node(srv.url()), key_prefix(PREFIX), fair(true));
    let c = lock_client!(node(srv.url()), key_prefix(PREFIX), fair(true));
    let stop = std::sync::atomic::AtomicBool::new(false);
    thread::scope(|s| {
        for _ in 0..3 {
            s.spawn(|| {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let g = busy.lock("x").expect("lock x");
                    thread::sleep(ms(1));
                    drop(g);
                }
            });
        }
        thread::sleep(ms(100));
        let asked = std::time::Instant::now();
        let got = c.try_multi_lock_for(["x", "y"], secs(10));
        eprintln!(
            "multi-lock among fair holders: {:?} after {:?}",
            got.as_ref().map(|_| ()),
            asked.elapsed()
        );
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        drop(got.expect("multi-lock"));
    });
}

/// Redis Cluster, names in several slots: a name of another kind in the last slot ends
/// the call with `WrongKind`, and a cancel while the last slot is waited for ends it with
/// `Cancelled`; either way the slots taken before are given back.
#[test]
fn cluster_a_later_slot_of_another_kind_or_a_cancel_gives_back_the_earlier() {
    let (cluster, c, other, names) = cluster_by_slot("s");
    let last = names.last().expect("names").clone();
    let held = |n: &String| {
        let key = KEYS.lock(n);
        exists(&mut cluster.master_of(key.as_bytes()).conn(), &key)
    };
    let write = other.rwlock(&last).write().expect("write");
    let e = c.try_multi_lock_for(&names, LIVENESS).unwrap_err();
    assert!(e.is_wrong_kind(), "{e:?}");
    let left: Vec<&String> = names.iter().filter(|n| held(n)).collect();
    assert_eq!(left, [&last], "only the read-write lock's key is there");
    drop(write);

    let blocker = other.lock(&last).expect("the last slot's name");
    let cancel = Cancel::new();
    thread::scope(|s| {
        let waiter = s.spawn(|| c.multi_lock_cancellable(&names, &cancel).map(drop));
        wait_for(LIVENESS, "the earlier slots taken", || held(&names[0]));
        cancel.cancel();
        let e = waiter.join().expect("waiter").unwrap_err();
        assert!(e.is_cancelled(), "{e:?}");
    });
    let left: Vec<&String> = names.iter().filter(|n| held(n)).collect();
    assert_eq!(left, [&last], "only the other holder's name is held");
    drop(blocker);
    drop(c.try_multi_lock_for(&names, LIVENESS).expect("free now"));
}

/// The server restarts without its data, once while a multi-lock waits for a name held
/// by another client, once while a multi-lock holds its names: the waiter gets every
/// name, and the holder's guard is lost, unlocks as `Expired` and leaves nothing behind.
#[test]
fn a_restart_without_data_during_a_wait_and_a_hold() {
    let srv = test_server();
    let c = lock_client!(node(srv.url()), key_prefix(PREFIX), lease(ms(800)));
    let other = lock_client!(node(srv.url()), key_prefix(PREFIX), lease(ms(800)));
    let blocker = other.lock("b").expect("b");
    thread::scope(|s| {
        let waiter = s.spawn(|| c.try_multi_lock_for(["a", "b"], LIVENESS));
        wait_for(LIVENESS, "the waiter's mark", || {
            exists(&mut srv.conn(), mark("b"))
        });
        srv.restart();
        let guard = waiter.join().expect("waiter").expect("every name");
        guard.check().expect("held");
        let e = other.try_lock_for("a", ms(100)).map(drop).unwrap_err();
        assert!(e.is_timeout(), "{e:?}");
        srv.restart();
        let reason = guard.lost().recv_timeout(LIVENESS).expect("a lost signal");
        assert_eq!(reason, LostReason::Deleted);
        assert_eq!(guard.unlock().expect("unlock"), Unlocked::Expired);
    });
    drop(blocker);
    assert!(keys_left(&srv).is_empty(), "{:?}", keys_left(&srv));
}

/// The client is shut down while a multi-lock waits: the wait, once it wins, returns a
/// guard already told it is lost (`WatchdogFailed`, as a plain lock's wait does), having
/// taken its names once; it does not take them again and again as if Redis had lost them.
#[test]
fn a_wait_won_after_a_shutdown_returns_a_guard_told_lost() {
    let srv = test_server();
    let (c, other) = (client(&srv.url()), client(&srv.url()));
    let blocker = other.lock("b").expect("b");
    thread::scope(|s| {
        let waiter = s.spawn(|| c.try_multi_lock_for(["a", "b"], LIVENESS));
        wait_for(LIVENESS, "the waiter's mark", || {
            exists(&mut srv.conn(), mark("b"))
        });
        c.clone().shutdown(LIVENESS).expect("shut down");
        let fences = FenceCount::start(&srv);
        drop(blocker);
        let guard = waiter.join().expect("waiter").expect("a guard");
        assert_eq!(fences.issued(), 2, "one fence per name");
        assert!(guard.is_lost());
        let reason = guard.lost().recv_timeout(LIVENESS).expect("a lost signal");
        assert_eq!(reason, LostReason::WatchdogFailed);
        // Not renewed, but still its own until the lease ends: released.
        assert_eq!(guard.unlock().expect("unlock"), Unlocked::Released);
    });
    assert!(keys_left(&srv).is_empty(), "{:?}", keys_left(&srv));
}

/// Child: holds a multi-lock of `a` and `b` on a short lease until killed.
#[test]
fn child_multi_holder() {
    child::hold_until_killed(|url| {
        let c = lock_client!(node(url), key_prefix(PREFIX), lease(ms(500)));
        c.multi_lock(["a", "b"]).expect("multi-lock")
    });
}

/// A process holding a multi-lock is killed: a waiter of another process gets every name
/// once the lease ends, told that the holds before ended without a release, with tokens
/// above the dead holder's.
#[test]
fn a_killed_holder_leaves_every_name_to_the_next() {
    let srv = test_server();
    let before = client(&srv.url()).lock("a").expect("a").fencing_token();
    let holder = child::spawn_holder("child_multi_holder", srv.url());
    let c = client(&srv.url());
    let e = c.try_multi_lock(["b", "c"]).unwrap_err();
    assert!(e.is_would_block(), "{e:?}");
    child::kill_and_reap(holder);
    let guard = c
        .try_multi_lock_for(["c", "b", "a"], LIVENESS)
        .expect("every name");
    assert!(guard.previous_lost());
    assert!(guard.fencing_token("a").expect("a") > before);
    drop(guard);
    assert!(keys_left(&srv).is_empty(), "{:?}", keys_left(&srv));
}

/// Redis Cluster: a multi-lock of `a` and `b` (a later slot, held elsewhere) takes `a`,
/// waits for `b` and times out. The give-back of `a`, a hold nobody used, is transparent:
/// after a release the next holder of `a` is told of no loss; after a hold of `a` that
/// ended without a release (its key deleted), the next holder is told of it.
#[test]
fn cluster_a_given_back_slot_keeps_the_news_of_a_lost_hold() {
    let (cluster, c, other, names) = cluster_by_slot("n");
    let (a, b) = (names[0].clone(), names[5].clone());
    let blocker = other.lock(&b).expect("b");
    let times_out = || {
        let e = c.try_multi_lock_for([&a, &b], ms(300)).unwrap_err();
        assert!(e.is_timeout(), "{e:?}");
    };
    // After a release, a give-back tells no loss.
    times_out();
    let lost = c.lock(&a).expect("a");
    assert!(!lost.previous_lost(), "a loss told after a release");
    let key = KEYS.lock(&a);
    let _: i64 = redis::cmd("DEL")
        .arg(&key)
        .query(&mut cluster.master_of(key.as_bytes()).conn())
        .expect("DEL");
    drop(lost);
    times_out();
    drop(blocker);
    let next = c.lock(&a).expect("a");
    assert!(next.previous_lost(), "the news of the loss");
}
