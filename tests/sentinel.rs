//! A Sentinel-managed master: locks follow the master through a failover, waiters keep
//! waking on events, and a holder whose lock did not survive is told; a sentinel that
//! names a server which is not the master (a replica, a dead address) is passed over for
//! the next one, at build and after a failover. The group (master,
//! replicas, sentinels) is made of real `redis-server` processes; the contenders are
//! real child processes.

use std::collections::HashMap;
use std::thread;
use std::time::{Duration, Instant};

use redbaton::Unlocked;
use redbaton_testkit::child_only;
use redbaton_testkit::clock::mono_ns;
use redbaton_testkit::keys::Keys;
use redbaton_testkit::proxy::Proxy;
use redbaton_testkit::sections::{Section, Worker};
use redbaton_testkit::sentinel::SentinelGroup;
use redbaton_testkit::server::RedisServer;
use redbaton_testkit::wait::wait_for;
use redbaton_testkit::{child, init_log, ms, secs};
use redbaton_testkit::{lock_builder, lock_client};

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

/// Has `sentinel` fail `name` over, asking again while it refuses (a sentinel that has
/// just started may not yet count its replica as a good one).
fn failover(sentinel: &RedisServer, name: &str) {
    let asked = Instant::now();
    loop {
        let r: redis::RedisResult<()> = redis::cmd("SENTINEL")
            .arg("FAILOVER")
            .arg(name)
            .query(&mut sentinel.conn());
        match r {
            Ok(()) => return,
            Err(e) => assert!(asked.elapsed() < secs(30), "failover refused: {e}"),
        }
        thread::sleep(ms(200));
    }
}

/// A sentinel that names the server at `port` the master of `name`, and never fails it
/// over within a test (only on `SENTINEL FAILOVER`).
fn lone_sentinel(name: &str, port: u16) -> RedisServer {
    RedisServer::builder()
        .sentinel()
        .config("sentinel", &format!("monitor {name} 127.0.0.1 {port} 1"))
        .config("sentinel", &format!("down-after-milliseconds {name} 60000"))
        .config("sentinel", &format!("failover-timeout {name} 60000"))
        .start()
}

/// The port `sentinel` names as the master of `name`, if it names one.
fn named_port(sentinel: &RedisServer, name: &str) -> Option<u16> {
    redis::cmd("SENTINEL")
        .arg("GET-MASTER-ADDR-BY-NAME")
        .arg(name)
        .query::<Option<(String, u16)>>(&mut sentinel.conn())
        .ok()
        .flatten()
        .map(|(_, port)| port)
}

/// Has `good` fail `name` over from `m` to `r` (the pair), and checks that `client`
/// follows it within 30 s (generous: the watcher resolves again at a fault, and every ten
/// seconds anyway).
fn fail_over_and_follow(
    client: &redbaton::LockClient,
    good: &RedisServer,
    name: &str,
    (m, r): (&RedisServer, &RedisServer),
) {
    failover(good, name);
    wait_for(secs(30), "the replica promoted", || {
        r.info("replication").contains("role:master") && named_port(good, name) == Some(r.port())
    });
    wait_for(secs(30), "the old master demoted", || {
        !m.info("replication").contains("role:master")
    });
    if let Err(last) = follows(client, secs(30)) {
        panic!(
            "30 s after the failover the client still fails ({last:?}; failovers seen: {})",
            client.stats().failovers
        );
    }
    assert!(
        client.stats().failovers >= 1,
        "followed without a failover counted"
    );
}

/// Takes the lock `name` with `client`, and checks that its key is on `server` (`what`).
fn lock_is_on(client: &redbaton::LockClient, name: &str, server: &RedisServer, what: &str) {
    let g = client.lock(name).expect("lock");
    assert!(
        redbaton_testkit::exists(&mut server.conn(), Keys::DEFAULT.lock(name)),
        "the lock {name} is not on {what}"
    );
    drop(g);
}

/// Sends `SENTINEL <command>` (its words split at spaces) to `sentinel`.
fn tell(sentinel: &RedisServer, command: &str) {
    let () = redis::cmd("SENTINEL")
        .arg(command.split(' ').collect::<Vec<_>>())
        .query(&mut sentinel.conn())
        .unwrap_or_else(|e| panic!("SENTINEL {command}: {e}"));
}

