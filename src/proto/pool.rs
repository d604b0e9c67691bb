//! A bounded pool of command connections to one node.
//!
//! Hand-written rather than r2d2 because the pool must (a) keep the `redis` error of a
//! failed connect as the error's source (r2d2 reduces it to a string), (b) discard every
//! connection whose command failed at the network level, since the reply to it may still
//! be on the wire, and (c) open connections lazily on the caller's thread, with no
//! background threads of its own.

use std::cell::Cell;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use redis::{Connection, ConnectionLike, RedisResult};

use crate::error::{Error, Result};
use crate::proto::sharded::Sharded;

pub(crate) struct Pool {
    /// Where connections go; replaced when the node's address changes (a Sentinel
    /// failover), with [`epoch`](Pool::epoch) counting the changes. Both change together,
    /// under this lock: a connection is stamped with the epoch of the address it was
    /// opened to, never a later one.
    client: Mutex<redis::Client>,
    epoch: AtomicU64,
    /// A command failed in a way that may mean the node moved (a network error, a
    /// `READONLY` reply); whoever follows the node's address takes it and looks again.
    fault: AtomicBool,
    /// The node serves nothing now (a Redis Cluster master demoted by a failover, or
    /// removed): nothing should keep a connection open to it while nothing needs one.
    retired: AtomicBool,
    /// Whether the node's library channels are sharded (`SPUBLISH`): asked by the first
    /// connection, and by the next one after the connections were dropped (the server
    /// behind the address may have changed).
    pub sharded: Sharded,
    connect_timeout: Duration,
    read_timeout: Duration,
    write_timeout: Duration,
    max: usize,
    state: Mutex<PoolState>,
    freed: Condvar,
}

/// An idle connection: the epoch it was opened in, and since when it is idle.
struct Idle {
    conn: Connection,
    epoch: u64,
    since: Instant,
}

struct PoolState {
    /// With the epoch each was opened in (one from before the address changed is closed
    /// rather than lent) and when it was put back.
    idle: Vec<Idle>,
    /// Connections that exist: idle, lent out, or being opened.
    open: usize,
}

impl PoolState {
    /// The idle connection put back last, if it was opened in `epoch`; those opened to the
    /// address before the last change are closed on the way (no longer open).
    fn pop_current(&mut self, epoch: u64) -> Option<(Connection, Instant)> {
        while let Some(idle) = self.idle.pop() {
            if idle.epoch == epoch {
                return Some((idle.conn, idle.since));
            }
            self.open -= 1;
        }
        None
    }
}

impl Pool {
    pub fn new(client: redis::Client, cfg: &crate::config::Config) -> Self {
        Pool {
            client: Mutex::new(client),
            epoch: AtomicU64::new(0),
            fault: AtomicBool::new(false),
            retired: AtomicBool::new(false),
            sharded: Sharded::new(&cfg.key_prefix),
            connect_timeout: cfg.connect_timeout,
            read_timeout: cfg.read_timeout,
            write_timeout: cfg.write_timeout,
            max: cfg.pool_size,
            state: Mutex::new(PoolState {
                idle: Vec::new(),
                open: 0,
            }),
            freed: Condvar::new(),
        }
    }

    /// The client for the node's current address.
    pub fn client(&self) -> redis::Client {
        self.client.lock().clone()
    }

    /// The client for the node's current address, with its epoch.
    fn target(&self) -> (redis::Client, u64) {
        let client = self.client.lock();
        (client.clone(), self.epoch())
    }

