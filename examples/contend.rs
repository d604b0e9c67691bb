//! contend: how much Redis traffic and waiting each wakeup strategy costs under contention.
//!
//! Runs P processes × T threads × S critical sections of H µs on K keys, once per strategy:
//!
//! | strategy         | builder                                                          |
//! |------------------|------------------------------------------------------------------|
//! | `poll-100ms`     | `.wakeup(Wakeup::Polling(100 ms)).local_handoff(false)`          |
//! | `poll-1ms`       | `.wakeup(Wakeup::Polling(1 ms)).local_handoff(false)`            |
//! | `notify`         | `.wakeup(Wakeup::Notifications).local_handoff(false)`            |
//! | `notify+handoff` | the defaults: notifications and the local baton                  |
//!
//! and prints one table: throughput, how long `lock()` waited (p50/p99/max), Redis commands
//! per critical section, fairness, and whether a counter kept in Redis came out exact.
//!
//! ```text
//! cargo run --release --example contend -- --quick
//! cargo run --release --example contend -- -p 4 -t 8 -s 200 --svg /tmp/contend.svg
//! cargo run --release --example contend -- --url redis://127.0.0.1:6379/ --strategies notify,notify+handoff
//! ```
//!
//! * Each critical section locks key `(thread + i) mod K`, reads that key's counter with
//!   `GET` on the thread's own raw connection, sleeps H µs, writes it back with `SET`, and
//!   unlocks. Only mutual exclusion across all processes keeps the counters exact.
//! * The tool re-executes itself as P worker processes (hidden `--worker` flag). Workers
//!   build their client and connections, say `ready` on stdout, and all start when the
//!   parent writes `go` on their stdin (a barrier that sends nothing to Redis). They report
//!   progress and, at the end, every wait and completion time as JSON lines on stdout.
//! * Commands are counted by the server: `INFO commandstats` before and after each strategy
//!   (after `CONFIG RESETSTAT`), minus the tool's own `INFO` and minus the 2 commands
//!   (`GET` + `SET`) of the counter in each section. `cmds/sect` counts every command the
//!   server ran, including the ones the library's Lua scripts run inside an `EVALSHA`;
//!   `sent/sect` counts only the commands clients sent (round trips: `EVALSHA`,
//!   `SUBSCRIBE`, `PING`, ...). With `--url`, other clients' traffic on that server is
//!   counted too.
//! * Fairness: when the first thread finished its S sections, how many sections the
//!   slowest and fastest thread (and process) had done. Everyone does S in the end.
//! * `--quick`: P=2, T=4, S=100, H=100 µs, K=1, and `poll-100ms` runs only S/5 sections per
//!   thread (`--slow-sections`), since each of its waits lasts about a polling period.
//!   It finishes in well under a minute on 2 cores. Without `--quick` the defaults are
//!   P=4, T=8, S=200, H=100 µs, K=1, lease 10 s.
//! * Without `--url` the tool starts its own `redis-server` (no persistence, temp dir, free
//!   127.0.0.1 port) and stops it at the end. Unix only (it reads `CLOCK_MONOTONIC`, which
//!   all processes of a machine share).

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};
use crossbeam_channel::{Receiver, RecvTimeoutError};
use indicatif::{ProgressBar, ProgressStyle};
use redbaton::{LockClient, Unlocked, Wakeup};
use serde::{Deserialize, Serialize};

#[path = "../tests/support/server.rs"]
#[allow(dead_code)]
mod server;

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type Res<T> = Result<T, BoxError>;

/// Commands that the library only ever runs inside its Lua scripts (acquire: GET, SET,
/// INCR, PEXPIRE, PUBLISH, PTTL; release: GET, DEL, PUBLISH; extend: GET, PEXPIRE), plus the
/// counter's GET/SET. Removing them from the server's totals leaves what clients sent.
const IN_SCRIPT: [&str; 7] = ["get", "set", "incr", "pexpire", "publish", "pttl", "del"];
/// How long workers may take to connect and say `ready`.
const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// How long workers may take to exit once told to.
const EXIT_TIMEOUT: Duration = Duration::from_secs(15);

