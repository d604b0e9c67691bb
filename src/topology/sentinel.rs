//! A Sentinel-managed master: one node whose address the sentinels decide. The node keeps
//! a stable name (`sentinel:<master name>`), so held locks, subscriptions and the watchdog
//! stay attached to it while its connections move to whichever server is master.
//!
//! A watcher thread follows the sentinels' `+switch-master` messages (on one sentinel at
//! a time: one that knows the master, and answers a ping when it has been quiet), and
//! re-resolves the master when a command on it fails in a way that may mean it moved (a
//! network error or a refused connection, a `READONLY` reply) and every [`RECHECK`] in
//! case a message was missed; calls meanwhile ride through (see `ride`) until it has.
//! Re-resolving asks every sentinel at once for the master's address and the
//! configuration epoch of its answer, then checks with `ROLE` that a server named under
//! the latest epoch is the master, on connections with the client's timeouts; so does the
//! first resolution, when the client is built. A sentinel that missed a failover names
//! the old master under an older epoch, so neither its place in the list nor a new master
//! that does not answer ever takes the client there; a sentinel or master that accepts
//! connections and answers nothing (a stopped process) costs a timeout, and a server named
//! under the latest epoch that is not the master (a replica, a server that does not
//! answer) is passed over for the next one so named, the current master's address
//! included. When the address changes, the node's
//! pool is pointed at the new master: idle connections close, the subscriber reconnects
//! there and re-subscribes (its waiters then retry once), and the watchdog's next renewal
//! goes there — where a lock that the promoted replica did not have is found gone, and
//! its holder told.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use super::Route;
use crate::config::{Config, SentinelConfig, Tls};
use crate::error::{Error, Result, is_auth_error, thread_error};
use crate::proto::node::{Node, NodeId, Parts};
use crate::proto::pool::open_connection;
use crate::proto::protocol::Protocols;
use crate::stats::Counters;

/// How often the master is re-resolved even without a message or a fault.
const RECHECK: Duration = Duration::from_secs(10);
/// How long a read on the sentinel subscription waits before the thread looks at faults.
const POLL: Duration = Duration::from_millis(100);
/// How long the sentinel subscription may stay quiet before it is pinged: a hung sentinel
/// is left for the next one within this and a read timeout.
const KEEPALIVE: Duration = Duration::from_secs(2);
/// How long the other sentinels are waited for once one has named the master: their
/// answers may carry a later epoch, and on a network that answers at all they come within
/// this.
const ANSWER_GRACE: Duration = Duration::from_millis(500);

pub(crate) struct Sentinel {
    route: Route,
    /// How long a call without a deadline rides through a failover: one lease.
    lease: Duration,
    stop: Arc<AtomicBool>,
    thread: crate::worker::Thread,
}

/// What the watcher needs.
struct Watcher {
    /// The master's name, and how to reach it (credentials, database, TLS).
    sc: SentinelConfig,
    tls: Tls,
    node: Weak<Node>,
    /// Clients of the sentinels themselves, for the `+switch-master` subscription and the
    /// master's address.
    sentinels: Vec<redis::Client>,
    address: String,
    connect_timeout: Duration,
    read_timeout: Duration,
    write_timeout: Duration,
    stop: Arc<AtomicBool>,
    counters: Arc<Counters>,
}

impl Sentinel {
    pub fn open(
        sc: &SentinelConfig,
        cfg: &Config,
        counters: &Arc<Counters>,
        client_id: &Arc<str>,
    ) -> Result<Self> {
        let sentinels = sc
            .sentinels
            .iter()
            .enumerate()
            .map(|(i, url)| {
                crate::proto::connect::open_client(&format!("sentinel {i}"), url, &cfg.tls)
            })
            .collect::<Result<Vec<_>>>()?;
        let stop = Arc::new(AtomicBool::new(false));
        let mut watcher = Watcher {
            sc: sc.clone(),
            tls: cfg.tls.clone(),
            node: Weak::new(),
            sentinels,
            address: String::new(),
            connect_timeout: cfg.connect_timeout,
            read_timeout: cfg.read_timeout,
            write_timeout: cfg.write_timeout,
            stop: stop.clone(),
            counters: counters.clone(),
        };
        let (master, address) = watcher.first_master()?;
        log::info!("sentinel: master {:?} is at {address}", sc.master);
        let id = NodeId::new(format!("sentinel:{}", sc.master));
        let parts = Parts {
            counters: counters.clone(),
            client_id: client_id.clone(),
            path: super::call::Path::plain(),
        };
        let node = Arc::new(Node::with_client(id, master, cfg, parts));
        watcher.node = Arc::downgrade(&node);
        watcher.address = address;
        let thread = std::thread::Builder::new()
            .name("redbaton-sentinel".to_owned())
            .spawn(move || watcher.run())
            .map_err(|e| thread_error("sentinel", e))?;
        Ok(Sentinel {
            route: Route::new(Arc::from(vec![node]), Protocols::of(cfg)),
            lease: cfg.lease,
            stop,
            thread: crate::worker::Thread::new(thread),
        })
    }

