//! What a node's subscriber thread and the waiters of that node share: per key, its
//! subscription's state (asked for, confirmed, moved away), its event counters and its
//! listeners; and what each thing the server says does to them.
//!
//! `events` classifies each message; the thread counts it for the key's waiters and pokes
//! them. A contender may leave its next attempt with its watch (see `early`): on an event
//! that may free the key, the thread sends it and reads the reply before it wakes the
//! contender.
//!
//! # A slot that moves
//!
//! In Redis Cluster the library's channel is a shard channel (`proto::sharded`). When its
//! slot moves to another master, the old one drops the subscription and says so (a
//! `sunsubscribe` nobody asked for). Events of the key now happen elsewhere: the key's
//! subscription here is no longer confirmed, its `moved` count changes, and its waiters
//! wake, follow the slot to its new master, subscribe there (confirmed) and retry once, as
//! after a reconnect. The key is not subscribed here again until a waiter watches it anew.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;
use parking_lot::{Condvar, Mutex};

use crate::proto::keys::{lock_of_channel, lock_of_keyspace_channel};
use crate::proto::node::NodeId;
use crate::proto::sharded::ChannelKind;
use crate::wake::early::{Armed, Early};
use crate::wake::events::{Event, Grant, Hears, Snapshot, classify, grant_of};
use crate::wake::seat::Booth;
use crate::wake::stream::Incoming;

/// How long a subscription outlives its last waiter, so that a key locked again and again
/// does not pay a `SUBSCRIBE` each time.
pub(super) const LINGER: Duration = Duration::from_secs(2);

/// One key's subscription on this node, and what its waiters need to know.
pub(super) struct KeySub {
    /// What was subscribed for this key on the current connection, and how (depends on
    /// whether the node has keyspace notifications and sharded pub/sub, which can change
    /// at a reconnect).
    pub(super) channels: Vec<(ChannelKind, Vec<u8>)>,
    pub(super) interest: usize,
    pub(super) confirmed: bool,
    /// When the subscription was confirmed: marks of remote contention published before
    /// then were not heard.
    pub(super) confirmed_at: Option<Instant>,
    pub(super) requested: bool,
    /// Channels asked for whose confirmation has not come yet.
    pub(super) unconfirmed: usize,
    /// The key's slot moved to another node (its shard channel was dropped): not
    /// subscribed here again until a waiter watches it anew.
    pub(super) away: bool,
    /// How many times that happened: a waiter whose watch saw it follows the slot.
    pub(super) moved: u64,
    pub(super) idle_since: Option<Instant>,
    pub(super) freed: u64,
    pub(super) released: u64,
    pub(super) taken: u64,
    pub(super) opened: u64,
    /// The key's last message was a keyspace `del`: an `r` that comes next is the library's
    /// word on the same release (its script deletes, then publishes, nothing of this key's
    /// in between). Any other message ends the pairing: a `del` no `r` follows (an
    /// operator's, an acquisition undone) must not take the next release's `r` for its own.
    pub(super) after_del: bool,
    pub(super) last_contended: Option<Instant>,
    /// This process released the key while others waited: its next contender waits for
    /// them (or this instant) before its first attempt.
    pub(super) yield_until: Option<(Instant, u64)>,
    pub(super) listeners: Vec<(u64, Hears, Sender<()>)>,
    /// Fair queue: the contender token each listener waits to be granted, and the grants
    /// heard for those tokens (the contender judges them: see `engine::contest`).
    pub(super) awaiting: Vec<(u64, Vec<u8>)>,
    pub(super) grants: Vec<(Vec<u8>, Grant)>,
    /// Without keyspace notifications: the last grant heard for another process's waiter
    /// (see `Snapshot::lapse`).
    pub(super) lapse: Option<(Instant, Duration)>,
    /// One contender's next attempt, to send when the key is freed (`early`).
    pub(super) early: Option<(u64, Early)>,
}

