//! Scripts that meet a failing command after they wrote: Redis does not undo a script's
//! writes when a later command of it fails, so a release or an attempt must not fail
//! half-way. Each test makes one command fail for the client's ACL user (an operator may
//! grant less than the guide's least ACL) at the moment a script would run it after its
//! first write, and checks what is left: the release done and said so, the waiter woken
//! or granted, no hold left behind without its owner knowing.
//!
//! A server out of memory (`maxmemory` with `noeviction`) refuses only a script's first
//! write that may take memory, never a later one: no half-way failure, which one test
//! pins for a release that grants.
//!
//! Real `redis-server`; the user's rights are changed with `ACL SETUSER` from the
//! harness's own connection while the clients run. Times are liveness bounds only: the
//! leases and re-checks are far longer, so a waiter that gets in within them was woken.

use std::thread;

use redbaton::{Error, LockClient};
use redbaton_testkit::server::RedisServer;
use redbaton_testkit::{lock_client, ms, secs};

/// A server whose user `locker` may run everything (until a test takes a command away).
fn server() -> RedisServer {
    RedisServer::builder()
        .acl_user("locker", "lockerpw", "~* &* +@all")
        .start()
}

/// A client of `locker`, with leases and re-checks far past the tests' bounds.
fn client(srv: &RedisServer) -> LockClient {
    lock_client!(node(srv.url_as("locker", "lockerpw").as_str()), patient())
}

/// Takes `command` away from `locker`.
fn refuse(srv: &RedisServer, command: &str) {
    let _: () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg("locker")
        .arg(format!("-{command}"))
        .query(&mut srv.conn())
        .expect("ACL SETUSER");
}

/// The members of the sorted set `key`.
fn members(srv: &RedisServer, key: &str) -> Vec<String> {
    redis::cmd("ZRANGE")
        .arg(key)
        .arg(0)
        .arg(-1)
        .query(&mut srv.conn())
        .expect("ZRANGE")
}

#[test]
fn smoke() {
    let srv = server();
    let c = client(&srv);
    c.semaphore("s", 1).acquire().unwrap().unlock().unwrap();
    c.rwlock("rw").write().unwrap().unlock().unwrap();
}

/// Runs `wait` (a waiter that takes the hold and gives it back) in a thread, then, once it
/// waits, runs `block` (what makes a command of the release fail: `refuse`, or `oom`) and
/// `release` (the hold in the way): the release must say it was done, and the waiter must
/// get in, woken or granted, long before its re-check. Then nothing is left held of `lock`.
fn release_blocked<B, R, W>(srv: &RedisServer, block: B, lock: &str, release: R, wait: W)
where
    B: FnOnce(),
    R: FnOnce() -> Result<(), Error>,
    W: FnOnce() -> Result<(), Error> + Send,
{
    thread::scope(|s| {
        let waiter = s.spawn(wait);
        thread::sleep(ms(300));
        block();
        let released = release();
        assert!(released.is_ok(), "released: {released:?}");
        let got = waiter.join().unwrap();
        assert!(got.is_ok(), "the waiter: {got:?}");
    });
    assert!(members(srv, lock).is_empty(), "{:?}", members(srv, lock));
}

/// [`release_blocked`] with `command` refused (see `refuse`), `lock` the key of the hold.
fn release_refused<R, W>(srv: &RedisServer, (command, lock): (&str, &str), release: R, wait: W)
where
    R: FnOnce() -> Result<(), Error>,
    W: FnOnce() -> Result<(), Error> + Send,
{
    release_blocked(srv, || refuse(srv, command), lock, release, wait);
}

/// `maxmemory` below what the server uses, with `noeviction`: every command that may
/// take memory is refused with `OOM`.
fn oom(srv: &RedisServer) {
    let mut c = srv.conn();
    for (name, value) in [("maxmemory-policy", "noeviction"), ("maxmemory", "1")] {
        let _: () = redis::cmd("CONFIG")
            .arg("SET")
            .arg(name)
            .arg(value)
            .query(&mut c)
            .expect("CONFIG SET");
    }
}

