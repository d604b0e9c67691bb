//! `redbaton`: the operators' view of redbaton locks. Is a name locked, who holds it
//! (under which fence, for how long), who waits for it, and a fence-checked release of a
//! stuck lock.
//!
//! ```text
//! redbaton status NAME                 what Redis holds for NAME, as a table
//! redbaton list [PATTERN]              the names held or waited for
//! redbaton watch NAME [--interval 1s]  status, refreshed until Ctrl-C
//! redbaton release NAME --fence F      delete NAME's lock only if its fence is F
//! ```
//!
//! Connection: `--url` (or `$REDIS_URL`; default `redis://127.0.0.1:6379/`), or
//! `--cluster SEED...`, or `--sentinel MASTER SENTINEL_URL...`; `--prefix` (default
//! `redbaton:`, as the library's); TLS with `rediss://` URLs, `--tls-ca`, `--tls-cert` and
//! `--tls-key`. Credentials go in the URL (`redis://user:password@host/`) or in
//! `$REDIS_URL`; they are never printed. The command only reads, except `release`; it
//! never changes the server's configuration.
//!
//! `--json` prints one JSON object per name (`list`: one per line) with at least `name`,
//! `kind`, `fence`, `ttl_ms`, `holders` and `queue`.
//!
//! # Exit codes
//!
//! * 0: done (`status` of a free name included);
//! * 1: not found or refused (`release` of a name not held, under another fence, or of
//!   another kind);
//! * 2: usage (bad arguments, an invalid name, unreadable TLS files);
//! * 3: connection (Redis unreachable, refused credentials, a server error).

use std::io::{IsTerminal, Write};
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use redbaton::{ForceRelease, Hold, HoldKind, LockClient, LockInfo, LockKind};
use serde::Serialize;

const EXIT_CODES: &str = "Exit codes: 0 ok (status of a free name included), 1 not found or \
refused (release), 2 usage, 3 connection (unreachable, refused credentials, server error).";

/// The operators' view of redbaton locks.
#[derive(Parser)]
#[command(name = "redbaton", version, about, after_help = EXIT_CODES)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    #[command(flatten)]
    conn: Connection,
    /// Print JSON: one object per name (`list`: one per line).
    #[arg(long, global = true)]
    json: bool,
}

#[derive(Subcommand)]
enum Command {
    /// What Redis holds for NAME: kind, holder and fence, lease left, holds, fair queue,
    /// waiting marks.
    Status {
        /// The lock's name.
        name: String,
    },
    /// The names held or waited for under the prefix, with holder fence, lease left and
    /// queue length.
    List {
        /// A Redis glob over names (`*`, `?`, `[a-z]`, `\` escapes); default every name.
        #[arg(default_value = "*")]
        pattern: String,
    },
    /// `status NAME`, refreshed every `--interval` until Ctrl-C.
    Watch {
        /// The lock's name.
        name: String,
        /// Time between refreshes, in milliseconds.
        #[arg(long, default_value_t = 1000, value_name = "MS")]
        interval: u64,
        /// Stop after this many refreshes (default: until Ctrl-C).
        #[arg(long)]
        count: Option<u64>,
    },
    /// Deletes NAME's lock only if its fence is still F (see `status`), and wakes its
    /// waiters. Refuses (exit 1) otherwise, and for read-write locks and semaphores.
    Release {
        /// The lock's name.
        name: String,
        /// The holder's fence, as `status` shows it.
        #[arg(long, value_name = "F")]
        fence: u64,
    },
}

#[derive(clap::Args)]
struct Connection {
    /// Redis URL (`redis://` or `rediss://`, credentials in it).
    #[arg(
        long,
        global = true,
        env = "REDIS_URL",
        hide_env_values = true,
        default_value = "redis://127.0.0.1:6379/"
    )]
    url: String,
    /// Redis Cluster seed URLs (instead of --url).
    #[arg(long, global = true, num_args = 1.., value_name = "SEED", conflicts_with = "sentinel")]
    cluster: Vec<String>,
    /// A Sentinel-managed master: its name, then sentinel URLs (instead of --url).
    #[arg(long, global = true, num_args = 2.., value_names = ["MASTER", "URL"])]
    sentinel: Vec<String>,
    /// Key prefix of the locks.
    #[arg(long, global = true, default_value = "redbaton:")]
    prefix: String,
    /// CA certificate (PEM) to trust for `rediss://`.
    #[arg(long, global = true, value_name = "FILE")]
    tls_ca: Option<std::path::PathBuf>,
    /// Client certificate (PEM) for mutual TLS; with --tls-key.
    #[arg(long, global = true, value_name = "FILE", requires = "tls_key")]
    tls_cert: Option<std::path::PathBuf>,
    /// Client private key (PEM) for mutual TLS; with --tls-cert.
    #[arg(long, global = true, value_name = "FILE", requires = "tls_cert")]
    tls_key: Option<std::path::PathBuf>,
    /// Seconds to wait for a connection or a reply.
    #[arg(long, global = true, default_value_t = 3, value_name = "SECS")]
    timeout: u64,
}

