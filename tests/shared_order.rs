//! The order in which a read-write lock's waiting writers, and a semaphore's waiting
//! permit-seekers, are granted: the order they came in, whatever their re-check interval
//! and however often they re-checked meanwhile. A waiter that stops re-checking (its
//! process crashed) holds the others back no longer than its mark lives.
//!
//! Real `redis-server`; each waiter is a client of its own (its own client id and
//! subscriber, as a process would have), so each waits in Redis. No assertion on how long
//! anything took: each test checks who got the hold in which order, with generous
//! liveness bounds only.

use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::Duration;

use redbaton::{LockClient, Unlocked};
use redbaton_testkit::proxy::Proxy;
use redbaton_testkit::server::RedisServer;
use redbaton_testkit::wait::{join_within, wait_for};
use redbaton_testkit::{lock_client, ms, secs, test_server};

const PREFIX: &str = "order:";
const WAITING: &str = "order:{k}:ww";
const ARRIVALS: &str = "order:{k}:wa";
/// A re-check interval much shorter than the wait: its waiters re-check several times.
const SHORT: u64 = 80;
/// A re-check interval longer than the whole wait: its waiters mark themselves once.
const LONG: u64 = 5_000;

fn client(url: &str, recheck_ms: u64) -> LockClient {
    lock_client!(
        node(url),
        key_prefix(PREFIX),
        lease(secs(10)),
        recheck_interval(ms(recheck_ms))
    )
}

/// What the waiters wait for on name `k`.
#[derive(Clone, Copy)]
enum Kind {
    Write,
    Permit,
}

impl Kind {
    /// Takes the hold on `c` at once; the release of that hold.
    fn hold(self, c: &LockClient) -> Box<dyn FnOnce()> {
        match self {
            Kind::Write => {
                let g = c.rwlock("k").write().expect("the write hold");
                Box::new(move || assert_eq!(g.unlock().expect("release"), Unlocked::Released))
            }
            Kind::Permit => {
                let p = c.semaphore("k", 1).acquire().expect("the permit");
                Box::new(move || assert_eq!(p.unlock().expect("release"), Unlocked::Released))
            }
        }
    }

    /// Takes the hold on `c`, waiting up to `within`, then keeps it a moment; `None` if
    /// the wait ended without it.
    fn take_and_keep(self, c: &LockClient, within: Duration) -> Option<()> {
        let keep = ms(30);
        match self {
            Kind::Write => {
                let g = c.rwlock("k").try_write_for(within).ok()?;
                thread::sleep(keep);
                g.unlock().expect("release the write hold");
            }
            Kind::Permit => {
                let p = c.semaphore("k", 1).try_acquire_for(within).ok()?;
                thread::sleep(keep);
                p.unlock().expect("release the permit");
            }
        }
        Some(())
    }
}

/// A waiter `id` on `c` in a thread of its own, which records `id` in `order` when it gets
/// the hold; waits until its mark is the `marks`-th in the waiting set.
fn waiter(
    srv: &RedisServer,
    kind: Kind,
    c: LockClient,
    id: usize,
    marks: usize,
    order: &Arc<Mutex<Vec<usize>>>,
) -> JoinHandle<()> {
    let order = Arc::clone(order);
    let h = thread::spawn(move || {
        if kind.take_and_keep(&c, secs(20)).is_some() {
            order.lock().unwrap().push(id);
        }
    });
    wait_for(secs(10), "the waiter's mark", || {
        srv.zcard(WAITING) >= marks
    });
    // Marks of one millisecond apart at least: arrivals are told apart.
    thread::sleep(ms(20));
    h
}

