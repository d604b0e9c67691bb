//! The Redis the tool measures: its own throwaway `redis-server` unless `--url` names one
//! (or, with `--cluster`, a throwaway Redis Cluster and a server for the counters), and
//! the parent's admin connections to them (command counters, clean-up).

use std::collections::HashMap;
use std::time::Duration;

use redbaton_testkit::cluster::Cluster;
use redbaton_testkit::server::{self, RedisServer};

use crate::Res;
use crate::measure::{net_commands, net_commands_nodes};
use crate::results::Commands;

/// Where the locks of a run live, where its counters live, and how its commands are
/// counted.
pub struct Lab {
    /// The locks' Redis: the node, or the cluster's seed.
    pub url: String,
    pub cluster: bool,
    /// The counters' server when it is not `url`.
    pub counter_url: Option<String>,
    /// For headers: what was measured.
    pub desc: String,
    pub meter: Meter,
    /// Throwaway servers, stopped when the lab is dropped.
    _server: Option<RedisServer>,
    _replica: Option<RedisServer>,
    _cluster: Option<Cluster>,
}

impl Lab {
    /// The tool's historical setup: locks and counters on `url`, or on a throwaway server.
    pub fn shared(url: Option<&str>) -> Lab {
        let (url, server) = redis_for(url);
        Lab {
            desc: url.clone(),
            url,
            cluster: false,
            counter_url: None,
            meter: Meter::Shared,
            _server: server,
            _replica: None,
            _cluster: None,
        }
    }

    /// A throwaway node that holds only locks (with `replica`, and a replica of it, whose
    /// commands are counted as a cluster's replicas are); counters on `counter_url`.
    pub fn lone_node(counter_url: &str, replica: bool) -> Res<Lab> {
        let server = redbaton_testkit::start_or_exit();
        let url = server.url();
        let mut nodes = vec![MeteredNode {
            conn: raw_conn(&url)?,
            replica: false,
        }];
        let replica = replica.then(|| server.start_replica());
        if let Some(r) = &replica {
            nodes.push(MeteredNode {
                conn: raw_conn(&r.url())?,
                replica: true,
            });
        }
        Ok(Lab {
            desc: format!(
                "one node {url}{} (counters on {counter_url})",
                if replica.is_some() {
                    " + a replica"
                } else {
                    ""
                }
            ),
            meter: Meter::Nodes(nodes),
            url,
            cluster: false,
            counter_url: Some(counter_url.to_owned()),
            _server: Some(server),
            _replica: replica,
            _cluster: None,
        })
    }

    /// A throwaway Redis Cluster on loopback (3 masters + 3 replicas) that holds only
    /// locks; counters on `counter_url`.
    pub fn cluster(counter_url: &str) -> Res<Lab> {
        let cluster = Cluster::start();
        let masters: Vec<u16> = cluster.masters().iter().map(|m| m.port()).collect();
        let nodes = cluster
            .servers
            .iter()
            .map(|n| {
                Ok(MeteredNode {
                    conn: raw_conn(&n.url())?,
                    replica: !masters.contains(&n.port()),
                })
            })
            .collect::<Res<Vec<_>>>()?;
        let url = cluster.servers[0].url();
        Ok(Lab {
            desc: format!(
                "Redis Cluster of {} masters + {} replicas, seed {url} (counters on {counter_url})",
                masters.len(),
                nodes.len() - masters.len()
            ),
            url,
            cluster: true,
            counter_url: Some(counter_url.to_owned()),
            meter: Meter::Nodes(nodes),
            _server: None,
            _replica: None,
            _cluster: Some(cluster),
        })
    }
}

/// A node whose command counters are read.
pub struct MeteredNode {
    pub conn: redis::Connection,
    pub replica: bool,
}

/// Where the lock's commands are counted.
pub enum Meter {
    /// On the one server that holds locks and counters (the admin connection's): its
    /// counters, minus the counters' GET + SET and the tool's INFO.
    Shared,
    /// On servers that hold only locks (one node, or every node of a cluster, replicas
    /// included): their counters summed, without housekeeping (see
    /// [`crate::measure::HOUSEKEEPING`]).
    Nodes(Vec<MeteredNode>),
}

/// One reading of the measured servers' `INFO commandstats`, one map per server.
pub type Reading = Vec<HashMap<String, u64>>;

