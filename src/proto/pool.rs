//! A bounded pool of command connections to one node.
//!
//! Hand-written rather than r2d2 because the pool must (a) keep the `redis` error of a
//! failed connect as the error's source (r2d2 reduces it to a string), (b) discard every
//! connection whose command failed at the network level, since the reply to it may still
//! be on the wire, and (c) open connections lazily on the caller's thread, with no
//! background threads of its own.

use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

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

struct PoolState {
    /// With the epoch each was opened in: one from before the address changed is closed
    /// rather than lent.
    idle: Vec<(Connection, u64)>,
    /// Connections that exist: idle, lent out, or being opened.
    open: usize,
}

impl PoolState {
    /// The idle connection put back last, if it was opened in `epoch`; those opened to the
    /// address before the last change are closed on the way (no longer open).
    fn pop_current(&mut self, epoch: u64) -> Option<Connection> {
        while let Some((conn, opened_in)) = self.idle.pop() {
            if opened_in == epoch {
                return Some(conn);
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
    pub fn get(&self) -> Result<PooledConn<'_>> {
        let deadline = crate::clock::from_now(self.connect_timeout);
        let mut st = self.state.lock();
        loop {
            let epoch = self.epoch();
            if let Some(conn) = st.pop_current(epoch) {
                return Ok(PooledConn::new(self, conn, epoch));
            }
            if st.open < self.max {
                st.open += 1;
                drop(st);
                return match self.connect("redbaton") {
                    Ok((conn, epoch)) => Ok(PooledConn::new(self, conn, epoch)),
                    Err(e) => {
                        self.forget_one();
                        Err(Error::Redis(e))
                    }
                };
            }
            if self.freed.wait_until(&mut st, deadline).timed_out() {
                return Err(Error::PoolExhausted);
            }
        }
    }

    /// An idle connection, if one is free right now: never opens one, never waits (for the
    /// subscriber thread, which must not block on the pool).
    pub fn try_idle(&self) -> Option<PooledConn<'_>> {
        let epoch = self.epoch();
        let conn = self.state.lock().pop_current(epoch)?;
        Some(PooledConn::new(self, conn, epoch))
    }

    /// A new connection to the node's current address, with the epoch of that address.
    fn connect(&self, name: &str) -> RedisResult<(Connection, u64)> {
        let (client, epoch) = self.target();
        let mut conn = open_connection(
            &client,
            self.connect_timeout,
            self.read_timeout,
            self.write_timeout,
            name,
        )?;
        if self.sharded.wanted() {
            self.sharded.probe(&mut conn)?;
        }
        Ok((conn, epoch))
    }

    fn forget_one(&self) {
        self.state.lock().open -= 1;
        self.freed.notify_one();
    }

    fn put_back(&self, conn: Connection, epoch: u64) {
        self.state.lock().idle.push((conn, epoch));
        self.freed.notify_one();
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

/// Opens a connection with timeouts on every read and write, named so that `CLIENT LIST`
/// tells the pool's connections (`redbaton`) from the subscriber's (`redbaton:sub`).
pub(crate) fn open_connection(
    client: &redis::Client,
    connect_timeout: Duration,
    read_timeout: Duration,
    write_timeout: Duration,
    name: &str,
) -> RedisResult<Connection> {
    let mut conn = client.get_connection_with_timeout(connect_timeout)?;
    conn.set_read_timeout(Some(read_timeout))?;
    conn.set_write_timeout(Some(write_timeout))?;
    // Naming is a courtesy to operators; an ACL may forbid it.
    if let Err(e) = redis::cmd("CLIENT")
        .arg("SETNAME")
        .arg(name)
        .query::<()>(&mut conn)
        && crate::error::is_network_error(&e)
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
}

impl<'a> PooledConn<'a> {
    fn new(pool: &'a Pool, conn: Connection, epoch: u64) -> Self {
        PooledConn {
            pool,
            conn: Some(conn),
            broken: false,
            epoch,
        }
    }

    pub fn discard(&mut self) {
        self.broken = true;
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
            Some(conn) if !self.broken && conn.is_open() && self.epoch == self.pool.epoch() => {
                self.pool.put_back(conn, self.epoch)
            }
            _ => self.pool.forget_one(),
        }
    }
}
