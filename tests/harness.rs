//! Tests of the test harness itself (the `redbaton-testkit` crate), independent of the
//! library: if these fail, failures elsewhere say nothing about redbaton.

use std::collections::HashMap;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use redbaton_testkit::child;
use redbaton_testkit::child_only;
use redbaton_testkit::ms;
use redbaton_testkit::proxy::Proxy;
use redbaton_testkit::server::{self, RedisServer, StatsReset};
use redbaton_testkit::test_server;
use redis::Connection;

fn ping(conn: &mut Connection) -> redis::RedisResult<String> {
    redis::cmd("PING").query(conn)
}

fn try_set(conn: &mut Connection, key: &str, value: &str) -> redis::RedisResult<()> {
    redis::cmd("SET").arg(key).arg(value).query(conn)
}

fn set(conn: &mut Connection, key: &str, value: &str) {
    try_set(conn, key, value).expect("SET");
}

fn get(conn: &mut Connection, key: &str) -> Option<String> {
    redis::cmd("GET").arg(key).query(conn).expect("GET")
}

/// A connection through `url` that fails instead of hanging.
fn conn_with_timeout(url: &str, timeout: Duration) -> Connection {
    let client = redis::Client::open(url).expect("client");
    let conn = client
        .get_connection_with_timeout(Duration::from_secs(2))
        .expect("connect");
    conn.set_read_timeout(Some(timeout)).expect("read timeout");
    conn.set_write_timeout(Some(timeout))
        .expect("write timeout");
    conn
}

fn process_exists(pid: u32) -> bool {
    // SAFETY: signal 0 only checks for existence.
    unsafe { libc::kill(pid as libc::pid_t, 0) == 0 }
}

#[test]
fn smoke() {
    let srv = test_server();
    let mut conn = srv.conn();
    assert_eq!(ping(&mut conn).unwrap(), "PONG");
    assert_eq!(srv.url(), format!("redis://127.0.0.1:{}/", srv.port()));
    assert_eq!(srv.addr().port(), srv.port());
    assert!(srv.addr().ip().is_loopback());
    assert!(srv.is_running());
    assert!(srv.dir().join("redis.conf").exists());
}

#[test]
fn drop_kills_the_process() {
    let srv = RedisServer::start();
    let pid = srv.pid();
    assert!(process_exists(pid));
    drop(srv);
    assert!(!process_exists(pid), "redis-server {pid} survived drop");
}

#[test]
fn commandstats_are_net_of_harness_traffic() {
    let srv = RedisServer::start();
    // A fresh server reports nothing: the startup probe is hidden.
    assert_eq!(srv.commandstats(), HashMap::new());
    assert_eq!(srv.total_commands(), 0);

    let mut conn = srv.conn();
    for i in 0..3 {
        set(&mut conn, &format!("k{i}"), "v");
    }
    assert_eq!(get(&mut conn, "k1").as_deref(), Some("v"));
    let _: String = redis::cmd("CLIENT")
        .arg("GETNAME")
        .query(&mut conn)
        .unwrap_or_default();

    // Repeated readings must not count themselves.
    for _ in 0..3 {
        assert_eq!(srv.command_count("set"), 3);
        assert_eq!(srv.command_count("SET"), 3);
        assert_eq!(srv.command_count("get"), 1);
        // Redis 7 counts subcommands apart; 6.2 only the container.
        if srv.version().at_least(7, 0) {
            assert_eq!(srv.command_count("client|getname"), 1);
        }
        assert_eq!(srv.command_count("client"), 1, "container sums subcommands");
        assert_eq!(srv.total_commands(), 5);
    }
    assert_eq!(
        srv.keys("k*"),
        vec![b"k0".to_vec(), b"k1".to_vec(), b"k2".to_vec()]
    );
    assert_eq!(srv.client_list().len(), 1, "only the test's connection");
    assert_eq!(
        srv.total_commands(),
        5,
        "SCAN / CLIENT LIST are harness traffic"
    );

    assert_eq!(srv.reset_stats(), StatsReset::Server);
    assert_eq!(srv.total_commands(), 0);
    set(&mut conn, "k", "v");
    assert_eq!(srv.commandstats(), HashMap::from([("set".to_string(), 1)]));
    assert!(srv.raw_commandstats()["info"] > 0);
}

