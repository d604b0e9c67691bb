//! The wakeup strategies compared, and the client builder each one stands for.

use std::time::Duration;

use clap::ValueEnum;
use redbaton::{LockClient, Wakeup};
use serde::{Deserialize, Serialize};

use crate::settings::Settings;

#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Strategy {
    #[value(name = "poll-100ms")]
    #[serde(rename = "poll-100ms")]
    Poll100ms,
    #[value(name = "poll-1ms")]
    #[serde(rename = "poll-1ms")]
    Poll1ms,
    #[value(name = "notify")]
    #[serde(rename = "notify")]
    Notify,
    #[value(name = "notify+handoff")]
    #[serde(rename = "notify+handoff")]
    NotifyHandoff,
    /// redbaton's defaults but without the fair queue: whoever reaches Redis first after
    /// a release wins (the library's behaviour before the queue).
    #[value(name = "unfair")]
    #[serde(rename = "unfair")]
    Unfair,
    /// Not redbaton: the queue of python-redis-lock, for comparison. `SET NX PX` to take
    /// the lock; a waiter blocks in `BLPOP` on a signal list, and a release (one script:
    /// compare, delete, `LPUSH` the signal) wakes exactly one waiter, which retries.
    #[value(name = "blpop-queue")]
    #[serde(rename = "blpop-queue")]
    BlpopQueue,
}

impl Strategy {
    pub const ALL: [Strategy; 6] = [
        Strategy::Poll100ms,
        Strategy::Poll1ms,
        Strategy::Notify,
        Strategy::NotifyHandoff,
        Strategy::Unfair,
        Strategy::BlpopQueue,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Strategy::Poll100ms => "poll-100ms",
            Strategy::Poll1ms => "poll-1ms",
            Strategy::Notify => "notify",
            Strategy::NotifyHandoff => "notify+handoff",
            Strategy::Unfair => "unfair",
            Strategy::BlpopQueue => "blpop-queue",
        }
    }

    /// The client of this strategy on the Redis at `url`, or on the Redis Cluster that
    /// `url` is a seed of when `cluster`.
    pub fn builder(
        self,
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
        match self {
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
                let b = b.fair(self == Strategy::NotifyHandoff);
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
}