impl KeySub {
    /// A key nobody has subscribed to yet.
    pub(super) fn new() -> Self {
        KeySub {
            channels: Vec::new(),
            interest: 0,
            confirmed: false,
            confirmed_at: None,
            requested: false,
            unconfirmed: 0,
            away: false,
            moved: 0,
            idle_since: None,
            freed: 0,
            released: 0,
            taken: 0,
            opened: 0,
            after_del: false,
            last_contended: None,
            yield_until: None,
            listeners: Vec::new(),
            awaiting: Vec::new(),
            grants: Vec::new(),
            lapse: None,
            early: None,
        }
    }

    /// Listener `id` is gone (its watch dropped). The grants heard for the token it
    /// awaited go with it, unless another listener awaits the same token: a waiter that
    /// watches the key anew (its route changed) starts the new watch before it drops the
    /// old, and a grant heard in between is the new watch's.
    pub(super) fn forget(&mut self, id: u64) {
        self.listeners.retain(|(l, _, _)| *l != id);
        self.stop_awaiting(id);
        if self.early.as_ref().is_some_and(|(l, _)| *l == id) {
            self.early = None;
        }
    }

    /// Listener `id` awaits grants to `token` now, in place of any token it awaited before
    /// (retired: see `stop_awaiting`).
    pub(super) fn await_token(&mut self, id: u64, token: &[u8]) {
        if self.awaiting.iter().any(|(l, t)| *l == id && t == token) {
            return;
        }
        self.stop_awaiting(id);
        self.awaiting.push((id, token.to_vec()));
    }

    /// Listener `id` awaits no token: the grants heard for the one it awaited go with it,
    /// unless another listener awaits the same token (see `forget`).
    fn stop_awaiting(&mut self, id: u64) {
        if let Some(i) = self.awaiting.iter().position(|(l, _)| *l == id) {
            let (_, token) = self.awaiting.swap_remove(i);
            if !self.awaiting.iter().any(|(_, t)| *t == token) {
                self.grants.retain(|(t, _)| *t != token);
            }
        }
    }

    /// Keeps a grant to `token` for the listener that awaits it; `false` when none here
    /// does (another process's turn).
    fn hear_grant(&mut self, token: &[u8], grant: Grant) -> bool {
        if !self.awaiting.iter().any(|(_, t)| t == token) {
            return false;
        }
        self.grants.push((token.to_vec(), grant));
        true
    }

    pub(super) fn poke(&self) {
        for (_, _, tx) in &self.listeners {
            let _ = tx.try_send(());
        }
    }

    /// Pokes only the listeners that hear `hears`.
    fn poke_hearing(&self, hears: Hears) {
        for (_, _, tx) in self.listeners.iter().filter(|(_, h, _)| *h == hears) {
            let _ = tx.try_send(());
        }
    }

    /// The key may be free: takes the armed attempt, if any, to send (the contender waits
    /// for it while it is [`Early::Sending`]).
    pub(super) fn take_armed(&mut self, generation: u64) -> Option<(Armed, Snapshot)> {
        let at = Snapshot {
            confirmed: self.confirmed,
            generation,
            freed: self.freed,
            released: self.released,
            taken: self.taken,
            opened: self.opened,
            moved: self.moved,
            lapse: self.lapse,
        };
        match self.early.take() {
            Some((id, Early::Armed(armed))) => {
                self.early = Some((id, Early::Sending));
                Some((armed, at))
            }
            other => {
                self.early = other;
                None
            }
        }
    }
}

/// Every key with listeners (or lingering), behind one mutex.
pub(super) struct State {
    pub(super) keys: HashMap<Vec<u8>, KeySub>,
    pub(super) generation: u64,
    pub(super) next_listener: u64,
    /// Some key wants subscribing: the thread should look.
    pub(super) dirty: bool,
}