    /// How many times the node's address has changed: a connection opened under an older
    /// epoch talks to a server that no longer serves the node.
    pub fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Acquire)
    }

    /// Records a failure that may mean the node moved.
    pub fn note_fault(&self) {
        self.fault.store(true, Ordering::Release);
    }

    /// Takes the fault recorded since the last call.
    pub fn take_fault(&self) -> bool {
        self.fault.swap(false, Ordering::AcqRel)
    }

    /// Points the pool at a new address: idle connections are closed, lent ones are
    /// closed when they come back, new ones go to `client`.
    pub fn repoint(&self, client: redis::Client) {
        {
            let mut current = self.client.lock();
            *current = client;
            self.epoch.fetch_add(1, Ordering::AcqRel);
        }
        self.clear_idle();
    }

    pub fn timeouts(&self) -> (Duration, Duration, Duration) {
        (self.connect_timeout, self.read_timeout, self.write_timeout)
    }

    /// A connection, reused or new; waits up to the connect timeout for one to be free.
    /// For a call that must be over by `deadline` (the call's own, [`MIN_ATTEMPT`] after
    /// its start at the earliest: see [`call_deadline`]): waiting for a free connection,
    /// and opening one (the connect, then the replies to the commands that set it up),
    /// each take no longer than what remains of it, as the call's own reads do. Against a
    /// server that accepts connections but does not answer, a fresh connection's set-up
    /// would otherwise wait a whole read timeout past the deadline.
    pub fn get_until(&self, deadline: Option<Instant>) -> Result<PooledConn<'_>> {
        let waited_until = crate::clock::from_now(bounded(self.connect_timeout, deadline));
        let mut st = self.state.lock();
        loop {
            let epoch = self.epoch();
            if let Some((conn, since)) = st.pop_current(epoch) {
                return Ok(PooledConn::new(self, conn, epoch, Some(since)));
            }
            if st.open < self.max {
                st.open += 1;
                drop(st);
                return match self.connect("redbaton", deadline) {
                    Ok((conn, epoch)) => Ok(PooledConn::new(self, conn, epoch, None)),
                    Err(e) => {
                        self.forget_one();
                        Err(Error::Redis(e))
                    }
                };
            }
            if self.freed.wait_until(&mut st, waited_until).timed_out() {
                return Err(Error::PoolExhausted);
            }
        }
    }

    /// An idle connection, if one is free right now: never opens one, never waits (for the
    /// subscriber thread, which must not block on the pool).
    pub fn try_idle(&self) -> Option<PooledConn<'_>> {
        let epoch = self.epoch();
        let (conn, since) = self.state.lock().pop_current(epoch)?;
        Some(PooledConn::new(self, conn, epoch, Some(since)))
    }

    /// A new connection to the node's current address, with the epoch of that address;
    /// opened, named and probed within `deadline` (see [`get_until`](Self::get_until)),
    /// then given the pool's read and write timeouts. Each step is bounded by what remains
    /// of the deadline when it starts: bounds reckoned once, before the connect, would let
    /// each of three slow replies take nearly the whole deadline.
    fn connect(&self, name: &str, deadline: Option<Instant>) -> RedisResult<(Connection, u64)> {
        let (client, epoch) = self.target();
        let timeouts = (self.connect_timeout, self.read_timeout, self.write_timeout);
        let mut conn = open_connection_until(&client, timeouts, name, deadline)?;
        if self.sharded.wanted() {
            conn.set_read_timeout(Some(bounded(self.read_timeout, deadline)))?;
            conn.set_write_timeout(Some(bounded(self.write_timeout, deadline)))?;
            self.sharded.probe(&mut conn)?;
        }
        if deadline.is_some() {
            conn.set_read_timeout(Some(self.read_timeout))?;
            conn.set_write_timeout(Some(self.write_timeout))?;
        }
        Ok((conn, epoch))
    }

    fn forget_one(&self) {
        self.state.lock().open -= 1;
        self.freed.notify_one();
    }

    /// Makes a lent connection idle, or closes it when it talks to an address the node no
    /// longer has, or belongs to a node that serves nothing now: lent when the node moved
    /// or stopped serving, it missed the closing of the idle ones, and would otherwise
    /// stay open for as long as the client lives. Checked under the state lock, which
    /// [`repoint`](Self::repoint) and [`set_serving`](Self::set_serving) take to close the
    /// idle connections after the change: a connection put back meanwhile is closed by one
    /// or the other.
    fn put_back(&self, conn: Connection, epoch: u64) {
        let mut st = self.state.lock();
        if epoch == self.epoch() && !self.is_retired() {
            st.idle.push(Idle {
                conn,
                epoch,
                since: Instant::now(),
            });
        } else {
            st.open -= 1;
        }
        drop(st);
        self.freed.notify_one();
    }

    /// Says whether the node serves anything now. A node that stops serving drops its
    /// idle connections (a server closes no idle connection by default, `timeout 0`), and
    /// its subscriber closes its connection once nothing waits there.
    pub fn set_serving(&self, serving: bool) {
        let was_retired = self.retired.swap(!serving, Ordering::AcqRel);
        if !serving && !was_retired {
            self.clear_idle();
        }
    }

    /// Whether the node serves nothing now (see [`set_serving`](Self::set_serving)).
    pub fn is_retired(&self) -> bool {
        self.retired.load(Ordering::Acquire)
    }

    /// Drops every idle connection (after the server restarted, say).
    pub fn clear_idle(&self) {
        self.sharded.forget();
        let mut st = self.state.lock();
        let n = st.idle.len();
        st.idle.clear();
        st.open -= n;
        drop(st);
        self.freed.notify_all();
    }
}

