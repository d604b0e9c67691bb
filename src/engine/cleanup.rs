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
//! again, while no new job waits, until what it gives back would have expired anyway: the
//! hold one lease after it was written, a waiter's mark or queue entry its own TTL after
//! the waiter's last attempt.
//!
//! An attempt delayed on its way can land after its give-back ran (the give-back went on
//! a fresh connection and overtook it), and take a free lock, or queue again, with a token
//! nobody holds: the name would then be nobody's for a lease. So a give-back of an attempt
//! (a release of a hold nobody used, or a leave) is looked at again while what a late
//! attempt could leave lives, at pauses that double from [`LOOK_AGAIN`]: a late landing is
//! given back within about as long as the attempt was late. The token was retired when it
//! was given back (invariant 3), so a look finds only what a late attempt left. So is the
//! token of an attempt sent again after a lost reply, whose retry overtook the first send:
//! a retry that finds the lock held says nothing of the first send, and a hold the retry
//! won is looked at again after its release (the first send would take it again then),
//! also a release left to this thread (see `Job::resent`). A look that is due runs before
//! a job is tried again for the network: a node that cannot be reached is tried again
//! until its job is moot, and must not hold up the looks at the others.

use std::collections::VecDeque;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{RecvTimeoutError, Sender, TryRecvError, TrySendError};
use parking_lot::Mutex;

use crate::error::{Error, Result};
use crate::local::held::RemoteLock;
use crate::proto::keys::Keys;
use crate::proto::node::{Node, NodeId, ReleaseReply, Retry};
use crate::proto::protocol::Protocol;
use crate::stats::{Count, Counters};
use crate::topology::{Route, Topology};

/// Releases waiting for the cleanup thread, at most; and as many again waiting to be
/// tried again.
pub(crate) const QUEUE: usize = 1024;

/// The pause before a job that failed for the network is tried again (while no new job
/// waits), until what it gives back has expired anyway (see `Job::lives`).
const AGAIN_AFTER: Duration = Duration::from_millis(100);

/// The first pause before a give-back of an attempt is looked at again (see the module
/// docs); each look after that waits twice as long as the one before.
const LOOK_AGAIN: Duration = Duration::from_millis(100);

/// One release or leave to make: the key, our token, what to do, and the nodes that may
/// hold it.
struct Job {
    keys: Keys,
    protocol: Protocol,
    token: String,
    undo: Undo,
    nodes: Vec<NodeId>,
    /// When what the job gives back has expired anyway: it is not tried after that.
    moot_at: Instant,
    /// Not run before then (a look again, see the module docs).
    due: Instant,
    /// How many times it ran and reached Redis: a job that did is looked at again, not
    /// retried, and is not counted as dropped when the client shuts down.
    looks: u32,
    /// The release of a hold won by a retry (see `RemoteLock::resent`): once made, its
    /// token is given back as an attempt's, and looked at again, since the first send of
    /// the attempt may land after it.
    resent: bool,
}

/// What a job gives back.
enum Undo {
    /// The hold of the token, with the holder's fence (`None`: an attempt nobody used, see
    /// `Protocol::release`).
    Release(Option<u64>),
    /// The wait of the token: its mark or queue entry, and a grant that raced its leaving
    /// or a hold a lost attempt took (see `Protocol::leave`).
    Leave,
    /// The contention mark of a wait that kept no token (see `Protocol::unmark`).
    Unmark,
}

impl Undo {
    /// The give-back of an attempt of a token nobody uses: a leave where a waiter's leave
    /// gives back a hold too (see `Protocol::leave_gives_back`), since an attempt of the
    /// token that lands late while another holds the name queues the token (or marks the
    /// name waited for) instead of taking it; else the release of a hold nobody used.
    fn give_back(protocol: Protocol) -> Undo {
        match protocol.leave_gives_back() {
            true => Undo::Leave,
            false => Undo::Release(None),
        }
    }
}

/// The client's cleanup thread and its queue; the thread starts at the first job. It holds
/// the nodes weakly: it must not keep the client's connections alive.
pub(crate) struct Cleanup {
    topology: Weak<Topology>,
    counters: Arc<Counters>,
    /// How long a hold outlives its last write: a release older than this is skipped, the
    /// key has expired by then anyway. (A leave waits longer when its mark or entry
    /// lives longer, see [`Job::lives`].)
    lease: Duration,
    worker: Mutex<Option<Worker>>,
    /// The client's key prefix (where faults are injected, see `crate::fault`).
    prefix: String,
    /// [`Cleanup::shutdown`] was called: no thread starts again, new jobs are dropped.
    stopped: AtomicBool,
    /// The thread a shutdown stopped, until it is joined: a shutdown that timed out leaves
    /// it to the next one, and to the drop.
    stopping: crate::worker::Thread,
}

