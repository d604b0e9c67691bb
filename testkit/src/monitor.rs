//! `MONITOR`: every command a server runs, the commands its scripts call included (client
//! `lua`), in the order it ran them, for tests of what reached Redis.

use std::collections::HashMap;
use std::sync::mpsc::{Receiver, channel};
use std::thread;
use std::time::Duration;

use redis::Value;

use crate::server::RedisServer;

/// A raw connection in `MONITOR` mode, read by a thread.
pub struct Monitor {
    lines: Receiver<String>,
}

impl Monitor {
    /// Starts monitoring `srv`: every command it runs from now on is seen.
    pub fn start(srv: &RedisServer) -> Monitor {
        let mut conn = srv.conn();
        let () = redis::cmd("MONITOR").query(&mut conn).expect("MONITOR");
        let (tx, lines) = channel();
        // Ends when the server closes the connection (the server is dropped at the
        // latest) or the receiver is gone.
        thread::spawn(move || {
            while let Ok(v) = conn.recv_response() {
                if let Value::SimpleString(s) = v
                    && tx.send(s).is_err()
                {
                    return;
                }
            }
        });
        Monitor { lines }
    }

    /// The next line, if one comes within `timeout`.
    pub fn next_line(&self, timeout: Duration) -> Option<String> {
        self.lines.recv_timeout(timeout).ok()
    }

    /// Every line up to now: a marker command sent now is waited for (the server shows
    /// commands in the order it ran them).
    pub fn flush(&self, srv: &RedisServer) -> Vec<String> {
        let marker = "redbaton-testkit-monitor-marker";
        let _: String = redis::cmd("ECHO")
            .arg(marker)
            .query(&mut srv.conn())
            .expect("ECHO");
        let mut lines = Vec::new();
        loop {
            let line = self
                .next_line(Duration::from_secs(10))
                .expect("MONITOR line (the marker never seen)");
            if line.contains(marker) {
                return lines;
            }
            lines.push(line);
        }
    }
}

/// A `MONITOR` line (`1700000000.123456 [0 127.0.0.1:5000] "EVALSHA" "..." ...`): the
/// client (`127.0.0.1:5000`, or `lua` for commands run by a script) and the arguments,
/// unquoted.
///
/// ```
/// use redbaton_testkit::monitor::parse_line;
///
/// let (client, args) = parse_line(r#"1.4 [0 lua] "GET" "a\"b\x41""#).unwrap();
/// assert_eq!(client, "lua");
/// assert_eq!(args, ["GET", "a\"bA"]);
/// ```
pub fn parse_line(line: &str) -> Option<(String, Vec<String>)> {
    let open = line.find('[')?;
    let close = open + line[open..].find("] ")?;
    let client = line[open + 1..close].split_once(' ')?.1.to_string();
    let mut out = Vec::new();
    let mut chars = line[close + 2..].chars().peekable();
    loop {
        while chars.peek() == Some(&' ') {
            chars.next();
        }
        match chars.next() {
            None => return Some((client, out)),
            Some('"') => {}
            Some(_) => return None,
        }
        let mut arg = String::new();
        loop {
            match chars.next()? {
                '"' => break,
                '\\' => match chars.next()? {
                    'n' => arg.push('\n'),
                    'r' => arg.push('\r'),
                    't' => arg.push('\t'),
                    'a' => arg.push('\x07'),
                    'b' => arg.push('\x08'),
                    'x' => {
                        let hex: String = [chars.next()?, chars.next()?].iter().collect();
                        arg.push(char::from(u8::from_str_radix(&hex, 16).ok()?));
                    }
                    c => arg.push(c),
                },
                c => arg.push(c),
            }
        }
        out.push(arg);
    }
}

/// A script call a server ran: `EVALSHA sha numkeys key... arg...`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScriptCall {
    pub sha: String,
    pub keys: Vec<String>,
    pub argv: Vec<String>,
}

impl ScriptCall {
    /// The script call a `MONITOR` line's arguments (see [`parse_line`]) make, if they are
    /// an `EVALSHA`.
    ///
    /// ```
    /// use redbaton_testkit::monitor::ScriptCall;
    ///
    /// let args = ["EVALSHA", "abc", "1", "k", "t-1"].map(String::from);
    /// let call = ScriptCall::parse(&args).unwrap();
    /// assert_eq!((call.keys, call.argv), (vec!["k".to_string()], vec!["t-1".to_string()]));
    /// ```
    pub fn parse(args: &[String]) -> Option<ScriptCall> {
        if !args.first()?.eq_ignore_ascii_case("evalsha") {
            return None;
        }
        let numkeys: usize = args.get(2)?.parse().ok()?;
        Some(ScriptCall {
            sha: args.get(1)?.clone(),
            keys: args.get(3..3 + numkeys)?.to_vec(),
            argv: args.get(3 + numkeys..)?.to_vec(),
        })
    }
}

/// The script calls that ran, in server order, from `MONITOR` lines. An `EVALSHA` answered
/// `NOSCRIPT` (the first of each script after a start) is followed on its connection by
/// redis-rs's `SCRIPT LOAD` and the same `EVALSHA` again: the one that did not run is left
/// out.
///
/// ```
/// use redbaton_testkit::monitor::script_calls;
///
/// let lines = [
///     r#"1.1 [0 127.0.0.1:5001] "EVALSHA" "def" "1" "k" "t-2""#,
///     r#"1.2 [0 127.0.0.1:5001] "SCRIPT" "LOAD" "return 1""#,
///     r#"1.3 [0 127.0.0.1:5001] "EVALSHA" "def" "1" "k" "t-2""#,
/// ]
/// .map(String::from);
/// assert_eq!(script_calls(&lines).len(), 1);
/// ```
pub fn script_calls(lines: &[String]) -> Vec<ScriptCall> {
    let mut calls: Vec<(ScriptCall, bool)> = Vec::new();
    let mut last_call: HashMap<String, usize> = HashMap::new();
    for line in lines {
        let Some((client, args)) = parse_line(line) else {
            continue;
        };
        if let Some(call) = ScriptCall::parse(&args) {
            last_call.insert(client, calls.len());
            calls.push((call, true));
        } else if args.len() >= 2
            && args[0].eq_ignore_ascii_case("script")
            && args[1].eq_ignore_ascii_case("load")
            && let Some(i) = last_call.remove(&client)
        {
            calls[i].1 = false;
        }
    }
    calls
        .into_iter()
        .filter(|(_, ran)| *ran)
        .map(|(c, _)| c)
        .collect()
}
