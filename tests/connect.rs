//! Reaching the Redis people run: TLS (a private CA, mutual TLS), ACL users and
//! passwords, Unix sockets. Every server here is a real `redis-server` started by the
//! test support, with certificates it generates.

use std::sync::Arc;
use std::thread;
use std::time::Duration;

use redbaton::LockClient;
use redbaton_testkit::server::RedisServer;
use redbaton_testkit::tls::{Certs, TlsServer, UnixServer};
use redbaton_testkit::{init_log, ms};
use redbaton_testkit::{lock_builder, lock_client};

fn tls_client(url: &str, certs: &Certs) -> redbaton::Result<LockClient> {
    lock_builder!(
        node(url),
        tls_ca_cert(certs.ca_pem.clone()),
        connect_timeout(ms(2000))
    )
    .build()
}

/// Fresh certificates and a TLS server using them (`mutual`: it asks for a client
/// certificate).
fn tls_server(mutual: bool) -> (Certs, TlsServer) {
    init_log();
    let certs = Certs::generate();
    let tls = TlsServer::start(&certs, mutual);
    (certs, tls)
}

#[test]
fn smoke() {
    let (certs, tls) = tls_server(false);
    let client = tls_client(&tls.url(), &certs).expect("build over TLS");
    let guard = client.lock("smoke").expect("lock over TLS");
    assert!(guard.fencing_token() > 0);
    assert!(guard.unlock().expect("unlock").was_held());
}

#[test]
fn a_waiter_is_woken_by_notifications_over_tls() {
    let (certs, tls) = tls_server(false);
    let holder = tls_client(&tls.url(), &certs).expect("holder");
    let waiter = Arc::new(tls_client(&tls.url(), &certs).expect("waiter"));
    let guard = holder.lock("k").expect("lock");
    let w = waiter.clone();
    let t = thread::spawn(move || {
        let g = w
            .try_lock_for("k", Duration::from_secs(20))
            .expect("waiter gets it");
        drop(g);
    });
    // Let the waiter subscribe and sleep, then release: the 30 s lease is far away, so
    // only the release's event can wake it this soon.
    thread::sleep(ms(300));
    guard.unlock().expect("unlock");
    t.join().expect("waiter thread");
    let s = waiter.stats();
    assert!(s.wakeups_event >= 1, "{s:?}");
    assert_eq!(s.wakeups_lease, 0, "{s:?}");
    // Everything the library opened went to the TLS port.
    let ours: Vec<_> = tls
        .server
        .client_list()
        .into_iter()
        .filter(|c| {
            c.get("laddr")
                .is_some_and(|a| !a.ends_with(&format!(":{}", tls.server.port())))
        })
        .collect();
    assert!(
        ours.iter()
            .any(|c| c.get("flags").is_some_and(|f| f.contains('P'))),
        "the subscriber connection is on the TLS port: {ours:?}"
    );
}

#[test]
fn a_server_signed_by_another_ca_is_rejected() {
    init_log();
    let certs = Certs::generate();
    let other = Certs::generate_named("some other CA");
    let tls = TlsServer::start(&certs, false);
    let e = tls_client(&tls.url(), &other).expect_err("untrusted server");
    eprintln!("{e} / {e:?}");
    assert!(e.is_tls(), "{e:?}");
    assert!(!e.is_auth(), "{e:?}");
}

#[test]
fn mutual_tls_works_with_a_client_identity_and_fails_clearly_without() {
    let (certs, tls) = tls_server(true);
    let client = lock_client!(
        node(tls.url()),
        tls_ca_cert(certs.ca_pem.clone()),
        tls_client_identity(certs.client_cert_pem.clone(), certs.client_key_pem.clone())
    );
    client.with_lock("m", || ()).expect("lock with mTLS");
    let e = tls_client(&tls.url(), &certs).expect_err("no client certificate");
    eprintln!("{e} / {e:?}");
    assert!(e.is_tls(), "{e:?}");
}

#[test]
fn a_garbage_certificate_is_invalid_configuration() {
    init_log();
    let e = LockClient::builder()
        .node("rediss://127.0.0.1:1/")
        .tls_ca_cert(b"not a certificate".to_vec())
        .build()
        .expect_err("bad PEM");
    assert!(e.is_invalid_input(), "{e:?}");
    assert!(e.to_string().contains("not a PEM certificate"), "{e}");
}

#[test]
fn acl_user_with_the_right_password_locks() {
    init_log();
    let server = RedisServer::builder()
        .acl_user(
            "locker",
            "s3cret-pw",
            "~* &* +@all -@dangerous +config|get +config|set",
        )
        .start();
    let url = server.url_as("locker", "s3cret-pw");
    let client = lock_client!(node(&url));
    client.with_lock("acl", || ()).expect("lock as ACL user");
    let debug = format!("{client:?}");
    assert!(!debug.contains("s3cret"), "{debug}");
    let builder = format!("{:?}", lock_builder!(node(&url)));
    assert!(!builder.contains("s3cret"), "{builder}");
}

#[test]
fn a_wrong_password_is_an_auth_error_that_says_no_secret() {
    init_log();
    let server = RedisServer::builder().password("right-pw").start();
    let url = format!("redis://:wrong-pw@127.0.0.1:{}/", server.port());
    let e = lock_builder!(node(&url))
        .build()
        .expect_err("wrong password");
    assert!(e.is_auth(), "{e:?}");
    assert!(!e.is_connection(), "{e:?}");
    let text = format!("{e} {e:?} {:?}", std::error::Error::source(&e));
    assert!(!text.contains("wrong-pw"), "{text}");

    let ok = format!("redis://:right-pw@127.0.0.1:{}/", server.port());
    let client = lock_client!(node(&ok));
    client.with_lock("pw", || ()).expect("lock");
}

#[test]
fn an_unreachable_server_is_not_an_auth_error() {
    let e = LockClient::builder()
        .node("redis://user:pw@127.0.0.1:1/")
        .connect_timeout(ms(500))
        .build()
        .expect_err("nothing listens on port 1");
    assert!(e.is_connection() && !e.is_auth(), "{e:?}");
}

#[test]
fn unix_socket() {
    init_log();
    let server = UnixServer::start();
    let client = lock_client!(node(server.url()));
    let holder = client.lock("u").expect("lock");
    let c2 = lock_client!(node(server.url()));
    let t = thread::spawn(move || c2.try_lock_for("u", Duration::from_secs(20)).map(drop));
    thread::sleep(ms(200));
    holder.unlock().expect("unlock");
    t.join().expect("thread").expect("waiter over the socket");
}
