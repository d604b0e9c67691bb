//! Critical sections as contenders saw them, and the check that matters after a fault:
//! two sections of one name that overlapped in time, where neither holder was told.
//!
//! The section recorder of the exclusion tests: each thread of a child is a [`Worker`]
//! ([`Worker::run_threads_and_print`]) that times its lock calls ([`Worker::call`]) and
//! notes each section ([`Section::start`], then [`Opened::end`] with the holder's check
//! and unlock). The parent reads the workers back ([`Worker::parse`]) and asks
//! [`Section::unexplained`] for the overlaps nobody was told of. On the wire a worker's
//! sections are one field ([`Section::join`], [`Section::parse_list`]).
//!
//! ```
//! use redbaton_testkit::sections::Section;
//!
//! let s = |start, end, told| Section { name: "n".into(), start, end, token: 1, told };
//! let printed = Section::join(&[s(0, 10, false), s(5, 15, true)]);
//! let back = Section::parse_list(&printed);
//! assert_eq!(back, [s(0, 10, false), s(5, 15, true)]);
//! assert!(Section::unexplained(&back).is_empty(), "the second holder was told");
//! ```

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::child;
use crate::clock::mono_ns;

/// One critical section as its holder saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Section {
    /// The lock's name.
    pub name: String,
    /// When the holder's work began and ended, in CLOCK_MONOTONIC nanoseconds.
    pub start: u64,
    pub end: u64,
    /// The fencing token of the hold.
    pub token: u64,
    /// The holder was told it did not hold the lock (lost signal, `check()` error, or an
    /// unlock that found the key gone or someone else's).
    pub told: bool,
}

impl Section {
    /// Opens the section `name` now: the holder's work begins. Close it with [`Opened::end`].
    pub fn start(name: &str) -> Opened {
        Opened {
            name: name.to_owned(),
            start: mono_ns(),
        }
    }

    /// `sections` as one `RESULT` value: `name:start:end:token:told` joined by commas
    /// (names must not hold `:`, `,` or whitespace).
    pub fn join(sections: &[Section]) -> String {
        let one = |s: &Section| {
            let told = u8::from(s.told);
            format!("{}:{}:{}:{}:{told}", s.name, s.start, s.end, s.token)
        };
        sections.iter().map(one).collect::<Vec<_>>().join(",")
    }

    /// The sections of a value made by [`Section::join`]. Panics on a malformed one.
    pub fn parse_list(list: &str) -> Vec<Section> {
        list.split(',')
            .filter(|s| !s.is_empty())
            .map(|s| {
                let f: Vec<&str> = s.split(':').collect();
                assert_eq!(f.len(), 5, "a section is name:start:end:token:told: {s:?}");
                Section {
                    name: f[0].to_owned(),
                    start: f[1].parse().expect("start"),
                    end: f[2].parse().expect("end"),
                    token: f[3].parse().expect("token"),
                    told: f[4] == "1",
                }
            })
            .collect()
    }

    /// Per name: pairs of `sections` that overlapped in time where neither holder was
    /// told ([`unexplained_overlaps`]).
    pub fn unexplained(sections: &[Section]) -> Vec<(Section, Section)> {
        unexplained_overlaps(sections, |s| (&s.name, s.start, s.end, s.told))
    }
}

/// Pairs of `sections` (each: its name, start and end on a clock common to the processes,
/// and whether its holder was told it did not hold the lock) that overlapped in time on
/// the same name while neither holder was told.
///
/// ```
/// use redbaton_testkit::sections::unexplained_overlaps;
///
/// let s = [("a", 0, 10, false), ("a", 5, 15, false), ("b", 5, 15, false), ("a", 12, 20, true)];
/// let bad = unexplained_overlaps(&s, |x| (x.0, x.1, x.2, x.3));
/// assert_eq!(bad, vec![(s[0], s[1])]);
/// ```
pub fn unexplained_overlaps<'a, T: Clone>(
    sections: &'a [T],
    span: impl Fn(&'a T) -> (&'a str, u64, u64, bool),
) -> Vec<(T, T)> {
    let mut sorted: Vec<&T> = sections.iter().collect();
    sorted.sort_by_key(|s| {
        let (name, start, ..) = span(s);
        (name, start)
    });
    let mut bad = Vec::new();
    for (i, a) in sorted.iter().enumerate() {
        let (name, _, end, told_a) = span(a);
        for b in &sorted[i + 1..] {
            let (other, start, _, told_b) = span(b);
            if other != name || start >= end {
                break;
            }
            if !told_a && !told_b {
                bad.push(((*a).clone(), (*b).clone()));
            }
        }
    }
    bad
}

/// A section begun with [`Section::start`] whose work has not ended.
#[derive(Debug)]
pub struct Opened {
    name: String,
    start: u64,
}

impl Opened {
    /// Ends the work now and releases: the hold had `token`; `told` says whether the
    /// holder was told it lost the lock (e.g. its own `check()` failed) before the end.
    /// Unless it was, `release` (the holder's unlock) runs after the end and returns
    /// whether it found the lock its own; when not, the holder was told so. A holder
    /// already told does not release: its guard goes with the section.
    pub fn end(self, token: u64, told: bool, release: impl FnOnce() -> bool) -> Section {
        let end = mono_ns();
        Section {
            name: self.name,
            start: self.start,
            end,
            token,
            told: told || !release(),
        }
    }
}

/// What one contending thread of a child saw: its sections and its longest call.
#[derive(Debug, Default)]
pub struct Worker {
    pub sections: Vec<Section>,
    pub longest: Duration,
}

impl Worker {
    /// Runs `call` (a lock call), keeping its duration if it is the longest so far.
    pub fn call<T>(&mut self, call: impl FnOnce() -> T) -> T {
        let called = Instant::now();
        let out = call();
        self.longest = self.longest.max(called.elapsed());
        out
    }

    /// The threads of a child: runs `threads` workers at once, each `body(index, worker)`
    /// returning the extra fields of its report, waits for all (a panic in one goes on
    /// in the caller), then prints their reports in the order of their index.
    pub fn run_threads_and_print(
        threads: usize,
        body: impl Fn(usize, &mut Worker) -> Vec<(&'static str, String)> + Sync,
    ) {
        let reports: Vec<(Worker, Vec<(&str, String)>)> = std::thread::scope(|s| {
            let running: Vec<_> = (0..threads)
                .map(|i| {
                    let body = &body;
                    s.spawn(move || {
                        let mut worker = Worker::default();
                        let extra = body(i, &mut worker);
                        (worker, extra)
                    })
                })
                .collect();
            running
                .into_iter()
                .map(|t| t.join().expect("worker"))
                .collect()
        });
        for (worker, extra) in reports {
            worker.print(&extra);
        }
    }

    /// Prints one `RESULT` line: `sections`, `longest_ms`, then `extra`; read back with
    /// [`Worker::parse`].
    pub fn print(&self, extra: &[(&str, String)]) {
        let mut fields = vec![
            ("sections", Section::join(&self.sections)),
            ("longest_ms", self.longest.as_millis().to_string()),
        ];
        fields.extend(extra.iter().cloned());
        child::print_result(&fields);
    }

    /// The worker a `RESULT` line printed by [`Worker::print`] stands for; `None` for
    /// any other line. Panics on a malformed one.
    pub fn parse(result: &HashMap<String, String>) -> Option<Worker> {
        let sections = Section::parse_list(result.get("sections")?);
        let longest_ms: u64 = result["longest_ms"].parse().expect("longest_ms");
        Some(Worker {
            sections,
            longest: Duration::from_millis(longest_ms),
        })
    }
}
