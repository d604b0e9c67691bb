//! Redis Cluster: a call's deadline while its lock's slot moves between masters. A
//! command that a migrating slot's source sends on (`ASK`) goes to the target after
//! `ASKING`: two replies in a row within one call, and the second may wait only for what
//! the first left of the call's deadline, not for as long as the call had when it began.

use std::time::{Duration, Instant};

use redbaton_testkit::cluster::{Cluster, announces_ports_at_runtime, slot_port};
use redbaton_testkit::keys::Keys;
use redbaton_testkit::proxy::Proxy;
use redbaton_testkit::wait::wait_for;
use redbaton_testkit::{init_log, lock_client, secs};

const KEYS: Keys = Keys::DEFAULT;
/// How long each reply of the target takes on its way back (its link is slow).
const DELAY: Duration = Duration::from_millis(1000);
/// The deadline of the try: more than one slow reply, less than two.
const DEADLINE: Duration = Duration::from_millis(1100);
/// Slack over the deadline (a busy machine), well short of a second slow reply.
const MARGIN: Duration = Duration::from_millis(600);

/// The slot of `name`'s lock.
fn slot_of(cluster: &Cluster, name: &str) -> u16 {
    cluster.keyslot(&KEYS.lock_bytes(name.as_bytes()))
}

/// A name whose lock the master on `port` serves.
fn name_on(cluster: &Cluster, port: u16) -> String {
    (0..)
        .map(|i| format!("there-{i}"))
        .find(|n| cluster.owner(slot_of(cluster, n)) == port)
        .expect("a name of the master")
}

/// A free lock whose slot is half-way to another master (no key moved yet): the source
/// sends its acquire on (`ASK`), and the target, reached through a slow link, refuses it
/// after `ASKING` (`TRYAGAIN`: the lock's keys are not all there). The `ASKING` reply
/// takes most of the try's deadline: the attempt's own reply is not waited for past it,
/// and the try returns within its deadline (plus a margin), not one slow reply later.
#[test]
fn the_command_after_asking_keeps_the_deadline() {
    if !announces_ports_at_runtime("the_command_after_asking_keeps_the_deadline") {
        return;
    }
    init_log();
    let cluster = Cluster::start();
    let name = "asked";
    let slot = slot_of(&cluster, name);
    let to = cluster.other_master(cluster.owner(slot));
    let there = name_on(&cluster, to);
    // The target announces the proxy, so that the slot map and the redirects name it.
    let proxy = Proxy::start(cluster.server(to).addr());
    cluster
        .server(to)
        .config_set("cluster-announce-port", &proxy.port().to_string());
    wait_for(secs(30), "every node names the proxy", || {
        cluster
            .servers
            .iter()
            .all(|s| slot_port(s, slot_of(&cluster, &there)) == Some(proxy.port()))
    });
    let client = lock_client!(cluster(cluster.seed_urls()), io_timeouts(secs(5)));
    // Connections to both masters, opened while the link is fast.
    let beside = cluster.name_beside(&KEYS, "beside-", slot);
    for n in [&there, &beside] {
        drop(client.lock(n).expect("a lock while nothing moves"));
    }
    assert!(
        proxy.connections_accepted() > 0,
        "the target through the proxy"
    );
    let migration = cluster.open_migration(slot, to);
    proxy.set_delay(DELAY);
    let started = Instant::now();
    let outcome = client.try_lock_for(name, DEADLINE);
    let took = started.elapsed();
    proxy.set_delay(Duration::ZERO);
    let e = outcome.expect_err("nothing can take a free lock of a slot half-way");
    assert!(e.is_timeout() || e.is_slot_migrating(), "{e:?}");
    assert!(
        took < DEADLINE + MARGIN,
        "a try of {DEADLINE:?} returned after {took:?}"
    );
    migration.finish();
    drop(client.lock(name).expect("the lock once the slot moved"));
}
