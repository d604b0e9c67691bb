//! One Redis node: its connection pool, and running commands and scripts on it (network
//! retries within a deadline, replica acknowledgements). Which lock scripts it runs, with
//! which arguments, is the route's protocol's (see `protocol`); where a command goes
//! when its server refuses or redirects it is the node's call path's, which the topology
//! gives it (see [`CallPath`]).

use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::{AtomicBool, AtomicUsize};
use std::time::{Duration, Instant};

use redis::{Cmd, Connection, FromRedisValue, RedisError, RedisResult, Value};

use crate::config::Config;
use crate::error::{Error, Result, is_network_error};
use crate::proto::ack::{WAIT_CUT, is_wait_cut, wait_cut, wait_timeout};
use crate::proto::connect::open_client;
use crate::proto::keys::Keys;
pub(crate) use crate::proto::pool::within_deadline;
use crate::proto::pool::{Pool, PooledConn, bounded, call_deadline};
use crate::proto::scripts::{self, Lua, RAISE_FENCE, Site};
use crate::stats::Counters;

/// What a compare-and-delete found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ReleaseReply {
    Released,
    /// Released by granting it to the next process in the fair queue.
    Passed,
    Gone,
    /// Gone, but only a retry saw it: the first attempt, whose reply was lost, may have
    /// been the one that deleted it.
    GoneAfterRetry,
    Other,
    /// Another token holds it, but only a retry saw it: the first attempt, whose reply was
    /// lost, may have released it (with the fair queue: granted it to the next waiter,
    /// whose token the retry finds) and the next holder have it since.
    OtherAfterRetry,
    /// Gone, and a retry that read the fence counter proved that no try of ours released
    /// it (status 3, see `scripts::RELEASE`, "A retry"): the hold ended without us, however
    /// many tries before lost their replies.
    NotReleased,
}

impl ReleaseReply {
    /// This reply, of a release that an earlier send may have made: gone or another's
    /// then says only what a retry saw.
    pub(crate) fn as_retried(self) -> Self {
        match self {
            ReleaseReply::Gone => ReleaseReply::GoneAfterRetry,
            ReleaseReply::Other => ReleaseReply::OtherAfterRetry,
            other => other,
        }
    }
}

/// When a command is sent again on a fresh connection after a network failure. Only
/// idempotent commands are retried.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Retry {
    pub times: u32,
    /// Also after a read timeout. Right when the reply may just be lost (one node); wrong
    /// when a node hangs and others can decide without it (Redlock, renewals).
    pub after_timeout: bool,
}

impl Retry {
    /// Start-up checks: fail fast.
    pub const NEVER: Retry = Retry {
        times: 0,
        after_timeout: false,
    };
    /// A dead pooled connection (server restarted) is worth one more try; a hung node is not.
    pub const ON_RESET: Retry = Retry {
        times: 1,
        after_timeout: false,
    };
    /// One node, idempotent command: a lost reply is retried with the same arguments.
    pub const LOST_REPLY: Retry = Retry {
        times: 2,
        after_timeout: true,
    };
}

/// How long a pooled connection may lie idle before a command that is sent only once
/// ([`Retry::NEVER`]) checks it: Redis's `timeout` closes a connection idle for longer than
/// a whole number of seconds, 1 at least.
const CHECK_IDLE_AFTER: Duration = Duration::from_secs(1);

/// A node's stable name: its address (never a password), the same for as long as the node
/// serves, whatever the order or number of nodes around it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct NodeId(Arc<str>);

impl NodeId {
    pub fn new(address: impl Into<Arc<str>>) -> Self {
        NodeId(address.into())
    }
}

