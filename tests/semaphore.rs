//! Semaphores against a real redis-server: never more holders than permits across
//! processes (intervals on one system-wide monotonic clock), a SIGKILLed holder's permit
//! returning after its lease, the permit count rule, and the cost of idle waiters.

use std::thread;
use std::time::Duration;

use redbaton::{LockClient, Unlocked};
use redbaton_testkit::child;
use redbaton_testkit::child_only;
use redbaton_testkit::intervals::{self, Recorder};
use redbaton_testkit::lock_client;
use redbaton_testkit::ms;
use redbaton_testkit::test_server;
use redbaton_testkit::wait::join_all;

const PREFIX: &str = "sem:";

/// A client whose keys carry the prefix of the semaphore tests.
fn sem_client(url: &str) -> LockClient {
    lock_client!(node(url), key_prefix(PREFIX))
}

#[test]
fn smoke() {
    let srv = test_server();
    let c = sem_client(&srv.url());
    let sem = c.semaphore("smoke", 2);
    let a = sem.acquire().expect("first");
    let b = sem.try_acquire().expect("second");
    assert!(sem.try_acquire().unwrap_err().is_would_block());
    a.check().expect("held");
    assert_eq!(a.unlock().expect("unlock"), Unlocked::Released);
    let c2 = sem.try_acquire().expect("a permit came back");
    drop((b, c2));
    assert!(srv.keys("sem:*").is_empty(), "{:?}", srv.keys("sem:*"));
}

#[test]
fn permit_count_must_match_while_held() {
    let srv = test_server();
    let c = sem_client(&srv.url());
    let p = c.semaphore("count", 3).acquire().expect("permit");
    let err = c.semaphore("count", 4).try_acquire().unwrap_err();
    assert!(err.is_permits_mismatch(), "{err}");
    let zero = c.semaphore("count", 0).try_acquire().unwrap_err();
    assert!(
        matches!(zero, redbaton::Error::InvalidArgument(_)),
        "{zero:?}"
    );
    drop(p);
    // Nobody holds it: the next holder's count is the one.
    let p = c.semaphore("count", 4).acquire().expect("new count");
    drop(p);
}

/// A child of the bound test: 4 threads taking a permit over and over, sections printed.
#[test]
fn child_permits() {
    child_only!();
    let c = sem_client(&child::env("REDIS_URL"));
    let iters: usize = child::env("ITERS").parse().unwrap();
    Recorder::new().run_threads_and_print(4, |held| {
        let sem = c.semaphore("bound", 3);
        for _ in 0..iters {
            let p = sem.acquire().expect("permit");
            held.time("p", || {
                thread::sleep(Duration::from_micros(rand::random_range(200..=2000)))
            });
            p.check().expect("held");
            drop(p);
        }
    });
}

#[test]
fn never_more_holders_than_permits_across_processes() {
    let srv = test_server();
    let envs = [("REDIS_URL", srv.url()), ("ITERS", "30".to_owned())];
    let held = intervals::from_children("child_permits", 4, &envs, Duration::from_secs(120));
    assert_eq!(2 * held.len(), 2 * 4 * 4 * 30);
    let most = intervals::most_at_once(&held);
    eprintln!("at most {most} holders at once");
    assert!(most <= 3, "{most} holders at once");
    assert!(most >= 2, "permits were never held together");
}

/// A child that takes a permit, says so, and holds it until killed.
#[test]
fn child_permit_holds() {
    child::hold_until_killed(|url| {
        lock_client!(node(url), key_prefix(PREFIX), lease(Duration::from_secs(2)))
            .semaphore("crash", 3)
            .acquire()
            .expect("permit")
    });
}

#[test]
fn a_killed_holders_permit_returns_after_its_lease() {
    let srv = test_server();
    let lease = Duration::from_secs(2);
    let holder = child::spawn_holder("child_permit_holds", srv.url());
    let c = lock_client!(node(srv.url()), key_prefix(PREFIX), lease(lease));
    let sem = c.semaphore("crash", 3);
    let a = sem.acquire().expect("second permit");
    let url = srv.url();
    let b = thread::spawn(move || {
        let c = lock_client!(node(url), key_prefix(PREFIX), lease(lease));
        let p = c.semaphore("crash", 3).acquire().expect("third permit");
        // Held past the killed holder's lease: renewed, unaffected.
        thread::sleep(lease + ms(500));
        p.check().expect("held");
        p.unlock().unwrap()
    });
    thread::sleep(ms(100));
    let killed = child::kill_and_reap(holder);
    let p = sem
        .try_acquire_for(Duration::from_secs(30))
        .expect("the killed holder's permit");
    let after = killed.elapsed();
    eprintln!("permit back {after:?} after the holder was killed");
    assert!(after <= lease + Duration::from_secs(1), "{after:?}");
    a.check().expect("held");
    assert_eq!(b.join().unwrap(), Unlocked::Released);
    drop((a, p));
}

