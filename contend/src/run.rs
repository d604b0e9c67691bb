//! Running one configuration: its ideal row and each strategy's worker processes, with
//! the server's counters read around them.

use std::io::Write;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use redbaton_testkit::keys::{fence_of, handoff_of};

use crate::Res;
use crate::ctx::Ctx;
use crate::ideal::{IDEAL_CAP, ideal_result, run_ideal_part};
use crate::measure::{fairness, waits};
use crate::protocol::{ClientStats, Msg, WorkerReport};
use crate::results::{ConfigResult, Counter, StrategyResult};
use crate::server::cleanup;
use crate::settings::Settings;
use crate::strategy::Strategy;
use crate::workers::{EXIT_TIMEOUT, READY_TIMEOUT, next_msg, spawn_workers};
use crate::workload::{counter_key, mono_us};

pub fn run_strategy(
    ctx: &mut Ctx,
    s: &Settings,
    strategy: Strategy,
    label: &str,
    run_id: &str,
) -> Res<StrategyResult> {
    let per_thread = s.sections_for(strategy);
    let prefix = format!("contend:{run_id}:{}:", strategy.name());
    for k in 0..s.keys {
        redis::cmd("SET")
            .arg(counter_key(&prefix, k))
            .arg(0)
            .query::<()>(&mut ctx.admin)?;
    }
    ctx.bar.set_message(format!("{label}{}", strategy.name()));
    let (mut workers, rx) = spawn_workers(
        &ctx.lab.url,
        ctx.lab.cluster,
        ctx.lab.counter_url.as_deref(),
        &prefix,
        strategy,
        s,
    )?;
    for _ in 0..s.processes {
        match next_msg(&rx, READY_TIMEOUT, "starting")? {
            (_, Msg::Ready) => {}
            (id, other) => return Err(format!("worker {id}: unexpected {other:?}").into()),
        }
    }

    // Window opens: fresh server counters, then a baseline reading.
    ctx.lab.meter.reset(&mut ctx.admin);
    let before = ctx.lab.meter.read(&mut ctx.admin)?;
    let base = mono_us();
    let started = Instant::now();
    for stdin in workers.stdins.iter_mut().flatten() {
        // Also the time origin of the workers' completion times.
        writeln!(stdin, "go {base}")?;
        stdin.flush()?;
    }
    let offset = ctx.bar.position();
    let mut progress = vec![0u64; s.processes];
    let mut reports: Vec<Option<WorkerReport>> = (0..s.processes).map(|_| None).collect();
    while reports.iter().any(Option::is_none) {
        match next_msg(&rx, ctx.stall, "running")? {
            (id, Msg::Progress { done }) => progress[id] = done,
            (id, Msg::Done(report)) => {
                progress[id] = report.threads.iter().map(|t| t.done_us.len() as u64).sum();
                reports[id] = Some(report);
            }
            (id, other) => return Err(format!("worker {id}: unexpected {other:?}").into()),
        }
        ctx.bar.set_position(offset + progress.iter().sum::<u64>());
    }
    let wall = started.elapsed();
    let after = ctx.lab.meter.read(&mut ctx.admin)?;
    // Window closed: let the workers go.
    workers.stdins.clear();
    let deadline = Instant::now() + EXIT_TIMEOUT;
    for child in &mut workers.children {
        while matches!(child.try_wait(), Ok(None)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    drop(workers);

    let reports: Vec<WorkerReport> = reports.into_iter().flatten().collect();
    if let Some(csv) = &mut ctx.csv {
        write_sections_csv(csv, ctx.csv_tag, s, strategy, &reports)?;
        csv.flush()?;
    }
    let mut counters = Vec::with_capacity(s.keys);
    for k in 0..s.keys {
        let n: Option<u64> = redis::cmd("GET")
            .arg(counter_key(&prefix, k))
            .query(&mut ctx.admin)?;
        counters.push(n.unwrap_or(0));
    }
    cleanup(&mut ctx.admin, &prefix)?;
    ctx.lab.meter.cleanup(&prefix)?;

    // Sections, waits, fairness. The run lasts from `go` to the last section's end (the
    // workers' reports arrive a little later).
    let last_done_us = reports
        .iter()
        .flat_map(|r| &r.threads)
        .filter_map(|t| t.done_us.last().copied())
        .max()
        .unwrap_or(0);
    let elapsed = if last_done_us > 0 {
        Duration::from_micros(last_done_us)
    } else {
        wall
    };
    let sections: u64 = reports
        .iter()
        .flat_map(|r| &r.threads)
        .map(|t| t.done_us.len() as u64)
        .sum();
    let wait = waits(&reports);
    let fairness = fairness(&reports, s);

    let commands = ctx.lab.meter.net(&before, &after, sections);

    // The counters in Redis must match the sections done on each key, across processes.
    let mut per_key = vec![0u64; s.keys];
    for r in &reports {
        for (total, n) in per_key.iter_mut().zip(&r.key_counts) {
            *total += n;
        }
    }
    let lost: u64 = reports.iter().map(|r| r.lost).sum();
    let expected = (s.processes * s.threads * per_thread) as u64;
    let actual: u64 = counters.iter().sum();
    let counter = Counter {
        expected,
        actual,
        exact: counters == per_key && actual == expected && lost == 0,
        lost,
    };
    let mut client_stats = ClientStats::default();
    for r in &reports {
        client_stats.add(&r.stats);
    }
    Ok(StrategyResult {
        strategy,
        sections_per_thread: per_thread,
        sections,
        elapsed_s: elapsed.as_secs_f64(),
        wall_s: wall.as_secs_f64(),
        sections_per_s: sections as f64 / elapsed.as_secs_f64().max(1e-9),
        wait,
        commands,
        fairness,
        counter,
        client_stats,
        process_stats: reports.iter().map(|r| r.stats).collect(),
        pct_ideal: 0.0,
    })
}

/// Appends one `--sections-csv` line per critical section of `reports`.
fn write_sections_csv(
    csv: &mut impl Write,
    tag: &str,
    s: &Settings,
    strategy: Strategy,
    reports: &[WorkerReport],
) -> Res<()> {
    let config = format!("{tag}{}x{}", s.processes, s.threads);
    for r in reports {
        for (t, th) in r.threads.iter().enumerate() {
            let global = r.worker * s.threads + t;
            for (i, ((&end, &wait), &fence)) in th
                .done_us
                .iter()
                .zip(&th.waits_us)
                .zip(&th.fences)
                .enumerate()
            {
                writeln!(
                    csv,
                    "{config},{},{},{},{t},{i},{end},{wait},{},{}",
                    strategy.name(),
                    (global + i) % s.keys,
                    r.worker,
                    fence_of(fence),
                    handoff_of(fence),
                )?;
            }
        }
    }
    Ok(())
}

pub fn make_bar(hidden: bool, total: u64) -> Res<ProgressBar> {
    if hidden {
        return Ok(ProgressBar::hidden());
    }
    let bar = ProgressBar::new(total);
    bar.set_style(
        ProgressStyle::with_template(
            "{msg:>20} [{bar:40}] {pos}/{len} sections  {elapsed_precise}",
        )?
        .progress_chars("=> "),
    );
    Ok(bar)
}

/// One configuration: the ideal row, then each strategy.
pub fn run_config(
    ctx: &mut Ctx,
    s: &Settings,
    strategies: &[Strategy],
    label: &str,
    run_id: &str,
) -> Res<ConfigResult> {
    let n = s.total_sections().min(IDEAL_CAP);
    ctx.bar.set_message(format!("{label}ideal"));
    let first = run_ideal_part(ctx, s, run_id, n / 2)?;
    let mut results = Vec::new();
    for &strategy in strategies {
        results.push(run_strategy(ctx, s, strategy, label, run_id)?);
    }
    ctx.bar.set_message(format!("{label}ideal"));
    let second = run_ideal_part(ctx, s, run_id, n - n / 2)?;
    let ideal = ideal_result(s, &[first, second]);
    for r in &mut results {
        r.pct_ideal = 100.0 * r.sections_per_s / ideal.sections_per_s.max(1e-9);
    }
    Ok(ConfigResult {
        settings: s.clone(),
        handoff_budget: s.budget(),
        ideal,
        results,
    })
}