struct Worker {
    jobs: Sender<Job>,
    thread: Option<JoinHandle<()>>,
}

impl Cleanup {
    pub fn new(
        topology: Weak<Topology>,
        counters: Arc<Counters>,
        lease: Duration,
        prefix: String,
    ) -> Self {
        Cleanup {
            topology,
            counters,
            lease,
            worker: Mutex::new(None),
            prefix,
            stopped: AtomicBool::new(false),
            stopping: crate::worker::Thread::none(),
        }
    }

    /// Stops the thread: the jobs still queued are made, the ones being tried again are
    /// given up (their keys expire with their TTL; counted as dropped), and no new job is
    /// taken. Waits for it until `deadline`; `false` if it still runs then (it ends once
    /// its current Redis call returns; the next shutdown, or the drop, waits for it).
    pub fn shutdown(&self, deadline: Instant) -> bool {
        // Set under the worker's lock, where `later` reads it: no thread starts after this.
        let taken = {
            let mut worker = self.worker.lock();
            self.stopped.store(true, Ordering::Relaxed);
            worker.take()
        };
        if let Some(mut worker) = taken {
            if let Some(thread) = worker.thread.take() {
                self.stopping.put(thread);
            }
            drop(worker); // closes the queue
        }
        self.stopping.join_until(deadline)
    }

    /// Queues a compare-and-delete of `token` on `nodes`, a hold nobody used (see
    /// `Protocol::release`; a holder's goes by [`Self::release_hold_later`]); never blocks.
    /// When the queue is full (or the thread cannot start) the release is dropped, counted,
    /// and the key expires with its lease.
    pub fn release_later(
        &self,
        keys: &Keys,
        protocol: Protocol,
        token: String,
        nodes: Vec<NodeId>,
    ) {
        let undo = Undo::Release(None);
        self.later(keys, protocol, token, undo, nodes, (0, false));
    }

    /// Queues the release of `lock`, a hold of ours, on `nodes`, as [`Self::release_later`]
    /// does; a hold won by a retry is looked at again after (see `Job::resent`).
    pub fn release_hold_later(&self, lock: &RemoteLock, nodes: Vec<NodeId>) {
        let (keys, protocol, token) = (&lock.keys, lock.protocol, lock.token.clone());
        let undo = Undo::Release(Some(lock.fence));
        self.later(keys, protocol, token, undo, nodes, (0, lock.resent()));
    }

    /// Queues the give-back of an attempt of `token` nobody uses (a hold it took, and what
    /// it left waiting: see `Undo::give_back`), as [`Self::release_later`] does a release.
    /// The token must not be used again.
    pub fn give_back_later(
        &self,
        keys: &Keys,
        protocol: Protocol,
        token: String,
        nodes: Vec<NodeId>,
    ) {
        self.later(
            keys,
            protocol,
            token,
            Undo::give_back(protocol),
            nodes,
            (0, false),
        );
    }

    /// Queues the leaving of the waiter `token` on `nodes`, as [`Self::release_later`]
    /// does a release; what cannot be queued expires (the mark or entry, and any grant).
    pub fn leave_later(&self, keys: &Keys, protocol: Protocol, token: String, nodes: Vec<NodeId>) {
        self.later(keys, protocol, token, Undo::Leave, nodes, (0, false));
    }

    /// Queues the removal of a contention mark on `nodes` (a wait that kept no token), as
    /// [`Self::leave_later`] does a leave; what cannot be queued expires with its TTL.
    pub fn unmark_later(&self, keys: &Keys, protocol: Protocol, nodes: Vec<NodeId>) {
        self.later(
            keys,
            protocol,
            String::new(),
            Undo::Unmark,
            nodes,
            (0, false),
        );
    }

    /// Queues a look, after a pause, at the leaving of the waiter `token` that was made on
    /// `nodes` while an attempt of it was still unanswered there: the attempt may land
    /// after the leaving (see the module docs).
    pub fn look_again(&self, keys: &Keys, protocol: Protocol, token: String, nodes: Vec<NodeId>) {
        self.later(keys, protocol, token, Undo::Leave, nodes, (1, false));
    }

