//! The call path: what a command does when its server refuses or redirects it. Every
//! node's commands take it (`Node::run_until` and the script runners built on it), so
//! this file is the one place that reads Redis Cluster's refusals and decides.
//!
//! In a Redis Cluster a `MOVED` or `ASK` reply sends the command to the node it names
//! (after `ASKING` for `ASK`): the command did not run, so it is safe to send again. A
//! `MOVED` records the slot's new owner in the slot map and has the map read again at the
//! next route. `TRYAGAIN` and `CLUSTERDOWN` are sent again after growing pauses, within
//! the caller's deadline (or [`CLUSTER_SETTLE`] without one); a `TRYAGAIN` that outlasts
//! it gives [`Error::SlotMigrating`], and so do redirects that do not settle within
//! [`MAX_HOPS`] (an `ASK` and a `MOVED` sending the command back and forth).
//! `CLUSTERDOWN`, and any command that got no reply or no connection, marks the map
//! stale: a failover may have given the slot to another master. Everywhere (a
//! Sentinel-managed master demoted under us too), `READONLY` drops the node's idle
//! connections, tells whoever follows the node's address, and is sent again if the
//! caller allows retries.
//!
//! `TRYAGAIN` is what a slot migration does to a command naming several keys (Redis's
//! `getNodeByQuery`, `src/cluster.c`): the source (`MIGRATING`) runs it when all of its
//! keys exist there, sends `ASK` when none does, and refuses it when only some do; the
//! target (`IMPORTING`), after `ASKING`, runs it when its keys are one, or all exist
//! there, and refuses it otherwise. A script's keys are its declared `KEYS` (EVALSHA is no
//! exception), and every command it runs is checked the same way, so a script cannot
//! create a key on the source either. Waiting is the only safe answer for an acquire: the
//! lock key of a free lock exists nowhere, its fence counter may still be on the source,
//! and taking the lock on the target with a counter of its own would issue tokens that go
//! backwards (and break the migration of the old counter). The server never runs one
//! lock's script on both masters, and a refused command did not run, so sending it again
//! is safe.
//!
//! A caller that has a narrower form of its call says so (`Call::narrower`): a renewal
//! batch can be sent one lock per call, and a release can name the lock key alone. Then a
//! refusal of the keys together is not waited out: the path answers `Sent::Narrow` at
//! once, and the caller sends the narrower form, which the server always serves (one key:
//! where it is, `ASK` to the target once it moved). Waiting could outlast the leases of
//! the locks being renewed. The keys are refused together by `TRYAGAIN`, and, in a
//! pipeline of renewal batches, by a redirect: `ASKING` covers only the first command of
//! a pipeline, so a redirect of another one bounces between the masters (and names no
//! node: see [`Failure::Bounced`]). A lock and its lease record count as two keys: a
//! renewal of one ordered lock is refused too while only one of them has moved, or while
//! the record does not exist yet.
//!
//! # Why a trait object the node holds
//!
//! The lock protocol (`proto::protocol`, `proto::rw_scripts`) runs its scripts on a
//! `&Node`, and the engine calls it with the nodes of a route. `proto` may not name the
//! topology, so the path is injected: `proto::node` declares the object-safe
//! `CallPath`, the topology gives every node one when it makes it ([`Path::plain`],
//! [`Path::cluster`]), and `Node` hands each call to it. The node keeps the mechanism (its
//! pool, sending on a connection with network retries within the deadline, scripts'
//! reloads, replica `WAIT`), the path makes every decision about a refused or redirected
//! command, and no caller changes. A runner passed as a parameter instead would have
//! to travel through every protocol function and every engine call site that reaches
//! one, for the same decisions.

use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use redis::{Cmd, RedisError};

use crate::error::{Error, Result, is_network_error};
use crate::proto::node::{Call, CallPath, Commands, Node, Sent};
use crate::proto::pool::{call_deadline, next_read};
use crate::stats::Counters;

/// `ASKING`, sent ahead of a command that follows an `ASK` (built once: a call that is
/// never redirected builds nothing).
static ASKING: std::sync::LazyLock<Cmd> = std::sync::LazyLock::new(|| redis::cmd("ASKING"));

/// Most redirects one command follows: a slot moves at most a few times in a row. Past
/// them the command gives [`Error::SlotMigrating`] (it ran nowhere).
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
/// The pause before a command refused with `READONLY` is sent again (not taken when it
/// would reach the caller's deadline).
const READONLY_PAUSE: Duration = Duration::from_millis(50);

