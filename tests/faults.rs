//! Faults: what the lock does when Redis, the network or a holder process misbehaves.
//!
//! * Unit-sized tests: the server killed while a lock is held, down at `build()`, stopped or
//!   paused mid-run. Each must end in a typed error (or a lost signal) within the configured
//!   timeouts — never a hang, never a panic — and the client must recover when the server
//!   comes back.
//! * [`chaos`]: several child processes contend for a few plain locks, a read-write lock
//!   (reads, writes and upgradable reads; a third of the writes end in a downgrade and of
//!   the upgradable reads in an upgrade, whose hold is the next section) and a semaphore
//!   while the parent injects faults at random (seeded; the seed is printed). Every lock
//!   and write section writes through a fenced storage (a Lua script on a separate
//!   redis-server). Checked, on the sections whose holder still held the name at their
//!   end: mutual exclusion (reads may overlap reads and one upgradable read, nothing
//!   else), tokens
//!   strictly increasing from one lock or write section to the next, no read's token below
//!   that of a write that ended before it began, and never more permit sections at once
//!   than the semaphore has permits; and strictly increasing tokens of the accepted
//!   writes, the fencing storage never seeing one token from two holders, every call
//!   returning by its deadline plus a margin, no hung thread or process, no key left at the
//!   end that the library would not let expire.
//!
//! A chaos run is of one of two kinds, its topology. `single`: one lock server behind two
//! proxies, as above. `redlock`: the clients are built with three lock servers
//! (`Builder::nodes`), each behind its own proxy, and contend for the plain locks only
//! (read-write locks, semaphores and multi-locks are not available on Redlock); the faults
//! are aimed at one node, or at two or three at once (a minority or a majority of them):
//! kills and restarts, SIGSTOP/SIGCONT pauses, proxy delays, drops and resets, `CLIENT
//! KILL`, besides the holder process killed or paused. A node restarted empty forgets the
//! locks it held, which Redlock without persistence only survives if the node stays down
//! for longer than a lease: every restart waits that long (see `chaos`), and then the same
//! checks hold with no exception for restarts (tokens strictly increase throughout, since
//! the nodes share one clock). The seed picks the topology (so a plain `cargo test` runs
//! either kind, each as long); `REDBATON_CHAOS_TOPOLOGY` (`single` or `redlock`) forces it.
//!
//! Replaying a chaos run: the seed and topology are printed at the start and in the failure
//! message; `REDBATON_SEED=<seed> REDBATON_CHAOS_TOPOLOGY=<topology> cargo test --test
//! faults chaos` replays its fault schedule (`CHAOS_SEED` is accepted too;
//! `REDBATON_CHAOS_SECS` changes the length of the faulty phase, 40 s by default, and must
//! match to replay). Every run writes its history (each section, fault and unlock, in time
//! order) to `target/tmp/chaos/chaos-seed-<seed>.history`.
//!
//! [`soak`] (ignored; `cargo test --release --test faults -- --ignored soak --nocapture`)
//! runs the chaos scenario many times with fresh seeds, each run in its own process with
//! its own servers, and prints the violations by kind with the seeds and histories of the
//! failing runs. `REDBATON_SOAK_RUNS` (200), `REDBATON_CHAOS_SECS` (10 in the soak) and
//! `REDBATON_SOAK_JOBS` (1: runs at once) set its size. Its runs alternate between the two
//! topologies, unless `REDBATON_CHAOS_TOPOLOGY` picks one for all.

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
use redbaton_testkit::child_only;
use redbaton_testkit::clock::{mono_ns, wall_us};
use redbaton_testkit::history::{self, History, Kind, Verdict, Violation};
use redbaton_testkit::keys::{Keys, fence_of};
use redbaton_testkit::leftover::{self, KeyPolicy};
use redbaton_testkit::proxy::Proxy;
use redbaton_testkit::server::RedisServer;
use redbaton_testkit::stalls::{StallWatch, Stalls};
use redbaton_testkit::wait::{eventually, wait_until};
use redbaton_testkit::{dead_url, test_server_and};
use redbaton_testkit::{init_log, ms};
use redbaton_testkit::{lock_builder, lock_client};

/// Short leases so that every fault resolves within about a second.
const LEASE: Duration = Duration::from_secs(1);
const RENEW: Duration = Duration::from_millis(300);
/// Connect / read / write timeout of the clients under test.
const NET: Duration = Duration::from_millis(300);

fn fast_builder(url: &str) -> redbaton::Builder {
    lock_builder!(
        node(url),
        lease(LEASE),
        renew_interval(RENEW),
        io_timeouts(NET)
    )
}

fn fast_client(url: &str) -> LockClient {
    fast_builder(url).build().expect("build")
}

#[test]
fn smoke() {
    let (_srv, c) = test_server_and(fast_client);
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
        let took = started.elapsed();
        assert!(took < Duration::from_secs(5), "{what}: {took:?}");
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
    let started = Instant::now();
    let e = fast_builder(&dead_url()).build().expect_err("refused");
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
    let holder = lock_client!(node(srv.url()), lease(Duration::from_secs(30)));
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
        let finished = wait_until(Duration::from_secs(15), || waiter.is_finished());
        assert!(finished, "lock() hangs with the server down");
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
    let took = started.elapsed();
    assert!(took < Duration::from_secs(3), "{took:?}");
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
        lock_client!(
            node(srv.url()),
            lease(Duration::from_secs(60)),
            recheck_interval(Duration::from_secs(60))
        )
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
                    let c = lock_client!(node(url), lease(ms(300)), renew_interval(ms(100)));
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
const CHAOS_KEYSPACE: Keys = Keys::new(CHAOS_PREFIX);
/// The plain locks of a chaos run.
const CHAOS_KEYS: [&str; 2] = ["alpha", "beta"];
/// The read-write lock of a chaos run: a name of its own, since one name has one kind.
const CHAOS_RW: &str = "gamma";
/// The semaphore of a chaos run (a name of its own too), and its permits: few, so that
/// permit-seekers wait and releases grant.
const CHAOS_SEM: &str = "delta";
const CHAOS_PERMITS: u32 = 2;
/// The names a chaos section may hold: one plain lock, the other, or both (a multi-lock).
const CHAOS_KEY_SETS: [&[&str]; 3] = [&[CHAOS_KEYS[0]], &[CHAOS_KEYS[1]], &CHAOS_KEYS];
/// Every name of a chaos run.
const CHAOS_NAMES: [&str; 4] = [CHAOS_KEYS[0], CHAOS_KEYS[1], CHAOS_RW, CHAOS_SEM];
const CHAOS_PROCS: usize = 3;
const CHAOS_THREADS: usize = 3;
/// Faults are injected for this long (unless `REDBATON_CHAOS_SECS` says otherwise); then a
/// calm period longer than a lease.
const CHAOS_SECS: u64 = 40;
/// The soak's runs are shorter by default: more seeds per hour.
const SOAK_CHAOS_SECS: u64 = 10;
const CALM: Duration = Duration::from_secs(2);
/// Sections must start again within this after a fault has healed (liveness).
const PROGRESS_LIMIT: Duration = Duration::from_secs(10);
/// The lock-server restarts of the run so far, in order: epoch n is the time after the
/// nth (see `chaos`).
static RESTARTS: Mutex<Vec<Restart>> = Mutex::new(Vec::new());

/// When the lock server was restarted, as the epochs of the sections are told from it.
#[derive(Clone, Copy, Debug)]
struct Restart {
    /// When the new server's epoch began, in µs of the wall clock, which is the server's
    /// `TIME` (same machine): a fence is at least the server's clock when it was issued, so
    /// a token's epoch is the number of restarts before its fence.
    fences_from: u64,
    /// When both proxies stalled before the restart (µs of CLOCK_MONOTONIC): nothing sent
    /// from then on reached the old server.
    stalled: u64,
    /// When they were about to let traffic through again: no reply of the new server
    /// reached a client before.
    resumed: u64,
}

/// The target: `try_lock_for` (and `try_read_for`, `try_write_for`, `try_acquire_for`)
/// returns within its wait plus this. Calls over it are counted and reported (see
/// `NET_BUDGET`).
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
        // Generous: the storage is never faulted, but a loaded machine can stall every
        // process for tens of seconds, and a harness panic would hide the run's findings.
        conn.set_read_timeout(Some(Duration::from_secs(60)))
            .unwrap();
        conn.set_write_timeout(Some(Duration::from_secs(60)))
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

    /// A section of the read-write lock or the semaphore `name` began in `holder`:
    /// counted as progress, and its process is the one a process fault aimed at `name`
    /// targets (see [`current_holder_pid`]). Apart from the fenced state's `holder`, which
    /// only the fenced writes may set.
    fn began_shared(&mut self, name: &str, holder: &str) {
        let (state, _, _) = store_keys(name);
        let () = redis::pipe()
            .hset(&state, "last", holder)
            .ignore()
            .hincr(&state, "shared_begins", 1)
            .ignore()
            .query(&mut self.conn)
            .expect("shared begin");
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

/// The chaos clients' re-check interval (the default, set here so that the keys-left
/// check's bounds and the clients agree by construction).
const CHAOS_RECHECK: Duration = Duration::from_secs(5);

/// A chaos client of the lock servers at `urls`: one, or three for Redlock.
fn chaos_builder(urls: &[&str]) -> redbaton::Builder {
    fast_builder(urls[0])
        .nodes(urls[1..].iter().copied())
        .key_prefix(CHAOS_PREFIX)
        .recheck_interval(CHAOS_RECHECK)
}

/// What the clients of a chaos run are built with (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Topology {
    /// One lock server, behind two proxies.
    Single,
    /// Three lock servers, each behind its own proxy: a majority must grant.
    Redlock,
}

impl Topology {
    const ENV: &str = "REDBATON_CHAOS_TOPOLOGY";

    fn label(self) -> &'static str {
        match self {
            Topology::Single => "single",
            Topology::Redlock => "redlock",
        }
    }

    /// `REDBATON_CHAOS_TOPOLOGY`, or the seed's choice; panics on an unknown name (a typo
    /// must not silently run another scenario).
    fn of(seed: u64) -> Topology {
        match std::env::var(Topology::ENV) {
            Ok(v) => Topology::named(v.trim())
                .unwrap_or_else(|| panic!("{}={v:?}: not single or redlock", Topology::ENV)),
            // A stream of its own, so that the fault schedule and the children's seeds do not
            // depend on it.
            Err(_) if history::derive(seed, u64::MAX) % 2 == 1 => Topology::Redlock,
            Err(_) => Topology::Single,
        }
    }

    fn named(name: &str) -> Option<Topology> {
        [Topology::Single, Topology::Redlock]
            .into_iter()
            .find(|t| t.label() == name)
    }

    /// The names its sections hold.
    fn names(self) -> &'static [&'static str] {
        match self {
            Topology::Single => &CHAOS_NAMES,
            Topology::Redlock => &CHAOS_KEYS,
        }
    }

    /// The fault kinds of its schedule: each once first, then these at random.
    fn faults(self) -> (&'static [Fault], &'static [Fault]) {
        match self {
            Topology::Single => (&ALL_FAULTS, &WEIGHTED_FAULTS),
            Topology::Redlock => (&REDLOCK_FAULTS, &REDLOCK_WEIGHTED_FAULTS),
        }
    }
}