#[derive(Parser, Debug, Clone)]
#[command(
    name = "contend",
    about = "Measure redbaton's wakeup strategies under contention: P processes × T threads × S critical sections of H µs on K keys.",
    after_help = "--quick = -p 2 -t 4 -s 100 --hold-us 100 -k 1 and poll-100ms with S/5 sections; explicit flags override it."
)]
struct Args {
    /// Redis to use; without it a throwaway redis-server is started.
    #[arg(long)]
    url: Option<String>,
    /// Worker processes [default: 4; --quick: 2].
    #[arg(short = 'p', long)]
    processes: Option<usize>,
    /// Threads per process [default: 8; --quick: 4].
    #[arg(short = 't', long)]
    threads: Option<usize>,
    /// Critical sections per thread [default: 200; --quick: 100].
    #[arg(short = 's', long)]
    sections: Option<usize>,
    /// Critical sections per thread for poll-100ms [default: S; --quick: S/5].
    #[arg(long)]
    slow_sections: Option<usize>,
    /// How long each critical section holds the lock, in µs [default: 100].
    #[arg(long)]
    hold_us: Option<u64>,
    /// Number of lock keys; section i of thread g takes key (g + i) mod K [default: 1].
    #[arg(short = 'k', long)]
    keys: Option<usize>,
    /// Lock lease in ms [default: 10000].
    #[arg(long)]
    lease_ms: Option<u64>,
    /// Strategies to run, comma-separated [default: all four].
    #[arg(long, value_enum, value_delimiter = ',')]
    strategies: Vec<Strategy>,
    /// Small, fast settings (see below).
    #[arg(long)]
    quick: bool,
    /// Print machine-readable results (JSON) instead of the table; no progress bar.
    #[arg(long)]
    json: bool,
    /// Write an SVG chart of throughput and commands per section.
    #[arg(long, value_name = "FILE")]
    svg: Option<PathBuf>,
    /// Abort when workers report no progress for this many seconds.
    #[arg(long, default_value_t = 120)]
    stall_s: u64,

    // Worker mode (the tool runs itself as its worker processes).
    #[arg(long, hide = true)]
    worker: bool,
    #[arg(long, hide = true, default_value_t = 0)]
    worker_id: usize,
    #[arg(long, hide = true, value_enum)]
    strategy: Option<Strategy>,
    #[arg(long, hide = true)]
    prefix: Option<String>,
}

#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
enum Strategy {
    #[value(name = "poll-100ms")]
    #[serde(rename = "poll-100ms")]
    Poll100ms,
    #[value(name = "poll-1ms")]
    #[serde(rename = "poll-1ms")]
    Poll1ms,
    #[value(name = "notify")]
    #[serde(rename = "notify")]
    Notify,
    #[value(name = "notify+handoff")]
    #[serde(rename = "notify+handoff")]
    NotifyHandoff,
}

impl Strategy {
    const ALL: [Strategy; 4] = [
        Strategy::Poll100ms,
        Strategy::Poll1ms,
        Strategy::Notify,
        Strategy::NotifyHandoff,
    ];

    fn name(self) -> &'static str {
        match self {
            Strategy::Poll100ms => "poll-100ms",
            Strategy::Poll1ms => "poll-1ms",
            Strategy::Notify => "notify",
            Strategy::NotifyHandoff => "notify+handoff",
        }
    }

    fn builder(self, url: &str, prefix: &str, s: &Settings) -> redbaton::Builder {
        let b = LockClient::builder()
            .node(url)
            .key_prefix(prefix)
            .lease(Duration::from_millis(s.lease_ms))
            // Enough connections that threads never queue for one (8 is the default).
            .pool_size(s.threads.clamp(8, 1024));
        match self {
            Strategy::Poll100ms => b
                .wakeup(Wakeup::Polling(Duration::from_millis(100)))
                .local_handoff(false),
            Strategy::Poll1ms => b
                .wakeup(Wakeup::Polling(Duration::from_millis(1)))
                .local_handoff(false),
            Strategy::Notify => b.wakeup(Wakeup::Notifications).local_handoff(false),
            Strategy::NotifyHandoff => b,
        }
    }
}

/// The resolved run parameters.
#[derive(Debug, Clone, Serialize)]
struct Settings {
    processes: usize,
    threads: usize,
    sections: usize,
    slow_sections: usize,
    hold_us: u64,
    keys: usize,
    lease_ms: u64,
}

impl Settings {
    fn from_args(a: &Args) -> Res<Settings> {
        let (p, t, s, h, k) = if a.quick {
            (2, 4, 100, 100, 1)
        } else {
            (4, 8, 200, 100, 1)
        };
        let sections = a.sections.unwrap_or(s);
        let slow_default = if a.quick {
            (sections / 5).max(1)
        } else {
            sections
        };
        let s = Settings {
            processes: a.processes.unwrap_or(p),
            threads: a.threads.unwrap_or(t),
            sections,
            slow_sections: a.slow_sections.unwrap_or(slow_default),
            hold_us: a.hold_us.unwrap_or(h),
            keys: a.keys.unwrap_or(k),
            lease_ms: a.lease_ms.unwrap_or(10_000),
        };
        if s.processes == 0 || s.threads == 0 || s.keys == 0 {
            return Err("--processes, --threads and --keys must be at least 1".into());
        }
        Ok(s)
    }

    fn sections_for(&self, strategy: Strategy) -> usize {
        match strategy {
            Strategy::Poll100ms => self.slow_sections,
            _ => self.sections,
        }
    }
}

// ---------------------------------------------------------------------------------------
// Worker <-> parent messages (one JSON object per line on the worker's stdout).

#[derive(Serialize, Deserialize, Debug)]
#[serde(tag = "type", rename_all = "snake_case")]
enum Msg {
    Ready,
    Progress { done: u64 },
    Done(WorkerReport),
    Failed { error: String },
}

