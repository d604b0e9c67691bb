//! Redis Cluster: locks live on the master of their key's slot, survive resharding and
//! failover, wake waiters through the right master, and cost nothing while idle. The
//! cluster (three masters, three replicas) is made of real `redis-server` processes; the
//! contenders of the multi-process tests are real child processes.

use std::collections::{HashMap, HashSet};
use std::thread;
use std::time::{Duration, Instant};

use redbaton::{LockClient, Unlocked};
use redbaton_testkit::child_only;
use redbaton_testkit::clock::mono_ns;
use redbaton_testkit::cluster::Cluster;
use redbaton_testkit::keys::Keys;
use redbaton_testkit::sections::{Section, Worker};
use redbaton_testkit::wait::join_all;
use redbaton_testkit::{child, init_log, ms, secs};
use redbaton_testkit::{lock_builder, lock_client};

/// Held for writing by the test whose bound is a matter of timing, for reading by the
/// others: cargo runs a file's tests in parallel, each with a cluster of six servers.
static TIMING: parking_lot::RwLock<()> = parking_lot::RwLock::new(());

const KEYS: Keys = Keys::DEFAULT;
/// Each call's own deadline; no call may return later than this plus [`MARGIN`].
const WAIT: Duration = Duration::from_secs(20);
const MARGIN: Duration = Duration::from_secs(5);

fn builder(seeds: Vec<String>) -> redbaton::Builder {
    lock_builder!(cluster(seeds), io_timeouts(ms(1000)))
}

fn exists(cluster: &Cluster, key: &[u8]) -> bool {
    redis::cmd("EXISTS")
        .arg(key)
        .query(&mut cluster.master_of(key).conn())
        .expect("EXISTS")
}

#[test]
fn smoke() {
    let _shared = TIMING.read();
    init_log();
    let cluster = Cluster::start();
    let client = builder(cluster.seed_urls()).build().expect("build");
    let mut seen = HashSet::new();
    for i in 0..30 {
        let name = format!("smoke-{i}");
        let guard = client.lock(&name).expect("lock");
        let key = KEYS.lock_bytes(name.as_bytes());
        assert!(exists(&cluster, &key), "the lock is on its slot's master");
        seen.insert(cluster.master_of(&key).port());
        assert_eq!(guard.unlock().expect("unlock"), Unlocked::Released);
        assert!(!exists(&cluster, &key));
    }
    assert_eq!(seen.len(), 3, "names spread over every master");
    let s = client.stats();
    assert_eq!(s.redirects, 0, "a fresh slot map needs no redirect");
    assert!(s.slot_refreshes >= 1);
}

/// Names with braces and non-UTF-8 bytes: every key of one lock has one slot (as the
/// server computes it), and names spread over all masters. A few of them are locked for
/// real: no `CROSSSLOT`.
#[test]
fn every_key_of_a_lock_shares_a_slot() {
    let _shared = TIMING.read();
    init_log();
    let cluster = Cluster::start();
    let pieces: [&[u8]; 8] = [b"{", b"}", b"{}", b"}{", b"a", b":", b"\xff", b"\x00"];
    let names: Vec<Vec<u8>> = (0..10_000u32)
        .map(|i| {
            let mut n = Vec::new();
            let mut x = i.wrapping_mul(2_654_435_761);
            for _ in 0..(1 + i % 5) {
                n.extend_from_slice(pieces[(x % 8) as usize]);
                x /= 8;
            }
            n.extend_from_slice(i.to_string().as_bytes());
            n
        })
        .collect();
    let mut conn = cluster.servers[0].conn();
    let mut pipe = redis::pipe();
    for n in &names {
        let lock = KEYS.lock_bytes(n);
        let suffixed = |s: &[u8]| [lock.as_slice(), s].concat();
        pipe.cmd("CLUSTER").arg("KEYSLOT").arg(&lock);
        pipe.cmd("CLUSTER").arg("KEYSLOT").arg(KEYS.fence_bytes(n));
        pipe.cmd("CLUSTER").arg("KEYSLOT").arg(suffixed(b":w"));
        pipe.cmd("CLUSTER").arg("KEYSLOT").arg(suffixed(b":ev"));
    }
    let slots: Vec<u16> = pipe.query(&mut conn).expect("KEYSLOT");
    for (n, s) in names.iter().zip(slots.chunks(4)) {
        assert!(s.iter().all(|x| *x == s[0]), "{n:?}: slots {s:?}");
    }
    let masters: HashSet<u16> = slots.iter().step_by(4).map(|s| cluster.owner(*s)).collect();
    assert_eq!(masters.len(), 3, "names spread over every master");
    let distinct: HashSet<u16> = slots.iter().step_by(4).copied().collect();
    assert!(distinct.len() > 5000, "{} distinct slots", distinct.len());
    let client = builder(cluster.seed_urls()).build().expect("build");
    for n in names.iter().step_by(97) {
        let guard = client.lock(n).expect("lock a name with braces");
        assert!(guard.fencing_token() > 0);
        guard.unlock().expect("unlock");
    }
}

