//! A fault-injecting TCP proxy between the code under test and Redis.
//!
//! Killing or pausing Redis only simulates node failures; the network
//! faults a distributed lock must survive (slow links, lost replies,
//! partitions) are injected here instead. Point the client at
//! [`Proxy::url`]; every accepted connection gets its own upstream
//! connection and two pump threads (client→server, server→client). All
//! controls act on live connections immediately.
//!
//! Delays are latency, not throughput limits: each chunk is stamped when
//! read and written once its own deadline passes, so a burst of replies is
//! delayed by `d` each rather than by `d` times its length.

use std::collections::{HashMap, VecDeque};
use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// Accept-loop poll interval: the listener is nonblocking so `Drop` can stop
/// the loop without tricks.
const ACCEPT_POLL: Duration = Duration::from_millis(5);
/// How often a pump re-checks a stalled proxy.
const STALL_POLL: Duration = Duration::from_millis(5);
const UPSTREAM_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// A TCP proxy on 127.0.0.1 forwarding to one target address.
pub struct Proxy {
    shared: Arc<Shared>,
    addr: SocketAddr,
    accept_thread: Option<JoinHandle<()>>,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Dir {
    ClientToServer,
    ServerToClient,
}

/// The "lose the reply" fault.
enum DropArm {
    Off,
    /// The next client→server chunk on any connection.
    Any,
    /// The next client→server chunk containing these bytes.
    Matching(Vec<u8>),
    /// Every client→server chunk containing these bytes, until disarmed.
    EveryMatching(Vec<u8>),
    /// Every client→server chunk containing these bytes never reaches Redis: the
    /// connection is closed instead, until disarmed.
    RefuseMatching(Vec<u8>),
    /// The next client→server chunk containing these bytes never reaches Redis: its
    /// connection is closed instead, once.
    RefuseNextMatching(Vec<u8>),
}

struct Shared {
    target: Mutex<SocketAddr>,
    delay_c2s: Mutex<Duration>,
    delay_s2c: Mutex<Duration>,
    blackhole: AtomicBool,
    stall: AtomicBool,
    drop_arm: Mutex<DropArm>,
    stopping: AtomicBool,
    next_id: AtomicU64,
    conns: Mutex<HashMap<u64, Arc<Conn>>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    accepted: AtomicU64,
    replies_dropped: AtomicU64,
    requests_refused: AtomicU64,
}

struct Conn {
    id: u64,
    client: TcpStream,
    server: TcpStream,
    /// Set by the client→server pump *before* forwarding the armed request,
    /// so the reply can never overtake the flag.
    drop_reply: AtomicBool,
    closed: AtomicBool,
    /// Pumps still running; the last one out unregisters the connection.
    pumps: AtomicUsize,
}

impl Conn {
    /// Closes both sides. `shutdown` also wakes a pump blocked in `read`.
    fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        let _ = self.client.shutdown(Shutdown::Both);
        let _ = self.server.shutdown(Shutdown::Both);
    }
}

impl Proxy {
    /// Starts a proxy on a free 127.0.0.1 port forwarding to `target`.
    pub fn start(target: SocketAddr) -> Proxy {
        Proxy::start_at(0, target)
    }

    /// Starts a proxy on 127.0.0.1:`port` (0: a free one) forwarding to `target`: an
    /// address a client used, back to life after the proxy that had it was dropped (its
    /// port is retried for a few seconds while the kernel lets it go).
    pub fn start_at(port: u16, target: SocketAddr) -> Proxy {
        let mut bound = TcpListener::bind((Ipv4Addr::LOCALHOST, port));
        let tried = std::time::Instant::now();
        while bound.is_err() && port != 0 && tried.elapsed() < Duration::from_secs(5) {
            thread::sleep(Duration::from_millis(10));
            bound = TcpListener::bind((Ipv4Addr::LOCALHOST, port));
        }
        let listener = bound.unwrap_or_else(|e| panic!("proxy: bind 127.0.0.1:{port}: {e}"));
        listener
            .set_nonblocking(true)
            .expect("proxy: nonblocking listener");
        let addr = listener.local_addr().expect("proxy: local_addr");
        let shared = Arc::new(Shared {
            target: Mutex::new(target),
            delay_c2s: Mutex::new(Duration::ZERO),
            delay_s2c: Mutex::new(Duration::ZERO),
            blackhole: AtomicBool::new(false),
            stall: AtomicBool::new(false),
            drop_arm: Mutex::new(DropArm::Off),
            stopping: AtomicBool::new(false),
            next_id: AtomicU64::new(0),
            conns: Mutex::new(HashMap::new()),
            threads: Mutex::new(Vec::new()),
            accepted: AtomicU64::new(0),
            replies_dropped: AtomicU64::new(0),
            requests_refused: AtomicU64::new(0),
        });
        let accept_shared = Arc::clone(&shared);
        let accept_thread = thread::Builder::new()
            .name(format!("proxy-accept-{}", addr.port()))
            .spawn(move || accept_loop(listener, accept_shared))
            .expect("proxy: spawn accept thread");
        Proxy {
            shared,
            addr,
            accept_thread: Some(accept_thread),
        }
    }

