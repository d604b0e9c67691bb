//! One Redis node: its connection pool, and running commands and scripts on it (retries,
//! redirects, replica acknowledgements). Which lock scripts it runs, with which
//! arguments, is the route's protocol's (see `protocol`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use redis::{Cmd, Connection, RedisResult, Value};

use crate::config::Config;
use crate::error::{Error, Result, is_network_error};
use crate::proto::connect::open_client;
use crate::proto::keys::Keys;
use crate::proto::pool::Pool;
use crate::proto::scripts::{self, EXTEND, EXTEND_UNORDERED, Lua, RAISE_FENCE};
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
}

/// What a compare-and-extend found for one key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ExtendReply {
    Extended,
    Gone,
    Other,
    /// Ours, but a newer change of the lease was applied: this one was refused. Says
    /// nothing the holder can use (the newer change's own reply does): counted as no
    /// answer, never as a loss.
    Stale,
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

/// The shortest read timeout an attempt gets, however close the caller's deadline.
const MIN_ATTEMPT: Duration = Duration::from_millis(50);

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

/// Where a node sends a command that its server redirected (Redis Cluster `MOVED` and
/// `ASK`), and whom it tells of a failure that may mean the cluster's layout changed. The
/// topology implements it; a node holds it weakly (the topology holds the nodes).
pub(crate) trait Redirect: Send + Sync {
    /// The node at `addr` (`host:port`) that a redirect for `slot` names; `moved`: the
    /// slot now belongs to it (`MOVED`), rather than for this one command (`ASK`).
    fn follow(&self, slot: u16, addr: &str, moved: bool) -> Option<Arc<Node>>;
    /// A command failed in a way that may mean a master moved (a network error,
    /// `CLUSTERDOWN`): look at the layout again soon.
    fn fault(&self);
}

/// Most redirects one command follows: a slot moves at most a few times in a row.
const MAX_HOPS: u32 = 5;
/// How long `TRYAGAIN` (keys of one command half-way through a slot migration) and
/// `CLUSTERDOWN` (a failover in progress) are retried when the caller set no deadline.
const CLUSTER_SETTLE: Duration = Duration::from_secs(2);
/// The first pause before a command refused with `TRYAGAIN` or `CLUSTERDOWN` is sent
/// again; each pause doubles, up to [`MAX_SETTLE_PAUSE`]. A resharding tool moves a
/// slot's keys in milliseconds, so the first tries come soon; one left half-way (a tool
/// that died) costs a waiter four commands a second, not a hundred.
const FIRST_SETTLE_PAUSE: Duration = Duration::from_millis(10);
const MAX_SETTLE_PAUSE: Duration = Duration::from_millis(250);

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
    /// `replica_ack`: replicas that must acknowledge an acquisition or renewal, and how
    /// long to wait for them.
    ack: Option<(usize, Duration)>,
    /// Redis Cluster: who follows this node's redirects.
    redirect: Option<std::sync::Weak<dyn Redirect>>,
    /// The last command got no reply (a network error or a timeout): asked last when
    /// any node will do (the cluster's slot map).
    silent: std::sync::atomic::AtomicBool,
}

