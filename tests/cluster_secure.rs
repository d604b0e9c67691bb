//! Redis Cluster secured as in production: TLS only (`tls-cluster`, `tls-replication`,
//! client certificates) and an ACL user with only the permissions the library needs, the
//! `default` user off (see `redbaton_testkit::cluster`). The client is given one seed;
//! the masters it finds in the slot map get the seed's TLS settings and credentials.
//!
//! One cluster serves every test of this file (starting one takes seconds); no test stops
//! a node or changes what another relies on.

use std::collections::HashSet;
use std::sync::OnceLock;
use std::thread;
use std::time::{Duration, Instant};

use redbaton::Unlocked;
use redbaton_testkit::cluster::{APP_ACL, Cluster};
use redbaton_testkit::keys::Keys;
use redbaton_testkit::lock_builder;
use redbaton_testkit::logs;
use redbaton_testkit::tls::Certs;
use redbaton_testkit::{init_log, ms, secs};

const KEYS: Keys = Keys::DEFAULT;
const USER: &str = "locker";
const PASSWORD: &str = "locker-pw-7f3a";
/// Waiters are woken by the release long before this; a lease runs far longer.
const LIVENESS: Duration = Duration::from_secs(5);
const LONG_LEASE: Duration = Duration::from_secs(60);

fn cluster() -> &'static Cluster {
    static CLUSTER: OnceLock<Cluster> = OnceLock::new();
    CLUSTER.get_or_init(|| {
        Cluster::builder()
            .tls(Certs::generate())
            .acl_user(USER, PASSWORD)
            .start()
    })
}

/// A client of the cluster through its first node only, over TLS with the cluster's CA
/// and client certificate.
fn builder(seed: &str) -> redbaton::Builder {
    let certs = cluster().certs().expect("a TLS cluster");
    lock_builder!(
        cluster([seed]),
        tls_ca_cert(certs.ca_pem.clone()),
        tls_client_identity(certs.client_cert_pem.clone(), certs.client_key_pem.clone()),
        io_timeouts(ms(1000))
    )
}

fn first_seed_as(user: &str, password: &str) -> String {
    cluster().seed_urls_as(user, password).remove(0)
}

/// One name per master (the master that serves it, as a port), found by asking the
/// cluster where candidate names live.
fn one_name_per_master(prefix: &str) -> Vec<(String, u16)> {
    let c = cluster();
    let mut found: Vec<(String, u16)> = Vec::new();
    for i in 0.. {
        let name = format!("{prefix}-{i}");
        let port = c.master_of(&KEYS.lock_bytes(name.as_bytes())).port();
        if found.iter().all(|(_, p)| *p != port) {
            found.push((name, port));
        }
        if found.len() == 3 {
            break;
        }
    }
    found
}

fn exists(name: &str) -> bool {
    let key = KEYS.lock_bytes(name.as_bytes());
    redis::cmd("EXISTS")
        .arg(&key)
        .query(&mut cluster().master_of(&key).conn())
        .expect("EXISTS")
}

/// No log line so far holds `secret`; how many lines there were.
fn assert_never_logged(secret: &str) -> usize {
    let logged = logs::all();
    if let Some(line) = logged.iter().find(|l| l.contains(secret)) {
        panic!("a log line holds the password: {line}");
    }
    logged.len()
}

/// Over TLS, as the ACL user, seeded with one node: locks on every master are exclusive,
/// a waiter is woken by the release (its deadline is far shorter than the holder's lease),
/// and every connection of the library is on a TLS port, logged in as the user.
#[test]
fn smoke() {
    init_log();
    logs::capture();
    let c = cluster();
    let seed = first_seed_as(USER, PASSWORD);
    let holder = builder(&seed).lease(LONG_LEASE).build().expect("holder");
    let waiter = builder(&seed).lease(LONG_LEASE).build().expect("waiter");
    let names = one_name_per_master("secure");
    for (name, port) in &names {
        let g = holder.lock(name).expect("lock");
        assert!(g.fencing_token() > 0);
        assert!(exists(name), "{name}: on its master {port}");
        assert!(waiter.try_lock(name).unwrap_err().is_would_block());
        let w = waiter.clone();
        let n = name.clone();
        let t = thread::spawn(move || {
            let g = w
                .try_lock_for(&n, LIVENESS)
                .expect("the waiter gets the lock");
            let at = Instant::now();
            assert_eq!(g.unlock().expect("waiter unlock"), Unlocked::Released);
            at
        });
        // The waiter is waiting (subscribed on that master) before the release.
        thread::sleep(ms(300));
        let released = Instant::now();
        assert_eq!(g.unlock().expect("unlock"), Unlocked::Released);
        let got = t.join().expect("waiter thread");
        let latency = got.duration_since(released);
        eprintln!("{name} (master {port}): waiter woken {latency:?} after the release");
        assert!(!exists(name), "{name}: released");
    }
    let s = waiter.stats();
    eprintln!("waiter stats: {s:?}");
    assert_eq!(
        s.wakeups_lease, 0,
        "woken by the release, not a lease: {s:?}"
    );
    assert!(s.wakeups_event >= 3, "{s:?}");

    // Every connection of the library, on every node: on the node's TLS port, as the user.
    let mut masters_used = HashSet::new();
    for server in &c.servers {
        let tls_port = c.tls_port(server.port()).expect("a TLS port");
        for client in server.client_list() {
            let name = client.get("name").map(String::as_str).unwrap_or("");
            if !name.starts_with("redbaton") {
                continue; // replication links, the tests' own connections
            }
            let laddr = client.get("laddr").expect("laddr");
            assert!(
                laddr.ends_with(&format!(":{tls_port}")),
                "{name} connected to {laddr}, not the TLS port {tls_port}"
            );
            assert_eq!(client.get("user").map(String::as_str), Some(USER));
            masters_used.insert(server.port());
        }
    }
    assert_eq!(masters_used.len(), 3, "connections to every master");
    let lines = assert_never_logged(PASSWORD);
    eprintln!("{lines} log lines, none with the password");
}

