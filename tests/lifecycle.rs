//! The public API at its edges and the client's life: edge inputs of every primitive
//! (`bad_input.rs` and `edges.rs` have the plain lock's), guards that outlive their client,
//! guards whose hold was lost, `shutdown`, and how long `Drop` and `shutdown` take against
//! a stopped or stalled server.

use std::any::Any;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Mutex;
use std::thread;
use std::time::{Duration, Instant};

use redbaton::fault::{self, Point};
use redbaton::{Error, LockClient, MAX_LATCH_COUNT, MAX_MULTI_NAMES, MAX_NAME_LEN};
use redbaton_testkit::proxy::Proxy;
use redbaton_testkit::server::RedisServer;
use redbaton_testkit::wait::wait_until;
use redbaton_testkit::{lock_client, ms, secs, test_server};

/// The tests count the process's `redbaton-*` threads: one test at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// A client of `srv` under this file's key prefix, with the settings given.
macro_rules! rv_client {
    ($srv:expr; $($settings:tt)*) => {
        lock_client!(node($srv.url()), key_prefix("rv:"), $($settings)*)
    };
}

/// What a test starts with: the lock that runs the tests one at a time, the library's
/// threads before it, and a server of its own.
fn begin() -> (std::sync::MutexGuard<'static, ()>, Vec<String>, RedisServer) {
    let serial = serial();
    (serial, lib_threads(), test_server())
}

/// The library's threads alive in this process now (names are truncated to 15 bytes).
fn lib_threads() -> Vec<String> {
    let mut out = Vec::new();
    for t in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
        if let Ok(comm) = std::fs::read_to_string(t.path().join("comm")) {
            let comm = comm.trim().to_owned();
            if comm.starts_with("redbaton") {
                out.push(comm);
            }
        }
    }
    out.sort();
    out
}

/// Waits until the library's threads are back to `baseline` (those of clients other tests
/// leaked on purpose, e.g. with `mem::forget` of a guard).
fn back_to(baseline: &[String], d: Duration) -> Result<(), Vec<String>> {
    if wait_until(d, || lib_threads().len() <= baseline.len()) {
        Ok(())
    } else {
        Err(lib_threads())
    }
}

fn client(srv: &RedisServer) -> LockClient {
    rv_client!(srv; io_timeouts(secs(1)))
}

/// One test at a time, a server of its own and two clients of it.
fn two_clients() -> (
    std::sync::MutexGuard<'static, ()>,
    RedisServer,
    LockClient,
    LockClient,
) {
    let serial = serial();
    let srv = test_server();
    let (c, other) = (client(&srv), client(&srv));
    (serial, srv, c, other)
}

/// Runs `drop_all` (the last handles' drops), then `heal` (the fault's end): fails when
/// the drops took 10 s or more, or the library's threads are not back to `base` 15 s
/// later.
fn drops_in_time(base: &[String], drop_all: impl FnOnce(), heal: impl FnOnce()) {
    let t = Instant::now();
    drop_all();
    let took = t.elapsed();
    let left = back_to(base, secs(15));
    heal();
    assert!(took < secs(10), "drop took {took:?}");
    left.expect("threads still running 15 s after the last handle");
}

/// Runs `f`, failing the test if it panics; its result.
fn no_panic<T>(what: &str, f: impl FnOnce() -> T) -> T {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(v) => v,
        Err(p) => {
            let msg = p
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            panic!("{what}: panicked: {msg}")
        }
    }
}

fn far_future() -> Instant {
    let now = Instant::now();
    (20..63)
        .rev()
        .find_map(|bits| now.checked_add(Duration::from_secs(1 << bits)))
        .unwrap()
}

/// A client's threads start with it and end with its last clone.
#[test]
fn smoke() {
    let (_s, base, srv) = begin();
    let c = client(&srv);
    c.lock("smoke").expect("lock").unlock().expect("unlock");
    assert!(lib_threads().len() > base.len(), "the client's threads run");
    drop(c);
    back_to(&base, secs(10)).expect("threads left");
}

