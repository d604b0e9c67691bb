//! A real `redis-server` process per test.
//!
//! Tests never mock Redis: lock semantics depend on real command atomicity,
//! real expiry and real keyspace notifications. Each `RedisServer` owns a
//! private temp dir, a generated `redis.conf`, a loopback-only port and the
//! child process; dropping it SIGKILLs and reaps the process, so no
//! `redis-server` outlives its test even when the test panics. A test
//! process that dies without unwinding (SIGKILL, abort, a CI timeout) does
//! not leak its servers either: each has a reaper (see [`Reaper`]).
//!
//! Command statistics (`commandstats`, `command_count`, `total_commands`) are
//! reported *net of the harness's own bookkeeping*: the private admin
//! connection that reads `INFO`, `CLIENT LIST`, `SCAN`... counts its own
//! commands and subtracts them, and a baseline taken at startup hides the
//! startup probe. A fresh server therefore reports zero commands, and a test
//! can assert exactly what the library sent.

use std::collections::HashMap;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use redis::{Cmd, Connection, ConnectionInfo, FromRedisValue, IntoConnectionInfo, RedisResult};
use tempfile::TempDir;

/// How long a fresh process may take to answer PING.
const STARTUP_TIMEOUT: Duration = Duration::from_secs(10);
/// Fresh random ports tried when the chosen one was taken between our probe
/// bind and Redis's bind (other tests pick free ports concurrently).
const PORT_ATTEMPTS: usize = 5;
/// `restart()` must reuse the port; the old socket may linger briefly.
const SAME_PORT_RETRY: Duration = Duration::from_secs(5);
/// Grace period for SIGTERM before escalating to SIGKILL.
const STOP_TIMEOUT: Duration = Duration::from_secs(5);
/// Read/write timeout of the harness's admin connection: a test that asks
/// for stats while the server is paused fails instead of hanging forever.
const ADMIN_TIMEOUT: Duration = Duration::from_secs(10);
/// Log lines quoted in panic messages.
const LOG_TAIL_LINES: usize = 30;

/// Credentials the harness (and `conn()`) use to talk to the server.
#[derive(Clone, Debug, Default)]
struct Auth {
    user: Option<String>,
    password: Option<String>,
}

/// Options for [`RedisServer`]; obtain with [`RedisServer::builder`].
#[derive(Clone, Debug, Default)]
pub struct RedisServerBuilder {
    config: Vec<(String, String)>,
    binary: Option<String>,
    sentinel: bool,
    port: Option<u16>,
    password: Option<String>,
    admin_auth: Option<(String, String)>,
    port_directives: Vec<String>,
}

impl RedisServerBuilder {
    /// Adds a config directive, written to `redis.conf` as the line
    /// `name value`. `value` is written verbatim so that multi-word
    /// directives work (`.config("user", "alice on >pw ~* +@all")`); quote
    /// it yourself if needed. An empty value is written as `""`, so
    /// `.config("notify-keyspace-events", "")` and
    /// `.config("rename-command", "CONFIG \"\"")` do what they say.
    /// Everything goes through the config file because some directives
    /// (`rename-command`) are rejected at runtime.
    pub fn config(mut self, name: &str, value: &str) -> Self {
        self.config.push((name.to_string(), value.to_string()));
        self
    }

    /// Adds the ACL user `user` with `password` and ACL `rules` (e.g. `~* +@all`); log in
    /// as it with [`RedisServer::url_as`].
    pub fn acl_user(self, user: &str, password: &str, rules: &str) -> Self {
        self.config("user", &format!("{user} on >{password} {rules}"))
    }

    /// Runs a server binary built with TLS (see [`crate::binaries::tls_bins`]) instead of
    /// [`crate::binaries::server_bin`].
    pub fn tls_capable(mut self) -> Self {
        self.binary = Some(crate::binaries::tls_bins().0);
        self
    }

    /// Runs `redis-server --sentinel`: `config` then takes `sentinel …` directives.
    pub fn sentinel(mut self) -> Self {
        self.sentinel = true;
        self
    }

    /// Listens on this port instead of a free one.
    pub fn port(mut self, port: u16) -> Self {
        self.port = Some(port);
        self
    }

    /// Adds the directive `name <port>` (e.g. `tls-port`) with a free port chosen afresh on
    /// every attempt to start, like the plain port: a port chosen once, before the start,
    /// may be taken by another test's server meanwhile. Read it back with
    /// [`RedisServer::port_of`]; `restart` keeps it.
    pub fn free_port_for(mut self, name: &str) -> Self {
        self.port_directives.push(name.to_string());
        self
    }

    /// Sets `requirepass` and makes the harness authenticate with it.
    pub fn password(mut self, password: &str) -> Self {
        self.password = Some(password.to_string());
        self
    }

    /// Credentials for the harness's own connections when ACL `user` lines
    /// lock the default user out (e.g. `user default off`).
    pub fn admin_auth(mut self, user: &str, password: &str) -> Self {
        self.admin_auth = Some((user.to_string(), password.to_string()));
        self
    }

    /// Starts the server and waits until it answers PING. Panics on failure, with the
    /// reason (an install hint when there is no server binary): tests never skip.
    pub fn start(self) -> RedisServer {
        self.try_start().unwrap_or_else(|e| panic!("{e}"))
    }

