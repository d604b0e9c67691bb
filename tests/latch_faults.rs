//! Countdown latches under faults, against real `redis-server` processes: a count down
//! that a demoted master refused (`READONLY`: it did not count) is counted once where
//! the master is now; a wait cancelled while its read waits on a stalled server says
//! `Cancelled`; a waiter whose key is deleted or replaced by hand is told at its re-check;
//! a count down the server refuses announces nothing.

use std::thread;

use redbaton::Cancel;
use redbaton_testkit::keys::Keys;
use redbaton_testkit::monitor::{Monitor, parse_line};
use redbaton_testkit::sentinel::SentinelGroup;
use redbaton_testkit::server::RedisServer;
use redbaton_testkit::wait::join_within;
use redbaton_testkit::{init_log, lock_client, ms, secs};

/// The Sentinel master name of the tests' sentinels.
const NAME: &str = "latches";

/// The latch key of `name` under the default prefix.
fn latch_key(name: &str) -> String {
    format!("{}:latch", Keys::DEFAULT.lock(name))
}

/// The stored value of the latch `name` on `srv` (`<left>:<count>:<id>`), if any.
fn stored(srv: &RedisServer, name: &str) -> Option<String> {
    redis::cmd("GET")
        .arg(latch_key(name))
        .query(&mut srv.conn())
        .expect("GET")
}

/// Runs `words` on `srv`.
fn run(srv: &RedisServer, words: &[&str]) {
    let _: redis::Value = redis::cmd(words[0])
        .arg(&words[1..])
        .query(&mut srv.conn())
        .unwrap_or_else(|e| panic!("{words:?}: {e}"));
}

#[test]
fn smoke() {
    init_log();
    let srv = RedisServer::start();
    let c = lock_client!(node(srv.url()));
    let latch = c.latch("smoke", 2);
    assert_eq!(latch.count_down().expect("count down"), 1);
    assert_eq!(
        stored(&srv, "smoke").expect("stored").split(':').next(),
        Some("1")
    );
    assert_eq!(latch.count_down().expect("count down"), 0);
    latch.wait_for(secs(1)).expect("open");
}

/// The master was replaced (its replica promoted, it demoted, the sentinel naming the new
/// one) and no message said so. A count down sent to the demoted master is refused there
/// (`READONLY`: the script's write failed, so it did not count): the client looks at the
/// sentinels again and counts down once on the new master, rather than returning a
/// refusal that reads as "may or may not have counted". That count down opens the latch,
/// and wakes a waiter of another client (which re-checks only every minute).
#[test]
fn a_count_down_refused_by_a_demoted_master_counts_once_on_the_new_one() {
    init_log();
    let group = SentinelGroup::start(NAME, 1, 1);
    let (a, b, s) = (&group.servers[0], &group.servers[1], &group.sentinels[0]);
    let c = lock_client!(sentinel(NAME, group.sentinel_urls()), io_timeouts(ms(500)));
    let w = lock_client!(sentinel(NAME, group.sentinel_urls()), patient());
    let latch = c.latch("demoted", 3);
    assert_eq!(latch.count_down().expect("first count down"), 2);
    assert_eq!(latch.count_down().expect("second count down"), 1);
    let waiter = {
        let latch = w.latch("demoted", 3);
        thread::spawn(move || latch.wait_for(secs(40)))
    };
    redbaton_testkit::wait::wait_for(secs(10), "the count replicated", || {
        stored(b, "demoted") == stored(a, "demoted")
    });
    thread::sleep(ms(200));
    // What a failover leaves, with no `+switch-master` published.
    let new_port = b.port().to_string();
    run(b, &["REPLICAOF", "NO", "ONE"]);
    run(a, &["REPLICAOF", "127.0.0.1", &new_port]);
    run(s, &["SENTINEL", "REMOVE", NAME]);
    run(
        s,
        &["SENTINEL", "MONITOR", NAME, "127.0.0.1", &new_port, "1"],
    );
    let left = latch.count_down();
    let on_b = stored(b, "demoted").unwrap_or_default();
    let failovers = c.stats().failovers;
    assert!(
        matches!(left, Ok(0)),
        "{left:?} (new master: {on_b}, failovers {failovers})"
    );
    assert!(
        on_b.starts_with("0:3:"),
        "counted once on the new master: {on_b}"
    );
    let out = join_within(vec![waiter], secs(30), "the waiter").pop();
    assert!(matches!(out, Some(Ok(()))), "{out:?}");
}

/// A waiter re-checking (every 100 ms) a latch on a server that stalls (`SIGSTOP`) is in
/// a read that cannot end before its read timeout when its wait is cancelled: the wait
/// ends once the read does, with `Cancelled`, the answer to the caller's cancel, not the
/// read's timeout.
#[test]
fn a_wait_cancelled_during_a_stalled_read_says_cancelled() {
    init_log();
    let srv = RedisServer::start();
    let url = srv.url();
    let c = lock_client!(node(url), io_timeouts(secs(1)), recheck_interval(ms(100)));
    let latch = c.latch("stalled", 2);
    assert_eq!(latch.count().expect("made"), 2);
    let cancel = Cancel::new();
    let waiter = {
        let (latch, cancel) = (latch.clone(), cancel.clone());
        thread::spawn(move || latch.wait_cancellable(&cancel))
    };
    thread::sleep(ms(200));
    srv.pause();
    // A re-check comes within 100 ms, and its read waits for the stalled server.
    thread::sleep(ms(400));
    cancel.cancel();
    let out = join_within(vec![waiter], secs(30), "the cancelled wait").pop();
    srv.resume();
    assert!(
        matches!(out, Some(Err(redbaton::Error::Cancelled))),
        "{out:?}"
    );
}