#[test]
fn parse_helpers() {
    let info = "# Commandstats\r\ncmdstat_evalsha:calls=12,usec=40,usec_per_call=3.33,rejected_calls=0,failed_calls=1\r\ncmdstat_client|list:calls=2,usec=5\r\n";
    let stats = server::parse_commandstats(info);
    assert_eq!(stats["evalsha"], 12);
    assert_eq!(stats["client|list"], 2);
    assert_eq!(stats.len(), 2);

    let list = "id=3 addr=127.0.0.1:5000 name= cmd=client|list\nid=4 addr=127.0.0.1:5001 name=w cmd=psubscribe psub=1\n";
    let clients = server::parse_client_list(list);
    assert_eq!(clients.len(), 2);
    assert_eq!(clients[0]["name"], "");
    assert_eq!(clients[1]["psub"], "1");
}

/// The list holds the test's connections, by id (not by count: a client of an earlier
/// test may still be reconnecting to a port the system has given this server).
#[test]
fn client_list_sees_connections() {
    let srv = RedisServer::start();
    let mut a = srv.conn();
    let mut b = srv.conn();
    let () = redis::cmd("CLIENT")
        .arg("SETNAME")
        .arg("waiter")
        .query(&mut a)
        .unwrap();
    let id = |c: &mut redis::Connection| -> String {
        redis::cmd("CLIENT")
            .arg("ID")
            .query::<i64>(c)
            .unwrap()
            .to_string()
    };
    let (ida, idb) = (id(&mut a), id(&mut b));
    let clients = srv.client_list();
    let named = |i: &str| {
        clients
            .iter()
            .find(|c| c["id"] == i)
            .map(|c| c["name"].clone())
    };
    assert_eq!(named(&ida).as_deref(), Some("waiter"), "{clients:?}");
    assert_eq!(named(&idb).as_deref(), Some(""), "{clients:?}");
}

#[test]
fn renamed_config_falls_back_to_baseline() {
    let srv = RedisServer::builder()
        .config("rename-command", "CONFIG \"\"")
        .config("notify-keyspace-events", "")
        .start();
    let mut conn = srv.conn();
    assert!(
        redis::cmd("CONFIG")
            .arg("GET")
            .arg("port")
            .query::<Vec<String>>(&mut conn)
            .is_err()
    );
    set(&mut conn, "a", "1");
    assert_eq!(srv.command_count("set"), 1);
    assert_eq!(srv.reset_stats(), StatsReset::Baseline);
    assert_eq!(srv.total_commands(), 0);
    set(&mut conn, "a", "2");
    assert_eq!(srv.commandstats(), HashMap::from([("set".to_string(), 1)]));
}

#[test]
fn password_and_acl_users() {
    let srv = RedisServer::builder().password("s3cret").start();
    let client = redis::Client::open(srv.url()).unwrap();
    let mut anon = client.get_connection().unwrap();
    assert!(ping(&mut anon).is_err(), "NOAUTH expected");
    assert_eq!(ping(&mut srv.conn()).unwrap(), "PONG");
    let mut via_url = redis::Client::open(srv.url_with_auth())
        .unwrap()
        .get_connection()
        .unwrap();
    assert_eq!(ping(&mut via_url).unwrap(), "PONG");
    assert_eq!(srv.command_count("ping"), 2);

    let acl = RedisServer::builder()
        .config("user", "admin on >adminpw ~* &* +@all")
        .config("user", "default off")
        .admin_auth("admin", "adminpw")
        .start();
    assert_eq!(ping(&mut acl.conn()).unwrap(), "PONG");
    assert_eq!(acl.command_count("ping"), 1);
}

#[test]
fn restart_keeps_port_and_loses_data() {
    let srv = RedisServer::start();
    let (port, pid) = (srv.port(), srv.pid());
    set(&mut srv.conn(), "k", "v");
    srv.restart();
    assert_eq!(srv.port(), port);
    assert_ne!(srv.pid(), pid);
    assert!(!process_exists(pid));
    let mut conn = srv.conn();
    assert_eq!(get(&mut conn, "k"), None);
    assert_eq!(srv.command_count("set"), 0, "stats start over");

    // Restart after a crash, too.
    srv.kill();
    assert!(!srv.is_running());
    assert!(ping(&mut conn).is_err());
    srv.restart();
    assert_eq!(ping(&mut srv.conn()).unwrap(), "PONG");
}

#[test]
fn fixed_port_builder() {
    let first = RedisServer::start();
    let port = first.port();
    drop(first);
    let srv = RedisServer::builder().port(port).start();
    assert_eq!(srv.port(), port);
    assert_eq!(ping(&mut srv.conn()).unwrap(), "PONG");
}