    /// Starts the server and waits until it answers PING; `Err` says why it could not
    /// (no binary, with an install hint; a bad directive, with the log's tail).
    pub fn try_start(self) -> Result<RedisServer, String> {
        self.try_start_choosing(&mut free_port)
    }

    /// `try_start` with the ports of each attempt taken from `choose`.
    fn try_start_choosing(self, choose: &mut dyn FnMut() -> u16) -> Result<RedisServer, String> {
        let binary = self
            .binary
            .clone()
            .unwrap_or_else(crate::binaries::server_bin);
        let version = crate::binaries::version_of(&binary)?;
        let auth = self.resolve_auth();
        let mut config = self.config;
        if let Some(pw) = &self.password {
            config.push(("requirepass".into(), pw.clone()));
        }
        let dir = tempfile::Builder::new()
            .prefix("redbaton-redis-")
            .tempdir()
            .map_err(|e| format!("create temp dir for redis-server: {e}"))?;
        let mut spec = Spec {
            binary,
            version,
            sentinel: self.sentinel,
            conf_path: dir.path().join("redis.conf"),
            dir: dir.path().to_path_buf(),
            config,
            port_directives: self.port_directives.into_iter().map(|n| (n, 0)).collect(),
            auth,
        };
        let (child, port) = match self.port {
            Some(port) => {
                spec.choose_directive_ports(choose);
                spawn_same_port(&spec, port, Duration::ZERO)?
            }
            None => spawn_free_port(&mut spec, choose)?,
        };
        let server = RedisServer {
            spec,
            port,
            reaper: Mutex::new(Reaper::arm(child.id(), dir.path())),
            process: Mutex::new(child),
            admin: Mutex::new(Admin::default()),
            _dir: dir,
        };
        server.reset_admin();
        Ok(server)
    }

    /// Password for the harness: explicit `admin_auth`, else `password`,
    /// else a `requirepass` passed through `config`.
    fn resolve_auth(&self) -> Auth {
        if let Some((user, pw)) = &self.admin_auth {
            return Auth {
                user: Some(user.clone()),
                password: Some(pw.clone()),
            };
        }
        let from_config = self
            .config
            .iter()
            .rev()
            .find(|(name, _)| name.eq_ignore_ascii_case("requirepass"))
            .map(|(_, v)| v.trim().trim_matches('"').to_string())
            .filter(|v| !v.is_empty());
        Auth {
            user: None,
            password: self.password.clone().or(from_config),
        }
    }
}

/// What is needed to (re)start the process.
struct Spec {
    binary: String,
    version: crate::binaries::ServerVersion,
    sentinel: bool,
    dir: PathBuf,
    conf_path: PathBuf,
    config: Vec<(String, String)>,
    /// Directives whose value is a port of their own (`free_port_for`), as last chosen.
    port_directives: Vec<(String, u16)>,
    auth: Auth,
}

impl Spec {
    fn choose_directive_ports(&mut self, choose: &mut dyn FnMut() -> u16) {
        for (_, port) in &mut self.port_directives {
            *port = choose();
        }
    }
}

/// The harness's private connection plus the bookkeeping that lets stats be
/// reported net of the harness's own traffic.
#[derive(Default)]
struct Admin {
    conn: Option<Connection>,
    /// `CLIENT ID` of `conn`, hidden from `client_list()`.
    conn_id: Option<u64>,
    /// Raw counts at the last reset; subtracted from every reading. Also
    /// the fallback when `CONFIG RESETSTAT` is unavailable.
    baseline: HashMap<String, u64>,
    /// Commands the admin connection completed since the baseline.
    own: HashMap<String, u64>,
}

/// How [`RedisServer::reset_stats`] managed to reset the counters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StatsReset {
    /// `CONFIG RESETSTAT` ran on the server.
    Server,
    /// `CONFIG` is unavailable (renamed away, ACL): a snapshot of the
    /// current counts is subtracted from later readings instead.
    Baseline,
}

/// A running `redis-server` child process bound to 127.0.0.1.
///
/// All methods take `&self` so a server can be shared (`Arc`) with helper
/// threads that pause, kill or restart it mid-test.
pub struct RedisServer {
    spec: Spec,
    port: u16,
    process: Mutex<Child>,
    reaper: Mutex<Reaper>,
    admin: Mutex<Admin>,
    // Declared last: removed only after the process is gone (see Drop).
    _dir: TempDir,
}

impl RedisServer {
    /// Starts a server with the default config on a free port.
    pub fn start() -> RedisServer {
        Self::builder().start()
    }

    /// Starts a server as managed services often run one: keyspace notifications off, and
    /// `CONFIG` renamed away, so that a client can neither read nor turn them on.
    pub fn without_notifications() -> RedisServer {
        Self::builder()
            .config("notify-keyspace-events", "")
            .config("rename-command", "CONFIG \"\"")
            .start()
    }

    /// Starts a server with the default config on a free port, or says why it could not.
    pub fn try_start() -> Result<RedisServer, String> {
        Self::builder().try_start()
    }

    pub fn builder() -> RedisServerBuilder {
        RedisServerBuilder::default()
    }

