//! Bad input: every way a caller (or an operator's Redis) can hand the library something
//! wrong, each with the typed error it must produce — never a panic — and nothing left in
//! Redis.
//!
//! Decisions this file pins down:
//! * Lock names are arbitrary bytes, 1..=[`MAX_NAME_LEN`] (4096) of them. Non-UTF-8 names
//!   are accepted: the Redis key is `prefix + "{" + name + "}"` byte for byte.
//! * A zero wait (`try_lock_for(name, Duration::ZERO)`, or `try_lock_until` a past instant)
//!   means "one attempt": it acquires a free lock and returns [`Error::Timeout`] at once on
//!   a held one, without subscribing to anything.
//! * Every builder setting is validated before any connection is opened: an invalid
//!   configuration never touches the server.
//! * The minimal Redis 7 ACL for a client with key prefix `redbaton:` is
//!   [`MINIMAL_ACL`] (see `acl_minimal_user_*`).

use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use redbaton::{Error, LockClient, MAX_NAME_LEN, Unlocked, Wakeup};
use redbaton_testkit::exists;
use redbaton_testkit::keys::{Keys, MAX_HANDOFFS};
use redbaton_testkit::ms;
use redbaton_testkit::server::RedisServer;
use redbaton_testkit::wait::wait_until;
use redbaton_testkit::{dead_url, test_server};
use redbaton_testkit::{lock_builder, lock_client};

/// The keys of a client with the default prefix.
const KEYS: Keys = Keys::DEFAULT;

/// The smallest ACL rule set with which a `redbaton` client (default prefix `redbaton:`,
/// database 0) works fully on Redis 7 — found by trial: each rule below was removed in turn
/// and the exercise of `exercise_acl_user` (build, lock, WouldBlock, unlock, renewals, a
/// waiter woken by the release, a subscription dropped after its linger) run again.
///
/// * keys `~redbaton:*` — the lock key `redbaton:{name}`, its counter `redbaton:{name}:fence`
///   and the waiters' contention mark next to them;
/// * `+evalsha` (every operation) and `+script|load` (redis-rs loads a script after
///   `NOSCRIPT`: first use, server restart, `SCRIPT FLUSH`);
/// * inside the scripts, which run with the caller's ACL: `+get +set +del +pttl`
///   (acquire and release fail without them), `+pexpire` (renewals: without it every lock
///   is lost after one lease), `+publish` (the release message that wakes waiters;
///   without it, and without keyspace events, waiters sleep until the re-check interval)
///   and, for the fair queue, `+exists +time +zadd +zrem +zrange +zrangebyscore +zcard
///   +zscore` (with `+zremrangebyscore`, also for read-write locks and semaphores);
/// * the subscriber: `+subscribe +unsubscribe` and the channel `&redbaton:*` (the library's
///   channel `redbaton:{name}:ev`); without them locks still work but waiters fall back to
///   retrying with a backoff (about 1.6 s to notice a release here);
/// * `&__keyspace@*` — keyspace notifications of the lock keys, subscribed only when
///   notifications are on; releases wake waiters without it, expiries then by the lease
///   timer;
/// * `+ping` — the subscriber's health check after 15 s without traffic (a refusal makes
///   it reconnect);
/// * `+client|setname` is optional (connections are named `redbaton`/`redbaton:sub` when
///   allowed; a refusal is ignored), kept so that operators can tell connections apart.
///
/// Optional: `+config|get +config|set` let the client turn keyspace notifications on (at
/// build and at every subscriber reconnect); without them it relies on its release channel
/// (one warning), which `acl_minimal_user_without_config` shows working.
const MINIMAL_ACL: &str = "resetkeys ~redbaton:* resetchannels &redbaton:* &__keyspace@* \
     -@all +evalsha +script|load +get +set +del +pexpire +pttl +publish \
     +exists +time +zadd +zrem +zrange +zrangebyscore +zcard +zscore +zremrangebyscore \
     +subscribe +unsubscribe +ping +client|setname";

fn builder(srv: &RedisServer) -> redbaton::Builder {
    lock_builder!(
        node(srv.url()),
        connect_timeout(ms(500)),
        read_timeout(Duration::from_secs(2)),
        write_timeout(Duration::from_secs(2))
    )
}

fn client(srv: &RedisServer) -> LockClient {
    builder(srv).build().expect("build")
}

/// A client whose waiters can only be woken by an event: lease and re-check interval are
/// far longer than the bounds the tests use.
fn event_only_client(url: &str) -> LockClient {
    lock_client!(
        node(url),
        lease(Duration::from_secs(60)),
        recheck_interval(Duration::from_secs(60))
    )
}

