//! A semaphore's grants: a freed permit is granted, in the release, to the permit-seeker
//! waiting longest. A grant that carries the nonce of the waiter's latest attempt, heard
//! before that attempt's send plus the grant lease, is the permit with no round trip; any
//! other grant, or one heard after that bound, only wakes the waiter, whose next attempt
//! finds its permit held and keeps it.
//!
//! The bodies of these tests are the fair lock's and the read-write lock's
//! (`redbaton_testkit::grants`), run on a semaphore of one permit ([`Permit`]): a permit
//! has no fencing token, so a hold's token here is when it was taken, on the machine's
//! monotonic clock (one permit: holds follow one another). Real `redis-server`, the
//! fault-injecting proxy, and real child processes where a process is stopped; two
//! clients of this process act as two processes. No assertion on how long anything took.

use std::thread;
use std::time::Duration;

use redbaton::LockClient;
use redbaton_testkit::clock::mono_ns;
use redbaton_testkit::grants::{self, Counts, Hold, Kind};
use redbaton_testkit::server::RedisServer;
use redbaton_testkit::wait::wait_for;
use redbaton_testkit::{grant_counts, lock_client, ms, secs, test_server};

/// The permit-seekers waiting for "k".
const WAITERS: &str = "redbaton:{k}:ww";

fn client(url: &str) -> LockClient {
    lock_client!(node(url), lease(secs(30)))
}

/// A permit of "k", and when it was taken.
struct Held {
    permit: redbaton::Permit,
    at: u64,
}

impl Held {
    fn new(permit: redbaton::Permit) -> Held {
        Held {
            permit,
            at: mono_ns(),
        }
    }
}

impl Hold for Held {
    fn token(&self) -> u64 {
        self.at
    }

    fn valid(&self) -> bool {
        self.permit.check().is_ok()
    }

    fn release(self) {
        self.permit.unlock().expect("unlock");
    }
}

/// The one permit of "k".
#[derive(Clone, Copy)]
struct Permit;

impl Kind for Permit {
    type Client = LockClient;
    type Held = Held;
    const WAITERS: &str = WAITERS;

    fn client(url: &str) -> LockClient {
        client(url)
    }

    fn counts(c: &LockClient) -> Counts {
        grant_counts!(c)
    }

    fn hold(self, c: &LockClient) -> Held {
        Held::new(
            c.semaphore("k", 1)
                .try_acquire_for(secs(5))
                .expect("the permit"),
        )
    }

    fn wait(self, c: &LockClient, within: Duration, what: &str) -> Held {
        Held::new(c.semaphore("k", 1).try_acquire_for(within).expect(what))
    }

    /// Marked, and asleep: it failed its first attempt and the one after its subscription
    /// was confirmed, and the reply to the second was read.
    fn asleep(self, srv: &RedisServer, c: &LockClient) {
        wait_for(secs(20), "the waiter marked", || srv.zcard(WAITERS) >= 1);
        wait_for(secs(20), "the waiter's attempt after subscribing", || {
            c.stats().failed_attempts >= 2
        });
        thread::sleep(ms(200));
    }
}

#[test]
fn smoke() {
    let srv = test_server();
    let (holder, w) = (client(&srv.url()), client(&srv.url()));
    grants::granted_in_time(Permit, &srv, holder, &w, || {});
}

/// The common case: the grant is heard in time and taken as the permit, with no attempt;
/// the watchdog renews it, so it stays valid past the grant lease.
#[test]
fn a_permit_grant_heard_in_time_is_the_permit() {
    let srv = test_server();
    let (holder, w) = (client(&srv.url()), client(&srv.url()));
    grants::granted_in_time(Permit, &srv, holder, &w, || thread::sleep(ms(1500)));
}

