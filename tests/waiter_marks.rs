//! The waiting marks of read-write locks and semaphores after a command whose outcome was
//! unknown: an attempt whose reply was lost and which was sent again, a leave sent twice,
//! a leave that failed. A release grants or wakes the waiter whose mark is the oldest, so
//! a mark left by a waiter that holds or has gone would send the next hold to nobody.
//!
//! Real `redis-server`, the fault-injecting proxy; two clients of this process act as two
//! processes (each has its own client id and subscriber).

use std::sync::mpsc;
use std::thread;
use std::time::Duration;

use redbaton::{Cancel, LockClient};
use redbaton_testkit::keys::Keys;
use redbaton_testkit::proxy::Proxy;
use redbaton_testkit::server::RedisServer;
use redbaton_testkit::wait::{wait_for, wait_until};
use redbaton_testkit::{lock_client, ms, secs, test_server, test_server_and};

const PREFIX: &str = "wm:";
const KEYS: Keys = Keys::new(PREFIX);

fn lock_key(name: &str) -> String {
    KEYS.lock(name)
}

/// The waiting writers' (and a semaphore's waiting permit-seekers') marks of `name`.
fn writer_marks(name: &str) -> String {
    format!("{}:ww", KEYS.lock(name))
}

fn zrange(srv: &RedisServer, key: &str) -> Vec<String> {
    redis::cmd("ZRANGE")
        .arg(key)
        .arg(0)
        .arg(-1)
        .arg("WITHSCORES")
        .query(&mut srv.conn())
        .expect("ZRANGE")
}

/// A client whose waits end only by a message (its re-checks and its holders' lease hints
/// come long after the test).
fn patient(url: &str) -> LockClient {
    lock_client!(node(url), key_prefix(PREFIX), patient())
}

/// A writer that waited, marked, and won leaves no mark behind.
#[test]
fn smoke() {
    let srv = test_server();
    let (a, b) = (patient(&srv.url()), patient(&srv.url()));
    let name = "smoke";
    let held = a.rwlock(name).write().expect("write hold");
    thread::scope(|s| {
        let waiting = s.spawn(|| b.rwlock(name).write().map(drop));
        wait_for(secs(30), "the writer marked", || {
            srv.zcard(&writer_marks(name)) == 1
        });
        drop(held);
        waiting.join().unwrap().expect("the waiting writer's turn");
    });
    assert_eq!(
        srv.zcard(&writer_marks(name)),
        0,
        "a mark outlived its wait"
    );
}

/// A wait's first attempt runs, fails and marks the writer waiting, and its reply is lost
/// (a read timeout); the node sends it again, and that retry wins the write hold (the
/// holder went meanwhile). The retry takes the mark out: when the writer releases, no
/// hold is granted to it again (its own mark the oldest), and the next writer gets the
/// lock at once.
#[test]
fn a_write_hold_won_by_the_retry_of_a_first_attempt_leaves_no_mark_behind() {
    let name = "retry-write";
    won_by_a_retry(name, &writer_marks(name), |c| {
        c.rwlock(name).try_write_for(secs(20)).map(drop)
    });
}

/// The same for a read hold won by the retry of a wait's first attempt: the reader's own
/// mark goes, so that the release of that last hold grants no read hold back to it, and a
/// writer takes the lock at once.
#[test]
fn a_read_hold_won_by_the_retry_of_a_first_attempt_leaves_no_mark_behind() {
    let name = "retry-read";
    let readers = format!("{}:wr", KEYS.lock(name));
    won_by_a_retry(name, &readers, |c| {
        c.rwlock(name).try_read_for(secs(20)).map(drop)
    });
}

