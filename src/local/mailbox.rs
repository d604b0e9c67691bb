//! A queued local waiter's mailbox, and how it waits for its grant.
//!
//! A local handoff costs the next holder's wake-up: a futex wake and, when its CPU has gone
//! idle, an inter-processor interrupt, which on a virtual machine means a VM exit (tens of
//! microseconds: a large share of a short critical section's cycle). So the waiter at the head of the queue is told when the current holder is *expected* to
//! release (its predecessor's hold time, averaged: see the table), sleeps until shortly
//! before (by how late its timed sleeps have woken, at least [`SPIN_LEAD_MIN`]), and then
//! spins, yielding, until the grant arrives or a short grace period passes, after which it
//! sleeps again. Only the head spins, for at most [`SPIN_LEAD_MAX`] + [`SPIN_GRACE`] per
//! handoff (about [`SPIN_MARGIN`] + [`SPIN_GRACE`] when its timer is as late as usual), and
//! only when holds are short
//! ([`SPIN_MAX_HOLD`]); a mispredicted hold costs that much CPU, never correctness: the
//! grant is always read under the mutex.
//!
//! Telling a head costs a wake-up of its own (to re-plan its sleep), and a spinning head
//! takes a core, so a head is told only with a [`Permit`]: at most one fewer than the
//! machine's cores across the process, and only while the process is busy with no more
//! keys than that: spinning for every key of a busy process takes the cores its holders
//! need (see `docs/benchmarks.md`).
//!
//! A wait may also end because its caller cancelled it ([`Cancellation`]): the flag that
//! every kind of wait checks where it checks its deadline, and the wakers of the waits
//! sleeping on it right now. It lives here, beside the mailbox, because the local queue is
//! the lowest layer that waits.

use std::sync::LazyLock;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::thread::ThreadId;
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;
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

/// The least time before the expected release the head waiter starts spinning: its own
/// timer wake-up (with the kernel's default 50 µs timer slack) must land before the
/// release. It starts earlier when this process's timed sleeps wake later than that (see
/// [`TimerLateness`]).
const SPIN_LEAD_MIN: Duration = Duration::from_micros(120);
/// The longest lead, however late the timer (a head whose timer then wakes on time spins
/// this long before the release).
const SPIN_LEAD_MAX: Duration = Duration::from_millis(1);
/// How long before the release a head whose timer is as late as usual wakes.
const SPIN_MARGIN: Duration = Duration::from_micros(70);
/// How long after the expected release it keeps spinning before it sleeps again.
const SPIN_GRACE: Duration = Duration::from_micros(100);
/// Holds longer than this are not worth spinning for: a wake-up is small beside them.
pub(crate) const SPIN_MAX_HOLD: Duration = Duration::from_millis(2);

/// How late this process's timed sleeps wake, on average (nanoseconds, each new one
/// weighing 1/8). On a virtual machine the timer wake-up of an idle vCPU can come 100 µs
/// late or more; a head that woke after the release would pay the very wake-up its spin is
/// for, so the lead covers the lateness seen. A sleep later than [`SPIN_LEAD_MAX`] (a
/// descheduled vCPU) counts as that much.
struct TimerLateness(AtomicU64);

impl TimerLateness {
    const fn new() -> Self {
        TimerLateness(AtomicU64::new(0))
    }

    /// A timed sleep woke `late` after it was due. Threads may race here: it is an
    /// estimate, and one lost update changes it by an eighth.
    fn note(&self, late: Duration) {
        let late = u64::try_from(late.min(SPIN_LEAD_MAX).as_nanos()).unwrap_or(u64::MAX);
        let old = self.0.load(Ordering::Relaxed);
        let new = if old == 0 { late } else { (old * 7 + late) / 8 };
        self.0.store(new.max(1), Ordering::Relaxed);
    }

    /// How long before the expected release a head starts spinning.
    fn spin_lead(&self) -> Duration {
        let late = Duration::from_nanos(self.0.load(Ordering::Relaxed));
        (late + SPIN_MARGIN).clamp(SPIN_LEAD_MIN, SPIN_LEAD_MAX)
    }
}

