//! A waiter's side of `seat`: its offer to read its node's subscriber connection while it
//! sleeps, and its reads.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;
use redis::{RedisError, RedisResult};

use crate::stats::Counters;
use crate::wake::seat::Reader;
use crate::wake::state::Shared;
use crate::wake::turn::{POLL, Reading, step};

/// The shortest read a waiter makes, so that a wait about to end does not spin on reads
/// that time out at once (the socket's timeout has millisecond steps on Linux anyway).
const SHORTEST_READ: Duration = Duration::from_millis(1);

/// A waiter's offer to read its node's subscriber connection while it sleeps: while it is
/// its turn, [`read`](Candidacy::read) reads. Dropping it withdraws the offer and gives
/// the connection on.
pub(crate) struct Candidacy {
    shared: Arc<Shared>,
    ticket: u64,
}

impl Candidacy {
    /// Offers to read `shared`'s connection; `poke` tells the waiter when its turn comes.
    pub(super) fn stand(shared: Arc<Shared>, poke: Sender<()>) -> Self {
        let ticket = shared.booth.stand(poke);
        Candidacy { shared, ticket }
    }

    /// When it is this waiter's turn, reads the connection once, for at most the time
    /// until `until` (and at most the thread's own poll), and acts on what came as the
    /// thread would: whether anything came. `None` when it is not its turn (it is poked
    /// when it is).
    pub fn read(&self, until: Instant, counters: &Counters) -> Option<bool> {
        let shared = &self.shared;
        let wait = until
            .saturating_duration_since(Instant::now())
            .clamp(SHORTEST_READ, POLL);
        let reader = shared.booth.take(self.ticket)?;
        let mut in_hand = InHand {
            shared,
            reader: Some(reader),
        };
        crate::fault::hit(&shared.prefix, crate::fault::Point::WaiterRead);
        let read = match in_hand.reader.as_mut() {
            Some(reader) => step(shared, reader, counters, wait, Reading::Waiter(until)),
            None => Ok(false),
        };
        let heard = *read.as_ref().unwrap_or(&false);
        in_hand.give_back(read.map(|_| ()));
        Some(heard)
    }
}

impl Drop for Candidacy {
    fn drop(&mut self) {
        self.shared.booth.withdraw(self.ticket);
    }
}

/// The connection in a waiter's hands, during one read: given back after it, or, if the
/// read panics, reported lost so that the thread reconnects.
struct InHand<'a> {
    shared: &'a Shared,
    reader: Option<Reader>,
}

impl InHand<'_> {
    fn give_back(&mut self, read: RedisResult<()>) {
        if let Some(reader) = self.reader.take() {
            self.shared.booth.give_back(reader, read);
        }
    }
}

impl Drop for InHand<'_> {
    fn drop(&mut self) {
        if self.reader.is_some() {
            let lost =
                std::io::Error::other("a waiter's read of the subscriber connection panicked");
            self.give_back(Err(RedisError::from(lost)));
        }
    }
}
