//! Redis Cluster: each lock lives on the master that serves its key's hash slot, and the
//! masters and their slots change while locks are held (resharding, failover).
//!
//! The slot map is read from the seeds at start (`CLUSTER SHARDS`, see [`slots`]) and kept
//! behind a lock; a lock's [`Route`] is the one master owning the slot of its lock key
//! (all of a lock's keys share that slot, see `proto::keys`). A node per master, named by
//! its address, keeps its pool across map refreshes.
//!
//! Redirects never reach users. Every command takes the call path (see [`call`]), which
//! follows a `MOVED` (the map records the slot's new owner and is read again at the next
//! route) or an `ASK` (`ASKING`, then the command, on the named node, once) through this
//! topology's [`SlotMap`], and waits out `TRYAGAIN` and `CLUSTERDOWN`. A slot
//! migration refuses (`TRYAGAIN`) every script of a lock whose keys are not all on one
//! side, a free lock's acquire among them: acquires wait for the slot to move, for as long
//! as failovers are ridden through, then give `Error::SlotMigrating`; a fair release
//! falls back to the plain one, which names the lock key alone, and a refused renewal
//! batch is sent one lock per call.
//! A redirected command had not run, so resending it is safe; an acquire keeps its token across the
//! redirect, and the script recognises its own token if an earlier attempt's reply was
//! lost. A network error (a refused connection too) marks the map stale: after a failover
//! the next route asks the cluster who serves the slot now, and until a replica is
//! promoted callers retry for as long as [`Cluster::failover_window`] allows (see
//! `Topology::ride_through`).
//!
//! Masters found in the map are reached as the first seed says (TLS, CA, client identity,
//! user, password; the builder makes every seed agree), on their TLS port over TLS.
//!
//! [`slots`]: super::slots
//! [`call`]: super::call

use std::cell::Cell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};

use super::Route;
use super::call::{Path, SlotMap};
use super::slots::{self, SLOTS, Shard};
use crate::config::Config;
use crate::error::{Error, Result};
use crate::proto::connect::{is_tls_url, open_client, open_client_at};
use crate::proto::keys::{Keys, keyslot};
use crate::proto::node::{Node, Parts, Retry, past};
use crate::proto::pool::{call_deadline, open_connection_until, within_deadline};
use crate::proto::protocol::Protocols;
use crate::stats::Counters;

/// The shortest time between two reads of the slot map: a burst of redirects or errors
/// after a failover reads it once.
const MIN_REFRESH: Duration = Duration::from_millis(100);
/// No master serves the slot (yet).
const NONE: u16 = u16::MAX;

thread_local! {
    /// The deadline of the caller's call under way on this thread, when it has one (see
    /// [`with_caller_deadline`]).
    static CALLER: Cell<Option<Instant>> = const { Cell::new(None) };
}

/// Runs `f`, a caller's call that must be over by `deadline`, so that a slot map read
/// again on its way (a route looked up while the map is stale, see `Shared::refresh`)
/// ends by that deadline, or [`MIN_ATTEMPT`](crate::proto::pool::MIN_ATTEMPT) after the
/// read began when that is later, rather than one read timeout. A thread-local, as the
/// read of the call's replies is (`proto::pool`): a route is looked up by code that knows
/// nothing of the call, and the map is read on the thread of whoever routes first.
pub(crate) fn with_caller_deadline<T>(deadline: Option<Instant>, f: impl FnOnce() -> T) -> T {
    /// Puts back the call before, however `f` ends.
    struct Restore(Option<Instant>);
    impl Drop for Restore {
        fn drop(&mut self) {
            CALLER.set(self.0);
        }
    }
    let _restore = Restore(CALLER.replace(deadline));
    f()
}

pub(crate) struct Cluster {
    shared: Arc<Shared>,
}

struct Shared {
    seeds: Vec<String>,
    cfg: Config,
    counters: Arc<Counters>,
    client_id: Arc<str>,
    map: RwLock<Map>,
    /// A redirect or a fault says the map may be out of date.
    stale: AtomicBool,
    /// When the map was last read; held while reading it (one reader at a time).
    refreshed: Mutex<Option<Instant>>,
    me: Weak<Shared>,
}

