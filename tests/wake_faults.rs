//! Waiters woken by events under faults of the subscriber's connection and of the server's
//! notification settings, and at the edges of what the subscriber maps: a stray `del`,
//! notifications turned off at runtime, the subscriber closed for its output buffer, odd
//! names, hundreds of names, a stopped server. And races of the subscriber's connection:
//! a shutdown while a waiter reads it in the thread's stead, a waiter whose read outlives
//! it (the thread, restarted after a panic, gave up waiting for it), a Redis Cluster key
//! that moves to another master while subscribed there. The re-check and the holders'
//! leases are a minute; every bound below is far under both.

use std::thread;
use std::time::{Duration, Instant};

use redbaton::fault::{self, Point};
use redbaton::{LockClient, Stats, Unlocked};
use redbaton_testkit::cluster::Cluster;
use redbaton_testkit::keys::{DEFAULT_PREFIX, Keys};
use redbaton_testkit::server::RedisServer;
use redbaton_testkit::wait::wait_for;
use redbaton_testkit::{init_log, lock_client, ms, raw_conn, secs, test_server};

/// A wait woken by an event ends within this, however loaded the machine (the re-check
/// and the holders' leases are 60 s).
const WOKEN: Duration = Duration::from_secs(8);
/// How long a waiter may wait in total before it gives up (well under the re-check).
const WAIT: Duration = Duration::from_secs(25);

fn client(srv: &RedisServer) -> LockClient {
    client_under(srv, DEFAULT_PREFIX)
}

/// A client of `srv` whose keys start with `prefix` (a test that injects faults, which act
/// on the clients of one prefix, has a prefix of its own).
fn client_under(srv: &RedisServer, prefix: &str) -> LockClient {
    lock_client!(
        node(srv.url()),
        key_prefix(prefix),
        lease(secs(60)),
        recheck_interval(secs(60)),
        local_handoff(false),
        fair(false)
    )
}

/// A server of its own, and two clients of it: a holder's and a waiter's.
fn server_and_two() -> (RedisServer, LockClient, LockClient) {
    init_log();
    let srv = RedisServer::start();
    let (holder, c) = (client(&srv), client(&srv));
    (srv, holder, c)
}

/// What a waiting thread reports: when it got the lock, and its client's stats then.
type Waiting = crossbeam_channel::Receiver<Result<(Instant, Stats), String>>;

/// A thread of `c` waiting for `name` (up to `WAIT`); it unlocks at once when it has it.
fn waiter(c: &LockClient, name: &[u8]) -> Waiting {
    waiter_for(c, name, WAIT)
}

/// A thread of `c` waiting for `name` (up to `wait`); it unlocks at once when it has it.
fn waiter_for(c: &LockClient, name: &[u8], wait: Duration) -> Waiting {
    let (tx, rx) = crossbeam_channel::bounded(1);
    let (c, name) = (c.clone(), name.to_vec());
    thread::spawn(move || {
        let got = c
            .try_lock_for(&name, wait)
            .map_err(|e| format!("{e:?}"))
            .and_then(|g| {
                let at = Instant::now();
                let s = c.stats();
                g.unlock().map_err(|e| format!("{e:?}"))?;
                Ok((at, s))
            });
        let _ = tx.send(got);
    });
    rx
}

/// A thread of `c` waiting for `name`, once it has failed its attempt and had time to go
/// to sleep. The count it waits for is read before the thread starts: a waiter whose
/// subscription is still there attempts at once, before this thread could read it after.
fn sleeping_waiter(c: &LockClient, name: &[u8]) -> Waiting {
    sleeping_waiter_for(c, name, WAIT)
}

/// [`sleeping_waiter`] waiting up to `wait` in all.
fn sleeping_waiter_for(c: &LockClient, name: &[u8], wait: Duration) -> Waiting {
    let failed = c.stats().failed_attempts;
    let w = waiter_for(c, name, wait);
    asleep(c, failed + 1);
    w
}

/// Waits until `c` has failed `n` attempts in all and its waiters had time to go to
/// sleep.
fn asleep(c: &LockClient, n: u64) {
    wait_for(secs(20), "the waiters to fail and sleep", || {
        c.stats().failed_attempts >= n
    });
    thread::sleep(Duration::from_millis(500));
}

