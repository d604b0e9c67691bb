//! rw_bench: a read-mostly workload on one name, under the read-write lock and under the
//! exclusive lock, in one run.
//!
//! P processes × T threads each run S critical sections of H µs on one name; R% of them
//! are reads. A section keeps its core busy (CPU-bound work: on a machine with few cores
//! this caps how many readers can run at once), or with `--sleep` it sleeps (I/O-bound
//! work, such as reading a remote resource, where readers overlap freely). With `rwlock` reads take `rwlock(name).read()` and
//! writes `.write()`; with `lock` every section takes `lock(name)`. It prints, per mode,
//! sections per second (from the moment all workers start to the last one's end) and the
//! Redis commands per section, counted by the server (`INFO commandstats`, after
//! `CONFIG RESETSTAT`, minus this tool's own `INFO`): `cmds` counts every command the
//! server ran, including those inside scripts; `sent` only what clients sent (round trips).
//! `failed` and `woken` are the workers' own counts per section: attempts that found the
//! name held, and waits ended by a message.
//! Then the same workload's floor: P × T threads in this one process, under
//! `parking_lot::RwLock` and under `parking_lot::Mutex` (no Redis, no other process), and
//! both ratios, read-write ÷ exclusive: what a read-write lock can gain on this workload
//! and machine at best, beside what the distributed one gains.
//! Last, the mean latency of an uncontended upgrade (an upgradable read turned into the
//! write hold).
//!
//! With `--only semaphore` every section takes one permit of a semaphore of `--permits`
//! permits (2 by default) instead: P processes wait for them, one thread each in Redis
//! (a process's threads wait for a permit one at a time), so with T = 1 the row shows
//! what a freed permit costs with P − permits processes waiting.
//!
//! ```text
//! cargo run --release --example rw_bench                    # P=4 T=4 S=500 H=100 R=90
//! cargo run --release --example rw_bench -- 4 4 500 100 90  # P T S H R
//! cargo run --release --example rw_bench -- --sleep          # sleeping sections
//! cargo run --release --example rw_bench -- --only rwlock    # one mode
//! cargo run --release --example rw_bench -- --sleep --only semaphore --permits 2 10 1 200 1000
//! REDIS_URL=redis://127.0.0.1:6379/ cargo run --release --example rw_bench
//! RW_STATS=1 cargo run --release --example rw_bench  # each worker's client stats, stderr
//! ```
//!
//! Without `REDIS_URL` a throwaway `redis-server` is started (it must be on `PATH`). The
//! tool re-executes itself as the worker processes; they connect, say `ready`, and all
//! start when the parent writes `go` on their stdin.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

const NAME: &str = "bench";

