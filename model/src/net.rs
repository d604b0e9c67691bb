//! What travels between the clients and Redis: requests (script calls), their replies,
//! and the messages Redis publishes on the lock's channel.
//!
//! Requests, and messages to a paused process, wait in in-flight multisets (kept sorted,
//! so that equal states compare equal) from which the adversary takes items in any
//! order, or drops them. Requests of one process do not overtake each other on one
//! connection in reality, but the library uses several connections (a pool, a reconnect
//! after a timeout), so any order is possible. A reply is delivered when its script runs,
//! or lost (see `adversary`). One request may be held back (stalled) and land at a later
//! tick, after its sender moved on; and the cleanup's jobs wait here to be fired.

use crate::redis::{Answer, Op, Publish};

/// A script call in flight to Redis (`O`: the scripts of the lock, by default, or of
/// the shared holds, `crate::shared`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Request<O = Op> {
    /// The tick at which the client sent it.
    pub sent: u8,
    pub from: u8,
    pub op: O,
}

/// A reply to the client that sent `request`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Reply<O = Op, A = Answer> {
    /// The tick at which the script ran.
    pub at: u8,
    pub request: Request<O>,
    pub answer: A,
}

/// A published message in flight to one subscribed process.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Message<P = Publish> {
    /// The tick at which it was published.
    pub at: u8,
    pub to: u8,
    pub what: P,
}

/// A background job of a client's cleanup thread: a give-back (`op`, a compare-and-delete
/// of a token, or a leave) that the thread makes and then looks at again, until `until`,
/// when what it gives back would have expired anyway. The adversary fires it at any step
/// while it lives, as often as it likes (see `adversary`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Job<O = Op> {
    /// Alive while `now < until`.
    pub until: u8,
    pub from: u8,
    pub op: O,
}

impl<O: GiveBack> Job<O> {
    /// The job the cleanup thread of `from` makes at `now` for `op`: it lives while what
    /// `op` gives back could (a hold its `lease`; a queue entry or a mark `mark_ttl`, or
    /// the lease if longer, for a leave, which may take a hold out too).
    pub fn new((from, now): (u8, u8), op: O, lease: u8, mark_ttl: u8) -> Self {
        let lives = if op.is_leave() {
            lease.max(mark_ttl)
        } else {
            lease
        };
        Job {
            until: now + lives,
            from,
            op,
        }
    }
}

/// A script call a cleanup job can make.
pub trait GiveBack {
    /// Whether it takes a waiter's entry or mark out (a leave) rather than a hold.
    fn is_leave(&self) -> bool;
}

/// Everything in flight.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Net<O = Op, P = Publish> {
    pub requests: Vec<Request<O>>,
    pub messages: Vec<Message<P>>,
    /// A request held back on its way: it may land at any tick after its longest
    /// ordinary delay, up to `adversary::Bounds::stall` ticks after it was sent, or never.
    pub stalled: Option<Request<O>>,
    /// The cleanup's jobs still alive, sorted.
    pub jobs: Vec<Job<O>>,
}

impl<O, P> Default for Net<O, P> {
    fn default() -> Self {
        Net {
            requests: Vec::new(),
            messages: Vec::new(),
            stalled: None,
            jobs: Vec::new(),
        }
    }
}

/// Adds `item` to a sorted multiset.
pub fn put<T: Ord>(items: &mut Vec<T>, item: T) {
    let at = items.partition_point(|x| x <= &item);
    items.insert(at, item);
}

/// Removes one `item` from a multiset; whether it was there.
pub fn take<T: PartialEq>(items: &mut Vec<T>, item: &T) -> bool {
    match items.iter().position(|x| x == item) {
        Some(at) => {
            items.remove(at);
            true
        }
        None => false,
    }
}

/// Process `from` sends `op` at `now`: into `sent` (what the step put in flight), and into
/// `pending` when it awaits the reply.
pub fn send<O: Copy>(
    sent: &mut Vec<Request<O>>,
    pending: &mut Option<Request<O>>,
    (from, now): (u8, u8),
    op: O,
    awaited: bool,
) {
    let request = Request {
        sent: now,
        from,
        op,
    };
    if awaited {
        *pending = Some(request);
    }
    sent.push(request);
}
