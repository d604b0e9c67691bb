//! Semaphores and countdown latches under faults, against real `redis-server` processes:
//! a server restarted or its connections killed under holders and waiters, permit counts
//! that differ between processes, extreme counts.

use std::thread;
use std::time::{Duration, Instant};

use redbaton::{Cancel, LockClient, Semaphore, Unlocked};
use redbaton_testkit::keys::Keys;
use redbaton_testkit::proxy::Proxy;
use redbaton_testkit::server::RedisServer;
use redbaton_testkit::wait::wait_for;
use redbaton_testkit::{lock_client, ms, secs, test_server};

const PREFIX: &str = "pf:";
const KEYS: Keys = Keys::new(PREFIX);

/// A client whose waits end only by a message (or their deadline): its re-checks and its
/// holders' lease hints come a minute later, long after any test here. Short network
/// timeouts: a stalled network is found out fast.
fn patient(url: &str) -> LockClient {
    lock_client!(
        node(url),
        io_timeouts(ms(300)),
        key_prefix(PREFIX),
        patient()
    )
}

/// The waiting permit-seekers' marks of `name`.
fn marks(name: &str) -> String {
    format!("{PREFIX}{{{name}}}:ww")
}

/// Waits until the one permit-seeker of `name`, of client `c`, sleeps in Redis: it failed
/// twice (its attempts before and after subscribing) and is marked waiting.
fn asleep(srv: &RedisServer, c: &LockClient, name: &str) {
    wait_for(secs(10), "the waiter asleep", || {
        srv.zcard(&marks(name)) == 1 && c.stats().failed_attempts >= 2
    });
}

/// A deadline far enough for a wait that ends by a message, far shorter than a re-check.
fn soon() -> Instant {
    Instant::now() + secs(30)
}

/// A permit of `sem`, if one comes [`soon`].
fn until_soon(sem: &Semaphore) -> redbaton::Result<redbaton::Permit> {
    sem.try_acquire_until(soon())
}

/// What a waiter got, and how long after the fault it got it: far less than its wait's
/// deadline ([`soon`]), whose last attempt finds a free permit without any wake-up.
type Waited = (redbaton::Result<()>, Duration);

/// Asserts that a waiter got its answer by a wake-up, not at its deadline.
fn promptly((got, after): Waited) -> redbaton::Result<()> {
    assert!(
        after < secs(10),
        "the waiter's answer came {after:?} after the fault"
    );
    got
}

/// The one permit of `name` taken by `holder`, and a client of `url` asking for it with
/// `take` in another thread: `fault` runs with the permit once that waiter sleeps in
/// Redis; then what the waiter got, and how long after `fault` returned.
fn while_a_waiter_sleeps<T>(
    srv: &RedisServer,
    holder: &LockClient,
    (name, url): (&str, &str),
    take: impl Fn(&Semaphore) -> redbaton::Result<redbaton::Permit> + Sync,
    fault: impl FnOnce(redbaton::Permit) -> T,
) -> (T, Waited) {
    let permit = holder.semaphore(name, 1).acquire().expect("permit");
    let waiter = patient(url);
    thread::scope(|s| {
        let w = s.spawn(|| {
            let got = take(&waiter.semaphore(name, 1)).map(drop);
            (got, Instant::now())
        });
        asleep(srv, &waiter, name);
        let out = fault(permit);
        let after = Instant::now();
        let (got, at) = w.join().unwrap();
        (out, (got, at.saturating_duration_since(after)))
    })
}

/// A wait on the latch `name` of `count` of a client of `url` until `deadline`, in
/// another thread: `meanwhile` runs once the latch exists and its waiter is subscribed;
/// then the wait's outcome.
fn while_a_latch_waiter_sleeps<T>(
    srv: &RedisServer,
    url: &str,
    (name, count): (&str, u64),
    deadline: Instant,
    meanwhile: impl FnOnce(&redbaton::Latch) -> T,
) -> (T, redbaton::Result<()>) {
    let c = patient(url);
    let latch = c.latch(name, count);
    assert_eq!(latch.count().expect("made"), count);
    thread::scope(|s| {
        let w = s.spawn(|| latch.wait_until(deadline));
        wait_for(secs(10), "the waiter subscribed", || {
            srv.subscribers().len() == 1
        });
        let out = meanwhile(&latch);
        (out, w.join().unwrap())
    })
}

