//! One watchdog thread per client: renews every held lock at about a third of its lease,
//! all due locks of a node in one round trip, and marks locks lost when a renewal proves
//! they are gone or the lease ran out before one succeeded. With renewals off it still
//! watches: the holder's lost channel fires when the lease runs out.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use parking_lot::Mutex;

use crate::api::client::Inner;
use crate::error::LostReason;
use crate::local::held::{Due, RemoteLock};
use crate::local::undo::OnUnwind;
use crate::proto::node::{ExtendReply, Renewal};
use crate::stats::Counters;

/// Longest sleep, so that hold caps and shutdown are noticed without a kick.
const MAX_SLEEP: Duration = Duration::from_secs(1);
/// Keys per extend call.
const BATCH: usize = 1000;

/// The held locks, and when the thread plans to look at them next.
#[derive(Default)]
struct Held {
    locks: HashMap<u64, Arc<RemoteLock>>,
    planned: Option<Instant>,
}

pub(crate) struct Watchdog {
    held: Arc<Mutex<Held>>,
    kick: Sender<()>,
    shutdown: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Watchdog {
    pub fn start(client: Weak<Inner>) -> std::io::Result<Self> {
        let held = Arc::new(Mutex::new(Held::default()));
        let (kick, kicked) = crossbeam_channel::bounded(1);
        let shutdown = Arc::new(AtomicBool::new(false));
        let (h, s, k) = (held.clone(), shutdown.clone(), kick.clone());
        let thread = std::thread::Builder::new()
            .name("redbaton-watchdog".to_owned())
            .spawn(move || {
                crate::supervise::supervise(
                    "watchdog",
                    || run(client.clone(), h.clone(), kicked.clone(), s.clone()),
                    |in_a_row| crashed(&client, &h, &k, in_a_row),
                );
            })?;
        Ok(Watchdog {
            held,
            kick,
            shutdown,
            thread: Some(thread),
        })
    }

    /// Starts watching `lock` (renewing it, or with renewals off, telling its holder when
    /// it expires). Wakes the thread only when the lock is due before the thread's next
    /// planned look: most acquisitions cost no context switch.
    pub fn register(&self, lock: Arc<RemoteLock>, due: Instant) {
        let mut held = self.held.lock();
        held.locks.insert(lock.id, lock);
        self.plan(held, due);
    }

    /// A watched lock is due at `due` now (its lease was changed by an explicit extend).
    pub fn reschedule(&self, due: Instant) {
        self.plan(self.held.lock(), due);
    }

    fn plan(&self, mut held: parking_lot::MutexGuard<'_, Held>, due: Instant) {
        if held.planned.is_none_or(|p| due < p) {
            held.planned = Some(due);
            drop(held);
            let _ = self.kick.try_send(());
        }
    }

    pub fn unregister(&self, lock: &RemoteLock) {
        self.held.lock().locks.remove(&lock.id);
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.shutdown.store(true, Ordering::Relaxed);
        let _ = self.kick.try_send(());
        if let Some(t) = self.thread.take()
            && t.thread().id() != std::thread::current().id()
        {
            let _ = t.join();
        }
    }
}

/// Panics in a row after which renewals are taken to be impossible: every watched lock's
/// holder is told ([`LostReason::WatchdogFailed`]) rather than left to find out when its
/// lease runs out.
const GIVE_UP_AFTER: u32 = 3;

/// The thread panicked (the locks it was renewing were put back by `renew_due`). Returns
/// whether to run again.
fn crashed(client: &Weak<Inner>, held: &Mutex<Held>, kick: &Sender<()>, in_a_row: u32) -> bool {
    let Some(inner) = client.upgrade() else {
        return false;
    };
    if in_a_row >= GIVE_UP_AFTER {
        let locks: Vec<Arc<RemoteLock>> = held.lock().locks.drain().map(|(_, l)| l).collect();
        log::error!(
            "watchdog: {in_a_row} panics in a row; telling the holders of {} locks they are lost",
            locks.len()
        );
        for lock in locks {
            lock.mark_lost(LostReason::WatchdogFailed, &inner.counters);
        }
    }
    // The restarted loop must not wait for a registration before its first pass.
    let _ = kick.try_send(());
    true
}

fn run(
    client: Weak<Inner>,
    held: Arc<Mutex<Held>>,
    kicked: Receiver<()>,
    shutdown: Arc<AtomicBool>,
) {
    // Nothing to do before the first registration; and the client may still be under
    // construction (spawned inside `Arc::new_cyclic`, where `upgrade` fails until it is done).
    if kicked.recv().is_err() {
        return;
    }
    while !shutdown.load(Ordering::Relaxed) {
        // Hold the client only while working, so that dropping the last handle ends us.
        let next = match client.upgrade() {
            Some(inner) => renew_due(&inner, &held),
            None => return, // registrations come from a live client: it is gone now
        };
        let next = next.min(Instant::now() + MAX_SLEEP);
        // A lock registered during the pass set `planned` (and kicked): keep the earlier.
        let next = {
            let mut h = held.lock();
            let next = h.planned.map_or(next, |p| p.min(next));
            h.planned = Some(next);
            next
        };
        let sleep = next.saturating_duration_since(Instant::now());
        if let Err(RecvTimeoutError::Disconnected) = kicked.recv_timeout(sleep) {
            return;
        }
    }
}

/// Renews what is due (and what would be due within a quarter interval, to batch), and
/// returns when to look again.
fn renew_due(inner: &Arc<Inner>, held: &Mutex<Held>) -> Instant {
    let cfg = &inner.cfg;
    let counters = &inner.counters;
    let now = Instant::now();
    let horizon = now + cfg.renew_interval / 4;
    let mut next = now + MAX_SLEEP;
    let mut due: Vec<(Arc<RemoteLock>, Duration)> = Vec::new();
    let mut h = held.lock();
    // Registrations during this pass must kick: the plan is being remade.
    h.planned = None;
    h.locks.retain(
        |_, lock| match lock.due(now, horizon, cfg.max_hold, counters) {
            Due::Forget => false,
            Due::At(t) => {
                next = next.min(t);
                true
            }
            Due::Renew(lease) => {
                due.push((lock.clone(), lease));
                true
            }
        },
    );
    drop(h);
    if due.is_empty() {
        return next;
    }
    let retry = (cfg.renew_interval / 4).min(Duration::from_millis(200));
    // A panic below must not leave these locks `renewing`: an unlock would wait for ever.
    let undo = OnUnwind::new(|| {
        for (lock, _) in &due {
            lock.end_renew(Err(None), now + retry, counters);
        }
    });
    crate::fault::hit(&cfg.key_prefix, crate::fault::Point::Watchdog);
    // Per lock: (extended, gone, other owner) node counts.
    let tallies = extend_on_nodes(inner, &due);
    let quorum = inner.quorum();
    for ((lock, lease), (ok, gone, other)) in due.iter().zip(tallies) {
        let redlock = inner.nodes.len() > 1;
        let outcome = match Renewal::judge((ok, gone, other), lock.nodes.len(), quorum, redlock) {
            Renewal::Renewed => {
                let renew_every = inner.renew_every(*lease);
                Ok((now + *lease - cfg.drift(*lease), now + renew_every))
            }
            Renewal::Lost(reason) => Err(Some(reason)),
            Renewal::Unknown => {
                Counters::inc(&counters.renewals_failed);
                Err(None)
            }
        };
        lock.end_renew(outcome, now + retry, counters);
        next = next.min(now + retry);
    }
    undo.disarm();
    next
}

/// Sends the extends, one call per node and batch, every node in parallel.
fn extend_on_nodes(
    inner: &Arc<Inner>,
    due: &[(Arc<RemoteLock>, Duration)],
) -> Vec<(usize, usize, usize)> {
    let jobs: Arc<Vec<(Arc<RemoteLock>, Duration)>> = Arc::new(due.to_vec());
    let client = inner.clone();
    let per_node = inner.map_nodes(move |n| {
        let node = &client.nodes[n];
        // Group this node's locks by lease: one script call per (lease, batch).
        let mut by_lease: HashMap<Duration, Vec<usize>> = HashMap::new();
        for (i, (lock, lease)) in jobs.iter().enumerate() {
            if lock.nodes.contains(&n) {
                by_lease.entry(*lease).or_default().push(i);
            }
        }
        let mut replies: Vec<(usize, Option<ExtendReply>)> = Vec::new();
        for (lease, idxs) in by_lease {
            for chunk in idxs.chunks(BATCH) {
                let batch: Vec<(&[u8], &str)> = chunk
                    .iter()
                    .map(|&i| (jobs[i].0.keys.lock(), jobs[i].0.token.as_str()))
                    .collect();
                Counters::add(&client.counters.renewals_sent, batch.len() as u64);
                match node.extend(&batch, lease) {
                    Ok(r) => replies.extend(chunk.iter().copied().zip(r.into_iter().map(Some))),
                    Err(e) => {
                        log::debug!("node {n}: renewal failed: {e}");
                        replies.extend(chunk.iter().map(|&i| (i, None)));
                    }
                }
            }
        }
        replies
    });
    let mut tallies = vec![(0, 0, 0); due.len()];
    for (i, reply) in per_node.into_iter().flatten() {
        match reply {
            Some(ExtendReply::Extended) => tallies[i].0 += 1,
            Some(ExtendReply::Gone) => tallies[i].1 += 1,
            Some(ExtendReply::Other) => tallies[i].2 += 1,
            None => {}
        }
    }
    tallies
}
