//! The `metrics` feature against a real `redis-server`: after a contended run (threads on
//! one lock, a read-write lock, a semaphore, a refused and a timed-out call) the recorder
//! holds the documented names and labels (docs/guide.md, "Metrics"), with values that
//! agree with the client's `Stats`; a call given a token cancelled already records its
//! wait; the held gauge returns to zero however a hold ends.
//!
//! The tests share one process-wide recorder, and so the process-wide gauge: they run one
//! at a time, each from a snapshot that resets the recorder (see [`recorder`]).

#![cfg(feature = "metrics")]

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::thread;
use std::time::Duration;

use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use metrics_util::{CompositeKey, MetricKind};
use redbaton::{Cancel, LockClient, LockGuard, LostReason, Stats};
use redbaton_testkit::keys::Keys;
use redbaton_testkit::server::RedisServer;
use redbaton_testkit::{lock_client, ms, test_server};

/// One metric: kind, name and labels (sorted), as the table in the guide lists them.
type Id = (MetricKind, String, Vec<(String, String)>);

fn id(key: &CompositeKey) -> Id {
    let mut labels: Vec<(String, String)> = key
        .key()
        .labels()
        .map(|l| (l.key().to_owned(), l.value().to_owned()))
        .collect();
    labels.sort();
    (key.kind(), key.key().name().to_owned(), labels)
}

fn labels(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    let mut v: Vec<_> = pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    v.sort();
    v
}

struct Seen(HashMap<Id, DebugValue>);

impl Seen {
    /// What the recorder holds now (the snapshot resets it, see [`recorder`]).
    fn take(s: &Snapshotter) -> Seen {
        Seen(
            s.snapshot()
                .into_vec()
                .into_iter()
                .map(|(k, _, _, v)| (id(&k), v))
                .collect(),
        )
    }

    fn get(&self, kind: MetricKind, name: &str, pairs: &[(&str, &str)]) -> Option<&DebugValue> {
        self.0.get(&(kind, name.to_owned(), labels(pairs)))
    }

    fn counter(&self, name: &str, pairs: &[(&str, &str)]) -> u64 {
        match self.get(MetricKind::Counter, name, pairs) {
            Some(DebugValue::Counter(n)) => *n,
            None => 0,
            Some(v) => panic!("{name} {pairs:?}: not a counter: {v:?}"),
        }
    }

    fn gauge(&self, name: &str, pairs: &[(&str, &str)]) -> Option<f64> {
        match self.get(MetricKind::Gauge, name, pairs) {
            Some(DebugValue::Gauge(g)) => Some(g.into_inner()),
            None => None,
            Some(v) => panic!("{name} {pairs:?}: not a gauge: {v:?}"),
        }
    }

    fn histogram(&self, name: &str, pairs: &[(&str, &str)]) -> Vec<f64> {
        match self.get(MetricKind::Histogram, name, pairs) {
            Some(DebugValue::Histogram(v)) => v.iter().map(|f| f.into_inner()).collect(),
            None => Vec::new(),
            Some(v) => panic!("{name} {pairs:?}: not a histogram: {v:?}"),
        }
    }

    /// The samples of `name` over every label set whose `label` is `value`.
    fn samples_where(&self, name: &str, label: &str, value: &str) -> usize {
        self.0
            .iter()
            .filter(|((_, n, ls), _)| n == name && ls.iter().any(|(k, v)| k == label && v == value))
            .map(|(_, v)| match v {
                DebugValue::Histogram(xs) => xs.len(),
                _ => 0,
            })
            .sum()
    }
}

/// A counter of `Stats`.
type Field = fn(&Stats) -> u64;

const WAIT: &str = "redbaton_acquire_wait_seconds";
const HOLD: &str = "redbaton_hold_seconds";
const HELD: &str = "redbaton_locks_held";

/// The one recorder of this test binary, and the lock that runs its tests one at a time:
/// each starts from zero (the debugging recorder's snapshot swaps counters and gauges to
/// 0 and drains histograms).
fn recorder() -> (&'static Snapshotter, MutexGuard<'static, ()>) {
    static SNAP: OnceLock<Snapshotter> = OnceLock::new();
    static SERIAL: Mutex<()> = Mutex::new(());
    let serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let snap = SNAP.get_or_init(|| {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        recorder
            .install()
            .expect("the only recorder of this test binary");
        snapshotter
    });
    let _ = snap.snapshot();
    (snap, serial)
}

fn contend(client: &LockClient, threads: usize, rounds: usize) {
    thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                for _ in 0..rounds {
                    let guard = client.lock("m").expect("lock");
                    thread::yield_now();
                    guard.unlock().expect("unlock");
                }
            });
        }
    });
}

/// A `try_lock` refused and a 20 ms `try_lock_for` timed out on `name`, held by another
/// thread.
fn refused_and_timed_out(client: &LockClient, name: &str) {
    assert!(client.try_lock(name).unwrap_err().is_would_block());
    assert!(client.try_lock_for(name, ms(20)).unwrap_err().is_timeout());
}

