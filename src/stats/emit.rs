//! The `metrics` feature: the client's counters, wait and hold times and held holds through
//! the `metrics` facade, to whatever recorder (exporter) the program installed. Names and
//! labels are listed in the user guide's "Metrics" section.
//!
//! Every key is a `static` with static labels (no lock name: one label value per lock
//! would grow without bound): emitting allocates nothing here, and without a recorder it
//! costs a thread-local and an atomic load.

use std::time::Duration;

use metrics::{Key, Level, Metadata, with_recorder};

use crate::error::{Error, LostReason};
use crate::stats::{HoldKind, Path};

static META: Metadata<'static> = Metadata::new("redbaton", Level::INFO, Some(module_path!()));

/// A `&'static Key` of a name and literal labels: `key!("name", "label" = "value", …)`.
macro_rules! key {
    ($name:literal $(, $label:literal = $value:literal)* $(,)?) => {{
        static LABELS: [metrics::Label; <[&str]>::len(&[$($label),*])] =
            [$(metrics::Label::from_static_parts($label, $value)),*];
        static KEY: metrics::Key = metrics::Key::from_static_parts($name, &LABELS);
        &KEY
    }};
}
pub(crate) use key;

/// The key of `$name` with the label `kind` for `$kind`, and literal labels after it.
macro_rules! kind_key {
    ($kind:expr, $name:literal $(, $label:literal = $value:literal)*) => {
        match $kind {
            HoldKind::Lock => key!($name, "kind" = "lock" $(, $label = $value)*),
            HoldKind::Read => key!($name, "kind" = "read" $(, $label = $value)*),
            HoldKind::Write => key!($name, "kind" = "write" $(, $label = $value)*),
            HoldKind::Permit => key!($name, "kind" = "permit" $(, $label = $value)*),
        }
    };
}

pub(super) fn counter(key: &Key, n: u64) {
    with_recorder(|r| r.register_counter(key, &META).increment(n));
}

fn histogram(key: &Key, d: Duration) {
    with_recorder(|r| r.register_histogram(key, &META).record(d.as_secs_f64()));
}

fn gauge(key: &Key, by: f64) {
    with_recorder(|r| r.register_gauge(key, &META).increment(by));
}

/// A call for a hold ended after `wait`: with the hold (and how it came), or not.
pub(super) fn settled(kind: HoldKind, took: Result<Path, &Error>, wait: Duration) {
    let key = match took {
        Ok(Path::Remote) => kind_key!(kind, "redbaton_acquire_wait_seconds", "outcome" = "remote"),
        Ok(Path::Handoff) => {
            kind_key!(kind, "redbaton_acquire_wait_seconds", "outcome" = "handoff")
        }
        Err(Error::Timeout) => {
            kind_key!(kind, "redbaton_acquire_wait_seconds", "outcome" = "timeout")
        }
        Err(Error::WouldBlock) => {
            kind_key!(
                kind,
                "redbaton_acquire_wait_seconds",
                "outcome" = "would_block"
            )
        }
        Err(_) => kind_key!(kind, "redbaton_acquire_wait_seconds", "outcome" = "error"),
    };
    histogram(key, wait);
    if took.is_ok() {
        gauge(kind_key!(kind, "redbaton_locks_held"), 1.0);
    }
}

/// A holder let go after holding for `held`.
pub(super) fn released(kind: HoldKind, path: Path, held: Duration) {
    let key = match path {
        Path::Remote => kind_key!(kind, "redbaton_hold_seconds", "path" = "remote"),
        Path::Handoff => kind_key!(kind, "redbaton_hold_seconds", "path" = "handoff"),
    };
    histogram(key, held);
    gauge(kind_key!(kind, "redbaton_locks_held"), -1.0);
}

/// A hold was found lost.
pub(super) fn lost(reason: LostReason) {
    let key = match reason {
        LostReason::Expired => key!("redbaton_lost_total", "reason" = "expired"),
        LostReason::Deleted => key!("redbaton_lost_total", "reason" = "deleted"),
        LostReason::Stolen => key!("redbaton_lost_total", "reason" = "stolen"),
        LostReason::HoldLimit => key!("redbaton_lost_total", "reason" = "hold_limit"),
        LostReason::NoQuorum => key!("redbaton_lost_total", "reason" = "no_quorum"),
        LostReason::WatchdogFailed => key!("redbaton_lost_total", "reason" = "watchdog_failed"),
        LostReason::Converted => key!("redbaton_lost_total", "reason" = "converted"),
    };
    counter(key, 1);
}
