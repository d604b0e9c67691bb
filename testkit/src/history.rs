//! Replayable randomized tests: the seed, the history of a run, and its violations by kind.
//!
//! * [`seed`] reads the seed a run replays (`REDBATON_SEED`, or an older alias), or makes a
//!   fresh one; [`derive`] gives each random stream of the run (a child process, a thread,
//!   the fault schedule) its own seed from it, so that one number replays them all.
//! * [`History`] collects timestamped events from every process of a run and writes them,
//!   in time order, to a file named after the test and the seed.
//! * [`Violation`] and [`Kind`]: what a run found, classified so that a safety violation
//!   (two holders at once) never hides among liveness ones (a slow call, a stall).
//! * [`Verdict`]: one machine-readable line per run, so that a soak running many runs in
//!   child processes can count violations by kind without parsing panic messages.

use std::collections::BTreeMap;
use std::fmt;
use std::io::Write;
use std::path::{Path, PathBuf};

use crate::child;

/// The environment variable a randomized test reads its seed from.
pub const SEED_ENV: &str = "REDBATON_SEED";

/// The seed of this run: `REDBATON_SEED` if set, else the first of `aliases` that is set,
/// else a fresh one (time and PID). Panics when a variable is set but is not a `u64`: a
/// typo must not silently run another schedule.
pub fn seed(aliases: &[&str]) -> u64 {
    for var in std::iter::once(&SEED_ENV).chain(aliases) {
        if let Ok(v) = std::env::var(var) {
            return v
                .trim()
                .parse()
                .unwrap_or_else(|e| panic!("{var}={v:?} is not a u64 seed: {e}"));
        }
    }
    fresh_seed()
}

/// A seed nobody chose: the wall clock's nanoseconds mixed with the PID.
pub fn fresh_seed() -> u64 {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock after 1970")
        .as_nanos() as u64;
    derive(now, u64::from(std::process::id()))
}

/// A seed for stream `stream` of the run seeded `seed` (SplitMix64 of both): distinct
/// streams get unrelated seeds, and the same pair always the same one.
pub fn derive(seed: u64, stream: u64) -> u64 {
    let mut z = seed
        .wrapping_add(stream.wrapping_mul(0x9e37_79b9_7f4a_7c15))
        .wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// What a violation is about. The first three are safety: the lock let two holders act at
/// once, or fencing would not have stopped the older one. The others are liveness or
/// hygiene.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    /// Two sections of one name overlapped while both holders believed they held the lock
    /// (or a section still valid at its end saw a newer token accepted during it).
    Overlap,
    /// The fenced storage accepted a token not higher than the one before it.
    TokenRegression,
    /// The fenced storage saw one token from two holders.
    DuplicateToken,
    /// A call returned later than its deadline allows.
    DeadlineOvershoot,
    /// Nobody made progress for too long (after a fault, or at the start).
    NoProgress,
    /// A key the library wrote is left without a TTL, or with one longer than the library
    /// allows, or is of a kind the test does not know.
    KeysLeft,
    /// Anything else: a child that crashed or hung, a harness inconsistency.
    Other,
}

impl Kind {
    /// Every kind, safety first.
    pub const ALL: [Kind; 7] = [
        Kind::Overlap,
        Kind::TokenRegression,
        Kind::DuplicateToken,
        Kind::DeadlineOvershoot,
        Kind::NoProgress,
        Kind::KeysLeft,
        Kind::Other,
    ];

    /// Whether a violation of this kind means two holders at once.
    pub fn is_safety(self) -> bool {
        matches!(
            self,
            Kind::Overlap | Kind::TokenRegression | Kind::DuplicateToken
        )
    }

    /// A short name without spaces (for tables and `RESULT` lines).
    pub fn label(self) -> &'static str {
        match self {
            Kind::Overlap => "overlap",
            Kind::TokenRegression => "token_regression",
            Kind::DuplicateToken => "duplicate_token",
            Kind::DeadlineOvershoot => "deadline_overshoot",
            Kind::NoProgress => "no_progress",
            Kind::KeysLeft => "keys_left",
            Kind::Other => "other",
        }
    }

    /// The kind whose [`label`](Kind::label) is `s`.
    pub fn from_label(s: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| k.label() == s)
    }
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let class = match self {
            k if k.is_safety() => "safety",
            Kind::Other => "harness or crash",
            _ => "liveness",
        };
        write!(f, "{} ({class})", self.label())
    }
}

