//! The redbaton client each wakeup strategy stands for, built from the run's settings.

use std::time::Duration;

use redbaton::{LockClient, Wakeup};

use crate::settings::Settings;
use crate::strategy::Strategy;

/// The client of `strategy` on the Redis at `url`, or on the Redis Cluster that
/// `url` is a seed of when `cluster`.
pub fn builder(
    strategy: Strategy,
    url: &str,
    cluster: bool,
    prefix: &str,
    s: &Settings,
) -> redbaton::Builder {
    let b = LockClient::builder();
    let b = if cluster {
        b.cluster([url])
    } else {
        b.node(url)
    };
    let b = b
        .key_prefix(prefix)
        .lease(Duration::from_millis(s.lease_ms))
        // Enough connections that threads never queue for one (8 is the default).
        .pool_size(s.threads.clamp(8, 1024));
    match strategy {
        Strategy::Poll100ms => b
            .wakeup(Wakeup::Polling(Duration::from_millis(100)))
            .local_handoff(false),
        Strategy::Poll1ms => b
            .wakeup(Wakeup::Polling(Duration::from_millis(1)))
            .local_handoff(false),
        Strategy::Notify => b.wakeup(Wakeup::Notifications).local_handoff(false),
        // The worker does not lock through the client: it only counts nothing.
        Strategy::BlpopQueue => b.wakeup(Wakeup::Polling(Duration::from_secs(1))),
        Strategy::Unfair | Strategy::NotifyHandoff => {
            let b = b.fair(strategy == Strategy::NotifyHandoff);
            let b = match s.max_handoffs {
                Some(n) => b.max_handoffs(n),
                None => b,
            };
            match s.slice() {
                Some(d) => b.handoff_slice(d),
                None => b,
            }
        }
    }
}
