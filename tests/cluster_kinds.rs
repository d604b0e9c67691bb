//! Read-write locks, semaphores, latches and multi-locks on Redis Cluster, across slot
//! migrations and failovers: holds released and waits left while a slot migrates, waiters
//! that follow a moved slot or a promoted replica, renewals that meet an `ASK`.

use std::time::{Duration, Instant};

use redbaton::{Error, LockClient, Unlocked};
use redbaton_testkit::cluster::Cluster;
use redbaton_testkit::keys::Keys;
use redbaton_testkit::lock_builder;
use redbaton_testkit::{init_log, ms, secs};

const KEYS: Keys = Keys::DEFAULT;

/// Two tests at a time at most (whatever the number of test threads): each has a cluster
/// of six servers and bounds that are a matter of timing (a failover, a waiter woken within
/// seconds), on a machine of two cores.
static TURNS: [parking_lot::Mutex<()>; 2] = [const { parking_lot::Mutex::new(()) }; 2];

/// A cluster of its own, logging on; the file's other tests wait for a turn while it is
/// alive.
struct Started {
    cluster: Cluster,
    _turn: parking_lot::MutexGuard<'static, ()>,
}

impl std::ops::Deref for Started {
    type Target = Cluster;
    fn deref(&self) -> &Cluster {
        &self.cluster
    }
}

fn started() -> Started {
    let turn = TURNS
        .iter()
        .find_map(|t| t.try_lock())
        .unwrap_or_else(|| TURNS[0].lock());
    init_log();
    Started {
        cluster: Cluster::start(),
        _turn: turn,
    }
}

/// The hash slot of the lock `name`.
fn slot_of(cluster: &Cluster, name: &str) -> u16 {
    cluster.keyslot(&KEYS.lock_bytes(name.as_bytes()))
}

fn client_of(cluster: &Cluster, lease: Duration) -> LockClient {
    lock_builder!(cluster(cluster.seed_urls()), io_timeouts(ms(1000)))
        .lease(lease)
        .build()
        .expect("build")
}

/// Every key of the master on `port` in `slot` that belongs to the lock `name` (its lock
/// key and every key suffixed to it).
fn keys_of(cluster: &Cluster, port: u16, slot: u16, name: &str) -> Vec<Vec<u8>> {
    let lock = KEYS.lock_bytes(name.as_bytes());
    let keys: Vec<Vec<u8>> = redis::cmd("CLUSTER")
        .arg("GETKEYSINSLOT")
        .arg(slot)
        .arg(1000)
        .query(&mut cluster.server(port).conn())
        .expect("GETKEYSINSLOT");
    keys.into_iter()
        .filter(|k| k == &lock || (k.starts_with(&lock) && k.get(lock.len()) == Some(&b':')))
        .collect()
}

/// Every kind on a cluster: a read and a write hold, a permit, a latch, a multi-lock.
#[test]
fn smoke() {
    let cluster = started();
    let c = client_of(&cluster, secs(10));
    let rw = c.rwlock("smoke-rw");
    assert_eq!(
        rw.read().expect("read").unlock().expect("unlock"),
        Unlocked::Released
    );
    assert_eq!(
        rw.write().expect("write").unlock().expect("unlock"),
        Unlocked::Released
    );
    let permit = c.semaphore("smoke-sem", 2).acquire().expect("permit");
    assert_eq!(permit.unlock().expect("unlock"), Unlocked::Released);
    let latch = c.latch("smoke-latch", 1);
    assert_eq!(latch.count_down().expect("count down"), 0);
    latch.wait().expect("open");
    let multi = c.multi_lock(["smoke-a", "smoke-b"]).expect("multi-lock");
    assert_eq!(multi.unlock().expect("unlock"), Unlocked::Released);
}

