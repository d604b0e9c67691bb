//! The cleanup thread's looks again where a route has several nodes or rides a failover,
//! against real redis-servers behind fault-injecting proxies: an attempt held back on its
//! way lands after the hold it was for was released, on a Redlock node whose reply was
//! lost while the others granted, or behind Sentinel after the contest rode through the
//! timeouts with the same token; and a node that cannot be reached keeps the cleanup
//! thread from no look again on the others. (`cleanup_faults.rs` shows one node.)
//!
//! Times are liveness bounds, never speed claims.

use std::thread;

use redbaton::{Builder, Error, LockClient};
use redbaton_testkit::keys::Keys;
use redbaton_testkit::proxy::Proxy;
use redbaton_testkit::server::{self, RedisServer};
use redbaton_testkit::wait::wait_for;
use redbaton_testkit::{init_log, lock_builder, lock_client, ms, secs, sentinel};

const PREFIX: &str = "cleanup-routes:";
const KEYS: Keys = Keys::new(PREFIX);

/// The token that holds the lock `name` on `srv`, if any.
fn token_on(srv: &RedisServer, name: &str) -> Option<String> {
    redis::cmd("GET")
        .arg(KEYS.lock(name))
        .query(&mut srv.conn())
        .expect("GET the lock key")
}

/// Three servers, a proxy in front of each, and a Redlock client through the proxies
/// whose calls give up after 1 s.
fn redlock() -> (Vec<RedisServer>, Vec<Proxy>, LockClient) {
    init_log();
    let servers = server::start_many(3);
    let proxies: Vec<Proxy> = servers.iter().map(|s| Proxy::start(s.addr())).collect();
    let urls: Vec<String> = proxies.iter().map(Proxy::url).collect();
    let late = lock_client!(nodes(urls), key_prefix(PREFIX), io_timeouts(secs(1)));
    drop(late.lock("warm-up").expect("warm-up"));
    (servers, proxies, late)
}

/// A Redlock lock is taken and released through the proxies.
#[test]
fn smoke() {
    let (servers, _proxies, late) = redlock();
    assert!(
        late.lock("k")
            .expect("lock")
            .unlock()
            .expect("unlock")
            .was_held()
    );
    assert!(servers.iter().all(|s| token_on(s, "k").is_none()));
}

/// Redlock: node 2's attempt is held back 4 s on its way; nodes 0 and 1 grant, and the
/// round is won with node 2's reply lost. Released at once, the first send on node 2
/// lands after the release and takes node 2 with the released token: the release is
/// looked at again there, or the name would keep one node less for a lease.
#[test]
fn a_redlock_win_with_a_reply_lost_is_looked_at_again_after_its_release() {
    let (servers, proxies, late) = redlock();
    proxies[2].set_delay_both(secs(4));
    let guard = late
        .try_lock_for("k", secs(3))
        .expect("nodes 0 and 1 grant");
    proxies[2].set_delay_both(ms(0));
    assert!(guard.unlock().expect("unlock").was_held());
    wait_for(secs(6), "node 2's first send landed", || {
        token_on(&servers[2], "k").is_some()
    });
    wait_for(secs(6), "given back on node 2", || {
        token_on(&servers[2], "k").is_none()
    });
}

/// Redlock: a give-back on node 0, which a black hole swallows, fails for the network and
/// is tried again while it could matter; meanwhile a refused attempt on `k` whose reply
/// from node 1 was lost (held back 4 s) is given back and looked at again there. The
/// owner of `k` lets go, and the first send lands on node 1 and takes it: the look again
/// runs all the same, and gives it back.
#[test]
fn a_node_that_cannot_be_reached_keeps_no_look_again_from_running() {
    let (servers, proxies, late) = redlock();
    let direct: Vec<String> = servers.iter().map(RedisServer::url).collect();
    let owner = lock_client!(nodes(direct), key_prefix(PREFIX));
    let (held_a, held_k) = (owner.lock("a").expect("a"), owner.lock("k").expect("k"));
    proxies[0].blackhole(true);
    late.try_lock("a").map(drop).expect_err("a is held");
    proxies[1].set_delay_both(secs(4));
    thread::scope(|s| {
        s.spawn(|| {
            thread::sleep(ms(500));
            proxies[1].set_delay_both(ms(0));
        });
        late.try_lock("k").map(drop).expect_err("k is held");
    });
    assert!(held_k.unlock().expect("unlock k").was_held());
    wait_for(secs(6), "node 1's first send landed", || {
        token_on(&servers[1], "k").is_some()
    });
    wait_for(secs(8), "given back on node 1", || {
        token_on(&servers[1], "k").is_none()
    });
    drop(held_a);
}

