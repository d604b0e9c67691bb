//! One watchdog thread per client: renews every held lock at about a third of its lease,
//! all due locks of a node in one round trip, and marks locks lost when a renewal proves
//! they are gone or the lease ran out before one succeeded. With renewals off it still
//! watches: the holder's lost channel fires when the lease runs out.
//!
//! A pass's round trips run on a thread of the pass's own, and the watchdog thread does
//! not wait for them. Why: a pass that waited for its slowest node (a hung node: up to the
//! read timeout) would hold up the next renewal of the holds on every other node, and the
//! first renewal of a hold taken meanwhile (a grant taken as the lock is sure for a second
//! only), and a holder that did nothing wrong would be told that its lock was lost.
//!
//! So each node's replies are applied as that node answers, from its own call: a lock is
//! settled as soon as its own nodes' answers decide it (all of them; on Redlock, a majority
//! that renewed it, or too many that say it is gone). A node whose call is still under way
//! is *busy*: later passes leave it out, and a lock that its free nodes alone cannot renew
//! (its one node is busy; on Redlock, too few free nodes for a majority) is held back until
//! the node answers, which wakes the thread. Meanwhile the thread looks at the holds on
//! their own schedule, and tells a holder whose validity ends while its renewal waits that
//! the lock is lost, by the local clock. Threads stay bounded: a pass takes only free
//! nodes, so at most one pass per node is under way (a hung node makes no thread per pass),
//! and the thread joins them when it ends.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
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
use crate::topology::verdict::Renewal;
use crate::topology::{Route, Topology};

/// Longest sleep, so that hold caps and shutdown are noticed without a kick.
const MAX_SLEEP: Duration = Duration::from_secs(1);
/// Locks per extend call.
const BATCH: usize = 1000;

/// A lock whose renewal is under way: its lease and the renewal's change number.
type Renewing = (Arc<RemoteLock>, Duration, u64);

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

