//! Multi-locks against real `redis-server`s: several names taken together, all or none,
//! on one node, behind Sentinel and across Redis Cluster masters; a timeout, a cancel or
//! a name held as another kind leaves nothing behind; losing one name loses the guard;
//! two real child processes taking overlapping multi-locks in opposite orders never
//! deadlock and never overlap; bad input is refused before anything is sent. Times are
//! printed (`--nocapture`), never asserted.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use redbaton::{Cancel, Error, LockClient, LostReason, MAX_MULTI_NAMES, Unlocked};
use redbaton_testkit::cluster::Cluster;
use redbaton_testkit::intervals::{self, Recorder, most_at_once};
use redbaton_testkit::keys::{Keys, fence_of, handoff_of};
use redbaton_testkit::sentinel::SentinelGroup;
use redbaton_testkit::server::{RedisServer, start_many};
use redbaton_testkit::wait::{join_within, wait_for};
use redbaton_testkit::{child, child_only, exists, lock_builder, lock_client, ms, secs};
use redbaton_testkit::{init_log, raw_conn, test_server, test_server_and};

const PREFIX: &str = "mt:";
const KEYS: Keys = Keys::new(PREFIX);
/// Generous bounds: liveness, not speed.
const LIVENESS: Duration = Duration::from_secs(20);
/// Rounds of each of the two children of the opposite-order tests: 1,000 in all.
const ROUNDS: usize = 500;

fn client(url: &str) -> LockClient {
    lock_client!(node(url), key_prefix(PREFIX))
}

/// Every key of the prefix but the fence counters, sorted.
fn keys_left(srv: &RedisServer) -> Vec<String> {
    srv.keys_but_fences(&format!("{PREFIX}*"))
}

fn value(srv: &RedisServer, key: &str) -> Option<String> {
    redis::cmd("GET")
        .arg(key)
        .query(&mut srv.conn())
        .expect("GET")
}

#[test]
fn smoke() {
    let (srv, c) = test_server_and(client);
    let guard = c.multi_lock(["a", "b", "c"]).expect("multi-lock");
    let tokens = guard.fencing_tokens();
    let names: Vec<&[u8]> = tokens.iter().map(|(n, _)| *n).collect();
    assert_eq!(names, [&b"a"[..], b"b", b"c"], "in the order given");
    // One token for the whole multi-lock, in every key.
    let token = value(&srv, &KEYS.lock("a")).expect("a is held");
    for name in ["b", "c"] {
        assert_eq!(
            value(&srv, &KEYS.lock(name)).as_deref(),
            Some(token.as_str())
        );
    }
    for (_, t) in &tokens {
        assert!(fence_of(*t) > 0 && handoff_of(*t) == 0, "{t}");
    }
    assert_eq!(guard.fencing_token("b"), Some(tokens[1].1));
    assert!(guard.valid_until() > Instant::now());
    guard.check().expect("held");
    assert!(!guard.is_lost());
    assert!(format!("{guard:?}").contains("MultiGuard"));
    let first = tokens[0].1;
    assert_eq!(guard.unlock().expect("unlock"), Unlocked::Released);
    assert!(keys_left(&srv).is_empty(), "{:?}", keys_left(&srv));
    let again = c.try_multi_lock(["c", "a"]).expect("free again");
    assert!(again.fencing_token("a").expect("a") > first);
}

/// One script for every name on one node: one round trip to take them, one to give them
/// back, with the plain lock and the fair queue alike.
#[test]
fn one_round_trip_each_way_on_one_node() {
    let srv = test_server();
    for fair in [true, false] {
        let c = lock_client!(node(srv.url()), key_prefix(PREFIX), fair(fair));
        drop(c.multi_lock(["w0", "w1"]).expect("warm-up"));
        let before = c.stats().commands;
        let guard = c.multi_lock(["a", "b", "c", "d"]).expect("multi-lock");
        assert_eq!(c.stats().commands - before, 1, "fair {fair}: one acquire");
        guard.unlock().expect("unlock");
        assert_eq!(c.stats().commands - before, 2, "fair {fair}: one release");
        assert!(keys_left(&srv).is_empty());
    }
}