#[derive(Serialize, Deserialize, Debug)]
struct WorkerReport {
    worker: usize,
    threads: Vec<ThreadReport>,
    /// Sections done per key by this process.
    key_counts: Vec<u64>,
    /// Sections whose lock was lost while held, or not ours any more at unlock.
    lost: u64,
    stats: ClientStats,
}

#[derive(Serialize, Deserialize, Debug, Default)]
struct ThreadReport {
    /// How long each `lock()` call waited, µs.
    waits_us: Vec<u64>,
    /// When each section ended, µs after the parent's `go` (CLOCK_MONOTONIC).
    done_us: Vec<u64>,
}

/// The client's own counters (`LockClient::stats`), summed over processes in the results.
#[derive(Serialize, Deserialize, Debug, Default, Clone, Copy)]
struct ClientStats {
    remote_acquisitions: u64,
    failed_attempts: u64,
    local_handoffs: u64,
    budget_releases: u64,
    commands: u64,
    wakeups_event: u64,
    wakeups_lease: u64,
    wakeups_recheck: u64,
    wakeups_poll: u64,
    renewals_sent: u64,
    locks_lost: u64,
}

impl ClientStats {
    fn from_stats(s: &redbaton::Stats) -> Self {
        ClientStats {
            remote_acquisitions: s.remote_acquisitions,
            failed_attempts: s.failed_attempts,
            local_handoffs: s.local_handoffs,
            budget_releases: s.budget_releases,
            commands: s.commands,
            wakeups_event: s.wakeups_event,
            wakeups_lease: s.wakeups_lease,
            wakeups_recheck: s.wakeups_recheck,
            wakeups_poll: s.wakeups_poll,
            renewals_sent: s.renewals_sent,
            locks_lost: s.locks_lost,
        }
    }

    fn add(&mut self, o: &ClientStats) {
        self.remote_acquisitions += o.remote_acquisitions;
        self.failed_attempts += o.failed_attempts;
        self.local_handoffs += o.local_handoffs;
        self.budget_releases += o.budget_releases;
        self.commands += o.commands;
        self.wakeups_event += o.wakeups_event;
        self.wakeups_lease += o.wakeups_lease;
        self.wakeups_recheck += o.wakeups_recheck;
        self.wakeups_poll += o.wakeups_poll;
        self.renewals_sent += o.renewals_sent;
        self.locks_lost += o.locks_lost;
    }
}

fn send(msg: &Msg) {
    // One `println!` holds the stdout lock for the whole line; stdout is line-buffered.
    println!(
        "{}",
        serde_json::to_string(msg).expect("messages serialize")
    );
}

/// Microseconds on CLOCK_MONOTONIC, which every process of the machine shares (unlike
/// `Instant`, whose values cannot be sent to another process).
fn mono_us() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime only writes the timespec we pass, which outlives the call.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_MONOTONIC) failed");
    ts.tv_sec as u64 * 1_000_000 + ts.tv_nsec as u64 / 1_000
}

fn lock_name(k: usize) -> String {
    format!("k{k}")
}

fn counter_key(prefix: &str, k: usize) -> String {
    format!("{prefix}counter:{k}")
}

fn raw_conn(url: &str) -> Res<redis::Connection> {
    let conn = redis::Client::open(url)?
        .get_connection_with_timeout(Duration::from_secs(5))
        .map_err(|e| format!("cannot connect to {url}: {e}"))?;
    conn.set_read_timeout(Some(Duration::from_secs(30)))?;
    conn.set_write_timeout(Some(Duration::from_secs(30)))?;
    Ok(conn)
}

// ---------------------------------------------------------------------------------------
// Worker process.

