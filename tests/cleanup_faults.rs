//! The cleanup job under faults, against a real `redis-server` and the fault-injecting
//! proxy: a waiter of a fair lock whose leaving fails in a partition leaves its queue
//! entry to the cleanup job, which keeps trying while the entry lives (two re-check
//! intervals), not only for one lease: given up after a lease shorter than that, the
//! departed waiter's entry would stay in the queue, ahead of live waiters, once the
//! partition heals; and an attempt that lands after its caller gave up is given back, as
//! is the first send of one sent again after a lost reply, which its retry overtook, for
//! every kind of hold and however the call ended.
//! (`lifecycle.rs` shows that `shutdown` stops the job's thread.)
//!
//! Times are liveness bounds, never speed claims.

use std::panic::{self, AssertUnwindSafe};
use std::thread;
use std::time::Instant;

use redbaton::fault::{self, Point};
use redbaton::{Builder, Error, LockClient, ReadGuard, UpgradableReadGuard};
use redbaton_testkit::proxy::Proxy;
use redbaton_testkit::server::RedisServer;
use redbaton_testkit::wait::wait_for;
use redbaton_testkit::{lock_builder, lock_client, ms, secs, test_server, test_server_and};

/// The fair queue of the lock `name` under the default prefix.
fn queue(name: &str) -> String {
    format!("redbaton:{{{name}}}:q")
}

fn client(url: &str) -> LockClient {
    lock_client!(node(url))
}

/// Runs `call`, a call of a client through `proxy` (with a read timeout of 1 s), with its
/// first send held back 4 s on its way, while its retry with the same token (after the
/// read timeout, on a fresh connection) goes through at once: the retry overtakes it.
fn overtaking<T>(proxy: &Proxy, call: impl FnOnce() -> T) -> T {
    proxy.set_delay_both(secs(4));
    thread::scope(|s| {
        s.spawn(|| {
            thread::sleep(ms(500));
            proxy.set_delay_both(ms(0));
        });
        call()
    })
}

/// A server, a proxy in front of it, and a client through the proxy whose calls give up
/// after 1 s (see [`overtaking`]).
fn behind_proxy() -> (RedisServer, Proxy, LockClient) {
    behind_proxy_with(|b| b)
}

/// As [`behind_proxy`], the client's settings changed by `more`.
fn behind_proxy_with(more: impl FnOnce(Builder) -> Builder) -> (RedisServer, Proxy, LockClient) {
    let srv = test_server();
    let proxy = Proxy::start(srv.addr());
    let late = more(lock_builder!(node(proxy.url()), io_timeouts(secs(1))));
    (srv, proxy, late.build().expect("a client"))
}

/// Waits until the key of `name` (a lock, or a read-write lock or semaphore) exists: a
/// first send held back by [`overtaking`] landed.
fn landed(srv: &RedisServer, name: &str) {
    let key = format!("redbaton:{{{name}}}");
    wait_for(secs(6), "the first send landed", || {
        srv.keys_but_fences(&format!("{key}*")).contains(&key)
    });
}

/// A fair lock is taken and given back, leaving no queue.
#[test]
fn smoke() {
    let (srv, c) = test_server_and(client);
    drop(c.lock("smoke").expect("lock"));
    assert_eq!(srv.zcard(&queue("smoke")), 0);
}

