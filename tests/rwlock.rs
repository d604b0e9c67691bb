//! Read-write locks against a real redis-server: exclusion across processes (intervals
//! recorded by every section, compared on one system-wide monotonic clock), writer
//! preference, a SIGKILLed reader's hold expiring alone, one name one kind, and the cost of
//! idle waiters.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::thread;
use std::time::{Duration, Instant};

use redbaton::{LockClient, RwLock, Unlocked};
use redbaton_testkit::child;
use redbaton_testkit::child_only;
use redbaton_testkit::intervals::{self, Recorder};
use redbaton_testkit::lock_client;
use redbaton_testkit::ms;
use redbaton_testkit::server::RedisServer;
use redbaton_testkit::spin;
use redbaton_testkit::wait::join_all;
use redbaton_testkit::{test_server, test_server_and};

const PREFIX: &str = "rw:";

fn client(url: &str) -> LockClient {
    lock_client!(node(url), key_prefix(PREFIX))
}

/// A server of its own, and the read-write lock `name` of a client of it.
fn served(name: &str) -> (RedisServer, RwLock) {
    let srv = test_server();
    let rw = client(&srv.url()).rwlock(name);
    (srv, rw)
}

#[test]
fn smoke() {
    let (srv, rw) = served("smoke");
    let r1 = rw.read().expect("read");
    let r2 = rw.try_read().expect("second reader");
    let other = client(&srv.url()).rwlock("smoke");
    assert!(other.try_write().unwrap_err().is_would_block());
    r1.check().expect("held");
    let rt = r2.fencing_token();
    assert_eq!(r1.unlock().expect("unlock"), Unlocked::Released);
    assert_eq!(r2.unlock().expect("unlock"), Unlocked::Released);
    let w = rw.try_write().expect("write");
    assert!(w.fencing_token() > rt);
    assert!(other.try_read().unwrap_err().is_would_block());
    assert_eq!(w.unlock().expect("unlock"), Unlocked::Released);
    assert!(srv.keys("rw:*").iter().all(|k| k.ends_with(b":fence")));
}

#[test]
fn one_name_one_kind() {
    let (_srv, c) = test_server_and(client);
    let (rw, sem) = (c.rwlock("k"), c.semaphore("k", 2));
    let plain = c.lock("k").expect("lock");
    assert!(rw.try_read().unwrap_err().is_wrong_kind());
    assert!(rw.try_write().unwrap_err().is_wrong_kind());
    assert!(sem.try_acquire().unwrap_err().is_wrong_kind());
    drop(plain);
    let r = rw.read().expect("free again");
    assert!(c.try_lock("k").unwrap_err().is_wrong_kind());
    assert!(sem.try_acquire().unwrap_err().is_wrong_kind());
    drop(r);
    let p = sem.acquire().expect("permit");
    assert!(c.try_lock("k").unwrap_err().is_wrong_kind());
    assert!(rw.try_write().unwrap_err().is_wrong_kind());
    drop(p);
    c.lock("k").expect("plain again").unlock().expect("unlock");
}

#[test]
fn a_thread_never_waits_for_itself() {
    let (_srv, rw) = served("self");
    let r = rw.read().expect("read");
    assert!(matches!(
        rw.try_write_for(ms(100)),
        Err(redbaton::Error::WouldDeadlock)
    ));
    let again = rw.read().expect("a reader reads again");
    drop((r, again));
    let w = rw.write().expect("write");
    assert!(matches!(rw.read(), Err(redbaton::Error::WouldDeadlock)));
    drop(w);
}

/// A thread that reads joins its own read hold when it reads again; not once the hold is
/// known lost: it gets the loss, not a guard of a hold it no longer has.
#[test]
fn a_thread_reading_again_is_told_its_hold_is_lost() {
    let srv = test_server();
    // A short lease: the watchdog renews, and finds the hold gone, within a second.
    let c = lock_client!(node(srv.url()), key_prefix(PREFIX), lease(ms(3000)));
    let rw = c.rwlock("again");
    let r = rw.read().expect("read");
    let _: () = redis::cmd("DEL")
        .arg("rw:{again}")
        .query(&mut srv.conn())
        .expect("DEL");
    // The watchdog's next renewal finds the hold gone.
    let deadline = Instant::now() + Duration::from_secs(60);
    while r.check().is_ok() {
        assert!(Instant::now() < deadline, "the loss was never found");
        thread::sleep(ms(20));
    }
    match rw.read() {
        Err(e) => assert!(e.is_lost(), "{e:?}"),
        Ok(again) => panic!("a guard of a lost hold: its check says {:?}", again.check()),
    }
    assert!(r.check().unwrap_err().is_lost());
    drop(r);
    drop(rw.read().expect("the name is free: a new read hold"));
}

