//! Edge values of every `Duration` and `Instant` the public API takes: `ZERO`, 1 ns,
//! `Duration::MAX`, and an `Instant` as far in the future as the platform can hold.
//!
//! Each one is either accepted with a documented meaning, or rejected with a typed error
//! naming the setting (`Error::InvalidConfig`) or the argument (`Error::InvalidArgument`);
//! none panics. Every case runs under `catch_unwind`, and accepted client settings are also
//! exercised with a contended `try_lock_for`, where some of them used to panic.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::thread;
use std::time::{Duration, Instant};

use redbaton::{Builder, Error, LockClient, Wakeup};
use redbaton_testkit::lock_builder;
use redbaton_testkit::server::RedisServer;
use redbaton_testkit::test_server;
use redbaton_testkit::wait::wait_until;
use redbaton_testkit::{init_log, ms};

const PREFIX: &str = "edges:";
const NS: Duration = Duration::from_nanos(1);
const MAX: Duration = Duration::MAX;
const ZERO: Duration = Duration::ZERO;

/// What a case must do.
#[derive(Debug, Clone, Copy)]
enum Expect {
    /// Not an input error: `Ok`, or a runtime error (a 1 ns timeout may well time out).
    Valid,
    /// `InvalidConfig` or `InvalidArgument` whose message contains this.
    Invalid(&'static str),
}

fn check<T>(what: &str, expect: Expect, run: impl FnOnce() -> Result<T, Error>) -> Option<T> {
    let outcome = catch_unwind(AssertUnwindSafe(run));
    let result = match outcome {
        Ok(r) => r,
        Err(_) => panic!("{what}: panicked"),
    };
    match (expect, result) {
        (Expect::Valid, Ok(v)) => Some(v),
        (Expect::Valid, Err(e)) => {
            assert!(!e.is_invalid_input(), "{what}: rejected as input: {e}");
            eprintln!("{what}: accepted, then {e}");
            None
        }
        (
            Expect::Invalid(needle),
            Err(e @ (Error::InvalidConfig(_) | Error::InvalidArgument(_))),
        ) => {
            assert!(e.to_string().contains(needle), "{what}: {e}");
            None
        }
        (Expect::Invalid(_), Err(e)) => panic!("{what}: expected an input error, got {e:?}"),
        (Expect::Invalid(_), Ok(_)) => panic!("{what}: expected an input error, it was accepted"),
    }
}

fn builder(srv: &RedisServer) -> Builder {
    lock_builder!(
        node(srv.url()),
        key_prefix(PREFIX),
        connect_timeout(Duration::from_secs(2))
    )
}

/// The latest `Instant` the platform can represent, about.
fn far_future() -> Instant {
    let now = Instant::now();
    (20..63)
        .rev()
        .find_map(|bits| now.checked_add(Duration::from_secs(1 << bits)))
        .expect("an instant some years ahead")
}

#[test]
fn every_builder_setting_at_its_edges() {
    let srv = test_server();
    let holder = builder(&srv).build().unwrap();
    type Set = fn(Builder, Duration) -> Builder;
    let settings: [(&str, Set); 9] = [
        ("lease", |b, d| b.lease(d)),
        ("connect timeout", |b, d| b.connect_timeout(d)),
        ("read timeout", |b, d| b.read_timeout(d)),
        ("write timeout", |b, d| b.write_timeout(d)),
        ("recheck interval", |b, d| b.recheck_interval(d)),
        ("renew interval", |b, d| b.renew_interval(d)),
        ("max hold", |b, d| b.max_hold(d)),
        ("handoff slice", |b, d| b.handoff_slice(d)),
        ("polling interval", |b, d| b.wakeup(Wakeup::Polling(d))),
    ];
    // Per value (ZERO, 1 ns, MAX). The lease is 10 ms ..= 24 h; a cap is positive and MAX
    // means no cap (for the handoff slice: only the handoff count bounds a run); every
    // timeout or interval is positive and at most 24 h.
    let expected = |what: &'static str| match what {
        "lease" => [Expect::Invalid(what); 3],
        "max hold" | "handoff slice" => [Expect::Invalid(what), Expect::Valid, Expect::Valid],
        _ => [Expect::Invalid(what), Expect::Valid, Expect::Invalid(what)],
    };
    let mut n = 0;
    for (setting, set) in settings {
        for (value, expect) in [ZERO, NS, MAX].into_iter().zip(expected(setting)) {
            n += 1;
            let what = format!("{setting} = {value:?}");
            let name = format!("b{n}");
            let Some(client) = check(&what, expect, || set(builder(&srv), value).build()) else {
                continue;
            };
            // The accepted client must survive a contended wait and a free lock.
            let held = holder.lock(&name).unwrap();
            let waited = check(
                &format!("{what}: contended try_lock_for"),
                Expect::Valid,
                || client.try_lock_for(&name, ms(100)).map(drop),
            );
            assert!(waited.is_none(), "{what}: got a lock that was held");
            drop(held);
            check(&format!("{what}: free try_lock_for"), Expect::Valid, || {
                client.try_lock_for(&name, ms(500)).map(drop)
            });
            check(&format!("{what}: drop"), Expect::Valid, || {
                drop(client);
                Ok(())
            });
        }
    }
}