/// Child entry point: `CHAOS_THREADS` threads contend until `CHAOS_END_AT_US`.
#[test]
fn chaos_child() {
    child_only!();
    // One URL, or the nodes' for Redlock, separated by spaces.
    let lock_urls = child::env("CHAOS_LOCK_URL");
    let lock_urls: Vec<&str> = lock_urls.split(' ').collect();
    let redlock = lock_urls.len() > 1;
    let store_url = child::env("CHAOS_STORE_URL");
    let end_at: u64 = child::env("CHAOS_END_AT_US").parse().unwrap();
    // Derived from the run's seed by the parent (see `chaos`): one seed replays all.
    let seed: u64 = child::env("CHAOS_CHILD_SEED").parse().unwrap();
    let pid = std::process::id();
    let tally = Arc::new(Tally::default());
    // A late call is judged on the time this process ran (see `stalls`).
    let watch = Arc::new(StallWatch::start());

    // The replacement of a killed child may start in the middle of a fault.
    let client = loop {
        match chaos_builder(&lock_urls).build() {
            Ok(c) => break c,
            Err(e) => {
                assert!(e.is_connection(), "build: {e:?}");
                tally.add("build_errors", 1);
                if mono_us() > end_at {
                    child::print_result(&[("pid", pid.to_string()), ("built", "0".into())]);
                    return;
                }
                thread::sleep(ms(100));
            }
        }
    };
    let workers: Vec<_> = (0..CHAOS_THREADS)
        .map(|t| {
            let (client, store_url, tally, watch) = (
                client.clone(),
                store_url.clone(),
                tally.clone(),
                watch.clone(),
            );
            let holder = format!("{pid}.{t}");
            let seed = history::derive(seed, t as u64);
            thread::Builder::new()
                .name(format!("chaos-{t}"))
                .spawn(move || {
                    let at = WorkerAt {
                        end_at,
                        seed,
                        holder: &holder,
                        redlock,
                    };
                    chaos_worker(&client, &store_url, at, &tally, &watch)
                })
                .unwrap()
        })
        .collect();
    // Bounded joins: a hung thread is reported, not waited for. A thread may be one call
    // (its wait plus a few network timeouts) past the end, or more on a stalled machine.
    let join_by = Instant::now()
        + Duration::from_micros(end_at.saturating_sub(mono_us()))
        + Duration::from_secs(60);
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
        child::print_result(&[
            ("pid", pid.to_string()),
            ("other_error", msg.clone()),
            ("n", n.to_string()),
        ]);
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
        ("grants_received", stats.grants_received),
        ("grants_trusted", stats.grants_trusted),
        ("grants_passed", stats.grants_passed),
    ] {
        fields.push((k, v.to_string()));
    }
    child::print_result(&fields);
}

/// A chaos thread: until when it runs, its seed, its name (pid.thread), and whether its
/// client is a Redlock one (which takes plain locks only).
struct WorkerAt<'a> {
    end_at: u64,
    seed: u64,
    holder: &'a str,
    redlock: bool,
}

fn chaos_worker(
    client: &LockClient,
    store_url: &str,
    at: WorkerAt<'_>,
    tally: &Tally,
    watch: &StallWatch,
) {
    let WorkerAt {
        end_at,
        seed,
        holder,
        redlock,
    } = at;
    let mut rng = StdRng::seed_from_u64(seed);
    let mut store = Store::connect(store_url);
    let rw = client.rwlock(CHAOS_RW);
    let sem = client.semaphore(CHAOS_SEM, CHAOS_PERMITS);
    while mono_us() < end_at {
        // A quarter of the sections read or write the read-write lock (30% of them write,
        // 10% take the upgradable read), a quarter take a permit of the semaphore, the
        // others take a plain lock, or (one in eight of them) both plain locks at once.
        let (hold, names): (Hold, &'static [&'static str]) = match rng.random_range(0..4) {
            _ if redlock => (Hold::Lock, CHAOS_KEY_SETS[rng.random_range(0..2)]),
            0 => {
                let hold = match rng.random_range(0..10) {
                    0..3 => Hold::Write,
                    3 => Hold::Upgradable,
                    _ => Hold::Read,
                };
                (hold, &[CHAOS_RW])
            }
            1 => (Hold::Permit, &[CHAOS_SEM]),
            _ if rng.random_range(0..8) == 0 => (Hold::Multi, CHAOS_KEY_SETS[2]),
            _ => (Hold::Lock, CHAOS_KEY_SETS[rng.random_range(0..2)]),
        };
        let name = names[0];
        let wait = ms(rng.random_range(50..500));
        let (w0, t0) = (mono_us(), Instant::now());
        let r: redbaton::Result<Box<dyn Guard>> = match hold {
            Hold::Lock => client.try_lock_for(name, wait).map(boxed),
            Hold::Read => rw.try_read_for(wait).map(boxed),
            Hold::Write => rw.try_write_for(wait).map(boxed),
            Hold::Upgradable => rw.try_upgradable_read_for(wait).map(boxed),
            Hold::Permit => sem.try_acquire_for(wait).map(boxed),
            Hold::Multi => client.try_multi_lock_for(names, wait).map(boxed),
        };
        let over = t0.elapsed().saturating_sub(wait);
        tally.max("max_overshoot_us", over.as_micros() as u64);
        let outcome = match &r {
            Ok(_) => "ok",
            Err(e) if e.is_timeout() => "timeout",
            Err(e) if e.is_connection() => "connection",
            Err(_) => "other",
        };
        if over > ms(250) {
            // start,end,overshoot,outcome,thread,stalled,call — the parent excuses calls
            // that overlapped a SIGSTOP of this process, and the time this process did not
            // run.
            let w1 = mono_us();
            tally.slow.lock().unwrap().push(format!(
                "{w0},{w1},{},{outcome},{holder},{},{}",
                over.as_micros(),
                watch.stalls().within(w0, w1),
                hold.call()
            ));
        }
        match r {
            Ok(g) => {
                let at = SectionAt {
                    hold,
                    names,
                    holder,
                    called: w0,
                };
                chaos_section(g, at, &mut rng, &mut store, tally);
            }
            Err(e) if e.is_timeout() => tally.add("timeouts", 1),
            Err(e) if e.is_connection() => {
                tally.add("connection_errors", 1);
                thread::sleep(ms(20));
            }
            Err(e) => {
                tally.add("other_errors", 1);
                let msg: String = no_spaces(&e.to_string()).chars().take(120).collect();
                *tally.other_errors.lock().unwrap().entry(msg).or_default() += 1;
                thread::sleep(ms(20));
            }
        }
    }
}

/// Where a chaos section runs: what it holds, of which names (two for a multi-lock, one
/// otherwise), in which thread, and when its call began.
struct SectionAt<'a> {
    hold: Hold,
    names: &'static [&'static str],
    holder: &'a str,
    called: u64,
}

