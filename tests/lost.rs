//! `previous_lost()`, against real redis-servers: an acquisition says whether the hold
//! before it ended without a release (a holder killed inside, a key deleted, a forced
//! release), and only then: a release, a fair queue's grant and a local baton pass are
//! clean, and a grant that runs out unconfirmed counts as a loss. The fence counter that carries the
//! news keeps issuing strictly increasing fences whatever it holds: a lost hold, nothing
//! (deleted), an old held value, a value ahead of the clock, a foreign string, or what a
//! restart brings back.

use std::process::Child;
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use redbaton::{Builder, ForceRelease, LockClient, Unlocked};
use redbaton_testkit::keys::{Counter, Keys, fence_of, handoff_of};
use redbaton_testkit::server::RedisServer;
use redbaton_testkit::wait::{join_within, wait_for};
use redbaton_testkit::{child, child_only, lock_builder, ms, secs, test_server, test_server_and};

const PREFIX: &str = "lost:";
const KEYS: Keys = Keys::new(PREFIX);
/// Short, so that a killed holder's hold runs out soon; long enough for the waiters of a
/// test to queue behind it first.
const LEASE: Duration = Duration::from_secs(2);
/// Generous: how long a waiter may take to get a lock whose holder died.
const WAIT: Duration = Duration::from_secs(30);

fn builder(url: &str) -> Builder {
    lock_builder!(node(url), key_prefix(PREFIX), lease(LEASE))
}

fn client(url: &str) -> LockClient {
    builder(url).build().expect("client")
}

fn plain(url: &str) -> LockClient {
    builder(url).fair(false).build().expect("client")
}

/// The name's fence counter as it is.
fn counter(srv: &RedisServer, name: &str) -> Option<Counter> {
    Counter::read(&mut srv.conn(), KEYS.fence(name).as_bytes())
}

/// Runs one Redis command on a connection of `srv`, ignoring its reply.
fn run(srv: &RedisServer, args: &[&str]) {
    let mut cmd = redis::cmd(args[0]);
    for a in &args[1..] {
        cmd.arg(*a);
    }
    let _: redis::Value = cmd.query(&mut srv.conn()).expect("command");
}

#[test]
fn smoke() {
    let (srv, c) = test_server_and(client);
    let first = c.lock("smoke").expect("lock");
    assert!(
        !first.previous_lost(),
        "a name's first hold has nothing before it"
    );
    let held = counter(&srv, "smoke").expect("counter");
    assert!(held.held && !held.after_lost, "{held:?}");
    assert_eq!(held.fence, fence_of(first.fencing_token()));
    assert_eq!(first.unlock().unwrap(), Unlocked::Released);
    let released = counter(&srv, "smoke").expect("counter");
    assert!(!released.held, "{released:?}");
    let second = c.lock("smoke").expect("lock");
    assert!(!second.previous_lost(), "the hold before was released");
    assert!(second.fencing_token() > held.fence << 12);
}

// --- a holder killed inside --------------------------------------------------------

/// Child: takes `LOST_NAME` as `LOST_KIND` says (`lock`, `plain`, `write`), says its
/// token, and holds it until killed.
#[test]
fn child_holds_until_killed() {
    child_only!();
    let url = child::env("REDIS_URL");
    let name = child::env("LOST_NAME");
    let kind = child::env("LOST_KIND");
    let say = |token: u64| child::print_result(&[("token", token.to_string())]);
    match kind.as_str() {
        "lock" | "plain" => {
            let c = builder(&url).fair(kind == "lock").build().expect("client");
            let g = c.lock(&name).expect("lock");
            say(g.fencing_token());
            thread::sleep(secs(120));
        }
        _ => {
            let c = client(&url);
            let w = c.rwlock(&name).write().expect("write");
            say(w.fencing_token());
            thread::sleep(secs(120));
        }
    }
}

