//! Redis Cluster: locks whose hash slot is half-way between two masters. A resharding
//! tool marks the slot `IMPORTING` on the target and `MIGRATING` on the source, then moves
//! its keys one `MIGRATE` at a time, then gives the slot to the target. Meanwhile the
//! servers refuse a command naming several keys of the slot unless they all exist on one
//! side (`TRYAGAIN`), and a free lock has no lock key: acquiring it cannot run anywhere
//! until the keys have moved. These tests keep a migration open, moving no key or only
//! some, and check that every call returns within its bound with a typed error or
//! succeeds, that nothing runs on both masters, and that the lock works on the new master
//! once the slot has moved, waking its waiters.

use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use redbaton::{Error, LockClient, LockKind, Unlocked};
use redbaton_testkit::cluster::Cluster;
use redbaton_testkit::keys::Keys;
use redbaton_testkit::lock_builder;
use redbaton_testkit::{init_log, ms, secs, timed};

const KEYS: Keys = Keys::DEFAULT;
/// Slack over a call's own bound before it counts as a stall (the machine may be busy).
const MARGIN: Duration = Duration::from_secs(10);
/// How long one attempt waits out `TRYAGAIN` without a deadline, before a `lock()` starts
/// counting its window.
const SETTLE: Duration = Duration::from_secs(2);

fn builder(seeds: Vec<String>) -> redbaton::Builder {
    lock_builder!(cluster(seeds), io_timeouts(ms(1000)))
}

/// Whether `key` exists on the master on `port`, asked the way that works on both sides
/// of a migration: `ASKING` first (the target serves the slot then), and a source that
/// lacks the key answers `ASK`; a master that does not serve the slot is asked for the
/// keys it has of it.
fn exists_on(cluster: &Cluster, port: u16, key: &[u8]) -> bool {
    let reply: redis::RedisResult<(bool,)> = redis::pipe()
        .cmd("ASKING")
        .ignore()
        .cmd("EXISTS")
        .arg(key)
        .query(&mut cluster.server(port).conn());
    match reply {
        Ok((found,)) => found,
        Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::Ask) => false,
        // Not serving the slot (any more): the keys it still has there, if any.
        Err(e) if e.to_string().contains("Moved") => {
            let keys: Vec<Vec<u8>> = redis::cmd("CLUSTER")
                .arg("GETKEYSINSLOT")
                .arg(cluster.keyslot(key))
                .arg(1000)
                .query(&mut cluster.server(port).conn())
                .expect("GETKEYSINSLOT");
            keys.iter().any(|k| k == key)
        }
        Err(e) => panic!("EXISTS on {port}: {e}"),
    }
}

/// The lease of the tests' clients: short, so that a wait bounded by one lease ends soon
/// and renewals come every second.
const LEASE: Duration = Duration::from_secs(3);

/// A cluster, and a client of it whose locks have a `lease`.
fn started(lease: Duration) -> (Cluster, LockClient) {
    init_log();
    let cluster = Cluster::start();
    let client = builder(cluster.seed_urls())
        .lease(lease)
        .build()
        .expect("build");
    (cluster, client)
}

/// The slot of `name`'s lock, the master that serves it, and another master to migrate it
/// to.
fn slot_and_masters(cluster: &Cluster, name: &str) -> (u16, u16, u16) {
    let slot = cluster.keyslot(&KEYS.lock_bytes(name.as_bytes()));
    let from = cluster.owner(slot);
    (slot, from, cluster.other_master(from))
}

/// What a call on a migrating slot may answer instead of the lock: a typed error that
/// says so, never a raw `TRYAGAIN` (or any other Redis error).
fn migrating_answer(e: &Error) -> bool {
    matches!(e, Error::Timeout | Error::SlotMigrating)
}

