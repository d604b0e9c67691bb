//! What one process keeps about the locks its threads hold or want: the singleflight
//! table, each queued waiter's mailbox, and the lock state shared by holder and watchdog.

pub(crate) mod held;
pub(crate) mod mailbox;
pub(crate) mod shares;
pub(crate) mod spin_choice;
pub(crate) mod table;
pub(crate) mod undo;