const NAMES: usize = 64;

/// Child: `C_THREADS` threads lock random names of `C_NAMES` until `C_RUN_MS` passed or
/// `C_ROUNDS` sections each, and add one to the name's counter file inside each section
/// (read, pause, write: only exclusion keeps the count exact).
#[test]
fn child_cluster_worker() {
    child_only!();
    let seeds = child::env_list("C_SEEDS");
    let threads: usize = child::env("C_THREADS").parse().expect("threads");
    let rounds: usize = child::env("C_ROUNDS").parse().expect("rounds");
    let names: usize = child::env("C_NAMES").parse().expect("names");
    let run_for = Duration::from_millis(child::env("C_RUN_MS").parse().expect("run"));
    let lease = Duration::from_millis(child::env("C_LEASE_MS").parse().expect("lease"));
    let dir = std::env::var("C_DIR").ok();
    let client = builder(seeds).lease(lease).build().expect("child: build");
    let until = Instant::now() + run_for;
    Worker::run_threads_and_print(threads, |t, worker| {
        // Failed calls: timeouts, connection errors, anything else.
        let mut errors = [0u64; 3];
        let mut x = (std::process::id() as usize) * 31 + t * 7919;
        while worker.sections.len() < rounds && Instant::now() < until {
            x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            let name = format!("n{}", (x >> 33) % names);
            let guard = match worker.call(|| client.try_lock_for(&name, WAIT)) {
                Ok(g) => g,
                Err(e) => {
                    eprintln!("child: {name}: {e:?}");
                    let kind = if e.is_timeout() {
                        0
                    } else if e.is_connection() {
                        1
                    } else {
                        2
                    };
                    errors[kind] += 1;
                    thread::sleep(ms(20));
                    continue;
                }
            };
            let section = Section::start(&name);
            if let Some(dir) = &dir {
                let path = format!("{dir}/{name}");
                let n: u64 = std::fs::read_to_string(&path)
                    .map(|s| s.trim().parse().expect("count"))
                    .unwrap_or(0);
                thread::sleep(ms(1));
                std::fs::write(&path, (n + 1).to_string()).expect("write count");
            } else {
                thread::sleep(ms(3));
            }
            let (token, told) = (guard.fencing_token(), guard.check().is_err());
            let release = || guard.unlock().is_ok_and(Unlocked::was_held);
            worker.sections.push(section.end(token, told, release));
        }
        vec![
            ("timeouts", errors[0].to_string()),
            ("conn_errors", errors[1].to_string()),
            ("other_errors", errors[2].to_string()),
        ]
    });
    child::print_counters(&client.stats(), &[]);
}

struct Run {
    sections: Vec<Section>,
    threads: usize,
    /// Failed calls of every thread: timeouts, connection errors, anything else.
    timeouts: u64,
    conn_errors: u64,
    other_errors: u64,
    stats: Vec<HashMap<String, String>>,
}

