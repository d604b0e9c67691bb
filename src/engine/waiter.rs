//! A contender's wait between attempts: its subscriptions, and what ends its sleep.

use std::time::{Duration, Instant};

use std::sync::Arc;

use crossbeam_channel::{Receiver, Sender};
use redis::Cmd;

use crate::clock::from_now;
use crate::config::Wakeup;
use crate::engine::clock::{YIELD, earliest};
use crate::engine::state::Engine;
use crate::local::mailbox::{Cancellation, Registration};
use crate::proto::keys::Keys;
use crate::proto::node::past;
use crate::proto::protocol::{Marks, Protocol, Request};
use crate::stats::Counters;
use crate::topology::Route;
use crate::wake::candidacy::Candidacy;
use crate::wake::early::{Armed, Shot};
use crate::wake::events::{Grant, Hears, Snapshot};
use crate::wake::subscriber::{Subscriber, Watch};

/// How a [`Waiter::nap`] ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Nap {
    /// Poked (an event, a grant, a cancel, a turn to read).
    Poked,
    /// It read the subscriber connection, and something came.
    Heard,
    /// It read the subscriber connection, and nothing came.
    Quiet,
    /// Its time ran out.
    Over,
}

/// Why a wait ended.
pub(crate) enum Woken {
    Event,
    Lease,
    Recheck,
    /// Polling: the polling interval ended.
    Poll,
    Deadline,
    Reconnected,
    /// Redis Cluster: the key's slot moved to another master; its events happen there now.
    Moved,
    /// Fair queue: a release granted us the lock.
    Granted,
    /// The caller cancelled the wait.
    Cancelled,
}

/// A contender's subscriptions (one per node) and the channel that pokes it. Both are made
/// only when the contender has to wait: an uncontended lock allocates neither.
pub(crate) struct Waiter {
    poke: Receiver<()>,
    /// The sending side of `poke`, kept once made, so that the subscriptions of every watch
    /// and the caller's cancellation poke one channel.
    poke_tx: Option<Sender<()>>,
    /// A cancellable wait: its waker (which pokes), registered for the whole contest.
    cancel: Option<Registration>,
    watches: Vec<Watch>,
    /// Watching one node: the offer to read its subscriber connection while asleep (see
    /// `wake::seat`), made at the first sleep and kept while the watch is (so that the
    /// subscriber thread, woken by the echo of our failed attempt's contention mark, finds
    /// it there already and hands the connection over before the event we wait for).
    candidacy: Option<Candidacy>,
    /// Degraded-mode backoff, used only while subscriptions cannot be confirmed.
    backoff: Duration,
    /// The attempt armed for the subscriber to send early (see `early`).
    pending: Option<Pending>,
    /// How many confirmed subscriptions make the waiter's view complete (a majority of
    /// the route's nodes), and how many of its subscribers can confirm at all.
    needed: usize,
    usable: usize,
    /// Fair queue: the contender's token for this wait, whose grant the watches keep.
    grant_token: Option<String>,
    /// Which events wake it.
    hears: Hears,
}

/// An armed attempt, as the contender needs it when it reads the reply.
pub(crate) struct Pending {
    pub token: String,
    /// The attempt's nonce (fair queue: see `fair_scripts`).
    pub nonce: u64,
    pub marks: Marks,
    pub call: Cmd,
}

impl Waiter {
    pub fn new() -> Self {
        Waiter {
            poke: crossbeam_channel::never(),
            poke_tx: None,
            cancel: None,
            watches: Vec::new(),
            candidacy: None,
            backoff: Duration::from_millis(10),
            pending: None,
            needed: 0,
            usable: 0,
            grant_token: None,
            hears: Hears::Key,
        }
    }

    /// A waiter that hears only what `hears` says.
    pub fn hearing(hears: Hears) -> Self {
        Waiter {
            hears,
            ..Waiter::new()
        }
    }

    /// Makes every sleep of this waiter end when `cancel` is set (a cancellable wait: its
    /// channel is made now, not when it first watches).
    pub fn cancel_with(&mut self, cancel: &Arc<Cancellation>) {
        let poke = self.poke_sender();
        self.cancel = Some(cancel.on_cancel_poke(poke));
    }

    /// Whether the caller cancelled the wait.
    pub fn cancelled(&self) -> bool {
        self.cancel.as_ref().is_some_and(Registration::cancelled)
    }

