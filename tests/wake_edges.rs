//! The subscriber at its edges: waiters that come and go (by their deadlines) on a few
//! names while those are released, and what stays subscribed once every waiter has left;
//! keyspace notifications turned off and the subscriber reconnected into the library
//! channel's fallback, where a release still wakes and an expiry is noticed at the lease's
//! end; `shutdown` while the server is stopped and a subscribe is on its way; and, in a
//! Redis Cluster, waits that follow their keys to a new master after `shutdown`. The
//! re-check is a minute, so a wake-up lost shows as a wait that does not end.

use std::thread;
use std::time::{Duration, Instant};

use redbaton::{LockClient, Stats, Unlocked};
use redbaton_testkit::cluster::Cluster;
use redbaton_testkit::keys::{DEFAULT_PREFIX, Keys};
use redbaton_testkit::server::RedisServer;
use redbaton_testkit::wait::{join_within, wait_for, wait_until};
use redbaton_testkit::{init_log, lock_client, ms, raw_conn, secs, test_server};

/// A wait woken by an event (or a lease's end) ends within this, however loaded the
/// machine: far under the re-check (60 s).
const WOKEN: Duration = Duration::from_secs(8);
/// Longest wait of a waiter that must get its lock.
const WAIT: Duration = Duration::from_secs(25);

/// A client that waits only on events: re-check and lease a minute.
fn client(srv: &RedisServer) -> LockClient {
    lock_client!(
        node(srv.url()),
        lease(secs(60)),
        recheck_interval(secs(60)),
        local_handoff(false),
        fair(false)
    )
}

/// [`client`]'s settings on `b`, with one-second I/O timeouts: a stopped server fails
/// each call within a second.
fn impatient(b: redbaton::Builder) -> LockClient {
    let second = secs(1);
    b.connect_timeout(second)
        .read_timeout(second)
        .write_timeout(second)
        .lease(secs(60))
        .recheck_interval(secs(60))
        .local_handoff(false)
        .fair(false)
        .build()
        .expect("build a client")
}

/// What a waiting thread reports: when it got the lock, and its client's stats then.
type Waiting = crossbeam_channel::Receiver<Result<(Instant, Stats), String>>;

/// A thread of `c` waiting for `name` up to `wait`; it unlocks at once when it has it.
fn waiter(c: &LockClient, name: &str, wait: Duration) -> Waiting {
    let (tx, rx) = crossbeam_channel::bounded(1);
    let (c, name) = (c.clone(), name.to_owned());
    thread::spawn(move || {
        let got = match c.try_lock_for(&name, wait) {
            Ok(g) => {
                let (at, s) = (Instant::now(), c.stats());
                g.unlock().map(|_| (at, s)).map_err(|e| format!("{e:?}"))
            }
            Err(e) => Err(format!("{e:?}")),
        };
        let _ = tx.send(got);
    });
    rx
}

/// The waiter got its lock within [`WOKEN`] of `since`.
fn got_within(w: &Waiting, since: Instant, what: &str, c: &LockClient) -> Stats {
    let (at, s) = w
        .recv_timeout(WAIT)
        .unwrap_or_else(|_| panic!("{what}: no answer: {:?}", c.stats()))
        .unwrap_or_else(|e| panic!("{what}: {e}: {:?}", c.stats()));
    let after = at.saturating_duration_since(since);
    assert!(after < WOKEN, "{what}: woken {after:?} after: {s:?}");
    s
}

/// Waits until `c` has failed `n` attempts in all, and its waiters had time to sleep.
fn asleep(c: &LockClient, n: u64) {
    wait_for(secs(20), "the waiters to fail and sleep", || {
        c.stats().failed_attempts >= n
    });
    thread::sleep(ms(300));
}

/// Once every waiter and holder has gone, each subscription lingers (2 s) and goes: no
/// connection to `srv` is left subscribed to anything.
fn nothing_subscribed(srv: &RedisServer) {
    let gone = wait_until(secs(10), || srv.subscribers().is_empty());
    assert!(
        gone,
        "still subscribed after every waiter left: {:?}",
        srv.client_list()
            .into_iter()
            .filter(|c| c.get("sub").is_some_and(|n| n != "0")
                || c.get("ssub").is_some_and(|n| n != "0"))
            .collect::<Vec<_>>()
    );
}

/// A waiter behind a holder is woken by the release, and nothing stays subscribed after.
#[test]
fn smoke() {
    let srv = test_server();
    let (holder, c) = (client(&srv), client(&srv));
    let guard = holder.lock("smoke").expect("lock");
    let w = waiter(&c, "smoke", WAIT);
    asleep(&c, 1);
    let released = Instant::now();
    assert_eq!(guard.unlock().expect("unlock"), Unlocked::Released);
    let s = got_within(&w, released, "smoke", &c);
    assert_eq!(s.wakeups_recheck + s.wakeups_lease, 0, "{s:?}");
    nothing_subscribed(&srv);
}

