//! The bounds of a grant taken as the lock with no round trip: a fair queue's grant that
//! names the nonce of its waiter's latest attempt is the lock until that attempt's send
//! plus the grant lease, less the drift margin. These tests check the edges of that rule:
//! a grant heard with too little of its bound left for the first renewal to be answered is
//! confirmed instead, a grant for an earlier wait of the same client is nobody's, and a
//! grant to a waiter that gave up is passed on. Real `redis-server` and the
//! fault-injecting proxy; two clients of this process act as two processes. No assertion
//! on how long anything took: each test checks who held the lock, and what its holder was
//! told.

use std::thread;
use std::time::{Duration, Instant};

use redbaton::{Cancel, LockClient, LockGuard, WriteGuard};
use redbaton_testkit::proxy::Proxy;
use redbaton_testkit::server::RedisServer;
use redbaton_testkit::wait::wait_for;
use redbaton_testkit::{lock_client, ms, secs, test_server};

const LOCK: &str = "redbaton:{k}";
const QUEUE: &str = "redbaton:{k}:q";
/// The writers waiting for the read-write lock "k".
const WRITERS: &str = "redbaton:{k}:ww";
/// The nonce of each waiter's latest attempt, by token.
const NONCES: &str = "redbaton:{k}:qn";
/// The channel grants are published on.
const CHANNEL: &str = "redbaton:{k}:ev";

fn client(url: &str) -> LockClient {
    lock_client!(node(url), lease(secs(30)))
}

/// Waits until one waiter is queued and asleep (its subscription confirmed).
fn wait_queued(srv: &RedisServer) {
    wait_asleep(srv, QUEUE);
}

/// Waits until one waiter is marked in `waiters` and asleep (its subscription confirmed).
fn wait_asleep(srv: &RedisServer, waiters: &str) {
    wait_for(secs(20), "the waiter marked", || srv.zcard(waiters) == 1);
    wait_for(secs(20), "the waiter's subscription", || {
        !srv.subscribers().is_empty()
    });
    thread::sleep(ms(200)); // its attempt after subscribing is answered: it sleeps
}

/// The queued waiter's token and the nonce of its latest attempt.
fn queued_nonce(conn: &mut redis::Connection) -> Option<(String, u64)> {
    let all: Vec<(String, u64)> = redis::cmd("ZRANGE")
        .arg(NONCES)
        .arg(0)
        .arg(-1)
        .arg("WITHSCORES")
        .query(conn)
        .expect("ZRANGE");
    all.into_iter().next()
}

/// Waits for "k" with `c`, checks the lock is held, lets it go, and returns its fencing
/// token.
fn take(c: &LockClient, what: &str) -> u64 {
    let got = c.try_lock_for("k", secs(30)).expect(what);
    assert!(got.check().is_ok(), "{what}");
    let fence = got.fencing_token();
    got.unlock().expect("unlock");
    fence
}

/// Publishes `message` on the lock's channel, sharded where the server has it.
fn publish(srv: &RedisServer, message: &str) {
    let mut conn = srv.conn();
    for publish in ["SPUBLISH", "PUBLISH"] {
        let _: redis::RedisResult<u64> = redis::cmd(publish)
            .arg(CHANNEL)
            .arg(message)
            .query(&mut conn);
    }
}

#[test]
fn smoke() {
    let srv = test_server();
    let (holder, w) = (client(&srv.url()), client(&srv.url()));
    let g = holder.lock("k").expect("lock");
    let c = w.clone();
    let waiting = thread::spawn(move || take(&c, "granted"));
    wait_queued(&srv);
    g.unlock().expect("unlock");
    waiting.join().expect("waiter");
    assert_eq!(w.stats().grants_trusted, 1);
}

/// The holds of "k" a grant hands over in the tests of the round trip.
#[derive(Clone, Copy)]
enum Hold {
    /// The fair lock.
    Lock,
    /// The read-write lock's write hold.
    Write,
}

impl Hold {
    /// The set that marks the waiters of this kind of hold.
    fn waiters(self) -> &'static str {
        match self {
            Hold::Lock => QUEUE,
            Hold::Write => WRITERS,
        }
    }

    /// Takes "k" (free), and returns its release (the guard's drop).
    fn take(self, c: &LockClient) -> Box<dyn FnOnce()> {
        match self {
            Hold::Lock => release_of(c.lock("k").expect("lock")),
            Hold::Write => release_of(c.rwlock("k").write().expect("write")),
        }
    }

    /// Waits for "k", holds it past the grant's bound, lets it go, and returns its guard's
    /// last check.
    fn hold_past_the_bound(self, c: &LockClient) -> redbaton::Result<()> {
        match self {
            Hold::Lock => past_the_bound(
                c.try_lock_for("k", secs(30)).expect("granted"),
                LockGuard::check,
            ),
            Hold::Write => past_the_bound(
                c.rwlock("k").try_write_for(secs(30)).expect("granted"),
                WriteGuard::check,
            ),
        }
    }
}

/// A guard's release: its drop.
fn release_of<G: 'static>(guard: G) -> Box<dyn FnOnce()> {
    Box::new(move || drop(guard))
}

/// Holds `guard` past the grant's bound (a hold whose first renewal came back too late is
/// lost by then), and returns its `check` then; the guard's drop lets it go.
fn past_the_bound<G>(guard: G, check: impl Fn(&G) -> redbaton::Result<()>) -> redbaton::Result<()> {
    thread::sleep(ms(1500));
    check(&guard)
}