/// `hold_and_release` waits on a client behind a proxy while another client holds the
/// write hold of `name`: its first attempt marks it in `marks`, and its reply comes after
/// the client's read timeout, so the node sends it again, after the holder went (deleted,
/// as a force-release or an expiry does). Checks that the hold won leaves no mark, and that
/// after its release the lock is free for the next writer.
fn won_by_a_retry(
    name: &str,
    marks: &str,
    hold_and_release: impl FnOnce(&LockClient) -> redbaton::Result<()> + Send,
) {
    let srv = test_server();
    let proxy = Proxy::start(srv.addr());
    let c = lock_client!(
        node(proxy.url()),
        key_prefix(PREFIX),
        lease(secs(30)),
        io_timeouts(ms(1000))
    );
    // Connections open and the channel mode known before the proxy turns slow.
    drop(c.rwlock("warm-up").write().expect("warm up"));
    let holder = patient(&srv.url());
    let held = holder
        .rwlock(name)
        .write()
        .expect("the holder's write hold");
    proxy.set_delay(secs(4));
    let won = thread::scope(|s| {
        let waiting = s.spawn(|| hold_and_release(&c));
        // The first attempt ran: it failed and marked the waiter.
        wait_for(secs(20), "the first attempt's mark", || {
            srv.zcard(marks) == 1
        });
        // Its reply is on its way (delayed); the retry, a moment later, is not.
        thread::sleep(ms(300));
        proxy.set_delay(Duration::ZERO);
        let () = redis::cmd("DEL")
            .arg(lock_key(name))
            .query(&mut srv.conn())
            .unwrap();
        waiting.join().unwrap()
    });
    won.expect("the retry wins the hold");
    assert_eq!(srv.zcard(marks), 0, "the holder's own mark was left");
    let taken = patient(&srv.url()).rwlock(name).try_write().map(drop);
    assert!(
        taken.is_ok(),
        "the lock is free after the only holder released it, yet: {taken:?} (holds: {:?})",
        zrange(&srv, &lock_key(name))
    );
    drop(held);
}

/// A permit-seeker gives up and its leave's reply is lost after the script ran; the node
/// sends it again. The second run finds the mark gone, as after a release took it to wake
/// this waiter, but its nonce gone too (the first run took both): it passes no wake-up on,
/// so the next waiter keeps its place, and the permit freed next goes to the waiter
/// waiting longest.
#[test]
fn a_permit_seekers_leave_sent_twice_keeps_the_next_waiters_place() {
    let name = "leave-twice";
    let (srv, holder) = test_server_and(patient);
    let proxy = Proxy::start(srv.addr());
    // `WAITER_LEAVE` loaded in the server's script cache: the lost reply below is the
    // script's, not a `NOSCRIPT`'s.
    let warm = holder
        .semaphore("warm-up", 1)
        .acquire()
        .expect("warm-up permit");
    let e = patient(&srv.url())
        .semaphore("warm-up", 1)
        .try_acquire_for(ms(300))
        .expect_err("held");
    assert!(e.is_timeout(), "{e:?}");
    drop(warm);
    let held = holder
        .semaphore(name, 1)
        .acquire()
        .expect("the only permit");
    // The waiter waiting longest, through the proxy, which gives up.
    let cancel = Cancel::new();
    let left = seeker_asleep(&srv, name, &patient(&proxy.url()), &cancel);
    let (tx, got) = mpsc::channel();
    let mut waiters = Vec::new();
    let mut threads = Vec::new();
    for i in 2..=3 {
        thread::sleep(ms(50));
        let c = patient(&srv.url());
        let tx = tx.clone();
        let c2 = c.clone();
        threads.push(thread::spawn(move || {
            let p = c2
                .semaphore(name, 1)
                .try_acquire_for(secs(120))
                .expect("a permit in turn");
            tx.send(i).unwrap();
            drop(p);
        }));
        wait_for(secs(30), "the waiter asleep", || {
            srv.zcard(&writer_marks(name)) == i && c.stats().failed_attempts >= 2
        });
        waiters.push(c);
    }
    eprintln!("marks: {:?}", zrange(&srv, &writer_marks(name)));
    let before = waiters[0].stats().failed_attempts;
    proxy.drop_next_reply_matching(b"EVALSHA");
    cancel.cancel();
    let e = left.join().unwrap().unwrap_err();
    assert!(e.is_cancelled(), "{e:?}");
    assert_eq!(proxy.replies_dropped(), 1, "the leave's reply was lost");
    // A wake-up, if one was sent, is heard and tried within this.
    let woken = wait_until(secs(2), || waiters[0].stats().failed_attempts > before);
    eprintln!(
        "waiter 2 woken and tried again: {woken}; marks: {:?}",
        zrange(&srv, &writer_marks(name))
    );
    drop(held);
    let first = got.recv_timeout(secs(30)).expect("a waiter got the permit");
    assert_eq!(
        first, 2,
        "the permit went to waiter {first}, not to waiter 2, waiting longest (woken by the \
         leave's second run: {woken})"
    );
    for t in threads {
        t.join().unwrap();
    }
}

