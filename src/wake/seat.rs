//! Who reads a node's subscriber connection: its thread, or a waiter asleep on it.
//!
//! Through the thread, an event costs two wake-ups before a waiter can act on it: the
//! server's write wakes the thread, and the thread wakes the waiter. On a small virtual
//! machine each is tens of microseconds after idling, which is as much as a round trip, so
//! a grant taken from the message alone would be no faster than a waiter with no library
//! that reads its own subscription and then sends one script. So a waiter that sleeps on
//! one node's events offers to read the connection itself (a `Candidacy`): the thread,
//! between two of its reads, parks the connection here and pokes the oldest candidate;
//! that waiter then reads it in short turns while it sleeps, and acts on everything it
//! reads as the thread would (counting events, poking other waiters, sending early
//! attempts, subscribing). An event for its own key then wakes it directly, and its wait
//! ends on the thread the server woke.
//!
//! When the waiter's wait ends, it gives the connection on: to the next candidate (poked),
//! or back to the thread (notified). A read that fails hands the error to the thread, which
//! reconnects as after its own failed read (every waiter retries once). The thread takes
//! the connection back when the node moves or the client shuts down (`recall`): the
//! reading waiter gives it back at its next turn. It also takes the turn from a waiter
//! that has not read for a while (held up in an attempt: a slow server, a `WAIT` for
//! replicas, a migrating slot), whose turn would otherwise keep every other waiter's
//! events unread in the socket; that waiter is then woken by the thread, as the others.
//!
//! Nothing is lost in a change of reader: what the server sends meanwhile waits in the
//! socket. A change costs one wake-up, off the path of the event that ends a wait, except
//! the one that gives the connection back at the end of it.
//!
//! This file is the seat itself; the waiter's side is `candidacy`, the reading `turn`.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;
use parking_lot::{Condvar, Mutex};
use redis::RedisError;

use crate::wake::stream::Stream;

/// How often a thread that parked its connection looks at shutdown and a moved node (and
/// takes it back, if a waiter that gave it back could not wake it).
const PARKED_CHECK: Duration = Duration::from_millis(50);
/// How long a thread restarted after a panic waits for a waiter to give its connection
/// back: a waiter's read lasts a few milliseconds.
const RECLAIM_WAIT: Duration = Duration::from_secs(1);
/// How long the waiter whose turn it is may leave the connection parked without reading
/// before the thread takes the turn back: a waiter between two reads makes one attempt,
/// a round trip.
const IDLE_TURN: Duration = Duration::from_millis(100);

/// The subscriber connection, and what its reads carry from one to the next.
pub(super) struct Reader {
    pub stream: Stream,
    /// When traffic last came (the health check's `PING` follows a long silence).
    pub last_traffic: Instant,
    /// The thread's connection it is: one a waiter brings back after the thread moved on
    /// to a newer one is dropped.
    pub epoch: u64,
    /// The subscriptions' generation (`State::generation`) it serves: once the thread has
    /// forgotten them (a new generation), a read of this connection still in a waiter's
    /// hands must neither subscribe on it nor count its confirmations.
    pub generation: u64,
}

impl Reader {
    pub fn new(stream: Stream, epoch: u64, generation: u64) -> Self {
        Reader {
            stream,
            last_traffic: Instant::now(),
            epoch,
            generation,
        }
    }
}

/// The connection while the thread lets waiters read it, and the thread's wait for it.
#[derive(Default)]
pub(super) struct Booth {
    seat: Mutex<Seat>,
    back: Condvar,
}

#[derive(Default)]
struct Seat {
    /// The connection, parked between two reads; `None` while the thread or a waiter has
    /// it in hand.
    reader: Option<Reader>,
    /// When it was parked last.
    parked_at: Option<Instant>,
    /// The waiter whose turn it is to read, and its poke.
    leader: Option<(u64, Sender<()>)>,
    /// Waiters that offered to read while they sleep, oldest first, and their pokes.
    candidates: VecDeque<(u64, Sender<()>)>,
    /// The thread parked the connection and waits for it back.
    parked: bool,
    /// A waiter's read failed: the thread reconnects.
    failed: Option<RedisError>,
    /// The thread wants the connection back.
    recall: bool,
    /// The thread's current connection.
    epoch: u64,
    next_ticket: u64,
}

impl Seat {
    /// Gives the turn to the oldest candidate, when nobody has it and the thread does not
    /// want the connection back.
    fn hand_on(&mut self) {
        if self.leader.is_some() || self.recall || !self.parked {
            return;
        }
        if let Some((ticket, poke)) = self.candidates.pop_front() {
            let _ = poke.try_send(());
            self.leader = Some((ticket, poke));
            // Its idle time counts from its turn.
            self.parked_at = Some(Instant::now());
        }
    }

    /// The thread wants the connection back: nobody new gets the turn, and the waiter
    /// whose turn it is is poked, to give it back at its next read.
    fn recall(&mut self) {
        self.recall = true;
        if let Some((_, poke)) = &self.leader {
            let _ = poke.try_send(());
        }
    }

    /// Parks the connection (between two reads).
    fn put(&mut self, reader: Reader) {
        self.reader = Some(reader);
        self.parked_at = Some(Instant::now());
    }

    fn is_leader(&self, ticket: u64) -> bool {
        self.leader.as_ref().is_some_and(|(t, _)| *t == ticket)
    }

