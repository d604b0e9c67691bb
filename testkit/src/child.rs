//! Real child processes contending for locks.
//!
//! Threads share one process, so they cannot show what happens when a
//! *process* holding a lock dies. A test re-runs its own test binary with a
//! filter selecting a single child entry point:
//!
//! ```ignore
//! #[test]
//! fn child_worker() {
//!     if !child::is_child() {
//!         return; // normal run: passes trivially
//!     }
//!     let url = child::env("REDIS_URL");
//!     // ... contend for the lock ...
//!     child::print_result(&[("acquired", "1".into())]);
//! }
//!
//! #[test]
//! fn two_processes() {
//!     let c = child::spawn_self("child_worker", &[("REDIS_URL", server.url())]);
//!     let out = child::wait_ok(c, Duration::from_secs(30));
//!     let results = child::parse_results(&out);
//! }
//! ```
//!
//! Children report through stdout lines `RESULT key=value ...`. Note that
//! libtest prints `test name ... ` *before* the test's own output on the
//! same line, so a result may not start its line; `parse_results` copes.

use std::collections::HashMap;
use std::io::{self, Read};
use std::os::fd::AsRawFd;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Once;
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

/// Set to `1` in children spawned by [`spawn_self`].
pub const CHILD_ENV: &str = "REDBATON_CHILD";
/// PID of the spawning test process, for the orphan watchdog.
const PARENT_ENV: &str = "REDBATON_PARENT_PID";
const RESULT_TAG: &str = "RESULT";

/// Re-runs the current test binary so that only `test_name` runs, with
/// `REDBATON_CHILD=1` and `envs` set. stdout and stderr are piped (stderr
/// is piped too so a child's panic shows up in the parent's failure message
/// instead of leaking onto the terminal).
pub fn spawn_self(test_name: &str, envs: &[(&str, String)]) -> Child {
    let exe = std::env::current_exe().expect("current_exe");
    let mut cmd = Command::new(exe);
    cmd.args([
        test_name,
        "--exact",
        "--nocapture",
        "--test-threads=1",
        "--include-ignored",
    ])
    .env(CHILD_ENV, "1")
    .env(PARENT_ENV, std::process::id().to_string())
    .stdin(Stdio::null())
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    for (name, value) in envs {
        cmd.env(name, value);
    }
    cmd.spawn()
        .unwrap_or_else(|e| panic!("spawn child for test {test_name}: {e}"))
}

/// The first line of a child entry point: outside a child spawned by [`spawn_self`] (a
/// normal test run), the test returns at once and passes trivially.
///
/// ```ignore
/// #[test]
/// fn child_worker() {
///     redbaton_testkit::child_only!();
///     let url = child::env("REDIS_URL");
///     // ...
/// }
/// ```
#[macro_export]
macro_rules! child_only {
    () => {
        if !$crate::child::is_child() {
            return;
        }
    };
}

/// Starts `n` children of the entry point `test_name`, all with `envs` ([`spawn_self`]).
pub fn spawn_many(n: usize, test_name: &str, envs: &[(&str, String)]) -> Vec<Child> {
    (0..n).map(|_| spawn_self(test_name, envs)).collect()
}

/// Waits for each of `children` in turn, `timeout` each ([`wait_ok`]), and returns what
/// they printed, in order.
pub fn wait_all_ok(children: Vec<Child>, timeout: Duration) -> Vec<String> {
    children.into_iter().map(|c| wait_ok(c, timeout)).collect()
}

/// True inside a child spawned by [`spawn_self`].
///
/// Side effect in a child: starts (once) a watchdog thread that exits the
/// process if its parent test binary dies, so a crashed or killed test run
/// leaves no orphan still hammering Redis.
pub fn is_child() -> bool {
    let child = std::env::var(CHILD_ENV).is_ok_and(|v| v == "1");
    if child {
        static WATCHDOG: Once = Once::new();
        WATCHDOG.call_once(start_orphan_watchdog);
    }
    child
}

/// A required environment variable (children get their parameters this
/// way). Panics with the name if it is missing.
pub fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("environment variable {name} is not set"))
}