/// One thing a run found wrong.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Violation {
    pub kind: Kind,
    pub text: String,
}

impl Violation {
    pub fn new(kind: Kind, text: impl Into<String>) -> Violation {
        Violation {
            kind,
            text: text.into(),
        }
    }
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "[{}] {}", self.kind, self.text)
    }
}

/// Violations by kind, safety kinds first.
pub fn count_by_kind(violations: &[Violation]) -> BTreeMap<Kind, usize> {
    let mut counts = BTreeMap::new();
    for v in violations {
        *counts.entry(v.kind).or_default() += 1;
    }
    counts
}

/// The failure message of a run: the seed and how to replay it, the violations (safety
/// first) and where the history is.
pub fn failure_message(
    test: &str,
    seed: u64,
    replay: &str,
    violations: &[Violation],
    history: &Path,
) -> String {
    let mut sorted: Vec<&Violation> = violations.iter().collect();
    sorted.sort_by_key(|v| v.kind);
    let safety = violations.iter().filter(|v| v.kind.is_safety()).count();
    let by_kind: Vec<String> = count_by_kind(violations)
        .iter()
        .map(|(k, n)| format!("{} {n}", k.label()))
        .collect();
    let mut msg = format!(
        "{test} seed {seed}: {} violations ({safety} safety; {}); history: {}\nreplay: {replay}\n",
        violations.len(),
        by_kind.join(", "),
        history.display()
    );
    for v in sorted {
        msg.push_str(&format!("{v}\n"));
    }
    msg
}

/// Timestamped events of one run, written to a file in time order.
///
/// Times are microseconds on a clock the processes of one machine share (the caller's
/// choice: CLOCK_MONOTONIC, or the wall clock); the file shows them as milliseconds since
/// the run started.
pub struct History {
    test: String,
    seed: u64,
    started_us: u64,
    header: Vec<String>,
    events: Vec<(u64, String, String)>,
}

impl History {
    /// An empty history of `test` run with `seed`, started at `started_us`.
    pub fn new(test: &str, seed: u64, started_us: u64) -> History {
        History {
            test: test.to_owned(),
            seed,
            started_us,
            header: Vec::new(),
            events: Vec::new(),
        }
    }

    /// A line for the file's header (configuration, replay command).
    pub fn note(&mut self, line: impl Into<String>) {
        self.header.push(line.into());
    }

    /// An event at `at_us` from `source` (`parent`, a PID, `pid.thread`).
    pub fn event(&mut self, at_us: u64, source: impl Into<String>, what: impl Into<String>) {
        self.events.push((at_us, source.into(), what.into()));
    }

    /// Where the history of `test` run with `seed` goes under `dir`.
    pub fn path_in(dir: &Path, test: &str, seed: u64) -> PathBuf {
        dir.join(format!("{test}-seed-{seed}.history"))
    }

    /// Writes the header, the violations and the events (sorted by time) to
    /// [`History::path_in`]`(dir, ..)`, creating `dir`, and returns the path. Panics when
    /// the file cannot be written: a run whose history is lost cannot be explained.
    pub fn write(&mut self, dir: &Path, violations: &[Violation]) -> PathBuf {
        std::fs::create_dir_all(dir).unwrap_or_else(|e| panic!("create {}: {e}", dir.display()));
        let path = History::path_in(dir, &self.test, self.seed);
        let mut out = String::new();
        out.push_str(&format!("# {} seed {}\n", self.test, self.seed));
        for h in &self.header {
            out.push_str(&format!("# {h}\n"));
        }
        out.push_str(&format!("# {} violations\n", violations.len()));
        for v in violations {
            out.push_str(&format!("# {v}\n"));
        }
        out.push_str("# time_ms source event\n");
        self.events.sort_by_key(|e| e.0);
        for (at, source, what) in &self.events {
            let rel = *at as i64 - self.started_us as i64;
            out.push_str(&format!(
                "{:>10.3} {source:<10} {what}\n",
                rel as f64 / 1000.0
            ));
        }
        std::fs::File::create(&path)
            .and_then(|mut f| f.write_all(out.as_bytes()))
            .unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
        path
    }
}

