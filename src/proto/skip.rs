//! Skipping a stalled node: a call made under [`skipping`] fails at once, without
//! touching the node, as a refused connection does: it did not run there (see
//! `node::may_have_run`), so nothing is given back there for it, and a waiter's mark is
//! not counted as left there.
//!
//! The Redlock fan-out uses it for a node whose earlier calls are all still waiting out
//! their timeouts (a hung node): a round then counts that node as a vote against and is
//! decided by the others at once, instead of queueing behind the hung node's backlog.

use std::cell::Cell;

thread_local! {
    static SKIPPING: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f` with every node command on this thread failing at once (see the module docs).
pub(crate) fn skipping<T>(f: impl FnOnce() -> T) -> T {
    struct Reset(bool);
    impl Drop for Reset {
        fn drop(&mut self) {
            SKIPPING.with(|s| s.set(self.0));
        }
    }
    let _reset = Reset(SKIPPING.with(|s| s.replace(true)));
    f()
}

/// Whether the current thread is skipping: what it sends to a node is not sent.
pub(crate) fn is_skipping() -> bool {
    SKIPPING.with(Cell::get)
}

/// The error a skipped command fails with, when the current thread is skipping.
pub(crate) fn skipped() -> Option<redis::RedisError> {
    is_skipping().then(|| {
        redis::RedisError::from(std::io::Error::new(
            std::io::ErrorKind::ConnectionRefused,
            "node skipped: its earlier calls are still waiting for it",
        ))
    })
}
