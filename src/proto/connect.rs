//! How a node URL becomes a `redis::Client`: TLS (`rediss://`, a private CA, a client
//! identity), credentials in the URL, Unix sockets. One code path for the command pool,
//! the subscriber and the builder's validation.

use crate::config::Tls;
use crate::error::{Error, Result};

/// A client for `url`; `label` names the node in errors, since the URL may hold a password.
pub(crate) fn open_client(label: &str, url: &str, tls: &Tls) -> Result<redis::Client> {
    let wants_tls = is_tls_url(url);
    if wants_tls && !cfg!(feature = "tls") {
        return Err(Error::InvalidConfig(format!(
            "{label}: rediss:// needs redbaton's `tls` feature"
        )));
    }
    let info = connection_info(label, url)?;
    client_of(label, info, tls)
}

/// A client for the server at `host:port` with everything else (credentials, database,
/// TLS) as `url` says: a Redis Cluster master found through a seed URL.
pub(crate) fn open_client_at(
    label: &str,
    url: &str,
    tls: &Tls,
    host: &str,
    port: u16,
) -> Result<redis::Client> {
    let info = connection_info(label, url)?;
    let addr = match info.addr() {
        redis::ConnectionAddr::TcpTls {
            insecure,
            tls_params,
            ..
        } => redis::ConnectionAddr::TcpTls {
            host: host.to_owned(),
            port,
            insecure: *insecure,
            tls_params: tls_params.clone(),
        },
        _ => redis::ConnectionAddr::Tcp(host.to_owned(), port),
    };
    client_of(label, info.set_addr(addr), tls)
}

/// A client for the server at `host:port`, which another server named (a Sentinel-managed
/// master): TLS when `secure` (with `tls`'s certificates), the credentials of `auth`
/// (user, password), database `db`.
pub(crate) fn open_client_to(
    label: &str,
    (host, port): (&str, u16),
    secure: bool,
    auth: Option<(Option<&str>, &str)>,
    db: i64,
    tls: &Tls,
) -> Result<redis::Client> {
    let addr = if secure {
        redis::ConnectionAddr::TcpTls {
            host: host.to_owned(),
            port,
            insecure: false,
            tls_params: None,
        }
    } else {
        redis::ConnectionAddr::Tcp(host.to_owned(), port)
    };
    let mut settings = redis::RedisConnectionInfo::default().set_db(db);
    if let Some((user, password)) = auth {
        if let Some(user) = user {
            settings = settings.set_username(user);
        }
        settings = settings.set_password(password);
    }
    let info = redis::IntoConnectionInfo::into_connection_info(addr)
        .map_err(|_| Error::InvalidConfig(format!("{label}: unusable address")))?
        .set_redis_settings(settings);
    client_of(label, info, tls)
}

/// How a URL reaches its server, the address aside: TLS or not, user, password, database.
/// Never printed (it holds the password).
#[derive(PartialEq, Eq)]
pub(crate) struct Access {
    tls: bool,
    user: Option<String>,
    password: Option<String>,
    pub db: i64,
}

/// The [`Access`] of `url`; `label` names it in errors.
pub(crate) fn access(label: &str, url: &str) -> Result<Access> {
    let info = connection_info(label, url)?;
    let settings = info.redis_settings();
    Ok(Access {
        tls: matches!(info.addr(), redis::ConnectionAddr::TcpTls { .. }),
        user: settings.username().map(str::to_owned),
        password: settings.password().map(str::to_owned),
        db: settings.db(),
    })
}

fn connection_info(label: &str, url: &str) -> Result<redis::ConnectionInfo> {
    redis::IntoConnectionInfo::into_connection_info(url)
        .map_err(|_| Error::InvalidConfig(format!("{label}: unparsable redis url")))
}