/// The slot map of a Redis Cluster, as its call path needs it (`topology::cluster`
/// implements it).
pub(crate) trait SlotMap: Send + Sync {
    /// The node at `addr` (`host:port`) that a redirect for `slot` from node `from`
    /// names; `moved`: the slot now belongs to it (`MOVED`), rather than for this one
    /// command (`ASK`). An empty host (`:port`, a server set to
    /// `cluster-preferred-endpoint-type unknown-endpoint`) is `from`'s.
    fn follow(&self, from: &Node, slot: u16, addr: &str, moved: bool) -> Option<Arc<Node>>;
    /// The layout may have changed (a master moved): read the map again soon.
    fn stale(&self);
}

/// A node's call path.
pub(crate) struct Path {
    /// Redis Cluster: the slot map, held weakly (the map holds the nodes).
    map: Option<Weak<dyn SlotMap>>,
}

impl Path {
    /// The path of a node outside a cluster: its commands run where they are sent.
    pub fn plain() -> Arc<dyn CallPath> {
        Arc::new(Path { map: None })
    }

    /// The path of a cluster's node, following redirects through `map`.
    pub fn cluster(map: Weak<dyn SlotMap>) -> Arc<dyn CallPath> {
        Arc::new(Path { map: Some(map) })
    }

    fn in_cluster(&self) -> bool {
        self.map.is_some()
    }

    fn map(&self) -> Option<Arc<dyn SlotMap>> {
        self.map.as_ref().and_then(Weak::upgrade)
    }
}

impl CallPath for Path {
    fn call(&self, node: &Node, call: Call, commands: &mut Commands<'_>) -> Result<Sent> {
        // Reckoned once, where the call begins: every step of it, on whatever node it is
        // sent to, and every command sent again, shares the least a call is given.
        let until = call_deadline(call.deadline);
        let asking = &*ASKING;
        // The node the command is sent to now (`None`: `node`), and what goes ahead of it
        // there (`ASKING` after an `ASK`).
        let mut at: Option<Arc<Node>> = None;
        let mut before: Option<&Cmd> = None;
        let mut hops = 0;
        'hop: loop {
            let on = at.as_deref().unwrap_or(node);
            let mut tries = 0;
            let settle_until = call
                .deadline
                .unwrap_or_else(|| Instant::now() + CLUSTER_SETTLE);
            let mut settle_pause = FIRST_SETTLE_PAUSE;
            loop {
                let deadlines = (call.deadline, until);
                let sent = on.send(call.retry, deadlines, &mut tries, &mut |c| {
                    if let Some(cmd) = before {
                        cmd.query::<()>(c)?;
                        // Two replies in one call: the command's waits only for what
                        // remains of the call's deadline after `ASKING`'s.
                        next_read(c)?;
                    }
                    commands(c, before)
                });
                let e = match sent {
                    Ok(()) => return Ok(Sent::Ran),
                    Err(Error::Redis(e)) => e,
                    Err(e) => return Err(e),
                };
                let failure = Failure::of(&e);
                match failure {
                    Failure::Migrating | Failure::Bounced if call.narrower && self.in_cluster() => {
                        return Ok(Sent::Narrow);
                    }
                    Failure::Redirect { slot, addr, moved } if self.in_cluster() => {
                        let target = self.map().and_then(|map| map.follow(on, slot, addr, moved));
                        match target {
                            Some(next) if hops < MAX_HOPS => {
                                Counters::inc(&on.counters().redirects);
                                log::debug!("node {}: {e}; following to {}", on.id, next.id);
                                at = Some(next);
                                before = (!moved).then_some(asking);
                                hops += 1;
                                continue 'hop;
                            }
                            // The redirects do not settle: a slot half-way between two
                            // masters that disagree on it (the source `MIGRATING`, the
                            // target not `IMPORTING` after a failover of its own), or a
                            // map in flux. The command ran nowhere: said as for a slot
                            // that stays half-way, which a ride waits out, and which
                            // neither reaches the caller as a raw redirect nor counts as
                            // a command that may have run (a count down is sent again).
                            Some(_) => {
                                log::debug!("node {}: {e}; redirects did not settle", on.id);
                                return Err(Error::SlotMigrating);
                            }
                            None => return Err(Error::Redis(e)),
                        }
                    }
                    Failure::Migrating | Failure::ClusterDown if self.in_cluster() => {
                        // The command did not run: a slot is half-way through a migration,
                        // or the cluster is electing a new master. Wait a little and send it
                        // again (after an `ASK`, to the same target).
                        let migrating = failure == Failure::Migrating;
                        if !migrating {
                            // A migrating slot keeps its owner until it has moved (then
                            // `MOVED` says so); an election may give it another.
                            self.fault();
                        }
                        let jitter = rand::random_range(0..=settle_pause.as_millis() as u64 / 2);
                        let pause = settle_pause + Duration::from_millis(jitter);
                        if Instant::now() + pause >= settle_until {
                            if migrating {
                                log::debug!("node {}: slot still migrating: {e}", on.id);
                                return Err(Error::SlotMigrating);
                            }
                            return Err(Error::Redis(e));
                        }
                        std::thread::sleep(pause);
                        settle_pause = (settle_pause * 2).min(MAX_SETTLE_PAUSE);
                    }
                    Failure::ReadOnly => {
                        // A master demoted under us (a failover): whoever follows the
                        // node's address looks again; the command is retried if the caller
                        // allows.
                        on.pool.clear_idle();
                        on.pool.note_fault();
                        // A pause that would reach the caller's deadline is not taken: the
                        // command could not be sent again in time.
                        let in_time = call
                            .deadline
                            .is_none_or(|d| Instant::now() + READONLY_PAUSE < d);
                        if tries >= call.retry.times || !in_time {
                            return Err(Error::Redis(e));
                        }
                        tries += 1;
                        std::thread::sleep(READONLY_PAUSE);
                    }
                    _ => return Err(Error::Redis(e)),
                }
            }
        }
    }

    fn resend(&self, e: &RedisError) -> bool {
        self.in_cluster()
            && matches!(
                Failure::of(e),
                Failure::Redirect { .. } | Failure::Migrating | Failure::ClusterDown
            )
    }

    fn fault(&self) {
        if let Some(map) = self.map() {
            map.stale();
        }
    }
}

