//! Faults: what the lock does when Redis, the network or a holder process misbehaves.
//!
//! * Unit-sized tests: the server killed while a lock is held, down at `build()`, stopped or
//!   paused mid-run. Each must end in a typed error (or a lost signal) within the configured
//!   timeouts — never a hang, never a panic — and the client must recover when the server
//!   comes back.
//! * [`chaos`]: several child processes contend for a few keys while the parent injects
//!   faults at random (seeded; the seed is printed). Every critical section writes through a
//!   fenced storage (a Lua script on a separate redis-server). Checked: mutual exclusion of
//!   the sections whose holder still held the lock at their end, strictly increasing tokens
//!   of the accepted writes, the fencing storage never seeing one token from two holders,
//!   every `try_lock_for` returning by its deadline plus a margin, no hung thread or
//!   process, no lock key left at the end.

use std::collections::{BTreeMap, HashMap};
use std::process::Child;
use std::sync::{Arc, Mutex, mpsc};
use std::thread;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use redbaton::{Error, LockClient, LostReason, Unlocked};
use redbaton_testkit::child;
use redbaton_testkit::clock::wall_us;
use redbaton_testkit::keys::fence_of;
use redbaton_testkit::proxy::Proxy;
use redbaton_testkit::server::RedisServer;
use redbaton_testkit::wait::eventually;
use redbaton_testkit::{init_log, ms};

/// Short leases so that every fault resolves within about a second.
const LEASE: Duration = Duration::from_secs(1);
const RENEW: Duration = Duration::from_millis(300);
/// Connect / read / write timeout of the clients under test.
const NET: Duration = Duration::from_millis(300);

fn fast_builder(url: &str) -> redbaton::Builder {
    LockClient::builder()
        .node(url)
        .lease(LEASE)
        .renew_interval(RENEW)
        .connect_timeout(NET)
        .read_timeout(NET)
        .write_timeout(NET)
}

fn fast_client(url: &str) -> LockClient {
    fast_builder(url).build().expect("build")
}

#[test]
fn smoke() {
    init_log();
    let srv = RedisServer::start();
    let c = fast_client(&srv.url());
    let g = c.lock("smoke").expect("lock");
    assert!(!g.is_lost());
    assert_eq!(g.unlock().unwrap(), Unlocked::Released);
}

// --- unit-sized faults ---------------------------------------------------------------------

#[test]
fn server_killed_mid_hold_then_recovers() {
    let srv = RedisServer::start();
    let c = fast_client(&srv.url());
    let g = c.lock("k").expect("lock");
    let first_token = g.fencing_token();

    srv.kill();
    let killed = Instant::now();
    // Renewals fail for network reasons until the validity deadline: then the holder is told.
    let reason = g
        .lost()
        .recv_timeout(LEASE + Duration::from_secs(3))
        .expect("the holder is told the lock is lost");
    eprintln!("told lost ({reason}) {:?} after the kill", killed.elapsed());
    assert_eq!(reason, LostReason::Expired);
    assert!(g.is_lost());
    assert!(matches!(g.check(), Err(Error::Lost(LostReason::Expired))));
    assert!(c.stats().renewals_failed > 0);

    // While the server is down: typed connection errors, quickly.
    for what in ["try_lock", "try_lock_for", "lock"] {
        let started = Instant::now();
        let e = match what {
            "try_lock" => c.try_lock("other").map(drop),
            "try_lock_for" => c.try_lock_for("other", Duration::from_secs(5)).map(drop),
            _ => c.lock("other").map(drop),
        }
        .expect_err("server down");
        assert!(e.is_connection(), "{what}: {e:?}");
        assert!(matches!(e, Error::Redis(_)), "{what}: {e:?}");
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{what}: {:?}",
            started.elapsed()
        );
    }

    srv.restart();
    // The lost guard releases without fuss: its key went with the old process.
    assert_eq!(
        g.unlock().expect("release after restart"),
        Unlocked::Expired
    );
    // New locks work (the pool dropped its dead connections), and keep being renewed.
    let g = eventually(Duration::from_secs(5), || c.try_lock("k").ok())
        .expect("the client recovers after the restart");
    thread::sleep(LEASE + ms(300));
    g.check().expect("renewed on the new server");
    // The fence counter restarted with the server: tokens are only monotonic while the
    // counter key survives (documented; the chaos test treats restarts as epochs).
    eprintln!(
        "token before restart {first_token}, after {}",
        g.fencing_token()
    );
    assert_eq!(g.unlock().unwrap(), Unlocked::Released);
    assert!(srv.keys("redbaton:{k}").is_empty());
}

#[test]
fn server_down_at_build_is_a_connection_error() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let started = Instant::now();
    let e = fast_builder(&format!("redis://127.0.0.1:{port}/"))
        .build()
        .expect_err("refused");
    assert!(e.is_connection(), "{e:?}");
    assert!(started.elapsed() < Duration::from_secs(3));

    // A paused server accepts the TCP connection but never answers: a timeout, typed too.
    let srv = RedisServer::start();
    srv.pause();
    let started = Instant::now();
    let e = fast_builder(&srv.url()).build().expect_err("paused");
    let took = started.elapsed();
    srv.resume();
    eprintln!("build against a paused server failed after {took:?}: {e}");
    assert!(e.is_connection(), "{e:?}");
    assert!(took < Duration::from_secs(5), "{took:?}");
}

