//! The engine's shared state: what the client façade, the guards and the contest loop
//! share, and how it starts.

use std::sync::Arc;
use std::time::Instant;

use crate::config::{Config, Wakeup};
use crate::engine::cleanup::Cleanup;
use crate::engine::eviction;
use crate::engine::multi_marks::MultiMarks;
use crate::engine::subs::{Subs, Template};
use crate::engine::watchdog::Watchdog;
use crate::error::{Error, Result, thread_error};
use crate::local::shares::ReadShares;
use crate::local::table::Table;
use crate::proto::node::{Node, Retry};
use crate::stats::Counters;
use crate::topology::{Route, Topology};
use crate::wake::notify::{self, Mode};
use crate::wake::subscriber::Subscriber;

/// Everything a lock operation needs. Guards hold it too, so that a guard can always
/// release.
pub(crate) struct Engine {
    pub cfg: Config,
    pub topology: Arc<Topology>,
    /// One per node with `Wakeup::Notifications` (Redis Cluster: per master, started as
    /// waiters need them); none when polling.
    pub subs: Subs,
    pub table: Table,
    pub counters: Arc<Counters>,
    pub watchdog: Option<Watchdog>,
    /// [`Engine::shutdown`] was called: no new hold is taken.
    pub shut_down: std::sync::atomic::AtomicBool,
    /// Read holds shared by this process's readers.
    pub shares: ReadShares,
    /// Releases nobody waits for (after an ambiguous failure, or a panic).
    pub cleanup: Cleanup,
    /// The multi-locks that wait with contention marks, by mark.
    pub multi_marks: MultiMarks,
}

impl Engine {
    /// Opens the topology, checks its nodes and starts the background threads.
    pub fn start(cfg: Config) -> Result<Self> {
        let counters = Arc::new(Counters::default());
        let client_id: Arc<str> = uuid::Uuid::new_v4().simple().to_string().into();
        let topology = Arc::new(Topology::open(&cfg, &counters, &client_id)?);
        let notifications = cfg.wakeup == Wakeup::Notifications;
        let nodes = topology.nodes();
        let mut modes = Vec::with_capacity(nodes.len());
        let mut first_error = None;
        for node in nodes.iter() {
            match check_node(node, notifications, cfg.configure_notifications) {
                Ok(mode) => modes.push(Some(mode)),
                Err(e) => {
                    log::warn!("node {}: unreachable at start: {e}", node.id);
                    first_error.get_or_insert(e);
                    modes.push(None);
                }
            }
        }
        let reachable = modes.iter().filter(|m| m.is_some()).count();
        if reachable < topology.quorum() {
            return Err(first_error.expect("an unreachable node left its error"));
        }
        if matches!(*topology, Topology::Redlock(_)) {
            let answered = nodes.iter().zip(&modes).filter(|(_, m)| m.is_some());
            distinct_servers(answered.map(|(n, _)| n))?;
        }
        let subs = Subs::new(
            notifications.then(|| Template {
                configure: cfg.configure_notifications,
                prefix: cfg.key_prefix.clone(),
                client_id: client_id.to_string(),
            }),
            counters.clone(),
        );
        for (node, mode) in nodes.iter().zip(&modes) {
            let keyspace = match mode {
                Some(Mode::Keyspace) => true,
                Some(Mode::Fallback(why)) => {
                    if notifications {
                        log::warn!(
                            "node {}: keyspace notifications unavailable: {why}; waiters are woken by the library's release channel instead",
                            node.id
                        );
                    }
                    false
                }
                None => true,
            };
            if notifications {
                subs.start(node, keyspace)?;
            }
        }
        // Also with renewals off: it tells holders when their lease runs out.
        let watchdog = Watchdog::start(cfg.clone(), Arc::downgrade(&topology), counters.clone())
            .map_err(|e| thread_error("watchdog", e))?;
        let cleanup = Cleanup::new(
            Arc::downgrade(&topology),
            counters.clone(),
            cfg.lease,
            cfg.key_prefix.clone(),
        );
        Ok(Engine {
            cleanup,
            cfg,
            topology,
            subs,
            table: Table::default(),
            counters,
            watchdog: Some(watchdog),
            shut_down: std::sync::atomic::AtomicBool::new(false),
            shares: ReadShares::default(),
            multi_marks: MultiMarks::default(),
        })
    }

    /// The subscribers of the nodes of `route` (started now for a node that has none).
    pub fn subs_for(&self, route: &Route) -> Arc<[Arc<Subscriber>]> {
        self.subs.for_route(route)
    }

    /// Stops the background threads and waits for them until `deadline`; `false` if one
    /// is still running then.
    pub fn shutdown(&self, deadline: Instant) -> bool {
        self.shut_down
            .store(true, std::sync::atomic::Ordering::Relaxed);
        let mut all = self.subs.shutdown(deadline);
        if let Some(w) = &self.watchdog {
            all &= w.shutdown(deadline);
        }
        all &= self.cleanup.shutdown(deadline);
        all &= self.topology.shutdown(deadline);
        all
    }
}

/// Redlock's nodes must be distinct servers: one reached under two addresses (an IP and a
/// host name, say) would grant a majority alone, and its restart without data would let a
/// second holder in. Both addresses answer with the server's run id. A node that refuses
/// `INFO` is not compared.
fn distinct_servers<'a>(nodes: impl Iterator<Item = &'a Arc<Node>>) -> Result<()> {
    let mut seen: Vec<(&Node, String)> = Vec::new();
    for node in nodes {
        let info = node.run(Retry::NEVER, |conn| {
            redis::cmd("INFO").arg("server").query::<String>(conn)
        });
        let run_id = info.ok().and_then(|info| {
            let line = info.lines().find_map(|l| l.strip_prefix("run_id:"));
            line.map(|id| id.trim().to_owned())
        });
        let Some(run_id) = run_id else { continue };
        if let Some((first, _)) = seen.iter().find(|(_, id)| *id == run_id) {
            return Err(Error::InvalidConfig(format!(
                "nodes {} and {} name one server twice (one run id): Redlock needs distinct servers",
                first.id, node.id
            )));
        }
        seen.push((node, run_id));
    }
    Ok(())
}

/// Connects to a node once at start: proves it reachable and, when waiters are to be woken
/// by notifications, checks (and maybe turns on) the node's keyspace notifications. Warns
/// when the node may evict lock keys (read in the same `CONFIG GET` when it can be).
fn check_node(node: &Node, notifications: bool, configure: bool) -> Result<Mode> {
    let (mode, memory) = if notifications {
        node.run(Retry::NEVER, |conn| {
            notify::ensure_reading(conn, configure, &eviction::SETTINGS)
        })?
    } else {
        node.run(Retry::NEVER, |conn| redis::cmd("PING").query::<()>(conn))?;
        let memory = node.run(Retry::NEVER, |conn| Ok(eviction::read(&node.id, conn)));
        (Mode::Keyspace, memory.unwrap_or_default())
    };
    eviction::warn_if_risky(&node.id, &memory);
    Ok(mode)
}
