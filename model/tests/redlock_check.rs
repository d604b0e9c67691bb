//! The checks of Redlock's fencing tokens (`redbaton_model::redlock`): with the rule the
//! library follows (a hold is handed out only when a majority carries its fence), the
//! tokens of successive holders increase whatever the raises and the clocks do; handing
//! every hold out whatever its raises did breaks that.

use redbaton_model::check_redlock;
use redbaton_model::redlock::{INCREASING, RedlockConfig};

/// Checker threads: the CI machines have 2 cores.
const THREADS: usize = 2;

#[test]
fn tokens_increase_when_a_majority_carries_the_fence() {
    let report = check_redlock(RedlockConfig::ci(), THREADS, None);
    report.assert_holds_on_every_path();
}

#[test]
fn handing_out_a_hold_whose_raises_failed_breaks_the_order_of_tokens() {
    let steps =
        check_redlock(RedlockConfig::broken(), THREADS, Some(INCREASING)).assert_broken(INCREASING);
    assert!(steps >= 4, "a round, two lost raises, a crash and a round");
}
