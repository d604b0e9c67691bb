//! The operators' view: `inspect` of every kind of name, `locks` over a prefix, and the
//! fence-checked `force_release`, against real `redis-server`s (one node, Redlock,
//! Sentinel, Cluster); the fair queue's waiters are real child processes.

use std::collections::HashSet;

use redbaton::{ForceRelease, HoldKind, LockClient, LockInfo, LockKind};
use redbaton_testkit::cluster::Cluster;
use redbaton_testkit::keys::Keys;
use redbaton_testkit::sentinel::SentinelGroup;
use redbaton_testkit::server::{RedisServer, start_many};
use redbaton_testkit::wait::wait_for;
use redbaton_testkit::{child, child_only, init_log, ms, secs, test_server, test_server_and};
use redbaton_testkit::{lock_builder, lock_client};

const KEYS: Keys = Keys::DEFAULT;

fn client(url: &str) -> LockClient {
    lock_client!(node(url), lease(secs(30)))
}

fn exists(srv: &RedisServer, key: &[u8]) -> bool {
    redis::cmd("EXISTS")
        .arg(key)
        .query(&mut srv.conn())
        .expect("EXISTS")
}

fn names(infos: impl Iterator<Item = redbaton::Result<LockInfo>>) -> HashSet<Vec<u8>> {
    infos.map(|i| i.expect("listing").name).collect()
}

#[test]
fn smoke() {
    let (_srv, c) = test_server_and(client);
    let guard = c.lock("k").expect("lock");
    let info = c.inspect("k").expect("inspect");
    assert_eq!(info.kind, LockKind::Lock);
    assert_eq!(info.name, b"k");
    let holder = info.holder.clone().expect("a holder");
    assert!(holder.mine);
    assert_eq!(holder.fence, Some(guard.fencing_token() >> 12));
    assert_eq!(info.fence, holder.fence);
    assert!(holder.lease_left.expect("a lease") <= secs(30));
    assert!(info.is_held() && !info.is_waited_for());
    assert!(format!("{info:?}").contains("name: \"k\""), "{info:?}");
    guard.unlock().expect("unlock");
    let info = c.inspect("k").expect("inspect");
    assert_eq!(info.kind, LockKind::Free);
    assert!(info.holder.is_none() && !info.is_held());
}

/// A name nobody ever used: free, no fence, nothing waits.
#[test]
fn an_unknown_name_is_free() {
    let (_srv, c) = test_server_and(client);
    let info = c.inspect("never").expect("inspect");
    assert_eq!(info.kind, LockKind::Free);
    assert_eq!(info.fence, None);
    assert!(info.holds.is_empty() && info.queue.is_empty() && info.holder.is_none());
    assert!(!info.is_held() && !info.is_waited_for());
    assert_eq!(
        c.force_release("never", 1).expect("release"),
        ForceRelease::NotHeld
    );
    assert!(c.inspect("").unwrap_err().is_invalid_input());
}

/// Another process's lock is not ours; a lock of this client's is.
#[test]
fn mine_tells_this_clients_holds_apart() {
    let srv = test_server();
    let (a, b) = (client(&srv.url()), client(&srv.url()));
    let _g = a.lock("k").expect("lock");
    assert!(a.inspect("k").unwrap().holder.unwrap().mine);
    assert!(!b.inspect("k").unwrap().holder.unwrap().mine);
}