/// Every primitive refuses the names the plain lock refuses (empty, longer than
/// `MAX_NAME_LEN`) with `InvalidName`, accepts NUL and invalid UTF-8, and never panics:
/// read-write locks, semaphores, latches, multi-locks, `inspect` and `force_release`.
#[test]
fn bad_names_for_every_primitive() {
    let _s = serial();
    let srv = test_server();
    let c = client(&srv);
    let huge = vec![b'x'; MAX_NAME_LEN + 1];
    let bad: [(&str, &[u8]); 2] = [("empty", b""), ("huge", &huge)];
    for (what, name) in bad {
        let check = |op: &str, r: Result<(), Error>| {
            let e = r.expect_err(&format!("{op}({what}) accepted"));
            assert!(
                matches!(e, Error::InvalidName(_)) && e.is_invalid_input(),
                "{op}({what}): {e:?}"
            );
        };
        check(
            "rw.try_read",
            no_panic("rw", || c.rwlock(name).try_read().map(drop)),
        );
        check(
            "rw.try_write",
            no_panic("rw", || c.rwlock(name).try_write().map(drop)),
        );
        check(
            "rw.try_upgradable_read",
            no_panic("rw", || c.rwlock(name).try_upgradable_read().map(drop)),
        );
        check(
            "sem.try_acquire",
            no_panic("sem", || c.semaphore(name, 2).try_acquire().map(drop)),
        );
        check(
            "latch.count",
            no_panic("latch", || c.latch(name, 2).count().map(drop)),
        );
        check(
            "latch.count_down",
            no_panic("latch", || c.latch(name, 2).count_down().map(drop)),
        );
        check(
            "latch.wait_for",
            no_panic("latch", || c.latch(name, 2).wait_for(ms(10))),
        );
        check(
            "try_multi_lock",
            no_panic("multi", || c.try_multi_lock([name, b"ok"]).map(drop)),
        );
        check("inspect", no_panic("inspect", || c.inspect(name).map(drop)));
        check(
            "force_release",
            no_panic("force", || c.force_release(name, 1).map(drop)),
        );
    }
    // NUL and invalid UTF-8 are names like any other.
    for name in [&b"a\0b"[..], &[0xff, 0xfe, b'{', b'}'][..]] {
        no_panic("rw", || {
            c.rwlock(name).try_write().unwrap().unlock().unwrap()
        });
        no_panic("sem", || {
            c.semaphore(name, 1)
                .try_acquire()
                .unwrap()
                .unlock()
                .unwrap()
        });
        no_panic("latch", || {
            assert_eq!(c.latch(name, 1).count_down().unwrap(), 0)
        });
        no_panic("multi", || {
            c.try_multi_lock([name, b"other"])
                .unwrap()
                .unlock()
                .unwrap()
        });
    }
    assert!(
        srv.keys_but_fences("rv:*")
            .iter()
            .all(|k| k.ends_with(":latch"))
    );
}

/// Semaphore with 0 permits: a typed input error, nothing sent. u32::MAX permits: works,
/// and `inspect` reports the same count. Latch 0 / MAX+1: InvalidArgument; MAX: works.
/// Multi-lock: no names, duplicates, MAX+1 names: InvalidArgument, nothing written.
#[test]
fn counts_at_their_edges() {
    let _s = serial();
    let srv = test_server();
    let c = client(&srv);
    let before = srv.total_commands();
    let e = no_panic("sem 0", || c.semaphore("s0", 0).try_acquire().map(drop)).unwrap_err();
    assert!(e.is_invalid_input(), "{e:?}");
    let e = no_panic("sem 0 acquire_for", || {
        c.semaphore("s0", 0).try_acquire_for(ms(50)).map(drop)
    })
    .unwrap_err();
    assert!(e.is_invalid_input(), "{e:?}");
    for n in [0, MAX_LATCH_COUNT + 1, u64::MAX] {
        let e = no_panic("latch", || c.latch("l", n).count()).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "latch({n}): {e:?}");
        let e = no_panic("latch", || c.latch("l", n).wait_for(ms(10))).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "latch({n}): {e:?}");
    }
    let none: [&str; 0] = [];
    let e = no_panic("multi none", || c.try_multi_lock(none).map(drop)).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
    let e = no_panic("multi dup", || c.try_multi_lock(["a", "b", "a"]).map(drop)).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
    let many: Vec<String> = (0..=MAX_MULTI_NAMES).map(|i| format!("m{i}")).collect();
    let e = no_panic("multi many", || c.try_multi_lock(&many).map(drop)).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
    // Endless iterator: refused without reading it all.
    let e = no_panic("multi endless", || {
        c.try_multi_lock((0u64..).map(|i| i.to_string())).map(drop)
    })
    .unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
    assert!(srv.keys_but_fences("rv:*").is_empty());
    // Nothing sent for any of the above except at most a few (stats-free) commands.
    let sent = srv.total_commands() - before;
    assert!(sent <= 2, "input errors sent {sent} commands");

    // The largest counts work.
    let sem = c.semaphore("smax", u32::MAX);
    let p = no_panic("sem max", || sem.try_acquire().unwrap());
    let info = c.inspect("smax").unwrap();
    assert_eq!(
        info.kind,
        redbaton::LockKind::Semaphore { permits: u32::MAX },
        "{info:?}"
    );
    p.unlock().unwrap();
    let l = c.latch("lmax", MAX_LATCH_COUNT);
    assert_eq!(
        no_panic("latch max", || l.count_down().unwrap()),
        MAX_LATCH_COUNT - 1
    );
    let full: Vec<String> = (0..MAX_MULTI_NAMES).map(|i| format!("f{i}")).collect();
    no_panic("multi max", || {
        c.try_multi_lock(&full).unwrap().unlock().unwrap()
    });
}