/// What the thread and its passes work with: the settings, the nodes (weakly: the thread
/// must not keep the client's connections alive), the counters, and what the passes under
/// way share with it.
struct Context {
    cfg: Config,
    topology: Weak<Topology>,
    counters: Arc<Counters>,
    /// The nodes a pass's call is under way on, each with whether a lock was held back for
    /// it (the pass then wakes the thread as soon as the node has answered).
    busy: Mutex<HashMap<NodeId, bool>>,
    /// The locks (by id) whose renewal a pass has sent and not yet settled.
    flying: Mutex<HashSet<u64>>,
    /// Per watched lock, its renewals refused at `AUTH` in a row.
    refused: Mutex<Refused>,
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
        let cx = Arc::new(Context {
            cfg,
            topology,
            counters: counters.clone(),
            busy: Mutex::new(HashMap::new()),
            flying: Mutex::new(HashSet::new()),
            refused: Mutex::new(Refused::new()),
        });
        let thread = std::thread::Builder::new()
            .name("redbaton-watchdog".to_owned())
            .spawn(move || {
                let mut passes = Vec::new();
                crate::supervise::supervise(
                    "watchdog",
                    || run(&cx, &h, &k, &kicked, &s, &e, &mut passes),
                    |in_a_row| crashed(&cx, &h, &k, in_a_row),
                    |backoff| crate::supervise::pause(backoff, &s, &k, &kicked),
                );
                // The passes still under way end with their calls (a read timeout at most).
                passes.into_iter().for_each(crate::worker::join);
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
            // The logger and the metrics recorder that count the loss are the user's
            // code: a panic there (which the panic hook reports) must not keep the other
            // holders from being told, nor come out of a drop.
            let tell = || lock.mark_lost(LostReason::WatchdogFailed, &self.counters);
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(tell));
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

    fn plan(&self, held: parking_lot::MutexGuard<'_, Held>, due: Stamp) {
        plan_look(held, &self.kick, due);
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

/// The thread panicked (the locks it was renewing were put back by `renew_due`, or by
/// the pass whose panic it raised). Returns whether to run again.
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
    cx: &Arc<Context>,
    held: &Arc<Mutex<Held>>,
    kick: &Sender<()>,
    kicked: &Receiver<()>,
    shutdown: &AtomicBool,
    expecting: &AtomicUsize,
    passes: &mut Vec<JoinHandle<()>>,
) {
    // Nothing to do before the first registration.
    if kicked.recv().is_err() {
        return;
    }
    while !shutdown.load(Ordering::Relaxed) {
        // Hold the nodes only while working, so that dropping the client ends us.
        let next = match cx.topology.upgrade() {
            Some(topology) => renew_due(cx, &topology, held, kick, passes),
            None => return, // registrations come from a live client: it is gone now
        };
        let longest = if expecting.load(Ordering::Relaxed) > 0 {
            cx.cfg.grant_tick().min(MAX_SLEEP)
        } else {
            MAX_SLEEP
        };
        let next = next.min(Stamp::now() + longest);
        // A lock registered, or settled by a pass, meanwhile set `planned` (and kicked):
        // keep the earlier.
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

/// When `lock`'s hold ends (its validity or its cap), on the lease clock: when the thread
/// must look at a lock it cannot renew now, to tell its holder.
fn end_of(lock: &RemoteLock) -> Stamp {
    Stamp::now() + lock.valid_until().saturating_duration_since(Instant::now())
}

/// Joins the passes that have ended; a pass's panic is raised here (its locks were put
/// back, and its nodes freed, by the pass itself).
fn reap(passes: &mut Vec<JoinHandle<()>>) {
    let mut i = 0;
    while i < passes.len() {
        if passes[i].is_finished() {
            if let Err(panic) = passes.swap_remove(i).join() {
                std::panic::resume_unwind(panic);
            }
        } else {
            i += 1;
        }
    }
}

/// Sends the renewals that are due (and those due within a quarter interval, to batch) as
/// a pass on a thread of its own, and returns when to look again. A lock whose nodes have
/// a call of an earlier pass under way is held back until they answer.
fn renew_due(
    cx: &Arc<Context>,
    topology: &Arc<Topology>,
    held: &Arc<Mutex<Held>>,
    kick: &Sender<()>,
    passes: &mut Vec<JoinHandle<()>>,
) -> Stamp {
    reap(passes);
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
    {
        let flying = cx.flying.lock();
        h.locks
            .retain(|_, lock| match lock.due(now, horizon, counters) {
                Due::Forget => false,
                // Its renewal is under way: the pass wakes the thread when it settles it;
                // meanwhile only the end of its hold matters (its holder is told then).
                Due::At(_) if flying.contains(&lock.id) => {
                    next = next.min(end_of(lock));
                    true
                }
                Due::At(t) => {
                    next = next.min(t);
                    true
                }
                Due::Renew { lease, seq } => {
                    due.push((lock.clone(), lease, seq));
                    true
                }
            });
    }
    {
        let mut refused = cx.refused.lock();
        if !refused.is_empty() {
            refused.retain(|id, _| h.locks.contains_key(id));
        }
    }
    drop(h);
    if due.is_empty() {
        return next;
    }
    // A panic below must not leave these locks `renewing`: an unlock would wait for ever.
    let undo = OnUnwind::new(|| {
        for (lock, lease, _) in &due {
            lock.end_renew(unknown(cfg, now, *lease), counters);
        }
    });
    crate::fault::hit(&cfg.key_prefix, crate::fault::Point::Watchdog);
    let plan = Plan::of(topology, &due, &cx.busy);
    undo.disarm();
    // Held back: nothing was sent, the lock is as it was and still due. The pass that
    // holds its nodes wakes the thread when they answer; its hold's end is looked at anyway.
    for &i in &plan.held_back {
        let lock = &due[i].0;
        let unchanged = Changed::Unknown {
            cap: lock.validity(),
            retry_at: lock.next_due(),
        };
        lock.end_renew(unchanged, counters);
        next = next.min(end_of(lock));
    }
    if plan.held_back.len() == due.len() {
        return next;
    }
    let pass = Arc::new(Pass::new(cx, held, kick, now, due, plan));
    if pass.plan.nodes.is_empty() {
        // No node to ask (nobody serves the slot now): settled at once, no thread needed.
        pass.run(topology);
        return next;
    }
    let (p, t) = (pass.clone(), topology.clone());
    let spawned = std::thread::Builder::new()
        .name("redbaton-renewal".to_owned())
        .spawn(move || p.run(&t));
    match spawned {
        Ok(thread) => passes.push(thread),
        // No thread to be had: the pass runs here, and its slowest node holds up the thread.
        Err(_) => pass.run(topology),
    }
    next
}

/// A renewal's outcome when there is no telling: it may have been applied (see
/// `renewal::EXTEND`).
fn unknown(cfg: &Config, sent: Stamp, lease: Duration) -> Changed {
    Changed::Unknown {
        cap: sent + lease - cfg.drift(lease),
        retry_at: sent + cfg.renew_retry(),
    }
}

/// Looks at the locks again at `due` if the thread planned to look later.
fn plan_look(mut held: parking_lot::MutexGuard<'_, Held>, kick: &Sender<()>, due: Stamp) {
    if held.planned.is_none_or(|p| due < p) {
        held.planned = Some(due);
        drop(held);
        let _ = kick.try_send(());
    }
}

/// What one node said of the locks it was asked to renew: their indexes in the pass, each
/// with its reply (`None`: no reply), and whether the node refused the call at `AUTH`.
type Replies = (Vec<(usize, Option<ExtendReply>)>, bool);

/// A pass: renewals sent at `now` to the nodes of its plan, on a thread of the pass's own.
/// Each node's replies are applied as they come, from that node's call: a lock's outcome
/// is settled once its own nodes' answers decide it (all of them, or on Redlock a majority
/// that renewed it), so a node that hangs holds up its own locks only, and no later pass
/// (which leaves that node out while it is busy).
struct Pass {
    cx: Arc<Context>,
    held: Arc<Mutex<Held>>,
    kick: Sender<()>,
    now: Stamp,
    due: Vec<Renewing>,
    plan: Plan,
    tally: Mutex<Tally>,
}

/// What a pass's nodes said so far. Per lock: (extended, gone, other owner) node counts,
/// the nodes yet to answer, whether a node refused its renewal at `AUTH`, and whether its
/// outcome was applied. Per node of the plan: whether it answered (and so is free).
struct Tally {
    counts: Vec<(usize, usize, usize)>,
    waiting: Vec<usize>,
    turned_away: Vec<bool>,
    settled: Vec<bool>,
    answered: Vec<bool>,
}

impl Pass {
    fn new(
        cx: &Arc<Context>,
        held: &Arc<Mutex<Held>>,
        kick: &Sender<()>,
        now: Stamp,
        due: Vec<Renewing>,
        plan: Plan,
    ) -> Pass {
        let mut settled = vec![false; due.len()];
        for &i in &plan.held_back {
            settled[i] = true; // put back by the watchdog thread
        }
        cx.flying.lock().extend(
            (due.iter().zip(&settled))
                .filter(|(_, settled)| !**settled)
                .map(|((lock, ..), _)| lock.id),
        );
        let tally = Tally {
            counts: vec![(0, 0, 0); due.len()],
            waiting: plan.nodes_per_lock(),
            turned_away: vec![false; due.len()],
            settled,
            answered: vec![false; plan.nodes.len()],
        };
        Pass {
            cx: cx.clone(),
            held: held.clone(),
            kick: kick.clone(),
            now,
            due,
            plan,
            tally: Mutex::new(tally),
        }
    }

    /// Sends the pass's extends and applies what comes back. A panic leaves no lock
    /// `renewing` (an unlock would wait for ever) and no node busy; it is raised on.
    fn run(self: &Arc<Self>, topology: &Topology) {
        let undo = OnUnwind::new(|| self.finish(true));
        extend_on_nodes(&self.cx, topology, self);
        undo.disarm();
        self.finish(false);
    }

    /// The plan's node `k` answered (or failed): each of its locks' outcomes is applied
    /// once its nodes' answers decide it, and the node is free for the next pass.
    fn heard(&self, k: usize, (replies, refused): Replies) {
        let mut look = None;
        let wake = {
            let mut t = self.tally.lock();
            for (i, reply) in replies {
                t.turned_away[i] |= refused;
                match reply {
                    Some(ExtendReply::Extended) => t.counts[i].0 += 1,
                    Some(ExtendReply::Gone) => t.counts[i].1 += 1,
                    Some(ExtendReply::Other) => t.counts[i].2 += 1,
                    // Refused as stale: a newer change's own reply says how it went.
                    Some(ExtendReply::Stale) | None => {}
                }
                t.waiting[i] = t.waiting[i].saturating_sub(1);
                if !t.settled[i] && (t.waiting[i] == 0 || self.decided(&t, i)) {
                    let at = self.settle(&mut t, i);
                    look = Some(look.map_or(at, |l: Stamp| l.min(at)));
                }
            }
            t.answered[k] = true;
            self.cx.busy.lock().remove(&self.plan.nodes[k].id) == Some(true)
        };
        self.look_again(look, wake);
    }

    /// The pass is over. A lock whose nodes did not all answer (a Redlock node skipped as
    /// stalled said nothing) is settled by what was heard; after a panic (`abandoned`),
    /// as unknown. The plan's nodes still marked busy are freed.
    fn finish(&self, abandoned: bool) {
        let mut look = None;
        let wake = {
            let mut t = self.tally.lock();
            for i in 0..self.due.len() {
                if t.settled[i] {
                    continue;
                }
                let at = if abandoned {
                    t.settled[i] = true;
                    let (lock, lease, _) = &self.due[i];
                    self.cx.flying.lock().remove(&lock.id);
                    lock.end_renew(unknown(&self.cx.cfg, self.now, *lease), &self.cx.counters);
                    lock.next_due()
                } else {
                    self.settle(&mut t, i)
                };
                look = Some(look.map_or(at, |l: Stamp| l.min(at)));
            }
            let mut busy = self.cx.busy.lock();
            let mut wake = false;
            for (node, answered) in self.plan.nodes.iter().zip(&mut t.answered) {
                if !std::mem::replace(answered, true) {
                    wake |= busy.remove(&node.id) == Some(true);
                }
            }
            wake
        };
        self.look_again(look, wake);
    }

    /// Whether what lock `i`'s nodes said so far decides its outcome, whatever the others
    /// say (Redlock: a majority renewed it, or too many say it is gone): then it is settled
    /// without waiting for a node that hangs.
    fn decided(&self, t: &Tally, i: usize) -> bool {
        let holders = self.due[i].0.nodes.len();
        !matches!(
            self.plan.routes[i].renewal(t.counts[i], holders),
            Renewal::Unknown
        )
    }

    /// Applies lock `i`'s outcome from its nodes' tally; returns when to look at it next.
    fn settle(&self, t: &mut Tally, i: usize) -> Stamp {
        t.settled[i] = true;
        let (cfg, counters, now) = (&self.cx.cfg, &*self.cx.counters, self.now);
        let (lock, lease, _) = &self.due[i];
        let outcome = match self.plan.routes[i].renewal(t.counts[i], lock.nodes.len()) {
            Renewal::Renewed => Changed::Applied {
                valid_until: now + *lease - cfg.drift(*lease),
                next_renew: now + cfg.renew_every(*lease),
            },
            Renewal::Lost(reason) => Changed::Lost(reason),
            Renewal::Unknown => {
                Counters::inc(&counters.renewals_failed);
                unknown(cfg, now, *lease)
            }
        };
        let outcome = match (outcome, t.turned_away[i]) {
            (Changed::Unknown { cap, .. }, true) => {
                let valid_until = lock.validity().min(cap);
                let n = {
                    let mut refused = self.cx.refused.lock();
                    let n = refused.entry(lock.id).or_default();
                    *n += 1;
                    *n
                };
                let retry_at = backoff(n, cfg.renew_retry(), now, valid_until);
                Changed::Unknown { cap, retry_at }
            }
            (outcome, _) => {
                self.cx.refused.lock().remove(&lock.id);
                outcome
            }
        };
        self.cx.flying.lock().remove(&lock.id);
        lock.end_renew(outcome, counters);
        // Its cap may come before the retry.
        lock.next_due().min(now + cfg.renew_retry())
    }

    /// Wakes the thread to look at the locks at `at`, or now when a lock was held back for
    /// a node that has answered since (`wake`).
    fn look_again(&self, at: Option<Stamp>, wake: bool) {
        let at = if wake { Some(Stamp::now()) } else { at };
        if let Some(at) = at {
            plan_look(self.held.lock(), &self.kick, at);
        }
    }
}

/// Which nodes hold the due locks (Redis Cluster: the master serving each lock's slot
/// now), and per node the indexes of its locks; whether calls go one slot at a time; each
/// lock's route; the locks held back for a node still busy with an earlier pass's call.
struct Plan {
    nodes: Vec<Arc<Node>>,
    held_by: Vec<Vec<usize>>,
    by_slot: bool,
    routes: Vec<Route>,
    held_back: Vec<usize>,
}

impl Plan {
    /// The plan of `due`, whose nodes are then marked `busy` (by the watchdog thread, the
    /// only one that adds to it). A lock is sent to its nodes that are not busy when they
    /// alone can renew it (Redlock: a majority), else held back (and its busy nodes marked
    /// to wake the thread when they answer): one node's hung call holds up no lock of the
    /// other nodes, and no thread is made per pass for a node that hangs.
    fn of(topology: &Topology, due: &[Renewing], busy: &Mutex<HashMap<NodeId, bool>>) -> Plan {
        // Routed first: a route may read the slot map again, not to be done under `busy`.
        let routed: Vec<(Route, Vec<Arc<Node>>)> = (due.iter())
            .map(|(lock, ..)| {
                let route = topology.route(&lock.keys);
                let holders = route.holders(&lock.nodes);
                (route, holders)
            })
            .collect();
        let mut nodes: Vec<Arc<Node>> = Vec::new();
        let mut held_by: Vec<Vec<usize>> = Vec::new();
        let mut routes = Vec::with_capacity(due.len());
        let mut held_back = Vec::new();
        let mut busy = busy.lock();
        for (i, (route, holders)) in routed.into_iter().enumerate() {
            let granted = due[i].0.nodes.len();
            let (free, taken): (Vec<Arc<Node>>, Vec<Arc<Node>>) =
                holders.into_iter().partition(|n| !busy.contains_key(&n.id));
            let enough = matches!(route.renewal((free.len(), 0, 0), granted), Renewal::Renewed);
            routes.push(route);
            if !taken.is_empty() && !enough {
                for node in taken {
                    busy.insert(node.id.clone(), true);
                }
                held_back.push(i);
                continue;
            }
            for node in free {
                match nodes.iter().position(|n| n.id == node.id) {
                    Some(k) => held_by[k].push(i),
                    None => {
                        nodes.push(node);
                        held_by.push(vec![i]);
                    }
                }
            }
        }
        for node in &nodes {
            busy.insert(node.id.clone(), false);
        }
        drop(busy);
        Plan {
            nodes,
            held_by,
            // Redis Cluster refuses one script call over keys of several slots.
            by_slot: topology.batches_by_slot(),
            routes,
            held_back,
        }
    }

    /// Per lock, how many nodes are asked to renew it.
    fn nodes_per_lock(&self) -> Vec<usize> {
        let mut count = vec![0; self.routes.len()];
        for i in self.held_by.iter().flatten() {
            count[*i] += 1;
        }
        count
    }
}

/// Sends the pass's extends: one round trip per node (its batches pipelined: Redis
/// Cluster wants one script call per slot), every node in parallel, each node's replies
/// applied as soon as it answered.
fn extend_on_nodes(cx: &Context, topology: &Topology, pass: &Arc<Pass>) {
    let counters = cx.counters.clone();
    let pass = pass.clone();
    let nodes = pass.plan.nodes.clone();
    topology.fan_out(&nodes, move |node| {
        let Some(k) = pass.plan.nodes.iter().position(|n| n.id == node.id) else {
            return;
        };
        let due = &pass.due;
        // Group this node's locks by lease, slot and kind: one script call per group and
        // batch, the script chosen by how the locks are held.
        let mut by_lease: HashMap<(Duration, u16, bool), Vec<usize>> = HashMap::new();
        for &i in &pass.plan.held_by[k] {
            let (lock, lease, _) = &due[i];
            let slot = if pass.plan.by_slot {
                keyslot(lock.keys.lock())
            } else {
                0
            };
            by_lease
                .entry((*lease, slot, lock.protocol.renewal().ordered))
                .or_default()
                .push(i);
        }
        // Every group's batches go in one round trip to the node.
        let mut batches: Vec<Batch<'_>> = Vec::new();
        let mut chunks: Vec<&[usize]> = Vec::new();
        for ((lease, _, _), idxs) in &by_lease {
            let RenewScript { script, ordered } = due[idxs[0]].0.protocol.renewal();
            for chunk in idxs.chunks(BATCH) {
                batches.push(Batch {
                    script,
                    locks: chunk
                        .iter()
                        .map(|&i| Change {
                            key: due[i].0.keys.lock(),
                            record: due[i].0.keys.lease(),
                            token: due[i].0.token.as_str(),
                            seq: due[i].2,
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
        pass.heard(k, (replies, refused));
    });
}
