//! Reading a Redis Cluster's slot map: which master serves which hash slots.
//!
//! `CLUSTER SHARDS` (Redis 7) is asked first; servers that do not know it, or an ACL that
//! allows only the older command, get `CLUSTER SLOTS` (deprecated in Redis 7, but the only
//! choice before).
//!
//! Over TLS (`tls-cluster yes`) a master has two ports: `CLUSTER SHARDS` gives both
//! (`port`, `tls-port`), and `CLUSTER SLOTS` and `MOVED` give the one of the asking
//! connection's kind, so a TLS client is always sent to TLS ports.

use redis::{Connection, RedisResult, Value};

use crate::proto::pool::next_read;

/// Hash slots in a Redis Cluster.
pub(crate) const SLOTS: usize = 16384;

/// One master and the slot ranges it serves (inclusive).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Shard {
    pub host: String,
    pub port: u16,
    pub ranges: Vec<(u16, u16)>,
}

/// How many slots `shards` name a master for: [`SLOTS`] in a map with every slot served.
/// A slot named twice (a malformed reply, or one read half-way through a change) counts
/// once, so that such a reply is never taken for a whole map.
pub(crate) fn slots_named(shards: &[Shard]) -> usize {
    let mut named = vec![false; SLOTS];
    for &(start, end) in shards.iter().flat_map(|s| &s.ranges) {
        let end = usize::from(end).min(SLOTS - 1);
        if let Some(range) = named.get_mut(usize::from(start)..=end) {
            range.fill(true);
        }
    }
    named.iter().filter(|&&n| n).count()
}

/// The masters of the cluster that `conn` belongs to. `tls`: the client connects with
/// TLS, so a master's TLS port is the one to use when the server tells it apart. `asked`:
/// the host `conn` is connected to, where a master is when the server knows no address of
/// it (`cluster-preferred-endpoint-type unknown-endpoint`, or a node that does not know its
/// own address): a client is to reach it there, at the port given.
pub(crate) fn read(conn: &mut Connection, tls: bool, asked: &str) -> RedisResult<Vec<Shard>> {
    match redis::cmd("CLUSTER").arg("SHARDS").query::<Value>(conn) {
        Ok(v) => Ok(from_shards(&v, tls, asked)),
        Err(e)
            if matches!(
                e.kind(),
                redis::ErrorKind::Server(
                    redis::ServerErrorKind::ResponseError | redis::ServerErrorKind::NoPerm
                )
            ) =>
        {
            // A second reply within one call: it waits only for what remains of the call's
            // deadline, not for as long as the refused `CLUSTER SHARDS` was given.
            next_read(conn)?;
            let v = redis::cmd("CLUSTER").arg("SLOTS").query::<Value>(conn)?;
            Ok(from_slots(&v, asked))
        }
        Err(e) => Err(e),
    }
}

/// The items of an array (RESP2) or the flattened pairs of a map (RESP3).
fn items(v: &Value) -> Vec<&Value> {
    match v {
        Value::Array(a) | Value::Set(a) => a.iter().collect(),
        Value::Map(m) => m.iter().flat_map(|(k, v)| [k, v]).collect(),
        _ => Vec::new(),
    }
}

fn text(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
        Value::SimpleString(s) => Some(s.clone()),
        Value::VerbatimString { text, .. } => Some(text.clone()),
        Value::Int(i) => Some(i.to_string()),
        _ => None,
    }
}

fn int(v: &Value) -> Option<i64> {
    match v {
        Value::Int(i) => Some(*i),
        other => text(other)?.parse().ok(),
    }
}

/// A flat key-value list as (key, value) pairs.
fn pairs(v: &Value) -> Vec<(String, &Value)> {
    let items = items(v);
    items
        .chunks(2)
        .filter_map(|kv| match kv {
            [k, v] => Some((text(k)?, *v)),
            _ => None,
        })
        .collect()
}

/// A host a client can reach: not an unknown endpoint (`?`, empty, or a RESP null, which
/// `text` does not read).
fn known(host: Option<String>) -> Option<String> {
    host.filter(|h| !h.is_empty() && h != "?")
}

