//! The fair queue's grants taken without a round trip: a grant that carries the nonce of
//! the waiter's latest attempt is the lock until that attempt's send plus the grant lease;
//! any other grant, or one heard after that bound, only wakes the waiter, whose next
//! attempt confirms it. Real `redis-server`, the fault-injecting proxy, and real child
//! processes where a process is stopped. No assertion on how long anything took: each
//! test checks who held the lock when.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::Duration;

use redbaton::{LockClient, LockGuard};
use redbaton_testkit::child_only;
use redbaton_testkit::clock::mono_ns;
use redbaton_testkit::lock_client;
use redbaton_testkit::proxy::Proxy;
use redbaton_testkit::server::RedisServer;
use redbaton_testkit::wait::wait_for;
use redbaton_testkit::{child, ms, secs};
use redbaton_testkit::{test_server, test_server_and};

const LOCK: &str = "redbaton:{k}";
const QUEUE: &str = "redbaton:{k}:q";
const NONCES: &str = "redbaton:{k}:qn";
const CHANNEL: &str = "redbaton:{k}:ev";

fn client(url: &str) -> LockClient {
    lock_client!(node(url), lease(secs(30)))
}

fn queued(srv: &RedisServer) -> usize {
    srv.zcard(QUEUE)
}

/// The queued tokens and the nonce each one's latest attempt stored.
fn nonces(srv: &RedisServer) -> Vec<(String, u64)> {
    redis::cmd("ZRANGE")
        .arg(NONCES)
        .arg(0)
        .arg(-1)
        .arg("WITHSCORES")
        .query(&mut srv.conn())
        .expect("ZRANGE")
}

fn keys_left(srv: &RedisServer) -> Vec<String> {
    srv.keys_but_fences("redbaton:*")
}

/// Waits until one waiter is queued and asleep (its subscription confirmed).
fn wait_queued(srv: &RedisServer) {
    wait_for(secs(20), "the waiter queued", || queued(srv) == 1);
    wait_for(secs(20), "the waiter's subscription", || {
        srv.client_list().iter().any(|c| {
            c.get("sub").is_some_and(|n| n != "0") || c.get("ssub").is_some_and(|n| n != "0")
        })
    });
    thread::sleep(ms(200)); // its attempt after subscribing is answered: it sleeps
}

/// "k" held on `srv`, and a waiter thread on `w` queued behind the holder and asleep.
struct Queued {
    /// The holder's client, kept as long as its guard.
    _holder: LockClient,
    g: LockGuard,
    /// Set by the test once the waiter may get the lock.
    released: Arc<AtomicBool>,
    /// The waiter: whether `released` was set when it got the lock, its fencing token and
    /// its guard's check.
    waiting: thread::JoinHandle<(bool, u64, bool)>,
}

fn queued_behind_holder(srv: &RedisServer, w: &LockClient) -> Queued {
    let holder = client(&srv.url());
    let g = holder.lock("k").expect("lock");
    let released = Arc::new(AtomicBool::new(false));
    let (c, after_release) = (w.clone(), released.clone());
    let waiting = thread::spawn(move || {
        let g = c.try_lock_for("k", secs(30)).expect("the waiter's turn");
        let after = after_release.load(Ordering::SeqCst);
        let token = g.fencing_token();
        let valid = g.check().is_ok();
        g.unlock().expect("unlock");
        (after, token, valid)
    });
    wait_queued(srv);
    Queued {
        _holder: holder,
        g,
        released,
        waiting,
    }
}

/// [`queued_behind_holder`], with the waiter's client connected through a proxy.
fn queued_through_proxy(srv: &RedisServer) -> (Proxy, LockClient, Queued) {
    let proxy = Proxy::start(srv.addr());
    let w = client(&proxy.url());
    let queued = queued_behind_holder(srv, &w);
    (proxy, w, queued)
}

impl Queued {
    /// The holder lets go, with `between` run after its release: the waiter then holds the
    /// lock after the holder, validly.
    fn hand_over(self, between: impl FnOnce()) {
        self.released.store(true, Ordering::SeqCst);
        let first = self.g.fencing_token();
        self.g.unlock().expect("unlock");
        between();
        let (after, got, valid) = self.waiting.join().expect("waiter");
        assert!(after && valid);
        assert!(got > first, "{got} <= {first}");
    }
}