#[test]
fn a_waiting_writer_stops_new_readers() {
    let srv = test_server();
    let (a, b) = (client(&srv.url()), client(&srv.url()));
    let r = a.rwlock("pref").read().expect("read");
    let writer = thread::spawn(move || {
        let t = Instant::now();
        let w = b
            .rwlock("pref")
            .try_write_for(Duration::from_secs(20))
            .expect("write");
        (t.elapsed(), w.fencing_token())
    });
    // Until the writer has failed once and marked itself waiting.
    await_marks(&srv, "rw:{pref}:ww", 1);
    let c = client(&srv.url());
    assert!(c.rwlock("pref").try_read().unwrap_err().is_would_block());
    thread::sleep(ms(200));
    r.unlock().expect("unlock");
    let (waited, _) = writer.join().unwrap();
    eprintln!("writer waited {waited:?}");
    assert!(waited < Duration::from_secs(10));
}

/// Waits until the marks set `key` holds `n` waiters.
fn await_marks(srv: &RedisServer, key: &str, n: i64) {
    let mut conn = srv.conn();
    let deadline = Instant::now() + Duration::from_secs(10);
    while redis::cmd("ZCARD")
        .arg(key)
        .query::<i64>(&mut conn)
        .unwrap()
        < n
    {
        assert!(
            Instant::now() < deadline,
            "fewer than {n} waiters marked {key}"
        );
        thread::sleep(ms(5));
    }
}

/// Waits until `client` has failed `n` attempts (it is then waiting for an event).
fn await_failed_attempts(client: &LockClient, n: u64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while client.stats().failed_attempts < n {
        assert!(Instant::now() < deadline, "fewer than {n} failed attempts");
        thread::sleep(ms(5));
    }
}

/// A thread that takes the write lock `name` with `client`, holds it 300 ms, and returns
/// the client for its stats.
fn writer_holding(client: LockClient, name: &'static str) -> thread::JoinHandle<LockClient> {
    thread::spawn(move || {
        let w = client.rwlock(name).write().expect("write");
        thread::sleep(ms(300));
        w.unlock().expect("unlock");
        client
    })
}

#[test]
fn a_release_for_writers_only_does_not_wake_readers() {
    let srv = test_server();
    let (a, b, c) = (client(&srv.url()), client(&srv.url()), client(&srv.url()));
    let first = a.rwlock("turns").write().expect("write");
    let writer = writer_holding(b, "turns");
    await_marks(&srv, "rw:{turns}:ww", 1);
    let reader = thread::spawn(move || {
        let r = c.rwlock("turns").read().expect("read");
        drop(r);
        c
    });
    await_marks(&srv, "rw:{turns}:wr", 1);
    // The first writer's release frees the lock for the waiting writer only: the reader
    // sleeps through it, and wakes once, when the second writer is done.
    first.unlock().expect("unlock");
    let b = writer.join().unwrap();
    let c = reader.join().unwrap();
    let stats = c.stats();
    eprintln!("reader: {stats:?}");
    assert_eq!(stats.wakeups_event, 1, "woken by the second release only");
    assert_eq!(
        stats.failed_attempts, 2,
        "the first attempt, and the one after subscribing"
    );
    assert_eq!(b.stats().remote_acquisitions, 1);
}

#[test]
fn the_writer_waiting_longest_alone_is_woken() {
    let srv = test_server();
    let (a, b, c) = (client(&srv.url()), client(&srv.url()), client(&srv.url()));
    let first = a.rwlock("queue").write().expect("write");
    let waiting = b.clone();
    let b = writer_holding(b, "queue");
    await_marks(&srv, "rw:{queue}:ww", 1);
    await_failed_attempts(&waiting, 2);
    // The second waiting writer marks itself later: its mark is renewed later, so it
    // expires later and comes second.
    thread::sleep(ms(50));
    let waiting = c.clone();
    let c = writer_holding(c, "queue");
    await_marks(&srv, "rw:{queue}:ww", 2);
    // Its mark is there from its first attempt; it waits once its second one (made after
    // its subscription is confirmed) has failed too. A release before that could be
    // raced by that attempt.
    await_failed_attempts(&waiting, 2);
    first.unlock().expect("unlock");
    let (b, c) = (b.join().unwrap(), c.join().unwrap());
    let (sb, sc) = (b.stats(), c.stats());
    eprintln!("first waiter: {sb:?}\nsecond waiter: {sc:?}");
    assert_eq!(sb.wakeups_event, 1, "woken once, by the first release");
    assert_eq!(sb.failed_attempts, 2, "it did not race the other writer");
    assert_eq!(sc.wakeups_event, 1, "woken once, by the second release");
    assert_eq!(sc.failed_attempts, 2, "it slept through the first release");
}

