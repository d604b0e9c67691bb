//! Renewals under faults, against a real redis-server (behind the fault-injecting proxy
//! where a node must hang): when the lost signal fires while the watchdog waits on a node
//! that does not answer, and what one bad lock in a batch does to the others.
//!
//! What the file shows: the holder's `lost()` channel fires when its validity (or its
//! `max_hold` cap) ends by the local clock, also while the watchdog is blocked on a
//! renewal that will only time out later; and a batch of renewals in which one lock's key
//! was deleted or changed kind renews every other lock of the batch.
//!
//! Times are generous liveness bounds, never speed claims: the lateness bounds below are
//! far shorter than the read timeout the signal must not wait for.

use std::time::{Duration, Instant};

use redbaton::{Builder, LockClient, LockGuard, LostReason};
use redbaton_testkit::keys::Keys;
use redbaton_testkit::proxy::Proxy;
use redbaton_testkit::server::RedisServer;
use redbaton_testkit::{lock_builder, ms, pttl, secs, test_server};

const PREFIX: &str = "rf:";
const KEYS: Keys = Keys::new(PREFIX);
/// Liveness bound of the waits of the test itself (never a speed claim).
const LIVENESS: Duration = Duration::from_secs(20);

/// A client of `url` under this file's prefix with `lease`, and the settings `more` adds.
fn client_with(url: &str, lease: Duration, more: impl FnOnce(Builder) -> Builder) -> LockClient {
    more(lock_builder!(node(url), key_prefix(PREFIX), lease(lease)))
        .build()
        .expect("client")
}

/// Waits for `guard`'s lost signal; returns the reason and how long after `due` it came
/// (zero if before).
fn lost_after(guard: &LockGuard, due: Instant) -> (LostReason, Duration) {
    let reason = guard
        .lost()
        .recv_timeout(LIVENESS)
        .unwrap_or_else(|e| panic!("no lost signal ({e}); check: {:?}", guard.check()));
    (reason, Instant::now().saturating_duration_since(due))
}

/// A lock is taken, renewed and released.
#[test]
fn smoke() {
    let srv = test_server();
    let c = client_with(&srv.url(), ms(300), |b| b);
    let guard = c.lock("smoke").expect("lock");
    std::thread::sleep(ms(500));
    guard.check().expect("renewed past its first lease");
    assert!(guard.unlock().expect("unlock").was_held());
}

/// A hold of `name` (lease 3 s, read timeout 2.5 s, and the settings `more` adds) whose
/// lease `extend` first cut to `short`, if given, on a node that hangs from then on: the
/// proxy swallows every byte, so each call waits for the read timeout.
struct Hung {
    guard: LockGuard,
    /// Until when the hold was valid as the node began to hang.
    due: Instant,
    proxy: Proxy,
    _client: LockClient,
    _srv: RedisServer,
}

fn hung_hold(name: &str, short: Option<Duration>, more: impl FnOnce(Builder) -> Builder) -> Hung {
    let srv = test_server();
    let proxy = Proxy::start(srv.addr());
    let client = client_with(&proxy.url(), secs(3), |b| more(b.read_timeout(ms(2500))));
    let guard = client.lock(name).expect("lock");
    if let Some(short) = short {
        guard.extend(short).expect("extend");
    }
    proxy.blackhole(true);
    let due = guard.valid_until();
    Hung {
        guard,
        due,
        proxy,
        _client: client,
        _srv: srv,
    }
}

/// The signal `told` came `late` after the end it reports: it must be `want`, and come
/// by the local clock, well before the read timeout (2.5 s) would have let it.
fn assert_told_on_time(told: LostReason, late: Duration, want: LostReason) {
    assert_eq!(told, want);
    assert!(
        late < secs(1),
        "the lost signal ({told:?}) came {late:?} after the end of the hold, as if it \
         waited for a call to a hung node to time out (read timeout 2.5 s)"
    );
}

