//! What a client reports about itself under faults, through `Stats` and the `metrics`
//! feature (a recording backend): a hold found gone or taken by its release counts as
//! lost, once, with its reason; the held gauge goes back to 0 after a shutdown with holds
//! alive, a panic while guards are held and an unlock that fails on a stalled server; a
//! call that times out counts once in `timeouts`, whatever it waited for and wherever
//! (in Redis, behind a local holder, riding a dead master behind Sentinel), and an
//! upgrade that returns its read hold lost at the deadline counts as that, not as a
//! timeout; replies lost on the way back count no acquisition twice and no loss; a
//! recorder that panics as a loss is counted strands no unlock and keeps no holder
//! from being told, at a shutdown too.
//!
//! The tests share the process-wide recorder: they run one at a time (see [`recorded`]).

#![cfg(feature = "metrics")]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock, mpsc};
use std::thread;

use metrics::{Counter, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit};
use metrics_util::MetricKind;
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use redbaton::fault::{self, Point};
use redbaton::{LockClient, LostReason, Stats, Unlocked};
use redbaton_testkit::keys::{DEFAULT_PREFIX, Keys};
use redbaton_testkit::proxy::Proxy;
use redbaton_testkit::server::RedisServer;
use redbaton_testkit::wait::wait_for;
use redbaton_testkit::{lock_client, ms, secs, test_server};

const KINDS: [&str; 4] = ["lock", "read", "write", "permit"];

/// The recorder of this test binary, emptied, and the lock that keeps its tests apart.
fn recorded() -> (&'static Snapshotter, MutexGuard<'static, ()>) {
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
    static SNAPSHOTS: OnceLock<Snapshotter> = OnceLock::new();
    let turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let snapshots = SNAPSHOTS.get_or_init(|| {
        let rec = DebuggingRecorder::new();
        let snapshots = rec.snapshotter();
        metrics::set_global_recorder(Failing(rec)).expect("one recorder per test binary");
        snapshots
    });
    drop(snapshots.snapshot());
    (snapshots, turn)
}

/// Set, the recorder panics the next time a loss is counted (then it is cleared).
static FAIL_ON_LOSS: AtomicBool = AtomicBool::new(false);

/// The recording backend, made to fail as an exporter's bug would (see [`FAIL_ON_LOSS`]).
struct Failing(DebuggingRecorder);

impl Recorder for Failing {
    fn describe_counter(&self, key: KeyName, unit: Option<Unit>, text: SharedString) {
        self.0.describe_counter(key, unit, text)
    }
    fn describe_gauge(&self, key: KeyName, unit: Option<Unit>, text: SharedString) {
        self.0.describe_gauge(key, unit, text)
    }
    fn describe_histogram(&self, key: KeyName, unit: Option<Unit>, text: SharedString) {
        self.0.describe_histogram(key, unit, text)
    }
    fn register_counter(&self, key: &Key, meta: &Metadata<'_>) -> Counter {
        if key.name() == "redbaton_lost_total" && FAIL_ON_LOSS.swap(false, Ordering::SeqCst) {
            panic!("the recorder fails as a loss is counted");
        }
        self.0.register_counter(key, meta)
    }
    fn register_gauge(&self, key: &Key, meta: &Metadata<'_>) -> Gauge {
        self.0.register_gauge(key, meta)
    }
    fn register_histogram(&self, key: &Key, meta: &Metadata<'_>) -> Histogram {
        self.0.register_histogram(key, meta)
    }
}

