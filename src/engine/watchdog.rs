//! One watchdog thread per client: renews every held lock at about a third of its lease,
//! all due locks of a node in one round trip, and marks locks lost when a renewal proves
//! they are gone or the lease ran out before one succeeded. With renewals off it still
//! watches: the holder's lost channel fires when the lease runs out. A pass's round trips
//! run on a thread of the pass's own, so that a hung node cannot delay that signal.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use crate::clock::Stamp;

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use parking_lot::Mutex;

use crate::config::Config;
use crate::error::LostReason;
use crate::local::held::{Changed, Due, RemoteLock};
use crate::local::undo::OnUnwind;
use crate::proto::keys::keyslot;
use crate::proto::node::{Node, NodeId};
use crate::proto::protocol::RenewScript;
use crate::proto::renewal::{Batch, Change, ExtendReply};
use crate::stats::Counters;
use crate::topology::Topology;
use crate::topology::verdict::Renewal;

/// Longest sleep, so that hold caps and shutdown are noticed without a kick.
const MAX_SLEEP: Duration = Duration::from_secs(1);
/// While a pass's round trips are under way, how often the holds are looked at anyway.
const LOOK_AGAIN: Duration = Duration::from_millis(50);
/// Locks per extend call.
const BATCH: usize = 1000;

/// A lock whose renewal is under way: its lease and the renewal's change number.
type Renewing = (Arc<RemoteLock>, Duration, u64);
/// A renewal as a node's job: the lock, its lease, the change's number, and its slot.
type Job = (Arc<RemoteLock>, Duration, u64, u16);

/// The held locks, and when the thread plans to look at them next. The watchdog's times
/// are on the lease clock (see `clock`): after a suspend, the locks whose lease ran out
/// meanwhile are due at once, and reported lost.
#[derive(Default)]
struct Held {
    locks: HashMap<u64, Arc<RemoteLock>>,
    planned: Option<Stamp>,
}

pub(crate) struct Watchdog {
    held: Arc<Mutex<Held>>,
    kick: Sender<()>,
    shutdown: Arc<AtomicBool>,
    counters: Arc<Counters>,
    /// Waits that may take a grant as the lock (see [`Watchdog::expect_grant`]).
    expecting: Arc<AtomicUsize>,
    thread: crate::worker::Thread,
}

/// A wait that may take a fair queue's grant as the lock, while it lasts (see
/// [`Watchdog::expect_grant`]).
pub(crate) struct Expecting<'a>(&'a AtomicUsize);

impl Drop for Expecting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// What the thread works with: the settings, the nodes (weakly: the thread must not keep
/// the client's connections alive) and the counters.
struct Context {
    cfg: Config,
    topology: Weak<Topology>,
    counters: Arc<Counters>,
}

impl Watchdog {
    pub fn start(
        cfg: Config,
        topology: Weak<Topology>,
        counters: Arc<Counters>,
    ) -> std::io::Result<Self> {
        let held = Arc::new(Mutex::new(Held::default()));
        let (kick, kicked) = crossbeam_channel::bounded(1);
        let shutdown = Arc::new(AtomicBool::new(false));
        let expecting = Arc::new(AtomicUsize::new(0));
        let (h, s, k, e) = (
            held.clone(),
            shutdown.clone(),
            kick.clone(),
            expecting.clone(),
        );
        let cx = Context {
            cfg,
            topology,
            counters: counters.clone(),
        };
        let thread = std::thread::Builder::new()
            .name("redbaton-watchdog".to_owned())
            .spawn(move || {
                crate::supervise::supervise(
                    "watchdog",
                    || run(&cx, &h, &kicked, &s, &e),
                    |in_a_row| crashed(&cx, &h, &k, in_a_row),
                    |backoff| crate::supervise::pause(backoff, &s, &k, &kicked),
                );
            })?;
        Ok(Watchdog {
            held,
            kick,
            shutdown,
            counters,
            expecting,
            thread: crate::worker::Thread::new(thread),
        })
    }

    /// Stops the thread and waits for it until `deadline`; `false` if it is still running.
    pub fn shutdown(&self, deadline: Instant) -> bool {
        self.stop();
        self.thread.join_until(deadline)
    }