#[test]
#[should_panic(expected = "redis-server on fixed port")]
fn fixed_port_in_use_panics() {
    let squatter = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = squatter.local_addr().unwrap().port();
    let _srv = RedisServer::builder().port(port).start();
}

#[test]
// The log tail quotes the directive; the words around it differ between servers ("Bad
// directive" up to Redis 7, "Unresolved Configuration" on Redis 8).
#[should_panic(expected = "no-such-directive")]
fn bad_config_panics_with_log_tail() {
    let _srv = RedisServer::builder()
        .config("no-such-directive", "1")
        .start();
}

#[test]
fn stop_is_clean() {
    let srv = RedisServer::start();
    let pid = srv.pid();
    srv.pause(); // stop must work on a paused server too
    let started = Instant::now();
    srv.stop();
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "SIGTERM was honoured"
    );
    assert!(!process_exists(pid));
}

#[test]
fn pause_and_resume() {
    let srv = Arc::new(RedisServer::start());
    let mut conn = conn_with_timeout(&srv.url(), ms(300));
    srv.pause();
    let started = Instant::now();
    let err = ping(&mut conn).expect_err("paused server must not answer");
    assert!(err.is_timeout() || err.is_io_error(), "{err}");
    assert!(started.elapsed() >= ms(250));

    // Resumed from another thread: the request queued in the socket runs.
    let s = Arc::clone(&srv);
    let resumer = thread::spawn(move || {
        thread::sleep(ms(100));
        s.resume();
    });
    let mut fresh = conn_with_timeout(&srv.url(), Duration::from_secs(5));
    assert_eq!(ping(&mut fresh).unwrap(), "PONG");
    resumer.join().unwrap();
}

#[test]
fn start_many_gives_independent_servers() {
    let servers = server::start_many(3);
    let mut ports: Vec<u16> = servers.iter().map(|s| s.port()).collect();
    ports.sort();
    ports.dedup();
    assert_eq!(ports.len(), 3);
    set(&mut servers[0].conn(), "only-here", "1");
    assert_eq!(servers[0].keys("*").len(), 1);
    assert!(servers[1].keys("*").is_empty());
    assert!(servers[2].keys("*").is_empty());
}

#[test]
fn proxy_forwards_and_delays() {
    let srv = RedisServer::start();
    let proxy = Proxy::start(srv.addr());
    let mut conn = conn_with_timeout(&proxy.url(), Duration::from_secs(5));
    set(&mut conn, "k", "v");
    assert_eq!(get(&mut srv.conn(), "k").as_deref(), Some("v"));
    assert_eq!(proxy.connections_accepted(), 1);
    assert_eq!(proxy.active_connections(), 1);

    // Delays of a second, so that the bounds leave room for a loaded machine.
    proxy.set_delay(ms(1000));
    let started = Instant::now();
    assert_eq!(ping(&mut conn).unwrap(), "PONG");
    let elapsed = started.elapsed();
    assert!(elapsed >= ms(1000), "{elapsed:?}");
    assert!(elapsed < ms(1900), "delayed one way only: {elapsed:?}");

    proxy.set_delay_both(ms(1000));
    let started = Instant::now();
    assert_eq!(ping(&mut conn).unwrap(), "PONG");
    assert!(started.elapsed() >= ms(2000), "{:?}", started.elapsed());

    // Any leftover delay would cost >= 1 s here.
    proxy.heal();
    let started = Instant::now();
    assert_eq!(ping(&mut conn).unwrap(), "PONG");
    assert!(started.elapsed() < ms(990), "{:?}", started.elapsed());
}

#[test]
fn delay_is_latency_not_throughput() {
    // A pipeline of many commands is delayed once, not once per reply.
    let srv = RedisServer::start();
    let proxy = Proxy::start(srv.addr());
    let mut conn = conn_with_timeout(&proxy.url(), Duration::from_secs(5));
    proxy.set_delay(ms(100));
    let mut pipe = redis::pipe();
    for i in 0..200 {
        pipe.cmd("SET").arg(format!("k{i}")).arg("x").ignore();
    }
    let started = Instant::now();
    let () = pipe.query(&mut conn).unwrap();
    let elapsed = started.elapsed();
    // Once per reply would be 20 s.
    assert!(elapsed >= ms(100) && elapsed < ms(5000), "{elapsed:?}");
}

