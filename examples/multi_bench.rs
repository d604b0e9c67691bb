//! multi_bench: a multi-lock of 4 names on one hash slot against the same 4 names taken
//! one after the other with `lock()`, uncontended, from one thread.
//!
//! Each round takes all 4 names and gives them back. It prints, per way, the Redis round
//! trips per round (the client's own count of commands sent, `Stats::commands`: a
//! pipelined release counts once) and the p50 and p99 of a round's time.
//!
//! ```text
//! cargo run --release --example multi_bench               # 2000 rounds, one node
//! cargo run --release --example multi_bench -- 5000       # rounds
//! cargo run --release --example multi_bench -- --cluster  # 4 names of one Cluster slot
//! REDIS_URL=redis://127.0.0.1:6379/ cargo run --release --example multi_bench
//! ```
//!
//! Without `REDIS_URL` a throwaway `redis-server` is started (it must be on `PATH`); with
//! `--cluster`, a throwaway Redis Cluster of three masters, and 4 names whose keys share
//! one slot (outside a cluster every name is on the one node, so in one script anyway).

use std::time::{Duration, Instant};

use redbaton::LockClient;
use redbaton_testkit::cluster::Cluster;
use redbaton_testkit::keys::Keys;

/// A multi-lock of 4 names on one hash slot against the same 4 names taken one after the
/// other with lock(), uncontended: round trips per round, p50 and p99 of a round.
///
/// Redis: $REDIS_URL when set; else a throwaway redis-server (it must be on PATH); with
/// --cluster, a throwaway Redis Cluster of three masters.
#[derive(clap::Parser)]
struct Cli {
    /// Rounds per way (after a warm-up of a tenth as many).
    #[arg(default_value_t = 2000)]
    rounds: usize,
    /// Against a throwaway Redis Cluster, 4 names whose keys share one slot.
    #[arg(long)]
    cluster: bool,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let Cli {
        rounds,
        cluster: on_cluster,
    } = clap::Parser::parse();
    // Kept running until the end.
    let (_server, _cluster, client, names) = if on_cluster {
        let cluster = Cluster::start();
        let client = LockClient::builder().cluster(cluster.seed_urls()).build()?;
        let (slot, names) = cluster.names_in_one_slot(&Keys::DEFAULT, "bench-", 4);
        println!("Redis Cluster, 4 names of slot {slot}");
        (None, Some(cluster), client, names)
    } else {
        let (url, server) = redbaton_testkit::example_redis(false);
        let client = LockClient::builder().node(url).build()?;
        println!("one node");
        let names = (0..4).map(|i| format!("{{acct}}:{i}")).collect();
        (server, None, client, names)
    };
    println!("{rounds} rounds of 4 names, uncontended");
    println!(
        "{:<20} {:>13} {:>10} {:>10}",
        "way", "trips/round", "p50 us", "p99 us"
    );
    let multi = measure(&client, rounds, || {
        client.multi_lock(&names)?.unlock()?;
        Ok(())
    })?;
    multi.print("multi_lock");
    let separate = measure(&client, rounds, || {
        let guards = names
            .iter()
            .map(|n| client.lock(n))
            .collect::<redbaton::Result<Vec<_>>>()?;
        for g in guards {
            g.unlock()?;
        }
        Ok(())
    })?;
    separate.print("4 x lock, in turn");
    println!(
        "multi_lock: {:.1}x fewer round trips, p50 {:.1}x",
        separate.trips / multi.trips,
        separate.p50.as_secs_f64() / multi.p50.as_secs_f64()
    );
    Ok(())
}

/// Round trips per round and round times of one way of taking the names.
struct Figures {
    trips: f64,
    p50: Duration,
    p99: Duration,
}

impl Figures {
    fn print(&self, way: &str) {
        println!(
            "{way:<20} {:>13.2} {:>10} {:>10}",
            self.trips,
            self.p50.as_micros(),
            self.p99.as_micros()
        );
    }
}

/// Runs `round` `rounds` times (after a warm-up of a tenth as many).
fn measure(
    client: &LockClient,
    rounds: usize,
    mut round: impl FnMut() -> redbaton::Result<()>,
) -> redbaton::Result<Figures> {
    for _ in 0..rounds / 10 {
        round()?;
    }
    let before = client.stats().commands;
    let mut times = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        let t = Instant::now();
        round()?;
        times.push(t.elapsed());
    }
    let trips = (client.stats().commands - before) as f64 / rounds as f64;
    times.sort();
    let at = |q: f64| times[((times.len() as f64 * q) as usize).min(times.len() - 1)];
    Ok(Figures {
        trips,
        p50: at(0.5),
        p99: at(0.99),
    })
}
