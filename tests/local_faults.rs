//! The process-local layer at its edges, against a real redis-server: guards forgotten or
//! dropped while unwinding, waits cancelled at every moment, a client shut down while its
//! threads hold or queue behind a local holder, and many threads of one process queued on
//! one name.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::thread;
use std::time::Duration;

use redbaton::{Builder, Cancel, Error, LockClient, LostReason};
use redbaton_testkit::keys::{fence_of, handoff_of};
use redbaton_testkit::server::RedisServer;
use redbaton_testkit::wait::{join_within, wait_for};
use redbaton_testkit::{lock_builder, lock_client, ms, secs, test_server};

fn client(srv: &RedisServer) -> LockClient {
    lock_client!(node(srv.url()), key_prefix("lf:"), io_timeouts(secs(1)))
}

/// A thread of its own holds `name` on `c` until the sender returned is dropped; returns
/// once it holds, with the sender and the thread.
fn hold_elsewhere(
    c: &LockClient,
    name: &'static str,
) -> (crossbeam_channel::Sender<()>, thread::JoinHandle<()>) {
    let (held_tx, held_rx) = crossbeam_channel::bounded(0);
    let (release_tx, release_rx) = crossbeam_channel::bounded::<()>(0);
    let c = c.clone();
    let h = thread::spawn(move || {
        let g = c.lock(name).unwrap();
        held_tx.send(()).unwrap();
        let _ = release_rx.recv();
        drop(g);
    });
    held_rx.recv().unwrap();
    (release_tx, h)
}

/// A client of `srv` whose locks are lost soon: a short `lease`, and I/O timeouts below it.
fn short_lease(srv: &RedisServer, lease: Duration) -> Builder {
    lock_builder!(
        node(srv.url()),
        key_prefix("lf:"),
        io_timeouts(ms(200)),
        lease(lease)
    )
}

/// A thread of its own waits up to 5 s for `name` on `c` and returns the fencing token of
/// the hold it got, if that hold is not known lost.
fn token_elsewhere(c: &LockClient, name: &'static str) -> thread::JoinHandle<Result<u64, Error>> {
    let c = c.clone();
    thread::spawn(move || {
        let g = c.try_lock_for(name, secs(5))?;
        g.check()?;
        Ok(g.fencing_token())
    })
}

/// Shuts `c` down while `waiters` wait, then lets the holder go (`let_go`): every waiter
/// ends, with the error of a client shut down or a guard told it is lost.
fn shut_down_then(
    c: &LockClient,
    waiters: Vec<thread::JoinHandle<Result<(), Error>>>,
    let_go: impl FnOnce(),
) {
    c.clone().shutdown(secs(5)).unwrap();
    let_go();
    for r in join_within(waiters, secs(15), "waiters after shutdown") {
        assert!(
            matches!(
                r,
                Err(Error::ShutDown | Error::Lost(LostReason::WatchdogFailed))
            ),
            "{r:?}"
        );
    }
}

#[test]
fn smoke() {
    let srv = test_server();
    let c = client(&srv);
    let g = c.lock("smoke").unwrap();
    assert!(matches!(c.lock("smoke"), Err(Error::WouldDeadlock)));
    g.unlock().unwrap();
}

/// A guard leaked with `mem::forget` keeps its own client's entry: this thread asking that
/// client again is a deadlock, but another client (its own local table) is not refused: it
/// waits in Redis like any other process.
#[test]
fn a_forgotten_guard_refuses_only_its_own_client() {
    let srv = test_server();
    let (a, b) = (client(&srv), client(&srv));
    std::mem::forget(a.lock("forgotten").unwrap());
    assert!(matches!(a.lock("forgotten"), Err(Error::WouldDeadlock)));
    let r = b.try_lock_for("forgotten", ms(200));
    assert!(matches!(r, Err(Error::Timeout)), "{r:?}");
}

/// A panic inside `with_lock` releases the lock while unwinding: a thread queued behind it
/// gets it, and the panicking thread may lock the name again.
#[test]
fn a_panic_while_holding_hands_the_lock_on() {
    let srv = test_server();
    let c = client(&srv);
    let (release, holder) = hold_elsewhere(&c, "panic");
    let c2 = c.clone();
    let panicker = thread::spawn(move || {
        let r = catch_unwind(AssertUnwindSafe(|| {
            c2.with_lock("panic", || panic!("in the section"))
        }));
        assert!(r.is_err());
        c2.try_lock_for("panic", secs(5)).map(drop)
    });
    let c3 = c.clone();
    let waiter = thread::spawn(move || c3.try_lock_for("panic", secs(5)).map(drop));
    thread::sleep(ms(100));
    drop(release);
    holder.join().unwrap();
    for r in join_within(vec![panicker, waiter], secs(10), "threads after a panic") {
        r.unwrap();
    }
}