impl Meter {
    /// `CONFIG RESETSTAT` on every measured server (best effort, as before).
    pub fn reset(&mut self, admin: &mut redis::Connection) {
        for conn in self.conns(admin) {
            let _ = redis::cmd("CONFIG").arg("RESETSTAT").query::<()>(conn);
        }
    }

    pub fn read(&mut self, admin: &mut redis::Connection) -> Res<Reading> {
        self.conns(admin).map(commandstats).collect()
    }

    /// The lock's commands between two readings, over `sections` critical sections.
    pub fn net(&self, before: &Reading, after: &Reading, sections: u64) -> Commands {
        match self {
            Meter::Shared => net_commands(&before[0], &after[0], sections),
            Meter::Nodes(nodes) => {
                let replica: Vec<bool> = nodes.iter().map(|n| n.replica).collect();
                net_commands_nodes(before, after, &replica, sections)
            }
        }
    }

    /// Deletes the lock's keys under `prefix` from the lock-only servers (the masters);
    /// with `Shared`, the caller's clean-up of the admin server does it.
    pub fn cleanup(&mut self, prefix: &str) -> Res<()> {
        if let Meter::Nodes(nodes) = self {
            for n in nodes.iter_mut().filter(|n| !n.replica) {
                cleanup_each(&mut n.conn, prefix)?;
            }
        }
        Ok(())
    }

    fn conns<'a>(
        &'a mut self,
        admin: &'a mut redis::Connection,
    ) -> Box<dyn Iterator<Item = &'a mut redis::Connection> + 'a> {
        match self {
            Meter::Shared => Box::new(std::iter::once(admin)),
            Meter::Nodes(nodes) => Box::new(nodes.iter_mut().map(|n| &mut n.conn)),
        }
    }
}

/// The Redis to measure: `url` when given, otherwise a throwaway `redis-server` (no
/// persistence, temp dir, free 127.0.0.1 port), returned too so that the caller keeps it
/// running until the end.
pub fn redis_for(url: Option<&str>) -> (String, Option<RedisServer>) {
    match url {
        Some(url) => (url.to_owned(), None),
        None => {
            let server = redbaton_testkit::start_or_exit();
            (server.url(), Some(server))
        }
    }
}

pub fn raw_conn(url: &str) -> Res<redis::Connection> {
    let conn = redis::Client::open(url)?
        .get_connection_with_timeout(Duration::from_secs(5))
        .map_err(|e| format!("cannot connect to {url}: {e}"))?;
    conn.set_read_timeout(Some(Duration::from_secs(30)))?;
    conn.set_write_timeout(Some(Duration::from_secs(30)))?;
    Ok(conn)
}

pub fn commandstats(admin: &mut redis::Connection) -> Res<HashMap<String, u64>> {
    let text: String = redis::cmd("INFO").arg("commandstats").query(admin)?;
    Ok(server::parse_commandstats(&text))
}

/// Deletes every key under `prefix` on a cluster node, one `DEL` per key (keys of
/// different slots cannot share one).
fn cleanup_each(conn: &mut redis::Connection, prefix: &str) -> Res<()> {
    delete_matching(conn, prefix, true)
}

/// Deletes every key under `prefix` (counters, fence counters).
pub fn cleanup(admin: &mut redis::Connection, prefix: &str) -> Res<()> {
    delete_matching(admin, prefix, false)
}

/// `SCAN`s for the keys under `prefix` and deletes them, a batch per `DEL` or, when
/// `one_by_one`, a `DEL` per key.
fn delete_matching(conn: &mut redis::Connection, prefix: &str, one_by_one: bool) -> Res<()> {
    let pattern = format!("{prefix}*");
    let mut cursor = 0u64;
    loop {
        let (next, keys): (u64, Vec<Vec<u8>>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(&pattern)
            .arg("COUNT")
            .arg(1000)
            .query(conn)?;
        if one_by_one {
            for key in keys {
                redis::cmd("DEL").arg(key).query::<()>(conn)?;
            }
        } else if !keys.is_empty() {
            redis::cmd("DEL").arg(keys).query::<()>(conn)?;
        }
        if next == 0 {
            return Ok(());
        }
        cursor = next;
    }
}
