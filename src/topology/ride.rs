//! Riding through a failover. When a call's node cannot be reached, refuses writes
//! (`READONLY`: a demoted master), or the cluster says it is electing a new master, the
//! call pauses briefly and tries again on the route read afresh: the failed command marked
//! the slot map stale, so the next route asks the cluster who serves the slot now; behind
//! Sentinel it told the watcher, which asks the sentinels and points the node at the
//! master they name. It keeps trying until its bound: the caller's deadline, the lock's
//! validity (release, extend), or, for a wait without a deadline, the window the topology
//! gives from the first failure. The topology decides which errors are worth it
//! ([`Topology::ride_through`]); on one node and over Redlock the first error is the
//! answer.
//!
//! The pauses grow from [`FIRST_PAUSE`] to [`MAX_PAUSE`] with a jitter, so a few hundred
//! waiters of a dead master do not stampede the cluster in step; the map itself is read
//! at most every 100 ms however many calls ride (see `topology::cluster`).
//!
//! One command's redirects and refusals are followed inside the node's call path (see
//! `call`); a ride is the level above it, for a whole operation whose node went away:
//! the contest, a release, an extend. Both are the topology's: the engine's loops ask
//! `again` and never classify an error themselves.

use std::time::{Duration, Instant};

use crate::error::Error;
use crate::stats::Counters;
use crate::topology::Topology;

/// The first pause after a failure.
const FIRST_PAUSE: Duration = Duration::from_millis(20);
/// The longest pause: a failover is noticed within this once it is done.
const MAX_PAUSE: Duration = Duration::from_millis(250);

/// One call's retries through a run of failures.
pub(crate) struct Ride<'a> {
    topology: &'a Topology,
    counters: &'a Counters,
    pause: Duration,
    /// When the current run of failures began.
    since: Option<Instant>,
    /// Whether the call was retried at least once.
    retried: bool,
}

impl<'a> Ride<'a> {
    pub fn new(topology: &'a Topology, counters: &'a Counters) -> Self {
        Ride {
            topology,
            counters,
            pause: FIRST_PAUSE,
            since: None,
            retried: false,
        }
    }

    /// After the call failed with `e`: whether to try again, having paused. Yes when the
    /// topology rides through `e` and `until` has not come: the caller's bound, or with
    /// `None` the topology's window from the first failure of this run. The pause never
    /// goes past the bound, so the last try is made at it.
    pub fn again(&mut self, e: &Error, until: Option<Instant>) -> bool {
        let Some(window) = self.topology.ride_through(e) else {
            return false;
        };
        let now = Instant::now();
        let since = *self.since.get_or_insert(now);
        let until = until.unwrap_or_else(|| since.checked_add(window).unwrap_or(now));
        let Some(left) = until.checked_duration_since(now).filter(|d| !d.is_zero()) else {
            return false;
        };
        let jitter = rand::random_range(0..=self.pause.as_millis() as u64 / 2);
        let pause = (self.pause + Duration::from_millis(jitter)).min(left);
        log::debug!("riding through a failover: {e:?}; retrying in {pause:?}");
        std::thread::sleep(pause);
        self.pause = (self.pause * 2).min(MAX_PAUSE);
        self.retried = true;
        Counters::inc(&self.counters.failover_retries);
        true
    }

    /// A reply came: the next failure starts a new run, with a full window.
    pub fn settled(&mut self) {
        self.since = None;
        self.pause = FIRST_PAUSE;
    }

    /// Whether the call was retried at least once.
    pub fn retried(&self) -> bool {
        self.retried
    }
}