/// One critical section on a hold just acquired, reported to the store for the parent's
/// checks. Lock and write sections write through the fenced storage at their begin and
/// end; reads (readers of different processes share tokens) and permits (which have no
/// token) do not, they only count as progress.
fn chaos_section(
    g: Box<dyn Guard>,
    at: SectionAt<'_>,
    rng: &mut StdRng,
    store: &mut Store,
    tally: &Tally,
) {
    let SectionAt {
        hold,
        names,
        holder,
        called,
    } = at;
    tally.add("acquired", 1);
    let tokens: Vec<u64> = names.iter().map(|name| g.token_of(name)).collect();
    let s = mono_us();
    // When the hold's lease began, or earlier: its validity counts from the send of the
    // round that won it (or of its last renewal so far), and no lease is longer than
    // LEASE (the drift margin makes it earlier still). Which server a permit came from,
    // across a restart, is told from it (see `ChaosSection::epoch`). The monotonic clock is
    // read before `valid_until`'s `now`, so that this is never later than the truth.
    let from =
        (mono_us() as i64 + signed_us_until(g.valid_until()) - LEASE.as_micros() as i64).max(0);
    if !matches!(hold, Hold::Lock | Hold::Multi) {
        store.began_shared(names[0], holder);
    }
    // Per name: the begin write's reply and the token the store had seen last.
    let begins: Vec<(i64, String)> = names
        .iter()
        .zip(&tokens)
        .map(|(name, &token)| {
            if hold.exclusive() {
                store.write("b", name, token, holder, s, 0)
            } else {
                (9, String::new()) // not sent
            }
        })
        .collect();
    if rng.random_range(0..40) == 0 {
        // A long section (past a few renewals): the watchdog meets the faults.
        // Conservative policy: stop between steps once the hold is known lost.
        tally.add("long_sections", 1);
        let until = Instant::now() + ms(rng.random_range(300..2000));
        while Instant::now() < until && g.check().is_ok() {
            thread::sleep(ms(50).min(until.saturating_duration_since(Instant::now())));
        }
    } else {
        thread::sleep(Duration::from_micros(rng.random_range(0..15_000)));
    }
    let e = mono_us();
    // Checked after reading the end time: if the hold is still ours now, it was ours
    // during all of [s, e].
    let left_us = signed_us_until(g.valid_until());
    let check = match g.check() {
        Ok(()) => "ok".to_owned(),
        Err(err) => no_spaces(&err.to_string()),
    };
    let valid = check == "ok";
    // The end write goes out even when the hold is known lost (the aggressive policy):
    // the fencing storage must refuse it if a newer holder began.
    let ends: Vec<i64> = names
        .iter()
        .zip(&tokens)
        .zip(&begins)
        .map(|((name, &token), &(r1, _))| {
            if r1 == 1 {
                store.write("e", name, token, holder, s, e).0
            } else {
                9 // not sent
            }
        })
        .collect();
    tally.add(
        if valid {
            "valid_sections"
        } else {
            "lost_sections"
        },
        1,
    );
    match (hold, valid) {
        (Hold::Lock, _) => {}
        (Hold::Read, true) => tally.add("valid_reads", 1),
        (Hold::Read, false) => tally.add("lost_reads", 1),
        (Hold::Write, true) => tally.add("valid_writes", 1),
        (Hold::Write, false) => tally.add("lost_writes", 1),
        (Hold::Upgradable, true) => tally.add("valid_upgradable_reads", 1),
        (Hold::Upgradable, false) => tally.add("lost_upgradable_reads", 1),
        (Hold::Permit, true) => tally.add("valid_permits", 1),
        (Hold::Permit, false) => tally.add("lost_permits", 1),
        (Hold::Multi, true) => tally.add("valid_multi_locks", 1),
        (Hold::Multi, false) => tally.add("lost_multi_locks", 1),
    }
    for (&(r1, _), &r2) in begins.iter().zip(&ends) {
        match r1 {
            1 => tally.add("begin_accepted", 1),
            0 => tally.add("begin_stale", 1),
            9 => {}
            _ => tally.add("begin_duplicate", 1),
        }
        match (r2, valid) {
            (0, true) => tally.add("end_stale_valid", 1),
            (0, false) => tally.add("end_stale_lost", 1),
            (1, false) => tally.add("end_accepted_lost", 1),
            _ => {}
        }
    }
    // A write hold is sometimes turned into a read hold, an upgradable read into the write
    // hold, where the section ends: the next section, on the hold the guard became, begins
    // once the call returns (no other holder may get in between; the checks say so).
    let (unlocked, next) = match hold.converts_to() {
        Some(into) if rng.random_range(0..3) == 0 => match g.convert(ms(rng.random_range(50..500)))
        {
            Ok(next) => ("unlock_converted", Some((into, next))),
            Err(back) => {
                // A refused upgrade gives its guard back; a failed downgrade the write
                // hold (as a drop does).
                if let Some(g) = back {
                    let _ = g.unlock();
                }
                ("unlock_convert_failed", None)
            }
        },
        _ => (
            match g.unlock() {
                Ok(Unlocked::Released) => "unlock_released",
                Ok(Unlocked::HandedOff) => "unlock_handed_off",
                Ok(Unlocked::Expired) => "unlock_expired",
                Ok(Unlocked::HeldByOther) => "unlock_held_by_other",
                Ok(_) => "unlock_other",
                Err(_) => "unlock_errors",
            },
            None,
        ),
    };
    tally.add(unlocked, 1);
    // One line per section for the invariants and the history: token, holder
    // (pid.thread), start, end, whether `check()` was Ok at the end, the two fenced
    // writes' replies, the token the begin saw, when the call started, the validity left
    // at the end (µs, negative once past), `check()`'s answer, the unlock's outcome,
    // what was held (see `Hold::code`) and a time its lease began at or after. A
    // multi-lock's section is one line on each of its names, with that name's token.
    for (((name, token), (r1, last1)), r2) in names.iter().zip(&tokens).zip(&begins).zip(&ends) {
        store.report(
            name,
            format!(
                "{token:020} {holder} {s} {e} {} {r1} {r2} {last1} {called} {left_us} {check} {} {} {from}",
                u8::from(valid),
                unlocked.trim_start_matches("unlock_"),
                hold.code()
            ),
        );
    }
    if let Some((into, g)) = next {
        let at = SectionAt {
            hold: into,
            names,
            holder,
            called: mono_us(),
        };
        chaos_section(g, at, rng, store, tally);
    }
}

/// What a chaos section holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Hold {
    /// A plain lock (`try_lock_for`).
    Lock,
    /// A read hold of the read-write lock (`try_read_for`).
    Read,
    /// The write hold of the read-write lock (`try_write_for`), or the one an upgrade made.
    Write,
    /// The upgradable read of the read-write lock (`try_upgradable_read_for`): a read that
    /// excludes writes and the other upgradable reads.
    Upgradable,
    /// A permit of the semaphore (`try_acquire_for`).
    Permit,
    /// Both plain locks at once (`try_multi_lock_for`): on each name, a lock.
    Multi,
}

impl Hold {
    const ALL: [Hold; 6] = [
        Hold::Lock,
        Hold::Read,
        Hold::Write,
        Hold::Upgradable,
        Hold::Permit,
        Hold::Multi,
    ];

    /// Its code in a section report.
    fn code(self) -> &'static str {
        match self {
            Hold::Lock => "x",
            Hold::Read => "r",
            Hold::Write => "w",
            Hold::Upgradable => "u",
            Hold::Permit => "p",
            Hold::Multi => "m",
        }
    }

    fn parse(code: &str) -> Option<Hold> {
        Hold::ALL.into_iter().find(|h| h.code() == code)
    }

    /// Its word before "section" in a history line.
    fn label(self) -> &'static str {
        match self {
            Hold::Lock => "",
            Hold::Read => "read ",
            Hold::Write => "write ",
            Hold::Upgradable => "upgradable read ",
            Hold::Permit => "permit ",
            Hold::Multi => "multi-lock ",
        }
    }

    /// The call that asks for it.
    fn call(self) -> &'static str {
        match self {
            Hold::Lock => "try_lock_for",
            Hold::Read => "try_read_for",
            Hold::Write => "try_write_for",
            Hold::Upgradable => "try_upgradable_read_for",
            Hold::Permit => "try_acquire_for",
            Hold::Multi => "try_multi_lock_for",
        }
    }

    /// Whether nobody else holds the name while it is held: a lock, a write or a
    /// multi-lock. Such a section's token is its own, so it goes through the fenced storage.
    fn exclusive(self) -> bool {
        matches!(self, Hold::Lock | Hold::Write | Hold::Multi)
    }

    /// Whether it has a fencing token (all but a permit).
    fn fenced(self) -> bool {
        self != Hold::Permit
    }

    /// Whether two sections of these holds may not overlap: either excludes everyone, or
    /// both are upgradable reads.
    fn conflicts(self, other: Hold) -> bool {
        self.exclusive()
            || other.exclusive()
            || (self, other) == (Hold::Upgradable, Hold::Upgradable)
    }

    /// What its guard turns into: a write hold into a read hold (`downgrade`), an
    /// upgradable read into the write hold (`try_upgrade_for`).
    fn converts_to(self) -> Option<Hold> {
        match self {
            Hold::Write => Some(Hold::Read),
            Hold::Upgradable => Some(Hold::Write),
            Hold::Lock | Hold::Read | Hold::Permit | Hold::Multi => None,
        }
    }
}

/// What a chaos section needs of its guard, whatever it holds.
trait Guard {
    /// Its fencing token; 0 for a permit, which has none.
    fn token(&self) -> u64;
    /// Its fencing token on `name`, one of the names it holds: a multi-lock has one each.
    fn token_of(&self, _name: &str) -> u64 {
        self.token()
    }
    fn valid_until(&self) -> Instant;
    fn check(&self) -> redbaton::Result<()>;
    fn unlock(self: Box<Self>) -> redbaton::Result<Unlocked>;
    /// Turns the hold into what [`Hold::converts_to`] says, waiting at most `wait`; on an
    /// error, the guard it gives back, if any. Only called for a hold that converts.
    fn convert(self: Box<Self>, wait: Duration) -> Result<Box<dyn Guard>, Option<Box<dyn Guard>>>;
}

macro_rules! chaos_guard {
    ($($guard:ty: $token:expr, $convert:expr);*) => {$(
        impl Guard for $guard {
            fn token(&self) -> u64 {
                $token(self)
            }
            fn valid_until(&self) -> Instant {
                <$guard>::valid_until(self)
            }
            fn check(&self) -> redbaton::Result<()> {
                <$guard>::check(self)
            }
            fn unlock(self: Box<Self>) -> redbaton::Result<Unlocked> {
                <$guard>::unlock(*self)
            }
            fn convert(
                self: Box<Self>,
                wait: Duration,
            ) -> Result<Box<dyn Guard>, Option<Box<dyn Guard>>> {
                $convert(*self, wait)
            }
        }
    )*};
}
/// The conversion of a guard whose hold converts to nothing.
fn no_conversion<G>(_: G, _: Duration) -> Result<Box<dyn Guard>, Option<Box<dyn Guard>>> {
    unreachable!("only a write hold or an upgradable read converts")
}
chaos_guard!(
    redbaton::LockGuard: redbaton::LockGuard::fencing_token, no_conversion;
    redbaton::ReadGuard: redbaton::ReadGuard::fencing_token, no_conversion;
    redbaton::WriteGuard: redbaton::WriteGuard::fencing_token,
        |g: redbaton::WriteGuard, _| g.downgrade().map(boxed).map_err(|_| None);
    redbaton::UpgradableReadGuard: redbaton::UpgradableReadGuard::fencing_token,
        |g: redbaton::UpgradableReadGuard, wait| g
            .try_upgrade_for(wait)
            .map(boxed)
            .map_err(|e| Some(boxed(e.into_guard())));
    redbaton::Permit: |_| 0, no_conversion
);

impl Guard for redbaton::MultiGuard {
    fn token(&self) -> u64 {
        unreachable!("a multi-lock has a token per name")
    }
    fn token_of(&self, name: &str) -> u64 {
        self.fencing_token(name)
            .expect("a name the multi-lock holds")
    }
    fn valid_until(&self) -> Instant {
        redbaton::MultiGuard::valid_until(self)
    }
    fn check(&self) -> redbaton::Result<()> {
        redbaton::MultiGuard::check(self)
    }
    fn unlock(self: Box<Self>) -> redbaton::Result<Unlocked> {
        redbaton::MultiGuard::unlock(*self)
    }
    fn convert(self: Box<Self>, wait: Duration) -> Result<Box<dyn Guard>, Option<Box<dyn Guard>>> {
        no_conversion(*self, wait)
    }
}