/// A required environment variable holding a comma-separated list (the parent joins a
/// list with `,`), split into its items.
pub fn env_list(name: &str) -> Vec<String> {
    env(name).split(',').map(str::to_owned).collect()
}

/// Prints one `RESULT k=v ...` line and flushes it (the parent may be
/// waiting for it with [`wait_for_line`]). Keys and values must not contain
/// whitespace; keys must not contain `=`.
pub fn print_result(fields: &[(&str, String)]) {
    let mut line = String::from(RESULT_TAG);
    for (k, v) in fields {
        assert!(
            !k.is_empty() && !k.contains(['=', ' ', '\t', '\n']),
            "bad RESULT key {k:?}"
        );
        assert!(
            !v.contains(char::is_whitespace),
            "RESULT value for {k} contains whitespace: {v:?}"
        );
        line.push_str(&format!(" {k}={v}"));
    }
    // println! is line-buffered, so the line leaves the process at once.
    println!("{line}");
}

/// Prints `extra`, then every integer field of `counters` (a struct of counts, such as a
/// client's `stats()`) under its own name, as one `RESULT` line. The fields are read from
/// the `Debug` form, so a counter added to the struct is reported without a change here.
///
/// ```
/// #[derive(Debug)]
/// struct Counts { hits: u64, misses: u64 }
/// redbaton_testkit::child::print_counters(&Counts { hits: 3, misses: 1 }, &[]);
/// // prints: RESULT hits=3 misses=1
/// ```
pub fn print_counters(counters: &impl std::fmt::Debug, extra: &[(&str, String)]) {
    let text = format!("{counters:?}");
    let inner = text
        .split_once('{')
        .and_then(|(_, rest)| rest.rsplit_once('}'))
        .map_or("", |(inner, _)| inner);
    let mut fields = extra.to_vec();
    fields.extend(inner.split(',').filter_map(|field| {
        let (name, value) = field.split_once(':')?;
        let value = value.trim();
        value.parse::<u64>().ok()?;
        Some((name.trim(), value.to_owned()))
    }));
    assert!(fields.len() > extra.len(), "no counters in {text}");
    print_result(&fields);
}

/// Parses every `RESULT k=v ...` line in a child's stdout, in order.
pub fn parse_results(stdout: &str) -> Vec<HashMap<String, String>> {
    stdout.lines().filter_map(parse_result_line).collect()
}

fn parse_result_line(line: &str) -> Option<HashMap<String, String>> {
    // The tag may follow libtest's `test name ... ` prefix.
    let mut words = line.split_whitespace().skip_while(|w| *w != RESULT_TAG);
    words.next()?;
    Some(
        words
            .filter_map(|kv| kv.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
    )
}

/// Everything a finished child produced.
#[derive(Debug)]
pub struct ChildOutput {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

/// Waits up to `timeout` for the child to exit, whatever its status (use
/// this for children you killed). On timeout the child is SIGKILLed and the
/// call panics with its output.
pub fn wait_output(mut child: Child, timeout: Duration) -> ChildOutput {
    // Drain the pipes concurrently: a child blocked on a full pipe would
    // otherwise never exit.
    let stdout = child.stdout.take().map(drain);
    let stderr = child.stderr.take().map(drain);
    let deadline = Instant::now() + timeout;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break Some(status),
            Ok(None) if Instant::now() < deadline => thread::sleep(Duration::from_millis(10)),
            Ok(None) => break None,
            Err(e) => panic!("waiting for child {}: {e}", child.id()),
        }
    };
    let timed_out = status.is_none();
    let status = status.unwrap_or_else(|| {
        let _ = child.kill();
        child.wait().expect("reap killed child")
    });
    let output = ChildOutput {
        status,
        stdout: collect(stdout),
        stderr: collect(stderr),
    };
    if timed_out {
        panic!(
            "child {} did not exit within {timeout:?}; killed it.\n--- stdout ---\n{}\n--- stderr ---\n{}",
            child.id(),
            output.stdout,
            output.stderr
        );
    }
    output
}

