//! Commands the server refuses for a reason of its own, which retrying soon will not cure:
//! an ACL without a command the lock needs (`NOPERM`), a server out of memory (`OOM`), a
//! replica (`READONLY`). The caller is told at once, whichever way it asked (no wait, a
//! deadline, no deadline), with an error that says the server refused
//! ([`Error::is_refused`], and which refusal: [`Error::refusal_code`]), never taken for a
//! network failure, a timeout or a bad reply, and nothing is left in Redis.
//!
//! Real `redis-server`s. Each words a refusal met inside a script its own way (Redis 6.2
//! carries every one under `ERR`, Redis 7 and Valkey an ACL's), and the same code comes
//! out on each.

use std::thread;

use redbaton::{Error, LockClient};
use redbaton_testkit::monitor::{Monitor, script_calls};
use redbaton_testkit::server::RedisServer;
use redbaton_testkit::wait::join_within;
use redbaton_testkit::{lock_client, secs, test_server};

/// A server whose user `locker` may run everything but what `rules` take away.
fn acl_server(rules: &str) -> RedisServer {
    RedisServer::builder()
        .acl_user("locker", "lockerpw", &format!("~* &* +@all {rules}"))
        .start()
}

/// A client of `locker` on `srv`.
fn locker(srv: &RedisServer) -> LockClient {
    lock_client!(node(srv.url_as("locker", "lockerpw").as_str()))
}

/// The error of each way to ask for `name`, one after the other (a second thread of this
/// client asking at once would find the first contending, and be told `WouldBlock`): no
/// wait, a deadline, no deadline. Each must end long before the deadline it was given, or
/// any: a refusal is not waited out.
fn attempts(client: &LockClient, name: &'static str) -> Vec<Error> {
    let calls: [fn(&LockClient, &str) -> redbaton::Result<redbaton::LockGuard>; 3] = [
        |c, n| c.try_lock(n),
        |c, n| c.try_lock_for(n, secs(60)),
        |c, n| c.lock(n),
    ];
    let mut errors = Vec::new();
    for call in calls {
        let c = client.clone();
        let h = thread::spawn(move || call(&c, name).map(drop).expect_err("refused"));
        errors.extend(join_within(vec![h], secs(8), "a refused attempt"));
    }
    errors
}

/// The error of a no-wait attempt at `name` of every other kind: a write hold, a read
/// hold, a permit, a latch's count down, a multi-lock of `name` and another name. Their
/// scripts meet the refusal at other commands than the lock's.
fn other_kinds(client: &LockClient, name: &str) -> Vec<Error> {
    let rw = client.rwlock(format!("{name}-rw"));
    let multi = [name, "another"];
    [
        rw.try_write().map(drop),
        rw.try_read().map(drop),
        client
            .semaphore(format!("{name}-s"), 2)
            .try_acquire()
            .map(drop),
        client.latch(format!("{name}-l"), 2).count_down().map(drop),
        client.try_multi_lock(multi).map(drop),
    ]
    .into_iter()
    .map(|r| r.expect_err("refused"))
    .collect()
}

/// `e` says the server refused with `code`, and nothing else.
fn assert_refused(e: &Error, code: &str) {
    assert!(matches!(e, Error::Redis(_)), "{e:?}");
    assert!(e.is_refused(), "{e:?}");
    assert_eq!(e.refusal_code(), Some(code), "{e:?}");
    assert!(!e.is_connection() && !e.is_auth() && !e.is_tls(), "{e:?}");
    assert!(!e.is_timeout() && !e.is_invalid_input(), "{e:?}");
}

/// No key of the library on `srv`.
fn assert_nothing_written(srv: &RedisServer) {
    let left = srv.keys("*{*");
    assert!(left.is_empty(), "{:?}", srv.keys_but_fences("*"));
}

#[test]
fn smoke() {
    let srv = acl_server("");
    let c = locker(&srv);
    c.lock("k").expect("lock").unlock().expect("unlock");
    let e = c.rwlock("k").try_read();
    assert!(e.is_ok(), "{e:?}");
}

/// An ACL without `EVALSHA`: the server refuses the attempt itself.
#[test]
fn a_lock_refused_by_the_acl_is_a_refusal() {
    let srv = acl_server("-evalsha -eval");
    let c = locker(&srv);
    for e in attempts(&c, "acl").iter().chain(&other_kinds(&c, "acl")) {
        assert_refused(e, "NOPERM");
    }
    assert_nothing_written(&srv);
}

