//! The long check: `cargo run --release -p redbaton-model --example deep [-- THREADS]`.
//!
//! Checks `Config::deep()` (a longer horizon and two locks per thread) with every fault,
//! then prints the states visited, the time taken and any violation with its path.

use redbaton_model::{Config, check};

fn main() {
    let threads = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(2);
    let cfg = Config::deep();
    println!("checking {cfg:?} on {threads} threads");
    let report = check(cfg, threads, None);
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
    if !report.violations.is_empty() || !report.never.is_empty() {
        std::process::exit(1);
    }
}