/// Why the command stopped, as its exit code says.
enum Failure {
    /// 1: not found or refused; the message was printed.
    Refused,
    /// 2: usage.
    Usage(String),
    /// 3: connection.
    Connection(String),
}

impl From<redbaton::Error> for Failure {
    fn from(e: redbaton::Error) -> Self {
        let mut text = e.to_string();
        let mut source = std::error::Error::source(&e);
        while let Some(s) = source {
            let more = s.to_string();
            if !text.contains(&more) {
                text.push_str(": ");
                text.push_str(&more);
            }
            source = s.source();
        }
        if e.is_invalid_input() || matches!(e, redbaton::Error::InvalidConfig(_)) {
            Failure::Usage(text)
        } else {
            Failure::Connection(text)
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(&cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure::Refused) => ExitCode::from(1),
        Err(Failure::Usage(e)) => {
            eprintln!("redbaton: {e}");
            ExitCode::from(2)
        }
        Err(Failure::Connection(e)) => {
            eprintln!("redbaton: {e}");
            ExitCode::from(3)
        }
    }
}

fn run(cli: &Cli) -> Result<(), Failure> {
    let client = connect(&cli.conn)?;
    let out = &mut std::io::stdout().lock();
    match &cli.command {
        Command::Status { name } => {
            let info = client.inspect(name)?;
            show(out, &info, cli.json);
        }
        Command::List { pattern } => list(out, &client, pattern, cli.json)?,
        Command::Watch {
            name,
            interval,
            count,
        } => {
            let clear = !cli.json && std::io::stdout().is_terminal();
            let mut shown = 0;
            loop {
                let info = client.inspect(name)?;
                if clear {
                    let _ = write!(out, "\x1b[2J\x1b[H");
                }
                show(out, &info, cli.json);
                let _ = out.flush();
                shown += 1;
                if count.is_some_and(|c| shown >= c) {
                    break;
                }
                std::thread::sleep(Duration::from_millis(*interval));
            }
        }
        Command::Release { name, fence } => release(out, &client, name, *fence, cli.json)?,
    }
    Ok(())
}

fn connect(c: &Connection) -> Result<LockClient, Failure> {
    let timeout = Duration::from_secs(c.timeout.max(1));
    let mut b = LockClient::builder()
        .key_prefix(c.prefix.clone())
        // An operator's tool: no subscriber threads, and never a `CONFIG SET`.
        .wakeup(redbaton::Wakeup::Polling(Duration::from_secs(1)))
        .configure_notifications(false)
        .connect_timeout(timeout)
        .read_timeout(timeout)
        .write_timeout(timeout);
    b = if !c.cluster.is_empty() {
        b.cluster(c.cluster.clone())
    } else if let [master, sentinels @ ..] = c.sentinel.as_slice() {
        b.sentinel(master.clone(), sentinels.to_vec())
    } else {
        b.node(c.url.clone())
    };
    let read = |path: &std::path::Path| {
        std::fs::read(path).map_err(|e| Failure::Usage(format!("{}: {e}", path.display())))
    };
    if let Some(ca) = &c.tls_ca {
        b = b.tls_ca_cert(read(ca)?);
    }
    if let (Some(cert), Some(key)) = (&c.tls_cert, &c.tls_key) {
        b = b.tls_client_identity(read(cert)?, read(key)?);
    }
    Ok(b.build()?)
}

fn list(
    out: &mut impl Write,
    client: &LockClient,
    pattern: &str,
    json: bool,
) -> Result<(), Failure> {
    if !json {
        let _ = writeln!(
            out,
            "{:<30} {:<12} {:>18} {:>10} {:>7} {:>6}",
            "NAME", "KIND", "FENCE", "LEASE", "HOLDS", "QUEUE"
        );
    }
    for info in client.locks(pattern) {
        let info = info?;
        if json {
            let _ = writeln!(out, "{}", json_line(&info));
            continue;
        }
        let _ = writeln!(
            out,
            "{:<30} {:<12} {:>18} {:>10} {:>7} {:>6}",
            shown_name(&info),
            kind_name(&info.kind),
            info.fence.map_or("-".to_owned(), |f| f.to_string()),
            ttl(&info).map_or("-".to_owned(), |t| human(Some(t))),
            live_holds(&info),
            info.queue.len(),
        );
    }
    Ok(())
}

fn release(
    out: &mut impl Write,
    client: &LockClient,
    name: &str,
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
        Err(e) => return Err(e.into()),
    };
    if json {
        #[derive(Serialize)]
        struct Released<'a> {
            name: &'a str,
            released: bool,
            fence: Option<u64>,
            message: &'a str,
        }
        let r = Released {
            name,
            released: !refused,
            fence: current,
            message: &outcome,
        };
        let _ = writeln!(out, "{}", serde_json::to_string(&r).unwrap_or_default());
    } else {
        let _ = writeln!(out, "{outcome}");
    }
    if refused {
        Err(Failure::Refused)
    } else {
        Ok(())
    }
}

