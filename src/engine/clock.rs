//! Deadlines: instants computed from durations a user may set as large as `Duration::MAX`.

use std::time::{Duration, Instant};

/// How long a contender of a process that just released a contended lock lets the other
/// waiters go first (it is woken sooner by their acquisition's `set` event).
pub(crate) const YIELD: Duration = Duration::from_millis(10);

/// `d` from now, or far in the future when that cannot be represented.
pub(crate) fn after(d: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(d)
        .or_else(|| now.checked_add(Duration::from_secs(100 * 365 * 24 * 3600)))
        .unwrap_or(now)
}

/// The earlier of `t` and the caller's deadline.
pub(crate) fn earliest(t: Instant, deadline: Option<Instant>) -> Instant {
    deadline.map_or(t, |d| d.min(t))
}
