//! The client the command talks through, from the connection options.

use std::time::Duration;

use redbaton::LockClient;

use crate::args::Connection;
use crate::failure::Failure;

pub fn connect(c: &Connection) -> Result<LockClient, Failure> {
    let timeout = Duration::from_secs(c.timeout);
    let mut b = LockClient::builder()
        .key_prefix(c.prefix.clone())
        // An operator's tool: no subscriber threads, and never a `CONFIG SET`.
        .wakeup(redbaton::Wakeup::Polling(Duration::from_secs(1)))
        .configure_notifications(false)
        // It takes no lock; a lease longer than the read timeout lets any timeout be set.
        .lease(timeout.saturating_mul(2).max(Duration::from_secs(30)))
        .connect_timeout(timeout)
        .read_timeout(timeout)
        .write_timeout(timeout);
    let urls: Vec<String> = if !c.cluster.is_empty() {
        c.cluster.clone()
    } else if let [_, sentinels] = c.sentinel.as_slice() {
        let urls = sentinels.split(',').filter(|u| !u.is_empty());
        urls.map(str::to_owned).collect()
    } else if c.url.trim().is_empty() {
        // Most likely `$REDIS_URL` set to nothing: "unparsable redis url" would name an
        // address the operator never typed.
        return Err(Failure::Usage(
            "the Redis URL is empty: give --url, or set $REDIS_URL (unset, it defaults to \
             redis://127.0.0.1:6379/)"
                .to_owned(),
        ));
    } else {
        vec![c.url.clone()]
    };
    // TLS options only apply to TLS URLs: given with plain ones, they would be ignored
    // and the command would talk in clear text to a server meant to be reached over TLS.
    let tls_options = c.tls_ca.is_some() || c.tls_cert.is_some();
    if tls_options && !urls.iter().any(|u| is_tls(u)) {
        return Err(Failure::Usage(
            "--tls-ca, --tls-cert and --tls-key apply to TLS connections only: write the URL \
             as rediss://"
                .to_owned(),
        ));
    }
    b = if !c.cluster.is_empty() {
        b.cluster(urls)
    } else if let [master, _] = c.sentinel.as_slice() {
        // Sentinels reached over TLS serve a deployment whose master speaks TLS too.
        let master_tls = !urls.is_empty() && urls.iter().all(|u| is_tls(u));
        let b = b
            .sentinel(master.clone(), urls)
            .sentinel_master_tls(master_tls);
        match &c.master_password {
            Some(password) => b.sentinel_master_auth(c.master_user.as_deref(), password),
            None => b,
        }
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

/// Whether `url` connects over TLS (`rediss://`, or its `valkeys://` spelling).
fn is_tls(url: &str) -> bool {
    let scheme = url
        .split_once("://")
        .map_or("", |(scheme, _)| scheme.trim());
    scheme.eq_ignore_ascii_case("rediss") || scheme.eq_ignore_ascii_case("valkeys")
}
