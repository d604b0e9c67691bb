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
/// braces, anything. Every key of one lock starts with the same Redis Cluster hash tag (the
/// first `{...}`), so they share one hash slot whatever the name and the prefix, and
/// different names spread over slots:
///
/// - **plain form**, when the prefix has no `{` and the name no `}`: the lock key is
///   `prefix{name}`; the tag is the name itself;
/// - **escaped form**, otherwise: `{h}prefix name`, where `h` is the 16 lower-case hex
///   digits of the name's FNV-1a-64 hash. In the plain form a `}` in the name would end the
///   tag early (`}x`: an empty tag, so the whole key is hashed and the lock and its counter
///   land in different slots), and a `{x}` in the prefix would be the tag of every lock.
///   The full name follows the tag, so escaped keys are unique; they never equal a plain
///   key, whose tag, when it starts the key, is followed by nothing but a suffix without
///   braces.
///
/// The other keys are the lock key plus a suffix (`:fence`, `:w`, `:latch`..., and `:ev`
/// for the channel).
///
/// Shared behind an `Arc`: the keys travel with the lock (guard, watchdog, fan-out jobs),
/// and a clone must not copy five buffers on every acquisition.
#[derive(Debug, Clone)]
pub(crate) struct Keys(std::sync::Arc<KeyBytes>);

/// Every key and channel of one name, in one buffer: an acquisition allocates it once
/// (and the `Arc` around it), not once per key.
#[derive(Debug)]
pub(crate) struct KeyBytes {
    /// The name, the lock key, then each suffix of the lock key in [`SUFFIXES`] order.
    buf: Box<[u8]>,
    name: usize,
    lock: usize,
    /// Where each suffix ends in `buf`.
    ends: [usize; SUFFIXES.len()],
}

/// The suffixes of the lock key that name a lock's other keys and its channel, in the
/// order `KeyBytes::ends` keeps them:
/// - `:fence`: the fencing counter;
/// - `:w`: who last failed to get the lock (a client id, with a short TTL): lets a holder
///   that subscribed late learn of a waiter whose live mark it could not hear;
/// - `:ev`: the library's own channel: `r` on release (when keyspace events are off) and
///   `c` when an acquire attempt failed (a remote process wants the lock);
/// - `:q`, `:qx`: the fair queue: waiting contenders by arrival, and when their entries
///   expire;
/// - `:lease`: the lease record (the number and token of the last lease change applied,
///   see `renewal::EXTEND`);
/// - `:ww`, `:wr`: a read-write lock's waiting writers and readers (see `rw_scripts`);
///   `:ww` also holds a semaphore's waiting permit-seekers (a name has one kind at a time);
/// - `:latch`: a countdown latch of the same name (see `latch_scripts`): a key of its own,
///   so a name can be a lock and a latch at once;
/// - `:qn`: the fair queue's nonces: the waiting contenders scored by their latest
///   attempt's nonce, which a grant tells them (see `fair_scripts`); for a read-write
///   lock, its waiting writers' (see `rw_scripts`);
/// - `:wa`: the waiting writers' and permit-seekers' arrivals, the order they are granted
///   in (see `rw_scripts`).
const SUFFIXES: [&[u8]; 11] = [
    b":fence", b":w", b":ev", b":q", b":qx", b":lease", b":ww", b":wr", b":latch", b":qn", b":wa",
];

impl PartialEq for Keys {
    /// The lock key says everything: the other keys derive from it.
    fn eq(&self, other: &Self) -> bool {
        self.lock() == other.lock()
    }
}

impl Eq for Keys {}

impl std::hash::Hash for Keys {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.lock().hash(state);
    }
}

impl Keys {
    pub fn new(prefix: &str, name: &[u8]) -> Result<Self> {
        if name.is_empty() {
            return Err(Error::InvalidName("empty"));
        }
        if name.len() > MAX_NAME_LEN {
            return Err(Error::InvalidName("longer than 4096 bytes"));
        }
        let lock = lock_key(prefix.as_bytes(), name);
        let suffixes: usize = SUFFIXES.iter().map(|s| lock.len() + s.len()).sum();
        let mut buf = Vec::with_capacity(name.len() + lock.len() + suffixes);
        buf.extend_from_slice(name);
        buf.extend_from_slice(&lock);
        let mut ends = [0; SUFFIXES.len()];
        for (end, suffix) in ends.iter_mut().zip(SUFFIXES) {
            buf.extend_from_slice(&lock);
            buf.extend_from_slice(suffix);
            *end = buf.len();
        }
        Ok(Keys(std::sync::Arc::new(KeyBytes {
            buf: buf.into_boxed_slice(),
            name: name.len(),
            lock: name.len() + lock.len(),
            ends,
        })))
    }