/// ZERO / MAX timeouts and past / far-future deadlines on the rwlock, semaphore, latch and
/// multi-lock waits: no panic (Instant + Duration overflow), ZERO and the past make one
/// attempt, MAX and far future wait without a deadline.
#[test]
fn every_wait_at_its_edges() {
    let (_s, _srv, c, other) = two_clients();
    let far = far_future();
    let past = Instant::now()
        .checked_sub(secs(3600))
        .unwrap_or_else(Instant::now);
    // Free: each of them takes it, with a wait of either end.
    for (what, d, t) in [
        ("ZERO, the past", Duration::ZERO, past),
        ("MAX, far", Duration::MAX, far),
    ] {
        no_panic(what, || -> redbaton::Result<()> {
            let rw = c.rwlock("rw");
            let sem = c.semaphore("sem", 1);
            let m = ["m1", "m2"];
            rw.try_read_for(d)?.unlock()?;
            rw.try_read_until(t)?.unlock()?;
            rw.try_write_for(d)?.unlock()?;
            rw.try_write_until(t)?.unlock()?;
            rw.try_upgradable_read_for(d)?.unlock()?;
            rw.try_upgradable_read_until(t)?.unlock()?;
            sem.try_acquire_for(d)?.unlock()?;
            sem.try_acquire_until(t)?.unlock()?;
            c.try_multi_lock_for(m, d)?.unlock()?;
            c.try_multi_lock_until(m, t)?.unlock()?;
            Ok(())
        })
        .expect("free: taken");
    }
    // Held elsewhere: ZERO and the past time out at once.
    let w = other.rwlock("rw").write().unwrap();
    let p = other.semaphore("sem", 1).acquire().unwrap();
    let m = other.lock("m1").unwrap();
    let started = Instant::now();
    for (what, r) in [
        (
            "read ZERO",
            c.rwlock("rw").try_read_for(Duration::ZERO).map(drop),
        ),
        (
            "write ZERO",
            c.rwlock("rw").try_write_for(Duration::ZERO).map(drop),
        ),
        ("read past", c.rwlock("rw").try_read_until(past).map(drop)),
        (
            "sem ZERO",
            c.semaphore("sem", 1)
                .try_acquire_for(Duration::ZERO)
                .map(drop),
        ),
        (
            "sem past",
            c.semaphore("sem", 1).try_acquire_until(past).map(drop),
        ),
        (
            "multi ZERO",
            c.try_multi_lock_for(["m1", "m2"], Duration::ZERO).map(drop),
        ),
        (
            "multi past",
            c.try_multi_lock_until(["m1", "m2"], past).map(drop),
        ),
        ("latch ZERO", c.latch("lat", 1).wait_for(Duration::ZERO)),
        ("latch past", c.latch("lat", 1).wait_until(past)),
    ] {
        let e = r.expect_err(what);
        assert!(e.is_timeout(), "{what}: {e:?}");
    }
    assert!(
        started.elapsed() < secs(5),
        "zero waits took {:?}",
        started.elapsed()
    );
    // MAX / far future wait for the release.
    let c2 = c.clone();
    let t = thread::spawn(move || {
        catch_unwind(AssertUnwindSafe(|| {
            c2.rwlock("rw").try_write_for(Duration::MAX).map(drop)?;
            c2.semaphore("sem", 1).try_acquire_until(far).map(drop)?;
            c2.try_multi_lock_for(["m1", "m2"], Duration::MAX).map(drop)
        }))
    });
    let l = c.latch("lat", 1);
    let t2 = thread::spawn(move || catch_unwind(AssertUnwindSafe(|| l.wait_for(Duration::MAX))));
    thread::sleep(ms(300));
    drop((w, p, m));
    other.latch("lat", 1).count_down().unwrap();
    assert!(wait_until(secs(15), || t.is_finished() && t2.is_finished()));
    t.join().unwrap().expect("no panic").unwrap();
    t2.join().unwrap().expect("no panic").unwrap();
}