/// What the handle, the thread and the waiters of one node share.
pub(super) struct Shared {
    pub(super) state: Mutex<State>,
    /// The connection while waiters read it (see `seat`).
    pub(super) booth: Booth,
    /// Signalled when an early attempt is done (see [`Early::Sending`]).
    pub(super) sent: Condvar,
    pub(super) kick: Sender<()>,
    pub(super) shutdown: AtomicBool,
    /// The thread has ended for good: its node serves nothing, and nothing was asked of
    /// it (see [`close`](Self::close)). Set under the state lock.
    pub(super) closed: AtomicBool,
    /// Keyspace notifications are on and their channels may be subscribed.
    pub(super) keyspace: AtomicBool,
    /// The library's own channels may be subscribed (contention marks are heard).
    pub(super) own_channel: AtomicBool,
    /// The library's own channels are shard channels on this connection.
    pub(super) sharded: AtomicBool,
    /// May `CONFIG SET` the notification classes.
    pub(super) configure: bool,
    pub(super) node: NodeId,
    pub(super) db: i64,
    pub(super) prefix: String,
    pub(super) client_id: String,
    /// Times this subscriber's connection was re-established.
    pub(super) reconnects: AtomicU64,
    /// Whether its connection is up now.
    /// A connection was made once: the next one is a reconnect (counted), also when the
    /// thread was restarted after a panic in between.
    pub(super) connected_once: AtomicBool,
    pub(super) connected: AtomicBool,
}

impl Shared {
    /// The thread panicked: whatever it was doing is abandoned. A contender waiting for an
    /// early attempt in flight makes its own, and every waiter re-waits for the
    /// re-subscription and retries once, as after a lost connection.
    pub(super) fn crashed(&self) {
        // First the connection, which a waiter may be reading: once no waiter can, the
        // subscriptions are forgotten (a waiter reading on would subscribe again on it).
        let back = self.booth.reclaim();
        self.connected.store(false, Ordering::Relaxed);
        // An attempt being sent by the waiter that kept the connection (its reply is
        // slow) may have taken the lock: that waiter stores its outcome when the reply
        // comes, and its contender waits for it. Only an attempt nobody is sending any
        // more is forgotten.
        if back {
            let mut st = self.state.lock();
            for ks in st.keys.values_mut() {
                if matches!(ks.early, Some((_, Early::Sending))) {
                    ks.early = None;
                }
            }
        }
        self.sent.notify_all();
        self.lost_connection();
    }

    /// Ends the subscriber if no key is wanted (no waiter's watch, no holder's interest);
    /// whether it did. Its thread, which has no connection, ends next; the keys that
    /// linger are forgotten (nothing is subscribed without a connection). Under the state
    /// lock, as a registration: a key registered first keeps the subscriber, and one
    /// registered after is told at once that it moved away, so that its waiter follows it
    /// to a fresh subscriber (see `Subscriber::register`).
    pub(super) fn close(&self) -> bool {
        let mut st = self.state.lock();
        if st.keys.values().any(|k| k.interest > 0) {
            return false;
        }
        st.keys.clear();
        self.closed.store(true, Ordering::Release);
        true
    }

    /// Nothing is subscribed, lingering or asked for.
    pub(super) fn is_idle(&self) -> bool {
        self.state.lock().keys.is_empty()
    }

    pub(super) fn wants_connection(&self) -> bool {
        let st = self.state.lock();
        st.keys.values().any(|k| k.interest > 0)
    }

    /// Every subscription is gone with the connection: waiters must re-wait for the
    /// re-subscription and retry once.
    pub(super) fn lost_connection(&self) {
        let mut st = self.state.lock();
        st.generation += 1;
        st.dirty = true;
        st.keys.retain(|_, ks| ks.interest > 0);
        for ks in st.keys.values_mut() {
            ks.confirmed = false;
            ks.confirmed_at = None;
            ks.requested = false;
            ks.away = false;
            ks.after_del = false;
            ks.poke();
        }
    }