/// Tries `client.try_lock` every 200 ms for up to `limit`, until it takes the lock: the
/// client has followed a failover. The last error otherwise.
fn follows(client: &redbaton::LockClient, limit: Duration) -> Result<(), Option<String>> {
    let t0 = Instant::now();
    let mut last = None;
    while t0.elapsed() < limit {
        match client.try_lock("after") {
            Ok(g) => {
                drop(g);
                return Ok(());
            }
            Err(e) => last = Some(e.to_string()),
        }
        thread::sleep(ms(200));
    }
    Err(last)
}

/// A master, one replica, one sentinel watching the master at `monitored` (its own port
/// or a proxy's) that never fails over by itself (only on `SENTINEL FAILOVER`).
fn manual_group(name: &str, master: &RedisServer, monitored: u16) -> (RedisServer, RedisServer) {
    let r = RedisServer::builder()
        .config("replicaof", &format!("127.0.0.1 {}", master.port()))
        .start();
    wait_for(secs(20), "replica in sync", || {
        r.info("replication").contains("master_link_status:up")
    });
    let sentinel = lone_sentinel(name, monitored);
    wait_for(secs(30), "the sentinel knows the replica", || {
        let m: Vec<String> = redis::cmd("SENTINEL")
            .arg("MASTER")
            .arg(name)
            .query(&mut sentinel.conn())
            .unwrap_or_default();
        m.iter()
            .position(|x| x == "num-slaves")
            .and_then(|i| m.get(i + 1))
            .is_some_and(|v| v == "1")
    });
    (r, sentinel)
}

/// [`manual_group`] of a master of its own: the master, the replica, the sentinel.
fn group_of_one(name: &str) -> (RedisServer, RedisServer, RedisServer) {
    init_log();
    let m = RedisServer::start();
    let (r, sentinel) = manual_group(name, &m, m.port());
    (m, r, sentinel)
}

/// A pool connection whose connect is in flight when the watcher follows a failover
/// belongs to the old master: it may serve the call it was opened for (a lock taken
/// there is the unprotected window of an asynchronous failover), but it is never put
/// back as a connection to the new one, so the lock's renewals go to the new master,
/// which never had it, and its holder is told. Here the old master cannot be demoted (as
/// if cut off from the sentinels but not from this client), and a fresh client takes the
/// same name on the new one: the first holder must not go on believing in it.
#[test]
fn a_connection_opened_across_a_failover_is_not_kept() {
    init_log();
    let name = "rvw";
    // The old master refuses to be demoted.
    let m = RedisServer::builder()
        .config("rename-command", "REPLICAOF \"\"")
        .config("rename-command", "SLAVEOF \"\"")
        .start();
    // Everybody reaches the master through the proxy (the sentinel names its address).
    let p = Proxy::start(m.addr());
    let (r, sentinel) = manual_group(name, &m, p.port());
    let x = lock_client!(
        sentinel(name, vec![sentinel.url()]),
        io_timeouts(secs(4)),
        lease(secs(8)),
        fair(false),
        wakeup(redbaton::Wakeup::Polling(ms(200)))
    );
    let accepted = p.connections_accepted();
    p.stall(true);
    let (tx, rx) = std::sync::mpsc::channel::<(&str, Option<u64>)>();
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let (lost_tx, lost_rx) = std::sync::mpsc::channel::<(&str, Option<bool>)>();
    let done_rx = std::sync::Mutex::new(done_rx);
    std::thread::scope(|s| {
        // Two at once: one may take a connection the pool already had, the other opens
        // one (its connect is in flight while the proxy holds its bytes).
        for lock_name in ["two", "aux"] {
            let (tx, x, done_rx, lost_tx) = (tx.clone(), &x, &done_rx, lost_tx.clone());
            s.spawn(move || {
                let got = x.try_lock_for(lock_name, secs(40));
                let fence = got
                    .as_ref()
                    .ok()
                    .filter(|g| !g.is_lost())
                    .map(|g| g.fencing_token());
                tx.send((lock_name, fence)).unwrap();
                let _ = done_rx.lock().unwrap().recv();
                lost_tx
                    .send((lock_name, got.as_ref().ok().map(|g| g.is_lost())))
                    .unwrap();
                drop(got);
            });
        }
        wait_for(secs(20), "the client's connect in flight", || {
            p.connections_accepted() > accepted
        });
        std::thread::sleep(ms(300));
        failover(&sentinel, name);
        let t0 = std::time::Instant::now();
        while x.stats().failovers < 1 {
            if t0.elapsed() > secs(30) {
                p.stall(false);
                panic!("the client did not follow the switch");
            }
            std::thread::sleep(ms(50));
        }
        eprintln!("switch followed after {:?}", t0.elapsed());
        p.stall(false);
        let mut fences = std::collections::HashMap::new();
        for _ in 0..2 {
            let (n, f) = rx.recv().unwrap();
            fences.insert(n, f);
        }
        let got = fences["two"];
        let on = |srv: &RedisServer, name: &str| {
            redbaton_testkit::exists(
                &mut srv.conn(),
                redbaton_testkit::keys::Keys::DEFAULT.lock(name),
            )
        };
        eprintln!(
            "after the switch: {fences:?}; key on old master {}, on new master {}",
            on(&m, "two"),
            on(&r, "two")
        );
        let y = lock_client!(
            sentinel(name, vec![sentinel.url()]),
            io_timeouts(secs(5)),
            fair(false)
        );
        let other = y.try_lock("two");
        eprintln!(
            "a fresh client: {:?}",
            other.as_ref().map(|g| g.fencing_token())
        );
        // Where a later lock goes, and the watchdog's renewals (lease 8 s: renewals
        // every few seconds): the new master.
        let later = x.try_lock("later").expect("later");
        eprintln!(
            "a later lock of the first client: key on old {}, on new {}",
            on(&m, "later"),
            on(&r, "later")
        );
        std::thread::sleep(secs(7));
        eprintln!("7 s later: later.is_lost() = {}", later.is_lost());
        drop(done_tx);
        let lost: std::collections::HashMap<_, _> =
            (0..2).map(|_| lost_rx.recv().unwrap()).collect();
        eprintln!("7 s after the switch, lost per guard: {lost:?}");
        assert!(
            !(got.is_some() && other.is_ok() && lost["two"] == Some(false)),
            "two holders of one name: the first client's lock went to the old master"
        );
    });
}

