//! Undoing local bookkeeping when a thread unwinds.
//!
//! Every begin/end pair of a lock's local state (a contender counted in the table, a key
//! marked as releasing, a renewal or an extend in flight) is closed by an [`OnUnwind`]
//! guard: if the code between them panics, the guard closes the pair on the way out, so a
//! panic never strands a key in the table and nothing waits for a flag that a dead frame
//! should have cleared.

/// Runs its closure when dropped, unless [`disarm`](OnUnwind::disarm)ed first: the normal
/// path disarms it and closes the pair itself.
#[must_use = "dropping the guard at once runs the undo at once"]
pub(crate) struct OnUnwind<F: FnOnce()> {
    undo: Option<F>,
}

impl<F: FnOnce()> OnUnwind<F> {
    pub fn new(undo: F) -> Self {
        OnUnwind { undo: Some(undo) }
    }

    /// The pair is being closed normally: do nothing on drop.
    pub fn disarm(mut self) {
        self.undo = None;
    }
}

impl<F: FnOnce()> Drop for OnUnwind<F> {
    fn drop(&mut self) {
        if let Some(undo) = self.undo.take() {
            undo();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::OnUnwind;
    use std::cell::Cell;

    #[test]
    fn runs_on_unwind_not_when_disarmed() {
        let ran = Cell::new(0);
        OnUnwind::new(|| ran.set(ran.get() + 1)).disarm();
        assert_eq!(ran.get(), 0);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _g = OnUnwind::new(|| ran.set(ran.get() + 1));
            panic!("boom");
        }));
        assert!(r.is_err());
        assert_eq!(ran.get(), 1);
    }
}