/// A guard of every kind outliving its client: it still works (check, extend, unlock), its
/// Drop releases in Redis, and the library's threads end once the last guard is gone.
#[test]
fn guards_outlive_their_client_and_threads_end() {
    let (_s, base, srv) = begin();
    let c = client(&srv);
    let g = c.lock("g").unwrap();
    let d = c.lock("d").unwrap().detach();
    let r = c.rwlock("r").read().unwrap();
    let w = c.rwlock("w").write().unwrap().detach();
    let p = c.semaphore("p", 2).acquire().unwrap();
    let m = c.multi_lock(["m1", "m2"]).unwrap();
    drop(c);
    g.check().unwrap();
    g.extend(secs(5)).unwrap();
    // Moved guards dropped on other threads.
    let t = thread::spawn(move || {
        d.check().unwrap();
        drop(d);
        drop(w);
        drop(m);
    });
    t.join().unwrap();
    drop(r);
    drop(p);
    assert!(g.unlock().unwrap().was_held());
    back_to(&base, secs(10)).expect("threads left after the last guard");
    assert!(
        srv.keys_but_fences("rv:*").is_empty(),
        "{:?}",
        srv.keys_but_fences("rv:*")
    );
}

/// `mem::forget` of a guard: the hold stays (the watchdog renews it while the process
/// lives), and the forgotten guard keeps the client's threads alive, but the client's
/// `Drop` returns at once.
#[test]
fn forgotten_guard_does_not_hang_drop() {
    let _s = serial();
    let srv = test_server();
    let c = client(&srv);
    std::mem::forget(c.lock("f").unwrap());
    std::mem::forget(c.multi_lock(["f1", "f2"]).unwrap());
    let t = Instant::now();
    drop(c);
    assert!(t.elapsed() < secs(5), "drop took {:?}", t.elapsed());
}

/// Drop of the last handle while the server is SIGSTOPped and a guard is held (its Drop
/// must release, fail within the I/O timeouts, and the client's threads must be joined).
#[test]
fn drop_with_server_paused_while_holding() {
    let (_s, base, srv) = begin();
    let c = rv_client!(srv; io_timeouts(secs(1)), lease(secs(3)));
    let g = c.lock("held").unwrap();
    srv.pause();
    thread::sleep(ms(200));
    let t = Instant::now();
    drop(c);
    drop(g);
    let took = t.elapsed();
    let left = back_to(&base, secs(15));
    srv.resume();
    assert!(
        took < secs(10),
        "drop of the client and guard took {took:?}"
    );
    left.expect("threads still running 15 s after the last handle");
}

/// Drop of the last handle through a stalled proxy while another thread waits for a lock
/// (the waiter keeps a clone; it must end within its deadline and the client's Drop must
/// then not hang).
#[test]
fn drop_with_proxy_stalled_while_waiting() {
    let (_s, base, srv) = begin();
    let proxy = Proxy::start(srv.addr());
    let c = rv_client!(proxy; io_timeouts(secs(1)), lease(secs(3)));
    let holder = client(&srv);
    let held = holder.lock("w").unwrap();
    let c2 = c.clone();
    let waiter = thread::spawn(move || c2.try_lock_for("w", secs(3)).map(drop));
    thread::sleep(ms(300));
    proxy.stall(true);
    let t = Instant::now();
    drop(c);
    let r = waiter.join().unwrap();
    let took = t.elapsed();
    drop(held);
    drop(holder);
    let left = back_to(&base, secs(15));
    proxy.heal();
    assert!(r.is_err());
    assert!(took < secs(10), "waiter + drop took {took:?}");
    left.expect("threads still running 15 s after the last handle");
}

/// Same with a blackholed proxy while a guard is held and renewals are in flight.
#[test]
fn drop_with_proxy_blackholed_during_renewal() {
    let (_s, base, srv) = begin();
    let proxy = Proxy::start(srv.addr());
    let c = rv_client!(proxy; io_timeouts(secs(1)), lease(secs(3)), renew_interval(ms(200)));
    let g = c.lock("b").unwrap();
    proxy.blackhole(true);
    thread::sleep(ms(500)); // a renewal is in flight now
    drops_in_time(&base, || drop((g, c)), || proxy.heal());
}

