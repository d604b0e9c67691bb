//! The link to one node under faults the server side causes: connections killed between
//! every kind of call, a password changed or required while the client runs, an ACL that
//! lets the scripts run but not be loaded again, a TLS server restarted or hung, and a
//! host name that does not resolve.
//!
//! * A small pool survives many killed connections: every slot a dead connection held is
//!   given back, so the calls after the faults still get one.
//! * A password changed on the server fails the next connection as an authentication
//!   error (not a connection error, never with the password in its text), and neither
//!   the renewals nor the subscriber hammer the server with reconnects meanwhile.
//! * A password required of a client that has none is an authentication error too, and
//!   the connection it was refused on is never lent (the server closes it at the first
//!   long command).
//! * A user allowed `EVALSHA` but not `SCRIPT LOAD` meets a typed error once the server
//!   lost its scripts (`SCRIPT FLUSH`): no hang, no lock left behind, a held lock
//!   reported lost.
//! * Over TLS, reconnects after a restart work and still check the certificate, and a
//!   hung server does not hold a call past its deadline.
//! * A host name that does not resolve is a connection error.
//!
//! Every server is a real `redis-server`.

use std::thread;
use std::time::Instant;

use redbaton::LockClient;
use redbaton_testkit::keys::Keys;
use redbaton_testkit::server::RedisServer;
use redbaton_testkit::tls::{Certs, TlsServer};
use redbaton_testkit::wait::wait_for;
use redbaton_testkit::{exists, init_log, lock_builder, lock_client, ms, secs, test_server};

const PREFIX: &str = "lf:";
const KEYS: Keys = Keys::new(PREFIX);

/// Kills every connection the library opened to `srv` (its pool's and its subscriber's).
fn kill_library_connections(srv: &RedisServer) -> usize {
    kill_library_connections_on(srv, &mut srv.conn())
}

/// [`kill_library_connections`], sent on `conn` (one opened while no password was needed).
fn kill_library_connections_on(srv: &RedisServer, conn: &mut redis::Connection) -> usize {
    let mut killed = 0;
    for client in srv.client_list() {
        if client
            .get("name")
            .is_some_and(|n| n.starts_with("redbaton"))
        {
            let id = &client["id"];
            let n: i64 = redis::cmd("CLIENT")
                .arg("KILL")
                .arg("ID")
                .arg(id)
                .query(conn)
                .expect("CLIENT KILL");
            killed += n as usize;
        }
    }
    killed
}

/// A server with the ACL user `locker` (`password`, `rules`), and its URL as that user.
fn locker_server(password: &str, rules: &str) -> (RedisServer, String) {
    let srv = RedisServer::builder()
        .acl_user("locker", password, rules)
        .start();
    let url = srv.url_as("locker", password);
    (srv, url)
}

#[test]
fn smoke() {
    let srv = test_server();
    let c = lock_client!(node(srv.url()), key_prefix(PREFIX), pool_size(2));
    let g = c.try_lock("smoke").expect("lock");
    assert!(kill_library_connections(&srv) >= 1);
    assert!(g.unlock().expect("unlock after a kill").was_held());
    assert!(!exists(&mut srv.conn(), KEYS.lock("smoke")));
}

// --- connections killed under each kind of call ------------------------------------------

