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
//! ```no_run
//! use std::time::Duration;
//!
//! # fn main() -> Result<(), redbaton::Error> {
//! let client = redbaton::LockClient::builder()
//!     .node("redis://127.0.0.1:6379/")
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
//! then `INCR` of the counter, or the holder's remaining `PTTL`), release is
//! compare-and-delete, renewal is compare-and-`PEXPIRE`. Each script is sent with EVALSHA.
//!
//! # Redlock and fencing
//!
//! With [`Builder::nodes`] over N independent masters (N odd, at least 3) the lock is
//! taken on all nodes in parallel and held when a majority granted it within the validity
//! time (lease − elapsed − drift). Its fencing token is built from the highest counter among
//! the granting nodes. That is **not** strictly increasing in every failure: a node that
//! restarts empty restarts its counter, and two majorities overlap in one node only, whose
//! counter may not be the highest of either. Martin Kleppmann ("How to do distributed
//! locking") argues that a lock without strictly monotonic tokens cannot make a paused
//! holder safe; antirez ("Is Redlock safe?") answers that the token-checking storage can use
//! the random token instead. redbaton promises: on one node, strictly increasing tokens
//! while the counter key survives; on Redlock, a majority-held lease and a best-effort
//! token. If your resource needs strict fencing, use one node with persistence (or a
//! consensus system).

mod builder;
mod client;
mod contend;
mod error;
mod fanout;
mod guard;
mod keys;
mod node;
mod notify;
mod pool;
mod remote;
mod scripts;
mod stats;
mod subscriber;
mod table;
mod watchdog;

pub use builder::{Builder, Wakeup};
pub use client::LockClient;
pub use error::{Error, LostReason, Result, Unlocked};
pub use guard::LockGuard;
pub use keys::MAX_NAME_LEN;
pub use stats::Stats;