    /// Acts on what the server said on a connection of subscriptions' `generation`.
    /// Messages are events whichever connection brought them; what concerns the
    /// subscriptions themselves counts only from a connection of the current generation
    /// (see `turn::sync_subscriptions`). `bound`: a waiter reads, and its nap ends then
    /// (see `turn::Reading::Waiter`).
    pub(super) fn incoming(&self, incoming: Incoming<'_>, generation: u64, bound: Option<Instant>) {
        match incoming {
            Incoming::Message { channel, payload } => self.dispatch(channel, payload, bound),
            Incoming::Subscribed { channel } => self.confirmed(channel, generation),
            // Redis Cluster: the shard channel's slot is served elsewhere already.
            Incoming::Refused { channel, error } if error.redirect_node().is_some() => {
                self.dropped(channel, generation);
            }
            Incoming::Refused { channel, error } => {
                // The probe at connect found the channels of the prefix allowed: this one
                // alone is refused. Its waiters are woken by their timers.
                log::warn!(
                    "node {}: subscribe to {} refused: {error}",
                    self.node,
                    String::from_utf8_lossy(channel)
                );
                self.confirmed(channel, generation);
            }
            Incoming::Dropped { channel } => self.dropped(channel, generation),
        }
    }

    /// One channel of a key is confirmed; the key is, once all its channels are.
    fn confirmed(&self, channel: &[u8], generation: u64) {
        let Some(lock) = lock_of_keyspace_channel(channel).or_else(|| lock_of_channel(channel))
        else {
            return;
        };
        let mut st = self.state.lock();
        if st.generation != generation {
            return; // asked for on a connection the thread has left
        }
        let Some(ks) = st.keys.get_mut(lock) else {
            return;
        };
        if !ks.requested || ks.unconfirmed == 0 {
            return; // asked for on an earlier connection, or before the key moved away
        }
        ks.unconfirmed -= 1;
        if ks.unconfirmed == 0 {
            ks.confirmed = true;
            ks.confirmed_at = Some(Instant::now());
            ks.requested = false;
            ks.poke();
        }
    }

    /// The server dropped (or refused) the shard channel of a key: its slot is served by
    /// another node. Its waiters follow it (see the module's header).
    fn dropped(&self, channel: &[u8], generation: u64) {
        let Some(lock) = lock_of_channel(channel) else {
            return;
        };
        let mut st = self.state.lock();
        if st.generation != generation {
            return; // a connection the thread has left: its subscriptions are not ours
        }
        let Some(ks) = st.keys.get_mut(lock) else {
            return;
        };
        log::debug!(
            "node {}: the slot of {} moved away; its waiters follow it",
            self.node,
            String::from_utf8_lossy(lock)
        );
        ks.confirmed = false;
        ks.confirmed_at = None;
        ks.requested = false;
        ks.away = true;
        ks.moved += 1;
        // No longer subscribed on the server: nothing to unsubscribe later.
        ks.channels
            .retain(|(kind, _)| *kind != ChannelKind::Sharded);
        ks.poke();
    }