fn worker_main(args: &Args) -> Res<()> {
    let (Some(url), Some(strategy), Some(prefix)) = (&args.url, args.strategy, &args.prefix) else {
        return Err("worker needs --url, --strategy and --prefix".into());
    };
    let s = Settings::from_args(args)?;
    let sections = s.sections_for(strategy);
    let client = strategy.builder(url, prefix, &s).build()?;
    let conns = (0..s.threads)
        .map(|_| raw_conn(url))
        .collect::<Res<Vec<_>>>()?;
    send(&Msg::Ready);

    let mut line = String::new();
    std::io::stdin().read_line(&mut line)?;
    let base: u64 = line
        .trim()
        .strip_prefix("go ")
        .and_then(|b| b.parse().ok())
        .ok_or_else(|| format!("expected `go <time>` on stdin, got {line:?}"))?;

    let done = Arc::new(AtomicU64::new(0));
    let finished = Arc::new(AtomicBool::new(false));
    let reporter = {
        let (done, finished) = (done.clone(), finished.clone());
        std::thread::spawn(move || {
            let mut last = 0;
            while !finished.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(100));
                let now = done.load(Ordering::Relaxed);
                if now != last {
                    send(&Msg::Progress { done: now });
                    last = now;
                }
            }
        })
    };

    let first_thread = args.worker_id * s.threads;
    let outcomes: Vec<Res<(ThreadReport, Vec<u64>, u64)>> = std::thread::scope(|scope| {
        let handles: Vec<_> = conns
            .into_iter()
            .enumerate()
            .map(|(t, mut conn)| {
                let (client, done, s) = (&client, &done, &s);
                scope.spawn(move || {
                    run_thread(
                        client,
                        &mut conn,
                        prefix,
                        s,
                        sections,
                        first_thread + t,
                        base,
                        done,
                    )
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err("a thread panicked".into())))
            .collect()
    });
    finished.store(true, Ordering::Relaxed);
    let _ = reporter.join();

    let mut report = WorkerReport {
        worker: args.worker_id,
        threads: Vec::new(),
        key_counts: vec![0; s.keys],
        lost: 0,
        stats: ClientStats::from_stats(&client.stats()),
    };
    for outcome in outcomes {
        let (thread, keys, lost) = outcome?;
        report.threads.push(thread);
        for (total, n) in report.key_counts.iter_mut().zip(keys) {
            *total += n;
        }
        report.lost += lost;
    }
    send(&Msg::Done(report));
    // Stay connected (so that disconnecting is not counted) until the parent has read the
    // server's counters and closes our stdin.
    let _ = std::io::stdin().read_line(&mut line);
    Ok(())
}

/// One thread's critical sections: lock, GET the counter, hold, SET it + 1, unlock.
#[allow(clippy::too_many_arguments)]
fn run_thread(
    client: &LockClient,
    conn: &mut redis::Connection,
    prefix: &str,
    s: &Settings,
    sections: usize,
    global_thread: usize,
    base: u64,
    done: &AtomicU64,
) -> Res<(ThreadReport, Vec<u64>, u64)> {
    let names: Vec<String> = (0..s.keys).map(lock_name).collect();
    let counters: Vec<String> = (0..s.keys).map(|k| counter_key(prefix, k)).collect();
    let hold = Duration::from_micros(s.hold_us);
    let mut report = ThreadReport {
        waits_us: Vec::with_capacity(sections),
        done_us: Vec::with_capacity(sections),
    };
    let mut key_counts = vec![0u64; s.keys];
    let mut lost = 0;
    for i in 0..sections {
        let k = (global_thread + i) % s.keys;
        let asked = Instant::now();
        let guard = client.lock(&names[k])?;
        let waited = asked.elapsed();
        let n: Option<u64> = redis::cmd("GET").arg(&counters[k]).query(conn)?;
        if !hold.is_zero() {
            std::thread::sleep(hold);
        }
        if guard.is_lost() {
            lost += 1;
        }
        redis::cmd("SET")
            .arg(&counters[k])
            .arg(n.unwrap_or(0) + 1)
            .query::<()>(conn)?;
        match guard.unlock()? {
            Unlocked::Released | Unlocked::HandedOff => {}
            _ => lost += 1,
        }
        report.waits_us.push(waited.as_micros() as u64);
        report.done_us.push(mono_us().saturating_sub(base));
        key_counts[k] += 1;
        done.fetch_add(1, Ordering::Relaxed);
    }
    Ok((report, key_counts, lost))
}

// ---------------------------------------------------------------------------------------
// Parent: runs the workers, reads the server's counters, reports.

#[derive(Serialize, Debug)]
struct Waits {
    p50_us: u64,
    p99_us: u64,
    max_us: u64,
    mean_us: f64,
}

#[derive(Serialize, Debug)]
struct Commands {
    /// Every call the server counted in the window, minus the tool's own INFO.
    server_total: u64,
    /// The counter's GET + SET: 2 per section.
    counter: u64,
    /// `server_total - counter`: the lock's commands, including those run inside scripts.
    lock: u64,
    lock_per_section: f64,
    /// Commands the lock's clients sent (round trips): `lock` without in-script calls.
    sent: u64,
    sent_per_section: f64,
    /// Net calls per command name (INFO commandstats), counter included.
    by_command: HashMap<String, u64>,
}

#[derive(Serialize, Debug)]
struct Fairness {
    /// When the first thread finished, µs after `go`.
    first_finish_us: u64,
    thread_min: u64,
    thread_max: u64,
    process_min: u64,
    process_max: u64,
}

#[derive(Serialize, Debug)]
struct Counter {
    expected: u64,
    actual: u64,
    /// Every key's counter equals the sections done on it, and no lock was lost.
    exact: bool,
    lost: u64,
}

#[derive(Serialize, Debug)]
struct StrategyResult {
    strategy: Strategy,
    sections_per_thread: usize,
    sections: u64,
    elapsed_s: f64,
    sections_per_s: f64,
    wait: Waits,
    commands: Commands,
    fairness: Fairness,
    counter: Counter,
    client_stats: ClientStats,
}

#[derive(Serialize)]
struct Output<'a> {
    settings: &'a Settings,
    redis_url: &'a str,
    results: &'a [StrategyResult],
}

/// The worker processes of one strategy; killed (SIGKILL) if still running when dropped.
struct Workers {
    children: Vec<Child>,
    stdins: Vec<Option<ChildStdin>>,
}

