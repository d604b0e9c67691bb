//! A Sentinel-managed master: locks follow the master through a failover, waiters keep
//! waking on events, and a holder whose lock did not survive is told. The group (master,
//! replicas, sentinels) is made of real `redis-server` processes; the contenders are
//! real child processes.

use std::collections::HashMap;
use std::thread;
use std::time::{Duration, Instant};

use redbaton::Unlocked;
use redbaton_testkit::child_only;
use redbaton_testkit::clock::mono_ns;
use redbaton_testkit::lock_builder;
use redbaton_testkit::sections::{Section, Worker};
use redbaton_testkit::sentinel::SentinelGroup;
use redbaton_testkit::{child, init_log, ms, secs};

const NAME: &str = "locks";
const PROCS: usize = 4;
const THREADS: usize = 4;
/// Each call's own deadline; no call may return later than this plus [`MARGIN`].
const WAIT: Duration = Duration::from_secs(20);
const MARGIN: Duration = Duration::from_secs(5);

fn builder(group: &SentinelGroup) -> redbaton::Builder {
    lock_builder!(sentinel(NAME, group.sentinel_urls()), io_timeouts(ms(1000)))
}

#[test]
fn smoke() {
    init_log();
    let group = SentinelGroup::start(NAME, 1, 3);
    let client = builder(&group)
        .build()
        .expect("build through the sentinels");
    let guard = client.lock("smoke").expect("lock");
    let key_on_master: bool = redis::cmd("EXISTS")
        .arg(b"redbaton:{smoke}".as_slice())
        .query(&mut group.master().conn())
        .expect("EXISTS");
    assert!(
        key_on_master,
        "the lock is on the master the sentinels name"
    );
    guard.unlock().expect("unlock");
    assert!(format!("{client:?}").contains("LockClient"));
}

/// Child: `THREADS` threads take "k" again and again for `S_RUN_MS`, retrying after errors
/// (a failover makes some calls fail). Prints every section, each call's longest
/// duration and the client's counters.
#[test]
fn child_failover_worker() {
    child_only!();
    let urls = child::env_list("S_URLS");
    let run_for = Duration::from_millis(child::env("S_RUN_MS").parse().expect("S_RUN_MS"));
    let lease = Duration::from_millis(child::env("S_LEASE_MS").parse().expect("lease"));
    let mut b = lock_builder!(sentinel(NAME, urls), lease(lease), io_timeouts(ms(1000)));
    if let Ok(n) = std::env::var("S_ACK") {
        b = b.replica_ack(n.parse().expect("S_ACK"), ms(100));
    }
    let client = b.build().expect("child: build");
    let until = Instant::now() + run_for;
    Worker::run_threads_and_print(THREADS, |_, worker| {
        let mut errors = 0u64;
        while Instant::now() < until {
            let guard = match worker.call(|| client.try_lock_for("k", WAIT)) {
                Ok(g) => g,
                Err(_) => {
                    errors += 1;
                    thread::sleep(ms(20));
                    continue;
                }
            };
            let section = Section::start("k");
            thread::sleep(ms(3));
            let (token, told) = (guard.fencing_token(), guard.check().is_err());
            let release = || guard.unlock().is_ok_and(Unlocked::was_held);
            worker.sections.push(section.end(token, told, release));
        }
        vec![("errors", errors.to_string())]
    });
    child::print_counters(&client.stats(), &[]);
}

struct Run {
    sections: Vec<Section>,
    /// Per thread: sections that began after the fault was over.
    after_fault: Vec<usize>,
    stats: Vec<HashMap<String, String>>,
}

/// Runs the children on `group`, calls `fault` once they are busy, and collects.
fn run_with_fault(group: &SentinelGroup, ack: Option<usize>, fault: impl FnOnce()) -> Run {
    let mut envs = vec![
        ("S_URLS", group.sentinel_urls().join(",")),
        ("S_RUN_MS", "14000".to_owned()),
        ("S_LEASE_MS", "2000".to_owned()),
    ];
    if let Some(n) = ack {
        envs.push(("S_ACK", n.to_string()));
    }
    let children = child::spawn_many(PROCS, "child_failover_worker", &envs);
    thread::sleep(ms(1500));
    fault();
    let fault_over = mono_ns();
    let outputs = child::wait_all_ok(children, Duration::from_secs(150));
    let mut sections = Vec::new();
    let mut after_fault = Vec::new();
    let mut stats = Vec::new();
    for out in &outputs {
        for r in child::parse_results(out) {
            if let Some(worker) = Worker::parse(&r) {
                let after = worker.sections.iter().filter(|s| s.start > fault_over);
                after_fault.push(after.count());
                let longest = worker.longest.as_millis();
                assert!(
                    worker.longest <= WAIT + MARGIN,
                    "a call took {longest} ms, past its deadline"
                );
                eprintln!("thread: errors {} longest {longest} ms", r["errors"]);
                sections.extend(worker.sections);
            } else {
                eprintln!("child stats: {r:?}");
                stats.push(r);
            }
        }
    }
    Run {
        sections,
        after_fault,
        stats,
    }
}

fn check_run(run: &Run) {
    assert_eq!(
        run.after_fault.len(),
        PROCS * THREADS,
        "every thread reported"
    );
    assert!(
        run.after_fault.iter().all(|&n| n > 0),
        "every thread went on locking on the new master: {:?}",
        run.after_fault
    );
    let bad = Section::unexplained(&run.sections);
    assert!(bad.is_empty(), "overlaps nobody was told of: {bad:?}");
    let told = run.sections.iter().filter(|s| s.told).count();
    eprintln!("sections {} told-lost {told}", run.sections.len());
    let sum = |k: &str| -> u64 { run.stats.iter().map(|s| s[k].parse::<u64>().unwrap()).sum() };
    assert!(
        sum("failovers") >= PROCS as u64,
        "every process followed the master"
    );
    assert!(
        sum("wakeups_event") > sum("wakeups_lease") + sum("wakeups_recheck"),
        "waiters woke on events, not timers: {:?}",
        run.stats
    );
}

