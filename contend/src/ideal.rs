//! The `ideal` row: the strategies' critical sections run back to back by one thread of
//! the parent, with no lock at all.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::Res;
use crate::ctx::Ctx;
use crate::measure::percentile;
use crate::results::{Commands, Counter, IdealResult};
use crate::server::{cleanup, raw_conn};
use crate::settings::Settings;
use crate::workload::{counter_key, hold_for};

/// At most this many sections for the ideal row; beyond, its rate is extrapolated.
pub const IDEAL_CAP: usize = 5_000;

/// One half of the ideal row.
pub struct IdealPart {
    pub measured: Duration,
    /// How long each section took, µs.
    pub times: Vec<u64>,
    pub commands: Commands,
    /// Counter values found, and expected, per key.
    pub actual: Vec<u64>,
    pub expected: Vec<u64>,
}

/// `n` of the strategies' critical sections (GET, hold, SET on the same server) run back
/// to back by this thread, with no lock.
pub fn run_ideal_part(ctx: &mut Ctx, s: &Settings, run_id: &str, n: usize) -> Res<IdealPart> {
    let prefix = format!("contend:{run_id}:ideal:");
    let counters: Vec<String> = (0..s.keys).map(|k| counter_key(&prefix, k)).collect();
    for c in &counters {
        redis::cmd("SET")
            .arg(c)
            .arg(0)
            .query::<()>(&mut ctx.admin)?;
    }
    let mut conn = raw_conn(ctx.counter_url())?;
    let hold = Duration::from_micros(s.hold_us);
    let mut times = Vec::with_capacity(n);

    ctx.lab.meter.reset(&mut ctx.admin);
    let before = ctx.lab.meter.read(&mut ctx.admin)?;
    let started = Instant::now();
    for i in 0..n {
        let k = i % s.keys;
        let t0 = Instant::now();
        let v: Option<u64> = redis::cmd("GET").arg(&counters[k]).query(&mut conn)?;
        hold_for(hold, s.spin);
        redis::cmd("SET")
            .arg(&counters[k])
            .arg(v.unwrap_or(0) + 1)
            .query::<()>(&mut conn)?;
        times.push(t0.elapsed().as_micros() as u64);
    }
    let measured = started.elapsed();
    let after = ctx.lab.meter.read(&mut ctx.admin)?;
    drop(conn);

    let mut actual = Vec::with_capacity(s.keys);
    for c in &counters {
        let v: Option<u64> = redis::cmd("GET").arg(c).query(&mut ctx.admin)?;
        actual.push(v.unwrap_or(0));
    }
    cleanup(&mut ctx.admin, &prefix)?;
    Ok(IdealPart {
        measured,
        times,
        commands: ctx.lab.meter.net(&before, &after, n as u64),
        actual,
        expected: (0..s.keys)
            .map(|k| (0..n).filter(|i| i % s.keys == k).count() as u64)
            .collect(),
    })
}

/// The ideal row from its halves, run before and after the strategies (so that a machine
/// whose load drifts during the run weighs on both alike).
pub fn ideal_result(s: &Settings, parts: &[IdealPart]) -> IdealResult {
    let total = s.total_sections() as u64;
    let run: u64 = parts.iter().map(|p| p.times.len() as u64).sum();
    let measured: Duration = parts.iter().map(|p| p.measured).sum();
    let rate = run as f64 / measured.as_secs_f64().max(1e-9);
    let mut times: Vec<u64> = parts.iter().flat_map(|p| p.times.iter().copied()).collect();
    times.sort_unstable();
    let mut by_command: HashMap<String, u64> = HashMap::new();
    for p in parts {
        for (name, n) in &p.commands.by_command {
            *by_command.entry(name.clone()).or_default() += n;
        }
    }
    let sum = |f: fn(&Commands) -> u64| parts.iter().map(|p| f(&p.commands)).sum::<u64>();
    let (lock, sent) = (sum(|c| c.lock), sum(|c| c.sent));
    let per = |n: u64| n as f64 / run.max(1) as f64;
    let actual: u64 = parts.iter().flat_map(|p| &p.actual).sum();
    IdealResult {
        sections: total,
        sections_run: run,
        measured_s: measured.as_secs_f64(),
        elapsed_s: total as f64 / rate,
        sections_per_s: rate,
        parts_per_s: parts
            .iter()
            .map(|p| p.times.len() as f64 / p.measured.as_secs_f64().max(1e-9))
            .collect(),
        section_p50_us: percentile(&times, 0.50),
        section_p99_us: percentile(&times, 0.99),
        commands: Commands {
            server_total: sum(|c| c.server_total),
            counter: sum(|c| c.counter),
            lock,
            lock_per_section: per(lock),
            sent,
            sent_per_section: per(sent),
            on_replicas: parts
                .iter()
                .map(|p| p.commands.on_replicas)
                .sum::<Option<u64>>(),
            by_command,
        },
        counter: Counter {
            expected: run,
            actual,
            exact: parts.iter().all(|p| p.actual == p.expected),
            lost: 0,
        },
    }
}
