//! The read holds of one process: which remote read hold new local readers may join, how
//! many local readers share each, and what each thread holds, so that local readers share
//! one remote read hold and a thread never waits for itself.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::thread::ThreadId;
use std::time::Instant;

use parking_lot::{Condvar, Mutex};

use crate::local::held::RemoteLock;
use crate::proto::keys::Keys;

/// The read holds of one process and who holds what, so that local readers share one
/// remote read hold and a thread never waits for itself.
#[derive(Default)]
pub(crate) struct ReadShares {
    pub state: Mutex<SharesState>,
    /// Notified when a local reader's attempt in Redis ends.
    pub attempted: Condvar,
}

#[derive(Default)]
pub(crate) struct SharesState {
    /// Per name: the remote read hold that new local readers may join.
    pub current: HashMap<Keys, Current>,
    /// Per remote read hold (by id): how many local readers hold it.
    pub readers: HashMap<u64, usize>,
    /// What each thread holds, per name.
    pub threads: HashMap<(Keys, ThreadId), Mine>,
    /// Names for which a local reader is taking a read hold in Redis: other local readers
    /// wait for it and join its hold rather than contend too (singleflight).
    pub acquiring: HashSet<Keys>,
}

pub(crate) struct Current {
    pub remote: Arc<RemoteLock>,
    pub since: Instant,
    pub joins: u32,
}

pub(crate) enum Mine {
    /// This many read guards of the thread on this remote read hold.
    Read(Arc<RemoteLock>, usize),
    Write,
}
