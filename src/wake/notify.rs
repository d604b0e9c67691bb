//! The start-up check of `notify-keyspace-events`.
//!
//! Keyspace notifications are off by default and server-wide. We need the keyspace channel
//! (`K`) for the classes that say a lock key changed: generic (`g`: `del`, `rename`...),
//! expired (`x`), evicted (`e`) and string (`$`: `set`, another process took the key).
//! Missing classes are added to whatever the server has, never replacing it. When that is
//! not allowed (the builder said no, `CONFIG` is renamed away, or an ACL forbids it), the
//! client falls back to the library's own channel: its release script publishes `r`, which
//! wakes waiters on every release by this library; expiries are then caught by the waiter's
//! timed wake at the end of the holder's remaining lease.

use std::collections::HashMap;

use redis::Connection;

use crate::error::is_network_error;

/// Errors that say something is wrong with the connection or its credentials, not that
/// `CONFIG` is refused: reported as errors, never turned into a silent fallback.
fn is_fatal(e: &redis::RedisError) -> bool {
    is_network_error(e)
        || e.kind() == redis::ErrorKind::AuthenticationFailed
        || matches!(e.code(), Some("NOAUTH" | "WRONGPASS"))
}

/// The classes we need, in `notify-keyspace-events` syntax.
pub(crate) const NEEDED: &str = "Kg$xe";

/// How waiters of one node are woken.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Mode {
    /// Keyspace notifications are on (or were turned on).
    Keyspace,
    /// They are not and cannot be: the reason, for the one warning.
    Fallback(String),
}

/// The classes of `NEEDED` that `flags` lacks. `A` stands for every class but `K`, `E`,
/// and the key-miss/new-key ones.
pub(crate) fn missing(flags: &str) -> String {
    NEEDED
        .chars()
        .filter(|&c| !(flags.contains(c) || (c != 'K' && flags.contains('A'))))
        .collect()
}

/// Checks the node's flags and merges in what is missing when `allowed`.
/// A network error is returned as such; every refusal becomes [`Mode::Fallback`].
pub(crate) fn ensure(conn: &mut Connection, allowed: bool) -> redis::RedisResult<Mode> {
    // A map: a flat array on a RESP2 connection, a map on the subscriber's RESP3 one.
    let current: HashMap<String, String> = match redis::cmd("CONFIG")
        .arg("GET")
        .arg("notify-keyspace-events")
        .query(conn)
    {
        Ok(v) => v,
        Err(e) if is_fatal(&e) => return Err(e),
        Err(e) => return Ok(Mode::Fallback(format!("CONFIG GET refused ({e})"))),
    };
    let flags = current
        .get("notify-keyspace-events")
        .cloned()
        .unwrap_or_default();
    let lacking = missing(&flags);
    if lacking.is_empty() {
        return Ok(Mode::Keyspace);
    }
    if !allowed {
        return Ok(Mode::Fallback(format!(
            "notify-keyspace-events is {flags:?}, lacking {lacking:?}, and configure_notifications is off"
        )));
    }
    let merged = format!("{flags}{lacking}");
    match redis::cmd("CONFIG")
        .arg("SET")
        .arg("notify-keyspace-events")
        .arg(&merged)
        .query::<()>(conn)
    {
        Ok(()) => {
            log::info!("notify-keyspace-events set to {merged:?} (was {flags:?})");
            Ok(Mode::Keyspace)
        }
        Err(e) if is_fatal(&e) => Err(e),
        Err(e) => Ok(Mode::Fallback(format!(
            "CONFIG SET notify-keyspace-events refused ({e})"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::missing;

    #[test]
    fn merges_never_replace() {
        assert_eq!(missing(""), "Kg$xe");
        assert_eq!(missing("AKE"), "");
        assert_eq!(missing("KA"), "");
        assert_eq!(missing("Ex"), "Kg$e");
        assert_eq!(missing("gxK"), "$e");
        assert_eq!(missing("A"), "K");
    }
}