fn from_shards(v: &Value, tls: bool, asked: &str) -> Vec<Shard> {
    let mut out = Vec::new();
    for shard in items(v) {
        let fields = pairs(shard);
        let get = |name: &str| fields.iter().find(|(k, _)| k == name).map(|(_, v)| *v);
        let ranges: Vec<(u16, u16)> = get("slots")
            .map(items)
            .unwrap_or_default()
            .chunks(2)
            .filter_map(|r| match r {
                [a, b] => Some((int(a)? as u16, int(b)? as u16)),
                _ => None,
            })
            .collect();
        if ranges.is_empty() {
            continue;
        }
        let masters = get("nodes").map(items).unwrap_or_default();
        let mut best: Option<(bool, String, u16)> = None;
        for node in masters {
            let f = pairs(node);
            let field = |name: &str| f.iter().find(|(k, _)| k == name).map(|(_, v)| *v);
            if field("role").and_then(text).as_deref() != Some("master") {
                continue;
            }
            let online = field("health").and_then(text).as_deref() == Some("online");
            let host = known(field("endpoint").and_then(text))
                .or_else(|| known(field("ip").and_then(text)))
                .or_else(|| known(Some(asked.to_owned())));
            let port = tls
                .then(|| field("tls-port").and_then(int))
                .flatten()
                .or_else(|| field("port").and_then(int));
            if let (Some(host), Some(port)) = (host, port)
                && best
                    .as_ref()
                    .is_none_or(|(was_online, ..)| online && !was_online)
            {
                best = Some((online, host, port as u16));
            }
        }
        if let Some((_, host, port)) = best {
            out.push(Shard { host, port, ranges });
        }
    }
    out
}