/// A name held elsewhere: nothing is taken, not even for a moment that outlives the call,
/// and the waiter's contention marks go with it.
#[test]
fn all_or_nothing_and_a_timeout_leaves_nothing() {
    let srv = test_server();
    let (holder, c) = (client(&srv.url()), client(&srv.url()));
    let held = holder.lock("c").expect("lock c");
    let before = keys_left(&srv);
    let e = c.try_multi_lock(["a", "b", "c"]).unwrap_err();
    assert!(e.is_would_block(), "{e:?}");
    assert_eq!(keys_left(&srv), before);
    let asked = Instant::now();
    let e = c.try_multi_lock_for(["a", "b", "c"], ms(300)).unwrap_err();
    eprintln!("timed out after {:?}", asked.elapsed());
    assert!(e.is_timeout(), "{e:?}");
    assert_eq!(keys_left(&srv), before, "nothing taken, no mark left");
    assert!(c.stats().timeouts >= 1);
    drop(held);
    let guard = c
        .try_multi_lock_for(["a", "b", "c"], LIVENESS)
        .expect("free now");
    drop(guard);
    assert!(keys_left(&srv).is_empty());
}

/// A waiter wakes on the release of the last name it waits for (not on a timer), and its
/// tokens are above the holders'.
#[test]
fn waits_for_every_name_and_wakes_on_release() {
    let srv = test_server();
    let (holder, c) = (client(&srv.url()), client(&srv.url()));
    let a = holder.lock("a").expect("a").detach();
    let b = holder.lock("b").expect("b").detach();
    let (ta, tb) = (a.fencing_token(), b.fencing_token());
    thread::scope(|s| {
        let waiter = s.spawn(|| {
            let g = c.multi_lock(["a", "b", "x"]).expect("multi-lock");
            (
                Instant::now(),
                g.fencing_tokens().iter().map(|t| t.1).collect::<Vec<_>>(),
            )
        });
        thread::sleep(ms(200));
        a.unlock().expect("unlock a");
        thread::sleep(ms(200));
        assert!(!waiter.is_finished(), "it took the names while b was held");
        let released = Instant::now();
        b.unlock().expect("unlock b");
        wait_for(LIVENESS, "the waiter", || waiter.is_finished());
        let (got, tokens) = waiter.join().expect("waiter");
        eprintln!("release to multi-lock: {:?}", got - released);
        assert!(tokens[0] > ta && tokens[1] > tb, "{tokens:?}");
    });
    let s = c.stats();
    assert!(s.wakeups_event >= 1, "woken by events: {s:?}");
    assert!(keys_left(&srv).is_empty());
}

/// Deleting one name's key loses the guard: the watchdog's next renewal says so.
#[test]
fn losing_one_name_loses_the_guard() {
    let srv = test_server();
    let c = lock_client!(node(srv.url()), key_prefix(PREFIX), lease(ms(600)));
    let guard = c.multi_lock(["a", "b", "c"]).expect("multi-lock");
    let _: i64 = redis::cmd("DEL")
        .arg(KEYS.lock("b"))
        .query(&mut srv.conn())
        .expect("DEL");
    let reason = guard.lost().recv_timeout(LIVENESS).expect("a lost signal");
    assert_eq!(reason, LostReason::Deleted);
    assert!(guard.is_lost());
    assert!(matches!(
        guard.check(),
        Err(Error::Lost(LostReason::Deleted))
    ));
    // The names still held stay held (and renewed) until the guard goes.
    thread::sleep(ms(700));
    assert!(exists(&mut srv.conn(), KEYS.lock("a")));
    assert_eq!(guard.unlock().expect("unlock"), Unlocked::Expired);
    assert!(keys_left(&srv).is_empty());
}

/// The watchdog renews every name: held well past the lease.
#[test]
fn every_name_is_renewed() {
    let srv = test_server();
    let c = lock_client!(node(srv.url()), key_prefix(PREFIX), lease(ms(300)));
    let guard = c.multi_lock(["a", "b"]).expect("multi-lock");
    thread::sleep(ms(1200));
    guard.check().expect("still held");
    for name in ["a", "b"] {
        assert!(exists(&mut srv.conn(), KEYS.lock(name)), "{name}");
    }
    assert_eq!(guard.unlock().expect("unlock"), Unlocked::Released);
}

