//! The long check: `cargo run --release -p redbaton-model --example deep [-- THREADS [shared]]`.
//!
//! Checks `Config::deep()` (a longer horizon) with every fault, or, with `shared`, the
//! read-write lock's and the semaphore's `SharedConfig::deep()`; then prints the states
//! visited, the time taken and any violation with its path.

use redbaton_model::{Config, Report, SharedConfig, check, check_shared};

fn main() {
    let mut args = std::env::args().skip(1);
    let threads = args.next().and_then(|a| a.parse().ok()).unwrap_or(2);
    let reports: Vec<Report> = if args.next().as_deref() == Some("shared") {
        SharedConfig::deep()
            .into_iter()
            .map(|cfg| {
                println!("checking {cfg:?} on {threads} threads");
                show(check_shared(cfg, threads, None))
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
