//! The operators' view: what Redis holds for a name ([`LockClient::inspect`]), which names
//! are held or waited for ([`LockClient::locks`]), and a fence-checked release of a stuck
//! lock ([`LockClient::force_release`]).
//!
//! Everything here reads the keys as they are, with one read-only script per name and
//! node (`proto::inspect_scripts`); only `force_release` writes, and only when the fence
//! it is given is still the lock's.

use std::collections::{HashSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use crate::api::client::LockClient;
use crate::engine::state::Engine;
use crate::error::{Error, Result};
use crate::proto::inspect_scripts::{self, Forced, Scan, Snapshot};
use crate::proto::keys::Keys;
use crate::proto::node::Node;

/// What Redis holds for one name: its kind, holder or holds, fair queue, waiting marks and
/// fence counter, read in one round trip on the node that serves it, at one instant of the
/// server's clock (in a Redis Cluster slot half-way through a migration, whose masters
/// refuse a command naming keys that only some of them hold, one key per command,
/// wherever each one is: moments apart).
///
/// One node, a Sentinel-managed master or a Redis Cluster slot's master decides alone, and
/// its view is the whole answer ([`nodes`](Self::nodes) is empty). On Redlock every
/// master is read: [`nodes`](Self::nodes) has each answering master's own view, in the
/// order the builder named them, and the other fields are the majority's: the view of
/// the first master whose lock key a majority of the masters share (one holder's token,
/// or a key of one other kind), since only a majority makes a Redlock hold. A key on
/// fewer (a round under way, what a failed one left, masters that did not answer) is no
/// holder: the view is then the first answering master's, [`LockKind::Free`], with no
/// [`holder`](Self::holder). [`is_waited_for`](Self::is_waited_for) looks at every
/// master's; [`unreachable`](Self::unreachable) names those that did not answer.
///
/// Lists (holds, queue entries, marks) stop at 1,000 entries per key.
///
/// # Examples
///
/// ```
/// # fn main() -> Result<(), redbaton::Error> {
/// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
/// let guard = client.lock("orders:42")?;
/// let info = client.inspect("orders:42")?;
/// assert_eq!(info.kind, redbaton::LockKind::Lock);
/// let holder = info.holder.as_ref().expect("held");
/// assert!(holder.mine);
/// assert_eq!(holder.fence, Some(guard.fencing_token() >> 12));
/// println!("{info:#?}");
/// # Ok(()) }
/// ```
#[derive(Clone, PartialEq)]
#[non_exhaustive]
pub struct LockInfo {
    /// The lock's name.
    pub name: Vec<u8>,
    /// The node that answered (its address; `sentinel:<master>` for a Sentinel master).
    pub node: String,
    /// What the name's key is.
    pub kind: LockKind,
    /// The fence counter (`p{n}:fence`): while a lock or a write hold is held, its fence
    /// (each acquisition, or grant to the fair queue's head, issues the next). `None` when
    /// the counter is gone (never locked, or idle longer than the counter's TTL).
    pub fence: Option<u64>,
    /// A plain lock's holder ([`LockKind::Lock`] only).
    pub holder: Option<Holder>,
    /// A read-write lock's or a semaphore's holds, the one expiring first first.
    pub holds: Vec<Hold>,
    /// The fair queue, in arrival order: the first entry is granted the lock next.
    pub queue: Vec<QueueEntry>,
    /// Writers waiting for a read-write lock: how long each live mark has left (a waiting
    /// writer renews it at each attempt; while one lives, no new read hold is granted).
    /// For a semaphore: the processes waiting for a permit, marked the same way.
    pub waiting_writers: Vec<Duration>,
    /// Readers waiting for a read-write lock, as [`waiting_writers`](Self::waiting_writers).
    pub waiting_readers: Vec<Duration>,
    /// A plain lock's contention mark: another process failed to get the lock lately and
    /// waits; how long the mark has left.
    pub contention: Option<Duration>,
    /// Redlock: each answering master's own view (each with no `nodes` of its own).
    /// Empty elsewhere.
    pub nodes: Vec<LockInfo>,
    /// Redlock: the masters that did not answer. Empty elsewhere.
    pub unreachable: Vec<String>,
}

impl std::fmt::Debug for LockInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut d = f.debug_struct("LockInfo");
        d.field("name", &String::from_utf8_lossy(&self.name))
            .field("node", &self.node)
            .field("kind", &self.kind)
            .field("fence", &self.fence)
            .field("holder", &self.holder)
            .field("holds", &self.holds)
            .field("queue", &self.queue)
            .field("waiting_writers", &self.waiting_writers)
            .field("waiting_readers", &self.waiting_readers)
            .field("contention", &self.contention);
        if !self.nodes.is_empty() || !self.unreachable.is_empty() {
            d.field("nodes", &self.nodes)
                .field("unreachable", &self.unreachable);
        }
        d.finish()
    }
}