    pub fn route(&self) -> Route {
        self.route.clone()
    }

    /// How long a call without a deadline waits for the client to follow a failover (see
    /// [`Topology::ride_through`](super::Topology::ride_through)): one lease, as in a
    /// Cluster. Until the watcher points the node at the new master, the old one refuses
    /// writes (`READONLY`) or cannot be reached, and the sentinels take
    /// `down-after-milliseconds` and an election to replace a dead master; a call that
    /// returned the first such error would fail while the master it wants is about to be
    /// named.
    pub fn failover_window(&self) -> Duration {
        self.lease
    }

    /// Stops the watcher and waits for it until `deadline`; `false` if it still runs.
    pub fn shutdown(&self, deadline: Instant) -> bool {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join_until(deadline)
    }
}

impl Drop for Sentinel {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join_now();
    }
}

impl Watcher {
    fn run(mut self) {
        const FIRST_BACKOFF: Duration = Duration::from_millis(50);
        let mut next = 0;
        let mut backoff = FIRST_BACKOFF;
        while !self.stop.load(Ordering::Relaxed) {
            let Some(node) = self.node.upgrade() else {
                return;
            };
            drop(node);
            // One sentinel at a time; the next one when it fails.
            let sentinel = self.sentinels[next % self.sentinels.len()].clone();
            next += 1;
            let began = Instant::now();
            match self.follow(&sentinel) {
                Ok(()) => return,
                Err(e) => {
                    // A subscription that served a while is a new failure, not one more
                    // of a run: it waits the first pause again, not the longest.
                    if began.elapsed() >= RECHECK {
                        backoff = FIRST_BACKOFF;
                    }
                    log::debug!("sentinel: subscription lost: {e}; trying the next sentinel");
                    // Whatever was missed meanwhile: look now.
                    self.resolve();
                    self.pause(backoff);
                    backoff = (backoff * 2).min(Duration::from_secs(1));
                }
            }
        }
    }

    /// Sleeps for `d`, or until the client stops (a drop waits for this thread).
    fn pause(&self, d: Duration) {
        let until = Instant::now() + d;
        while !self.stop.load(Ordering::Relaxed) {
            let Some(left) = until.checked_duration_since(Instant::now()) else {
                return;
            };
            std::thread::sleep(left.min(POLL));
        }
    }

    /// Listens to one sentinel's `+switch-master` until it fails (`Err`) or the client
    /// stops (`Ok`). A sentinel that does not know the master (it answers `nil` for the
    /// name) is not listened to: it would never announce this master's failover. Nor is
    /// one that stops answering: a sentinel that hangs with its connections open (a
    /// stopped process, a silent partition) delivers no message and no error, so the
    /// subscription is pinged when it has been quiet for [`KEEPALIVE`], and left for the
    /// next sentinel when the pong does not come within the read timeout.
    fn follow(&mut self, sentinel: &redis::Client) -> redis::RedisResult<()> {
        // Named, and every read (the subscription's confirmation included) bounded: a
        // sentinel that accepts connections and answers nothing must not hold the
        // watcher (nor the client's drop, which joins it).
        let mut conn = self.connect(sentinel, "redbaton:sentinel")?;
        let named: Option<(String, u16)> = redis::cmd("SENTINEL")
            .arg("GET-MASTER-ADDR-BY-NAME")
            .arg(&self.sc.master)
            .query(&mut conn)?;
        if named.is_none() {
            return Err(redis::RedisError::from((
                redis::ErrorKind::MasterNameNotFoundBySentinel,
                "this sentinel does not know the master",
            )));
        }
        let mut ps = conn.as_pubsub();
        ps.subscribe("+switch-master")?;
        ps.set_read_timeout(Some(POLL))?;
        // A switch may have happened before the subscription.
        self.resolve();
        let mut last_check = Instant::now();
        let mut heard = Instant::now();
        loop {
            if self.stop.load(Ordering::Relaxed) {
                return Ok(());
            }
            match ps.get_message() {
                Ok(msg) => {
                    heard = Instant::now();
                    let payload: String = msg.get_payload().unwrap_or_default();
                    // "<name> <old ip> <old port> <new ip> <new port>"
                    if payload.split(' ').next() == Some(self.sc.master.as_str()) {
                        log::info!("sentinel: +switch-master {payload}");
                        self.resolve();
                        last_check = Instant::now();
                    }
                }
                Err(e) if e.is_timeout() => {}
                Err(e) => return Err(e),
            }
            if heard.elapsed() >= KEEPALIVE {
                ps.set_read_timeout(Some(self.read_timeout))?;
                let _: redis::Value = ps.ping()?;
                ps.set_read_timeout(Some(POLL))?;
                heard = Instant::now();
            }
            // Taken after the read, not before it: a fault the node met while the read
            // waited is acted on now, not one read later (a call rides until then).
            let Some(node) = self.node.upgrade() else {
                return Ok(());
            };
            let fault = node.pool.take_fault();
            drop(node);
            if fault || last_check.elapsed() >= RECHECK {
                self.resolve();
                last_check = Instant::now();
            }
        }
    }

