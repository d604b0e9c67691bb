//! Sharded pub/sub for the library's own channel: `SPUBLISH`/`SSUBSCRIBE` (Redis 7.0+) when
//! the node has them, classic `PUBLISH`/`SUBSCRIBE` otherwise.
//!
//! In Redis Cluster a classic `PUBLISH` goes over the cluster bus to every node, so each
//! release and each contention mark costs every node of the cluster a message. A sharded
//! publish stays in the shard that owns the channel's slot, and the library channel of a
//! lock shares the lock's hash tag (`proto::keys`): the script that publishes runs on that
//! very shard. Keyspace channels stay classic: Redis sends them to the node's own
//! subscribers only.
//!
//! Publisher and subscriber must agree: a message sent with `SPUBLISH` reaches only
//! `SSUBSCRIBE`rs, and one sent with `PUBLISH` only `SUBSCRIBE`rs. So every process decides
//! the same way, from the same fact about the server: whether `SPUBLISH` on a probe channel
//! under the key prefix runs. Redis 6 does not know the command; an operator may have
//! renamed it away; an ACL may refuse it. Any of these means classic, for the publishing
//! scripts and the subscriber alike. A `MOVED` reply means sharded: the command exists and
//! the ACL let it through (Redis checks both before it redirects). A node asks when it
//! opens a connection, while it has no answer or its answer may be out of date: its
//! connections were dropped (a network error, a Sentinel failover), and the server behind
//! the address may have changed. Meanwhile it keeps using the last answer, so that a call
//! never waits for a probe of a server that does not answer. The subscriber asks on each
//! of its connections.
//!
//! The scripts take the choice as their last argument (`Node::publish_mode`) and publish
//! through one Lua helper ([`PUBLISH_FN`]), so one script body serves both.

use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};

use redis::{Connection, RedisResult};

use crate::error::is_network_error;
use crate::proto::keys::{channel_of_lock, probe_lock};

/// How a channel is subscribed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ChannelKind {
    /// `SUBSCRIBE` / `PUBLISH`.
    Classic,
    /// `SSUBSCRIBE` / `SPUBLISH`: the shard of the channel's slot only.
    Sharded,
}

/// The Lua helper every script that publishes on the library channel starts with. The
/// script's last argument says how: `s` sharded, anything else classic. Published with
/// `pcall`: a user whose ACL refuses the channel still locks.
pub(crate) const PUBLISH_FN: &str = r"
local function publish(channel, message)
  if ARGV[#ARGV] == 's' then return redis.pcall('SPUBLISH', channel, message) end
  return redis.pcall('PUBLISH', channel, message)
end
";

const UNKNOWN: u8 = 0;
const CLASSIC: u8 = 1;
const SHARDED: u8 = 2;

/// What one node was found to have, and the channel it is probed with.
pub(crate) struct Sharded {
    state: AtomicU8,
    /// The answer may be out of date: ask again at the next connection.
    stale: AtomicBool,
    /// The library channel of a lock no one takes, under the client's prefix (so that an
    /// ACL on the prefix covers it).
    channel: Vec<u8>,
}

impl Sharded {
    pub fn new(prefix: &str) -> Self {
        Sharded {
            state: AtomicU8::new(UNKNOWN),
            stale: AtomicBool::new(false),
            channel: channel_of_lock(&probe_lock(prefix)),
        }
    }

    /// Whether the node's library channels are sharded, if known.
    pub fn known(&self) -> Option<bool> {
        match self.state.load(Ordering::Acquire) {
            CLASSIC => Some(false),
            SHARDED => Some(true),
            _ => None,
        }
    }

    /// The server behind the node may have changed: ask again at the next connection
    /// (the answer so far stays in use until then).
    pub fn forget(&self) {
        self.stale.store(true, Ordering::Release);
    }

    /// Whether a new connection should ask.
    pub fn wanted(&self) -> bool {
        self.known().is_none() || self.stale.load(Ordering::Acquire)
    }

    /// Asks the server on `conn` (a plain connection, or one not yet subscribed to
    /// anything) and records the answer. A network error is returned as such.
    pub fn probe(&self, conn: &mut Connection) -> RedisResult<bool> {
        let sharded = match redis::cmd("SPUBLISH")
            .arg(&self.channel)
            .arg("")
            .query::<redis::Value>(conn)
        {
            Ok(_) => true,
            Err(e) if is_network_error(&e) => return Err(e),
            Err(e) => !lacks_command(&e),
        };
        let state = if sharded { SHARDED } else { CLASSIC };
        self.stale.store(false, Ordering::Release);
        if self.state.swap(state, Ordering::AcqRel) != state {
            log::debug!(
                "library channel: {}",
                if sharded {
                    "sharded (SPUBLISH)"
                } else {
                    "classic (PUBLISH)"
                }
            );
        }
        Ok(sharded)
    }
}

/// The server does not run the command for us: unknown (Redis 6, renamed away) or refused
/// by an ACL.
fn lacks_command(e: &redis::RedisError) -> bool {
    e.code() == Some("NOPERM")
        || e.detail()
            .is_some_and(|d| d.to_ascii_lowercase().starts_with("unknown command"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn server_error(line: &str) -> redis::RedisError {
        let value = redis::parse_redis_value(format!("-{line}\r\n").as_bytes()).unwrap();
        value.extract_error().unwrap_err()
    }

    #[test]
    fn smoke() {
        assert!(lacks_command(&server_error(
            "ERR unknown command 'SPUBLISH', with args beginning with: 'x' ''"
        )));
    }

    #[test]
    fn what_counts_as_lacking() {
        assert!(lacks_command(&server_error(
            "NOPERM User locker has no permissions to run the 'spublish' command"
        )));
        // Redis 6.2 quotes with backticks.
        assert!(lacks_command(&server_error(
            "ERR unknown command `SPUBLISH`, with args beginning with: `x`, ``, "
        )));
        // A redirect: the command exists and the ACL let it through.
        assert!(!lacks_command(&server_error("MOVED 3999 127.0.0.1:7002")));
        assert!(!lacks_command(&server_error(
            "CLUSTERDOWN The cluster is down"
        )));
    }

    #[test]
    fn asked_until_known_and_after_forget() {
        let s = Sharded::new("p:");
        assert_eq!((s.known(), s.wanted()), (None, true));
        s.state.store(SHARDED, Ordering::Release);
        assert_eq!((s.known(), s.wanted()), (Some(true), false));
        s.forget();
        // Still in use until asked again.
        assert_eq!((s.known(), s.wanted()), (Some(true), true));
        assert_eq!(s.channel, b"p:{redbaton-probe}:ev");
    }
}