impl Drop for Workers {
    fn drop(&mut self) {
        self.stdins.clear();
        for child in &mut self.children {
            if matches!(child.try_wait(), Ok(None)) {
                let _ = child.kill();
            }
            let _ = child.wait();
        }
    }
}

enum Event {
    Line(usize, String),
    Eof(usize),
}

fn spawn_workers(
    url: &str,
    prefix: &str,
    strategy: Strategy,
    s: &Settings,
) -> Res<(Workers, Receiver<Event>)> {
    let exe = std::env::current_exe()?;
    let (tx, rx) = crossbeam_channel::unbounded();
    let mut workers = Workers {
        children: Vec::new(),
        stdins: Vec::new(),
    };
    for id in 0..s.processes {
        let mut child = Command::new(&exe)
            .arg("--worker")
            .args(["--worker-id", &id.to_string()])
            .args(["--url", url])
            .args(["--prefix", prefix])
            .args(["--strategy", strategy.name()])
            .args(["--processes", &s.processes.to_string()])
            .args(["--threads", &s.threads.to_string()])
            .args(["--sections", &s.sections.to_string()])
            .args(["--slow-sections", &s.slow_sections.to_string()])
            .args(["--hold-us", &s.hold_us.to_string()])
            .args(["--keys", &s.keys.to_string()])
            .args(["--lease-ms", &s.lease_ms.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()?;
        let stdout = child.stdout.take().expect("stdout is piped");
        workers.stdins.push(child.stdin.take());
        workers.children.push(child);
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                match line {
                    Ok(l) => {
                        if tx.send(Event::Line(id, l)).is_err() {
                            return;
                        }
                    }
                    Err(_) => break,
                }
            }
            let _ = tx.send(Event::Eof(id));
        });
    }
    Ok((workers, rx))
}

/// Reads the next message from any worker, failing on a worker's death or error.
fn next_msg(rx: &Receiver<Event>, timeout: Duration, what: &str) -> Res<(usize, Msg)> {
    loop {
        match rx.recv_timeout(timeout) {
            Ok(Event::Line(id, line)) => match serde_json::from_str::<Msg>(&line) {
                Ok(Msg::Failed { error }) => return Err(format!("worker {id}: {error}").into()),
                Ok(msg) => return Ok((id, msg)),
                // Not ours (a stray print): pass it on.
                Err(_) => eprintln!("worker {id}: {line}"),
            },
            Ok(Event::Eof(id)) => {
                return Err(format!("worker {id} exited while {what}").into());
            }
            Err(RecvTimeoutError::Timeout) => {
                return Err(
                    format!("no word from the workers for {timeout:?} while {what}").into(),
                );
            }
            Err(RecvTimeoutError::Disconnected) => {
                return Err(format!("lost every worker while {what}").into());
            }
        }
    }
}

fn commandstats(admin: &mut redis::Connection) -> Res<HashMap<String, u64>> {
    let text: String = redis::cmd("INFO").arg("commandstats").query(admin)?;
    Ok(server::parse_commandstats(&text))
}

/// Deletes every key under `prefix` (counters, fence counters).
fn cleanup(admin: &mut redis::Connection, prefix: &str) -> Res<()> {
    let pattern = format!("{prefix}*");
    let mut cursor = 0u64;
    loop {
        let (next, keys): (u64, Vec<Vec<u8>>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(&pattern)
            .arg("COUNT")
            .arg(1000)
            .query(admin)?;
        if !keys.is_empty() {
            redis::cmd("DEL").arg(keys).query::<()>(admin)?;
        }
        if next == 0 {
            return Ok(());
        }
        cursor = next;
    }
}

struct Ctx<'a> {
    url: &'a str,
    settings: &'a Settings,
    admin: redis::Connection,
    bar: ProgressBar,
    stall: Duration,
}

