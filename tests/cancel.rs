//! Cancellable waits against a real `redis-server`: a cancel from another thread ends a
//! wait in Redis (the contest) and a wait behind a local holder (the local queue, the
//! read-write turns, the permit contenders) with `Error::Cancelled`, leaves no queue entry
//! or mark behind, and never loses a hold that won the race. The time from `cancel()` to
//! the call's return is printed, not asserted.

use std::sync::Barrier;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use redbaton::{Cancel, Error, LockClient, LockGuard, LockInfo, Unlocked};
use redbaton_testkit::server::RedisServer;
use redbaton_testkit::wait::wait_for;
use redbaton_testkit::{lock_client, ms, secs, test_server, test_server_and};

/// Generous bound for a cancelled call to return: liveness, not a latency assertion.
const LIVENESS: Duration = Duration::from_secs(5);

fn client(url: &str) -> LockClient {
    lock_client!(node(url), lease(secs(30)))
}

/// A server and two clients of it.
fn two_clients() -> (RedisServer, LockClient, LockClient) {
    let srv = test_server();
    let (a, b) = (client(&srv.url()), client(&srv.url()));
    (srv, a, b)
}

/// `c`'s lock of `name`, and the keys there are while it is held: what a cancelled wait for
/// it leaves as it found.
fn lock_and_list(srv: &RedisServer, c: &LockClient, name: &str) -> (LockGuard, Vec<String>) {
    let held = c.lock(name).expect("lock");
    (held, keys_left(srv))
}

fn info(c: &LockClient, name: &str) -> LockInfo {
    c.inspect(name).expect("inspect")
}

/// Every key under the default prefix but the fence counters.
fn keys_left(srv: &RedisServer) -> Vec<String> {
    srv.keys_but_fences("redbaton:*")
}

/// Nothing of a waiter is left: no fair-queue entry, no contention or waiting marks, and
/// no key but those there before it waited.
fn assert_nothing_left(c: &LockClient, srv: &RedisServer, name: &str, before: &[String]) {
    let i = info(c, name);
    assert!(i.queue.is_empty(), "queue entries left: {:?}", i.queue);
    assert!(i.contention.is_none(), "contention mark left");
    assert!(i.waiting_writers.is_empty(), "writer marks left");
    assert!(i.waiting_readers.is_empty(), "reader marks left");
    assert_eq!(keys_left(srv), before, "keys changed by the cancelled wait");
}

/// Runs `wait` on another thread, waits for `waiting` (or a short pause when `None`),
/// cancels, and returns the call's result and the time from `cancel()` to its return.
fn cancel_during(
    cancel: &Cancel,
    wait: impl FnOnce() -> redbaton::Result<()> + Send,
    waiting: Option<&dyn Fn() -> bool>,
) -> (redbaton::Result<()>, Duration) {
    thread::scope(|s| {
        let waiter = s.spawn(move || {
            let r = wait();
            (r, Instant::now())
        });
        match waiting {
            Some(cond) => wait_for(LIVENESS, "the waiter waits", || {
                cond() || waiter.is_finished()
            }),
            None => thread::sleep(ms(100)),
        }
        assert!(!waiter.is_finished(), "the call did not wait");
        let at = Instant::now();
        cancel.cancel();
        let (r, returned) = join(waiter, "cancelled waiter");
        (r, returned.saturating_duration_since(at))
    })
}

/// Cancels `c`'s wait for the lock `name`, held by `holder` (another client), once the
/// wait is in the fair queue: its result, and the time from `cancel()` to its return.
fn cancel_remote_lock_wait(
    holder: &LockClient,
    c: &LockClient,
    name: &str,
    cancel: &Cancel,
) -> (redbaton::Result<()>, Duration) {
    let queued = || info(holder, name).queue.len() == 1;
    cancel_during(
        cancel,
        || c.lock_cancellable(name, cancel).map(drop),
        Some(&queued),
    )
}

/// Joins a scoped thread, which must end within [`LIVENESS`].
fn join<T>(h: thread::ScopedJoinHandle<'_, T>, what: &str) -> T {
    wait_for(LIVENESS, what, || h.is_finished());
    h.join().expect(what)
}

fn assert_cancelled<T>(r: redbaton::Result<T>) {
    match r {
        Err(e) => assert!(e.is_cancelled(), "expected Cancelled, got {e:?}"),
        Ok(_) => panic!("expected Cancelled, got the hold"),
    }
}

#[test]
fn smoke() {
    let (_srv, c) = test_server_and(client);
    let cancel = Cancel::new();
    assert!(!cancel.is_cancelled());
    let g = c.lock_cancellable("smoke", &cancel).expect("free lock");
    assert!(g.fencing_token() > 0);
    g.unlock().expect("unlock");
    cancel.cancel();
    assert!(cancel.is_cancelled());
    let e = Error::Cancelled;
    assert!(e.is_cancelled() && !e.is_timeout());
    assert_eq!(e.to_string(), "wait cancelled");
}

