//! The subscriber's connection on the wire: classic and sharded (un)subscribes, the
//! server's replies to them, and the messages of both kinds.
//!
//! redis-rs's sync `PubSub` speaks RESP2 and drops `smessage`, and it knows no
//! `SSUBSCRIBE`. So the connection speaks RESP3, where everything the server says about
//! subscriptions is a *push*: messages (`message`, `smessage`), confirmations
//! (`subscribe`, `ssubscribe`, `unsubscribe`, `sunsubscribe`), and also a `sunsubscribe`
//! nobody asked for, which the server sends when a shard channel's slot moves to another
//! node. redis-rs hands every push it reads to the connection's push sender; this module
//! reads them from there, in order, and pairs each reply with the command it answers.
//!
//! Commands are sent without waiting (one channel per command, so that each has exactly
//! one reply) and [`settle`](Stream::settle) reads until every one is answered: a
//! confirmation push, or an error reply (an ACL refusal; in a Cluster, `MOVED` for a shard
//! channel whose slot is served elsewhere). A `PING`'s reply is the only other non-push
//! reply.
//!
//! Two ways to read, because redis-rs's `recv_response` counts a read that timed out as a
//! reply still owed, and then silently drops that many later non-push replies (our
//! `PONG`s, the errors to refused subscribes):
//!
//! * while replies are owed, `recv_response` with the full read timeout: a timeout there
//!   is a dead connection, which is dropped anyway;
//! * otherwise, [`poll`](Stream::poll) with a short timeout, through
//!   `PubSub::get_message`, the one public read that does not count timeouts (see there).

use std::collections::VecDeque;
use std::mem::ManuallyDrop;
use std::sync::mpsc;
use std::time::Duration;

use redis::{Connection, PushInfo, PushKind, RedisError, RedisResult, Value};

use crate::proto::pool::{Pool, open_connection};
use crate::proto::sharded::ChannelKind;

