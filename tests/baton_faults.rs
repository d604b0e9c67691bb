//! The baton (the local handoff of a held lock) and the local turns of a read-write lock
//! under faults, against a real redis-server: a server that stalls while a thread queues
//! behind a local holder or checks a turn's budget, a lock deleted under its holder just
//! before it is handed on or on its way, `shutdown` with threads queued, a waiter that
//! gives up or panics as the baton reaches it.
//!
//! What the file shows: a thread waiting for a local turn keeps its deadline whatever the
//! server does (a handoff sends nothing to Redis, so nothing on its path may wait for
//! Redis past the deadline), a thread handed a lock that is gone is told through its own
//! `lost()` channel, a lock nothing renews is never handed on as live, and a lock is never
//! left held by a thread that gave up.
//!
//! Times are generous liveness bounds, never speed claims.

use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use redbaton::fault::{self, Point};
use redbaton::{Builder, LockClient, LockGuard, Unlocked};
use redbaton_testkit::keys::Keys;
use redbaton_testkit::server::RedisServer;
use redbaton_testkit::wait::wait_for;
use redbaton_testkit::{init_log, lock_builder, ms, secs, test_server};

const PREFIX: &str = "bf:";
const KEYS: Keys = Keys::new(PREFIX);
/// Liveness bound of the waits of the test itself (never a speed claim).
const LIVENESS: Duration = Duration::from_secs(20);

/// The tests that stop or fail a handoff at [`Point::Handoff`] run one at a time: the
/// point is armed for the file's prefix, which they share.
fn handoff_faults() -> MutexGuard<'static, ()> {
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

/// Clients of `srv` under this file's prefix, with long leases (nothing expires unless a
/// test makes it) and a long read timeout (a call to a stalled server waits that long).
fn builder(srv: &RedisServer) -> Builder {
    lock_builder!(
        node(srv.url()),
        key_prefix(PREFIX),
        patient(),
        read_timeout(secs(30))
    )
}

fn client(srv: &RedisServer) -> LockClient {
    builder(srv).build().expect("client")
}

/// For a test that stops a handoff on its way: its turn (see [`handoff_faults`]), a server
/// of its own, and a client of it whose holds are not renewed (they expire after `lease`)
/// and whose calls to a stalled server give up after `read_timeout`.
fn unrenewed(
    lease: Duration,
    read_timeout: Duration,
) -> (MutexGuard<'static, ()>, RedisServer, LockClient) {
    let one = handoff_faults();
    init_log();
    let srv = test_server();
    let c = builder(&srv)
        .lease(lease)
        .read_timeout(read_timeout)
        .auto_renew(false)
        .build()
        .expect("client");
    (one, srv, c)
}

/// Hands `held` on to the thread queued for `name`, and stops the baton as it reaches it.
fn hand_on_stopped(srv: &RedisServer, name: &str, held: LockGuard) {
    wait_for(LIVENESS, "the waiter queues", || subscribed(srv, name));
    fault::stall(PREFIX, Point::Handoff);
    assert_eq!(held.unlock().expect("unlock"), Unlocked::HandedOff);
    wait_for(LIVENESS, "the baton reaches the waiter", || {
        fault::stalled(PREFIX, Point::Handoff)
    });
}

/// A server of its own, a client of it, and `name` held by that client.
fn holding(name: &str) -> (RedisServer, LockClient, LockGuard) {
    init_log();
    let srv = test_server();
    let c = client(&srv);
    let held = c.lock(name).expect("lock");
    (srv, c, held)
}

/// Whether the client holds a subscription to the keyspace channel of `name`'s lock key
/// (a thread queued behind a local holder makes one).
fn subscribed(srv: &RedisServer, name: &str) -> bool {
    let channel = format!("__keyspace@0__:{}", KEYS.lock(name));
    let mut conn = srv.conn();
    let counts: Vec<(String, i64)> = redis::cmd("PUBSUB")
        .arg("NUMSUB")
        .arg(&channel)
        .query(&mut conn)
        .expect("PUBSUB NUMSUB");
    counts.iter().any(|(_, n)| *n > 0)
}