/// 20 idle waiters on a full semaphore cost Redis almost nothing.
#[test]
fn idle_waiters_cost_almost_no_commands() {
    let srv = test_server();
    let holder = sem_client(&srv.url());
    let p = holder.semaphore("idle", 1).acquire().expect("permit");
    let waiters = sem_client(&srv.url());
    let handles: Vec<_> = (0..20)
        .map(|_| {
            let c = waiters.clone();
            thread::spawn(move || {
                c.semaphore("idle", 1)
                    .try_acquire_for(Duration::from_secs(20))
                    .map(drop)
            })
        })
        .collect();
    let spent = srv.idle_cost("20 idle waiters");
    assert!(spent < 10, "{spent} commands: {:?}", srv.commandstats());
    drop(p);
    for h in handles {
        h.join()
            .unwrap()
            .expect("every waiter got a permit in turn");
    }
}

/// The threads of one process wait for a permit one at a time in Redis: a freed permit
/// costs one attempt per process, not one per waiting thread. Eight threads of one client
/// take a one-permit semaphore in turn; each fails twice (its attempts before and after
/// subscribing, while the previous one holds): 16, where waking all of them at each
/// release failed 44 times.
#[test]
fn local_waiters_take_turns_for_a_permit() {
    let srv = test_server();
    let waiters = sem_client(&srv.url());
    let holder = sem_client(&srv.url());
    let first = holder.semaphore("one", 1).acquire().expect("permit");
    let before = waiters.stats();
    let done: Vec<_> = (0..8)
        .map(|_| {
            let c = waiters.clone();
            thread::spawn(move || {
                let p = c
                    .semaphore("one", 1)
                    .try_acquire_for(Duration::from_secs(20))
                    .expect("permit in turn");
                thread::sleep(ms(20));
                drop(p);
            })
        })
        .collect();
    thread::sleep(ms(200));
    drop(first);
    join_all(done, "waiter");
    let s = waiters.stats();
    let failed = s.failed_attempts - before.failed_attempts;
    eprintln!("failed attempts: {failed}; {s:?}");
    assert!(
        failed <= 24,
        "{failed} failed attempts for 8 permits in turn"
    );
}

// A freed permit wakes one waiter: the permit-seeker waiting longest, by its mark.

use std::sync::mpsc::{self, Receiver};
use std::sync::{Arc, Condvar, Mutex};

use redbaton::Stats;
use redbaton_testkit::wait::{join_within, wait_for};

/// A client of its own for each waiter (it waits in Redis, as a process of its own would)
/// whose waits end only by a message: its re-checks and the holders' lease hints come
/// long after the test.
fn patient_client(url: &str) -> LockClient {
    lock_client!(
        node(url),
        key_prefix(PREFIX),
        lease(Duration::from_secs(60)),
        recheck_interval(Duration::from_secs(60))
    )
}

/// The waiting permit-seekers' marks of `name`.
fn permit_marks(name: &str) -> String {
    format!("{PREFIX}{{{name}}}:ww")
}

/// Waiters for a permit of `name` (or holders: those that get one at once), one thread
/// per client: each takes a permit, says so, and holds it until the gate opens.
struct PermitWaiters {
    clients: Vec<LockClient>,
    threads: Vec<thread::JoinHandle<()>>,
    got: Receiver<usize>,
    gate: Arc<(Mutex<bool>, Condvar)>,
}

impl PermitWaiters {
    fn start(clients: Vec<LockClient>, name: &str, permits: u32) -> Self {
        let (tx, got) = mpsc::channel();
        let gate = Arc::new((Mutex::new(false), Condvar::new()));
        let threads = clients
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let (c, name, tx, gate) = (c.clone(), name.to_owned(), tx.clone(), gate.clone());
                thread::spawn(move || {
                    let p = c
                        .semaphore(&name, permits)
                        .try_acquire_for(Duration::from_secs(60))
                        .expect("a permit in turn");
                    tx.send(i).expect("the test listens");
                    let (open, opened) = &*gate;
                    drop(
                        opened
                            .wait_while(open.lock().unwrap(), |open| !*open)
                            .unwrap(),
                    );
                    drop(p);
                })
            })
            .collect();
        PermitWaiters {
            clients,
            threads,
            got,
            gate,
        }
    }

    /// Waits until every waiter sleeps in Redis: it failed twice (its attempts before and
    /// after subscribing) and `marks` marks wait.
    fn asleep(&self, srv: &redbaton_testkit::server::RedisServer, name: &str, marks: usize) {
        wait_for(Duration::from_secs(30), "every waiter asleep", || {
            srv.zcard(&permit_marks(name)) == marks
                && self.clients.iter().all(|c| c.stats().failed_attempts >= 2)
        });
    }

    fn stats(&self) -> Vec<Stats> {
        self.clients.iter().map(LockClient::stats).collect()
    }

    /// The next waiter to say it holds a permit (within a bound far shorter than the
    /// waiters' re-checks: a wake-up lost would show as a timeout).
    fn next(&self) -> usize {
        self.got
            .recv_timeout(Duration::from_secs(30))
            .expect("a waiter got a permit")
    }

    /// Lets every holder go, and every waiter after it as soon as it holds.
    fn open(&self) {
        let (open, opened) = &*self.gate;
        *open.lock().unwrap() = true;
        opened.notify_all();
    }

    /// Waits for every waiter to have held and let go.
    fn join(self) {
        join_within(self.threads, Duration::from_secs(60), "permit waiter");
    }

    fn open_and_join(self) {
        self.open();
        self.join();
    }
}