impl std::fmt::Display for NodeId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// How a node's commands reach the server that serves their keys, and what a command its
/// server refused or redirected does next. Declared here, implemented by the topology
/// (`topology::call`), which gives every node one when it makes it: the node sends
/// ([`Node::send`]), the call path decides.
pub(crate) trait CallPath: Send + Sync {
    /// Runs `commands` for `node` as `call` says: on `node` through [`Node::send`], then
    /// wherever the servers' replies send them, every step of the call within
    /// `call.deadline` as [`Call::deadline`] says. [`Sent::Narrow`] (only with
    /// `call.narrower`): the server refused the call's keys together, and the caller is to
    /// send its narrower form instead.
    fn call(&self, node: &Node, call: Call, commands: &mut Commands<'_>) -> Result<Sent>;
    /// Whether a command sent outside the call path (see [`Node::finish_early`]) that
    /// failed with `e` is to be sent again through it.
    fn resend(&self, e: &RedisError) -> bool;
    /// A command of a node got no reply, or no connection: the layout may have changed.
    fn fault(&self);
}

/// The commands of one attempt of a call, sent on a connection. The second argument is
/// the command the call path sent ahead of them on that connection, if any: a command sent
/// again within the attempt (a script after its reload) needs it ahead of it again.
pub(crate) type Commands<'a> = dyn FnMut(&mut Connection, Option<&Cmd>) -> RedisResult<()> + 'a;

/// How one call is made.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Call {
    pub retry: Retry,
    /// No read, and no wait for or opening of a connection, goes past it, or past
    /// [`MIN_ATTEMPT`](crate::proto::pool::MIN_ATTEMPT) after the call began when that is
    /// later: the call as a whole is given that much, not each of its steps (see
    /// [`call_deadline`]). Nothing is sent again after it.
    pub deadline: Option<Instant>,
    /// The caller has a narrower form of the call (fewer keys per command) to send instead
    /// if the server refuses these keys together.
    pub narrower: bool,
}

/// What became of a call whose commands did not fail.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Sent {
    /// The commands ran.
    Ran,
    /// They did not run: the caller sends its narrower form (see [`Call::narrower`]).
    Narrow,
}

pub(crate) struct Node {
    pub id: NodeId,
    pub pool: Arc<Pool>,
    /// The database of the URL: keyspace channels are per database.
    pub db: i64,
    counters: Arc<Counters>,
    /// Sent with failed attempts, so that our own subscriber ignores our own marks.
    client_id: Arc<str>,
    /// How long an idle fencing counter lives, in ms (a script argument).
    fence_ttl_ms: u64,
    /// The lease of a grant a read-write lock's release makes to the writer waiting
    /// longest, in ms (a script argument, see `rw_scripts`).
    grant_ms: u64,
    /// `replica_ack`: replicas that must acknowledge an acquisition or renewal, and how
    /// long to wait for them.
    pub(crate) ack: Option<(usize, Duration)>,
    /// Where its commands go when their server refuses or redirects them.
    path: Arc<dyn CallPath>,
    /// The last command got no reply (a network error or a timeout): asked last when
    /// any node will do (the cluster's slot map).
    silent: AtomicBool,
    /// How many replicas acknowledged the last `WAIT` the node answered: what a `WAIT` the
    /// call's deadline cut short says (see [`Node::unseen_acks`]).
    last_acked: AtomicUsize,
}

/// What every node of a client shares, given when a node is made: the client's counters,
/// its id, and the call path its commands take (see [`CallPath`]).
pub(crate) struct Parts {
    pub counters: Arc<Counters>,
    pub client_id: Arc<str>,
    pub path: Arc<dyn CallPath>,
}

impl Node {
    /// Whether the last command got a reply (see `silent`).
    pub fn answering(&self) -> bool {
        !self.silent.load(Relaxed)
    }

    /// A node at `url`; `label` names it in errors (the URL may hold a password).
    pub fn new(label: &str, url: &str, cfg: &Config, parts: Parts) -> Result<Self> {
        let client = open_client(label, url, &cfg.tls)?;
        Ok(Self::at(client, cfg, parts))
    }

    /// A node named by the address and database of `client`.
    pub fn at(client: redis::Client, cfg: &Config, parts: Parts) -> Self {
        let info = client.get_connection_info();
        let id = NodeId::new(format!("{}/{}", info.addr(), info.redis_settings().db()));
        Self::with_client(id, client, cfg, parts)
    }

    /// A node named `id` whose connections go through `client` (a role, such as a
    /// Sentinel-managed master, whose address may change: see [`Pool::repoint`]).
    pub fn with_client(id: NodeId, client: redis::Client, cfg: &Config, parts: Parts) -> Self {
        let Parts {
            counters,
            client_id,
            path,
        } = parts;
        let db = client.get_connection_info().redis_settings().db();
        Node {
            id,
            pool: Arc::new(Pool::new(client, cfg)),
            db,
            counters,
            client_id,
            fence_ttl_ms: millis(cfg.fence_ttl),
            grant_ms: millis(cfg.grant_lease()),
            ack: cfg.replica_ack,
            path,
            silent: AtomicBool::new(false),
            last_acked: AtomicUsize::new(0),
        }
    }

