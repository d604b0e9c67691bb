//! Redis Cluster as its shape changes: a master added and given slots (a node the client
//! has never seen), a master emptied and removed (`CLUSTER FORGET`, then stopped), every
//! seed gone while the masters the client learned of live. Locks, renewals, waiters and
//! listings follow the slots; nothing keeps talking to a node that left.

use std::time::{Duration, Instant};

use redbaton::{LockClient, LockGuard, Unlocked};
use redbaton_testkit::cluster::Cluster;
use redbaton_testkit::keys::Keys;
use redbaton_testkit::server::RedisServer;
use redbaton_testkit::wait::{wait_for, wait_until};
use redbaton_testkit::{init_log, lock_client, ms, secs, timed_waiter};

const KEYS: Keys = Keys::DEFAULT;
/// The clients' connect, read and write timeout.
const IO: Duration = Duration::from_secs(1);

/// The port of the master serving `name`'s lock.
fn master_of_name(cluster: &Cluster, name: &str) -> u16 {
    cluster.owner(slot_of(cluster, name))
}

fn slot_of(cluster: &Cluster, name: &str) -> u16 {
    cluster.keyslot(&KEYS.lock_bytes(name.as_bytes()))
}

/// `name` held by one client with `lease`, and awaited by another (patient: only a
/// wake-up ends its wait soon) once its subscriber is connected to the master on port `on`.
struct Contended {
    holder: LockClient,
    patient: LockClient,
    guard: LockGuard,
    waiting: std::thread::JoinHandle<Instant>,
}

fn contended(cluster: &Cluster, name: &str, lease: Duration, on: u16) -> Contended {
    let holder = lock_client!(cluster(cluster.seed_urls()), io_timeouts(IO), lease(lease));
    let patient = lock_client!(cluster(cluster.seed_urls()), io_timeouts(IO), patient());
    let guard = holder.lock(name).expect("lock");
    let waiting = timed_waiter!(&patient, name, secs(20));
    wait_for(secs(10), "the waiter's subscriber connected", || {
        connections_named(cluster.server(on), "redbaton:sub") > 0
    });
    Contended {
        holder,
        patient,
        guard,
        waiting,
    }
}

/// Releases `guard`, held longer than its lease since its slot moved to the master on port
/// `on`: only renewals sent there kept it. The waiter wakes soon after the release.
fn renewed_then_released(guard: LockGuard, waiting: std::thread::JoinHandle<Instant>, on: u16) {
    assert!(!guard.is_lost(), "renewed on {on}");
    let released = Instant::now();
    assert_eq!(guard.unlock().expect("unlock"), Unlocked::Released);
    let got = waiting.join().expect("the waiter");
    let after = got.saturating_duration_since(released);
    assert!(
        after < secs(10),
        "the waiter woke {after:?} after the release on {on}"
    );
}

/// A cluster with a master added (serving no slot yet), and that master's port.
fn grown() -> (Cluster, u16) {
    init_log();
    let mut cluster = Cluster::start();
    let new = cluster.add_master();
    (cluster, new)
}

/// A cluster with a master added, which serves the slot of `name`'s lock: the cluster, the
/// added master's port, the slot, and the port of the master that served it before.
fn grown_for(name: &str) -> (Cluster, u16, u16, u16) {
    let (cluster, new) = grown();
    let slot = slot_of(&cluster, name);
    let old = cluster.owner(slot);
    cluster.move_slot(slot, new);
    (cluster, new, slot, old)
}

/// Each of `clients` sees `name` held on the master on `port`: the first lists it there
/// alone, the second's `inspect` names that master as the node that answered.
fn seen_on(clients: [&LockClient; 2], name: &str, port: u16) {
    // Past the shortest time between two reads of the slot map.
    std::thread::sleep(ms(200));
    let [lister, inspector] = clients;
    let listing = listed(lister);
    assert_eq!(listing, vec![(name.to_owned(), at(port))], "the listing");
    let info = inspector.inspect(name).expect("inspect");
    assert!(info.holder.is_some(), "held: {info:?}");
    assert_eq!(info.node, at(port), "the node that answered");
}

/// The connections named `name` that `server` has open: `redbaton` for a client's pools,
/// `redbaton:sub` for its subscribers.
fn connections_named(server: &RedisServer, name: &str) -> usize {
    let named =
        |c: &std::collections::HashMap<String, String>| c.get("name").is_some_and(|n| n == name);
    server.client_list().iter().filter(|c| named(c)).count()
}

