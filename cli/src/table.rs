//! The tables: `status`'s (one name, a row per fact) and `list`'s (a row per name).

use redbaton::{Hold, LockInfo};

use crate::describe::{hold_name, human, kind_name, live_holds, ttl, waiting};
use crate::name::escape;

/// `list`'s header row.
pub fn list_header() -> String {
    list_row(["NAME", "KIND", "FENCE", "LEASE", "HOLDS", "QUEUE"].map(str::to_owned))
}

/// `list`'s row for one name.
pub fn list_line(info: &LockInfo) -> String {
    list_row([
        escape(&info.name),
        kind_name(&info.kind),
        info.fence.map_or("-".to_owned(), |f| f.to_string()),
        ttl(info).map_or("-".to_owned(), |t| human(Some(t))),
        live_holds(info).to_string(),
        waiting(info).to_string(),
    ])
}

fn list_row([name, kind, fence, lease, holds, queue]: [String; 6]) -> String {
    format!("{name:<30} {kind:<12} {fence:>18} {lease:>10} {holds:>7} {queue:>6}\n")
}

/// `status`'s table of one name.
pub fn table(info: &LockInfo) -> String {
    let mut t = String::new();
    let mut row = |k: &str, v: String| t.push_str(&format!("{k:<16}{v}\n"));
    row("name", escape(&info.name));
    row("node", info.node.clone());
    row("kind", kind_name(&info.kind));
    row(
        "fence",
        info.fence.map_or("-".to_owned(), |f| f.to_string()),
    );
    if let Some(h) = &info.holder {
        let lease = h
            .lease_left
            .map_or("no expiry".to_owned(), |d| human(Some(d)));
        row("lease left", lease);
    }
    if !info.holds.is_empty() {
        row("holds", format!("{} live", live_holds(info)));
        for (
            i,
            Hold {
                kind, lease_left, ..
            },
        ) in info.holds.iter().enumerate()
        {
            row(
                "",
                format!(
                    "{}. {:<10} lease left {}",
                    i + 1,
                    hold_name(*kind),
                    human(*lease_left)
                ),
            );
        }
    }
    let (live, expired) = (waiting(info), info.queue.len() - waiting(info));
    row(
        "queue",
        match expired {
            0 => format!("{live} waiting"),
            n => format!("{live} waiting, {n} expired"),
        },
    );
    for (i, q) in info.queue.iter().enumerate() {
        row(
            "",
            format!(
                "{}. waiting {}, expires in {}",
                i + 1,
                human(Some(q.age)),
                human(q.expires_in)
            ),
        );
    }
    if let redbaton::LockKind::Semaphore { .. } = info.kind {
        // A semaphore's waiters are marked as a read-write lock's writers are: they wait
        // for a permit, and nobody writes.
        row("permit waiters", info.waiting_writers.len().to_string());
    } else if matches!(info.kind, redbaton::LockKind::ReadWrite) || !info.waiting_writers.is_empty()
    {
        row("writers waiting", info.waiting_writers.len().to_string());
        row("readers waiting", info.waiting_readers.len().to_string());
    }
    if let Some(c) = info.contention {
        row(
            "contention",
            format!("another process waits (mark expires in {})", human(Some(c))),
        );
    }
    for n in &info.nodes {
        let holder = n.fence.map_or("-".to_owned(), |f| f.to_string());
        row(
            "master",
            format!("{}: {}, fence {holder}", n.node, kind_name(&n.kind)),
        );
    }
    for n in &info.unreachable {
        row("master", format!("{n}: unreachable"));
    }
    t
}
