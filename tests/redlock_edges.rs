//! Redlock at its edges: a renewal settled by the majority while the slow node's call is
//! still on its way, then an unlock that races it (either lands first); an `extend` while
//! one node hangs; the validity's start with a slow node; a key left by an acquire whose
//! reply was lost; holds taken in turns by two clients with a slow node; tokens across
//! counters that drifted apart; the details of `NoQuorum`.
//!
//! Timing: the client's lease is 3 s (renewed every 200 ms) with a 2.5 s read timeout, so
//! that a node's calls count as stalled after 1.25 s. The bounds are liveness bounds only.

use std::thread;
use std::time::{Duration, Instant};

use redbaton::{Error, LockClient, LockGuard, Unlocked};
use redbaton_testkit::intervals::{Recorder, most_at_once};
use redbaton_testkit::keys::{Counter, Keys, fence_of};
use redbaton_testkit::proxy::Proxy;
use redbaton_testkit::server::{self, RedisServer};
use redbaton_testkit::wait::wait_until;
use redbaton_testkit::{init_log, lock_client, ms, pttl};

const PREFIX: &str = "re:";
const KEYS: Keys = Keys::new(PREFIX);
/// The client's lease.
const LEASE: Duration = Duration::from_secs(3);
/// The client's read (and connect, write) timeout.
const IO: Duration = Duration::from_millis(2500);

/// `n` servers, each behind a proxy, and a client of the proxies.
fn proxied(n: usize) -> (Vec<RedisServer>, Vec<Proxy>, LockClient) {
    init_log();
    let servers = server::start_many(n);
    let proxies: Vec<Proxy> = servers.iter().map(|s| Proxy::start(s.addr())).collect();
    let client = client_of(&proxies);
    (servers, proxies, client)
}

/// A client of the nodes behind `proxies`: [`LEASE`], [`IO`] timeouts, renewals every
/// 200 ms.
fn client_of(proxies: &[Proxy]) -> LockClient {
    let urls: Vec<String> = proxies.iter().map(Proxy::url).collect();
    lock_client!(
        nodes(urls),
        key_prefix(PREFIX),
        lease(LEASE),
        io_timeouts(IO),
        renew_interval(ms(200))
    )
}

/// The keys of `name` on `srv` but its fence counter (the lock key, its lease record).
fn keys_of(srv: &RedisServer, name: &str) -> Vec<String> {
    srv.keys_but_fences(&format!("{}*", KEYS.lock(name)))
}

/// The drift margin of a lease: lease × 1% + 2 ms.
fn drift(lease: Duration) -> Duration {
    lease / 100 + ms(2)
}

/// `guard`'s validity counts from before the lease change that set it was sent, and that
/// was sent no later than `sent` (give or take `slack`): it ends no later than a lease,
/// less the drift margin, from then.
fn assert_validity_bounded(what: &str, guard: &LockGuard, sent: Instant, slack: Duration) {
    let bound = sent + slack + LEASE - drift(LEASE);
    let valid = guard.valid_until();
    assert!(
        valid <= bound,
        "{what}: valid until {:?} past the bound",
        valid - bound
    );
}

#[test]
fn smoke() {
    let (servers, _proxies, client) = proxied(3);
    let guard = client.lock("smoke").expect("lock");
    for s in &servers {
        assert!(pttl(&mut s.conn(), KEYS.lock("smoke")) > 0);
    }
    assert_eq!(guard.unlock().expect("unlock"), Unlocked::Released);
    for s in &servers {
        assert_eq!(keys_of(s, "smoke"), Vec::<String>::new());
    }
}