    /// Starts a replica of this server (default config) and waits until it is in sync.
    /// Panics if it is not within 20 s.
    pub fn start_replica(&self) -> RedisServer {
        let replica = Self::builder()
            .config("replicaof", &format!("127.0.0.1 {}", self.port))
            .start();
        let info = |server: &RedisServer| {
            redis::cmd("INFO")
                .arg("replication")
                .query::<String>(&mut server.conn())
                .unwrap_or_default()
        };
        // In sync on both sides: the master counts a replica that synced without a disk
        // (`WAIT` included) only once its first acknowledgement came, up to a second later.
        crate::wait::wait_for(Duration::from_secs(20), "the replica in sync", || {
            info(&replica).contains("master_link_status:up")
                && info(self).contains(&format!("port={},state=online", replica.port))
        });
        replica
    }

    /// The version of this server's binary.
    pub fn version(&self) -> &crate::binaries::ServerVersion {
        &self.spec.version
    }

    /// `redis://127.0.0.1:PORT/` (no credentials; see `url_with_auth`).
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// A URL that logs in as `user` (see [`RedisServerBuilder::acl_user`]).
    pub fn url_as(&self, user: &str, password: &str) -> String {
        format!("redis://{user}:{password}@127.0.0.1:{}/", self.port)
    }