/// A child of the exclusion test: `THREADS` threads, 80% reads, each section printed.
#[test]
fn child_mixed() {
    child_only!();
    let c = client(&child::env("REDIS_URL"));
    let iters: usize = child::env("ITERS").parse().unwrap();
    let counter = child::env("COUNTER");
    Recorder::new().run_threads_and_print(4, |sections| {
        let rw = c.rwlock("mixed");
        let mut conn = redis::Client::open(child::env("REDIS_URL"))
            .unwrap()
            .get_connection()
            .unwrap();
        for _ in 0..iters {
            let write = rand::random_range(0..10) < 2;
            if write {
                let g = rw.write().expect("write");
                sections.time("w", || {
                    let v: i64 = redis::cmd("GET")
                        .arg(&counter)
                        .query::<Option<i64>>(&mut conn)
                        .unwrap()
                        .unwrap_or(0);
                    spin(Duration::from_micros(300));
                    redis::cmd("SET")
                        .arg(&counter)
                        .arg(v + 1)
                        .query::<()>(&mut conn)
                        .unwrap();
                });
                g.check().expect("held");
                drop(g);
            } else {
                let g = rw.read().expect("read");
                sections.time("r", || {
                    spin(Duration::from_micros(rand::random_range(200..=1500)))
                });
                g.check().expect("held");
                drop(g);
            }
        }
    });
}

#[test]
fn readers_share_and_writers_exclude_across_processes() {
    let srv = test_server();
    let envs = [
        ("REDIS_URL", srv.url()),
        ("ITERS", "40".to_owned()),
        ("COUNTER", "counter".to_owned()),
    ];
    let all = intervals::from_children("child_mixed", 4, &envs, Duration::from_secs(120));
    assert_eq!(all.len(), 4 * 4 * 40);
    let writes = all.iter().filter(|s| s.tag == "w").count();
    let (mut reader_overlaps, mut across) = (0, 0);
    for (i, a) in all.iter().enumerate() {
        for b in &all[i + 1..] {
            if a.overlaps(b) {
                assert!(
                    a.tag == "r" && b.tag == "r",
                    "a writer overlapped: {a:?} {b:?}"
                );
                reader_overlaps += 1;
                across += usize::from(a.pid != b.pid);
            }
        }
    }
    let counter: i64 = redis::cmd("GET")
        .arg("counter")
        .query(&mut srv.conn())
        .unwrap();
    eprintln!(
        "{writes} writes, {reader_overlaps} overlapping reader pairs, {across} of them across processes"
    );
    assert_eq!(
        counter as usize, writes,
        "a write was lost: writers overlapped"
    );
    assert!(reader_overlaps > 0, "readers never overlapped");
    // Read phases: readers of different processes read side by side, writers waiting or not.
    assert!(
        across > 0,
        "readers of different processes never overlapped"
    );
}

/// A child of the starvation test: 4 threads reading back to back until `STOP` is set.
#[test]
fn child_readers() {
    child_only!();
    let url = child::env("REDIS_URL");
    let c = client(&url);
    let reads = Arc::new(AtomicU64::new(0));
    let handles: Vec<_> = (0..4)
        .map(|_| {
            let (c, url, reads) = (c.clone(), url.clone(), reads.clone());
            thread::spawn(move || {
                let mut conn = redis::Client::open(url).unwrap().get_connection().unwrap();
                let rw = c.rwlock("busy");
                loop {
                    let g = rw.read().expect("read");
                    spin(ms(2));
                    drop(g);
                    reads.fetch_add(1, SeqCst);
                    if reads.load(SeqCst) % 16 == 0
                        && redis::cmd("EXISTS")
                            .arg("stop")
                            .query::<i64>(&mut conn)
                            .unwrap()
                            == 1
                    {
                        return;
                    }
                }
            })
        })
        .collect();
    join_all(handles, "handles");
    child::print_result(&[("reads", reads.load(SeqCst).to_string())]);
}

/// A child of the starvation test: one write, timed.
#[test]
fn child_writer() {
    child_only!();
    let c = client(&child::env("REDIS_URL"));
    let t = Instant::now();
    let w = c
        .rwlock("busy")
        .try_write_for(Duration::from_secs(30))
        .expect("write");
    let waited = t.elapsed();
    drop(w);
    child::print_result(&[("waited_ms", waited.as_millis().to_string())]);
}

