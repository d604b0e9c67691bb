//! The subcommands: what each asks Redis and prints.

use std::io::{IsTerminal, Write};
use std::time::Duration;

use redbaton::{ForceRelease, LockClient, LockInfo};
use serde::Serialize;

use crate::failure::{Failure, error_text, warn};
use crate::json::json_line;
use crate::name::Name;
use crate::table::{list_header, list_line, table};

/// `status NAME`.
pub fn status(
    out: &mut impl Write,
    client: &LockClient,
    name: &Name,
    json: bool,
) -> Result<(), Failure> {
    let info = client.inspect(name)?;
    show(out, &info, json)
}

/// `watch NAME`: `status` every `interval` ms, `count` times (at least once) or until
/// stdout is closed.
pub fn watch(
    out: &mut impl Write,
    client: &LockClient,
    name: &Name,
    (interval, count): (u64, Option<u64>),
    json: bool,
) -> Result<(), Failure> {
    let clear = !json && std::io::stdout().is_terminal();
    let mut shown: u64 = 0;
    loop {
        let info = client.inspect(name)?;
        if clear {
            write!(out, "\x1b[2J\x1b[H")?;
        }
        show(out, &info, json)?;
        out.flush()?;
        shown = shown.saturating_add(1);
        if count.is_some_and(|c| shown >= c) {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(interval));
    }
}

/// `list PATTERN`: every name it can read; the others are reported on stderr, and make
/// the command fail once the listing is done.
pub fn list(
    out: &mut impl Write,
    client: &LockClient,
    pattern: &str,
    json: bool,
) -> Result<(), Failure> {
    if !json {
        out.write_all(list_header().as_bytes())?;
    }
    let mut failed = 0_usize;
    for info in client.locks(pattern) {
        match info {
            Ok(info) if json => writeln!(out, "{}", json_line(&info))?,
            Ok(info) => out.write_all(list_line(&info).as_bytes())?,
            Err(e) => {
                failed += 1;
                warn(&format!("list: {}", error_text(&e)));
            }
        }
    }
    out.flush()?;
    match failed {
        0 => Ok(()),
        n => Err(Failure::Runtime(format!(
            "list: {n} name(s) or page(s) could not be read; the others are listed"
        ))),
    }
}

/// `release NAME --fence F`.
pub fn release(
    out: &mut impl Write,
    client: &LockClient,
    name: &Name,
    fence: u64,
    json: bool,
) -> Result<(), Failure> {
    let (outcome, current, refused) = match client.force_release(name, fence) {
        Ok(ForceRelease::Released { nodes }) => {
            let text = format!("released {name} (fence {fence}) on {nodes} node(s)");
            (text, Some(fence), false)
        }
        Ok(ForceRelease::NotHeld) => (format!("refused: {name} is not held"), None, true),
        Ok(ForceRelease::FenceMismatch { current }) => {
            let now = current.map_or("gone".to_owned(), |c| c.to_string());
            let text = format!("refused: {name} is held under fence {now}, not {fence}");
            (text, current, true)
        }
        Ok(other) => (format!("refused: {other:?}"), None, true),
        Err(e) if e.is_wrong_kind() => {
            let text = format!(
                "refused: {name} is not a plain lock (read-write locks, semaphores and \
                 foreign keys are never force-released)"
            );
            (text, None, true)
        }
        // The script is sent once: with the connection lost, it may have run (the lock
        // deleted) with its reply lost. "Failed" alone would tell the operator nothing was
        // done.
        Err(e) if e.is_connection() => {
            return Err(Failure::Runtime(format!(
                "{}: whether {name} was released is unknown; `redbaton status {name}` shows \
                 whether it is still held",
                error_text(&e)
            )));
        }
        Err(e) => return Err(e.into()),
    };
    let written = if json {
        #[derive(Serialize)]
        struct Released<'a> {
            name: &'a str,
            released: bool,
            fence: Option<u64>,
            message: &'a str,
        }
        let r = Released {
            name: &name.to_string(),
            released: !refused,
            fence: current,
            message: &outcome,
        };
        let line = serde_json::to_string(&r).unwrap_or_default();
        writeln!(out, "{line}").and_then(|()| out.flush())
    } else {
        writeln!(out, "{outcome}").and_then(|()| out.flush())
    };
    // What was done (or refused) is the exit code, whether or not it could be shown.
    if refused {
        return Err(Failure::Refused);
    }
    Ok(written?)
}

fn show(out: &mut impl Write, info: &LockInfo, json: bool) -> Result<(), Failure> {
    if json {
        writeln!(out, "{}", json_line(info))?;
    } else {
        out.write_all(table(info).as_bytes())?;
    }
    Ok(())
}
