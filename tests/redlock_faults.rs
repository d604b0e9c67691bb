//! Redlock under faults that the fan-out and the verdicts on the nodes' replies must
//! survive: healthy nodes called by several threads after an idle spell, nodes that lose
//! their keys in a restart right before an unlock, a round cut short by its deadline, a
//! hung node that rounds skip.

use std::sync::{Arc, Barrier};
use std::thread;

use redbaton::{LockClient, Unlocked};
use redbaton_testkit::keys::Keys;
use redbaton_testkit::monitor::{Monitor, script_calls};
use redbaton_testkit::proxy::Proxy;
use redbaton_testkit::server::{self, RedisServer};
use redbaton_testkit::wait::join_within;
use redbaton_testkit::{init_log, lock_client, ms, secs};

const PREFIX: &str = "rf:";
const KEYS: Keys = Keys::new(PREFIX);

/// `n` servers, and their URLs.
fn nodes(n: usize) -> (Vec<RedisServer>, Vec<String>) {
    init_log();
    let servers = server::start_many(n);
    let urls = servers.iter().map(RedisServer::url).collect();
    (servers, urls)
}

/// The token in the lock key of `name` on `srv`, if any.
fn token_on(srv: &RedisServer, name: &str) -> Option<String> {
    redis::cmd("GET")
        .arg(KEYS.lock(name))
        .query(&mut srv.conn())
        .expect("GET the lock key")
}

/// `n` servers, each behind a proxy, and the proxies' URLs.
fn proxied(n: usize) -> (Vec<RedisServer>, Vec<Proxy>, Vec<String>) {
    let (servers, _) = nodes(n);
    let proxies: Vec<Proxy> = servers.iter().map(|s| Proxy::start(s.addr())).collect();
    let urls = proxies.iter().map(Proxy::url).collect();
    (servers, proxies, urls)
}

/// Sets the fence counter of `name` on `srv` far ahead of the server's clock (a node whose
/// clock ran ahead, or that issued fences the others never saw): a hold it grants takes
/// its fence and must raise the other granting nodes to it. The value set.
fn counter_ahead(srv: &RedisServer, name: &str) -> u64 {
    let ahead: u64 = redis::cmd("TIME")
        .query::<(u64, u64)>(&mut srv.conn())
        .map(|(s, us)| s * 1_000_000 + us + 100_000_000_000_000)
        .expect("TIME");
    let _: () = redis::cmd("SET")
        .arg(KEYS.fence(name))
        .arg(ahead)
        .query(&mut srv.conn())
        .expect("SET the counter ahead");
    ahead
}

/// The bytes that tell the raise of `name`'s fence counter from other requests: it is the
/// one script of a single key called on the counter.
fn raise_request(name: &str) -> String {
    let fence_key = KEYS.fence(name);
    format!("$1\r\n1\r\n${}\r\n{fence_key}", fence_key.len())
}

#[test]
fn smoke() {
    let (servers, urls) = nodes(3);
    let client = lock_client!(nodes(urls), key_prefix(PREFIX));
    let guard = client.lock("smoke").expect("lock");
    let token = token_on(&servers[0], "smoke").expect("held on node 0");
    for s in &servers {
        assert_eq!(token_on(s, "smoke").as_deref(), Some(token.as_str()));
    }
    assert_eq!(guard.unlock().expect("unlock"), Unlocked::Released);
}

/// Healthy nodes, each behind a link with 150 ms of latency (a tenth of the 1.5 s a call
/// may take before its node counts as stalled), idle for longer than that bound. Then
/// several threads take different locks at once: every node answers every call in about
/// 150 ms, so every `try_lock` is granted by every node. No node is skipped as stalled
/// merely because its workers are busy with calls that have just started, after a spell
/// in which no call ended because none was made.
#[test]
fn busy_workers_after_an_idle_spell_are_not_a_stall() {
    let (_servers, proxies, urls) = proxied(3);
    let client = Arc::new(lock_client!(
        nodes(urls),
        key_prefix(PREFIX),
        read_timeout(secs(3))
    ));
    client
        .lock("warm")
        .expect("warm-up lock")
        .unlock()
        .expect("warm-up unlock");
    for p in &proxies {
        p.set_delay(ms(150));
    }
    // Longer than the stall bound (half the read timeout) with no call at all.
    thread::sleep(ms(1_800));
    let threads = 6;
    let start = Arc::new(Barrier::new(threads));
    let workers = (0..threads)
        .map(|i| {
            let (client, start) = (client.clone(), start.clone());
            thread::spawn(move || {
                start.wait();
                let got = client.try_lock(format!("busy{i}"));
                got.map(|g| g.unlock()).map_err(|e| format!("{e:?}"))
            })
        })
        .collect();
    let outcomes = join_within(workers, secs(30), "the lockers");
    eprintln!("{outcomes:?}");
    for (i, outcome) in outcomes.into_iter().enumerate() {
        let unlocked = outcome.unwrap_or_else(|e| panic!("locker {i}: {e}"));
        assert_eq!(unlocked.expect("unlock"), Unlocked::Released, "locker {i}");
    }
}

