//! The operators' view under faults, against real redis-servers: a listing while the
//! keyspace grows under it, a listing whose `SCAN` pages fail (once half-way, or always),
//! a live hold behind a thousand expired ones not yet dropped, and a fence-checked release
//! that meets a key this library did not write, on one node and on Redlock masters that
//! disagree (one answer lost).

use redbaton::{ForceRelease, LockClient, LockKind};
use redbaton_testkit::keys::Keys;
use redbaton_testkit::proxy::Proxy;
use redbaton_testkit::server::{RedisServer, start_many};
use redbaton_testkit::{exists, lock_client, secs, test_server_and};

const KEYS: Keys = Keys::DEFAULT;

fn client(url: &str) -> LockClient {
    lock_client!(node(url), lease(secs(30)))
}

#[test]
fn smoke() {
    let (_srv, c) = test_server_and(client);
    let guard = c.lock("smoke").expect("lock").detach();
    let released = c.force_release("smoke", guard.fencing_token() >> 12);
    assert!(
        matches!(released, Ok(ForceRelease::Released { nodes: 1 })),
        "{released:?}"
    );
    assert_eq!(c.inspect("smoke").expect("inspect").kind, LockKind::Free);
}

/// `locks` pages through `SCAN` while other programs write 40,000 keys between its steps
/// (the server's table grows and rehashes under the cursor): every name held throughout is
/// listed, each once.
#[test]
fn a_listing_while_the_keyspace_grows_finds_every_held_name_once() {
    let (srv, c) = test_server_and(client);
    let held: Vec<String> = (0..200).map(|i| format!("steady:{i}")).collect();
    let _guards: Vec<_> = held.iter().map(|n| c.lock(n).expect("lock")).collect();
    let mut conn = srv.conn();
    let mut listed = Vec::new();
    for (step, info) in c.locks("steady:*").enumerate() {
        listed.push(String::from_utf8(info.expect("item").name).expect("utf-8"));
        let mut growth = redis::pipe();
        for i in 0..200 {
            growth.set(format!("other:{step}:{i}"), i).ignore();
        }
        growth.exec(&mut conn).expect("grow");
    }
    listed.sort();
    let mut want = held.clone();
    want.sort();
    assert_eq!(listed, want);
}

/// `locks` through a proxy, 1,000 names held: after 10 items, `SCAN` requests are refused
/// until a step fails (one error item), then let through. The failed page is asked again
/// from the cursor it failed at, so every name is still listed, each once, and the failure
/// is the one error item: the rest of the node is not dropped.
#[test]
fn a_failed_scan_page_is_asked_again() {
    let (srv, proxy, c) = behind_a_proxy();
    let mut want: Vec<Vec<u8>> = (0..1000)
        .map(|i| format!("many:{i}").into_bytes())
        .collect();
    let mut hold = redis::pipe();
    for name in &want {
        hold.cmd("SET")
            .arg(KEYS.lock_bytes(name))
            .arg("another holder's token")
            .arg("PX")
            .arg(60_000)
            .ignore();
    }
    hold.exec(&mut srv.conn()).expect("hold");
    let mut listing = c.locks("many:*");
    let mut listed: Vec<Vec<u8>> = listing
        .by_ref()
        .take(10)
        .map(|i| i.expect("item").name)
        .collect();
    let mut errors = 0;
    while errors == 0 {
        match proxy.refusing_requests_matching(b"SCAN", || listing.next()) {
            Some(Ok(info)) => listed.push(info.name),
            Some(Err(_)) => errors += 1,
            None => panic!("the listing ended before a page was refused"),
        }
    }
    for item in listing {
        match item {
            Ok(info) => listed.push(info.name),
            Err(e) => panic!("a second error after the proxy healed: {e}"),
        }
    }
    listed.sort();
    want.sort();
    assert_eq!(listed.len(), want.len(), "names listed, of 1,000 held");
    assert_eq!(listed, want);
}

/// `locks` through a proxy that refuses every `SCAN`: each step's failure is an error
/// item, and after three in a row the node is given up, so the listing ends.
#[test]
fn a_node_whose_pages_keep_failing_is_given_up() {
    let (_srv, proxy, c) = behind_a_proxy();
    let _held = c.lock("held").expect("lock");
    let items: Vec<_> = proxy.refusing_requests_matching(b"SCAN", || c.locks("*").collect());
    assert_eq!(items.len(), 3, "{items:?}");
    assert!(items.iter().all(Result::is_err), "{items:?}");
}

/// A server, a proxy in front of it and a client through the proxy.
fn behind_a_proxy() -> (RedisServer, Proxy, LockClient) {
    let srv = RedisServer::start();
    let proxy = Proxy::start(srv.addr());
    let c = client(&proxy.url());
    (srv, proxy, c)
}