    /// Like `url()` but with the configured user/password embedded.
    /// Credentials are not percent-encoded: keep test passwords URL-safe.
    pub fn url_with_auth(&self) -> String {
        match (&self.spec.auth.user, &self.spec.auth.password) {
            (Some(u), Some(p)) => format!("redis://{u}:{p}@127.0.0.1:{}/", self.port),
            (None, Some(p)) => format!("redis://:{p}@127.0.0.1:{}/", self.port),
            _ => self.url(),
        }
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The port given to the directive `name` of [`RedisServerBuilder::free_port_for`].
    pub fn port_of(&self, name: &str) -> Option<u16> {
        self.spec
            .port_directives
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, port)| *port)
    }

    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from((Ipv4Addr::LOCALHOST, self.port))
    }

    /// PID of the current process (changes on `restart`; still returns the
    /// old PID after `kill`/`stop`).
    pub fn pid(&self) -> u32 {
        self.process.lock().id()
    }

    /// Whether the process is alive (a paused process is alive).
    pub fn is_running(&self) -> bool {
        matches!(self.process.lock().try_wait(), Ok(None))
    }

    /// The server's temp dir (holds `redis.conf` and `redis.log`).
    pub fn dir(&self) -> &Path {
        &self.spec.dir
    }

    /// Last lines of the server log and captured stdout/stderr.
    pub fn log_tail(&self) -> String {
        log_tail(&self.spec.dir)
    }

    /// A fresh raw connection, authenticated if the server needs it. No
    /// timeouts are set, and its commands count in the stats (it is test
    /// traffic, not harness bookkeeping).
    pub fn conn(&self) -> Connection {
        connect(&self.connection_info(), None)
            .unwrap_or_else(|e| panic!("connect to redis on port {}: {e}", self.port))
    }

    /// SIGKILL and reap: the abrupt death of a Redis node.
    pub fn kill(&self) {
        let mut child = self.process.lock();
        self.reaper.lock().disarm();
        signal(&mut child, libc::SIGKILL);
        let _ = child.wait();
    }

    /// SIGTERM (clean shutdown), waiting up to 5 s before SIGKILL.
    pub fn stop(&self) {
        let mut child = self.process.lock();
        self.reaper.lock().disarm();
        stop_child(&mut child);
    }

    /// SIGSTOP: the process keeps its sockets but answers nothing, like a
    /// node stuck in a long GC pause or a silent network partition.
    pub fn pause(&self) {
        signal(&mut self.process.lock(), libc::SIGSTOP);
    }

    /// SIGCONT after `pause`.
    pub fn resume(&self) {
        signal(&mut self.process.lock(), libc::SIGCONT);
    }

    /// Stops the server and starts a new process on the same port with the
    /// same config. The dataset comes back empty (persistence is off), and
    /// anything set with `CONFIG SET` is lost. Works after `kill` too.
    pub fn restart(&self) {
        {
            let mut child = self.process.lock();
            let mut reaper = self.reaper.lock();
            reaper.disarm();
            stop_child(&mut child);
            let (new_child, _) = spawn_same_port(&self.spec, self.port, SAME_PORT_RETRY)
                .unwrap_or_else(|e| panic!("{e}"));
            *reaper = Reaper::arm(new_child.id(), &self.spec.dir);
            *child = new_child;
        }
        self.reset_admin();
    }

    /// Calls per command since startup/`reset_stats`, net of harness
    /// traffic. Keys are lower-case Redis 7 names: `evalsha`, `set`,
    /// `client|list`, `config|set`...
    pub fn commandstats(&self) -> HashMap<String, u64> {
        let mut admin = self.admin.lock();
        let raw = self.raw_stats(&mut admin);
        net_stats(&raw, &admin.baseline, &admin.own)
    }

    /// Unadjusted `INFO commandstats` calls (includes harness traffic).
    pub fn raw_commandstats(&self) -> HashMap<String, u64> {
        let mut admin = self.admin.lock();
        self.raw_stats(&mut admin)
    }

    /// Calls of one command. A container name without `|` (e.g. `client`,
    /// `config`) sums all its subcommands.
    pub fn command_count(&self, name: &str) -> u64 {
        let name = name.to_ascii_lowercase();
        let prefix = format!("{name}|");
        self.commandstats()
            .iter()
            .filter(|(k, _)| **k == name || (!name.contains('|') && k.starts_with(&prefix)))
            .map(|(_, v)| v)
            .sum()
    }

    /// Sum of all calls, net of harness traffic.
    pub fn total_commands(&self) -> u64 {
        self.commandstats().values().sum()
    }

    /// The server's `INFO` section `section` (e.g. `replication`) as text; empty when the
    /// server cannot be reached (one that was killed, or is being restarted), so that a
    /// poll for a role or a link state simply goes on.
    pub fn info(&self, section: &str) -> String {
        connect(&self.connection_info(), None)
            .and_then(|mut conn| redis::cmd("INFO").arg(section).query(&mut conn))
            .unwrap_or_default()
    }

    /// The value of the server's configuration parameter `name` (`CONFIG GET`), e.g.
    /// `notify-keyspace-events`: what a client changed, or did not, on the server.
    pub fn config_get(&self, name: &str) -> String {
        let reply: Vec<String> = redis::cmd("CONFIG")
            .arg("GET")
            .arg(name)
            .query(&mut self.conn())
            .unwrap_or_else(|e| panic!("CONFIG GET {name}: {e}"));
        reply.get(1).cloned().unwrap_or_default()
    }

    /// Sets the server's configuration parameter `name` (`CONFIG SET`) through the
    /// harness's own connection, so that it works also when the server takes no new
    /// client (`maxclients`).
    pub fn config_set(&self, name: &str, value: &str) {
        let mut admin = self.admin.lock();
        let cmd = redis::cmd("CONFIG").arg("SET").arg(name).arg(value).clone();
        self.admin_query::<()>(&mut admin, &cmd, "config|set")
            .unwrap_or_else(|e| panic!("CONFIG SET {name} {value} on port {}: {e}", self.port));
    }

    /// Another process releases the lock key `key` and takes it again at once (one
    /// transaction, held for two minutes): a waiter wakes, retries, and finds it held.
    pub fn bounce(&self, key: &str) {
        let () = redis::pipe()
            .atomic()
            .cmd("DEL")
            .arg(key)
            .ignore()
            .cmd("SET")
            .arg(key)
            .arg("another owner")
            .arg("PX")
            .arg(120_000)
            .ignore()
            .query(&mut self.conn())
            .unwrap_or_else(|e| panic!("bounce {key} on port {}: {e}", self.port));
    }

    /// What idle waiters cost: the commands the server runs in 3 s, counted once they
    /// have had a second to settle into waiting. Prints the figure for `who`.
    pub fn idle_cost(&self, who: &str) -> u64 {
        std::thread::sleep(Duration::from_secs(1));
        let before = self.total_commands();
        std::thread::sleep(Duration::from_secs(3));
        let spent = self.total_commands() - before;
        eprintln!("{who}: {spent} commands in 3 s");
        spent
    }

    /// Zeroes the command counters. Uses `CONFIG RESETSTAT` when allowed
    /// (which also resets other `INFO stats` fields); if the command is
    /// refused (renamed away, ACL) falls back to a baseline snapshot, so it
    /// never panics for that reason.
    pub fn reset_stats(&self) -> StatsReset {
        let mut admin = self.admin.lock();
        let reset = self.admin_query::<()>(
            &mut admin,
            redis::cmd("CONFIG").arg("RESETSTAT"),
            "config|resetstat",
        );
        match reset {
            Ok(()) => {
                admin.baseline.clear();
                // RESETSTAT itself is recorded after the reset (under `config` before
                // Redis 7, which counts subcommands apart).
                let name = if self.spec.version.at_least(7, 0) {
                    "config|resetstat"
                } else {
                    "config"
                };
                admin.own = HashMap::from([(name.to_string(), 1)]);
                StatsReset::Server
            }
            Err(e) if is_transport_error(&e) => {
                panic!("reset_stats on port {}: {e}", self.port)
            }
            Err(_) => {
                self.take_baseline(&mut admin);
                StatsReset::Baseline
            }
        }
    }

    /// `CLIENT KILL TYPE pubsub`: drops every subscriber connection; how many there were.
    pub fn kill_pubsub(&self) -> i64 {
        redis::cmd("CLIENT")
            .arg("KILL")
            .arg("TYPE")
            .arg("pubsub")
            .query(&mut self.conn())
            .unwrap_or_else(|e| panic!("CLIENT KILL TYPE pubsub on port {}: {e}", self.port))
    }

    /// `CLIENT LIST`, one map per client (`id`, `addr`, `name`, `cmd`,
    /// `flags`, `sub`, `psub`...). The harness's own admin connection is
    /// left out; connections from `conn()` are included.
    pub fn client_list(&self) -> Vec<HashMap<String, String>> {
        let mut admin = self.admin.lock();
        let text: String = self
            .admin_query(&mut admin, redis::cmd("CLIENT").arg("LIST"), "client|list")
            .unwrap_or_else(|e| panic!("CLIENT LIST on port {}: {e}", self.port));
        let own_id = admin.conn_id.map(|id| id.to_string());
        parse_client_list(&text)
            .into_iter()
            .filter(|c| own_id.is_none() || c.get("id") != own_id.as_ref())
            .collect()
    }

    /// The ids of the connections subscribed to a channel, classic or sharded: one per
    /// client (or process) that waits, or reads the read-write lock.
    pub fn subscribers(&self) -> Vec<String> {
        let some = |n: Option<&String>| n.is_some_and(|n| n != "0");
        (self.client_list().into_iter())
            .filter(|c| some(c.get("sub")) || some(c.get("ssub")))
            .filter_map(|mut c| c.remove("id"))
            .collect()
    }

    /// Keys matching a glob pattern but the fence counters (which outlive every hold by
    /// design), as strings, sorted: what a test expects to be gone after a release.
    pub fn keys_but_fences(&self, pattern: &str) -> Vec<String> {
        let mut keys: Vec<String> = self
            .keys(pattern)
            .into_iter()
            .map(|k| String::from_utf8_lossy(&k).into_owned())
            .filter(|k| !k.ends_with(":fence"))
            .collect();
        keys.sort();
        keys
    }

    /// The number of members of the sorted set `key` (0 when it is gone).
    pub fn zcard(&self, key: &str) -> usize {
        redis::cmd("ZCARD")
            .arg(key)
            .query(&mut self.conn())
            .expect("ZCARD")
    }

    /// Keys matching a glob pattern, via `SCAN` (sorted, for stable asserts).
    pub fn keys(&self, pattern: &str) -> Vec<Vec<u8>> {
        let mut admin = self.admin.lock();
        let mut cursor = "0".to_string();
        let mut keys = Vec::new();
        loop {
            let (next, batch): (String, Vec<Vec<u8>>) = self
                .admin_query(
                    &mut admin,
                    redis::cmd("SCAN")
                        .arg(&cursor)
                        .arg("MATCH")
                        .arg(pattern)
                        .arg("COUNT")
                        .arg(1000),
                    "scan",
                )
                .unwrap_or_else(|e| panic!("SCAN on port {}: {e}", self.port));
            keys.extend(batch);
            if next == "0" {
                break;
            }
            cursor = next;
        }
        keys.sort();
        keys.dedup(); // SCAN may return a key twice during rehashing
        keys
    }

    fn connection_info(&self) -> ConnectionInfo {
        connection_info(self.port, &self.spec.auth)
    }

    /// Fresh admin connection and a baseline that hides everything so far
    /// (the startup probe, previous process's counts).
    fn reset_admin(&self) {
        let mut admin = self.admin.lock();
        *admin = Admin::default();
        self.take_baseline(&mut admin);
    }

    fn take_baseline(&self, admin: &mut Admin) {
        // Connect first so the connection's AUTH / CLIENT ID land in the
        // baseline rather than in `own`.
        if let Err(e) = self.admin_conn(admin) {
            panic!("admin connection to port {}: {e}", self.port);
        }
        admin.own.clear();
        admin.baseline = self.raw_stats(admin);
        // raw_stats recorded its own INFO in `own`: keep exactly that.
        admin.own = HashMap::from([("info".to_string(), 1)]);
    }

    /// `INFO commandstats`; the INFO being executed is not in its own
    /// output, but it is counted in `own` for the next reading.
    fn raw_stats(&self, admin: &mut Admin) -> HashMap<String, u64> {
        let text: String = self
            .admin_query(admin, redis::cmd("INFO").arg("commandstats"), "info")
            .unwrap_or_else(|e| panic!("INFO commandstats on port {}: {e}", self.port));
        parse_commandstats(&text)
    }

    fn admin_conn<'a>(&self, admin: &'a mut Admin) -> RedisResult<&'a mut Connection> {
        if admin.conn.is_none() {
            let mut conn = connect(&self.connection_info(), Some(ADMIN_TIMEOUT))?;
            if self.spec.auth.password.is_some() {
                *admin.own.entry("auth".into()).or_default() += 1;
            }
            let id: u64 = redis::cmd("CLIENT").arg("ID").query(&mut conn)?;
            *admin.own.entry("client|id".into()).or_default() += 1;
            admin.conn_id = Some(id);
            admin.conn = Some(conn);
        }
        Ok(admin.conn.as_mut().expect("connected above"))
    }

    /// Runs a command on the admin connection and books it under
    /// `stat_name`. A broken connection is discarded so the next call
    /// reconnects (e.g. after `kill` + manual checks).
    fn admin_query<T: FromRedisValue>(
        &self,
        admin: &mut Admin,
        cmd: &Cmd,
        stat_name: &str,
    ) -> RedisResult<T> {
        let result = cmd.query(self.admin_conn(admin)?);
        match &result {
            Ok(_) => {
                // Redis 7 counts subcommands apart (`client|list`); 6.2 only the container.
                let name = match stat_name.split_once('|') {
                    Some((container, _)) if !self.spec.version.at_least(7, 0) => container,
                    _ => stat_name,
                };
                *admin.own.entry(name.into()).or_default() += 1
            }
            Err(e) if is_transport_error(e) => {
                admin.conn = None;
                admin.conn_id = None;
            }
            Err(_) => {}
        }
        result
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        // SIGKILL is enough: nothing is persisted. Reap it so the process is
        // really gone before the temp dir is deleted.
        self.reaper.get_mut().disarm();
        let child = self.process.get_mut();
        signal(child, libc::SIGKILL);
        let _ = child.wait();
    }
}

