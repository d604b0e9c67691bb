//! The lock protocol's Redis keys and fencing-token layout, as seen from outside the
//! library.
//!
//! The lock of name `n` is the key `{prefix}{n}` (the name between braces, byte for byte)
//! holding the holder's random token, and its fencing counter is `{prefix}{n}:fence`.
//! A fencing token is the counter's value shifted left by [`HANDOFF_BITS`], plus the number
//! of local handoffs since the lock was last taken from Redis.

/// The prefix a client uses unless `Builder::key_prefix` says otherwise.
pub const DEFAULT_PREFIX: &str = "redbaton:";

/// Low bits of a fencing token that number local handoffs (`redbaton` keeps the same
/// layout; its tests pin it down).
pub const HANDOFF_BITS: u32 = 20;

/// The largest `Builder::max_handoffs` accepted: a handoff count must fit in
/// [`HANDOFF_BITS`].
pub const MAX_HANDOFFS: u32 = (1 << HANDOFF_BITS) - 1;

/// How much one remote acquisition (one step of the fencing counter) adds to a token.
pub const FENCE_STEP: u64 = 1 << HANDOFF_BITS;

/// The fencing counter's part of a token.
pub fn fence_of(token: u64) -> u64 {
    token >> HANDOFF_BITS
}

/// The local handoff count of a token: 0 for a lock taken from Redis.
pub fn handoff_of(token: u64) -> u64 {
    token & (FENCE_STEP - 1)
}

/// The Redis keys of one key prefix.
///
/// ```
/// use redbaton_testkit::keys::Keys;
///
/// const KEYS: Keys = Keys::new("bt:");
/// assert_eq!(KEYS.lock("a"), "bt:{a}");
/// assert_eq!(KEYS.fence("a"), "bt:{a}:fence");
/// assert_eq!(Keys::DEFAULT.lock_bytes(b"\xff"), b"redbaton:{\xff}");
/// ```
#[derive(Clone, Copy, Debug)]
pub struct Keys {
    prefix: &'static str,
}

impl Keys {
    /// The keys of a client with the default prefix.
    pub const DEFAULT: Keys = Keys::new(DEFAULT_PREFIX);

    /// The keys of a client built with `.key_prefix(prefix)`.
    pub const fn new(prefix: &'static str) -> Keys {
        Keys { prefix }
    }

    pub fn prefix(&self) -> &'static str {
        self.prefix
    }

    /// The key holding lock `name`'s owner token: `{prefix}{name}`.
    pub fn lock(&self, name: &str) -> String {
        format!("{}{{{name}}}", self.prefix)
    }

    /// The fencing counter of lock `name`: `{prefix}{name}:fence`.
    pub fn fence(&self, name: &str) -> String {
        format!("{}:fence", self.lock(name))
    }

    /// [`Keys::lock`] for a name that may not be UTF-8.
    pub fn lock_bytes(&self, name: &[u8]) -> Vec<u8> {
        let mut k = Vec::with_capacity(self.prefix.len() + name.len() + 2);
        k.extend_from_slice(self.prefix.as_bytes());
        k.push(b'{');
        k.extend_from_slice(name);
        k.push(b'}');
        k
    }

    /// [`Keys::fence`] for a name that may not be UTF-8.
    pub fn fence_bytes(&self, name: &[u8]) -> Vec<u8> {
        let mut k = self.lock_bytes(name);
        k.extend_from_slice(b":fence");
        k
    }

    /// A `SCAN`/`KEYS` glob matching every lock key of this prefix (not the counters).
    pub fn lock_pattern(&self) -> String {
        format!("{}{{*}}", self.prefix)
    }
}