struct Map {
    /// Per slot: the index in `routes` of its master.
    owner: Vec<u16>,
    /// One route per master: that master alone.
    routes: Vec<Route>,
    /// Every master.
    all: Route,
    /// The nodes of the masters that serve slots (and of those a redirect named since the
    /// last read of the map), by `host:port`. A master that serves nothing any more is
    /// dropped at the next read: with masters coming and going at new addresses (pods
    /// restarted, failovers) a client keeps the nodes of the masters that serve, not of
    /// every master it ever met. Calls under way on its node finish there (a route holds
    /// its nodes), and locks follow their slot (`Route::holders`), so no lock needs it; a
    /// master that serves again gets a fresh node.
    known: HashMap<String, Arc<Node>>,
    /// Since when the reads of the map have named no master for some slots (see
    /// `install`); `None` while they name one for every slot.
    unnamed_since: Option<Instant>,
}

impl Cluster {
    /// Reads the slot map through the first seed that answers.
    pub fn open(
        seeds: &[String],
        cfg: &Config,
        counters: &Arc<Counters>,
        client_id: &Arc<str>,
    ) -> Result<Self> {
        let shared = Shared::new(seeds, cfg, counters, client_id);
        shared.refresh(true)?;
        Ok(Cluster { shared })
    }

    /// The master serving the slot of `keys`' lock key.
    pub fn route(&self, keys: &Keys) -> Route {
        let shared = &self.shared;
        shared.fresh();
        let slot = keyslot(keys.lock());
        let map = shared.map.read();
        match map.owner[usize::from(slot)] {
            // Nobody serves it in our map: any master answers MOVED or CLUSTERDOWN.
            NONE => map
                .routes
                .first()
                .cloned()
                .unwrap_or_else(|| map.all.clone()),
            i => map.routes[usize::from(i)].clone(),
        }
    }

    /// Every master. Read afresh when a fault or a redirect marked the map stale, as a
    /// route is.
    pub fn all(&self) -> Route {
        self.shared.fresh();
        self.shared.map.read().all.clone()
    }

    /// Every master, as the cluster has them now: the map is read again first (unless it
    /// was read less than [`MIN_REFRESH`] ago), for a listing (`locks`). A listing may be
    /// all a client does, and nothing else would tell it of a change: no redirect reaches a
    /// client that routes nothing, so it would miss, for ever, a master added and given
    /// slots since (and the locks there), and keep asking one removed, or one that died
    /// rather than the replica that took over. One `CLUSTER SHARDS` per listing, against a
    /// `SCAN` of every master.
    pub fn all_now(&self) -> Route {
        let _ = self.shared.refresh(false);
        self.shared.map.read().all.clone()
    }

    /// How long a call without a deadline rides through a failover (see
    /// [`Topology::ride_through`](super::Topology::ride_through)): one lease. A master
    /// that stays unreplaced for longer has lost every lock it held anyway (their holders
    /// could not renew them), and a cluster replaces a dead master well within one with the
    /// defaults (`cluster-node-timeout` 15 s plus an election of about a second, against
    /// a 30 s lease).
    pub fn failover_window(&self) -> Duration {
        self.shared.failover_window()
    }
}

impl Shared {
    /// A map of nothing yet, whose seeds are `seeds`.
    fn new(
        seeds: &[String],
        cfg: &Config,
        counters: &Arc<Counters>,
        client_id: &Arc<str>,
    ) -> Arc<Self> {
        Arc::new_cyclic(|me| Shared {
            seeds: seeds.to_vec(),
            cfg: cfg.clone(),
            counters: counters.clone(),
            client_id: client_id.clone(),
            map: RwLock::new(Map {
                owner: vec![NONE; SLOTS],
                routes: Vec::new(),
                all: Route::every(Arc::from(Vec::new()), 1, Protocols::of(cfg)),
                known: HashMap::new(),
                unnamed_since: None,
            }),
            stale: AtomicBool::new(false),
            refreshed: Mutex::new(None),
            me: me.clone(),
        })
    }

    /// See [`Cluster::failover_window`].
    fn failover_window(&self) -> Duration {
        self.cfg.lease
    }

