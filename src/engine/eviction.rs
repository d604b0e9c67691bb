//! The start-up check of the node's eviction policy.
//!
//! Every key of the library has a TTL (a lock key its lease, a fencing counter
//! `fence_ttl`), so a `volatile-*` policy, as an `allkeys-*` one, may evict a held lock
//! under memory pressure, and another client then takes it while the holder believes it
//! holds it, or a fencing counter, and the next holder is not told of a lost hold. Only
//! `noeviction` (writes fail instead) is safe, and no policy evicts while `maxmemory` is
//! 0 (no limit). The check reads the two settings where `CONFIG GET` is allowed and warns
//! once per node per client; a refusal is not worth more than a debug line.

use std::collections::HashMap;

use redis::Connection;

use crate::proto::node::NodeId;

/// The settings read, in `CONFIG GET` syntax.
pub(crate) const SETTINGS: [&str; 2] = ["maxmemory", "maxmemory-policy"];

/// Why the node may evict lock keys, or `None`: `settings` holds what was read of
/// [`SETTINGS`] (a missing value is taken as safe: nothing is known).
pub(crate) fn risk(settings: &HashMap<String, String>) -> Option<String> {
    let maxmemory: u64 = settings.get("maxmemory")?.parse().ok()?;
    let policy = settings.get("maxmemory-policy")?;
    if maxmemory == 0 || policy == "noeviction" {
        return None;
    }
    // Every key of the library has a TTL, so `volatile-*` may evict any of them too.
    let what = "a held lock's key (another client can then take the lock) and a fencing counter";
    Some(format!(
        "maxmemory-policy is {policy} with maxmemory {maxmemory}: under memory pressure Redis may evict {what}; set maxmemory-policy noeviction"
    ))
}

/// Warns (once: the caller checks a node once per client) when `settings` say the node
/// may evict lock keys.
pub(crate) fn warn_if_risky(node: &NodeId, settings: &HashMap<String, String>) {
    if let Some(why) = risk(settings) {
        log::warn!("node {node}: {why}");
    }
}

/// Reads [`SETTINGS`] on its own (when waiters poll, no notification check reads them),
/// one at a time on a server before Redis 7. A refusal (an ACL, a renamed `CONFIG`) reads
/// nothing.
pub(crate) fn read(node: &NodeId, conn: &mut Connection) -> HashMap<String, String> {
    crate::wake::notify::config_get(conn, &SETTINGS).unwrap_or_else(|e| {
        log::debug!("node {node}: eviction policy unknown: {e}");
        HashMap::new()
    })
}

#[cfg(test)]
mod tests {
    use super::risk;

    fn settings(maxmemory: &str, policy: &str) -> std::collections::HashMap<String, String> {
        [("maxmemory", maxmemory), ("maxmemory-policy", policy)]
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect()
    }

    #[test]
    fn only_noeviction_or_no_limit_is_safe() {
        assert!(risk(&settings("0", "volatile-lru")).is_none());
        assert!(risk(&settings("104857600", "noeviction")).is_none());
        assert!(risk(&Default::default()).is_none());
        for policy in [
            "volatile-lru",
            "volatile-ttl",
            "allkeys-lru",
            "allkeys-random",
        ] {
            let why = risk(&settings("104857600", policy)).expect(policy);
            assert!(why.contains(policy) && why.contains("noeviction"), "{why}");
        }
        assert!(
            risk(&settings("1", "allkeys-lfu"))
                .unwrap()
                .contains("fencing counter")
        );
    }
}