    /// Asks the sentinels where the master is, and moves the node there if it moved and
    /// says it is the master (`ROLE`). Every connection has the client's timeouts: a
    /// master or sentinel that accepts connections but never answers (a stopped
    /// process) must not hold the watcher, which alone can follow the failover away from
    /// it.
    fn resolve(&mut self) {
        let Some(node) = self.node.upgrade() else {
            return;
        };
        let (client, address) = match self.find_master() {
            Ok(None) => return,
            Ok(Some(master)) => master,
            Err(Missing::Unanswered(e)) => {
                return log::debug!("sentinel: no sentinel answered: {e}");
            }
            Err(Missing::Unknown) => {
                return log::debug!("sentinel: no sentinel knows {:?}", self.sc.master);
            }
            Err(Missing::NotMaster(address, NotMaster::Role(role))) => {
                return log::debug!("sentinel: {address} is a {role} yet, not the master");
            }
            Err(Missing::NotMaster(address, NotMaster::Unreachable(e))) => {
                return log::debug!("sentinel: master at {address} unreachable: {e}");
            }
        };
        log::warn!(
            "sentinel: master {:?} moved from {} to {address}",
            self.sc.master,
            self.address
        );
        node.pool.repoint(client);
        self.address = address;
        Counters::inc(&self.counters.failovers);
    }

    /// A connection with the client's timeouts.
    fn connect(&self, client: &redis::Client, name: &str) -> redis::RedisResult<redis::Connection> {
        open_connection(
            client,
            self.connect_timeout,
            self.read_timeout,
            self.write_timeout,
            name,
        )
    }

    /// Every sentinel's answer, in the order of the list (`None`: no answer in time). They
    /// are asked at once, a thread each, and every one is waited for until the first that
    /// names the master has answered, then [`ANSWER_GRACE`] more: the others' epochs may
    /// outrank its answer, but a sentinel that does not answer (a dead host, a stopped
    /// process) must hold up the resolution (and the calls riding a failover on it)
    /// neither for its timeouts nor once per such sentinel. A thread left behind ends with
    /// its own timeouts. A sentinel whose thread cannot be started is asked in turn.
    fn ask_all(&self) -> Vec<Option<redis::RedisResult<Option<Named>>>> {
        let timeouts = (self.connect_timeout, self.read_timeout, self.write_timeout);
        if let [sentinel] = self.sentinels.as_slice() {
            return vec![Some(ask(sentinel, &self.sc.master, timeouts))];
        }
        let (tx, rx) = crossbeam_channel::unbounded();
        let mut answers: Vec<Option<_>> = self.sentinels.iter().map(|_| None).collect();
        let mut asking = 0;
        for (i, sentinel) in self.sentinels.iter().enumerate() {
            let (client, master, tx) = (sentinel.clone(), self.sc.master.clone(), tx.clone());
            let spawned = std::thread::Builder::new()
                .name("redbaton-sentinel-ask".to_owned())
                .spawn(move || {
                    let _ = tx.send((i, ask(&client, &master, timeouts)));
                });
            match spawned {
                Ok(_) => asking += 1,
                Err(_) => answers[i] = Some(ask(sentinel, &self.sc.master, timeouts)),
            }
        }
        let mut until = (answers.iter().flatten())
            .any(|a| matches!(a, Ok(Some(_))))
            .then(|| Instant::now() + ANSWER_GRACE);
        while asking > 0 {
            let got = match until {
                Some(until) => rx.recv_deadline(until).ok(),
                None => rx.recv().ok(),
            };
            let Some((i, answer)) = got else { break };
            asking -= 1;
            if until.is_none() && matches!(answer, Ok(Some(_))) {
                until = Some(Instant::now() + ANSWER_GRACE);
            }
            answers[i] = Some(answer);
        }
        answers
    }

