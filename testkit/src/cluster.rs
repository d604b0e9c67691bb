//! A Redis Cluster on loopback: three masters and three replicas, all real `redis-server`
//! processes (`cluster-enabled yes`, the cluster's state file in each server's temp dir),
//! joined with `redis-cli --cluster create` and stopped by PID like every other test
//! server.
//!
//! [`Cluster::start`] starts an open cluster. [`Cluster::builder`] can secure it the way
//! a production cluster is secured:
//!
//! * **TLS** ([`ClusterBuilder::tls`]): every node has a `tls-port` with a certificate of
//!   the [`Certs`] CA, `tls-cluster yes` (the cluster bus speaks TLS, so the slot map and
//!   redirects that TLS clients get name the TLS ports), `tls-replication yes` (replicas
//!   sync over TLS) and `tls-auth-clients yes` (every client shows a certificate of the
//!   CA; nodes show the client pair, `tls-client-cert-file`, on their own connections to
//!   each other). The plain `port` stays open on loopback for the harness alone (its admin
//!   connection, [`RedisServer::conn`], stats), as for [`TlsServer`](crate::tls::TlsServer):
//!   tests check that the library never uses it ([`Cluster::tls_port`]). A production
//!   node would have `port 0`.
//! * **ACL** ([`ClusterBuilder::acl_user`]): `user default off` (no anonymous access), the
//!   application's user with [`APP_ACL`] and nothing more, [`ADMIN_USER`] with every
//!   permission for the harness and `redis-cli --cluster create`, and [`REPLICA_USER`]
//!   with only what a replica needs to sync (`masteruser`/`masterauth`). A cluster does not
//!   share ACLs between its nodes: every node gets the same `user` lines. The servers'
//!   config turns on the keyspace notifications the library needs
//!   (`notify-keyspace-events Kg$xe`), since the application user may only read the
//!   setting, not change it.

use std::process::Command;
use std::time::Duration;

use crate::server::{RedisServer, RedisServerBuilder};
use crate::tls::Certs;
use crate::wait::{wait_for, wait_until};

/// How long a master may be unreachable before the others mark it failed.
const NODE_TIMEOUT_MS: u64 = 2000;
/// How long the cluster may take to form or to settle after a change.
const SETTLE: Duration = Duration::from_secs(30);

/// The harness's user on an ACL cluster: every permission.
pub const ADMIN_USER: &str = "admin";
const ADMIN_PASSWORD: &str = "admin-secret";
/// The user replicas log in as on an ACL cluster: only what replication needs.
pub const REPLICA_USER: &str = "replica";
const REPLICA_PASSWORD: &str = "replica-secret";

/// What a `redbaton` client (default prefix `redbaton:`) needs on a Redis 7 cluster node,
/// and nothing more: the single-node minimum (keys and channels under the prefix, the
/// scripts and the commands they run, the subscriber's commands, `CONFIG GET` to read the
/// notification setting, the shard channel commands of Redis 7) plus the cluster's own: `CLUSTER SHARDS` (or `CLUSTER SLOTS` on
/// older servers) to read the slot map, and `ASKING` to follow an `ASK` redirect during a
/// slot migration. `+wait` would be needed for `replica_ack`.
pub const APP_ACL: &str = "resetkeys ~redbaton:* resetchannels &redbaton:* &__keyspace@* \
     -@all +evalsha +script|load +get +set +del +pexpire +pttl +incr +publish \
     +exists +time +zadd +zrem +zrange +zrangebyscore +zcard +zcount +zscore +zmscore \
     +zremrangebyscore +type +scan +subscribe +unsubscribe +ping +client|setname +config|get \
     +spublish +ssubscribe +sunsubscribe +cluster|shards +cluster|slots +asking";

/// Three masters (with the slots split evenly at start) and a replica for each.
pub struct Cluster {
    /// Every server; the first three are the masters at start.
    pub servers: Vec<RedisServer>,
    /// Per server (same order), its TLS port; empty without TLS.
    tls_ports: Vec<u16>,
    /// The certificates of a TLS cluster, kept while the servers read them.
    certs: Option<Certs>,
    /// The application user of an ACL cluster and its password.
    app_user: Option<(String, String)>,
}

