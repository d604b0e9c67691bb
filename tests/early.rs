//! Early attempts (`src/wake/early.rs`): the subscriber thread makes a waiting contender's next
//! acquire attempt the moment the key is freed. These tests drive each of its branches
//! against a real `redis-server`: the plain case, a server that forgot the script, a lost
//! reply (and its retry's), a waiter that gave up before the release (its armed attempt
//! must never go out), and the subscriber thread's panic while a waiter's attempt is in
//! flight (its outcome must reach the waiter). Bounds are generous liveness bounds. The fair queue is off here: with it, a
//! release grants the lock to the waiter directly and there is nothing to send early.

use std::thread;
use std::time::{Duration, Instant};

use crossbeam_channel::Receiver;
use redbaton::fault::{self, Point};
use redbaton::{LockClient, Stats, Unlocked};
use redbaton_testkit::keys::{FenceCount, Keys, fence_of};
use redbaton_testkit::ms;
use redbaton_testkit::proxy::Proxy;
use redbaton_testkit::secs;
use redbaton_testkit::server::RedisServer;
use redbaton_testkit::wait::wait_for;
use redbaton_testkit::{init_log, lock_client};

/// The lock key of `name` under `prefix`.
fn get(srv: &RedisServer, key: &str) -> Option<String> {
    redis::cmd("GET").arg(key).query(&mut srv.conn()).unwrap()
}

fn client(url: &str) -> LockClient {
    lock_client!(node(url), lease(secs(30)), fair(false))
}

/// A thread of `c` waiting in `lock(name)`; reports the fence it got, after unlocking.
fn spawn_waiter(c: &LockClient, name: &str) -> Receiver<Result<u64, String>> {
    let (tx, rx) = crossbeam_channel::bounded(1);
    let (c, name) = (c.clone(), name.to_owned());
    thread::spawn(move || {
        let r = c.lock(&name).map_err(|e| e.to_string()).and_then(|g| {
            let fence = g.fencing_token();
            match g.unlock() {
                Ok(Unlocked::Released) => Ok(fence),
                other => Err(format!("unlock: {other:?}")),
            }
        });
        let _ = tx.send(r);
    });
    rx
}

/// Waits until `c`'s contender has failed twice (before and after its subscription was
/// confirmed), then a little longer, so that it sleeps with its next attempt armed.
fn wait_armed(c: &LockClient) {
    wait_for(secs(10), "the waiter to block", || {
        c.stats().failed_attempts >= 2
    });
    thread::sleep(ms(300));
}

/// Holds `name` with `holder`, lets a waiter of `waiter` arm, runs `fault`, releases, and
/// returns (the holder's fence, the waiter's fence).
fn handoff(
    holder: &LockClient,
    waiter: &LockClient,
    name: &str,
    fault: impl FnOnce(),
) -> (u64, u64) {
    let guard = holder.lock(name).expect("holder lock");
    let held = guard.fencing_token();
    let rx = spawn_waiter(waiter, name);
    wait_armed(waiter);
    fault();
    assert_eq!(guard.unlock().unwrap(), Unlocked::Released);
    let got = rx
        .recv_timeout(secs(20))
        .expect("waiter hung")
        .expect("waiter failed");
    (held, got)
}

/// [`handoff`] of `name` on `srv`, checked for what every handoff here promises: the
/// waiter's fence comes after the holder's, each holder took one fence (a retry with the
/// same token takes none), the waiter made one early attempt, and no lock key is left.
/// Returns the waiter's fence and stats.
fn checked_handoff(
    srv: &RedisServer,
    (holder, waiter): (&LockClient, &LockClient),
    name: &str,
    fault: impl FnOnce(),
) -> (u64, Stats) {
    let fences = FenceCount::start(srv);
    let (held, got) = handoff(holder, waiter, name, fault);
    let s = waiter.stats();
    eprintln!("{name}: {s:?}");
    assert!(got > held, "{got:#x} after {held:#x}: {s:?}");
    assert_eq!(fences.issued(), 2, "one fence for each holder: {s:?}");
    assert_eq!(s.early_attempts, 1, "{s:?}");
    let key = format!("redbaton:{{{name}}}");
    assert!(srv.keys(&key).is_empty(), "lock key left");
    (got, s)
}

#[test]
fn smoke() {
    let srv = RedisServer::start();
    let (holder, waiter) = (client(&srv.url()), client(&srv.url()));
    let (_, s) = checked_handoff(&srv, (&holder, &waiter), "smoke", || {});
    assert_eq!(s.remote_acquisitions, 1, "{s:?}");
}

