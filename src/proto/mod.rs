//! The Redis protocol: key layout, scripts, connections and one node's operations.

pub(crate) mod ack;
pub(crate) mod attempt;
pub(crate) mod connect;
pub(crate) mod fair_scripts;
pub(crate) mod inspect_scripts;
pub(crate) mod keys;
pub(crate) mod latch_scripts;
pub(crate) mod multi_scripts;
pub(crate) mod node;
pub(crate) mod pool;
pub(crate) mod protocol;
pub(crate) mod renewal;
pub(crate) mod rw_scripts;
pub(crate) mod scripts;
pub(crate) mod sharded;
pub(crate) mod skip;
