//! Singleflight and the baton (DESIGN.md, "Singleflight and the baton"), against a real
//! redis-server: one local thread per key talks to Redis, the lock is passed between local
//! threads with no Redis command, a fairness budget hands it back to Redis when another
//! process waits, fencing tokens strictly increase across all holders, and a thread asking
//! again for a lock it holds gets `WouldDeadlock`.
//!
//! Critical sections detect broken mutual exclusion themselves: a shared "holder" slot that
//! must be empty on entry, and a counter updated with a separate load and store (or GET and
//! SET across processes), so that an overlap shows up as a lost update.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use redbaton::{Builder, Error, LockClient, LostReason, Stats, Unlocked};
use redbaton_testkit::child;
use redbaton_testkit::child_only;
use redbaton_testkit::exists;
use redbaton_testkit::keys::{Counter, Keys, fence_of, handoff_of};
use redbaton_testkit::lock_builder;
use redbaton_testkit::ms;
use redbaton_testkit::server::RedisServer;
use redbaton_testkit::spin;
use redbaton_testkit::test_server;
use redbaton_testkit::wait::join_within;

const PREFIX: &str = "bt:";
const KEYS: Keys = Keys::new(PREFIX);

fn builder(url: &str) -> Builder {
    lock_builder!(node(url), key_prefix(PREFIX))
}

fn random_section() -> Duration {
    Duration::from_micros(rand::random_range(0..=100))
}

/// What critical sections check and record, shared by the threads of one process.
#[derive(Default)]
struct Shared {
    /// Id (1-based) of the thread inside a section, 0 when none.
    holder: AtomicU64,
    /// Sections entered while another thread was inside.
    overlaps: AtomicU64,
    /// Incremented with a separate load and store: exact only under mutual exclusion.
    counter: AtomicU64,
    /// Sections completed (fetch_add: the reference for `counter`).
    sections: AtomicU64,
    /// Fencing tokens in the order the sections ran.
    tokens: Mutex<Vec<u64>>,
}

impl Shared {
    /// One critical section by thread `me` (1-based) holding a lock of `token`.
    fn section(&self, me: u64, token: u64, work: Duration) {
        if self.holder.swap(me, SeqCst) != 0 {
            self.overlaps.fetch_add(1, SeqCst);
        }
        self.tokens.lock().unwrap().push(token);
        let v = self.counter.load(SeqCst);
        spin(work);
        self.counter.store(v + 1, SeqCst);
        if self.holder.compare_exchange(me, 0, SeqCst, SeqCst).is_err() {
            self.overlaps.fetch_add(1, SeqCst);
        }
        self.sections.fetch_add(1, SeqCst);
    }

    /// Asserts mutual exclusion held and tokens strictly increased; returns the sections.
    fn check(&self, what: &str) -> u64 {
        let sections = self.sections.load(SeqCst);
        assert_eq!(self.overlaps.load(SeqCst), 0, "{what}: two holders at once");
        assert_eq!(
            self.counter.load(SeqCst),
            sections,
            "{what}: lost updates on the counter"
        );
        let tokens = self.tokens.lock().unwrap();
        assert_eq!(tokens.len() as u64, sections);
        if let Some(i) = tokens.windows(2).position(|w| w[0] >= w[1]) {
            panic!(
                "{what}: fencing tokens not strictly increasing at section {i}: {:#x} then {:#x}",
                tokens[i],
                tokens[i + 1]
            );
        }
        sections
    }
}

#[test]
fn smoke() {
    let srv = test_server();
    let client = builder(&srv.url()).build().expect("build");
    let guard = client.lock("smoke").expect("lock");
    assert_eq!(guard.name(), b"smoke");
    // A first remote acquisition: the counter it created (at the server's clock in µs), no
    // local handoff.
    let counter = Counter::read(&mut srv.conn(), KEYS.fence("smoke").as_bytes());
    assert_eq!(
        counter.map(|c| c.fence),
        Some(fence_of(guard.fencing_token())),
        "first remote acquisition"
    );
    assert_eq!(handoff_of(guard.fencing_token()), 0);
    assert!(exists(&mut srv.conn(), KEYS.lock("smoke")));
    assert_eq!(guard.unlock().expect("unlock"), Unlocked::Released);
    assert!(!exists(&mut srv.conn(), KEYS.lock("smoke")));
    let s = client.stats();
    assert_eq!((s.remote_acquisitions, s.local_handoffs), (1, 0));
}

// --- one process, many threads ---------------------------------------------------------

struct LocalRun {
    sections: u64,
    server_commands: u64,
    stats: Stats,
    elapsed: Duration,
}

/// `threads` threads of one client, `per_thread` sections each, on one key.
fn local_contention(handoff: bool, threads: u64, per_thread: u64) -> LocalRun {
    let srv = RedisServer::start();
    let client = builder(&srv.url())
        .local_handoff(handoff)
        .build()
        .expect("build");
    let shared = Arc::new(Shared::default());
    // Count only what the contention itself costs, not the client's start-up.
    srv.reset_stats();
    let started = Instant::now();
    let handles: Vec<_> = (1..=threads)
        .map(|me| {
            let (client, shared) = (client.clone(), shared.clone());
            thread::spawn(move || {
                for _ in 0..per_thread {
                    let guard = client.lock("hot").expect("lock");
                    shared.section(me, guard.fencing_token(), random_section());
                    drop(guard);
                }
            })
        })
        .collect();
    join_within(handles, Duration::from_secs(120), "local contention");
    let elapsed = started.elapsed();
    let what = format!("handoff={handoff}");
    let sections = shared.check(&what);
    assert_eq!(sections, threads * per_thread);
    let mut breakdown: Vec<_> = srv.commandstats().into_iter().collect();
    breakdown.sort();
    eprintln!("{what}: INFO commandstats (script-internal calls included): {breakdown:?}");
    let server_commands = breakdown.iter().map(|(_, n)| n).sum();
    assert!(
        !exists(&mut srv.conn(), KEYS.lock("hot")),
        "{what}: lock key left behind"
    );
    LocalRun {
        sections,
        server_commands,
        stats: client.stats(),
        elapsed,
    }
}

