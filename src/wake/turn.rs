//! One turn of reading a node's subscriber connection, by its thread or by a waiter
//! asleep on it (see `seat`).
//!
//! A turn reads with a short timeout ([`POLL`]) so that (un)subscribe requests are taken
//! between reads; events themselves are read as soon as they arrive. The (un)subscribes of
//! one turn are sent together, one channel per command, and the turn reads until the
//! server answered them all; a key counts as subscribed once every one of its channels is
//! confirmed.
//!
//! Each key has its keyspace channel (classic: Redis sends keyspace events to the node's
//! own subscribers only) and the library's channel, sharded (`SSUBSCRIBE`) where the node
//! has sharded pub/sub, as its publishers decide too (`proto::sharded`), classic
//! otherwise.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crossbeam_channel::Receiver;
use redis::RedisResult;

use crate::proto::keys::{channel_of_lock, keyspace_channel};
use crate::proto::sharded::ChannelKind;
use crate::stats::Counters;
use crate::wake::seat::Reader;
use crate::wake::state::{LINGER, Shared};
use crate::wake::stream::{Incoming, Stream};

/// Read timeout while subscriptions are active: the longest a (un)subscribe request waits
/// for the thread (or the waiter reading for it). It does not delay events.
pub(super) const POLL: Duration = Duration::from_millis(5);
/// Longest sleep while nothing is subscribed.
pub(super) const IDLE: Duration = Duration::from_millis(500);
/// A `PING` on the subscriber connection after this long without traffic, so that a dead
/// connection is noticed even when no event is due.
const HEALTH_CHECK: Duration = Duration::from_secs(15);

/// Who reads the connection, for one turn.
pub(super) enum Reading<'a> {
    /// The thread; with nothing subscribed, it sleeps on this channel instead.
    Thread(&'a Receiver<()>),
    /// A waiter, whose current nap ends at this instant (its wait's deadline at the
    /// latest): what it does for others meanwhile (an early attempt it sends for them) is
    /// over by then.
    Waiter(Instant),
}

/// One turn of reading the connection, by the thread or a waiter: the (un)subscribes
/// asked for, then what the server sends within `poll`, each acted on; a `PING` after a
/// long silence. With nothing subscribed, the thread sleeps on its kick channel instead
/// (a waiter, which reads only while its own key is subscribed, returns). Whether
/// anything came.
pub(super) fn step(
    shared: &Shared,
    reader: &mut Reader,
    counters: &Counters,
    poll: Duration,
    who: Reading<'_>,
) -> RedisResult<bool> {
    let stream = &mut reader.stream;
    let generation = reader.generation;
    let (kicked, bound) = match who {
        Reading::Thread(kicked) => (Some(kicked), None),
        Reading::Waiter(until) => (None, Some(until)),
    };
    let mut heard = false;
    let mut on = |i: Incoming<'_>| {
        heard = true;
        shared.incoming(i, generation, bound);
    };
    if sync_subscriptions(shared, stream, generation, counters, &mut on)? {
        stream.poll(poll, &mut on)?;
    } else if let Some(kicked) = kicked {
        // Nothing subscribed: sleep on the kick channel rather than the socket.
        let _ = kicked.recv_timeout(IDLE);
    }
    if heard {
        reader.last_traffic = Instant::now();
        return Ok(true);
    }
    if reader.last_traffic.elapsed() >= HEALTH_CHECK {
        Counters::inc(&counters.commands);
        stream.ping()?;
        stream.settle(&mut |i| shared.incoming(i, generation, bound))?;
        reader.last_traffic = Instant::now();
    }
    Ok(false)
}

/// Sends the (un)subscribes the state asks for and reads the replies. Returns whether any
/// key is subscribed.
///
/// Nothing is sent on a connection of an earlier `generation`: a waiter can still have one
/// in hand when the thread, restarted after a panic, gave up waiting for it and forgot
/// its subscriptions. Subscribed there, a key would count as subscribed while the
/// thread's new connection never subscribes it (and its events would go to a connection
/// dropped at the end of the read); a lingering key unsubscribed and forgotten there
/// would stay subscribed on the new one.
fn sync_subscriptions(
    shared: &Shared,
    stream: &mut Stream,
    generation: u64,
    counters: &Counters,
    on: &mut dyn FnMut(Incoming<'_>),
) -> RedisResult<bool> {
    let (subscribe, unsubscribe, active) = {
        let mut st = shared.state.lock();
        if st.generation != generation {
            // Read on until given back (its messages are events all the same).
            return Ok(true);
        }
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
            // A key whose slot moved away is neither confirmed nor asked for any more, but
            // only its shard channel was dropped by the server: what `channels` has left
            // (the keyspace channel) is still subscribed on this connection.
            if expired && (ks.confirmed || ks.requested || ks.away) {
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