/// The shortest time a call with a deadline is given, however close its deadline: an
/// attempt needs a chance to succeed. Given once, from the call's start (see
/// [`call_deadline`]), and shared by its steps (waiting for a connection, opening one,
/// each read): given to each step, a call of many steps against a server that answers
/// each of them just in time would overrun its deadline by as many of it.
pub(crate) const MIN_ATTEMPT: Duration = Duration::from_millis(50);

/// What a step is given when nothing remains of its call's deadline: it fails at once,
/// as a timeout. Not zero: a zero read or write timeout is refused (by `std`'s
/// `set_read_timeout`), not taken as "no time".
const NO_TIME_LEFT: Duration = Duration::from_millis(1);

/// The deadline a call that starts now is over by, when the caller gives it `deadline`:
/// that one, but [`MIN_ATTEMPT`] from now at the earliest. Reckoned once, where the call
/// begins; its steps are bounded by what remains of it ([`bounded`]).
pub(crate) fn call_deadline(deadline: Option<Instant>) -> Option<Instant> {
    deadline.map(|d| d.max(Instant::now() + MIN_ATTEMPT))
}

/// The call whose commands this thread is sending on a connection (see [`within_deadline`]),
/// when it has a deadline. A call may wait for several replies in turn (a script answered
/// `NOSCRIPT`, loaded, then sent again), sent by code that knows nothing of the call's
/// deadline: [`next_read`] bounds each of them by what remains of it then.
#[derive(Clone, Copy)]
struct Reading {
    deadline: Instant,
    /// The connection's usual read timeout, put back after the call.
    read_timeout: Duration,
    /// The connection's read timeout is shorter than the usual one now.
    shortened: bool,
}

thread_local! {
    static READING: Cell<Option<Reading>> = const { Cell::new(None) };
}

/// Puts back the call under way before [`within_deadline`] began its own, however `f` ends
/// (a panic too: a later call without a deadline must not inherit this one's).
struct Restore(Option<Reading>);

impl Drop for Restore {
    fn drop(&mut self) {
        READING.set(self.0);
    }
}

/// Runs `f` on `conn` with each of its reads bounded by `deadline` (the call's, from
/// [`call_deadline`]): what remains of it when the read is sent (see [`next_read`]), when
/// that is shorter than `read_timeout`, the connection's usual timeout, which is then put
/// back (after a reply, error replies included). A read sent once nothing remains fails
/// at once. A connection whose timeout cannot be put back fails the call (a network
/// error: the caller drops it).
pub(crate) fn within_deadline<T>(
    conn: &mut Connection,
    deadline: Option<Instant>,
    read_timeout: Duration,
    f: impl FnOnce(&mut Connection) -> RedisResult<T>,
) -> RedisResult<T> {
    let reading = deadline.map(|deadline| Reading {
        deadline,
        read_timeout,
        shortened: false,
    });
    let _restore = Restore(READING.replace(reading));
    if reading.is_none() {
        return f(conn);
    }
    next_read(conn)?;
    let result = f(conn);
    let shortened = READING.get().is_some_and(|r| r.shortened);
    if !shortened || result.as_ref().is_err_and(crate::error::is_network_error) {
        return result; // nothing to put back, or the connection is dropped anyway
    }
    // Also after an error reply: the connection goes back to the pool.
    conn.set_read_timeout(Some(read_timeout))?;
    result
}

/// Bounds the next read on `conn` by what remains of the deadline of the call under way
/// on this thread, if it has one (see [`within_deadline`]): for a command sent after
/// another within one call, whose reply would otherwise be given as long as the first
/// one's.
pub(crate) fn next_read(conn: &mut Connection) -> RedisResult<()> {
    let Some(mut reading) = READING.get() else {
        return Ok(());
    };
    let t = bounded(reading.read_timeout, Some(reading.deadline));
    if t < reading.read_timeout {
        conn.set_read_timeout(Some(t))?;
        reading.shortened = true;
        READING.set(Some(reading));
    }
    Ok(())
}