/// Starts `n` independent servers (one per Redlock node), in parallel.
pub fn start_many(n: usize) -> Vec<RedisServer> {
    thread::scope(|s| {
        let handles: Vec<_> = (0..n).map(|_| s.spawn(RedisServer::start)).collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
            .collect()
    })
}

/// Parses `INFO commandstats` into `name -> calls`
/// (`cmdstat_client|list:calls=3,usec=...` -> `client|list -> 3`).
pub fn parse_commandstats(info: &str) -> HashMap<String, u64> {
    info.lines()
        .filter_map(|line| {
            let (name, fields) = line.trim().strip_prefix("cmdstat_")?.split_once(':')?;
            let calls = fields
                .split(',')
                .find_map(|f| f.strip_prefix("calls="))?
                .parse()
                .ok()?;
            Some((name.to_ascii_lowercase(), calls))
        })
        .collect()
}

/// Parses `CLIENT LIST`: one client per line, space-separated `key=value`.
pub fn parse_client_list(text: &str) -> Vec<HashMap<String, String>> {
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|line| {
            line.split_whitespace()
                .filter_map(|kv| kv.split_once('='))
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        })
        .collect()
}

fn net_stats(
    raw: &HashMap<String, u64>,
    baseline: &HashMap<String, u64>,
    own: &HashMap<String, u64>,
) -> HashMap<String, u64> {
    raw.iter()
        .filter_map(|(name, &calls)| {
            let minus =
                baseline.get(name).copied().unwrap_or(0) + own.get(name).copied().unwrap_or(0);
            let net = calls.saturating_sub(minus);
            (net > 0).then(|| (name.clone(), net))
        })
        .collect()
}

