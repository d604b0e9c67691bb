//! Upgradable reads, upgrades and downgrades of a read-write lock against a real
//! redis-server: an upgrade waits for the readers of other processes and wins with no
//! writer in between, a waiting upgrade holds new readers back, a downgrade keeps a
//! waiting writer out while readers join, upgradable reads exclude each other across
//! processes, renewals never report a converted hold lost, an upgrade that went unanswered
//! leaves its guard lost (the write hold it may have made is given back), a downgrade that
//! went unanswered hands the process's write hold to no local writer, the same on every
//! master of a Cluster, and bad input or paths give typed errors and leave nothing in Redis.
//!
//! Children report through Redis keys the parent reads (`writer_in`, `reader_in`) and stop
//! when the parent sets `stop`: the parent orders events by what it can observe, never by
//! timing.

use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use redbaton::{Error, HoldKind, LockClient, LostReason, ReadGuard, Unlocked, WriteGuard};
use redbaton_testkit::child;
use redbaton_testkit::child_only;
use redbaton_testkit::lock_client;
use redbaton_testkit::ms;
use redbaton_testkit::proxy::Proxy;
use redbaton_testkit::server::RedisServer;
use redbaton_testkit::{test_server, test_server_and};

const PREFIX: &str = "up:";
/// Liveness bound of every wait in these tests: generous, never a speed claim.
const LIVENESS: Duration = Duration::from_secs(30);

fn client(url: &str) -> LockClient {
    lock_client!(node(url), key_prefix(PREFIX))
}

#[test]
fn smoke() {
    let (srv, c) = test_server_and(client);
    // Other clients in this thread: a thread's holds through one client are another
    // client's strangers (`WouldDeadlock` is per client).
    let other = client(&srv.url()).rwlock("smoke");
    let third = client(&srv.url()).rwlock("smoke");
    let rw = c.rwlock("smoke");
    let u = rw.upgradable_read().expect("upgradable read");
    u.check().expect("held");
    let read_token = u.fencing_token();
    // Readers read beside it; writers and other upgradable readers do not get in.
    let r = other.try_read().expect("a reader beside it");
    assert!(third.try_write().unwrap_err().is_would_block());
    assert!(third.try_upgradable_read().unwrap_err().is_would_block());
    let info = c.inspect("smoke").expect("inspect");
    let kinds: Vec<_> = info.holds.iter().map(|h| (h.kind, h.mine)).collect();
    assert!(kinds.contains(&(HoldKind::Upgradable, true)), "{kinds:?}");
    // The upgrade waits for that reader: a try gives the guard back.
    let u = u.try_upgrade().expect_err("a reader holds").into_guard();
    drop(r);
    let w = u.try_upgrade().expect("the reader is gone");
    assert!(w.fencing_token() > read_token, "a writer's token");
    assert!(other.try_read().unwrap_err().is_would_block());
    let write_token = w.fencing_token();
    let r = w.downgrade().expect("downgrade");
    assert!(r.fencing_token() > write_token);
    let joined = other.try_read().expect("readers join");
    assert!(third.try_write().unwrap_err().is_would_block());
    assert_eq!(r.unlock().expect("unlock"), Unlocked::Released);
    drop(joined);
    let next = other.try_write().expect("free");
    assert!(next.fencing_token() > write_token);
    drop(next);
    assert_only_fences(&srv);
}

/// Only fence counters are left under the prefix (every hold, mark and wait is gone).
fn assert_only_fences(srv: &RedisServer) {
    let keys = srv.keys("up:*");
    assert!(
        keys.iter().all(|k| k.ends_with(b":fence")),
        "left: {:?}",
        keys.iter()
            .map(|k| String::from_utf8_lossy(k).into_owned())
            .collect::<Vec<_>>()
    );
}

/// Waits until the sorted set `key` of the Redis at `url` holds `n` members.
fn await_marks(url: &str, key: &str, n: i64) {
    let mut conn = redbaton_testkit::raw_conn(url);
    let deadline = Instant::now() + LIVENESS;
    while redis::cmd("ZCARD")
        .arg(key)
        .query::<i64>(&mut conn)
        .unwrap()
        < n
    {
        assert!(Instant::now() < deadline, "fewer than {n} marks in {key}");
        thread::sleep(ms(5));
    }
}

