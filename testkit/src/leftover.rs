//! The keys a lock leaves in Redis once its users have gone, and how long the library lets
//! each kind of key stay.
//!
//! Every key of lock name `n` is its lock key `L` (see [`Keys`]) plus a suffix:
//!
//! | key | written by | how long it may stay |
//! |---|---|---|
//! | `L` (string) | exclusive lock, fair grant | its lease |
//! | `L` (sorted set) | read-write lock or semaphore holds | its longest live hold's lease |
//! | `L:fence` | every remote acquisition | see [`KeyPolicy::fence`] |
//! | `L:lease` | a lease change (renewal, extend) of an exclusive lock | its lease |
//! | `L:w` | a failed non-fair acquire that waits (the contention mark) | the mark TTL |
//! | `L:q`, `L:qx`, `L:qn` | the fair queue | see [`KeyPolicy::queue`] |
//! | `L:ww`, `L:wr` | waiting writers and readers of a read-write lock | twice the mark TTL |
//! | `L:wa` | the arrivals of the waiting writers or permit-seekers | twice the mark TTL |
//!
//! The mark TTL is twice the client's re-check interval (a waiter renews its mark at each
//! attempt, and attempts at least that often); so is a fair queue entry's.
//! `L:ev` is a channel, never a key.
//!
//! [`misplaced`] reports the keys that break these rules: no TTL where one is due, a TTL
//! longer than allowed, or a suffix the table does not know (a new kind of key must be
//! added here, with its bound).

use std::fmt;
use std::time::Duration;

use crate::keys::Keys;

/// A kind of key of one lock name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum KeyKind {
    /// `L`: the holder's token, or the holds of a read-write lock or semaphore.
    Lock,
    /// `L:fence`: the fencing counter.
    Fence,
    /// `L:lease`: the number and token of the last lease change applied to the lock.
    LeaseRecord,
    /// `L:w`: who last failed to get a non-fair lock and waits.
    Mark,
    /// `L:q`: the fair queue by arrival.
    Queue,
    /// `L:qx`: the fair queue's entry expiries.
    QueueExpiry,
    /// `L:qn`: the fair queue's nonces (each entry's latest attempt's).
    QueueNonce,
    /// `L:ww`: writers waiting for a read-write lock.
    WaitingWriters,
    /// `L:wr`: readers waiting for a read-write lock.
    WaitingReaders,
    /// `L:wa`: when each waiting writer or permit-seeker came.
    WaitingArrivals,
}

impl KeyKind {
    /// The suffix after the lock key (empty for the lock key itself).
    pub fn suffix(self) -> &'static str {
        match self {
            KeyKind::Lock => "",
            KeyKind::Fence => ":fence",
            KeyKind::LeaseRecord => ":lease",
            KeyKind::Mark => ":w",
            KeyKind::Queue => ":q",
            KeyKind::QueueExpiry => ":qx",
            KeyKind::QueueNonce => ":qn",
            KeyKind::WaitingWriters => ":ww",
            KeyKind::WaitingReaders => ":wr",
            KeyKind::WaitingArrivals => ":wa",
        }
    }

    /// Every kind the library writes.
    pub const ALL: [KeyKind; 10] = [
        KeyKind::Lock,
        KeyKind::Fence,
        KeyKind::LeaseRecord,
        KeyKind::Mark,
        KeyKind::Queue,
        KeyKind::QueueExpiry,
        KeyKind::QueueNonce,
        KeyKind::WaitingWriters,
        KeyKind::WaitingReaders,
        KeyKind::WaitingArrivals,
    ];
}

/// How long a kind of key may stay after its users have gone.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Allowed {
    /// It may stay, with or without a TTL.
    Forever,
    /// It must carry a TTL of at most this.
    Within(Duration),
}

impl fmt::Display for Allowed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Allowed::Forever => f.write_str("may stay"),
            Allowed::Within(d) => write!(f, "TTL at most {} ms", d.as_millis()),
        }
    }
}

/// The bounds of one client configuration.
#[derive(Clone, Copy, Debug)]
pub struct KeyPolicy {
    /// The longest lease any holder used (builder lease, or the longest `extend`).
    pub lease: Duration,
    /// Twice the re-check interval: the TTL of a waiting mark and of a fair queue entry.
    pub mark_ttl: Duration,
    /// The fence counter: within the client's `fence_ttl` (7 days by default; set it for
    /// clients built with another).
    pub fence: Allowed,
    /// The fair queue `L:q` / `L:qx` / `L:qn`. By default it must expire within twice the longer
    /// of an entry's TTL and the lease: a queue outlives its last live entry by at most
    /// that much.
    pub queue: Allowed,
}