#[test]
fn server_stopped_mid_run_is_a_connection_error_not_a_hang() {
    let srv = RedisServer::start();
    let holder = LockClient::builder()
        .node(srv.url())
        .lease(Duration::from_secs(30))
        .build()
        .unwrap();
    let c = fast_client(&srv.url());
    let g = holder.lock("k").unwrap();
    // A waiter blocked in lock() (no deadline) when the server goes away.
    let waiter = {
        let c = c.clone();
        thread::spawn(move || {
            let r = c.lock("k").map(drop);
            (r, Instant::now())
        })
    };
    thread::sleep(ms(400));
    assert!(!waiter.is_finished(), "the waiter waits");
    srv.stop();
    let stopped = Instant::now();
    let (r, at) = {
        let deadline = Instant::now() + Duration::from_secs(15);
        while !waiter.is_finished() {
            assert!(
                Instant::now() < deadline,
                "lock() hangs with the server down"
            );
            thread::sleep(ms(20));
        }
        waiter.join().unwrap()
    };
    let e = r.expect_err("server down");
    eprintln!("waiter in lock() got {e} {:?} after the stop", at - stopped);
    assert!(e.is_connection(), "{e:?}");
    drop(g); // release fails (server down): logged, no panic

    // A fresh call fails within the connect timeout (plus retries), not later.
    let started = Instant::now();
    let e = c.lock("x").map(drop).expect_err("down");
    assert!(e.is_connection(), "{e:?}");
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
}

#[test]
fn server_paused_mid_run_times_out_as_a_connection_error() {
    let srv = RedisServer::start();
    let c = fast_client(&srv.url());
    drop(c.lock("p").unwrap());
    srv.pause();
    let started = Instant::now();
    let r = c.lock("p").map(drop);
    let took = started.elapsed();
    srv.resume();
    let e = r.expect_err("paused");
    eprintln!("lock() on a paused server: {e} after {took:?}");
    assert!(e.is_connection(), "{e:?}");
    // Each attempt is bounded by the connect and read timeouts (300 ms here); the acquire
    // retries twice and then cleans up. Generous bound: 20 × 300 ms.
    assert!(took < NET * 20, "{took:?}");
    // And the client works again once the server answers.
    let g = eventually(Duration::from_secs(5), || c.try_lock("p").ok()).expect("recovers");
    drop(g);
}

/// How long after the release a waiter in another client got the lock.
fn wake_latency(holder: &LockClient, waiter: LockClient, name: &str) -> Duration {
    let guard = holder.lock(name).expect("holder locks");
    let n = name.to_owned();
    let t = thread::spawn(move || {
        let g = waiter.try_lock_for(&n, Duration::from_secs(20));
        let at = Instant::now();
        g.map(|g| {
            drop(g);
            at
        })
    });
    thread::sleep(ms(400));
    assert!(!t.is_finished(), "the waiter did not wait");
    let released = Instant::now();
    assert_eq!(guard.unlock().unwrap(), Unlocked::Released);
    let at = t.join().unwrap().expect("waiter acquires");
    at.saturating_duration_since(released)
}

/// Was a bug: a restart forgets the `CONFIG SET notify-keyspace-events` made at build, and
/// releases did not publish on the library channel then.
#[test]
fn waiters_still_woken_after_a_server_restart() {
    let srv = RedisServer::start();
    let event_only = || {
        LockClient::builder()
            .node(srv.url())
            .lease(Duration::from_secs(60))
            .recheck_interval(Duration::from_secs(60))
            .build()
            .unwrap()
    };
    let (holder, waiter) = (event_only(), event_only());
    let before = wake_latency(&holder, waiter.clone(), "r");
    assert!(before < Duration::from_secs(5), "{before:?}");
    srv.restart();
    drop(eventually(Duration::from_secs(5), || holder.try_lock("warm").ok()).expect("reconnects"));
    drop(eventually(Duration::from_secs(5), || waiter.try_lock("warm").ok()).expect("reconnects"));
    let after = wake_latency(&holder, waiter, "r");
    eprintln!("wake-up latency before the restart {before:?}, after {after:?}");
    assert!(after < Duration::from_secs(5), "waiter slept {after:?}");
}

