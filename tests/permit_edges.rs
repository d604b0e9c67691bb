//! Semaphores and countdown latches at their edges, against real `redis-server`
//! processes: a name whose kind changes while the old kind's waiters still wait, replies
//! lost on the way back, and permits counted across processes.

use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::Instant;

use redbaton::{LockClient, Unlocked};
use redbaton_testkit::intervals::{self, Recorder};
use redbaton_testkit::proxy::Proxy;
use redbaton_testkit::server::RedisServer;
use redbaton_testkit::wait::wait_for;
use redbaton_testkit::{lock_client, ms, secs, test_server};

const PREFIX: &str = "pe:";

/// A client whose waits end only by a message (or their deadline).
fn patient(url: &str) -> LockClient {
    lock_client!(node(url), key_prefix(PREFIX), patient())
}

/// A patient client reaching Redis through `proxy`, whose network failures are found
/// out fast: one that a test cuts off.
fn behind(proxy: &Proxy) -> LockClient {
    let url = proxy.url();
    lock_client!(
        node(url),
        key_prefix(PREFIX),
        patient(),
        io_timeouts(ms(300))
    )
}

/// A client whose holds lapse soon after they are taken (it renews nothing): a holder
/// that froze.
fn freezing(url: &str) -> LockClient {
    lock_client!(
        node(url),
        key_prefix(PREFIX),
        lease(ms(400)),
        auto_renew(false)
    )
}

/// A client whose holds outlast any test here.
fn lasting(url: &str) -> LockClient {
    lock_client!(node(url), key_prefix(PREFIX), lease(secs(30)))
}

/// A server, and a proxy in front of it.
fn server_and_proxy() -> (RedisServer, Proxy) {
    let srv = test_server();
    let proxy = Proxy::start(srv.addr());
    (srv, proxy)
}

/// A server, a proxy in front of it, a client of lasting holds behind the proxy (whose
/// replies a test loses), and a patient client of the server.
fn lossy_and_direct() -> (RedisServer, Proxy, LockClient, LockClient) {
    let (srv, proxy) = server_and_proxy();
    let (lossy, direct) = (lasting(&proxy.url()), patient(&srv.url()));
    (srv, proxy, lossy, direct)
}

/// A deadline far enough for a wait that ends by a message, far shorter than a re-check.
fn soon() -> Instant {
    Instant::now() + secs(20)
}

/// Waits until `marked` waiters of `name` (writers or permit-seekers) are marked waiting,
/// the last of them a waiter of client `c` that failed twice (its attempts before and
/// after subscribing): it sleeps in Redis.
fn asleep(srv: &RedisServer, c: &LockClient, name: &str, marked: usize) {
    let marks = format!("{PREFIX}{{{name}}}:ww");
    wait_for(secs(10), "the waiter asleep", || {
        srv.zcard(&marks) == marked && c.stats().failed_attempts >= 2
    });
}

#[test]
fn smoke() {
    let srv = test_server();
    let c = patient(&srv.url());
    let permit = c.semaphore("smoke", 1).try_acquire().expect("permit");
    assert_eq!(c.latch("smoke", 1).count_down().expect("count down"), 0);
    drop(permit);
}

/// A writer still waiting on a name whose write hold lapsed (its holder froze) when the
/// name is taken up as a semaphore: the semaphore's release must not grant a permit to
/// the writer's mark. The writer is told the name is another kind, and never holds a
/// "write hold" that is a permit, with the semaphore's count for a fence.
#[test]
fn a_semaphore_release_grants_no_permit_to_a_writer_left_waiting() {
    let (srv, proxy) = server_and_proxy();
    let url = srv.url();
    // The writer reaches Redis through the proxy: its attempt after the lapse is held
    // back on its way, so that the semaphore takes the name up first, as the scenario
    // needs (were the writer first, its write hold would be a write hold).
    let writer = lock_client!(node(proxy.url()), key_prefix(PREFIX), patient());
    let (frozen, sem_user) = (freezing(&url), lasting(&url));
    let name = "kind-change";
    let first = frozen.rwlock(name).write().expect("first write hold");
    let first_token = first.fencing_token();
    std::mem::forget(first);
    thread::scope(|s| {
        let w = s.spawn(|| {
            writer
                .rwlock(name)
                .try_write_until(soon())
                .map(|g| g.fencing_token())
        });
        asleep(&srv, &writer, name, 1);
        proxy.set_delay_both(ms(300));
        // Two permits, taken once the frozen write hold lapsed; one is given back while
        // the other keeps the name a semaphore, and no permit-seeker waits.
        let sem = sem_user.semaphore(name, 2);
        let mut kept = None;
        wait_for(secs(5), "the frozen write hold lapsed", || {
            kept = sem.try_acquire().ok();
            kept.is_some()
        });
        drop(sem.try_acquire().expect("the second permit"));
        let still_free = sem.try_acquire();
        proxy.set_delay_both(ms(0));
        let got = w.join().expect("writer thread");
        match got {
            Err(e) => assert!(e.is_wrong_kind(), "{e}"),
            Ok(token) => panic!(
                "the writer holds a write hold of token {token} (the write before it had {first_token}) on a semaphore's name"
            ),
        }
        drop(still_free.expect("the permit given back is free"));
        drop(kept);
    });
}

