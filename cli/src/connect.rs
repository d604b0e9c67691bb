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
    b = if !c.cluster.is_empty() {
        b.cluster(c.cluster.clone())
    } else if let [master, sentinels] = c.sentinel.as_slice() {
        b.sentinel(
            master.clone(),
            sentinels.split(',').filter(|u| !u.is_empty()),
        )
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
