//! The contender: the one thread of a process (per key) that talks to Redis to take a lock,
//! and how it waits between attempts.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::Receiver;
use redis::Cmd;

use crate::api::client::Inner;
use crate::config::Wakeup;
use crate::error::{Error, Result};
use crate::fencing::MAX_FENCE;
use crate::local::held::{Acquisition, RemoteLock};
use crate::proto::keys::Keys;
use crate::proto::node::{Attempt, Marks, ReleaseReply, Retry, may_have_run};
use crate::stats::Counters;
use crate::wake::early::{Armed, Shot};
use crate::wake::subscriber::{Snapshot, Watch};

/// How long a contender of a process that just released a contended lock lets the other
/// waiters go first (it is woken sooner by their acquisition's `set` event).
pub(crate) const YIELD: Duration = Duration::from_millis(10);

/// The outcome of one round of attempts.
enum Round {
    Acquired(Arc<RemoteLock>),
    /// Held elsewhere; wake by this time at the latest (the holder's remaining lease, or a
    /// jitter after a split Redlock vote).
    Held(Option<Duration>),
}

/// Why a wait ended.
enum Woken {
    Event,
    Lease,
    Recheck,
    Deadline,
    Reconnected,
}

/// The caller's wait policy.
#[derive(Clone, Copy)]
pub(crate) enum Wait {
    No,
    Until(Option<Instant>),
}

impl Wait {
    fn deadline(self) -> Option<Instant> {
        match self {
            Wait::No => None,
            Wait::Until(d) => d,
        }
    }
}

impl Inner {
    /// Contends in Redis until the lock is ours, the wait policy says stop, or an error.
    pub(crate) fn contend(
        self: &Arc<Self>,
        keys: &Keys,
        wait: Wait,
        yield_first: bool,
    ) -> Result<Arc<RemoteLock>> {
        let mut waiter = Waiter::new();
        let asked: Vec<Option<(Instant, u64)>> =
            self.subs.iter().map(|s| s.should_yield(keys)).collect();
        if (yield_first || asked.iter().any(Option::is_some)) && !self.subs.is_empty() {
            waiter.yield_to_others(keys, wait.deadline(), self, &asked);
        }
        let mut marked = false;
        loop {
            // An attempt that will wait if it fails marks contention for the holder. The
            // script deletes our mark when we win; when we leave without the lock, we take
            // it with us, so that no holder keeps yielding to nobody.
            let (before, marks, outcome) = match waiter.take_early() {
                // The subscriber sent our attempt when the key was freed.
                Some((shot, pending)) => (
                    Some(vec![shot.at]),
                    pending.marks,
                    self.finish_early(keys, shot, pending, wait.deadline()),
                ),
                None => {
                    let before = waiter.snapshots();
                    let waiting = match wait {
                        Wait::No => false,
                        Wait::Until(d) => d.is_none_or(|d| Instant::now() < d),
                    };
                    let marks = Marks {
                        leave: waiting,
                        clear: marked,
                    };
                    (before, marks, self.round(keys, marks, wait.deadline()))
                }
            };
            let hint = match outcome {
                Ok(Round::Acquired(lock)) => return Ok(lock),
                Ok(Round::Held(hint)) => {
                    marked |= marks.leave;
                    hint
                }
                Err(e) => {
                    if marked {
                        self.unmark(keys);
                    }
                    return Err(e);
                }
            };
            let deadline = match wait {
                Wait::No => return Err(Error::WouldBlock),
                Wait::Until(d) => d,
            };
            if deadline.is_some_and(|d| Instant::now() >= d) {
                if marked {
                    self.unmark(keys);
                }
                return Err(Error::Timeout);
            }
            crate::fault::hit(&self.cfg.key_prefix, crate::fault::Point::Contend);
            let woken = match self.cfg.wakeup {
                Wakeup::Polling(every) => {
                    let until = earliest(crate::clock::from_now(every), deadline);
                    std::thread::sleep(until.saturating_duration_since(Instant::now()));
                    Counters::inc(&self.counters.wakeups_poll);
                    continue;
                }
                Wakeup::Notifications => {
                    if waiter.watches.is_empty() {
                        // Subscribe, and have Redis confirm it, before the attempt whose
                        // failure makes us wait: then no release after it goes unseen.
                        waiter.watch(keys, self, deadline);
                        continue;
                    }
                    match before {
                        Some(before) => {
                            waiter.arm(keys, self, marked, deadline);
                            waiter.wait_change(&before, hint, deadline, self)
                        }
                        None => waiter.wait_degraded(hint, deadline, keys, self),
                    }
                }
            };
            let c = &self.counters;
            match woken {
                Woken::Event => Counters::inc(&c.wakeups_event),
                Woken::Lease => Counters::inc(&c.wakeups_lease),
                Woken::Recheck => Counters::inc(&c.wakeups_recheck),
                Woken::Reconnected => Counters::inc(&c.wakeups_reconnect),
                Woken::Deadline => {}
            }
        }
    }