/// Options of a [`Cluster`]; obtain with [`Cluster::builder`].
#[derive(Default)]
pub struct ClusterBuilder {
    tls: Option<Certs>,
    app_user: Option<(String, String)>,
}

impl ClusterBuilder {
    /// Clients reach the cluster over TLS only, with certificates of `certs`' CA (see the
    /// module docs).
    pub fn tls(mut self, certs: Certs) -> Self {
        self.tls = Some(certs);
        self
    }

    /// `default` is off and `user` (with `password`) has [`APP_ACL`] (see the module
    /// docs).
    pub fn acl_user(mut self, user: &str, password: &str) -> Self {
        self.app_user = Some((user.to_owned(), password.to_owned()));
        self
    }

    /// Starts six servers, joins them (`--cluster-replicas 1`) and waits until every node
    /// reports `cluster_state:ok` and every replica is in sync. Panics on failure.
    pub fn start(self) -> Cluster {
        let servers: Vec<RedisServer> = (0..6)
            .map(|_| {
                let b = match &self.tls {
                    Some(certs) => tls_node(certs),
                    None => RedisServer::builder(),
                };
                let mut b = b
                    .config("cluster-enabled", "yes")
                    .config("cluster-config-file", "nodes.conf")
                    .config("cluster-node-timeout", &NODE_TIMEOUT_MS.to_string())
                    // A replica whose master is gone may be promoted however stale.
                    .config("cluster-replica-validity-factor", "0");
                if let Some((user, password)) = &self.app_user {
                    b = acl_config(b, user, password);
                }
                b.start()
            })
            .collect();
        let tls_ports: Vec<u16> = servers
            .iter()
            .filter_map(|s| s.port_of("tls-port"))
            .collect();
        let cli = match &self.tls {
            Some(_) => crate::binaries::tls_bins().1,
            None => crate::binaries::cli_bin(),
        };
        let mut cmd = Command::new(cli);
        if let Some(certs) = &self.tls {
            cmd.arg("--tls")
                .args(["--cacert", &certs.file("ca.pem")])
                .args(["--cert", &certs.file("client.pem")])
                .args(["--key", &certs.file("client.key")]);
        }
        if self.app_user.is_some() {
            cmd.args([
                "--user",
                ADMIN_USER,
                "--pass",
                ADMIN_PASSWORD,
                "--no-auth-warning",
            ]);
        }
        cmd.arg("--cluster").arg("create");
        for (i, s) in servers.iter().enumerate() {
            let port = tls_ports.get(i).copied().unwrap_or(s.port());
            cmd.arg(format!("127.0.0.1:{port}"));
        }
        cmd.args(["--cluster-replicas", "1", "--cluster-yes"]);
        let out = cmd.output().expect("run redis-cli --cluster create");
        assert!(
            out.status.success(),
            "redis-cli --cluster create failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let cluster = Cluster {
            servers,
            tls_ports,
            certs: self.tls,
            app_user: self.app_user,
        };
        cluster.wait_ok();
        wait_for(SETTLE, "replicas in sync", || {
            cluster.servers.iter().all(|s| {
                let repl = s.info("replication");
                repl.contains("role:master") || repl.contains("master_link_status:up")
            }) && cluster.masters().len() == 3
        });
        for s in &cluster.servers {
            s.reset_stats();
        }
        cluster
    }
}

/// A node that speaks TLS on a port of its own, to clients, to the other nodes and to its
/// replicas, and wants a certificate of the CA from each of them.
fn tls_node(certs: &Certs) -> RedisServerBuilder {
    certs
        .server()
        .config("tls-client-cert-file", &certs.file("client.pem"))
        .config("tls-client-key-file", &certs.file("client.key"))
        .config("tls-auth-clients", "yes")
        .config("tls-cluster", "yes")
        .config("tls-replication", "yes")
}

