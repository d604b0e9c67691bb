//! The printed report: the table (or the matrix's combined table), its legend, and the
//! JSON documents of `--json`.

use std::time::Duration;

use serde::Serialize;

use crate::ideal::IDEAL_CAP;
use crate::results::{ConfigResult, IdealResult, StrategyResult};
use crate::settings::{MATRIX_SECTIONS_QUICK, config_label};
use crate::strategy::Strategy;

#[derive(Serialize)]
pub struct Output<'a> {
    pub redis_url: &'a str,
    #[serde(flatten)]
    pub config: &'a ConfigResult,
}

/// `--json` of `--compare-cluster`.
#[derive(Serialize)]
pub struct CompareOutput<'a> {
    pub node: Output<'a>,
    pub cluster: Output<'a>,
    pub ratios: &'a [Ratio],
}

/// `--compare-cluster`'s target for both ratios (cluster ÷ one node).
pub const COMPARE_TARGET: f64 = 1.2;

/// One strategy on a cluster against one node.
#[derive(Serialize, Debug)]
pub struct Ratio {
    pub strategy: Strategy,
    pub node_lock_per_section: f64,
    pub cluster_lock_per_section: f64,
    /// cluster ÷ one node.
    pub lock_ratio: f64,
    /// The cluster's masters only (what the replicas re-run of their masters' writes
    /// left out), the same for the one node (which has a replica with `--node-replica`),
    /// and their ratio.
    pub cluster_masters_lock_per_section: f64,
    pub node_master_lock_per_section: f64,
    pub masters_lock_ratio: f64,
    pub node_wait_p50_us: u64,
    pub cluster_wait_p50_us: u64,
    pub wait_p50_ratio: f64,
    pub node_sections_per_s: f64,
    pub cluster_sections_per_s: f64,
}

/// The ratios of every strategy that ran against both.
pub fn compare_ratios(node: &ConfigResult, cluster: &ConfigResult) -> Vec<Ratio> {
    node.results
        .iter()
        .filter_map(|n| {
            let c = cluster.results.iter().find(|c| c.strategy == n.strategy)?;
            let masters = |r: &StrategyResult| {
                (r.commands.lock - r.commands.on_replicas.unwrap_or(0)) as f64
                    / r.sections.max(1) as f64
            };
            let (cm, nm) = (masters(c), masters(n));
            Some(Ratio {
                cluster_masters_lock_per_section: cm,
                node_master_lock_per_section: nm,
                masters_lock_ratio: cm / nm.max(1e-9),
                strategy: n.strategy,
                node_lock_per_section: n.commands.lock_per_section,
                cluster_lock_per_section: c.commands.lock_per_section,
                lock_ratio: c.commands.lock_per_section / n.commands.lock_per_section.max(1e-9),
                node_wait_p50_us: n.wait.p50_us,
                cluster_wait_p50_us: c.wait.p50_us,
                wait_p50_ratio: c.wait.p50_us as f64 / n.wait.p50_us.max(1) as f64,
                node_sections_per_s: n.sections_per_s,
                cluster_sections_per_s: c.sections_per_s,
            })
        })
        .collect()
}

pub fn print_ratios(ratios: &[Ratio]) {
    let mark = |x: f64| {
        if x <= COMPARE_TARGET {
            "met"
        } else {
            "NOT met"
        }
    };
    for r in ratios {
        println!(
            "{}: Redis lock commands per section, cluster masters ÷ one node: {:.2} ÷ {:.2} = {:.2} (target ≤ {COMPARE_TARGET}: {})",
            r.strategy.name(),
            r.cluster_masters_lock_per_section,
            r.node_master_lock_per_section,
            r.masters_lock_ratio,
            mark(r.masters_lock_ratio),
        );
        println!(
            "{}: the same with what the replicas re-ran of their masters' writes, on both sides (a one node without a replica has none: see --node-replica): {:.2} ÷ {:.2} = {:.2}",
            r.strategy.name(),
            r.cluster_lock_per_section,
            r.node_lock_per_section,
            r.lock_ratio,
        );
        println!(
            "{}: wait p50 under this load (queueing included), cluster ÷ one node: {} ÷ {} = {:.2}",
            r.strategy.name(),
            fmt_us(r.cluster_wait_p50_us),
            fmt_us(r.node_wait_p50_us),
            r.wait_p50_ratio,
        );
    }
    println!(
        "(The cross-process handoff p50 of one node and of a cluster: cargo run --release --example handoff -- --compare-cluster)"
    );
}

#[derive(Serialize)]
pub struct MatrixOutput<'a> {
    pub redis_url: &'a str,
    pub matrix: bool,
    pub elapsed_s: f64,
    pub configs: &'a [ConfigResult],
    pub target: Option<Target>,
}

/// The baton's target: 1 process × 8 threads, notify+handoff, at least 80% of ideal.
#[derive(Serialize, Debug)]
pub struct Target {
    pub pct_ideal: f64,
    pub sent_per_section: f64,
    pub lock_per_section: f64,
    /// pct_ideal ≥ 80.
    pub throughput_met: bool,
    /// Fewer than 0.2 commands per section, sent by clients / run by the server.
    pub sent_met: bool,
    pub server_side_met: bool,
}

