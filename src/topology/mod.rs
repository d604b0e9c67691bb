//! Which node(s) serve a lock's keys, and how many of them must agree.
//!
//! [`Topology`] is the one place that knows how the client's Redis is laid out. It is an
//! enum of flavors, each in its own file: a single node ([`single`]), Redlock over
//! independent masters ([`redlock`]), a Sentinel-managed master ([`sentinel`]) and Redis
//! Cluster ([`cluster`]). The contest loop, the watchdog and the release path
//! ask it for a lock's [`Route`] and for verdicts on the nodes' replies ([`verdict`]), and
//! never count nodes themselves. Nodes are named by a stable [`NodeId`] (their address),
//! never by position, so a flavor whose set of nodes changes while locks are held fits
//! behind the same questions.

mod call;
mod cluster;
mod fanout;
mod redlock;
pub(crate) mod ride;
mod sentinel;
mod single;
mod slots;
pub(crate) mod verdict;

use std::sync::Arc;
use std::time::{Duration, Instant};

use redis::{Cmd, RedisResult, Value};

use crate::config::Config;
use crate::error::{Error, Result};
use crate::proto::keys::Keys;
use crate::proto::node::{Node, NodeId, Parts, Retry};
use crate::proto::protocol::{Attempt, Kind, Protocol, Protocols, Request};
use crate::stats::Counters;

pub(crate) use call::is_read_only;
use call::{Path, is_failover_symptom};
use cluster::Cluster;
pub(crate) use cluster::with_caller_deadline;
use redlock::Redlock;
use sentinel::Sentinel;
use single::Single;
use verdict::{Renewal, Rules};

/// The layout of the client's Redis.
pub(crate) enum Topology {
    /// One node decides alone.
    Single(Single),
    /// N independent masters (N odd, at least 3); a majority decides.
    Redlock(Redlock),
    /// A master the sentinels name; it may move to another server while locks are held.
    Sentinel(Sentinel),
    /// Redis Cluster: the master serving the lock key's hash slot decides alone; masters
    /// and slots move while locks are held.
    Cluster(Cluster),
}

/// The node(s) that serve one lock's keys, how many of them must agree, and the
/// protocols holds follow on them.
#[derive(Clone)]
pub(crate) struct Route {
    nodes: Arc<[Arc<Node>]>,
    quorum: usize,
    /// Chosen when the route is built: the engine asks them, never the layout.
    protocols: Protocols,
    /// The lock lives wherever the route points now, not on the nodes that granted it
    /// (Redis Cluster: its slot may move to another master while it is held).
    follows: bool,
}

impl Route {
    fn new(nodes: Arc<[Arc<Node>]>, protocol: Protocols) -> Self {
        let quorum = nodes.len() / 2 + 1;
        Route::every(nodes, quorum, protocol)
    }

    /// `nodes`, of which `quorum` must agree.
    fn every(nodes: Arc<[Arc<Node>]>, quorum: usize, protocol: Protocols) -> Self {
        Route {
            nodes,
            quorum,
            protocols: protocol,
            follows: false,
        }
    }

    /// One node that serves the lock for now (a Redis Cluster slot's master).
    fn following(node: Arc<Node>, protocol: Protocols) -> Self {
        Route {
            nodes: Arc::from(vec![node]),
            quorum: 1,
            protocols: protocol,
            follows: true,
        }
    }

    /// The protocols of this route's holds (Redis Cluster: the same on every route).
    pub fn protocols(&self) -> Protocols {
        self.protocols
    }

    /// How a hold of `kind` is contended for and given back on this route; an error when
    /// the route cannot hold it (shared holds over Redlock).
    pub fn protocol(&self, kind: Kind) -> Result<Protocol> {
        self.protocols.get(kind)
    }

    /// The exclusive lock's protocol on this route.
    pub fn lock_protocol(&self) -> Protocol {
        self.protocols.lock()
    }