/// A grant heard with less of its bound left than a round trip on the grantee's link takes
/// (a proxy delays everything the server sends the grantee by 600 ms; the release comes
/// right after one of the grantee's attempts ran, so the grant is heard about 600 ms into
/// its 1 s bound) is confirmed by an attempt rather than taken as the hold: taken, its
/// first renewal could not be answered before the bound, and its holder would be told the
/// hold was lost although Redis kept it. Confirmed, it is held with the full lease.
fn little_left_is_confirmed(kind: Hold) {
    let srv = test_server();
    let proxy = Proxy::start(srv.addr());
    // Attempts every 300 ms, so that one comes soon after the delay is set.
    let w = lock_client!(
        node(proxy.url()),
        lease(secs(30)),
        recheck_interval(ms(300))
    );
    let holder = client(&srv.url());
    let release = kind.take(&holder);
    let c = w.clone();
    let waiting = thread::spawn(move || kind.hold_past_the_bound(&c));
    wait_asleep(&srv, kind.waiters());
    proxy.set_delay(ms(600));
    let mut conn = srv.conn();
    let (_, before) = queued_nonce(&mut conn).expect("queued");
    // The release right after an attempt ran: the grant names its nonce.
    let deadline = Instant::now() + secs(20);
    while queued_nonce(&mut conn).is_some_and(|(_, n)| n == before) {
        assert!(Instant::now() < deadline, "no new attempt");
    }
    release();
    let valid = waiting.join().expect("waiter");
    let s = w.stats();
    assert!(valid.is_ok(), "{valid:?}; {s:?}");
    assert_eq!(s.locks_lost, 0, "{s:?}");
    assert_eq!(s.grants_trusted, 0, "confirmed, not taken: {s:?}");
    proxy.set_delay(Duration::ZERO);
}

#[test]
fn a_grant_heard_with_less_left_than_a_round_trip_is_confirmed() {
    little_left_is_confirmed(Hold::Lock);
}

#[test]
fn a_write_grant_heard_with_less_left_than_a_round_trip_is_confirmed() {
    little_left_is_confirmed(Hold::Write);
}

/// A grant to the token of an earlier wait of the same client, carrying the nonce of the
/// current wait's latest attempt (each wait counts its attempts from 1), is not this wait's:
/// it is not even heard, the waiter waits on, and the holder keeps the lock.
#[test]
fn a_grant_to_an_earlier_wait_of_the_same_client_is_nobodys() {
    let srv = test_server();
    let (holder, w) = (client(&srv.url()), client(&srv.url()));
    let mut conn = srv.conn();
    // The first wait: granted, taken, released.
    let g = holder.lock("k").expect("lock");
    let c = w.clone();
    let first = thread::spawn(move || take(&c, "first wait"));
    wait_queued(&srv);
    let (old, _) = queued_nonce(&mut conn).expect("queued");
    g.unlock().expect("unlock");
    let fence = first.join().expect("waiter");
    // The second wait of the same client, behind the holder again.
    let g = holder.lock("k").expect("lock again");
    let c = w.clone();
    let second = thread::spawn(move || take(&c, "second wait"));
    wait_queued(&srv);
    let (new, nonce) = queued_nonce(&mut conn).expect("queued again");
    assert_ne!(new, old, "a new wait has a new token");
    let heard = w.stats().grants_received;
    publish(&srv, &format!("g{old}:{nonce}:{}:1000", fence + 1));
    thread::sleep(ms(300));
    let s = w.stats();
    assert!(
        s.grants_received == heard && !second.is_finished(),
        "the old wait's grant was heard, or taken as the lock: {s:?}"
    );
    assert!(g.check().is_ok(), "the holder still holds");
    let released = g.fencing_token();
    g.unlock().expect("unlock");
    assert!(second.join().expect("waiter") > released);
}

/// A waiter cancelled as the lock is granted to it, its grant message late (a proxy delays
/// what the server sends it): it ends cancelled or holding, never both, and a grant it did
/// not take is passed on as it leaves: the key is not left held for the grant lease.
#[test]
fn a_grant_to_a_cancelled_waiter_is_passed_on() {
    let srv = test_server();
    let proxy = Proxy::start(srv.addr());
    let w = client(&proxy.url());
    let holder = client(&srv.url());
    let g = holder.lock("k").expect("lock");
    let cancel = Cancel::new();
    let (c, cancel2) = (w.clone(), cancel.clone());
    let waiting = thread::spawn(move || {
        c.lock_cancellable("k", &cancel2).map(|got| {
            assert!(got.check().is_ok());
            got.unlock().expect("unlock");
        })
    });
    wait_queued(&srv);
    proxy.set_delay(ms(300));
    g.unlock().expect("unlock"); // granted to the waiter; it hears it 300 ms later
    cancel.cancel();
    let mut conn = srv.conn();
    let outcome = waiting.join().expect("waiter");
    eprintln!("the cancelled grantee: {outcome:?}; {:?}", w.stats());
    match outcome {
        Ok(()) => {}
        Err(e) => {
            assert!(matches!(e, redbaton::Error::Cancelled), "{e:?}");
            let left: Option<String> = redis::cmd("GET").arg(LOCK).query(&mut conn).unwrap();
            assert_eq!(left, None, "the grant was not passed on");
        }
    }
    proxy.set_delay(Duration::ZERO);
    let other = client(&srv.url());
    let got = other.try_lock_for("k", secs(5)).expect("the lock is free");
    got.unlock().expect("unlock");
}