/// Waiters with these re-check intervals (ms) come, in this order, while a holder holds
/// `kind` on "k"; they wait while the short ones re-check several times, then the holder
/// releases. Returns the order (by index) in which they got the hold. `prepare` runs on
/// the server before anything else.
fn granted_order(kind: Kind, rechecks: &[u64], prepare: fn(&RedisServer)) -> Vec<usize> {
    let srv = test_server();
    prepare(&srv);
    let holder = client(&srv.url(), SHORT);
    let release = kind.hold(&holder);
    let order = Arc::new(Mutex::new(Vec::new()));
    let waiters: Vec<_> = rechecks
        .iter()
        .enumerate()
        .map(|(i, &r)| waiter(&srv, kind, client(&srv.url(), r), i, i + 1, &order))
        .collect();
    // Every short waiter re-checks (and renews its mark) several times.
    thread::sleep(ms(SHORT * 6));
    release();
    join_within(waiters, secs(30), "the waiters");
    let order = order.lock().unwrap().clone();
    println!(
        "{kind}: re-checks {rechecks:?} granted in order {order:?}",
        kind = match kind {
            Kind::Write => "writers",
            Kind::Permit => "permit-seekers",
        }
    );
    order
}

#[test]
fn smoke() {
    let srv = test_server();
    let c = client(&srv.url(), SHORT);
    let g = c.rwlock("k").write().expect("write");
    g.unlock().expect("release");
    let p = c.semaphore("s", 1).acquire().expect("permit");
    p.unlock().expect("release");
}

#[test]
fn a_writer_with_a_long_recheck_is_granted_before_later_writers() {
    let order = granted_order(Kind::Write, &[LONG, SHORT, SHORT], |_| ());
    assert_eq!(order, [0, 1, 2], "writers granted out of arrival order");
}

#[test]
fn a_permit_seeker_with_a_long_recheck_is_granted_before_later_ones() {
    let order = granted_order(Kind::Permit, &[LONG, SHORT, SHORT], |_| ());
    assert_eq!(
        order,
        [0, 1, 2],
        "permit-seekers granted out of arrival order"
    );
}

#[test]
fn waiters_that_recheck_keep_their_places() {
    for kind in [Kind::Write, Kind::Permit] {
        let order = granted_order(kind, &[SHORT, LONG, SHORT, SHORT], |_| ());
        assert_eq!(order, [0, 1, 2, 3], "waiters granted out of arrival order");
    }
}

/// The arrivals' key holding a value of another type (another program's key of the same
/// name): the waiters are still granted, each in turn, in the order their marks expire.
#[test]
fn arrivals_of_another_type_fail_nobody() {
    for kind in [Kind::Write, Kind::Permit] {
        let order = granted_order(kind, &[SHORT, LONG, SHORT], |srv| {
            let mut conn = srv.conn();
            redis::cmd("SET")
                .arg(ARRIVALS)
                .arg("another program's")
                .query::<()>(&mut conn)
                .expect("SET");
        });
        let mut sorted = order.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, [0, 1, 2], "every waiter granted once: {order:?}");
    }
}

/// A waiter whose process stops (its link to Redis cut: it neither re-checks nor leaves)
/// came first; once its mark expired, the release of the hold grants the next one, rather
/// than leaving it for its re-check.
#[test]
fn a_crashed_waiter_holds_nobody_back_past_its_mark() {
    for kind in [Kind::Write, Kind::Permit] {
        let srv = test_server();
        let holder = client(&srv.url(), SHORT);
        let release = kind.hold(&holder);
        let proxy = Proxy::start(srv.addr());
        let order = Arc::new(Mutex::new(Vec::new()));
        let crashed = waiter(&srv, kind, client(&proxy.url(), 250), 0, 1, &order);
        proxy.blackhole(true);
        // The next one re-checks only long after the test: a grant alone lets it in soon.
        let next = waiter(&srv, kind, client(&srv.url(), LONG), 1, 2, &order);
        // The crashed waiter's mark (two re-check intervals) expires.
        thread::sleep(ms(250 * 3));
        release();
        wait_for(secs(3), "the next waiter granted", || {
            order.lock().unwrap().as_slice() == [1]
        });
        proxy.blackhole(false);
        join_within(vec![next, crashed], secs(30), "the waiters");
    }
}
