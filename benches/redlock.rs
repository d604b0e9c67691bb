//! Redlock latency: uncontended `lock()` + `unlock()` on 5 independent redis-servers,
//! against the same on 1 node, measured in the same run.
//!
//! ```text
//! cargo bench --bench redlock
//! REDLOCK_BENCH_ITERS=5000 cargo bench --bench redlock
//! ```
//!
//! Starts its own throwaway redis-servers (no persistence, temp dirs, free ports) and stops
//! them at the end. One thread, one key, nobody else contending: each iteration is one
//! remote acquisition and one release (a Redlock round sends both to every node in
//! parallel). The two clients are measured in alternating blocks, so that a burst of
//! machine noise hits both alike. Prints p50/p90/p99/max per client and the 5-node/1-node
//! ratios; the goal is a ratio below 1.6.
//!
//! For scale it then prints a floor: the same two round trips (an acquire-like and a
//! release-like script) over raw connections, on 1 node and on 5 nodes, the 5 sent
//! scatter-gather from one thread (write to all, then read all): what any client could
//! reach on this machine. On a 2-core box the 5 servers cannot all run at once, so that
//! floor's ratio is far above 1.6 too.

use std::time::{Duration, Instant};

use redbaton::LockClient;
use redbaton_testkit::server;
use redis::{Connection, ConnectionLike};

const WARMUP: usize = 300;
const BLOCK: usize = 100;

struct Summary {
    p50: Duration,
    p90: Duration,
    p99: Duration,
    max: Duration,
    mean: Duration,
}

fn summarize(mut samples: Vec<Duration>) -> Summary {
    samples.sort_unstable();
    let at = |q: f64| samples[((samples.len() - 1) as f64 * q).round() as usize];
    let total: Duration = samples.iter().sum();
    Summary {
        p50: at(0.50),
        p90: at(0.90),
        p99: at(0.99),
        max: *samples.last().expect("samples"),
        mean: total / samples.len() as u32,
    }
}

fn one(client: &LockClient, name: &str) -> Duration {
    let started = Instant::now();
    let guard = client.lock(name).expect("lock");
    guard.unlock().expect("unlock");
    started.elapsed()
}

