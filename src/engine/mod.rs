//! The engine: the contend loop and its waiter, the release path and the watchdog.

pub(crate) mod cleanup;
pub(crate) mod contend;
pub(crate) mod watchdog;
