//! Runs one operation on every Redlock node at once, so that a round costs about the
//! slowest node's round trip, not the sum. The calling thread takes node 0 itself; a few
//! long-lived worker threads take the others (spawning threads per call would cost more
//! than a loopback round trip).

use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam_channel::Sender;

type Job = Box<dyn FnOnce() + Send>;

pub(crate) struct Fanout {
    jobs: Option<Sender<Job>>,
    threads: Vec<JoinHandle<()>>,
}

impl Fanout {
    pub fn start(workers: usize) -> std::io::Result<Self> {
        let (tx, rx) = crossbeam_channel::unbounded::<Job>();
        let mut threads = Vec::with_capacity(workers);
        for i in 0..workers {
            let rx = rx.clone();
            threads.push(
                std::thread::Builder::new()
                    .name(format!("redbaton-fanout-{i}"))
                    .spawn(move || {
                        // Ends when the client drops the sender.
                        for job in rx {
                            job();
                        }
                    })?,
            );
        }
        Ok(Fanout {
            jobs: Some(tx),
            threads,
        })
    }

    /// `f(i)` for every `i` in `0..n`, in parallel; results in index order.
    pub fn map<T, F>(&self, n: usize, f: Arc<F>) -> Vec<T>
    where
        T: Send + 'static,
        F: Fn(usize) -> T + Send + Sync + 'static,
    {
        let (tx, rx) = crossbeam_channel::bounded(n);
        let jobs = self
            .jobs
            .as_ref()
            .expect("fanout alive while its client is");
        for i in 1..n {
            let (f, tx) = (f.clone(), tx.clone());
            let job: Job = Box::new(move || {
                let _ = tx.send((i, f(i)));
            });
            if let Err(e) = jobs.send(job) {
                // Workers gone (shutting down): run it here.
                (e.into_inner())();
            }
        }
        let mut out: Vec<Option<T>> = (0..n).map(|_| None).collect();
        if n > 0 {
            out[0] = Some(f(0));
        }
        drop(tx);
        for (i, v) in rx.iter().take(n.saturating_sub(1)) {
            out[i] = Some(v);
        }
        out.into_iter()
            .map(|v| v.expect("every node answers: each call has its own timeout"))
            .collect()
    }
}

impl Drop for Fanout {
    fn drop(&mut self) {
        self.jobs.take();
        let me = std::thread::current().id();
        for t in self.threads.drain(..) {
            if t.thread().id() != me {
                let _ = t.join();
            }
        }
    }
}
