//! Guards that move, against a real redis-server: a detached lock or write hold keeps its
//! token, lease and lost signal, may be checked, extended and released from another
//! thread, and is never handed to a local thread: the process's waiters for the name wait
//! in Redis and get it, with a higher fencing token, only once it is released there.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::thread;
use std::time::Duration;

use redbaton::{Builder, Error, LockClient, LockGuard, LostReason, ReadGuard, Unlocked};
use redbaton_testkit::keys::{Keys, fence_of, handoff_of};
use redbaton_testkit::server::RedisServer;
use redbaton_testkit::wait::join_within;
use redbaton_testkit::{exists, lock_builder, ms, pttl, test_server, test_server_and};

const PREFIX: &str = "dt:";
const KEYS: Keys = Keys::new(PREFIX);
const JOIN: Duration = Duration::from_secs(20);

fn builder(url: &str) -> Builder {
    lock_builder!(node(url), key_prefix(PREFIX))
}

fn client(url: &str) -> LockClient {
    builder(url).build().expect("client")
}

/// A server, a client of it, and that client's guard of `name`.
fn locked(name: &str) -> (RedisServer, LockClient, LockGuard) {
    let (srv, c) = test_server_and(client);
    let guard = c.lock(name).expect("lock");
    (srv, c, guard)
}

/// Runs `f` on another thread and returns what it returned (the guard moves there).
fn elsewhere<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    join_within(vec![thread::spawn(f)], JOIN, "the other thread")
        .pop()
        .expect("one result")
}

/// Waits long enough for a thread just started to be waiting for a lock. The tests pass
/// either way; this only makes it likely that the waiter queued locally before the detach.
fn let_it_queue() {
    thread::sleep(ms(200));
}

/// A thread of the client waiting for a name that is detached meanwhile, and the flag set
/// just before the detached guard is released.
struct Waiter {
    handle: thread::JoinHandle<(u64, bool)>,
    released: Arc<AtomicBool>,
}

impl Waiter {
    /// Starts a thread that takes the name with `take`, notes the guard's `token` and
    /// whether the release had begun when it got it, and lets go.
    fn start<G: 'static>(
        take: impl FnOnce() -> G + Send + 'static,
        token: fn(&G) -> u64,
    ) -> Waiter {
        let released = Arc::new(AtomicBool::new(false));
        let seen = released.clone();
        let handle = thread::spawn(move || {
            let guard = take();
            (token(&guard), seen.load(SeqCst))
        });
        let_it_queue();
        Waiter { handle, released }
    }

    /// Checks that the waiter does not get the name while it is detached, runs `unlock`
    /// (the detached guard's release) on another thread, and returns the waiter's token,
    /// once it got the name after the release.
    fn after_release(
        self,
        unlock: impl FnOnce() -> redbaton::Result<Unlocked> + Send + 'static,
    ) -> u64 {
        thread::sleep(ms(200));
        assert!(
            !self.handle.is_finished(),
            "the waiter got it while detached"
        );
        let released = self.released;
        let outcome = elsewhere(move || {
            released.store(true, SeqCst);
            unlock()
        });
        assert_eq!(outcome.expect("unlock"), Unlocked::Released);
        let (token, after_release) = join_within(vec![self.handle], JOIN, "the waiter")
            .pop()
            .expect("one result");
        assert!(after_release, "the waiter got it before the release");
        token
    }
}

#[test]
fn smoke() {
    let (srv, c, guard) = locked("smoke");
    let token = guard.fencing_token();
    let detached = guard.detach();
    assert_eq!(detached.name(), b"smoke");
    assert_eq!(detached.fencing_token(), token, "the token stays");
    assert!(detached.valid_until() > std::time::Instant::now());
    detached.check().expect("still held");
    assert!(!detached.is_lost());
    assert!(exists(&mut srv.conn(), KEYS.lock("smoke")));
    assert_eq!(detached.unlock().expect("unlock"), Unlocked::Released);
    assert!(!exists(&mut srv.conn(), KEYS.lock("smoke")));
    // The thread that detached may take the name again: the table forgot it.
    let again = c.try_lock("smoke").expect("free again");
    assert!(again.fencing_token() > token);
}

#[test]
fn unlocked_from_another_thread() {
    let (srv, c) = test_server_and(client);
    let detached = c.lock("moved").expect("lock").detach();
    let outcome = elsewhere(move || detached.unlock());
    assert_eq!(outcome.expect("unlock"), Unlocked::Released);
    assert!(!exists(&mut srv.conn(), KEYS.lock("moved")));
    let stats = c.stats();
    assert_eq!(stats.remote_hold.count, 1, "the hold is counted once");
}