/// A wrong password, an unknown user or no credentials at all are `is_auth()` errors,
/// never connection errors, and neither the error nor the log shows the password.
#[test]
fn wrong_credentials_are_auth_errors() {
    init_log();
    logs::capture();
    let wrong = "wrong-pw-91c2";
    for (what, seed) in [
        ("wrong password", first_seed_as(USER, wrong)),
        ("unknown user", first_seed_as("nobody", wrong)),
        ("no credentials", cluster().seed_urls_as("", "").remove(0)),
    ] {
        let seed = seed.replace("rediss://:@", "rediss://");
        let e = builder(&seed).build().expect_err(what);
        assert!(e.is_auth(), "{what}: {e:?}");
        assert!(!e.is_connection(), "{what}: {e:?}");
        let shown = format!("{e} {e:?} {:?}", builder(&seed));
        assert!(!shown.contains(wrong), "{what}: {shown}");
    }
    assert_never_logged(wrong);
}

/// The seed's certificate settings reach every node: without the client certificate, or
/// trusting another CA, the handshake fails as a TLS error.
#[test]
fn tls_settings_are_required() {
    init_log();
    let seed = first_seed_as(USER, PASSWORD);
    let certs = cluster().certs().expect("a TLS cluster");
    let e = lock_builder!(
        cluster([seed.as_str()]),
        tls_ca_cert(certs.ca_pem.clone()),
        connect_timeout(ms(1000))
    )
    .build()
    .expect_err("no client certificate");
    assert!(e.is_tls() || e.is_connection(), "{e:?}");
    let other = Certs::generate_named("another CA");
    let e = lock_builder!(
        cluster([seed.as_str()]),
        tls_ca_cert(other.ca_pem.clone()),
        tls_client_identity(certs.client_cert_pem.clone(), certs.client_key_pem.clone()),
        connect_timeout(ms(1000))
    )
    .build()
    .expect_err("an untrusted server");
    assert!(e.is_tls(), "{e:?}");
}

/// A password changed on one master only (ACLs are per node): calls for that master's
/// slots fail at once with `is_auth()` (no failover retries: credentials do not come back
/// by waiting), while the other masters keep working.
#[test]
fn a_password_changed_on_one_master_fails_there_as_auth() {
    init_log();
    let c = cluster();
    let user = "rotating";
    let rules: Vec<&str> = APP_ACL.split_whitespace().collect();
    for server in &c.servers {
        redis::cmd("ACL")
            .arg("SETUSER")
            .arg(user)
            .arg("on")
            .arg(">rotating-pw-1")
            .arg(&rules)
            .query::<()>(&mut server.conn())
            .expect("ACL SETUSER");
    }
    let client = builder(&first_seed_as(user, "rotating-pw-1"))
        .build()
        .expect("build");
    let names = one_name_per_master("rotate");
    for (name, _) in &names {
        client.lock(name).expect("lock").unlock().expect("unlock");
    }
    let (changed_name, changed_port) = &names[1];
    let mut admin = c.server(*changed_port).conn();
    redis::cmd("ACL")
        .arg("SETUSER")
        .arg(user)
        .arg("resetpass")
        .arg(">rotating-pw-2")
        .query::<()>(&mut admin)
        .expect("change the password");
    redis::cmd("CLIENT")
        .arg("KILL")
        .arg("USER")
        .arg(user)
        .query::<i64>(&mut admin)
        .expect("drop the user's connections");
    let started = Instant::now();
    let e = client
        .try_lock_for(changed_name, secs(20))
        .expect_err("the password changed there");
    assert!(e.is_auth(), "{e:?}");
    let took = started.elapsed();
    assert!(took < LIVENESS, "an auth error is not retried: {took:?}");
    for (name, port) in &names {
        if port != changed_port {
            client
                .lock(name)
                .expect("other masters")
                .unlock()
                .expect("unlock");
        }
    }
}
