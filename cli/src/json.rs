//! The JSON form of a name: one object, on one line.

use std::time::Duration;

use redbaton::{LockInfo, LockKind};
use serde::Serialize;

use crate::describe::{hold_name, kind_name, ttl};
use crate::name::escape;

/// The JSON form of one name.
#[derive(Serialize)]
struct Json {
    /// The name in the escaped form that NAME arguments take back.
    name: String,
    node: String,
    kind: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    permits: Option<u32>,
    /// A foreign key's Redis type.
    #[serde(skip_serializing_if = "Option::is_none")]
    redis_type: Option<String>,
    fence: Option<u64>,
    /// The lock's lease left (shared kinds: the longest live hold's), in ms.
    ttl_ms: Option<u64>,
    holders: Vec<JsonHolder>,
    queue: Vec<JsonWaiter>,
    waiting_writers: usize,
    waiting_readers: usize,
    contention_ms: Option<u64>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    nodes: Vec<Json>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    unreachable: Vec<String>,
}

#[derive(Serialize)]
struct JsonHolder {
    kind: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    fence: Option<u64>,
    /// Lease left in ms; null when expired (or, for a lock, no expiry).
    ttl_ms: Option<u64>,
    expired: bool,
    mine: bool,
}

#[derive(Serialize)]
struct JsonWaiter {
    age_ms: u64,
    /// Until the entry expires, in ms; null when expired.
    ttl_ms: Option<u64>,
}

fn ms(d: Option<Duration>) -> Option<u64> {
    d.map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

fn to_json(info: &LockInfo) -> Json {
    let mut holders: Vec<JsonHolder> = info
        .holder
        .iter()
        .map(|h| JsonHolder {
            kind: "lock",
            fence: h.fence,
            ttl_ms: ms(h.lease_left),
            expired: false,
            mine: h.mine,
        })
        .collect();
    holders.extend(info.holds.iter().map(|h| JsonHolder {
        kind: hold_name(h.kind),
        fence: None,
        ttl_ms: ms(h.lease_left),
        expired: h.lease_left.is_none(),
        mine: h.mine,
    }));
    Json {
        name: escape(&info.name),
        node: info.node.clone(),
        kind: match info.kind {
            LockKind::Semaphore { .. } => "semaphore".to_owned(),
            LockKind::Foreign { .. } => "foreign".to_owned(),
            ref k => kind_name(k),
        },
        permits: match info.kind {
            LockKind::Semaphore { permits } => Some(permits),
            _ => None,
        },
        redis_type: match &info.kind {
            LockKind::Foreign { redis_type } => Some(redis_type.clone()),
            _ => None,
        },
        fence: info.fence,
        ttl_ms: ms(ttl(info)),
        holders,
        queue: info
            .queue
            .iter()
            .map(|q| JsonWaiter {
                age_ms: ms(Some(q.age)).unwrap_or(0),
                ttl_ms: ms(q.expires_in),
            })
            .collect(),
        waiting_writers: info.waiting_writers.len(),
        waiting_readers: info.waiting_readers.len(),
        contention_ms: ms(info.contention),
        nodes: info.nodes.iter().map(to_json).collect(),
        unreachable: info.unreachable.clone(),
    }
}

pub fn json_line(info: &LockInfo) -> String {
    serde_json::to_string(&to_json(info)).unwrap_or_default()
}