/// `n` names (`<stem>-<i>`) held by one client, each waited for by a thread of another
/// client, asleep.
struct Many {
    c: LockClient,
    guards: Vec<redbaton::LockGuard>,
    waiters: Vec<Waiting>,
}

fn many_waiting(srv: &RedisServer, stem: &str, n: usize) -> Many {
    init_log();
    let (holder, c) = (client(srv), client(srv));
    let names: Vec<String> = (0..n).map(|i| format!("{stem}-{i}")).collect();
    let guards = names
        .iter()
        .map(|n| holder.lock(n).expect("lock"))
        .collect();
    let waiters = names.iter().map(|n| waiter(&c, n.as_bytes())).collect();
    asleep(&c, n as u64);
    Many { c, guards, waiters }
}

impl Many {
    /// Releases every name at once and waits for every waiter: the waiters' client's stats
    /// then, none woken by its re-check or a lease.
    fn released(self) -> Stats {
        let released = Instant::now();
        for g in self.guards {
            assert_eq!(g.unlock().expect("unlock"), Unlocked::Released);
        }
        let mut last = Duration::ZERO;
        for (i, w) in self.waiters.iter().enumerate() {
            let (at, _) = w
                .recv_timeout(secs(15))
                .unwrap_or_else(|_| panic!("waiter {i}: not woken: {:?}", self.c.stats()))
                .expect("the waiter's lock");
            last = last.max(at - released);
        }
        let s = self.c.stats();
        eprintln!(
            "{} waiters woken, the last {last:?} after the first release; {s:?}",
            self.waiters.len()
        );
        by_events(&s);
        s
    }
}

/// Every wake-up of these waits came from an event: none from a re-check or a lease.
fn by_events(s: &Stats) {
    assert_eq!(s.wakeups_recheck + s.wakeups_lease, 0, "{s:?}");
}

/// The lock key of a plain name under the default prefix.
fn lock_key(name: &str) -> String {
    lock_key_under(DEFAULT_PREFIX, name)
}

/// The lock key of a plain name under `prefix`.
fn lock_key_under(prefix: &str, name: &str) -> String {
    format!("{prefix}{{{name}}}")
}

/// A waiter behind a holder is woken by the release's event.
#[test]
fn smoke() {
    init_log();
    let srv = RedisServer::start();
    let (holder, c) = (client(&srv), client(&srv));
    let guard = holder.lock("smoke").expect("lock");
    let waiting = waiter(&c, b"smoke");
    asleep(&c, 1);
    let released = Instant::now();
    guard.unlock().expect("unlock");
    let (at, stats) = waiting
        .recv_timeout(WAIT)
        .expect("reported")
        .expect("the lock");
    assert!(at.duration_since(released) < WOKEN, "woken late");
    assert_eq!(
        stats.wakeups_recheck, 0,
        "woken by the event, not the re-check"
    );
}

/// An operator's `DEL` of the lock key (here `DEL` and `SET` back, so the holder keeps the
/// lock) is a keyspace `del` that no library `r` follows. With keyspace notifications then
/// turned off at runtime (an operator's `CONFIG SET`, which the subscriber does not see),
/// the holder's release sends `r` alone, and that `r` still wakes the waiter: the
/// subscriber pairs an `r` only with the `del` just before it, not with an old one.
#[test]
fn a_stray_del_does_not_swallow_the_next_release() {
    keyspace_off_then_release(true);
}

/// Notifications turned off at runtime (the subscriber still believes them on): the
/// release's `r` alone wakes the waiter.
#[test]
fn keyspace_events_turned_off_at_runtime_release_still_wakes() {
    keyspace_off_then_release(false);
}

