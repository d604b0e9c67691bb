//! Cleanup after failures: the releases nobody waits for, and the local state a panicking
//! waiter or holder leaves behind.
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
use std::time::{Duration, Instant};

use crossbeam_channel::{Sender, TrySendError};
use parking_lot::Mutex;

use crate::error::Result;
use crate::proto::keys::Keys;
use crate::proto::node::{Node, NodeId, ReleaseReply, Retry};
use crate::proto::protocol::Protocol;
use crate::stats::Counters;
use crate::topology::{Route, Topology};

/// Releases waiting for the cleanup thread, at most.
pub(crate) const QUEUE: usize = 1024;

/// One release to make: the key, our token, the holder's fence (`None`: an attempt nobody
/// used, see `Protocol::release`), and the nodes that may hold it.
struct Job {
    keys: Keys,
    protocol: Protocol,
    token: String,
    fence: Option<u64>,
    nodes: Vec<NodeId>,
    queued_at: Instant,
}

/// The client's cleanup thread and its queue; the thread starts at the first job. It holds
/// the nodes weakly: it must not keep the client's connections alive.
pub(crate) struct Cleanup {
    topology: Weak<Topology>,
    counters: Arc<Counters>,
    /// A job older than this is skipped: the key has expired by then anyway.
    lease: Duration,
    worker: Mutex<Option<Worker>>,
}

struct Worker {
    jobs: Sender<Job>,
    thread: Option<JoinHandle<()>>,
}

impl Cleanup {
    pub fn new(topology: Weak<Topology>, counters: Arc<Counters>, lease: Duration) -> Self {
        Cleanup {
            topology,
            counters,
            lease,
            worker: Mutex::new(None),
        }
    }

    /// Queues a compare-and-delete of `token` on `nodes` (`fence`: the holder's, see
    /// `Protocol::release`); never blocks. When the queue is full (or the thread cannot
    /// start) the release is dropped, counted, and the key expires with its lease.
    pub fn release_later(
        &self,
        keys: &Keys,
        protocol: Protocol,
        token: String,
        fence: Option<u64>,
        nodes: Vec<NodeId>,
    ) {
        let job = Job {
            keys: keys.clone(),
            protocol,
            token,
            fence,
            nodes,
            queued_at: Instant::now(),
        };
        let mut worker = self.worker.lock();
        if worker.is_none() {
            match self.start() {
                Ok(w) => *worker = Some(w),
                Err(e) => {
                    log::warn!(
                        "cannot start the cleanup thread ({e}); the key expires with its lease"
                    );
                    Counters::inc(&self.counters.cleanup_dropped);
                    return;
                }
            }
        }
        let jobs = &worker.as_ref().expect("started above").jobs;
        match jobs.try_send(job) {
            Ok(()) => {}
            Err(TrySendError::Full(job)) => {
                Counters::inc(&self.counters.cleanup_dropped);
                log::debug!(
                    "cleanup queue full: {} expires with its lease",
                    job.keys.display()
                );
            }
            Err(TrySendError::Disconnected(_)) => Counters::inc(&self.counters.cleanup_dropped),
        }
    }

    fn start(&self) -> std::io::Result<Worker> {
        let (jobs, rx) = crossbeam_channel::bounded::<Job>(QUEUE);
        let (topology, lease) = (self.topology.clone(), self.lease);
        let thread = std::thread::Builder::new()
            .name("redbaton-cleanup".to_owned())
            .spawn(move || {
                // Ends when the client drops the sender.
                for job in rx {
                    let Some(topology) = topology.upgrade() else {
                        return;
                    };
                    if job.queued_at.elapsed() >= lease {
                        // A long partition: the key has expired by now anyway.
                        continue;
                    }
                    let released = catch_unwind(AssertUnwindSafe(|| {
                        let route = topology.route(&job.keys);
                        release_on(
                            &topology,
                            &job.keys,
                            &route,
                            job.protocol,
                            &job.token,
                            job.fence,
                            &job.nodes,
                        )
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
        if let Some(t) = thread {
            crate::worker::join(t);
        }
    }
}

/// Compare-and-delete of `token` where the nodes `ids` left it: those of them on
/// `route`, or the route's node now when the lock follows its route (Redis Cluster: a
/// failover or a reshard since moved it), in parallel; the replies. `fence`: the holder's
/// (see `Protocol::release`).
pub(crate) fn release_on(
    topology: &Topology,
    keys: &Keys,
    route: &Route,
    protocol: Protocol,
    token: &str,
    fence: Option<u64>,
    ids: &[NodeId],
) -> Vec<Result<ReleaseReply>> {
    if ids.is_empty() {
        return Vec::new();
    }
    release_at(
        topology,
        keys,
        &route.holders(ids),
        route.retry(),
        protocol,
        token,
        fence,
    )
}

/// Compare-and-delete of `token`'s hold of `protocol` on `nodes`, in parallel; `fence`:
/// the holder's (see `Protocol::release`).
pub(crate) fn release_at(
    topology: &Topology,
    keys: &Keys,
    nodes: &[Arc<Node>],
    retry: Retry,
    protocol: Protocol,
    token: &str,
    fence: Option<u64>,
) -> Vec<Result<ReleaseReply>> {
    if let [node] = nodes {
        return vec![protocol.release(node, keys, token, fence, retry)];
    }
    let (k, t) = (keys.clone(), token.to_owned());
    topology.fan_out(nodes, move |node| {
        protocol.release(node, &k, &t, fence, retry)
    })
}