/// A waiter of a fair lock (a lease of 1 s, a re-check interval of a minute: its queue
/// entry lives two minutes after its last attempt) gives up while the link to Redis is a
/// black hole: its leaving fails and is left to the cleanup job, which cannot reach Redis
/// either. The partition lasts longer than the lease, far shorter than the entry's TTL;
/// once it heals, the cleanup job still takes the entry out of the queue.
#[test]
fn a_leave_left_to_the_cleanup_job_is_tried_while_the_entry_lives() {
    let srv = test_server();
    let proxy = Proxy::start(srv.addr());
    let holder = lock_client!(node(srv.url()), lease(secs(1)));
    let waiter = lock_client!(
        node(proxy.url()),
        lease(secs(1)),
        recheck_interval(secs(60)),
        io_timeouts(ms(300))
    );
    // Scripts loaded, so that the waiter's first attempt queues at once.
    drop(waiter.lock("warm-up").expect("warm-up"));
    let held = holder.lock("k").expect("lock");
    thread::scope(|s| {
        let w = s.spawn(|| waiter.try_lock_for("k", ms(1500)).map(drop));
        wait_for(secs(30), "the waiter queued", || {
            srv.zcard(&queue("k")) == 1
        });
        proxy.blackhole(true);
        wait_for(secs(30), "the waiter gives up", || w.is_finished());
        // Its deadline, or an attempt's read that timed out in the black hole first.
        let e = w.join().expect("waiter").expect_err("the lock is held");
        assert!(e.is_timeout() || e.is_connection(), "{e:?}");
    });
    // The leave was queued before the waiter returned: it is older than the lease now.
    thread::sleep(ms(2500));
    proxy.heal();
    assert_eq!(srv.zcard(&queue("k")), 1, "the departed waiter's entry");
    wait_for(secs(20), "the cleanup job takes the entry out", || {
        srv.zcard(&queue("k")) == 0
    });
    held.unlock().expect("unlock");
}

/// An attempt delayed on its way lands after its caller gave up, and takes the free lock
/// with a token nobody holds. The give-back of that attempt found nothing when it ran (it
/// overtook the attempt on a fresh connection), so the cleanup job looks again for a while
/// and gives the late hold back: another client gets the lock soon after the late attempt
/// lands, not a lease later. Fair and plain locks alike.
#[test]
fn an_attempt_that_lands_after_its_caller_gave_up_is_given_back() {
    for fair in [false, true] {
        let srv = test_server();
        let proxy = Proxy::start(srv.addr());
        let late = lock_client!(node(proxy.url()), lease(secs(10)), fair(fair));
        let other = client(&srv.url());
        // Connections and scripts ready, so that the one delayed request is the attempt.
        drop(late.lock("warm-up").expect("warm-up"));
        proxy.set_delay_both(ms(2000));
        let e = late
            .try_lock_for("k", ms(300))
            .expect_err("the attempt is delayed");
        assert!(e.is_timeout() || e.is_connection(), "{e:?}");
        // The give-back and what follows go through at once; the attempt lands at 2 s.
        proxy.set_delay_both(ms(0));
        wait_for(secs(5), "the late attempt landed", || {
            srv.keys_but_fences("redbaton:{k}*")
                .contains(&"redbaton:{k}".to_owned())
        });
        // The late hold would last 10 s. Given back, the other client gets the lock soon.
        let got = other.try_lock_for("k", secs(6));
        assert!(got.is_ok(), "fair {fair}: {:?}", got.err());
    }
}

/// What the owner of `k` does while a retry overtakes the first send (see [`overtaken`]).
#[derive(Debug, Clone, Copy, PartialEq)]
enum Owner {
    /// Nobody holds `k`: the retry wins, and its holder releases.
    None,
    /// It holds `k` until the caller gives up, then lets go.
    Outwaits,
    /// It holds `k` when the retry comes (which finds it held) and lets go while the
    /// caller waits, which then wins and releases.
    LetsGo,
    /// It holds `k` when the retry comes, which refuses a caller that does not wait
    /// (`try_lock`), and lets go after that.
    Refuses,
}

/// A client whose attempt on `k` is overtaken by its retry (see [`overtaking`]); `owner`
/// says what the other owner of `k` does meanwhile. Either way the first send lands
/// after the caller is done, and takes the free lock with a token nobody holds: it must
/// be given back soon, as above.
fn overtaken(fair: bool, owner: Owner) {
    let srv = test_server();
    let proxy = Proxy::start(srv.addr());
    let late = lock_client!(node(proxy.url()), fair(fair), io_timeouts(secs(1)));
    drop(late.lock("warm-up").expect("warm-up"));
    let key = "redbaton:{k}";
    let del = || redis::cmd("DEL").arg(key).query::<()>(&mut srv.conn());
    if owner != Owner::None {
        let held = redis::cmd("SET")
            .arg(key)
            .arg("owner")
            .arg("PX")
            .arg(60_000)
            .clone();
        let () = held.query(&mut srv.conn()).expect("SET");
    }
    let started = Instant::now();
    let outcome = overtaking(&proxy, || {
        thread::scope(|s| {
            if owner == Owner::LetsGo {
                s.spawn(|| {
                    thread::sleep(ms(1500).saturating_sub(started.elapsed()));
                    del().expect("DEL");
                });
            }
            match owner {
                Owner::Refuses => late.try_lock("k").and_then(|g| g.unlock()),
                Owner::Outwaits => late.try_lock_for("k", secs(2)).and_then(|g| g.unlock()),
                _ => late.try_lock_for("k", secs(3)).and_then(|g| g.unlock()),
            }
        })
    });
    match outcome {
        Err(e) => assert!(
            (owner == Owner::Outwaits && e.is_timeout())
                || (owner == Owner::Refuses && e.is_would_block()),
            "{owner:?}: {e:?}"
        ),
        Ok(unlocked) => {
            assert!(matches!(owner, Owner::None | Owner::LetsGo) && unlocked.was_held())
        }
    }
    if matches!(owner, Owner::Outwaits | Owner::Refuses) {
        del().expect("DEL");
    }
    landed(&srv, "k");
    let got = client(&srv.url()).try_lock_for("k", secs(6));
    assert!(got.is_ok(), "fair {fair}, {owner:?}: {:?}", got.err());
}

