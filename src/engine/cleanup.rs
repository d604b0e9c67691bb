//! Cleanup after failures: the releases nobody waits for, and the local state a panicking
//! waiter leaves behind.
//!
//! An acquire whose outcome is unknown (its reply was lost, say) may have left our token
//! in Redis. The contender returns at once, keeping the caller's deadline, and leaves a
//! compare-and-delete to one cleanup thread per client. The thread starts at the first
//! such failure and takes its work from a bounded queue: under a partition, where every
//! attempt fails this way, the process never grows more threads or memory; what does not
//! fit is dropped and counted ([`Stats::cleanup_dropped`](crate::Stats::cleanup_dropped)):
//! those keys expire with their lease instead.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::Instant;

use crossbeam_channel::{Sender, TrySendError};
use parking_lot::Mutex;

use crate::api::client::Inner;
use crate::local::held::RemoteLock;
use crate::local::mailbox::Slot;
use crate::local::table::Grant;
use crate::proto::keys::Keys;
use crate::stats::Counters;

/// Releases waiting for the cleanup thread, at most.
pub(crate) const QUEUE: usize = 1024;

/// One release to make: the key, our token, and the nodes that may hold it.
struct Job {
    keys: Keys,
    token: String,
    nodes: Vec<usize>,
    queued_at: Instant,
}

/// The client's cleanup thread and its queue; the thread starts at the first job.
pub(crate) struct Cleanup {
    client: Weak<Inner>,
    worker: Mutex<Option<Worker>>,
}

struct Worker {
    jobs: Sender<Job>,
    thread: Option<JoinHandle<()>>,
}

impl Cleanup {
    pub fn new(client: Weak<Inner>) -> Self {
        Cleanup {
            client,
            worker: Mutex::new(None),
        }
    }

    /// Queues a compare-and-delete of `token` on `nodes`; never blocks. When the queue is
    /// full (or the thread cannot start) the release is dropped, counted, and the key
    /// expires with its lease.
    fn submit(&self, job: Job, counters: &Counters) {
        let mut worker = self.worker.lock();
        if worker.is_none() {
            match self.start() {
                Ok(w) => *worker = Some(w),
                Err(e) => {
                    log::warn!(
                        "cannot start the cleanup thread ({e}); the key expires with its lease"
                    );
                    Counters::inc(&counters.cleanup_dropped);
                    return;
                }
            }
        }
        let jobs = &worker.as_ref().expect("started above").jobs;
        match jobs.try_send(job) {
            Ok(()) => {}
            Err(TrySendError::Full(job)) => {
                Counters::inc(&counters.cleanup_dropped);
                log::debug!(
                    "cleanup queue full: {} expires with its lease",
                    job.keys.display()
                );
            }
            Err(TrySendError::Disconnected(_)) => Counters::inc(&counters.cleanup_dropped),
        }
    }

    fn start(&self) -> std::io::Result<Worker> {
        let (jobs, rx) = crossbeam_channel::bounded::<Job>(QUEUE);
        let client = self.client.clone();
        let thread = std::thread::Builder::new()
            .name("redbaton-cleanup".to_owned())
            .spawn(move || {
                // Ends when the client drops the sender.
                for job in rx {
                    let Some(inner) = client.upgrade() else {
                        return;
                    };
                    if job.queued_at.elapsed() >= inner.cfg.lease {
                        // A long partition: the key has expired by now anyway.
                        continue;
                    }
                    let released = catch_unwind(AssertUnwindSafe(|| {
                        inner.release_on(&job.keys, &job.token, job.nodes)
                    }));
                    match released {
                        Ok(replies) => {
                            for e in replies.into_iter().filter_map(|r| r.err()) {
                                log::debug!(
                                    "cleanup release failed (the key expires with its lease): {e}"
                                );
                            }
                        }
                        Err(_) => {
                            log::error!("cleanup release panicked; the key expires with its lease")
                        }
                    }
                }
            })?;
        Ok(Worker {
            jobs,
            thread: Some(thread),
        })
    }
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        let Some(mut worker) = self.worker.get_mut().take() else {
            return;
        };
        let thread = worker.thread.take();
        drop(worker); // closes the queue: the thread ends after the jobs left
        if let Some(t) = thread
            && t.thread().id() != std::thread::current().id()
        {
            let _ = t.join();
        }
    }
}

impl Inner {
    /// A compare-and-delete the caller does not wait for (see the module docs).
    pub(crate) fn release_later(&self, keys: &Keys, token: String, nodes: Vec<usize>) {
        let job = Job {
            keys: keys.clone(),
            token,
            nodes,
            queued_at: Instant::now(),
        };
        self.cleanup.submit(job, &self.counters);
    }

    /// A release is unwinding after the table marked the key as releasing: stop renewals,
    /// leave the compare-and-delete to the cleanup thread, and let the next local waiter
    /// contend.
    pub(crate) fn abandon_release(&self, lock: &RemoteLock) {
        lock.begin_release(&self.counters);
        self.release_later(
            &lock.keys,
            lock.token.clone(),
            (0..self.nodes.len()).collect(),
        );
        self.table.released(&lock.keys, false);
    }

    /// A queued waiter is unwinding: leave the queue, and pass on whatever reached it
    /// meanwhile (the duty to contend, or the lock itself), so that the key stays usable.
    pub(crate) fn abandon_queued(self: &Arc<Self>, keys: &Keys, slot: &Slot) {
        match self.table.abandon(keys, slot) {
            None => {}
            Some(Grant::Contend { .. }) => self.table.contend_failed(keys),
            Some(Grant::Baton { remote, .. }) => {
                if let Err(e) = self.release(&remote) {
                    log::warn!(
                        "lock {:?}: release after a panic failed (it expires with its lease): {e}",
                        keys.display()
                    );
                }
            }
        }
    }
}