#[test]
fn read_write_holds_and_waiting_writers() {
    let srv = test_server();
    let (a, b) = (client(&srv.url()), client(&srv.url()));
    let r1 = a.rwlock("rw").read().expect("read");
    let info = a.inspect("rw").expect("inspect");
    assert_eq!(info.kind, LockKind::ReadWrite);
    assert_eq!(info.holds.len(), 1);
    assert_eq!(info.holds[0].kind, HoldKind::Read);
    assert!(info.holds[0].mine && info.holds[0].lease_left.is_some());
    assert!(info.holder.is_none());
    // A writer of another process waits: its mark shows, and holds new readers back.
    std::thread::scope(|s| {
        let writer = s.spawn(|| {
            let w = b.rwlock("rw").write().expect("write");
            let token = w.fencing_token();
            let info = b.inspect("rw").expect("inspect");
            drop(w);
            (token, info)
        });
        wait_for(secs(20), "the writer's mark", || {
            !a.inspect("rw").unwrap().waiting_writers.is_empty()
        });
        let info = b.inspect("rw").expect("inspect");
        assert!(!info.holds[0].mine, "the other process's read");
        assert_eq!(info.waiting_writers.len(), 1, "{info:?}");
        assert!(info.is_waited_for());
        drop(r1);
        let (token, info) = writer.join().unwrap();
        assert_eq!(info.holds.len(), 1);
        assert_eq!(info.holds[0].kind, HoldKind::Write);
        assert!(info.holds[0].mine);
        assert_eq!(info.fence, Some(token >> 12));
    });
}
/// Expired holds are shown as expired, and left where they are: inspect writes nothing.
#[test]
fn a_semaphore_with_expired_holds() {
    let (srv, c) = test_server_and(client);
    let sem = c.semaphore("sem", 3);
    let live = sem.acquire().expect("permit");
    let key = KEYS.lock_bytes(b"sem");
    // A holder that crashed a while ago: its permit expired in the key, not yet dropped.
    let _: i64 = redis::cmd("ZADD")
        .arg(&key)
        .arg(1)
        .arg("p-crashed")
        .query(&mut srv.conn())
        .expect("ZADD");
    let count = || -> i64 {
        redis::cmd("ZCARD")
            .arg(&key)
            .query(&mut srv.conn())
            .expect("ZCARD")
    };
    let before = count();
    let info = c.inspect("sem").expect("inspect");
    assert_eq!(info.kind, LockKind::Semaphore { permits: 3 });
    assert_eq!(info.holds.len(), 2, "{info:?}");
    let expired: Vec<_> = info
        .holds
        .iter()
        .filter(|h| h.lease_left.is_none())
        .collect();
    assert_eq!(expired.len(), 1);
    assert!(!expired[0].mine);
    let mine: Vec<_> = info.holds.iter().filter(|h| h.mine).collect();
    assert_eq!(mine.len(), 1);
    assert_eq!(mine[0].kind, HoldKind::Permit);
    assert!(mine[0].lease_left.is_some());
    assert_eq!(count(), before, "inspect dropped nothing");
    assert!(c.force_release("sem", 1).unwrap_err().is_wrong_kind());
    drop(live);
}

/// Child: waits for the fair lock "fq" (up to `F_WAIT_MS`) and releases it at once.
#[test]
fn child_fair_waiter() {
    child_only!();
    let c = lock_client!(node(child::env("F_URL")), fair(true));
    let wait = ms(child::env("F_WAIT_MS").parse().expect("wait"));
    let g = c.try_lock_for("fq", wait).expect("lock");
    g.unlock().expect("unlock");
    child::print_result(&[("got", "1".to_owned())]);
}

/// Three processes queue in turn: the queue lists them in arrival order (the oldest
/// first), each with time left on its entry.
#[test]
fn a_fair_queue_of_three_processes() {
    let srv = test_server();
    let holder = lock_client!(node(srv.url()), fair(true));
    let guard = holder.lock("fq").expect("lock");
    let queued = || holder.inspect("fq").expect("inspect").queue.len();
    let mut children = Vec::new();
    for n in 1..=3 {
        children.push(child::spawn_self(
            "child_fair_waiter",
            &[("F_URL", srv.url()), ("F_WAIT_MS", "30000".to_owned())],
        ));
        wait_for(secs(20), "the waiter to queue", || queued() == n);
    }
    let info = holder.inspect("fq").expect("inspect");
    assert_eq!(info.queue.len(), 3, "{info:?}");
    let ages: Vec<_> = info.queue.iter().map(|q| q.age).collect();
    let mut oldest_first = ages.clone();
    oldest_first.sort_unstable_by(|a, b| b.cmp(a));
    assert_eq!(ages, oldest_first, "arrival order: {info:#?}");
    assert!(info.queue.iter().all(|q| q.expires_in.is_some()));
    assert!(info.holder.as_ref().unwrap().mine);
    assert!(info.is_waited_for());
    let listed: Vec<LockInfo> = holder.locks("fq").map(|i| i.unwrap()).collect();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].queue.len(), 3);
    guard.unlock().expect("unlock: granted to the first waiter");
    for c in children {
        let out = child::wait_ok(c, secs(30));
        assert_eq!(child::result_with(&out, "got")["got"], "1");
    }
    assert_eq!(holder.inspect("fq").unwrap().kind, LockKind::Free);
}