pub fn fmt_us(us: u64) -> String {
    match us {
        0..1_000 => format!("{us}µs"),
        1_000..10_000 => format!("{:.2}ms", us as f64 / 1e3),
        10_000..1_000_000 => format!("{:.1}ms", us as f64 / 1e3),
        _ => format!("{:.2}s", us as f64 / 1e6),
    }
}

pub fn fmt_rate(x: f64) -> String {
    if x >= 100.0 {
        format!("{x:.0}")
    } else {
        format!("{x:.1}")
    }
}

pub fn fmt_pct(x: f64) -> String {
    if x >= 10.0 {
        format!("{x:.0}%")
    } else {
        format!("{x:.1}%")
    }
}

/// Table columns after the first one(s): (title, width); the counter column follows.
pub const COLUMNS: [(&str, usize); 11] = [
    ("sect/s", 9),
    ("% ideal", 8),
    ("wait p50", 9),
    ("p99", 9),
    ("max", 9),
    ("cmds/sect", 10),
    ("sent/sect", 10),
    ("thr min-max", 12),
    ("proc min-max", 13),
    ("proc gap", 9),
    ("1st/last", 9),
];

pub fn table_line(first: &[(&str, usize)], cells: &[String], last: &str) -> String {
    let mut line = String::new();
    for (text, width) in first {
        line.push_str(&format!("{text:<width$} "));
    }
    for (cell, (_, width)) in cells.iter().zip(COLUMNS) {
        line.push_str(&format!("{cell:>width$} "));
    }
    line.push(' ');
    line.push_str(last);
    line.trim_end().to_owned()
}

pub fn table_header(first: &[(&str, usize)]) -> String {
    let titles: Vec<String> = COLUMNS.iter().map(|(t, _)| t.to_string()).collect();
    let header = table_line(first, &titles, "counter");
    let rule = "-".repeat(header.chars().count() + 8);
    format!("{header}\n{rule}")
}

pub fn ideal_cells(i: &IdealResult) -> (Vec<String>, String) {
    let dash = || "-".to_owned();
    let cells = vec![
        fmt_rate(i.sections_per_s),
        "100%".to_owned(),
        dash(),
        dash(),
        dash(),
        format!("{:.2}", i.commands.lock_per_section),
        format!("{:.2}", i.commands.sent_per_section),
        dash(),
        dash(),
        dash(),
        dash(),
    ];
    let counter = if i.counter.exact {
        format!("exact {}", i.counter.actual)
    } else {
        format!("WRONG {}/{}", i.counter.actual, i.counter.expected)
    };
    (cells, counter)
}

pub fn result_cells(r: &StrategyResult) -> (Vec<String>, String) {
    let f = &r.fairness;
    let cells = vec![
        fmt_rate(r.sections_per_s),
        fmt_pct(r.pct_ideal),
        fmt_us(r.wait.p50_us),
        fmt_us(r.wait.p99_us),
        fmt_us(r.wait.max_us),
        format!("{:.2}", r.commands.lock_per_section),
        format!("{:.2}", r.commands.sent_per_section),
        format!("{}-{}", f.thread_min, f.thread_max),
        format!("{}-{}", f.process_min, f.process_max),
        fmt_us(f.process_max_gap_us),
        format!(
            "{:.2}",
            f.first_finish_us as f64 / (r.elapsed_s * 1e6).max(1.0)
        ),
    ];
    let counter = if r.counter.exact {
        format!("exact {}", r.counter.actual)
    } else {
        format!(
            "WRONG {}/{} (lost {})",
            r.counter.actual, r.counter.expected, r.counter.lost
        )
    };
    (cells, counter)
}

pub const LEGEND: &str = "\
ideal     = the same critical sections (GET, hold, SET) back to back in ONE thread with NO lock.
% ideal   = sections/s ÷ ideal's sections/s.
wait      = time spent in lock().
cmds/sect = Redis commands per critical section (INFO commandstats), EXCLUDING the counter's GET+SET
            (2 per section) and the tool's own INFO; includes what the Lua scripts run inside EVALSHA.
sent/sect = the same, counting only the commands clients sent (round trips).
thr/proc min-max = sections done by the slowest / fastest thread and process when the first thread
            finished its S (all reach S in the end).
proc gap  = the longest time a process completed no section (from go to its last section).
1st/last  = when the first thread finished ÷ when the last did (1.00: all finished together).
counter   = every Redis counter (GET+SET under the lock) equals the sections done on its key.";

pub fn ideal_note(i: &IdealResult) -> String {
    let run = if i.sections_run < i.sections {
        format!(
            "{} of its {} sections run, time extrapolated",
            i.sections_run, i.sections
        )
    } else {
        format!("{} sections", i.sections_run)
    };
    let halves: Vec<String> = i.parts_per_s.iter().map(|&r| fmt_rate(r)).collect();
    format!(
        "{run} (half before, half after the strategies: {}/s); one section took p50 {} / p99 {}",
        halves.join(" and "),
        fmt_us(i.section_p50_us),
        fmt_us(i.section_p99_us)
    )
}

