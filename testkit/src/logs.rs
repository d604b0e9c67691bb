//! The one `log` logger of a test process: it echoes the library's records through
//! `env_logger` (filtered by `RUST_LOG`, errors only when it is unset; written with
//! `eprint!`, so that the test harness captures them and shows them with a failing
//! test's output, and on stderr in a child process, whose stdout carries its lines to the
//! parent), and, once a test asked for it ([`capture`]), keeps every record as text so
//! that the test can check what the library warned of. Tests of one binary share it, so a
//! test looks for lines that only it can have caused (naming its own server's port, say).

use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{LazyLock, Once};

use parking_lot::Mutex;

/// Every record since [`capture`] was first called, as `LEVEL target: message`.
static LINES: Mutex<Vec<String>> = Mutex::new(Vec::new());

struct Logger {
    /// `RUST_LOG`'s echo.
    echo: env_logger::Logger,
    /// Whether records are kept ([`capture`]).
    keep: AtomicBool,
}

impl log::Log for Logger {
    fn enabled(&self, metadata: &log::Metadata<'_>) -> bool {
        self.keep.load(Relaxed) || self.echo.enabled(metadata)
    }

    fn log(&self, record: &log::Record<'_>) {
        if self.keep.load(Relaxed) {
            let line = format!("{} {}: {}", record.level(), record.target(), record.args());
            LINES.lock().push(line);
        }
        if self.echo.matches(record) {
            self.echo.log(record);
        }
    }

    fn flush(&self) {
        self.echo.flush();
    }
}

/// The process's logger.
static LOGGER: LazyLock<Logger> = LazyLock::new(|| Logger {
    echo: env_logger::Builder::from_default_env()
        .is_test(true)
        .build(),
    keep: AtomicBool::new(false),
});

/// The process's logger, installed by the first call; a call returns once it is (so that
/// a level [`capture`] sets is never overwritten by an installation still under way).
fn installed() -> &'static Logger {
    static INSTALL: Once = Once::new();
    INSTALL.call_once(|| {
        log::set_logger(&*LOGGER).expect("no other logger in this process");
        log::set_max_level(LOGGER.echo.filter());
    });
    &LOGGER
}

/// Echoes the library's records as `RUST_LOG` says (see the module's doc).
pub fn echo() {
    installed();
}

/// Starts keeping every record of every level (for the rest of the process).
pub fn capture() {
    installed().keep.store(true, Relaxed);
    log::set_max_level(log::LevelFilter::Trace);
}

/// The records kept so far at `level` that contain `needle`.
pub fn lines(level: log::Level, needle: &str) -> Vec<String> {
    let prefix = format!("{level} ");
    LINES
        .lock()
        .iter()
        .filter(|l| l.starts_with(&prefix) && l.contains(needle))
        .cloned()
        .collect()
}

/// Every record kept so far, of every level.
pub fn all() -> Vec<String> {
    LINES.lock().clone()
}