impl Run {
    /// The sum of one counter over the children.
    fn stat(&self, name: &str) -> u64 {
        self.stats
            .iter()
            .map(|r| r[name].parse::<u64>().expect("a count"))
            .sum()
    }
}

/// What each `child_cluster_worker` on `cluster` is told: 4 threads, each doing `rounds`
/// sections at most, for `run` at most, on `names` names, with a `lease`.
fn worker_envs(
    cluster: &Cluster,
    rounds: usize,
    names: usize,
    run: Duration,
    lease: Duration,
) -> Vec<(&'static str, String)> {
    vec![
        ("C_SEEDS", cluster.seed_urls().join(",")),
        ("C_THREADS", "4".to_owned()),
        ("C_ROUNDS", rounds.to_string()),
        ("C_NAMES", names.to_string()),
        ("C_RUN_MS", run.as_millis().to_string()),
        ("C_LEASE_MS", lease.as_millis().to_string()),
    ]
}

fn run_children(procs: usize, envs: &[(&str, String)], fault: impl FnOnce()) -> Run {
    let children = child::spawn_many(procs, "child_cluster_worker", envs);
    fault();
    let mut run = Run {
        sections: Vec::new(),
        threads: 0,
        timeouts: 0,
        conn_errors: 0,
        other_errors: 0,
        stats: Vec::new(),
    };
    for c in children {
        let out = child::wait_ok(c, Duration::from_secs(180));
        for r in child::parse_results(&out) {
            if let Some(worker) = Worker::parse(&r) {
                run.threads += 1;
                run.sections.extend(worker.sections);
                let longest = worker.longest.as_millis();
                assert!(
                    worker.longest <= WAIT + MARGIN,
                    "a call took {longest} ms, past its deadline"
                );
                let count = |k: &str| r[k].parse::<u64>().expect("a count");
                run.timeouts += count("timeouts");
                run.conn_errors += count("conn_errors");
                run.other_errors += count("other_errors");
                eprintln!(
                    "thread: timeouts {} connection errors {} other errors {} longest {longest} ms",
                    r["timeouts"], r["conn_errors"], r["other_errors"]
                );
            } else {
                eprintln!("child stats: {r:?}");
                run.stats.push(r);
            }
        }
    }
    run
}

/// 4 processes × 4 threads on 64 names over every master: the counters are exact and
/// each name's fencing tokens increase with time.
#[test]
fn exclusion_across_processes() {
    let _shared = TIMING.read();
    init_log();
    let cluster = Cluster::start();
    let dir = tempfile_dir();
    let mut envs = worker_envs(&cluster, 40, NAMES, secs(120), secs(10));
    envs.push(("C_DIR", dir.clone()));
    let run = run_children(4, &envs, || ());
    assert_eq!(run.threads, 16);
    assert_eq!(run.sections.len(), 16 * 40, "every section done");
    let mut per_name: HashMap<String, Vec<&Section>> = HashMap::new();
    for s in &run.sections {
        per_name.entry(s.name.clone()).or_default().push(s);
    }
    let mut masters = HashSet::new();
    for (name, list) in &mut per_name {
        let count: usize = std::fs::read_to_string(format!("{dir}/{name}"))
            .expect("counter file")
            .trim()
            .parse()
            .expect("count");
        assert_eq!(count, list.len(), "{name}: counter exact");
        list.sort_by_key(|s| s.start);
        for w in list.windows(2) {
            assert!(w[0].end <= w[1].start, "{name}: sections overlap: {w:?}");
            assert!(w[0].token < w[1].token, "{name}: tokens increase: {w:?}");
        }
        masters.insert(cluster.master_of(&KEYS.lock_bytes(name.as_bytes())).port());
    }
    assert_eq!(masters.len(), 3, "names on every master");
    let _ = std::fs::remove_dir_all(&dir);
}

fn tempfile_dir() -> String {
    let dir = std::env::temp_dir().join(format!(
        "redbaton-cluster-{}-{}",
        std::process::id(),
        mono_ns()
    ));
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir.to_string_lossy().into_owned()
}