pub fn print_table(url: &str, c: &ConfigResult) {
    let s = &c.settings;
    println!(
        "contend: P={} processes × T={} threads × S={} sections (poll-100ms: {}) of H={} on K={} key{}, lease {} ms, redis {url}",
        s.processes,
        s.threads,
        s.sections,
        s.slow_sections,
        s.hold_desc(),
        s.keys,
        if s.keys == 1 { "" } else { "s" },
        s.lease_ms,
    );
    println!("notify+handoff budget: {}", c.handoff_budget);
    println!("ideal: {}", ideal_note(&c.ideal));
    println!("{LEGEND}");
    println!();
    let first = [("strategy", 15)];
    println!("{}", table_header(&first));
    let (cells, counter) = ideal_cells(&c.ideal);
    println!("{}", table_line(&[("ideal", 15)], &cells, &counter));
    for r in &c.results {
        let (cells, counter) = result_cells(r);
        println!(
            "{}",
            table_line(&[(r.strategy.name(), 15)], &cells, &counter)
        );
    }
    print_split(c);
}

/// Over lock-only servers (`--cluster`, `--compare-cluster`): what the command columns
/// count, and how much of it replicas ran.
fn print_split(c: &ConfigResult) {
    if c.ideal.commands.on_replicas.is_none() {
        return;
    }
    println!(
        "cmds/sect here: every call on the lock servers (replicas included), counters apart, without replconf, ping, cluster, info and client; sent/sect: masters only."
    );
    for r in &c.results {
        let Some(rep) = r.commands.on_replicas else {
            continue;
        };
        let per = |n: u64| n as f64 / r.sections.max(1) as f64;
        println!(
            "{}: cmds/sect {:.2} = masters {:.2} + replicas {:.2}",
            r.strategy.name(),
            r.commands.lock_per_section,
            per(r.commands.lock - rep),
            per(rep),
        );
    }
}

pub fn print_matrix(
    url: &str,
    configs: &[ConfigResult],
    elapsed: Duration,
    target: Option<&Target>,
) {
    let Some(s) = configs.first().map(|c| &c.settings) else {
        return;
    };
    println!(
        "contend --matrix: processes × threads ∈ {{1×2, 1×8, 1×32, 4×8}}, S={} sections per thread of H={} on K={} key{}, lease {} ms, redis {url}",
        s.sections,
        s.hold_desc(),
        s.keys,
        if s.keys == 1 { "" } else { "s" },
        s.lease_ms,
    );
    println!(
        "S is sized so that the whole matrix takes about a minute on 2 cores (--quick: S={MATRIX_SECTIONS_QUICK}); this one took {:.0} s.",
        elapsed.as_secs_f64()
    );
    println!("notify+handoff budget: {}", configs[0].handoff_budget);
    println!(
        "ideal: P × T × S sections (at most {IDEAL_CAP}; beyond that the rate is measured on {IDEAL_CAP}), half before and half after each configuration's strategies."
    );
    println!("{LEGEND}");
    println!();
    let first = [("config", 6), ("strategy", 15)];
    println!("{}", table_header(&first));
    for (n, c) in configs.iter().enumerate() {
        if n > 0 {
            println!();
        }
        let label = config_label(&c.settings);
        let (cells, counter) = ideal_cells(&c.ideal);
        println!(
            "{}",
            table_line(&[(&label, 6), ("ideal", 15)], &cells, &counter)
        );
        for r in &c.results {
            let (cells, counter) = result_cells(r);
            println!(
                "{}",
                table_line(&[(&label, 6), (r.strategy.name(), 15)], &cells, &counter)
            );
        }
    }
    println!();
    for c in configs {
        println!(
            "ideal {:<5} {}",
            config_label(&c.settings),
            ideal_note(&c.ideal)
        );
    }
    if let Some(t) = target {
        let mark = |ok: bool| if ok { "met" } else { "NOT met" };
        println!();
        println!(
            "target (1×8, notify+handoff, H=100µs): ≥ 80% of ideal: {} ({}); < 0.2 commands/section: sent {:.3} ({}), server-side {:.3} ({})",
            fmt_pct(t.pct_ideal),
            mark(t.throughput_met),
            t.sent_per_section,
            mark(t.sent_met),
            t.lock_per_section,
            mark(t.server_side_met),
        );
    }
}

pub fn target_of(configs: &[ConfigResult]) -> Option<Target> {
    let c = configs
        .iter()
        .find(|c| c.settings.processes == 1 && c.settings.threads == 8)?;
    let r = c
        .results
        .iter()
        .find(|r| r.strategy == Strategy::NotifyHandoff)?;
    Some(Target {
        pct_ideal: r.pct_ideal,
        sent_per_section: r.commands.sent_per_section,
        lock_per_section: r.commands.lock_per_section,
        throughput_met: r.pct_ideal >= 80.0,
        sent_met: r.commands.sent_per_section < 0.2,
        server_side_met: r.commands.lock_per_section < 0.2,
    })
}