/// A renewal that the two fast nodes settled while the third node's call is held up on the
/// way there (1 s), then an unlock: whether the release reaches the slow node before the
/// late renewal or after it, no key of the hold is left there once both landed (the
/// renewal is a compare-and-`PEXPIRE`, which cannot bring a deleted key back), and the
/// unlock says `Released`.
#[test]
fn a_late_renewal_on_a_slow_node_does_not_outlive_the_unlock() {
    let (servers, proxies, client) = proxied(3);
    for release_first in [true, false] {
        let name = format!("late-{release_first}");
        let guard = client.lock(&name).expect("lock");
        // Every request to node 2 from now on takes a second to arrive (its replies too):
        // the next renewal there is on its way while the fast nodes settle it.
        proxies[2].set_delay_both(ms(1000));
        let slowed = Instant::now();
        thread::sleep(ms(400));
        let valid = guard.valid_until();
        assert!(
            valid > slowed + LEASE - ms(600),
            "renewed by the majority meanwhile: valid for {:?} more",
            valid.saturating_duration_since(Instant::now())
        );
        if release_first {
            // The release overtakes the renewal still on its way.
            proxies[2].set_delay_both(Duration::ZERO);
        }
        let outcome = guard.unlock().expect("unlock");
        assert_eq!(
            outcome,
            Unlocked::Released,
            "release first: {release_first}"
        );
        // The release lands on the slow node (the unlock did not wait for it), and the
        // late renewal has landed too (sent by 400 ms, a second on the way): nothing of
        // the hold is left, nor brought back.
        let gone = wait_until(ms(4000), || keys_of(&servers[2], &name).is_empty());
        thread::sleep((slowed + ms(1800)).saturating_duration_since(Instant::now()));
        proxies[2].heal();
        assert!(gone, "release first: {release_first}");
        for (i, s) in servers.iter().enumerate() {
            assert_eq!(
                keys_of(s, &name),
                Vec::<String>::new(),
                "node {i} after the unlock (release first: {release_first})"
            );
        }
    }
}

/// An `extend` to a lease shorter than the read timeout while one node of three hangs
/// (every request to it held on the way): the two others answer at once, and that is the
/// outcome: the hold is extended, not lost, and renewed on by the majority.
#[test]
fn extend_while_one_node_hangs_is_decided_by_the_majority() {
    let (servers, proxies, client) = proxied(3);
    let guard = client.lock("extend").expect("lock");
    proxies[2].stall(true);
    let began = Instant::now();
    let extended = guard.extend(ms(900));
    let took = began.elapsed();
    thread::sleep(ms(1200).saturating_sub(began.elapsed()));
    let lost = guard.is_lost();
    let check = guard.check();
    proxies[2].heal();
    extended.unwrap_or_else(|e| panic!("extend after {took:?}: {e}"));
    assert!(!lost, "lost 1.2 s after an extend to 900 ms: {check:?}");
    check.expect("held");
    for s in &servers[..2] {
        assert!(pttl(&mut s.conn(), KEYS.lock("extend")) > 0);
    }
    assert!(guard.unlock().expect("unlock").was_held());
}

/// Two nodes of three down: `try_lock` fails with `NoQuorum`, whose details are this
/// round's: one node granted, two were needed, of three.
#[test]
fn no_quorum_tells_the_round() {
    let (servers, _proxies, client) = proxied(3);
    drop(client.lock("warm").expect("lock"));
    servers[1].kill();
    servers[2].kill();
    match client.try_lock("nq") {
        Err(Error::NoQuorum {
            granted,
            needed,
            nodes,
        }) => assert_eq!((granted, needed, nodes), (1, 2, 3)),
        other => panic!("{:?}", other.map(|g| g.fencing_token())),
    }
    assert_eq!(keys_of(&servers[0], "nq"), Vec::<String>::new());
}

/// One node 300 ms away each way: the acquisition waits for its reply, and the validity
/// still counts from before the first request was sent (not from the replies), and every
/// renewal settled by the two fast nodes meanwhile keeps it within a lease of its sending.
#[test]
fn validity_counts_from_before_the_requests_with_a_slow_node() {
    let (_servers, proxies, client) = proxied(3);
    // The acquisition is checked on a client that does not renew: a renewal that the
    // other's watchdog sends as soon as the lock is handed over (its 200 ms are long
    // past) would move the validity before the check reads it.
    let urls: Vec<String> = proxies.iter().map(Proxy::url).collect();
    let unrenewed = lock_client!(
        nodes(urls),
        key_prefix(PREFIX),
        lease(LEASE),
        io_timeouts(IO),
        auto_renew(false)
    );
    drop(unrenewed.lock("warm").expect("warm up"));
    drop(client.lock("warm").expect("warm up"));
    proxies[2].set_delay_both(ms(300));
    let before = Instant::now();
    let acquired = unrenewed.lock("acquired").expect("lock");
    // The requests go out at once (a few ms at most), the slow node answers 600 ms later.
    assert_validity_bounded("acquired", &acquired, before, ms(100));
    assert_eq!(acquired.unlock().expect("unlock"), Unlocked::Released);
    let guard = client.lock("valid").expect("lock");
    for _ in 0..6 {
        thread::sleep(ms(150));
        assert_validity_bounded("renewed", &guard, Instant::now(), Duration::ZERO);
        guard.check().expect("held by the majority's renewals");
    }
    proxies[2].heal();
    assert_eq!(guard.unlock().expect("unlock"), Unlocked::Released);
}

