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
}

impl Strategy {
    pub const ALL: [Strategy; 4] = [
        Strategy::Poll100ms,
        Strategy::Poll1ms,
        Strategy::Notify,
        Strategy::NotifyHandoff,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Strategy::Poll100ms => "poll-100ms",
            Strategy::Poll1ms => "poll-1ms",
            Strategy::Notify => "notify",
            Strategy::NotifyHandoff => "notify+handoff",
        }
    }

    pub fn builder(self, url: &str, prefix: &str, s: &Settings) -> redbaton::Builder {
        let b = LockClient::builder()
            .node(url)
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
            Strategy::NotifyHandoff => {
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