/// The node hangs after a hold's lease was cut short by `extend`: the watchdog's renewal
/// of it blocks until the read timeout, long after the 600 ms lease ends. The lost signal
/// must fire when the validity ends by the local clock, not when the renewal gives up.
#[test]
fn lost_fires_on_time_while_the_watchdog_waits_on_a_hung_node() {
    let h = hung_hold("hung", Some(ms(600)), |b| b);
    let (reason, late) = lost_after(&h.guard, h.due);
    h.proxy.heal();
    assert_told_on_time(reason, late, LostReason::Expired);
    assert!(h.guard.check().is_err());
}

/// `max_hold` passes while a renewal waits on a hung node: `HoldLimit` is told at the cap,
/// not when the renewal times out, and only once.
#[test]
fn hold_limit_fires_at_the_cap_while_a_renewal_is_in_flight() {
    let h = hung_hold("cap", None, |b| b.renew_interval(ms(200)).max_hold(ms(700)));
    let (reason, late) = lost_after(&h.guard, h.due);
    h.proxy.heal();
    assert_told_on_time(reason, late, LostReason::HoldLimit);
    assert!(h.guard.lost().recv_timeout(ms(300)).is_err());
}

/// Fifteen hundred holds of one node are renewed in batches; one's key was deleted and
/// another's turned into a hash. Those two are told (`Deleted`, `Stolen`); every other
/// hold of their batches stays renewed past several leases.
#[test]
fn one_bad_lock_does_not_fail_its_batch() {
    let srv = test_server();
    let lease = ms(1500);
    let c = client_with(&srv.url(), lease, |b| b);
    let guards: Vec<_> = (0..1500)
        .map(|i| c.lock(format!("many{i}")).expect("lock"))
        .collect();
    let mut conn = srv.conn();
    let _: () = redis::cmd("DEL")
        .arg(KEYS.lock("many7"))
        .query(&mut conn)
        .expect("DEL");
    let _: () = redis::pipe()
        .cmd("DEL")
        .arg(KEYS.lock("many1200"))
        .cmd("HSET")
        .arg(KEYS.lock("many1200"))
        .arg("f")
        .arg("v")
        .query(&mut conn)
        .expect("turn into a hash");
    let deleted = guards[7].lost().recv_timeout(LIVENESS);
    let changed = guards[1200].lost().recv_timeout(LIVENESS);
    assert_eq!(deleted, Ok(LostReason::Deleted));
    assert_eq!(changed, Ok(LostReason::Stolen));
    // Two more leases: only renewals keep the others.
    std::thread::sleep(lease * 2);
    for (i, guard) in guards.iter().enumerate() {
        if i == 7 || i == 1200 {
            continue;
        }
        assert!(guard.check().is_ok(), "many{i}: {:?}", guard.check());
        let left = pttl(&mut conn, KEYS.lock(&format!("many{i}")));
        assert!(left > 0, "many{i} not renewed in Redis: PTTL {left}");
    }
    let kind: String = redis::cmd("TYPE")
        .arg(KEYS.lock("many1200"))
        .query(&mut conn)
        .expect("TYPE");
    assert_eq!(kind, "hash", "the other kind's key is left as it is");
}

/// The holder's own `extend` waits on a hung node (until the read timeout) while its
/// 600 ms validity runs out. A thread that waits on the hold's lost channel meanwhile must
/// be told when the validity ends, not when the extend gives up.
#[test]
fn lost_fires_on_time_while_an_extend_waits_on_a_hung_node() {
    let h = hung_hold("extending", Some(ms(600)), |b| b);
    let (lost, due) = (h.guard.lost().clone(), h.due);
    let listener = std::thread::spawn(move || {
        let reason = lost.recv_timeout(LIVENESS).expect("a lost signal");
        (reason, Instant::now().saturating_duration_since(due))
    });
    let err = h
        .guard
        .extend(secs(3))
        .expect_err("no reply from a hung node");
    let (reason, late) = listener.join().expect("listener");
    h.proxy.heal();
    assert!(!err.is_invalid_input(), "{err:?}");
    assert_told_on_time(reason, late, LostReason::Expired);
}