/// The common case: the grant is heard in time and taken as the lock, with no attempt;
/// the watchdog's first renewal, a quarter of the grant's validity later, gives it the
/// full lease.
#[test]
fn a_grant_heard_in_time_is_the_lock_and_renewed_soon() {
    let (srv, holder) = test_server_and(client);
    let g = holder.lock("k").expect("lock");
    let first = g.fencing_token();
    let w = client(&srv.url());
    let url = srv.url();
    let waiting = {
        let w = w.clone();
        thread::spawn(move || {
            let g = w.try_lock_for("k", secs(30)).expect("the waiter's turn");
            // The grant lease is 1 s: a lease of more proves the first renewal applied.
            let mut conn = redbaton_testkit::raw_conn(&url);
            wait_for(secs(20), "the first renewal", || {
                redbaton_testkit::pttl(&mut conn, LOCK) > 5_000
            });
            let token = g.fencing_token();
            assert!(g.check().is_ok());
            g.unlock().expect("unlock");
            token
        })
    };
    wait_queued(&srv);
    g.unlock().expect("unlock");
    let token = waiting.join().expect("waiter");
    assert!(token > first, "{token} <= {first}");
    let s = w.stats();
    assert_eq!(s.grants_received, 1, "{s:?}");
    assert_eq!(
        s.grants_trusted, 1,
        "the grant was taken as the lock: {s:?}"
    );
    assert!(keys_left(&srv).is_empty(), "{:?}", keys_left(&srv));
}

/// With a short lease (300 ms, so the grant lease is 300 ms too), a lock taken from a
/// grant stays held across many grant leases: its first renewal, planned by the
/// watchdog's frequent looks while the waiter waited rather than by waking it at the
/// handoff, comes before the grant's bound, and the renewals after it keep the lock.
#[test]
fn a_granted_lock_with_a_short_lease_is_renewed_in_time() {
    let short = |url: &str| lock_client!(node(url), lease(ms(300)));
    let (srv, holder) = test_server_and(|url| short(url));
    let g = holder.lock("k").expect("lock");
    let w = short(&srv.url());
    let waiting = {
        let w = w.clone();
        thread::spawn(move || {
            let g = w.try_lock_for("k", secs(30)).expect("the waiter's turn");
            let token = g.fencing_token();
            // Ten grant leases: a lock whose first renewal came late would be lost by now.
            thread::sleep(ms(3000));
            assert!(g.check().is_ok(), "held across ten grant leases");
            g.unlock().expect("unlock");
            token
        })
    };
    wait_queued(&srv);
    g.unlock().expect("unlock");
    waiting.join().expect("waiter");
    let s = w.stats();
    assert_eq!(
        s.grants_trusted, 1,
        "the grant was taken as the lock: {s:?}"
    );
    assert_eq!(s.locks_lost, 0, "{s:?}");
    assert!(keys_left(&srv).is_empty(), "{:?}", keys_left(&srv));
}

/// A grant that reaches its grantee after its bound (a proxy delays everything the server
/// sends the grantee by 1.5 s; the grant lease is 1 s) is not taken as a lock: another
/// client takes the expired grant's key meanwhile, and the grantee gets the lock only
/// after that holder lets go.
#[test]
fn a_grant_delayed_past_its_bound_is_not_a_lock() {
    let srv = test_server();
    let (proxy, w, queued) = queued_through_proxy(&srv);
    proxy.set_delay(ms(1500));
    queued.g.unlock().expect("unlock"); // granted to the waiter, with a 1 s lease
    thread::sleep(ms(1200));
    let other = client(&srv.url());
    let taken = other
        .try_lock_for("k", secs(5))
        .expect("the expired grant's key is free");
    thread::sleep(ms(1000)); // the grant reaches the waiter meanwhile
    proxy.set_delay(Duration::ZERO);
    queued.released.store(true, Ordering::SeqCst);
    let token = taken.fencing_token();
    taken.unlock().expect("unlock");
    let (after, got, valid) = queued.waiting.join().expect("waiter");
    assert!(
        after,
        "the late grantee took the lock while another held it"
    );
    assert!(got > token, "{got} <= {token}");
    assert!(valid);
    assert!(w.stats().grants_received >= 1, "{:?}", w.stats());
}