/// Documented bound: a waiting writer gets the lock once the read holds already granted
/// end: each process's shared read hold takes new local readers for at most
/// `handoff_slice` (10 ms) after which they ask Redis and meet the writer's mark; so the
/// wait is about that slice plus a section plus a few round trips. Asserted with a
/// generous liveness bound (5 s); the figure is printed.
#[test]
fn a_writer_is_not_starved_by_busy_readers() {
    let srv = test_server();
    let envs = [("REDIS_URL", srv.url())];
    let readers = child::spawn_many(2, "child_readers", &envs);
    // Let the readers get going.
    let mut conn = srv.conn();
    let deadline = Instant::now() + Duration::from_secs(20);
    while redis::cmd("EXISTS")
        .arg("rw:{busy}")
        .query::<i64>(&mut conn)
        .unwrap()
        == 0
    {
        assert!(Instant::now() < deadline, "readers never started");
        thread::sleep(ms(10));
    }
    thread::sleep(ms(500));
    let out = child::wait_ok(
        child::spawn_self("child_writer", &envs),
        Duration::from_secs(60),
    );
    let waited: u64 = child::parse_results(&out)[0]["waited_ms"].parse().unwrap();
    redis::cmd("SET")
        .arg("stop")
        .arg(1)
        .query::<()>(&mut conn)
        .unwrap();
    let mut reads = 0;
    for r in readers {
        let out = child::wait_ok(r, Duration::from_secs(60));
        reads += child::parse_results(&out)[0]["reads"]
            .parse::<u64>()
            .unwrap();
    }
    eprintln!("writer waited {waited} ms among {reads} reads");
    assert!(waited < 5000, "writer waited {waited} ms");
}

/// The lease of the holds of the crash test, short so that a killed reader's hold
/// expires soon.
const CRASH_LEASE: Duration = Duration::from_secs(2);

/// The read-write lock of the crash test, through a client of its own on `url`.
fn crash_lock(url: &str) -> RwLock {
    lock_client!(node(url), key_prefix(PREFIX), lease(CRASH_LEASE)).rwlock("crash")
}

/// A child that takes a read hold, says so, and holds it until killed.
#[test]
fn child_reader_holds() {
    child::hold_until_killed(|url| crash_lock(url).read().expect("read"));
}

#[test]
fn a_killed_readers_hold_expires_alone() {
    let srv = test_server();
    let lease = CRASH_LEASE;
    let reader = child::spawn_holder("child_reader_holds", srv.url());
    let other = crash_lock(&srv.url());
    let r = other.read().expect("another reader");
    let killed = child::kill_and_reap(reader);
    let url = srv.url();
    let writer = thread::spawn(move || {
        let w = crash_lock(&url)
            .try_write_for(Duration::from_secs(30))
            .expect("write");
        let at = Instant::now();
        drop(w);
        at
    });
    // The surviving reader keeps its hold past the killed reader's lease.
    thread::sleep(lease + ms(300));
    r.check().expect("the other reader's hold is unaffected");
    let joined = other.try_read();
    assert!(joined.is_ok() || joined.as_ref().unwrap_err().is_would_block());
    drop(joined);
    assert_eq!(r.unlock().unwrap(), Unlocked::Released);
    let got = writer.join().unwrap();
    let after = got.duration_since(killed);
    eprintln!("writer got the lock {after:?} after the reader was killed");
    assert!(after <= lease + Duration::from_secs(1), "{after:?}");
}

/// 20 idle waiters (10 readers, 10 writers) behind a writer cost Redis almost nothing.
#[test]
fn idle_waiters_cost_almost_no_commands() {
    let (srv, holder) = test_server_and(client);
    let w = holder.rwlock("idle").write().expect("write");
    let waiters = client(&srv.url());
    let handles: Vec<_> = (0..20)
        .map(|i| {
            let c = waiters.clone();
            thread::spawn(move || {
                let rw = c.rwlock("idle");
                let t = Duration::from_secs(8);
                if i % 2 == 0 {
                    rw.try_read_for(t).map(drop)
                } else {
                    rw.try_write_for(t).map(drop)
                }
            })
        })
        .collect();
    let spent = srv.idle_cost("20 idle waiters");
    assert!(spent < 10, "{spent} commands: {:?}", srv.commandstats());
    drop(w);
    for got in join_all(handles, "waiter") {
        got.expect("every waiter got in once the writer left");
    }
}
