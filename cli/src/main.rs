//! `redbaton`: the operators' view of redbaton locks. Is a name locked, who holds it
//! (under which fence, for how long), who waits for it, and a fence-checked release of a
//! stuck lock.
//!
//! ```text
//! redbaton status NAME                 what Redis holds for NAME, as a table
//! redbaton list [PATTERN]              the names held or waited for
//! redbaton watch NAME [--interval MS]  status, refreshed until Ctrl-C
//! redbaton release NAME --fence F      delete NAME's lock only if its fence is F
//! ```
//!
//! Connection, before or after the subcommand: `--url` (or `$REDIS_URL`; default
//! `redis://127.0.0.1:6379/`), or `--cluster SEED[,SEED...]` (or the option repeated), or
//! `--sentinel MASTER URL[,URL...]` (the master over TLS when its sentinels are
//! `rediss://`); `--prefix` (default `redbaton:`, as the library's);
//! `--timeout SECS` (1 to 3600, default 3); TLS with `rediss://` URLs, `--tls-ca`,
//! `--tls-cert` and `--tls-key` (a usage error with plain `redis://` URLs, which would
//! ignore them). Credentials go in the URL (`redis://user:password@host/`) or in
//! `$REDIS_URL`; a Sentinel-managed master's, which its sentinels' URLs do not give, in
//! `--master-user` and `--master-password` (or `$REDBATON_MASTER_PASSWORD`, out of `ps`'s
//! sight). They are never printed. The command only reads, except `release`; it never
//! changes the server's configuration.
//!
//! Names are bytes. They are shown (tables and JSON) in one escaped form, and NAME arguments
//! take that form back: `\\` for a backslash, `\n`, `\r`, `\t`, `\xNN` for other ASCII
//! control characters and bytes that are not UTF-8, `\u{NNNN}` for other control
//! characters (see `name.rs`).
//!
//! `--json` prints one JSON object per name (`list`: one per line) with at least `name`,
//! `kind`, `fence`, `ttl_ms`, `holders` and `queue`.
//!
//! # Exit codes
//!
//! * 0: done (`status` of a free name included);
//! * 1: not found or refused (`release` of a name not held, under another fence, or of
//!   another kind);
//! * 2: usage (bad arguments, an invalid name, an empty or unparsable URL, unreadable TLS
//!   files, TLS options without a `rediss://` URL, `watch --count 0`);
//! * 3: runtime (Redis unreachable, refused credentials, a server error; `list`: a name or
//!   a page it could not read, reported on stderr after what was listed; stdout not
//!   writable).
//!
//! A closed stdout (`redbaton watch NAME | head`) ends the command at its next write, with
//! exit 0 (`watch`: also while it waits for its next look).
//!
//! `watch` fails as `status` does at start-up (its first look); after that, a failed look
//! (a restart, a killed connection, a timeout) is one line on stderr and a new look after a
//! bounded backoff, not the end of the command (see `Command::Watch`).

mod args;
mod commands;
mod connect;
mod describe;
mod failure;
mod json;
mod name;
mod table;

use std::process::ExitCode;

use clap::Parser;

use crate::args::{Cli, Command};
use crate::failure::Failure;

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(&cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(failure) => failure.exit(),
    }
}

fn run(cli: &Cli) -> Result<(), Failure> {
    let client = connect::connect(&cli.conn)?;
    let out = &mut std::io::stdout().lock();
    match &cli.command {
        Command::Status { name } => commands::status(out, &client, name, cli.json),
        Command::List { pattern } => {
            commands::list(out, &client, (&cli.conn.prefix, pattern), cli.json)
        }
        Command::Watch {
            name,
            interval,
            count,
        } => commands::watch(out, &client, name, (*interval, *count), cli.json),
        Command::Release { name, fence } => commands::release(out, &client, name, *fence, cli.json),
    }
}