    /// Reads the map again if something marked it stale (see [`refresh`](Self::refresh)).
    fn fresh(&self) {
        if self.stale.load(Ordering::Relaxed) {
            let _ = self.refresh(false);
        }
    }

    /// Reads the slot map again, unless another thread is reading it or it was read less
    /// than [`MIN_REFRESH`] ago (`force`: at start). Asks the known masters first, then
    /// the seeds.
    ///
    /// A read on a caller's path (not `force`) takes one read timeout in all, each node
    /// asked for [`MIN_ATTEMPT`](crate::proto::pool::MIN_ATTEMPT) at least (the ask of
    /// each is a call of its own, all of its steps within that): it runs on the
    /// thread of whoever routed (a caller with a deadline, the watchdog), and the nodes
    /// are asked one after another, so that a stalled cluster (every master and seed
    /// accepting connections and answering nothing) would otherwise keep that thread one
    /// read timeout per node. A caller with a nearer deadline (see
    /// [`with_caller_deadline`]) gives it that much (`MIN_ATTEMPT` at least), and asks no
    /// more nodes once it has passed: the map stays stale, and the next route reads it
    /// again. A node that did not answer is asked last next time (see `Node::answering`).
    fn refresh(&self, force: bool) -> Result<()> {
        let Some(mut last) = self.refreshed.try_lock() else {
            return Ok(());
        };
        if !force && last.is_some_and(|t| t.elapsed() < MIN_REFRESH) {
            return Ok(());
        }
        self.stale.store(false, Ordering::Relaxed);
        *last = Some(Instant::now());
        let tls = self.seeds.iter().any(|u| is_tls_url(u));
        // Masters that answered lately first: a hung one would hold up every caller that
        // routes while the map is read.
        let mut masters: Vec<Arc<Node>> = self.map.read().all.nodes().to_vec();
        masters.sort_by_key(|n| !n.answering());
        let caller = call_deadline(CALLER.get()).filter(|_| !force);
        let until = (!force).then(|| {
            let by_timeout = Instant::now() + self.cfg.read_timeout;
            caller.map_or(by_timeout, |d| d.min(by_timeout))
        });
        // A caller whose deadline has passed asks no more nodes (see above).
        let out_of_time = || past(caller);
        let mut first_error = None;
        let mut found = None;
        // A map that names no master for some slots (a node that has not yet heard all of
        // a failover: see `install`): kept while the next masters are asked for a whole
        // one, which a master the failover concerned already has.
        let mut partial: Option<(usize, Vec<Shard>)> = None;
        for node in &masters {
            if out_of_time() {
                break;
            }
            let asked = Self::host_of(node).unwrap_or_default();
            match node.run_until(Retry::NEVER, until, |c| slots::read(c, tls, &asked)) {
                Ok(shards) => {
                    let named = slots::slots_named(&shards);
                    if named >= SLOTS {
                        found = Some(shards);
                        break;
                    }
                    if named > partial.as_ref().map_or(0, |(n, _)| *n) {
                        partial = Some((named, shards));
                    }
                }
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        found = found.or(partial.map(|(_, shards)| shards));
        if found.is_none() {
            for (i, url) in self.seeds.iter().enumerate() {
                if out_of_time() {
                    first_error.get_or_insert(Error::Timeout);
                    break;
                }
                match self.read_seed(i, url, tls, until) {
                    Ok(shards) if !shards.is_empty() => {
                        found = Some(shards);
                        break;
                    }
                    Ok(_) => {
                        first_error.get_or_insert(Error::InvalidConfig(format!(
                            "cluster seed {i}: no slot is served (is it a cluster node?)"
                        )));
                    }
                    Err(e) => {
                        first_error.get_or_insert(e);
                    }
                }
            }
        }
        let Some(shards) = found else {
            // Look again at the next route.
            self.stale.store(true, Ordering::Relaxed);
            return Err(
                first_error.unwrap_or_else(|| Error::InvalidConfig("cluster: no seed".to_owned()))
            );
        };
        Counters::inc(&self.counters.slot_refreshes);
        self.install(&shards)
    }

    /// The map as seed `i` at `url` has it, asked within `until`, or within
    /// [`MIN_ATTEMPT`](crate::proto::pool::MIN_ATTEMPT) of the start when that is later:
    /// the connect, its naming and the read share that much, each bounded by what remains
    /// of it when it starts.
    fn read_seed(
        &self,
        i: usize,
        url: &str,
        tls: bool,
        until: Option<Instant>,
    ) -> Result<Vec<Shard>> {
        let client = open_client(&format!("cluster seed {i}"), url, &self.cfg.tls)?;
        let until = call_deadline(until);
        let cfg = &self.cfg;
        let timeouts = (cfg.connect_timeout, cfg.read_timeout, cfg.write_timeout);
        let mut conn =
            open_connection_until(&client, timeouts, "redbaton", until).map_err(Error::Redis)?;
        let asked = match client.get_connection_info().addr() {
            redis::ConnectionAddr::Tcp(host, _) | redis::ConnectionAddr::TcpTls { host, .. } => {
                host.clone()
            }
            _ => String::new(),
        };
        Counters::inc(&self.counters.commands);
        within_deadline(&mut conn, until, cfg.read_timeout, |c| {
            slots::read(c, tls, &asked)
        })
        .map_err(Error::Redis)
    }

    /// The host `node` is reached at, read from its id (`host:port/db`, the address it was
    /// made for): also for a node no longer known, which the calls that were under way on
    /// it still ask.
    fn host_of(node: &Node) -> Option<String> {
        let id = node.id.to_string();
        let (at, _db) = id.rsplit_once('/')?;
        at.rsplit_once(':').map(|(host, _)| host.to_owned())
    }

    /// Makes `shards` the map.
    fn install(&self, shards: &[Shard]) -> Result<()> {
        let mut nodes = Vec::with_capacity(shards.len());
        for shard in shards {
            nodes.push(self.node(&shard.host, shard.port)?);
        }
        let mut map = self.map.write();
        let mut owner = vec![NONE; SLOTS];
        for (i, shard) in shards.iter().enumerate() {
            for &(start, end) in &shard.ranges {
                for slot in start..=end.min(SLOTS as u16 - 1) {
                    owner[usize::from(slot)] = i as u16;
                }
            }
        }
        // A node that has not yet heard all of a failover names no master for that
        // shard's slots (its old master a replica by then, the new one not yet a master to
        // it): they stay with the master the map had for them (or a redirect named), a
        // call there is redirected if need be, and the map is read again soon. Left
        // without a master, they would be routed anywhere and left out of listings until
        // the node asked had heard. For one failover window: slots that stay without a
        // master longer have none (an operator's `CLUSTER DELSLOTS`, a dead master with no
        // replica on a cluster that allows partial coverage), and keeping them would keep
        // a master that serves them no more, and read the map again at every route, for
        // ever.
        if owner.contains(&NONE) {
            let since = *map.unnamed_since.get_or_insert_with(Instant::now);
            if since.elapsed() < self.failover_window() {
                let previous: Vec<&Arc<Node>> = map.routes.iter().map(|r| &r.nodes()[0]).collect();
                keep_unnamed(&mut owner, &mut nodes, &map.owner, &previous);
                self.stale.store(true, Ordering::Relaxed);
            }
        } else {
            map.unnamed_since = None;
        }
        map.owner = owner;
        let protocol = Protocols::of(&self.cfg);
        map.routes = nodes
            .iter()
            .map(|n| Route::following(n.clone(), protocol))
            .collect();
        // The masters that serve no slot now (one demoted by a failover, one removed from
        // the cluster) lose their node (see `known`; a call still under way holds it) and
        // its idle connections: no route leads there any more, and a server closes no
        // idle connection by default (`timeout 0`). Their subscribers end once nothing
        // waits there (see `Pool::set_serving`).
        // Under the map's lock, as a followed redirect's change is (see `route_moved`).
        let serving = |n: &Arc<Node>| nodes.iter().any(|m| Arc::ptr_eq(m, n));
        for n in map.known.values() {
            n.pool.set_serving(serving(n));
        }
        map.known.retain(|_, n| serving(n));
        map.all = Route::every(Arc::from(nodes.clone()), 1, protocol);
        Ok(())
    }

    /// Routes `slot` to `node` (at `addr`, `host:port`) at once, after a `MOVED`, and has
    /// the whole map read again soon (one moved slot usually means more: a reshard, a
    /// failover). The node routed to: `node`, or the one known at `addr` by then. A read
    /// of the map between the look-up of `node` and this may have dropped it (from a reply
    /// read before the move): it is known again, so that every routed node is known, and a
    /// later read that finds it serving nothing retires it (its connections and its
    /// subscriber end), and its serving flag changes under the map's lock, as a read's do.
    fn route_moved(&self, addr: &str, node: Arc<Node>, slot: u16) -> Arc<Node> {
        let mut map = self.map.write();
        let node = map.known.entry(addr.to_owned()).or_insert(node).clone();
        let i = match map.routes.iter().position(|r| r.nodes()[0].id == node.id) {
            Some(i) => i,
            None => {
                let protocol = map.all.protocols();
                map.routes.push(Route::following(node.clone(), protocol));
                let mut all = map.all.nodes().to_vec();
                all.push(node.clone());
                map.all = Route::every(Arc::from(all), 1, protocol);
                map.routes.len() - 1
            }
        };
        if let Some(o) = map.owner.get_mut(usize::from(slot)) {
            *o = i as u16;
        }
        node.pool.set_serving(true);
        self.stale.store(true, Ordering::Relaxed);
        node
    }

    /// The node at `host:port`, made on first use.
    fn node(&self, host: &str, port: u16) -> Result<Arc<Node>> {
        let addr = format!("{host}:{port}");
        if let Some(n) = self.map.read().known.get(&addr) {
            return Ok(n.clone());
        }
        let seed = self.seeds.first().map(String::as_str).unwrap_or("redis://");
        let client = open_client_at(
            &format!("cluster node {addr}"),
            seed,
            &self.cfg.tls,
            host,
            port,
        )?;
        let map: Weak<dyn SlotMap> = self.me.clone();
        let parts = Parts {
            counters: self.counters.clone(),
            client_id: self.client_id.clone(),
            path: Path::cluster(map),
        };
        let node = Arc::new(Node::at(client, &self.cfg, parts));
        let mut map = self.map.write();
        Ok(map.known.entry(addr).or_insert(node).clone())
    }
}

impl SlotMap for Shared {
    fn follow(&self, from: &Node, slot: u16, addr: &str, moved: bool) -> Option<Arc<Node>> {
        let (host, port) = addr.rsplit_once(':')?;
        let port = port.parse().ok()?;
        let from_host;
        let host = if host.is_empty() {
            // The server announces no endpoint: the target is on the host the command was
            // sent to.
            from_host = Self::host_of(from)?;
            from_host.as_str()
        } else {
            host
        };
        let node = self.node(host, port).ok()?;
        Some(if moved {
            self.route_moved(&format!("{host}:{port}"), node, slot)
        } else {
            node
        })
    }

    fn stale(&self) {
        self.stale.store(true, Ordering::Relaxed);
    }
}

/// Gives each slot that `owner` leaves without a master the master `previous_owner` had
/// for it (an index into `previous`), adding its node to `nodes` (which `owner` indexes)
/// when it is not there yet.
fn keep_unnamed(
    owner: &mut [u16],
    nodes: &mut Vec<Arc<Node>>,
    previous_owner: &[u16],
    previous: &[&Arc<Node>],
) {
    // Where each previous master went in `nodes`, once looked up.
    let mut placed: Vec<Option<u16>> = vec![None; previous.len()];
    for (slot, o) in owner.iter_mut().enumerate() {
        let was = previous_owner.get(slot).copied().unwrap_or(NONE);
        if *o != NONE || was == NONE {
            continue;
        }
        let Some(node) = previous.get(usize::from(was)) else {
            continue;
        };
        let i = *placed[usize::from(was)].get_or_insert_with(|| {
            match nodes.iter().position(|n| Arc::ptr_eq(n, node)) {
                Some(i) => i as u16,
                None => {
                    nodes.push(Arc::clone(node));
                    (nodes.len() - 1) as u16
                }
            }
        });
        *o = i;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::node::NodeId;

    fn shard(port: u16) -> Shard {
        served(port, 0, SLOTS as u16 - 1)
    }

    fn served(port: u16, first: u16, last: u16) -> Shard {
        Shard {
            host: "127.0.0.1".to_owned(),
            port,
            ranges: vec![(first, last)],
        }
    }

    /// Three masters at ports 1, 2 and 3, each serving a third of the slots.
    fn thirds() -> [Shard; 3] {
        [
            served(1, 0, 5460),
            served(2, 5461, 10922),
            served(3, 10923, 16383),
        ]
    }

    /// A map of nothing yet, of a cluster seeded at port 1, with `lease` (the failover
    /// window) when given. No server is needed: nothing listens on the ports named, and
    /// nothing is asked.
    fn shared_map(lease: Option<Duration>) -> Arc<Shared> {
        let defaults = Config::default();
        let cfg = Config {
            cluster: vec!["redis://127.0.0.1:1".to_owned()],
            lease: lease.unwrap_or(defaults.lease),
            ..defaults
        };
        let counters = Arc::new(Counters::default());
        Shared::new(&cfg.cluster, &cfg, &counters, &Arc::from("test"))
    }

    /// The id of the node serving `slot` in `shared`'s map.
    fn owner_of(shared: &Shared, slot: usize) -> Option<String> {
        let map = shared.map.read();
        let i = usize::from(*map.owner.get(slot)?);
        Some(map.routes.get(i)?.nodes()[0].id.to_string())
    }

    /// A node that has not yet heard all of a failover names no master for that shard's
    /// slots (its old master a replica by then, the new one not yet a master to it). The
    /// slots stay with the master the map had for them, which stays among the masters a
    /// listing asks, and the map is read again soon; a full map later replaces it.
    #[test]
    fn slots_a_map_names_no_master_for_stay_where_they_were() {
        let shared = shared_map(None);
        let thirds = thirds();
        shared.install(&thirds).expect("a map");
        assert!(!shared.stale.load(Ordering::Relaxed));
        shared.install(&thirds[1..]).expect("a map");
        assert_eq!(owner_of(&shared, 0).as_deref(), Some("127.0.0.1:1/0"));
        assert_eq!(owner_of(&shared, 5460).as_deref(), Some("127.0.0.1:1/0"));
        assert_eq!(owner_of(&shared, 5461).as_deref(), Some("127.0.0.1:2/0"));
        let all: Vec<String> = (shared.map.read().all.nodes().iter())
            .map(|n| n.id.to_string())
            .collect();
        assert!(all.contains(&"127.0.0.1:1/0".to_owned()), "{all:?}");
        assert!(shared.stale.load(Ordering::Relaxed), "read again soon");
        let moved = [
            served(4, 0, 5460),
            served(2, 5461, 10922),
            served(3, 10923, 16383),
        ];
        shared.install(&moved).expect("a map");
        assert_eq!(owner_of(&shared, 0).as_deref(), Some("127.0.0.1:4/0"));
        assert_eq!(shared.map.read().all.nodes().len(), 3);
    }

    /// Slots that stay without a master (an operator's `CLUSTER DELSLOTS`, a dead master
    /// forgotten with no replica to take over, on a cluster that allows partial coverage)
    /// are kept on their last master for one failover window only: after it, that master
    /// serves nothing in the map (it loses its node, and listings no longer ask it), and
    /// the map is no longer read again at every route.
    #[test]
    fn slots_left_without_a_master_past_a_failover_window_are_let_go() {
        let shared = shared_map(Some(Duration::from_millis(200)));
        let thirds = thirds();
        shared.install(&thirds).expect("a map");
        let old = shared.map.read().routes[0].nodes()[0].clone();
        shared.install(&thirds[1..]).expect("a map");
        assert_eq!(owner_of(&shared, 0).as_deref(), Some("127.0.0.1:1/0"));
        assert!(shared.stale.load(Ordering::Relaxed), "read again soon");
        std::thread::sleep(Duration::from_millis(300));
        shared.stale.store(false, Ordering::Relaxed);
        shared.install(&thirds[1..]).expect("a map");
        assert_eq!(owner_of(&shared, 0), None, "no master serves slot 0");
        assert_eq!(owner_of(&shared, 5461).as_deref(), Some("127.0.0.1:2/0"));
        assert_eq!(shared.map.read().all.nodes().len(), 2);
        assert!(old.pool.is_retired());
        assert!(
            !shared.stale.load(Ordering::Relaxed),
            "not read at every route"
        );
        // Served again, the slots are routed there, and a later gap is kept once more.
        shared.install(&thirds).expect("a map");
        assert_eq!(owner_of(&shared, 0).as_deref(), Some("127.0.0.1:1/0"));
        shared.install(&thirds[1..]).expect("a map");
        assert_eq!(owner_of(&shared, 0).as_deref(), Some("127.0.0.1:1/0"));
        assert!(shared.stale.load(Ordering::Relaxed));
    }

    /// A first map that names no master for some slots (a seed that has not yet heard
    /// all of a failover) has nothing to keep them on, and is read again soon.
    #[test]
    fn a_first_map_naming_no_master_for_some_slots_is_read_again() {
        let shared = shared_map(None);
        shared
            .install(&[served(2, 5461, 10922), served(3, 10923, 16383)])
            .expect("a map");
        assert_eq!(owner_of(&shared, 0), None);
        assert!(shared.stale.load(Ordering::Relaxed), "read again soon");
    }

    /// A redirect is followed in two steps (the node looked up or made, then the slot
    /// routed there), and a read of the map may come between them and drop the node: the
    /// routed node is known again, and serving, so that the next read that finds it
    /// serving nothing retires it (its connections and subscriber end).
    #[test]
    fn a_redirect_followed_across_a_read_of_the_map_leaves_its_node_known() {
        let shared = shared_map(None);
        shared.install(&[shard(1)]).expect("a map");
        let looked_up = shared.node("127.0.0.1", 2).expect("a node");
        // A map read before the move: it names the old master, and drops the new one.
        shared.install(&[shard(1)]).expect("a map");
        let routed = shared.route_moved("127.0.0.1:2", looked_up, 0);
        assert_eq!(owner_of(&shared, 0).as_deref(), Some("127.0.0.1:2/0"));
        assert!(!routed.pool.is_retired(), "routed to a retired node");
        let known = shared.map.read().known.get("127.0.0.1:2").cloned();
        assert!(
            known.is_some_and(|n| Arc::ptr_eq(&n, &routed)),
            "routed node not known"
        );
        shared.install(&[shard(1)]).expect("a map");
        assert!(
            routed.pool.is_retired(),
            "a node serving nothing left serving"
        );
    }

    /// A master that serves nothing at a read of the map loses its node. A route read
    /// before still holds it: a call there fails with a typed error, and a redirect it
    /// meets (naming no host) is followed. Serving again, the master gets a fresh node.
    #[test]
    fn a_retired_masters_node_is_dropped() {
        let shared = shared_map(None);
        let cluster = Cluster {
            shared: shared.clone(),
        };
        let keys = Keys::new("t:", b"k").expect("keys");
        shared.install(&[shard(1)]).expect("a map");
        let before = cluster.route(&keys);
        let old = before.nodes()[0].clone();
        shared.install(&[shard(2)]).expect("a map");
        let known: Vec<String> = shared.map.read().known.keys().cloned().collect();
        assert_eq!(known, vec!["127.0.0.1:2".to_owned()]);
        assert!(old.pool.is_retired());
        let ping = old.run(Retry::NEVER, |c| redis::cmd("PING").query::<()>(c));
        assert!(matches!(ping, Err(Error::Redis(_))), "{ping:?}");
        let next = shared.follow(&old, 0, ":2", true).expect("followed");
        assert_eq!(next.id, NodeId::new("127.0.0.1:2/0"));
        shared.install(&[shard(1)]).expect("a map");
        let again = cluster.route(&keys).nodes()[0].clone();
        assert_eq!(again.id, old.id);
        assert!(!Arc::ptr_eq(&again, &old), "the retired node given again");
        assert!(!again.pool.is_retired());
    }
}
