//! Counters of what a client did, for users measuring contention and for tests.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

macro_rules! counters {
    ($( $(#[$doc:meta])* $field:ident ),* $(,)?) => {
        /// A snapshot of a client's counters since it was built (see
        /// [`LockClient::stats`](crate::LockClient::stats)).
        ///
        /// # Examples
        ///
        /// ```
        /// # fn main() -> Result<(), redbaton::Error> {
        /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
        /// client.with_lock("report", || ())?;
        /// let s = client.stats();
        /// println!("{} commands for {} acquisitions", s.commands, s.remote_acquisitions);
        /// # Ok(()) }
        /// ```
        #[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
        #[non_exhaustive]
        pub struct Stats {
            $( $(#[$doc])* pub $field: u64, )*
        }

        #[derive(Default)]
        pub(crate) struct Counters {
            $( pub $field: AtomicU64, )*
        }

        impl Counters {
            pub fn snapshot(&self) -> Stats {
                Stats { $( $field: self.$field.load(Relaxed), )* }
            }
        }
    };
}

counters! {
    /// Locks taken in Redis (one per remote acquisition, however many local holders).
    remote_acquisitions,
    /// Acquire attempts that found the lock held.
    failed_attempts,
    /// Locks passed to a waiting local thread with no Redis command.
    local_handoffs,
    /// Releases in Redis forced by the fairness budget while local threads still waited.
    budget_releases,
    /// Commands sent to Redis by this client: scripts, (un)subscribes, pings.
    commands,
    /// Waits ended by a notification for the key.
    wakeups_event,
    /// Acquire attempts the subscriber thread made for a waiter the moment the key was
    /// freed, before waking it (one node, notifications): a handoff without a thread hop.
    early_attempts,
    /// Waits ended because the holder's remaining lease ran out.
    wakeups_lease,
    /// Waits ended by the re-check ceiling.
    wakeups_recheck,
    /// Waits ended by the polling interval (`Wakeup::Polling`).
    wakeups_poll,
    /// Waits ended because the subscriber reconnected (events may have been missed).
    wakeups_reconnect,
    /// Redis Cluster: waits ended because the key's slot moved to another master (its
    /// shard channel was dropped): the waiter followed it and retried once.
    wakeups_moved,
    /// Times a subscriber connection was re-established.
    reconnects,
    /// Lock renewals sent by the watchdog (one per lock per node).
    renewals_sent,
    /// Renewals that failed at the network level (retried until the lease runs out).
    renewals_failed,
    /// Locks found lost while held.
    locks_lost,
    /// Calls that returned `Error::Timeout`.
    timeouts,
    /// Sentinel: times the master moved to another server and the client followed it.
    failovers,
    /// Fair queue: locks this client was granted by another process's release.
    grants_received,
    /// Fair queue: locks this client's releases granted to the next process in the queue.
    grants_passed,
    /// Fair queue: waits that ended without the lock and left the queue.
    queue_departures,
    /// Redis Cluster: `MOVED` and `ASK` replies followed to the node they named.
    redirects,
    /// Redis Cluster: times the slot map was read again from the cluster.
    slot_refreshes,
    /// Redis Cluster: calls (acquire, release, extend) retried after their master could
    /// not be reached or the cluster was failing over, once the slot map was read again.
    failover_retries,
    /// Background releases (after an acquire whose outcome was unknown) dropped because the
    /// cleanup queue was full: those keys expire with their lease instead.
    cleanup_dropped,
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
    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Relaxed);
    }
    pub fn inc(counter: &AtomicU64) {
        counter.fetch_add(1, Relaxed);
    }
}