fn run_strategy(ctx: &mut Ctx, strategy: Strategy, run_id: &str) -> Res<StrategyResult> {
    let s = ctx.settings;
    let per_thread = s.sections_for(strategy);
    let prefix = format!("contend:{run_id}:{}:", strategy.name());
    for k in 0..s.keys {
        redis::cmd("SET")
            .arg(counter_key(&prefix, k))
            .arg(0)
            .query::<()>(&mut ctx.admin)?;
    }
    ctx.bar.set_message(strategy.name());
    let (mut workers, rx) = spawn_workers(ctx.url, &prefix, strategy, s)?;
    for _ in 0..s.processes {
        match next_msg(&rx, READY_TIMEOUT, "starting")? {
            (_, Msg::Ready) => {}
            (id, other) => return Err(format!("worker {id}: unexpected {other:?}").into()),
        }
    }

    // Window opens: fresh server counters, then a baseline reading.
    let _ = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query::<()>(&mut ctx.admin);
    let before = commandstats(&mut ctx.admin)?;
    let base = mono_us();
    let started = Instant::now();
    for stdin in workers.stdins.iter_mut().flatten() {
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
    let elapsed = started.elapsed();
    let after = commandstats(&mut ctx.admin)?;
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
    let mut counters = Vec::with_capacity(s.keys);
    for k in 0..s.keys {
        let n: Option<u64> = redis::cmd("GET")
            .arg(counter_key(&prefix, k))
            .query(&mut ctx.admin)?;
        counters.push(n.unwrap_or(0));
    }
    cleanup(&mut ctx.admin, &prefix)?;

    // Sections, waits, fairness.
    let sections: u64 = reports
        .iter()
        .flat_map(|r| &r.threads)
        .map(|t| t.done_us.len() as u64)
        .sum();
    let mut waits: Vec<u64> = reports
        .iter()
        .flat_map(|r| &r.threads)
        .flat_map(|t| t.waits_us.iter().copied())
        .collect();
    waits.sort_unstable();
    let pct = |q: f64| -> u64 {
        if waits.is_empty() {
            return 0;
        }
        let rank = ((q * waits.len() as f64).ceil() as usize).clamp(1, waits.len());
        waits[rank - 1]
    };
    let wait = Waits {
        p50_us: pct(0.50),
        p99_us: pct(0.99),
        max_us: waits.last().copied().unwrap_or(0),
        mean_us: waits.iter().sum::<u64>() as f64 / waits.len().max(1) as f64,
    };
    let first_finish_us = reports
        .iter()
        .flat_map(|r| &r.threads)
        .filter_map(|t| t.done_us.last().copied())
        .min()
        .unwrap_or(0);
    let by_thread = |t: &ThreadReport| t.done_us.partition_point(|&d| d <= first_finish_us) as u64;
    let thread_counts: Vec<u64> = reports
        .iter()
        .flat_map(|r| &r.threads)
        .map(by_thread)
        .collect();
    let process_counts: Vec<u64> = reports
        .iter()
        .map(|r| r.threads.iter().map(by_thread).sum())
        .collect();
    let fairness = Fairness {
        first_finish_us,
        thread_min: thread_counts.iter().copied().min().unwrap_or(0),
        thread_max: thread_counts.iter().copied().max().unwrap_or(0),
        process_min: process_counts.iter().copied().min().unwrap_or(0),
        process_max: process_counts.iter().copied().max().unwrap_or(0),
    };

    // Commands: the window's net calls per command, minus our own INFO (the first reading
    // is counted by the second).
    let mut by_command: HashMap<String, u64> = after
        .iter()
        .map(|(name, &calls)| {
            let net = calls.saturating_sub(before.get(name).copied().unwrap_or(0));
            (name.clone(), net)
        })
        .filter(|&(_, n)| n > 0)
        .collect();
    if let Some(info) = by_command.get_mut("info") {
        *info -= 1;
    }
    by_command.retain(|_, n| *n > 0);
    let server_total: u64 = by_command.values().sum();
    let counter = 2 * sections;
    let lock = server_total.saturating_sub(counter);
    let in_script: u64 = IN_SCRIPT
        .iter()
        .filter_map(|name| by_command.get(*name))
        .sum();
    let sent = server_total.saturating_sub(in_script);
    let per = |n: u64| n as f64 / sections.max(1) as f64;
    let commands = Commands {
        server_total,
        counter,
        lock,
        lock_per_section: per(lock),
        sent,
        sent_per_section: per(sent),
        by_command,
    };

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
        sections_per_s: sections as f64 / elapsed.as_secs_f64().max(1e-9),
        wait,
        commands,
        fairness,
        counter,
        client_stats,
    })
}

fn fmt_us(us: u64) -> String {
    match us {
        0..1_000 => format!("{us}µs"),
        1_000..10_000 => format!("{:.2}ms", us as f64 / 1e3),
        10_000..1_000_000 => format!("{:.1}ms", us as f64 / 1e3),
        _ => format!("{:.2}s", us as f64 / 1e6),
    }
}

fn fmt_rate(x: f64) -> String {
    if x >= 100.0 {
        format!("{x:.0}")
    } else {
        format!("{x:.1}")
    }
}

