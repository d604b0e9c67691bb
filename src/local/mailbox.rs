//! A queued local waiter's mailbox, and how it waits for its grant.
//!
//! A local handoff costs the next holder's wake-up: a futex wake and, when its CPU has gone
//! idle, an inter-processor interrupt, which on a virtual machine means a VM exit (tens of
//! microseconds: a large share of a short critical section's cycle). So the waiter at the head of the queue is told when the current holder is *expected* to
//! release (its predecessor's hold time, averaged: see the table), sleeps until shortly
//! before, and then spins, yielding, until the grant arrives or a short grace period
//! passes, after which it sleeps again. Only the head spins, for at most
//! [`SPIN_LEAD`] + [`SPIN_GRACE`] per handoff, and only when holds are short
//! ([`SPIN_MAX_HOLD`]); a mispredicted hold costs that much CPU, never correctness: the
//! grant is always read under the mutex.
//!
//! Telling a head costs a wake-up of its own (to re-plan its sleep), and a spinning head
//! takes a core, so a head is told only with a [`Permit`]: at most one fewer than the
//! machine's cores across the process, and only while the process is busy with no more
//! keys than that: spinning for every key of a busy process takes the cores its holders
//! need (see `docs/benchmarks.md`).

use std::sync::LazyLock;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread::ThreadId;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use std::sync::Arc;

use crate::local::held::RemoteLock;

/// What a queued waiter is given.
pub(crate) enum Grant {
    /// The lock itself, passed by the previous local holder: same Redis token and lease.
    Baton { remote: Arc<RemoteLock>, seq: u32 },
    /// The duty to contend in Redis for the process. `yield_first`: the previous holder
    /// released because of the fairness budget, so let a remote waiter in first.
    Contend { yield_first: bool },
}

/// How long before the expected release the head waiter starts spinning: its own timer
/// wake-up (with the kernel's default 50 µs timer slack) must land before the release.
const SPIN_LEAD: Duration = Duration::from_micros(120);
/// How long after the expected release it keeps spinning before it sleeps again.
const SPIN_GRACE: Duration = Duration::from_micros(100);
/// Holds longer than this are not worth spinning for: a wake-up is small beside them.
pub(crate) const SPIN_MAX_HOLD: Duration = Duration::from_millis(2);

/// Head waiters of this process told to expect a release right now, and how many may be:
/// one fewer than the machine's cores (none on one core).
static SPINNERS: AtomicUsize = AtomicUsize::new(0);
static MAX_SPINNERS: LazyLock<usize> =
    LazyLock::new(|| std::thread::available_parallelism().map_or(0, |n| n.get() - 1));

/// The right to tell a head waiter to spin; given back when dropped (at the grant).
pub(crate) struct Permit(());

impl Permit {
    /// A permit, if this process is busy with no more keys than it may have spinners
    /// (spinning for one key while others' holders need the cores slows them more than it
    /// gains) and fewer heads than that hold one.
    pub fn try_take(active_keys: usize) -> Option<Permit> {
        if active_keys > *MAX_SPINNERS {
            return None;
        }
        if SPINNERS.fetch_add(1, Ordering::AcqRel) >= *MAX_SPINNERS {
            SPINNERS.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        Some(Permit(()))
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        SPINNERS.fetch_sub(1, Ordering::AcqRel);
    }
}

pub(crate) struct Slot {
    pub thread: ThreadId,
    inbox: Mutex<Inbox>,
    /// A grant is in the inbox (read without the mutex while spinning).
    ready: AtomicBool,
    changed: Condvar,
}

#[derive(Default)]
struct Inbox {
    grant: Option<Grant>,
    /// When the holder ahead is expected to release (set while this slot heads the queue),
    /// with the permit to spin for it.
    expected: Option<(Instant, Permit)>,
}

impl Slot {
    pub fn new(thread: ThreadId) -> Self {
        Slot {
            thread,
            inbox: Mutex::new(Inbox::default()),
            ready: AtomicBool::new(false),
            changed: Condvar::new(),
        }
    }

    /// Delivers the grant (under the table's lock). The permit goes back at once, so that
    /// the next head can be told.
    pub fn give(&self, grant: Grant) {
        let mut inbox = self.inbox.lock();
        inbox.grant = Some(grant);
        inbox.expected = None;
        drop(inbox);
        self.ready.store(true, Ordering::Release);
        self.changed.notify_one();
    }

