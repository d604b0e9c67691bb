//! The checks of the shared holds (`redbaton_model::shared`): a read-write lock (with
//! upgrades, downgrades, local turns, and resends with late wins given back) and a
//! semaphore hold every property; a grant taken without the nonce rule, a renewal that
//! revives, an unanswered upgrade whose guard is kept, an unanswered downgrade whose write
//! hold a local turn takes over and a member reused after a late give-back break
//! exclusion; the bound on a permit left free while a permit-seeker waits is tight.

use redbaton_model::shared::props::{EXCLUSION, UNCLAIMED};
use redbaton_model::{Grants, Report, SharedConfig, check_shared};

/// Checker threads: the CI machines have 2 cores.
const THREADS: usize = 2;

fn holds(cfg: SharedConfig) -> Report {
    println!("checking {cfg:?}");
    let report = check_shared(cfg, THREADS, None);
    report.assert_holds();
    report
}

/// Checks `cfg`, which holds every property and takes every path its `sometimes`
/// properties name.
fn holds_on_every_path(cfg: SharedConfig) {
    println!("checking {cfg:?}");
    check_shared(cfg, THREADS, None).assert_holds_on_every_path();
}

/// Checks `cfg` until exclusion breaks; the length of the shortest path found.
fn breaks(cfg: SharedConfig) -> usize {
    check_shared(cfg, THREADS, Some(EXCLUSION)).assert_broken(EXCLUSION)
}

#[test]
fn a_read_write_lock_holds_every_property() {
    holds_on_every_path(SharedConfig::rw());
}

#[test]
fn a_semaphore_holds_every_property() {
    holds_on_every_path(SharedConfig::semaphore());
}

#[test]
fn a_semaphore_of_one_permit_holds_every_property() {
    let report = holds(SharedConfig::semaphore_of_one());
    assert_eq!(report.never, ["holds shared"], "one permit is never shared");
}

/// The bound on a permit left free while a permit-seeker waits is tight: one tick less
/// and the checker finds a permit free while the seeker sleeps until its re-check (the
/// messages of two releases lost: a grant and a wake-up nobody heard), so the property is
/// not vacuous.
#[test]
fn the_unclaimed_permit_bound_is_tight() {
    let mut cfg = SharedConfig::semaphore();
    cfg.starve_bound -= 1;
    check_shared(cfg, THREADS, Some(UNCLAIMED)).assert_broken(UNCLAIMED);
}

/// An upgradable reader that upgrades (`try_upgrade`), beside a writer and a reader.
#[test]
fn upgrades_hold_every_property() {
    holds_on_every_path(SharedConfig::upgrade());
}

/// A writer that downgrades to a read hold, a reader that joins it, a second writer.
#[test]
fn downgrades_hold_every_property() {
    holds_on_every_path(SharedConfig::downgrade());
}

/// Each process with a second thread that takes a turn on its hold, the writer
/// downgrading: a turn goes on only while the hold is not known lost.
#[test]
fn local_turns_hold_every_property() {
    holds_on_every_path(SharedConfig::turns());
}

/// A downgrade that goes unanswered may have run: the read hold it made is given back, and
/// a writer gets in. A local turn that takes the write hold over as it was overlaps it
/// (the library marks the write hold lost, `LostReason::Converted`).
#[test]
fn an_unanswered_downgrade_handing_its_hold_to_a_turn_breaks_exclusion() {
    breaks(SharedConfig {
        downgrade_keeps_turns: true,
        ..SharedConfig::turns()
    });
}

/// Upgrades that wait, beside a writer and a reader: marked as a waiting writer (no new
/// reader gets in), woken by the release of the last other hold.
#[test]
fn waiting_upgrades_hold_every_property() {
    holds_on_every_path(SharedConfig::upgrade_waiting());
}

/// An upgrade that goes unanswered may have run: the write hold it made is given back,
/// and a writer gets in. A guard that goes on claiming the upgradable read overlaps it
/// (the library marks it lost, `LostReason::Converted`).
#[test]
fn an_unanswered_upgrade_keeping_its_guard_breaks_exclusion() {
    breaks(SharedConfig {
        upgrade_keeps_guard: true,
        ..SharedConfig::upgrade()
    });
}

/// An attempt whose reply is lost is sent again with the same member; a win whose reply
/// comes after its lease, counted from the first send, ran out is given back, and the
/// wait goes on with a new member. One permit is never shared.
#[test]
fn resends_and_late_give_backs_hold_every_property() {
    for cfg in [SharedConfig::resends(), SharedConfig::resends_of_permits()] {
        let report = holds(cfg);
        assert_eq!(report.never, ["holds shared"], "one reader, one permit");
    }
}

/// The wait's next attempt reuses the member a late win gave back: the give-back runs
/// late, after that attempt won the hold again, and deletes it under its holder; the
/// other process gets in (a reader beside the writer, or the one permit twice).
#[test]
fn reusing_a_given_back_member_breaks_exclusion() {
    for cfg in [SharedConfig::resends(), SharedConfig::resends_of_permits()] {
        breaks(SharedConfig {
            reuse_given_back_member: true,
            ..cfg
        });
    }
}

/// Replies as slow as the read timeout: a renewal may run after its hold expired.
#[test]
fn slow_replies_hold_every_property() {
    holds_on_every_path(SharedConfig::slow_replies());
}

/// A renewal that revives an expired hold, answered in time: its holder goes on while
/// another took the name meanwhile.
#[test]
fn a_renewal_reviving_an_expired_hold_breaks_exclusion() {
    breaks(SharedConfig {
        renewal_revives: true,
        ..SharedConfig::slow_replies()
    });
}

/// A grant taken as the hold from when it is heard: a message read late outlives the
/// hold it granted.
#[test]
fn a_grant_trusted_from_hearing_breaks_exclusion() {
    breaks(SharedConfig::rw().with_grants(Grants::FromHearing));
    breaks(SharedConfig::semaphore_of_one().with_grants(Grants::FromHearing));
}

/// A grant taken whatever attempt's nonce it carries: an older grant outlives its lease.
#[test]
fn a_grant_taken_with_any_nonce_breaks_exclusion() {
    breaks(SharedConfig::rw().with_grants(Grants::AnyNonce));
    breaks(SharedConfig::semaphore_of_one().with_grants(Grants::AnyNonce));
}

/// Every grant confirmed by an attempt holds too.
#[test]
fn confirmed_grants_hold() {
    holds(SharedConfig::rw().with_grants(Grants::Confirmed));
}

/// The longer checks, also `cargo run --release -p redbaton-model --example deep -- 2 shared`.
#[test]
#[ignore = "the long check: run with --release -- --ignored"]
fn deep_shared_configurations_hold_every_property() {
    for cfg in SharedConfig::deep() {
        holds_on_every_path(cfg);
    }
}