fn us(d: Duration) -> String {
    format!("{:.1} µs", d.as_secs_f64() * 1e6)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let iters: usize = std::env::var("REDLOCK_BENCH_ITERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2000)
        .max(BLOCK);
    let servers = server::start_many(6);
    let redlock_urls: Vec<String> = servers[..5].iter().map(|s| s.url()).collect();
    let redlock = LockClient::builder()
        .nodes(redlock_urls)
        .key_prefix("bench:")
        .build()?;
    let single = LockClient::builder()
        .node(servers[5].url())
        .key_prefix("bench:")
        .build()?;

    for _ in 0..WARMUP {
        one(&single, "single");
        one(&redlock, "redlock");
    }
    let (c1, c5) = (single.stats().commands, redlock.stats().commands);

    let mut t1 = Vec::with_capacity(iters);
    let mut t5 = Vec::with_capacity(iters);
    let wall = Instant::now();
    while t1.len() < iters {
        let n = BLOCK.min(iters - t1.len());
        for _ in 0..n {
            t1.push(one(&single, "single"));
        }
        for _ in 0..n {
            t5.push(one(&redlock, "redlock"));
        }
    }
    let wall = wall.elapsed();
    let per_op = |c: u64, before: u64| (c - before) as f64 / iters as f64;
    let cmds1 = per_op(single.stats().commands, c1);
    let cmds5 = per_op(redlock.stats().commands, c5);

    let s1 = summarize(t1);
    let s5 = summarize(t5);
    println!(
        "redlock bench: uncontended lock+unlock, {iters} iterations each after {WARMUP} warm-up, \
         alternating blocks of {BLOCK} ({wall:.2?} total)"
    );
    for (label, s, cmds) in [("1 node ", &s1, cmds1), ("5 nodes", &s5, cmds5)] {
        println!(
            "  {label}: p50 {:>10}  p90 {:>10}  p99 {:>10}  max {:>10}  mean {:>10}  ({cmds:.1} redis commands/op)",
            us(s.p50),
            us(s.p90),
            us(s.p99),
            us(s.max),
            us(s.mean)
        );
    }
    let ratio = |a: Duration, b: Duration| a.as_secs_f64() / b.as_secs_f64();
    let r50 = ratio(s5.p50, s1.p50);
    let r99 = ratio(s5.p99, s1.p99);
    println!(
        "  ratio 5 nodes / 1 node: p50 {r50:.2}x  p99 {r99:.2}x  mean {:.2}x  (goal < 1.6x: {})",
        ratio(s5.mean, s1.mean),
        if r50 < 1.6 {
            "met at p50"
        } else {
            "NOT met at p50"
        }
    );

    let (f1, f5) = raw_floor(&servers, iters);
    println!("raw floor (same scripts, raw connections, no library):");
    for (label, s) in [("1 node ", &f1), ("5 nodes", &f5)] {
        println!(
            "  {label}: p50 {:>10}  p90 {:>10}  p99 {:>10}  max {:>10}  mean {:>10}",
            us(s.p50),
            us(s.p90),
            us(s.p99),
            us(s.max),
            us(s.mean)
        );
    }
    println!(
        "  floor ratio 5 nodes / 1 node: p50 {:.2}x  p99 {:.2}x;  library 5 nodes / floor 5 nodes: p50 {:.2}x",
        ratio(f5.p50, f1.p50),
        ratio(f5.p99, f1.p99),
        ratio(s5.p50, f5.p50)
    );
    Ok(())
}

/// One acquire-like and one release-like EVALSHA per node, like a lock+unlock: on node 0
/// alone, then on all 5 (written to every connection, then every reply read).
fn raw_floor(servers: &[server::RedisServer], iters: usize) -> (Summary, Summary) {
    let acquire = redis::Script::new(
        "if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then \
           return {1, redis.call('INCR', KEYS[2])} end \
         return {0, redis.call('PTTL', KEYS[1])}",
    );
    let release = redis::Script::new(
        "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end \
         return 0",
    );
    let mut conns: Vec<Connection> = servers[..5].iter().map(|s| s.conn()).collect();
    for c in conns.iter_mut() {
        // Loads both scripts (EVALSHA, then SCRIPT LOAD on NOSCRIPT).
        let _: redis::Value = acquire
            .key("raw:{k}")
            .key("raw:{k}:fence")
            .arg("token")
            .arg(30_000)
            .invoke(c)
            .expect("acquire");
        let _: redis::Value = release
            .key("raw:{k}")
            .arg("token")
            .invoke(c)
            .expect("release");
    }
    let packed = |cmd: &mut redis::Cmd| cmd.get_packed_command();
    let acq = packed(
        redis::cmd("EVALSHA")
            .arg(acquire.get_hash())
            .arg(2)
            .arg("raw:{k}")
            .arg("raw:{k}:fence")
            .arg("token")
            .arg(30_000),
    );
    let rel = packed(
        redis::cmd("EVALSHA")
            .arg(release.get_hash())
            .arg(1)
            .arg("raw:{k}")
            .arg("token"),
    );
    let mut one = Vec::with_capacity(iters);
    let mut five = Vec::with_capacity(iters);
    for i in 0..WARMUP + iters {
        let started = Instant::now();
        for cmd in [&acq, &rel] {
            conns[0].req_packed_command(cmd).expect("raw 1 node");
        }
        let t1 = started.elapsed();
        let started = Instant::now();
        for cmd in [&acq, &rel] {
            for c in conns.iter_mut() {
                c.send_packed_command(cmd).expect("raw send");
            }
            for c in conns.iter_mut() {
                c.recv_response().expect("raw reply");
            }
        }
        let t5 = started.elapsed();
        if i >= WARMUP {
            one.push(t1);
            five.push(t5);
        }
    }
    (summarize(one), summarize(five))
}
