//! Guards, cancellation and the client's life at their edges: a cancel that races a local
//! handoff, one token shared by many waits, guards dropped while a thread unwinds (also
//! when their release panics), a stale guard beside its thread's new hold of the name,
//! guards kept past `shutdown`, and the client's threads ending whatever the order in
//! which the client and its guards go. Only the client's own behaviour is tested here.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Barrier, Mutex};
use std::thread;
use std::time::Duration;

use redbaton::{Cancel, Error, LockClient, LostReason};
use redbaton_testkit::proxy::Proxy;
use redbaton_testkit::server::RedisServer;
use redbaton_testkit::wait::{wait_for, wait_until};
use redbaton_testkit::{lock_client, ms, secs, test_server};

/// Generous bound for what must end: liveness, not speed.
const LIVENESS: Duration = Duration::from_secs(5);

/// The tests count the process's `redbaton-*` threads: one test at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// The names of the library's threads in this process now (a name is cut to 15 bytes).
fn threads() -> Vec<String> {
    let tasks = std::fs::read_dir("/proc/self/task").expect("/proc/self/task");
    let mut names: Vec<String> = tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("comm")).ok())
        .map(|n| n.trim().to_owned())
        .filter(|n| n.starts_with("redbaton"))
        .collect();
    names.sort();
    names
}

/// Fails unless the library's threads are back to `before` within a few seconds.
fn threads_end(before: &[String], when: &str) {
    let ended = wait_until(LIVENESS, || threads().len() <= before.len());
    assert!(
        ended,
        "{when}: threads left {:?}, before {before:?}",
        threads()
    );
}

fn client(url: &str) -> LockClient {
    client_of(&[url.to_owned()])
}

/// A client of the nodes `urls` (more than one: Redlock), renewing often: its renewal
/// threads come and go all the time.
fn client_of(urls: &[String]) -> LockClient {
    lock_client!(
        nodes(urls.iter().cloned()),
        key_prefix("ge:"),
        io_timeouts(secs(1)),
        renew_interval(ms(50))
    )
}

/// A client of `urls` whose subscriber threads run (a waiter waited once), with the
/// library's threads before it was built.
fn warm_client(urls: &[String]) -> (Vec<String>, LockClient) {
    let before = threads();
    let c = client_of(urls);
    let held = client_of(urls).lock("warm").expect("lock");
    assert!(c.try_lock_for("warm", ms(50)).is_err());
    drop(held);
    (before, c)
}

/// What most tests start with: the lock that runs them one at a time, a server of their
/// own and a client of it.
fn begin() -> (std::sync::MutexGuard<'static, ()>, RedisServer, LockClient) {
    let serial = serial();
    let srv = test_server();
    let c = client(&srv.url());
    (serial, srv, c)
}

/// Whether `name` is free in Redis now: another client takes it at once.
fn free(srv: &RedisServer, name: &str) -> bool {
    client(&srv.url()).try_lock(name).is_ok()
}

#[test]
fn smoke() {
    let _s = serial();
    let srv = test_server();
    let (before, c) = warm_client(&[srv.url()]);
    assert_eq!(c.with_lock("smoke", || 7).expect("with_lock"), 7);
    drop(c);
    threads_end(&before, "client dropped");
}

/// A cancel racing the local handoff to a waiter queued behind a holder of the same
/// client: the waiter either returns a valid guard or `Cancelled`, and then the lock is
/// not left held by nobody: another thread takes it at once.
#[test]
fn a_cancel_racing_a_local_handoff_never_strands_the_lock() {
    let (_s, _srv, c) = begin();
    let (mut won, mut cancelled) = (0, 0);
    for i in 0..60u32 {
        let cancel = Cancel::new();
        let go = Barrier::new(2);
        let outcome = thread::scope(|s| {
            let held = c.lock("race").expect("lock");
            let waiter = s.spawn(|| {
                let g = c.lock_cancellable("race", &cancel)?;
                g.check().expect("a returned guard holds the lock");
                g.unlock()
            });
            wait_for(LIVENESS, "queued", || {
                format!("{cancel:?}").contains("waiting: 1") || waiter.is_finished()
            });
            let canceller = s.spawn(|| {
                go.wait();
                if i % 3 == 1 {
                    thread::yield_now();
                }
                cancel.cancel();
            });
            go.wait();
            drop(held);
            canceller.join().expect("canceller");
            waiter.join().expect("waiter")
        });
        match outcome {
            Err(e) if e.is_cancelled() => cancelled += 1,
            unlocked => {
                let held = unlocked.is_ok_and(|u| u.was_held());
                assert!(held, "round {i}: the guard won was released");
                won += 1;
            }
        }
        let g = c.try_lock("race");
        assert!(g.is_ok(), "round {i}: the lock is stranded: {g:?}");
    }
    eprintln!("racing cancels of a handoff: {won} won, {cancelled} cancelled");
}

