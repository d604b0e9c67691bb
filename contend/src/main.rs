//! redbaton-contend: how much Redis traffic and waiting each wakeup strategy costs under contention.
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
//! cargo run --release -p redbaton-contend -- --quick
//! cargo run --release -p redbaton-contend -- -p 4 -t 8 -s 200 --svg /tmp/contend.svg
//! cargo run --release -p redbaton-contend -- --url redis://127.0.0.1:6379/ --strategies notify,notify+handoff
//! cargo run --release -p redbaton-contend -- -p 4 -t 8 --strategies notify+handoff --max-handoffs 64 --slice-ms 2.5
//! cargo run --release -p redbaton-contend -- --matrix
//! cargo run --release -p redbaton-contend -- --compare-cluster
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
//! * `--cluster`: the locks live in a Redis Cluster the tool starts on loopback (3 masters
//!   and 3 replicas, `redbaton_testkit::cluster`); workers build their clients with
//!   `.cluster([seed])`. The counters (data the lock protects: it can live anywhere) and
//!   the `ideal` row go to a separate throwaway `redis-server`. Commands are then summed
//!   over every cluster node, replicas included, without `REPLCONF`, `PING`, `CLUSTER`,
//!   `INFO` and `CLIENT` (replication and housekeeping, not lock traffic); `sent/sect`
//!   counts the masters only. Not with `--url`; `blpop-queue` does not run on a cluster.
//! * `--compare-cluster`: the same configuration against one lock-only node, then against
//!   a cluster (counters on their own server for both, counted alike), both tables, and
//!   per strategy the ratios cluster ÷ one node: lock commands per section on the masters
//!   (target: ≤ 1.2), the same with what replicas re-run, and wait p50 under this load.
//!   `--node-replica` gives the one node a replica, as each cluster master has. Defaults:
//!   P=4, T=4, S=200, H=1000 µs, K=8 (two processes contend for each key, and the keys
//!   spread over the masters), `notify+handoff` only.
//! * Without `--url` the tool starts its own `redis-server` (no persistence, temp dir, free
//!   127.0.0.1 port) and stops it at the end. Unix only (it reads `CLOCK_MONOTONIC`, which
//!   all processes of a machine share).
//!
//! The code, one job per module: [`cli`] (flags), [`settings`] (resolved parameters),
//! [`strategy`] (the strategies), [`client`] (the client each strategy builds),
//! [`workload`] (keys, hold, clock),
//! [`server`] (the Redis measured, node or cluster, and the admin connections),
//! [`protocol`] (worker ↔ parent messages), [`worker`] (a worker process), [`workers`]
//! (starting and reading them),
//! [`ctx`] (what a run measures with), [`ideal`] (the lock-free reference row), [`run`]
//! (one configuration), [`measure`]
//! (counters, percentiles, fairness), [`results`], [`report`] (tables, JSON) and [`chart`]
//! (`--svg`).

mod blpop;
mod chart;
mod cli;
mod client;
mod ctx;
mod ideal;
mod measure;
mod parent;
mod protocol;
mod report;
mod results;
mod run;
mod server;
mod settings;
mod strategy;
mod worker;
mod workers;
mod workload;

use clap::Parser;

use cli::Args;
use parent::parent_main;
use protocol::{Msg, send};
use worker::worker_main;

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

pub type Res<T> = Result<T, BoxError>;

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