fn report(what: &str, r: &LocalRun) {
    let s = &r.stats;
    eprintln!(
        "{what}: {} sections in {:?}: {} server commands = {:.4} per section \
         (client counted {}); remote_acquisitions={} local_handoffs={} budget_releases={} \
         failed_attempts={} wakeups event/lease/recheck={}/{}/{}",
        r.sections,
        r.elapsed,
        r.server_commands,
        r.server_commands as f64 / r.sections as f64,
        s.commands,
        s.remote_acquisitions,
        s.local_handoffs,
        s.budget_releases,
        s.failed_attempts,
        s.wakeups_event,
        s.wakeups_lease,
        s.wakeups_recheck,
    );
}

/// 16 threads × 500 sections of 0–100 µs on one key, handoff on: exact counter, strictly
/// increasing tokens, and fewer than 0.2 Redis commands per critical section.
#[test]
fn sixteen_threads_one_key_handoff_on() {
    let r = local_contention(true, 16, 500);
    report("16 threads x 500, handoff on", &r);
    let per_section = r.server_commands as f64 / r.sections as f64;
    assert!(
        per_section < 0.2,
        "{per_section:.3} Redis commands per critical section (want < 0.2)"
    );
    assert!(r.stats.local_handoffs > 0);
    assert_eq!(
        r.stats.remote_acquisitions + r.stats.local_handoffs,
        r.sections,
        "every section is a remote acquisition or a handoff"
    );
}

/// The same with the baton off: every section goes through Redis. Only reported.
#[test]
fn sixteen_threads_one_key_handoff_off() {
    let r = local_contention(false, 16, 500);
    report("16 threads x 500, handoff off", &r);
    assert_eq!(r.stats.local_handoffs, 0, "handoff off never hands off");
    assert_eq!(r.stats.budget_releases, 0);
    assert_eq!(r.stats.remote_acquisitions, r.sections);
}

/// With the baton on, a busy key is served mostly by local handoffs.
#[test]
fn handoff_on_serves_most_sections_locally() {
    let srv = RedisServer::start();
    let client = builder(&srv.url()).build().expect("build");
    let (threads, per_thread) = (8u64, 100u64);
    let shared = Arc::new(Shared::default());
    let handles: Vec<_> = (1..=threads)
        .map(|me| {
            let (client, shared) = (client.clone(), shared.clone());
            thread::spawn(move || {
                for _ in 0..per_thread {
                    client
                        .with_lock("busy", || shared.section(me, 0, random_section()))
                        .expect("with_lock");
                }
            })
        })
        .collect();
    join_within(handles, Duration::from_secs(60), "handoff on");
    let total = threads * per_thread;
    assert_eq!(shared.sections.load(SeqCst), total);
    assert_eq!(shared.counter.load(SeqCst), total);
    assert_eq!(shared.overlaps.load(SeqCst), 0);
    let s = client.stats();
    eprintln!(
        "8 threads x 100, handoff on: remote_acquisitions={} local_handoffs={} budget_releases={} commands={}",
        s.remote_acquisitions, s.local_handoffs, s.budget_releases, s.commands
    );
    assert!(s.local_handoffs > 0, "no local handoff at all");
    assert_eq!(s.remote_acquisitions + s.local_handoffs, total);
    assert!(
        s.remote_acquisitions <= total / 10,
        "{} of {total} sections went through Redis",
        s.remote_acquisitions
    );
}

/// A process alone on a key is not held to the fairness budget: after the 4,095 local
/// handoffs one fencing token can number, the lock goes back through Redis for a new
/// fence, and that release is not counted as one forced by the budget.
#[test]
fn the_handoff_number_cap_is_not_a_fairness_budget_release() {
    let srv = RedisServer::start();
    let client = builder(&srv.url()).build().expect("build");
    let (threads, per_thread) = (8u64, 1200u64);
    let handles: Vec<_> = (0..threads)
        .map(|_| {
            let client = client.clone();
            thread::spawn(move || {
                for _ in 0..per_thread {
                    let guard = client.lock("alone").expect("lock");
                    spin(Duration::from_micros(20));
                    drop(guard);
                }
            })
        })
        .collect();
    join_within(handles, Duration::from_secs(120), "alone");
    let s = client.stats();
    eprintln!(
        "alone: remote_acquisitions={} local_handoffs={} budget_releases={}",
        s.remote_acquisitions, s.local_handoffs, s.budget_releases
    );
    assert_eq!(
        s.remote_acquisitions + s.local_handoffs,
        threads * per_thread
    );
    assert!(
        s.remote_acquisitions >= 2,
        "the handoff numbers never ran out"
    );
    assert_eq!(
        s.budget_releases, 0,
        "a process alone on the key reports fairness-budget releases"
    );
}

