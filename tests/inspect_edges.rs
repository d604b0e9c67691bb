//! The operators' view (`inspect`, `locks`, `force_release`) and the eviction check at
//! their edges, against real redis-servers: a force release whose reply is lost, a Redlock
//! lock held on a majority only, a fair queue and waiting writers' marks behind 1,000
//! dead entries, a foreign key with a long name under the prefix, force releases of a
//! hold after a loss and of a stale fence, the eviction warning with waiters that poll
//! (also on Redis 6.2) and with a `volatile-*` policy, a large keyspace, a braced prefix.

use std::collections::HashSet;

use redbaton::{ForceRelease, LockClient, LockInfo, LockKind, Wakeup};
use redbaton_testkit::keys::Keys;
use redbaton_testkit::proxy::Proxy;
use redbaton_testkit::server::{RedisServer, start_many};
use redbaton_testkit::{
    exists, init_log, lock_client, logs, ms, secs, test_server, test_server_and,
};

const KEYS: Keys = Keys::DEFAULT;

fn client(url: &str) -> LockClient {
    lock_client!(node(url), lease(secs(30)))
}

fn key(name: &[u8], suffix: &str) -> Vec<u8> {
    [KEYS.lock_bytes(name), suffix.as_bytes().to_vec()].concat()
}

/// A held lock is listed once, with its kind and fence.
#[test]
fn smoke() {
    let (_srv, c) = test_server_and(client);
    let guard = c.lock("smoke").expect("lock");
    let listed: Vec<LockInfo> = c.locks("*").map(|i| i.expect("item")).collect();
    let fence = Some(guard.fencing_token() >> 12);
    assert!(
        matches!(listed.as_slice(), [info] if info.kind == LockKind::Lock && info.fence == fence),
        "{listed:?}"
    );
}

/// An operator force-releases a held lock; the script runs and deletes the lock, but its
/// reply is lost (the connection drops). The force release returns an error or
/// `Released`, never `NotHeld` ("nothing was changed") about a lock it deleted.
#[test]
fn a_force_release_whose_reply_is_lost_never_says_not_held() {
    let srv = test_server();
    let proxy = Proxy::start(srv.addr());
    let holder = client(&srv.url());
    let op = lock_client!(
        node(proxy.url()),
        lease(secs(30)),
        wakeup(Wakeup::Polling(ms(500)))
    );
    let guard = holder.lock("lost-reply").expect("lock");
    let fence = guard.fencing_token() >> 12;
    // Loads FORCE_RELEASE on the server, so that the armed request is the script itself
    // (not a NOSCRIPT round).
    assert_eq!(
        op.force_release("warm-up", 1).expect("warm up"),
        ForceRelease::NotHeld
    );
    proxy.drop_next_reply_matching(fence.to_string().as_bytes());
    let outcome = op.force_release("lost-reply", fence);
    assert_eq!(proxy.replies_dropped(), 1, "the fault fired");
    assert!(
        !exists(&mut srv.conn(), KEYS.lock_bytes(b"lost-reply")),
        "the lock was deleted by the first send"
    );
    assert!(
        !matches!(outcome, Ok(ForceRelease::NotHeld)),
        "a force release that deleted the lock does not report NotHeld: {outcome:?}"
    );
    drop(guard);
}

/// Redlock over three masters: a lock held on masters 2 and 3 (a majority: a valid lock)
/// but not on master 1 (restarted empty, or down at the acquisition) is listed by
/// `locks()`, and `inspect` says it is held.
#[test]
fn redlock_listing_keeps_a_lock_held_on_a_majority() {
    init_log();
    let servers = start_many(3);
    let urls: Vec<String> = servers.iter().map(|s| s.url()).collect();
    let c = lock_client!(nodes(urls), lease(secs(30)));
    let guard = c.lock("majority").expect("lock on all three");
    // Master 1 loses the lock (as a restart without data would).
    let () = redis::cmd("DEL")
        .arg(KEYS.lock_bytes(b"majority"))
        .arg(key(b"majority", ":lease"))
        .query(&mut servers[0].conn())
        .unwrap();
    assert!(exists(&mut servers[1].conn(), KEYS.lock_bytes(b"majority")));
    assert!(exists(&mut servers[2].conn(), KEYS.lock_bytes(b"majority")));
    assert!(!guard.is_lost(), "a majority still holds it");
    let listed: HashSet<Vec<u8>> = c.locks("*").map(|i| i.expect("item").name).collect();
    assert!(
        listed.contains(b"majority".as_slice()),
        "a lock held on 2 of 3 masters is listed: {listed:?}"
    );
    let info = c.inspect("majority").expect("inspect");
    assert!(info.is_held(), "held on a majority: {info:?}");
    drop(guard);
}