/// Permits held by clients of their own (as many processes) while replies to their
/// scripts are lost now and then: acquires, renewals, grants trusted and releases sent
/// again never let more holders than permits hold at once, and every client gets permits.
#[test]
fn lost_replies_never_let_more_holders_than_permits_hold() {
    let (_srv, proxy) = server_and_proxy();
    let recorder = Recorder::new();
    let name = "lossy";
    let stop = AtomicBool::new(false);
    let clients: Vec<LockClient> = (0..5)
        .map(|_| {
            lock_client!(
                node(proxy.url()),
                key_prefix(PREFIX),
                lease(ms(600)),
                recheck_interval(secs(60)),
                io_timeouts(ms(500))
            )
        })
        .collect();
    let got: Vec<usize> = thread::scope(|s| {
        let workers: Vec<_> = clients
            .iter()
            .map(|c| {
                let (recorder, stop) = (&recorder, &stop);
                s.spawn(move || {
                    let sem = c.semaphore(name, 2);
                    let mut got = 0;
                    while !stop.load(Ordering::Relaxed) {
                        let Ok(permit) = sem.try_acquire_for(ms(300)) else {
                            continue;
                        };
                        recorder.time("p", || thread::sleep(ms(4)));
                        // No fault here can cost a holder its permit: a reply lost is
                        // sent again, well within the lease.
                        permit.check().expect("the permit held throughout");
                        got += 1;
                        drop(permit);
                    }
                    got
                })
            })
            .collect();
        let end = Instant::now() + ms(1500);
        while Instant::now() < end {
            proxy.drop_next_reply_matching(b"EVALSHA");
            thread::sleep(ms(25));
        }
        stop.store(true, Ordering::Relaxed);
        workers
            .into_iter()
            .map(|w| w.join().expect("worker"))
            .collect()
    });
    let held = recorder.intervals();
    let most = intervals::most_at_once(&held);
    eprintln!(
        "{} permits held, at most {most} at once, per client {got:?}",
        held.len()
    );
    assert!(most <= 2, "{most} holders of 2 permits at once");
    assert!(
        got.iter().all(|&n| n > 0),
        "a client never got a permit: {got:?}"
    );
    assert!(
        proxy.replies_dropped() > 10,
        "{} replies lost",
        proxy.replies_dropped()
    );
}

/// A release whose reply is lost, sent again after the first send granted the permit to
/// the waiter: the holder is told it released, and the release sent again takes nothing
/// from the waiter, which holds the one permit alone.
#[test]
fn a_release_sent_again_after_its_grant_takes_nothing_from_the_grantee() {
    let (srv, proxy, holder, waiter) = lossy_and_direct();
    let name = "release-again";
    let permit = holder.semaphore(name, 1).acquire().expect("permit");
    thread::scope(|s| {
        let w = s.spawn(|| {
            let granted = waiter.semaphore(name, 1).try_acquire_until(soon())?;
            granted.check()?;
            let e = holder.semaphore(name, 1).try_acquire().unwrap_err();
            assert!(e.is_would_block(), "{e}");
            granted.unlock()
        });
        asleep(&srv, &waiter, name, 1);
        proxy.drop_next_reply_matching(b"EVALSHA");
        assert_eq!(permit.unlock().expect("unlock"), Unlocked::Released);
        assert_eq!(proxy.replies_dropped(), 1);
        let unlocked = w
            .join()
            .expect("waiter thread")
            .expect("the permit released");
        assert_eq!(unlocked, Unlocked::Released);
    });
}

