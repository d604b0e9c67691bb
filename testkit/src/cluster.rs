//! A Redis Cluster on loopback: three masters and three replicas, all real `redis-server`
//! processes (`cluster-enabled yes`, the cluster's state file in each server's temp dir),
//! joined with `redis-cli --cluster create` and stopped by PID like every other test
//! server.

use std::process::Command;
use std::time::Duration;

use crate::server::RedisServer;
use crate::wait::wait_for;

/// How long a master may be unreachable before the others mark it failed.
const NODE_TIMEOUT_MS: u64 = 2000;
/// How long the cluster may take to form or to settle after a change.
const SETTLE: Duration = Duration::from_secs(30);

/// Three masters (with the slots split evenly at start) and a replica for each.
pub struct Cluster {
    /// Every server; the first three are the masters at start.
    pub servers: Vec<RedisServer>,
}

impl Cluster {
    /// Starts six servers, joins them (`--cluster-replicas 1`) and waits until every node
    /// reports `cluster_state:ok` and every replica is in sync. Panics on failure.
    pub fn start() -> Cluster {
        let servers: Vec<RedisServer> = (0..6)
            .map(|_| {
                RedisServer::builder()
                    .config("cluster-enabled", "yes")
                    .config("cluster-config-file", "nodes.conf")
                    .config("cluster-node-timeout", &NODE_TIMEOUT_MS.to_string())
                    // A replica whose master is gone may be promoted however stale.
                    .config("cluster-replica-validity-factor", "0")
                    .start()
            })
            .collect();
        let mut cmd = Command::new("redis-cli");
        cmd.arg("--cluster").arg("create");
        for s in &servers {
            cmd.arg(format!("127.0.0.1:{}", s.port()));
        }
        cmd.args(["--cluster-replicas", "1", "--cluster-yes"]);
        let out = cmd.output().expect("run redis-cli --cluster create");
        assert!(
            out.status.success(),
            "redis-cli --cluster create failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let cluster = Cluster { servers };
        cluster.wait_ok();
        wait_for(SETTLE, "replicas in sync", || {
            cluster.servers.iter().all(|s| {
                let repl = info(s, "replication");
                repl.contains("role:master") || repl.contains("master_link_status:up")
            }) && cluster.masters().len() == 3
        });
        for s in &cluster.servers {
            s.reset_stats();
        }
        cluster
    }

    /// Waits until every running node reports `cluster_state:ok` and agrees on the
    /// owner of every slot.
    pub fn wait_ok(&self) {
        wait_for(SETTLE, "cluster_state:ok on every node", || {
            let running: Vec<&RedisServer> = self.running().collect();
            running
                .iter()
                .all(|s| info_cluster(s).contains("cluster_state:ok"))
                && running
                    .iter()
                    .map(|s| slot_owners(s))
                    .collect::<Vec<_>>()
                    .windows(2)
                    .all(|w| w[0] == w[1])
        });
    }

    fn running(&self) -> impl Iterator<Item = &RedisServer> {
        self.servers.iter().filter(|s| s.is_running())
    }

    /// URLs of every node (any of them is a seed).
    pub fn seed_urls(&self) -> Vec<String> {
        self.servers.iter().map(RedisServer::url).collect()
    }

    /// The running masters that serve slots, as their servers.
    pub fn masters(&self) -> Vec<&RedisServer> {
        self.running()
            .filter(|s| info(s, "replication").contains("role:master") && owns_slots(s))
            .collect()
    }

    /// The server listening on `port`.
    pub fn server(&self, port: u16) -> &RedisServer {
        self.servers
            .iter()
            .find(|s| s.port() == port)
            .unwrap_or_else(|| panic!("no server on port {port}"))
    }

    /// The hash slot of `key`, as the server computes it (`CLUSTER KEYSLOT`).
    pub fn keyslot(&self, key: &[u8]) -> u16 {
        let s = self.running().next().expect("a running node");
        redis::cmd("CLUSTER")
            .arg("KEYSLOT")
            .arg(key)
            .query(&mut s.conn())
            .expect("CLUSTER KEYSLOT")
    }

    /// The port of the master serving `slot`, as a running node sees it.
    pub fn owner(&self, slot: u16) -> u16 {
        let s = self.running().next().expect("a running node");
        slot_owners(s)
            .into_iter()
            .find(|(a, b, _)| (*a..=*b).contains(&slot))
            .map(|(_, _, port)| port)
            .unwrap_or_else(|| panic!("nobody serves slot {slot}"))
    }

    /// The port of a running master other than the one on port `not`.
    pub fn other_master(&self, not: u16) -> u16 {
        self.masters()
            .iter()
            .map(|m| m.port())
            .find(|p| *p != not)
            .expect("another master")
    }

    /// The master serving `key`, as a server.
    pub fn master_of(&self, key: &[u8]) -> &RedisServer {
        self.server(self.owner(self.keyslot(key)))
    }

    /// Moves `slot` and its keys to the master on port `to`: `IMPORTING` on the target,
    /// `MIGRATING` on the source, `MIGRATE` of every key, then `SETSLOT … NODE` on every
    /// master.
    pub fn move_slot(&self, slot: u16, to: u16) {
        let from = self.owner(slot);
        assert_ne!(from, to, "slot {slot} is on {to} already");
        let (src, dst) = (self.server(from), self.server(to));
        let (src_id, dst_id) = (node_id(src), node_id(dst));
        let mut sc = src.conn();
        let mut dc = dst.conn();
        let setslot = |c: &mut redis::Connection, how: &str, id: &str| {
            redis::cmd("CLUSTER")
                .arg("SETSLOT")
                .arg(slot)
                .arg(how)
                .arg(id)
                .query::<()>(c)
                .unwrap_or_else(|e| panic!("CLUSTER SETSLOT {slot} {how}: {e}"));
        };
        setslot(&mut dc, "IMPORTING", &src_id);
        setslot(&mut sc, "MIGRATING", &dst_id);
        loop {
            let keys: Vec<Vec<u8>> = redis::cmd("CLUSTER")
                .arg("GETKEYSINSLOT")
                .arg(slot)
                .arg(100)
                .query(&mut sc)
                .expect("GETKEYSINSLOT");
            if keys.is_empty() {
                break;
            }
            redis::cmd("MIGRATE")
                .arg("127.0.0.1")
                .arg(to)
                .arg("")
                .arg(0)
                .arg(5000)
                .arg("REPLACE")
                .arg("KEYS")
                .arg(&keys)
                .query::<()>(&mut sc)
                .expect("MIGRATE");
        }
        setslot(&mut dc, "NODE", &dst_id);
        setslot(&mut sc, "NODE", &dst_id);
        for m in self.masters() {
            if m.port() != from && m.port() != to {
                setslot(&mut m.conn(), "NODE", &dst_id);
            }
        }
        self.wait_ok();
    }

    /// `CLUSTER FAILOVER` on a replica of the master on port `master`; waits until it
    /// is the master. Returns its port.
    pub fn failover(&self, master: u16) -> u16 {
        let replica = self.replica_of(master);
        redis::cmd("CLUSTER")
            .arg("FAILOVER")
            .query::<()>(&mut replica.conn())
            .expect("CLUSTER FAILOVER");
        let port = replica.port();
        wait_for(SETTLE, "the replica promoted", || {
            info(replica, "replication").contains("role:master")
        });
        self.wait_ok();
        port
    }

    /// Kills the master on port `master` (SIGKILL) and waits until its replica took over
    /// and the cluster is ok again. Returns the new master's port.
    pub fn kill_master(&self, master: u16) -> u16 {
        let replica = self.replica_of(master);
        self.server(master).kill();
        wait_for(SETTLE, "the replica promoted", || {
            info(replica, "replication").contains("role:master")
        });
        self.wait_ok();
        replica.port()
    }

    /// A running replica of the master on port `master`.
    pub fn replica_of(&self, master: u16) -> &RedisServer {
        self.running()
            .find(|s| {
                let repl = info(s, "replication");
                repl.contains("role:slave") && repl.contains(&format!("master_port:{master}\r"))
            })
            .unwrap_or_else(|| panic!("no replica of {master}"))
    }
}

/// `CLUSTER MYID`.
pub fn node_id(s: &RedisServer) -> String {
    redis::cmd("CLUSTER")
        .arg("MYID")
        .query(&mut s.conn())
        .expect("CLUSTER MYID")
}

fn info(s: &RedisServer, section: &str) -> String {
    redis::cmd("INFO")
        .arg(section)
        .query(&mut s.conn())
        .unwrap_or_default()
}

fn info_cluster(s: &RedisServer) -> String {
    redis::cmd("CLUSTER")
        .arg("INFO")
        .query(&mut s.conn())
        .unwrap_or_default()
}

/// `(first slot, last slot, master port)` for every range, as `s` sees them.
fn slot_owners(s: &RedisServer) -> Vec<(u16, u16, u16)> {
    let v: Vec<redis::Value> = redis::cmd("CLUSTER")
        .arg("SLOTS")
        .query(&mut s.conn())
        .unwrap_or_default();
    let mut out: Vec<(u16, u16, u16)> = v
        .into_iter()
        .filter_map(|r| {
            let redis::Value::Array(r) = r else {
                return None;
            };
            let a: u16 = redis::from_redis_value(r.first()?.clone()).ok()?;
            let b: u16 = redis::from_redis_value(r.get(1)?.clone()).ok()?;
            let redis::Value::Array(m) = r.get(2)? else {
                return None;
            };
            let port: u16 = redis::from_redis_value(m.get(1)?.clone()).ok()?;
            Some((a, b, port))
        })
        .collect();
    out.sort_unstable();
    out
}

fn owns_slots(s: &RedisServer) -> bool {
    slot_owners(s).iter().any(|(_, _, port)| *port == s.port())
}