static TIMER: TimerLateness = TimerLateness::new();

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

    /// Wakes the waiter to look at its cancellation flag (under the inbox's mutex, so that
    /// a waiter about to sleep has either seen the flag or is asleep and hears this).
    pub fn poke(&self) {
        let _inbox = self.inbox.lock();
        self.changed.notify_all();
    }

    /// Waits for the grant until `deadline`, or until `cancel` is set (its waker must
    /// [`poke`](Self::poke) this slot); `None` when either came first (the caller then
    /// leaves the queue under the table's lock, where a late grant is still found).
    pub fn wait(&self, deadline: Option<Instant>, cancel: Option<&Cancellation>) -> Option<Grant> {
        let mut inbox = self.inbox.lock();
        loop {
            if let Some(g) = inbox.grant.take() {
                inbox.expected = None;
                return Some(g);
            }
            let now = Instant::now();
            if deadline.is_some_and(|d| now >= d) || cancel.is_some_and(Cancellation::is_cancelled)
            {
                inbox.expected = None;
                return None;
            }
            let expected = inbox.expected.as_ref().map(|(t, _)| *t);
            let spin_from = expected.map(|t| t.checked_sub(TIMER.spin_lead()).unwrap_or(t));
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
                    if self.changed.wait_until(&mut inbox, wake).timed_out() && wake == from {
                        TIMER.note(Instant::now().saturating_duration_since(from));
                    }
                }
                _ => {
                    // Past the spin window, if any (told late, or the timer woke late):
                    // sleep without the permit, so that another key's head may spin.
                    inbox.expected = None;
                    match deadline {
                        Some(d) => {
                            self.changed.wait_until(&mut inbox, d);
                        }
                        None => self.changed.wait(&mut inbox),
                    }
                }
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

/// What a waiter runs to end its sleep early when the wait is cancelled.
type Waker = Box<dyn Fn() + Send + Sync>;

/// A cancellation flag shared by the clones of a public `Cancel`, and the wakers of the
/// waits sleeping on it. Each wait registers one waker while it waits and removes it when
/// it ends ([`Registration`]), so the list holds at most one waker per wait in progress.
#[derive(Default)]
pub(crate) struct Cancellation {
    cancelled: AtomicBool,
    wakers: Mutex<Wakers>,
}

#[derive(Default)]
struct Wakers {
    next: u64,
    list: Vec<(u64, Waker)>,
}

impl Cancellation {
    /// Sets the flag and wakes every wait registered now. Only the first call wakes.
    ///
    /// The flag is set before the list is taken, and a wait checks the flag after it
    /// registers: a wait registered too late to be woken sees the flag instead. The
    /// wakers run outside the list's mutex, so a waker may take the waiter's own mutex
    /// (to notify a condition variable without a lost wake-up) while that waiter, holding
    /// it, registers or deregisters.
    pub fn cancel(&self) {
        if self.cancelled.swap(true, Ordering::SeqCst) {
            return;
        }
        let woken = std::mem::take(&mut self.wakers.lock().list);
        for (_, wake) in woken {
            wake();
        }
    }

    pub fn is_cancelled(&self) -> bool {
        self.cancelled.load(Ordering::SeqCst)
    }

    /// Runs `wake` when the wait is cancelled, until the registration is dropped. It is
    /// not run if the flag is already set: the caller checks [`is_cancelled`] after
    /// registering (under its own mutex, for a condition variable).
    ///
    /// [`is_cancelled`]: Self::is_cancelled
    pub fn on_cancel(self: &Arc<Self>, wake: impl Fn() + Send + Sync + 'static) -> Registration {
        let mut wakers = self.wakers.lock();
        let id = wakers.next;
        wakers.next += 1;
        wakers.list.push((id, Box::new(wake)));
        Registration {
            owner: self.clone(),
            id,
        }
    }

    /// As [`on_cancel`](Self::on_cancel), for a waiter that sleeps on a channel: the
    /// waker sends on `poke` (when it is full, a poke is pending and wakes the waiter).
    pub fn on_cancel_poke(self: &Arc<Self>, poke: Sender<()>) -> Registration {
        self.on_cancel(move || {
            let _ = poke.try_send(());
        })
    }

    /// How many waits are registered now.
    pub fn waiting(&self) -> usize {
        self.wakers.lock().list.len()
    }
}

/// A waker registered with a [`Cancellation`]; removed when dropped.
pub(crate) struct Registration {
    owner: Arc<Cancellation>,
    id: u64,
}

impl Registration {
    /// Whether the wait it belongs to was cancelled.
    pub fn cancelled(&self) -> bool {
        self.owner.is_cancelled()
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.owner
            .wakers
            .lock()
            .list
            .retain(|(id, _)| *id != self.id);
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
        assert!(matches!(s.wait(None, None), Some(Grant::Contend { .. })));
    }

    #[test]
    fn deadline_without_grant() {
        let s = slot();
        let start = Instant::now();
        assert!(
            s.wait(Some(start + Duration::from_millis(30)), None)
                .is_none()
        );
        assert!(start.elapsed() >= Duration::from_millis(30));
    }

    #[test]
    fn grant_at_the_expected_time_is_taken_while_spinning() {
        let s = slot();
        s.expect_release(Instant::now() + Duration::from_millis(5), permit());
        let t = give_after(&s, Duration::from_millis(5));
        assert!(s.wait(None, None).is_some());
        t.join().unwrap();
    }

    #[test]
    fn mispredicted_release_falls_back_to_sleeping() {
        let s = slot();
        // Expected now, but the grant comes 50 ms later: the spin gives up, the wait does not.
        s.expect_release(Instant::now(), permit());
        let t = give_after(&s, Duration::from_millis(50));
        assert!(
            s.wait(Some(Instant::now() + Duration::from_secs(10)), None)
                .is_some()
        );
        t.join().unwrap();
    }

    #[test]
    fn a_cancel_wakes_a_waiting_slot_once_and_forgets_its_wakers() {
        let s = slot();
        let cancel = Arc::new(Cancellation::default());
        let woken = Arc::new(AtomicUsize::new(0));
        let registered = {
            let (s, woken) = (s.clone(), woken.clone());
            cancel.on_cancel(move || {
                woken.fetch_add(1, Ordering::SeqCst);
                s.poke();
            })
        };
        let dropped = cancel.on_cancel(|| panic!("deregistered: never run"));
        drop(dropped);
        assert_eq!(cancel.waiting(), 1);
        let t = {
            let cancel = cancel.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(20));
                cancel.cancel();
                cancel.cancel();
            })
        };
        assert!(
            s.wait(None, Some(&cancel)).is_none(),
            "cancelled, not granted"
        );
        t.join().unwrap();
        assert_eq!(woken.load(Ordering::SeqCst), 1);
        assert_eq!(cancel.waiting(), 0);
        drop(registered);
        // A grant that came first wins over a cancel.
        s.give(contend());
        assert!(s.wait(None, Some(&cancel)).is_some());
    }

    #[test]
    fn the_spin_lead_covers_how_late_the_timer_wakes() {
        let us = Duration::from_micros;
        let t = TimerLateness::new();
        assert_eq!(t.spin_lead(), SPIN_LEAD_MIN, "nothing seen yet");
        t.note(us(20));
        assert_eq!(
            t.spin_lead(),
            SPIN_LEAD_MIN,
            "a punctual timer: the least lead"
        );
        for _ in 0..40 {
            t.note(us(200));
        }
        let lead = t.spin_lead();
        assert!(
            lead > us(260) && lead <= us(200) + SPIN_MARGIN,
            "a timer 200 µs late: {lead:?}"
        );
        // A descheduled vCPU counts as the longest lead at most, and is forgotten.
        t.note(Duration::from_millis(50));
        assert!(t.spin_lead() <= SPIN_LEAD_MAX);
        for _ in 0..40 {
            t.note(us(10));
        }
        assert_eq!(t.spin_lead(), SPIN_LEAD_MIN);
    }

    #[test]
    fn deadline_inside_the_spin_window_is_kept() {
        let s = slot();
        let start = Instant::now();
        s.expect_release(start + Duration::from_millis(1), permit());
        assert!(
            s.wait(Some(start + Duration::from_millis(1)), None)
                .is_none()
        );
        // A late grant is still there for the caller's leave-the-queue check.
        s.give(contend());
        assert!(s.take().is_some());
    }

    #[test]
    fn a_release_expected_in_the_past_gives_the_permit_back_before_sleeping() {
        let s = slot();
        // The holder ahead already held longer than its estimate (or the head's timer woke
        // past the spin window): the head sleeps, and must not keep a spin permit meanwhile.
        s.expect_release(Instant::now() - Duration::from_secs(1), permit());
        let t = {
            let s = s.clone();
            std::thread::spawn(move || s.wait(Some(Instant::now() + Duration::from_secs(10)), None))
        };
        let mut given_back = false;
        for _ in 0..500 {
            if s.inbox.lock().expected.is_none() {
                given_back = true;
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        s.give(contend());
        assert!(t.join().unwrap().is_some());
        assert!(given_back, "the sleeping head kept its spin permit");
    }
}