/// While threads of two clients wait for names of one slot, the slot moves to another
/// master: held locks keep being renewed there, and every waiter gets its lock soon after
/// the holder lets go, woken by events rather than by the lease running out.
#[test]
fn waiters_follow_a_resharded_slot() {
    let _shared = TIMING.read();
    init_log();
    let cluster = Cluster::start();
    let (slot, names) = cluster.names_in_one_slot(&KEYS, "r", 3);
    let from = cluster.owner(slot);
    let to = cluster.other_master(from);
    let holder = builder(cluster.seed_urls())
        .lease(secs(10))
        .renew_interval(ms(500))
        .build()
        .expect("holder");
    let guards: Vec<_> = names
        .iter()
        .map(|n| holder.lock(n).expect("hold"))
        .collect();
    let waiters: Vec<LockClient> = (0..2)
        .map(|_| builder(cluster.seed_urls()).build().expect("waiter"))
        .collect();
    let (tx, rx) = std::sync::mpsc::channel();
    let mut threads = Vec::new();
    for client in &waiters {
        for name in &names {
            for _ in 0..2 {
                let (client, name, tx) = (client.clone(), name.clone(), tx.clone());
                threads.push(thread::spawn(move || {
                    let g = client
                        .try_lock_for(&name, WAIT)
                        .expect("waiter gets the lock");
                    tx.send(Instant::now()).unwrap();
                    thread::sleep(ms(5));
                    g.unlock().expect("waiter unlock");
                }));
            }
        }
    }
    thread::sleep(ms(1500));
    let renewed_before = holder.stats().renewals_sent;
    cluster.move_slot(slot, to);
    eprintln!("slot {slot}: {from} -> {to}");
    thread::sleep(ms(2000));
    let mut conn = cluster.server(to).conn();
    for (name, g) in names.iter().zip(&guards) {
        assert!(!g.is_lost(), "{name}: still held after the move");
        let pttl: i64 = redis::cmd("PTTL")
            .arg(KEYS.lock(name))
            .query(&mut conn)
            .expect("PTTL");
        assert!(
            pttl > 8000,
            "{name}: renewed on the new master (pttl {pttl})"
        );
    }
    assert!(holder.stats().renewals_sent > renewed_before);
    let released = Instant::now();
    for g in guards {
        assert_eq!(g.unlock().expect("unlock"), Unlocked::Released);
    }
    let n = threads.len();
    let got: Vec<Instant> = (0..n)
        .map(|_| rx.recv_timeout(WAIT).expect("every waiter acquires"))
        .collect();
    join_all(threads, "waiter thread");
    let last = got.iter().max().expect("some").duration_since(released);
    assert!(
        last < secs(5),
        "all waiters done {last:?} after the release"
    );
    for w in &waiters {
        let s = w.stats();
        eprintln!("waiter stats: {s:?}");
        assert_eq!(s.wakeups_lease, 0, "woken by events, not the lease: {s:?}");
    }
    eprintln!("holder stats: {:?}", holder.stats());
    assert!(
        holder.stats().redirects + waiters[0].stats().redirects + waiters[1].stats().redirects > 0
    );
    for name in &names {
        assert!(
            !exists(&cluster, &KEYS.lock_bytes(name.as_bytes())),
            "{name}: no key left"
        );
    }
}

