//! A waiter asleep on one node's events reads that node's subscriber connection itself
//! (`wake::seat`): the event that ends its wait wakes it directly, not the subscriber
//! thread first. The connection goes from the thread to the waiters and back without a
//! lost event: other waiters of the process are woken by what a reading waiter reads, the
//! thread reads again once no waiter does, and a read that fails or panics, or a waiter
//! that leaves, hands it on, and so does a waiter held up in an attempt.
//!
//! Waiters here must be woken by events: the re-check ceiling is a minute, and every wait
//! is bounded well below it. Another process is played by a second client.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::thread;
use std::time::{Duration, Instant};

use redbaton::fault::{self, Point};
use redbaton::{Cancel, LockClient, LockGuard, Stats};
use redbaton_testkit::keys::Keys;
use redbaton_testkit::server::RedisServer;
use redbaton_testkit::wait::wait_for;
use redbaton_testkit::{init_log, lock_client, secs};

/// Long enough for any waiter to have gone to sleep and been handed the connection (the
/// thread hands it over within its 5 ms poll), short beside the bounds below.
const SETTLED: Duration = Duration::from_millis(300);
/// What a wait woken by an event takes at most, however loaded the machine.
const WOKEN: Duration = Duration::from_secs(10);

fn client(srv: &RedisServer, prefix: &str) -> LockClient {
    lock_client!(
        node(srv.url()),
        key_prefix(prefix),
        recheck_interval(secs(60))
    )
}

/// What a waiting thread sends once it returns: its client's stats, taken with the lock.
type Waiting = crossbeam_channel::Receiver<redbaton::Result<Stats>>;

/// A thread of `c` waiting for `name` (up to `WOKEN`), which must be held elsewhere; it
/// sends the client's stats once it has the lock, then unlocks.
fn waiter(c: &LockClient, name: &str) -> Waiting {
    let (tx, rx) = crossbeam_channel::bounded(1);
    let (c, name) = (c.clone(), name.to_owned());
    thread::spawn(move || {
        let got = c.try_lock_for(&name, WOKEN).and_then(|g| {
            let s = c.stats();
            g.unlock().map(|_| s)
        });
        let _ = tx.send(got);
    });
    rx
}

/// Waits for `waiter`'s outcome: it got the lock, woken by an event.
fn got(waiter: &Waiting, what: &str) -> Stats {
    let s = waiter
        .recv_timeout(WOKEN + secs(5))
        .unwrap_or_else(|_| panic!("{what}: the waiter did not return"))
        .unwrap_or_else(|e| panic!("{what}: {e:?}"));
    assert_eq!(s.wakeups_recheck + s.wakeups_lease, 0, "{what}: {s:?}");
    s
}

/// A server and two clients of it with `prefix`: a holder, and the process under test.
fn start(prefix: &str) -> (RedisServer, LockClient, LockClient) {
    init_log();
    let srv = RedisServer::start();
    let (holder, other) = (client(&srv, prefix), client(&srv, prefix));
    (srv, holder, other)
}

/// Waits until every subscriber of `c` has reconnected and is up.
fn reconnected(c: &LockClient) {
    wait_for(secs(10), "the subscriber's reconnect", || {
        c.subscribers()
            .iter()
            .all(|s| s.reconnects >= 1 && s.connected)
    });
}

/// Waits until `c` has made `n` failed attempts in all: its waiters are asleep after them.
fn failed(c: &LockClient, n: u64) {
    wait_for(secs(10), "the waiters' failed attempts", || {
        c.stats().failed_attempts >= n
    });
    thread::sleep(SETTLED);
}

/// `holder` takes the lock `k`, and a waiter of `other` sleeps on it, after its attempt
/// before it subscribed and its attempt once subscribed.
fn held_and_awaited(holder: &LockClient, other: &LockClient) -> (LockGuard, Waiting) {
    let g = holder.lock("k").unwrap();
    let w = waiter(other, "k");
    failed(other, 2);
    (g, w)
}

#[test]
fn smoke() {
    let (_srv, holder, other) = start("wr-smoke:");
    let (g, w) = held_and_awaited(&holder, &other);
    g.unlock().unwrap();
    let s = got(&w, "k");
    assert_eq!(s.waiter_reads, 1, "the grant was read by the waiter: {s:?}");
    assert_eq!(s.grants_trusted, 1, "{s:?}");
}

/// Three waiters of one process on three names: one reads the connection, and the others
/// are woken by what it reads, or read it in turn once it is done.
#[test]
fn a_reading_waiter_wakes_the_others() {
    let (_srv, holder, other) = start("wr-others:");
    let names = ["a", "b", "c"];
    let held: Vec<_> = names.iter().map(|n| holder.lock(n).unwrap()).collect();
    let waiters: Vec<_> = names.iter().map(|n| waiter(&other, n)).collect();
    failed(&other, 6);
    // The last to stand is the last to read: release it first.
    for ((g, w), name) in held.into_iter().zip(&waiters).zip(names).rev() {
        g.unlock().unwrap();
        got(w, name);
    }
    let s = other.stats();
    assert_eq!(s.wakeups_event, 3, "{s:?}");
    assert!(s.waiter_reads >= 1, "{s:?}");
}