    /// Tells the head waiter when the holder ahead is expected to release.
    pub fn expect_release(&self, at: Instant, permit: Permit) {
        let mut inbox = self.inbox.lock();
        if inbox.grant.is_some() {
            return; // granted already: the permit goes back at once
        }
        inbox.expected = Some((at, permit));
        drop(inbox);
        self.changed.notify_one();
    }

    /// The grant, if it has come.
    pub fn take(&self) -> Option<Grant> {
        self.inbox.lock().grant.take()
    }

    /// Waits for the grant until `deadline`; `None` when it passed first (the caller then
    /// leaves the queue under the table's lock, where a late grant is still found).
    pub fn wait(&self, deadline: Option<Instant>) -> Option<Grant> {
        let mut inbox = self.inbox.lock();
        loop {
            if let Some(g) = inbox.grant.take() {
                inbox.expected = None;
                return Some(g);
            }
            let now = Instant::now();
            if deadline.is_some_and(|d| now >= d) {
                inbox.expected = None;
                return None;
            }
            let expected = inbox.expected.as_ref().map(|(t, _)| *t);
            let spin_from = expected.map(|t| t.checked_sub(SPIN_LEAD).unwrap_or(t));
            let spin_until = expected.map(|t| t + SPIN_GRACE);
            match (spin_from, spin_until) {
                (Some(from), Some(until)) if now >= from && now < until => {
                    let until = deadline.map_or(until, |d| d.min(until));
                    parking_lot::MutexGuard::unlocked(&mut inbox, || self.spin(until));
                    // Spun out without a grant: the estimate was wrong; sleep from now on.
                    if !self.ready.load(Ordering::Acquire) {
                        inbox.expected = None;
                    }
                }
                (Some(from), _) if now < from => {
                    let wake = deadline.map_or(from, |d| d.min(from));
                    self.changed.wait_until(&mut inbox, wake);
                }
                _ => match deadline {
                    Some(d) => {
                        self.changed.wait_until(&mut inbox, d);
                    }
                    None => self.changed.wait(&mut inbox),
                },
            }
        }
    }

    fn spin(&self, until: Instant) {
        while !self.ready.load(Ordering::Acquire) && Instant::now() < until {
            for _ in 0..64 {
                std::hint::spin_loop();
            }
            // On a machine with fewer cores than runnable threads, let the holder run.
            std::thread::yield_now();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn slot() -> Arc<Slot> {
        Arc::new(Slot::new(std::thread::current().id()))
    }

    /// A permit even on a one-core machine (the tests exercise the spin itself).
    fn permit() -> Permit {
        SPINNERS.fetch_add(1, Ordering::AcqRel);
        Permit(())
    }

    fn contend() -> Grant {
        Grant::Contend { yield_first: false }
    }

    fn give_after(slot: &Arc<Slot>, after: Duration) -> std::thread::JoinHandle<()> {
        let s = slot.clone();
        std::thread::spawn(move || {
            std::thread::sleep(after);
            s.give(contend());
        })
    }

    #[test]
    fn smoke() {
        let s = slot();
        s.give(contend());
        assert!(matches!(s.wait(None), Some(Grant::Contend { .. })));
    }

    #[test]
    fn deadline_without_grant() {
        let s = slot();
        let start = Instant::now();
        assert!(s.wait(Some(start + Duration::from_millis(30))).is_none());
        assert!(start.elapsed() >= Duration::from_millis(30));
    }

    #[test]
    fn grant_at_the_expected_time_is_taken_while_spinning() {
        let s = slot();
        s.expect_release(Instant::now() + Duration::from_millis(5), permit());
        let t = give_after(&s, Duration::from_millis(5));
        assert!(s.wait(None).is_some());
        t.join().unwrap();
    }

    #[test]
    fn mispredicted_release_falls_back_to_sleeping() {
        let s = slot();
        // Expected now, but the grant comes 50 ms later: the spin gives up, the wait does not.
        s.expect_release(Instant::now(), permit());
        let t = give_after(&s, Duration::from_millis(50));
        assert!(
            s.wait(Some(Instant::now() + Duration::from_secs(10)))
                .is_some()
        );
        t.join().unwrap();
    }

    #[test]
    fn deadline_inside_the_spin_window_is_kept() {
        let s = slot();
        let start = Instant::now();
        s.expect_release(start + Duration::from_millis(1), permit());
        assert!(s.wait(Some(start + Duration::from_millis(1))).is_none());
        // A late grant is still there for the caller's leave-the-queue check.
        s.give(contend());
        assert!(s.take().is_some());
    }
}
