//! Lock names and the Redis keys and channels derived from them.

use crate::error::{Error, Result};

/// Longest lock name accepted, in bytes. Redis allows 512 MB keys, but every wait, event
/// and log line carries the name: a name this long is a bug, not a key.
///
/// # Examples
///
/// ```
/// # fn main() -> Result<(), redbaton::Error> {
/// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
/// let too_long = vec![b'x'; redbaton::MAX_NAME_LEN + 1];
/// assert!(client.lock(&too_long).unwrap_err().is_invalid_input());
/// # Ok(()) }
/// ```
pub const MAX_NAME_LEN: usize = 4096;
/// Longest key prefix accepted, in bytes.
pub(crate) const MAX_PREFIX_LEN: usize = 1024;

/// The keys and channels of one lock name.
///
/// Names are arbitrary non-empty bytes (Redis keys are binary): UTF-8 or not, spaces,
/// braces, anything. The name sits between braces so that a Redis Cluster port keeps the
/// lock key and its fencing counter in one slot: the first `{...}` of both keys is the same.
///
/// Shared behind an `Arc`: the keys travel with the lock (guard, watchdog, fan-out jobs),
/// and a clone must not copy five buffers on every acquisition.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct Keys(std::sync::Arc<KeyBytes>);

#[derive(Debug, PartialEq, Eq, Hash)]
pub(crate) struct KeyBytes {
    name: Vec<u8>,
    lock: Vec<u8>,
    fence: Vec<u8>,
    /// Who last failed to get the lock (a client id, with a short TTL): lets a holder that
    /// subscribed late learn of a waiter whose live mark it could not hear.
    mark: Vec<u8>,
    /// The library's own channel: `r` on release (when keyspace events are off) and `c`
    /// when an acquire attempt failed (a remote process wants the lock).
    channel: Vec<u8>,
    /// The fair queue: waiting contenders by arrival, and when their entries expire.
    queue: Vec<u8>,
    queue_expiry: Vec<u8>,
}

impl Keys {
    pub fn new(prefix: &str, name: &[u8]) -> Result<Self> {
        if name.is_empty() {
            return Err(Error::InvalidName("empty"));
        }
        if name.len() > MAX_NAME_LEN {
            return Err(Error::InvalidName("longer than 4096 bytes"));
        }
        let mut lock = Vec::with_capacity(prefix.len() + name.len() + 2);
        lock.extend_from_slice(prefix.as_bytes());
        lock.push(b'{');
        lock.extend_from_slice(name);
        lock.push(b'}');
        let mut fence = lock.clone();
        fence.extend_from_slice(b":fence");
        let mut mark = lock.clone();
        mark.extend_from_slice(b":w");
        let channel = channel_of_lock(&lock);
        let mut queue = lock.clone();
        queue.extend_from_slice(b":q");
        let mut queue_expiry = lock.clone();
        queue_expiry.extend_from_slice(b":qx");
        Ok(Keys(std::sync::Arc::new(KeyBytes {
            name: name.to_vec(),
            lock,
            fence,
            mark,
            channel,
            queue,
            queue_expiry,
        })))
    }

    pub fn name(&self) -> &[u8] {
        &self.0.name
    }

    pub fn lock(&self) -> &[u8] {
        &self.0.lock
    }

    pub fn fence(&self) -> &[u8] {
        &self.0.fence
    }

    pub fn mark(&self) -> &[u8] {
        &self.0.mark
    }

    pub fn channel(&self) -> &[u8] {
        &self.0.channel
    }

    pub fn queue(&self) -> &[u8] {
        &self.0.queue
    }

    pub fn queue_expiry(&self) -> &[u8] {
        &self.0.queue_expiry
    }

    /// The name for log lines.
    pub fn display(&self) -> String {
        String::from_utf8_lossy(&self.0.name).into_owned()
    }
}

/// The library's own channel of a lock key.
pub(crate) fn channel_of_lock(lock: &[u8]) -> Vec<u8> {
    let mut c = Vec::with_capacity(lock.len() + 3);
    c.extend_from_slice(lock);
    c.extend_from_slice(b":ev");
    c
}

/// The lock key behind one of the library's own channels (`{lock}:ev`).
pub(crate) fn lock_of_channel(channel: &[u8]) -> Option<&[u8]> {
    channel.strip_suffix(b":ev")
}

/// The keyspace-notification channel of a key in database `db`.
pub(crate) fn keyspace_channel(db: i64, lock: &[u8]) -> Vec<u8> {
    let mut c = format!("__keyspace@{db}__:").into_bytes();
    c.extend_from_slice(lock);
    c
}

/// The key behind a keyspace-notification channel.
pub(crate) fn lock_of_keyspace_channel(channel: &[u8]) -> Option<&[u8]> {
    let rest = channel.strip_prefix(b"__keyspace@")?;
    let colon = rest.windows(3).position(|w| w == b"__:")?;
    Some(&rest[colon + 3..])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_share_a_hash_tag() {
        let k = Keys::new("p:", b"orders:42").unwrap();
        assert_eq!(k.lock(), b"p:{orders:42}");
        assert_eq!(k.fence(), b"p:{orders:42}:fence");
        assert_eq!(lock_of_channel(k.channel()), Some(k.lock()));
    }

    #[test]
    fn binary_names_are_kept_exactly() {
        let k = Keys::new("", &[0xff, 0x00, b'}']).unwrap();
        assert_eq!(k.lock(), &[b'{', 0xff, 0x00, b'}', b'}']);
    }

    #[test]
    fn bad_names_are_errors() {
        assert!(Keys::new("p", b"").unwrap_err().is_invalid_input());
        let long = vec![b'a'; MAX_NAME_LEN + 1];
        assert!(Keys::new("p", &long).unwrap_err().is_invalid_input());
        assert!(Keys::new("p", &long[..MAX_NAME_LEN]).is_ok());
    }

    #[test]
    fn keyspace_channels_round_trip() {
        let c = keyspace_channel(3, b"p:{a}");
        assert_eq!(c, b"__keyspace@3__:p:{a}");
        assert_eq!(lock_of_keyspace_channel(&c), Some(&b"p:{a}"[..]));
    }
}