/// A multi-lock of two names in one slot is released while that slot migrates, with one
/// name's keys already moved to the target and the other's still on the source. The
/// source runs the release of the name it still has and refuses the other's, so the group
/// is released again one name at a time: the name the first try released is found gone,
/// which says only what a retry saw. Both were ours and valid: `Unlocked::Released`.
#[test]
fn multi_lock_release_with_half_its_slot_moved() {
    let cluster = started();
    // Not fair: a fair release names the queue's keys too, which do not exist.
    let client = lock_builder!(cluster(cluster.seed_urls()), io_timeouts(ms(1000)))
        .lease(secs(6))
        .fair(false)
        .build()
        .expect("build");
    let (slot, mut names) = cluster.names_in_one_slot(&KEYS, "rvmulti", 4);
    // A multi-lock of the slot taken and released first: its release script is then
    // loaded on the source, as on any master that served such a release before.
    let others = names.split_off(2);
    let warm = client.multi_lock(&others).expect("multi_lock");
    assert_eq!(warm.unlock().expect("unlock"), Unlocked::Released);
    names.sort_by_key(|n| KEYS.lock_bytes(n.as_bytes()));
    let guard = client.multi_lock(&names).expect("multi_lock");
    let from = cluster.owner(slot);
    // The first renewal writes each name's lease record: then every key a release names
    // exists on the source, which runs the release of a name whose keys are all there.
    let has_record = |name: &str| {
        keys_of(&cluster, from, slot, name)
            .iter()
            .any(|k| k.ends_with(b":lease"))
    };
    let t = Instant::now();
    while !names.iter().all(|n| has_record(n)) {
        assert!(t.elapsed() < secs(20), "no renewal wrote the lease records");
        std::thread::sleep(ms(50));
    }
    let to = cluster.other_master(from);
    let migration = cluster.open_migration(slot, to);
    // The second name's keys (second in the pipeline) move; the first's stay.
    let moving = keys_of(&cluster, from, slot, &names[1]);
    assert!(!moving.is_empty(), "no keys of {}", names[1]);
    let only: Vec<&[u8]> = moving.iter().map(Vec::as_slice).collect();
    let moved = migration.migrate_keys(Some(&only));
    eprintln!("moved {moved} keys of {} to {to}", names[1]);
    let t = Instant::now();
    let unlocked = guard.unlock();
    eprintln!("multi unlock: {unlocked:?} after {:?}", t.elapsed());
    let left: Vec<String> = keys_of(&cluster, from, slot, &names[0])
        .into_iter()
        .chain(keys_of(&cluster, from, slot, &names[1]))
        .map(|k| String::from_utf8_lossy(&k).into_owned())
        .collect();
    eprintln!("left on the source: {left:?}");
    let first_left = left.contains(&KEYS.lock(&names[0]));
    migration.finish();
    assert!(!first_left, "the first name's lock key is still held");
    assert_eq!(
        unlocked.expect("unlock"),
        Unlocked::Released,
        "both names were ours and valid"
    );
}

/// A read hold of a read-write lock is released while its slot's migration is open and no
/// key has moved yet (the first step of every reshard). The release names the lock's
/// waiting sets, fence counter and nonces, which the source refuses together (`TRYAGAIN`);
/// its narrower form, the lock key alone, is always served: `unlock()` gives the hold back
/// at once and says `Unlocked::Released`.
#[test]
fn read_hold_release_while_its_slot_migration_is_open() {
    let cluster = started();
    let client = client_of(&cluster, secs(8));
    let name = "rvrw";
    let slot = slot_of(&cluster, name);
    let rw = client.rwlock(name);
    let read = rw.read().expect("read");
    let from = cluster.owner(slot);
    let to = cluster.other_master(from);
    let migration = cluster.open_migration(slot, to);
    let t = Instant::now();
    let unlocked = read.unlock();
    let took = t.elapsed();
    eprintln!("read unlock: {unlocked:?} after {took:?}");
    migration.finish();
    assert_eq!(unlocked.expect("unlock"), Unlocked::Released);
    assert!(took < secs(3), "the release took {took:?}");
}

/// Waits on `latch` in a thread; the receiver gets the outcome and when it came.
fn latch_waiter(
    client: &LockClient,
    name: &str,
    count: u64,
    timeout: Duration,
) -> std::sync::mpsc::Receiver<(redbaton::Result<()>, Instant)> {
    let latch = client.latch(name, count);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let r = latch.wait_for(timeout);
        let _ = tx.send((r, Instant::now()));
    });
    rx
}

