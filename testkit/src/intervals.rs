//! When things happened, across processes: an [`Recorder`] that the threads of a child
//! share to note each interval (a critical section, a permit held) on the system-wide
//! monotonic clock, printed as `RESULT` lines; [`parse`] reads them back in the parent,
//! and [`most_at_once`] says how many intervals were under way at the same time.
//!
//! ```
//! use redbaton_testkit::intervals::{Interval, most_at_once};
//!
//! let i = |start, end| Interval { tag: "w".into(), pid: 1, start, end };
//! let all = [i(0, 10), i(5, 15), i(10, 20)];
//! assert!(all[0].overlaps(&all[1]) && !all[0].overlaps(&all[2]));
//! // One ending at the instant another starts is not "at once".
//! assert_eq!(most_at_once(&all), 2);
//! ```

use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::child;
use crate::clock::mono_ns;

/// One interval as a process recorded it: a tag saying what it was (e.g. `"w"` for a
/// write hold), the process, and its start and end in CLOCK_MONOTONIC nanoseconds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Interval {
    pub tag: String,
    pub pid: u32,
    pub start: u64,
    pub end: u64,
}

impl Interval {
    /// Whether the two were under way at the same instant (touching ends do not count).
    pub fn overlaps(&self, other: &Interval) -> bool {
        self.start < other.end && other.start < self.end
    }
}

/// The intervals of one process, shared by its threads (clone it into each).
#[derive(Debug, Clone, Default)]
pub struct Recorder {
    intervals: Arc<Mutex<Vec<Interval>>>,
}

impl Recorder {
    /// An empty recorder.
    pub fn new() -> Self {
        Self::default()
    }

    /// Runs `body`, recording the interval from just before it to just after it under
    /// `tag`, and returns what `body` returned.
    pub fn time<T>(&self, tag: &str, body: impl FnOnce() -> T) -> T {
        let start = mono_ns();
        let out = body();
        let end = mono_ns();
        self.lock().push(Interval {
            tag: tag.to_owned(),
            pid: std::process::id(),
            start,
            end,
        });
        out
    }

    /// Runs `body` on `threads` threads at once, each recording into this recorder,
    /// waits for all of them (a panic in one goes on in the caller), then prints what they
    /// recorded ([`Recorder::print`]): the whole of a child that reports intervals.
    pub fn run_threads_and_print(&self, threads: usize, body: impl Fn(&Recorder) + Sync) {
        std::thread::scope(|s| {
            for _ in 0..threads {
                s.spawn(|| body(self));
            }
        });
        self.print();
    }

    /// Everything recorded so far, in the order it was recorded.
    pub fn intervals(&self) -> Vec<Interval> {
        self.lock().clone()
    }

    /// Prints every interval as one `RESULT` line ([`child::print_result`]), for [`parse`]
    /// in the parent.
    pub fn print(&self) {
        for i in self.lock().iter() {
            child::print_result(&[
                ("t", i.tag.clone()),
                ("p", i.pid.to_string()),
                ("s", i.start.to_string()),
                ("e", i.end.to_string()),
            ]);
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Interval>> {
        // A thread that panicked while pushing left a whole vector behind.
        self.intervals
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// The intervals a child printed with [`Recorder::print`], in order; other `RESULT`
/// lines are passed over.
pub fn parse(stdout: &str) -> Vec<Interval> {
    child::parse_results(stdout)
        .into_iter()
        .filter_map(|r| {
            Some(Interval {
                tag: r.get("t")?.clone(),
                pid: r.get("p")?.parse().ok()?,
                start: r.get("s")?.parse().ok()?,
                end: r.get("e")?.parse().ok()?,
            })
        })
        .collect()
}

/// Runs `procs` children of the entry point `test_name` with `envs` (each of them a
/// [`Recorder::run_threads_and_print`]) and returns all that they recorded; each child
/// must succeed within `timeout`.
pub fn from_children(
    test_name: &str,
    procs: usize,
    envs: &[(&str, String)],
    timeout: Duration,
) -> Vec<Interval> {
    let children = child::spawn_many(procs, test_name, envs);
    child::wait_all_ok(children, timeout)
        .iter()
        .flat_map(|out| parse(out))
        .collect()
}

/// The largest number of `intervals` under way at one instant. An interval that ends at
/// the instant another starts is counted out before that one is counted in.
pub fn most_at_once(intervals: &[Interval]) -> usize {
    let mut events: Vec<(u64, i32)> = intervals
        .iter()
        .flat_map(|i| [(i.start, 1), (i.end, -1)])
        .collect();
    // Ends (-1) sort before starts (+1) at the same instant.
    events.sort();
    let (mut now, mut most) = (0i32, 0i32);
    for (_, d) in events {
        now += d;
        most = most.max(now);
    }
    most as usize
}