/// Every counter and gauge recorded since the last snapshot, as `(name, label values, n)`
/// (the values joined by commas, empty without labels); histograms as their sample count.
fn values(snapshots: &Snapshotter) -> Vec<(String, String, f64)> {
    let mut out = Vec::new();
    for (key, _, _, value) in snapshots.snapshot().into_vec() {
        let (kind, key) = (key.kind(), key.key().clone());
        let labels: Vec<&str> = key.labels().map(|l| l.value()).collect();
        let n = match (kind, value) {
            (MetricKind::Counter, DebugValue::Counter(n)) => n as f64,
            (MetricKind::Gauge, DebugValue::Gauge(g)) => g.into_inner(),
            (MetricKind::Histogram, DebugValue::Histogram(xs)) => xs.len() as f64,
            (kind, value) => panic!("{key:?}: {kind:?} {value:?}"),
        };
        out.push((key.name().to_owned(), labels.join(","), n));
    }
    out
}

/// The sum of `name` over the series with a label of value `label` (all, when empty).
fn sum(seen: &[(String, String, f64)], name: &str, label: &str) -> f64 {
    let has = |l: &String| label.is_empty() || l.split(',').any(|v| v == label);
    let of = |(n, l, _): &&(String, String, f64)| n == name && has(l);
    seen.iter().filter(of).map(|(_, _, v)| v).sum()
}

/// The held gauge of every kind is 0 (each kind was held at some point in the test).
fn nothing_held(seen: &[(String, String, f64)]) {
    for kind in KINDS {
        let held = sum(seen, "redbaton_locks_held", kind);
        assert_eq!(held, 0.0, "redbaton_locks_held{{kind={kind}}}: {seen:?}");
    }
}

/// Deletes the key of `name` behind its holders' backs.
fn delete(srv: &RedisServer, name: &str) {
    let n: i64 = redis::cmd("DEL")
        .arg(Keys::DEFAULT.lock(name))
        .query(&mut srv.conn())
        .expect("DEL");
    assert_eq!(n, 1, "{name}");
}

/// A server, a proxy in front of it, and a client through the proxy whose calls give up
/// on a silent server soon (300 ms).
fn behind_a_proxy() -> (RedisServer, Proxy, LockClient) {
    let srv = test_server();
    let proxy = Proxy::start(srv.addr());
    let client = lock_client!(node(proxy.url()), io_timeouts(ms(300)));
    (srv, proxy, client)
}

fn lost_counted(stats: &Stats, seen: &[(String, String, f64)], reason: &str, n: u64) {
    assert_eq!(
        sum(seen, "redbaton_lost_total", reason),
        n as f64,
        "{reason}: {seen:?}"
    );
    assert_eq!(
        sum(seen, "redbaton_lost_total", ""),
        stats.locks_lost as f64
    );
}

#[test]
fn smoke() {
    let (snapshots, _turn) = recorded();
    let srv = test_server();
    let client = lock_client!(node(srv.url()));
    client.lock("s").expect("lock").unlock().expect("unlock");
    let seen = values(snapshots);
    assert_eq!(sum(&seen, "redbaton_acquire_wait_seconds", "lock"), 1.0);
    assert_eq!(sum(&seen, "redbaton_locks_held", "lock"), 0.0);
    assert_eq!(client.stats().remote_hold.count, 1);
}

