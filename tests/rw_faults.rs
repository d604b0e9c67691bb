//! Read-write locks under faults, against a real redis-server (with child processes for
//! killed readers): a name whose last reader died is free for a plain lock once the hold
//! expired, a reader killed while it waits holds the next writer back for a grant's lease
//! at most, every reader waiting behind a writer gets in when it leaves however many
//! wait, a restart ends the reads and lets the waiting writer in with a higher token, and
//! a local reader that gives its process's hold back on a server that stopped answering
//! keeps its deadline.
//!
//! Times are liveness bounds, never speed claims.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::thread;
use std::time::{Duration, Instant};

use redbaton::LockClient;
use redbaton_testkit::child;
use redbaton_testkit::child_only;
use redbaton_testkit::wait::{join_all, wait_for, wait_until};
use redbaton_testkit::{lock_client, ms, secs, test_server, test_server_and};

const PREFIX: &str = "rf:";

/// The lease of the holds whose holder is killed: short, so that they expire soon.
const SHORT_LEASE: Duration = Duration::from_millis(500);

fn client(url: &str) -> LockClient {
    lock_client!(node(url), key_prefix(PREFIX))
}

/// A client whose waits end only by a message (or their deadline): its re-checks and its
/// holders' lease hints come long after the test.
fn patient(url: &str) -> LockClient {
    lock_client!(node(url), key_prefix(PREFIX), patient())
}

fn short_client(url: &str) -> LockClient {
    lock_client!(node(url), key_prefix(PREFIX), lease(SHORT_LEASE))
}

#[test]
fn smoke() {
    let srv = test_server();
    let c = client(&srv.url());
    let rw = c.rwlock("smoke");
    let r = rw.read().expect("read");
    assert!(c.lock("smoke").unwrap_err().is_wrong_kind());
    drop(r);
    drop(rw.write().expect("write"));
    drop(c.lock("smoke").expect("a plain lock once the holds ended"));
}

/// A child that takes a read hold with a short lease and holds it until killed.
#[test]
fn child_short_reader_holds() {
    child::hold_until_killed(|url| short_client(url).rwlock("dead").read().expect("read"));
}

/// A reader killed while it holds leaves a hold that expires; once it has, the name is
/// free for a plain lock too, not held as "another kind" by a key of expired holds.
#[test]
fn a_name_whose_last_reader_died_is_free_for_a_plain_lock() {
    let srv = test_server();
    let reader = child::spawn_holder("child_short_reader_holds", srv.url());
    child::kill_and_reap(reader);
    thread::sleep(SHORT_LEASE + ms(200));
    let c = client(&srv.url());
    let plain = c.lock("dead").expect("a plain lock on a name nobody holds");
    drop(plain);
}

/// More readers wait behind a writer than one release grants read holds to (a release
/// grants a bounded number at once): when the writer leaves, every one of them gets in,
/// side by side, none left asleep until the others are done or its re-check comes.
#[test]
fn every_waiting_reader_gets_in_when_the_writer_leaves() {
    const READERS: usize = 70;
    let srv = test_server();
    let url = srv.url();
    let w = patient(&url).rwlock("many").write().expect("write");
    let clients: Vec<LockClient> = (0..READERS).map(|_| patient(&url)).collect();
    let reading = Arc::new(AtomicUsize::new(0));
    let readers: Vec<_> = clients
        .iter()
        .map(|c| {
            let (rw, reading) = (c.rwlock("many"), reading.clone());
            thread::spawn(move || {
                let r = rw.try_read_for(secs(30)).expect("read");
                reading.fetch_add(1, SeqCst);
                // Readers share: each one reads until all are in (or the test gives up).
                wait_until(secs(10), || reading.load(SeqCst) == READERS);
                let seen = reading.load(SeqCst);
                drop(r);
                seen
            })
        })
        .collect();
    // Each asleep: it failed its first attempt and the one after its subscription.
    wait_for(secs(20), "every reader asleep", || {
        clients.iter().all(|c| c.stats().failed_attempts >= 2)
    });
    thread::sleep(ms(200));
    drop(w);
    let seen = join_all(readers, "readers");
    let fewest = seen.iter().min().copied();
    assert_eq!(
        fewest,
        Some(READERS),
        "readers in at once, as a reader saw it"
    );
}

