//! Early attempts: the subscriber thread makes a waiting contender's next acquire attempt
//! the moment its key may be free, before it wakes the contender.
//!
//! Without this, a handoff between processes costs the event's delivery to the subscriber
//! thread, a wake-up of the contender thread, and only then the acquire's round trip, with
//! Redis gone idle in between. With it, the round trip starts as soon as the event is
//! read, on the thread that is already running, and a handoff between processes is that
//! much shorter (`docs/benchmarks.md` has the figures).
//!
//! A contender *arms* its watch with the request (built with its next token) just before it
//! sleeps, and *takes* it back at each wake-up, fired or not. The subscriber fires at most
//! one armed request per event, outside its state lock, on an idle pooled connection only
//! (it never opens a connection or waits for one), reads the reply, and records what the
//! key's counters were when it sent it: they are the contender's "before" for its next
//! wait, so no event after the attempt goes unseen. The subscriber thread spends one round
//! trip on it, during which events of other keys wait; a reply that does not come within
//! the read timeout is handed over as an error, and the contender retries with the same
//! token, as after any lost reply.
//!
//! Only one node (a Redlock round needs every node at once) and only with notifications.

use std::sync::Arc;
use std::time::Instant;

use redis::{Cmd, RedisResult, Value};

use crate::clock::Stamp;
use crate::error::is_network_error;
use crate::proto::node::within_deadline;
use crate::proto::pool::{Pool, call_deadline};
use crate::wake::events::Snapshot;

/// A request ready to go when the key is freed.
pub(crate) struct Armed {
    pool: Arc<Pool>,
    packed: Vec<u8>,
    /// The contender's deadline: the reply is waited for no longer than an attempt of
    /// the contender's own would be (the contender waits for the subscriber meanwhile).
    deadline: Option<Instant>,
}

impl Armed {
    pub fn new(pool: Arc<Pool>, call: &Cmd, deadline: Option<Instant>) -> Self {
        Armed {
            pool,
            packed: call.get_packed_command(),
            deadline,
        }
    }

    /// Sends the request on an idle connection and reads the reply; `None` when no
    /// connection was idle (the contender then makes the attempt itself). `bound`: the
    /// reader that sends it is a waiter, whose nap ends then: the reply is waited for no
    /// longer (cut, it is a lost reply, which the contender's retry settles).
    pub fn fire(self, at: Snapshot, bound: Option<Instant>) -> Option<Shot> {
        let mut conn = self.pool.try_idle()?;
        let (_, read_timeout, _) = self.pool.timeouts();
        // On the lease clock at the send itself: converted from an `Instant` later (when
        // the reply is read), a suspend of the machine meanwhile would put the send later
        // than it was, and a validity counted from it would be too long.
        let sent = Stamp::now();
        // A call of its own, given the least a call is given however near the deadline.
        let until = call_deadline(self.deadline.into_iter().chain(bound).min());
        let reply = within_deadline(&mut conn, until, read_timeout, |c| {
            c.send_packed_command(&self.packed)?;
            c.recv_response()
        });
        if let Err(e) = &reply
            && is_network_error(e)
        {
            // Its reply may still arrive: never reuse it.
            conn.discard();
        }
        Some(Shot { sent, at, reply })
    }
}

/// An attempt the subscriber made for a contender.
pub(crate) struct Shot {
    /// When it was sent, on the lease clock: the lease is counted from here.
    pub sent: Stamp,
    /// The key's counters when it was sent.
    pub at: Snapshot,
    /// The raw reply (errors included: the contender decides what they mean).
    pub reply: RedisResult<Value>,
}

/// What a watch holds for its contender.
pub(crate) enum Early {
    Armed(Armed),
    /// The subscriber is making the attempt (outside its state lock).
    Sending,
    Fired(Shot),
}
