//! The connection layer of one node under faults: what a command whose reply was lost
//! becomes when the retry cannot even connect, how long a call with a deadline may block
//! when it has to open a connection to a server that does not answer, and what a command
//! sent only once meets on a pooled connection the server closed while it was idle.
//!
//! * An acquire whose reply was lost may have taken the lock. When the retry that would
//!   have found out is refused a connection, the call's outcome is still unknown: the
//!   library must give back what the lost attempt may have taken, not report "refused"
//!   as if nothing had been sent.
//! * A call with a deadline keeps it even when the pool has no idle connection and the
//!   server accepts connections but never answers: opening the connection (its name, the
//!   channel probe) waits no longer than the call may.
//! * A count down is never sent twice, so it must not be spent on a pooled connection
//!   that Redis closed for idleness (its `timeout`): that fails it with an unknown outcome
//!   though it never reached Redis.
//!
//! Every server is a real `redis-server`; faults come from the test support's proxy, from
//! stopping the server (`SIGSTOP`), and from a proxy started again on a dead address.

use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use redbaton::LockClient;
use redbaton_testkit::keys::Keys;
use redbaton_testkit::proxy::Proxy;
use redbaton_testkit::server::RedisServer;
use redbaton_testkit::wait::{wait_for, wait_until};
use redbaton_testkit::{exists, lock_client, ms, secs, test_server};

const PREFIX: &str = "cf:";
const KEYS: Keys = Keys::new(PREFIX);
/// Long, so that a key still there after [`GIVE_BACK`] is one nobody gave back (it did
/// not expire by itself).
const LEASE: Duration = Duration::from_secs(40);
/// How long a give-back in the background may take: far below the lease.
const GIVE_BACK: Duration = Duration::from_secs(8);

/// Resumes a stopped server however the test ends.
struct Resume<'a>(&'a RedisServer);

impl Drop for Resume<'_> {
    fn drop(&mut self) {
        self.0.resume();
    }
}

#[test]
fn smoke() {
    let srv = test_server();
    let proxy = Proxy::start(srv.addr());
    let c = lock_client!(node(proxy.url()), key_prefix(PREFIX), lease(LEASE));
    let g = c.try_lock("smoke").expect("lock through the proxy");
    assert!(exists(&mut srv.conn(), KEYS.lock("smoke")));
    assert!(g.unlock().expect("unlock").was_held());
}

// --- a lost reply, then a refused connection ---------------------------------------------

/// An acquire runs in Redis (it takes the lock) but its reply never comes back: the
/// connection is closed, and the proxy's port stops listening at that very moment, so the
/// retry that would have found our token is refused a connection. The attempt may have
/// taken the lock, and did: once the address answers again, the library gives it back in
/// the background. Reporting the refusal as if the acquire had never been sent leaves
/// the lock held by nobody until its lease runs out.
#[test]
fn an_acquire_whose_reply_was_lost_is_given_back_when_the_retry_was_refused() {
    let srv = test_server();
    let proxy = Proxy::start(srv.addr());
    let port = proxy.port();
    let c = Arc::new(lock_client!(
        node(proxy.url()),
        key_prefix(PREFIX),
        lease(LEASE),
        pool_size(1),
        io_timeouts(secs(5))
    ));
    // An idle pooled connection, so that the acquire below is sent at once.
    assert!(
        c.try_lock("warm")
            .expect("warm")
            .unlock()
            .expect("unlock")
            .was_held()
    );
    // Replies are held back: the acquire runs, its reply waits in the proxy.
    proxy.set_delay(secs(60));
    let taker = {
        let c = Arc::clone(&c);
        thread::spawn(move || c.try_lock("x").map(drop))
    };
    let key = KEYS.lock("x");
    wait_for(secs(10), "the acquire to run in redis", || {
        exists(&mut srv.conn(), &key)
    });
    // The listener goes first, then the connections: the reply is lost, and the retry's
    // connection is refused.
    drop(proxy);
    let e = taker
        .join()
        .expect("taker")
        .expect_err("the reply was lost and no retry could be sent");
    eprintln!("acquire with a lost reply, retry refused: {e:?}");
    assert!(
        exists(&mut srv.conn(), &key),
        "the lost attempt took the lock"
    );
    // The address answers again, reaching the same server.
    let _back = Proxy::start_at(port, srv.addr());
    assert!(
        wait_until(GIVE_BACK, || !exists(&mut srv.conn(), &key)),
        "the lock a lost attempt took was never given back (error reported: {e:?})"
    );
}

// --- deadlines while connecting ----------------------------------------------------------