/// A fair queue whose expiry set holds 1,000 expired entries (crashed waiters not yet
/// pruned) and one live waiter that arrived first: `inspect` reports the live head with
/// its expiry, the name is waited for, and `locks()` lists it.
#[test]
fn a_live_queue_head_behind_dead_entries_is_reported_live() {
    let (srv, c) = test_server_and(client);
    let mut conn = srv.conn();
    let (q, qx) = (key(b"crowd", ":q"), key(b"crowd", ":qx"));
    let mut p = redis::pipe();
    // The live waiter: first by arrival, expiring far in the future (ms).
    p.cmd("ZADD").arg(&q).arg(1).arg("live").ignore();
    p.cmd("ZADD").arg(&qx).arg(9e15).arg("live").ignore();
    for i in 0..1000 {
        let t = format!("dead{i:04}");
        p.cmd("ZADD").arg(&q).arg(2 + i).arg(&t).ignore();
        p.cmd("ZADD").arg(&qx).arg(1).arg(&t).ignore();
    }
    let () = p.query(&mut conn).unwrap();
    let info = c.inspect("crowd").expect("inspect");
    assert_eq!(info.queue.len(), 1000, "the first 1,000 by arrival");
    assert!(
        info.queue[0].expires_in.is_some(),
        "the live head of the queue has an expiry: {:?}",
        info.queue[0]
    );
    assert!(info.is_waited_for(), "a live waiter is queued");
    let listed: Vec<Vec<u8>> = c.locks("*").map(|i| i.expect("item").name).collect();
    assert_eq!(
        listed,
        vec![b"crowd".to_vec()],
        "the waited-for name is listed"
    );
}

/// A read-write lock whose waiting writers' marks are 1,000 expired ones (crashed
/// waiters) and one live one: `inspect` reports the live waiting writer.
#[test]
fn a_live_writer_mark_behind_dead_marks_is_reported() {
    let (srv, c) = test_server_and(client);
    let _r = c.rwlock("marks").read().expect("read hold");
    let mut conn = srv.conn();
    let ww = key(b"marks", ":ww");
    let mut p = redis::pipe();
    for i in 0..1000 {
        p.cmd("ZADD")
            .arg(&ww)
            .arg(1)
            .arg(format!("wdead{i:04}"))
            .ignore();
    }
    p.cmd("ZADD").arg(&ww).arg(9e15).arg("wlive").ignore();
    let () = p.query(&mut conn).unwrap();
    let info = c.inspect("marks").expect("inspect");
    assert_eq!(
        info.waiting_writers.len(),
        1,
        "one live waiting writer: {:?}",
        info.waiting_writers
    );
}

/// A key under the prefix that this library did not write, whose name is longer than
/// any lock name may be (5,000 bytes): `locks("*")` yields no error for it and lists the
/// held lock beside it.
#[test]
fn a_foreign_key_with_a_long_name_does_not_fail_the_listing() {
    let (srv, c) = test_server_and(client);
    let _g = c.lock("real").expect("lock");
    let long = vec![b'x'; 5000];
    let () = redis::cmd("SET")
        .arg(KEYS.lock_bytes(&long))
        .arg("v")
        .query(&mut srv.conn())
        .unwrap();
    let items: Vec<redbaton::Result<LockInfo>> = c.locks("*").collect();
    let errors: Vec<String> = items
        .iter()
        .filter_map(|i| i.as_ref().err().map(|e| e.to_string()))
        .collect();
    assert!(
        errors.is_empty(),
        "a foreign key under the prefix yields no error in the listing: {errors:?}"
    );
    assert!(
        items
            .iter()
            .any(|i| i.as_ref().is_ok_and(|i| i.name == b"real"))
    );
}