    /// The sender of the channel that pokes this waiter, made the first time.
    fn poke_sender(&mut self) -> Sender<()> {
        if let Some(tx) = &self.poke_tx {
            return tx.clone();
        }
        let (tx, rx) = crossbeam_channel::bounded(1);
        self.poke = rx;
        self.poke_tx = Some(tx.clone());
        tx
    }

    /// Before sleeping: leaves the next attempt (with a fresh token, or the wait's, and
    /// `nonce`) for the subscriber to send the moment the key may be free. One node only.
    #[allow(clippy::too_many_arguments)]
    pub fn arm(
        &mut self,
        keys: &Keys,
        client: &Engine,
        route: &Route,
        protocol: Protocol,
        marked: bool,
        nonce: u64,
        deadline: Option<Instant>,
    ) {
        if client.cfg.replica_ack.is_some() {
            return; // the subscriber's early attempt would not wait for the replicas
        }
        let [watch] = self.watches.as_slice() else {
            return;
        };
        let token = self
            .grant_token
            .clone()
            .unwrap_or_else(|| protocol.new_token());
        // We wait, so a failure marks contention; and clears our mark if we win.
        let marks = Marks {
            leave: true,
            clear: marked,
        };
        let req = Request {
            keys,
            token: &token,
            lease: client.cfg.lease,
            marks,
            nonce,
        };
        let Some((node, call)) = client.topology.early_call(route, protocol, req) else {
            return;
        };
        if watch.arm(Armed::new(node.pool.clone(), &call, deadline)) {
            self.pending = Some(Pending {
                token,
                nonce,
                marks,
                call,
            });
        }
    }

    /// After a wake-up: disarms, and returns the attempt in flight if the subscriber sent it.
    pub fn take_early(&mut self) -> Option<(Shot, Pending)> {
        let pending = self.pending.take()?;
        let shot = self.watches.first()?.take_early()?;
        Some((shot, pending))
    }

    /// Registers with every node's subscriber and waits until a majority confirmed (one
    /// node: that node), bounded by the deadline and the read timeout.
    pub fn watch(
        &mut self,
        keys: &Keys,
        client: &Engine,
        route: &Route,
        deadline: Option<Instant>,
    ) {
        self.watch_all(std::slice::from_ref(keys), client, route, deadline);
    }

    /// [`watch`](Self::watch) for several keys at once (a multi-lock's names of one node):
    /// any key's event wakes the waiter, and the confirmations waited for are a majority
    /// of the nodes for every key (one node: every key there).
    pub fn watch_all(
        &mut self,
        keys: &[Keys],
        client: &Engine,
        route: &Route,
        deadline: Option<Instant>,
    ) {
        let poke_tx = self.poke_sender();
        let subs = client.subs_for(route);
        crate::fault::hit(&client.cfg.key_prefix, crate::fault::Point::Watch);
        let hears = self.hears;
        self.candidacy = None;
        let watches: Vec<Watch> = keys
            .iter()
            .flat_map(|k| subs.iter().map(|s| s.watch(k, hears, poke_tx.clone())))
            .collect();
        // The new watches await our grant before the old ones go: a grant heard on a node
        // watched in both is kept for the new watch (see `KeySub::forget`).
        if let Some(token) = &self.grant_token {
            for w in &watches {
                w.expect_grant(token);
            }
        }
        drop(std::mem::replace(&mut self.watches, watches));
        self.needed = (route.quorum() * keys.len()).min(self.watches.len());
        self.usable = keys.len() * subs.iter().filter(|s| s.usable()).count();
        self.confirm(client, deadline);
        self.stand();
    }

    /// Watching one node: offers to read its subscriber connection while asleep (see
    /// `candidacy`), from before the attempt that makes it wait.
    fn stand(&mut self) {
        if self.candidacy.is_none()
            && let ([watch], Some(poke)) = (self.watches.as_slice(), &self.poke_tx)
        {
            self.candidacy = Some(watch.candidacy(poke.clone()));
        }
    }