/// With the baton off, every acquisition goes through Redis.
#[test]
fn handoff_off_never_hands_off() {
    let srv = RedisServer::start();
    let client = builder(&srv.url())
        .local_handoff(false)
        .build()
        .expect("build");
    let (threads, per_thread) = (4u64, 50u64);
    let shared = Arc::new(Shared::default());
    let outcomes = Arc::new(Mutex::new(Vec::new()));
    let handles: Vec<_> = (1..=threads)
        .map(|me| {
            let (client, shared, outcomes) = (client.clone(), shared.clone(), outcomes.clone());
            thread::spawn(move || {
                for _ in 0..per_thread {
                    let guard = client.lock("off").expect("lock");
                    assert_eq!(handoff_of(guard.fencing_token()), 0, "a handed-off token");
                    shared.section(me, guard.fencing_token(), random_section());
                    let outcome = guard.unlock().expect("unlock");
                    outcomes.lock().unwrap().push(outcome);
                }
            })
        })
        .collect();
    join_within(handles, Duration::from_secs(60), "handoff off");
    let total = shared.check("handoff off");
    assert_eq!(total, threads * per_thread);
    let outcomes = outcomes.lock().unwrap();
    assert!(
        outcomes.iter().all(|o| *o == Unlocked::Released),
        "handoff off: every unlock releases in Redis: {outcomes:?}"
    );
    let s = client.stats();
    assert_eq!(s.local_handoffs, 0);
    assert_eq!(s.budget_releases, 0);
    assert_eq!(s.remote_acquisitions, total);
}

// --- several processes ------------------------------------------------------------------

const PROCS: usize = 4;
const PROC_THREADS: u64 = 4;
const PROC_SECTIONS: u64 = 200;
/// Generous bound on one `lock()` wait in the multi-process test (see the derivation there).
const WAIT_BOUND: Duration = Duration::from_secs(2);

/// Child: `BT_THREADS` threads × `BT_SECTIONS` sections on lock `BT_NAME`, with the
/// default budget. Inside each section it reads and rewrites a counter and the last
/// fencing token in Redis (GET/SET: a lost update or a token going backwards means two
/// holders at once). Waits for key `BT_GO` before starting, so all children contend from
/// the first section.
#[test]
fn child_contender() {
    child_only!();
    let url = child::env("BT_URL");
    let name = child::env("BT_NAME");
    let threads: u64 = child::env("BT_THREADS").parse().unwrap();
    let per_thread: u64 = child::env("BT_SECTIONS").parse().unwrap();
    let counter_key = child::env("BT_COUNTER");
    let token_key = child::env("BT_TOKEN");
    let go_key = child::env("BT_GO");
    let client = builder(&url).build().expect("child: build");
    let redis = redis::Client::open(url.as_str()).unwrap();
    let mut conn = redis.get_connection().unwrap();
    child::print_result(&[("ready", std::process::id().to_string())]);
    let deadline = Instant::now() + Duration::from_secs(30);
    while !exists(&mut conn, &go_key) {
        assert!(Instant::now() < deadline, "child: no go signal");
        thread::sleep(ms(1));
    }
    let handles: Vec<_> = (0..threads)
        .map(|_| {
            let client = client.clone();
            let (name, counter_key, token_key) =
                (name.clone(), counter_key.clone(), token_key.clone());
            let mut conn = redis.get_connection().unwrap();
            thread::spawn(move || {
                let (mut max_wait, mut total_wait) = (Duration::ZERO, Duration::ZERO);
                let (mut violations, mut long_waits, mut max_at) = (0u64, 0u64, 0u64);
                let mut fences = Vec::new();
                for i in 0..per_thread {
                    let t0 = Instant::now();
                    let guard = client.lock(&name).expect("child: lock");
                    let waited = t0.elapsed();
                    if waited > max_wait {
                        (max_wait, max_at) = (waited, i);
                    }
                    if waited > ms(100) {
                        long_waits += 1;
                    }
                    total_wait += waited;
                    let token = guard.fencing_token();
                    if handoff_of(token) == 0 {
                        fences.push(fence_of(token));
                    }
                    let (count, last): (Option<u64>, Option<u64>) = redis::cmd("MGET")
                        .arg(&counter_key)
                        .arg(&token_key)
                        .query(&mut conn)
                        .unwrap();
                    if last.is_some_and(|l| l >= token) {
                        violations += 1;
                    }
                    spin(random_section());
                    let () = redis::cmd("MSET")
                        .arg(&counter_key)
                        .arg(count.unwrap_or(0) + 1)
                        .arg(&token_key)
                        .arg(token)
                        .query(&mut conn)
                        .unwrap();
                    drop(guard);
                }
                (max_wait, total_wait, violations, long_waits, max_at, fences)
            })
        })
        .collect();
    let results = join_within(handles, Duration::from_secs(120), "child threads");
    let (max_wait, max_at) = results.iter().map(|r| (r.0, r.4)).max().unwrap();
    let mut fences: Vec<u64> = results.iter().flat_map(|r| r.5.iter().copied()).collect();
    fences.sort_unstable();
    let fences: Vec<String> = fences.iter().map(u64::to_string).collect();
    let long_waits: u64 = results.iter().map(|r| r.3).sum();
    let total_wait: Duration = results.iter().map(|r| r.1).sum();
    let violations: u64 = results.iter().map(|r| r.2).sum();
    let sections = threads * per_thread;
    let s = client.stats();
    child::print_counters(
        &s,
        &[
            ("pid", std::process::id().to_string()),
            ("sections", sections.to_string()),
            ("max_wait_us", max_wait.as_micros().to_string()),
            (
                "mean_wait_us",
                (total_wait.as_micros() / u128::from(sections)).to_string(),
            ),
            ("violations", violations.to_string()),
            ("long_waits", long_waits.to_string()),
            ("fences", fences.join(",")),
            ("max_at", max_at.to_string()),
            (
                "wakeups",
                format!(
                    "{}/{}/{}",
                    s.wakeups_event, s.wakeups_lease, s.wakeups_recheck
                ),
            ),
        ],
    );
}