/// The server lost its scripts (`SCRIPT FLUSH`, as after a restart) while the attempt was
/// armed: the early call gets NOSCRIPT and the contender makes it again, loading the script.
#[test]
fn noscript_reply_is_retried() {
    let srv = RedisServer::start();
    let (holder, waiter) = (client(&srv.url()), client(&srv.url()));
    // The holder's release reloads the release script; the waiter's early acquire then
    // still meets a server without the acquire script.
    checked_handoff(&srv, (&holder, &waiter), "noscript", || {
        redis::cmd("SCRIPT")
            .arg("FLUSH")
            .query::<()>(&mut srv.conn())
            .expect("SCRIPT FLUSH");
    });
}

/// The early attempt ran in Redis but its reply was lost (the connection closed): the
/// contender retries with the same token and gets the first attempt's fence: one lock, no
/// second fence step.
#[test]
fn lost_early_reply_returns_the_first_fence() {
    let srv = RedisServer::start();
    let proxy = Proxy::start(srv.addr());
    let holder = client(&srv.url());
    let waiter = client(&proxy.url());
    let (got, _) = checked_handoff(&srv, (&holder, &waiter), "lost-reply", || {
        proxy.drop_next_reply_matching(b"EVALSHA");
    });
    assert_eq!(proxy.replies_dropped(), 1, "the fault did not fire");
    let fence: u64 = redis::cmd("GET")
        .arg("redbaton:{lost-reply}:fence")
        .query(&mut srv.conn())
        .unwrap();
    assert_eq!(
        fence,
        fence_of(got),
        "the counter moved after the waiter's fence"
    );
}

/// A waiter that timed out took its armed attempt back: the release that follows takes
/// nothing on its behalf (no stray lock for the lease's 30 s).
#[test]
fn timed_out_waiter_leaves_no_armed_attempt() {
    let srv = RedisServer::start();
    let (holder, waiter) = (client(&srv.url()), client(&srv.url()));
    let guard = holder.lock("gave-up").expect("holder lock");
    let err = waiter
        .try_lock_for("gave-up", ms(400))
        .expect_err("the lock is held");
    assert!(err.is_timeout(), "{err}");
    assert_eq!(guard.unlock().unwrap(), Unlocked::Released);
    thread::sleep(ms(300));
    let s = waiter.stats();
    assert_eq!(s.early_attempts, 0, "{s:?}");
    assert!(
        srv.keys("redbaton:{gave-up}").is_empty(),
        "someone holds the key after its only waiter gave up"
    );
    let again = holder.try_lock("gave-up").expect("free again");
    drop(again);
}

/// Several threads of one process waiting in Redis on one key (local handoff off): one of
/// them is armed, the others are woken as usual; every section runs once.
#[test]
fn many_contenders_one_armed() {
    let srv = RedisServer::start();
    let holder = client(&srv.url());
    let waiter = lock_client!(node(srv.url()), lease(secs(30)), local_handoff(false));
    let guard = holder.lock("many").expect("holder lock");
    let waiters: Vec<_> = (0..6).map(|_| spawn_waiter(&waiter, "many")).collect();
    // Each waiter fails at least once (see `wakeup.rs`, idle waiters).
    wait_for(secs(10), "every waiter to block", || {
        waiter.stats().failed_attempts >= 6
    });
    thread::sleep(ms(300));
    assert_eq!(guard.unlock().unwrap(), Unlocked::Released);
    let mut fences: Vec<u64> = waiters
        .iter()
        .map(|rx| {
            rx.recv_timeout(secs(30))
                .expect("waiter hung")
                .expect("waiter failed")
        })
        .collect();
    fences.sort_unstable();
    fences.dedup();
    assert_eq!(fences.len(), 6, "two holders shared a fence");
    let s = waiter.stats();
    eprintln!("6 contenders: {s:?}");
    assert!(s.early_attempts >= 1, "{s:?}");
    assert!(srv.keys("redbaton:{many}").is_empty(), "lock key left");
}

/// A lock held by a client on `srv` directly, and a waiter of `waiter` (a client through
/// `proxy`, a 30 s lease, a 6 s read timeout) sleeping with its early attempt armed, waiting
/// at most `wait` in `try_lock_for`: the holder's guard and token, and what the waiter's
/// call returns (its fencing token) and how long it took.
struct Armed {
    srv: RedisServer,
    proxy: Proxy,
    waiter: LockClient,
    guard: redbaton::LockGuard,
    token: String,
    key: String,
    rx: Receiver<(redbaton::Result<u64>, Duration)>,
}

