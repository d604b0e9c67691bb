//! `redbaton watch` while the server fails under it, run as a subprocess against a real
//! `redis-server`: a restart, a killed connection, a stall. Once it has shown the name,
//! `watch` reports each failed look on stderr and keeps looking; what it cannot mend (the
//! server unreachable at start-up) still ends it at once, and so do `--count` and a reader
//! that goes away, even while it waits between looks.

mod support;

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, ChildStdout};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use redbaton::LockGuard;
use redbaton_testkit::server::RedisServer;
use redbaton_testkit::wait::wait_for;
use redbaton_testkit::{dead_url, secs, test_server};

use support::{client, code, exit_within, no_panic, redbaton, spawn, stderr};

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// The lines a child wrote on one of its pipes so far, read by a thread of their own.
#[derive(Clone, Default)]
struct Lines(Arc<Mutex<Vec<String>>>);

impl Lines {
    fn read(pipe: impl Read + Send + 'static) -> (Lines, JoinHandle<()>) {
        let lines = Lines::default();
        let sink = lines.clone();
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(pipe).lines() {
                let Ok(line) = line else { break };
                sink.0.lock().expect("lines").push(line);
            }
        });
        (lines, reader)
    }

    fn len(&self) -> usize {
        self.0.lock().expect("lines").len()
    }

    fn since(&self, from: usize) -> Vec<String> {
        let lines = self.0.lock().expect("lines");
        lines.get(from..).unwrap_or_default().to_vec()
    }

    fn any(&self, from: usize, needle: &str) -> bool {
        self.since(from).iter().any(|l| l.contains(needle))
    }
}

/// `watch NAME --json` running, its stdout and stderr read line by line.
struct Watching {
    child: Child,
    out: Lines,
    err: Lines,
    readers: Vec<JoinHandle<()>>,
}

impl Watching {
    fn start(url: &str, args: &[&str]) -> Watching {
        let mut child = spawn(url, &[&["watch", "--json"], args].concat());
        let (out, o) = Lines::read(child.stdout.take().expect("stdout"));
        let (err, e) = Lines::read(child.stderr.take().expect("stderr"));
        Watching {
            child,
            out,
            err,
            readers: vec![o, e],
        }
    }

    /// Waits (10 s at most) for a line of its stdout, from the `from`-th on, that contains
    /// `needle`; fails at once if the command ends meanwhile.
    fn wait_out(&mut self, from: usize, needle: &str) {
        self.wait(|w| &w.out, from, needle);
    }

    /// [`wait_out`](Self::wait_out) for its stderr.
    fn wait_err(&mut self, from: usize, needle: &str) {
        self.wait(|w| &w.err, from, needle);
    }

    fn wait(&mut self, lines: fn(&Watching) -> &Lines, from: usize, needle: &str) {
        wait_for(secs(10), &format!("a line with {needle:?}"), || {
            self.assert_running();
            lines(self).any(from, needle)
        });
    }

    /// Fails when the command has ended (it should still be watching).
    fn assert_running(&mut self) {
        let status = self.child.try_wait().expect("try_wait");
        assert!(
            status.is_none(),
            "watch ended, exit {:?}; stderr: {:?}",
            status.and_then(|s| s.code()),
            self.err.since(0)
        );
    }

    /// Stops the command (SIGKILL: it never ends by itself) and reads what is left.
    fn stop(mut self) -> Vec<String> {
        let _ = self.child.kill();
        let _ = self.child.wait();
        for r in self.readers {
            r.join().expect("reader");
        }
        self.err.since(0)
    }
}

/// A server, a lock held on `w` there, and `watch w ARGS` running once it has shown that
/// holder.
fn watching_a_held_lock(args: &[&str]) -> (RedisServer, LockGuard, Watching) {
    let srv = test_server();
    let holder = client(&srv).lock("w").expect("lock");
    let mut w = Watching::start(&srv.url(), &[&["w"], args].concat());
    w.wait_out(0, "\"kind\":\"lock\"");
    (srv, holder, w)
}

/// Each stderr line of a failed look says what failed and that `watch` looks again.
fn assert_retry_lines(err: &[String]) {
    assert!(!err.is_empty());
    for line in err {
        assert!(
            line.starts_with("redbaton: watch w: ") && line.contains("trying again in"),
            "{err:?}"
        );
        assert!(!line.contains("panicked"), "{err:?}");
    }
}

#[test]
fn smoke() {
    let (_srv, _holder, w) = watching_a_held_lock(&["--interval", "20"]);
    assert!(w.stop().is_empty());
}

/// The server restarts on the same port (killed, then a new process): `watch` prints one
/// line per failed look on stderr, backing off rather than flooding, and once the new
/// server answers it prints the name again, holder included.
#[test]
fn watch_survives_a_server_restart() {
    let (srv, holder, mut w) = watching_a_held_lock(&["--interval", "10"]);
    srv.kill();
    drop(holder);
    w.wait_err(0, "trying again");
    // An outage of a second: without a backoff, a look every 10 ms fails at once (the
    // port refuses) and would write a line each time.
    std::thread::sleep(ms(1000));
    w.assert_running();
    let failed = w.err.len();
    assert!(failed <= 12, "{failed} lines: {:?}", w.err.since(0));
    srv.restart();
    let shown = w.out.len();
    let _holder = client(&srv).lock("w").expect("lock after the restart");
    w.wait_out(shown, "\"kind\":\"lock\"");
    w.assert_running();
    assert_retry_lines(&w.stop());
}