impl LockInfo {
    /// Whether somebody holds the name now: a plain lock, a live read, write or permit
    /// hold, or a key of another type (which stands in every acquisition's way); on
    /// Redlock, on a majority of the masters (see [`LockInfo`]).
    ///
    /// # Examples
    ///
    /// ```
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// assert!(!client.inspect("free")?.is_held());
    /// let _permit = client.semaphore("pool", 2).acquire()?;
    /// assert!(client.inspect("pool")?.is_held());
    /// # Ok(()) }
    /// ```
    pub fn is_held(&self) -> bool {
        match self.kind {
            LockKind::Free => false,
            LockKind::Lock | LockKind::Foreign { .. } => true,
            LockKind::ReadWrite | LockKind::Semaphore { .. } => {
                self.holds.iter().any(|h| h.lease_left.is_some())
            }
        }
    }

    /// Whether some process waits for the name: a live fair-queue entry, a waiting
    /// writer's or reader's mark, or a contention mark; on Redlock, on any master.
    ///
    /// # Examples
    ///
    /// ```
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// let _guard = client.lock("job")?;
    /// assert!(!client.inspect("job")?.is_waited_for(), "nobody else asked");
    /// # Ok(()) }
    /// ```
    pub fn is_waited_for(&self) -> bool {
        self.nodes.iter().any(LockInfo::is_waited_for) || self.waited_for_here()
    }

    /// Whether this view (one node's) shows a waiter.
    fn waited_for_here(&self) -> bool {
        self.queue.iter().any(|q| q.expires_in.is_some())
            || !self.waiting_writers.is_empty()
            || !self.waiting_readers.is_empty()
            || self.contention.is_some()
    }
}

/// What a name's key is.
///
/// # Examples
///
/// ```
/// # fn main() -> Result<(), redbaton::Error> {
/// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
/// use redbaton::LockKind;
/// let _r = client.rwlock("catalog").read()?;
/// let _p = client.semaphore("pool", 3).acquire()?;
/// assert_eq!(client.inspect("catalog")?.kind, LockKind::ReadWrite);
/// assert_eq!(client.inspect("pool")?.kind, LockKind::Semaphore { permits: 3 });
/// assert_eq!(client.inspect("nothing")?.kind, LockKind::Free);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum LockKind {
    /// No key: nobody holds the name (a fair queue may still wait for it).
    Free,
    /// A plain lock (see [`LockInfo::holder`]).
    Lock,
    /// A read-write lock (see [`LockInfo::holds`]).
    ReadWrite,
    /// A semaphore of this many permits (see [`LockInfo::holds`]).
    Semaphore {
        /// The permit count its holders use.
        permits: u32,
    },
    /// A key under the prefix that this library did not write (another Redis type, or a
    /// sorted set without a kind member): reported, never modified. It blocks every
    /// acquisition of the name.
    Foreign {
        /// Its Redis type, as `TYPE` says (`hash`, `list`, ...).
        redis_type: String,
    },
}

/// The holder of a plain lock.
///
/// # Examples
///
/// ```
/// # fn main() -> Result<(), redbaton::Error> {
/// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
/// let _guard = client.lock("report")?;
/// let holder = client.inspect("report")?.holder.expect("held");
/// assert!(holder.mine);
/// assert!(holder.lease_left.expect("a lease") <= std::time::Duration::from_secs(30));
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Holder {
    /// The holder's fence: the fence counter while it holds (what
    /// [`force_release`](LockClient::force_release) compares; `None` when the counter is
    /// gone, which `force_release` takes as fence 0). A guard's
    /// [`fencing_token`](crate::LockGuard::fencing_token) is this fence shifted left by 12
    /// bits, plus the number of local handoffs.
    pub fence: Option<u64>,
    /// What is left of its lease (`None`: the key has no expiry, so it was not set by this
    /// library).
    pub lease_left: Option<Duration>,
    /// Whether this client holds it (its token is one of this client's held locks).
    pub mine: bool,
}

