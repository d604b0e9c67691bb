//! Cleanup after failures: the releases and leaves nobody waits for, and the local state a
//! panicking waiter or holder leaves behind.
//!
//! An acquire whose outcome is unknown (its reply was lost, say) may have left our token
//! in Redis. The contender returns at once, keeping the caller's deadline, and leaves a
//! compare-and-delete to one cleanup thread per client. So does a waiter whose leaving
//! failed: its mark (or queue entry) would otherwise stay until it expires, and a release
//! meanwhile would grant the next hold to a waiter that has gone, leaving the ones still
//! waiting to their re-checks. The thread starts at the first
//! such failure and takes its work from a bounded queue: under a partition, where every
//! attempt fails this way, the process never grows more threads or memory; what does not
//! fit is dropped and counted ([`Stats::cleanup_dropped`](crate::Stats::cleanup_dropped)):
//! those keys expire with their lease instead. A job that fails for the network is tried
//! again, while no new job waits, until its key would have expired anyway.

use std::collections::VecDeque;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Sender, TryRecvError, TrySendError};
use parking_lot::Mutex;

use crate::error::{Error, Result};
use crate::proto::keys::Keys;
use crate::proto::node::{Node, NodeId, ReleaseReply, Retry};
use crate::proto::protocol::Protocol;
use crate::stats::Counters;
use crate::topology::{Route, Topology};

/// Releases waiting for the cleanup thread, at most; and as many again waiting to be
/// tried again.
pub(crate) const QUEUE: usize = 1024;

/// The pause before a job that failed for the network is tried again (while no new job
/// waits), until the key it gives back has expired anyway (see [`Cleanup`]'s `lease`).
const AGAIN_AFTER: Duration = Duration::from_millis(100);

/// One release or leave to make: the key, our token, what to do, and the nodes that may
/// hold it.
struct Job {
    keys: Keys,
    protocol: Protocol,
    token: String,
    undo: Undo,
    nodes: Vec<NodeId>,
    queued_at: Instant,
}

/// What a job gives back.
enum Undo {
    /// The hold of the token, with the holder's fence (`None`: an attempt nobody used, see
    /// `Protocol::release`).
    Release(Option<u64>),
    /// The wait of the token: its mark or queue entry, and a grant that raced its leaving
    /// or a hold a lost attempt took (see `Protocol::leave`).
    Leave,
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
        self.later(keys, protocol, token, Undo::Release(fence), nodes);
    }

    /// Queues the leaving of the waiter `token` on `nodes`, as [`Self::release_later`]
    /// does a release; what cannot be queued expires (the mark or entry, and any grant).
    pub fn leave_later(&self, keys: &Keys, protocol: Protocol, token: String, nodes: Vec<NodeId>) {
        self.later(keys, protocol, token, Undo::Leave, nodes);
    }

    fn later(
        &self,
        keys: &Keys,
        protocol: Protocol,
        token: String,
        undo: Undo,
        nodes: Vec<NodeId>,
    ) {
        let job = Job {
            keys: keys.clone(),
            protocol,
            token,
            undo,
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
        let counters = self.counters.clone();
        let thread = std::thread::Builder::new()
            .name("redbaton-cleanup".to_owned())
            .spawn(move || {
                // Jobs that failed for the network, tried again while no new job waits.
                let mut again: VecDeque<Job> = VecDeque::new();
                loop {
                    let job = match rx.try_recv() {
                        Ok(job) => job,
                        // The client dropped the sender.
                        Err(TryRecvError::Disconnected) => return,
                        Err(TryRecvError::Empty) => match again.pop_front() {
                            Some(job) => {
                                std::thread::sleep(AGAIN_AFTER);
                                job
                            }
                            None => match rx.recv() {
                                Ok(job) => job,
                                Err(_) => return,
                            },
                        },
                    };
                    let Some(topology) = topology.upgrade() else {
                        return;
                    };
                    if job.queued_at.elapsed() >= lease {
                        // A long partition: the key has expired by now anyway.
                        continue;
                    }
                    match catch_unwind(AssertUnwindSafe(|| job.run(&topology, &counters))) {
                        Ok(errors) if errors.iter().any(Error::is_connection) => {
                            log::debug!("cleanup of {} failed; trying again", job.keys.display());
                            if again.len() < QUEUE {
                                again.push_back(job);
                            } else {
                                Counters::inc(&counters.cleanup_dropped);
                            }
                        }
                        Ok(errors) => {
                            for e in errors {
                                log::debug!("cleanup failed (the keys expire with their TTL): {e}");
                            }
                        }
                        Err(_) => {
                            log::error!("cleanup panicked; the keys expire with their TTL")
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

impl Job {
    /// Makes the release or leave where the route of the key goes now; the errors.
    fn run(&self, topology: &Topology, counters: &Counters) -> Vec<Error> {
        let route = topology.route(&self.keys);
        let (keys, protocol, token) = (&self.keys, self.protocol, &self.token);
        let release = |fence| {
            release_on(topology, keys, &route, protocol, token, fence, &self.nodes)
                .into_iter()
                .filter_map(|r| r.err())
                .collect::<Vec<_>>()
        };
        match self.undo {
            Undo::Release(fence) => release(fence),
            Undo::Leave => {
                let mut errors = Vec::new();
                for node in route.holders(&self.nodes) {
                    match protocol.leave(&node, keys, token, true) {
                        Ok(true) => Counters::inc(&counters.grants_passed),
                        Ok(false) => {}
                        Err(e) => errors.push(e),
                    }
                }
                if !protocol.leave_gives_back() {
                    errors.extend(release(None));
                }
                errors
            }
        }
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