#[test]
fn drop_next_reply_executes_but_loses_the_answer() {
    let srv = RedisServer::start();
    let proxy = Proxy::start(srv.addr());
    let mut conn = conn_with_timeout(&proxy.url(), Duration::from_secs(2));
    assert_eq!(ping(&mut conn).unwrap(), "PONG"); // handshake done before arming

    proxy.drop_next_reply();
    assert!(proxy.drop_armed());
    let started = Instant::now();
    let err = try_set(&mut conn, "k", "v").expect_err("reply must be lost");
    assert!(started.elapsed() < ms(1500), "closed, not timed out: {err}");
    assert!(!proxy.drop_armed());
    assert_eq!(proxy.replies_dropped(), 1);
    // ...but the command ran.
    assert_eq!(get(&mut srv.conn(), "k").as_deref(), Some("v"));
    assert_eq!(srv.command_count("set"), 1);

    // The connection is gone; a new one works normally.
    assert!(ping(&mut conn).is_err());
    let mut fresh = conn_with_timeout(&proxy.url(), Duration::from_secs(2));
    assert_eq!(get(&mut fresh, "k").as_deref(), Some("v"));
}

#[test]
fn drop_next_reply_matching_skips_other_traffic() {
    let srv = RedisServer::start();
    let proxy = Proxy::start(srv.addr());
    let mut conn = conn_with_timeout(&proxy.url(), Duration::from_secs(2));
    proxy.drop_next_reply_matching(b"target-key");
    set(&mut conn, "other", "1");
    assert!(proxy.drop_armed());
    assert!(try_set(&mut conn, "target-key", "2").is_err());
    assert_eq!(get(&mut srv.conn(), "target-key").as_deref(), Some("2"));
}

#[test]
fn blackhole_and_stall() {
    let srv = RedisServer::start();
    let proxy = Proxy::start(srv.addr());
    let mut conn = conn_with_timeout(&proxy.url(), ms(300));

    proxy.blackhole(true);
    assert!(ping(&mut conn).is_err(), "blackholed");
    assert_eq!(srv.command_count("ping"), 0, "nothing reached Redis");
    proxy.blackhole(false);
    let mut fresh = conn_with_timeout(&proxy.url(), ms(300));
    assert_eq!(ping(&mut fresh).unwrap(), "PONG");

    // Stall: the request is held, then delivered when the partition heals.
    proxy.stall(true);
    assert!(try_set(&mut fresh, "late", "1").is_err());
    assert_eq!(get(&mut srv.conn(), "late"), None);
    proxy.stall(false);
    let deadline = Instant::now() + Duration::from_secs(2);
    while get(&mut srv.conn(), "late").is_none() {
        assert!(Instant::now() < deadline, "stalled request never arrived");
        thread::sleep(ms(10));
    }
}

#[test]
fn proxy_kill_all_and_drop() {
    let srv = RedisServer::start();
    let proxy = Proxy::start(srv.addr());
    let mut a = conn_with_timeout(&proxy.url(), Duration::from_secs(2));
    let mut b = conn_with_timeout(&proxy.url(), Duration::from_secs(2));
    assert_eq!(ping(&mut a).unwrap(), "PONG");
    assert_eq!(ping(&mut b).unwrap(), "PONG");
    assert_eq!(proxy.active_connections(), 2);

    proxy.kill_all();
    assert!(ping(&mut a).is_err());
    assert!(ping(&mut b).is_err());
    let deadline = Instant::now() + Duration::from_secs(2);
    while proxy.active_connections() > 0 {
        assert!(Instant::now() < deadline, "pumps did not exit");
        thread::sleep(ms(5));
    }
    let mut c = conn_with_timeout(&proxy.url(), Duration::from_secs(2));
    assert_eq!(ping(&mut c).unwrap(), "PONG");

    // Drop closes live connections and returns (threads joined).
    let url = proxy.url();
    let started = Instant::now();
    drop(proxy);
    assert!(started.elapsed() < Duration::from_secs(1));
    assert!(ping(&mut c).is_err());
    assert!(redis::Client::open(url).unwrap().get_connection().is_err());
}

#[test]
fn proxy_to_dead_target_closes_client() {
    let srv = RedisServer::start();
    let proxy = Proxy::start(srv.addr());
    srv.kill();
    let client = redis::Client::open(proxy.url()).unwrap();
    // Either the handshake or the first command fails: the proxy closes
    // the client as soon as the upstream connect is refused.
    if let Ok(mut conn) = client.get_connection_with_timeout(Duration::from_secs(2)) {
        assert!(ping(&mut conn).is_err());
    }
    assert_eq!(proxy.connections_accepted(), 1);
}

// --- child processes -------------------------------------------------------