/// One hold of a read-write lock or a semaphore.
///
/// # Examples
///
/// ```
/// # fn main() -> Result<(), redbaton::Error> {
/// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
/// let _w = client.rwlock("catalog").write()?;
/// let info = client.inspect("catalog")?;
/// assert_eq!(info.holds.len(), 1);
/// assert_eq!(info.holds[0].kind, redbaton::HoldKind::Write);
/// assert!(info.holds[0].mine);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Hold {
    /// Read, write, upgradable read or permit.
    pub kind: HoldKind,
    /// What is left of its lease; `None` when it has expired (its holder stopped renewing
    /// it: it counts no more, and the next script run on the name drops it).
    pub lease_left: Option<Duration>,
    /// Whether this client holds it.
    pub mine: bool,
}

/// What a [`Hold`] holds.
///
/// # Examples
///
/// ```
/// # fn main() -> Result<(), redbaton::Error> {
/// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
/// let _r = client.rwlock("catalog").read()?;
/// assert_eq!(client.inspect("catalog")?.holds[0].kind, redbaton::HoldKind::Read);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum HoldKind {
    /// A read hold of a read-write lock.
    Read,
    /// The write hold of a read-write lock.
    Write,
    /// A semaphore's permit.
    Permit,
    /// The upgradable read hold of a read-write lock (see
    /// [`RwLock::upgradable_read`](crate::RwLock::upgradable_read)).
    Upgradable,
}

/// A process waiting in a fair lock's queue ([`Builder::fair`](crate::Builder::fair)).
///
/// # Examples
///
/// ```
/// # fn main() -> Result<(), redbaton::Error> {
/// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).fair(true).build()?;
/// let _guard = client.lock("fifo")?;
/// // Processes that wait for "fifo" now queue; each is a `QueueEntry`.
/// for entry in client.inspect("fifo")?.queue {
///     println!("waiting {:?}, expires in {:?}", entry.age, entry.expires_in);
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct QueueEntry {
    /// How long ago it joined the queue.
    pub age: Duration,
    /// When its entry expires unless its next attempt renews it; `None` when it has
    /// expired (the waiter died or gave up unheard: it will be dropped, never granted).
    pub expires_in: Option<Duration>,
}

/// What [`LockClient::force_release`] did.
///
/// # Examples
///
/// ```
/// # fn main() -> Result<(), redbaton::Error> {
/// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
/// use redbaton::ForceRelease;
/// assert_eq!(client.force_release("nothing", 1)?, ForceRelease::NotHeld);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ForceRelease {
    /// The lock and its lease record were deleted, and its waiters told, on this many
    /// nodes (one but on Redlock).
    Released {
        /// Nodes where it was deleted.
        nodes: usize,
    },
    /// There was no lock to release: nothing was changed.
    NotHeld,
    /// The lock is held under another fence (a new holder got it since the fence was
    /// read): nothing was changed.
    FenceMismatch {
        /// The fence counter now (`None`: gone).
        current: Option<u64>,
    },
}

impl LockClient {
    /// What Redis holds for `name`, read in one read-only round trip on the node that
    /// serves it (Redlock: on every master at once; see [`LockInfo`]). Nothing is written
    /// and no expiry changes: expired holds and queue entries are reported as expired.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidName`]; Redis errors of the node (Redlock: when no master answered).
    ///
    /// # Examples
    ///
    /// ```
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// let info = client.inspect("orders:42")?;
    /// if let Some(holder) = &info.holder {
    ///     println!("held under fence {:?} for {:?} more", holder.fence, holder.lease_left);
    /// }
    /// # Ok(()) }
    /// ```
    pub fn inspect(&self, name: impl AsRef<[u8]>) -> Result<LockInfo> {
        let engine = self.engine();
        let keys = Keys::new(&engine.cfg.key_prefix, name.as_ref())?;
        inspect_keys(engine, &keys)
    }

