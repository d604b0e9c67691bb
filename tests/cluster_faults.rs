//! Redis Cluster: the request path under faults. A call's redirects, refusals and
//! failover rides, and the slot map reads they cause, stay within the caller's bound, and
//! what the servers say is read for what it is.

use std::time::{Duration, Instant};

use redbaton::{LockClient, Unlocked};
use redbaton_testkit::cluster::Cluster;
use redbaton_testkit::keys::Keys;
use redbaton_testkit::server::RedisServer;
use redbaton_testkit::{init_log, lock_client, secs};

const KEYS: Keys = Keys::DEFAULT;
/// The clients' read (and connect, write) timeout.
const IO: Duration = Duration::from_secs(1);

/// A cluster and a client of it with [`IO`] timeouts.
fn started() -> (Cluster, LockClient) {
    init_log();
    let cluster = Cluster::start();
    let client = lock_client!(cluster(cluster.seed_urls()), io_timeouts(IO));
    (cluster, client)
}

/// The port of the master serving `name`'s lock.
fn master_of_name(cluster: &Cluster, name: &str) -> u16 {
    cluster.owner(cluster.keyslot(&KEYS.lock_bytes(name.as_bytes())))
}

/// Servers stopped (SIGSTOP) while it lives, resumed when dropped, also by a failing
/// assertion.
struct Paused<'a>(Vec<&'a RedisServer>);

impl<'a> Paused<'a> {
    fn new(servers: Vec<&'a RedisServer>) -> Self {
        servers.iter().for_each(|s| s.pause());
        Paused(servers)
    }
}

impl Drop for Paused<'_> {
    fn drop(&mut self) {
        self.0.iter().for_each(|s| s.resume());
    }
}

/// Locks on every master, taken and released, with their tokens increasing.
#[test]
fn smoke() {
    let (cluster, client) = started();
    let names: Vec<String> = (0..60).map(|i| format!("smoke-{i}")).collect();
    let mut masters: Vec<u16> = names.iter().map(|n| master_of_name(&cluster, n)).collect();
    masters.sort_unstable();
    masters.dedup();
    assert_eq!(masters.len(), 3, "names on every master");
    for name in &names {
        let first = client.lock(name).expect("lock");
        let token = first.fencing_token();
        assert_eq!(first.unlock().expect("unlock"), Unlocked::Released);
        let second = client.try_lock(name).expect("try_lock");
        assert!(second.fencing_token() > token, "{name}: tokens increase");
        drop(second);
    }
}

/// Every master stops answering (SIGSTOP: connections are accepted, nothing is read).
/// A `try_lock_for` of a name there fails by its deadline plus about one read timeout,
/// slot map reads included: after the attempt's timeouts the call path has the map read
/// again, and that read, asking each master and then each seed in turn, must not keep
/// the caller one read timeout per node it asks.
#[test]
fn a_stalled_cluster_keeps_the_callers_deadline() {
    let (cluster, client) = started();
    let name = "stalled";
    drop(client.lock(name).expect("warm-up"));
    let wait = secs(4);
    let took = {
        let _paused = Paused::new(cluster.masters());
        let t = Instant::now();
        let r = client.try_lock_for(name, wait);
        let took = t.elapsed();
        eprintln!("try_lock_for with every master stopped: {r:?} after {took:?}");
        assert!(r.expect_err("no master answers").is_timeout());
        took
    };
    assert!(
        took < wait + 2 * IO,
        "returned {:?} after its deadline",
        took.saturating_sub(wait)
    );
    // Answering again, the cluster serves the name (a replica may have taken over).
    let g = redbaton_testkit::wait::eventually(secs(30), || client.try_lock(name).ok());
    drop(g.expect("the lock once the masters answer"));
}

/// The connections named `name` open on `server`: `redbaton` for the client's pools,
/// `redbaton:sub` for its subscribers.
fn connections_named(server: &RedisServer, name: &str) -> usize {
    let named =
        |c: &std::collections::HashMap<String, String>| c.get("name").is_some_and(|n| n == name);
    server.client_list().iter().filter(|c| named(c)).count()
}

/// The connections of `client`'s pools open on `server`.
fn pooled_connections(server: &RedisServer) -> usize {
    connections_named(server, "redbaton")
}