/// A hold whose key went away between two renewals (a restart without persistence, an
/// operator's `DEL`) or that another owner took is told so only by its release: it was
/// lost while held all the same, and counts once, with the reason a renewal would have
/// given (`deleted`, `stolen`).
#[test]
fn a_hold_its_release_finds_gone_counts_as_lost() {
    let (snapshots, _turn) = recorded();
    let srv = test_server();
    // Renewals a minute apart: only the release looks at the keys in time.
    let client = lock_client!(node(srv.url()), patient());

    let lock = client.lock("restarted").expect("lock");
    let write = client.rwlock("rw").write().expect("write");
    let permit = client.semaphore("sem", 2).acquire().expect("permit");
    let multi = client.multi_lock(["m1", "m2"]).expect("multi");
    let detached = client.lock("detached").expect("lock").detach();
    srv.restart();
    assert_eq!(lock.unlock().expect("unlock"), Unlocked::Expired);
    assert_eq!(write.unlock().expect("unlock"), Unlocked::Expired);
    assert_eq!(permit.unlock().expect("unlock"), Unlocked::Expired);
    assert_eq!(multi.unlock().expect("unlock"), Unlocked::Expired);
    assert_eq!(detached.unlock().expect("unlock"), Unlocked::Expired);

    let stolen = client.lock("stolen").expect("lock");
    let () = redis::cmd("SET")
        .arg(Keys::DEFAULT.lock("stolen"))
        .arg("another owner")
        .arg("PX")
        .arg(60_000)
        .query(&mut srv.conn())
        .expect("SET");
    assert_eq!(stolen.unlock().expect("unlock"), Unlocked::HeldByOther);
    // A hold known lost before its release is not counted again by it.
    let known = client.lock("known").expect("lock");
    delete(&srv, "known");
    assert!(known.extend(secs(60)).unwrap_err().is_lost());
    assert_eq!(known.unlock().expect("unlock"), Unlocked::Expired);

    let (stats, seen) = (client.stats(), values(snapshots));
    // The multi-lock lost two names: each is a lock.
    lost_counted(&stats, &seen, "deleted", 4 + 2 + 1);
    lost_counted(&stats, &seen, "stolen", 1);
    assert_eq!(stats.locks_lost, 8, "{stats:?}");
}

/// Holds of every kind alive when the client shuts down are told they are lost, each
/// counted once (`watchdog_failed`); the guards dropped afterwards take the gauge back
/// to 0, and their releases, which find the holds known lost, count nothing more.
#[test]
fn holds_alive_at_shutdown_leave_the_gauge_at_zero() {
    let (snapshots, _turn) = recorded();
    let srv = test_server();
    let client = lock_client!(node(srv.url()));
    let lock = client.lock("l").expect("lock");
    let read = client.rwlock("r").read().expect("read");
    let write = client.rwlock("w").write().expect("write");
    let permit = client.semaphore("p", 3).acquire().expect("permit");
    let multi = client.multi_lock(["m1", "m2"]).expect("multi");
    let detached = client.lock("d").expect("lock").detach();
    let counters = client.clone();
    client.shutdown(secs(5)).expect("shutdown");
    for lost in [lock.lost(), read.lost(), write.lost(), detached.lost()] {
        assert_eq!(lost.recv_timeout(secs(5)), Ok(LostReason::WatchdogFailed));
    }
    drop((lock, read, write, permit, multi, detached));

    let (stats, seen) = (counters.stats(), values(snapshots));
    nothing_held(&seen);
    lost_counted(&stats, &seen, "watchdog_failed", 7);
}

/// A panic in user code while guards of every kind are held: the guards are dropped as
/// the thread unwinds, and the gauge goes back to 0; each hold is timed once.
#[test]
fn a_panic_while_holding_leaves_the_gauge_at_zero() {
    let (snapshots, _turn) = recorded();
    let srv = test_server();
    let client = lock_client!(node(srv.url()));
    thread::scope(|s| {
        let panicked = s.spawn(|| {
            let _lock = client.lock("l").expect("lock");
            let _read = client.rwlock("r").read().expect("read");
            let _write = client.rwlock("w").write().expect("write");
            let _permit = client.semaphore("p", 1).acquire().expect("permit");
            let _multi = client.multi_lock(["m1", "m2"]).expect("multi");
            client.with_lock("inner", || panic!("user code fails while holding"))
        });
        assert!(panicked.join().is_err());
    });
    let (stats, seen) = (client.stats(), values(snapshots));
    nothing_held(&seen);
    assert_eq!(stats.remote_hold.count, 6, "{stats:?}");
    assert_eq!(stats.locks_lost, 0, "{stats:?}");
}