/// `locks` lists held and waited-for names of every kind, under its own prefix only,
/// names with braces included, and filters by pattern.
#[test]
fn locks_lists_held_names() {
    let (srv, c) = test_server_and(client);
    let other = lock_client!(node(srv.url()), key_prefix("other:"));
    let _a = c.lock("jobs:a").expect("lock");
    let _b = c.lock("jobs:}b{").expect("lock");
    let _r = c.rwlock("jobs:rw").read().expect("read");
    let _p = c.semaphore("pool", 2).acquire().expect("permit");
    let _o = other.lock("jobs:x").expect("lock");
    c.lock("jobs:released")
        .expect("lock")
        .unlock()
        .expect("unlock");
    let all = names(c.locks("*"));
    let want: HashSet<Vec<u8>> = [&b"jobs:a"[..], b"jobs:}b{", b"jobs:rw", b"pool"]
        .iter()
        .map(|n| n.to_vec())
        .collect();
    assert_eq!(
        all, want,
        "released names and other prefixes are not listed"
    );
    assert_eq!(names(c.locks("")), want);
    let jobs = names(c.locks("jobs:*"));
    assert_eq!(jobs.len(), 3);
    assert!(!jobs.contains(b"pool".as_slice()));
    assert_eq!(
        names(c.locks("jobs:}*")),
        HashSet::from([b"jobs:}b{".to_vec()])
    );
    assert_eq!(names(other.locks("*")), HashSet::from([b"jobs:x".to_vec()]));
    // Many names take several pages.
    let guards: Vec<_> = (0..500)
        .map(|i| c.lock(format!("many:{i}")).expect("lock"))
        .collect();
    assert_eq!(names(c.locks("many:*")).len(), 500);
    drop(guards);
}

/// The right fence deletes the lock (its waiters can take it at once), the wrong one
/// changes nothing.
#[test]
fn force_release_checks_the_fence() {
    let srv = test_server();
    let (a, b) = (client(&srv.url()), client(&srv.url()));
    let guard = a.lock("stuck").expect("lock");
    let fence = b.inspect("stuck").unwrap().holder.unwrap().fence.unwrap();
    assert_eq!(
        b.force_release("stuck", fence - 1).expect("refused"),
        ForceRelease::FenceMismatch {
            current: Some(fence)
        }
    );
    assert!(exists(&srv, &KEYS.lock_bytes(b"stuck")), "nothing deleted");
    assert_eq!(
        b.force_release("stuck", fence).expect("released"),
        ForceRelease::Released { nodes: 1 }
    );
    assert!(!exists(&srv, &KEYS.lock_bytes(b"stuck")));
    let next = b.try_lock("stuck").expect("free now");
    let next_fence = next.fencing_token() >> 12;
    assert!(next_fence > fence);
    // The old fence is not the lock's any more.
    assert_eq!(
        a.force_release("stuck", fence).expect("refused"),
        ForceRelease::FenceMismatch {
            current: Some(next_fence)
        }
    );
    drop(guard);
}