    /// Runs one command on a pooled connection, sent again on fresh connections after a
    /// network failure as `retry` says (see [`send`](Self::send)): callers pass retries
    /// only for idempotent commands.
    pub fn run<T>(
        &self,
        retry: Retry,
        f: impl FnMut(&mut Connection) -> RedisResult<T>,
    ) -> Result<T> {
        self.run_until(retry, None, f)
    }

    /// [`run`](Self::run), within the caller's `deadline`: each read, and getting a
    /// connection (see [`Pool::get_until`]), waits at most until the deadline (or until
    /// [`MIN_ATTEMPT`](crate::proto::pool::MIN_ATTEMPT) after the call began, when that is
    /// later: the call as a whole has a chance, see [`Call::deadline`]), and nothing is
    /// retried once it has passed. The node's call path decides what a command its server
    /// refused or redirected does next (Redis Cluster: `topology::call`).
    pub fn run_until<T>(
        &self,
        retry: Retry,
        deadline: Option<Instant>,
        mut f: impl FnMut(&mut Connection) -> RedisResult<T>,
    ) -> Result<T> {
        self.run_whole(retry, deadline, |c, _| f(c))
    }

    /// Runs `call` of `script` (loaded first where the server lacks it), as
    /// [`run_until`](Self::run_until) runs a command.
    pub fn run_script<T: FromRedisValue>(
        &self,
        script: &Lua,
        call: &Cmd,
        retry: Retry,
        deadline: Option<Instant>,
    ) -> Result<T> {
        self.run_whole(retry, deadline, |c, before| script.run(call, c, before))
    }

    /// `f` through the node's call path, a call without a narrower form.
    fn run_whole<T>(
        &self,
        retry: Retry,
        deadline: Option<Instant>,
        f: impl FnMut(&mut Connection, Option<&Cmd>) -> RedisResult<T>,
    ) -> Result<T> {
        let call = Call {
            retry,
            deadline,
            narrower: false,
        };
        self.call(call, f)?
            .ok_or_else(|| Error::Protocol("narrowed a call that has no narrower form".to_owned()))
    }

    /// `f` through the node's call path as `call` says; `None` when the path said to send
    /// the narrower form ([`Sent::Narrow`]).
    ///
    /// A call whose commands were sent and lost their reply may have run, whatever its
    /// later tries meet: when the last one failed in a way that says it did not run (a
    /// refused connection, an exhausted pool, a slot refused), the error of the lost reply
    /// is returned instead, so that the caller does not take the call for one that never
    /// reached Redis (see [`may_have_run`]).
    pub(crate) fn call<T>(
        &self,
        call: Call,
        mut f: impl FnMut(&mut Connection, Option<&Cmd>) -> RedisResult<T>,
    ) -> Result<Option<T>> {
        if let Some(e) = crate::proto::skip::skipped() {
            return Err(Error::Redis(e));
        }
        let mut out = None;
        let mut lost: Option<RedisError> = None;
        let sent = self.path.call(self, call, &mut |c, before| {
            match f(c, before) {
                Ok(v) => out = Some(v),
                Err(e) => {
                    if is_network_error(&e) && lost.is_none() {
                        lost = Some(e.clone());
                    }
                    return Err(e);
                }
            }
            Ok(())
        });
        let sent = sent.map_err(|e| unknown_outcome(e, lost))?;
        Ok(match sent {
            Sent::Ran => out,
            Sent::Narrow => None,
        })
    }

