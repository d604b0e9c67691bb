//! Worker <-> parent messages: one JSON object per line on the worker's stdout.

use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, Debug)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Msg {
    Ready,
    Progress { done: u64 },
    Done(WorkerReport),
    Failed { error: String },
}

#[derive(Serialize, Deserialize, Debug)]
pub struct WorkerReport {
    pub worker: usize,
    pub threads: Vec<ThreadReport>,
    /// Sections done per key by this process.
    pub key_counts: Vec<u64>,
    /// Sections whose lock was lost while held, or not ours any more at unlock.
    pub lost: u64,
    pub stats: ClientStats,
}

#[derive(Serialize, Deserialize, Debug, Default)]
pub struct ThreadReport {
    /// How long each `lock()` call waited, µs.
    pub waits_us: Vec<u64>,
    /// When each section ended, µs after the parent's `go` (CLOCK_MONOTONIC).
    pub done_us: Vec<u64>,
    /// Each section's fencing token (remote fence << 12 | local handoff number).
    pub fences: Vec<u64>,
}

/// The client's own counters (`LockClient::stats`), summed over processes in the results.
#[derive(Serialize, Deserialize, Debug, Default, Clone, Copy)]
pub struct ClientStats {
    pub remote_acquisitions: u64,
    pub failed_attempts: u64,
    pub local_handoffs: u64,
    pub budget_releases: u64,
    pub commands: u64,
    pub wakeups_event: u64,
    pub wakeups_lease: u64,
    pub wakeups_recheck: u64,
    pub wakeups_poll: u64,
    pub renewals_sent: u64,
    pub locks_lost: u64,
}

impl ClientStats {
    pub fn from_stats(s: &redbaton::Stats) -> Self {
        ClientStats {
            remote_acquisitions: s.remote_acquisitions,
            failed_attempts: s.failed_attempts,
            local_handoffs: s.local_handoffs,
            budget_releases: s.budget_releases,
            commands: s.commands,
            wakeups_event: s.wakeups_event,
            wakeups_lease: s.wakeups_lease,
            wakeups_recheck: s.wakeups_recheck,
            wakeups_poll: s.wakeups_poll,
            renewals_sent: s.renewals_sent,
            locks_lost: s.locks_lost,
        }
    }

    pub fn add(&mut self, o: &ClientStats) {
        self.remote_acquisitions += o.remote_acquisitions;
        self.failed_attempts += o.failed_attempts;
        self.local_handoffs += o.local_handoffs;
        self.budget_releases += o.budget_releases;
        self.commands += o.commands;
        self.wakeups_event += o.wakeups_event;
        self.wakeups_lease += o.wakeups_lease;
        self.wakeups_recheck += o.wakeups_recheck;
        self.wakeups_poll += o.wakeups_poll;
        self.renewals_sent += o.renewals_sent;
        self.locks_lost += o.locks_lost;
    }
}

pub fn send(msg: &Msg) {
    // One `println!` holds the stdout lock for the whole line; stdout is line-buffered.
    println!(
        "{}",
        serde_json::to_string(msg).expect("messages serialize")
    );
}
