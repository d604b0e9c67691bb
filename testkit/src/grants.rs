//! The grant tests that the fair lock, the read-write lock's write and read holds and the
//! semaphore's permits share, written once. A release grants the hold to the waiter queued
//! longest: a grant that carries the nonce of the waiter's latest attempt, heard before
//! that attempt's send plus the grant lease, is the hold with no round trip; any other
//! grant, or one heard after that bound, only wakes the waiter, whose next attempt confirms
//! it.
//!
//! A test file says how its kind of hold is taken and waited for ([`Kind`], on a type of
//! its own), and each of its tests runs one of the bodies here ([`granted_in_time`],
//! [`delayed_past_its_bound`], [`stale_grant_only_wakes`], [`stopped_grantee`],
//! [`lost_grant_recovered`]; [`grantee`] is its child entry point). The name is always
//! `"k"`, under the default prefix. No assertion on how long anything took: each body
//! checks who held what when (fencing tokens in order, a flag set before a release, the
//! clients' counters), with generous liveness bounds only.
//!
//! Generic because this crate does not depend on `redbaton` (see the crate documentation):
//! a test file implements [`Hold`] for its guards and [`Kind`] for its kind of hold, and
//! reads a client's counters with [`grant_counts!`](crate::grant_counts).

use std::process::Child;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::thread::{self, JoinHandle};
use std::time::Duration;

use crate::clock::mono_ns;
use crate::proxy::Proxy;
use crate::server::RedisServer;
use crate::wait::wait_for;
use crate::{child, ms, secs, test_server};

/// The lock key of "k" (a string for the lock, a sorted set for the read-write lock).
const LOCK: &str = "redbaton:{k}";
/// The nonce each waiter's latest attempt stored, by waiter.
const NONCES: &str = "redbaton:{k}:qn";
/// The channel grants are published on.
const CHANNEL: &str = "redbaton:{k}:ev";
/// The variable that gives a [`grantee`] child its Redis URL.
const GRANTEE_URL: &str = "G_URL";

/// A hold of "k" (a lock's guard, a read or write hold), as the grant checks see it.
pub trait Hold {
    /// Its fencing token.
    fn token(&self) -> u64;
    /// Whether its guard's check passes.
    fn valid(&self) -> bool;
    /// Lets go of it; panics when the release fails.
    fn release(self);
}

/// One kind of hold handed over by grants: how a test file takes it, waits for it, and sees
/// its waiter asleep. Implemented on a small `Copy` value (which may choose how the holder
/// holds, such as a read or the write hold before a write grant).
pub trait Kind: Copy + Send + 'static {
    /// The client (`redbaton::LockClient`).
    type Client: Clone + Send + 'static;
    /// A hold of "k", the holder's as the waiter's.
    type Held: Hold;
    /// The sorted set that marks the waiters of "k" of this kind.
    const WAITERS: &'static str;

    /// The holder's hold of "k", free at the time.
    fn hold(self, c: &Self::Client) -> Self::Held;
    /// The waiter's hold of "k", waiting up to `within`; panics with `what` when it does
    /// not come.
    fn wait(self, c: &Self::Client, within: Duration, what: &str) -> Self::Held;
    /// The hold of "k" that another client takes while a grant to the waiter is not the
    /// hold (it came too late, or to a stopped grantee): one that the waiter's hold
    /// excludes, so that both believed at once would be a broken promise. The waiter's own
    /// kind unless its holds can be shared (a read grant: the write hold).
    fn wait_excluding(self, c: &Self::Client, within: Duration, what: &str) -> Self::Held {
        self.wait(c, within, what)
    }
    /// Returns once the waiter of `c`, the only one, is marked and asleep.
    fn asleep(self, srv: &RedisServer, c: &Self::Client);
    /// A client of `url` with a 30 s lease.
    fn client(url: &str) -> Self::Client;
    /// The grant counters of `c` ([`grant_counts!`](crate::grant_counts)).
    fn counts(c: &Self::Client) -> Counts;
}

/// The counters of a client that the grant tests read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Counts {
    /// Grants heard.
    pub received: u64,
    /// Grants taken as the hold with no round trip.
    pub trusted: u64,
    /// Holds lost.
    pub lost: u64,
    /// Wake-ups for a reconnect of the subscriber.
    pub reconnects: u64,
}