/// A free lock whose slot is migrating, with none of its keys (a fresh name), then with
/// its fencing counter on the source, then with the counter moved to the target:
/// `try_lock_for` gives the lock or `Timeout` by its deadline, `try_lock` and a `lock`
/// outliving its window say `SlotMigrating`, and no lock key appears on either master.
/// Once the slot has moved, the lock works on the new master and its tokens keep
/// increasing.
#[test]
fn a_free_lock_while_its_slot_migrates() {
    let (cluster, client) = &started(LEASE);
    let check = |name: &str, stage: &str, from: u16, to: u16| {
        let key = KEYS.lock_bytes(name.as_bytes());
        // The operators' view reads the keys one at a time where they are.
        let (info, took) = timed(|| client.inspect(name));
        let info = info.unwrap_or_else(|e| panic!("{stage}: inspect: {e:?} after {took:?}"));
        assert_eq!(info.kind, LockKind::Free, "{stage}: inspect: {info:?}");
        let fence = KEYS.fence_bytes(name.as_bytes());
        let counter = exists_on(cluster, from, &fence) || exists_on(cluster, to, &fence);
        assert_eq!(info.fence.is_some(), counter, "{stage}: inspect: {info:?}");
        let wait = secs(3);
        let (r, took) = timed(|| client.try_lock_for(name, wait));
        eprintln!("{stage}: try_lock_for: {r:?} after {took:?}");
        assert!(
            took < wait + MARGIN,
            "{stage}: try_lock_for stalled {took:?}"
        );
        match r {
            Ok(g) => {
                let on_both = exists_on(cluster, from, &key) && exists_on(cluster, to, &key);
                assert!(!on_both, "{stage}: the lock key on both masters");
                assert_eq!(g.unlock().expect("unlock"), Unlocked::Released);
            }
            Err(e) => assert!(migrating_answer(&e), "{stage}: try_lock_for: {e:?}"),
        }
        let (r, took) = timed(|| client.try_lock(name));
        eprintln!("{stage}: try_lock: {r:?} after {took:?}");
        assert!(took < SETTLE + MARGIN, "{stage}: try_lock stalled {took:?}");
        match r {
            Ok(g) => drop(g.unlock().expect("unlock")),
            Err(e) => assert!(migrating_answer(&e), "{stage}: try_lock: {e:?}"),
        }
        // A wait without a deadline rides a migration for one lease from the first
        // refusal, then says why.
        let (r, took) = timed(|| client.lock(name));
        eprintln!("{stage}: lock: {r:?} after {took:?}");
        assert!(
            took < SETTLE + LEASE + MARGIN,
            "{stage}: lock stalled {took:?}"
        );
        match r {
            Ok(g) => drop(g.unlock().expect("unlock")),
            Err(e) => assert!(matches!(e, Error::SlotMigrating), "{stage}: lock: {e:?}"),
        }
        assert!(!exists_on(cluster, from, &key), "{stage}: a lock left");
        assert!(!exists_on(cluster, to, &key), "{stage}: a lock left");
    };

    // A fresh name: no key anywhere.
    let fresh = "mig-fresh";
    let (slot, from, to) = slot_and_masters(cluster, fresh);
    let migration = cluster.open_migration(slot, to);
    check(fresh, "no keys", from, to);
    migration.finish();
    let g = client.lock(fresh).expect("lock on the new master");
    assert!(exists_on(cluster, to, &KEYS.lock_bytes(fresh.as_bytes())));
    g.unlock().expect("unlock");

    // A name locked before: its fencing counter is on the source.
    let used = "mig-used";
    let (slot, from, to) = slot_and_masters(cluster, used);
    let before = client.lock(used).expect("lock before");
    let token = before.fencing_token();
    before.unlock().expect("unlock before");
    let fence = KEYS.fence_bytes(used.as_bytes());
    assert!(exists_on(cluster, from, &fence));
    let migration = cluster.open_migration(slot, to);
    check(used, "counter on the source", from, to);
    // Half-way: the counter moved, the lock key does not exist.
    assert_eq!(migration.migrate_keys(Some(&[fence.as_slice()])), 1);
    check(used, "counter on the target", from, to);
    migration.finish();
    let after = client.lock(used).expect("lock on the new master");
    assert!(exists_on(cluster, to, &KEYS.lock_bytes(used.as_bytes())));
    assert!(
        after.fencing_token() > token,
        "tokens increase across the move"
    );
    after.unlock().expect("unlock");
}

/// A lock held when its slot starts migrating: its holder releases it on the source, a
/// waiter of another client (`lock()`, no deadline) waits through the migration and gets
/// the lock on the new master once the slot has moved, with a higher token; the first
/// client locks it again after that. With the fair queue (the default) and without, and
/// with the waiter queued (or marked) before the migration starts or not: a fair release
/// then grants the lock to it on the source, which its confirming attempt cannot take
/// until the slot has moved (the grant's short lease runs out meanwhile).
#[test]
fn a_waiter_gets_the_lock_once_the_slot_has_moved() {
    init_log();
    let cluster = Cluster::start();
    for fair in [true, false] {
        for queued_before in [false, true] {
            let name = format!("mig-held-{fair}-{queued_before}");
            waiter_through_a_migration(&cluster, name.leak(), fair, queued_before);
        }
    }
}

