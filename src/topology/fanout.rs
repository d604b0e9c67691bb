//! Runs one operation on every Redlock node at once, so that a round costs about the
//! slowest node's round trip, not the sum. The calling thread takes node 0 itself; every
//! other node has long-lived worker threads of its own (spawning threads per call would
//! cost more than a loopback round trip).
//!
//! One bounded queue per node: a hung node's calls (each waits out its timeout) occupy
//! only that node's workers, never the workers of the healthy nodes, so a round decided
//! by the healthy majority is not queued behind the hung node's backlog. When a node's
//! queue is full, the caller runs that node's call itself (backpressure: memory stays
//! bounded, and no call is lost).

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam_channel::{Sender, TrySendError};

type Job = Box<dyn FnOnce() + Send>;

/// Worker threads per node (calls to one node in flight at once from this client).
const WORKERS_PER_NODE: usize = 2;
/// Calls waiting for a node's workers, at most.
const QUEUE_PER_NODE: usize = 64;

pub(crate) struct Fanout {
    /// Per node; node 0's is `None`: the caller runs it.
    queues: Vec<Option<Sender<Job>>>,
    threads: Vec<JoinHandle<()>>,
}

impl Fanout {
    /// Workers for nodes `1..nodes`.
    pub fn start(nodes: usize) -> std::io::Result<Self> {
        let mut queues = Vec::with_capacity(nodes);
        let mut threads = Vec::with_capacity(nodes.saturating_sub(1) * WORKERS_PER_NODE);
        queues.push(None);
        for node in 1..nodes {
            let (tx, rx) = crossbeam_channel::bounded::<Job>(QUEUE_PER_NODE);
            for w in 0..WORKERS_PER_NODE {
                let rx = rx.clone();
                threads.push(
                    std::thread::Builder::new()
                        .name(format!("redbaton-fan-{node}.{w}"))
                        .spawn(move || {
                            // Ends when the client drops the sender. A panicking call is
                            // the caller's to see (its reply never comes); the worker
                            // goes on.
                            for job in rx {
                                let _ = catch_unwind(AssertUnwindSafe(job));
                            }
                        })?,
                );
            }
            queues.push(Some(tx));
        }
        Ok(Fanout { queues, threads })
    }

    /// `f(i)` for every `i` in `0..n`, in parallel; results in index order.
    ///
    /// # Panics
    ///
    /// When `f` panicked for some node (after every other node's call ended).
    pub fn map<T, F>(&self, n: usize, f: Arc<F>) -> Vec<T>
    where
        T: Send + 'static,
        F: Fn(usize) -> T + Send + Sync + 'static,
    {
        let (tx, rx) = crossbeam_channel::bounded(n);
        let mut inline = Vec::new();
        for i in 1..n {
            let (f, tx) = (f.clone(), tx.clone());
            let job: Job = Box::new(move || {
                let _ = tx.send((i, f(i)));
            });
            match self.queues.get(i).and_then(Option::as_ref) {
                Some(queue) => match queue.try_send(job) {
                    Ok(()) => {}
                    // Backlogged, or workers gone (shutting down): run it here.
                    Err(TrySendError::Full(job) | TrySendError::Disconnected(job)) => {
                        inline.push(job)
                    }
                },
                None => inline.push(job),
            }
        }
        let mut out: Vec<Option<T>> = (0..n).map(|_| None).collect();
        if n > 0 {
            out[0] = Some(f(0));
        }
        for job in inline {
            job();
        }
        drop(tx);
        for (i, v) in rx.iter().take(n.saturating_sub(1)) {
            out[i] = Some(v);
        }
        out.into_iter()
            .map(|v| v.expect("a node's call panicked"))
            .collect()
    }
}

impl Drop for Fanout {
    fn drop(&mut self) {
        self.queues.clear();
        let me = std::thread::current().id();
        for t in self.threads.drain(..) {
            if t.thread().id() != me {
                let _ = t.join();
            }
        }
    }
}