/// The [`Counts`] of a `redbaton::LockClient`. A macro because this crate does not depend
/// on `redbaton`: the expansion reads the fields of its `Stats`.
#[macro_export]
macro_rules! grant_counts {
    ($client:expr) => {{
        let s = $client.stats();
        $crate::grants::Counts {
            received: s.grants_received,
            trusted: s.grants_trusted,
            lost: s.locks_lost,
            reconnects: s.wakeups_reconnect,
        }
    }};
}

/// What a waiter got: whether the flag its test sets before letting it in was set when it
/// got the hold, its fencing token, and its guard's check (after what it did with it).
#[derive(Debug)]
pub struct Got {
    pub after: bool,
    pub token: u64,
    pub valid: bool,
}

impl Got {
    /// Checks that the waiter got its hold after the flag was set, validly, with a fencing
    /// token later than `first`.
    pub fn assert_after(&self, first: u64) {
        assert!(self.after && self.valid, "{self:?}");
        assert!(self.token > first, "{} <= {first}", self.token);
    }
}

/// A thread that waits for a hold with `take`, notes whether `released` was set by then,
/// runs `during` while it holds, and lets go.
pub fn waiter<H: Hold>(
    take: impl FnOnce() -> H + Send + 'static,
    released: &Arc<AtomicBool>,
    during: impl FnOnce() + Send + 'static,
) -> JoinHandle<Got> {
    let released = released.clone();
    thread::spawn(move || {
        let held = take();
        let after = released.load(SeqCst);
        during();
        let got = Got {
            after,
            token: held.token(),
            valid: held.valid(),
        };
        held.release();
        got
    })
}

/// Asserts that the server holds no key of the lock's but the fence counters (which
/// outlive every hold by design).
pub fn assert_nothing_left(srv: &RedisServer) {
    let left = srv.keys_but_fences("redbaton:*");
    assert!(left.is_empty(), "{left:?}");
}

/// Waits until the grant lease (1 s) of the hold taken from a grant has been renewed with
/// the client's full lease: its key lives longer than the grant lease could make it.
pub fn wait_renewed(url: &str) {
    let mut conn = crate::raw_conn(url);
    wait_for(secs(20), "the first renewal", || {
        crate::pttl(&mut conn, LOCK) > 5_000
    });
}

/// "k" held by a client, and a waiter of another behind it, asleep.
struct Behind<K: Kind> {
    /// The holder's client, kept as long as its hold.
    _holder: K::Client,
    held: K::Held,
    /// Set by the test once the waiter may get the hold.
    released: Arc<AtomicBool>,
    waiting: JoinHandle<Got>,
}

impl<K: Kind> Behind<K> {
    /// `holder` holds "k", and a waiter of `w` waits behind it (up to 30 s), asleep; it
    /// runs `during` once it holds.
    fn new(
        kind: K,
        srv: &RedisServer,
        holder: K::Client,
        w: &K::Client,
        during: impl FnOnce() + Send + 'static,
    ) -> Behind<K> {
        let held = kind.hold(&holder);
        let released = Arc::new(AtomicBool::new(false));
        let c = w.clone();
        let take = move || kind.wait(&c, secs(30), "the waiter's turn");
        let waiting = waiter(take, &released, during);
        kind.asleep(srv, w);
        Behind {
            _holder: holder,
            held,
            released,
            waiting,
        }
    }

    /// [`Behind::new`] with a holder of its own, the waiter's client connected through a
    /// proxy; returns the proxy and that client too.
    fn through_proxy(kind: K, srv: &RedisServer) -> (Proxy, K::Client, Behind<K>) {
        let proxy = Proxy::start(srv.addr());
        let w = K::client(&proxy.url());
        let behind = Behind::new(kind, srv, K::client(&srv.url()), &w, || {});
        (proxy, w, behind)
    }

    /// The holder lets go, with `between` run after its release: the waiter then holds
    /// after the holder, validly, with a later fencing token.
    fn hand_over(self, between: impl FnOnce()) {
        self.released.store(true, SeqCst);
        let first = self.held.token();
        self.held.release();
        between();
        self.waiting.join().expect("waiter").assert_after(first);
    }
}