#[test]
fn every_method_taking_a_duration_or_instant_at_its_edges() {
    let srv = test_server();
    let client = builder(&srv).build().unwrap();
    let other = builder(&srv).build().unwrap();
    let far = far_future();

    // Free lock: every deadline, however short or long, gets one attempt at least.
    for (what, timeout) in [("ZERO", ZERO), ("1 ns", NS), ("MAX", MAX)] {
        check(
            &format!("try_lock_for({what}), free"),
            Expect::Valid,
            || client.try_lock_for("free", timeout).map(drop),
        )
        .expect("a free lock is taken");
    }
    for (what, deadline) in [("now", Instant::now()), ("far future", far)] {
        check(
            &format!("try_lock_until({what}), free"),
            Expect::Valid,
            || client.try_lock_until("free", deadline).map(drop),
        )
        .expect("a free lock is taken");
    }

    // Held elsewhere: the short ones time out, the endless ones wait for the release.
    let held = other.lock("held").unwrap();
    for (what, timeout) in [("ZERO", ZERO), ("1 ns", NS)] {
        let r = catch_unwind(AssertUnwindSafe(|| client.try_lock_for("held", timeout)));
        let e = r.expect("no panic").expect_err("held elsewhere");
        assert!(e.is_timeout(), "try_lock_for({what}), held: {e:?}");
    }
    let r = catch_unwind(AssertUnwindSafe(|| {
        client.try_lock_until("held", Instant::now())
    }));
    assert!(r.expect("no panic").expect_err("held").is_timeout());
    drop(held);
    type Wait = fn(&LockClient, Instant) -> Result<(), Error>;
    let endless: [(&str, Wait); 2] = [
        ("try_lock_for(MAX)", |c, _| {
            c.try_lock_for("held", MAX).map(drop)
        }),
        ("try_lock_until(far future)", |c, far| {
            c.try_lock_until("held", far).map(drop)
        }),
    ];
    for (what, wait) in endless {
        let held = other.lock("held").unwrap();
        let c = client.clone();
        let t = thread::spawn(move || catch_unwind(AssertUnwindSafe(|| wait(&c, far))));
        thread::sleep(ms(300));
        drop(held);
        let finished = wait_until(Duration::from_secs(10), || t.is_finished());
        assert!(finished, "{what}: never woke after the release");
        t.join()
            .unwrap()
            .unwrap_or_else(|_| panic!("{what}: panicked"))
            .unwrap_or_else(|e| panic!("{what}: {e}"));
    }

    // extend takes the builder's lease range, 10 ms ..= 24 h.
    let guard = client.lock("extend").unwrap();
    for (value, expect) in [
        (ZERO, Expect::Invalid("lease")),
        (NS, Expect::Invalid("lease")),
        (ms(9), Expect::Invalid("lease")),
        (
            Duration::from_secs(24 * 3600) + NS,
            Expect::Invalid("lease"),
        ),
        (MAX, Expect::Invalid("lease")),
        (Duration::from_secs(24 * 3600), Expect::Valid),
    ] {
        check(&format!("extend({value:?})"), expect, || {
            guard.extend(value)
        });
    }
    // The shortest lease on a lock of its own: one that lives 10 ms may end before the
    // next call, on a loaded machine.
    let short = client.lock("extend-short").unwrap();
    check("extend(10ms)", Expect::Valid, || short.extend(ms(10)));
    drop(short);
    let e = guard.extend(MAX).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
    assert!(e.is_invalid_input());
    let pttl: i64 = redis::cmd("PTTL")
        .arg(format!("{PREFIX}{{extend}}"))
        .query(&mut srv.conn())
        .unwrap();
    assert!(
        pttl > 23 * 3600 * 1000,
        "the last valid extend holds: {pttl}"
    );
    guard.unlock().unwrap();
}

#[test]
fn errors_name_their_cause_once() {
    init_log();
    // Nothing listens on port 1.
    let e = LockClient::builder()
        .node("redis://127.0.0.1:1/")
        .connect_timeout(ms(500))
        .build()
        .unwrap_err();
    let source = std::error::Error::source(&e).expect("the redis error is the source");
    let cause = source.to_string();
    assert!(
        !e.to_string().contains(&cause),
        "the message repeats its source: {e} / {cause}"
    );
    assert!(e.is_connection());
}