/// Waits for the child to exit successfully and returns its stdout.
/// Panics with the child's output on timeout or failure.
pub fn wait_ok(child: Child, timeout: Duration) -> String {
    let pid = child.id();
    let out = wait_output(child, timeout);
    if !out.status.success() {
        panic!(
            "child {pid} failed: {}\n--- stdout ---\n{}\n--- stderr ---\n{}",
            out.status, out.stdout, out.stderr
        );
    }
    out.stdout
}

/// Sends a signal (`libc::SIGKILL`, `SIGSTOP`, `SIGTERM`...) to the child
/// unless it has already been reaped. Does not wait; follow with
/// [`wait_output`].
pub fn kill_child(child: &mut Child, signal: libc::c_int) {
    if matches!(child.try_wait(), Ok(None)) {
        // SAFETY: plain syscall on our own, not yet reaped, child PID.
        unsafe {
            libc::kill(child.id() as libc::pid_t, signal);
        }
    }
}

/// Stops the child (SIGSTOP) and waits until every one of its threads is stopped (or it
/// is gone). `kill` only queues the signal: one thread takes it when it next runs and then
/// stops the others, so on a loaded machine a stopped child may go on for milliseconds,
/// and a `SIGCONT` sent meanwhile cancels the stop altogether. Panics if the child is
/// still running after 10 s.
pub fn stop_child(child: &mut Child) {
    kill_child(child, libc::SIGSTOP);
    let pid = child.id();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !stopped(pid) {
        assert!(
            Instant::now() < deadline,
            "child {pid} not stopped after 10 s"
        );
        thread::sleep(Duration::from_millis(2));
    }
}

/// Whether every thread of process `pid` is stopped, or the process is gone or a zombie.
fn stopped(pid: u32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return true;
    };
    tasks.flatten().all(|task| {
        let Ok(stat) = std::fs::read_to_string(task.path().join("stat")) else {
            return true; // the thread ended
        };
        // `pid (comm) state ...`: the state follows the last ')'.
        let state = stat.rsplit_once(')').map(|(_, rest)| rest.trim_start());
        state.is_none_or(|s| s.starts_with(['T', 't', 'Z', 'X']))
    })
}

/// The whole of a child entry point that takes a hold (a lock, a read hold, a permit)
/// for a test of what its death does: outside a child, nothing; in one, `take` gets the
/// `REDIS_URL` it was given and returns the hold, which is kept while the child says
/// `RESULT held=1` and sleeps until killed. The parent starts it with [`spawn_holder`].
pub fn hold_until_killed<T>(take: impl FnOnce(&str) -> T) {
    if !is_child() {
        return;
    }
    let _held = take(&env("REDIS_URL"));
    print_result(&[("held", "1".to_owned())]);
    thread::sleep(Duration::from_secs(120));
}

/// Starts the child entry point `test_name` (one made of [`hold_until_killed`]) on the
/// Redis at `url` and waits up to 30 s for it to say it holds.
pub fn spawn_holder(test_name: &str, url: String) -> Child {
    let mut child = spawn_self(test_name, &[("REDIS_URL", url)]);
    wait_for_line(&mut child, "held=1", Duration::from_secs(30));
    child
}

/// SIGKILLs the child and reaps it (up to 10 s), whatever it printed; returns the
/// instant of the kill, from which a test measures how long the hold it left outlived it.
pub fn kill_and_reap(mut child: Child) -> Instant {
    kill_child(&mut child, libc::SIGKILL);
    let killed = Instant::now();
    let _ = wait_output(child, Duration::from_secs(10));
    killed
}