/// A pool of two, its connections killed before each acquire, extend, inspect and
/// release, many times over: each call still succeeds (a killed idle connection is
/// found out and replaced), and so does a call after all of them. A slot lost on any of
/// these paths would leave the pool exhausted after a few rounds.
#[test]
fn a_small_pool_outlives_many_killed_connections() {
    init_log();
    let srv = test_server();
    let c = lock_client!(
        node(srv.url()),
        key_prefix(PREFIX),
        pool_size(2),
        connect_timeout(secs(2)),
        lease(secs(30))
    );
    for round in 0..12 {
        kill_library_connections(&srv);
        let g = c
            .try_lock("killed")
            .unwrap_or_else(|e| panic!("round {round}: acquire: {e:?}"));
        kill_library_connections(&srv);
        g.extend(secs(30))
            .unwrap_or_else(|e| panic!("round {round}: extend: {e:?}"));
        kill_library_connections(&srv);
        c.inspect("killed")
            .unwrap_or_else(|e| panic!("round {round}: inspect: {e:?}"));
        kill_library_connections(&srv);
        let how = g
            .unlock()
            .unwrap_or_else(|e| panic!("round {round}: release: {e:?}"));
        assert!(how.was_held(), "round {round}: {how:?}");
    }
    // Two at once: both slots are free.
    let a = c.try_lock("after-a").expect("first after the faults");
    let b = c.try_lock("after-b").expect("second after the faults");
    drop((a, b));
    assert!(!exists(&mut srv.conn(), KEYS.lock("killed")));
}

// --- a password changed while the client runs --------------------------------------------

/// The user's password changes on the server and its connections are killed: the next
/// call cannot connect, and says so as an authentication error that does not contain
/// either password. Meanwhile the subscriber, whose connection was killed too, does not
/// reconnect in a tight loop. With the old password back, the client locks again.
#[test]
fn a_password_changed_on_the_server_is_an_auth_error_without_a_reconnect_storm() {
    init_log();
    let (srv, url) = locker_server("first-pw", "~* &* +@all");
    let c = lock_client!(node(&url), key_prefix(PREFIX), connect_timeout(secs(2)));
    let waiter = lock_client!(node(&url), key_prefix(PREFIX), connect_timeout(secs(2)));
    let g = c.try_lock("pw").expect("lock");

    // A waiter is subscribed when the password changes: its subscriber, and the pool it
    // tries on, meet the new password too.
    let waiting = thread::spawn(move || waiter.try_lock_for("pw", secs(3)).map(drop));
    thread::sleep(ms(300));
    let mut admin = srv.conn();
    redis::cmd("ACL")
        .arg("SETUSER")
        .arg("locker")
        .arg("resetpass")
        .arg(">second-pw")
        .query::<()>(&mut admin)
        .expect("change the password");
    kill_library_connections(&srv);
    let connections = |admin: &mut redis::Connection| -> u64 {
        let info: String = redis::cmd("INFO").arg("stats").query(admin).unwrap();
        info.lines()
            .find_map(|l| l.strip_prefix("total_connections_received:"))
            .and_then(|v| v.trim().parse().ok())
            .expect("total_connections_received")
    };
    let before = connections(&mut admin);

    let e = c
        .try_lock("pw-next")
        .expect_err("the old password no longer works");
    assert!(e.is_auth(), "{e:?}");
    assert!(!e.is_connection(), "{e:?}");
    let text = format!("{e} {e:?} {:?}", std::error::Error::source(&e));
    assert!(
        !text.contains("first-pw") && !text.contains("second-pw"),
        "{text}"
    );
    let e = g
        .extend(secs(30))
        .expect_err("extend cannot connect either");
    assert!(e.is_auth() || e.is_lost(), "{e:?}");

    let e = waiting
        .join()
        .expect("waiter")
        .expect_err("the waiter cannot lock");
    assert!(e.is_auth() || e.is_timeout(), "{e:?}");
    let attempts = connections(&mut admin) - before;
    // Three calls, the wait's attempts and the renewals of the hold, each a connect or
    // two, spaced out: a few dozen at most, not thousands.
    assert!(attempts <= 60, "{attempts} connections in 2 s");

    redis::cmd("ACL")
        .arg("SETUSER")
        .arg("locker")
        .arg("resetpass")
        .arg(">first-pw")
        .query::<()>(&mut admin)
        .expect("password back");
    drop(g);
    drop(c.try_lock("pw-back").expect("locks again"));
}