/// The waiter whose turn it is to read is held up in an attempt (a slow server, a `WAIT`
/// for replicas, a migrating slot) with the connection parked in the seat: the thread
/// takes the turn back and reads on, so a release that another waiter of the process
/// waits for still wakes it, without waiting for the held-up attempt to end.
#[test]
fn a_reader_held_up_in_an_attempt_gives_up_its_turn() {
    const P: &str = "wr-held-up:";
    let (srv, holder, other) = start(P);
    // The first waiter stands first: its turn to read.
    let (first_held, first) = held_and_awaited(&holder, &other);
    // Held for a minute: only an event wakes its waiter within the bounds here.
    let patient = lock_client!(node(srv.url()), key_prefix(P), patient());
    let second_held = patient.lock("b").unwrap();
    let second = waiter(&other, "b");
    failed(&other, 4);
    fault::stall(P, Point::Contend);
    // `k` freed and taken at once by another owner: the first waiter reads the event,
    // tries, finds it held, and stops before its next wait, its turn kept.
    let key = Keys::new(P).lock("k");
    srv.bounce(&key);
    wait_for(
        secs(10),
        "the first waiter held up after its attempt",
        || fault::stalled(P, Point::Contend),
    );
    second_held.unlock().unwrap();
    // Within half its wait: at its end, a last attempt would find the lock free anyway.
    let woken = second.recv_timeout(WOKEN / 2);
    fault::disarm(P, Point::Contend);
    woken
        .expect("the second waiter was woken while the first was held up")
        .expect("the second waiter's lock");
    drop(first_held);
    let () = redis::cmd("DEL").arg(&key).query(&mut srv.conn()).unwrap();
    got(&first, "k");
}

/// A waiter reading the connection hears that another waiter's name was freed, and sends
/// that waiter's early attempt, to a server that then stalls (its writes paused): the
/// reader still returns by its own deadline, not when the stalled attempt is answered.
#[test]
fn a_reader_sending_anothers_early_attempt_keeps_its_own_deadline() {
    const P: &str = "wr-fires:";
    let srv = RedisServer::start();
    // A call to the stalled server waits out the read timeout.
    let other = lock_client!(
        node(srv.url()),
        key_prefix(P),
        patient(),
        io_timeouts(secs(8))
    );
    for name in ["one", "two"] {
        srv.bounce(&Keys::new(P).lock(name));
    }
    let reader = other.clone();
    let asked = Instant::now();
    let first = thread::spawn(move || {
        (
            reader.try_lock_for("one", secs(2)).map(drop),
            asked.elapsed(),
        )
    });
    failed(&other, 2);
    let second = other.clone();
    thread::spawn(move || second.lock("two").map(drop));
    failed(&other, 4);
    let () = redis::pipe()
        .cmd("DEL")
        .arg(Keys::new(P).lock("two"))
        .cmd("CLIENT")
        .arg("PAUSE")
        .arg(4_000)
        .arg("WRITE")
        .query(&mut srv.conn())
        .unwrap();
    let (got, took) = first.join().expect("the reader");
    assert!(got.is_err_and(|e| e.is_timeout()));
    assert!(took < secs(3), "a wait of 2 s took {took:?}");
}

/// After a waiter read the connection and its wait ended, the thread reads it again: a
/// waiter that does not read it itself (a multi-lock's, which watches two names) is woken
/// by the release it hears.
#[test]
fn the_thread_reads_again_after_the_waiters() {
    let (_srv, holder, other) = start("wr-back:");
    let (g, w) = held_and_awaited(&holder, &other);
    g.unlock().unwrap();
    assert_eq!(got(&w, "k").waiter_reads, 1);

    let both = holder.multi_lock(["m1", "m2"]).unwrap();
    // Read before the thread starts: its first attempts may fail before this thread runs
    // again, and the count would then wait for attempts that never come.
    let before = other.stats().failed_attempts;
    let (tx, rx) = crossbeam_channel::bounded(1);
    let c = other.clone();
    thread::spawn(move || {
        let got = c.try_multi_lock_for(["m1", "m2"], WOKEN).map(drop);
        let _ = tx.send((got, c.stats()));
    });
    failed(&other, before + 2);
    both.unlock().unwrap();
    let (result, s) = rx.recv_timeout(WOKEN + secs(5)).expect("returns");
    result.expect("the multi-lock, woken by the release");
    assert_eq!(s.wakeups_recheck + s.wakeups_lease, 0, "{s:?}");
    assert_eq!(
        s.waiter_reads, 1,
        "the multi-lock's wait read nothing: {s:?}"
    );
}