fn keyspace_off_then_release(stray_del: bool) {
    let (srv, holder, c) = server_and_two();
    let name = if stray_del {
        "stray-del"
    } else {
        "no-stray-del"
    };
    let guard = holder.lock(name).expect("lock");
    let w = waiter(&c, name.as_bytes());
    asleep(&c, 1);
    let before = c.stats();

    // An operator deletes the key and puts it back (as it was) in one go: a `del` and a
    // `set` for the waiters, the holder keeps its lock.
    let mut conn = raw_conn(&srv.url());
    if stray_del {
        let _: () = redis::cmd("EVAL")
            .arg(
                "local v = redis.call('GET', KEYS[1]) local t = redis.call('PTTL', KEYS[1]) \
             redis.call('DEL', KEYS[1]) redis.call('SET', KEYS[1], v, 'PX', t)",
            )
            .arg(1)
            .arg(lock_key(name))
            .query(&mut conn)
            .expect("del and set back");
        // The waiter woke on the `del`, tried, failed and sleeps again.
        wait_for(secs(20), "the waiter to retry after the del", || {
            c.stats().failed_attempts > before.failed_attempts
        });
        thread::sleep(Duration::from_millis(500));
    }

    // Notifications are turned off at runtime; the release publishes `r` alone.
    srv.config_set("notify-keyspace-events", "");
    let released = Instant::now();
    assert_eq!(guard.unlock().expect("unlock"), Unlocked::Released);
    let got = w
        .recv_timeout(WOKEN)
        .map_err(|_| format!("not woken within {WOKEN:?} of the release: {:?}", c.stats()));
    let (at, s) = got.expect("the waiter").expect("the waiter's lock");
    eprintln!("woken {:?} after the release; {s:?}", at - released);
    by_events(&s);
}

/// The server closes the subscriber's connection for `client-output-buffer-limit pubsub`
/// (a burst of messages): the subscriber reconnects, the waiter re-subscribes and
/// retries, and the release after (racing the reconnect, or after it) still wakes it.
#[test]
fn subscriber_closed_for_its_output_buffer_then_release_wakes() {
    init_log();
    let srv = RedisServer::start();
    srv.config_set("client-output-buffer-limit", "pubsub 64kb 0 0");
    let holder = client(&srv);
    let c = client(&srv);
    for (i, racing) in [(0, false), (1, true)] {
        let name = format!("obuf-{i}");
        let guard = holder.lock(&name).expect("lock");
        let w = sleeping_waiter(&c, name.as_bytes());
        let before = c.stats();
        let subs = srv.subscribers();
        assert_eq!(subs.len(), 1, "one subscriber connection");
        // 40 messages of 8 KB at once on the key's library channel (a shard channel on
        // Redis 7, classic before): more than the buffer's hard limit, and nothing a
        // waiter acts on (`x...` is ignored).
        let publish = if srv.version().at_least(7, 0) {
            "SPUBLISH"
        } else {
            "PUBLISH"
        };
        let _: () = redis::cmd("EVAL")
            .arg(format!(
                "local p = string.rep('x', 8192) for i = 1, 40 do redis.call('{publish}', KEYS[1], p) end"
            ))
            .arg(1)
            .arg(format!("{}:ev", lock_key(&name)))
            .query(&mut raw_conn(&srv.url()))
            .expect("flood");
        if !racing {
            wait_for(secs(20), "the subscriber to reconnect", || {
                c.stats().reconnects > before.reconnects
            });
            wait_for(secs(20), "the waiter to retry after the reconnect", || {
                c.stats().wakeups_reconnect > before.wakeups_reconnect
            });
            thread::sleep(Duration::from_millis(300));
        }
        let released = Instant::now();
        assert_eq!(guard.unlock().expect("unlock"), Unlocked::Released);
        let (at, s) = w
            .recv_timeout(WOKEN)
            .unwrap_or_else(|_| panic!("{name}: not woken within {WOKEN:?}: {:?}", c.stats()))
            .expect("the waiter's lock");
        eprintln!("{name}: woken {:?} after the release; {s:?}", at - released);
        assert!(
            s.reconnects > before.reconnects,
            "{name}: never closed: {s:?}"
        );
        by_events(&s);
    }
}