    /// Sends `commands` on a pooled connection of this node: the mechanism under every
    /// call path. A network failure discards the connection (its reply may still arrive)
    /// and every idle one (a server restart kills them all), tells the call path, then
    /// sends the commands again on a fresh connection as `retry` allows (`tries`: the
    /// retries this call made so far), never once `deadline` (the caller's) has passed.
    /// Getting a connection and every read are bounded by `until`, the deadline of the
    /// whole call, reckoned where it began (see [`call_deadline`]). Commands that are never sent again go on a connection
    /// checked first when it lay idle long (see [`CHECK_IDLE_AFTER`]). Any other failure
    /// is returned for the call path to judge.
    pub(crate) fn send(
        &self,
        retry: Retry,
        (deadline, until): (Option<Instant>, Option<Instant>),
        tries: &mut u32,
        commands: &mut dyn FnMut(&mut Connection) -> RedisResult<()>,
    ) -> Result<()> {
        let (_, read_timeout, _) = self.pool.timeouts();
        loop {
            let mut conn = self.connection(until)?;
            if retry.times == 0 && conn.idle_for() >= CHECK_IDLE_AFTER {
                // Commands sent once must not be lost to a connection that died while idle
                // (Redis's `timeout`, a NAT): a `PING` finds out first, at no risk.
                Counters::inc(&self.counters.commands);
                let ping = within_deadline(&mut conn, until, read_timeout, |c| {
                    redis::cmd("PING").query::<()>(c)
                });
                if let Err(e) = ping
                    && is_network_error(&e)
                {
                    self.close(conn);
                    if e.is_timeout() {
                        // Not dead but silent: another connection would wait as long.
                        self.unanswered();
                        return Err(Error::Redis(e));
                    }
                    log::debug!("node {}: idle connection closed: {e}", self.id);
                    continue;
                }
            }
            Counters::inc(&self.counters.commands);
            let reply = within_deadline(&mut conn, until, read_timeout, &mut *commands);
            match reply {
                // The node answered; its replicas did not acknowledge by the deadline, and
                // the `WAIT`'s reply is still due on the connection: the connection goes,
                // the node is neither silent nor suspected of having moved.
                Err(e) if is_wait_cut(&e) => {
                    conn.discard();
                    self.silent.store(false, Relaxed);
                    return Err(Error::Redis(e));
                }
                Err(e) if is_network_error(&e) => {
                    self.close(conn);
                    self.unanswered();
                    if *tries >= retry.times
                        || (e.is_timeout() && !retry.after_timeout)
                        || past(deadline)
                    {
                        return Err(Error::Redis(e));
                    }
                    *tries += 1;
                    log::debug!("node {}: retrying after network error: {e}", self.id);
                }
                reply => {
                    self.silent.store(false, Relaxed);
                    return reply.map_err(Error::Redis);
                }
            }
        }
    }