fn print_table(s: &Settings, url: &str, results: &[StrategyResult]) {
    println!(
        "contend: P={} processes × T={} threads × S={} sections (poll-100ms: {}) of H={}µs on K={} key{}, lease {} ms, redis {url}",
        s.processes,
        s.threads,
        s.sections,
        s.slow_sections,
        s.hold_us,
        s.keys,
        if s.keys == 1 { "" } else { "s" },
        s.lease_ms,
    );
    println!(
        "wait      = time spent in lock().\n\
         cmds/sect = Redis commands per critical section (INFO commandstats), EXCLUDING the counter's GET+SET\n\
         \x20           (2 per section) and the tool's own INFO; includes what the Lua scripts run inside EVALSHA.\n\
         sent/sect = the same, counting only the commands clients sent (round trips).\n\
         thr/proc min-max = sections done by the slowest / fastest thread and process when the first thread\n\
         \x20           finished its S (all reach S in the end).\n\
         counter   = every Redis counter (GET+SET under the lock) equals the sections done on its key."
    );
    println!();
    let header = format!(
        "{:<15} {:>9} {:>9} {:>9} {:>9} {:>10} {:>10} {:>12} {:>13}  {}",
        "strategy",
        "sect/s",
        "wait p50",
        "p99",
        "max",
        "cmds/sect",
        "sent/sect",
        "thr min-max",
        "proc min-max",
        "counter"
    );
    println!("{header}");
    println!("{}", "-".repeat(header.chars().count() + 6));
    for r in results {
        let f = &r.fairness;
        let counter = if r.counter.exact {
            format!("exact {}", r.counter.actual)
        } else {
            format!(
                "WRONG {}/{} (lost {})",
                r.counter.actual, r.counter.expected, r.counter.lost
            )
        };
        println!(
            "{:<15} {:>9} {:>9} {:>9} {:>9} {:>10.2} {:>10.2} {:>12} {:>13}  {}",
            r.strategy.name(),
            fmt_rate(r.sections_per_s),
            fmt_us(r.wait.p50_us),
            fmt_us(r.wait.p99_us),
            fmt_us(r.wait.max_us),
            r.commands.lock_per_section,
            r.commands.sent_per_section,
            format!("{}-{}", f.thread_min, f.thread_max),
            format!("{}-{}", f.process_min, f.process_max),
            counter,
        );
    }
}

fn draw_svg(path: &Path, s: &Settings, results: &[StrategyResult]) -> Res<()> {
    use plotters::coord::combinators::IntoLogRange;
    use plotters::prelude::*;
    use plotters::style::text_anchor::{HPos, Pos, VPos};

    let n = results.len();
    let names: Vec<&str> = results.iter().map(|r| r.strategy.name()).collect();
    let x_range = || Slots(n);
    let label = |x: &f64| -> String {
        let i = x.round();
        if (x - i).abs() < 1e-6 && i >= 0.0 {
            names
                .get(i as usize)
                .map_or(String::new(), |s| s.to_string())
        } else {
            String::new()
        }
    };
    let on_top =
        TextStyle::from(("sans-serif", 14).into_font()).pos(Pos::new(HPos::Center, VPos::Bottom));

    let root = SVGBackend::new(path, (1200, 560)).into_drawing_area();
    root.fill(&WHITE)?;
    let title = format!(
        "redbaton contend: P={} processes × T={} threads × S={} sections (poll-100ms: {}), H={}µs hold, K={} key{}",
        s.processes,
        s.threads,
        s.sections,
        s.slow_sections,
        s.hold_us,
        s.keys,
        if s.keys == 1 { "" } else { "s" },
    );
    let root = root.titled(&title, ("sans-serif", 20))?;
    let (left, right) = root.split_horizontally(600);

    // Left: throughput, log scale (polling at 100 ms is orders of magnitude slower).
    let max_rate = results
        .iter()
        .map(|r| r.sections_per_s)
        .fold(1.0f64, f64::max);
    let min_rate = results
        .iter()
        .map(|r| r.sections_per_s)
        .fold(f64::INFINITY, f64::min)
        .max(0.1);
    let y_lo = 10f64.powf(min_rate.log10().floor()).clamp(0.1, 1.0);
    let y_hi = 10f64.powf((max_rate * 3.0).log10().ceil());
    let mut chart = ChartBuilder::on(&left)
        .caption("throughput", ("sans-serif", 18))
        .margin(20)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(x_range(), (y_lo..y_hi).log_scale())?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_desc("strategy")
        .y_desc("critical sections per second (log scale)")
        .x_label_formatter(&label)
        .y_label_formatter(&|y| format!("{y}"))
        .axis_desc_style(("sans-serif", 15))
        .draw()?;
    chart.draw_series(results.iter().enumerate().map(|(i, r)| {
        let x = i as f64;
        Rectangle::new(
            [(x - 0.32, y_lo), (x + 0.32, r.sections_per_s.max(y_lo))],
            Palette99::pick(i).filled(),
        )
    }))?;
    chart.draw_series(results.iter().enumerate().map(|(i, r)| {
        Text::new(
            fmt_rate(r.sections_per_s),
            (i as f64, r.sections_per_s.max(y_lo) * 1.12),
            on_top.clone(),
        )
    }))?;

    // Right: commands per critical section, two bars per strategy.
    let max_cmds = results
        .iter()
        .map(|r| r.commands.lock_per_section.max(r.commands.sent_per_section))
        .fold(0.0f64, f64::max);
    let y_hi = (max_cmds * 1.2).max(1.0);
    let mut chart = ChartBuilder::on(&right)
        .caption(
            "Redis commands per critical section (counter GET+SET excluded)",
            ("sans-serif", 18),
        )
        .margin(20)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(x_range(), 0f64..y_hi)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_desc("strategy")
        .y_desc("commands per critical section")
        .x_label_formatter(&label)
        .y_label_formatter(&|y| {
            if y_hi >= 10.0 {
                format!("{y:.0}")
            } else {
                format!("{y:.1}")
            }
        })
        .axis_desc_style(("sans-serif", 15))
        .draw()?;
    let all_color = RGBColor(70, 110, 190);
    let sent_color = RGBColor(235, 145, 50);
    chart
        .draw_series(results.iter().enumerate().map(|(i, r)| {
            let x = i as f64;
            Rectangle::new(
                [(x - 0.38, 0.0), (x - 0.02, r.commands.lock_per_section)],
                all_color.filled(),
            )
        }))?
        .label("all commands (incl. those run inside Lua scripts)")
        .legend(move |(x, y)| Rectangle::new([(x, y - 6), (x + 14, y + 6)], all_color.filled()));
    chart
        .draw_series(results.iter().enumerate().map(|(i, r)| {
            let x = i as f64;
            Rectangle::new(
                [(x + 0.02, 0.0), (x + 0.38, r.commands.sent_per_section)],
                sent_color.filled(),
            )
        }))?
        .label("commands sent by clients (round trips)")
        .legend(move |(x, y)| Rectangle::new([(x, y - 6), (x + 14, y + 6)], sent_color.filled()));
    let small =
        TextStyle::from(("sans-serif", 12).into_font()).pos(Pos::new(HPos::Center, VPos::Bottom));
    chart.draw_series(results.iter().enumerate().flat_map(|(i, r)| {
        let x = i as f64;
        [
            Text::new(
                format!("{:.2}", r.commands.lock_per_section),
                (x - 0.2, r.commands.lock_per_section + y_hi * 0.01),
                small.clone(),
            ),
            Text::new(
                format!("{:.2}", r.commands.sent_per_section),
                (x + 0.2, r.commands.sent_per_section + y_hi * 0.01),
                small.clone(),
            ),
        ]
    }))?;
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK.mix(0.4))
        .label_font(("sans-serif", 13))
        .draw()?;
    root.present()?;
    Ok(())
}

