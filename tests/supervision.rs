//! Panics inside the library: a contender, a release or a worker thread that panics must
//! leave no key stuck in its client, no `unlock` waiting for ever, and no worker dead
//! without anyone noticing.
//!
//! Faults are injected with `redbaton::fault` (the unstable `fault-injection` feature,
//! which the crate's tests turn on), scoped to one key prefix per test so that tests of
//! this binary running in parallel do not hit each other's clients. Where another process
//! holds the lock, it is played by a plain Redis connection (`SET ... PX`, `DEL`), so that
//! only the client under test runs with the prefix.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::thread;
use std::time::{Duration, Instant};

use redbaton::fault::{self, Point};
use redbaton::{LockClient, LostReason};
use redbaton_testkit::server::RedisServer;
use redbaton_testkit::{init_log, ms};
use redbaton_testkit::{lock_builder, lock_client};

fn client(srv: &RedisServer, prefix: &str) -> LockClient {
    lock_builder!(node(srv.url()), key_prefix(prefix))
        // Waiters must be woken by events, not by the safety net.
        .recheck_interval(Duration::from_secs(60))
        .build()
        .unwrap()
}

/// Another process takes `name`: a foreign token with a long lease.
fn hold_elsewhere(srv: &RedisServer, prefix: &str, name: &str) {
    let _: () = redis::cmd("SET")
        .arg(format!("{prefix}{{{name}}}"))
        .arg("foreign")
        .arg("PX")
        .arg(120_000)
        .query(&mut srv.conn())
        .unwrap();
}

fn release_elsewhere(srv: &RedisServer, prefix: &str, name: &str) {
    let _: i64 = redis::cmd("DEL")
        .arg(format!("{prefix}{{{name}}}"))
        .query(&mut srv.conn())
        .unwrap();
}

/// A thread of `c` waiting (up to 20 s) for `name`, which another process holds; returns
/// once it sleeps in its wait.
fn waiter_behind_foreign(
    srv: &RedisServer,
    c: &LockClient,
    prefix: &str,
    name: &'static str,
) -> thread::JoinHandle<Result<(), redbaton::Error>> {
    hold_elsewhere(srv, prefix, name);
    let c = c.clone();
    let waiter = thread::spawn(move || c.try_lock_for(name, Duration::from_secs(20)).map(drop));
    thread::sleep(ms(300));
    waiter
}

/// Runs `call` with a clone of `c` on a thread of its own, with the next pass through
/// [`Point::Contend`] in the clients of `prefix` armed to panic, and checks that it
/// panicked there.
fn panic_while_contending(
    prefix: &str,
    c: &LockClient,
    call: impl FnOnce(LockClient) + Send + 'static,
) {
    fault::arm(prefix, Point::Contend, 1);
    let c = c.clone();
    let panicked = thread::spawn(move || call(c)).join().is_err();
    fault::disarm(prefix, Point::Contend);
    assert!(panicked, "the injected fault fired");
}

fn wait_until(within: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + within;
    while !cond() {
        if Instant::now() >= deadline {
            return false;
        }
        thread::sleep(ms(10));
    }
    true
}

/// A contender that panics between its attempts leaves the key usable by its client: the
/// next call contends in Redis instead of queueing behind a contender that is gone. Its
/// queue entry (fair lock) or contention mark (plain lock) goes with it: holders would
/// otherwise see the name contended for the mark's lifetime.
#[test]
fn panicking_contender_does_not_strand_the_key() {
    init_log();
    const P: &str = "sv-contend:";
    let srv = RedisServer::start();
    for fair in [true, false] {
        let c = lock_builder!(node(srv.url()), key_prefix(P), fair(fair))
            .recheck_interval(Duration::from_secs(60))
            .build()
            .unwrap();
        hold_elsewhere(&srv, P, "k");
        panic_while_contending(P, &c, |c| {
            drop(c.try_lock_for("k", Duration::from_secs(20)))
        });
        let only_the_holders = || srv.keys_but_fences(&format!("{P}{{k}}*")).len() == 1;
        assert!(
            wait_until(Duration::from_secs(5), only_the_holders),
            "fair {fair}: {:?}",
            srv.keys_but_fences(&format!("{P}{{k}}*"))
        );
        release_elsewhere(&srv, P, "k");
        let guard = c
            .try_lock("k")
            .expect("the key is free and nobody local contends for it");
        guard.unlock().unwrap();
    }
}