/// Errors where the connection itself failed (vs. a Redis error reply).
fn is_transport_error(e: &redis::RedisError) -> bool {
    e.is_io_error() || e.is_timeout() || e.is_connection_dropped() || e.is_connection_refusal()
}

fn connection_info(port: u16, auth: &Auth) -> ConnectionInfo {
    let info = format!("redis://127.0.0.1:{port}/")
        .into_connection_info()
        .expect("valid redis url");
    // Skip `CLIENT SETINFO` on connect: it would show up in commandstats
    // as noise unrelated to the code under test.
    let mut settings = info.redis_settings().clone().set_skip_set_lib_name();
    if let Some(user) = &auth.user {
        settings = settings.set_username(user);
    }
    if let Some(pw) = &auth.password {
        settings = settings.set_password(pw);
    }
    info.set_redis_settings(settings)
}

fn connect(info: &ConnectionInfo, timeout: Option<Duration>) -> RedisResult<Connection> {
    let client = redis::Client::open(info.clone())?;
    let conn = client.get_connection_with_timeout(timeout.unwrap_or(Duration::from_secs(5)))?;
    conn.set_read_timeout(timeout)?;
    conn.set_write_timeout(timeout)?;
    Ok(conn)
}

/// Sends `sig` unless the child was already reaped. Holding `&mut Child`
/// (under the server's mutex) guarantees nobody reaps it concurrently, so
/// the PID cannot have been recycled for an unrelated process.
fn signal(child: &mut Child, sig: libc::c_int) -> bool {
    if !matches!(child.try_wait(), Ok(None)) {
        return false;
    }
    // SAFETY: plain syscall on a PID we own and have not reaped.
    unsafe { libc::kill(child.id() as libc::pid_t, sig) == 0 }
}

/// Kills a server by PID if the test process dies without stopping it: a `sh`
/// child blocked reading a pipe from this process. A line written to the pipe
/// disarms it (the harness stops the server itself); end of file means this
/// process is gone, however it went, and the reaper kills the server and
/// removes its temp dir. It checks that the PID is still a `redis-server` (or Valkey)
/// where `/proc` can tell, so a reused PID is never killed.
pub(crate) struct Reaper(Option<(Child, ChildStdin)>);

impl Reaper {
    fn arm(pid: u32, dir: &Path) -> Reaper {
        // Deaf to the signals a terminal sends the whole process group (Ctrl-C): the
        // reaper must outlive the process it watches to clean up after it.
        const SCRIPT: &str = r#"
trap '' INT HUP TERM
if read _; then exit 0; fi
comm=$(cat "/proc/$0/comm" 2>/dev/null || echo redis-server)
case "$comm" in redis*|valkey*) kill -9 "$0" 2>/dev/null ;; esac
rm -rf "$1""#;
        Reaper::spawn(SCRIPT, &[&pid.to_string(), &dir.to_string_lossy()])
    }

    /// Removes `dir` when the test process ends without [`disarm`](Self::disarm): a
    /// directory kept for the whole process (certificates of a cluster in a `static`),
    /// which no destructor removes.
    pub(crate) fn for_dir(dir: &Path) -> Reaper {
        const SCRIPT: &str = r#"
trap '' INT HUP TERM
if read _; then exit 0; fi
rm -rf "$0""#;
        Reaper::spawn(SCRIPT, &[&dir.to_string_lossy()])
    }

    fn spawn(script: &str, args: &[&str]) -> Reaper {
        let spawned = Command::new("sh")
            .arg("-c")
            .arg(script)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn();
        // Without `sh` the harness still stops its servers; only a test
        // process killed outright would leak one.
        Reaper(spawned.ok().and_then(|mut child| {
            let pipe = child.stdin.take()?;
            Some((child, pipe))
        }))
    }

    pub(crate) fn disarm(&mut self) {
        if let Some((mut child, mut pipe)) = self.0.take() {
            let _ = pipe.write_all(b"\n");
            drop(pipe);
            let _ = child.wait();
        }
    }
}

