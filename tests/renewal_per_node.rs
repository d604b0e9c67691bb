//! Renewals node by node: a node that hangs holds up the renewals of its own holds only.
//!
//! What the file shows: on Redis Cluster, while one master is paused (SIGSTOP: a renewal
//! sent there waits for the pause to end, or for the read timeout), the holds on the other
//! masters keep their renewal schedule: a hold taken before the pause whose lease an
//! `extend` made short, and a hold taken from a fair queue's grant during the pause (sure
//! only for the grant lease, 1 s, and due for its first renewal a moment later). On
//! Redlock, a node paused under a renewal leaves the holds to the majority that answers.
//!
//! Timing: the client's lease is 3 s (renewed every 200 ms) with a 2.5 s read timeout; the
//! short holds (a 900 ms lease, the 1 s grant) end well before a renewal held up by the
//! paused node could be sent, and the look at them comes 1.5 s into the pause, which ends
//! before the cluster's 2 s node timeout (so no failover begins). The bounds are liveness
//! bounds only.

use std::panic::{self, AssertUnwindSafe};
use std::thread;
use std::time::{Duration, Instant};

use redbaton::{Builder, LockClient, LockGuard};
use redbaton_testkit::cluster::Cluster;
use redbaton_testkit::keys::Keys;
use redbaton_testkit::server::{self, RedisServer};
use redbaton_testkit::wait::wait_for;
use redbaton_testkit::{init_log, lock_builder, ms, pttl, secs};

const KEYS: Keys = Keys::DEFAULT;
/// The client's lease: longer than the read timeout, as the settings require.
const LEASE: Duration = Duration::from_secs(3);
/// The client's read (and connect, write) timeout: longer than any pause here.
const IO: Duration = Duration::from_millis(2500);
/// The lease of the holds that would be lost if their renewals waited for the pause.
const SHORT: Duration = Duration::from_millis(900);
/// How far into the pause the holds are looked at: past a short lease since the pause
/// began.
const LOOK: Duration = Duration::from_millis(1500);

/// Runs `f`, given when the pause began, while `server` is paused (SIGSTOP); resumes the
/// server however `f` ends (a failing assertion too).
fn while_paused<T>(server: &RedisServer, f: impl FnOnce(Instant) -> T) -> T {
    server.pause();
    let out = panic::catch_unwind(AssertUnwindSafe(|| f(Instant::now())));
    server.resume();
    out.unwrap_or_else(|e| panic::resume_unwind(e))
}

/// The settings of every client here: [`LEASE`], [`IO`] timeouts, renewals every 200 ms.
fn client_of(topology: impl FnOnce(Builder) -> Builder) -> LockClient {
    topology(lock_builder!(
        lease(LEASE),
        io_timeouts(IO),
        renew_interval(ms(200))
    ))
    .build()
    .expect("client")
}

/// A name starting with `stem` whose lock is served by the master on `port`.
fn name_on(cluster: &Cluster, stem: &str, port: u16) -> String {
    (0..)
        .map(|i| format!("{stem}-{i}"))
        .find(|n| cluster.owner(cluster.keyslot(&KEYS.lock_bytes(n.as_bytes()))) == port)
        .expect("a name on the master")
}

/// Sleeps until `LOOK` into the pause that began at `began`.
fn sleep_until_look(began: Instant) {
    thread::sleep((began + LOOK).saturating_duration_since(Instant::now()));
}

/// `guard` (of `name`, on `server`) is held: not lost, `check()` OK, and its key still
/// there with a lease left (past a short lease into the pause: it was renewed).
fn assert_held(what: &str, guard: &LockGuard, server: &RedisServer, name: &str, since: Instant) {
    let after = since.elapsed();
    assert!(
        !guard.is_lost(),
        "{what}: lost {after:?} into the pause: {:?}",
        guard.check()
    );
    guard
        .check()
        .unwrap_or_else(|e| panic!("{what}: check {after:?} into the pause: {e}"));
    let left = pttl(&mut server.conn(), KEYS.lock(name));
    assert!(
        left > 0,
        "{what}: key's PTTL {left} {after:?} into the pause"
    );
}