/// After a failover the old master is a replica and serves no slot: once the slot map has
/// been read again, the client keeps no idle connection to it (a server's `timeout` is 0
/// by default: they would stay open for as long as the client lives).
#[test]
fn no_idle_connection_is_kept_to_a_demoted_master() {
    let (cluster, client) = started();
    let name = "demoted";
    let old = master_of_name(&cluster, name);
    drop(client.lock(name).expect("lock on the master"));
    assert!(pooled_connections(cluster.server(old)) > 0);
    let new = cluster.failover(old);
    // The first lock meets a MOVED; the later ones read the map again.
    let closed = redbaton_testkit::wait::wait_until(secs(10), || {
        drop(client.lock(name).expect("lock on the new master"));
        pooled_connections(cluster.server(old)) == 0
    });
    let left = pooled_connections(cluster.server(old));
    assert!(
        closed,
        "{left} idle connection(s) to the demoted master {old} (now {new}'s replica)"
    );
}

/// A waiter of a name made the client's subscriber connect to its master; after a
/// failover that master is a replica serving no slot, and nothing waits there any more:
/// once the slot map has been read again, the subscriber closes its connection to it
/// rather than keep it (and its `PING`s) for as long as the client lives.
#[test]
fn no_subscriber_connection_is_kept_to_a_demoted_master() {
    let (cluster, client) = started();
    let name = "demoted-sub";
    let old = master_of_name(&cluster, name);
    let guard = client.lock(name).expect("lock on the master");
    std::thread::scope(|s| {
        let waiter = s.spawn(|| drop(client.lock(name).expect("the waiter's lock")));
        let subscribed = redbaton_testkit::wait::wait_until(secs(10), || {
            connections_named(cluster.server(old), "redbaton:sub") > 0
        });
        drop(guard);
        waiter.join().expect("the waiter");
        assert!(subscribed, "the waiter's subscriber connected to {old}");
    });
    let new = cluster.failover(old);
    let closed = redbaton_testkit::wait::wait_until(secs(15), || {
        drop(client.lock(name).expect("lock on the new master"));
        connections_named(cluster.server(old), "redbaton:sub") == 0
    });
    let left = connections_named(cluster.server(old), "redbaton:sub");
    assert!(
        closed,
        "{left} subscriber connection(s) to the demoted master {old} (now {new}'s replica)"
    );
}

/// A slot left `MIGRATING` on its master while the target does not import it (the target
/// failed over half-way through a resharding: `SETSLOT … IMPORTING` is not replicated):
/// the source sends a free lock's acquire to the target (`ASK`), and the target sends it
/// back (`MOVED`), for ever. The redirects never settle; the call gives up after a few
/// hops and says why, as for a slot that stays half-way: `try_lock` and a `lock()` that
/// outlives its window get `SlotMigrating`, never a raw redirect; `try_lock_for` a
/// timeout. Nothing is taken anywhere.
#[test]
fn redirects_that_never_settle_end_as_a_migrating_slot() {
    init_log();
    let cluster = Cluster::start();
    let lease = secs(2);
    let client = lock_client!(cluster(cluster.seed_urls()), io_timeouts(IO), lease(lease));
    let name = "ping-pong";
    let key = KEYS.lock_bytes(name.as_bytes());
    let slot = cluster.keyslot(&key);
    let from = cluster.owner(slot);
    let to = cluster.other_master(from);
    let setslot = |how: &str| {
        let mut cmd = redis::cmd("CLUSTER");
        cmd.arg("SETSLOT").arg(slot).arg(how);
        if how == "MIGRATING" {
            cmd.arg(redbaton_testkit::cluster::node_id(cluster.server(to)));
        }
        cmd.query::<()>(&mut cluster.server(from).conn())
            .unwrap_or_else(|e| panic!("SETSLOT {how}: {e}"));
    };
    setslot("MIGRATING");
    let redirects = client.stats().redirects;
    let r = client.try_lock(name).map(drop);
    eprintln!("try_lock: {r:?}");
    assert!(client.stats().redirects > redirects, "redirected");
    assert!(
        matches!(r, Err(redbaton::Error::SlotMigrating)),
        "try_lock: {r:?}"
    );
    let r = client.try_lock_for(name, secs(1)).map(drop);
    eprintln!("try_lock_for: {r:?}");
    assert!(r.is_err_and(|e| e.is_timeout()));
    let r = client.lock(name).map(drop);
    eprintln!("lock: {r:?}");
    assert!(
        matches!(r, Err(redbaton::Error::SlotMigrating)),
        "lock: {r:?}"
    );
    setslot("STABLE");
    for port in [from, to] {
        let found = cluster.server(port).keys(&KEYS.lock(name));
        assert!(found.is_empty(), "taken on {port}");
    }
    drop(client.lock(name).expect("the lock once the slot is stable"));
}