/// Reads the child's stdout until a line containing `needle` appears and
/// returns that line; used to synchronise with a child (e.g. wait for
/// `RESULT acquired=1` before killing it). Lines read here, including the
/// returned one, are consumed and will not be part of `wait_ok`'s output.
/// On timeout or EOF the child is killed and the call panics.
pub fn wait_for_line(child: &mut Child, needle: &str, timeout: Duration) -> String {
    let deadline = Instant::now() + timeout;
    let mut seen = String::new();
    let mut line = Vec::new();
    let outcome = loop {
        let Some(stdout) = child.stdout.as_mut() else {
            break Err("child stdout is not piped (or was taken)".to_string());
        };
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break Err(format!("no line containing {needle:?} within {timeout:?}"));
        }
        match poll_readable(stdout.as_raw_fd(), left) {
            Ok(false) => continue, // timed out; the deadline check ends the loop
            Ok(true) => {}
            Err(e) => break Err(format!("poll child stdout: {e}")),
        }
        // One byte at a time (unbuffered) so nothing past the matching line
        // is taken from the pipe.
        let mut byte = [0u8; 1];
        match stdout.read(&mut byte) {
            Ok(0) => {
                break Err(format!(
                    "child stdout closed before a line containing {needle:?}"
                ));
            }
            Ok(_) if byte[0] == b'\n' => {
                let text = String::from_utf8_lossy(&line).into_owned();
                line.clear();
                if text.contains(needle) {
                    break Ok(text);
                }
                seen.push_str(&text);
                seen.push('\n');
            }
            Ok(_) => line.push(byte[0]),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => break Err(format!("read child stdout: {e}")),
        }
    };
    match outcome {
        Ok(text) => text,
        Err(why) => {
            kill_child(child, libc::SIGKILL);
            let _ = child.wait();
            let stderr = child.stderr.take().map(drain);
            panic!(
                "child {}: {why}\n--- stdout so far ---\n{seen}{}\n--- stderr ---\n{}",
                child.id(),
                String::from_utf8_lossy(&line),
                collect(stderr)
            );
        }
    }
}

fn poll_readable(fd: libc::c_int, timeout: Duration) -> io::Result<bool> {
    let mut pfd = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    let ms = timeout.as_millis().clamp(1, i32::MAX as u128) as libc::c_int;
    // SAFETY: one valid pollfd, count 1.
    let n = unsafe { libc::poll(&mut pfd, 1, ms) };
    match n {
        -1 => {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                Ok(false)
            } else {
                Err(e)
            }
        }
        0 => Ok(false),
        // POLLHUP without POLLIN still means "read will not block" (EOF).
        _ => Ok(true),
    }
}

fn drain<R: Read + Send + 'static>(mut pipe: R) -> JoinHandle<String> {
    thread::spawn(move || {
        let mut bytes = Vec::new();
        let _ = pipe.read_to_end(&mut bytes);
        String::from_utf8_lossy(&bytes).into_owned()
    })
}

fn collect(reader: Option<JoinHandle<String>>) -> String {
    reader
        .map(|h| h.join().unwrap_or_else(|_| "<reader panicked>".into()))
        .unwrap_or_default()
}

/// Exits the child when the parent disappears (the child is then
/// re-parented, so `getppid` changes).
fn start_orphan_watchdog() {
    let Some(parent) = std::env::var(PARENT_ENV)
        .ok()
        .and_then(|v| v.parse::<libc::pid_t>().ok())
    else {
        return;
    };
    thread::spawn(move || {
        loop {
            // SAFETY: getppid has no preconditions.
            if unsafe { libc::getppid() } != parent {
                eprintln!("redbaton child: parent {parent} is gone, exiting");
                std::process::exit(3);
            }
            thread::sleep(Duration::from_millis(200));
        }
    });
}

/// The first `RESULT` line of a child's stdout that has `key`; panics with the output when
/// there is none.
pub fn result_with(stdout: &str, key: &str) -> HashMap<String, String> {
    parse_results(stdout)
        .into_iter()
        .find(|r| r.contains_key(key))
        .unwrap_or_else(|| panic!("no RESULT line with {key} in child stdout:\n{stdout}"))
}

/// Field `key` of a `RESULT` line, parsed; panics naming the field when it is missing or
/// does not parse.
pub fn field<T>(result: &HashMap<String, String>, key: &str) -> T
where
    T: std::str::FromStr,
    T::Err: std::fmt::Display,
{
    let text = result
        .get(key)
        .unwrap_or_else(|| panic!("child result lacks {key}: {result:?}"));
    text.parse()
        .unwrap_or_else(|e| panic!("child result {key}={text:?}: {e}"))
}