/// `shutdown(deadline)` with the server SIGSTOPped: returns by its deadline (plus a
/// margin), Ok or Err(Timeout).
#[test]
fn shutdown_returns_in_time_with_server_paused() {
    let (_s, base, srv) = begin();
    let c = rv_client!(srv; io_timeouts(secs(1)), lease(secs(3)), renew_interval(ms(200)));
    // A subscriber exists only once someone waited.
    let other = client(&srv);
    let h = other.lock("s").unwrap();
    let _ = c.try_lock_for("s", ms(200));
    drop(h);
    drop(other);
    let g = c.lock("s2").unwrap();
    srv.pause();
    thread::sleep(ms(300));
    let t = Instant::now();
    let r = c.clone().shutdown(ms(500));
    let took = t.elapsed();
    srv.resume();
    drop(g);
    drop(c);
    assert!(took < secs(2), "shutdown(500 ms) took {took:?}: {r:?}");
    back_to(&base, secs(15)).expect("threads left");
}

/// A hold deleted by hand and then taken by another client: the old guard (plain and
/// detached) says Lost(Deleted) in `check`, refuses `extend` with Lost, keeps its token,
/// its validity is over, and its `unlock` says not held and leaves the new holder's lock.
#[test]
fn lost_guard_methods() {
    let (_s, base, srv) = begin();
    let c = rv_client!(srv; io_timeouts(secs(1)), lease(secs(2)), renew_interval(ms(100)));
    let g = c.lock("lost").unwrap();
    let other = client(&srv);
    let d = c.lock("lostd").unwrap().detach();
    let (tg, td) = (g.fencing_token(), d.fencing_token());
    let mut conn = srv.conn();
    let _: () = redis::cmd("DEL")
        .arg("rv:{lost}")
        .arg("rv:{lostd}")
        .query(&mut conn)
        .unwrap();
    assert!(
        wait_until(secs(5), || g.is_lost() && d.is_lost()),
        "loss not noticed"
    );
    let new = other.try_lock("lost").unwrap();
    let newd = other.try_lock("lostd").unwrap();
    for (what, r) in [("check", g.check()), ("check detached", d.check())] {
        assert!(matches!(r, Err(Error::Lost(_))), "{what}: {r:?}");
    }
    for (what, r) in [
        ("extend", g.extend(secs(5))),
        ("extend detached", d.extend(secs(5))),
    ] {
        assert!(matches!(r, Err(Error::Lost(_))), "{what}: {r:?}");
    }
    assert_eq!(g.fencing_token(), tg);
    assert_eq!(d.fencing_token(), td);
    assert!(g.valid_until() <= Instant::now());
    assert!(d.valid_until() <= Instant::now());
    assert!(g.lost().try_recv().is_ok());
    let t = thread::spawn(move || d.unlock());
    let ud = t.join().unwrap().unwrap();
    let u = g.unlock().unwrap();
    assert!(!u.was_held() && !ud.was_held(), "{u:?} {ud:?}");
    new.check().unwrap();
    newd.check().unwrap();
    let v: Option<String> = redis::cmd("GET").arg("rv:{lost}").query(&mut conn).unwrap();
    assert!(
        v.is_some(),
        "the lost guard's unlock deleted the new holder's lock"
    );
    drop((new, newd, other, c));
    back_to(&base, secs(10)).expect("threads left");
}

/// After `shutdown()` no clone takes a new hold (nothing would renew it): a call returns
/// `ShutDown` and takes nothing; a wait under way when it was called, which wins by its
/// re-check afterwards, gets a guard already told it is lost, whose drop gives the lock
/// back.
#[test]
fn no_clone_takes_a_hold_after_shutdown() {
    let (_s, base, srv) = begin();
    let c = rv_client!(srv; io_timeouts(ms(500)), lease(secs(1)), recheck_interval(ms(300)));
    let other = client(&srv);
    let clone = c.clone();
    let held = other.lock("sd").unwrap();
    let c2 = clone.clone();
    let t = thread::spawn(move || {
        c2.try_lock_for("sd", secs(8))
            .map(|g| (g.lost().recv_timeout(ms(100)).ok(), g.check().err()))
    });
    thread::sleep(ms(300));
    c.shutdown(secs(5)).expect("shutdown in time");
    drop(held);
    assert!(wait_until(secs(10), || t.is_finished()));
    let (signal, checked) = t.join().unwrap().expect("the wait under way wins");
    assert_eq!(signal, Some(redbaton::LostReason::WatchdogFailed));
    assert!(checked.is_some_and(|e| e.is_lost()));
    let e = clone.lock("sd2").unwrap_err();
    assert!(e.is_shut_down(), "{e:?}");
    assert!(
        other.try_lock("sd2").is_ok(),
        "the refused call took nothing"
    );
    assert!(
        other.try_lock("sd").is_ok(),
        "the lost guard's drop gave the lock back"
    );
    drop((clone, other));
    back_to(&base, secs(10)).expect("threads left");
}

