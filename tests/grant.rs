//! The fair queue's grants taken without a round trip: a grant that carries the nonce of
//! the waiter's latest attempt is the lock until that attempt's send plus the grant lease;
//! any other grant, or one heard after that bound, only wakes the waiter, whose next
//! attempt confirms it. Real `redis-server`, the fault-injecting proxy, and real child
//! processes where a process is stopped. No assertion on how long anything took: each
//! test checks who held the lock when.
//!
//! The read-write lock's write grants are tested the same way (`rw_grant.rs`): the bodies
//! of these tests are written once, in `redbaton_testkit::grants`, for both; here is how
//! the lock is taken and waited for ([`Lock`]).

use std::thread;
use std::time::Duration;

use redbaton::{LockClient, LockGuard};
use redbaton_testkit::grants::{self, Counts, Hold, Kind};
use redbaton_testkit::server::RedisServer;
use redbaton_testkit::wait::wait_for;
use redbaton_testkit::{grant_counts, lock_client, ms, secs, test_server};

const QUEUE: &str = "redbaton:{k}:q";

fn client(url: &str) -> LockClient {
    lock_client!(node(url), lease(secs(30)))
}

/// Waits until one waiter is queued and asleep (its subscription confirmed).
fn wait_queued(srv: &RedisServer) {
    wait_for(secs(20), "the waiter queued", || srv.zcard(QUEUE) == 1);
    wait_for(secs(20), "the waiter's subscription", || {
        !srv.subscribers().is_empty()
    });
    thread::sleep(ms(200)); // its attempt after subscribing is answered: it sleeps
}

/// The lock's guard, as the grant tests see a hold.
struct Locked(LockGuard);

impl Hold for Locked {
    fn token(&self) -> u64 {
        self.0.fencing_token()
    }

    fn valid(&self) -> bool {
        self.0.check().is_ok()
    }

    fn release(self) {
        self.0.unlock().expect("unlock");
    }
}

/// The fair lock of "k": the holder takes it, the waiter queues for it.
#[derive(Clone, Copy)]
struct Lock;

impl Kind for Lock {
    type Client = LockClient;
    type Held = Locked;
    const WAITERS: &str = QUEUE;

    fn hold(self, c: &LockClient) -> Locked {
        Locked(c.lock("k").expect("lock"))
    }

    fn wait(self, c: &LockClient, within: Duration, what: &str) -> Locked {
        Locked(c.try_lock_for("k", within).expect(what))
    }

    fn asleep(self, srv: &RedisServer, _: &LockClient) {
        wait_queued(srv);
    }

    fn client(url: &str) -> LockClient {
        client(url)
    }

    fn counts(c: &LockClient) -> Counts {
        grant_counts!(c)
    }
}

/// The common case: the grant is heard in time and taken as the lock, with no attempt;
/// the watchdog's first renewal, a quarter of the grant's validity later, gives it the
/// full lease.
#[test]
fn a_grant_heard_in_time_is_the_lock_and_renewed_soon() {
    let srv = test_server();
    let url = srv.url();
    let during = move || grants::wait_renewed(&url);
    grants::granted_in_time(Lock, &srv, client(&srv.url()), &client(&srv.url()), during);
}

/// With a short lease (300 ms, so the grant lease is 300 ms too), a lock taken from a
/// grant stays held across many grant leases: its first renewal, planned by the
/// watchdog's frequent looks while the waiter waited rather than by waking it at the
/// handoff, comes before the grant's bound, and the renewals after it keep the lock.
#[test]
fn a_granted_lock_with_a_short_lease_is_renewed_in_time() {
    let short = |url: &str| lock_client!(node(url), lease(ms(300)));
    let srv = test_server();
    // Ten grant leases: a lock whose first renewal came late would be lost by now.
    let during = || thread::sleep(ms(3000));
    grants::granted_in_time(Lock, &srv, short(&srv.url()), &short(&srv.url()), during);
}

/// A grant that reaches its grantee after its bound (a proxy delays everything the server
/// sends the grantee by 1.5 s; the grant lease is 1 s) is not taken as a lock: another
/// client takes the expired grant's key meanwhile, and the grantee gets the lock only
/// after that holder lets go.
#[test]
fn a_grant_delayed_past_its_bound_is_not_a_lock() {
    grants::delayed_past_its_bound(Lock);
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
    grants::stale_grant_only_wakes(Lock, &srv, &w);
}

/// Child: waits for "k", then reports when it got it, whether its guard's check held, and
/// how many grants it took as the lock.
#[test]
fn child_grantee() {
    grants::grantee(Lock);
}

/// A grantee stopped (SIGSTOP) across its grant: the others get the lock once the grant
/// lease ran out; resumed, it does not believe it holds, and gets the lock only after the
/// holder of the moment lets go. (On Linux the resumed subscriber's read fails with
/// `EINTR` and it reconnects, so the grant is usually lost rather than late: either way
/// only a wake-up. A grant read late is `a_grant_delayed_past_its_bound_is_not_a_lock`.)
#[test]
fn a_grantee_stopped_across_its_grant_does_not_believe_it_holds() {
    grants::stopped_grantee(Lock, "child_grantee");
}

/// A grant message lost entirely (the grantee's connections drop it, then are reset): the
/// grantee's next attempt, after its subscriber reconnects, gets the lock.
#[test]
fn a_lost_grant_message_is_recovered_by_the_next_attempt() {
    grants::lost_grant_recovered(Lock);
}