/// A grant of an earlier attempt's queue entry, heard after a newer attempt, is only a
/// wake-up: the waiter's next attempt finds the lock held and waits on. (The message is
/// published here as a grant that came late would be: to the waiter's token, with the
/// nonce of one of its earlier attempts.)
#[test]
fn a_stale_grant_heard_after_a_newer_attempt_is_only_a_wake_up() {
    let srv = test_server();
    // Attempts every 300 ms: the entry's nonce moves on.
    let w: LockClient = lock_client!(node(srv.url()), lease(secs(30)), recheck_interval(ms(300)));
    let queued = queued_behind_holder(&srv, &w);
    let queued_nonces = nonces(&srv);
    let [(token, old)] = &queued_nonces[..] else {
        panic!("one queued nonce: {queued_nonces:?}");
    };
    let old = *old;
    wait_for(secs(20), "a newer attempt", || {
        nonces(&srv).first().is_some_and(|(_, n)| *n > old)
    });
    let stale = format!("g{token}:{old}:999:1000");
    let mut conn = srv.conn();
    for publish in ["SPUBLISH", "PUBLISH"] {
        let _: redis::RedisResult<u64> = redis::cmd(publish)
            .arg(CHANNEL)
            .arg(&stale)
            .query(&mut conn);
    }
    wait_for(secs(20), "the stale grant heard", || {
        w.stats().grants_received == 1
    });
    thread::sleep(ms(300)); // its confirming attempt is answered
    assert!(queued.g.check().is_ok(), "the holder still holds the lock");
    assert!(
        !queued.waiting.is_finished(),
        "a stale grant was taken as the lock"
    );
    assert_eq!(w.stats().grants_trusted, 0, "{:?}", w.stats());
    queued.hand_over(|| {});
    assert!(keys_left(&srv).is_empty(), "{:?}", keys_left(&srv));
}

/// Child: waits for "k", then reports when it got it, whether its guard's check held, and
/// how many grants it took as the lock.
#[test]
fn child_grantee() {
    child_only!();
    let c = client(&child::env("G_URL"));
    println!("waiting");
    let g = c.try_lock_for("k", secs(30)).expect("child: lock");
    let got = mono_ns();
    let s = c.stats();
    child::print_result(&[
        ("got_ns", got.to_string()),
        ("valid", u8::from(g.check().is_ok()).to_string()),
        ("received", s.grants_received.to_string()),
        ("trusted", s.grants_trusted.to_string()),
        ("reconnects", s.wakeups_reconnect.to_string()),
    ]);
    g.unlock().expect("child: unlock");
}

/// A grantee stopped (SIGSTOP) across its grant: the others get the lock once the grant
/// lease ran out; resumed, it does not believe it holds, and gets the lock only after the
/// holder of the moment lets go. (On Linux the resumed subscriber's read fails with
/// `EINTR` and it reconnects, so the grant is usually lost rather than late: either way
/// only a wake-up. A grant read late is `a_grant_delayed_past_its_bound_is_not_a_lock`.)
#[test]
fn a_grantee_stopped_across_its_grant_does_not_believe_it_holds() {
    let (srv, holder) = test_server_and(client);
    let g = holder.lock("k").expect("lock");
    let mut grantee = child::spawn_self("child_grantee", &[("G_URL", srv.url())]);
    child::wait_for_line(&mut grantee, "waiting", secs(20));
    wait_queued(&srv);
    child::stopped_across_grant(
        grantee,
        || {
            g.unlock().expect("unlock"); // granted to the stopped child
        },
        || {
            let taken = client(&srv.url())
                .try_lock_for("k", secs(20))
                .expect("the others get the lock after the grant lease");
            Box::new(move || {
                assert!(taken.check().is_ok());
                taken.unlock().expect("unlock");
            })
        },
    );
    assert!(keys_left(&srv).is_empty(), "{:?}", keys_left(&srv));
}

/// A grant message lost entirely (the grantee's connections drop it, then are reset): the
/// grantee's next attempt, after its subscriber reconnects, gets the lock.
#[test]
fn a_lost_grant_message_is_recovered_by_the_next_attempt() {
    let srv = test_server();
    let (proxy, w, queued) = queued_through_proxy(&srv);
    proxy.blackhole(true);
    // The grant message is dropped on its way.
    queued.hand_over(|| {
        proxy.blackhole(false);
        proxy.kill_all();
    });
    let s = w.stats();
    assert_eq!(s.grants_received, 0, "the grant message was lost: {s:?}");
    assert_eq!(s.grants_trusted, 0, "{s:?}");
    assert!(keys_left(&srv).is_empty(), "{:?}", keys_left(&srv));
}
