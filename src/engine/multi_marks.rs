//! The contention marks a client's multi-locks share: every multi-lock of a client marks
//! a name it waits for with the same id (see `multi`), so that whichever of them wins
//! clears it; one that stops waiting must leave the mark to another still waiting. The
//! client counts them per mark here, apart from the contest (which the engine's state,
//! holding the count, must not import).
//!
//! The last one to leave a mark removes it in Redis, after it has left the count: a
//! multi-lock that begins to wait on the mark meanwhile would mark it, and that removal,
//! arriving after, would take its mark. So a removal on its way is noted with the count,
//! and a multi-lock that joins a mark being removed waits for the removal to end before
//! its attempt (within its deadline, and until the caller cancels): its mark then comes
//! after the removal.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use parking_lot::{Condvar, Mutex};

use crate::local::mailbox::Cancellation;
use crate::proto::keys::Keys;

/// The client's multi-locks that wait with contention marks, counted by the mark they
/// share (see [`Waiting`]), and the marks whose removal is on its way. Shared with the
/// cancel wakers of the multi-locks waiting for a removal.
#[derive(Default)]
pub(crate) struct MultiMarks(Arc<Counts>);

#[derive(Default)]
struct Counts {
    marks: Mutex<HashMap<Mark, Count>>,
    /// Notified when a removal ends, and when a multi-lock waiting for one is cancelled.
    removed: Condvar,
}

/// A contention mark: the id it holds and its key.
type Mark = (String, Vec<u8>);

/// One mark's multi-locks.
#[derive(Default)]
struct Count {
    /// How many wait with it.
    waiting: usize,
    /// The last one to leave it is removing it in Redis.
    removing: bool,
}

/// A group contest's count in its client's [`MultiMarks`], from before its first attempt
/// that may leave a mark until its contest ends.
pub(crate) struct Waiting<'a> {
    counts: &'a MultiMarks,
    marks: Vec<Mark>,
    /// The marks this one left last, whose removal is on its way until
    /// [`removed`](Self::removed).
    removing: Vec<Mark>,
}

impl<'a> Waiting<'a> {
    pub fn new(counts: &'a MultiMarks) -> Self {
        Waiting {
            counts,
            marks: Vec::new(),
            removing: Vec::new(),
        }
    }

    /// Counted for the marks of `keys` with `mark_id`, unless already; first waits (until
    /// `deadline`, if any) for the removal on its way of any of them to end, so that the
    /// mark our next attempt leaves is not taken by it. False, and not counted, when
    /// `cancel` ends that wait.
    pub fn join(
        &mut self,
        mark_id: &str,
        keys: &[Keys],
        deadline: Option<Instant>,
        cancel: Option<&Arc<Cancellation>>,
    ) -> bool {
        if !self.marks.is_empty() {
            return true;
        }
        let marks: Vec<Mark> = keys
            .iter()
            .map(|k| (mark_id.to_owned(), k.mark().to_vec()))
            .collect();
        let counts = &self.counts.0;
        let removing = |waiting: &HashMap<Mark, Count>| {
            (marks.iter()).any(|m| waiting.get(m).is_some_and(|c| c.removing))
        };
        // Registered before the flag is read under the mutex, and notifying under it: a
        // cancel is either seen below or wakes the wait (see `Cancellation::cancel`).
        let _woken = cancel.map(|c| {
            let counts = Arc::clone(counts);
            c.on_cancel(move || {
                let _marks = counts.marks.lock();
                counts.removed.notify_all();
            })
        });
        let cancelled = || cancel.is_some_and(|c| c.is_cancelled());
        let mut waiting = counts.marks.lock();
        while removing(&waiting) {
            if cancelled() {
                return false;
            }
            match deadline {
                Some(d) => {
                    if counts.removed.wait_until(&mut waiting, d).timed_out() {
                        break;
                    }
                }
                None => counts.removed.wait(&mut waiting),
            }
        }
        for mark in &marks {
            waiting.entry(mark.clone()).or_default().waiting += 1;
        }
        self.marks = marks;
        true
    }

    /// Counted (since [`join`](Self::join), until [`leave`](Self::leave)): the marks may be
    /// ours, left by an attempt of ours or to us by another multi-lock that left.
    pub fn counted(&self) -> bool {
        !self.marks.is_empty()
    }

    /// No longer counted: per key (in `join`'s order, all false if never counted), whether
    /// it was the last of the client's multi-locks waiting with that mark, whose leaving
    /// may remove it. Those marks are noted as being removed until
    /// [`removed`](Self::removed).
    pub fn leave(&mut self) -> Vec<bool> {
        let mut waiting = self.counts.0.marks.lock();
        let marks = std::mem::take(&mut self.marks);
        let mut last = Vec::with_capacity(marks.len());
        for mark in marks {
            let count = waiting.entry(mark.clone()).or_default();
            count.waiting = count.waiting.saturating_sub(1);
            let alone = count.waiting == 0;
            if alone {
                count.removing = true;
                self.removing.push(mark);
            }
            last.push(alone);
        }
        last
    }

    /// The removal of the marks this one left last has ended (or was never sent): a
    /// multi-lock waiting to join them goes on.
    pub fn removed(&mut self) {
        if self.removing.is_empty() {
            return;
        }
        let mut waiting = self.counts.0.marks.lock();
        for mark in std::mem::take(&mut self.removing) {
            if let Some(count) = waiting.get_mut(&mark) {
                count.removing = false;
                if count.waiting == 0 {
                    waiting.remove(&mark);
                }
            }
        }
        self.counts.0.removed.notify_all();
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.leave();
        self.removed();
    }
}
