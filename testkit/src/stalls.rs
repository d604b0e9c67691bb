//! Telling a slow library from a starved machine.
//!
//! On a loaded machine a test process may not run for seconds: every liveness bound it
//! checks (progress within 10 s, a call back by its deadline) is then broken by the
//! machine, not by the code under test. [`StallWatch`] runs a thread that sleeps a few
//! milliseconds at a time and records each sleep that overran by more than
//! [`StallWatch::MIN_GAP`]: the spans when this process did not get the CPU. A liveness
//! check subtracts the stalled time inside its window ([`Stalls::within`]) before judging.
//! Safety checks never need it: a stall cannot make two holders overlap by itself.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::{self, JoinHandle};
use std::time::Duration;

use parking_lot::Mutex;

use crate::clock::mono_ns;

/// Spans (start, end: CLOCK_MONOTONIC µs) when the watching process did not run.
#[derive(Clone, Debug, Default)]
pub struct Stalls {
    pub gaps: Vec<(u64, u64)>,
}

impl Stalls {
    /// Stalled microseconds inside `[from, to]`.
    pub fn within(&self, from: u64, to: u64) -> u64 {
        self.gaps
            .iter()
            .map(|&(a, b)| b.min(to).saturating_sub(a.max(from)))
            .sum()
    }

    /// The longest gap, in microseconds.
    pub fn longest(&self) -> u64 {
        self.gaps.iter().map(|(a, b)| b - a).max().unwrap_or(0)
    }

    /// All stalled microseconds.
    pub fn total(&self) -> u64 {
        self.gaps.iter().map(|(a, b)| b - a).sum()
    }
}

/// A thread recording [`Stalls`] until [`StallWatch::stop`] (or drop).
pub struct StallWatch {
    stop: Arc<AtomicBool>,
    stalls: Arc<Mutex<Stalls>>,
    thread: Option<JoinHandle<()>>,
}

impl StallWatch {
    /// How often the watcher wakes.
    pub const TICK: Duration = Duration::from_millis(10);
    /// An overrun shorter than this is ordinary scheduling noise, not a stall.
    pub const MIN_GAP: Duration = Duration::from_millis(200);

    /// Starts watching this process.
    pub fn start() -> StallWatch {
        let stop = Arc::new(AtomicBool::new(false));
        let stalls = Arc::new(Mutex::new(Stalls::default()));
        let thread = {
            let (stop, stalls) = (stop.clone(), stalls.clone());
            thread::Builder::new()
                .name("stall-watch".into())
                .spawn(move || {
                    let tick = StallWatch::TICK.as_micros() as u64;
                    let min = StallWatch::MIN_GAP.as_micros() as u64;
                    while !stop.load(Ordering::Relaxed) {
                        let before = mono_ns() / 1000;
                        thread::sleep(StallWatch::TICK);
                        let after = mono_ns() / 1000;
                        if after - before > tick + min {
                            stalls.lock().gaps.push((before + tick, after));
                        }
                    }
                })
                .expect("spawn the stall watcher")
        };
        StallWatch {
            stop,
            stalls,
            thread: Some(thread),
        }
    }

    /// The stalls seen so far.
    pub fn stalls(&self) -> Stalls {
        self.stalls.lock().clone()
    }

    /// Stops watching; the stalls seen.
    pub fn stop(mut self) -> Stalls {
        self.halt();
        self.stalls()
    }

    fn halt(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for StallWatch {
    fn drop(&mut self) {
        self.halt();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stalled_time_is_clipped_to_the_window() {
        let s = Stalls {
            gaps: vec![(100, 200), (300, 1_000)],
        };
        assert_eq!(s.within(0, 150), 50);
        assert_eq!(s.within(150, 400), 150);
        assert_eq!(s.within(2_000, 3_000), 0);
        assert_eq!(s.longest(), 700);
        assert_eq!(s.total(), 800);
    }
}