impl KeyPolicy {
    /// The bounds of clients built with `lease` and `recheck_interval`.
    pub fn new(lease: Duration, recheck_interval: Duration) -> KeyPolicy {
        let mark_ttl = recheck_interval * 2;
        KeyPolicy {
            lease,
            mark_ttl,
            fence: Allowed::Within(Duration::from_secs(7 * 24 * 3600)),
            queue: Allowed::Within(mark_ttl.max(lease) * 2),
        }
    }

    /// How long a key of `kind` may stay (a read-write lock's or semaphore's key, a
    /// sorted set, ends with its longest live hold, as an exclusive lock's with its lease).
    pub fn allowed(&self, kind: KeyKind) -> Allowed {
        match kind {
            KeyKind::Lock | KeyKind::LeaseRecord => Allowed::Within(self.lease),
            KeyKind::Fence => self.fence,
            KeyKind::Mark => Allowed::Within(self.mark_ttl),
            KeyKind::Queue | KeyKind::QueueExpiry | KeyKind::QueueNonce => self.queue,
            KeyKind::WaitingWriters | KeyKind::WaitingReaders | KeyKind::WaitingArrivals => {
                Allowed::Within(self.mark_ttl * 2)
            }
        }
    }
}

/// The name and kind of `key` among the keys of `names`, if it is one of them.
pub fn kind_of<'a>(keys: Keys, names: &[&'a str], key: &[u8]) -> Option<(&'a str, KeyKind)> {
    names.iter().find_map(|name| {
        let lock = keys.lock_bytes(name.as_bytes());
        let rest = key.strip_prefix(lock.as_slice())?;
        KeyKind::ALL
            .into_iter()
            .find(|k| k.suffix().as_bytes() == rest)
            .map(|k| (*name, k))
    })
}

/// A key that breaks the rules of [`KeyPolicy`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Misplaced {
    pub key: String,
    /// Its kind, `None` when it is not a known key of a known name.
    pub kind: Option<KeyKind>,
    /// `PTTL` when checked: milliseconds, -1 without TTL.
    pub pttl: i64,
    pub allowed: Option<Allowed>,
}

impl fmt::Display for Misplaced {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ttl = if self.pttl < 0 {
            "no TTL".to_owned()
        } else {
            format!("TTL {} ms", self.pttl)
        };
        match (self.kind, self.allowed) {
            (Some(kind), Some(allowed)) => {
                write!(f, "{} ({kind:?}): {ttl}, allowed: {allowed}", self.key)
            }
            _ => write!(f, "{}: unknown kind of key ({ttl})", self.key),
        }
    }
}

/// The keys of the server behind `conn` under `keys`' prefix that break `policy`, for
/// locks named `names`. Call it once every client has gone: a live holder's keys are
/// within the bounds too, but a key being written may be read between two commands.
pub fn misplaced(
    conn: &mut redis::Connection,
    keys: Keys,
    names: &[&str],
    policy: &KeyPolicy,
) -> Vec<Misplaced> {
    let all: Vec<Vec<u8>> = redis::cmd("KEYS")
        .arg(format!("*{}*", keys.prefix()))
        .query(conn)
        .expect("KEYS");
    let mut bad = Vec::new();
    for key in all {
        let pttl: i64 = redis::cmd("PTTL").arg(&key).query(conn).expect("PTTL");
        if pttl == -2 {
            continue; // expired since KEYS
        }
        let shown = String::from_utf8_lossy(&key).into_owned();
        let Some((_, kind)) = kind_of(keys, names, &key) else {
            bad.push(Misplaced {
                key: shown,
                kind: None,
                pttl,
                allowed: None,
            });
            continue;
        };
        let allowed = policy.allowed(kind);
        let ok = match allowed {
            Allowed::Forever => true,
            Allowed::Within(d) => pttl >= 0 && pttl as u128 <= d.as_millis(),
        };
        if !ok {
            bad.push(Misplaced {
                key: shown,
                kind: Some(kind),
                pttl,
                allowed: Some(allowed),
            });
        }
    }
    bad
}