/// The master process hangs (SIGSTOP: the kernel still accepts connections, the process
/// answers nothing). A command of the client times out, which makes the watcher look for
/// the master at once, while the sentinel still names the hung one: the watcher's own
/// connections time out too (with a resolver that read without a timeout it blocked
/// there for as long as the master hung), and it follows the failover the sentinel then
/// makes.
#[test]
fn the_watcher_follows_a_failover_away_from_a_hung_master() {
    let name = "hung";
    let (m, r, sentinel) = group_of_one(name);
    let c = lock_client!(
        sentinel(name, vec![sentinel.url()]),
        io_timeouts(ms(1000)),
        fair(false),
        wakeup(redbaton::Wakeup::Polling(ms(200)))
    );
    drop(c.lock("warm").expect("lock"));
    m.pause();
    // One command times out on the hung master: the watcher looks again, now (the
    // sentinel still names the hung master).
    let first = c.try_lock("during");
    eprintln!(
        "during the hang: {:?}",
        first.as_ref().map(|g| g.fencing_token())
    );
    drop(first);
    std::thread::sleep(ms(1000));
    failover(&sentinel, name);
    wait_for(secs(30), "the replica promoted", || {
        r.info("replication").contains("role:master")
            && named_port(&sentinel, name) == Some(r.port())
    });
    let followed = follows(&c, secs(20));
    let failovers = c.stats().failovers;
    m.resume();
    if let Err(last) = followed {
        panic!(
            "20 s after the sentinel named the new master, the client still fails ({last:?}; \
             failovers seen: {failovers})"
        );
    }
}

/// The first sentinel listed accepts connections and answers nothing (a stopped
/// process): `build()` asks the next one, within the client's timeouts, instead of
/// reading from the hung one for as long as it hangs; and with no other sentinel, it
/// fails in time with a connection error.
#[test]
fn build_does_not_wait_on_a_hung_sentinel() {
    let name = "hung-sentinel";
    let (_m, _r, sentinel) = group_of_one(name);
    let hung = RedisServer::start();
    hung.pause();
    let build = |sentinels: Vec<String>| {
        let (tx, rx) = crossbeam_channel::bounded(1);
        thread::spawn(move || {
            let r = lock_builder!(sentinel(name, sentinels), io_timeouts(ms(500))).build();
            let _ = tx.send(r.map(|c| drop(c.lock("k").expect("lock on the master"))));
        });
        rx.recv_timeout(secs(30))
    };
    let two = build(vec![hung.url(), sentinel.url()]);
    let one = build(vec![hung.url()]);
    hung.resume();
    match two {
        Ok(r) => r.expect("build through the second sentinel"),
        Err(_) => panic!("build() still waits on the hung sentinel after 30 s"),
    }
    match one {
        Ok(r) => assert!(
            r.as_ref().is_err_and(redbaton::Error::is_connection),
            "{r:?}"
        ),
        Err(_) => panic!("build() with only a hung sentinel still waits after 30 s"),
    }
}