    /// The master, as the sentinels name it: every sentinel is asked, and the servers
    /// named under the latest configuration epoch of their answers are tried (in the order
    /// of the list) until `ROLE` confirms one is the master. That is the sentinels' own
    /// rule: a sentinel that missed a failover (cut off from the others, or restarted with
    /// an old configuration) names the old master under the epoch before it, and the old
    /// master may still say it is one (not yet demoted, or restarted as a master): neither
    /// the list's order nor a latest master that does not answer may send the client
    /// there, nor back there after it followed the failover. A server of the latest epoch
    /// whose answer is not the master (a replica, a server that does not answer) is passed
    /// over for the next one named, the current address included; each address is tried
    /// once. Answers without an epoch (a sentinel whose ACL refuses `SENTINEL MASTER`)
    /// count as the oldest. `None` for the current address (and when the client stops); when none gives
    /// a master: the first server named and why it was not taken, else whether any
    /// sentinel answered.
    fn find_master(&self) -> std::result::Result<Option<(redis::Client, String)>, Missing> {
        // A client being dropped waits for this thread: no sentinel is asked once it
        // stops.
        if self.stop.load(Ordering::Relaxed) {
            return Ok(None);
        }
        let mut missing = None;
        let mut named = Vec::with_capacity(self.sentinels.len());
        // A sentinel that gave no answer in time did so while another named the master.
        for answer in self.ask_all().into_iter().flatten() {
            match answer {
                Ok(Some(answer)) => named.push(answer),
                Ok(None) => {
                    if matches!(missing, None | Some(Missing::Unanswered(_))) {
                        missing = Some(Missing::Unknown);
                    }
                }
                // The first error, unless a later sentinel refused the credentials: that
                // says what to fix, where a dead sentinel's refused connection does not.
                Err(e) => match &missing {
                    None => missing = Some(Missing::Unanswered(e)),
                    Some(Missing::Unanswered(first))
                        if !is_auth_error(first) && is_auth_error(&e) =>
                    {
                        missing = Some(Missing::Unanswered(e));
                    }
                    Some(_) => {}
                },
            }
        }
        // Stable: the list's order within one epoch.
        named.sort_by_key(|n| std::cmp::Reverse(n.epoch));
        // The latest configuration's answers only: an older one names a master that the
        // sentinels have replaced since, which may still say it is one (cut off from them,
        // never demoted), and a lock there would overlap those taken on the master that
        // replaced it by the clients that reach it. When none of the latest answers, the
        // client stays where it is, and looks again.
        let latest = named.first().map(|n| n.epoch);
        named.retain(|n| Some(n.epoch) == latest);
        let mut tried: Vec<String> = Vec::new();
        for Named { host, port, epoch } in named {
            let address = format!("{host}:{port}");
            if tried.contains(&address) {
                continue;
            }
            // A client being dropped waits for this thread: each server named that does
            // not answer costs a timeout, so none more is tried once it stops.
            if self.stop.load(Ordering::Relaxed) {
                return Ok(None);
            }
            match self.master_at(&host, port) {
                Ok(_) if address == self.address => return Ok(None),
                Ok(client) => return Ok(Some((client, address))),
                Err(why) => {
                    log::debug!(
                        "sentinel: {address} named by a sentinel (epoch {epoch}) is not \
                         taken; trying the next"
                    );
                    if !matches!(missing, Some(Missing::NotMaster(..))) {
                        missing = Some(Missing::NotMaster(address.clone(), why));
                    }
                }
            }
            tried.push(address);
        }
        Err(missing.unwrap_or(Missing::Unknown))
    }