fn client_of(label: &str, info: redis::ConnectionInfo, tls: &Tls) -> Result<redis::Client> {
    let wants_tls = matches!(info.addr(), redis::ConnectionAddr::TcpTls { .. });
    // The server's certificate is always checked: a URL asking not to is a configuration
    // error now, not a connection error at the first connect.
    if matches!(
        info.addr(),
        redis::ConnectionAddr::TcpTls { insecure: true, .. }
    ) {
        return Err(Error::InvalidConfig(format!(
            "{label}: `#insecure` (no certificate check) is not supported; give the CA with tls_ca_cert"
        )));
    }
    let bad_url = || Error::InvalidConfig(format!("{label}: unparsable redis url"));
    // No `CLIENT SETINFO` pipeline at connect: against a hung server each of its replies
    // would wait a full timeout.
    let settings = info.redis_settings().clone().set_skip_set_lib_name();
    let info = info.set_redis_settings(settings);
    if !wants_tls {
        if tls.ca.is_some() || tls.identity.is_some() {
            log::debug!("{label}: not a rediss:// url, TLS settings unused");
        }
        return redis::Client::open(info).map_err(|_| bad_url());
    }
    tls_client(label, info, tls)
}

/// Whether `url` asks for TLS.
pub(crate) fn is_tls_url(url: &str) -> bool {
    let scheme = url.split("://").next().unwrap_or("");
    scheme.eq_ignore_ascii_case("rediss") || scheme.eq_ignore_ascii_case("valkeys")
}

#[cfg(feature = "tls")]
fn tls_client(label: &str, info: redis::ConnectionInfo, tls: &Tls) -> Result<redis::Client> {
    // rustls needs a process-wide crypto provider; keep one the application installed.
    let _ = rustls::crypto::ring::default_provider().install_default();
    if tls.ca.is_none() && tls.identity.is_none() {
        // The system's trust store.
        return redis::Client::open(info)
            .map_err(|_| Error::InvalidConfig(format!("{label}: unparsable redis url")));
    }
    // Checked here, so that a file that is not PEM is a configuration error at build
    // time rather than a handshake failure later.
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let certs_in = |pem: &[u8]| {
        CertificateDer::pem_slice_iter(pem)
            .collect::<std::result::Result<Vec<_>, _>>()
            .is_ok_and(|c| !c.is_empty())
    };
    let bad = |what: &str| {
        Err(Error::InvalidConfig(format!(
            "{label}: {what} is not a PEM certificate"
        )))
    };
    if tls.ca.as_deref().is_some_and(|ca| !certs_in(ca)) {
        return bad("the TLS CA");
    }
    if let Some((cert, key)) = &tls.identity {
        if !certs_in(cert) {
            return bad("the TLS client certificate");
        }
        if PrivateKeyDer::from_pem_slice(key).is_err() {
            return Err(Error::InvalidConfig(format!(
                "{label}: the TLS client key is not a PEM private key"
            )));
        }
    }
    let certificates = redis::TlsCertificates {
        client_tls: tls
            .identity
            .as_ref()
            .map(|(cert, key)| redis::ClientTlsConfig {
                client_cert: cert.clone(),
                client_key: key.clone(),
            }),
        root_cert: tls.ca.clone(),
    };
    redis::Client::build_with_tls(info, certificates).map_err(|e| {
        Error::InvalidConfig(format!(
            "{label}: unusable TLS certificate or key: {}",
            e.detail().unwrap_or("cannot be parsed")
        ))
    })
}

#[cfg(not(feature = "tls"))]
fn tls_client(label: &str, _: redis::ConnectionInfo, _: &Tls) -> Result<redis::Client> {
    Err(Error::InvalidConfig(format!(
        "{label}: rediss:// needs redbaton's `tls` feature"
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tls_urls() {
        assert!(is_tls_url("rediss://h:6380/"));
        assert!(is_tls_url("REDISS://h/"));
        assert!(!is_tls_url("redis://h/"));
        assert!(!is_tls_url("redis+unix:///tmp/r.sock"));
    }

    #[test]
    fn without_the_feature_rediss_says_so() {
        let e = open_client("node 0", "rediss://127.0.0.1:6380/", &Tls::default());
        if cfg!(feature = "tls") {
            assert!(e.is_ok(), "{e:?}");
        } else {
            let msg = e.unwrap_err().to_string();
            assert!(msg.contains("`tls` feature"), "{msg}");
        }
    }

    #[test]
    fn a_bad_url_names_the_node_not_the_password() {
        let e = open_client("node 3", "redis://u:s3cret@[bad/", &Tls::default()).unwrap_err();
        let msg = format!("{e} {e:?}");
        assert!(msg.contains("node 3"), "{msg}");
        assert!(!msg.contains("s3cret"), "{msg}");
    }
}