/// An acquire whose reply is lost is sent again with the same member: it finds the
/// permit it took and takes it once, so the semaphore counts it once.
#[test]
fn an_acquire_sent_again_after_its_reply_was_lost_counts_once() {
    let (srv, proxy, lossy, other) = lossy_and_direct();
    let name = "acquire-again";
    proxy.drop_next_reply_matching(b"EVALSHA");
    let first = lossy.semaphore(name, 2).try_acquire().expect("a permit");
    assert_eq!(proxy.replies_dropped(), 1);
    let second = other
        .semaphore(name, 2)
        .try_acquire()
        .expect("the other permit");
    let e = other.semaphore(name, 2).try_acquire().unwrap_err();
    assert!(e.is_would_block(), "{e}");
    assert_eq!(
        srv.zcard(&format!("{PREFIX}{{{name}}}")),
        3,
        "the kind and two holds"
    );
    drop((first, second));
    assert!(srv.keys(&format!("{PREFIX}*")).is_empty());
}

/// A count down whose reply is lost is not sent again: the error says so, and the latch
/// was counted down once, not twice.
#[test]
fn a_count_down_whose_reply_was_lost_counts_once() {
    let (_srv, proxy) = server_and_proxy();
    let lossy = lock_client!(node(proxy.url()), key_prefix(PREFIX), io_timeouts(ms(500)));
    let latch = lossy.latch("count-once", 3);
    assert_eq!(latch.count().expect("count"), 3);
    proxy.drop_next_reply_matching(b"EVALSHA");
    let e = latch.count_down().unwrap_err();
    assert!(e.is_connection(), "{e}");
    assert_eq!(latch.count().expect("count"), 2);
}

/// A permit-seeker cut off while it waited (its mark lingers) on a name whose permits
/// lapsed, then taken up as a read-write lock: the write hold's release grants it to the
/// writer waiting behind that stale mark, which gets it at once, not at its re-check.
#[test]
fn a_write_release_passes_over_a_permit_seeker_left_waiting() {
    let (srv, proxy) = server_and_proxy();
    let name = "kind-change-back";
    let (frozen, seeker) = (freezing(&srv.url()), behind(&proxy));
    let (first, next) = (patient(&srv.url()), patient(&srv.url()));
    std::mem::forget(frozen.semaphore(name, 1).acquire().expect("permit"));
    thread::scope(|s| {
        let p = s.spawn(|| seeker.semaphore(name, 1).try_acquire_for(secs(2)).map(drop));
        asleep(&srv, &seeker, name, 1);
        proxy.blackhole(true);
        let mut write = None;
        wait_for(secs(5), "the frozen permit lapsed", || {
            write = first.rwlock(name).try_write().ok();
            write.is_some()
        });
        let w = s.spawn(|| {
            let got = next.rwlock(name).try_write_for(secs(5)).map(drop);
            (got, Instant::now())
        });
        asleep(&srv, &next, name, 2);
        drop(write);
        let released = Instant::now();
        let (got, when) = w.join().expect("writer thread");
        got.expect("the write hold");
        let after = when - released;
        assert!(
            after < secs(2),
            "the writer got the free write hold {after:?} after its release"
        );
        let _ = p.join().expect("seeker thread");
        proxy.blackhole(false);
    });
}

/// A permit-seeker cut off while it waited (its mark lingers) on a name whose permits
/// lapsed: a reader of the name, now free, gets its read hold at once, not after the
/// seeker's mark expires (two re-check intervals), as if a writer waited.
#[test]
fn a_reader_is_not_held_back_by_a_permit_seeker_left_waiting() {
    let (srv, proxy) = server_and_proxy();
    let name = "kind-change-read";
    let (frozen, seeker) = (freezing(&srv.url()), behind(&proxy));
    let reader = patient(&srv.url());
    std::mem::forget(frozen.semaphore(name, 1).acquire().expect("permit"));
    thread::scope(|s| {
        let p = s.spawn(|| seeker.semaphore(name, 1).try_acquire_for(secs(2)).map(drop));
        asleep(&srv, &seeker, name, 1);
        proxy.blackhole(true);
        thread::sleep(ms(500));
        let read = reader.rwlock(name).try_read_for(secs(1));
        drop(read.expect("a read hold of a free name"));
        let _ = p.join().expect("seeker thread");
        proxy.blackhole(false);
    });
}