    /// `redis://127.0.0.1:PORT/`
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.addr.port())
    }

    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Redirects *new* connections (existing ones keep their upstream).
    pub fn set_target(&self, target: SocketAddr) {
        *self.shared.target.lock() = target;
    }

    /// Delays every server→client chunk (replies, pub/sub messages).
    pub fn set_delay(&self, delay: Duration) {
        *self.shared.delay_s2c.lock() = delay;
    }

    /// Delays both directions.
    pub fn set_delay_both(&self, delay: Duration) {
        *self.shared.delay_c2s.lock() = delay;
        *self.shared.delay_s2c.lock() = delay;
    }

    /// Arms a one-shot fault: the next client→server chunk (on any
    /// connection) is forwarded and executed by Redis, but its reply is
    /// swallowed and that connection is closed on both sides. Models "the
    /// command ran, the answer was lost" for idempotent-retry tests.
    pub fn drop_next_reply(&self) {
        *self.shared.drop_arm.lock() = DropArm::Any;
    }

    /// Like `drop_next_reply`, but only triggers on a client→server chunk
    /// containing `needle` (e.g. `b"EVALSHA"`, a key name), so unrelated
    /// traffic such as a pub/sub connection cannot consume the fault.
    pub fn drop_next_reply_matching(&self, needle: &[u8]) {
        assert!(!needle.is_empty(), "empty needle: use drop_next_reply()");
        *self.shared.drop_arm.lock() = DropArm::Matching(needle.to_vec());
    }

    /// Runs `f` while the reply of every request containing `needle` is lost (the request
    /// runs in Redis; the connection is closed instead of answering, as
    /// [`drop_next_reply_matching`](Self::drop_next_reply_matching) does once), then heals
    /// the proxy.
    pub fn losing_replies_matching<T>(&self, needle: &[u8], f: impl FnOnce() -> T) -> T {
        assert!(!needle.is_empty(), "empty needle");
        *self.shared.drop_arm.lock() = DropArm::EveryMatching(needle.to_vec());
        let _heal = Heal(self);
        f()
    }

    /// Runs `f` while every request containing `needle` is lost on its way (it never runs
    /// in Redis; its connection is closed instead), then heals the proxy.
    pub fn refusing_requests_matching<T>(&self, needle: &[u8], f: impl FnOnce() -> T) -> T {
        assert!(!needle.is_empty(), "empty needle");
        *self.shared.drop_arm.lock() = DropArm::RefuseMatching(needle.to_vec());
        let _heal = Heal(self);
        f()
    }

    /// Arms a one-shot fault: the next request containing `needle` is lost on its way (it
    /// never runs in Redis; its connection is closed instead); the ones after it pass.
    pub fn refuse_next_request_matching(&self, needle: &[u8]) {
        assert!(!needle.is_empty(), "empty needle");
        *self.shared.drop_arm.lock() = DropArm::RefuseNextMatching(needle.to_vec());
    }

    /// How many requests `refusing_requests_matching` has kept from Redis so far.
    pub fn requests_refused(&self) -> u64 {
        self.shared.requests_refused.load(Ordering::SeqCst)
    }

    /// Whether a `drop_next_reply*` fault is still waiting for its request.
    pub fn drop_armed(&self) -> bool {
        !matches!(*self.shared.drop_arm.lock(), DropArm::Off)
    }

    /// Disarms a pending `drop_next_reply*` fault.
    pub fn disarm_drop(&self) {
        *self.shared.drop_arm.lock() = DropArm::Off;
    }

    /// How many replies `drop_next_reply*` has swallowed so far.
    pub fn replies_dropped(&self) -> u64 {
        self.shared.replies_dropped.load(Ordering::SeqCst)
    }

    /// While on, connections are accepted and bytes read in both directions
    /// but discarded (a lossy partition). Streams that lost bytes are out
    /// of sync afterwards; clients are expected to time out and reconnect.
    pub fn blackhole(&self, on: bool) {
        self.shared.blackhole.store(on, Ordering::SeqCst);
    }

    /// While on, bytes are read and held (in order), then delivered when
    /// turned off: a partition that heals, where late requests still reach
    /// Redis — e.g. an acquire that executes after its client gave up.
    pub fn stall(&self, on: bool) {
        self.shared.stall.store(on, Ordering::SeqCst);
    }

    /// Clears delays, blackhole, stall and any armed drop.
    pub fn heal(&self) {
        self.set_delay_both(Duration::ZERO);
        self.blackhole(false);
        self.stall(false);
        self.disarm_drop();
    }

    /// Closes every current connection (both sides). New connections are
    /// still accepted.
    pub fn kill_all(&self) {
        self.shared.close_all();
    }

    /// Connections accepted since start.
    pub fn connections_accepted(&self) -> u64 {
        self.shared.accepted.load(Ordering::SeqCst)
    }

    /// Connections currently proxied.
    pub fn active_connections(&self) -> usize {
        self.shared.conns.lock().len()
    }
}