/// A read-mostly workload on one name, under the read-write lock and under the exclusive
/// lock (or a semaphore), from several processes: sections per second and Redis commands
/// per section, beside the same workload under parking_lot's RwLock and Mutex in one
/// process.
///
/// Redis: $REDIS_URL when set; else a throwaway redis-server (it must be on PATH).
#[derive(clap::Parser)]
struct Cli {
    /// Processes.
    #[arg(default_value_t = 4)]
    procs: u64,
    /// Threads per process.
    #[arg(default_value_t = 4)]
    threads: u64,
    /// Critical sections per thread.
    #[arg(default_value_t = 500)]
    sections: u64,
    /// Length of a section, in microseconds.
    #[arg(default_value_t = 100)]
    hold_us: u64,
    /// Share of the sections that are reads, in percent.
    #[arg(default_value_t = 90)]
    read_pct: u64,
    /// Sections sleep (I/O-bound work) instead of keeping their core busy.
    #[arg(long)]
    sleep: bool,
    /// One mode only (by default rwlock and lock; semaphore only when asked for).
    #[arg(long, value_parser = ["rwlock", "lock", "semaphore"])]
    only: Option<String>,
    /// The semaphore's permits, with `--only semaphore`.
    #[arg(long, default_value_t = 2)]
    permits: u64,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("--worker") {
        return worker(&args[2..]);
    }
    let Cli {
        procs,
        threads,
        sections,
        hold_us,
        read_pct,
        sleep,
        only,
        permits,
    } = clap::Parser::parse();
    let (url, _server) = redbaton_testkit::example_redis(false);
    let mut admin = redis::Client::open(url.as_str())?.get_connection()?;
    let workload = Workload {
        sections,
        hold: Duration::from_micros(hold_us),
        read_pct,
        sleep,
    };
    let kind = if sleep { "sleeping" } else { "busy" };
    println!(
        "{procs} processes x {threads} threads x {sections} {kind} sections of {hold_us} us, {read_pct}% reads"
    );
    if only.as_deref() == Some("semaphore") {
        println!("semaphore of {permits} permits: one per section");
    }
    println!(
        "{:<9} {:>12} {:>10} {:>11} {:>11} {:>11} {:>11}",
        "mode", "sections/s", "seconds", "cmds/sect", "sent/sect", "failed/sect", "woken/sect"
    );
    let mut rates = HashMap::new();
    for mode in ["rwlock", "lock", "semaphore"] {
        // The semaphore only when asked for: the default run compares the two locks.
        let chosen = match only.as_deref() {
            Some(only) => only == mode,
            None => mode != "semaphore",
        };
        if !chosen {
            continue;
        }
        redis::cmd("CONFIG")
            .arg("RESETSTAT")
            .query::<()>(&mut admin)?;
        let mut children = Vec::new();
        for p in 0..procs {
            let mut child = Command::new(std::env::current_exe()?)
                .args(["--worker", mode, &url])
                .args([threads, sections, hold_us, read_pct, p].map(|n| n.to_string()))
                .arg(if sleep { "sleep" } else { "busy" })
                .arg(permits.to_string())
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .spawn()?;
            let mut out = BufReader::new(child.stdout.take().expect("piped"));
            let mut line = String::new();
            out.read_line(&mut line)?;
            assert_eq!(line.trim(), "ready", "worker said {line:?}");
            children.push((child, out));
        }
        let before = commandstats(&mut admin)?;
        let start = Instant::now();
        for (child, _) in &mut children {
            writeln!(child.stdin.as_mut().expect("piped"), "go")?;
        }
        // The workers' failed attempts and wake-ups by a message.
        let (mut failed, mut woken) = (0, 0);
        for (child, mut out) in children {
            let mut line = String::new();
            out.read_line(&mut line)?;
            let counts: Vec<u64> = line
                .trim()
                .strip_prefix("done")
                .unwrap_or_else(|| panic!("worker said {line:?}"))
                .split_whitespace()
                .map(|n| n.parse().expect("a count"))
                .collect();
            failed += counts[0];
            woken += counts[1];
            let mut child = child;
            child.wait()?;
        }
        let elapsed = start.elapsed();
        let after = commandstats(&mut admin)?;
        let delta = |k: &str| after.get(k).unwrap_or(&0) - before.get(k).unwrap_or(&0);
        // Our own INFO: one before the run (counted after), one now.
        let all: u64 = after.keys().map(|k| delta(k)).sum::<u64>() - 1;
        let sent: u64 = [
            "evalsha",
            "eval",
            "script|load",
            "subscribe",
            "unsubscribe",
            "ping",
            "get",
        ]
        .iter()
        .map(|k| delta(k))
        .sum();
        let total = (procs * threads * sections) as f64;
        rates.insert(mode, total / elapsed.as_secs_f64());
        println!(
            "{:<9} {:>12.0} {:>10.2} {:>11.2} {:>11.2} {:>11.2} {:>11.2}",
            mode,
            rates[mode],
            elapsed.as_secs_f64(),
            all as f64 / total,
            sent as f64 / total,
            failed as f64 / total,
            woken as f64 / total,
        );
    }
    if let (Some(rw), Some(lock)) = (rates.get("rwlock"), rates.get("lock")) {
        // The floor: the same threads in one process, under in-process locks.
        let local_rw = workload.in_process(procs * threads, true);
        let local_mutex = workload.in_process(procs * threads, false);
        println!(
            "{:<9} {local_rw:>12.0} {:>10.2}   (floor: {} threads of one process, parking_lot::RwLock)",
            "local-rw",
            (procs * threads * sections) as f64 / local_rw,
            procs * threads
        );
        println!(
            "{:<9} {local_mutex:>12.0} {:>10.2}   (floor: the same, parking_lot::Mutex)",
            "local-mx",
            (procs * threads * sections) as f64 / local_mutex,
        );
        println!(
            "read-write / exclusive: {:.2} x across processes, {:.2} x floor (in-process)",
            rw / lock,
            local_rw / local_mutex
        );
    }
    // One more figure: an upgradable read turned into the write hold, nobody else there.
    let client = redbaton::LockClient::builder().node(url.as_str()).build()?;
    let (rw, upgrades) = (client.rwlock("upgrade"), 200);
    let mut upgrading = Duration::ZERO;
    for _ in 0..upgrades {
        let u = rw.upgradable_read()?;
        let t = Instant::now();
        drop(u.upgrade()?);
        upgrading += t.elapsed();
    }
    println!(
        "upgrade  {:>9.0} us each (uncontended, mean of {upgrades})",
        upgrading.as_secs_f64() * 1e6 / f64::from(upgrades)
    );
    Ok(())
}

