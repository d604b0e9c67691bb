//! Redis Cluster: locks live on the master of their key's slot, survive resharding and
//! failover, wake waiters through the right master, and cost nothing while idle. The
//! cluster (three masters, three replicas) is made of real `redis-server` processes; the
//! contenders of the multi-process tests are real child processes.

use std::collections::{HashMap, HashSet};
use std::thread;
use std::time::{Duration, Instant};

use redbaton::{LockClient, Unlocked};
use redbaton_testkit::clock::mono_ns;
use redbaton_testkit::cluster::Cluster;
use redbaton_testkit::keys::Keys;
use redbaton_testkit::sections;
use redbaton_testkit::{child, init_log, ms, secs};

const KEYS: Keys = Keys::DEFAULT;
/// Each call's own deadline; no call may return later than this plus [`MARGIN`].
const WAIT: Duration = Duration::from_secs(20);
const MARGIN: Duration = Duration::from_secs(5);

fn builder(seeds: Vec<String>) -> redbaton::Builder {
    LockClient::builder()
        .cluster(seeds)
        .connect_timeout(ms(1000))
        .read_timeout(ms(1000))
        .write_timeout(ms(1000))
}

fn exists(cluster: &Cluster, key: &[u8]) -> bool {
    redis::cmd("EXISTS")
        .arg(key)
        .query(&mut cluster.master_of(key).conn())
        .expect("EXISTS")
}

