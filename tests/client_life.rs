//! The client's own background threads and the pauses of its call path: a shutdown that
//! comes while a worker waits to restart after its panics, a cleanup job that panics, a
//! wait still under way when its client shuts down, and a command refused with `READONLY`
//! sent again within its caller's deadline.
//!
//! Only the client's behaviour is tested here: one server kind is enough.
//!
//! Faults are injected with `redbaton::fault` (the crate's tests turn the unstable
//! `fault-injection` feature on), scoped to one key prefix per test so that tests running
//! in parallel do not hit each other's clients. Times are generous liveness bounds, never
//! speed claims.

use std::thread;
use std::time::{Duration, Instant};

use redbaton::fault::{self, Point};
use redbaton::{Error, LockClient};
use redbaton_testkit::keys::{Counter, Keys};
use redbaton_testkit::proxy::Proxy;
use redbaton_testkit::server::RedisServer;
use redbaton_testkit::wait::{wait_for, wait_until};
use redbaton_testkit::{lock_client, ms, secs, test_server};

/// A waiter of `c` (whose prefix `keys` has) for the lock `name` (for `wait` at most),
/// which a plain connection holds for `lease`; returns once the client's subscriber
/// thread serves the wait.
fn waiter_behind_foreign(
    srv: &RedisServer,
    c: &LockClient,
    (keys, name): (Keys, &'static str),
    lease: Duration,
    wait: Duration,
) -> thread::JoinHandle<Result<(), Error>> {
    let _: () = redis::cmd("SET")
        .arg(keys.lock(name))
        .arg("foreign")
        .arg("PX")
        .arg(lease.as_millis() as u64)
        .query(&mut srv.conn())
        .unwrap();
    let c = c.clone();
    let waiter = thread::spawn(move || c.try_lock_for(name, wait).map(drop));
    assert!(
        wait_until(secs(5), || !srv.subscribers().is_empty()),
        "the waiter subscribed"
    );
    waiter
}

/// A client of `srv` whose waiters are woken by events alone (the re-check is a minute
/// away), with the given read timeout.
fn waiting_client(srv: &RedisServer, prefix: &str, read_timeout: Duration) -> LockClient {
    lock_client!(
        node(srv.url()),
        key_prefix(prefix),
        recheck_interval(secs(60)),
        io_timeouts(read_timeout)
    )
}

#[test]
fn smoke() {
    let srv = test_server();
    let c = lock_client!(node(srv.url()), key_prefix("cl-smoke:"));
    c.with_lock("k", || ()).unwrap();
    c.shutdown(secs(5)).unwrap();
}

/// A worker that panicked again and again waits up to seconds before its next restart; a
/// shutdown during that pause ends it at once instead of waiting it out.
#[test]
fn shutdown_ends_a_crashed_workers_restart_pause() {
    const P: &str = "cl-pause:";
    let srv = test_server();
    let c = waiting_client(&srv, P, secs(10));
    let waiter = waiter_behind_foreign(&srv, &c, (Keys::new(P), "k"), secs(60), secs(3));
    let before = c.stats().reconnects;
    // Each restart reconnects and panics at once; the pauses between them double from
    // 10 ms: after the seventh restart, the next pause is over a second.
    fault::arm(P, Point::Subscriber, u32::MAX);
    let crashed = wait_until(secs(10), || c.stats().reconnects >= before + 7);
    thread::sleep(ms(50)); // the restart's panic, and into the pause
    fault::disarm(P, Point::Subscriber);
    assert!(crashed, "the subscriber restarted after its panics");
    let restarts = c.stats().reconnects - before;
    let started = Instant::now();
    let shut = c.shutdown(ms(300));
    eprintln!(
        "shutdown: {shut:?} in {:?} ({} restarts)",
        started.elapsed(),
        restarts
    );
    assert_eq!(
        format!("{shut:?}"),
        "Ok(())",
        "the shutdown waited out the restart pause"
    );
    // The waiter keeps its own deadline.
    assert!(waiter.join().unwrap().is_err(), "the lock stayed held");
}

/// A call to a replica is refused with `READONLY` and sent again after a pause; the pause
/// does not outlast the caller's deadline. Of a few calls with a short deadline, the
/// fastest must end well before a whole pause: the pause is the only wait that long.
#[test]
fn readonly_pause_keeps_the_deadline() {
    let srv = test_server();
    let replica = srv.start_replica();
    let c = lock_client!(node(replica.url()), key_prefix("cl-ro:"));
    let deadline = ms(5);
    let mut fastest = Duration::MAX;
    for i in 0..5 {
        let started = Instant::now();
        let got = c.try_lock_for(format!("k{i}"), deadline).map(drop);
        let took = started.elapsed();
        eprintln!("{got:?} in {took:?}");
        assert!(got.is_err(), "a replica takes no lock");
        fastest = fastest.min(took);
    }
    assert!(
        fastest < ms(45),
        "every call with a {deadline:?} deadline took {fastest:?} or more"
    );
}

/// The cleanup job of a lost reply panics: the later jobs of the client are still made.
/// Two attempts whose replies were lost took their locks (for a lease of a minute, their
/// fences say so); the give-back of the first panics, the second's still frees its lock.
#[test]
fn a_panicking_cleanup_job_does_not_stop_the_later_ones() {
    const P: &str = "cl-cleanup:";
    const KEYS: Keys = Keys::new(P);
    let srv = test_server();
    let proxy = Proxy::start(srv.addr());
    let c = lock_client!(node(proxy.url()), key_prefix(P), lease(secs(60)));
    let other = lock_client!(node(srv.url()), key_prefix(P));
    // Connections and scripts ready, so that the lost replies are the attempts'.
    drop(c.lock("warm-up").expect("warm-up"));
    fault::arm(P, Point::Cleanup, 1);
    for name in ["lost-one", "lost-two"] {
        let got = proxy.losing_replies_matching(name.as_bytes(), || c.try_lock(name).map(drop));
        assert!(got.is_err(), "{name}: the replies were lost");
        let fence = Counter::read(&mut srv.conn(), KEYS.fence(name).as_bytes());
        assert!(fence.is_some(), "{name}: the lost attempt took the lock");
    }
    wait_for(secs(10), "the second give-back", || {
        other.try_lock("lost-two").is_ok()
    });
    fault::disarm(P, Point::Cleanup);
    // The job that panicked is not made again: its lock expires with its lease.
    assert!(
        other.try_lock("lost-one").is_err(),
        "the first lock is still held"
    );
}

/// A wait under way when its client shuts down keeps its own deadline, and the
/// subscriptions it slept on are gone: it still notices the holder's lease end (at its
/// next look, bounded by what is left of the lease), not a read timeout later, waiting for
/// confirmations that no stopped subscriber sends.
#[test]
fn a_wait_under_way_at_shutdown_notices_the_lease_end() {
    const P: &str = "cl-shut-wait:";
    let srv = test_server();
    let read_timeout = secs(6);
    let c = waiting_client(&srv, P, read_timeout);
    let lease_left = ms(1000);
    let set = Instant::now();
    let waiter = waiter_behind_foreign(&srv, &c, (Keys::new(P), "k"), lease_left, secs(8));
    c.shutdown(secs(5)).expect("shut down");
    let got = waiter.join().unwrap();
    let took = set.elapsed();
    eprintln!("{got:?} {took:?} after the foreign hold was set");
    assert!(got.is_ok(), "the lease ended within the wait: {got:?}");
    assert!(
        took < lease_left + read_timeout / 2,
        "the lease end was noticed {took:?} after the hold was set"
    );
}