#[test]
fn the_token_is_clone_send_sync_and_clones_share_the_flag() {
    fn shareable<T: Clone + Send + Sync + Default + std::fmt::Debug>() {}
    shareable::<Cancel>();
    let a = Cancel::default();
    let b = a.clone();
    b.cancel();
    assert!(a.is_cancelled());
    assert!(format!("{a:?}").contains("cancelled: true"));
}

#[test]
fn a_remote_wait_is_cancelled_and_leaves_no_queue_entry() {
    let (srv, holder, waiter) = two_clients();
    let (held, before) = lock_and_list(&srv, &holder, "k");
    let cancel = Cancel::new();
    let (r, took) = cancel_remote_lock_wait(&holder, &waiter, "k", &cancel);
    assert_cancelled(r);
    eprintln!("remote lock wait: cancel to return {took:?}");
    assert_nothing_left(&holder, &srv, "k", &before);
    // The holder still holds it; after its release the lock is free for anyone.
    held.check().expect("the holder keeps the lock");
    held.unlock().expect("unlock");
    assert!(keys_left(&srv).is_empty(), "{:?}", keys_left(&srv));
    drop(holder.try_lock("k").expect("free after the release"));
}

#[test]
fn a_wait_behind_a_local_holder_is_cancelled_and_leaves_the_local_queue() {
    let (srv, c, other) = two_clients();
    let (held, before) = lock_and_list(&srv, &c, "k");
    let cancel = Cancel::new();
    let (r, took) = cancel_during(&cancel, || c.lock_cancellable("k", &cancel).map(drop), None);
    assert_cancelled(r);
    eprintln!("local lock wait: cancel to return {took:?}");
    assert_nothing_left(&c, &srv, "k", &before);
    // Released in Redis, not handed to the waiter that left: another process gets it.
    assert_eq!(held.unlock().expect("unlock"), Unlocked::Released);
    drop(other.try_lock("k").expect("nobody kept the lock"));
}

#[test]
fn a_remote_read_wait_is_cancelled() {
    let (srv, writer, reader) = two_clients();
    let w = writer.rwlock("rw").write().expect("write");
    let before = keys_left(&srv);
    let cancel = Cancel::new();
    let rw = reader.rwlock("rw");
    let (r, took) = cancel_during(&cancel, || rw.read_cancellable(&cancel).map(drop), None);
    assert_cancelled(r);
    eprintln!("remote read wait: cancel to return {took:?}");
    assert_nothing_left(&writer, &srv, "rw", &before);
    w.unlock().expect("unlock");
    drop(
        reader
            .rwlock("rw")
            .try_read()
            .expect("read after the write"),
    );
}

#[test]
fn a_remote_write_wait_is_cancelled_and_its_mark_does_not_hold_readers_back() {
    let srv = test_server();
    let (reader, writer, late) = (client(&srv.url()), client(&srv.url()), client(&srv.url()));
    let r = reader.rwlock("rw").read().expect("read");
    let before = keys_left(&srv);
    let cancel = Cancel::new();
    let rw = writer.rwlock("rw");
    let marked = || !info(&reader, "rw").waiting_writers.is_empty();
    let (w, took) = cancel_during(
        &cancel,
        || rw.write_cancellable(&cancel).map(drop),
        Some(&marked),
    );
    assert_cancelled(w);
    eprintln!("remote write wait: cancel to return {took:?}");
    assert_nothing_left(&reader, &srv, "rw", &before);
    // No writer waits any more: a new reader of another process reads at once.
    drop(late.rwlock("rw").try_read().expect("no writer mark left"));
    r.unlock().expect("unlock");
}

#[test]
fn local_read_and_write_turn_waits_are_cancelled() {
    let (srv, c) = test_server_and(client);
    let rw = c.rwlock("rw");
    for writer_waits in [true, false] {
        // A local writer waits for the local readers' turn to end; a local reader, for the
        // local writer's.
        let held: Box<dyn std::any::Any> = if writer_waits {
            Box::new(rw.read().expect("read"))
        } else {
            Box::new(rw.write().expect("write"))
        };
        let before = keys_left(&srv);
        let cancel = Cancel::new();
        let wait = || match writer_waits {
            true => rw.write_cancellable(&cancel).map(drop),
            false => rw.read_cancellable(&cancel).map(drop),
        };
        let (r, took) = cancel_during(&cancel, wait, None);
        assert_cancelled(r);
        let what = if writer_waits { "write" } else { "read" };
        eprintln!("local {what} turn: cancel to return {took:?}");
        assert_nothing_left(&c, &srv, "rw", &before);
        drop(held);
    }
    drop(rw.try_write().expect("free"));
}