/// A semaphore whose holders crashed by the thousand: 1,000 expired permits that no script
/// has dropped yet (renewals of the live permit drop nothing), and one live permit, which
/// expires last. `inspect` reports the live permit (the listing stops at 1,000 entries: the
/// expired ones, first by expiry, must not fill it), the name is held, and `locks` lists it.
#[test]
fn a_live_permit_behind_expired_ones_is_reported() {
    let (srv, c) = test_server_and(client);
    let _permit = c.semaphore("pool", 5000).acquire().expect("permit");
    let mut expired = redis::cmd("ZADD");
    expired.arg(KEYS.lock("pool"));
    for i in 1..=1000 {
        expired.arg(i).arg(format!("pcrashed{i}"));
    }
    expired.exec(&mut srv.conn()).expect("zadd");
    let info = c.inspect("pool").expect("inspect");
    assert_eq!(info.kind, LockKind::Semaphore { permits: 5000 });
    let live: Vec<_> = info
        .holds
        .iter()
        .filter(|h| h.lease_left.is_some())
        .collect();
    assert!(
        matches!(live.as_slice(), [h] if h.mine),
        "one live permit, of {} listed",
        info.holds.len()
    );
    assert!(info.is_held());
    let listed: Vec<_> = c.locks("pool").map(|i| i.expect("item").name).collect();
    assert_eq!(listed, [b"pool".to_vec()]);
}

/// Every lock this library takes has a lease, so a string with no expiry at a name's lock
/// key was written by another program (`inspect` shows it with no lease left). The name's
/// fence counter, left by an earlier lock of the name, still shows a fence; a force release
/// at that fence refuses the key as it refuses keys of other types, and leaves it.
#[test]
fn force_release_leaves_a_string_without_expiry() {
    let (srv, c) = test_server_and(client);
    let fence = c.lock("shared").expect("lock").fencing_token() >> 12;
    let mut conn = srv.conn();
    redis::cmd("SET")
        .arg(KEYS.lock("shared"))
        .arg("another program's value")
        .exec(&mut conn)
        .expect("set");
    let holder = c
        .inspect("shared")
        .expect("inspect")
        .holder
        .expect("a holder");
    assert_eq!((holder.fence, holder.lease_left), (Some(fence), None));
    let refused = c.force_release("shared", fence);
    assert!(
        matches!(&refused, Err(e) if e.is_wrong_kind()),
        "{refused:?}"
    );
    assert!(exists(&mut conn, KEYS.lock("shared")));
}

/// Redlock over three masters, the third behind a proxy; `name` locked on all three, then
/// its lock key on the masters `foreign` replaced by a hash (another program's). The client,
/// the servers, the proxy and the guard.
fn redlock_beside_foreign_keys(
    name: &str,
    foreign: &[usize],
) -> (LockClient, Vec<RedisServer>, Proxy, redbaton::LockGuard) {
    let servers = start_many(3);
    let proxy = Proxy::start(servers[2].addr());
    let urls = vec![servers[0].url(), servers[1].url(), proxy.url()];
    let c = lock_client!(nodes(urls), lease(secs(30)));
    let guard = c.lock(name).expect("lock on all three");
    for &i in foreign {
        let mut conn = servers[i].conn();
        redis::cmd("DEL")
            .arg(KEYS.lock(name))
            .exec(&mut conn)
            .expect("del");
        redis::cmd("HSET")
            .arg(KEYS.lock(name))
            .arg("f")
            .arg("v")
            .exec(&mut conn)
            .expect("hset");
    }
    // Loads the release script on every master, so that a request armed on the proxy is
    // the script itself (not a NOSCRIPT round).
    let warm = c.force_release("warm-up", 1);
    assert!(matches!(warm, Ok(ForceRelease::NotHeld)), "{warm:?}");
    (c, servers, proxy, guard)
}

/// Redlock: one master has a foreign key at the lock key, the two others hold the lock
/// under a newer fence than the one given. The lock is held (on a majority), so the answer
/// is the fence mismatch, with the fence it is held under, not "not a plain lock".
#[test]
fn redlock_force_release_reports_a_mismatch_beside_a_foreign_key() {
    let (c, servers, _proxy, guard) = redlock_beside_foreign_keys("mixed", &[0]);
    let fence = guard.fencing_token() >> 12;
    let outcome = c.force_release("mixed", fence - 1);
    assert!(
        matches!(outcome, Ok(ForceRelease::FenceMismatch { current: Some(f) }) if f == fence),
        "{outcome:?}"
    );
    assert!(exists(&mut servers[1].conn(), KEYS.lock("mixed")));
    assert!(exists(&mut servers[2].conn(), KEYS.lock("mixed")));
}

/// Redlock: two masters have a foreign key at the lock key, the third deletes the lock but
/// its reply is lost. Whether anything was deleted is unknown to the client: the answer is
/// the connection error, never "not a plain lock" (which says nothing was deleted).
#[test]
fn redlock_force_release_with_a_lost_reply_is_not_refused() {
    let (c, servers, proxy, guard) = redlock_beside_foreign_keys("mixed", &[0, 1]);
    let fence = guard.fencing_token() >> 12;
    proxy.drop_next_reply_matching(fence.to_string().as_bytes());
    let outcome = c.force_release("mixed", fence);
    assert_eq!(proxy.replies_dropped(), 1, "the fault fired");
    assert!(
        !exists(&mut servers[2].conn(), KEYS.lock("mixed")),
        "the third master deleted the lock"
    );
    assert!(
        matches!(&outcome, Err(e) if e.is_connection()),
        "{outcome:?}"
    );
}