/// Waits until `key` exists.
fn await_key(conn: &mut redis::Connection, key: &str) {
    let deadline = Instant::now() + LIVENESS;
    while !redbaton_testkit::exists(conn, key) {
        assert!(Instant::now() < deadline, "{key} never set");
        thread::sleep(ms(10));
    }
}

/// A server, a proxy in front of it, and a client through the proxy whose holds outlast
/// the test and whose calls give up soon on a lost reply. The process's write hold serves
/// its writers without asking Redis again.
fn behind_proxy() -> (RedisServer, Proxy, LockClient) {
    let srv = test_server();
    let proxy = Proxy::start(srv.addr());
    let client = lock_client!(
        node(proxy.url()),
        key_prefix(PREFIX),
        lease(Duration::from_secs(20)),
        io_timeouts(ms(300)),
        handoff_slice(Duration::from_secs(600))
    );
    (srv, proxy, client)
}

fn get(conn: &mut redis::Connection, key: &str) -> Option<String> {
    redis::cmd("GET").arg(key).query(conn).unwrap()
}

fn set(conn: &mut redis::Connection, key: &str, value: impl redis::ToRedisArgs) {
    redis::cmd("SET")
        .arg(key)
        .arg(value)
        .query::<()>(conn)
        .unwrap();
}

/// The whole of a child that takes a hold of `NAME` with `take`, says `held=1`, and lets
/// go once `stop` is set.
fn hold_until_stop<T>(take: impl FnOnce(&redbaton::RwLock) -> redbaton::Result<T>) {
    child_only!();
    let url = child::env("REDIS_URL");
    let held = take(&client(&url).rwlock(child::env("NAME"))).expect("hold");
    child::print_result(&[("held", "1".to_owned())]);
    await_key(&mut redbaton_testkit::raw_conn(&url), "stop");
    drop(held);
}

/// A child that reads `NAME` until `stop` is set.
#[test]
fn child_reader_until_stop() {
    hold_until_stop(|rw| rw.read());
}

/// A child that holds the upgradable read of `NAME` until `stop` is set.
#[test]
fn child_upgradable_until_stop() {
    hold_until_stop(|rw| rw.upgradable_read());
}

/// The whole of a child that waits for a hold of `NAME` (`take` gives it, `token` reads
/// its fencing token), then sets `key` to the token and says it; keeps the hold until
/// `stop` is set if `until_stop`.
fn wait_then_say<T>(
    key: &str,
    until_stop: bool,
    take: impl FnOnce(&redbaton::RwLock, Duration) -> redbaton::Result<T>,
    token: impl FnOnce(&T) -> u64,
) {
    child_only!();
    let url = child::env("REDIS_URL");
    let held = take(&client(&url).rwlock(child::env("NAME")), LIVENESS).expect("hold");
    let token = token(&held);
    let mut conn = redbaton_testkit::raw_conn(&url);
    set(&mut conn, key, token);
    child::print_result(&[("token", token.to_string())]);
    if until_stop {
        await_key(&mut conn, "stop");
    }
    drop(held);
}

/// A child that waits to write `NAME`, and once it writes sets `writer_in` to its token.
#[test]
fn child_writer_waits() {
    let take = redbaton::RwLock::try_write_for;
    wait_then_say("writer_in", false, take, WriteGuard::fencing_token);
}

/// A child that waits to read `NAME`, sets `reader_in` while it reads, and lets go once
/// `stop` is set.
#[test]
fn child_reader_waits() {
    let take = redbaton::RwLock::try_read_for;
    wait_then_say("reader_in", true, take, ReadGuard::fencing_token);
}