/// With a hung server (stopped: the kernel still accepts connections for it, nobody
/// answers), a latch's `wait_for` reads on its pooled connection and fails by its
/// deadline; that drops the connection. The next `wait_for` must open one: naming it (and
/// probing the channel kind) waits for replies too, and must not wait the whole read
/// timeout (20 s here) past a deadline of a fraction of a second.
#[test]
fn a_call_that_must_connect_to_a_hung_server_keeps_its_deadline() {
    let srv = test_server();
    let c: LockClient = lock_client!(
        node(srv.url()),
        key_prefix(PREFIX),
        lease(secs(60)),
        io_timeouts(secs(20))
    );
    let latch = c.latch("hung", 2);
    assert_eq!(latch.count().expect("made"), 2);
    srv.pause();
    let _resume = Resume(&srv);
    // The first wait reads on the pooled connection, the second must open a new one.
    let waits: Vec<_> = (0..2)
        .map(|_| {
            let started = Instant::now();
            (latch.wait_for(ms(300)), started.elapsed())
        })
        .collect();
    eprintln!("waits against a hung server: {waits:?}");
    for (waited, took) in &waits {
        assert!(
            waited.as_ref().is_err_and(redbaton::Error::is_timeout) && *took < secs(10),
            "a 300 ms wait: {waited:?} after {took:?}"
        );
    }
}

// --- a connection that died while idle ----------------------------------------------------

/// Redis closes a connection idle for longer than its `timeout`. A count down is sent once
/// (a second would count twice), so it must not go out on a pooled connection the server
/// already closed: it would fail with an unknown outcome (for the caller, it may have
/// counted) though it never reached Redis.
#[test]
fn a_count_down_after_the_server_closed_the_idle_connection_counts() {
    let srv = test_server();
    let c: LockClient = lock_client!(node(srv.url()), key_prefix(PREFIX));
    let latch = c.latch("idle", 3);
    assert_eq!(latch.count().expect("made"), 3);
    srv.config_set("timeout", "1");
    wait_for(
        secs(10),
        "the server to close the idle pooled connection",
        || {
            !srv.client_list()
                .iter()
                .any(|c| c.get("name").is_some_and(|n| n == "redbaton"))
        },
    );
    let sent = c.stats().commands;
    assert_eq!(latch.count_down().expect("count down"), 2);
    // The check of the idle connection is a command the client sent too.
    assert_eq!(c.stats().commands - sent, 2, "the PING and the count down");
    assert_eq!(latch.count().expect("read"), 2);
}

// --- leaving at the deadline ---------------------------------------------------------------

/// A wait that ends at its deadline takes its queue entry or mark out on the way, and that
/// keeps the deadline too: against a hung server (stopped once the waiter has failed its
/// first attempt and marked itself), leaving is left to the background once the deadline
/// has passed, rather than wait a whole read timeout (20 s here) for the reply. For each
/// kind of waiter: the fair lock's queue entry, the plain lock's mark, a writer's mark, a
/// multi-lock's marks.
#[test]
fn a_wait_that_ends_at_its_deadline_against_a_hung_server_leaves_within_it() {
    let srv = test_server();
    let holder = lock_client!(node(srv.url()), key_prefix(PREFIX));
    let waiter = |fair: bool| {
        lock_client!(
            node(srv.url()),
            key_prefix(PREFIX),
            lease(secs(60)),
            io_timeouts(secs(20)),
            fair(fair)
        )
    };
    let (fair, plain) = (waiter(true), waiter(false));
    let _held = (
        holder.lock("fair").expect("lock"),
        holder.lock("plain").expect("lock"),
        holder.rwlock("rw").read().expect("read"),
        holder.lock("m1").expect("lock"),
    );
    type Wait<'a> = Box<dyn FnOnce() -> redbaton::Result<()> + Send + 'a>;
    let cases: [(&str, &LockClient, Wait<'_>); 4] = [
        (
            "fair lock",
            &fair,
            Box::new(|| fair.try_lock_for("fair", secs(1)).map(drop)),
        ),
        (
            "plain lock",
            &plain,
            Box::new(|| plain.try_lock_for("plain", secs(1)).map(drop)),
        ),
        (
            "writer",
            &plain,
            Box::new(|| plain.rwlock("rw").try_write_for(secs(1)).map(drop)),
        ),
        (
            "multi-lock",
            &plain,
            Box::new(|| plain.try_multi_lock_for(["m1", "m2"], secs(1)).map(drop)),
        ),
    ];
    for (what, client, wait) in cases {
        let failed_before = client.stats().failed_attempts;
        let (started, ended) = thread::scope(|s| {
            let started = Instant::now();
            let w = s.spawn(wait);
            wait_for(secs(10), "the waiter's first attempt failed", || {
                client.stats().failed_attempts > failed_before
            });
            srv.pause();
            let _resume = Resume(&srv);
            let r = w.join().expect("waiter");
            assert!(r.is_err(), "{what}: {r:?}");
            (started, Instant::now())
        });
        let took = ended - started;
        eprintln!("{what}: the wait of 1 s against a hung server ended after {took:?}");
        assert!(
            took < secs(10),
            "{what}: a wait of 1 s ended after {took:?}"
        );
    }
}
