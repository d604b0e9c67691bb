//! Test support shared by the integration tests: real `redis-server`
//! processes, a fault-injecting TCP proxy and child-process helpers.
//!
//! Each test binary includes this with `mod support;` and uses a subset,
//! hence the blanket `dead_code` allowance.
#![allow(dead_code)]

pub mod child;
pub mod clock;
pub mod proxy;
pub mod server;

use std::time::Duration;

/// Shorthand for `Duration::from_millis`, to keep timing-heavy tests legible.
pub fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// Placeholder for logger setup (env_logger may be wired in later); tests
/// call it first so that change will not touch every test.
pub fn init_log() {}