fn stop_child(child: &mut Child) {
    signal(child, libc::SIGTERM);
    // A paused (SIGSTOPped) process would never act on SIGTERM.
    signal(child, libc::SIGCONT);
    let deadline = Instant::now() + STOP_TIMEOUT;
    while Instant::now() < deadline {
        if !matches!(child.try_wait(), Ok(None)) {
            return;
        }
        thread::sleep(Duration::from_millis(10));
    }
    signal(child, libc::SIGKILL);
    let _ = child.wait();
}

enum StartError {
    /// Our bind failed: someone else holds the port.
    PortInUse(String),
    Fatal(String),
}

/// Starts on a port from `choose`, with fresh ports for the port directives too, and tries
/// again with new ones when any of them was taken.
fn spawn_free_port(
    spec: &mut Spec,
    choose: &mut dyn FnMut() -> u16,
) -> Result<(Child, u16), String> {
    let mut failures = Vec::new();
    for _ in 0..PORT_ATTEMPTS {
        let port = choose();
        spec.choose_directive_ports(choose);
        match spawn_once(spec, port) {
            Ok(child) => return Ok((child, port)),
            Err(StartError::PortInUse(msg)) => failures.push(format!("port {port}: {msg}")),
            Err(StartError::Fatal(msg)) => return Err(msg),
        }
    }
    Err(format!(
        "redis-server could not bind a free port in {PORT_ATTEMPTS} attempts:\n{}",
        failures.join("\n")
    ))
}

fn spawn_same_port(spec: &Spec, port: u16, retry_for: Duration) -> Result<(Child, u16), String> {
    let deadline = Instant::now() + retry_for;
    loop {
        match spawn_once(spec, port) {
            Ok(child) => return Ok((child, port)),
            Err(StartError::PortInUse(_)) if Instant::now() < deadline => {
                thread::sleep(Duration::from_millis(50));
            }
            Err(StartError::PortInUse(msg)) | Err(StartError::Fatal(msg)) => {
                return Err(format!("redis-server on fixed port {port}: {msg}"));
            }
        }
    }
}

/// Asks the kernel for a free port. It is released before Redis binds it,
/// so another process may grab it meanwhile: callers retry. Never above 55535:
/// a cluster node's bus listens 10000 higher, and Redis refuses to start a
/// cluster node whose bus port would not exist.
pub(crate) fn free_port() -> u16 {
    loop {
        let port = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .and_then(|l| l.local_addr())
            .expect("bind 127.0.0.1:0")
            .port();
        if port <= 55535 {
            return port;
        }
    }
}

fn spawn_once(spec: &Spec, port: u16) -> Result<Child, StartError> {
    write_config(spec, port).map_err(|e| StartError::Fatal(format!("write redis.conf: {e}")))?;
    // Logs are appended to across attempts and restarts: remember where
    // this attempt's output begins.
    let log_start = LOG_FILES.map(|name| fs::metadata(spec.dir.join(name)).map_or(0, |m| m.len()));
    let stdio = OpenOptions::new()
        .create(true)
        .append(true)
        .open(spec.dir.join("stdio.log"))
        .map_err(|e| StartError::Fatal(format!("open stdio.log: {e}")))?;
    let stderr = stdio
        .try_clone()
        .map_err(|e| StartError::Fatal(format!("dup stdio.log: {e}")))?;
    let bin = &spec.binary;
    let mut command = Command::new(bin);
    command.arg(&spec.conf_path);
    if spec.sentinel {
        command.arg("--sentinel");
    }
    let mut child = command
        .current_dir(&spec.dir)
        .stdin(Stdio::null())
        .stdout(stdio)
        .stderr(stderr)
        .spawn()
        .map_err(|e| match e.kind() {
            io::ErrorKind::NotFound => StartError::Fatal(format!(
                "{bin} not found: {}",
                crate::binaries::INSTALL_HINT
            )),
            _ => StartError::Fatal(format!("spawn {bin}: {e}")),
        })?;
    match wait_ready(&mut child, port, spec, log_start) {
        Ok(()) => Ok(child),
        Err(e) => {
            signal(&mut child, libc::SIGKILL);
            let _ = child.wait();
            let tail = log_tail(&spec.dir);
            Err(match e {
                StartError::PortInUse(m) => StartError::PortInUse(m),
                StartError::Fatal(m) => StartError::Fatal(format!(
                    "redis-server (port {port}) failed to start: {m}\n--- log tail ({}) ---\n{tail}",
                    spec.dir.display()
                )),
            })
        }
    }
}

