//! The checks `cargo test -p redbaton-model` runs: the CI configuration holds every
//! property, and each protocol rule left out makes the checker find the violation it
//! prevents.

use redbaton_model::props::{EXCLUSION, LOST_NEWS, ORPHAN, STARVATION};
use redbaton_model::{Config, Grants, Rules, check};

/// Checker threads: the CI machines have 2 cores.
const THREADS: usize = 2;

#[test]
fn ci_configuration_holds_every_property() {
    let cfg = Config::ci();
    println!("checking {cfg:?}");
    let report = check(cfg, THREADS, None);
    report.assert_holds_on_every_path();
}

/// A late win left for the next attempt, which finds its token and confirms it, instead
/// of given back with its token retired: the alternative to the library's rule holds too.
#[test]
fn keeping_late_wins_holds_every_property() {
    let report = check(Config::ci().keeping_late_wins(), THREADS, None);
    report.assert_holds_on_every_path();
}

/// Checks `cfg` until `property` is violated, and returns the length of the shortest path
/// to that (a variant may break other properties on the way: they are printed too).
fn violation(cfg: Config, property: &'static str) -> usize {
    check(cfg, THREADS, Some(property)).assert_broken(property)
}

#[test]
fn without_the_extend_fix_exclusion_breaks() {
    let steps = violation(Config::ci().without_extend_fix(), EXCLUSION);
    println!("counterexample path length: {steps}");
}

#[test]
fn without_the_min_rule_a_lost_extend_reply_breaks_exclusion() {
    violation(
        Config::ci().with_rules(Rules {
            min_on_unknown: false,
            ..Rules::FIXED
        }),
        EXCLUSION,
    );
}

#[test]
fn without_ordered_lease_changes_a_late_renewal_breaks_exclusion() {
    violation(
        Config::ci().with_rules(Rules {
            ordered_changes: false,
            ..Rules::FIXED
        }),
        EXCLUSION,
    );
}

/// The library before grants were confirmed: the message taken for the lock, valid for
/// the grant lease from when it was read.
#[test]
fn a_grant_trusted_from_hearing_breaks_exclusion() {
    violation(Config::ci().with_grants(Grants::FromHearing), EXCLUSION);
}

/// A grant taken whatever attempt's nonce it carries, bounded by the latest attempt's
/// send: an older grant, heard late, outlives its lease.
#[test]
fn a_grant_taken_with_any_nonce_breaks_exclusion() {
    violation(Config::ci().with_grants(Grants::AnyNonce), EXCLUSION);
}

/// A grant after a loss must carry no nonce: one that carries its entry's is taken as
/// the lock by its grantee, which is then told nothing was lost.
#[test]
fn a_grant_after_a_loss_with_a_nonce_makes_previous_lost_wrong() {
    violation(
        Config::ci().with_rules(Rules {
            confirm_after_loss: false,
            ..Rules::FIXED
        }),
        LOST_NEWS,
    );
}

/// An attempt given back unused must leave the counter as the hold before it left it:
/// one that marks it released hides a loss from the next holder.
#[test]
fn a_give_back_that_marks_the_counter_released_makes_previous_lost_wrong() {
    violation(
        Config::ci().with_rules(Rules {
            transparent_give_back: false,
            ..Rules::FIXED
        }),
        LOST_NEWS,
    );
}

/// A won attempt whose reply comes after its lease (counted from its first send) ran out
/// is given back with its token; were the fair queue's next attempt to reuse that token,
/// a give-back that runs after that attempt won would delete or pass on the lock under
/// its holder (the library before `Contest::retire_token`).
#[test]
fn reusing_a_given_back_token_breaks_exclusion() {
    let steps = violation(
        Config::ci().with_rules(Rules {
            retire_given_back_token: false,
            ..Rules::FIXED
        }),
        EXCLUSION,
    );
    println!("counterexample path length: {steps}");
}

/// A lock won by a retry after a lost reply must have its release looked at again: the
/// first send, stalled on its way, lands after the release and takes the free lock with
/// a token nobody holds, and nobody gives it back (the library before the look again).
#[test]
fn no_look_again_after_a_release_leaves_the_lock_to_nobody() {
    let steps = violation(Config::ci().without_look_again(), ORPHAN);
    println!("counterexample path length: {steps}");
}

/// A look again that releases the hold of the token but leaves its queue entry: a first
/// send that lands while the key is held queues, and a later release grants it the lock.
#[test]
fn a_look_again_that_only_releases_leaves_a_queued_first_send_to_nobody() {
    let cfg = Config {
        horizon: 6,
        ..Config::ci()
    };
    let steps = violation(cfg.looking_again_with_a_release(), ORPHAN);
    println!("counterexample path length: {steps}");
}

/// Every grant confirmed by an attempt (the library before grants were trusted, and
/// where `Contest::may_trust` says no) holds too; a tick less, to keep the run short.
#[test]
fn confirmed_grants_hold_every_property() {
    let cfg = Config {
        horizon: 4,
        ..Config::ci()
    }
    .with_grants(Grants::Confirmed);
    check(cfg, THREADS, None).assert_holds();
}

/// The starvation bound is tight: one tick less and the checker finds a waiter left
/// behind a free lock (asleep until its re-check while nobody told it), so the property
/// is not vacuous.
#[test]
fn the_starvation_bound_is_tight() {
    let cfg = Config::ci();
    let tighter = Config {
        starve_bound: cfg.starve_bound - 1,
        ..cfg
    };
    violation(tighter, STARVATION);
}

/// The plain scripts (no queue) under the same bounds, with a shorter horizon.
#[test]
fn plain_scripts_hold_every_property() {
    let cfg = Config {
        horizon: 4,
        ..Config::ci().plain()
    };
    let report = check(cfg, THREADS, None);
    report.assert_holds_on_every_path();
}

/// The long check, also `cargo run --release -p redbaton-model --example deep`.
#[test]
#[ignore = "the long check: run with --release -- --ignored"]
fn deep_configuration_holds_every_property() {
    let report = check(Config::deep(), THREADS, None);
    report.assert_holds_on_every_path();
}
