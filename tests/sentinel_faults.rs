//! A Sentinel-managed master under faults: a master replaced without the client hearing
//! of it (no `+switch-master` reaches it), sentinels that are down, stalled or know
//! nothing of the master, and the bounds of every call meanwhile. Each test has one
//! sentinel of its own that never fails a master over by itself: the switch is made by
//! hand (the replica promoted, the old master made its replica, the sentinel told to
//! watch the new one), which no message announces.

use std::time::Instant;

use redbaton_testkit::keys::Keys;
use redbaton_testkit::proxy::Proxy;
use redbaton_testkit::server::RedisServer;
use redbaton_testkit::{init_log, lock_builder, lock_client, ms, secs};

const NAME: &str = "faults";
/// The lease of the locks held across a switch: renewals every few hundred ms.
const LEASE: std::time::Duration = std::time::Duration::from_secs(2);

/// A sentinel that names the server at `port` the master of [`NAME`], and never fails it
/// over within a test (it takes a minute to call a master down).
fn sentinel_of(port: u16) -> RedisServer {
    RedisServer::builder()
        .sentinel()
        .config("sentinel", &format!("monitor {NAME} 127.0.0.1 {port} 1"))
        .config("sentinel", &format!("down-after-milliseconds {NAME} 60000"))
        .start()
}

/// Two masters of their own, `a` and `b`, a sentinel naming `a`, and a client through it
/// ([`client_of`]) that has locked once on `a` (its pool has a connection there).
fn on_first_of_two() -> (RedisServer, RedisServer, RedisServer, redbaton::LockClient) {
    init_log();
    let (a, b) = (RedisServer::start(), RedisServer::start());
    let s = sentinel_of(a.port());
    let c = client_of(&s);
    drop(c.lock("warm").expect("lock on the first master"));
    (a, b, s, c)
}

/// A client through `sentinel` alone, with short timeouts and lease [`LEASE`].
fn client_of(sentinel: &RedisServer) -> redbaton::LockClient {
    lock_client!(
        sentinel(NAME, vec![sentinel.url()]),
        io_timeouts(ms(500)),
        lease(LEASE),
        fair(false)
    )
}

/// Sends `SENTINEL <words>` to `sentinel`.
fn tell(sentinel: &RedisServer, words: &[&str]) {
    let () = redis::cmd("SENTINEL")
        .arg(words)
        .query(&mut sentinel.conn())
        .unwrap_or_else(|e| panic!("SENTINEL {words:?}: {e}"));
}

/// Makes `new` the master and `old` its replica, and has `sentinel` name `new`: what a
/// failover leaves, with no `+switch-master` published.
fn silent_switch(sentinel: &RedisServer, old: &RedisServer, new: &RedisServer) {
    let () = redis::cmd("REPLICAOF")
        .arg("NO")
        .arg("ONE")
        .query(&mut new.conn())
        .expect("promote");
    let () = redis::cmd("REPLICAOF")
        .arg("127.0.0.1")
        .arg(new.port())
        .query(&mut old.conn())
        .expect("demote");
    rename_master(sentinel, new);
}

/// Points `sentinel` at `new` as the master of [`NAME`], with no message.
fn rename_master(sentinel: &RedisServer, new: &RedisServer) {
    tell(sentinel, &["REMOVE", NAME]);
    let port = new.port().to_string();
    tell(sentinel, &["MONITOR", NAME, "127.0.0.1", &port, "1"]);
    tell(sentinel, &["SET", NAME, "down-after-milliseconds", "60000"]);
}

#[test]
fn smoke() {
    init_log();
    let m = RedisServer::start();
    let s = sentinel_of(m.port());
    let c = client_of(&s);
    let g = c.lock("k").expect("lock");
    assert!(redbaton_testkit::exists(
        &mut m.conn(),
        Keys::DEFAULT.lock("k")
    ));
    g.unlock().expect("unlock");
}

/// The master was replaced and demoted, and the sentinel names the new one, but no
/// message said so. A wait with a deadline meets the demoted master (`READONLY`): that
/// reply makes the client look at the sentinels again, and the wait goes on against the
/// master they name, taking the lock there within its deadline rather than returning the
/// demoted master's refusal.
#[test]
fn a_wait_follows_a_master_replaced_without_a_message() {
    let (a, b, s, c) = on_first_of_two();
    silent_switch(&s, &a, &b);
    let t0 = Instant::now();
    let got = c.try_lock_for("k", secs(10));
    let took = t0.elapsed();
    let g = match got {
        Ok(g) => g,
        Err(e) => panic!(
            "after {took:?}: {e:?} (failovers seen {})",
            c.stats().failovers
        ),
    };
    assert!(
        redbaton_testkit::exists(&mut b.conn(), Keys::DEFAULT.lock("k")),
        "the lock is on the new master"
    );
    drop(g);
}