/// The node whose reply to the acquisition was lost holds our token (the script ran): the
/// hold is the other two's, and the unlock deletes the key there too.
#[test]
fn an_unlock_deletes_the_key_whose_acquire_reply_was_lost() {
    let (servers, proxies, client) = proxied(3);
    drop(client.lock("warm").expect("warm up"));
    proxies[2].drop_next_reply_matching(KEYS.lock("lost-reply").as_bytes());
    let guard = client.lock("lost-reply").expect("lock");
    assert!(!proxies[2].drop_armed(), "the acquire's reply was lost");
    assert!(
        pttl(&mut servers[2].conn(), KEYS.lock("lost-reply")) > 0,
        "the acquire ran on the node whose reply was lost"
    );
    assert_eq!(guard.unlock().expect("unlock"), Unlocked::Released);
    for (i, s) in servers.iter().enumerate() {
        assert_eq!(keys_of(s, "lost-reply"), Vec::<String>::new(), "node {i}");
    }
}

/// Two clients (two processes' worth of state) take turns on one name for two seconds,
/// each hold longer than a renewal interval, while one node is 120 ms away: renewals are
/// settled by the fast majority with the slow node's calls still on their way. No two
/// holds that were still valid at their end overlap, and tokens only grow.
#[test]
fn holds_do_not_overlap_while_renewals_settle_without_the_slow_node() {
    let (_servers, proxies, first) = proxied(3);
    let second = client_of(&proxies);
    for client in [&first, &second] {
        drop(client.lock("turns").expect("warm up"));
    }
    proxies[2].set_delay_both(ms(120));
    let recorder = Recorder::new();
    let tokens = std::sync::Mutex::new(Vec::new());
    let until = Instant::now() + ms(2000);
    thread::scope(|s| {
        for client in [&first, &second] {
            let (recorder, tokens) = (&recorder, &tokens);
            s.spawn(move || {
                while Instant::now() < until {
                    let guard = client.lock("turns").expect("lock");
                    let held = recorder.time("held", || {
                        thread::sleep(ms(250));
                        guard.check().is_ok()
                    });
                    assert!(held, "a hold lost with a majority renewing it");
                    let token = guard.fencing_token();
                    assert!(guard.unlock().expect("unlock").was_held());
                    tokens.lock().expect("tokens").push(token);
                }
            });
        }
    });
    proxies[2].heal();
    let intervals = recorder.intervals();
    assert!(intervals.len() >= 3, "{} holds", intervals.len());
    assert_eq!(most_at_once(&intervals), 1, "{intervals:?}");
    let tokens = tokens.into_inner().expect("tokens");
    assert!(tokens.windows(2).all(|w| w[0] < w[1]), "{tokens:?}");
}

/// The fence counters of three nodes far apart (one at 5,000, two at 10): a hold won by
/// the high node and a low one, then one won by the two low ones. The second token is
/// still the higher: the first round raised its low node to the fence it handed out
/// before handing it out, and every later majority has that node or the high one.
#[test]
fn tokens_grow_across_majorities_whose_counters_drifted_apart() {
    let (servers, proxies, client) = proxied(3);
    for (s, value) in servers.iter().zip(["5000", "10", "10"]) {
        let _: () = redis::cmd("SET")
            .arg(KEYS.fence("drift"))
            .arg(value)
            .query(&mut s.conn())
            .expect("SET the counter");
    }
    let name = KEYS.lock("drift");
    let mut last = 0;
    for without in [2, 0] {
        let guard = proxies[without]
            .refusing_requests_matching(name.as_bytes(), || client.lock("drift"))
            .expect("lock by the two other nodes");
        let fence = fence_of(guard.fencing_token());
        assert!(
            fence > last,
            "fence {fence} after {last} (without node {without})"
        );
        for (i, s) in servers.iter().enumerate().filter(|(i, _)| *i != without) {
            let counter = Counter::read(&mut s.conn(), KEYS.fence("drift").as_bytes());
            assert_eq!(counter.map(|c| c.fence), Some(fence), "node {i}");
        }
        last = fence;
        assert_eq!(guard.unlock().expect("unlock"), Unlocked::Released);
    }
}
