//! One Redis node: it serves every key and decides alone.

use std::sync::Arc;

use super::Route;
use crate::proto::node::Node;
use crate::proto::protocol::Protocols;

pub(crate) struct Single {
    route: Route,
}

impl Single {
    pub fn new(node: Arc<Node>, protocol: Protocols) -> Self {
        Single {
            route: Route::new(Arc::from(vec![node]), protocol),
        }
    }

    pub fn route(&self) -> Route {
        self.route.clone()
    }
}