/// Heals the proxy however a fault's closure ends (a failed assertion too).
struct Heal<'a>(&'a Proxy);

impl Drop for Heal<'_> {
    fn drop(&mut self) {
        self.0.heal();
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.shared.stopping.store(true, Ordering::SeqCst);
        if let Some(t) = self.accept_thread.take() {
            let _ = t.join();
        }
        // The accept loop is gone, so no new connection can register.
        self.shared.close_all();
        let threads = std::mem::take(&mut *self.shared.threads.lock());
        for t in threads {
            let _ = t.join();
        }
    }
}

impl Shared {
    fn close_all(&self) {
        let conns: Vec<Arc<Conn>> = self.conns.lock().values().cloned().collect();
        for c in conns {
            c.close();
        }
    }

    fn delay(&self, dir: Dir) -> Duration {
        match dir {
            Dir::ClientToServer => *self.delay_c2s.lock(),
            Dir::ServerToClient => *self.delay_s2c.lock(),
        }
    }

    /// Whether this client→server chunk is to be kept from Redis.
    fn refuses(&self, chunk: &[u8]) -> bool {
        let mut arm = self.drop_arm.lock();
        let refused = match &*arm {
            DropArm::RefuseMatching(needle) => contains(chunk, needle),
            DropArm::RefuseNextMatching(needle) if contains(chunk, needle) => {
                *arm = DropArm::Off;
                true
            }
            _ => false,
        };
        drop(arm);
        if refused {
            self.requests_refused.fetch_add(1, Ordering::SeqCst);
        }
        refused
    }

    /// Consumes the armed fault if this client→server chunk triggers it.
    fn take_drop_arm(&self, chunk: &[u8]) -> bool {
        let mut arm = self.drop_arm.lock();
        let (hit, once) = match &*arm {
            DropArm::Off | DropArm::RefuseMatching(_) | DropArm::RefuseNextMatching(_) => {
                (false, false)
            }
            DropArm::Any => (true, true),
            DropArm::Matching(needle) => (contains(chunk, needle), true),
            DropArm::EveryMatching(needle) => (contains(chunk, needle), false),
        };
        if hit && once {
            *arm = DropArm::Off;
        }
        hit
    }
}

fn contains(chunk: &[u8], needle: &[u8]) -> bool {
    chunk.windows(needle.len()).any(|w| w == needle)
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    while !shared.stopping.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((client, _)) => {
                shared.accepted.fetch_add(1, Ordering::SeqCst);
                if let Err(e) = start_conn(&shared, client) {
                    // Upstream unreachable: the client sees the connection
                    // close, as it would if Redis were down.
                    eprintln!("proxy: upstream connect failed: {e}");
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => thread::sleep(ACCEPT_POLL),
            Err(_) => thread::sleep(ACCEPT_POLL),
        }
    }
}