    pub fn name(&self) -> &[u8] {
        &self.0.buf[..self.0.name]
    }

    pub fn lock(&self) -> &[u8] {
        &self.0.buf[self.0.name..self.0.lock]
    }

    /// The lock key with the `i`-th of [`SUFFIXES`].
    fn suffixed(&self, i: usize) -> &[u8] {
        let start = if i == 0 {
            self.0.lock
        } else {
            self.0.ends[i - 1]
        };
        &self.0.buf[start..self.0.ends[i]]
    }

    pub fn fence(&self) -> &[u8] {
        self.suffixed(0)
    }

    pub fn mark(&self) -> &[u8] {
        self.suffixed(1)
    }

    pub fn channel(&self) -> &[u8] {
        self.suffixed(2)
    }

    pub fn queue(&self) -> &[u8] {
        self.suffixed(3)
    }

    pub fn queue_expiry(&self) -> &[u8] {
        self.suffixed(4)
    }

    /// The lease record (see `renewal::EXTEND`).
    pub fn lease(&self) -> &[u8] {
        self.suffixed(5)
    }

    /// A read-write lock's waiting writers.
    pub fn writers(&self) -> &[u8] {
        self.suffixed(6)
    }

    /// A semaphore's waiting permit-seekers: the set of a read-write lock's waiting
    /// writers, marked and woken the same way (see `rw_scripts`). The lock key has one kind
    /// at a time, so one set serves both with no key more (`inspect` and `locks` see these
    /// waiters as they see writers); only when a name changes kind do the old kind's last
    /// marks linger, a mark's TTL at most.
    pub fn permit_waiters(&self) -> &[u8] {
        self.writers()
    }

    /// A read-write lock's waiting readers.
    pub fn readers(&self) -> &[u8] {
        self.suffixed(7)
    }

    /// A countdown latch's count (see `latch_scripts`).
    pub fn latch(&self) -> &[u8] {
        self.suffixed(8)
    }

    /// The fair queue's nonces: each waiting token scored by its latest attempt's nonce.
    pub fn queue_nonce(&self) -> &[u8] {
        self.suffixed(9)
    }

    /// A read-write lock's waiting writers scored by their latest attempt's nonce, which
    /// a grant of the write hold tells them: the fair queue's set of nonces, which it is for
    /// a lock (the lock key has one kind at a time, see [`permit_waiters`](Self::permit_waiters)).
    pub fn writer_nonces(&self) -> &[u8] {
        self.queue_nonce()
    }

    /// When each of [`writers`](Self::writers) (a read-write lock's waiting writers, or a
    /// semaphore's permit-seekers) began to wait: the order a release grants them in.
    pub fn arrivals(&self) -> &[u8] {
        self.suffixed(10)
    }

    /// The name for log lines.
    pub fn display(&self) -> String {
        String::from_utf8_lossy(self.name()).into_owned()
    }
}

/// The lock key of `name` under `prefix` (see [`Keys`] for the two forms).
pub(crate) fn lock_key(prefix: &[u8], name: &[u8]) -> Vec<u8> {
    let plain = !prefix.contains(&b'{') && !name.contains(&b'}');
    let mut lock = Vec::with_capacity(prefix.len() + name.len() + 18);
    if plain {
        lock.extend_from_slice(prefix);
        lock.push(b'{');
        lock.extend_from_slice(name);
        lock.push(b'}');
    } else {
        lock.extend_from_slice(format!("{{{:016x}}}", fnv1a64(name)).as_bytes());
        lock.extend_from_slice(prefix);
        lock.extend_from_slice(name);
    }
    lock
}

