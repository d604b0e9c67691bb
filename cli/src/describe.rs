//! A lock's state in words, as both the table and the JSON say it.

use std::time::Duration;

use redbaton::{HoldKind, LockInfo, LockKind};

pub fn kind_name(kind: &LockKind) -> String {
    match kind {
        LockKind::Free => "free".to_owned(),
        LockKind::Lock => "lock".to_owned(),
        LockKind::ReadWrite => "rwlock".to_owned(),
        LockKind::Semaphore { permits } => format!("semaphore/{permits}"),
        LockKind::Foreign { redis_type } => format!("foreign:{redis_type}"),
        other => format!("{other:?}").to_lowercase(),
    }
}

pub fn hold_name(kind: HoldKind) -> &'static str {
    match kind {
        HoldKind::Read => "read",
        HoldKind::Write => "write",
        HoldKind::Permit => "permit",
        HoldKind::Upgradable => "upgradable",
        _ => "hold",
    }
}

/// A duration for people: `29.8s`, `850ms`; `expired` for nothing left.
pub fn human(d: Option<Duration>) -> String {
    match d {
        None => "expired".to_owned(),
        Some(d) if d < Duration::from_secs(1) => format!("{}ms", d.as_millis()),
        Some(d) => format!("{:.1}s", d.as_secs_f64()),
    }
}

/// The lease left: the lock's, or the longest of the live shared holds'.
pub fn ttl(info: &LockInfo) -> Option<Duration> {
    match &info.holder {
        Some(h) => h.lease_left,
        None => info.holds.iter().filter_map(|h| h.lease_left).max(),
    }
}

pub fn live_holds(info: &LockInfo) -> usize {
    match info.kind {
        LockKind::Lock => 1,
        _ => info.holds.iter().filter(|h| h.lease_left.is_some()).count(),
    }
}

/// The processes waiting in the fair queue: its live entries (an expired one's waiter died
/// or gave up unheard: it is dropped, never granted).
pub fn waiting(info: &LockInfo) -> usize {
    info.queue.iter().filter(|q| q.expires_in.is_some()).count()
}
