//! The Redis the tool measures: its own throwaway `redis-server` unless `--url` names one,
//! and the parent's admin connection to it (command counters, clean-up).

use std::collections::HashMap;
use std::time::Duration;

use redbaton_testkit::server::{self, RedisServer};

use crate::Res;

/// The Redis to measure: `url` when given, otherwise a throwaway `redis-server` (no
/// persistence, temp dir, free 127.0.0.1 port), returned too so that the caller keeps it
/// running until the end.
pub fn redis_for(url: Option<&str>) -> (String, Option<RedisServer>) {
    match url {
        Some(url) => (url.to_owned(), None),
        None => {
            let server = RedisServer::start();
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

/// Deletes every key under `prefix` (counters, fence counters).
pub fn cleanup(admin: &mut redis::Connection, prefix: &str) -> Res<()> {
    let pattern = format!("{prefix}*");
    let mut cursor = 0u64;
    loop {
        let (next, keys): (u64, Vec<Vec<u8>>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(&pattern)
            .arg("COUNT")
            .arg(1000)
            .query(admin)?;
        if !keys.is_empty() {
            redis::cmd("DEL").arg(keys).query::<()>(admin)?;
        }
        if next == 0 {
            return Ok(());
        }
        cursor = next;
    }
}