    /// A pooled connection, within `deadline` (see [`Pool::get_until`]); a node that gives
    /// none is noted as [`send`](Self::send) says.
    fn connection(&self, deadline: Option<Instant>) -> Result<PooledConn<'_>> {
        match self.pool.get_until(deadline) {
            Ok(conn) => Ok(conn),
            // Every connection busy: the client's own load, not the node's fault (it
            // answers the calls that hold them). Neither silent nor moved: a slot map
            // read on every exhausted call would add to the load.
            Err(Error::PoolExhausted) => Err(Error::PoolExhausted),
            Err(e) => {
                self.silent.store(true, Relaxed);
                // A node that refuses connections may have been replaced (a master
                // killed in a cluster, or one the sentinels replaced).
                if e.is_connection() {
                    self.pool.note_fault();
                    self.path.fault();
                }
                Err(e)
            }
        }
    }

    /// Closes a connection a network error showed dead, and the idle ones beside it, which
    /// the same cause (a restart, a network fault) most likely closed too.
    fn close(&self, mut conn: PooledConn<'_>) {
        conn.discard();
        drop(conn);
        self.pool.clear_idle();
    }

    /// A command got no reply: the node is asked last where any will do (`silent`), and
    /// the pool and the call path are told, since the node may have moved.
    fn unanswered(&self) {
        self.silent.store(true, Relaxed);
        self.pool.note_fault();
        self.path.fault();
    }

    /// Runs an acquire `call` of `script`, retried as `retry` says within `deadline`.
    /// When `took` says its reply took the lock and `replica_ack` asks, `WAIT`s on the
    /// same connection (`WAIT` counts that connection's writes), within what remains of
    /// the call's deadline (see [`wait_replicas_until`](Self::wait_replicas_until)); the
    /// reply, and how many replicas acknowledged when fewer than asked. `again`, when
    /// given, makes the call sent after the first (which may have run): one that takes out
    /// what a first send may have left (its mark, when it failed and will wait). Last,
    /// whether the reply is a retry's: the first send may still land, later.
    pub fn run_acquire<T: FromRedisValue>(
        &self,
        script: &Lua,
        (call, again): (&Cmd, Option<&dyn Fn() -> Cmd>),
        retry: Retry,
        deadline: Option<Instant>,
        took: impl Fn(&T) -> bool,
    ) -> Result<(T, Option<usize>, bool)> {
        // The deadline the call path gives the call as a whole, reckoned as it does, where
        // the call begins (a moment before it: no later).
        let until = call_deadline(deadline);
        let mut retried: Option<Cmd> = None;
        let (mut sent, mut resent) = (false, false);
        // The reply of an acquisition whose `WAIT` the deadline cut short: the hold is
        // ours, with fewer acknowledgements than asked.
        let mut cut: Option<T> = None;
        let outcome = self.run_whole(retry, deadline, |c, before| {
            let call = match again {
                Some(again) if sent => &*retried.get_or_insert_with(again),
                _ => call,
            };
            resent |= sent;
            sent = true;
            let reply: T = script.run(call, c, before)?;
            let acked = match self.ack {
                Some(_) if took(&reply) => match self.wait_replicas_until(c, until) {
                    // Failed, so that the connection, which still owes the `WAIT`'s
                    // reply, is dropped (see `send`); the hold is ours all the same.
                    Err(e) if is_wait_cut(&e) => {
                        cut = Some(reply);
                        return Err(e);
                    }
                    acked => Some(acked?),
                },
                _ => None,
            };
            Ok((reply, acked))
        });
        let (reply, acked) = match (outcome, cut) {
            (Ok(outcome), _) => outcome,
            // A cut ends the call (see `send`): the send that took the hold was the last,
            // and the caller gives it back as it does any hold too few replicas
            // acknowledged.
            (Err(_), Some(reply)) => {
                log::debug!("node {}: {WAIT_CUT}", self.id);
                (reply, Some(self.unseen_acks()))
            }
            (Err(e), None) => return Err(e),
        };
        let unacked = match (acked, self.ack) {
            (Some(acked), Some((wanted, _))) if acked < wanted => Some(acked),
            _ => None,
        };
        Ok((reply, unacked, resent))
    }

    /// `WAIT` for the replicas `replica_ack` asks for, in a call without a deadline (a
    /// renewal); how many acknowledged.
    pub(crate) fn wait_replicas(&self, c: &mut Connection) -> RedisResult<usize> {
        self.wait_replicas_until(c, None)
    }

    /// `WAIT` for the replicas `replica_ack` asks for, in a call that must be over by
    /// `until` (from [`call_deadline`]); how many acknowledged. The `WAIT`'s own timeout
    /// and its read are cut to what remains of `until`, leaving the server time to answer
    /// before it (see [`wait_timeout`]); with nothing left, no `WAIT` is sent, and fewer
    /// than asked acknowledged (see [`unseen_acks`](Self::unseen_acks)). A read the
    /// deadline cut short fails with [`wait_cut`] (the connection still owes the reply).
    fn wait_replicas_until(
        &self,
        c: &mut Connection,
        until: Option<Instant>,
    ) -> RedisResult<usize> {
        let Some((wanted, timeout)) = self.ack else {
            return Ok(0);
        };
        let left = until.map(|u| u.saturating_duration_since(Instant::now()));
        if left.is_some_and(|left| left.is_zero()) {
            return Ok(self.unseen_acks());
        }
        let timeout = wait_timeout(timeout, left);
        Counters::inc(&self.counters.commands);
        // WAIT answers after its own timeout at the latest: give its reply that long even
        // when the caller's deadline shortened the connection's read timeout, but no
        // longer than what remains of that deadline.
        let (_, read_timeout, _) = self.pool.timeouts();
        let patient = read_timeout.max(timeout + Duration::from_millis(500));
        c.set_read_timeout(Some(bounded(patient, until)))?;
        let acked: RedisResult<i64> = redis::cmd("WAIT").arg(wanted).arg(millis(timeout)).query(c);
        if let Err(e) = &acked
            && e.is_timeout()
            && past(until)
        {
            return Err(wait_cut());
        }
        // Put back after an error reply too (an ACL refusing `WAIT`): the connection goes
        // back to the pool, whose next borrower expects the pool's read timeout.
        if !acked.as_ref().is_err_and(is_network_error) {
            c.set_read_timeout(Some(read_timeout))?;
        }
        let acked = usize::try_from(acked?).unwrap_or(0);
        self.last_acked.store(acked, Relaxed);
        Ok(acked)
    }

    /// How many replicas acknowledged a `WAIT` that got no answer by the call's deadline
    /// (cut short, or never sent): it saw none, but the replicas that acknowledged the
    /// node's last answered `WAIT` most likely did again, so their count (fewer than
    /// asked: the hold counts as not acknowledged) tells how many are missing where none
    /// would say that all are.
    fn unseen_acks(&self) -> usize {
        let wanted = self.ack.map_or(0, |(wanted, _)| wanted);
        self.last_acked.load(Relaxed).min(wanted.saturating_sub(1))
    }

    /// How long an idle fencing counter lives, in ms.
    pub fn fence_ttl_ms(&self) -> u64 {
        self.fence_ttl_ms
    }

    /// The lease of a write grant, in ms (see `grant_ms`).
    pub fn grant_ms(&self) -> u64 {
        self.grant_ms
    }

    /// This client's id, sent with failed attempts so that our own subscriber ignores
    /// our own marks.
    pub fn client_id(&self) -> &str {
        &self.client_id
    }

    /// What a script call needs from this node (see [`Site`]), its publish mode learnt
    /// within `deadline` (see [`publish_mode`](Self::publish_mode)).
    pub fn site(&self, deadline: Option<Instant>) -> Result<Site<'_>> {
        Ok(self.site_with(self.publish_mode(deadline)?))
    }

    /// [`site`](Self::site) when it is known without asking the node (`None` before the
    /// node's first connection): for a call sent only on an idle pooled connection, which
    /// a node never reached has none of.
    pub fn known_site(&self) -> Option<Site<'_>> {
        let sharded = self.pool.sharded.known()?;
        Some(self.site_with(mode_arg(sharded)))
    }

    fn site_with(&self, publish: &'static str) -> Site<'_> {
        Site {
            client_id: &self.client_id,
            fence_ttl_ms: self.fence_ttl_ms,
            publish,
        }
    }

    /// The reply to a `call` of `script` the subscriber thread sent early (see `early`),
    /// from its raw reply. When the reply was lost, the server lacked the script, or the
    /// call path would have sent the call on (see [`CallPath::resend`]), the call is made
    /// again the usual way with the same arguments: an acquire script recognises its own
    /// token. With it, whether it was made again after the reply was lost: the early send
    /// may still land, later.
    pub fn finish_early<T: FromRedisValue>(
        &self,
        reply: RedisResult<Value>,
        script: &Lua,
        call: &Cmd,
        retry: Retry,
        deadline: Option<Instant>,
    ) -> Result<(T, bool)> {
        Counters::inc(&self.counters.commands);
        Counters::inc(&self.counters.early_attempts);
        let parsed = reply
            .and_then(Value::extract_error)
            .and_then(|v| Ok(redis::from_redis_value::<T>(v)?));
        match parsed {
            Ok(v) => Ok((v, false)),
            Err(e) if is_network_error(&e) || scripts::is_noscript(&e) || self.path.resend(&e) => {
                let lost = is_network_error(&e).then(|| e.clone());
                if lost.is_some() {
                    self.pool.clear_idle();
                }
                log::debug!("node {}: early attempt failed: {e}; retrying", self.id);
                // The early attempt whose reply was lost may have run, whatever the retry
                // meets (see `call`).
                let resent = lost.is_some();
                self.run_script(script, call, retry, deadline)
                    .map(|v| (v, resent))
                    .map_err(|e| unknown_outcome(e, lost))
            }
            Err(e) => Err(Error::Redis(e)),
        }
    }

    /// The client's counters.
    pub(crate) fn counters(&self) -> &Counters {
        &self.counters
    }

    /// Raises the key's fencing counter to at least `fence`, within the `deadline` of the
    /// call that won the hold, if it has one.
    pub fn raise_fence(&self, keys: &Keys, fence: u64, deadline: Option<Instant>) -> Result<()> {
        let mut call = RAISE_FENCE.call(1);
        call.arg(keys.fence()).arg(fence).arg(self.fence_ttl_ms);
        self.run_script::<i64>(&RAISE_FENCE, &call, Retry::ON_RESET, deadline)?;
        Ok(())
    }

    /// Runs a release `call` of `script` (1 released, 0 gone, -1 another owner; 2 passed on,
    /// for the releases and leaves that grant), with `narrow`, its narrower form (a script
    /// and the call it makes, naming the lock key alone), run instead at once when the call
    /// path says so ([`Sent::Narrow`]: the server refused the keys of `call` together).
    /// `deadline`: a waiter's leaving keeps its wait's (see [`Call::deadline`]); a release
    /// has none, its retries bound it.
    pub(crate) fn release_with(
        &self,
        script: &Lua,
        call: &Cmd,
        retry: Retry,
        narrow: Option<(&Lua, &dyn Fn() -> Cmd)>,
        deadline: Option<Instant>,
    ) -> Result<ReleaseReply> {
        self.release_again(script, (call, None), retry, narrow, deadline, false)
    }

    /// [`release_with`](Self::release_with), with `again`, when given, making the call
    /// sent after a try whose reply was lost: one that can tell, when it finds the key
    /// gone, whether that try released it (status 3: it did not, see `scripts::RELEASE`).
    /// `resent`: a try of this release made by an earlier call (a failover ridden through,
    /// see `ride`) may have run, so every try of this one is sent and read as such a retry.
    pub(crate) fn release_again(
        &self,
        script: &Lua,
        (call, again): (&Cmd, Option<&dyn Fn() -> Cmd>),
        retry: Retry,
        narrow: Option<(&Lua, &dyn Fn() -> Cmd)>,
        deadline: Option<Instant>,
        resent: bool,
    ) -> Result<ReleaseReply> {
        let mut tries = ReleaseTries {
            deadline,
            resent,
            ..ReleaseTries::default()
        };
        let mut retried: Option<Cmd> = None;
        let mut reply = tries.call(self, retry, narrow.is_some(), |c, before, after_lost| {
            let call = match again {
                Some(again) if after_lost => &*retried.get_or_insert_with(again),
                _ => call,
            };
            script.run::<i64>(call, c, before)
        });
        if let (Ok(None), Some((narrow, narrow_call))) = (&reply, narrow) {
            let narrow_call = narrow_call();
            reply = tries.call(self, retry, false, |c, before, _| {
                narrow.run::<i64>(&narrow_call, c, before)
            });
        }
        let reply = reply.map_err(|e| tries.error(e))?;
        let Some(reply) = reply else {
            return Err(Error::Protocol("release refused".to_owned()));
        };
        release_reply(reply, tries.retried)
    }

    /// Runs release `calls` of `script` (a multi-lock's locks of one hash slot) in one
    /// round trip, one status each (as [`release_with`](Self::release_with) reads it); `None`
    /// when the call path says the server refused their keys together (a Redis Cluster
    /// slot migrating): the caller then releases them one by one. `again` and `resent` as
    /// for [`release_again`](Self::release_again): the calls sent after a try whose reply
    /// was lost, which read the fence counters of the keys they find gone.
    pub(crate) fn release_all(
        &self,
        script: &Lua,
        (calls, again): (&[Cmd], Option<&dyn Fn() -> Vec<Cmd>>),
        retry: Retry,
        resent: bool,
    ) -> Result<Option<Vec<ReleaseReply>>> {
        let mut tries = ReleaseTries {
            resent,
            ..ReleaseTries::default()
        };
        let mut retried: Option<Vec<Cmd>> = None;
        let statuses = tries.call(self, retry, true, |c, before, after_lost| {
            let calls = match again {
                Some(again) if after_lost => &retried.get_or_insert_with(again)[..],
                _ => calls,
            };
            scripts::run_pipelined::<i64>(&[script], calls, c, before)
        });
        let Some(statuses) = statuses.map_err(|e| tries.error(e))? else {
            return Ok(None);
        };
        if statuses.len() != calls.len() {
            return Err(Error::Protocol(format!(
                "release replied {} statuses for {} calls",
                statuses.len(),
                calls.len()
            )));
        }
        let replies = statuses
            .into_iter()
            .map(|s| release_reply(s, tries.retried));
        replies.collect::<Result<_>>().map(Some)
    }

    /// The last argument of a script that publishes on the library channel: `s` when this
    /// node's channels are sharded (see `sharded`). The pool's connections ask when they
    /// open; before the first one (a node down when the client started, a Cluster master
    /// met later), a connection is opened now, within the caller's `deadline` as the
    /// call's own would be (the command that follows then uses it). When none can be, the
    /// error the call would meet: a guess could publish where no waiter listens.
    pub fn publish_mode(&self, deadline: Option<Instant>) -> Result<&'static str> {
        let sharded = match self.pool.sharded.known() {
            Some(sharded) => sharded,
            None => {
                // A node skipped is not touched (see `skip`): the call fails at once, as
                // it would have.
                if let Some(e) = crate::proto::skip::skipped() {
                    return Err(Error::Redis(e));
                }
                // A call of its own: opening a connection takes several replies.
                drop(self.connection(call_deadline(deadline))?);
                // Every connection the pool lends was probed when it opened.
                self.pool.sharded.known().unwrap_or(false)
            }
        };
        Ok(mode_arg(sharded))
    }

    /// Redis Cluster: the server dropped a shard channel of this node without being asked,
    /// which it does when the channel's slot moves to another master. Has the topology
    /// read the layout again at the next route.
    pub fn slot_moved(&self) {
        self.path.fault();
    }
}