/// A master `a` and its replica `b`, a sentinel naming `a`, and a client through it
/// (lease [`LEASE`], one replica acknowledging) that holds `name`.
fn holding_replicated(
    name: &str,
) -> (
    RedisServer,
    RedisServer,
    RedisServer,
    redbaton::LockClient,
    redbaton::LockGuard,
) {
    init_log();
    let a = RedisServer::start();
    let b = a.start_replica();
    let s = sentinel_of(a.port());
    let c = lock_client!(
        sentinel(NAME, vec![s.url()]),
        io_timeouts(ms(500)),
        lease(LEASE),
        replica_ack(1, ms(200)),
        fair(false)
    );
    let g = c
        .try_lock_for(name, secs(10))
        .expect("an acknowledged lock");
    (a, b, s, c, g)
}

/// A held lock that the replica had when it was promoted, with no message saying so:
/// the old master refuses the watchdog's renewals (`READONLY`, wrapped in a script error
/// before Redis 7), the client looks at the sentinels again, and the renewals go on
/// against the new master. The lock lives on: its holder is never told it was lost, and
/// releases it there.
#[test]
fn a_replicated_lock_outlives_a_master_replaced_without_a_message() {
    let (a, b, s, c, g) = holding_replicated("held");
    silent_switch(&s, &a, &b);
    // Two leases: renewals were due several times, each past the old master.
    std::thread::sleep(LEASE * 2);
    assert!(
        !g.is_lost(),
        "the holder was told its lock was lost: {:?} (failovers seen {})",
        g.check(),
        c.stats().failovers
    );
    assert!(redbaton_testkit::exists(
        &mut b.conn(),
        Keys::DEFAULT.lock("held")
    ));
    let outcome = g.unlock().expect("unlock on the new master");
    assert!(outcome.was_held(), "{outcome:?}");
}

/// A held lock the new master never had: renewals on the demoted master are not taken
/// for successes, and once the client follows the sentinels, the new master's answer
/// tells the holder within about a lease, while another client takes the name there.
#[test]
fn a_lock_the_new_master_never_had_is_reported_lost() {
    let (a, b, s, c) = on_first_of_two();
    let g = c.lock("held").expect("lock");
    silent_switch(&s, &a, &b);
    let other = lock_client!(sentinel(NAME, vec![s.url()]), io_timeouts(ms(500)));
    let theirs = other
        .try_lock("held")
        .expect("the name is free on the new master");
    redbaton_testkit::wait::wait_for(secs(10), "the holder told", || g.is_lost());
    let outcome = g.unlock();
    assert!(
        outcome.as_ref().is_ok_and(|o| !o.was_held()) || outcome.is_err(),
        "the first holder's unlock: {outcome:?}"
    );
    assert!(theirs.unlock().expect("unlock").was_held());
}

/// The master died, and the client's commands found it gone while the sentinel still
/// named it. The sentinel then names a new master, and no message reaches the client.
/// A wait that meets only refused connections (nothing is left in the pool) reports
/// them as the faults they are, so the client looks at the sentinels again and the wait
/// takes the lock on the new master within its deadline.
#[test]
fn a_wait_follows_the_replacement_of_a_dead_master() {
    let (a, b, s, c) = on_first_of_two();
    a.kill();
    let e = c.try_lock("probe").expect_err("the master is dead");
    assert!(e.is_connection(), "{e:?}");
    // The client looked at the sentinel, which still names the dead master.
    std::thread::sleep(ms(1000));
    rename_master(&s, &b);
    let got = c.try_lock_for("k", secs(5));
    let failovers = c.stats().failovers;
    let g = got.unwrap_or_else(|e| panic!("{e:?} (failovers seen {failovers})"));
    assert!(redbaton_testkit::exists(
        &mut b.conn(),
        Keys::DEFAULT.lock("k")
    ));
    drop(g);
}

/// Settings that can name no master are typed errors at `build()`, never a hang: no
/// sentinel or no master name (invalid input), sentinels that cannot be reached (a
/// connection error), and a master name no sentinel knows (Redis's
/// `MasterNameNotFoundBySentinel`, not a connection error).
#[test]
fn sentinel_settings_that_name_no_master_are_typed_errors() {
    init_log();
    let none: [&str; 0] = [];
    let e = lock_builder!(sentinel(NAME, none)).build().unwrap_err();
    assert!(e.is_invalid_input(), "no sentinel: {e:?}");
    let e = lock_builder!(sentinel("", ["redis://127.0.0.1:26379/"]))
        .build()
        .unwrap_err();
    assert!(e.is_invalid_input(), "no master name: {e:?}");
    let dead = redbaton_testkit::dead_url();
    let e = lock_builder!(sentinel(NAME, [dead.clone(), dead]), io_timeouts(ms(500)))
        .build()
        .unwrap_err();
    assert!(e.is_connection(), "no sentinel reachable: {e:?}");
    let m = RedisServer::start();
    let s = sentinel_of(m.port());
    let e = lock_builder!(sentinel("unknown", [s.url()]), io_timeouts(ms(500)))
        .build()
        .unwrap_err();
    assert!(
        !e.is_connection()
            && e.redis_error().map(redis::RedisError::kind)
                == Some(redis::ErrorKind::MasterNameNotFoundBySentinel),
        "an unknown master name: {e:?}"
    );
}