/// A client of `srv` through a proxy, with I/O timeouts of `io`, whose scripts are loaded;
/// then the proxy stalls: what the client sends goes unanswered.
fn stalled(srv: &RedisServer, io: Duration) -> (Proxy, LockClient) {
    let proxy = Proxy::start(srv.addr());
    let c = rv_client!(proxy; io_timeouts(io));
    c.lock("warm").unwrap().unlock().unwrap();
    proxy.stall(true);
    (proxy, c)
}

/// A client whose acquisitions lost their replies (stalled proxy) has releases queued for
/// its cleanup thread; dropping the client then must not take much longer than one I/O
/// timeout.
#[test]
fn drop_with_cleanup_jobs_against_stalled_server() {
    let (_s, base, srv) = begin();
    let (proxy, c) = stalled(&srv, secs(1));
    for i in 0..3 {
        let r = c.try_lock(format!("cl{i}"));
        assert!(r.is_err());
    }
    let st = c.stats();
    eprintln!("cleanup_dropped {}", st.cleanup_dropped);
    drops_in_time(&base, || drop(c), || proxy.heal());
}

/// `shutdown` stops the cleanup thread too, while it is trying a release again against a
/// stalled server: it gives the release up (the key expires with its lease) rather than
/// outlive the call, and no later failure starts it again.
#[test]
fn shutdown_stops_the_cleanup_thread() {
    let (_s, base, srv) = begin();
    let (proxy, c) = stalled(&srv, ms(500));
    let cleanup = || {
        lib_threads()
            .iter()
            .any(|t| t.starts_with("redbaton-clean"))
    };
    assert!(c.try_lock("cl").is_err());
    assert!(
        wait_until(secs(10), cleanup),
        "no cleanup thread: {:?}",
        lib_threads()
    );
    c.clone()
        .shutdown(secs(5))
        .expect("every thread stopped in time");
    assert!(
        !cleanup(),
        "the cleanup thread outlived shutdown: {:?}",
        lib_threads()
    );
    assert!(c.try_lock("cl2").is_err());
    assert!(
        !cleanup(),
        "a job after shutdown started a thread: {:?}",
        lib_threads()
    );
    drops_in_time(&base, || drop(c), || proxy.heal());
}

/// A library thread of the `rv:` clients caught at a fault point (see `redbaton::fault`)
/// until this is dropped.
struct Stall(Point);

impl Stall {
    /// Arms the stall, runs `go`, and waits until a thread is caught there.
    fn until(&self, go: impl FnOnce(), what: &str) {
        fault::stall("rv:", self.0);
        go();
        assert!(wait_until(secs(10), || self.caught()), "{what}");
    }

    /// Whether a thread is caught there still.
    fn caught(&self) -> bool {
        fault::stalled("rv:", self.0)
    }
}

impl Drop for Stall {
    fn drop(&mut self) {
        fault::disarm("rv:", self.0);
    }
}

/// A `shutdown` that timed out while the cleanup thread was busy leaves it to the next
/// one: a later `shutdown` waits for that thread (and says when it still runs), and says
/// every thread stopped only once it has. Forgetting it would let a caller go on (fork,
/// say) with the thread still making its calls.
#[test]
fn a_shutdown_after_one_that_timed_out_still_waits_for_the_cleanup_thread() {
    let (_s, base, srv) = begin();
    let (proxy, c) = stalled(&srv, ms(500));
    let stall = Stall(Point::Cleanup);
    stall.until(
        || assert!(c.try_lock("cl").is_err()),
        "the cleanup job never ran",
    );
    let first = c.clone().shutdown(ms(50));
    assert!(first.is_err(), "the cleanup thread is stalled: {first:?}");
    let second = c.clone().shutdown(ms(300));
    let still = stall.caught();
    drop(stall);
    assert!(
        second.is_err() || !still,
        "shutdown said every thread stopped while the cleanup thread ran: {second:?}"
    );
    c.clone()
        .shutdown(secs(10))
        .expect("every thread stopped in time");
    assert!(
        !lib_threads()
            .iter()
            .any(|t| t.starts_with("redbaton-clean")),
        "the cleanup thread outlived shutdown: {:?}",
        lib_threads()
    );
    drops_in_time(&base, || drop(c), || proxy.heal());
}

