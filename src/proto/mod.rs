//! The Redis protocol: key layout, scripts, connections and one node's operations.

pub(crate) mod keys;
pub(crate) mod node;
pub(crate) mod pool;
pub(crate) mod scripts;
pub(crate) mod skip;