/// Rounds on three names at once: a holder holds the name, waiters with deadlines of a
/// few milliseconds come and leave (their subscriptions asked for, confirmed, given up,
/// lingering) around one waiter that must get it, and the holder releases at a moment
/// among them that differs from round to round. Every waiter that stays is woken by the release (or by a leaver
/// that got the lock and released it), none by the re-check; once all have left,
/// nothing is subscribed on the server.
#[test]
fn waiters_leaving_around_a_release_lose_no_wakeup_and_leave_nothing_subscribed() {
    let srv = test_server();
    let (holder, c) = (client(&srv), client(&srv));
    let rounds = |name: String| {
        let (holder, c) = (holder.clone(), c.clone());
        thread::spawn(move || {
            for round in 0..12u64 {
                let guard = holder.lock(&name).expect("lock");
                let stays = waiter(&c, &name, WAIT);
                let leavers: Vec<Waiting> = (0..6)
                    .map(|i| waiter(&c, &name, ms(1 + (round * 7 + i * 13) % 60)))
                    .collect();
                thread::sleep(ms((round * 17) % 70));
                let released = Instant::now();
                assert_eq!(guard.unlock().expect("unlock"), Unlocked::Released);
                let s = got_within(&stays, released, &format!("{name} round {round}"), &c);
                assert_eq!(s.wakeups_recheck, 0, "{name} round {round}: {s:?}");
                for l in leavers {
                    let _ = l.recv_timeout(WAIT).expect("a leaver's answer");
                }
            }
        })
    };
    let handles: Vec<_> = (0..3).map(|i| rounds(format!("churn-{i}"))).collect();
    join_within(handles, secs(60), "the rounds");
    let s = c.stats();
    eprintln!("{s:?}");
    assert_eq!(s.wakeups_recheck, 0, "{s:?}");
    nothing_subscribed(&srv);
}

/// Keyspace notifications turned off by an operator, and the subscriber's connection
/// lost (here killed) so that it reconnects into the fallback: a client that may not
/// configure notifications then subscribes the library channel alone. Every waiter
/// retries once; the next release's `r` wakes the waiter, and a lock that expires (its
/// holder gone, no release) is noticed at the end of its lease, far before the re-check.
/// Once all have left, nothing is subscribed, the keyspace channel of the first connection
/// included.
#[test]
fn notifications_turned_off_and_a_reconnect_release_and_expiry_still_wake() {
    init_log();
    let srv = RedisServer::builder()
        .config("notify-keyspace-events", "KEA")
        .start();
    let make = || {
        lock_client!(
            node(srv.url()),
            lease(secs(60)),
            recheck_interval(secs(60)),
            configure_notifications(false),
            local_handoff(false),
            fair(false)
        )
    };
    let (holder, c) = (make(), make());
    let guard = holder.lock("off").expect("lock");
    let w = waiter(&c, "off", WAIT);
    asleep(&c, 1);
    let before = c.stats();
    srv.config_set("notify-keyspace-events", "");
    assert!(srv.kill_pubsub() >= 1, "a subscriber connection to kill");
    wait_for(secs(20), "the waiter to retry after the reconnect", || {
        c.stats().wakeups_reconnect > before.wakeups_reconnect
    });
    thread::sleep(ms(300));
    // The library channel alone on each new connection: no keyspace channel.
    let channels = |cl: &std::collections::HashMap<String, String>| {
        let n = |k: &str| cl.get(k).and_then(|v| v.parse::<u32>().ok()).unwrap_or(0);
        n("sub") + n("ssub")
    };
    let list = srv.client_list();
    assert!(
        list.iter().all(|cl| channels(cl) <= 1),
        "a keyspace channel subscribed in the fallback: {list:?}"
    );
    let released = Instant::now();
    assert_eq!(guard.unlock().expect("unlock"), Unlocked::Released);
    let s = got_within(&w, released, "release after the fallback", &c);
    assert_eq!(s.wakeups_recheck, 0, "{s:?}");

    // Another process's hold of 1.5 s that nobody releases.
    let key = format!("{DEFAULT_PREFIX}{{off}}");
    let _: () = redis::cmd("SET")
        .arg(&key)
        .arg("gone")
        .arg("PX")
        .arg(1500)
        .query(&mut raw_conn(&srv.url()))
        .expect("set the lock key");
    let set = Instant::now();
    let w = waiter(&c, "off", WAIT);
    let s = got_within(&w, set, "expiry without notifications", &c);
    assert_eq!(s.wakeups_recheck, 0, "{s:?}");
    drop((holder, c));
    nothing_subscribed(&srv);
}