fn waiter_through_a_migration(
    cluster: &Cluster,
    name: &'static str,
    fair: bool,
    queued_before: bool,
) {
    let key = KEYS.lock_bytes(name.as_bytes());
    let (slot, from, to) = slot_and_masters(cluster, name);
    let client = || builder(cluster.seed_urls()).fair(fair).build();
    let a = client().expect("a");
    let b = client().expect("b");
    let held = a.lock(name).expect("a locks");
    let token = held.fencing_token();
    let open = || cluster.open_migration(slot, to);
    let migration = (!queued_before).then(open);

    // The waiter's guard stays on its thread: it says what it got, holds the lock until
    // told, then unlocks.
    let (got_tx, got_rx) = mpsc::channel();
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let waiter = {
        let b = b.clone();
        thread::spawn(move || match b.lock(name) {
            Ok(g) => {
                got_tx
                    .send((Instant::now(), Ok(g.fencing_token())))
                    .unwrap();
                go_rx.recv().unwrap();
                g.unlock()
            }
            Err(e) => {
                got_tx.send((Instant::now(), Err(e))).unwrap();
                Ok(Unlocked::Released)
            }
        })
    };
    thread::sleep(ms(500));
    let migration = migration.unwrap_or_else(open);
    let (r, took) = timed(|| held.unlock());
    eprintln!("unlock during the migration: {r:?} after {took:?}");
    assert_eq!(r.expect("unlock on the source"), Unlocked::Released);
    // The waiter cannot take a free lock while the slot is half-way.
    thread::sleep(ms(1500));
    assert!(!exists_on(cluster, from, &key), "taken on the source");
    assert!(!exists_on(cluster, to, &key), "taken on the target");
    let finished = Instant::now();
    migration.finish();
    let (woke, got) = got_rx
        .recv_timeout(secs(20))
        .expect("the waiter returns once the slot has moved");
    eprintln!(
        "waiter: {got:?}, {:?} after the migration ended",
        woke.saturating_duration_since(finished)
    );
    let second = got.expect("the waiter's lock");
    assert!(second > token, "tokens increase across the move");
    assert!(exists_on(cluster, to, &key) && !exists_on(cluster, from, &key));
    go_tx.send(()).unwrap();
    let unlocked = waiter.join().expect("waiter thread").expect("unlock");
    assert_eq!(unlocked, Unlocked::Released);
    let again = a.lock(name).expect("a locks on the new master");
    assert!(exists_on(cluster, to, &key));
    assert_eq!(again.unlock().expect("unlock"), Unlocked::Released);
}

/// Locks held through a migration left half-way: one whose key already moved to the
/// target, one whose key is still on the source, and one of another slot of the source
/// (renewed in the same round trip). The watchdog keeps all three, for several leases,
/// and each releases where its key is.
#[test]
fn held_locks_are_renewed_while_their_slot_migrates() {
    let (cluster, client) = &started(LEASE);
    let (slot, names) = cluster.names_in_one_slot(&KEYS, "mig-r", 2);
    let from = cluster.owner(slot);
    let to = cluster.other_master(from);
    let other = cluster.name_beside(&KEYS, "mig-o", slot);
    let guards: Vec<_> = names
        .iter()
        .chain([&other])
        .map(|n| client.lock(n).expect("lock"))
        .collect();
    let migration = cluster.open_migration(slot, to);
    let moved = KEYS.lock_bytes(names[0].as_bytes());
    assert_eq!(migration.migrate_keys(Some(&[moved.as_slice()])), 1);
    thread::sleep(LEASE * 3);
    for (name, g) in names.iter().chain([&other]).zip(&guards) {
        assert!(g.check().is_ok(), "{name}: lost while its slot migrates");
    }
    assert!(exists_on(cluster, to, &moved), "renewed on the target");
    // The operators' view finds the hold, its key on the target and its counter on the
    // source.
    let info = client
        .inspect(&names[0])
        .expect("inspect while the slot migrates");
    assert_eq!(info.kind, LockKind::Lock, "{info:?}");
    let holder = info.holder.expect("a holder");
    assert!(holder.mine && holder.fence.is_some(), "{holder:?}");
    for (name, g) in names.iter().chain([&other]).zip(guards) {
        let (r, took) = timed(|| g.unlock());
        eprintln!("{name}: unlock {r:?} after {took:?}");
        assert_eq!(r.expect("unlock"), Unlocked::Released, "{name}");
    }
    migration.finish();
}