/// The retry finds the lock held: its answer says nothing of the first send, also when
/// the caller does not wait.
#[test]
fn an_attempt_overtaken_by_its_retry_and_landing_late_is_given_back() {
    for fair in [false, true] {
        overtaken(fair, Owner::Outwaits);
        overtaken(fair, Owner::LetsGo);
        overtaken(fair, Owner::Refuses);
    }
}

/// The retry wins: the release is looked at again.
#[test]
fn an_attempt_overtaken_by_its_winning_retry_and_landing_after_the_release_is_given_back() {
    for fair in [false, true] {
        overtaken(fair, Owner::None);
    }
}

/// A semaphore's permit-seeker, as above: its retry finds no permit free, it gives up, the
/// holder lets go, and the first send lands and takes the permit with a member nobody
/// holds. The seeker's leave looks again, and gives it back.
#[test]
fn a_permit_attempt_overtaken_by_its_retry_and_landing_late_is_given_back() {
    let (srv, proxy, late) = behind_proxy();
    let (owner, other) = (client(&srv.url()), client(&srv.url()));
    drop(late.semaphore("warm-up", 1).acquire().expect("warm-up"));
    let held = owner.semaphore("s", 1).acquire().expect("the permit");
    let got = overtaking(&proxy, || late.semaphore("s", 1).try_acquire_for(secs(2)));
    let e = got.map(drop).expect_err("no permit free");
    assert!(e.is_timeout(), "{e:?}");
    assert!(held.unlock().expect("unlock").was_held());
    thread::sleep(secs(3)); // the first send lands
    let got = other.semaphore("s", 1).try_acquire_for(secs(6));
    assert!(got.is_ok(), "{:?}", got.err());
}

/// A hold won by a retry that overtook its first send, then released: the first send
/// lands and takes the hold again with the released token; the release is looked at
/// again, and gives it back. A read-write lock's write hold, and a multi-lock's names.
#[test]
fn a_hold_won_by_a_retry_and_released_is_looked_at_again() {
    for multi in [false, true] {
        let (srv, proxy, late) = behind_proxy();
        let other = client(&srv.url());
        let take = |c: &LockClient, names: [&str; 2], wait| match multi {
            true => c.try_multi_lock_for(names, wait)?.unlock(),
            false => c.rwlock(names[0]).try_write_for(wait)?.unlock(),
        };
        take(&late, ["w1", "w2"], secs(3)).expect("warm-up");
        let unlocked = overtaking(&proxy, || take(&late, ["a", "b"], secs(3)));
        assert!(unlocked.expect("the retry wins").was_held());
        landed(&srv, "a");
        let got = take(&other, ["a", "b"], secs(6));
        assert!(got.is_ok(), "multi {multi}: {:?}", got.err());
    }
}

