//! contend: how much Redis traffic and waiting each wakeup strategy costs under contention.
//!
//! Runs P processes × T threads × S critical sections of H µs on K keys, once per strategy:
//!
//! | strategy         | builder                                                          |
//! |------------------|------------------------------------------------------------------|
//! | `poll-100ms`     | `.wakeup(Wakeup::Polling(100 ms)).local_handoff(false)`          |
//! | `poll-1ms`       | `.wakeup(Wakeup::Polling(1 ms)).local_handoff(false)`            |
//! | `notify`         | `.wakeup(Wakeup::Notifications).local_handoff(false)`            |
//! | `notify+handoff` | the defaults: notifications and the local baton (`--max-handoffs`, `--slice-ms` set its budget) |
//!
//! and prints one table: throughput (also as a share of the `ideal` row), how long `lock()`
//! waited (p50/p99/max), Redis commands per critical section, fairness, and whether a
//! counter kept in Redis came out exact.
//!
//! ```text
//! cargo run --release --example contend -- --quick
//! cargo run --release --example contend -- -p 4 -t 8 -s 200 --svg /tmp/contend.svg
//! cargo run --release --example contend -- --url redis://127.0.0.1:6379/ --strategies notify,notify+handoff
//! cargo run --release --example contend -- -p 4 -t 8 --strategies notify+handoff --max-handoffs 64 --slice-ms 2.5
//! cargo run --release --example contend -- --matrix
//! ```
//!
//! * Each critical section locks key `(thread + i) mod K`, reads that key's counter with
//!   `GET` on the thread's own raw connection, sleeps H µs, writes it back with `SET`, and
//!   unlocks. Only mutual exclusion across all processes keeps the counters exact.
//! * `ideal`, the first row: the same critical sections (GET, H µs, SET on the same server)
//!   run back to back by ONE thread of the parent process, with no lock at all — the
//!   throughput a perfect lock would reach on one key. It runs as many sections as the
//!   strategies (P × T × S), at most 5,000 (beyond that its rate is measured on 5,000 and
//!   its time extrapolated), half before and half after the strategies, so that a drift in
//!   the machine's load weighs on both alike (the table shows each half's rate).
//!   `% ideal` = a strategy's sections/s ÷ ideal's. With
//!   K > 1 keys, sections on different keys can run in parallel, so more than 100% is
//!   possible.
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
//!   `proc gap`: the longest time a process completed no section. `--json` adds, from the
//!   fencing tokens: `max_tenure` (most sections one remote acquisition served, i.e. its
//!   local handoffs + 1), `max_tenures_in_row` (most remote acquisitions in a row by one
//!   process while another still had sections to do), `max_run` (the same in sections),
//!   `switches`, `tail_alone_us`/`tail_alone_sections` (the end of the run, when only the
//!   last process still had sections to do), plus
//!   each process's client counters. `--sections-csv FILE` writes every section (end
//!   time, wait, fence, handoff number) for a closer look.
//! * `--quick`: P=2, T=4, S=100, H=100 µs, K=1, and `poll-100ms` runs only S/5 sections per
//!   thread (`--slow-sections`), since each of its waits lasts about a polling period.
//!   It finishes in well under a minute on 2 cores. Without `--quick` the defaults are
//!   P=4, T=8, S=200, H=100 µs, K=1, lease 10 s.
//! * `--matrix`: one combined table over the configurations 1 process × {2, 8, 32} threads
//!   and 4 processes × 8 threads, each with its `ideal` row and the strategies `notify`
//!   (no handoff) and `notify+handoff`, H=100 µs, S=500 sections per thread (about a
//!   minute on 2 cores; `--quick`: S=60). `-s`, `--hold-us`, `-k`, `--lease-ms`,
//!   `--max-handoffs` and `--slice-ms` still apply; `-p`, `-t` and `--strategies` do not.
//!   It ends with the target check for 1 × 8: notify+handoff at 80% of ideal or more and
//!   fewer than 0.2 Redis commands per section.
//! * Without `--url` the tool starts its own `redis-server` (no persistence, temp dir, free
//!   127.0.0.1 port) and stops it at the end. Unix only (it reads `CLOCK_MONOTONIC`, which
//!   all processes of a machine share).

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};
use crossbeam_channel::{Receiver, RecvTimeoutError};
use indicatif::{ProgressBar, ProgressStyle};
use redbaton::{LockClient, Unlocked, Wakeup};
use redbaton_testkit::{clock, server};
use serde::{Deserialize, Serialize};

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
    after_help = "--quick = -p 2 -t 4 -s 100 --hold-us 100 -k 1 and poll-100ms with S/5 sections; explicit flags override it.\n\
                  --matrix = 1×2, 1×8, 1×32 and 4×8 (processes × threads) with notify and notify+handoff, H=100µs, S=500 (--quick: S=60)."
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
    /// Hold the lock by busy-waiting H µs instead of sleeping: steadier timings (no timer
    /// slack, no wake-up from an idle CPU), at the cost of a busy core per holder.
    #[arg(long)]
    spin: bool,
    /// Number of lock keys; section i of thread g takes key (g + i) mod K [default: 1].
    #[arg(short = 'k', long)]
    keys: Option<usize>,
    /// Lock lease in ms [default: 10000].
    #[arg(long)]
    lease_ms: Option<u64>,
    /// Strategies to run, comma-separated [default: all four].
    #[arg(long, value_enum, value_delimiter = ',')]
    strategies: Vec<Strategy>,
    /// Handoff budget of notify+handoff: consecutive local handoffs while another process
    /// waits [default: the library's].
    #[arg(long, value_name = "N")]
    max_handoffs: Option<u32>,
    /// Handoff budget of notify+handoff: how long one process may keep passing the lock
    /// on locally while another waits, in ms (fractions allowed) [default: the library's].
    #[arg(long, value_name = "MS")]
    slice_ms: Option<f64>,
    /// Run the matrix (see below) and print one combined table.
    #[arg(long)]
    matrix: bool,
    /// Small, fast settings (see below).
    #[arg(long)]
    quick: bool,
    /// Print machine-readable results (JSON) instead of the table; no progress bar.
    #[arg(long)]
    json: bool,
    /// Write an SVG chart of throughput and commands per section.
    #[arg(long, value_name = "FILE")]
    svg: Option<PathBuf>,
    /// Write every critical section as a CSV line (config, strategy, key, process, thread,
    /// section, end µs after go, wait µs, remote fence, local handoff number).
    #[arg(long, value_name = "FILE")]
    sections_csv: Option<PathBuf>,
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
            Strategy::NotifyHandoff => {
                let b = match s.max_handoffs {
                    Some(n) => b.max_handoffs(n),
                    None => b,
                };
                match s.slice() {
                    Some(d) => b.handoff_slice(d),
                    None => b,
                }
            }
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
    /// Hold by busy-waiting instead of sleeping.
    spin: bool,
    /// notify+handoff's budget; `None` = the library's default.
    max_handoffs: Option<u32>,
    slice_ms: Option<f64>,
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
            spin: a.spin,
            keys: a.keys.unwrap_or(k),
            lease_ms: a.lease_ms.unwrap_or(10_000),
            max_handoffs: a.max_handoffs,
            slice_ms: a.slice_ms,
        };
        if s.processes == 0 || s.threads == 0 || s.keys == 0 || s.sections == 0 {
            return Err("--processes, --threads, --sections and --keys must be at least 1".into());
        }
        if s.max_handoffs == Some(0) {
            return Err("--max-handoffs must be at least 1".into());
        }
        if let Some(ms) = s.slice_ms
            && !(ms.is_finite() && ms > 0.0 && ms < 1e9)
        {
            return Err(format!("--slice-ms {ms}: must be a positive number of ms").into());
        }
        Ok(s)
    }

    fn hold_desc(&self) -> String {
        let how = if self.spin { "busy-wait" } else { "sleep" };
        format!("{}µs ({how})", self.hold_us)
    }

    fn slice(&self) -> Option<Duration> {
        self.slice_ms.map(|ms| Duration::from_secs_f64(ms / 1e3))
    }

    /// Every section of every thread (poll-100ms may run fewer).
    fn total_sections(&self) -> usize {
        self.processes * self.threads * self.sections
    }

    /// The handoff budget notify+handoff runs with, for headers: explicit values, or the
    /// library's defaults (read from the builder's `Debug`, so they stay true if they change).
    fn budget(&self) -> String {
        let defaults = format!("{:?}", redbaton::Builder::default());
        let field = |name: &str| -> String {
            defaults
                .split_once(&format!("{name}: "))
                .map(|(_, rest)| rest.split([',', ' ', '}']).next().unwrap_or("?").to_owned())
                .unwrap_or_else(|| "?".to_owned())
        };
        let n = match self.max_handoffs {
            Some(n) => n.to_string(),
            None => format!("{} (library default)", field("max_handoffs")),
        };
        let slice = match self.slice_ms {
            Some(ms) => format!("{ms}ms"),
            None => format!("{} (library default)", field("handoff_slice")),
        };
        format!("max_handoffs {n}, handoff_slice {slice}")
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
    /// Each section's fencing token (remote fence << 20 | local handoff number).
    fences: Vec<u64>,
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

/// Microseconds on CLOCK_MONOTONIC, which every process of the machine shares.
fn mono_us() -> u64 {
    clock::mono_ns() / 1_000
}

/// The critical section's work: sleep (or busy-wait) for `hold`.
fn hold_for(hold: Duration, spin: bool) {
    if hold.is_zero() {
        return;
    }
    if spin {
        let start = Instant::now();
        while start.elapsed() < hold {
            std::hint::spin_loop();
        }
    } else {
        std::thread::sleep(hold);
    }
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
    // Dropping `finished` stops the reporter at once (no sleep to wait out).
    let (finished, stop) = crossbeam_channel::bounded::<()>(0);
    let reporter = {
        let done = done.clone();
        std::thread::spawn(move || {
            let mut last = 0;
            while let Err(RecvTimeoutError::Timeout) = stop.recv_timeout(Duration::from_millis(100))
            {
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
    drop(finished);
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
        fences: Vec::with_capacity(sections),
    };
    let mut key_counts = vec![0u64; s.keys];
    let mut lost = 0;
    for i in 0..sections {
        let k = (global_thread + i) % s.keys;
        let asked = Instant::now();
        let guard = client.lock(&names[k])?;
        let fence = guard.fencing_token();
        let waited = asked.elapsed();
        let n: Option<u64> = redis::cmd("GET").arg(&counters[k]).query(conn)?;
        hold_for(hold, s.spin);
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
        report.fences.push(fence);
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
    /// The most sections one process completed in a row on one key (completion order)
    /// while another process still had sections to do on it.
    max_run: u64,
    /// How many times a key went from one process to another.
    switches: u64,
    /// The most sections one remote acquisition served (its local handoffs + 1).
    max_tenure: u64,
    /// The most remote acquisitions in a row one process made on one key while another
    /// process still had sections to do on it.
    max_tenures_in_row: u64,
    /// The longest time a process completed no section (from `go` to its last section).
    process_max_gap_us: u64,
    /// The end of the run, when only the last process still had sections to do: how long
    /// it lasted and how many sections it saw (0 with one process).
    tail_alone_us: u64,
    tail_alone_sections: u64,
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
    /// From `go` to the end of the last section.
    elapsed_s: f64,
    /// From `go` to the last worker's report.
    wall_s: f64,
    sections_per_s: f64,
    wait: Waits,
    commands: Commands,
    fairness: Fairness,
    counter: Counter,
    client_stats: ClientStats,
    /// Each process's own counters, by worker id.
    process_stats: Vec<ClientStats>,
    /// sections_per_s ÷ the ideal row's, in percent.
    pct_ideal: f64,
}

/// The `ideal` row: the same critical sections run back to back by one thread, no lock.
#[derive(Serialize, Debug)]
struct IdealResult {
    /// The sections it stands for: the strategies' P × T × S.
    sections: u64,
    /// The sections actually run (at most `IDEAL_CAP`): half before the strategies, half
    /// after.
    sections_run: u64,
    /// Measured time of the sections run.
    measured_s: f64,
    /// Time `sections` would take at the measured rate.
    elapsed_s: f64,
    sections_per_s: f64,
    /// The rate of each half (before, after the strategies).
    parts_per_s: Vec<f64>,
    /// How long one section (GET, hold, SET) took, µs.
    section_p50_us: u64,
    section_p99_us: u64,
    /// Counted like the strategies': with no lock, `lock` should come out 0.
    commands: Commands,
    counter: Counter,
}

/// One configuration's ideal row and strategy rows.
#[derive(Serialize, Debug)]
struct ConfigResult {
    settings: Settings,
    /// notify+handoff's budget, as used.
    handoff_budget: String,
    ideal: IdealResult,
    results: Vec<StrategyResult>,
}

#[derive(Serialize)]
struct Output<'a> {
    redis_url: &'a str,
    #[serde(flatten)]
    config: &'a ConfigResult,
}

#[derive(Serialize)]
struct MatrixOutput<'a> {
    redis_url: &'a str,
    matrix: bool,
    elapsed_s: f64,
    configs: &'a [ConfigResult],
    target: Option<Target>,
}

/// The issue's target: 1 process × 8 threads, notify+handoff.
#[derive(Serialize, Debug)]
struct Target {
    pct_ideal: f64,
    sent_per_section: f64,
    lock_per_section: f64,
    /// pct_ideal ≥ 80.
    throughput_met: bool,
    /// Fewer than 0.2 commands per section, sent by clients / run by the server.
    sent_met: bool,
    server_side_met: bool,
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
            .args(s.spin.then_some("--spin"))
            .args(["--keys", &s.keys.to_string()])
            .args(["--lease-ms", &s.lease_ms.to_string()])
            .args(
                s.max_handoffs
                    .iter()
                    .flat_map(|n| ["--max-handoffs".to_owned(), n.to_string()]),
            )
            .args(
                s.slice_ms
                    .iter()
                    .flat_map(|ms| ["--slice-ms".to_owned(), ms.to_string()]),
            )
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
    admin: redis::Connection,
    bar: ProgressBar,
    stall: Duration,
    /// `--sections-csv`: one line per critical section.
    csv: Option<std::io::BufWriter<std::fs::File>>,
}

/// The window's net calls per command (INFO commandstats readings `before` and `after`),
/// minus our own INFO (the first reading is counted by the second) and the counter's
/// GET + SET of each of `sections` sections.
fn net_commands(
    before: &HashMap<String, u64>,
    after: &HashMap<String, u64>,
    sections: u64,
) -> Commands {
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
    Commands {
        server_total,
        counter,
        lock,
        lock_per_section: per(lock),
        sent,
        sent_per_section: per(sent),
        by_command,
    }
}

/// `q`-quantile (nearest rank) of sorted values; 0 when empty.
fn percentile(sorted: &[u64], q: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

/// At most this many sections for the ideal row; beyond, its rate is extrapolated.
const IDEAL_CAP: usize = 5_000;

/// One half of the ideal row.
struct IdealPart {
    measured: Duration,
    /// How long each section took, µs.
    times: Vec<u64>,
    commands: Commands,
    /// Counter values found, and expected, per key.
    actual: Vec<u64>,
    expected: Vec<u64>,
}

/// `n` of the strategies' critical sections (GET, hold, SET on the same server) run back
/// to back by this thread, with no lock.
fn run_ideal_part(ctx: &mut Ctx, s: &Settings, run_id: &str, n: usize) -> Res<IdealPart> {
    let prefix = format!("contend:{run_id}:ideal:");
    let counters: Vec<String> = (0..s.keys).map(|k| counter_key(&prefix, k)).collect();
    for c in &counters {
        redis::cmd("SET")
            .arg(c)
            .arg(0)
            .query::<()>(&mut ctx.admin)?;
    }
    let mut conn = raw_conn(ctx.url)?;
    let hold = Duration::from_micros(s.hold_us);
    let mut times = Vec::with_capacity(n);

    let _ = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query::<()>(&mut ctx.admin);
    let before = commandstats(&mut ctx.admin)?;
    let started = Instant::now();
    for i in 0..n {
        let k = i % s.keys;
        let t0 = Instant::now();
        let v: Option<u64> = redis::cmd("GET").arg(&counters[k]).query(&mut conn)?;
        hold_for(hold, s.spin);
        redis::cmd("SET")
            .arg(&counters[k])
            .arg(v.unwrap_or(0) + 1)
            .query::<()>(&mut conn)?;
        times.push(t0.elapsed().as_micros() as u64);
    }
    let measured = started.elapsed();
    let after = commandstats(&mut ctx.admin)?;
    drop(conn);

    let mut actual = Vec::with_capacity(s.keys);
    for c in &counters {
        let v: Option<u64> = redis::cmd("GET").arg(c).query(&mut ctx.admin)?;
        actual.push(v.unwrap_or(0));
    }
    cleanup(&mut ctx.admin, &prefix)?;
    Ok(IdealPart {
        measured,
        times,
        commands: net_commands(&before, &after, n as u64),
        actual,
        expected: (0..s.keys)
            .map(|k| (0..n).filter(|i| i % s.keys == k).count() as u64)
            .collect(),
    })
}

/// The ideal row from its halves, run before and after the strategies (so that a machine
/// whose load drifts during the run weighs on both alike).
fn ideal_result(s: &Settings, parts: &[IdealPart]) -> IdealResult {
    let total = s.total_sections() as u64;
    let run: u64 = parts.iter().map(|p| p.times.len() as u64).sum();
    let measured: Duration = parts.iter().map(|p| p.measured).sum();
    let rate = run as f64 / measured.as_secs_f64().max(1e-9);
    let mut times: Vec<u64> = parts.iter().flat_map(|p| p.times.iter().copied()).collect();
    times.sort_unstable();
    let mut by_command: HashMap<String, u64> = HashMap::new();
    for p in parts {
        for (name, n) in &p.commands.by_command {
            *by_command.entry(name.clone()).or_default() += n;
        }
    }
    let sum = |f: fn(&Commands) -> u64| parts.iter().map(|p| f(&p.commands)).sum::<u64>();
    let (lock, sent) = (sum(|c| c.lock), sum(|c| c.sent));
    let per = |n: u64| n as f64 / run.max(1) as f64;
    let actual: u64 = parts.iter().flat_map(|p| &p.actual).sum();
    IdealResult {
        sections: total,
        sections_run: run,
        measured_s: measured.as_secs_f64(),
        elapsed_s: total as f64 / rate,
        sections_per_s: rate,
        parts_per_s: parts
            .iter()
            .map(|p| p.times.len() as f64 / p.measured.as_secs_f64().max(1e-9))
            .collect(),
        section_p50_us: percentile(&times, 0.50),
        section_p99_us: percentile(&times, 0.99),
        commands: Commands {
            server_total: sum(|c| c.server_total),
            counter: sum(|c| c.counter),
            lock,
            lock_per_section: per(lock),
            sent,
            sent_per_section: per(sent),
            by_command,
        },
        counter: Counter {
            expected: run,
            actual,
            exact: parts.iter().all(|p| p.actual == p.expected),
            lost: 0,
        },
    }
}

fn run_strategy(
    ctx: &mut Ctx,
    s: &Settings,
    strategy: Strategy,
    label: &str,
    run_id: &str,
) -> Res<StrategyResult> {
    let per_thread = s.sections_for(strategy);
    let prefix = format!("contend:{run_id}:{}:", strategy.name());
    for k in 0..s.keys {
        redis::cmd("SET")
            .arg(counter_key(&prefix, k))
            .arg(0)
            .query::<()>(&mut ctx.admin)?;
    }
    ctx.bar.set_message(format!("{label}{}", strategy.name()));
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
        // Also the time origin of the workers' completion times.
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
    let wall = started.elapsed();
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
    if let Some(csv) = &mut ctx.csv {
        let config = format!("{}x{}", s.processes, s.threads);
        for r in &reports {
            for (t, th) in r.threads.iter().enumerate() {
                let global = r.worker * s.threads + t;
                for (i, ((&end, &wait), &fence)) in th
                    .done_us
                    .iter()
                    .zip(&th.waits_us)
                    .zip(&th.fences)
                    .enumerate()
                {
                    writeln!(
                        csv,
                        "{config},{},{},{},{t},{i},{end},{wait},{},{}",
                        strategy.name(),
                        (global + i) % s.keys,
                        r.worker,
                        fence >> 20,
                        fence & ((1 << 20) - 1),
                    )?;
                }
            }
        }
        csv.flush()?;
    }
    let mut counters = Vec::with_capacity(s.keys);
    for k in 0..s.keys {
        let n: Option<u64> = redis::cmd("GET")
            .arg(counter_key(&prefix, k))
            .query(&mut ctx.admin)?;
        counters.push(n.unwrap_or(0));
    }
    cleanup(&mut ctx.admin, &prefix)?;

    // Sections, waits, fairness. The run lasts from `go` to the last section's end (the
    // workers' reports arrive a little later).
    let last_done_us = reports
        .iter()
        .flat_map(|r| &r.threads)
        .filter_map(|t| t.done_us.last().copied())
        .max()
        .unwrap_or(0);
    let elapsed = if last_done_us > 0 {
        Duration::from_micros(last_done_us)
    } else {
        wall
    };
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
    let wait = Waits {
        p50_us: percentile(&waits, 0.50),
        p99_us: percentile(&waits, 0.99),
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
    // Completion order per key: (done_us, process). Thread t of worker w is global thread
    // w × T + t, and its section i took key (global + i) mod K.
    let mut per_key: Vec<Vec<(u64, usize, u64)>> = vec![Vec::new(); s.keys];
    for r in &reports {
        for (t, th) in r.threads.iter().enumerate() {
            let global = r.worker * s.threads + t;
            for (i, (&d, &f)) in th.done_us.iter().zip(&th.fences).enumerate() {
                per_key[(global + i) % s.keys].push((d, r.worker, f >> 20));
            }
        }
    }
    // Runs only count while another process still had sections to do on the key: once a
    // process is alone, it keeps the lock by right.
    let (mut max_run, mut switches) = (0u64, 0u64);
    let (mut max_tenure, mut max_tenures_in_row) = (0u64, 0u64);
    for seq in &mut per_key {
        seq.sort_unstable();
        let mut last_end: HashMap<usize, u64> = HashMap::new();
        for &(end, p, _) in seq.iter() {
            last_end.insert(p, end);
        }
        let others_until = |p: usize| {
            last_end
                .iter()
                .filter(|&(&q, _)| q != p)
                .map(|(_, &e)| e)
                .max()
                .unwrap_or(0)
        };
        let (mut run, mut prev) = (0u64, None);
        let (mut tenures, mut tenure, mut prev_fence) = (0u64, 0u64, None);
        for &(end, p, fence) in seq.iter() {
            let contested = end < others_until(p);
            if prev == Some(p) {
                run += 1;
            } else {
                switches += u64::from(prev.is_some());
                run = 1;
                tenures = 0;
                prev = Some(p);
            }
            if prev_fence == Some(fence) {
                tenure += 1;
            } else {
                tenure = 1;
                tenures += 1;
                prev_fence = Some(fence);
            }
            max_tenure = max_tenure.max(tenure);
            if contested {
                max_run = max_run.max(run);
                max_tenures_in_row = max_tenures_in_row.max(tenures);
            }
        }
    }
    let process_max_gap_us = reports
        .iter()
        .map(|r| {
            let mut done: Vec<u64> = r
                .threads
                .iter()
                .flat_map(|t| t.done_us.iter().copied())
                .collect();
            done.sort_unstable();
            let mut last = 0;
            let mut gap = 0;
            for d in done {
                gap = gap.max(d.saturating_sub(last));
                last = d;
            }
            gap
        })
        .max()
        .unwrap_or(0);
    let mut finish: Vec<u64> = reports
        .iter()
        .map(|r| {
            r.threads
                .iter()
                .filter_map(|t| t.done_us.last().copied())
                .max()
                .unwrap_or(0)
        })
        .collect();
    finish.sort_unstable();
    let (tail_alone_us, tail_alone_sections) = match finish[..] {
        [.., second, last] => (
            last - second,
            reports
                .iter()
                .flat_map(|r| &r.threads)
                .flat_map(|t| &t.done_us)
                .filter(|&&d| d > second)
                .count() as u64,
        ),
        _ => (0, 0),
    };
    let fairness = Fairness {
        first_finish_us,
        tail_alone_us,
        tail_alone_sections,
        thread_min: thread_counts.iter().copied().min().unwrap_or(0),
        thread_max: thread_counts.iter().copied().max().unwrap_or(0),
        process_min: process_counts.iter().copied().min().unwrap_or(0),
        process_max: process_counts.iter().copied().max().unwrap_or(0),
        max_run,
        switches,
        max_tenure,
        max_tenures_in_row,
        process_max_gap_us,
    };

    let commands = net_commands(&before, &after, sections);

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
        wall_s: wall.as_secs_f64(),
        sections_per_s: sections as f64 / elapsed.as_secs_f64().max(1e-9),
        wait,
        commands,
        fairness,
        counter,
        client_stats,
        process_stats: reports.iter().map(|r| r.stats).collect(),
        pct_ideal: 0.0,
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

fn fmt_pct(x: f64) -> String {
    if x >= 10.0 {
        format!("{x:.0}%")
    } else {
        format!("{x:.1}%")
    }
}

/// Table columns after the first one(s): (title, width); the counter column follows.
const COLUMNS: [(&str, usize); 10] = [
    ("sect/s", 9),
    ("% ideal", 8),
    ("wait p50", 9),
    ("p99", 9),
    ("max", 9),
    ("cmds/sect", 10),
    ("sent/sect", 10),
    ("thr min-max", 12),
    ("proc min-max", 13),
    ("proc gap", 9),
];

fn table_line(first: &[(&str, usize)], cells: &[String], last: &str) -> String {
    let mut line = String::new();
    for (text, width) in first {
        line.push_str(&format!("{text:<width$} "));
    }
    for (cell, (_, width)) in cells.iter().zip(COLUMNS) {
        line.push_str(&format!("{cell:>width$} "));
    }
    line.push(' ');
    line.push_str(last);
    line.trim_end().to_owned()
}

fn table_header(first: &[(&str, usize)]) -> String {
    let titles: Vec<String> = COLUMNS.iter().map(|(t, _)| t.to_string()).collect();
    let header = table_line(first, &titles, "counter");
    let rule = "-".repeat(header.chars().count() + 8);
    format!("{header}\n{rule}")
}

fn ideal_cells(i: &IdealResult) -> (Vec<String>, String) {
    let dash = || "-".to_owned();
    let cells = vec![
        fmt_rate(i.sections_per_s),
        "100%".to_owned(),
        dash(),
        dash(),
        dash(),
        format!("{:.2}", i.commands.lock_per_section),
        format!("{:.2}", i.commands.sent_per_section),
        dash(),
        dash(),
        dash(),
    ];
    let counter = if i.counter.exact {
        format!("exact {}", i.counter.actual)
    } else {
        format!("WRONG {}/{}", i.counter.actual, i.counter.expected)
    };
    (cells, counter)
}

fn result_cells(r: &StrategyResult) -> (Vec<String>, String) {
    let f = &r.fairness;
    let cells = vec![
        fmt_rate(r.sections_per_s),
        fmt_pct(r.pct_ideal),
        fmt_us(r.wait.p50_us),
        fmt_us(r.wait.p99_us),
        fmt_us(r.wait.max_us),
        format!("{:.2}", r.commands.lock_per_section),
        format!("{:.2}", r.commands.sent_per_section),
        format!("{}-{}", f.thread_min, f.thread_max),
        format!("{}-{}", f.process_min, f.process_max),
        fmt_us(f.process_max_gap_us),
    ];
    let counter = if r.counter.exact {
        format!("exact {}", r.counter.actual)
    } else {
        format!(
            "WRONG {}/{} (lost {})",
            r.counter.actual, r.counter.expected, r.counter.lost
        )
    };
    (cells, counter)
}

const LEGEND: &str = "\
ideal     = the same critical sections (GET, hold, SET) back to back in ONE thread with NO lock.
% ideal   = sections/s ÷ ideal's sections/s.
wait      = time spent in lock().
cmds/sect = Redis commands per critical section (INFO commandstats), EXCLUDING the counter's GET+SET
            (2 per section) and the tool's own INFO; includes what the Lua scripts run inside EVALSHA.
sent/sect = the same, counting only the commands clients sent (round trips).
thr/proc min-max = sections done by the slowest / fastest thread and process when the first thread
            finished its S (all reach S in the end).
proc gap  = the longest time a process completed no section (from go to its last section).
counter   = every Redis counter (GET+SET under the lock) equals the sections done on its key.";

fn ideal_note(i: &IdealResult) -> String {
    let run = if i.sections_run < i.sections {
        format!(
            "{} of its {} sections run, time extrapolated",
            i.sections_run, i.sections
        )
    } else {
        format!("{} sections", i.sections_run)
    };
    let halves: Vec<String> = i.parts_per_s.iter().map(|&r| fmt_rate(r)).collect();
    format!(
        "{run} (half before, half after the strategies: {}/s); one section took p50 {} / p99 {}",
        halves.join(" and "),
        fmt_us(i.section_p50_us),
        fmt_us(i.section_p99_us)
    )
}

fn print_table(url: &str, c: &ConfigResult) {
    let s = &c.settings;
    println!(
        "contend: P={} processes × T={} threads × S={} sections (poll-100ms: {}) of H={} on K={} key{}, lease {} ms, redis {url}",
        s.processes,
        s.threads,
        s.sections,
        s.slow_sections,
        s.hold_desc(),
        s.keys,
        if s.keys == 1 { "" } else { "s" },
        s.lease_ms,
    );
    println!("notify+handoff budget: {}", c.handoff_budget);
    println!("ideal: {}", ideal_note(&c.ideal));
    println!("{LEGEND}");
    println!();
    let first = [("strategy", 15)];
    println!("{}", table_header(&first));
    let (cells, counter) = ideal_cells(&c.ideal);
    println!("{}", table_line(&[("ideal", 15)], &cells, &counter));
    for r in &c.results {
        let (cells, counter) = result_cells(r);
        println!(
            "{}",
            table_line(&[(r.strategy.name(), 15)], &cells, &counter)
        );
    }
}

/// The matrix's configurations: (processes, threads).
const MATRIX: [(usize, usize); 4] = [(1, 2), (1, 8), (1, 32), (4, 8)];
/// Sections per thread in the matrix (about a minute on 2 cores), and with `--quick`.
const MATRIX_SECTIONS: usize = 500;
const MATRIX_SECTIONS_QUICK: usize = 60;

fn config_label(s: &Settings) -> String {
    format!("{}×{}", s.processes, s.threads)
}

fn print_matrix(url: &str, configs: &[ConfigResult], elapsed: Duration, target: Option<&Target>) {
    let Some(s) = configs.first().map(|c| &c.settings) else {
        return;
    };
    println!(
        "contend --matrix: processes × threads ∈ {{1×2, 1×8, 1×32, 4×8}}, S={} sections per thread of H={} on K={} key{}, lease {} ms, redis {url}",
        s.sections,
        s.hold_desc(),
        s.keys,
        if s.keys == 1 { "" } else { "s" },
        s.lease_ms,
    );
    println!(
        "S is sized so that the whole matrix takes about a minute on 2 cores (--quick: S={MATRIX_SECTIONS_QUICK}); this one took {:.0} s.",
        elapsed.as_secs_f64()
    );
    println!("notify+handoff budget: {}", configs[0].handoff_budget);
    println!(
        "ideal: P × T × S sections (at most {IDEAL_CAP}; beyond that the rate is measured on {IDEAL_CAP}), half before and half after each configuration's strategies."
    );
    println!("{LEGEND}");
    println!();
    let first = [("config", 6), ("strategy", 15)];
    println!("{}", table_header(&first));
    for (n, c) in configs.iter().enumerate() {
        if n > 0 {
            println!();
        }
        let label = config_label(&c.settings);
        let (cells, counter) = ideal_cells(&c.ideal);
        println!(
            "{}",
            table_line(&[(&label, 6), ("ideal", 15)], &cells, &counter)
        );
        for r in &c.results {
            let (cells, counter) = result_cells(r);
            println!(
                "{}",
                table_line(&[(&label, 6), (r.strategy.name(), 15)], &cells, &counter)
            );
        }
    }
    println!();
    for c in configs {
        println!(
            "ideal {:<5} {}",
            config_label(&c.settings),
            ideal_note(&c.ideal)
        );
    }
    if let Some(t) = target {
        let mark = |ok: bool| if ok { "met" } else { "NOT met" };
        println!();
        println!(
            "target (1×8, notify+handoff, H=100µs): ≥ 80% of ideal: {} ({}); < 0.2 commands/section: sent {:.3} ({}), server-side {:.3} ({})",
            fmt_pct(t.pct_ideal),
            mark(t.throughput_met),
            t.sent_per_section,
            mark(t.sent_met),
            t.lock_per_section,
            mark(t.server_side_met),
        );
    }
}

fn target_of(configs: &[ConfigResult]) -> Option<Target> {
    let c = configs
        .iter()
        .find(|c| c.settings.processes == 1 && c.settings.threads == 8)?;
    let r = c
        .results
        .iter()
        .find(|r| r.strategy == Strategy::NotifyHandoff)?;
    Some(Target {
        pct_ideal: r.pct_ideal,
        sent_per_section: r.commands.sent_per_section,
        lock_per_section: r.commands.lock_per_section,
        throughput_met: r.pct_ideal >= 80.0,
        sent_met: r.commands.sent_per_section < 0.2,
        server_side_met: r.commands.lock_per_section < 0.2,
    })
}

/// Draws throughput (with each configuration's ideal as a dashed reference line) and
/// commands per section for one or more configurations, one bar per strategy.
fn draw_svg(path: &Path, title: &str, configs: &[ConfigResult]) -> Res<()> {
    use plotters::coord::combinators::IntoLogRange;
    use plotters::prelude::*;
    use plotters::style::text_anchor::{HPos, Pos, VPos};

    // One slot per strategy result, configurations side by side.
    let many = configs.len() > 1;
    let bars: Vec<(String, &StrategyResult)> = configs
        .iter()
        .flat_map(|c| {
            let label = config_label(&c.settings);
            c.results.iter().map(move |r| {
                let name = if many {
                    format!("{label} {}", r.strategy.name())
                } else {
                    r.strategy.name().to_owned()
                };
                (name, r)
            })
        })
        .collect();
    // (first slot, last slot, ideal rate) per configuration.
    let mut groups = Vec::new();
    let mut slot = 0;
    for c in configs {
        let n = c.results.len();
        if n > 0 {
            groups.push((slot, slot + n - 1, c.ideal.sections_per_s));
        }
        slot += n;
    }
    let n = bars.len();
    let x_range = || Slots(n);
    let label = |x: &f64| -> String {
        let i = x.round();
        if (x - i).abs() < 1e-6 && i >= 0.0 {
            bars.get(i as usize)
                .map_or(String::new(), |(name, _)| name.clone())
        } else {
            String::new()
        }
    };
    // Throughput labels go inside the bars' tops, clear of the ideal line just above.
    let inside = TextStyle::from(("sans-serif", 14).into_font())
        .color(&WHITE)
        .pos(Pos::new(HPos::Center, VPos::Top));
    let panel = (130 * n as u32).max(600);

    let root = SVGBackend::new(path, (2 * panel, 560)).into_drawing_area();
    root.fill(&WHITE)?;
    let root = root.titled(title, ("sans-serif", 20))?;
    let (left, right) = root.split_horizontally(panel);

    // Left: throughput, log scale (polling at 100 ms is orders of magnitude slower).
    let rates = || {
        bars.iter()
            .map(|(_, r)| r.sections_per_s)
            .chain(groups.iter().map(|g| g.2))
    };
    let max_rate = rates().fold(1.0f64, f64::max);
    let min_rate = rates().fold(f64::INFINITY, f64::min).max(0.1);
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
        .x_desc(if many {
            "configuration (processes×threads) and strategy"
        } else {
            "strategy"
        })
        .y_desc("critical sections per second (log scale)")
        .x_label_formatter(&label)
        .y_label_formatter(&|y| format!("{y}"))
        .axis_desc_style(("sans-serif", 15))
        .draw()?;
    chart.draw_series(bars.iter().enumerate().map(|(i, (_, r))| {
        let x = i as f64;
        let color = Palette99::pick(if many { i % 2 + 2 } else { i });
        Rectangle::new(
            [(x - 0.32, y_lo), (x + 0.32, r.sections_per_s.max(y_lo))],
            color.filled(),
        )
    }))?;
    chart.draw_series(bars.iter().enumerate().map(|(i, (_, r))| {
        Text::new(
            format!("{} ({})", fmt_rate(r.sections_per_s), fmt_pct(r.pct_ideal)),
            (i as f64, r.sections_per_s.max(y_lo) / 1.08),
            inside.clone(),
        )
    }))?;
    let ideal_color = RGBColor(200, 30, 30);
    chart
        .draw_series(groups.iter().map(|&(a, b, rate)| {
            plotters::element::DashedPathElement::new(
                [(a as f64 - 0.45, rate), (b as f64 + 0.45, rate)],
                8,
                5,
                ideal_color.stroke_width(2),
            )
        }))?
        .label("ideal: the same sections in 1 thread with no lock")
        .legend(move |(x, y)| PathElement::new([(x, y), (x + 14, y)], ideal_color.stroke_width(2)));
    let ideal_text = TextStyle::from(("sans-serif", 13).into_font())
        .color(&ideal_color)
        .pos(Pos::new(HPos::Left, VPos::Bottom));
    chart.draw_series(groups.iter().map(|&(a, _, rate)| {
        Text::new(
            format!("ideal {}", fmt_rate(rate)),
            (a as f64 - 0.43, rate * 1.04),
            ideal_text.clone(),
        )
    }))?;
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK.mix(0.4))
        .label_font(("sans-serif", 13))
        .draw()?;

    // Right: commands per critical section, two bars per strategy.
    let max_cmds = bars
        .iter()
        .map(|(_, r)| r.commands.lock_per_section.max(r.commands.sent_per_section))
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
        .x_desc(if many {
            "configuration (processes×threads) and strategy"
        } else {
            "strategy"
        })
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
        .draw_series(bars.iter().enumerate().map(|(i, (_, r))| {
            let x = i as f64;
            Rectangle::new(
                [(x - 0.38, 0.0), (x - 0.02, r.commands.lock_per_section)],
                all_color.filled(),
            )
        }))?
        .label("all commands (incl. those run inside Lua scripts)")
        .legend(move |(x, y)| Rectangle::new([(x, y - 6), (x + 14, y + 6)], all_color.filled()));
    chart
        .draw_series(bars.iter().enumerate().map(|(i, (_, r))| {
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
    chart.draw_series(bars.iter().enumerate().flat_map(|(i, (_, r))| {
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

fn make_bar(hidden: bool, total: u64) -> Res<ProgressBar> {
    if hidden {
        return Ok(ProgressBar::hidden());
    }
    let bar = ProgressBar::new(total);
    bar.set_style(
        ProgressStyle::with_template(
            "{msg:>20} [{bar:40}] {pos}/{len} sections  {elapsed_precise}",
        )?
        .progress_chars("=> "),
    );
    Ok(bar)
}

/// One configuration: the ideal row, then each strategy.
fn run_config(
    ctx: &mut Ctx,
    s: &Settings,
    strategies: &[Strategy],
    label: &str,
    run_id: &str,
) -> Res<ConfigResult> {
    let n = s.total_sections().min(IDEAL_CAP);
    ctx.bar.set_message(format!("{label}ideal"));
    let first = run_ideal_part(ctx, s, run_id, n / 2)?;
    let mut results = Vec::new();
    for &strategy in strategies {
        results.push(run_strategy(ctx, s, strategy, label, run_id)?);
    }
    ctx.bar.set_message(format!("{label}ideal"));
    let second = run_ideal_part(ctx, s, run_id, n - n / 2)?;
    let ideal = ideal_result(s, &[first, second]);
    for r in &mut results {
        r.pct_ideal = 100.0 * r.sections_per_s / ideal.sections_per_s.max(1e-9);
    }
    Ok(ConfigResult {
        settings: s.clone(),
        handoff_budget: s.budget(),
        ideal,
        results,
    })
}

fn parent_main(args: &Args) -> Res<()> {
    let settings = Settings::from_args(args)?;
    if args.matrix
        && (args.processes.is_some() || args.threads.is_some() || !args.strategies.is_empty())
    {
        return Err("--matrix sets --processes, --threads and --strategies itself".into());
    }
    // The configurations to run, with their strategies.
    let runs: Vec<(Settings, Vec<Strategy>)> = if args.matrix {
        MATRIX
            .iter()
            .map(|&(p, t)| {
                let s = Settings {
                    processes: p,
                    threads: t,
                    sections: args.sections.unwrap_or(if args.quick {
                        MATRIX_SECTIONS_QUICK
                    } else {
                        MATRIX_SECTIONS
                    }),
                    hold_us: args.hold_us.unwrap_or(100),
                    ..settings.clone()
                };
                (s, vec![Strategy::Notify, Strategy::NotifyHandoff])
            })
            .collect()
    } else {
        let strategies = if args.strategies.is_empty() {
            Strategy::ALL.to_vec()
        } else {
            let mut v = args.strategies.clone();
            v.dedup();
            v
        };
        vec![(settings, strategies)]
    };
    // Keep a throwaway server alive until the end.
    let (url, _server) = match &args.url {
        Some(url) => (url.clone(), None),
        None => {
            let server = server::RedisServer::start();
            (server.url(), Some(server))
        }
    };
    let total: u64 = runs
        .iter()
        .flat_map(|(s, strategies)| {
            strategies
                .iter()
                .map(|&st| (s.processes * s.threads * s.sections_for(st)) as u64)
        })
        .sum();
    let mut ctx = Ctx {
        url: &url,
        admin: raw_conn(&url)?,
        bar: make_bar(args.json, total)?,
        stall: Duration::from_secs(args.stall_s.max(1)),
        csv: match &args.sections_csv {
            Some(path) => {
                let mut f = std::io::BufWriter::new(std::fs::File::create(path)?);
                writeln!(
                    f,
                    "config,strategy,key,process,thread,section,end_us,wait_us,fence,handoff"
                )?;
                Some(f)
            }
            None => None,
        },
    };
    let run_id = format!("{}", std::process::id());
    let started = Instant::now();
    let mut configs = Vec::new();
    for (s, strategies) in &runs {
        let label = if args.matrix {
            format!("{} ", config_label(s))
        } else {
            String::new()
        };
        configs.push(run_config(&mut ctx, s, strategies, &label, &run_id)?);
    }
    let elapsed = started.elapsed();
    ctx.bar.finish_and_clear();

    if args.matrix {
        let target = target_of(&configs);
        if args.json {
            let out = MatrixOutput {
                redis_url: &url,
                matrix: true,
                elapsed_s: elapsed.as_secs_f64(),
                configs: &configs,
                target,
            };
            println!("{}", serde_json::to_string_pretty(&out)?);
        } else {
            print_matrix(&url, &configs, elapsed, target.as_ref());
        }
    } else if args.json {
        let out = Output {
            redis_url: &url,
            config: &configs[0],
        };
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        print_table(&url, &configs[0]);
    }
    if let Some(path) = &args.svg {
        let s = &configs[0].settings;
        let keys = format!("K={} key{}", s.keys, if s.keys == 1 { "" } else { "s" });
        let title = if args.matrix {
            format!(
                "redbaton contend --matrix: S={} sections per thread, H={} hold, {keys}; {}",
                s.sections,
                s.hold_desc(),
                s.budget()
            )
        } else {
            format!(
                "redbaton contend: P={} processes × T={} threads × S={} sections (poll-100ms: {}), H={} hold, {keys}",
                s.processes,
                s.threads,
                s.sections,
                s.slow_sections,
                s.hold_desc(),
            )
        };
        draw_svg(path, &title, &configs)?;
        if !args.json {
            println!("\nchart written to {}", path.display());
        }
    }
    let exact = configs
        .iter()
        .all(|c| c.ideal.counter.exact && c.results.iter().all(|r| r.counter.exact));
    if !exact {
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