fn armed_waiter(prefix: &'static str, wait: Duration) -> Armed {
    init_log();
    let srv = RedisServer::start();
    let proxy = Proxy::start(srv.addr());
    let waiter = lock_client!(
        node(proxy.url()),
        key_prefix(prefix),
        fair(false),
        lease(secs(30)),
        read_timeout(secs(6)),
        recheck_interval(secs(60))
    );
    let holder = lock_client!(
        node(srv.url()),
        key_prefix(prefix),
        fair(false),
        lease(secs(30))
    );
    let key = Keys::new(prefix).lock("k");
    let guard = holder.lock("k").unwrap();
    let token = get(&srv, &key).expect("held");
    let (tx, rx) = crossbeam_channel::bounded(1);
    let c = waiter.clone();
    thread::spawn(move || {
        let t = Instant::now();
        let r = c.try_lock_for("k", wait).map(|g| g.fencing_token());
        let _ = tx.send((r, t.elapsed()));
    });
    wait_armed(&waiter);
    Armed {
        srv,
        proxy,
        waiter,
        guard,
        token,
        key,
        rx,
    }
}

/// The subscriber thread panics while the waiter that reads its connection is in the middle
/// of its own early attempt, whose reply is slow (longer than the restarted thread waits for
/// the connection back, 1 s). The attempt ran in Redis and took the lock with its token.
///
/// The waiter stores the attempt's outcome when its reply comes, and its contender takes
/// the lock it won: not a fresh attempt with a new token, which would find the key held
/// by the attempt nobody owns and sleep until its 30 s lease ran out.
#[test]
fn early_attempt_in_flight_when_the_subscriber_crashes() {
    const P: &str = "early-crash:";
    let a = armed_waiter(P, secs(15));

    // Every reply (and pub/sub message) to the waiter's process now takes 3 s.
    a.proxy.set_delay(secs(3));
    a.guard.unlock().unwrap();
    // The release's event reaches the waiter 3 s later; it fires its early attempt, which
    // runs in Redis at once (its reply takes 3 s more).
    wait_for(secs(10), "the early attempt ran in Redis", || {
        get(&a.srv, &a.key).is_some_and(|t| t != a.token)
    });
    let early_token = get(&a.srv, &a.key).unwrap();
    eprintln!("early attempt's token in the key: {early_token}");
    // The subscriber thread (parked: the waiter reads) panics at its next look.
    fault::arm(P, Point::Subscriber, 1);
    wait_for(secs(10), "the subscriber thread's crash", || {
        a.waiter.subscribers().iter().all(|s| !s.connected)
    });
    fault::disarm(P, Point::Subscriber);
    // The restarted thread connects at full speed (the early reply keeps its 3 s).
    a.proxy.set_delay(Duration::ZERO);

    let (r, took) = a.rx.recv_timeout(secs(30)).expect("the waiter returns");
    let s = a.waiter.stats();
    eprintln!("waiter: {r:?} after {took:?}; {s:?}");
    let left = get(&a.srv, &a.key);
    eprintln!(
        "key after the waiter returned: {left:?} (pttl {} ms)",
        redbaton_testkit::pttl(&mut a.srv.conn(), &a.key)
    );
    assert!(
        r.is_ok(),
        "the waiter's early attempt took the lock, yet the waiter did not get it: {r:?}; \
         key {} still held by {left:?} (the early attempt's token was {early_token})",
        a.key
    );
}

/// Every reply to the waiter's scripts is lost while the key is freed: its early attempt
/// runs in Redis (it takes the lock with its token) but its reply is lost, and so is the
/// same-token retry's. The wait ends with an error, and the lock its attempt took is given
/// back once the link heals, not left held by nobody for the 30 s lease.
#[test]
fn early_attempt_and_its_retry_unanswered_leave_no_stray_lock() {
    const P: &str = "early-lost:";
    let a = armed_waiter(P, secs(8));
    let (r, _) = a.proxy.losing_replies_matching(b"EVALSHA", || {
        a.guard.unlock().unwrap();
        wait_for(secs(10), "the early attempt ran in Redis", || {
            get(&a.srv, &a.key).is_some_and(|t| t != a.token)
        });
        a.rx.recv_timeout(secs(30)).expect("the waiter returns")
    });
    let s = a.waiter.stats();
    eprintln!(
        "waiter: {r:?}; {s:?}; dropped {}",
        a.proxy.replies_dropped()
    );
    if r.is_ok() {
        return; // it learnt the outcome after all: the lock was its own
    }
    wait_for(secs(10), "the unanswered attempt's lock given back", || {
        get(&a.srv, &a.key).is_none()
    });
    drop(a.waiter.try_lock("k").expect("free again"));
}