    fn later(
        &self,
        keys: &Keys,
        protocol: Protocol,
        token: String,
        undo: Undo,
        nodes: Vec<NodeId>,
        (looks, resent): (u32, bool),
    ) {
        let lives = Job::lives(protocol, &undo, self.lease);
        let now = Instant::now();
        let job = Job {
            keys: keys.clone(),
            protocol,
            token,
            undo,
            nodes,
            moot_at: now + lives,
            due: now + Job::pause(looks),
            looks,
            resent,
        };
        let mut worker = self.worker.lock();
        if self.stopped.load(Ordering::Relaxed) {
            log::debug!(
                "client shut down: the cleanup of {} is left to the keys' TTL",
                job.keys.display()
            );
            Counters::inc(&self.counters.cleanup_dropped);
            return;
        }
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
        let topology = self.topology.clone();
        let counters = self.counters.clone();
        let prefix = self.prefix.clone();
        let thread = std::thread::Builder::new()
            .name("redbaton-cleanup".to_owned())
            .spawn(move || {
                // Jobs that failed for the network, tried again while no new job waits.
                let mut again: VecDeque<Job> = VecDeque::new();
                // Jobs to look at again when due (see the module docs), while no new job
                // or retry waits.
                let mut looks: Vec<Job> = Vec::new();
                // The jobs given up when the thread stops, before what they give back has
                // expired, are dropped as much as those that did not fit in the queue:
                // their keys expire with their TTL. (A look again is not: its job was
                // made.)
                let give_up = |jobs: &mut dyn Iterator<Item = Job>| {
                    let now = Instant::now();
                    let live = jobs
                        .filter(|job| now < job.moot_at && job.looks == 0)
                        .count();
                    counters.cleanup_dropped.count(live as u64);
                };
                loop {
                    // A look that is due goes before a retry: a job that keeps failing for
                    // the network (a node that cannot be reached) is retried until it is
                    // moot, a lease, and the looks at the other nodes must not wait so long.
                    let now = Instant::now();
                    let due = (looks.iter().enumerate())
                        .filter(|(_, job)| job.due <= now)
                        .min_by_key(|(_, job)| job.due)
                        .map(|(i, _)| i);
                    let job = match (rx.try_recv(), due) {
                        (Ok(job), _) => job,
                        // The client shut down: the queue is made, the retries given up.
                        (Err(TryRecvError::Disconnected), _) => {
                            return give_up(&mut again.drain(..));
                        }
                        (Err(TryRecvError::Empty), Some(i)) => looks.swap_remove(i),
                        (Err(TryRecvError::Empty), None) => match again.pop_front() {
                            Some(job) => {
                                std::thread::sleep(AGAIN_AFTER);
                                job
                            }
                            None => {
                                let next = (looks.iter().enumerate())
                                    .min_by_key(|(_, job)| job.due)
                                    .map(|(i, job)| (i, job.due));
                                let got = match next {
                                    Some((i, due)) => match rx.recv_deadline(due) {
                                        Err(RecvTimeoutError::Timeout) => Ok(looks.swap_remove(i)),
                                        got => got.map_err(|_| ()),
                                    },
                                    None => rx.recv().map_err(|_| ()),
                                };
                                match got {
                                    Ok(job) => job,
                                    Err(()) => return give_up(&mut again.drain(..)),
                                }
                            }
                        },
                    };
                    let Some(topology) = topology.upgrade() else {
                        // The client is gone: this job, the retries and the queue with it.
                        let mut left = std::iter::once(job)
                            .chain(again.drain(..))
                            .chain(rx.try_iter());
                        return give_up(&mut left);
                    };
                    let now = Instant::now();
                    if now >= job.moot_at {
                        // A long partition: what the job gives back has expired by now.
                        continue;
                    }
                    if now < job.due {
                        if looks.len() < QUEUE {
                            looks.push(job);
                        }
                        continue;
                    }
                    let run = || {
                        crate::fault::hit(&prefix, crate::fault::Point::Cleanup);
                        job.run(&topology, &counters)
                    };
                    match catch_unwind(AssertUnwindSafe(run)) {
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
                            if let Some(job) = job.look_again()
                                && looks.len() < QUEUE
                            {
                                looks.push(job);
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
    /// How long after it is queued what a job gives back may still be in Redis: a hold
    /// (and a grant, shorter) lives its `lease` after its last write; a leave also takes
    /// out the waiter's mark or queue entry, which lives its own TTL (two re-check
    /// intervals, which may be longer than the lease) after the waiter's last attempt.
    /// Given up earlier, a departed waiter's entry could stay in a fair queue ahead of
    /// live waiters, and a release grant it the lock, which nobody takes until the grant
    /// runs out.
    fn lives(protocol: Protocol, undo: &Undo, lease: Duration) -> Duration {
        match undo {
            Undo::Release(_) => lease,
            Undo::Leave | Undo::Unmark => lease.max(protocol.waiter_ttl()),
        }
    }

    /// The pause before the look number `looks` (none before a job's first run).
    fn pause(looks: u32) -> Duration {
        match looks {
            0 => Duration::ZERO,
            n => LOOK_AGAIN.saturating_mul(1 << (n - 1).min(20)),
        }
    }

    /// The same job, to run again after the next pause, when it gives back an attempt (a
    /// hold nobody used, or a wait) and what a late attempt could leave lives past then.
    fn look_again(mut self) -> Option<Job> {
        if let Undo::Release(Some(_)) = self.undo {
            if !self.resent {
                return None;
            }
            self.undo = Undo::give_back(self.protocol);
        }
        self.looks += 1;
        self.due = Instant::now() + Job::pause(self.looks);
        (self.due < self.moot_at).then_some(self)
    }

    /// Makes the release or leave where the route of the key goes now; the errors.
    fn run(&self, topology: &Topology, counters: &Counters) -> Vec<Error> {
        let route = topology.route(&self.keys);
        let (keys, protocol, token) = (&self.keys, self.protocol, &self.token);
        // A look again that finds something: an attempt landed after its caller left.
        let late = || {
            if self.looks > 0 {
                log::info!(
                    "an attempt on {} landed after its caller left; given back",
                    keys.display()
                );
            }
        };
        let release = |fence| {
            let replies = release_on(
                topology,
                keys,
                &route,
                protocol,
                token,
                (fence, None),
                &self.nodes,
            );
            let mut errors = Vec::new();
            for reply in replies {
                match reply {
                    Ok(ReleaseReply::Released | ReleaseReply::Passed) => late(),
                    Ok(_) => {}
                    Err(e) => errors.push(e),
                }
            }
            errors
        };
        match self.undo {
            Undo::Release(fence) => release(fence),
            Undo::Leave => {
                let mut errors = Vec::new();
                for node in route.holders(&self.nodes) {
                    match protocol.leave(&node, keys, token, true, None) {
                        Ok(true) => {
                            late();
                            Counters::inc(&counters.grants_passed)
                        }
                        Ok(false) => {}
                        Err(e) => errors.push(e),
                    }
                }
                if protocol.left_later_gives_back() {
                    errors.extend(release(None));
                }
                errors
            }
            Undo::Unmark => (route.holders(&self.nodes).iter())
                .filter_map(|node| protocol.unmark(node, keys, None).err())
                .collect(),
        }
    }
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        if let Some(mut worker) = self.worker.get_mut().take() {
            if let Some(thread) = worker.thread.take() {
                self.stopping.put(thread);
            }
            // Closes the queue.
            drop(worker);
        }
        // The thread ends at once (also one a shutdown stopped and could not wait for):
        // the topology, dropped before this (it is declared first in `Engine`), is gone,
        // and the jobs left go with it (their keys expire with their TTL): a client's drop
        // never waits out a partition, only the call under way.
        self.stopping.join_now();
    }
}

/// Compare-and-delete of `token` where the nodes `ids` left it: those of them on
/// `route`, or the route's node now when the lock follows its route (Redis Cluster: a
/// failover or a reshard since moved it), in parallel; the replies. `fence`: the holder's,
/// and `deadline` (see `Protocol::release`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn release_on(
    topology: &Topology,
    keys: &Keys,
    route: &Route,
    protocol: Protocol,
    token: &str,
    (fence, deadline): (Option<u64>, Option<Instant>),
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
        (false, deadline),
    )
}

/// Compare-and-delete of `token`'s hold of `protocol` on `nodes`, in parallel; `fence`,
/// `resent` and `deadline`: see `Protocol::release`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn release_at(
    topology: &Topology,
    keys: &Keys,
    nodes: &[Arc<Node>],
    retry: Retry,
    protocol: Protocol,
    token: &str,
    fence: Option<u64>,
    (resent, deadline): (bool, Option<Instant>),
) -> Vec<Result<ReleaseReply>> {
    if let [node] = nodes {
        return vec![protocol.release(node, keys, token, fence, retry, resent, deadline)];
    }
    let (k, t) = (keys.clone(), token.to_owned());
    topology.fan_out(nodes, move |node| {
        protocol.release(node, &k, &t, fence, retry, resent, deadline)
    })
}