/// What a failed command's error says, read once: the one classification of Redis's
/// refusals.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Failure<'a> {
    /// No reply (a network error or a timeout): the command may have run.
    NoReply,
    /// `MOVED` (`moved`) or `ASK` naming the node that serves `slot`: the command did not
    /// run.
    Redirect {
        slot: u16,
        addr: &'a str,
        moved: bool,
    },
    /// `MOVED` or `ASK` as the first failure of a pipeline, whose error names no node
    /// (`redirect_node` is `None` there).
    Bounced,
    /// `TRYAGAIN`: the command names several keys of a migrating slot, and the node has
    /// only some of them. It did not run.
    Migrating,
    /// `CLUSTERDOWN`: the cluster is electing a new master. The command did not run.
    ClusterDown,
    /// `READONLY`: the node is no longer a master.
    ReadOnly,
    /// Anything else: the server's answer.
    Other,
}

impl<'a> Failure<'a> {
    fn of(e: &'a RedisError) -> Self {
        use redis::{ErrorKind::Server, ServerErrorKind as Kind};
        if is_network_error(e) {
            return Failure::NoReply;
        }
        match e.kind() {
            Server(kind @ (Kind::Moved | Kind::Ask)) => match e.redirect_node() {
                Some((addr, slot)) => Failure::Redirect {
                    slot,
                    addr,
                    moved: kind == Kind::Moved,
                },
                None => Failure::Bounced,
            },
            Server(Kind::TryAgain) => Failure::Migrating,
            Server(Kind::ClusterDown) => Failure::ClusterDown,
            // Also as Redis before 7 says it of a script's write (`ERR Error running
            // script … -READONLY …`, or that text passed on by a script that caught it):
            // a script on a demoted master fails so at its first write, having written
            // nothing.
            _ if crate::error::refusal_code(e) == Some("READONLY") => Failure::ReadOnly,
            _ => Failure::Other,
        }
    }
}

/// Whether `e` is a demoted master's refusal of a write (`READONLY`, wrapped in a script
/// error before Redis 7): a script refused so stopped at its first write, having written
/// nothing, so a call that must not run twice may be sent again where the master is now.
pub(crate) fn is_read_only(e: &Error) -> bool {
    matches!(e, Error::Redis(r) if Failure::of(r) == Failure::ReadOnly)
}

/// Whether `e` is what a Redis Cluster client sees while a master fails over or a slot
/// moves, rather than an answer about the lock: the node cannot be reached (killed, not
/// yet replaced), it no longer takes writes (`READONLY`), the cluster is electing a new
/// master (`CLUSTERDOWN`) or moving keys (`TRYAGAIN`, and [`Error::SlotMigrating`] when
/// the call path gave up waiting it out), or redirects did not settle. A refused
/// handshake or refused credentials are not: waiting does not cure them.
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
    matches!(
        Failure::of(r),
        Failure::NoReply
            | Failure::Redirect { .. }
            | Failure::Migrating
            | Failure::ClusterDown
            | Failure::ReadOnly
    )
}