/// A forced failover, then a master killed, while 4 processes × 4 threads lock names on
/// every master: every thread finishes, no call outlives its deadline, and every overlap
/// of two sections had a holder who was told. While the killed master awaits its
/// replacement, calls for its names ride through (the slot map read again, the call
/// retried until its deadline): they get their lock once the replica is promoted, or a
/// timeout, never a connection error.
#[test]
fn failover_under_load() {
    let _shared = TIMING.read();
    init_log();
    let cluster = Cluster::start();
    let names = 12;
    let envs = worker_envs(&cluster, 1_000_000, names, secs(16), secs(2));
    // The names of the killed master, when it died, and when its replica had taken over.
    let mut killed: Option<(HashSet<String>, u64, u64)> = None;
    let run = run_children(4, &envs, || {
        thread::sleep(ms(2000));
        let m = cluster.masters()[0].port();
        let new = cluster.failover(m);
        eprintln!("failover: {m} -> {new}");
        thread::sleep(ms(1000));
        let m = cluster
            .masters()
            .iter()
            .map(|s| s.port())
            .find(|p| *p != new)
            .expect("m");
        let there: HashSet<String> = (0..names)
            .map(|i| format!("n{i}"))
            .filter(|n| cluster.master_of(&KEYS.lock_bytes(n.as_bytes())).port() == m)
            .collect();
        let at = mono_ns();
        let new = cluster.kill_master(m);
        let back = mono_ns();
        eprintln!(
            "master {m} killed; new master {new} after {} ms; its names {there:?}",
            (back - at) / 1_000_000
        );
        killed = Some((there, at, back));
    });
    assert_eq!(run.threads, 16, "every thread reported");
    let bad = Section::unexplained(&run.sections);
    assert!(bad.is_empty(), "overlaps nobody was told of: {bad:?}");
    let told = run.sections.iter().filter(|s| s.told).count();
    eprintln!(
        "sections {} told {told}; timeouts {} connection errors {} other errors {}; failover retries {}",
        run.sections.len(),
        run.timeouts,
        run.conn_errors,
        run.other_errors,
        run.stat("failover_retries")
    );
    assert!(run.sections.len() > 100);
    assert_eq!(run.conn_errors, 0, "calls rode through the failover");
    assert_eq!(run.other_errors, 0, "only locks or timeouts");
    assert!(
        run.stat("failover_retries") > 0,
        "calls met the dead master"
    );
    let (there, _, back) = killed.expect("the master was killed");
    assert!(!there.is_empty(), "the killed master served some names");
    let after = run
        .sections
        .iter()
        .filter(|s| there.contains(&s.name) && s.start > back)
        .count();
    assert!(after > 0, "its names were locked again on the new master");
}

/// A master killed twice. First its replica takes over: a lock held there survives
/// (the watchdog keeps renewing, then renews on the new master) and can be extended and
/// released there. Then the new master is killed too, and nothing can replace it:
/// `try_lock` does not wait; `try_lock_for` rides through until its deadline and times
/// out; `lock()`, with no deadline, gives up after one lease (the bound a failover must
/// meet for held locks to survive it) with the cluster's error. A lock held there is lost
/// when its lease runs out (its holder is told), and its release does not wait.
#[test]
fn a_master_replaced_then_lost_for_good() {
    let _shared = TIMING.read();
    init_log();
    let cluster = Cluster::start();
    let m = cluster.masters()[0].port();
    let names: Vec<String> = (0..)
        .map(|i| format!("gone-{i}"))
        .filter(|n| cluster.master_of(&KEYS.lock_bytes(n.as_bytes())).port() == m)
        .take(5)
        .collect();
    let key = |n: &str| KEYS.lock_bytes(n.as_bytes());

    // 1. Replaced: the lock outlives the failover.
    let keeper = builder(cluster.seed_urls())
        .lease(secs(10))
        .build()
        .expect("build");
    let kept = keeper.lock(&names[4]).expect("hold");
    let mut replica = cluster.replica_of(m).conn();
    redis::cmd("READONLY")
        .query::<()>(&mut replica)
        .expect("READONLY");
    redbaton_testkit::wait::wait_for(secs(10), "the lock replicated", || {
        redbaton_testkit::exists(&mut replica, key(&names[4]))
    });
    let n = cluster.kill_master(m);
    let mut conn = cluster.server(n).conn();
    redbaton_testkit::wait::wait_for(secs(10), "a renewal on the new master", || {
        redbaton_testkit::pttl(&mut conn, key(&names[4])) > 8000
    });
    assert!(!kept.is_lost());
    kept.extend(secs(20)).expect("extend on the new master");
    assert!(redbaton_testkit::pttl(&mut conn, key(&names[4])) > 15_000);
    assert_eq!(kept.unlock().expect("unlock"), Unlocked::Released);
    eprintln!("keeper stats: {:?}", keeper.stats());

    // 2. Lost for good: no replica is left to take over.
    let lease = secs(2);
    let client = builder(cluster.seed_urls())
        .lease(lease)
        .build()
        .expect("build");
    let held = client.lock(&names[0]).expect("hold");
    cluster.server(n).kill();

    let t = Instant::now();
    let e = client.try_lock(&names[1]).expect_err("nobody serves it");
    assert!(e.is_connection(), "{e:?}");
    let took = t.elapsed();
    assert!(took < MARGIN, "try_lock does not wait: {took:?}");

    let t = Instant::now();
    let e = client
        .try_lock_for(&names[2], ms(1500))
        .expect_err("nobody serves it");
    assert!(e.is_timeout(), "{e:?}");
    assert!(t.elapsed() >= ms(1500) && t.elapsed() < ms(1500) + MARGIN);

    let t = Instant::now();
    let e = client.lock(&names[3]).expect_err("nobody serves it");
    eprintln!("lock() gave up after {:?}: {e:?}", t.elapsed());
    assert!(!e.is_timeout() && e.redis_error().is_some(), "{e:?}");
    assert!(t.elapsed() >= lease && t.elapsed() < lease + MARGIN);
    assert!(client.stats().failover_retries > 0);

    assert!(held.is_lost(), "its lease ran out unrenewed");
    let t = Instant::now();
    assert!(held.unlock().is_err(), "nobody to release it");
    let took = t.elapsed();
    assert!(took < secs(3), "no retries past the lease: {took:?}");
}