/// The names `client` lists and the nodes it found them on; every item must be an answer.
fn listed(client: &LockClient) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = client
        .locks("")
        .map(|info| {
            let info = info.expect("every listed node answers");
            (String::from_utf8_lossy(&info.name).into_owned(), info.node)
        })
        .collect();
    out.sort();
    out
}

fn at(port: u16) -> String {
    format!("127.0.0.1:{port}/0")
}

/// A cluster with a master added: locks on every master, the new one included once it
/// serves a slot, taken and released with their tokens increasing.
#[test]
fn smoke() {
    let (cluster, new) = grown();
    let name = "smoke";
    let client = lock_client!(cluster(cluster.seed_urls()), io_timeouts(IO));
    let first = client.lock(name).expect("lock").fencing_token();
    cluster.move_slot(slot_of(&cluster, name), new);
    let guard = client.lock(name).expect("lock on the new master");
    assert!(
        guard.fencing_token() > first,
        "tokens increase across the move"
    );
    assert_eq!(guard.unlock().expect("unlock"), Unlocked::Released);
}

/// A lock's slot moves to a master added after the client started (a node it has never
/// seen), while the lock is held with a short lease and a waiter of another client waits
/// on the old master: the renewals go to the new master and keep the lock, the release
/// there frees it and wakes the waiter (not the lease: it waits much longer), and both
/// clients' listings find the names on the new master.
#[test]
fn a_lock_and_its_waiter_follow_their_slot_to_a_new_master() {
    let (cluster, new) = grown();
    let name = "out";
    let old = master_of_name(&cluster, name);
    let Contended {
        holder,
        patient,
        guard,
        waiting,
    } = contended(&cluster, name, secs(2), old);
    let token = guard.fencing_token();
    cluster.move_slot(slot_of(&cluster, name), new);
    // Longer than the lease.
    std::thread::sleep(secs(3));
    let pttl: i64 = redis::cmd("PTTL")
        .arg(KEYS.lock(name))
        .query(&mut cluster.server(new).conn())
        .expect("PTTL");
    assert!(pttl > 0, "the lock lives on the new master (pttl {pttl})");
    for client in [&holder, &patient] {
        let names = listed(client);
        assert!(
            names.contains(&(name.to_owned(), at(new))),
            "listed on the new master {new}: {names:?}"
        );
        assert!(
            names.iter().all(|(_, node)| *node != at(old)),
            "nothing listed on the old master {old}: {names:?}"
        );
    }
    renewed_then_released(guard, waiting, new);
    let again = holder.lock(name).expect("lock again");
    assert!(again.fencing_token() > token, "tokens increase");
}

/// Scale-in: a master that served a lock, with the client's idle connections and its
/// subscriber connected, is emptied and forgotten. Once the client has read the new map
/// it keeps no connection to it, and after it stopped nothing goes there: locks on every
/// master work, listings name no node that is gone and fail on none, and the subscriber
/// does not try to reconnect to it: it ends.
#[test]
fn a_removed_master_keeps_no_connection_and_gets_no_call() {
    let name = "in";
    let (cluster, new, slot, old) = grown_for(name);
    let client = lock_client!(cluster(cluster.seed_urls()), io_timeouts(IO));
    let guard = client.lock(name).expect("lock on the new master");
    let waiting = timed_waiter!(&client, name, secs(20));
    wait_for(secs(10), "the waiter subscribed on the new master", || {
        connections_named(cluster.server(new), "redbaton:sub") > 0
    });
    drop(guard);
    waiting.join().expect("the waiter");
    assert!(connections_named(cluster.server(new), "redbaton") > 0);
    cluster.empty_master(slot, old);
    cluster.forget_master(new);
    let closed = wait_until(secs(15), || {
        drop(client.lock(name).expect("lock on the old master"));
        connections_named(cluster.server(new), "redbaton") == 0
            && connections_named(cluster.server(new), "redbaton:sub") == 0
    });
    let left = cluster.server(new).client_list();
    assert!(
        closed,
        "connections left to the removed master {new}: {left:?}"
    );
    cluster.server(new).kill();
    let names: Vec<String> = (0..30).map(|i| format!("after-{i}")).collect();
    let guards: Vec<_> = names
        .iter()
        .map(|n| client.lock(n).expect("lock after the removal"))
        .collect();
    let listing = listed(&client);
    assert_eq!(listing.len(), names.len(), "every held name: {listing:?}");
    assert!(
        listing.iter().all(|(_, node)| *node != at(new)),
        "nothing listed on the removed master: {listing:?}"
    );
    drop(guards);
    let reconnects = |c: &LockClient| {
        c.subscribers()
            .into_iter()
            .filter(|s| s.node == at(new))
            .map(|s| (s.reconnects, s.connected))
            .collect::<Vec<_>>()
    };
    // Its subscriber does not reconnect to it, and ends (see `cluster_subscribers.rs`).
    let before = reconnects(&client);
    assert!(before.iter().all(|(_, connected)| !connected), "{before:?}");
    let ended = wait_until(secs(10), || {
        let now = reconnects(&client);
        assert!(
            now.iter().all(|r| before.contains(r)),
            "the subscriber leaves the removed master alone: {before:?}, then {now:?}"
        );
        now.is_empty()
    });
    assert!(ended, "the removed master's subscriber ended");
}

