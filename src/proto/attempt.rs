//! The reply to one acquire attempt, whatever the hold: what every acquire script's reply
//! is read into, and what the topology's verdict counts.

use std::time::Duration;

/// The reply to one acquire attempt on one node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Attempt {
    /// The hold is ours: `fence` is the node's fencing counter for it, `others_wait` says
    /// (a write hold) that another process may wait for it, and `previous_lost` that the
    /// node's counter said the hold before this one ended without a release (see
    /// `scripts::FENCE_FN`). `resent`: as `Held`'s; the first send, landing after the hold
    /// was released, would take the lock again with our token.
    Acquired {
        fence: u64,
        others_wait: bool,
        previous_lost: bool,
        resent: bool,
    },
    /// Someone else holds it; `pttl` is what remains of their lease (`None`: no TTL).
    /// `resent`: this was a retry, after the first send's reply was lost; that send may
    /// still land (delayed on its way, overtaken by the retry) and take the lock later
    /// with our token, so the node is one where our token may be.
    Held {
        pttl: Option<Duration>,
        resent: bool,
    },
    /// The script took the lock, but fewer replicas than asked acknowledged it in time
    /// (`replica_ack`): the caller must release it. `resent`: as `Held`'s; the first
    /// send, landing after the give-back, would take the lock again with our token.
    Unacked { acked: usize, resent: bool },
}

impl Attempt {
    /// This reply, to a call that was sent again after a lost reply when `resent`.
    pub fn sent_again(mut self, resent: bool) -> Self {
        let (Attempt::Held { resent: r, .. }
        | Attempt::Acquired { resent: r, .. }
        | Attempt::Unacked { resent: r, .. }) = &mut self;
        *r = resent;
        self
    }

    /// Whether this reply is a retry's after a lost reply (see `Held`).
    pub fn resent(self) -> bool {
        let (Attempt::Held { resent, .. }
        | Attempt::Acquired { resent, .. }
        | Attempt::Unacked { resent, .. }) = self;
        resent
    }
}
