//! Turning raw readings into measurements: the server's command counters and percentiles.

use std::collections::HashMap;

use redbaton_testkit::keys::fence_of;

use crate::protocol::{ThreadReport, WorkerReport};
use crate::results::{Commands, Fairness, Waits};
use crate::settings::Settings;

/// Commands that the library only ever runs inside its Lua scripts (acquire: GET, SET,
/// INCR, PEXPIRE, PUBLISH, PTTL; release: GET, DEL, PUBLISH; extend: GET, PEXPIRE), plus the
/// counter's GET/SET. Removing them from the server's totals leaves what clients sent.
pub const IN_SCRIPT: [&str; 7] = ["get", "set", "incr", "pexpire", "publish", "pttl", "del"];

/// The window's net calls per command (INFO commandstats readings `before` and `after`),
/// minus our own INFO (the first reading is counted by the second) and the counter's
/// GET + SET of each of `sections` sections.
pub fn net_commands(
    before: &HashMap<String, u64>,
    after: &HashMap<String, u64>,
    sections: u64,
) -> Commands {
    let mut by_command: HashMap<String, u64> = after
        .iter()
        .map(|(name, &calls)| {
            let net = calls.saturating_sub(before.get(name).copied().unwrap_or(0));
            (name.clone(), net)
        })
        .filter(|&(_, n)| n > 0)
        .collect();
    if let Some(info) = by_command.get_mut("info") {
        *info -= 1;
    }
    by_command.retain(|_, n| *n > 0);
    let server_total: u64 = by_command.values().sum();
    let counter = 2 * sections;
    let lock = server_total.saturating_sub(counter);
    let in_script: u64 = IN_SCRIPT
        .iter()
        .filter_map(|name| by_command.get(*name))
        .sum();
    let sent = server_total.saturating_sub(in_script);
    let per = |n: u64| n as f64 / sections.max(1) as f64;
    Commands {
        server_total,
        counter,
        lock,
        lock_per_section: per(lock),
        sent,
        sent_per_section: per(sent),
        on_replicas: None,
        by_command,
    }
}

/// Not lock traffic, left out when counting over lock-only servers: replication
/// (`REPLCONF`), health checks (`PING`), the cluster's topology (`CLUSTER …`), the tool's
/// own `INFO`, and connection set-up (`CLIENT …`).
pub const HOUSEKEEPING: [&str; 5] = ["replconf", "ping", "cluster", "info", "client"];

/// The window's net calls per command summed over lock-only servers (readings `before`
/// and `after`, one map per server; `replica` tells which are replicas), without
/// [`HOUSEKEEPING`]. The counters live elsewhere, so nothing is subtracted for them.
/// `sent` counts the masters' calls only: what a replica runs came from its master, not
/// from a client.
pub fn net_commands_nodes(
    before: &[HashMap<String, u64>],
    after: &[HashMap<String, u64>],
    replica: &[bool],
    sections: u64,
) -> Commands {
    let mut by_command: HashMap<String, u64> = HashMap::new();
    let (mut on_replicas, mut sent) = (0u64, 0u64);
    for ((b, a), &is_replica) in before.iter().zip(after).zip(replica) {
        for (name, &calls) in a {
            let base = name.split('|').next().unwrap_or(name);
            if HOUSEKEEPING.contains(&base) {
                continue;
            }
            let net = calls.saturating_sub(b.get(name).copied().unwrap_or(0));
            if net == 0 {
                continue;
            }
            *by_command.entry(name.clone()).or_default() += net;
            if is_replica {
                on_replicas += net;
            } else if !IN_SCRIPT.contains(&name.as_str()) {
                sent += net;
            }
        }
    }
    let lock: u64 = by_command.values().sum();
    let per = |n: u64| n as f64 / sections.max(1) as f64;
    Commands {
        server_total: lock,
        counter: 0,
        lock,
        lock_per_section: per(lock),
        sent,
        sent_per_section: per(sent),
        on_replicas: Some(on_replicas),
        by_command,
    }
}