/// `timeout`, or less when what remains of `deadline` (a call's, from [`call_deadline`],
/// which gave the call its [`MIN_ATTEMPT`]) is shorter: [`NO_TIME_LEFT`] when nothing
/// remains.
pub(crate) fn bounded(timeout: Duration, deadline: Option<Instant>) -> Duration {
    match deadline {
        Some(d) => timeout.min(
            d.saturating_duration_since(Instant::now())
                .max(NO_TIME_LEFT),
        ),
        None => timeout,
    }
}

/// Opens a connection with timeouts on every read and write, named so that `CLIENT LIST`
/// tells the pool's connections (`redbaton`) from the subscriber's (`redbaton:sub`).
pub(crate) fn open_connection(
    client: &redis::Client,
    connect_timeout: Duration,
    read_timeout: Duration,
    write_timeout: Duration,
    name: &str,
) -> RedisResult<Connection> {
    let timeouts = (connect_timeout, read_timeout, write_timeout);
    open_connection_until(client, timeouts, name, None)
}

/// [`open_connection`] within `deadline` (a call's, from [`call_deadline`]): the connect
/// (with the handshake the URL asks for), then the naming, each bounded by what remains
/// of it when that step starts.
pub(crate) fn open_connection_until(
    client: &redis::Client,
    (connect_timeout, read_timeout, write_timeout): (Duration, Duration, Duration),
    name: &str,
    deadline: Option<Instant>,
) -> RedisResult<Connection> {
    let mut conn = client.get_connection_with_timeout(bounded(connect_timeout, deadline))?;
    conn.set_read_timeout(Some(bounded(read_timeout, deadline)))?;
    conn.set_write_timeout(Some(bounded(write_timeout, deadline)))?;
    // Naming is a courtesy to operators; an ACL may forbid it. But a server that wants a
    // password the URL does not give refuses every command on the connection (`NOAUTH`)
    // and closes it at the first long one (a protocol error, `unauthenticated multibulk
    // length`): lent out, it would fail the call with an error that does not say why,
    // then go back to the pool already closed.
    if let Err(e) = redis::cmd("CLIENT")
        .arg("SETNAME")
        .arg(name)
        .query::<()>(&mut conn)
        && (crate::error::is_network_error(&e) || crate::error::is_auth_error(&e))
    {
        return Err(e);
    }
    Ok(conn)
}

/// A lent connection. Mark it [`broken`](PooledConn::discard) after a network error: it is
/// then closed instead of returned.
pub(crate) struct PooledConn<'a> {
    pool: &'a Pool,
    conn: Option<Connection>,
    broken: bool,
    epoch: u64,
    /// Since when it was idle in the pool; `None`: opened for this loan.
    idle_since: Option<Instant>,
}

impl<'a> PooledConn<'a> {
    fn new(pool: &'a Pool, conn: Connection, epoch: u64, idle_since: Option<Instant>) -> Self {
        PooledConn {
            pool,
            conn: Some(conn),
            broken: false,
            epoch,
            idle_since,
        }
    }

    pub fn discard(&mut self) {
        self.broken = true;
    }

    /// How long it lay idle in the pool before this loan (zero when opened for it): the
    /// server, or a middlebox, may have closed it meanwhile (Redis's `timeout` closes
    /// connections idle for that many seconds), which only the next command finds out.
    pub fn idle_for(&self) -> Duration {
        self.idle_since.map_or(Duration::ZERO, |t| t.elapsed())
    }
}

impl Deref for PooledConn<'_> {
    type Target = Connection;
    fn deref(&self) -> &Connection {
        self.conn.as_ref().expect("connection present until drop")
    }
}

impl DerefMut for PooledConn<'_> {
    fn deref_mut(&mut self) -> &mut Connection {
        self.conn.as_mut().expect("connection present until drop")
    }
}

impl Drop for PooledConn<'_> {
    fn drop(&mut self) {
        match self.conn.take() {
            Some(conn) if !self.broken && conn.is_open() => self.pool.put_back(conn, self.epoch),
            _ => self.pool.forget_one(),
        }
    }
}