/// A child holding `name` as `kind` says, and its token.
fn holder(srv: &RedisServer, name: &str, kind: &str) -> (Child, u64) {
    let mut c = child::spawn_self(
        "child_holds_until_killed",
        &[
            ("REDIS_URL", srv.url()),
            ("LOST_NAME", name.to_owned()),
            ("LOST_KIND", kind.to_owned()),
        ],
    );
    let line = child::wait_for_line(&mut c, "token=", secs(30));
    let token = child::field(&child::result_with(&line, "token"), "token");
    (c, token)
}

/// A holder SIGKILLed inside its critical section: once its lease ran out, the next holder
/// is told, fair queue or not, and its token is higher; the one after it is not told.
#[test]
fn a_holder_killed_inside_is_reported_lost() {
    let srv = test_server();
    for (kind, c) in [("lock", client(&srv.url())), ("plain", plain(&srv.url()))] {
        let name = format!("killed-{kind}");
        let (dead, dead_token) = holder(&srv, &name, kind);
        child::kill_and_reap(dead);
        let g = c.try_lock_for(&name, WAIT).expect("the lease runs out");
        assert!(
            g.previous_lost(),
            "{kind}: the killed holder never released"
        );
        assert!(g.fencing_token() > dead_token, "{kind}");
        let token = g.fencing_token();
        assert_eq!(g.unlock().unwrap(), Unlocked::Released);
        let g = c.lock(&name).expect("lock");
        assert!(!g.previous_lost(), "{kind}: the holder before released");
        assert!(g.fencing_token() > token, "{kind}");
    }
}

/// The same for a read-write lock's write hold; a read hold's release in between changes
/// nothing, and a write hold released says so to the next.
#[test]
fn a_writer_killed_inside_is_reported_lost() {
    let (srv, c) = test_server_and(client);
    let (dead, dead_token) = holder(&srv, "killed-writer", "write");
    child::kill_and_reap(dead);
    let rw = c.rwlock("killed-writer");
    let r = rw.try_read_for(WAIT).expect("the lease runs out");
    assert!(r.fencing_token() > dead_token);
    r.unlock().unwrap();
    let w = rw.try_write_for(WAIT).expect("write");
    assert!(w.previous_lost(), "the killed writer never released");
    assert!(w.fencing_token() > dead_token);
    let token = w.fencing_token();
    assert!(w.unlock().unwrap().was_held());
    let w = rw.write().expect("write");
    assert!(!w.previous_lost(), "the writer before released");
    assert!(w.fencing_token() > token);
}

/// A key deleted by hand ends a hold without a release, as a lease running out does.
#[test]
fn a_deleted_key_is_reported_lost() {
    let srv = test_server();
    let (a, b) = (client(&srv.url()), client(&srv.url()));
    let held = a.lock("deleted").expect("lock");
    run(&srv, &["DEL", &KEYS.lock("deleted")]);
    let g = b.lock("deleted").expect("free");
    assert!(g.previous_lost());
    assert!(g.fencing_token() > held.fencing_token());
    // The first holder's release finds the key taken: it leaves the counter alone.
    assert!(!held.unlock().unwrap().was_held());
    assert!(counter(&srv, "deleted").expect("counter").held);
    drop(g);
    assert!(!b.lock("deleted").expect("lock").previous_lost());
}

/// `force_release` deletes a held lock: the next holder is told its hold was lost.
#[test]
fn force_release_counts_as_lost() {
    let srv = test_server();
    let (a, b) = (client(&srv.url()), client(&srv.url()));
    let stuck = a.lock("forced").expect("lock");
    let fence = b
        .inspect("forced")
        .expect("inspect")
        .holder
        .and_then(|h| h.fence)
        .expect("a holder with a fence");
    assert_eq!(fence, fence_of(stuck.fencing_token()));
    assert_eq!(
        b.force_release("forced", fence).unwrap(),
        ForceRelease::Released { nodes: 1 }
    );
    let g = b.try_lock("forced").expect("free");
    assert!(g.previous_lost());
    assert!(g.fencing_token() > stuck.fencing_token());
    drop(stuck);
    drop(g);
    assert!(!b.lock("forced").expect("lock").previous_lost());
}

// --- clean ends --------------------------------------------------------------------