/// `CLIENT KILL` of the connection `watch` reads through: the next look fails (or is
/// retried on a new connection), and `watch` goes on printing.
#[test]
fn watch_survives_client_kill() {
    let (srv, _holder, mut w) = watching_a_held_lock(&["--interval", "50"]);
    // The library names its connections `redbaton`: the command's, and the holder's.
    let ids: Vec<String> = (srv.client_list().into_iter())
        .filter(|c| c.get("name").is_some_and(|n| n == "redbaton"))
        .filter_map(|mut c| c.remove("id"))
        .collect();
    assert!(ids.len() >= 2, "{ids:?}");
    for id in ids {
        redis::cmd("CLIENT")
            .arg("KILL")
            .arg("ID")
            .arg(id)
            .exec(&mut srv.conn())
            .expect("client kill");
    }
    let shown = w.out.len();
    w.wait_out(shown + 3, "\"kind\":\"lock\"");
    w.assert_running();
    let err = w.stop();
    assert!(err.len() <= 1, "{err:?}");
    if !err.is_empty() {
        assert_retry_lines(&err);
    }
}

/// The server stops answering (paused) for longer than `--timeout`: each look that times
/// out is one line on stderr, and `watch` prints again once the server answers.
#[test]
fn watch_survives_a_read_timeout() {
    let (srv, _holder, mut w) = watching_a_held_lock(&["--interval", "50", "--timeout", "1"]);
    srv.pause();
    w.wait_err(0, "trying again");
    w.assert_running();
    srv.resume();
    let shown = w.out.len();
    w.wait_out(shown, "\"kind\":\"lock\"");
    assert_retry_lines(&w.stop());
}

/// `--count N` bounds the command whatever the server does: failed looks count, and when
/// the last look fails the command ends with exit 3 (what it printed last is stale), its
/// last line on stderr the error alone.
#[test]
fn a_bounded_watch_ends_when_the_server_stays_away() {
    let srv = test_server();
    let mut w = Watching::start(&srv.url(), &["w", "--interval", "200", "--count", "4"]);
    w.wait_out(0, "\"kind\":\"free\"");
    srv.kill();
    let status = exit_within(&mut w.child, secs(10));
    assert_eq!(status.and_then(|s| s.code()), Some(3), "{status:?}");
    let shown = w.out.len();
    let mut err = w.stop();
    let last = err.pop().expect("a last line");
    assert!(!last.contains("trying again"), "{last}");
    assert!(last.starts_with("redbaton: watch w: "), "{last}");
    assert_retry_lines(&err);
    assert_eq!(
        shown + err.len() + 1,
        4,
        "{shown} shown, then {err:?}, {last}"
    );
}

/// `watch w --interval MS` (a table), once its first refresh has been read; and its stdout.
fn first_refresh(url: &str, interval_ms: &str) -> (Child, ChildStdout) {
    let mut child = spawn(url, &["watch", "w", "--interval", interval_ms]);
    let mut out = child.stdout.take().expect("stdout");
    let mut first = [0u8; 64];
    assert!(out.read(&mut first).expect("read") > 0);
    (child, out)
}

/// Closes the command's stdout (its reader goes away): it ends within 10 s, exit 0.
fn ends_when_closed(mut child: Child, out: ChildStdout) {
    drop(out);
    let status = exit_within(&mut child, secs(10));
    assert_eq!(status.and_then(|s| s.code()), Some(0), "{status:?}");
}

/// A reader that goes away while the server is down ends `watch`, which has nothing to
/// print then: it notices while it waits to look again, with exit 0.
#[test]
fn watch_ends_when_its_stdout_is_closed_during_an_outage() {
    let srv = test_server();
    let (mut child, out) = first_refresh(&srv.url(), "20");
    let (err, reader) = Lines::read(child.stderr.take().expect("stderr"));
    srv.kill();
    wait_for(secs(10), "a failed look", || err.any(0, "trying again"));
    ends_when_closed(child, out);
    reader.join().expect("reader");
}

/// `watch NAME --interval 60000 | head -1`: the reader goes away after the first refresh,
/// and `watch` ends then (exit 0), not at its next write a minute later.
#[test]
fn watch_ends_when_its_stdout_is_closed_between_long_refreshes() {
    let srv = test_server();
    let (child, out) = first_refresh(&srv.url(), "60000");
    ends_when_closed(child, out);
}

/// Nothing listens at start-up: no retry, exit 3 at once with one line on stderr (a
/// wrong address or port is the likeliest cause, and looking again will not mend it).
#[test]
fn watch_exits_at_once_when_nothing_listens_at_start_up() {
    let o = redbaton(&dead_url(), &["watch", "w"]);
    no_panic(&o);
    assert_eq!(code(&o), 3, "{}", stderr(&o));
    assert_eq!(stderr(&o).lines().count(), 1, "{}", stderr(&o));
}
