//! The `redbaton` binary as a new operator meets it, run as a subprocess against a real
//! `redis-server`: TLS options and the URLs they go with (Sentinel's included), a Sentinel
//! master behind a password, an empty `$REDIS_URL`, what a timeout says, and releasing a
//! lock that shows no fence.

mod support;

use redbaton::LockClient;
use redbaton_testkit::keys::Keys;
use redbaton_testkit::sentinel::watching;
use redbaton_testkit::server::RedisServer;
use redbaton_testkit::tls::{Certs, TlsServer};
use redbaton_testkit::{exists, test_server};

use support::{client, code, command, no_panic, redbaton, stderr, stdout};

#[test]
fn smoke() {
    let certs = Certs::generate();
    let tls = TlsServer::start(&certs, false);
    let o = redbaton(
        &tls.url(),
        &["--tls-ca", &certs.file("ca.pem"), "status", "x"],
    );
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(stdout(&o).contains("free"), "{}", stdout(&o));
}

/// The CLI's TLS options reach the connection: without `--tls-ca` the server's private CA
/// is not trusted (exit 3), and with `--tls-cert`/`--tls-key` a server that verifies its
/// clients lets the command in.
#[test]
fn tls_options_reach_the_connection() {
    let certs = Certs::generate();
    let tls = TlsServer::start(&certs, true);
    let o = redbaton(&tls.url(), &["status", "x"]);
    no_panic(&o);
    assert_eq!(code(&o), 3, "{}", stderr(&o));
    let (ca, cert, key) = (
        certs.file("ca.pem"),
        certs.file("client.pem"),
        certs.file("client.key"),
    );
    let o = redbaton(&tls.url(), &["--tls-ca", &ca, "status", "x"]);
    assert_eq!(code(&o), 3, "no client certificate: {}", stderr(&o));
    let args = [
        "--tls-ca",
        &ca,
        "--tls-cert",
        &cert,
        "--tls-key",
        &key,
        "status",
        "x",
    ];
    let o = redbaton(&tls.url(), &args);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
}

/// Sentinels reached over TLS (`rediss://`) serve a master that speaks TLS too: the command
/// talks TLS to the master they name, with the same CA.
#[test]
fn sentinels_over_tls_name_a_master_over_tls() {
    let certs = Certs::generate();
    let master = TlsServer::start(&certs, false);
    let _holder = LockClient::builder()
        .node(master.url())
        .tls_ca_cert(std::fs::read(certs.file("ca.pem")).expect("ca"))
        .build()
        .expect("client")
        .lock("job")
        .expect("lock");
    let sentinel = certs
        .server()
        .sentinel()
        .config("tls-auth-clients", "no")
        .config("tls-replication", "yes")
        .config(
            "sentinel",
            &format!("monitor m 127.0.0.1 {} 1", master.tls_port),
        )
        .start();
    let sentinel_url = format!(
        "rediss://127.0.0.1:{}/",
        sentinel.port_of("tls-port").expect("tls port")
    );
    let args = [
        "--sentinel",
        "m",
        &sentinel_url,
        "--tls-ca",
        &certs.file("ca.pem"),
        "status",
        "job",
    ];
    let o = redbaton(&sentinel_url, &args);
    no_panic(&o);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(
        stdout(&o).contains("kind            lock"),
        "{}",
        stdout(&o)
    );
}

/// A Sentinel-managed master that wants a password (the default user's, or an ACL user's):
/// the sentinels' URLs carry only their own credentials, and the master's come from
/// `--master-password` (or `$REDBATON_MASTER_PASSWORD`) and `--master-user`. With them
/// `status` reads the master; without them the master refuses the command (exit 3); a
/// user without a password is a usage error.
#[test]
fn a_sentinel_master_with_a_password() {
    let master = RedisServer::builder()
        .password("master-pw")
        .acl_user("ops", "ops-pw", "~* &* +@all")
        .start();
    let sentinel = watching("m", master.port(), &["auth-pass m master-pw"]);
    let status = |args: &[&str], env_password: Option<&str>| {
        let sentinels = ["--sentinel", "m", &sentinel.url()];
        let mut c = command(&[&sentinels[..], args, &["status", "x"]].concat());
        if let Some(password) = env_password {
            c.env("REDBATON_MASTER_PASSWORD", password);
        }
        let o = c.output().expect("run redbaton");
        no_panic(&o);
        o
    };
    for (args, env_password) in [
        (&["--master-password", "master-pw"][..], None),
        (&[], Some("master-pw")),
        (
            &["--master-user", "ops", "--master-password", "ops-pw"],
            None,
        ),
        (&["--master-user", "ops"], Some("ops-pw")),
    ] {
        let o = status(args, env_password);
        assert_eq!(code(&o), 0, "{args:?}: {}", stderr(&o));
        assert!(stdout(&o).contains("free"), "{args:?}: {}", stdout(&o));
        assert!(!stderr(&o).contains("pw"), "{}", stderr(&o));
    }
    let o = status(&[], None);
    assert_eq!(code(&o), 3, "no password for the master: {}", stderr(&o));
    let o = status(&["--master-user", "ops"], None);
    assert_eq!(code(&o), 2, "a user without a password: {}", stderr(&o));
}