/// The error's message and its sources', as `anyhow`'s `{:#}` prints them: a message no
/// longer repeats its cause, which is its source.
fn chain(e: &Error) -> String {
    let mut text = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

/// `err` must be `InvalidConfig` and its message must mention `needle`.
fn assert_invalid_config(result: Result<LockClient, Error>, needle: &str) {
    match result {
        Err(Error::InvalidConfig(msg)) => {
            assert!(msg.contains(needle), "message {msg:?} lacks {needle:?}")
        }
        Err(e) => panic!("expected InvalidConfig({needle}), got {e:?}"),
        Ok(_) => panic!("expected InvalidConfig({needle}), the build succeeded"),
    }
}

/// Releases `name` (held through `holder`) while a thread of `waiter` waits for it, and
/// returns how long after the release the waiter got the lock.
fn wake_latency(holder: &LockClient, waiter: LockClient, name: &[u8]) -> Duration {
    let guard = holder.lock(name).expect("holder locks");
    let (started_tx, started_rx) = mpsc::channel();
    let n = name.to_vec();
    let t = thread::spawn(move || {
        started_tx.send(()).unwrap();
        let g = waiter.try_lock_for(&n, Duration::from_secs(20));
        let at = Instant::now();
        g.map(|g| {
            assert_eq!(g.name(), n.as_slice());
            drop(g);
            at
        })
    });
    started_rx.recv().unwrap();
    // Let the waiter subscribe, fail its attempt and go to sleep.
    thread::sleep(ms(400));
    assert!(!t.is_finished(), "the waiter did not wait");
    let released = Instant::now();
    assert_eq!(guard.unlock().expect("unlock"), Unlocked::Released);
    let acquired = t
        .join()
        .expect("waiter thread")
        .expect("waiter acquires after the release");
    acquired.saturating_duration_since(released)
}

#[test]
fn smoke() {
    let srv = test_server();
    let c = client(&srv);
    let g = c.lock("smoke").expect("lock");
    assert_eq!(srv.keys("redbaton:*").len(), 2, "lock key and its counter");
    assert_eq!(g.unlock().unwrap(), Unlocked::Released);
    assert_eq!(srv.keys("redbaton:*"), vec![KEYS.fence_bytes(b"smoke")]);
}

// --- names -------------------------------------------------------------------------------

#[test]
fn empty_name_is_rejected_before_redis() {
    let srv = RedisServer::start();
    let c = client(&srv);
    srv.reset_stats();
    let checks: Vec<(&str, Result<(), Error>)> = vec![
        ("lock", c.lock("").map(drop)),
        ("try_lock", c.try_lock(b"").map(drop)),
        (
            "try_lock_for",
            c.try_lock_for(Vec::<u8>::new(), Duration::from_secs(1))
                .map(drop),
        ),
        (
            "try_lock_until",
            c.try_lock_until("", Instant::now() + Duration::from_secs(1))
                .map(drop),
        ),
        (
            "with_lock",
            c.with_lock("", || panic!("the closure must not run")),
        ),
    ];
    for (what, r) in checks {
        let e = r.expect_err(what);
        assert!(matches!(e, Error::InvalidName(_)), "{what}: {e:?}");
        assert!(e.is_invalid_input() && !e.is_connection(), "{what}: {e:?}");
        assert!(e.to_string().contains("empty"), "{what}: {e}");
    }
    assert_eq!(srv.total_commands(), 0, "{:?}", srv.commandstats());
    assert!(srv.keys("*").is_empty());
}

#[test]
fn name_length_limit_is_4096_bytes() {
    assert_eq!(MAX_NAME_LEN, 4096);
    let srv = RedisServer::start();
    let c = client(&srv);
    srv.reset_stats();
    let mib = vec![b'x'; 1 << 20];
    for (what, name) in [
        ("1 MiB", &mib[..]),
        ("MAX_NAME_LEN + 1", &mib[..MAX_NAME_LEN + 1]),
    ] {
        for r in [
            c.lock(name).map(drop),
            c.try_lock(name).map(drop),
            c.try_lock_for(name, ms(10)).map(drop),
        ] {
            let e = r.expect_err(what);
            assert!(matches!(e, Error::InvalidName(_)), "{what}: {e:?}");
            assert!(e.to_string().contains("4096"), "{what}: {e}");
        }
    }
    assert_eq!(srv.total_commands(), 0, "{:?}", srv.commandstats());
    assert!(srv.keys("*").is_empty());

    // Exactly MAX_NAME_LEN bytes is a name.
    let name = &mib[..MAX_NAME_LEN];
    let g = c.lock(name).expect("a 4096-byte name is accepted");
    assert_eq!(g.name(), name);
    assert_eq!(
        srv.keys("*"),
        vec![KEYS.lock_bytes(name), KEYS.fence_bytes(name)]
    );
    assert_eq!(g.unlock().unwrap(), Unlocked::Released);
    // The fencing counter stays (it must, for tokens to keep increasing); the lock goes.
    assert_eq!(srv.keys("*"), vec![KEYS.fence_bytes(name)]);
}

#[test]
fn binary_names_are_exact_keys() {
    let srv = RedisServer::start();
    let a = client(&srv);
    let b = client(&srv);
    let names: Vec<Vec<u8>> = vec![
        vec![0xff, 0xfe, 0xfd],
        vec![0x00],
        vec![0x00, 0x00, b'}', b'{'],
        b"}{".to_vec(),
        b"a b\tc\r\nd".to_vec(),
        // A RESP frame inside a name is just bytes (the protocol is binary-safe).
        b"*1\r\n$8\r\nFLUSHALL\r\n".to_vec(),
        vec![0xc3, 0x28, b':', b'e', b'v'], // invalid UTF-8 ending like a channel suffix
        "ключ-🔒".as_bytes().to_vec(),
    ];
    for name in &names {
        let g = a.lock(name).unwrap_or_else(|e| panic!("{name:?}: {e}"));
        assert_eq!(g.name(), name.as_slice());
        assert_eq!(
            srv.keys("*"),
            {
                let mut v = vec![KEYS.lock_bytes(name), KEYS.fence_bytes(name)];
                for other in &names {
                    if other != name && exists(&mut srv.conn(), KEYS.fence_bytes(other)) {
                        v.push(KEYS.fence_bytes(other));
                    }
                }
                v.sort();
                v
            },
            "{name:?}"
        );
        let e = b.try_lock(name).expect_err("held by a");
        assert!(e.is_would_block(), "{name:?}: {e:?}");
        assert_eq!(g.unlock().unwrap(), Unlocked::Released, "{name:?}");
        assert!(!exists(&mut srv.conn(), KEYS.lock_bytes(name)), "{name:?}");
    }
    assert!(!srv.keys("*").is_empty());
    assert!(
        srv.keys("redbaton:*")
            .iter()
            .all(|k| k.ends_with(b":fence")),
        "only counters are left"
    );

    // Names that differ only in bytes that are not UTF-8 are different locks (their lossy
    // display is the same "\u{fffd}").
    let g1 = a.lock([0xff]).expect("0xff");
    let g2 = b.try_lock([0xfe]).expect("0xfe is another lock");
    let g3 = b.try_lock([0xfe, 0xff]).expect("and so is this");
    assert!(a.try_lock([0xfe]).unwrap_err().is_would_block());
    drop((g1, g2, g3));
}

#[test]
fn binary_name_waiter_is_woken_by_the_release() {
    let srv = RedisServer::start();
    let holder = event_only_client(&srv.url());
    let waiter = event_only_client(&srv.url());
    let name = [0xff, b'\n', b'*', 0x00, b'}', b'{', 0xfe];
    let latency = wake_latency(&holder, waiter, &name);
    eprintln!("binary-name waiter woken {latency:?} after the release");
    // Only the `del` event can wake it this soon (lease and re-check are 60 s).
    assert!(latency < Duration::from_secs(5), "{latency:?}");
    assert!(!exists(&mut srv.conn(), KEYS.lock_bytes(&name)));
}

// --- builder settings ----------------------------------------------------------------------

/// A TLS URL that asks to skip the server's certificate check (`#insecure`) is refused
/// when the client is built, before it connects anywhere: the library always checks
/// certificates (give the CA with `tls_ca_cert` instead).
#[test]
fn an_insecure_tls_url_is_invalid_config() {
    for url in [
        "rediss://127.0.0.1:1/#insecure",
        "rediss://127.0.0.1:1/0#insecure",
    ] {
        assert_invalid_config(
            redbaton::LockClient::builder().node(url).build(),
            "#insecure",
        );
    }
}

#[test]
fn lease_outside_10ms_to_24h_is_invalid() {
    let srv = RedisServer::start();
    let day = Duration::from_secs(24 * 3600);
    for lease in [
        Duration::ZERO,
        Duration::from_nanos(1),
        ms(9),
        Duration::from_micros(9_999),
        day + Duration::from_millis(1),
        Duration::from_secs(10 * 365 * 24 * 3600),
        Duration::MAX,
    ] {
        assert_invalid_config(builder(&srv).lease(lease).build(), "lease");
    }
    // Validation comes before any connection.
    assert!(srv.client_list().is_empty());
    assert_eq!(srv.total_commands(), 0);

    for lease in [ms(10), day] {
        // The default read timeout: a 10 ms lease refuses a chosen 2 s one.
        let c = lock_client!(node(srv.url()), lease(lease));
        drop(c);
    }
    // A 24 h lease really is 24 h in Redis.
    let c = builder(&srv).lease(day).build().unwrap();
    let g = c.lock("day").unwrap();
    let pttl: i64 = redis::cmd("PTTL")
        .arg(KEYS.lock_bytes(b"day"))
        .query(&mut srv.conn())
        .unwrap();
    assert!(
        pttl > (day - Duration::from_secs(60)).as_millis() as i64,
        "{pttl}"
    );
    drop(g);
    assert!(!exists(&mut srv.conn(), KEYS.lock_bytes(b"day")));
}

#[test]
fn renew_interval_must_be_positive_and_below_the_lease() {
    let srv = RedisServer::start();
    let lease = Duration::from_secs(3);
    // The lease less its drift margin (1% + 2 ms): a renewal due later than that comes
    // after the hold's validity ended, and every hold would be lost after one lease.
    let valid_for = lease - Duration::from_millis(32);
    for renew in [
        Duration::ZERO,
        valid_for,
        lease - Duration::from_nanos(1),
        lease,
        lease + Duration::from_nanos(1),
        lease * 2,
    ] {
        assert_invalid_config(
            builder(&srv).lease(lease).renew_interval(renew).build(),
            "renew interval",
        );
    }
    // The default (lease / 3) is checked too: it is positive for every valid lease.
    assert!(srv.client_list().is_empty());
    builder(&srv)
        .lease(lease)
        .renew_interval(valid_for - Duration::from_nanos(1))
        .build()
        .expect("just below the lease less its drift margin is allowed");
}

#[test]
fn zero_durations_are_invalid() {
    let srv = RedisServer::start();
    let cases: Vec<(&str, redbaton::Builder)> = vec![
        (
            "connect timeout",
            builder(&srv).connect_timeout(Duration::ZERO),
        ),
        ("read timeout", builder(&srv).read_timeout(Duration::ZERO)),
        ("write timeout", builder(&srv).write_timeout(Duration::ZERO)),
        (
            "recheck interval",
            builder(&srv).recheck_interval(Duration::ZERO),
        ),
        ("handoff slice", builder(&srv).handoff_slice(Duration::ZERO)),
        (
            "polling interval",
            builder(&srv).wakeup(Wakeup::Polling(Duration::ZERO)),
        ),
        ("max hold", builder(&srv).max_hold(Duration::ZERO)),
    ];
    for (what, b) in cases {
        assert_invalid_config(b.build(), what);
    }
    assert!(srv.client_list().is_empty());
    assert_eq!(srv.total_commands(), 0);
}

#[test]
fn counts_out_of_range_are_invalid() {
    let srv = RedisServer::start();
    assert_invalid_config(builder(&srv).pool_size(0).build(), "pool size");
    assert_invalid_config(builder(&srv).pool_size(1025).build(), "pool size");
    assert_invalid_config(builder(&srv).max_handoffs(0).build(), "max handoffs");
    assert_invalid_config(
        builder(&srv).max_handoffs(MAX_HANDOFFS + 1).build(),
        "max handoffs",
    );
    assert_invalid_config(
        builder(&srv).key_prefix("p".repeat(1025)).build(),
        "key prefix",
    );
    assert!(srv.client_list().is_empty());
    assert_eq!(srv.total_commands(), 0);

    for b in [
        builder(&srv).pool_size(1),
        builder(&srv).pool_size(1024),
        builder(&srv).max_handoffs(1),
        builder(&srv).max_handoffs(MAX_HANDOFFS),
        builder(&srv).key_prefix("p".repeat(1024)),
    ] {
        b.build().expect("boundary value accepted");
    }
    // An empty prefix is allowed: the key is the braced name.
    let c = builder(&srv).key_prefix("").build().unwrap();
    let g = c.lock("bare").unwrap();
    assert!(exists(&mut srv.conn(), b"{bare}"));
    drop(g);
    assert!(!exists(&mut srv.conn(), b"{bare}"));
}

#[test]
fn redlock_needs_an_odd_number_of_nodes() {
    // Unreachable URLs: validation must fail before any connection attempt.
    for n in [2, 4] {
        let urls: Vec<String> = (0..n)
            .map(|i| format!("redis://127.0.0.1:{}/", i + 1))
            .collect();
        let started = Instant::now();
        assert_invalid_config(lock_builder!(nodes(urls)).build(), "odd");
        assert!(started.elapsed() < Duration::from_secs(1));
    }
}

/// Redlock's nodes must be distinct servers: one server named twice (in the same words or
/// not, or under two databases) would grant a majority alone, and a restart of it without
/// its data would let a second holder in beside the first.
#[test]
fn redlock_refuses_a_server_named_twice() {
    for urls in [
        [
            "redis://127.0.0.1:1/",
            "redis://127.0.0.1:1/",
            "redis://127.0.0.1:2/",
        ],
        [
            "redis://127.0.0.1:1/0",
            "redis://127.0.0.1:1",
            "redis://127.0.0.1:2/",
        ],
        [
            "redis://127.0.0.1:1/0",
            "redis://127.0.0.1:2/",
            "redis://127.0.0.1:1/3",
        ],
    ] {
        let started = Instant::now();
        assert_invalid_config(lock_builder!(nodes(urls)).build(), "twice");
        assert!(started.elapsed() < Duration::from_secs(1));
    }
}

/// One server named under two addresses (an IP and a host name for it) is found out when
/// the client connects: both answer with one server's run id.
#[test]
fn redlock_refuses_a_server_reached_under_two_addresses() {
    let (one, other) = (test_server(), test_server());
    let urls = [
        format!("redis://127.0.0.1:{}/", one.port()),
        format!("redis://localhost:{}/", one.port()),
        other.url(),
    ];
    assert_invalid_config(lock_builder!(nodes(urls)).build(), "twice");
}

// --- waits -------------------------------------------------------------------------------

#[test]
fn zero_wait_is_one_attempt() {
    let srv = RedisServer::start();
    let a = client(&srv);
    let b = client(&srv);

    // Free key: a zero wait acquires.
    let g = b.try_lock_for("z", Duration::ZERO).expect("free: acquired");
    drop(g);
    let g = b
        .try_lock_until("z", Instant::now())
        .expect("a deadline of now acquires a free lock too");
    drop(g);

    // Held key: Timeout at once, after exactly one attempt and no subscription.
    let held = a.lock("z").unwrap();
    srv.reset_stats();
    let before = b.stats().timeouts;
    let started = Instant::now();
    let e = b.try_lock_for("z", Duration::ZERO).expect_err("held");
    let took = started.elapsed();
    assert!(matches!(e, Error::Timeout), "{e:?}");
    let past = Instant::now();
    thread::sleep(ms(5));
    let e = b.try_lock_until("z", past).expect_err("held");
    assert!(matches!(e, Error::Timeout), "{e:?}");
    eprintln!("zero wait on a held lock returned in {took:?}");
    assert!(took < Duration::from_secs(10), "{took:?}");
    assert_eq!(srv.command_count("evalsha"), 2, "{:?}", srv.commandstats());
    assert_eq!(
        srv.command_count("subscribe"),
        0,
        "{:?}",
        srv.commandstats()
    );
    assert_eq!(b.stats().timeouts, before + 2);
    drop(held);
}

#[test]
fn endless_wait_does_not_overflow() {
    let srv = RedisServer::start();
    let a = client(&srv);
    let b = client(&srv);
    // Duration::MAX cannot be added to an Instant: it must mean "no deadline", not panic.
    drop(b.try_lock_for("m", Duration::MAX).expect("free"));
    let held = a.lock("m").unwrap();
    let t = thread::spawn(move || b.try_lock_for("m", Duration::MAX).map(drop));
    thread::sleep(ms(300));
    drop(held);
    let finished = wait_until(Duration::from_secs(10), || t.is_finished());
    assert!(finished, "the waiter never got the lock");
    t.join().unwrap().expect("acquired after the release");
}

// --- URLs and credentials ----------------------------------------------------------------

#[test]
fn invalid_urls_are_invalid_config() {
    for url in [
        "not a url",
        "http://x",
        "redis://:badport",
        "redis://127.0.0.1:notaport/",
        "redis://127.0.0.1:99999/",
        "",
        "redis://[::1/",
        "redis://127.0.0.1:6379/notadb",
    ] {
        let started = Instant::now();
        let e = lock_builder!(node(url))
            .build()
            .expect_err(&format!("{url:?} must be refused"));
        assert!(matches!(e, Error::InvalidConfig(_)), "{url:?}: {e:?}");
        assert!(e.to_string().contains("url"), "{url:?}: {e}");
        assert!(started.elapsed() < Duration::from_secs(1), "{url:?}");
    }
}

#[test]
fn invalid_url_error_does_not_leak_the_password() {
    let e = LockClient::builder()
        .node("redis://user:s3cret@127.0.0.1:notaport/")
        .build()
        .expect_err("bad port");
    assert!(matches!(e, Error::InvalidConfig(_)), "{e:?}");
    for text in [e.to_string(), format!("{e:?}"), format!("{e:#}")] {
        assert!(!text.contains("s3cret"), "password leaked: {text}");
    }
    // Redlock: the message names the node by index.
    let e = LockClient::builder()
        .nodes([
            "redis://127.0.0.1:1/",
            "redis://u:s3cret@host:port:extra/",
            "redis://127.0.0.1:3/",
        ])
        .build()
        .expect_err("bad second url");
    assert!(e.to_string().contains("node 1"), "{e}");
    assert!(!format!("{e} {e:?}").contains("s3cret"));
}

#[test]
fn wrong_password_is_a_typed_redis_error() {
    let srv = RedisServer::builder().password("s3cret").start();
    let port = srv.port();
    for url in [
        format!("redis://:wr0ng@127.0.0.1:{port}/"),
        format!("redis://default:wr0ng@127.0.0.1:{port}/"),
        format!("redis://nosuchuser:wr0ng@127.0.0.1:{port}/"),
    ] {
        let e = lock_builder!(node(url.as_str()))
            .build()
            .expect_err("wrong password");
        assert!(matches!(e, Error::Redis(_)), "{url}: {e:?}");
        assert!(!e.is_invalid_input(), "{url}: {e:?}");
        let text = chain(&e).to_lowercase();
        assert!(
            text.contains("auth") || text.contains("password"),
            "{url}: {text}"
        );
        assert!(
            !format!("{e} {e:?}").contains("wr0ng"),
            "password leaked: {e:?}"
        );
        eprintln!("wrong password: {e} (is_connection: {})", e.is_connection());
    }
    // No password at all: NOAUTH, a typed error from build() (see
    // `missing_password_is_refused_at_build`).
    let e = lock_builder!(node(srv.url())).build().expect_err("NOAUTH");
    assert!(matches!(e, Error::Redis(_)), "{e:?}");
    assert!(chain(&e).to_lowercase().contains("auth"), "{e}");

    // The right password works.
    let c = lock_client!(node(srv.url_with_auth()));
    let g = c.lock("pw").expect("lock");
    assert_eq!(g.unlock().unwrap(), Unlocked::Released);
    assert!(!format!("{c:?}").contains("s3cret"), "{c:?}");
}

/// Regression: NOAUTH from the notification check was taken for "CONFIG refused", so
/// build() fell back and succeeded, and every lock then failed.
#[test]
fn missing_password_is_refused_at_build() {
    let srv = RedisServer::builder().password("s3cret").start();
    let e = lock_builder!(node(srv.url()))
        .build()
        .expect_err("the server requires a password: build() must say so");
    assert!(matches!(e, Error::Redis(_)), "{e:?}");
    assert!(chain(&e).to_lowercase().contains("auth"), "{e}");
}

// --- the server --------------------------------------------------------------------------

#[test]
fn server_down_at_build_is_a_connection_error() {
    let started = Instant::now();
    let e = lock_builder!(node(dead_url()), connect_timeout(ms(500)))
        .build()
        .expect_err("nothing listens");
    assert!(e.is_connection(), "{e:?}");
    assert!(matches!(e, Error::Redis(_)), "{e:?}");
    assert!(started.elapsed() < Duration::from_secs(5));

    // A killed server, too.
    let srv = RedisServer::start();
    srv.kill();
    let e = builder(&srv).build().expect_err("killed");
    assert!(e.is_connection(), "{e:?}");
}

#[test]
fn server_down_mid_run_is_a_connection_error() {
    let srv = RedisServer::start();
    let c = client(&srv);
    drop(c.lock("mid").unwrap());
    srv.stop();
    let started = Instant::now();
    let calls: Vec<(&str, Result<(), Error>)> = vec![
        ("lock", c.lock("mid").map(drop)),
        ("try_lock", c.try_lock("mid").map(drop)),
        (
            "try_lock_for",
            c.try_lock_for("mid", Duration::from_secs(1)).map(drop),
        ),
        ("with_lock", c.with_lock("mid", || ())),
    ];
    for (what, r) in calls {
        let e = r.expect_err(what);
        assert!(e.is_connection(), "{what}: {e:?}");
        assert!(!e.is_timeout(), "{what}: a connection error, not a timeout");
    }
    // Generous: four calls, each bounded by the connect timeout (0.5 s) and retries.
    let took = started.elapsed();
    assert!(took < Duration::from_secs(20), "{took:?}");
}

#[test]
fn config_command_refused_still_works() {
    let srv = RedisServer::builder()
        .config("rename-command", "CONFIG \"\"")
        .start();
    let holder = event_only_client(&srv.url());
    let waiter = event_only_client(&srv.url());
    let g = holder.lock("cfg").expect("lock without CONFIG");
    assert!(waiter.try_lock("cfg").unwrap_err().is_would_block());
    assert_eq!(g.unlock().unwrap(), Unlocked::Released);
    // Waiters are woken by the library's release channel instead of keyspace events.
    let latency = wake_latency(&holder, waiter, b"cfg");
    eprintln!("CONFIG renamed: waiter woken {latency:?} after the release");
    assert!(latency < Duration::from_secs(5), "{latency:?}");
    assert!(!exists(&mut srv.conn(), KEYS.lock_bytes(b"cfg")));
}

fn acl_server(rules: &str) -> RedisServer {
    RedisServer::builder()
        .acl_user("locker", "lockerpw", rules)
        .start()
}

fn acl_url(srv: &RedisServer) -> String {
    srv.url_as("locker", "lockerpw")
}

/// build + lock + WouldBlock + unlock + renewals + a read-write lock and a semaphore + a
/// waiter woken by the release + a subscription dropped after its linger, all as `locker`. Returns the wake-up latency.
fn exercise_acl_user(srv: &RedisServer) -> Duration {
    let url = acl_url(srv);
    let holder = event_only_client(&url);
    let waiter = event_only_client(&url);
    let g = holder.lock("acl").expect("lock");
    assert!(waiter.try_lock("acl").unwrap_err().is_would_block());
    let token = g.fencing_token();
    assert_eq!(g.unlock().unwrap(), Unlocked::Released);
    let g = waiter.try_lock_for("acl", Duration::from_secs(2)).unwrap();
    assert!(g.fencing_token() > token);
    drop(g);

    // Renewals (compare-and-PEXPIRE) are allowed: a 1 s lease survives 1.5 s (renewed
    // every third of it, so that a renewal may come late on a loaded machine).
    let short = lock_client!(node(url.as_str()), lease(ms(1000)));
    let g = short.lock("acl-renew").expect("lock");
    thread::sleep(ms(1500));
    g.check().expect("renewed under the ACL");
    assert!(short.stats().renewals_sent >= 2);
    assert_eq!(short.stats().renewals_failed, 0);
    assert_eq!(g.unlock().unwrap(), Unlocked::Released);

    // Read-write locks and semaphores: their scripts run as the user too.
    let r = holder.rwlock("acl-rw").read().expect("read");
    assert!(
        waiter
            .rwlock("acl-rw")
            .try_write()
            .unwrap_err()
            .is_would_block()
    );
    drop(r);
    drop(
        waiter
            .rwlock("acl-rw")
            .try_write_for(ms(2000))
            .expect("write"),
    );
    let p = holder.semaphore("acl-sem", 1).acquire().expect("permit");
    assert!(
        waiter
            .semaphore("acl-sem", 1)
            .try_acquire()
            .unwrap_err()
            .is_would_block()
    );
    drop(p);
    drop(
        waiter
            .semaphore("acl-sem", 1)
            .try_acquire_for(ms(2000))
            .expect("permit"),
    );

    let latency = wake_latency(&holder, waiter.clone(), b"acl");
    assert!(latency < Duration::from_secs(5), "{latency:?}");
    assert!(!exists(&mut srv.conn(), KEYS.lock_bytes(b"acl")));
    // The waiter's subscription lingers 2 s, then is dropped (UNSUBSCRIBE) without
    // disturbing the subscriber connection; a second wait works the same.
    thread::sleep(ms(2600));
    let latency2 = wake_latency(&holder, waiter.clone(), b"acl");
    assert!(latency2 < Duration::from_secs(5), "{latency2:?}");
    assert_eq!(waiter.stats().reconnects, 0, "{:?}", waiter.stats());

    // A key outside the prefix is refused by the ACL, as a typed error.
    let other = lock_client!(node(url.as_str()), key_prefix("elsewhere:"));
    let e = other.try_lock("acl").expect_err("outside ~redbaton:*");
    assert!(matches!(e, Error::Redis(_)) && !e.is_connection(), "{e:?}");
    assert!(chain(&e).to_lowercase().contains("perm"), "{e}");
    assert!(srv.keys("elsewhere:*").is_empty());
    latency
}

#[test]
fn acl_minimal_user_without_config() {
    let srv = acl_server(MINIMAL_ACL);
    // The fallback path: no CONFIG permission, so no keyspace events; the library channel
    // wakes the waiter.
    let latency = exercise_acl_user(&srv);
    eprintln!("minimal ACL (no CONFIG): waiter woken {latency:?} after the release");
    let flags = srv.config_get("notify-keyspace-events");
    assert_eq!(
        flags, "",
        "the client could not (and did not) change the server"
    );
}

#[test]
fn acl_minimal_user_with_config() {
    let srv = acl_server(&format!("{MINIMAL_ACL} +config|get +config|set"));
    let latency = exercise_acl_user(&srv);
    eprintln!("minimal ACL + CONFIG: waiter woken {latency:?} after the release");
    let flags = srv.config_get("notify-keyspace-events");
    for c in ['K', 'g', '$', 'x', 'e'] {
        assert!(flags.contains(c), "{flags:?}");
    }
    // Woken by a keyspace event: the release did not publish on the library channel.
    assert!(srv.command_count("subscribe") > 0);
}

#[test]
fn acl_keyspace_events_on_without_config_permission() {
    // The operator turned notifications on in redis.conf; the user may read CONFIG but not
    // set it. Waiters subscribe to `__keyspace@0__:...`, which `&__keyspace@*` allows.
    let srv = RedisServer::builder()
        .config("notify-keyspace-events", "KEA")
        .config(
            "user",
            &format!("locker on >lockerpw {MINIMAL_ACL} +config|get"),
        )
        .start();
    let latency = exercise_acl_user(&srv);
    eprintln!("minimal ACL + CONFIG GET, events on: waiter woken {latency:?}");
}

/// Was a bug: redis-rs's `PubSub::subscribe` returns `Ok` for an error reply, so a refused
/// keyspace SUBSCRIBE looked confirmed and waiters slept until their deadline.
#[test]
fn acl_without_keyspace_channel_permission_still_wakes_waiters() {
    // Events on, CONFIG GET allowed, but no `&__keyspace@*`: the keyspace SUBSCRIBE is
    // refused. The client must notice (and fall back), not sleep until the lease ends.
    let rules = MINIMAL_ACL.replace(" &__keyspace@*", "");
    let srv = RedisServer::builder()
        .config("notify-keyspace-events", "KEA")
        .config("user", &format!("locker on >lockerpw {rules} +config|get"))
        .start();
    let url = acl_url(&srv);
    let holder = event_only_client(&url);
    let waiter = event_only_client(&url);
    let latency = wake_latency(&holder, waiter, b"acl");
    assert!(latency < Duration::from_secs(5), "waiter slept {latency:?}");
}

#[test]
fn acl_user_without_channel_permissions_still_locks() {
    // No channel at all: no SUBSCRIBE, no PUBLISH gets through. Locking works; a waiter
    // notices a release by retrying (degraded, but not until the 60 s re-check).
    let rules = MINIMAL_ACL
        .replace(" &redbaton:*", "")
        .replace(" &__keyspace@*", "");
    let srv = acl_server(&rules);
    let url = acl_url(&srv);
    let holder = event_only_client(&url);
    let waiter = event_only_client(&url);
    let g = holder.lock("nc").expect("lock");
    assert!(waiter.try_lock("nc").unwrap_err().is_would_block());
    assert_eq!(g.unlock().unwrap(), Unlocked::Released);
    let latency = wake_latency(&holder, waiter, b"nc");
    eprintln!("ACL without channels: waiter got the lock {latency:?} after the release");
    assert!(latency < Duration::from_secs(10), "{latency:?}");
    assert!(!exists(&mut srv.conn(), KEYS.lock_bytes(b"nc")));
}

// --- foreign values in the lock's keys -----------------------------------------------------

#[test]
fn lock_key_of_the_wrong_type_is_a_typed_error() {
    let srv = RedisServer::start();
    let c = client(&srv);
    let key = KEYS.lock_bytes(b"wt");
    let () = redis::cmd("HSET")
        .arg(&key)
        .arg("field")
        .arg("value")
        .query(&mut srv.conn())
        .unwrap();
    let calls: Vec<(&str, Result<(), Error>)> = vec![
        ("try_lock", c.try_lock("wt").map(drop)),
        ("try_lock_for", c.try_lock_for("wt", ms(300)).map(drop)),
        ("lock", c.lock("wt").map(drop)),
    ];
    for (what, r) in calls {
        let e = r.expect_err(what);
        assert!(e.is_wrong_kind(), "{what}: {e:?}");
        assert!(!e.is_connection() && !e.is_invalid_input(), "{what}: {e:?}");
    }
    // The foreign hash is untouched and nothing else was written.
    let h: Vec<String> = redis::cmd("HGETALL")
        .arg(&key)
        .query(&mut srv.conn())
        .unwrap();
    assert_eq!(h, ["field", "value"]);
    assert_eq!(srv.keys("*"), vec![key]);
    // The client is fine for other names.
    drop(c.lock("ok").unwrap());
}

/// The acquire script sets the lock key before it increments the counter: a counter that
/// is not a number fails the script after the SET (Lua scripts do not roll back). The
/// client must clean up (it releases after any error that may have run).
#[test]
fn fence_key_of_the_wrong_type_leaves_nothing() {
    let srv = RedisServer::start();
    let c = client(&srv);
    let () = redis::cmd("HSET")
        .arg(KEYS.fence_bytes(b"wf"))
        .arg("f")
        .arg("v")
        .query(&mut srv.conn())
        .unwrap();
    let e = c.try_lock("wf").expect_err("the counter is not a number");
    assert!(matches!(e, Error::Redis(_)) && !e.is_connection(), "{e:?}");
    assert!(chain(&e).contains("WRONGTYPE"), "{e}");
    assert!(
        !exists(&mut srv.conn(), KEYS.lock_bytes(b"wf")),
        "a failed acquire left the lock key behind"
    );
}

#[test]
fn foreign_lock_without_ttl_is_held_not_an_error() {
    let srv = RedisServer::start();
    let c = client(&srv);
    let () = redis::cmd("SET")
        .arg(KEYS.lock_bytes(b"ft"))
        .arg("someone-else")
        .query(&mut srv.conn())
        .unwrap();
    assert!(c.try_lock("ft").unwrap_err().is_would_block());
    let started = Instant::now();
    let e = c.try_lock_for("ft", ms(300)).expect_err("held for ever");
    assert!(e.is_timeout(), "{e:?}");
    let took = started.elapsed();
    assert!(took < Duration::from_secs(3), "{took:?}");
    let v: String = redis::cmd("GET")
        .arg(KEYS.lock_bytes(b"ft"))
        .query(&mut srv.conn())
        .unwrap();
    assert_eq!(v, "someone-else", "never touched");
}
