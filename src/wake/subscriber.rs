//! One subscriber thread per node: listens for changes of the keys local threads wait for
//! and wakes exactly their waiters.
//!
//! # Why one channel per key, not a pattern
//!
//! The thread `SUBSCRIBE`s to the keyspace channel of each key it has waiters for (and to the
//! library's own channel of that key), instead of `PSUBSCRIBE`ing to a prefix pattern. With
//! 10,000 keys and 100 processes on one Redis, a pattern would deliver every event of every
//! key to all 100 processes (and Redis matches every published event against every
//! pattern): 100 messages per lock change, 99 of them thrown away. Per-key channels cost
//! one dictionary lookup per event and reach only the processes that wait for that key;
//! the price is one `SUBSCRIBE` when a process starts waiting for a key (amortised: a
//! subscription lingers for [`LINGER`] after its last waiter leaves) and Redis memory of one
//! entry per (key, waiting process).
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
//! The sync `redis` connection is `&mut` only, so this thread owns it and reads with a
//! short timeout ([`POLL`]) to take (un)subscribe requests between reads; events
//! themselves are read as soon as they arrive. One channel per (UN)SUBSCRIBE command:
//! redis-rs reads one confirmation per call.
//!
//! # What wakes whom
//!
//! `events` classifies each message; this thread counts it for the key's waiters and pokes
//! them.
//!
//! A contender may leave its next attempt with its watch (see `early`): on an event that
//! may free the key, this thread sends it and reads the reply before it wakes the
//! contender.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use parking_lot::{Condvar, Mutex};
use redis::{Msg, PubSub, RedisResult};

use crate::proto::keys::{Keys, channel_of_lock, keyspace_channel};
use crate::proto::node::NodeId;
use crate::proto::pool::Pool;
use crate::stats::Counters;
use crate::wake::early::{Armed, Early, Shot};
use crate::wake::events::{Event, Snapshot, classify, grant_of};

/// How long a subscription outlives its last waiter, so that a key locked again and again
/// does not pay a `SUBSCRIBE` each time.
pub(crate) const LINGER: Duration = Duration::from_secs(2);
/// Read timeout while subscriptions are active: the longest a (un)subscribe request waits
/// for the thread. It does not delay events.
const POLL: Duration = Duration::from_millis(5);
/// Longest sleep while nothing is subscribed.
const IDLE: Duration = Duration::from_millis(500);
/// A `PING` on the subscriber connection after this long without traffic, so that a dead
/// connection is noticed even when no event is due.
const HEALTH_CHECK: Duration = Duration::from_secs(15);

struct KeySub {
    /// What was subscribed for this key on the current connection (depends on whether the
    /// node has keyspace notifications, which can change at a reconnect).
    channels: Vec<Vec<u8>>,
    interest: usize,
    confirmed: bool,
    /// When the subscription was confirmed: marks of remote contention published before
    /// then were not heard.
    confirmed_at: Option<Instant>,
    requested: bool,
    idle_since: Option<Instant>,
    freed: u64,
    taken: u64,
    /// Keyspace `del` events not yet followed by the library's `r` for the same release.
    unpaired_dels: u32,
    last_contended: Option<Instant>,
    /// This process released the key while others waited: its next contender waits for
    /// them (or this instant) before its first attempt.
    yield_until: Option<(Instant, u64)>,
    listeners: Vec<(u64, Sender<()>)>,
    /// Fair queue: the contender token each listener waits to be granted, and the grants
    /// heard for them (fence, when heard).
    awaiting: Vec<(u64, Vec<u8>)>,
    grants: Vec<(Vec<u8>, u64, Instant)>,
    /// One contender's next attempt, to send when the key is freed (`early`).
    early: Option<(u64, Early)>,
}

impl KeySub {
    fn poke(&self) {
        for (_, tx) in &self.listeners {
            let _ = tx.try_send(());
        }
    }