/// A hold that began after a loss (its counter in the `-0<f>` form) is compared by its
/// fence: the force release deletes that hold and its lease record, the next holder is
/// told of the loss, and the next fence is strictly greater.
#[test]
fn force_release_of_a_hold_after_a_loss() {
    let (srv, (a, b)) = test_server_and(|url| (client(url), client(url)));
    let first = a.lock("fl").expect("lock");
    let () = redis::cmd("DEL")
        .arg(KEYS.lock_bytes(b"fl"))
        .query(&mut srv.conn())
        .unwrap();
    let second = b.lock("fl").expect("lock after the loss");
    assert!(second.previous_lost());
    let fence = b.inspect("fl").unwrap().holder.unwrap().fence.unwrap();
    assert_eq!(fence, second.fencing_token() >> 12);
    assert_eq!(
        a.force_release("fl", fence).unwrap(),
        ForceRelease::Released { nodes: 1 }
    );
    assert!(
        !exists(&mut srv.conn(), key(b"fl", ":lease")),
        "lease record deleted"
    );
    drop(first);
    drop(second);
    let third = a.try_lock("fl").expect("free");
    assert!(third.fencing_token() >> 12 > fence);
    assert!(third.previous_lost());
}

/// A force release with a stale fence (from before a normal release and a new
/// acquisition) never deletes the new hold: it says `FenceMismatch` with the current,
/// greater fence; a release between inspect and force release leaves `NotHeld`.
#[test]
fn force_release_is_conditional_on_the_inspected_fence() {
    let (_srv, (a, b)) = test_server_and(|url| (client(url), client(url)));
    let g = a.lock("cond").expect("lock");
    let old = a.inspect("cond").unwrap().holder.unwrap().fence.unwrap();
    g.unlock().expect("unlock");
    assert_eq!(b.force_release("cond", old).unwrap(), ForceRelease::NotHeld);
    let g2 = b.lock("cond").expect("relock");
    let outcome = a.force_release("cond", old).unwrap();
    assert!(
        matches!(outcome, ForceRelease::FenceMismatch { current: Some(f) } if f > old),
        "{outcome:?}"
    );
    assert!(g2.check().is_ok());
    drop(g2);
}

/// A client whose waiters poll (no keyspace notifications) still checks the eviction
/// policy: with `allkeys-lru` and a memory limit it warns once, on Redis 7 as on 6.2 (run
/// with `REDBATON_REDIS_SERVER=<a 6.2 redis-server>`), whose `CONFIG GET` takes one
/// parameter at a time.
#[test]
fn eviction_risk_is_warned_with_polling_waiters() {
    let warned = eviction_warnings("allkeys-lru", |url| {
        lock_client!(node(url), wakeup(Wakeup::Polling(ms(100))))
    });
    assert_eq!(warned.len(), 1, "one eviction warning: {warned:?}");
}

/// With a `volatile-*` policy, Redis may evict every key that carries a TTL: the
/// warning names the fencing counter as well as the held lock's key.
#[test]
fn the_volatile_eviction_warning_names_the_fence_counter() {
    let warned = eviction_warnings("volatile-lru", |url| lock_client!(node(url)));
    assert_eq!(warned.len(), 1, "one eviction warning: {warned:?}");
    assert!(
        warned[0].contains("fenc"),
        "the warning names the fencing counter: {warned:?}"
    );
}

/// Waiters that poll no faster than the fair queue's grant lease (one second) lose their
/// turn whenever a lock is granted to them: `build()` warns (it does not refuse: a slow
/// poller is how a waiter that hears nothing is shown); faster polling, or no queue, is
/// not warned of.
#[test]
fn polling_slower_than_a_grant_lasts_is_warned_with_the_fair_queue() {
    init_log();
    logs::capture();
    let srv = test_server();
    let polling = |every, fair| {
        let c = lock_client!(node(srv.url()), wakeup(Wakeup::Polling(every)), fair(fair));
        drop(c);
        logs::lines(log::Level::Warn, &format!("every {every:?}"))
    };
    assert_eq!(polling(ms(1234), true).len(), 1, "one warning");
    assert!(polling(ms(1235), false).is_empty(), "no queue: no warning");
    assert!(
        polling(ms(999), true).is_empty(),
        "polling faster: no warning"
    );
}

