//! The subscriber threads of a Redis Cluster client while the cluster changes shape. A
//! client has one per master its locks are routed to, not one per master it ever met: a
//! master that stops serving (removed, or demoted by a failover) takes its subscriber
//! with it once nothing waits there, a master that serves again at the same address gets
//! a fresh one for its next waiter, and `subscribers()` lists the live ones only. A waiter
//! that took its master's subscriber just as it ended follows on to a fresh one. A local
//! queue that outlives its key's master keeps the key subscribed where it is served now.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use redbaton::fault::{self, Point};
use redbaton::{LockClient, Unlocked};
use redbaton_testkit::cluster::Cluster;
use redbaton_testkit::keys::Keys;
use redbaton_testkit::server::RedisServer;
use redbaton_testkit::wait::{join_all, wait_for, wait_until};
use redbaton_testkit::{init_log, lock_client, ms, secs, timed_waiter};

const KEYS: Keys = Keys::DEFAULT;
/// The clients' connect, read and write timeout.
const IO: Duration = Duration::from_secs(1);
/// The masters of a [`Cluster`] at start.
const MASTERS: usize = 3;
/// How long a subscriber whose master left may take to end: the keys of the waiters that
/// moved on linger out (2 s), then it stays idle for a while (0.5 s).
const ENDS: Duration = Duration::from_secs(10);

/// The tests count the process's subscriber threads: one test at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// A test's start: this file's turn (see [`SERIAL`]), a fresh cluster, and the slot of
/// `name` there.
fn start(name: &str) -> (std::sync::MutexGuard<'static, ()>, Cluster, u16) {
    let serial = serial();
    init_log();
    let cluster = Cluster::start();
    let slot = slot_of(&cluster, name);
    (serial, cluster, slot)
}

/// The subscriber threads alive in this process now.
fn sub_threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .expect("/proc/self/task")
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("comm")).ok())
        .filter(|name| name.trim() == "redbaton-sub")
        .count()
}

fn slot_of(cluster: &Cluster, name: &str) -> u16 {
    cluster.keyslot(&KEYS.lock_bytes(name.as_bytes()))
}

fn at(port: u16) -> String {
    format!("127.0.0.1:{port}/0")
}

/// The nodes of `client`'s subscribers, sorted.
fn subscribed(client: &LockClient) -> Vec<String> {
    let mut nodes: Vec<String> = client.subscribers().into_iter().map(|s| s.node).collect();
    nodes.sort();
    nodes
}

/// The nodes of the masters that serve slots now, sorted.
fn masters(cluster: &Cluster) -> Vec<String> {
    let mut nodes: Vec<String> = cluster.masters().iter().map(|m| at(m.port())).collect();
    nodes.sort();
    nodes
}

/// The subscriber connections (`redbaton:sub`) open on `server`.
fn sub_connections(server: &RedisServer) -> usize {
    let sub = |c: &std::collections::HashMap<String, String>| {
        c.get("name").is_some_and(|n| n == "redbaton:sub")
    };
    server.client_list().iter().filter(|c| sub(c)).count()
}

/// A holder (the default lease, 30 s) and a patient client to wait (a minute's lease and
/// re-check): a waiter woken within seconds of a release was woken by a message.
fn clients(cluster: &Cluster) -> (LockClient, LockClient) {
    let holder = lock_client!(cluster(cluster.seed_urls()), io_timeouts(IO));
    let patient = lock_client!(cluster(cluster.seed_urls()), io_timeouts(IO), patient());
    (holder, patient)
}

/// Each of `clients` takes `name` where it is served now, twice: the first lock is
/// redirected there (or rides a refused connection through), the second, past the shortest
/// time between two reads of the slot map (100 ms), has the map read again.
fn relocate(clients: [&LockClient; 2], name: &str) {
    for pass in 0..2 {
        if pass > 0 {
            std::thread::sleep(Duration::from_millis(200));
        }
        for c in clients {
            drop(c.lock(name).expect("the lock where it is now"));
        }
    }
}

/// Releases `guard`; the waiter of `patient` that `waiting` runs wakes soon after, by a
/// message (the holder's lease and the waiter's re-check are far longer), with its
/// subscriber of the master on port `on` connected.
fn released_wakes(
    guard: redbaton::LockGuard,
    waiting: std::thread::JoinHandle<Instant>,
    patient: &LockClient,
    before: &redbaton::Stats,
    on: u16,
) {
    let released = Instant::now();
    assert_eq!(
        guard.unlock().expect("the holder's unlock"),
        Unlocked::Released
    );
    let got = waiting.join().expect("the waiter");
    let after = got.saturating_duration_since(released);
    assert!(
        after < secs(5),
        "the waiter on {on} woke {after:?} after the release"
    );
    let stats = patient.stats();
    assert!(
        stats.wakeups_event > before.wakeups_event,
        "woken by a message on {on}: {stats:?}"
    );
    let connected = patient
        .subscribers()
        .into_iter()
        .any(|s| s.node == at(on) && s.connected);
    assert!(connected, "subscribed on {on}: {:?}", patient.subscribers());
}