/// The name whose lock key `key` is, or whose suffixed key (one of [`SUFFIXES`]), under
/// `prefix`, and that suffix (empty for the lock key itself); `None` for any other key.
/// The inverse of [`lock_key`] in both its forms: a decoded name is checked by making
/// its lock key again, so a key of the other form, or an escaped key whose hash is not its
/// name's, is never taken for a lock.
pub(crate) fn name_of_key<'k>(prefix: &[u8], key: &'k [u8]) -> Option<(&'k [u8], &'k [u8])> {
    let suffixes = std::iter::once(&b""[..]).chain(SUFFIXES);
    // Escaped form: `{h}prefix name`, h 16 hex digits; the name may end like a suffix, so
    // each split is tried and the hash decides.
    if let Some(rest) = key
        .get(18..)
        .filter(|_| key[0] == b'{' && key[17] == b'}')
        .and_then(|rest| rest.strip_prefix(prefix))
    {
        for suffix in suffixes.clone() {
            if let Some(name) = rest.strip_suffix(suffix)
                && !name.is_empty()
                && lock_key(prefix, name) == key[..key.len() - suffix.len()]
            {
                return Some((name, suffix));
            }
        }
    }
    // Plain form: `prefix{name}`: the name has no `}`, so the first one ends it.
    let inner = key.strip_prefix(prefix)?.strip_prefix(b"{")?;
    let close = inner.iter().position(|&b| b == b'}')?;
    let (name, suffix) = (&inner[..close], &inner[close + 1..]);
    let suffix = suffixes.into_iter().find(|s| *s == suffix)?;
    (!name.is_empty() && lock_key(prefix, name) == key[..key.len() - suffix.len()])
        .then_some((name, suffix))
}