/// The same for a read-write lock: a thread that contends in Redis for the write hold on
/// behalf of its process, and panics between its attempts, leaves the name usable by the
/// process's other threads, writers and readers. (Another client plays the other process:
/// it takes its write hold before the fault is armed, at its first attempt.)
#[test]
fn rw_contender_panic_does_not_strand_the_turn() {
    init_log();
    const P: &str = "sv-rw-contend:";
    let srv = RedisServer::start();
    let c = client(&srv, P);
    let other = client(&srv, P);
    let foreign = other
        .rwlock("rw")
        .write()
        .expect("the other process writes");
    panic_while_contending(P, &c, |c| {
        drop(c.rwlock("rw").try_write_for(Duration::from_secs(20)));
    });
    foreign.unlock().expect("the other process lets go");
    let guard = c
        .rwlock("rw")
        .try_write_for(Duration::from_secs(5))
        .expect("the name is free and no local thread contends for it");
    guard.unlock().unwrap();
    let read = c.rwlock("rw").try_read_for(ms(500));
    assert!(read.is_ok(), "read after the panic: {:?}", read.map(drop));
}

/// Threads queued locally behind a contender that panics: the first is promoted to
/// contend, gets the lock when the other process releases it, and passes it on.
#[test]
fn queued_waiters_survive_their_contender_panicking() {
    init_log();
    const P: &str = "sv-queue:";
    let srv = RedisServer::start();
    let c = client(&srv, P);
    let contender = waiter_behind_foreign(&srv, &c, P, "k");
    let waiters: Vec<_> = (0..3)
        .map(|_| {
            let c = c.clone();
            thread::spawn(move || {
                c.try_lock_for("k", Duration::from_secs(10)).map(|g| {
                    thread::sleep(ms(20));
                    drop(g);
                })
            })
        })
        .collect();
    thread::sleep(ms(300));
    fault::arm(P, Point::Contend, 1);
    srv.bounce(&format!("{P}{{k}}")); // the contender wakes, fails, and panics
    assert!(contender.join().is_err(), "the injected fault fired");
    fault::disarm(P, Point::Contend);
    release_elsewhere(&srv, P, "k");
    let released = Instant::now();
    for w in waiters {
        w.join().unwrap().expect("a queued waiter gets the lock");
    }
    eprintln!(
        "queued waiters served {:?} after the release",
        released.elapsed()
    );
    assert!(released.elapsed() < Duration::from_secs(8));
}

/// A critical section that panics under `with_lock` while other threads queue: the lock
/// goes to the next of them at once.
#[test]
fn panicking_critical_section_passes_the_lock_on() {
    init_log();
    const P: &str = "sv-section:";
    let srv = RedisServer::start();
    let c = client(&srv, P);
    let c2 = c.clone();
    let holder = thread::spawn(move || {
        c2.with_lock("k", || {
            thread::sleep(ms(300));
            panic!("the critical section fails");
        })
    });
    thread::sleep(ms(100));
    let c3 = c.clone();
    let waiter = thread::spawn(move || c3.try_lock_for("k", Duration::from_secs(5)).map(drop));
    assert!(holder.join().is_err());
    waiter
        .join()
        .unwrap()
        .expect("the queued waiter gets the lock");
    c.try_lock("k").expect("free again").unlock().unwrap();
}

/// A release that panics midway (after the local table marked the key as releasing):
/// the key is released in the background and usable by the same client at once.
#[test]
fn panicking_release_does_not_strand_the_key() {
    init_log();
    const P: &str = "sv-release:";
    let srv = RedisServer::start();
    let c = client(&srv, P);
    let guard = c.lock("k").unwrap();
    fault::arm(P, Point::Release, 1);
    let r = catch_unwind(AssertUnwindSafe(|| guard.unlock()));
    fault::disarm(P, Point::Release);
    assert!(r.is_err(), "the injected fault fired");
    let started = Instant::now();
    let guard = c
        .try_lock_for("k", Duration::from_secs(20))
        .expect("usable again");
    eprintln!("key usable again after {:?}", started.elapsed());
    // A stranded key would wait out the 30 s lease.
    assert!(started.elapsed() < Duration::from_secs(10));
    guard.unlock().unwrap();
}