    /// Watches at once when every node's subscriber already has the key confirmed (another
    /// local waiter's subscription, or one that lingers): no command is sent, and the first
    /// attempt that fails can wait at once instead of subscribing and trying again.
    pub fn watch_if_subscribed(
        &mut self,
        keys: &[Keys],
        client: &Engine,
        route: &Route,
        deadline: Option<Instant>,
    ) {
        if self.watching() || !matches!(client.cfg.wakeup, Wakeup::Notifications) {
            return;
        }
        let subs = client.subs_for(route);
        let confirmed = |s: &Arc<Subscriber>| keys.iter().all(|k| s.confirmed_at(k).is_some());
        if !subs.is_empty() && subs.iter().all(confirmed) {
            self.watch_all(keys, client, route, deadline);
        }
    }

    /// Redis Cluster: the slot of `keys` may have moved (a reshard, a failover) since the
    /// last attempt, and `route` is where they were. Subscribes on the new master,
    /// confirmed, before the attempt, as after a reconnect: events there were not heard.
    /// The old master may have said so (it dropped the keys' shard channels) before our
    /// slot map knows: has the map read again first.
    pub fn follow(
        &mut self,
        keys: &[Keys],
        client: &Engine,
        route: &mut Route,
        deadline: Option<Instant>,
    ) {
        let moved = self.moved();
        if moved {
            route.nodes().iter().for_each(|n| n.slot_moved());
        }
        let Some(first) = keys.first() else { return };
        let now = client.topology.route(first);
        if moved && now.same_nodes(route) {
            // The map does not know the new master yet (it is read at most every 100 ms):
            // this attempt's redirect will tell it. Watch there after the attempt, before
            // sleeping.
            self.unwatch();
        } else if moved || !now.same_nodes(route) {
            *route = now;
            if self.watching() {
                self.watch_all(keys, client, route, deadline);
            }
        }
    }

    /// Fair queue: waits with `token`, and keeps a grant to it.
    pub fn await_grant(&mut self, token: &str) {
        self.grant_token = Some(token.to_owned());
        for w in &self.watches {
            w.expect_grant(token);
        }
    }

    /// The grants to this waiter heard since the last call (taken: each wakes the waiter
    /// once), added to `into`.
    pub fn take_grants(&self, into: &mut Vec<Grant>) {
        if self.grant_token.is_some() {
            self.watches.iter().for_each(|w| w.take_grants(into));
        }
    }

    pub fn watching(&self) -> bool {
        !self.watches.is_empty()
    }

    /// Drops the subscriptions (their node no longer serves the key): the next sleep
    /// subscribes again first, as the first one does.
    pub fn unwatch(&mut self) {
        self.candidacy = None;
        self.watches.clear();
        self.pending = None;
    }

    /// Whether the key's slot moved away from a node watched (Redis Cluster): the waiter
    /// must follow it before it waits again.
    pub fn moved(&self) -> bool {
        self.watches.iter().any(Watch::moved)
    }

    fn confirm(&self, client: &Engine, deadline: Option<Instant>) -> bool {
        let until = earliest(from_now(client.cfg.read_timeout), deadline);
        let needed = self.needed;
        if self.usable < needed {
            return false;
        }
        loop {
            if self.cancelled() {
                return false;
            }
            // The client shut down: its subscribers stopped (poking every waiter as they
            // forgot the subscriptions), and nothing confirms any more. A wait under way
            // goes on without events: its attempts follow the holder's lease.
            if client.shut_down.load(std::sync::atomic::Ordering::Relaxed) {
                return false;
            }
            let confirmed = self
                .watches
                .iter()
                .filter(|w| w.snapshot().confirmed)
                .count();
            if confirmed >= needed {
                return true;
            }
            // A watch whose slot moved away is never confirmed on its node.
            let hopeless = self.watches.iter().filter(|w| w.moved()).count();
            if self.watches.len() - hopeless < needed {
                return false;
            }
            if self.nap(until, client) == Nap::Over {
                return self
                    .watches
                    .iter()
                    .filter(|w| w.snapshot().confirmed)
                    .count()
                    >= needed;
            }
        }
    }

