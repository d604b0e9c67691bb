//! A worker process: builds its client, waits for `go`, runs its threads' critical
//! sections and reports every wait and completion time to the parent.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crossbeam_channel::RecvTimeoutError;
use redbaton::{LockClient, Unlocked};

use crate::Res;
use crate::cli::Args;
use crate::client;
use crate::protocol::{ClientStats, Msg, ThreadReport, WorkerReport, send};
use crate::server::raw_conn;
use crate::settings::Settings;
use crate::strategy::Strategy;
use crate::workload::{counter_key, hold_for, lock_name, mono_us};

/// A lock held by a thread.
enum Held {
    Guard(redbaton::LockGuard),
    /// The BLPOP queue's key and token.
    Blpop(String, String),
}

pub fn worker_main(args: &Args) -> Res<()> {
    let (Some(url), Some(strategy), Some(prefix)) = (&args.url, args.strategy, &args.prefix) else {
        return Err("worker needs --url, --strategy and --prefix".into());
    };
    let s = Settings::from_args(args)?;
    let sections = s.sections_for(strategy);
    if args.cluster && strategy == Strategy::BlpopQueue {
        return Err("blpop-queue does not run on a cluster".into());
    }
    let client = client::builder(strategy, url, args.cluster, prefix, &s).build()?;
    // The counters: on the locks' Redis, or on a server of their own.
    let counter_url = args.counter_url.as_deref().unwrap_or(url);
    let conns = (0..s.threads)
        .map(|_| raw_conn(counter_url))
        .collect::<Res<Vec<_>>>()?;
    // The BLPOP queue locks through a connection of each thread's own (BLPOP blocks it).
    let mut lock_conns = (0..s.threads)
        .map(|_| {
            (strategy == Strategy::BlpopQueue)
                .then(|| raw_conn(url))
                .transpose()
        })
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
            .zip(lock_conns.drain(..))
            .enumerate()
            .map(|(t, (mut conn, lock_conn))| {
                let (client, done, s) = (&client, &done, &s);
                let locker = match lock_conn {
                    Some(c) => Locker::Blpop(c, args.worker_id),
                    None => Locker::Client(client),
                };
                scope.spawn(move || {
                    run_thread(
                        locker,
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

/// How a thread takes its locks.
pub enum Locker<'a> {
    Client(&'a LockClient),
    /// The BLPOP queue (see `blpop`): its connection, and the worker's id.
    Blpop(redis::Connection, usize),
}

/// One thread's critical sections: lock, GET the counter, hold, SET it + 1, unlock.
#[allow(clippy::too_many_arguments)]
pub fn run_thread(
    mut locker: Locker<'_>,
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
        let (guard, fence) = match &mut locker {
            Locker::Client(client) => {
                let g = client.lock(&names[k])?;
                let fence = g.fencing_token();
                (Held::Guard(g), fence)
            }
            Locker::Blpop(c, worker) => {
                let key = format!("{prefix}{}", names[k]);
                let (token, fence) = crate::blpop::lock(c, &key, s.lease_ms, *worker)?;
                (Held::Blpop(key, token), fence)
            }
        };
        let waited = asked.elapsed();
        let n: Option<u64> = redis::cmd("GET").arg(&counters[k]).query(conn)?;
        hold_for(hold, s.spin);
        if let Held::Guard(g) = &guard
            && g.is_lost()
        {
            lost += 1;
        }
        redis::cmd("SET")
            .arg(&counters[k])
            .arg(n.unwrap_or(0) + 1)
            .query::<()>(conn)?;
        match (guard, &mut locker) {
            (Held::Guard(g), _) => match g.unlock()? {
                Unlocked::Released | Unlocked::HandedOff => {}
                _ => lost += 1,
            },
            (Held::Blpop(key, token), Locker::Blpop(c, _)) => {
                if !crate::blpop::unlock(c, &key, &token)? {
                    lost += 1;
                }
            }
            (Held::Blpop(..), Locker::Client(_)) => unreachable!("a BLPOP hold has its connection"),
        }
        report.waits_us.push(waited.as_micros() as u64);
        report.done_us.push(mono_us().saturating_sub(base));
        report.fences.push(fence);
        key_counts[k] += 1;
        done.fetch_add(1, Ordering::Relaxed);
    }
    Ok((report, key_counts, lost))
}
