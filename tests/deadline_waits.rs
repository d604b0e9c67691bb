//! A call's deadline against commands that wait, or replies that come late, besides the
//! command the deadline was reckoned for: the replicas' `WAIT` after an acquisition
//! (`replica_ack`), and a Redis Cluster's slot map read again on a caller's way (with
//! `CLUSTER SLOTS` when `CLUSTER SHARDS` is refused).
//!
//! * A `try_lock_for` (or any wait with a deadline) against a replica that does not
//!   acknowledge ends by its deadline (50 ms from its start when the deadline is nearer),
//!   not when the `WAIT` would end: the acquisition counts as too few acknowledgements,
//!   is given back, and the call says `ReplicaAck`.
//! * A call without a deadline (`lock`), or with one far enough, still gives a late
//!   replica the whole acknowledgement timeout.
//! * A slot map read on a caller's way ends by the caller's deadline, and takes one read
//!   timeout at most: when `CLUSTER SHARDS` is refused (a server before Redis 7, or an
//!   ACL that allows only `CLUSTER SLOTS`), the `CLUSTER SLOTS` sent after it waits only
//!   for what the first reply left.
//!
//! Times are generous liveness bounds, never speed claims: each bound lies far from both
//! the deadline and what a wait that ignored it would take (an acknowledgement timeout of
//! 2 s, a second slow reply). Every server is a real `redis-server`; slow replies come
//! from the test support's proxy.

use std::time::Duration;

use redbaton::{Error, LockClient};
use redbaton_testkit::cluster::{Cluster, announces_ports_at_runtime, slot_port};
use redbaton_testkit::keys::Keys;
use redbaton_testkit::proxy::Proxy;
use redbaton_testkit::server::RedisServer;
use redbaton_testkit::wait::wait_for;
use redbaton_testkit::{init_log, lock_client, ms, secs, timed};

/// How long the replicas' `WAIT` may take: far longer than any deadline below.
const ACK_TIMEOUT: Duration = Duration::from_secs(2);
/// The read (and connect, and write) timeout: longer than [`ACK_TIMEOUT`], as it must be.
const IO: Duration = Duration::from_secs(4);
/// What a call whose deadline is nearer than that is given from its start (the library's
/// `MIN_ATTEMPT`).
const LEAST_ATTEMPT: Duration = Duration::from_millis(50);
/// Room for the give-back, the leave and a busy machine after the deadline: far below
/// [`ACK_TIMEOUT`].
const MARGIN: Duration = Duration::from_millis(600);

/// A master with one replica in sync, and a client that asks that replica to
/// acknowledge each acquisition within [`ACK_TIMEOUT`].
fn with_replica() -> (RedisServer, RedisServer, LockClient) {
    init_log();
    let master = RedisServer::start();
    let replica = master.start_replica();
    let client = lock_client!(
        node(master.url()),
        replica_ack(1, ACK_TIMEOUT),
        io_timeouts(IO)
    );
    (master, replica, client)
}

/// `what`, which returned `got` after `took`, took less than `bound`.
fn assert_within<T: std::fmt::Debug>(what: &str, (got, took): &(T, Duration), bound: Duration) {
    eprintln!("{what}: {took:?}: {got:?}");
    assert!(*took < bound, "{what} took {took:?} (at most {bound:?})");
}

/// `what` failed with too few acknowledgements, within `bound` (far below
/// [`ACK_TIMEOUT`]).
fn assert_unacked_within<T: std::fmt::Debug>(
    what: &str,
    outcome: (redbaton::Result<T>, Duration),
    bound: Duration,
) {
    assert_within(what, &outcome, bound);
    assert!(
        matches!(outcome.0, Err(Error::ReplicaAck { wanted: 1, .. })),
        "{what}: {:?}",
        outcome.0
    );
}

/// Nothing of a hold given back stays on `master`: the give-back sent after the deadline
/// does not wait, so it is looked for.
fn assert_nothing_left(master: &RedisServer) {
    wait_for(secs(5), "the holds given back", || {
        master.keys_but_fences("redbaton:*").is_empty()
    });
}

