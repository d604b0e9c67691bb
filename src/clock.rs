//! Time, two clocks of it.
//!
//! *Waits and deadlines* (a caller's `try_lock_for`, a retry pause, a thread's sleep) are
//! `Instant`s, with arithmetic that cannot panic: settings and arguments may be as large as
//! `Duration::MAX`, or an `Instant` far in the future, and adding them to "now" must then
//! mean "practically never", not an overflow.
//!
//! *Leases* are judged on the lease clock, [`Stamp`]: a guard's validity, the watchdog's
//! deadlines for losing a lock, and whether a grant (one node or a Redlock majority) came
//! with time left. Redis counts a key's TTL in real time, also while the holder's machine
//! is suspended; `Instant` does not everywhere, and a holder resumed after its lease ran
//! out must not go on believing in it. The lease clock is:
//!
//! - Linux and Android: `CLOCK_BOOTTIME`, which counts through suspend (`Instant` is
//!   `CLOCK_MONOTONIC`, which stops while the machine is suspended);
//! - macOS, iOS and the other Apple platforms: `CLOCK_MONOTONIC`, which counts through
//!   sleep (`Instant` is `mach_absolute_time`/`CLOCK_UPTIME_RAW`, which does not);
//! - Windows: `Instant` itself, `QueryPerformanceCounter`, which Microsoft documents as
//!   counting the time the machine spends in sleep, hibernation or connected standby;
//! - every other platform: `Instant`, the plain monotonic clock, which may stop while the
//!   machine is suspended there (a suspend longer than the time a lease has left is then
//!   not seen by the holder; the lease still ends in Redis).
//!
//! Suspend itself cannot be tested here; the tests check that the lease clock advances as
//! `Instant` does while the machine runs, and that conversions keep the order of events.

use std::ops::{Add, Sub};
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

/// A point in time on the lease clock (see the module docs): the time since an arbitrary
/// origin (boot, where the platform counts from there), that keeps counting while the
/// machine is suspended where the platform allows. Arithmetic saturates: it never panics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct Stamp(Duration);

impl Stamp {
    /// Now, on the lease clock.
    pub fn now() -> Stamp {
        Stamp(lease_clock())
    }

    /// How long ago this was (zero if it is in the future).
    pub fn elapsed(self) -> Duration {
        Stamp::now().since(self)
    }

    /// How long after `earlier` this is (zero if it is not after it).
    pub fn since(self, earlier: Stamp) -> Duration {
        self.0.saturating_sub(earlier.0)
    }

    /// The `Instant` that is as far from `Instant::now()` as this is from now on the lease
    /// clock: for the public API (`valid_until`) and for waits bounded by a validity.
    pub fn to_instant(self) -> Instant {
        let (now, instant) = (Stamp::now(), Instant::now());
        if self >= now {
            after(instant, self.since(now))
        } else {
            instant.checked_sub(now.since(self)).unwrap_or(instant)
        }
    }
}

impl Add<Duration> for Stamp {
    type Output = Stamp;

    fn add(self, d: Duration) -> Stamp {
        Stamp(self.0.saturating_add(d))
    }
}

impl Sub<Duration> for Stamp {
    type Output = Stamp;

    fn sub(self, d: Duration) -> Stamp {
        Stamp(self.0.saturating_sub(d))
    }
}

/// Reads the lease clock (see the module docs for which clock, per platform).
#[cfg(any(target_os = "linux", target_os = "android", target_vendor = "apple"))]
fn lease_clock() -> Duration {
    #[cfg(any(target_os = "linux", target_os = "android"))]
    let id = rustix::time::ClockId::Boottime;
    #[cfg(target_vendor = "apple")]
    let id = rustix::time::ClockId::Monotonic;
    let t = rustix::time::clock_gettime(id);
    // Neither clock is ever negative; a negative reading would be a kernel bug, read as 0.
    Duration::new(
        u64::try_from(t.tv_sec).unwrap_or(0),
        u32::try_from(t.tv_nsec).unwrap_or(0),
    )
}

/// Reads the lease clock: `Instant`, from the first reading on (see the module docs).
#[cfg(not(any(target_os = "linux", target_os = "android", target_vendor = "apple")))]
fn lease_clock() -> Duration {
    static ORIGIN: std::sync::LazyLock<Instant> = std::sync::LazyLock::new(Instant::now);
    ORIGIN.elapsed()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lease_clock_advances_with_instant() {
        let (i0, s0) = (Instant::now(), Stamp::now());
        std::thread::sleep(Duration::from_millis(50));
        let (s1, i1) = (Stamp::now(), Instant::now());
        // Read inside the Instant readings: the stamps' interval is within theirs.
        let (on_stamps, on_instants) = (s1.since(s0), i1.duration_since(i0));
        assert!(on_stamps >= Duration::from_millis(50), "{on_stamps:?}");
        assert!(on_stamps <= on_instants, "{on_stamps:?} > {on_instants:?}");
        assert!(s1 > s0 && s0.elapsed() >= on_stamps);
        assert_eq!(s0.since(s1), Duration::ZERO);
    }

    #[test]
    fn conversions_keep_the_order_of_events() {
        for d in [
            Duration::ZERO,
            Duration::from_millis(5),
            Duration::from_secs(30),
        ] {
            let (now, ahead) = (Instant::now(), Stamp::now() + d);
            let back = ahead.to_instant();
            // Two clock readings apart at most: well under a millisecond, say 50.
            let err = back.max(now + d) - back.min(now + d);
            assert!(err < Duration::from_millis(50), "{d:?}: off by {err:?}");
        }
        let past = Stamp::now() - Duration::from_secs(10);
        assert!(past.to_instant() <= Instant::now() - Duration::from_secs(9));
        // Saturating, never panicking.
        assert!(Stamp::now() + Duration::MAX > Stamp::now());
        assert_eq!(Stamp(Duration::ZERO) - Duration::MAX, Stamp(Duration::ZERO));
        assert!((Stamp::now() + Duration::MAX).to_instant() > Instant::now());
    }

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