/// Names whose channel or keyspace event could be mapped to another key (`}`, `{`, an
/// `:ev` ending, a keyspace prefix, NUL, invalid UTF-8, 4,096 bytes): each release wakes
/// its own waiter, at once, and no other.
#[test]
fn odd_names_are_woken_by_their_own_release() {
    let (_srv, holder, c) = server_and_two();
    let names: Vec<Vec<u8>> = vec![
        b"a}b".to_vec(),
        b"}".to_vec(),
        b"{x}".to_vec(),
        b"n:ev".to_vec(),
        b"n".to_vec(),
        b"}n:ev".to_vec(),
        b"}n".to_vec(),
        b"__keyspace@0__:n".to_vec(),
        vec![0, 1, 0],
        vec![0xc3, 0x28, 0xff],
        vec![b'z'; 4096],
    ];
    let guards: Vec<_> = names
        .iter()
        .map(|n| holder.lock(n).expect("lock"))
        .collect();
    let waiters: Vec<_> = names.iter().map(|n| waiter(&c, n)).collect();
    asleep(&c, names.len() as u64);
    for (i, guard) in guards.into_iter().enumerate() {
        let released = Instant::now();
        assert_eq!(guard.unlock().expect("unlock"), Unlocked::Released);
        let (at, _) = waiters[i]
            .recv_timeout(WOKEN)
            .unwrap_or_else(|_| {
                panic!(
                    "name {:?}: not woken within {WOKEN:?}: {:?}",
                    &names[i][..names[i].len().min(20)],
                    c.stats()
                )
            })
            .expect("the waiter's lock");
        eprintln!("name {i}: woken {:?} after its release", at - released);
        for (j, w) in waiters.iter().enumerate().skip(i + 1) {
            assert!(
                w.is_empty(),
                "name {j} got its lock when name {i} was released"
            );
        }
    }
    let s = c.stats();
    by_events(&s);
}

/// Hundreds of names released at once, each with its own waiter thread: every waiter is
/// woken by its event, none by the re-check.
#[test]
fn hundreds_of_names_released_at_once_wake_every_waiter() {
    many_waiting(&RedisServer::start(), "many", 200).released();
}

/// A client dropped while its server is stopped (SIGSTOP) with subscriptions active: the
/// drop returns at once.
#[test]
fn drop_with_a_stopped_server_returns() {
    init_log();
    let srv = RedisServer::start();
    let holder = client(&srv);
    let c = lock_client!(
        node(srv.url()),
        io_timeouts(secs(1)),
        recheck_interval(secs(60)),
        fair(false)
    );
    // Something subscribed (lingering after the wait: 2 s) and the subscriber reading.
    let guard = holder.lock("drop").expect("lock");
    let w = waiter(&c, b"drop");
    asleep(&c, 1);
    drop(guard);
    w.recv_timeout(WOKEN).expect("woken").expect("lock");
    srv.pause();
    let (tx, rx) = crossbeam_channel::bounded(1);
    let started = Instant::now();
    thread::spawn(move || {
        drop(c);
        let _ = tx.send(());
    });
    let took = rx.recv_timeout(secs(30)).map(|_| started.elapsed());
    srv.resume();
    let took = took.expect("drop did not return within 30 s");
    eprintln!("drop took {took:?}");
    assert!(took < secs(8), "drop took {took:?}");
}

/// A name watched again right when its lingering subscription (2 s after its last waiter)
/// is unsubscribed: whichever comes first, the new waiter is subscribed, confirmed, and
/// woken by the release.
#[test]
fn watching_again_as_the_lingering_subscription_goes() {
    let (_srv, holder, c) = server_and_two();
    let name = "linger";
    for offset_ms in [1900u64, 1960, 1990, 2000, 2005, 2010, 2030, 2080] {
        let guard = holder.lock(name).expect("lock");
        let w = sleeping_waiter(&c, name.as_bytes());
        drop(guard);
        w.recv_timeout(WOKEN)
            .expect("woken")
            .expect("the waiter's lock");
        // Its watch is gone: the subscription lingers 2 s, then is unsubscribed.
        let guard = holder.lock(name).expect("lock");
        thread::sleep(Duration::from_millis(offset_ms));
        let w = sleeping_waiter(&c, name.as_bytes());
        let released = Instant::now();
        drop(guard);
        let (at, s) = w
            .recv_timeout(WOKEN)
            .unwrap_or_else(|_| panic!("offset {offset_ms} ms: not woken: {:?}", c.stats()))
            .expect("the waiter's lock");
        eprintln!(
            "offset {offset_ms} ms: woken {:?} after the release",
            at - released
        );
        by_events(&s);
    }
}

