//! The engine: the acquire path and contend loop, a contender's wait, the release path and
//! the watchdog, over the shared [`state::Engine`].

mod abandon;
pub(crate) mod acquire;
pub(crate) mod cleanup;
pub(crate) mod clock;
pub(crate) mod contest;
mod eviction;
mod latch;
pub(crate) mod multi;
pub(crate) mod multi_marks;
mod probe;
pub(crate) mod release;
pub(crate) mod shared_hold;
pub(crate) mod state;
pub(crate) mod subs;
mod turns;
pub(crate) mod waiter;
pub(crate) mod watchdog;