/// Two `shutdown`s at once, while a thread of the client is busy (the watchdog, caught
/// in a renewal): each keeps its own timeout; the one allowed less does not wait for the
/// other's.
#[test]
fn a_shutdown_keeps_its_timeout_beside_a_longer_one() {
    let (_s, base, srv) = begin();
    let c = rv_client!(srv; io_timeouts(secs(1)), lease(secs(3)));
    let held = c.lock("renewed").expect("lock");
    let stall = Stall(Point::Watchdog);
    stall.until(|| (), "no renewal came");
    let long = {
        let c = c.clone();
        thread::spawn(move || c.shutdown(secs(60)))
    };
    thread::sleep(ms(50));
    let short = {
        let c = c.clone();
        thread::spawn(move || c.shutdown(ms(100)))
    };
    let kept = wait_until(secs(10), || short.is_finished());
    drop(stall);
    assert!(kept, "a 100 ms shutdown waited for a 60 s one");
    let short = short.join().expect("short shutdown");
    assert!(short.is_err(), "the watchdog was stalled: {short:?}");
    long.join()
        .expect("long shutdown")
        .expect("every thread stopped");
    drop(held);
    drops_in_time(&base, || drop(c), || ());
}

/// `locks(pattern)` lists each held name once, exactly as given (names with braces, glob
/// characters, NUL, invalid UTF-8), matches `pattern` against names, and lists nothing
/// for latches or fence counters.
#[test]
fn locks_lists_odd_names_exactly() {
    let _s = serial();
    let srv = test_server();
    let c = client(&srv);
    let odd: [&[u8]; 9] = [
        b"a}b",
        b"x{y}",
        b"st*r?[x]",
        b"back\\slash",
        b"n\0ul",
        b"\xff}\xfe",
        b"plain",
        b"a:fence",
        b"a:latch",
    ];
    let names: Vec<Vec<u8>> = odd.iter().map(|n| n.to_vec()).collect();
    let guards: Vec<_> = names.iter().map(|n| c.lock(n).unwrap()).collect();
    c.lock("freed").unwrap().unlock().unwrap();
    c.latch("lat", 3).count_down().unwrap();
    let rw = c.rwlock("rw{1}").read().unwrap();
    let mut listed: Vec<Vec<u8>> = c.locks("").map(|i| i.unwrap().name).collect();
    listed.sort();
    let mut want = names.clone();
    want.push(b"rw{1}".to_vec());
    want.sort();
    assert_eq!(
        listed
            .iter()
            .map(|n| String::from_utf8_lossy(n).into_owned())
            .collect::<Vec<_>>(),
        want.iter()
            .map(|n| String::from_utf8_lossy(n).into_owned())
            .collect::<Vec<_>>()
    );
    assert_eq!(listed, want);
    for (pattern, want) in [
        ("a}*", vec![b"a}b".to_vec()]),
        ("x{*", vec![b"x{y}".to_vec()]),
        ("st\\*r*", vec![b"st*r?[x]".to_vec()]),
        ("rw*", vec![b"rw{1}".to_vec()]),
    ] {
        let mut got: Vec<Vec<u8>> = c.locks(pattern).map(|i| i.unwrap().name).collect();
        got.sort();
        assert_eq!(got, want, "pattern {pattern:?}");
    }
    drop((guards, rw));
}

/// Each kind of guard dropped while the server is SIGSTOPped returns within a few I/O
/// timeouts (1 s here), and so does the client's Drop after.
#[test]
fn every_guard_drop_with_server_paused() {
    let (_s, base, srv) = begin();
    let c = rv_client!(srv; io_timeouts(secs(1)), lease(secs(5)));
    let g = c.lock("g").unwrap();
    let d = c.lock("d").unwrap().detach();
    let r = c.rwlock("r").read().unwrap();
    let w = c.rwlock("w").write().unwrap();
    let u = c.rwlock("u").upgradable_read().unwrap();
    let p = c.semaphore("p", 2).acquire().unwrap();
    let m = c.multi_lock(["m1", "m2"]).unwrap();
    srv.pause();
    thread::sleep(ms(100));
    let mut slow = Vec::new();
    let drops: Vec<(&str, Box<dyn Any>)> = vec![
        ("lock guard", Box::new(g)),
        ("detached", Box::new(d)),
        ("read", Box::new(r)),
        ("write", Box::new(w)),
        ("upgradable", Box::new(u)),
        ("permit", Box::new(p)),
        ("multi", Box::new(m)),
        ("client", Box::new(c)),
    ];
    for (what, handle) in drops {
        let t = Instant::now();
        drop(handle);
        let took = t.elapsed();
        eprintln!("{what}: {took:?}");
        if took > secs(6) {
            slow.push(format!("{what}: {took:?}"));
        }
    }
    let left = back_to(&base, secs(15));
    srv.resume();
    assert!(slow.is_empty(), "slow drops: {slow:?}");
    left.expect("threads left");
}

