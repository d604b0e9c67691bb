//! The subscriber thread's loop: connect, check what the node allows, (un)subscribe what
//! the waiters ask for, read events, reconnect when the connection fails.
//!
//! The sync `redis` connection is `&mut` only, so this thread owns it (and lends it to
//! waiters that read it while they sleep, see `seat`) and reads it in turns (`turn`).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use crossbeam_channel::Receiver;
use redis::RedisResult;

use crate::proto::keys::{channel_of_lock, keyspace_channel, probe_lock};
use crate::proto::pool::Pool;
use crate::proto::sharded::ChannelKind;
use crate::stats::Counters;
use crate::wake::notify::{self, Mode};
use crate::wake::seat::{Parked, Reader};
use crate::wake::state::Shared;
use crate::wake::stream::{Incoming, Stream};
use crate::wake::turn::{IDLE, POLL, Reading, step};

/// How the thread opens its connection: to wherever the node's pool points now (it moves
/// on a Sentinel failover), with the pool's timeouts.
#[derive(Clone)]
pub(crate) struct Connector {
    pub pool: Arc<Pool>,
}

/// The thread's body: connections one after the other, until the client shuts down, or
/// until its node serves nothing and nothing is asked of it.
pub(super) fn run(
    shared: Arc<Shared>,
    kicked: Receiver<()>,
    connector: Connector,
    counters: Arc<Counters>,
) {
    let node = &shared.node;
    let mut backoff = Duration::from_millis(50);
    while !shared.shutdown.load(Ordering::Relaxed) {
        if !shared.wants_connection() {
            let asked = kicked.recv_timeout(IDLE).is_ok();
            // A Redis Cluster master that serves nothing now (removed, demoted), and not a
            // request for a whole idle turn: the thread ends rather than idle for as long
            // as the client lives, since with masters coming and going at new addresses
            // their subscribers would pile up. A waiter that routes there again (the
            // master serves again) gets a fresh one (`Subs::for_route`).
            if !asked && connector.pool.is_retired() && shared.close() {
                log::debug!("subscriber {node}: the node serves nothing; ended");
                break;
            }
            continue;
        }
        let epoch = connector.pool.epoch();
        let stream = Stream::open(&connector.pool).and_then(|mut s| {
            prepare(&shared, &mut s, &connector, &counters)?;
            Ok(s)
        });
        let stream = match stream {
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
        if shared.connected_once.swap(true, Ordering::Relaxed) {
            Counters::inc(&counters.reconnects);
            Counters::inc(&shared.reconnects);
            log::info!("subscriber {node}: reconnected; waiters retry once");
        }
        backoff = Duration::from_millis(50);
        let node_now = NodeNow {
            moved: &|| connector.pool.epoch() != epoch,
            retired: &|| connector.pool.is_retired(),
        };
        // Only this thread forgets subscriptions (a new generation), and it did so before
        // this connection: its generation is the current one.
        let generation = shared.state.lock().generation;
        let reader = Reader::new(stream, shared.booth.new_connection(), generation);
        let end = serve(&shared, &kicked, reader, &counters, &node_now);
        shared.connected.store(false, Ordering::Relaxed);
        shared.lost_connection();
        match end {
            Ok(Closed::Stopped) => break,
            Ok(Closed::Retired) => {
                // Not a lost connection: the next one, if any waiter comes, is no
                // reconnect.
                shared.connected_once.store(false, Ordering::Relaxed);
                log::debug!("subscriber {node}: the node serves nothing now; disconnected");
            }
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

/// What a connection's node is now: moved to another address (a Sentinel failover), or
/// serving nothing (a Redis Cluster master demoted or removed).
struct NodeNow<'a> {
    moved: &'a dyn Fn() -> bool,
    retired: &'a dyn Fn() -> bool,
}

/// Why a connection was closed without failing.
enum Closed {
    /// The client shuts down.
    Stopped,
    /// Its node serves nothing and nothing is subscribed.
    Retired,
}

/// Serves one connection until it fails (`Err`), the client shuts down, or its node
/// serves nothing with nothing subscribed; while waiters offer to read it themselves, it
/// is theirs (see `seat`).
fn serve(
    shared: &Shared,
    kicked: &Receiver<()>,
    reader: Reader,
    counters: &Counters,
    node: &NodeNow<'_>,
) -> RedisResult<Closed> {
    let moved = node.moved;
    let mut reader = reader;
    loop {
        if shared.shutdown.load(Ordering::Relaxed) {
            return Ok(Closed::Stopped);
        }
        // A demoted master's connection would otherwise stay open (and `PING`ed) while the
        // client lives; a waiter that comes later connects again (`wants_connection`).
        if (node.retired)() && !shared.booth.wanted() && shared.is_idle() {
            return Ok(Closed::Retired);
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
        if shared.booth.wanted() {
            let check = || crate::fault::hit(&shared.prefix, crate::fault::Point::Subscriber);
            match shared.booth.park(reader, &shared.shutdown, moved, &check) {
                Parked::Back(r) => reader = r,
                Parked::Failed(e) => return Err(e),
                Parked::Stop => return Ok(Closed::Stopped),
            }
            continue;
        }
        step(shared, &mut reader, counters, POLL, Reading::Thread(kicked))?;
    }
}
