//! The `log` records of this test process, kept as text so that a test can check what the
//! library warned of. One logger per process: tests of one binary share it, so a test
//! looks for lines that only it can have caused (naming its own server's port, say).

use std::sync::Once;

use parking_lot::Mutex;

/// Every record since [`capture`] was first called, as `LEVEL target: message`.
static LINES: Mutex<Vec<String>> = Mutex::new(Vec::new());

struct Capture;

impl log::Log for Capture {
    fn enabled(&self, _: &log::Metadata<'_>) -> bool {
        true
    }

    fn log(&self, record: &log::Record<'_>) {
        let line = format!("{} {}: {}", record.level(), record.target(), record.args());
        LINES.lock().push(line);
    }

    fn flush(&self) {}
}

/// Starts keeping every record of every level (once per process). Panics when another
/// logger was installed first: its records would never reach this one.
pub fn capture() {
    static INSTALL: Once = Once::new();
    INSTALL.call_once(|| {
        log::set_logger(&Capture).expect("no other logger in this process");
        log::set_max_level(log::LevelFilter::Trace);
    });
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