/// A cancel before the wait, during it (queued behind a local holder), fired twice, and a
/// token reused after: each wait ends with `Cancelled`, none leaves the lock stranded.
#[test]
fn a_cancel_before_during_and_twice_ends_queued_waits() {
    let srv = test_server();
    let c = client(&srv);
    let (release, holder) = hold_elsewhere(&c, "cancel");
    let fired = Cancel::new();
    fired.cancel();
    assert!(matches!(
        c.lock_cancellable("cancel", &fired),
        Err(Error::Cancelled)
    ));
    let during = Cancel::new();
    let waiters: Vec<_> = (0..3)
        .map(|_| {
            let (c, t) = (c.clone(), during.clone());
            thread::spawn(move || c.lock_cancellable("cancel", &t).map(drop))
        })
        .collect();
    thread::sleep(ms(100));
    during.cancel();
    during.cancel();
    for r in join_within(waiters, secs(5), "cancelled waiters") {
        assert!(matches!(r, Err(Error::Cancelled)), "{r:?}");
    }
    assert!(matches!(
        c.lock_cancellable("cancel", &during),
        Err(Error::Cancelled)
    ));
    drop(release);
    holder.join().unwrap();
    c.try_lock_for("cancel", secs(5)).unwrap().unlock().unwrap();
}

/// `shutdown` while one thread holds and others queue behind it locally: the holder is
/// told its lock is lost, and every waiter ends (an error, or a guard already lost) once
/// the holder lets go: none is left blocked.
#[test]
fn shutdown_while_threads_hold_and_queue_leaves_none_blocked() {
    let srv = test_server();
    let c = client(&srv);
    let (release, holder) = hold_elsewhere(&c, "down");
    let waiters: Vec<_> = (0..4)
        .map(|_| {
            let c = c.clone();
            thread::spawn(move || match c.lock("down") {
                Ok(g) => g.check(),
                Err(e) => Err(e),
            })
        })
        .collect();
    thread::sleep(ms(100));
    shut_down_then(&c, waiters, || {
        drop(release);
        holder.join().unwrap();
    });
}

/// Hundreds of threads of one process queued on one name: every one gets it in turn, none
/// overlaps another, none is left waiting.
#[test]
fn hundreds_of_local_waiters_all_get_the_lock() {
    let srv = test_server();
    let c = client(&srv);
    let inside = Arc::new(AtomicU64::new(0));
    let done = Arc::new(AtomicU64::new(0));
    let threads: Vec<_> = (0..300)
        .map(|_| {
            let (c, inside, done) = (c.clone(), inside.clone(), done.clone());
            thread::spawn(move || {
                let g = c.lock("many").unwrap();
                assert_eq!(inside.fetch_add(1, SeqCst), 0, "two holders at once");
                inside.fetch_sub(1, SeqCst);
                done.fetch_add(1, SeqCst);
                drop(g);
            })
        })
        .collect();
    join_within(threads, secs(20), "300 local waiters");
    assert_eq!(done.load(SeqCst), 300);
}

/// A guard whose key was deleted under it: once the watchdog knows, `extend` and `check`
/// say it is lost, `unlock` says it was not held, and a waiter of this process is not
/// handed the dead lock but wins it in Redis.
#[test]
fn a_lost_guard_is_not_extended_nor_handed_on() {
    let srv = test_server();
    let c = short_lease(&srv, ms(600)).build().unwrap();
    let g = c.lock("lost").unwrap();
    let waiter = token_elsewhere(&c, "lost");
    thread::sleep(ms(50));
    let _: () = redis::cmd("DEL")
        .arg("lf:{lost}")
        .query(&mut srv.conn())
        .unwrap();
    wait_for(secs(5), "the loss noticed", || g.is_lost());
    assert!(matches!(g.extend(secs(1)), Err(Error::Lost(_))));
    let first = g.fencing_token();
    assert!(!g.unlock().unwrap().was_held());
    let next = join_within(vec![waiter], secs(10), "waiter")
        .pop()
        .unwrap()
        .unwrap();
    assert!(next > first);
}