    /// The master when the client is built, with its address, as [`Self::resolve`] finds
    /// it (on connections with the client's timeouts).
    fn first_master(&self) -> Result<(redis::Client, String)> {
        let not_found = |why: String| {
            Error::Redis(redis::RedisError::from((
                redis::ErrorKind::MasterNameNotFoundBySentinel,
                "master not found by the sentinels",
                why,
            )))
        };
        match self.find_master() {
            Ok(Some(master)) => Ok(master),
            // No current address yet: never found.
            Ok(None) => Err(not_found("no address".to_owned())),
            Err(Missing::Unanswered(e)) => Err(Error::Redis(e)),
            Err(Missing::Unknown) => {
                Err(not_found(format!("no sentinel knows {:?}", self.sc.master)))
            }
            Err(Missing::NotMaster(address, NotMaster::Role(role))) => {
                Err(not_found(format!("{address} is a {role}, not the master")))
            }
            Err(Missing::NotMaster(_, NotMaster::Unreachable(e))) => Err(e),
        }
    }

    /// A client of the server at `host:port` that a sentinel named the master, with the
    /// credentials, database and TLS of the settings, if `ROLE` says it is the master.
    fn master_at(&self, host: &str, port: u16) -> std::result::Result<redis::Client, NotMaster> {
        let auth = self
            .sc
            .master_auth
            .as_ref()
            .map(|(user, password)| (user.as_deref(), password.as_str()));
        let master = crate::proto::connect::open_client_to(
            "sentinel master",
            (host, port),
            self.sc.master_tls,
            auth,
            self.sc.db,
            &self.tls,
        )
        .map_err(NotMaster::Unreachable)?;
        match self.role(&master) {
            Ok(role) if role == "master" => Ok(master),
            Ok(role) => Err(NotMaster::Role(role)),
            Err(e) => Err(NotMaster::Unreachable(Error::Redis(e))),
        }
    }

    /// What the server of `client` says it is (`ROLE`'s first field).
    fn role(&self, client: &redis::Client) -> redis::RedisResult<String> {
        let mut conn = self.connect(client, "redbaton")?;
        let role: Vec<redis::Value> = redis::cmd("ROLE").query(&mut conn)?;
        Ok(match role.first() {
            Some(redis::Value::BulkString(b)) => String::from_utf8_lossy(b).into_owned(),
            Some(redis::Value::SimpleString(s)) => s.clone(),
            _ => String::new(),
        })
    }
}

/// What `sentinel` says of the master `master` (`None`: it does not know the name), asked
/// on a connection with the client's timeouts.
fn ask(
    sentinel: &redis::Client,
    master: &str,
    (connect_timeout, read_timeout, write_timeout): (Duration, Duration, Duration),
) -> redis::RedisResult<Option<Named>> {
    let name = "redbaton:sentinel";
    let mut conn = open_connection(sentinel, connect_timeout, read_timeout, write_timeout, name)?;
    let Some((host, port)) = redis::cmd("SENTINEL")
        .arg("GET-MASTER-ADDR-BY-NAME")
        .arg(master)
        .query::<Option<(String, u16)>>(&mut conn)?
    else {
        return Ok(None);
    };
    // The epoch of that answer, from `SENTINEL MASTER` (whose own address field still
    // names the old master while the replicas are being moved: the address is the one
    // above). A sentinel that refuses it (an ACL that allows only the address) gives an
    // answer that any with an epoch outranks.
    let epoch = match redis::cmd("SENTINEL")
        .arg("MASTER")
        .arg(master)
        .query::<std::collections::HashMap<String, String>>(&mut conn)
    {
        Ok(fields) => fields
            .get("config-epoch")
            .and_then(|e| e.parse().ok())
            .unwrap_or(0),
        Err(e) if crate::error::is_network_error(&e) => return Err(e),
        Err(_) => 0,
    };
    Ok(Some(Named { host, port, epoch }))
}

/// One sentinel's answer: the master's address, and the configuration epoch under which
/// that sentinel knows it (0 when it does not say).
struct Named {
    host: String,
    port: u16,
    epoch: u64,
}

/// Why the sentinels' answers gave no master.
enum Missing {
    /// No sentinel answered (the first error, or the first refusal of the credentials).
    Unanswered(redis::RedisError),
    /// Those that answered do not know the master's name.
    Unknown,
    /// The first server named (its address) that is not taken, and why.
    NotMaster(String, NotMaster),
}

/// Why a server a sentinel named is not taken as the master.
enum NotMaster {
    /// No client or no `ROLE` reply.
    Unreachable(Error),
    /// `ROLE` says it is something else (a replica not yet promoted).
    Role(String),
}