/// Deletes the key of the lock `name` behind its holder's back, and drops `guard` once it
/// was told the lock is lost.
fn lose(srv: &RedisServer, name: &str, guard: LockGuard) {
    let deleted: i64 = redis::cmd("DEL")
        .arg(Keys::DEFAULT.lock(name))
        .query(&mut srv.conn())
        .expect("DEL");
    assert_eq!(deleted, 1);
    let reason = guard.lost().recv_timeout(Duration::from_secs(30));
    assert_eq!(reason, Ok(LostReason::Deleted));
}

#[test]
fn names_labels_and_values_after_a_contended_run() {
    let (snapshotter, _serial) = recorder();
    let srv = test_server();
    let client = lock_client!(node(srv.url()));

    contend(&client, 4, 25);

    // Refused and timed out while another thread holds the lock.
    let guard = client.lock("m").expect("lock");
    thread::scope(|s| {
        s.spawn(|| refused_and_timed_out(&client, "m"));
    });
    drop(guard);

    // A read and a write hold, and a permit.
    let rw = client.rwlock("rw");
    drop(rw.read().expect("read"));
    drop(rw.write().expect("write"));
    drop(client.semaphore("sem", 2).acquire().expect("permit"));

    // A lock lost while held: its key deleted behind the holder's back (a second client,
    // whose short lease gets renewed, and so checked, soon).
    let short = lock_client!(node(srv.url()), lease(ms(900)), renew_interval(ms(300)));
    lose(&srv, "gone", short.lock("gone").expect("lock"));

    let (a, b) = (client.stats(), short.stats());
    let both = |f: Field| f(&a) + f(&b);
    let seen = Seen::take(snapshotter);

    // No label names the lock (unbounded cardinality), and every name is the crate's.
    for (_, name, ls) in seen.0.keys() {
        assert!(name.starts_with("redbaton_"), "{name}");
        assert!(ls.iter().all(|(k, _)| k != "name"), "{name} {ls:?}");
    }

    // Waits: every successful call, by how it got the hold, and the two failed ones.
    let lock_remote = seen.histogram(WAIT, &[("kind", "lock"), ("outcome", "remote")]);
    let lock_handoff = seen.histogram(WAIT, &[("kind", "lock"), ("outcome", "handoff")]);
    assert_eq!(
        lock_remote.len() + lock_handoff.len(),
        4 * 25 + 2,
        "every lock call that returned a guard"
    );
    assert!(
        !lock_handoff.is_empty(),
        "contended threads hand the lock on"
    );
    assert!(
        lock_remote
            .iter()
            .chain(&lock_handoff)
            .all(|s| (0.0..60.0).contains(s))
    );
    let failed = |outcome| seen.histogram(WAIT, &[("kind", "lock"), ("outcome", outcome)]);
    assert_eq!(failed("would_block").len(), 1);
    let timed_out = failed("timeout");
    assert_eq!(timed_out.len(), 1);
    assert!(timed_out[0] >= 0.020, "waited its 20 ms: {timed_out:?}");
    for kind in ["read", "write", "permit"] {
        let n = seen
            .histogram(WAIT, &[("kind", kind), ("outcome", "remote")])
            .len();
        assert_eq!(n, 1, "{kind}");
    }

    // Holds: one per guard let go, by how it was got; nothing held now.
    let holds = |path| {
        seen.histogram(HOLD, &[("kind", "lock"), ("path", path)])
            .len()
    };
    assert_eq!(holds("remote"), lock_remote.len());
    assert_eq!(holds("handoff"), lock_handoff.len());
    // Each summary of `Stats` counts the samples of its histograms over every kind.
    let summaries: [(_, _, _, Field); 4] = [
        (WAIT, "outcome", "remote", |s| s.remote_wait.count),
        (WAIT, "outcome", "handoff", |s| s.handoff_wait.count),
        (HOLD, "path", "remote", |s| s.remote_hold.count),
        (HOLD, "path", "handoff", |s| s.handoff_hold.count),
    ];
    for (name, label, value, count) in summaries {
        let n = seen.samples_where(name, label, value) as u64;
        assert_eq!(n, both(count), "{name} {label}={value}");
    }
    for kind in ["lock", "read", "write", "permit"] {
        assert_eq!(seen.gauge(HELD, &[("kind", kind)]), Some(0.0), "{kind}");
    }

    // Counters agree with `Stats`.
    assert_eq!(
        seen.counter("redbaton_remote_acquisitions_total", &[]),
        both(|s| s.remote_acquisitions)
    );
    assert_eq!(
        seen.counter("redbaton_handoffs_total", &[]),
        both(|s| s.local_handoffs)
    );
    assert_eq!(seen.counter("redbaton_timeouts_total", &[]), 1);
    assert_eq!(both(|s| s.timeouts), 1);
    assert!(seen.counter("redbaton_commands_total", &[]) > 0);
    let wakeups: u64 = ["event", "lease", "recheck", "poll", "reconnect", "moved"]
        .iter()
        .map(|cause| seen.counter("redbaton_wakeups_total", &[("cause", cause)]))
        .sum();
    assert_eq!(
        wakeups,
        both(|s| s.wakeups_event
            + s.wakeups_lease
            + s.wakeups_recheck
            + s.wakeups_poll
            + s.wakeups_reconnect
            + s.wakeups_moved)
    );
    assert_eq!(both(|s| s.locks_lost), 1);
    assert_eq!(
        seen.counter("redbaton_lost_total", &[("reason", "deleted")]),
        1
    );
    assert_eq!(
        seen.counter("redbaton_lost_total", &[("reason", "expired")]),
        0
    );
}