/// Scale-in under a waiter: a lock is held on a master added earlier, and a waiter of
/// another client is subscribed there, when the slot is moved back, the master forgotten
/// and stopped. The holder's release reaches the slot's owner now, and the waiter (which
/// would otherwise wait a minute for its re-check) wakes there; nothing is left held.
#[test]
fn a_waiter_follows_its_slot_off_a_removed_master() {
    let name = "off";
    let (cluster, new, slot, old) = grown_for(name);
    let Contended {
        patient,
        guard,
        waiting,
        ..
    } = contended(&cluster, name, secs(3), new);
    cluster.remove_master(slot, old, new);
    // Longer than the lease.
    std::thread::sleep(secs(4));
    renewed_then_released(guard, waiting, old);
    assert!(listed(&patient).is_empty(), "nothing left held");
}

/// The client was given one seed, and that node is removed: every seed is gone while the
/// masters it learned of live. A failover then gives a master's slots to a replica the
/// client never saw: the slot map is read again from the known masters, locks there work,
/// and the listing names the promoted replica and neither the removed node nor the
/// demoted master.
#[test]
fn the_slot_map_is_read_from_known_masters_when_every_seed_is_gone() {
    let (cluster, seed) = grown();
    let client = lock_client!(
        cluster(vec![format!("redis://127.0.0.1:{seed}/")]),
        io_timeouts(IO)
    );
    let name = "seedless";
    drop(client.lock(name).expect("lock"));
    cluster.forget_master(seed);
    cluster.server(seed).kill();
    let old = master_of_name(&cluster, name);
    let new = cluster.failover(old);
    let refreshed = client.stats().slot_refreshes;
    let guard = client.lock(name).expect("lock on the promoted replica");
    wait_for(secs(10), "the slot map read again", || {
        drop(client.lock("elsewhere").expect("lock elsewhere"));
        client.stats().slot_refreshes > refreshed
    });
    let listing = listed(&client);
    assert!(
        listing.contains(&(name.to_owned(), at(new))),
        "listed on the promoted replica {new}: {listing:?}"
    );
    assert!(
        listing
            .iter()
            .all(|(_, node)| *node != at(old) && *node != at(seed)),
        "nothing listed on {old} or {seed}: {listing:?}"
    );
    assert_eq!(guard.unlock().expect("unlock"), Unlocked::Released);
}

/// Clients that only list or inspect (they take no lock, so no redirect tells them of a
/// change but their own) while another reshapes the cluster: a master added and given a
/// slot with a lock on it, then emptied, forgotten and stopped. Each listing asks the
/// masters of the cluster as it is: the added master's lock is found, and no node that is
/// gone is asked. `inspect` names the node that answered, the slot's owner now (the old
/// master answered `MOVED`), and is answered there once the master it knew has gone.
#[test]
fn a_listing_follows_a_reshaped_cluster() {
    let (cluster, new) = grown();
    // They read the map while the added master serves nothing.
    let lister = lock_client!(cluster(cluster.seed_urls()), io_timeouts(IO));
    let inspector = lock_client!(cluster(cluster.seed_urls()), io_timeouts(IO));
    assert!(listed(&lister).is_empty());
    let name = "listed";
    let slot = slot_of(&cluster, name);
    let old = cluster.owner(slot);
    cluster.move_slot(slot, new);
    let holder = lock_client!(cluster(cluster.seed_urls()), io_timeouts(IO));
    let guard = holder.lock(name).expect("lock on the new master");
    seen_on([&lister, &inspector], name, new);
    drop(guard);
    cluster.remove_master(slot, old, new);
    let guard = holder.lock(name).expect("lock on the old master");
    seen_on([&lister, &inspector], name, old);
    drop(guard);
}
