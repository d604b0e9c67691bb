//! What applications use: the builder, the client façade and the guards.

pub(crate) mod builder;
pub(crate) mod cancel;
pub(crate) mod client;
pub(crate) mod detached;
pub(crate) mod guard;
pub(crate) mod inspect;
pub(crate) mod latch;
pub(crate) mod multi;
pub(crate) mod rwlock;
pub(crate) mod semaphore;
