//! The wakeup strategies compared (the client each one stands for is built in `client`).

use clap::ValueEnum;
use serde::{Deserialize, Serialize};

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
}