/// The script argument that says how a node publishes (see [`Node::publish_mode`]).
fn mode_arg(sharded: bool) -> &'static str {
    if sharded { "s" } else { "c" }
}

/// The tries of one release on a node: whether a try lost its reply (it may have done
/// what a later try finds done: deleted the key, or passed it on). A redirected or
/// refused try did not run.
#[derive(Default)]
struct ReleaseTries {
    /// The error of the first try whose reply was lost, if one was.
    lost_reply: Option<RedisError>,
    /// A try ran after one whose reply was lost.
    retried: bool,
    /// The caller's, if it has one (see [`Call::deadline`]).
    deadline: Option<Instant>,
    /// A try of the release made by an earlier call may have run: every try is a retry.
    resent: bool,
}

impl ReleaseTries {
    /// Runs `f` through `node`'s call path (see [`Node::call`]) within the caller's
    /// deadline, if any (a release has none: its retries bound it), noting lost replies;
    /// `f`'s last argument says whether a try before lost its reply.
    fn call<T>(
        &mut self,
        node: &Node,
        retry: Retry,
        narrower: bool,
        mut f: impl FnMut(&mut Connection, Option<&Cmd>, bool) -> RedisResult<T>,
    ) -> Result<Option<T>> {
        let how = Call {
            retry,
            deadline: self.deadline,
            narrower,
        };
        node.call(how, |c, before| {
            let after_lost = self.resent || self.lost_reply.is_some();
            self.retried |= after_lost;
            let reply = f(c, before, after_lost);
            if let Err(e) = &reply
                && is_network_error(e)
            {
                self.lost_reply.get_or_insert_with(|| e.clone());
            }
            reply
        })
    }

