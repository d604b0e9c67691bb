//! Edges of the read-to-write upgrade of a read-write lock, against a real redis-server:
//! an upgrade that ran in Redis but whose write hold the client refuses (its fence past
//! the largest a fencing token carries) leaves a guard that says lost, never one that
//! goes on claiming the upgradable read the script replaced; an upgrade waiting behind a
//! reader whose process went silent gets the write hold when that reader's lease ends,
//! with no release or re-check to wake it. And the cleanup job: a
//! give-back it still tries when the client shuts down is given up and counted as
//! dropped (its key expires with its lease), never silently.
//!
//! Times are liveness bounds, never speed claims.

use std::thread;

use redbaton::{Error, HoldKind, LockClient, LostReason};
use redbaton_testkit::proxy::Proxy;
use redbaton_testkit::wait::wait_for;
use redbaton_testkit::{lock_client, ms, secs, test_server, test_server_and};

const PREFIX: &str = "ue:";

/// The largest fence a fencing token carries (52 bits: Lua numbers are exact to 2^53).
const LAST_FENCE: u64 = (1 << 52) - 1;

fn client(url: &str) -> LockClient {
    lock_client!(node(url), key_prefix(PREFIX))
}

fn fence_key(name: &str) -> String {
    format!("{PREFIX}{{{name}}}:fence")
}

#[test]
fn smoke() {
    let (srv, c) = test_server_and(client);
    let u = c
        .rwlock("smoke")
        .upgradable_read()
        .expect("upgradable read");
    let w = u.upgrade().expect("upgrade");
    w.check().expect("held");
    drop(w);
    let left = srv.keys_but_fences(&format!("{PREFIX}*"));
    assert!(left.is_empty(), "only fence counters left: {left:?}");
}

/// The name's fence counter stands at the last fence a token carries: the upgradable
/// read gets it, and the upgrade's script issues the next one while it turns the
/// upgradable read into the write hold. The client refuses a hold of that fence and gives
/// the write hold back: the upgradable read is gone from Redis with it, so the guard
/// handed back must say so (lost, converted), not that it still holds.
#[test]
fn an_upgrade_refused_for_its_fence_leaves_no_upgradable_read_believed() {
    let srv = test_server();
    let c = client(&srv.url());
    let _: () = redis::cmd("SET")
        .arg(fence_key("spent"))
        .arg(LAST_FENCE)
        .query(&mut srv.conn())
        .expect("set the counter");
    let u = c
        .rwlock("spent")
        .upgradable_read()
        .expect("upgradable read");
    let refused = u
        .try_upgrade()
        .expect_err("no fence left for the write hold");
    assert!(
        matches!(refused.error(), Error::Protocol(_)),
        "{:?}",
        refused.error()
    );
    let guard = refused.into_guard();
    let info = c.inspect("spent").expect("inspect");
    let upgradable = info.holds.iter().any(|h| h.kind == HoldKind::Upgradable);
    match guard.check() {
        Err(Error::Lost(LostReason::Converted)) => {}
        check => panic!(
            "the guard says {check:?} while Redis holds the upgradable read: {upgradable} \
             ({:?})",
            info.holds
        ),
    }
    assert!(!upgradable, "{:?}", info.holds);
}

/// An acquisition whose reply is lost in a partition leaves its give-back to the cleanup
/// job, which cannot reach Redis either and keeps it to try again. The client shuts down
/// meanwhile: the give-back is given up, and the key expires with its lease; that is what
/// `cleanup_dropped` counts.
#[test]
fn a_give_back_given_up_at_shutdown_is_counted_as_dropped() {
    let srv = test_server();
    let proxy = Proxy::start(srv.addr());
    // Its calls give up soon in the partition; what they may have taken lives long.
    let c = lock_client!(node(proxy.url()), io_timeouts(ms(200)), lease(secs(10)));
    // The script is loaded: the attempt in the partition is the lock's own.
    drop(c.lock("warm").expect("warm-up"));
    proxy.blackhole(true);
    let e = c.try_lock("cut").expect_err("no reply in the partition");
    assert!(e.is_connection(), "{e:?}");
    // The job's first try fails too, and it waits to be tried again.
    wait_for(secs(20), "the cleanup job tried", || {
        proxy.connections_accepted() > 1
    });
    thread::sleep(ms(600));
    let dropped = c.stats().cleanup_dropped;
    c.clone().shutdown(secs(20)).expect("shutdown");
    proxy.heal();
    assert_eq!(
        c.stats().cleanup_dropped,
        dropped + 1,
        "the give-back left to the lease at shutdown"
    );
}

/// A reader of another process (lease 1 s) goes silent: the link to Redis is a black hole,
/// so it neither renews nor releases. An upgrade that waits for it, of a client whose
/// re-checks come after a minute, is woken when that reader's lease ends (the hint its
/// attempt read), and nobody else holds then.
#[test]
fn an_upgrade_behind_a_reader_that_went_silent_gets_in_when_its_lease_ends() {
    let srv = test_server();
    let proxy = Proxy::start(srv.addr());
    let silent = lock_client!(node(proxy.url()), key_prefix(PREFIX), lease(secs(1)));
    let upgrader = lock_client!(node(srv.url()), key_prefix(PREFIX), patient());
    let r = silent.rwlock("silent").read().expect("read");
    let u = (upgrader.rwlock("silent").upgradable_read()).expect("upgradable read");
    proxy.blackhole(true);
    let w = u
        .try_upgrade_for(secs(20))
        .map_err(|e| e.into_parts().1)
        .expect("the reader's lease ends long before the deadline");
    w.check().expect("held");
    let info = upgrader.inspect("silent").expect("inspect");
    let holds: Vec<_> = info.holds.iter().map(|h| (h.kind, h.mine)).collect();
    assert_eq!(holds, [(HoldKind::Write, true)]);
    drop(w);
    proxy.heal();
    drop(r);
}
