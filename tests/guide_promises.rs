//! Promises of the user guide (`docs/guide.md`) that users rely on, each checked against
//! real redis-servers: what an upgrade whose reply was lost leaves its guard saying (lost
//! when unanswered, the write hold when the reply was lost with its connection); that the
//! guide's ACL rules let every primitive work, `inspect` and `locks` included, and that a
//! Sentinel master's user needs `+role` beside them; that `replica_ack` works on Redis
//! Cluster, every master waiting for its own replicas; how a multi-lock counts in `Stats`;
//! and that `build()` adds keyspace-notification classes without dropping others.
//!
//! Times are liveness bounds, never speed claims.

use std::thread;

use redbaton::{Error, HoldKind, LockClient, LostReason, UpgradableReadGuard};

use redbaton_testkit::cluster::Cluster;
use redbaton_testkit::keys::Keys;
use redbaton_testkit::proxy::Proxy;
use redbaton_testkit::server::RedisServer;
use redbaton_testkit::wait::wait_for;
use redbaton_testkit::{lock_builder, lock_client, ms, secs, test_server_and};

const PREFIX: &str = "guide:";

fn client(url: &str) -> LockClient {
    lock_client!(node(url), key_prefix(PREFIX))
}

/// The upgradable read of `name`, by a client whose scripts the server knows already: its
/// upgrade is then one `EVALSHA`.
fn warmed_upgradable_read(c: &LockClient, name: &str) -> UpgradableReadGuard {
    drop(
        c.rwlock("warm")
            .upgradable_read()
            .unwrap()
            .upgrade()
            .unwrap(),
    );
    c.rwlock(name).upgradable_read().expect("upgradable read")
}

#[test]
fn smoke() {
    let (_srv, c) = test_server_and(client);
    let w = c.rwlock("smoke").upgradable_read().unwrap().upgrade();
    w.expect("upgrade").check().expect("held");
}

/// "An upgrade that went unanswered (a connection error …) may have run: the write hold it
/// may have made is given back, and the guard comes back lost (`LostReason::Converted`;
/// the error is the connection error …)".
#[test]
fn an_unanswered_upgrade_gives_its_guard_back_lost_as_converted() {
    let (srv, observer) = test_server_and(client);
    let proxy = Proxy::start(srv.addr());
    let c = lock_client!(node(proxy.url()), key_prefix(PREFIX), io_timeouts(ms(500)));
    let u = warmed_upgradable_read(&c, "cut");
    proxy.blackhole(true);
    let refused = u.try_upgrade();
    proxy.heal();
    let refused = refused.expect_err("no reply came");
    let (guard, error) = refused.into_parts();
    assert!(error.is_connection(), "{error:?}");
    assert!(
        matches!(guard.check(), Err(Error::Lost(LostReason::Converted))),
        "the guard says {:?}",
        guard.check()
    );
    // Neither the write hold it may have made nor the upgradable read is left held.
    wait_for(secs(10), "the name given back", || {
        observer.inspect("cut").expect("inspect").holds.is_empty()
    });
    drop(
        observer
            .rwlock("cut")
            .try_write()
            .expect("free for a writer"),
    );
}

/// "A reply lost with its connection is not that: the upgrade is sent again on a new
/// connection and finds its own write hold if the first one ran."
#[test]
fn an_upgrade_whose_reply_was_lost_with_its_connection_finds_its_write_hold() {
    let (srv, observer) = test_server_and(client);
    let proxy = Proxy::start(srv.addr());
    let c = client(&proxy.url());
    let u = warmed_upgradable_read(&c, "eof");
    let read_token = u.fencing_token();
    proxy.drop_next_reply_matching(b"EVALSHA");
    let w = u
        .try_upgrade()
        .expect("the upgrade sent again finds its write hold");
    assert_eq!(
        proxy.replies_dropped(),
        1,
        "the upgrade's first reply was lost"
    );
    w.check().expect("held");
    assert!(w.fencing_token() > read_token);
    let holds = observer.inspect("eof").expect("inspect").holds;
    assert!(
        holds.len() == 1 && holds[0].kind == HoldKind::Write && !holds[0].mine,
        "{holds:?}"
    );
    assert!(
        observer
            .rwlock("eof")
            .try_read()
            .unwrap_err()
            .is_would_block()
    );
}