/// A master's entry of `CLUSTER SLOTS` is `[endpoint, port, id, {ip, hostname}]`; the
/// endpoint is `?` (a hostname preferred but none announced) or null (an unknown endpoint),
/// and the map, since Redis 7, gives the addresses other than the endpoint: its `ip` is
/// used then, and the host asked without one.
fn from_slots(v: &Value, asked: &str) -> Vec<Shard> {
    let mut out: Vec<Shard> = Vec::new();
    for range in items(v) {
        let r = items(range);
        let (Some(start), Some(end), Some(master)) = (
            r.first().and_then(|v| int(v)),
            r.get(1).and_then(|v| int(v)),
            r.get(2),
        ) else {
            continue;
        };
        let m = items(master);
        let ip = || {
            let more = pairs(m.get(3)?);
            known(
                more.iter()
                    .find(|(k, _)| k == "ip")
                    .and_then(|(_, v)| text(v)),
            )
        };
        let host = known(m.first().and_then(|v| text(v)))
            .or_else(ip)
            .or_else(|| known(Some(asked.to_owned())));
        let (Some(host), Some(port)) = (host, m.get(1).and_then(|v| int(v))) else {
            continue;
        };
        let range = (start as u16, end as u16);
        match out
            .iter_mut()
            .find(|s| s.host == host && s.port == port as u16)
        {
            Some(s) => s.ranges.push(range),
            None => out.push(Shard {
                host,
                port: port as u16,
                ranges: vec![range],
            }),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A map with every slot served names [`SLOTS`]; one without a shard, fewer.
    #[test]
    fn slots_named_counts_every_range() {
        let shard = |port, ranges: &[(u16, u16)]| Shard {
            host: "h".to_owned(),
            port,
            ranges: ranges.to_vec(),
        };
        let whole = [
            shard(1, &[(0, 5460)]),
            shard(2, &[(5461, 10922)]),
            shard(3, &[(10923, 16000), (16001, 16383)]),
        ];
        assert_eq!(slots_named(&whole), SLOTS);
        assert_eq!(slots_named(&whole[1..]), SLOTS - 5461);
        assert_eq!(slots_named(&[]), 0);
    }

    /// A reply naming two masters for the same slots (malformed, or read half-way through
    /// a change) counts those slots once: it is no whole map, and the next master is asked.
    #[test]
    fn slots_named_counts_a_slot_named_twice_once() {
        let shard = |port, ranges: &[(u16, u16)]| Shard {
            host: "h".to_owned(),
            port,
            ranges: ranges.to_vec(),
        };
        let twice = [shard(1, &[(0, 8191)]), shard(2, &[(0, 8191)])];
        assert_eq!(slots_named(&twice), 8192);
        let overlapping = [
            shard(1, &[(0, 10000)]),
            shard(2, &[(5000, 16383), (9000, 9999)]),
        ];
        assert_eq!(slots_named(&overlapping), SLOTS);
        assert_eq!(slots_named(&[shard(1, &[(20000, 30000), (5, 4)])]), 0);
    }

    fn s(x: &str) -> Value {
        Value::BulkString(x.as_bytes().to_vec())
    }

    #[test]
    fn shards_reply() {
        let node = |role: &str, port: i64, health: &str| {
            Value::Array(vec![
                s("id"),
                s("abc"),
                s("port"),
                Value::Int(port),
                s("ip"),
                s("127.0.0.1"),
                s("endpoint"),
                s("127.0.0.1"),
                s("role"),
                s(role),
                s("health"),
                s(health),
            ])
        };
        let shard = Value::Array(vec![
            s("slots"),
            Value::Array(vec![
                Value::Int(0),
                Value::Int(5460),
                Value::Int(6000),
                Value::Int(6001),
            ]),
            s("nodes"),
            Value::Array(vec![
                node("replica", 7004, "online"),
                node("master", 7000, "online"),
            ]),
        ]);
        let shards = from_shards(&Value::Array(vec![shard]), false, "10.0.0.9");
        assert_eq!(
            shards,
            vec![Shard {
                host: "127.0.0.1".into(),
                port: 7000,
                ranges: vec![(0, 5460), (6000, 6001)],
            }]
        );
    }

    /// A TLS cluster (`tls-cluster yes`) gives both ports: a TLS client takes `tls-port`.
    #[test]
    fn shards_reply_over_tls() {
        let node = Value::Array(vec![
            s("port"),
            Value::Int(7000),
            s("tls-port"),
            Value::Int(7100),
            s("endpoint"),
            s("127.0.0.1"),
            s("role"),
            s("master"),
            s("health"),
            s("online"),
        ]);
        let shard = Value::Array(vec![
            s("slots"),
            Value::Array(vec![Value::Int(0), Value::Int(16383)]),
            s("nodes"),
            Value::Array(vec![node]),
        ]);
        let v = Value::Array(vec![shard]);
        assert_eq!(from_shards(&v, true, "10.0.0.9")[0].port, 7100);
        assert_eq!(from_shards(&v, false, "10.0.0.9")[0].port, 7000);
    }

    #[test]
    fn slots_reply() {
        let range = |a: i64, b: i64, port: i64| {
            Value::Array(vec![
                Value::Int(a),
                Value::Int(b),
                Value::Array(vec![s("127.0.0.1"), Value::Int(port), s("id")]),
                Value::Array(vec![s("127.0.0.1"), Value::Int(port + 3), s("id2")]),
            ])
        };
        let v = Value::Array(vec![
            range(0, 10, 7000),
            range(11, 20, 7001),
            range(21, 30, 7000),
        ]);
        let shards = from_slots(&v, "10.0.0.9");
        assert_eq!(shards.len(), 2);
        assert_eq!(shards[0].ranges, vec![(0, 10), (21, 30)]);
        assert_eq!(shards[1].port, 7001);
    }

    /// `CLUSTER SLOTS` from a server that knows no endpoint of its masters (Redis 7 and
    /// later: `?` when a hostname is preferred but none announced, null with
    /// `cluster-preferred-endpoint-type unknown-endpoint`): a master is reached at the
    /// `ip` of the entry's address map, or, without one, on the host asked, at its port.
    #[test]
    fn slots_reply_with_unknown_endpoints() {
        let master = |endpoint: Value, port: i64, more: Vec<Value>| {
            Value::Array(vec![
                endpoint,
                Value::Int(port),
                s("id"),
                Value::Array(more),
            ])
        };
        let range = |a: i64, b: i64, master: Value| {
            Value::Array(vec![Value::Int(a), Value::Int(b), master])
        };
        let v = Value::Array(vec![
            range(0, 10, master(s("?"), 7000, vec![s("ip"), s("10.0.0.1")])),
            range(
                11,
                20,
                master(Value::Nil, 7001, vec![s("ip"), s("10.0.0.2")]),
            ),
            range(21, 30, master(Value::Nil, 7002, vec![])),
            range(31, 40, master(s(""), 7003, vec![s("ip"), s("")])),
        ]);
        let at: Vec<(String, u16)> = from_slots(&v, "10.0.0.9")
            .into_iter()
            .map(|shard| (shard.host, shard.port))
            .collect();
        let want = [
            ("10.0.0.1", 7000),
            ("10.0.0.2", 7001),
            ("10.0.0.9", 7002),
            ("10.0.0.9", 7003),
        ];
        assert_eq!(at, want.map(|(h, p)| (h.to_owned(), p)));
    }
}