#[test]
fn smoke() {
    let (_master, _replica, client) = with_replica();
    let guard = client.try_lock_for("smoke", secs(5)).expect("acknowledged");
    assert!(guard.unlock().expect("unlock").was_held());
}

/// A replica that acknowledges nothing (its process stopped): `try_lock_for` of 300 ms
/// ends soon after 300 ms with `ReplicaAck`, not after the 2 s the `WAIT` is allowed, and
/// leaves no hold behind; so do a read hold's and a permit's waits. Once the replica is
/// back, the lock is acknowledged again.
#[test]
fn a_deadline_ends_the_wait_for_a_silent_replica() {
    let (master, replica, client) = with_replica();
    let deadline = ms(300);
    let bound = deadline + MARGIN;
    replica.pause();
    let rw = client.rwlock("rw");
    let sem = client.semaphore("sem", 2);
    let tries: [(&str, &dyn Fn() -> redbaton::Result<()>); 3] = [
        ("try_lock_for", &|| {
            client.try_lock_for("k", deadline).map(drop)
        }),
        ("try_read_for", &|| rw.try_read_for(deadline).map(drop)),
        ("try_acquire_for", &|| {
            sem.try_acquire_for(deadline).map(drop)
        }),
    ];
    for (what, attempt) in tries {
        assert_unacked_within(
            &format!("{what}, the replica paused"),
            timed(attempt),
            bound,
        );
    }
    assert_nothing_left(&master);
    replica.resume();
    let guard = client.try_lock_for("k", secs(10)).expect("replica back");
    assert!(guard.unlock().expect("unlock").was_held());
}

/// A deadline nearer than the least a call is given: the acquisition and its `WAIT`
/// share those 50 ms from the call's start, and the call ends soon after them.
#[test]
fn a_deadline_nearer_than_the_least_a_call_is_given_bounds_the_wait() {
    let (master, replica, client) = with_replica();
    replica.pause();
    let got = timed(|| client.try_lock_for("near", ms(10)));
    assert_unacked_within(
        "try_lock_for(10 ms), the replica paused",
        got,
        LEAST_ATTEMPT + MARGIN,
    );
    assert_nothing_left(&master);
    replica.resume();
}