    /// A compare-and-delete the caller does not wait for (after an ambiguous failure, so
    /// that the deadline is kept and no stray key outlives the call by long).
    fn release_in_background(self: &Arc<Self>, keys: &Keys, token: String, nodes: Vec<usize>) {
        // One bounded worker per client (see `cleanup`), never a thread per failure.
        self.release_later(keys, token, nodes);
    }

    /// Redlock: raises the fencing counter of the granting nodes that are behind to
    /// `fence`, the highest among them, before the lock is used. Any later majority overlaps this one in at
    /// least one node, whose counter is now at least `fence`: the next holder's token is
    /// higher, even though the nodes' counters drift apart. A node that fails here (or
    /// restarts empty later) weakens that promise: see the crate docs.
    fn raise_fences(self: &Arc<Self>, keys: &Keys, fence: u64, nodes: &[usize]) {
        let (client, k, nodes) = (self.clone(), keys.clone(), nodes.to_vec());
        let replies = self.map_nodes(move |n| {
            nodes
                .contains(&n)
                .then(|| client.nodes[n].raise_fence(&k, fence))
        });
        for e in replies.into_iter().flatten().filter_map(|r| r.err()) {
            log::debug!("raising a fence counter failed: {e}");
        }
    }

    /// Removes our contention mark on every node (best effort).
    fn unmark(self: &Arc<Self>, keys: &Keys) {
        let (client, k) = (self.clone(), keys.clone());
        for r in self.map_nodes(move |n| client.nodes[n].unmark(&k)) {
            if let Err(e) = r {
                log::debug!("removing a contention mark failed: {e}");
            }
        }
    }

