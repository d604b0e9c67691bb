//! The subcommands: what each asks Redis and prints.

use std::io::{ErrorKind, IsTerminal, Write};
use std::time::Duration;

use redbaton::{ForceRelease, LockClient, LockInfo};
use serde::Serialize;

use crate::describe::human;
use crate::failure::{Failure, error_text, warn};
use crate::json::json_line;
use crate::name::{Name, Pattern};
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

/// How long `watch` waits after a failed look: the interval, doubled at each failure in a
/// row, from this at the least (a refused port fails at once: never a busy loop, nor a
/// flood of lines on stderr)...
const RETRY_FLOOR: Duration = Duration::from_millis(100);
/// ... to this at the most, or the interval when longer (the command must notice soon that
/// the server is back).
const RETRY_CEILING: Duration = Duration::from_secs(5);

/// `watch NAME`: `status` every `interval` ms, `count` times (at least once) or until
/// stdout is closed.
///
/// The first look is the start-up check: if it fails (nothing listens, refused
/// credentials, a timeout, a server error), the command ends as `status` would, since the
/// address or the credentials are the likeliest cause and looking again will not mend
/// them. Once the name has been shown, a look that fails (the server restarting or
/// loading, a connection killed or reset, a read timed out) is one line on stderr and
/// another look after [`retry_delay`] (the client's pool opens a new connection for a
/// lost one), and the status printed again as soon as the server answers. Failed looks
/// count in `count`: when the last one fails, the command ends with exit 3.
pub fn watch(
    out: &mut impl Write,
    client: &LockClient,
    name: &Name,
    (interval, count): (u64, Option<u64>),
    json: bool,
) -> Result<(), Failure> {
    let interval = Duration::from_millis(interval);
    let clear = !json && std::io::stdout().is_terminal();
    let mut looks: u64 = 0;
    let mut failed: u32 = 0;
    loop {
        let result = client.inspect(name);
        looks = looks.saturating_add(1);
        let last = count.is_some_and(|c| looks >= c);
        let pause = match result {
            Ok(info) => {
                failed = 0;
                if clear {
                    write!(out, "\x1b[2J\x1b[H")?;
                }
                show(out, &info, json)?;
                out.flush()?;
                if last {
                    return Ok(());
                }
                interval
            }
            Err(e) if looks == 1 || e.is_invalid_input() => return Err(e.into()),
            Err(e) if last => {
                return Err(Failure::Runtime(format!(
                    "watch {name}: {}",
                    error_text(&e)
                )));
            }
            Err(e) => {
                failed = failed.saturating_add(1);
                let delay = retry_delay(interval, failed);
                warn(&format!(
                    "watch {name}: {}; trying again in {}",
                    error_text(&e),
                    human(Some(delay))
                ));
                delay
            }
        };
        if stdout_closed_within(pause) {
            return Err(Failure::Closed);
        }
    }
}

/// The wait after the `failed`-th failed look in a row (see [`RETRY_FLOOR`]).
fn retry_delay(interval: Duration, failed: u32) -> Duration {
    let ceiling = RETRY_CEILING.max(interval);
    let doubled = interval
        .max(RETRY_FLOOR)
        .saturating_mul(1_u32 << failed.saturating_sub(1).min(16));
    doubled.min(ceiling)
}