    /// The key may be free: takes the armed attempt, if any, to send (the contender waits
    /// for it while it is [`Early::Sending`]).
    fn take_armed(&mut self, generation: u64) -> Option<(Armed, Snapshot)> {
        let at = Snapshot {
            confirmed: self.confirmed,
            generation,
            freed: self.freed,
            taken: self.taken,
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

struct State {
    keys: HashMap<Vec<u8>, KeySub>,
    generation: u64,
    next_listener: u64,
    /// Some key wants subscribing: the thread should look.
    dirty: bool,
}

pub(crate) struct Shared {
    state: Mutex<State>,
    /// Signalled when an early attempt is done (see [`Early::Sending`]).
    sent: Condvar,
    kick: Sender<()>,
    shutdown: AtomicBool,
    /// Keyspace notifications are on and their channels may be subscribed.
    keyspace: AtomicBool,
    /// The library's own channels may be subscribed (contention marks are heard).
    own_channel: AtomicBool,
    /// May `CONFIG SET` the notification classes.
    configure: bool,
    node: NodeId,
    db: i64,
    prefix: String,
    client_id: String,
}

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

/// How the thread opens its connection: to wherever the node's pool points now (it moves
/// on a Sentinel failover), with the pool's timeouts.
#[derive(Clone)]
pub(crate) struct Connector {
    pub pool: Arc<Pool>,
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
            kick,
            shutdown: AtomicBool::new(false),
            keyspace: AtomicBool::new(keyspace),
            own_channel: AtomicBool::new(true),
            configure,
            node,
            db,
            prefix,
            client_id,
        });
        let thread_shared = shared.clone();
        let thread = std::thread::Builder::new()
            .name("redbaton-sub".to_owned())
            .spawn(move || {
                let sh = &thread_shared;
                crate::supervise::supervise(
                    "subscriber",
                    || {
                        run(
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

    /// An [`Interest`] that also pokes `poke` at every change of the key.
    pub fn watch(&self, keys: &Keys, poke: Sender<()>) -> Watch {
        let id = self.register(keys, Some(poke));
        Watch(Interest {
            shared: self.shared.clone(),
            lock: keys.lock().to_vec(),
            listener: Some(id),
        })
    }

    fn register(&self, keys: &Keys, poke: Option<Sender<()>>) -> u64 {
        let mut st = self.shared.state.lock();
        let id = st.next_listener;
        st.next_listener += 1;
        let ks = st
            .keys
            .entry(keys.lock().to_vec())
            .or_insert_with(|| KeySub {
                channels: Vec::new(),
                interest: 0,
                confirmed: false,
                confirmed_at: None,
                requested: false,
                idle_since: None,
                freed: 0,
                taken: 0,
                unpaired_dels: 0,
                last_contended: None,
                yield_until: None,
                listeners: Vec::new(),
                awaiting: Vec::new(),
                grants: Vec::new(),
                early: None,
            });
        ks.interest += 1;
        ks.idle_since = None;
        if let Some(tx) = poke {
            ks.listeners.push((id, tx));
        }
        let needs_subscribe = !ks.confirmed && !ks.requested;
        if needs_subscribe {
            st.dirty = true;
            drop(st);
            let _ = self.shared.kick.try_send(());
        }
        id
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

    /// Whether marks are heard at all on this node (an ACL may refuse our channels).
    pub fn hears_marks(&self) -> bool {
        self.shared.own_channel.load(Ordering::Relaxed)
    }

    /// Whether this node's subscriptions can work at all (an ACL may refuse every channel
    /// we need): waiters then do not wait for confirmations that cannot come.
    pub fn usable(&self) -> bool {
        self.shared.keyspace.load(Ordering::Relaxed)
            || self.shared.own_channel.load(Ordering::Relaxed)
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
                ks.listeners.retain(|(l, _)| *l != id);
                if let Some(i) = ks.awaiting.iter().position(|(l, _)| *l == id) {
                    let (_, token) = ks.awaiting.swap_remove(i);
                    ks.grants.retain(|(t, ..)| *t != token);
                }
                if ks.early.as_ref().is_some_and(|(l, _)| *l == id) {
                    ks.early = None;
                }
            }
            if ks.interest == 0 {
                ks.idle_since = Some(Instant::now());
            }
        }
    }
}

/// A waiter's registration: keeps the key subscribed and pokes the waiter on changes.
pub(crate) struct Watch(Interest);

impl Watch {
    /// Leaves `armed` to be sent the moment the key may be free; `false` when another
    /// contender of this process has armed it already.
    pub fn arm(&self, armed: Armed) -> bool {
        let mut st = self.0.shared.state.lock();
        let (Some(ks), Some(id)) = (st.keys.get_mut(&self.0.lock), self.0.listener) else {
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
        let shared = &self.0.shared;
        let mut st = shared.state.lock();
        loop {
            let ks = st.keys.get_mut(&self.0.lock)?;
            if ks
                .early
                .as_ref()
                .is_none_or(|(l, _)| Some(*l) != self.0.listener)
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

    /// Fair queue: this waiter's contender token, so that a grant to it is kept for it.
    pub fn expect_grant(&self, token: &str) {
        let mut st = self.0.shared.state.lock();
        let (Some(ks), Some(id)) = (st.keys.get_mut(&self.0.lock), self.0.listener) else {
            return;
        };
        ks.awaiting.retain(|(l, _)| *l != id);
        ks.awaiting.push((id, token.as_bytes().to_vec()));
    }

    /// Whether a grant to this waiter's token was heard.
    pub fn has_grant(&self) -> bool {
        let st = self.0.shared.state.lock();
        let Some(ks) = st.keys.get(&self.0.lock) else {
            return false;
        };
        ks.awaiting
            .iter()
            .filter(|(l, _)| Some(*l) == self.0.listener)
            .any(|(_, t)| ks.grants.iter().any(|(g, ..)| g == t))
    }

    /// Takes a grant to this waiter's token: its fence and when it was heard.
    pub fn take_grant(&self) -> Option<(u64, Instant)> {
        let mut st = self.0.shared.state.lock();
        let ks = st.keys.get_mut(&self.0.lock)?;
        let (_, token) = ks
            .awaiting
            .iter()
            .find(|(l, _)| Some(*l) == self.0.listener)?;
        let i = ks.grants.iter().position(|(g, ..)| g == token)?;
        let (_, fence, at) = ks.grants.swap_remove(i);
        Some((fence, at))
    }

    pub fn snapshot(&self) -> Snapshot {
        let st = self.0.shared.state.lock();
        let ks = st.keys.get(&self.0.lock);
        Snapshot {
            confirmed: ks.is_some_and(|k| k.confirmed),
            generation: st.generation,
            freed: ks.map_or(0, |k| k.freed),
            taken: ks.map_or(0, |k| k.taken),
        }
    }
}

fn run(shared: Arc<Shared>, kicked: Receiver<()>, connector: Connector, counters: Arc<Counters>) {
    let node = &shared.node;
    let mut backoff = Duration::from_millis(50);
    let mut connected_once = false;
    while !shared.shutdown.load(Ordering::Relaxed) {
        if !shared.wants_connection() {
            let _ = kicked.recv_timeout(IDLE);
            continue;
        }
        let (connect_timeout, read_timeout, write_timeout) = connector.pool.timeouts();
        let epoch = connector.pool.epoch();
        let conn = crate::proto::pool::open_connection(
            &connector.pool.client(),
            connect_timeout,
            read_timeout,
            write_timeout,
            "redbaton:sub",
        );
        let mut conn = match conn.and_then(|mut c| prepare(&shared, &mut c, &counters).map(|()| c))
        {
            Ok(c) => c,
            Err(e) => {
                log::debug!("subscriber {node}: connect failed: {e}; retrying in {backoff:?}");
                let jitter = rand::random_range(0..=backoff.as_millis() as u64 / 2);
                let _ = kicked.recv_timeout(backoff + Duration::from_millis(jitter));
                backoff = (backoff * 2).min(Duration::from_secs(2));
                continue;
            }
        };
        if connected_once {
            Counters::inc(&counters.reconnects);
            log::info!("subscriber {node}: reconnected; waiters retry once");
        }
        connected_once = true;
        backoff = Duration::from_millis(50);
        let moved = || connector.pool.epoch() != epoch;
        let err = serve(
            &shared,
            &kicked,
            conn.as_pubsub(),
            read_timeout,
            &counters,
            &moved,
        );
        shared.lost_connection();
        match err {
            Ok(()) => break,
            Err(e) => log::warn!("subscriber {node}: connection lost: {e}"),
        }
    }
}

/// Before subscribing on a new connection: re-check the node's notifications (a restart
/// forgets a `CONFIG SET`) and which channels an ACL lets us subscribe to. Doing this on a
/// plain connection matters: redis-rs's `PubSub::subscribe` swallows an error reply, so a
/// refused SUBSCRIBE would look confirmed.
fn prepare(shared: &Shared, conn: &mut redis::Connection, counters: &Counters) -> RedisResult<()> {
    Counters::add(&counters.commands, 2);
    let mode = crate::wake::notify::ensure(conn, shared.configure)?;
    let probe_lock = format!("{}{{redbaton-probe}}", shared.prefix).into_bytes();
    let keyspace = matches!(mode, crate::wake::notify::Mode::Keyspace)
        && probe(conn, &keyspace_channel(shared.db, &probe_lock), counters)?;
    let own = probe(conn, &channel_of_lock(&probe_lock), counters)?;
    let had_keyspace = shared.keyspace.swap(keyspace, Ordering::Relaxed);
    shared.own_channel.store(own, Ordering::Relaxed);
    let node = &shared.node;
    if had_keyspace && !keyspace {
        let why = match mode {
            crate::wake::notify::Mode::Fallback(why) => why,
            crate::wake::notify::Mode::Keyspace => {
                "SUBSCRIBE to keyspace channels refused".to_owned()
            }
        };
        log::warn!(
            "node {node}: keyspace notifications unavailable: {why}; waiters are woken by the library's release channel instead"
        );
    }
    if !own {
        log::warn!(
            "node {node}: SUBSCRIBE to the library's channels refused (ACL?): waiters are woken by the lease timer and re-checks, and the fairness budget always applies"
        );
    }
    Ok(())
}

/// Whether SUBSCRIBE to `channel` is allowed; unsubscribes at once.
fn probe(conn: &mut redis::Connection, channel: &[u8], counters: &Counters) -> RedisResult<bool> {
    Counters::inc(&counters.commands);
    match redis::cmd("SUBSCRIBE")
        .arg(channel)
        .query::<redis::Value>(conn)
    {
        Ok(_) => {
            Counters::inc(&counters.commands);
            redis::cmd("UNSUBSCRIBE")
                .arg(channel)
                .query::<redis::Value>(conn)?;
            Ok(true)
        }
        Err(e) if crate::error::is_network_error(&e) => Err(e),
        Err(_) => Ok(false),
    }
}

/// Serves one connection until it fails (`Err`) or the client shuts down (`Ok`).
fn serve(
    shared: &Shared,
    kicked: &Receiver<()>,
    mut ps: PubSub<'_>,
    read_timeout: Duration,
    counters: &Counters,
    moved: &dyn Fn() -> bool,
) -> RedisResult<()> {
    let mut last_traffic = Instant::now();
    ps.set_read_timeout(Some(POLL))?;
    loop {
        if shared.shutdown.load(Ordering::Relaxed) {
            return Ok(());
        }
        if moved() {
            // The node's address changed (a failover): events now come from the new
            // server. Reconnect there, re-subscribe, and have every waiter retry once.
            return Err(redis::RedisError::from(std::io::Error::new(
                std::io::ErrorKind::ConnectionReset,
                "the node moved to a new address",
            )));
        }
        crate::fault::hit(&shared.prefix, crate::fault::Point::Subscriber);
        let active = sync_subscriptions(shared, &mut ps, read_timeout, counters)?;
        if !active {
            // Nothing subscribed: sleep on the kick channel rather than the socket.
            let _ = kicked.recv_timeout(IDLE);
        } else {
            match ps.get_message() {
                Ok(msg) => {
                    last_traffic = Instant::now();
                    shared.dispatch(&msg);
                    continue;
                }
                Err(e) if e.is_timeout() => {}
                Err(e) => return Err(e),
            }
        }
        if last_traffic.elapsed() >= HEALTH_CHECK {
            ps.set_read_timeout(Some(read_timeout))?;
            Counters::inc(&counters.commands);
            ps.ping::<redis::Value>()?;
            ps.set_read_timeout(Some(POLL))?;
            last_traffic = Instant::now();
        }
    }
}

/// Sends the (un)subscribes the state asks for. Returns whether any key is subscribed.
fn sync_subscriptions(
    shared: &Shared,
    ps: &mut PubSub<'_>,
    read_timeout: Duration,
    counters: &Counters,
) -> RedisResult<bool> {
    let (subscribe, unsubscribe, generation, active) = {
        let mut st = shared.state.lock();
        let now = Instant::now();
        let mut subscribe = Vec::new();
        let mut unsubscribe = Vec::new();
        if st.dirty {
            st.dirty = false;
            let keyspace = shared.keyspace.load(Ordering::Relaxed);
            let own = shared.own_channel.load(Ordering::Relaxed);
            let usable = keyspace || own;
            for (lock, ks) in st.keys.iter_mut() {
                if usable && ks.interest > 0 && !ks.confirmed && !ks.requested {
                    ks.requested = true;
                    ks.channels.clear();
                    if own {
                        ks.channels.push(channel_of_lock(lock));
                    }
                    if keyspace {
                        ks.channels.push(keyspace_channel(shared.db, lock));
                    }
                    subscribe.push((lock.clone(), ks.channels.clone()));
                }
            }
        }
        st.keys.retain(|_, ks| {
            let expired = ks.interest == 0 && ks.idle_since.is_some_and(|t| now - t >= LINGER);
            if expired && (ks.confirmed || ks.requested) {
                unsubscribe.extend(ks.channels.iter().cloned());
            }
            !expired
        });
        let active = !st.keys.is_empty();
        (subscribe, unsubscribe, st.generation, active)
    };
    if subscribe.is_empty() && unsubscribe.is_empty() {
        return Ok(active);
    }
    // A confirmation may take longer than the poll interval on a busy server.
    ps.set_read_timeout(Some(read_timeout))?;
    // One channel per command: redis-rs reads one confirmation per call, and a multi-channel
    // (UN)SUBSCRIBE leaves the others in the stream, where a later call would take one for
    // its own confirmation before Redis has run it. That would break the invariant.
    for channel in &unsubscribe {
        Counters::inc(&counters.commands);
        ps.unsubscribe(channel)?;
    }
    for (lock, channels) in &subscribe {
        for channel in channels {
            Counters::inc(&counters.commands);
            ps.subscribe(channel)?;
        }
        let mut st = shared.state.lock();
        if st.generation != generation {
            continue;
        }
        if let Some(ks) = st.keys.get_mut(lock) {
            ks.confirmed = true;
            ks.confirmed_at = Some(Instant::now());
            ks.requested = false;
            ks.poke();
        }
    }
    ps.set_read_timeout(Some(POLL))?;
    Ok(true)
}

impl Shared {
    /// The thread panicked: whatever it was doing is abandoned. A contender waiting for an
    /// early attempt in flight makes its own, and every waiter re-waits for the
    /// re-subscription and retries once, as after a lost connection.
    fn crashed(&self) {
        let mut st = self.state.lock();
        for ks in st.keys.values_mut() {
            if matches!(ks.early, Some((_, Early::Sending))) {
                ks.early = None;
            }
        }
        drop(st);
        self.sent.notify_all();
        self.lost_connection();
    }

    fn wants_connection(&self) -> bool {
        let st = self.state.lock();
        st.keys.values().any(|k| k.interest > 0)
    }

    /// Every subscription is gone with the connection: waiters must re-wait for the
    /// re-subscription and retry once.
    fn lost_connection(&self) {
        let mut st = self.state.lock();
        st.generation += 1;
        st.dirty = true;
        st.keys.retain(|_, ks| ks.interest > 0);
        for ks in st.keys.values_mut() {
            ks.confirmed = false;
            ks.confirmed_at = None;
            ks.requested = false;
            ks.poke();
        }
    }

    fn dispatch(&self, msg: &Msg) {
        // Names may be binary: read the channel as bytes, not as `&str`.
        let Ok(channel) = msg.get_channel::<Vec<u8>>() else {
            return;
        };
        let channel = channel.as_slice();
        let payload: &[u8] = msg.get_payload_bytes();
        let Some((lock, kind)) = classify(channel, payload, self.client_id.as_bytes()) else {
            return;
        };
        let mut st = self.state.lock();
        let generation = st.generation;
        let Some(ks) = st.keys.get_mut(lock) else {
            return;
        };
        match kind {
            Event::Deleted => {
                ks.freed += 1;
                ks.unpaired_dels += 1;
            }
            // Our release script deletes, then publishes `r`: the `del` came first (same
            // connection, same order) and already woke the waiters.
            Event::Released if ks.unpaired_dels > 0 => {
                ks.unpaired_dels -= 1;
                return;
            }
            Event::Released | Event::Freed => ks.freed += 1,
            Event::Taken => {
                ks.taken += 1;
                // A new owner: every process still waiting fails against it and marks
                // again (Redis sends those marks after this event), so older marks say
                // nothing about who waits now. A process left alone stops yielding.
                ks.last_contended = None;
            }
            Event::Contended => ks.last_contended = Some(Instant::now()),
            Event::Granted => {
                let Some((token, fence)) = grant_of(payload) else {
                    return;
                };
                if !ks.awaiting.iter().any(|(_, t)| t == token) {
                    return; // another process's turn
                }
                ks.grants.push((token.to_vec(), fence, Instant::now()));
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
        let shot = armed.fire(at);
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