/// 4 processes × 4 threads on one key with the default budget (16 handoffs, 10 ms slice):
/// every process completes its share, the shared counter is exact, tokens strictly
/// increase across processes, and no single wait exceeds a bound derived from the budget.
///
/// Derivation: once another process is known to wait, a holder process gives the lock up
/// after at most min(H sections, S + one section). A waiting process may see the other
/// P-1 processes take a turn first, so it waits about (P-1) × (S + section + handoff
/// overhead) + a few round trips + the 10 ms yield pause — about 50 ms here — plus, in the
/// worst case where the contention mark was missed, the re-check ceiling. The test bound
/// is a generous 2 s per single wait (CI has 2 cores, and the tests run in parallel).
#[test]
fn four_processes_share_one_key() {
    let srv = RedisServer::start();
    let envs = [
        ("BT_URL", srv.url()),
        ("BT_NAME", "shared".to_string()),
        ("BT_THREADS", PROC_THREADS.to_string()),
        ("BT_SECTIONS", PROC_SECTIONS.to_string()),
        ("BT_COUNTER", "bt-counter".to_string()),
        ("BT_TOKEN", "bt-last-token".to_string()),
        ("BT_GO", "bt-go".to_string()),
    ];
    let mut children = child::spawn_many(PROCS, "child_contender", &envs);
    for c in &mut children {
        child::wait_for_line(c, "RESULT ready=", Duration::from_secs(60));
    }
    let started = Instant::now();
    let mut conn = srv.conn();
    let () = redis::cmd("SET")
        .arg("bt-go")
        .arg(1)
        .query(&mut conn)
        .unwrap();
    let outputs = child::wait_all_ok(children, Duration::from_secs(120));
    let elapsed = started.elapsed();
    let section = Duration::from_micros(100);
    let (h, s) = (16u32, ms(10));
    let ideal = (s + section + ms(2)) * (PROCS as u32 - 1) + ms(2) + ms(10);
    eprintln!(
        "{PROCS} processes x {PROC_THREADS} threads x {PROC_SECTIONS} sections in {elapsed:?}; \
         budget H={h} S={s:?}: derived wait ~{ideal:?} (+ re-check ceiling 5 s if a \
         contention mark is missed); test bound {WAIT_BOUND:?}"
    );
    let reports: Vec<_> = outputs
        .iter()
        .map(|out| {
            child::parse_results(out)
                .into_iter()
                .find(|r| r.contains_key("sections"))
                .unwrap_or_else(|| panic!("child printed no result:\n{out}"))
        })
        .collect();
    // The order of remote turns (by fence), to see how many turns in a row each process
    // lost while it waited: the budget bounds each turn, not who takes the next one.
    let mut turns: Vec<(u64, usize)> = reports
        .iter()
        .enumerate()
        .flat_map(|(p, r)| {
            r["fences"]
                .split(',')
                .map(move |f| (f.parse::<u64>().unwrap(), p))
        })
        .collect();
    turns.sort_unstable();
    let lost_in_a_row = |p: usize| {
        let (mut streak, mut worst) = (0, 0);
        let last = turns.iter().rposition(|t| t.1 == p).unwrap();
        for t in &turns[..last] {
            streak = if t.1 == p { 0 } else { streak + 1 };
            worst = worst.max(streak);
        }
        worst
    };
    let mut total = 0;
    for (p, r) in reports.iter().enumerate() {
        let num = |k: &str| r[k].parse::<u64>().unwrap();
        eprintln!(
            "  process {}: {} sections, max wait {:.1} ms (at section {}), mean wait {:.2} ms, \
             waits > 100 ms: {}, most turns lost in a row: {}, remote={} local={} \
             budget_releases={} commands={} wakeups event/lease/recheck={}",
            r["pid"],
            num("sections"),
            num("max_wait_us") as f64 / 1000.0,
            num("max_at"),
            num("mean_wait_us") as f64 / 1000.0,
            num("long_waits"),
            lost_in_a_row(p),
            num("remote_acquisitions"),
            num("local_handoffs"),
            num("budget_releases"),
            num("commands"),
            r["wakeups"],
        );
        assert_eq!(num("sections"), PROC_THREADS * PROC_SECTIONS);
        assert_eq!(num("violations"), 0, "fencing token went backwards");
        assert!(
            Duration::from_micros(num("max_wait_us")) < WAIT_BOUND,
            "process {} waited {} µs for the lock (bound {WAIT_BOUND:?})",
            r["pid"],
            num("max_wait_us")
        );
        total += num("sections");
    }
    let counter: u64 = redis::cmd("GET")
        .arg("bt-counter")
        .query(&mut conn)
        .unwrap();
    assert_eq!(total, PROCS as u64 * PROC_THREADS * PROC_SECTIONS);
    assert_eq!(counter, total, "lost updates across processes");
    assert!(
        !exists(&mut conn, KEYS.lock("shared")),
        "lock key left behind"
    );
}