    /// The names under this client's key prefix that are held or waited for, with what
    /// [`inspect`](Self::inspect) says of each, their names matching `pattern` (a Redis
    /// glob over names: `*`, `?`, `[a-z]`, `\` to escape, a `\` at the end being a
    /// backslash and a class left open running to the end; empty means every name).
    ///
    /// Names are bytes, and so is the pattern: a `&str`, or bytes for names that are not
    /// UTF-8 (a byte that is not UTF-8 matches itself). The glob applies to the name
    /// alone, whichever form its keys take: the key prefix, and the braces or hash tag
    /// around the name in the key, are not matched by it.
    ///
    /// Found with `SCAN` (`MATCH`, a bounded `COUNT`) on every node the client talks to
    /// (Redis Cluster: each master), never `KEYS`: one page per step of the iterator, so
    /// the server is never blocked by a long listing. As with `SCAN`, a name held or freed
    /// during the listing may or may not be in it; each name comes once.
    ///
    /// # Errors
    ///
    /// An item is an error when a page or an inspection failed; the listing goes on with
    /// the next name (after an inspection error), or asks the failed page again at the
    /// next step, from where it failed, so that one lost page drops none of the node's
    /// other names. A node whose pages fail 3 times in a row is given up (the third error
    /// is its last item, and the rest of its names are not listed): the listing goes on
    /// with the next node, and always ends.
    ///
    /// # Examples
    ///
    /// ```
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// let _a = client.lock("orders:1")?;
    /// let _b = client.lock("orders:2")?;
    /// let mut names: Vec<Vec<u8>> = client
    ///     .locks("orders:*")
    ///     .map(|info| info.map(|i| i.name))
    ///     .collect::<Result<_, _>>()?;
    /// names.sort();
    /// assert_eq!(names, [b"orders:1".to_vec(), b"orders:2".to_vec()]);
    ///
    /// // A name that is not UTF-8, found by a pattern of bytes.
    /// let _raw = client.lock(b"raw:\xff\x01")?;
    /// let raw: Vec<Vec<u8>> = client
    ///     .locks(b"raw:\xff*")
    ///     .map(|info| info.map(|i| i.name))
    ///     .collect::<Result<_, _>>()?;
    /// assert_eq!(raw, [b"raw:\xff\x01".to_vec()]);
    /// # Ok(()) }
    /// ```
    pub fn locks(&self, pattern: impl AsRef<[u8]>) -> Locks {
        let pattern = pattern.as_ref();
        let engine = self.engine().clone();
        let nodes = engine.topology.nodes_now().to_vec();
        let scan = Scan::new(&engine.cfg.key_prefix, pattern);
        Locks {
            engine,
            nodes,
            node: 0,
            pattern: pattern.to_vec(),
            scan,
            pending: VecDeque::new(),
            seen: HashSet::new(),
            failures: 0,
        }
    }