/// No anonymous access; the application user with [`APP_ACL`], the harness's admin, and
/// the replication user that replicas log in as.
fn acl_config(b: RedisServerBuilder, user: &str, password: &str) -> RedisServerBuilder {
    b.config(
        "user",
        &format!("{ADMIN_USER} on >{ADMIN_PASSWORD} ~* &* +@all"),
    )
    .config(
        "user",
        &format!("{REPLICA_USER} on >{REPLICA_PASSWORD} +psync +replconf +ping"),
    )
    .acl_user(user, password, APP_ACL)
    .config("user", "default off")
    .config("masteruser", REPLICA_USER)
    .config("masterauth", REPLICA_PASSWORD)
    .config("notify-keyspace-events", "Kg$xe")
    .admin_auth(ADMIN_USER, ADMIN_PASSWORD)
}

impl Cluster {
    /// Starts an open cluster (no TLS, no ACL): see [`ClusterBuilder::start`].
    pub fn start() -> Cluster {
        Self::builder().start()
    }

    /// Options for a secured cluster.
    pub fn builder() -> ClusterBuilder {
        ClusterBuilder::default()
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

    /// URLs of every node (any of them is a seed), as a client of this cluster gives
    /// them: `rediss://` on the TLS ports of a TLS cluster, with the application user's
    /// credentials on an ACL cluster.
    pub fn seed_urls(&self) -> Vec<String> {
        match &self.app_user {
            Some((user, password)) => self.seed_urls_as(user, password),
            None => self.urls(""),
        }
    }

    /// [`seed_urls`](Self::seed_urls) logging in as `user` with `password`.
    pub fn seed_urls_as(&self, user: &str, password: &str) -> Vec<String> {
        self.urls(&format!("{user}:{password}@"))
    }

    fn urls(&self, userinfo: &str) -> Vec<String> {
        let scheme = if self.certs.is_some() {
            "rediss"
        } else {
            "redis"
        };
        self.servers
            .iter()
            .map(|s| {
                format!(
                    "{scheme}://{userinfo}127.0.0.1:{}/",
                    self.client_port(s.port())
                )
            })
            .collect()
    }

    /// The certificates of a TLS cluster.
    pub fn certs(&self) -> Option<&Certs> {
        self.certs.as_ref()
    }

    /// The TLS port of the server whose plain port is `port` (TLS cluster only).
    pub fn tls_port(&self, port: u16) -> Option<u16> {
        let i = self.servers.iter().position(|s| s.port() == port)?;
        self.tls_ports.get(i).copied()
    }

    /// The port that clients, replicas and `MIGRATE` use to reach the server whose plain
    /// port is `port`: its TLS port on a TLS cluster.
    fn client_port(&self, port: u16) -> u16 {
        self.tls_port(port).unwrap_or(port)
    }

    /// The running masters that serve slots, as their servers.
    pub fn masters(&self) -> Vec<&RedisServer> {
        self.running()
            .filter(|s| s.info("replication").contains("role:master") && owns_slots(s))
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

    /// `want` names starting with `stem` whose lock keys (under `keys`' prefix) share
    /// one slot, found by asking the server for the slots of many candidates; and the
    /// slot.
    pub fn names_in_one_slot(
        &self,
        keys: &crate::keys::Keys,
        stem: &str,
        want: usize,
    ) -> (u16, Vec<String>) {
        let first = format!("{stem}0");
        let slot = self.keyslot(&keys.lock_bytes(first.as_bytes()));
        let mut names = vec![first];
        let mut conn = self.servers[0].conn();
        let mut start = 1;
        while names.len() < want {
            let candidates: Vec<String> = (start..start + 50_000)
                .map(|i| format!("{stem}{i}"))
                .collect();
            start += 50_000;
            let mut pipe = redis::pipe();
            for c in &candidates {
                pipe.cmd("CLUSTER").arg("KEYSLOT").arg(keys.lock(c));
            }
            let slots: Vec<u16> = pipe.query(&mut conn).expect("KEYSLOT");
            names.extend(
                candidates
                    .into_iter()
                    .zip(slots)
                    .filter(|(_, s)| *s == slot)
                    .map(|(c, _)| c),
            );
        }
        names.truncate(want);
        (slot, names)
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

    /// A name starting with `stem` whose lock key (under `keys`' prefix) is in another slot
    /// than `slot`, on the same master.
    pub fn name_beside(&self, keys: &crate::keys::Keys, stem: &str, slot: u16) -> String {
        let master = self.owner(slot);
        (0..)
            .map(|i| format!("{stem}{i}"))
            .find(|n| {
                let s = self.keyslot(&keys.lock_bytes(n.as_bytes()));
                s != slot && self.owner(s) == master
            })
            .expect("a name of another slot of the master")
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
        self.open_migration(slot, to).finish();
    }

    /// Starts moving `slot` to the master on port `to` and leaves it half-way, as a
    /// resharding tool does between its steps: `IMPORTING` on the target, `MIGRATING` on
    /// the source, and no key moved yet. [`Migration::migrate_keys`] moves the slot's
    /// keys; [`Migration::finish`] moves the rest and gives the slot to the target.
    pub fn open_migration(&self, slot: u16, to: u16) -> Migration<'_> {
        let from = self.owner(slot);
        assert_ne!(from, to, "slot {slot} is on {to} already");
        let migration = Migration {
            cluster: self,
            slot,
            from,
            to,
            src_id: node_id(self.server(from)),
            dst_id: node_id(self.server(to)),
        };
        migration.setslot(to, "IMPORTING", &migration.src_id);
        migration.setslot(from, "MIGRATING", &migration.dst_id);
        migration
    }

    /// `CLUSTER FAILOVER` on a replica of the master on port `master`; waits until it
    /// is the master. Returns its port.
    pub fn failover(&self, master: u16) -> u16 {
        let replica = self.replica_of(master);
        // A manual failover waits for the replica to catch up with its master: one whose
        // link is not up yet (a loaded machine, a cluster just made) may never.
        wait_for(SETTLE, "the replica's link to its master", || {
            replica
                .info("replication")
                .contains("master_link_status:up")
        });
        // The master ignores a replica's request to fail over until gossip has told it the
        // node is its replica; and a manual failover not done in 5 s is dropped without a
        // word. So the request is made again until the replica is the master.
        let (replica_id, promoted) = (node_id(replica), || {
            replica.info("replication").contains("role:master")
        });
        wait_for(SETTLE, "the master knowing its replica", || {
            let replicas: Vec<String> = redis::cmd("CLUSTER")
                .arg("REPLICAS")
                .arg(node_id(self.server(master)))
                .query(&mut self.server(master).conn())
                .unwrap_or_default();
            replicas.iter().any(|line| line.starts_with(&replica_id))
        });
        wait_for(SETTLE, "the replica promoted", || {
            redis::cmd("CLUSTER")
                .arg("FAILOVER")
                .query::<()>(&mut replica.conn())
                .expect("CLUSTER FAILOVER");
            wait_until(Duration::from_secs(7), promoted)
        });
        self.wait_ok();
        replica.port()
    }

    /// Waits until the replica of the master on port `master` has every write the master
    /// had when called: a test whose state must survive a killed master calls it first
    /// (replication is asynchronous, and a write not yet sent is lost with its master).
    pub fn wait_replicated(&self, master: u16) {
        let offset = |s: &RedisServer, field: &str| -> u64 {
            s.info("replication")
                .lines()
                .find_map(|l| l.trim().strip_prefix(field))
                .and_then(|v| v.parse().ok())
                .unwrap_or(0)
        };
        let written = offset(self.server(master), "master_repl_offset:");
        let replica = self.replica_of(master);
        wait_for(SETTLE, "the replica has the master's writes", || {
            offset(replica, "slave_repl_offset:") >= written
        });
    }

    /// Kills the master on port `master` (SIGKILL) and waits until its replica took over
    /// and the cluster is ok again. Returns the new master's port.
    pub fn kill_master(&self, master: u16) -> u16 {
        let replica = self.replica_of(master);
        self.server(master).kill();
        wait_for(SETTLE, "the replica promoted", || {
            replica.info("replication").contains("role:master")
        });
        self.wait_ok();
        replica.port()
    }

    /// Scale-out: a new empty master joins the cluster (`CLUSTER MEET`), as
    /// `redis-cli --cluster add-node` does; it serves no slot until one is moved to it
    /// ([`move_slot`](Self::move_slot)). Returns its port, a new address each time. An
    /// open cluster only (no TLS, no ACL).
    pub fn add_master(&mut self) -> u16 {
        assert!(
            self.certs.is_none() && self.app_user.is_none(),
            "add_master: an open cluster only"
        );
        let server = RedisServer::builder()
            .config("cluster-enabled", "yes")
            .config("cluster-config-file", "nodes.conf")
            .config("cluster-node-timeout", &NODE_TIMEOUT_MS.to_string())
            .start();
        let port = server.port();
        redis::cmd("CLUSTER")
            .arg("MEET")
            .arg("127.0.0.1")
            .arg(port)
            .query::<()>(&mut self.servers[0].conn())
            .expect("CLUSTER MEET");
        self.servers.push(server);
        let ids: Vec<String> = self.running().map(node_id).collect();
        wait_for(SETTLE, "every node knows every other", || {
            self.running().all(|s| {
                let nodes = cluster_nodes(s);
                ids.iter().all(|id| nodes.contains(id.as_str())) && !nodes.contains("handshake")
            })
        });
        self.wait_ok();
        port
    }

    /// Moves `slot`, the last one of its master, and its keys to the master on port `to`.
    /// The master that gives it away is told first: one that learns from the others that
    /// its last slot is gone turns into a replica of the node that took it (Redis 7 by
    /// default, as Redis 6.2 always does), and a replica refuses `SETSLOT`.
    pub fn empty_master(&self, slot: u16, to: u16) {
        let migration = self.open_migration(slot, to);
        migration.migrate_keys(None);
        let target = node_id(self.server(to));
        let setslot = |port: u16| {
            redis::cmd("CLUSTER")
                .arg("SETSLOT")
                .arg(slot)
                .arg("NODE")
                .arg(&target)
                .query::<()>(&mut self.server(port).conn())
        };
        setslot(migration.from).expect("SETSLOT NODE on the master giving its last slot away");
        for m in self.masters() {
            setslot(m.port()).expect("SETSLOT NODE on a master");
        }
        self.wait_ok();
    }

    /// Scale-in: the master on `port`, emptied of its slots, is forgotten by every other
    /// node (`CLUSTER FORGET`, as `redis-cli --cluster del-node` does); it still runs.
    pub fn forget_master(&self, port: u16) {
        assert!(
            !self.masters().iter().any(|m| m.port() == port),
            "{port} serves no slot"
        );
        let id = node_id(self.server(port));
        for s in self.running().filter(|s| s.port() != port) {
            redis::cmd("CLUSTER")
                .arg("FORGET")
                .arg(&id)
                .query::<()>(&mut s.conn())
                .unwrap_or_else(|e| panic!("CLUSTER FORGET on {}: {e}", s.port()));
        }
        wait_for(SETTLE, "every other node forgot it", || {
            self.running()
                .filter(|s| s.port() != port)
                .all(|s| !cluster_nodes(s).contains(id.as_str()))
        });
    }

    /// Scale-in, whole: `slot`, the last of the master on port `port`, moved to the master
    /// on port `to` ([`empty_master`](Self::empty_master)), then that master forgotten
    /// ([`forget_master`](Self::forget_master)) and stopped.
    pub fn remove_master(&self, slot: u16, to: u16, port: u16) {
        self.empty_master(slot, to);
        self.forget_master(port);
        self.server(port).kill();
    }

    /// A running replica of the master on port `master`.
    pub fn replica_of(&self, master: u16) -> &RedisServer {
        // A replica of a TLS cluster names its master's TLS port.
        let port = self.client_port(master);
        self.running()
            .find(|s| {
                let repl = s.info("replication");
                repl.contains("role:slave") && repl.contains(&format!("master_port:{port}\r"))
            })
            .unwrap_or_else(|| panic!("no replica of {master}"))
    }
}

/// A slot half-way between two masters (see [`Cluster::open_migration`]).
pub struct Migration<'a> {
    cluster: &'a Cluster,
    /// The slot being moved.
    pub slot: u16,
    /// The port of the master that owned it.
    pub from: u16,
    /// The port of the master it moves to.
    pub to: u16,
    src_id: String,
    dst_id: String,
}

impl Migration<'_> {
    fn setslot(&self, port: u16, how: &str, id: &str) {
        redis::cmd("CLUSTER")
            .arg("SETSLOT")
            .arg(self.slot)
            .arg(how)
            .arg(id)
            .query::<()>(&mut self.cluster.server(port).conn())
            .unwrap_or_else(|e| panic!("CLUSTER SETSLOT {} {how}: {e}", self.slot));
    }