/// An x axis of `n` slots centred on 0, 1, .. n-1, with one key point (label) per slot.
struct Slots(usize);

impl plotters::coord::ranged1d::Ranged for Slots {
    type FormatOption = plotters::coord::ranged1d::DefaultFormatting;
    type ValueType = f64;

    fn map(&self, value: &f64, limit: (i32, i32)) -> i32 {
        let r = self.range();
        let frac = (value - r.start) / (r.end - r.start);
        limit.0 + (frac * f64::from(limit.1 - limit.0)).round() as i32
    }

    fn key_points<H: plotters::coord::ranged1d::KeyPointHint>(&self, _hint: H) -> Vec<f64> {
        (0..self.0).map(|i| i as f64).collect()
    }

    fn range(&self) -> std::ops::Range<f64> {
        -0.5..self.0 as f64 - 0.5
    }
}

fn parent_main(args: &Args) -> Res<()> {
    let settings = Settings::from_args(args)?;
    let strategies: Vec<Strategy> = if args.strategies.is_empty() {
        Strategy::ALL.to_vec()
    } else {
        let mut v = args.strategies.clone();
        v.dedup();
        v
    };
    // Keep a throwaway server alive until the end.
    let (url, _server) = match &args.url {
        Some(url) => (url.clone(), None),
        None => {
            let server = server::RedisServer::start();
            (server.url(), Some(server))
        }
    };
    let bar = if args.json {
        ProgressBar::hidden()
    } else {
        let total: u64 = strategies
            .iter()
            .map(|&st| (settings.processes * settings.threads * settings.sections_for(st)) as u64)
            .sum();
        let bar = ProgressBar::new(total);
        bar.set_style(
            ProgressStyle::with_template(
                "{msg:>15} [{bar:40}] {pos}/{len} sections  {elapsed_precise}",
            )?
            .progress_chars("=> "),
        );
        bar
    };
    let mut ctx = Ctx {
        url: &url,
        settings: &settings,
        admin: raw_conn(&url)?,
        bar,
        stall: Duration::from_secs(args.stall_s.max(1)),
    };
    let run_id = format!("{}", std::process::id());
    let mut results = Vec::new();
    for &strategy in &strategies {
        results.push(run_strategy(&mut ctx, strategy, &run_id)?);
    }
    ctx.bar.finish_and_clear();

    if args.json {
        let out = Output {
            settings: &settings,
            redis_url: &url,
            results: &results,
        };
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        print_table(&settings, &url, &results);
    }
    if let Some(path) = &args.svg {
        draw_svg(path, &settings, &results)?;
        if !args.json {
            println!("\nchart written to {}", path.display());
        }
    }
    if results.iter().any(|r| !r.counter.exact) {
        return Err("a counter is off: mutual exclusion failed".into());
    }
    Ok(())
}

fn main() {
    let args = Args::parse();
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    if args.worker {
        if let Err(e) = worker_main(&args) {
            send(&Msg::Failed {
                error: e.to_string(),
            });
            std::process::exit(1);
        }
        return;
    }
    if let Err(e) = parent_main(&args) {
        eprintln!("contend: {e}");
        std::process::exit(1);
    }
}