/// Child entry point: passes trivially in a normal run.
#[test]
fn child_echo() {
    child_only!();
    let mut conn = redis::Client::open(child::env("HARNESS_URL"))
        .unwrap()
        .get_connection()
        .unwrap();
    set(&mut conn, "from-child", &child::env("HARNESS_ECHO"));
    child::print_result(&[("ok", "1".into()), ("echo", child::env("HARNESS_ECHO"))]);
}

/// Child entry point that announces itself and then hangs until killed.
#[test]
fn child_sleeper() {
    child_only!();
    child::print_result(&[("ready", std::process::id().to_string())]);
    thread::sleep(Duration::from_secs(60));
}

/// Child entry point: starts a server, says which, and hangs until killed.
#[test]
fn child_server_owner() {
    child_only!();
    let srv = RedisServer::start();
    child::print_result(&[
        ("pid", srv.pid().to_string()),
        ("dir", srv.dir().display().to_string()),
    ]);
    thread::sleep(Duration::from_secs(60));
}

/// Alive and not a zombie (a killed orphan stays one until init reaps it).
fn running(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the parenthesised command name.
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| !matches!(rest.trim_start().chars().next(), Some('Z' | 'X'))),
        Err(_) => process_exists(pid),
    }
}

#[test]
fn server_dies_with_a_killed_test_process() {
    let mut c = child::spawn_self("child_server_owner", &[]);
    let line = child::wait_for_line(&mut c, "RESULT", Duration::from_secs(30));
    let result = child::parse_results(&line).pop().expect("a RESULT line");
    let pid: u32 = result["pid"].parse().expect("pid");
    let dir = std::path::PathBuf::from(&result["dir"]);
    assert!(running(pid) && dir.exists());
    // No unwinding, no destructors: only the reaper can stop the server now.
    child::kill_child(&mut c, libc::SIGKILL);
    let _ = child::wait_output(c, Duration::from_secs(30));
    let deadline = Instant::now() + Duration::from_secs(10);
    while (running(pid) || dir.exists()) && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(20));
    }
    assert!(
        !running(pid),
        "redis-server {pid} outlived its killed test process"
    );
    assert!(
        !dir.exists(),
        "{} outlived its killed test process",
        dir.display()
    );
}

/// Child entry point: starts a server with no redis-server on PATH.
#[test]
fn child_without_redis() {
    child_only!();
    let _srv = RedisServer::start();
}

#[test]
fn missing_redis_server_message() {
    let c = child::spawn_self(
        "child_without_redis",
        &[
            ("PATH", "/nonexistent".into()),
            ("REDBATON_REDIS_SERVER", "redis-server".into()),
        ],
    );
    let out = child::wait_output(c, Duration::from_secs(30));
    assert!(!out.status.success());
    assert!(
        out.stderr.contains("redis-server not found")
            && out.stderr.contains("apt-get install -y redis-server")
            && out.stderr.contains("REDBATON_REDIS_SERVER"),
        "stderr:\n{}",
        out.stderr
    );
}

#[test]
fn child_round_trip() {
    let srv = RedisServer::start();
    let c = child::spawn_self(
        "child_echo",
        &[("HARNESS_URL", srv.url()), ("HARNESS_ECHO", "hello".into())],
    );
    let out = child::wait_ok(c, Duration::from_secs(30));
    let results = child::parse_results(&out);
    assert_eq!(results.len(), 1, "stdout:\n{out}");
    assert_eq!(results[0]["ok"], "1");
    assert_eq!(results[0]["echo"], "hello");
    assert_eq!(get(&mut srv.conn(), "from-child").as_deref(), Some("hello"));
}

#[test]
fn child_can_be_killed() {
    let mut c = child::spawn_self("child_sleeper", &[]);
    let line = child::wait_for_line(&mut c, "RESULT ready=", Duration::from_secs(30));
    let fields = &child::parse_results(&line)[0];
    assert_eq!(fields["ready"], c.id().to_string());
    child::kill_child(&mut c, libc::SIGKILL);
    let out = child::wait_output(c, Duration::from_secs(10));
    assert!(!out.status.success());
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(out.status.signal(), Some(libc::SIGKILL));
}

#[test]
fn parse_results_handles_libtest_prefix() {
    let out = "\nrunning 1 test\ntest child_x ... RESULT a=1 b=x=y\nRESULT c=3\nok\n";
    let r = child::parse_results(out);
    assert_eq!(r.len(), 2);
    assert_eq!(r[0]["a"], "1");
    assert_eq!(r[0]["b"], "x=y");
    assert_eq!(r[1]["c"], "3");
}