/// A waiter of `w` waits behind `holder` and is handed the hold by a grant, heard in time
/// and taken as the hold; it runs `during` with it, and loses nothing. Nothing is left
/// behind.
pub fn granted_in_time<K: Kind>(
    kind: K,
    srv: &RedisServer,
    holder: K::Client,
    w: &K::Client,
    during: impl FnOnce() + Send + 'static,
) {
    Behind::new(kind, srv, holder, w, during).hand_over(|| {});
    let s = K::counts(w);
    assert_eq!(s.received, 1, "{s:?}");
    assert_eq!(s.trusted, 1, "the grant was taken as the hold: {s:?}");
    assert_eq!(s.lost, 0, "{s:?}");
    assert_nothing_left(srv);
}

/// A grant that reaches its grantee after its bound (a proxy delays everything the server
/// sends the grantee by 1.5 s; the grant lease is 1 s) is not taken as the hold: another
/// client takes the hold once the grant expired, and the grantee gets it only after that
/// holder lets go.
pub fn delayed_past_its_bound<K: Kind>(kind: K) {
    let srv = test_server();
    let (proxy, w, behind) = Behind::through_proxy(kind, &srv);
    proxy.set_delay(ms(1500));
    behind.held.release(); // granted to the waiter, with a 1 s lease
    thread::sleep(ms(1200));
    let other = K::client(&srv.url());
    let taken = kind.wait_excluding(&other, secs(5), "the expired grant's hold is free");
    thread::sleep(ms(1000)); // the grant reaches the waiter meanwhile
    proxy.set_delay(Duration::ZERO);
    behind.released.store(true, SeqCst);
    let token = taken.token();
    taken.release();
    let got = behind.waiting.join().expect("waiter");
    assert!(
        got.after,
        "the late grantee took the hold while another held it"
    );
    assert!(got.token > token, "{} <= {token}", got.token);
    assert!(got.valid);
    let s = K::counts(&w);
    assert!(s.received >= 1, "{s:?}");
}

/// The waiting members of "k" and the nonce each one's latest attempt stored.
fn nonces(srv: &RedisServer) -> Vec<(String, u64)> {
    redis::cmd("ZRANGE")
        .arg(NONCES)
        .arg(0)
        .arg(-1)
        .arg("WITHSCORES")
        .query(&mut srv.conn())
        .expect("ZRANGE")
}

/// A grant of an earlier attempt of the waiter of `w` (whose attempts come often, so that
/// its nonce moves on), heard after a newer attempt, is only a wake-up: the waiter's next
/// attempt finds the holder still there and waits on. (The message is published here as
/// a grant that came late would be: to the waiter's member, with an older nonce of its
/// own.)
pub fn stale_grant_only_wakes<K: Kind>(kind: K, srv: &RedisServer, w: &K::Client) {
    let behind = Behind::new(kind, srv, K::client(&srv.url()), w, || {});
    let waiting = nonces(srv);
    let [(member, old)] = &waiting[..] else {
        panic!("one waiting nonce: {waiting:?}");
    };
    let old = *old;
    wait_for(secs(20), "a newer attempt", || {
        nonces(srv).first().is_some_and(|(_, n)| *n > old)
    });
    let stale = format!("g{member}:{old}:999:1000");
    let mut conn = srv.conn();
    for publish in ["SPUBLISH", "PUBLISH"] {
        let _: redis::RedisResult<u64> = redis::cmd(publish)
            .arg(CHANNEL)
            .arg(&stale)
            .query(&mut conn);
    }
    wait_for(secs(20), "the stale grant heard", || {
        K::counts(w).received == 1
    });
    thread::sleep(ms(300)); // its confirming attempt is answered
    assert!(behind.held.valid(), "the holder still holds");
    assert!(
        !behind.waiting.is_finished(),
        "a stale grant was taken as the hold"
    );
    let s = K::counts(w);
    assert_eq!(s.trusted, 0, "{s:?}");
    behind.hand_over(|| {});
    assert_nothing_left(srv);
}

