//! The client's subscribers: one per node that waiters of this process wait on, keyed by
//! the node's id, started at build time for the nodes known then and on demand for nodes
//! that appear later (a Redis Cluster master after a reshard or a failover).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use parking_lot::RwLock;

use crate::error::{Result, thread_error};
use crate::proto::node::{Node, NodeId};
use crate::stats::{Counters, SubscriberStats};
use crate::topology::Route;
use crate::wake::subscriber::{Connector, Setup, Subscriber};

/// Every subscriber, and how to start one more.
pub(crate) struct Subs {
    list: RwLock<Arc<[Arc<Subscriber>]>>,
    /// `None` when waiters poll: no subscriber at all.
    template: Option<Template>,
    counters: Arc<Counters>,
    /// The client shut down: no subscriber starts any more (a wait still under way that
    /// follows its key to a new node is woken by its timers there, as everywhere).
    stopped: AtomicBool,
}

/// What every subscriber of the client shares.
pub(crate) struct Template {
    pub configure: bool,
    pub prefix: String,
    pub client_id: String,
}

impl Subs {
    pub fn new(template: Option<Template>, counters: Arc<Counters>) -> Self {
        Subs {
            list: RwLock::new(Arc::from(Vec::new())),
            template,
            counters,
            stopped: AtomicBool::new(false),
        }
    }

    /// Whether waiters poll instead (no subscriber will ever run).
    pub fn is_empty(&self) -> bool {
        self.template.is_none()
    }

    /// Starts the subscriber of `node`; `keyspace`: whether its keyspace notifications
    /// are known to work (the subscriber checks again on each connection).
    ///
    /// # Errors
    ///
    /// The thread could not be spawned, or the client shut down.
    pub fn start(&self, node: &Node, keyspace: bool) -> Result<Arc<Subscriber>> {
        let Some(t) = &self.template else {
            return Err(crate::error::Error::Protocol(
                "no subscribers when polling".to_owned(),
            ));
        };
        let mut list = self.list.write();
        if let Some(s) = list.iter().find(|s| *s.node() == node.id) {
            return Ok(s.clone());
        }
        // Read under the list's lock, which `shutdown` takes to set it: a subscriber is
        // either in the list it stops, or never started.
        if self.stopped.load(Ordering::Relaxed) {
            return Err(crate::error::Error::ShutDown);
        }
        let setup = Setup {
            node: node.id.clone(),
            db: node.db,
            keyspace,
            configure: t.configure,
            prefix: t.prefix.clone(),
            client_id: t.client_id.clone(),
            connector: Connector {
                pool: node.pool.clone(),
            },
        };
        let sub = Arc::new(
            Subscriber::start(setup, self.counters.clone())
                .map_err(|e| thread_error("subscriber", e))?,
        );
        let mut all = list.to_vec();
        all.push(sub.clone());
        *list = Arc::from(all);
        Ok(sub)
    }

    /// The subscribers of the nodes of `route`, in the route's order; a node without one
    /// gets one now (none when polling).
    pub fn for_route(&self, route: &Route) -> Arc<[Arc<Subscriber>]> {
        let list = self.list.read().clone();
        let nodes = route.nodes();
        // Every node but Redis Cluster's: the route is all of them, in order.
        if list.len() == nodes.len() && list.iter().zip(nodes).all(|(s, n)| *s.node() == n.id) {
            return list;
        }
        if self.template.is_none() {
            return list;
        }
        nodes
            .iter()
            .filter_map(|n| match list.iter().find(|s| *s.node() == n.id) {
                Some(s) => Some(s.clone()),
                None if self.stopped.load(Ordering::Relaxed) => None,
                None => self
                    .start(n, true)
                    .inspect_err(|e| log::warn!("node {}: no subscriber: {e}", n.id))
                    .ok(),
            })
            .collect()
    }

    /// Each subscriber's node and connection figures.
    pub fn stats(&self) -> Vec<SubscriberStats> {
        self.list
            .read()
            .iter()
            .map(|s| {
                let (reconnects, connected) = s.connection();
                SubscriberStats {
                    node: s.node().to_string(),
                    reconnects,
                    connected,
                }
            })
            .collect()
    }

    /// The subscriber of node `id`, if it has one.
    pub fn find(&self, id: &NodeId) -> Option<Arc<Subscriber>> {
        self.list.read().iter().find(|s| s.node() == id).cloned()
    }

    /// Stops every subscriber and waits for them until `deadline`; `false` if one still
    /// runs then.
    pub fn shutdown(&self, deadline: Instant) -> bool {
        let list = {
            let list = self.list.write();
            self.stopped.store(true, Ordering::Relaxed);
            list.clone()
        };
        let mut all = true;
        for s in list.iter() {
            all &= s.shutdown(deadline);
        }
        all
    }
}
