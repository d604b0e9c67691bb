//! What TLS and replica acknowledgement cost: uncontended lock + unlock, measured in one
//! run against the same kind of server over plain TCP, over TLS, and with
//! `replica_ack(1, …)` against a master with one replica. Rounds of each are interleaved
//! so that the machine's drift hits all three alike.
//!
//! ```text
//! cargo run --release --example transport            # 5 rounds of 2,000 lock+unlock each
//! cargo run --release --example transport -- 10 5000 # rounds, operations per round
//! ```
//!
//! Starts its own `redis-server` processes (loopback, temp dirs, no persistence).

use std::time::{Duration, Instant};

use redbaton::LockClient;
use redbaton_testkit::server::RedisServer;
use redbaton_testkit::tls::{Certs, TlsServer};

/// What TLS and replica acknowledgement cost: uncontended lock + unlock over plain TCP,
/// over TLS, and with replica_ack(1, ...) against a master with one replica.
///
/// Starts its own redis-server processes (loopback, temp dirs, no persistence; the TLS one
/// needs a redis-server built with TLS).
#[derive(clap::Parser)]
struct Cli {
    /// Rounds; each measures every transport in turn.
    #[arg(default_value_t = 5)]
    rounds: usize,
    /// Lock + unlock operations per transport and round.
    #[arg(default_value_t = 2000)]
    ops: usize,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let Cli { rounds, ops } = clap::Parser::parse();

    let plain = RedisServer::start();
    let certs = Certs::generate();
    let tls = TlsServer::start(&certs, false);
    let master = RedisServer::start();
    let _replica = master.start_replica();

    let clients = [
        (
            "plain TCP",
            LockClient::builder().node(plain.url()).build()?,
        ),
        (
            "TLS",
            LockClient::builder()
                .node(tls.url())
                .tls_ca_cert(certs.ca_pem.clone())
                .build()?,
        ),
        (
            "replica_ack(1)",
            LockClient::builder()
                .node(master.url())
                .replica_ack(1, Duration::from_millis(100))
                .build()?,
        ),
    ];
    let mut samples: Vec<Vec<Duration>> = vec![Vec::new(); clients.len()];
    for _ in 0..rounds {
        for (i, (_, client)) in clients.iter().enumerate() {
            for _ in 0..ops {
                let t = Instant::now();
                client.lock("bench")?.unlock()?;
                samples[i].push(t.elapsed());
            }
        }
    }
    let p = |v: &mut Vec<Duration>, q: f64| {
        v.sort_unstable();
        v[((v.len() - 1) as f64 * q) as usize]
    };
    let mut p50s = Vec::new();
    println!("{rounds} rounds x {ops} uncontended lock+unlock, interleaved");
    println!("{:<16} {:>10} {:>10}", "transport", "p50", "p99");
    for (i, (name, _)) in clients.iter().enumerate() {
        let (p50, p99) = (p(&mut samples[i], 0.5), p(&mut samples[i], 0.99));
        p50s.push(p50);
        println!("{name:<16} {:>8.1}µs {:>8.1}µs", us(p50), us(p99));
    }
    println!(
        "TLS / plain p50:            {:.2}",
        us(p50s[1]) / us(p50s[0])
    );
    println!(
        "replica_ack(1) / plain p50: {:.2}",
        us(p50s[2]) / us(p50s[0])
    );
    Ok(())
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}