    /// `MIGRATE`s the slot's keys still on the source to the target (every one of them,
    /// or those named in `only`). Returns how many moved.
    pub fn migrate_keys(&self, only: Option<&[&[u8]]>) -> usize {
        let cluster = self.cluster;
        let mut sc = cluster.server(self.from).conn();
        let mut moved = 0;
        loop {
            let mut keys: Vec<Vec<u8>> = redis::cmd("CLUSTER")
                .arg("GETKEYSINSLOT")
                .arg(self.slot)
                .arg(100)
                .query(&mut sc)
                .expect("GETKEYSINSLOT");
            if let Some(only) = only {
                keys.retain(|k| only.contains(&k.as_slice()));
            }
            if keys.is_empty() {
                return moved;
            }
            let mut migrate = redis::cmd("MIGRATE");
            migrate
                .arg("127.0.0.1")
                .arg(cluster.client_port(self.to))
                .arg("")
                .arg(0)
                .arg(5000)
                .arg("REPLACE");
            if cluster.app_user.is_some() {
                migrate.arg("AUTH2").arg(ADMIN_USER).arg(ADMIN_PASSWORD);
            }
            migrate
                .arg("KEYS")
                .arg(&keys)
                .query::<()>(&mut sc)
                .expect("MIGRATE");
            moved += keys.len();
        }
    }

