//! The parent's side of the worker processes: starting them (the tool re-executes
//! itself with `--worker`), reading their messages, and killing any left over.

use std::io::{BufRead, BufReader};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::Duration;

use crossbeam_channel::{Receiver, RecvTimeoutError};

use crate::Res;
use crate::protocol::Msg;
use crate::settings::Settings;
use crate::strategy::Strategy;

/// How long workers may take to connect and say `ready`.
pub const READY_TIMEOUT: Duration = Duration::from_secs(30);

/// How long workers may take to exit once told to.
pub const EXIT_TIMEOUT: Duration = Duration::from_secs(15);

/// The worker processes of one strategy; killed (SIGKILL) if still running when dropped.
pub struct Workers {
    pub children: Vec<Child>,
    pub stdins: Vec<Option<ChildStdin>>,
}

impl Drop for Workers {
    fn drop(&mut self) {
        self.stdins.clear();
        for child in &mut self.children {
            if matches!(child.try_wait(), Ok(None)) {
                let _ = child.kill();
            }
            let _ = child.wait();
        }
    }
}

pub enum Event {
    Line(usize, String),
    Eof(usize),
}

/// `url` is where the locks live (a cluster's seed when `cluster`); `counter_url`, where
/// the counters do when not there.
pub fn spawn_workers(
    url: &str,
    cluster: bool,
    counter_url: Option<&str>,
    prefix: &str,
    strategy: Strategy,
    s: &Settings,
) -> Res<(Workers, Receiver<Event>)> {
    let exe = std::env::current_exe()?;
    let (tx, rx) = crossbeam_channel::unbounded();
    let mut workers = Workers {
        children: Vec::new(),
        stdins: Vec::new(),
    };
    for id in 0..s.processes {
        let mut child = Command::new(&exe)
            .arg("--worker")
            .args(["--worker-id", &id.to_string()])
            .args(["--url", url])
            .args(cluster.then_some("--cluster"))
            .args(counter_url.iter().flat_map(|u| ["--counter-url", u]))
            .args(["--prefix", prefix])
            .args(["--strategy", strategy.name()])
            .args(["--processes", &s.processes.to_string()])
            .args(["--threads", &s.threads.to_string()])
            .args(["--sections", &s.sections.to_string()])
            .args(["--slow-sections", &s.slow_sections.to_string()])
            .args(["--hold-us", &s.hold_us.to_string()])
            .args(s.spin.then_some("--spin"))
            .args(["--keys", &s.keys.to_string()])
            .args(["--lease-ms", &s.lease_ms.to_string()])
            .args(
                s.max_handoffs
                    .iter()
                    .flat_map(|n| ["--max-handoffs".to_owned(), n.to_string()]),
            )
            .args(
                s.slice_ms
                    .iter()
                    .flat_map(|ms| ["--slice-ms".to_owned(), ms.to_string()]),
            )
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()?;
        let stdout = child.stdout.take().expect("stdout is piped");
        workers.stdins.push(child.stdin.take());
        workers.children.push(child);
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                match line {
                    Ok(l) => {
                        if tx.send(Event::Line(id, l)).is_err() {
                            return;
                        }
                    }
                    Err(_) => break,
                }
            }
            let _ = tx.send(Event::Eof(id));
        });
    }
    Ok((workers, rx))
}

/// Reads the next message from any worker, failing on a worker's death or error.
pub fn next_msg(rx: &Receiver<Event>, timeout: Duration, what: &str) -> Res<(usize, Msg)> {
    loop {
        match rx.recv_timeout(timeout) {
            Ok(Event::Line(id, line)) => match serde_json::from_str::<Msg>(&line) {
                Ok(Msg::Failed { error }) => return Err(format!("worker {id}: {error}").into()),
                Ok(msg) => return Ok((id, msg)),
                // Not ours (a stray print): pass it on.
                Err(_) => eprintln!("worker {id}: {line}"),
            },
            Ok(Event::Eof(id)) => {
                return Err(format!("worker {id} exited while {what}").into());
            }
            Err(RecvTimeoutError::Timeout) => {
                return Err(
                    format!("no word from the workers for {timeout:?} while {what}").into(),
                );
            }
            Err(RecvTimeoutError::Disconnected) => {
                return Err(format!("lost every worker while {what}").into());
            }
        }
    }
}
