//! Runs one operation on every Redlock node at once, so that a round costs about the
//! slowest node's round trip, not the sum. Every node has long-lived worker threads of its
//! own (spawning threads per call would cost more than a loopback round trip), the first
//! one included: a caller that made one node's call itself would wait out that node's
//! timeout whenever it hangs.
//!
//! One bounded queue per node: a hung node's calls (each waits out its timeout) occupy
//! only that node's workers, never the workers of the healthy nodes. And no round waits
//! for a hung node either: once a node's last call took half a read timeout or more (or
//! every worker is busy and none has finished a call for that long), the node is
//! *stalled*, and calls to it are made on the caller's thread in skipping mode (they fail
//! at once, as a timeout would; see `proto::skip`), so the healthy majority decides every
//! round at once. Meanwhile one probe at a time (a `PING`) goes to the node on its own
//! workers, which no caller waits for: once the node answers quickly again, it is used
//! again. A call that waited in a node's queue for `stall` or more before a worker took
//! it (queued behind calls to a node that has just hung, before any of them ended) is
//! skipped too: a round waits for a hung node about one of its timeouts at most. When a
//! node's queue is full, the caller makes that node's call itself (backpressure).

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Sender, TrySendError};
use parking_lot::Mutex;

use crate::proto::skip::skipping;

type Job = Box<dyn FnOnce() + Send>;

/// Worker threads per node (calls to one node in flight at once from this client).
const WORKERS_PER_NODE: usize = 2;
/// Calls waiting for a node's workers, at most.
const QUEUE_PER_NODE: usize = 64;

/// One node's queue (each call with when it was queued), and how its workers are doing.
struct Lane {
    jobs: Sender<(Instant, Job)>,
    state: Arc<LaneState>,
}

/// Shared with the node's workers (which must not hold the sender: dropping it ends them).
struct LaneState {
    /// Calls queued or running.
    pending: AtomicUsize,
    /// A probe of a stalled node is queued or running.
    probing: AtomicBool,
    /// When a worker last finished a call (or the lane started), and how long that
    /// call took.
    progress: Mutex<(Instant, Duration)>,
}

impl LaneState {
    /// The node is not keeping up: its last call (or probe) took `stall` or more, or every
    /// worker is busy and none has finished anything for `stall`.
    fn stalled(&self, stall: Duration) -> bool {
        let pending = self.pending.load(Ordering::Acquire);
        let (at, took) = *self.progress.lock();
        took >= stall || (pending >= WORKERS_PER_NODE && at.elapsed() >= stall)
    }
}

/// A probe of node `i`: a cheap command whose only use is its duration.
pub(crate) type Probe = Arc<dyn Fn(usize) + Send + Sync>;

pub(crate) struct Fanout {
    /// Per node (`None` only if a lane could not be made: the caller then runs the call).
    lanes: Vec<Option<Lane>>,
    stall: Duration,
    probe: Probe,
    threads: Vec<JoinHandle<()>>,
}

impl Fanout {
    /// Workers for every node; a node is skipped while stalled (its calls take `stall`).
    pub fn start(nodes: usize, stall: Duration, probe: Probe) -> std::io::Result<Self> {
        let mut lanes = Vec::with_capacity(nodes);
        let mut threads = Vec::with_capacity(nodes * WORKERS_PER_NODE);
        for node in 0..nodes {
            let (jobs, rx) = crossbeam_channel::bounded::<(Instant, Job)>(QUEUE_PER_NODE);
            let state = Arc::new(LaneState {
                pending: AtomicUsize::new(0),
                probing: AtomicBool::new(false),
                progress: Mutex::new((Instant::now(), Duration::ZERO)),
            });
            for w in 0..WORKERS_PER_NODE {
                let (rx, lane) = (rx.clone(), state.clone());
                threads.push(
                    std::thread::Builder::new()
                        .name(format!("redbaton-fan-{node}.{w}"))
                        .spawn(move || {
                            // Ends when the client drops the lanes. A panicking call is
                            // the caller's to see (its reply never comes); the worker
                            // goes on. A call that waited `stall` in the queue is skipped,
                            // and says nothing of how the node is doing.
                            for (queued, job) in rx {
                                if queued.elapsed() >= stall {
                                    let _ = catch_unwind(AssertUnwindSafe(|| skipping(job)));
                                } else {
                                    let started = Instant::now();
                                    let _ = catch_unwind(AssertUnwindSafe(job));
                                    *lane.progress.lock() = (Instant::now(), started.elapsed());
                                }
                                lane.pending.fetch_sub(1, Ordering::AcqRel);
                            }
                        })?,
                );
            }
            lanes.push(Some(Lane { jobs, state }));
        }
        Ok(Fanout {
            lanes,
            stall,
            probe,
            threads,
        })
    }

    /// `f(i)` for every position `i` of `nodes` (each the index of a node), in parallel,
    /// each on its node's lane; results in the order of `nodes`.
    ///
    /// # Panics
    ///
    /// When `f` panicked for some node (after every other node's call ended).
    pub fn map<T, F>(&self, nodes: &[usize], f: Arc<F>) -> Vec<T>
    where
        T: Send + 'static,
        F: Fn(usize) -> T + Send + Sync + 'static,
    {
        let n = nodes.len();
        let (tx, rx) = crossbeam_channel::bounded(n);
        let mut inline = Vec::new();
        let mut skipped = Vec::new();
        for (i, &node) in nodes.iter().enumerate() {
            let (f, tx) = (f.clone(), tx.clone());
            let job: Job = Box::new(move || {
                let _ = tx.send((i, f(i)));
            });
            let Some(lane) = self.lanes.get(node).and_then(Option::as_ref) else {
                inline.push(job);
                continue;
            };
            if lane.state.stalled(self.stall) {
                self.probe(node, lane);
                skipped.push(job);
                continue;
            }
            lane.state.pending.fetch_add(1, Ordering::AcqRel);
            if let Err(TrySendError::Full((_, job)) | TrySendError::Disconnected((_, job))) =
                lane.jobs.try_send((Instant::now(), job))
            {
                // Backlogged, or workers gone (shutting down): run it here.
                lane.state.pending.fetch_sub(1, Ordering::AcqRel);
                inline.push(job);
            }
        }
        let mut out: Vec<Option<T>> = (0..n).map(|_| None).collect();
        for job in skipped {
            skipping(job);
        }
        for job in inline {
            job();
        }
        drop(tx);
        for (i, v) in rx.iter().take(n) {
            out[i] = Some(v);
        }
        out.into_iter()
            .map(|v| v.expect("a node's call panicked"))
            .collect()
    }
}

impl Fanout {
    /// Sends one probe to a stalled node's lane (if none is on its way): when it comes
    /// back quickly, the node is no longer stalled. No caller waits for it.
    fn probe(&self, node: usize, lane: &Lane) {
        if lane.state.probing.swap(true, Ordering::AcqRel) {
            return;
        }
        let (probe, state) = (self.probe.clone(), lane.state.clone());
        let job: Job = Box::new(move || {
            probe(node);
            state.probing.store(false, Ordering::Release);
        });
        lane.state.pending.fetch_add(1, Ordering::AcqRel);
        if lane.jobs.try_send((Instant::now(), job)).is_err() {
            lane.state.pending.fetch_sub(1, Ordering::AcqRel);
            lane.state.probing.store(false, Ordering::Release);
        }
    }
}

impl Drop for Fanout {
    fn drop(&mut self) {
        self.lanes.clear();
        let me = std::thread::current().id();
        for t in self.threads.drain(..) {
            if t.thread().id() != me {
                let _ = t.join();
            }
        }
    }
}