/// One token given to many waits (behind a local holder, and in Redis behind another
/// client): one cancel ends them all, leaves the token with no wait registered, and the
/// holder's lock as it was.
#[test]
fn one_token_ends_many_waits() {
    let _s = serial();
    let srv = test_server();
    let (c, other) = (client(&srv.url()), client(&srv.url()));
    let cancel = Cancel::new();
    let local = c.lock("local").expect("lock");
    let remote = other.lock("remote").expect("lock");
    thread::scope(|s| {
        let waits: Vec<_> = (0..6)
            .map(|i| {
                let (c, cancel) = (&c, &cancel);
                s.spawn(move || {
                    let name = if i % 2 == 0 { "local" } else { "remote" };
                    c.lock_cancellable(name, cancel).map(drop)
                })
            })
            .collect();
        wait_for(LIVENESS, "every wait registered", || {
            format!("{cancel:?}").contains("waiting: 6")
        });
        cancel.cancel();
        for w in waits {
            let r = w.join().expect("wait");
            assert!(matches!(r, Err(Error::Cancelled)), "{r:?}");
        }
    });
    assert!(format!("{cancel:?}").contains("waiting: 0"), "{cancel:?}");
    local.check().expect("the local holder keeps its lock");
    remote.check().expect("the remote holder keeps its lock");
    assert!(c.inspect("local").expect("inspect").queue.is_empty());
    assert!(c.inspect("remote").expect("inspect").queue.is_empty());
    assert!(local.unlock().expect("unlock").was_held());
    assert!(remote.unlock().expect("unlock").was_held());
    assert!(free(&srv, "local") && free(&srv, "remote"));
}

/// Guards dropped while their thread unwinds from a panic: the drop neither panics nor
/// aborts, and the locks are released in Redis at once. Through a server that stopped
/// answering, the drop fails within the I/O timeouts, still without a panic.
#[test]
fn guards_dropped_while_unwinding_release() {
    let (_s, srv, c) = begin();
    let unwound = catch_unwind(AssertUnwindSafe(|| {
        let _g = c.lock("unwind").expect("lock");
        let _d = c.lock("unwind-d").expect("lock").detach();
        let _m = c.multi_lock(["unwind-m1", "unwind-m2"]).expect("lock");
        panic!("the critical section fails");
    }));
    assert!(unwound.is_err());
    for name in ["unwind", "unwind-d", "unwind-m1", "unwind-m2"] {
        assert!(free(&srv, name), "{name} still held after the unwind");
    }
    let proxy = Proxy::start(srv.addr());
    let through = client(&proxy.url());
    let unwound = thread::scope(|s| {
        s.spawn(|| {
            let _g = through.lock("stalled").expect("lock");
            let _d = through.lock("stalled-d").expect("lock").detach();
            proxy.blackhole(true);
            panic!("the critical section fails");
        })
        .join()
    });
    proxy.heal();
    assert!(unwound.is_err(), "the thread unwound (and did not abort)");
}

/// Guards kept past `shutdown`: `check` and `extend` say the lock is lost (nothing renews
/// it), nothing hangs, and `unlock`, here and from another thread for a detached guard,
/// still releases it in Redis. A wait under way ends when its token is cancelled.
#[test]
fn guards_kept_past_shutdown() {
    let _s = serial();
    let srv = test_server();
    let (before, c) = warm_client(&[srv.url()]);
    let g = c.lock("kept").expect("lock");
    let d = c.lock("kept-d").expect("lock").detach();
    let other = client(&srv.url());
    let foreign = other.lock("busy").expect("lock");
    let cancel = Cancel::new();
    let waiting = {
        let (c, cancel) = (c.clone(), cancel.clone());
        thread::spawn(move || c.lock_cancellable("busy", &cancel).map(drop))
    };
    wait_for(LIVENESS, "waiting", || {
        format!("{cancel:?}").contains("waiting: 1")
    });
    c.clone().shutdown(LIVENESS).expect("shutdown in time");
    c.clone().shutdown(LIVENESS).expect("a second shutdown");
    let watchdog_failed = |r: redbaton::Result<()>| {
        assert!(
            matches!(r, Err(Error::Lost(LostReason::WatchdogFailed))),
            "{r:?}"
        );
    };
    watchdog_failed(g.check());
    watchdog_failed(g.extend(secs(10)));
    let moved = thread::spawn(move || {
        let checked = d.check();
        let extended = d.extend(secs(10));
        (checked, extended, d.unlock())
    });
    let (checked, extended, unlocked) = moved.join().expect("detached guard's thread");
    watchdog_failed(checked);
    watchdog_failed(extended);
    assert!(unlocked.expect("unlock").was_held());
    assert!(g.unlock().expect("unlock").was_held());
    assert!(free(&srv, "kept") && free(&srv, "kept-d"));
    cancel.cancel();
    let r = waiting.join().expect("waiter");
    assert!(matches!(r, Err(Error::Cancelled)), "{r:?}");
    let e = c.try_lock("kept").expect_err("no hold after shutdown");
    assert!(e.is_shut_down(), "{e:?}");
    drop((foreign, other, c));
    threads_end(&before, "after shutdown and the last guard");
}

