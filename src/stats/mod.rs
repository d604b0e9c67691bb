//! Counters and wait and hold times of what a client did, for users measuring contention
//! and for tests; with the `metrics` feature, the same through the `metrics` facade.
//!
//! Everything is recorded where the event happens, once: [`Counters`] keeps the atomics
//! behind [`Stats`] and, with the feature, emits the matching metric in the same call.
//! Wait and hold times go to fixed arrays of atomic buckets (see `summary` for the
//! resolution and why no histogram crate). The metrics' names and labels are listed in
//! one table, in the user guide's "Metrics" section (`docs/guide.md`).

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Instant;

use crate::error::{Error, LostReason};

#[cfg(feature = "metrics")]
mod emit;
mod summary;

use summary::Histogram;
pub use summary::TimeSummary;

/// What a metric key a counter also emits to is, with the `metrics` feature: none for a
/// counter emitted elsewhere with finer labels.
#[cfg(feature = "metrics")]
type MetricKey = Option<&'static metrics::Key>;
#[cfg(not(feature = "metrics"))]
type MetricKey = ();

/// The metric a counter emits to, from its name and labels (nothing without the feature).
#[cfg(feature = "metrics")]
macro_rules! metric {
    () => {
        None
    };
    ($($key:tt)+) => {
        Some(emit::key!($($key)+))
    };
}
#[cfg(not(feature = "metrics"))]
macro_rules! metric {
    ($($key:tt)*) => {
        ()
    };
}

/// One of a client's counters (and, with the `metrics` feature, the metric it feeds).
pub(crate) struct Counter {
    n: AtomicU64,
    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    metric: MetricKey,
}

impl Counter {
    fn new(metric: MetricKey) -> Self {
        Counter {
            n: AtomicU64::new(0),
            metric,
        }
    }

    fn get(&self) -> u64 {
        self.n.load(Relaxed)
    }
}

/// Something [`Counters::inc`] and [`Counters::add`] count into: a client's counter, or a
/// plain atomic kept elsewhere (a subscriber's own reconnects).
pub(crate) trait Count {
    fn count(&self, n: u64);
}

impl Count for AtomicU64 {
    fn count(&self, n: u64) {
        self.fetch_add(n, Relaxed);
    }
}

impl Count for Counter {
    fn count(&self, n: u64) {
        self.n.fetch_add(n, Relaxed);
        #[cfg(feature = "metrics")]
        if let Some(key) = self.metric {
            emit::counter(key, n);
        }
    }
}

/// What a hold is, for the times and the metrics' `kind` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum HoldKind {
    Lock,
    Read,
    Write,
    Permit,
}

/// How a holder got its hold: taken in Redis, or handed over by a local holder (the baton,
/// or a turn on the process's read or write hold).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Path {
    Remote,
    Handoff,
}

