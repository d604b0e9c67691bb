//! `replica_ack`: an acquisition counts only once enough replicas acknowledged it.

use std::time::{Duration, Instant};

use redbaton::LockClient;
use redbaton_testkit::lock_client;
use redbaton_testkit::monitor::{Monitor, script_calls};
use redbaton_testkit::proxy::Proxy;
use redbaton_testkit::server::RedisServer;
use redbaton_testkit::test_server;
use redbaton_testkit::{init_log, ms, secs};

fn with_replica() -> (RedisServer, RedisServer) {
    let master = RedisServer::start();
    let replica = master.start_replica();
    (master, replica)
}

#[test]
fn smoke() {
    init_log();
    let (master, replica) = with_replica();
    let client = lock_client!(node(master.url()), replica_ack(1, ms(500)));
    let guard = client.lock("k").expect("acknowledged lock");
    // The replica has it: it was acknowledged before the guard was returned.
    let on_replica: bool = redis::cmd("EXISTS")
        .arg("redbaton:{k}")
        .query(&mut replica.conn())
        .expect("EXISTS");
    assert!(on_replica);
    guard.unlock().expect("unlock");
    // Shared holds are acknowledged too, with the replica there to do it.
    let rw = client.rwlock("rw");
    let sem = client.semaphore("sem", 2);
    drop(rw.read().expect("acknowledged read"));
    drop(rw.write().expect("acknowledged write"));
    drop(sem.acquire().expect("acknowledged permit"));
}

#[test]
fn without_enough_replicas_the_call_fails_with_the_count_and_leaves_nothing() {
    let server = test_server();
    let client = lock_client!(node(server.url()), replica_ack(1, ms(50)));
    let e = client.try_lock("k").expect_err("no replica to acknowledge");
    assert!(e.is_replica_ack(), "{e:?}");
    assert!(
        matches!(
            e,
            redbaton::Error::ReplicaAck {
                acked: 0,
                wanted: 1
            }
        ),
        "{e:?}"
    );
    let started = Instant::now();
    let e = client
        .try_lock_for("k", ms(400))
        .expect_err("still no replica");
    assert!(e.is_replica_ack(), "{e:?}");
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "kept its deadline"
    );
    // Undone: at once, or by a release sent without waiting when the deadline had passed.
    redbaton_testkit::wait::wait_for(Duration::from_secs(5), "the undo", || {
        server.keys("redbaton:{k}").is_empty()
    });
}

#[test]
fn a_paused_replica_makes_acquisitions_fail_until_it_is_back() {
    init_log();
    let (master, replica) = with_replica();
    let client = lock_client!(node(master.url()), replica_ack(1, ms(100)));
    replica.pause();
    let e = client
        .try_lock_for("k", ms(500))
        .expect_err("replica paused");
    assert!(e.is_replica_ack(), "{e:?}");
    replica.resume();
    client
        .try_lock_for("k", Duration::from_secs(10))
        .expect("replica back")
        .unlock()
        .expect("unlock");
}

#[test]
fn a_zero_replica_count_or_a_long_timeout_is_invalid() {
    for (n, t) in [
        (0, ms(100)),
        (1, Duration::ZERO),
        (1, Duration::from_secs(5)),
    ] {
        let e = LockClient::builder()
            .node("redis://127.0.0.1:1/")
            .replica_ack(n, t)
            .build()
            .expect_err("invalid");
        assert!(e.is_invalid_input(), "{n} {t:?}: {e:?}");
    }
}

/// Every kind of shared hold counts only once acknowledged, as a lock does: without a
/// replica a read, a write, an upgradable read and a permit each fail with the count, and
/// leave no hold behind.
#[test]
fn without_enough_replicas_no_shared_hold_is_taken() {
    let server = test_server();
    let client = lock_client!(node(server.url()), replica_ack(1, ms(50)));
    let rw = client.rwlock("rw");
    let sem = client.semaphore("sem", 2);
    let tries: [(&str, &dyn Fn() -> redbaton::Result<()>); 4] = [
        ("read", &|| rw.try_read().map(drop)),
        ("write", &|| rw.try_write().map(drop)),
        ("upgradable read", &|| rw.try_upgradable_read().map(drop)),
        ("permit", &|| sem.try_acquire().map(drop)),
    ];
    for (what, attempt) in tries {
        let e = attempt().expect_err(what);
        assert!(
            matches!(
                e,
                redbaton::Error::ReplicaAck {
                    acked: 0,
                    wanted: 1
                }
            ),
            "{what}: {e:?}"
        );
    }
    redbaton_testkit::wait::wait_for(Duration::from_secs(5), "the undo", || {
        server.zcard("redbaton:{rw}") == 0 && server.zcard("redbaton:{sem}") == 0
    });
}