/// A thread of the same client waiting for the name is not handed the detached lock: it
/// gets it in Redis once the detached guard is released, with a higher fencing token.
#[test]
fn a_local_waiter_waits_for_the_detached_release() {
    let (_srv, c, guard) = locked("waited");
    let token = guard.fencing_token();
    let waiter = {
        let c = c.clone();
        Waiter::start(
            move || c.lock("waited").expect("lock"),
            LockGuard::fencing_token,
        )
    };
    let handoffs = c.stats().local_handoffs;
    let detached = guard.detach();
    let next = waiter.after_release(move || {
        detached.check()?;
        detached.unlock()
    });
    assert!(next > token, "{next} after {token}");
    assert_eq!(handoff_of(next), 0, "taken in Redis");
    assert_eq!(c.stats().local_handoffs, handoffs, "no local handoff");
    assert_eq!(
        c.inspect("waited").expect("inspect").fence,
        Some(fence_of(next)),
        "one acquisition in Redis after the detached one"
    );
}

/// A guard that got the lock by a local handoff detaches with its token too, and the
/// baton goes no further.
#[test]
fn a_handed_off_guard_detaches_with_its_token() {
    let (srv, c) = test_server_and(client);
    let first = c.lock("baton").expect("lock");
    let (tx, rx) = crossbeam_channel::bounded(1);
    let second = {
        let c = c.clone();
        thread::spawn(move || {
            let g = c.lock("baton").expect("second lock");
            let token = g.fencing_token();
            tx.send(g.detach()).expect("send");
            token
        })
    };
    let_it_queue();
    let first_token = first.fencing_token();
    let handed = first.unlock().expect("unlock");
    let token = join_within(vec![second], JOIN, "the second holder")
        .pop()
        .expect("one result");
    let detached = rx.recv().expect("the detached guard");
    assert_eq!(detached.fencing_token(), token);
    if handed == Unlocked::HandedOff {
        assert_eq!(fence_of(token), fence_of(first_token));
        assert!(handoff_of(token) > 0);
    }
    assert_eq!(detached.unlock().expect("unlock"), Unlocked::Released);
    assert!(!exists(&mut srv.conn(), KEYS.lock("baton")));
}

#[test]
fn extend_and_check_from_another_thread() {
    let srv = test_server();
    let c = builder(&srv.url()).lease(ms(2000)).build().expect("client");
    let detached = c.lock("extended").expect("lock").detach();
    let detached = elsewhere(move || {
        detached.check().expect("held");
        detached.extend(Duration::from_secs(60)).expect("extend");
        assert!(matches!(
            detached.extend(Duration::ZERO),
            Err(Error::InvalidArgument(_))
        ));
        detached
    });
    let left = pttl(&mut srv.conn(), KEYS.lock("extended"));
    assert!(left > 10_000, "lease extended: {left} ms left");
    assert_eq!(detached.unlock().expect("unlock"), Unlocked::Released);
}

#[test]
fn dropping_a_detached_guard_releases() {
    let (srv, c) = test_server_and(client);
    let detached = c.lock("dropped").expect("lock").detach();
    elsewhere(move || drop(detached));
    assert!(!exists(&mut srv.conn(), KEYS.lock("dropped")));
    let other = client(&srv.url());
    let _held = other.try_lock("dropped").expect("free for another client");
}

#[test]
fn a_detached_guard_hears_that_its_lock_is_lost() {
    let srv = test_server();
    let c = builder(&srv.url())
        .lease(ms(1500))
        .renew_interval(ms(500))
        .build()
        .expect("client");
    let detached = c.lock("lost").expect("lock").detach();
    let deleted: i64 = redis::cmd("DEL")
        .arg(KEYS.lock("lost"))
        .query(&mut srv.conn())
        .expect("DEL");
    assert_eq!(deleted, 1);
    let reason = elsewhere(move || {
        let reason = detached.lost().recv_timeout(Duration::from_secs(10));
        assert!(detached.is_lost());
        assert!(matches!(
            detached.check(),
            Err(Error::Lost(LostReason::Deleted))
        ));
        assert!(!detached.unlock().expect("unlock").was_held());
        reason
    });
    assert_eq!(reason.expect("lost signal"), LostReason::Deleted);
}

/// A detached write hold is released from another thread while a reader of the same
/// client waits: the reader gets its read hold in Redis after the release.
#[test]
fn a_detached_write_hold_unlocked_elsewhere_lets_the_local_reader_in() {
    let (_srv, c) = test_server_and(client);
    let rw = c.rwlock("catalog");
    let w = rw.write().expect("write");
    let token = w.fencing_token();
    let reader = {
        let rw = rw.clone();
        Waiter::start(move || rw.read().expect("read"), ReadGuard::fencing_token)
    };
    let handoffs = c.stats().local_handoffs;
    let detached = w.detach();
    assert_eq!(detached.fencing_token(), token);
    let read_token = reader.after_release(move || {
        detached.check()?;
        detached.unlock()
    });
    assert!(read_token > token, "{read_token} after {token}");
    assert_eq!(c.stats().local_handoffs, handoffs, "no local turn");
    // The writer's thread may write again: the turns forgot it.
    let again = rw.try_write().expect("free again");
    assert!(again.fencing_token() > read_token);
}