/// The client's threads (subscriber, watchdog, cleanup) end once the client and its
/// guards are gone, in every order: the guard first, the client first, a detached guard
/// dropped last on another thread, and after `shutdown` a detached guard dropped later;
/// on one node, and for Redlock (whose fan-out threads end too).
#[test]
fn threads_end_in_every_order() {
    let _s = serial();
    let servers: Vec<RedisServer> = (0..3).map(|_| test_server()).collect();
    let urls: Vec<String> = servers.iter().map(|s| s.url()).collect();
    type Order = fn(LockClient);
    let orders: [(&str, Order); 4] = [
        ("guard first", |c| {
            let g = c.lock("o").expect("lock");
            drop(g);
            drop(c);
        }),
        ("client first", |c| {
            let g = c.lock("o").expect("lock");
            drop(c);
            drop(g);
        }),
        ("detached last, elsewhere", |c| {
            let g = c.lock("o").expect("lock");
            let d = c.lock("o-d").expect("lock").detach();
            let (tx, rx) = std::sync::mpsc::channel::<()>();
            let t = thread::spawn(move || {
                let _ = rx.recv();
                drop(d);
            });
            drop(c);
            drop(g);
            drop(tx);
            t.join().expect("detached guard's thread");
        }),
        ("shut down, detached later", |c| {
            let d = c.lock("o-d").expect("lock").detach();
            c.shutdown(LIVENESS).expect("shutdown in time");
            thread::spawn(move || drop(d)).join().expect("drop");
        }),
    ];
    for (what, order) in orders {
        for urls in [&urls[..1], &urls[..]] {
            let (before, c) = warm_client(urls);
            order(c);
            let what = format!("{what}, {} nodes", urls.len());
            threads_end(&before, &what);
            let free = |name| client_of(urls).try_lock(name).is_ok();
            assert!(free("o") && free("o-d"), "{what}: a lock is left");
        }
    }
}

/// Without the local handoff, a thread whose lock was deleted under it is unseated by
/// another thread that wins the key in Redis; once that one is done, the first thread
/// takes the key again while its stale guard still lives. Dropping (or detaching) the stale
/// guard must leave the new hold as it is: its guard releases it (no panic), and this
/// thread asking again for the lock it holds is refused rather than left to wait for
/// itself. Let go after the new hold, the stale guard releases (or detaches) without a
/// panic, and says it held nothing.
#[test]
fn a_stale_guard_leaves_the_new_hold_of_its_thread_alone() {
    let _s = serial();
    let srv = test_server();
    let c = lock_client!(
        node(srv.url()),
        key_prefix("ge:"),
        local_handoff(false),
        lease(secs(2)),
        renew_interval(ms(100))
    );
    for (detach, stale_first) in [(false, true), (true, true), (false, false), (true, false)] {
        let stale = c.lock("unseat").expect("lock");
        let _: () = redis::cmd("DEL")
            .arg("ge:{unseat}")
            .query(&mut srv.conn())
            .expect("DEL");
        wait_for(LIVENESS, "the loss is noticed", || stale.is_lost());
        thread::scope(|s| {
            s.spawn(|| c.lock("unseat").expect("another thread wins").unlock())
                .join()
                .expect("other thread")
                .expect("unlock");
        });
        let held = c.lock("unseat").expect("the first thread again");
        if !stale_first {
            assert!(held.unlock().expect("unlock").was_held());
            let let_go = catch_unwind(AssertUnwindSafe(|| match detach {
                true => stale.detach().unlock(),
                false => stale.unlock(),
            }));
            let let_go = let_go.expect("the stale guard is let go without a panic");
            assert!(!let_go.expect("unlock").was_held(), "detach {detach}");
            assert!(free(&srv, "unseat"));
            continue;
        }
        if detach {
            drop(stale.detach());
        } else {
            drop(stale);
        }
        let kept = held.check();
        let again = c.try_lock("unseat").map(drop);
        let released = catch_unwind(AssertUnwindSafe(|| held.unlock()));
        kept.expect("the new hold is untouched");
        assert!(
            matches!(again, Err(Error::WouldDeadlock)),
            "detach {detach}: asking again for a held lock: {again:?}"
        );
        let released = released.expect("the release of the new hold does not panic");
        assert!(released.expect("unlock").was_held());
        assert!(free(&srv, "unseat"));
    }
}