    /// The thread is done with its connection: dropped where it is parked, and when the
    /// waiter that has it in hand gives it back (a new epoch), and nobody has the turn.
    fn retire(&mut self) {
        self.epoch += 1;
        self.reader = None;
        self.leader = None;
        self.failed = None;
        self.parked = false;
        self.recall = false;
    }
}

/// What the thread gets when it stops waiting for its parked connection.
pub(super) enum Parked {
    Back(Reader),
    /// A waiter's read of it failed.
    Failed(RedisError),
    /// The client shuts down.
    Stop,
}

impl Booth {
    /// A new connection of the thread: the epoch that [`Reader::new`] takes. A reader of
    /// an older one, wherever it is, is dropped.
    pub fn new_connection(&self) -> u64 {
        let mut seat = self.seat.lock();
        seat.retire();
        seat.epoch
    }

    /// After the thread panicked (see `supervise`), wherever its connection was: waits
    /// (at most [`RECLAIM_WAIT`]) until no waiter has it in hand, then drops it, as a new
    /// connection would. Until then a waiter may read it and act on what it reads; after,
    /// none can, so that subscriptions the thread then forgets are not made again on a
    /// connection nobody will read. Whether it came back: `false` when a waiter still
    /// had it at the end of the wait (and may still act on what it read).
    pub fn reclaim(&self) -> bool {
        let mut seat = self.seat.lock();
        let mut back = true;
        if seat.parked {
            seat.recall();
            let deadline = Instant::now() + RECLAIM_WAIT;
            while seat.leader.is_some() && seat.reader.is_none() && seat.failed.is_none() {
                if self.back.wait_until(&mut seat, deadline).timed_out() {
                    log::warn!("a waiter kept the subscriber connection past {RECLAIM_WAIT:?}");
                    back = false;
                    break;
                }
            }
        }
        drop(seat);
        self.new_connection();
        back
    }

    /// Whether a waiter offered to read the connection.
    pub fn wanted(&self) -> bool {
        !self.seat.lock().candidates.is_empty()
    }

    /// The thread lets the waiters that offered read `reader`, and waits until none wants
    /// it any more, a read of theirs failed, the node moved (`moved`: it takes the
    /// connection back, to reconnect) or the client shuts down. `check` runs at each look.
    pub fn park(
        &self,
        reader: Reader,
        shutdown: &AtomicBool,
        moved: &dyn Fn() -> bool,
        check: &dyn Fn(),
    ) -> Parked {
        let mut seat = self.seat.lock();
        seat.put(reader);
        seat.parked = true;
        seat.recall = false;
        seat.hand_on();
        loop {
            if let Some(e) = seat.failed.take() {
                seat.parked = false;
                seat.reader = None;
                return Parked::Failed(e);
            }
            if seat.reader.is_some() && seat.parked_at.is_some_and(|t| t.elapsed() >= IDLE_TURN) {
                // The waiter whose turn it is reads no more (held up in an attempt): the
                // thread reads on, and wakes it with the others. It gets no turn again in
                // this wait.
                seat.leader = None;
            }
            if seat.leader.is_none()
                && let Some(reader) = seat.reader.take()
            {
                seat.parked = false;
                return Parked::Back(reader);
            }
            if shutdown.load(Ordering::Relaxed) {
                // The connection ends with the thread, also when a waiter reads it now:
                // left parked (or given back by that waiter), it would stay open and
                // subscribed, and that waiter would go on reading it, for as long as any
                // clone of the client lives.
                seat.retire();
                return Parked::Stop;
            }
            check();
            if !seat.recall && moved() {
                seat.recall();
            }
            self.back.wait_for(&mut seat, PARKED_CHECK);
        }
    }

    /// A waiter offers to read; `poke` tells it when its turn comes. Its ticket.
    pub fn stand(&self, poke: Sender<()>) -> u64 {
        let mut seat = self.seat.lock();
        let ticket = seat.next_ticket;
        seat.next_ticket += 1;
        seat.candidates.push_back((ticket, poke));
        // Parked with nobody reading (between two waiters): its turn at once.
        seat.hand_on();
        ticket
    }

    /// The waiter `ticket` takes the connection, to read it once and give it back, if it
    /// is its turn (`None`: it is poked when its turn comes).
    pub fn take(&self, ticket: u64) -> Option<Reader> {
        let mut seat = self.seat.lock();
        if !seat.is_leader(ticket) {
            return None;
        }
        if seat.recall {
            seat.leader = None;
            drop(seat);
            self.back.notify_all();
            return None;
        }
        seat.reader.take()
    }

    /// A waiter gives the connection back after a read: parked for its next turn, or, if
    /// the read failed, dropped and its error handed to the thread.
    pub fn give_back(&self, reader: Reader, read: Result<(), RedisError>) {
        let mut seat = self.seat.lock();
        match read {
            Ok(()) if reader.epoch == seat.epoch => {
                seat.put(reader);
                if seat.recall {
                    drop(seat);
                    self.back.notify_all();
                }
            }
            Ok(()) => {}
            Err(e) => {
                seat.failed = Some(e);
                seat.leader = None;
                drop(seat);
                self.back.notify_all();
            }
        }
    }

    /// The waiter `ticket` withdraws its offer, and gives the connection on if it was its
    /// turn: to the next candidate, or back to the thread.
    pub fn withdraw(&self, ticket: u64) {
        let mut seat = self.seat.lock();
        seat.candidates.retain(|(t, _)| *t != ticket);
        if seat.is_leader(ticket) {
            seat.leader = None;
            seat.hand_on();
            if seat.leader.is_none() {
                drop(seat);
                self.back.notify_all();
            }
        }
    }
}