/// The release of a permit takes the hold out, then counts the live holds (`ZCOUNT`) to
/// grant the freed permit to the permit-seeker waiting longest: refused, the permit is
/// free all the same, the release says it was done, and the waiter is woken to take it.
#[test]
fn a_permit_release_whose_count_is_refused_frees_and_wakes() {
    let srv = server();
    let (a, b) = (client(&srv), client(&srv));
    let held = a.semaphore("s", 1).acquire().expect("permit");
    let release = || held.unlock().map(drop);
    release_refused(&srv, ("zcount", "redbaton:{s}"), release, || {
        let permit = b.semaphore("s", 1).try_acquire_for(secs(8))?;
        let holds = members(&srv, "redbaton:{s}");
        assert_eq!(holds.len(), 2, "the kind member and the permit: {holds:?}");
        permit.unlock().map(drop)
    });
}

/// The release of the last read hold grants the write hold to the writer waiting
/// (`ZADD`), then reads its nonce (`ZMSCORE`): refused, the grant goes out as a wake-up
/// (nonce 0), whose attempt finds the write hold its own; the release says it was done.
/// The same for the reader waiting behind that writer, when the write hold ends.
#[test]
fn releases_whose_nonce_read_is_refused_still_grant() {
    let srv = server();
    let (a, b, c) = (client(&srv), client(&srv), client(&srv));
    let read = a.rwlock("rw").read().expect("read");
    let release = || read.unlock().map(drop);
    release_refused(&srv, ("zmscore", "redbaton:{rw}"), release, || {
        thread::scope(|s| {
            let writer = s.spawn(|| {
                let w = b.rwlock("rw").try_write_for(secs(8))?;
                w.check()?;
                w.unlock().map(drop)
            });
            // Behind the waiting writer.
            thread::sleep(ms(100));
            let r = c.rwlock("rw").try_read_for(secs(8))?;
            r.check()?;
            r.unlock()?;
            writer.join().unwrap()
        })
    });
}

/// A server out of memory refuses a script's first write that may take memory, never a
/// later one (Redis lets a script that has written go on): a release, whose first write
/// takes the hold out, finishes, and its grant of the write hold to the writer waiting is
/// written and heard (the writer takes it from the message: its own attempt would be
/// refused).
#[test]
fn a_release_out_of_memory_still_grants_the_writer() {
    let srv = server();
    let (a, b) = (client(&srv), client(&srv));
    let read = a.rwlock("rw").read().expect("read");
    release_blocked(
        &srv,
        || oom(&srv),
        "redbaton:{rw}",
        || read.unlock().map(drop),
        || b.rwlock("rw").try_write_for(secs(8))?.unlock().map(drop),
    );
    // Out of memory, an attempt's first write is refused, and says so: nothing is taken.
    let refused = a.rwlock("rw").try_write().map(drop);
    assert!(
        matches!(&refused, Err(Error::Redis(e)) if e.to_string().contains("OOM")),
        "{refused:?}"
    );
    assert!(members(&srv, "redbaton:{rw}").is_empty());
}

/// A write attempt that takes the hold then asks whether others wait (`EXISTS`): refused,
/// the hold is the caller's all the same, rather than written, then answered with an
/// error.
#[test]
fn a_write_hold_whose_waiter_check_is_refused_is_kept() {
    let srv = server();
    let c = client(&srv);
    refuse(&srv, "exists");
    let got = c.rwlock("rw").try_write();
    let holds = members(&srv, "redbaton:{rw}");
    let w = got.unwrap_or_else(|e| panic!("write: {e:?}, left in Redis: {holds:?}"));
    w.unlock().expect("unlock");
    assert!(members(&srv, "redbaton:{rw}").is_empty());
}

/// A server out of memory refuses a script's first write that may take memory: a shared
/// hold's renewal writes the hold's new expiry (`ZADD`), which takes none, yet is such a
/// command. The renewal lengthens the key's TTL first (`PEXPIRE`, which Redis lets
/// through), so read holds and permits are kept while the server is full, as locks are.
#[test]
fn shared_holds_are_renewed_while_the_server_is_out_of_memory() {
    let srv = server();
    let c = lock_client!(
        node(srv.url_as("locker", "lockerpw").as_str()),
        lease(ms(600))
    );
    let read = c.rwlock("rw").read().expect("read");
    let permit = c.semaphore("s", 2).acquire().expect("permit");
    let lock = c.lock("l").expect("lock");
    oom(&srv);
    // Three leases: renewed every third of one, each hold needs several renewals.
    thread::sleep(ms(1800));
    let kept = [
        ("read", read.check()),
        ("permit", permit.check()),
        ("lock", lock.check()),
    ];
    for (what, kept) in &kept {
        assert!(kept.is_ok(), "{what} out of memory: {kept:?}");
    }
}
