//! Who decides that a waiter wakes: the subscriber of each node, the events it
//! classifies, the attempts it sends early, and the server's notification settings.

pub(crate) mod early;
pub(crate) mod events;
pub(crate) mod notify;
pub(crate) mod subscriber;