/// Waiters of 100 names, the subscriber killed and every name released at once, racing the
/// reconnect: all are woken.
#[test]
fn pubsub_kill_with_waiters_of_many_names_racing_their_releases() {
    init_log();
    const N: usize = 100;
    let srv = RedisServer::start();
    let many = many_waiting(&srv, "kill-many", N);
    let killed = srv.kill_pubsub();
    assert!(killed >= 1);
    let s = many.released();
    assert!(s.reconnects >= 1, "{s:?}");
    by_events(&s);
}

/// Holds `name` for a minute the way another process would: its key, set directly.
fn hold(srv: &RedisServer, prefix: &str, name: &str) {
    let _: () = redis::cmd("SET")
        .arg(lock_key_under(prefix, name))
        .arg("someone-else")
        .arg("PX")
        .arg(60_000)
        .query(&mut srv.conn())
        .expect("set the lock key");
}

/// Frees `name` as an operator would (a keyspace `del`, no library `r`).
fn free(srv: &RedisServer, prefix: &str, name: &str) {
    let _: () = redis::cmd("DEL")
        .arg(lock_key_under(prefix, name))
        .query(&mut srv.conn())
        .expect("del the lock key");
}

/// The waiter got the lock, woken by the event of the key freed just now: well before
/// its deadline, whose last attempt would find the key free too.
fn woken(w: &Waiting) {
    let freed = Instant::now();
    let (at, s) = w.recv_timeout(WAIT).expect("reported").expect("the lock");
    let after = at.saturating_duration_since(freed);
    assert!(
        after < WOKEN,
        "woken {after:?} after the key was freed: {s:?}"
    );
    by_events(&s);
}

/// `shutdown` while a waiter reads the subscriber connection in the thread's stead (the
/// usual case while one waiter sleeps): the thread ends, and so does its connection,
/// although a clone of the client (the waiter's) lives on. The connection had been left
/// in the waiter's hands, still subscribed, for as long as any clone lived.
#[test]
fn shutdown_closes_the_connection_a_waiter_reads() {
    let srv = test_server();
    let c = client_under(&srv, "sd:");
    hold(&srv, "sd:", "k");
    let w = sleeping_waiter_for(&c, b"k", secs(8));
    assert_eq!(srv.subscribers().len(), 1, "the waiter's subscriber");
    c.clone().shutdown(secs(5)).expect("shutdown in time");
    wait_for(secs(5), "the subscriber connection to close", || {
        srv.subscribers().is_empty()
    });
    // The wait goes on, woken only by its timers now.
    let r = w.recv_timeout(secs(30)).expect("reported");
    assert!(r.is_err(), "the key is held for a minute: {r:?}");
    drop(c);
}

/// Stops the next thread of `prefix`'s clients that passes `point` there, and returns
/// once it is stopped.
fn stop_at(prefix: &str, point: Point) {
    fault::stall(prefix, point);
    wait_for(secs(10), "a thread stopped at the fault point", || {
        fault::stalled(prefix, point)
    });
}

/// Lets `srv` accept new clients, or not: then the connections it has now (the
/// harness's own, not listed, included) are all it takes.
fn admit_new_clients(srv: &RedisServer, admit: bool) {
    let most = if admit {
        10_000
    } else {
        srv.client_list().len() + 1
    };
    srv.config_set("maxclients", &most.to_string());
}