/// The ACL rules of the guide's `ACL SETUSER locker …` block, as one line.
fn guide_acl_rules() -> String {
    let guide = include_str!("../docs/guide.md");
    let start = guide
        .find("ACL SETUSER locker on >password")
        .expect("the ACL block");
    let block = &guide[start..];
    let block = &block[..block.find("```").expect("the block's end")];
    let rules = block.split_whitespace().skip(5).collect::<Vec<_>>();
    rules.join(" ")
}

/// "On Redis 6.2 and 7, the least a user of the default prefix `redbaton:` needs": every
/// primitive works as that user, not only the plain lock.
#[test]
fn the_guides_acl_rules_let_every_primitive_work() {
    let rules = guide_acl_rules();
    let srv = RedisServer::builder()
        .acl_user("locker", "lockerpw", &rules)
        .start();
    let url = srv.url_as("locker", "lockerpw");
    let a = lock_client!(node(url.as_str()), recheck_interval(secs(2)));
    let b = lock_client!(node(url.as_str()), recheck_interval(secs(2)));
    let mut refused = Vec::new();
    let mut check = |what: &str, r: Result<(), Error>| {
        if let Err(e) = r {
            refused.push(format!("{what}: {e:#?}"));
        }
    };
    // A writer waiting behind a reader is granted the write hold by the reader's release.
    let rw = a.rwlock("rw");
    check(
        "read, then a waiting writer granted",
        rw.read().and_then(|r| {
            thread::scope(|s| {
                let w = s.spawn(|| b.rwlock("rw").try_write_for(secs(5)).map(drop));
                thread::sleep(ms(200));
                let released = r.unlock().map(drop);
                released.and(w.join().unwrap())
            })
        }),
    );
    check(
        "upgradable read and upgrade",
        rw.upgradable_read().and_then(|u| u.upgrade()).map(drop),
    );
    // A permit seeker waiting behind the only permit is granted it by the release.
    check(
        "a waiting permit seeker granted",
        a.semaphore("sem", 1).acquire().and_then(|p| {
            thread::scope(|s| {
                let w = s.spawn(|| b.semaphore("sem", 1).try_acquire_for(secs(5)).map(drop));
                thread::sleep(ms(200));
                let released = p.unlock().map(drop);
                released.and(w.join().unwrap())
            })
        }),
    );
    let latch = a.latch("latch", 1);
    check("latch", latch.count_down().and_then(|_| latch.wait()));
    check("multi-lock", a.multi_lock(["m1", "m2"]).map(drop));
    let held = a.lock("held").expect("lock");
    check("inspect", a.inspect("held").map(drop));
    check(
        "locks",
        a.locks("*").collect::<Result<Vec<_>, _>>().map(drop),
    );
    drop(held);
    // A command refused inside a script fails a call whose error may go unseen (a guard's
    // drop): the server's count of refused commands tells. Sharded pub/sub and CONFIG are
    // optional (Redis 6.2 counts CONFIG without its subcommand).
    let optional = [
        "spublish",
        "ssubscribe",
        "sunsubscribe",
        "config",
        "config|get",
        "config|set",
    ];
    refused.extend(
        rejected_commands(&srv)
            .into_iter()
            .filter(|c| !optional.contains(&c.as_str())),
    );
    assert!(
        refused.is_empty(),
        "refused under the guide's ACL ({rules}): {refused:#?}"
    );
}

/// The commands the server refused at least once (`rejected_calls` of `INFO commandstats`).
fn rejected_commands(srv: &RedisServer) -> Vec<String> {
    let info = srv.info("commandstats");
    let rejected = |line: &str| {
        let (name, fields) = line.trim().strip_prefix("cmdstat_")?.split_once(':')?;
        let n: u64 = fields
            .split(',')
            .find_map(|f| f.strip_prefix("rejected_calls="))?
            .parse()
            .ok()?;
        (n > 0).then(|| name.to_owned())
    };
    info.lines().filter_map(rejected).collect()
}