/// Subscribes `client` to lock `name` with no other client failing on it (so no contention
/// mark): one of its threads holds the lock while another queues behind it, until Redis
/// shows `subscribers` subscribers on the key's keyspace channel. The subscription then
/// lingers for 2 s after the last local interest.
fn warm_subscription(srv: &RedisServer, client: &LockClient, name: &str, subscribers: i64) {
    let guard = client.lock(name).expect("warm-up lock");
    let (c, n) = (client.clone(), name.to_string());
    let waiter = thread::spawn(move || c.try_lock_for(&n, Duration::from_secs(10)).map(drop));
    let channel = format!("__keyspace@0__:{}", KEYS.lock(name));
    let mut conn = srv.conn();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (_, n): (String, i64) = redis::cmd("PUBSUB")
            .arg("NUMSUB")
            .arg(&channel)
            .query(&mut conn)
            .expect("PUBSUB NUMSUB");
        if n >= subscribers {
            break;
        }
        assert!(Instant::now() < deadline, "no subscription to {channel}");
        thread::sleep(ms(1));
    }
    drop(guard);
    join_within(vec![waiter], Duration::from_secs(10), "warm-up waiter")
        .pop()
        .unwrap()
        .expect("warm-up waiter");
}

/// Two clients × 4 threads × 150 sections on one key, handoff on (each client's stats and
/// max wait are printed). Returns the number of switches between clients, and how many
/// sections each client ran before the first of them finished its share.
fn two_clients(srv: &RedisServer, clients: &[LockClient]) -> (usize, [usize; 2]) {
    let shared = Arc::new(Shared::default());
    // Which client ran each section, in order.
    let order = Arc::new(Mutex::new(Vec::new()));
    let (threads, per_thread) = (4u64, 150u64);
    let mut handles = Vec::new();
    for (c, client) in clients.iter().enumerate() {
        for t in 0..threads {
            let (client, shared, order) = (client.clone(), shared.clone(), order.clone());
            let me = c as u64 * threads + t + 1;
            handles.push(thread::spawn(move || {
                let mut max_wait = Duration::ZERO;
                for _ in 0..per_thread {
                    let t0 = Instant::now();
                    let guard = client.lock("two").expect("lock");
                    max_wait = max_wait.max(t0.elapsed());
                    order.lock().unwrap().push(c);
                    shared.section(me, guard.fencing_token(), random_section());
                    drop(guard);
                }
                (c, max_wait)
            }));
        }
    }
    let waits = join_within(handles, Duration::from_secs(60), "two clients");
    let total = shared.check("two clients");
    assert_eq!(total, 2 * threads * per_thread);
    assert!(!exists(&mut srv.conn(), KEYS.lock("two")));
    let order = order.lock().unwrap();
    let switches = order.windows(2).filter(|w| w[0] != w[1]).count();
    let last = [0, 1].map(|c| order.iter().rposition(|&x| x == c).unwrap());
    let first_done = last[0].min(last[1]);
    let interleaved = [0, 1].map(|c| order[..first_done].iter().filter(|&&x| x == c).count());
    for (c, client) in clients.iter().enumerate() {
        let s = client.stats();
        let max_wait = waits
            .iter()
            .filter(|w| w.0 == c)
            .map(|w| w.1)
            .max()
            .unwrap();
        eprintln!(
            "client {c}: remote={} local={} budget_releases={} max wait {max_wait:?}",
            s.remote_acquisitions, s.local_handoffs, s.budget_releases
        );
    }
    eprintln!(
        "two clients: {switches} switches between clients; before the first finished, \
         sections run by client 0/1 = {}/{}",
        interleaved[0], interleaved[1]
    );
    (switches, interleaved)
}

fn assert_both_progressed(clients: &[LockClient], switches: usize, interleaved: [usize; 2]) {
    let budget: u64 = clients.iter().map(|c| c.stats().budget_releases).sum();
    assert!(budget > 0, "the budget never forced a release");
    assert!(
        switches >= 4,
        "only {switches} switches: one client kept the lock while the other waited"
    );
    assert!(
        interleaved.iter().all(|&n| n > 0),
        "one client ran all its sections before the other ran any: {interleaved:?}"
    );
}

/// Two clients in one process (two "processes" as far as the lock is concerned), handoff
/// on, each already subscribed to the key: both make progress while the other waits,
/// because the fairness budget forces releases in Redis.
#[test]
fn two_clients_both_progress() {
    let srv = RedisServer::start();
    let clients: Vec<LockClient> = (0..2)
        .map(|_| builder(&srv.url()).build().expect("build"))
        .collect();
    warm_subscription(&srv, &clients[0], "two", 1);
    warm_subscription(&srv, &clients[1], "two", 2);
    // The warm-up may itself end in one budget release: it releases as soon as the
    // subscription exists, before the queued waiter's mark check says nobody else waits.
    let (switches, interleaved) = two_clients(&srv, &clients);
    assert_both_progressed(&clients, switches, interleaved);
}

/// The same from a cold start (neither client subscribed yet). Regression: the contention
/// mark of the client that failed first was published before the holder's process had
/// subscribed to the key, so the holder never applied the budget and ran all its sections
/// first; the durable mark key now tells it.
#[test]
fn two_clients_both_progress_from_cold_start() {
    let srv = RedisServer::start();
    let clients: Vec<LockClient> = (0..2)
        .map(|_| builder(&srv.url()).build().expect("build"))
        .collect();
    let (switches, interleaved) = two_clients(&srv, &clients);
    assert_both_progressed(&clients, switches, interleaved);
}

const MARK_RECHECK: Duration = Duration::from_secs(2);