    /// One attempt on every node.
    fn round(
        self: &Arc<Self>,
        keys: &Keys,
        marks: Marks,
        deadline: Option<Instant>,
    ) -> Result<Round> {
        let token = new_token();
        let lease = self.cfg.lease;
        let started = Instant::now();
        if self.nodes.len() == 1 {
            let reply =
                self.nodes[0].acquire(keys, &token, lease, Retry::LOST_REPLY, marks, deadline);
            return self.single_node(keys, token, started, reply);
        }
        // Redlock: every node at once; an error is a vote against, never an abort.
        let (client, k, t) = (self.clone(), keys.clone(), token.clone());
        let replies = self.map_nodes(move |n| {
            client.nodes[n].acquire(&k, &t, lease, Retry::ON_RESET, marks, deadline)
        });
        let granted: Vec<(usize, u64)> = replies
            .iter()
            .enumerate()
            .filter_map(|(n, r)| match r {
                Ok(Attempt::Acquired { fence }) => Some((n, *fence)),
                _ => None,
            })
            .collect();
        let needed = self.quorum();
        let validity = lease.checked_sub(started.elapsed() + self.cfg.drift(lease));
        if granted.len() >= needed && validity.is_some_and(|v| !v.is_zero()) {
            let fence = granted.iter().map(|&(_, f)| f).max().unwrap_or(0);
            let nodes: Vec<usize> = granted.iter().map(|&(n, _)| n).collect();
            // Only nodes behind need it: with counters in step there is no extra round trip.
            let behind: Vec<usize> = granted
                .iter()
                .filter(|&&(_, f)| f < fence)
                .map(|&(n, _)| n)
                .collect();
            if !behind.is_empty() {
                self.raise_fences(keys, fence, &behind);
            }
            return self.acquired(keys, token, fence, nodes, started);
        }
        // Not ours: undo on every node that may hold our token, including the ones whose
        // reply was lost.
        let undo: Vec<usize> = replies
            .iter()
            .enumerate()
            .filter(|(_, r)| match r {
                Ok(Attempt::Held { .. }) => false,
                Ok(Attempt::Acquired { .. }) => true,
                Err(e) => may_have_run(e),
            })
            .map(|(n, _)| n)
            .collect();
        if deadline.is_some_and(|d| Instant::now() >= d) {
            self.release_in_background(keys, token, undo);
        } else {
            self.release_on(keys, &token, undo);
        }
        let errors = replies.iter().filter(|r| r.is_err()).count();
        if errors > self.nodes.len() - needed {
            if let Some(Err(e)) = replies.iter().find(|r| r.is_err()) {
                log::debug!("redlock round failed: {e}");
            }
            return Err(Error::NoQuorum {
                granted: granted.len(),
                needed,
                nodes: self.nodes.len(),
            });
        }
        let held: Vec<Option<Duration>> = replies
            .iter()
            .filter_map(|r| match r {
                Ok(Attempt::Held { pttl }) => Some(*pttl),
                _ => None,
            })
            .collect();
        let pttl = held.iter().flatten().min().copied();
        if held.len() > self.nodes.len() - needed {
            // Others hold enough nodes that we cannot win now: wait for their release
            // events (or their lease), like on one node.
            return Ok(Round::Held(pttl));
        }
        // A split vote (nobody has a majority): retry after a random jitter, so that
        // contenders do not stay in lockstep.
        let jitter = Duration::from_millis(rand::random_range(2..=25));
        Ok(Round::Held(Some(pttl.map_or(jitter, |p| p.min(jitter)))))
    }

    /// Reads the reply to the attempt the subscriber sent for us (one node).
    fn finish_early(
        self: &Arc<Self>,
        keys: &Keys,
        shot: Shot,
        pending: Pending,
        deadline: Option<Instant>,
    ) -> Result<Round> {
        let reply =
            self.nodes[0].finish_acquire(shot.reply, &pending.call, Retry::LOST_REPLY, deadline);
        self.single_node(keys, pending.token, shot.sent, reply)
    }

    /// The round's outcome from the one node's reply to an attempt with `token`.
    fn single_node(
        self: &Arc<Self>,
        keys: &Keys,
        token: String,
        started: Instant,
        reply: Result<Attempt>,
    ) -> Result<Round> {
        match reply {
            Ok(Attempt::Acquired { fence }) => self.acquired(keys, token, fence, vec![0], started),
            Ok(Attempt::Held { pttl }) => Ok(Round::Held(pttl)),
            Err(e) => {
                if may_have_run(&e) {
                    // The key may be ours without our knowing: leave nothing behind,
                    // without spending the caller's deadline on it.
                    self.release_in_background(keys, token, vec![0]);
                }
                Err(e)
            }
        }
    }

    fn acquired(
        self: &Arc<Self>,
        keys: &Keys,
        token: String,
        fence: u64,
        nodes: Vec<usize>,
        started: Instant,
    ) -> Result<Round> {
        if fence > MAX_FENCE {
            self.release_on(keys, &token, nodes);
            return Err(Error::Protocol(format!(
                "fence counter {fence} exceeds {MAX_FENCE}"
            )));
        }
        let lease = self.cfg.lease;
        let lock = Arc::new(RemoteLock::new(
            Acquisition {
                keys: keys.clone(),
                token,
                fence,
                nodes,
                started,
            },
            lease,
            self.cfg.drift(lease),
            self.cfg.auto_renew.then(|| self.renew_every(lease)),
        ));
        Counters::inc(&self.counters.remote_acquisitions);
        Ok(Round::Acquired(lock))
    }

