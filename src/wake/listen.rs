//! The subscriber thread's loop: connect, check what the node allows, (un)subscribe what
//! the waiters ask for, read events, reconnect when the connection fails.
//!
//! The sync `redis` connection is `&mut` only, so this thread owns it and reads with a
//! short timeout ([`POLL`]) to take (un)subscribe requests between reads; events
//! themselves are read as soon as they arrive. The (un)subscribes of one pass are sent
//! together, one channel per command, and the pass reads until the server answered them
//! all; a key counts as subscribed once every one of its channels is confirmed.
//!
//! Each key has its keyspace channel (classic: Redis sends keyspace events to the node's
//! own subscribers only) and the library's channel, sharded (`SSUBSCRIBE`) where the node
//! has sharded pub/sub, as its publishers decide too (`proto::sharded`), classic
//! otherwise.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crossbeam_channel::Receiver;
use redis::RedisResult;

use crate::proto::keys::{channel_of_lock, keyspace_channel, probe_lock};
use crate::proto::pool::Pool;
use crate::proto::sharded::ChannelKind;
use crate::stats::Counters;
use crate::wake::notify::{self, Mode};
use crate::wake::state::{LINGER, Shared};
use crate::wake::stream::{Incoming, Stream};

/// Read timeout while subscriptions are active: the longest a (un)subscribe request waits
/// for the thread. It does not delay events.
const POLL: Duration = Duration::from_millis(5);
/// Longest sleep while nothing is subscribed.
const IDLE: Duration = Duration::from_millis(500);
/// A `PING` on the subscriber connection after this long without traffic, so that a dead
/// connection is noticed even when no event is due.
const HEALTH_CHECK: Duration = Duration::from_secs(15);

/// How the thread opens its connection: to wherever the node's pool points now (it moves
/// on a Sentinel failover), with the pool's timeouts.
#[derive(Clone)]
pub(crate) struct Connector {
    pub pool: Arc<Pool>,
}

/// The thread's body: connections one after the other, until the client shuts down.
pub(super) fn run(
    shared: Arc<Shared>,
    kicked: Receiver<()>,
    connector: Connector,
    counters: Arc<Counters>,
) {
    let node = &shared.node;
    let mut backoff = Duration::from_millis(50);
    let mut connected_once = false;
    while !shared.shutdown.load(Ordering::Relaxed) {
        if !shared.wants_connection() {
            let _ = kicked.recv_timeout(IDLE);
            continue;
        }
        let epoch = connector.pool.epoch();
        let stream = Stream::open(&connector.pool, POLL).and_then(|mut s| {
            prepare(&shared, &mut s, &connector, &counters)?;
            Ok(s)
        });
        let mut stream = match stream {
            Ok(s) => s,
            Err(e) => {
                log::debug!("subscriber {node}: connect failed: {e}; retrying in {backoff:?}");
                let jitter = rand::random_range(0..=backoff.as_millis() as u64 / 2);
                let _ = kicked.recv_timeout(backoff + Duration::from_millis(jitter));
                backoff = (backoff * 2).min(Duration::from_secs(2));
                continue;
            }
        };
        shared.connected.store(true, Ordering::Relaxed);
        if connected_once {
            Counters::inc(&counters.reconnects);
            Counters::inc(&shared.reconnects);
            log::info!("subscriber {node}: reconnected; waiters retry once");
        }
        connected_once = true;
        backoff = Duration::from_millis(50);
        let moved = || connector.pool.epoch() != epoch;
        let err = serve(&shared, &kicked, &mut stream, &counters, &moved);
        shared.connected.store(false, Ordering::Relaxed);
        shared.lost_connection();
        match err {
            Ok(()) => break,
            Err(e) => log::warn!("subscriber {node}: connection lost: {e}"),
        }
    }
}

/// Before subscribing on a new connection: re-check the node's notifications (a restart
/// forgets a `CONFIG SET`), whether its library channels are sharded, and which channels
/// an ACL lets us subscribe to.
fn prepare(
    shared: &Shared,
    stream: &mut Stream,
    connector: &Connector,
    counters: &Counters,
) -> RedisResult<()> {
    Counters::add(&counters.commands, 2);
    let mode = notify::ensure(stream.plain(), shared.configure)?;
    Counters::inc(&counters.commands);
    let sharded = connector.pool.sharded.probe(stream.plain())?;
    let library = if sharded {
        ChannelKind::Sharded
    } else {
        ChannelKind::Classic
    };
    let probe_lock = probe_lock(&shared.prefix);
    let keyspace = matches!(mode, Mode::Keyspace)
        && probe(
            stream,
            ChannelKind::Classic,
            &keyspace_channel(shared.db, &probe_lock),
            counters,
        )?;
    let own = probe(stream, library, &channel_of_lock(&probe_lock), counters)?;
    let had_keyspace = shared.keyspace.swap(keyspace, Ordering::Relaxed);
    shared.own_channel.store(own, Ordering::Relaxed);
    shared.sharded.store(sharded, Ordering::Relaxed);
    let node = &shared.node;
    if had_keyspace && !keyspace {
        let why = match mode {
            Mode::Fallback(why) => why,
            Mode::Keyspace => "SUBSCRIBE to keyspace channels refused".to_owned(),
        };
        log::warn!(
            "node {node}: keyspace notifications unavailable: {why}; waiters are woken by the library's release channel instead"
        );
    }
    if !own {
        log::warn!(
            "node {node}: {} to the library's channels refused (ACL?): waiters are woken by the lease timer and re-checks, and the fairness budget always applies",
            if sharded { "SSUBSCRIBE" } else { "SUBSCRIBE" }
        );
    }
    Ok(())
}