/// An unlock that fails because the server stalls consumes its guard: the hold is over
/// for the process (the gauge goes back to 0, its time is recorded) and the call is not
/// a timeout of a wait. Its lease then runs out unrenewed: no loss, the hold was given up.
#[test]
fn an_unlock_that_fails_on_a_stalled_server_ends_the_hold() {
    let (snapshots, _turn) = recorded();
    let srv = test_server();
    let client = lock_client!(node(srv.url()), io_timeouts(ms(200)), lease(ms(1500)));
    let lock = client.lock("l").expect("lock");
    let write = client.rwlock("w").write().expect("write");
    let permit = client.semaphore("p", 1).acquire().expect("permit");
    srv.pause();
    let failed = [lock.unlock(), write.unlock(), permit.unlock()];
    srv.resume();
    assert!(failed.iter().all(Result::is_err), "{failed:?}");
    thread::sleep(ms(1500));
    let (stats, seen) = (client.stats(), values(snapshots));
    nothing_held(&seen);
    assert_eq!(stats.remote_hold.count, 3, "{stats:?}");
    assert_eq!(stats.timeouts, 0, "{stats:?}");
    assert_eq!(
        stats.locks_lost, 0,
        "released holds are nobody's to lose: {stats:?}"
    );
}

/// Every call that returns `Error::Timeout` counts once in `timeouts` and has one wait
/// sample with `outcome="timeout"`, whatever it waited for and wherever it waited: in
/// Redis behind another client, or behind a holder of its own process.
#[test]
fn each_timed_out_call_counts_once() {
    let (snapshots, _turn) = recorded();
    let srv = test_server();
    let (client, other) = (lock_client!(node(srv.url())), lock_client!(node(srv.url())));
    let t = ms(60);
    let timed_out = |r: redbaton::Result<()>| assert!(r.unwrap_err().is_timeout());
    let upgradable = client.rwlock("u").upgradable_read().expect("upgradable");
    let _reader = other.rwlock("u").read().expect("read");
    let held = [
        other.lock("l").expect("lock").detach(),
        other.lock("m2").expect("lock").detach(),
    ];
    let _write = other.rwlock("rw").write().expect("write");
    let _permit = other.semaphore("p", 1).acquire().expect("permit");
    // In Redis, behind the other client.
    timed_out(client.try_lock_for("l", t).map(drop));
    timed_out(client.rwlock("rw").try_read_for(t).map(drop));
    timed_out(client.rwlock("rw").try_write_for(t).map(drop));
    timed_out(client.semaphore("p", 1).try_acquire_for(t).map(drop));
    timed_out(client.try_multi_lock_for(["m1", "m2"], t).map(drop));
    timed_out(client.latch("never", 1).wait_for(t));
    let upgrade = upgradable.try_upgrade_for(t);
    timed_out(upgrade.map(drop).map_err(|e| e.into_parts().1));
    let in_redis = 7;
    // Behind a holder of this process: queued locally.
    let mine = [client.rwlock("mine").write().expect("write")];
    let lock = client.lock("mine-l").expect("lock");
    let permit = client.semaphore("mine-p", 1).acquire().expect("permit");
    thread::scope(|s| {
        s.spawn(|| {
            timed_out(client.try_lock_for("mine-l", t).map(drop));
            timed_out(client.rwlock("mine").try_read_for(t).map(drop));
            timed_out(client.rwlock("mine").try_write_for(t).map(drop));
            timed_out(client.semaphore("mine-p", 1).try_acquire_for(t).map(drop));
        });
    });
    let locally = 4;
    drop((mine, lock, permit, held));

    let (stats, seen) = (client.stats(), values(snapshots));
    let calls = in_redis + locally;
    assert_eq!(stats.timeouts, calls, "{stats:?}");
    let samples = sum(&seen, "redbaton_acquire_wait_seconds", "timeout");
    assert_eq!(
        samples,
        (calls - 1) as f64,
        "every call but the latch's: {seen:?}"
    );
    assert_eq!(
        sum(&seen, "redbaton_timeouts_total", ""),
        (calls + other.stats().timeouts) as f64
    );
}