#[test]
fn bad_input_is_refused_before_anything_is_sent() {
    let (srv, c) = test_server_and(client);
    let sent = || c.stats().commands;
    let before = sent();
    let none: [&str; 0] = [];
    let too_many: Vec<String> = (0..=MAX_MULTI_NAMES).map(|i| format!("n{i}")).collect();
    let long = vec![b'x'; redbaton::MAX_NAME_LEN + 1];
    let cases: Vec<(&str, Error)> = vec![
        ("empty", c.multi_lock(none).unwrap_err()),
        ("twice", c.multi_lock(["a", "b", "a"]).unwrap_err()),
        (
            "too many",
            c.try_multi_lock_for(&too_many, secs(1)).unwrap_err(),
        ),
        ("empty name", c.try_multi_lock(["a", ""]).unwrap_err()),
        (
            "long name",
            c.try_multi_lock([&b"a"[..], &long]).unwrap_err(),
        ),
    ];
    for (what, e) in &cases {
        eprintln!("{what}: {e}");
        assert!(e.is_invalid_input(), "{what}: {e:?}");
    }
    for (what, e) in &cases[..3] {
        assert!(matches!(e, Error::InvalidArgument(_)), "{what}: {e:?}");
    }
    // Exactly the most accepted is fine.
    let most = c
        .multi_lock(&too_many[..MAX_MULTI_NAMES])
        .expect("64 names");
    assert_eq!(most.fencing_tokens().len(), MAX_MULTI_NAMES);
    drop(most);
    let after_bad = sent();
    assert_eq!(
        after_bad - before,
        2,
        "only the 64 names were sent (taken, released)"
    );
    assert!(keys_left(&srv).is_empty());
    // A name held by this very thread: waiting would wait for itself.
    let mine = c.lock("a").expect("lock");
    assert!(matches!(
        c.multi_lock(["b", "a"]),
        Err(Error::WouldDeadlock)
    ));
    drop(mine);
    assert_eq!(
        sent() - after_bad,
        2,
        "the lock's own acquire and release only"
    );
    // A name held as another kind of lock: nothing taken.
    let permit = c.semaphore("s", 2).acquire().expect("permit");
    let e = c.try_multi_lock_for(["a", "s"], secs(1)).unwrap_err();
    assert!(e.is_wrong_kind(), "{e:?}");
    assert_eq!(keys_left(&srv), [KEYS.lock("s")]);
    drop(permit);
    assert!(keys_left(&srv).is_empty());
}

#[test]
fn a_cancelled_wait_leaves_nothing() {
    let srv = test_server();
    let (holder, c) = (client(&srv.url()), client(&srv.url()));
    let held = holder.lock("b").expect("b");
    let before = keys_left(&srv);
    let cancel = Cancel::new();
    thread::scope(|s| {
        let waiter = s.spawn(|| c.multi_lock_cancellable(["a", "b"], &cancel).map(drop));
        thread::sleep(ms(200));
        assert!(!waiter.is_finished());
        let at = Instant::now();
        cancel.cancel();
        wait_for(LIVENESS, "the cancelled waiter", || waiter.is_finished());
        eprintln!("cancel to return: {:?}", at.elapsed());
        let e = waiter.join().expect("waiter").unwrap_err();
        assert!(e.is_cancelled(), "{e:?}");
    });
    assert_eq!(keys_left(&srv), before, "no name taken, no mark left");
    drop(held);
    let e = c.multi_lock_cancellable(["a"], &cancel).unwrap_err();
    assert!(e.is_cancelled(), "a cancelled token sends nothing");
}

/// Threads of the multi-lock's own process keep handing a name to each other; the
/// multi-lock's contention marks, which their subscriber does not take for its own, make
/// them give it back in Redis within their fairness budget.
#[test]
fn the_processs_own_threads_make_room() {
    let (srv, c) = test_server_and(client);
    let stop = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = (0..3)
        .map(|_| {
            let (c, stop) = (c.clone(), stop.clone());
            thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let g = c.lock("x").expect("lock x");
                    thread::sleep(ms(1));
                    drop(g);
                }
            })
        })
        .collect();
    thread::sleep(ms(100));
    let asked = Instant::now();
    let guard = c
        .try_multi_lock_for(["x", "y"], LIVENESS)
        .expect("multi-lock");
    eprintln!("multi-lock among local holders after {:?}", asked.elapsed());
    // Its own token: no local thread was handed it.
    let token = value(&srv, &KEYS.lock("x")).expect("x held");
    assert_eq!(value(&srv, &KEYS.lock("y")), Some(token));
    drop(guard);
    stop.store(true, Ordering::Relaxed);
    join_within(workers, LIVENESS, "local workers");
    assert!(keys_left(&srv).is_empty(), "{:?}", keys_left(&srv));
}