/// Granted by all three nodes; then two of them restart empty (they lose our key) and the
/// holder unlocks before any renewal has looked. The client's pooled connections to the
/// restarted nodes are dead, so their releases fail once and are tried again, and find no
/// key: only the one node that kept the key deleted it. A minority's delete is no release
/// of a Redlock (while the two were empty another majority could be taken): the unlock
/// must not report `Released`.
#[test]
fn an_unlock_deleted_by_a_minority_is_not_released() {
    let (servers, urls) = nodes(3);
    let client: LockClient = lock_client!(nodes(urls), key_prefix(PREFIX), lease(secs(30)));
    let guard = client.lock("gone").expect("lock on all three");
    for s in &servers {
        assert!(token_on(s, "gone").is_some(), "granted by every node");
    }
    servers[1].restart();
    servers[2].restart();
    let outcome = guard.unlock();
    eprintln!("unlock after two of three restarted empty: {outcome:?}");
    assert!(
        !matches!(outcome, Ok(Unlocked::Released)),
        "only one node of three deleted the key, yet unlock said {outcome:?}"
    );
    assert_eq!(token_on(&servers[0], "gone"), None, "deleted where it was");
}

/// Two nodes of three answer only after a second: a wait of 300 ms cannot reach a
/// majority in time. It ends as any wait whose deadline passes: `Timeout` (and counted as
/// one), not the `NoQuorum` of a round whose replies were cut short by that deadline.
#[test]
fn a_wait_whose_deadline_cuts_the_round_short_times_out() {
    let (_servers, proxies, urls) = proxied(3);
    let client = lock_client!(nodes(urls), key_prefix(PREFIX), read_timeout(secs(3)));
    client
        .lock("slow")
        .expect("warm-up lock")
        .unlock()
        .expect("warm-up unlock");
    for p in &proxies[1..] {
        p.set_delay(secs(1));
    }
    let timeouts = client.stats().timeouts;
    let outcome = client.try_lock_for("slow", ms(300)).map(drop);
    assert!(
        matches!(outcome, Err(ref e) if e.is_timeout()),
        "a 300 ms wait with two nodes of three a second away: {outcome:?}"
    );
    assert_eq!(client.stats().timeouts, timeouts + 1);
}

/// One node of three hung (stopped) while a waiter waits for a lock the other two hold
/// for someone else: after the first call to it (which may have run, and is given back
/// when the node answers again), the rounds skip it and send it nothing. A skipped call
/// ran nowhere, so nothing is given back there for it: once the node answers again, every
/// token a script call brings it is one an acquisition brought it first.
#[test]
fn nothing_is_given_back_where_a_skipped_call_never_went() {
    let (servers, urls) = nodes(3);
    let holder = lock_client!(nodes(urls.clone()), key_prefix(PREFIX));
    let waiter = lock_client!(
        nodes(urls),
        key_prefix(PREFIX),
        read_timeout(secs(1)),
        recheck_interval(ms(100))
    );
    let held = holder.lock("hung").expect("lock");
    let monitor = Monitor::start(&servers[2]);
    servers[2].pause();
    let waited = waiter.try_lock_for("hung", secs(3)).map(drop);
    assert!(waited.is_err(), "held by a majority: {waited:?}");
    servers[2].resume();
    // The cleanup job's give-backs, tried again every 100 ms, reach the node now.
    thread::sleep(secs(3));
    let calls = script_calls(&monitor.flush(&servers[2]));
    let mut acquired = std::collections::HashSet::new();
    let acquire = calls.first().map(|c| c.sha.clone());
    let mut stray = Vec::new();
    for call in &calls {
        let Some(token) = call.argv.first() else {
            continue;
        };
        if Some(&call.sha) == acquire.as_ref() {
            acquired.insert(token.clone());
        } else if !acquired.contains(token) {
            stray.push(token.clone());
        }
    }
    eprintln!(
        "{} script calls on the hung node after it answered again, {} acquisitions",
        calls.len(),
        acquired.len()
    );
    assert!(
        stray.is_empty(),
        "{} give-backs of tokens that never reached the node: {stray:?}",
        stray.len()
    );
    drop(held);
}