    /// Deletes the plain lock `name` only if its fence is still `fence` (the
    /// [`Holder::fence`] that [`inspect`](Self::inspect) showed), so that a lock taken
    /// again since it was inspected is never deleted. In one script: the fence counter is
    /// compared, and the lock key and its lease record deleted, and `r` published on the
    /// lock's channel as a release does, so that its waiters wake at once. The holder
    /// learns it lost the lock at its next renewal, and the next holder that its hold
    /// ended without a release ([`LockGuard::previous_lost`](crate::LockGuard::previous_lost)).
    ///
    /// For operators, about a holder that is stuck (a process paused or hung while its
    /// watchdog still renews): it does not stop that holder, which may still act on what
    /// it protects. The fence counter outlives an acquisition by
    /// [`Builder::fence_ttl`](crate::Builder::fence_ttl) (7 days), renewals or not: a hold
    /// kept longer has no counter ([`Holder::fence`] is `None`), and fence `0` frees it
    /// (only while the name has no counter: any acquisition since writes one, so a lock
    /// taken again is still never deleted). A resource that checks fencing tokens refuses
    /// its writes once a new holder has written.
    ///
    /// # Errors
    ///
    /// [`Error::WrongKind`] when the name is a read-write lock, a semaphore or a key this
    /// library did not write (of another type, or a string with no expiry: every lock this
    /// library takes has a lease). Nothing is deleted (read-write and semaphore holds have
    /// no single fence: each expires with its own lease). On Redlock, only when no node
    /// held the lock or failed to answer: the nodes that did delete it whatever another
    /// holds, and the call says `Released`; a lock held under another fence on some node is
    /// `FenceMismatch`.
    /// [`Error::InvalidName`]; Redis errors. The script is sent once: after a connection
    /// error ([`Error::is_connection`]) whether it ran is unknown, and
    /// [`inspect`](Self::inspect) tells what is there now (sent again, it would find the
    /// lock it had deleted gone and say `NotHeld`).
    ///
    /// # Examples
    ///
    /// ```
    /// # fn main() -> Result<(), redbaton::Error> {
    /// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
    /// use redbaton::ForceRelease;
    /// let guard = client.lock("stuck")?;
    /// let fence = client.inspect("stuck")?.holder.and_then(|h| h.fence).expect("fence");
    /// let refused = client.force_release("stuck", fence - 1)?;
    /// assert_eq!(refused, ForceRelease::FenceMismatch { current: Some(fence) });
    /// assert_eq!(client.force_release("stuck", fence)?, ForceRelease::Released { nodes: 1 });
    /// drop(guard); // its release finds the lock gone
    /// # Ok(()) }
    /// ```
    pub fn force_release(&self, name: impl AsRef<[u8]>, fence: u64) -> Result<ForceRelease> {
        let engine = self.engine();
        let keys = Keys::new(&engine.cfg.key_prefix, name.as_ref())?;
        let route = engine.topology.route(&keys);
        let replies = on_each(engine, route.nodes(), &keys, move |node, keys| {
            inspect_scripts::force_release(node, keys, fence)
        });
        let mut mismatch = None;
        let (mut released, mut foreign) = (0, false);
        let mut error = None;
        for (_, reply) in replies {
            match reply {
                Ok(Forced::Released) => released += 1,
                Ok(Forced::NotALock) => foreign = true,
                Ok(Forced::OtherFence(current)) => {
                    mismatch = Some(ForceRelease::FenceMismatch { current });
                }
                Ok(Forced::NotHeld) => {}
                Err(e) => {
                    error.get_or_insert(e);
                }
            }
        }
        // Redlock: what the other nodes did counts, whatever one node holds: a lock
        // deleted on some is reported deleted. Then a node whose outcome is unknown (it
        // may have deleted the lock), then a lock held under another fence, before another
        // program's key on some node: each of these says more of the lock than the last.
        match (released, error, mismatch) {
            (0, Some(e), _) => Err(e),
            (0, None, Some(mismatch)) => Ok(mismatch),
            (0, None, None) if foreign => Err(Error::WrongKind),
            (0, None, None) => Ok(ForceRelease::NotHeld),
            (nodes, _, _) => Ok(ForceRelease::Released { nodes }),
        }
    }
}

/// `f(node, keys)` on each of `nodes`, in parallel where there are several (Redlock); the
/// replies by node address, in `nodes` order.
fn on_each<T, F>(engine: &Engine, nodes: &[Arc<Node>], keys: &Keys, f: F) -> Vec<(String, T)>
where
    T: Send + 'static,
    F: Fn(&Node, &Keys) -> T + Send + Sync + 'static,
{
    if let [node] = nodes {
        return vec![(node.id.to_string(), f(node, keys))];
    }
    let keys = keys.clone();
    engine
        .topology
        .fan_out(nodes, move |node| (node.id.to_string(), f(node, &keys)))
}