/// A latch waiter whose name's slot moves to another master (a finished reshard), then
/// the latch is counted down to zero by another client on the new master: the old master
/// drops the waiter's shard subscription, the waiter reads again and watches on the new
/// master, and hears the `z` there.
#[test]
fn latch_waiter_follows_a_moved_slot() {
    latch_waiter_across("rvlatch-move", ms(1500), |cluster, slot, from| {
        cluster.move_slot(slot, cluster.other_master(from));
    });
}

/// A latch waiter whose name's master fails over (`CLUSTER FAILOVER`: its replica is
/// promoted), then the latch is counted down to zero on the new master: the waiter learns
/// that its subscription is on a node that no longer serves the slot, watches on the new
/// master, and hears the `z` there.
#[test]
fn latch_waiter_across_a_failover() {
    latch_waiter_across("rvlatch-failover", ms(1500), |cluster, slot, from| {
        let promoted = cluster.failover(from);
        eprintln!("slot {slot}: {from} -> {promoted}");
    });
}

/// As [`latch_waiter_across_a_failover`], but the master is killed (SIGKILL) and its
/// replica takes over after `cluster-node-timeout`: the waiter's subscriber loses its
/// connection, and the waiter reads again where the slot is now.
#[test]
fn latch_waiter_across_a_killed_master() {
    latch_waiter_across("rvlatch-kill", ms(2000), |cluster, slot, from| {
        let promoted = cluster.kill_master(from);
        eprintln!("slot {slot}: {from} killed, {promoted} promoted");
    });
}

/// A latch `name` of 2, counted down once, waited on (re-checks every minute) while
/// `disturb` takes the name's slot from its master (the slot and the master's port are
/// given); `settle` later the latch is opened where the slot is now, and the waiter must
/// wake within 5 s.
fn latch_waiter_across(name: &str, settle: Duration, disturb: impl FnOnce(&Cluster, u16, u16)) {
    let cluster = started();
    let (waiter, counter) = (patient(&cluster), patient(&cluster));
    let latch = counter.latch(name, 2);
    assert_eq!(latch.count_down().expect("count down"), 1);
    let done = latch_waiter(&waiter, name, 2, secs(90));
    std::thread::sleep(ms(500));
    let slot = slot_of(&cluster, name);
    let from = cluster.owner(slot);
    // The count down must outlive a killed master: the test is of the waiter.
    cluster.wait_replicated(from);
    disturb(&cluster, slot, from);
    std::thread::sleep(settle);
    // A read first (reads ride through a failover): the count down that follows is not
    // sent on a connection to a dead master (a count down is sent once, see the guide).
    assert_eq!(latch.count().expect("count"), 1);
    let opened = Instant::now();
    assert_eq!(latch.count_down().expect("count down"), 0);
    let (r, at) = done.recv_timeout(secs(100)).expect("the waiter ended");
    let after = at.saturating_duration_since(opened);
    eprintln!("latch wait: {r:?}, {after:?} after the count reached zero");
    r.expect("wait");
    assert!(
        after < secs(5),
        "the waiter woke {after:?} after the count reached zero"
    );
}

/// Two exclusive locks held on one master, in two slots; one slot's migration is opened
/// and that lock's keys (its key, lease record and fence counter) all move to the target,
/// and the migration is left open. The watchdog's pipeline to the source then meets an
/// `ASK` (not a `TRYAGAIN`, which `tests/cluster_migration.rs` covers) for the moved
/// lock's batch: both locks are kept for three leases.
#[test]
fn renewals_of_two_slots_with_one_lock_moved_by_an_open_migration() {
    let cluster = started();
    let lease = secs(3);
    let client = lock_builder!(cluster(cluster.seed_urls()), io_timeouts(ms(1000)))
        .lease(lease)
        .build()
        .expect("build");
    let moving = "rvrenew-moving";
    let slot = slot_of(&cluster, moving);
    let from = cluster.owner(slot);
    let to = cluster.other_master(from);
    let staying = cluster.name_beside(&KEYS, "rvrenew-stay", slot);
    let g_moving = client.lock(moving).expect("lock");
    let g_staying = client.lock(&staying).expect("lock");
    // The first renewal writes the lease record: then the lock's keys all move.
    let t = Instant::now();
    while !keys_of(&cluster, from, slot, moving)
        .iter()
        .any(|k| k.ends_with(b":lease"))
    {
        assert!(t.elapsed() < secs(20), "no renewal wrote the lease record");
        std::thread::sleep(ms(50));
    }
    let migration = cluster.open_migration(slot, to);
    let keys = keys_of(&cluster, from, slot, moving);
    let only: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
    let moved = migration.migrate_keys(Some(&only));
    eprintln!("moved {moved} keys of {moving} to {to}; {staying} stays on {from}");
    let renewed = client.stats().renewals_failed;
    std::thread::sleep(lease * 3);
    let failed = client.stats().renewals_failed - renewed;
    let (a, b) = (g_moving.check(), g_staying.check());
    eprintln!("moving: {a:?}; staying: {b:?}; renewals failed meanwhile: {failed}");
    migration.finish();
    assert!(
        a.is_ok() && b.is_ok(),
        "lost while a slot migrates: {moving} (its slot) {a:?}, {staying} (another) {b:?}"
    );
}

