//! One subscriber thread per node: listens for changes of the keys local threads wait for
//! and wakes exactly their waiters.
//!
//! # Why one channel per key, not a pattern
//!
//! The thread subscribes to the keyspace channel of each key it has waiters for (and to the
//! library's own channel of that key, a shard channel where the node has them), instead
//! of `PSUBSCRIBE`ing to a prefix pattern. With 10,000 keys and 100 processes on one
//! Redis, a pattern would deliver every event of every key to all 100 processes (and Redis
//! matches every published event against every pattern): 100 messages per lock change, 99
//! of them thrown away. Per-key channels cost one dictionary lookup per event and reach
//! only the processes that wait for that key; the price is one (S)SUBSCRIBE per channel
//! when a process starts waiting for a key (amortised: a subscription lingers for 2 s
//! after its last waiter leaves) and Redis memory of one entry per (key, waiting process).
//!
//! # The invariant
//!
//! A waiter registers a [`Watch`] and waits until Redis confirms the subscription (the
//! contender's `confirm`) *before* the acquire attempt whose failure makes it wait. It
//! reads the key's event counters before that attempt and, after it, sleeps only while they
//! are unchanged: an event between the attempt and the sleep is never lost. When the
//! connection drops, the generation changes, every waiter is poked, re-waits for the
//! re-subscription and retries once (events sent while it was away are gone).
//!
//! This module is the handle: starting the thread, and the registrations of holders
//! ([`Interest`]) and waiters ([`Watch`]). The thread's loop is in `listen`, its connection
//! in `stream`, and what they share with the waiters in `state` (which also says what a
//! moved Cluster slot does).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;
use parking_lot::{Condvar, Mutex};

use crate::proto::keys::Keys;
use crate::proto::node::NodeId;
use crate::stats::Counters;
use crate::wake::candidacy::Candidacy;
use crate::wake::early::{Armed, Early, Shot};
use crate::wake::events::{Grant, Hears, Snapshot};
pub(crate) use crate::wake::listen::Connector;
use crate::wake::seat::Booth;
use crate::wake::state::{KeySub, Shared, State};

/// How a subscriber starts.
pub(crate) struct Setup {
    pub node: NodeId,
    pub db: i64,
    /// What the build-time check found (it warned if notifications are unavailable).
    pub keyspace: bool,
    pub configure: bool,
    pub prefix: String,
    pub client_id: String,
    pub connector: Connector,
}

/// The subscriber of one node: the handle callers use, and the thread.
pub(crate) struct Subscriber {
    shared: Arc<Shared>,
    thread: crate::worker::Thread,
}