#[test]
fn permit_waits_are_cancelled_in_redis_and_behind_the_local_contender() {
    let (srv, holder, c) = two_clients();
    let only = holder.semaphore("sem", 1).acquire().expect("permit");
    let before = keys_left(&srv);
    let sem = c.semaphore("sem", 1);
    let (in_redis, behind) = (Cancel::new(), Cancel::new());
    thread::scope(|s| {
        // One thread contends in Redis for the process...
        let first = s.spawn(|| sem.acquire_cancellable(&in_redis).map(drop));
        thread::sleep(ms(100));
        // ...the next waits behind it, locally.
        let (r, took) = cancel_during(&behind, || sem.acquire_cancellable(&behind).map(drop), None);
        assert_cancelled(r);
        eprintln!("local permit wait: cancel to return {took:?}");
        assert!(!first.is_finished(), "the other waiter waits on");
        let at = Instant::now();
        in_redis.cancel();
        assert_cancelled(join(first, "permit waiter"));
        eprintln!("remote permit wait: cancel to return {:?}", at.elapsed());
    });
    assert_nothing_left(&holder, &srv, "sem", &before);
    only.unlock().expect("unlock");
    drop(
        c.semaphore("sem", 1)
            .try_acquire()
            .expect("the permit is free"),
    );
}

#[test]
fn a_cancel_before_the_call_returns_at_once_without_a_command() {
    let (_srv, holder, c) = two_clients();
    let _held = holder.lock("k").expect("lock");
    let cancel = Cancel::new();
    cancel.cancel();
    let before = c.stats().commands;
    assert_cancelled(c.lock_cancellable("k", &cancel));
    assert_cancelled(c.lock_cancellable("free", &cancel));
    assert_cancelled(c.rwlock("rw").read_cancellable(&cancel));
    assert_cancelled(c.rwlock("rw").write_cancellable(&cancel));
    assert_cancelled(c.semaphore("sem", 2).acquire_cancellable(&cancel));
    assert_eq!(c.stats().commands, before, "no command sent");
    assert!(info(&holder, "k").queue.is_empty());
}

#[test]
fn cancelling_twice_is_harmless() {
    let (_srv, holder, c) = two_clients();
    let held = holder.lock("k").expect("lock");
    let cancel = Cancel::new();
    let (r, _) = cancel_remote_lock_wait(&holder, &c, "k", &cancel);
    assert_cancelled(r);
    cancel.cancel();
    assert!(cancel.is_cancelled());
    assert_cancelled(c.lock_cancellable("k", &cancel));
    drop(held);
    // A fresh token waits again, and gets the lock.
    drop(c.lock_cancellable("k", &Cancel::new()).expect("lock"));
}

/// A cancel racing the release that lets the waiter in: either the waiter returns the
/// guard (the acquisition won; the hold is valid) or `Cancelled`, and then nobody holds
/// the lock: it is never taken for a waiter that has gone.
#[test]
fn a_cancel_racing_an_acquisition_never_loses_the_lock() {
    let (_srv, holder, c) = two_clients();
    let (mut won, mut cancelled) = (0, 0);
    for i in 0..100u32 {
        let held = holder.lock("race").expect("lock");
        let cancel = Cancel::new();
        let go = Barrier::new(2);
        let waiting = AtomicBool::new(false);
        let outcome = thread::scope(|s| {
            let waiter = s.spawn(|| {
                waiting.store(true, Ordering::SeqCst);
                c.lock_cancellable("race", &cancel)
                    .map(|g| (g.check().is_ok(), g.unlock().map(|u| u.was_held())))
            });
            wait_for(LIVENESS, "the waiter starts", || {
                waiting.load(Ordering::SeqCst)
            });
            // Some rounds cancel while it is queued, others while it may still be starting;
            // some cancel a little after the release, when the acquisition may win.
            if i % 2 == 0 {
                wait_for(LIVENESS, "queued", || {
                    info(&holder, "race").queue.len() == 1 || waiter.is_finished()
                });
            }
            let canceller = s.spawn(|| {
                go.wait();
                if i % 3 == 0 {
                    thread::sleep(ms(1));
                }
                cancel.cancel();
            });
            go.wait();
            held.unlock().expect("unlock");
            canceller.join().expect("canceller");
            join(waiter, "racing waiter")
        });
        match outcome {
            Ok((valid, unlocked)) => {
                assert!(valid, "round {i}: a returned guard holds the lock");
                assert!(unlocked.expect("unlock"), "round {i}: it was held");
                won += 1;
            }
            Err(e) => {
                assert!(e.is_cancelled(), "round {i}: {e:?}");
                cancelled += 1;
            }
        }
        // Either way the lock is free now, and nothing of the waiter is left.
        let i_ = info(&holder, "race");
        assert!(i_.holder.is_none(), "round {i}: held by {:?}", i_.holder);
        assert!(i_.queue.is_empty(), "round {i}: queue {:?}", i_.queue);
    }
    eprintln!("racing cancels: {won} acquisitions won, {cancelled} cancelled");
}