/// A waiter sleeping on the lock wakes when it is force-released (the release's `r`).
#[test]
fn force_release_wakes_waiters() {
    let srv = test_server();
    let (a, b) = (client(&srv.url()), client(&srv.url()));
    let _stuck = a.lock("w").expect("lock");
    let fence = a.inspect("w").unwrap().fence.unwrap();
    std::thread::scope(|s| {
        let waiter = s.spawn(|| b.try_lock_for("w", secs(25)).map(|g| g.fencing_token()));
        // Locks are fair by default: the waiter queues.
        wait_for(secs(20), "the waiter to queue", || {
            a.inspect("w").unwrap().is_waited_for()
        });
        assert_eq!(
            a.force_release("w", fence).unwrap(),
            ForceRelease::Released { nodes: 1 }
        );
        assert!(waiter.join().unwrap().expect("woken and locked") >> 12 > fence);
    });
}

/// A key of another type under the prefix is reported, listed, and never modified.
#[test]
fn a_foreign_key_is_reported_not_modified() {
    let (srv, c) = test_server_and(client);
    let key = KEYS.lock_bytes(b"alien");
    let _: i64 = redis::cmd("HSET")
        .arg(&key)
        .arg("f")
        .arg("v")
        .query(&mut srv.conn())
        .expect("HSET");
    let info = c.inspect("alien").expect("inspect");
    assert_eq!(
        info.kind,
        LockKind::Foreign {
            redis_type: "hash".to_owned()
        }
    );
    assert!(info.is_held());
    assert!(c.force_release("alien", 1).unwrap_err().is_wrong_kind());
    assert!(names(c.locks("*")).contains(b"alien".as_slice()));
    let v: String = redis::cmd("HGET")
        .arg(&key)
        .arg("f")
        .query(&mut srv.conn())
        .expect("HGET");
    assert_eq!(v, "v", "untouched");
}

/// Redlock: every master's view; a force release deletes it on each.
#[test]
fn redlock_inspects_every_master() {
    init_log();
    let servers = start_many(3);
    let urls: Vec<String> = servers.iter().map(|s| s.url()).collect();
    let c = lock_client!(nodes(urls.clone()));
    let _g = c.lock("rl").expect("lock");
    let info = c.inspect("rl").expect("inspect");
    assert_eq!(info.nodes.len(), 3, "{info:?}");
    assert!(info.unreachable.is_empty());
    assert!(info.nodes.iter().all(|n| n.kind == LockKind::Lock));
    assert!(info.nodes.iter().all(|n| n.holder.as_ref().unwrap().mine));
    let fence = info.holder.unwrap().fence.unwrap();
    assert_eq!(names(c.locks("*")), HashSet::from([b"rl".to_vec()]));
    assert_eq!(
        c.force_release("rl", fence).unwrap(),
        ForceRelease::Released { nodes: 3 }
    );
}

#[test]
fn sentinel_inspects_the_master() {
    init_log();
    let group = SentinelGroup::start("inspect", 1, 3);
    let c = lock_builder!(
        sentinel("inspect", group.sentinel_urls()),
        io_timeouts(ms(1000))
    )
    .build()
    .expect("build");
    let g = c.lock("s").expect("lock");
    let info = c.inspect("s").expect("inspect");
    assert_eq!(info.kind, LockKind::Lock);
    assert!(info.nodes.is_empty());
    assert_eq!(info.fence, Some(g.fencing_token() >> 12));
    assert_eq!(names(c.locks("*")), HashSet::from([b"s".to_vec()]));
    let fence = info.fence.unwrap();
    assert_eq!(
        c.force_release("s", fence).unwrap(),
        ForceRelease::Released { nodes: 1 }
    );
}