fn show(out: &mut impl Write, info: &LockInfo, json: bool) {
    if json {
        let _ = writeln!(out, "{}", json_line(info));
    } else {
        let _ = write!(out, "{}", table(info));
    }
}

/// The name as text (names are bytes; others are shown escaped).
fn name_of(info: &LockInfo) -> String {
    String::from_utf8(info.name.clone()).unwrap_or_else(|_| info.name.escape_ascii().to_string())
}

/// The name as a table shows it: control characters escaped, so that a name cannot
/// break the table into rows of its own (or send the terminal escape sequences).
fn shown_name(info: &LockInfo) -> String {
    let name = name_of(info);
    if name.chars().any(char::is_control) {
        name.escape_debug().to_string()
    } else {
        name
    }
}

fn kind_name(kind: &LockKind) -> String {
    match kind {
        LockKind::Free => "free".to_owned(),
        LockKind::Lock => "lock".to_owned(),
        LockKind::ReadWrite => "rwlock".to_owned(),
        LockKind::Semaphore { permits } => format!("semaphore/{permits}"),
        LockKind::Foreign { redis_type } => format!("foreign:{redis_type}"),
        other => format!("{other:?}").to_lowercase(),
    }
}

fn hold_name(kind: HoldKind) -> &'static str {
    match kind {
        HoldKind::Read => "read",
        HoldKind::Write => "write",
        HoldKind::Permit => "permit",
        _ => "hold",
    }
}

/// A duration for people: `29.8s`, `850ms`; `none` for nothing left.
fn human(d: Option<Duration>) -> String {
    match d {
        None => "expired".to_owned(),
        Some(d) if d < Duration::from_secs(1) => format!("{}ms", d.as_millis()),
        Some(d) => format!("{:.1}s", d.as_secs_f64()),
    }
}

/// The lease left: the lock's, or the longest of the live shared holds'.
fn ttl(info: &LockInfo) -> Option<Duration> {
    match &info.holder {
        Some(h) => h.lease_left,
        None => info.holds.iter().filter_map(|h| h.lease_left).max(),
    }
}

fn live_holds(info: &LockInfo) -> usize {
    match info.kind {
        LockKind::Lock => 1,
        _ => info.holds.iter().filter(|h| h.lease_left.is_some()).count(),
    }
}