/// One node of three hung (stopped) under a held lock: the watchdog's renewals skip it
/// once its calls stall, and a skipped renewal is not one sent. `renewals_sent` counts the
/// renewals that reached a node, as the two answering nodes saw them.
#[test]
fn renewals_skipped_on_a_hung_node_are_not_counted_as_sent() {
    let (servers, urls) = nodes(3);
    let client = lock_client!(
        nodes(urls),
        key_prefix(PREFIX),
        read_timeout(secs(1)),
        lease(secs(10)),
        renew_interval(ms(200))
    );
    let held = client.lock("renewed").expect("lock");
    servers[2].pause();
    // The first renewal to the stopped node waits out its read timeout; after it, that
    // node's renewals are skipped.
    thread::sleep(secs(2));
    let monitors: Vec<Monitor> = servers[..2].iter().map(Monitor::start).collect();
    let before = client.stats().renewals_sent;
    thread::sleep(secs(2));
    let sent = client.stats().renewals_sent - before;
    let seen: usize = monitors
        .iter()
        .zip(&servers)
        .map(|(m, s)| script_calls(&m.flush(s)).len())
        .sum();
    servers[2].resume();
    eprintln!("renewals_sent {sent}, renewal calls seen on the two answering nodes {seen}");
    assert!(seen > 0, "no renewal reached the answering nodes");
    // A renewal in flight at either edge of the window may be counted on one side only.
    assert!(
        sent <= seen as u64 + 2,
        "{sent} renewals counted as sent, {seen} reached the nodes that answer"
    );
    assert!(!held.is_lost(), "a majority renews it");
    drop(held);
}

/// A round that a majority granted, but whose fence too few of the granting nodes carry
/// once the raises are done (the raise lost on its way), is nobody's hold and is undone on
/// every node that may hold its token: also on the node whose reply to the attempt was
/// lost, where the attempt ran and left the token with a whole lease. Left there, the
/// name would need both other nodes for a lease, and one more fault would refuse it.
#[test]
fn a_round_undone_after_its_raise_failed_is_given_back_where_a_reply_was_lost() {
    let (servers, proxies, urls) = proxied(3);
    let name = "stray";
    let client = lock_client!(
        nodes(urls),
        key_prefix(PREFIX),
        lease(secs(30)),
        auto_renew(false)
    );
    // The scripts loaded everywhere, so that the request whose reply is lost is the
    // attempt itself.
    drop(client.lock("warm").expect("warm-up"));
    counter_ahead(&servers[0], name);
    let raise = raise_request(name);
    // The third node runs every attempt sent to it, and answers none.
    let taken = proxies[2].losing_replies_matching(KEYS.lock(name).as_bytes(), || {
        proxies[1].refusing_requests_matching(raise.as_bytes(), || client.try_lock(name))
    });
    assert!(
        proxies[2].replies_dropped() > 0,
        "no attempt reached the third node"
    );
    assert!(
        proxies[1].requests_refused() > 0,
        "no raise was sent to the node behind"
    );
    let e = taken
        .map(drop)
        .expect_err("a fence that no majority carries");
    eprintln!("the round whose raise was lost: {e}");
    let given_back =
        redbaton_testkit::wait::wait_until(secs(10), || token_on(&servers[2], name).is_none());
    assert!(
        given_back,
        "the token left where the reply was lost, for a lease ({e})"
    );
}

/// One node's fence counter is far ahead of the others' (its clock ran ahead, or it issued
/// fences the others never saw), so a hold granted by all three takes that node's fence and
/// must raise the two behind to it: a later majority of those two alone then issues a
/// higher token. Here every raise is lost on its way to the two, and the hold is then left
/// to expire (its holder crashed). No token handed out may be below one handed out before:
/// a hold whose fence a majority does not carry is not handed out.
#[test]
fn a_hold_whose_fence_no_majority_carries_is_not_handed_out() {
    let (servers, proxies, urls) = proxied(3);
    let name = "raised";
    let ahead = counter_ahead(&servers[0], name);
    let client = lock_client!(
        nodes(urls.clone()),
        key_prefix(PREFIX),
        lease(secs(1)),
        auto_renew(false)
    );
    let raise = raise_request(name);
    let first = proxies[1].refusing_requests_matching(raise.as_bytes(), || {
        proxies[2]
            .refusing_requests_matching(raise.as_bytes(), || client.try_lock_for(name, secs(2)))
    });
    let refused = proxies[1].requests_refused() + proxies[2].requests_refused();
    assert!(refused > 0, "no raise was sent to the nodes behind");
    let mut tokens = Vec::new();
    match first {
        Ok(guard) => {
            tokens.push(guard.fencing_token());
            // The holder crashes: no release writes its fence back.
            std::mem::forget(guard);
            thread::sleep(ms(1_500));
        }
        Err(e) => eprintln!("the hold whose raises were lost: {e}"),
    }
    // The node that was ahead is gone; the two behind are a majority, for another process.
    proxies[0].blackhole(true);
    let other = lock_client!(nodes(urls), key_prefix(PREFIX), read_timeout(secs(1)));
    let second = thread::scope(|s| {
        s.spawn(|| {
            let guard = other
                .try_lock_for(name, secs(10))
                .expect("a majority of two");
            guard.fencing_token()
        })
        .join()
        .expect("the second holder")
    });
    tokens.push(second);
    eprintln!("tokens: {tokens:?} (counter ahead at {ahead})");
    assert!(
        tokens.windows(2).all(|w| w[1] > w[0]),
        "a token went backwards: {tokens:?}"
    );
}