impl Subscriber {
    pub fn start(setup: Setup, counters: Arc<Counters>) -> std::io::Result<Self> {
        let Setup {
            node,
            db,
            keyspace,
            configure,
            prefix,
            client_id,
            connector,
        } = setup;
        let (kick, kicked) = crossbeam_channel::bounded(1);
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                keys: HashMap::new(),
                generation: 0,
                next_listener: 0,
                dirty: false,
            }),
            sent: Condvar::new(),
            booth: Booth::default(),
            kick,
            shutdown: AtomicBool::new(false),
            closed: AtomicBool::new(false),
            keyspace: AtomicBool::new(keyspace),
            own_channel: AtomicBool::new(true),
            sharded: AtomicBool::new(false),
            configure,
            node,
            db,
            prefix,
            client_id,
            reconnects: AtomicU64::new(0),
            connected: AtomicBool::new(false),
            connected_once: AtomicBool::new(false),
        });
        let thread_shared = shared.clone();
        let thread = std::thread::Builder::new()
            .name("redbaton-sub".to_owned())
            .spawn(move || {
                let sh = &thread_shared;
                crate::supervise::supervise(
                    "subscriber",
                    || {
                        crate::wake::listen::run(
                            sh.clone(),
                            kicked.clone(),
                            connector.clone(),
                            counters.clone(),
                        )
                    },
                    |_| {
                        sh.crashed();
                        true
                    },
                    |backoff| crate::supervise::pause(backoff, &sh.shutdown, &sh.kick, &kicked),
                );
            })?;
        Ok(Subscriber {
            shared,
            thread: crate::worker::Thread::new(thread),
        })
    }

    /// The node this subscriber listens to.
    pub fn node(&self) -> &NodeId {
        &self.shared.node
    }

    /// Whether its thread has ended because its node serves nothing (a Redis Cluster
    /// master removed or demoted) and nothing waited there: the node's next waiter needs
    /// a fresh subscriber (see `Shared::close`).
    pub fn closed(&self) -> bool {
        self.shared.closed.load(Ordering::Acquire)
    }

    /// Times its connection was re-established, and whether it is up now.
    pub fn connection(&self) -> (u64, bool) {
        (
            self.shared.reconnects.load(Ordering::Relaxed),
            self.shared.connected.load(Ordering::Relaxed),
        )
    }

    /// Stops the thread and waits for it until `deadline`; `false` if it is still running.
    pub fn shutdown(&self, deadline: Instant) -> bool {
        self.shared.shutdown.store(true, Ordering::Relaxed);
        let _ = self.shared.kick.try_send(());
        self.thread.join_until(deadline)
    }

    /// Keeps `keys` subscribed (for the holder's process to hear of remote contention);
    /// dropping the handle lets the subscription linger, then go.
    pub fn interest(&self, keys: &Keys) -> Interest {
        self.register(keys, None);
        Interest {
            shared: self.shared.clone(),
            lock: keys.lock().to_vec(),
            listener: None,
        }
    }

    /// An [`Interest`] that also pokes `poke` at every change of the key that a listener
    /// which `hears` so cares about.
    pub fn watch(&self, keys: &Keys, hears: Hears, poke: Sender<()>) -> Watch {
        let (id, moved) = self.register(keys, Some((hears, poke)));
        Watch {
            interest: Interest {
                shared: self.shared.clone(),
                lock: keys.lock().to_vec(),
                listener: Some(id),
            },
            moved,
        }
    }

    /// Registers a listener of `keys`: its id, and how often the key had moved away.
    fn register(&self, keys: &Keys, poke: Option<(Hears, Sender<()>)>) -> (u64, u64) {
        let mut st = self.shared.state.lock();
        let id = st.next_listener;
        st.next_listener += 1;
        let ks = st
            .keys
            .entry(keys.lock().to_vec())
            .or_insert_with(KeySub::new);
        ks.interest += 1;
        ks.idle_since = None;
        // The route names this node for the key (again): try here, whatever happened
        // before; a refusal comes back as another move.
        ks.away = false;
        let moved = ks.moved;
        if let Some((hears, tx)) = poke {
            ks.listeners.push((id, hears, tx));
        }
        if self.shared.closed.load(Ordering::Acquire) {
            // The thread has ended (its node serves nothing) since the caller took this
            // subscriber: nothing will subscribe the key here. As if its slot had moved
            // away at once, its waiter follows it, to a fresh subscriber.
            ks.moved += 1;
            return (id, moved);
        }
        let needs_subscribe = !ks.confirmed && !ks.requested;
        if needs_subscribe {
            st.dirty = true;
            drop(st);
            let _ = self.shared.kick.try_send(());
        }
        (id, moved)
    }

    /// Whether another process failed to get `keys` within the last `window`, as heard live.
    pub fn heard_mark_within(&self, keys: &Keys, window: Duration) -> bool {
        let st = self.shared.state.lock();
        st.keys
            .get(keys.lock())
            .and_then(|k| k.last_contended)
            .is_some_and(|t| t.elapsed() < window)
    }

    /// When the key's current subscription was confirmed (`None`: it is not).
    pub fn confirmed_at(&self, keys: &Keys) -> Option<Instant> {
        let st = self.shared.state.lock();
        st.keys
            .get(keys.lock())
            .filter(|k| k.confirmed)
            .and_then(|k| k.confirmed_at)
    }

    /// Whether marks are heard at all on this node (an ACL may refuse our channels; a
    /// subscriber that ended hears nothing).
    pub fn hears_marks(&self) -> bool {
        !self.closed() && self.shared.own_channel.load(Ordering::Relaxed)
    }

    /// Whether this node's subscriptions can work at all (an ACL may refuse every channel
    /// we need, or the subscriber ended): waiters then do not wait for confirmations that
    /// cannot come.
    pub fn usable(&self) -> bool {
        !self.closed()
            && (self.shared.keyspace.load(Ordering::Relaxed)
                || self.shared.own_channel.load(Ordering::Relaxed))
    }

    /// Asks this process's next contender for `keys` to let others go first until `until`
    /// (kept only while the key is subscribed: without events it could not be woken early).
    pub fn ask_to_yield(&self, keys: &Keys, until: Instant) {
        let mut st = self.shared.state.lock();
        if let Some(k) = st.keys.get_mut(keys.lock())
            && k.confirmed
        {
            k.yield_until = Some((until, k.taken));
        }
    }

    /// Whether a contender for `keys` should yield first (and clears the request): until
    /// when, and the count of others' acquisitions (`set` events) when it was asked, so
    /// that one which came in between counts.
    pub fn should_yield(&self, keys: &Keys) -> Option<(Instant, u64)> {
        let mut st = self.shared.state.lock();
        st.keys
            .get_mut(keys.lock())
            .and_then(|k| k.yield_until.take())
            .filter(|&(until, _)| Instant::now() < until)
    }
}

impl Drop for Subscriber {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::Relaxed);
        let _ = self.shared.kick.try_send(());
        self.thread.join_now();
    }
}

/// Keeps a key subscribed while alive.
pub(crate) struct Interest {
    shared: Arc<Shared>,
    lock: Vec<u8>,
    listener: Option<u64>,
}

