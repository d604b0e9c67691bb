//! `MONITOR`: every command a server runs, the commands its scripts call included (client
//! `lua`), in the order it ran them, for tests of what reached Redis.

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