/// Sets the default user's password (`""`: none) on `admin`, a connection opened before
/// any was required.
fn set_requirepass(admin: &mut redis::Connection, password: &str) {
    let () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("requirepass")
        .arg(password)
        .query(admin)
        .expect("CONFIG SET requirepass");
}

/// A password is required while the client has none: a new connection is refused every
/// command (`NOAUTH`), and the call fails as an authentication error. Lent out, such a
/// connection would answer a call's long command with a protocol error (`unauthenticated
/// multibulk length`) and be closed by the server, then go back to the pool as if
/// healthy: once the password is dropped again, a count down (sent once) would meet it
/// closed and fail with an unknown outcome though it never reached Redis.
#[test]
fn a_password_required_later_is_an_auth_error_and_spoils_no_connection() {
    init_log();
    let srv = test_server();
    let mut admin = srv.conn();
    let c = lock_client!(
        node(srv.url()),
        key_prefix(PREFIX),
        connect_timeout(secs(2))
    );
    let latch = c.latch("noauth", 2);
    assert_eq!(latch.count().expect("made"), 2);

    set_requirepass(&mut admin, "later-pw");
    assert!(kill_library_connections_on(&srv, &mut admin) >= 1);
    let e = c.try_lock("noauth").expect_err("a password is required");
    set_requirepass(&mut admin, "");
    assert!(e.is_auth() && !e.is_connection(), "{e:?}");
    assert!(!format!("{e} {e:?}").contains("later-pw"), "{e:?}");

    assert_eq!(latch.count_down().expect("counted down"), 1);
    assert_eq!(latch.count().expect("read"), 1);
}

// --- an ACL that runs the scripts but cannot load them -----------------------------------

/// `SCRIPT` (its `LOAD`) is denied, `EVALSHA` is not: while the server has the scripts, locking
/// works. After `SCRIPT FLUSH` an acquire meets `NOSCRIPT`, cannot load, and fails with a
/// typed error naming the refusal, promptly, leaving no lock behind; a lock held across
/// the flush cannot be renewed, is reported lost once its lease ran out (not held on to
/// by a guard that believes it), and its release is the same typed refusal.
#[test]
fn a_user_that_cannot_load_scripts_gets_a_typed_error_after_a_flush() {
    init_log();
    let (srv, url) = locker_server("pw", "~* &* +@all -script -eval");
    // The scripts are loaded by an administrator while the user cannot load them.
    let admin_client = lock_client!(node(srv.url()), key_prefix(PREFIX));
    drop(admin_client.try_lock("acl").expect("admin locks"));
    let c = lock_client!(node(&url), key_prefix(PREFIX), lease(ms(600)));
    let held = c.try_lock("held").expect("the scripts are there");

    let _: () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query(&mut srv.conn())
        .unwrap();
    let refused = |e: &redbaton::Error| {
        let text = format!("{e} {:?}", std::error::Error::source(e)).to_lowercase();
        !e.is_connection() && !e.is_timeout() && text.contains("perm")
    };
    let started = Instant::now();
    let e = c
        .try_lock_for("acl", secs(3))
        .expect_err("the script cannot be loaded");
    assert!(started.elapsed() < secs(10), "{:?}", started.elapsed());
    assert!(refused(&e), "{e:?}");
    assert!(!exists(&mut srv.conn(), KEYS.lock("acl")));

    wait_for(secs(5), "the held lock reported lost", || {
        held.check().is_err_and(|e| e.is_lost())
    });
    // Its key expires in Redis after the guard stopped believing in it.
    wait_for(secs(5), "the held lock's key expired", || {
        !exists(&mut srv.conn(), KEYS.lock("held"))
    });
    let e = held.unlock().expect_err("the release cannot be loaded");
    assert!(refused(&e), "{e:?}");
}

// --- addresses that cannot be reached ----------------------------------------------------

