//! Test support for redbaton: its integration tests, benches, examples, documentation
//! examples and the `redbaton-contend` tool all run against real `redis-server` processes
//! started from here.
//!
//! * [`server`]: a throwaway `redis-server` per test ([`server::RedisServer`]);
//!   [`test_server`] is how a test starts with one ([`test_server_and`]: with a client).
//! * [`client`]: [`lock_client!`] and [`lock_builder!`], the one way to make a client.
//! * [`proxy`]: a fault-injecting TCP proxy (delays, lost replies, partitions).
//! * [`child`]: real child processes contending for locks.
//! * [`cluster`]: a Redis Cluster of three masters and three replicas.
//! * [`clock`]: clocks whose readings can be compared between processes.
//! * [`grants`]: the grant tests of the fair lock and of the read-write lock's write
//!   hold, written once for both.
//! * [`keys`]: the Redis keys and fencing-token layout of the lock protocol, as the
//!   tests observe them from outside.
//! * [`logs`]: the `log` records of the test process, to check what a client warned of.
//! * [`monitor`]: `MONITOR`, every command a server runs, scripts' calls included.
//! * [`leftover`]: every kind of key the library writes and how long each may stay.
//! * [`history`]: seeds, histories and violations of replayable randomized tests.
//! * [`stalls`]: when the test process itself did not run (a loaded machine), so that
//!   liveness checks do not blame the library for it.
//! * [`sections`]: critical sections as contenders report them, and checking them for
//!   overlaps nobody was told of.
//! * [`intervals`]: recording when things happened in a process (sections, permits) and
//!   counting how many were under way at once.
//! * [`wait`]: polling and joining with a deadline, so a broken test fails instead of
//!   hanging.
//!
//! [`redis_url`] starts a throwaway server (loopback, free port, temp dir, persistence
//! off) for one documentation example and returns its URL. Examples do not share servers,
//! so two of them locking the same name at once cannot disturb each other.
//!
//! A doctest's process exits without dropping statics, so those servers are never stopped
//! from here: the harness gives each one a reaper that kills it by PID, and removes its
//! temp dir, once this process is gone (see [`server`]).
//!
//! This crate does not depend on `redbaton`: what it knows of the lock's protocol is
//! written down in [`keys`] and checked by the integration tests.

use std::time::Duration;

use parking_lot::Mutex;

pub mod binaries;
pub mod child;
pub mod client;
pub mod clock;
pub mod cluster;
pub mod grants;
pub mod history;
pub mod intervals;
pub mod keys;
pub mod leftover;
pub mod logs;
pub mod monitor;
pub mod proxy;
pub mod sections;
pub mod sentinel;
pub mod server;
pub mod stalls;
pub mod tls;
pub mod wait;

use server::RedisServer;

/// Servers handed out by [`redis_url`], kept running until this process ends.
static KEPT: Mutex<Vec<RedisServer>> = Mutex::new(Vec::new());

/// Starts a throwaway `redis-server` for one example and returns its URL
/// (`redis://127.0.0.1:PORT/`).
///
/// Panics with an install hint when `redis-server` is not on `PATH`: examples never skip.
pub fn redis_url() -> String {
    let server = RedisServer::start();
    let url = server.url();
    KEPT.lock().push(server);
    url
}

/// For programs (examples, the contention tool): a throwaway `redis-server`, or, when none
/// can be found or started, a message saying what is missing and how to install it on
/// standard error, and exit status 1. A first run without Redis gets a message, not a
/// panic and a backtrace.
pub fn start_or_exit() -> RedisServer {
    RedisServer::try_start().unwrap_or_else(|e| {
        eprintln!("error: cannot start a throwaway Redis: {e}");
        std::process::exit(1)
    })
}

/// For examples: `$REDIS_URL` when set; else, with `probe_default`, Redis on
/// `127.0.0.1:6379` if one answers; else a throwaway server ([`start_or_exit`]), returned
/// so that the caller keeps it running until the end.
pub fn example_redis(probe_default: bool) -> (String, Option<RedisServer>) {
    const DEFAULT: &str = "redis://127.0.0.1:6379/";
    if let Ok(url) = std::env::var("REDIS_URL") {
        return (url, None);
    }
    if probe_default && answers(DEFAULT) {
        return (DEFAULT.to_owned(), None);
    }
    let server = start_or_exit();
    (server.url(), Some(server))
}

/// Whether a Redis at `url` answers PING within a fraction of a second.
fn answers(url: &str) -> bool {
    redis::Client::open(url)
        .and_then(|c| c.get_connection_with_timeout(Duration::from_millis(300)))
        .and_then(|mut c| redis::cmd("PING").query::<String>(&mut c))
        .is_ok()
}