/// Waits `pause`, or less when the reader of stdout goes away meanwhile (`watch | head`
/// once `head` has read enough, or while the server is down and nothing is printed):
/// whether it went away.
#[cfg(unix)]
fn stdout_closed_within(pause: Duration) -> bool {
    use std::os::fd::AsRawFd;
    use std::time::Instant;
    // An interval too long for the clock (`--interval` near u64::MAX ms) waits forever.
    let deadline = Instant::now().checked_add(pause);
    let fd = std::io::stdout().as_raw_fd();
    loop {
        let left = deadline.map_or(Duration::MAX, |d| {
            d.saturating_duration_since(Instant::now())
        });
        if left.is_zero() {
            return false;
        }
        // No event asked for: poll reports only POLLERR (a pipe whose reader closed) and
        // POLLHUP (a socket shut down, a terminal hung up). A file or a terminal never
        // wakes it early.
        let mut pfd = libc::pollfd {
            fd,
            events: 0,
            revents: 0,
        };
        let ms = libc::c_int::try_from(left.as_millis().max(1)).unwrap_or(libc::c_int::MAX);
        // SAFETY: one valid pollfd, and its count.
        match unsafe { libc::poll(&mut pfd, 1, ms) } {
            0 => return false,
            n if n > 0 && pfd.revents & (libc::POLLERR | libc::POLLHUP) != 0 => return true,
            n if n < 0 && std::io::Error::last_os_error().kind() == ErrorKind::Interrupted => {}
            // Not a file to watch (POLLNVAL), or poll itself failed: wait without it.
            _ => {
                std::thread::sleep(left);
                return false;
            }
        }
    }
}

#[cfg(not(unix))]
fn stdout_closed_within(pause: Duration) -> bool {
    std::thread::sleep(pause);
    false
}

/// `list PATTERN`: every name it can read; the others are reported on stderr, and make
/// the command fail once the listing is done.
/// Nothing found is said on stderr with where it looked: a wrong `--prefix` or database
/// must not look like an idle system.
pub fn list(
    out: &mut impl Write,
    client: &LockClient,
    (prefix, pattern): (&str, &Pattern),
    json: bool,
) -> Result<(), Failure> {
    if !json {
        out.write_all(list_header().as_bytes())?;
    }
    let (mut listed, mut failed) = (0_usize, 0_usize);
    for info in client.locks(&pattern.glob) {
        match info {
            Ok(info) if json => writeln!(out, "{}", json_line(&info))?,
            Ok(info) => out.write_all(list_line(&info).as_bytes())?,
            Err(e) => {
                failed += 1;
                warn(&format!("list: {}", error_text(&e)));
                continue;
            }
        }
        listed += 1;
    }
    out.flush()?;
    match (listed, failed) {
        (0, 0) => {
            warn(&format!(
                "list: no name held or waited for matches `{pattern}` under prefix `{prefix}`"
            ));
            Ok(())
        }
        (_, 0) => Ok(()),
        (_, n) => Err(Failure::Runtime(format!(
            "list: {n} name(s) or page(s) could not be read; the list above may miss names"
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
    // Fence 0 is how the library says "no fence counter", which `status` shows as `-`.
    let shown = |f: u64| match f {
        0 => "-".to_owned(),
        f => f.to_string(),
    };
    let (outcome, current, refused) = match client.force_release(name, fence) {
        Ok(ForceRelease::Released { nodes }) => {
            let text = format!(
                "released {name} (fence {}) on {nodes} node(s)",
                shown(fence)
            );
            (text, Some(fence), false)
        }
        Ok(ForceRelease::NotHeld) => (format!("refused: {name} is not held"), None, true),
        Ok(ForceRelease::FenceMismatch { current }) => {
            let text = match current {
                Some(now) => format!(
                    "refused: {name} is held under fence {}, not {}",
                    shown(now),
                    shown(fence)
                ),
                None => format!(
                    "refused: {name} is held with no fence (`-`), not fence {fence}: \
                     `--fence -` releases it"
                ),
            };
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::retry_delay;

    #[test]
    fn the_retry_delay_doubles_between_a_floor_and_a_ceiling() {
        let ms = Duration::from_millis;
        let delays = |interval, n| {
            (1..=n)
                .map(|f| retry_delay(interval, f))
                .collect::<Vec<_>>()
        };
        assert_eq!(delays(ms(0), 3), [ms(100), ms(200), ms(400)]);
        assert_eq!(
            delays(ms(1000), 5),
            [ms(1000), ms(2000), ms(4000), ms(5000), ms(5000)]
        );
        assert_eq!(delays(ms(60_000), 2), [ms(60_000), ms(60_000)]);
        assert_eq!(retry_delay(ms(300), u32::MAX), ms(5000));
        assert_eq!(retry_delay(Duration::MAX, u32::MAX), Duration::MAX);
    }
}
