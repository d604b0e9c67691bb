//! latch_bench: how long a countdown latch's waiters take to return after the count down
//! that opens it, beside a `PING` round trip measured in the same run.
//!
//! Each of N rounds uses a new latch of count 2: one client counts it down once, W threads
//! of another client start waiting (they subscribe to the name's channel, then read the
//! count and sleep), and after a pause that lets them fall asleep the first client counts
//! it down again. A waiter's latency is from just before that last `count_down()` call to
//! its own return: the count down's round trip, the `SPUBLISH` (or `PUBLISH`) reaching
//! the waiters' subscriber thread, its wake-up of the waiter, and the waiter's confirming
//! read. It prints p50 and p99 of that, of the `count_down()` call alone, and of `PING`.
//!
//! ```text
//! cargo run --release --example latch_bench              # N=200 rounds, W=4 waiters
//! cargo run --release --example latch_bench -- 500 8     # N W
//! REDIS_URL=redis://127.0.0.1:6379/ cargo run --release --example latch_bench
//! ```
//!
//! Without `REDIS_URL` a throwaway `redis-server` is started (it must be on `PATH`).

use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

/// How long the waiters get to subscribe, read and fall asleep before the last count down.
const SETTLE: Duration = Duration::from_millis(20);

/// How long a countdown latch's waiters take to return after the count down that opens
/// it, beside a PING round trip (p50 and p99).
///
/// Redis: $REDIS_URL when set; else a throwaway redis-server (it must be on PATH).
#[derive(clap::Parser)]
struct Cli {
    /// Rounds, each on a new latch of count 2.
    #[arg(default_value_t = 200)]
    rounds: usize,
    /// Threads waiting on each latch.
    #[arg(default_value_t = 4)]
    waiters: usize,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let Cli { rounds, waiters } = clap::Parser::parse();
    let (url, _server) = redbaton_testkit::example_redis(false);
    let build = || redbaton::LockClient::builder().node(url.as_str()).build();
    let (counter, waiting) = (build()?, build()?);

    let mut ping = Vec::with_capacity(1000);
    let mut conn = redis::Client::open(url.as_str())?.get_connection()?;
    for _ in 0..1000 {
        let t = Instant::now();
        redis::cmd("PING").query::<String>(&mut conn)?;
        ping.push(t.elapsed());
    }

    // One channel per waiter thread: the name to wait for; one back: when it returned.
    let (done_tx, done_rx) = mpsc::channel::<Result<Instant, redbaton::Error>>();
    let names: Vec<mpsc::Sender<String>> = (0..waiters)
        .map(|_| {
            let (tx, rx) = mpsc::channel::<String>();
            let (client, done) = (waiting.clone(), done_tx.clone());
            thread::spawn(move || {
                for name in rx {
                    let r = client.latch(name, 2).wait().map(|()| Instant::now());
                    if done.send(r).is_err() {
                        return;
                    }
                }
            });
            tx
        })
        .collect();

    let (mut wake, mut down) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        let name = format!("latch-bench-{round}");
        let latch = counter.latch(&name, 2);
        latch.count_down()?;
        for tx in &names {
            tx.send(name.clone())?;
        }
        thread::sleep(SETTLE);
        let before = Instant::now();
        latch.count_down()?;
        down.push(before.elapsed());
        for _ in 0..waiters {
            wake.push(done_rx.recv()??.saturating_duration_since(before));
        }
    }

    println!("{rounds} rounds x {waiters} waiters, one redis-server at {url}");
    println!("{:<36} {:>9} {:>9}", "", "p50", "p99");
    for (what, mut samples) in [
        ("PING round trip", ping),
        ("count_down() call", down),
        ("last count_down() to waiter return", wake),
    ] {
        samples.sort_unstable();
        println!(
            "{what:<36} {:>9} {:>9}",
            micros(percentile(&samples, 50)),
            micros(percentile(&samples, 99))
        );
    }
    let s = waiting.stats();
    println!(
        "waiters' wake-ups: {} by event, {} by re-check",
        s.wakeups_event, s.wakeups_recheck
    );
    Ok(())
}

/// The `p`-th percentile of sorted `samples`.
fn percentile(samples: &[Duration], p: usize) -> Duration {
    samples[(samples.len() * p / 100).min(samples.len() - 1)]
}

fn micros(d: Duration) -> String {
    format!("{} us", d.as_micros())
}