/// Locks on every master held with renewals past a lease.
#[test]
fn smoke() {
    init_log();
    let cluster = Cluster::start();
    let client = client_of(|b| b.cluster(cluster.seed_urls()));
    let guards: Vec<(String, LockGuard)> = cluster
        .masters()
        .iter()
        .map(|m| {
            let name = name_on(&cluster, "smoke", m.port());
            let guard = client.lock(&name).expect("lock");
            guard.extend(SHORT).expect("extend");
            (name, guard)
        })
        .collect();
    thread::sleep(SHORT * 2);
    for (name, guard) in guards {
        guard.check().unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(guard.unlock().expect("unlock").was_held());
    }
}

/// One master paused while the client holds a lock there (its renewal, sent every 200 ms,
/// waits on the paused master) and one on another master, whose lease an `extend` made
/// 900 ms: renewed every 300 ms on its own master meanwhile. A waiter of the client on the
/// healthy master is granted its lock during the pause and takes the grant as the lock:
/// renewed a moment later, not lost when the grant's second runs out. The hold on the
/// paused master outlives the pause (its lease is 3 s): the renewal that waited for its
/// master is applied there once it answers.
#[test]
fn a_paused_master_holds_up_no_renewal_on_the_others() {
    init_log();
    let cluster = Cluster::start();
    let client = client_of(|b| b.cluster(cluster.seed_urls()));
    let other = client_of(|b| b.cluster(cluster.seed_urls()));
    let paused_port = cluster.masters()[0].port();
    let healthy_port = cluster.other_master(paused_port);
    let healthy = cluster.server(healthy_port);
    let stuck_name = name_on(&cluster, "stuck", paused_port);
    let short_name = name_on(&cluster, "short", healthy_port);
    let granted_name = name_on(&cluster, "granted", healthy_port);
    let stuck = client
        .lock(&stuck_name)
        .expect("lock on the master to pause");
    let short = client.lock(&short_name).expect("lock on a healthy master");
    short.extend(SHORT).expect("extend");
    let holder = other
        .lock(&granted_name)
        .expect("the holder before the grant");
    while_paused(cluster.server(paused_port), |began| {
        thread::scope(|s| {
            // The waiter's latest attempt is sent now: the grant comes well within its 1 s.
            let waiter = s.spawn(|| {
                let granted = client
                    .try_lock_for(&granted_name, secs(10))
                    .expect("granted");
                sleep_until_look(began);
                let what = "taken from a grant";
                assert_held(what, &granted, healthy, &granted_name, began);
                assert!(granted.unlock().expect("unlock").was_held(), "{what}");
            });
            let queue = format!("{}:q", KEYS.lock(&granted_name));
            wait_for(secs(10), "the waiter queued", || healthy.zcard(&queue) == 1);
            thread::sleep(ms(100)); // its subscription confirmed, it sleeps
            holder.unlock().expect("the holder's release");
            sleep_until_look(began);
            assert_held("extended to 900 ms", &short, healthy, &short_name, began);
            if let Err(e) = waiter.join() {
                panic::resume_unwind(e);
            }
        });
    });
    assert_eq!(client.stats().grants_trusted, 1, "the grant was the lock");
    // Its master answers again: the renewal that waited is applied there, and settled.
    let paused = cluster.server(paused_port);
    wait_for(secs(10), "the paused master's hold renewed", || {
        pttl(&mut paused.conn(), KEYS.lock(&stuck_name)) > 2000
    });
    stuck.check().expect("the hold on the paused master");
    assert!(stuck.unlock().expect("unlock").was_held());
    assert!(short.unlock().expect("unlock").was_held());
}

/// Redlock over three nodes, one paused under a renewal: a hold whose lease an `extend`
/// made 900 ms is renewed by the two nodes that answer (a majority) on its own schedule.
#[test]
fn a_paused_redlock_node_leaves_the_hold_to_the_majority() {
    init_log();
    let servers = server::start_many(3);
    let urls: Vec<String> = servers.iter().map(RedisServer::url).collect();
    let client = client_of(|b| b.nodes(urls));
    let held = client.lock("held").expect("lock");
    held.extend(SHORT).expect("extend");
    while_paused(&servers[0], |began| {
        sleep_until_look(began);
        assert_held("extended to 900 ms", &held, &servers[1], "held", began);
    });
    assert!(held.unlock().expect("unlock").was_held());
}