/// Child: `I_THREADS` threads each wait for one of `I_NAMES` (held elsewhere) until the
/// parent frees them.
#[test]
fn child_idle_waiter() {
    child_only!();
    let seeds = child::env_list("I_SEEDS");
    let names = child::env_list("I_NAMES");
    let client = builder(seeds)
        .recheck_interval(secs(60))
        .build()
        .expect("child: build");
    let workers: Vec<_> = names
        .into_iter()
        .map(|name| {
            let client = client.clone();
            thread::spawn(move || {
                let g = client
                    .try_lock_for(&name, secs(60))
                    .expect("lock once freed");
                g.unlock().expect("unlock");
            })
        })
        .collect();
    join_all(workers, "waiter");
    child::print_counters(&client.stats(), &[]);
}

/// 20 threads in 2 processes wait 3 s for names held elsewhere: the cluster sees almost
/// no command meanwhile, and each process has one subscriber connection per master.
#[test]
fn idle_waiters_cost_nothing() {
    let _shared = TIMING.read();
    init_log();
    let cluster = Cluster::start();
    let names: Vec<String> = (0..20).map(|i| format!("idle-{i}")).collect();
    // Held by someone else: set directly, with a long lease.
    for n in &names {
        let key = KEYS.lock_bytes(n.as_bytes());
        redis::cmd("SET")
            .arg(&key)
            .arg("someone")
            .arg("PX")
            .arg(60_000)
            .query::<()>(&mut cluster.master_of(&key).conn())
            .expect("SET");
    }
    let masters: HashSet<u16> = names
        .iter()
        .map(|n| cluster.master_of(&KEYS.lock_bytes(n.as_bytes())).port())
        .collect();
    assert_eq!(masters.len(), 3, "names on every master");
    let children: Vec<_> = names
        .chunks(10)
        .map(|chunk| {
            child::spawn_self(
                "child_idle_waiter",
                &[
                    ("I_SEEDS", cluster.seed_urls().join(",")),
                    ("I_NAMES", chunk.join(",")),
                ],
            )
        })
        .collect();
    thread::sleep(secs(3));
    let net = |s: &redbaton_testkit::server::RedisServer| -> u64 {
        s.commandstats()
            .iter()
            .filter(|(k, _)| !k.contains("replconf") && !k.contains("ping"))
            .map(|(_, v)| v)
            .sum()
    };
    let before: Vec<u64> = cluster.servers.iter().map(net).collect();
    thread::sleep(secs(3));
    let after: Vec<u64> = cluster.servers.iter().map(net).collect();
    let added: u64 = after.iter().zip(&before).map(|(a, b)| a - b).sum();
    assert!(added < 10, "{added} commands while idle");
    for m in cluster.masters() {
        let subs = m
            .client_list()
            .iter()
            .filter(|c| c.get("name").map(String::as_str) == Some("redbaton:sub"))
            .count();
        assert_eq!(subs, 2, "master {}: one subscriber per process", m.port());
    }
    for n in &names {
        let key = KEYS.lock_bytes(n.as_bytes());
        redis::cmd("DEL")
            .arg(&key)
            .query::<()>(&mut cluster.master_of(&key).conn())
            .expect("DEL");
    }
    for c in children {
        let out = child::wait_ok(c, secs(30));
        for r in child::parse_results(&out) {
            assert_eq!(r["wakeups_lease"], "0", "{r:?}");
            assert_eq!(r["wakeups_event"], "10", "{r:?}");
        }
    }
}