/// The whole of the child entry point that a [`stopped_grantee`] test starts: outside a
/// child, nothing; in one, it waits (up to 30 s) for the hold of "k" on the Redis at
/// `G_URL`, then reports when it got it (`got_ns`, by [`mono_ns`]), whether its guard's
/// check held (`valid`), and its [`Counts`].
pub fn grantee<K: Kind>(kind: K) {
    if !child::is_child() {
        return;
    }
    let c = K::client(&child::env(GRANTEE_URL));
    println!("waiting");
    let held = kind.wait(&c, secs(30), "child: the hold");
    let got_ns = mono_ns().to_string();
    let valid = u8::from(held.valid()).to_string();
    child::print_counters(&K::counts(&c), &[("got_ns", got_ns), ("valid", valid)]);
    held.release();
}

/// Connections subscribed to a channel (see [`RedisServer::subscribers`]).
fn subscribed(srv: &RedisServer) -> usize {
    srv.subscribers().len()
}

/// A grantee stopped (SIGSTOP) across its grant: another client gets the hold once the
/// grant lease ran out; resumed, the grantee does not believe it holds, and gets the hold
/// only after that holder lets go. `entry` names the test file's [`grantee`] child entry
/// point. (On Linux the resumed subscriber's read fails with `EINTR` and it reconnects, so
/// the grant is usually lost rather than late: either way only a wake-up. A grant read
/// late is [`delayed_past_its_bound`].)
pub fn stopped_grantee<K: Kind>(kind: K, entry: &str) {
    let srv = test_server();
    let holder = K::client(&srv.url());
    let held = kind.hold(&holder);
    let before = subscribed(&srv);
    let mut grantee = child::spawn_self(entry, &[(GRANTEE_URL, srv.url())]);
    child::wait_for_line(&mut grantee, "waiting", secs(20));
    wait_for(secs(20), "the grantee marked", || {
        srv.zcard(K::WAITERS) == 1
    });
    wait_for(secs(20), "the grantee's subscription", || {
        subscribed(&srv) > before
    });
    thread::sleep(ms(200)); // its attempt after subscribing is answered: it sleeps
    stopped_across_grant(
        grantee,
        || held.release(), // granted to the stopped child
        || {
            let other = K::client(&srv.url());
            kind.wait_excluding(
                &other,
                secs(20),
                "the others get the hold after the grant lease",
            )
        },
    );
    assert_nothing_left(&srv);
}

/// Stops `grantee` (a [`grantee`] child), runs `release` (whose release grants the hold
/// to it), runs `take_other` (which takes the hold once the grant lease ran out), resumes
/// the child, lets the other hold go, and checks that the child got the hold only after
/// that, validly.
fn stopped_across_grant<H: Hold>(
    mut grantee: Child,
    release: impl FnOnce(),
    take_other: impl FnOnce() -> H,
) {
    child::stop_child(&mut grantee);
    release();
    let other = take_other();
    child::kill_child(&mut grantee, libc::SIGCONT);
    // The child hears its grant, and its attempt finds the hold taken.
    thread::sleep(ms(500));
    let released = mono_ns();
    assert!(other.valid());
    other.release();
    let out = child::wait_ok(grantee, secs(30));
    let r = child::result_with(&out, "got_ns");
    let got: u64 = child::field(&r, "got_ns");
    assert!(
        got > released,
        "the resumed grantee got the hold while another held it ({got} <= {released}): {out}"
    );
    assert_eq!(child::field::<u8>(&r, "valid"), 1, "{out}");
    eprintln!("the resumed grantee: {r:?}");
}

/// A grant message lost entirely (the grantee's connections drop it, then are reset): the
/// grantee's next attempt, after its subscriber reconnects, gets the hold.
pub fn lost_grant_recovered<K: Kind>(kind: K) {
    let srv = test_server();
    let (proxy, w, behind) = Behind::through_proxy(kind, &srv);
    proxy.blackhole(true);
    // The grant message is dropped on its way: the connections that could still carry it
    // are closed before the partition heals, so a message the proxy had not yet read when
    // the release returned is lost too, never delivered late.
    behind.hand_over(|| {
        proxy.kill_all();
        proxy.blackhole(false);
    });
    let s = K::counts(&w);
    assert_eq!(s.received, 0, "the grant message was lost: {s:?}");
    assert_eq!(s.trusted, 0, "{s:?}");
    assert_nothing_left(&srv);
}