    /// Stops renewing and watching for good. The holds still watched are told at once
    /// that they are lost ([`LostReason::WatchdogFailed`]), as a hold registered later is:
    /// nothing renews them any more, and nothing would tell a holder that waits on its
    /// lost channel when the lease runs out.
    fn stop(&self) {
        // Set before the holds are taken, under the same mutex as `register` reads it:
        // a registration either sees it or is among the holds taken here.
        self.shutdown.store(true, Ordering::Relaxed);
        let _ = self.kick.try_send(());
        let orphans: Vec<Arc<RemoteLock>> =
            self.held.lock().locks.drain().map(|(_, l)| l).collect();
        for lock in orphans {
            lock.mark_lost(LostReason::WatchdogFailed, &self.counters);
        }
    }

    /// Starts watching `lock` (renewing it, or with renewals off, telling its holder when
    /// it expires); after [`Self::shutdown`], marks it lost at once. Wakes the thread only
    /// when the lock is due before the thread's next planned look: most acquisitions cost
    /// no context switch.
    pub fn register(&self, lock: Arc<RemoteLock>, due: Stamp) {
        let mut held = self.held.lock();
        if self.shutdown.load(Ordering::Relaxed) {
            drop(held);
            // A wait under way when the client was shut down, won since: nothing will
            // renew the hold or watch it, and its holder is told so at once.
            lock.mark_lost(LostReason::WatchdogFailed, &self.counters);
            return;
        }
        held.locks.insert(lock.id, lock);
        self.plan(held, due);
    }

    /// A wait that may take a fair queue's grant as the lock is about to sleep: until the
    /// returned guard is dropped, the thread looks at least every `Config::grant_tick`, so
    /// that such a lock's first renewal (due a `Config::first_renewal` later) is planned
    /// by the thread's next look and its registration needs no wake-up. The wake-up would
    /// come at the handoff, the moment that matters, and compete for a core with the
    /// thread the grant is for. The first such wait wakes the thread now, while it sleeps
    /// anyway.
    pub fn expect_grant(&self) -> Expecting<'_> {
        if self.expecting.fetch_add(1, Ordering::Relaxed) == 0 {
            let _ = self.kick.try_send(());
        }
        Expecting(&self.expecting)
    }

    /// A watched lock is due at `due` now (its lease was changed by an explicit extend).
    pub fn reschedule(&self, due: Stamp) {
        self.plan(self.held.lock(), due);
    }

    fn plan(&self, mut held: parking_lot::MutexGuard<'_, Held>, due: Stamp) {
        if held.planned.is_none_or(|p| due < p) {
            held.planned = Some(due);
            drop(held);
            let _ = self.kick.try_send(());
        }
    }

    pub fn unregister(&self, lock: &RemoteLock) {
        self.held.lock().locks.remove(&lock.id);
    }

    /// The tokens (shared holds: members) of this client's holds of the lock key `lock`:
    /// every hold is watched while held, so an operator's view can tell which are ours.
    pub fn tokens_of(&self, lock: &[u8]) -> Vec<String> {
        let held = self.held.lock();
        held.locks
            .values()
            .filter(|l| l.keys.lock() == lock)
            .map(|l| l.token.clone())
            .collect()
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.stop();
        self.thread.join_now();
    }
}

/// Panics in a row after which renewals are taken to be impossible: every watched lock's
/// holder is told ([`LostReason::WatchdogFailed`]) rather than left to find out when its
/// lease runs out.
const GIVE_UP_AFTER: u32 = 3;

/// The thread panicked (the locks it was renewing were put back by `renew_due`). Returns
/// whether to run again.
fn crashed(cx: &Context, held: &Mutex<Held>, kick: &Sender<()>, in_a_row: u32) -> bool {
    if cx.topology.strong_count() == 0 {
        return false; // the client is gone
    }
    if in_a_row >= GIVE_UP_AFTER {
        let locks: Vec<Arc<RemoteLock>> = held.lock().locks.drain().map(|(_, l)| l).collect();
        log::error!(
            "watchdog: {in_a_row} panics in a row; telling the holders of {} locks they are lost",
            locks.len()
        );
        for lock in locks {
            lock.mark_lost(LostReason::WatchdogFailed, &cx.counters);
        }
    }
    // The restarted loop must not wait for a registration before its first pass.
    let _ = kick.try_send(());
    true
}