/// Busy-waits for `d`: a critical section that keeps its core, unlike a sleep.
pub fn spin(d: Duration) {
    let t = std::time::Instant::now();
    while t.elapsed() < d {
        std::hint::spin_loop();
    }
}

/// Shorthand for `Duration::from_millis`, to keep timing-heavy tests legible.
pub fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// Shorthand for `Duration::from_secs`.
pub fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

/// Runs `f`, returning what it returned and how long it took.
pub fn timed<T>(f: impl FnOnce() -> T) -> (T, Duration) {
    let started = std::time::Instant::now();
    let got = f();
    (got, started.elapsed())
}

/// The library's `log` output in tests, as `RUST_LOG` says (see [`logs`]): shown with a
/// failing test's output. Every test may call it: the first call in a process installs
/// the logger.
///
/// ```text
/// RUST_LOG=redbaton=debug cargo test --test core -- --nocapture smoke
/// ```
pub fn init_log() {
    logs::echo();
}

/// What most tests start with: logging set up ([`init_log`]) and a throwaway
/// `redis-server` of their own ([`RedisServer::start`]).
pub fn test_server() -> RedisServer {
    init_log();
    RedisServer::start()
}

/// [`test_server`], and what `make` makes of its URL (a client): the two lines most tests
/// start with, as one.
pub fn test_server_and<C>(make: impl FnOnce(&str) -> C) -> (RedisServer, C) {
    let srv = test_server();
    let made = make(&srv.url());
    (srv, made)
}

/// The sockets that keep the ports of [`dead_url`] bound, and not listening, until the
/// test process ends.
static DEAD_PORTS: parking_lot::Mutex<Vec<socket2::Socket>> = parking_lot::Mutex::new(Vec::new());

/// A Redis URL on a loopback port that nothing listens on: for tests of a server that is
/// not there, whose connections are refused at once. The port stays bound (by a socket
/// that never listens) for the rest of the test process, so that no server another test
/// starts meanwhile can take it and answer in the dead server's place.
pub fn dead_url() -> String {
    use socket2::{Domain, Socket, Type};
    let socket = Socket::new(Domain::IPV4, Type::STREAM, None).expect("socket");
    socket
        .bind(&std::net::SocketAddr::from((std::net::Ipv4Addr::LOCALHOST, 0)).into())
        .expect("bind 127.0.0.1:0");
    let port = socket
        .local_addr()
        .ok()
        .and_then(|a| a.as_socket())
        .expect("local_addr")
        .port();
    DEAD_PORTS.lock().push(socket);
    format!("redis://127.0.0.1:{port}/")
}

/// A raw connection to `url` (5 s to connect, 10 s per read or write), so that a broken
/// test fails instead of hanging. Panics when it cannot connect.
pub fn raw_conn(url: &str) -> redis::Connection {
    let conn = redis::Client::open(url)
        .unwrap_or_else(|e| panic!("redis url {url}: {e}"))
        .get_connection_with_timeout(secs(5))
        .unwrap_or_else(|e| panic!("connect to {url}: {e}"));
    conn.set_read_timeout(Some(secs(10))).expect("read timeout");
    conn.set_write_timeout(Some(secs(10)))
        .expect("write timeout");
    conn
}

/// Whether `key` exists (`EXISTS`).
pub fn exists(conn: &mut redis::Connection, key: impl redis::ToRedisArgs) -> bool {
    redis::cmd("EXISTS")
        .arg(key)
        .query::<i64>(conn)
        .expect("EXISTS")
        == 1
}

/// `PTTL key`: milliseconds left, -1 without expiry, -2 when the key does not exist.
pub fn pttl(conn: &mut redis::Connection, key: impl redis::ToRedisArgs) -> i64 {
    redis::cmd("PTTL").arg(key).query(conn).expect("PTTL")
}

#[cfg(test)]
mod tests {
    use std::net::{Ipv4Addr, TcpListener, TcpStream};

    /// The dead server's port refuses connections, and nobody else can take it meanwhile.
    #[test]
    fn a_dead_url_refuses_and_keeps_its_port() {
        let url = super::dead_url();
        let port: u16 = url
            .trim_start_matches("redis://127.0.0.1:")
            .trim_end_matches('/')
            .parse()
            .expect("a port");
        let refused = TcpStream::connect((Ipv4Addr::LOCALHOST, port)).expect_err("refused");
        assert_eq!(refused.kind(), std::io::ErrorKind::ConnectionRefused);
        assert!(TcpListener::bind((Ipv4Addr::LOCALHOST, port)).is_err());
    }
}
