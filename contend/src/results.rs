//! What one run measured, as printed by `--json`.

use std::collections::HashMap;

use serde::Serialize;

use crate::protocol::ClientStats;
use crate::settings::Settings;
use crate::strategy::Strategy;

#[derive(Serialize, Debug)]
pub struct Waits {
    pub p50_us: u64,
    pub p99_us: u64,
    pub max_us: u64,
    pub mean_us: f64,
}

#[derive(Serialize, Debug)]
pub struct Commands {
    /// Every call the server counted in the window, minus the tool's own INFO.
    pub server_total: u64,
    /// The counter's GET + SET: 2 per section.
    pub counter: u64,
    /// `server_total - counter`: the lock's commands, including those run inside scripts.
    pub lock: u64,
    pub lock_per_section: f64,
    /// Commands the lock's clients sent (round trips): `lock` without in-script calls.
    pub sent: u64,
    pub sent_per_section: f64,
    /// Of `lock`, the calls counted on replicas (lock-only servers; absent otherwise).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub on_replicas: Option<u64>,
    /// Net calls per command name (INFO commandstats), counter included.
    pub by_command: HashMap<String, u64>,
}

#[derive(Serialize, Debug)]
pub struct Fairness {
    /// When the first thread finished, µs after `go`.
    pub first_finish_us: u64,
    pub thread_min: u64,
    pub thread_max: u64,
    pub process_min: u64,
    pub process_max: u64,
    /// The most sections one process completed in a row on one key (completion order)
    /// while another process still had sections to do on it.
    pub max_run: u64,
    /// How many times a key went from one process to another.
    pub switches: u64,
    /// The most sections one remote acquisition served (its local handoffs + 1).
    pub max_tenure: u64,
    /// The most remote acquisitions in a row one process made on one key while another
    /// process still had sections to do on it.
    pub max_tenures_in_row: u64,
    /// The longest time a process completed no section (from `go` to its last section).
    pub process_max_gap_us: u64,
    /// The end of the run, when only the last process still had sections to do: how long
    /// it lasted and how many sections it saw (0 with one process).
    pub tail_alone_us: u64,
    pub tail_alone_sections: u64,
}

#[derive(Serialize, Debug)]
pub struct Counter {
    pub expected: u64,
    pub actual: u64,
    /// Every key's counter equals the sections done on it, and no lock was lost.
    pub exact: bool,
    pub lost: u64,
}

#[derive(Serialize, Debug)]
pub struct StrategyResult {
    pub strategy: Strategy,
    pub sections_per_thread: usize,
    pub sections: u64,
    /// From `go` to the end of the last section.
    pub elapsed_s: f64,
    /// From `go` to the last worker's report.
    pub wall_s: f64,
    pub sections_per_s: f64,
    pub wait: Waits,
    pub commands: Commands,
    pub fairness: Fairness,
    pub counter: Counter,
    pub client_stats: ClientStats,
    /// Each process's own counters, by worker id.
    pub process_stats: Vec<ClientStats>,
    /// sections_per_s ÷ the ideal row's, in percent.
    pub pct_ideal: f64,
}

/// The `ideal` row: the same critical sections run back to back by one thread, no lock.
#[derive(Serialize, Debug)]
pub struct IdealResult {
    /// The sections it stands for: the strategies' P × T × S.
    pub sections: u64,
    /// The sections actually run (at most `IDEAL_CAP`): half before the strategies, half
    /// after.
    pub sections_run: u64,
    /// Measured time of the sections run.
    pub measured_s: f64,
    /// Time `sections` would take at the measured rate.
    pub elapsed_s: f64,
    pub sections_per_s: f64,
    /// The rate of each half (before, after the strategies).
    pub parts_per_s: Vec<f64>,
    /// How long one section (GET, hold, SET) took, µs.
    pub section_p50_us: u64,
    pub section_p99_us: u64,
    /// Counted like the strategies': with no lock, `lock` should come out 0.
    pub commands: Commands,
    pub counter: Counter,
}

/// One configuration's ideal row and strategy rows.
#[derive(Serialize, Debug)]
pub struct ConfigResult {
    pub settings: Settings,
    /// notify+handoff's budget, as used.
    pub handoff_budget: String,
    pub ideal: IdealResult,
    pub results: Vec<StrategyResult>,
}