/// While its slot migrates, a lock's lease changes name its key alone, unordered with the
/// hold's other changes (the server refuses the key and its lease record together). A
/// change that lands after a longer one (a renewal delayed on the way and landing late;
/// here an explicit extend sent after) must not cut the longer lease short: the holder
/// believes the longer lease from the moment it was applied, and another client could
/// otherwise take the lock inside it. Such a change only lengthens the lease.
#[test]
fn a_shorter_lease_change_never_cuts_a_longer_one_short_while_the_slot_migrates() {
    // No renewal before the migration opens: the lease record does not exist yet, and
    // the source refuses the lock and its record together.
    let (cluster, client) = &started(secs(30));
    let name = "mig-ext";
    let (slot, from, to) = slot_and_masters(cluster, name);
    let g = client.lock(name).expect("lock");
    let migration = cluster.open_migration(slot, to);
    g.extend(secs(60)).expect("the longer change");
    g.extend(LEASE).expect("a shorter change after it");
    let pttl: i64 = redis::cmd("PTTL")
        .arg(KEYS.lock_bytes(name.as_bytes()))
        .query(&mut cluster.server(from).conn())
        .expect("PTTL on the source");
    assert!(pttl > 30_000, "the 60 s lease cut to {pttl} ms");
    assert!(g.check().is_ok());
    assert_eq!(g.unlock().expect("unlock"), Unlocked::Released);
    migration.finish();
}

/// A fair waiter queued before the migration starts is granted the lock by a release on
/// the source, cannot confirm it while the slot is half-way, and gives up at its
/// deadline: it leaves the queue without waiting the migration out, so `try_lock_for`
/// returns by its deadline plus one read timeout (the promise of a one-node client), with
/// `Timeout`.
#[test]
fn a_queued_waiter_leaves_by_its_deadline_while_the_slot_migrates() {
    let (cluster, holder) = &started(LEASE);
    let name = "mig-leave";
    let held = holder.lock(name).expect("lock");
    let (slot, _, to) = slot_and_masters(cluster, name);
    let waiter = builder(cluster.seed_urls()).build().expect("waiter");
    let wait = secs(4);
    let t = thread::spawn(move || timed(|| waiter.try_lock_for(name, wait).map(drop)));
    thread::sleep(ms(500));
    let migration = cluster.open_migration(slot, to);
    thread::sleep(ms(500));
    assert_eq!(held.unlock().expect("unlock"), Unlocked::Released);
    let (r, took) = t.join().expect("waiter thread");
    eprintln!("waiter: {r:?} after {took:?}");
    assert!(matches!(r, Err(Error::Timeout)), "{r:?}");
    let read_timeout = secs(1);
    assert!(
        took < wait + read_timeout,
        "returned {:?} after its deadline",
        took - wait
    );
    migration.finish();
}

/// A script sent to the target of an `ASK` that the target does not know (`NOSCRIPT`, as
/// after `SCRIPT FLUSH`) is loaded there and sent again after `ASKING` once more: the
/// target serves it, and the call costs one redirect. Without `ASKING` the target would
/// answer `MOVED` back to the source, which would send it on again (three redirects).
/// A semaphore's acquire names one key, which the target serves after `ASKING` while
/// the slot migrates.
#[test]
fn a_script_reloaded_after_ask_is_sent_with_asking_again() {
    let (cluster, client) = &started(LEASE);
    let name = "mig-noscript";
    let (slot, _, to) = slot_and_masters(cluster, name);
    let migration = cluster.open_migration(slot, to);
    let () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query(&mut cluster.server(to).conn())
        .expect("SCRIPT FLUSH");
    let before = client.stats().redirects;
    let permit = client
        .semaphore(name, 2)
        .try_acquire()
        .expect("a permit on the target");
    let redirects = client.stats().redirects - before;
    assert!(exists_on(cluster, to, &KEYS.lock_bytes(name.as_bytes())));
    assert_eq!(redirects, 1, "one ASK, then the script on the target");
    drop(permit);
    migration.finish();
}