/// A release, from a guard or a detached guard, of a lock or a write hold: the next
/// holder is not told anything was lost, and a detached guard says what its guard said.
#[test]
fn a_released_hold_is_not_lost() {
    let srv = test_server();
    let c = Arc::new(client(&srv.url()));
    let g = c.lock("released").expect("lock");
    let d = g.detach();
    assert!(!d.previous_lost());
    assert_eq!(
        join_within(vec![thread::spawn(move || d.unlock())], WAIT, "unlock")
            .pop()
            .unwrap()
            .unwrap(),
        Unlocked::Released
    );
    assert!(!c.lock("released").expect("lock").previous_lost());

    let rw = c.rwlock("released-rw");
    let d = rw.write().expect("write").detach();
    assert!(!d.previous_lost());
    assert!(d.unlock().unwrap().was_held());
    let w = rw.write().expect("write");
    assert!(!w.previous_lost());
    drop(w);
    assert!(!counter(&srv, "released-rw").expect("counter").held);
    // A detached guard says what its guard said: true after a loss.
    let lost = a_lost_hold(&srv, &c, "released-lost");
    assert!(lost.previous_lost());
    let d = lost.detach();
    assert!(d.previous_lost());
    drop(d);
    assert!(!c.lock("released-lost").expect("lock").previous_lost());
}

/// `c`'s lock of `name`, taken after another client's hold of it lost its key.
fn a_lost_hold(srv: &RedisServer, c: &LockClient, name: &str) -> redbaton::LockGuard {
    let other = client(&srv.url());
    let gone = other.lock(name).expect("lock");
    run(srv, &["DEL", &KEYS.lock(name)]);
    let g = c.lock(name).expect("free");
    drop(gone);
    g
}

/// A fair release that grants the lock to the waiter at the head of the queue is a clean
/// release: the grantee is not told anything was lost.
#[test]
fn a_fair_grant_is_a_clean_release() {
    let (srv, holder) = test_server_and(client);
    let w = client(&srv.url());
    let g = holder.lock("granted").expect("lock");
    let queued = thread::spawn(move || {
        let g = w.try_lock_for("granted", WAIT).expect("granted");
        (g.previous_lost(), g.fencing_token())
    });
    wait_queued(&srv, "granted", 1);
    let token = g.fencing_token();
    assert_eq!(g.unlock().unwrap(), Unlocked::Released);
    let (lost, got) = join_within(vec![queued], WAIT, "the waiter").remove(0);
    assert!(!lost, "a grant after a release");
    assert!(got > token);
    assert_eq!(holder.stats().grants_passed, 1, "the release granted it");
}

/// Waits until `n` waiters are in the fair queue of `name`.
fn wait_queued(srv: &RedisServer, name: &str, n: u64) {
    let mut conn = srv.conn();
    let queue = format!("{}:q", KEYS.lock(name));
    wait_for(WAIT, "the waiters queued", || {
        redis::cmd("ZCARD")
            .arg(&queue)
            .query::<u64>(&mut conn)
            .unwrap()
            == n
    });
}

/// Two processes queue behind a holder that is killed: the first to get the lock (taking
/// it, or by the grant another waiter's attempt makes on the spot) is told, and the second,
/// granted by the first's release, is not.
#[test]
fn a_loss_reaches_the_first_waiter_only() {
    let srv = test_server();
    let (dead, dead_token) = holder(&srv, "queued", "lock");
    let waiters: Vec<_> = (0..2u64)
        .map(|i| {
            let url = srv.url();
            let t = thread::spawn(move || {
                let c = client(&url);
                let g = c.try_lock_for("queued", WAIT).expect("the lease runs out");
                (g.fencing_token(), g.previous_lost())
            });
            wait_queued(&srv, "queued", i + 1);
            t
        })
        .collect();
    child::kill_and_reap(dead);
    let mut got = join_within(waiters, WAIT, "the waiters");
    got.sort_unstable();
    assert!(got[0].0 > dead_token);
    assert_eq!(
        got.iter().map(|g| g.1).collect::<Vec<_>>(),
        [true, false],
        "{got:?}"
    );
}