/// With a short lease (300 ms, so the grant lease is 300 ms too), a permit taken from a
/// grant stays held across many grant leases: its renewals keep it.
#[test]
fn a_granted_permit_with_a_short_lease_is_renewed_in_time() {
    let short = |url: &str| lock_client!(node(url), lease(ms(300)));
    let srv = test_server();
    let (holder, w) = (short(&srv.url()), short(&srv.url()));
    // Ten grant leases: a permit whose first renewal came late would be lost by now.
    grants::granted_in_time(Permit, &srv, holder, &w, || thread::sleep(ms(3000)));
}

/// A grant that reaches its permit-seeker after its bound (a proxy delays what the server
/// sends it by 1.5 s; the grant lease is 1 s) is not taken as the permit: another client
/// takes the permit once the grant expired, and the late one gets it only after that.
#[test]
fn a_permit_grant_delayed_past_its_bound_is_not_the_permit() {
    grants::delayed_past_its_bound(Permit);
}

/// A grant with the nonce of one of the waiter's earlier attempts, heard after a newer
/// attempt, is only a wake-up: its next attempt finds the permit still taken and waits on.
#[test]
fn a_stale_permit_grant_heard_after_a_newer_attempt_is_only_a_wake_up() {
    let srv = test_server();
    // Attempts every 300 ms: the waiter's nonce moves on.
    let w: LockClient = lock_client!(node(srv.url()), lease(secs(30)), recheck_interval(ms(300)));
    grants::stale_grant_only_wakes(Permit, &srv, &w);
}

/// Child: waits for the permit of "k", then reports when it got it, whether its check
/// held, and how many grants it took as the permit.
#[test]
fn child_permit_grantee() {
    grants::grantee(Permit);
}

/// A permit-seeker stopped (SIGSTOP) across its grant: another client gets the permit once
/// the grant lease ran out; resumed, the stopped one does not believe it holds, and gets
/// the permit only after that holder lets go.
#[test]
fn a_permit_grantee_stopped_across_its_grant_does_not_believe_it_holds() {
    grants::stopped_grantee(Permit, "child_permit_grantee");
}

/// A grant's message lost entirely (the waiter's connections drop it, then are reset): its
/// next attempt, after its subscriber reconnects, gets the permit.
#[test]
fn a_lost_permit_grant_message_is_recovered_by_the_next_attempt() {
    grants::lost_grant_recovered(Permit);
}

/// A release never grants a permit beyond the count: when the permit it gives back had
/// expired already and the other holds fill the semaphore (made here by hand: two live
/// holds of a semaphore of two permits, and a waiter's mark and nonce), the waiter marked
/// is not granted a permit (it may only be woken, and its attempt would fail).
#[test]
fn a_release_of_an_expired_permit_grants_nothing_beyond_the_count() {
    let srv = test_server();
    let c = lock_client!(node(srv.url()), lease(ms(300)), auto_renew(false));
    let permit = c.semaphore("k", 2).acquire().expect("a permit");
    let mut conn = srv.conn();
    let (secs_now, micros): (u64, u64) = redis::cmd("TIME").query(&mut conn).expect("TIME");
    let later = secs_now * 1000 + micros / 1000 + 60_000;
    let () = redis::pipe()
        .cmd("ZADD")
        .arg("redbaton:{k}")
        .arg(later)
        .arg("pother1")
        .arg(later)
        .arg("pother2")
        .ignore()
        .cmd("PEXPIRE")
        .arg("redbaton:{k}")
        .arg(60_000)
        .ignore()
        .cmd("ZADD")
        .arg(WAITERS)
        .arg(later)
        .arg("pwaiter")
        .ignore()
        .cmd("ZADD")
        .arg("redbaton:{k}:qn")
        .arg(7)
        .arg("pwaiter")
        .ignore()
        .query(&mut conn)
        .expect("the holds and the waiter, by hand");
    thread::sleep(ms(600)); // our permit's lease has run out; nobody pruned it
    let _ = permit.unlock();
    let granted: Option<f64> = redis::cmd("ZSCORE")
        .arg("redbaton:{k}")
        .arg("pwaiter")
        .query(&mut conn)
        .expect("ZSCORE");
    assert_eq!(granted, None, "a permit granted beyond the count");
}
