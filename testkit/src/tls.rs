//! TLS for test servers: a throwaway CA with a server and a client certificate, made
//! fresh for each test, and a `redis-server` that listens on a TLS port with them.

use std::net::{IpAddr, Ipv4Addr};
use std::path::PathBuf;

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair, SanType,
};

use crate::server::{Reaper, RedisServer, RedisServerBuilder};

/// PEM material and the files the server reads it from.
pub struct Certs {
    /// The CA certificate that signed both others.
    pub ca_pem: Vec<u8>,
    /// The client certificate and its key, for mutual TLS.
    pub client_cert_pem: Vec<u8>,
    pub client_key_pem: Vec<u8>,
    dir: tempfile::TempDir,
    /// Removes `dir` if the process ends without dropping these (a `static` cluster's).
    reaper: Reaper,
}

impl Drop for Certs {
    fn drop(&mut self) {
        // The directory goes with `dir`.
        self.reaper.disarm();
    }
}

impl Certs {
    /// A new CA, a server certificate for 127.0.0.1 and `localhost`, and a client
    /// certificate, all signed by that CA.
    pub fn generate() -> Certs {
        Self::generate_named("redbaton test CA")
    }

    /// The same with a CA of another name: a client trusting one set rejects the other's
    /// server.
    pub fn generate_named(ca_name: &str) -> Certs {
        let ca_key = KeyPair::generate().expect("CA key");
        let mut ca = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.distinguished_name.push(DnType::CommonName, ca_name);
        let ca_cert = ca.self_signed(&ca_key).expect("self-signed CA");

        let leaf = |purpose: ExtendedKeyUsagePurpose, name: &str| {
            let key = KeyPair::generate().expect("leaf key");
            let mut params =
                CertificateParams::new(vec!["localhost".to_owned()]).expect("leaf params");
            params
                .subject_alt_names
                .push(SanType::IpAddress(IpAddr::V4(Ipv4Addr::LOCALHOST)));
            params.distinguished_name.push(DnType::CommonName, name);
            params.extended_key_usages = vec![purpose];
            let cert = params
                .signed_by(&key, &ca_cert, &ca_key)
                .expect("leaf signed by CA");
            (cert.pem().into_bytes(), key.serialize_pem().into_bytes())
        };
        let (server_cert, server_key) = leaf(ExtendedKeyUsagePurpose::ServerAuth, "redis");
        let (client_cert, client_key) = leaf(ExtendedKeyUsagePurpose::ClientAuth, "client");
        let dir = tempfile::Builder::new()
            .prefix("redbaton-tls-")
            .tempdir()
            .expect("temp dir for certificates");
        let ca_pem = ca_cert.pem().into_bytes();
        // The client pair too: servers of a TLS cluster present it on their own outgoing
        // connections (cluster bus, replication) to peers that verify clients.
        for (name, pem) in [
            ("ca.pem", &ca_pem),
            ("server.pem", &server_cert),
            ("server.key", &server_key),
            ("client.pem", &client_cert),
            ("client.key", &client_key),
        ] {
            std::fs::write(dir.path().join(name), pem).expect("write certificate");
        }
        let reaper = Reaper::for_dir(dir.path());
        Certs {
            ca_pem,
            client_cert_pem: client_cert,
            client_key_pem: client_key,
            dir,
            reaper,
        }
    }

    /// The path of one of the PEM files: `ca.pem`, `server.pem`, `server.key`,
    /// `client.pem`, `client.key`.
    pub fn file(&self, name: &str) -> String {
        self.dir.path().join(name).to_string_lossy().into_owned()
    }

    /// A builder for a server that listens for TLS on a port of its own (read it with
    /// `port_of("tls-port")`) and presents these certificates.
    pub fn server(&self) -> RedisServerBuilder {
        RedisServer::builder()
            .tls_capable()
            .free_port_for("tls-port")
            .config("tls-cert-file", &self.file("server.pem"))
            .config("tls-key-file", &self.file("server.key"))
            .config("tls-ca-cert-file", &self.file("ca.pem"))
    }
}

/// A `redis-server` with a TLS port (its plain port serves only the harness).
pub struct TlsServer {
    pub server: RedisServer,
    pub tls_port: u16,
}

impl TlsServer {
    /// Starts a server with `certs`; `verify_clients`: `tls-auth-clients yes`.
    pub fn start(certs: &Certs, verify_clients: bool) -> TlsServer {
        let server = certs
            .server()
            .config(
                "tls-auth-clients",
                if verify_clients { "yes" } else { "no" },
            )
            .start();
        let tls_port = server.port_of("tls-port").expect("a TLS port");
        TlsServer { server, tls_port }
    }

    /// The `rediss://` URL of the TLS port.
    pub fn url(&self) -> String {
        format!("rediss://127.0.0.1:{}/", self.tls_port)
    }
}

/// A server that also listens on a Unix socket.
pub struct UnixServer {
    pub server: RedisServer,
    socket: PathBuf,
    _dir: tempfile::TempDir,
}

impl UnixServer {
    pub fn start() -> UnixServer {
        let dir = tempfile::Builder::new()
            .prefix("redbaton-sock-")
            .tempdir()
            .expect("temp dir for the socket");
        let socket = dir.path().join("redis.sock");
        let server = RedisServer::builder()
            .config("unixsocket", &socket.to_string_lossy())
            .config("unixsocketperm", "700")
            .start();
        UnixServer {
            server,
            socket,
            _dir: dir,
        }
    }

    /// The `redis+unix://` URL of the socket.
    pub fn url(&self) -> String {
        format!("redis+unix://{}", self.socket.display())
    }
}