/// The guard moves to another thread and is released there; the process's own threads
/// waiting for a name it holds get it after, in Redis.
#[test]
fn the_guard_moves_between_threads() {
    let (_srv, c) = test_server_and(client);
    let guard = c.multi_lock(["a", "b"]).expect("multi-lock");
    let token = guard.fencing_token("a").expect("a");
    let c2 = c.clone();
    let waiter = thread::spawn(move || c2.lock("a").expect("lock a").fencing_token());
    thread::sleep(ms(200));
    assert!(
        !waiter.is_finished(),
        "a local thread took a name the multi-lock holds"
    );
    let outcome = join_within(
        vec![thread::spawn(move || guard.unlock())],
        LIVENESS,
        "unlock",
    );
    assert_eq!(outcome[0].as_ref().expect("unlock"), &Unlocked::Released);
    let next = join_within(vec![waiter], LIVENESS, "waiter")[0];
    assert!(next > token);
}

#[test]
fn redlock_refuses_multi_locks() {
    init_log();
    let servers = start_many(3);
    let c = lock_client!(nodes(servers.iter().map(|s| s.url())), key_prefix(PREFIX));
    let e = c.multi_lock(["a", "b"]).unwrap_err();
    assert!(e.is_unsupported(), "{e:?}");
    for s in &servers {
        assert!(keys_left(s).is_empty());
    }
}

#[test]
fn behind_sentinel() {
    init_log();
    let group = SentinelGroup::start("mt", 1, 3);
    let c = lock_builder!(sentinel("mt", group.sentinel_urls()), key_prefix(PREFIX))
        .build()
        .expect("client");
    let guard = c.multi_lock(["a", "b"]).expect("multi-lock");
    for name in ["a", "b"] {
        assert!(exists(&mut group.master().conn(), KEYS.lock(name)));
    }
    assert_eq!(guard.unlock().expect("unlock"), Unlocked::Released);
    assert!(keys_left(group.master()).is_empty());
}

/// Child: `ROUNDS` multi-locks of `M_NAMES` (comma-separated, in this child's order),
/// each section counted in a shared counter on `M_COUNTER` (which must read 1 inside)
/// and recorded; prints the sections and the longest wait.
#[test]
fn child_multi_locker() {
    child_only!();
    let names = child::env_list("M_NAMES");
    let seeds = child::env_list("M_URLS");
    // A deadlock would show as a timeout here.
    let c = if seeds.len() > 1 {
        lock_client!(cluster(seeds), key_prefix(PREFIX))
    } else {
        client(&seeds[0])
    };
    let mut counter = raw_conn(&child::env("M_COUNTER"));
    let recorder = Recorder::new();
    let mut longest = Duration::ZERO;
    for round in 0..ROUNDS {
        let asked = Instant::now();
        let guard = c
            .try_multi_lock_for(&names, secs(60))
            .unwrap_or_else(|e| panic!("round {round}: {e}"));
        longest = longest.max(asked.elapsed());
        recorder.time("m", || {
            let inside: i64 = redis::cmd("INCR")
                .arg("inside")
                .query(&mut counter)
                .unwrap();
            assert_eq!(inside, 1, "round {round}: two holders at once");
            let _: i64 = redis::cmd("DECR")
                .arg("inside")
                .query(&mut counter)
                .unwrap();
        });
        guard.check().expect("held throughout");
        assert_eq!(guard.unlock().expect("unlock"), Unlocked::Released);
        // A little time outside, so that the other process gets its turns.
        thread::sleep(Duration::from_micros(200 + 100 * (round as u64 % 5)));
    }
    recorder.print();
    child::print_result(&[("longest_wait_ms", longest.as_millis().to_string())]);
}

/// Two child processes on the servers `seeds` (comma-separated), each taking its
/// `names`: 1,000 multi-locks, no two at once, none waiting for ever.
fn opposite_orders(seeds: &str, names: &[&str; 2], counter: &RedisServer) {
    let run = |names: &str| {
        child::spawn_self(
            "child_multi_locker",
            &[
                ("M_NAMES", names.to_owned()),
                ("M_URLS", seeds.to_owned()),
                ("M_COUNTER", counter.url()),
            ],
        )
    };
    let started = Instant::now();
    let children = names.iter().map(|n| run(n)).collect();
    let outs = child::wait_all_ok(children, secs(300));
    eprintln!("1,000 multi-locks in {:?}", started.elapsed());
    let mut all = Vec::new();
    for out in &outs {
        let r = child::result_with(out, "longest_wait_ms");
        eprintln!("child: longest wait {} ms", r["longest_wait_ms"]);
        all.extend(intervals::parse(out));
    }
    assert_eq!(all.len(), 2 * ROUNDS);
    assert_eq!(most_at_once(&all), 1, "two multi-locks overlapped");
}