/// Child: queues for `LOST_NAME` and waits (it is killed while it does).
#[test]
fn child_queues() {
    child_only!();
    let c = client(&child::env("REDIS_URL"));
    let _ = c.try_lock_for(child::env("LOST_NAME"), secs(120));
}

/// A grant to a waiter that died in the queue: a grantee may hold the lock from the grant
/// message alone, with no further call, so Redis cannot tell a grant nobody heard from a
/// grantee that died holding it. When the grant lease runs out, the next waiter is told
/// of a loss (erring on the side of caution).
#[test]
fn a_grant_that_expires_unconfirmed_is_a_loss() {
    let (srv, holder) = test_server_and(client);
    let g = holder.lock("dead-grantee").expect("lock");
    let mut dead = child::spawn_self(
        "child_queues",
        &[
            ("REDIS_URL", srv.url()),
            ("LOST_NAME", "dead-grantee".to_owned()),
        ],
    );
    wait_queued(&srv, "dead-grantee", 1);
    let url = srv.url();
    let next = thread::spawn(move || {
        let c = client(&url);
        let g = c
            .try_lock_for("dead-grantee", WAIT)
            .expect("after the grant lease");
        (g.previous_lost(), g.fencing_token())
    });
    wait_queued(&srv, "dead-grantee", 2);
    child::kill_child(&mut dead, libc::SIGKILL);
    let _ = child::wait_output(dead, secs(10));
    let token = g.fencing_token();
    assert_eq!(g.unlock().unwrap(), Unlocked::Released);
    let (lost, got) = join_within(vec![next], WAIT, "the next waiter").remove(0);
    assert!(
        lost,
        "the dead waiter's grant ran out: it may have been held"
    );
    assert!(got > token);
}

/// A local baton pass hands the remote hold on cleanly: the thread that took it from
/// Redis after a loss is told, the thread it passes it to is not.
#[test]
fn a_local_baton_pass_is_clean() {
    let srv = test_server();
    let c = Arc::new(client(&srv.url()));
    // A waiter that queues too late finds the lock released in Redis: try again, each
    // time giving it longer to queue.
    for round in 1..=20 {
        let first = a_lost_hold(&srv, &c, "baton");
        assert!(first.previous_lost(), "round {round}");
        let c2 = c.clone();
        let second = thread::spawn(move || {
            let g = c2.lock("baton").expect("lock");
            (g.previous_lost(), g.fencing_token())
        });
        thread::sleep(ms(50 * round));
        let outcome = first.unlock().unwrap();
        let (lost, token) = join_within(vec![second], WAIT, "the second thread").remove(0);
        if outcome == Unlocked::HandedOff {
            assert!(handoff_of(token) > 0, "passed locally: {token:#x}");
            assert!(!lost, "a baton pass is a clean release");
            return;
        }
        eprintln!("round {round}: released in Redis before the second thread queued");
    }
    panic!("the second thread never queued behind the first");
}

// --- fences across odd counters ------------------------------------------------------