/// Calls per command since the last `CONFIG RESETSTAT`.
fn commandstats(conn: &mut redis::Connection) -> redis::RedisResult<HashMap<String, u64>> {
    let info: String = redis::cmd("INFO").arg("commandstats").query(conn)?;
    Ok(info
        .lines()
        .filter_map(|l| {
            let rest = l.strip_prefix("cmdstat_")?;
            let (name, stats) = rest.split_once(':')?;
            let calls = stats.split(',').find_map(|f| f.strip_prefix("calls="))?;
            Some((name.to_owned(), calls.parse().ok()?))
        })
        .collect())
}

fn worker(args: &[String]) -> Result<(), Box<dyn std::error::Error>> {
    let mode = args[0].clone();
    let url = &args[1];
    let n: Vec<u64> = args[2..7].iter().map(|a| a.parse().unwrap()).collect();
    let threads = n[0];
    let work = Workload {
        sections: n[1],
        hold: Duration::from_micros(n[2]),
        read_pct: n[3],
        sleep: args.get(7).map(String::as_str) == Some("sleep"),
    };
    let permits: u32 = args[8].parse()?;
    let client = redbaton::LockClient::builder().node(url.as_str()).build()?;
    // Warm the connection pool and scripts outside the measured run.
    client.with_lock("warmup", || ())?;
    drop(client.rwlock("warmup").write()?);
    drop(client.semaphore("warmup-sem", 1).acquire()?);
    println!("ready");
    let mut go = String::new();
    std::io::stdin().read_line(&mut go)?;
    let handles: Vec<_> = (0..threads)
        .map(|_| {
            let (client, mode) = (client.clone(), mode.clone());
            std::thread::spawn(move || -> redbaton::Result<()> {
                let rw = client.rwlock(NAME);
                let sem = client.semaphore(NAME, permits);
                for _ in 0..work.sections {
                    match (mode.as_str(), work.read()) {
                        ("rwlock", true) => {
                            let g = rw.read()?;
                            work.section();
                            drop(g);
                        }
                        ("rwlock", false) => {
                            let g = rw.write()?;
                            work.section();
                            drop(g);
                        }
                        ("semaphore", _) => {
                            let p = sem.acquire()?;
                            work.section();
                            drop(p);
                        }
                        _ => {
                            let g = client.lock(NAME)?;
                            work.section();
                            drop(g);
                        }
                    }
                }
                Ok(())
            })
        })
        .collect();
    for h in handles {
        h.join().expect("worker thread")?;
    }
    let stats = client.stats();
    if std::env::var("RW_STATS").is_ok() {
        eprintln!("{stats:?}");
    }
    println!("done {} {}", stats.failed_attempts, stats.wakeups_event);
    Ok(())
}

/// What each thread does: `sections` critical sections of `hold`, `read_pct` % of them
/// reads, each busy or asleep.
#[derive(Clone, Copy)]
struct Workload {
    sections: u64,
    hold: Duration,
    read_pct: u64,
    sleep: bool,
}

impl Workload {
    /// Whether the next section reads.
    fn read(&self) -> bool {
        rand::random_range(0..100) < self.read_pct
    }

    /// One critical section: `hold` of busy work, or of sleep.
    fn section(&self) {
        if self.sleep {
            std::thread::sleep(self.hold);
            return;
        }
        let t = Instant::now();
        while t.elapsed() < self.hold {
            std::hint::spin_loop();
        }
    }

    /// Sections per second of `threads` threads of this process running the workload
    /// under an in-process `parking_lot` lock: the `RwLock` (reads share it) with `rw`,
    /// else the `Mutex`.
    fn in_process(self, threads: u64, rw: bool) -> f64 {
        let rwlock = Arc::new(parking_lot::RwLock::new(()));
        let mutex = Arc::new(parking_lot::Mutex::new(()));
        let start = Instant::now();
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                let (rwlock, mutex) = (rwlock.clone(), mutex.clone());
                std::thread::spawn(move || {
                    for _ in 0..self.sections {
                        match (rw, self.read()) {
                            (true, true) => {
                                let _g = rwlock.read();
                                self.section();
                            }
                            (true, false) => {
                                let _g = rwlock.write();
                                self.section();
                            }
                            (false, _) => {
                                let _g = mutex.lock();
                                self.section();
                            }
                        }
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().expect("floor thread");
        }
        (threads * self.sections) as f64 / start.elapsed().as_secs_f64()
    }
}