/// Cluster: each name is read on its slot's master, and `locks` scans every master.
#[test]
fn cluster_inspects_slot_masters_and_lists_all() {
    init_log();
    let cluster = Cluster::start();
    let c = lock_builder!(cluster(cluster.seed_urls()), io_timeouts(ms(1000)))
        .build()
        .expect("build");
    let mut masters = HashSet::new();
    let mut guards = Vec::new();
    let mut want = HashSet::new();
    for i in 0..12 {
        let name = format!("c{i}");
        masters.insert(cluster.master_of(&KEYS.lock_bytes(name.as_bytes())).port());
        guards.push(c.lock(&name).expect("lock"));
        want.insert(name.into_bytes());
    }
    assert!(masters.len() >= 2, "names on several masters");
    for g in &guards {
        let info = c.inspect(g.name()).expect("inspect");
        assert_eq!(info.kind, LockKind::Lock);
        assert!(info.holder.as_ref().unwrap().mine);
        let port = cluster.master_of(&KEYS.lock_bytes(g.name())).port();
        assert!(
            info.node.contains(&port.to_string()),
            "{} on {port}",
            info.node
        );
    }
    assert_eq!(names(c.locks("*")), want);
    // A client that routed nothing yet (as the command line is) lists every master too.
    let fresh = lock_builder!(cluster(cluster.seed_urls()), io_timeouts(ms(1000)))
        .wakeup(redbaton::Wakeup::Polling(ms(500)))
        .build()
        .expect("build");
    assert_eq!(names(fresh.locks("*")), want);
    let fence = c.inspect("c0").unwrap().fence.unwrap();
    assert_eq!(
        c.force_release("c0", fence).unwrap(),
        ForceRelease::Released { nodes: 1 }
    );
    assert_eq!(c.inspect("c0").unwrap().kind, LockKind::Free);
}

/// Without the fair queue, a waiting process leaves a contention mark.
#[test]
fn a_plain_waiter_leaves_a_contention_mark() {
    let srv = test_server();
    let a = lock_client!(node(srv.url()), fair(false));
    let b = lock_client!(node(srv.url()), fair(false));
    let guard = a.lock("m").expect("lock");
    std::thread::scope(|s| {
        let waiter = s.spawn(|| b.lock("m").map(drop));
        wait_for(secs(20), "the waiter's mark", || {
            a.inspect("m").unwrap().contention.is_some()
        });
        let info = a.inspect("m").unwrap();
        assert!(info.is_waited_for() && info.queue.is_empty(), "{info:?}");
        drop(guard);
        waiter.join().unwrap().expect("locked after the release");
    });
}

/// Redlock, three masters: the name is a plain lock on masters 1 and 2 (a majority) and a
/// key of another type on master 3. `force_release` with the right fence deletes the lock
/// where it is held and says so: not `WrongKind`, whose meaning is "nothing deleted".
#[test]
fn redlock_force_release_deletes_the_lock_beside_a_foreign_key() {
    let servers = start_many(3);
    let urls: Vec<String> = servers.iter().map(|s| s.url()).collect();
    let c = lock_client!(nodes(urls), lease(secs(30)));
    let key = KEYS.lock_bytes(b"mixed");
    let _guard = c.lock("mixed").expect("lock on all three");
    let mut m3 = servers[2].conn();
    let () = redis::cmd("DEL").arg(&key).query(&mut m3).unwrap();
    let () = redis::cmd("HSET")
        .arg(&key)
        .arg("f")
        .arg("v")
        .query(&mut m3)
        .unwrap();
    let fence = c
        .inspect("mixed")
        .unwrap()
        .holder
        .and_then(|h| h.fence)
        .expect("fence");
    assert_eq!(
        c.force_release("mixed", fence).expect("released"),
        ForceRelease::Released { nodes: 2 }
    );
    assert!(!exists(&servers[0], &key) && !exists(&servers[1], &key));
    assert!(exists(&servers[2], &key), "the foreign key is left alone");
}

