//! Which Redis binaries the harness runs, and what that server knows.
//!
//! `REDBATON_REDIS_SERVER` and `REDBATON_REDIS_CLI` name the server and CLI binaries
//! (default: `redis-server` and `redis-cli` on `PATH`), so the same suite runs on Redis
//! 6.2, Redis 7 or Valkey by pointing the variables at another build. The server's version
//! is read once, from `--version`, and the harness writes only the `redis.conf` directives
//! that version knows.

use std::collections::BTreeMap;
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use parking_lot::Mutex;

/// How to install a server, said whenever none can be found or started.
pub const INSTALL_HINT: &str = "install it (Debian/Ubuntu: apt-get update && apt-get install -y redis-server; macOS: brew install redis), point REDBATON_REDIS_SERVER at a redis-server binary, or set REDIS_URL to an existing server where a program accepts one";

/// The server binary: `$REDBATON_REDIS_SERVER`, else `redis-server`.
pub fn server_bin() -> String {
    std::env::var("REDBATON_REDIS_SERVER").unwrap_or_else(|_| "redis-server".into())
}

/// The CLI binary: `$REDBATON_REDIS_CLI`, else `redis-cli`.
pub fn cli_bin() -> String {
    std::env::var("REDBATON_REDIS_CLI").unwrap_or_else(|_| "redis-cli".into())
}

/// What `redis-server --version` says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerVersion {
    /// `redis` or `valkey`.
    pub product: String,
    /// Major, minor, patch.
    pub version: (u32, u32, u32),
}

impl ServerVersion {
    /// Parses `Redis server v=7.0.15 sha=…` or `Valkey server v=9.1.2 …`.
    pub fn parse(text: &str) -> Option<ServerVersion> {
        let product = text.split_whitespace().next()?.to_ascii_lowercase();
        let v = text.split_whitespace().find_map(|w| w.strip_prefix("v="))?;
        let mut parts = v.split('.').map(|p| p.parse::<u32>().ok());
        let version = (
            parts.next()??,
            parts.next()??,
            parts.next().flatten().unwrap_or(0),
        );
        Some(ServerVersion { product, version })
    }

    /// At least Redis `major.minor` (every Valkey release is at least Redis 7.2).
    pub fn at_least(&self, major: u32, minor: u32) -> bool {
        self.product == "valkey" || (self.version.0, self.version.1) >= (major, minor)
    }
}

impl std::fmt::Display for ServerVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (a, b, c) = self.version;
        write!(f, "{} {a}.{b}.{c}", self.product)
    }
}

/// The server binary's version ([`server_bin`]), read once per process. `Err` says why it
/// could not be read (not found, with [`INSTALL_HINT`]).
pub fn server_version() -> Result<ServerVersion, String> {
    version_of(&server_bin())
}

/// The version of the server binary `bin`, read once per process and binary.
pub fn version_of(bin: &str) -> Result<ServerVersion, String> {
    static VERSIONS: Mutex<BTreeMap<String, Result<ServerVersion, String>>> =
        Mutex::new(BTreeMap::new());
    VERSIONS
        .lock()
        .entry(bin.to_owned())
        .or_insert_with(|| {
            let out = Command::new(bin).arg("--version").output().map_err(|e| {
                if e.kind() == std::io::ErrorKind::NotFound {
                    format!("{bin} not found: {INSTALL_HINT}")
                } else {
                    format!("run {bin} --version: {e}")
                }
            })?;
            let text = String::from_utf8_lossy(&out.stdout);
            ServerVersion::parse(&text)
                .ok_or_else(|| format!("{bin} --version printed no version: {text}"))
        })
        .clone()
}

/// The server and CLI binaries for TLS tests: [`server_bin`] and [`cli_bin`] when that
/// server was built with TLS, else `redis-server` and `redis-cli` on `PATH` when that one
/// was (said once on standard error: the TLS tests then check the library against that
/// server, never skipping). Panics when no server with TLS can be found.
pub fn tls_bins() -> (String, String) {
    static BINS: OnceLock<Result<(String, String), String>> = OnceLock::new();
    BINS.get_or_init(|| {
        let (server, cli) = (server_bin(), cli_bin());
        if has_tls(&server) {
            return Ok((server, cli));
        }
        let version = version_of(&server)?;
        let fallback = "redis-server";
        if has_tls(fallback) {
            eprintln!(
                "{version} ({server}) was built without TLS: the TLS tests run on {} ({fallback})",
                version_of(fallback)?
            );
            return Ok((fallback.into(), "redis-cli".into()));
        }
        Err(format!(
            "{version} ({server}) was built without TLS and no redis-server on PATH has it: \
             the TLS tests need one ({INSTALL_HINT})"
        ))
    })
    .clone()
    .unwrap_or_else(|e| panic!("{e}"))
}

/// Whether `bin` was built with TLS: a trial start with a TLS port and no certificate
/// fails on the missing certificate with TLS, and on the directive or the missing
/// connection type without (Redis 6.2 says "Bad directive", Valkey "Failed finding TLS
/// support").
fn has_tls(bin: &str) -> bool {
    let Ok(dir) = tempfile::tempdir() else {
        return false;
    };
    let log = dir.path().join("trial.log");
    let (Ok(out), Ok(err)) = (std::fs::File::create(&log), std::fs::File::create(&log)) else {
        return false;
    };
    let Ok(mut child) = Command::new(bin)
        .args(["--port", "0", "--save", "", "--appendonly", "no"])
        .args(["--tls-port", &crate::server::free_port().to_string()])
        .current_dir(dir.path())
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .spawn()
    else {
        return false;
    };
    // Either way it exits at once; a build that somehow starts is stopped.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while matches!(child.try_wait(), Ok(None)) && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    !text.contains("Bad directive") && !text.contains("TLS support")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_redis_and_valkey() {
        let r = ServerVersion::parse("Redis server v=6.2.14 sha=00000000:0 malloc=libc").unwrap();
        assert_eq!(r.version, (6, 2, 14));
        assert!(!r.at_least(7, 0));
        let v = ServerVersion::parse("Valkey server v=9.1.2 sha=00000000:0").unwrap();
        assert_eq!(v.product, "valkey");
        assert!(v.at_least(7, 0));
        assert_eq!(ServerVersion::parse("nonsense"), None);
    }
}