/// A restart with no data ends every hold: the reader is told its hold is lost, and the
/// writer that waited behind it is woken by the reconnect and gets in, with a fencing
/// token above the read's (the counter starts again from the server's clock).
#[test]
fn a_restart_ends_the_reads_and_lets_the_waiting_writer_in() {
    let srv = test_server();
    let reader = lock_client!(node(srv.url()), key_prefix(PREFIX), lease(secs(3)));
    let r = reader.rwlock("restart").read().expect("read");
    let writer = patient(&srv.url());
    let rw = writer.rwlock("restart");
    let waiting = thread::spawn(move || {
        rw.try_write_for(secs(20))
            .map(|w| (w.fencing_token(), w.unlock()))
    });
    wait_for(secs(20), "the writer asleep", || {
        writer.stats().failed_attempts >= 2
    });
    srv.restart();
    let lost = r.lost().recv_timeout(secs(10));
    assert!(lost.is_ok(), "the reader is told: {lost:?}");
    assert!(r.check().is_err());
    let (token, unlocked) = waiting.join().unwrap().expect("the writer gets in");
    assert!(
        token > r.fencing_token(),
        "{token} <= {}",
        r.fencing_token()
    );
    assert_eq!(unlocked.expect("unlock"), redbaton::Unlocked::Released);
    drop(r);
    let left = srv.keys_but_fences(&format!("{PREFIX}*"));
    assert!(left.is_empty(), "only fence counters left: {left:?}");
}

/// A local reader whose budget check fails (an error counts as "someone waits"), with
/// nobody left on the process's read hold, gives that hold back before it asks Redis for
/// its own: on a server that has stopped answering, that give-back must not keep it past
/// its deadline.
#[test]
fn a_give_back_on_a_stalled_server_keeps_the_waiting_readers_deadline() {
    // A read timeout far beyond the wait: a call that sits on it is seen.
    let (srv, a) = test_server_and(|url| {
        lock_client!(
            node(url),
            key_prefix(PREFIX),
            handoff_slice(ms(50)),
            io_timeouts(secs(10))
        )
    });
    let rw = a.rwlock("stall");
    let reading = rw.read().expect("read");
    // The read hold's time slice runs out: the next local reader asks Redis first.
    thread::sleep(ms(100));
    srv.pause();
    let second = thread::spawn(move || {
        let asked = Instant::now();
        let got = rw.try_read_for(secs(2)).map(drop);
        (got, asked.elapsed())
    });
    // The first reader leaves while the check is out: the hold stays for the asker.
    thread::sleep(ms(500));
    drop(reading);
    let (got, took) = second.join().unwrap();
    srv.resume();
    eprintln!("second reader: {got:?} after {took:?}");
    assert!(took < secs(6), "a 2 s wait returned after {took:?}");
    // The hold it gave back in the background is gone once the server answers again.
    wait_for(secs(20), "the read hold given back", || {
        srv.keys_but_fences(&format!("{PREFIX}*")).is_empty()
    });
}

/// A child that waits to read behind the parent's writer, until killed.
#[test]
fn child_waiting_reader() {
    child_only!();
    let c = client(&child::env("REDIS_URL"));
    let _ = c.rwlock("ghost").read();
    thread::sleep(secs(120));
}

/// A reader killed while it waits leaves its mark (alive twice its re-check interval):
/// the writer's release grants it a read hold that nobody takes. That costs the next
/// writer the grant's short lease at most, not the mark's life, and leaves nothing behind.
#[test]
fn a_reader_killed_while_it_waits_holds_the_next_writer_back_briefly() {
    let srv = test_server();
    let w = patient(&srv.url()).rwlock("ghost").write().expect("write");
    let reader = child::spawn_self("child_waiting_reader", &[("REDIS_URL", srv.url())]);
    wait_for(secs(20), "the reader marked waiting", || {
        srv.zcard(&format!("{PREFIX}{{ghost}}:wr")) == 1
    });
    child::kill_and_reap(reader);
    drop(w);
    let next = patient(&srv.url()).rwlock("ghost");
    let asked = Instant::now();
    let w = next
        .try_write_for(secs(20))
        .expect("the next writer gets in");
    let waited = asked.elapsed();
    eprintln!("the next writer waited {waited:?}");
    assert!(waited < secs(4), "held back {waited:?} by a dead reader");
    drop(w);
    let left = srv.keys_but_fences(&format!("{PREFIX}*"));
    assert!(left.is_empty(), "only fence counters left: {left:?}");
}
