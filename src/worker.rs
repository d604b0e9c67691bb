//! Stopping the library's background threads: a `Drop` only signals and joins a thread
//! that is not the current one; [`Thread::join_until`] lets a user wait for them with a
//! bound.

use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Joins `handle` unless it is the current thread.
pub(crate) fn join(handle: JoinHandle<()>) {
    if handle.thread().id() != std::thread::current().id() {
        let _ = handle.join();
    }
}

/// A background thread's handle, joinable from `&self`: by a user's shutdown with a
/// deadline, or by the owner's `Drop`.
pub(crate) struct Thread(parking_lot::Mutex<Option<JoinHandle<()>>>);

impl Thread {
    pub fn new(handle: JoinHandle<()>) -> Self {
        Thread(parking_lot::Mutex::new(Some(handle)))
    }

    /// No thread yet (see [`put`](Self::put)).
    pub fn none() -> Self {
        Thread(parking_lot::Mutex::new(None))
    }

    /// Keeps `handle` to be joined.
    pub fn put(&self, handle: JoinHandle<()>) {
        *self.0.lock() = Some(handle);
    }

    /// Waits for the thread (told to stop by the caller) until `deadline`; `false` if it
    /// still runs then. The handle is looked at, not held, between the looks: callers at
    /// once (two clones shutting down) each keep their own deadline, and the one that sees
    /// the thread end joins it.
    pub fn join_until(&self, deadline: Instant) -> bool {
        loop {
            {
                let mut thread = self.0.lock();
                match thread.as_ref() {
                    None => return true,
                    Some(t) if t.thread().id() == std::thread::current().id() => return true,
                    Some(t) if t.is_finished() => {
                        if let Some(t) = thread.take() {
                            let _ = t.join();
                        }
                        return true;
                    }
                    Some(_) => {}
                }
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Joins the thread (told to stop by the caller) unless it is the current one.
    pub fn join_now(&mut self) {
        if let Some(t) = self.0.get_mut().take() {
            join(t);
        }
    }
}
