//! Lease keeping under faults and at its edges, against a real redis-server (through the
//! fault-injecting proxy where a reply must be late or lost): the watchdog that renews
//! holds, a hold's view of its own validity, and the guard's `extend`/`check`/`lost()`.
//!
//! What the file shows: a holder is told through its `lost()` channel whenever its hold
//! can no longer be counted on, also when the client's watchdog was stopped under it
//! (`shutdown` with a lock still held), not only when `check()` is asked; and
//! `valid_until()` never promises a hold past the point where `check()` fails (a
//! `max_hold` cap shorter than the lease).
//!
//! Times are generous liveness bounds, never speed claims.

use std::time::{Duration, Instant};

use redbaton::{Builder, LockClient, LostReason};
use redbaton_testkit::{lock_builder, ms, secs, test_server};

const PREFIX: &str = "lf:";
/// Liveness bound of the waits of the test itself (never a speed claim).
const LIVENESS: Duration = Duration::from_secs(20);

/// A client of `url` under this file's prefix with `lease`, and the settings `more` adds.
fn client_with(url: &str, lease: Duration, more: impl FnOnce(Builder) -> Builder) -> LockClient {
    more(lock_builder!(node(url), key_prefix(PREFIX), lease(lease)))
        .build()
        .expect("client")
}

fn client(url: &str, lease: Duration) -> LockClient {
    client_with(url, lease, |b| b)
}

/// A lock is taken, extended, checked and released; its validity lies ahead while held.
#[test]
fn smoke() {
    let srv = test_server();
    let c = client(&srv.url(), secs(5));
    let guard = c.lock("smoke").expect("lock");
    guard.check().expect("held");
    guard.extend(secs(10)).expect("extend");
    assert!(guard.valid_until() > std::time::Instant::now() + secs(5));
    assert!(guard.lost().try_recv().is_err());
    assert!(guard.unlock().expect("unlock").was_held());
}

/// A lock (and a detached one) still held when its client is shut down: nothing renews it
/// any more, and its lease runs out. A holder that waits on its `lost()` channel (and asks
/// nothing else: `check()` would find the loss itself) must be told, not left waiting for
/// ever.
#[test]
fn a_hold_left_at_shutdown_is_told_on_its_channel() {
    let srv = test_server();
    let c = client(&srv.url(), ms(600));
    let guard = c.lock("sd").expect("lock");
    let detached = c.lock("sd-detached").expect("lock").detach();
    c.shutdown(secs(5)).expect("shutdown in time");
    // Many leases: the holds have surely run out by the end of it.
    let told = guard.lost().recv_timeout(LIVENESS);
    let told_detached = detached.lost().recv_timeout(secs(1));
    assert!(
        told.is_ok() && told_detached.is_ok(),
        "the leases ran out unrenewed (check: {:?}, {:?}), but the lost channels said \
         nothing: {told:?} {told_detached:?}",
        guard.check(),
        detached.check()
    );
    assert!(guard.check().is_err() && detached.check().is_err());
    drop((guard, detached));
}

/// With a cap on the hold (`max_hold`) shorter than the lease, `check()` fails from the cap
/// on: `valid_until()`, "until when the lock is surely held", must not promise more, on a
/// guard or a detached one.
#[test]
fn validity_ends_by_the_hold_cap() {
    let srv = test_server();
    let c = client_with(&srv.url(), secs(30), |b| b.max_hold(ms(800)));
    let guard = c.lock("cap").expect("lock");
    let detached = c.lock("cap-detached").expect("lock").detach();
    // Both acquisitions began before this: their caps come before it plus 800 ms.
    let capped_by = Instant::now() + ms(800);
    let (valid, valid_detached) = (guard.valid_until(), detached.valid_until());
    assert!(
        valid <= capped_by && valid_detached <= capped_by,
        "valid until {:?} and {:?} after a cap that comes within 800 ms",
        valid.saturating_duration_since(capped_by),
        valid_detached.saturating_duration_since(capped_by)
    );
    // And the cap is where check() starts failing.
    let lost = guard.lost().recv_timeout(LIVENESS);
    assert_eq!(lost.ok(), Some(LostReason::HoldLimit));
    assert!(guard.check().is_err() && Instant::now() >= valid);
}

/// An `extend` that waits for a renewal in flight (stalled in the link) and gets its turn
/// after the hold's cap is refused as lost, with nothing sent: a fresh lease for a hold
/// that ended at its cap would let its holder go on past it, told `Ok`.
#[test]
fn an_extend_that_gets_its_turn_after_the_cap_is_refused() {
    let srv = test_server();
    let proxy = redbaton_testkit::proxy::Proxy::start(srv.addr());
    let c = client_with(&proxy.url(), secs(10), |b| {
        b.renew_interval(ms(100))
            .max_hold(ms(600))
            .read_timeout(secs(5))
    });
    let guard = c.lock("capped").expect("lock");
    proxy.stall(true);
    // The first renewal, due 100 ms after the acquisition, waits in the stalled link.
    std::thread::sleep(ms(300));
    std::thread::scope(|s| {
        s.spawn(|| {
            std::thread::sleep(ms(600));
            proxy.heal();
        });
        let extended = guard.extend(secs(3));
        assert!(
            matches!(extended, Err(redbaton::Error::Lost(LostReason::HoldLimit))),
            "an extend after the cap: {extended:?}"
        );
    });
    assert!(guard.check().is_err());
}