/// A permit-seeker gives up while cut off from Redis: its leave fails. The cleanup job
/// leaves for it once the node answers again (its mark and nonce out), so the release that
/// follows grants the freed permit to the waiter still waiting, not to the one that has
/// gone (whose grant would expire unheard, leaving the waiter to its re-check). The
/// partition heals three seconds before the release: time for the background work.
#[test]
fn a_permit_seeker_whose_leave_failed_does_not_strand_the_next_permit() {
    let name = "leave-failed";
    let (srv, holder) = test_server_and(patient);
    let held = holder
        .semaphore(name, 1)
        .acquire()
        .expect("the only permit");
    let proxy = Proxy::start(srv.addr());
    let leaving = lock_client!(
        node(proxy.url()),
        key_prefix(PREFIX),
        lease(secs(60)),
        recheck_interval(secs(60)),
        io_timeouts(ms(300))
    );
    let cancel = Cancel::new();
    let left = seeker_asleep(&srv, name, &leaving, &cancel);
    thread::sleep(ms(50));
    let next = patient(&srv.url());
    let (tx, got) = mpsc::channel();
    let waiter = {
        let c = next.clone();
        thread::spawn(move || {
            let p = c.semaphore(name, 1).try_acquire_for(secs(120));
            let _ = tx.send(p.is_ok());
        })
    };
    wait_for(secs(30), "the next waiter asleep", || {
        srv.zcard(&writer_marks(name)) == 2 && next.stats().failed_attempts >= 2
    });
    // The leaving waiter is cut off from Redis as it gives up.
    proxy.blackhole(true);
    cancel.cancel();
    let e = left.join().unwrap().unwrap_err();
    assert!(e.is_cancelled(), "{e:?}");
    // The partition heals: whatever the client left to do in the background may run.
    proxy.heal();
    thread::sleep(secs(3));
    eprintln!(
        "marks after the leave: {:?}",
        zrange(&srv, &writer_marks(name))
    );
    // The holder lets its permit go: the waiter still waiting should have it.
    drop(held);
    eprintln!(
        "holds after the release: {:?}",
        zrange(&srv, &lock_key(name))
    );
    let got = got.recv_timeout(secs(10));
    assert!(
        matches!(got, Ok(true)),
        "the waiter did not get the freed permit within 10 s ({got:?}): it went to the \
         departed waiter's member"
    );
    waiter.join().unwrap();
}

/// A permit-seeker of `c` for the semaphore `name` (of one permit, held), waiting until
/// `cancel`, once it is asleep: marked, after two attempts.
fn seeker_asleep(
    srv: &RedisServer,
    name: &'static str,
    c: &LockClient,
    cancel: &Cancel,
) -> thread::JoinHandle<redbaton::Result<()>> {
    let left = {
        let (c, cancel) = (c.clone(), cancel.clone());
        thread::spawn(move || c.semaphore(name, 1).acquire_cancellable(&cancel).map(drop))
    };
    wait_for(secs(30), "the leaving waiter asleep", || {
        srv.zcard(&writer_marks(name)) == 1 && c.stats().failed_attempts >= 2
    });
    left
}