    /// What a release whose last try failed with `e` reports: `e`, unless `e` says the
    /// release did not run (a refused connection, a refused slot) while an earlier try
    /// lost its reply: that try may have run, which a caller that tries again (through a
    /// failover) must know, so the earlier error is reported.
    fn error(&self, e: Error) -> Error {
        unknown_outcome(e, self.lost_reply.clone())
    }
}

/// What a release script's status says (2 passed on, 1 released, 0 gone, -1 another
/// owner; 3 gone, and a retry proved that no earlier try released it); `retried`: an
/// earlier try of the call lost its reply, and may have done it.
pub(crate) fn release_reply(status: i64, retried: bool) -> Result<ReleaseReply> {
    let reply = match status {
        3 => return Ok(ReleaseReply::NotReleased),
        1 => ReleaseReply::Released,
        2 => ReleaseReply::Passed,
        0 => ReleaseReply::Gone,
        -1 => ReleaseReply::Other,
        n => return Err(Error::Protocol(format!("release replied {n}"))),
    };
    Ok(if retried { reply.as_retried() } else { reply })
}

/// The error of a call whose last try failed with `e`, when an earlier try lost its reply
/// with `lost`: `e`, unless `e` says the call did not run while the lost try may have.
fn unknown_outcome(e: Error, lost: Option<RedisError>) -> Error {
    match lost {
        Some(lost) if !may_have_run(&e) => Error::Redis(lost),
        _ => e,
    }
}

/// Whether a failed command may have reached Redis (and so may have taken effect).
pub(crate) fn may_have_run(e: &Error) -> bool {
    match e {
        // Refused before it ran (`TRYAGAIN`).
        Error::PoolExhausted | Error::SlotMigrating => false,
        Error::Redis(e) => !e.is_connection_refusal(),
        _ => true,
    }
}

/// Whether `deadline` has passed.
pub(crate) fn past(deadline: Option<Instant>) -> bool {
    deadline.is_some_and(|d| Instant::now() >= d)
}

/// A duration in whole milliseconds, at least 1, for a script argument.
pub(crate) fn millis(d: Duration) -> u64 {
    crate::clock::millis(d).max(1)
}

/// A fresh owner token: a random UUID v4, from the thread-local CSPRNG (seeded by the OS)
/// rather than a `getrandom` system call per lock.
pub(crate) fn new_token() -> String {
    uuid::Builder::from_random_bytes(rand::random())
        .into_uuid()
        .hyphenated()
        .to_string()
}