/// Read-write locks and semaphores work on a cluster as on one node: on names spread over
/// every master, readers share, a writer waits for them and is woken by the last reader's
/// release (the lease is far longer than the wait), and a semaphore's last permit is
/// returned to a waiter the same way.
#[test]
fn rwlocks_and_semaphores_on_every_master() {
    let _shared = TIMING.read();
    init_log();
    let cluster = Cluster::start();
    let build = || {
        builder(cluster.seed_urls())
            .lease(secs(60))
            .build()
            .expect("build")
    };
    // Three clients, as three processes would be: one thread may not read and write the
    // same name through one client (`WouldDeadlock`).
    let (a, b, c) = (build(), build(), build());
    let mut masters = HashSet::new();
    for i in 0..9 {
        let name = format!("rw-{i}");
        masters.insert(cluster.master_of(&KEYS.lock_bytes(name.as_bytes())).port());
        let r1 = a.rwlock(&name).read().expect("read");
        let r2 = b.rwlock(&name).read().expect("readers share");
        assert!(c.rwlock(&name).try_write().unwrap_err().is_would_block());
        let read_token = r1.fencing_token();
        thread::scope(|s| {
            let writer = s.spawn(|| {
                let t = Instant::now();
                let w = c.rwlock(&name).try_write_for(secs(10)).expect("write");
                assert!(w.fencing_token() > read_token);
                t.elapsed()
            });
            thread::sleep(ms(100));
            drop(r1);
            drop(r2);
            assert!(writer.join().unwrap() < secs(5), "woken by the release");
        });
        let sem = format!("sem-{i}");
        let p1 = a.semaphore(&sem, 2).acquire().expect("permit 1");
        let p2 = b.semaphore(&sem, 2).acquire().expect("permit 2");
        assert!(
            c.semaphore(&sem, 2)
                .try_acquire()
                .unwrap_err()
                .is_would_block()
        );
        thread::scope(|s| {
            let third = s.spawn(|| {
                let t = Instant::now();
                let p = c
                    .semaphore(&sem, 2)
                    .try_acquire_for(secs(10))
                    .expect("permit 3");
                drop(p);
                t.elapsed()
            });
            thread::sleep(ms(100));
            drop(p1);
            assert!(third.join().unwrap() < secs(5), "woken by the release");
        });
        drop(p2);
    }
    assert_eq!(masters.len(), 3, "names on every master");
    // One subscriber per master, each connected once.
    let subs = c.subscribers();
    let nodes: HashSet<_> = subs.iter().map(|s| s.node.clone()).collect();
    assert_eq!((subs.len(), nodes.len()), (3, 3), "{subs:?}");
    assert!(
        subs.iter().all(|s| s.connected && s.reconnects == 0),
        "{subs:?}"
    );
    for s in cluster.masters() {
        let left: Vec<Vec<u8>> = redis::cmd("KEYS")
            .arg(format!("{}*", KEYS.prefix()))
            .query(&mut s.conn())
            .expect("KEYS");
        let holds: Vec<_> = left
            .iter()
            .filter(|k| !k.ends_with(b":fence"))
            .map(|k| String::from_utf8_lossy(k).into_owned())
            .collect();
        assert!(holds.is_empty(), "no hold left on {}: {holds:?}", s.port());
    }
}

