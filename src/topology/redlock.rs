//! Redlock: N independent masters serve every key; a majority decides. Operations go to
//! all nodes at once through the fan-out workers.

use std::sync::Arc;

use super::Route;
use super::fanout::Fanout;
use crate::error::{Result, thread_error};
use crate::proto::node::Node;

pub(crate) struct Redlock {
    route: Route,
    fanout: Fanout,
}

impl Redlock {
    pub fn new(nodes: Vec<Arc<Node>>, read_timeout: std::time::Duration) -> Result<Self> {
        let fanout =
            Fanout::start(nodes.len(), read_timeout).map_err(|e| thread_error("fanout", e))?;
        Ok(Redlock {
            route: Route::new(Arc::from(nodes)),
            fanout,
        })
    }

    pub fn route(&self) -> Route {
        self.route.clone()
    }

    pub fn fan_out<T, F>(&self, nodes: &[Arc<Node>], f: F) -> Vec<T>
    where
        T: Send + 'static,
        F: Fn(&Node) -> T + Send + Sync + 'static,
    {
        let nodes: Arc<[Arc<Node>]> = Arc::from(nodes);
        let n = nodes.len();
        self.fanout.map(n, Arc::new(move |i: usize| f(&nodes[i])))
    }
}