/// Tokens strictly increase across a lost hold, a counter deleted while held (the
/// release does not bring it back), an old held value, a foreign string and a counter
/// ahead of the clock; the news of a loss follows what the counter says.
#[test]
fn fences_increase_whatever_the_counter_holds() {
    let srv = test_server();
    for (fair, c) in [(true, client(&srv.url())), (false, plain(&srv.url()))] {
        let name = format!("odd-{fair}");
        let fence_key = KEYS.fence(&name);
        let mut seq = Sequence {
            c: &c,
            name: &name,
            last: 0,
        };
        drop(seq.next(false, "first"));
        // A lost hold.
        let g = seq.next(false, "released before");
        run(&srv, &["DEL", &KEYS.lock(&name)]);
        drop(g);
        drop(seq.next(true, "after a lost hold"));
        // The counter deleted while held: the release does not create it again.
        let g = seq.next(false, "released before");
        run(&srv, &["DEL", &fence_key]);
        drop(g);
        assert_eq!(
            counter(&srv, &name),
            None,
            "fair {fair}: no counter without a TTL"
        );
        drop(seq.next(false, "after the counter was deleted"));
        // Old values (a stale snapshot, a replica that missed the last fences).
        for old in ["-5", "-05", "5"] {
            run(&srv, &["SET", &fence_key, old]);
            drop(seq.next(old.starts_with('-'), old));
        }
        // A foreign string: no counter.
        run(&srv, &["SET", &fence_key, "not a fence"]);
        drop(seq.next(false, "a foreign string"));
        // Ahead of the clock (a burst of more than one fence per microsecond): one more.
        // A minute ahead, so that no stall of a loaded machine lets the clock catch up.
        let ahead = fence_of(seq.last) + 60_000_000;
        run(&srv, &["SET", &fence_key, &format!("-{ahead}")]);
        let g = seq.next(true, "ahead of the clock");
        assert_eq!(fence_of(g.fencing_token()), ahead + 1, "fair {fair}");
        let seen = counter(&srv, &name).expect("counter");
        assert!(seen.held && seen.after_lost, "fair {fair}: {seen:?}");
        drop(g);
        assert!(!counter(&srv, &name).expect("counter").held, "fair {fair}");
    }
}

/// Acquisitions of one name, each checked against the one before.
struct Sequence<'a> {
    c: &'a LockClient,
    name: &'a str,
    last: u64,
}

impl Sequence<'_> {
    /// The next holder: a higher token than the last, told `lost` (`what`: the case).
    fn next(&mut self, lost: bool, what: &str) -> redbaton::LockGuard {
        let g = self.c.try_lock(self.name).expect("free");
        assert!(g.fencing_token() > self.last, "{}: {what}", self.name);
        assert_eq!(g.previous_lost(), lost, "{}: {what}", self.name);
        self.last = g.fencing_token();
        g
    }
}

/// A restart that brings the data back (from a snapshot) brings the news back with it:
/// a holder killed before the snapshot is reported lost after the restart, and a stale
/// snapshot loaded again says so again; a restart with no data says nothing. Tokens
/// increase throughout (a fence is never below the server's clock).
#[test]
fn fences_increase_and_the_news_follows_the_data_across_restarts() {
    let (srv, c) = test_server_and(client);
    let first = c.lock("restart").expect("lock").fencing_token();
    let (dead, dead_token) = holder(&srv, "restart", "lock");
    assert!(dead_token > first);
    run(&srv, &["SAVE"]);
    child::kill_and_reap(dead);
    srv.restart();
    let g = c.try_lock_for("restart", WAIT).expect("the lease runs out");
    assert!(
        g.previous_lost(),
        "the snapshot says the hold was never released"
    );
    assert!(g.fencing_token() > dead_token);
    let token = g.fencing_token();
    assert_eq!(g.unlock().unwrap(), Unlocked::Released);
    // The same snapshot again: stale, and still held.
    srv.restart();
    let g = c.try_lock_for("restart", WAIT).expect("lock");
    assert!(g.previous_lost(), "the stale snapshot says held");
    assert!(g.fencing_token() > token);
    let token = g.fencing_token();
    drop(g);
    // No data at all.
    run(&srv, &["FLUSHALL"]);
    run(&srv, &["SAVE"]);
    srv.restart();
    let g = c.try_lock_for("restart", WAIT).expect("lock");
    assert!(!g.previous_lost(), "no counter, nothing to tell");
    assert!(g.fencing_token() > token);
}

// --- Redlock --------------------------------------------------------------------------