/// `holder` takes `name` (on the master on port `on`), a waiter of `patient` waits for it
/// there, and the release wakes the waiter: by a message, soon (the holder's lease and the
/// waiter's re-check are far longer). Both clients route `name` to `on` afterwards.
fn woken_on(holder: &LockClient, patient: &LockClient, name: &str, on: u16) {
    let guard = holder.lock(name).expect("the holder's lock");
    let before = patient.stats();
    let waiting = timed_waiter!(patient, name, secs(60));
    // Its first attempt fails, it subscribes (confirmed), and its second one fails: it
    // now sleeps until a message.
    wait_for(secs(10), "the waiter waiting", || {
        patient.stats().failed_attempts >= before.failed_attempts + 2
    });
    released_wakes(guard, waiting, patient, &before, on);
}

/// Address churn: three times, a master at a new address joins, serves the slot of a
/// name that clients lock and wait for, then is emptied, forgotten and stopped. Each
/// client's subscribers are those of the masters serving now, and so are the threads:
/// one per master and client, however many masters came and went; none is left once the
/// clients are dropped.
#[test]
fn masters_that_come_and_go_leave_no_subscriber_behind() {
    let name = "churn";
    let (_serial, mut cluster, slot) = start(name);
    let home = cluster.owner(slot);
    let baseline = sub_threads();
    let (holder, patient) = clients(&cluster);
    for _ in 0..3 {
        let new = cluster.add_master();
        cluster.move_slot(slot, new);
        woken_on(&holder, &patient, name, new);
        cluster.remove_master(slot, home, new);
        relocate([&holder, &patient], name);
    }
    let now = masters(&cluster);
    assert_eq!(now.len(), MASTERS);
    let settled = wait_until(ENDS, || {
        sub_threads() == baseline + 2 * MASTERS
            && subscribed(&holder) == now
            && subscribed(&patient) == now
    });
    assert!(
        settled,
        "{} subscriber threads for 2 clients of {MASTERS} masters (baseline {baseline}); \
         the holder's subscribers {:?}, the waiter's {:?}, the masters {now:?}",
        sub_threads(),
        subscribed(&holder),
        subscribed(&patient)
    );
    // The masters that stayed still wake their waiters.
    woken_on(&holder, &patient, name, home);
    drop((holder, patient));
    assert_eq!(
        sub_threads(),
        baseline,
        "threads left once the clients are dropped"
    );
}

/// A master demoted by a failover serves nothing: once nothing waits there its
/// subscriber ends (and is not listed). Failed over back, it serves again at the same
/// address: the next waiter there gets a fresh subscriber, which the release wakes.
/// `shutdown` then stops every subscriber thread.
#[test]
fn a_master_that_serves_again_gets_a_fresh_subscriber() {
    let name = "again";
    let (_serial, cluster, slot) = start(name);
    let old = cluster.owner(slot);
    let baseline = sub_threads();
    let (holder, patient) = clients(&cluster);
    woken_on(&holder, &patient, name, old);
    let new = cluster.failover(old);
    relocate([&holder, &patient], name);
    let ended = wait_until(ENDS, || {
        sub_threads() == baseline + 2 * MASTERS
            && subscribed(&holder) == masters(&cluster)
            && subscribed(&patient) == masters(&cluster)
            && sub_connections(cluster.server(old)) == 0
    });
    assert!(
        ended,
        "{} subscriber threads (baseline {baseline}), {} subscriber connections to the \
         demoted {old}; the waiter's subscribers {:?}, the masters {:?}",
        sub_threads(),
        sub_connections(cluster.server(old)),
        patient.subscribers(),
        masters(&cluster)
    );
    assert_eq!(cluster.failover(new), old, "the same address serves again");
    woken_on(&holder, &patient, name, old);
    drop(holder);
    patient
        .shutdown(secs(5))
        .expect("every thread stopped in time");
    assert_eq!(sub_threads(), baseline, "threads left after shutdown");
}