    /// Moves the keys left on the source, then `SETSLOT … NODE` on the target, the source
    /// and every other master, and waits until the cluster agrees.
    pub fn finish(self) {
        self.migrate_keys(None);
        self.setslot(self.to, "NODE", &self.dst_id);
        self.setslot(self.from, "NODE", &self.dst_id);
        for m in self.cluster.masters() {
            if m.port() != self.from && m.port() != self.to {
                self.setslot(m.port(), "NODE", &self.dst_id);
            }
        }
        self.cluster.wait_ok();
    }
}

/// `CLUSTER MYID`.
pub fn node_id(s: &RedisServer) -> String {
    redis::cmd("CLUSTER")
        .arg("MYID")
        .query(&mut s.conn())
        .expect("CLUSTER MYID")
}

/// `CLUSTER NODES` as `s` sees it.
fn cluster_nodes(s: &RedisServer) -> String {
    redis::cmd("CLUSTER")
        .arg("NODES")
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

/// The port that `server` says serves `slot` (`CLUSTER SLOTS`): the master's own, or the
/// one it announces.
pub fn slot_port(server: &RedisServer, slot: u16) -> Option<u16> {
    slot_owners(server)
        .into_iter()
        .find(|(a, b, _)| (*a..=*b).contains(&slot))
        .map(|(_, _, port)| port)
}

/// Whether the server can change the port a master announces while it runs
/// (`CONFIG SET cluster-announce-port`, Redis 7 on), which tests that put a proxy in
/// front of a master need; when not, says so for `test`, which is then not checked.
pub fn announces_ports_at_runtime(test: &str) -> bool {
    let version = crate::binaries::server_version().expect("server version");
    let yes = version.at_least(7, 0);
    if !yes {
        eprintln!("{test}: {version} cannot announce a master's port at runtime: not checked");
    }
    yes
}

fn owns_slots(s: &RedisServer) -> bool {
    slot_owners(s).iter().any(|(_, _, port)| *port == s.port())
}
