//! Wait and hold times: a fixed array of atomic buckets per summary, recorded lock-free
//! from any thread, summed into count, p50, p99 and max when [`Stats`](crate::Stats) is read.
//!
//! Why not a histogram crate: `hdrhistogram` records through `&mut` (its shared form hands
//! each thread a recorder and merges on read, which allocates and needs a refresh step),
//! and `metrics-util`'s atomic bucket keeps every sample (memory grows with the count).
//! What is needed here is smaller: one `fetch_add` and at most one `fetch_max` per sample,
//! no allocation, memory fixed at build.
//!
//! Resolution: times are counted in whole microseconds, log-linear: exact below 16 µs,
//! then 16 buckets per power of two, so a bucket spans 1/16 of its lower bound and a
//! percentile (the bucket's midpoint) is within about 3% of the true value. The max is
//! exact (to the microsecond). Times from 2^41 µs (about 25 days) on share the last
//! bucket.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

/// Sub-buckets per power of two, as a power of two.
const SUB_BITS: u32 = 4;
const SUB: u64 = 1 << SUB_BITS;
/// The highest power of two with buckets of its own (values at or above `2^(TOP+1)` µs
/// fall into its last bucket).
const TOP: u32 = 40;
const BUCKETS: usize = ((TOP - SUB_BITS + 2) as usize) << SUB_BITS;

/// A summary of durations: how many, the median, the 99th percentile and the longest.
///
/// Percentiles are within about 3% of the true value (log-linear buckets over
/// microseconds: exact below 16 µs, then 16 buckets per power of two); `max` is exact to
/// the microsecond. All zero while `count` is 0.
///
/// # Examples
///
/// ```
/// # fn main() -> Result<(), redbaton::Error> {
/// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
/// client.with_lock("report", || ())?;
/// let wait = client.stats().remote_wait;
/// assert!(wait.count >= 1);
/// assert!(wait.p50 <= wait.p99 && wait.p99 <= wait.max);
/// println!("{wait:?}"); // TimeSummary { count: 1, p50: 312µs, p99: 312µs, max: 312µs }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct TimeSummary {
    /// How many durations were recorded.
    pub count: u64,
    /// The median.
    pub p50: Duration,
    /// The 99th percentile: 1 in 100 took longer.
    pub p99: Duration,
    /// The longest.
    pub max: Duration,
}

/// The recording side of a [`TimeSummary`].
pub(crate) struct Histogram {
    buckets: Box<[AtomicU64; BUCKETS]>,
    max: AtomicU64,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram {
            buckets: Box::new([const { AtomicU64::new(0) }; BUCKETS]),
            max: AtomicU64::new(0),
        }
    }
}

impl Histogram {
    pub fn record(&self, d: Duration) {
        let us = u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        // The max first: a reader that counts this sample sees a max at least as high.
        if us > self.max.load(Relaxed) {
            self.max.fetch_max(us, Relaxed);
        }
        self.buckets[index(us)].fetch_add(1, Relaxed);
    }

    pub fn summary(&self) -> TimeSummary {
        let counts: Vec<u64> = self.buckets.iter().map(|b| b.load(Relaxed)).collect();
        let max = self.max.load(Relaxed);
        let count: u64 = counts.iter().sum();
        if count == 0 {
            return TimeSummary::default();
        }
        let at = |q: f64| {
            // The smallest value with at least q of the samples at or below it.
            let rank = ((q * count as f64).ceil() as u64).clamp(1, count);
            let mut seen = 0;
            let i = counts
                .iter()
                .position(|&c| {
                    seen += c;
                    seen >= rank
                })
                .unwrap_or(BUCKETS - 1);
            Duration::from_micros(midpoint(i).min(max))
        };
        TimeSummary {
            count,
            p50: at(0.50),
            p99: at(0.99),
            max: Duration::from_micros(max),
        }
    }
}

/// The bucket of `us` microseconds.
fn index(us: u64) -> usize {
    if us < SUB {
        return us as usize;
    }
    let top = (63 - us.leading_zeros()).min(TOP);
    let sub = if top == TOP && us >> top > 1 {
        SUB - 1
    } else {
        (us >> (top - SUB_BITS)) & (SUB - 1)
    };
    (((top - SUB_BITS + 1) as usize) << SUB_BITS) + sub as usize
}

/// The middle of bucket `i`, in microseconds (its value when it is exact).
fn midpoint(i: usize) -> u64 {
    let i = i as u64;
    if i < SUB {
        return i;
    }
    let top = (i >> SUB_BITS) as u32 + SUB_BITS - 1;
    let width = 1u64 << (top - SUB_BITS);
    let low = (SUB + (i & (SUB - 1))) * width;
    low + width / 2
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_cover_every_value_in_order() {
        let mut last = 0;
        for us in (0..100_000u64).chain([1 << 40, (1 << 41) - 1, 1 << 41, u64::MAX]) {
            let i = index(us);
            assert!(i < BUCKETS, "{us} -> {i}");
            assert!(i >= last, "{us}: bucket {i} before {last}");
            last = i;
        }
        assert_eq!(index(u64::MAX), BUCKETS - 1);
    }

    #[test]
    fn a_bucket_midpoint_is_within_a_few_percent() {
        for us in (0..16u64).chain((16..2_000_000).step_by(7)) {
            let mid = midpoint(index(us)) as f64;
            let err = (mid - us as f64).abs() / (us.max(1) as f64);
            assert!(err <= 1.0 / 32.0 + 1e-9, "{us}: midpoint {mid}");
        }
    }

    #[test]
    fn summary_of_known_samples() {
        let h = Histogram::default();
        assert_eq!(h.summary(), TimeSummary::default());
        for us in 1..=1000u64 {
            h.record(Duration::from_micros(us));
        }
        let s = h.summary();
        assert_eq!(s.count, 1000);
        assert_eq!(s.max, Duration::from_micros(1000));
        let near = |d: Duration, want: f64| (d.as_micros() as f64 - want).abs() / want <= 0.035;
        assert!(near(s.p50, 500.0), "{s:?}");
        assert!(near(s.p99, 990.0), "{s:?}");
        assert!(s.p99 <= s.max);
    }

    #[test]
    fn huge_durations_are_kept_in_the_last_bucket() {
        let h = Histogram::default();
        h.record(Duration::MAX);
        let s = h.summary();
        assert_eq!(s.count, 1);
        assert!(s.p50 >= Duration::from_secs(1 << 40 >> 20) && s.p50 <= s.max);
    }
}
