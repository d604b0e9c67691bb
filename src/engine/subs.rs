//! The client's subscribers: one per node that locks of this process are routed to, keyed
//! by the node's id, started at build time for the nodes known then and on demand for
//! nodes that appear later (a Redis Cluster master after a reshard or a failover).
//!
//! A Redis Cluster master that serves nothing any more (removed, or demoted by a
//! failover) loses its subscriber: once nothing waits there, its thread ends on its own
//! (see `wake::listen`), and the next look at the list takes it out and joins it. With
//! masters coming and going at new addresses (pods restarted, failovers), subscribers
//! are those of the masters that serve, not of every master the client ever met. A master
//! that serves again gets a fresh one at the next route there.

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
    /// The subscribers, and those whose thread ended until the next look takes them out.
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
        if let Some(s) = list.iter().find(|s| *s.node() == node.id && !s.closed()) {
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
        let (mut all, ended) = split_ended(&list);
        all.push(sub.clone());
        *list = Arc::from(all);
        drop(list);
        // Joined (the last handle's drop joins its thread) outside the list's lock.
        drop(ended);
        Ok(sub)
    }

    /// Takes the subscribers whose thread ended out of the list, and joins them (the last
    /// handle's drop joins its thread; a waiter may hold one still, see
    /// `Subscriber::register`). The list as it is then.
    fn prune(&self) -> Arc<[Arc<Subscriber>]> {
        let mut list = self.list.write();
        let (live, ended) = split_ended(&list);
        if !ended.is_empty() {
            *list = Arc::from(live);
        }
        let now = list.clone();
        drop(list);
        drop(ended);
        now
    }

    /// The subscribers of the nodes of `route`, in the route's order; a node without one
    /// gets one now (none when polling).
    pub fn for_route(&self, route: &Route) -> Arc<[Arc<Subscriber>]> {
        let mut list = self.list.read().clone();
        if list.iter().any(|s| s.closed()) {
            list = self.prune();
        }
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
            .filter_map(
                |n| match list.iter().find(|s| *s.node() == n.id && !s.closed()) {
                    Some(s) => Some(s.clone()),
                    None if self.stopped.load(Ordering::Relaxed) => None,
                    None => self
                        .start(n, true)
                        .inspect_err(|e| log::warn!("node {}: no subscriber: {e}", n.id))
                        .ok(),
                },
            )
            .collect()
    }

    /// Each subscriber's node and connection figures (not those whose thread ended).
    pub fn stats(&self) -> Vec<SubscriberStats> {
        self.list
            .read()
            .iter()
            .filter(|s| !s.closed())
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
        self.list
            .read()
            .iter()
            .find(|s| s.node() == id && !s.closed())
            .cloned()
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

/// The subscribers of `list` whose thread runs, and those whose thread ended.
fn split_ended(list: &[Arc<Subscriber>]) -> (Vec<Arc<Subscriber>>, Vec<Arc<Subscriber>>) {
    list.iter().cloned().partition(|s| !s.closed())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::config::Config;
    use crate::proto::keys::Keys;
    use crate::topology::Topology;
    use crate::wake::events::Hears;

    /// Polls `cond` for up to 5 s; whether it held.
    fn within_5s(cond: impl Fn() -> bool) -> bool {
        let until = Instant::now() + Duration::from_secs(5);
        while Instant::now() < until {
            if cond() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        cond()
    }

    /// A node that serves nothing (a Redis Cluster master removed from the map; nothing
    /// listens at its address) keeps its subscriber while a waiter watches it there, and
    /// loses it once none does: not listed, not found, its thread ended. A waiter that
    /// took it from the list just before (the route read before the thread ended) and
    /// watches it after is told at once that its key moved away, with nothing to wait
    /// for: it follows (as for a moved slot), and the route gets a fresh subscriber.
    /// `shutdown` stops that one too. (No server is needed: the node is never reached.)
    #[test]
    fn a_retired_nodes_subscriber_ends_and_a_late_waiter_follows_on() {
        let counters = Arc::new(Counters::default());
        let cfg = Config {
            nodes: vec!["redis://127.0.0.1:1".to_owned()],
            ..Config::default()
        };
        let topology = Topology::open(&cfg, &counters, &Arc::from("test")).expect("topology");
        let keys = Keys::new("subs-test:", b"k").expect("keys");
        let route = topology.route(&keys);
        route.nodes()[0].pool.set_serving(false);
        let template = Template {
            configure: false,
            prefix: "subs-test:".to_owned(),
            client_id: "test".to_owned(),
        };
        let subs = Subs::new(Some(template), counters);
        let (poke, _poked) = crossbeam_channel::bounded(1);

        let first = subs.for_route(&route)[0].clone();
        let watch = first.watch(&keys, Hears::Key, poke.clone());
        std::thread::sleep(Duration::from_millis(1500));
        assert!(!first.closed(), "ended under a waiter's watch");
        assert!(!watch.moved());
        drop(watch);
        assert!(
            within_5s(|| first.closed()),
            "still running with nothing to do"
        );
        assert!(subs.stats().is_empty(), "listed once ended");
        assert!(subs.find(first.node()).is_none(), "found once ended");

        let late = first.watch(&keys, Hears::Key, poke);
        assert!(
            late.moved(),
            "a watch of an ended subscriber must follow its key"
        );
        assert!(!first.usable(), "nothing to confirm there");
        assert!(!late.snapshot().confirmed);
        drop(late);
        let fresh = subs.for_route(&route)[0].clone();
        assert!(
            !Arc::ptr_eq(&fresh, &first),
            "the ended subscriber given again"
        );
        assert!(!fresh.closed());
        assert_eq!(subs.stats().len(), 1, "the fresh one alone is listed");
        drop(first);
        assert!(subs.shutdown(Instant::now() + Duration::from_secs(5)));
    }
}