/// A master, two replicas and three sentinels; the master's port.
fn group_of_three() -> (SentinelGroup, u16) {
    init_log();
    let group = SentinelGroup::start(NAME, 2, 3);
    let master = group.master_port();
    (group, master)
}

#[test]
fn locks_follow_a_forced_failover() {
    let (group, old) = group_of_three();
    let run = run_with_fault(&group, None, || {
        let new = group.failover();
        eprintln!("failover: {old} -> {new}");
    });
    check_run(&run);
}

#[test]
fn locks_follow_a_killed_master() {
    let (group, old) = group_of_three();
    let run = run_with_fault(&group, None, || {
        group.server(old).kill();
        let new = group.wait_new_master(old);
        eprintln!("master {old} killed; new master {new}");
    });
    check_run(&run);
}

/// With `replica_ack(2, …)` a held lock is on both replicas before its holder gets it, so
/// the promoted one has it: holders across the failover keep their locks, and the tokens
/// of one name keep increasing.
#[test]
fn acknowledged_locks_survive_a_failover() {
    let (group, _) = group_of_three();
    let client = builder(&group)
        .lease(Duration::from_secs(30))
        .replica_ack(2, ms(200))
        .build()
        .expect("build");
    let names: Vec<String> = (0..8).map(|i| format!("held-{i}")).collect();
    let (tx, rx) = std::sync::mpsc::channel();
    let (done_tx, done_rx) = crossbeam_channel::bounded::<()>(0);
    let holders: Vec<_> = names
        .iter()
        .map(|name| {
            let (client, name, tx, done) =
                (client.clone(), name.clone(), tx.clone(), done_rx.clone());
            thread::spawn(move || {
                let guard = client.lock(&name).expect("lock with acknowledgement");
                tx.send(()).unwrap();
                let _ = done.recv();
                let lost = guard.is_lost();
                let outcome = guard.unlock();
                (lost, outcome.map(|o| o.was_held()).unwrap_or(false))
            })
        })
        .collect();
    for _ in &names {
        rx.recv_timeout(Duration::from_secs(20))
            .expect("every holder locked");
    }
    let before = client.lock("counted").expect("lock").fencing_token();
    let old = group.master_port();
    let new = group.failover();
    eprintln!("failover: {old} -> {new}");
    // Every held key is on the new master.
    let mut conn = group.server(new).conn();
    for name in &names {
        let exists: bool = redis::cmd("EXISTS")
            .arg(format!("redbaton:{{{name}}}"))
            .query(&mut conn)
            .expect("EXISTS");
        assert!(exists, "{name} survived the failover");
    }
    // Renewals go on against the new master for a while.
    thread::sleep(Duration::from_secs(3));
    let after = client
        .try_lock_for("counted", Duration::from_secs(30))
        .expect("lock after the failover")
        .fencing_token();
    assert!(
        after > before,
        "tokens keep increasing: {before} then {after}"
    );
    drop(done_tx);
    for h in holders {
        let (lost, held) = h.join().expect("holder");
        assert!(
            !lost && held,
            "a held lock survived: lost {lost}, held at unlock {held}"
        );
    }
    assert!(client.stats().failovers >= 1);
}

/// Read-write locks and semaphores through Sentinel: they work on the master, and after a
/// forced failover on the new one, with no hold left behind.
#[test]
fn rwlocks_and_semaphores_follow_the_master() {
    init_log();
    let group = SentinelGroup::start(NAME, 1, 3);
    let (a, b) = (
        builder(&group).build().expect("build"),
        builder(&group).build().expect("build"),
    );
    let check = |round: &str| {
        let r = a.rwlock("rw").read().expect("read");
        let r2 = b.rwlock("rw").read().expect("readers share");
        assert!(
            lock_builder!(sentinel(NAME, group.sentinel_urls()))
                .build()
                .expect("build")
                .rwlock("rw")
                .try_write()
                .unwrap_err()
                .is_would_block(),
            "{round}: a writer waits for the readers"
        );
        drop((r, r2));
        drop(b.rwlock("rw").try_write_for(secs(10)).expect("write"));
        let p = a.semaphore("sem", 1).acquire().expect("permit");
        let sem = b.semaphore("sem", 1);
        assert!(sem.try_acquire().unwrap_err().is_would_block());
        drop(p);
        drop(sem.try_acquire_for(secs(10)).expect("permit again"));
    };
    check("before the failover");
    let old = group.master_port();
    let new = group.failover();
    assert_ne!(old, new);
    // The clients follow the new master; calls meanwhile may fail once.
    let deadline = Instant::now() + secs(30);
    while a.rwlock("probe").try_write().is_err() || b.rwlock("probe").try_write().is_err() {
        assert!(
            Instant::now() < deadline,
            "clients did not follow the new master"
        );
        thread::sleep(ms(100));
    }
    check("after the failover");
    let left: Vec<String> = redis::cmd("KEYS")
        .arg("redbaton:*")
        .query(&mut group.server(new).conn())
        .expect("KEYS");
    assert!(
        left.iter().all(|k| k.ends_with(":fence")),
        "no hold left: {left:?}"
    );
}
