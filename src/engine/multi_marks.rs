//! The contention marks a client's multi-locks share: every multi-lock of a client marks
//! a name it waits for with the same id (see `multi`), so that whichever of them wins
//! clears it; one that stops waiting must leave the mark to another still waiting. The
//! client counts them per mark here, apart from the contest (which the engine's state,
//! holding the count, must not import).

use std::collections::HashMap;

use parking_lot::Mutex;

use crate::proto::keys::Keys;

/// The client's multi-locks that wait with contention marks, counted by the mark they
/// share (see [`Waiting`]).
#[derive(Default)]
pub(crate) struct MultiMarks(Mutex<HashMap<Mark, usize>>);

/// A contention mark: the id it holds and its key.
type Mark = (String, Vec<u8>);

/// A group contest's count in its client's [`MultiMarks`], from before its first attempt
/// that may leave a mark until its contest ends.
pub(crate) struct Waiting<'a> {
    counts: &'a MultiMarks,
    marks: Vec<Mark>,
}

impl<'a> Waiting<'a> {
    pub fn new(counts: &'a MultiMarks) -> Self {
        Waiting {
            counts,
            marks: Vec::new(),
        }
    }

    /// Counted for the marks of `keys` with `mark_id`, unless already.
    pub fn join(&mut self, mark_id: &str, keys: &[Keys]) {
        if !self.marks.is_empty() {
            return;
        }
        self.marks = keys
            .iter()
            .map(|k| (mark_id.to_owned(), k.mark().to_vec()))
            .collect();
        let mut waiting = self.counts.0.lock();
        for mark in &self.marks {
            *waiting.entry(mark.clone()).or_default() += 1;
        }
    }

    /// No longer counted: per key (in `join`'s order, all false if never counted), whether
    /// it was the last of the client's multi-locks waiting with that mark, whose leaving
    /// may remove it.
    pub fn leave(&mut self) -> Vec<bool> {
        let mut waiting = self.counts.0.lock();
        std::mem::take(&mut self.marks)
            .into_iter()
            .map(|mark| match waiting.get_mut(&mark) {
                Some(n) if *n > 1 => {
                    *n -= 1;
                    false
                }
                _ => {
                    waiting.remove(&mark);
                    true
                }
            })
            .collect()
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.leave();
    }
}
