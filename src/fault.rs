//! Fault injection for this crate's own tests: make a library thread panic at a chosen
//! point, to show that a panic never strands a lock or silences a worker.
//!
//! **Unstable, not part of the API.** It exists only with the `fault-injection` feature,
//! which the crate's tests turn on through a dev-dependency on the crate itself; without
//! the feature every hook compiles to nothing.

/// Where a fault can be injected.
///
/// ```
/// let _ = redbaton::fault::Point::Watchdog;
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Point {
    /// In the contend loop, after an attempt found the lock held and before the wait.
    Contend,
    /// In the subscriber thread, while it serves its connection (or waits for it back from
    /// the waiters reading it).
    Subscriber,
    /// In a waiting thread, as it reads its node's subscriber connection itself.
    WaiterRead,
    /// In a waiting thread, after it took the subscribers of its route's nodes and before
    /// it watches its key with them.
    Watch,
    /// In the watchdog thread, while it renews the locks that are due.
    Watchdog,
    /// In a release to Redis, after renewals stopped and before the compare-and-delete.
    Release,
    /// In the cleanup thread, as it runs a job: a release or a leave that nobody waits
    /// for (an attempt whose reply was lost, say).
    Cleanup,
    /// In a thread queued behind a local holder, as the lock handed to it arrives and
    /// before it is returned.
    Handoff,
}

#[cfg(feature = "fault-injection")]
mod imp {
    use super::Point;
    use parking_lot::Mutex;
    use std::sync::atomic::{AtomicBool, Ordering};

    static ANY: AtomicBool = AtomicBool::new(false);
    static ARMED: Mutex<Vec<(String, Point, u32)>> = Mutex::new(Vec::new());
    /// The points armed to stall rather than panic, and whether a thread stalls there.
    static STALLS: Mutex<Vec<(String, Point, bool)>> = Mutex::new(Vec::new());

    /// Makes the next `times` passes through `point`, in clients whose key prefix is
    /// `prefix`, panic (`u32::MAX`: every pass until [`disarm`]).
    ///
    /// # Examples
    ///
    /// ```
    /// use redbaton::fault::{self, Point};
    /// fault::arm("doc-fault:", Point::Contend, 1);
    /// fault::disarm("doc-fault:", Point::Contend);
    /// ```
    pub fn arm(prefix: &str, point: Point, times: u32) {
        let mut armed = ARMED.lock();
        armed.retain(|(p, q, _)| !(p == prefix && *q == point));
        armed.push((prefix.to_owned(), point, times));
        ANY.store(true, Ordering::SeqCst);
    }

    /// Stops injecting at `point` for `prefix`.
    ///
    /// # Examples
    ///
    /// ```
    /// redbaton::fault::disarm("doc-fault:", redbaton::fault::Point::Watchdog);
    /// ```
    pub fn disarm(prefix: &str, point: Point) {
        ARMED
            .lock()
            .retain(|(p, q, _)| !(p == prefix && *q == point));
        STALLS
            .lock()
            .retain(|(p, q, _)| !(p == prefix && *q == point));
    }

    /// Makes the next pass through `point`, in clients whose key prefix is `prefix`, stop
    /// there until [`disarm`]: a thread caught at a chosen moment, for a race to be played
    /// out in a set order.
    ///
    /// # Examples
    ///
    /// ```
    /// use redbaton::fault::{self, Point};
    /// fault::stall("doc-stall:", Point::WaiterRead);
    /// assert!(!fault::stalled("doc-stall:", Point::WaiterRead));
    /// fault::disarm("doc-stall:", Point::WaiterRead);
    /// ```
    pub fn stall(prefix: &str, point: Point) {
        let mut stalls = STALLS.lock();
        stalls.retain(|(p, q, _)| !(p == prefix && *q == point));
        stalls.push((prefix.to_owned(), point, false));
        ANY.store(true, Ordering::SeqCst);
    }

    /// Whether a thread stopped at `point` armed by [`stall`], and is there still.
    ///
    /// # Examples
    ///
    /// ```
    /// assert!(!redbaton::fault::stalled("doc-none:", redbaton::fault::Point::Watchdog));
    /// ```
    pub fn stalled(prefix: &str, point: Point) -> bool {
        STALLS
            .lock()
            .iter()
            .any(|(p, q, at)| p == prefix && *q == point && *at)
    }

    /// Stops here while `point` is armed to stall, the first thread to pass only.
    fn stall_here(prefix: &str, point: Point) {
        let at = |(p, q, _): &(String, Point, bool)| p == prefix && *q == point;
        match STALLS.lock().iter_mut().find(|s| at(s)) {
            Some((_, _, stalled)) if !*stalled => *stalled = true,
            _ => return,
        }
        while STALLS.lock().iter().any(at) {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }

    pub(crate) fn hit(prefix: &str, point: Point) {
        if !ANY.load(Ordering::Relaxed) {
            return;
        }
        stall_here(prefix, point);
        let fire = {
            let mut armed = ARMED.lock();
            match armed
                .iter_mut()
                .find(|(p, q, n)| p == prefix && *q == point && *n > 0)
            {
                Some((_, _, n)) => {
                    if *n != u32::MAX {
                        *n -= 1;
                    }
                    true
                }
                None => false,
            }
        };
        if fire {
            panic!("injected fault at {point:?}");
        }
    }
}

#[cfg(feature = "fault-injection")]
pub use imp::{arm, disarm, stall, stalled};

#[cfg(feature = "fault-injection")]
pub(crate) use imp::hit;

/// Without the `fault-injection` feature: nothing.
#[cfg(not(feature = "fault-injection"))]
#[inline(always)]
pub(crate) fn hit(_prefix: &str, _point: Point) {}