    fn dispatch(&self, channel: &[u8], payload: &[u8], bound: Option<Instant>) {
        let Some((lock, kind)) = classify(channel, payload, self.client_id.as_bytes()) else {
            return;
        };
        let mut st = self.state.lock();
        let generation = st.generation;
        let Some(ks) = st.keys.get_mut(lock) else {
            return;
        };
        let after_del = std::mem::replace(&mut ks.after_del, matches!(kind, Event::Deleted));
        match kind {
            Event::Deleted => ks.freed += 1,
            // Our release script deletes, then publishes `r`: the `del` came just before
            // (same connection, same order) and already woke the plain lock's waiters;
            // the `r` still wakes those of read-write locks and semaphores.
            Event::Released if after_del => {
                ks.released += 1;
                ks.poke_hearing(Hears::Releases);
                return;
            }
            Event::Released => {
                ks.freed += 1;
                ks.released += 1;
            }
            Event::Freed => ks.freed += 1,
            Event::Taken => {
                ks.taken += 1;
                // A new owner: every process still waiting fails against it and marks
                // again (Redis sends those marks after this event), so older marks say
                // nothing about who waits now. A process left alone stops yielding.
                ks.last_contended = None;
            }
            Event::Contended => ks.last_contended = Some(Instant::now()),
            // A latch opened: only its waiters care (a lock of the name is another key).
            Event::Opened => {
                ks.opened += 1;
                ks.poke_hearing(Hears::Zero);
                return;
            }
            Event::Granted => {
                let Some((token, grant)) = grant_of(payload) else {
                    return;
                };
                if !ks.hear_grant(token, grant) {
                    // Another process's turn. Without keyspace notifications, nothing is
                    // heard if that grant runs out untaken (its grantee died): its waiters
                    // look again when its lease ends.
                    if !self.keyspace.load(Ordering::Relaxed) {
                        ks.lapse = Some((Instant::now(), grant.lease));
                        ks.poke();
                    }
                    return;
                }
            }
            Event::Ignored => return,
        }
        let armed = match kind {
            Event::Deleted | Event::Released | Event::Freed => ks.take_armed(generation),
            _ => None,
        };
        let Some((armed, at)) = armed else {
            ks.poke();
            return;
        };
        drop(st);
        // Outside the state lock: a contender woken by something else may look meanwhile.
        // The attempt goes out before the poke: on a small machine the wake-up would
        // otherwise delay the write (measured: the other order is slower).
        let shot = armed.fire(at, bound);
        let mut st = self.state.lock();
        if let Some(ks) = st.keys.get_mut(lock) {
            if let Some((id, Early::Sending)) = ks.early {
                ks.early = shot.map(|s| (id, Early::Fired(s)));
            }
            ks.poke();
        }
        drop(st);
        self.sent.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grant() -> Grant {
        Grant {
            nonce: 7,
            fence: 42,
            lease: Duration::from_millis(500),
        }
    }

    #[test]
    fn a_grant_heard_while_a_waiter_watches_anew_is_kept_for_the_new_watch() {
        let mut ks = KeySub::new();
        ks.awaiting.push((1, b"t".to_vec()));
        assert!(ks.hear_grant(b"t", grant()));
        // The new watch awaits the same token before the old one is dropped.
        ks.awaiting.push((2, b"t".to_vec()));
        ks.forget(1);
        assert_eq!(ks.grants.len(), 1, "the grant went with the old watch");
        assert!(ks.hear_grant(b"t", grant()), "the new watch hears grants");
        ks.forget(2);
        assert!(ks.grants.is_empty(), "no listener left to take the grants");
    }

    /// A waiter whose token was retired (a hold it confirmed and had to give back) awaits
    /// a new one: the grants heard for the old token go, as they would with its watch, or
    /// they would stay as long as the key is watched.
    #[test]
    fn the_grants_of_a_token_replaced_go_with_it() {
        let mut ks = KeySub::new();
        ks.await_token(1, b"t1");
        assert!(ks.hear_grant(b"t1", grant()));
        ks.await_token(1, b"t1");
        assert_eq!(
            ks.grants.len(),
            1,
            "a grant to the token still awaited dropped"
        );
        ks.await_token(1, b"t2");
        assert!(ks.grants.is_empty(), "the old token's grant kept");
        assert!(ks.hear_grant(b"t2", grant()));
        assert_eq!(ks.grants.len(), 1);
    }

    #[test]
    fn a_grant_to_a_token_nobody_here_awaits_is_not_kept() {
        let mut ks = KeySub::new();
        ks.awaiting.push((1, b"t".to_vec()));
        assert!(!ks.hear_grant(b"other", grant()));
        assert!(ks.grants.is_empty());
    }
}
