//! Who decides that a waiter wakes: the subscriber of each node (its state, its thread and
//! its connection, which a sleeping waiter may read itself), the events it classifies, the
//! attempts it sends early, and the server's notification settings.

pub(crate) mod candidacy;
pub(crate) mod early;
pub(crate) mod events;
mod listen;
pub(crate) mod notify;
mod seat;
mod state;
mod stream;
pub(crate) mod subscriber;
mod turn;