fn start_conn(shared: &Arc<Shared>, client: TcpStream) -> io::Result<()> {
    // Accepted sockets must block: pumps rely on blocking reads with
    // per-read timeouts.
    client.set_nonblocking(false)?;
    let target = *shared.target.lock();
    let server = TcpStream::connect_timeout(&target, UPSTREAM_CONNECT_TIMEOUT)?;
    // Without NODELAY, Nagle + delayed ACK add ~40 ms to small writes and
    // would swamp the delays tests ask for.
    client.set_nodelay(true)?;
    server.set_nodelay(true)?;
    let conn = Arc::new(Conn {
        id: shared.next_id.fetch_add(1, Ordering::SeqCst),
        client,
        server,
        drop_reply: AtomicBool::new(false),
        closed: AtomicBool::new(false),
        pumps: AtomicUsize::new(2),
    });
    shared.conns.lock().insert(conn.id, Arc::clone(&conn));
    let mut threads = shared.threads.lock();
    // Forget threads that already finished so the list stays short.
    threads.retain(|t| !t.is_finished());
    for dir in [Dir::ClientToServer, Dir::ServerToClient] {
        let (s, c) = (Arc::clone(shared), Arc::clone(&conn));
        let spawned = thread::Builder::new()
            .name(format!("proxy-{}-{dir:?}", conn.id))
            .spawn(move || pump(&s, &c, dir));
        match spawned {
            Ok(t) => threads.push(t),
            Err(e) => {
                conn.close();
                shared.conns.lock().remove(&conn.id);
                return Err(e);
            }
        }
    }
    Ok(())
}

fn pump(shared: &Shared, conn: &Conn, dir: Dir) {
    let (from, to) = match dir {
        Dir::ClientToServer => (&conn.client, &conn.server),
        Dir::ServerToClient => (&conn.server, &conn.client),
    };
    pump_loop(shared, conn, dir, from, to);
    if conn.pumps.fetch_sub(1, Ordering::SeqCst) == 1 {
        conn.close();
        shared.conns.lock().remove(&conn.id);
    }
}

/// Reads chunks from `from`, stamps each with its due time and writes it to
/// `to` when due. Reads use a timeout equal to the time until the next due
/// chunk, so one thread does both without busy-waiting.
fn pump_loop(shared: &Shared, conn: &Conn, dir: Dir, mut from: &TcpStream, mut to: &TcpStream) {
    let mut queue: VecDeque<(Instant, Vec<u8>)> = VecDeque::new();
    let mut buf = vec![0u8; 64 * 1024];
    let mut eof = false;
    loop {
        if conn.closed.load(Ordering::SeqCst) {
            return;
        }
        let stalled = shared.stall.load(Ordering::SeqCst);
        if !stalled {
            let now = Instant::now();
            while queue.front().is_some_and(|(due, _)| *due <= now) {
                let (_, chunk) = queue.pop_front().expect("front checked");
                if to.write_all(&chunk).is_err() {
                    conn.close();
                    return;
                }
            }
        }
        if eof && queue.is_empty() {
            // Propagate the half-close; the peer decides when to close.
            let _ = to.shutdown(Shutdown::Write);
            return;
        }
        let wait = if stalled && !queue.is_empty() {
            Some(STALL_POLL)
        } else {
            queue.front().map(|(due, _)| {
                due.saturating_duration_since(Instant::now())
                    .max(Duration::from_millis(1))
            })
        };
        if eof {
            thread::sleep(wait.unwrap_or(STALL_POLL));
            continue;
        }
        if from.set_read_timeout(wait).is_err() {
            conn.close();
            return;
        }
        let n = match from.read(&mut buf) {
            Ok(0) => {
                eof = true;
                continue;
            }
            Ok(n) => n,
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock
                        | io::ErrorKind::TimedOut
                        | io::ErrorKind::Interrupted
                ) =>
            {
                continue;
            }
            Err(_) => {
                conn.close();
                return;
            }
        };
        let chunk = &buf[..n];
        if shared.blackhole.load(Ordering::SeqCst) {
            continue;
        }
        match dir {
            Dir::ClientToServer => {
                if shared.refuses(chunk) {
                    conn.close();
                    return;
                }
                if shared.take_drop_arm(chunk) {
                    conn.drop_reply.store(true, Ordering::SeqCst);
                }
            }
            Dir::ServerToClient => {
                if conn.drop_reply.load(Ordering::SeqCst) {
                    // The request executed; its reply vanishes with the link.
                    shared.replies_dropped.fetch_add(1, Ordering::SeqCst);
                    conn.close();
                    return;
                }
            }
        }
        queue.push_back((Instant::now() + shared.delay(dir), chunk.to_vec()));
    }
}