/// Replies lost on the way back (the command ran): the acquisition retried with its
/// token counts once, as one wait, with no failed attempt; the release retried after its
/// lost reply finds it made, and counts no loss.
#[test]
fn lost_replies_count_each_acquisition_once_and_no_loss() {
    let (snapshots, _turn) = recorded();
    let (_srv, proxy, client) = behind_a_proxy();
    drop(client.lock("warm").expect("lock"));
    let before = client.stats();
    for (name, rw) in [("l", false), ("w", true)] {
        let dropped = proxy.replies_dropped();
        proxy.drop_next_reply_matching(Keys::DEFAULT.lock(name).as_bytes());
        let rwlock = client.rwlock(name);
        let unlock: Box<dyn FnOnce() -> redbaton::Result<Unlocked>> = match rw {
            false => {
                let guard = client.lock(name).expect("lock");
                Box::new(move || guard.unlock())
            }
            true => {
                let guard = rwlock.write().expect("write");
                Box::new(move || guard.unlock())
            }
        };
        assert_eq!(proxy.replies_dropped(), dropped + 1, "{name}");
        proxy.drop_next_reply_matching(Keys::DEFAULT.lock(name).as_bytes());
        assert_eq!(unlock().expect("released"), Unlocked::Released);
        assert_eq!(proxy.replies_dropped(), dropped + 2, "{name}");
        proxy.heal();
    }
    let (after, seen) = (client.stats(), values(snapshots));
    let new = |f: fn(&Stats) -> u64| f(&after) - f(&before);
    assert_eq!(new(|s| s.remote_acquisitions), 2, "{after:?}");
    assert_eq!(new(|s| s.remote_wait.count), 2, "{after:?}");
    assert_eq!(new(|s| s.failed_attempts), 0, "{after:?}");
    assert_eq!(after.locks_lost, 0, "{after:?}");
    nothing_held(&seen);
}

/// An upgrade whose attempt was still unanswered at its deadline may have run: the call
/// returns the upgradable read lost (`Converted`), not a timeout, and is counted as what
/// it returned: an error, no timeout, one loss.
#[test]
fn an_upgrade_lost_at_its_deadline_is_counted_as_what_it_returned() {
    let (snapshots, _turn) = recorded();
    let (_srv, proxy, client) = behind_a_proxy();
    let upgradable = client.rwlock("u").upgradable_read().expect("upgradable");
    drop(values(snapshots));
    proxy.blackhole(true);
    let upgrade = upgradable.try_upgrade_for(ms(200));
    proxy.heal();
    let (guard, error) = upgrade.expect_err("no reply came").into_parts();
    assert!(
        matches!(error, redbaton::Error::Lost(LostReason::Converted)),
        "{error:?}"
    );
    drop(guard);
    let (stats, seen) = (client.stats(), values(snapshots));
    assert_eq!(
        sum(&seen, "redbaton_acquire_wait_seconds", "timeout"),
        0.0,
        "{seen:?}"
    );
    assert_eq!(
        sum(&seen, "redbaton_acquire_wait_seconds", "error"),
        1.0,
        "{seen:?}"
    );
    assert_eq!(stats.timeouts, 0, "{stats:?}");
    lost_counted(&stats, &seen, "converted", 1);
}

/// A wait that rides through a dead master (behind Sentinel) until its deadline is one
/// call: one timeout, one wait sample, however many times it was retried (each retry
/// counts in `failover_retries`).
#[test]
fn a_wait_riding_a_dead_master_counts_one_timeout() {
    let (snapshots, _turn) = recorded();
    let master = test_server();
    let sentinel = RedisServer::builder()
        .sentinel()
        .config(
            "sentinel",
            &format!("monitor m 127.0.0.1 {} 1", master.port()),
        )
        .config("sentinel", "down-after-milliseconds m 60000")
        .start();
    let client = lock_client!(sentinel("m", vec![sentinel.url()]), io_timeouts(ms(200)));
    drop(client.lock("warm").expect("lock"));
    master.kill();
    drop(values(snapshots));
    let before = client.stats();
    let waited = client.try_lock_for("x", ms(600));
    assert!(waited.unwrap_err().is_timeout());
    let (after, seen) = (client.stats(), values(snapshots));
    assert_eq!(after.timeouts - before.timeouts, 1, "{after:?}");
    assert_eq!(sum(&seen, "redbaton_timeouts_total", ""), 1.0, "{seen:?}");
    assert_eq!(
        sum(&seen, "redbaton_acquire_wait_seconds", ""),
        1.0,
        "{seen:?}"
    );
    let retries = after.failover_retries - before.failover_retries;
    assert!(retries > 1, "retried until the deadline: {after:?}");
    assert_eq!(sum(&seen, "redbaton_failovers_total", ""), 0.0, "{seen:?}");
}