fn table(info: &LockInfo) -> String {
    let mut t = String::new();
    let mut row = |k: &str, v: String| t.push_str(&format!("{k:<16}{v}\n"));
    row("name", shown_name(info));
    row("node", info.node.clone());
    row("kind", kind_name(&info.kind));
    row(
        "fence",
        info.fence.map_or("-".to_owned(), |f| f.to_string()),
    );
    if let Some(h) = &info.holder {
        let lease = h
            .lease_left
            .map_or("no expiry".to_owned(), |d| human(Some(d)));
        row("lease left", lease);
    }
    if !info.holds.is_empty() {
        row("holds", format!("{} live", live_holds(info)));
        for (
            i,
            Hold {
                kind, lease_left, ..
            },
        ) in info.holds.iter().enumerate()
        {
            row(
                "",
                format!(
                    "{}. {:<7} lease left {}",
                    i + 1,
                    hold_name(*kind),
                    human(*lease_left)
                ),
            );
        }
    }
    row("queue", format!("{} waiting", info.queue.len()));
    for (i, q) in info.queue.iter().enumerate() {
        row(
            "",
            format!(
                "{}. waiting {}, expires in {}",
                i + 1,
                human(Some(q.age)),
                human(q.expires_in)
            ),
        );
    }
    if matches!(info.kind, LockKind::ReadWrite) || !info.waiting_writers.is_empty() {
        row("writers waiting", info.waiting_writers.len().to_string());
        row("readers waiting", info.waiting_readers.len().to_string());
    }
    if let Some(c) = info.contention {
        row(
            "contention",
            format!("another process waits (mark expires in {})", human(Some(c))),
        );
    }
    for n in &info.nodes {
        let holder = n.fence.map_or("-".to_owned(), |f| f.to_string());
        row(
            "master",
            format!("{}: {}, fence {holder}", n.node, kind_name(&n.kind)),
        );
    }
    for n in &info.unreachable {
        row("master", format!("{n}: unreachable"));
    }
    t
}

/// The JSON form of one name.
#[derive(Serialize)]
struct Json {
    name: String,
    node: String,
    kind: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    permits: Option<u32>,
    /// A foreign key's Redis type.
    #[serde(skip_serializing_if = "Option::is_none")]
    redis_type: Option<String>,
    fence: Option<u64>,
    /// The lock's lease left (shared kinds: the longest live hold's), in ms.
    ttl_ms: Option<u64>,
    holders: Vec<JsonHolder>,
    queue: Vec<JsonWaiter>,
    waiting_writers: usize,
    waiting_readers: usize,
    contention_ms: Option<u64>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    nodes: Vec<Json>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    unreachable: Vec<String>,
}

#[derive(Serialize)]
struct JsonHolder {
    kind: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    fence: Option<u64>,
    /// Lease left in ms; null when expired (or, for a lock, no expiry).
    ttl_ms: Option<u64>,
    expired: bool,
    mine: bool,
}

#[derive(Serialize)]
struct JsonWaiter {
    age_ms: u64,
    /// Until the entry expires, in ms; null when expired.
    ttl_ms: Option<u64>,
}

fn ms(d: Option<Duration>) -> Option<u64> {
    d.map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

fn to_json(info: &LockInfo) -> Json {
    let mut holders: Vec<JsonHolder> = info
        .holder
        .iter()
        .map(|h| JsonHolder {
            kind: "lock",
            fence: h.fence,
            ttl_ms: ms(h.lease_left),
            expired: false,
            mine: h.mine,
        })
        .collect();
    holders.extend(info.holds.iter().map(|h| JsonHolder {
        kind: hold_name(h.kind),
        fence: None,
        ttl_ms: ms(h.lease_left),
        expired: h.lease_left.is_none(),
        mine: h.mine,
    }));
    Json {
        name: name_of(info),
        node: info.node.clone(),
        kind: match info.kind {
            LockKind::Semaphore { .. } => "semaphore".to_owned(),
            LockKind::Foreign { .. } => "foreign".to_owned(),
            ref k => kind_name(k),
        },
        permits: match info.kind {
            LockKind::Semaphore { permits } => Some(permits),
            _ => None,
        },
        redis_type: match &info.kind {
            LockKind::Foreign { redis_type } => Some(redis_type.clone()),
            _ => None,
        },
        fence: info.fence,
        ttl_ms: ms(ttl(info)),
        holders,
        queue: info
            .queue
            .iter()
            .map(|q| JsonWaiter {
                age_ms: ms(Some(q.age)).unwrap_or(0),
                ttl_ms: ms(q.expires_in),
            })
            .collect(),
        waiting_writers: info.waiting_writers.len(),
        waiting_readers: info.waiting_readers.len(),
        contention_ms: ms(info.contention),
        nodes: info.nodes.iter().map(to_json).collect(),
        unreachable: info.unreachable.clone(),
    }
}

fn json_line(info: &LockInfo) -> String {
    serde_json::to_string(&to_json(info)).unwrap_or_default()
}