/// A fair lock won by a retry that overtook its first send, and released; another client
/// then holds the lock when the first send lands, which queues the released token (its
/// entry would live two re-check intervals, two minutes here) ahead of every later
/// waiter: the next release would grant the lock to nobody. The release's look again
/// takes the entry out as well as a hold.
#[test]
fn a_first_send_landing_queued_after_the_release_is_taken_out_of_the_queue() {
    let (srv, proxy, late) = behind_proxy_with(|b| b.recheck_interval(secs(60)));
    drop(late.lock("warm-up").expect("warm-up"));
    let other = client(&srv.url());
    let held = overtaking(&proxy, || {
        let unlocked = late.try_lock_for("k", secs(3))?.unlock()?;
        assert!(unlocked.was_held());
        other.lock("k")
    });
    let held = held.expect("the retry wins, and the lock is free again");
    wait_for(secs(8), "the first send landed, queued", || {
        srv.zcard(&queue("k")) == 1
    });
    wait_for(secs(8), "the look again takes the entry out", || {
        srv.zcard(&queue("k")) == 0
    });
    assert!(held.unlock().expect("unlock").was_held());
}

/// A server with no replica to acknowledge a hold (`replica_ack`): every win is given
/// back. A retry that overtook its first send wins and is given back; the first send
/// lands after that, on the free lock, with a token nobody holds. It is given back too.
#[test]
fn a_win_by_a_retry_without_its_replicas_is_looked_at_again_after_its_give_back() {
    let (srv, proxy, late) = behind_proxy_with(|b| b.fair(false).replica_ack(1, ms(100)));
    let warm_up = late.try_lock("warm-up").map(drop);
    let overtaken = overtaking(&proxy, || late.try_lock("k").map(drop));
    for got in [warm_up, overtaken] {
        let e = got.expect_err("no replica");
        assert!(matches!(e, Error::ReplicaAck { .. }), "{e:?}");
    }
    landed(&srv, "k");
    let got = client(&srv.url()).try_lock_for("k", secs(6));
    assert!(got.is_ok(), "{:?}", got.err());
}

/// An upgradable read won by a retry that overtook its first send; the read-write lock is
/// then deleted under it, so its upgrade fails and the guard, lost, gives its hold back
/// in the background. The first send lands after that and takes the upgradable read with
/// the member given back: that give-back is looked at again too.
#[test]
fn a_hold_won_by_a_retry_and_given_back_in_the_background_is_looked_at_again() {
    let (srv, proxy, late) = behind_proxy();
    drop(late.rwlock("warm-up").upgradable_read().expect("warm-up"));
    let guard = overtaking(&proxy, || {
        late.rwlock("rw").try_upgradable_read_for(secs(3))
    });
    let guard = guard.expect("the retry wins");
    let () = redis::cmd("DEL")
        .arg("redbaton:{rw}")
        .query(&mut srv.conn())
        .expect("DEL");
    let e = guard.upgrade().expect_err("the upgradable read is gone");
    assert!(e.is_lost(), "{e:?}");
    landed(&srv, "rw");
    let got = client(&srv.url()).rwlock("rw").try_write_for(secs(6));
    assert!(got.is_ok(), "{:?}", got.err());
}

/// Through `proxy`, `late` takes the upgradable read of `rw` while `other` reads it, and
/// its upgrade's first send is overtaken by its retry, which finds the reader and waits
/// until the upgrade times out (its waiting mark taken out): the guard, and the reader's.
fn upgrade_timed_out(
    proxy: &Proxy,
    late: &LockClient,
    other: &LockClient,
) -> (UpgradableReadGuard, ReadGuard) {
    let warm = late.rwlock("warm-up").upgradable_read().expect("warm-up");
    let reading = other.rwlock("warm-up").read().expect("warm-up read");
    let warm = warm.try_upgrade_for(ms(200)).expect_err("warm-up");
    drop(reading);
    drop(warm.into_guard().upgrade().expect("warm-up upgrade"));
    let guard = late.rwlock("rw").upgradable_read().expect("upgradable");
    let reading = other.rwlock("rw").read().expect("another reader");
    let e = overtaking(proxy, || guard.try_upgrade_for(secs(2))).expect_err("a reader holds");
    assert!(e.error().is_timeout(), "{e:?}");
    (e.into_guard(), reading)
}

