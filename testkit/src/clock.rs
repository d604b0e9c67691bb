//! CLOCK_MONOTONIC, for times that cross process boundaries: on Linux it is one clock for
//! every process of the machine, so a parent and its children can order their events
//! (`Instant`'s values cannot be sent to another process).
//!

/// CLOCK_MONOTONIC in nanoseconds.
pub fn mono_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime only writes the timespec we pass, which outlives the call.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_MONOTONIC) failed");
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Wall-clock microseconds since the Unix epoch: comparable between processes on one
/// machine, unlike `Instant`.
pub fn wall_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock after 1970")
        .as_micros() as u64
}
