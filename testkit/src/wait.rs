//! Polling and joining with a deadline: a test whose condition never comes fails with a
//! message instead of hanging.

use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

/// How often the helpers below re-check.
pub const POLL: Duration = Duration::from_millis(5);

/// Polls `f` until it returns `Some`, for at most `limit`; its value, or `None` on timeout.
pub fn eventually<T>(limit: Duration, f: impl FnMut() -> Option<T>) -> Option<T> {
    eventually_every(POLL, limit, f)
}

/// [`eventually`], re-checking every `interval`: for a check that costs more than a
/// command (one that opens connections, asks several servers).
pub fn eventually_every<T>(
    interval: Duration,
    limit: Duration,
    mut f: impl FnMut() -> Option<T>,
) -> Option<T> {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(v) = f() {
            return Some(v);
        }
        if Instant::now() >= deadline {
            return None;
        }
        thread::sleep(interval);
    }
}

/// Polls `cond` until it holds or `timeout` passes; whether it held.
pub fn wait_until(timeout: Duration, mut cond: impl FnMut() -> bool) -> bool {
    eventually(timeout, || cond().then_some(())).is_some()
}

/// Polls `cond` until it holds; panics with `what` after `timeout`.
pub fn wait_for(timeout: Duration, what: &str, cond: impl FnMut() -> bool) {
    wait_for_every(POLL, timeout, what, cond);
}

/// [`wait_for`], re-checking every `interval` (see [`eventually_every`]).
pub fn wait_for_every(
    interval: Duration,
    timeout: Duration,
    what: &str,
    mut cond: impl FnMut() -> bool,
) {
    assert!(
        eventually_every(interval, timeout, || cond().then_some(())).is_some(),
        "timed out after {timeout:?} waiting for: {what}"
    );
}

/// Joins every thread, failing (instead of hanging) if one is not done by `timeout`; a
/// thread's panic is re-raised here.
pub fn join_within<T>(handles: Vec<JoinHandle<T>>, timeout: Duration, what: &str) -> Vec<T> {
    let deadline = Instant::now() + timeout;
    for h in &handles {
        while !h.is_finished() {
            assert!(
                Instant::now() < deadline,
                "{what}: a thread is still running after {timeout:?}"
            );
            thread::sleep(Duration::from_millis(2));
        }
    }
    handles
        .into_iter()
        .map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
        .collect()
}

/// Joins every thread of `handles` in order, without a deadline, and returns what they
/// returned; a thread that panicked fails the caller, named by `what`.
pub fn join_all<T>(handles: Vec<JoinHandle<T>>, what: &str) -> Vec<T> {
    handles
        .into_iter()
        .map(|h| {
            h.join()
                .unwrap_or_else(|_| panic!("a thread of {what} panicked"))
        })
        .collect()
}