fn inspect_keys(engine: &Engine, keys: &Keys) -> Result<LockInfo> {
    let mine = engine
        .watchdog
        .as_ref()
        .map(|w| w.tokens_of(keys.lock()))
        .unwrap_or_default();
    let route = engine.topology.route(keys);
    let mut replies = on_each(engine, route.nodes(), keys, inspect_scripts::inspect);
    // Redis Cluster: the master asked may have left since the map was read (removed from
    // the cluster, or replaced in a failover); its failure marked the map stale, and this
    // read is asked once more of the slot's owner now, when that is another node.
    if let ([(_, Err(e))], [asked]) = (&replies[..], route.nodes())
        && engine.topology.ride_through(e).is_some()
        && let Some(now) = engine.topology.route(keys).sole().cloned()
        && now.id != asked.id
    {
        replies = on_each(engine, &[now], keys, inspect_scripts::inspect);
    }
    let many = replies.len() > 1;
    let mut views = Vec::with_capacity(replies.len());
    let mut owners = Vec::with_capacity(replies.len());
    let mut unreachable = Vec::new();
    let mut error = None;
    for (node, reply) in replies {
        match reply {
            Ok(snapshot) => {
                views.push(view(keys.name(), node, &snapshot, &mine));
                owners.push(snapshot.value);
            }
            Err(e) => {
                log::debug!("inspect {}: node {node}: {e}", keys.display());
                unreachable.push(node);
                error.get_or_insert(e);
            }
        }
    }
    let Some(first) = views.first() else {
        return Err(error.unwrap_or_else(|| Error::Protocol("no node to inspect".to_owned())));
    };
    if !many {
        let mut info = first.clone();
        // A Redis Cluster master that gave the slot away answers `MOVED`, which the call
        // followed to the slot's owner now, and the route names that owner from then on:
        // the node that answered is that one, not the one first asked.
        if let Some(now) = engine.topology.route(keys).sole() {
            info.node = now.id.to_string();
        }
        return Ok(info);
    }
    let mut info = majority_view(&views, &owners, route.quorum());
    info.nodes = views;
    info.unreachable = unreachable;
    Ok(info)
}

/// Redlock: the view that `quorum` masters share, of the masters' `views` (`owners`: the
/// token each one's lock key holds, if a string). A holder is one token on a majority,
/// as only a majority makes a Redlock hold, and a key of another kind counts alike; the
/// first such master's view is the answer. Without a majority (a round under way, a
/// leftover of one that failed, masters that did not answer) nobody holds the name: the
/// first master's view, free.
fn majority_view(views: &[LockInfo], owners: &[Option<String>], quorum: usize) -> LockInfo {
    let same = |i: usize, j: usize| {
        views[i].kind == views[j].kind
            && (views[i].kind != LockKind::Lock || owners[i] == owners[j])
    };
    let agreed = (0..views.len()).find(|&i| {
        views[i].kind != LockKind::Free
            && (0..views.len()).filter(|&j| same(i, j)).count() >= quorum
    });
    match agreed {
        Some(i) => views[i].clone(),
        None => LockInfo {
            kind: LockKind::Free,
            holder: None,
            holds: Vec::new(),
            ..views[0].clone()
        },
    }
}

/// The public view of what `INSPECT` read on node `node`; `mine`: this client's tokens of
/// the name's holds.
fn view(name: &[u8], node: String, s: &Snapshot, mine: &[String]) -> LockInfo {
    // In floating point: a score is any double a foreign or damaged key may hold (an
    // infinity too), and a cast to an integer saturates where a difference would overflow.
    let left = |expiry_ms: f64| {
        let ms = expiry_ms - s.now_ms as f64;
        (ms > 0.0).then(|| Duration::from_millis(ms as u64))
    };
    let kind = match s.key_type.as_str() {
        "none" => LockKind::Free,
        "string" => LockKind::Lock,
        "zset" => match s.holds.first() {
            Some((m, _)) if m == "#rw" => LockKind::ReadWrite,
            Some((m, score)) if m == "#sem" => LockKind::Semaphore {
                permits: (-score) as u32,
            },
            _ => foreign("zset"),
        },
        other => foreign(other),
    };
    let holder = (kind == LockKind::Lock).then(|| Holder {
        fence: s.fence,
        lease_left: u64::try_from(s.pttl).ok().map(Duration::from_millis),
        mine: s.value.as_ref().is_some_and(|v| mine.contains(v)),
    });
    let shared = matches!(kind, LockKind::ReadWrite | LockKind::Semaphore { .. });
    let holds = s
        .holds
        .iter()
        .filter(|_| shared)
        .filter_map(|(member, expiry)| {
            let kind = match member.as_bytes().first() {
                Some(b'r') => HoldKind::Read,
                Some(b'w') => HoldKind::Write,
                Some(b'p') => HoldKind::Permit,
                Some(b'u') => HoldKind::Upgradable,
                _ => return None,
            };
            Some(Hold {
                kind,
                lease_left: left(*expiry),
                mine: mine.contains(member),
            })
        })
        .collect();
    let queue = s
        .queue
        .iter()
        .map(|(token, arrival_us)| QueueEntry {
            age: Duration::from_micros((s.now_us as f64 - arrival_us).max(0.0) as u64),
            expires_in: s
                .queue_expiry
                .iter()
                .find(|(t, _)| t == token)
                .and_then(|(_, expiry)| left(*expiry)),
        })
        .collect();
    let marks = |set: &[(String, f64)]| set.iter().filter_map(|(_, e)| left(*e)).collect();
    LockInfo {
        name: name.to_vec(),
        node,
        kind,
        fence: s.fence,
        holder,
        holds,
        queue,
        waiting_writers: marks(&s.writers),
        waiting_readers: marks(&s.readers),
        contention: s
            .mark
            .as_ref()
            .and_then(|(_, pttl)| u64::try_from(*pttl).ok())
            .filter(|ms| *ms > 0)
            .map(Duration::from_millis),
        nodes: Vec::new(),
        unreachable: Vec::new(),
    }
}