/// An upgradable read whose hold was deleted (by hand; likewise expired), while another
/// client now reads: the upgrade must fail (Lost, or at worst Timeout), never return a write
/// guard while the other reader holds. Likewise a lost write hold's downgrade must fail with
/// Lost rather than return a read guard beside another client's write hold.
#[test]
fn conversions_of_a_lost_hold() {
    let (_s, srv, c, other) = two_clients();
    let mut conn = srv.conn();
    // Upgrade of a lost upgradable read, another reader in.
    let u = c.rwlock("up").upgradable_read().unwrap();
    let _: () = redis::cmd("DEL").arg("rv:{up}").query(&mut conn).unwrap();
    let r = other.rwlock("up").try_read().unwrap();
    match no_panic("upgrade", || u.try_upgrade_for(secs(2))) {
        Ok(w) => panic!(
            "upgrade of a deleted hold gave a write guard (token {}) while another client reads",
            w.fencing_token()
        ),
        Err(e) => eprintln!("upgrade: {:?}", e.error()),
    }
    drop(r);
    // Upgrade of a lost upgradable read, nobody else in: Lost, not a write guard.
    let u = c.rwlock("up2").upgradable_read().unwrap();
    let _: () = redis::cmd("DEL").arg("rv:{up2}").query(&mut conn).unwrap();
    match no_panic("upgrade2", || u.try_upgrade()) {
        Ok(w) => panic!(
            "upgrade of a deleted upgradable read returned a write guard: check {:?}",
            w.check()
        ),
        Err(e) => assert!(e.error().is_lost(), "{:?}", e.error()),
    }
    // Downgrade of a lost write hold while another client writes.
    let w = c.rwlock("down").write().unwrap();
    let _: () = redis::cmd("DEL").arg("rv:{down}").query(&mut conn).unwrap();
    let ow = other.rwlock("down").try_write().unwrap();
    match no_panic("downgrade", || w.downgrade()) {
        Ok(r) => panic!(
            "downgrade of a deleted write hold gave a read guard (check {:?}) beside another writer",
            r.check()
        ),
        Err(e) => assert!(e.is_lost(), "{e:?}"),
    }
    ow.check().unwrap();
}

/// Sentinel client: with the sentinels and the master SIGSTOPped while a lock is held, a
/// waiter waits (with a deadline) and a renewal is due, `shutdown(1 s)` returns within
/// about its deadline, dropping the guard and the client takes a few I/O timeouts at
/// most, and every thread (watcher, subscriber, watchdog) ends.
#[test]
fn sentinel_lifecycle_with_everything_paused() {
    let _s = serial();
    let base = lib_threads();
    redbaton_testkit::init_log();
    let group = redbaton_testkit::sentinel::SentinelGroup::start("rvs", 0, 2);
    let c = lock_client!(
        sentinel("rvs", group.sentinel_urls()),
        key_prefix("rv:"),
        io_timeouts(secs(1)),
        lease(secs(4))
    );
    let g = c.lock("s").unwrap();
    let c2 = c.clone();
    let waiter = thread::spawn(move || c2.try_lock_for("s", secs(3)).map(drop));
    thread::sleep(ms(300));
    for s in &group.sentinels {
        s.pause();
    }
    group.servers[0].pause();
    thread::sleep(ms(1500));
    let t = Instant::now();
    let sd = c.clone().shutdown(secs(1));
    let shutdown_took = t.elapsed();
    let r = waiter.join().unwrap();
    let t = Instant::now();
    drop(g);
    drop(c);
    let drop_took = t.elapsed();
    let left = back_to(&base, secs(15));
    for s in &group.sentinels {
        s.resume();
    }
    group.servers[0].resume();
    eprintln!("shutdown {shutdown_took:?} {sd:?}, drop {drop_took:?}, waiter {r:?}");
    assert!(
        shutdown_took < secs(3),
        "shutdown(1 s) took {shutdown_took:?}"
    );
    assert!(drop_took < secs(10), "drop took {drop_took:?}");
    left.expect("threads left");
}