/// Whether subscribing to `channel` is allowed; unsubscribes at once. The reply is read
/// as such: a refused subscribe is an error reply, never a confirmation. In a Cluster the
/// probe's shard channel may be in another node's slot: a redirect says the ACL let the
/// command through (Redis checks it first), which is all the probe asks.
fn probe(
    stream: &mut Stream,
    kind: ChannelKind,
    channel: &[u8],
    counters: &Counters,
) -> RedisResult<bool> {
    Counters::add(&counters.commands, 2);
    stream.send(true, kind, channel)?;
    stream.send(false, kind, channel)?;
    let mut allowed = false;
    stream.settle(&mut |i| match i {
        Incoming::Subscribed { .. } => allowed = true,
        Incoming::Refused { error, .. } if error.redirect_node().is_some() => allowed = true,
        _ => {}
    })?;
    Ok(allowed)
}

/// Serves one connection until it fails (`Err`) or the client shuts down (`Ok`).
fn serve(
    shared: &Shared,
    kicked: &Receiver<()>,
    stream: &mut Stream,
    counters: &Counters,
    moved: &dyn Fn() -> bool,
) -> RedisResult<()> {
    let mut last_traffic = Instant::now();
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
        let mut heard = false;
        let mut on = |i: Incoming<'_>| {
            heard = true;
            shared.incoming(i);
        };
        if sync_subscriptions(shared, stream, counters, &mut on)? {
            stream.poll(&mut on)?;
        } else {
            // Nothing subscribed: sleep on the kick channel rather than the socket.
            let _ = kicked.recv_timeout(IDLE);
        }
        if heard {
            last_traffic = Instant::now();
            continue;
        }
        if last_traffic.elapsed() >= HEALTH_CHECK {
            Counters::inc(&counters.commands);
            stream.ping()?;
            stream.settle(&mut |i| shared.incoming(i))?;
            last_traffic = Instant::now();
        }
    }
}

/// Sends the (un)subscribes the state asks for and reads the replies. Returns whether any
/// key is subscribed.
fn sync_subscriptions(
    shared: &Shared,
    stream: &mut Stream,
    counters: &Counters,
    on: &mut dyn FnMut(Incoming<'_>),
) -> RedisResult<bool> {
    let (subscribe, unsubscribe, active) = {
        let mut st = shared.state.lock();
        let now = Instant::now();
        let mut subscribe = Vec::new();
        let mut unsubscribe = Vec::new();
        if st.dirty {
            st.dirty = false;
            let keyspace = shared.keyspace.load(Ordering::Relaxed);
            let own = shared.own_channel.load(Ordering::Relaxed);
            let library = if shared.sharded.load(Ordering::Relaxed) {
                ChannelKind::Sharded
            } else {
                ChannelKind::Classic
            };
            let usable = keyspace || own;
            for (lock, ks) in st.keys.iter_mut() {
                if usable && ks.interest > 0 && !ks.confirmed && !ks.requested && !ks.away {
                    ks.requested = true;
                    ks.channels.clear();
                    if own {
                        ks.channels.push((library, channel_of_lock(lock)));
                    }
                    if keyspace {
                        ks.channels
                            .push((ChannelKind::Classic, keyspace_channel(shared.db, lock)));
                    }
                    ks.unconfirmed = ks.channels.len();
                    subscribe.extend(ks.channels.iter().cloned());
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
        (subscribe, unsubscribe, active)
    };
    if subscribe.is_empty() && unsubscribe.is_empty() {
        return Ok(active);
    }
    for (kind, channel) in &unsubscribe {
        Counters::inc(&counters.commands);
        stream.send(false, *kind, channel)?;
    }
    for (kind, channel) in &subscribe {
        Counters::inc(&counters.commands);
        stream.send(true, *kind, channel)?;
    }
    // Each confirmation is counted for its key as it comes (`Shared::incoming`).
    stream.settle(on)?;
    Ok(true)
}