/// Every sentinel accepts connections and answers nothing (a partition that drops bytes)
/// just as the watcher looks for the master again, so that it waits out a read timeout
/// per sentinel asked. Dropping the client meanwhile waits for the sentinel it is asking,
/// not for all the others too: the watcher asks none more once the client stops.
#[test]
fn dropping_the_client_does_not_wait_for_every_hung_sentinel() {
    init_log();
    let m = RedisServer::start();
    let s = sentinel_of(m.port());
    let links: Vec<Proxy> = (0..12).map(|_| Proxy::start(s.addr())).collect();
    let io = ms(500);
    let c = lock_client!(
        sentinel(NAME, links.iter().map(Proxy::url).collect::<Vec<_>>()),
        io_timeouts(io)
    );
    drop(c.lock("k").expect("lock"));
    for link in &links {
        link.blackhole(true);
    }
    // The subscription breaks: the watcher asks every sentinel in turn.
    links[0].kill_all();
    std::thread::sleep(ms(300));
    let t0 = Instant::now();
    drop(c);
    let took = t0.elapsed();
    // A connection's set-up and first command may each wait a read timeout: a few of
    // them, against about two per sentinel still to ask.
    assert!(
        took < io * 6,
        "dropping the client took {took:?} ({} sentinels, read timeout {io:?})",
        links.len()
    );
}

/// The connections the client opened to `server`: its pool's and its subscriber's.
fn ours(server: &RedisServer) -> Vec<String> {
    server
        .client_list()
        .into_iter()
        .filter_map(|c| c.get("name").filter(|n| n.starts_with("redbaton")).cloned())
        .collect()
}

/// A waiter waits on the master while the holder's lock is replicated; the master is
/// replaced with no message. The holder's renewals meet the demoted master, the client
/// follows the sentinel, and the waiter's subscription moves with it: the holder's
/// release on the new master wakes the waiter there, and nothing of the client stays
/// connected to the old master, its subscriber included.
#[test]
fn a_waiter_and_its_subscription_move_to_the_new_master() {
    let (a, b, s, c, g) = holding_replicated("w");
    std::thread::scope(|scope| {
        let waiter = scope.spawn(|| c.try_lock_for("w", secs(20)).map(|g| g.fencing_token()));
        redbaton_testkit::wait::wait_for(secs(10), "the waiter subscribed", || {
            !a.subscribers().is_empty()
        });
        silent_switch(&s, &a, &b);
        redbaton_testkit::wait::wait_for(secs(10), "the subscriber on the new master", || {
            !b.subscribers().is_empty()
        });
        let held = g.unlock().expect("unlock on the new master");
        assert!(held.was_held(), "{held:?}");
        waiter
            .join()
            .expect("waiter")
            .expect("the waiter takes the lock on the new master");
    });
    redbaton_testkit::wait::wait_for(secs(10), "no connection left to the old master", || {
        ours(&a).is_empty()
    });
}

/// The master stops answering (its link drops every byte) and the sentinel still names
/// it. A wait rides through until its deadline and no further, and a `lock()` without
/// one gives up after about a lease: neither waits for a master that never comes back.
#[test]
fn calls_on_an_unreachable_master_keep_their_bounds() {
    init_log();
    let m = RedisServer::start();
    let link = Proxy::start(m.addr());
    let s = sentinel_of(link.port());
    let c = client_of(&s);
    drop(c.lock("warm").expect("lock through the link"));
    link.blackhole(true);
    let t0 = Instant::now();
    let e = c.try_lock_for("k", ms(800)).expect_err("nothing answers");
    let took = t0.elapsed();
    assert!(e.is_timeout(), "{e:?}");
    assert!(took < secs(3), "a wait of 800 ms took {took:?}");
    let (tx, rx) = std::sync::mpsc::channel();
    let c2 = c.clone();
    std::thread::spawn(move || tx.send(c2.lock("k").map(drop)));
    let r = rx
        .recv_timeout(LEASE + secs(10))
        .expect("lock() without a deadline still waits");
    assert!(
        r.is_err_and(|e| e.is_connection()),
        "lock() gave up with a connection error"
    );
    link.blackhole(false);
}