/// What `key` holds, in one line, for a history: a string's value, or a sorted set's first
/// members with their scores, and the server's clock (ms) to compare expiry scores with.
pub fn contents(conn: &mut redis::Connection, key: &str) -> String {
    let ty: String = redis::cmd("TYPE").arg(key).query(conn).expect("TYPE");
    let (secs, micros): (u64, u64) = redis::cmd("TIME").query(conn).expect("TIME");
    let now_ms = secs * 1000 + micros / 1000;
    let value = match ty.as_str() {
        "string" => {
            let v: Option<String> = redis::cmd("GET").arg(key).query(conn).expect("GET");
            format!("{v:?}")
        }
        "zset" => {
            let v: Vec<(String, f64)> = redis::cmd("ZRANGE")
                .arg(key)
                .arg(0)
                .arg(19)
                .arg("WITHSCORES")
                .query(conn)
                .expect("ZRANGE");
            let n: u64 = redis::cmd("ZCARD").arg(key).query(conn).expect("ZCARD");
            let shown: Vec<String> = v.iter().map(|(m, s)| format!("{m}@{s}")).collect();
            format!("{n} members: {}", shown.join(" "))
        }
        other => format!("a {other}"),
    };
    format!("{key} = {value} (server time {now_ms} ms)")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_are_told_apart() {
        let keys = Keys::new("p:");
        let names = ["a", "a:q"];
        assert_eq!(kind_of(keys, &names, b"p:{a}"), Some(("a", KeyKind::Lock)));
        assert_eq!(
            kind_of(keys, &names, b"p:{a}:qx"),
            Some(("a", KeyKind::QueueExpiry))
        );
        assert_eq!(
            kind_of(keys, &names, b"p:{a:q}:fence"),
            Some(("a:q", KeyKind::Fence))
        );
        assert_eq!(kind_of(keys, &names, b"p:{a}:zz"), None);
        assert_eq!(kind_of(keys, &names, b"p:{b}"), None);
    }

    #[test]
    fn misplaced_keys_are_found_on_a_real_server() {
        let srv = crate::server::RedisServer::start();
        let mut c = srv.conn();
        let keys = Keys::new("p:");
        let run = |c: &mut redis::Connection, args: &[&str]| {
            let mut cmd = redis::cmd(args[0]);
            for a in &args[1..] {
                cmd.arg(*a);
            }
            cmd.query::<redis::Value>(c).expect("command");
        };
        run(&mut c, &["SET", "p:{a}", "t", "PX", "900"]); // within the lease
        run(&mut c, &["SET", "p:{a}:fence", "7", "PX", "60000"]); // within fence_ttl
        run(&mut c, &["SET", "p:{a}:lease", "3:t", "PX", "5000"]); // longer than the lease
        run(&mut c, &["SET", "p:{a}:w", "id", "PX", "60000"]); // longer than the mark TTL
        run(&mut c, &["ZADD", "p:{a}:q", "1", "x"]); // no TTL
        run(&mut c, &["SET", "p:{a}:zz", "?"]); // unknown
        run(&mut c, &["SET", "other", "not ours"]);
        let policy = KeyPolicy::new(Duration::from_secs(1), Duration::from_secs(5));
        let mut bad: Vec<String> = misplaced(&mut c, keys, &["a"], &policy)
            .into_iter()
            .map(|m| m.key)
            .collect();
        bad.sort();
        assert_eq!(bad, ["p:{a}:lease", "p:{a}:q", "p:{a}:w", "p:{a}:zz"]);
        assert!(contents(&mut c, "p:{a}:q").contains("1 members: x@1"));
    }

    #[test]
    fn bounds_follow_the_configuration() {
        let p = KeyPolicy::new(Duration::from_secs(1), Duration::from_secs(5));
        assert_eq!(
            p.allowed(KeyKind::Lock),
            Allowed::Within(Duration::from_secs(1))
        );
        assert_eq!(
            p.allowed(KeyKind::Mark),
            Allowed::Within(Duration::from_secs(10))
        );
        assert_eq!(
            p.allowed(KeyKind::Fence),
            Allowed::Within(Duration::from_secs(7 * 24 * 3600))
        );
        assert_eq!(
            p.allowed(KeyKind::LeaseRecord),
            Allowed::Within(Duration::from_secs(1))
        );
    }
}