/// A lock is handed to a queued thread, which then releases it in Redis.
#[test]
fn smoke() {
    let (srv, c, held) = holding("smoke");
    let token = held.fencing_token();
    std::thread::scope(|s| {
        let waiter = s.spawn(|| {
            let g = c.try_lock_for("smoke", LIVENESS).expect("handed the lock");
            assert!(g.fencing_token() > token);
            g.unlock().expect("unlock")
        });
        wait_for(LIVENESS, "the waiter queues", || subscribed(&srv, "smoke"));
        assert_eq!(held.unlock().expect("unlock"), Unlocked::HandedOff);
        assert_eq!(waiter.join().expect("waiter"), Unlocked::Released);
    });
    drop(c.try_lock("smoke").expect("free again"));
}

/// The first thread to queue behind a local holder reads the key's contention mark once
/// the key's subscription is confirmed. When the subscription is confirmed already (it
/// lingers after an earlier wait) and the server has stopped answering, that read must not
/// keep the thread past its deadline: its `try_lock_for` returns `Timeout` about when
/// asked, not after the client's read timeout.
#[test]
fn a_thread_queued_while_the_server_stalls_keeps_its_deadline() {
    let name = "stall";
    // An earlier wait behind a local holder leaves the key subscribed for a while.
    let (srv, c, held) = holding(name);
    std::thread::scope(|s| {
        let waiter = s.spawn(|| c.lock(name).expect("handed the lock").unlock());
        wait_for(LIVENESS, "the waiter queues", || subscribed(&srv, name));
        assert_eq!(held.unlock().expect("unlock"), Unlocked::HandedOff);
        waiter.join().expect("waiter").expect("unlock");
    });
    let held = c.lock(name).expect("lock again");
    srv.pause();
    let (waited, took) = std::thread::scope(|s| {
        s.spawn(|| {
            let asked = Instant::now();
            (c.try_lock_for(name, ms(300)).map(drop), asked.elapsed())
        })
        .join()
        .expect("waiter")
    });
    srv.resume();
    assert!(
        matches!(waited, Err(ref e) if e.is_timeout()),
        "a wait behind a local holder: {waited:?}"
    );
    // The read timeout is 30 s: a wait that sat on a read ends long after this.
    assert!(took < secs(10), "a 300 ms wait returned after {took:?}");
    drop(held);
}

/// A lock deleted in Redis under its holder (by hand, by `force_release`) and handed to a
/// queued thread before the watchdog's next renewal finds it gone: the thread that holds it
/// now is the one told, on its own `lost()` channel, and its `check()` fails; meanwhile
/// another process may have taken the name.
#[test]
fn a_lock_deleted_just_before_the_handoff_is_reported_to_the_new_holder() {
    init_log();
    let srv = test_server();
    let c = builder(&srv)
        .renew_interval(ms(300))
        .build()
        .expect("client");
    let other = client(&srv);
    let name = "deleted";
    let held = c.lock(name).expect("lock");
    std::thread::scope(|s| {
        let waiter = s.spawn(|| {
            let g = c.lock(name).expect("handed the lock");
            let told = g.lost().recv_timeout(LIVENESS);
            (told, g.check())
        });
        wait_for(LIVENESS, "the waiter queues", || subscribed(&srv, name));
        let _: () = redis::cmd("DEL")
            .arg(KEYS.lock(name))
            .query(&mut srv.conn())
            .expect("DEL");
        // The renewal due next finds the key gone; the release comes first.
        assert_eq!(held.unlock().expect("unlock"), Unlocked::HandedOff);
        let taken = other.try_lock_for(name, LIVENESS).expect("the key is free");
        let (told, checked) = waiter.join().expect("waiter");
        assert!(told.is_ok(), "the new holder was not told: {told:?}");
        assert!(checked.is_err(), "check() after the loss: {checked:?}");
        drop(taken);
    });
}