    /// How a round of acquire replies is judged on this route; `valid`: whether the lease
    /// had time left by the replies (see `verdict::lease_left`).
    pub fn rules(&self, valid: bool) -> Rules {
        Rules {
            quorum: self.quorum,
            sole: self.sole().is_some(),
            valid,
            jitter: Duration::from_millis(rand::random_range(2..=25)),
        }
    }

    /// What a round of extends on `holders` of this route's nodes says: `tally` is
    /// (extended, gone, held by another).
    pub fn renewal(&self, tally: (usize, usize, usize), holders: usize) -> Renewal {
        Renewal::judge(tally, holders, self.quorum, self.sole().is_none())
    }

    /// Every node of the route.
    pub fn nodes(&self) -> &[Arc<Node>] {
        &self.nodes
    }

    /// The ids of every node of the route: where a job left to the cleanup thread goes.
    pub fn node_ids(&self) -> Vec<NodeId> {
        self.nodes.iter().map(|n| n.id.clone()).collect()
    }

    /// How many nodes must agree.
    pub fn quorum(&self) -> usize {
        self.quorum
    }

    /// The node that decides alone, when one does. A reply from it is the whole answer,
    /// so a lost reply is worth retrying with the same arguments, and an attempt may be
    /// sent early by the subscriber on its own.
    pub fn sole(&self) -> Option<&Arc<Node>> {
        match &*self.nodes {
            [node] => Some(node),
            _ => None,
        }
    }

    /// How an idempotent command on this route is retried after a network failure: a
    /// lost reply from the deciding node is retried; with a majority to decide, a hung
    /// node is not waited for twice.
    pub fn retry(&self) -> Retry {
        if self.sole().is_some() {
            Retry::LOST_REPLY
        } else {
            Retry::ON_RESET
        }
    }

    /// Whether `other` names the same nodes, in the same order.
    pub fn same_nodes(&self, other: &Route) -> bool {
        self.nodes.len() == other.nodes.len()
            && self
                .nodes
                .iter()
                .zip(other.nodes.iter())
                .all(|(a, b)| a.id == b.id)
    }

    /// The nodes holding a lock that the nodes `granted` granted: those among them, or,
    /// when the lock follows its route (Redis Cluster), the route's nodes now.
    pub fn holders(&self, granted: &[NodeId]) -> Vec<Arc<Node>> {
        if self.follows {
            return self.nodes.to_vec();
        }
        self.among(granted)
    }

    /// The nodes of the route among `ids`.
    pub fn among(&self, ids: &[NodeId]) -> Vec<Arc<Node>> {
        self.nodes
            .iter()
            .filter(|n| ids.contains(&n.id))
            .cloned()
            .collect()
    }
}

