//! Redlock: N independent masters serve every key; a majority decides. Operations go to
//! all nodes at once through the fan-out workers.

use std::sync::{Arc, Weak};

use super::Route;
use super::fanout::{Fanout, Probe};
use crate::error::{Result, thread_error};
use crate::proto::node::{Node, Retry};
use crate::proto::protocol::Protocols;

pub(crate) struct Redlock {
    route: Route,
    fanout: Fanout,
}

impl Redlock {
    /// Redlock over `nodes`; a node whose calls take `stall` is skipped until it answers
    /// faster (see [`Config::stall`](crate::config::Config::stall)).
    pub fn new(
        nodes: Vec<Arc<Node>>,
        stall: std::time::Duration,
        protocol: Protocols,
    ) -> Result<Self> {
        // A stalled node is probed with a PING; the nodes are held weakly (the fan-out's
        // workers must not keep the client's connections alive).
        let weak: Vec<Weak<Node>> = nodes.iter().map(Arc::downgrade).collect();
        let probe: Probe = Arc::new(move |i: usize| {
            if let Some(node) = weak.get(i).and_then(Weak::upgrade) {
                let _ = node.run(Retry::NEVER, |c| redis::cmd("PING").query::<()>(c));
            }
        });
        let fanout =
            Fanout::start(nodes.len(), stall, probe).map_err(|e| thread_error("fanout", e))?;
        Ok(Redlock {
            route: Route::new(Arc::from(nodes), protocol),
            fanout,
        })
    }

    pub fn route(&self) -> Route {
        self.route.clone()
    }

    /// `f` on every node of `nodes`, in parallel, until `done` says the replies so far
    /// decide the outcome: a node that hangs then holds up no caller whose majority has
    /// answered (`None`: no reply yet, its call goes on on its lane; or its call panicked).
    pub fn fan_out<T: Send + 'static>(
        &self,
        nodes: &[Arc<Node>],
        f: impl Fn(&Node) -> T + Send + Sync + 'static,
        done: &dyn Fn(&[Option<T>]) -> bool,
    ) -> Vec<Option<T>> {
        // Each call goes to its node's own lane, whichever nodes this call names.
        let lanes: Vec<usize> = nodes
            .iter()
            .map(|n| {
                self.route
                    .nodes()
                    .iter()
                    .position(|m| m.id == n.id)
                    .unwrap_or(0)
            })
            .collect();
        let nodes: Arc<[Arc<Node>]> = Arc::from(nodes);
        self.fanout
            .map_until(&lanes, Arc::new(move |i: usize| f(&nodes[i])), done)
    }
}