/// A release that panics (an injected fault standing for a bug) in the drop of guards
/// whose thread is already unwinding: the drop swallows the second panic rather than abort
/// the process, and the locks are given back in the background, usable again soon.
#[test]
fn a_release_that_panics_while_unwinding_does_not_abort() {
    use redbaton::fault::{self, Point};
    const P: &str = "ge-fault:";
    let _s = serial();
    let srv = test_server();
    let before = threads();
    let c = lock_client!(node(srv.url()), key_prefix(P));
    fault::arm(P, Point::Release, 2);
    let unwound = thread::scope(|s| {
        s.spawn(|| {
            let _g = c.lock("k").expect("lock");
            let _d = c.lock("d").expect("lock").detach();
            panic!("the critical section fails");
        })
        .join()
    });
    fault::disarm(P, Point::Release);
    assert!(unwound.is_err(), "the thread unwound");
    for name in ["k", "d"] {
        let g = c.try_lock_for(name, LIVENESS);
        assert!(g.is_ok(), "{name} usable again: {g:?}");
    }
    // The cleanup thread, which gave them back, ends with the client.
    drop(c);
    threads_end(&before, "client dropped");
}

/// A token cancelled before the call ends a multi-lock and a latch wait at once too, with
/// `Cancelled` and without a command: no latch is made, no name taken.
#[test]
fn a_cancelled_token_ends_every_kind_of_wait_before_it_starts() {
    let (_s, srv, c) = begin();
    let cancel = Cancel::new();
    cancel.cancel();
    let before = c.stats().commands;
    let multi = c.multi_lock_cancellable(["m1", "m2"], &cancel).map(drop);
    let latch = c.latch("l", 1).wait_cancellable(&cancel);
    assert!(matches!(multi, Err(Error::Cancelled)), "{multi:?}");
    assert!(matches!(latch, Err(Error::Cancelled)), "{latch:?}");
    assert_eq!(c.stats().commands, before, "no command sent");
    assert!(srv.keys_but_fences("ge:*").is_empty());
}

/// After `shutdown`, a detached guard whose release cannot reach the server, dropped on
/// another thread: the release fails within the I/O timeouts, is left to the key's lease
/// (no cleanup thread starts again), and nothing hangs.
#[test]
fn a_release_that_fails_after_shutdown_is_left_to_the_lease() {
    let _s = serial();
    let srv = test_server();
    let proxy = Proxy::start(srv.addr());
    let before = threads();
    let c = client(&proxy.url());
    let d = c.lock("gone").expect("lock").detach();
    c.clone().shutdown(LIVENESS).expect("shutdown in time");
    proxy.blackhole(true);
    let unlocked = thread::spawn(move || d.unlock()).join().expect("unlock");
    assert!(unlocked.is_err(), "{unlocked:?}");
    assert!(
        !threads().iter().any(|t| t.starts_with("redbaton-cleanu")),
        "a cleanup thread runs after the shutdown: {:?}",
        threads()
    );
    drop(c);
    threads_end(&before, "after the last handle");
    proxy.heal();
}

/// A guard kept in a thread-local, dropped as its thread exits (the thread's own data is
/// being torn down then): the release still happens, without a panic.
#[test]
fn a_guard_in_a_thread_local_is_released_at_thread_exit() {
    use std::cell::RefCell;
    thread_local! {
        static KEPT: RefCell<Option<redbaton::LockGuard>> = const { RefCell::new(None) };
    }
    let (_s, srv, c) = begin();
    let c2 = c.clone();
    thread::spawn(move || {
        let g = c2.lock("tls").expect("lock");
        KEPT.with(|k| *k.borrow_mut() = Some(g));
    })
    .join()
    .expect("the thread exits cleanly");
    assert!(free(&srv, "tls"), "released at thread exit");
}