/// The eviction warnings logged for a server with a 100 MB memory limit and the eviction
/// `policy`, while a client `make` builds for its URL is alive.
fn eviction_warnings(policy: &str, make: impl FnOnce(&str) -> LockClient) -> Vec<String> {
    init_log();
    logs::capture();
    let srv = RedisServer::builder()
        .config("maxmemory", "100mb")
        .config("maxmemory-policy", policy)
        .start();
    let c = make(&srv.url());
    let node = format!(":{}/", srv.port());
    let warned = logs::lines(log::Level::Warn, &node)
        .into_iter()
        .filter(|l| l.contains("maxmemory-policy"))
        .collect();
    drop(c);
    warned
}

/// Listing terminates and misses nothing in a large keyspace: 20,000 unrelated keys
/// (some under the prefix: fence counters, lease records, latches of idle names, and
/// foreign keys) around five held names, two of them in the escaped key form (`}` in the
/// name).
#[test]
fn listing_a_large_keyspace_finds_every_held_name() {
    let (srv, c) = test_server_and(client);
    let mut conn = srv.conn();
    let mut p = redis::pipe();
    for i in 0..20_000 {
        match i % 4 {
            0 => p.cmd("SET").arg(format!("other:{i}")).arg(1).ignore(),
            1 => p
                .cmd("SET")
                .arg(key(format!("idle{i}").as_bytes(), ":fence"))
                .arg(i)
                .ignore(),
            2 => p
                .cmd("SET")
                .arg(key(format!("idle{i}").as_bytes(), ":latch"))
                .arg("1:1:x")
                .ignore(),
            _ => p
                .cmd("SET")
                .arg(format!("redbaton:no-brace-{i}"))
                .arg(1)
                .ignore(),
        };
    }
    let () = p.query(&mut conn).unwrap();
    let names: [&[u8]; 5] = [b"a", b"b}c", b"}", b"x{y", b"\xff\x00z"];
    let guards: Vec<_> = names.iter().map(|n| c.lock(n).expect("lock")).collect();
    let listed: Vec<Vec<u8>> = c.locks("").map(|i| i.expect("item").name).collect();
    let want: HashSet<Vec<u8>> = names.iter().map(|n| n.to_vec()).collect();
    assert_eq!(listed.len(), want.len(), "each name once: {listed:?}");
    assert_eq!(listed.into_iter().collect::<HashSet<_>>(), want);
    drop(guards);
}

/// Under a prefix with a brace (every key in the escaped form), a pattern lists the
/// matching held names only.
#[test]
fn listing_under_a_braced_prefix() {
    let srv = test_server();
    let c = lock_client!(node(srv.url()), key_prefix("{app}*:"));
    let _a = c.lock("jobs:1").expect("lock");
    let _b = c.lock("jobs:2").expect("lock");
    let _o = c.lock("other").expect("lock");
    let mut listed: Vec<Vec<u8>> = c.locks("jobs:*").map(|i| i.expect("item").name).collect();
    listed.sort();
    assert_eq!(listed, vec![b"jobs:1".to_vec(), b"jobs:2".to_vec()]);
}

/// The names `c.locks(pattern)` lists, sorted.
fn listed(c: &LockClient, pattern: &[u8]) -> Vec<Vec<u8>> {
    let mut names: Vec<Vec<u8>> = c.locks(pattern).map(|i| i.expect("item").name).collect();
    names.sort();
    names
}

/// Patterns whose end the glob reads on its own: an unpaired backslash at the end (a
/// literal backslash), an unclosed class (it runs to the end of the pattern), a `-` before
/// a class's `]` (a literal `-`). Each lists the names the glob matches, in both key forms:
/// what the `SCAN` pattern adds after the user's does not change what it means.
#[test]
fn patterns_with_open_ends_list_what_the_glob_matches() {
    let srv = test_server();
    for prefix in ["redbaton:", "{app}:"] {
        let c = lock_client!(node(srv.url()), key_prefix(prefix));
        let names: [&[u8]; 4] = [b"end\\", b"b", b"-", b"x"];
        let _held: Vec<_> = names.iter().map(|n| c.lock(n).expect("lock")).collect();
        assert_eq!(listed(&c, b"end\\"), [b"end\\"], "{prefix}");
        assert_eq!(listed(&c, b"[ab"), [b"b"], "{prefix}");
        assert_eq!(listed(&c, b"[b\\"), [b"b"], "{prefix}");
        assert_eq!(listed(&c, b"[a-]"), [b"-"], "{prefix}");
        assert_eq!(listed(&c, b"[^-b"), [b"x"], "{prefix}");
    }
}