/// TLS options given with a plain `redis://` URL would be ignored, and the command would
/// talk in clear text to a server the operator meant to reach over TLS: a usage error
/// (exit 2) that names `rediss://`, before any connection.
#[test]
fn tls_options_with_a_plain_url_are_a_usage_error() {
    let srv = test_server();
    let certs = Certs::generate();
    let (ca, cert, key) = (
        certs.file("ca.pem"),
        certs.file("client.pem"),
        certs.file("client.key"),
    );
    for tls in [
        &["--tls-ca", &ca][..],
        &["--tls-cert", &cert, "--tls-key", &key],
    ] {
        let o = redbaton(&srv.url(), &[tls, &["status", "x"]].concat());
        no_panic(&o);
        assert_eq!(code(&o), 2, "{tls:?}: {}", stderr(&o));
        assert!(stderr(&o).contains("rediss://"), "{tls:?}: {}", stderr(&o));
        assert_eq!(stdout(&o), "", "{tls:?}");
    }
    let seed = srv.url();
    let o = redbaton(
        &srv.url(),
        &["--cluster", &seed, "--tls-ca", &ca, "status", "x"],
    );
    assert_eq!(code(&o), 2, "--cluster: {}", stderr(&o));
}

/// `$REDIS_URL` set but empty (`REDIS_URL=${REDIS_URL}` in a file where it is unset) is
/// neither taken as the default address nor reported as an unparsable URL the operator
/// never typed: a usage error that names the variable.
#[test]
fn an_empty_redis_url_is_named() {
    for o in [
        command(&["status", "x"]).env("REDIS_URL", "").output(),
        command(&["status", "x", "--url", " "]).output(),
    ] {
        let o = o.expect("run");
        no_panic(&o);
        assert_eq!(code(&o), 2, "{}", stderr(&o));
        assert!(stderr(&o).contains("$REDIS_URL"), "{}", stderr(&o));
    }
}

/// A server that does not answer within `--timeout`: the message says that it timed out
/// and which option sets how long it waits, not the socket's "resource temporarily
/// unavailable".
#[test]
fn a_timeout_says_so() {
    let srv = test_server();
    srv.pause();
    let o = redbaton(&srv.url(), &["--timeout", "1", "status", "x"]);
    srv.resume();
    assert_eq!(code(&o), 3, "{}", stderr(&o));
    let err = stderr(&o);
    assert!(
        err.contains("timed out") && err.contains("--timeout"),
        "{err}"
    );
    assert!(!err.contains("temporarily unavailable"), "{err}");
}

/// A lock held longer than its fence counter lives (or written without one) shows fence
/// `-`; `release NAME --fence -` is how an operator gives back what `status` showed, and
/// frees it (fence 0 to the library: only while the name has no counter). Another fence is
/// refused with a message that says how.
#[test]
fn a_lock_that_shows_no_fence_is_released_with_fence_dash() {
    let srv = test_server();
    let keys = Keys::DEFAULT;
    let guard = client(&srv).lock("old").expect("lock");
    redis::cmd("DEL")
        .arg(keys.fence("old"))
        .exec(&mut srv.conn())
        .expect("del");
    let o = redbaton(&srv.url(), &["status", "old"]);
    assert!(stdout(&o).contains("fence           -"), "{}", stdout(&o));
    let o = redbaton(&srv.url(), &["release", "old", "--fence", "5"]);
    assert_eq!(code(&o), 1, "{}", stderr(&o));
    assert!(stdout(&o).contains("`--fence -`"), "{}", stdout(&o));
    let o = redbaton(&srv.url(), &["release", "old", "--fence", "-"]);
    no_panic(&o);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(
        !exists(&mut srv.conn(), keys.lock("old")),
        "the lock was deleted"
    );
    drop(guard);
}

/// `list` that finds nothing says so on stderr, naming the prefix and the pattern it looked
/// under (a wrong `--prefix` or database would otherwise look like an idle system), and
/// still succeeds with nothing on stdout but the header (nothing at all with `--json`).
#[test]
fn a_list_that_finds_nothing_says_where_it_looked() {
    let srv = test_server();
    let _held = client(&srv).lock("job").expect("lock");
    let o = redbaton(&srv.url(), &["--prefix", "other:", "list", "j*"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(stdout(&o).lines().count(), 1, "the header: {}", stdout(&o));
    let err = stderr(&o);
    assert!(err.contains("other:") && err.contains("j*"), "{err}");
    let o = redbaton(&srv.url(), &["--json", "--prefix", "other:", "list"]);
    assert_eq!((code(&o), stdout(&o)), (0, String::new()), "{}", stderr(&o));
    assert!(stderr(&o).contains("other:"), "{}", stderr(&o));
    let o = redbaton(&srv.url(), &["list"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(stdout(&o).contains("job"), "{}", stdout(&o));
    assert_eq!(stderr(&o), "", "a list with names says nothing more");
}

/// `watch --interval` below 10 ms (0: a script sent in a tight loop for as long as an
/// operator leaves the terminal open) is a usage error naming the option.
#[test]
fn a_watch_interval_below_10_ms_is_refused() {
    let srv = test_server();
    for interval in ["0", "9"] {
        let o = redbaton(&srv.url(), &["watch", "x", "--interval", interval]);
        no_panic(&o);
        assert_eq!(code(&o), 2, "{interval}: {}", stderr(&o));
        assert!(stderr(&o).contains("--interval"), "{}", stderr(&o));
    }
}