/// The outcome of one run, as one `RESULT` line (see [`child::print_result`]): the seed,
/// the history file and the violation count of each kind.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Verdict {
    pub seed: u64,
    pub history: String,
    pub counts: BTreeMap<Kind, usize>,
    /// One line per violation kind found: the first violation's text (spaces replaced),
    /// for the soak's table.
    pub first: BTreeMap<Kind, String>,
    /// How long the run's own process did not get the CPU (see `stalls`), in ms: the
    /// liveness checks of a run stalled for long judged little.
    pub stalled_ms: u64,
}

/// The `RESULT` field that marks a verdict line.
const VERDICT_TAG: &str = "verdict";

impl Verdict {
    /// The verdict of a run with `violations`.
    pub fn of(seed: u64, history: &Path, violations: &[Violation]) -> Verdict {
        let mut first = BTreeMap::new();
        for v in violations {
            first.entry(v.kind).or_insert_with(|| v.text.clone());
        }
        Verdict {
            seed,
            history: history.display().to_string(),
            counts: count_by_kind(violations),
            first,
            stalled_ms: 0,
        }
    }

    /// Prints the verdict as a `RESULT` line on stdout.
    pub fn print(&self) {
        let squash = |s: &str| -> String {
            s.chars()
                .map(|c| if c.is_whitespace() { '_' } else { c })
                .take(300)
                .collect()
        };
        let mut fields = vec![
            (VERDICT_TAG.to_owned(), "1".to_owned()),
            ("seed".to_owned(), self.seed.to_string()),
            ("history".to_owned(), squash(&self.history)),
            ("stalled_ms".to_owned(), self.stalled_ms.to_string()),
        ];
        for (k, n) in &self.counts {
            fields.push((k.label().to_owned(), n.to_string()));
        }
        for (k, t) in &self.first {
            fields.push((format!("first_{}", k.label()), squash(t)));
        }
        let borrowed: Vec<(&str, String)> = fields
            .iter()
            .map(|(k, v)| (k.as_str(), v.clone()))
            .collect();
        child::print_result(&borrowed);
    }

    /// The verdict printed in `stdout`, if any.
    pub fn parse(stdout: &str) -> Option<Verdict> {
        let r = child::parse_results(stdout)
            .into_iter()
            .find(|r| r.contains_key(VERDICT_TAG))?;
        let mut v = Verdict {
            seed: r.get("seed")?.parse().ok()?,
            history: r.get("history").cloned().unwrap_or_default(),
            stalled_ms: r
                .get("stalled_ms")
                .and_then(|n| n.parse().ok())
                .unwrap_or(0),
            ..Verdict::default()
        };
        for k in Kind::ALL {
            if let Some(n) = r.get(k.label()).and_then(|n| n.parse().ok()) {
                v.counts.insert(k, n);
            }
            if let Some(t) = r.get(&format!("first_{}", k.label())) {
                v.first.insert(k, t.clone());
            }
        }
        Some(v)
    }

    /// Whether the run found nothing.
    pub fn is_clean(&self) -> bool {
        self.counts.values().all(|n| *n == 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn derived_seeds_differ_and_repeat() {
        assert_eq!(derive(7, 1), derive(7, 1));
        assert_ne!(derive(7, 1), derive(7, 2));
        assert_ne!(derive(7, 1), derive(8, 1));
    }

    #[test]
    fn verdicts_round_trip() {
        let vs = [
            Violation::new(Kind::Overlap, "a and b"),
            Violation::new(Kind::KeysLeft, "x:q without TTL"),
            Violation::new(Kind::KeysLeft, "x:qx without TTL"),
        ];
        let v = Verdict::of(42, Path::new("/tmp/h"), &vs);
        let line =
            "RESULT verdict=1 seed=42 history=/tmp/h overlap=1 keys_left=2 first_overlap=a_and_b";
        let parsed = Verdict::parse(line).unwrap();
        assert_eq!(parsed.seed, 42);
        assert_eq!(parsed.counts, v.counts);
        assert!(!parsed.is_clean());
        assert!(Kind::Overlap.is_safety() && !Kind::KeysLeft.is_safety());
        let msg = failure_message("chaos", 42, "REDBATON_SEED=42", &vs, Path::new("/tmp/h"));
        assert!(msg.contains("1 safety"), "{msg}");
    }
}