/// A server of its own for a test of `name`, and what its children are told of both.
fn served(name: &str) -> (RedisServer, [(&'static str, String); 2]) {
    let srv = test_server();
    let envs = [("REDIS_URL", srv.url()), ("NAME", name.to_owned())];
    (srv, envs)
}

/// Starts the child `test` and waits until it says it holds.
fn holder(test: &str, envs: &[(&str, String)]) -> std::process::Child {
    let mut c = child::spawn_self(test, envs);
    child::wait_for_line(&mut c, "held=1", LIVENESS);
    c
}

#[test]
fn an_upgrade_waits_for_other_processes_readers_and_no_writer_gets_in_first() {
    let (srv, envs) = served("up");
    let c = client(&srv.url());
    let u = c.rwlock("up").upgradable_read().expect("upgradable read");
    let readers = [
        holder("child_reader_until_stop", &envs),
        holder("child_reader_until_stop", &envs),
    ];
    let writer = child::spawn_self("child_writer_waits", &envs);
    await_marks(&srv.url(), "up:{up}:ww", 1);
    // Once the upgrade is marked waiting too, no new reader gets in; then the readers go.
    let url = srv.url();
    let stopper = thread::spawn(move || {
        await_marks(&url, "up:{up}:ww", 2);
        let late = client(&url).rwlock("up").try_read();
        assert!(late.unwrap_err().is_would_block(), "a new reader got in");
        set(&mut redbaton_testkit::raw_conn(&url), "stop", 1);
    });
    let t = Instant::now();
    let w = u.upgrade().expect("upgrade");
    eprintln!("upgrade waited {:?} for two readers", t.elapsed());
    stopper.join().expect("stopper");
    let mut conn = srv.conn();
    assert_eq!(get(&mut conn, "stop").as_deref(), Some("1"), "it waited");
    assert_eq!(get(&mut conn, "writer_in"), None, "a writer got in first");
    w.check().expect("the write hold is ours");
    let ours = w.fencing_token();
    drop(w);
    for r in readers {
        child::wait_ok(r, LIVENESS);
    }
    let out = child::wait_ok(writer, LIVENESS);
    let theirs: u64 = child::field(&child::result_with(&out, "token"), "token");
    assert!(
        theirs > ours,
        "the waiting writer came after: {theirs} > {ours}"
    );
    assert_only_fences(&srv);
}

#[test]
fn a_waiting_upgrade_holds_new_readers_back() {
    let srv = test_server();
    let (a, b) = (client(&srv.url()), client(&srv.url()));
    let u = a.rwlock("back").upgradable_read().expect("upgradable read");
    let (release, released) = mpsc::channel::<()>();
    let (reading, read) = mpsc::channel::<()>();
    let reader = thread::spawn(move || {
        let r = b.rwlock("back").read().expect("read");
        reading.send(()).unwrap();
        released.recv().unwrap();
        drop(r);
    });
    read.recv().unwrap();
    let url = srv.url();
    let checker = thread::spawn(move || {
        await_marks(&url, "up:{back}:ww", 1);
        let late = client(&url).rwlock("back").try_read();
        assert!(late.unwrap_err().is_would_block(), "a new reader got in");
        release.send(()).unwrap();
    });
    let w = u.upgrade().expect("upgrade");
    checker.join().expect("checker");
    reader.join().expect("reader");
    drop(w);
    assert_only_fences(&srv);
}

#[test]
fn a_downgrade_keeps_a_waiting_writer_out_and_lets_local_readers_join() {
    let (srv, envs) = served("down");
    // Local readers join the process's read hold while its budget lasts (then Redis says a
    // writer waits, and they stop): a budget longer than the test.
    let c = lock_client!(
        node(srv.url()),
        key_prefix(PREFIX),
        handoff_slice(Duration::from_secs(600))
    );
    let rw = c.rwlock("down");
    let w = rw.write().expect("write");
    let writer = child::spawn_self("child_writer_waits", &envs);
    await_marks(&srv.url(), "up:{down}:ww", 1);
    let r = w.downgrade().expect("downgrade");
    r.check().expect("the downgraded read holds");
    let mut conn = srv.conn();
    assert_eq!(
        get(&mut conn, "writer_in"),
        None,
        "the writer got in between"
    );
    // Another thread of this process joins the read; a writer still waits (writers
    // first, so another process's new reader is held back too).
    thread::scope(|s| {
        s.spawn(|| drop(rw.try_read().expect("a local reader joins")));
        assert!(s.spawn(|| rw.try_write().is_err()).join().unwrap());
    });
    let other = client(&srv.url()).rwlock("down");
    assert!(other.try_read().unwrap_err().is_would_block());
    let info = c.inspect("down").expect("inspect");
    assert_eq!(info.holds.len(), 1, "{info:?}");
    assert_eq!(
        (info.holds[0].kind, info.holds[0].mine),
        (HoldKind::Read, true)
    );
    assert_eq!(info.waiting_writers.len(), 1, "{info:?}");
    assert_eq!(get(&mut conn, "writer_in"), None);
    let read_token = r.fencing_token();
    assert_eq!(r.unlock().expect("unlock"), Unlocked::Released);
    let out = child::wait_ok(writer, LIVENESS);
    let theirs: u64 = child::field(&child::result_with(&out, "token"), "token");
    assert!(theirs > read_token, "{theirs} > {read_token}");
    assert_only_fences(&srv);
}

/// A downgrade turns the write hold into a read hold of the same acquisition (its fence
/// kept): the hold's cap (`max_hold`) still counts from the write hold's acquisition, so
/// that an upgradable read, an upgrade and a downgrade do not hold a name past it.
#[test]
fn a_downgrade_keeps_the_hold_cap_of_the_write_hold() {
    let (_srv, c) =
        test_server_and(|url| lock_client!(node(url), key_prefix(PREFIX), max_hold(ms(2000))));
    let w = c.rwlock("cap").write().expect("write");
    let taken = Instant::now();
    thread::sleep(ms(1500));
    let r = w.downgrade().expect("downgrade");
    r.check().expect("held within the cap");
    while r.check().is_ok() && taken.elapsed() < LIVENESS {
        thread::sleep(ms(20));
    }
    let ended = taken.elapsed();
    assert!(
        matches!(r.check(), Err(Error::Lost(LostReason::HoldLimit))),
        "{:?}",
        r.check()
    );
    // The cap ends it at 2 s; counted from the downgrade it would be 3.5 s.
    assert!(
        ended < ms(3000),
        "the read hold lasted {ended:?} from the write hold's acquisition, its cap 2 s"
    );
}

#[test]
fn a_downgrade_wakes_other_processes_readers() {
    let (srv, envs) = served("wake");
    let c = client(&srv.url());
    let w = c.rwlock("wake").write().expect("write");
    let reader = child::spawn_self("child_reader_waits", &envs);
    await_marks(&srv.url(), "up:{wake}:wr", 1);
    let r = w.downgrade().expect("downgrade");
    let mut conn = srv.conn();
    // The reader of the other process reads while the downgraded read holds.
    await_key(&mut conn, "reader_in");
    r.check().expect("still reading");
    let theirs: u64 = get(&mut conn, "reader_in").unwrap().parse().unwrap();
    assert_eq!(theirs, r.fencing_token(), "both read after the same write");
    set(&mut conn, "stop", 1);
    drop(r);
    child::wait_ok(reader, LIVENESS);
    assert_only_fences(&srv);
}

#[test]
fn upgradable_reads_exclude_each_other() {
    let (srv, envs) = served("one");
    let held = holder("child_upgradable_until_stop", &envs);
    let c = client(&srv.url());
    let rw = c.rwlock("one");
    assert!(rw.try_upgradable_read().unwrap_err().is_would_block());
    assert!(
        rw.try_upgradable_read_for(ms(100))
            .unwrap_err()
            .is_timeout()
    );
    drop(rw.try_read().expect("a reader reads beside it"));
    // The child lets go once this one waits for it (its mark is in the readers' set).
    let url = srv.url();
    let stopper = thread::spawn(move || {
        await_marks(&url, "up:{one}:wr", 1);
        set(&mut redbaton_testkit::raw_conn(&url), "stop", 1);
    });
    let u = rw
        .try_upgradable_read_for(LIVENESS)
        .expect("after the child's");
    stopper.join().unwrap();
    child::wait_ok(held, LIVENESS);
    // Threads of one process exclude each other too: the hold is not shared locally.
    thread::scope(|s| {
        let busy = s.spawn(|| rw.try_upgradable_read().unwrap_err().is_would_block());
        assert!(busy.join().unwrap());
    });
    drop(u);
    assert_only_fences(&srv);
}

#[test]
fn bad_input_and_paths_are_typed_errors() {
    let (srv, c) = test_server_and(client);
    assert!(matches!(
        c.rwlock("").upgradable_read(),
        Err(Error::InvalidName(_))
    ));
    let too_long = vec![b'x'; redbaton::MAX_NAME_LEN + 1];
    assert!(
        c.rwlock(&too_long)
            .try_upgradable_read()
            .unwrap_err()
            .is_invalid_input()
    );
    // One name, one kind.
    let (rw, sem) = (c.rwlock("kind"), c.semaphore("kind", 2));
    let plain = c.lock("kind").expect("lock");
    assert!(rw.try_upgradable_read().unwrap_err().is_wrong_kind());
    drop(plain);
    let u = rw.upgradable_read().expect("free again");
    assert!(c.try_lock("kind").unwrap_err().is_wrong_kind());
    assert!(sem.try_acquire().unwrap_err().is_wrong_kind());
    // A thread never waits for itself.
    for taken in [
        rw.try_read().err(),
        rw.try_write().err(),
        rw.try_upgradable_read().err(),
    ] {
        assert!(matches!(taken, Some(Error::WouldDeadlock)), "{taken:?}");
    }
    drop(u);
    let r = rw.read().expect("read");
    assert!(matches!(rw.upgradable_read(), Err(Error::WouldDeadlock)));
    drop(r);
    let w = rw.write().expect("write");
    assert!(matches!(rw.upgradable_read(), Err(Error::WouldDeadlock)));
    drop(w);
    // A hold deleted under it: the upgrade and the downgrade say it is lost.
    let mut conn = srv.conn();
    let u = rw.upgradable_read().expect("upgradable read");
    redis::cmd("DEL")
        .arg("up:{kind}")
        .query::<()>(&mut conn)
        .unwrap();
    let e = u.try_upgrade_for(LIVENESS).expect_err("gone");
    assert!(e.error().is_lost(), "{e:?}");
    let (u, _) = e.into_parts();
    assert!(u.check().unwrap_err().is_lost());
    drop(u);
    let w = rw.write().expect("write");
    redis::cmd("DEL")
        .arg("up:{kind}")
        .query::<()>(&mut conn)
        .unwrap();
    assert!(w.downgrade().unwrap_err().is_lost());
    // An upgrade that times out gives the guard back, still holding, with no mark left.
    let other = client(&srv.url());
    let u = rw.upgradable_read().expect("upgradable read");
    let r = other.rwlock("kind").read().expect("a reader");
    let e = u.try_upgrade_for(ms(100)).expect_err("a reader holds");
    assert!(e.error().is_timeout(), "{e:?}");
    let as_error: Error = e.into_guard().try_upgrade().expect_err("still").into();
    assert!(as_error.is_would_block(), "{as_error:?}");
    assert!(!redbaton_testkit::exists(&mut conn, "up:{kind}:ww"));
    drop(r);
    // Upgrades and downgrades of a thread's own holds; a second guard on an own read
    // keeps it.
    let w = rw.upgradable_read().unwrap().upgrade().expect("upgrade");
    let r = w.downgrade().expect("downgrade");
    let again = rw.read().expect("the thread reads again");
    drop(r);
    again.check().expect("still held");
    assert_eq!(c.inspect("kind").unwrap().holds.len(), 1);
    drop(again);
    assert_only_fences(&srv);
    // Redlock offers no read-write locks.
    let servers = [test_server(), test_server(), test_server()];
    let redlock = lock_client!(nodes(servers.iter().map(|s| s.url())));
    assert!(
        redlock
            .rwlock("r")
            .try_upgradable_read()
            .unwrap_err()
            .is_unsupported()
    );
}

/// Every hold without local handoff is a thread's own: a thread that reads twice shares
/// one remote hold, which goes back with its last guard.
#[test]
fn without_local_handoff_a_second_read_guard_keeps_the_hold() {
    let srv = test_server();
    let c = lock_client!(node(srv.url()), key_prefix(PREFIX), local_handoff(false));
    let rw = c.rwlock("own");
    let first = rw.read().expect("read");
    let second = rw.read().expect("again");
    drop(first);
    second.check().expect("held");
    let other = client(&srv.url()).rwlock("own");
    assert!(other.try_write().unwrap_err().is_would_block());
    assert_eq!(second.unlock().expect("unlock"), Unlocked::Released);
    let w = rw.write().expect("write");
    let r = w.downgrade().expect("downgrade");
    assert!(other.try_write().unwrap_err().is_would_block());
    drop(r);
    assert_only_fences(&srv);
}

/// Renewals never report a hold lost because an upgrade or a downgrade replaced it: with
/// renewals every few milliseconds (the lease is long: nothing expires), many conversions
/// in a row meet renewals in flight and lose nothing.
#[test]
fn renewals_never_cross_a_conversion() {
    let srv = test_server();
    let c = lock_client!(
        node(srv.url()),
        key_prefix(PREFIX),
        lease(Duration::from_secs(10)),
        renew_interval(ms(2))
    );
    let rw = c.rwlock("renewed");
    let (mut conversions, t) = (0u64, Instant::now());
    while t.elapsed() < Duration::from_secs(2) {
        // Holds of a few renewal intervals each, of varied length.
        let hold = || thread::sleep(Duration::from_micros(1000 + conversions % 7 * 500));
        let u = rw.upgradable_read().unwrap();
        hold();
        let w = u.upgrade().expect("upgrade");
        hold();
        let r = w.downgrade().expect("downgrade");
        hold();
        r.check().expect("held");
        conversions += 2;
    }
    let stats = c.stats();
    eprintln!(
        "{conversions} conversions, {} renewals",
        stats.renewals_sent
    );
    assert!(stats.renewals_sent > 0, "{stats:?}");
    assert_eq!(stats.locks_lost, 0, "{stats:?}");
    assert_only_fences(&srv);
}

/// An upgrade that goes unanswered may have run: the upgradable read is then the write
/// hold in Redis, which the library gives back (the upgrade's outcome is unknown), and a
/// writer waiting behind it gets in. The guard given back must not go on claiming the
/// upgradable read meanwhile: its `check` says lost, converted, and its validity is over.
#[test]
fn an_unanswered_upgrade_leaves_no_upgradable_read_believed() {
    let (srv, proxy, a) = behind_proxy();
    // The server knows the upgrade's script: an unknown one's `EVALSHA` runs nothing.
    drop(
        a.rwlock("warm")
            .upgradable_read()
            .and_then(|u| u.upgrade())
            .expect("upgrade"),
    );
    let u = a
        .rwlock("unanswered")
        .upgradable_read()
        .expect("upgradable read");
    // A writer of another client waits (marked) behind the upgradable read.
    let (writing, wrote) = mpsc::channel::<u64>();
    let (done, finish) = mpsc::channel::<()>();
    let writer = {
        let b = client(&srv.url());
        thread::spawn(move || {
            let w = b.rwlock("unanswered").write().expect("write");
            writing.send(w.fencing_token()).unwrap();
            finish.recv().unwrap();
            drop(w);
        })
    };
    await_marks(&srv.url(), "up:{unanswered}:ww", 1);
    // Every call of this client on the name runs in Redis, and its reply is lost: the
    // upgrade, its retries, what the client does about their unknown outcome.
    let (written, overlap) = proxy.losing_replies_matching(b"{unanswered}", || {
        let refused = u.try_upgrade().expect_err("the upgrade is never answered");
        assert!(refused.error().is_connection(), "{:?}", refused.error());
        let written = wrote.recv_timeout(LIVENESS).expect("the writer got in");
        let guard = refused.into_guard();
        let valid_for = guard
            .valid_until()
            .saturating_duration_since(Instant::now());
        (written, (guard.check(), valid_for))
    });
    done.send(()).unwrap();
    writer.join().expect("writer");
    match overlap {
        (Err(Error::Lost(LostReason::Converted)), valid_for) if valid_for.is_zero() => {}
        (check, valid_for) => panic!(
            "the writer holds (fencing token {written}) while the upgradable read's guard \
             says {check:?}, valid for {valid_for:?}"
        ),
    }
}

/// A downgrade of the process's write hold whose outcome is unknown (every reply lost, the
/// retries too) may have turned the write hold into a read hold in Redis, which the client
/// then gives back: the write hold is gone from Redis. The thread waiting for the process's
/// write hold must not be handed it locally: a writer of another process may take the name.
#[test]
fn an_unanswered_downgrade_hands_no_local_writer_the_write_hold() {
    let (srv, proxy, a) = behind_proxy();
    let b = client(&srv.url());
    // The server knows the downgrade's script: an unknown one's `EVALSHA` runs nothing.
    drop(
        a.rwlock("warm")
            .write()
            .and_then(|w| w.downgrade())
            .expect("downgrade"),
    );
    let handoffs_before = a.stats().local_handoffs;
    let w = a.rwlock("unanswered").write().expect("write");
    let a = &a;
    let (got, got_it) = mpsc::channel::<Result<u64, String>>();
    let (ask, asked) = mpsc::channel::<()>();
    let (checked, check_result) = mpsc::channel::<Result<(), Error>>();
    thread::scope(|s| {
        // A second writer of this process waits for the process's write hold.
        s.spawn(move || {
            let second = a.rwlock("unanswered").write();
            let token = second.as_ref().map(|g| g.fencing_token());
            got.send(token.map_err(ToString::to_string)).unwrap();
            if let Ok(guard) = second {
                asked.recv().unwrap();
                checked.send(guard.check()).unwrap();
            }
        });
        // Long enough that it waits in the process's turn (were it not waiting yet, it
        // would ask Redis itself, and the test would prove less).
        thread::sleep(ms(300));
        proxy.losing_replies_matching(b"{unanswered}", || {
            let refused = w.downgrade().expect_err("the downgrade is never answered");
            assert!(refused.is_connection(), "{refused:?}");
        });
        let second = got_it
            .recv_timeout(LIVENESS)
            .expect("the second writer returned");
        let handed = a.stats().local_handoffs > handoffs_before;
        // Another process's writer takes the name once it is free in Redis, unless this
        // process's second writer holds it there.
        let deadline = Instant::now() + LIVENESS;
        let other = loop {
            if let Ok(g) = b.rwlock("unanswered").try_write() {
                break Some(g);
            }
            let info = a.inspect("unanswered").expect("inspect");
            let ours = |h: &redbaton::Hold| h.mine && h.kind == HoldKind::Write;
            if second.is_ok() && !handed && info.holds.iter().any(ours) {
                break None;
            }
            assert!(Instant::now() < deadline, "nobody got the name: {info:?}");
            thread::sleep(ms(10));
        };
        // The second writer believes it holds when its guard's check says so.
        let believed = second.is_ok() && {
            ask.send(()).unwrap();
            let check = check_result.recv_timeout(LIVENESS).expect("checked");
            check.is_ok()
        };
        drop(ask);
        if let (Some(other), true) = (&other, believed) {
            panic!(
                "another process's writer holds (fencing token {}) while this process's \
                 second writer (fencing token {:?}, handed over locally: {handed}) believes \
                 it holds",
                other.fencing_token(),
                second
            );
        }
    });
}

/// Redis Cluster: upgrades and downgrades on names served by every master (each script's
/// keys share the name's slot).
#[test]
fn upgrades_and_downgrades_on_every_master_of_a_cluster() {
    let cluster = redbaton_testkit::cluster::Cluster::start();
    let build = || lock_client!(cluster(cluster.seed_urls()), key_prefix(PREFIX));
    let (a, b) = (build(), build());
    for i in 0..9 {
        let name = format!("up-{i}");
        let u = a.rwlock(&name).upgradable_read().expect("upgradable read");
        let r = b.rwlock(&name).read().expect("a reader beside it");
        let u = u.try_upgrade().expect_err("a reader holds").into_guard();
        drop(r);
        let w = u.upgrade().expect("upgrade");
        assert!(b.rwlock(&name).try_read().unwrap_err().is_would_block());
        let written = w.fencing_token();
        let r = w.downgrade().expect("downgrade");
        assert!(r.fencing_token() > written);
        drop(b.rwlock(&name).try_read().expect("readers join"));
        drop(r);
        let next = b.rwlock(&name).try_write().expect("free");
        assert!(next.fencing_token() > written);
    }
}

/// An upgrade issues a write hold's fence, as a write does, so it says too whether the
/// write hold before it ended without a release: here that writer's hold was deleted
/// under it (as its lease running out would leave it), and the upgrade that comes next is
/// told; after a writer that released, it is not.
#[test]
fn an_upgrade_tells_of_a_write_hold_lost_before_it() {
    let (srv, c) = test_server_and(client);
    let other = client(&srv.url());
    let rw = c.rwlock("lost-before");
    let lost = other.rwlock("lost-before").write().expect("write hold");
    let () = redis::cmd("DEL")
        .arg(format!("{PREFIX}{{lost-before}}"))
        .query(&mut srv.conn())
        .expect("DEL");
    drop(lost);
    let upgraded = || rw.upgradable_read().and_then(|u| u.upgrade());
    let w = upgraded().expect("upgrade");
    assert!(
        w.previous_lost(),
        "the write hold before was never released"
    );
    w.unlock().expect("unlock");
    let w = upgraded().expect("upgrade");
    assert!(!w.previous_lost(), "the write hold before was released");
}