/// Polls until *our* process answers PING. Checking `process_id` matters:
/// if the port was taken by another test's Redis, that one would answer
/// while ours dies with "Address already in use".
fn wait_ready(
    child: &mut Child,
    port: u16,
    spec: &Spec,
    log_start: [u64; 2],
) -> Result<(), StartError> {
    let info = connection_info(port, &spec.auth);
    let deadline = Instant::now() + STARTUP_TIMEOUT;
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            let output = output_since(&spec.dir, log_start);
            if let Some(line) = output
                .lines()
                .find(|l| l.contains("Address already in use"))
            {
                return Err(StartError::PortInUse(format!(
                    "exited with {status}: {}",
                    line.trim()
                )));
            }
            return Err(StartError::Fatal(format!("exited with {status}")));
        }
        let last_err = match probe(&info) {
            Ok(pid) if pid == child.id() => return Ok(()),
            Ok(pid) => format!("port answered by another redis (pid {pid})"),
            Err(e) => e.to_string(),
        };
        if Instant::now() >= deadline {
            return Err(StartError::Fatal(format!(
                "no PING answer within {STARTUP_TIMEOUT:?}; last error: {last_err}"
            )));
        }
        thread::sleep(Duration::from_millis(20));
    }
}

/// PING, then `INFO server` to learn which process answered.
fn probe(info: &ConnectionInfo) -> RedisResult<u32> {
    let mut conn = connect(info, Some(Duration::from_millis(500)))?;
    let _: String = redis::cmd("PING").query(&mut conn)?;
    let text: String = redis::cmd("INFO").arg("server").query(&mut conn)?;
    Ok(text
        .lines()
        .find_map(|l| l.trim().strip_prefix("process_id:"))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0))
}

fn write_config(spec: &Spec, port: u16) -> io::Result<()> {
    let dir = quote(&spec.dir.to_string_lossy());
    let log = quote(&spec.dir.join("redis.log").to_string_lossy());
    let mut text = format!(
        "# Generated by redbaton-testkit (server.rs); rewritten on every start.\n\
         bind 127.0.0.1\n\
         port {port}\n\
         dir {dir}\n\
         logfile {log}\n\
         daemonize no\n\
         protected-mode no\n\
         save \"\"\n\
         appendonly no\n\
         # A replica's first sync starts at once: the default waits 5 s for more replicas\n\
         # (Redis 7 syncs diskless by default), and every cluster start would wait it out.\n\
         repl-diskless-sync-delay 0\n"
    );
    // Lets tests use DEBUG SLEEP to simulate a busy server. The directive came with Redis
    // 7.0; before it DEBUG was always allowed, and 6.2 refuses to start on the line.
    if spec.version.at_least(7, 0) {
        text.push_str("enable-debug-command local\n");
    }
    text.push_str("# Test-specific directives:\n");
    for (name, value) in &spec.config {
        let value = if value.is_empty() { "\"\"" } else { value };
        text.push_str(&format!("{name} {value}\n"));
    }
    for (name, port) in &spec.port_directives {
        text.push_str(&format!("{name} {port}\n"));
    }
    let mut file = File::create(&spec.conf_path)?;
    file.write_all(text.as_bytes())
}

/// Double-quotes a path for redis.conf (which uses C-like escapes).
fn quote(s: &str) -> String {
    format!("\"{}\"", s.replace('\\', "\\\\").replace('"', "\\\""))
}

const LOG_FILES: [&str; 2] = ["redis.log", "stdio.log"];

/// Everything the process wrote since the given per-file offsets.
fn output_since(dir: &Path, start: [u64; 2]) -> String {
    let mut out = String::new();
    for (name, offset) in LOG_FILES.iter().zip(start) {
        let bytes = fs::read(dir.join(name)).unwrap_or_default();
        let from = (offset as usize).min(bytes.len());
        out.push_str(&String::from_utf8_lossy(&bytes[from..]));
    }
    out
}

fn log_tail(dir: &Path) -> String {
    let mut out = String::new();
    for name in LOG_FILES {
        let text = fs::read_to_string(dir.join(name)).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        let start = lines.len().saturating_sub(LOG_TAIL_LINES);
        out.push_str(&format!("[{name}]\n{}\n", lines[start..].join("\n")));
    }
    out
}

#[cfg(test)]
mod tests {
    use std::net::TcpStream;

    use super::*;
    use crate::tls::Certs;

    /// Another process took the TLS port between our choice and Redis's bind: the start
    /// tries again with new ports instead of failing on the same taken one five times.
    #[test]
    fn a_taken_tls_port_is_chosen_again() {
        let certs = Certs::generate();
        let taken = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("bind 127.0.0.1:0");
        let taken_port = taken.local_addr().expect("local addr").port();
        // The first two ports handed out are the taken one: whichever of the plain and the
        // TLS port is chosen first, some attempt must choose the TLS port anew.
        let mut calls = 0;
        let mut choose = || {
            calls += 1;
            if calls <= 2 { taken_port } else { free_port() }
        };
        let server = certs
            .server()
            .try_start_choosing(&mut choose)
            .unwrap_or_else(|e| panic!("{e}"));
        let tls_port = server.port_of("tls-port").expect("a TLS port");
        assert_ne!(tls_port, taken_port);
        assert!(TcpStream::connect((Ipv4Addr::LOCALHOST, tls_port)).is_ok());
        drop(taken);
    }
}