/// A client whose holds last 20 s and whose waiters re-check every minute: a waiter woken
/// sooner was woken by an event.
fn patient(cluster: &Cluster) -> LockClient {
    lock_builder!(cluster(cluster.seed_urls()), io_timeouts(ms(1000)))
        .lease(secs(20))
        .recheck_interval(secs(60))
        .build()
        .expect("build")
}

/// Each of `n` waiters reports on `rx` (its kind, whether it got the hold, when): every
/// one got it within 8 s of the releases at `released`.
fn all_woken(rx: &std::sync::mpsc::Receiver<(&str, bool, Instant)>, n: usize, released: Instant) {
    let mut slow = Vec::new();
    for _ in 0..n {
        let (kind, ok, at) = rx.recv_timeout(secs(100)).expect("a waiter ended");
        let after = at.saturating_duration_since(released);
        eprintln!("{kind}: {ok} {after:?} after the releases");
        if !ok || after > secs(8) {
            slow.push((kind, ok, after));
        }
    }
    let woken = slow.is_empty();
    assert!(woken, "waiters not woken by the releases: {slow:?}");
}

/// A plain lock's waiter, a read-write lock's writer (behind a read hold) and a
/// semaphore's permit-seeker (behind its only permit) wait on one master; that master is
/// killed and its replica promoted; then the holder gives each hold back on the new
/// master. Each waiter follows the slot to the new master and is woken by the release
/// there, well before its re-check (60 s) or the holds' lease (20 s) would wake it.
#[test]
fn waiters_of_every_kind_across_a_killed_master() {
    let cluster = started();
    let build = || patient(&cluster);
    let (holder, waiter) = (build(), build());
    // Three names on one master.
    let first = "rvkill-0";
    let from = cluster.owner(cluster.keyslot(&KEYS.lock_bytes(first.as_bytes())));
    let names: Vec<String> = (0..)
        .map(|i| format!("rvkill-{i}"))
        .filter(|n| cluster.owner(cluster.keyslot(&KEYS.lock_bytes(n.as_bytes()))) == from)
        .take(3)
        .collect();
    let lock = holder.lock(&names[0]).expect("lock");
    let read = holder.rwlock(&names[1]).read().expect("read");
    let permit = holder.semaphore(&names[2], 1).acquire().expect("permit");
    let (tx, rx) = std::sync::mpsc::channel::<(&str, bool, Instant)>();
    let waiter = std::sync::Arc::new(waiter);
    let spawn = |kind: &'static str, f: Box<dyn FnOnce() -> bool + Send>| {
        let tx = tx.clone();
        std::thread::spawn(move || {
            let ok = f();
            let _ = tx.send((kind, ok, Instant::now()));
        });
    };
    let (w, n) = (waiter.clone(), names[0].clone());
    spawn(
        "lock",
        Box::new(move || w.try_lock_for(&n, secs(90)).map(drop).is_ok()),
    );
    let (w, n) = (waiter.clone(), names[1].clone());
    spawn(
        "write",
        Box::new(move || w.rwlock(&n).try_write_for(secs(90)).map(drop).is_ok()),
    );
    let (w, n) = (waiter.clone(), names[2].clone());
    spawn(
        "permit",
        Box::new(move || {
            w.semaphore(&n, 1)
                .try_acquire_for(secs(90))
                .map(drop)
                .is_ok()
        }),
    );
    std::thread::sleep(ms(1000));
    // The holds and the waiters' marks must outlive the killed master.
    cluster.wait_replicated(from);
    let promoted = cluster.kill_master(from);
    eprintln!("{from} killed, {promoted} promoted");
    std::thread::sleep(ms(2000));
    let released = Instant::now();
    eprintln!("lock: {:?}", lock.unlock());
    eprintln!("read: {:?}", read.unlock());
    eprintln!("permit: {:?}", permit.unlock());
    all_woken(&rx, 3, released);
}