/// Was a bug: the watchdog thread could run before `Arc::new_cyclic` finished building the
/// client, fail to upgrade its `Weak` and exit; that client never renewed.
#[test]
fn every_client_renews_its_locks() {
    // The race needs the new thread to run before `build()` returns: build many clients
    // at once so that the scheduler gets the chance.
    let srv = RedisServer::start();
    let url = srv.url();
    let lost: Vec<usize> = thread::scope(|s| {
        let handles: Vec<_> = (0..24)
            .map(|i| {
                let url = url.clone();
                s.spawn(move || {
                    let c = LockClient::builder()
                        .node(url)
                        .lease(ms(300))
                        .renew_interval(ms(100))
                        .build()
                        .unwrap();
                    let g = c.lock(format!("w{i}")).unwrap();
                    thread::sleep(ms(800));
                    (g.is_lost(), c.stats().renewals_sent)
                })
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .filter_map(|(i, h)| {
                let (lost, sent) = h.join().unwrap();
                (lost || sent == 0).then_some(i)
            })
            .collect()
    });
    assert!(lost.is_empty(), "clients that never renewed: {lost:?}");
}

// --- chaos -----------------------------------------------------------------------------------

const CHAOS_PREFIX: &str = "chaos:";
const CHAOS_KEYS: [&str; 2] = ["alpha", "beta"];
const CHAOS_PROCS: usize = 3;
const CHAOS_THREADS: usize = 3;
/// Faults are injected for this long; then a calm period longer than a lease.
const CHAOS_FOR: Duration = Duration::from_secs(40);
const CALM: Duration = Duration::from_secs(2);
/// After a lock-server restart the parent sets each fence counter to `epoch << EPOCH_SHIFT`
/// (see `chaos` for why), so a fencing token's epoch is `fence_of(token) >> EPOCH_SHIFT`.
const EPOCH_SHIFT: u32 = 24;
/// The target: `try_lock_for` returns within its wait plus this. Calls over it are
/// counted and reported (see `NET_BUDGET`).
const OVERSHOOT_MARGIN: Duration = Duration::from_secs(1);
/// What is asserted. The wait deadline bounds the waiting, not the Redis round trips: one
/// attempt may take a few connect + read timeouts (a pooled connection that times out, a
/// fresh one, the acquire's two retries, the clean-up release after an ambiguous failure,
/// a script reload after a restart). Anything beyond this is a hang.
const NET_BUDGET: Duration = Duration::from_millis(1000 + 10 * 300);

/// The fenced storage: accepts a write only if its token is not lower than the last
/// accepted one — strictly greater, or equal from the same holder (the section's second
/// write). Tokens are 20-digit zero-padded decimals, so string order is numeric order.
///
/// KEYS: state hash, accepted-sections list. ARGV: kind (`b` begin / `e` end), token,
/// holder, start_us, end_us. Returns `{status, last token}`: 1 accepted, 0 stale (a higher
/// token was accepted), -1 the same token from another holder (two holders with one token:
/// a violation), -2 an end without its begin.
const FENCED_WRITE: &str = r"
local last = redis.call('HGET', KEYS[1], 'token') or ''
local holder = redis.call('HGET', KEYS[1], 'holder') or ''
local t = ARGV[2]
if t < last then return {0, last} end
if t == last and ARGV[3] ~= holder then return {-1, last} end
if ARGV[1] == 'b' then
  redis.call('HSET', KEYS[1], 'token', t, 'holder', ARGV[3])
  redis.call('HINCRBY', KEYS[1], 'begins', 1)
  return {1, t}
end
if t ~= last then return {-2, last} end
redis.call('RPUSH', KEYS[2], t .. ' ' .. ARGV[3] .. ' ' .. ARGV[4] .. ' ' .. ARGV[5])
return {1, t}
";

fn store_keys(key: &str) -> (String, String, String) {
    (
        format!("fs:{key}:state"),
        format!("fs:{key}:accepted"),
        format!("fs:{key}:sections"),
    )
}

/// A child's connection to the fenced storage (never faulted).
struct Store {
    conn: redis::Connection,
    script: redis::Script,
}

impl Store {
    fn connect(url: &str) -> Store {
        let conn = redis::Client::open(url)
            .unwrap()
            .get_connection_with_timeout(Duration::from_secs(5))
            .expect("connect to the storage");
        conn.set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        conn.set_write_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        Store {
            conn,
            script: redis::Script::new(FENCED_WRITE),
        }
    }

    fn write(
        &mut self,
        kind: &str,
        key: &str,
        token: u64,
        holder: &str,
        s: u64,
        e: u64,
    ) -> (i64, String) {
        let (state, accepted, _) = store_keys(key);
        self.script
            .key(state)
            .key(accepted)
            .arg(kind)
            .arg(format!("{token:020}"))
            .arg(holder)
            .arg(s)
            .arg(e)
            .invoke(&mut self.conn)
            .expect("fenced write")
    }

    fn report(&mut self, key: &str, line: String) {
        let (_, _, sections) = store_keys(key);
        let () = redis::cmd("RPUSH")
            .arg(sections)
            .arg(line)
            .query(&mut self.conn)
            .expect("report");
    }
}

/// Per-process counters, printed as one RESULT line.
#[derive(Default)]
struct Tally {
    counts: Mutex<BTreeMap<&'static str, u64>>,
    slow: Mutex<Vec<String>>,
    other_errors: Mutex<BTreeMap<String, u64>>,
}

impl Tally {
    fn add(&self, what: &'static str, n: u64) {
        *self.counts.lock().unwrap().entry(what).or_default() += n;
    }

    fn max(&self, what: &'static str, v: u64) {
        let mut c = self.counts.lock().unwrap();
        let e = c.entry(what).or_default();
        *e = (*e).max(v);
    }
}

fn chaos_builder(url: &str) -> redbaton::Builder {
    fast_builder(url).key_prefix(CHAOS_PREFIX)
}

/// Child entry point: `CHAOS_THREADS` threads contend until `CHAOS_END_AT_US`.
#[test]
fn chaos_child() {
    if !child::is_child() {
        return;
    }
    let lock_url = child::env("CHAOS_LOCK_URL");
    let store_url = child::env("CHAOS_STORE_URL");
    let end_at: u64 = child::env("CHAOS_END_AT_US").parse().unwrap();
    let seed: u64 = child::env("CHAOS_SEED").parse().unwrap();
    let pid = std::process::id();
    let tally = Arc::new(Tally::default());

    // The replacement of a killed child may start in the middle of a fault.
    let client = loop {
        match chaos_builder(&lock_url).build() {
            Ok(c) => break c,
            Err(e) => {
                assert!(e.is_connection(), "build: {e:?}");
                tally.add("build_errors", 1);
                if wall_us() > end_at {
                    child::print_result(&[("pid", pid.to_string()), ("built", "0".into())]);
                    return;
                }
                thread::sleep(ms(100));
            }
        }
    };
    let workers: Vec<_> = (0..CHAOS_THREADS)
        .map(|t| {
            let (client, store_url, tally) = (client.clone(), store_url.clone(), tally.clone());
            let holder = format!("{pid}.{t}");
            let seed = seed.wrapping_mul(31).wrapping_add(t as u64);
            thread::Builder::new()
                .name(format!("chaos-{t}"))
                .spawn(move || chaos_worker(&client, &store_url, end_at, seed, &holder, &tally))
                .unwrap()
        })
        .collect();
    // Bounded joins: a hung thread is reported, not waited for.
    let join_by = Instant::now()
        + Duration::from_micros(end_at.saturating_sub(wall_us()))
        + Duration::from_secs(10);
    while workers.iter().any(|w| !w.is_finished()) && Instant::now() < join_by {
        thread::sleep(ms(20));
    }
    let hung = workers.iter().filter(|w| !w.is_finished()).count();
    if hung > 0 {
        child::print_result(&[("pid", pid.to_string()), ("hung_threads", hung.to_string())]);
        std::process::exit(2);
    }
    for w in workers {
        if w.join().is_err() {
            tally.add("panicked_threads", 1);
        }
    }
    let stats = client.stats();
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        drop(client);
        let _ = tx.send(());
    });
    if rx.recv_timeout(Duration::from_secs(5)).is_err() {
        child::print_result(&[("pid", pid.to_string()), ("hung_drop", "1".into())]);
        std::process::exit(2);
    }
    for line in tally.slow.lock().unwrap().iter() {
        child::print_result(&[("pid", pid.to_string()), ("slow", line.clone())]);
    }
    for (msg, n) in tally.other_errors.lock().unwrap().iter() {
        child::print_result(&[("other_error", msg.clone()), ("n", n.to_string())]);
    }
    let mut fields: Vec<(&str, String)> = vec![("pid", pid.to_string()), ("built", "1".into())];
    for (k, v) in tally.counts.lock().unwrap().iter() {
        fields.push((k, v.to_string()));
    }
    for (k, v) in [
        ("remote_acquisitions", stats.remote_acquisitions),
        ("local_handoffs", stats.local_handoffs),
        ("reconnects", stats.reconnects),
        ("locks_lost", stats.locks_lost),
        ("renewals_sent", stats.renewals_sent),
        ("renewals_failed", stats.renewals_failed),
        ("wakeups_event", stats.wakeups_event),
        ("wakeups_lease", stats.wakeups_lease),
        ("wakeups_reconnect", stats.wakeups_reconnect),
    ] {
        fields.push((k, v.to_string()));
    }
    child::print_result(&fields);
}