/// The first sentinel listed names a replica (of a server outside the group) as the
/// master; the second names the real one. `build()` takes the master the second names,
/// instead of failing on the first one's answer (a sentinel that missed a failover, or
/// was restarted with an old configuration, answers so).
#[test]
fn build_asks_the_next_sentinel_when_the_first_names_a_replica() {
    let name = "wrong-first";
    let (m, _r, good) = group_of_one(name);
    // Outside the group: a replica of a server of its own, which a sentinel of its own
    // names the master.
    let other = RedisServer::start();
    let (replica, _other_sentinel) = manual_group("elsewhere", &other, other.port());
    let stale = lone_sentinel(name, replica.port());
    assert_eq!(named_port(&stale, name), Some(replica.port()));
    let built = lock_builder!(
        sentinel(name, vec![stale.url(), good.url()]),
        io_timeouts(ms(1000))
    )
    .build();
    let c = match built {
        Ok(c) => c,
        Err(e) => panic!("build() gave up on the first sentinel's replica: {e}"),
    };
    lock_is_on(&c, "held", &m, "the master the second sentinel names");
}

/// The client was built through the second sentinel (the first did not know the master
/// then). The first then comes to name an address where nothing listens, and the second
/// fails the master over to the replica: the watcher, asking the sentinels in order, must
/// not stop at the first one's dead address, and the client goes on locking on the new
/// master.
#[test]
fn the_watcher_asks_the_next_sentinel_when_the_first_names_a_dead_master() {
    let name = "dead-first";
    let (m, r, good) = group_of_one(name);
    // Knows nothing of `name` yet: build() asks the next sentinel.
    let stale = RedisServer::builder().sentinel().start();
    let c = lock_client!(
        sentinel(name, vec![stale.url(), good.url()]),
        io_timeouts(ms(1000)),
        fair(false),
        wakeup(redbaton::Wakeup::Polling(ms(200)))
    );
    drop(c.lock("warm").expect("lock on the first master"));
    // The first sentinel now names a dead address as the master.
    let dead_port: u16 = redbaton_testkit::dead_url()
        .trim_start_matches("redis://127.0.0.1:")
        .trim_end_matches('/')
        .parse()
        .expect("a port");
    tell(&stale, &format!("MONITOR {name} 127.0.0.1 {dead_port} 1"));
    tell(&stale, &format!("SET {name} down-after-milliseconds 60000"));
    assert_eq!(named_port(&stale, name), Some(dead_port));
    fail_over_and_follow(&c, &good, name, (&m, &r));
    lock_is_on(&c, "on-new", &r, "the new master");
}

/// The first sentinel listed names the master through a link (a proxy: the address the
/// client then uses). The link breaks, and that sentinel, cut off from the group, goes on
/// naming the address it cannot reach while the second fails the master over to the
/// replica: the watcher checks the current address too, rather than keep it because a
/// sentinel still names it, and follows the second sentinel to the new master.
#[test]
fn the_watcher_leaves_a_current_master_that_a_stale_sentinel_still_names() {
    let name = "stale-current";
    let (m, r, good) = group_of_one(name);
    let link = Proxy::start(m.addr());
    let stale = lone_sentinel(name, link.port());
    let c = lock_client!(
        sentinel(name, vec![stale.url(), good.url()]),
        io_timeouts(ms(1000)),
        fair(false),
        wakeup(redbaton::Wakeup::Polling(ms(200)))
    );
    lock_is_on(&c, "warm", &m, "the master, through the link");
    link.blackhole(true);
    // The first sentinel forgets what it learned through the link (the replica, the
    // other sentinel) and watches the cut address anew: it can learn nothing more.
    tell(&stale, &format!("REMOVE {name}"));
    tell(
        &stale,
        &format!("MONITOR {name} 127.0.0.1 {} 1", link.port()),
    );
    tell(&stale, &format!("SET {name} down-after-milliseconds 60000"));
    assert_eq!(
        named_port(&stale, name),
        Some(link.port()),
        "the stale sentinel"
    );
    fail_over_and_follow(&c, &good, name, (&m, &r));
    link.blackhole(false);
}
