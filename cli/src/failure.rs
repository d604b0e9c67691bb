//! Why a command stopped, and the exit code that says it.

use std::io::Write;
use std::process::ExitCode;

/// Why the command stopped, as its exit code says.
pub enum Failure {
    /// 1: not found or refused; the message was printed.
    Refused,
    /// 2: usage.
    Usage(String),
    /// 3: runtime: the connection, the server, or stdout.
    Runtime(String),
    /// 0: stdout was closed (`| head`): nothing more to show (the Unix convention).
    Closed,
}

impl Failure {
    /// Prints the message, if any, and gives the exit code.
    pub fn exit(self) -> ExitCode {
        match self {
            Failure::Closed => ExitCode::SUCCESS,
            Failure::Refused => ExitCode::from(1),
            Failure::Usage(e) => {
                warn(&e);
                ExitCode::from(2)
            }
            Failure::Runtime(e) => {
                warn(&e);
                ExitCode::from(3)
            }
        }
    }
}

impl From<redbaton::Error> for Failure {
    fn from(e: redbaton::Error) -> Self {
        if e.is_invalid_input() || matches!(e, redbaton::Error::InvalidConfig(_)) {
            Failure::Usage(error_text(&e))
        } else {
            Failure::Runtime(error_text(&e))
        }
    }
}

impl From<std::io::Error> for Failure {
    fn from(e: std::io::Error) -> Self {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            Failure::Closed
        } else {
            Failure::Runtime(format!("stdout: {e}"))
        }
    }
}

/// The error and its sources, each said once. A timed-out socket says "resource
/// temporarily unavailable" (EAGAIN), which tells an operator nothing: it is said as a
/// timeout, with the option that sets it.
pub fn error_text(e: &redbaton::Error) -> String {
    if e.redis_error().is_some_and(|r| r.is_timeout()) {
        return format!("{e}: timed out (no reply within --timeout)");
    }
    let mut text = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        let more = s.to_string();
        if !text.contains(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        source = s.source();
    }
    text
}

/// One line on stderr (a closed stderr is no reason to panic).
pub fn warn(message: &str) {
    let _ = writeln!(std::io::stderr(), "redbaton: {message}");
}
