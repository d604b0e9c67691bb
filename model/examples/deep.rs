//! The long check: `cargo run --release -p redbaton-model --example deep [-- THREADS [shared|stalls]]`.
//!
//! Checks `Config::deep()` (a longer horizon) with every fault, or, with `shared`, the
//! read-write lock's and the semaphore's `SharedConfig::deep()`, or, with `stalls`,
//! their `SharedConfig::deep_stalls()`; then prints the states visited, the time taken
//! and any violation with its path.

use redbaton_model::{Config, Report, SharedConfig, check, check_shared};

fn main() {
    let mut args = std::env::args().skip(1);
    let threads = args.next().and_then(|a| a.parse().ok()).unwrap_or(2);
    let shared: Option<Vec<SharedConfig>> = match args.next().as_deref() {
        Some("shared") => Some(SharedConfig::deep().into()),
        Some("stalls") => Some(SharedConfig::deep_stalls().into()),
        _ => None,
    };
    let reports: Vec<Report> = if let Some(configs) = shared {
        configs
            .into_iter()
            .map(|cfg| {
                println!("checking {cfg:?} on {threads} threads");
                // One permit is never shared.
                let one_permit = cfg.permits == 1;
                let mut report = show(check_shared(cfg, threads, None));
                report
                    .never
                    .retain(|&p| !(one_permit && p == "holds shared"));
                report
            })
            .collect()
    } else {
        let cfg = Config::deep();
        println!("checking {cfg:?} on {threads} threads");
        vec![show(check(cfg, threads, None))]
    };
    if reports
        .iter()
        .any(|r| !r.violations.is_empty() || !r.never.is_empty())
    {
        std::process::exit(1);
    }
}

fn show(report: Report) -> Report {
    println!(
        "{} states, depth {}, {:.1?}, complete: {}",
        report.states, report.depth, report.elapsed, report.complete
    );
    for (name, steps, path) in &report.violations {
        println!("VIOLATED {name} after {steps} steps:\n{path}");
    }
    for name in &report.never {
        println!("never seen: {name}");
    }
    report
}