/// The subscriber connection is killed while a waiter reads it: the thread reconnects,
/// the waiter retries once and sleeps again, and the release wakes it.
#[test]
fn a_connection_killed_while_a_waiter_reads_it() {
    let (srv, holder, other) = start("wr-kill:");
    let (g, w) = held_and_awaited(&holder, &other);
    assert!(
        srv.kill_pubsub() >= 1,
        "the subscriber connections were killed"
    );
    reconnected(&other);
    failed(&other, 3); // its retry after the reconnect
    g.unlock().unwrap();
    let s = got(&w, "k");
    assert!(s.wakeups_reconnect >= 1, "{s:?}");
}

/// A waiter whose turn it is to read is cancelled: it returns at once, and the waiter
/// after it is woken by the release.
#[test]
fn a_cancelled_reader_hands_the_connection_on() {
    let (_srv, holder, other) = start("wr-cancel:");
    let (g1, g2) = (holder.lock("k1").unwrap(), holder.lock("k2").unwrap());
    let cancel = Cancel::new();
    let (tx, cancelled) = crossbeam_channel::bounded(1);
    let (c, cc) = (other.clone(), cancel.clone());
    thread::spawn(move || {
        let _ = tx.send(c.lock_cancellable("k1", &cc).map(drop));
    });
    failed(&other, 2); // the first to stand: it reads
    let w2 = waiter(&other, "k2");
    failed(&other, 4);
    let t = Instant::now();
    cancel.cancel();
    let r = cancelled
        .recv_timeout(secs(5))
        .expect("the cancelled wait returns");
    assert!(r.is_err_and(|e| e.is_cancelled()));
    eprintln!("cancelled in {:?}", t.elapsed());
    g2.unlock().unwrap();
    got(&w2, "k2");
    drop(g1);
}

/// A waiter's read panics (an injected fault): its call panics, the connection is
/// reconnected, and the next waiter of the process is woken by events.
#[test]
fn a_panic_in_a_waiters_read_is_survived() {
    const P: &str = "wr-panic:";
    let (_srv, holder, other) = start(P);
    let g = holder.lock("k").unwrap();
    fault::arm(P, Point::WaiterRead, 1);
    let c = other.clone();
    let panicked = thread::spawn(move || {
        catch_unwind(AssertUnwindSafe(|| c.try_lock_for("k", WOKEN).map(drop))).is_err()
    })
    .join()
    .unwrap();
    fault::disarm(P, Point::WaiterRead);
    assert!(panicked, "the injected fault fired");
    let before = other.stats().failed_attempts;
    let w = waiter(&other, "k");
    // The thread reconnects once a waiter wants the connection: at once if the panicked
    // waiter had not yet left when the thread took its error, else for this one.
    reconnected(&other);
    // Then this waiter sleeps after one failed attempt or more: the subscription to "k"
    // may linger from the waiter that panicked (a waiter that finds its key subscribed
    // watches before its first attempt, which is then the one it waits on), and a
    // reconnect makes every waiter retry once.
    failed(&other, before + 1);
    g.unlock().unwrap();
    got(&w, "k");
}

/// The subscriber thread panics while a waiter has its connection in hand, and the
/// restarted thread cannot connect at once (the server takes no new client): the thread
/// takes its connection back from the waiter before it forgets the subscriptions, so the
/// waiter cannot subscribe again on the dead thread's connection, and the release after
/// the thread is back wakes it.
#[test]
fn a_subscriber_panic_while_a_waiter_reads_is_survived() {
    const P: &str = "wr-crash:";
    let (srv, holder, other) = start(P);
    let (g, w) = held_and_awaited(&holder, &other);
    let before = srv.subscribers();
    fault::stall(P, Point::WaiterRead);
    wait_for(
        secs(10),
        "the waiter stopped, the connection in hand",
        || fault::stalled(P, Point::WaiterRead),
    );
    // No new client: every connection now, the harness's own (not listed) included.
    let clients = srv.client_list().len() + 1;
    srv.config_set("maxclients", &clients.to_string());
    fault::arm(P, Point::Subscriber, 1);
    thread::sleep(SETTLED); // the thread panics at its next look, and cannot connect again
    fault::disarm(P, Point::Subscriber);
    fault::disarm(P, Point::WaiterRead);
    thread::sleep(SETTLED); // the waiter reads on
    srv.config_set("maxclients", "10000");
    wait_for(secs(10), "the restarted thread's subscription", || {
        srv.subscribers().iter().any(|id| !before.contains(id))
    });
    thread::sleep(SETTLED);
    g.unlock().unwrap();
    got(&w, "k");
}