/// The 64-bit FNV-1a hash: small, stable across versions and platforms, and spread well
/// enough to scatter names over hash slots.
fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// Redis Cluster's hash slot of `key`: CRC16 (XMODEM) of its hash tag (the bytes between
/// the first `{` and the next `}`, when not empty), or of the whole key, modulo 16384.
pub(crate) fn keyslot(key: &[u8]) -> u16 {
    let mut hashed = key;
    if let Some(open) = key.iter().position(|&b| b == b'{')
        && let Some(len) = key[open + 1..].iter().position(|&b| b == b'}')
        && len > 0
    {
        hashed = &key[open + 1..open + 1 + len];
    }
    let mut crc: u16 = 0;
    for &b in hashed {
        crc ^= u16::from(b) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc % 16384
}

/// A lock key no lock uses, under `prefix` (so that an ACL on the prefix covers it): its
/// channels are probed at connect, to learn what the server lets us subscribe and publish.
pub(crate) fn probe_lock(prefix: &str) -> Vec<u8> {
    lock_key(prefix.as_bytes(), b"redbaton-probe")
}

/// The library's own channel of a lock key. It shares the lock's hash tag, and so its
/// slot: a sharded publish (`proto::sharded`) of it stays on the lock's shard.
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
        let k = Keys::new("", &[0xff, 0x00, b'{']).unwrap();
        assert_eq!(k.lock(), &[b'{', 0xff, 0x00, b'{', b'}']);
        let k = Keys::new("", &[0xff, 0x00, b'}']).unwrap();
        assert!(k.lock().ends_with(&[0xff, 0x00, b'}']));
    }

    #[test]
    fn keyslot_matches_redis() {
        // Values from the Redis Cluster specification and `CLUSTER KEYSLOT`.
        assert_eq!(keyslot(b"123456789"), 0x31c3);
        assert_eq!(keyslot(b"foo"), 12182);
        assert_eq!(keyslot(b"{user1000}.following"), keyslot(b"user1000"));
        assert_eq!(keyslot(b"foo{{bar}}zap"), keyslot(b"{bar"));
    }

    fn slots_of(k: &Keys) -> [u16; 5] {
        [
            keyslot(k.lock()),
            keyslot(k.fence()),
            keyslot(k.mark()),
            keyslot(k.channel()),
            keyslot(k.latch()),
        ]
    }

    #[test]
    fn plain_layout_is_unchanged() {
        let k = Keys::new("redbaton:", b"a{b").unwrap();
        assert_eq!(k.lock(), b"redbaton:{a{b}");
        assert_eq!(k.mark(), b"redbaton:{a{b}:w");
        assert_eq!(k.channel(), b"redbaton:{a{b}:ev");
        let k = Keys::new("x}", b"n").unwrap();
        assert_eq!(k.lock(), b"x}{n}");
    }

    #[test]
    fn every_key_of_a_lock_shares_its_slot() {
        let prefixes = ["", "p:", "redbaton:", "{x}", "a{", "}", "{}", "{{"];
        let names: [&[u8]; 12] = [
            b"}x",
            b"}",
            b"}{",
            b"{}",
            b"{",
            b"a}b",
            b"x",
            b"{a}",
            b"\xff}",
            b"}}}",
            b"a{b}c",
            &[0xff, 0xfe, b'}', 0x00],
        ];
        for prefix in prefixes {
            for name in names {
                let k = Keys::new(prefix, name).unwrap();
                let s = slots_of(&k);
                assert!(s.iter().all(|x| *x == s[0]), "{prefix:?} {name:?}: {s:?}");
            }
        }
    }

    #[test]
    fn names_spread_over_slots_whatever_the_prefix() {
        for prefix in ["p:", "{x}", "a{"] {
            let slots: std::collections::HashSet<u16> = (0..1000)
                .map(|i| {
                    keyslot(
                        Keys::new(prefix, format!("n}}{i}").as_bytes())
                            .unwrap()
                            .lock(),
                    )
                })
                .collect();
            assert!(slots.len() > 900, "{prefix:?}: {} slots", slots.len());
        }
    }

    #[test]
    fn escaped_keys_are_distinct_from_plain_ones() {
        let escaped = Keys::new("", b"}").unwrap();
        assert_eq!(
            escaped.lock(),
            format!("{{{:016x}}}}}", fnv1a64(b"}")).as_bytes()
        );
        let tag = format!("{:016x}", fnv1a64(b"}"));
        let plain = Keys::new("", tag.as_bytes()).unwrap();
        assert_ne!(escaped.lock(), plain.lock());
        assert_ne!(
            Keys::new("{", b"a").unwrap().lock(),
            Keys::new("{", b"b").unwrap().lock()
        );
    }

    #[test]
    fn bad_names_are_errors() {
        assert!(Keys::new("p", b"").unwrap_err().is_invalid_input());
        let long = vec![b'a'; MAX_NAME_LEN + 1];
        assert!(Keys::new("p", &long).unwrap_err().is_invalid_input());
        assert!(Keys::new("p", &long[..MAX_NAME_LEN]).is_ok());
    }

    #[test]
    fn names_decode_from_their_keys() {
        let prefixes = ["", "p:", "redbaton:", "{x}", "a{", "}"];
        let names: [&[u8]; 8] = [
            b"n", b"}x", b"a{b", b"x:fence", b"{a}", b"q:q", b"}", b"a}:w",
        ];
        for prefix in prefixes {
            for name in names {
                let k = Keys::new(prefix, name).unwrap();
                let p = prefix.as_bytes();
                assert_eq!(
                    name_of_key(p, k.lock()),
                    Some((name, &b""[..])),
                    "{prefix:?} {name:?}"
                );
                assert_eq!(name_of_key(p, k.fence()), Some((name, &b":fence"[..])));
                assert_eq!(name_of_key(p, k.queue()), Some((name, &b":q"[..])));
                assert_eq!(name_of_key(p, k.queue_nonce()), Some((name, &b":qn"[..])));
                assert_eq!(name_of_key(p, k.writers()), Some((name, &b":ww"[..])));
                assert_eq!(name_of_key(p, k.arrivals()), Some((name, &b":wa"[..])));
            }
        }
        assert_eq!(name_of_key(b"p:", b"p:{a}:other"), None);
        assert_eq!(name_of_key(b"p:", b"p:plain"), None);
        assert_eq!(name_of_key(b"p:", b"q:{a}"), None);
        assert_eq!(name_of_key(b"p:", b"p:{}"), None);
        assert_eq!(name_of_key(b"p:", b"{0000000000000000}p:a"), None);
    }

    #[test]
    fn keyspace_channels_round_trip() {
        let c = keyspace_channel(3, b"p:{a}");
        assert_eq!(c, b"__keyspace@3__:p:{a}");
        assert_eq!(lock_of_keyspace_channel(&c), Some(&b"p:{a}"[..]));
    }
}