/// How long process Y waits for a lock that process X (another client) keeps handing
/// around locally. X took the lock at its first attempt, so it subscribed to nothing; X's
/// threads queue (which subscribes X to the key) either before Y's first failed attempt
/// (`waiter_first == false`: X sees Y's contention mark) or after it (X cannot see it).
fn holder_yield_wait(srv: &RedisServer, waiter_first: bool) -> Duration {
    let name = format!("mark-{waiter_first}");
    let build = || {
        builder(&srv.url())
            .recheck_interval(MARK_RECHECK)
            .build()
            .expect("build")
    };
    let (x, y) = (build(), build());
    let guard = x.lock(&name).expect("x lock");
    let stop = Arc::new(AtomicBool::new(false));
    let spawn_x = || {
        let (x, stop, name) = (x.clone(), stop.clone(), name.clone());
        thread::spawn(move || {
            while !stop.load(SeqCst) {
                let g = x.lock(&name).expect("x thread lock");
                thread::sleep(ms(1));
                drop(g);
            }
        })
    };
    let mut xs = Vec::new();
    if !waiter_first {
        xs.extend([spawn_x(), spawn_x()]);
        thread::sleep(ms(100)); // X's process subscribes
    }
    let (yc, yname) = (y.clone(), name.clone());
    let y_thread = thread::spawn(move || {
        let t0 = Instant::now();
        let g = yc.lock(&yname).expect("y lock");
        let waited = t0.elapsed();
        drop(g);
        waited
    });
    thread::sleep(ms(100)); // Y failed once (its mark is out) and waits
    if waiter_first {
        xs.extend([spawn_x(), spawn_x()]);
        thread::sleep(ms(20));
    }
    drop(guard); // the baton goes to X's threads
    let waited = join_within(vec![y_thread], Duration::from_secs(30), "waiter")[0];
    stop.store(true, SeqCst);
    join_within(xs, Duration::from_secs(30), "x threads");
    let s = x.stats();
    eprintln!(
        "waiter failed {} the holder's process subscribed: waited {waited:?} (re-check \
         {MARK_RECHECK:?}); holder: local_handoffs={} budget_releases={}",
        if waiter_first { "before" } else { "after" },
        s.local_handoffs,
        s.budget_releases,
    );
    waited
}

/// Control: a holder's process that sees another process's contention mark gives the
/// lock up within its budget, long before the waiter's re-check.
#[test]
fn holder_yields_once_contention_is_seen() {
    let srv = RedisServer::start();
    let waited = holder_yield_wait(&srv, false);
    assert!(
        waited < MARK_RECHECK / 2,
        "waited {waited:?} although the holder's process saw the contention"
    );
}

/// A contention mark published before the holder's process subscribed to the key is not
/// seen; the holder's process keeps the baton until the waiter's re-check marks again.
/// That is the worst case of the budget derivation: bounded by the re-check ceiling.
#[test]
fn missed_contention_mark_is_bounded_by_recheck() {
    let srv = RedisServer::start();
    let waited = holder_yield_wait(&srv, true);
    assert!(
        waited < MARK_RECHECK + Duration::from_millis(1500),
        "waited {waited:?}: more than the re-check ceiling {MARK_RECHECK:?} allows"
    );
}

/// What the design promises ("yield promptly once someone else wants it") also when the
/// waiter failed before the holder's process subscribed. Regression: the waiter used to wait
/// for its re-check; the first queued local waiter now reads the durable mark key.
#[test]
fn missed_contention_mark_still_yields_promptly() {
    let srv = RedisServer::start();
    let waited = holder_yield_wait(&srv, true);
    assert!(
        waited < MARK_RECHECK / 2,
        "waited {waited:?}: the holder's process kept the baton until the waiter's re-check"
    );
}

// --- timeouts, loss, re-entry -------------------------------------------------------------

/// Short deadlines racing handoffs on a hot key for 5 s: a thread whose call returned
/// `Timeout` holds nothing (the library does not count it as the holder), no baton is lost
/// (the lock ends free in Redis and locally), sections never overlap.
#[test]
fn timeouts_race_handoffs() {
    let srv = RedisServer::start();
    // Two clients, so that budget-forced releases and yielding contenders race the
    // deadlines too.
    let clients: Vec<LockClient> = (0..2)
        .map(|_| builder(&srv.url()).build().expect("build"))
        .collect();
    let shared = Arc::new(Shared::default());
    let stop = Arc::new(AtomicBool::new(false));
    let timeouts = Arc::new(AtomicU64::new(0));
    let leaked = Arc::new(AtomicU64::new(0));
    let unexpected = Arc::new(Mutex::new(Vec::<String>::new()));
    let last_token = Arc::new(Mutex::new(0u64));
    let run = Duration::from_secs(5);
    let mut handles = Vec::new();
    // 8 threads with random deadlines of 0–5 ms, 2 with lock() keeping the key hot.
    for me in 1..=10u64 {
        let client = clients[(me % 2) as usize].clone();
        let (shared, stop, timeouts, leaked, unexpected, last_token) = (
            shared.clone(),
            stop.clone(),
            timeouts.clone(),
            leaked.clone(),
            unexpected.clone(),
            last_token.clone(),
        );
        handles.push(thread::spawn(move || {
            let section = |guard: redbaton::LockGuard| {
                let token = guard.fencing_token();
                {
                    let mut last = last_token.lock().unwrap();
                    assert!(token > *last, "token {token:#x} after {:#x}", *last);
                    *last = token;
                }
                shared.section(me, token, random_section());
                drop(guard);
            };
            while !stop.load(SeqCst) {
                if me > 8 {
                    section(client.lock("race").expect("lock"));
                    continue;
                }
                let wait = Duration::from_micros(rand::random_range(0..5000));
                match client.try_lock_for("race", wait) {
                    Ok(guard) => section(guard),
                    Err(Error::Timeout) => {
                        timeouts.fetch_add(1, SeqCst);
                        if shared.holder.load(SeqCst) == me {
                            leaked.fetch_add(1, SeqCst);
                        }
                        // A baton handed to us after we gave up would make us the holder:
                        // asking again would then say WouldDeadlock.
                        match client.try_lock("race") {
                            Ok(guard) => section(guard),
                            Err(Error::WouldBlock) => {}
                            Err(Error::WouldDeadlock) => {
                                leaked.fetch_add(1, SeqCst);
                            }
                            Err(e) => unexpected.lock().unwrap().push(e.to_string()),
                        }
                    }
                    Err(e) => unexpected.lock().unwrap().push(e.to_string()),
                }
            }
        }));
    }
    thread::sleep(run);
    stop.store(true, SeqCst);
    join_within(handles, Duration::from_secs(30), "timeout race");
    let sections = shared.check("timeout race");
    let unexpected = unexpected.lock().unwrap();
    assert!(unexpected.is_empty(), "unexpected errors: {unexpected:?}");
    assert_eq!(
        leaked.load(SeqCst),
        0,
        "a thread held the lock after its call timed out"
    );
    let stats: Vec<Stats> = clients.iter().map(LockClient::stats).collect();
    eprintln!(
        "timeout race: {sections} sections, {} timeouts in {run:?}; per client \
         remote/local/budget/timeouts = {:?}",
        timeouts.load(SeqCst),
        stats
            .iter()
            .map(|s| (
                s.remote_acquisitions,
                s.local_handoffs,
                s.budget_releases,
                s.timeouts
            ))
            .collect::<Vec<_>>()
    );
    assert!(timeouts.load(SeqCst) > 0, "no deadline ever passed");
    assert!(sections > 0);
    let mut conn = srv.conn();
    assert!(
        !exists(&mut conn, KEYS.lock("race")),
        "lock key still in Redis after every thread is done"
    );
    // Both clients' tables are free too: each takes it at once.
    for client in &clients {
        let guard = client.try_lock("race").expect("client's table still busy");
        assert_eq!(guard.unlock().unwrap(), Unlocked::Released);
    }
    let fresh = builder(&srv.url()).build().expect("build");
    let guard = fresh.try_lock("race").expect("fresh client");
    assert_eq!(guard.unlock().unwrap(), Unlocked::Released);
}