#[test]
fn smoke() {
    let srv = test_server();
    let c = patient(&srv.url());
    let latch = c.latch("smoke", 1);
    assert_eq!(latch.count_down().expect("count down"), 0);
    latch.wait_for(secs(1)).expect("open");
    let only = c.semaphore("smoke", 1).try_acquire().expect("permit");
    let e = c.semaphore("smoke", 1).try_acquire().unwrap_err();
    assert!(e.is_would_block(), "{e}");
    assert_eq!(only.unlock().expect("unlock"), Unlocked::Released);
}

/// A waiter asleep on a full semaphore when the server restarts (empty: every permit is
/// gone) gets a permit at once, not at its re-check a minute later; the holder whose
/// permit went with the data is told it lost it (at its next renewal).
#[test]
fn a_server_restart_frees_the_waiter_and_tells_the_holder() {
    let srv = test_server();
    let holder = lock_client!(node(srv.url()), key_prefix(PREFIX), lease(ms(1500)));
    let (p, waited) =
        while_a_waiter_sleeps(&srv, &holder, ("restart", &srv.url()), until_soon, |p| {
            srv.restart();
            p
        });
    promptly(waited).expect("a permit after the restart");
    p.lost().recv_timeout(secs(10)).expect("the holder told");
    assert!(p.check().unwrap_err().is_lost());
}

/// Every connection killed (`CLIENT KILL`) while a waiter sleeps: the holder's release
/// still reaches the waiter.
#[test]
fn a_release_after_every_connection_was_killed_reaches_the_waiter() {
    let srv = test_server();
    let holder = patient(&srv.url());
    let (unlocked, waited) =
        while_a_waiter_sleeps(&srv, &holder, ("killed", &srv.url()), until_soon, |p| {
            let _: i64 = redis::cmd("CLIENT")
                .arg("KILL")
                .arg("TYPE")
                .arg("normal")
                .arg("SKIPME")
                .arg("yes")
                .query(&mut srv.conn())
                .expect("CLIENT KILL");
            srv.kill_pubsub();
            p.unlock()
        });
    assert_eq!(unlocked.expect("unlock"), Unlocked::Released);
    promptly(waited).expect("the freed permit");
}

/// A latch waiter asleep when the server restarts (the latch is gone with its data) is
/// told at once that its latch expired, not at its re-check a minute later.
#[test]
fn a_latch_waiter_learns_of_a_restart_soon() {
    let srv = test_server();
    let deadline = Instant::now() + secs(30);
    let ((), waited) =
        while_a_latch_waiter_sleeps(&srv, &srv.url(), ("restart", 2), deadline, |_| {
            srv.restart();
        });
    let e = waited.unwrap_err();
    assert!(e.is_latch_expired(), "{e}");
}

/// The largest permit count works: taken, refused to another count, given back.
#[test]
fn the_largest_permit_count_works() {
    let srv = test_server();
    let c = patient(&srv.url());
    let sem = c.semaphore("max", u32::MAX);
    let a = sem.try_acquire().expect("permit");
    let b = sem.try_acquire().expect("another");
    let e = c.semaphore("max", u32::MAX - 1).try_acquire().unwrap_err();
    assert!(e.is_permits_mismatch(), "{e}");
    drop((a, b));
    assert!(srv.keys(&KEYS.lock_pattern()).is_empty());
}