/// The race of a waiter with its master's subscriber ending: the waiter took the
/// subscriber of its master (its first attempt failed) and, before it watches there, the
/// master is demoted, its subscriber ends, and it serves again at the same address
/// (failed over back). Watching with the subscriber that ended, nothing would ever
/// confirm its key there, and it would poll; it follows on at once instead, to a fresh
/// subscriber of the same master, and the release wakes it by a message.
#[test]
fn a_waiter_that_took_a_subscriber_as_it_ended_follows_on_to_a_fresh_one() {
    let name = "late";
    let (_serial, cluster, slot) = start(name);
    let old = cluster.owner(slot);
    // Locked by both clients to have their maps read again: a name of the same master.
    let beside = cluster.name_beside(&KEYS, "beside-", slot);
    let (holder, patient) = clients(&cluster);
    let guard = holder.lock(name).expect("the holder's lock");
    let before = patient.stats();
    let prefix = KEYS.prefix();
    fault::stall(prefix, Point::Watch);
    let waiting = timed_waiter!(&patient, name, secs(60));
    wait_for(secs(10), "the waiter about to watch", || {
        fault::stalled(prefix, Point::Watch)
    });
    let new = cluster.failover(old);
    relocate([&holder, &patient], &beside);
    wait_for(ENDS, "the demoted master's subscriber ended", || {
        !subscribed(&patient).contains(&at(old))
    });
    assert_eq!(cluster.failover(new), old, "the same address serves again");
    relocate([&holder, &patient], &beside);
    fault::disarm(prefix, Point::Watch);
    // After the first: one as it follows on, and one confirmed on the fresh subscriber.
    wait_for(
        secs(10),
        "the waiter waiting on the fresh subscriber",
        || patient.stats().failed_attempts >= before.failed_attempts + 3,
    );
    released_wakes(guard, waiting, &patient, &before, old);
}

/// A hot key's local queue outlives its master: threads of one client take the key in
/// turns without a pause, so its entry never goes idle and its queue keeps the key
/// subscribed (for the holder to hear other processes fail to get it), while the master
/// is retired (its slot moved away, the node forgotten and stopped). The queue's
/// subscription follows the key. The queue hears the new master: another client takes the
/// key there, and its release wakes the queue's contender by a message, long before its
/// re-check. The retired master's subscriber ends while the turns go on, instead of trying
/// to reach the stopped node for as long as the queue lives.
#[test]
fn a_hot_keys_queue_follows_its_key_off_a_retired_master() {
    let name = "hot";
    let (_serial, mut cluster, slot) = start(name);
    let home = cluster.owner(slot);
    let new = cluster.add_master();
    cluster.move_slot(slot, new);
    let (holder, patient) = clients(&cluster);
    let stop = Arc::new(AtomicBool::new(false));
    let turns: Vec<_> = (0..3)
        .map(|_| {
            let (patient, stop) = (patient.clone(), stop.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let guard = patient.lock(name).expect("a turn");
                    std::thread::sleep(ms(1));
                    drop(guard);
                }
            })
        })
        .collect();
    wait_for(secs(10), "the turns handed on", || {
        patient.stats().local_handoffs > 20
    });
    cluster.remove_master(slot, home, new);
    let before = patient.stats();
    let guard = holder
        .try_lock_for(name, secs(20))
        .expect("the holder's lock, between the turns");
    let held = patient.stats();
    // A failed attempt, and the key subscribed on its master: the contender sleeps soon.
    wait_for(secs(10), "the turns waiting for the holder", || {
        patient.stats().failed_attempts > before.failed_attempts
            && patient
                .subscribers()
                .iter()
                .any(|s| s.node == at(home) && s.connected)
    });
    std::thread::sleep(ms(200));
    let released = Instant::now();
    assert_eq!(
        guard.unlock().expect("the holder's unlock"),
        Unlocked::Released
    );
    wait_for(secs(20), "the turns taking the key again", || {
        patient.stats().remote_acquisitions > held.remote_acquisitions
    });
    let after = released.elapsed();
    let stats = patient.stats();
    assert!(
        after < secs(5) && stats.wakeups_event > held.wakeups_event,
        "the queue's contender took the key {after:?} after the release on {home}: {stats:?}"
    );
    let handoffs = stats.local_handoffs;
    let ended = wait_until(ENDS, || !subscribed(&patient).contains(&at(new)));
    assert!(
        ended,
        "the retired {new} keeps its subscriber while the queue lives: {:?}",
        patient.subscribers()
    );
    assert!(
        patient.stats().local_handoffs > handoffs,
        "the turns went on meanwhile"
    );
    stop.store(true, Ordering::Relaxed);
    join_all(turns, "the turns");
}
