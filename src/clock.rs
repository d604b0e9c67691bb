//! Instant arithmetic that cannot panic: settings and arguments may be as large as
//! `Duration::MAX`, or an `Instant` far in the future, and adding them to "now" must then
//! mean "practically never", not an overflow.

use std::time::{Duration, Instant};

/// About a century: longer than any process lives, short enough to add to any `Instant`
/// the platform can produce from `Instant::now()`.
const FOREVER: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// `t + d`, saturating at about a century after `t` (or at `t` itself on a platform whose
/// `Instant` cannot even hold that).
pub(crate) fn after(t: Instant, d: Duration) -> Instant {
    t.checked_add(d)
        .or_else(|| t.checked_add(FOREVER))
        .unwrap_or(t)
}

/// `Instant::now() + d`, saturating (see [`after`]).
pub(crate) fn from_now(d: Duration) -> Instant {
    after(Instant::now(), d)
}

/// `d` in whole milliseconds as a `u64`, saturating instead of truncating.
pub(crate) fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn never_panics() {
        let now = Instant::now();
        assert!(after(now, Duration::MAX) > now);
        assert_eq!(
            after(now, Duration::from_secs(1)),
            now + Duration::from_secs(1)
        );
        let far = from_now(Duration::MAX);
        assert!(after(far, Duration::MAX) >= far);
        assert_eq!(millis(Duration::MAX), u64::MAX);
        assert_eq!(millis(Duration::from_millis(7)), 7);
    }
}