    /// Compare-and-delete on `nodes`, in parallel; the replies per node.
    pub(crate) fn release_on(
        self: &Arc<Self>,
        keys: &Keys,
        token: &str,
        nodes: Vec<usize>,
    ) -> Vec<Result<ReleaseReply>> {
        if self.nodes.len() == 1 {
            return nodes
                .iter()
                .map(|&n| self.nodes[n].release(keys, token, Retry::LOST_REPLY))
                .collect();
        }
        let (client, k, t) = (self.clone(), keys.clone(), token.to_owned());
        let replies = self.map_nodes(move |n| {
            if nodes.contains(&n) {
                Some(client.nodes[n].release(&k, &t, Retry::ON_RESET))
            } else {
                None
            }
        });
        replies.into_iter().flatten().collect()
    }
}

/// A fresh owner token: a random UUID v4, from the thread-local CSPRNG (seeded by the OS)
/// rather than a `getrandom` system call per lock.
fn new_token() -> String {
    uuid::Builder::from_random_bytes(rand::random())
        .into_uuid()
        .hyphenated()
        .to_string()
}

fn earliest(t: Instant, deadline: Option<Instant>) -> Instant {
    deadline.map_or(t, |d| d.min(t))
}

/// A contender's subscriptions (one per node) and the channel that pokes it. Both are made
/// only when the contender has to wait: an uncontended lock allocates neither.
struct Waiter {
    poke: Receiver<()>,
    watches: Vec<Watch>,
    /// Degraded-mode backoff, used only while subscriptions cannot be confirmed.
    backoff: Duration,
    /// The attempt armed for the subscriber to send early (see `early`).
    pending: Option<Pending>,
}

/// An armed attempt, as the contender needs it when it reads the reply.
struct Pending {
    token: String,
    marks: Marks,
    call: Cmd,
}

impl Waiter {
    fn new() -> Self {
        Waiter {
            poke: crossbeam_channel::never(),
            watches: Vec::new(),
            backoff: Duration::from_millis(10),
            pending: None,
        }
    }

    /// Before sleeping: leaves the next attempt (with a fresh token) for the subscriber to
    /// send the moment the key may be free. One node only.
    fn arm(&mut self, keys: &Keys, client: &Inner, marked: bool, deadline: Option<Instant>) {
        let [node] = client.nodes.as_slice() else {
            return;
        };
        let [watch] = self.watches.as_slice() else {
            return;
        };
        let token = new_token();
        // We wait, so a failure marks contention; and clears our mark if we win.
        let marks = Marks {
            leave: true,
            clear: marked,
        };
        let call = node.acquire_call(keys, &token, client.cfg.lease, marks);
        if watch.arm(Armed::new(node.pool.clone(), &call, deadline)) {
            self.pending = Some(Pending { token, marks, call });
        }
    }

    /// After a wake-up: disarms, and returns the attempt in flight if the subscriber sent it.
    fn take_early(&mut self) -> Option<(Shot, Pending)> {
        let pending = self.pending.take()?;
        let shot = self.watches.first()?.take_early()?;
        Some((shot, pending))
    }

    /// Registers with every node's subscriber and waits until a majority confirmed (one
    /// node: that node), bounded by the deadline and the read timeout.
    fn watch(&mut self, keys: &Keys, client: &Inner, deadline: Option<Instant>) {
        let (poke_tx, poke) = crossbeam_channel::bounded(1);
        self.poke = poke;
        self.watches = client
            .subs
            .iter()
            .map(|s| s.watch(keys, poke_tx.clone()))
            .collect();
        self.confirm(client, deadline);
    }

    fn confirm(&self, client: &Inner, deadline: Option<Instant>) -> bool {
        let until = earliest(Instant::now() + client.cfg.read_timeout, deadline);
        let needed = client.quorum().min(self.watches.len());
        if client.subs.iter().filter(|s| s.usable()).count() < needed {
            return false;
        }
        loop {
            let confirmed = self
                .watches
                .iter()
                .filter(|w| w.snapshot().confirmed)
                .count();
            if confirmed >= needed {
                return true;
            }
            if self.poke.recv_deadline(until).is_err() {
                return self
                    .watches
                    .iter()
                    .filter(|w| w.snapshot().confirmed)
                    .count()
                    >= needed;
            }
        }
    }

