//! The checks of the shared holds (`redbaton_model::shared`): a read-write lock (with
//! upgrades, downgrades, local turns, and resends with late wins given back) and a
//! semaphore hold every property; a grant taken without the nonce rule, a renewal that
//! revives, an unanswered upgrade whose guard is kept, an unanswered downgrade whose write
//! hold a local turn takes over and a member reused after a late give-back break
//! exclusion; the bound on a permit left free while a permit-seeker waits is tight. With
//! a first send stalled to land after its retry, every property holds, no hold for nobody
//! included, and each of the cleanup's rules is needed: without it the checker finds a
//! late send holding (or granted, or marking a waiting writer) for nobody.

use redbaton_model::shared::props::{EXCLUSION, ORPHAN, UNCLAIMED};
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

/// Checks `cfg` until a late first send holds for nobody; the length of the shortest
/// path found, printed.
fn orphans(cfg: SharedConfig) -> usize {
    let steps = check_shared(cfg, THREADS, Some(ORPHAN)).assert_broken(ORPHAN);
    println!("a hold for nobody after {steps} steps");
    steps
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

/// The longer checks of stalled first sends, also `cargo run --release -p redbaton-model
/// --example deep -- 2 stalls`. One permit is never shared.
#[test]
#[ignore = "the long check: run with --release -- --ignored"]
fn deep_stalled_configurations_hold_every_property() {
    for cfg in SharedConfig::deep_stalls() {
        let one_permit = cfg.permits == 1;
        let report = holds(cfg);
        let never: &[&str] = if one_permit { &["holds shared"] } else { &[] };
        assert_eq!(report.never, never);
    }
}

/// The first send of an attempt stalled, landing after its retry: after the hold the retry
/// won was released, after the retry was answered `held`, or after the wait gave up. The
/// cleanup's looks again give back what it takes, within the tick it lands.
#[test]
fn stalled_first_sends_hold_every_property() {
    for cfg in [SharedConfig::stalls(), SharedConfig::stalls_of_permits()] {
        let report = holds(cfg);
        assert_eq!(report.never, ["holds shared"], "one reader, one permit");
    }
}

/// The same beside a second reader: a late send marks a writer waiting, is granted a
/// hold, or takes one, beside other holds.
/// Three permit-seekers for two permits, a first send stalled: the bound on a permit
/// left free holds beside late landings too.
#[test]
fn stalled_first_sends_of_three_permit_seekers_hold_every_property() {
    holds_on_every_path(SharedConfig::stalled_semaphore());
}

#[test]
fn stalled_first_sends_beside_a_second_reader_hold_every_property() {
    holds_on_every_path(SharedConfig::stalled_rw());
}

/// Without the look again after the release of a hold won by a retry, the first send
/// lands after the release and takes the write hold (or the permit) for nobody.
#[test]
fn no_look_again_after_the_release_leaves_a_hold_for_nobody() {
    for cfg in [SharedConfig::stalls(), SharedConfig::stalls_of_permits()] {
        orphans(cfg.without_look_again());
    }
}

/// A writer whose hold, won by a retry, is downgraded and released; the first send lands
/// after the downgrade or after the release.
#[test]
fn stalled_downgrades_hold_every_property() {
    holds_on_every_path(SharedConfig::stalled_downgrades());
}

/// Without the look again at the member a downgrade retired, the first send of the write
/// attempt, landing while the read hold is held, marks the writer waiting: the release of
/// the read hold grants the write hold to that mark, to nobody.
#[test]
fn no_look_again_at_a_downgraded_member_leaves_a_hold_for_nobody() {
    orphans(SharedConfig::stalled_downgrades().without_look_again_at_turned());
}

/// An upgradable read whose hold, won by a retry, is upgraded and released; an upgrade
/// whose first send lands after its retry was refused (the guard keeping its upgradable
/// read) turns it into the write hold, which the guard's release gives back.
#[test]
fn stalled_upgrades_hold_every_property() {
    holds_on_every_path(SharedConfig::stalled_upgrades());
}

/// Without `SHARED_RELEASE` giving back the write hold a late upgrade made of the
/// upgradable read, the guard's release leaves it for nobody.
#[test]
fn an_upgradable_release_leaving_the_turned_write_hold_leaves_it_for_nobody() {
    orphans(SharedConfig::stalled_upgrades().without_turned_give_back());
}

/// Without the look again at the member an upgrade retired, the first send of the
/// upgradable read, landing after the write hold's release, takes it for nobody.
#[test]
fn no_look_again_at_an_upgraded_member_leaves_a_hold_for_nobody() {
    orphans(SharedConfig::stalled_upgrades().without_look_again_at_turned());
}

/// Waits with a deadline (tick 2), and calls that do not wait (permits): a retry answered
/// `held` leaves its member unsettled when the wait ends, or when the call that does not
/// wait is refused; the first send lands after that, and the cleanup gives it back. The
/// waits end before a late win (or, for calls that leave no mark, a grant) is reached.
#[test]
fn stalled_deadlines_and_tries_hold_every_property() {
    let late_win = "a hold won after a late win was given back";
    let report = holds(SharedConfig::stalled_deadlines());
    assert_eq!(report.never, [late_win, "holds shared"]);
    let report = holds(SharedConfig::stalled_tries_of_permits());
    let never = ["a permit taken from its grant", late_win, "holds shared"];
    assert_eq!(report.never, never);
}

/// Without the give-back of a member left unsettled when the wait ends (its leave made)
/// or the call that does not wait is refused, the first send lands after that and holds
/// (or marks a waiting writer) for nobody.
#[test]
fn no_give_back_of_an_unsettled_member_leaves_a_hold_for_nobody() {
    for cfg in [
        SharedConfig::stalled_deadlines(),
        SharedConfig::stalled_tries_of_permits(),
    ] {
        orphans(cfg.without_unsettled_handed_on());
    }
}

/// An upgrade that waits (`try_upgrade_for`, here until tick 3), whose first send is
/// stalled, holds every property, and a late landing is reached and given back.
#[test]
fn stalled_waiting_upgrades_hold_every_property() {
    let report = holds(SharedConfig::stalled_waiting_upgrades());
    let never = [
        "a read hold taken from its grant",
        "a hold won after a late win was given back",
    ];
    assert_eq!(report.never, never, "the waits end at tick 3");
}

/// A fault this check found in the library (19 steps, the stall the only fault it
/// needs), with the release of the upgradable read leaving its waiting-upgrade mark: by
/// tick 1 the upgradable read `u0` and a reader's read hold are taken; at tick 2 the
/// upgrade is called and its first send held back; at tick 3 its retry, answered `held`
/// (the reader holds), marks `u0` as a waiting writer, the deadline has come, and the wait
/// ends with `WAITER_UNMARK`: the guard keeps its upgradable read. At tick 4 the guard
/// lets go; the first send lands before that release runs, finds `u0` and the reader's
/// hold, and marks `u0` waiting again, and the release leaves that mark: a waiting-writer
/// mark of nobody holds every new reader back until it expires (two re-check intervals)
/// or the reader's release wakes it.
#[test]
fn a_release_leaving_a_late_upgrade_mark_holds_readers_back_for_nobody() {
    orphans(SharedConfig::stalled_waiting_upgrades().without_upgrade_mark_released());
}
