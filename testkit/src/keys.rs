//! The lock protocol's Redis keys and fencing-token layout, as seen from outside the
//! library.
//!
//! The lock of name `n` is the key `{prefix}{n}` (the name between braces, byte for byte)
//! holding the holder's random token, and its fencing counter is `{prefix}{n}:fence`.
//! When the prefix holds a `{` or the name a `}` (either would break the Redis Cluster
//! hash tag), the lock key is `{h}{prefix}{n}` instead, `h` being the 16 lower-case hex
//! digits of the name's FNV-1a-64 hash, so that all of a lock's keys share one slot.
//! A fencing token is the counter's value shifted left by [`HANDOFF_BITS`], plus the number
//! of local handoffs since the lock was last taken from Redis.
//!
//! The counter also says whether its last hold was released ([`Counter`]): `<f>` released
//! (or a fair grant its waiter has not confirmed yet), `-<f>` held, `-0<f>` held by a hold
//! that began after one that ended without a release.

/// The prefix a client uses unless `Builder::key_prefix` says otherwise.
pub const DEFAULT_PREFIX: &str = "redbaton:";

/// Low bits of a fencing token that number local handoffs (`redbaton` keeps the same
/// layout; its tests pin it down).
pub const HANDOFF_BITS: u32 = 12;

/// The largest `Builder::max_handoffs` accepted: a handoff count must fit in
/// [`HANDOFF_BITS`].
pub const MAX_HANDOFFS: u32 = (1 << HANDOFF_BITS) - 1;

/// How much one remote acquisition (one step of the fencing counter) adds to a token.
pub const FENCE_STEP: u64 = 1 << HANDOFF_BITS;

/// What a fence counter's value says (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Counter {
    /// The last fence issued.
    pub fence: u64,
    /// Its hold has not been released: it is held, or it ended without a release.
    pub held: bool,
    /// Held, by a hold that began after one that ended without a release.
    pub after_lost: bool,
}

impl Counter {
    /// Reads a counter's value; `None` for one that is not a fence.
    ///
    /// ```
    /// use redbaton_testkit::keys::Counter;
    ///
    /// assert_eq!(Counter::parse("12"), Some(Counter { fence: 12, held: false, after_lost: false }));
    /// assert_eq!(Counter::parse("-12"), Some(Counter { fence: 12, held: true, after_lost: false }));
    /// assert_eq!(Counter::parse("-012"), Some(Counter { fence: 12, held: true, after_lost: true }));
    /// assert_eq!(Counter::parse("x"), None);
    /// ```
    pub fn parse(value: &str) -> Option<Counter> {
        let n: i64 = value.parse().ok()?;
        (n != 0).then(|| Counter {
            fence: n.unsigned_abs(),
            held: n < 0,
            after_lost: value.starts_with("-0"),
        })
    }

    /// The counter `key` on `conn`, if it holds a fence.
    pub fn read(conn: &mut redis::Connection, key: &[u8]) -> Option<Counter> {
        let value: Option<String> = redis::cmd("GET").arg(key).query(conn).expect("GET");
        value.as_deref().and_then(Counter::parse)
    }
}

/// Counts the fences a server issues from the moment it is started, through `MONITOR`
/// (which shows the commands scripts call): each issuance writes the name's counter with
/// one `SET <…:fence> <value> PX <ttl> GET`, and no other write of a counter has both
/// `PX` and `GET` (a release keeps the TTL, a second write of the same issuance too). A
/// fence is `max(last + 1, the server's clock in µs)`, so values alone cannot tell one
/// issuance from two.
///
/// Start it before the acquisitions it should count; [`FenceCount::issued`] then counts
/// every fence issued until it is called, by any client.
pub struct FenceCount<'a> {
    srv: &'a crate::server::RedisServer,
    monitor: crate::monitor::Monitor,
    seen: std::cell::Cell<u64>,
}

impl<'a> FenceCount<'a> {
    /// Starts counting the fences `srv` issues.
    pub fn start(srv: &'a crate::server::RedisServer) -> FenceCount<'a> {
        FenceCount {
            srv,
            monitor: crate::monitor::Monitor::start(srv),
            seen: std::cell::Cell::new(0),
        }
    }

    /// The fences issued since [`start`](Self::start), up to now.
    pub fn issued(&self) -> u64 {
        let issues = self
            .monitor
            .flush(self.srv)
            .iter()
            .filter_map(|l| crate::monitor::parse_line(l))
            .filter(|(_, args)| {
                let has = |word: &str| args.iter().any(|a| a.eq_ignore_ascii_case(word));
                args.first().is_some_and(|c| c.eq_ignore_ascii_case("set"))
                    && args.get(1).is_some_and(|k| k.ends_with(":fence"))
                    && has("px")
                    && has("get")
            })
            .count();
        self.seen.set(self.seen.get() + issues as u64);
        self.seen.get()
    }
}

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

    /// The key holding lock `name`'s owner token: `{prefix}{name}` (or the escaped form,
    /// see the module docs).
    pub fn lock(&self, name: &str) -> String {
        String::from_utf8(self.lock_bytes(name.as_bytes())).expect("UTF-8 in, UTF-8 out")
    }

    /// The fencing counter of lock `name`: `{prefix}{name}:fence`.
    pub fn fence(&self, name: &str) -> String {
        format!("{}:fence", self.lock(name))
    }

    /// [`Keys::lock`] for a name that may not be UTF-8.
    ///
    /// ```
    /// use redbaton_testkit::keys::Keys;
    ///
    /// assert_eq!(Keys::new("p:").lock_bytes(b"}x"), b"{08e04207b57f61d0}p:}x");
    /// ```
    pub fn lock_bytes(&self, name: &[u8]) -> Vec<u8> {
        let prefix = self.prefix.as_bytes();
        let mut k = Vec::with_capacity(prefix.len() + name.len() + 18);
        if !prefix.contains(&b'{') && !name.contains(&b'}') {
            k.extend_from_slice(prefix);
            k.push(b'{');
            k.extend_from_slice(name);
            k.push(b'}');
        } else {
            let mut h: u64 = 0xcbf2_9ce4_8422_2325;
            for &b in name {
                h ^= u64::from(b);
                h = h.wrapping_mul(0x0000_0100_0000_01b3);
            }
            k.extend_from_slice(format!("{{{h:016x}}}").as_bytes());
            k.extend_from_slice(prefix);
            k.extend_from_slice(name);
        }
        k
    }

    /// [`Keys::fence`] for a name that may not be UTF-8.
    pub fn fence_bytes(&self, name: &[u8]) -> Vec<u8> {
        let mut k = self.lock_bytes(name);
        k.extend_from_slice(b":fence");
        k
    }

    /// A `SCAN`/`KEYS` glob matching every plain-form lock key of this prefix (not the
    /// counters, nor escaped-form keys).
    pub fn lock_pattern(&self) -> String {
        format!("{}{{*}}", self.prefix)
    }
}
