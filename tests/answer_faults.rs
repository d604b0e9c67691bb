//! The answers a holder and an operator get under faults, against real redis-servers: what
//! an `unlock()` whose first try failed says once its retry finds the key gone (released by
//! that first try, or lost before it: a restart without data, a key deleted, a hold that
//! outlived its fence counter), what `inspect` shows of a Redlock name that the masters
//! disagree on, `force_release` of a hold older than its fence counter, and the words of a
//! latch's timeout.

use redbaton::{Builder, ForceRelease, LockClient, LockKind, Unlocked};
use redbaton_testkit::keys::{Counter, Keys, fence_of};
use redbaton_testkit::proxy::Proxy;
use redbaton_testkit::server::{RedisServer, start_many};
use redbaton_testkit::{
    exists, init_log, lock_builder, lock_client, ms, secs, test_server, test_server_and,
};

const PREFIX: &str = "af:";
const KEYS: Keys = Keys::new(PREFIX);

/// A builder for `url` with the plain (unfair) lock, whose release is `RELEASE`.
fn unfair(url: &str) -> Builder {
    lock_builder!(node(url), key_prefix(PREFIX), fair(false))
}

/// A plain client of `url`, with a lease long enough that no renewal looks at the lock
/// during a test.
fn plain(url: &str) -> LockClient {
    let b = unfair(url).lease(secs(30)).read_timeout(ms(500));
    b.build().expect("client")
}

/// A client of `url` with the fair lock (the default), whose release is `FAIR_RELEASE`,
/// and the lease and read timeout of [`plain`].
fn fair(url: &str) -> LockClient {
    let b = lock_builder!(node(url), key_prefix(PREFIX));
    b.lease(secs(30))
        .read_timeout(ms(500))
        .build()
        .expect("client")
}

/// A plain client of `url` whose fence counters live 1 s (the shortest `fence_ttl`), with
/// a lease short enough for that: a hold of a second and a half outlives its counter.
fn short_counters(url: &str) -> LockClient {
    let b = unfair(url).lease(ms(300)).read_timeout(ms(250));
    b.fence_ttl(secs(1)).build().expect("client")
}

/// Sleeps until the fence counter of the hold `g` has expired under it (renewed, it is
/// still held): a hold older than its counter.
fn outlive_counter(srv: &RedisServer, g: &redbaton::LockGuard) {
    std::thread::sleep(ms(1_300));
    let name = String::from_utf8_lossy(g.name()).into_owned();
    assert!(
        !exists(&mut srv.conn(), KEYS.fence(&name)),
        "the counter expired"
    );
    g.check().expect("still held, renewed");
}

/// A server, a proxy in front of it, and a client through the proxy, made by `make`. A
/// lock taken and released first loads the scripts, so that a request a test loses is
/// the script run itself (not a `NOSCRIPT` round, which ran nothing).
fn behind_proxy_with(make: fn(&str) -> LockClient) -> (RedisServer, Proxy, LockClient) {
    let srv = test_server();
    let proxy = Proxy::start(srv.addr());
    let c = make(&proxy.url());
    let warm = c.lock("warm-up").expect("warm-up lock").unlock();
    assert_eq!(warm.expect("warm-up unlock"), Unlocked::Released);
    (srv, proxy, c)
}

/// A server, a proxy in front of it, and a plain client through the proxy.
fn behind_proxy() -> (RedisServer, Proxy, LockClient) {
    behind_proxy_with(plain)
}

/// Three masters and a Redlock client of them.
fn redlock() -> (Vec<RedisServer>, LockClient) {
    init_log();
    let servers = start_many(3);
    let urls: Vec<String> = servers.iter().map(RedisServer::url).collect();
    let c = lock_client!(nodes(urls), key_prefix(PREFIX), lease(secs(30)));
    (servers, c)
}

/// The token in the lock key of `name` on `srv`, if any.
fn token_on(srv: &RedisServer, name: &str) -> Option<String> {
    redis::Commands::get(&mut srv.conn(), KEYS.lock(name)).expect("GET the lock key")
}

/// Deletes the lock key of `name` on `srv` (by hand, as an operator or a restart would),
/// leaving its fence counter as it is.
fn delete_lock(srv: &RedisServer, name: &str) {
    redis::cmd("DEL")
        .arg(KEYS.lock(name))
        .exec(&mut srv.conn())
        .expect("DEL the lock key");
}

#[test]
fn smoke() {
    let (srv, _proxy, c) = behind_proxy();
    let g = c.lock("smoke").expect("lock");
    assert!(token_on(&srv, "smoke").is_some());
    assert_eq!(g.unlock().expect("unlock"), Unlocked::Released);
    let counter = Counter::read(&mut srv.conn(), KEYS.fence("smoke").as_bytes());
    assert!(counter.is_some_and(|c| !c.held), "released: {counter:?}");
}

// --- unlock after a failed first try -------------------------------------------------------