fn run(
    cx: &Context,
    held: &Arc<Mutex<Held>>,
    kicked: &Receiver<()>,
    shutdown: &AtomicBool,
    expecting: &AtomicUsize,
) {
    // Nothing to do before the first registration.
    if kicked.recv().is_err() {
        return;
    }
    let mut refused = Refused::new();
    while !shutdown.load(Ordering::Relaxed) {
        // Hold the nodes only while working, so that dropping the client ends us.
        let next = match cx.topology.upgrade() {
            Some(topology) => renew_due(cx, &topology, held, &mut refused),
            None => return, // registrations come from a live client: it is gone now
        };
        let longest = if expecting.load(Ordering::Relaxed) > 0 {
            cx.cfg.grant_tick().min(MAX_SLEEP)
        } else {
            MAX_SLEEP
        };
        let next = next.min(Stamp::now() + longest);
        // A lock registered during the pass set `planned` (and kicked): keep the earlier.
        let next = {
            let mut h = held.lock();
            let next = h.planned.map_or(next, |p| p.min(next));
            h.planned = Some(next);
            next
        };
        let sleep = next.since(Stamp::now());
        if let Err(RecvTimeoutError::Disconnected) = kicked.recv_timeout(sleep) {
            return;
        }
    }
}

/// Per watched lock (by id), how many of its renewals in a row a node refused at `AUTH`.
type Refused = HashMap<u64, u32>;

/// When to renew again a lock of which the `n`-th renewal in a row was refused at
/// `AUTH` (n ≥ 1), sent at `now`, valid until `valid_until`: `retry` doubled for each
/// refusal after the first, since retrying cannot help until an operator puts the password
/// back, but never later than half the validity left (nor sooner than `retry`), so that a
/// password put back still saves the lock.
fn backoff(n: u32, retry: Duration, now: Stamp, valid_until: Stamp) -> Stamp {
    let doubled = retry.saturating_mul(1 << n.saturating_sub(1).min(20));
    let latest = (valid_until.since(now) / 2).max(retry);
    now + doubled.min(latest)
}

/// Renews what is due (and what would be due within a quarter interval, to batch), and
/// returns when to look again. `refused` counts the renewals refused at `AUTH` in a row.
fn renew_due(
    cx: &Context,
    topology: &Topology,
    held: &Mutex<Held>,
    refused: &mut Refused,
) -> Stamp {
    let cfg = &cx.cfg;
    let counters = &cx.counters;
    let now = Stamp::now();
    let mut next = now + MAX_SLEEP;
    let mut due: Vec<Renewing> = Vec::new();
    let mut h = held.lock();
    // The locks due within a quarter interval ride along, but only with one that is due
    // now: a look at an arbitrary moment (the thread looks at least every `MAX_SLEEP`)
    // would take the first few early and split locks taken close together into batches
    // that never meet again.
    let horizon = match h.locks.values().any(|lock| lock.next_due() <= now) {
        true => now + cfg.renew_batch(),
        false => now,
    };
    // Registrations during this pass must kick: the plan is being remade.
    h.planned = None;
    h.locks
        .retain(|_, lock| match lock.due(now, horizon, counters) {
            Due::Forget => false,
            Due::At(t) => {
                next = next.min(t);
                true
            }
            Due::Renew { lease, seq } => {
                due.push((lock.clone(), lease, seq));
                true
            }
        });
    if !refused.is_empty() {
        refused.retain(|id, _| h.locks.contains_key(id));
    }
    drop(h);
    if due.is_empty() {
        return next;
    }
    let retry = cfg.renew_retry();
    // Each renewal's outcome when there is no telling: it may have been applied (see
    // `renewal::EXTEND`).
    let unknown = |lease: Duration| Changed::Unknown {
        cap: now + lease - cfg.drift(lease),
        retry_at: now + retry,
    };
    // A panic below must not leave these locks `renewing`: an unlock would wait for ever.
    let undo = OnUnwind::new(|| {
        for (lock, lease, _) in &due {
            lock.end_renew(unknown(*lease), counters);
        }
    });
    crate::fault::hit(&cfg.key_prefix, crate::fault::Point::Watchdog);
    let plan = Plan::of(topology, &due);
    // Per lock: (extended, gone, other owner) node counts, and the nodes yet to answer.
    let mut tallies = vec![(0, 0, 0); due.len()];
    let mut waiting = plan.nodes_per_lock();
    // Per lock: whether a node refused its renewal at `AUTH` in this pass.
    let mut turned_away = vec![false; due.len()];
    // A lock's outcome, applied as soon as its nodes have answered: a node that hangs
    // holds up its own locks only (see `telling_meanwhile`).
    let mut settle = |i: usize, (ok, gone, other): (usize, usize, usize), turned_away: bool| {
        let (lock, lease, _) = &due[i];
        let route = topology.route(&lock.keys);
        let outcome = match route.renewal((ok, gone, other), lock.nodes.len()) {
            Renewal::Renewed => Changed::Applied {
                valid_until: now + *lease - cfg.drift(*lease),
                next_renew: now + cfg.renew_every(*lease),
            },
            Renewal::Lost(reason) => Changed::Lost(reason),
            Renewal::Unknown => {
                Counters::inc(&counters.renewals_failed);
                unknown(*lease)
            }
        };
        let outcome = match (outcome, turned_away) {
            (Changed::Unknown { cap, .. }, true) => {
                let n = refused.entry(lock.id).or_default();
                *n += 1;
                let retry_at = backoff(*n, retry, now, lock.validity().min(cap));
                Changed::Unknown { cap, retry_at }
            }
            (outcome, _) => {
                refused.remove(&lock.id);
                outcome
            }
        };
        lock.end_renew(outcome, counters);
        // Its cap may come before the retry.
        next = next.min(now + retry).min(lock.next_due());
    };
    let mut heard = |(replies, refused): Replies| {
        for (i, reply) in replies {
            turned_away[i] |= refused;
            match reply {
                Some(ExtendReply::Extended) => tallies[i].0 += 1,
                Some(ExtendReply::Gone) => tallies[i].1 += 1,
                Some(ExtendReply::Other) => tallies[i].2 += 1,
                // Refused as stale: a newer change's own reply says how it went.
                Some(ExtendReply::Stale) | None => {}
            }
            waiting[i] = waiting[i].saturating_sub(1);
            if waiting[i] == 0 {
                settle(i, tallies[i], turned_away[i]);
            }
        }
    };
    telling_meanwhile(held, counters, &mut heard, |report| {
        extend_on_nodes(cx, topology, &due, &plan, report)
    });
    undo.disarm();
    // A node whose call never ran (a Redlock node skipped as stalled) said nothing.
    for i in 0..due.len() {
        if waiting[i] > 0 {
            settle(i, tallies[i], turned_away[i]);
        }
    }
    next
}