/// Redlock: a hold lost on the nodes is reported, and so is one lost on a single node
/// the holder still released on the others (any granting node that saw a hold end
/// without a release says so); after a release everywhere, nothing.
#[test]
fn redlock_reports_a_loss_any_granting_node_saw() {
    let servers: Vec<RedisServer> = (0..3).map(|_| test_server()).collect();
    let urls: Vec<String> = servers.iter().map(RedisServer::url).collect();
    let c = lock_builder!(
        nodes(urls.iter().cloned()),
        key_prefix(PREFIX),
        lease(LEASE)
    )
    .build()
    .expect("client");
    let g = c.lock("rl").expect("lock");
    assert!(!g.previous_lost());
    let token = g.fencing_token();
    for s in &servers {
        run(s, &["DEL", &KEYS.lock("rl")]);
    }
    drop(g);
    let g = c.lock("rl").expect("lock");
    assert!(g.previous_lost(), "lost everywhere");
    assert!(g.fencing_token() > token);
    run(&servers[1], &["DEL", &KEYS.lock("rl")]);
    assert_eq!(
        g.unlock().unwrap(),
        Unlocked::Released,
        "a majority released"
    );
    let g = c.lock("rl").expect("lock");
    assert!(
        g.previous_lost(),
        "one node saw the hold end without a release"
    );
    drop(g);
    assert!(!c.lock("rl").expect("lock").previous_lost());
}

// --- the other primitives keep the counter's forms -----------------------------------

#[test]
fn a_downgraded_write_ended_cleanly() {
    let (srv, c) = test_server_and(client);
    let rw = c.rwlock("down");
    let read = rw.write().expect("write").downgrade().expect("downgrade");
    let released = counter(&srv, "down").expect("counter");
    assert!(
        !released.held,
        "the write hold ended in the downgrade: {released:?}"
    );
    drop(read);
    assert_next_write_clean(&rw, "the write hold before was downgraded, not lost");
}

/// The next write hold of `rw` is told that the hold before it was not lost (`why`).
fn assert_next_write_clean(rw: &redbaton::RwLock, why: &str) {
    let next = rw.write().expect("write");
    assert!(!next.previous_lost(), "{why}");
}

#[test]
fn an_upgraded_write_released_is_not_lost() {
    let (srv, c) = test_server_and(client);
    let rw = c.rwlock("up");
    let write = rw
        .upgradable_read()
        .expect("upgradable")
        .upgrade()
        .expect("upgrade");
    assert!(
        counter(&srv, "up").expect("counter").held,
        "the upgrade holds the write"
    );
    assert_eq!(write.unlock().unwrap(), Unlocked::Released);
    assert_next_write_clean(&rw, "the upgraded write hold was released");
}

#[test]
fn a_multi_lock_released_is_not_lost() {
    let (srv, c) = test_server_and(client);
    let both = c.multi_lock(["{m}a", "{m}b"]).expect("multi-lock");
    for name in ["{m}a", "{m}b"] {
        assert!(counter(&srv, name).expect("counter").held, "{name} held");
    }
    assert_eq!(both.unlock().unwrap(), Unlocked::Released);
    for name in ["{m}a", "{m}b"] {
        let g = c.lock(name).expect("lock");
        assert!(!g.previous_lost(), "{name}: the multi-lock released it");
    }
    // A multi-lock that cannot have every name takes none: the counters say what they
    // said before.
    let held = c.lock("{m}b").expect("lock");
    let err = client(&srv.url())
        .try_multi_lock(["{m}a", "{m}b"])
        .expect_err("b is held");
    assert!(err.is_would_block(), "{err:?}");
    drop(held);
    let a = c.lock("{m}a").expect("lock");
    assert!(!a.previous_lost(), "nothing was lost on a");
}

#[test]
fn a_multi_lock_is_told_of_a_lost_name() {
    let (srv, c) = test_server_and(client);
    let held = c.lock("{n}b").expect("lock");
    // Its key deleted by hand: the hold ends without a release.
    run(&srv, &["DEL", &KEYS.lock("{n}b")]);
    drop(held);
    let both = client(&srv.url())
        .multi_lock(["{n}a", "{n}b"])
        .expect("multi-lock");
    assert!(
        both.previous_lost(),
        "the hold of b before ended without a release"
    );
    assert_eq!(both.unlock().unwrap(), Unlocked::Released);
    let again = c.multi_lock(["{n}a", "{n}b"]).expect("multi-lock");
    assert!(
        !again.previous_lost(),
        "the multi-lock before released both"
    );
}