/// A replica that acknowledges late, within the acknowledgement timeout: a call without a
/// deadline, and one whose deadline lies beyond the timeout, wait for it and get the lock.
#[test]
fn a_late_replica_is_waited_for_as_long_as_the_call_allows() {
    let (_master, replica, client) = with_replica();
    type Take<'a> = &'a dyn Fn() -> redbaton::Result<redbaton::LockGuard>;
    let calls: [(&str, Take<'_>); 2] = [
        ("lock", &|| client.lock("late")),
        ("try_lock_for(5 s)", &|| {
            client.try_lock_for("late", secs(5))
        }),
    ];
    for (what, take) in calls {
        replica.pause();
        let resumed = std::thread::scope(|s| {
            s.spawn(|| {
                std::thread::sleep(ms(400));
                replica.resume();
            });
            take()
        });
        let guard =
            resumed.unwrap_or_else(|e| panic!("{what}, the replica back after 400 ms: {e:?}"));
        assert!(guard.unlock().expect("unlock").was_held(), "{what}");
    }
}

// --- a Redis Cluster's slot map -----------------------------------------------------------

/// The read timeout of the cluster's client: what a slot map read on a caller's way may
/// take in all.
const MAP_READ: Duration = Duration::from_secs(2);
/// How late each reply of a master comes while the map is read: more than half of
/// [`MAP_READ`], so that two replies in a row take longer than it.
const SLOW_REPLY: Duration = Duration::from_millis(1800);

/// The user the client logs in as: everything but `CLUSTER SHARDS`, so that the slot map
/// is read with `CLUSTER SLOTS` as on a server before Redis 7.
const SLOTS_ONLY: (&str, &str) = ("slots-only", "slots-only-secret");

/// A name of each master of `cluster` (by its port), read before any master announces
/// another port.
fn a_name_per_master(cluster: &Cluster) -> Vec<(u16, String)> {
    let slot_of = |n: &str| cluster.keyslot(&Keys::DEFAULT.lock_bytes(n.as_bytes()));
    cluster
        .masters()
        .iter()
        .map(|m| {
            let name = (0..)
                .map(|i| format!("map-{i}"))
                .find(|n| cluster.owner(slot_of(n)) == m.port())
                .expect("a name of the master");
            (m.port(), name)
        })
        .collect()
}

/// A stale slot map is read again on the next caller's way, asking the masters one after
/// another. Here every master answers 1.8 s late and refuses `CLUSTER SHARDS` (an ACL).
///
/// * A caller with a deadline of 100 ms gives the read that much (50 ms at least), not
///   the 2 s read timeout: it asks no more masters once its deadline has passed, and the
///   map stays stale for the next route.
/// * A caller with a deadline of 2.5 s gives the read one read timeout in all: the first
///   master asked answers the refusal within it, and the `CLUSTER SLOTS` that follows
///   must not be waited for past it (a second slow reply, 3.6 s in all, past the
///   deadline); the map comes from a seed instead.
#[test]
fn a_slot_map_read_on_a_callers_way_keeps_its_deadline() {
    let test = "a_slot_map_read_on_a_callers_way_keeps_its_deadline";
    if !announces_ports_at_runtime(test) {
        return;
    }
    init_log();
    let cluster = Cluster::start();
    let (user, password) = SLOTS_ONLY;
    for s in &cluster.servers {
        redis::cmd("ACL")
            .arg("SETUSER")
            .arg(user)
            .arg(&["on", &format!(">{password}"), "~*", "&*", "+@all"])
            .arg("-cluster|shards")
            .query::<()>(&mut s.conn())
            .expect("ACL SETUSER");
    }
    let named = a_name_per_master(&cluster);
    // Every master announces a proxy in front of it: the map names the proxies.
    let proxies: Vec<Proxy> = named
        .iter()
        .map(|(port, name)| {
            let proxy = Proxy::start(cluster.server(*port).addr());
            cluster
                .server(*port)
                .config_set("cluster-announce-port", &proxy.port().to_string());
            let slot = cluster.keyslot(&Keys::DEFAULT.lock_bytes(name.as_bytes()));
            wait_for(secs(30), "every node names the proxy", || {
                cluster
                    .servers
                    .iter()
                    .all(|s| slot_port(s, slot) == Some(proxy.port()))
            });
            proxy
        })
        .collect();
    let client = lock_client!(
        cluster(cluster.seed_urls_as(user, password)),
        io_timeouts(MAP_READ),
        wakeup(redbaton::Wakeup::Polling(ms(100)))
    );
    // A connection to each master, used a moment ago: none is checked first for having
    // lain idle.
    for (_, name) in &named {
        drop(client.lock(name).expect("a lock while the links are fast"));
    }
    // A connection that dies under a call makes the map stale: read again at the next
    // route.
    proxies[0].kill_all();
    drop(
        client
            .lock(&named[0].1)
            .expect("a lock sent again on a new connection"),
    );
    // Past the shortest time between two reads of the map.
    std::thread::sleep(ms(200));
    for p in &proxies {
        p.set_delay(SLOW_REPLY);
    }
    let short = ms(100);
    let outcome = timed(|| client.try_lock_for(&named[1].1, short).map(drop));
    let what = format!("a {short:?} call on a stale map, replies {SLOW_REPLY:?} late");
    assert_within(&what, &outcome, secs(1));
    // A deadline beyond the first slow reply, within the second: the map read that
    // follows the refused `CLUSTER SHARDS` must end with the read timeout, so that the
    // call keeps its deadline (waiting for the second slow reply, it would end with it).
    std::thread::sleep(ms(200));
    let refreshed = client.stats().slot_refreshes;
    let deadline = ms(2_500);
    let outcome = timed(|| client.try_lock_for(&named[1].1, deadline).map(drop));
    for p in &proxies {
        p.heal();
    }
    assert!(
        client.stats().slot_refreshes > refreshed,
        "the call read the map: {outcome:?}"
    );
    let what = format!(
        "a {deadline:?} call that read the map (read timeout {MAP_READ:?}), replies \
         {SLOW_REPLY:?} late"
    );
    assert_within(&what, &outcome, deadline + ms(600));
}