/// "`replica_ack(n, timeout)` runs `WAIT n timeout` after every acquisition and renewal …
/// Every kind of hold counts as an acquisition": on Redis Cluster too, each master waiting
/// for its own replicas; one more replica than a master has is `Error::ReplicaAck`.
#[test]
fn replica_ack_works_on_a_cluster() {
    let cluster = Cluster::start();
    let c = lock_client!(cluster(cluster.seed_urls()), replica_ack(1, ms(500)));
    // One name on each master.
    let master_of = |n: &str| {
        cluster
            .master_of(&Keys::DEFAULT.lock_bytes(n.as_bytes()))
            .port()
    };
    let mut names: Vec<String> = Vec::new();
    for n in (0..).map(|i| format!("ack{i}")) {
        if !names.iter().any(|m| master_of(m) == master_of(&n)) {
            names.push(n);
        }
        if names.len() == 3 {
            break;
        }
    }
    for name in &names {
        let g = c.lock(name).expect("an acknowledged lock");
        // Acknowledged before the guard came back: the master's replica has it.
        let mut replica = cluster.replica_of(master_of(name)).conn();
        redis::cmd("READONLY").exec(&mut replica).expect("READONLY");
        assert!(redbaton_testkit::exists(
            &mut replica,
            Keys::DEFAULT.lock(name)
        ));
        g.extend(secs(20)).expect("an acknowledged extend");
        drop(g);
    }
    drop(
        c.rwlock(&names[0])
            .write()
            .expect("an acknowledged write hold"),
    );
    drop(
        c.semaphore(&names[1], 2)
            .acquire()
            .expect("an acknowledged permit"),
    );
    drop(c.multi_lock(&names).expect("an acknowledged multi-lock"));
    let greedy = lock_client!(cluster(cluster.seed_urls()), replica_ack(2, ms(100)));
    let e = greedy
        .try_lock_for(&names[2], ms(300))
        .expect_err("one replica per master");
    assert!(
        matches!(
            e,
            Error::ReplicaAck {
                acked: 1,
                wanted: 2
            }
        ),
        "{e:?}"
    );
}

/// "Behind Sentinel, the master's user needs `+role` (the client checks that the server the
/// sentinels name is the master)": with the guide's rules and `+role` a client locks;
/// without `+role` it finds no master.
#[test]
fn behind_sentinel_the_masters_user_needs_role() {
    let rules = guide_acl_rules();
    let master = RedisServer::builder()
        .acl_user("locker", "lockerpw", &rules)
        .acl_user("roler", "rolerpw", &format!("{rules} +role"))
        .start();
    let sentinel = RedisServer::builder()
        .sentinel()
        .config(
            "sentinel",
            &format!("monitor guide 127.0.0.1 {} 1", master.port()),
        )
        .start();
    let through = |user: &str, password: &str| {
        lock_builder!(
            sentinel("guide", [sentinel.url()]),
            sentinel_master_auth(Some(user), password),
            io_timeouts(ms(500))
        )
        .build()
    };
    let c = through("roler", "rolerpw").expect("a client of the master");
    c.lock("role").expect("lock").unlock().expect("unlock");
    let e = through("locker", "lockerpw").expect_err("no ROLE, no master");
    let why = format!("{e:?}").to_lowercase();
    assert!(why.contains("role") && why.contains("perm"), "{why}");
}

/// "`kind` is `lock` (plain and fair locks, and multi-locks: one wait and one hold per
/// guard, one remote acquisition per name)".
#[test]
fn a_multi_lock_counts_one_wait_one_hold_and_an_acquisition_per_name() {
    let (_srv, c) = test_server_and(client);
    c.multi_lock(["m1", "m2", "m3"])
        .expect("multi-lock")
        .unlock()
        .expect("unlock");
    let s = c.stats();
    assert_eq!(s.remote_acquisitions, 3, "{s:?}");
    assert_eq!((s.remote_wait.count, s.remote_hold.count), (1, 1), "{s:?}");
}

/// "The client adds what is missing when `CONFIG SET` is allowed (`configure_notifications`,
/// merging, never replacing)": classes another application asked for stay on.
#[test]
fn notification_classes_are_added_never_replaced() {
    let srv = RedisServer::builder()
        .config("notify-keyspace-events", "Elh")
        .start();
    drop(client(&srv.url()));
    let flags = srv.config_get("notify-keyspace-events");
    for class in ['E', 'l', 'h', 'K', 'g', '$', 'x', 'e'] {
        assert!(flags.contains(class), "class {class} in {flags:?}");
    }
}