/// Renewals of many locks over many slots, plain locks and read holds mixed (the watchdog
/// sends each master one pipelined round trip per round, one script call per slot and
/// kind): every lock stays held through several leases.
#[test]
fn renewals_cover_every_slot_and_kind() {
    let _shared = TIMING.read();
    init_log();
    let cluster = Cluster::start();
    let client = builder(cluster.seed_urls())
        .lease(ms(600))
        .read_timeout(ms(500))
        .build()
        .expect("build");
    let locks: Vec<_> = (0..30)
        .map(|i| client.lock(format!("renew-{i}")).expect("lock"))
        .collect();
    let reads: Vec<_> = (0..10)
        .map(|i| client.rwlock(format!("renew-rw-{i}")).read().expect("read"))
        .collect();
    thread::sleep(secs(2));
    for g in &locks {
        g.check().expect("renewed");
    }
    for r in &reads {
        r.check().expect("renewed");
    }
    let s = client.stats();
    assert!(s.renewals_sent >= 40 * 2, "{s:?}");
    assert_eq!(s.renewals_failed, 0, "{s:?}");
    assert_eq!(s.locks_lost, 0, "{s:?}");
    drop(reads);
    for g in locks {
        assert_eq!(g.unlock().expect("unlock"), Unlocked::Released);
    }
}

/// A master that stops answering (SIGSTOP) holds up renewals on the others by at most
/// one read timeout per round: the watchdog asks the masters in parallel, and the slot
/// map is read from masters that answer first. Locks on the healthy masters stay held
/// with a lease of 1.5 read timeouts.
#[test]
fn a_hung_master_delays_renewals_elsewhere_by_one_timeout_at_most() {
    // Its bound (renewals held up by one read timeout at most, with a lease of 1.5 read
    // timeouts) is about this client's watchdog, not about two cores shared with five
    // other clusters: it runs alone.
    let _alone = TIMING.write();
    init_log();
    let cluster = Cluster::start();
    let client = lock_client!(
        cluster(cluster.seed_urls()),
        lease(secs(3)),
        read_timeout(secs(2))
    );
    let masters: Vec<u16> = cluster.masters().iter().map(|m| m.port()).collect();
    let name_on = |port: u16| {
        (0..)
            .map(|i| format!("hung-{i}"))
            .find(|n| cluster.master_of(&KEYS.lock_bytes(n.as_bytes())).port() == port)
            .expect("a name")
    };
    let healthy: Vec<_> = masters[1..]
        .iter()
        .map(|&p| client.lock(name_on(p)).expect("lock"))
        .collect();
    let on_hung = client.lock(name_on(masters[0])).expect("lock");
    // The bound is about this client's watchdog, not about the cluster's coverage rule:
    // by default the healthy masters refuse every command (CLUSTERDOWN) from when they
    // mark the hung one failed (the node timeout, 2 s) until its replica is promoted,
    // which may outlast a 3 s lease whatever the client does.
    for s in &cluster.servers {
        let () = redis::cmd("CONFIG")
            .arg("SET")
            .arg("cluster-require-full-coverage")
            .arg("no")
            .query(&mut s.conn())
            .expect("CONFIG SET");
    }
    let hung = cluster.server(masters[0]);
    hung.pause();
    thread::sleep(secs(5));
    let held: Vec<bool> = healthy.iter().map(|g| g.check().is_ok()).collect();
    hung.resume();
    assert_eq!(held, vec![true, true], "renewed on the healthy masters");
    drop(on_hung);
    for g in healthy {
        assert_eq!(g.unlock().expect("unlock"), Unlocked::Released);
    }
}