/// A latch waited on whose key is deleted by hand ends the wait, at the waiter's next
/// re-check, with `LatchExpired` (nobody will count that latch down), not at its deadline;
/// one whose key is replaced by a hash ends it with `WrongKind`, the hash left as it is.
#[test]
fn a_waiter_whose_key_is_deleted_or_replaced_is_told_at_its_recheck() {
    init_log();
    let srv = RedisServer::start();
    let c = lock_client!(node(srv.url()), recheck_interval(ms(100)));
    for (name, replace) in [("deleted", false), ("replaced", true)] {
        let latch = c.latch(name, 2);
        assert_eq!(latch.count().expect("made"), 2);
        let waiter = {
            let latch = latch.clone();
            thread::spawn(move || latch.wait_for(secs(60)))
        };
        thread::sleep(ms(200));
        run(&srv, &["DEL", &latch_key(name)]);
        if replace {
            run(&srv, &["HSET", &latch_key(name), "f", "v"]);
        }
        let out = join_within(vec![waiter], secs(30), "the waiter").pop();
        match out {
            Some(Err(e)) if replace => assert!(e.is_wrong_kind(), "{e:?}"),
            Some(Err(e)) => assert!(e.is_latch_expired(), "{e:?}"),
            other => panic!("{name}: {other:?}"),
        }
    }
    let kind: String = redis::cmd("TYPE")
        .arg(latch_key("replaced"))
        .query(&mut srv.conn())
        .expect("TYPE");
    assert_eq!(kind, "hash");
}

/// Redis Cluster: a latch whose slot is half-way to another master, its key already
/// moved: the count downs that follow `ASK` count once each on the target, and the one
/// that opens it wakes a waiter of another client (which re-checks only every minute)
/// subscribed where the slot still belongs, within a bounded time.
#[test]
fn cluster_count_downs_during_a_migration_count_once_and_wake_the_waiter() {
    init_log();
    let cluster = redbaton_testkit::cluster::Cluster::start();
    let c = lock_client!(cluster(cluster.seed_urls()), io_timeouts(ms(1000)));
    let w = lock_client!(
        cluster(cluster.seed_urls()),
        io_timeouts(ms(1000)),
        patient()
    );
    let key = latch_key("mig");
    let slot = cluster.keyslot(key.as_bytes());
    let from = cluster.owner(slot);
    let latch = c.latch("mig", 3);
    assert_eq!(latch.count_down().expect("count down"), 2);
    let waiter = {
        let latch = w.latch("mig", 3);
        thread::spawn(move || latch.wait_for(secs(50)))
    };
    thread::sleep(ms(300));
    let migration = cluster.open_migration(slot, cluster.other_master(from));
    assert_eq!(migration.migrate_keys(None), 1);
    assert_eq!(latch.count_down().expect("count down on the target"), 1);
    assert_eq!(latch.count_down().expect("count down on the target"), 0);
    let t0 = std::time::Instant::now();
    let out = join_within(vec![waiter], secs(40), "the waiter").pop();
    eprintln!("waiter: {out:?}, {:?} after the count down", t0.elapsed());
    assert!(matches!(out, Some(Ok(()))), "{out:?}");
    migration.finish();
    assert_eq!(latch.count().expect("count"), 0);
}

/// A count down that would open a latch but whose write the server refuses (here the
/// user's ACL lost `set`; `OOM` is the same) did not count: the caller is told, and the
/// latch's waiters are told nothing. No `z` goes out on the latch's channel, which would
/// wake them all to read a latch still closed. (Only what the scripts publish counts: the
/// client's subscriber may still be asking the server, with an `SPUBLISH` of its own,
/// which kind of channel it has.)
#[test]
fn a_refused_count_down_sends_no_false_open() {
    init_log();
    let srv = RedisServer::builder()
        .acl_user("locker", "lockerpw", "~* &* +@all")
        .start();
    let c = lock_client!(node(srv.url_as("locker", "lockerpw").as_str()));
    let latch = c.latch("refused", 1);
    latch
        .wait_for(ms(1))
        .expect_err("closed: created by its first read");
    run(&srv, &["ACL", "SETUSER", "locker", "-set"]);
    let monitor = Monitor::start(&srv);
    // The publishes scripts made since the last call.
    let published = || {
        (monitor.flush(&srv).iter().filter_map(|l| parse_line(l)))
            .filter(|(client, args)| {
                client == "lua" && ["PUBLISH", "SPUBLISH"].contains(&args[0].as_str())
            })
            .count()
    };
    latch.count_down().expect_err("SET refused: not counted");
    assert_eq!(
        published(),
        0,
        "a refused count down announced the latch open"
    );
    run(&srv, &["ACL", "SETUSER", "locker", "+set"]);
    assert_eq!(latch.count_down().expect("count down"), 0);
    assert_eq!(published(), 1);
}