/// An upgrade whose first send is overtaken by its retry, which finds another reader and
/// waits until the upgrade times out; the guard keeps its upgradable read. The reader lets
/// go and the first send lands: it turns the guard's upgradable read into the write hold
/// of the same member. That hold is the guard's, and goes with the guard's release.
#[test]
fn an_upgrade_landing_after_it_timed_out_goes_with_the_guard() {
    let (srv, proxy, late) = behind_proxy();
    let other = client(&srv.url());
    let (guard, reading) = upgrade_timed_out(&proxy, &late, &other);
    drop(reading);
    wait_for(secs(6), "the first send landed", || {
        let holds: Vec<String> = redis::cmd("ZRANGE")
            .arg("redbaton:{rw}")
            .arg(0)
            .arg(-1)
            .query(&mut srv.conn())
            .expect("ZRANGE");
        holds.iter().any(|m| m.starts_with('w'))
    });
    drop(guard.unlock());
    let got = other.rwlock("rw").try_write_for(secs(6));
    assert!(got.is_ok(), "{:?}", got.err());
}

/// A lock won by a retry that overtook its first send, whose release panics (injected
/// there): the release is left to the cleanup thread, and the first send, landing after
/// it, takes the lock again with the released token. That release is looked at again too.
#[test]
fn a_release_left_to_the_cleanup_thread_after_a_panic_is_looked_at_again() {
    const PREFIX: &str = "cleanup-faults-panic:";
    let (srv, proxy, late) = behind_proxy_with(|b| b.key_prefix(PREFIX));
    drop(late.lock("warm-up").expect("warm-up"));
    let guard = overtaking(&proxy, || late.try_lock_for("k", secs(3)));
    let guard = guard.expect("the retry wins");
    fault::arm(PREFIX, Point::Release, 1);
    let unlocked = panic::catch_unwind(AssertUnwindSafe(|| guard.unlock()));
    fault::disarm(PREFIX, Point::Release);
    assert!(unlocked.is_err(), "the release panics");
    let key = format!("{PREFIX}{{k}}");
    let held = || srv.keys_but_fences(&format!("{key}*")).contains(&key);
    wait_for(secs(6), "the release made", || !held());
    wait_for(secs(6), "the first send landed", held);
    let other = lock_client!(node(srv.url()), key_prefix(PREFIX));
    let got = other.try_lock_for("k", secs(6));
    assert!(got.is_ok(), "{:?}", got.err());
}

/// A hold won by a retry that overtook its first send, then turned into another (a write
/// hold downgraded, an upgradable read upgraded) and released: the first send lands after
/// that, and takes the hold it was for with the member the turn retired. The release of
/// the turned hold looks again at that member too.
#[test]
fn a_hold_won_by_a_retry_and_turned_is_looked_at_again_after_its_release() {
    for upgrade in [false, true] {
        let (srv, proxy, late) = behind_proxy();
        let turned = |name: &str| match upgrade {
            true => late
                .rwlock(name)
                .try_upgradable_read_for(secs(3))?
                .upgrade()?
                .unlock(),
            false => late
                .rwlock(name)
                .try_write_for(secs(3))?
                .downgrade()?
                .unlock(),
        };
        turned("warm-up").expect("warm-up");
        let unlocked = overtaking(&proxy, || turned("rw"));
        assert!(unlocked.expect("the retry wins").was_held());
        landed(&srv, "rw");
        let got = client(&srv.url()).rwlock("rw").try_write_for(secs(6));
        assert!(got.is_ok(), "upgrade {upgrade}: {:?}", got.err());
    }
}

/// An upgrade whose first send is overtaken by its retry, which finds another reader and
/// waits until the upgrade times out (its waiting mark taken out); the first send lands
/// while that reader still holds, and marks the guard's upgrade as waiting again. The
/// guard then lets go: its waiting mark goes with its upgradable read, or it would hold
/// every new reader back, for nobody, for two re-check intervals (two minutes here).
#[test]
fn an_upgrade_marking_after_it_timed_out_leaves_no_mark_behind_the_guard() {
    let (srv, proxy, late) = behind_proxy_with(|b| b.recheck_interval(secs(60)));
    let other = client(&srv.url());
    let (guard, reading) = upgrade_timed_out(&proxy, &late, &other);
    thread::sleep(secs(3)); // the first send lands, and marks the upgrade waiting
    assert!(guard.unlock().expect("unlock").was_held());
    let got = client(&srv.url()).rwlock("rw").try_read_for(secs(3));
    assert!(got.is_ok(), "{:?}", got.err());
    drop(reading);
}
