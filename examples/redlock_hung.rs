//! Redlock with one node hung: `lock()` + `unlock()` latency from several threads, with
//! every node healthy, then with one of three nodes stopped (SIGSTOP: it keeps its sockets
//! and answers nothing, so each call to it waits out the read timeout).
//!
//! ```text
//! cargo run --release --example redlock_hung
//! REDLOCK_HUNG_ITERS=400 REDLOCK_HUNG_THREADS=8 cargo run --release --example redlock_hung
//! ```
//!
//! Starts its own throwaway redis-servers. Each thread locks and unlocks its own key in a
//! loop (no contention between threads: only the fan-out to the nodes is shared). Prints
//! p50/p90/p99/max per phase.

use std::thread;
use std::time::{Duration, Instant};

use redbaton::LockClient;
use redbaton_testkit::server;

const READ_TIMEOUT: Duration = Duration::from_millis(100);

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn run(client: &LockClient, threads: usize, iters: usize, tag: &str) -> Vec<Duration> {
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let c = client.clone();
            let name = format!("{tag}-{t}");
            thread::spawn(move || {
                let mut samples = Vec::with_capacity(iters);
                for _ in 0..iters {
                    let started = Instant::now();
                    match c.lock(&name) {
                        Ok(g) => {
                            let _ = g.unlock();
                        }
                        Err(e) => eprintln!("lock failed: {e}"),
                    }
                    samples.push(started.elapsed());
                }
                samples
            })
        })
        .collect();
    handles
        .into_iter()
        .flat_map(|h| h.join().expect("worker"))
        .collect()
}

fn report(phase: &str, mut s: Vec<Duration>) {
    s.sort_unstable();
    let at = |q: f64| s[((s.len() - 1) as f64 * q).round() as usize];
    println!(
        "{phase:<22} n={:<5} p50={:>9.2?} p90={:>9.2?} p99={:>9.2?} max={:>9.2?}",
        s.len(),
        at(0.50),
        at(0.90),
        at(0.99),
        s[s.len() - 1]
    );
}

/// Redlock with one node hung: lock() + unlock() latency from several threads with three
/// healthy nodes, then with one of them stopped (SIGSTOP): p50/p90/p99/max per phase.
///
/// Starts its own three throwaway redis-servers. REDLOCK_HUNG_ITERS (200) sets the
/// iterations per thread, REDLOCK_HUNG_THREADS (4) the threads.
#[derive(clap::Parser)]
struct Cli {}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    <Cli as clap::Parser>::parse();
    let iters = env("REDLOCK_HUNG_ITERS", 200);
    let threads = env("REDLOCK_HUNG_THREADS", 4);
    let servers = server::start_many(3);
    let client = LockClient::builder()
        .nodes(servers.iter().map(|s| s.url()))
        .connect_timeout(READ_TIMEOUT)
        .read_timeout(READ_TIMEOUT)
        .write_timeout(READ_TIMEOUT)
        .build()?;
    println!("3 nodes, {threads} threads x {iters} lock+unlock, read timeout {READ_TIMEOUT:?}");
    run(&client, threads, iters / 10 + 1, "warmup");
    report("all nodes healthy", run(&client, threads, iters, "healthy"));
    servers[2].pause();
    let hung = run(&client, threads, iters, "hung");
    servers[2].resume();
    report("one node hung", hung);
    Ok(())
}