impl Node {
    /// Whether the last command got a reply (see `silent`).
    pub fn answering(&self) -> bool {
        !self.silent.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// A node at `url`; `label` names it in errors (the URL may hold a password).
    pub fn new(
        label: &str,
        url: &str,
        cfg: &Config,
        counters: Arc<Counters>,
        client_id: Arc<str>,
    ) -> Result<Self> {
        let client = open_client(label, url, &cfg.tls)?;
        Ok(Self::at(client, cfg, counters, client_id))
    }

    /// A node named by the address and database of `client`.
    pub fn at(
        client: redis::Client,
        cfg: &Config,
        counters: Arc<Counters>,
        client_id: Arc<str>,
    ) -> Self {
        let info = client.get_connection_info();
        let db = info.redis_settings().db();
        let id = NodeId::new(format!("{}/{db}", info.addr()));
        Self::with_client(id, client, cfg, counters, client_id)
    }

    /// This node, with its redirects followed by `hook` (Redis Cluster).
    pub fn with_redirect(mut self, hook: std::sync::Weak<dyn Redirect>) -> Self {
        self.redirect = Some(hook);
        self
    }

    /// Who follows this node's redirects, while the topology lives.
    fn hook(&self) -> Option<Arc<dyn Redirect>> {
        self.redirect.as_ref().and_then(std::sync::Weak::upgrade)
    }

    /// A node named `id` whose connections go through `client` (a role, such as a
    /// Sentinel-managed master, whose address may change: see [`Pool::repoint`]).
    pub fn with_client(
        id: NodeId,
        client: redis::Client,
        cfg: &Config,
        counters: Arc<Counters>,
        client_id: Arc<str>,
    ) -> Self {
        let db = client.get_connection_info().redis_settings().db();
        Node {
            id,
            pool: Arc::new(Pool::new(client, cfg)),
            db,
            counters,
            client_id,
            fence_ttl_ms: millis(cfg.fence_ttl),
            ack: cfg.replica_ack,
            redirect: None,
            silent: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Runs one command on a pooled connection. A network failure discards the connection
    /// (its reply may still arrive) and every idle one (a server restart kills them all),
    /// then retries on fresh connections as `retry` says: callers pass retries only for
    /// idempotent commands.
    pub fn run<T>(
        &self,
        retry: Retry,
        f: impl FnMut(&mut Connection) -> RedisResult<T>,
    ) -> Result<T> {
        self.run_until(retry, None, f)
    }

    /// [`run`](Self::run), within the caller's `deadline`: each read waits at most until
    /// the deadline (but [`MIN_ATTEMPT`] at least, so an attempt has a chance), and
    /// nothing is retried once it has passed.
    ///
    /// In a Redis Cluster, a `MOVED` or `ASK` reply sends the command to the node it names
    /// (after `ASKING` for `ASK`): the command did not run, so it is safe to send again.
    /// `TRYAGAIN` and `CLUSTERDOWN` are retried after growing pauses, within the deadline
    /// (or [`CLUSTER_SETTLE`] without one); a `TRYAGAIN` that outlasts it gives
    /// [`Error::SlotMigrating`].
    ///
    /// `TRYAGAIN` is what a slot migration does to a command naming several keys
    /// (Redis's `getNodeByQuery`, `src/cluster.c`): the source (`MIGRATING`) runs it when
    /// all of its keys exist there, sends `ASK` when none does, and refuses it when only
    /// some do; the target (`IMPORTING`), after `ASKING`, runs it when its keys are one,
    /// or all exist there, and refuses it otherwise. A script's keys are its declared
    /// `KEYS` (EVALSHA is no exception), and every command it runs is checked the same
    /// way, so a script cannot create a key on the source either. Waiting is the only
    /// safe answer for an acquire: the lock key of a free lock exists nowhere, its fence
    /// counter may still be on the source, and taking the lock on the target with a
    /// counter of its own would issue tokens that go backwards (and break the
    /// migration of the old counter). The server never runs one lock's script on both
    /// masters, and a refused command did not run, so sending it again is safe.
    pub fn run_until<T>(
        &self,
        retry: Retry,
        deadline: Option<Instant>,
        mut f: impl FnMut(&mut Connection) -> RedisResult<T>,
    ) -> Result<T> {
        if let Some(e) = crate::proto::skip::skipped() {
            return Err(Error::Redis(e));
        }
        self.run_hop(retry, deadline, false, 0, &mut f)
    }

    /// [`run_until`](Self::run_until) on this node, the `hops`-th redirect of a command;
    /// `asking`: the redirect was an `ASK`.
    fn run_hop<T>(
        &self,
        retry: Retry,
        deadline: Option<Instant>,
        asking: bool,
        hops: u32,
        f: &mut dyn FnMut(&mut Connection) -> RedisResult<T>,
    ) -> Result<T> {
        let (_, read_timeout, _) = self.pool.timeouts();
        let mut tries = 0;
        let settle_until = deadline.unwrap_or_else(|| Instant::now() + CLUSTER_SETTLE);
        let mut settle_pause = FIRST_SETTLE_PAUSE;
        loop {
            let mut conn = match self.pool.get() {
                Ok(conn) => conn,
                Err(e) => {
                    self.silent
                        .store(true, std::sync::atomic::Ordering::Relaxed);
                    // A node that refuses connections may have been replaced (a master
                    // killed in a cluster): look at the layout again.
                    if e.is_connection()
                        && let Some(hook) = self.hook()
                    {
                        hook.fault();
                    }
                    return Err(e);
                }
            };
            Counters::inc(&self.counters.commands);
            let reply = within_deadline(&mut conn, deadline, read_timeout, |c| {
                if asking {
                    redis::cmd("ASKING").query::<()>(c)?;
                }
                f(c)
            });
            self.silent.store(
                reply.as_ref().is_err_and(is_network_error),
                std::sync::atomic::Ordering::Relaxed,
            );
            match reply {
                Ok(v) => return Ok(v),
                Err(e) if e.redirect_node().is_some() && self.redirect.is_some() => {
                    drop(conn);
                    let (addr, slot) = e.redirect_node().expect("checked above");
                    let moved = e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::Moved);
                    let target = self.hook().and_then(|hook| hook.follow(slot, addr, moved));
                    match target {
                        Some(node) if hops < MAX_HOPS => {
                            Counters::inc(&self.counters.redirects);
                            log::debug!("node {}: {e}; following to {}", self.id, node.id);
                            return node.run_hop(retry, deadline, !moved, hops + 1, f);
                        }
                        _ => return Err(Error::Redis(e)),
                    }
                }
                Err(e) if is_settling(&e) && self.redirect.is_some() => {
                    // The command did not run: a slot is half-way through a migration, or
                    // the cluster is electing a new master. Wait a little and send it again
                    // (here: an `ASK` is followed again from the source, whose keys may
                    // have moved meanwhile).
                    drop(conn);
                    let migrating = is_migrating(&e);
                    if !migrating && let Some(hook) = self.hook() {
                        // A migrating slot keeps its owner until it has moved (then `MOVED`
                        // says so); an election may give it another.
                        hook.fault();
                    }
                    let jitter = rand::random_range(0..=settle_pause.as_millis() as u64 / 2);
                    let pause = settle_pause + Duration::from_millis(jitter);
                    if Instant::now() + pause >= settle_until {
                        if migrating {
                            log::debug!("node {}: slot still migrating: {e}", self.id);
                            return Err(Error::SlotMigrating);
                        }
                        return Err(Error::Redis(e));
                    }
                    std::thread::sleep(pause);
                    settle_pause = (settle_pause * 2).min(MAX_SETTLE_PAUSE);
                }
                Err(e) if is_network_error(&e) => {
                    conn.discard();
                    drop(conn);
                    self.pool.clear_idle();
                    self.pool.note_fault();
                    if let Some(hook) = self.hook() {
                        hook.fault();
                    }
                    let late = deadline.is_some_and(|d| Instant::now() >= d);
                    if tries >= retry.times || (e.is_timeout() && !retry.after_timeout) || late {
                        return Err(Error::Redis(e));
                    }
                    tries += 1;
                    log::debug!("node {}: retrying after network error: {e}", self.id);
                }
                Err(e) if e.code() == Some("READONLY") => {
                    // A master demoted under us (a failover): whoever follows the node's
                    // address looks again; the command is retried if the caller allows.
                    drop(conn);
                    self.pool.clear_idle();
                    self.pool.note_fault();
                    let late = deadline.is_some_and(|d| Instant::now() >= d);
                    if tries >= retry.times || late {
                        return Err(Error::Redis(e));
                    }
                    tries += 1;
                    std::thread::sleep(Duration::from_millis(50));
                }
                Err(e) => return Err(Error::Redis(e)),
            }
        }
    }

    /// Runs an acquire `call` of `script` (its reply: 1 when it took the lock, and a
    /// number), retried as `retry` says within `deadline`. When it took the lock and
    /// `replica_ack` asks, `WAIT`s on the same connection (`WAIT` counts that
    /// connection's writes); the reply, and how many replicas acknowledged when fewer
    /// than asked.
    pub fn run_acquire(
        &self,
        script: &Lua,
        call: &Cmd,
        retry: Retry,
        deadline: Option<Instant>,
    ) -> Result<((i64, i64), Option<usize>)> {
        let (reply, acked) = self.run_until(retry, deadline, |c| {
            let reply: (i64, i64) = script.run(call, c)?;
            let acked = match (reply.0, self.ack) {
                (1, Some(_)) => Some(self.wait_replicas(c)?),
                _ => None,
            };
            Ok((reply, acked))
        })?;
        let unacked = match (acked, self.ack) {
            (Some(acked), Some((wanted, _))) if acked < wanted => Some(acked),
            _ => None,
        };
        Ok((reply, unacked))
    }

    /// `WAIT` for the replicas `replica_ack` asks for; how many acknowledged.
    fn wait_replicas(&self, c: &mut Connection) -> RedisResult<usize> {
        let Some((wanted, timeout)) = self.ack else {
            return Ok(0);
        };
        Counters::inc(&self.counters.commands);
        // WAIT answers after its own timeout at the latest: give its reply that long even
        // when the caller's deadline shortened the connection's read timeout.
        let (_, read_timeout, _) = self.pool.timeouts();
        c.set_read_timeout(Some(read_timeout.max(timeout + Duration::from_millis(500))))?;
        let acked: i64 = redis::cmd("WAIT")
            .arg(wanted)
            .arg(timeout.as_millis().max(1) as u64)
            .query(c)?;
        c.set_read_timeout(Some(read_timeout))?;
        Ok(usize::try_from(acked).unwrap_or(0))
    }

    /// How long an idle fencing counter lives, in ms.
    pub fn fence_ttl_ms(&self) -> u64 {
        self.fence_ttl_ms
    }

    /// This client's id, sent with failed attempts so that our own subscriber ignores
    /// our own marks.
    pub fn client_id(&self) -> &str {
        &self.client_id
    }

    /// The reply to a `call` of `script` the subscriber thread sent early (see `early`),
    /// from its raw reply. When the reply was lost, the server lacked the script, or
    /// (Redis Cluster) it redirected or refused the call, the call is made again the usual
    /// way with the same arguments: an acquire script recognises its own token.
    pub fn finish_early<T: redis::FromRedisValue>(
        &self,
        reply: RedisResult<Value>,
        script: &Lua,
        call: &Cmd,
        retry: Retry,
        deadline: Option<Instant>,
    ) -> Result<T> {
        Counters::inc(&self.counters.commands);
        Counters::inc(&self.counters.early_attempts);
        let parsed = reply
            .and_then(Value::extract_error)
            .and_then(|v| Ok(redis::from_redis_value::<T>(v)?));
        match parsed {
            Ok(v) => Ok(v),
            Err(e)
                if is_network_error(&e)
                    || scripts::is_noscript(&e)
                    || (self.redirect.is_some()
                        && (e.redirect_node().is_some() || is_settling(&e))) =>
            {
                if is_network_error(&e) {
                    self.pool.clear_idle();
                }
                log::debug!("node {}: early attempt failed: {e}; retrying", self.id);
                self.run_until(retry, deadline, |c| script.run(call, c))
            }
            Err(e) => Err(Error::Redis(e)),
        }
    }

    /// The client's counters.
    pub(crate) fn counters(&self) -> &Counters {
        &self.counters
    }

    /// Raises the key's fencing counter to at least `fence`.
    pub fn raise_fence(&self, keys: &Keys, fence: u64) -> Result<()> {
        self.run(Retry::ON_RESET, |c| {
            let mut call = RAISE_FENCE.call(1);
            call.arg(keys.fence()).arg(fence).arg(self.fence_ttl_ms);
            RAISE_FENCE.run::<i64>(&call, c)
        })?;
        Ok(())
    }

    /// Runs a release `call` of `script` (1 released, 0 gone, -1 another owner).
    pub(crate) fn release_by(
        &self,
        script: &Lua,
        call: &Cmd,
        retry: Retry,
    ) -> Result<ReleaseReply> {
        self.release_with(script, call, retry, None)
    }

    /// [`release_by`](Self::release_by) (also for the fair queue's leave: 2 passed on,
    /// 1 released, 0 nothing ours); when the server refuses `call` because the lock's slot
    /// is migrating (`TRYAGAIN`), the narrow release (a script and the call it makes:
    /// the plain compare-and-delete, naming the lock key alone) is run instead, at once.
    pub(crate) fn release_with(
        &self,
        script: &Lua,
        call: &Cmd,
        retry: Retry,
        narrow: Option<(&Lua, &dyn Fn() -> Cmd)>,
    ) -> Result<ReleaseReply> {
        // Whether an earlier attempt's reply was lost (it may have deleted the key); a
        // redirected or refused attempt did not run.
        let mut lost_reply = false;
        let mut retried = false;
        // `None`: refused as migrating, when `narrowing`.
        let mut attempt = |script: &Lua, call: &Cmd, narrowing: bool| {
            self.run(retry, |c| {
                retried |= lost_reply;
                let reply = match script.run::<i64>(call, c) {
                    Err(e) if narrowing && is_migrating(&e) => return Ok(None),
                    reply => reply,
                };
                lost_reply |= reply.as_ref().is_err_and(is_network_error);
                reply.map(Some)
            })
        };
        let mut reply = attempt(script, call, narrow.is_some())?;
        if let (None, Some((narrow, narrow_call))) = (reply, narrow) {
            reply = attempt(narrow, &narrow_call(), false)?;
        }
        let Some(reply) = reply else {
            return Err(Error::Protocol("release refused".to_owned()));
        };
        match reply {
            1 => Ok(ReleaseReply::Released),
            2 => Ok(ReleaseReply::Passed),
            0 if retried => Ok(ReleaseReply::GoneAfterRetry),
            0 => Ok(ReleaseReply::Gone),
            -1 if retried => Ok(ReleaseReply::OtherAfterRetry),
            -1 => Ok(ReleaseReply::Other),
            n => Err(Error::Protocol(format!("release replied {n}"))),
        }
    }

    /// The last argument of a script that publishes on the library channel: `s` when this
    /// node's channels are sharded (see `sharded`). The pool's connections ask when they
    /// open; before the first one, a connection is opened now (the command that follows
    /// then uses it). If none can be (the node is down), classic: the command fails too.
    pub fn publish_mode(&self) -> &'static str {
        let sharded = self.pool.sharded.known().unwrap_or_else(|| {
            drop(self.pool.get());
            self.pool.sharded.known().unwrap_or(false)
        });
        if sharded { "s" } else { "c" }
    }

    /// Redis Cluster: the server dropped a shard channel of this node without being asked,
    /// which it does when the channel's slot moves to another master. Has the topology
    /// read the layout again at the next route.
    pub fn slot_moved(&self) {
        if let Some(hook) = self.hook() {
            hook.fault();
        }
    }

    /// Compare-and-extend many locks of this node in one round trip, each change ordered
    /// by its number (see `scripts::EXTEND`).
    pub fn extend(&self, locks: &[Change<'_>], lease: Duration) -> Result<Vec<ExtendReply>> {
        let mut replies = self.extend_batches(&[Batch {
            script: &EXTEND,
            locks: locks.to_vec(),
            lease,
            ordered: true,
        }])?;
        Ok(replies.pop().unwrap_or_default())
    }

    /// Runs several renewal batches (each one script call; Redis Cluster: one slot each)
    /// in one round trip, pipelined, with one `WAIT` for all of them when replicas must
    /// acknowledge. One status list per batch.
    pub(crate) fn extend_batches(&self, batches: &[Batch<'_>]) -> Result<Vec<Vec<ExtendReply>>> {
        match self.extend_once(batches)? {
            Some(replies) => Ok(replies),
            None => self.extend_apart(batches),
        }
    }

    /// [`extend_batches`](Self::extend_batches) in one round trip; `None` when the server
    /// refused them because a slot migrates (see [`apart`](Self::apart)).
    fn extend_once(&self, batches: &[Batch<'_>]) -> Result<Option<Vec<Vec<ExtendReply>>>> {
        let calls: Vec<redis::Cmd> = batches.iter().map(Batch::call).collect();
        // Each script once, for reloading after a NOSCRIPT.
        let mut scripts: Vec<&Lua> = Vec::new();
        for b in batches {
            if !scripts.iter().any(|s| std::ptr::eq(*s, b.script)) {
                scripts.push(b.script);
            }
        }
        let outcome = self.run(Retry::ON_RESET, |c| {
            let replies = match calls.as_slice() {
                [one] => scripts[0].run(one, c).map(|r| vec![r]),
                _ => crate::proto::scripts::run_pipelined(&scripts, &calls, c),
            };
            let replies: Vec<Vec<i64>> = match replies {
                Err(e) if self.apart(&e, batches) => return Ok(None),
                replies => replies?,
            };
            let acked = match self.ack {
                Some(_) if replies.iter().flatten().any(|&r| r == 1) => {
                    Some(self.wait_replicas(c)?)
                }
                _ => None,
            };
            Ok(Some((replies, acked)))
        })?;
        let Some((replies, acked)) = outcome else {
            return Ok(None);
        };
        if let (Some(acked), Some((wanted, _))) = (acked, self.ack)
            && acked < wanted
        {
            // Not renewed as far as a failover is concerned: retried until the lease ends.
            return Err(Error::ReplicaAck { acked, wanted });
        }
        if replies.len() != batches.len() {
            return Err(Error::Protocol(format!(
                "extend replied {} lists for {} batches",
                replies.len(),
                batches.len()
            )));
        }
        replies
            .into_iter()
            .zip(batches)
            .map(|(r, b)| extend_replies(r, b.locks.len()))
            .collect::<Result<_>>()
            .map(Some)
    }
}

impl Node {
    /// Whether renewal `batches` that failed with `e` are to be sent again one lock per
    /// call ([`extend_apart`](Self::extend_apart)): Redis Cluster, a slot half-way through
    /// a migration. The server refuses a batch whose keys are not all on one side
    /// (`TRYAGAIN`), and in a pipeline of batches `ASKING` covers only the first, so a
    /// redirect of another one bounces between the masters. One key per call is always
    /// served: where the key is (`ASK` to the target once it moved). Waiting instead
    /// could outlast the leases.
    /// A lock and its lease record count as two keys: a renewal of one ordered lock is
    /// refused too while only one of them has moved, or while the record does not exist
    /// yet (the lock's first lease change).
    fn apart(&self, e: &redis::RedisError, batches: &[Batch<'_>]) -> bool {
        let locks: usize = batches.iter().map(|b| b.locks.len()).sum();
        let ordered = batches.iter().any(|b| b.ordered);
        self.redirect.is_some()
            && (locks > 1 || ordered)
            && (is_migrating(e) || (batches.len() > 1 && is_redirect(e)))
    }

    /// [`extend_batches`](Self::extend_batches), one lock per call, each following its
    /// own redirects (see [`apart`](Self::apart)). Costs a round trip per lock, only
    /// while a slot of this node migrates.
    fn extend_apart(&self, batches: &[Batch<'_>]) -> Result<Vec<Vec<ExtendReply>>> {
        batches
            .iter()
            .map(|b| {
                b.locks
                    .iter()
                    .map(|&lock| {
                        let one = Batch {
                            script: b.script,
                            locks: vec![lock],
                            lease: b.lease,
                            ordered: b.ordered,
                        };
                        let replies = match self.extend_once(&[one])? {
                            Some(replies) => replies,
                            // The lock and its record refused together: the lock alone,
                            // unordered (see `EXTEND_UNORDERED`).
                            None => {
                                let alone = Batch {
                                    script: &EXTEND_UNORDERED,
                                    locks: vec![lock],
                                    lease: b.lease,
                                    ordered: false,
                                };
                                self.extend_once(&[alone])?.ok_or(Error::SlotMigrating)?
                            }
                        };
                        let mut replies = replies;
                        replies
                            .pop()
                            .and_then(|mut list| list.pop())
                            .ok_or_else(|| Error::Protocol("extend replied nothing".to_owned()))
                    })
                    .collect()
            })
            .collect()
    }
}

/// One lease change of one hold: its key, its token (a shared hold's member) and the
/// change's number in the hold's sequence (see `scripts::EXTEND`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Change<'a> {
    pub key: &'a [u8],
    /// The lock's lease record (see `Keys::lease`).
    pub record: &'a [u8],
    pub token: &'a str,
    pub seq: u64,
}

/// One renewal script call: which script, the changes, the new lease, and whether the
/// script orders changes by their numbers (`EXTEND`: keys and lease records in pairs,
/// then a token and a number per lock) or not (`SHARED_EXTEND`: keys, then a member per
/// hold; its holds keep one lease for life, so a late renewal can only lengthen one).
pub(crate) struct Batch<'a> {
    pub script: &'a Lua,
    pub locks: Vec<Change<'a>>,
    pub lease: Duration,
    pub ordered: bool,
}

impl Batch<'_> {
    /// The `EVALSHA` of this batch.
    fn call(&self) -> Cmd {
        let keys = if self.ordered { 2 } else { 1 } * self.locks.len();
        let mut call = self.script.call(keys);
        for c in &self.locks {
            call.arg(c.key);
            if self.ordered {
                call.arg(c.record);
            }
        }
        call.arg(millis(self.lease));
        for c in &self.locks {
            call.arg(c.token);
            if self.ordered {
                call.arg(c.seq);
            }
        }
        call
    }
}

/// One batch's statuses, one per lock: 1 extended, 0 gone, −1 another owner, 2 refused as
/// stale.
fn extend_replies(replies: Vec<i64>, locks: usize) -> Result<Vec<ExtendReply>> {
    if replies.len() != locks {
        return Err(Error::Protocol(format!(
            "extend replied {} statuses for {locks} keys",
            replies.len(),
        )));
    }
    replies
        .into_iter()
        .map(|r| match r {
            1 => Ok(ExtendReply::Extended),
            0 => Ok(ExtendReply::Gone),
            -1 => Ok(ExtendReply::Other),
            2 => Ok(ExtendReply::Stale),
            n => Err(Error::Protocol(format!("extend replied {n}"))),
        })
        .collect()
}

/// Runs `f` on `conn` with its reads bounded by `deadline`: what remains of it, but
/// [`MIN_ATTEMPT`] at least, when that is shorter than `read_timeout`, the connection's
/// usual timeout, which is then put back (after a reply, error replies included). A
/// connection whose timeout cannot be put back fails the call (a network error: the
/// caller drops it).
pub(crate) fn within_deadline<T>(
    conn: &mut Connection,
    deadline: Option<Instant>,
    read_timeout: Duration,
    f: impl FnOnce(&mut Connection) -> RedisResult<T>,
) -> RedisResult<T> {
    let short = deadline
        .map(|d| d.saturating_duration_since(Instant::now()).max(MIN_ATTEMPT))
        .filter(|t| *t < read_timeout);
    let Some(t) = short else {
        return f(conn);
    };
    conn.set_read_timeout(Some(t))?;
    let result = f(conn);
    if result.as_ref().is_err_and(is_network_error) {
        return result; // the connection is dropped anyway
    }
    // Also after an error reply: the connection goes back to the pool.
    conn.set_read_timeout(Some(read_timeout))?;
    result
}

/// `MOVED` or `ASK`, also as the first failure of a pipeline (whose error carries no
/// address: `redirect_node` is `None` there).
fn is_redirect(e: &redis::RedisError) -> bool {
    use redis::{
        ErrorKind::Server,
        ServerErrorKind::{Ask, Moved},
    };
    matches!(e.kind(), Server(Ask) | Server(Moved))
}

/// A Redis Cluster reply saying the command did not run and may be sent again shortly:
/// `TRYAGAIN` (its keys are half-way through a slot migration) or `CLUSTERDOWN`.
fn is_settling(e: &redis::RedisError) -> bool {
    is_migrating(e) || e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::ClusterDown)
}

/// `TRYAGAIN`: the command names several keys of a migrating slot, and the node has only
/// some of them (see [`Node::run_until`]). It did not run.
fn is_migrating(e: &redis::RedisError) -> bool {
    e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::TryAgain)
}

/// Whether `e` is what a Redis Cluster client sees while a master fails over or a slot
/// moves, rather than an answer about the lock: the node cannot be reached (killed, not
/// yet replaced), it no longer takes writes (`READONLY`), the cluster is electing a new
/// master (`CLUSTERDOWN`) or moving keys (`TRYAGAIN`, and [`Error::SlotMigrating`] when
/// a node gave up waiting it out), or redirects did not settle. A
/// refused handshake or refused credentials are not: waiting does not cure them.
pub(crate) fn is_failover_symptom(e: &Error) -> bool {
    if e.is_slot_migrating() {
        return true;
    }
    let Error::Redis(r) = e else {
        return false;
    };
    if e.is_tls() || e.is_auth() {
        return false;
    }
    is_network_error(r)
        || is_settling(r)
        || r.code() == Some("READONLY")
        || r.redirect_node().is_some()
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