/// What each waiter's counters did between two snapshots: the failed attempts of all,
/// and each one's waits ended by a message.
fn woken(before: &[Stats], after: &[Stats]) -> (u64, Vec<u64>) {
    let failed = before
        .iter()
        .zip(after)
        .map(|(b, a)| a.failed_attempts - b.failed_attempts)
        .sum();
    let woken = before
        .iter()
        .zip(after)
        .map(|(b, a)| a.wakeups_event - b.wakeups_event)
        .collect();
    (failed, woken)
}

/// Writes held back by the server (`CLIENT PAUSE WRITE`) until [`resume`](Self::resume):
/// the scripts sent meanwhile wait, then run one after the other in the order they came.
struct HeldBack<'a>(&'a redbaton_testkit::server::RedisServer);

impl<'a> HeldBack<'a> {
    fn start(srv: &'a redbaton_testkit::server::RedisServer) -> Self {
        let () = redis::cmd("CLIENT")
            .arg("PAUSE")
            .arg(30_000)
            .arg("WRITE")
            .query(&mut srv.conn())
            .expect("CLIENT PAUSE");
        HeldBack(srv)
    }

    /// Waits until `n` scripts wait.
    fn waiting(&self, n: usize) {
        wait_for(Duration::from_secs(30), "scripts held back", || {
            let clients = self.0.client_list();
            let held = clients
                .iter()
                .filter(|c| c.get("flags").is_some_and(|f| f.contains('b')))
                .filter(|c| c.get("cmd").is_some_and(|cmd| cmd == "evalsha"));
            held.count() == n
        });
    }

    fn resume(self) {
        let () = redis::cmd("CLIENT")
            .arg("UNPAUSE")
            .query(&mut self.0.conn())
            .expect("CLIENT UNPAUSE");
    }
}

/// Lets `holders` go in one burst: their releases run one after the other, before any
/// waiter they woke can try.
fn release_at_once(srv: &redbaton_testkit::server::RedisServer, holders: PermitWaiters) {
    let held = HeldBack::start(srv);
    holders.open();
    held.waiting(holders.clients.len());
    held.resume();
    holders.join();
}

/// `permits` holders let go together, `n` waiters (each a client of its own) asleep:
/// `permits` distinct waiters get a permit, each woken alone; then each one that lets go
/// wakes the next. Nobody wakes to fail: one wake-up per waiter, no failed attempt.
fn a_burst_of_releases_wakes_as_many_waiters(name: &str, permits: u32, n: usize) {
    let srv = test_server();
    let holders = PermitWaiters::start(
        (0..permits).map(|_| patient_client(&srv.url())).collect(),
        name,
        permits,
    );
    for _ in 0..permits {
        holders.next();
    }
    let waiters = PermitWaiters::start(
        (0..n).map(|_| patient_client(&srv.url())).collect(),
        name,
        permits,
    );
    waiters.asleep(&srv, name, n);
    // Their marks are the waiting writers' set: `inspect` shows them there.
    let info = waiters.clients[0].inspect(name).expect("inspect");
    assert_eq!(info.waiting_writers.len(), n, "{info:?}");
    let before = waiters.stats();
    release_at_once(&srv, holders);
    let first: Vec<usize> = (0..permits).map(|_| waiters.next()).collect();
    let (failed, woken_now) = woken(&before, &waiters.stats());
    eprintln!("after {permits} releases: {first:?} hold; woken {woken_now:?}, {failed} failed");
    assert_eq!(failed, 0, "a waiter woke to fail");
    assert_eq!(srv.zcard(&permit_marks(name)), n - permits as usize);
    let stats = waiters.clients.clone();
    waiters.open_and_join();
    let after: Vec<Stats> = stats.iter().map(LockClient::stats).collect();
    let (failed, woken) = woken(&before, &after);
    eprintln!("all {n} in turn: woken {woken:?}, {failed} failed");
    assert_eq!(failed, 0, "a waiter woke to fail");
    assert_eq!(woken, vec![1; n], "one wake-up each");
    assert!(srv.keys_but_fences(&format!("{PREFIX}*")).is_empty());
}