#[test]
fn opposite_orders_on_one_node() {
    let srv = test_server();
    opposite_orders(&srv.url(), &["a,b,c,d", "d,c,b,e"], &srv);
    assert!(keys_left(&srv).is_empty(), "{:?}", keys_left(&srv));
}

/// On Redis Cluster a multi-lock takes one slot's names at a time. The names are chosen so
/// that ordering the slots by their smallest name would deadlock: `p < r < q` by key,
/// `p` and `q` in one slot, `r` in another; one child takes `{p, q}` then `{r}` that way,
/// the other `{r}` then `{q}`. In slot order both take the same slot first.
#[test]
fn opposite_orders_across_cluster_slots() {
    init_log();
    let cluster = Cluster::start();
    let counter = test_server();
    let (slot, same) = cluster.names_in_one_slot(&KEYS, "same-", 2);
    let (p, q) = (same[0].clone(), same[1].clone());
    let r = format!("{p}~");
    let key = |n: &str| KEYS.lock(n);
    assert!(key(&p) < key(&r) && key(&r) < key(&q), "{p} < {r} < {q}");
    assert_ne!(cluster.keyslot(key(&r).as_bytes()), slot);
    let seeds = cluster.seed_urls().join(",");
    opposite_orders(
        &seeds,
        &[&format!("{p},{q},{r}"), &format!("{r},{q}")],
        &counter,
    );
    for name in [&p, &q, &r] {
        let key = key(name);
        assert!(!exists(&mut cluster.master_of(key.as_bytes()).conn(), &key));
    }
}

/// Names on every master, and names sharing one slot: each lock on its slot's master,
/// one token per slot; one script for a slot's names; a timeout on the last slot gives back
/// the slots taken before it.
#[test]
fn across_cluster_masters() {
    init_log();
    let cluster = Cluster::start();
    let c = lock_client!(cluster(cluster.seed_urls()), key_prefix(PREFIX));
    let names: Vec<String> = (0..12).map(|i| format!("m{i}")).collect();
    let master = |n: &str| cluster.master_of(KEYS.lock(n).as_bytes()).port();
    let masters: std::collections::BTreeSet<u16> = names.iter().map(|n| master(n)).collect();
    assert_eq!(masters.len(), 3, "names on every master");
    let guard = c.multi_lock(&names).expect("multi-lock");
    let mut tokens = std::collections::BTreeSet::new();
    for n in &names {
        let key = KEYS.lock(n);
        let v: Option<String> = redis::cmd("GET")
            .arg(&key)
            .query(&mut cluster.master_of(key.as_bytes()).conn())
            .expect("GET");
        tokens.insert(v.expect("held on its slot's master"));
    }
    let slots: std::collections::BTreeSet<u16> = (names.iter())
        .map(|n| cluster.keyslot(KEYS.lock(n).as_bytes()))
        .collect();
    assert_eq!(tokens.len(), slots.len(), "one token per slot");
    assert_eq!(guard.unlock().expect("unlock"), Unlocked::Released);
    let held = |n: &String| {
        let key = KEYS.lock(n);
        exists(&mut cluster.master_of(key.as_bytes()).conn(), &key)
    };
    assert!(!names.iter().any(held));

    // Four names of one slot: one acquire call.
    let (_, same) = cluster.names_in_one_slot(&KEYS, "same-", 4);
    drop(c.multi_lock(&same).expect("warm-up"));
    let before = c.stats().commands;
    let guard = c.multi_lock(&same).expect("one slot");
    assert_eq!(c.stats().commands - before, 1, "one script for one slot");
    drop(guard);

    // The name of the highest slot held elsewhere: the lower slots are taken, then given
    // back when the call times out.
    let slot = |n: &String| cluster.keyslot(KEYS.lock(n).as_bytes());
    let last = names.iter().max_by_key(|n| slot(n)).expect("names").clone();
    let holder = lock_client!(cluster(cluster.seed_urls()), key_prefix(PREFIX));
    let blocker = holder.lock(&last).expect("lock the last slot's name");
    let e = c.try_multi_lock_for(&names, ms(500)).unwrap_err();
    assert!(e.is_timeout(), "{e:?}");
    let left: Vec<&String> = names.iter().filter(|n| held(n)).collect();
    assert_eq!(left, [&last], "only the other holder's name is held");
    drop(blocker);
    let guard = c.try_multi_lock_for(&names, LIVENESS).expect("free now");
    drop(guard);
    assert!(!names.iter().any(held));
}