macro_rules! counters {
    ($( $(#[$doc:meta])* $field:ident $(=> ($($metric:tt)+))? ),* $(,)?) => {
        /// A snapshot of a client's counters and wait and hold times since it was built
        /// (see [`LockClient::stats`](crate::LockClient::stats)).
        ///
        /// The times are summaries ([`TimeSummary`]: count, p50, p99, max) of every hold
        /// taken through this client (locks, read and write holds, permits), split by how
        /// the holder got it: `remote_*` in Redis, `handoff_*` from a local holder without
        /// a Redis command (the baton, or a turn on the process's read or write hold).
        /// With the `metrics` feature the same events also go to the `metrics` facade:
        /// see the "Metrics" section of the user guide (`docs/guide.md`) for the names
        /// and labels.
        ///
        /// # Examples
        ///
        /// ```
        /// # fn main() -> Result<(), redbaton::Error> {
        /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
        /// client.with_lock("report", || ())?;
        /// let s = client.stats();
        /// println!("{} commands for {} acquisitions", s.commands, s.remote_acquisitions);
        /// println!("waits {:?}, holds {:?}", s.remote_wait, s.remote_hold);
        /// # Ok(()) }
        /// ```
        #[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
        #[non_exhaustive]
        pub struct Stats {
            $( $(#[$doc])* pub $field: u64, )*
            /// Waits of holders that got their hold in Redis: from the call (`lock`,
            /// `try_lock*`, `read`, `write`, `acquire`, …) until it returned the guard.
            /// Calls that returned an error are not counted.
            ///
            /// ```
            /// # fn main() -> Result<(), redbaton::Error> {
            /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
            /// drop(client.lock("w")?);
            /// assert_eq!(client.stats().remote_wait.count, 1);
            /// # Ok(()) }
            /// ```
            pub remote_wait: TimeSummary,
            /// Waits of holders that got their hold from a local holder (see
            /// [`local_handoffs`](Stats::local_handoffs)), from the call until it returned
            /// the guard.
            ///
            /// ```
            /// # fn main() -> Result<(), redbaton::Error> {
            /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
            /// let s = client.stats();
            /// assert_eq!(s.handoff_wait.count, s.local_handoffs);
            /// # Ok(()) }
            /// ```
            pub handoff_wait: TimeSummary,
            /// Holds of holders that got their hold in Redis: from the call's return until
            /// the guard was unlocked or dropped (however it was then given on).
            ///
            /// ```
            /// # fn main() -> Result<(), redbaton::Error> {
            /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
            /// let guard = client.lock("h")?;
            /// assert_eq!(client.stats().remote_hold.count, 0); // still held
            /// guard.unlock()?;
            /// assert_eq!(client.stats().remote_hold.count, 1);
            /// # Ok(()) }
            /// ```
            pub remote_hold: TimeSummary,
            /// Holds of holders that got their hold from a local holder, from the call's
            /// return until the guard was unlocked or dropped.
            ///
            /// ```
            /// # fn main() -> Result<(), redbaton::Error> {
            /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
            /// println!("{:?}", client.stats().handoff_hold);
            /// # Ok(()) }
            /// ```
            pub handoff_hold: TimeSummary,
        }

        pub(crate) struct Counters {
            $( pub $field: Counter, )*
            remote_wait: Histogram,
            handoff_wait: Histogram,
            remote_hold: Histogram,
            handoff_hold: Histogram,
        }

        impl Default for Counters {
            fn default() -> Self {
                Counters {
                    $( $field: Counter::new(metric!($($($metric)+)?)), )*
                    remote_wait: Histogram::default(),
                    handoff_wait: Histogram::default(),
                    remote_hold: Histogram::default(),
                    handoff_hold: Histogram::default(),
                }
            }
        }

        impl Counters {
            pub fn snapshot(&self) -> Stats {
                Stats {
                    $( $field: self.$field.get(), )*
                    remote_wait: self.remote_wait.summary(),
                    handoff_wait: self.handoff_wait.summary(),
                    remote_hold: self.remote_hold.summary(),
                    handoff_hold: self.handoff_hold.summary(),
                }
            }
        }
    };
}

counters! {
    /// Locks taken in Redis (one per remote acquisition, however many local holders).
    remote_acquisitions => ("redbaton_remote_acquisitions_total"),
    /// Acquire attempts that found the lock held, or won it too late to use (the lease
    /// had run out by the reply); on Redlock, one per node that found it held (an attempt
    /// refused by all of three nodes counts three).
    failed_attempts => ("redbaton_failed_attempts_total"),
    /// Locks passed to a waiting local thread with no Redis command.
    local_handoffs => ("redbaton_handoffs_total"),
    /// Releases in Redis forced by the fairness budget while local threads still waited
    /// (not the release after the 4,095 local handoffs one fencing token can number, which
    /// a process alone on a key makes too).
    budget_releases => ("redbaton_budget_releases_total"),
    /// Requests sent to Redis by this client, one per round trip: a script call, a
    /// pipeline (a multi-lock's or a renewal pass's batches to one node count one), an
    /// (un)subscribe, a `PING`. A script that Redis had to load first counts once with
    /// the call it served.
    commands => ("redbaton_commands_total"),
    /// Waits ended by a notification for the key.
    wakeups_event => ("redbaton_wakeups_total", "cause" = "event"),
    /// Waits ended by an event that the waiting thread read from the subscriber
    /// connection itself (it had the connection while it slept), with no wake-up of the
    /// subscriber thread in between; counted in the other wake-ups too.
    waiter_reads => ("redbaton_waiter_reads_total"),
    /// Acquire attempts the subscriber thread made for a waiter the moment the key was
    /// freed, before waking it (one node, notifications): a handoff without a thread hop.
    early_attempts => ("redbaton_early_attempts_total"),
    /// Waits ended because the holder's remaining lease ran out.
    wakeups_lease => ("redbaton_wakeups_total", "cause" = "lease"),
    /// Waits ended by the re-check ceiling (or, while the waiter's subscription cannot
    /// be confirmed, by its retry backoff). A wait ended by its deadline or a cancel
    /// counts in no `wakeups_*` counter.
    wakeups_recheck => ("redbaton_wakeups_total", "cause" = "recheck"),
    /// Waits ended by the polling interval (`Wakeup::Polling`); not one ended by its
    /// deadline or a cancel before the interval did.
    wakeups_poll => ("redbaton_wakeups_total", "cause" = "poll"),
    /// Waits ended because the subscriber reconnected (events may have been missed).
    wakeups_reconnect => ("redbaton_wakeups_total", "cause" = "reconnect"),
    /// Redis Cluster: waits ended because the key's slot moved to another master (its
    /// shard channel was dropped): the waiter followed it and retried once.
    wakeups_moved => ("redbaton_wakeups_total", "cause" = "moved"),
    /// Times a subscriber connection was re-established.
    reconnects => ("redbaton_subscriber_reconnects_total"),
    /// Lock renewals sent by the watchdog (one per lock per node).
    renewals_sent => ("redbaton_renewals_total"),
    /// Renewals that failed at the network level (retried until the lease runs out).
    renewals_failed => ("redbaton_renewals_failed_total"),
    /// Locks found lost while held: by the watchdog, by the holder's own look (`is_lost`,
    /// `check`, `extend`) past the lease or the cap, or by the release, which found the
    /// key gone or another owner's. Once per hold in Redis, however many local holders
    /// share it.
    // Emitted by `Counters::lost`, with the reason as a label.
    locks_lost,
    /// Waits that returned `Error::Timeout`: calls for a hold (a lock, a read or write
    /// hold, a permit, a multi-lock, an upgrade) and latch waits.
    timeouts => ("redbaton_timeouts_total"),
    /// Sentinel: times the master moved to another server and the client followed it.
    failovers => ("redbaton_failovers_total"),
    /// Fair queue, read-write locks and semaphores: grants heard by this client's waiters
    /// (a lock, a write or read hold or a permit given by another process's release, or
    /// a writer's wake-up).
    grants_received => ("redbaton_fair_grants_received_total"),
    /// Of those, grants taken as the hold from the message alone (it carried the nonce of
    /// the waiter's latest attempt, in time), with no confirming attempt.
    grants_trusted => ("redbaton_fair_grants_trusted_total"),
    /// Fair queue: locks this client's releases granted to the next process in the queue;
    /// and grants (fair queue, read-write locks) that a waiter of this client gave up
    /// unused and passed on. A release whose reply was lost after it ran is not counted:
    /// its retry finds the next holder's token (or no key) and cannot tell a grant its
    /// lost try made from a lease that ran out and another process's acquisition.
    grants_passed => ("redbaton_fair_grants_passed_total"),
    /// Fair queue: waits that ended without the lock and left the queue.
    queue_departures => ("redbaton_fair_queue_departures_total"),
    /// Redis Cluster: `MOVED` and `ASK` replies followed to the node they named.
    redirects => ("redbaton_cluster_redirects_total"),
    /// Redis Cluster: times the slot map was read again from the cluster.
    slot_refreshes => ("redbaton_cluster_slot_refreshes_total"),
    /// Redis Cluster and Sentinel: retries of a call (acquire, release, extend, latch
    /// call) after its master could not be reached or the cluster was failing over, once
    /// the slot map (or the sentinels) was read again. One per retry: a call that rides
    /// through a failover of a few seconds counts several.
    failover_retries => ("redbaton_cluster_failover_retries_total"),
    /// Background releases (after an acquire whose outcome was unknown) dropped: the cleanup
    /// queue was full, or the client shut down or was dropped before they were made while
    /// what they give back was still live. Those keys expire with their lease instead.
    cleanup_dropped => ("redbaton_cleanup_dropped_total"),
}

/// One subscriber connection of a client (one per node waiters wait on: per master in
/// a Redis Cluster), see [`LockClient::subscribers`](crate::LockClient::subscribers).
///
/// # Examples
///
/// ```
/// # fn main() -> Result<(), redbaton::Error> {
/// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
/// for s in client.subscribers() {
///     println!("{}: {} reconnects, up: {}", s.node, s.reconnects, s.connected);
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct SubscriberStats {
    /// The node's address (`host:port`, never a password).
    pub node: String,
    /// Times the connection was re-established since the subscriber started.
    pub reconnects: u64,
    /// Whether the connection is up now.
    pub connected: bool,
}

impl Counters {
    pub fn add(counter: &impl Count, n: u64) {
        counter.count(n);
    }
    pub fn inc(counter: &impl Count) {
        counter.count(1);
    }

    /// A lock was found lost while held.
    pub fn lost(&self, reason: LostReason) {
        self.locks_lost.count(1);
        #[cfg(feature = "metrics")]
        emit::lost(reason);
        #[cfg(not(feature = "metrics"))]
        let _ = reason;
    }

    /// A call for a hold of `kind`, made at `asked`, returns `took`: how it got the hold,
    /// or its error. Records the wait; returns now, the start of the hold.
    pub fn settled(&self, kind: HoldKind, asked: Instant, took: Result<Path, &Error>) -> Instant {
        let now = Instant::now();
        let wait = now.saturating_duration_since(asked);
        match took {
            Ok(Path::Remote) => self.remote_wait.record(wait),
            Ok(Path::Handoff) => self.handoff_wait.record(wait),
            Err(_) => {}
        }
        #[cfg(feature = "metrics")]
        emit::settled(kind, took, wait);
        #[cfg(not(feature = "metrics"))]
        let _ = kind;
        now
    }

    /// A holder of `kind` that got its hold by `path` at `since` lets go.
    pub fn released(&self, kind: HoldKind, path: Path, since: Instant) {
        let held = since.elapsed();
        match path {
            Path::Remote => self.remote_hold.record(held),
            Path::Handoff => self.handoff_hold.record(held),
        }
        #[cfg(feature = "metrics")]
        emit::released(kind, path, held);
        #[cfg(not(feature = "metrics"))]
        let _ = kind;
    }
}