/// `q`-quantile (nearest rank) of sorted values; 0 when empty.
pub fn percentile(sorted: &[u64], q: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

/// How long `lock()` waited, over every section of every worker.
pub fn waits(reports: &[WorkerReport]) -> Waits {
    let mut waits: Vec<u64> = reports
        .iter()
        .flat_map(|r| &r.threads)
        .flat_map(|t| t.waits_us.iter().copied())
        .collect();
    waits.sort_unstable();
    Waits {
        p50_us: percentile(&waits, 0.50),
        p99_us: percentile(&waits, 0.99),
        max_us: waits.last().copied().unwrap_or(0),
        mean_us: waits.iter().sum::<u64>() as f64 / waits.len().max(1) as f64,
    }
}

/// Fairness of a run from the workers' reports: who had done how much when the first
/// thread finished, runs and tenures per key, gaps, and the tail one process ran alone.
pub fn fairness(reports: &[WorkerReport], s: &Settings) -> Fairness {
    let first_finish_us = reports
        .iter()
        .flat_map(|r| &r.threads)
        .filter_map(|t| t.done_us.last().copied())
        .min()
        .unwrap_or(0);
    let by_thread = |t: &ThreadReport| t.done_us.partition_point(|&d| d <= first_finish_us) as u64;
    let thread_counts: Vec<u64> = reports
        .iter()
        .flat_map(|r| &r.threads)
        .map(by_thread)
        .collect();
    let process_counts: Vec<u64> = reports
        .iter()
        .map(|r| r.threads.iter().map(by_thread).sum())
        .collect();
    // Completion order per key: (done_us, process). Thread t of worker w is global thread
    // w × T + t, and its section i took key (global + i) mod K.
    let mut per_key: Vec<Vec<(u64, usize, u64)>> = vec![Vec::new(); s.keys];
    for r in reports {
        for (t, th) in r.threads.iter().enumerate() {
            let global = r.worker * s.threads + t;
            for (i, (&d, &f)) in th.done_us.iter().zip(&th.fences).enumerate() {
                per_key[(global + i) % s.keys].push((d, r.worker, fence_of(f)));
            }
        }
    }
    // Runs only count while another process still had sections to do on the key: once a
    // process is alone, it keeps the lock by right.
    let (mut max_run, mut switches) = (0u64, 0u64);
    let (mut max_tenure, mut max_tenures_in_row) = (0u64, 0u64);
    for seq in &mut per_key {
        seq.sort_unstable();
        let mut last_end: HashMap<usize, u64> = HashMap::new();
        for &(end, p, _) in seq.iter() {
            last_end.insert(p, end);
        }
        let others_until = |p: usize| {
            last_end
                .iter()
                .filter(|&(&q, _)| q != p)
                .map(|(_, &e)| e)
                .max()
                .unwrap_or(0)
        };
        let (mut run, mut prev) = (0u64, None);
        let (mut tenures, mut tenure, mut prev_fence) = (0u64, 0u64, None);
        for &(end, p, fence) in seq.iter() {
            let contested = end < others_until(p);
            if prev == Some(p) {
                run += 1;
            } else {
                switches += u64::from(prev.is_some());
                run = 1;
                tenures = 0;
                prev = Some(p);
            }
            if prev_fence == Some(fence) {
                tenure += 1;
            } else {
                tenure = 1;
                tenures += 1;
                prev_fence = Some(fence);
            }
            max_tenure = max_tenure.max(tenure);
            if contested {
                max_run = max_run.max(run);
                max_tenures_in_row = max_tenures_in_row.max(tenures);
            }
        }
    }
    let process_max_gap_us = reports
        .iter()
        .map(|r| {
            let mut done: Vec<u64> = r
                .threads
                .iter()
                .flat_map(|t| t.done_us.iter().copied())
                .collect();
            done.sort_unstable();
            let mut last = 0;
            let mut gap = 0;
            for d in done {
                gap = gap.max(d.saturating_sub(last));
                last = d;
            }
            gap
        })
        .max()
        .unwrap_or(0);
    let mut finish: Vec<u64> = reports
        .iter()
        .map(|r| {
            r.threads
                .iter()
                .filter_map(|t| t.done_us.last().copied())
                .max()
                .unwrap_or(0)
        })
        .collect();
    finish.sort_unstable();
    let (tail_alone_us, tail_alone_sections) = match finish[..] {
        [.., second, last] => (
            last - second,
            reports
                .iter()
                .flat_map(|r| &r.threads)
                .flat_map(|t| &t.done_us)
                .filter(|&&d| d > second)
                .count() as u64,
        ),
        _ => (0, 0),
    };
    Fairness {
        first_finish_us,
        tail_alone_us,
        tail_alone_sections,
        thread_min: thread_counts.iter().copied().min().unwrap_or(0),
        thread_max: thread_counts.iter().copied().max().unwrap_or(0),
        process_min: process_counts.iter().copied().min().unwrap_or(0),
        process_max: process_counts.iter().copied().max().unwrap_or(0),
        max_run,
        switches,
        max_tenure,
        max_tenures_in_row,
        process_max_gap_us,
    }
}
