//! A blocking, thread-based distributed lock on Redis.
//!
//! * **Waiters sleep until Redis says the lock is free.** One subscriber thread per node
//!   listens to keyspace notifications for the keys local threads wait for, and wakes
//!   exactly their waiters. No waiter polls on a timer.
//! * **One local thread contends per key, and the lock is passed like a baton.** When
//!   several threads of a process want the same key, one talks to Redis; on release the
//!   lock goes straight to the next local waiter with zero Redis commands, until a fairness
//!   budget says another process's turn has come.
//! * Leases renewed by a watchdog, a signal when a lock is lost, fencing tokens, idempotent
//!   acquire retries after a lost reply, and Redlock over several independent masters.
//!
//! # Examples
//!
//! ```
//! use std::time::Duration;
//!
//! # fn main() -> Result<(), redbaton::Error> {
//! let url = "redis://127.0.0.1:6379/";
//! # let url = redbaton_testkit::redis_url(); // the doc test's throwaway redis-server
//! let client = redbaton::LockClient::builder()
//!     .node(url)
//!     .key_prefix("lock:")
//!     .lease(Duration::from_secs(30))
//!     .build()?;
//!
//! let guard = client.try_lock_for("orders:42", Duration::from_secs(5))?;
//! let token = guard.fencing_token(); // pass it to the storage you protect
//! guard.check()?;                    // still ours?
//! guard.unlock()?;
//! # let _ = token;
//! # Ok(()) }
//! ```
//!
//! # Redis protocol
//!
//! The lock of name `n` is the key `{prefix}{n}` (the name between braces) holding a random
//! token; its fencing counter is `{prefix}{n}:fence`. Acquire is one Lua script (`SET NX PX`
//! and the next fence, the larger of the last one plus one and the server clock in µs, or
//! the holder's remaining `PTTL`), release is compare-and-delete, renewal is
//! compare-and-`PEXPIRE`. Each script is sent with EVALSHA. (A name with `}`, or a prefix
//! with `{`, takes an escaped form of the key; see the guide.)
//!
//! # Redlock and fencing
//!
//! With [`Builder::nodes`] over N independent masters (N odd, at least 3) the lock is
//! taken on all nodes in parallel and held when a majority granted it within the validity
//! time (lease − elapsed − drift, drift = lease × 1% + 2 ms); a node's error is a vote
//! against, never an abort, and a failed round is undone on every node that may hold the
//! token.
//!
//! Each node keeps its own fencing counter, and they drift apart (a round that fails
//! still increments the nodes that granted it). So after a successful round the client
//! raises the counter of every granting node to the highest among them before returning
//! the guard. Any later majority shares at least one node with this one, whose counter is
//! now at least this token's: the next holder's token is higher. The guard is returned
//! only when the nodes carrying its token's fence are a majority: when raises fail on too
//! many nodes, the acquisition fails with [`Error::NoQuorum`], as without enough grants.
//!
//! What is promised, and what is not:
//!
//! * Promised: on one node, strictly increasing tokens, also when the `…:fence` key
//!   expires ([`Builder::fence_ttl`]), is evicted, is lost in a restart, or comes back
//!   stale after a failover to a replica that missed the latest increments: a fence is
//!   `max(last + 1, the server's clock in µs)`, and never runs ahead of that clock, so a
//!   counter that starts again starts above every token issued before. This rests on the
//!   clock of the server that issues a fence not being behind the clock that issued the
//!   previous one, and on fewer than one acquisition per microsecond per name. On Redlock,
//!   increasing tokens across holders under the same condition for the nodes' clocks, and
//!   while the write-back reached the overlap.
//! * Not promised: tokens across a clock stepped back by more than the time since the
//!   name's last acquisition, and mutual exclusion across a restart or failover that loses
//!   a held lock (the old holder learns it at its next renewal; a resource that checks
//!   tokens refuses its writes). Martin Kleppmann ("How to do distributed locking")
//!   argues that a lock whose tokens are not strictly monotonic cannot make a paused holder
//!   safe, and that Redlock's timing assumptions do not hold in an asynchronous network;
//!   antirez ("Is Redlock safe?") answers that the storage can check the unique random
//!   token instead, and that the timing assumptions are reasonable in practice. If your
//!   resource needs strict fencing through node failures without trusting clocks, use one
//!   node with persistence (`appendfsync always`) or a consensus system.

#![forbid(unsafe_code)]
#![warn(missing_docs, clippy::missing_errors_doc)]

mod api;
mod clock;
mod config;
mod engine;
mod error;
#[doc(hidden)]
pub mod fault;
mod fencing;
mod local;
mod proto;
mod stats;
mod supervise;
mod topology;
mod wake;
mod worker;

pub use api::builder::Builder;
pub use api::cancel::Cancel;
pub use api::client::LockClient;
pub use api::detached::{DetachedGuard, DetachedWriteGuard};
pub use api::guard::LockGuard;
pub use api::inspect::{
    ForceRelease, Hold, HoldKind, Holder, LockInfo, LockKind, Locks, QueueEntry,
};
pub use api::latch::{Latch, MAX_LATCH_COUNT};
pub use api::multi::{MAX_MULTI_NAMES, MultiGuard};
pub use api::rwlock::{ReadGuard, RwLock, UpgradableReadGuard, UpgradeError, WriteGuard};
pub use api::semaphore::{Permit, Semaphore};
pub use config::Wakeup;
pub use error::{Error, LostReason, Result, Unlocked};
pub use proto::keys::MAX_NAME_LEN;
pub use stats::{Stats, SubscriberStats, TimeSummary};