/// The holder's lock is deleted behind its back while 4 local threads queue: once the
/// holder knows it is lost and lets go, none of them is handed the lost lock — the first
/// acquires it again in Redis (a higher fence), and the others follow.
#[test]
fn lost_lock_is_not_handed_to_queued_threads() {
    let srv = RedisServer::start();
    // Short lease: the watchdog renews (and so notices the deletion) every 500 ms.
    let client = builder(&srv.url()).lease(ms(1500)).build().expect("build");
    let holder = client.lock("lost").expect("lock");
    let a_token = holder.fencing_token();
    let before = client.stats();
    let url = srv.url();
    let acquired = Arc::new(Mutex::new(Vec::new()));
    let handles: Vec<_> = (0..4)
        .map(|_| {
            let (client, acquired, url) = (client.clone(), acquired.clone(), url.clone());
            thread::spawn(move || {
                let mut conn = redis::Client::open(url).unwrap().get_connection().unwrap();
                let guard = client.lock("lost").expect("queued lock");
                let token = guard.fencing_token();
                let in_redis = exists(&mut conn, KEYS.lock("lost"));
                let checked = guard.check();
                acquired.lock().unwrap().push(token);
                thread::sleep(ms(5));
                let outcome = guard.unlock().expect("unlock");
                (token, in_redis, checked.is_ok(), outcome)
            })
        })
        .collect();
    thread::sleep(ms(300)); // the 4 queue behind the holder
    assert!(handles.iter().all(|h| !h.is_finished()), "a waiter got in");
    let mut conn = srv.conn();
    let () = redis::cmd("DEL")
        .arg(KEYS.lock("lost"))
        .query(&mut conn)
        .unwrap();
    let reason = holder
        .lost()
        .recv_timeout(Duration::from_secs(5))
        .expect("no lost signal within 5 s");
    assert_eq!(reason, LostReason::Deleted);
    assert!(holder.is_lost());
    assert!(matches!(
        holder.check(),
        Err(Error::Lost(LostReason::Deleted))
    ));
    thread::sleep(ms(50));
    assert!(
        handles.iter().all(|h| !h.is_finished()),
        "a waiter got in while the holder still held the lost lock"
    );
    assert_eq!(holder.unlock().expect("unlock"), Unlocked::Expired);
    let results = join_within(handles, Duration::from_secs(10), "queued waiters");
    let order = acquired.lock().unwrap().clone();
    eprintln!(
        "lost holder token {a_token:#x}; then {:?}",
        order.iter().map(|t| format!("{t:#x}")).collect::<Vec<_>>()
    );
    for (token, in_redis, valid, outcome) in &results {
        assert!(
            fence_of(*token) > fence_of(a_token),
            "token {token:#x} is from the lost acquisition {a_token:#x}"
        );
        assert!(
            *in_redis,
            "holder with token {token:#x}: the key is not in Redis"
        );
        assert!(*valid, "holder with token {token:#x} holds a lost lock");
        assert!(outcome.was_held(), "unlock: {outcome:?}");
    }
    assert!(order.windows(2).all(|w| w[0] < w[1]), "tokens: {order:x?}");
    assert!(results.iter().any(|r| r.3 == Unlocked::Released));
    let after = client.stats();
    assert!(
        after.remote_acquisitions > before.remote_acquisitions,
        "no new remote acquisition after the loss"
    );
    assert_eq!(
        after.remote_acquisitions - before.remote_acquisitions + after.local_handoffs
            - before.local_handoffs,
        4,
        "each waiter acquired in Redis or from a valid holder"
    );
    assert!(after.locks_lost >= 1);
    assert!(!exists(&mut conn, KEYS.lock("lost")));
}

