//! Read-write locks and semaphores at their edges: what a no-wait attempt says when the
//! server does not answer, a permit's key that must not outlive its grant, a stale permit
//! mark that is no writer, an upgradable read lost to an unanswered upgrade that writers
//! do not wait for, and a permit-seeker's place kept across a wake-up for nothing.

use std::time::Duration;

use redbaton::{Cancel, LockClient, ReadGuard, RwLock};
use redbaton_testkit::keys::Keys;
use redbaton_testkit::proxy::Proxy;
use redbaton_testkit::server::RedisServer;
use redbaton_testkit::wait::wait_for;
use redbaton_testkit::{lock_client, ms, pttl, secs, test_server};

const PREFIX: &str = "she:";
const KEYS: Keys = Keys::new(PREFIX);

/// The server's clock, in milliseconds (the scores of holds and waiting marks).
fn server_ms(conn: &mut redis::Connection) -> u64 {
    let (s, us): (u64, u64) = redis::cmd("TIME").query(conn).expect("TIME");
    s * 1000 + us / 1000
}

/// Marks `member` waiting for `name` (writers' or permit-seekers' set) for a minute, as a
/// waiter does that then goes silent: it never takes what it is granted.
fn silent_waiter(srv: &RedisServer, name: &str, member: &str) {
    let mut conn = srv.conn();
    let until = server_ms(&mut conn) + 60_000;
    let () = redis::cmd("ZADD")
        .arg(format!("{}:ww", KEYS.lock(name)))
        .arg(until)
        .arg(member)
        .query(&mut conn)
        .expect("ZADD a waiting mark");
}

/// A client of `url` whose reads give up after `io`: a long lease (a hold never ends by
/// itself in a test), and a short time slice for the process's own turns on a hold, after
/// which the next local turn asks Redis whether another process waits.
fn client(url: &str, io: Duration) -> LockClient {
    lock_client!(
        node(url),
        key_prefix(PREFIX),
        lease(secs(30)),
        io_timeouts(io),
        handoff_slice(ms(50))
    )
}

/// A read of `rw` by this thread, and a no-wait read by another thread beside it once the
/// hold's time slice ran out (that turn asks Redis first whether another process waits)
/// and `meanwhile` ran.
fn read_beside(rw: &RwLock, meanwhile: impl FnOnce()) -> (ReadGuard, redbaton::Result<()>) {
    let reading = rw.read().expect("read");
    std::thread::sleep(ms(100));
    meanwhile();
    let beside = std::thread::scope(|s| s.spawn(|| rw.try_read().map(drop)).join());
    (reading, beside.expect("reader"))
}

#[test]
fn smoke() {
    let srv = test_server();
    let c = client(&srv.url(), ms(2_000));
    let r = c.rwlock("smoke").try_read().expect("read");
    let p = c.semaphore("smoke-sem", 1).try_acquire().expect("permit");
    drop((r, p));
}

/// Whether `e` says what a plain lock's `try_lock` said (`plain`) on the same stalled
/// server: never that the name is held, since nobody answered.
fn answers_like(what: &str, e: &redbaton::Error, plain: &redbaton::Error) {
    assert!(
        !e.is_would_block(),
        "{what} on a stalled server: {e:?}, a plain lock: {plain:?}"
    );
    let says = |e: &redbaton::Error| (e.is_timeout(), e.is_connection());
    assert_eq!(
        says(e),
        says(plain),
        "{what}: {e:?}, a plain lock: {plain:?}"
    );
}

/// Every shared hold's no-wait attempt on a server that does not answer says so, as a
/// plain lock's does.
#[test]
fn a_no_wait_attempt_on_a_stalled_server_says_what_happened() {
    let srv = test_server();
    let c = client(&srv.url(), ms(300));
    srv.pause();
    let plain = c.try_lock("stalled-plain").map(drop);
    let read = c.rwlock("stalled").try_read().map(drop);
    let write = c.rwlock("stalled-w").try_write().map(drop);
    let upgradable = c.rwlock("stalled-u").try_upgradable_read().map(drop);
    let permit = c.semaphore("stalled-sem", 2).try_acquire().map(drop);
    srv.resume();
    let plain = plain.expect_err("a plain lock on a stalled server");
    for (what, got) in [
        ("read", read),
        ("write", write),
        ("upgradable", upgradable),
        ("permit", permit),
    ] {
        answers_like(what, &got.expect_err(what), &plain);
    }
}

/// A no-wait read beside the process's own read hold, whose budget check finds the server
/// stalled, says what happened (as a plain lock's `try_lock` would there), not
/// `WouldBlock`: nobody said the name is held.
#[test]
fn a_no_wait_read_beside_a_local_read_on_a_stalled_server_says_what_happened() {
    let srv = test_server();
    let c = client(&srv.url(), ms(300));
    let (reading, second) = read_beside(&c.rwlock("beside"), || srv.pause());
    let plain = c.try_lock("beside-plain").map(drop);
    srv.resume();
    let plain = plain.expect_err("a plain lock on a stalled server");
    answers_like("a read beside ours", &second.expect_err("a read"), &plain);
    drop(reading);
}