/// An ACL that allows the scripts but not their writes: each server refuses them inside
/// the script with words of its own, under `ERR`; the code is `NOPERM` all the same.
#[test]
fn a_write_refused_by_the_acl_inside_the_script_is_a_refusal() {
    let srv = acl_server("-@write");
    let c = locker(&srv);
    for e in attempts(&c, "acl-set")
        .iter()
        .chain(&other_kinds(&c, "acl-set"))
    {
        assert_refused(e, "NOPERM");
    }
    assert_nothing_written(&srv);
}

/// `maxmemory` below what the server uses, with `noeviction`: the lock's first write is
/// refused with `OOM` (inside the script, under `ERR` on Redis 6.2).
#[test]
fn a_lock_refused_out_of_memory_is_a_refusal() {
    let srv = test_server();
    let c = lock_client!(node(srv.url()));
    srv.config_set("maxmemory-policy", "noeviction");
    srv.config_set("maxmemory", "1");
    for e in attempts(&c, "oom").iter().chain(&other_kinds(&c, "oom")) {
        assert_refused(e, "OOM");
    }
    srv.config_set("maxmemory", "0");
    assert_nothing_written(&srv);
    c.lock("oom")
        .expect("taken once memory is back")
        .unlock()
        .unwrap();
}

/// A client pointed at a replica: every write is refused with `READONLY`, and nothing is
/// written on the replica or on its master.
#[test]
fn a_lock_on_a_replica_is_a_refusal() {
    let master = test_server();
    let replica = master.start_replica();
    let c = lock_client!(node(replica.url()));
    for e in attempts(&c, "replica")
        .iter()
        .chain(&other_kinds(&c, "replica"))
    {
        assert_refused(e, "READONLY");
    }
    assert_nothing_written(&replica);
    assert_nothing_written(&master);
}

/// What is no refusal stays none: a network failure, credentials refused, a name held as
/// another kind, the library's own outcomes.
#[test]
fn other_failures_are_not_refusals() {
    let down = redbaton::LockClient::builder()
        .node(redbaton_testkit::dead_url())
        .build()
        .expect_err("nothing listens");
    let srv = acl_server("");
    let wrong = LockClient::builder()
        .node(srv.url_as("locker", "wrong"))
        .build()
        .expect_err("wrong password");
    let c = locker(&srv);
    let _held = c.lock("k").expect("lock");
    let kind = c.rwlock("k").try_read().expect_err("another kind");
    for e in [down, wrong, kind, Error::Timeout, Error::WouldBlock] {
        assert!(!e.is_refused() && e.refusal_code().is_none(), "{e:?}");
    }
}

/// On a replica, a write hold's attempt is refused as a lock's is, and sent again as
/// often after the pause a demoted master gets (behind Sentinel, the wait for the new
/// master): on Redis 6.2 its refusal comes as a script passes on an error it caught.
#[test]
fn a_write_hold_on_a_replica_is_sent_again_as_a_lock_is() {
    let master = test_server();
    let replica = master.start_replica();
    let c = lock_client!(node(replica.url()));
    let rw = c.rwlock("rw");
    // How often the attempt's script (the first one called on `key`) ran; a give-back of
    // an earlier attempt, which the client sends in the background, is another script.
    let sent = |key: &str, attempt: &dyn Fn() -> Option<Error>| {
        let monitor = Monitor::start(&replica);
        let e = attempt().expect("refused");
        assert_refused(&e, "READONLY");
        let calls = script_calls(&monitor.flush(&replica));
        let on_key: Vec<_> = calls
            .iter()
            .filter(|c| c.keys.first().is_some_and(|k| k == key))
            .collect();
        on_key.iter().filter(|c| c.sha == on_key[0].sha).count()
    };
    let lock = sent("redbaton:{k}", &|| c.try_lock("k").err());
    let write = sent("redbaton:{rw}", &|| rw.try_write().err());
    assert!(lock > 1, "a lock's attempt sent once");
    assert_eq!(write, lock, "the write hold's attempts");
}

/// A multi-lock's release goes out pipelined (one script call per lock, one round trip),
/// where redis-rs keeps each failure's code and words apart from the error's own: a
/// refusal met there is told as a lock's is. Here the ACL takes `DEL` away while the
/// multi-lock is held, and each release script meets the refusal inside.
#[test]
fn a_multi_lock_release_refused_is_a_refusal() {
    let srv = acl_server("");
    let c = locker(&srv);
    let held = c.multi_lock(["m1", "m2"]).expect("multi-lock");
    redis::cmd("ACL")
        .arg(&["SETUSER", "locker", "-del"])
        .query::<()>(&mut srv.conn())
        .expect("ACL SETUSER");
    let e = held.unlock().expect_err("refused");
    assert_refused(&e, "NOPERM");
}