/// A master, a proxy in front of it, a sentinel watching it through the proxy (and slow to
/// call it down), and a client of `name` through the sentinel whose calls give up after
/// 1 s, its settings changed by `more`.
fn behind_sentinel(
    name: &str,
    more: impl FnOnce(Builder) -> Builder,
) -> (RedisServer, Proxy, RedisServer, LockClient) {
    init_log();
    let master = RedisServer::start();
    let proxy = Proxy::start(master.addr());
    let patient = format!("down-after-milliseconds {name} 60000");
    let watching = sentinel::watching(name, proxy.port(), &[&patient]);
    let b = lock_builder!(
        sentinel(name, vec![watching.url()]),
        key_prefix(PREFIX),
        io_timeouts(secs(1))
    );
    let c = more(b).build().expect("a client");
    (master, proxy, watching, c)
}

/// Behind Sentinel, the master reached through a proxy: an attempt's sends (the node's own
/// retries after lost replies) are all held back 8 s and time out; the contest rides
/// through with the same token, and its next round wins (`owner`: after finding the lock
/// held by another until 4 s). Released at once, the sends held back land after that, on
/// the free lock: the release is looked at again, as a win by a retry's is. A lock, or
/// (`multi`) a multi-lock of the one name.
fn ridden(fair: bool, owner: bool, multi: bool) {
    let name = format!("cleanup-ride-{fair}-{owner}-{multi}");
    let (master, proxy, _watching, c) = behind_sentinel(&name, |b| b.fair(fair));
    drop(c.lock("warm-up").expect("warm-up"));
    let key = KEYS.lock("k");
    let set = |value: Option<&str>| {
        let mut cmd = redis::cmd(if value.is_some() { "SET" } else { "DEL" });
        cmd.arg(&key);
        if let Some(value) = value {
            cmd.arg(value).arg("PX").arg(60_000);
        }
        cmd.query::<()>(&mut master.conn()).expect("SET or DEL")
    };
    if owner {
        set(Some("owner"));
    }
    proxy.set_delay_both(secs(8));
    thread::scope(|s| {
        s.spawn(|| {
            thread::sleep(ms(2500));
            proxy.set_delay_both(ms(0));
            if owner {
                thread::sleep(ms(1500));
                set(None);
            }
        });
        let unlocked = match multi {
            true => c
                .try_multi_lock_for(["k"], secs(6))
                .and_then(|g| g.unlock()),
            false => c.try_lock_for("k", secs(6)).and_then(|g| g.unlock()),
        };
        assert!(unlocked.expect("the ride's round wins").was_held());
    });
    let held = || token_on(&master, "k").is_some();
    wait_for(secs(10), "a send held back landed", held);
    wait_for(secs(6), "given back", || !held());
}

#[test]
fn a_win_after_a_ride_with_the_same_token_is_looked_at_again() {
    ridden(false, false, false);
    ridden(false, true, false);
    ridden(true, true, false);
    ridden(false, false, true);
}

/// As [`ridden`], fair, asking a replica acknowledgement the master (which has none) never
/// gives: the round after the ride takes the lock with the ridden token, unacknowledged,
/// and gives it back (its token retired). The sends of the rounds before it, held back,
/// land after that, with the ridden token: they are given back all the same.
#[test]
fn a_ride_ended_by_an_unacknowledged_round_is_looked_at_again() {
    let (master, proxy, _watching, c) =
        behind_sentinel("cleanup-ride-unacked", |b| b.replica_ack(1, ms(100)));
    let warm_up = c.try_lock("warm-up").map(drop).expect_err("no replica");
    assert!(matches!(warm_up, Error::ReplicaAck { .. }), "{warm_up:?}");
    proxy.set_delay_both(secs(8));
    thread::scope(|s| {
        s.spawn(|| {
            thread::sleep(ms(1500));
            proxy.set_delay_both(ms(0));
        });
        let e = c
            .try_lock_for("k", secs(7))
            .map(drop)
            .expect_err("no replica");
        assert!(matches!(e, Error::ReplicaAck { .. }), "{e:?}");
    });
    // Every send held back (the latest about 9.5 s from the start) has landed by now.
    thread::sleep(secs(4));
    let direct = lock_client!(node(master.url()), key_prefix(PREFIX));
    let got = direct.try_lock_for("k", secs(6));
    assert!(got.is_ok(), "{:?}", got.err());
}