/// Asking again for a lock the calling thread holds fails at once with `WouldDeadlock`,
/// without a Redis command, with or without the baton, however the lock came to it.
#[test]
fn reentry_is_would_deadlock() {
    let srv = RedisServer::start();
    for handoff in [true, false] {
        let client = builder(&srv.url())
            .local_handoff(handoff)
            .build()
            .expect("build");
        let name = format!("reenter-{handoff}");
        let guard = client.lock(&name).expect("lock");
        let commands = client.stats().commands;
        let t0 = Instant::now();
        assert!(matches!(client.lock(&name), Err(Error::WouldDeadlock)));
        assert!(matches!(client.try_lock(&name), Err(Error::WouldDeadlock)));
        assert!(matches!(
            client.try_lock_for(&name, Duration::from_secs(30)),
            Err(Error::WouldDeadlock)
        ));
        assert!(matches!(
            client.try_lock_until(&name, Instant::now() + Duration::from_secs(30)),
            Err(Error::WouldDeadlock)
        ));
        assert!(matches!(
            client.with_lock(&name, || ()),
            Err(Error::WouldDeadlock)
        ));
        assert!(t0.elapsed() < Duration::from_secs(10), "re-entry waited");
        assert_eq!(
            client.stats().commands,
            commands,
            "re-entry talked to Redis"
        );
        // The guard is unharmed; other keys and other threads are not affected.
        guard.check().expect("still held");
        client.with_lock("other", || ()).expect("other key");
        let (c, n) = (client.clone(), name.clone());
        let other = thread::spawn(move || c.try_lock(&n).map(drop));
        let other = join_within(vec![other], Duration::from_secs(10), "other thread");
        assert!(
            matches!(other[0], Err(Error::WouldBlock)),
            "another thread: {:?}",
            other[0]
        );
        assert_eq!(guard.unlock().unwrap(), Unlocked::Released);
        // Free again for this thread.
        client.lock(&name).expect("lock again").unlock().unwrap();

        // A lock that came by the baton (or, handoff off, from Redis after a wait).
        let guard = client.lock(&name).expect("lock");
        let (c, n) = (client.clone(), name.clone());
        let waiter = thread::spawn(move || {
            let g = c.lock(&n).expect("waiter lock");
            let t0 = Instant::now();
            let again = c.try_lock_for(&n, Duration::from_secs(30));
            let fast = t0.elapsed() < Duration::from_secs(10);
            let token = g.fencing_token();
            (matches!(again, Err(Error::WouldDeadlock)), fast, token)
        });
        thread::sleep(ms(100));
        let outcome = guard.unlock().unwrap();
        let (deadlock, fast, token) =
            join_within(vec![waiter], Duration::from_secs(10), "waiter")[0];
        assert!(deadlock && fast, "handoff={handoff}: baton holder re-entry");
        if handoff {
            assert_eq!(outcome, Unlocked::HandedOff);
            assert_eq!(handoff_of(token), 1, "the baton's first handoff");
        } else {
            assert_eq!(outcome, Unlocked::Released);
        }
    }
}

/// A queued waiter whose deadline passes returns `Timeout`, and the queue behind it still
/// works: the next waiters get the baton in order.
#[test]
fn queued_waiter_times_out_and_queue_still_works() {
    let srv = RedisServer::start();
    let client = builder(&srv.url()).build().expect("build");
    let guard = client.lock("queue").expect("lock");
    let queued = |wait: Option<Duration>, delay: Duration| {
        let client = client.clone();
        thread::sleep(delay);
        thread::spawn(move || {
            let t0 = Instant::now();
            let r = match wait {
                Some(w) => client.try_lock_for("queue", w),
                None => client.lock("queue"),
            };
            let waited = t0.elapsed();
            let r = r.map(|g| {
                let token = g.fencing_token();
                thread::sleep(ms(5));
                (token, g.unlock().expect("unlock"))
            });
            (r, waited)
        })
    };
    let b = queued(Some(ms(300)), Duration::ZERO); // gives up
    let c = queued(None, ms(50));
    let d = queued(Some(Duration::from_secs(20)), ms(50));
    let b = join_within(vec![b], Duration::from_secs(10), "timing-out waiter")
        .pop()
        .unwrap();
    assert!(matches!(b.0, Err(Error::Timeout)), "{:?}", b.0);
    assert!(
        b.1 >= ms(300) && b.1 < ms(2300),
        "timed out after {:?} (deadline 300 ms)",
        b.1
    );
    assert!(client.stats().timeouts >= 1);
    thread::sleep(ms(20));
    assert!(!c.is_finished() && !d.is_finished());
    let first = guard.fencing_token();
    assert_eq!(guard.unlock().unwrap(), Unlocked::HandedOff);
    let rest = join_within(vec![c, d], Duration::from_secs(10), "queued waiters");
    let (c_token, c_out) = rest[0].0.as_ref().map(|x| *x).expect("c");
    let (d_token, d_out) = rest[1].0.as_ref().map(|x| *x).expect("d");
    assert_eq!(
        (c_token, d_token),
        (first + 1, first + 2),
        "baton passed in FIFO order"
    );
    assert_eq!((c_out, d_out), (Unlocked::HandedOff, Unlocked::Released));
    let s = client.stats();
    assert_eq!((s.remote_acquisitions, s.local_handoffs), (1, 2));
    assert!(!exists(&mut srv.conn(), KEYS.lock("queue")));
    // And the key is usable afterwards.
    client
        .try_lock_for("queue", Duration::from_secs(5))
        .expect("after")
        .unlock()
        .unwrap();
}