/// A permit granted to a waiter that never takes it (cut off) is held for the grant lease
/// only, and the key goes with it: it does not keep the released permit's lease, during
/// which a plain lock of the name would be refused as another kind.
#[test]
fn a_permit_granted_to_a_silent_waiter_keeps_the_key_no_longer_than_the_grant() {
    let srv = test_server();
    let c = client(&srv.url(), secs(2));
    let permit = c.semaphore("cut", 1).acquire().expect("permit");
    silent_waiter(&srv, "cut", "psilent");
    permit.unlock().expect("unlock");
    let mut conn = srv.conn();
    let left = pttl(&mut conn, KEYS.lock("cut"));
    // The grant lease is the releasing client's lease, one second at most.
    assert!(
        (1..=1_000).contains(&left),
        "the key granted to a silent waiter lives {left} ms"
    );
    wait_for(
        secs(5),
        "the plain lock of the name once the grant lapsed",
        || c.try_lock("cut").is_ok(),
    );
}

/// A permit-seeker's mark left from when the name was a semaphore (its waiter gone, the
/// mark alive until its TTL) is no writer waiting: a process holding a read hold keeps
/// letting its own readers in at its budget checks, as with no mark.
#[test]
fn a_stale_permit_mark_does_not_end_a_read_phase() {
    let srv = test_server();
    let c = client(&srv.url(), secs(2));
    let (reading, beside) = read_beside(&c.rwlock("stale"), || {
        silent_waiter(&srv, "stale", "pgone");
    });
    assert!(
        beside.is_ok(),
        "a reader beside ours, with a stale permit mark left: {beside:?}"
    );
    drop(reading);
}

/// An upgrade whose request never reached the server (its outcome unknown to the client)
/// leaves the upgradable read's guard lost: the library gives that read back, so that a
/// writer does not wait for the guard's drop or the read's lease, while the guard is kept.
#[test]
fn an_upgradable_read_lost_to_an_unanswered_upgrade_lets_writers_in() {
    let srv = test_server();
    let proxy = Proxy::start(srv.addr());
    let c = client(&proxy.url(), secs(2));
    let u = c
        .rwlock("unsent")
        .upgradable_read()
        .expect("upgradable read");
    let refused = proxy
        .refusing_requests_matching(b"{unsent}", || u.try_upgrade())
        .expect_err("the upgrade never reached the server");
    let guard = refused.into_guard();
    let check = guard.check();
    assert!(matches!(check, Err(ref e) if e.is_lost()), "{check:?}");
    let other = client(&srv.url(), secs(2));
    let w = other.rwlock("unsent").try_write_for(secs(5));
    assert!(
        w.is_ok(),
        "a writer behind a lost upgradable read whose guard is kept: {w:?}"
    );
    drop((w, guard));
}

/// A permit-seeker woken with no permit free (made here by hand: two more permits held in
/// a semaphore of two, so that a release frees none) whose attempt then fails keeps its
/// place: it is not put behind a waiter that began to wait after it.
#[test]
fn a_permit_seeker_woken_for_nothing_keeps_its_place() {
    let srv = test_server();
    let h = client(&srv.url(), secs(2));
    let ours = h.semaphore("place", 2).acquire().expect("permit");
    let (mut conn, lock) = (srv.conn(), KEYS.lock("place"));
    let marks = format!("{lock}:ww");
    let later = server_ms(&mut conn) + 60_000;
    let () = redis::cmd("ZADD")
        .arg(&lock)
        .arg(later)
        .arg("pheld1")
        .arg(later)
        .arg("pheld2")
        .query(&mut conn)
        .expect("ZADD the holds");
    let waiter = lock_client!(node(srv.url()), key_prefix(PREFIX), patient());
    let cancel = Cancel::new();
    std::thread::scope(|s| {
        let waiting = s.spawn(|| {
            waiter
                .semaphore("place", 2)
                .acquire_cancellable(&cancel)
                .map(drop)
        });
        wait_for(secs(10), "the waiter asleep", || {
            srv.zcard(&marks) == 1 && waiter.stats().failed_attempts >= 2
        });
        let first: Vec<(String, u64)> = redis::cmd("ZRANGE")
            .arg(&marks)
            .arg(0)
            .arg(0)
            .arg("WITHSCORES")
            .query(&mut conn)
            .expect("ZRANGE");
        let (member, place) = first[0].clone();
        // Another waiter begins to wait just after it (a mark expiring just after its).
        let () = redis::cmd("ZADD")
            .arg(&marks)
            .arg(place + 1)
            .arg("pafter")
            .query(&mut conn)
            .expect("ZADD a later mark");
        // Its release frees no permit: it wakes the waiter waiting longest.
        ours.unlock().expect("unlock");
        wait_for(secs(10), "the woken waiter's attempt", || {
            waiter.stats().failed_attempts >= 3 && srv.zcard(&marks) == 2
        });
        let now_first: Vec<String> = redis::cmd("ZRANGE")
            .arg(&marks)
            .arg(0)
            .arg(0)
            .query(&mut conn)
            .expect("ZRANGE");
        cancel.cancel();
        assert!(waiting.join().expect("waiter").unwrap_err().is_cancelled());
        assert_eq!(
            now_first,
            [member],
            "the first waiter after a wake-up for nothing"
        );
    });
}