    /// Sleeps until poked or `until` (then [`Nap::Over`]); while it is this waiter's turn
    /// to read its node's subscriber connection (see `wake::seat`), it reads it instead,
    /// one short read at a time, and returns after each. What woke it is in the state it
    /// then looks at: a poke of its own read, or of a cancel (a flag), says nothing more.
    fn nap(&self, until: Instant, client: &Engine) -> Nap {
        if let Some(c) = &self.candidacy
            && Instant::now() < until
            && let Some(heard) = c.read(until, &client.counters)
        {
            let _ = self.poke.try_recv();
            return if heard { Nap::Heard } else { Nap::Quiet };
        }
        match self.poke.recv_deadline(until) {
            Ok(()) => Nap::Poked,
            Err(_) => Nap::Over,
        }
    }

    /// The counters before an attempt, if the subscriptions are confirmed.
    pub fn snapshots(&self) -> Option<Vec<Snapshot>> {
        if self.watches.is_empty() {
            return None;
        }
        while self.poke.try_recv().is_ok() {}
        let snaps: Vec<Snapshot> = self.watches.iter().map(Watch::snapshot).collect();
        let confirmed = snaps.iter().filter(|s| s.confirmed).count();
        (confirmed >= snaps.len().div_ceil(2).max(1)).then_some(snaps)
    }

    /// Sleeps between two attempts as the client's wake-up mode says, and counts why it
    /// woke. The first time, it only subscribes (and has Redis confirm it) and returns: the
    /// attempt whose failure makes the caller wait must come after that, so that no release
    /// after it goes unseen. `before`: the counters read before the failed attempt;
    /// `arm`: run just before sleeping on events (to leave an early attempt).
    #[allow(clippy::too_many_arguments)]
    pub fn sleep(
        &mut self,
        keys: &Keys,
        client: &Engine,
        route: &Route,
        before: Option<Vec<Snapshot>>,
        hint: Option<Duration>,
        deadline: Option<Instant>,
        arm: impl FnOnce(&mut Self),
    ) {
        let c = &client.counters;
        let woken = match (client.cfg.wakeup, before) {
            // Only a cancellation pokes a polling waiter (it watches nothing).
            (Wakeup::Polling(every), _) => self.sleep_interval(every, deadline, Woken::Poll),
            (Wakeup::Notifications, _) if !self.watching() => {
                self.watch(keys, client, route, deadline);
                if self.watching() {
                    return;
                }
                // No subscriber serves the route (the client shut down before the key
                // moved to a node it had none for): nothing to confirm, and the next
                // attempt must not follow at once, or the wait spins on attempts. Timers
                // alone wake it, as a wait without confirmed subscriptions.
                self.wait_degraded(hint, deadline, keys, client)
            }
            (Wakeup::Notifications, Some(before)) => {
                arm(self);
                self.wait_change(&before, hint, deadline, client)
            }
            (Wakeup::Notifications, None) => self.wait_degraded(hint, deadline, keys, client),
        };
        match woken {
            Woken::Event => Counters::inc(&c.wakeups_event),
            Woken::Lease => Counters::inc(&c.wakeups_lease),
            Woken::Recheck => Counters::inc(&c.wakeups_recheck),
            Woken::Poll => Counters::inc(&c.wakeups_poll),
            Woken::Reconnected => Counters::inc(&c.wakeups_reconnect),
            Woken::Moved => Counters::inc(&c.wakeups_moved),
            Woken::Granted => Counters::inc(&c.wakeups_event),
            Woken::Deadline | Woken::Cancelled => {}
        }
    }