fn foreign(redis_type: &str) -> LockKind {
    LockKind::Foreign {
        redis_type: redis_type.to_owned(),
    }
}

/// The listing of [`LockClient::locks`], an iterator of [`LockInfo`]: one `SCAN` page at a
/// time, node after node, each name found inspected as it is reached. It borrows neither
/// the client nor the pattern.
///
/// # Examples
///
/// ```
/// # fn main() -> Result<(), redbaton::Error> {
/// # let client = redbaton::LockClient::builder().node(redbaton_testkit::redis_url()).build()?;
/// let _job = client.lock("jobs:7")?;
/// let listing: redbaton::Locks = client.locks(String::from("jobs:*"));
/// for info in listing {
///     let info = info?;
///     println!("{}: held {}", String::from_utf8_lossy(&info.name), info.is_held());
/// }
/// # Ok(()) }
/// ```
pub struct Locks {
    engine: Arc<Engine>,
    nodes: Vec<Arc<Node>>,
    /// The node being scanned (an index into `nodes`).
    node: usize,
    pattern: Vec<u8>,
    scan: Scan,
    /// Names found and not yet inspected.
    pending: VecDeque<Vec<u8>>,
    /// Names already found: `SCAN` may return a key twice, a name has several keys, and a
    /// Redlock name is on several masters.
    seen: HashSet<Vec<u8>>,
    /// The current node's pages that failed in a row (see [`PAGE_FAILURES`]).
    failures: u32,
}

/// How many failures in a row of one node's pages end that node's listing. A failed page
/// keeps its cursor and is asked again at the next step (a dropped connection or a
/// timeout loses none of the node's names), but a node that is down would otherwise
/// yield an error at every step, and the listing would never end.
const PAGE_FAILURES: u32 = 3;

impl std::fmt::Debug for Locks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Locks")
            .field("pattern", &self.pattern.escape_ascii().to_string())
            .field("node", &self.node)
            .field("nodes", &self.nodes.len())
            .field("pending", &self.pending.len())
            .finish_non_exhaustive()
    }
}

impl Locks {
    fn next_node(&mut self) {
        self.node += 1;
        self.failures = 0;
        self.scan = Scan::new(&self.engine.cfg.key_prefix, &self.pattern);
    }
}

impl Iterator for Locks {
    type Item = Result<LockInfo>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            if let Some(name) = self.pending.pop_front() {
                // A key under the prefix whose name no lock may have (too long) is not
                // one of the library's: skipped, as keys of other programs are.
                let Ok(keys) = Keys::new(&self.engine.cfg.key_prefix, &name) else {
                    continue;
                };
                match inspect_keys(&self.engine, &keys) {
                    Ok(info) if !info.is_held() && !info.is_waited_for() => continue,
                    other => return Some(other),
                }
            }
            let node = self.nodes.get(self.node)?.clone();
            if self.scan.done() {
                self.next_node();
                continue;
            }
            match self.scan.page(&node) {
                Ok(names) => {
                    self.failures = 0;
                    for name in names {
                        if self.seen.insert(name.clone()) {
                            self.pending.push_back(name);
                        }
                    }
                }
                // The scan kept its cursor: the next step asks the same page again.
                Err(e) => {
                    self.failures += 1;
                    if self.failures >= PAGE_FAILURES {
                        self.next_node();
                    }
                    return Some(Err(e));
                }
            }
        }
    }
}
