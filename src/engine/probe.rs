//! How the local table hears of remote contention: through the node's subscriber.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::local::table::Probe;
use crate::proto::keys::Keys;
use crate::proto::node::NodeId;
use crate::wake::subscriber::Subscriber;

impl Probe for Arc<Subscriber> {
    fn node(&self) -> &NodeId {
        Subscriber::node(self)
    }

    fn interest(&self, keys: &Keys) -> Box<dyn Send> {
        Box::new(Subscriber::interest(self, keys))
    }

    fn heard_mark_within(&self, keys: &Keys, window: Duration) -> bool {
        Subscriber::heard_mark_within(self, keys, window)
    }

    fn hears_marks(&self) -> bool {
        Subscriber::hears_marks(self)
    }

    fn confirmed_at(&self, keys: &Keys) -> Option<Instant> {
        Subscriber::confirmed_at(self, keys)
    }
}
