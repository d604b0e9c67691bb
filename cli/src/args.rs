//! The command line's arguments.

use std::path::PathBuf;

use clap::{ArgAction, Parser, Subcommand};

use crate::name::{self, NAME_HELP, Name, PATTERN_HELP, Pattern};

const EXIT_CODES: &str = "Exit codes: 0 ok (status of a free name included), 1 not found or \
refused (release), 2 usage, 3 runtime (Redis unreachable, refused credentials, a server \
error, names or nodes `list` could not read, stdout not writable; `watch`: at start-up only, \
after which it reports each failed look on stderr and looks again). A closed stdout \
(`| head`) ends the command with 0.";

/// The operators' view of redbaton locks.
#[derive(Parser)]
#[command(name = "redbaton", version, about, after_help = EXIT_CODES)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
    #[command(flatten)]
    pub conn: Connection,
    /// Print JSON: one object per name (`list`: one per line).
    #[arg(long, global = true)]
    pub json: bool,
}

#[derive(Subcommand)]
pub enum Command {
    /// What Redis holds for NAME: kind, holder and fence, lease left, holds, fair queue,
    /// waiting marks.
    Status {
        #[arg(help = NAME_HELP, value_parser = name::parse)]
        name: Name,
    },
    /// The names held or waited for under the prefix, a row each.
    ///
    /// Each row: the name, its kind, the holder's fence, the lease left, the live holds
    /// and the processes waiting in the fair queue (expired entries not counted). A name
    /// or a node that cannot be read is reported on stderr, the others listed, and the
    /// command ends with exit 3.
    List {
        #[arg(help = PATTERN_HELP, default_value = "*", value_parser = name::parse_pattern)]
        pattern: Pattern,
    },
    /// `status NAME`, refreshed every `--interval` until Ctrl-C (or stdout is closed);
    /// rides out a Redis restart or a lost connection.
    ///
    /// At start-up the command fails at once, as `status` does, when NAME or an option is
    /// invalid (exit 2) or when the first look fails (exit 3: nothing listens at the
    /// address, refused credentials, a TLS failure, no reply within --timeout): a wrong
    /// address or password is the likeliest cause, and looking again will not mend it.
    ///
    /// Once NAME has been shown, a look that fails (the server restarting or still
    /// loading, a connection killed or reset, a reply later than --timeout) is one line on
    /// stderr, `redbaton: watch NAME: <error>; trying again in <delay>`, and another look
    /// (on a new connection when the old one was lost) after that delay: the interval,
    /// doubled at each failure in a row, 100 ms at the least and 5 s (or the interval,
    /// when longer) at the most. The status is printed again as soon as the server
    /// answers. Failed looks count in --count: when the last one fails, the command ends
    /// with exit 3.
    Watch {
        #[arg(help = NAME_HELP, value_parser = name::parse)]
        name: Name,
        /// Time between refreshes, in milliseconds, at least 10 (0 would send Redis a
        /// script in a tight loop).
        #[arg(long, default_value_t = 1000, value_name = "MS",
              value_parser = clap::value_parser!(u64).range(10..))]
        interval: u64,
        /// Stop after this many looks, failed ones included, at least 1 (default: until
        /// Ctrl-C).
        #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
        count: Option<u64>,
    },
    /// Deletes NAME's lock only if its fence is still F (see `status`), and wakes its
    /// waiters.
    ///
    /// Refuses (exit 1) when NAME is not held, is held under another fence, or is a
    /// read-write lock or a semaphore. When the connection is lost before the reply, whether
    /// the lock was deleted is unknown (exit 3): `status NAME` tells.
    Release {
        #[arg(help = NAME_HELP, value_parser = name::parse)]
        name: Name,
        /// The holder's fence, as `status` shows it: `-` for a lock that shows none (held
        /// longer than its fence counter lives, 7 days by default), which frees it only
        /// while the name has no counter (`0` says the same).
        #[arg(long, value_name = "F", value_parser = parse_fence)]
        fence: u64,
    },
}

/// A `--fence` value: a number, or `-` (what `status` shows for no fence) for 0, the fence
/// the library takes for "the name has no fence counter".
fn parse_fence(arg: &str) -> Result<u64, String> {
    match arg {
        "-" => Ok(0),
        n => n
            .parse()
            .map_err(|e| format!("{e}: a fence is a number (as `status` shows it), or `-`")),
    }
}

#[derive(clap::Args)]
pub struct Connection {
    /// Redis URL (`redis://` or `rediss://`, credentials in it).
    #[arg(
        long,
        global = true,
        env = "REDIS_URL",
        hide_env_values = true,
        default_value = "redis://127.0.0.1:6379/"
    )]
    pub url: String,
    /// Redis Cluster seed URLs, instead of --url: comma-separated, or the option repeated.
    #[arg(
        long,
        global = true,
        value_delimiter = ',',
        value_name = "SEED",
        conflicts_with = "sentinel"
    )]
    pub cluster: Vec<String>,
    /// A Sentinel-managed master, instead of --url: its name, then its sentinels' URLs,
    /// comma-separated. With `rediss://` sentinels, the master is reached over TLS too.
    #[arg(
        long,
        global = true,
        num_args = 2,
        action = ArgAction::Set,
        value_names = ["MASTER", "URLS"]
    )]
    pub sentinel: Vec<String>,
    /// The Sentinel-managed master's ACL user (default: the default user); needs --sentinel
    /// and a master password.
    #[arg(long, global = true, value_name = "USER", requires_all = ["sentinel", "master_password"])]
    pub master_user: Option<String>,
    /// The Sentinel-managed master's password (and its replicas'): credentials in the
    /// sentinels' URLs are the sentinels' own. Safer in the environment, which `ps` does
    /// not show. Used with --sentinel only, so the variable may stay set.
    #[arg(
        long,
        global = true,
        value_name = "PASSWORD",
        env = "REDBATON_MASTER_PASSWORD",
        hide_env_values = true
    )]
    pub master_password: Option<String>,
    /// Key prefix of the locks.
    #[arg(long, global = true, default_value = "redbaton:")]
    pub prefix: String,
    /// CA certificate (PEM) to trust for `rediss://` (refused with `redis://` URLs).
    #[arg(long, global = true, value_name = "FILE")]
    pub tls_ca: Option<PathBuf>,
    /// Client certificate (PEM) for mutual TLS; with --tls-key.
    #[arg(long, global = true, value_name = "FILE", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// Client private key (PEM) for mutual TLS; with --tls-cert.
    #[arg(long, global = true, value_name = "FILE", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Seconds to wait for a connection or a reply, 1 to 3600.
    #[arg(
        long,
        global = true,
        default_value_t = 3,
        value_name = "SECS",
        value_parser = clap::value_parser!(u64).range(1..=3600)
    )]
    pub timeout: u64,
}