fn boxed<G: Guard + 'static>(g: G) -> Box<dyn Guard> {
    Box::new(g)
}

/// Microseconds of CLOCK_MONOTONIC: one clock for the parent and its children (on Linux),
/// which an NTP step cannot move, so that sections of different processes compare.
fn mono_us() -> u64 {
    mono_ns() / 1000
}

/// `s` with its whitespace replaced: report lines are split on spaces.
fn no_spaces(s: &str) -> String {
    s.chars()
        .map(|c| if c.is_whitespace() { '_' } else { c })
        .collect()
}

/// Microseconds from now until `t`, negative once `t` has passed.
fn signed_us_until(t: Instant) -> i64 {
    let now = Instant::now();
    if t >= now {
        (t - now).as_micros() as i64
    } else {
        -((now - t).as_micros() as i64)
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
    /// Lock servers SIGSTOPped for a while, then resumed (Redlock only: a single server
    /// paused is what a proxy dropping every byte does).
    PauseServer,
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

/// The faults of a Redlock run: those of a single server (`faults`, `N` of them), then as
/// many pauses of its nodes as make `M`.
const fn and_node_pauses<const N: usize, const M: usize>(faults: [Fault; N]) -> [Fault; M] {
    let mut all = [Fault::PauseServer; M];
    let mut i = 0;
    while i < N {
        all[i] = faults[i];
        i += 1;
    }
    all
}

const REDLOCK_FAULTS: [Fault; 9] = and_node_pauses(ALL_FAULTS);
/// The random phase of a Redlock run: a pause of nodes as rare as a restart.
const REDLOCK_WEIGHTED_FAULTS: [Fault; 15] = and_node_pauses(WEIGHTED_FAULTS);

/// One step of the fault schedule, with every random choice it may need. All are drawn
/// whatever the fault, so that the schedule depends on the seed alone, not on which
/// process happened to hold a lock when a step ran.
#[derive(Clone, Copy, Debug)]
struct Step {
    fault: Fault,
    /// A process fault targets the process of this name's last accepted begin (of the
    /// read-write lock and the semaphore: its last section's begin, of any kind)...
    key: &'static str,
    /// ...or this slot when the key has none.
    fallback: usize,
    /// The proxy of a proxy fault.
    proxy: usize,
    /// A SIGSTOP lasts a lease plus this.
    pause_extra: Duration,
    /// The latency a delaying proxy adds, and for how long.
    delay: Duration,
    delay_for: Duration,
    /// How long a proxy drops every byte.
    blackhole_for: Duration,
    /// The pause after a fault before progress is checked.
    settle: Duration,
    /// Redlock: the nodes a node or proxy fault is aimed at (a bit each: one node, a
    /// minority, or two or three, a majority), how long a paused node stays stopped, and
    /// how much longer than a lease a killed one stays down.
    nodes: u8,
    node_pause: Duration,
    down_extra: Duration,
}

/// The fault schedule of a seed: every kind once in a seeded order, then seeded random
/// kinds until the time is up.
struct Schedule {
    rng: StdRng,
    topology: Topology,
    first: Vec<Fault>,
    taken: usize,
}

impl Schedule {
    fn new(seed: u64, topology: Topology) -> Schedule {
        let mut rng = StdRng::seed_from_u64(history::derive(seed, 0));
        let mut first = topology.faults().0.to_vec();
        first.shuffle(&mut rng);
        Schedule {
            rng,
            topology,
            first,
            taken: 0,
        }
    }

    fn next_step(&mut self) -> Step {
        let rng = &mut self.rng;
        let (_, weighted) = self.topology.faults();
        let names = self.topology.names();
        let random = weighted[rng.random_range(0..weighted.len())];
        let mut step = Step {
            fault: self.first.get(self.taken).copied().unwrap_or(random),
            key: names[rng.random_range(0..names.len())],
            fallback: rng.random_range(0..CHAOS_PROCS),
            proxy: rng.random_range(0..2),
            pause_extra: ms(rng.random_range(200..800)),
            delay: ms(rng.random_range(50..400)),
            delay_for: ms(rng.random_range(500..2000)),
            blackhole_for: ms(rng.random_range(300..1500)),
            settle: ms(rng.random_range(200..800)),
            nodes: 1,
            node_pause: Duration::ZERO,
            down_extra: Duration::ZERO,
        };
        // Drawn only for Redlock, so that a single-server seed keeps its schedule.
        if self.topology == Topology::Redlock {
            let all = (1u8 << REDLOCK_NODES) - 1;
            let one = 1u8 << rng.random_range(0..REDLOCK_NODES);
            // Half the faults hit one node, a third two (all but one), a sixth all three.
            step.nodes = match rng.random_range(0..6) {
                0..3 => one,
                3..5 => all & !one,
                _ => all,
            };
            step.node_pause = ms(rng.random_range(300..2000));
            step.down_extra = ms(rng.random_range(100..1000));
        }
        self.taken += 1;
        step
    }
}

/// How many lock servers a Redlock chaos run has.
const REDLOCK_NODES: usize = 3;

/// The lock servers of a chaos run and the proxies in front of them.
struct Rig {
    nodes: Vec<RedisServer>,
    /// Single: two proxies in front of the one server (children alternate between them, so
    /// that a proxy fault partitions some processes and not others); Redlock: proxy `i` in
    /// front of node `i`, which every child reaches through it.
    proxies: Vec<Proxy>,
    topology: Topology,
}

impl Rig {
    fn start(topology: Topology) -> Rig {
        let n = match topology {
            Topology::Single => 1,
            Topology::Redlock => REDLOCK_NODES,
        };
        // Keyspace notifications on in the config file, as an operator would set them (a
        // restart keeps them).
        let nodes: Vec<RedisServer> = (0..n)
            .map(|_| {
                RedisServer::builder()
                    .config("notify-keyspace-events", "Kg$xe")
                    .start()
            })
            .collect();
        let proxies = match topology {
            Topology::Single => vec![Proxy::start(nodes[0].addr()), Proxy::start(nodes[0].addr())],
            Topology::Redlock => nodes.iter().map(|n| Proxy::start(n.addr())).collect(),
        };
        Rig {
            nodes,
            proxies,
            topology,
        }
    }

    fn describe(&self) -> String {
        let nodes: Vec<String> = self.nodes.iter().map(RedisServer::url).collect();
        let proxies: Vec<String> = self.proxies.iter().map(Proxy::url).collect();
        format!(
            "lock servers {} behind proxies {}",
            nodes.join(" "),
            proxies.join(" ")
        )
    }

    /// The lock URLs of the child in `slot` (see `chaos_child`), and which proxies they are.
    fn urls_for(&self, slot: usize) -> (String, String) {
        match self.topology {
            Topology::Single => {
                let proxy = slot % self.proxies.len();
                (self.proxies[proxy].url(), format!("proxy {proxy}"))
            }
            Topology::Redlock => {
                let urls: Vec<String> = self.proxies.iter().map(Proxy::url).collect();
                (urls.join(" "), "every node's proxy".to_owned())
            }
        }
    }

    /// The indices a node or proxy fault of `step` is aimed at.
    fn aimed(&self, step: &Step, single: usize) -> Vec<usize> {
        match self.topology {
            Topology::Single => vec![single],
            Topology::Redlock => (0..REDLOCK_NODES)
                .filter(|i| step.nodes & (1 << i) != 0)
                .collect(),
        }
    }

    fn nodes_of(&self, step: &Step) -> Vec<&RedisServer> {
        self.aimed(step, 0)
            .into_iter()
            .map(|i| &self.nodes[i])
            .collect()
    }

    fn proxies_of(&self, step: &Step) -> Vec<&Proxy> {
        self.aimed(step, step.proxy)
            .into_iter()
            .map(|i| &self.proxies[i])
            .collect()
    }

    /// The nodes a fault is aimed at, in words: of Redlock, which and whether a majority.
    fn nodes_aimed(&self, step: &Step) -> String {
        match self.topology {
            Topology::Single => "the lock server".to_owned(),
            Topology::Redlock => self.of_redlock("node", step),
        }
    }

    fn proxies_aimed(&self, step: &Step) -> String {
        match self.topology {
            Topology::Single => format!("proxy {}", step.proxy),
            Topology::Redlock => self.of_redlock("proxy of node", step),
        }
    }

    fn of_redlock(&self, what: &str, step: &Step) -> String {
        let aimed = self.aimed(step, 0);
        let share = if aimed.len() * 2 > REDLOCK_NODES {
            "a majority"
        } else {
            "a minority"
        };
        format!("{what} {aimed:?} ({share})")
    }
}

/// Kills the library's command connections to `srv` by name (`redbaton`, so that no
/// harness connection is touched); how many.
fn kill_command_conns(srv: &RedisServer) -> u64 {
    let mut conn = srv.conn();
    let ids: Vec<String> = srv
        .client_list()
        .into_iter()
        .filter(|c| c.get("name").map(String::as_str) == Some("redbaton"))
        .filter_map(|c| c.get("id").cloned())
        .collect();
    ids.iter()
        .map(|id| {
            redis::cmd("CLIENT")
                .arg("KILL")
                .arg("ID")
                .arg(id)
                .query::<i64>(&mut conn)
                .unwrap_or(0) as u64
        })
        .sum()
}

/// The seed of the `n`th child process spawned by the run seeded `seed` (stream 0 is the
/// fault schedule).
fn child_seed(seed: u64, n: usize) -> u64 {
    history::derive(seed, 1 + n as u64)
}

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

/// One critical section of a chaos run as its thread reported it (see `chaos_worker`),
/// with what the run's history tells of it: not the [`redbaton_testkit::sections::Section`]
/// of the exclusion tests, since a chaos verdict needs the store's replies and the timings.
struct ChaosSection {
    key: &'static str,
    hold: Hold,
    token: u64,
    holder: String,
    s: u64,
    e: u64,
    valid: bool,
    r1: i64,
    r2: i64,
    last1: u64,
    called: u64,
    left_us: i64,
    check: String,
    unlock: String,
    /// Its lease began at this time or after it (µs of CLOCK_MONOTONIC, see
    /// `chaos_section`).
    from: u64,
}

impl ChaosSection {
    fn parse(key: &'static str, line: &str) -> Option<ChaosSection> {
        let f: Vec<&str> = line.split(' ').collect();
        Some(ChaosSection {
            key,
            token: f.first()?.parse().ok()?,
            holder: (*f.get(1)?).to_owned(),
            s: f.get(2)?.parse().ok()?,
            e: f.get(3)?.parse().ok()?,
            valid: *f.get(4)? == "1",
            r1: f.get(5)?.parse().ok()?,
            r2: f.get(6)?.parse().ok()?,
            last1: f.get(7)?.parse().unwrap_or(0),
            called: f.get(8)?.parse().ok()?,
            left_us: f.get(9)?.parse().ok()?,
            check: (*f.get(10)?).to_owned(),
            unlock: (*f.get(11)?).to_owned(),
            hold: Hold::parse(f.get(12)?)?,
            from: f.get(13)?.parse().ok()?,
        })
    }

    /// The lock-server epoch the section's hold came from, when it is known: its token's
    /// (see [`epoch_of`]); for a permit, which has no token, the restarts around its
    /// acquisition. A permit whose lease began after a restart's stall came from a later
    /// server (nothing sent then reached the old one), and a section that began before the
    /// restart's proxies let traffic through again holds one of an earlier server (no
    /// reply of the new one came before). `None` when its round spans a restart: it was
    /// sent before the stall and answered after it, by the old server (a reply the proxies
    /// held) or the new one (a retry).
    fn epoch(&self) -> Option<u64> {
        if self.hold.fenced() {
            return Some(epoch_of(self.token));
        }
        let restarts = RESTARTS.lock().unwrap();
        let after = restarts.iter().filter(|r| r.stalled <= self.from).count();
        let before = restarts.iter().filter(|r| r.resumed < self.s).count();
        (after == before).then_some(after as u64)
    }

    /// The section in a violation: what it held, token, holder, start and end.
    fn brief(&self) -> String {
        format!(
            "{}{}({}) [{}, {}]",
            self.hold.label(),
            if self.hold.fenced() {
                format!("{} ", self.token)
            } else {
                String::new()
            },
            self.holder,
            self.s,
            self.e
        )
    }

    /// The section as one history line.
    fn describe(&self) -> String {
        let epoch = self
            .epoch()
            .map_or_else(|| "uncertain".to_owned(), |n| n.to_string());
        let held = if self.hold.fenced() {
            format!(
                "token {} (epoch {epoch}, fence {}, handoff {})",
                self.token,
                fence_of(self.token),
                redbaton_testkit::keys::handoff_of(self.token)
            )
        } else {
            format!(
                "(epoch {epoch}, lease began at most {:.3} ms before)",
                self.s.saturating_sub(self.from) as f64 / 1000.0
            )
        };
        format!(
            "{}section {} {held} {:.3} ms [called {:.3} ms before], \
             validity left {:.3} ms, check {}, begin {} (store's last: {}), end {}, unlock {}",
            self.hold.label(),
            self.key,
            (self.e - self.s) as f64 / 1000.0,
            self.s.saturating_sub(self.called) as f64 / 1000.0,
            self.left_us as f64 / 1000.0,
            self.check,
            write_reply(self.r1),
            if self.last1 == 0 {
                "nothing".to_owned()
            } else {
                self.last1.to_string()
            },
            write_reply(self.r2),
            self.unlock
        )
    }
}

/// A reply of `FENCED_WRITE`, in words.
fn write_reply(r: i64) -> &'static str {
    match r {
        1 => "accepted",
        0 => "stale",
        -1 => "same-token-other-holder",
        -2 => "end-without-begin",
        9 => "not-sent",
        _ => "?",
    }
}

fn epoch_of(token: u64) -> u64 {
    let fence = fence_of(token);
    RESTARTS
        .lock()
        .unwrap()
        .iter()
        .filter(|r| r.fences_from <= fence)
        .count() as u64
}

/// How many sections have begun: the fenced storage's accepted begins, and the read-write
/// lock's and the semaphore's sections (see [`Store::began_shared`]).
fn progress(store: &mut redis::Connection) -> u64 {
    CHAOS_NAMES
        .iter()
        .map(|k| {
            let n: Vec<Option<u64>> = redis::cmd("HMGET")
                .arg(store_keys(k).0)
                .arg("begins")
                .arg("shared_begins")
                .query(store)
                .unwrap();
            n.into_iter().flatten().sum::<u64>()
        })
        .sum()
}

/// The process of the last section of `key` that began: the fenced storage's holder, or
/// for the read-write lock and the semaphore, the holder of its last section.
fn current_holder_pid(store: &mut redis::Connection, key: &str) -> Option<u32> {
    let (last, holder): (Option<String>, Option<String>) = redis::cmd("HMGET")
        .arg(store_keys(key).0)
        .arg("last")
        .arg("holder")
        .query(store)
        .unwrap();
    last.or(holder)?.split('.').next()?.parse().ok()
}

/// A number from the environment, or `default`; panics on a value that is not one (a typo
/// must not silently run another scenario).
fn env_u64(name: &str, default: u64) -> u64 {
    match std::env::var(name) {
        Ok(v) => v
            .trim()
            .parse()
            .unwrap_or_else(|e| panic!("{name}={v:?} is not a number: {e}")),
        Err(_) => default,
    }
}

/// Where chaos runs write their histories.
fn chaos_dir() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("chaos")
}