/// The server restarts without data while the lock is held, and the holder unlocks before
/// any renewal has looked: the release's first try fails on the dead pooled connection,
/// and its retry finds the key gone, with no fence counter either. Nothing of ours was
/// released: the hold was lost in the restart, and the unlock says so.
#[test]
fn an_unlock_after_a_restart_without_data_is_not_released() {
    for make in [plain, fair] {
        let (srv, c) = test_server_and(make);
        let g = c.lock("restart").expect("lock");
        srv.restart();
        let outcome = g.unlock();
        eprintln!("unlock after a restart without data: {outcome:?}");
        assert_eq!(outcome.expect("unlock"), Unlocked::Expired);
    }
}

/// The release's first try never reaches Redis (its connection dies), and meanwhile the
/// key was deleted by hand: the retry finds the key gone and the counter still holding our
/// fence, held. The release did not end the hold: `Expired`, and the counter is left held,
/// news for the next holder.
#[test]
fn an_unlock_whose_key_was_deleted_before_its_retry_is_not_released() {
    for make in [plain, fair] {
        let (srv, proxy, c) = behind_proxy_with(make);
        let g = c.lock("deleted").expect("lock");
        let fence = fence_of(g.fencing_token());
        delete_lock(&srv, "deleted");
        proxy.kill_all();
        let outcome = g.unlock();
        eprintln!("unlock of a key deleted while its connection died: {outcome:?}");
        assert_eq!(outcome.expect("unlock"), Unlocked::Expired);
        let counter = Counter::read(&mut srv.conn(), KEYS.fence("deleted").as_bytes())
            .expect("the counter is there");
        assert!(counter.held && counter.fence == fence, "{counter:?}");
        let next = c.lock("deleted").expect("lock again");
        assert!(next.previous_lost(), "the next holder is told");
    }
}

/// The common release sends the commands it always did: no read of the fence counter, no
/// clock; those are for a retry after a lost reply only.
#[test]
fn a_first_release_reads_neither_counter_nor_clock() {
    let (srv, c) = test_server_and(plain);
    let g = c.lock("first").expect("lock");
    srv.reset_stats();
    assert_eq!(g.unlock().expect("unlock"), Unlocked::Released);
    let stats = srv.commandstats();
    eprintln!("{stats:?}");
    let count = |name: &str| stats.get(name).copied().unwrap_or(0);
    assert_eq!(
        (count("get"), count("del"), count("set"), count("time")),
        (1, 1, 1, 0),
        "{stats:?}"
    );
}

/// The release runs but its reply is lost: the retry finds the key gone and the counter
/// holding our fence released. The first try released it: `Released`.
#[test]
fn an_unlock_whose_reply_was_lost_is_released() {
    for make in [plain, fair] {
        let (srv, proxy, c) = behind_proxy_with(make);
        let g = c.lock("lost-reply").expect("lock");
        let token = token_on(&srv, "lost-reply").expect("held");
        proxy.drop_next_reply_matching(token.as_bytes());
        let outcome = g.unlock();
        assert_eq!(proxy.replies_dropped(), 1, "the fault fired");
        assert_eq!(outcome.expect("unlock"), Unlocked::Released);
        assert!(token_on(&srv, "lost-reply").is_none());
    }
}

/// A hold longer than its fence counter's TTL: the counter expired under it. Its release's
/// reply is lost, and the retry finds both the key and the counter gone, as after a restart
/// without data; but here the first try did release it, which a counter that expired by
/// itself cannot tell otherwise: the unlock must not say the hold was lost.
#[test]
fn an_unlock_of_a_hold_older_than_its_counter_is_released() {
    let (srv, proxy, c) = behind_proxy_with(short_counters);
    let g = c.lock("old").expect("lock");
    outlive_counter(&srv, &g);
    // The release names the lock's channel; renewals, every 100 ms here, do not.
    proxy.drop_next_reply_matching(format!("{}:ev", KEYS.lock("old")).as_bytes());
    let outcome = g.unlock();
    assert_eq!(proxy.replies_dropped(), 1, "the fault fired");
    assert_eq!(outcome.expect("unlock"), Unlocked::Released);
}

/// Redlock over three masters, one of which restarts without data while the lock is held:
/// its release's retry finds neither key nor counter there, and the two others release
/// it: a majority, `Released`.
#[test]
fn a_redlock_unlock_after_one_empty_restart_is_released() {
    let (servers, c) = redlock();
    let g = c.lock("one-restart").expect("lock on all three");
    servers[0].restart();
    let outcome = g.unlock();
    eprintln!("unlock after one of three restarted empty: {outcome:?}");
    assert_eq!(outcome.expect("unlock"), Unlocked::Released);
    for s in &servers {
        assert!(token_on(s, "one-restart").is_none());
    }
}

// --- Redlock: inspect -----------------------------------------------------------------------

