//! `redbaton watch`, run as a subprocess against a real `redis-server`: how it refreshes
//! and how it ends (a count, a signal to stop, its reader gone; Redis gone or restarting:
//! `watch_faults.rs`).

mod support;

use std::io::Read;
use std::process::{Child, ChildStdout, Command};

use redbaton_testkit::{secs, test_server};

use support::{client, code, exit_within, json, no_panic, redbaton, spawn, stderr, stdout};

/// `watch w --interval MS`, running, once its first refresh has been read; and its stdout.
fn watching(url: &str, interval_ms: &str) -> (Child, ChildStdout) {
    let mut child = spawn(url, &["watch", "w", "--interval", interval_ms]);
    let mut out = child.stdout.take().expect("stdout");
    let mut buf = [0u8; 256];
    assert!(
        out.read(&mut buf).expect("read") > 0,
        "watch printed something"
    );
    (child, out)
}

/// All that `child` wrote on stderr (it has exited).
fn stderr_of(child: &mut Child) -> String {
    let mut err = String::new();
    let mut pipe = child.stderr.take().expect("stderr");
    pipe.read_to_string(&mut err).expect("read stderr");
    err
}

/// `watch --count 1` prints the status of the name once, as `status` does.
#[test]
fn smoke() {
    let srv = test_server();
    let guard = client(&srv).lock("job").expect("lock");
    let o = redbaton(&srv.url(), &["watch", "job", "--count", "1", "--json"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(json(&o)["fence"], guard.fencing_token() >> 12);
}

/// When the reader of its stdout goes away (`watch NAME | head`, a closed terminal),
/// `watch` ends at its next refresh, with exit 0, instead of inspecting Redis forever.
#[test]
fn watch_ends_when_its_stdout_is_closed() {
    let srv = test_server();
    let (mut child, out) = watching(&srv.url(), "20");
    drop(out); // the reader goes away
    let status = exit_within(&mut child, secs(10));
    assert!(
        status.is_some(),
        "watch still running 10 s after its stdout was closed"
    );
    assert_eq!(status.and_then(|s| s.code()), Some(0), "{status:?}");
    let err = stderr_of(&mut child);
    assert!(err.is_empty(), "{err}");
}

/// A signal to stop (SIGTERM, as a service manager sends; Ctrl-C's SIGINT has the same
/// default handler) ends `watch` at once. SIGINT itself is not sent: a test run started
/// in the background inherits it ignored.
#[test]
fn watch_ends_on_a_signal_to_stop() {
    let srv = test_server();
    let (mut child, _out) = watching(&srv.url(), "20");
    let kill = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .expect("kill -INT");
    assert!(kill.success());
    let status = exit_within(&mut child, secs(10));
    assert!(status.is_some_and(|s| !s.success()), "{status:?}");
}

/// `watch --count 0` is refused as a usage error (exit 2, a message naming `--count`)
/// and prints nothing.
#[test]
fn watch_count_zero_is_a_usage_error() {
    let srv = test_server();
    let o = redbaton(&srv.url(), &["watch", "w", "--count", "0", "--json"]);
    no_panic(&o);
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(stderr(&o).contains("--count"), "{}", stderr(&o));
    assert_eq!(stdout(&o), "");
}

/// `watch --count N` refreshes N times, then ends with exit 0.
#[test]
fn watch_refreshes() {
    let srv = test_server();
    let o = redbaton(
        &srv.url(),
        &["watch", "w", "--interval", "10", "--count", "3", "--json"],
    );
    assert_eq!(code(&o), 0);
    assert_eq!(stdout(&o).lines().count(), 3);
}