/// The subscriber thread panics while a waiter has its connection in hand, and the waiter
/// keeps it past the second the restarted thread waits for it (here stopped at its read;
/// a slow early attempt does the same), while the thread cannot connect again at once.
/// The read it then finishes is on a connection nobody will read after it: it must not
/// subscribe the waiters' keys there (nor count its confirmations), or they count as
/// subscribed while the thread's new connection never subscribes them, and the release
/// wakes nobody.
#[test]
fn a_read_past_a_crash_subscribes_nothing_on_the_dead_connection() {
    const P: &str = "stale-read:";
    let srv = test_server();
    let c = client_under(&srv, P);
    hold(&srv, P, "k");
    let w = sleeping_waiter(&c, b"k");
    // The waiter stops in its read, the connection in hand.
    stop_at(P, Point::WaiterRead);
    admit_new_clients(&srv, false);
    fault::arm(P, Point::Subscriber, 1);
    // The thread panics at its next look, waits a second for its connection, gives up
    // on it, forgets the subscriptions and cannot connect again.
    wait_for(secs(10), "the thread gave up its connection", || {
        c.subscribers().iter().all(|s| !s.connected)
    });
    fault::disarm(P, Point::Subscriber);
    // The waiter reads on, the old connection in hand, and gives it back (dropped).
    fault::disarm(P, Point::WaiterRead);
    thread::sleep(ms(300));
    admit_new_clients(&srv, true);
    wait_for(secs(10), "the restarted thread's connection", || {
        c.subscribers().iter().all(|s| s.connected)
    });
    wait_for(secs(10), "the key subscribed on the new connection", || {
        srv.subscribers().len() == 1
    });
    thread::sleep(ms(300)); // the waiter's retry after the reconnect, and its sleep
    free(&srv, P, "k");
    woken(&w);
}

/// Subscribers of the classic channel `channel` on `srv`.
fn numsub(srv: &RedisServer, channel: &str) -> i64 {
    let (_, n): (String, i64) = redis::cmd("PUBSUB")
        .arg("NUMSUB")
        .arg(channel)
        .query(&mut srv.conn())
        .expect("PUBSUB NUMSUB");
    n
}

/// Redis Cluster: a waiter's key moves to another master, which frees it. Once the
/// key's subscription on the old master has lingered out, nothing of it is left
/// subscribed there: the old master dropped the shard channel itself, and the keyspace
/// channel (classic, which no slot move touches) is ours to unsubscribe. It had been left
/// subscribed, unlisted, until the connection ended. Servers without sharded pub/sub
/// (before Redis 7) drop nothing when a slot moves, so the waiter is not told of the move
/// and keeps its subscriptions where they are (`tests/sharded.rs` shows what it hears
/// then): nothing here applies to them.
#[test]
fn cluster_a_moved_key_leaves_no_subscription_on_its_old_master() {
    init_log();
    let cluster = Cluster::start();
    if !cluster.masters()[0].version().at_least(7, 0) {
        eprintln!("no sharded pub/sub on this server: no moved-slot drop to follow");
        return;
    }
    let c = lock_client!(
        cluster(cluster.seed_urls()),
        io_timeouts(secs(1)),
        lease(secs(60)),
        recheck_interval(secs(60)),
        local_handoff(false),
        fair(false)
    );
    let name = "moving";
    let key = Keys::DEFAULT.lock(name);
    let slot = cluster.keyslot(key.as_bytes());
    let from = cluster.owner(slot);
    let to = cluster.other_master(from);
    let _: () = redis::cmd("SET")
        .arg(&key)
        .arg("someone-else")
        .arg("PX")
        .arg(60_000)
        .query(&mut cluster.server(from).conn())
        .expect("set the lock key");
    let keyspace = format!("__keyspace@0__:{key}");
    let w = sleeping_waiter(&c, name.as_bytes());
    wait_for(
        secs(10),
        "the waiter's subscription on the key's master",
        || numsub(cluster.server(from), &keyspace) == 1,
    );
    let attempts = c.stats().failed_attempts;
    cluster.move_slot(slot, to);
    wait_for(
        secs(10),
        "the waiter's subscription and attempt there",
        || numsub(cluster.server(to), &keyspace) == 1 && c.stats().failed_attempts > attempts,
    );
    thread::sleep(ms(300));
    let _: () = redis::cmd("DEL")
        .arg(&key)
        .query(&mut cluster.server(to).conn())
        .expect("del the lock key");
    woken(&w);
    wait_for(
        secs(10),
        "the old master's subscription to linger out",
        || numsub(cluster.server(from), &keyspace) == 0,
    );
}