/// One release wakes exactly one of five waiting processes.
#[test]
fn a_freed_permit_wakes_one_waiter() {
    a_burst_of_releases_wakes_as_many_waiters("one-wake", 1, 5);
}

/// Three releases in quick succession wake three distinct waiters of eight: each release
/// takes the mark of the one it wakes, so the next wakes the next.
#[test]
fn releases_in_a_burst_wake_distinct_waiters() {
    a_burst_of_releases_wakes_as_many_waiters("burst-wake", 3, 8);
}

/// A child that waits for the permit of "crash-wake" until killed; its mark lives 40 s (a
/// re-check of 20 s, as the test's other waiters).
#[test]
fn child_permit_waits() {
    child_only!();
    let c = lock_client!(
        node(child::env("REDIS_URL")),
        key_prefix(PREFIX),
        recheck_interval(Duration::from_secs(20))
    );
    let _ = c
        .semaphore("crash-wake", 1)
        .try_acquire_for(Duration::from_secs(120));
}

/// A waiter SIGKILLed while it waits leaves its mark, the oldest: the release wakes it,
/// and nobody else. The others get the permit at their next re-check (the holder's lease
/// hint, 2 s), within a bound far shorter than the mark's life.
#[test]
fn a_woken_waiter_that_crashed_does_not_strand_the_others() {
    let srv = test_server();
    let name = "crash-wake";
    let holder = lock_client!(
        node(srv.url()),
        key_prefix(PREFIX),
        lease(Duration::from_secs(2))
    );
    let held = holder.semaphore(name, 1).acquire().expect("permit");
    let mut dead = child::spawn_self("child_permit_waits", &[("REDIS_URL", srv.url())]);
    wait_for(Duration::from_secs(30), "the child marked", || {
        srv.zcard(&permit_marks(name)) == 1
    });
    child::kill_child(&mut dead, libc::SIGKILL);
    let _ = child::wait_output(dead, Duration::from_secs(10));
    let survivors: Vec<LockClient> = (0..2)
        .map(|_| {
            lock_client!(
                node(srv.url()),
                key_prefix(PREFIX),
                recheck_interval(Duration::from_secs(20))
            )
        })
        .collect();
    let waiters = PermitWaiters::start(survivors, name, 1);
    waiters.asleep(&srv, name, 3);
    let before = waiters.stats();
    drop(held);
    let first = waiters.next();
    let (_, woken_now) = woken(&before, &waiters.stats());
    eprintln!("survivor {first} holds; woken by a message: {woken_now:?}");
    assert_eq!(woken_now, vec![0, 0], "the wake-up went to the dead waiter");
    waiters.open_and_join();
}

/// A waiter that gives up after a release chose it, before it heard of it, passes the
/// wake-up on: the next waiter gets the freed permit at once, not at its re-check. The
/// server holds the release and then the leaving back, and runs them in that order.
#[test]
fn a_waiter_leaving_passes_its_wake_up_on() {
    let srv = test_server();
    let name = "leave-wake";
    let holder = PermitWaiters::start(vec![patient_client(&srv.url())], name, 1);
    holder.next();
    // The waiter waiting longest, which gives up.
    let leaving = patient_client(&srv.url());
    let cancel = redbaton::Cancel::new();
    let left = {
        let (c, cancel) = (leaving.clone(), cancel.clone());
        thread::spawn(move || c.semaphore(name, 1).acquire_cancellable(&cancel).map(drop))
    };
    wait_for(Duration::from_secs(30), "the first waiter asleep", || {
        srv.zcard(&permit_marks(name)) == 1 && leaving.stats().failed_attempts >= 2
    });
    let next = PermitWaiters::start(vec![patient_client(&srv.url())], name, 1);
    next.asleep(&srv, name, 2);
    let before = next.stats();
    let held = HeldBack::start(&srv);
    holder.open();
    held.waiting(1);
    cancel.cancel();
    held.waiting(2);
    held.resume();
    let e = left.join().unwrap().unwrap_err();
    assert!(e.is_cancelled(), "{e:?}");
    next.next();
    let (failed, woken) = woken(&before, &next.stats());
    assert_eq!((failed, woken), (0, vec![1]), "woken once, by a message");
    holder.join();
    next.open_and_join();
}