/// Something the server said that the subscriber acts on.
pub(crate) enum Incoming<'a> {
    /// A message on a subscribed channel, classic or shard.
    Message {
        channel: &'a [u8],
        payload: &'a [u8],
    },
    /// A subscribe of ours is confirmed.
    Subscribed { channel: &'a [u8] },
    /// A subscribe of ours was refused with this error reply.
    Refused {
        channel: &'a [u8],
        error: &'a RedisError,
    },
    /// The server dropped a shard channel we did not unsubscribe: its slot moved to
    /// another node.
    Dropped { channel: &'a [u8] },
}

/// A command sent whose reply has not been read yet.
#[derive(Debug)]
enum Sent {
    Subscribe(ChannelKind, Vec<u8>),
    Unsubscribe(ChannelKind, Vec<u8>),
    Ping,
}

/// The subscriber's RESP3 connection.
pub(crate) struct Stream {
    conn: Connection,
    pushes: mpsc::Receiver<PushInfo>,
    /// Oldest first: replies come in the order of the commands.
    owed: VecDeque<Sent>,
    read_timeout: Duration,
    /// The read timeout the socket has now.
    current: Duration,
}

impl Stream {
    /// Opens a RESP3 connection to wherever `pool` points now, with its timeouts.
    pub fn open(pool: &Pool) -> RedisResult<Self> {
        let client = pool.client();
        let info = client.get_connection_info().clone();
        let settings = info
            .redis_settings()
            .clone()
            .set_protocol(redis::ProtocolVersion::RESP3);
        let client = redis::Client::open(info.set_redis_settings(settings))?;
        let (connect_timeout, read_timeout, write_timeout) = pool.timeouts();
        let mut conn = open_connection(
            &client,
            connect_timeout,
            read_timeout,
            write_timeout,
            "redbaton:sub",
        )?;
        let (tx, pushes) = mpsc::channel();
        conn.set_push_sender(tx);
        Ok(Stream {
            conn,
            pushes,
            owed: VecDeque::new(),
            read_timeout,
            current: read_timeout,
        })
    }

    /// The connection, for plain commands before anything is subscribed.
    pub fn plain(&mut self) -> &mut Connection {
        &mut self.conn
    }

    /// Sends one (un)subscribe of `channel`; its reply is read by [`settle`](Self::settle).
    pub fn send(&mut self, subscribe: bool, kind: ChannelKind, channel: &[u8]) -> RedisResult<()> {
        let name = match (subscribe, kind) {
            (true, ChannelKind::Classic) => "SUBSCRIBE",
            (true, ChannelKind::Sharded) => "SSUBSCRIBE",
            (false, ChannelKind::Classic) => "UNSUBSCRIBE",
            (false, ChannelKind::Sharded) => "SUNSUBSCRIBE",
        };
        self.conn
            .send_packed_command(&redis::cmd(name).arg(channel).get_packed_command())?;
        self.owed.push_back(if subscribe {
            Sent::Subscribe(kind, channel.to_vec())
        } else {
            Sent::Unsubscribe(kind, channel.to_vec())
        });
        Ok(())
    }

    /// Sends a `PING` (the health check); its reply is read by [`settle`](Self::settle).
    pub fn ping(&mut self) -> RedisResult<()> {
        self.conn
            .send_packed_command(&redis::cmd("PING").get_packed_command())?;
        self.owed.push_back(Sent::Ping);
        Ok(())
    }

    /// Reads until every command sent has its reply, each read bounded by the read
    /// timeout; hands everything that arrives meanwhile to `on`, in order.
    pub fn settle(&mut self, on: &mut dyn FnMut(Incoming<'_>)) -> RedisResult<()> {
        if self.owed.is_empty() {
            return Ok(());
        }
        self.set_timeout(self.read_timeout)?;
        while !self.owed.is_empty() {
            let value = self.conn.recv_response()?;
            // A push was handed to the sender too, before this returned: take it (and
            // any before it) from there, so that every push is read one way.
            self.drain(on);
            if !matches!(value, Value::Push { .. }) {
                self.reply(value, on);
            }
        }
        Ok(())
    }

    /// Waits for traffic up to `wait` and hands what came to `on`. A timeout is not an
    /// error.
    pub fn poll(&mut self, wait: Duration, on: &mut dyn FnMut(Incoming<'_>)) -> RedisResult<()> {
        debug_assert!(self.owed.is_empty(), "replies are read by settle");
        self.set_timeout(wait)?;
        // `get_message` reads without counting a timeout as a reply owed (it returns on a
        // message and goes on reading past anything else; every push also went to the
        // sender, where `drain` finds it). Its `PubSub` must never be dropped, since
        // that unsubscribes from everything; it holds nothing but a queue that only its
        // own (un)subscribe and ping methods fill, which are not used, so nothing leaks.
        let read = ManuallyDrop::new(self.conn.as_pubsub()).get_message();
        self.drain(on);
        match read {
            Ok(_) => Ok(()),
            Err(e) if e.is_timeout() => Ok(()),
            Err(e) => Err(e),
        }
    }

    fn set_timeout(&mut self, t: Duration) -> RedisResult<()> {
        if self.current != t {
            self.conn.set_read_timeout(Some(t))?;
            self.current = t;
        }
        Ok(())
    }

    /// Every push read so far, in order.
    fn drain(&mut self, on: &mut dyn FnMut(Incoming<'_>)) {
        while let Ok(push) = self.pushes.try_recv() {
            self.push(push, on);
        }
    }

    fn push(&mut self, push: PushInfo, on: &mut dyn FnMut(Incoming<'_>)) {
        let channel = match push.data.first() {
            Some(Value::BulkString(c)) => c.as_slice(),
            _ => return, // a disconnection notice: the read that saw it fails too
        };
        match push.kind {
            PushKind::Message | PushKind::SMessage => {
                let payload = match push.data.get(1) {
                    Some(Value::BulkString(p)) => p.as_slice(),
                    _ => b"",
                };
                on(Incoming::Message { channel, payload });
            }
            PushKind::Subscribe | PushKind::SSubscribe => {
                if self.answers(true, kind_of(&push.kind), channel) {
                    on(Incoming::Subscribed { channel });
                } else {
                    log::debug!("subscriber: unexpected confirmation {:?}", push.kind);
                }
            }
            PushKind::Unsubscribe | PushKind::SUnsubscribe => {
                let kind = kind_of(&push.kind);
                if !self.answers(false, kind, channel) && kind == ChannelKind::Sharded {
                    on(Incoming::Dropped { channel });
                }
            }
            _ => {}
        }
    }

    /// Whether a confirmation answers the oldest command owed (which then is no longer).
    fn answers(&mut self, subscribe: bool, kind: ChannelKind, channel: &[u8]) -> bool {
        let owed = match self.owed.front() {
            Some(Sent::Subscribe(k, c)) => subscribe && *k == kind && c == channel,
            Some(Sent::Unsubscribe(k, c)) => !subscribe && *k == kind && c == channel,
            _ => false,
        };
        if owed {
            self.owed.pop_front();
        }
        owed
    }

    /// A reply that is not a push: the answer to the oldest command owed.
    fn reply(&mut self, value: Value, on: &mut dyn FnMut(Incoming<'_>)) {
        let Some(sent) = self.owed.pop_front() else {
            log::debug!("subscriber: a reply nobody asked for: {value:?}");
            return;
        };
        match (sent, value.extract_error()) {
            (Sent::Subscribe(_, channel), Err(error)) => on(Incoming::Refused {
                channel: &channel,
                error: &error,
            }),
            // An unsubscribe refused (a `MOVED` for a shard channel whose slot left) has
            // nothing left to undo; a `PING` answered is all the health check asks.
            (Sent::Unsubscribe(..) | Sent::Ping, _) => {}
            // Not what Redis answers; take it as a confirmation rather than leave the
            // key waiting for one.
            (Sent::Subscribe(_, channel), Ok(v)) => {
                log::debug!("subscriber: a subscribe answered {v:?}");
                on(Incoming::Subscribed { channel: &channel });
            }
        }
    }
}

fn kind_of(push: &PushKind) -> ChannelKind {
    match push {
        PushKind::SSubscribe | PushKind::SUnsubscribe | PushKind::SMessage => ChannelKind::Sharded,
        _ => ChannelKind::Classic,
    }
}