/// Three masters, and `name`'s lock key only on the first (a minority: an attempt whose
/// round failed, a leftover). No majority holds it: `inspect`'s view says nobody holds it,
/// while each master's own view is kept.
#[test]
fn redlock_inspect_shows_no_holder_held_by_a_minority() {
    let (servers, c) = redlock();
    let guard = c.lock("minority").expect("lock on all three");
    delete_lock(&servers[1], "minority");
    delete_lock(&servers[2], "minority");
    let info = c.inspect("minority").expect("inspect");
    eprintln!("{info:#?}");
    assert_eq!(info.nodes.len(), 3, "every master's view is kept");
    assert!(info.nodes[0].holder.is_some(), "the first master has it");
    assert_eq!(info.kind, LockKind::Free, "{info:?}");
    assert!(info.holder.is_none(), "no majority holds it: {info:?}");
    assert!(!info.is_held(), "{info:?}");
    drop(guard);
}

/// Three masters; the lock held on the second and third (a majority), the first answering
/// master empty (restarted without data, say). The view is the majority's: the holder, its
/// fence and lease, and it is ours.
#[test]
fn redlock_inspect_shows_the_majority_holder_after_an_empty_first_master() {
    let (servers, c) = redlock();
    let guard = c.lock("majority").expect("lock on all three");
    delete_lock(&servers[0], "majority");
    let info = c.inspect("majority").expect("inspect");
    assert_eq!(info.kind, LockKind::Lock, "{info:?}");
    let holder = info.holder.as_ref().expect("held by a majority");
    assert!(holder.mine, "{info:?}");
    assert_eq!(holder.fence, Some(fence_of(guard.fencing_token())));
    assert!(holder.lease_left.is_some());
    assert!(info.is_held());
    assert_eq!(info.nodes[0].kind, LockKind::Free);
}

/// Three masters holding three different tokens (no round won a majority): no holder.
#[test]
fn redlock_inspect_shows_no_holder_when_the_masters_disagree() {
    let (servers, c) = redlock();
    for (i, s) in servers.iter().enumerate() {
        redis::cmd("SET")
            .arg(KEYS.lock("split"))
            .arg(format!("token-{i}"))
            .arg("PX")
            .arg(30_000)
            .exec(&mut s.conn())
            .expect("SET");
    }
    let info = c.inspect("split").expect("inspect");
    assert!(info.holder.is_none(), "{info:?}");
    assert!(!info.is_held(), "{info:?}");
    assert!(info.nodes.iter().all(|n| n.holder.is_some()));
}

// --- force_release of a hold older than its counter -------------------------------------

/// A hold kept longer than the fence counter's TTL: the counter is gone, and `inspect`
/// shows the holder with no fence. An operator frees it with fence 0 (what a gone counter
/// reads as), and a fence that is not 0 is refused.
#[test]
fn a_hold_older_than_its_counter_can_be_force_released() {
    let (srv, c) = test_server_and(short_counters);
    let g = c.lock("stuck").expect("lock");
    let fence = fence_of(g.fencing_token());
    outlive_counter(&srv, &g);
    let info = c.inspect("stuck").expect("inspect");
    let holder = info.holder.expect("held, renewed");
    assert_eq!(holder.fence, None, "the counter expired");
    assert_eq!(
        c.force_release("stuck", fence).expect("force release"),
        ForceRelease::FenceMismatch { current: None },
        "a fence that is not the counter's is refused"
    );
    assert_eq!(
        c.force_release("stuck", 0).expect("force release"),
        ForceRelease::Released { nodes: 1 }
    );
    assert!(token_on(&srv, "stuck").is_none());
    assert_eq!(g.unlock().expect("unlock"), Unlocked::Expired);
}

/// Fence 0 frees only a lock whose counter is gone: a lock whose counter is there is
/// refused, with that counter.
#[test]
fn fence_zero_never_frees_a_lock_with_a_counter() {
    let (srv, c) = test_server_and(plain);
    let g = c.lock("counted").expect("lock");
    let fence = fence_of(g.fencing_token());
    assert_eq!(
        c.force_release("counted", 0).expect("force release"),
        ForceRelease::FenceMismatch {
            current: Some(fence)
        }
    );
    assert!(token_on(&srv, "counted").is_some(), "left alone");
    assert_eq!(g.unlock().expect("unlock"), Unlocked::Released);
}

// --- messages ---------------------------------------------------------------------------

/// A latch's wait that times out says that a wait timed out, not that a lock was waited
/// for.
#[test]
fn a_latch_timeout_names_no_lock() {
    let (_srv, c) = test_server_and(plain);
    let latch = c.latch("gate", 2);
    assert_eq!(latch.count().expect("made"), 2);
    let e = latch.wait_for(ms(50)).expect_err("nobody counts down");
    assert!(e.is_timeout(), "{e:?}");
    let text = e.to_string();
    assert!(!text.contains("lock"), "{text}");
}