/// A call for a hold given a token cancelled already returns `Cancelled` at once, and its
/// wait is recorded as any other call's that failed: `outcome="error"`, under its kind
/// (a multi-lock's is `lock`, an upgradable read's `read`).
#[test]
fn a_call_made_already_cancelled_records_its_wait_as_an_error() {
    let (snap, _serial) = recorder();
    let srv = test_server();
    let client = lock_client!(node(srv.url()));
    let cancel = Cancel::new();
    cancel.cancel();
    let rw = client.rwlock("rw");
    let before = client.stats().commands;
    let calls = [
        client.lock_cancellable("pre", &cancel).map(drop),
        client.multi_lock_cancellable(["a", "b"], &cancel).map(drop),
        rw.read_cancellable(&cancel).map(drop),
        rw.upgradable_read_cancellable(&cancel).map(drop),
        rw.write_cancellable(&cancel).map(drop),
        client
            .semaphore("sem", 1)
            .acquire_cancellable(&cancel)
            .map(drop),
    ];
    for r in calls {
        assert!(r.unwrap_err().is_cancelled());
    }
    let seen = Seen::take(snap);
    for (kind, calls) in [("lock", 2), ("read", 2), ("write", 1), ("permit", 1)] {
        let errors = seen.histogram(WAIT, &[("kind", kind), ("outcome", "error")]);
        assert_eq!(errors.len(), calls, "{kind}: one wait sample per call");
    }
    assert_eq!(client.stats().commands, before, "nothing sent");
}

/// `redbaton_locks_held` returns to 0 for every way a hold ends besides a plain unlock or
/// drop: a detached lock and a detached write hold released from another thread, a
/// multi-lock, an upgrade and a downgrade, a local baton handoff, a refused `try_lock`, a
/// timed-out and a cancelled wait, a permit, a shared read held twice by one thread, and
/// a lock whose key was deleted (lost) before its guard was dropped.
#[test]
fn the_held_gauge_returns_to_zero_after_every_way_a_hold_ends() {
    let (snap, _serial) = recorder();
    let srv = test_server();
    let client = lock_client!(node(srv.url()), lease(ms(900)), renew_interval(ms(300)));

    // Detached lock, released on another thread.
    let d = client.lock("det").expect("lock").detach();
    thread::spawn(move || d.unlock().expect("unlock"))
        .join()
        .expect("join");
    // Detached write hold, dropped on another thread.
    let rw = client.rwlock("rw");
    let dw = rw.write().expect("write").detach();
    thread::spawn(move || drop(dw)).join().expect("join");
    // Multi-lock.
    client
        .multi_lock(["m1", "m2"])
        .expect("multi")
        .unlock()
        .expect("unlock");
    // Upgrade, then downgrade, then drop.
    let up = rw.upgradable_read().expect("upgradable");
    let w = up.upgrade().expect("upgrade");
    let r = w.downgrade().expect("downgrade");
    // A second read of the same thread shares it.
    let r2 = rw.read().expect("reentrant read");
    drop(r2);
    drop(r);
    // Baton: a local waiter gets the lock from the holder.
    let g = client.lock("baton").expect("lock");
    thread::scope(|s| {
        let w = s.spawn(|| client.lock("baton").expect("handoff").unlock());
        thread::sleep(ms(100));
        drop(g);
        w.join().expect("join").expect("unlock");
    });
    // Refused, timed out and cancelled calls while another thread holds.
    let g = client.lock("busy").expect("lock");
    thread::scope(|s| {
        s.spawn(|| {
            refused_and_timed_out(&client, "busy");
            let cancel = Cancel::new();
            thread::scope(|s2| {
                let c = s2.spawn(|| client.lock_cancellable("busy", &cancel).map(drop));
                thread::sleep(ms(50));
                cancel.cancel();
                assert!(c.join().expect("join").unwrap_err().is_cancelled());
            });
        });
    });
    drop(g);
    // A permit.
    client
        .semaphore("sem", 1)
        .acquire()
        .expect("permit")
        .unlock()
        .expect("unlock");
    // A lock lost (its key deleted) while held, then dropped.
    lose(&srv, "gone", client.lock("gone").expect("lock"));

    let seen = Seen::take(snap);
    for kind in ["lock", "read", "write", "permit"] {
        assert_eq!(seen.gauge(HELD, &[("kind", kind)]), Some(0.0), "{kind}");
    }
}