fn chaos_worker(
    client: &LockClient,
    store_url: &str,
    end_at: u64,
    seed: u64,
    holder: &str,
    tally: &Tally,
) {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut store = Store::connect(store_url);
    while wall_us() < end_at {
        let key = CHAOS_KEYS[rng.random_range(0..CHAOS_KEYS.len())];
        let wait = ms(rng.random_range(50..500));
        let (w0, t0) = (wall_us(), Instant::now());
        let r = client.try_lock_for(key, wait);
        let over = t0.elapsed().saturating_sub(wait);
        tally.max("max_overshoot_us", over.as_micros() as u64);
        let outcome = match &r {
            Ok(_) => "ok",
            Err(e) if e.is_timeout() => "timeout",
            Err(e) if e.is_connection() => "connection",
            Err(_) => "other",
        };
        if over > ms(250) {
            // start,end,overshoot,outcome — the parent excuses calls that overlapped a
            // SIGSTOP of this process.
            tally.slow.lock().unwrap().push(format!(
                "{w0},{},{},{outcome}",
                wall_us(),
                over.as_micros()
            ));
        }
        match r {
            Ok(g) => {
                tally.add("acquired", 1);
                let token = g.fencing_token();
                let s = wall_us();
                let (r1, last1) = store.write("b", key, token, holder, s, 0);
                if rng.random_range(0..40) == 0 {
                    // A long section (past a few renewals): the watchdog meets the faults.
                    // Conservative policy: stop between steps once the lock is known lost.
                    tally.add("long_sections", 1);
                    let until = Instant::now() + ms(rng.random_range(300..2000));
                    while Instant::now() < until && !g.is_lost() {
                        thread::sleep(ms(50).min(until.saturating_duration_since(Instant::now())));
                    }
                } else {
                    thread::sleep(Duration::from_micros(rng.random_range(0..15_000)));
                }
                let e = wall_us();
                // Checked after reading the end time: if the lock is still ours now, it was
                // ours during all of [s, e].
                let valid = g.check().is_ok();
                // The end write goes out even when the lock is known lost (the aggressive
                // policy): the fencing storage must refuse it if a newer holder began.
                let r2 = if r1 == 1 {
                    store.write("e", key, token, holder, s, e).0
                } else {
                    9 // not sent
                };
                store.report(
                    key,
                    format!(
                        "{token:020} {holder} {s} {e} {} {r1} {r2} {last1}",
                        u8::from(valid)
                    ),
                );
                tally.add(
                    if valid {
                        "valid_sections"
                    } else {
                        "lost_sections"
                    },
                    1,
                );
                match r1 {
                    1 => tally.add("begin_accepted", 1),
                    0 => tally.add("begin_stale", 1),
                    _ => tally.add("begin_duplicate", 1),
                }
                match (r2, valid) {
                    (0, true) => tally.add("end_stale_valid", 1),
                    (0, false) => tally.add("end_stale_lost", 1),
                    (1, false) => tally.add("end_accepted_lost", 1),
                    _ => {}
                }
                match g.unlock() {
                    Ok(Unlocked::Released) => tally.add("unlock_released", 1),
                    Ok(Unlocked::HandedOff) => tally.add("unlock_handed_off", 1),
                    Ok(Unlocked::Expired) => tally.add("unlock_expired", 1),
                    Ok(Unlocked::HeldByOther) => tally.add("unlock_held_by_other", 1),
                    Ok(_) => tally.add("unlock_other", 1),
                    Err(_) => tally.add("unlock_errors", 1),
                }
            }
            Err(e) if e.is_timeout() => tally.add("timeouts", 1),
            Err(e) if e.is_connection() => {
                tally.add("connection_errors", 1);
                thread::sleep(ms(20));
            }
            Err(e) => {
                tally.add("other_errors", 1);
                let msg: String = e
                    .to_string()
                    .chars()
                    .map(|c| if c.is_whitespace() { '_' } else { c })
                    .take(120)
                    .collect();
                *tally.other_errors.lock().unwrap().entry(msg).or_default() += 1;
                thread::sleep(ms(20));
            }
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Fault {
    KillHolder,
    PauseHolder,
    KillSubscribers,
    KillCommandConns,
    RestartServer,
    ProxyDelay,
    ProxyBlackhole,
    ProxyReset,
}

const ALL_FAULTS: [Fault; 8] = [
    Fault::KillHolder,
    Fault::PauseHolder,
    Fault::KillSubscribers,
    Fault::KillCommandConns,
    Fault::RestartServer,
    Fault::ProxyDelay,
    Fault::ProxyBlackhole,
    Fault::ProxyReset,
];

/// The random phase: restarts and proxy resets are quick and drastic, so rarer.
const WEIGHTED_FAULTS: [Fault; 14] = [
    Fault::KillHolder,
    Fault::KillHolder,
    Fault::PauseHolder,
    Fault::PauseHolder,
    Fault::KillSubscribers,
    Fault::KillSubscribers,
    Fault::KillCommandConns,
    Fault::KillCommandConns,
    Fault::RestartServer,
    Fault::ProxyDelay,
    Fault::ProxyDelay,
    Fault::ProxyBlackhole,
    Fault::ProxyBlackhole,
    Fault::ProxyReset,
];

/// The child processes; dropping it SIGKILLs (and reaps) the ones still running, so a
/// failing parent leaves no stopped or running child behind.
struct Children {
    slots: Vec<Option<Child>>,
}

impl Drop for Children {
    fn drop(&mut self) {
        for c in self.slots.iter_mut().flatten() {
            child::kill_child(c, libc::SIGKILL);
            let _ = c.wait();
        }
    }
}

struct Section {
    key: &'static str,
    token: u64,
    holder: String,
    s: u64,
    e: u64,
    valid: bool,
    r1: i64,
    r2: i64,
    last1: u64,
}

fn epoch_of(token: u64) -> u64 {
    fence_of(token) >> EPOCH_SHIFT
}

fn progress(store: &mut redis::Connection) -> u64 {
    CHAOS_KEYS
        .iter()
        .map(|k| {
            let n: Option<u64> = redis::cmd("HGET")
                .arg(store_keys(k).0)
                .arg("begins")
                .query(store)
                .unwrap();
            n.unwrap_or(0)
        })
        .sum()
}

fn current_holder_pid(store: &mut redis::Connection, key: &str) -> Option<u32> {
    let h: Option<String> = redis::cmd("HGET")
        .arg(store_keys(key).0)
        .arg("holder")
        .query(store)
        .unwrap();
    h?.split('.').next()?.parse().ok()
}

/// Chaos, bounded (about 45 s), against real redis-servers.
///
/// Setup: the lock server L (keyspace notifications on in its config file, as an operator
/// would set them), two fault proxies in front of it (children alternate between them, so a
/// proxy fault partitions some processes and not others), and the storage server S, which
/// no fault touches. `CHAOS_PROCS` processes × `CHAOS_THREADS` threads run
/// `try_lock_for(random key, random 50..500 ms)` and a short critical section that writes
/// through the fenced storage.
///
/// Faults, one at a time, each followed by a pause and a check that the system makes
/// progress again ("survived"): the current holder process SIGKILLed (and replaced by a new
/// child), the holder SIGSTOPped past its lease then resumed, `CLIENT KILL TYPE pubsub`,
/// the library's command connections killed by name (`redbaton`, so no harness connection
/// is touched), a lock-server restart, a proxy adding latency for a while, a proxy
/// dropping every byte for a while, a proxy resetting its connections.
///
/// Restarts and fencing: Redis without persistence loses the lock keys and the fencing
/// counter on restart. That is a failure mode the library does not protect against (the
/// README lists "Redis restart/failover without persistence"): a holder keeps believing in a
/// lock the new server never heard of until its next renewal, and tokens restart from 1.
/// The test models the recovery a persistent deployment gets: while both proxies stall all
/// traffic, the parent restarts L and sets every fence counter to `epoch << 24` before
/// letting clients in. The fencing storage keeps comparing plain tokens — a token of a
/// later epoch is higher — and the mutual-exclusion checks are made per epoch (a section of
/// epoch n may overlap one of epoch n+1: that is the unprotected window).
#[test]
fn chaos() {
    init_log();
    let seed: u64 = std::env::var("CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| wall_us() ^ u64::from(std::process::id()));
    eprintln!("chaos seed {seed} (rerun with CHAOS_SEED={seed} cargo test --test faults chaos)");
    let mut rng = StdRng::seed_from_u64(seed);

    let lock_srv = RedisServer::builder()
        .config("notify-keyspace-events", "Kg$xe")
        .start();
    let store_srv = RedisServer::start();
    let proxies = [Proxy::start(lock_srv.addr()), Proxy::start(lock_srv.addr())];
    let mut store = store_srv.conn();
    let started = Instant::now();
    let chaos_end = started + CHAOS_FOR;
    let end_at_us = wall_us() + (CHAOS_FOR + CALM).as_micros() as u64;

    let spawn = |slot: usize, rng: &mut StdRng| -> Child {
        child::spawn_self(
            "chaos_child",
            &[
                ("CHAOS_LOCK_URL", proxies[slot % proxies.len()].url()),
                ("CHAOS_STORE_URL", store_srv.url()),
                ("CHAOS_END_AT_US", end_at_us.to_string()),
                ("CHAOS_SEED", rng.random::<u64>().to_string()),
            ],
        )
    };
    let mut children = Children {
        slots: (0..CHAOS_PROCS).map(|i| Some(spawn(i, &mut rng))).collect(),
    };

    let mut violations: Vec<String> = Vec::new();
    let mut injected: BTreeMap<Fault, (u32, u32)> = BTreeMap::new();
    let mut pauses: Vec<(u32, u64, u64)> = Vec::new();
    let mut epoch = 0u64;
    let mut max_recovery_us = 0u64;
    let mut spawned = CHAOS_PROCS;
    let mut detail: BTreeMap<&str, u64> = BTreeMap::new();

    // Let everyone start before the first fault.
    if eventually(Duration::from_secs(15), || {
        (progress(&mut store) > 0).then_some(())
    })
    .is_none()
    {
        violations.push("no progress before the first fault".into());
    }

    // Every kind once (in a seeded order), then seeded random kinds until time is up.
    let mut schedule: Vec<Fault> = ALL_FAULTS.to_vec();
    schedule.shuffle(&mut rng);
    let mut next = 0;
    while Instant::now() < chaos_end {
        let fault = if next < schedule.len() {
            schedule[next]
        } else {
            WEIGHTED_FAULTS[rng.random_range(0..WEIGHTED_FAULTS.len())]
        };
        next += 1;
        let before = progress(&mut store);
        // The target of the process faults: the process of the last accepted begin (most
        // likely the holder now), else any child.
        let key = CHAOS_KEYS[rng.random_range(0..CHAOS_KEYS.len())];
        let target = {
            let pid = current_holder_pid(&mut store, key);
            children
                .slots
                .iter()
                .position(|c| c.as_ref().is_some_and(|c| Some(c.id()) == pid))
                .unwrap_or_else(|| rng.random_range(0..CHAOS_PROCS))
        };
        match fault {
            Fault::KillHolder => {
                let mut c = children.slots[target].take().expect("live child");
                child::kill_child(&mut c, libc::SIGKILL);
                let _ = child::wait_output(c, Duration::from_secs(10));
                children.slots[target] = Some(spawn(target, &mut rng));
                spawned += 1;
            }
            Fault::PauseHolder => {
                let c = children.slots[target].as_mut().expect("live child");
                let pid = c.id();
                let stop_at = wall_us();
                child::kill_child(c, libc::SIGSTOP);
                thread::sleep(LEASE + ms(rng.random_range(200..800)));
                child::kill_child(c, libc::SIGCONT);
                pauses.push((pid, stop_at, wall_us()));
            }
            Fault::KillSubscribers => {
                let n: i64 = redis::cmd("CLIENT")
                    .arg("KILL")
                    .arg("TYPE")
                    .arg("pubsub")
                    .query(&mut lock_srv.conn())
                    .unwrap();
                *detail.entry("subscriber connections killed").or_default() += n as u64;
            }
            Fault::KillCommandConns => {
                let mut conn = lock_srv.conn();
                let ids: Vec<String> = lock_srv
                    .client_list()
                    .into_iter()
                    .filter(|c| c.get("name").map(String::as_str) == Some("redbaton"))
                    .filter_map(|c| c.get("id").cloned())
                    .collect();
                for id in ids {
                    let n: i64 = redis::cmd("CLIENT")
                        .arg("KILL")
                        .arg("ID")
                        .arg(&id)
                        .query(&mut conn)
                        .unwrap_or(0);
                    *detail.entry("command connections killed").or_default() += n as u64;
                }
            }
            Fault::RestartServer => {
                for p in &proxies {
                    p.stall(true);
                }
                lock_srv.restart();
                epoch += 1;
                let mut conn = lock_srv.conn();
                for k in CHAOS_KEYS {
                    let () = redis::cmd("SET")
                        .arg(format!("{CHAOS_PREFIX}{{{k}}}:fence"))
                        .arg(epoch << EPOCH_SHIFT)
                        .query(&mut conn)
                        .unwrap();
                }
                for p in &proxies {
                    p.stall(false);
                }
            }
            Fault::ProxyDelay => {
                let p = &proxies[rng.random_range(0..proxies.len())];
                p.set_delay(ms(rng.random_range(50..400)));
                thread::sleep(ms(rng.random_range(500..2000)));
                p.set_delay(Duration::ZERO);
            }
            Fault::ProxyBlackhole => {
                let p = &proxies[rng.random_range(0..proxies.len())];
                p.blackhole(true);
                thread::sleep(ms(rng.random_range(300..1500)));
                p.blackhole(false);
            }
            Fault::ProxyReset => {
                proxies[rng.random_range(0..proxies.len())].kill_all();
            }
        }
        thread::sleep(ms(rng.random_range(200..800)));
        let healed = Instant::now();
        let survived = eventually(Duration::from_secs(10), || {
            (progress(&mut store) > before).then_some(())
        })
        .is_some();
        max_recovery_us = max_recovery_us.max(healed.elapsed().as_micros() as u64);
        let e = injected.entry(fault).or_default();
        e.0 += 1;
        if survived {
            e.1 += 1;
        } else {
            violations.push(format!("no progress within 10 s after {fault:?}"));
        }
    }
    for p in &proxies {
        p.heal();
    }

    // Children stop on their own at end_at_us; bound the wait.
    let mut results: Vec<HashMap<String, String>> = Vec::new();
    let mut slow_lines: Vec<(u32, String)> = Vec::new();
    for slot in children.slots.iter_mut() {
        let c = slot.take().expect("live child");
        let pid = c.id();
        let out = child::wait_output(c, CALM + Duration::from_secs(30));
        if !out.status.success() {
            violations.push(format!(
                "child {pid} exited with {}\n--- stdout ---\n{}\n--- stderr ---\n{}",
                out.status, out.stdout, out.stderr
            ));
        }
        for r in child::parse_results(&out.stdout) {
            if let Some(s) = r.get("slow") {
                slow_lines.push((pid, s.clone()));
            } else if let Some(msg) = r.get("other_error") {
                eprintln!("child {pid}: other error x{}: {msg}", r["n"]);
            } else {
                results.push(r);
            }
        }
    }

    // No lock key left once every child has exited (killed children's keys expire).
    let leftover = eventually(LEASE + Duration::from_secs(2), || {
        let keys: Vec<Vec<u8>> = lock_srv
            .keys(&format!("{CHAOS_PREFIX}*"))
            .into_iter()
            .filter(|k| !k.ends_with(b":fence"))
            .collect();
        keys.is_empty().then_some(())
    });
    if leftover.is_none() {
        violations.push(format!(
            "lock keys left: {:?}",
            lock_srv
                .keys(&format!("{CHAOS_PREFIX}*"))
                .iter()
                .map(|k| String::from_utf8_lossy(k).into_owned())
                .collect::<Vec<_>>()
        ));
    }

    // --- invariants ---
    let mut sections: Vec<Section> = Vec::new();
    for key in CHAOS_KEYS {
        let (_, accepted, reports) = store_keys(key);
        let lines: Vec<String> = redis::cmd("LRANGE")
            .arg(&reports)
            .arg(0)
            .arg(-1)
            .query(&mut store)
            .unwrap();
        for l in lines {
            let f: Vec<&str> = l.split(' ').collect();
            sections.push(Section {
                key,
                token: f[0].parse().unwrap(),
                holder: f[1].to_owned(),
                s: f[2].parse().unwrap(),
                e: f[3].parse().unwrap(),
                valid: f[4] == "1",
                r1: f[5].parse().unwrap(),
                r2: f[6].parse().unwrap(),
                last1: f[7].parse().unwrap_or(0),
            });
        }
        // Accepted writes: tokens strictly increase in the storage's order.
        let log: Vec<String> = redis::cmd("LRANGE")
            .arg(&accepted)
            .arg(0)
            .arg(-1)
            .query(&mut store)
            .unwrap();
        let tokens: Vec<u64> = log
            .iter()
            .map(|l| l.split(' ').next().unwrap().parse().unwrap())
            .collect();
        for w in tokens.windows(2) {
            if w[1] <= w[0] {
                violations.push(format!("{key}: accepted tokens not increasing: {w:?}"));
            }
        }
        *detail.entry("accepted sections").or_default() += tokens.len() as u64;
    }
    let mut per_epoch: BTreeMap<u64, u64> = BTreeMap::new();
    for s in &sections {
        if fence_of(s.token) >= (epoch + 1) << EPOCH_SHIFT {
            violations.push(format!("fence of {} beyond its epoch range", s.token));
        }
        *per_epoch.entry(epoch_of(s.token)).or_default() += 1;
        if s.r1 == -1 || s.r2 == -1 {
            violations.push(format!(
                "{}: token {} accepted from two holders (last {})",
                s.key, s.token, s.holder
            ));
        }
        if s.r1 == -2 || s.r2 == -2 {
            violations.push(format!("{}: end without begin for {}", s.key, s.token));
        }
        // A section still valid at its end whose begin was refused as stale: a higher
        // token of the same epoch was accepted while this holder held the lock.
        if s.valid && s.r1 == 0 && epoch_of(s.last1) == epoch_of(s.token) {
            violations.push(format!(
                "{}: valid section {} ({}) refused as stale by {}",
                s.key, s.token, s.holder, s.last1
            ));
        }
    }
    // Mutual exclusion: the sections whose holder still held the lock at their end never
    // overlap (per key and epoch). Sorted by start, each must end before the next starts.
    for key in CHAOS_KEYS {
        let mut valid: Vec<&Section> = sections
            .iter()
            .filter(|s| s.key == key && s.valid)
            .collect();
        valid.sort_by_key(|s| (epoch_of(s.token), s.s));
        for w in valid.windows(2) {
            let (a, b) = (w[0], w[1]);
            if epoch_of(a.token) == epoch_of(b.token) && b.s < a.e {
                violations.push(format!(
                    "{key}: overlapping valid sections: {} ({}) [{}, {}] and {} ({}) [{}, {}]",
                    a.token, a.holder, a.s, a.e, b.token, b.holder, b.s, b.e
                ));
            }
        }
    }
    // Deadlines: a call slower than wait + NET_BUDGET is a violation unless its process was
    // SIGSTOPped during it; calls over wait + OVERSHOOT_MARGIN are counted.
    let mut max_excused = 0u64;
    let mut max_unexcused = 0u64;
    let mut over_margin = 0u64;
    for (pid, line) in &slow_lines {
        let f: Vec<&str> = line.split(',').collect();
        let (w0, w1, over): (u64, u64, u64) = (
            f[0].parse().unwrap(),
            f[1].parse().unwrap(),
            f[2].parse().unwrap(),
        );
        let excused = pauses
            .iter()
            .any(|&(p, a, b)| p == *pid && w0 <= b && w1 >= a);
        if excused {
            max_excused = max_excused.max(over);
        } else {
            max_unexcused = max_unexcused.max(over);
            if over > OVERSHOOT_MARGIN.as_micros() as u64 {
                over_margin += 1;
                eprintln!(
                    "call over the 1 s margin in {pid}: overshoot {} ms, outcome {}",
                    over / 1000,
                    f[3]
                );
            }
            if over > NET_BUDGET.as_micros() as u64 {
                violations.push(format!(
                    "try_lock_for overshot its wait by {} ms in {pid} ({})",
                    over / 1000,
                    f[3]
                ));
            }
        }
    }

    // --- report ---
    let sum = |k: &str| -> u64 {
        results
            .iter()
            .filter_map(|r| r.get(k).and_then(|v| v.parse::<u64>().ok()))
            .sum()
    };
    let max_over_all = results
        .iter()
        .filter_map(|r| {
            r.get("max_overshoot_us")
                .and_then(|v| v.parse::<u64>().ok())
        })
        .max()
        .unwrap_or(0);
    eprintln!(
        "--- chaos report (seed {seed}, {:?}) ---",
        started.elapsed()
    );
    eprintln!(
        "processes: {CHAOS_PROCS} x {CHAOS_THREADS} threads, {spawned} spawned in all; lock server epochs: {}",
        epoch + 1
    );
    for (fault, (n, ok)) in &injected {
        eprintln!("fault {fault:?}: injected {n}, survived {ok}");
    }
    for (k, v) in &detail {
        eprintln!("{k}: {v}");
    }
    eprintln!("sections reported per epoch: {per_epoch:?}");
    for k in [
        "acquired",
        "valid_sections",
        "lost_sections",
        "long_sections",
        "begin_accepted",
        "begin_stale",
        "end_stale_lost",
        "end_accepted_lost",
        "end_stale_valid",
        "timeouts",
        "connection_errors",
        "other_errors",
        "build_errors",
        "unlock_released",
        "unlock_handed_off",
        "unlock_expired",
        "unlock_held_by_other",
        "unlock_errors",
        "remote_acquisitions",
        "local_handoffs",
        "reconnects",
        "locks_lost",
        "renewals_sent",
        "renewals_failed",
        "wakeups_event",
        "wakeups_lease",
        "wakeups_reconnect",
    ] {
        eprintln!("{k}: {} (surviving processes)", sum(k));
    }
    eprintln!(
        "max try_lock_for overshoot: {} ms (surviving processes), {} ms not explained by a SIGSTOP, {} ms during a SIGSTOP",
        max_over_all / 1000,
        max_unexcused / 1000,
        max_excused / 1000
    );
    eprintln!(
        "calls over wait + {OVERSHOOT_MARGIN:?} not explained by a SIGSTOP: {over_margin} (asserted bound: wait + {NET_BUDGET:?})"
    );
    eprintln!(
        "recovery after a fault (first new section): max {:?}",
        Duration::from_micros(max_recovery_us)
    );
    eprintln!("{} violations", violations.len());
    assert!(
        violations.is_empty(),
        "chaos seed {seed}: {} violations:\n{}",
        violations.len(),
        violations.join("\n")
    );
    assert!(sum("valid_sections") > 0, "no valid section at all");
    assert!(
        per_epoch.len() as u64 == epoch + 1,
        "an epoch without any section: {per_epoch:?}"
    );
    for (fault, (n, ok)) in &injected {
        assert!(*n > 0 && n == ok, "{fault:?}: {ok} of {n} survived");
    }
}