    /// The counters before an attempt, if the subscriptions are confirmed.
    fn snapshots(&self) -> Option<Vec<Snapshot>> {
        if self.watches.is_empty() {
            return None;
        }
        while self.poke.try_recv().is_ok() {}
        let snaps: Vec<Snapshot> = self.watches.iter().map(Watch::snapshot).collect();
        let confirmed = snaps.iter().filter(|s| s.confirmed).count();
        (confirmed >= snaps.len().div_ceil(2).max(1)).then_some(snaps)
    }

    /// Sleeps until the key may be free: an event on any node, the holder's lease (plus a
    /// margin, since `expired` comes when Redis evicts the key, which can be late), the
    /// re-check ceiling, or the deadline.
    fn wait_change(
        &self,
        before: &[Snapshot],
        hint: Option<Duration>,
        deadline: Option<Instant>,
        client: &Inner,
    ) -> Woken {
        let now = Instant::now();
        let recheck = crate::clock::after(now, client.cfg.recheck_interval);
        let lease_end = hint.map(|p| {
            crate::clock::after(now, p.saturating_add(p / 100 + Duration::from_millis(2)))
        });
        let mut until = recheck;
        if let Some(t) = lease_end {
            until = until.min(t);
        }
        let until = earliest(until, deadline);
        loop {
            for (w, b) in self.watches.iter().zip(before) {
                let s = w.snapshot();
                if s.generation != b.generation || (b.confirmed && !s.confirmed) {
                    // Events may have been lost while the subscriber was away: re-confirm,
                    // then retry once.
                    self.confirm(client, deadline);
                    return Woken::Reconnected;
                }
                if s.freed != b.freed {
                    return Woken::Event;
                }
            }
            if self.poke.recv_deadline(until).is_err() {
                let now = Instant::now();
                return if deadline.is_some_and(|d| now >= d) {
                    Woken::Deadline
                } else if lease_end.is_some_and(|t| now >= t) {
                    Woken::Lease
                } else {
                    Woken::Recheck
                };
            }
        }
    }

    /// Subscriptions could not be confirmed (the subscriber cannot reach Redis): retry with
    /// a capped, jittered backoff, never longer than the holder's lease, and try to
    /// confirm again.
    fn wait_degraded(
        &mut self,
        hint: Option<Duration>,
        deadline: Option<Instant>,
        keys: &Keys,
        client: &Inner,
    ) -> Woken {
        let jitter = Duration::from_millis(rand::random_range(0..=self.backoff.as_millis() as u64));
        let mut sleep = self.backoff / 2 + jitter / 2;
        if let Some(p) = hint {
            sleep = sleep.min(p);
        }
        self.backoff = (self.backoff * 2).min(Duration::from_secs(1));
        let until = earliest(Instant::now() + sleep, deadline);
        log::debug!(
            "waiting for {} without confirmed subscription",
            keys.display()
        );
        let _ = self.poke.recv_deadline(until);
        self.confirm(client, deadline);
        Woken::Recheck
    }

    /// After this process released a lock others wait for, let them take it first: wait
    /// for someone to set the key, or until the pause asked for at release (`asked`, per
    /// node: until when, and the count of others' acquisitions then) runs out.
    fn yield_to_others(
        &mut self,
        keys: &Keys,
        deadline: Option<Instant>,
        client: &Inner,
        asked: &[Option<(Instant, u64)>],
    ) {
        if self.watches.is_empty() {
            self.watch(keys, client, deadline);
        }
        let before: Vec<u64> = self
            .watches
            .iter()
            .zip(asked)
            .map(|(w, a)| a.map_or_else(|| w.snapshot().taken, |(_, taken)| taken))
            .collect();
        let pause_end = asked
            .iter()
            .flatten()
            .map(|&(until, _)| until)
            .min()
            .unwrap_or_else(|| Instant::now() + YIELD);
        let until = earliest(pause_end, deadline);
        loop {
            // Only another owner's `set` ends the pause early: our own release's `del`/`r`
            // may still be on its way and must not count as "they went first".
            let taken = self
                .watches
                .iter()
                .zip(&before)
                .any(|(w, b)| w.snapshot().taken != *b);
            if taken || self.poke.recv_deadline(until).is_err() {
                return;
            }
        }
    }
}