/// An upgrade takes the write hold, so it counts only once acknowledged too; one that too
/// few replicas acknowledged is given back, and the upgradable read it converted is gone
/// with it: the error says how many acknowledged, and the guard it hands back is lost.
#[test]
fn an_unacknowledged_upgrade_gives_the_hold_back() {
    init_log();
    let (master, replica) = with_replica();
    let client = lock_client!(node(master.url()), replica_ack(1, ms(100)));
    let rw = client.rwlock("rw");
    // Tried again until acknowledged: a replica that has just synced may ack its first
    // write later than the 100 ms allowed (a busy machine).
    let upgradable = rw
        .try_upgradable_read_for(Duration::from_secs(10))
        .expect("acknowledged");
    replica.pause();
    let e = upgradable
        .try_upgrade_for(ms(500))
        .expect_err("replica paused");
    replica.resume();
    assert!(
        matches!(
            e.error(),
            redbaton::Error::ReplicaAck {
                acked: 0,
                wanted: 1
            }
        ),
        "{e:?}"
    );
    let guard = e.into_guard();
    assert!(
        matches!(
            guard.check(),
            Err(redbaton::Error::Lost(redbaton::LostReason::Converted))
        ),
        "{guard:?}"
    );
    assert_eq!(master.zcard("redbaton:{rw}"), 0, "given back");
    // Acknowledged again once the replica is back.
    drop(guard);
    rw.try_write_for(Duration::from_secs(10))
        .expect("replica back")
        .unlock()
        .expect("unlock");
}

/// A contender token (a UUID), or a shared hold's member (a kind letter, then the token).
fn is_token(arg: &str) -> bool {
    let uuid = arg.trim_start_matches(['r', 'w', 'u', 'p']);
    uuid.len() == 36 && uuid.bytes().filter(|&b| b == b'-').count() == 4
}

/// A wait whose acquisitions win without enough replicas gives each back and tries again.
/// A give-back may run late (its reply lost, its bytes delayed): a later attempt with the
/// same token would win a hold that late give-back then deletes, or passes on, under its
/// holder. So once a token's hold is given back, no attempt uses that token again: every
/// script call after the first that is not an acquisition (a give-back, a leave) retires
/// its token. For the fair lock's queue token, a writer's member and a permit's member.
#[test]
fn a_token_given_back_is_never_used_again() {
    let server = test_server();
    let client = lock_client!(node(server.url()), replica_ack(1, ms(50)));
    let monitor = Monitor::start(&server);
    type Wait<'a> = Box<dyn Fn() -> bool + 'a>;
    let waits: [(&str, Wait<'_>); 3] = [
        (
            "lock",
            Box::new(|| client.try_lock_for("k", ms(400)).is_err()),
        ),
        (
            "write",
            Box::new(|| client.rwlock("rw").try_write_for(ms(400)).is_err()),
        ),
        (
            "permit",
            Box::new(|| client.semaphore("sem", 1).try_acquire_for(ms(400)).is_err()),
        ),
    ];
    for (what, wait) in &waits {
        assert!(wait(), "{what}: no replica acknowledges");
    }
    let lines = monitor.flush(&server);
    // Per lock key: the script that acquires (the first one called), and per token what
    // happened last, so that an acquisition after a give-back is seen.
    let mut acquire_sha: std::collections::HashMap<&str, &str> = Default::default();
    let mut given_back: std::collections::HashSet<&str> = Default::default();
    let mut attempts = 0;
    let calls = script_calls(&lines);
    for call in &calls {
        let (Some(key), Some(token)) = (call.keys.first(), call.argv.iter().find(|a| is_token(a)))
        else {
            continue;
        };
        let token = token.trim_start_matches(['r', 'w', 'u', 'p']);
        if *acquire_sha.entry(key.as_str()).or_insert(call.sha.as_str()) == call.sha {
            attempts += 1;
            assert!(
                !given_back.contains(token),
                "an attempt with token {token} after its hold was given back"
            );
        } else {
            given_back.insert(token);
        }
    }
    assert!(
        attempts >= 6 && given_back.len() >= 3,
        "{attempts} attempts, {given_back:?}"
    );
}

/// A hold taken without enough replicas whose give-back is lost on its way: it is left to
/// the cleanup thread, which gives it back soon, not left in Redis for its whole lease.
#[test]
fn an_unacknowledged_hold_whose_give_back_is_lost_is_given_back_later() {
    init_log();
    let server = test_server();
    let proxy = Proxy::start(server.addr());
    let client = lock_client!(
        node(proxy.url()),
        replica_ack(1, ms(100)),
        read_timeout(secs(1))
    );
    // The lease key is in the releases (and the leave), not in the acquisition.
    let took = proxy.refusing_requests_matching(b"{k}:lease", || client.try_lock_for("k", secs(2)));
    assert!(took.is_err_and(|e| e.is_replica_ack()));
    let other = lock_client!(node(server.url()));
    let again = other
        .try_lock_for("k", secs(5))
        .expect("the name free again");
    assert!(again.unlock().expect("unlock").was_held());
}