/// The text of a panic payload.
fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| (*s).to_owned()))
        .unwrap_or_else(|| "panic".to_owned())
}

/// Chaos, bounded (about 45 s), against real redis-servers.
///
/// Setup: the lock server L (keyspace notifications on in its config file, as an operator
/// would set them), two fault proxies in front of it (children alternate between them, so a
/// proxy fault partitions some processes and not others), and the storage server S, which
/// no fault touches. `CHAOS_PROCS` processes × `CHAOS_THREADS` threads run
/// `try_lock_for(random key, random 50..500 ms)` and a short critical section that writes
/// through the fenced storage; a quarter of their sections instead read (`try_read_for`)
/// or write (`try_write_for`, 30% of them) the read-write lock `CHAOS_RW`, whose writes
/// are fenced too (readers share tokens: a read is only reported), and a quarter take a
/// permit (`try_acquire_for`) of the semaphore `CHAOS_SEM` of `CHAOS_PERMITS` permits
/// (no token: a permit is only reported, and the parent counts the permits held at once).
/// One in eight of the plain-lock sections takes both plain locks at once
/// (`try_multi_lock_for`): a section on each name, with that name's token.
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
/// lock the new server never heard of until its next renewal. Tokens do not go back: a fence
/// is never below the server's clock, so the new server's first fences are above the old
/// one's. While both proxies stall all traffic, the parent restarts L and notes the time
/// (the epoch's start) before letting clients in. The fencing storage keeps comparing plain
/// tokens, and the mutual-exclusion and permit checks are made per epoch (a section of
/// epoch n may overlap one of epoch n+1: that is the unprotected window). A permit's epoch
/// is told from when its lease began and when it was acquired (see
/// `ChaosSection::epoch`); one whose round spans a restart belongs to no known epoch and
/// is left out of the permit check.
///
/// Redlock (the `redlock` topology, see the module docs): three lock servers, each behind
/// its own proxy, and only plain locks. A node fault is aimed at one node, or two or three
/// at once. A node restarted empty forgets its locks, and the holder keeps its lease on the
/// other nodes: a majority can then grant the name again only if no lease it held is still
/// running, which the operating rule for Redlock without persistence provides: a node that
/// crashed stays down for longer than a lease (here the lease plus a random extra, counted
/// from the kill). So restarts make no epochs in a Redlock run, and every check holds
/// across them, token order included (the nodes share this machine's clock).
///
/// Replay and history: see the module docs. Every random choice of the parent comes from
/// the fault schedule ([`Schedule`], stream 0 of the seed) and every child's from its own
/// stream ([`child_seed`]); what a seed cannot fix is timing (which process holds a lock
/// when a process fault comes, how many faults fit in the time).
#[test]
fn chaos() {
    init_log();
    // Run by the soak as a child process: exit if the soak goes away.
    child::is_child();
    let seed = history::seed(&["CHAOS_SEED"]);
    let secs = env_u64("REDBATON_CHAOS_SECS", CHAOS_SECS);
    let topology = Topology::of(seed);
    let replay = format!(
        "REDBATON_SEED={seed} REDBATON_CHAOS_SECS={secs} {}={} cargo test --test faults chaos",
        Topology::ENV,
        topology.label()
    );
    let dir = chaos_dir();
    eprintln!(
        "chaos seed {seed} ({} topology), {secs} s of faults; replay: {replay}; history: {}",
        topology.label(),
        History::path_in(&dir, "chaos", seed).display()
    );
    let started_us = mono_us();
    let mut hist = History::new("chaos", seed, started_us);
    hist.note(format!("replay: {replay}"));
    hist.note(match topology {
        Topology::Single => format!(
            "single lock server: {CHAOS_PROCS} processes x {CHAOS_THREADS} threads on keys \
             {CHAOS_KEYS:?}, read-write lock {CHAOS_RW:?} and semaphore {CHAOS_SEM:?} of \
             {CHAOS_PERMITS} permits"
        ),
        Topology::Redlock => format!(
            "Redlock of {REDLOCK_NODES} lock servers: {CHAOS_PROCS} processes x \
             {CHAOS_THREADS} threads on keys {CHAOS_KEYS:?}; a node restarts after over a lease"
        ),
    });
    hist.note(format!(
        "lease {LEASE:?}, renew every {RENEW:?}, network timeouts {NET:?}, {secs} s of faults \
         then {CALM:?} calm"
    ));
    hist.note("times: ms since the start; sources: parent, child pid, or pid.thread");
    let mut violations: Vec<Violation> = Vec::new();
    let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        run_chaos(seed, secs, topology, &mut hist, &mut violations)
    }));
    let stalls = ran.unwrap_or_else(|p| {
        violations.push(Violation::new(
            Kind::Other,
            format!("the harness panicked: {}", panic_text(&*p)),
        ));
        Stalls::default()
    });
    let path = hist.write(&dir, &violations);
    let mut verdict = Verdict::of(seed, &path, &violations);
    verdict.stalled_ms = stalls.total() / 1000;
    verdict.print();
    eprintln!(
        "{} violations; history: {}",
        violations.len(),
        path.display()
    );
    assert!(
        violations.is_empty(),
        "{} topology: {}",
        topology.label(),
        history::failure_message("chaos", seed, &replay, &violations, &path)
    );
}

