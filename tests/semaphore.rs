//! Semaphores against a real redis-server: never more holders than permits across
//! processes (intervals on one system-wide monotonic clock), a SIGKILLed holder's permit
//! returning after its lease, the permit count rule, and the cost of idle waiters.

use std::thread;
use std::time::Duration;

use redbaton::{LockClient, Unlocked};
use redbaton_testkit::child;
use redbaton_testkit::child_only;
use redbaton_testkit::intervals::{self, Recorder};
use redbaton_testkit::lock_client;
use redbaton_testkit::ms;
use redbaton_testkit::test_server;
use redbaton_testkit::wait::join_all;

const PREFIX: &str = "sem:";

/// A client whose keys carry the prefix of the semaphore tests.
fn sem_client(url: &str) -> LockClient {
    lock_client!(node(url), key_prefix(PREFIX))
}

#[test]
fn smoke() {
    let srv = test_server();
    let c = sem_client(&srv.url());
    let sem = c.semaphore("smoke", 2);
    let a = sem.acquire().expect("first");
    let b = sem.try_acquire().expect("second");
    assert!(sem.try_acquire().unwrap_err().is_would_block());
    a.check().expect("held");
    assert_eq!(a.unlock().expect("unlock"), Unlocked::Released);
    let c2 = sem.try_acquire().expect("a permit came back");
    drop((b, c2));
    assert!(srv.keys("sem:*").is_empty(), "{:?}", srv.keys("sem:*"));
}

#[test]
fn permit_count_must_match_while_held() {
    let srv = test_server();
    let c = sem_client(&srv.url());
    let p = c.semaphore("count", 3).acquire().expect("permit");
    let err = c.semaphore("count", 4).try_acquire().unwrap_err();
    assert!(err.is_permits_mismatch(), "{err}");
    assert!(
        c.semaphore("count", 0)
            .try_acquire()
            .unwrap_err()
            .is_invalid_input()
    );
    drop(p);
    // Nobody holds it: the next holder's count is the one.
    let p = c.semaphore("count", 4).acquire().expect("new count");
    drop(p);
}

/// A child of the bound test: 4 threads taking a permit over and over, sections printed.
#[test]
fn child_permits() {
    child_only!();
    let c = sem_client(&child::env("REDIS_URL"));
    let iters: usize = child::env("ITERS").parse().unwrap();
    Recorder::new().run_threads_and_print(4, |held| {
        let sem = c.semaphore("bound", 3);
        for _ in 0..iters {
            let p = sem.acquire().expect("permit");
            held.time("p", || {
                thread::sleep(Duration::from_micros(rand::random_range(200..=2000)))
            });
            p.check().expect("held");
            drop(p);
        }
    });
}

#[test]
fn never_more_holders_than_permits_across_processes() {
    let srv = test_server();
    let envs = [("REDIS_URL", srv.url()), ("ITERS", "30".to_owned())];
    let held = intervals::from_children("child_permits", 4, &envs, Duration::from_secs(120));
    assert_eq!(2 * held.len(), 2 * 4 * 4 * 30);
    let most = intervals::most_at_once(&held);
    eprintln!("at most {most} holders at once");
    assert!(most <= 3, "{most} holders at once");
    assert!(most >= 2, "permits were never held together");
}

/// A child that takes a permit, says so, and holds it until killed.
#[test]
fn child_permit_holds() {
    child::hold_until_killed(|url| {
        lock_client!(node(url), key_prefix(PREFIX), lease(Duration::from_secs(2)))
            .semaphore("crash", 3)
            .acquire()
            .expect("permit")
    });
}

#[test]
fn a_killed_holders_permit_returns_after_its_lease() {
    let srv = test_server();
    let lease = Duration::from_secs(2);
    let holder = child::spawn_holder("child_permit_holds", srv.url());
    let c = lock_client!(node(srv.url()), key_prefix(PREFIX), lease(lease));
    let sem = c.semaphore("crash", 3);
    let a = sem.acquire().expect("second permit");
    let url = srv.url();
    let b = thread::spawn(move || {
        let c = lock_client!(node(url), key_prefix(PREFIX), lease(lease));
        let p = c.semaphore("crash", 3).acquire().expect("third permit");
        // Held past the killed holder's lease: renewed, unaffected.
        thread::sleep(lease + ms(500));
        p.check().expect("held");
        p.unlock().unwrap()
    });
    thread::sleep(ms(100));
    let killed = child::kill_and_reap(holder);
    let p = sem
        .try_acquire_for(Duration::from_secs(30))
        .expect("the killed holder's permit");
    let after = killed.elapsed();
    eprintln!("permit back {after:?} after the holder was killed");
    assert!(after <= lease + Duration::from_secs(1), "{after:?}");
    a.check().expect("held");
    assert_eq!(b.join().unwrap(), Unlocked::Released);
    drop((a, p));
}

/// 20 idle waiters on a full semaphore cost Redis almost nothing.
#[test]
fn idle_waiters_cost_almost_no_commands() {
    let srv = test_server();
    let holder = sem_client(&srv.url());
    let p = holder.semaphore("idle", 1).acquire().expect("permit");
    let waiters = sem_client(&srv.url());
    let handles: Vec<_> = (0..20)
        .map(|_| {
            let c = waiters.clone();
            thread::spawn(move || {
                c.semaphore("idle", 1)
                    .try_acquire_for(Duration::from_secs(20))
                    .map(drop)
            })
        })
        .collect();
    let spent = srv.idle_cost("20 idle waiters");
    assert!(spent < 10, "{spent} commands: {:?}", srv.commandstats());
    drop(p);
    for h in handles {
        h.join()
            .unwrap()
            .expect("every waiter got a permit in turn");
    }
}

/// The threads of one process wait for a permit one at a time in Redis: a freed permit
/// costs one attempt per process, not one per waiting thread. Eight threads of one client
/// take a one-permit semaphore in turn; each fails twice (its attempts before and after
/// subscribing, while the previous one holds): 16, where waking all of them at each
/// release failed 44 times.
#[test]
fn local_waiters_take_turns_for_a_permit() {
    let srv = test_server();
    let waiters = sem_client(&srv.url());
    let holder = sem_client(&srv.url());
    let first = holder.semaphore("one", 1).acquire().expect("permit");
    let before = waiters.stats();
    let done: Vec<_> = (0..8)
        .map(|_| {
            let c = waiters.clone();
            thread::spawn(move || {
                let p = c
                    .semaphore("one", 1)
                    .try_acquire_for(Duration::from_secs(20))
                    .expect("permit in turn");
                thread::sleep(ms(20));
                drop(p);
            })
        })
        .collect();
    thread::sleep(ms(200));
    drop(first);
    join_all(done, "waiter");
    let s = waiters.stats();
    let failed = s.failed_attempts - before.failed_attempts;
    eprintln!("failed attempts: {failed}; {s:?}");
    assert!(
        failed <= 24,
        "{failed} failed attempts for 8 permits in turn"
    );
}
