//! Keeps a client's worker thread alive: a panic in its body is caught, logged at `error`,
//! and the body runs again after a short backoff, so that a bug in one pass cannot leave
//! waiters unwoken or leases unrenewed for the rest of the process.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};

/// Backoff after the first crash; doubled per crash in a row, up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(10);
const MAX_BACKOFF: Duration = Duration::from_secs(2);
/// A body that ran this long before crashing starts again from the first backoff.
const STABLE: Duration = Duration::from_secs(10);

/// Runs `body` until it returns; after each panic calls `crashed(crashes in a row)`, which
/// repairs the shared state and says whether to run again, then `pause(backoff)`, which
/// waits before the restart and says whether to restart (see [`pause`]).
pub(crate) fn supervise(
    name: &str,
    mut body: impl FnMut(),
    mut crashed: impl FnMut(u32) -> bool,
    mut pause: impl FnMut(Duration) -> bool,
) {
    let mut in_a_row = 0u32;
    let mut backoff = FIRST_BACKOFF;
    loop {
        let started = Instant::now();
        let Err(panic) = catch_unwind(AssertUnwindSafe(&mut body)) else {
            return;
        };
        if started.elapsed() >= STABLE {
            in_a_row = 0;
            backoff = FIRST_BACKOFF;
        }
        in_a_row = in_a_row.saturating_add(1);
        let what = panic
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".to_owned());
        log::error!("{name} thread panicked ({what}); restarting it");
        if !catch_unwind(AssertUnwindSafe(|| crashed(in_a_row))).unwrap_or(false) {
            log::error!("{name} thread stopped after {in_a_row} panics in a row");
            return;
        }
        if !pause(backoff) {
            return;
        }
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

/// The restart pause of a worker that is told to stop by `shutdown` and woken by a message
/// on `kicked`: waits `backoff`, but ends at once when `shutdown` is set (a shutdown or a
/// client's drop must not wait out a backoff of seconds); `false` then. A kick that comes
/// for another reason is sent again through `kick` for the restarted body, which may wait
/// for it before its first pass.
pub(crate) fn pause(
    backoff: Duration,
    shutdown: &AtomicBool,
    kick: &Sender<()>,
    kicked: &Receiver<()>,
) -> bool {
    let until = Instant::now() + backoff;
    let mut kicked_meanwhile = false;
    let go_on = loop {
        if shutdown.load(Ordering::Relaxed) {
            break false;
        }
        match kicked.recv_deadline(until) {
            Ok(()) => kicked_meanwhile = true,
            Err(RecvTimeoutError::Timeout) => break !shutdown.load(Ordering::Relaxed),
            // Nobody can kick or stop the worker any more: its owner is gone.
            Err(RecvTimeoutError::Disconnected) => break false,
        }
    };
    if kicked_meanwhile {
        let _ = kick.try_send(());
    }
    go_on
}