/// Local waiters get the lock in the order they queued (FIFO), each handed it by the
/// previous holder of this process.
#[test]
fn local_waiters_are_served_in_the_order_they_queued() {
    let srv = test_server();
    let c = client(&srv);
    let (release, holder) = hold_elsewhere(&c, "fifo");
    let order = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut waiters = Vec::new();
    for i in 0..20u64 {
        let (c, order) = (c.clone(), order.clone());
        waiters.push(thread::spawn(move || {
            let g = c.lock("fifo").unwrap();
            order.lock().unwrap().push((
                i,
                fence_of(g.fencing_token()),
                handoff_of(g.fencing_token()),
            ));
        }));
        // Long enough for the thread to queue before the next one starts.
        thread::sleep(ms(20));
    }
    drop(release);
    holder.join().unwrap();
    join_within(waiters, secs(10), "queued waiters");
    let order = order.lock().unwrap().clone();
    let ids: Vec<u64> = order.iter().map(|(i, _, _)| *i).collect();
    assert_eq!(ids, (0..20).collect::<Vec<_>>(), "{order:?}");
    assert!(
        order.iter().all(|(_, f, _)| *f == order[0].1),
        "one acquisition in Redis: {order:?}"
    );
}

/// A token's wakers go with the waits that registered them: a token used for many waits
/// (won, cancelled) keeps none, and cancelling after a win leaves the guard held.
#[test]
fn a_reused_cancel_token_keeps_no_waiters_and_takes_no_hold() {
    let srv = test_server();
    let c = client(&srv);
    let token = Cancel::new();
    for _ in 0..3 {
        c.lock_cancellable("reuse", &token)
            .unwrap()
            .unlock()
            .unwrap();
    }
    let (release, holder) = hold_elsewhere(&c, "reuse");
    assert!(matches!(
        c.try_lock_for("reuse", ms(50)),
        Err(Error::Timeout)
    ));
    let g = {
        drop(release);
        holder.join().unwrap();
        c.lock_cancellable("reuse", &token).unwrap()
    };
    token.cancel();
    g.check().unwrap();
    assert!(format!("{token:?}").contains("waiting: 0"), "{token:?}");
    assert!(g.unlock().unwrap().was_held());
}

/// A holder of this process that keeps the lock past `max_hold`: the waiter queued behind
/// it is not handed the capped hold, but takes the lock anew in Redis once it is let go.
#[test]
fn a_hold_past_its_cap_is_not_handed_on() {
    let srv = test_server();
    let c = short_lease(&srv, secs(1))
        .max_hold(ms(300))
        .build()
        .unwrap();
    let g = c.lock("cap").unwrap();
    let waiter = token_elsewhere(&c, "cap");
    wait_for(secs(5), "the cap reached", || g.is_lost());
    let first = g.fencing_token();
    drop(g);
    let next = join_within(vec![waiter], secs(10), "waiter")
        .pop()
        .unwrap()
        .unwrap();
    assert!(
        fence_of(next) > fence_of(first),
        "{next:#x} after {first:#x}"
    );
}

/// `shutdown` while this client's threads wait for a lock another client holds (one in
/// Redis, the others queued behind it here): the subscriber that would wake them is gone,
/// yet each ends once the other client lets go, with a typed outcome.
#[test]
fn shutdown_while_waiting_on_another_client_leaves_none_blocked() {
    let srv = test_server();
    let c = client(&srv);
    let other = lock_client!(
        node(srv.url()),
        key_prefix("lf:"),
        io_timeouts(ms(500)),
        lease(secs(2))
    );
    let held = other.lock("remote").unwrap();
    let waiters: Vec<_> = (0..3)
        .map(|_| {
            let c = c.clone();
            thread::spawn(move || c.lock("remote").and_then(|g| g.check()))
        })
        .collect();
    thread::sleep(ms(200));
    shut_down_then(&c, waiters, || {
        held.unlock().unwrap();
    });
}

/// Without the local handoff every thread contends in Redis: a thread that wins the lock
/// after the key of another local holder was deleted is the holder now, and the old
/// holder's release must not take the entry away from it: the new holder is still refused
/// a second lock of the name (`WouldDeadlock`, not a wait for itself) and its release does
/// not panic.
#[test]
fn a_holder_whose_key_was_deleted_does_not_unseat_the_next_one() {
    let srv = test_server();
    let c = lock_client!(
        node(srv.url()),
        key_prefix("lf:"),
        io_timeouts(secs(1)),
        local_handoff(false)
    );
    let (release, old) = hold_elsewhere(&c, "unseat");
    let _: () = redis::cmd("DEL")
        .arg("lf:{unseat}")
        .query(&mut srv.conn())
        .unwrap();
    let g = c.try_lock_for("unseat", secs(5)).unwrap();
    drop(release);
    old.join().unwrap();
    let again = c.try_lock("unseat");
    assert!(matches!(again, Err(Error::WouldDeadlock)), "{again:?}");
    let released = catch_unwind(AssertUnwindSafe(|| g.unlock()));
    assert!(
        matches!(released, Ok(Ok(u)) if u.was_held()),
        "{released:?}"
    );
    c.try_lock("unseat").unwrap().unlock().unwrap();
}