#[test]
fn smoke() {
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

/// One critical section as a child saw it.
#[derive(Debug, Clone)]
struct Section {
    name: String,
    start: u64,
    end: u64,
    token: u64,
    /// The holder was told it did not hold the lock (`check()` error, or an unlock that
    /// found the key gone or someone else's).
    told: bool,
}

fn parse_sections(list: &str) -> Vec<Section> {
    list.split(',')
        .filter(|s| !s.is_empty())
        .map(|s| {
            let f: Vec<&str> = s.split(':').collect();
            Section {
                name: f[0].to_owned(),
                start: f[1].parse().expect("start"),
                end: f[2].parse().expect("end"),
                token: f[3].parse().expect("token"),
                told: f[4] == "1",
            }
        })
        .collect()
}

const NAMES: usize = 64;

/// Child: `C_THREADS` threads lock random names of `C_NAMES` until `C_RUN_MS` passed or
/// `C_ROUNDS` sections each, and add one to the name's counter file inside each section
/// (read, pause, write: only exclusion keeps the count exact).
#[test]
fn child_cluster_worker() {
    if !child::is_child() {
        return;
    }
    let seeds: Vec<String> = child::env("C_SEEDS")
        .split(',')
        .map(str::to_owned)
        .collect();
    let threads: usize = child::env("C_THREADS").parse().expect("threads");
    let rounds: usize = child::env("C_ROUNDS").parse().expect("rounds");
    let names: usize = child::env("C_NAMES").parse().expect("names");
    let run_for = Duration::from_millis(child::env("C_RUN_MS").parse().expect("run"));
    let lease = Duration::from_millis(child::env("C_LEASE_MS").parse().expect("lease"));
    let dir = std::env::var("C_DIR").ok();
    let client = builder(seeds).lease(lease).build().expect("child: build");
    let until = Instant::now() + run_for;
    let workers: Vec<_> = (0..threads)
        .map(|t| {
            let (client, dir) = (client.clone(), dir.clone());
            thread::spawn(move || {
                let mut sections = Vec::new();
                let (mut errors, mut longest) = (0u64, Duration::ZERO);
                let mut x = (std::process::id() as usize) * 31 + t * 7919;
                while sections.len() < rounds && Instant::now() < until {
                    x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
                    let name = format!("n{}", (x >> 33) % names);
                    let called = Instant::now();
                    let r = client.try_lock_for(&name, WAIT);
                    longest = longest.max(called.elapsed());
                    let guard = match r {
                        Ok(g) => g,
                        Err(e) => {
                            eprintln!("child: {name}: {e}");
                            errors += 1;
                            thread::sleep(ms(20));
                            continue;
                        }
                    };
                    let start = mono_ns();
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
                    let lost_now = guard.check().is_err();
                    let end = mono_ns();
                    let token = guard.fencing_token();
                    let told = lost_now
                        || !matches!(guard.unlock(), Ok(Unlocked::Released | Unlocked::HandedOff));
                    sections.push(format!("{name}:{start}:{end}:{token}:{}", u8::from(told)));
                }
                (sections, errors, longest)
            })
        })
        .collect();
    for w in workers {
        let (sections, errors, longest) = w.join().expect("worker");
        child::print_result(&[
            ("sections", sections.join(",")),
            ("errors", errors.to_string()),
            ("longest_ms", longest.as_millis().to_string()),
        ]);
    }
    let s = client.stats();
    child::print_result(&[
        ("wake_event", s.wakeups_event.to_string()),
        ("wake_lease", s.wakeups_lease.to_string()),
        ("redirects", s.redirects.to_string()),
        ("refreshes", s.slot_refreshes.to_string()),
        ("lost", s.locks_lost.to_string()),
    ]);
}

struct Run {
    sections: Vec<Section>,
    threads: usize,
    stats: Vec<HashMap<String, String>>,
}

fn run_children(procs: usize, envs: &[(&str, String)], fault: impl FnOnce()) -> Run {
    let children: Vec<_> = (0..procs)
        .map(|_| child::spawn_self("child_cluster_worker", envs))
        .collect();
    fault();
    let mut run = Run {
        sections: Vec::new(),
        threads: 0,
        stats: Vec::new(),
    };
    for c in children {
        let out = child::wait_ok(c, Duration::from_secs(180));
        for r in child::parse_results(&out) {
            if let Some(list) = r.get("sections") {
                run.threads += 1;
                run.sections.extend(parse_sections(list));
                let longest: u64 = r["longest_ms"].parse().expect("longest");
                assert!(
                    Duration::from_millis(longest) <= WAIT + MARGIN,
                    "a call took {longest} ms, past its deadline"
                );
                eprintln!("thread: errors {} longest {longest} ms", r["errors"]);
            } else {
                eprintln!("child stats: {r:?}");
                run.stats.push(r);
            }
        }
    }
    run
}

/// Per name: pairs of sections that overlapped in time where neither holder was told.
fn unexplained_overlaps(sections: &[Section]) -> Vec<(Section, Section)> {
    sections::unexplained_overlaps(sections, |s| (&s.name, s.start, s.end, s.told))
}

/// 4 processes × 4 threads on 64 names over every master: the counters are exact and
/// each name's fencing tokens increase with time.
#[test]
fn exclusion_across_processes() {
    init_log();
    let cluster = Cluster::start();
    let dir = tempfile_dir();
    let envs = [
        ("C_SEEDS", cluster.seed_urls().join(",")),
        ("C_THREADS", "4".to_owned()),
        ("C_ROUNDS", "40".to_owned()),
        ("C_NAMES", NAMES.to_string()),
        ("C_RUN_MS", "120000".to_owned()),
        ("C_LEASE_MS", "10000".to_owned()),
        ("C_DIR", dir.clone()),
    ];
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

/// Names whose lock keys share one slot: the slot of `n0`, and more names found by asking
/// the server for the slots of many candidates.
fn names_in_one_slot(cluster: &Cluster, want: usize) -> (u16, Vec<String>) {
    let slot = cluster.keyslot(&KEYS.lock_bytes(b"r0"));
    let mut names = vec!["r0".to_owned()];
    let mut conn = cluster.servers[0].conn();
    let mut start = 1;
    while names.len() < want {
        let candidates: Vec<String> = (start..start + 50_000).map(|i| format!("r{i}")).collect();
        start += 50_000;
        let mut pipe = redis::pipe();
        for c in &candidates {
            pipe.cmd("CLUSTER").arg("KEYSLOT").arg(KEYS.lock(c));
        }
        let slots: Vec<u16> = pipe.query(&mut conn).expect("KEYSLOT");
        names.extend(
            candidates
                .into_iter()
                .zip(slots)
                .filter(|(_, s)| *s == slot)
                .map(|(c, _)| c),
        );
    }
    names.truncate(want);
    (slot, names)
}

/// While threads of two clients wait for names of one slot, the slot moves to another
/// master: held locks keep being renewed there, and every waiter gets its lock soon after
/// the holder lets go, woken by events rather than by the lease running out.
#[test]
fn waiters_follow_a_resharded_slot() {
    init_log();
    let cluster = Cluster::start();
    let (slot, names) = names_in_one_slot(&cluster, 3);
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
    for t in threads {
        t.join().expect("waiter thread");
    }
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
/// of two sections had a holder who was told.
#[test]
fn failover_under_load() {
    init_log();
    let cluster = Cluster::start();
    let envs = [
        ("C_SEEDS", cluster.seed_urls().join(",")),
        ("C_THREADS", "4".to_owned()),
        ("C_ROUNDS", "1000000".to_owned()),
        ("C_NAMES", "12".to_owned()),
        ("C_RUN_MS", "16000".to_owned()),
        ("C_LEASE_MS", "2000".to_owned()),
    ];
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
        let new = cluster.kill_master(m);
        eprintln!("master {m} killed; new master {new}");
    });
    assert_eq!(run.threads, 16, "every thread reported");
    let bad = unexplained_overlaps(&run.sections);
    assert!(bad.is_empty(), "overlaps nobody was told of: {bad:?}");
    let told = run.sections.iter().filter(|s| s.told).count();
    eprintln!("sections {} told {told}", run.sections.len());
    assert!(run.sections.len() > 100);
}

/// Child: `I_THREADS` threads each wait for one of `I_NAMES` (held elsewhere) until the
/// parent frees them.
#[test]
fn child_idle_waiter() {
    if !child::is_child() {
        return;
    }
    let seeds: Vec<String> = child::env("I_SEEDS")
        .split(',')
        .map(str::to_owned)
        .collect();
    let names: Vec<String> = child::env("I_NAMES")
        .split(',')
        .map(str::to_owned)
        .collect();
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
    for w in workers {
        w.join().expect("waiter");
    }
    let s = client.stats();
    child::print_result(&[
        ("wake_event", s.wakeups_event.to_string()),
        ("wake_lease", s.wakeups_lease.to_string()),
    ]);
}

/// 20 threads in 2 processes wait 3 s for names held elsewhere: the cluster sees almost
/// no command meanwhile, and each process has one subscriber connection per master.
#[test]
fn idle_waiters_cost_nothing() {
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
            assert_eq!(r["wake_lease"], "0", "{r:?}");
            assert_eq!(r["wake_event"], "10", "{r:?}");
        }
    }
}