/// The server stops (SIGSTOP) while a waiter sleeps and another has just asked for a new
/// name's subscription (its `SUBSCRIBE` unanswered): `shutdown` returns within its
/// timeout, and once the server runs again the subscriber's connection is gone.
#[test]
fn shutdown_with_the_server_stopped_returns_and_closes_the_subscriber() {
    let srv = test_server();
    let holder = client(&srv);
    let c = impatient(LockClient::builder().node(srv.url()));
    let _guards = [
        holder.lock("a").expect("lock"),
        holder.lock("b").expect("lock"),
    ];
    let wa = waiter(&c, "a", secs(6));
    asleep(&c, 1);
    srv.pause();
    let wb = waiter(&c, "b", secs(6));
    thread::sleep(ms(100));
    let (tx, rx) = crossbeam_channel::bounded(1);
    let c2 = c.clone();
    let started = Instant::now();
    thread::spawn(move || {
        let _ = tx.send(c2.shutdown(secs(3)));
    });
    let done = rx.recv_timeout(secs(20));
    let took = started.elapsed();
    srv.resume();
    let done = done.expect("shutdown did not return within 20 s");
    eprintln!("shutdown took {took:?}: {done:?}");
    assert!(took < WOKEN, "shutdown took {took:?}");
    for (w, name) in [(wa, "a"), (wb, "b")] {
        let r = w.recv_timeout(secs(30)).expect("the waiter's answer");
        assert!(r.is_err(), "{name} is held for a minute: {r:?}");
    }
    drop(c);
    let closed = wait_until(secs(10), || {
        srv.client_list()
            .iter()
            .all(|cl| cl.get("name").is_none_or(|n| n != "redbaton:sub"))
    });
    assert!(
        closed,
        "a subscriber connection left: {:?}",
        srv.client_list()
    );
}

/// Redis Cluster: waits go on after `shutdown` (woken only by their timers now), a lock's
/// and a multi-lock's, and their keys' master fails over to a replica that no subscriber
/// served. Following the keys there must not start a subscriber (`shutdown` said every
/// thread had stopped, and a new one would hold a connection, subscribed, for as long as
/// a clone of the client lives), nor make the waits spin on attempts with nothing to wait
/// on.
#[test]
fn cluster_waits_that_follow_their_keys_after_shutdown_start_no_subscriber() {
    init_log();
    let cluster = Cluster::start();
    let c = impatient(LockClient::builder().cluster(cluster.seed_urls()));
    let (slot, names) = cluster.names_in_one_slot(&Keys::DEFAULT, "after-shutdown-", 3);
    let from = cluster.owner(slot);
    for name in &names {
        let _: () = redis::cmd("SET")
            .arg(Keys::DEFAULT.lock(name))
            .arg("someone-else")
            .arg("PX")
            .arg(60_000)
            .query(&mut cluster.server(from).conn())
            .expect("set the lock key");
    }
    cluster.wait_replicated(from);
    let wait = secs(8);
    let single = waiter(&c, &names[0], wait);
    let (tx, multi) = crossbeam_channel::bounded(1);
    let (c2, pair) = (c.clone(), names[1..].to_vec());
    thread::spawn(move || {
        let _ = tx.send(c2.try_multi_lock_for(&pair, wait).map(drop));
    });
    asleep(&c, 1);
    thread::sleep(ms(300));
    c.clone().shutdown(secs(5)).expect("shutdown in time");
    // Counted from before the failover: the waits may follow their keys while it ends.
    let redirects = c.stats().redirects;
    let to = cluster.failover(from);
    wait_for(secs(10), "the waits to follow their keys", || {
        c.stats().redirects > redirects
    });
    thread::sleep(ms(300));
    // Nothing wakes the waits but their timers: a few attempts a second at most.
    let (commands, window) = (c.stats().commands, Instant::now());
    thread::sleep(secs(2));
    let sent = c.stats().commands - commands;
    assert!(
        sent < 100,
        "{sent} commands in {:?} after shutdown: {:?}",
        window.elapsed(),
        c.stats()
    );
    let subscribers = cluster.server(to).subscribers();
    assert!(
        subscribers.is_empty(),
        "a subscriber started after shutdown: {:?}",
        cluster.server(to).client_list()
    );
    let r = single.recv_timeout(secs(30)).expect("the waiter's answer");
    assert!(r.is_err(), "the key is held for a minute: {r:?}");
    let r = multi
        .recv_timeout(secs(30))
        .expect("the multi-lock's answer");
    assert!(r.is_err(), "the keys are held for a minute: {r:?}");
}
