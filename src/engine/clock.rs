//! The contest loop's timing: the pause after a contended release, and deadlines.
//! Instants from durations (which a user may set as large as `Duration::MAX`) come from
//! `crate::clock::from_now`, which saturates.

use std::time::{Duration, Instant};

/// How long a contender of a process that just released a contended lock lets the other
/// waiters go first (it is woken sooner by their acquisition's `set` event).
pub(crate) const YIELD: Duration = Duration::from_millis(10);

/// The earlier of `t` and the caller's deadline.
pub(crate) fn earliest(t: Instant, deadline: Option<Instant>) -> Instant {
    deadline.map_or(t, |d| d.min(t))
}