/// What one node said of the locks it was asked to renew: their indexes in the pass, each
/// with its reply (`None`: no reply), and whether the node refused the call at `AUTH`.
type Replies = (Vec<(usize, Option<ExtendReply>)>, bool);

/// Runs `renew` (a pass's round trips, which a hung node stretches to the read timeout) on
/// a thread of its own; each node's replies, sent on the channel it is given, are `heard`
/// here as they come (its locks' outcomes applied at once), while this thread tells the
/// holders whose validity or cap ends meanwhile that their hold is lost, by the local
/// clock: a holder waiting on its lost channel must not learn it a read timeout late, and
/// the locks of the nodes that answered are renewed by then. A panic in `renew` is raised
/// here.
fn telling_meanwhile(
    held: &Mutex<Held>,
    counters: &Counters,
    heard: &mut dyn FnMut(Replies),
    renew: impl Fn(Sender<Replies>) + Sync,
) {
    let (report, reports) = crossbeam_channel::unbounded::<Replies>();
    std::thread::scope(|s| {
        let renew = &renew;
        let sender = report.clone();
        let worker = std::thread::Builder::new()
            .name("redbaton-renewal".to_owned())
            .spawn_scoped(s, move || renew(sender));
        let Ok(worker) = worker else {
            // No thread to be had: the holders are told when the pass is over.
            renew(report);
            reports.try_iter().for_each(&mut *heard);
            return;
        };
        // The worker's sender alone is left: its end ends the wait below.
        drop(report);
        // Also looked at every `LOOK_AGAIN`: an extend may have shortened another lease.
        loop {
            let again = Instant::now() + LOOK_AGAIN;
            let next = tell_lost(held, counters).map_or(again, |end| end.min(again));
            match reports.recv_deadline(next) {
                Ok(replies) => heard(replies),
                Err(RecvTimeoutError::Timeout) => {}
                // Every sender gone: the pass is over (or its thread panicked).
                Err(RecvTimeoutError::Disconnected) => break,
            }
        }
        worker
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    })
}

/// Marks lost every watched hold whose validity or cap has ended (its holder is told), and
/// returns when the next of the others ends, if any does.
fn tell_lost(held: &Mutex<Held>, counters: &Counters) -> Option<Instant> {
    let now = Instant::now();
    let held = held.lock();
    held.locks
        .values()
        .filter(|lock| lock.lost(counters).is_none())
        .map(|lock| lock.valid_until())
        // Past its end and not lost: released meanwhile, nothing to tell.
        .filter(|end| *end > now)
        .min()
}