/// The subscriber thread panics while a waiter sleeps: it is restarted, re-subscribes,
/// and the waiter is woken by the release, long before the re-check ceiling. Its new
/// connection counts as a reconnect.
#[test]
fn subscriber_panic_is_survived() {
    init_log();
    const P: &str = "sv-sub:";
    let srv = RedisServer::start();
    let c = client(&srv, P);
    let waiter = waiter_behind_foreign(&srv, &c, P, "k");
    let reconnects = c.stats().reconnects;
    fault::arm(P, Point::Subscriber, 1);
    thread::sleep(ms(500)); // it fires within a poll interval; the thread restarts
    fault::disarm(P, Point::Subscriber);
    release_elsewhere(&srv, P, "k");
    let released = Instant::now();
    assert!(
        wait_until(Duration::from_secs(5), || waiter.is_finished()),
        "the waiter was not woken by the release"
    );
    waiter.join().unwrap().expect("acquired after the release");
    eprintln!("woken {:?} after the release", released.elapsed());
    assert!(
        c.stats().reconnects > reconnects,
        "the restarted thread's connection"
    );

    // A new waiter after the restart is woken by events too.
    let waiter = waiter_behind_foreign(&srv, &c, P, "k2");
    release_elsewhere(&srv, P, "k2");
    assert!(wait_until(Duration::from_secs(5), || waiter.is_finished()));
    waiter.join().unwrap().expect("acquired after the release");
}

/// The watchdog panics once: it is restarted and the held lock keeps being renewed.
#[test]
fn watchdog_panic_is_survived() {
    init_log();
    const P: &str = "sv-dog:";
    let srv = RedisServer::start();
    let c = lock_client!(node(srv.url()), key_prefix(P), lease(ms(1000)));
    // The holder runs on its own thread: an unlock that hangs must fail the test, not
    // hang it.
    let (tx, rx) = crossbeam_channel::bounded(3);
    let c2 = c.clone();
    thread::spawn(move || {
        let guard = c2.lock("k").unwrap();
        fault::arm(P, Point::Watchdog, 1);
        thread::sleep(ms(2500)); // two and a half leases
        fault::disarm(P, Point::Watchdog);
        let _ = tx.send(format!("{:?}", guard.check()));
        let started = Instant::now();
        let _ = tx.send(format!("{:?}", guard.unlock()));
        let _ = tx.send(format!("{:?}", started.elapsed()));
    });
    let checked = rx.recv_timeout(Duration::from_secs(10)).expect("checked");
    assert_eq!(checked, "Ok(())", "still held: renewals went on");
    let unlocked = rx
        .recv_timeout(Duration::from_secs(5))
        .expect("unlock returns");
    assert_eq!(unlocked, "Ok(Released)");
    eprintln!("unlocked in {}", rx.recv().unwrap());
}

/// The watchdog panics at every pass: renewals cannot go on, and the holder is told
/// within one renew interval instead of when the lease runs out; unlock does not hang.
#[test]
fn watchdog_that_keeps_failing_tells_the_holder() {
    init_log();
    const P: &str = "sv-dog-dead:";
    let srv = RedisServer::start();
    let renew = ms(1000);
    let c = lock_client!(
        node(srv.url()),
        key_prefix(P),
        lease(Duration::from_secs(10)),
        renew_interval(renew)
    );
    // The holder runs on its own thread: an unlock that hangs must fail the test, not
    // hang it.
    let (tx, rx) = crossbeam_channel::bounded(2);
    let c2 = c.clone();
    thread::spawn(move || {
        let guard = c2.lock("k").unwrap();
        fault::arm(P, Point::Watchdog, u32::MAX);
        let reason = guard.lost().recv_timeout(renew + ms(1000));
        fault::disarm(P, Point::Watchdog);
        let _ = tx.send(format!("{reason:?}"));
        let _ = tx.send(format!("{:?}", guard.unlock()));
    });
    let reason = rx.recv_timeout(Duration::from_secs(10)).expect("told");
    assert_eq!(
        reason,
        format!("{:?}", Ok::<_, ()>(LostReason::WatchdogFailed))
    );
    let outcome = rx
        .recv_timeout(Duration::from_secs(5))
        .expect("unlock returns");
    eprintln!("unlock after the watchdog failed: {outcome}");
    // The restarted watchdog renews new locks again.
    let guard = c.lock("k").unwrap();
    thread::sleep(ms(2500));
    guard.check().expect("held");
    let pttl: i64 = redis::cmd("PTTL")
        .arg(format!("{P}{{k}}"))
        .query(&mut srv.conn())
        .unwrap();
    assert!(
        pttl > 8500,
        "renewed by the restarted watchdog: {pttl} ms left"
    );
}