/// Prints the time from `cancel()` to the call's return over 50 cancels of a remote wait
/// (p50, p99). Not asserted: the machine may be busy.
#[test]
fn cancel_latency() {
    let (srv, holder, c) = two_clients();
    let (_held, before) = lock_and_list(&srv, &holder, "lat");
    let mut took = Vec::new();
    for _ in 0..50 {
        let cancel = Cancel::new();
        let (r, t) = cancel_remote_lock_wait(&holder, &c, "lat", &cancel);
        assert_cancelled(r);
        took.push(t);
    }
    assert_nothing_left(&holder, &srv, "lat", &before);
    took.sort();
    let at = |p: usize| took[(took.len() * p / 100).min(took.len() - 1)];
    eprintln!(
        "cancel to return over {} remote waits: p50 {:?}, p99 {:?}, max {:?}",
        took.len(),
        at(50),
        at(99),
        took[took.len() - 1]
    );
}

#[test]
fn a_registered_wait_leaves_the_token_when_it_ends() {
    let (_srv, holder, c) = two_clients();
    let cancel = Cancel::new();
    // Waits that end by acquiring, many times over: the token keeps no waker of theirs.
    let held = holder.lock("k").expect("lock");
    thread::scope(|s| {
        let waiter = s.spawn(|| c.lock_cancellable("k", &cancel).map(drop));
        wait_for(LIVENESS, "queued", || info(&holder, "k").queue.len() == 1);
        assert!(format!("{cancel:?}").contains("waiting: 1"), "{cancel:?}");
        drop(held);
        join(waiter, "waiter").expect("the lock");
    });
    assert!(format!("{cancel:?}").contains("waiting: 0"), "{cancel:?}");
}

/// A queued waiter that became the process's contender (the holder detached its guard,
/// which promotes the head of the local queue) and is cancelled while it waits in Redis
/// passes the duty to contend on: the next local waiter gets the lock as soon as the
/// detached guard releases it, with a token above the detached one's.
#[test]
fn a_cancelled_contender_passes_the_duty_on() {
    let (_srv, c, _) = two_clients();
    let held = c.lock("k").expect("lock");
    let first = held.fencing_token();
    let cancel = Cancel::new();
    thread::scope(|s| {
        let contender = s.spawn(|| c.lock_cancellable("k", &cancel).map(drop));
        thread::sleep(ms(200));
        let next = s.spawn(|| c.try_lock_for("k", secs(10)).map(|g| g.fencing_token()));
        thread::sleep(ms(200));
        // The first waiter is promoted and contends in Redis behind the detached hold; the
        // second stays queued.
        let detached = held.detach();
        thread::sleep(ms(300));
        cancel.cancel();
        assert_cancelled(join(contender, "contender"));
        thread::sleep(ms(200));
        assert!(detached.unlock().unwrap().was_held());
        let started = Instant::now();
        let token = join(next, "next waiter").expect("the next waiter contends and gets the lock");
        eprintln!(
            "the next waiter got the lock {:?} after the release",
            started.elapsed()
        );
        assert!(token > first, "{token:#x} after {first:#x}");
        assert!(started.elapsed() < LIVENESS);
    });
    drop(c.try_lock("k").expect("free again"));
}

/// A wait cancelled while its attempt's read waits on a stalled server (such a read ends
/// only at its timeout) ends with `Cancelled`, as a wait whose deadline passed meanwhile
/// ends with `Timeout`: not with the read's error.
#[test]
fn a_wait_cancelled_during_a_stalled_attempt_says_cancelled() {
    let srv = test_server();
    let holder = client(&srv.url());
    let polling = lock_client!(
        node(srv.url()),
        io_timeouts(secs(1)),
        wakeup(redbaton::Wakeup::Polling(ms(100)))
    );
    let _held = holder.lock("stalled").expect("lock");
    let cancel = Cancel::new();
    thread::scope(|s| {
        let waiter = s.spawn(|| polling.lock_cancellable("stalled", &cancel).map(drop));
        thread::sleep(ms(300));
        srv.pause();
        // An attempt comes within 100 ms, and its read waits for the stalled server.
        thread::sleep(ms(400));
        cancel.cancel();
        let out = join(waiter, "the cancelled wait");
        srv.resume();
        assert_cancelled(out);
    });
}