/// Which nodes hold the due locks (Redis Cluster: the master serving each lock's slot
/// now), and per node the indexes of its locks; whether calls go one slot at a time.
struct Plan {
    nodes: Vec<Arc<Node>>,
    held_by: Vec<Vec<usize>>,
    by_slot: bool,
    locks: usize,
}

impl Plan {
    fn of(topology: &Topology, due: &[Renewing]) -> Plan {
        let mut nodes: Vec<Arc<Node>> = Vec::new();
        let mut held_by: Vec<Vec<usize>> = Vec::new();
        for (i, (lock, ..)) in due.iter().enumerate() {
            for node in topology.route(&lock.keys).holders(&lock.nodes) {
                match nodes.iter().position(|n| n.id == node.id) {
                    Some(k) => held_by[k].push(i),
                    None => {
                        nodes.push(node);
                        held_by.push(vec![i]);
                    }
                }
            }
        }
        Plan {
            nodes,
            held_by,
            // Redis Cluster refuses one script call over keys of several slots.
            by_slot: topology.batches_by_slot(),
            locks: due.len(),
        }
    }

    /// Per lock, how many nodes are asked to renew it.
    fn nodes_per_lock(&self) -> Vec<usize> {
        let mut count = vec![0; self.locks];
        for i in self.held_by.iter().flatten() {
            count[*i] += 1;
        }
        count
    }
}

/// Sends the extends: one round trip per node (its batches pipelined: Redis Cluster wants
/// one script call per slot), every node in parallel, each node's replies sent on `report`
/// as soon as it answered.
fn extend_on_nodes(
    cx: &Context,
    topology: &Topology,
    due: &[Renewing],
    plan: &Plan,
    report: Sender<Replies>,
) {
    let counters = cx.counters.clone();
    let by_slot = plan.by_slot;
    let jobs: Arc<Vec<Job>> = Arc::new(
        due.iter()
            .map(|(lock, lease, seq)| {
                let slot = if by_slot {
                    keyslot(lock.keys.lock())
                } else {
                    0
                };
                (lock.clone(), *lease, *seq, slot)
            })
            .collect(),
    );
    let held_by: Arc<HashMap<NodeId, Vec<usize>>> = Arc::new(
        (plan.nodes.iter().map(|n| n.id.clone()))
            .zip(plan.held_by.iter().cloned())
            .collect(),
    );
    topology.fan_out(&plan.nodes, move |node| {
        // Group this node's locks by lease, slot and kind: one script call per group and
        // batch, the script chosen by how the locks are held.
        let mut by_lease: HashMap<(Duration, u16, bool), Vec<usize>> = HashMap::new();
        for &i in held_by.get(&node.id).map(Vec::as_slice).unwrap_or_default() {
            let (lock, lease, _, slot) = &jobs[i];
            by_lease
                .entry((*lease, *slot, lock.protocol.renewal().ordered))
                .or_default()
                .push(i);
        }
        // Every group's batches go in one round trip to the node.
        let mut batches: Vec<Batch<'_>> = Vec::new();
        let mut chunks: Vec<&[usize]> = Vec::new();
        for ((lease, _, _), idxs) in &by_lease {
            let RenewScript { script, ordered } = jobs[idxs[0]].0.protocol.renewal();
            for chunk in idxs.chunks(BATCH) {
                batches.push(Batch {
                    script,
                    locks: chunk
                        .iter()
                        .map(|&i| Change {
                            key: jobs[i].0.keys.lock(),
                            record: jobs[i].0.keys.lease(),
                            token: jobs[i].0.token.as_str(),
                            seq: jobs[i].2,
                        })
                        .collect(),
                    lease: *lease,
                    ordered,
                });
                chunks.push(chunk);
            }
        }
        // A node skipped as stalled (Redlock) is sent nothing: not counted.
        if !crate::proto::skip::is_skipping() {
            let sent = chunks.iter().map(|c| c.len() as u64).sum();
            Counters::add(&counters.renewals_sent, sent);
        }
        let mut replies = Vec::new();
        let mut refused = false;
        match node.extend_batches(&batches) {
            Ok(lists) => {
                for (chunk, list) in chunks.iter().zip(lists) {
                    replies.extend(chunk.iter().copied().zip(list.into_iter().map(Some)));
                }
            }
            Err(e) => {
                log::debug!("node {}: renewal failed: {e}", node.id);
                refused = e.is_auth();
                replies.extend(chunks.iter().flat_map(|c| c.iter()).map(|&i| (i, None)));
            }
        }
        // The pass's thread is gone only after a panic: nobody to tell.
        let _ = report.send((replies, refused));
    });
}