/// A server, two clients (with the fair queue or without), and `name` locked by the first
/// (a holder stuck, say): its guard and fence.
fn stuck_holder(
    fair: bool,
    name: &str,
) -> (
    RedisServer,
    LockClient,
    LockClient,
    redbaton::LockGuard,
    u64,
) {
    let srv = test_server();
    let a = lock_client!(node(srv.url()), fair(fair), lease(secs(30)));
    let b = lock_client!(node(srv.url()), fair(fair), lease(secs(30)));
    let stuck = a.lock(name).expect("lock");
    let fence = stuck.fencing_token() >> 12;
    (srv, a, b, stuck, fence)
}

/// After a force release, the next holder is told the hold before it ended without a
/// release, and gets a higher fence (plain lock, not fair).
#[test]
fn next_holder_after_force_release_is_told_of_the_loss() {
    let (_srv, _a, b, stuck, fence) = stuck_holder(false, "pl");
    assert_eq!(
        b.force_release("pl", fence).unwrap(),
        ForceRelease::Released { nodes: 1 }
    );
    // The stuck holder's release comes afterwards: it must not make the loss look clean.
    drop(stuck);
    let next = b.try_lock("pl").expect("free");
    assert!(next.fencing_token() >> 12 > fence);
    assert!(
        next.previous_lost(),
        "the forced-out hold was never released"
    );
}

/// The same with the fair queue and a waiter queued behind the stuck holder: the queue's
/// head gets the lock, told of the loss, under a higher fence; nothing is left queued.
#[test]
fn fair_waiter_after_force_release_is_told_of_the_loss() {
    let (_srv, a, b, stuck, fence) = stuck_holder(true, "fq");
    std::thread::scope(|s| {
        let waiter = s.spawn(|| {
            b.try_lock_for("fq", secs(20))
                .map(|g| (g.fencing_token() >> 12, g.previous_lost()))
        });
        wait_for(secs(20), "the waiter to queue", || {
            a.inspect("fq").unwrap().queue.len() == 1
        });
        assert_eq!(
            a.force_release("fq", fence).unwrap(),
            ForceRelease::Released { nodes: 1 }
        );
        let (f, lost) = waiter.join().unwrap().expect("woken and locked");
        assert!(f > fence);
        assert!(lost, "the forced-out hold was never released");
    });
    drop(stuck);
    let info = a.inspect("fq").unwrap();
    assert!(info.queue.is_empty(), "{info:?}");
}

/// A stale fence (an earlier holder's) never deletes the current holder's lock, also when
/// the earlier hold ended without a release (its key gone as by expiry: the counter is
/// left held).
#[test]
fn a_stale_fence_never_deletes_the_current_hold() {
    let (srv, _a, b, first, old) = stuck_holder(false, "st");
    let _: () = redis::cmd("DEL")
        .arg(KEYS.lock_bytes(b"st"))
        .query(&mut srv.conn())
        .unwrap();
    let next = b.lock("st").expect("after the hold vanished");
    assert!(next.previous_lost());
    let outcome = b.force_release("st", old).unwrap();
    assert!(
        matches!(outcome, ForceRelease::FenceMismatch { .. }),
        "{outcome:?}"
    );
    assert!(b.inspect("st").unwrap().is_held());
    drop(first);
    assert!(
        b.inspect("st").unwrap().is_held(),
        "the old guard's release spared it"
    );
}

/// A score no mark of this library has (a foreign or damaged key under the prefix: here
/// `-inf` in the waiting writers' set) is read, never a panic (a difference of integers
/// would overflow; the CLI's `status` and `list` would die): that mark is long past.
#[test]
fn inspect_survives_an_infinite_score() {
    let srv = test_server();
    let c = lock_client!(node(srv.url()));
    let mut conn = srv.conn();
    let ww = [KEYS.lock_bytes(b"inf"), b":ww".to_vec()].concat();
    let _: () = redis::cmd("ZADD")
        .arg(&ww)
        .arg("-inf")
        .arg("x")
        .query(&mut conn)
        .unwrap();
    let info = c.inspect("inf").expect("inspect");
    assert!(
        info.waiting_writers.is_empty(),
        "a -inf expiry is long past: {info:?}"
    );
}