/// A writer waits behind a read hold (its mark in the lock's waiting-writers set) when the
/// slot's migration opens, no key moved; it gives up at its deadline. As a fair lock's
/// queued waiter does (`tests/cluster_migration.rs`), `try_write_for` returns by its
/// deadline plus one read timeout: its leave, refused over the lock's five keys, is sent
/// at once in its narrower form (the lock key alone; the mark expires).
#[test]
fn rw_writer_leaves_by_its_deadline_while_the_slot_migrates() {
    let name = "rvrw-leave";
    let cluster = started();
    let (holder, waiter) = (client_of(&cluster, secs(20)), client_of(&cluster, secs(20)));
    let slot = slot_of(&cluster, name);
    let read = holder.rwlock(name).read().expect("read");
    let wait = secs(4);
    let t = std::thread::spawn(move || {
        let t = Instant::now();
        let r = waiter.rwlock(name).try_write_for(wait).map(drop);
        (r, t.elapsed())
    });
    std::thread::sleep(ms(500));
    let from = cluster.owner(slot);
    let migration = cluster.open_migration(slot, to_other(&cluster, from));
    let (r, took) = t.join().expect("waiter thread");
    eprintln!("writer: {r:?} after {took:?}");
    migration.finish();
    drop(read);
    // `SlotMigrating` is accepted for a wait with a deadline (as in
    // tests/cluster_migration.rs); the bound is the point.
    assert!(
        matches!(r, Err(Error::Timeout | Error::SlotMigrating)),
        "{r:?}"
    );
    let read_timeout = secs(1);
    assert!(
        took < wait + read_timeout,
        "returned {:?} after its deadline",
        took - wait
    );
}

fn to_other(cluster: &Cluster, from: u16) -> u16 {
    cluster.other_master(from)
}

/// A read-write lock's writer (behind a read hold) and a semaphore's permit-seeker
/// (behind its only permit) wait while their names' slots move to another master (a
/// finished reshard); then the holder gives both holds back on the new master. Each
/// waiter is woken by the move (`sunsubscribe`), watches on the new master and is woken
/// there by the release, well before its re-check (60 s) or the holds' lease (20 s).
#[test]
fn shared_waiters_follow_a_moved_slot() {
    let cluster = started();
    let build = || patient(&cluster);
    let (holder, waiter) = (build(), std::sync::Arc::new(build()));
    let (rw_name, sem_name) = ("rvmove-rw", "rvmove-sem");
    let read = holder.rwlock(rw_name).read().expect("read");
    let permit = holder.semaphore(sem_name, 1).acquire().expect("permit");
    let (tx, rx) = std::sync::mpsc::channel::<(&str, bool, Instant)>();
    let (w, t) = (waiter.clone(), tx.clone());
    std::thread::spawn(move || {
        let ok = w.rwlock(rw_name).try_write_for(secs(90)).map(drop).is_ok();
        let _ = t.send(("write", ok, Instant::now()));
    });
    let (w, t) = (waiter.clone(), tx);
    std::thread::spawn(move || {
        let ok = w
            .semaphore(sem_name, 1)
            .try_acquire_for(secs(90))
            .map(drop)
            .is_ok();
        let _ = t.send(("permit", ok, Instant::now()));
    });
    std::thread::sleep(ms(1000));
    for name in [rw_name, sem_name] {
        let slot = slot_of(&cluster, name);
        let from = cluster.owner(slot);
        cluster.move_slot(slot, cluster.other_master(from));
    }
    std::thread::sleep(ms(1500));
    let released = Instant::now();
    eprintln!("read: {:?}", read.unlock());
    eprintln!("permit: {:?}", permit.unlock());
    all_woken(&rx, 2, released);
}