impl Drop for Interest {
    fn drop(&mut self) {
        let mut st = self.shared.state.lock();
        if let Some(ks) = st.keys.get_mut(&self.lock) {
            ks.interest -= 1;
            if let Some(id) = self.listener {
                ks.forget(id);
            }
            if ks.interest == 0 {
                ks.idle_since = Some(Instant::now());
            }
        }
    }
}

/// A waiter's registration: keeps the key subscribed and pokes the waiter on changes.
pub(crate) struct Watch {
    interest: Interest,
    /// The key's `moved` count when the watch began.
    moved: u64,
}

impl Watch {
    /// Leaves `armed` to be sent the moment the key may be free; `false` when another
    /// contender of this process has armed it already.
    pub fn arm(&self, armed: Armed) -> bool {
        let mut st = self.interest.shared.state.lock();
        let (Some(ks), Some(id)) = (st.keys.get_mut(&self.interest.lock), self.interest.listener)
        else {
            return false;
        };
        if ks.early.is_some() {
            return false;
        }
        ks.early = Some((id, Early::Armed(armed)));
        true
    }

    /// Takes back what [`arm`](Self::arm) left: the attempt, if the subscriber made it.
    /// A contender woken by something else while the subscriber is making it waits for it
    /// (at most a round trip: the connection's timeouts bound it).
    pub fn take_early(&self) -> Option<Shot> {
        let shared = &self.interest.shared;
        let mut st = shared.state.lock();
        loop {
            let ks = st.keys.get_mut(&self.interest.lock)?;
            if ks
                .early
                .as_ref()
                .is_none_or(|(l, _)| Some(*l) != self.interest.listener)
            {
                return None;
            }
            match ks.early.take() {
                Some((_, Early::Fired(shot))) => return Some(shot),
                Some((id, Early::Sending)) => {
                    ks.early = Some((id, Early::Sending));
                    shared.sent.wait_for(&mut st, Duration::from_millis(100));
                }
                // Armed and not sent: disarmed now.
                _ => return None,
            }
        }
    }

    /// Offers to read this node's subscriber connection while the waiter sleeps (see
    /// `seat`): `poke` tells it when it is its turn.
    pub fn candidacy(&self, poke: Sender<()>) -> Candidacy {
        Candidacy::stand(self.interest.shared.clone(), poke)
    }

    /// Fair queue: this waiter's contender token, so that a grant to it is kept for it.
    pub fn expect_grant(&self, token: &str) {
        let mut st = self.interest.shared.state.lock();
        let (Some(ks), Some(id)) = (st.keys.get_mut(&self.interest.lock), self.interest.listener)
        else {
            return;
        };
        ks.await_token(id, token.as_bytes());
    }

    /// Whether a grant to this waiter's token was heard.
    pub fn has_grant(&self) -> bool {
        let st = self.interest.shared.state.lock();
        let Some(ks) = st.keys.get(&self.interest.lock) else {
            return false;
        };
        ks.awaiting
            .iter()
            .filter(|(l, _)| Some(*l) == self.interest.listener)
            .any(|(_, t)| ks.grants.iter().any(|(g, _)| g == t))
    }

    /// Takes the grants heard for this waiter's token, in the order heard.
    pub fn take_grants(&self, into: &mut Vec<Grant>) {
        let mut st = self.interest.shared.state.lock();
        let Some(ks) = st.keys.get_mut(&self.interest.lock) else {
            return;
        };
        let Some((_, token)) = ks
            .awaiting
            .iter()
            .find(|(l, _)| Some(*l) == self.interest.listener)
        else {
            return;
        };
        let token = token.clone();
        ks.grants.retain(|(t, g)| {
            let ours = *t == token;
            if ours {
                into.push(*g);
            }
            !ours
        });
    }

    pub fn snapshot(&self) -> Snapshot {
        let st = self.interest.shared.state.lock();
        let ks = st.keys.get(&self.interest.lock);
        Snapshot {
            confirmed: ks.is_some_and(|k| k.confirmed),
            generation: st.generation,
            freed: ks.map_or(0, |k| k.freed),
            released: ks.map_or(0, |k| k.released),
            taken: ks.map_or(0, |k| k.taken),
            opened: ks.map_or(0, |k| k.opened),
            moved: ks.map_or(self.moved, |k| k.moved),
            lapse: ks.and_then(|k| k.lapse),
        }
    }

    /// Whether the key's slot moved away from this node since the watch began: it cannot
    /// be confirmed here, and its events now happen on another node.
    pub fn moved(&self) -> bool {
        self.snapshot().moved != self.moved
    }

    /// Whether a grant to the waiter can be heard on this node: an ACL may refuse the
    /// library's channels while it allows the keyspace channels.
    pub fn hears_grants(&self) -> bool {
        self.interest.shared.own_channel.load(Ordering::Relaxed)
    }
}
