//! Which Redis binaries the harness runs, and what that server knows.
//!
//! `REDBATON_REDIS_SERVER` and `REDBATON_REDIS_CLI` name the server and CLI binaries
//! (default: `redis-server` and `redis-cli` on `PATH`), so the same suite runs on Redis
//! 6.2, Redis 7 or Valkey by pointing the variables at another build. The server's version
//! is read once, from `--version`, and the harness writes only the `redis.conf` directives
//! that version knows.

use std::process::Command;
use std::sync::OnceLock;

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

/// The server binary's version, read once per process. `Err` says why it could not be read
/// (not found, with [`INSTALL_HINT`]).
pub fn server_version() -> Result<&'static ServerVersion, String> {
    static VERSION: OnceLock<Result<ServerVersion, String>> = OnceLock::new();
    VERSION
        .get_or_init(|| {
            let bin = server_bin();
            let out = Command::new(&bin).arg("--version").output().map_err(|e| {
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
        .as_ref()
        .map_err(Clone::clone)
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