/// A lock whose lease runs out between its handoff and the moment the thread it was handed
/// to takes it (a thread that wakes late, a giver slowed down on its way) is no lock to
/// return as held: that thread contends again, within its deadline, and returns a lock it
/// holds, as an attempt in Redis that came back too late is not returned either.
#[test]
fn a_baton_whose_lease_ran_out_on_its_way_is_not_returned_as_held() {
    let lease = secs(4);
    let (_one, srv, c) = unrenewed(lease, secs(2));
    let name = "late-baton";
    let held = c.lock(name).expect("lock");
    std::thread::scope(|s| {
        let waiter = s.spawn(|| {
            let g = c.try_lock_for(name, LIVENESS).expect("a lock");
            let live = g.check().is_ok() && g.valid_until() > Instant::now();
            (live, g.unlock())
        });
        hand_on_stopped(&srv, name, held);
        std::thread::sleep(lease + ms(500));
        fault::disarm(PREFIX, Point::Handoff);
        let (live, unlocked) = waiter.join().expect("waiter");
        assert!(live, "a lock returned whose lease had run out");
        assert_eq!(unlocked.expect("unlock"), Unlocked::Released);
    });
}

/// `shutdown` while threads queue behind a local holder: the holder is told its lock is
/// lost (nothing renews it any more), so it is not handed on as a live lock when released;
/// each queued thread ends, with an error or a guard already told it is lost, and the
/// name is free in Redis at the end.
#[test]
fn threads_queued_at_shutdown_end_and_are_never_handed_a_live_lock() {
    let name = "shutdown";
    let (srv, c, held) = holding(name);
    std::thread::scope(|s| {
        let waiters: Vec<_> = (0..3)
            .map(|_| {
                s.spawn(|| match c.try_lock_for(name, LIVENESS) {
                    Ok(g) => {
                        let told = g.lost().recv_timeout(LIVENESS).is_ok();
                        Ok((told, g.check().is_err(), g.unlock().map(|u| u.was_held())))
                    }
                    Err(e) => Err(e),
                })
            })
            .collect();
        wait_for(LIVENESS, "the waiters queue", || subscribed(&srv, name));
        c.clone().shutdown(secs(5)).expect("shutdown in time");
        assert!(held.is_lost(), "a hold nothing renews any more");
        assert_ne!(held.unlock().expect("unlock"), Unlocked::HandedOff);
        for w in waiters {
            match w.join().expect("waiter") {
                Ok((told, lost, _)) => assert!(told && lost, "a guard after shutdown, not lost"),
                Err(e) => assert!(e.is_shut_down(), "{e:?}"),
            }
        }
    });
    assert!(
        srv.keys_but_fences(&KEYS.lock_pattern()).is_empty(),
        "keys left: {:?}",
        srv.keys_but_fences(&KEYS.lock_pattern())
    );
}

/// A queued thread's deadline, or a cancel, lands just as the holder releases: either the
/// thread returns a guard of a live lock, or it returns `Timeout`/`Cancelled` and nobody
/// holds the lock (it was never left to a thread that had gone). Rounds vary the moment.
#[test]
fn a_waiter_leaving_as_the_baton_reaches_it_never_strands_the_lock() {
    init_log();
    let srv = test_server();
    let c = client(&srv);
    let name = "race";
    let (mut handed, mut left) = (0, 0);
    for round in 0..60u64 {
        let held = c.lock(name).expect("lock");
        let cancel = redbaton::Cancel::new();
        let queued_at = Instant::now();
        let outcome = std::thread::scope(|s| {
            let waiter = s.spawn(|| {
                let got = if round % 2 == 0 {
                    c.try_lock_for(name, ms(20))
                } else {
                    c.lock_cancellable(name, &cancel)
                };
                got.map(|g| (g.check().is_ok(), g.unlock().expect("unlock")))
            });
            // Around the waiter's deadline (or cancel), a little before or after it.
            let at = queued_at + ms(16) + Duration::from_micros(round * 150);
            std::thread::sleep(at.saturating_duration_since(Instant::now()));
            if round % 2 == 1 {
                s.spawn(|| cancel.cancel());
            }
            held.unlock().expect("unlock");
            waiter.join().expect("waiter")
        });
        match outcome {
            Ok((live, unlocked)) => {
                assert!(live, "round {round}: a guard of a lost lock");
                assert!(unlocked.was_held(), "round {round}: {unlocked:?}");
                handed += 1;
            }
            Err(e) => {
                assert!(e.is_timeout() || e.is_cancelled(), "round {round}: {e:?}");
                left += 1;
            }
        }
        // Free at once, in this process and in Redis.
        std::thread::scope(|s| {
            s.spawn(|| drop(c.try_lock(name).expect("free after the round")));
        });
        assert!(srv.keys_but_fences(&KEYS.lock_pattern()).is_empty());
    }
    eprintln!("{handed} handed the lock, {left} left without it");
}