/// A host name that does not resolve fails the build as a connection error, not an
/// authentication or configuration error, within a few seconds.
#[test]
fn a_host_that_does_not_resolve_is_a_connection_error() {
    let started = Instant::now();
    let url = "redis://user:dns-pw@no-such-host.invalid:6379/";
    let e = lock_builder!(node(url), connect_timeout(ms(500)))
        .build()
        .expect_err("no such host");
    assert!(e.is_connection() && !e.is_auth(), "{e:?}");
    assert!(!format!("{e} {e:?}").contains("dns-pw"), "{e:?}");
    assert!(started.elapsed() < secs(20), "{:?}", started.elapsed());
}

// --- a TLS server restarted ----------------------------------------------------------------

/// A client of a TLS server locks across the server's restart (its pooled connections
/// die with the old process and new handshakes succeed); when the server comes back with
/// a certificate from a CA the client does not trust, the new handshakes fail as TLS
/// errors: the reconnect does not skip the check.
/// `waiter` waits for `name`, which `holder` holds, and is woken by the release's message
/// (its lease and re-check interval are far longer than the wait).
fn woken_by_a_message(holder: &LockClient, waiter: &LockClient, name: &str) {
    let g = holder.try_lock(name).expect("holder locks");
    let before = waiter.stats().wakeups_event;
    thread::scope(|s| {
        let t = s.spawn(|| waiter.try_lock_for(name, secs(10)).map(drop));
        thread::sleep(ms(300));
        assert!(g.unlock().expect("unlock").was_held());
        t.join().expect("waiter").expect("woken by the release");
    });
    assert!(
        waiter.stats().wakeups_event > before,
        "{:?}",
        waiter.stats()
    );
}

/// Clients of a TLS server lock, and wait, across the server's restart: the pooled
/// connections and the subscriber's die with the old process, and new handshakes
/// succeed. When the server comes back with a certificate from a CA the clients do not
/// trust, the new handshakes fail as TLS errors: a reconnect does not skip the check.
#[test]
fn a_restarted_tls_server_is_reconnected_to_and_still_checked() {
    init_log();
    let certs = Certs::generate();
    let tls = TlsServer::start(&certs, false);
    let client = || {
        lock_client!(
            node(tls.url()),
            key_prefix(PREFIX),
            tls_ca_cert(certs.ca_pem.clone()),
            connect_timeout(secs(2)),
            patient()
        )
    };
    let (holder, waiter) = (client(), client());
    woken_by_a_message(&holder, &waiter, "tls");

    tls.server.restart();
    woken_by_a_message(&holder, &waiter, "tls");

    // The server's identity replaced by one signed by another CA.
    let other = Certs::generate_named("some other CA");
    for name in ["server.pem", "server.key"] {
        std::fs::copy(other.file(name), certs.file(name)).expect("replace the certificate");
    }
    tls.server.restart();
    let e = holder.try_lock("tls").expect_err("an untrusted server");
    assert!(e.is_tls() && !e.is_auth(), "{e:?}");
    assert!(!exists(&mut tls.server.conn(), KEYS.lock("tls")));
}

/// A TLS server that accepts connections but does not answer (stopped): a call with a
/// deadline that must open a connection keeps its deadline, the handshake included,
/// though every network timeout of the client is 20 s.
#[test]
fn a_call_that_must_connect_to_a_hung_tls_server_keeps_its_deadline() {
    init_log();
    let certs = Certs::generate();
    let tls = TlsServer::start(&certs, false);
    let c = lock_client!(
        node(tls.url()),
        key_prefix(PREFIX),
        tls_ca_cert(certs.ca_pem.clone()),
        io_timeouts(secs(20))
    );
    drop(c.try_lock("hung-tls").expect("lock over TLS"));
    kill_library_connections(&tls.server);
    tls.server.pause();
    let started = Instant::now();
    let result = c.try_lock_for("hung-tls", ms(300)).map(drop);
    let took = started.elapsed();
    tls.server.resume();
    assert!(
        result.is_err() && took < secs(10),
        "{result:?} after {took:?}"
    );
}
