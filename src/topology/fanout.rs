//! Runs one operation on every Redlock node at once, so that a round costs about the
//! slowest node's round trip, not the sum. Every node has long-lived worker threads of its
//! own (spawning threads per call would cost more than a loopback round trip), the first
//! one included: a caller that made one node's call itself would wait out that node's
//! timeout whenever it hangs.
//!
//! One bounded queue per node: a hung node's calls (each waits out its timeout) occupy
//! only that node's workers, never the workers of the healthy nodes. And no round waits
//! for a hung node either: once a node's last call took half a read timeout or more (or
//! every worker is in a call that began that long ago), the node is
//! *stalled*, and calls to it are made on the caller's thread in skipping mode (they fail
//! at once, as a timeout would; see `proto::skip`), so the healthy majority decides every
//! round at once. Meanwhile one probe at a time (a `PING`) goes to the node on its own
//! workers, which no caller waits for: once the node answers quickly again, it is used
//! again. A call that waited in a node's queue for `stall` or more before a worker took
//! it (queued behind calls to a node that has just hung, before any of them ended) is
//! skipped too: a round waits for a hung node about one of its timeouts at most. When a
//! node's queue is full, the caller makes that node's call itself (backpressure). A caller
//! whose replies so far decide its outcome (a lease change a majority applied) may return
//! without waiting for the rest, whose calls go on on their lanes.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
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
    /// A probe of a stalled node is queued or running.
    probing: AtomicBool,
    /// How the node's calls are going.
    progress: Mutex<Progress>,
}

/// How a node's calls are going, as its workers see them.
struct Progress {
    /// How long the last call (or probe) that ended took.
    took: Duration,
    /// When each worker's call in progress began; `None`: the worker waits for a call.
    busy: [Option<Instant>; WORKERS_PER_NODE],
}

impl LaneState {
    /// The node is not keeping up: its last call (or probe) took `stall` or more, or every
    /// worker is in a call that began `stall` ago or more. Counted from when each call
    /// began, not from when a call last ended: after an idle spell (no call, so none
    /// ended) a burst of calls that keeps every worker busy for a moment is no stall.
    fn stalled(&self, stall: Duration) -> bool {
        let progress = self.progress.lock();
        progress.took >= stall
            || progress
                .busy
                .iter()
                .all(|began| began.is_some_and(|b| b.elapsed() >= stall))
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
                probing: AtomicBool::new(false),
                progress: Mutex::new(Progress {
                    took: Duration::ZERO,
                    busy: [None; WORKERS_PER_NODE],
                }),
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
                                    lane.progress.lock().busy[w] = Some(started);
                                    let _ = catch_unwind(AssertUnwindSafe(job));
                                    let mut progress = lane.progress.lock();
                                    progress.busy[w] = None;
                                    progress.took = started.elapsed();
                                }
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
    /// each on its node's lane; results in the order of `nodes`. Returns as soon as `done`
    /// says the results so far decide the outcome (a majority answered alike): the calls
    /// still under way go on on their lanes, and their results (`None` here) are dropped.
    /// A call that panicked is `None`.
    pub fn map_until<T, F>(
        &self,
        nodes: &[usize],
        f: Arc<F>,
        done: impl Fn(&[Option<T>]) -> bool,
    ) -> Vec<Option<T>>
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
            if let Err(TrySendError::Full((_, job)) | TrySendError::Disconnected((_, job))) =
                lane.jobs.try_send((Instant::now(), job))
            {
                // Backlogged, or workers gone (shutting down): run it here.
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
            if done(&out) {
                break;
            }
        }
        out
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
        if lane.jobs.try_send((Instant::now(), job)).is_err() {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn lane(took: Duration, busy: [Option<Instant>; WORKERS_PER_NODE]) -> LaneState {
        LaneState {
            probing: AtomicBool::new(false),
            progress: Mutex::new(Progress { took, busy }),
        }
    }

    #[test]
    fn a_node_stalls_by_its_slow_calls_not_by_an_idle_spell() {
        let stall = Duration::from_secs(1);
        let now = Instant::now();
        let long_ago = now.checked_sub(Duration::from_secs(5)).unwrap_or(now);
        // Idle, or every worker in a call that has just begun (after an idle spell too).
        assert!(!lane(Duration::ZERO, [None; WORKERS_PER_NODE]).stalled(stall));
        assert!(!lane(Duration::ZERO, [Some(now); WORKERS_PER_NODE]).stalled(stall));
        // One worker free.
        let mut one_free = [Some(long_ago); WORKERS_PER_NODE];
        one_free[0] = None;
        assert!(!lane(Duration::ZERO, one_free).stalled(stall));
        if long_ago < now {
            // Every worker in a call that began a stall ago or more: hung.
            assert!(lane(Duration::ZERO, [Some(long_ago); WORKERS_PER_NODE]).stalled(stall));
        }
        // The last call took a stall or more.
        assert!(lane(stall, [None; WORKERS_PER_NODE]).stalled(stall));
    }
}