/// A read-write lock's hold, once its budget is spent, is checked in Redis (does another
/// process wait?) by the next local thread that wants a turn. On a server that has stopped
/// answering, that check must not keep the thread past its own deadline either.
#[test]
fn a_budget_check_on_a_stalled_server_keeps_the_callers_deadline() {
    init_log();
    let srv = test_server();
    let c = builder(&srv).handoff_slice(ms(50)).build().expect("client");
    let rw = c.rwlock("rw-stall");
    let reading = rw.read().expect("read");
    // The read hold's time slice runs out: the next turn asks Redis first.
    std::thread::sleep(ms(100));
    srv.pause();
    let (waited, took) = std::thread::scope(|s| {
        s.spawn(|| {
            let asked = Instant::now();
            (rw.try_read_for(ms(300)).map(drop), asked.elapsed())
        })
        .join()
        .expect("reader")
    });
    srv.resume();
    eprintln!("second reader: {waited:?} after {took:?}");
    // The read timeout is 30 s: a turn that sat on a read ends long after this.
    assert!(took < secs(10), "a 300 ms wait returned after {took:?}");
    drop(reading);
}

/// A panic in the thread a lock is handed to, before it returns the lock (its logger
/// failing as it is told the lock was lost on its way, say): the lock is let go, so the
/// name stays usable, in this process and in others.
#[test]
fn a_panic_as_the_baton_arrives_never_strands_the_lock() {
    let _one = handoff_faults();
    let name = "baton-panic";
    let (srv, c, held) = holding(name);
    let other = client(&srv);
    std::thread::scope(|s| {
        let waiter = s.spawn(|| c.try_lock_for(name, LIVENESS).map(drop));
        wait_for(LIVENESS, "the waiter queues", || subscribed(&srv, name));
        fault::arm(PREFIX, Point::Handoff, 1);
        assert_eq!(held.unlock().expect("unlock"), Unlocked::HandedOff);
        assert!(waiter.join().is_err(), "the waiter panics");
    });
    fault::disarm(PREFIX, Point::Handoff);
    let again = c.try_lock_for(name, secs(5)).expect("this process again");
    assert!(again.unlock().expect("unlock").was_held());
    let elsewhere = other.try_lock_for(name, secs(5)).expect("another process");
    assert!(elsewhere.unlock().expect("unlock").was_held());
}

/// A lock handed on whose lease ran out on its way, while the server stalls: the thread it
/// was handed to gives it back without waiting for the server past its own deadline (the
/// release is left to the cleanup thread), and returns by then.
#[test]
fn a_baton_expired_on_its_way_while_the_server_stalls_keeps_the_deadline() {
    let (name, lease) = ("late-stalled", secs(12));
    // A call to the stalled server waits out the read timeout.
    let (_one, srv, c) = unrenewed(lease, secs(10));
    let held = c.lock(name).expect("lock");
    let asked = Instant::now();
    std::thread::scope(|s| {
        let waiter = s.spawn(|| (c.try_lock_for(name, secs(14)).map(drop), asked.elapsed()));
        hand_on_stopped(&srv, name, held);
        srv.pause();
        std::thread::sleep(lease + ms(500));
        fault::disarm(PREFIX, Point::Handoff);
        let (took, waited) = waiter.join().expect("waiter");
        srv.resume();
        assert!(took.as_ref().is_err_and(|e| e.is_timeout()), "{took:?}");
        // Past its deadline by the read timeout, had it waited for the server.
        assert!(waited < secs(18), "waited {waited:?} for a 14 s deadline");
    });
}
