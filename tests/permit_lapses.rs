//! Semaphores when grants lapse and reads are refused, against real `redis-server`
//! processes: permits freed by grants nobody took reach the waiters left, and the keys of
//! a semaphore keep a TTL under an ACL that refuses a read its scripts make after writing.

use std::thread;
use std::time::Instant;

use redbaton::{Cancel, LockClient, Semaphore, Unlocked};
use redbaton_testkit::keys::Keys;
use redbaton_testkit::leftover::{KeyPolicy, misplaced};
use redbaton_testkit::proxy::Proxy;
use redbaton_testkit::server::RedisServer;
use redbaton_testkit::wait::wait_for;
use redbaton_testkit::{lock_client, ms, secs, test_server};

const PREFIX: &str = "pl:";

/// A client whose waits end only by a message (or their deadline): its re-checks and its
/// holders' lease hints come a minute later, long after any test here. No keyspace
/// events: a key that expires wakes nobody, as with a server that refuses `CONFIG`.
fn patient(url: &str) -> LockClient {
    lock_client!(
        node(url),
        io_timeouts(ms(300)),
        key_prefix(PREFIX),
        configure_notifications(false),
        patient()
    )
}

/// Waits until the permit-seeker of `name` of client `c`, the `n`th, sleeps in Redis: it
/// failed twice (its attempts before and after subscribing) and is marked waiting, so
/// that its lease hint is the holders' lease.
fn asleep(srv: &RedisServer, c: &LockClient, name: &str, n: usize) {
    wait_for(secs(10), "the waiter asleep", || {
        srv.zcard(&format!("{PREFIX}{{{name}}}:ww")) == n && c.stats().failed_attempts >= 2
    });
}

/// What a semaphore's user needs (Redis 6.2 and later) but `PTTL`, which its scripts read.
const NO_PTTL_ACL: &str = "resetkeys ~redbaton:* resetchannels &redbaton:* -@all +evalsha \
     +script|load +get +set +del +pexpire +publish +exists +time +zadd +zrem +zrange \
     +zrangebyscore +zcard +zcount +zscore +zmscore +zremrangebyscore +subscribe \
     +unsubscribe +ping";

#[test]
fn smoke() {
    let srv = test_server();
    let c = patient(&srv.url());
    let sem = c.semaphore("smoke", 2);
    let (a, b) = (
        sem.try_acquire().expect("one"),
        sem.try_acquire().expect("two"),
    );
    assert!(sem.try_acquire().unwrap_err().is_would_block());
    assert_eq!(a.unlock().expect("unlock"), Unlocked::Released);
    assert_eq!(b.unlock().expect("unlock"), Unlocked::Released);
}

/// Two permits granted to two waiters cut off by a stalled network lapse unused, and the
/// key goes with them; a newcomer takes one permit, making the key again, and the other is
/// free. When the two give up, their leaving wakes the waiter behind them, which takes the
/// free permit then, not at its re-check a minute later.
#[test]
fn lapsed_grants_under_a_key_made_again_reach_the_next_waiter() {
    let srv = test_server();
    let proxy = Proxy::start(srv.addr());
    let name = "again";
    let holder = patient(&srv.url());
    let sem = |c: &LockClient| -> Semaphore { c.semaphore(name, 2) };
    let held = (
        sem(&holder).acquire().expect("one"),
        sem(&holder).acquire().expect("two"),
    );
    let cut: Vec<LockClient> = (0..2).map(|_| patient(&proxy.url())).collect();
    let (next, newcomer) = (patient(&srv.url()), patient(&srv.url()));
    let cancel = Cancel::new();
    thread::scope(|s| {
        let mut cut_waits = Vec::new();
        for (i, c) in cut.iter().enumerate() {
            cut_waits.push(s.spawn(|| sem(c).acquire_cancellable(&cancel).map(drop)));
            asleep(&srv, c, name, i + 1);
        }
        let w = s.spawn(|| {
            let got = sem(&next).try_acquire_for(secs(20)).map(drop);
            (got, Instant::now())
        });
        asleep(&srv, &next, name, 3);
        proxy.stall(true);
        // Granted to the two waiters cut off, marked first; the grants (one second) lapse,
        // and the key with them.
        drop(held);
        wait_for(secs(10), "the lapsed grants gone with the key", || {
            srv.keys(&format!("{PREFIX}{{{name}}}")).is_empty()
        });
        let one = sem(&newcomer).try_acquire().expect("a free permit");
        cancel.cancel();
        thread::sleep(ms(500));
        proxy.stall(false);
        let healed = Instant::now();
        for wait in cut_waits {
            assert!(wait.join().unwrap().unwrap_err().is_cancelled());
        }
        // Its last attempt, at its deadline, would find the permit without a wake-up.
        let (got, at) = w.join().unwrap();
        let after = at.saturating_duration_since(healed);
        assert!(
            after < secs(10),
            "the waiter got its answer {after:?} after the leaving"
        );
        got.expect("the free permit reached the waiter left");
        drop(one);
    });
}

/// Under an ACL that refuses `PTTL`, a semaphore's scripts still work, and no key of the
/// semaphore is left without a TTL: a holder's, and a waiter's marks.
#[test]
fn no_key_without_a_ttl_when_pttl_is_refused() {
    let srv = RedisServer::builder()
        .acl_user("nopttl", "pw", NO_PTTL_ACL)
        .start();
    let c = LockClient::builder()
        .node(srv.url_as("nopttl", "pw"))
        .lease(secs(5))
        .recheck_interval(secs(5))
        .build()
        .expect("client");
    let sem = c.semaphore("ttl", 2);
    let first = sem.try_acquire();
    let second = sem.try_acquire();
    let waited = sem.try_acquire_for(ms(300));
    let policy = KeyPolicy::new(secs(5), secs(5));
    let bad = misplaced(&mut srv.conn(), Keys::DEFAULT, &["ttl"], &policy);
    assert!(
        bad.is_empty(),
        "{bad:?} (took {:?}, {:?}; waited {:?})",
        first.as_ref().map(drop),
        second.as_ref().map(drop),
        waited.as_ref().map(drop)
    );
    let _held = (first.expect("first permit"), second.expect("second permit"));
    assert!(waited.unwrap_err().is_timeout());
}