/// A permit-seeker that waits with one count is never granted a permit of a semaphore
/// made meanwhile with another count: it is told of the mismatch.
#[test]
fn a_waiter_with_another_count_is_told_not_granted() {
    let srv = test_server();
    let (old, newer) = (patient(&srv.url()), patient(&srv.url()));
    let (p, waited) = while_a_waiter_sleeps(&srv, &old, ("count", &srv.url()), until_soon, |old| {
        // The holder's permit ends without a release (as when its lease runs out): the
        // name is free, and the next holder's count is the one.
        let _: i64 = redis::cmd("DEL")
            .arg(KEYS.lock("count"))
            .query(&mut srv.conn())
            .expect("DEL");
        drop(old);
        let p = newer
            .semaphore("count", 2)
            .try_acquire()
            .expect("new count");
        // Its release grants the permit it frees to the permit-seeker waiting longest.
        drop(
            newer
                .semaphore("count", 2)
                .try_acquire()
                .expect("new count"),
        );
        p
    });
    let e = promptly(waited).unwrap_err();
    assert!(e.is_permits_mismatch(), "{e}");
    // The permit the release held for it was passed on: both are free to the new count.
    let q = newer
        .semaphore("count", 2)
        .try_acquire()
        .expect("the permit passed on");
    drop((p, q));
    assert!(srv.keys(&KEYS.lock_pattern()).is_empty());
}

/// A waiter cut off by a stalled network gives up (cancelled) after a release granted it
/// the permit (it never heard, and the grant lapsed): its leaving, when it reaches Redis,
/// passes that permit on to the next waiter, which gets it then, not at its re-check.
#[test]
fn a_lapsed_grant_of_a_waiter_cut_off_goes_to_the_next() {
    let srv = test_server();
    let proxy = Proxy::start(srv.addr());
    let (holder, next) = (patient(&srv.url()), patient(&srv.url()));
    let cancel = Cancel::new();
    let take = |sem: &Semaphore| sem.acquire_cancellable(&cancel);
    let (waited_next, waited) =
        while_a_waiter_sleeps(&srv, &holder, ("stall", &proxy.url()), take, |p| {
            thread::scope(|s| {
                let w = s.spawn(|| until_soon(&next.semaphore("stall", 1)).map(drop));
                wait_for(secs(10), "the next waiter asleep", || {
                    srv.zcard(&marks("stall")) == 2 && next.stats().failed_attempts >= 2
                });
                proxy.stall(true);
                // Granted to the waiter cut off, the one marked first; the grant lapses
                // (one second), then it gives up, and its leaving waits on the network.
                drop(p);
                thread::sleep(ms(1500));
                cancel.cancel();
                thread::sleep(ms(1000));
                proxy.stall(false);
                let healed = Instant::now();
                let got = w.join().unwrap();
                (got, healed.elapsed())
            })
        });
    assert!(waited.0.unwrap_err().is_cancelled());
    promptly(waited_next).expect("the permit went on to the next waiter");
    wait_for(secs(10), "nothing of the waits left", || {
        srv.keys(&format!("{PREFIX}*")).is_empty()
    });
}

/// A latch waiter cut off by a stalled network keeps its deadline (it times out, or
/// reports the network's failure if a read of it failed first).
#[test]
fn a_latch_waiter_cut_off_keeps_its_deadline() {
    let srv = test_server();
    let proxy = Proxy::start(srv.addr());
    let deadline = Instant::now() + ms(1500);
    let ((), waited) =
        while_a_latch_waiter_sleeps(&srv, &proxy.url(), ("stall", 2), deadline, |_| {
            proxy.stall(true);
        });
    let e = waited.unwrap_err();
    assert!(e.is_timeout() || e.is_connection(), "{e}");
    let late = Instant::now().saturating_duration_since(deadline);
    assert!(late < secs(3), "returned {late:?} after its deadline");
    proxy.stall(false);
}

/// A latch waiter whose subscription was killed (`CLIENT KILL TYPE pubsub`) still wakes
/// when the latch opens, not at its re-check a minute later.
#[test]
fn a_latch_waiter_whose_subscription_was_killed_wakes_when_it_opens() {
    let srv = test_server();
    let deadline = Instant::now() + secs(30);
    let (left, waited) =
        while_a_latch_waiter_sleeps(&srv, &srv.url(), ("pubsub", 1), deadline, |latch| {
            srv.kill_pubsub();
            latch.count_down()
        });
    assert_eq!(left.expect("count down"), 0);
    waited.expect("open");
}