/// A recorder that panics as a loss is counted (an exporter's bug), while the holder's
/// extend waits for the renewal in flight that finds the hold gone: the extend returns
/// all the same (it would wait for ever for a renewal never said to be over), the holder
/// is told, and its unlock returns.
#[test]
fn a_recorder_panicking_as_a_loss_is_counted_strands_no_extend() {
    let (_snapshots, _turn) = recorded();
    let srv = test_server();
    let client = lock_client!(node(srv.url()), lease(ms(900)));
    // The holder's thread (a guard stays on it): locks, then extends when told to.
    let (go, told) = mpsc::channel::<()>();
    let (tx, rx) = mpsc::channel();
    let holder = client.clone();
    thread::spawn(move || {
        let guard = holder.lock("failing").expect("lock");
        let _ = tx.send(Err(guard.lost().clone()));
        if told.recv().is_ok() {
            let extended = guard.extend(secs(5)).map_err(|e| e.is_lost());
            let _ = tx.send(Ok((extended, guard.unlock())));
        }
    });
    let Ok(Err(lost)) = rx.recv_timeout(secs(10)) else {
        panic!("no lock")
    };
    // The next renewal is caught before it is sent, marked as in flight.
    fault::stall(DEFAULT_PREFIX, Point::Watchdog);
    wait_for(secs(10), "a renewal starts", || {
        fault::stalled(DEFAULT_PREFIX, Point::Watchdog)
    });
    delete(&srv, "failing");
    FAIL_ON_LOSS.store(true, Ordering::SeqCst);
    go.send(()).expect("the holder waits");
    // The extend waits for the renewal in flight.
    thread::sleep(ms(300));
    fault::disarm(DEFAULT_PREFIX, Point::Watchdog);
    let ended = rx.recv_timeout(secs(10));
    assert!(
        !FAIL_ON_LOSS.load(Ordering::SeqCst),
        "the recorder never failed"
    );
    let Ok(Ok((extended, unlocked))) = ended else {
        panic!("the extend never returned: {ended:?}")
    };
    assert_eq!(extended, Err(true), "the extend finds the hold lost");
    assert_eq!(unlocked.expect("unlock"), Unlocked::Expired);
    assert_eq!(lost.recv_timeout(secs(5)), Ok(LostReason::Deleted));
}

/// A recorder that panics as the first hold is counted lost at `shutdown`: every other
/// hold is still told it is lost (nothing renews it any more), and the shutdown ends.
#[test]
fn a_recorder_panicking_at_shutdown_keeps_no_holder_from_being_told() {
    let (_snapshots, _turn) = recorded();
    let srv = test_server();
    let client = lock_client!(node(srv.url()));
    let guards: Vec<_> = ["a", "b", "c"]
        .iter()
        .map(|name| client.lock(name).expect("lock"))
        .collect();
    FAIL_ON_LOSS.store(true, Ordering::SeqCst);
    client.shutdown(secs(5)).expect("shutdown");
    assert!(
        !FAIL_ON_LOSS.load(Ordering::SeqCst),
        "the recorder never failed"
    );
    for guard in &guards {
        assert_eq!(
            guard.lost().recv_timeout(secs(5)),
            Ok(LostReason::WatchdogFailed)
        );
    }
}