/// One chaos scenario: events go to `hist`, findings to `violations`; returns when the
/// harness itself was stalled.
fn run_chaos(
    seed: u64,
    secs: u64,
    topology: Topology,
    hist: &mut History,
    violations: &mut Vec<Violation>,
) -> Stalls {
    let mut schedule = Schedule::new(seed, topology);
    let chaos_for = Duration::from_secs(secs);
    // Liveness is judged on the time this process actually ran (see `stalls`).
    let watch = StallWatch::start();

    let rig = Rig::start(topology);
    let proxies = &rig.proxies;
    let store_srv = RedisServer::start();
    let mut store = store_srv.conn();
    RESTARTS.lock().unwrap().clear();
    let started = Instant::now();
    let chaos_end = started + chaos_for;
    let end_at_us = mono_us() + (chaos_for + CALM).as_micros() as u64;
    hist.event(
        mono_us(),
        "parent",
        format!("servers up: {}, store {}", rig.describe(), store_srv.url()),
    );

    let mut spawned = 0usize;
    let mut spawn = |slot: usize, hist: &mut History| -> Child {
        let child_seed = child_seed(seed, spawned);
        spawned += 1;
        let (urls, via) = rig.urls_for(slot);
        let c = child::spawn_self(
            "chaos_child",
            &[
                ("CHAOS_LOCK_URL", urls),
                ("CHAOS_STORE_URL", store_srv.url()),
                ("CHAOS_END_AT_US", end_at_us.to_string()),
                ("CHAOS_CHILD_SEED", child_seed.to_string()),
            ],
        );
        hist.event(
            mono_us(),
            "parent",
            format!(
                "spawned child {} in slot {slot} (via {via}, seed {child_seed})",
                c.id()
            ),
        );
        c
    };
    let mut children = Children {
        slots: (0..CHAOS_PROCS).map(|i| Some(spawn(i, hist))).collect(),
    };

    let mut injected: BTreeMap<Fault, (u32, u32)> = BTreeMap::new();
    let mut pauses: Vec<(u32, u64, u64)> = Vec::new();
    let mut epoch = 0u64;
    let mut max_recovery_us = 0u64;
    let mut detail: BTreeMap<&str, u64> = BTreeMap::new();

    // Let everyone start before the first fault.
    let t0 = mono_us();
    if eventually(Duration::from_secs(15), || {
        (progress(&mut store) > 0).then_some(())
    })
    .is_none()
    {
        no_progress(
            &watch.stalls(),
            t0,
            Duration::from_secs(15),
            "before the first fault",
            hist,
            violations,
        );
    }

    while Instant::now() < chaos_end {
        let step = schedule.next_step();
        let fault = step.fault;
        let before = progress(&mut store);
        let target = {
            let pid = current_holder_pid(&mut store, step.key);
            children
                .slots
                .iter()
                .position(|c| c.as_ref().is_some_and(|c| Some(c.id()) == pid))
                .unwrap_or(step.fallback)
        };
        let target_pid = children.slots[target].as_ref().map_or(0, |c| c.id());
        let n = schedule.taken;
        let what = match fault {
            Fault::KillHolder | Fault::PauseHolder => {
                format!(
                    "{fault:?} child {target_pid} (slot {target}, {} holder)",
                    step.key
                )
            }
            Fault::ProxyDelay => format!(
                "{fault:?} {} +{:?} for {:?}",
                rig.proxies_aimed(&step),
                step.delay,
                step.delay_for
            ),
            Fault::ProxyBlackhole => {
                format!(
                    "{fault:?} {} for {:?}",
                    rig.proxies_aimed(&step),
                    step.blackhole_for
                )
            }
            Fault::ProxyReset => format!("{fault:?} {}", rig.proxies_aimed(&step)),
            Fault::PauseServer => format!(
                "{fault:?} {} for {:?}",
                rig.nodes_aimed(&step),
                step.node_pause
            ),
            Fault::RestartServer if topology == Topology::Redlock => format!(
                "{fault:?} {}: killed, down for {:?} (the lease and {:?})",
                rig.nodes_aimed(&step),
                LEASE + step.down_extra,
                step.down_extra
            ),
            _ => format!("{fault:?} {}", rig.nodes_aimed(&step)),
        };
        hist.event(mono_us(), "parent", format!("fault {n}: {what}"));
        match fault {
            Fault::KillHolder => {
                let mut c = children.slots[target].take().expect("live child");
                child::kill_child(&mut c, libc::SIGKILL);
                let out = child::wait_output(c, Duration::from_secs(10));
                hist.event(
                    mono_us(),
                    "parent",
                    format!("child {target_pid} killed: {}", out.status),
                );
                children.slots[target] = Some(spawn(target, hist));
            }
            Fault::PauseHolder => {
                let c = children.slots[target].as_mut().expect("live child");
                let stop_at = mono_us();
                child::kill_child(c, libc::SIGSTOP);
                thread::sleep(LEASE + step.pause_extra);
                child::kill_child(c, libc::SIGCONT);
                pauses.push((target_pid, stop_at, mono_us()));
            }
            Fault::KillSubscribers => {
                for srv in rig.nodes_of(&step) {
                    let n = srv.kill_pubsub();
                    *detail.entry("subscriber connections killed").or_default() += n as u64;
                }
            }
            Fault::KillCommandConns => {
                for srv in rig.nodes_of(&step) {
                    *detail.entry("command connections killed").or_default() +=
                        kill_command_conns(srv);
                }
            }
            Fault::RestartServer if topology == Topology::Redlock => {
                // Down for longer than a lease: every lease the nodes granted before the
                // kill has ended when they come back empty (see `chaos`), so no epoch.
                let aimed = rig.nodes_of(&step);
                for srv in &aimed {
                    srv.kill();
                }
                thread::sleep(LEASE + step.down_extra);
                for srv in &aimed {
                    srv.restart();
                }
                *detail.entry("node restarts").or_default() += aimed.len() as u64;
            }
            Fault::PauseServer => {
                let aimed = rig.nodes_of(&step);
                for srv in &aimed {
                    srv.pause();
                }
                thread::sleep(step.node_pause);
                for srv in &aimed {
                    srv.resume();
                }
            }
            Fault::RestartServer => {
                for p in proxies {
                    p.stall(true);
                }
                let stalled = mono_us();
                rig.nodes[0].restart();
                epoch += 1;
                // Every fence of the old server was issued before the restart, and every
                // fence of the new one will be after the proxies let clients in again.
                let start = wall_us();
                RESTARTS.lock().unwrap().push(Restart {
                    fences_from: start,
                    stalled,
                    resumed: mono_us(),
                });
                for p in proxies {
                    p.stall(false);
                }
                hist.event(
                    mono_us(),
                    "parent",
                    format!("lock server restarted: epoch {epoch} from {start} µs"),
                );
            }
            Fault::ProxyDelay => {
                let aimed = rig.proxies_of(&step);
                for p in &aimed {
                    p.set_delay(step.delay);
                }
                thread::sleep(step.delay_for);
                for p in &aimed {
                    p.set_delay(Duration::ZERO);
                }
            }
            Fault::ProxyBlackhole => {
                let aimed = rig.proxies_of(&step);
                for p in &aimed {
                    p.blackhole(true);
                }
                thread::sleep(step.blackhole_for);
                for p in &aimed {
                    p.blackhole(false);
                }
            }
            Fault::ProxyReset => {
                for p in rig.proxies_of(&step) {
                    p.kill_all();
                }
            }
        }
        hist.event(mono_us(), "parent", format!("fault {n}: over"));
        thread::sleep(step.settle);
        let healed = Instant::now();
        let healed_us = mono_us();
        // The children stop starting sections at `end_at_us`: a fault that ends less than
        // the progress limit before that cannot be judged on it (the run ends first).
        let window = Duration::from_micros(end_at_us.saturating_sub(healed_us));
        let limit = PROGRESS_LIMIT.min(window);
        let survived =
            eventually(limit, || (progress(&mut store) > before).then_some(())).is_some();
        max_recovery_us = max_recovery_us.max(healed.elapsed().as_micros() as u64);
        let e = injected.entry(fault).or_default();
        e.0 += 1;
        if !survived && limit < PROGRESS_LIMIT {
            hist.event(
                mono_us(),
                "parent",
                format!(
                    "no progress after fault {n} ({what}) before the children's end, {} ms \
                     later: not judged (the limit is {PROGRESS_LIMIT:?})",
                    window.as_millis()
                ),
            );
            *detail.entry("late faults not judged").or_default() += 1;
            e.1 += 1;
        } else if survived
            || !no_progress(
                &watch.stalls(),
                healed_us,
                PROGRESS_LIMIT,
                &format!("after fault {n} ({what})"),
                hist,
                violations,
            )
        {
            e.1 += 1;
        }
    }
    for p in proxies {
        p.heal();
    }
    hist.event(mono_us(), "parent", "faults over; proxies healed");

    // Children stop on their own at end_at_us; bound the wait.
    let mut results: Vec<HashMap<String, String>> = Vec::new();
    let mut slow_lines: Vec<(u32, String)> = Vec::new();
    for slot in children.slots.iter_mut() {
        let c = slot.take().expect("live child");
        let pid = c.id();
        let out = child::wait_output(c, CALM + Duration::from_secs(90));
        hist.event(
            mono_us(),
            pid.to_string(),
            format!("exited: {}", out.status),
        );
        if !out.status.success() {
            violations.push(Violation::new(
                Kind::Other,
                format!(
                    "child {pid} exited with {}\n--- stdout ---\n{}\n--- stderr ---\n{}",
                    out.status, out.stdout, out.stderr
                ),
            ));
        }
        for r in child::parse_results(&out.stdout) {
            if let Some(s) = r.get("slow") {
                slow_lines.push((pid, s.clone()));
            } else if let Some(msg) = r.get("other_error") {
                eprintln!("child {pid}: other error x{}: {msg}", r["n"]);
                hist.event(
                    mono_us(),
                    pid.to_string(),
                    format!("other error x{}: {msg}", r["n"]),
                );
            } else {
                results.push(r);
            }
        }
    }

    // No key the library would not let expire, once every child has exited (a killed
    // child's lock key and marks are there until their TTLs run out: that is allowed).
    let policy = KeyPolicy::new(LEASE, CHAOS_RECHECK);
    for (i, srv) in rig.nodes.iter().enumerate() {
        for bad in leftover::misplaced(&mut srv.conn(), CHAOS_KEYSPACE, &CHAOS_NAMES, &policy) {
            let held = leftover::contents(&mut srv.conn(), &bad.key);
            hist.event(
                mono_us(),
                "parent",
                format!("key left on node {i}: {bad}; {held}"),
            );
            violations.push(Violation::new(Kind::KeysLeft, format!("node {i}: {bad}")));
        }
    }

    // --- invariants ---
    let mut sections: Vec<ChaosSection> = Vec::new();
    for key in CHAOS_NAMES {
        let (_, accepted, reports) = store_keys(key);
        let lines: Vec<String> = redis::cmd("LRANGE")
            .arg(&reports)
            .arg(0)
            .arg(-1)
            .query(&mut store)
            .unwrap();
        for l in lines {
            match ChaosSection::parse(key, &l) {
                Some(s) => sections.push(s),
                None => violations.push(Violation::new(
                    Kind::Other,
                    format!("{key}: unreadable section report {l:?}"),
                )),
            }
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
                violations.push(Violation::new(
                    Kind::TokenRegression,
                    format!("{key}: accepted tokens not increasing: {w:?}"),
                ));
            }
        }
        *detail.entry("accepted sections").or_default() += tokens.len() as u64;
    }
    for s in &sections {
        hist.event(s.s, s.holder.clone(), s.describe());
    }
    let mut per_epoch: BTreeMap<u64, u64> = BTreeMap::new();
    for s in &sections {
        match s.epoch() {
            Some(n) => *per_epoch.entry(n).or_default() += 1,
            None => {
                *detail
                    .entry("permit sections of no known epoch (a round across a restart)")
                    .or_default() += 1;
            }
        }
        if s.r1 == -1 || s.r2 == -1 {
            violations.push(Violation::new(
                Kind::DuplicateToken,
                format!(
                    "{}: token {} accepted from two holders (last {})",
                    s.key, s.token, s.holder
                ),
            ));
        }
        if s.r1 == -2 || s.r2 == -2 {
            violations.push(Violation::new(
                Kind::Other,
                format!("{}: end without begin for {}", s.key, s.token),
            ));
        }
        // A section still valid at its end whose begin was refused as stale: a higher
        // token of the same epoch was accepted while this holder held the lock.
        if s.valid && s.r1 == 0 && epoch_of(s.last1) == epoch_of(s.token) {
            violations.push(Violation::new(
                Kind::Overlap,
                format!(
                    "{}: valid section {} ({}) refused as stale by {}",
                    s.key, s.token, s.holder, s.last1
                ),
            ));
        }
    }
    // The sections whose holder still held the name at their end, per name, by epoch and
    // start: mutual exclusion and the order of the fencing tokens; of the semaphore, the
    // number of permits held at once. A section of no known epoch is left out: it may
    // overlap those of either (the unprotected window of a restart, see `chaos`).
    for key in CHAOS_NAMES {
        let mut valid: Vec<&ChaosSection> = sections
            .iter()
            .filter(|s| s.key == key && s.valid && s.epoch().is_some())
            .collect();
        valid.sort_by_key(|s| (s.epoch(), s.s));
        if key == CHAOS_SEM {
            permits_held(key, &valid, CHAOS_PERMITS, violations);
        } else {
            exclusion(key, &valid, violations);
            token_order(key, &valid, violations);
        }
    }
    // Deadlines: a call slower than wait + NET_BUDGET is a violation unless its process was
    // SIGSTOPped during it; calls over wait + OVERSHOOT_MARGIN are counted.
    let stalls = watch.stop();
    for &(a, b) in &stalls.gaps {
        if b - a >= 1_000_000 {
            hist.event(
                a,
                "parent",
                format!("the harness did not run for {} ms", (b - a) / 1000),
            );
        }
    }
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
        let thread = f.get(4).copied().unwrap_or("?");
        let call = f.get(6).copied().unwrap_or("try_lock_for");
        let excused = pauses
            .iter()
            .any(|&(p, a, b)| p == *pid && w0 <= b && w1 >= a);
        // A machine that stalled during the call made it late by that much: the parent's
        // stalls, or the child's own (a loaded machine starves some processes more).
        let child_stalled: u64 = f.get(5).and_then(|v| v.parse().ok()).unwrap_or(0);
        let stalled = stalls.within(w0, w1).max(child_stalled);
        hist.event(
            w0,
            thread,
            format!(
                "{call} returned {} ms late ({}){}{}",
                over / 1000,
                f[3],
                if excused { ", during a SIGSTOP" } else { "" },
                if stalled > 0 {
                    format!(", {} ms of it with the harness stalled", stalled / 1000)
                } else {
                    String::new()
                }
            ),
        );
        let over = over.saturating_sub(stalled);
        if excused {
            max_excused = max_excused.max(over);
        } else {
            max_unexcused = max_unexcused.max(over);
            if over > OVERSHOOT_MARGIN.as_micros() as u64 {
                over_margin += 1;
                eprintln!(
                    "{call} over the 1 s margin in {thread}: overshoot {} ms, outcome {}",
                    over / 1000,
                    f[3]
                );
            }
            if over > NET_BUDGET.as_micros() as u64 {
                violations.push(Violation::new(
                    Kind::DeadlineOvershoot,
                    format!(
                        "{call} overshot its wait by {} ms in {thread} ({})",
                        over / 1000,
                        f[3]
                    ),
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
    let mut report: Vec<String> = vec![
        format!(
            "--- chaos report (seed {seed}, {:?}) ---",
            started.elapsed()
        ),
        format!(
            "topology {}: {}; processes: {CHAOS_PROCS} x {CHAOS_THREADS} threads, {spawned} spawned in all; lock server epochs: {}",
            topology.label(),
            rig.describe(),
            epoch + 1
        ),
    ];
    for (fault, (n, ok)) in &injected {
        report.push(format!("fault {fault:?}: injected {n}, survived {ok}"));
    }
    for (k, v) in &detail {
        report.push(format!("{k}: {v}"));
    }
    report.push(format!("sections reported per epoch: {per_epoch:?}"));
    for k in [
        "acquired",
        "valid_sections",
        "lost_sections",
        "valid_reads",
        "lost_reads",
        "valid_writes",
        "lost_writes",
        "valid_upgradable_reads",
        "lost_upgradable_reads",
        "valid_permits",
        "lost_permits",
        "valid_multi_locks",
        "lost_multi_locks",
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
        "unlock_converted",
        "unlock_convert_failed",
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
        "grants_received",
        "grants_trusted",
        "grants_passed",
    ] {
        report.push(format!("{k}: {} (surviving processes)", sum(k)));
    }
    report.push(format!(
        "max overshoot of a try_*_for call: {} ms (surviving processes), {} ms not explained by a SIGSTOP, {} ms during a SIGSTOP",
        max_over_all / 1000,
        max_unexcused / 1000,
        max_excused / 1000
    ));
    report.push(format!(
        "calls over wait + {OVERSHOOT_MARGIN:?} not explained by a SIGSTOP: {over_margin} (asserted bound: wait + {NET_BUDGET:?})"
    ));
    report.push(format!(
        "recovery after a fault (first new section): max {:?}",
        Duration::from_micros(max_recovery_us)
    ));
    report.push(format!(
        "harness stalled (not scheduled for over {:?}): {} times, {} ms in all, longest {} ms",
        StallWatch::MIN_GAP,
        stalls.gaps.len(),
        stalls.total() / 1000,
        stalls.longest() / 1000
    ));
    for line in report {
        eprintln!("{line}");
        hist.note(line);
    }

    if sum("valid_sections") == 0 {
        violations.push(Violation::new(Kind::NoProgress, "no valid section at all"));
    }
    // The read-write lock and the semaphore are contended by every process: each kind
    // must get through (where there are any: not on Redlock).
    let kinds: &[Hold] = match topology {
        Topology::Single => &[Hold::Read, Hold::Write, Hold::Permit],
        Topology::Redlock => &[],
    };
    for &hold in kinds {
        if !sections.iter().any(|s| s.hold == hold && s.valid) {
            violations.push(Violation::new(
                Kind::NoProgress,
                format!("no valid {}section", hold.label()),
            ));
        }
    }
    if per_epoch.len() as u64 != epoch + 1 {
        violations.push(Violation::new(
            Kind::NoProgress,
            format!("an epoch without any section: {per_epoch:?}"),
        ));
    }
    // A full-length run injects every kind (the schedule starts with one of each); a
    // shorter one (the soak's) may end first.
    if secs >= CHAOS_SECS {
        for &fault in topology.faults().0 {
            if !injected.contains_key(&fault) {
                violations.push(Violation::new(
                    Kind::Other,
                    format!("{fault:?} never injected"),
                ));
            }
        }
    }
    stalls
}

/// Mutual exclusion among `valid`, one name's valid sections sorted by epoch and start:
/// within an epoch, no two overlap unless both are reads. A section overlaps the later
/// ones that start before it ends: every such pair, not only neighbours, since a long
/// section may overlap several short ones.
fn exclusion(key: &str, valid: &[&ChaosSection], violations: &mut Vec<Violation>) {
    for (i, a) in valid.iter().enumerate() {
        for b in valid[i + 1..]
            .iter()
            .take_while(|b| b.epoch() == a.epoch() && b.s < a.e)
            .filter(|b| a.hold.conflicts(b.hold))
        {
            violations.push(Violation::new(
                Kind::Overlap,
                format!(
                    "{key}: overlapping valid sections: {} and {}",
                    a.brief(),
                    b.brief()
                ),
            ));
        }
    }
}

/// At most `permits` of `valid`, the semaphore's valid sections (as for [`exclusion`]),
/// held at any instant within an epoch: a sweep of their intervals by start, with the
/// sections still held when each begins (one that ends as another begins does not
/// overlap it, as in [`exclusion`]). Permits have no tokens to check.
fn permits_held(key: &str, valid: &[&ChaosSection], permits: u32, violations: &mut Vec<Violation>) {
    for epoch in valid.chunk_by(|a, b| a.epoch() == b.epoch()) {
        let mut held: Vec<&ChaosSection> = Vec::new();
        for &b in epoch {
            held.retain(|a| b.s < a.e);
            held.push(b);
            if held.len() > permits as usize {
                let all: Vec<String> = held.iter().map(|s| s.brief()).collect();
                violations.push(Violation::new(
                    Kind::Overlap,
                    format!(
                        "{key}: {} valid permit sections at once, of {permits} permits: {}",
                        held.len(),
                        all.join(", ")
                    ),
                ));
            }
        }
    }
}

/// The order of the fencing tokens among `valid` (as for [`exclusion`]): when a section
/// ended before another of its epoch began, the later one's token is higher if it
/// excludes (a lock or a write: tokens strictly increase from holder to holder), and not
/// lower than an exclusive earlier one's if it is a read (`ReadGuard::fencing_token`: at
/// least the token of every write that ended before the read began; readers that share a
/// hold share a token, and a read after a read is promised nothing). Each section is
/// compared with the highest token that ended before it began.
fn token_order(key: &str, valid: &[&ChaosSection], violations: &mut Vec<Violation>) {
    let higher =
        |a: &ChaosSection, top: Option<&ChaosSection>| top.is_none_or(|t| a.token > t.token);
    for epoch in valid.chunk_by(|a, b| a.epoch() == b.epoch()) {
        let mut by_end = epoch.to_vec();
        by_end.sort_by_key(|s| s.e);
        let mut ended = by_end.into_iter().peekable();
        // The highest token among the sections ended so far, and among the exclusive ones.
        let (mut top, mut top_exclusive): (Option<&ChaosSection>, Option<&ChaosSection>) =
            (None, None);
        for b in epoch {
            while let Some(a) = ended.next_if(|a| a.e < b.s) {
                if higher(a, top) {
                    top = Some(a);
                }
                if a.hold.exclusive() && higher(a, top_exclusive) {
                    top_exclusive = Some(a);
                }
            }
            let (before, in_order) = if b.hold.exclusive() {
                (top, top.is_none_or(|a| b.token > a.token))
            } else {
                (
                    top_exclusive,
                    top_exclusive.is_none_or(|a| b.token >= a.token),
                )
            };
            if let Some(a) = before.filter(|_| !in_order) {
                violations.push(Violation::new(
                    Kind::TokenRegression,
                    format!(
                        "{key}: valid section {} began after {} ended, with a {} token",
                        b.brief(),
                        a.brief(),
                        if b.hold.exclusive() {
                            "no higher"
                        } else {
                            "lower"
                        }
                    ),
                ));
            }
        }
    }
}

/// Judges a progress check that saw no progress for `limit` from `from`: a violation if
/// this process ran for `limit` of that time (returns true), else the machine stalled and
/// the check is not judged (an event in the history; returns false).
fn no_progress(
    stalls: &Stalls,
    from: u64,
    limit: Duration,
    when: &str,
    hist: &mut History,
    violations: &mut Vec<Violation>,
) -> bool {
    let now = mono_us();
    let stalled = stalls.within(from, now);
    let ran = Duration::from_micros((now - from).saturating_sub(stalled));
    if ran >= limit {
        hist.event(now, "parent", format!("no progress {when} in {limit:?}"));
        violations.push(Violation::new(
            Kind::NoProgress,
            format!("no progress within {limit:?} {when}"),
        ));
        true
    } else {
        hist.event(
            now,
            "parent",
            format!(
                "no progress {when}, but the harness stalled {} ms of the {} ms: not judged",
                stalled / 1000,
                (now - from) / 1000
            ),
        );
        false
    }
}

/// Many chaos runs with fresh seeds, each in its own process with its own servers (so a
/// run's panic or hang does not end the soak), and a table of their violations by kind.
///
/// Not in CI: `cargo test --release --test faults -- --ignored soak --nocapture`, with
/// `REDBATON_SOAK_RUNS` (200), `REDBATON_CHAOS_SECS` (10) and `REDBATON_SOAK_JOBS` (1). The
/// run seeds derive from the soak's own seed (printed; `REDBATON_SEED` replays the soak).
#[test]
#[ignore = "soak: long; run on purpose (see the doc comment)"]
fn soak() {
    if child::is_child() {
        return;
    }
    let runs = env_u64("REDBATON_SOAK_RUNS", 200) as usize;
    let secs = env_u64("REDBATON_CHAOS_SECS", SOAK_CHAOS_SECS);
    let jobs = env_u64("REDBATON_SOAK_JOBS", 1).max(1) as usize;
    let soak_seed = history::seed(&[]);
    eprintln!(
        "soak seed {soak_seed}: {runs} chaos runs of {secs} s, {jobs} at once; \
         histories in {}",
        chaos_dir().display()
    );
    let next = std::sync::atomic::AtomicUsize::new(0);
    let verdicts: Mutex<Vec<(usize, Verdict, Topology)>> = Mutex::new(Vec::new());
    let soak_started = Instant::now();
    thread::scope(|s| {
        for _ in 0..jobs {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    if i >= runs {
                        break;
                    }
                    let seed = history::derive(soak_seed, i as u64);
                    // Both kinds in turn, unless the environment picks one.
                    let topology = match std::env::var_os(Topology::ENV) {
                        Some(_) => Topology::of(seed),
                        None if i % 2 == 1 => Topology::Redlock,
                        None => Topology::Single,
                    };
                    let t0 = Instant::now();
                    let verdict = soak_run(seed, secs, topology);
                    let took = t0.elapsed();
                    let what = if verdict.is_clean() {
                        "clean".to_owned()
                    } else {
                        let kinds: Vec<String> = verdict
                            .counts
                            .iter()
                            .map(|(k, n)| format!("{} {n}", k.label()))
                            .collect();
                        format!("{} -> {}", kinds.join(", "), verdict.history)
                    };
                    eprintln!(
                        "run {}/{runs} seed {seed} {} ({took:.0?}, harness stalled {} ms): {what}",
                        i + 1,
                        topology.label(),
                        verdict.stalled_ms
                    );
                    verdicts.lock().unwrap().push((i, verdict, topology));
                }
            });
        }
    });
    let mut verdicts = verdicts.into_inner().unwrap();
    verdicts.sort_by_key(|v| v.0);
    let failing: Vec<&Verdict> = verdicts
        .iter()
        .map(|v| &v.1)
        .filter(|v| !v.is_clean())
        .collect();
    // A failing seed is shown with its topology, which its replay needs.
    let kind_of: HashMap<u64, &str> = verdicts.iter().map(|v| (v.1.seed, v.2.label())).collect();
    let named = |seed: u64| format!("{seed} ({})", kind_of[&seed]);
    eprintln!(
        "\n--- soak: {} runs of {secs} s in {:.0?}, {} with violations (soak seed {soak_seed}) ---",
        verdicts.len(),
        soak_started.elapsed(),
        failing.len()
    );
    eprintln!("{:<34} {:>5} {:>6}  seeds", "kind", "runs", "total");
    for kind in Kind::ALL {
        let with: Vec<&&Verdict> = failing
            .iter()
            .filter(|v| v.counts.get(&kind).is_some_and(|n| *n > 0))
            .collect();
        let total: usize = with.iter().map(|v| v.counts[&kind]).sum();
        let seeds: Vec<String> = with.iter().map(|v| named(v.seed)).collect();
        eprintln!(
            "{:<34} {:>5} {:>6}  {}",
            kind.to_string(),
            with.len(),
            total,
            seeds.join(" ")
        );
    }
    for v in &failing {
        eprintln!("\nseed {}: history {}", named(v.seed), v.history);
        for (k, t) in &v.first {
            eprintln!("  first {}: {t}", k.label());
        }
    }
    let stalled: Vec<String> = verdicts
        .iter()
        .filter(|v| v.1.stalled_ms >= 1000)
        .map(|v| format!("{} ({} ms)", v.1.seed, v.1.stalled_ms))
        .collect();
    eprintln!(
        "\nruns whose harness stalled 1 s or more in all (liveness judged on the time it ran): {}",
        if stalled.is_empty() {
            "none".to_owned()
        } else {
            stalled.join(", ")
        }
    );
    let safety = failing
        .iter()
        .filter(|v| v.counts.keys().any(|k| k.is_safety()))
        .count();
    assert!(
        failing.is_empty(),
        "{} of {} soak runs had violations ({safety} with safety violations); see the table above",
        failing.len(),
        verdicts.len()
    );
}

/// One chaos run of the soak, in a child process: its verdict (an `Other` violation when
/// the run printed none: it crashed or hung).
fn soak_run(seed: u64, secs: u64, topology: Topology) -> Verdict {
    let c = child::spawn_self(
        "chaos",
        &[
            ("REDBATON_SEED", seed.to_string()),
            ("REDBATON_CHAOS_SECS", secs.to_string()),
            (Topology::ENV, topology.label().to_owned()),
        ],
    );
    // A run lasts its faulty phase plus set-up, calm, children's exit and checks.
    let limit = Duration::from_secs(secs + 180);
    let out = std::panic::catch_unwind(|| child::wait_output(c, limit));
    let history = History::path_in(&chaos_dir(), "chaos", seed);
    let broken = |why: String| Verdict::of(seed, &history, &[Violation::new(Kind::Other, why)]);
    match out {
        Ok(out) => Verdict::parse(&out.stdout).unwrap_or_else(|| {
            broken(format!(
                "run printed no verdict ({}): {}",
                out.status,
                out.stderr
                    .lines()
                    .rev()
                    .take(5)
                    .collect::<Vec<_>>()
                    .join(" / ")
            ))
        }),
        Err(p) => broken(format!("run hung: {}", panic_text(&*p))),
    }
}
