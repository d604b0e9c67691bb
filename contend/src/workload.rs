//! The workload's building blocks, shared by the workers' critical sections and the
//! parent's lock-free `ideal` row: the keys, the hold, and the clock both sides read.

use std::time::{Duration, Instant};

use redbaton_testkit::clock;

/// Microseconds on CLOCK_MONOTONIC, which every process of the machine shares.
pub fn mono_us() -> u64 {
    clock::mono_ns() / 1_000
}

/// The critical section's work: sleep (or busy-wait) for `hold`.
pub fn hold_for(hold: Duration, spin: bool) {
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

pub fn lock_name(k: usize) -> String {
    format!("k{k}")
}

pub fn counter_key(prefix: &str, k: usize) -> String {
    format!("{prefix}counter:{k}")
}