    /// Sleeps until the key may be free: an event on any node, the holder's lease (plus a
    /// margin, since `expired` comes when Redis evicts the key, which can be late), the
    /// re-check ceiling, or the deadline.
    pub fn wait_change(
        &mut self,
        before: &[Snapshot],
        hint: Option<Duration>,
        deadline: Option<Instant>,
        client: &Engine,
    ) -> Woken {
        let recheck = from_now(client.cfg.recheck_interval);
        let lease_end = hint.map(|p| from_now(client.cfg.past_expiry(p)));
        let mut until = recheck;
        if let Some(t) = lease_end {
            until = until.min(t);
        }
        let until = earliest(until, deadline);
        // Sleeping on one node's events, the waiter reads that node's subscriber
        // connection itself when its turn comes (see `wake::seat`): an event for its key
        // then wakes it, not the subscriber thread first. `read`: our last turn read
        // something.
        self.stand();
        let mut read = false;
        let by_own_read = |read: bool| {
            if read {
                Counters::inc(&client.counters.waiter_reads);
            }
        };
        loop {
            if self.grant_token.is_some() && self.watches.iter().any(Watch::has_grant) {
                by_own_read(read);
                return Woken::Granted;
            }
            if self.cancelled() {
                return Woken::Cancelled;
            }
            // Also when a grant to another waiter, heard since the attempt, runs out (if
            // nobody took it, nothing else says so: see `Snapshot::lapse`).
            let mut nap_until = until;
            for (w, b) in self.watches.iter().zip(before) {
                let s = w.snapshot();
                if let Some((heard, lease)) = s.lapse.filter(|_| s.lapse != b.lapse) {
                    nap_until = nap_until.min(heard + client.cfg.past_expiry(lease));
                }
                if s.moved != b.moved {
                    return Woken::Moved;
                }
                if s.generation != b.generation || (b.confirmed && !s.confirmed) {
                    // Events may have been lost while the subscriber was away: re-confirm,
                    // then retry once. (The thread subscribes again: the connection is
                    // not ours to read meanwhile.)
                    self.candidacy = None;
                    self.confirm(client, deadline);
                    return Woken::Reconnected;
                }
                // A fair waiter that cannot hear its grant wakes when anyone takes the
                // key (a grant is a `set` of the key): its attempt finds its own token if
                // the lock was granted to it, before the grant's short lease runs out.
                let deaf = self.grant_token.is_some() && !w.hears_grants();
                let woken = match self.hears {
                    Hears::Key => s.freed != b.freed || (deaf && s.taken != b.taken),
                    Hears::Releases => s.released != b.released,
                    Hears::Zero => s.opened != b.opened,
                };
                if woken {
                    by_own_read(read);
                    return Woken::Event;
                }
            }
            let nap = self.nap(nap_until, client);
            read = nap == Nap::Heard;
            if nap == Nap::Over {
                return if past(deadline) {
                    Woken::Deadline
                } else if past(lease_end) || nap_until < until {
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
    pub fn wait_degraded(
        &mut self,
        hint: Option<Duration>,
        deadline: Option<Instant>,
        keys: &Keys,
        client: &Engine,
    ) -> Woken {
        let jitter = Duration::from_millis(rand::random_range(0..=self.backoff.as_millis() as u64));
        let mut sleep = self.backoff / 2 + jitter / 2;
        if let Some(p) = hint {
            sleep = sleep.min(p);
        }
        self.backoff = (self.backoff * 2).min(Duration::from_secs(1));
        // The thread is to subscribe again: the connection is not ours to read meanwhile.
        self.candidacy = None;
        log::debug!(
            "waiting for {} without confirmed subscription",
            keys.display()
        );
        let woken = self.sleep_interval(sleep, deadline, Woken::Recheck);
        self.confirm(client, deadline);
        woken
    }

    /// Sleeps `interval`, or until `deadline` if that comes first, or until poked; then
    /// says what ended the sleep: a cancel, the deadline, or else the interval (`ended`,
    /// counted as its cause). A poke that is not a cancel ends the interval early.
    fn sleep_interval(&self, interval: Duration, deadline: Option<Instant>, ended: Woken) -> Woken {
        let _ = self
            .poke
            .recv_deadline(earliest(from_now(interval), deadline));
        if self.cancelled() {
            Woken::Cancelled
        } else if past(deadline) {
            Woken::Deadline
        } else {
            ended
        }
    }

    /// After this process released a lock others wait for, let them take it first: wait
    /// for someone to set the key, or until the pause asked for at release (`asked`, per
    /// node: until when, and the count of others' acquisitions then) runs out.
    pub fn yield_to_others(
        &mut self,
        keys: &Keys,
        deadline: Option<Instant>,
        client: &Engine,
        route: &Route,
        asked: &[Option<(Instant, u64)>],
    ) {
        if self.watches.is_empty() {
            self.watch(keys, client, route, deadline);
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
            .unwrap_or_else(|| from_now(YIELD));
        let until = earliest(pause_end, deadline);
        loop {
            // Only another owner's `set` ends the pause early: our own release's `del`/`r`
            // may still be on its way and must not count as "they went first".
            let taken = self
                .watches
                .iter()
                .zip(&before)
                .any(|(w, b)| w.snapshot().taken != *b);
            if taken || self.cancelled() || self.nap(until, client) == Nap::Over {
                return;
            }
        }
    }
}