impl Topology {
    /// Opens the nodes `cfg` names (no connection is made yet).
    pub fn open(cfg: &Config, counters: &Arc<Counters>, client_id: &Arc<str>) -> Result<Self> {
        if !cfg.cluster.is_empty() {
            return Ok(Topology::Cluster(Cluster::open(
                &cfg.cluster,
                cfg,
                counters,
                client_id,
            )?));
        }
        if let Some(sc) = &cfg.sentinel {
            return Ok(Topology::Sentinel(Sentinel::open(
                sc, cfg, counters, client_id,
            )?));
        }
        let nodes = cfg
            .nodes
            .iter()
            .enumerate()
            .map(|(i, url)| {
                let parts = Parts {
                    counters: counters.clone(),
                    client_id: client_id.clone(),
                    path: Path::plain(),
                };
                Node::new(&format!("node {i}"), url, cfg, parts).map(Arc::new)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(match nodes.len() {
            1 => Topology::Single(Single::new(
                nodes.into_iter().next().expect("one node"),
                Protocols::of(cfg),
            )),
            // Redlock never queues: independent masters cannot agree on one queue.
            _ => Topology::Redlock(Redlock::new(nodes, cfg.stall(), Protocols::majority(cfg))?),
        })
    }

    /// Every node the client talks to now (Redis Cluster: the masters; the set changes).
    pub fn nodes(&self) -> Arc<[Arc<Node>]> {
        self.any_route().nodes
    }

    /// [`nodes`](Self::nodes), with a Redis Cluster's slot map read again first (see
    /// [`Cluster::all_now`]): for a listing of every master, which no redirect would
    /// tell of a master added or removed.
    pub fn nodes_now(&self) -> Arc<[Arc<Node>]> {
        match self {
            Topology::Cluster(t) => t.all_now().nodes,
            _ => self.nodes(),
        }
    }

    /// How many of [`nodes`](Self::nodes) must be reachable at start.
    pub fn quorum(&self) -> usize {
        self.any_route().quorum
    }

    /// The nodes that serve the lock `keys`.
    pub fn route(&self, keys: &Keys) -> Route {
        match self {
            Topology::Single(t) => t.route(),
            Topology::Redlock(t) => t.route(),
            Topology::Sentinel(t) => t.route(),
            Topology::Cluster(t) => t.route(keys),
        }
    }

    /// Whether a call that failed with `e` should read its route again and retry after a
    /// short pause, and for how long at most when the caller set no deadline (counted from
    /// the first failure). Redis Cluster and Sentinel ride through a failover this way (see
    /// [`Cluster::failover_window`], [`Sentinel::failover_window`]); the other layouts
    /// return `None`: `e` is the answer.
    pub fn ride_through(&self, e: &Error) -> Option<Duration> {
        match self {
            Topology::Cluster(t) if is_failover_symptom(e) => Some(t.failover_window()),
            Topology::Sentinel(t) if is_failover_symptom(e) => Some(t.failover_window()),
            _ => None,
        }
    }

    /// Whether one call may renew several locks of a node only when their keys share a
    /// hash slot (Redis Cluster refuses a script whose keys are in different slots).
    pub fn batches_by_slot(&self) -> bool {
        matches!(self, Topology::Cluster(_))
    }

    fn any_route(&self) -> Route {
        match self {
            Topology::Single(t) => t.route(),
            Topology::Redlock(t) => t.route(),
            Topology::Sentinel(t) => t.route(),
            Topology::Cluster(t) => t.all(),
        }
    }

    /// One acquire attempt of `protocol` with `token` on every node of `route`, in
    /// parallel where several must answer; the replies by node.
    pub fn attempt(
        &self,
        route: &Route,
        protocol: Protocol,
        req: Request<'_>,
        deadline: Option<Instant>,
    ) -> Vec<(NodeId, Result<Attempt>)> {
        let retry = route.retry();
        if let Some(node) = route.sole() {
            // One node: no closure to share with other threads, nothing to clone.
            let reply = protocol.acquire(node, req, retry, deadline);
            return vec![(node.id.clone(), reply)];
        }
        let (k, t, lease, marks) = (req.keys.clone(), req.token.to_owned(), req.lease, req.marks);
        let nonce = req.nonce;
        self.fan_out(route.nodes(), move |node| {
            let req = Request {
                keys: &k,
                token: &t,
                lease,
                marks,
                nonce,
            };
            (
                node.id.clone(),
                protocol.acquire(node, req, retry, deadline),
            )
        })
    }

    /// The attempt the subscriber thread may send early for a waiter, on the route's node
    /// that decides alone: its node and call. `None` where no node decides alone (a
    /// majority must answer) or the protocol sends no early attempts.
    pub fn early_call(
        &self,
        route: &Route,
        protocol: Protocol,
        req: Request<'_>,
    ) -> Option<(Arc<Node>, Cmd)> {
        let node = route.sole()?;
        let call = protocol.early_call(node, req)?;
        Some((node.clone(), call))
    }

    /// The replies to an early attempt (see [`early_call`](Self::early_call)), from the
    /// subscriber's raw reply: sent again the usual way when that was lost.
    pub fn finish_early(
        &self,
        route: &Route,
        protocol: Protocol,
        reply: RedisResult<Value>,
        call: &Cmd,
        deadline: Option<Instant>,
    ) -> Vec<(NodeId, Result<Attempt>)> {
        let Some(node) = route.sole() else {
            return Vec::new();
        };
        let reply = protocol.finish_acquire(node, reply, call, route.retry(), deadline);
        vec![(node.id.clone(), reply)]
    }

    /// [`fan_out`](Self::fan_out), but on Redlock it returns as soon as `done` says the
    /// replies so far decide the outcome (`None`: a node that has not answered yet, whose
    /// call goes on on its own): a hung node holds up no call that a majority decided.
    /// Elsewhere every node's reply is awaited.
    pub fn fan_out_until<T, F>(
        &self,
        nodes: &[Arc<Node>],
        f: F,
        done: impl Fn(&[Option<T>]) -> bool,
    ) -> Vec<Option<T>>
    where
        T: Send + 'static,
        F: Fn(&Node) -> T + Send + Sync + 'static,
    {
        match (self, nodes) {
            (Topology::Redlock(t), [_, _, ..]) => t.fan_out(nodes, f, &done),
            _ => self.fan_out(nodes, f).into_iter().map(Some).collect(),
        }
    }

    /// `f(node)` for each of `nodes`, in parallel where several must answer (a round
    /// costs about the slowest node's round trip, not the sum); replies in `nodes` order.
    pub fn fan_out<T, F>(&self, nodes: &[Arc<Node>], f: F) -> Vec<T>
    where
        T: Send + 'static,
        F: Fn(&Node) -> T + Send + Sync + 'static,
    {
        match (self, nodes) {
            (_, [node]) => vec![f(node)],
            (Topology::Redlock(t), _) => (t.fan_out(nodes, f, &|_| false).into_iter())
                .map(|v| v.expect("a node's call panicked"))
                .collect(),
            // Redis Cluster: masters come and go, so no standing lanes; a scoped thread per
            // extra master (only the watchdog asks several at once, every few seconds), so
            // that a hung master does not hold up the renewals on the others.
            // A thread that cannot be spawned runs its node inline instead.
            (_, [first, rest @ ..]) => std::thread::scope(|s| {
                let f = &f;
                let others: Vec<_> = rest
                    .iter()
                    .map(|n| {
                        std::thread::Builder::new()
                            .name("redbaton-fanout".to_owned())
                            .spawn_scoped(s, move || f(n))
                            .map_err(|_| n)
                    })
                    .collect();
                let mut out = vec![f(first)];
                out.extend(others.into_iter().map(|h| {
                    match h {
                        Ok(h) => h
                            .join()
                            .unwrap_or_else(|panic| std::panic::resume_unwind(panic)),
                        Err(n) => f(n),
                    }
                }));
                out
            }),
            (_, []) => Vec::new(),
        }
    }

    /// Stops the topology's own threads (the Sentinel watcher) and waits for them until
    /// `deadline`; `false` if one still runs.
    pub fn shutdown(&self, deadline: std::time::Instant) -> bool {
        match self {
            Topology::Sentinel(t) => t.shutdown(deadline),
            _ => true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Redlock routes never queue, whatever the settings ask: independent masters cannot
    /// agree on one queue. One node follows the settings. (No connection is made.)
    #[test]
    fn redlock_routes_get_the_plain_protocol() {
        let (counters, client_id) = (Arc::new(Counters::default()), Arc::from("test"));
        let keys = Keys::new("t", b"k").expect("keys");
        let url = |port: u16| format!("redis://127.0.0.1:{port}");
        let redlock = Config {
            fair: true,
            nodes: (1..=3).map(url).collect(),
            ..Config::default()
        };
        let t = Topology::open(&redlock, &counters, &client_id).expect("redlock");
        let protocol = t.route(&keys).lock_protocol();
        assert!(matches!(protocol, Protocol::Lock { .. }), "{protocol:?}");
        let single = Config {
            nodes: vec![url(1)],
            ..redlock
        };
        let t = Topology::open(&single, &counters, &client_id).expect("single");
        let protocol = t.route(&keys).lock_protocol();
        assert!(matches!(protocol, Protocol::FairLock(_)), "{protocol:?}");
    }
}
