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

/// The server setting of the classes notified.
const FLAGS: &str = "notify-keyspace-events";

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
    Ok(ensure_reading(conn, allowed, &[])?.0)
}

/// [`ensure`], reading the settings `also` in the same `CONFIG GET` (several parameters in
/// one call: Redis 7; an older server, which takes one, is asked again one parameter per
/// call). Returns the values of `also` that were read: none when `CONFIG GET` is refused.
pub(crate) fn ensure_reading(
    conn: &mut Connection,
    allowed: bool,
    also: &[&str],
) -> redis::RedisResult<(Mode, HashMap<String, String>)> {
    let params: Vec<&str> = std::iter::once(FLAGS).chain(also.iter().copied()).collect();
    let current = config_get(conn, &params);
    let current = match current {
        Ok(v) => v,
        Err(e) if is_fatal(&e) => return Err(e),
        Err(e) => {
            let why = format!("CONFIG GET refused ({e})");
            return Ok((Mode::Fallback(why), HashMap::new()));
        }
    };
    let read = also
        .iter()
        .filter_map(|&k| current.get(k).map(|v| (k.to_owned(), v.clone())))
        .collect();
    Ok((merge(conn, allowed, &current)?, read))
}

/// `CONFIG GET notify-keyspace-events` and `also`, as a map (a flat array on a RESP2
/// connection, a map on the subscriber's RESP3 one).
/// `CONFIG GET` of `params` in one call, or, on a server before Redis 7 (which takes one
/// parameter per call), one call each: the first parameter's error is the call's, a later
/// one's reads nothing of it.
pub(crate) fn config_get(
    conn: &mut Connection,
    params: &[&str],
) -> redis::RedisResult<HashMap<String, String>> {
    let get = |conn: &mut Connection, params: &[&str]| {
        redis::cmd("CONFIG").arg("GET").arg(params).query(conn)
    };
    match get(conn, params) {
        Err(e) if params.len() > 1 && is_arity_error(&e) => {
            let mut all: HashMap<String, String> = get(conn, &params[..1])?;
            for &param in &params[1..] {
                all.extend(get(conn, &[param]).unwrap_or_default());
            }
            Ok(all)
        }
        other => other,
    }
}

/// A server before Redis 7 refuses a `CONFIG GET` of several parameters this way.
fn is_arity_error(e: &redis::RedisError) -> bool {
    e.to_string().contains("wrong number of arguments")
}

/// The flags read are `current`: merges in what is missing, when `allowed`.
fn merge(
    conn: &mut Connection,
    allowed: bool,
    current: &HashMap<String, String>,
) -> redis::RedisResult<Mode> {
    let flags = current.get(FLAGS).cloned().unwrap_or_default();
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
        .arg(FLAGS)
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
