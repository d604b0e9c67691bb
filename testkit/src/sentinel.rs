//! A Sentinel group on loopback: one master, its replicas and the sentinels that watch
//! them, all real `redis-server` processes (`--sentinel` for the sentinels), stopped by
//! PID like every other test server.

use std::time::{Duration, Instant};

use crate::server::RedisServer;

/// How fast the sentinels decide a master is down.
const DOWN_AFTER_MS: u64 = 1000;

/// A master, its replicas and the sentinels that monitor it under `name`.
pub struct SentinelGroup {
    pub name: String,
    /// Data servers: the first is the master at start.
    pub servers: Vec<RedisServer>,
    pub sentinels: Vec<RedisServer>,
}

impl SentinelGroup {
    /// Starts a master with `replicas` replicas and `sentinels` sentinels (quorum: a
    /// majority of them), and waits until the sentinels know every replica and each other.
    pub fn start(name: &str, replicas: usize, sentinels: usize) -> SentinelGroup {
        let master = RedisServer::start();
        let mport = master.port();
        let mut servers = vec![master];
        for _ in 0..replicas {
            servers.push(
                RedisServer::builder()
                    .config("replicaof", &format!("127.0.0.1 {mport}"))
                    .start(),
            );
        }
        wait_for(Duration::from_secs(20), "replicas in sync", || {
            servers[0]
                .info("replication")
                .contains(&format!("connected_slaves:{replicas}"))
                && servers[1..]
                    .iter()
                    .all(|r| r.info("replication").contains("master_link_status:up"))
        });
        let quorum = sentinels / 2 + 1;
        let sentinels: Vec<RedisServer> = (0..sentinels)
            .map(|_| {
                RedisServer::builder()
                    .sentinel()
                    .config(
                        "sentinel",
                        &format!("monitor {name} 127.0.0.1 {mport} {quorum}"),
                    )
                    .config(
                        "sentinel",
                        &format!("down-after-milliseconds {name} {DOWN_AFTER_MS}"),
                    )
                    .config("sentinel", &format!("failover-timeout {name} 4000"))
                    .config("sentinel", &format!("parallel-syncs {name} 2"))
                    .start()
            })
            .collect();
        let group = SentinelGroup {
            name: name.to_owned(),
            servers,
            sentinels,
        };
        group.wait_known(replicas);
        group
    }

    fn wait_known(&self, replicas: usize) {
        let others = self.sentinels.len() - 1;
        wait_for(
            Duration::from_secs(30),
            "sentinels discover the group",
            || {
                self.sentinels.iter().all(|s| {
                    let master: Vec<String> = redis::cmd("SENTINEL")
                        .arg("MASTER")
                        .arg(&self.name)
                        .query(&mut s.conn())
                        .unwrap_or_default();
                    let field = |k: &str| {
                        master
                            .iter()
                            .position(|x| x == k)
                            .and_then(|i| master.get(i + 1))
                            .and_then(|v| v.parse::<usize>().ok())
                    };
                    field("num-slaves") == Some(replicas)
                        && field("num-other-sentinels") == Some(others)
                })
            },
        );
    }

    /// The sentinels' URLs.
    pub fn sentinel_urls(&self) -> Vec<String> {
        self.sentinels.iter().map(RedisServer::url).collect()
    }

    /// The port the sentinels name as master now.
    pub fn master_port(&self) -> u16 {
        for s in &self.sentinels {
            if let Ok((_, port)) = redis::cmd("SENTINEL")
                .arg("GET-MASTER-ADDR-BY-NAME")
                .arg(&self.name)
                .query::<(String, u16)>(&mut s.conn())
            {
                return port;
            }
        }
        panic!("no sentinel names a master");
    }

    /// The data server listening on `port`.
    pub fn server(&self, port: u16) -> &RedisServer {
        self.servers
            .iter()
            .find(|s| s.port() == port)
            .expect("a server of the group")
    }

    /// The current master.
    pub fn master(&self) -> &RedisServer {
        self.server(self.master_port())
    }

    /// `SENTINEL FAILOVER`, then waits until the sentinels name another master, it says it
    /// is one, and the old master no longer says so (the sentinels turn it into a replica
    /// only after the promotion: until then a client that has not heard of the switch may
    /// still lock on the old master, beside one that asks the sentinels anew). Returns the
    /// new master's port.
    pub fn failover(&self) -> u16 {
        let old = self.master_port();
        let asked = Instant::now();
        loop {
            // Refused while a previous failover is still settling: ask again.
            let r: redis::RedisResult<()> = redis::cmd("SENTINEL")
                .arg("FAILOVER")
                .arg(&self.name)
                .query(&mut self.sentinels[0].conn());
            if r.is_ok() {
                break;
            }
            assert!(
                asked.elapsed() < Duration::from_secs(30),
                "failover refused: {r:?}"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        let new = self.wait_new_master(old);
        wait_for(Duration::from_secs(40), "the old master demoted", || {
            !self.server(old).info("replication").contains("role:master")
        });
        new
    }

    /// Waits until the sentinels name a master other than `old` and it is one.
    pub fn wait_new_master(&self, old: u16) -> u16 {
        let mut new = old;
        wait_for(Duration::from_secs(40), "a new master", || {
            new = self.master_port();
            new != old && self.server(new).info("replication").contains("role:master")
        });
        new
    }
}

/// Polls `ok` every 50 ms: each check here asks the sentinels or the servers on new
/// connections.
/// A sentinel of its own that names the server at `master_port` the master `name`
/// (quorum 1), with more `sentinel` directives (`auth-pass NAME PASSWORD`, ...).
pub fn watching(name: &str, master_port: u16, directives: &[&str]) -> RedisServer {
    let monitor = format!("monitor {name} 127.0.0.1 {master_port} 1");
    // The master is named first: a directive about it before its `monitor` line is refused.
    let watching = RedisServer::builder()
        .sentinel()
        .config("sentinel", &monitor);
    (directives.iter())
        .fold(watching, |b, line| b.config("sentinel", line))
        .start()
}

fn wait_for(limit: Duration, what: &str, ok: impl FnMut() -> bool) {
    crate::wait::wait_for_every(Duration::from_millis(50), limit, what, ok);
}
